"""Tiny transformers CSM checkpoints written in the real layouts, for the loader and parity tests.

The HF model follows spec §4.4 (llama3 RoPE dicts set explicitly, a tiny Mimi codec); its tokenizer
is a byte-level BPE with the Llama-3 special token names, so bos/eos/<|AUDIO|>/<|audio_eos|> are
ids 256..259.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

K, V_AUDIO = 8, 64  # codebooks; audio vocab = tiny codec codebook size (a power of 2)
BOS, EOS, AUDIO, AUDIO_EOS = 256, 257, 258, 259
V_TEXT = 260
FRAME_SAMPLES = 64  # tiny codec: upsampling ratios 8*4, times 2


def write_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>"])
    tok.save(str(d / "tokenizer.json"))


def hf_config():
    from transformers import CsmConfig

    codec = dict(model_type="mimi", audio_channels=1, hidden_size=32, num_filters=8, num_residual_layers=1,
                 upsampling_ratios=[8, 4], codebook_size=V_AUDIO, vector_quantization_hidden_dimension=64,
                 codebook_dim=64, upsample_groups=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, sliding_window=4, num_quantizers=K, use_cache=False)
    dd = dict(num_codebooks=K, backbone_hidden_size=64, vocab_size=V_AUDIO, hidden_size=32, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=33,
              rms_norm_eps=1e-5, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                  "low_freq_factor": 0.001953125, "high_freq_factor": 0.0078125,
                                                  "original_max_position_embeddings": 16})
    return CsmConfig(num_codebooks=K, vocab_size=V_AUDIO, text_vocab_size=V_TEXT, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=2048, bos_token_id=BOS, pad_token_id=EOS, audio_token_id=AUDIO,
                     audio_eos_token_id=AUDIO_EOS, codebook_eos_token_id=0, codebook_pad_token_id=V_AUDIO - 1,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 0.125, "high_freq_factor": 0.5,
                                      "original_max_position_embeddings": 1024},
                     depth_decoder_config=dd, codec_config=codec)


def build_hf(d: Path, seed: int = 0):
    """A random tiny CsmForConditionalGeneration saved with save_pretrained (+ tokenizer.json) into d."""
    from transformers import CsmForConditionalGeneration

    torch.manual_seed(seed)
    model = CsmForConditionalGeneration(hf_config()).eval()
    with torch.no_grad():  # larger than the default 0.02 init so greedy codes vary from frame to frame
        for name, p in model.named_parameters():
            if not name.startswith("codec_model.") and not name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
        for name, b in model.codec_model.named_buffers():  # default codebooks are all zero: every code would be 0
            if name.endswith("codebook.embed_sum"):
                b.normal_(0.0, 1.0)
    model.config._attn_implementation = "eager"
    model.save_pretrained(d)
    write_tokenizer(d)
    return model


def write_original(hf_sd: dict[str, torch.Tensor], d: Path, fmt: str) -> None:
    """The HF weights in the original layout (inverse §2.3 mapping, q/k back to interleaved RoPE)."""
    from csmserve.models.loader import HF_AUDIO, HF_AUDIO_TIED, HF_IGNORED, hf_to_orig_name, rope_unpermute

    heads = {"backbone_model": {"q": 4, "k": 2}, "depth_decoder": {"q": 4, "k": 2}}
    out = {}
    for name, t in hf_sd.items():
        if any(p.search(name) for p in HF_IGNORED) or (name == HF_AUDIO_TIED and HF_AUDIO in hf_sd):
            continue
        name = HF_AUDIO if name == HF_AUDIO_TIED else name  # the tied audio table under its backbone name
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t = rope_unpermute(t, heads[name.split(".")[0]][name.split(".")[-2][0]])
        out[hf_to_orig_name(name)] = t.contiguous()
    d.mkdir(parents=True, exist_ok=True)
    if fmt == "pt":
        torch.save(out, d / "ckpt.pt")
    else:
        save_file(out, str(d / "model.safetensors"))
