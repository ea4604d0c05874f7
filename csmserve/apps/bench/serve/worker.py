"""A client process (`python -m csmserve.apps.bench.serve.worker`): one asyncio loop (uvloop when installed)
running its share of a scenario's users. JSON lines on stdin/stdout talk to the parent (bench.py):

    parent -> {"cmd": "run", "scenario": {...}, "users": [...], "t_start": T, "url": ..., ...}
    worker -> {"event": "drained"}             every counted request of this process has ended
    parent -> {"cmd": "stop"}                  (the window and the drain are over: stop every user)
    worker -> {"event": "result", "records": [...], "cpu_s": ..., "wall_s": ..., "lag_ms": {...}}
    parent -> {"cmd": "exit"}

or, for the soak (soak.py, soak_users.py): parent -> {"cmd": "soak", ...}; worker -> {"event": "records", ...}
every few seconds; parent -> {"cmd": "stop"}; worker -> {"event": "result", ...}.

Besides the users it measures itself: its CPU time, and the event loop's lag (how late a 50 ms
ticker wakes) in the window, which bounds how late it timestamps an arrival.
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

from csmserve.apps.bench.serve.scenario import Scenario
from csmserve.apps.bench.serve.users import Run, run_until_stop, user_coroutine

TICK_S = 0.05


def _send(payload: dict) -> None:
    sys.stdout.write(json.dumps(payload, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


async def _ticker(run: Run, lags: list[float]) -> None:
    while True:
        t = time.monotonic()
        await asyncio.sleep(TICK_S)
        late = time.monotonic() - t - TICK_S
        if run.t0 <= t < run.t1:
            lags.append(late)
        run.check_drained()


async def run_scenario(cmd: dict, commands: asyncio.Queue) -> dict:
    sc = Scenario(**cmd["scenario"])
    users: list[int] = cmd["users"]
    run = Run(sc, cmd["url"], cmd["t_start"], cmd["texts"], cmd["voices"], api_key=cmd.get("api_key"),
              backoff=cmd.get("backoff", 0.25), ws_compression=cmd.get("ws_compression", False),
              on_drained=lambda: _send({"event": "drained"}), num_users=len(users))
    cpu0, wall0 = time.process_time(), time.monotonic()
    lags: list[float] = []
    tasks = [asyncio.create_task(user_coroutine(run, u)) for u in users]
    ticker = asyncio.create_task(_ticker(run, lags))
    errors = await run_until_stop(run, commands, tasks, ticker)
    return {"event": "result", "records": run.records, "cpu_s": time.process_time() - cpu0,
            "wall_s": time.monotonic() - wall0, "users": len(users), "user_errors": errors[:5],
            "lag_ms": {"p50": _ms(_pct(lags, 50)), "p99": _ms(_pct(lags, 99)), "max": _ms(max(lags, default=None))}}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def _read_stdin(loop: asyncio.AbstractEventLoop, commands: asyncio.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            loop.call_soon_threadsafe(commands.put_nowait, json.loads(line))
    loop.call_soon_threadsafe(commands.put_nowait, {"cmd": "exit"})


async def main_async() -> None:
    commands: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_read_stdin, args=(asyncio.get_running_loop(), commands), daemon=True).start()
    _send({"event": "ready"})
    while True:
        cmd = await commands.get()
        if cmd.get("cmd") == "run":
            _send(await run_scenario(cmd, commands))
        elif cmd.get("cmd") == "soak":  # bench/soak.py: the soak's users (soak_users.py) until "stop"
            from csmserve.apps.bench.serve.soak_users import run_soak

            _send(await run_soak(cmd, commands, _send))
        elif cmd.get("cmd") == "exit":
            return


def main() -> None:
    from csmserve.apps.bench.serve.server import raise_fd_limit

    raise_fd_limit()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_async())
    else:
        uvloop.run(main_async()) if hasattr(uvloop, "run") else (uvloop.install(), asyncio.run(main_async()))


if __name__ == "__main__":
    main()
