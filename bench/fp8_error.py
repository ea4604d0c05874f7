"""FP8 weights (EngineConfig.weights = fp8 / fp8-all) against bf16 on the real shape: the logits' error
under teacher forcing (the frame step's speed per weights: bench/frame_step.py --weights).

Error: the bf16 model samples a few utterances (its own codes, so the inputs are on its distribution);
both models then read exactly those frames (teacher forcing: the backbone over the whole sequence,
the depth decoder over [h, c_0 .. c_30] of every frame in one pass) and their logits are compared per
codebook: top-1 agreement (over the 2048 real codes) and KL(p_bf16 || p_fp8) of the softmax at
temperature 1. With `fp8` the backbone is bf16 in both, so codebook 0 agrees exactly. Random weights
give flat distributions, where a small error flips the argmax more easily than in trained, peaked
ones; KL is the more telling number. Each FP8 setting is measured twice: with the activations quantized per
row (FP8Linear's w8a8 GEMM: what the frame step runs past CSMSERVE_FP8_DENSE_ROWS, 512) and weight-only
(FP8Linear.weight_only: the numbers of kernels/gemv.py's FP8 GEMV and of the bf16 copy of the dequantized weights,
what the frame step runs up to 512 rows).

    python bench/fp8_error.py                      # dummy weights (N(0, 1/fan_in))
    python bench/fp8_error.py --hf-init            # transformers' random init (N(0, 0.02)), if installed
"""
from __future__ import annotations

import argparse
import copy

import numpy as np
import torch

from csmserve.models import reference
from csmserve.sampling import SamplingParams
from csmserve.models.fp8 import FP8Linear, quantize_weights


def build(args) -> torch.nn.Module:
    if args.hf_init:
        from csmserve.apps.bench.engine import hf_checkpoint

        hf, ckpt = hf_checkpoint(torch.bfloat16)
        del hf
    from csmserve.models.loader import load_csm

    return load_csm(ckpt if args.hf_init else args.model, "cuda", torch.bfloat16)[0]


def own_codes(model, utterances: int, frames: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, mask) [T, 33] sequences: a text prompt and the frames the model sampled after it."""
    out = []
    rng = np.random.default_rng(0)
    K, W = model.cfg.num_codebooks, model.cfg.frame_width
    for u in range(utterances):
        n = 12
        tok, mask = np.zeros((n, W), np.int64), np.zeros((n, W), bool)
        tok[:, K], mask[:, K] = rng.integers(1000, 100_000, n), True
        gen = reference.generate(model, tok, mask, SamplingParams(temperature=0.9, top_k=50, seed=u,
                                                                  max_audio_length_ms=frames * 80)).codes
        ftok = np.zeros((len(gen), W), np.int64)
        ftok[:, :K] = gen
        fmask = np.zeros((len(gen), W), bool)
        fmask[:, :K] = True
        out.append((np.concatenate([tok, ftok]), np.concatenate([mask, fmask]), n))
    return out


@torch.inference_mode()
def teacher_forced_logits(model, tokens: np.ndarray, mask: np.ndarray, start: int) -> torch.Tensor:
    """Logits [F, K, 2048] float32 of every codebook of the frames after the prompt, given the true codes."""
    K, n = model.cfg.num_codebooks, model.cfg.sampleable_codes
    t = torch.as_tensor(tokens, device="cuda")[None]
    m = torch.as_tensor(mask, device="cuda")[None]
    T = t.shape[1]
    kv = model.backbone.new_kv(1, T, torch.bfloat16, "cuda")
    h = model.forward_backbone(t, m, torch.arange(T, device="cuda")[None], kv)[0]  # [T, Db]
    h = h[start - 1: T - 1]  # the state that predicts frame f is the one before it: [F, Db]
    codes = t[0, start:, :K]  # [F, K]
    F = codes.shape[0]
    l0 = model.codebook0_head(h)[:, :n].float()  # [F, n]
    x = torch.cat([h[:, None], model.audio_embeddings(codes[:, : K - 1] + model.codebook_offsets[: K - 1])], 1)
    dkv = model.decoder.new_kv(F, K, torch.bfloat16, "cuda")
    out = model.decoder(model.projection(x), torch.arange(K, device="cuda").expand(F, K), dkv)  # [F, K, Dd]
    rest = [model.codebook_logits(i, out[:, i])[:, :n].float() for i in range(1, K)]
    return torch.stack([l0] + rest, 1)


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """-> top-1 agreement [K], mean KL(ref || got) [K] (nats)."""
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean(0)
    lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean(0)
    return agree.cpu().numpy(), kl.cpu().numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy")
    ap.add_argument("--hf-init", action="store_true", help="transformers' random init instead of --model")
    ap.add_argument("--utterances", type=int, default=4)
    ap.add_argument("--frames", type=int, default=64, help="frames sampled per utterance")
    args = ap.parse_args()
    base = build(args)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"weights {'transformers random init' if args.hf_init else args.model}", flush=True)
    seqs = own_codes(base, args.utterances, args.frames)
    ref = torch.cat([teacher_forced_logits(base, *s) for s in seqs])  # [F, K, n]
    K = ref.shape[1]
    results = {}
    variants = [(w, wo) for w in ("fp8", "fp8-all") for wo in (False, True)]
    for weights, weight_only in variants:
        q = copy.deepcopy(base)
        quantize_weights(q, weights)
        for m in q.modules():
            if isinstance(m, FP8Linear):
                m.weight_only = weight_only
                m.dense = None  # w8a8 at every row count past 16 (the bf16 copy's numbers are weight-only ones)
        got = torch.cat([teacher_forced_logits(q, *s) for s in seqs])
        results[(weights, weight_only)] = compare(ref, got)
        del q, got
        torch.cuda.empty_cache()
    names = [f"{w} {'weight-only' if wo else 'w8a8'}" for w, wo in variants]
    print(f"\nteacher forcing on {ref.shape[0]} frames ({args.utterances} utterances sampled by the bf16 model); "
          "w8a8: activations quantized per row (the frame step past CSMSERVE_FP8_DENSE_ROWS), weight-only: the "
          "frame step's numbers up to there (the GEMV, weight_only_mm, the bf16 copy of the dequantized weights)")
    print("\n| codebook | " + " | ".join(f"{n}: top-1 | {n}: KL (nats)" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for c in range(K):
        print(f"| {c} | " + " | ".join(f"{results[v][0][c]:.2%} | {results[v][1][c]:.2e}" for v in variants) + " |")
    print(f"| mean, codebooks 1-{K - 1} | " + " | ".join(
        f"{results[v][0][1:].mean():.2%} | {results[v][1][1:].mean():.2e}" for v in variants) + " |")
    print("| mean, all codebooks | " + " | ".join(
        f"{results[v][0].mean():.2%} | {results[v][1].mean():.2e}" for v in variants) + " |")


if __name__ == "__main__":
    main()
