"""server/lead.py: a saturated worker holds back streams far ahead of real time; an idle one never."""
from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import numpy as np
import pytest

from csmserve.audio import make_encoder
from csmserve.config import EngineConfig, ServerConfig
from csmserve.engine.request import AudioChunk
from csmserve.server.flags import add_serve_parser, configs
from csmserve.server.lead import Lead, LoopLoad
from csmserve.server.speech import _encoded

SPEECH = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm"}

pytestmark = pytest.mark.serial  # measures how far ahead of real time a stream runs: not beside another worker


def test_loop_load_sees_a_blocked_loop_and_forgets_it() -> None:
    async def main() -> tuple[bool, bool, bool]:
        load = LoopLoad(period_s=0.005, busy_lag_s=0.02, hold_s=0.2)
        load.start()
        await asyncio.sleep(0.05)
        idle = load.busy
        time.sleep(0.08)  # the loop is stuck (an encode hogging it)
        await asyncio.sleep(0.02)
        blocked = load.busy
        await asyncio.sleep(0.3)  # past the hold with the loop free
        after = load.busy
        load.stop()
        return idle, blocked, after

    assert asyncio.run(main()) == (False, True, False)


class _Busy:
    busy = True


class _Idle:
    busy = False


def test_delay_only_while_busy_and_ahead() -> None:
    lead = Lead(_Busy(), max_lead_s=2.0)
    assert lead.delay(t_first=100.0, audio_s=1.0, now=100.0) == 0.0  # 1 s ahead: under the bound
    assert lead.delay(t_first=100.0, audio_s=2.1, now=100.0) == pytest.approx(0.1)
    assert lead.delay(t_first=100.0, audio_s=9.0, now=101.0) == 0.25  # one wait at most, then look again
    assert lead.delay(t_first=100.0, audio_s=3.0, now=101.5) == 0.0  # real time caught up
    assert Lead(_Idle(), 2.0).delay(100.0, 9.0, 100.0) == 0.0
    assert Lead(_Busy(), 0.0).delay(100.0, 9.0, 100.0) == 0.0  # 0: never


def _chunks(n: int, frames: int) -> list[AudioChunk]:
    pcm = np.zeros(frames * 1920, np.float32)
    return [AudioChunk("r", pcm, np.zeros((frames, 32), np.int64), i * frames, i == n - 1, None, 0) for i in range(n)]


@pytest.mark.parametrize("busy", [False, True])
def test_a_stream_ahead_waits_for_real_time_while_busy(busy: bool) -> None:
    """10 chunks of 160 ms ready at once: while busy, encoding keeps within max_lead_s of real time."""
    first, *rest = _chunks(10, 2)

    async def source():
        for c in rest:
            yield c

    async def main() -> float:
        t = time.monotonic()
        out = [x async for x in _encoded(source(), first, make_encoder("pcm"), Lead(_Busy() if busy else _Idle(), 0.3))]
        assert len(out) == 11 and out[-1][1] is None  # every chunk, then the encoder's tail
        return time.monotonic() - t

    took = asyncio.run(main())
    if busy:  # the last chunk (1.44 s into the audio) waits until 1.44 - 0.3 s of real time
        assert took >= 1.44 - 0.3 - 0.05, took
    else:
        assert took < 0.5, took


def test_the_bound_is_a_checked_flag() -> None:
    with pytest.raises(ValueError, match="max_lead_s"):
        ServerConfig(max_lead_s=-1)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    server, _ = configs(parser.parse_args(["serve", "--max-lead-s", "0.5"]))
    assert server.max_lead_s == 0.5 and ServerConfig().max_lead_s == 1.0


@pytest.mark.inproc
def test_the_server_paces_a_response_only_while_its_worker_is_busy(serve) -> None:
    """Audio received ahead of real time (playback from the first byte): bounded by max_lead_s (+ the
    chunk being written) while the worker is busy; unbounded when it is not."""
    # a chunk written after the wait may be the largest the router makes once a stream is ahead (max_chunk_ms)
    lead_s, chunk_s = 0.1, EngineConfig().max_chunk_ms // 80 * 0.08
    server = serve(max_lead_s=lead_s)
    load = server.state.lead.load
    assert load.task is not None  # started with the app
    body = {**SPEECH, "max_audio_length_ms": 3000}

    def most_ahead() -> tuple[float, int]:
        ahead, got = 0.0, 0
        with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=60) as r:
            for b in r.iter_bytes():
                t = time.monotonic()
                if not got:
                    t_first = t
                got += len(b)
                ahead = max(ahead, got / 2 / 24_000 - (t - t_first))
        return ahead, got

    free, n_free = most_ahead()
    server.state.lead.load = _Busy()  # as if the loop were saturated
    try:
        held, n_held = most_ahead()
    finally:
        server.state.lead.load = load
    assert n_free == n_held == 2 * 1920 * (3000 // 80)  # the same audio either way
    bound = lead_s + 0.08 + chunk_s + 0.1  # the first chunk, the chunk written after a wait, scheduling
    assert held <= bound, (held, free)
    if free <= bound + 0.1:
        pytest.skip(f"the engine here runs too close to real time to tell (free stream {free:.2f} s ahead)")
