"""ServerConfig.encode_threads: a compressed stream's chunks after its first are encoded on the pool's
thread (the event loop stays free); the bytes are the same as when all of it is encoded on the loop."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from csmserve.audio import make_encoder
from csmserve.config import ServerConfig
from csmserve.engine.request import AudioChunk
from csmserve.server.lead import Lead, LoopLoad
from csmserve.server.speech import _encoded


def _chunks(n: int) -> list[AudioChunk]:
    rng = np.random.default_rng(0)
    return [AudioChunk("r", (rng.standard_normal(3840) * 0.1).astype(np.float32), np.ones((2, 32), np.int64), 2 * i)
            for i in range(n)]


async def _run(fmt: str, pool) -> tuple[bytes, list[str]]:
    enc = make_encoder(fmt)
    threads: list[str] = []
    write, close = enc.write, enc.close
    enc.write = lambda pcm: (threads.append(threading.current_thread().name), write(pcm))[1]
    enc.close = lambda: (threads.append(threading.current_thread().name), close())[1]
    chunks = _chunks(6)

    async def rest():
        for c in chunks[1:]:
            yield c

    out = b"".join([data async for data, _ in _encoded(rest(), chunks[0], enc, Lead(LoopLoad(), 0.0), 1.0, pool)])
    return out, threads


@pytest.mark.parametrize("fmt", ["mp3", "flac"])  # deterministic bytes (Ogg pages carry a random serial)
def test_chunks_after_the_first_go_to_the_pool_and_the_bytes_are_the_same(fmt):
    with ThreadPoolExecutor(1, thread_name_prefix="csmserve-encode") as pool:
        threaded, names = asyncio.run(_run(fmt, pool))
    inline, inline_names = asyncio.run(_run(fmt, None))
    assert threaded == inline and len(threaded) > 0
    loop_thread = threading.current_thread().name
    assert names[0] == loop_thread  # the first chunk: at once, on the loop
    assert all(n.startswith("csmserve-encode") for n in names[1:]), names  # the rest and the tail: the pool
    assert set(inline_names) == {loop_thread}


def test_pcm_is_never_sent_to_the_pool():
    with ThreadPoolExecutor(1, thread_name_prefix="csmserve-encode") as pool:
        _, names = asyncio.run(_run("pcm", pool))
    assert set(names) == {threading.current_thread().name}


def test_encode_threads_is_checked():
    with pytest.raises(ValueError, match="encode_threads"):
        ServerConfig(encode_threads=-1)
