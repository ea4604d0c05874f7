"""PEFT adapters for the tiny transformers CSM of tiny_csm.py, as PEFT / unsloth save them: get_peft_model on a copy
of the model, RANDOM non-zero LoRA A and B (training leaves Mimi's transformer, which plain target names also wrap,
at B = 0: so are those here), save_pretrained."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

# unsloth's CSM recipe: every projection of the backbone and the depth decoder (plain names: Mimi's q/k/v/o too)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(hf, d: Path, r: int = 4, alpha: float = 8.0, targets=ALL, seed: int = 1, std: float = 0.2,
                 codec_std: float = 0.0, **config):
    """A PeftModel over a copy of `hf` with random LoRA weights, saved into d (adapter_config.json +
    adapter_model.safetensors). codec_std > 0: Mimi's LoRA weights random too (a non-zero codec delta)."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(hf), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, bias="none",
                                                      **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                s = codec_std if "codec_model." in name else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
    pm.eval()
    pm.save_pretrained(str(d))
    return pm


def merged_checkpoint(pm, d: Path) -> Path:
    """unsloth's merged save: merge_and_unload() then save_pretrained (+ the tokenizer) into d."""
    from tiny_csm import write_tokenizer

    merged = copy.deepcopy(pm).merge_and_unload()
    merged.save_pretrained(d)
    write_tokenizer(d)
    return d
