"""Text tokenizers and prompt frames (spec §1.4, §1.7).

Every segment's text is encoded as `<|begin_of_text|>[speaker]text<|end_of_text|>`, one text frame
per token. A context turn is its text frames, then its audio frames, then one all-zero EOS frame;
the target turn is its text frames only. Frames are 33 columns (32 codebooks, then the text token)
with a 33-column bool mask.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Protocol

import numpy as np

from csmserve.config import FRAME_MS


class TextTokenizer(Protocol):
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...


class HFTokenizer:
    """The Llama-3 tokenizer from a `tokenizer.json` (library `tokenizers`)."""

    def __init__(self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.bos_id = self._special_id(bos_token or "<|begin_of_text|>")
        self.eos_id = self._special_id(eos_token or "<|end_of_text|>")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _special_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer.json has no token {token!r}")
        return i

    def encode(self, text: str) -> list[int]:
        # the file's own post-processor (which may add bos) is bypassed; segment_ids adds bos/eos
        return self._tok.encode(text, add_special_tokens=False).ids


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, bos 256, eos 257: the text side of dummy models."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _token_content(value: object) -> str | None:
    # tokenizer_config.json holds special tokens as a string or an AddedToken dict
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(model_dir: str | Path | None) -> TextTokenizer:
    """`tokenizer.json` of the model directory (bos/eos from `tokenizer_config.json` if present), else bytes."""
    if model_dir is None:
        return ByteTokenizer()
    d = Path(model_dir)
    if not (d / "tokenizer.json").is_file():
        raise ValueError(f"{d} has no tokenizer.json (the Llama-3 tokenizer the model was trained with)")
    bos = eos = None
    if (d / "tokenizer_config.json").is_file():
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        bos, eos = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
    return HFTokenizer(d / "tokenizer.json", bos, eos)


def segment_ids(tok: TextTokenizer, speaker: int, text: str) -> list[int]:
    """`<|begin_of_text|>[speaker]text<|end_of_text|>` as ids."""
    return [tok.bos_id, *tok.encode(f"[{speaker}]{text}"), tok.eos_id]


@dataclass
class PromptSegment:
    """A context turn: its speaker, its text and its audio as Mimi codes [n, K] (or None)."""

    speaker: int
    text: str
    codes: np.ndarray | None = None


def text_frames(ids: Sequence[int], num_codebooks: int) -> tuple[np.ndarray, np.ndarray]:
    # -> tokens [n, K+1] int64 (text in the last column), mask [n, K+1] bool (last column only)
    return assemble((), ids, num_codebooks, max_seq_len=len(ids))[:2]


@dataclass
class PromptPart:
    """A context turn tokenized: its text ids (`<bos>[speaker]text<eos>`, one text frame each) and its audio
    codes [n, K] (checked; None: a text-only turn), whose frames follow as audio frames + one EOS frame."""

    ids: np.ndarray  # [t] int64
    codes: np.ndarray | None = None  # [n, K] int (any integer dtype: written into the int64 frames)

    @property
    def frames(self) -> int:
        return len(self.ids) + (0 if self.codes is None else len(self.codes) + 1)


def prompt_part(tok: TextTokenizer, seg: PromptSegment, num_codebooks: int) -> PromptPart:
    """seg's text tokenized, its codes checked ([n, K], integers; their range is the model's, CSM checks it)."""
    codes = seg.codes
    if codes is not None:
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != num_codebooks:
            raise ValueError(f"codes must be [frames, {num_codebooks}], got {list(codes.shape)}")
        if codes.dtype.kind not in "iu":
            raise ValueError(f"codes must be integers, got {codes.dtype}")
    return PromptPart(np.asarray(segment_ids(tok, seg.speaker, seg.text), dtype=np.int64), codes)


def assemble(parts: Sequence[PromptPart], target_ids: Sequence[int], num_codebooks: int = 32,
             max_frames: int | None = None, max_seq_len: int = 2048) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Context parts then the target turn's text ids -> tokens [T, K+1] int64, mask [T, K+1] bool, and the
    frame count after each part (the turn boundaries). Written into one allocation, a slice per part.

    With `max_frames`, the prompt plus that many generated frames, all but the last of which is fed back, must fit
    in `max_seq_len` positions (checked before anything is allocated; Scheduler.frame_limit's bound)."""
    boundaries = list(accumulate(p.frames for p in parts))
    total = (boundaries[-1] if boundaries else 0) + len(target_ids)
    if max_frames is not None and total + max_frames > max_seq_len + 1:  # the last frame is not fed back
        raise ValueError(
            f"prompt too long: {total} prompt frames + {max_frames} frames of audio "
            f"({max_frames * FRAME_MS} ms) exceed the model's {max_seq_len} positions; "
            f"shorten the context or lower max_audio_length_ms"
        )
    k = num_codebooks
    tokens = np.zeros((total, k + 1), dtype=np.int64)
    mask = np.zeros((total, k + 1), dtype=bool)
    at = 0
    for p in parts:
        t = len(p.ids)
        tokens[at:at + t, k] = p.ids
        mask[at:at + t, k] = True
        at += t
        if p.codes is not None:
            a = len(p.codes)
            tokens[at:at + a, :k] = p.codes  # then the all-zero EOS frame, audio columns masked in
            mask[at:at + a + 1, :k] = True
            at += a + 1
    tokens[at:, k] = target_ids
    mask[at:, k] = True
    return tokens, mask, boundaries


def prompt_frames(tok: TextTokenizer, segments: Sequence[PromptSegment], target_text: str, target_speaker: int,
                  num_codebooks: int = 32, max_frames: int | None = None,
                  max_seq_len: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """Context turns then the target turn's text -> tokens [T, K+1] int64, mask [T, K+1] bool (max_frames,
    max_seq_len: as assemble's)."""
    return prompt_frames_and_boundaries(tok, segments, target_text, target_speaker, num_codebooks, max_frames,
                                        max_seq_len)[:2]


def prompt_frames_and_boundaries(tok: TextTokenizer, segments: Sequence[PromptSegment], target_text: str,
                                 target_speaker: int, num_codebooks: int = 32, max_frames: int | None = None,
                                 max_seq_len: int = 2048) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """prompt_frames, and the frame count after each context turn (the turn boundaries: the prefixes a
    growing conversation shares with its earlier requests)."""
    parts = [prompt_part(tok, seg, num_codebooks) for seg in segments]
    return assemble(parts, segment_ids(tok, target_speaker, target_text), num_codebooks, max_frames, max_seq_len)
