"""--tree auto: the tree picked from measured tau and (injected) cycle times, its cache, its refusals, and the CLI
end to end on the demo (lossless against plain decoding); bench.py --tune_tree's report."""
import json

import pytest

import bench
import generate
import measure
import decode
from load import load_draft, load_target
from tokenizer import Tokenizer
import tune
from conftest import ROOT, expect_error, read_generation
from decode import TreeConfig
from sampling import SamplingConfig
from model import EagletError
from tune import TreeMeasure

pytestmark = pytest.mark.skipif(not (ROOT / "demo" / "head" / "draft.pth").is_file(),
                                reason="no demo/ (scripts/make_demo.py)")
GRID = ((2, 1, 3), (4, 1, 5), (2, 3, 8), (3, 4, 12))  # two chains, two trees
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def demo():
    model = load_target(ROOT / "demo" / "target", "cpu", "fp32", max_seq_length=256)
    draft = load_draft(ROOT / "demo" / "head", model)
    tokenizer = Tokenizer(ROOT / "demo" / "target")
    prompts = [tokenizer.encode(text) for text in tune.CALIBRATION_PROMPTS[:2]]
    return model, draft, prompts


@pytest.fixture(scope="module")
def taus(demo):
    """Each tree's tau, computed here from generate()'s own runs: tokens emitted in a run's cycles but its last
    (cut at NEW_TOKENS), over those cycles."""
    model, draft, prompts = demo
    out = {}
    for point in GRID:
        emitted = cycles = 0
        for prompt in prompts:
            tree = TreeConfig(*point)
            result = decode.generate(model, prompt, NEW_TOKENS, SamplingConfig(), draft=draft, tree=tree)
            assert len(result.tokens) == NEW_TOKENS and sum(result.accept_lengths) == NEW_TOKENS - 1  # 1: prefill
            emitted += NEW_TOKENS - 1 - result.accept_lengths[-1]
            cycles += len(result.accept_lengths) - 1
        out[point] = emitted / cycles
    assert len(set(out.values())) > 1  # the trees differ, so the choice means something
    return out


class FakeTimer:
    """Seconds per cycle from a table, by (depth, tree_topk, total_tokens); counts its calls."""

    def __init__(self, seconds: dict):
        self.seconds, self.calls = seconds, 0

    def __call__(self, target, draft, tree, start):
        self.calls += 1
        root, ctx_len, h_last = start
        assert root.ndim == 0 and h_last.shape == (target.args.dim,)  # the cycle's real inputs
        return self.seconds[(tree.depth, tree.topk, tree.total_tokens)]


@pytest.fixture
def fake_tau(monkeypatch, taus):
    """measure_tau replaced by the taus computed once (the cache's tests need no decoding); counts its calls."""
    calls = []

    def measure(target, draft, tree, prompts, new_tokens):
        calls.append(tree)
        return taus[(tree.depth, tree.topk, tree.total_tokens)]
    monkeypatch.setattr(tune, "measure_tau", measure)
    return calls


def expected_choice(taus: dict, seconds: dict) -> tuple:
    """The argmax of tau / seconds, ties to the fewest total_tokens, then the smaller depth and top-k."""
    best = max(taus[p] / seconds[p] for p in taus)
    return min((p for p in taus if taus[p] / seconds[p] == best), key=lambda p: (p[2], p[0], p[1]))


def test_grid_holds_chains_and_the_default_and_is_in_help(capsys):
    trees = [TreeConfig(*point) for point in tune.TREE_GRID]  # raises for a total_tokens past the tree's max
    assert (6, 10, 60) in tune.TREE_GRID and len(set(tune.TREE_GRID)) == len(trees)
    assert [t for t in trees if t.topk == 1 and t.total_tokens == t.depth + 1]
    assert all(2 <= t.total_tokens <= t.max_total_tokens for t in trees)
    with pytest.raises(SystemExit):
        generate.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert tune.grid_text(tune.TREE_GRID) in help_text and "3/1/4" in help_text


@pytest.mark.parametrize("winner", [1, 2])
def test_choice_is_the_argmax_of_tau_over_cycle_time(demo, taus, winner, capsys):
    """Cycle times made so that tree `winner` has the most tau / time, though neither the highest tau nor the
    fastest cycle; the tuner's taus are the ones computed here from generate()."""
    model, draft, prompts = demo
    score = {p: 1.0 for p in GRID}
    score[GRID[winner]] = 1.5
    seconds = {p: taus[p] / score[p] for p in GRID}
    chosen, measured = tune.tune_tree(model, draft, prompts, GRID, NEW_TOKENS, FakeTimer(seconds))
    assert [(m.tree.depth, m.tree.topk, m.tree.total_tokens) for m in measured] == list(GRID)
    assert [m.tau for m in measured] == pytest.approx([taus[p] for p in GRID])
    assert (chosen.depth, chosen.topk, chosen.total_tokens) == expected_choice(taus, seconds) == GRID[winner]
    out = capsys.readouterr().out
    for m in measured:
        assert f"{tune.tree_name(m.tree)}: tau {m.tau:.2f}, {m.cycle_s * 1e3:.2f} ms per cycle, " \
               f"{m.tau / m.cycle_s:.1f} tokens/s" in out
    assert f"tree auto: {tune.tree_name(chosen)} (" in out and "s of tuning" in out


def test_the_same_timings_give_the_same_choice(demo, fake_tau):
    model, draft, prompts = demo
    seconds = {p: 0.01 * (1 + i) for i, p in enumerate(GRID)}
    runs = [tune.tune_tree(model, draft, prompts, GRID, NEW_TOKENS, FakeTimer(seconds), log=lambda s: None)
            for _ in range(2)]
    assert runs[0][0] == runs[1][0] and [m.tau for m in runs[0][1]] == [m.tau for m in runs[1][1]]


def test_a_tie_goes_to_the_fewest_tokens_then_the_smaller_depth():
    rows = [TreeMeasure(TreeConfig(3, 4, 12), 4.0, 1.0), TreeMeasure(TreeConfig(3, 1, 4), 2.0, 0.5),
            TreeMeasure(TreeConfig(2, 4, 12), 4.0, 1.0), TreeMeasure(TreeConfig(2, 3, 8), 3.0, 1.0)]
    assert tune.best_tree(rows).tree == TreeConfig(3, 1, 4)
    assert tune.best_tree([rows[0], rows[2]]).tree == TreeConfig(2, 4, 12)
    assert tune.best_tree(rows[::-1]).tree == TreeConfig(3, 1, 4)  # not the order measured


def key_for(demo, **changes):
    """The demo's key on this CPU, with some of its fields changed (another device, another format)."""
    model, draft, prompts = demo
    key = tune.tree_key(ROOT / "demo" / "target" / "model.pth", ROOT / "demo" / "head" / "draft.pth", model,
                            draft, "cpu", "fp32", prompts, GRID, NEW_TOKENS)
    assert all(name in key for name in changes)
    return {**key, **changes}


def test_the_choice_is_cached_per_key(demo, taus, fake_tau, tmp_path):
    model, draft, prompts = demo
    cache, lines = tmp_path / "sub" / "tree_choice.json", []
    first = {p: taus[p] / (2.0 if p == GRID[0] else 1.0) for p in GRID}  # GRID[0] wins
    second = {p: taus[p] / (2.0 if p == GRID[3] else 1.0) for p in GRID}  # GRID[3] wins
    timer = FakeTimer(first)
    pick = lambda key, timer: tune.pick_tree(model, draft, prompts, key, cache, GRID, NEW_TOKENS,  # noqa: E731
                                                 timer=timer, log=lines.append)
    key = key_for(demo)
    assert pick(key, timer) == TreeConfig(*GRID[0]) and timer.calls == len(GRID)
    entry, = json.loads(cache.read_text())["choices"]
    assert entry["key"] == key and entry["tree"] == {"depth": 2, "topk": 1, "total_tokens": 3}
    assert [m["tau"] for m in entry["measured"]] == pytest.approx([taus[p] for p in GRID])
    lines.clear()
    assert pick(key, timer) == TreeConfig(*GRID[0]) and timer.calls == len(fake_tau) == len(GRID)  # not again
    assert lines == [f"tree auto: {tune.tree_name(TreeConfig(*GRID[0]))}, read from {cache} (tuned before for "
                     "this target, head, device and format; not measured again: delete the file to tune again)"]
    # another device, another format: measured again, each key keeps its own choice
    for n, other in enumerate([key_for(demo, device="NVIDIA H100 80GB HBM3"), key_for(demo, weights="int4 g128")]):
        timer = FakeTimer(second)
        assert pick(other, timer) == TreeConfig(*GRID[3]) and timer.calls == len(GRID)
        assert len(json.loads(cache.read_text())["choices"]) == 2 + n
    timer = FakeTimer(second)
    assert pick(key, timer) == TreeConfig(*GRID[0]) and timer.calls == 0


def test_the_key_names_what_the_choice_depends_on(demo):
    key = key_for(demo)
    assert key["device"] == "cpu" and key["weights"] == "float32" and key["precision"] == "fp32"
    assert key["target"]["path"] == str((ROOT / "demo" / "target" / "model.pth").resolve())
    assert key["head"]["bytes"] == (ROOT / "demo" / "head" / "draft.pth").stat().st_size
    assert key["grid"] == [list(p) for p in GRID] and key["calibration"]["new_tokens"] == NEW_TOKENS
    model, draft, prompts = demo
    other_prompts = tune.tree_key(ROOT / "demo" / "target" / "model.pth", ROOT / "demo" / "head" / "draft.pth",
                                      model, draft, "cpu", "fp32", prompts[:1], GRID, NEW_TOKENS)
    assert other_prompts["calibration"] != key["calibration"]


CORRUPT = {"not JSON": "{\"choices\": [", "a list": "[]", "no list of choices": "{\"choices\": 3}",
           "an entry without a tree": None, "a tree past its max": {"depth": 2, "topk": 1, "total_tokens": 9},
           "a tree not in the grid": {"depth": 6, "topk": 10, "total_tokens": 60}}


@pytest.mark.parametrize("case", CORRUPT)
def test_a_corrupt_cache_is_said_and_tuned_again(demo, taus, fake_tau, tmp_path, case):
    model, draft, prompts = demo
    cache, key, lines = tmp_path / "tree_choice.json", key_for(demo), []
    text = CORRUPT[case]
    if not isinstance(text, str):  # an entry for this very key, holding a bad tree
        text = json.dumps({"choices": [{"key": key, **({"tree": text} if text else {})}]})
    cache.write_text(text)
    timer = FakeTimer({p: taus[p] / (2.0 if p == GRID[2] else 1.0) for p in GRID})
    tree = tune.pick_tree(model, draft, prompts, key, cache, GRID, NEW_TOKENS, timer=timer, log=lines.append)
    assert tree == TreeConfig(*GRID[2]) and timer.calls == len(GRID)
    assert lines[0].startswith(f"warning: the tree cache {cache} cannot be read (") and lines[0].endswith(
        "); tuning again")
    assert json.loads(cache.read_text())["choices"][-1]["tree"] == {"depth": 2, "topk": 3, "total_tokens": 8}


@pytest.mark.parametrize("blocked", ["a folder where the file should be", "a file where its folder should be"])
def test_a_cache_that_cannot_be_written_is_said_and_the_run_goes_on(demo, taus, fake_tau, tmp_path, blocked):
    model, draft, prompts = demo
    cache, lines = tmp_path / "cache" / "tree_choice.json", []
    if blocked.startswith("a folder"):
        cache.mkdir(parents=True)
    else:
        cache.parent.write_text("x")  # EAGLET_CACHE naming a file
    timer = FakeTimer({p: 1.0 for p in GRID})
    tree = tune.pick_tree(model, draft, prompts, key_for(demo), cache, GRID, NEW_TOKENS, timer=timer,
                              log=lines.append)
    best = max(GRID, key=lambda p: (taus[p], -p[2]))
    assert tree == TreeConfig(*best) and timer.calls == len(GRID)
    assert "cannot be read" in lines[0] or blocked.startswith("a file")
    assert lines[-1].startswith(f"warning: could not save the tree choice to {cache}")


def test_a_grid_that_does_not_fit_the_cache_is_refused_before_measuring(demo):
    model, draft, prompts = demo
    timer = FakeTimer({})
    longest = max(map(len, prompts))
    size = model.max_seq_length
    model.setup_caches(1, longest + NEW_TOKENS + 11)  # room for the first three trees' scratch, not (3, 4, 12)'s
    draft.setup_caches(model.max_seq_length)
    try:
        with pytest.raises(EagletError, match=r"--tree auto: the tree depth 3, top-k 4, 12 tokens needs 12 scratch "
                           rf"slots; with the longest calibration prompt \({longest} tokens\) and its {NEW_TOKENS} new "
                           rf"tokens that is {longest + NEW_TOKENS + 12}, over the KV cache"):
            tune.tune_tree(model, draft, prompts, GRID, NEW_TOKENS, timer)
        with pytest.raises(EagletError, match="total_tokens must be between 2 and 4"):  # past its max_total_tokens
            tune.tune_tree(model, draft, prompts, ((2, 1, 3), (2, 1, 5)), NEW_TOKENS, timer)
        assert timer.calls == 0
    finally:
        model.setup_caches(1, size)
        draft.setup_caches(size)


def test_cli_refuses_what_tree_auto_cannot_do():
    expect_error(["--tree", "auto", "--total_tokens", "16"], "--tree auto picks depth, tree_topk and total_tokens "
                 "itself: leave out --total_tokens")
    expect_error(["--tree", "auto", "--depth", "3"], "leave out --depth")
    expect_error(["--tree", "auto", "--no_draft"], "--tree auto tunes the draft tree: it needs a head")
    # the run fits in 100 slots; the tuning's longest prompt, its 64 tokens and the larger trees' scratch do not
    expect_error(["--tree", "auto", "--max_new_tokens", "4", "--max_seq_length", "100"],
                 "scratch slots; with the longest calibration prompt")
    expect_error(["--tree", "auto", "--max_new_tokens", "4", "--max_seq_length", "100"],
                 "over the KV cache (100 slots; --max_seq_length ")


def test_a_cache_too_small_for_the_tuning_is_told_the_size_that_fits_every_tree():
    """One error, not one a tree: the size it names runs the whole grid, a slot less does not."""
    from model import EagletError
    trees, prompts = [decode.TreeConfig(*point) for point in tune.TREE_GRID], [[1] * 17, [1] * 40]
    with pytest.raises(EagletError, match=r"--max_seq_length (\d+) or more") as e:
        tune.check_tune_fits(trees, prompts, 64, 100, 1000)
    need = int(e.value.args[0].split("--max_seq_length ")[1].split()[0])
    assert need == 40 + 64 + max(tree.scratch for tree in trees)
    tune.check_tune_fits(trees, prompts, 64, need, 1000)
    with pytest.raises(EagletError, match=f"that is {need}, over the KV cache \\({need - 1} slots"):
        tune.check_tune_fits(trees, prompts, 64, need - 1, 1000)


def test_cli_tree_auto_end_to_end_equals_plain_decoding(tmp_path, monkeypatch, capsys):
    """--tree auto on the demo tunes (a small grid, real timings), decodes with its choice exactly as plain
    decoding does, and the second run reads the choice from the cache."""
    grid = (GRID[1], GRID[3])
    monkeypatch.setattr(tune, "TREE_GRID", grid)
    monkeypatch.setattr(tune, "CALIBRATION_PROMPTS", tune.CALIBRATION_PROMPTS[:1])
    monkeypatch.setattr(tune, "CALIBRATION_TOKENS", NEW_TOKENS)
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))
    base = ["--max_new_tokens", "30", "--device", "cpu"]
    generate.main(base + ["--no_draft", "--json_out", str(tmp_path / "plain.json")])
    capsys.readouterr()
    runs = []
    for n in range(2):
        generate.main(base + ["--tree", "auto", "--json_out", str(tmp_path / f"auto{n}.json")])
        runs.append(capsys.readouterr().out)
        assert read_generation(tmp_path / f"auto{n}.json")["tokens"] == \
            read_generation(tmp_path / "plain.json")["tokens"]
    entry, = json.loads((tmp_path / "cache" / "tree_choice.json").read_text())["choices"]
    chosen = TreeConfig(**entry["tree"])
    assert (chosen.depth, chosen.topk, chosen.total_tokens) in grid
    assert "tree auto: measuring 2 trees" in runs[0] and f"tree auto: {tune.tree_name(chosen)} (" in runs[0]
    assert sum(line.startswith("  depth ") and "ms per cycle" in line for line in runs[0].splitlines()) == 2
    assert "measuring" not in runs[1] and f"tree auto: {tune.tree_name(chosen)}, read from" in runs[1]
    for out in runs:  # the run's own tree is the choice
        assert f"tree {chosen.total_tokens} tokens, depth {chosen.depth}, top-k {chosen.topk};" in out


@pytest.mark.slow
def test_bench_tune_tree_reports_the_choice_against_the_flags_tree(tmp_path, monkeypatch):
    for module in (bench, measure):  # bench.py checks the grid fits, measure.py measures it
        monkeypatch.setattr(module, "TREE_GRID", GRID)
        monkeypatch.setattr(module, "CALIBRATION_TOKENS", NEW_TOKENS)
    bench.main(["--model", "tiny", "--tune_tree", "--depth", "3", "--tree_topk", "4", "--total_tokens", "16",
                "--repeats", "1", "--side_tokens", "12", "--out", str(tmp_path / "r")])
    results = json.loads((tmp_path / "r.json").read_text())
    tuned, md = results["tuned_tree"], (tmp_path / "r.md").read_text()
    assert [(r["depth"], r["topk"], r["total_tokens"]) for r in tuned["grid"]] == list(GRID)
    for r in tuned["grid"]:
        assert r["tokens_per_s"] == pytest.approx(r["tau"] / r["cycle_ms"] * 1e3)
        assert f"| {r['tau']:.2f} | {r['cycle_ms']:.3f} | {r['tokens_per_s']:.1f} |" in md
    best = max(tuned["grid"], key=lambda r: (r["tokens_per_s"], -r["total_tokens"], -r["depth"], -r["topk"]))
    assert tuned["chosen"] == {k: best[k] for k in ("depth", "topk", "total_tokens")}
    runs = tuned["end_to_end"]
    assert runs["flags"]["tree"] == {"depth": 3, "topk": 4, "total_tokens": 16} and runs["tuned"]["tree"] == \
        tuned["chosen"]
    assert all(r["tokens_per_s"] > 0 and r["tau"] >= 1 for r in runs.values()) and tuned["same_tokens"]
    assert tuned["speedup"] == pytest.approx(runs["tuned"]["tokens_per_s"] / runs["flags"]["tokens_per_s"])
    assert f"Chosen: {tune.tree_name(TreeConfig(**tuned['chosen']))}, in" in md and "| flags: depth 3" in md


def test_bench_tune_tree_is_refused_before_measuring_when_it_does_not_fit(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "CALIBRATION_TOKENS", 500)
    expect_error(["--model", "tiny", "--tune_tree", "--max_seq_length", "256", "--out", str(tmp_path / "r")],
                 "--tree auto: the tree depth", bench.main)
    assert "copy bandwidth" not in capsys.readouterr().out


def test_cli_tree_auto_with_several_prompts_tunes_at_batch_1(tmp_path, monkeypatch, capsys):
    """Two prompts decoded together: the tuning runs on one-row caches, then the batch on two rows, each prompt's
    tokens as plain decoding's."""
    timer = FakeTimer({GRID[1]: 1.0, GRID[3]: 2.0})
    monkeypatch.setattr(tune, "time_cycle", timer)
    monkeypatch.setattr(tune, "TREE_GRID", (GRID[1], GRID[3]))
    monkeypatch.setattr(tune, "CALIBRATION_PROMPTS", tune.CALIBRATION_PROMPTS[:1])
    monkeypatch.setattr(tune, "CALIBRATION_TOKENS", NEW_TOKENS)
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))
    base = ["--prompt", "def f(x):\n", "--prompt", "import os\n", "--max_new_tokens", "20", "--device", "cpu"]
    generate.main(base + ["--tree", "auto", "--json_out", str(tmp_path / "auto.json")])
    generate.main(base + ["--no_draft", "--json_out", str(tmp_path / "plain.json")])
    assert timer.calls == 2 and "2 prompts, 2 at a time" in capsys.readouterr().out
    auto, plain = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("auto", "plain"))
    assert [p["samples"][0]["tokens"] for p in auto] == [p["samples"][0]["tokens"] for p in plain]
    assert all(len(p["samples"][0]["tokens"]) == 20 for p in auto)
