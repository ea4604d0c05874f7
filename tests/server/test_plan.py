"""ServerState.plan: a speech request's one call into the state (input checked, voices and context resolved,
caps sized, the Request built) -> a SpeechPlan the route only streams. Without an engine (an attached CSM)."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from csmserve.api import CSM, TextFeed
from csmserve.config import EngineConfig, ServerConfig
from csmserve.engine.messages import EngineInfo
from csmserve.server.errors import APIError
from csmserve.server.schemas import SpeechRequest
from csmserve.server.state import RequestArgs, ServerState, SpeechPlan
from csmserve.voices.sqlite import VoiceStore


@pytest.fixture
def state(tmp_path):
    info = EngineInfo("dummy", None, 32, 2051, 512, 1920, True, EngineConfig(max_seq_len=512))
    csm = CSM.attach(SimpleNamespace(info=info, fatal=None))
    return ServerState(csm, ServerConfig(max_input_chars=300, mp3_compression_level=7), VoiceStore(tmp_path / "v.db"))


def plan(state, **body) -> SpeechPlan:
    return asyncio.run(state.plan(SpeechRequest.model_validate({"model": "tts-1", "voice": "alloy", **body})))


def test_every_request_choice_is_a_keyword_of_every_builder():
    """A field added to RequestArgs (one more per-request choice) reaches every builder through kw()."""
    names = {f.name for f in dataclasses.fields(RequestArgs)} | {"fit_cap"}
    for builder in (CSM.request, CSM.long_request, CSM.history_overflow):  # TextFeed.open: long_request's
        assert names <= set(inspect.signature(builder).parameters), builder
    assert list(inspect.signature(TextFeed.open).parameters) == ["self", "speaker", "kw"]


def test_plain_input_plans_the_request_its_script_and_encoder(state):
    p = plan(state, input="Hi there. How are you?", voice="ash", temperature=0, seed=3, response_format="mp3",
             speed=1.5, max_segment_length_ms=400)
    want = state.csm.long_request(["Hi there.", "How are you?"], **p.args.kw())
    np.testing.assert_array_equal(p.request.tokens, want.tokens)
    assert (p.args.speaker, p.args.temperature, p.args.seed, p.args.max_segment_length_ms) == (1, 0, 3, 400)
    assert p.script.texts == ["Hi there.", "How are you?"] and p.script.speakers == [1, 1]
    assert p.spans == [(0, 9), (10, 22)] and not p.dialogue
    assert (p.response_format, p.speed, p.codec_options) == ("mp3", 1.5, {"compression_level": "7"})
    assert state.last_prompt[0] is p.request.tokens
    one = plan(state, input="Hello.", max_segment_length_ms=240)  # one sentence: its cap caps the whole
    assert not one.request.segments
    assert (one.args.max_audio_length_ms, one.args.max_segment_length_ms) == (240, None)


def test_dialogue_plans_one_long_form_request_with_each_speaker(state):
    p = plan(state, input="[S1] Hello there. [S2] Hi! [S1] Bye.", temperature=0)
    assert p.dialogue and p.script.texts == ["Hello there.", "Hi!", "Bye."]
    assert (p.script.speakers, p.script.lines) == ([0, 1, 0], [0, 1, 2])
    assert len(p.request.segments) == 2 and p.args.speaker == 0


@pytest.mark.parametrize("body, status, code, param", [
    ({"input": " "}, 400, "empty_input", "input"),
    ({"input": "x" * 301}, 400, "input_too_long", "input"),
    ({"input": "Hi.", "voice": "nobody"}, 404, "voice_not_found", "voice"),
    ({"input": "[S1] Hi.", "voices": ["nobody"]}, 404, "voice_not_found", "voices"),
    ({"input": "Hi.", "max_audio_length_ms": 10**7}, 400, "invalid_value", "max_audio_length_ms"),
])
def test_bad_requests_are_refused_in_the_plan(state, body, status, code, param):
    with pytest.raises(APIError) as e:
        plan(state, **body)
    assert (e.value.status, e.value.code, e.value.param) == (status, code, param)
