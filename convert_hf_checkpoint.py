"""Convert a Hugging Face LLaMA-family checkpoint folder into DIR/model.pth (eaglet's names, fused qkv),
or an EAGLE-1/2, EAGLE-3, DFlash or DSpark draft head folder into DIR/draft.pth; which one it is comes from its
contents.

    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-chat-hf
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/yuhuili/EAGLE-llama2-chat-7B
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/deepseek-ai/dspark_qwen3_8b_block7
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4

The folder keeps its config.json and tokenizer files; generate.py reads them from beside the .pth file.

A 4-bit checkpoint from the Hub (its config.json has a quantization_config: AWQ's GEMM layout, GPTQ, or
compressed-tensors' pack-quantized, with groups of 32, 64, 128 or 256 input channels) becomes
DIR/model_int4.g<N>.pth, the file quantize.py --mode int4 --groupsize N writes: the 4-bit integers carry over
exactly, the scales and zeros round to bf16 (the largest change it makes is printed), the lm_head goes to int8
as quantize.py has it, and layers the checkpoint left unquantized stay as they are. Act-order checkpoints
whose groups are not contiguous, other bit widths, per-channel scales and other formats are refused by name.
An existing model_int4.g<N>.pth is replaced only with --overwrite.

For a folder that is read-only or shared (a hub cache), --out_dir OUT writes the converted file into OUT
instead, with copies of the files the tools read beside it (config.json, generation_config.json, tokenizer.json,
tokenizer.model, tokenizer_config.json, chat_template.jinja, chat_template.json, draft_vocab.json: those the
folder has), and writes nothing in --checkpoint_dir; generate.py then needs only OUT:

    python convert_hf_checkpoint.py --checkpoint_dir /shared/hub/Llama-2-7b-chat-hf --out_dir checkpoints/llama2
    python generate.py --checkpoint_path checkpoints/llama2/model.pth --prompt "Hello"

In OUT an existing converted file, or a copy that differs from the folder's, is replaced only with --overwrite
(an identical copy is kept as it is).

A GGUF file (llama.cpp, ollama, LM Studio; --checkpoint_dir names the .gguf file, or a folder holding one and no
config.json) becomes model_int4.g32.pth where its Linears are Q4_0, Q4_1 or Q4_K (their 4-bit integers, fp16
scales and minimums kept), else a model.pth (--dequantize: in any case) of the file's values (dequantized in
fp32, or fp16 where that holds them exactly), with config.json, tokenizer.json, tokenizer_config.json (the
chat template) and generation_config.json written beside it from its metadata:

    python convert_hf_checkpoint.py --checkpoint_dir SmolLM2-135M-Instruct.Q4_1.gguf --out_dir checkpoints/smollm2
    python generate.py --checkpoint_path checkpoints/smollm2/model_int4.g32.pth --chat --precision bf16 \
        --prompt "What is the capital of France?"
"""
import filecmp
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from cli import Progress, cli_parser


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_dir", required=True, type=Path,
                   help="Hugging Face checkpoint folder (config.json and the weights), or a .gguf file")
    p.add_argument("--out_dir", type=Path, default=None,
                   help="write the converted file here (made if missing) with copies of the config and tokenizer "
                        "files the tools read beside it, leaving --checkpoint_dir untouched (default: "
                        "--checkpoint_dir itself)")
    p.add_argument("--dequantize", action="store_true",
                   help="a .gguf file: write model.pth, every weight dequantized (fp32, or fp16 where that holds "
                        "it exactly), even where its Linears are 4-bit (by default they stay 4-bit, in "
                        "model_int4.g32.pth)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing converted file in --out_dir and the copies there that differ; a Hub "
                        "4-bit target: its model_int4.g<N>.pth wherever it goes (in --checkpoint_dir, model.pth and "
                        "draft.pth are replaced without it)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

import torch  # noqa: E402
from torch import Tensor  # noqa: E402
from safetensors import SafetensorError, safe_open  # noqa: E402

from head_formats import (eagle3_flags, feature_layer_ids, head_args, head_config, head_kind,  # noqa: E402
                          is_dflash_config, is_eagle3_config, probe)
from checkpoint import QUANT_KEY, EagletError, load_state_dict, read_config  # noqa: E402
from model import ModelArgs  # noqa: E402
from quantize import GROUPSIZES, output_path, pack_int4, quantization_record, quantize_group, spill  # noqa: E402
from convert_gguf import (INT4_TYPES, check_tensor_names, dequantize, find_gguf, gguf_config, gguf_layer,  # noqa: E402
                          gguf_tokenizer, linear_types, read_gguf)

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
    ids = feature_layer_ids(config, str(checkpoint_dir))  # checked here too: the target is not known yet
    if not any(k.startswith("midlayer.") for k in weights):  # speculators' name for the one layer
        for k in [k for k in weights if k.startswith("layers.0.")]:
            weights["midlayer." + k[len("layers.0."):]] = dict.pop(weights, k)  # moved, not read
    embed, t2d, d2t = weights.pop("embed_tokens.weight", None), weights.pop("t2d", None), weights.pop("d2t", None)
    norms = [f"fc_norm.{i}.weight" for i in range(len(ids or (0, 0, 0)))] if flags.fc_norm else []
    norms += ["input_norm.weight"] if flags.norm_before_fc else []
    try:
        out = {"fc.weight": weights.pop("fc.weight"), "norm.weight": weights.pop("norm.weight"),
               "lm_head.weight": weights.pop("lm_head.weight"),
               "layer.hidden_norm.weight": weights.pop("midlayer.hidden_norm.weight"),
               "layer.embed_norm.weight": weights.pop("midlayer.input_layernorm.weight")}
        out.update(convert_layer(weights, "midlayer.", "layer."))
        for i in range(1, args.n_layer):  # speculators' later layers: plain decoder layers
            out.update(convert_layer(weights, f"layers.{i}.", f"decoder_layers.{i - 1}."))
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
    if config.get("speculators_model_type") == "peagle":  # what its mask positions read in place of features
        width = out["fc.weight"].shape[1]
        mask_hidden = weights.pop("mask_hidden", None)
        if mask_hidden is None or mask_hidden.numel() != width:
            raise EagletError(f"{checkpoint_dir}: a P-EAGLE head needs mask_hidden, {width} values (fc's input)")
        out["mask_hidden"] = mask_hidden.reshape(1, 1, width)
    if embed is not None and (config.get("target_hidden_size") or config.get("embed_requires_grad") is True):
        if tuple(embed.shape) != (args.vocab_size, args.dim):
            raise EagletError(f"{checkpoint_dir}: embed_tokens {tuple(embed.shape)} does not match config.json")
        out["embed.weight"] = embed
    if weights:
        raise EagletError(f"{checkpoint_dir}: unexpected weights {', '.join(sorted(weights)[:5])}")
    return out


def convert_dflash_head(checkpoint_dir: Path, config: dict, weights: dict) -> dict:
    """A DFlash, DSpark, DFlash2 or XPress head: fc, hidden_norm, norm and its Qwen3 layers (keys with or without a
    leading "model."), a DSpark head's Markov and confidence heads, DFlash2's convolutions and candidate selector,
    XPress's refiner, and a speculators head's own lm_head and d2t over a smaller draft
    vocabulary. Copies of the target's embedding and lm_head (DeepSpec's files carry both) are not kept: each
    becomes a probe (head_formats.probe) that loading checks against the target's own."""
    for k in [k for k in weights if k.startswith("model.")]:
        weights[k[len("model."):]] = dict.pop(weights, k)  # moved, not read
    args = head_args(config)
    try:
        out = {name: weights.pop(name) for name in ("fc.weight", "hidden_norm.weight", "norm.weight")}
        for i in range(args.n_layer):
            out.update(convert_layer(weights, f"layers.{i}.", f"layers.{i}."))
    except KeyError as e:
        raise EagletError(f"{checkpoint_dir}: weight {e.args[0]} is missing")
    extras = ("markov_head.", "confidence_head.", "candidate_selector.", "refiner_head.")  # DSpark, DFlash2, XPress
    convs = tuple(f"layers.{i}.{conv}_conv." for i in range(args.n_layer) for conv in ("attention", "mlp"))  # DFlash2's
    out.update({k: weights.pop(k) for k in [k for k in weights if k.startswith(extras + convs)]})
    if config.get("draft_vocab_size", args.vocab_size) < args.vocab_size:  # speculators' own draft vocabulary
        missing = [k for k in ("lm_head.weight", "d2t") if k not in weights]
        if missing:
            raise EagletError(f"{checkpoint_dir}: a draft vocabulary of {config['draft_vocab_size']} tokens and no "
                              f"{missing[0]}")
        out.update({k: weights.pop(k) for k in ("lm_head.weight", "d2t")})
        t2d = weights.pop("t2d", None)
        if t2d is not None and (t2d.shape != (args.vocab_size,) or not bool(t2d.bool()[
                torch.arange(len(out["d2t"])) + out["d2t"].long()].all()) or int(t2d.bool().sum()) != len(out["d2t"])):
            raise EagletError(f"{checkpoint_dir}: t2d and d2t disagree about the draft vocabulary")
    for name, key in (("embed", "embed_tokens.weight"), ("lm_head", "lm_head.weight")):
        if key in weights:
            copy = weights.pop(key)
            if tuple(copy.shape) != (args.vocab_size, args.dim):
                raise EagletError(f"{checkpoint_dir}: {key} {tuple(copy.shape)} does not match config.json")
            out[f"target_check.{name}"] = probe(copy)
    weights.pop("t2d", None), weights.pop("d2t", None)  # a full draft vocabulary's maps: the identity
    if weights:
        raise EagletError(f"{checkpoint_dir}: unexpected weights {', '.join(sorted(weights)[:5])} (config.json "
                          f"says num_hidden_layers {args.n_layer})")
    return out


# Hub 4-bit checkpoints. AWQ (GEMM), GPTQ and compressed-tensors (pack-quantized) each store integers q and z
# and a scale s per group of input channels, w = (q - z) * s. Int4Linear holds w = (q - 8) * scale + zero, so
# q and the groups carry over exactly and scale = s, zero = (8 - z) * s, rounded to bf16.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's int32 holds column 8k + AWQ_ORDER[j] in its 4-bit slot j
INT32, FLOATS = (torch.int32,), (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class HubInt4:
    """What a config.json's quantization_config says its 4-bit Linears hold."""
    method: str  # awq, gptq or compressed-tensors
    groupsize: int
    source: str  # the format, as the int4 file's record names it
    zero_offset: int = 0  # GPTQ's first checkpoint format stores z - 1
    symmetric: bool = False  # compressed-tensors: z = 8, no zero points stored


def int4_groupsize(bits, groupsize, where: str) -> int:
    if bits != 4 or type(bits) is not int:
        kind = f"{bits}-bit weights" if type(bits) is int else f"bits {bits!r}"
        raise EagletError(f"{where}: {kind}; eaglet's int4 kernels take 4-bit weights (for 8-bit, convert the "
                          "unquantized model and run quantize.py --mode int8)")
    if groupsize not in GROUPSIZES or type(groupsize) is not int:
        kind = "per-channel scales (group_size -1)" if groupsize == -1 else f"group_size {groupsize!r}"
        raise EagletError(f"{where}: {kind}; eaglet's int4 kernels take groups of 32, 64, 128 or 256 inputs")
    return groupsize


def awq_scheme(qc: dict) -> HubInt4:
    version, backend = str(qc.get("version", "gemm")).lower(), str(qc.get("backend", "autoawq")).lower()
    if version != "gemm" or backend != "autoawq":
        raise EagletError(f"awq version {version!r} (backend {backend!r}): eaglet reads AutoAWQ's GEMM layout "
                          "(version gemm), not the layouts of other AWQ kernels")
    if qc.get("zero_point", True) is not True:
        raise EagletError("awq without zero points (zero_point false): eaglet reads AWQ's GEMM layout with them")
    groupsize = int4_groupsize(qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size")), "awq")
    return HubInt4("awq", groupsize, "awq gemm")


def gptq_scheme(qc: dict) -> HubInt4:
    fmt = "marlin" if qc.get("is_marlin_format") else str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise EagletError(f"gptq checkpoint_format {fmt!r}: eaglet reads the gptq and gptq_v2 layouts only")
    if qc.get("dynamic"):
        raise EagletError("gptq with per-module overrides (dynamic): eaglet takes one bit width and group size")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise EagletError(f"gptq pack_dtype {qc['pack_dtype']!r}: eaglet reads values packed in int32 words")
    groupsize = int4_groupsize(qc.get("bits"), qc.get("group_size"), "gptq")
    return HubInt4("gptq", groupsize, fmt, zero_offset=1 if fmt == "gptq" else 0)


def compressed_tensors_scheme(qc: dict) -> HubInt4:
    fmt, sparsity = qc.get("format"), qc.get("sparsity_config") or {}
    if fmt != "pack-quantized":
        raise EagletError(f"compressed-tensors format {fmt!r}: eaglet reads pack-quantized (4-bit integers)")
    for key, what in (("kv_cache_scheme", "a quantized KV cache"), ("transform_config", "rotated weights")):
        if qc.get(key):
            raise EagletError(f"compressed-tensors {key}: {what}, which eaglet does not run")
    if not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense":
        raise EagletError(f"compressed-tensors sparsity_config {sparsity!r}: eaglet runs dense weights"[:300])
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise EagletError("compressed-tensors without config_groups: no scheme for its weights")
    schemes = {compressed_tensors_group(f"compressed-tensors config_groups.{name}", group, fmt)
               for name, group in groups.items()}
    if len(schemes) > 1:
        raise EagletError(f"compressed-tensors config_groups of different schemes (symmetric, group size): "
                          f"{sorted(schemes)}; eaglet takes one for every layer")
    (symmetric, groupsize), = schemes
    kind = "symmetric" if symmetric else "asymmetric"
    return HubInt4("compressed-tensors", groupsize, f"compressed-tensors pack-quantized {kind}", symmetric=symmetric)


def compressed_tensors_group(where: str, group, fmt: str) -> tuple:
    """(symmetric, group size) of one config group, or one error naming what eaglet cannot run."""
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise EagletError(f"{where} has no weights scheme (a preset's name?): {group!r}"[:300])
    if group.get("input_activations") or group.get("output_activations"):
        raise EagletError(f"{where} quantizes activations too; eaglet's int4 is weight-only")
    if (group.get("format") or fmt) != fmt or weights.get("type", "int") != "int":
        raise EagletError(f"{where}: {group.get('format') or fmt} {weights.get('type')} weights; eaglet reads "
                          "pack-quantized int ones")
    groupsize = weights.get("group_size")
    strategy = weights.get("strategy") or ("group" if (groupsize or 0) > 0 else "channel" if groupsize else "tensor")
    if weights.get("num_bits", 8) == 4 and strategy != "group":
        raise EagletError(f"{where}: strategy {strategy!r}; eaglet's int4 kernels take groups of 32, 64, 128 "
                          "or 256 input channels (strategy group)")
    if weights.get("dynamic"):
        raise EagletError(f"{where}: dynamic weight scales, which eaglet does not run")
    return bool(weights.get("symmetric", True)), int4_groupsize(weights.get("num_bits", 8), groupsize, where)


HUB_SCHEMES = {"awq": awq_scheme, "gptq": gptq_scheme, "compressed-tensors": compressed_tensors_scheme}


def hub_int4_scheme(qc) -> HubInt4:
    """A config.json's quantization_config, or one error naming what eaglet's int4 cannot hold."""
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else None
    if method not in HUB_SCHEMES:
        raise EagletError(f"quantization_config with quant_method {method!r}: eaglet converts 4-bit awq (gemm), "
                          "gptq and compressed-tensors (pack-quantized) checkpoints")
    return HUB_SCHEMES[method](qc)


def linear_shapes(args: ModelArgs) -> dict:
    """Each Hugging Face projection of a decoder layer: (out, in, whether the architecture has its bias)."""
    q, kv = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    dim, inter = args.dim, args.intermediate_size
    return {"self_attn.q_proj": (q, dim, args.qkv_bias), "self_attn.k_proj": (kv, dim, args.qkv_bias),
            "self_attn.v_proj": (kv, dim, args.qkv_bias), "self_attn.o_proj": (dim, q, args.o_bias),
            "mlp.gate_proj": (inter, dim, args.mlp_bias), "mlp.up_proj": (inter, dim, args.mlp_bias),
            "mlp.down_proj": (dim, inter, args.mlp_bias)}


def check_int4_widths(args: ModelArgs, groupsize: int):
    for module, (out_features, in_features, _) in linear_shapes(args).items():
        if in_features % groupsize:
            raise EagletError(f"group size {groupsize} does not divide the input width {in_features} of "
                              f"{module}: the checkpoint cannot match its quantization_config")
        if out_features % 16:
            raise EagletError(f"int4 needs output widths that are multiples of 16 (torch's CPU kernel); {module} "
                              f"has {out_features}")


def nibbles(packed: Tensor) -> Tensor:
    """int32 [..., n] -> uint8 [..., 8 n]: each int32's eight 4-bit values, the lowest bits first."""
    out = torch.empty(*packed.shape, 8, dtype=torch.uint8)
    for j in range(8):
        out[..., j] = (packed >> 4 * j) & 15
    return out.flatten(-2)


def take(tensors: dict, key: str, shape: tuple, dtypes: tuple, scheme: HubInt4) -> Tensor:
    """A quantized Linear's tensor, checked against what its quantization_config says it holds."""
    if key not in tensors:
        raise EagletError(f"{key} is missing: {scheme.source} (group size {scheme.groupsize}) stores it")
    t = tensors.pop(key)
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        raise EagletError(f"{key} is {str(t.dtype)[6:]} {tuple(t.shape)}, but {scheme.source} with group size "
                          f"{scheme.groupsize} stores {str(dtypes[0])[6:]} {shape} there: the tensors do not match "
                          "the quantization_config")
    return t


def check_g_idx(tensors: dict, key: str, in_features: int, groupsize: int):
    """Act-order (GPTQ's desc_act, compressed-tensors' actorder group) can put the input channels in groups out
    of order; int4 kernels take contiguous groups, and running such a layer exactly would need each layer's
    input permuted. A g_idx of contiguous groups is fine whatever the flag says."""
    g_idx = tensors.pop(key, None)
    if g_idx is not None and not torch.equal(g_idx.long().flatten(), torch.arange(in_features) // groupsize):
        raise EagletError(f"{key}: act-order puts input channels in groups out of order, which eaglet's int4 "
                          "kernels cannot run (they take contiguous groups); use a checkpoint without act-order "
                          "(desc_act false, actorder null or weight)")


def awq_values(t: dict, name: str, out_features: int, in_features: int, scheme: HubInt4) -> tuple:
    """AWQ GEMM: qweight [in, out / 8] and qzeros [in / group, out / 8], eight output columns an int32 in
    AWQ_ORDER; scales [in / group, out]."""
    groups = in_features // scheme.groupsize
    qweight = take(t, f"{name}.qweight", (in_features, out_features // 8), INT32, scheme)
    qzeros = take(t, f"{name}.qzeros", (groups, out_features // 8), INT32, scheme)
    scales = take(t, f"{name}.scales", (groups, out_features), FLOATS, scheme)
    slot = [AWQ_ORDER.index(c) for c in range(8)]

    def columns(packed):
        return nibbles(packed).unflatten(-1, (-1, 8))[..., slot].flatten(-2).T
    return columns(qweight), columns(qzeros), scales.T


def gptq_values(t: dict, name: str, out_features: int, in_features: int, scheme: HubInt4) -> tuple:
    """GPTQ: qweight [in / 8, out], eight input rows an int32; qzeros [in / group, out / 8], eight output
    columns an int32 (z - 1 in the gptq format, z in gptq_v2); scales [in / group, out]; g_idx [in]."""
    groups = in_features // scheme.groupsize
    qweight = take(t, f"{name}.qweight", (in_features // 8, out_features), INT32, scheme)
    qzeros = take(t, f"{name}.qzeros", (groups, out_features // 8), INT32, scheme)
    scales = take(t, f"{name}.scales", (groups, out_features), FLOATS, scheme)
    check_g_idx(t, f"{name}.g_idx", in_features, scheme.groupsize)
    return nibbles(qweight.T), nibbles(qzeros).T + scheme.zero_offset, scales.T


def compressed_tensors_values(t: dict, name: str, out_features: int, in_features: int, scheme: HubInt4) -> tuple:
    """pack-quantized: weight_packed [out, in / 8], eight input columns an int32, each q + 8 (signed values
    stored offset); weight_scale [out, in / group]; weight_zero_point (asymmetric only) [out / 8, in / group],
    packed along the outputs, z + 8; weight_shape [out, in]; weight_g_idx [in]."""
    groups = in_features // scheme.groupsize
    packed = take(t, f"{name}.weight_packed", (out_features, in_features // 8), INT32, scheme)
    scales = take(t, f"{name}.weight_scale", (out_features, groups), FLOATS, scheme)
    shape = t.pop(f"{name}.weight_shape", None)
    if shape is not None and shape.tolist() != [out_features, in_features]:
        raise EagletError(f"{name}.weight_shape is {shape.tolist()}, but config.json makes it "
                          f"[{out_features}, {in_features}]")
    check_g_idx(t, f"{name}.weight_g_idx", in_features, scheme.groupsize)
    if not scheme.symmetric:
        zero_points = take(t, f"{name}.weight_zero_point", (out_features // 8, groups), INT32, scheme)
        return nibbles(packed), nibbles(zero_points.T).T, scales
    zero_points = t.pop(f"{name}.weight_zero_point", None)
    if zero_points is not None and zero_points.any():
        raise EagletError(f"{name}.weight_zero_point is not zero, but its scheme is symmetric")
    return nibbles(packed), torch.full((out_features, groups), 8, dtype=torch.uint8), scales


HUB_VALUES = {"awq": awq_values, "gptq": gptq_values, "compressed-tensors": compressed_tensors_values}


def int4_form(q: Tensor, z: Tensor, s: Tensor, name: str) -> dict:
    """w = (q - z) * s as Int4Linear holds it: w = (q - 8) * scale + zero, scale = s, zero = (8 - z) * s."""
    if not torch.isfinite(s).all():
        raise EagletError(f"{name} holds NaN or infinite scales: a damaged checkpoint")
    s = s.float()
    return {f"{name}.weight": pack_int4(q.contiguous()), f"{name}.scales": s.to(torch.bfloat16).contiguous(),
            f"{name}.zeros": ((8 - z.float()) * s).to(torch.bfloat16).contiguous()}


def weight_error(q: Tensor, z: Tensor, s: Tensor, scales: Tensor, zeros: Tensor) -> float:
    """The largest |w' - w| in a row over the row's largest |w|: w = (q - z) * s, the checkpoint's weight,
    and w' = (q - 8) * scale + zero, ours. Both are linear in q, so within a group the extremes lie at its
    smallest and largest q: [out, groups] tensors, never a float copy of the weight."""
    grouped = q.unflatten(1, (s.shape[1], -1))
    s, z, ds, zero = s.float(), z.float(), scales.float() - s.float(), zeros.float()
    error, largest = torch.zeros_like(s), torch.zeros_like(s)
    for end in (grouped.amin(-1).float(), grouped.amax(-1).float()):
        error = torch.maximum(error, ((end - 8) * ds + zero - (8 - z) * s).abs())
        largest = torch.maximum(largest, ((end - z) * s).abs())
    return (error.amax(1) / largest.amax(1).clamp(min=1e-30)).max().item()


def hub_int4_layer(weights: dict, i: int, args: ModelArgs, scheme: HubInt4) -> tuple:
    """Decoder layer i of a Hub 4-bit checkpoint in our names, its 4-bit Linears in Int4Linear's form and
    what it left unquantized as it is; and (the largest weight_error, its Linear)."""
    src, shapes, worst = f"model.layers.{i}.", linear_shapes(args), (0.0, "")
    layer = {k: weights.pop(k) for k in [k for k in weights if k.startswith(src)]}  # one layer in memory
    for theirs in LAYER_LINEARS.values():
        quantized = [m for m in theirs if f"{src}{m}.weight" not in layer]
        if quantized and len(quantized) < len(theirs):
            plain = next(m for m in theirs if m not in quantized)
            raise EagletError(f"{src}{plain} is not quantized but {src}{quantized[0]} is: eaglet fuses "
                              f"{', '.join(theirs)} into one Linear, all 4-bit or none")
        for module in quantized:
            name, (out_features, in_features, has_bias) = src + module, shapes[module]
            q, z, s = HUB_VALUES[scheme.method](layer, name, out_features, in_features, scheme)
            int4 = int4_form(q, z, s, name)
            layer.update(int4)
            worst = max(worst, (weight_error(q, z, s, int4[f"{name}.scales"], int4[f"{name}.zeros"]), name))
            if f"{name}.bias" in layer and not has_bias and not layer[f"{name}.bias"].any():
                del layer[f"{name}.bias"]  # AutoGPTQ wrote a bias for every Linear, zeros where the model has none
    out = convert_layer(layer, src, f"layers.{i}.")
    if layer:
        raise EagletError(f"unexpected weights {', '.join(sorted(layer)[:5])}")
    return out, worst


def convert_int4_target(checkpoint_dir: Path, config: dict, weights: dict, tmp_dir: Path, scheme: HubInt4,
                        log=print) -> dict:
    """A Hub 4-bit target as quantize.py's int4 file: the 4-bit Linears carried over, what the checkpoint left
    unquantized as it is, but the lm_head in int8 as quantize.py has it (a tied one gets its own copy)."""
    args = ModelArgs.from_hf_config(config)
    for k in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        del weights[k]
    quantized_head = sorted(k for k in weights if k.startswith("lm_head.") and k != "lm_head.weight")
    if quantized_head:
        raise EagletError(f"{checkpoint_dir}: its lm_head is quantized ({quantized_head[0]}); eaglet keeps the "
                          "lm_head in int8 and reads a checkpoint whose lm_head is not quantized")
    worst, out = (0.0, ""), {QUANT_KEY: quantization_record("int4", scheme.groupsize, scheme.source)}
    try:
        embed = weights.pop("model.embed_tokens.weight")
        if "lm_head.weight" not in weights and not args.tie_word_embeddings:
            raise EagletError(f"{checkpoint_dir}: lm_head.weight is missing and tie_word_embeddings is false")
        rest = {"tok_embeddings.weight": embed, "norm.weight": weights.pop("model.norm.weight"),
                "output.weight": weights.pop("lm_head.weight", embed)}
        out.update(spill(quantize_group(rest, "int4", scheme.groupsize), tmp_dir, "embeddings"))
        with Progress("converting", args.n_layer, "layers", log=log) as progress:
            for i in range(args.n_layer):
                layer, error = hub_int4_layer(weights, i, args, scheme)
                out.update(spill(layer, tmp_dir, f"layer{i}"))
                worst = max(worst, error)
                progress.update(i + 1)
    except KeyError as e:
        raise EagletError(f"{checkpoint_dir}: weight {e.args[0]} is missing")
    if weights:
        raise EagletError(f"{checkpoint_dir}: unexpected weights {', '.join(sorted(weights)[:5])}")
    log(f"{scheme.source}: the largest weight change from the scales and zeros in bf16 is {100 * worst[0]:.3f}% "
        f"of its row's largest weight ({worst[1] if worst[0] else 'every weight exact'})")
    return out


def hub_int4_config(checkpoint_dir: Path, config: dict):
    """The scheme of a Hub 4-bit target, checked before any weight is read; None if it is not quantized."""
    if config.get("quantization_config") is None:
        return None
    try:
        scheme = hub_int4_scheme(config["quantization_config"])
        check_int4_widths(ModelArgs.from_hf_config({"model_type": "llama", **config}), scheme.groupsize)
    except EagletError as e:
        raise EagletError(f"{checkpoint_dir / 'config.json'}: {e}")
    return scheme


# What generate.py, quantize.py and bench.py read beside a converted file: config.json (shapes and EOS ids),
# generation_config.json (EOS ids), the tokenizer and its settings, the chat template, and the draft
# vocabulary an EAGLE-1/2 head may have. --out_dir copies those the checkpoint has.
FILES_BESIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                "chat_template.jinja", "chat_template.json", "draft_vocab.json")


def out_folder(checkpoint_dir: Path, out_dir) -> Path:
    """Where the converted file goes: out_dir, or the checkpoint's folder (also when out_dir is that folder)."""
    if out_dir is None:
        return checkpoint_dir
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise EagletError(f"--out_dir {out_dir} is a file, not a folder")
    if out_dir.is_dir() and os.path.samefile(out_dir, checkpoint_dir):
        return checkpoint_dir
    return out_dir


def refuse_existing(path: Path, overwrite: bool, detail: str = ""):
    if path.is_dir() or (path.exists() and not overwrite):
        raise EagletError(f"{path} exists{detail}{'' if path.is_dir() else '; give --overwrite to replace it'}")


def same_contents(a: Path, b: Path) -> bool:
    try:
        return filecmp.cmp(a, b, shallow=False)
    except OSError as e:
        raise EagletError(f"cannot compare {a} with {b}: {e.strerror or e}")


def files_to_copy(checkpoint_dir: Path, out_dir: Path, overwrite: bool, log=print) -> list:
    """The FILES_BESIDE that checkpoint_dir has and out_dir lacks or holds otherwise; one held otherwise is
    refused unless overwrite. An identical copy stays; so does a file of those names the checkpoint lacks."""
    names = []
    for name in FILES_BESIDE:
        src, dst = checkpoint_dir / name, out_dir / name
        if not src.is_file():
            if dst.is_file():
                log(f"note: {dst} is not from {checkpoint_dir}; the tools read it beside the converted file")
            continue
        if dst.is_file() and same_contents(src, dst):
            continue
        refuse_existing(dst, overwrite, f" and differs from {src}")
        names.append(name)
    return names


def make_folder(out_dir: Path):
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EagletError(f"--out_dir {out_dir} cannot be made: {e.strerror or e}")


def convert_weights(checkpoint_dir: Path, config: dict, weights: dict, tmp_dir: Path, hub_int4, is_target: bool,
                    log=print) -> dict:
    if hub_int4:
        return convert_int4_target(checkpoint_dir, config, weights, tmp_dir, hub_int4, log)
    if is_target:
        return convert_target(checkpoint_dir, config, weights, tmp_dir, log)
    kind = head_kind(config, weights, str(checkpoint_dir))
    convert_kind = {"eagle3": convert_eagle3_head, "dflash": convert_dflash_head}.get(kind, convert_head)
    return convert_kind(checkpoint_dir, config, weights)


def gguf_state_dict(f, config: dict, tmp_dir: Path, int4: bool, log=print) -> dict:
    """A GGUF file's weights in our names, its values exactly: dequantized ones in fp16 where that holds them,
    else fp32; where its Linears are 4-bit, Int4Linear's g32 form with the file's scales and minimums. The
    embedding and lm_head (a tied one stays tied) as the file has them, not requantized."""
    args = ModelArgs.from_hf_config(config)
    check_tensor_names(f, args.n_layer)
    types = sorted(set(linear_types(f)))
    record = quantization_record("int4", 32, f"{f.path.name} ({', '.join(types)})", format_version=2)
    out = {QUANT_KEY: record | {"lm_head": "as in the file"}} if int4 else {}
    rest = {"tok_embeddings.weight": dequantize(f, "token_embd.weight"),
            "norm.weight": dequantize(f, "output_norm.weight")}
    if "output.weight" in f.tensors:
        rest["output.weight"] = dequantize(f, "output.weight")
    out.update(spill(rest, tmp_dir, "embeddings"))
    with Progress("converting", args.n_layer, "layers", log=log) as progress:
        for i in range(args.n_layer):
            layer = gguf_layer(f, i, config, int4_allowed=int4)
            out.update(spill(convert_layer(layer, f"model.layers.{i}.", f"layers.{i}."), tmp_dir, f"layer{i}"))
            progress.update(i + 1)
    return out


def convert_gguf_file(path: Path, out_dir, overwrite: bool, log=print, keep_4bit: bool = True) -> Path:
    """DIR/model.pth (dequantized) or DIR/model_int4.g32.pth (its 4-bit Linears kept 4-bit) and, beside it, the
    config.json, tokenizer.json, tokenizer_config.json and generation_config.json the metadata describes.
    DIR: out_dir, else the file's folder. A file there that differs is replaced only if overwrite."""
    f = read_gguf(find_gguf(path))
    config = gguf_config(f)
    try:
        args = ModelArgs.from_hf_config(config)
    except EagletError as e:
        raise EagletError(f"{f.path}: {e}")
    texts = {"config.json": json.dumps(config, indent=2), **gguf_tokenizer(f)}
    types = linear_types(f)
    int4 = keep_4bit and any(t in INT4_TYPES for t in types)
    other = sorted(set(t for t in types if t not in INT4_TYPES + ("F32", "F16", "BF16")))
    if other:
        log(f"note: {f.path.name} holds {', '.join(other)} Linears: eaglet dequantizes them (fp32, or fp16 "
            "where that holds them exactly)"
            + (" (and the other Linears fused with them: q, k, v and gate, up go together)" if int4 else ""))
    if int4:
        check_int4_widths(args, 32)
    out_dir = Path(out_dir) if out_dir is not None else f.path.parent
    if out_dir.exists() and not out_dir.is_dir():
        raise EagletError(f"--out_dir {out_dir} is a file, not a folder")
    out_path = output_path(out_dir / "model.pth", "int4", 32) if int4 else out_dir / "model.pth"
    refuse_existing(out_path, overwrite)
    for name, text in texts.items():
        if (out_dir / name).is_file() and (out_dir / name).read_bytes() != text.encode():
            refuse_existing(out_dir / name, overwrite, f" and is not what {f.path.name} describes")
    make_folder(out_dir)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".eaglet-convert-") as tmp_dir:
            state_dict = gguf_state_dict(f, config, Path(tmp_dir), int4, log)
            log(f"writing {out_path}")
            torch.save(state_dict, Path(tmp_dir) / out_path.name)
            for name, text in texts.items():
                (Path(tmp_dir) / name).write_text(text, encoding="utf-8")
                os.replace(Path(tmp_dir) / name, out_dir / name)
            os.replace(Path(tmp_dir) / out_path.name, out_path)
    except OSError as e:
        raise EagletError(f"cannot write in {out_dir}: {e.strerror or e} (give --out_dir to write elsewhere)")
    return out_path


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").exists() and
                                      any(path.glob("*.gguf")))


def convert(checkpoint_dir, log=print, overwrite: bool = False, out_dir=None, dequantize: bool = False) -> Path:
    """DIR/model.pth or DIR/draft.pth; a Hub 4-bit target's DIR/model_int4.g<N>.pth, which replaces a file of
    that name only if overwrite. DIR: out_dir if given, with copies of the FILES_BESIDE the checkpoint has
    (there, an existing converted file or a different copy is replaced only if overwrite); else checkpoint_dir."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.exists():
        raise EagletError(f"{'file' if checkpoint_dir.suffix == '.gguf' else 'checkpoint folder'} not found: "
                          f"{checkpoint_dir}")
    if dequantize and not is_gguf(checkpoint_dir):
        raise EagletError("--dequantize is for .gguf files (a Hub 4-bit folder converts to int4 only)")
    if is_gguf(checkpoint_dir):
        return convert_gguf_file(checkpoint_dir, out_dir, overwrite, log, keep_4bit=not dequantize)
    if not checkpoint_dir.is_dir():
        raise EagletError(f"not a folder or a .gguf file: {checkpoint_dir}")
    config = head_config(read_config(checkpoint_dir), str(checkpoint_dir / "config.json"))  # a head's, flat
    try:  # refuse what we cannot run before reading weights
        ModelArgs.from_hf_config({"model_type": "llama", **config})
    except EagletError as e:
        raise EagletError(f"{checkpoint_dir / 'config.json'}: {e}")
    out_dir, hub_int4 = out_folder(checkpoint_dir, out_dir), hub_int4_config(checkpoint_dir, config)
    in_place = out_dir == checkpoint_dir
    weights = load_hf_weights(checkpoint_dir, log)  # the names only
    is_target = any(k.startswith("model.") for k in weights) and not (is_eagle3_config(config) or
                                                                      is_dflash_config(config))
    if hub_int4 and not is_target:
        raise EagletError(f"{checkpoint_dir}: a quantized draft head; eaglet converts 4-bit targets (quantize.py "
                          "--mode int8 takes a converted head)")
    out_path = output_path(out_dir / "model.pth", "int4", hub_int4.groupsize) if hub_int4 else \
        out_dir / ("model.pth" if is_target else "draft.pth")
    refuse_existing(out_path, overwrite or (in_place and not hub_int4))  # in place, model.pth is ours to replace
    copies = [] if in_place else files_to_copy(checkpoint_dir, out_dir, overwrite, log)
    make_folder(out_dir)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".eaglet-convert-") as tmp_dir:
            state_dict = convert_weights(checkpoint_dir, config, weights, Path(tmp_dir), hub_int4, is_target, log)
            log(f"writing {out_path}")
            torch.save(state_dict, Path(tmp_dir) / out_path.name)
            for name in copies:  # before the converted file: a converted file in DIR has its config beside it
                shutil.copyfile(checkpoint_dir / name, Path(tmp_dir) / name)
                os.replace(Path(tmp_dir) / name, out_dir / name)
            os.replace(Path(tmp_dir) / out_path.name, out_path)  # an interrupted write leaves the old file whole
    except SafetensorError as e:  # a shard that is truncated or corrupt shows when its tensors are read
        raise EagletError(f"cannot read the weights in {checkpoint_dir}: {e}")
    except OSError as e:
        elsewhere = " (give --out_dir to write elsewhere)" if in_place else ""
        raise EagletError(f"cannot write in {out_dir}: {e.strerror or e}{elsewhere}")
    return out_path


def main(argv=None):
    args = parse_args(argv)
    try:
        out_path = convert(args.checkpoint_dir, overwrite=args.overwrite, out_dir=args.out_dir, dequantize=args.dequantize)
    except EagletError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
