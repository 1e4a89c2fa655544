"""bench.py end to end on tiny models (numbers printed, not asserted), and torch.compile on CPU without
recompilation."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import bench
import generate
import measure
from cli import DEMO_PROMPT
from conftest import (HANG_S, ROOT, SHARED, expect_error, head_config, make_agreeing_eagle3_pair, make_agreeing_pair,
                      random_head_weights, write_eagle_head)
from convert_hf_checkpoint import convert
from decode import TreeConfig
from load import load_draft, load_target
from attention import causal_mask
from model import EagletError

SMALL = ["--depth", "3", "--tree_topk", "4", "--total_tokens", "16", "--repeats", "2", "--side_tokens", "12"]


@pytest.mark.slow
def test_bench_random_shape_with_transformers_side_by_side(tmp_path):
    bench.main(["--model", "tiny", "--hf", "--out", str(tmp_path / "r")] + SMALL)
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["plain"]["tokens_per_s"] > 0 and results["setup"]["copy_GB_per_s"] > 0
    assert set(results["cycle"]["phases"]) == {"catch-up", "expansion (draft tree)", "verify",
                                               "accept + compaction", "whole cycle"}
    side = results["side_by_side"]
    assert all(row["same_tokens_as_plain"] for row in side.values())  # fp32: the same greedy tokens
    assert "| verify |" in (tmp_path / "r.md").read_text()
    assert results["plain"]["kernels"]["per_call"] > 0
    assert all(phase["kernels"]["ms_per_call"] > 0 for phase in results["cycle"]["phases"].values())


@pytest.mark.parametrize("kind", ["llama_bias", "qwen2", "qwen3"])  # q/k/v/o + mlp biases; q/k/v bias, tied; q/k norms
def test_hf_twin_reproduces_our_logits(checkpoints, kind):
    """The transformers baseline runs on exactly our weights (the fixtures' norms and biases are random)."""
    path, _ = checkpoints(kind)
    target = load_target(path / "model.pth", "cpu", "fp32", 16)
    ids, pos = torch.tensor([[1, 17, 5, 88, 42, 9, 63, 30]]), torch.arange(8)
    with torch.no_grad():
        ours, _ = target(ids, pos, pos, causal_mask(pos, 16))
        want = measure.hf_twin(target)(ids).logits
    assert (ours - want).abs().max() < 1e-4 * want.abs().max()


def test_hf_twin_refuses_a_weight_left_out_of_the_export(checkpoints, monkeypatch):
    import convert_common
    export_layer = convert_common.export_layer
    monkeypatch.setattr(convert_common, "export_layer", lambda *a: {
        k: v for k, v in export_layer(*a).items() if not k.endswith("layers.1.mlp.up_proj.bias")})
    target = load_target(checkpoints("llama_bias")[0] / "model.pth", "cpu", "fp32")
    with pytest.raises(EagletError, match=r"missing \['model.layers.1.mlp.up_proj.bias'\], unexpected \[\]"):
        measure.hf_twin(target)


def test_kernel_table_counts_what_a_call_runs():
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def call():
        torch.mm(a, b)
        torch.mm(b, a)
        torch.softmax(a, dim=-1)

    table = measure.kernel_table(call, "cpu", calls=4)
    assert "error" not in table, table  # the profiler failed (kernel_table keeps its message)
    rows = {row["name"]: row for row in table["top"]}
    assert table["unit"].startswith("CPU") and rows["aten::mm"]["per_call"] == 2
    assert rows["aten::mm"]["us_per_call"] > 0 and "aten::_softmax" in rows
    top_us = sum(row["us_per_call"] for row in table["top"])  # a part of the total, or all of it (rounding aside)
    assert table["ms_per_call"] * 1e3 >= top_us * (1 - 1e-9) and top_us > 0


@pytest.mark.slow
def test_bench_eval_on_question_files(checkpoints, tmp_path, capsys):
    target, _ = checkpoints("llama2")
    head = tmp_path / "head"
    write_eagle_head(head, random_head_weights(64, 4, 4, 96, 96), head_config(64, 4, 4, 96, 96))
    convert(head)
    questions = SHARED / "data" / "prompts"
    if not questions.is_dir():  # a fresh clone without ../shared: two questions of our own
        questions = tmp_path / "q"
        questions.mkdir()
        (questions / "mine.jsonl").write_text("\n".join(json.dumps({"question_id": i, "category": "x",
                                                                    "turns": ["w1 w2 w3", "w4"]}) for i in range(2)))
    bench.main(["--checkpoint_path", str(target / "model.pth"), "--draft_checkpoint_path", str(head / "draft.pth"),
                "--eval", str(questions), "--questions", "1", "--max_new_tokens", "16", "--max_seq_length", "512",
                "--out", str(tmp_path / "r")] + SMALL)
    results = json.loads((tmp_path / "r.json").read_text())
    rows = results["eval"].values()
    task = next(iter(results["eval"]))
    assert f"{task}: question 1/1" in capsys.readouterr().out and results["setup"]["chat_template"]  # progress
    assert sum(row["turns"] for row in rows) >= 2 and all(row["mismatches"] == [] for row in rows)
    for task, limit in results["limit"]["eval"].items():  # each task against its own tau and tokens/s
        row = results["eval"][task]
        assert (limit["tau"], limit["measured_tokens_per_s"]) == (row["tau"], row["spec_tokens_per_s"])
    assert set(results["limit"]["eval"]) == {task for task, row in results["eval"].items() if row["turns"]}
    print((tmp_path / "r.md").read_text())


@pytest.mark.slow
def test_gpu_check_quick_runs_on_cpu(tmp_path, without_inductor):
    """scripts/gpu_check.py --quick as a CPU smoke test: every section runs, compiled (traced by dynamo, run without
    inductor: conftest.traced_compile) == eager, no recompiles."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    gpu_check.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "g"), "--depth", "2", "--tree_topk", "3",
                    "--total_tokens", "8"])
    results = json.loads((tmp_path / "g" / "results.json").read_text())
    assert not [name for name, r in results.items() if "error" in r], results
    checks = results["compiled vs eager (reduced shape, fp32)"]
    for kind in ("plain", "EAGLE-2"):
        assert checks[kind]["same_tokens"] and checks[kind]["same_tokens_second_prompt"]
        assert checks[kind]["graphs_compiled_after_warm_up"] == 0
    assert checks["EAGLE-2"]["tau_compiled"] > 1.5  # the inflated demo accepts for real
    assert "decode T=1" in results["attention kernels (reduced shape)"]


@pytest.mark.slow
def test_gpu_check_plain_only_measures_a_shape_on_cpu(tmp_path, monkeypatch, without_inductor):
    """gpu_check --plain_only (the A/B run) skips the checks and measures the compiled plain step of each shape,
    then the cache-size comparison, here on a small shape added for the test."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    monkeypatch.setitem(gpu_check.SHAPES, "small-test", {**gpu_check.REDUCED, "max_position_embeddings": 1024})
    gpu_check.main(["--plain_only", "--device", "cpu", "--shapes", "small-test", "--formats", "bf16",
                    "--out", str(tmp_path / "g"), "--repeats", "2", "--max_seq_length", "256", "--draft_vocab", "4096"])
    results = json.loads((tmp_path / "g" / "results.json").read_text())
    assert not [name for name, r in results.items() if "error" in r], results
    assert "compiled vs eager (reduced shape, fp32)" not in results
    plain = results["small-test bf16 (inflated demo)"]["plain"]
    assert plain["tokens_per_s"] > 0 and plain["recompiles_after_warmup"] == 0
    assert set(results["small-test bf16 (inflated demo)"]) == {"weights", "weights_GB", "plain", "section_seconds",
                                                               "draft_vocab"}
    assert set(results["small-test (inflated demo): formats side by side"]["bf16"]) >= {"plain_step_ms", "weights_GB"}
    assert results["setup"]["draft_vocab"] == 4096
    sizes = results["compiled plain step at context 256: 512, 4096 and 8192 cache slots"]
    assert set(sizes) >= {"512 slots", "1024 slots"} and sizes["1024 slots"]["recompiles_after_warmup"] == 0


@pytest.mark.slow
def test_gpu_check_formats_side_by_side_and_linear_kernels_on_cpu(tmp_path, monkeypatch, without_inductor):
    """gpu_check --formats: the inflated demo in bf16 (fp32 on CPU), int8 and int4 g32 quantized in memory from
    it, each measured in its own section and summed up side by side (EAGLE-2 == plain in each, the demo's tau
    kept, fewer bytes per format); --linear_kernels on its tiny CPU shape (compiled); --int4_13b refused on
    CPU. The model steps run eagerly here (compile_step patched out) so that the loop's plumbing costs
    seconds (compiled quantized cycles: test_quantize.py)."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    # just wider than the demo (256): the smallest shape int4 g32 takes (widths of multiples of 32, of 16 out)
    monkeypatch.setitem(gpu_check.SHAPES, "small-test", dict(
        vocab_size=4096, hidden_size=320, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=1024))  # wider heads: DFlash's q/k norms
    for module in (measure, generate):
        monkeypatch.setattr(module, "compile_step", lambda step_fn, device: step_fn)
    formats = ["bf16", "int8", "int4.g32"]
    gpu_check.main(["--skip_checks", "--device", "cpu", "--shapes", "small-test", "--formats", ",".join(formats),
                    "--linear_kernels", "--int4_13b", "--dflash", "--out", str(tmp_path / "g"), "--repeats", "1",
                    "--side_tokens", "12", "--depth", "2", "--tree_topk", "3", "--total_tokens", "8",
                    "--max_seq_length", "256"])
    results = json.loads((tmp_path / "g" / "results.json").read_text())
    assert not [name for name, r in results.items() if "error" in r], results
    assert "compiled vs eager (reduced shape, fp32)" not in results  # --skip_checks
    table = results["small-test (inflated demo): formats side by side"]
    assert [table[f]["weights"] for f in formats] == ["float32", "int8", "int4 g32, lm_head int8"]
    # fewer bytes per format; but in fp32 on a CPU int4 Linears are kept dequantized (torch's int4 kernel is fast in
    # bf16 only), which the bytes read say: between the fp32 model and int8 (its lm_head stays int8)
    assert table["bf16"]["weights_GB"] > table["int4.g32"]["weights_GB"] > table["int8"]["weights_GB"]
    for fmt in formats:
        row = table[fmt]
        assert row["eagle2_same_tokens_as_plain"] and row["tau"] > 1.5, (fmt, row)  # lossless, real acceptance
        assert row["total_tokens_auto"] == 16 and 0 < row["eagle2_weight_GB_per_token"] < row["weights_GB"] * 2
    assert "cycle" in results["small-test bf16 (inflated demo)"]  # the phase table: first format of the first shape
    assert "cycle" not in results["small-test int8 (inflated demo)"]
    dflash = results["small-test bf16 DFlash cycle (random head, published shape)"]  # the first format only
    assert dflash["block_size"] == 16 and dflash["layers"] == 5 and len(dflash["feature_layers"]) == 5
    assert dflash["chain"]["draft_passes"] == 1 and dflash["tree"]["phases"]["whole cycle"]["ms"] > 0
    # a phase table (five graphs to compile on a GPU) for the first configuration only, the whole cycle for the rest
    assert "verify" in dflash["chain"]["phases"] and set(dflash["tree"]["phases"]) == {"whole cycle"}
    demo = results["small-test bf16 DFlash end to end (inflated demo)"]  # the demo's DFlash head: real acceptance
    for tree in ("chain 8", "tree 16"):
        assert demo[tree]["same_tokens_as_plain"] and demo[tree]["tau"] > 1.3, (tree, demo[tree])
    assert not [k for k in results if "int8 DFlash" in k]
    kernels = results["linear kernels by rows"]
    assert kernels["rows"] == [1, 16, 17]
    (shape_rows,) = [v for k, v in kernels.items() if k.startswith("64x128")]
    assert set(shape_rows) == {"float32 nn.Linear", "int8 Int8Linear", "int4 g128 Int4Linear"}
    for row in shape_rows.values():
        assert row["M=1"]["over_M1"] == 1.0 and all(row[f"M={m}"]["ms"] > 0 for m in (1, 16, 17))
    assert "CUDA" in results["llama2-13b int4 g128 (inflated demo): speed and peak memory"]["skipped"]


def test_gpu_check_shapes_hold_the_demo():
    """Every shape gpu_check can measure (LLaMA-2-13B's too) has room for the demo: its layout is accepted,
    checked on the configs alone (a 13B model is never built on a CPU; test_inflate.py decodes reduced ones)."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    import inflate_demo
    from model import ModelArgs
    demo = ModelArgs.from_checkpoint_dir(gpu_check.DEMO_DIR / "target")
    for name, shape in gpu_check.SHAPES.items():
        big = ModelArgs.from_hf_config({"model_type": "llama", **shape})
        layout = inflate_demo.Layout(demo, big)
        assert int(layout.q_heads.max()) < big.n_head and layout.eps(demo.norm_eps) > 0, name
    assert gpu_check.SHAPES["llama2-13b"]["hidden_size"] == 5120


def test_gpu_check_refuses_unknown_formats(tmp_path):
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    with pytest.raises(SystemExit, match="^error: unknown --formats int3; known: bf16, int8, int4, int4.g32"):
        gpu_check.main(["--formats", "bf16,int3", "--out", str(tmp_path / "g")])
    assert not (tmp_path / "g").exists()


# What bench reports, checked on a real process: an agreeing pair (tau above 1) whose head has a draft
# vocabulary beside it, run once with that default and once with --draft_vocab full.
VOCAB_KEPT = 48  # of the pair's 64 tokens


def run_bench(argv, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "bench.py"), *argv], capture_output=True, text=True,
                          timeout=HANG_S, cwd=cwd)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_pair")
    target, head, _ = make_agreeing_pair(root, vocab=64, hidden=64, wrong_fraction=0.3)
    convert(target), convert(head)
    (head / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(VOCAB_KEPT))}))
    return SimpleNamespace(root=root, target=target / "model.pth", head=head)


@pytest.fixture(scope="module")
def runs(pair):
    """name -> one real bench process on the pair (beside: the draft vocabulary beside the head; full), run once."""
    done = {}

    def run(name):
        if name not in done:
            stem = pair.root / f"{name}.v1"  # a dot in the name stays: beside.v1.json
            extra = ["--draft_vocab", "full"] if name == "full" else []
            proc = run_bench(["--checkpoint_path", str(pair.target), "--draft_checkpoint_path",
                              str(pair.head / "draft.pth"), "--max_seq_length", "256", "--out", str(stem), *extra] + SMALL)
            assert proc.returncode == 0, proc.stderr[-2000:]
            done[name] = SimpleNamespace(stdout=proc.stdout, stderr=proc.stderr, md=Path(f"{stem}.md").read_text(),
                                         results=json.loads(Path(f"{stem}.json").read_text()))
        return done[name]
    return run


@pytest.mark.slow
def test_reports_name_the_draft_vocab_beside_the_head(pair, runs):
    run, text = runs("beside"), f"{VOCAB_KEPT} of 64 tokens from {pair.head / 'draft_vocab.json'}"
    assert f"draft vocabulary: {text}" in run.stdout
    assert f"Draft vocabulary: {text}" in run.md
    vocab = run.results["setup"]["draft_vocab"]
    assert (vocab["tokens"], vocab["of"], vocab["source"]) == (VOCAB_KEPT, 64, str(pair.head / "draft_vocab.json"))
    assert f"Head: {pair.head / 'draft.pth'} (EAGLE-1/2)" in run.md and "USDT" not in run.stderr


def test_draft_vocab_full_reaches_the_head(pair):
    """--draft_vocab full: the head scores all 64 rows, and the bytes floor reads them on every draft pass."""
    args = SimpleNamespace(model=None, checkpoint_path=pair.target, draft_checkpoint_path=pair.head / "draft.pth",
                           precision="fp32", max_seq_length=256, draft_vocab=None)
    tree, floors = TreeConfig(3, 4, 16), {}
    for vocab, text in [(None, f"{VOCAB_KEPT} of 64 tokens from {pair.head / 'draft_vocab.json'}"),
                        ("full", "full vocabulary (64)")]:
        args.draft_vocab = vocab
        target, draft = bench.load_models(args, "cpu")
        assert bench.draft_vocab_used(args, target, draft)["text"] == text
        floors[vocab] = measure.cycle_bytes(target, draft, tree, 128)["cycle"]
    assert floors["full"] - floors[None] == (tree.depth + 1) * (64 - VOCAB_KEPT) * 64 * 4  # rows of 64 fp32


@pytest.mark.slow
def test_draft_vocab_full_is_named_in_every_report(runs):
    run = runs("full")
    assert "draft vocabulary: full vocabulary (64)" in run.stdout and "Draft vocabulary: full vocabulary (64)" in run.md
    assert run.results["setup"]["draft_vocab"]["tokens"] == 64
    draft_passes, row_bytes = run.results["setup"]["tree"]["depth"] + 1, 64 * 4  # hidden 64, fp32
    extra = run.results["cycle"]["cycle_bytes_GB"] - runs("beside").results["cycle"]["cycle_bytes_GB"]
    assert extra * 1e9 == pytest.approx(draft_passes * (64 - VOCAB_KEPT) * row_bytes)


def numbers(pattern: str, text: str) -> list:
    match = re.search(pattern, text)
    assert match, pattern
    return [float(x) for x in match.groups()]


@pytest.mark.slow
def test_derived_figures_follow_from_their_reported_inputs(runs):
    r = runs("beside").results
    setup, plain, cycle, side = r["setup"], r["plain"], r["cycle"], r["side_by_side"]
    limit = r["limit"]["side_by_side"]
    copy, spec = setup["copy_GB_per_s"], side["eaglet EAGLE-2"]
    assert plain["tokens_per_s"] == pytest.approx(1e3 / plain["step_ms"])
    assert plain["GB_per_s"] == pytest.approx(plain["weights_GB"] / (plain["step_ms"] / 1e3))
    assert plain["fraction_of_copy_bandwidth"] == pytest.approx(plain["GB_per_s"] / copy)
    for phase in cycle["phases"].values():
        assert phase["plain_steps"] == pytest.approx(phase["ms"] / plain["step_ms"])
    assert cycle["floor_plain_steps"] == pytest.approx(cycle["cycle_bytes_GB"] / cycle["plain_step_bytes_GB"])
    assert cycle["floor_ms"] == pytest.approx(cycle["cycle_bytes_GB"] / copy * 1e3)
    assert cycle["measured_over_floor"] == pytest.approx(cycle["phases"]["whole cycle"]["ms"] / cycle["floor_ms"])
    for row in side.values():
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / side["eaglet plain"]["tokens_per_s"])
    # the limit: this run's own tau and tokens/s, the measured bandwidth and floor
    assert spec["tau"] > 1.2 and (limit["tau"], limit["measured_tokens_per_s"]) == (spec["tau"], spec["tokens_per_s"])
    assert (limit["copy_GB_per_s"], limit["cycle_bytes_GB"], limit["context"]) == (copy, cycle["cycle_bytes_GB"],
                                                                                   cycle["context"])
    assert limit["tokens_per_s"] == pytest.approx(spec["tau"] * copy / cycle["cycle_bytes_GB"])
    assert limit["fraction"] == pytest.approx(spec["tokens_per_s"] / limit["tokens_per_s"])
    # ... and the markdown says so: its figures follow from the inputs it prints, within their rounding
    md = runs("beside").md
    tau, bw, gb, ctx, tokens_per_s, measured, percent = numbers(
        r"its tau ([\d.]+) x the copy bandwidth ([\d.]+) GB/s / the bytes floor ([\d.]+) GB per cycle "
        r"\(at context (\d+)\) = ([\d.]+) tokens/s; it measured ([\d.]+) tokens/s, ([\d.]+)% of that", md)
    assert tokens_per_s == pytest.approx(tau * bw / gb, rel=0.01)
    assert percent == pytest.approx(100 * measured / tokens_per_s, rel=0.01)
    assert f"| eaglet EAGLE-2 | {measured:.1f} | {tau:.2f} |" in md and ctx == cycle["context"]
    assert f"Measured copy bandwidth: {bw:.4g} GB/s" in md
    gb_floor, floor_ms, whole_ms, ratio = numbers(r"Bytes floor of a cycle at context \d+: ([\d.]+) GB .* it "
                                                  r"takes ([\d.]+) ms; the measured whole cycle, ([\d.]+) ms, is "
                                                  r"([\d.]+) x", md)
    assert gb_floor == gb and floor_ms == pytest.approx(gb / bw * 1e3, rel=0.01)
    assert ratio == pytest.approx(whole_ms / floor_ms, rel=0.01) and f"| whole cycle | {whole_ms:.3f} |" in md
    # time outside the calls: each run's decode time (after its first token) over its calls, against the call's own
    for name, call_ms in [("eaglet plain", plain["step_ms"]), ("eaglet EAGLE-2", cycle["phases"]["whole cycle"]["ms"])]:
        run, out = side[name], r["outside_the_graph"][name]
        assert out["end_to_end_ms_per_call"] == pytest.approx(run["decode_ms"] / run["calls"])
        assert out["outside_ms_per_call"] == pytest.approx(out["end_to_end_ms_per_call"] - call_ms)
        assert out["at_call_rate"] == pytest.approx(call_ms / out["end_to_end_ms_per_call"])
        assert 0 < run["first_token_ms"] < run["decode_ms"] + run["first_token_ms"]
        assert f"| {name} | {call_ms:.3f} | {out['end_to_end_ms_per_call']:.3f} |" in md
    below = any(o["outside_ms_per_call"] < 0 for o in r["outside_the_graph"].values())
    assert ("Below zero outside the call" in md) == below  # said only when a row is below zero
    assert side["eaglet plain"]["calls"] == setup["side_tokens"] - 1  # every token after the first is one step
    assert spec["calls"] * spec["tau"] == pytest.approx(setup["side_tokens"] - 1)  # tau: tokens per cycle after it
    assert 0 < r["host_loop_us"]["plain"] < 1e3 and 0 < r["host_loop_us"]["EAGLE-2"] < 1e3


def test_each_run_is_held_to_its_own_limit():
    """The side by side and each evaluated task: their own tau against their own tokens/s, never another's."""
    results = {"side_by_side": {"eaglet EAGLE-2": {"tau": 2.0, "tokens_per_s": 10.0}},
               "cycle": {"cycle_bytes_GB": 0.5, "context": 128},
               "eval": {"a": {"turns": 2, "tau": 3.0, "spec_tokens_per_s": 20.0},
                        "b": {"turns": 1, "tau": 4.0, "spec_tokens_per_s": 30.0},
                        "too long": {"turns": 0, "tau": 0.0, "spec_tokens_per_s": 0.0}}}
    limits = bench.limits(results, copy_bw=100e9)  # 100 GB/s / 0.5 GB per cycle = 200 cycles/s
    side = limits["side_by_side"]
    assert side["tokens_per_s"] == pytest.approx(400) and side["fraction"] == pytest.approx(10 / 400)
    assert {task: (x["tau"], x["tokens_per_s"], x["fraction"]) for task, x in limits["eval"].items()} == {
        "a": (3.0, pytest.approx(600), pytest.approx(20 / 600)),
        "b": (4.0, pytest.approx(800), pytest.approx(30 / 800))}


def test_eagle3_head_reports_its_own_d2t(tmp_path):
    target, head = make_agreeing_eagle3_pair(tmp_path, missing=8)
    convert(target), convert(head)
    (head / "draft_vocab.json").write_text(json.dumps({"token_ids": [0, 1, 2]}))  # not for EAGLE-3 heads: unread
    model = load_target(target / "model.pth", "cpu", "fp32", 64)
    args = SimpleNamespace(draft_vocab=None, draft_checkpoint_path=head / "draft.pth")
    vocab = bench.draft_vocab_used(args, model, load_draft(args.draft_checkpoint_path, model))
    assert vocab["text"] == "the head's own d2t of 40 (of the target's 48 tokens)" and vocab["tokens"] == 40


def test_random_head_takes_a_draft_vocab_file(tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({"token_ids": list(range(100))}))
    args = SimpleNamespace(model="tiny", precision="fp32", max_seq_length=64, draft_vocab=str(tmp_path / "v.json"),
                           draft_checkpoint_path=None, random_head="eagle")
    target, draft = bench.load_models(args, "cpu")
    assert draft.vocab_size == 100 and draft.lm_head_module(target).weight.shape[0] == 100
    assert bench.draft_vocab_used(args, target, draft)["text"] == f"100 of 1024 tokens from {tmp_path / 'v.json'}"
    args.draft_vocab = "full"
    assert bench.draft_vocab_used(args, *bench.load_models(args, "cpu"))["text"] == "full vocabulary (1024)"


def test_a_draft_vocab_that_is_not_there_is_refused(tmp_path):
    expect_error(["--model", "tiny", "--draft_vocab", str(tmp_path / "nope.json")], "no such file", bench.main)


def test_profiler_markers_leave_stderr_and_other_lines_stay(capfd):
    a = torch.randn(64, 64)

    def call():
        torch.mm(a, a)
        os.write(2, b"a real error\n")  # below Python, where kineto writes too

    table = measure.kernel_table(call, "cpu", calls=2)
    err = capfd.readouterr().err
    assert "USDT" not in err and err.count("a real error") == 2 and "error" not in table


def test_no_arguments_means_the_demo():
    if not (bench.DEMO_DIR / "target" / "model.pth").is_file():
        pytest.skip("no demo/ (scripts/make_demo.py)")
    args = bench.parse_args([])
    assert args.demo and args.checkpoint_path == bench.DEMO_DIR / "target" / "model.pth"
    assert args.draft_checkpoint_path == bench.DEMO_DIR / "head" / "draft.pth"
    assert args.out.parent == Path("bench_out") and not bench.parse_args(["--model", "tiny"]).demo


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "demo" / "head" / "draft.pth").is_file(), reason="no demo/ (scripts/make_demo.py)")
def test_bench_without_a_checkpoint_runs_the_demo_into_bench_out(tmp_path):
    proc = run_bench(["--depth", "3", "--tree_topk", "4", "--total_tokens", "16", "--repeats", "1",
                      "--max_seq_length", "256"], cwd=tmp_path)
    assert proc.returncode == 0 and "USDT" not in proc.stderr, proc.stderr[-2000:]
    (json_path,) = (tmp_path / "bench_out").glob("*.json")
    setup = json.loads(json_path.read_text())["setup"]
    assert setup["head"] == f"{ROOT / 'demo' / 'head' / 'draft.pth'} (EAGLE-1/2)"
    assert setup["side_tokens"] == generate.DEMO_MAX_NEW_TOKENS
    assert setup["side_by_side_prompt"].startswith(f"generate.py's demo prompt {DEMO_PROMPT!r}")
    assert f"wrote {json_path.relative_to(tmp_path)} and" in proc.stdout


def test_help_shows_every_default():
    """Every flag that takes a value says what it is when not given (switches are off when not given)."""
    text = run_bench(["--help"]).stdout
    options = re.split(r"\n  (?=-)", text.split("options:")[1])
    with_values = [o for o in options if re.match(r"--\w+ [{A-Z]", o)]
    assert len(with_values) >= 17 and not [o for o in with_values if "default" not in o], text


@pytest.mark.slow
def test_unwritable_out_is_refused_before_anything_is_measured(tmp_path):
    (tmp_path / "r.json").mkdir()
    proc = run_bench(["--model", "tiny", "--out", str(tmp_path / "r"), "--overwrite"])
    assert proc.returncode == 1 and proc.stderr == f"error: --out {tmp_path / 'r.json'} is a directory\n"
    assert "copy bandwidth" not in proc.stdout


def test_existing_results_are_kept(tmp_path):
    (tmp_path / "r.md").write_text("mine")
    expect_error(["--model", "tiny", "--out", str(tmp_path / "r")], "r.md exists; give another --out, or --overwrite",
                 bench.main)
    assert (tmp_path / "r.md").read_text() == "mine" and not (tmp_path / "r.json").exists()


def test_a_mistake_found_after_the_out_check_leaves_no_folder(tmp_path):
    expect_error(["--checkpoint_path", str(tmp_path / "missing" / "model.pth"), "--out", str(tmp_path / "new" / "r")],
                 "missing", bench.main)
    assert not (tmp_path / "new").exists()  # the folder is made once the models are loaded and checked
    (tmp_path / "a_file").write_text("mine")
    expect_error(["--model", "tiny", "--out", str(tmp_path / "a_file" / "sub" / "r")],
                 f"cannot make the folder: {tmp_path / 'a_file'} is not a writable folder", bench.main)


def test_out_names_the_pair_of_files():
    assert bench.out_files(Path("a/run.v2")) == (Path("a/run.v2.json"), Path("a/run.v2.md"))
    assert bench.out_files(Path("a/run.json")) == bench.out_files(Path("a/run.md")) == (Path("a/run.json"),
                                                                                       Path("a/run.md"))


def test_default_out_folder_is_ignored_by_git():
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    assert subprocess.run(["git", "check-ignore", "-q", "bench_out/20260101-000000.json"], cwd=ROOT).returncode == 0
    tracked_but_ignored = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT,
                                         capture_output=True, text=True).stdout
    assert tracked_but_ignored == ""


@pytest.mark.slow
def test_the_tree_depth_defaults_to_the_heads_own(tmp_path):
    """As in generate.py: an EAGLE-3 head decodes at depth 7 unless --depth says otherwise."""
    target, head = make_agreeing_eagle3_pair(tmp_path, missing=8)
    convert(target), convert(head)
    base = ["--checkpoint_path", str(target / "model.pth"), "--draft_checkpoint_path", str(head), "--device", "cpu",
            "--tree_topk", "4", "--total_tokens", "16", "--repeats", "1", "--side_tokens", "8", "--max_seq_length", "512"]
    bench.main(base + ["--out", str(tmp_path / "r7")])
    assert json.loads((tmp_path / "r7.json").read_text())["setup"]["tree"]["depth"] == 7
    args = bench.parse_args(base + ["--depth", "3"])  # the flag wins (the same function picks the tree)
    assert bench.flags_tree(args, load_draft(head / "draft.pth", load_target(target / "model.pth", "cpu", "fp32", 64))
                            ).depth == 3


@pytest.mark.slow
def test_bench_batch_sizes_sweep(tmp_path, capsys):
    """--batch_sizes: both modes at each size, the ratio and the crossover recomputed from the JSON."""
    bench.main(["--model", "tiny", "--batch_sizes", "1,2,3", "--out", str(tmp_path / "r")] + SMALL)
    results = json.loads((tmp_path / "r.json").read_text())
    sweep, md = results["batches"], (tmp_path / "r.md").read_text()
    plain, spec = sweep["rows"]["plain"], sweep["rows"]["EAGLE-2"]
    assert list(plain) == list(spec) == ["1", "2", "3"] and sweep["tokens"] == 12
    for b in plain:
        assert plain[b]["tokens_per_s"] > 0 and spec[b]["latency_s"] > 0 and spec[b]["tau"] >= 1
        ratio = spec[b]["tokens_per_s"] / plain[b]["tokens_per_s"]
        assert f"| batch {b} | {plain[b]['tokens_per_s']:.1f} | {spec[b]['tokens_per_s']:.1f} | {ratio:.2f}x |" in md
    stops = next((int(b) for b in plain if spec[b]["tokens_per_s"] <= plain[b]["tokens_per_s"]), None)
    assert sweep["eagle_stops_beating_plain_at"] == stops
    assert results["setup"]["batch_prompts"].startswith("random token ids")


@pytest.mark.parametrize("sizes", ["2,1", "0,1", "1,x"])
def test_bench_batch_sizes_must_increase(sizes):
    expect_error(["--model", "tiny", "--batch_sizes", sizes], "--batch_sizes", main=bench.main)


@pytest.mark.slow
def test_cuda_exact_checks_each_way_against_plain_eager_on_cpu(without_inductor):
    """scripts/cuda_exact.py (gpu_check --exact) on a CPU: fp32 ways, eager and compiled, give plain eager's tokens;
    a bf16 difference, if any, is reported at its first position with a top-2 gap that makes it a near-tie."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import cuda_exact
    assert cuda_exact.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert cuda_exact.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert cuda_exact.first_difference([1, 2, 3], [1, 2]) == 2
    # One way of each kind the script runs (eager, compiled -- traced by dynamo, run without inductor, whose CPU code
    # is not what a GPU runs --, a batch, bf16); what the other ways add is checked on a CPU by their own tests: a grammar and DFlash / DSpark trees
    # compiled (test_grammar.py, test_dflash.py, test_dspark.py), prefill chunks (eager under --compile too:
    # test_long_context.py).
    plan = [("fp32", "EAGLE-2, eager"), ("fp32", "EAGLE-2, compiled, logprobs"), ("fp32", "EAGLE-2, compiled, draft window 16"),
            ("bf16", "EAGLE-3, compiled"), ("fp32", "EAGLE-2, 3 prompts at once, compiled")]
    saved = []
    rows = cuda_exact.check_all("cpu", plan, n_tokens=64, budget_s=3600, save=saved.append)
    ways = rows["ways"]
    assert list(ways) == [f"{target}: {way}" for target, way in plan] and saved
    for key, row in ways.items():
        assert "error" not in row, row
        assert row["tau"] > 1.2  # the demo's heads accept for real
        if key.startswith("fp32"):
            assert row["same_tokens"], row
        for diff in (v for k, v in row.items() if k.startswith("prompt")):
            assert diff["top2_gap"] < 0.1, diff
    assert ways["fp32: EAGLE-2, compiled, logprobs"]["logprobs_close"]  # within 1e-3 nats of one causal forward
    # the window reached the head: the same tokens from other drafts (the logprobs way drafts as plain EAGLE-2 does)
    assert ways["fp32: EAGLE-2, compiled, draft window 16"]["tau"] != ways["fp32: EAGLE-2, compiled, logprobs"]["tau"]
    assert rows["all_checked_and_same"] == (not rows["differ_or_failed"])
    on_cpu = SimpleNamespace(device="cpu")  # CapturedGraphs are CUDA graphs: the way says so, never a CPU row
    assert cuda_exact.check_way(on_cpu, "EAGLE-2, captured graphs") == {"skipped": "CUDA graphs need CUDA"}


def test_bf16_rows_dry_run_measures_every_operation(tmp_path):
    """scripts/bf16_rows.py on a CPU (the GPU call's dry run): every operation of both settings measured, nothing
    failed; the norm, a row-wise operation, equal in every row; each linear timed both ways."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bf16_rows
    bf16_rows.main(["--out", str(tmp_path / "rows"), "--device", "cpu", "--shape", "tiny", "--rows", "8",
                    "--context", "16", "--repeats", "2"])
    results = json.loads((tmp_path / "rows" / "bf16_rows.json").read_text())
    ops = {"wqkv", "wo", "w13", "w2", "lm_head", "attention_norm", "attention (q/k/v, cache, SDPA, wo)", "logits"}
    for sections in results["settings"].values():
        assert set(sections) == ops
        assert all(r["rows"] == 8 and 0 <= r["rows_equal"] <= 8 for r in sections.values())
        assert sections["attention_norm"]["rows_equal"] == 8
        assert all(sections[name]["one_row_us"] > 0 and sections[name]["padded_us"] > 0
                   for name in ("wqkv", "wo", "w13", "w2", "lm_head"))
    assert "| defaults | logits |" in (tmp_path / "rows" / "bf16_rows.md").read_text()


def test_gpu_calls_every_flag_is_the_scripts_own_and_a_step_is_recorded(tmp_path):
    """scripts/gpu_calls.py: each step's GPU arguments name flags its script has (a typo would cost a device call,
    not a CPU test), a step's row is written when it ends, and a folder that holds files is refused."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_calls
    import speed_ab
    import drafter_cycles
    assert set(gpu_calls.SPEED_ROWS.split(",")) <= set(speed_ab.ROWS)  # rows the script has
    assert set(gpu_calls.CYCLE_ROWS.split(",")) <= set(drafter_cycles.ROWS)
    for step in (s for steps in gpu_calls.CALLS.values() for s in steps if s.gpu[0].endswith(".py")):
        assert step.gpu[0] == step.cpu[0] and (ROOT / step.gpu[0]).is_file()
        usage = subprocess.run([sys.executable, step.gpu[0], "--help"], cwd=ROOT, capture_output=True, text=True).stdout
        for flag in (a for a in step.gpu + step.cpu if a.startswith("--")):
            assert re.search(rf"{flag}\b", usage), (step.name, flag)
    for step in (s for steps in gpu_calls.CALLS.values() for s in steps if "--budget_s" in s.gpu):
        assert step.gpu[step.gpu.index("--budget_s") + 1] == "{budget}", step.name  # the step's own limit, less a margin
    said = tmp_path / "said"
    said.mkdir()
    echo = gpu_calls.Step("echo", "a step's budget", 40, ["-c", "print('budget {budget}')"], [])
    assert gpu_calls.run_step(echo, said, False, 40, "abc")[0] == 0
    assert f"budget {40 - gpu_calls.STEP_MARGIN_S}\n" in (said / "calls.log").read_text()
    out = tmp_path / "c1"
    gpu_calls.main(["--call", "1", "--out", str(out), "--only", "env", "--dry_run", "--commit", "abc1234"])
    table = (out / "calls.md").read_text()
    assert "call 1, commit abc1234, CPU dry run" in table and "| env | the machine | 0 |" in table
    assert "== env: -c" in (out / "calls.log").read_text() and "torch" in (out / "calls.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["calls.log", "calls.md"]  # one log for every step: few files
    for argv, said in ((["--call", "1", "--out", str(out)], "not an empty folder"),
                       (["--call", "2", "--out", str(tmp_path / "c2"), "--only", "speed_ab"], "names none of call 2"),
                       (["--call", "2", "--out", str(tmp_path / "c2"), "--budget_s", "nan"], "positive number"),
                       (["--call", "3", "--out", str(tmp_path / "c2")], "error: argument --call")):
        with pytest.raises(SystemExit) as e:
            gpu_calls.main(argv)
        assert said in str(e.value)


def test_forced_tokens_tau_counts_the_prefills_that_start_segments(capsys):
    """scripts/forced_tokens_tau.py: every reply starts with a prefill, so the prefills it counts are at least one a
    reply (it once counted none when the prefill moved to decode.prefill_chunks)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import forced_tokens_tau
    forced_tokens_tau.main(["--forced_min", "0", "--max_new_tokens", "4"])
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    cycles, prefills = int(row[3]), int(row[4])
    replies = len(forced_tokens_tau.SCHEMAS) * len(forced_tokens_tau.PROMPTS)
    assert prefills >= replies and cycles > 0


@pytest.mark.slow
def test_drafter_cycles_dry_run_writes_each_row_as_it_goes(tmp_path, without_inductor):
    """scripts/drafter_cycles.py on a CPU (the GPU call's dry run): the plain step and a block drafter's chain of its
    whole block, compiled, in plain steps and against its bytes floor; an --out that exists is refused."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import drafter_cycles
    out = tmp_path / "cycles"
    drafter_cycles.main(["--out", str(out), "--shape", "tiny", "--device", "cpu", "--repeats", "1",
                         "--rows", "XPress chain"])
    rows = json.loads((out / "cycles.json").read_text())["rows"]
    xpress = rows["XPress chain"]
    assert xpress["tree"] == [14, 1, 16] and xpress["draft_passes"] == 1  # the published block of 16, one pass
    assert xpress["phases"]["whole cycle"]["ms"] > 0 and xpress["floor_ms"] > 0
    # the plain step, measured after the rows, gives each row's cycle in plain steps
    plain_ms = json.loads((out / "cycles.json").read_text())["plain"]["step_ms"]
    assert xpress["phases"]["whole cycle"]["plain_steps"] == pytest.approx(xpress["phases"]["whole cycle"]["ms"] / plain_ms)
    table = (out / "cycles.md").read_text()
    assert "| XPress chain | 16 | 1 |" in table and "| plain step | 1 |" in table
    with pytest.raises(SystemExit, match="--out .* exists"):
        drafter_cycles.main(["--out", str(out), "--shape", "tiny", "--device", "cpu"])


@pytest.mark.slow
def test_speed_ab_dry_run_measures_its_rows_against_plain(tmp_path, without_inductor):
    """scripts/speed_ab.py on a CPU (the first GPU call's first step, dry): each row's tokens against the first plain
    row's, its time outside the call, the commit it was given; a row past the budget says so."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import speed_ab
    out = tmp_path / "ab"
    speed_ab.main(["--out", str(out), "--device", "cpu", "--shape", "reduced", "--tokens", "8", "--repeats", "1",
                   "--rows", "plain/trees,eagle2/trees/draft_vocab", "--commit", "abc1234"])
    results = json.loads((out / "speed_ab.json").read_text())
    assert results["setup"]["commit"] == "abc1234"
    plain, spec = results["rows"]["plain/trees"], results["rows"]["eagle2/trees/draft_vocab"]
    assert results["reference"] == "plain/trees" and spec["same_tokens_as_reference"] is True
    assert spec["tau"] > 1  # the demo's head, inflated, accepts
    assert plain["call_ms"] > 0 and spec["call_ms"] > plain["call_ms"]  # a 60-token verify and 7 draft passes
    # one graph a row: the timed calls take the sampling settings as generate() passes them (a SamplingConfig there
    # once compiled a second graph, and on CUDA captured it again, inside the warm-up calls that hide it)
    assert plain["graphs_compiled"] == spec["graphs_compiled"] == 1
    assert "timeline" in spec and (out / "timeline.json.gz").is_file()  # compressed: a GPU call brings back files of limited size
    table = (out / "speed_ab.md").read_text()
    assert "| eagle2/trees/draft_vocab |" in table and "same tokens as plain/trees" in table
    speed_ab.main(["--out", str(tmp_path / "late"), "--device", "cpu", "--shape", "reduced", "--budget_s", "1",
                   "--tokens", "4", "--repeats", "1", "--rows", "plain/trees,eagle2/trees/draft_vocab"])
    late = json.loads((tmp_path / "late" / "speed_ab.json").read_text())["rows"]  # the first row may start; then
    assert "spent; the longest row took" in late["eagle2/trees/draft_vocab"]["skipped"]  # none that would end late
