"""Quantized targets and heads (quantize.py): the stored values against the weights they came from, the
quantized Linears against a dequantize-then-matmul reference, the whole model against transformers on the
dequantized weights, and EAGLE on a quantized target lossless against plain decoding of the same target."""
from pathlib import Path

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import generate
import decode
from attention import causal_mask
import model as model_module
import quantize
from conftest import check_compiled_cycle, expect_error, make_agreeing_eagle3_pair, make_agreeing_pair, read_generation
from convert_common import export_layer
from convert_hf_checkpoint import convert
from decode import TreeConfig
from sampling import SamplingConfig
from load import load_draft, load_target
from quantize import Int4Linear, Int8Linear, pack_quantized, use_quantized_linears, weight_bytes
from model import QUANT_KEY, ModelArgs, read_config

GREEDY = SamplingConfig()
MODES = [("int8", 0), ("int4", 32), ("int4", 64)]
MODE_IDS = ["int8", "int4-g32", "int4-g64"]


def quantize_cli(path, mode, groupsize=0, *extra):
    argv = ["--checkpoint_path", str(path), "--mode", mode] + (["--groupsize", str(groupsize)] if groupsize else [])
    quantize.main(argv + list(extra))
    return quantize.output_path(path, mode, groupsize or 128)


def dequantize(state_dict: dict) -> dict:
    """The stored format read back by its definition, independently of model.py: int8 w = q * scale per row;
    int4 w = (q - 8) * scale + zero per group, two values a byte with the even input channel high."""
    out = {k: v for k, v in state_dict.items() if k != QUANT_KEY and not k.endswith((".scales", ".zeros"))}
    for key in [k for k in state_dict if k.endswith(".scales")]:
        name = key.removesuffix(".scales")
        q, scales = state_dict[f"{name}.weight"], state_dict[key].float()
        if f"{name}.zeros" in state_dict:
            values = torch.empty(q.shape[0], 2 * q.shape[1])
            values[:, 0::2], values[:, 1::2] = (q >> 4).float(), (q & 15).float()
            group = values.shape[1] // scales.shape[1]
            zeros = state_dict[f"{name}.zeros"].float()
            scales, zeros = scales.repeat_interleave(group, 1), zeros.repeat_interleave(group, 1)
            out[f"{name}.weight"] = (values - 8) * scales + zeros
        else:
            out[f"{name}.weight"] = q.float() * scales[:, None]
    return out


def hf_twin_of(checkpoint_path, tmp_path):
    """transformers' model holding the dequantized weights of a quantized file, saved in tmp_path."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = read_config(checkpoint_path.parent)
    sd = dequantize(torch.load(checkpoint_path, weights_only=True))
    args = ModelArgs.from_hf_config(config)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).eval()
    weights = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"],
               "lm_head.weight": sd["output.weight"]}
    for i in range(args.n_layer):
        weights.update(export_layer(sd, f"layers.{i}.", f"model.layers.{i}.", args))
    hf.config.tie_word_embeddings = False  # the int8 lm_head is its own copy of the embedding
    hf.lm_head.weight = torch.nn.Parameter(weights.pop("lm_head.weight"))
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in k or "rotary" in k for k in missing), (missing, unexpected)
    hf.save_pretrained(tmp_path)
    return hf


def own_copy(checkpoints, kind: str, tmp_path):
    """The session's converted checkpoint folder of this kind, copied: quantized files written beside its model.pth
    stay out of the shared folder, which other tests give as a folder (of one checkpoint)."""
    import shutil
    return Path(shutil.copytree(checkpoints(kind)[0], tmp_path / f"own_{kind}"))


def quantized_linear(mode: str, groupsize: int, dtype) -> tuple:
    """A 256 -> 96 Linear with a bias, quantized as quantize.py stores it and loaded as model.py loads it:
    (the weight it came from, its stored tensors, the quantized Linear in dtype on the CPU)."""
    torch.manual_seed(0)
    w, bias = torch.randn(96, 256) * 0.05, torch.randn(96)
    names = ["l.weight", "l.scales"] + (["l.zeros"] if mode == "int4" else [])
    stored = dict(zip(names, quantize.quantize_int8(w) if mode == "int8" else quantize.quantize_int4(w, groupsize)))
    holder = torch.nn.Module()
    with torch.device("meta"):
        holder.l = torch.nn.Linear(256, 96)
        use_quantized_linears(holder, stored)
    holder.load_state_dict({**stored, "l.bias": bias}, assign=True)
    holder = holder.to(dtype)
    pack_quantized(holder)
    assert isinstance(holder.l, Int8Linear if mode == "int8" else Int4Linear)
    return w, stored, holder.l


@pytest.mark.parametrize("mode,groupsize", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_linear_equals_dequantize_then_matmul(mode, groupsize, dtype):
    w, stored, linear = quantized_linear(mode, groupsize, dtype)
    deq, bias = dequantize(stored)["l.weight"], linear.bias.float()
    # round to nearest: within half a step of the weight (a zero point in bf16 may add its own rounding)
    step = stored["l.scales"].float()
    step = step[:, None] if mode == "int8" else step.repeat_interleave(groupsize, 1)
    assert ((w - deq).abs() <= step / 2 + 1e-3 * w.abs().amax()).all()
    assert (w - deq).abs().max() < (0.004 if mode == "int8" else 0.02)
    for m in (1, 17, 60):
        x = torch.randn(2, m, 256)
        want = x @ deq.T + bias
        got = linear(x.to(dtype)).float()
        tol = 1e-4 if dtype == torch.float32 else 3e-2 * want.abs().max()
        assert got.shape == want.shape and (got - want).abs().max() <= tol


class OpLog(TorchDispatchMode):
    """Every aten op a call runs, and the tensor it returns."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, out))
        return out


@pytest.mark.parametrize("mode,groupsize", MODES, ids=MODE_IDS)
def test_bf16_on_a_cpu_runs_torchs_kernel_not_a_dequantized_weight(mode, groupsize):
    """The fast CPU path: bf16 activations go through torch's CPU kernel, whose fp32 accumulation leaves only
    the output's bf16 rounding, and no op writes a float weight (what dequantize-then-matmul does each call,
    several times slower). Eager inputs may start off the int8 kernel's 32-byte alignment; compiled
    (generate.py --compile), inductor calls the same kernel. Rows sliced off an int8 lm_head (a draft
    vocabulary) too."""
    _, stored, linear = quantized_linear(mode, groupsize, torch.bfloat16)
    kernel = torch.ops.aten._weight_int8pack_mm if mode == "int8" else torch.ops.aten._weight_int4pack_mm_for_cpu
    deq = dequantize(stored)["l.weight"]
    for m in (1, 17, 60):
        x = torch.randn(2 * m * 256 + 3, dtype=torch.bfloat16)[3:].view(2, m, 256)  # 6 bytes off
        with OpLog() as log:
            got = linear(x)
        assert [f for f, _ in log.calls].count(kernel.default) == 1
        assert deq.numel() not in [out.numel() for _, out in log.calls if isinstance(out, torch.Tensor)]
        product, bias = x.float() @ deq.T, linear.bias.float()
        # rounded to bf16 (half a step: 2 ** -9 of the value) once, and again when the bias is added in bf16
        assert ((got.float() - product - bias).abs() <= 2 ** -8 * (product.abs() + (product + bias).abs())).all()
    x = x.clone()  # compiled code gets no alignment check (see quantize.kernel_rows)
    compiled, code = run_and_get_code(torch.compile(linear, fullgraph=True), x)
    assert torch.equal(compiled, linear(x))
    assert ("_weight_int8pack_mm" if mode == "int8" else "_weight_int4pack_mm") in "".join(code)
    if mode == "int8":
        ids = torch.tensor([5, 17, 90, 3])
        with OpLog() as log:
            got = linear.rows(ids)(x)
        assert kernel.default in [f for f, _ in log.calls] and torch.equal(got, linear(x)[..., ids])


@pytest.mark.parametrize("kind", ["llama31", "qwen2"])  # GQA + llama3 rope scaling; q/k/v bias + tied embeddings
@pytest.mark.parametrize("mode,groupsize", MODES[:2], ids=MODE_IDS[:2])
def test_quantized_target_matches_transformers_on_dequantized_weights(checkpoints, tmp_path, capsys, kind, mode,
                                                                      groupsize):
    path = own_copy(checkpoints, kind, tmp_path)
    out_path = quantize_cli(path / "model.pth", mode, groupsize, "--overwrite")
    assert out_path.name == ("model_int8.pth" if mode == "int8" else f"model_int4.g{groupsize}.pth")
    assert capsys.readouterr().out.count("quantized layers.") == 2  # progress, layer by layer
    model = load_target(out_path, "cpu", "bf16", 64)
    assert model.quantization["mode"] == mode and model.quantization["groupsize"] == groupsize
    assert isinstance(model.output, Int8Linear)  # the lm_head is int8 in both modes, tied or not
    linear = Int8Linear if mode == "int8" else Int4Linear
    assert isinstance(model.layers[0].attention.wqkv, linear) and isinstance(model.layers[1].feed_forward.w2, linear)
    assert getattr(model.layers[1].feed_forward.w2, "packed_for", "cpu") == "cpu"  # bf16: torch's kernel
    model = load_target(out_path, "cpu", "fp32", 64)
    assert isinstance(model.output, Int8Linear)
    assert isinstance(model.layers[0].attention.wqkv, linear) and isinstance(model.layers[1].feed_forward.w2, linear)
    if mode == "int4":  # in fp32 on a CPU kept dequantized (torch's kernel is fast in bf16 only): the stored values
        w2 = model.layers[1].feed_forward.w2
        assert w2.packed_for == "cpu, dequantized"
        assert torch.equal(w2.weight, dequantize(model_module.load_state_dict(out_path))["layers.1.feed_forward.w2.weight"])
    hf = hf_twin_of(out_path, tmp_path)
    tokens = torch.tensor([[1, 17, 5, 88, 42, 9, 63, 2, 30]])
    pos = torch.arange(tokens.shape[1])
    with torch.no_grad():
        ours, _ = model(tokens, pos, pos, causal_mask(pos, tokens.shape[1]))
        want = hf(tokens).logits
    assert (ours - want).abs().max() < 1e-4


def test_the_sizes_it_prints_are_the_files_sizes(checkpoints, tmp_path, capsys):
    """quantize.py's last line: the source's and the written file's sizes, in MB below a GB (a small file once
    printed as 0.000 GB)."""
    path = own_copy(checkpoints, "llama2", tmp_path)
    written = quantize_cli(path / "model.pth", "int8")
    line = [s for s in capsys.readouterr().out.splitlines() if " -> " in s][-1]
    source_mb, out_mb = (float(part.split()[0]) for part in line.split(" -> "))
    assert line.endswith(" MB") and out_mb == round(written.stat().st_size / 1e6, 3) and 0 < out_mb < source_mb


def test_weight_bytes_count_quantized_bytes_as_stored(checkpoints, tmp_path):
    """A Linear reads its values, scales and zeros (fp32 on CPU); an untied embedding one row."""
    path = own_copy(checkpoints, "llama2", tmp_path)
    a = ModelArgs.from_checkpoint_dir(path)
    linears = [(3 * a.dim, a.dim), (a.dim, a.dim), (2 * a.intermediate_size, a.dim), (a.dim, a.intermediate_size)]
    norms = (2 * a.n_layer + 1) * a.dim * 4
    embedding_row, lm_head = a.dim * 4, (a.vocab_size * a.dim, a.vocab_size * 4)
    int8 = a.n_layer * sum(n * k + 4 * n for n, k in linears) + sum(lm_head) + norms + embedding_row
    # int4 in fp32 on a CPU is kept dequantized (torch's int4 kernel is fast in bf16 only): 4 bytes a weight
    int4 = a.n_layer * sum(4 * n * k for n, k in linears) + sum(lm_head) + norms + embedding_row
    for mode, groupsize, expected in [("int8", 0, int8), ("int4", 32, int4)]:
        model = load_target(quantize_cli(path / "model.pth", mode, groupsize, "--overwrite"), "cpu", "fp32")
        assert weight_bytes(model) == expected


@pytest.fixture(scope="module")
def quantized_pairs(tmp_path_factory):
    """(mode, groupsize, head kind) -> (quantized target path, head path): a partly wrong EAGLE-1/2 head
    (int8 itself) and an EAGLE-3 head missing 8 of 48 tokens from its draft vocabulary."""
    pairs = {}
    target, head, _ = make_agreeing_pair(tmp_path_factory.mktemp("q_eagle"), wrong_fraction=0.3)
    target3, head3 = make_agreeing_eagle3_pair(tmp_path_factory.mktemp("q_eagle3"), missing=8)
    for path in (target, head, target3, head3):
        convert(path)
    head_int8 = quantize_cli(head / "draft.pth", "int8")
    for mode, groupsize in MODES[:2]:
        pairs[mode, groupsize, "eagle"] = (quantize_cli(target / "model.pth", mode, groupsize), head_int8)
        pairs[mode, groupsize, "eagle3"] = (quantize_cli(target3 / "model.pth", mode, groupsize), head3 / "draft.pth")
    return pairs


def prompts(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("mode,groupsize", MODES[:2], ids=MODE_IDS[:2])
@pytest.mark.parametrize("head,draft_vocab", [("eagle", None), ("eagle", 40), ("eagle3", None)],
                         ids=["eagle", "eagle-draft_vocab", "eagle3"])
def test_greedy_speculative_equals_plain_on_quantized_target(quantized_pairs, tmp_path, mode, groupsize, head,
                                                             draft_vocab):
    target_path, head_path = quantized_pairs[mode, groupsize, head]
    model = load_target(target_path, "cpu", "fp32", 256)
    vocab_file = None
    if draft_vocab:  # the head may propose only 40 of the 64 tokens: rows of the int8 lm_head
        vocab_file = tmp_path / "draft_vocab.json"
        kept = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:draft_vocab]
        vocab_file.write_text('{"token_ids": %s}' % kept.tolist())
    draft = load_draft(head_path, model, vocab_file)
    if draft_vocab:
        assert isinstance(draft.vocab_lm_head, Int8Linear) and draft.vocab_lm_head.out_features == draft_vocab
    if head == "eagle":
        assert isinstance(draft.fc, Int8Linear) and isinstance(draft.layer.feed_forward.w13, Int8Linear)
    lengths = []
    for prompt in prompts(model.args.vocab_size, 6):
        plain = decode.generate(model, prompt, 40, GREEDY)
        spec = decode.generate(model, prompt, 40, GREEDY, draft=draft)
        assert spec.tokens == plain.tokens
        lengths += spec.accept_lengths
    tau = sum(lengths) / len(lengths)
    print(f"{mode} g{groupsize} {head} draft_vocab={draft_vocab}: tau {tau:.2f}, lengths {sorted(set(lengths))}")
    # deep and varied paths through the quantized verify (measured: 2.60 / 1.93 with 40 of 64 tokens / 4.50)
    assert tau >= (1.5 if draft_vocab else 2.2) and len(set(lengths)) >= 5


@pytest.mark.parametrize("mode,groupsize", [MODES[0], pytest.param(*MODES[1], marks=pytest.mark.slow)],
                         ids=MODE_IDS[:2])
def test_greedy_speculative_equals_plain_on_quantized_target_in_bf16(quantized_pairs, mode, groupsize):
    """bf16 activations on a CPU, where torch's kernels run the quantized Linears: the verify's rows and a
    plain step's one row come out of the same kernel alike (it computes each row on its own)."""
    target_path, head_path = quantized_pairs[mode, groupsize, "eagle3"]
    model = load_target(target_path, "cpu", "bf16", 256)
    draft = load_draft(head_path, model)
    lengths = []
    for prompt in prompts(model.args.vocab_size, 4):
        plain = decode.generate(model, prompt, 40, GREEDY)
        spec = decode.generate(model, prompt, 40, GREEDY, draft=draft)
        assert spec.tokens == plain.tokens
        lengths += spec.accept_lengths
    assert len(set(lengths)) >= 5  # deep and varied paths through the verify


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16: inductor calls torch's CPU kernels
@pytest.mark.parametrize("mode,groupsize", MODES[:2], ids=MODE_IDS[:2])
def test_compiled_cycle_on_quantized_target_equals_eager(quantized_pairs, mode, groupsize, precision):
    target_path, head_path = quantized_pairs[mode, groupsize, "eagle"]
    model = load_target(target_path, "cpu", precision, 128)
    draft = load_draft(head_path, model)  # int8 itself
    assert len(check_compiled_cycle(model, draft, TreeConfig(depth=3, topk=3, total_tokens=10))) >= 2


@pytest.mark.slow
@pytest.mark.stat
@pytest.mark.parametrize("mode,groupsize", MODES[:2], ids=MODE_IDS[:2])
def test_speculative_sampling_on_quantized_target_matches_its_distribution(tmp_path, mode, groupsize):
    """The chi-square check of test_sampling.py, the exact distribution enumerated by transformers on the
    dequantized weights of the quantized target."""
    from test_sampling import VOCAB, chi_square_p_below, exact_distribution, speculative_samples
    target, head, _ = make_agreeing_pair(tmp_path, vocab=VOCAB, hidden=32, alpha=2.5, layer_scale=20.0,
                                         lm_head_noise=1.0)
    convert(target), convert(head)
    quantized = quantize_cli(target / "model.pth", mode, groupsize)
    hf_twin_of(quantized, tmp_path / "twin")
    model = load_target(quantized, "cpu", "fp32", 64)
    draft = load_draft(head / "draft.pth", model)
    sampling = SamplingConfig(temperature=0.9, top_k=6)
    counts = speculative_samples(model, draft, sampling)
    assert not chi_square_p_below(counts, exact_distribution(tmp_path / "twin", sampling))


def test_quantize_errors(checkpoints, tmp_path, monkeypatch):
    path = own_copy(checkpoints, "llama2", tmp_path)  # hidden 64, intermediate 96: groupsize 64 does not divide 96
    model_pth = path / "model.pth"
    expect_error(["--checkpoint_path", str(model_pth), "--mode", "int3"], "invalid choice", main=quantize.main)
    expect_error(["--checkpoint_path", str(model_pth), "--mode", "int4", "--groupsize", "100"], "invalid choice",
                 main=quantize.main)
    expect_error(["--checkpoint_path", str(model_pth), "--mode", "int8", "--groupsize", "64"], "is for --mode int4",
                 main=quantize.main)
    expect_error(["--checkpoint_path", str(model_pth), "--mode", "int4", "--groupsize", "64", "--overwrite"],
                 "does not divide the input width 96 of layers.0.feed_forward.w2; one that divides every layer's: 32",
                 main=quantize.main)
    expect_error(["--checkpoint_path", str(tmp_path / "nope.pth"), "--mode", "int8"], "checkpoint not found",
                 main=quantize.main)
    # what convert_hf_checkpoint.py reads, not what it writes: refused before any work
    expect_error(["--checkpoint_path", str(path / "model.safetensors"), "--mode", "int8"],
                 "is a Hugging Face weights file: run convert_hf_checkpoint.py", main=quantize.main)
    from safetensors.torch import load_file
    torch.save(load_file(str(path / "model.safetensors")), tmp_path / "renamed.pth")
    expect_error(["--checkpoint_path", str(tmp_path / "renamed.pth"), "--mode", "int8"],
                 "this is a Hugging Face checkpoint", main=quantize.main)
    (tmp_path / "empty.pth").write_bytes(b"")
    (tmp_path / "text.pth").write_text("hello")
    (tmp_path / "cut.pth").write_bytes(model_pth.read_bytes()[:20000])
    for name, match in [("empty", "empty.pth is empty"), ("text", "not a checkpoint of plain tensors"),
                        ("cut", "truncated or corrupt")]:
        expect_error(["--checkpoint_path", str(tmp_path / f"{name}.pth"), "--mode", "int8"], match,
                     main=quantize.main)
    out = quantize_cli(model_pth, "int8", 0, "--overwrite")
    out.unlink()
    for other in path.glob("model_*.pth"):  # the folder holds one checkpoint, model.pth: the folder is that file
        other.unlink()
    quantize.main(["--checkpoint_path", str(path), "--mode", "int8"])
    before = out.read_bytes()
    expect_error(["--checkpoint_path", str(model_pth), "--mode", "int8"], "exists; give --overwrite",
                 main=quantize.main)
    assert out.read_bytes() == before  # the user's file is untouched
    expect_error(["--checkpoint_path", str(out), "--mode", "int4"], "already quantized (int8)", main=quantize.main)

    # an output folder that cannot be written is refused before any layer is quantized
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    with monkeypatch.context() as m:
        m.setattr(quantize.tempfile, "TemporaryDirectory", refuse)
        expect_error(["--checkpoint_path", str(model_pth), "--mode", "int4", "--groupsize", "32", "--overwrite"],
                     "cannot write", main=quantize.main)

    # a file from a newer format, and a torch without the int4 kernel, when loading
    sd = torch.load(out, weights_only=True)
    sd[QUANT_KEY]["format_version"] = 99
    newer = path / "model_newer.pth"
    torch.save(sd, newer)
    base = ["--device", "cpu", "--prompt", "w5", "--max_new_tokens", "2"]
    expect_error(["--checkpoint_path", str(newer), *base], "format version 99, newer than this eaglet reads")
    int4 = quantize_cli(model_pth, "int4", 32, "--overwrite")
    monkeypatch.setitem(quantize.INT4_KERNELS, "cpu", ("_no_such_pack", "_no_such_mm"))
    expect_error(["--checkpoint_path", str(int4), *base, "--precision", "bf16"], "has no int4 kernel for cpu")


def test_quantized_files_run_through_the_cli(quantized_pairs, tmp_path, capsys):
    target_path, head_path = quantized_pairs["int4", 32, "eagle"]
    argv = ["--checkpoint_path", str(target_path), "--device", "cpu", "--prompt", "w5 w9 w11", "--max_new_tokens", "24"]
    generate.main(argv + ["--draft_checkpoint_path", str(head_path), "--json_out", str(tmp_path / "spec.json")])
    assert "target target/model_int4.g32.pth (int4 g32, lm_head int8); head head/draft_int8.pth (int8)" in capsys.readouterr().out
    generate.main(argv + ["--json_out", str(tmp_path / "plain.json")])
    printed = capsys.readouterr().out  # the int4 Linears kept dequantized; the lm_head's int8 dequantized at each call
    assert "note: int4 weights in fp32 on a CPU are kept dequantized" in printed
    assert "note: on a CPU, int8 weights (the target's) are fast with bf16 activations only" in printed
    spec, plain = (read_generation(tmp_path / f) for f in ("spec.json", "plain.json"))
    assert spec["tokens"] == plain["tokens"] and spec["cycles"] > 0
    generate.main(argv + ["--precision", "bf16", "--max_new_tokens", "2"])
    assert "note:" not in capsys.readouterr().out


def test_training_a_head_on_a_quantized_target(checkpoints, tmp_path):
    """train_draft.py reads an int4 target's features; an EAGLE-3 head starts from its int8 lm_head's rows
    (dequantized), trains, converts, and decodes losslessly on that target."""

    import train_draft
    from convert_hf_checkpoint import main as convert_main
    from test_train_draft import corpus
    target_dir = own_copy(checkpoints, "llama8", tmp_path)
    int4 = quantize_cli(target_dir / "model.pth", "int4", 32, "--overwrite")
    out = tmp_path / "head3"
    argv = ["--checkpoint_path", str(int4), "--data", str(corpus(tmp_path / "corpus.txt")), "--out_dir", str(out),
            "--head", "eagle3", "--device", "cpu", "--batch_size", "4", "--seq_len", "32", "--unroll_steps", "2",
            "--lr", "3e-3", "--steps", "8"]
    train_draft.main(argv)
    assert (out / "model.safetensors").is_file()
    convert_main(["--checkpoint_dir", str(out)])
    base = ["--checkpoint_path", str(int4), "--device", "cpu", "--prompt", "w3 w4 w5 w6", "--max_new_tokens", "30"]
    generate.main(base + ["--json_out", str(tmp_path / "plain.json")])
    generate.main(base + ["--draft_checkpoint_path", str(out / "draft.pth"), "--json_out", str(tmp_path / "spec.json")])
    plain, spec = (read_generation(tmp_path / f"{n}.json") for n in ("plain", "spec"))
    assert spec["tokens"] == plain["tokens"] and spec["cycles"] > 0


def test_a_damaged_int4_file_is_refused_by_name(checkpoints, tmp_path):
    path = own_copy(checkpoints, "llama2", tmp_path)
    sd = torch.load(quantize_cli(path / "model.pth", "int4", 32, "--overwrite"), weights_only=True)
    scales = sd["layers.0.attention.wo.scales"]
    sd["layers.0.attention.wo.scales"] = torch.cat([scales, scales[:, :1]], dim=1)  # 3 groups of 64 inputs
    torch.save(sd, path / "model_damaged.pth")
    expect_error(["--checkpoint_path", str(path / "model_damaged.pth"), "--device", "cpu", "--prompt", "w5"],
                 "layers.0.attention.wo: (64, 3) int4 scales do not make groups")
    sd["layers.0.attention.wo.scales"] = scales
    sd["layers.1.feed_forward.w2.weight"] = sd["layers.1.feed_forward.w2.weight"].float()
    torch.save(sd, path / "model_damaged.pth")
    expect_error(["--checkpoint_path", str(path / "model_damaged.pth"), "--device", "cpu", "--prompt", "w5"],
                 "layers.1.feed_forward.w2: a quantized layer's weight must be torch.uint8, not torch.float32")
    # a checkpoint with a NaN weight is refused by layer name, and nothing is left behind
    weights = torch.load(path / "model.pth", weights_only=True)
    weights["layers.1.attention.wqkv.weight"][3, 5] = float("nan")
    (tmp_path / "nan").mkdir()
    torch.save(weights, tmp_path / "nan" / "model.pth")
    expect_error(["--checkpoint_path", str(tmp_path / "nan" / "model.pth"), "--mode", "int8"],
                 "layers.1.attention.wqkv holds NaN or infinite weights", main=quantize.main)
    assert sorted(p.name for p in (tmp_path / "nan").iterdir()) == ["model.pth"]
