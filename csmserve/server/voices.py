"""Voices: POST/GET/DELETE /v1/audio/voices. A voice is a clip's Mimi codes + its transcript, encoded once."""
from __future__ import annotations

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile

from csmserve.voices import ALIASES, VoiceInfo, VoiceLimitError
from csmserve.server.errors import APIError, bad_request
from csmserve.server.schemas import media_type
from csmserve.server.state import ServerState

router = APIRouter()


def voice_object(v: VoiceInfo) -> dict:
    return {"id": v.id, "object": "audio.voice", "type": "audio_sample", "name": v.name,
            "created_at": int(v.created_at), "transcript": v.transcript, "speaker": v.speaker,
            "num_frames": v.num_frames, "duration_s": round(v.duration_s, 3), "adapter": v.adapter}


def _multipart(http: Request) -> None:
    """A dependency, so it runs before the form's fields are checked: JSON sent here gets this, not 'missing
    required parameter'."""
    if media_type(http.headers.get("content-type")) != "multipart/form-data":
        got = repr(http.headers["content-type"][:100]) if "content-type" in http.headers else "none"
        raise APIError(415, "POST /v1/audio/voices takes multipart/form-data (fields: name, audio_sample as a "
                       f"file, transcript, speaker, adapter), not JSON or another type (got Content-Type {got})",
                       "unsupported_media_type")


@router.post("/v1/audio/voices", dependencies=[Depends(_multipart)])
async def create_voice(http: Request, name: str = Form(...), audio_sample: UploadFile = File(...),
                       transcript: str = Form(""), speaker: int = Form(0), adapter: str = Form("")) -> dict:
    """multipart: `name`, `audio_sample` (any common audio file), `transcript` (what the clip says: CSM
    conditions on it), `speaker` (default 0), `adapter` (a loaded LoRA adapter the voice speaks with)."""
    state: ServerState = http.app.state.server
    adapter = adapter.strip() or None
    if adapter is not None:  # checked before the clip is encoded: a loaded adapter's name
        state.require_ready()
        try:
            state.config.check_adapter_name(adapter)
        except ValueError as e:
            raise bad_request(str(e), "adapter", "invalid_adapter_name") from None
        if adapter not in await state.adapters():
            raise APIError(404, f"adapter {adapter!r} is not loaded (GET /v1/models lists the adapters; load it "
                           "first)", "model_not_found", "adapter")
    if not name.strip():
        raise bad_request("'name' must not be empty", "name", "empty_name")
    if len(name) > state.config.max_input_chars:
        raise bad_request(f"'name' is longer than {state.config.max_input_chars} characters", "name")
    if not 0 <= speaker <= 255:
        raise bad_request("'speaker' must be in 0..255", "speaker")
    if len(transcript) > state.config.max_input_chars:
        raise bad_request(f"'transcript' is longer than {state.config.max_input_chars} characters", "transcript")
    data = await audio_sample.read(state.config.max_upload_bytes + 1)
    codes = await state.encode_clip(data, "audio_sample")
    try:
        voice = await state.stored(state.store.create, name.strip(), transcript, codes, speaker, adapter=adapter,
                                   max_voices=state.config.max_voices)
    except VoiceLimitError as e:  # checked in the insert itself: creates racing in other workers cannot pass it
        raise APIError(409, f"{e} (--max-voices)", "too_many_voices") from None
    state.voices_changed()
    return voice_object(voice)


@router.get("/v1/audio/voices")
async def list_voices(http: Request) -> dict:
    state: ServerState = http.app.state.server
    stored = [voice_object(v) for v in await state.stored(state.store.list)]
    aliases = [{"id": name, "object": "audio.voice", "type": "alias", "name": name, "speaker": spk, "adapter": None}
               for name, spk in ALIASES.items()]
    return {"object": "list", "voices": stored + aliases, "data": stored + aliases}


@router.get("/v1/audio/voices/{voice_id}")
async def get_voice(voice_id: str, http: Request) -> dict:
    state: ServerState = http.app.state.server
    v = await state.stored(state.store.get, voice_id)
    if v is None:
        raise APIError(404, f"voice {voice_id!r} not found", "voice_not_found", "voice_id")
    return voice_object(v)


@router.delete("/v1/audio/voices/{voice_id}")
async def delete_voice(voice_id: str, http: Request) -> dict:
    state: ServerState = http.app.state.server
    if not await state.stored(state.store.delete, voice_id):
        raise APIError(404, f"voice {voice_id!r} not found", "voice_not_found", "voice_id")
    state.voices_changed()
    return {"id": voice_id, "object": "audio.voice", "deleted": True}
