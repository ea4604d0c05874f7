"""CPU cost per stream of each output format's encoder (csmserve/audio/encoders.py, as the server uses it).

Each stream encodes SECONDS of audio in CHUNK-ms writes (80 ms: the server's first chunk; 320 ms: the later
ones); with --streams N, N encoders are written round-robin, as a server interleaves its streams. Reported:
CPU ms (process time, every thread counted) per second of audio, the threads each live encoder adds, and the
setup cost of one encoder (make_encoder + first write + close of a 1-chunk stream).

Variants (each in a fresh process, libav state is process-wide):
  default   make_encoder as the server calls it (mp3 / opus: their libraries called directly, audio/lame.py
            and audio/opus.py)
  libav     mp3 / opus through PyAV / libav instead (make_encoder(native=False)); the variants below too
  codec1    + the codec context's thread_count = 1, thread_type NONE (set before the codec opens)
  cpu1      + av_cpu_force_count(1) in libavutil (ctypes): the auto thread count of every libav object,
            the filter graph PyAV's encode() re-blocks audio through included
  cpu16     av_cpu_force_count(16): what a 16-core machine (the H200's) gets by default
  opts      codec options from --options (e.g. mp3:compression_level=7,opus:compression_level=5)

    python bench/encoder_cost.py                                 # all formats, 80/320 ms chunks, 1 and 64 streams
    python bench/encoder_cost.py --signal harmonic --variants default,cpu1 --out encoder_cost.md
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

RATE = 24_000
FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")
VARIANTS = ("default", "libav", "codec1", "cpu1", "cpu16", "opts")


def threads() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"Threads:\s+(\d+)", f.read()).group(1))


def signal(kind: str, seconds: float, seed: int = 0) -> np.ndarray:
    """[n] float32: noise (what the dummy model serves) or a speech-like harmonic tone with a syllable envelope."""
    n = int(seconds * RATE)
    if kind == "noise":
        return (np.random.default_rng(seed).standard_normal(n) * 0.2).astype(np.float32)
    t = np.arange(n) / RATE
    phase = 2 * np.pi * np.cumsum(120 + 25 * np.sin(2 * np.pi * 0.5 * t)) / RATE
    tone = sum(np.sin(k * phase) / k for k in range(1, 12))
    env = 0.3 + 0.7 * np.sin(2 * np.pi * 3.5 * t) ** 2
    return (0.3 * tone * env / np.abs(tone).max()).astype(np.float32)


def force_cpu_count(n: int) -> None:
    import ctypes
    import glob

    import av

    libs = os.path.join(os.path.dirname(av.__file__), os.pardir, "av.libs")
    found = glob.glob(os.path.join(libs, "libavutil*")) or glob.glob(os.path.join(os.path.dirname(av.__file__),
                                                                                   "**", "libavutil*"), recursive=True)
    lib = ctypes.CDLL(found[0]) if found else ctypes.CDLL("libavutil.so")
    lib.av_cpu_force_count(n)


def make(fmt: str, variant: str, options: dict[str, dict[str, str]] | None = None):
    from csmserve.audio.encoders import ENCODERS, make_encoder

    if variant == "opts" and fmt in (options or {}):
        cls = ENCODERS[fmt]
        cls = type(cls.__name__, (cls,), {"codec_options": {**cls.codec_options, **options[fmt]}})
        return cls(RATE)
    enc = make_encoder(fmt, RATE, native=variant == "default")
    if variant == "codec1" and hasattr(enc, "stream"):
        ctx = enc.stream.codec_context
        ctx.thread_count = 1
        ctx.thread_type = "NONE"
    return enc


def measure(fmt: str, chunk_ms: int, streams: int, variant: str, pcm: np.ndarray, repeats: int,
            options: dict | None = None) -> dict:
    chunk = RATE * chunk_ms // 1000
    pieces = [pcm[i:i + chunk] for i in range(0, pcm.size, chunk)]
    cpu_per_s, wall_per_s, added = [], [], 0
    for _ in range(repeats):
        base = threads()
        encs = [make(fmt, variant, options) for _ in range(streams)]
        for e in encs:  # the codec opens (and any thread pool starts) at the first write
            e.write(pieces[0])
        added = (threads() - base) / streams
        c0, w0 = time.process_time(), time.perf_counter()
        for piece in pieces[1:]:
            for e in encs:
                e.write(piece)
        for e in encs:
            e.close()
        c1, w1 = time.process_time(), time.perf_counter()
        audio = streams * (pcm.size - pieces[0].size) / RATE
        cpu_per_s.append((c1 - c0) * 1e3 / audio)
        wall_per_s.append((w1 - w0) * 1e3 / audio)
        del encs
    setup = []
    for _ in range(max(5, repeats)):
        c0 = time.process_time()
        e = make(fmt, variant, options)
        e.write(pieces[0])
        e.close()
        setup.append((time.process_time() - c0) * 1e3)
    return {"format": fmt, "chunk_ms": chunk_ms, "streams": streams, "variant": variant,
            "cpu_ms_per_s": statistics.median(cpu_per_s), "wall_ms_per_s": statistics.median(wall_per_s),
            "threads_per_encoder": added, "setup_ms": statistics.median(setup)}


def child(args: argparse.Namespace) -> None:
    if args.child in ("cpu1", "cpu16"):
        force_cpu_count(int(args.child[3:]))
    options = parse_options(args.options[-1] if args.options else "")
    pcm = signal(args.signal, args.seconds)
    for fmt in args.formats.split(","):
        if args.child != "default" and (fmt in ("pcm", "wav") or (args.child == "opts" and fmt not in options)
                                        or (args.child == "libav" and fmt not in ("mp3", "opus"))):
            continue  # no libav in them / no options given for it / libav already in default
        for chunk_ms in map(int, args.chunks.split(",")):
            for streams in map(int, args.streams.split(",")):
                r = measure(fmt, chunk_ms, streams, args.child, pcm, args.repeats, options)
                if args.child == "opts":
                    r["variant"] = ",".join(f"{k}={v}" for k, v in options[fmt].items())
                print(json.dumps(r), flush=True)


def parse_options(spec: str | None) -> dict[str, dict[str, str]]:
    """"mp3:compression_level=7,opus:compression_level=5" -> {"mp3": {...}, "opus": {...}}"""
    out: dict[str, dict[str, str]] = {}
    for item in filter(None, (spec or "").split(",")):
        fmt, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        out.setdefault(fmt.strip(), {})[key.strip()] = value.strip()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="audio per stream (default 10)")
    ap.add_argument("--chunks", default="80,320", help="write sizes in ms (default 80,320)")
    ap.add_argument("--streams", default="1,64", help="encoders written round-robin (default 1,64)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--signal", default="noise", choices=["noise", "harmonic"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--options", action="append", default=None,
                    help="codec options of an `opts` variant: fmt:key=value,...; repeatable (one variant each)")
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    import av

    rows = []
    runs = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            ap.error(f"unknown variant {variant!r}")
        runs += [(variant, o) for o in args.options or []] if variant == "opts" else [(variant, "")]
    for variant, options in runs:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--seconds", str(args.seconds),
               "--chunks", args.chunks, "--streams", args.streams, "--formats", args.formats,
               "--signal", args.signal, "--repeats", str(args.repeats), "--options", options]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ}).stdout
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    lines = [f"encoders: csmserve/audio/encoders.py, PyAV {av.__version__}, {os.cpu_count()} cores, "
             f"{args.seconds:g} s of {args.signal} per stream, median of {args.repeats}",
             "", "| format | write (ms) | streams | variant | CPU ms per s of audio | wall ms per s of audio | "
             "threads per encoder | setup ms (open + 1 write + close) |", "|---|---|---|---|---|---|---|---|"]
    rows.sort(key=lambda r: (FORMATS.index(r["format"]), r["chunk_ms"], r["streams"],
                             VARIANTS.index(r["variant"]) if r["variant"] in VARIANTS else len(VARIANTS)))
    for r in rows:
        lines.append(f"| {r['format']} | {r['chunk_ms']} | {r['streams']} | {r['variant']} | {r['cpu_ms_per_s']:.2f} | "
                     f"{r['wall_ms_per_s']:.2f} | {r['threads_per_encoder']:.1f} | {r['setup_ms']:.2f} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
