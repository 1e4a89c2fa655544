"""Convert a Hugging Face LLaMA-family checkpoint folder into DIR/model.pth (eaglet's names, fused qkv),
or an EAGLE-1/2, EAGLE-3, P-EAGLE, DFlash, DSpark, DFlash2 or XPress draft head folder into DIR/draft.pth; which
one it is comes from its contents.

    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-chat-hf
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/yuhuili/EAGLE-llama2-chat-7B
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/deepseek-ai/dspark_qwen3_8b_block7
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4

The folder keeps its config.json and tokenizer files; generate.py reads them from beside the .pth file. An earlier
conversion there is replaced; a model.pth or draft.pth that is no PyTorch checkpoint is replaced only with --overwrite.

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
# (The docstring above is --help's text.) A tool on top: Hugging Face folders (targets and heads) converted here;
# a Hub 4-bit target's Linears read in convert_hub_int4.py, a GGUF file in convert_gguf.py, a decoder layer's names
# in convert_common.py. scripts/make_demo.py and the tests import it (convert).
import filecmp
import json
import os
import shutil
import sys
import tempfile
import zipfile
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
                        "4-bit target: its model_int4.g<N>.pth wherever it goes (in --checkpoint_dir, a model.pth or "
                        "draft.pth that torch.save wrote, an earlier conversion, is replaced without it; a file of "
                        "that name that is no PyTorch checkpoint only with it)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

import torch  # noqa: E402
from safetensors import SafetensorError, safe_open  # noqa: E402

from head_formats import (eagle3_flags, feature_layer_ids, head_args, head_config, head_kind,  # noqa: E402
                          is_dflash_config, is_eagle3_config, probe)
from checkpoint import EagletError, load_state_dict, read_config  # noqa: E402
from model import ModelArgs  # noqa: E402
from quantize import output_path, spill  # noqa: E402
from convert_common import convert_layer, make_folder, refuse_existing  # noqa: E402
from convert_hub_int4 import convert_int4_target, hub_int4_config  # noqa: E402
from convert_gguf import convert_gguf_file  # noqa: E402

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


def convert_weights(checkpoint_dir: Path, config: dict, weights: dict, tmp_dir: Path, hub_int4, is_target: bool,
                    log=print) -> dict:
    if hub_int4:
        return convert_int4_target(checkpoint_dir, config, weights, tmp_dir, hub_int4, log)
    if is_target:
        return convert_target(checkpoint_dir, config, weights, tmp_dir, log)
    kind = head_kind(config, weights, str(checkpoint_dir))
    convert_kind = {"eagle3": convert_eagle3_head, "dflash": convert_dflash_head}.get(kind, convert_head)
    return convert_kind(checkpoint_dir, config, weights)


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").exists() and
                                      any(path.glob("*.gguf")))


def is_torch_archive(path: Path) -> bool:
    """Whether path is a file torch.save wrote (a zip archive holding data.pkl)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


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
    # in place, an earlier conversion is ours to replace; a file of that name that is no PyTorch checkpoint is not
    replaceable = in_place and not hub_int4 and out_path.is_file()
    ours = replaceable and is_torch_archive(out_path)
    refuse_existing(out_path, overwrite or ours, " and is not a PyTorch checkpoint" if replaceable and not ours else "")
    copies = [] if in_place else files_to_copy(checkpoint_dir, out_dir, overwrite, log)
    make_folder(out_dir)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".eaglet-convert-") as tmp_dir:
            state_dict = convert_weights(checkpoint_dir, config, weights, Path(tmp_dir), hub_int4, is_target, log)
            rows = state_dict.get("tok_embeddings.weight") if is_target else None
            if rows is not None and rows.shape[0] != config["vocab_size"]:  # else refused only when loaded
                raise EagletError(f"{checkpoint_dir / 'config.json'}: vocab_size {config['vocab_size']}, but the "
                                  f"embeddings have {rows.shape[0]} rows")
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
