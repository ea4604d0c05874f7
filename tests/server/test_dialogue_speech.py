"""POST /v1/audio/speech with a dialogue: `input` as lines or an [S1]/[S2] script, one stream; each
speaker's stored clip first as the id it has in the dialogue, each line with its own speaker id."""
import base64

import httpx
import pytest
import numpy as np

from csmserve.api import Segment
from server_helpers import error_of
from test_speech import sse_events
from test_voice_routes import create

pytestmark = pytest.mark.inproc  # reads the prompts the routes built in server.state

MS = 3 * 80


class Built:
    """A Request as the route built it (the engine rewrites tokens and segments as it goes)."""

    def __init__(self, request) -> None:
        self.tokens, self.context_len = request.tokens.copy(), request.context_len
        self.segments = [(t.copy(), m.copy()) for t, m in request.segments]


def capture(server) -> list[Built]:
    """The Requests the route builds (ServerState.stream's argument)."""
    seen, stream = [], server.state.stream
    server.state.stream = lambda request, *a, **kw: (seen.append(Built(request)), stream(request, *a, **kw))[1]
    return seen


def post(server, **body):
    body = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "temperature": 0,
            "max_segment_length_ms": MS, **body}
    return httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)


def text_of(tokens: np.ndarray) -> str:
    return bytes(int(t) for t in tokens[1:-1, -1]).decode()  # dummy-tiny's byte tokenizer; bos/eos cut


def test_lines_with_stored_voices_build_one_request_with_each_speaker(server, csm):
    ann = create(server.url, name="ann", transcript="I am Ann.", speaker="0").json()
    bob = create(server.url, name="bob", transcript="I am Bob.", speaker="0").json()  # both stored as speaker 0
    seen = capture(server)
    lines = [{"voice": "ann", "text": "Hi Bob. How are you?"}, {"voice": {"id": bob["id"]}, "text": "Fine!"},
             {"voice": "ann", "text": "Good."}]
    r = post(server, input=lines)
    assert r.status_code == 200, r.text
    (req,) = seen
    store = server.state.store
    clips = [Segment(0, "I am Ann.", codes=store.get(ann["id"]).codes),  # ann: id 0, bob: id 1 (distinct)
             Segment(1, "I am Bob.", codes=store.get(bob["id"]).codes)]
    want = csm.long_request(["Hi Bob.", "How are you?", "Fine!", "Good."], context=clips, speakers=[0, 0, 1, 0],
                            max_segment_length_ms=MS)
    np.testing.assert_array_equal(req.tokens, want.tokens)  # the clips, then the first line's first sentence
    assert [text_of(t) for t, _ in req.segments] == ["[0]How are you?", "[1]Fine!", "[0]Good."]
    assert req.context_len == want.context_len and len(r.content) % (1920 * 2) == 0 and r.content


def test_tagged_script_with_voices_streams_segment_events_per_line(server):
    create(server.url, name="narrator", transcript="The narrator speaks.", speaker="4")
    seen = capture(server)
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60, json={
            "model": "tts-1", "voice": "alloy", "input": "[S1] Hello there. [S2] Hi! [S1] Bye.",
            "voices": ["narrator"], "response_format": "pcm", "stream_format": "sse", "temperature": 0,
            "max_segment_length_ms": MS, "add_timestamps": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    segs = [e for e in events if e["type"] == "speech.audio.segment"]
    assert [(e["line"], e["speaker"], e["text"]) for e in segs] == [(0, 0, "Hello there."), (1, 1, "Hi!"),
                                                                    (2, 0, "Bye.")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert len(audio) == segs[-1]["audio_end_ms"] * 48
    (req,) = seen  # the narrator's clip is in the prompt as [S1]'s speaker id, 0
    first_turn = req.tokens[: list(req.tokens[:, -1]).index(257) + 1]
    assert text_of(first_turn) == "[0]The narrator speaks."


def test_dialogue_errors_are_400_naming_the_field(server):
    for body, code in [({"input": []}, "invalid_value"), ({"input": "[S1]   "}, "invalid_value"),
                       ({"input": [{"speaker": 1}]}, "missing_required_parameter"),
                       ({"input": [{"text": "x", "speaker": 300}]}, "invalid_value")]:
        r = post(server, **body)
        assert r.status_code == 400, (body, r.text)
        assert error_of(r)["param"].startswith("input"), r.text
    r = post(server, input=[{"text": "x", "voice": "nobody"}])
    assert r.status_code == 404 and error_of(r)["code"] == "voice_not_found"
    r = post(server, input=[{"text": "x" * 3000}, {"text": "y" * 3000}])
    assert r.status_code == 400 and error_of(r)["code"] == "input_too_long"
