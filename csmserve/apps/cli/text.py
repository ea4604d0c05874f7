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


def read_script(args: argparse.Namespace) -> list:
    """--script FILE -> the dialogue's lines (csmserve/prompt/dialogue.py)."""
    from csmserve.prompt.dialogue import read_script as parse

    raw = _read(args.script)
    voices = [v.strip() or None for v in args.voices.split(",")] if args.voices else []
    try:
        return parse(raw, voices)
    except ValueError as e:
        raise CLIError(f"--script {args.script!r}: {e}") from None


def read_text(args: argparse.Namespace) -> str:
    """The text to speak, whitespace collapsed; sets args.lines (the --script's lines, or None)."""
    if args.script is not None:
        args.lines = read_script(args)
        return " ".join(ln.text for ln in args.lines)
    args.lines = None
    source = args.input if args.input is not None else args.text
    text = _read(source) if args.input is not None or source == "-" else source
    text = " ".join(text.split())
    if not text:
        raise CLIError("the text is empty")
    return text


def split_sentences(text: str) -> list[str]:
    """Whole sentences (what `pieces` packs): the server's sentence splitter (csmserve/prompt/segments.py:
    abbreviations, closing quotes, paragraphs) without its cap on a sentence's length."""
    from csmserve.prompt.segments import split_sentences as split

    return split(text, max_words=1 << 30, max_chars=1 << 30)


def pieces(text: str, limit: int) -> list[str]:
    """Whole sentences packed into pieces of at most `limit` characters (a longer sentence is cut at spaces)."""
    out: list[str] = []
    cur = ""
    for sentence in split_sentences(text):
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
