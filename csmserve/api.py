"""The offline Python API: `CSM(model)` with `prompt`, `generate`, `stream`, `astream`, `speak`, `aspeak`,
`dialogue`, `encode_audio`. `CSM` is the one builder of requests (`request`, `long_request`), its own and the server's.

`speak` is long-form: text of any length, or streamed in piece by piece (`TextFeed`, also the server's WebSocket
turns), is cut into sentences (prompt/segments.py) and spoken in one slot as one continuous stream, each sentence
seeing the earlier ones. Generation runs on the engine, started on first use; `engine=False` keeps the reference
generator (batch 1), the golden path the tests compare to. LoRA: `CSM(model, adapters={"ann": path})`,
`load_adapter` / `unload_adapter`; every generating method takes `adapter="ann"` (None: the base model), rows of
different adapters in one batch (models/lora.py, engine/adapters.py).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from csmserve.models import reference
from csmserve.config import FRAME_SAMPLES, SAMPLE_RATE, EngineConfig
from csmserve.engine.request import AudioChunk, Request
from csmserve.sampling import SamplingParams
from csmserve.models.codec import load_codec
from csmserve.models.loader import DUMMY_MODELS, load_csm
from csmserve.engine.adapters import UnknownAdapterError
from csmserve.prompt.segments import SentenceSplitter
from csmserve.prompt.tokenizer import (FRAME_MS, PromptPart, PromptSegment, assemble, load_tokenizer, prompt_part,
                                       segment_ids, text_frames)
from csmserve.engine.paced import PACED_MODEL

if TYPE_CHECKING:
    from csmserve.engine.client import EngineClient

log = logging.getLogger("csmserve")
_START = threading.Lock()  # CSM.client: the engine is started once
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class Segment:
    """A context turn: who spoke, what they said, and their audio as Mimi codes [frames, 32] or a waveform."""

    speaker: int
    text: str
    codes: np.ndarray | None = None  # [frames, 32] int
    audio: np.ndarray | None = None  # [samples] float at 24 kHz (encoded with Mimi once)
    # (tokenizer, codes, speaker, text, PromptPart): tokenized once, not per request; never pickled
    _prompt_part: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_prompt_part"}

    @classmethod
    def of_voice(cls, voice, speaker: int | None = None) -> Segment:
        """A stored voice's clip as a context turn, spoken as `speaker` (default: the voice's own)."""
        return cls(voice.speaker if speaker is None else speaker, voice.transcript, codes=voice.codes)


@dataclass
class GenerationResult:
    codes: np.ndarray  # [frames, 32] int64, the ending all-zero frame excluded
    audio: np.ndarray | None  # [frames * 1920] float32 at 24 kHz; None without a codec
    finish_reason: str  # "eos" | "length" | "abort"
    seed: int | None
    sample_rate: int = SAMPLE_RATE

    @property
    def duration_s(self) -> float:
        return self.codes.shape[0] * FRAME_MS / 1000


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class CSM:
    """CSM-1B: `model` is a hub id, a local directory, `dummy` or `dummy-tiny`.

    codec: None = the Mimi weights beside the model (or random ones for dummy models); a path = a kyutai/mimi
    dir or moshi safetensors; "none" = codes only. adapters: name -> PEFT / unsloth adapter directory (checked
    here: LoraError); without max_loras in engine_config the pool is sized for them (a slot each, their largest
    rank)."""

    def __init__(self, model: str = "sesame/csm-1b", device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, codec: str | Path | None = None,
                 codec_dtype: str | torch.dtype | None = None, engine: bool = True,
                 engine_config: EngineConfig | None = None, adapters: dict[str, str] | None = None) -> None:
        self.model_name = model
        self.sample_rate = SAMPLE_RATE
        self.use_engine = engine
        self.engine_config = engine_config
        self._engine = None
        self._client = None
        # the adapters served (name -> LoraAdapter read at construction, or the path load_adapter read): registered
        # with each engine this CSM starts (a first use, or one after close())
        self._served: dict = {}
        # paced: no model, a stand-in engine paced at the GPU's measured step times (engine/paced.py)
        self.paced = model == PACED_MODEL
        if self.paced:
            from csmserve.models.csm import CSMConfig

            self.device, self.dtype = torch.device("cpu"), torch.float32
            self.model = self.mimi = self.model_dir = None
            self.config = CSMConfig()
            self.tokenizer = load_tokenizer(None)
            self.frame_size, self.has_codec = FRAME_SAMPLES, True
            return
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.model, self.config, self.model_dir = load_csm(model, self.device, self.dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        # Mimi: bfloat16 on CUDA (its error against float32: docs/benchmarks.md), float32 on the CPU
        cdtype = resolve_dtype(codec_dtype, self.device)
        self.mimi = load_codec(model, self.model_dir, codec, self.device, cdtype)
        self.frame_size = self.mimi.cfg.frame_size if self.mimi is not None else 1920
        self.has_codec = self.mimi is not None  # chunks carry audio (here, in the engine's process, or paced)
        if adapters:
            self._read_adapters(dict(adapters))

    @classmethod
    def attach(cls, client) -> "CSM":
        """A CSM without weights that builds prompts for an engine in another process (a RemoteEngineClient)."""
        from csmserve.models.csm import CSMConfig

        info = client.info
        self = cls.__new__(cls)
        self.model_name, self.device, self.dtype = info.model, torch.device("cpu"), torch.float32
        self.model = self.mimi = None
        self.config = CSMConfig(audio_vocab_size=info.audio_vocab_size, num_codebooks=info.num_codebooks,
                                max_seq_len=info.model_max_seq_len)
        self.model_dir = None if info.model_dir is None else Path(info.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.frame_size, self.sample_rate = info.frame_size, SAMPLE_RATE
        self.use_engine, self.engine_config = True, info.engine
        self._engine, self._client = None, client
        self._served = {}
        self.has_codec, self.paced = info.has_codec, False
        return self

    # ---- engine
    def build_engine(self, config: EngineConfig, **kw):
        """An engine for this model (engine.build_engine's keywords), the paced stand-in for `CSM("paced")`."""
        if self.paced:
            from csmserve.engine.paced import build_paced_engine

            return build_paced_engine(config, **kw)
        from csmserve.engine.engine import build_engine

        return build_engine(self.model, self.mimi, config, **kw)

    @property
    def client(self) -> "EngineClient":
        if self._client is None:
            with _START:  # one engine, even when threads ask for it at once
                if self._client is None:
                    from csmserve.engine.client import EngineClient

                    engine = self.build_engine(self.engine_config or EngineConfig())
                    client = EngineClient(engine)
                    for name, adapter in self._served.items():  # served before any request can reach it
                        client.load_adapter(name, adapter)
                    self._engine = engine
                    self._client = client
        return self._client

    @property
    def engine(self):
        _ = self.client
        return self._engine

    @property
    def random_weights(self) -> bool:
        """`dummy` / `dummy-tiny`: no EOS, so an unnamed length is a reader's length (config.reading_ms)."""
        return self.model_name in DUMMY_MODELS

    @property
    def ready(self) -> bool:
        return self._client is not None

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = self._client = None
        elif self._client is not None and hasattr(self._client, "shutdown"):
            self._client.shutdown()
            self._client = None

    # ---- LoRA adapters
    def _read_adapters(self, paths: dict[str, str]) -> None:
        import dataclasses

        from csmserve.models.lora import read_adapter

        cfg = self.engine_config or EngineConfig()
        rank = cfg.max_lora_rank if cfg.max_loras else None
        read = {name: read_adapter(path, self.config, self.dtype, rank) for name, path in paths.items()}
        if not cfg.max_loras:  # a pool for these: one slot each, their largest rank
            cfg = dataclasses.replace(cfg, max_loras=len(read),
                                      max_lora_rank=max(cfg.max_lora_rank, *(a.rank for a in read.values())))
        self.engine_config = cfg
        self._served = {n: a.pin() if self.device.type == "cuda" else a for n, a in read.items()}

    def take_adapters(self) -> dict:
        """The adapters read at construction, not served yet (name -> LoraAdapter), handed over once."""
        served, self._served = self._served, {}
        return served

    def load_adapter(self, name: str, path: str | Path) -> dict:
        """Serve the PEFT / unsloth adapter directory `path` as `name` (other streams go on) -> its info.
        LoraError: it cannot be served right; ValueError: the name is taken, or no adapter pool (max_loras 0)."""
        self._need_engine()
        info = self.client.load_adapter(name, str(path))
        self._served[name] = str(path)
        return info

    def unload_adapter(self, name: str) -> dict:
        """Stop serving `name`: new requests are refused (UnknownAdapterError), those in flight finish with it."""
        self._need_engine()
        info = self.client.unload_adapter(name)
        self._served.pop(name, None)
        return info

    @property
    def adapters(self) -> dict[str, dict]:
        """name -> info (rank, bytes, resident, running, queued, requests, loads, load_s) of each adapter served."""
        if self._client is None:
            return {n: {"name": n, "path": a, "resident": False} if isinstance(a, str) else
                    {"name": n, "rank": a.rank, "bytes": a.nbytes, "path": a.path, "resident": False}
                    for n, a in self._served.items()}
        return self._client.adapters()

    def _need_engine(self) -> None:
        if not self.use_engine:
            raise ValueError("LoRA adapters run on the engine: CSM(..., engine=True)")

    def _check_adapter(self, name: str | None) -> None:
        if name is None:
            return
        self._need_engine()
        known = self._served if self._client is None else (self._engine.adapters() if self._engine is not None
                                                             else None)
        if known is not None and name not in known:
            raise UnknownAdapterError(f"unknown adapter {name!r} (loaded: {', '.join(sorted(known)) or 'none'})")

    # ---- prompts
    def encode_audio(self, audio: np.ndarray) -> np.ndarray:
        """A 24 kHz mono waveform -> Mimi codes [frames, 32] int64."""
        if self.paced:
            from csmserve.engine.paced import stand_in_codes

            return stand_in_codes(audio)
        if self.mimi is None and not self.has_codec:
            raise RuntimeError("no codec loaded: pass codes=, or load CSM with a Mimi codec")
        audio = np.asarray(audio, dtype=np.float32)
        if audio.ndim != 1 or audio.size == 0:
            raise ValueError(f"audio must be a non-empty 1-D waveform at 24 kHz, got shape {audio.shape}")
        if self.mimi is None:  # attached: the engine process encodes
            return self._client.encode(audio)
        wav = torch.as_tensor(audio, device=self.device)
        with torch.inference_mode():
            codes = self.mimi.encode(wav[None, None].to(self.mimi.dtype))[0]  # [Q, T]
        return codes[: self.config.num_codebooks].T.cpu().numpy().astype(np.int64)

    def _part(self, seg: Segment) -> PromptPart:
        """seg tokenized and checked, cached on seg while its speaker, text and codes are the same objects."""
        hit = seg._prompt_part
        if hit is not None and hit[0] is self.tokenizer and hit[1] is seg.codes and hit[2] == seg.speaker \
                and hit[3] is seg.text and seg.audio is None:
            return hit[4]
        codes = seg.codes
        if codes is None and seg.audio is not None:
            codes = self.encode_audio(seg.audio)
        if codes is not None:
            codes = np.asarray(codes)
            if codes.size and (codes.min() < 0 or codes.max() >= self.config.audio_vocab_size):
                raise ValueError(f"codes must be in [0, {self.config.audio_vocab_size})")
        part = prompt_part(self.tokenizer, PromptSegment(int(seg.speaker), seg.text, codes), self.config.num_codebooks)
        if seg.audio is None:
            seg._prompt_part = (self.tokenizer, seg.codes, seg.speaker, seg.text, part)
        return part

    def prompt(self, text: str, speaker: int = 0, context: Sequence[Segment] = (),
               max_audio_length_ms: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt frames: tokens [T, 33] int64, mask [T, 33] bool (checked to leave room for the audio if given)."""
        return self.prompt_and_boundaries(text, speaker, context, max_audio_length_ms)[:2]

    def prompt_and_boundaries(self, text: str, speaker: int = 0, context: Sequence[Segment] = (),
                              max_audio_length_ms: int | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """prompt(), and the frame count after each context turn (shorter prefixes for the prefix cache)."""
        max_frames = None if max_audio_length_ms is None else max_audio_length_ms // FRAME_MS
        return assemble([self._part(seg) for seg in context], segment_ids(self.tokenizer, int(speaker), text),
                        self.config.num_codebooks, max_frames, self.max_seq_len)

    @property
    def max_seq_len(self) -> int:
        """Positions a request may use: the model's, or fewer when the engine's slots hold fewer."""
        engine = self.engine_config.max_seq_len if self.engine_config is not None else self.config.max_seq_len
        return min(self.config.max_seq_len, engine)

    def request(self, text: str, speaker: int = 0, context: Sequence[Segment] = (), temperature: float = 0.9,
                top_k: int = 50, top_p: float = 1.0, seed: int | None = None,
                max_audio_length_ms: int | None = 10_000, max_segment_length_ms: int | None = None,
                fit_cap: bool = False, adapter: str | None = None) -> Request:
        """A request speaking `text` as `speaker` after the `context` turns. max_audio_length_ms caps the whole
        (None: no cap), max_segment_length_ms one segment of a long-form request. The prompt must leave room for
        one segment's cap, unless it is past the slot's positions (the engine stops at the slot's end);
        fit_cap=True: whatever it is (the server refuses a cap the slot cannot hold). ValueError: a prompt that
        does not fit, codes out of range; UnknownAdapterError."""
        self._check_adapter(adapter)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                max_audio_length_ms=max_audio_length_ms, max_segment_length_ms=max_segment_length_ms)
        room = self._room(params, fit_cap)
        tokens, mask, bounds = self.prompt_and_boundaries(text, speaker, context,
                                                          None if room is None else room * FRAME_MS)
        # the context turns are a reusable prefix (the engine's prefix cache keeps their KV); the boundaries
        # before the last are its shorter candidates
        prefix = bounds[-1] if bounds else 0
        return Request(tokens, mask, params=params, prefix_len=prefix, prefix_boundaries=tuple(bounds[:-1]),
                       adapter=adapter)

    def _room(self, params: SamplingParams, fit_cap: bool) -> int | None:
        """Frames the prompt must leave for one segment's audio (None: none checked, see `request`)."""
        frames = params.segment_frames
        return frames if fit_cap or frames < self.max_seq_len else None

    def history_overflow(self, text: str, history: Sequence[Segment], speaker: int = 0,
                         context: Sequence[Segment] = (), temperature: float = 0.9, top_k: int = 50,
                         top_p: float = 1.0, seed: int | None = None, max_audio_length_ms: int | None = None,
                         max_segment_length_ms: int | None = 20_000, fit_cap: bool = False,
                         adapter: str | None = None) -> int:
        """How many of the oldest segments of `history` (oldest first) a request speaking `text` after
        `context + history` (long_request's keywords) must leave out so that `context + history[n:]` fits, or
        n = len(history) (the request's own error then says why). ValueError: codes out of range anywhere."""
        room = self._room(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                         max_audio_length_ms=max_audio_length_ms,
                                         max_segment_length_ms=max_segment_length_ms), fit_cap)
        fixed = sum(self._part(seg).frames for seg in context)
        sizes = [self._part(seg).frames for seg in history]  # every one checked, as the whole prompt would be
        if room is None:
            return 0
        left = self.max_seq_len + 1 - room - fixed - len(segment_ids(self.tokenizer, int(speaker), text))  # assemble's
        kept = 0
        for size in reversed(sizes):
            if size > left:
                break
            left -= size
            kept += 1
        return len(history) - kept

    # ---- generation
    def generate(self, text: str | Sequence[str] | Sequence[Request], speaker: int = 0,
                 context: Sequence[Segment] = (), temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0,
                 seed: int | None = None, max_audio_length_ms: int = 10_000,
                 adapter: str | None | Sequence[str | None] = None) -> GenerationResult | list[GenerationResult]:
        """Speech for `text` as `speaker`, after `context`. temperature 0 = greedy; seed None = a random seed.
        A list of texts (`adapter`: one for all, or one per text) or of `Request`s runs together on the engine
        -> a list of results in the same order."""
        kw = dict(speaker=speaker, context=context, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  max_audio_length_ms=max_audio_length_ms)
        if isinstance(text, str):
            if not isinstance(adapter, (str, type(None))):
                raise ValueError("one text takes one adapter (a name or None), not a list")
            req = self.request(text, adapter=adapter, **kw)
            return self._results([req])[0] if self.use_engine else self._reference(req)
        text = list(text)
        adapters = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * len(text)
        if len(adapters) != len(text):
            raise ValueError(f"{len(text)} texts but {len(adapters)} adapters")
        reqs = [t if isinstance(t, Request) else self.request(t, adapter=a, **kw) for t, a in zip(text, adapters)]
        return self._results(reqs)

    def stream(self, text: str | Request, **kw) -> Iterator[AudioChunk]:
        """Chunks (.audio float32 24 kHz, .codes [n, 32]) as they are generated; the first after one frame."""
        req = text if isinstance(text, Request) else self.request(text, **kw)
        yield from self.client.stream(req)

    async def astream(self, text: str | Request, **kw) -> AsyncIterator[AudioChunk]:
        req = text if isinstance(text, Request) else self.request(text, **kw)
        async for chunk in self.client.astream(req):
            yield chunk

    # ---- long-form
    def segment_frames(self, text: str, speaker: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """A later segment's prompt: the text frames of `<bos>[speaker]text<eos>`."""
        return text_frames(segment_ids(self.tokenizer, int(speaker), text), self.config.num_codebooks)

    def long_request(self, segments: Sequence[str], speaker: int = 0, context: Sequence[Segment] = (),
                     open: bool = False, temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0,
                     seed: int | None = None, max_audio_length_ms: int | None = None,
                     max_segment_length_ms: int | None = 20_000, speakers: Sequence[int] | None = None,
                     fit_cap: bool = False, adapter: str | None = None) -> Request:
        """One request speaking `segments` in order in one slot (max_audio_length_ms caps the whole,
        max_segment_length_ms each segment; fit_cap: see `request`); open=True: more may be appended
        (EngineClient.append) until EngineClient.close. speakers: each segment's (default `speaker`)."""
        if not segments:
            raise ValueError("no text to speak")
        spk = [int(speaker)] * len(segments) if speakers is None else [int(s) for s in speakers]
        if len(spk) != len(segments):
            raise ValueError(f"{len(segments)} segments but {len(spk)} speakers")
        req = self.request(segments[0], spk[0], context, temperature, top_k, top_p, seed, max_audio_length_ms,
                           max_segment_length_ms, fit_cap, adapter)
        req.context_len = req.prefix_len  # the context turns: everything before the first segment's text
        req.segments = deque(self.segment_frames(t, s) for t, s in zip(segments[1:], spk[1:]))
        req.open = open
        return req

    def speak(self, text: str | Iterable[str], speaker: int = 0, context: Sequence[Segment] = (),
              temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0, seed: int | None = None,
              max_audio_length_ms: int | None = None, max_segment_length_ms: int | None = 20_000,
              max_words: int = 25, max_chars: int = 250, adapter: str | None = None) -> Iterator[AudioChunk]:
        """Long-form speech as one stream of AudioChunks (chunk.segment / chunk.text: which sentence).
        `text`: a string or an iterable of pieces (e.g. from an LLM): speech starts once the first sentence is
        complete; the rest is read on a thread of its own. The same text gives the same segments (and, greedy
        or seeded, the same audio) whole or in pieces."""
        speech = _Speech(self, max_words, max_chars, dict(
            speaker=speaker, context=context, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            max_audio_length_ms=max_audio_length_ms, max_segment_length_ms=max_segment_length_ms, adapter=adapter))
        pieces = iter([text] if isinstance(text, str) else text)
        for piece in pieces:
            if speech.take(piece):
                break
        req = speech.request(whole=isinstance(text, str))  # a string: every segment now, one closed request

        def read_rest() -> None:
            with speech.reading(BaseException) as feed:  # anything, re-raised in the caller's thread
                for piece in pieces:
                    if speech.stopped:
                        return
                    feed.feed(piece)
                feed.end()

        reader = threading.Thread(target=read_rest, name="csmserve-speak-feed", daemon=True)
        try:
            for chunk in self.client.stream(req, on_submit=speech.on_submit(reader.start)):
                yield speech.feed.label(chunk)
        finally:
            speech.stopped = True
        speech.raise_error()

    async def aspeak(self, text: str | Iterable[str] | AsyncIterable[str], speaker: int = 0,
                     context: Sequence[Segment] = (), temperature: float = 0.9, top_k: int = 50,
                     top_p: float = 1.0, seed: int | None = None, max_audio_length_ms: int | None = None,
                     max_segment_length_ms: int | None = 20_000, max_words: int = 25, max_chars: int = 250,
                     adapter: str | None = None) -> AsyncIterator[AudioChunk]:
        """`speak` for asyncio; `text` may also be an async iterable of pieces (the rest of it is read in a
        task of this loop). A string is one piece of text streamed in."""
        speech = _Speech(self, max_words, max_chars, dict(
            speaker=speaker, context=context, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            max_audio_length_ms=max_audio_length_ms, max_segment_length_ms=max_segment_length_ms, adapter=adapter))
        if isinstance(text, str):
            text = [text]
        pieces = text.__aiter__() if isinstance(text, AsyncIterable) else _aiter(text)
        async for piece in pieces:
            if speech.take(piece):
                break
        req = speech.request()

        async def read_rest() -> None:
            with speech.reading(Exception) as feed:  # re-raised after the stream; a cancel is not kept
                async for piece in pieces:
                    feed.feed(piece)
                feed.end()

        tasks: list[asyncio.Task] = []

        def start() -> None:
            tasks.append(asyncio.get_running_loop().create_task(read_rest()))

        try:
            async for chunk in self.client.astream(req, on_submit=speech.on_submit(start)):
                yield speech.feed.label(chunk)
        finally:
            for t in tasks:
                t.cancel()
        speech.raise_error()

    def dialogue(self, lines: Sequence[tuple[int, str]], context: Sequence[Segment] = (), temperature: float = 0.9,
                 top_k: int = 50, top_p: float = 1.0, seed: int | None = None, max_audio_length_ms: int | None = None,
                 max_segment_length_ms: int | None = 20_000, adapter: str | None = None) -> Iterator[AudioChunk]:
        """A multi-speaker script, `[(speaker, text), ...]`, as one stream of AudioChunks: every line's sentences
        in one slot, after `context` (e.g. each speaker's voice clip). chunk.text: its sentence."""
        from csmserve.prompt.dialogue import Line, segments

        segs = segments([Line(t) for _, t in lines], [s for s, _ in lines])
        texts = [t for _, _, t in segs]
        req = self.long_request(texts, context=context, speakers=[s for _, s, _ in segs], temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed, max_audio_length_ms=max_audio_length_ms,
                                max_segment_length_ms=max_segment_length_ms, adapter=adapter)
        for chunk in self.client.stream(req):
            yield label(chunk, texts)

    def _results(self, reqs: list[Request]) -> list[GenerationResult]:
        out = []
        for req, chunks in zip(reqs, self.client.run(reqs)):
            codes = np.concatenate([c.codes for c in chunks])
            audio = np.concatenate([c.audio for c in chunks]) if self.has_codec else None  # attached: decoded there
            out.append(GenerationResult(codes, audio, chunks[-1].finish_reason or "length", req.params.seed))
        return out

    def _reference(self, req: Request) -> GenerationResult:  # (request() refused an adapter: no engine)
        out = reference.generate(self.model, req.tokens, req.mask, req.params)
        return GenerationResult(out.codes, self.decode(out.codes), out.finish_reason, out.seed)

    def decode(self, codes: np.ndarray) -> np.ndarray | None:
        """Whole-utterance Mimi decode of codes [frames, 32] -> float32 [frames * 1920]."""
        if self.mimi is None:
            return None
        with torch.inference_mode():
            c = torch.as_tensor(np.asarray(codes).T[None], dtype=torch.long, device=self.device)  # [1, 32, T]
            return self.mimi.decode(c)[0, 0].float().cpu().numpy()


async def _aiter(items: Iterable[str]) -> AsyncIterator[str]:
    for item in items:
        yield item
        await asyncio.sleep(0)


def label(chunk: AudioChunk, texts: Sequence[str]) -> AudioChunk:
    """chunk.text: the text of the segment it speaks (None past the known ones)."""
    chunk.text = texts[chunk.segment] if chunk.segment < len(texts) else None
    return chunk


class TextFeed:
    """Text streamed into one long-form request (`CSM.speak`, `CSM.aspeak`, the server's WebSocket turns).
    Pieces are cut into segments as they arrive (the same segments as the whole text); `open` builds the request
    with the segments so far; once the engine has it (`start`) each later segment is appended as it completes,
    and `end` appends the rest and closes it. `texts`: every segment so far (AudioChunk.segment indexes it).
    Fed from one thread or loop at a time; `open` may run on another while pieces still arrive."""

    def __init__(self, csm: CSM, max_words: int = 25, max_chars: int = 250) -> None:
        self.csm = csm
        self.splitter = SentenceSplitter(max_words, max_chars)
        self.texts: list[str] = []
        self.ended = False  # the text ended (the splitter flushed)
        self.request: Request | None = None
        self.speaker = 0
        self._given = 0  # segments the request has: in its prompt and segments, or appended
        self._open = self._started = self._done = False

    @property
    def ready(self) -> bool:
        """A segment is complete, or the text ended: the request can be built."""
        return bool(self.texts) or self.ended

    def feed(self, piece: str) -> list[str]:
        """A piece of text -> the segments it completed."""
        new = self.splitter.feed(piece)
        self.texts += new
        self._give()
        return new

    def end(self) -> list[str]:
        """The text ended -> its last segments; once they are given, the request is closed."""
        if self.ended:
            return []
        new = self.splitter.flush()
        self.texts += new
        self.ended = True  # after the texts: `open` on another thread reads `ended` first
        self._give()
        return new

    def open(self, speaker: int = 0, **kw) -> Request:
        """The request (CSM.long_request's keywords): the segments so far, open unless the text ended."""
        ended = self.ended
        texts = list(self.texts)
        self.request = self.csm.long_request(texts, speaker, open=not ended, **kw)
        self.speaker, self._given, self._open = int(speaker), len(texts), not ended
        return self.request

    def start(self) -> None:
        """The engine has the request (its stream's on_submit): appending starts."""
        self._started = True
        self._give()

    def stop(self) -> None:
        """Its stream is over: nothing more is appended (nor closed)."""
        self._done = True

    def close(self) -> None:
        """No more segments for the open request (once; also after a failure: what it has is spoken)."""
        if self._open and not self._done:
            self._done = True
            self.csm.client.close(self.request.request_id)

    def label(self, chunk: AudioChunk) -> AudioChunk:
        return label(chunk, self.texts)

    def _give(self) -> None:
        if not self._started or self._done:
            return
        while self._given < len(self.texts):
            text = self.texts[self._given]
            self._given += 1
            self.csm.client.append(self.request.request_id, *self.csm.segment_frames(text, self.speaker))
        if self.ended:
            self.close()


class _Speech:
    """One `speak` or `aspeak` call: its TextFeed, its request once the first segment is complete, and the
    error of reading the rest of its text (re-raised after the stream)."""

    def __init__(self, csm: CSM, max_words: int, max_chars: int, kw: dict) -> None:
        self.feed = TextFeed(csm, max_words, max_chars)
        self.kw = kw
        self.errors: list[BaseException] = []
        self.stopped = False  # the caller stopped reading the stream: read no more text

    def take(self, piece: str) -> bool:
        """A piece read before the request exists -> whether the request can be built now."""
        self.feed.feed(piece)
        return self.feed.ready

    def request(self, whole: bool = False) -> Request:
        """The request, once take() said so or the pieces ran out. whole: the text ends here."""
        if whole or not self.feed.ready:
            self.feed.end()
        return self.feed.open(**self.kw)

    def on_submit(self, read_rest: Callable[[], None]) -> Callable[[], None] | None:
        """The stream's on_submit: appending starts, then `read_rest`; None when the text has ended."""
        if self.feed.ended:
            return None

        def submitted() -> None:
            self.feed.start()
            read_rest()

        return submitted

    @contextmanager
    def reading(self, keep: type[BaseException]) -> Iterator[TextFeed]:
        """Around reading the rest of the text: an error of type `keep` is kept; the request is closed."""
        try:
            yield self.feed
        except keep as e:  # noqa: BLE001
            self.errors.append(e)
        finally:
            self.feed.close()

    def raise_error(self) -> None:
        if self.errors:
            raise self.errors[0]
