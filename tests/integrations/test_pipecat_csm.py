"""csmserve.integrations.pipecat.CSMTTSService in Pipecat's own test pipeline (pipecat.tests.utils.run_test),
against a dummy-tiny csmserve: one conversation, the user's audio as context, interruptions cut at what
was played."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("pipecat", reason="pip install 'csmserve[pipecat]'")

from pipecat.frames.frames import (  # noqa: E402
    InputAudioRawFrame, InterruptionFrame, LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMTextFrame,
    TranscriptionFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame, TTSTextFrame, UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame)
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from csmserve.integrations.pipecat import CSMTTSService  # noqa: E402
from helpers import chunks, greedy, hold_from, session_codes, settle, tone, user_codes  # noqa: E402

FRAME_BYTES = 1920 * 2


def user_turn(pcm: bytes, text: str | None) -> list:
    frames = [UserStartedSpeakingFrame()]
    frames += [InputAudioRawFrame(audio=c, sample_rate=16_000, num_channels=1) for c in chunks(pcm)]
    frames.append(UserStoppedSpeakingFrame())
    if text is not None:
        frames.append(TranscriptionFrame(text, "user-1", "now"))
    return frames


def reply(*pieces: str) -> list:
    return [LLMFullResponseStartFrame(), *[LLMTextFrame(p) for p in pieces], LLMFullResponseEndFrame()]


def script(*parts):
    """Frames for run_test, in order; a callable in place of a frame waits (20 ms sleeps) until it is true,
    so the next turn starts when the last has ended however slow the machine is, not after a fixed sleep."""
    for part in parts:
        if callable(part):
            deadline = time.monotonic() + 30
            while not part() and time.monotonic() < deadline:
                yield SleepFrame(0.02)
        else:
            yield part


def reply_done(server, n: int):
    return lambda: len(server.built) >= n and all(b.reason is not None for b in server.built[:n])


class StepClock:
    """The playout's clock: 0 while the reply's audio is handed on (it all comes at once, however slowly this
    machine generates it), `later` once the script says `go` (just before the interruption), so "played" is exact
    whatever the machine's speed."""

    def __init__(self, later: float) -> None:
        self.later, self.now = later, 0.0

    def __call__(self) -> float:
        return self.now

    def go(self) -> bool:  # a script step: true at once
        self.now = self.later
        return True


def service(server, **kw) -> CSMTTSService:
    kw.setdefault("max_segment_length_ms", kw.get("max_audio_length_ms", 240))  # per sentence
    return CSMTTSService(url=server.url, voice="alloy", temperature=0, **kw)


def test_two_turns_each_hears_the_users_audio_and_its_own_earlier_reply(server, csm):
    user1, user2 = tone(0.8), tone(0.48, hz=330)  # 10 and 6 Mimi frames
    tts = service(server)
    frames = script(*user_turn(user1, "How are you?"), *reply("I am fine. ", "Thanks for asking!"),
                    reply_done(server, 1), SleepFrame(0.3), *user_turn(user2, "Tell me more."),
                    *reply("Sure. ", "Here is more."), reply_done(server, 2), SleepFrame(0.3))
    down, _ = asyncio.run(run_test(tts, frames_to_send=frames))
    assert len(server.built) == 2 and all(b.reason in ("eos", "length") for b in server.built)
    first, second = (b.turns() for b in server.built)
    u1, u2 = user_codes(csm, user1), user_codes(csm, user2)
    assert len(u1) == 10 and len(u2) == 6
    # turn 1's prompt: the user's turn (speaker 1, its transcript, its 10 frames), then the reply's text
    assert [(s, t, len(c)) for s, t, c in first] == [(1, "How are you?", 10), (0, "I am fine.", 0)]
    np.testing.assert_array_equal(first[0][2], u1)
    # turn 2's prompt: both user turns with their audio, and turn 1 as CSM generated it (its codes)
    assert [(s, t) for s, t, _ in second] == [(1, "How are you?"), (0, "I am fine."), (0, "Thanks for asking!"),
                                              (1, "Tell me more."), (0, "Sure.")]
    np.testing.assert_array_equal(second[0][2], u1)
    np.testing.assert_array_equal(second[3][2], u2)
    reply1 = np.concatenate([second[1][2], second[2][2]])
    assert len(reply1) == server.built[0].frames
    np.testing.assert_array_equal(reply1, session_codes(server, tts.conversation.context_id, index=0))
    # what Pipecat got: 24 kHz mono PCM, every frame, in two TTS runs with their text
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert all(f.sample_rate == 24_000 and f.num_channels == 1 for f in audio)
    assert sum(len(f.audio) for f in audio) == sum(b.frames for b in server.built) * FRAME_BYTES
    assert [type(f) for f in down if isinstance(f, (TTSStartedFrame, TTSStoppedFrame))] == [
        TTSStartedFrame, TTSStoppedFrame] * 2
    spoken = " ".join(f.text for f in down if isinstance(f, TTSTextFrame))
    assert "I am fine." in spoken and "Here is more." in spoken
    settle(csm)


def test_user_text_from_the_llm_context_and_preroll(server, csm):
    context = LLMContext([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}])
    tts = service(server, llm_context=context)
    early, speech = tone(0.24, hz=500), tone(0.56)  # the VAD confirms speech after its first 240 ms
    frames = script(*[InputAudioRawFrame(audio=c, sample_rate=16_000, num_channels=1) for c in chunks(early)],
                    *user_turn(speech, None), *reply("Hi there."), reply_done(server, 1), SleepFrame(0.3))
    asyncio.run(run_test(tts, frames_to_send=frames))
    (built,) = server.built
    turns = built.turns()
    assert [(s, t) for s, t, _ in turns] == [(1, "Hello?"), (0, "Hi there.")]
    np.testing.assert_array_equal(turns[0][2], user_codes(csm, early + speech))  # 0.8 s: the preroll kept
    settle(csm)


def test_interruption_while_generating_keeps_exactly_the_played_frames(server, csm):
    text = "A long answer that keeps on going for a good while."
    server.hold_after = 3  # chunks of 1 and 2 frames, then the stream waits: still generating at the barge-in
    tts = service(server, max_audio_length_ms=30 * 80, clock=(clock := StepClock(0.16)))  # 2 frames played by then
    frames = script(*reply(text), lambda: server.built and server.built[0].frames >= 3, SleepFrame(0.5), clock.go,
                    InterruptionFrame(), SleepFrame(0.3), *reply("Sorry."), lambda: len(server.built) >= 2,
                    SleepFrame(0.5))
    down, _ = asyncio.run(run_test(tts, frames_to_send=frames))
    (cut,) = tts.cuts
    generated = server.built[0].frames
    assert server.built[0].reason == "closed", (server.built[0].reason, server.built[0].frames)  # cancelled while generating: the slot was given back
    assert cut["played_ms"] == 160 and cut["num_frames"] == 2 < generated < 30, (cut, generated)
    np.testing.assert_array_equal(session_codes(server, tts.conversation.context_id, index=0),
                                  greedy(csm, text, 0, [], 2))  # the first two frames, as generated
    turns = server.built[1].turns()  # the next reply hears exactly those frames of the cut one
    assert [(s, t, len(c)) for s, t, c in turns] == [(0, text, 2), (0, "Sorry.", 0)]
    assert sum(len(f.audio) for f in down if isinstance(f, TTSAudioRawFrame)) >= 2 * FRAME_BYTES
    settle(csm)


def test_interruption_after_generation_truncates_the_reply_still_playing(server, csm):
    text = "A short answer."
    tts = service(server, max_audio_length_ms=10 * 80, clock=(clock := StepClock(0.32)))  # 4 of its frames played
    frames = script(*reply(text), reply_done(server, 1), SleepFrame(0.5), clock.go, InterruptionFrame(),
                    SleepFrame(0.3), *reply("Sorry."), reply_done(server, 2), SleepFrame(0.3))
    asyncio.run(run_test(tts, frames_to_send=frames))
    (cut,) = tts.cuts
    full = server.built[0].frames
    assert server.built[0].reason in ("eos", "length") and full > 4  # generated whole before the barge-in
    assert cut["played_ms"] == 320 and cut["num_frames"] == 4, cut
    np.testing.assert_array_equal(session_codes(server, tts.conversation.context_id, index=0),
                                  greedy(csm, text, 0, [], full)[:4])
    assert [(s, len(c)) for s, _, c in server.built[1].turns()] == [(0, 4), (0, 0)]
    settle(csm)


def test_a_reply_finished_before_the_barge_in_reached_the_server_is_truncated(server, csm):
    """The server finished the reply, but its flush_done was still on the wire when the user barged in: the
    cancel stops nothing there, and the reply is cut by a truncate at what was played instead."""
    text = "A short answer."
    tts = service(server, max_audio_length_ms=10 * 80, clock=(clock := StepClock(0.32)))  # 4 of its frames played
    held, release = hold_from(tts.conversation, "flush_done")

    def release_after_the_cancel() -> bool:
        if any(m.get("type") == "cancelled" for m in held):
            release()
            return True
        return False

    frames = script(*reply(text), reply_done(server, 1), lambda: held, SleepFrame(0.3), clock.go, InterruptionFrame(),
                    release_after_the_cancel, SleepFrame(0.3), *reply("Sorry."), reply_done(server, 2),
                    SleepFrame(0.3))
    asyncio.run(run_test(tts, frames_to_send=frames))
    (cut,) = tts.cuts
    full = server.built[0].frames
    assert server.built[0].reason in ("eos", "length") and full > 4
    assert cut["request_id"] == server.built[0].request_id and cut["played_ms"] == 320 and cut["num_frames"] == 4
    np.testing.assert_array_equal(session_codes(server, tts.conversation.context_id, index=0),
                                  greedy(csm, text, 0, [], full)[:4])
    assert [(s, len(c)) for s, _, c in server.built[1].turns()] == [(0, 4), (0, 0)]
    settle(csm)


def test_playout_model():
    from csmserve.integrations.playout import Playout

    t = [10.0]
    p = Playout(lambda: t[0])
    p.pushed("a", 5)  # a starts at 10.0, plays 400 ms
    t[0] = 10.1
    p.pushed("b", 3)  # b is queued after a: starts at 10.4
    assert p.played_ms("a") == 80 and p.played_ms("b") == 0
    t[0] = 10.5
    assert p.played_ms("a") == 400 and p.finished("a") and p.played_ms("b") == 80 and not p.finished("b")
    t[0] = 20.0
    assert p.played_ms("b") == 240 and p.finished("b")  # never more than was handed on
    p.pushed("c", 3)  # plays 20.0-20.24
    t[0] = 21.0
    p.pushed("c", 3)  # the next sentence came late: the player ran dry, it plays 21.0-21.24, not 20.24-20.48
    t[0] = 21.1
    assert p.played_ms("c") == 320 and not p.finished("c")
    p.pushed("c", 2)  # queued right after: 21.24-21.40
    t[0] = 21.3
    assert p.played_ms("c") == 80 * (3 + 3 + 0) and len(p._runs["c"].pieces) == 2
