"""n-gram prompt lookup (lookup.py): its trees hold what followed the context's suffix, and greedy output equals plain
decoding through the Python API (logprobs too), a compiled verify and the command line."""
import pytest
import torch

from conftest import expect_error, run_cli
from batch import generate_batch
from decode import generate
from graphs import compile_step
from load import load_target
from lookup import NgramIndex, NgramLookup, lookup_cycle
from sampling import SamplingConfig

GREEDY = SamplingConfig()
PROMPTS = ([1, 5, 9, 11, 30], [1, 7, 8, 9, 10, 11, 12, 40, 41, 42])
REPEATING = [1] + [5, 9, 11, 30, 40, 7, 8, 22] * 5 + [5, 9]


@pytest.fixture(scope="module")
def target(checkpoints):
    folder, _ = checkpoints("llama2")
    return folder, load_target(folder / "model.pth", "cpu", "fp32", 256)


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


def test_ngram_lookup_in_a_batch_gives_each_row_its_tokens_alone(target):
    _, model = target
    prompts = [REPEATING, PROMPTS[1], REPEATING[:20]]
    model.setup_caches(3, 256)
    try:
        together = generate_batch(model, prompts, 40, GREEDY, lookup=NgramLookup())
        alone = [generate(model, p, 40, GREEDY) for p in prompts]
    finally:
        model.setup_caches(1, 256)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert max(together[0].accept_lengths) > 2  # drafts were accepted in the batch
