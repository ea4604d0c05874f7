"""csmserve.integrations.livekit in a real livekit-agents AgentSession (no room: a microphone, an STT, an
LLM and a speaker standing in for the room's, livekit_session.py) against a dummy-tiny csmserve, watching
the WebSocket: each interruption cuts the reply the speaker was playing, at the position it reported,
whatever else the TTS spoke (`synthesize()` outside the session's output) and whatever never reached the
speaker."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

pytest.importorskip("livekit.agents", reason="pip install 'csmserve[livekit]'")

from csmserve.integrations.livekit import TTS, ConversationAgent  # noqa: E402
from helpers import hold_from, settle, tone, until  # noqa: E402
from livekit_session import session, watch  # noqa: E402

FRAMES = 5  # each reply and greeting: 400 ms


async def drain(stream) -> int:
    """A `synthesize()` the app plays itself (not through the session's output): its samples."""
    n = 0
    async for ev in stream:
        n += ev.frame.samples_per_channel
    await stream.aclose()
    return n


def cuts(log: list[dict]) -> list[tuple[str, str, int]]:
    """The cuts sent: ("truncate", request_id, audio_end_ms) and ("cancel", "", audio_end_ms)."""
    out = []
    for e in log:
        m = e.get("sent", {})
        if m.get("truncate"):
            out.append(("truncate", m["request_id"], m["audio_end_ms"]))
        elif m.get("cancel"):
            out.append(("cancel", "", m.get("audio_end_ms")))
    return out


@contextlib.asynccontextmanager
async def talk(server, texts: list[str], replies: list[list[str]], cut: dict[int, float], **kw):
    """The TTS against `server` in a session (livekit_session.session: the STT's `texts`, the LLM's `replies`),
    the speaker cutting the n-th reply it gets at cut[n] s -> (tts, session, mic, speaker, the WebSocket's log);
    both closed after."""
    tts = TTS(base_url=server.url, voice="alloy", temperature=0, max_audio_length_ms=FRAMES * 80)
    log = watch(tts.conversation)
    s, mic, speaker = session(tts, texts, replies, **kw)
    speaker.cut = cut
    try:
        yield tts, s, mic, speaker, log
    finally:
        await s.aclose()
        await tts.aclose()


async def say(mic, done) -> None:
    """The user speaks (0.3 s: the STT's next text), then until done()."""
    mic.say(tone(0.3))
    await until(done)


def heard(server, index: int) -> list[tuple[str, int | None]]:
    """The turns of the index-th request's prompt (what CSM heard): (text, frames) for its own, (text, None)
    for the user's (their length depends on when the STT's events came)."""
    return [(t, len(c) if s == 0 else None) for s, t, c in server.built[index].turns()]


def test_synthesize_before_between_and_after_turns_never_shifts_a_cut(server, csm):
    server.chunk_delay = 0.03  # 2 frames a chunk: a barge-in may come while the reply still generates

    async def main():
        # the 2nd and 4th replies the speaker gets are cut there
        async with talk(server, ["Hi.", "Tell me.", "Stop.", "More.", "Wait.", "Bye."],
                        [["One."], ["Two."], ["Three."], ["Four."], ["Five."]],
                        {1: 0.16, 3: 0.08}) as (tts, s, mic, speaker, log):
            # before: a greeting spoken outside the session's output
            assert await drain(tts.synthesize("Hello there.")) >= FRAMES * 1920
            await s.start(ConversationAgent(instructions="Be brief."))
            await say(mic, lambda: len(speaker.reports) == 1)  # "Hi." -> "One.", heard in full
            assert await drain(tts.synthesize("By the way.")) >= FRAMES * 1920  # between
            # "Tell me." -> "Two.", cut at 160 ms by "Stop."
            await say(mic, lambda: len(speaker.segments) == 2 and speaker.pushed >= 0.24)
            await say(mic, lambda: len(speaker.reports) == 3)  # "Stop." -> "Three.", heard in full
            assert await drain(tts.synthesize("And another thing.")) >= FRAMES * 1920  # after
            # "More." -> "Four.", cut at 80 ms by "Wait."
            await say(mic, lambda: len(speaker.segments) == 4 and speaker.pushed >= 0.24)
            await say(mic, lambda: len(speaker.reports) == 5)  # "Wait." -> "Five."
        return log, speaker

    log, speaker = asyncio.run(main())
    assert speaker.reports == [(0.4, False), (0.16, True), (0.4, False), (0.08, True), (0.4, False)]
    _greet, _one, _between, two, _three, _after, four, _five = (b.request_id for b in server.built)
    truncates = [c for c in cuts(log) if c[0] == "truncate"]
    assert truncates == [("truncate", two, 160), ("truncate", four, 80)]
    assert heard(server, 7) == [
        ("Hello there.", FRAMES), ("Hi.", None), ("One.", FRAMES), ("By the way.", FRAMES), ("Tell me.", None),
        ("Two.", 2), ("Stop.", None), ("Three.", FRAMES), ("And another thing.", FRAMES), ("More.", None),
        ("Four.", 1), ("Wait.", None), ("Five.", 0)]
    settle(csm)


@pytest.mark.parametrize("when", ["generating", "generated"])
def test_a_reply_that_never_reached_the_speaker_is_cut_to_nothing_and_shifts_nothing(server, csm, when):
    """The barge-in comes while the speaker accepts nothing yet (the room's output waits for the listener to
    subscribe): the reply's audio reached the TTS, not the speaker, and no playback report comes for it."""

    async def main():
        # the 3rd reply the speaker gets ("Four.") is cut at 80 ms
        async with talk(server, ["Hi.", "Tell me.", "Stop.", "More.", "Wait."],
                        [["One."], ["Two."], ["Three."], ["Four."], ["Five."]],
                        {2: 0.08}) as (_tts, s, mic, speaker, log):
            await s.start(ConversationAgent(instructions="Be brief."))
            await say(mic, lambda: len(speaker.reports) == 1)  # "Hi." -> "One.", heard in full
            speaker.accepting.clear()
            if when == "generating":  # "Two." stops after 3 frames (chunks of 1 and 2), still generating
                server.hold_after, server.hold_only = 2, 1
            # "Tell me." -> "Two.": its audio reaches the TTS ...
            await say(mic, lambda: len(server.built) == 2 and server.built[1].frames >= 2)
            if when == "generated":
                await until(lambda: sum("flush_done" == e.get("got", {}).get("type") for e in log) == 2)
            # ... "Stop." before the speaker took any: -> "Three.", heard in full
            await say(mic, lambda: len(server.built) == 3)
            speaker.accepting.set()
            await until(lambda: len(speaker.reports) == 2)
            # "More." -> "Four.", cut at 80 ms by "Wait."
            await say(mic, lambda: len(speaker.segments) == 3 and speaker.pushed >= 0.24)
            await say(mic, lambda: len(speaker.reports) == 4)  # "Wait." -> "Five."
        return log, speaker

    log, speaker = asyncio.run(main())
    assert speaker.reports == [(0.4, False), (0.4, False), (0.08, True), (0.4, False)]
    _one, two, _three, four, _five = (b.request_id for b in server.built)
    sent = cuts(log)
    if when == "generating":  # cancelled keeping none of it (of the 3 frames the TTS got)
        assert sent[0] == ("cancel", "", 0) and server.built[1].reason == "closed"
        assert [c for c in sent if c[0] == "truncate"] == [("truncate", four, 80)]
    else:  # finished generating: cut to nothing once its speech is over
        assert server.built[1].reason == "length"
        assert [c for c in sent if c[0] == "truncate"] == [("truncate", two, 0), ("truncate", four, 80)]
    assert heard(server, 4) == [  # "Two." is not in it: none of it was heard
        ("Hi.", None), ("One.", FRAMES), ("Tell me.", None), ("Stop.", None), ("Three.", FRAMES), ("More.", None),
        ("Four.", 1), ("Wait.", None), ("Five.", 0)]
    settle(csm)


def test_a_reply_finished_before_the_barge_in_reached_the_server_is_still_cut(server, csm):
    """The barge-in's cancel crosses the reply's flush_done (the server had generated all of it): the cancel
    stops nothing there, and the playback report still cuts the reply to what was played."""

    async def main():
        tts = TTS(base_url=server.url, voice="alloy", temperature=0, max_audio_length_ms=FRAMES * 80)
        log = watch(tts.conversation)
        s, mic, speaker = session(tts, ["Hi.", "More.", "Wait."], [["One."], ["Four."], ["Five."]])
        speaker.cut = {1: 0.08}  # the 2nd reply the speaker gets ("Four.") is cut at 80 ms
        await s.start(ConversationAgent(instructions="Be brief."))
        mic.say(tone(0.3))  # "Hi." -> "One.", heard in full
        await until(lambda: len(speaker.reports) == 1)
        held, release = hold_from(tts.conversation, "flush_done")
        mic.say(tone(0.3))  # "More." -> "Four.", generated whole; its flush_done stays on the wire
        await until(lambda: held and len(speaker.segments) == 2 and speaker.pushed >= 0.24)
        mic.say(tone(0.3))  # "Wait." -> the cancel, answered with nothing stopped
        await until(lambda: any(m.get("type") == "cancelled" for m in held))
        release()
        await until(lambda: len(speaker.reports) == 3)
        await s.aclose()
        await tts.aclose()
        return log, speaker

    log, speaker = asyncio.run(main())
    assert speaker.reports == [(0.4, False), (0.08, True), (0.4, False)]
    _one, four, _five = (b.request_id for b in server.built)
    assert server.built[1].reason == "length"
    assert [c for c in cuts(log) if c[0] == "truncate"] == [("truncate", four, 80)]
    assert heard(server, 2) == [("Hi.", None), ("One.", FRAMES), ("More.", None), ("Four.", 1), ("Wait.", None),
                                ("Five.", 0)]
    settle(csm)


def test_a_speaker_at_another_rate_gets_the_cut_right(server, csm):
    """A 48 kHz output: the agent resamples each reply itself, and its frames still say whose they are."""

    async def main():
        async with talk(server, ["Hi.", "Stop.", "Bye."], [["One."], ["Two."]], {0: 0.16},
                        rate=48_000) as (_tts, s, mic, speaker, log):
            await s.start(ConversationAgent(instructions="Be brief."))
            # "Hi." -> "One.", cut at 160 ms by "Stop."
            await say(mic, lambda: len(speaker.segments) == 1 and speaker.pushed >= 0.24)
            await say(mic, lambda: len(speaker.reports) == 2)  # "Stop." -> "Two."
        return log, speaker

    log, speaker = asyncio.run(main())
    assert {f.sample_rate for seg in speaker.segments for f in seg} == {48_000}
    assert speaker.reports == [(0.16, True), (0.4, False)]
    one, _two = (b.request_id for b in server.built)
    assert [c for c in cuts(log) if c[0] == "truncate"] == [("truncate", one, 160)]
    assert heard(server, 1) == [("Hi.", None), ("One.", 2), ("Stop.", None), ("Two.", 0)]
    settle(csm)


def test_without_the_tap_nothing_is_cut(server, csm):
    """An Agent that leaves out on_enter's hook (no tap on the output): the TTS cannot know what played, so
    it cuts nothing, rather than take the replies it never saw reach the speaker for unheard."""

    class NoTap(ConversationAgent):
        async def on_enter(self) -> None:
            pass

    async def main():
        async with talk(server, ["Hi.", "Tell me.", "Stop."], [["One."], ["Two."], ["Three."]],
                        {1: 0.16}) as (_tts, s, mic, speaker, log):
            await s.start(NoTap(instructions="Be brief."))
            await say(mic, lambda: len(speaker.reports) == 1)  # "Hi." -> "One.", heard in full
            # "Tell me." -> "Two.", cut at 160 ms by "Stop."
            await say(mic, lambda: len(speaker.segments) == 2 and speaker.pushed >= 0.24)
            await say(mic, lambda: len(speaker.reports) == 3)  # "Stop." -> "Three."
        return log

    log = asyncio.run(main())
    assert [c for c in cuts(log) if c[0] == "truncate"] == []
    assert heard(server, 2)[:2] == [("Hi.", None), ("One.", FRAMES)]
    settle(csm)
