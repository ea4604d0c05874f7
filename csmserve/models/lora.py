"""LoRA adapters on our module layout: PEFT / unsloth adapter directories read and checked, the pool of adapters'
weights the batched forward reads, and the LoRA math in torch (the reference of kernels/lora.py).

An adapter directory is what PEFT's (and unsloth's) `save_pretrained` writes for transformers'
`CsmForConditionalGeneration`: `adapter_config.json` + `adapter_model.safetensors` (or `.bin`), tensors named
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]; y = W x + s B A x with
s = alpha / r (rsLoRA: alpha / sqrt(r)), r and alpha per module where `rank_pattern` / `alpha_pattern` say.

Our q,k,v and gate,up are fused projections (models/llama.py): a LoRA on q, k and v is three slices of one qkv
output, each slice its own A (its shrink) and its own column range of B (its expand). An adapter is packed in one
host buffer [rank, width]: each rank row holds, per LoRA-able projection (`LoraLayout`), its A [S, K] (S slices)
then its B [N] (every slice's columns, the scale folded in); a projection or slice it does not target is zeros.
The pool (`LoraPool`) is the same rows for `max_loras` adapters [L, R, width]: loading an adapter into slot l is
one copy into weights[l, :rank]; each projection reads views A [L, R, S, K] and B [L, R, N].

Refused with one line saying why (LoraError), never served wrong: a different base shape, DoRA, bias, embedding
or head LoRA, modules we do not have, a rank over the pool's. PEFT with plain target names also wraps Mimi's
transformer inside CsmForConditionalGeneration (`codec_model.*`); training leaves it at B = 0: all-zero codec deltas
are dropped (one log line), a non-zero one is refused.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

log = logging.getLogger("csmserve.lora")

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
# <module>.lora_A.weight / .lora_B.weight (PEFT drops the adapter name on save; a raw state dict keeps it)
_LORA_KEY = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# config fields that change the math or what is trained: refused when set (field -> what it is)
_UNSUPPORTED = {"use_dora": "DoRA (use_dora)", "lora_bias": "a LoRA bias (lora_bias)",
                "use_qalora": "QALoRA (use_qalora)",
                "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
                "layer_replication": "layer_replication", "trainable_token_indices": "trainable tokens",
                "modules_to_save": "modules_to_save (full copies of modules)", "target_parameters": "target_parameters",
                "fan_in_fan_out": "fan_in_fan_out", "use_bdlora": "BD-LoRA (use_bdlora)"}
# init_lora_weights that leave the base weights as they are (PEFT's others rewrite them to W - B0 A0, or quantize them)
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica")
# transformers modules we know but do not adapt -> what they are
_HEADS = {"lm_head": "the codebook-0 head (lm_head)", "embed_text_tokens": "the text embedding",
          "backbone_model.embed_tokens.embed_audio_tokens": "the audio embedding",
          "depth_decoder.model.embed_tokens": "the depth decoder's audio embedding",
          "depth_decoder.codebooks_head": "the codebook heads"}


class LoraError(ValueError):
    """An adapter that cannot be served right: the message says why in one line."""


# ---------------------------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class Target:
    """One LoRA-able projection of ours: module path, input features K, output widths of its slices (q, k, v /
    gate, up / one), and where its A [S, K] and B [N] sit in a rank row of the packed layout."""

    module: str
    k: int
    slices: tuple[int, ...]
    a_off: int
    b_off: int
    hf: tuple[str, ...]  # transformers' module of each slice

    @property
    def n(self) -> int:
        return sum(self.slices)

    @property
    def bounds(self) -> tuple[int, int]:
        """(end of slice 0, end of slice 1) in output columns; past N for slices that do not exist."""
        ends = [sum(self.slices[:i + 1]) for i in range(len(self.slices))]
        return (ends[0] if len(ends) > 1 else self.n, ends[1] if len(ends) > 2 else self.n)


class LoraLayout:
    """Every LoRA-able projection of a CSMConfig in a fixed order, and the width of one packed rank row."""

    def __init__(self, cfg) -> None:  # a CSMConfig (not imported: llama.py, which csm.py imports, calls this file)
        self.cfg = cfg
        self.targets: list[Target] = []
        self.hf: dict[str, tuple[int, int]] = {}  # transformers' module -> (target index, slice)
        off = 0

        def add(module: str, k: int, slices: tuple[int, ...], hf: tuple[str, ...]) -> None:
            nonlocal off
            t = Target(module, k, slices, off, off + len(slices) * k, hf)
            off = t.b_off + t.n
            for s, name in enumerate(hf):
                self.hf[name] = (len(self.targets), s)
            self.targets.append(t)

        for ours, theirs, c in (("backbone", "backbone_model", cfg.backbone),
                                ("decoder", "depth_decoder.model", cfg.decoder)):
            hd = c.head_dim
            for i in range(c.n_layers):
                p, q = f"{ours}.layers.{i}.", f"{theirs}.layers.{i}."
                add(p + "self_attn.qkv_proj", c.dim, (c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd),
                    tuple(q + f"self_attn.{x}_proj" for x in "qkv"))
                add(p + "self_attn.o_proj", c.n_heads * hd, (c.dim,), (q + "self_attn.o_proj",))
                add(p + "mlp.gate_up_proj", c.dim, (c.intermediate, c.intermediate),
                    (q + "mlp.gate_proj", q + "mlp.up_proj"))
                add(p + "mlp.down_proj", c.intermediate, (c.dim,), (q + "mlp.down_proj",))
        add("projection", cfg.backbone.dim, (cfg.decoder.dim,), ("depth_decoder.model.inputs_embeds_projector",))
        self.width = off

    def shape_of(self, hf: str) -> tuple[int, int]:
        """(out, in) of one transformers module we adapt."""
        t, s = self.targets[self.hf[hf][0]], self.hf[hf][1]
        return t.slices[s], t.k


# ---------------------------------------------------------------------------------------------- adapters

@dataclass
class LoraAdapter:
    """One adapter in the packed layout: weights [rank, layout.width] (the model dtype, CPU; pinned once
    `pin()`ed), the scales folded into B."""

    path: str
    rank: int
    weights: Tensor
    modules: int  # transformers modules it adapts
    alpha: float  # lora_alpha (the config's; patterns may differ per module)
    rslora: bool
    dropped_codec: int = 0  # zero codec_model deltas dropped
    info: dict = field(default_factory=dict)  # base_model_name_or_path, target_modules (for listings)

    @property
    def nbytes(self) -> int:
        return self.weights.numel() * self.weights.element_size()

    def pin(self) -> "LoraAdapter":
        if not self.weights.is_pinned():
            self.weights = self.weights.pin_memory()
        return self


def random_adapter(cfg, rank: int, seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.bfloat16
                   ) -> LoraAdapter:
    """Random A and B of `rank` on every projection, packed for `cfg` (benchmarks, `--model dummy`'s tests)."""
    layout = LoraLayout(cfg)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rank, layout.width, generator=g) * std).to(dtype)
    return LoraAdapter(f"random:{seed}", rank, w, sum(len(t.slices) for t in layout.targets), float(rank), False)


def write_adapter(d: str | Path, cfg, rank: int = 16, seed: int = 0, std: float = 0.02, alpha: float | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """A PEFT adapter directory for `cfg`'s shape as PEFT's save_pretrained writes one (adapter_config.json +
    adapter_model.safetensors, transformers' module names), random A and B of `rank` on every projection we adapt:
    what the load benchmark and the tests serve, PEFT-free. alpha: lora_alpha (default 2 * rank)."""
    from safetensors.torch import save_file

    d = Path(d)
    layout = LoraLayout(cfg)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for hf in layout.hf:
        out, k = layout.shape_of(hf)
        sd[f"{_PREFIX}{hf}.lora_A.weight"] = (torch.randn(rank, k, generator=g) * std).to(dtype)
        sd[f"{_PREFIX}{hf}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * std).to(dtype)
    d.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(d / WEIGHT_FILES[0]))
    targets = sorted(layout.hf)  # full names: plain ones would wrap Mimi's q/k/v/o too (left at B = 0 by PEFT)
    (d / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "task_type": None, "r": rank, "lora_alpha": 2 * rank if alpha is None else alpha,
        "lora_dropout": 0.0, "bias": "none", "target_modules": targets, "use_rslora": False, "use_dora": False,
        "base_model_name_or_path": None}, indent=2))
    return d


def _pattern(patterns: dict, module: str, default):
    # PEFT's get_pattern_key: the first key k with module matching (.*\.)?(k)$
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(path: str | Path) -> tuple[Path, dict]:
    """An adapter directory -> (it, its checked adapter_config.json)."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise LoraError(f"{d}: no such adapter directory")
    path = d / CONFIG_FILE
    if not path.is_file():
        raise LoraError(f"{d}: not a PEFT adapter directory (no {CONFIG_FILE})")
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(c, dict):
        raise LoraError(f"{path}: not a JSON object")
    if c.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path}: peft_type {c.get('peft_type')!r} is not LoRA")
    for key, what in _UNSUPPORTED.items():
        if c.get(key):
            raise LoraError(f"{d}: {what} is not supported")
    init = c.get("init_lora_weights", True)
    if not (isinstance(init, bool) or init in _PLAIN_INITS):
        raise LoraError(f"{d}: init_lora_weights={init!r} is not supported: PiSSA, OLoRA, CorDA, LoRA-GA and LoftQ "
                        f"adapters apply to base weights their initialisation rewrote, not to the base model (save "
                        f"one with path_initial_model_for_weight_conversion= to make it a plain LoRA)")
    if c.get("bias", "none") != "none":
        raise LoraError(f"{d}: bias={c['bias']!r} is not supported (only bias='none': base biases stay untrained)")
    for key in ("r", "lora_alpha"):
        if not isinstance(c.get(key), (int, float)) or c[key] <= 0:
            raise LoraError(f"{path}: {key} must be a positive number, got {c.get(key)!r}")
    return d, c


def _zero_delta(a: Tensor, b: Tensor) -> bool:
    """B A is zero, to float32 rounding: untrained (B = 0), or a PiSSA / OLoRA save converted to a plain LoRA, whose
    untouched layers hold [A; A0] and [B, -B0] (|BA| ~1e-7 of |B| |A|, where a trained delta is ~r^-1/2 of it)."""
    a, b = a.float(), b.float()
    return bool(torch.linalg.norm(b @ a) <= 1e-5 * torch.linalg.norm(b) * torch.linalg.norm(a))


def _read_tensors(d: Path) -> dict[str, Tensor]:
    for name in WEIGHT_FILES:
        path = d / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path), device="cpu")
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file: its error, in one line
            first = " ".join(str(e).split())[:200]
            raise LoraError(f"{path}: cannot read it ({type(e).__name__}: {first})") from None
        if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
            raise LoraError(f"{path}: not a dict of tensors")
        return sd
    raise LoraError(f"{d}: no {' or '.join(WEIGHT_FILES)}")


def check_adapter_dir(path: str | Path, max_rank: int | None = None) -> None:
    """What read_adapter checks before it reads a tensor (a directory, its config's fields and rank, a weights file):
    what the command line can say at once, without the model (LoraError)."""
    d, c = _read_config(path)
    if not any((d / name).is_file() for name in WEIGHT_FILES):
        raise LoraError(f"{d}: no {' or '.join(WEIGHT_FILES)}")
    ranks = [c["r"], *(r for r in (c.get("rank_pattern") or {}).values() if isinstance(r, (int, float)))]
    if max_rank is not None and max(ranks) > max_rank:
        raise LoraError(f"{d}: rank {max(ranks):g} is over the pool's max_lora_rank {max_rank} (--max-lora-rank)")


def read_adapter(path: str | Path, cfg, dtype: torch.dtype = torch.float32,
                 max_rank: int | None = None) -> LoraAdapter:
    """A PEFT adapter directory -> LoraAdapter packed for `cfg` (a CSMConfig; CPU, `dtype`). LoraError (one line)
    for anything that cannot be served right; max_rank: the pool's (EngineConfig.max_lora_rank)."""
    d, c = _read_config(path)
    sd = _read_tensors(d)
    layout = LoraLayout(cfg)
    pairs: dict[str, dict[str, Tensor]] = {}
    unexpected: list[str] = []
    for key, t in sd.items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        m = _LORA_KEY.match(name)
        if m is None:
            if "lora_magnitude_vector" in name:
                raise LoraError(f"{d}: DoRA (lora_magnitude_vector) is not supported")
            if "lora_embedding_" in name:
                raise LoraError(f"{d}: LoRA on {_what(name.split('.lora_embedding_')[0])} is not supported")
            unexpected.append(key)
            continue
        pairs.setdefault(m["mod"], {})[m["ab"]] = t
    for mod in pairs:  # a head's LoRA first: PEFT saves a tied head's full weight beside it
        if mod in _HEADS:
            raise LoraError(f"{d}: LoRA on {_HEADS[mod]} is not supported")
    if unexpected:
        raise LoraError(f"{d}: unexpected tensor {unexpected[0]} (only lora_A / lora_B weights are supported)")
    rslora = bool(c.get("use_rslora"))
    ranks, alphas = c.get("rank_pattern") or {}, c.get("alpha_pattern") or {}
    chosen: list[tuple[str, Tensor, Tensor, float]] = []  # (hf module, A [r, K], B [N_s, r], scale)
    codec_zero = 0
    for mod, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{d}: {mod} has lora_{'A' if 'A' in ab else 'B'} but no lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or not a.is_floating_point() \
                or not b.is_floating_point():
            raise LoraError(f"{d}: {mod} lora_A {list(a.shape)} and lora_B {list(b.shape)} are not a LoRA pair")
        if mod.startswith("codec_model."):
            if not _zero_delta(a, b):
                raise LoraError(f"{d}: {mod} is a non-zero LoRA on Mimi's transformer (codec_model); codec LoRA "
                                f"is not supported")
            codec_zero += 1
            continue
        if mod not in layout.hf:
            raise LoraError(f"{d}: module {mod} is not a projection of this model's backbone or depth decoder "
                            f"(an adapter for another model?)")
        r = a.shape[0]
        out, k = layout.shape_of(mod)
        if a.shape[1] != k or b.shape[0] != out:
            raise LoraError(f"{d}: trained for a different base model: {mod} lora_A {list(a.shape)}, lora_B "
                            f"{list(b.shape)}, this model's {mod} is [{out}, {k}]")
        r_cfg = _pattern(ranks, mod, c["r"])
        if r_cfg != r:
            raise LoraError(f"{d}: {mod} has rank {r} but the config says r={r_cfg}")
        alpha = float(_pattern(alphas, mod, c["lora_alpha"]))
        chosen.append((mod, a, b, alpha / (math.sqrt(r) if rslora else r)))
    if codec_zero:
        log.info("adapter %s: %d zero LoRA deltas on Mimi's transformer (codec_model) dropped", d, codec_zero)
    if not chosen:
        raise LoraError(f"{d}: no LoRA weights for this model's backbone or depth decoder")
    rank = max(a.shape[0] for _, a, _, _ in chosen)
    if max_rank is not None and rank > max_rank:
        raise LoraError(f"{d}: rank {rank} is over the pool's max_lora_rank {max_rank} (--max-lora-rank)")
    w = torch.zeros(rank, layout.width, dtype=torch.float32)
    for mod, a, b, scale in chosen:
        t_i, s = layout.hf[mod]
        t = layout.targets[t_i]
        r = a.shape[0]
        w[:r, t.a_off + s * t.k:t.a_off + (s + 1) * t.k] = a.float()
        col = t.b_off + sum(t.slices[:s])
        w[:r, col:col + t.slices[s]] = (b.float() * scale).T
    if not torch.isfinite(w := w.to(dtype)).all():
        raise LoraError(f"{d}: its weights hold NaN or infinite values (a diverged fine-tune?)")
    info = {"base_model": c.get("base_model_name_or_path"), "target_modules": c.get("target_modules")}
    return LoraAdapter(str(d), rank, w, len(chosen), float(c["lora_alpha"]), rslora, codec_zero, info)


def _what(module: str) -> str:
    return _HEADS.get(module, module)


# ------------------------------------------------------------------------------------------------- the pool

class LoraLayer:
    """The pool's weights of one projection: A [L, R, S, K], B [L, R, N] (views of LoraPool.weights, B scaled),
    ranks [L] int32 (each slot's adapter rank: kernels read no row past it). The rows' adapters come from the
    pool: `pool.rows` [B] int32 (-1: none) for the forward in flight, B batch rows of x's M = B * rows_per."""

    def __init__(self, pool: "LoraPool", target: Target) -> None:
        self.pool, self.target = pool, target
        L, R, W = pool.weights.shape
        S, K, N = len(target.slices), target.k, target.n
        w = pool.weights
        self.a = w.as_strided((L, R, S, K), (R * W, W, K, 1), w.storage_offset() + target.a_off)
        self.b = w.as_strided((L, R, N), (R * W, W, 1), w.storage_offset() + target.b_off)
        self._scratch: tuple[Tensor, Tensor] | None = None
        # an MLP's gate_up: its block's down (LoraPool), whose shrink kernels/lora.py's GLU makes past TICKET_ROWS
        # rows and leaves in the down's `shrunk`: (the h it shrank, its pieces), taken by the down's next call
        self.down: LoraLayer | None = None
        self.shrunk: tuple[Tensor, Tensor] | None = None

    @property
    def rows(self) -> Tensor | None:
        return self.pool.rows

    def scratch(self, rb: int) -> tuple[Tensor, Tensor]:
        """The ticketed kernels' (kernels/lora.py) shrink partial sums [pieces, TICKET_ROWS in whole tiles, rb] float32
        and counters [4] int32, this projection's own (its calls run one after another), made once, never inside a
        capture."""
        from csmserve.kernels.lora import TICKET_ROWS, TICKET_TILE, pieces

        rows = max(1, -(-TICKET_ROWS // TICKET_TILE)) * TICKET_TILE  # at least one tile (the GEMV's 16 rows)
        if self._scratch is None or self._scratch[0].shape[1:] != (rows, rb):
            dev = self.a.device
            n = len(self.target.slices) * pieces(self.target.k)
            self._scratch = (torch.zeros(n, rows, rb, dtype=torch.float32, device=dev),
                             torch.zeros(4, dtype=torch.int32, device=dev))
        return self._scratch


class LoraPool:
    """`max_loras` adapters' weights on the model's device, [L, R, width] (R = max_lora_rank) zeros until loaded,
    and every LoRA-able module's LoraLayer (`module.lora`). `rows` [B] int32: each batch row's slot (-1: none),
    set by the runner before a forward (a static buffer inside the CUDA graphs); None: no LoRA in this forward."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        p = next(model.parameters())
        self.layout = LoraLayout(model.cfg)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.weights = torch.zeros(max_loras, max_rank, self.layout.width, dtype=p.dtype, device=p.device)
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=p.device)
        self.rows: Tensor | None = None
        self.layers = []
        detach(model)  # a pool of an earlier runner on the same model
        for t in self.layout.targets:
            layer = LoraLayer(self, t)
            model.get_submodule(t.module).lora = layer
            if t.module.endswith("mlp.down_proj"):  # after its block's gate_up (LoraLayout's order)
                assert self.layers[-1].target.module == t.module.replace("down_proj", "gate_up_proj")
                self.layers[-1].down = layer
            self.layers.append(layer)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Adapter into slot (on the current stream; the caller orders it after the steps that read the slot's
        last adapter and before the first that reads this one): one copy of its rows, the rest zeroed."""
        r = adapter.rank
        self.weights[slot, :r].copy_(adapter.weights, non_blocking=True)
        self.weights[slot, r:].zero_()
        self.ranks[slot] = r


class LoraMerge:
    """One adapter merged into the model's own projection weights, in place: W += B A per slice (one rounding, as
    PEFT's merge_and_unload; B carries the scale), so a step whose every row has that adapter runs the plain kernels
    (engine/runner.py decides when). The base weights stay in `base` (a copy of every LoRA'd weight on the device,
    ~2 GiB for CSM-1B in bf16), copied back by `restore`: exact, no drift over any number of merges. The CUDA
    graphs hold the weights' storage, which both keep. Weights other than the pool's dtype (FP8's e4m3) cannot merge
    (`possible`)."""

    def __init__(self, model: nn.Module, pool: "LoraPool") -> None:
        self.pool = pool
        self.weights = [model.get_submodule(layer.target.module).weight for layer in pool.layers]  # [N, K] each
        self.base = [w.detach().clone() for w in self.weights]
        self.slot = -1  # the pool slot merged now; -1: the base weights
        model.__dict__["lora_merge"] = self  # a later runner on the model restores it (detach)

    @staticmethod
    def possible(model: nn.Module, pool: "LoraPool") -> bool:
        w0 = pool.weights
        for layer in pool.layers:
            w = getattr(model.get_submodule(layer.target.module), "weight", None)
            if not isinstance(w, Tensor) or w.dtype != w0.dtype or w.shape != (layer.target.n, layer.target.k):
                return False
        return True

    @torch.no_grad()
    def merge(self, slot: int) -> None:
        """The adapter in pool slot `slot` into the weights (the base ones first, if another is merged)."""
        if self.slot == slot:
            return
        self.restore()
        for w, layer in zip(self.weights, self.pool.layers):
            a, b, col = layer.a[slot], layer.b[slot], 0  # [R, S, K], [R, N]
            for s, width in enumerate(layer.target.slices):
                w[col:col + width].addmm_(b[:, col:col + width].T, a[:, s])  # [N_s, R] @ [R, K]
                col += width
        self.slot = slot

    @torch.no_grad()
    def restore(self) -> None:
        if self.slot < 0:
            return
        for w, base in zip(self.weights, self.base):
            w.copy_(base)
        self.slot = -1


def detach(model: nn.Module) -> None:
    """Take every LoraLayer off the model's modules (its pool's memory goes with the last reference), and the base
    weights back where an adapter is merged."""
    merge = model.__dict__.pop("lora_merge", None)
    if merge is not None:
        merge.restore()
    for m in model.modules():
        m.__dict__.pop("lora", None)


# ------------------------------------------------------------------------------------------------- the math

def row_adapters(rows: Tensor, m: int) -> Tensor:
    """rows [B] (each batch row's slot) -> [m] for x's m = B * rows_per flattened rows (a row's positions
    consecutive: the depth decoder's first step has 2 per row)."""
    per = m // rows.shape[0]
    return rows if per == 1 else rows.repeat_interleave(per)


_GATHER_ELEMS = 1 << 22  # below this many gathered weights (M x R x (S K + N)) the rows' adapters are gathered


def shrink_torch(x: Tensor, lora: LoraLayer) -> Tensor:
    """x [M, K] -> xa [M, S, R] in x's dtype (as PEFT's lora_A(x) rounds it), zero on rows without an adapter.
    No host sync: each row's A gathered (few rows), or every slot's shrink and each row's picked (memory M L S R)."""
    ad = row_adapters(lora.rows, x.shape[0]).long()
    a = lora.a
    if x.shape[0] * a[0].numel() <= _GATHER_ELEMS:
        xa = torch.einsum("mk,mrsk->msr", x.float(), a[ad.clamp(min=0)].float())
    else:
        xa = torch.einsum("mk,lrsk->mlsr", x.float(), a.float())  # [M, L, S, R]
        xa = xa[torch.arange(x.shape[0], device=x.device), ad.clamp(min=0)]  # [M, S, R]
    return torch.where((ad >= 0)[:, None, None], xa, 0.0).to(x.dtype)


def expand_torch(xa: Tensor, lora: LoraLayer) -> Tensor:
    """xa [M, S, R] -> the LoRA delta [M, N] in xa's dtype (B scaled already); slice s's columns use xa[:, s]. Each
    row's B gathered (few rows), or one product per slot and slice, each row's own kept."""
    ad = row_adapters(lora.rows, xa.shape[0])
    slices = lora.target.slices
    if xa.shape[0] * lora.b[0].numel() <= _GATHER_ELEMS:
        b = lora.b[ad.long().clamp(min=0)].float()  # [M, R, N]; rows without an adapter: xa is zero
        parts, col = [], 0
        for s, width in enumerate(slices):
            parts.append(torch.einsum("mr,mrn->mn", xa[:, s].float(), b[:, :, col:col + width]))
            col += width
        return torch.cat(parts, 1).to(xa.dtype)
    out = torch.zeros(xa.shape[0], lora.target.n, dtype=torch.float32, device=xa.device)
    col = 0
    for s, width in enumerate(slices):
        for slot in range(lora.b.shape[0]):
            mine = xa[:, s].float() * (ad == slot)[:, None]  # [M, R]
            out[:, col:col + width] += mine @ lora.b[slot, :, col:col + width].float()
        col += width
    return out.to(xa.dtype)


def delta_torch(x: Tensor, lora: LoraLayer) -> Tensor:
    """The LoRA delta of x [..., K] -> [..., N]: B (A x) per row's adapter, rounded as PEFT does (x A^T to the
    dtype, then B)."""
    x2 = x.reshape(-1, x.shape[-1])
    return expand_torch(shrink_torch(x2, lora), lora).reshape(*x.shape[:-1], lora.target.n)
