"""What the converters share: one decoder layer between Hugging Face's names and ours (convert_layer, and its
inverse export_layer, which train_heads.py saves heads with), and the converted file's place (an existing file
refused, the folder made).

Imports checkpoint.py and model.py; convert_hf_checkpoint.py, convert_hub_int4.py, convert_gguf.py and
train_heads.py import it.
"""
from pathlib import Path

import torch

from checkpoint import EagletError
from model import ModelArgs


# Our Linears and the Hugging Face projections fused into each, in order (q, k, v; gate, up).
LAYER_LINEARS = {"attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "attention.wo": ("self_attn.o_proj",),
                 "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
                 "feed_forward.w2": ("mlp.down_proj",)}


def convert_layer(weights: dict, src: str, dst: str) -> dict:
    """One decoder layer from Hugging Face names (prefix src) to ours (prefix dst). Pops what it uses. Each
    Linear's parts are fused alike: weight, bias, and the scales and zeros (a GGUF file's minimums) of a 4-bit
    checkpoint's."""
    out = {}
    for ours, theirs in LAYER_LINEARS.items():
        for part in ("weight", "bias", "scales", "zeros", "minimums"):
            if part == "weight" or f"{src}{theirs[0]}.{part}" in weights:
                out[f"{dst}{ours}.{part}"] = torch.cat([weights.pop(f"{src}{t}.{part}") for t in theirs])
    out[f"{dst}ffn_norm.weight"] = weights.pop(f"{src}post_attention_layernorm.weight")
    for norm in ("q_norm", "k_norm"):  # Qwen3
        if f"{src}self_attn.{norm}.weight" in weights:
            out[f"{dst}attention.{norm}.weight"] = weights.pop(f"{src}self_attn.{norm}.weight")
    if f"{src}input_layernorm.weight" in weights:
        out[f"{dst}attention_norm.weight"] = weights.pop(f"{src}input_layernorm.weight")
    return out


def export_layer(state_dict: dict, src: str, dst: str, args: ModelArgs) -> dict:
    """The inverse of convert_layer: one of our layers (prefix src) under Hugging Face names (prefix dst)."""
    q_dim, kv_dim = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    out = {}
    for part in ("weight", "bias"):
        if f"{src}attention.wqkv.{part}" in state_dict:
            for name, t in zip("qkv", state_dict[f"{src}attention.wqkv.{part}"].split([q_dim, kv_dim, kv_dim])):
                out[f"{dst}self_attn.{name}_proj.{part}"] = t
        if f"{src}attention.wo.{part}" in state_dict:
            out[f"{dst}self_attn.o_proj.{part}"] = state_dict[f"{src}attention.wo.{part}"]
        if f"{src}feed_forward.w13.{part}" in state_dict:
            gate, up = state_dict[f"{src}feed_forward.w13.{part}"].chunk(2)
            out.update({f"{dst}mlp.gate_proj.{part}": gate, f"{dst}mlp.up_proj.{part}": up,
                        f"{dst}mlp.down_proj.{part}": state_dict[f"{src}feed_forward.w2.{part}"]})
    for norm in ("q_norm", "k_norm"):  # Qwen3
        if f"{src}attention.{norm}.weight" in state_dict:
            out[f"{dst}self_attn.{norm}.weight"] = state_dict[f"{src}attention.{norm}.weight"]
    out[f"{dst}post_attention_layernorm.weight"] = state_dict[f"{src}ffn_norm.weight"]
    if f"{src}attention_norm.weight" in state_dict:
        out[f"{dst}input_layernorm.weight"] = state_dict[f"{src}attention_norm.weight"]
    return out


def refuse_existing(path: Path, overwrite: bool, detail: str = ""):
    if path.is_dir() or (path.exists() and not overwrite):
        raise EagletError(f"{path} exists{detail}{'' if path.is_dir() else '; give --overwrite to replace it'}")


def make_folder(out_dir: Path):
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EagletError(f"--out_dir {out_dir} cannot be made: {e.strerror or e}")
