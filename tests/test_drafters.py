"""Drafting without a trained head: a draft model (draft_model.py) and n-gram prompt lookup (lookup.py). Greedy
output equals plain decoding for both, through the Python API, the command line, batches, stepping aside and a
compiled cycle; a draft model that is the target itself has every draft accepted (its positions line up with the
target's); the lookup's trees hold what followed the context's suffix."""
import json

import pytest
import torch

from batch import generate_batch
from conftest import check_compiled_cycle, expect_error, run_cli
from decode import TreeConfig, generate
from graphs import compile_step
from load import load_draft_model, load_target
from lookup import NgramIndex, NgramLookup, lookup_cycle
from sampling import SamplingConfig
from step_aside import StepAside

GREEDY = SamplingConfig()
PROMPTS = ([1, 5, 9, 11, 30], [1, 7, 8, 9, 10, 11, 12, 40, 41, 42])
REPEATING = [1] + [5, 9, 11, 30, 40, 7, 8, 22] * 5 + [5, 9]


@pytest.fixture(scope="module")
def target(checkpoints):
    folder, _ = checkpoints("llama2")
    return folder, load_target(folder / "model.pth", "cpu", "fp32", 256)


@pytest.mark.parametrize("tree", [TreeConfig(4, 1, 6), TreeConfig(3, 3, 12)], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["llama2", "qwen2"])
def test_a_draft_model_decodes_as_plain_decoding(checkpoints, target, kind, tree):
    """The target drafted for by itself (every draft the target's own pick: a chain's cycles emit depth + 2 tokens
    but where the generation ends) and by another model of its vocabulary (Qwen2's biases and tied embeddings)."""
    folder, model = target
    draft = load_draft_model(checkpoints(kind)[0], model)
    for prompt in PROMPTS:
        plain = generate(model, prompt, 40, GREEDY)
        spec = generate(model, prompt, 40, GREEDY, draft=draft, tree=tree)
        assert spec.tokens == plain.tokens
        if kind == "llama2" and tree.topk == 1:
            assert set(spec.accept_lengths[:-1]) == {tree.levels}  # depth + 1 drafts and the bonus


def test_a_draft_model_in_a_batch_and_stepping_aside(checkpoints, target):
    folder, model = target
    model.setup_caches(2, 256)
    draft = load_draft_model(checkpoints("qwen2")[0], model)
    draft.setup_caches(256, 2)
    tree = TreeConfig(3, 2, 8)
    alone = [generate(model, p, 30, GREEDY, draft=draft, tree=tree) for p in PROMPTS]
    together = generate_batch(model, list(PROMPTS), 30, GREEDY, draft=draft, tree=tree)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.accept_lengths for r in together] == [r.accept_lengths for r in alone]
    gate = StepAside(retry_after=4, trial_cycles=1, clock=iter(range(0, 10 ** 6, 7)).__next__)
    aside = generate(model, PROMPTS[1], 40, GREEDY, draft=draft, tree=tree, step_aside=gate)
    assert aside.tokens == generate(model, PROMPTS[1], 40, GREEDY).tokens and gate.switches >= 2
    model.setup_caches(1, 256)


@pytest.mark.slow
def test_a_draft_model_compiles_into_one_cycle(target):
    folder, model = target
    assert check_compiled_cycle(model, load_draft_model(folder, model), TreeConfig(4, 1, 6)) == {6}


def test_the_command_line_takes_a_draft_model_and_refuses_another_vocabulary(tmp_path, checkpoints, target):
    folder, _ = target
    base = ["--checkpoint_path", str(folder), "--device", "cpu", "--prompt", "w3 w4 w5 w6", "--max_new_tokens", "30",
            "--step_aside", "off"]
    plain = run_cli(tmp_path, base)
    drafted = run_cli(tmp_path, base + ["--draft_model", str(folder), "--tree_topk", "1"])
    assert drafted["tokens"] == plain["tokens"] and drafted["tau"] > 4
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((checkpoints("qwen2")[0] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    state = torch.load(checkpoints("qwen2")[0] / "model.pth", weights_only=True)
    state = {k: torch.cat([v, v[:4]]) if k in ("tok_embeddings.weight", "output.weight") else v for k, v in state.items()}
    torch.save(state, other / "model.pth")
    expect_error(base + ["--draft_model", str(other)], "must share the target's vocabulary")
    expect_error(base + ["--draft_model", str(folder), "--ngram"], "give one drafter")


def test_the_lookup_finds_the_continuations_of_the_longest_suffix_most_recent_first():
    index = NgramIndex(NgramLookup(depth=3, topk=3, total_tokens=16, max_ngram=3, min_ngram=1))
    index.extend([7, 1, 2, 3, 4, 9, 1, 2, 5, 6, 2, 8, 1, 2])
    # suffix [1, 2] (no earlier [8, 1, 2]): after its latest occurrence 5 6 2, then 3 4 9; then suffix [2]: 8 1 2
    assert index.continuations() == [(5, 6, 2), (3, 4, 9), (8, 1, 2)]
    tree = index.tree("cpu")
    assert tree.tokens.tolist()[:10] == [2, 5, 6, 2, 3, 4, 9, 8, 1, 2] and len(tree.tokens) == 16  # 10 in a size of 16
    assert tree.parents.tolist()[:10] == [0, 0, 1, 2, 0, 4, 5, 0, 7, 8]
    assert torch.isinf(tree.draft_logp[10:]).all() and not torch.isinf(tree.draft_logp[:10]).any()
    assert tree.ancestors[9].nonzero().flatten().tolist() == [0, 7, 8, 9]
    index.extend([5, 6])  # [1, 2, 5, 6] again: the longest suffix, [2, 5, 6], has one earlier occurrence
    assert index.continuations()[0] == (2, 8, 1)
    index.extend([77])
    assert index.continuations() == [] and index.tree("cpu") is None


@pytest.mark.parametrize("lookup", [NgramLookup(), NgramLookup(depth=3, topk=1, total_tokens=4),
                                    NgramLookup(max_ngram=2, min_ngram=1)], ids=["default", "chain", "short"])
def test_ngram_lookup_decodes_as_plain_decoding(target, lookup):
    _, model = target
    for prompt in (REPEATING, PROMPTS[1]):
        plain = generate(model, prompt, 60, GREEDY)
        spec = generate(model, prompt, 60, GREEDY, lookup=lookup)
        assert spec.tokens == plain.tokens
        assert sum(spec.accept_lengths) + spec.plain_tokens == len(spec.tokens) - 1  # the prefill gave the first
    assert max(spec.accept_lengths) > 2  # drafts were accepted


def test_ngram_lookup_scores_tokens_and_compiles_one_graph(target):
    from torch._dynamo.utils import counters
    _, model = target
    scored = SamplingConfig(logprobs=2)
    plain = generate(model, REPEATING, 40, scored)
    spec = generate(model, REPEATING, 40, scored, lookup=NgramLookup())
    assert spec.tokens == plain.tokens
    for (lp, top), (want, want_top) in zip(spec.logprobs, plain.logprobs):
        assert lp == pytest.approx(want, abs=1e-4) and [t for t, _ in top] == [t for t, _ in want_top]
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(model, REPEATING, 60, GREEDY, lookup=NgramLookup(), step_fn=compile_step(lookup_cycle, "cpu"))
    assert compiled.tokens == generate(model, REPEATING, 60, GREEDY).tokens
    assert counters["stats"]["unique_graphs"] == 1  # trees of every size share one graph (dynamic on a CPU)


def test_the_command_line_decodes_with_ngram_lookup(tmp_path, target):
    folder, _ = target
    prompt = " ".join(f"w{t}" for t in REPEATING[1:])
    base = ["--checkpoint_path", str(folder), "--device", "cpu", "--prompt", prompt, "--max_new_tokens", "40"]
    plain = run_cli(tmp_path, base)
    looked_up = run_cli(tmp_path, base + ["--ngram", "--depth", "6"])
    assert looked_up["tokens"] == plain["tokens"] and looked_up["tau"] > 1
    expect_error(base + ["--ngram", "--ngram_min", "3", "--ngram_max", "2"], "larger than --ngram_max")
    expect_error(base + ["--ngram", "--tree", "auto"], "--tree auto")
