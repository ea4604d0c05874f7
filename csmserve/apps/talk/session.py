"""A talk conversation: TalkSession runs one exchange at a time (the user's turn -> the assistant's
spoken reply), keeping the LLM's history and CSM's context (both sides' audio); Exchange is one's record."""
from __future__ import annotations

import math
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from csmserve.apps.common import CLIError, read_clip
from csmserve.apps.talk.asr import transcribe
from csmserve.apps.talk.errors import TalkError
from csmserve.apps.talk.llm import SYSTEM_PROMPT, LLMStream
from csmserve.apps.talk.speech import InProcessSpeech, ServerSpeech
from csmserve.config import FRAME_MS, FRAME_SAMPLES


@dataclass
class Exchange:
    """One exchange of a conversation: the user's turn and the assistant's spoken reply (cut at barge-in),
    with the latency split. `TalkSession.turn()` returns it; `TalkSession.turns` keeps them."""

    index: int
    user_text: str = ""
    reply_text: str = ""  # what the assistant said (cut at barge-in)
    llm_text: str = ""  # the LLM's whole reply as received
    frames: int = 0  # assistant frames played (kept in the context)
    audio: np.ndarray | None = None
    interrupted: bool = False
    error: str | None = None
    t_end_of_speech: float = 0.0
    t_transcribed: float | None = None
    t_first_token: float | None = None
    t_first_audio: float | None = None

    @property
    def latency(self) -> dict[str, float | None]:
        """end of user speech -> first audio byte, split: transcription, LLM first token, CSM first audio."""
        t0 = self.t_end_of_speech
        asr = (self.t_transcribed - t0) if self.t_transcribed is not None else None
        t1 = self.t_transcribed if self.t_transcribed is not None else t0
        llm = (self.t_first_token - t1) if self.t_first_token is not None else None
        csm = (self.t_first_audio - self.t_first_token) if None not in (self.t_first_audio, self.t_first_token) else None
        total = (self.t_first_audio - t0) if self.t_first_audio is not None else None
        return {"total": total, "transcription": asr, "llm_first_token": llm, "csm_first_audio": csm}

    def latency_line(self) -> str:
        ms = {k: "-" if v is None else f"{v * 1000:.0f} ms" for k, v in self.latency.items()}
        return (f"latency {ms['total']} (transcription {ms['transcription']}, LLM first token "
                f"{ms['llm_first_token']}, CSM first audio {ms['csm_first_audio']})")


@dataclass
class PromptRecord:
    """What CSM was given for one assistant turn: the context segments (speaker, text, codes) in order."""

    turn: int
    speaker: int
    context: list  # list[Segment]


@dataclass
class _Played:
    """What the user heard of a reply so far: its frames' codes (in-process) and audio, each sentence's text."""

    codes: list[np.ndarray] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    spoken: dict[int, str] = field(default_factory=dict)  # segment index -> text, for those with frames played
    frames: int = 0

    def add(self, chunk, n: int, frame_size: int) -> np.ndarray:
        """The chunk's first n frames were played -> their audio."""
        if chunk.codes is not None:
            self.codes.append(chunk.codes[:n])
        a = chunk.audio[: n * frame_size]
        self.audio.append(a)
        self.frames += n
        self.spoken[chunk.segment] = chunk.text or self.spoken.get(chunk.segment, "")
        return a


class TalkSession:
    """A conversation: history for the LLM, context (both sides' audio) for CSM; `turn()` runs one exchange."""

    def __init__(self, csm, llm_url: str, llm_model: str = "default", asr_url: str | None = None,
                 asr_model: str = "whisper-1", speaker: int = 0, user_speaker: int = 1,
                 system_prompt: str | None = SYSTEM_PROMPT, temperature: float = 0.9, top_k: int = 50,
                 top_p: float = 1.0, seed: int | None = None, max_audio_length_ms: int = 20_000,
                 max_context_frames: int = 1000, llm_temperature: float | None = None,
                 api_key: str | None = None, timeout: float = 60.0,
                 on_audio: Callable[[Exchange, np.ndarray], None] | None = None,
                 log: Callable[[str], None] | None = None, url: str | None = None,
                 server_key: str | None = None, voice: str | None = None) -> None:
        """csm: an in-process CSM, or None with `url` (a running `csmserve serve`: CSM over its WebSocket,
        one context_id for the conversation; the server keeps the turns, the user's audio encoded there once)."""
        if csm is None and url is None:
            raise ValueError("give a CSM or the url of a csmserve server")
        self.context_id = f"talk-{uuid.uuid4().hex}"
        self.speaker, self.user_speaker = int(speaker), int(user_speaker)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        max_segment_length_ms=max_audio_length_ms)  # per sentence
        self.speech: InProcessSpeech | ServerSpeech = (
            InProcessSpeech(csm, self.speaker, self.user_speaker, sampling) if csm is not None else
            ServerSpeech(url, self.context_id, self.speaker, self.user_speaker, sampling, server_key, voice))
        self.llm_url, self.llm_model, self.asr_url, self.asr_model = llm_url, llm_model, asr_url, asr_model
        self.max_context_frames = max_context_frames
        self.llm_temperature, self.api_key, self.timeout = llm_temperature, api_key, timeout
        self.history: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.context: list = []  # list[api.Segment], oldest first
        self.prompts: list[PromptRecord] = []
        self.turns: list[Exchange] = []
        self.on_audio = on_audio
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self._interrupt = threading.Event()
        self._llm: LLMStream | None = None  # the reply's LLM stream while it plays
        self._speaking = threading.Event()

    # ---- barge-in
    def interrupt(self) -> None:
        """The user started speaking: the assistant's audio in progress stops (its turn cut at what was played)."""
        self._interrupt.set()
        llm = self._llm
        if llm is not None:  # no more text: a reply waiting for the LLM's next sentence ends now
            llm.abort()

    @property
    def speaking(self) -> bool:
        return self._speaking.is_set()

    # ---- one exchange
    def turn(self, wav: bytes | None = None, text: str | None = None, name: str = "input",
             barge_in_after_ms: int | None = None, end_of_speech: float | None = None) -> Exchange:
        """The user's turn (audio bytes of any common format, and/or typed text) -> the assistant's spoken reply.
        Raises nothing for endpoint failures: the Exchange's `error` says what went wrong (also logged)."""
        turn = Exchange(index=len(self.turns) + 1)
        turn.t_end_of_speech = end_of_speech if end_of_speech is not None else time.perf_counter()
        self.turns.append(turn)
        self._interrupt.clear()
        try:
            self.context.append(self._user_turn(turn, wav, text, name))
            self.history.append({"role": "user", "content": turn.user_text})
            self._reply(turn, barge_in_after_ms)
        except CLIError as e:  # a TalkError, or audio that does not decode
            turn.error = str(e)
        except (OSError, ValueError, RuntimeError) as e:
            turn.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if turn.error:
            self.log(f"turn {turn.index}: error: {turn.error} (the conversation goes on)")
        return turn

    def close(self) -> None:
        self.speech.close()

    def _user_turn(self, turn: Exchange, wav: bytes | None, text: str | None, name: str):
        """The user's audio (transcribed unless `text` is given) and/or text -> their Segment for the context."""
        pcm = None
        if wav is not None:
            pcm = read_clip(wav, name)
            if text is None:
                if not self.asr_url:
                    raise TalkError("audio input needs --asr-url (an OpenAI-compatible transcription endpoint)")
                text = transcribe(self.asr_url, wav, self.asr_model, self.timeout, self.api_key)
                turn.t_transcribed = time.perf_counter()
        text = " ".join((text or "").split())
        if not text:
            raise TalkError(f"turn {turn.index}: nothing heard (empty transcript)")
        turn.user_text = text
        return self.speech.user_turn(text, pcm)

    # ---- the assistant's reply
    def _reply(self, turn: Exchange, barge_in_after_ms: int | None) -> None:
        """The LLM's reply, spoken as it streams; what was played joins the context and the history."""
        def frames(s) -> int:
            if s.codes is not None:
                return len(s.codes)
            return 0 if s.audio is None else len(s.audio) // FRAME_SAMPLES
        while len(self.context) > 1 and sum(frames(s) for s in self.context) > self.max_context_frames:
            self.context.pop(0)
        llm = LLMStream(self.llm_url, self.llm_model, list(self.history), self.api_key, self.timeout,
                        self.llm_temperature)
        context = list(self.context)
        self.prompts.append(PromptRecord(turn.index, self.speaker, context))
        limit = None if barge_in_after_ms is None else max(1, math.ceil(barge_in_after_ms / FRAME_MS))
        played = _Played()
        error: Exception | None = None
        self._speaking.set()
        self._llm = llm
        try:
            self._play(turn, llm, self.speech.reply(llm, context), played, limit)
        except (TalkError, OSError, ValueError, RuntimeError) as e:
            error = e
        finally:
            self._speaking.clear()
            self._llm = None
        self._keep(turn, llm, played)
        if isinstance(error, ValueError) and "no text to speak" in str(error):
            raise TalkError("the LLM's reply was empty")
        if error is not None:
            raise error if isinstance(error, TalkError) else TalkError(f"{type(error).__name__}: {error}")

    def _play(self, turn: Exchange, llm: LLMStream, stream, played: _Played, limit: int | None) -> None:
        """The reply's chunks to on_audio as they come, until it ends, the user barges in (interrupt()) or
        `limit` frames were played (the barge_in_after_ms test hook)."""
        frame_size = self.speech.frame_size
        try:
            for chunk in stream:
                if self._interrupt.is_set():  # nothing that comes after the barge-in is played
                    turn.interrupted = True
                    break
                n = len(chunk.codes) if chunk.codes is not None else len(chunk.audio) // frame_size
                if limit is not None and played.frames + n >= limit:  # the user speaks again here
                    n = limit - played.frames
                    turn.interrupted = True
                if n:
                    turn.t_first_audio = turn.t_first_audio or time.perf_counter()
                    audio = played.add(chunk, n, frame_size)
                    if self.on_audio is not None:
                        self.on_audio(turn, audio)
                if turn.interrupted or self._interrupt.is_set():
                    turn.interrupted = True
                    break
                if chunk.final and chunk.finish_reason in ("error", "abort"):
                    raise TalkError(f"CSM stopped the turn ({chunk.finish_reason})")
        finally:
            llm.stop.set()
            stream.close()  # leaving the stream aborts the request; its slot is freed
            self.speech.end(played.frames)

    def _keep(self, turn: Exchange, llm: LLMStream, played: _Played) -> None:
        """The reply into the Exchange; as played, into CSM's context (its codes in-process, else its audio)
        and the LLM's history."""
        from csmserve.api import Segment

        turn.t_first_token = llm.first_token_t
        turn.llm_text = llm.text
        turn.frames = played.frames
        turn.audio = np.concatenate(played.audio) if played.audio else np.zeros(0, np.float32)
        turn.reply_text = " ".join(played.spoken[k] for k in sorted(played.spoken) if played.spoken[k])
        if not played.frames:
            return
        said = turn.reply_text or llm.text
        if played.codes:
            reply = Segment(self.speaker, said, codes=np.concatenate(played.codes))
        else:  # a server sends audio only (it keeps the codes)
            reply = Segment(self.speaker, said, audio=turn.audio)
        self.context.append(reply)
        self.history.append({"role": "assistant", "content": said})
