"""server/encode_queue.py: encodes most urgent first, in slices that leave the event loop to the other hops of
every request; the server's compressed responses go through it."""
from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

from csmserve.audio import make_encoder
from csmserve.engine.request import AudioChunk
from csmserve.server.encode_queue import EncodeQueue
from csmserve.server.lead import Lead, LoopLoad
from csmserve.server.speech import _encoded


def test_encodes_run_earliest_deadline_first() -> None:
    async def main() -> list[int]:
        q = EncodeQueue()
        q.start()
        ran: list[int] = []
        # queued in one turn (the runner is not running meanwhile), deadlines out of order
        jobs = [asyncio.ensure_future(q.run(d, ran.append, i)) for i, d in enumerate([5.0, 1.0, 3.0, 1.0, 0.5])]
        await asyncio.gather(*jobs)
        q.stop()
        return ran

    assert asyncio.run(main()) == [4, 1, 3, 2, 0]  # ties: first queued first


def test_a_turn_runs_one_slice_of_the_backlog_not_all_of_it() -> None:
    """50 encodes of >= 1 ms queued at once: a task that only waits for the next turn of the loop (a request's
    hop: a delivery, a write) comes back after a slice (2 ms: a few encodes), not after all 50."""
    async def main() -> tuple[int, int]:
        q = EncodeQueue(slice_s=0.002)
        q.start()
        jobs = [asyncio.ensure_future(q.run(float(i), time.sleep, 0.001)) for i in range(50)]
        await asyncio.sleep(0)  # the runner takes its first slice in this turn
        await asyncio.sleep(0)
        seen = q.ran
        await asyncio.gather(*jobs)
        q.stop()
        return seen, q.ran

    seen, ran = asyncio.run(main())
    assert ran == 50
    assert 1 <= seen <= 10, seen  # inline encoding would have run all 50 before this task's next turn


def test_a_first_chunk_goes_before_the_backlog_of_streams_ahead() -> None:
    async def main() -> list[str]:
        q = EncodeQueue(slice_s=0.0)  # one encode per turn
        q.start()
        now = time.monotonic()
        order: list[str] = []
        ahead = [asyncio.ensure_future(q.run(now + 1.0 + i, order.append, f"ahead{i}")) for i in range(5)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # a couple of the backlog ran
        await q.run(time.monotonic(), order.append, "first")
        await asyncio.gather(*ahead)
        q.stop()
        return order

    order = asyncio.run(main())
    assert order.index("first") < 4, order  # not behind the whole backlog


def test_errors_reach_their_caller_and_a_cancelled_caller_leaves_the_queue() -> None:
    def fail() -> None:
        raise ValueError("bad chunk")

    async def main() -> tuple[list[str], bool]:
        q = EncodeQueue()
        q.start()
        ran: list[str] = []
        gone = asyncio.ensure_future(q.run(0.0, ran.append, "gone"))
        kept = asyncio.ensure_future(q.run(1.0, ran.append, "kept"))
        gone.cancel()  # its response went away while queued
        with pytest.raises(ValueError, match="bad chunk"):
            await q.run(2.0, fail)
        await kept
        alive = q.task is not None and not q.task.done()
        q.stop()
        return ran, alive

    ran, alive = asyncio.run(main())
    assert ran == ["kept"] and alive


def test_busy_while_encodes_wait_and_it_feeds_the_lead_bound() -> None:
    async def main() -> tuple[bool, bool, bool, float]:
        q = EncodeQueue(slice_s=0.002, busy_wait_s=0.01, hold_s=0.2)
        q.start()
        lead = Lead(LoopLoad(), 0.5, q)
        before = q.busy
        await asyncio.gather(*[q.run(float(i), time.sleep, 0.002) for i in range(20)])  # the last waited ~40 ms
        during = q.busy
        delay = lead.delay(t_first=100.0, audio_s=2.0, now=100.0)  # 2 s ahead, bound 0.5 s
        await asyncio.sleep(0.3)
        after = q.busy
        q.stop()
        return before, during, after, delay

    before, during, after, delay = asyncio.run(main())
    assert (before, during, after) == (False, True, False)
    assert delay == 0.25


def test_not_started_runs_inline() -> None:
    assert asyncio.run(EncodeQueue().run(0.0, lambda x: x + 1, 1)) == 2


def test_the_stream_goes_through_the_queue_and_the_bytes_are_the_same() -> None:
    rng = np.random.default_rng(0)
    chunks = [AudioChunk("r", (rng.standard_normal(3840) * 0.1).astype(np.float32), np.ones((2, 32), np.int64),
                         2 * i) for i in range(6)]

    async def run(started: bool) -> tuple[bytes, int]:
        q = EncodeQueue()
        if started:
            q.start()

        async def rest():
            for c in chunks[1:]:
                yield c

        out = b"".join([d async for d, _ in _encoded(rest(), chunks[0], make_encoder("mp3"), Lead(LoopLoad(), 0.0, q))])
        q.stop()
        return out, q.ran

    queued, ran = asyncio.run(run(True))
    inline, ran_inline = asyncio.run(run(False))
    assert queued == inline and len(queued) > 0
    assert ran == 7 and ran_inline == 0  # 6 chunks and the tail


@pytest.mark.inproc
def test_the_server_encodes_mp3_through_its_queue(serve) -> None:
    server = serve()
    queue = server.state.lead.queue
    assert queue.task is not None  # started with the app
    before = queue.ran
    body = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "mp3",
            "max_audio_length_ms": 800}
    r = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200 and r.content[:2] in (b"\xff\xf3", b"\xff\xf2", b"\xff\xfb")
    after = queue.ran
    assert after - before >= 2  # the first chunk and the tail at least
    pcm = httpx.post(f"{server.url}/v1/audio/speech", json={**body, "response_format": "pcm"}, timeout=60)
    assert pcm.status_code == 200 and len(pcm.content) > 0 and queue.ran == after  # pcm is written as it comes


def test_a_grown_chunk_is_encoded_in_pieces_each_at_its_own_turn() -> None:
    """A 12-frame chunk (a stream well ahead of real time, --max-chunk-ms) is 6 encodes of 2 frames at their own
    playback deadlines: a first chunk queued meanwhile (deadline now) runs after one piece, not after all of it;
    the bytes are those of one write."""
    from csmserve.server.speech import ENCODE_PIECE_SAMPLES, _encode

    rng = np.random.default_rng(1)
    big = AudioChunk("r", (rng.standard_normal(12 * 1920) * 0.1).astype(np.float32), np.ones((12, 32), np.int64), 0)

    async def main() -> tuple[bytes, list[str], int]:
        q = EncodeQueue(slice_s=0.0)  # one encode per turn
        q.start()
        lead, order = Lead(LoopLoad(), 0.0, q), []
        enc = make_encoder("mp3")
        write = enc.write
        enc.write = lambda a: (order.append(f"big{len(a) // 1920}"), write(a))[1]
        now = time.monotonic()
        grown = asyncio.ensure_future(_encode(enc, big, lead, now + 0.5))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # its first piece is queued and run
        first = asyncio.ensure_future(q.run(now, order.append, "first"))
        data = await grown
        await first
        q.stop()
        return data, order, q.ran

    data, order, ran = asyncio.run(main())
    assert ENCODE_PIECE_SAMPLES == 2 * 1920 and ran == 7
    assert order.index("first") <= 2 and order.count("big2") == 6  # the first chunk did not wait for the rest
    whole = make_encoder("mp3")
    assert data == whole.write(big.audio)  # the same stream of bytes as one write
