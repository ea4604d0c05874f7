"""`csmserve talk`: its flags (add_talk_parser) and the command (talk): turns from audio files or typed
lines, each assistant reply to DIR/turn-NN.wav or raw PCM on stdout, a line per turn on stderr."""
from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from csmserve.apps.common import CLIError, check_sampling, check_url, pcm16, wav_bytes
from csmserve.apps.talk.llm import SYSTEM_PROMPT
from csmserve.apps.talk.session import Exchange, TalkSession
from csmserve.config import FRAME_MS


def add_talk_parser(sub) -> None:
    p = sub.add_parser(
        "talk", help="a spoken conversation with any OpenAI-compatible LLM (and ASR), CSM speaking",
        description="Each turn: your speech (--input-wav, repeatable) is transcribed by --asr-url, or a line "
                    "is typed (--typed, from stdin); the LLM at --llm-url replies (streamed) and CSM speaks "
                    "the reply as it arrives, with the whole conversation (both sides' audio) as context. "
                    "Latency per turn is printed on stderr.")
    io_ = p.add_argument_group("turns")
    io_.add_argument("--input-wav", action="append", default=[], metavar="FILE",
                     help="a user turn as an audio file (repeat for several turns, in order)")
    io_.add_argument("--typed", action="store_true",
                     help="user turns typed as lines on stdin (a line typed while the assistant speaks barges in)")
    io_.add_argument("--out-dir", default=None, metavar="DIR",
                     help="write each assistant turn to DIR/turn-NN.wav (default: raw 24 kHz s16le PCM on stdout)")
    io_.add_argument("--barge-in-after-ms", type=int, default=None, metavar="MS",
                     help="test hook: the user speaks again after MS of each reply's audio (it is cut there)")
    ep = p.add_argument_group("endpoints (OpenAI-compatible)")
    ep.add_argument("--llm-url", required=True, help="chat completions base URL, e.g. http://localhost:8080/v1")
    ep.add_argument("--llm-model", default="default", help="model name sent to the LLM (default: 'default')")
    ep.add_argument("--asr-url", default=None, help="transcriptions base URL, e.g. http://localhost:9000/v1")
    ep.add_argument("--asr-model", default="whisper-1", help="model name sent to the ASR (default whisper-1)")
    ep.add_argument("--endpoint-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="Bearer key for the LLM/ASR endpoints [env OPENAI_API_KEY]")
    ep.add_argument("--system-prompt", default=SYSTEM_PROMPT, help="the LLM's system message")
    ep.add_argument("--timeout", type=float, default=60.0, help="seconds per endpoint call (default 60)")
    server = p.add_argument_group("CSM through a server (instead of in-process)")
    server.add_argument("--url", default=None,
                        help="a running `csmserve serve` (e.g. http://localhost:8000): its WebSocket, one context_id")
    server.add_argument("--api-key", default=os.environ.get("CSMSERVE_API_KEY"),
                        help="Bearer key for --url [env CSMSERVE_API_KEY]")
    server.add_argument("--voice", default=None, help="with --url: the server's voice (id, name or alias)")
    model = p.add_argument_group("CSM (in-process)")
    model.add_argument("--model", default="sesame/csm-1b",
                       help="hub id, local directory, or dummy-tiny (random weights, offline)")
    model.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    model.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    model.add_argument("--codec", default=None, help="Mimi weights (default: beside the model)")
    voice = p.add_argument_group("voices and sampling")
    voice.add_argument("--speaker", type=int, default=0, help="the assistant's CSM speaker id (default 0)")
    voice.add_argument("--user-speaker", type=int, default=1, help="the user's CSM speaker id (default 1)")
    voice.add_argument("--temperature", type=float, default=0.9)
    voice.add_argument("--top-k", type=int, default=50)
    voice.add_argument("--seed", type=int, default=None)
    voice.add_argument("--max-audio-length-ms", type=int, default=20_000, help="cap per sentence (default 20000)")
    voice.add_argument("--max-context-frames", type=int, default=1000,
                       help="audio frames of earlier turns kept in CSM's context, oldest dropped (default 1000)")
    p.set_defaults(func=talk)


def talk(args) -> int:
    """The conversation, a turn per --input-wav file then per typed line -> 1 if any turn failed, else 0."""
    _check_args(args)
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    csm = None if args.url else _load_csm(args)

    def on_audio(turn: Exchange, pcm: np.ndarray) -> None:
        if not args.out_dir:
            sys.stdout.buffer.write(pcm16(pcm))
            sys.stdout.buffer.flush()

    session = TalkSession(csm, args.llm_url, args.llm_model, args.asr_url, args.asr_model, args.speaker,
                          args.user_speaker, args.system_prompt or None, args.temperature, args.top_k,
                          seed=args.seed, max_audio_length_ms=args.max_audio_length_ms,
                          max_context_frames=args.max_context_frames, api_key=args.endpoint_key,
                          timeout=args.timeout, on_audio=on_audio,
                          log=lambda s: print(f"csmserve talk: {s}", file=sys.stderr, flush=True),
                          url=args.url, server_key=args.api_key, voice=args.voice)
    failed = 0
    try:
        for wav, text, name in _turn_inputs(args, session):
            turn = session.turn(wav, text, name=name, barge_in_after_ms=args.barge_in_after_ms)
            if turn.error:
                failed += 1
            else:
                _report(args, turn)
    finally:
        session.close()
        if csm is not None:
            csm.close()
    return 1 if failed else 0


def _check_args(args) -> None:
    if not args.input_wav and not args.typed:
        raise CLIError("no turns: give --input-wav FILE (repeatable) or --typed (lines on stdin)")
    if args.input_wav and not args.asr_url:
        raise CLIError("--input-wav needs --asr-url (an OpenAI-compatible /v1/audio/transcriptions endpoint)")
    for name in ("speaker", "user_speaker"):
        if not 0 <= getattr(args, name) <= 255:
            raise CLIError(f"--{name.replace('_', '-')} must be in 0..255")
    for name in ("llm_url", "asr_url", "url"):
        check_url(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.barge_in_after_ms is not None and args.barge_in_after_ms < 1:
        raise CLIError("--barge-in-after-ms must be >= 1")
    check_sampling(args)


def _load_csm(args):
    """The in-process CSM (without --url); it must have the Mimi codec (audio in and out)."""
    from csmserve.api import CSM
    from csmserve.config import EngineConfig

    csm = CSM(args.model, device=args.device, dtype=args.dtype, codec=args.codec,
              engine_config=EngineConfig(max_slots=2, max_seq_len=2048))
    if csm.mimi is None:
        csm.close()
        raise CLIError("talk needs the Mimi codec (audio in and out): pass --codec")
    return csm


def _report(args, turn: Exchange) -> None:
    """A turn that went through: its WAV (with --out-dir) and its line on stderr."""
    if args.out_dir:
        (Path(args.out_dir) / f"turn-{turn.index:02d}.wav").write_bytes(wav_bytes(turn.audio))
    cut = " (cut: barge-in)" if turn.interrupted else ""
    print(f"csmserve talk: turn {turn.index}: you: {turn.user_text!r} -> {turn.reply_text!r}{cut}, "
          f"{turn.frames * FRAME_MS / 1000:.2f} s of audio; {turn.latency_line()}", file=sys.stderr, flush=True)


def _turn_inputs(args, session: TalkSession) -> Iterator[tuple[bytes | None, str | None, str]]:
    """The user's turns as (audio bytes, typed text, name): each --input-wav file, then with --typed each line."""
    for path in args.input_wav:
        try:
            yield Path(path).read_bytes(), None, path
        except OSError as e:
            session.log(f"error: cannot read {path!r}: {e.strerror or e}")
    if args.typed:
        lines: queue.Queue = queue.Queue()

        def reader() -> None:  # lines typed while the assistant speaks barge in
            for line in sys.stdin:
                lines.put(line)
                if session.speaking:
                    session.interrupt()
            lines.put(None)

        threading.Thread(target=reader, daemon=True, name="csmserve-talk-stdin").start()
        while (line := lines.get()) is not None:
            if line.strip():
                yield None, line, "stdin"
