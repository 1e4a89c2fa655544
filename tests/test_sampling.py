"""Speculative sampling follows the target's distribution exactly (chi-square against enumeration), and the
same check rejects the classic mistakes, so it has the power to catch them."""
import math
from collections import Counter
from itertools import product

import pytest
import torch

import decode
from batch import generate_batch
from decode import TreeConfig, accept, generate
from sampling import SamplingConfig, logits_to_probs, sample
import graphs
from conftest import STAT_SAMPLES, eagle3_config, eagle3_head_weights, make_agreeing_pair, write_eagle_head
from convert_hf_checkpoint import convert
from load import load_draft, load_draft_model, load_target
from lookup import NgramLookup

VOCAB, PROMPT, N_TOKENS = 8, [1, 5, 3], 3
TREE = TreeConfig(depth=2, topk=3, total_tokens=8)
pytestmark = pytest.mark.stat  # EAGLET_STAT_SAMPLES draws per test (conftest.py)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, head, _ = make_agreeing_pair(tmp_path_factory.mktemp("sampling"), vocab=VOCAB, hidden=16, alpha=2.5,
                                         layer_scale=20.0, lm_head_noise=1.0)
    convert(target), convert(head)
    model = load_target(target / "model.pth", "cpu", "fp32", 64)
    return target, model, load_draft(head / "draft.pth", model)


@pytest.fixture(scope="module")
def eagle3_pair(pair, tmp_path_factory):
    """The same target with a random EAGLE-3 head: 6 of its 8 tokens in the draft vocabulary, and the
    features named by layer ids (the 2-layer target has no layers 2, L//2, L-3)."""
    target = pair[0]
    model = load_target(target / "model.pth", "cpu", "fp32", 64)  # its own: the features it returns differ
    head = tmp_path_factory.mktemp("eagle3_sampling")
    weights = eagle3_head_weights(16, 4, 2, 32, 6, VOCAB, std=0.3, generator=torch.Generator().manual_seed(0))
    write_eagle_head(head, weights, eagle3_config(16, 4, 2, 32, VOCAB, 6,
                                                  eagle_config={"eagle_aux_hidden_state_layer_ids": [-1, 0, 1]}))
    convert(head)
    return target, model, load_draft(head / "draft.pth", model)


def exact_distribution(target_dir, sampling, prompt=PROMPT):
    """P(first N_TOKENS tokens) by enumeration with transformers' model and its own logits warpers."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    warp = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)] +
                               ([TopKLogitsWarper(sampling.top_k)] if sampling.top_k else []) +
                               ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []) +
                               ([MinPLogitsWarper(sampling.min_p)] if sampling.min_p else []))
    prefixes = list(product(range(VOCAB), repeat=N_TOKENS - 1))
    ids = torch.tensor([prompt + list(p) for p in prefixes])
    with torch.no_grad():
        logits = hf(ids).logits[:, len(prompt) - 1:]  # predictions for tokens 1..N_TOKENS
    probs = torch.stack([torch.softmax(warp(ids, logits[:, i].clone()), -1) for i in range(N_TOKENS)], 1)
    dist = {}
    for row, p in enumerate(prefixes):
        for last in range(VOCAB):
            seq = p + (last,)
            dist[seq] = math.prod(probs[row, i, seq[i]].item() for i in range(N_TOKENS))
    return dist


def speculative_samples(model, draft, sampling):
    counts, lengths = Counter(), []
    for i in range(STAT_SAMPLES):
        torch.manual_seed(i)
        result = generate(model, PROMPT, N_TOKENS, sampling, draft=draft, tree=TREE)
        counts[tuple(result.tokens)] += 1
        lengths += result.accept_lengths
    print(f"tau {sum(lengths) / len(lengths):.2f}, tokens per cycle seen: {sorted(Counter(lengths).items())}")
    return counts


def check_sampled_sequences(target_dir, model, draft, tree):
    """STAT_SAMPLES seeded speculative generations at temperature 1: some drafts were accepted (the acceptance rule
    ran), and the sequences follow the target's exact distribution (chi-square)."""
    sampling, counts, lengths = SamplingConfig(temperature=1.0), Counter(), []
    for i in range(STAT_SAMPLES):
        torch.manual_seed(i)
        result = generate(model, PROMPT, N_TOKENS, sampling, draft=draft, tree=tree)
        counts[tuple(result.tokens)] += 1
        lengths += result.accept_lengths
    assert max(lengths) > 1  # drafts were accepted: the acceptance rule was exercised
    assert not chi_square_p_below(counts, exact_distribution(target_dir, sampling))


def chi_square_p_below(counts, dist, alpha=1e-3):
    """True when the counts are unlikely (p < alpha) under dist. Bins expecting < 5 are pooled."""
    n = sum(counts.values())
    if any(counts[seq] for seq, p in dist.items() if p == 0):
        return True  # a sequence the target can never produce
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for seq, p in dist.items():
        if n * p < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[seq], pooled_exp + n * p
        else:
            stat, df = stat + (counts[seq] - n * p) ** 2 / (n * p), df + 1
    if pooled_exp > 0:
        stat, df = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, df + 1
    z = 3.09  # one-sided normal quantile for alpha = 1e-3 (Wilson-Hilferty approximation below)
    threshold = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    print(f"chi-square {stat:.1f} on {df} degrees of freedom, threshold {threshold:.1f}")
    return stat > threshold


@pytest.mark.parametrize("sampling", [
    pytest.param(SamplingConfig(temperature=1.0), id="t1"),
    pytest.param(SamplingConfig(temperature=0.8, top_p=0.9), id="t0.8-top_p0.9", marks=pytest.mark.slow),
    pytest.param(SamplingConfig(temperature=1.3, top_k=5), id="t1.3-top_k5", marks=pytest.mark.slow),
    pytest.param(SamplingConfig(temperature=1.0, top_p=0.95, min_p=0.15), id="t1-top_p0.95-min_p0.15")])
def test_speculative_sampling_matches_target_distribution(pair, sampling):
    target_dir, model, draft = pair
    counts = speculative_samples(model, draft, sampling)
    assert not chi_square_p_below(counts, exact_distribution(target_dir, sampling))


@pytest.mark.slow
def test_eagle3_sampling_matches_target_distribution(eagle3_pair):
    target_dir, model, draft = eagle3_pair
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    counts = speculative_samples(model, draft, sampling)
    assert not chi_square_p_below(counts, exact_distribution(target_dir, sampling))


def test_a_draft_model_samples_the_target_distribution(pair):
    """A draft model (here the target itself, converted: it proposes the target's top-k, so drafts are often
    accepted) drafting EAGLE-2's tree: the sequences follow the target's law."""
    target_dir, model, _ = pair
    check_sampled_sequences(target_dir, model, load_draft_model(target_dir / "model.pth", model), TREE)


def test_ngram_lookup_samples_the_target_distribution(pair):
    """n-gram lookup's deterministic drafts (a one-hot draft distribution) from a prompt that repeats itself:
    accepted where they are the target's own pick, and the sequences follow the target's law (chi-square)."""
    target_dir, model, _ = pair
    prompt, sampling, counts, lengths = [1, 5, 3, 6, 1, 5, 3, 6, 1], SamplingConfig(temperature=1.0), Counter(), []
    lookup = NgramLookup(depth=3, topk=3, total_tokens=8, max_ngram=2, min_ngram=1)
    for i in range(STAT_SAMPLES):
        torch.manual_seed(i)
        result = generate(model, prompt, N_TOKENS, sampling, lookup=lookup)
        counts[tuple(result.tokens)] += 1
        lengths += result.accept_lengths
    assert max(lengths) > 1  # drafts were accepted: the acceptance rule was exercised
    assert not chi_square_p_below(counts, exact_distribution(target_dir, sampling, prompt))


def bonus_from_unmodified_p(tree, logits, sampling, levels):
    path, n_accepted, _ = accept(tree, logits, sampling, levels)
    return path, n_accepted, sample(logits[path[n_accepted]][None], sampling)[0]  # may repeat a rejected child


def accept_with_draft_ratio(tree, logits, sampling, levels):
    """The usual single-draft rule min(1, p/q) with the draft's own q, misapplied to the tree."""
    p = logits_to_probs(logits, sampling)
    ratio = p[tree.parents, tree.tokens] / tree.draft_logp.exp()
    correct = torch.rand(ratio.shape) < ratio.clamp(max=1)
    correct[0] = True
    accepted = (tree.ancestors & ~correct[None]).sum(1) == 0
    best = torch.where(accepted, tree.depths * 1000 - torch.arange(len(correct)), -10 ** 6).argmax()
    at_depth = tree.ancestors[best][None] & (tree.depths[None] == torch.arange(levels)[:, None])
    return at_depth.int().argmax(1), tree.depths[best], sample(logits[best][None], sampling)[0]


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", [bonus_from_unmodified_p, accept_with_draft_ratio])
def test_wrong_acceptance_rules_are_caught(pair, monkeypatch, wrong_rule):
    target_dir, model, draft = pair
    sampling = SamplingConfig(temperature=1.0)
    monkeypatch.setattr(decode, "accept", wrong_rule)
    counts = speculative_samples(model, draft, sampling)
    assert chi_square_p_below(counts, exact_distribution(target_dir, sampling))


@pytest.mark.slow
def test_batched_rows_sample_the_target_distribution(pair):
    """generate_batch: rows 0 and 2 hold PROMPT, row 1 a longer prompt (so the others are padded and sit
    elsewhere in their caches); the first two rows' draws pooled follow the target's distribution."""
    target_dir, model, draft = pair
    sampling = SamplingConfig(temperature=1.0)
    model.setup_caches(3, 64)
    draft.setup_caches(64, 3)
    counts = Counter()
    try:
        for i in range(STAT_SAMPLES // 2):
            torch.manual_seed(i)
            rows = generate_batch(model, [PROMPT, [1, 2, 3, 4, 5, 6, 7], PROMPT], N_TOKENS, sampling,
                                  draft=draft, tree=TREE)
            counts[tuple(rows[0].tokens)] += 1
            counts[tuple(rows[2].tokens)] += 1
    finally:
        model.setup_caches(1, 64)
        draft.setup_caches(64)
    assert not chi_square_p_below(counts, exact_distribution(target_dir, sampling))


SETTINGS = [SamplingConfig(0.0), SamplingConfig(0.7), SamplingConfig(1.3, top_p=0.9), SamplingConfig(0.9, top_k=3),
            SamplingConfig(1.1, top_p=0.8, top_k=5), SamplingConfig(0.5, logprobs=0), SamplingConfig(1.0, logprobs=3),
            SamplingConfig(0.0, logprobs=5), SamplingConfig(2.0, top_k=1), SamplingConfig(0.6, top_p=0.5, logprobs=2),
            SamplingConfig(1e-3), SamplingConfig(0.0, top_k=2, top_p=0.3), SamplingConfig(0.9, min_p=0.3),
            SamplingConfig(1.2, top_k=4, min_p=0.05, logprobs=1)]  # a dozen requests, each its own


@pytest.mark.slow
def test_every_sampling_setting_runs_the_compiled_step_and_cycle_without_compiling(pair):
    """Temperature, top_p, top_k, min_p and logprobs' k are tensor inputs of the compiled step and cycle: after warming up
    their graphs (greedy or sampled, logprobs or not: four each), a dozen requests with settings of their own compile
    nothing and are all answered (greedy ones as eager decoding answers them); a new setting's draws follow the
    target's law (chi-square). The cycle is inductor's (its sampled verify and its draws, inductor's own random
    numbers); the plain step, whose sampling is the cycle's, is traced (conftest.traced_compile)."""
    from torch._dynamo.utils import counters
    from unittest import mock
    from conftest import traced_compile
    target_dir, model, draft = pair
    torch._dynamo.reset()
    counters.clear()  # graphs other tests compiled in this process before
    with mock.patch.object(torch, "compile", traced_compile()):
        plain_step = graphs.compile_step(decode.decode_one_token, "cpu")
    steps = {"plain": ({}, plain_step),
             "EAGLE-2": ({"draft": draft, "tree": TREE}, graphs.compile_step(decode.speculative_cycle, "cpu"))}
    for kwargs, step in steps.values():
        for warm in (SamplingConfig(), SamplingConfig(1.0), SamplingConfig(logprobs=0), SamplingConfig(1.0, logprobs=0)):
            generate(model, PROMPT, 8, warm, step_fn=step, **kwargs)
    assert counters["stats"]["unique_graphs"] == 8
    counters.clear()
    for name, (kwargs, step) in steps.items():
        for sampling in SETTINGS:
            result = generate(model, PROMPT, 8, sampling, step_fn=step, **kwargs)
            assert len(result.tokens) == 8, (name, sampling)
            assert [len(top) for _, top in result.logprobs] == [sampling.logprobs] * 8 * (sampling.logprobs >= 0)
            if sampling.greedy:  # as eager code decodes and scores (the logprobs of inductor's code too)
                eager = generate(model, PROMPT, 8, sampling, **kwargs)
                assert result.tokens == eager.tokens
                for (a, top_a), (b, top_b) in zip(result.logprobs, eager.logprobs):
                    assert a == pytest.approx(b, abs=1e-4)
                    assert [v for _, v in top_a] == pytest.approx([v for _, v in top_b], abs=1e-4)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    sampling, counts = SamplingConfig(temperature=0.8, top_p=0.9, top_k=5), Counter()
    for i in range(STAT_SAMPLES):
        torch.manual_seed(i)
        counts[tuple(generate(model, PROMPT, N_TOKENS, sampling, draft=draft, tree=TREE,
                              step_fn=steps["EAGLE-2"][1]).tokens)] += 1
    assert not chi_square_p_below(counts, exact_distribution(target_dir, sampling))
    assert counters["stats"]["unique_graphs"] == 0


def test_the_tensor_settings_are_named_by_the_config_fields():
    """A compiled step reads the sampling settings from one tensor, each by its SamplingConfig field's name; whole
    numbers are capped at 2**24, exact in float32 (a top_k past any vocabulary filters nothing)."""
    from sampling import TENSOR_SETTINGS
    assert TENSOR_SETTINGS == ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                               "repetition_penalty", "min_tokens")
    named = SamplingConfig(temperature=0.5, top_p=0.25, top_k=7, min_p=0.125, presence_penalty=0.5, min_tokens=3,
                           logprobs=3).inputs("cpu", 8).named()
    assert {k: v.item() for k, v in named.items()} == {
        "temperature": 0.5, "top_p": 0.25, "top_k": 7.0, "min_p": 0.125, "presence_penalty": 0.5,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 3.0}
    assert SamplingConfig(top_k=10**9).inputs("cpu").named()["top_k"].item() == 2**24


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 0.3])
def test_a_top_p_float32_cannot_hold_keeps_the_most_likely_token_as_transformers_does(top_p):
    """top_p is a float32 tensor in the step: 1e-300 is 0 there, and 'drop where the more likely tokens hold at least
    top_p' would drop every token (0 / 0: a token from nowhere). transformers' warper keeps at least one token."""
    from transformers.generation.logits_process import TopPLogitsWarper
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    expected = torch.softmax(TopPLogitsWarper(top_p)(None, logits.clone()), -1)
    got = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
