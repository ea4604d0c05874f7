"""schemathesis over /openapi.json, every route: schema-valid and schema-violating requests (seeded,
bounded) never get a 5xx, and every error is OpenAI's shape with a non-null code; afterwards the server
still speaks and still holds its stored voice. CPU, dummy-tiny: well under 2 minutes on 2 cores."""
import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from csmserve.config import ServerConfig
from csmserve.server import create_app
from server_helpers import Server, wav_bytes

EXAMPLES = {"POST /v1/audio/speech": 150, "POST /v1/audio/voices": 80}  # per mode; other routes: 40
# smallest normal / subnormal float32, just under GREEDY_BELOW, the schema's ends
FLOAT32_EDGES = [1.175494351e-38, 1.401298464e-45, 5e-38, 9.99e-6, 1e-5, 0.0, 2.0, 1.0, 3.4028234e38 / 1.7e38]
CANARY = "canary-voice-7f3a9c"  # a name fuzzing will not guess (GET/DELETE also take names)


@pytest.fixture(scope="module")
def fuzz_server(csm, tmp_path_factory):
    # small caps keep each 200 cheap: <= 10 frames of audio, short inputs (long input is many sentences)
    config = ServerConfig(voices_db=str(tmp_path_factory.mktemp("fuzz") / "voices.db"), max_audio_length_ms=800,
                          default_audio_length_ms=240, max_input_chars=200, max_clip_seconds=5.0)
    server = Server(create_app(csm, config)).start()
    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": CANARY, "transcript": "A tone."},
                   files={"audio_sample": ("a.wav", wav_bytes(1.0), "audio/wav")}, timeout=60)
    assert r.status_code == 200, r.text
    server.canary = r.json()["id"]
    yield server
    server.stop()


# the document the server serves, built without a model (create_app answers /openapi.json before loading)
SCHEMA = schemathesis.openapi.from_dict(create_app(None, ServerConfig(voices_db=":memory:")).openapi())
OPERATIONS = {op.label: op for op in (r.ok() for r in SCHEMA.get_all_operations())}
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@schemathesis.check
def openai_error_shape(ctx, response, case):
    """Any status >= 400: {"error": {"message", "type", "param", "code"}}, code a non-empty string."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["code"], str) and err["code"], err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err
    return True


def test_every_route_is_fuzzed():
    assert len(OPERATIONS) >= 10 and "POST /v1/audio/speech" in OPERATIONS and "POST /v1/audio/voices" in OPERATIONS


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_5xx_and_every_error_in_openai_shape(fuzz_server, label, mode):
    statuses: Counter = Counter()

    @settings(max_examples=EXAMPLES.get(label, 40), derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=OPERATIONS[label].as_strategy(generation_mode=mode))
    def run(case):
        # every other one made to pass the first check, so the fuzzed values reach the engine / the decoder
        statuses["cases"] += 1
        if isinstance(case.body, dict) and statuses["cases"] % 2:
            if label == "POST /v1/audio/speech":
                case.body["voice"] = "alloy"
                if statuses["cases"] % 4 == 1:  # float32 edges hypothesis rarely draws (the sampler runs in float32)
                    case.body["temperature"] = FLOAT32_EDGES[statuses["cases"] // 4 % len(FLOAT32_EDGES)]
                    case.body["top_p"] = FLOAT32_EDGES[::-1][statuses["cases"] // 4 % len(FLOAT32_EDGES)] or 1.0
            elif label == "POST /v1/audio/voices":
                case.body["audio_sample"] = wav_bytes(0.5)
        response = case.call(base_url=fuzz_server.url, timeout=60)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error, openai_error_shape])

    try:
        run()
    except Unsatisfiable:  # negative mode, nothing in the operation can be violated (a free-form path string)
        assert mode is GenerationMode.NEGATIVE
    print(label, mode.value, dict(statuses))
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200


def test_after_fuzzing_the_server_still_serves(fuzz_server):
    body = {"model": "tts-1", "voice": fuzz_server.canary, "input": "Still here.", "response_format": "pcm",
            "max_audio_length_ms": 160}
    r = httpx.post(f"{fuzz_server.url}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200 and len(r.content) == 2 * 1920 * 2
    assert httpx.get(f"{fuzz_server.url}/v1/audio/voices/{fuzz_server.canary}").json()["name"] == CANARY
