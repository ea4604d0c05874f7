"""CSM.speak / aspeak: long text in one slot as one continuous stream (CPU, dummy-tiny with its Mimi)."""
import asyncio

import numpy as np
import pytest

from csmserve import CSM
from csmserve.config import EngineConfig
from csmserve.prompt.segments import split_sentences

SENTENCES = " ".join(f"Sentence number {i} is here." for i in range(20))


@pytest.fixture(scope="module")
def csm():
    c = CSM("dummy-tiny", engine_config=EngineConfig(max_slots=2, max_seq_len=512, first_chunk_frames=1,
                                                     chunk_frames=2))
    yield c
    c.close()


def test_twenty_sentences_make_one_seamless_stream(csm):
    chunks = list(csm.speak(SENTENCES, temperature=0.0, max_audio_length_ms=3 * 80))
    texts = split_sentences(SENTENCES)
    assert len(texts) == 20 and chunks[-1].final
    codes = np.concatenate([c.codes for c in chunks])
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.shape == (len(codes) * 1920,)  # nothing inserted at the seams
    for c in chunks:
        assert len(c.audio) == len(c.codes) * 1920 and c.text == texts[c.segment]
    assert [c.frame_start for c in chunks] == list(np.cumsum([0] + [len(c.codes) for c in chunks[:-1]]))
    per_seg = np.bincount([c.segment for c in chunks for _ in range(len(c.codes))], minlength=20)
    assert per_seg.sum() == len(codes) and (per_seg <= 3).all()
    assert sorted({c.segment for c in chunks if len(c.codes)}) == [s for s in range(20) if per_seg[s]]
    # the codec state ran on across segments: the streamed audio is the one-shot decode of all the codes
    np.testing.assert_allclose(audio, csm.decode(codes), atol=1e-4)


def test_text_in_pieces_gives_the_same_codes_as_whole(csm):
    text = "Hello there, my friend. This is a test of streaming! Does it work? Yes."
    whole = list(csm.speak(text, temperature=0.0, max_audio_length_ms=3 * 80))
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    streamed = list(csm.speak(iter(pieces), temperature=0.0, max_audio_length_ms=3 * 80))
    np.testing.assert_array_equal(np.concatenate([c.codes for c in streamed]),
                                  np.concatenate([c.codes for c in whole]))
    assert [(c.segment, c.text) for c in streamed] == [(c.segment, c.text) for c in whole]

    async def agen():
        for p in pieces:
            await asyncio.sleep(0.001)
            yield p

    async def collect():
        return [c async for c in csm.aspeak(agen(), temperature=0.0, max_audio_length_ms=3 * 80)]

    np.testing.assert_array_equal(np.concatenate([c.codes for c in asyncio.run(collect())]),
                                  np.concatenate([c.codes for c in whole]))
