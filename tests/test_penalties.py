"""Penalties and the logit bias, lossless under speculation: greedy decoding under presence, frequency and repetition
penalties and a bias equals a reference loop over transformers' logits (its RepetitionPenaltyLogitsProcessor, OpenAI's
formula for the presence and frequency penalties, the bias added), plain, speculative (a head, a draft model, n-gram
lookup) and compiled; sampled, the sequences follow the penalized law (chi-square against enumeration)."""
import math
from collections import Counter
from itertools import product

import pytest
import torch

from conftest import STAT_SAMPLES, sampling_pair
from decode import TreeConfig, generate
from graphs import compile_step
from load import load_draft, load_draft_model, load_target
from lookup import NgramLookup
from model import EagletError
from sampling import SamplingConfig, logits_to_probs
from test_sampling import chi_square_p_below

PENALTIES = [SamplingConfig(presence_penalty=1.5), SamplingConfig(frequency_penalty=0.7),
             SamplingConfig(repetition_penalty=1.4), SamplingConfig(logit_bias={7: 3.0, 11: -100.0}),
             SamplingConfig(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=0.8, logit_bias={20: 2.0})]
PROMPT = [1, 5, 9, 11, 30, 5, 9]


def penalized_reference(hf, prompt: list, n: int, s: SamplingConfig, constraint=None) -> list:
    """See reference_loop: over transformers' model."""
    return reference_loop(lambda ids: hf(torch.tensor([ids])).logits[0, -1], prompt, n, s, constraint)


def reference_loop(forward, prompt: list, n: int, s: SamplingConfig, constraint=None) -> list:
    """Greedy decoding as transformers and OpenAI define the penalties: the bias added to the logits, then
    RepetitionPenaltyLogitsProcessor over the prompt and the reply, then logit - count * frequency - (count > 0) *
    presence over the reply's tokens; under a grammar (constraint), the argmax of what it allows."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    ids, reply = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = forward(ids).float()
        for t, b in s.logit_bias.items():
            logits[t] += b
        logits = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(torch.tensor([ids]), logits[None])[0]
        counts = torch.bincount(torch.tensor(reply, dtype=torch.long), minlength=len(logits)).float()
        logits = logits - counts * s.frequency_penalty - (counts > 0).float() * s.presence_penalty
        if constraint is not None:
            logits = logits.masked_fill(~constraint.allowed("cpu"), float("-inf"))
        ids.append(int(logits.argmax()))
        reply.append(ids[-1])
        if constraint is not None and (constraint.take([ids[-1]]) != 1 or constraint.done()):
            break
    return reply


@pytest.fixture(scope="module")
def target(checkpoints):
    folder, hf = checkpoints("llama2")
    return folder, hf, load_target(folder / "model.pth", "cpu", "fp32", 256)


@pytest.mark.parametrize("sampling", PENALTIES, ids=["presence", "frequency", "repetition", "bias", "all"])
def test_greedy_under_penalties_equals_transformers_plain_and_speculative(target, sampling):
    folder, hf, model = target
    want = penalized_reference(hf, PROMPT, 30, sampling)
    assert want != generate(model, PROMPT, 30, SamplingConfig()).tokens  # the penalty changed the reply
    assert generate(model, PROMPT, 30, sampling).tokens == want
    drafter = load_draft_model(folder, model)  # the target itself: its drafts are unpenalized, so often rejected
    accepted = []
    for kwargs in ({"draft": drafter, "tree": TreeConfig(3, 3, 12)}, {"draft": drafter, "tree": TreeConfig(4, 1, 6)},
                   {"lookup": NgramLookup(min_ngram=1)}):
        result = generate(model, PROMPT, 30, sampling, **kwargs)
        assert result.tokens == want, kwargs
        accepted += result.accept_lengths
    assert max(accepted) > 1  # drafts were accepted: the penalized verify ran over paths


def test_penalties_compile_once_and_are_refused_where_not_built(target, tmp_path):
    """The plain step and an EAGLE cycle compiled (the cycle by inductor, its code equal to the reference; the step,
    whose penalties are the cycle's, traced: conftest.traced_compile), one graph each for every penalized setting."""
    from unittest import mock
    from torch._dynamo.utils import counters
    from conftest import head_config, random_head_weights, traced_compile, write_eagle_head
    from convert_hf_checkpoint import convert
    folder, hf, model = target
    write_eagle_head(tmp_path, random_head_weights(64, 4, 4, 96, 96), head_config(64, 4, 4, 96, 96))
    convert(tmp_path, log=lambda *_: None)
    head = load_draft(tmp_path / "draft.pth", model)
    torch._dynamo.reset()
    counters.clear()
    with mock.patch.object(torch, "compile", traced_compile()):
        step = compile_step(__import__("decode").decode_one_token, "cpu")
    cycle = compile_step(__import__("decode").speculative_cycle, "cpu")
    for s in PENALTIES[:3]:  # values are tensor inputs: one graph for every penalized setting, the step's and the cycle's
        want = penalized_reference(hf, PROMPT, 12, s)
        assert generate(model, PROMPT, 12, s, step_fn=step).tokens == want
        assert generate(model, PROMPT, 12, s, draft=head, tree=TreeConfig(2, 3, 8), step_fn=cycle).tokens == want
    assert counters["stats"]["unique_graphs"] == 2
    with pytest.raises(EagletError, match="repetition_penalty above 0"):
        SamplingConfig(repetition_penalty=0.0)
    with pytest.raises(EagletError, match="past the vocabulary"):
        generate(model, PROMPT, 4, SamplingConfig(logit_bias={10 ** 6: 1.0}))


@pytest.mark.stat
def test_sampled_penalized_speculation_follows_the_penalized_law(tmp_path):
    """STAT_SAMPLES seeded draws of 3 tokens with an EAGLE head over a vocabulary of 8, under every penalty at once:
    the sequences follow the law enumerated from the target's logits with the penalties applied at each position."""
    target_dir, model, draft = sampling_pair(tmp_path, 8)
    prompt, sampling = [1, 5, 3, 5], SamplingConfig(temperature=1.0, presence_penalty=0.6, frequency_penalty=0.4,
                                                    repetition_penalty=1.3, logit_bias={2: -1.0, 6: 0.7})
    counts, lengths = Counter(), []
    for i in range(STAT_SAMPLES):
        torch.manual_seed(i)
        result = generate(model, prompt, 3, sampling, draft=draft, tree=TreeConfig(2, 3, 8))
        counts[tuple(result.tokens)] += 1
        lengths += result.accept_lengths
    assert max(lengths) > 1
    def next_law(reply: tuple) -> torch.Tensor:  # the penalized distribution after prompt + reply
        ids = prompt + list(reply)
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]), torch.arange(len(ids)), torch.arange(len(ids)),
                              torch.ones(len(ids), len(ids), dtype=torch.bool).tril())
        logits = logits[0, -1].float() + torch.tensor([sampling.logit_bias.get(t, 0.0) for t in range(8)])
        seen = torch.zeros(8, dtype=torch.bool)
        seen[ids] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits)
        c = torch.bincount(torch.tensor(list(reply), dtype=torch.long), minlength=8).float()
        return logits_to_probs((logits - 0.4 * c - 0.6 * (c > 0).float())[None], SamplingConfig(temperature=1.0))[0]
    laws = {reply: next_law(reply) for n in range(3) for reply in product(range(8), repeat=n)}
    law = {seq: math.prod(laws[seq[:i]][seq[i]].item() for i in range(3)) for seq in product(range(8), repeat=3)}
    assert math.isclose(sum(law.values()), 1.0, abs_tol=1e-5)
    assert not chi_square_p_below(counts, law)


def test_the_command_line_takes_the_penalties(target, tmp_path):
    from conftest import expect_error, run_cli
    folder, hf, model = target
    s = SamplingConfig(presence_penalty=0.5, repetition_penalty=1.3, logit_bias={7: 2.5})
    base = ["--checkpoint_path", str(folder), "--device", "cpu", "--prompt", "w1 w5 w7 w26 w1 w5", "--max_new_tokens",
            "20"]
    got = run_cli(tmp_path, base + ["--presence_penalty", "0.5", "--repetition_penalty", "1.3", "--logit_bias",
                                    '{"7": 2.5}', "--draft_model", str(folder), "--tree_topk", "1"])
    assert got["tokens"] == penalized_reference(hf, got["prompt_tokens"], 20, s)
    expect_error(base + ["--logit_bias", '{"w7": 1}'], "maps token ids to numbers")


def test_min_tokens_masks_the_end_until_reached_exactly_under_speculation(tmp_path):
    """A prompt whose greedy reply ends early (end-of-sequence, id 2): with min_tokens the end is masked until the reply
    holds that many tokens, as transformers' MinNewTokensLengthLogitsProcessor masks it -- plain, with the head
    (trees whose deeper nodes sit past min_tokens), with n-gram lookup."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor
    from load import load_draft
    from conftest import make_agreeing_pair
    from convert_hf_checkpoint import convert
    target, head, _ = make_agreeing_pair(tmp_path, layer_scale=0.3)  # a head that agrees: its trees reach the end
    convert(target, log=lambda *_: None), convert(head, log=lambda *_: None)
    model = load_target(target / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(head / "draft.pth", model)
    prompt = next(p for p in ([1, x] for x in range(4, 64))  # its reply ends at index 2 to 5
                  if 2 in generate(model, p, 12, SamplingConfig()).tokens[2:6])
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = list(prompt)
    mask = MinNewTokensLengthLogitsProcessor(len(prompt), 9, eos_token_id=2)
    while len(ids) < len(prompt) + 30:
        with torch.no_grad():
            logits = mask(torch.tensor([ids]), hf(torch.tensor([ids])).logits[:, -1])
        ids.append(int(logits.argmax()))
        if ids[-1] == 2:
            break
    want = ids[len(prompt):]
    assert 2 not in want[:9]
    s = SamplingConfig(min_tokens=9)
    for kwargs in ({}, {"draft": draft, "tree": TreeConfig(4, 2, 10)}, {"lookup": NgramLookup(min_ngram=1)}):
        assert generate(model, prompt, 30, s, eos_ids=(2,), **kwargs).tokens == want, kwargs
    # min_tokens at the reply's own end: allowed exactly there, where a cycle's deeper nodes reach past min_tokens
    end = generate(model, prompt, 12, SamplingConfig(), eos_ids=(2,)).tokens
    assert 3 <= len(end) <= 6 and end[-1] == 2
    at_end = SamplingConfig(min_tokens=len(end) - 1)
    assert generate(model, prompt, 12, at_end, eos_ids=(2,), draft=draft, tree=TreeConfig(4, 2, 10)).tokens == end


def test_penalties_under_a_grammar_count_the_reply_across_segments():
    """Under a grammar the reply is decoded in segments, each prefilling the reply so far as context: the penalties
    still count the reply (not the prompt), so the constrained greedy reply equals a loop that masks the penalized
    logits of one whole forward a token, plain and with the demo's head; the penalty changes it."""
    from conftest import ROOT
    from grammar import Constraint, grammar_of
    from load import load_draft
    from tokenizer import Tokenizer
    demo = ROOT / "demo"
    model = load_target(demo / "target" / "model.pth", "cpu", "fp32", 256)
    head, tokenizer = load_draft(demo / "head" / "draft.pth", model), Tokenizer(demo / "target")
    grammar = grammar_of("regex", "[a-z_]+(, [a-z_]+){3,12}\\)")
    prompt, s = tokenizer.encode("def total(values, start"), SamplingConfig(frequency_penalty=1.5, presence_penalty=0.5)

    def forward(ids):
        pos = torch.arange(len(ids))
        return model(torch.tensor([ids]), pos, pos, torch.ones(len(ids), len(ids), dtype=torch.bool).tril())[0][0, -1]

    def run(sampling, **kwargs):
        return generate(model, prompt, 40, sampling, tokenizer.eos_ids,
                        constraint=Constraint(tokenizer, model.args.vocab_size, grammar), **kwargs).tokens
    plain = run(s)
    assert plain == reference_loop(forward, prompt, 40, s, Constraint(tokenizer, model.args.vocab_size, grammar))
    assert plain != run(SamplingConfig())
    assert run(s, draft=head, tree=TreeConfig(3, 4, 10)) == plain
