"""A dialogue as one speech request: `input` as a list of lines `{"text", "speaker"?, "voice"?}` or a
string tagged `[S1] ... [S2] ...` (with `voices`: [S1]'s voice, [S2]'s, ...) -> ONE long-form Request:
each voice's clip first (as the speaker id it has in the dialogue), then `context`, then every line cut
into sentences, each segment with its line's speaker, so each line sees the earlier lines' text and
generated audio (csmserve/prompt/dialogue.py has the casting rules). CSM.long_request builds it."""
from __future__ import annotations

from dataclasses import dataclass

from csmserve.prompt.dialogue import Line, cast, is_tagged, parse_tagged, segments
from csmserve.engine.request import Request
from csmserve.server.errors import bad_request
from csmserve.server.schemas import SpeechRequest, VoiceRef
from csmserve.server.state import ServerState


@dataclass(frozen=True)
class Script:
    """What each segment of a request speaks: its text, speaker id and line (0 for a plain input)."""

    texts: list[str]
    speakers: list[int]
    lines: list[int]


def is_dialogue(body: SpeechRequest) -> bool:
    return isinstance(body.input, list) or is_tagged(body.input)


def _key(voice: str | VoiceRef | None) -> str | None:
    return voice.id if isinstance(voice, VoiceRef) else voice


def _lines(body: SpeechRequest) -> list[Line]:
    try:
        if isinstance(body.input, list):
            if not body.input:
                raise ValueError("a dialogue needs at least one line")
            return [Line(" ".join(d.text.split()), d.speaker, _key(d.voice)) for d in body.input]
        return parse_tagged(body.input, [_key(v) for v in body.voices or ()])
    except ValueError as e:
        raise bad_request(str(e), "input", "invalid_value") from None


async def build_dialogue(state: ServerState, body: SpeechRequest) -> tuple[Request, Script]:
    lines = _lines(body)
    state.check_input(" ".join(ln.text for ln in lines))  # --max-input-chars counts the whole script
    filled, c = cast(lines, _key(body.voice))
    limit = state.config.max_context_turns
    if len(c.voices) + len(body.context) > limit:
        raise bad_request(f"the dialogue's {len(c.voices)} voices and {len(body.context)} context turns are more "
                          f"than {limit} context turns (--max-context-turns)", "input", "context_too_long")
    from csmserve.api import Segment

    clips = []
    for voice, speaker in c.voices.items():  # each voice's clip, as the id it speaks with here
        resolved = await state.resolve_voice(voice, "voices" if body.voices else "input")
        if resolved.voice is not None:
            clips.append(Segment.of_voice(resolved.voice, speaker))
    context = clips + await state.context_segments(body.context)
    segs = segments(filled, c.speakers)
    texts = [t for _, _, t in segs]
    # the whole script's text sizes the response's cap; each line's sentences get the sentence cap
    kw = await state.speech_args(None, body.model_copy(update={"speaker": segs[0][1]}), (), context,
                                 total_chars=sum(len(t) for t in texts), segment_chars=max(len(t) for t in texts),
                                 segmented=True)
    request = await state.build(state.require_ready().long_request, texts, speakers=[s for _, s, _ in segs], **kw)
    return request, Script(texts, [s for _, s, _ in segs], [i for i, _, _ in segs])
