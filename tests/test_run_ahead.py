"""Running ahead (generate's default on CUDA, forced here on CPU): step or cycle k+1 is queued before the host reads
step k's tokens. The output must not change -- tokens, accepted lengths, sampled draws, stops, the caches a second
chat turn reuses -- and the extra call must never write past the cache."""
import pytest
import torch

from checkpoint import EagletError
from decode import TreeConfig, generate, speculative_cycle
from sampling import SamplingConfig
from tokenizer import Tokenizer
from conftest import ROOT
from load import load_draft, load_target

DEMO = ROOT / "demo"
GREEDY = SamplingConfig()
PROMPTS = ["def read_lines(path):\n", "import os\n\n\ndef main(", "class Stack:\n    def push(self, item):"]

pytestmark = pytest.mark.skipif(not (DEMO / "target" / "model.pth").is_file(), reason="no demo/")


@pytest.fixture(scope="module")
def demo():
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 256)
    draft = load_draft(DEMO / "head" / "draft.pth", target)
    tokenizer = Tokenizer(DEMO / "target")
    return target, draft, [tokenizer.encode(p, bos=True) for p in PROMPTS]


def both(target, prompt, n, sampling=GREEDY, seed=None, **kwargs):
    """The same generation without and with running ahead (the same seed before each when sampling)."""
    results = []
    for ahead in (False, True):
        if seed is not None:
            torch.manual_seed(seed)
        results.append(generate(target, prompt, n, sampling, run_ahead=ahead, **kwargs))
    return results


@pytest.mark.parametrize("speculative", [False, True])
def test_same_tokens_and_accepted_lengths(demo, speculative):
    target, draft, prompts = demo
    kwargs = {"draft": draft, "tree": TreeConfig(6, 10, 60)} if speculative else {}
    for prompt, n in zip(prompts, (1, 5, 40)):
        alone, ahead = both(target, prompt, n, **kwargs)
        assert ahead.tokens == alone.tokens and len(alone.tokens) == n
        assert ahead.accept_lengths == alone.accept_lengths


def test_sampled_draws_are_the_same(demo):
    target, draft, prompts = demo
    sampling = SamplingConfig(temperature=0.8, top_k=40)
    for seed, prompt in enumerate(prompts[:2]):
        alone, ahead = both(target, prompt, 20, sampling, seed=seed, draft=draft)
        assert ahead.tokens == alone.tokens and ahead.accept_lengths == alone.accept_lengths
        plain_alone, plain_ahead = both(target, prompt, 20, sampling, seed=seed)
        assert plain_ahead.tokens == plain_alone.tokens


def test_eos_and_stop_strings_end_where_they_did(demo):
    target, draft, prompts = demo
    reference = generate(target, prompts[0], 40, GREEDY).tokens
    eos = reference[9]  # a token the output reaches part-way through a cycle
    for kwargs in ({}, {"draft": draft}):
        alone, ahead = both(target, prompts[0], 40, eos_ids=(eos,), **kwargs)
        assert ahead.tokens == alone.tokens == reference[:reference.index(eos) + 1]

        def stop_after_12(seen: list):  # as a stop string: keeps the tokens up to the 12th, then ends
            stop_after_12.count += len(seen)
            return len(seen) - (stop_after_12.count - 12) if stop_after_12.count >= 12 else None
        results = []
        for ahead in (False, True):
            stop_after_12.count = 0
            results.append(generate(target, prompts[0], 40, GREEDY, on_tokens=stop_after_12,
                                    run_ahead=ahead, **kwargs).tokens)
        assert results[0] == results[1] == reference[:12]


def test_calls_are_queued_before_tokens_are_read(demo):
    """When a cycle's tokens reach the host, the next cycle has already been called, but for the cycles that may
    reach max_new_tokens (up to tree.levels tokens short of it): a cycle queued after those would be thrown away,
    a whole cycle's device time for nothing."""
    target, draft, prompts = demo
    calls, seen_at, emitted = [0], [], [0]
    levels = TreeConfig().levels

    def counting_cycle(*args):
        calls[0] += 1
        return speculative_cycle(*args)

    def on_tokens(new):
        seen_at.append((calls[0], emitted[0]))
        emitted[0] += len(new)
    result = generate(target, prompts[0], 40, GREEDY, draft=draft, step_fn=counting_cycle,
                      on_tokens=on_tokens, run_ahead=True)
    cycles = len(result.accept_lengths)
    assert seen_at[0] == (0, 0)  # the prefill's token
    for k, (called, before) in enumerate(seen_at[1:], 1):  # cycle k's tokens, read after `called` calls
        assert called == (k + 1 if 40 - before > levels else k), (k, called, before)
    assert calls[0] == cycles  # it ended by max_new_tokens: no call queued and thrown away
    assert any(40 - before > levels for _, before in seen_at[1:])  # some cycles did run ahead


@pytest.mark.parametrize("speculative", [False, True])
def test_a_tight_cache_is_never_overrun(demo, speculative):
    """prompt + max_new_tokens + scratch fills the cache exactly: the last calls must not run ahead past it (an
    index past the cache raises on CPU and corrupts memory or asserts on CUDA)."""
    _, draft, prompts = demo
    tree = TreeConfig(6, 10, 60)
    prompt, n = prompts[2], 30
    cache = len(prompt) + n + (tree.scratch if speculative else 0)
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", cache)
    kwargs = {}
    if speculative:
        draft = load_draft(DEMO / "head" / "draft.pth", target)
        kwargs = {"draft": draft, "tree": tree}
    alone, ahead = both(target, prompt, n, **kwargs)
    assert ahead.tokens == alone.tokens and len(ahead.tokens) == n


def test_second_chat_turn_reuses_the_caches(demo):
    """A turn decoded running ahead leaves its context's K/V (target and draft) as a turn without: the next turn,
    starting from the kept tokens, decodes as a fresh run over the whole history."""
    target, draft, prompts = demo
    first = generate(target, prompts[0], 23, GREEDY, draft=draft, run_ahead=True)
    history = prompts[0] + first.tokens
    second_prompt = history + prompts[1][1:]
    reused = generate(target, second_prompt, 20, GREEDY, draft=draft, start_pos=len(history),
                      run_ahead=True)
    fresh = generate(target, second_prompt, 20, GREEDY, draft=draft, run_ahead=False)
    assert reused.tokens == fresh.tokens and reused.accept_lengths == fresh.accept_lengths


def test_a_run_that_cannot_fit_is_refused_before_any_call(demo):
    """Running ahead relies on generate() refusing up front what the cache cannot hold: prompt + max_new_tokens
    (+ the tree's scratch slots with a head) over the cache is one clear error, never an index past the cache."""
    _, _, prompts = demo
    tree = TreeConfig(6, 10, 60)
    prompt = prompts[2]
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", len(prompt) + 30)
    draft = load_draft(DEMO / "head" / "draft.pth", target)
    generate(target, prompt, 30, GREEDY, run_ahead=True)  # fits exactly
    with pytest.raises(EagletError, match=r"max_new_tokens \(31\) = .* exceeds the cache"):
        generate(target, prompt, 31, GREEDY, run_ahead=True)
    with pytest.raises(EagletError, match=r"max_new_tokens \(1\) \+ tree scratch \(60\) = .* exceeds"):
        generate(target, prompt, 1, GREEDY, draft=draft, tree=tree, run_ahead=True)
