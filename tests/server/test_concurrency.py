"""32 concurrent streaming clients; half of them hang up mid-stream."""
import asyncio
import time

import openai

from server_helpers import metric, wait_idle

FRAMES = 8


async def one(c: openai.AsyncOpenAI, i: int, hang_up: bool) -> tuple[int, int]:
    # -> (bytes received, body parts received)
    n = parts = 0
    ms = 30_000 if hang_up else FRAMES * 80
    async with c.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=f"Client number {i}.", response_format="pcm",
            extra_body={"seed": i, "max_audio_length_ms": ms}) as r:
        assert r.status_code == 200
        async for part in r.iter_bytes():
            n, parts = n + len(part), parts + 1
            if hang_up and n >= 2 * 1920 * 2:
                break  # leaving the block closes the connection mid-stream
    return n, parts


def test_32_concurrent_clients_half_hang_up(server):
    assert wait_idle(server)  # the procs server is the session's: nothing of an earlier module still ends
    if server.state is None:
        time.sleep(0.5)
    before = {r: _finished(server, r) for r in ("abort", "length")}

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i, hang_up=i % 2 == 1) for i in range(32)))

    results = asyncio.run(main())
    for i, (n, _) in enumerate(results):
        if i % 2 == 0:
            assert n == FRAMES * 1920 * 2, (i, n)  # every frame of the ones that stayed
        else:
            assert 2 * 1920 * 2 <= n < 30_000 // 80 * 1920 * 2
    assert wait_idle(server)  # every slot free, nothing waiting
    if server.state is not None:
        assert server.state.active == 0
    assert _finished(server, "abort") - before["abort"] == 16
    assert _finished(server, "length") - before["length"] == 16


def _finished(server, reason: str) -> float:
    try:
        return metric(server, f'csmserve:request_success_total{{finished_reason="{reason}"')
    except KeyError:
        return 0.0
