"""`csmserve` command line (also `python -m csmserve`): `speak`, `serve`, `bench`, `talk` (csmserve/apps/talk.py).

    csmserve speak "Hello there." -o hello.wav --model dummy-tiny
    csmserve speak -i chapter.txt -o chapter.mp3 --voice narrator --seed 1
    echo "Hi." | csmserve speak - -o - --format pcm | aplay -f S16_LE -r 24000 -c 1
    csmserve speak -i chapter.txt -o chapter.opus --url http://localhost:8000
    csmserve serve --model sesame/csm-1b
    csmserve bench
    csmserve talk --input-wav q.wav --asr-url http://localhost:9000/v1 --llm-url http://localhost:8080/v1 --out-dir out

Errors (bad flags, unreadable files, a server's refusal) are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, NoReturn

import numpy as np

from csmserve.extras import MissingExtraError
from csmserve.config import SAMPLE_RATE

FRAME_S = 0.08
EXTENSIONS = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".opus": "opus", ".ogg": "opus", ".pcm": "pcm",
              ".raw": "pcm", ".aac": "aac", ".npy": "npy"}
FORMATS = ("wav", "mp3", "flac", "opus", "pcm", "aac", "npy")
CHARS_PER_SECOND = 14.0  # rough speaking rate: the progress bar's estimate of the total
URL_CHUNK_CHARS = 4000  # under the server's default --max-input-chars (4096)


def one_line(e: BaseException) -> str:
    """An error's whole message on one line (a hint after the first line is kept)."""
    return " ".join(str(e).split()) or type(e).__name__


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`csmserve speak: error: ...`) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------- parsers
def _speak_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "speak", help="speech for any length of text, into an audio file or stdout",
        description="Speak TEXT (or -i FILE, or - for stdin) into OUT (-o; - for stdout). Long text is "
                    "split into sentences and spoken as one continuous stream in one voice.")
    src = p.add_argument_group("input and output")
    src.add_argument("text", nargs="?", help="the text to speak; - reads stdin")
    src.add_argument("-i", "--input", metavar="FILE", help="read the text from FILE (- for stdin)")
    src.add_argument("--script", metavar="FILE",
                     help="a dialogue (- for stdin): '[S1] Hi. [S2] Hello!' ([Sn] is speaker n-1), or a JSON list "
                          "of lines {\"text\", \"speaker\"?, \"voice\"?}; each line hears the lines before it")
    src.add_argument("--voices", metavar="V1,V2", default=None,
                     help="with --script: the stored voices of [S1], [S2], ... (comma-separated; empty: none)")
    src.add_argument("-o", "--output", required=True, metavar="OUT",
                     help="output file (.wav .mp3 .flac .opus .ogg .pcm .aac, or .npy for the Mimi codes); "
                          "- writes the audio bytes to stdout")
    src.add_argument("--format", choices=FORMATS, default=None,
                     help="output format (default: from OUT's extension; wav for stdout). "
                          "pcm is 24 kHz s16le mono without a header")
    model = p.add_argument_group("model (in-process)")
    model.add_argument("--model", default="sesame/csm-1b",
                       help="hub id, local directory, or dummy / dummy-tiny (random weights, no download)")
    model.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    model.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                       help="default: bfloat16 on cuda, float32 on cpu")
    model.add_argument("--codec", default=None, help="Mimi weights (default: beside the model)")
    server = p.add_argument_group("server (instead of in-process)")
    server.add_argument("--url", default=None,
                        help="a running `csmserve serve` (e.g. http://localhost:8000): POST /v1/audio/speech")
    server.add_argument("--api-key", default=os.environ.get("CSMSERVE_API_KEY"),
                        help="Bearer key for --url [env CSMSERVE_API_KEY]")
    voice = p.add_argument_group("voice")
    voice.add_argument("--voice", default=None,
                       help="a stored voice's id or name (or an OpenAI voice name); with --url the server's")
    voice.add_argument("--voices-db", default=None,
                       help="stored voices: an SQLite file or a postgresql:// URL "
                            "(default: $XDG_DATA_HOME/csmserve/voices.db)")
    voice.add_argument("--ref-audio", metavar="FILE", default=None,
                       help="a one-off reference clip (any common audio file) to speak like")
    voice.add_argument("--ref-text", default=None, help="what --ref-audio says (required with it)")
    voice.add_argument("--speaker", type=int, default=None, help="CSM speaker id 0..255 (default: the voice's, or 0)")
    samp = p.add_argument_group("sampling")
    samp.add_argument("--temperature", type=float, default=0.9, help="0 = greedy (default 0.9)")
    samp.add_argument("--top-k", type=int, default=50, help="<= 0 disables (default 50)")
    samp.add_argument("--top-p", type=float, default=1.0, help="(default 1.0)")
    samp.add_argument("--seed", type=int, default=None, help="same seed + same text = same audio (default: random)")
    samp.add_argument("--max-audio-length-ms", type=int, default=None,
                      help="cap on each sentence's audio (default: the model's / server's)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary on stderr")
    p.set_defaults(func=speak)


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from csmserve.apps.bench.engine import add_arguments
    from csmserve.apps.bench.serve import add_arguments as add_serve_arguments

    p = sub.add_parser("bench", help="the engine benchmark on this machine's GPU (tables of frames/s, latency)",
                       description="One stream, a concurrency sweep and memory on the local GPU, with random "
                                   "full-size weights by default (they cost what real ones do). Without a GPU: "
                                   "--model dummy-tiny for a tiny CPU run. With --serve: load through the real "
                                   "server (csmserve serve started with --model, --max-seq-len, ...) from "
                                   "streaming HTTP and WebSocket clients.")
    add_arguments(p)
    p.add_argument("--serve", action="store_true",
                   help="benchmark the server instead: closed loop, bursts, formats, WebSocket (flags below)")
    add_serve_arguments(p, shared=True)
    p.set_defaults(func=bench)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="csmserve", description="Streaming inference for Sesame CSM-1B.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _speak_parser(sub)
    from csmserve.apps.cli.serve import run_serve
    from csmserve.server.flags import add_serve_parser

    add_serve_parser(sub).set_defaults(func=run_serve)
    _bench_parser(sub)
    from csmserve.apps.talk import add_talk_parser

    add_talk_parser(sub)
    return parser


# ---------------------------------------------------------------- speak: arguments
def _check_args(args: argparse.Namespace) -> None:
    if sum(x is not None for x in (args.text, args.input, args.script)) > 1:
        raise CLIError("give one of TEXT, -i FILE and --script FILE, not both")
    if args.text is None and args.input is None and args.script is None:
        raise CLIError("no text: give TEXT, -i FILE, --script FILE, or - to read stdin")
    if args.voices is not None and args.script is None:
        raise CLIError("--voices goes with --script (the voices of [S1], [S2], ...)")
    if args.script is not None and (args.ref_audio is not None or args.speaker is not None):
        raise CLIError("--script names its speakers itself: no --ref-audio or --speaker with it")
    if args.format is None:
        if args.output == "-":
            args.format = "wav"
        else:
            ext = Path(args.output).suffix.lower()
            if ext not in EXTENSIONS:
                raise CLIError(f"cannot tell the format of {args.output!r} from its extension; "
                               f"use .wav .mp3 .flac .opus .pcm .aac .npy or --format")
            args.format = EXTENSIONS[ext]
    if args.format == "npy" and (args.output == "-" or args.url):
        raise CLIError("npy (Mimi codes) needs an output file and the in-process model (no --url)")
    if (args.ref_audio is None) != (args.ref_text is None):
        raise CLIError("--ref-audio and --ref-text go together (the clip and what it says)")
    if args.ref_audio is not None and args.voice is not None:
        raise CLIError("give --voice or --ref-audio, not both")
    if args.speaker is not None and not 0 <= args.speaker <= 255:
        raise CLIError(f"--speaker must be in 0..255, got {args.speaker}")
    if args.temperature < 0:
        raise CLIError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise CLIError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_audio_length_ms is not None and args.max_audio_length_ms < 80:
        raise CLIError(f"--max-audio-length-ms must be >= 80 (one frame), got {args.max_audio_length_ms}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise CLIError(f"--seed must be in 0..2**63-1, got {args.seed}")
    if args.url is not None and not re.match(r"^https?://", args.url):
        raise CLIError(f"--url must start with http:// or https://, got {args.url!r}")


def read_script(args: argparse.Namespace) -> list:
    """--script FILE -> the dialogue's lines (csmserve/prompt/dialogue.py)."""
    from csmserve.prompt.dialogue import read_script as parse

    raw = sys.stdin.read() if args.script == "-" else None
    if raw is None:
        try:
            raw = Path(args.script).read_text(encoding="utf-8")
        except OSError as e:
            raise CLIError(f"cannot read {args.script!r}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise CLIError(f"{args.script!r} is not UTF-8 text") from None
    voices = [v.strip() or None for v in args.voices.split(",")] if args.voices else []
    try:
        return parse(raw, voices)
    except ValueError as e:
        raise CLIError(f"--script {args.script!r}: {e}") from None


def read_text(args: argparse.Namespace) -> str:
    if args.script is not None:
        args.lines = read_script(args)
        return " ".join(ln.text for ln in args.lines)
    args.lines = None
    source = args.input if args.input is not None else args.text
    if args.input is not None or source == "-":
        try:
            if source == "-":
                text = sys.stdin.read()
            else:
                text = Path(source).read_text(encoding="utf-8")
        except OSError as e:
            raise CLIError(f"cannot read {source!r}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise CLIError(f"{source!r} is not UTF-8 text") from None
    else:
        text = source
    text = " ".join(text.split())
    if not text:
        raise CLIError("the text is empty")
    return text


def read_bytes(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise CLIError(f"cannot read {what} {path!r}: {e.strerror or e}") from None


def split_sentences(text: str) -> list[str]:
    """Sentences (the fallback when CSM.speak is not there): split after . ! ? followed by a space."""
    parts = re.split(r"(?<=[.!?…])[\"')\]]*\s+", text)
    return [p.strip() for p in parts if p.strip()]


# ---------------------------------------------------------------- speak: output
class Output:
    """Encodes float PCM chunks into the chosen format and writes them to a file or stdout."""

    def __init__(self, path: str, fmt: str) -> None:
        self.path, self.fmt = path, fmt
        self.samples = 0
        self.codes: list[np.ndarray] = []
        self.encoder = None
        if fmt != "npy":
            try:
                from csmserve.audio import make_encoder
            except ImportError as e:
                raise CLIError(f"audio output needs PyAV ({e}): pip install av") from None
            self.encoder = make_encoder(fmt, SAMPLE_RATE)
        if path == "-":
            self.file: IO[bytes] = sys.stdout.buffer
        else:
            try:
                self.file = open(path, "wb")
            except OSError as e:
                raise CLIError(f"cannot write {path!r}: {e.strerror or e}") from None

    def write(self, audio: np.ndarray, codes: np.ndarray | None = None) -> None:
        self.samples += audio.size
        if codes is not None and self.fmt == "npy":
            self.codes.append(codes)
        if self.encoder is not None and audio.size:
            self._put(self.encoder.write(audio))

    def write_pcm16(self, data: bytes) -> None:
        """Raw s16le bytes (what --url asks the server for)."""
        if len(data) % 2:
            raise ValueError("odd number of PCM bytes")
        self.write(np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767)

    def _put(self, data: bytes) -> None:
        if data:
            self.file.write(data)
            self.file.flush()

    def close(self) -> None:
        if self.encoder is not None:
            self._put(self.encoder.close())
        if self.fmt == "npy":
            codes = np.concatenate(self.codes) if self.codes else np.zeros((0, 32), np.int64)
            np.save(self.file, codes)
        if self.fmt == "wav" and self.path != "-":
            self._fix_wav_sizes()
        if self.path != "-":
            self.file.close()

    def _fix_wav_sizes(self) -> None:
        # the streaming header says 0xFFFFFFFF (unknown); a file can be rewritten with the real sizes
        import struct

        data = self.samples * 2
        if data + 36 < 2**32:
            self.file.seek(4)
            self.file.write(struct.pack("<I", 36 + data))
            self.file.seek(40)
            self.file.write(struct.pack("<I", data))

    @property
    def seconds(self) -> float:
        return self.samples / SAMPLE_RATE


class Progress:
    """A rich progress bar on stderr, in seconds of audio against an estimate from the text length."""

    def __init__(self, text: str, enabled: bool) -> None:
        self.start = time.perf_counter()
        self.load_s = 0.0
        self.first: float | None = None
        self.enabled, self.total = enabled, max(1.0, len(text) / CHARS_PER_SECOND)
        self.bar = None

    def _show(self) -> None:
        """Start drawing (once the model is loaded or audio arrives: an early error stays one line)."""
        if self.bar is not None or not self.enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress as Bar, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.bar = Bar(SpinnerColumn(), TextColumn("[bold]speaking"), BarColumn(),
                       TextColumn("{task.completed:.1f} / ~{task.total:.1f} s of audio"),
                       TextColumn("{task.fields[rt]}"), TimeElapsedColumn(),
                       console=Console(file=sys.stderr), transient=False)
        self.task = self.bar.add_task("speak", total=self.total, rt="")
        self.bar.start()

    def loaded(self) -> None:
        """The model is loaded: time to first audio and the real-time factor count from here."""
        now = time.perf_counter()
        self.load_s, self.start = now - self.start, now
        self._show()

    def update(self, seconds: float) -> None:
        now = time.perf_counter()
        if self.first is None and seconds > 0:
            self.first = now
        self._show()
        if self.bar is not None:
            wall = now - self.start
            rt = f"{seconds / wall:.2f}x real time" if wall > 0 and seconds > 0 else ""
            self.total = max(self.total, seconds)
            self.bar.update(self.task, completed=seconds, total=self.total, rt=rt)

    def finish(self, seconds: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=seconds, total=max(seconds, 0.01))
            self.bar.stop()


# ---------------------------------------------------------------- speak
def speak(args: argparse.Namespace) -> int:
    _check_args(args)
    text = read_text(args)
    ref = read_bytes(args.ref_audio, "--ref-audio") if args.ref_audio is not None else None
    ref_pcm = _decode_ref(ref, args.ref_audio) if ref is not None and not args.url else None
    out = Output(args.output, args.format)
    progress = Progress(text, enabled=not args.quiet)
    ok = False
    try:
        if args.url:
            finish = _speak_url(args, text, ref, out, progress)
        else:
            finish = _speak_local(args, text, ref_pcm, out, progress)
        ok = True
    finally:
        progress.finish(out.seconds)
        if ok:
            out.close()
        elif args.output != "-":  # no half-written file left behind
            out.file.close()
            Path(args.output).unlink(missing_ok=True)
    if not args.quiet:
        wall = time.perf_counter() - progress.start
        ttfa = f", first audio after {progress.first - progress.start:.2f} s" if progress.first else ""
        where = "stdout" if args.output == "-" else args.output
        load = f" (+{progress.load_s:.1f} s loading the model)" if progress.load_s else ""
        print(f"{where}: {out.seconds:.2f} s of audio ({args.format}) in {wall:.1f} s{load}{ttfa}{finish}",
              file=sys.stderr)
    return 0


def _speak_local(args, text: str, ref_pcm: np.ndarray | None, out: Output, progress: Progress) -> str:
    from csmserve.api import CSM, Segment
    from csmserve.config import EngineConfig

    context: list[Segment] = []
    speaker = args.speaker
    if args.voice is not None and args.lines is None:  # (a script casts its voices itself)
        from csmserve.voices import VoiceNotFoundError, open_voice_store

        with open_voice_store(args.voices_db) as store:
            try:
                resolved = store.resolve(args.voice)
            except VoiceNotFoundError:
                raise CLIError(f"voice {args.voice!r} not found in {store.path}") from None
        if resolved.voice is not None:
            v = resolved.voice
            context.append(Segment(v.speaker, v.transcript, codes=v.codes))
        speaker = resolved.speaker if speaker is None else speaker
    speaker = 0 if speaker is None else speaker
    script = _cast_script(args) if args.lines is not None else None
    csm = CSM(args.model, device=args.device, dtype=args.dtype, codec=args.codec,
              engine_config=EngineConfig(max_slots=2, max_seq_len=2048))
    try:
        if args.format != "npy" and csm.mimi is None:
            raise CLIError("this model has no Mimi codec, so no audio: write .npy codes, or pass --codec")
        if ref_pcm is not None:
            context.append(Segment(speaker, args.ref_text, codes=csm.encode_audio(ref_pcm)))
        progress.loaded()
        kw = dict(speaker=speaker, context=context, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed)
        if args.max_audio_length_ms is not None:  # per sentence (the whole text has no cap)
            kw["max_segment_length_ms"] = args.max_audio_length_ms
        reasons: dict[str, int] = {}
        if script is not None:  # a dialogue: its voices' clips first, then the lines, each with its speaker
            lines, clips = script
            kw.pop("speaker")
            chunks = csm.dialogue(lines, context=clips + kw.pop("context"), **kw)
        else:
            chunks = _long_form(csm, text, kw)
        for chunk in chunks:
            out.write(chunk.audio, chunk.codes)
            progress.update(out.seconds)
            if chunk.final and chunk.finish_reason:
                reasons[chunk.finish_reason] = reasons.get(chunk.finish_reason, 0) + 1
        if "error" in reasons or "abort" in reasons:
            raise CLIError(f"generation stopped early ({', '.join(reasons)})")
    finally:
        csm.close()
    done = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
    return f" (segments: {done})" if done else ""


def _cast_script(args) -> tuple[list[tuple[int, str]], list]:
    """The script's lines as (speaker, text), and each stored voice's clip as the id it speaks with."""
    from csmserve.api import Segment
    from csmserve.prompt.dialogue import cast
    from csmserve.voices import VoiceNotFoundError, VoiceStore

    lines, c = cast(args.lines, args.voice)
    clips = []
    if c.voices:
        with VoiceStore(args.voices_db) as store:
            for name, speaker in c.voices.items():
                try:
                    resolved = store.resolve(name)
                except VoiceNotFoundError:
                    raise CLIError(f"voice {name!r} not found in {store.path}") from None
                if resolved.voice is not None:
                    v = resolved.voice
                    clips.append(Segment(speaker, v.transcript, codes=v.codes))
    return [(spk, ln.text) for spk, ln in zip(c.speakers, lines)], clips


def _long_form(csm, text: str, kw: dict) -> Iterator:
    """CSM.speak (the long-form path: segments in one slot, one continuous stream) when the API has it;
    else one CSM.stream per sentence, each after the previous sentence as context."""
    if hasattr(csm, "speak"):
        yield from csm.speak(text, **kw)
        return
    from csmserve.api import Segment

    base = list(kw.pop("context"))
    kw["max_audio_length_ms"] = kw.pop("max_segment_length_ms", 10_000)
    seed = kw.pop("seed")
    prev = None
    for i, sentence in enumerate(split_sentences(text)):
        context = base + ([prev] if prev is not None else [])
        codes = []
        for chunk in csm.stream(sentence, context=context, seed=None if seed is None else seed + i, **kw):
            codes.append(chunk.codes)
            yield chunk
        if codes:
            prev = Segment(kw["speaker"], sentence, codes=np.concatenate(codes))


def _decode_ref(data: bytes, path: str) -> np.ndarray:
    from csmserve.audio import AudioDecodeError, decode_audio_24k

    try:
        return decode_audio_24k(data, max_seconds=120)
    except AudioDecodeError as e:
        raise CLIError(f"--ref-audio {path!r}: {e}") from None


def _speak_url(args, text: str, ref: bytes | None, out: Output, progress: Progress) -> str:
    """POST /v1/audio/speech per piece of text (pcm, streamed), encoded here into one file."""
    import httpx

    url = args.url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    body: dict = {"model": "csm-1b", "voice": args.voice or "alloy", "response_format": "pcm",
                  "temperature": args.temperature, "top_k": max(args.top_k, 0), "top_p": args.top_p}
    for name in ("speaker", "seed"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.max_audio_length_ms is not None:  # per sentence; the server sizes the whole from the text
        body["max_segment_length_ms"] = args.max_audio_length_ms
    if ref is not None:
        body["context"] = [{"speaker": args.speaker or 0, "text": args.ref_text,
                            "audio": base64.b64encode(ref).decode()}]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pieces = _pieces(text, URL_CHUNK_CHARS) if args.lines is None else [
        [{k: v for k, v in (("text", ln.text), ("speaker", ln.speaker), ("voice", ln.voice)) if v is not None}
         for ln in args.lines]]  # a dialogue: one request
    with httpx.Client(timeout=httpx.Timeout(30.0, read=600.0), headers=headers) as client:
        for i, piece in enumerate(pieces):
            req = {**body, "input": piece}
            if args.seed is not None:
                req["seed"] = args.seed + i
            try:
                with client.stream("POST", f"{url}/v1/audio/speech", json=req) as r:
                    if r.status_code != 200:
                        raise CLIError(f"{url}: HTTP {r.status_code}: {_error_message(r.read())}")
                    carry = b""
                    for data in r.iter_bytes():
                        data, carry = carry + data, b""
                        if len(data) % 2:
                            data, carry = data[:-1], data[-1:]
                        out.write_pcm16(data)
                        progress.update(out.seconds)
            except httpx.HTTPError as e:
                raise CLIError(f"{url}: {type(e).__name__}: {e}") from None
    return f" from {url} ({len(pieces)} request{'s' if len(pieces) != 1 else ''})"


def _pieces(text: str, limit: int) -> list[str]:
    """Whole sentences packed into pieces of at most `limit` characters (a longer sentence is cut at spaces)."""
    pieces: list[str] = []
    cur = ""
    for sentence in split_sentences(text):
        while len(sentence) > limit:
            cut = sentence.rfind(" ", 0, limit)
            cut = cut if cut > 0 else limit
            sentence, head = sentence[cut:].strip(), sentence[:cut].strip()
            if cur:
                pieces.append(cur)
                cur = ""
            pieces.append(head)
        if cur and len(cur) + 1 + len(sentence) > limit:
            pieces.append(cur)
            cur = ""
        cur = f"{cur} {sentence}".strip()
    if cur:
        pieces.append(cur)
    return pieces


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace").strip() or "no body"


# ---------------------------------------------------------------- bench
def bench(args: argparse.Namespace) -> int:
    if args.serve:
        from csmserve.apps.bench.serve import run
    else:
        from csmserve.apps.bench.engine import run

    return run(args)


# ---------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"csmserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `csmserve speak ... -o - | head`: the reader left
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 1
    except (CLIError, ValueError, NotImplementedError, RuntimeError, OSError, MissingExtraError) as e:
        msg = one_line(e)
        print(f"csmserve {args.command}: error: {msg}", file=sys.stderr)
        return 2

