"""Convert a Hugging Face LLaMA-family checkpoint folder into DIR/model.pth (eaglet's names, fused qkv),
or an EAGLE-1/2 or EAGLE-3 draft head folder into DIR/draft.pth; which one it is comes from its contents.

    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-chat-hf
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/yuhuili/EAGLE-llama2-chat-7B
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B

The folder keeps its config.json and tokenizer files; generate.py reads them from beside the .pth file.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from draft import head_args, head_kind
from model import EagletError, ModelArgs

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def load_hf_weights(checkpoint_dir: Path) -> dict:
    """All tensors of a checkpoint: single file or sharded, safetensors or .bin."""
    for name in WEIGHT_FILES:
        if (checkpoint_dir / name).is_file():
            break
    else:
        raise EagletError(f"no weights in {checkpoint_dir} (looked for {', '.join(WEIGHT_FILES)})")
    path = checkpoint_dir / name
    files = [path]
    if name.endswith(".index.json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        files = [checkpoint_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise EagletError(f"{checkpoint_dir}: shards listed in {name} are missing: {', '.join(missing)}")
    weights = {}
    for f in files:
        if f.suffix == ".safetensors":
            weights.update(load_file(str(f)))
        else:
            weights.update(torch.load(str(f), map_location="cpu", mmap=True, weights_only=True))
    return weights


def convert_layer(weights: dict, src: str, dst: str) -> dict:
    """One decoder layer from Hugging Face names (prefix src) to ours (prefix dst). Pops what it uses."""
    attn, mlp = f"{src}self_attn.", f"{src}mlp."
    out = {
        f"{dst}attention.wqkv.weight": torch.cat([weights.pop(f"{attn}{p}_proj.weight") for p in "qkv"]),
        f"{dst}attention.wo.weight": weights.pop(f"{attn}o_proj.weight"),
        f"{dst}feed_forward.w13.weight": torch.cat([weights.pop(f"{mlp}gate_proj.weight"),
                                                    weights.pop(f"{mlp}up_proj.weight")]),
        f"{dst}feed_forward.w2.weight": weights.pop(f"{mlp}down_proj.weight"),
        f"{dst}ffn_norm.weight": weights.pop(f"{src}post_attention_layernorm.weight"),
    }
    if f"{attn}q_proj.bias" in weights:
        out[f"{dst}attention.wqkv.bias"] = torch.cat([weights.pop(f"{attn}{p}_proj.bias") for p in "qkv"])
    if f"{attn}o_proj.bias" in weights:
        out[f"{dst}attention.wo.bias"] = weights.pop(f"{attn}o_proj.bias")
    for norm in ("q_norm", "k_norm"):  # Qwen3
        if f"{attn}{norm}.weight" in weights:
            out[f"{dst}attention.{norm}.weight"] = weights.pop(f"{attn}{norm}.weight")
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
    gate, up = state_dict[f"{src}feed_forward.w13.weight"].chunk(2)
    out.update({f"{dst}mlp.gate_proj.weight": gate, f"{dst}mlp.up_proj.weight": up,
                f"{dst}mlp.down_proj.weight": state_dict[f"{src}feed_forward.w2.weight"],
                f"{dst}post_attention_layernorm.weight": state_dict[f"{src}ffn_norm.weight"]})
    if f"{src}attention_norm.weight" in state_dict:
        out[f"{dst}input_layernorm.weight"] = state_dict[f"{src}attention_norm.weight"]
    return out


def convert_target(checkpoint_dir: Path, config: dict, weights: dict) -> dict:
    args = ModelArgs.from_hf_config(config)
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    try:
        out = {"tok_embeddings.weight": weights.pop("model.embed_tokens.weight"),
               "norm.weight": weights.pop("model.norm.weight")}
        for i in range(args.n_layer):
            out.update(convert_layer(weights, f"model.layers.{i}.", f"layers.{i}."))
    except KeyError as e:
        raise EagletError(f"{checkpoint_dir}: weight {e.args[0]} is missing")
    if "lm_head.weight" in weights:
        out["output.weight"] = weights.pop("lm_head.weight")
    elif not args.tie_word_embeddings:
        raise EagletError(f"{checkpoint_dir}: lm_head.weight is missing and tie_word_embeddings is false")
    if weights:
        raise EagletError(f"{checkpoint_dir}: unexpected weights {', '.join(sorted(weights)[:5])}")
    return out


def convert_head(checkpoint_dir: Path, config: dict, weights: dict) -> dict:
    """An EAGLE-1/2 head: fc plus one decoder layer. Its copy of the embedding (if any) is dropped:
    eaglet shares the target's."""
    args = head_args(config)
    embed = weights.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != (config.get("vocab_size"), args.dim):
        raise EagletError(f"{checkpoint_dir}: embed_tokens {tuple(embed.shape)} does not match config.json")
    out = {"fc.weight": weights.pop("fc.weight")}
    if "fc.bias" in weights:
        out["fc.bias"] = weights.pop("fc.bias")
    try:
        out.update(convert_layer(weights, "layers.0.", "layer."))
    except KeyError as e:
        raise EagletError(f"{checkpoint_dir}: weight {e.args[0]} is missing")
    if config.get("bias", True) != ("fc.bias" in out):
        raise EagletError(f"{checkpoint_dir}: config.json says bias={config.get('bias', True)} but fc.bias is "
                          f"{'present' if 'fc.bias' in out else 'missing'}")
    if weights:
        raise EagletError(f"{checkpoint_dir}: unexpected weights {', '.join(sorted(weights)[:5])}")
    return out


def convert_eagle3_head(checkpoint_dir: Path, config: dict, weights: dict) -> dict:
    """An EAGLE-3 head: fc, the midlayer, its norm, lm_head and d2t. Its embedding is kept only when the config
    sets target_hidden_size (a head narrower or wider than its target); t2d is checked against d2t, then dropped."""
    args = head_args(config)
    embed, t2d, d2t = weights.pop("embed_tokens.weight", None), weights.pop("t2d", None), weights.pop("d2t", None)
    try:
        out = {"fc.weight": weights.pop("fc.weight"), "norm.weight": weights.pop("norm.weight"),
               "lm_head.weight": weights.pop("lm_head.weight"),
               "layer.hidden_norm.weight": weights.pop("midlayer.hidden_norm.weight"),
               "layer.embed_norm.weight": weights.pop("midlayer.input_layernorm.weight")}
        out.update(convert_layer(weights, "midlayer.", "layer."))
    except KeyError as e:
        raise EagletError(f"{checkpoint_dir}: weight {e.args[0]} is missing")
    draft_vocab = out["lm_head.weight"].shape[0]
    if config.get("draft_vocab_size", draft_vocab) != draft_vocab:
        raise EagletError(f"{checkpoint_dir}: lm_head has {draft_vocab} rows but draft_vocab_size is "
                          f"{config['draft_vocab_size']}")
    if d2t is None and draft_vocab != args.vocab_size:
        raise EagletError(f"{checkpoint_dir}: no d2t to map its {draft_vocab} draft tokens to target tokens")
    out["d2t"] = torch.zeros(draft_vocab, dtype=torch.long) if d2t is None else d2t.long()
    if out["d2t"].shape != (draft_vocab,):
        raise EagletError(f"{checkpoint_dir}: d2t has {tuple(out['d2t'].shape)} entries but lm_head has "
                          f"{draft_vocab} rows")
    target_ids = torch.arange(draft_vocab) + out["d2t"]
    if t2d is not None and not (t2d.shape == (args.vocab_size,) and int(t2d.sum()) == draft_vocab
                                and 0 <= target_ids.min() and target_ids.max() < args.vocab_size
                                and t2d.bool()[target_ids].all()):
        raise EagletError(f"{checkpoint_dir}: t2d and d2t disagree about the draft vocabulary")
    if embed is not None and config.get("target_hidden_size"):
        if tuple(embed.shape) != (args.vocab_size, args.dim):
            raise EagletError(f"{checkpoint_dir}: embed_tokens {tuple(embed.shape)} does not match config.json")
        out["embed.weight"] = embed
    if weights:
        raise EagletError(f"{checkpoint_dir}: unexpected weights {', '.join(sorted(weights)[:5])}")
    return out


def convert(checkpoint_dir) -> Path:
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise EagletError(f"checkpoint folder not found: {checkpoint_dir}")
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise EagletError(f"no config.json in {checkpoint_dir}")
    config = json.loads(config_path.read_text())
    ModelArgs.from_hf_config({"model_type": "llama", **config})  # refuse what we cannot run before reading weights
    weights = load_hf_weights(checkpoint_dir)
    if any(k.startswith("model.") for k in weights):
        out_path, state_dict = checkpoint_dir / "model.pth", convert_target(checkpoint_dir, config, weights)
    else:  # a draft head: its keys have no "model." prefix
        eagle3 = head_kind(config, weights, str(checkpoint_dir)) == "eagle3"
        convert_fn = convert_eagle3_head if eagle3 else convert_head
        out_path, state_dict = checkpoint_dir / "draft.pth", convert_fn(checkpoint_dir, config, weights)
    torch.save(state_dict, out_path)
    return out_path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", required=True, help="Hugging Face checkpoint folder")
    args = parser.parse_args(argv)
    try:
        out_path = convert(args.checkpoint_dir)
    except EagletError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
