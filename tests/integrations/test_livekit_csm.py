"""csmserve.integrations.livekit (TTS, ConversationAgent) through LiveKit Agents' own interfaces (the
TTS's SynthesizeStream, the Agent's stt_node / on_user_turn_completed hooks with LiveKit's speech events
and chat messages, an audio output's playback reports through the PlaybackTap) against a dummy-tiny
csmserve. test_livekit_session.py runs them in a real AgentSession."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("livekit.agents", reason="pip install 'csmserve[livekit]'")

from livekit import rtc  # noqa: E402
from livekit.agents import Agent, llm, stt  # noqa: E402

from csmserve.integrations.livekit import REPLY_KEY, TTS, ConversationAgent, PlaybackTap  # noqa: E402
from helpers import chunks, greedy, session_codes, settle, tone, user_codes  # noqa: E402
from livekit_session import Speaker  # noqa: E402


def frames_of(pcm: bytes) -> list[rtc.AudioFrame]:
    return [rtc.AudioFrame(c, 16_000, 1, len(c) // 2) for c in chunks(pcm)]


async def speak(tts: TTS, *pieces: str, stop_after_s: float | None = None, output=None) -> list[rtc.AudioFrame]:
    """One agent reply as AgentSession drives it: text pieces, end of input, frames out (to `output` too)."""
    out = []
    stream = tts.stream()
    for p in pieces:
        stream.push_text(p)
    stream.end_input()
    try:
        async for ev in stream:
            out.append(ev.frame)
            if output is not None:
                await output.capture_frame(ev.frame)
            if stop_after_s is not None and sum(f.duration for f in out) >= stop_after_s:
                break
    finally:
        await stream.aclose()
        if output is not None:
            output.flush()
    return out


async def user_says(agent: ConversationAgent, pcm: bytes, text: str, preroll: bytes = b"") -> None:
    """The user's turn through the Agent's hooks: the STT node sees the audio and reports speech start and
    end (a stand-in for Agent.default.stt_node, the session's STT), then the turn completes."""
    audio = frames_of(preroll) + frames_of(pcm)

    async def source():
        for f in audio:
            yield f

    events = [ev async for ev in agent.stt_node(source(), None)]
    assert [e.type for e in events] == [stt.SpeechEventType.START_OF_SPEECH, stt.SpeechEventType.FINAL_TRANSCRIPT,
                                        stt.SpeechEventType.END_OF_SPEECH]
    await agent.on_user_turn_completed(llm.ChatContext(), llm.ChatMessage(role="user", content=[text]))


@pytest.fixture
def fake_stt(monkeypatch):
    """Agent.default.stt_node replaced by an STT that hears every frame: START_OF_SPEECH once `skip` frames
    (the preroll) have gone by, then the transcript and END_OF_SPEECH when the audio ends."""
    state = {"skip": 0}

    async def stt_node(agent, audio, model_settings):
        n = 0
        async for _ in audio:
            n += 1
            if n == state["skip"] + 1:
                yield stt.SpeechEvent(type=stt.SpeechEventType.START_OF_SPEECH)
        yield stt.SpeechEvent(type=stt.SpeechEventType.FINAL_TRANSCRIPT,
                              alternatives=[stt.SpeechData(language="en", text="...")])
        yield stt.SpeechEvent(type=stt.SpeechEventType.END_OF_SPEECH)

    monkeypatch.setattr(Agent.default, "stt_node", stt_node)
    return state


def test_replies_hear_the_users_audio_and_the_earlier_replies(server, csm, fake_stt):
    user1, user2, early = tone(0.8), tone(0.48, hz=330), tone(0.24, hz=500)

    async def main():
        tts = TTS(base_url=server.url, voice="alloy", temperature=0, max_segment_length_ms=240)
        agent = ConversationAgent(instructions="Be brief.", tts=tts)
        await user_says(agent, user1, "How are you?")
        a1 = await speak(tts, "I am fine. ", "Thanks for ", "asking!")
        fake_stt["skip"] = len(frames_of(early))  # the STT confirms speech 240 ms late: the preroll keeps it
        await user_says(agent, user2, "Tell me more.", preroll=early)
        a2 = await speak(tts, "Sure. Here is more.")
        await tts.aclose()
        return tts, a1, a2

    tts, a1, a2 = asyncio.run(main())
    assert all(f.sample_rate == 24_000 and f.num_channels == 1 for f in a1 + a2)
    first, second = server.built
    for reply, b in ((a1, first), (a2, second)):
        samples = sum(f.samples_per_channel for f in reply)
        assert b.frames * 1920 <= samples <= b.frames * 1920 + 480  # every frame (the emitter pads the last)
    u1, u2 = user_codes(csm, user1), user_codes(csm, early + user2)
    assert len(u1) == 10 and len(u2) == 9
    t1 = first.turns()
    assert [(s, t, len(c)) for s, t, c in t1] == [(1, "How are you?", 10), (0, "I am fine.", 0)]
    np.testing.assert_array_equal(t1[0][2], u1)
    t2 = second.turns()  # both user turns' audio and the first reply as generated
    assert [(s, t) for s, t, _ in t2] == [(1, "How are you?"), (0, "I am fine."), (0, "Thanks for asking!"),
                                          (1, "Tell me more."), (0, "Sure.")]
    np.testing.assert_array_equal(t2[0][2], u1)
    np.testing.assert_array_equal(t2[3][2], u2)
    np.testing.assert_array_equal(np.concatenate([t2[1][2], t2[2][2]]),
                                  session_codes(server, tts.conversation.context_id, index=0))
    assert len(t2[1][2]) + len(t2[2][2]) == first.frames
    settle(csm)


def test_interruption_cuts_the_reply_at_the_playback_position(server, csm):
    text = "A long answer that keeps on going for a good while."

    server.chunk_delay = 0.05  # 30 frames in chunks of 2: still generating when the agent closes the stream

    async def main():
        tts = TTS(base_url=server.url, voice="alloy", temperature=0, max_audio_length_ms=30 * 80)
        speaker = Speaker()
        speaker.cut = {0: 0.27}  # 3 frames heard
        output = PlaybackTap(tts, speaker)
        got = await speak(tts, text, stop_after_s=0.48, output=output)  # 6 frames reached the agent; the barge-in
        settle_now = server.built[0].reason
        output.clear_buffer()  # the speaker stops: its report comes through the tap
        for _ in range(200):
            if tts.cuts:
                break
            await asyncio.sleep(0.02)
        after = await speak(tts, "Sorry.")
        await tts.aclose()
        return tts, got, settle_now, after

    tts, got, reason, _ = asyncio.run(main())
    assert {f.userdata[REPLY_KEY] for f in got} == {got[0].userdata[REPLY_KEY]}  # each frame says whose it is
    assert reason == "closed"  # cancelled at once: the slot was given back before the playback report
    assert tts.cuts == [{"request_id": server.built[0].request_id, "played_ms": 240, "num_frames": 3}]
    np.testing.assert_array_equal(session_codes(server, tts.conversation.context_id, index=0),
                                  greedy(csm, text, 0, [], 3))
    assert [(s, t, len(c)) for s, t, c in server.built[1].turns()] == [(0, text, 3), (0, "Sorry.", 0)]
    settle(csm)


def test_a_reply_played_to_the_end_is_kept_whole(server, csm):
    async def main():
        tts = TTS(base_url=server.url, voice="alloy", temperature=0, max_segment_length_ms=240)
        speaker = Speaker()
        await speak(tts, "All of it.", output=PlaybackTap(tts, speaker))
        await speak(tts, "Next.")
        await tts.aclose()
        return tts, speaker

    tts, speaker = asyncio.run(main())
    assert speaker.reports == [(0.24, False)] and tts.cuts == []
    first = server.built[0].frames
    assert [(s, len(c)) for s, _, c in server.built[1].turns()] == [(0, first), (0, 0)]
    settle(csm)


@pytest.mark.parametrize("max_replies", [2, 3])
def test_replies_awaiting_a_report_are_bounded(server, csm, max_replies):
    """A reply whose report never comes (spoken elsewhere) is forgotten once `max_replies` newer ones got
    audio: the oldest goes first, and a report about a forgotten reply cuts nothing."""

    async def main():
        tts = TTS(base_url=server.url, voice="alloy", temperature=0, max_audio_length_ms=3 * 80,
                  max_replies=max_replies)
        speaker = Speaker()
        speaker.cut = {0: 0.08}
        output = PlaybackTap(tts, speaker)
        await speak(tts, "Played here.", output=output)  # at the speaker, still playing
        tracked = [len(tts._replies)]
        for text in ("Spoken elsewhere.", "And again."):
            await speak(tts, text)
            tracked.append(len(tts._replies))
        output.clear_buffer()  # the report on the first reply, 80 ms played
        await asyncio.sleep(0.05)
        await asyncio.gather(*tts._tasks)  # the cut, if any, is sent and answered
        await tts.aclose()
        return tts, tracked

    tts, tracked = asyncio.run(main())
    assert tracked == [1, 2, min(3, max_replies)]
    with pytest.raises(ValueError, match="max_replies must be at least 1"):
        TTS(base_url=server.url, max_replies=0)
    if max_replies == 2:  # forgotten: nothing to cut
        assert tts.cuts == []
    else:
        assert tts.cuts == [{"request_id": server.built[0].request_id, "played_ms": 80, "num_frames": 1}]
    settle(csm)
