"""kernels/gemv.py's default launches compiled for sm_90 without a GPU, this tree against a git ref, PTX compared.

python bench/ptx_diff.py [--ref main] [--keep DIR]
python bench/ptx_diff.py --lora      (this tree's LoRA launches only: that each compiles for sm_90)

Every launch variant of CSM-1B's path without LoRA (bf16 and e4m3 weights; 1-2 rows: the plain GEMV, the norm with
and without the delta, the GLU, the gather; 3 and 16 rows: the tensor-core kernel with its K splits; PDL on, as on
Hopper, and off; CSMSERVE_KERNEL_TUNING as set) is made by the tree's own gemv() / norm_gemv() / gather_gemv() on
meta tensors, the launches recorded in place of the kernels, specialised as Triton specialises them at launch and
compiled with Triton's own compiler for GPUTarget("cuda", 90, 32). The PTX is compared without comments, debug
sections and location lines. Exit status 1 where a variant differs or exists on one side only (--keep DIR: each
side's PTX files, to diff). --lora: the fused GEMV with LoRA at 1-16 rows and kernels/lora.py's kernels past them,
rank 16 and 64, on every LoRA-able projection (Triton's interpreter does not type-check what the compiler does).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, N, K, glu, norm, gather): the GEMMs of models/llama.py's and models/csm.py's default path; the norm's
# GEMMs (norm_then, norm_matmul_t) take the norm at 1-2 rows only, with delta (False: layer 0's qkv, no delta)
SHAPES = [
    ("backbone qkv", 3072, 2048, False, True, False), ("backbone o", 2048, 2048, False, False, False),
    ("backbone gate_up", 8192, 2048, True, True, False), ("backbone down", 2048, 8192, False, False, False),
    ("codebook0 head", 2051, 2048, False, False, False), ("projection", 1024, 2048, False, False, False),
    ("projection gather", 1024, 2048, False, False, True),
    ("depth qkv", 1536, 1024, False, True, False), ("depth o", 1024, 1024, False, False, False),
    ("depth gate_up", 8192, 1024, True, True, False), ("depth down", 1024, 8192, False, False, False),
    ("depth head", 2112, 1024, False, True, False),  # head_t (2051 padded to 64), bf16 under --weights fp8 too
]
ROWS = (1, 2, 3, 16)  # M specialises as 1, other, and a multiple of 16; 3..15 share a variant


def _meta(*shape, dtype=None):
    import torch

    return torch.empty(*shape, dtype=dtype or torch.bfloat16, device="meta")


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kw)` appends (label[0], kernel, args, kw) to out."""

    def __init__(self, fn, out: list, label: list[str]) -> None:
        self.fn, self.out, self.label = fn, out, label

    def __getitem__(self, grid):
        return lambda *args, **kw: self.out.append((self.label[0], self.fn, args, kw))


def launches() -> list[tuple]:
    """[(label, kernel, args, kwargs)]: the tree's launches for SHAPES x ROWS x (bf16, e4m3) x PDL (on, off)."""
    import torch

    from csmserve.kernels import gemv, pdl

    out, label = [], [""]
    gemv._gemv_kernel, gemv._gemv_mma_kernel = (_Recorder(k, out, label)
                                                for k in (gemv._gemv_kernel, gemv._gemv_mma_kernel))
    for pdl_on in (True, False):
        pdl.enabled = lambda on=pdl_on: on  # on: as on sm_90
        for fp8 in (False, True):
            for name, n, k, glu, norm, gather in SHAPES:
                if fp8 and name == "depth head":
                    continue
                rows = n * (2 if glu else 1)
                w = _meta(rows, k, dtype=torch.float8_e4m3fn if fp8 else None)
                scale = _meta(1, rows, dtype=torch.float32) if fp8 else None
                for m in ROWS:
                    label[0] = f"{'e4m3' if fp8 else 'bf16'} {name} m={m}{'' if pdl_on else ' no-pdl'}"
                    if gather:
                        gemv.gather_gemv(_meta(m, dtype=torch.int64), _meta(2051, k), w, scale)
                    elif norm and m <= gemv.ELEMENTWISE_ROWS:
                        base = label[0]
                        for delta in ([None, _meta(m, k)] if name.endswith("qkv") else [_meta(m, k)]):
                            label[0] = f"{base} norm{' delta' if delta is not None else ''}"
                            gemv.norm_gemv(_meta(m, k), delta, _meta(k), 1e-5, w, glu, scale)
                    else:
                        gemv.gemv(_meta(m, k), w, glu, scale)
    return out


def lora_launches() -> list[tuple]:
    """The tree's LoRA launches (PDL on): every LoRA-able projection of CSM-1B, ranks 16 and 64, 1-512 rows."""
    import torch

    from csmserve.kernels import gemv, pdl
    from csmserve.kernels import lora as kl
    from csmserve.models.csm import CSMConfig, CSMModel
    from csmserve.models.lora import LoraPool

    out, label = [], [""]
    for mod, names in ((gemv, ("_gemv_lora_kernel", "_gemv_mma_lora_kernel")),
                       (kl, ("_lora_small_kernel", "_lora_kernel"))):
        for n in names:
            setattr(mod, n, _Recorder(getattr(mod, n), out, label))
    pdl.enabled = lambda: True
    with torch.device("meta"):
        model = CSMModel(CSMConfig()).to(torch.bfloat16)
    for rank in (16, 64):
        pool = LoraPool(model, 8, rank)
        for layer in pool.layers:
            w, k = model.get_submodule(layer.target.module).weight, layer.target.k
            glu = "gate_up" in layer.target.module
            for m in (1, 2, 3, 16, 32, 128, 512):  # fused GEMV; ticketed, row tiles with the shrink, shrink apart
                pool.rows = _meta(m, dtype=torch.int32)
                label[0] = f"rank {rank} {layer.target.module} m={m}"
                if m <= gemv.MAX_ROWS:
                    gemv.gemv(_meta(m, k), w, glu, lora=layer)
                    if m <= gemv.ELEMENTWISE_ROWS:
                        gemv.norm_gemv(_meta(m, k), _meta(m, k), _meta(k), 1e-5, w, glu, lora=layer)
                elif glu:
                    kl.lora_glu(_meta(m, w.shape[0]), _meta(m, k), layer)
                else:
                    kl.lora_add_(_meta(m, k), _meta(m, w.shape[0]), layer)
    return out


def compile_all(items: list[tuple], dump: str | None = None) -> int:
    """Each launch compiled for sm_90 (once per specialisation) -> {label: PTX} to dump; returns the failures."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    done, ptx, failed = {}, {}, 0
    for label, fn, args, kw in items:
        # as JITFunction.run: its extra options, its binder's specialisation, _pack_args
        kw = dict(kw, debug=False)
        for opt in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, opt):
                kw[opt] = getattr(knobs.compilation, opt)
        bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kw)
        options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
        key = repr((fn.__name__, signature, sorted(constexprs.items()), sorted(attrs.items()),
                    sorted(options.__dict__.items())))
        if key not in done:
            try:
                done[key] = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                           options=options.__dict__).asm["ptx"]
            except Exception as e:  # noqa: BLE001 - reported per variant
                done[key] = ""
                failed += 1
                print(f"FAILS {label} ({fn.__name__}): {str(e)[-600:]}")
        ptx[label] = done[key]
    print(f"{len(items)} launches, {len(done)} specialisations compiled for sm_90, {failed} failed", file=sys.stderr)
    if dump:
        with open(dump, "w") as f:
            json.dump(ptx, f)
    return failed


def normalise(ptx: str) -> list[str]:
    """The PTX's instructions and declarations: no comments, debug sections, .loc/.file lines or their labels."""
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    lines = []
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].rstrip()
        if line.strip() and not re.match(r"\s*(\.loc|\.file|\$L__tmp\d+:)", line):
            lines.append(line)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="main", help="the git ref to compare against (its csmserve/, by git archive)")
    ap.add_argument("--keep", help="a folder for each side's PTX files")
    ap.add_argument("--lora", action="store_true", help="compile this tree's LoRA launches, compare nothing")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # the child: compile this PYTHONPATH's csmserve
    a = ap.parse_args()
    if a.lora:
        sys.path.insert(0, ROOT)  # this tree's csmserve
        return 1 if compile_all(lora_launches()) else 0
    if a.dump:
        return 1 if compile_all(launches(), a.dump) else 0
    with tempfile.TemporaryDirectory() as tmp:
        ref = os.path.join(tmp, "ref")
        os.makedirs(ref)
        archive = subprocess.run(["git", "-C", ROOT, "archive", a.ref, "csmserve"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", ref], input=archive.stdout, check=True)
        sides = {a.ref: ref, "tree": ROOT}
        env = dict(os.environ, TRITON_DISABLE_LINE_INFO="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--dump", os.path.join(tmp, f"{i}.json")],
                                  env=dict(env, PYTHONPATH=d)) for i, d in enumerate(sides.values())]
        codes = [p.wait() for p in procs]  # both, whatever the first's
        if any(codes):
            return 2
        ptx = {}
        for i, s in enumerate(sides):
            with open(os.path.join(tmp, f"{i}.json")) as f:
                ptx[s] = json.load(f)
    old, new = ptx[a.ref], ptx["tree"]
    differ = [k for k in old if k in new and normalise(old[k]) != normalise(new[k])]
    one_side = sorted(set(old) ^ set(new))
    for k in differ:
        print(f"DIFFERS {k}: {len(normalise(old[k]))} -> {len(normalise(new[k]))} lines")
    for k in one_side:
        print(f"ONE SIDE {k}")
    if a.keep:
        for s, d in ((a.ref, old), ("tree", new)):
            os.makedirs(os.path.join(a.keep, s.replace("/", "_")), exist_ok=True)
            for k, v in d.items():
                with open(os.path.join(a.keep, s.replace("/", "_"), k.replace(" ", "_") + ".ptx"), "w") as f:
                    f.write("\n".join(normalise(v)) + "\n")
    same = len(set(old) & set(new)) - len(differ)
    kinds = len({"\n".join(normalise(v)) for v in new.values()})
    print(f"{same} of {len(set(old) | set(new))} launch variants ({kinds} distinct kernels) compile to the same PTX "
          f"for sm_90 as {a.ref}")
    return 1 if differ or one_side else 0


if __name__ == "__main__":
    sys.exit(main())
