"""`csmserve speak`: speech for any length of text (or a dialogue script) into an audio file or stdout,
in-process (CSM.speak / CSM.dialogue) or through a running server (--url: POST /v1/audio/speech)."""
from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from pathlib import Path

import numpy as np

from csmserve.apps.cli.output import Output
from csmserve.apps.cli.progress import Progress
from csmserve.apps.cli.text import pieces, read_text
from csmserve.apps.common import CLIError, base_url, bearer, check_url, error_message, read_clip, check_sampling

EXTENSIONS = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".opus": "opus", ".ogg": "opus", ".pcm": "pcm",
              ".raw": "pcm", ".aac": "aac", ".npy": "npy"}
FORMATS = ("wav", "mp3", "flac", "opus", "pcm", "aac", "npy")
URL_CHUNK_CHARS = 4000  # under the server's default --max-input-chars (4096)
# ---------------------------------------------------------------- arguments
def add_speak_parser(sub: argparse._SubParsersAction) -> None:
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
                     help="the output's format; pcm is 24 kHz s16le mono without a header (default: from OUT's "
                          "extension; wav for stdout)")
    model = p.add_argument_group("model (in-process)")
    model.add_argument("--model", default="sesame/csm-1b", metavar="ID|PATH",
                       help="hub id, local directory, or dummy / dummy-tiny (random weights, no download) "
                            "(default: sesame/csm-1b)")
    model.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    model.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                       help="the model's dtype (default: bfloat16 on cuda, float32 on cpu)")
    model.add_argument("--codec", default=None, metavar="PATH",
                       help="Mimi's weights: a kyutai/mimi directory or moshi safetensors (default: beside the model)")
    model.add_argument("--lora", default=None, metavar="[NAME=]PATH",
                       help="speak with this PEFT / unsloth LoRA fine-tune (its adapter directory) on the model "
                            "(default: the model alone; a stored voice bound to an adapter needs it)")
    server = p.add_argument_group("server (instead of in-process)")
    server.add_argument("--url", default=None,
                        help="a running `csmserve serve` (e.g. http://localhost:8000): POST /v1/audio/speech "
                             "(default: the model in this process)")
    server.add_argument("--api-key", default=os.environ.get("CSMSERVE_API_KEY"), metavar="KEY",
                        help="Bearer key for --url (default: $CSMSERVE_API_KEY, else none)")
    server.add_argument("--adapter", default=None, metavar="NAME",
                        help="with --url: a LoRA adapter the server serves (the request's `model`; GET /v1/models "
                             "lists them) (default: the voice's adapter, else the base)")
    voice = p.add_argument_group("voice")
    voice.add_argument("--voice", default=None,
                       help="a stored voice's id or name, or an OpenAI voice name; with --url the server's "
                            "(default: none, speaker 0; alloy with --url)")
    voice.add_argument("--voices-db", default=None, metavar="PATH|URL",
                       help="stored voices: an SQLite file or a postgresql:// URL "
                            "(default: $XDG_DATA_HOME/csmserve/voices.db)")
    voice.add_argument("--ref-audio", metavar="FILE", default=None,
                       help="a one-off reference clip (any common audio file) to speak like (default: none)")
    voice.add_argument("--ref-text", default=None, metavar="TEXT", help="what --ref-audio says (required with it)")
    voice.add_argument("--speaker", type=int, default=None, metavar="ID",
                       help="CSM speaker id 0..255 (default: the voice's, or 0)")
    samp = p.add_argument_group("sampling")
    samp.add_argument("--temperature", type=float, default=0.9, metavar="X",
                      help="sampling temperature; 0: greedy (default: 0.9)")
    samp.add_argument("--top-k", type=int, default=50, metavar="K",
                      help="sample among the K most likely codes; <= 0: all (default: 50)")
    samp.add_argument("--top-p", type=float, default=1.0, metavar="P",
                      help="sample among the most likely codes holding P of the probability; 1: all (default: 1.0)")
    samp.add_argument("--seed", type=int, default=None, metavar="N",
                      help="same seed + same text = same audio (default: random)")
    samp.add_argument("--max-audio-length-ms", type=int, default=None, metavar="MS",
                      help="cap on each sentence's audio (default: 20000, a reader's length on random weights; "
                           "with --url the server's --max-segment-ms)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary on stderr")
    p.set_defaults(func=speak)


def check_args(args: argparse.Namespace) -> None:
    """CLIError for flags that do not go together or a value out of range; fills in args.format."""
    if sum(x is not None for x in (args.text, args.input, args.script)) > 1:
        raise CLIError("give one of TEXT, -i FILE and --script FILE, not both")
    if args.text is None and args.input is None and args.script is None:
        raise CLIError("no text: give TEXT, -i FILE, --script FILE, or - to read stdin")
    if args.voices is not None and args.script is None:
        raise CLIError("--voices goes with --script (the voices of [S1], [S2], ...)")
    if args.script is not None and (args.ref_audio is not None or args.speaker is not None):
        raise CLIError("--script names its speakers itself: no --ref-audio or --speaker with it")
    if args.lora is not None and args.url:
        raise CLIError("--lora loads an adapter into this process's model; with --url name one the server serves "
                       "with --adapter NAME")
    if args.adapter is not None and not args.url:
        raise CLIError("--adapter names an adapter of a server (--url); in-process give its directory with --lora")
    if args.format is None and args.output == "-":
        args.format = "wav"
    elif args.format is None:
        args.format = EXTENSIONS.get(Path(args.output).suffix.lower())
        if args.format is None:
            raise CLIError(f"cannot tell the format of {args.output!r} from its extension; "
                           f"use .wav .mp3 .flac .opus .pcm .aac .npy or --format")
    if args.format == "npy" and (args.output == "-" or args.url):
        raise CLIError("npy (Mimi codes) needs an output file and the in-process model (no --url)")
    if (args.ref_audio is None) != (args.ref_text is None):
        raise CLIError("--ref-audio and --ref-text go together (the clip and what it says)")
    if args.ref_audio is not None and args.voice is not None:
        raise CLIError("give --voice or --ref-audio, not both")
    if args.speaker is not None and not 0 <= args.speaker <= 255:
        raise CLIError(f"--speaker must be in 0..255, got {args.speaker}")
    check_sampling(args)
    check_url("--url", args.url)


# ---------------------------------------------------------------- the command
def speak(args: argparse.Namespace) -> int:
    check_args(args)
    text = read_text(args)
    ref = None
    if args.ref_audio is not None:
        try:
            ref = Path(args.ref_audio).read_bytes()
        except OSError as e:
            raise CLIError(f"cannot read --ref-audio {args.ref_audio!r}: {e.strerror or e}") from None
    ref_pcm = read_clip(ref, f"--ref-audio {args.ref_audio!r}") if ref is not None and not args.url else None
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
        else:
            out.discard()
    if not args.quiet:
        wall = time.perf_counter() - progress.start
        ttfa = f", first audio after {progress.first - progress.start:.2f} s" if progress.first else ""
        where = "stdout" if args.output == "-" else args.output
        load = f" (+{progress.load_s:.1f} s loading the model)" if progress.load_s else ""
        print(f"{where}: {out.seconds:.2f} s of audio ({args.format}) in {wall:.1f} s{load}{ttfa}{finish}",
              file=sys.stderr)
    return 0


# ---------------------------------------------------------------- in-process
def _speak_local(args, text: str, ref_pcm: np.ndarray | None, out: Output, progress: Progress) -> str:
    """CSM.speak (the long-form path: sentences in one slot, one continuous stream), or CSM.dialogue for a
    --script; -> the summary's tail (the segments' finish reasons)."""
    from csmserve.api import CSM, Segment
    from csmserve.config import EngineConfig

    context: list[Segment] = []
    speaker = args.speaker
    bound = None  # the adapter a stored voice is bound to
    if args.voice is not None and args.lines is None:  # (a script casts its voices itself)
        resolved, = _resolve_voices(args.voices_db, [args.voice])
        if resolved.voice is not None:
            context.append(Segment.of_voice(resolved.voice))
            bound = resolved.voice.adapter
        speaker = resolved.speaker if speaker is None else speaker
    speaker = 0 if speaker is None else speaker
    script = _cast_script(args) if args.lines is not None else None
    adapters = _lora(args.lora, bound)
    csm = CSM(args.model, device=args.device, dtype=args.dtype, codec=args.codec,
              engine_config=EngineConfig(max_slots=2, max_seq_len=2048), adapters=adapters)
    try:
        if args.format != "npy" and csm.mimi is None:
            raise CLIError("this model has no Mimi codec, so no audio: write .npy codes, or pass --codec")
        if ref_pcm is not None:
            context.append(Segment(speaker, args.ref_text, codes=csm.encode_audio(ref_pcm)))
        progress.loaded()
        kw = dict(context=context, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  adapter=next(iter(adapters)) if adapters else None)
        if args.max_audio_length_ms is not None:  # per sentence (the whole text has no cap)
            kw["max_segment_length_ms"] = args.max_audio_length_ms
        elif csm.random_weights:
            kw.update(_reading_caps([t for _, t in script[0]] if script is not None else [text]))
        if script is not None:  # a dialogue: its voices' clips first, then the lines, each with its speaker
            lines, clips = script
            chunks = csm.dialogue(lines, **{**kw, "context": clips + context})
        else:
            chunks = csm.speak(text, speaker=speaker, **kw)
        reasons: dict[str, int] = {}
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


def _lora(arg: str | None, bound: str | None) -> dict[str, str] | None:
    """--lora [NAME=]PATH -> {name: path} (NAME: the voice's adapter, else the directory's name); a voice bound to
    an adapter without --lora: CLIError (this process has no adapter of that name)."""
    if arg is None:
        if bound is not None:
            raise CLIError(f"the voice speaks with the LoRA adapter {bound!r}: give its directory with "
                           f"--lora {bound}=PATH (or speak through the server that serves it, --url)")
        return None
    name, sep, path = arg.partition("=")
    if not sep:
        name, path = bound or Path(arg).resolve().name or "lora", arg
    if not Path(path).expanduser().is_dir():
        raise CLIError(f"--lora {path!r}: no such adapter directory")
    return {name: str(Path(path).expanduser())}


def _reading_caps(texts: list[str]) -> dict:
    """Random weights (dummy, dummy-tiny) never end a sentence: a request that names no length stops at a
    reader's length for its text (config.reading_ms), each sentence at its longest one's, the whole at all of
    the text's, as the server sizes them."""
    from csmserve.config import reading_ms
    from csmserve.prompt.segments import split_sentences

    longest = max(len(s) for t in texts for s in split_sentences(t))
    return {"max_segment_length_ms": reading_ms(longest), "max_audio_length_ms": reading_ms(sum(map(len, texts)))}


def _resolve_voices(voices_db: str | None, names: list[str]) -> list:
    """Each voice (a stored voice's id or name, or an OpenAI voice name) resolved in --voices-db."""
    from csmserve.voices import VoiceNotFoundError, open_voice_store

    with open_voice_store(voices_db) as store:
        resolved = []
        for name in names:
            try:
                resolved.append(store.resolve(name))
            except VoiceNotFoundError:
                raise CLIError(f"voice {name!r} not found in {store.path}") from None
    return resolved


def _cast_script(args) -> tuple[list[tuple[int, str]], list]:
    """The script's lines as (speaker, text), and each stored voice's clip as the id it speaks with."""
    from csmserve.api import Segment
    from csmserve.prompt.dialogue import cast

    lines, c = cast(args.lines, args.voice)
    resolved = _resolve_voices(args.voices_db, list(c.voices)) if c.voices else []
    clips = [Segment(speaker, r.voice.transcript, codes=r.voice.codes)
             for speaker, r in zip(c.voices.values(), resolved) if r.voice is not None]
    return [(spk, ln.text) for spk, ln in zip(c.speakers, lines)], clips


# ---------------------------------------------------------------- through a server
def _speak_url(args, text: str, ref: bytes | None, out: Output, progress: Progress) -> str:
    """POST /v1/audio/speech per piece of text (pcm, streamed), encoded here into one file."""
    import httpx

    url = base_url(args.url)
    body = _request_body(args, ref)
    requests = pieces(text, URL_CHUNK_CHARS) if args.lines is None else [
        [{k: v for k, v in (("text", ln.text), ("speaker", ln.speaker), ("voice", ln.voice)) if v is not None}
         for ln in args.lines]]  # a dialogue: one request
    with httpx.Client(timeout=httpx.Timeout(30.0, read=600.0), headers=bearer(args.api_key)) as client:
        for i, piece in enumerate(requests):
            req = {**body, "input": piece}
            if args.seed is not None:
                req["seed"] = args.seed + i
            try:
                with client.stream("POST", f"{url}/v1/audio/speech", json=req) as r:
                    if r.status_code != 200:
                        raise CLIError(f"{url}: HTTP {r.status_code}: {error_message(r.read())}")
                    _write_pcm16(r.iter_bytes(), out, progress)
            except httpx.HTTPError as e:
                raise CLIError(f"{url}: {type(e).__name__}: {e}") from None
    return f" from {url} ({len(requests)} request{'s' if len(requests) != 1 else ''})"


def _request_body(args, ref: bytes | None) -> dict:
    """The /v1/audio/speech request's fields but its input (and the seed per request)."""
    body: dict = {"model": args.adapter or "csm-1b", "voice": args.voice or "alloy", "response_format": "pcm",
                  "temperature": args.temperature, "top_k": max(args.top_k, 0), "top_p": args.top_p}
    for name in ("speaker", "seed"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.max_audio_length_ms is not None:  # per sentence; the server sizes the whole from the text
        body["max_segment_length_ms"] = args.max_audio_length_ms
    if ref is not None:
        body["context"] = [{"speaker": args.speaker or 0, "text": args.ref_text,
                            "audio": base64.b64encode(ref).decode()}]
    return body


def _write_pcm16(stream, out: Output, progress: Progress) -> None:
    """s16le bytes as they arrive (a sample may be split across two reads) -> out."""
    carry = b""
    for data in stream:
        data, carry = carry + data, b""
        if len(data) % 2:
            data, carry = data[:-1], data[-1:]
        out.write_pcm16(data)
        progress.update(out.seconds)
