"""A Hub 4-bit target read as quantize.py's int4 file (model_int4.g<N>.pth) for convert_hf_checkpoint.py: AWQ's GEMM
layout, GPTQ and compressed-tensors' pack-quantized, their quantization_config checked before any weight is read,
each Linear's 4-bit integers carried over exactly into Int4Linear's form, the scales and zeros rounded to bf16 (the
largest change it makes reported), the lm_head in int8. Also the int4 width check a GGUF file's 4-bit Linears meet.

Imports checkpoint.py, model.py, quantize.py, cli.py and convert_common.py; convert_gguf.py and
convert_hf_checkpoint.py import it.
"""
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from cli import Progress
from checkpoint import QUANT_KEY, EagletError
from model import ModelArgs
from quantize import GROUPSIZES, pack_int4, quantization_record, quantize_group, spill
from convert_common import LAYER_LINEARS, convert_layer


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
