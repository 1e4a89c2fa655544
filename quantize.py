"""Weight-only quantization of a converted target (model.pth) or draft head (draft.pth), written beside it.

    python quantize.py --checkpoint_path checkpoints/org/model/model.pth --mode int8        # -> model_int8.pth
    python quantize.py --checkpoint_path checkpoints/org/model/model.pth --mode int4 --groupsize 128
    python quantize.py --checkpoint_path checkpoints/org/model-eagle/draft.pth --mode int8  # -> draft_int8.pth

The int4 line writes model_int4.g128.pth. The input is what convert_hf_checkpoint.py wrote, never a
Hugging Face *.safetensors / *.bin file. Which format: int8 stays close to bf16 (on the demo 27 of 40
greedy outputs identical) at half the bytes; int4 reads about a quarter of bf16's and moves the model
further (smaller groups stay closer); both keep the heads' acceptance on the demo (README.md). int4 runs
on CUDA GPUs of compute capability 8.0 or newer and on CPU (slowly: it is for checking there).

int8: every Linear, symmetric, one scale per output channel. int4: the attention and MLP Linears in groups of
--groupsize input channels, each with a scale and a zero point (asymmetric); the lm_head (the target's, or an
EAGLE-3 head's own) in int8, because it is the largest single matrix and every draft pass reads it too. The
embedding stays in its own dtype: a token reads one row of it, so quantizing it would save no time.
generate.py, bench.py and train_draft.py load the file like any model.pth; speculative decoding on it gives
exactly the output of plain decoding of the same quantized model.
"""
import os
import sys
import tempfile
from pathlib import Path

from cli import Progress, cli_parser

GROUPSIZES = (32, 64, 128, 256)  # the group sizes torch's int4 kernels take


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", type=Path, required=True,
                   help="model.pth or draft.pth (bf16 / fp32), or the folder holding it")
    p.add_argument("--mode", required=True, choices=["int8", "int4"], help="weight format")
    p.add_argument("--groupsize", type=int, choices=GROUPSIZES, default=None,
                   help="int4: input channels sharing one scale and zero point (default: 128)")
    p.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
    args = p.parse_args(argv)
    if args.mode == "int8" and args.groupsize is not None:
        p.error("--groupsize is for --mode int4 (int8 has one scale per output channel)")
    args.groupsize = args.groupsize or 128
    return args


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from model import QUANT_FORMAT_VERSION, QUANT_KEY, EagletError, load_state_dict  # noqa: E402

EMBEDDINGS = ("tok_embeddings.weight", "embed.weight")  # the only 2-D weights that are not Linears
LM_HEADS = ("output.weight", "lm_head.weight")  # int8 even in int4 mode


def quantize_int8(w: Tensor):
    """w [out, in] -> int8 values and one bf16 scale per row: w ~ q * scale, |q| <= 127."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: Tensor, groupsize: int):
    """w [out, in] -> 4-bit values two a byte (the even input channel in the high nibble), and a bf16 scale
    and zero point per group of groupsize input channels: w ~ (q - 8) * scale + zero, q in 0..15, the
    group's minimum and maximum at q = 0 and 15."""
    out_features, in_features = w.shape
    groups = w.float().reshape(out_features, in_features // groupsize, groupsize)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-6).to(torch.bfloat16)
    zeros = (low + 8 * scales.float()).to(torch.bfloat16)  # rounded first: q is computed from what is stored
    q = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp(0, 15)
    return pack_int4(q.to(torch.uint8).reshape(out_features, in_features)), scales, zeros


def pack_int4(q: Tensor) -> Tensor:
    """uint8 values 0..15 [out, in] -> [out, in / 2], two a byte, the even input channel in the high nibble."""
    return (q[:, 0::2] << 4) | q[:, 1::2]


def spill(tensors: dict, tmp_dir: Path, name: str) -> dict:
    """Tensors written to a temporary file and mapped back: they wait on disk, not in memory, until the
    final torch.save reads them."""
    path = Path(tmp_dir) / f"{name}.pt"
    torch.save(tensors, path)
    return torch.load(path, mmap=True, weights_only=True)


def output_path(checkpoint_path: Path, mode: str, groupsize: int) -> Path:
    suffix = f"_{mode}" + (f".g{groupsize}" if mode == "int4" else "")
    return checkpoint_path.with_name(checkpoint_path.stem + suffix + ".pth")


def is_linear(name: str, t: Tensor) -> bool:
    return name.endswith(".weight") and t.ndim == 2 and name not in EMBEDDINGS and t.is_floating_point()


def check_shapes(state_dict: dict, mode: str, groupsize: int):
    """Refuse, before any work, what is not a converted checkpoint, and a width the int4 format cannot hold
    (the kernels' constraints)."""
    if any(k.startswith("model.") or ".self_attn." in k or ".mlp." in k for k in state_dict):
        raise EagletError("this is a Hugging Face checkpoint (its tensor names are): run convert_hf_checkpoint.py "
                          "--checkpoint_dir on its folder, then quantize the model.pth / draft.pth it writes")
    if not any(is_linear(k, t) for k, t in state_dict.items()):
        raise EagletError("no Linear weights to quantize (is this a model.pth or draft.pth?)")
    int4 = {n: t for n, t in state_dict.items() if mode == "int4" and is_linear(n, t) and n not in LM_HEADS}
    for name, t in int4.items():
        layer = name.removesuffix(".weight")
        if t.shape[1] % groupsize:
            fits = [str(g) for g in GROUPSIZES if all(w.shape[1] % g == 0 for w in int4.values())]
            raise EagletError(f"--groupsize {groupsize} does not divide the input width {t.shape[1]} of {layer}; "
                              + (f"one that divides every layer's: {', '.join(fits)}" if fits else
                                 "no int4 group size divides every layer's width: use --mode int8"))
        if t.shape[0] % 16:
            raise EagletError(f"int4 needs output widths that are multiples of 16 (torch's CPU kernel); {layer} has "
                              f"{t.shape[0]} (int8 has no such limit)")


def quantize_group(tensors: dict, mode: str, groupsize: int) -> dict:
    """One layer's tensors: Linear weights quantized (NAME.weight + NAME.scales [+ NAME.zeros]), the rest as is."""
    out = {}
    for name, t in tensors.items():
        layer = name.removesuffix(".weight")
        if not is_linear(name, t):
            out[name] = t
            continue
        if not torch.isfinite(t).all():
            raise EagletError(f"{layer} holds NaN or infinite weights: a damaged checkpoint cannot be quantized")
        if mode == "int4" and name not in LM_HEADS:
            out[name], out[f"{layer}.scales"], out[f"{layer}.zeros"] = quantize_int4(t, groupsize)
        else:
            out[name], out[f"{layer}.scales"] = quantize_int8(t)
    return out


def layer_groups(names) -> dict:
    """Tensor names by decoder layer (layers.N. / layer.), the rest (embedding, lm_head, norm, fc) together."""
    groups = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else parts[0] if parts[0] == "layer" else "the rest"
        groups.setdefault(key, []).append(name)
    return groups


def quantization_record(mode: str, groupsize: int, source: str) -> dict:
    return {"format_version": QUANT_FORMAT_VERSION, "mode": mode, "groupsize": groupsize if mode == "int4" else 0,
            "lm_head": "int8", "source": source}


def quantized_layers(state_dict: dict, mode: str, groupsize: int):
    """(layer name, its tensors quantized) one decoder layer at a time, the rest (embeddings, norm, lm_head)
    first. A tied lm_head (no output.weight beside tok_embeddings.weight) gets its own int8 copy."""
    if "tok_embeddings.weight" in state_dict and "output.weight" not in state_dict:
        state_dict = {**state_dict, "output.weight": state_dict["tok_embeddings.weight"]}
    check_shapes(state_dict, mode, groupsize)
    for key, names in layer_groups(state_dict).items():
        yield key, quantize_group({n: state_dict[n] for n in names}, mode, groupsize)


def quantize_state_dict(state_dict: dict, mode: str, groupsize: int = 128) -> dict:
    """All of it in memory (on the tensors' device), record included: for tools that quantize what they built."""
    out = {QUANT_KEY: quantization_record(mode, groupsize, "memory")}
    for _, tensors in quantized_layers(state_dict, mode, groupsize):
        out.update(tensors)
    return out


def quantize_checkpoint(checkpoint_path, mode: str, groupsize: int = 128, overwrite: bool = False, log=print) -> Path:
    checkpoint_path = Path(checkpoint_path)
    if checkpoint_path.is_dir():  # a converted folder: its model.pth, or a head folder's draft.pth
        checkpoint_path = next((checkpoint_path / n for n in ("model.pth", "draft.pth")
                                if (checkpoint_path / n).is_file()), checkpoint_path / "model.pth")
    if not checkpoint_path.is_file():
        raise EagletError(f"checkpoint not found: {checkpoint_path} (convert_hf_checkpoint.py writes it)")
    if checkpoint_path.suffix in (".safetensors", ".bin"):
        raise EagletError(f"{checkpoint_path} is a Hugging Face weights file: run convert_hf_checkpoint.py "
                          "--checkpoint_dir on its folder, then quantize the model.pth / draft.pth it writes")
    out_path = output_path(checkpoint_path, mode, groupsize)
    if out_path.is_dir() or (out_path.exists() and not overwrite):
        raise EagletError(f"{out_path} exists{'' if out_path.is_dir() else '; give --overwrite to replace it'}")
    state_dict = load_state_dict(checkpoint_path)  # memory-mapped: a layer is read when it is quantized
    if QUANT_KEY in state_dict:
        record = state_dict[QUANT_KEY] if isinstance(state_dict[QUANT_KEY], dict) else {}
        raise EagletError(f"{checkpoint_path} is already quantized ({record.get('mode')}"
                          f"{'' if record.get('mode') != 'int4' else ' g' + str(record.get('groupsize'))}): "
                          "quantize the bf16 / fp32 checkpoint it came from")
    source_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    check_shapes(state_dict, mode, groupsize)  # before the output folder is touched
    try:  # the temporary folder beside the output: a failed write leaves no partial file, and os.replace works
        with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".eaglet-quantize-") as tmp_dir:
            out = {QUANT_KEY: quantization_record(mode, groupsize, checkpoint_path.name)}
            with Progress("quantizing", len(layer_groups(state_dict)), "layer groups", log=log) as progress:
                for i, (key, quantized) in enumerate(quantized_layers(state_dict, mode, groupsize)):
                    out.update(spill(quantized, Path(tmp_dir), f"part{i}"))  # on disk until the final write
                    progress.update(i + 1, f"quantized {key}")
            log(f"writing {out_path}")
            torch.save(out, Path(tmp_dir) / out_path.name)
            os.replace(Path(tmp_dir) / out_path.name, out_path)
    except OSError as e:
        raise EagletError(f"cannot write {out_path}: {e.strerror or e}")
    log(f"{source_bytes / 1e9:.3f} GB -> {out_path.stat().st_size / 1e9:.3f} GB")
    return out_path


def main(argv=None):
    args = parse_args(argv)
    try:
        out_path = quantize_checkpoint(args.checkpoint_path, args.mode, args.groupsize, args.overwrite)
    except EagletError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
