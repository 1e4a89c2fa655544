"""bench.py end to end on tiny models (numbers printed, not asserted), and torch.compile on CPU without
recompilation."""
import json

import torch

import bench
import generate
from conftest import ROOT, SHARED, head_config, random_head_weights, write_eagle_head
from convert_hf_checkpoint import convert
from generate import SamplingConfig, TreeConfig, compile_step, decode_one_token, load_draft, load_target

SMALL = ["--depth", "3", "--tree_topk", "4", "--total_tokens", "16", "--repeats", "2", "--side_tokens", "12"]


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


def test_kernel_table_counts_what_a_call_runs():
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def call():
        torch.mm(a, b)
        torch.mm(b, a)
        torch.softmax(a, dim=-1)

    table = bench.kernel_table(call, "cpu", calls=4)
    rows = {row["name"]: row for row in table["top"]}
    assert table["unit"].startswith("CPU") and rows["aten::mm"]["per_call"] == 2
    assert rows["aten::mm"]["us_per_call"] > 0 and "aten::_softmax" in rows
    assert table["ms_per_call"] * 1e3 >= sum(row["us_per_call"] for row in table["top"]) > 0


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
    print((tmp_path / "r.md").read_text())


def test_compiled_plain_decoding_does_not_recompile(checkpoints):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    path, _ = checkpoints("llama31")
    model = load_target(path / "model.pth", "cpu", "fp32", 128)
    step = compile_step(decode_one_token, "cpu")
    for prompt in ([1, 5, 9], [1, 7, 8, 9, 10, 11, 12]):
        eager = generate.generate(model, prompt, 20, SamplingConfig())
        compiled = generate.generate(model, prompt, 20, SamplingConfig(), step_fn=step)
        assert compiled.tokens == eager.tokens
    assert counters["stats"]["unique_graphs"] == 1  # one graph for every step of both prompts


def test_compiled_speculative_cycle_does_not_recompile(tmp_path):
    from conftest import make_agreeing_pair
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    target, head, _ = make_agreeing_pair(tmp_path, vocab=32, hidden=32, wrong_fraction=0.3)
    convert(target), convert(head)
    model = load_target(target / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(head / "draft.pth", model)
    tree = TreeConfig(depth=2, topk=3, total_tokens=8)
    step = compile_step(generate.speculative_cycle, "cpu")
    lengths = set()
    for prompt in ([1, 5, 9], [1, 7, 8, 9, 10, 11, 12]):
        eager = generate.generate(model, prompt, 30, SamplingConfig(), draft=draft, tree=tree)
        compiled = generate.generate(model, prompt, 30, SamplingConfig(), draft=draft, tree=tree, step_fn=step)
        assert compiled.tokens == eager.tokens and compiled.accept_lengths == eager.accept_lengths
        lengths |= set(compiled.accept_lengths)
    assert len(lengths) >= 2  # different accepted lengths went through the same graph
    assert counters["stats"]["unique_graphs"] == 1


def test_gpu_check_quick_runs_on_cpu(tmp_path):
    """scripts/gpu_check.py --quick as a CPU smoke test: every section runs, compiled == eager, no recompiles."""
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


def test_gpu_check_plain_only_measures_a_shape_on_cpu(tmp_path, monkeypatch):
    """gpu_check --plain_only (the A/B run) skips the checks and measures the compiled plain step of each shape,
    then the cache-size comparison, here on a small shape added for the test."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    monkeypatch.setitem(gpu_check.SHAPES, "small-test", {**gpu_check.REDUCED, "max_position_embeddings": 1024})
    gpu_check.main(["--plain_only", "--device", "cpu", "--shapes", "small-test", "--out", str(tmp_path / "g"),
                    "--repeats", "2", "--max_seq_length", "256", "--draft_vocab", "4096"])
    results = json.loads((tmp_path / "g" / "results.json").read_text())
    assert not [name for name, r in results.items() if "error" in r], results
    assert "compiled vs eager (reduced shape, fp32)" not in results
    plain = results["small-test (inflated demo)"]["plain"]
    assert plain["tokens_per_s"] > 0 and plain["recompiles_after_warmup"] == 0
    assert set(results["small-test (inflated demo)"]) == {"weights_GB", "plain", "section_seconds", "draft_vocab"}
    assert results["setup"]["draft_vocab"] == 4096
    sizes = results["plain step at context 256: 512 vs 8192 cache slots"]
    assert set(sizes) >= {"512 slots", "1024 slots"} and sizes["1024 slots"]["recompiles_after_warmup"] == 0
