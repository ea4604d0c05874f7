"""The host's own work per engine step, with a stand-in runner (no model, no device): what the engine
process spends on scheduling, reading a step's results and handing them out, and what one API worker
spends turning its rows into chunks, as functions of the rows per step.

    python bench/host_step.py --rows 64,512,2048 [--clients 4] [--admit 80]

For each row count R: R long requests run (one frame per step each); every step also admits
`--admit` new requests and finishes as many (a turnover of admit x 12.5 per second of audio).
Printed per R: engine-side ms per step (schedule + update + one EngineStep per client, pickled as it
leaves the engine process), and router-side ms per step for one client's share of the rows (unpickle,
gather codes and PCM rows, group into chunks, one sink call per chunk).
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time
from dataclasses import dataclass

import numpy as np

from csmserve.config import EngineConfig
from csmserve.engine.engine import Engine
from csmserve.engine.outputs import CLIENT_SHIFT
from csmserve.engine.outputs import Router
from csmserve.engine.request import Request
from csmserve.sampling import SamplingParams

K, FS = 32, 1920


@dataclass
class _Out:
    slots: np.ndarray
    codes: np.ndarray
    pcm: np.ndarray
    ring: int = 0

    def done(self) -> bool:
        return True

    def wait(self):
        return self.codes, self.pcm

    def codec_lag_s(self) -> float:
        return 0.0


class StandInRunner:
    """The runner's surface without a model: every frame step returns the same non-EOS codes at once."""

    class _KV:
        bytes_per_position = 1

    class _Cfg:
        num_codebooks = K

    def __init__(self, num_slots: int) -> None:
        import torch

        from csmserve.engine.output_ring import OutputRing

        self.device, self.cfg, self.kv = torch.device("cpu"), self._Cfg(), self._KV()
        self.ring = OutputRing(1, 1, K, 0)  # the engine's reader bookkeeping; the outputs are below
        self.codes = np.full((num_slots, K), 7, np.int64)
        self.pcm = np.zeros((num_slots, FS), np.float32)

    def admit(self, admissions, prefixes: bool = True) -> None:
        pass

    resume = prefill = store_prefixes = copy_prefixes = admit

    def step(self, slots: np.ndarray, step_id: int = -1, from_prefill: bool = False):
        if not len(slots):
            return None
        n = len(slots)
        return _Out(slots, self.codes[:n], self.pcm[:n])


def _request(client: int, n: int, frames: int) -> Request:
    tokens, mask = np.zeros((1, K + 1), np.int64), np.ones((1, K + 1), bool)
    r = Request(tokens, mask, SamplingParams(temperature=0.0, max_audio_length_ms=80 * frames))
    r.handle = (client << CLIENT_SHIFT) | n
    return r


def measure(rows: int, clients: int = 4, admit: int = 0, steps: int = 50, warmup: int = 16,
            chunk_frames: int = 4) -> dict:
    """ms per step on the engine side and on one client's router, R rows running; the first `warmup` steps
    are not timed (the first touch of every buffer's pages: a process that serves does it once)."""
    cfg = EngineConfig(max_slots=rows + admit + 1, max_seq_len=4096, max_waiting=10 * rows + 1000)
    sent: list[tuple[int, bytes]] = []
    engine = Engine(StandInRunner(cfg.max_slots), cfg, start=False,
                    emit=lambda c, step, out: sent.append((c, pickle.dumps(step, protocol=5))))
    n = 0
    long = 10**6
    for i in range(rows):
        engine.submit(_request(i % clients + 1, n, long))
        n += 1
    for _ in range(3):  # admit and reach steady state
        engine.step()
    # one router per client, with a sink per request, as an API worker has
    routers = {c: Router(K, 1, chunk_frames) for c in range(1, clients + 1)}
    chunks = [0]

    def sink(item) -> None:
        chunks[0] += 1

    for r in list(engine.scheduler.slots):
        if r is not None:
            routers[r.handle >> CLIENT_SHIFT].open(r.handle, r.request_id, sink)
    eng_s = rtr_s = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            eng_s = rtr_s = 0.0
            chunks[0] = 0
        for _ in range(admit):  # turnover: short requests arrive (and end after 1 frame)
            r = _request(1 + n % clients, n, 1)
            routers[r.handle >> CLIENT_SHIFT].open(r.handle, r.request_id, sink)
            engine.submit(r)
            n += 1
        sent.clear()
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        eng_s += t1 - t0
        for c, data in sent:  # the worker side, for client 1's share only
            if c != 1:
                continue
            t2 = time.perf_counter()
            step = pickle.loads(data)
            codes, pcm = engine.runner.codes[step.rows], engine.runner.pcm[step.rows]
            routers[1].deliver(step, codes, pcm)
            rtr_s += time.perf_counter() - t2
    return {"rows": rows, "clients": clients, "admit": admit, "engine_ms": 1e3 * eng_s / steps,
            "router_ms": 1e3 * rtr_s / steps, "chunks": chunks[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="host_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,512,2048", help="comma-separated rows per step (default: 64,512,2048)")
    ap.add_argument("--clients", type=int, default=4, help="API workers the rows are spread over")
    ap.add_argument("--admit", type=int, default=80, help="requests admitted (and finished) per step")
    ap.add_argument("--steps", type=int, default=50, help="steps timed per row count (default: 50)")
    ap.add_argument("--warmup", type=int, default=16, help="steps run first, not timed")
    ap.add_argument("--chunk-frames", type=int, default=4, help="frames per chunk after the first (no growth)")
    args = ap.parse_args(argv)
    print("| rows per step | admitted per step | engine host ms / step | one worker's router ms / step "
          f"(1/{args.clients} of the rows) |")
    print("|---|---|---|---|")
    for r in (int(x) for x in args.rows.split(",")):
        m = measure(r, args.clients, args.admit, args.steps, args.warmup, args.chunk_frames)
        print(f"| {r} | {args.admit} | {m['engine_ms']:.2f} | {m['router_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
