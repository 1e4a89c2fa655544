"""Weight-only quantization of a converted target (model.pth) or draft head (draft.pth), written beside it.

    python quantize.py --checkpoint_path checkpoints/org/model/model.pth --mode int8        # -> model_int8.pth
    python quantize.py --checkpoint_path checkpoints/org/model/model.pth --mode int4 --groupsize 128
    python quantize.py --checkpoint_path checkpoints/org/model-eagle/draft.pth --mode int8  # -> draft_int8.pth

The int4 line writes model_int4.g128.pth. The input is what convert_hf_checkpoint.py wrote, never a
Hugging Face *.safetensors / *.bin file. Which format: int8 stays close to bf16 (on the demo 27 of 40
greedy outputs identical) at half the bytes; int4 reads about a quarter of bf16's and moves the model
further (smaller groups stay closer); both keep the heads' acceptance on the demo (docs/quantization.md).
int4 runs on CUDA GPUs of compute capability 8.0 or newer and on CPU (slowly: it is for checking there).

int8: every Linear, symmetric, one scale per output channel. int4: the attention and MLP Linears in groups of
--groupsize input channels, each with a scale and a zero point (asymmetric); the lm_head (the target's, or an
EAGLE-3 head's own) in int8, because it is the largest single matrix and every draft pass reads it too. The
embedding stays in its own dtype: a token reads one row of it, so quantizing it would save no time.
generate.py, bench.py and train_draft.py load the file like any model.pth; speculative decoding on it gives
exactly the output of plain decoding of the same quantized model.
"""
# (The docstring above is --help's text.) Beside the tool, the formats as a model runs them: Int8Linear and
# Int4Linear (torch's kernels), swapped in for a file's quantized Linears when it is loaded (use_quantized_linears,
# pack_quantized). Imports checkpoint.py and cli.py; model.py imports this file only when it loads quantized weights.
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

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
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

from checkpoint import QUANT_KEY, EagletError, converted_file, converted_files, load_state_dict  # noqa: E402

# The newest format of the record a quantized file holds under QUANT_KEY that this eaglet reads; a newer one is
# refused. 2: int4 Linears may hold minimums in place of zeros (a GGUF file's own form; convert_gguf.py writes
# it), which a version 1 reader would take for damage. quantize.py's own files stay version 1.
QUANT_FORMAT_VERSION = 2
# 2-D weights that are not Linears
EMBEDDINGS = ("tok_embeddings.weight", "embed.weight", "markov_head.markov_w1.weight",
              "refiner_head.token_embed.weight")
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


class Int8Linear(nn.Module):
    """Weight-only int8: w = weight * scales (symmetric, one scale per output channel). The weight is scaled
    inside the matmul's input (scaling the output instead overflows fp16: x @ q is 127 / max|w| times too
    big), which inductor fuses into a one-token GEMV that reads int8 bytes (see graphs.compile_settings).
    On a CPU, bf16 activations go through torch's int8 kernel instead (cpu_kernel_takes)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = frozen(torch.empty(out_features, in_features, dtype=torch.int8))
        self.scales = frozen(torch.empty(out_features, dtype=torch.bfloat16))
        self.bias = frozen(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if cpu_kernel_takes(x, self.in_features):
            x2d = kernel_rows(x, self.in_features)
            y = torch.ops.aten._weight_int8pack_mm(x2d, self.weight, self.scales.to(x.dtype))
            return with_bias(y.view(*x.shape[:-1], self.out_features), self.bias)
        return F.linear(x, self.weight.to(x.dtype) * self.scales.to(x.dtype)[:, None], self.bias)

    def dequantize(self) -> Tensor:
        return self.weight.to(self.scales.dtype) * self.scales[:, None]

    def rows(self, ids: Tensor) -> "Int8Linear":
        """A Linear of only these output rows (a draft vocabulary's rows of an lm_head)."""
        with torch.device("meta"):
            out = Int8Linear(self.in_features, len(ids), self.bias is not None)
        out.weight, out.scales = frozen(self.weight[ids]), frozen(self.scales[ids])
        if self.bias is not None:
            out.bias = frozen(self.bias[ids])
        return out


# torch's int4 kernels by device: (pack the weights, multiply). Their packed layouts differ, so files hold
# the plain 4-bit values and pack() lays them out on the device the model is loaded on.
INT4_KERNELS = {"cuda": ("_convert_weight_to_int4pack", "_weight_int4pack_mm"),
                "cpu": ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")}


class Int4Linear(nn.Module):
    """Weight-only int4, grouped and asymmetric: w = (q - 8) * scale + zero for q in 0..15, one scale and
    zero per group of groupsize input channels (tinygemm's convention). As stored: weight uint8
    [out, in / 2] (two values a byte, the even input channel in the high nibble), scales and zeros
    [out, in / groupsize]; pack() turns them into the layout of the device's kernel.

    With minimums (a GGUF file's Q4_0 / Q4_1 / Q4_K, as llama.cpp computes them): w = q * scale + minimum, the
    file's fp16 (or exact fp32) scales and minimums kept as they are. In fp32 that is the file's weight exactly.
    The zero the kernels take, 8 * scale + minimum, is worked out in pack() in fp32 from the file's values (kept
    as loaded in file_values, a plain attribute that the model's .to(dtype) does not round) and rounds once, to
    the kernel's dtype."""

    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False,
                 minimums: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.weight = frozen(torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.scales = frozen(torch.empty(out_features, in_features // groupsize, dtype=torch.bfloat16))
        offsets = frozen(torch.empty(out_features, in_features // groupsize, dtype=torch.bfloat16))
        self.zeros, self.minimums = (None, offsets) if minimums else (offsets, None)
        self.bias = frozen(torch.empty(out_features)) if bias else None
        self.file_values: Optional[tuple] = None  # (scales, minimums) as use_quantized_linears found them
        self.packed_for: Optional[str] = None

    def dequantize(self) -> Tensor:
        """The weight [out, in] as floats in the scales' dtype (before pack()): (q - 8) * scale + zero, or
        q * scale + minimum (q * scale is exact in fp32, so only the sum rounds, as in llama.cpp)."""
        values = torch.stack([self.weight >> 4, self.weight & 15], dim=-1).view(self.out_features, -1)
        if self.minimums is not None:
            scales, minimums = (t.repeat_interleave(self.groupsize, dim=1) for t in (self.scales, self.minimums))
            return values.to(scales.dtype) * scales + minimums
        scales, zeros = (t.repeat_interleave(self.groupsize, dim=1) for t in (self.scales, self.zeros))
        return (values.to(scales.dtype) - 8) * scales + zeros

    def kernel_zeros(self) -> Tensor:
        """The value at q = 8 of each group, as torch's int4 kernels take it."""
        if self.minimums is None:
            return self.zeros
        scales, minimums = self.file_values or (self.scales, self.minimums)
        return (8 * scales.float() + minimums.float()).to(self.scales.device)

    def pack(self):
        device = self.weight.device.type
        if device == "cpu" and self.scales.dtype == torch.float32:
            # fp32 activations on a CPU: torch's int4 kernel is vectorized for bf16 only, and its fp32 scalar loop
            # ran 20x slower than the same weights as floats (BENCHMARKS.md). So the weight is kept dequantized:
            # exact, since (q - 8) times a bf16 scale (q times an fp16 one) is exact in fp32 and the zero (the
            # minimum) is added with one rounding, as the kernel (llama.cpp) does.
            self.weight = frozen(self.dequantize())
            del self.scales, self.zeros, self.minimums
            self.file_values, self.packed_for = None, "cpu, dequantized"
            return
        convert, _ = int4_kernel(device)
        if device == "cuda" and torch.cuda.get_device_capability(self.weight.device) < (8, 0):
            raise EagletError(f"int4 runs on tinygemm, which needs an Ampere or newer GPU (compute capability 8.0); "
                              f"{torch.cuda.get_device_name(self.weight.device)} is older: use int8")
        if device == "cuda":  # tinygemm: bf16 scales and zeros; inner k-tiles as wide as the width allows
            inner_k_tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            packed, dtype = convert(self.weight.contiguous(), inner_k_tiles), torch.bfloat16
        else:  # the CPU kernel takes one int32 per value, and scales in the activations' dtype
            values = torch.stack([self.weight >> 4, self.weight & 15], dim=-1).view(self.out_features, -1)
            packed, dtype = convert(values.to(torch.int32).contiguous(), 1), self.scales.dtype
        zeros = self.kernel_zeros()
        self.scales_and_zeros = frozen(torch.stack([self.scales.t().to(zeros.dtype), zeros.t()], dim=-1).to(dtype)
                                       .contiguous())
        self.weight = frozen(packed)
        del self.scales, self.zeros, self.minimums
        self.file_values, self.packed_for = None, device

    def forward(self, x: Tensor) -> Tensor:
        if self.packed_for == "cpu, dequantized" and x.device.type == "cpu":
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        if self.packed_for != x.device.type:
            raise EagletError(f"int4 weights packed for {self.packed_for} got input on {x.device.type}: "
                              "load the model on the device it runs on")
        _, matmul = int4_kernel(self.packed_for)
        if self.packed_for == "cuda":  # tinygemm multiplies bf16 only
            x2d = x.reshape(-1, self.in_features)
            y = matmul(x2d.to(torch.bfloat16).contiguous(), self.weight, self.groupsize,
                       self.scales_and_zeros.to(torch.bfloat16)).to(x.dtype)
        else:  # vectorized for bf16 activations; fp32 runs the kernel's scalar loop (exact, several times slower)
            x2d = kernel_rows(x, self.in_features)
            y = matmul(x2d, self.weight, self.groupsize, self.scales_and_zeros.to(x.dtype))
        return with_bias(y.view(*x.shape[:-1], self.out_features), self.bias)


def cpu_kernel_takes(x: Tensor, in_features: int) -> bool:
    """Whether torch's CPU int8 kernel (_weight_int8pack_mm) runs this input fast and right. On x86 it is
    vectorized for bf16 only (fp32 runs a scalar loop, at the verify's rows far slower than dequantizing the
    weight), and its vector loop has no tail: it reads 16 input channels a step (AVX-512; 8 on AVX2) and
    ignores the rest."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and in_features % 16 == 0


def kernel_rows(x: Tensor, in_features: int) -> Tensor:
    """x as the contiguous [rows, in_features] matrix torch's CPU kernels take. The int8 kernel loads it with
    aligned vector loads (a misaligned row crashes the process, not an error), so an eager view that starts
    off a 32-byte boundary of its (64-byte aligned) storage is copied; rows of 16 bf16 channels keep the
    alignment. Compiled code cannot read a storage offset: there a Linear's input is one of inductor's
    buffers (64-byte aligned) or whole rows of one."""
    x2d = x.reshape(-1, in_features).contiguous()
    if torch.compiler.is_compiling() or (x2d.storage_offset() * x2d.element_size()) % 32 == 0:
        return x2d
    return x2d.clone()


def with_bias(y: Tensor, bias: Optional[Tensor]) -> Tensor:
    return y if bias is None else y + bias


def frozen(t: Tensor) -> nn.Parameter:
    """A parameter that is never trained: quantized weights are integers, which cannot carry gradients."""
    return nn.Parameter(t, requires_grad=False)


def int4_kernel(device: str):
    if device not in INT4_KERNELS:
        raise EagletError(f"int4 runs on CUDA and CPU only, not on {device}: use int8")
    ops = [getattr(torch.ops.aten, name, None) for name in INT4_KERNELS[device]]
    if None in ops:
        raise EagletError(f"this torch ({torch.__version__}) has no int4 kernel for {device} "
                          f"({' and '.join(INT4_KERNELS[device])}): int4 needs torch >= 2.6")
    return ops


def use_quantized_linears(module: nn.Module, state_dict: dict):
    """Replace each nn.Linear that the state dict holds quantized (it has NAME.scales) by an Int8Linear, or an
    Int4Linear if it also has NAME.zeros (or NAME.minimums), ready for load_state_dict(assign=True). Call on the
    meta device."""
    for name, linear in list(module.named_modules()):
        scales = state_dict.get(f"{name}.scales")
        if not isinstance(linear, nn.Linear) or scales is None:
            continue
        bias, weight = linear.bias is not None, state_dict.get(f"{name}.weight")
        int4 = f"{name}.zeros" in state_dict or f"{name}.minimums" in state_dict
        stored = torch.uint8 if int4 else torch.int8
        if weight is None or weight.dtype != stored:
            raise EagletError(f"{name}: a quantized layer's weight must be {stored}, not "
                              f"{'missing' if weight is None else weight.dtype} (a damaged file?)")
        if int4:
            n_groups = scales.shape[-1] if scales.ndim == 2 and scales.shape[-1] else 0
            groupsize = linear.in_features // n_groups if n_groups else 0
            if groupsize not in (32, 64, 128, 256) or groupsize * n_groups != linear.in_features:
                raise EagletError(f"{name}: {tuple(scales.shape)} int4 scales do not make groups of 32, 64, 128 or "
                                  f"256 of its {linear.in_features} input channels (a damaged file?)")
            minimums = state_dict.get(f"{name}.minimums")
            new = Int4Linear(linear.in_features, linear.out_features, groupsize, bias, minimums is not None)
            new.file_values = (scales, minimums) if minimums is not None else None
        else:
            new = Int8Linear(linear.in_features, linear.out_features, bias)
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, new)


def pack_quantized(module: nn.Module):
    """Lay out every Int4Linear's weights for the device the module is on (after .to(device))."""
    for m in module.modules():
        if isinstance(m, Int4Linear) and m.packed_for is None:
            m.pack()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one forward over one token reads: every weight once (shared tensors, e.g. tied
    embeddings, once; quantized ones as they are read: values, scales and zeros), but only one row of an embedding
    table that is not also an lm_head."""
    sizes = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    linear = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding) and m.weight.data_ptr() not in linear:
            sizes[m.weight.data_ptr()] = m.weight[0].numel() * m.weight.element_size()
    return sum(sizes.values())


def weights_format(module: torch.nn.Module) -> str:
    """How a model's weights are stored: 'int4 g128, lm_head int8', 'int8', or the dtype of float weights."""
    int4 = [m for m in module.modules() if isinstance(m, Int4Linear)]
    int8 = any(isinstance(m, Int8Linear) for m in module.modules())
    if int4:
        return f"int4 g{int4[0].groupsize}" + (", lm_head int8" if int8 else "")
    if int8:
        return "int8"
    return str(next(module.parameters()).dtype).removeprefix("torch.")


def pop_quantization(state_dict: dict, path) -> Optional[dict]:
    """What a quantized file holds (mode, groupsize, ...), taken out of its state dict; None if not quantized."""
    record = state_dict.pop(QUANT_KEY, None)
    if record is None:
        return None
    if not isinstance(record, dict) or type(record.get("format_version")) is not int:
        raise EagletError(f"{path}: its quantization record is damaged: {record!r}"[:300])
    if record["format_version"] > QUANT_FORMAT_VERSION:
        raise EagletError(f"{path} was quantized in format version {record['format_version']}, newer than this "
                          f"eaglet reads ({QUANT_FORMAT_VERSION}): update eaglet, or quantize again with this one")
    return record


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


def quantization_record(mode: str, groupsize: int, source: str, format_version: int = 1) -> dict:
    return {"format_version": format_version, "mode": mode, "groupsize": groupsize if mode == "int4" else 0,
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
    if checkpoint_path.is_dir():  # a converted folder: its one target checkpoint, or a head folder's draft.pth
        is_head = not converted_files(checkpoint_path, "model.pth") and converted_files(checkpoint_path, "draft.pth")
        name = "draft.pth" if is_head else "model.pth"
        # quantized files beside the unquantized one came from it: that one is the input
        plain = checkpoint_path / name
        checkpoint_path = plain if plain.is_file() else converted_file(checkpoint_path, name)
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
    written = out_path.stat().st_size
    unit, scale = ("GB", 1e9) if max(source_bytes, written) >= 1e9 else ("MB", 1e6)  # a head's few MB shown too
    log(f"{source_bytes / scale:.3f} {unit} -> {written / scale:.3f} {unit}")
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
