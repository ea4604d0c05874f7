"""A dialogue as one speech request: `input` as a list of lines `{"text", "speaker"?, "voice"?}` or a string
tagged `[S1] ... [S2] ...` (with `voices`: [S1]'s voice, ...) -> its voices (each as its speaker id there) and
every line's sentences with its speaker (prompt/dialogue.py has the casting rules)."""
from __future__ import annotations

from collections.abc import Callable

from csmserve.prompt.dialogue import Line, cast, is_tagged, parse_tagged, segments
from csmserve.server.errors import bad_request
from csmserve.server.schemas import SpeechRequest, VoiceRef


def is_dialogue(body: SpeechRequest) -> bool:
    return isinstance(body.input, list) or is_tagged(body.input)


def voice_key(voice: str | VoiceRef | None) -> str | None:
    return voice.id if isinstance(voice, VoiceRef) else voice


def read_dialogue(body: SpeechRequest, check_text: Callable[[str], object]
                  ) -> tuple[dict[str, int], list[tuple[int, int, str]]]:
    """-> (each voice -> its speaker id here, the segments: (line, speaker, sentence)). check_text sees the
    whole script's text before it is cast (--max-input-chars counts the whole script)."""
    try:
        if isinstance(body.input, list):
            if not body.input:
                raise ValueError("a dialogue needs at least one line")
            lines = [Line(" ".join(d.text.split()), d.speaker, voice_key(d.voice)) for d in body.input]
        else:
            lines = parse_tagged(body.input, [voice_key(v) for v in body.voices or ()])
    except ValueError as e:
        raise bad_request(str(e), "input", "invalid_value") from None
    check_text(" ".join(ln.text for ln in lines))
    try:
        filled, c = cast(lines, voice_key(body.voice))
        return c.voices, segments(filled, c.speakers)
    except ValueError as e:
        raise bad_request(str(e), "input", "invalid_value") from None
