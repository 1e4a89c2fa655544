"""Convert a Hugging Face LLaMA-family checkpoint folder into DIR/model.pth (eaglet's names, fused qkv),
or an EAGLE-1/2 or EAGLE-3 draft head folder into DIR/draft.pth; which one it is comes from its contents.

    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-chat-hf
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/yuhuili/EAGLE-llama2-chat-7B
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B

The folder keeps its config.json and tokenizer files; generate.py reads them from beside the .pth file.
"""
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

from cli import Progress, cli_parser


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_dir", required=True, type=Path,
                   help="Hugging Face checkpoint folder (config.json and the weights)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

import torch  # noqa: E402
from safetensors import SafetensorError, safe_open  # noqa: E402

from draft import eagle3_flags, feature_layer_ids, head_args, head_config, head_kind, is_eagle3_config  # noqa: E402
from model import EagletError, ModelArgs, load_state_dict, read_config  # noqa: E402
from quantize import spill  # noqa: E402

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class LazyWeights(dict):
    """name -> a function that reads that tensor from its shard; pop() reads it. The conversion holds the
    tensors of one layer at a time, not the whole checkpoint (legacy-format .bin shards are read whole)."""

    def pop(self, name, *default):
        if default and name not in self:
            return default[0]
        return super().pop(name)()


def weight_files(checkpoint_dir: Path) -> list:
    """The checkpoint's weight files: one file, or the shards its index lists."""
    for name in WEIGHT_FILES:
        if (checkpoint_dir / name).is_file():
            break
    else:
        raise EagletError(f"no weights in {checkpoint_dir} (looked for {', '.join(WEIGHT_FILES)})")
    path = checkpoint_dir / name
    if not name.endswith(".index.json"):
        return [path]
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        files = [checkpoint_dir / f for f in sorted(set(weight_map.values()))]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise EagletError(f"{path} is not a valid index (a JSON object with a weight_map of file names): {e!r}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise EagletError(f"{checkpoint_dir}: shards listed in {name} are missing: {', '.join(missing)}")
    return files


def load_hf_weights(checkpoint_dir: Path, log=print) -> LazyWeights:
    """All tensors of a checkpoint, single file or sharded, safetensors or .bin, read when taken."""
    weights, files = LazyWeights(), weight_files(checkpoint_dir)
    for i, f in enumerate(files):
        if len(files) > 1:
            log(f"reading shard {i + 1}/{len(files)}: {f.name}")
        if f.suffix == ".safetensors":
            try:
                shard = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError) as e:
                raise EagletError(f"cannot read {f}: {e}")
            weights.update({k: partial(shard.get_tensor, k) for k in shard.keys()})
        else:
            shard = load_state_dict(f)  # memory-mapped
            weights.update({k: partial(shard.__getitem__, k) for k in shard})
    return weights


# Our Linears and the Hugging Face projections fused into each, in order (q, k, v; gate, up).
LAYER_LINEARS = {"attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "attention.wo": ("self_attn.o_proj",),
                 "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
                 "feed_forward.w2": ("mlp.down_proj",)}


def convert_layer(weights: dict, src: str, dst: str) -> dict:
    """One decoder layer from Hugging Face names (prefix src) to ours (prefix dst). Pops what it uses. Each
    Linear's parts are fused alike: weight, bias, and the scales and zeros of a Hub 4-bit checkpoint's."""
    out = {}
    for ours, theirs in LAYER_LINEARS.items():
        for part in ("weight", "bias", "scales", "zeros"):
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


def convert_target(checkpoint_dir: Path, config: dict, weights: dict, tmp_dir: Path, log=print) -> dict:
    args = ModelArgs.from_hf_config(config)
    for k in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        del weights[k]
    try:
        out = spill({"tok_embeddings.weight": weights.pop("model.embed_tokens.weight"),
                     "norm.weight": weights.pop("model.norm.weight")}, tmp_dir, "embeddings")
        with Progress("converting", args.n_layer, "layers", log=log) as progress:
            for i in range(args.n_layer):
                out.update(spill(convert_layer(weights, f"model.layers.{i}.", f"layers.{i}."), tmp_dir, f"layer{i}"))
                progress.update(i + 1)
    except KeyError as e:
        raise EagletError(f"{checkpoint_dir}: weight {e.args[0]} is missing")
    if "lm_head.weight" in weights:
        out.update(spill({"output.weight": weights.pop("lm_head.weight")}, tmp_dir, "lm_head"))
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
    try:
        out = {"fc.weight": weights.pop("fc.weight")}
    except KeyError:
        raise EagletError(f"{checkpoint_dir}: weight fc.weight is missing")
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
    """An EAGLE-3 head: fc, its layer (midlayer.* in EAGLE's and SpecForge's layout, layers.0.* in speculators'),
    its norm, lm_head, d2t, and the norms its flags add (fc_norm.i, input_norm). config: flat (head_config).
    Its embedding is kept only when the config sets target_hidden_size (a head narrower or wider than its
    target) or embed_requires_grad (a trained one); t2d is checked against d2t, then dropped."""
    args, flags = head_args(config), eagle3_flags(config, str(checkpoint_dir))
    feature_layer_ids(config, str(checkpoint_dir))  # checked here too: the target is not known yet
    if not any(k.startswith("midlayer.") for k in weights):  # speculators' name for the one layer
        for k in [k for k in weights if k.startswith("layers.0.")]:
            weights["midlayer." + k[len("layers.0."):]] = dict.pop(weights, k)  # moved, not read
    embed, t2d, d2t = weights.pop("embed_tokens.weight", None), weights.pop("t2d", None), weights.pop("d2t", None)
    norms = [f"fc_norm.{i}.weight" for i in range(3)] if flags.fc_norm else []
    norms += ["input_norm.weight"] if flags.norm_before_fc else []
    try:
        out = {"fc.weight": weights.pop("fc.weight"), "norm.weight": weights.pop("norm.weight"),
               "lm_head.weight": weights.pop("lm_head.weight"),
               "layer.hidden_norm.weight": weights.pop("midlayer.hidden_norm.weight"),
               "layer.embed_norm.weight": weights.pop("midlayer.input_layernorm.weight")}
        out.update(convert_layer(weights, "midlayer.", "layer."))
        out.update({k: weights.pop(k) for k in norms})
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
    if target_ids.unique().numel() != draft_vocab:
        raise EagletError(f"{checkpoint_dir}: d2t maps two draft tokens to one target token")
    if t2d is not None and not (t2d.shape == (args.vocab_size,) and int(t2d.sum()) == draft_vocab
                                and 0 <= target_ids.min() and target_ids.max() < args.vocab_size
                                and t2d.bool()[target_ids].all()):
        raise EagletError(f"{checkpoint_dir}: t2d and d2t disagree about the draft vocabulary")
    if embed is not None and (config.get("target_hidden_size") or config.get("embed_requires_grad") is True):
        if tuple(embed.shape) != (args.vocab_size, args.dim):
            raise EagletError(f"{checkpoint_dir}: embed_tokens {tuple(embed.shape)} does not match config.json")
        out["embed.weight"] = embed
    if weights:
        raise EagletError(f"{checkpoint_dir}: unexpected weights {', '.join(sorted(weights)[:5])}")
    return out


def convert(checkpoint_dir, log=print) -> Path:
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise EagletError(f"checkpoint folder not found: {checkpoint_dir}")
    config = head_config(read_config(checkpoint_dir), str(checkpoint_dir / "config.json"))  # a head's, flat
    try:  # refuse what we cannot run before reading weights
        ModelArgs.from_hf_config({"model_type": "llama", **config})
    except EagletError as e:
        raise EagletError(f"{checkpoint_dir / 'config.json'}: {e}")
    weights = load_hf_weights(checkpoint_dir, log)
    try:
        with tempfile.TemporaryDirectory(dir=checkpoint_dir, prefix=".eaglet-convert-") as tmp_dir:
            if any(k.startswith("model.") for k in weights) and not is_eagle3_config(config):
                out_path = checkpoint_dir / "model.pth"
                state_dict = convert_target(checkpoint_dir, config, weights, Path(tmp_dir), log)
            else:  # a draft head: its keys have no "model." prefix
                eagle3 = head_kind(config, weights, str(checkpoint_dir)) == "eagle3"
                convert_fn = convert_eagle3_head if eagle3 else convert_head
                out_path, state_dict = checkpoint_dir / "draft.pth", convert_fn(checkpoint_dir, config, weights)
            log(f"writing {out_path}")
            torch.save(state_dict, Path(tmp_dir) / out_path.name)
            os.replace(Path(tmp_dir) / out_path.name, out_path)  # an interrupted write leaves the old file whole
    except SafetensorError as e:  # a shard that is truncated or corrupt shows when its tensors are read
        raise EagletError(f"cannot read the weights in {checkpoint_dir}: {e}")
    except OSError as e:
        raise EagletError(f"cannot write in {checkpoint_dir}: {e.strerror or e}")
    return out_path


def main(argv=None):
    args = parse_args(argv)
    try:
        out_path = convert(args.checkpoint_dir)
    except EagletError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
