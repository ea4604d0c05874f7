"""Dialogues: a multi-speaker script in one long-form request, each line conditioned on the audio of the
lines before it (csmserve/prompt/dialogue.py, CSM.dialogue; CPU, dummy-tiny, greedy)."""
from __future__ import annotations

import numpy as np
import pytest

from csmserve import CSM, Segment
from csmserve.models import reference
from csmserve.config import EngineConfig
from csmserve.prompt.dialogue import Line, cast, is_tagged, parse_tagged, read_script, segments
from csmserve.sampling import SamplingParams

SCRIPT = "[S1] Hi there. How are you? [S2] Fine, thanks! [S1] Good. [S2] Bye now."
MS = 4 * 80  # 4 frames per sentence at most: quick on the CPU


def test_parse_tagged_and_read_script():
    lines = parse_tagged(SCRIPT, ["narrator"])
    assert [(ln.speaker, ln.voice, ln.text) for ln in lines] == [
        (0, "narrator", "Hi there. How are you?"), (1, None, "Fine, thanks!"), (0, "narrator", "Good."),
        (1, None, "Bye now.")]
    assert is_tagged("  [S2] x") and not is_tagged("Hello [S1]")
    assert read_script('[{"text": "a", "voice": "v"}, {"text": "b", "speaker": 3}]') == [
        Line("a", None, "v"), Line("b", 3, None)]
    assert read_script(SCRIPT) == parse_tagged(SCRIPT)
    for bad, match in [("Hello [S1] x", "starts with a speaker tag"), ("[S1]  [S2] ", "no text"),
                       ("[S0] x", r"\[S1\] to"), ('[{"speaker": 1}]', "line 0"), ('[{"text": "a", "speaker": 999}]',
                                                                                  "0..255")]:
        with pytest.raises(ValueError, match=match):
            read_script(bad)


def test_cast_gives_each_voice_its_own_speaker_id():
    lines = [Line("a", voice="ann"), Line("b", voice="bob"), Line("c", speaker=0), Line("d"), Line("e", voice="ann")]
    filled, c = cast(lines, default_voice="alloy")
    # speaker 0 is named by a line, so the voices take 1, 2, 3 in order of first appearance
    assert c.voices == {"ann": 1, "bob": 2, "alloy": 3} and c.speakers == [1, 2, 0, 3, 1]
    assert filled[3].voice == "alloy"
    assert [(i, s, t) for i, s, t in segments([Line("One. Two."), Line("Three.")], [0, 1])] == [
        (0, 0, "One."), (0, 0, "Two."), (1, 1, "Three.")]


@pytest.fixture(scope="module")
def csm():
    c = CSM("dummy-tiny", device="cpu", dtype="float32", engine_config=EngineConfig(max_slots=2, max_seq_len=512))
    yield c
    c.close()


def test_each_line_sees_the_earlier_lines_codes_with_their_speaker_ids(csm):
    """The engine's stream equals, segment by segment, the reference generator on the prompt that holds
    the voice clips, then every earlier segment's text with ITS speaker id and its generated codes."""
    rng = np.random.default_rng(0)
    clips = [Segment(0, "I am the first voice.", codes=rng.integers(0, 2048, (6, 32))),
             Segment(1, "And I the second.", codes=rng.integers(0, 2048, (5, 32)))]
    lines = parse_tagged(SCRIPT)
    script = [(ln.speaker, ln.text) for ln in lines]
    segs = segments(lines, [s for s, _ in script])
    sampling = dict(temperature=0.0, max_segment_length_ms=MS)  # per segment; the whole has no cap
    chunks = list(csm.dialogue(script, context=clips, **sampling))
    assert chunks[-1].final and [c.frame_start for c in chunks] == list(
        np.cumsum([0] + [len(c.codes) for c in chunks[:-1]]))  # one continuous stream
    got = [np.zeros((0, 32), np.int64) for _ in segs]
    for c in chunks:
        got[c.segment] = np.concatenate([got[c.segment], c.codes])
        assert c.text == segs[c.segment][2]
    params = SamplingParams(temperature=0.0, max_audio_length_ms=MS, seed=1)
    earlier: list[Segment] = []
    for i, (_, speaker, text) in enumerate(segs):
        tokens, mask = csm.prompt(text, speaker, clips + earlier)
        want = reference.generate(csm.model, tokens, mask, params).codes
        np.testing.assert_array_equal(got[i], want, err_msg=f"segment {i} ({speaker}: {text})")
        assert len(want) > 0
        earlier.append(Segment(speaker, text, codes=got[i]))


def test_the_request_carries_each_segments_speaker_in_its_text_frames(csm):
    texts, speakers = ["Hi.", "Hello!", "Bye."], [0, 1, 0]
    req = csm.long_request(texts, context=[], speakers=speakers)
    first = bytes(int(t) for t in req.tokens[req.context_len:, -1][1:-1]).decode()  # the byte tokenizer
    later = [bytes(int(t) for t in tokens[1:-1, -1]).decode() for tokens, _ in req.segments]
    assert [first, *later] == ["[0]Hi.", "[1]Hello!", "[0]Bye."]
    with pytest.raises(ValueError, match="speakers"):
        csm.long_request(texts, speakers=[0, 1])
