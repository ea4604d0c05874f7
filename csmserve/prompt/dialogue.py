"""Dialogue scripts: several speakers in one request, each line conditioned on the audio of the lines
before it (one long-form request: a line is one or more segments, each with its own speaker id; the
earlier lines' generated codes are in the slot's KV, each speakers' voice clip comes first).

Two ways to write one:
- a tagged string, `[S1] Hi there. [S2] Hello! How are you? [S1] Fine.` (Dia's tags): `[Sn]` is
  CSM speaker n-1, spoken in `voices[n-1]` when given;
- a list of lines `{"text", "speaker"?, "voice"?}`: a line with a voice and no speaker gets the voice's
  own speaker id in the dialogue (the lowest id no line names, in order of first appearance), so two
  stored voices never share an id; a line with neither uses the default voice (speaker 0 without one).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from csmserve.prompt.segments import split_sentences

TAG = re.compile(r"\[S(\d{1,3})\]")
MAX_SPEAKER = 255


@dataclass(frozen=True)
class Line:
    """One line of a script: its text, and who says it (an explicit speaker id and/or a voice)."""

    text: str
    speaker: int | None = None
    voice: str | None = None  # a voice's id or name (or an OpenAI alias)


@dataclass(frozen=True)
class Cast:
    """Who speaks: each line's speaker id, and each voice's id (the voices in order of first appearance)."""

    speakers: list[int]  # one per line
    voices: dict[str, int]  # voice key -> the speaker id its clip is given as


def is_tagged(text: str) -> bool:
    """A string script: it starts with a `[Sn]` tag."""
    return TAG.match(text.lstrip()) is not None


def parse_tagged(text: str, voices: Sequence[str | None] = ()) -> list[Line]:
    """`[S1] a [S2] b` -> lines; text before the first tag is an error. Empty lines are dropped."""
    parts = TAG.split(text.strip())
    if parts[0].strip():
        raise ValueError(f"a tagged script starts with a speaker tag such as [S1], got {parts[0].strip()[:30]!r}")
    lines = []
    for n, body in zip(parts[1::2], parts[2::2]):
        k = int(n)
        if not 1 <= k <= MAX_SPEAKER + 1:
            raise ValueError(f"[S{k}]: speaker tags go from [S1] to [S{MAX_SPEAKER + 1}]")
        body = " ".join(body.split())
        if body:
            lines.append(Line(body, k - 1, voices[k - 1] if k - 1 < len(voices) else None))
    if not lines:
        raise ValueError("the script has no text")
    return lines


def cast(lines: Sequence[Line], default_voice: str | None) -> tuple[list[Line], Cast]:
    """Fill in each line's voice (the default for a line with neither) and speaker id."""
    filled = [ln if ln.speaker is not None or ln.voice is not None else
              Line(ln.text, 0 if default_voice is None else None, default_voice) for ln in lines]
    taken = {ln.speaker for ln in filled if ln.speaker is not None}
    voices: dict[str, int] = {}
    free = (i for i in range(MAX_SPEAKER + 1) if i not in taken)
    for ln in filled:
        if ln.voice is not None and ln.voice not in voices:
            speaker = ln.speaker if ln.speaker is not None else next(free, None)
            if speaker is None:
                raise ValueError("more voices than speaker ids")
            voices[ln.voice] = speaker
    speakers = [ln.speaker if ln.speaker is not None else voices[ln.voice] for ln in filled]
    return filled, Cast(speakers, voices)


def segments(lines: Sequence[Line], speakers: Sequence[int], max_words: int = 25, max_chars: int = 250
             ) -> list[tuple[int, int, str]]:
    """The long-form segments: (line index, speaker, sentence) for every sentence of every line."""
    out = [(i, spk, sentence) for i, (ln, spk) in enumerate(zip(lines, speakers))
           for sentence in split_sentences(ln.text, max_words, max_chars)]
    if not out:
        raise ValueError("the script has no text")
    return out


def read_script(text: str, voices: Sequence[str | None] = ()) -> list[Line]:
    """A script file's text: a JSON list of lines, or a tagged script (`[S1] ... [S2] ...`)."""
    import json

    stripped = text.strip()
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except ValueError:
            data = None
        if isinstance(data, list):
            if not data:
                raise ValueError("the script has no text")
            return [_line(d, i) for i, d in enumerate(data)]
    return parse_tagged(text, voices)


def _line(d: object, i: int) -> Line:
    if not isinstance(d, dict) or not isinstance(d.get("text"), str) or not d["text"].strip():
        raise ValueError(f"script line {i}: expected {{\"text\": str, \"speaker\"?: int, \"voice\"?: str}}")
    speaker, voice = d.get("speaker"), d.get("voice")
    if speaker is not None and (not isinstance(speaker, int) or not 0 <= speaker <= MAX_SPEAKER):
        raise ValueError(f"script line {i}: speaker must be an integer in 0..{MAX_SPEAKER}")
    if voice is not None and not isinstance(voice, str):
        raise ValueError(f"script line {i}: voice must be a string")
    return Line(" ".join(d["text"].split()), speaker, voice)
