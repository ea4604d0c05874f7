"""The offline Python API: `CSM(model)` with `prompt`, `generate`, `stream`, `astream`, `speak`, `aspeak`,
`encode_audio`.

`speak` is long-form: text of any length (or text streamed in, piece by piece) is cut into sentences
(csmserve/prompt/segments.py) and spoken in one slot, each sentence seeing the earlier ones as context, as one
continuous audio stream.

Generation runs on the engine (continuous batching; CUDA graphs on a GPU) started on first use;
`engine=False` keeps the plain reference generator (batch 1), the golden path the tests compare to.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from csmserve.models import reference
from csmserve.config import EngineConfig
from csmserve.engine.request import AudioChunk, Request
from csmserve.sampling import SamplingParams
from csmserve.models.codec import load_codec
from csmserve.models.loader import load_csm
from csmserve.prompt.segments import SentenceSplitter, split_sentences
from csmserve.prompt.tokenizer import FRAME_MS, PromptSegment, load_tokenizer, prompt_frames_and_boundaries, segment_ids, text_frames
from csmserve.config import SAMPLE_RATE

if TYPE_CHECKING:
    from csmserve.engine.client import EngineClient

log = logging.getLogger("csmserve")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class Segment:
    """A context turn: who spoke, what they said, and their audio as Mimi codes [frames, 32] or a waveform."""

    speaker: int
    text: str
    codes: np.ndarray | None = None  # [frames, 32] int
    audio: np.ndarray | None = None  # [samples] float at 24 kHz (encoded with Mimi once)


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

    codec: None = the Mimi weights beside the model (`codec_model.*`, a moshi/kyutai file in the same
    directory, or random weights for dummy models); a path = a kyutai/mimi dir or moshi safetensors;
    "none" = no codec (codes only).
    """

    def __init__(self, model: str = "sesame/csm-1b", device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, codec: str | Path | None = None,
                 codec_dtype: str | torch.dtype | None = None, engine: bool = True,
                 engine_config: EngineConfig | None = None) -> None:
        self.model_name = model
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.model, self.config, self.model_dir = load_csm(model, self.device, self.dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        # Mimi: bfloat16 on CUDA (its error against float32: docs/benchmarks.md), float32 on the CPU
        cdtype = resolve_dtype(codec_dtype, self.device)
        self.mimi = load_codec(model, self.model_dir, codec, self.device, cdtype)
        self.frame_size = self.mimi.cfg.frame_size if self.mimi is not None else 1920
        self.sample_rate = SAMPLE_RATE
        self.use_engine = engine
        self.engine_config = engine_config
        self._engine = None
        self._client = None

    @classmethod
    def attach(cls, client) -> "CSM":
        """A CSM without weights over an engine in another process (an API worker's): prompts are built
        here with the model's tokenizer; generation and audio encoding run in the engine process.
        `client` is an engine.remote.RemoteEngineClient (its `info` describes the model)."""
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
        self._has_codec = info.has_codec
        return self

    # ---- engine
    @property
    def client(self) -> "EngineClient":
        if self._client is None:
            from csmserve.engine.client import EngineClient
            from csmserve.engine.engine import build_engine

            self._engine = build_engine(self.model, self.mimi, self.engine_config or EngineConfig())
            self._client = EngineClient(self._engine)
        return self._client

    @property
    def engine(self):
        _ = self.client
        return self._engine

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

    # ---- prompts
    def encode_audio(self, audio: np.ndarray) -> np.ndarray:
        """A 24 kHz mono waveform -> Mimi codes [frames, 32] int64."""
        if self.mimi is None and getattr(self, "_has_codec", False):  # attached: the engine process encodes
            audio = np.asarray(audio, dtype=np.float32)
            if audio.ndim != 1 or audio.size == 0:
                raise ValueError(f"audio must be a non-empty 1-D waveform at 24 kHz, got shape {audio.shape}")
            return self._client.encode(audio)
        if self.mimi is None:
            raise RuntimeError("no codec loaded: pass codes=, or load CSM with a Mimi codec")
        wav = torch.as_tensor(np.asarray(audio, dtype=np.float32), device=self.device)
        if wav.ndim != 1 or wav.numel() == 0:
            raise ValueError(f"audio must be a non-empty 1-D waveform at 24 kHz, got shape {tuple(wav.shape)}")
        with torch.inference_mode():
            codes = self.mimi.encode(wav[None, None].to(self.mimi.dtype))[0]  # [Q, T]
        return codes[: self.config.num_codebooks].T.cpu().numpy().astype(np.int64)

    def _segments(self, context: Sequence[Segment]) -> list[PromptSegment]:
        out = []
        for seg in context:
            codes = seg.codes
            if codes is None and seg.audio is not None:
                codes = self.encode_audio(seg.audio)
            if codes is not None:
                codes = np.asarray(codes)
                if codes.size and (codes.min() < 0 or codes.max() >= self.config.audio_vocab_size):
                    raise ValueError(f"codes must be in [0, {self.config.audio_vocab_size})")
            out.append(PromptSegment(int(seg.speaker), seg.text, codes))
        return out

    def prompt(self, text: str, speaker: int = 0, context: Sequence[Segment] = (),
               max_audio_length_ms: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt frames: tokens [T, 33] int64, mask [T, 33] bool (checked to leave room for the audio if given)."""
        return self.prompt_and_boundaries(text, speaker, context, max_audio_length_ms)[:2]

    def prompt_and_boundaries(self, text: str, speaker: int = 0, context: Sequence[Segment] = (),
                              max_audio_length_ms: int | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """prompt(), and the frame count after each context turn (shorter prefixes for the prefix cache)."""
        max_frames = None if max_audio_length_ms is None else max_audio_length_ms // FRAME_MS
        return prompt_frames_and_boundaries(self.tokenizer, self._segments(context), text, int(speaker),
                                            self.config.num_codebooks, max_frames, self.max_seq_len)

    @property
    def max_seq_len(self) -> int:
        """Positions a request may use: the model's, or fewer when the engine's slots hold fewer."""
        engine = self.engine_config.max_seq_len if self.engine_config is not None else self.config.max_seq_len
        return min(self.config.max_seq_len, engine)

    def request(self, text: str, speaker: int = 0, context: Sequence[Segment] = (), temperature: float = 0.9,
                top_k: int = 50, top_p: float = 1.0, seed: int | None = None,
                max_audio_length_ms: int | None = 10_000, max_segment_length_ms: int | None = None) -> Request:
        """max_audio_length_ms caps the whole request (None: no cap); max_segment_length_ms one segment
        of a long-form request. The prompt must leave room for one segment's audio."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                max_audio_length_ms=max_audio_length_ms, max_segment_length_ms=max_segment_length_ms)
        room = params.segment_frames * FRAME_MS if params.segment_frames < self.max_seq_len else None
        tokens, mask, bounds = self.prompt_and_boundaries(text, speaker, context, room)
        # the context turns (a voice's reference, a conversation's earlier turns) are a reusable prefix:
        # the engine's prefix cache keeps their KV, so the next request with the same context prefills
        # only its own text, and one whose context grew by a turn only that turn and its text
        prefix = len(tokens) - len(self.segment_frames(text, speaker)[0])
        return Request(tokens, mask, params=params, prefix_len=prefix, prefix_boundaries=tuple(bounds[:-1]))

    # ---- generation
    def generate(self, text: str | Sequence[str] | Sequence[Request], speaker: int = 0,
                 context: Sequence[Segment] = (), temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0,
                 seed: int | None = None, max_audio_length_ms: int = 10_000
                 ) -> GenerationResult | list[GenerationResult]:
        """Speech for `text` as `speaker`, after `context`. temperature 0 = greedy; seed None = a random seed.

        A list of texts (same keyword arguments for all) or of `Request`s runs together on the engine
        and returns a list of results in the same order.
        """
        kw = dict(speaker=speaker, context=context, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  max_audio_length_ms=max_audio_length_ms)
        if isinstance(text, str):
            if not self.use_engine:
                return self._reference(self.request(text, **kw))
            return self._results([self.request(text, **kw)])[0]
        reqs = [t if isinstance(t, Request) else self.request(t, **kw) for t in text]
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
                     max_segment_length_ms: int | None = 20_000, speakers: Sequence[int] | None = None) -> Request:
        """One request speaking `segments` in order in one slot (max_audio_length_ms caps the whole,
        max_segment_length_ms each segment); open=True: more may be appended (EngineClient.append)
        until EngineClient.close. speakers: each segment's speaker (a dialogue); default `speaker` for all."""
        if not segments:
            raise ValueError("no text to speak")
        spk = [int(speaker)] * len(segments) if speakers is None else [int(s) for s in speakers]
        if len(spk) != len(segments):
            raise ValueError(f"{len(segments)} segments but {len(spk)} speakers")
        req = self.request(segments[0], spk[0], context, temperature, top_k, top_p, seed, max_audio_length_ms,
                           max_segment_length_ms)
        req.context_len = req.prefix_len  # the context turns: everything before the first segment's text
        req.segments = deque(self.segment_frames(t, s) for t, s in zip(segments[1:], spk[1:]))
        req.open = open
        return req

    def speak(self, text: str | Iterable[str], speaker: int = 0, context: Sequence[Segment] = (),
              temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0, seed: int | None = None,
              max_audio_length_ms: int | None = None, max_segment_length_ms: int | None = 20_000,
              max_words: int = 25, max_chars: int = 250) -> Iterator[AudioChunk]:
        """Long-form speech as one stream of AudioChunks (chunk.segment / chunk.text: which sentence).

        `text`: a string (cut into sentences, clauses when long) or an iterable of pieces (text streamed
        in, e.g. from an LLM): speech starts once the first sentence is complete and the slot waits for
        the rest. max_audio_length_ms caps the whole (None: no cap), max_segment_length_ms each segment.
        The same text gives the same segments (and, greedy or seeded, the same audio) whole or in pieces."""
        kw = dict(speaker=speaker, context=context, temperature=temperature, top_k=top_k, top_p=top_p,
                  seed=seed, max_audio_length_ms=max_audio_length_ms, max_segment_length_ms=max_segment_length_ms)
        if isinstance(text, str):
            texts = split_sentences(text, max_words, max_chars)
            req = self.long_request(texts, **kw)
            for chunk in self.client.stream(req):
                chunk.text = texts[chunk.segment] if chunk.segment < len(texts) else None
                yield chunk
            return
        splitter, it = SentenceSplitter(max_words, max_chars), iter(text)
        texts, more = self._first_segments(splitter, it)
        req = self.long_request(texts, open=more, **kw)
        stop, errors = threading.Event(), []

        def feed() -> None:
            try:
                for piece in it:
                    if stop.is_set():
                        return
                    self._append_segments(req, texts, splitter.feed(piece), speaker)
                self._append_segments(req, texts, splitter.flush(), speaker)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
            finally:
                self.client.close(req.request_id)

        feeder = threading.Thread(target=feed, name="csmserve-speak-feed", daemon=True)
        try:
            for chunk in self.client.stream(req, on_submit=feeder.start if more else None):
                chunk.text = texts[chunk.segment] if chunk.segment < len(texts) else None
                yield chunk
        finally:
            stop.set()
        if errors:
            raise errors[0]

    def dialogue(self, lines: Sequence[tuple[int, str]], context: Sequence[Segment] = (), temperature: float = 0.9,
                 top_k: int = 50, top_p: float = 1.0, seed: int | None = None, max_audio_length_ms: int | None = None,
                 max_segment_length_ms: int | None = 20_000) -> Iterator[AudioChunk]:
        """A multi-speaker script, `[(speaker, text), ...]`, as one stream of AudioChunks: every line (cut
        into sentences) in one slot, each seeing the earlier lines' text and generated audio with their
        speaker ids. `context` goes first (e.g. each speaker's voice clip). chunk.text: its sentence."""
        from csmserve.prompt.dialogue import Line, segments

        segs = segments([Line(t) for _, t in lines], [s for s, _ in lines])
        texts = [t for _, _, t in segs]
        req = self.long_request(texts, context=context, speakers=[s for _, s, _ in segs], temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed, max_audio_length_ms=max_audio_length_ms,
                                max_segment_length_ms=max_segment_length_ms)
        for chunk in self.client.stream(req):
            chunk.text = texts[chunk.segment] if chunk.segment < len(texts) else None
            yield chunk

    async def aspeak(self, text: str | Iterable[str] | AsyncIterable[str], speaker: int = 0,
                     context: Sequence[Segment] = (), temperature: float = 0.9, top_k: int = 50,
                     top_p: float = 1.0, seed: int | None = None, max_audio_length_ms: int | None = None,
                     max_segment_length_ms: int | None = 20_000, max_words: int = 25, max_chars: int = 250
                     ) -> AsyncIterator[AudioChunk]:
        """`speak` for asyncio; `text` may also be an async iterable of pieces."""
        kw = dict(speaker=speaker, context=context, temperature=temperature, top_k=top_k, top_p=top_p,
                  seed=seed, max_audio_length_ms=max_audio_length_ms, max_segment_length_ms=max_segment_length_ms)
        if isinstance(text, str):
            text = [text]
        splitter = SentenceSplitter(max_words, max_chars)
        ait = text.__aiter__() if isinstance(text, AsyncIterable) else _aiter(text)
        texts: list[str] = []
        more = True
        while not texts and more:
            try:
                texts += splitter.feed(await ait.__anext__())
            except StopAsyncIteration:
                texts += splitter.flush()
                more = False
        req = self.long_request(texts, open=more, **kw)
        errors: list[BaseException] = []

        async def feed() -> None:
            try:
                async for piece in ait:
                    self._append_segments(req, texts, splitter.feed(piece), speaker)
                self._append_segments(req, texts, splitter.flush(), speaker)
            except Exception as e:  # noqa: BLE001 - re-raised after the stream
                errors.append(e)
            finally:
                self.client.close(req.request_id)

        task: list[asyncio.Task] = []
        start = (lambda: task.append(asyncio.get_running_loop().create_task(feed()))) if more else None
        try:
            async for chunk in self.client.astream(req, on_submit=start):
                chunk.text = texts[chunk.segment] if chunk.segment < len(texts) else None
                yield chunk
        finally:
            for t in task:
                t.cancel()
        if errors:
            raise errors[0]

    def _first_segments(self, splitter: SentenceSplitter, it: Iterator[str]) -> tuple[list[str], bool]:
        """Read pieces until the first segment is complete -> (segments so far, more input may come)."""
        texts: list[str] = []
        for piece in it:
            texts += splitter.feed(piece)
            if texts:
                return texts, True
        texts += splitter.flush()
        if not texts:
            raise ValueError("no text to speak")
        return texts, False

    def _append_segments(self, req: Request, texts: list[str], new: list[str], speaker: int) -> None:
        for t in new:
            texts.append(t)
            self.client.append(req.request_id, *self.segment_frames(t, speaker))

    def _results(self, reqs: list[Request]) -> list[GenerationResult]:
        out = []
        for req, chunks in zip(reqs, self.client.run(reqs)):
            codes = np.concatenate([c.codes for c in chunks])
            audio = np.concatenate([c.audio for c in chunks]) if self.mimi is not None else None
            out.append(GenerationResult(codes, audio, chunks[-1].finish_reason or "length", req.params.seed))
        return out

    def _reference(self, req: Request) -> GenerationResult:
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
