"""4-bit checkpoints from the Hub (AutoAWQ's GEMM layout, GPTQ in its gptq and gptq_v2 zero-point conventions,
compressed-tensors' pack-quantized, symmetric and asymmetric) converted by convert_hf_checkpoint.py into
quantize.py's int4 file. Each format is written here as its writer lays it out, from the format's description
and not from the converter, so that an unpacking bug cannot cancel itself out. Checked: the converted values
against the format's own formula w = (q - z) * s; on integer weights where quantize.py finds the same q, z
and s, the very file quantize.py writes; logits against transformers holding the dequantized weights; greedy
speculative decoding equal to plain decoding on converted targets; each refusal as one error line."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode import generate
from sampling import SamplingConfig
from attention import causal_mask
import model as model_module
import quantize
from conftest import expect_error, make_agreeing_eagle3_pair, make_agreeing_pair, write_tokenizer
from convert_common import export_layer
from convert_hf_checkpoint import convert
from convert_hf_checkpoint import main as convert_main
from load import load_draft, load_target
from model import QUANT_KEY, ModelArgs, read_config
from test_quantize import dequantize, prompts

GREEDY = SamplingConfig()
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
AWQ_SLOTS = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: an int32's 4-bit slot j holds column 8k + AWQ_SLOTS[j]
IN_ORDER = tuple(range(8))
SYMMETRIC = {"awq": False, "gptq": True, "gptq_asym": False, "gptq_v2": False, "ct_sym": True, "ct_asym": False}


# The formats' writers: integers q [out, in] and z [out, groups] in 0..15, scales s [out, groups].

def int32_words(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 tensors the formats store: the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, slots) -> torch.Tensor:
    """[rows, 8 n] values 0..15 -> int32 [rows, n]: bits 4j..4j+3 of word k hold value 8k + slots[j]."""
    assert values.min() >= 0 and values.max() <= 15
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for j, column in enumerate(slots):
        words |= values[:, column::8].long() << (4 * j)
    return int32_words(words)


def awq_tensors(q, z, s):
    """AutoAWQ GEMM: qweight [in, out / 8], qzeros [in / group, out / 8], both eight output columns a word in
    AWQ's interleaved order; scales fp16 [in / group, out]."""
    return {"qweight": pack_rows(q.T, AWQ_SLOTS), "qzeros": pack_rows(z.T, AWQ_SLOTS), "scales": s.T.contiguous()}


def gptq_tensors(q, z, s, v2):
    """GPTQ: qweight [in / 8, out], eight input channels a word, the first lowest; qzeros [in / group,
    out / 8], eight output columns a word, holding z - 1 (the gptq format) or z (gptq_v2); scales
    [in / group, out]; g_idx, each input channel's group."""
    stored = z.long() if v2 else z.long() - 1
    groupsize = q.shape[1] // z.shape[1]
    return {"qweight": pack_rows(q, IN_ORDER).T.contiguous(), "qzeros": pack_rows(stored.T, IN_ORDER),
            "scales": s.T.contiguous(), "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // groupsize}


def ct_tensors(q, z, s, symmetric):
    """compressed-tensors pack-quantized: the signed values q - 8 are stored offset by 8 (so as q), eight
    input channels a word, the first lowest: weight_packed [out, in / 8]; weight_scale [out, groups];
    weight_shape; asymmetric only, the zero points packed the same way along the OUTPUT dimension:
    weight_zero_point [out / 8, groups]."""
    out = {"weight_packed": pack_rows(q, IN_ORDER), "weight_scale": s.contiguous(),
           "weight_shape": torch.tensor(q.shape)}
    if not symmetric:
        out["weight_zero_point"] = pack_rows(z.T, IN_ORDER).T.contiguous()
    return out


WRITERS = {"awq": awq_tensors, "gptq": lambda q, z, s: gptq_tensors(q, z, s, False),
           "gptq_asym": lambda q, z, s: gptq_tensors(q, z, s, False),
           "gptq_v2": lambda q, z, s: gptq_tensors(q, z, s, True),
           "ct_sym": lambda q, z, s: ct_tensors(q, z, s, True), "ct_asym": lambda q, z, s: ct_tensors(q, z, s, False)}


def quantization_config(fmt: str, groupsize: int) -> dict:
    """config.json's quantization_config as each library writes it: gptq is the gptq checkpoint format,
    symmetric (z = 8, stored 7); gptq_asym the same format asymmetric (z - 1 stored); gptq_v2 asymmetric (z)."""
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": groupsize, "version": "gemm", "zero_point": True,
                "modules_to_not_convert": None}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": groupsize, "desc_act": False, "sym": SYMMETRIC[fmt],
                "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
                "checkpoint_format": "gptq_v2" if fmt == "gptq_v2" else "gptq"}
    weights = {"num_bits": 4, "type": "int", "symmetric": fmt == "ct_sym", "strategy": "group",
               "group_size": groupsize, "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}


def round_to_grid(w: torch.Tensor, groupsize: int, symmetric: bool, scale_dtype=torch.float16):
    """Round-to-nearest 4-bit per group as the writers quantize (their error searches aside): asymmetric from
    the group's range with an integer zero point, or symmetric around z = 8."""
    groups = w.float().unflatten(1, (-1, groupsize))
    if symmetric:
        s = (groups.abs().amax(-1) / 7.5).clamp(min=1e-6).to(scale_dtype)
        z = torch.full(s.shape, 8)
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        s = ((high - low) / 15).clamp(min=1e-6).to(scale_dtype)
        z = (-low / s.float()).round().clamp(1, 15).long()  # 1 and up: gptq's z - 1 must not go below 0
    q = (groups / s.float()[..., None] + z[..., None]).round().clamp(0, 15)
    return q.flatten(1).to(torch.uint8), z.to(torch.uint8), s


def on_grid(shape, groupsize: int, symmetric: bool, g: torch.Generator):
    """Integers and power-of-two scales on which quantize.py finds the same q, z and s: each group holds a 0
    and a 15, so its minimum and maximum are -z s and (15 - z) s, exact in fp16 and bf16."""
    out_features, in_features = shape
    q = torch.randint(0, 16, (out_features, in_features // groupsize, groupsize), generator=g)
    q[..., 3], q[..., groupsize - 2] = 0, 15
    groups = (out_features, in_features // groupsize)
    z = torch.full(groups, 8) if symmetric else torch.randint(1, 16, groups, generator=g)
    s = (2.0 ** -torch.randint(4, 9, groups, generator=g).float()).half()
    return q.flatten(1).to(torch.uint8), z.to(torch.uint8), s


def formula(q, z, s) -> torch.Tensor:
    """The format's weight, w = (q - z) * s, in fp32 (exact for fp16 or bf16 s)."""
    groupsize = q.shape[1] // z.shape[1]
    return (q.float() - z.float().repeat_interleave(groupsize, 1)) * s.float().repeat_interleave(groupsize, 1)


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and any(name.endswith(f".{m}.weight") for m in LINEARS)


def write_folder(dst, config: dict, tensors: dict, shards: int):
    """config.json, tokenizer-free, and the tensors in one safetensors file or `shards` with their index."""
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(dst / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in names[i::shards]}, str(dst / shard))
        weight_map.update({k: shard for k in names[i::shards]})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_hub(dst, src, fmt: str, groupsize: int, values, shards: int = 1, dense_dst=None) -> dict:
    """The float Hugging Face folder src rewritten into dst as a Hub checkpoint of format fmt: each decoder
    Linear is values(weight) -> (q, z, s), packed by the format's writer; the rest in fp16 as published.
    dense_dst: the same model with (q - z) * s as plain fp16 weights. Returns {module: (q, z, s)}."""
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    config = {**json.loads((src / "config.json").read_text()), "torch_dtype": "float16"}
    packed, dense, grids = {}, {}, {}
    for name, t in weights.items():
        if not is_linear(name):
            packed[name] = dense[name] = t.half()
            continue
        module = name.removesuffix(".weight")
        grids[module] = values(t)
        packed.update({f"{module}.{k}": v for k, v in WRITERS[fmt](*grids[module]).items()})
        dense[name] = formula(*grids[module]).half()
    write_folder(dst, {**config, "quantization_config": quantization_config(fmt, groupsize)}, packed, shards)
    if dense_dst is not None:
        write_folder(dense_dst, config, dense, 1)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    return grids


def converted(folder) -> tuple:
    """A Hub folder converted: (the int4 file written beside it, nothing else left there; what was printed)."""
    lines = []
    convert(folder, log=lines.append)
    written = sorted(folder.glob("model_int4.g*.pth"))
    assert len(written) == 1 and not list(folder.glob(".eaglet-*")), written
    return written[0], "\n".join(lines)


def by_module(path, args: ModelArgs) -> tuple:
    """Our file dequantized by its definition (test_quantize.dequantize): its decoder Linears under Hugging Face
    module names, and the whole state dict."""
    sd = dequantize(torch.load(path, weights_only=True))
    out = {}
    for i in range(args.n_layer):
        out.update(export_layer(sd, f"layers.{i}.", f"model.layers.{i}.", args))
    return {k.removesuffix(".weight"): v for k, v in out.items() if is_linear(k)}, sd


def transformers_twin(src, grids: dict, lm_head: torch.Tensor):
    """transformers' model of src holding each Linear as the format defines it, (q - z) * s, and our int8
    lm_head dequantized (quantize.py's, checked in test_quantize.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).eval()
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update({k: v.half().float() for k, v in load_file(str(f)).items()})  # fp16, as the Hub file
    weights.update({f"{m}.weight": formula(*grid) for m, grid in grids.items()})
    weights["lm_head.weight"] = lm_head.float()
    hf.config.tie_word_embeddings = False
    hf.lm_head.weight = torch.nn.Parameter(weights.pop("lm_head.weight"))
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in k or "rotary" in k for k in missing), (missing, unexpected)
    return hf


def logits_of(path, hf):
    model = load_target(path, "cpu", "fp32", 64)
    tokens = torch.tensor([[1, 17, 5, 88, 42, 9, 63, 2, 30]]) % model.args.vocab_size
    pos = torch.arange(tokens.shape[1])
    with torch.no_grad():
        ours, _ = model(tokens, pos, pos, causal_mask(pos, tokens.shape[1]))
        return ours, hf(tokens).logits


def largest_row_error(grids: dict, ours: dict) -> float:
    """max over Linears and rows of max |ours - w| / max |w|, w = (q - z) * s: the figure the converter prints."""
    worst = 0.0
    for module, grid in grids.items():
        w = formula(*grid)
        worst = max(worst, ((ours[module] - w).abs().amax(1) / w.abs().amax(1)).max().item())
    return worst


# (format, model kind, group size, shards): every format on GQA, a tied embedding with q/k/v biases, sharded
REAL = [("awq", "llama31", 32, 1), ("gptq", "qwen2", 32, 2), ("gptq_v2", "llama31", 32, 1),
        ("ct_sym", "llama31", 32, 2), ("ct_asym", "qwen2", 32, 1)]


@pytest.mark.parametrize("fmt,kind,groupsize,shards", REAL, ids=[r[0] for r in REAL])
def test_converted_weights_follow_the_formats_formula(checkpoints, tmp_path, fmt, kind, groupsize, shards):
    """Weights quantized as the writers do, scales in fp16 (in bf16 for compressed-tensors, to cover both):
    ours are (q - 8) * bf16(s) + bf16((8 - z) * s) exactly, so the integers and groups carried over; the
    printed figure is the largest change; logits follow transformers on (q - z) * s."""
    src, _ = checkpoints(kind)
    scale_dtype = torch.bfloat16 if fmt.startswith("ct") else torch.float16

    def values(w):
        return round_to_grid(w, groupsize, SYMMETRIC[fmt], scale_dtype)
    grids = write_hub(tmp_path / fmt, src, fmt, groupsize, values, shards)
    path, log = converted(tmp_path / fmt)
    assert path.name == f"model_int4.g{groupsize}.pth" and log.count("converting ") == 2  # a line per layer
    stored = torch.load(path, weights_only=True)
    assert stored[QUANT_KEY]["mode"] == "int4" and stored[QUANT_KEY]["groupsize"] == groupsize
    assert stored[QUANT_KEY]["lm_head"] == "int8" and stored["output.scales"].dtype == torch.bfloat16
    args = ModelArgs.from_hf_config(read_config(src))
    ours, sd = by_module(path, args)
    for module, (q, z, s) in grids.items():
        step = s.float().to(torch.bfloat16).float().repeat_interleave(groupsize, 1)
        zero = ((8 - z.float()) * s.float()).to(torch.bfloat16).float().repeat_interleave(groupsize, 1)
        assert torch.equal(ours[module], (q.float() - 8) * step + zero), module
    error = largest_row_error(grids, ours)
    printed = re.search(r"change from the scales and zeros in bf16 is ([0-9.]+)% of its row's largest", log)
    assert abs(float(printed.group(1)) - 100 * error) < 0.0015, (printed.group(0), error)
    assert error < (1e-7 if fmt == "ct_sym" else 5e-3)  # a bf16 scale of a bf16 model, and zero 0: exact
    print(f"{fmt}: largest weight change {100 * error:.3f}% of its row's largest weight")
    ours_logits, want = logits_of(path, transformers_twin(src, grids, sd["output.weight"]))
    assert (ours_logits - want).abs().max() < (1e-4 if fmt == "ct_sym" else 0.02 * want.abs().max())


# (format, model kind, group size): shapes where quantize.py's min/max rounding finds the integers again
GRID = [("awq", "llama31", 32), ("gptq", "llama2", 32), ("gptq_v2", "qwen2", 32), ("ct_sym", "wide", 128),
        ("ct_asym", "wide", 64)]


def wide_checkpoint(path):
    """A LLaMA 128 wide and 256 inside, for group sizes 64 and 128."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(path)
    write_tokenizer(path)
    return path


@pytest.mark.parametrize("fmt,kind,groupsize", GRID, ids=[g[0] for g in GRID])
def test_same_file_as_quantize_py_on_the_same_integers(checkpoints, tmp_path, fmt, kind, groupsize):
    """Every group holds a 0 and a 15 and the scales are powers of two, so quantize.py, given the dense model,
    finds the same q, scale and zero: the converted file is tensor for tensor quantize.py's, its greedy output
    the same, and its logits transformers' on (q - z) * s."""
    src = wide_checkpoint(tmp_path / "wide") if kind == "wide" else checkpoints(kind)[0]
    g = torch.Generator().manual_seed(1)
    grids = write_hub(tmp_path / "hub", src, fmt, groupsize,
                      lambda w: on_grid(w.shape, groupsize, SYMMETRIC[fmt], g), dense_dst=tmp_path / "dense")
    ours, _ = converted(tmp_path / "hub")
    convert(tmp_path / "dense", log=lambda *_: None)
    theirs = quantize.quantize_checkpoint(tmp_path / "dense" / "model.pth", "int4", groupsize, log=lambda *_: None)
    a, b = torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)
    record, their_record = a.pop(QUANT_KEY), b.pop(QUANT_KEY)
    assert record == {**their_record, "source": record["source"]} and record["source"] != their_record["source"]
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    targets = [load_target(p, "cpu", "fp32", 64) for p in (ours, theirs)]
    for prompt in prompts(96, 2, seed=3):
        assert generate(targets[0], prompt, 12, GREEDY).tokens == \
            generate(targets[1], prompt, 12, GREEDY).tokens
    _, sd = by_module(ours, ModelArgs.from_hf_config(read_config(src)))
    ours_logits, want = logits_of(ours, transformers_twin(src, grids, sd["output.weight"]))
    assert (ours_logits - want).abs().max() < 1e-4


def varied_zeros(shape, groupsize: int, g: torch.Generator):
    """Random q; zero points 1..15 drawn per group and output column (gptq's stored z - 1 stays in 0..14);
    fp16 scales that bf16 rounds, as are (8 - z) s."""
    out_features, in_features = shape
    groups = (out_features, in_features // groupsize)
    q = torch.randint(0, 16, shape, generator=g)
    z = torch.randint(1, 16, groups, generator=g)
    s = (0.001 + 0.02 * torch.rand(groups, generator=g)).half()
    return q.to(torch.uint8), z.to(torch.uint8), s


def int4_weight(q, z, s) -> torch.Tensor:
    """(q - 8) * bf16(s) + bf16((8 - z) s): w = (q - z) * s as the int4 file holds it."""
    groupsize = q.shape[1] // z.shape[1]
    step = s.float().to(torch.bfloat16).float().repeat_interleave(groupsize, 1)
    zero = ((8 - z.float()) * s.float()).to(torch.bfloat16).float().repeat_interleave(groupsize, 1)
    return (q.float() - 8) * step + zero


# (format, what its qzeros hold less z, the format its file would be mistaken for)
GPTQ_ZEROS = [("gptq_asym", -1, "gptq_v2"), ("gptq_v2", 0, "gptq")]


@pytest.mark.parametrize("fmt,stored,other", GPTQ_ZEROS, ids=[g[0] for g in GPTQ_ZEROS])
def test_asymmetric_gptq_zero_points_in_either_convention(checkpoints, tmp_path, fmt, stored, other):
    """Asymmetric GPTQ with zero points varying per group and per output column, written in the gptq format
    (qzeros hold z - 1, sym false) and in gptq_v2 (z): ours are w = (q - z) * s with bf16 scale and zero, and
    differ in every weight from the file read in the other convention (z - 1 taken as z, or z as z - 1),
    which the converter, told the other checkpoint_format, indeed gives."""
    src, _ = checkpoints("llama2")
    g = torch.Generator().manual_seed(7)
    grids = write_hub(tmp_path / fmt, src, fmt, 32, lambda w: varied_zeros(w.shape, 32, g))
    config = json.loads((tmp_path / fmt / "config.json").read_text())["quantization_config"]
    assert config["sym"] is False and config["checkpoint_format"] == ("gptq" if fmt == "gptq_asym" else fmt)
    zs = torch.cat([z.flatten() for _, z, _ in grids.values()])
    assert zs.min() == 1 and zs.max() == 15 and (zs != 8).float().mean() > 0.8
    qzeros = load_file(str(tmp_path / fmt / "model.safetensors"))["model.layers.0.mlp.down_proj.qzeros"]
    _, z, _ = grids["model.layers.0.mlp.down_proj"]
    assert [(int(qzeros[0, 0]) >> 4 * j) & 15 for j in range(8)] == (z[:8, 0].long() + stored).tolist()
    mistaken = tmp_path / other
    shutil.copytree(tmp_path / fmt, mistaken)
    edit_config(checkpoint_format=other)(mistaken)
    args = ModelArgs.from_hf_config(read_config(src))
    ours, _ = by_module(converted(tmp_path / fmt)[0], args)
    misread, _ = by_module(converted(mistaken)[0], args)
    shift = -1 if fmt == "gptq_asym" else 1  # z - 1 read as z, or z read as z - 1
    for module, (q, z, s) in grids.items():
        assert (z.diff(dim=0) != 0).any() and (z.diff(dim=1) != 0).any(), module
        assert torch.equal(ours[module], int4_weight(q, z, s)), module
        wrong = int4_weight(q, z.long() + shift, s)
        assert (ours[module] != wrong).all(), module
        assert torch.equal(misread[module], wrong), module


@pytest.fixture(scope="module")
def hub_pairs(tmp_path_factory):
    """(format, head kind) -> (converted target, converted head): the agreeing pairs' targets rewritten in each
    format with group size 64, the heads converted as published."""
    pairs = {}
    target, head, _ = make_agreeing_pair(tmp_path_factory.mktemp("hub_eagle"), wrong_fraction=0.3)
    target3, head3 = make_agreeing_eagle3_pair(tmp_path_factory.mktemp("hub_eagle3"), missing=8)
    for path in (head, head3):
        convert(path, log=lambda *_: None)
    for fmt in ("awq", "gptq", "ct_asym"):
        for kind, t, h in (("eagle", target, head), ("eagle3", target3, head3)):
            dst = tmp_path_factory.mktemp(f"{fmt}_{kind}") / "target"
            write_hub(dst, t, fmt, 64, lambda w: round_to_grid(w, 64, SYMMETRIC[fmt]), shards=2)
            pairs[fmt, kind] = (converted(dst)[0], h / "draft.pth")
    return pairs


# One layout decodes in the fast tier; every layout's conversion is checked weight by weight above.
SPECULATIVE = [("awq", "eagle")] + \
    [pytest.param(fmt, head, marks=pytest.mark.slow) for fmt, head in [("gptq", "eagle3"), ("ct_asym", "eagle"),
                                                                       ("awq", "eagle3"), ("gptq", "eagle"),
                                                                       ("ct_asym", "eagle3")]]


@pytest.mark.parametrize("fmt,head", SPECULATIVE)
def test_greedy_speculative_equals_plain_on_converted_target(hub_pairs, request, fmt, head):
    target_path, head_path = hub_pairs[fmt, head]
    model = load_target(target_path, "cpu", "fp32", 256)
    draft = load_draft(head_path, model)
    slow = any(m.name == "slow" for m in request.node.iter_markers())
    lengths = []
    for prompt in prompts(model.args.vocab_size, 6 if slow else 3):
        plain = generate(model, prompt, 40, GREEDY)
        spec = generate(model, prompt, 40, GREEDY, draft=draft)
        assert spec.tokens == plain.tokens
        lengths += spec.accept_lengths
    print(f"{fmt} {head}: tau {sum(lengths) / len(lengths):.2f}, lengths {sorted(set(lengths))}")
    assert sum(lengths) / len(lengths) >= 2 and len(set(lengths)) >= 3  # deep, varied paths through the verify


def test_act_order_with_contiguous_groups_converts_and_zero_biases_go(checkpoints, tmp_path):
    """desc_act true whose g_idx is i // group (static groups) runs as is; the all-zero bias AutoGPTQ gives
    every Linear of a model without biases is dropped; a real bias (Qwen2's q/k/v) is kept."""
    src, _ = checkpoints("llama2")
    write_hub(tmp_path / "hub", src, "gptq", 32, lambda w: round_to_grid(w, 32, True))
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    config["quantization_config"].update(desc_act=True, static_groups=True)
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "hub" / "model.safetensors"))
    for name in [k for k in tensors if k.endswith(".qweight")]:
        tensors[name.replace(".qweight", ".bias")] = torch.zeros(tensors[name].shape[1], dtype=torch.float16)
    save_file(tensors, str(tmp_path / "hub" / "model.safetensors"))
    path, _ = converted(tmp_path / "hub")
    assert not [k for k in torch.load(path, weights_only=True) if k.endswith(".bias")]
    load_target(path, "cpu", "fp32", 64)
    qwen, _ = checkpoints("qwen2")
    write_hub(tmp_path / "qwen", qwen, "gptq", 32, lambda w: round_to_grid(w, 32, True))
    stored = torch.load(converted(tmp_path / "qwen")[0], weights_only=True)
    want = torch.cat([load_file(str(qwen / "model.safetensors"))[f"model.layers.1.self_attn.{p}_proj.bias"]
                      for p in "qkv"]).half()
    assert torch.equal(stored["layers.1.attention.wqkv.bias"], want)


def test_compressed_tensors_packing_as_the_library_documents():
    """The test's own writer against values compressed-tensors publishes for its packer: signed 4-bit
    [1, 2, 3, 4] is one word 52137 (9, 10, 11, 12 from the lowest bits up), [-8 .. -1] is 0x76543210."""
    signed = torch.tensor([1, 2, 3, 4])
    assert pack_rows(torch.cat([signed + 8, torch.zeros(4, dtype=torch.long)])[None], IN_ORDER).tolist() == [[52137]]
    assert pack_rows(torch.arange(8)[None], IN_ORDER).tolist() == [[0x76543210]]
    ct = pytest.importorskip("compressed_tensors.compressors.quantized_compressors.pack_quantized")
    q = torch.randint(0, 16, (16, 64))
    assert torch.equal(ct.unpack_from_int32(pack_rows(q, IN_ORDER), 4, q.shape).long() + 8, q)


def edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def edit_tensors(change):
    def edit(folder):
        tensors = load_file(str(folder / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    return edit


def shuffle_g_idx(t):
    t["model.layers.1.mlp.up_proj.g_idx"] = t["model.layers.1.mlp.up_proj.g_idx"].flip(0).contiguous()


def unpack_q_proj(t):
    t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 64, dtype=torch.float16)
    for part in ("qweight", "qzeros", "scales", "g_idx"):
        del t[f"model.layers.0.self_attn.q_proj.{part}"]


def quantize_lm_head(t):
    t["lm_head.qweight"] = t.pop("model.layers.0.mlp.up_proj.qweight")


# mistake: (format of the folder, its edit, what the one error line must say)
MISTAKES = {
    "bitsandbytes": ("awq", edit_config(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
    "fp8": ("awq", edit_config(quant_method="fp8"), "quant_method 'fp8'"),
    "exl2": ("awq", edit_config(quant_method="exl2"), "quant_method 'exl2'"),
    "gguf": ("awq", edit_config(quant_method="gguf"), "quant_method 'gguf'"),
    "3-bit awq": ("awq", edit_config(bits=3), "awq: 3-bit weights"),
    "8-bit gptq": ("gptq", edit_config(bits=8), "gptq: 8-bit weights"),
    "per-channel gptq": ("gptq", edit_config(group_size=-1), "per-channel scales (group_size -1)"),
    "group size 16": ("awq", edit_config(group_size=16), "group_size 16"),
    "awq gemv": ("awq", edit_config(version="gemv"), "awq version 'gemv'"),
    "awq without zero points": ("awq", edit_config(zero_point=False), "without zero points"),
    "gptq marlin": ("gptq", edit_config(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    "gptq is_marlin_format": ("gptq", edit_config(is_marlin_format=True), "checkpoint_format 'marlin'"),
    "gptq dynamic": ("gptq", edit_config(dynamic={"+:.*down.*": {"bits": 8}}), "per-module overrides"),
    "compressed-tensors 8-bit int": ("ct_sym", edit_config(format="int-quantized"), "format 'int-quantized'"),
    "compressed-tensors channel": ("ct_sym", edit_config(config_groups={"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}),
        "strategy 'channel'"),
    "compressed-tensors activations": ("ct_sym", edit_config(config_groups={"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32, "strategy": "group"},
        "input_activations": {"num_bits": 8}}}), "quantizes activations too"),
    "group size not dividing a width": ("awq", edit_config(group_size=64),
                                        "group size 64 does not divide the input width 96 of mlp.down_proj"),
    "qzeros missing": ("awq", edit_tensors(lambda t: t.pop("model.layers.1.mlp.down_proj.qzeros")),
                       "model.layers.1.mlp.down_proj.qzeros is missing"),
    "awq tensors under a gptq config": ("awq", edit_config(quant_method="gptq"),
                                        "model.layers.0.self_attn.q_proj.qweight is int32 (64, 8), but gptq"),
    "scales of the wrong shape": ("ct_asym", edit_tensors(lambda t: t.update({
        "model.layers.0.mlp.up_proj.weight_scale": t["model.layers.0.mlp.up_proj.weight_scale"][:, :1].contiguous()})),
        "model.layers.0.mlp.up_proj.weight_scale is bfloat16 (96, 1)"),
    "act-order": ("gptq", edit_tensors(shuffle_g_idx), "model.layers.1.mlp.up_proj.g_idx: act-order puts"),
    "q_proj left unquantized, k and v not": ("gptq", edit_tensors(unpack_q_proj),
                                             "q_proj is not quantized but model.layers.0.self_attn.k_proj is"),
    "quantized lm_head": ("gptq", edit_tensors(quantize_lm_head), "its lm_head is quantized (lm_head.qweight)"),
    "symmetric with zero points": ("ct_sym", edit_tensors(lambda t: t.update({
        "model.layers.0.self_attn.o_proj.weight_zero_point": torch.ones(64, 2, dtype=torch.int8)})),
        "weight_zero_point is not zero, but its scheme is symmetric"),
}


@pytest.fixture(scope="module")
def hub_folders(checkpoints, tmp_path_factory):
    src, _ = checkpoints("llama2")  # 64 wide, 96 inside: group size 32 only
    root = tmp_path_factory.mktemp("hub_mistakes")
    for fmt in ("awq", "gptq", "ct_sym", "ct_asym"):
        write_hub(root / fmt, src, fmt, 32, lambda w: round_to_grid(w, 32, SYMMETRIC[fmt], torch.bfloat16))
    return root


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_refused_with_one_error_line(hub_folders, tmp_path, mistake):
    fmt, edit, match = MISTAKES[mistake]
    folder = tmp_path / fmt
    shutil.copytree(hub_folders / fmt, folder)
    edit(folder)
    expect_error(["--checkpoint_dir", str(folder)], match, main=convert_main)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in (hub_folders / fmt).iterdir())


def test_an_existing_file_is_replaced_only_with_overwrite(hub_folders, tmp_path, capsys):
    folder = tmp_path / "awq"
    shutil.copytree(hub_folders / "awq", folder)
    convert_main(["--checkpoint_dir", str(folder)])
    assert f"wrote {folder / 'model_int4.g32.pth'}" in capsys.readouterr().out
    (folder / "model_int4.g32.pth").write_bytes(b"the user's own file")
    expect_error(["--checkpoint_dir", str(folder)], "model_int4.g32.pth exists; give --overwrite", main=convert_main)
    assert (folder / "model_int4.g32.pth").read_bytes() == b"the user's own file"
    convert_main(["--checkpoint_dir", str(folder), "--overwrite"])
    assert QUANT_KEY in torch.load(folder / "model_int4.g32.pth", weights_only=True)
