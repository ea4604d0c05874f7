"""`csmserve talk`: a spoken conversation with any OpenAI-compatible LLM, CSM speaking with the whole
conversation (both sides' audio) as context.

One turn: the user's audio (a WAV file) is transcribed by an OpenAI-compatible
`/v1/audio/transcriptions` endpoint (or the text is typed) -> the text and the history go to an
OpenAI-compatible `/v1/chat/completions` endpoint (streamed) -> the reply's tokens are fed as they
arrive into CSM's long-form text-streaming path (`CSM.speak` over an iterator), so speech starts at
the first complete sentence, long before the LLM has finished -> CSM speaks as `speaker` after the
conversation's turns: the user's audio (Mimi-encoded once, speaker `user_speaker`) and the
assistant's generated codes (speaker `speaker`).

Barge-in: when the user speaks again (`TalkSession.interrupt()`, a typed line arriving while the
assistant speaks, or the `barge_in_after_ms` test hook) the assistant's audio stops and its turn is
cut, in the CSM context and in the LLM history, at what was played (the frames delivered so far).

`TalkSession.prompts` keeps, per turn, the context CSM was given (a test hook);
`TalkSession.turns` the per-turn results with their latency split.
"""
from __future__ import annotations

import base64
import io
import json
import math
import sys
import threading
import time
import uuid
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from csmserve.config import FRAME_MS, SAMPLE_RATE

SYSTEM_PROMPT = ("You are a friendly voice assistant in a spoken conversation. Answer in one to three short "
                 "spoken sentences: no lists, no markdown, no emoji.")


class TalkError(Exception):
    """A turn failed (an endpoint unreachable or failing, unreadable audio): one line; the conversation goes on."""


def endpoint(url: str, path: str) -> str:
    """A base URL (http://host:port, .../v1) or the full endpoint -> the full endpoint URL."""
    url = url.rstrip("/")
    if url.endswith(path):
        return url
    if url.endswith("/v1"):
        return url + path
    return url + "/v1" + path


def _error_text(body: bytes) -> str:
    try:
        err = json.loads(body)
        if isinstance(err, dict):
            e = err.get("error", err.get("detail", err))
            if isinstance(e, dict):
                e = e.get("message", e)
            return str(e)[:200]
    except ValueError:
        pass
    return body[:200].decode("utf-8", "replace").strip() or "no body"


def _http_error(what: str, url: str, e: Exception) -> TalkError:
    import httpx

    if isinstance(e, httpx.ConnectError):
        return TalkError(f"{what} endpoint {url} is unreachable ({e or 'connection refused'})")
    if isinstance(e, httpx.TimeoutException):
        return TalkError(f"{what} endpoint {url} timed out ({type(e).__name__})")
    return TalkError(f"{what} endpoint {url} failed: {type(e).__name__}: {e}")


# ---------------------------------------------------------------- endpoints
def transcribe(url: str, wav: bytes, model: str = "whisper-1", timeout: float = 60.0,
               api_key: str | None = None) -> str:
    """POST the audio to an OpenAI-compatible /v1/audio/transcriptions (multipart) -> the text."""
    import httpx

    full = endpoint(url, "/audio/transcriptions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(full, files={"file": ("speech.wav", wav, "audio/wav")},
                       data={"model": model, "response_format": "json"}, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise _http_error("ASR", full, e) from None
    if r.status_code != 200:
        raise TalkError(f"ASR endpoint {full} failed: HTTP {r.status_code}: {_error_text(r.content)}")
    try:
        body = r.json()
        text = body["text"] if isinstance(body, dict) else str(body)
    except (ValueError, KeyError):
        text = r.text  # response_format=text servers
    return " ".join(str(text).split())


@dataclass
class LLMStream:
    """The streamed chat completion: iterate for the content pieces; timestamps (perf_counter) as they come."""

    url: str
    model: str
    messages: list[dict]
    api_key: str | None = None
    timeout: float = 60.0
    temperature: float | None = None
    first_token_t: float | None = None
    last_token_t: float | None = None
    done_t: float | None = None
    text: str = ""
    stop: threading.Event = field(default_factory=threading.Event)

    def __iter__(self) -> Iterator[str]:
        import httpx

        full = endpoint(self.url, "/chat/completions")
        body: dict = {"model": self.model, "messages": self.messages, "stream": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            with httpx.stream("POST", full, json=body, headers=headers,
                              timeout=httpx.Timeout(self.timeout, read=self.timeout)) as r:
                if r.status_code != 200:
                    raise TalkError(f"LLM endpoint {full} failed: HTTP {r.status_code}: {_error_text(r.read())}")
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        msg = json.loads(data)
                    except ValueError:
                        raise TalkError(f"LLM endpoint {full} sent a line that is not JSON: {data[:80]!r}") from None
                    if isinstance(msg, dict) and "error" in msg:
                        raise TalkError(f"LLM endpoint {full} failed: {_error_text(data.encode())}")
                    try:
                        piece = (msg["choices"][0].get("delta") or {}).get("content") or ""
                    except (KeyError, IndexError, TypeError, AttributeError):
                        piece = ""
                    if piece:
                        now = time.perf_counter()
                        self.first_token_t = self.first_token_t or now
                        self.last_token_t = now
                        self.text += piece
                        yield piece
        except httpx.HTTPError as e:
            raise _http_error("LLM", full, e) from None
        finally:
            self.done_t = time.perf_counter()


# ---------------------------------------------------------------- audio helpers
def wav_bytes(pcm: np.ndarray, rate: int = SAMPLE_RATE) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def read_wav(data: bytes, name: str) -> np.ndarray:
    """Any common audio file's bytes -> [n] float32 at 24 kHz."""
    from csmserve.audio import AudioDecodeError, decode_audio_24k

    try:
        return decode_audio_24k(data, max_seconds=120)
    except AudioDecodeError as e:
        raise TalkError(f"{name}: {e}") from None


# ---------------------------------------------------------------- the session
@dataclass
class Turn:
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
    t_last_token: float | None = None
    t_llm_done: float | None = None
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
        lat = self.latency

        def f(v):
            return "-" if v is None else f"{v * 1000:.0f} ms"
        return (f"latency {f(lat['total'])} (transcription {f(lat['transcription'])}, LLM first token "
                f"{f(lat['llm_first_token'])}, CSM first audio {f(lat['csm_first_audio'])})")


@dataclass
class PromptRecord:
    """What CSM was given for one assistant turn: the context segments (speaker, text, codes) in order."""

    turn: int
    speaker: int
    context: list  # list[Segment]


class TalkSession:
    """A conversation: history for the LLM, context (both sides' audio) for CSM; `turn()` runs one turn."""

    def __init__(self, csm, llm_url: str, llm_model: str = "default", asr_url: str | None = None,
                 asr_model: str = "whisper-1", speaker: int = 0, user_speaker: int = 1,
                 system_prompt: str | None = SYSTEM_PROMPT, temperature: float = 0.9, top_k: int = 50,
                 top_p: float = 1.0, seed: int | None = None, max_audio_length_ms: int = 20_000,
                 max_context_frames: int = 1000, llm_temperature: float | None = None,
                 api_key: str | None = None, timeout: float = 60.0,
                 on_audio: Callable[[Turn, np.ndarray], None] | None = None,
                 log: Callable[[str], None] | None = None, url: str | None = None,
                 server_key: str | None = None, voice: str | None = None) -> None:
        """csm: an in-process CSM, or None with `url` (a running `csmserve serve`: CSM over its WebSocket,
        one context_id for the conversation; the server keeps the turns, the user's audio encoded there once)."""
        if csm is None and url is None:
            raise ValueError("give a CSM or the url of a csmserve server")
        self.csm, self.url, self.server_key, self.voice = csm, url, server_key, voice
        self.context_id = f"talk-{uuid.uuid4().hex}"
        self._ws = None
        self._user_wav: bytes | None = None
        self.llm_url, self.llm_model, self.asr_url, self.asr_model = llm_url, llm_model, asr_url, asr_model
        self.speaker, self.user_speaker = int(speaker), int(user_speaker)
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                             max_segment_length_ms=max_audio_length_ms)  # per sentence
        self.max_context_frames = max_context_frames
        self.llm_temperature, self.api_key, self.timeout = llm_temperature, api_key, timeout
        self.history: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.context: list = []  # list[api.Segment], oldest first
        self.prompts: list[PromptRecord] = []
        self.turns: list[Turn] = []
        self.on_audio = on_audio
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self._interrupt = threading.Event()
        self._speaking = threading.Event()

    # ---- barge-in
    def interrupt(self) -> None:
        """The user started speaking: the assistant's audio in progress stops (its turn cut at what was played)."""
        self._interrupt.set()

    @property
    def speaking(self) -> bool:
        return self._speaking.is_set()

    # ---- one turn
    def turn(self, wav: bytes | None = None, text: str | None = None, name: str = "input",
             barge_in_after_ms: int | None = None, end_of_speech: float | None = None) -> Turn:
        """The user's turn (audio bytes of any common format, and/or typed text) -> the assistant's spoken reply.

        Raises nothing for endpoint failures: the Turn's `error` says what went wrong (also logged) and
        the conversation goes on with the next turn."""
        from csmserve.api import Segment

        turn = Turn(index=len(self.turns) + 1)
        turn.t_end_of_speech = end_of_speech if end_of_speech is not None else time.perf_counter()
        self.turns.append(turn)
        self._interrupt.clear()
        try:
            user_codes = None
            if wav is not None:
                pcm = read_wav(wav, name)
                if text is None:
                    if not self.asr_url:
                        raise TalkError("audio input needs --asr-url (an OpenAI-compatible transcription endpoint)")
                    text = transcribe(self.asr_url, wav, self.asr_model, self.timeout, self.api_key)
                    turn.t_transcribed = time.perf_counter()
                if self.csm is not None:
                    user_codes = self.csm.encode_audio(pcm)  # Mimi-encoded once; kept in the context
            text = " ".join((text or "").split())
            if not text:
                raise TalkError(f"turn {turn.index}: nothing heard (empty transcript)")
            turn.user_text = text
            user = Segment(self.user_speaker, text, codes=user_codes)
            if self.csm is None and wav is not None:
                user.audio = pcm  # --url: the server encodes it (once, on arrival)
                self._user_wav = wav
            else:
                self._user_wav = None
            self.context.append(user)
            self.history.append({"role": "user", "content": text})
            self._reply(turn, barge_in_after_ms)
        except TalkError as e:
            turn.error = str(e)
        except (OSError, ValueError, RuntimeError) as e:
            turn.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if turn.error:
            self.log(f"turn {turn.index}: error: {turn.error} (the conversation goes on)")
        return turn

    def _trim_context(self) -> None:
        def frames(s) -> int:
            if s.codes is not None:
                return len(s.codes)
            return 0 if s.audio is None else len(s.audio) // 1920
        while len(self.context) > 1 and sum(frames(s) for s in self.context) > self.max_context_frames:
            self.context.pop(0)

    def _reply(self, turn: Turn, barge_in_after_ms: int | None) -> None:
        from csmserve.api import Segment

        self._trim_context()
        llm = LLMStream(self.llm_url, self.llm_model, list(self.history), self.api_key, self.timeout,
                        self.llm_temperature)
        context = list(self.context)
        self.prompts.append(PromptRecord(turn.index, self.speaker, context))
        codes: list[np.ndarray] = []
        audio: list[np.ndarray] = []
        spoken: dict[int, str] = {}  # segment index -> text, for the segments with frames played
        limit = None if barge_in_after_ms is None else max(1, math.ceil(barge_in_after_ms / FRAME_MS))
        played = 0
        error: Exception | None = None
        self._speaking.set()
        try:
            if self.csm is not None:
                stream = self.csm.speak(iter(llm), speaker=self.speaker, context=context, **self.sampling)
            else:
                stream = self._ws_stream(llm, context[-1])
            frame_size = self.csm.frame_size if self.csm is not None else 1920
            try:
                for chunk in stream:
                    n = len(chunk.codes) if chunk.codes is not None else len(chunk.audio) // frame_size
                    if limit is not None and played + n >= limit:  # the user speaks again here
                        n = limit - played
                        turn.interrupted = True
                    if n:
                        turn.t_first_audio = turn.t_first_audio or time.perf_counter()
                        if chunk.codes is not None:
                            codes.append(chunk.codes[:n])
                        a = chunk.audio[: n * frame_size]
                        audio.append(a)
                        played += n
                        spoken[chunk.segment] = chunk.text or spoken.get(chunk.segment, "")
                        if self.on_audio is not None:
                            self.on_audio(turn, a)
                    if turn.interrupted or self._interrupt.is_set():
                        turn.interrupted = True
                        break
                    if chunk.final and chunk.finish_reason in ("error", "abort"):
                        raise TalkError(f"CSM stopped the turn ({chunk.finish_reason})")
            finally:
                llm.stop.set()
                stream.close()  # leaving the stream aborts the request; its slot is freed
        except (TalkError, OSError, ValueError, RuntimeError) as e:
            error = e
        finally:
            self._speaking.clear()
        turn.t_first_token, turn.t_last_token, turn.t_llm_done = llm.first_token_t, llm.last_token_t, llm.done_t
        turn.llm_text = llm.text
        turn.frames = played
        turn.audio = np.concatenate(audio) if audio else np.zeros(0, np.float32)
        turn.reply_text = " ".join(spoken[k] for k in sorted(spoken) if spoken[k])
        if played:  # the assistant's turn as played: codes in CSM's context, text in the LLM's history
            said = turn.reply_text or llm.text
            if self.csm is not None:
                self.context.append(Segment(self.speaker, said, codes=np.concatenate(codes)))
            else:
                self.context.append(Segment(self.speaker, said, audio=turn.audio))
                if turn.interrupted:  # the server drops a cancelled turn: add what was played
                    self._ws_send({"context_id": self.context_id, "add_context": [
                        {"speaker": self.speaker, "text": said,
                         "audio": base64.b64encode(wav_bytes(turn.audio)).decode()}]})
            self.history.append({"role": "assistant", "content": said})
        if error is not None:
            if isinstance(error, ValueError) and "no text to speak" in str(error):
                raise TalkError("the LLM's reply was empty")
            raise error if isinstance(error, TalkError) else TalkError(f"{type(error).__name__}: {error}")


    # ---- --url: CSM through a csmserve server's WebSocket
    def _ws_connect(self):
        if self._ws is None:
            from websockets.sync.client import connect

            base = self.url.rstrip("/")
            base = base[:-3] if base.endswith("/v1") else base
            ws_url = base.replace("https://", "wss://").replace("http://", "ws://") + "/v1/audio/speech/stream"
            headers = {"Authorization": f"Bearer {self.server_key}"} if self.server_key else None
            kw = dict(additional_headers=headers, open_timeout=self.timeout, max_size=None)
            try:
                try:
                    self._ws = connect(ws_url, legacy=True, **kw)  # websockets >= 17: a connection, no warning
                except TypeError:
                    self._ws = connect(ws_url, **kw)
            except Exception as e:  # noqa: BLE001 - any connection failure is one line
                raise TalkError(f"csmserve server {ws_url} is unreachable ({type(e).__name__}: {e})") from None
        return self._ws

    def _ws_send(self, msg: dict) -> None:
        try:
            self._ws_connect().send(json.dumps(msg))
        except TalkError:
            raise
        except Exception as e:  # noqa: BLE001
            self._ws_drop()
            raise TalkError(f"csmserve server {self.url}: connection lost ({type(e).__name__}: {e})") from None

    def _ws_drop(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:  # noqa: BLE001
                pass
            self._ws = None

    def _ws_stream(self, llm: LLMStream, user) -> Iterator[_Chunk]:
        """One turn over the WebSocket: the user's turn as add_context, the LLM's pieces as text, flush;
        -> chunks of audio as they come. Leaving early cancels the turn on the server."""
        cid = self.context_id
        first: dict = {"context_id": cid, "speaker": self.speaker, "output_format": "pcm_s16le",
                       **{k: v for k, v in self.sampling.items() if v is not None}}
        if self.voice:
            first["voice"] = self.voice
        entry: dict = {"speaker": user.speaker, "text": user.text}
        if self._user_wav is not None:
            entry["audio"] = base64.b64encode(self._user_wav).decode()
        first["add_context"] = [entry]
        self._ws_send(first)
        ws = self._ws
        state: dict = {"sent": 0, "done": False, "error": None}

        def sender() -> None:
            try:
                for piece in llm:
                    if llm.stop.is_set():
                        break
                    ws.send(json.dumps({"context_id": cid, "text": piece}))
                    state["sent"] += 1
            except Exception as e:  # noqa: BLE001 - re-raised after the turn
                state["error"] = e
            finally:
                try:
                    if state["sent"] and not llm.stop.is_set():
                        ws.send(json.dumps({"context_id": cid, "flush": True}))
                except Exception:  # noqa: BLE001
                    pass
                state["done"] = True

        feeder = threading.Thread(target=sender, daemon=True, name="csmserve-talk-ws-send")
        feeder.start()
        finished = False
        try:
            while True:
                if state["done"] and not state["sent"]:
                    finished = True
                    break
                try:
                    raw = ws.recv(timeout=0.05)
                except TimeoutError:
                    continue
                except Exception as e:  # noqa: BLE001
                    finished = True
                    self._ws_drop()
                    raise TalkError(f"csmserve server {self.url}: connection lost ({type(e).__name__})") from None
                if not isinstance(raw, str):
                    continue
                m = json.loads(raw)
                if m.get("type") == "audio":
                    pcm = np.frombuffer(base64.b64decode(m["audio"]), dtype="<i2").astype(np.float32) / 32767
                    yield _Chunk(None, pcm, m.get("segment", 0), m.get("text"))
                elif m.get("type") == "flush_done":
                    finished = True
                    yield _Chunk(None, np.zeros(0, np.float32), 0, None, True, m.get("finish_reason"))
                    break
                elif m.get("type") == "error":
                    raise TalkError(f"csmserve server {self.url}: {m.get('error', {}).get('message', m)}")
        finally:
            llm.stop.set()
            if not finished and self._ws is not None:  # barge-in (or an error): stop the server's turn
                feeder.join(timeout=2.0)  # no text after the cancel (it would start a new turn)
                try:
                    ws.send(json.dumps({"context_id": cid, "cancel": True}))
                    deadline = time.monotonic() + self.timeout
                    while time.monotonic() < deadline:
                        raw = ws.recv(timeout=max(0.01, deadline - time.monotonic()))
                        if isinstance(raw, str) and json.loads(raw).get("type") == "cancelled":
                            break
                except Exception:  # noqa: BLE001
                    self._ws_drop()
        if state["error"] is not None:
            raise state["error"]

    def close(self) -> None:
        self._ws_drop()


@dataclass
class _Chunk:
    codes: np.ndarray | None
    audio: np.ndarray
    segment: int
    text: str | None
    final: bool = False
    finish_reason: str | None = None


# ---------------------------------------------------------------- the CLI
def add_talk_parser(sub) -> None:
    import os

    p = sub.add_parser(
        "talk", help="a spoken conversation with any OpenAI-compatible LLM (and ASR), CSM speaking",
        description="Each turn: your speech (--input-wav, repeatable) is transcribed by --asr-url, or a line "
                    "is typed (--typed, from stdin); the LLM at --llm-url replies (streamed) and CSM speaks "
                    "the reply as it arrives, with the whole conversation (both sides' audio) as context. "
                    "Latency per turn is printed on stderr.")
    io_ = p.add_argument_group("turns")
    io_.add_argument("--input-wav", action="append", default=[], metavar="FILE",
                     help="a user turn as an audio file (repeat for several turns, in order)")
    io_.add_argument("--typed", action="store_true",
                     help="user turns typed as lines on stdin (a line typed while the assistant speaks barges in)")
    io_.add_argument("--out-dir", default=None, metavar="DIR",
                     help="write each assistant turn to DIR/turn-NN.wav (default: raw 24 kHz s16le PCM on stdout)")
    io_.add_argument("--barge-in-after-ms", type=int, default=None, metavar="MS",
                     help="test hook: the user speaks again after MS of each reply's audio (it is cut there)")
    ep = p.add_argument_group("endpoints (OpenAI-compatible)")
    ep.add_argument("--llm-url", required=True, help="chat completions base URL, e.g. http://localhost:8080/v1")
    ep.add_argument("--llm-model", default="default", help="model name sent to the LLM (default: 'default')")
    ep.add_argument("--asr-url", default=None, help="transcriptions base URL, e.g. http://localhost:9000/v1")
    ep.add_argument("--asr-model", default="whisper-1", help="model name sent to the ASR (default whisper-1)")
    ep.add_argument("--endpoint-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="Bearer key for the LLM/ASR endpoints [env OPENAI_API_KEY]")
    ep.add_argument("--system-prompt", default=SYSTEM_PROMPT, help="the LLM's system message")
    ep.add_argument("--timeout", type=float, default=60.0, help="seconds per endpoint call (default 60)")
    server = p.add_argument_group("CSM through a server (instead of in-process)")
    server.add_argument("--url", default=None,
                        help="a running `csmserve serve` (e.g. http://localhost:8000): its WebSocket, one context_id")
    server.add_argument("--api-key", default=os.environ.get("CSMSERVE_API_KEY"),
                        help="Bearer key for --url [env CSMSERVE_API_KEY]")
    server.add_argument("--voice", default=None, help="with --url: the server's voice (id, name or alias)")
    model = p.add_argument_group("CSM (in-process)")
    model.add_argument("--model", default="sesame/csm-1b",
                       help="hub id, local directory, or dummy-tiny (random weights, offline)")
    model.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    model.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    model.add_argument("--codec", default=None, help="Mimi weights (default: beside the model)")
    voice = p.add_argument_group("voices and sampling")
    voice.add_argument("--speaker", type=int, default=0, help="the assistant's CSM speaker id (default 0)")
    voice.add_argument("--user-speaker", type=int, default=1, help="the user's CSM speaker id (default 1)")
    voice.add_argument("--temperature", type=float, default=0.9)
    voice.add_argument("--top-k", type=int, default=50)
    voice.add_argument("--seed", type=int, default=None)
    voice.add_argument("--max-audio-length-ms", type=int, default=20_000, help="cap per sentence (default 20000)")
    voice.add_argument("--max-context-frames", type=int, default=1000,
                       help="audio frames of earlier turns kept in CSM's context, oldest dropped (default 1000)")
    p.set_defaults(func=talk)


def _turn_inputs(args, session: TalkSession) -> Iterator[tuple[bytes | None, str | None, str]]:
    from pathlib import Path

    for path in args.input_wav:
        try:
            yield Path(path).read_bytes(), None, path
        except OSError as e:
            session.log(f"error: cannot read {path!r}: {e.strerror or e}")
    if args.typed:
        import queue

        lines: queue.Queue = queue.Queue()

        def reader() -> None:  # lines typed while the assistant speaks barge in
            for line in sys.stdin:
                lines.put(line)
                if session.speaking:
                    session.interrupt()
            lines.put(None)

        threading.Thread(target=reader, daemon=True, name="csmserve-talk-stdin").start()
        while (line := lines.get()) is not None:
            if line.strip():
                yield None, line, "stdin"


def talk(args) -> int:
    from pathlib import Path

    from csmserve.apps.cli.main import CLIError

    if not args.input_wav and not args.typed:
        raise CLIError("no turns: give --input-wav FILE (repeatable) or --typed (lines on stdin)")
    if args.input_wav and not args.asr_url:
        raise CLIError("--input-wav needs --asr-url (an OpenAI-compatible /v1/audio/transcriptions endpoint)")
    for name in ("speaker", "user_speaker"):
        if not 0 <= getattr(args, name) <= 255:
            raise CLIError(f"--{name.replace('_', '-')} must be in 0..255")
    for name in ("llm_url", "asr_url", "url"):
        v = getattr(args, name)
        if v is not None and not v.startswith(("http://", "https://")):
            raise CLIError(f"--{name.replace('_', '-')} must start with http:// or https://, got {v!r}")
    if args.barge_in_after_ms is not None and args.barge_in_after_ms < 1:
        raise CLIError("--barge-in-after-ms must be >= 1")
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)

    from csmserve.api import CSM
    from csmserve.config import EngineConfig

    csm = None
    if not args.url:
        csm = CSM(args.model, device=args.device, dtype=args.dtype, codec=args.codec,
                  engine_config=EngineConfig(max_slots=2, max_seq_len=2048))
        if csm.mimi is None:
            csm.close()
            raise CLIError("talk needs the Mimi codec (audio in and out): pass --codec")

    def on_audio(turn: Turn, pcm: np.ndarray) -> None:
        if not args.out_dir:
            sys.stdout.buffer.write((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
            sys.stdout.buffer.flush()

    session = TalkSession(csm, args.llm_url, args.llm_model, args.asr_url, args.asr_model, args.speaker,
                          args.user_speaker, args.system_prompt or None, args.temperature, args.top_k,
                          seed=args.seed, max_audio_length_ms=args.max_audio_length_ms,
                          max_context_frames=args.max_context_frames, api_key=args.endpoint_key,
                          timeout=args.timeout, on_audio=on_audio,
                          log=lambda s: print(f"csmserve talk: {s}", file=sys.stderr, flush=True),
                          url=args.url, server_key=args.api_key, voice=args.voice)
    failed = 0
    try:
        for wav, text, name in _turn_inputs(args, session):
            turn = session.turn(wav, text, name=name, barge_in_after_ms=args.barge_in_after_ms)
            if turn.error:
                failed += 1
                continue
            if args.out_dir:
                path = Path(args.out_dir) / f"turn-{turn.index:02d}.wav"
                path.write_bytes(wav_bytes(turn.audio))
            cut = " (cut: barge-in)" if turn.interrupted else ""
            print(f"csmserve talk: turn {turn.index}: you: {turn.user_text!r} -> {turn.reply_text!r}{cut}, "
                  f"{turn.frames * FRAME_MS / 1000:.2f} s of audio; {turn.latency_line()}",
                  file=sys.stderr, flush=True)
    finally:
        session.close()
        if csm is not None:
            csm.close()
    return 1 if failed else 0
