"""A client process (`python -m csmserve.apps.bench.serve.client`): one asyncio loop (uvloop when installed)
running its share of the users, JSON lines on stdin/stdout to the parent (bench.py, soak.py):

    parent -> {"cmd": "run", "scenario": {...}, "users": [...], "t_start": T, "url": ..., ...}   (users.py)
              or {"cmd": "soak", ...}   (soak_users.py: the client sends {"event": "records"} every few s)
    client -> {"event": "drained"}   (run: every counted request of this process has ended)
    parent -> {"cmd": "stop"}; client -> {"event": "result", "records": [...], "cpu_s": ..., ...}; parent -> exit
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading

from csmserve.apps.bench.serve.report import pct
from csmserve.apps.bench.serve.users import Run, Scenario, http_user, run_users, send, ws_user

TICK_S = 0.05


async def run_scenario(cmd: dict, commands: asyncio.Queue) -> dict:
    sc, users = Scenario(**cmd["scenario"]), cmd["users"]
    run = Run(cmd["url"], cmd["texts"], cmd["voices"], cmd.get("api_key"), sc, cmd["t_start"],
              on_drained=lambda: send({"event": "drained"}), num_users=len(users), adapters=cmd.get("adapters", ()))
    tasks = [asyncio.create_task((ws_user if sc.mode == "ws" else http_user)(run, u)) for u in users]
    result, lags = await run_users(run, commands, tasks, TICK_S, run.check_drained)
    return result | {"users": len(users),
                     "lag_ms": {"p50": pct(lags, 50), "p99": pct(lags, 99), "max": max(lags, default=None)}}


async def main_async() -> None:
    commands: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(commands.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(commands.put_nowait, {"cmd": "exit"})

    threading.Thread(target=read_stdin, daemon=True).start()
    send({"event": "ready"})
    while True:
        cmd = await commands.get()
        if cmd.get("cmd") == "run":
            send(await run_scenario(cmd, commands))
        elif cmd.get("cmd") == "soak":  # bench/soak.py: the soak's users until "stop"
            from csmserve.apps.bench.serve.soak_users import run_soak

            send(await run_soak(cmd, commands))
        elif cmd.get("cmd") == "exit":
            return


if __name__ == "__main__":
    from csmserve.ray.haproxy import raise_fd_limit

    raise_fd_limit()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_async())
    else:
        uvloop.run(main_async()) if hasattr(uvloop, "run") else (uvloop.install(), asyncio.run(main_async()))
