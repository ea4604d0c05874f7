"""csmserve.integrations.conversation.Conversation, the client the Pipecat and LiveKit services are built
on: a reply's events, user turns as context, errors as one line, a server that goes away."""
from __future__ import annotations

import asyncio
import json

import pytest

from csmserve.integrations.conversation import Conversation, ConversationError, ReplyAudio, ReplySegment
from helpers import hold_from, settle, tone, until
from server_helpers import free_port


def test_a_reply_streams_audio_and_exact_segment_times(server, csm):
    async def main():
        conv = Conversation(server.url, voice="alloy", temperature=0, max_segment_length_ms=160)
        await conv.connect()
        conv.add_user_audio(tone(0.05), 16_000)  # under 0.1 s: the turn goes as text only
        assert conv.end_user_turn("  Hi   there. ")["text"] == "Hi there." and "audio" not in conv._user_turns[0]
        reply = await conv.say("One. Two.", key="r1")
        await conv.flush("r1")
        events = [e async for e in reply]
        await conv.close(forget=True)
        return reply, events

    reply, events = asyncio.run(main())
    audio = [e for e in events if isinstance(e, ReplyAudio)]
    segs = [e for e in events if isinstance(e, ReplySegment)]
    assert reply.done and reply.finish_reason in ("eos", "length") and reply.request_id.startswith("req-")
    assert [s.text for s in segs] == ["One.", "Two."] and segs[0].audio_start_ms == 0
    assert segs[1].audio_start_ms == segs[0].audio_end_ms and segs[1].audio_end_ms == reply.frames * 80
    assert sum(len(a.pcm) for a in audio) == reply.frames * 3840
    assert [(s, t) for s, t, _ in server.built[0].turns()] == [(1, "Hi there."), (0, "One.")]
    settle(csm)


def test_errors_are_one_line(server, csm):
    async def unreachable():
        await Conversation(f"http://127.0.0.1:{free_port()}").connect()

    with pytest.raises(ConversationError, match="unreachable"):
        asyncio.run(unreachable())

    async def refused():
        conv = Conversation(server.url, voice="nobody-by-that-name")
        reply = await conv.say("Hello.", key="x")
        await conv.flush("x")
        try:
            return [e async for e in reply]
        finally:
            await conv.close()

    with pytest.raises(ConversationError, match="nobody-by-that-name"):
        asyncio.run(refused())
    settle(csm)


def test_the_server_going_away_ends_the_reply_with_the_reason(server, csm):
    async def main():
        conv = Conversation(server.url, voice="alloy", max_audio_length_ms=60_000)
        reply = await conv.say("A long answer that goes on.", key="x")
        await conv.flush("x")
        async for _ in reply:
            break
        await conv._ws.close()  # the connection drops
        with pytest.raises(ConversationError, match="closed|lost"):
            async for _ in reply:
                pass
        await conv.close()

    asyncio.run(main())
    settle(csm)  # the server aborted the turn of the connection that left


def test_a_reply_the_server_finished_before_the_cancel_came_keeps_its_request_id(server, csm):
    """The barge-in's cancel crosses the reply's flush_done: the server stops nothing (its `cancelled` names
    no turn), and the reply learns its request_id and length from the flush_done that was on the wire, so
    a truncate can still cut it at what was played."""

    async def main():
        conv = Conversation(server.url, voice="alloy", temperature=0, max_audio_length_ms=5 * 80)
        await conv.connect()
        held, release = hold_from(conv, "flush_done")
        reply = await conv.say("Four.", key="r")
        await conv.flush("r")
        await until(lambda: any(m.get("type") == "flush_done" for m in held))
        interrupted = asyncio.create_task(conv.interrupt(audio_end_ms=400))
        await until(lambda: any(m.get("type") == "cancelled" for m in held))
        assert not reply.done and reply.cancelled
        release()
        cancelled = await interrupted
        truncated = await conv.truncate(reply.request_id, 80)
        await conv.close(forget=True)
        return reply, cancelled, truncated

    reply, cancelled, truncated = asyncio.run(main())
    assert "request_id" not in cancelled  # nothing was generating
    assert reply.done and reply.request_id == server.built[0].request_id and reply.frames == 5
    assert reply.finish_reason == server.built[0].reason == "length"
    assert truncated["num_frames"] == 1
    settle(csm)


class _FakeWS:
    """The server's side of one WebSocket: what the Conversation sends, and messages put in `inbox`."""

    def __init__(self):
        self.sent, self.inbox = [], asyncio.Queue()

    async def send(self, data):
        self.sent.append(json.loads(data))

    async def close(self):
        await self.inbox.put(None)

    def __aiter__(self):
        return self

    async def __anext__(self):
        m = await self.inbox.get()
        if m is None:
            raise StopAsyncIteration
        return json.dumps(m)


def test_a_refused_truncate_fails_the_truncate_not_the_reply_generating():
    """LiveKit cuts an earlier reply (truncate by its request_id) while the next one generates; the server refuses
    it (the turn is gone: another replica, an idle expiry): truncate() raises at once, the reply goes on."""
    async def main():
        conv = Conversation("http://x", context_id="c1")
        ws = conv._ws = _FakeWS()
        conv._reader = asyncio.get_running_loop().create_task(conv._read(ws))
        reply = await conv.say("Hello there. ", key="turn-2")
        await ws.inbox.put({"type": "audio", "context_id": "c1", "audio": "AAAA", "frame_start": 0, "num_frames": 1,
                            "segment": 0, "text": "Hello there."})
        trunc = asyncio.create_task(conv.truncate("req-old", 160))
        await asyncio.sleep(0.05)
        await ws.inbox.put({"type": "error", "context_id": "c1", "error": {
            "message": "context 'c1' has no assistant turn from request 'req-old' to truncate",
            "type": "invalid_request_error", "param": "request_id", "code": "invalid_value"}})
        await asyncio.sleep(0.05)
        assert trunc.done() and isinstance(trunc.exception(), ConversationError)
        assert not reply.done and reply.error is None
        await ws.inbox.put({"type": "flush_done", "context_id": "c1", "request_id": "req-2", "num_frames": 1})
        await asyncio.sleep(0.05)
        assert reply.done and reply.error is None and reply.request_id == "req-2"
        await conv.close()

    asyncio.run(main())
