"""`csmserve speak`'s text: read from TEXT, -i FILE, --script FILE or stdin (-); cut into sentences and
into pieces a server takes in one request."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from csmserve.apps.common import CLIError


def _read(source: str) -> str:
    """A file's text, or stdin's for -: CLIError if it cannot be read or is not UTF-8."""
    if source == "-":
        return sys.stdin.read()
    try:
        return Path(source).read_text(encoding="utf-8")
    except OSError as e:
        raise CLIError(f"cannot read {source!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise CLIError(f"{source!r} is not UTF-8 text") from None


def read_text(args: argparse.Namespace) -> str:
    """The text to speak, whitespace collapsed; sets args.lines (the --script's lines, or None)."""
    if args.script is not None:
        from csmserve.prompt.dialogue import read_script

        raw = _read(args.script)
        voices = [v.strip() or None for v in args.voices.split(",")] if args.voices else []
        try:
            args.lines = read_script(raw, voices)
        except ValueError as e:
            raise CLIError(f"--script {args.script!r}: {e}") from None
        return " ".join(ln.text for ln in args.lines)
    args.lines = None
    source = args.input if args.input is not None else args.text
    text = _read(source) if args.input is not None or source == "-" else source
    text = " ".join(text.split())
    if not text:
        raise CLIError("the text is empty")
    return text


def pieces(text: str, limit: int) -> list[str]:
    """Whole sentences (the server's splitter without its cap on a sentence's length) packed into pieces of
    at most `limit` characters (a longer sentence is cut at spaces)."""
    from csmserve.prompt.segments import split_sentences

    out: list[str] = []
    cur = ""
    for sentence in split_sentences(text, max_words=1 << 30, max_chars=1 << 30):
        while len(sentence) > limit:
            cut = sentence.rfind(" ", 0, limit)
            cut = cut if cut > 0 else limit
            sentence, head = sentence[cut:].strip(), sentence[:cut].strip()
            if cur:
                out.append(cur)
                cur = ""
            out.append(head)
        if cur and len(cur) + 1 + len(sentence) > limit:
            out.append(cur)
            cur = ""
        cur = f"{cur} {sentence}".strip()
    if cur:
        out.append(cur)
    return out
