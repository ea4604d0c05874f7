"""Request bodies, validated at the edge. Unknown fields are ignored (OpenAI clients add new ones); known fields
of the wrong type are a 400 naming the field. JSON bodies are parsed by pydantic's parser (`parse_body`: bounded
nesting, lone surrogates a 400) and must come as `Content-Type: application/json` (415 otherwise)."""
from __future__ import annotations

import asyncio
from typing import Annotated, Literal, TypeVar

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, StrictStr, ValidationError,
                      model_validator)

from csmserve.audio import MAX_SPEED, MIN_SPEED
from csmserve.server.errors import APIError, validation_error

M = TypeVar("M", bound=BaseModel)


def _integral(v: object) -> object:
    # JSON Schema's "integer" admits 1.0 (generated clients send it); 1.5, "1" and true stay refused
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[StrictInt, BeforeValidator(_integral)]


def _bounded(**bounds) -> object:
    """Int with its bounds inside the annotation: `X | None` then keeps them as JSON Schema's minimum / maximum
    (a Field(ge=...) beside an Annotated union leaves pydantic's own `ge` in /openapi.json, which clients ignore)."""
    return Annotated[StrictInt, Field(**bounds), BeforeValidator(_integral)]


Speaker, Seed, AtLeastFrame, NonNegative = (_bounded(ge=0, le=255), _bounded(ge=0, lt=2**63), _bounded(ge=80),
                                            _bounded(ge=0))

ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


class VoiceRef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: StrictStr


class ContextTurn(BaseModel):
    """One earlier turn of the conversation: who spoke, what they said, and how it sounded."""

    model_config = ConfigDict(extra="ignore")
    speaker: Int = Field(0, ge=0, le=255)
    text: StrictStr = ""
    audio: StrictStr | None = None  # base64 of any common audio file (wav, mp3, flac, ogg, ...)
    voice_id: StrictStr | None = None  # a stored voice's clip and transcript

    @model_validator(mode="after")
    def _one_source(self) -> ContextTurn:
        if self.audio is not None and self.voice_id is not None:
            raise ValueError("give either audio or voice_id, not both")
        return self


class SamplingFields(BaseModel):
    """CSM extensions shared by HTTP and WebSocket requests."""

    model_config = ConfigDict(extra="ignore")
    speaker: Speaker | None = None  # default: the voice's speaker (0 for aliases)
    temperature: float = Field(0.9, ge=0.0, le=2.0, allow_inf_nan=False)  # 0 (and < 1e-5) = greedy
    top_k: Int = Field(50, ge=0, le=2051)  # 0 disables
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: Seed | None = None
    max_audio_length_ms: AtLeastFrame | None = None  # the whole response (all sentences)
    max_segment_length_ms: AtLeastFrame | None = None  # one sentence of a long input / WebSocket turn


class DialogueLine(BaseModel):
    """One line of a dialogue script: its text, and who says it (a speaker id and/or a voice)."""

    model_config = ConfigDict(extra="ignore")
    text: StrictStr
    speaker: StrictInt | None = Field(None, ge=0, le=255)
    voice: StrictStr | VoiceRef | None = None


class SpeechRequest(SamplingFields):
    """OpenAI's CreateSpeechRequest plus the CSM extensions (`extra_body=` in the openai SDK).

    `input` may also be a dialogue: a list of lines, or a string tagged `[S1] ... [S2] ...`."""

    model: StrictStr
    input: StrictStr | list[DialogueLine]
    voice: StrictStr | VoiceRef
    voices: list[StrictStr | VoiceRef | None] | None = None  # a tagged script's voices: [S1]'s, [S2]'s, ...
    instructions: StrictStr | None = Field(None, max_length=4096)  # accepted, not used: CSM has no style prompt
    response_format: ResponseFormat = "mp3"
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED, allow_inf_nan=False)
    stream_format: Literal["audio", "sse"] = "audio"
    add_timestamps: bool = False  # sse: `speech.audio.segment` events, each segment's audio_start_ms / audio_end_ms
    context: list[ContextTurn] = Field(default_factory=list)


class WsRequest(SamplingFields):
    """One client message on the WebSocket (see docs/api.md)."""

    context_id: StrictStr = Field("default", min_length=1, max_length=256)
    text: StrictStr | None = None
    voice: StrictStr | VoiceRef | None = None
    # the session's model, as POST /v1/audio/speech's `model`; `adapter`: the same setting under CSM's word
    model: StrictStr | None = Field(None, max_length=256)
    adapter: StrictStr | None = Field(None, max_length=256)
    context: list[ContextTurn] | None = None  # the session's fixed context (replaces the one given before)
    add_context: list[ContextTurn] | None = None  # turns appended to the session's conversation (e.g. the user's)
    output_format: Literal["pcm_s16le", "pcm_f32le"] | None = None
    add_timestamps: bool | None = None  # `segment_done` messages: each segment's audio_start_ms / audio_end_ms
    flush: bool = False
    close: bool = False
    cancel: bool = False
    # with `cancel`: keep the first audio_end_ms of the cancelled turn (what was played; whole 80 ms frames)
    # in the session; with `truncate`: cut an assistant turn already in the session there
    truncate: bool = False
    audio_end_ms: NonNegative | None = None
    request_id: StrictStr | None = None  # the turn `truncate` cuts (default: the newest assistant turn)


def media_type(content_type: str | None) -> str:
    """A Content-Type header's media type, lowercased, without its parameters ("" without one)."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def check_json_type(content_type: str | None) -> None:
    """JSON routes take `Content-Type: application/json` only (415): text/plain is a browser's simple request."""
    if media_type(content_type) != "application/json":
        got = repr(content_type[:100]) if content_type else "none"
        raise APIError(415, f"this route takes a JSON object: send it with Content-Type: application/json "
                       f"(got {got})", "unsupported_media_type")


def parse_json(raw: bytes, model: type[M]) -> M:
    """A JSON body -> `model`, or the 400 that says what is wrong with it."""
    if not raw.strip():
        first = next(n for n, f in model.model_fields.items() if f.is_required())
        raise APIError(400, f"the request body is empty; send a JSON object (it needs '{first}')",
                       "missing_required_parameter", first)
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None


async def parse_body(raw: bytes, model: type[M]) -> M:
    """parse_json in a thread: a body of --max-body-bytes takes ~10 ms per MiB to parse, off the event loop."""
    return await asyncio.to_thread(parse_json, raw, model) if len(raw) > 65536 else parse_json(raw, model)


class LoadLoraAdapter(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve `lora_path` (under --lora-dir) as `lora_name`."""

    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr = Field(min_length=1, max_length=256)
    lora_path: StrictStr = Field(min_length=1, max_length=4096)


class UnloadLoraAdapter(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving `lora_name` (its requests in flight finish with it)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr = Field(min_length=1, max_length=256)
