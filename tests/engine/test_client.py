"""engine/client.py: a stream whose event loop closed before it was read (asyncio.run returned with the
stream unfinished) is aborted at its next chunk; the engine step goes on for every other stream."""
import asyncio
import time

from csmserve import CSM
from csmserve.config import EngineConfig


def test_a_stream_whose_loop_closed_is_aborted_and_the_others_go_on():
    csm = CSM("dummy-tiny", device="cpu", dtype="float32", engine=True,
              engine_config=EngineConfig(max_slots=4, max_seq_len=512, first_chunk_frames=1, chunk_frames=1))
    try:
        client = csm.client
        aborted = []
        abort = client.abort
        client.abort = lambda rid: (aborted.append(rid), abort(rid))
        loop = asyncio.new_event_loop()
        loop.close()
        sink = client._async_sink(loop, asyncio.Queue(), "gone")
        sink(object())  # a chunk for it: no RuntimeError into the engine's step
        assert aborted == ["gone"]

        async def orphan():  # the first chunk read, then the loop ends with the stream open
            agen = client.astream(csm.request("A long one.", temperature=0.0, max_audio_length_ms=40 * 80))
            await agen.__anext__()
            return agen

        kept = asyncio.run(orphan())  # noqa: F841 - a live reference: the stream is not closed by collection
        frames = sum(len(c.codes) for c in client.run([csm.request("Next.", temperature=0.0,
                                                                   max_audio_length_ms=4 * 80)])[0])
        assert frames == 4  # the engine kept stepping for this one
        sched = client.engine.scheduler
        deadline = time.time() + 10
        while time.time() < deadline and sched.num_free_slots < sched.max_slots:
            time.sleep(0.02)
        assert sched.num_free_slots == sched.max_slots  # the orphan's slot was given back, not held to its cap
    finally:
        csm.close()


def test_a_burst_of_chunks_wakes_the_loop_once_and_keeps_their_order():
    """The delivering thread hands a step's chunks to an event loop's streams with one call_soon_threadsafe (a
    self-pipe write and a GIL hand-off each), not one a chunk; each queue gets its own items in order."""
    from csmserve.engine.client import _LoopFeed

    loop = asyncio.new_event_loop()
    try:
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))
        feed = _LoopFeed(loop, lambda rid: None)
        queues = [asyncio.Queue() for _ in range(4)]
        for i in range(100):
            feed.put(queues[i % 4], i, f"r{i % 4}")
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakes) == 1
        assert [[q.get_nowait() for _ in range(q.qsize())] for q in queues] == [list(range(k, 100, 4))
                                                                                 for k in range(4)]
        feed.put(queues[0], 100, "r0")  # drained: the next burst wakes it again
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakes) == 2 and queues[0].get_nowait() == 100
    finally:
        loop.close()
