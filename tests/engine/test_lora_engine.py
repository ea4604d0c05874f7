"""LoRA adapters in the engine (CPU, dummy-tiny, float32) through the CSM API and the engine-core process's messages:
a batch mixing 4 adapters and the base gives every row the codes it gets alone (greedy and seeded); a pool smaller
than the adapters in flight (LRU; every slot pinned -> the request waits); load and unload while other streams run;
bad adapters and names refused in one line while every other stream goes on."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from csmserve import CSM
from csmserve.config import EngineConfig
from csmserve.engine.adapters import AdapterLimitError, UnknownAdapterError
from csmserve.models.loader import tiny_config
from csmserve.models.lora import LoraError, LoraLayout

NAMES = ["a1", "a2", "a3", "a4"]
TEXTS = ["One voice here.", "Another, slower.", "A third one speaks.", "Four, at last.", "The base model."]
FRAMES = 8
STREAM_FRAMES = 24  # the streams that run while adapters are loaded, unloaded, refused


def write_adapter(d: Path, r: int = 4, seed: int = 0, std: float = 0.3, cfg=None, **config) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for dummy-tiny's shape, random
    A and B on every projection."""
    layout = LoraLayout(cfg or tiny_config())
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for hf in layout.hf:
        out, k = layout.shape_of(hf)
        sd[f"base_model.model.{hf}.lora_A.weight"] = torch.randn(r, k, generator=g) * std
        sd[f"base_model.model.{hf}.lora_B.weight"] = torch.randn(out, r, generator=g) * std
    d.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                      "bias": "none", "target_modules": ["q_proj"], **config}))
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(d / name, seed=i) for i, name in enumerate(NAMES + ["a5"])}


def make_csm(dirs, max_loras: int = 4, names=NAMES, **kw) -> CSM:
    cfg = EngineConfig(max_slots=8, max_seq_len=256, max_loras=max_loras, max_lora_rank=8, **kw)
    return CSM("dummy-tiny", device="cpu", dtype="float32", codec="none", engine_config=cfg,
               adapters={n: str(dirs[n]) for n in names})


@pytest.fixture(scope="module")
def csm(dirs):
    c = make_csm(dirs)
    yield c
    c.close()


_ALONE: dict = {}


def alone(csm, text, adapter, **kw):
    """The codes of one request alone on the module's engine (each asked once: the CPU is shared)."""
    key = (text, adapter, tuple(sorted(kw.items())))
    if key not in _ALONE:
        _ALONE[key] = csm.generate(text, adapter=adapter, max_audio_length_ms=FRAMES * 80, **kw).codes
    return _ALONE[key]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=7)], ids=["greedy", "seeded"])
def test_a_batch_mixing_four_adapters_and_the_base_equals_each_alone(csm, sampling):
    adapters = NAMES + [None]
    batch = csm.generate(TEXTS, adapter=adapters, max_audio_length_ms=FRAMES * 80, **sampling)
    codes = [r.codes for r in batch]
    for text, adapter, got in zip(TEXTS, adapters, codes):
        np.testing.assert_array_equal(got, alone(csm, text, adapter, **sampling))
    assert not np.array_equal(codes[0], alone(csm, TEXTS[0], None, **sampling))  # the adapter speaks differently


def test_more_adapters_than_the_pool_take_turns(dirs, csm):
    """A pool of 2 slots, 4 adapters and the base in one batch: the requests whose adapter is not resident wait in
    the queue (every slot pinned by a running request), the idle ones are evicted (LRU); every row as alone."""
    small = make_csm(dirs, max_loras=2)
    try:
        batch = small.generate(TEXTS, adapter=NAMES + [None], temperature=0, max_audio_length_ms=FRAMES * 80)
        for text, adapter, r in zip(TEXTS, NAMES + [None], batch):
            np.testing.assert_array_equal(r.codes, alone(csm, text, adapter, temperature=0))
        info = small.adapters
        assert sum(a["loads"] for a in info.values()) >= 4 and sum(a["resident"] for a in info.values()) <= 2
        assert small.engine.scheduler.adapters.take_loads() == []
    finally:
        small.close()


def _stream(csm, text, adapter, out: list, started: threading.Event):
    req = csm.request(text, adapter=adapter, temperature=0, max_audio_length_ms=STREAM_FRAMES * 80)
    for chunk in csm.client.stream(req):
        out.append(chunk.codes)
        started.set()


def test_load_and_unload_while_streams_run(dirs, csm):
    want = {a: alone(csm, TEXTS[0], a, temperature=0) for a in (None, "a1")}
    csm = make_csm(dirs, max_loras=3, names=["a1", "a2"])
    try:
        outs = {None: [], "a1": []}
        started = {k: threading.Event() for k in outs}
        threads = [threading.Thread(target=_stream, args=(csm, TEXTS[0], k, outs[k], started[k])) for k in outs]
        for t in threads:
            t.start()
        for e in started.values():
            assert e.wait(30)
        csm.load_adapter("a5", str(dirs["a5"]))  # while both stream
        csm.unload_adapter("a1")  # in use: its stream finishes with it
        with pytest.raises(UnknownAdapterError, match="unknown adapter 'a1'"):
            csm.generate(TEXTS[1], adapter="a1")
        fresh = csm.generate(TEXTS[1], adapter="a5", temperature=0, max_audio_length_ms=FRAMES * 80).codes
        for t in threads:
            t.join(60)
        for k, chunks in outs.items():
            got = np.concatenate(chunks)
            np.testing.assert_array_equal(got[:len(want[k])], want[k])  # want: FRAMES, the streams STREAM_FRAMES
        assert set(csm.adapters) == {"a2", "a5"} and len(fresh) > 0
        pool = csm.engine.scheduler.adapters
        assert all(a is None or a.name != "a1" for a in pool.slots)  # its slot freed after its stream
        csm.load_adapter("a1", str(dirs["a1"]))  # the name again
        again = csm.generate(TEXTS[0], adapter="a1", temperature=0, max_audio_length_ms=FRAMES * 80).codes
        np.testing.assert_array_equal(again, want["a1"])
    finally:
        csm.close()


def test_bad_adapters_and_names_refused_while_a_stream_runs(dirs, tmp_path, csm):
    want = alone(csm, TEXTS[2], "a2", temperature=0)
    out, started = [], threading.Event()
    t = threading.Thread(target=_stream, args=(csm, TEXTS[2], "a2", out, started))
    t.start()
    assert started.wait(30)
    other = tiny_config()
    other = type(other)(backbone=type(other.backbone)(**{**other.backbone.__dict__, "intermediate": 96}),
                        decoder=other.decoder, text_vocab_size=other.text_vocab_size)
    bad = {
        "other base": (write_adapter(tmp_path / "other", cfg=other), LoraError, "different base model"),
        "missing": (tmp_path / "nowhere", LoraError, "no such adapter directory"),
        "DoRA": (write_adapter(tmp_path / "dora", use_dora=True), LoraError, "DoRA"),
        "rank": (write_adapter(tmp_path / "r16", r=16), LoraError, "max_lora_rank 8"),
    }
    corrupt = write_adapter(tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    bad["corrupt"] = (corrupt, LoraError, "cannot read it")
    for what, (path, kind, match) in bad.items():
        with pytest.raises(kind, match=match) as e:
            csm.load_adapter("x", str(path))
        assert "\n" not in str(e.value), what
    with pytest.raises(ValueError, match="already loaded"):
        csm.load_adapter("a3", str(dirs["a3"]))
    with pytest.raises(UnknownAdapterError, match=r"unknown adapter 'nope' \(loaded: a1, a2, a3, a4\)"):
        csm.generate("Hi.", adapter="nope")
    with pytest.raises(UnknownAdapterError):
        csm.unload_adapter("nope")
    t.join(60)
    np.testing.assert_array_equal(np.concatenate(out)[:len(want)], want)  # the stream went on
    assert set(csm.adapters) == set(NAMES)


def test_limits_and_an_engine_without_adapters(dirs):
    plain = CSM("dummy-tiny", device="cpu", dtype="float32", codec="none",
                engine_config=EngineConfig(max_slots=2, max_seq_len=256))
    try:
        with pytest.raises(ValueError, match="serves no LoRA adapters"):
            plain.load_adapter("a1", str(dirs["a1"]))
        with pytest.raises(UnknownAdapterError, match="loaded: none"):
            plain.generate("Hi.", adapter="a1")
    finally:
        plain.close()
    capped = make_csm(dirs, max_loras=1, names=["a1"], max_cpu_loras=2)
    try:
        capped.load_adapter("a2", str(dirs["a2"]))
        with pytest.raises(AdapterLimitError, match="max_cpu_loras = 2"):
            capped.load_adapter("a3", str(dirs["a3"]))
    finally:
        capped.close()
    with pytest.raises(ValueError, match="engine=True"):
        CSM("dummy-tiny", device="cpu", codec="none", engine=False).generate("Hi.", adapter="a1")


def test_adapter_calls_through_the_engine_core_process_messages(dirs, tmp_path, monkeypatch, csm):
    """The engine-core loop (engine/core.py) with a worker's RemoteEngineClient: load / list / unload reach it as
    messages, a request's adapter rides its Submit; the codes are the in-process engine's."""
    import secrets

    from csmserve.engine import core
    from csmserve.engine.core import EngineSpec, serve_engine
    from csmserve.engine.remote import RemoteEngineClient

    monkeypatch.setattr(core, "freeze_gc", lambda: None)  # the test process's objects stay collectable
    cfg = EngineConfig(max_slots=4, max_seq_len=256, max_loras=2, max_lora_rank=8)
    spec = EngineSpec("dummy-tiny", "cpu", "float32", "none", None, cfg, str(tmp_path / "engine.sock"),
                      secrets.token_bytes(16), str(tmp_path / "ring"))
    threading.Thread(target=serve_engine, args=(spec, _load), daemon=True).start()
    client = RemoteEngineClient(spec.address, spec.authkey, client_id=3, timeout=60)
    try:
        info = client.load_adapter("a1", str(dirs["a1"]))
        assert info["name"] == "a1" and info["rank"] == 4
        with pytest.raises(LoraError, match="no such adapter directory"):
            client.load_adapter("x", str(tmp_path / "nowhere"))
        assert set(client.adapters()) == {"a1"}
        worker = CSM.attach(client)
        got = worker.generate(TEXTS[0], adapter="a1", temperature=0, max_audio_length_ms=FRAMES * 80).codes
        np.testing.assert_array_equal(got, alone(csm, TEXTS[0], "a1", temperature=0))
        client.unload_adapter("a1")
        with pytest.raises(UnknownAdapterError):
            client.unload_adapter("a1")
        with pytest.raises(UnknownAdapterError, match="unknown adapter 'a1'"):  # refused at submit, same kind
            worker.generate(TEXTS[0], adapter="a1", max_audio_length_ms=FRAMES * 80)
    finally:
        client.shutdown()


def _load(spec):
    return CSM(spec.model, device=spec.device, dtype=spec.dtype, codec=spec.codec, engine_config=spec.engine)
