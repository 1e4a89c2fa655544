"""Speculation that steps aside (StepAside): where a cycle costs more than the tokens it gives, generate() decodes with
plain steps and tries cycles again later. The switches happen between calls, so greedy output stays plain greedy
and sampling keeps the target's law. Time is a fake clock here (cycles made to look slow or fast), never measured."""
from collections import Counter

import math

import pytest
import torch

from conftest import HANG_S, STAT_SAMPLES, make_context_pair
from convert_hf_checkpoint import convert
from decode import TreeConfig, generate
from sampling import SamplingConfig
from step_aside import StepAside
from load import load_draft, load_target

GREEDY = SamplingConfig()
TREE = TreeConfig(depth=3, topk=3, total_tokens=10)


def fake_clock(cycle_seconds: float, step_seconds: float = 1.0):
    """A StepAside whose clock advances by cycle_seconds after a cycle and step_seconds after a plain step."""
    now = [0.0]
    gate = StepAside(retry_after=6, trial_cycles=2, probe_steps=3, share=math.inf)  # no share: trials by the wait alone

    def clock():
        now[0] += cycle_seconds if gate.speculating else step_seconds
        return now[0]
    gate.clock = clock
    return gate


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, head, _ = make_context_pair(tmp_path_factory.mktemp("step_aside"), noise=0.3)
    convert(target, log=lambda *_: None), convert(head, log=lambda *_: None)
    model = load_target(target / "model.pth", "cpu", "fp32", 400)
    return model, load_draft(head / "draft.pth", model)


def prompt(seed=0, n=40):
    return [1] + torch.randint(3, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_slow_cycles_step_aside_and_the_tokens_stay_plain_greedy(pair):
    model, draft = pair
    plain = generate(model, prompt(), 80, GREEDY)
    gate = fake_clock(cycle_seconds=20.0)  # no tau makes a cycle of 20 steps' time pay
    run = generate(model, prompt(), 80, GREEDY, draft=draft, tree=TREE, step_aside=gate, prefill_chunk=16)
    assert run.tokens == plain.tokens
    assert gate.switches >= 4 and run.plain_tokens > 25, (gate.switches, run.plain_tokens)  # 6 plain, 3 cycles, ...
    assert sum(run.accept_lengths) + run.plain_tokens == len(run.tokens) - 1  # the first token is the prefill's
    assert gate.step_seconds == 1.0 and gate.cycle_seconds == 20.0 and not gate.pays()


def test_cycles_that_pay_keep_speculating_after_one_probe(pair):
    model, draft = pair
    gate = fake_clock(cycle_seconds=1.2)  # tau ~2.8 tokens for 1.2 steps' time
    run = generate(model, prompt(1), 80, GREEDY, draft=draft, tree=TREE, step_aside=gate)
    assert run.tokens == generate(model, prompt(1), 80, GREEDY).tokens
    assert gate.switches == 2 and run.plain_tokens == gate.probe_steps  # out to time a step, and back
    assert gate.pays()
    again = generate(model, prompt(2), 40, GREEDY, draft=draft, tree=TREE, step_aside=gate)
    assert again.plain_tokens == 0 and gate.switches == 2  # the estimates carry over: no probe this time


def test_cycles_after_plain_steps_draft_as_after_a_fresh_prefill(pair, monkeypatch):
    """When cycles resume, the head reads what the plain steps wrote, from where it stopped: the cycles' accepted
    lengths from there are those of a fresh generation over the same context."""
    import decode
    model, draft = pair
    reads, catch_up_after_plain = [], decode.catch_up_after_plain
    monkeypatch.setattr(decode, "catch_up_after_plain", lambda *a, **k: reads.append(a[3]) or catch_up_after_plain(*a, **k))
    gate = fake_clock(cycle_seconds=1.2)  # three cycles, three plain steps timing a step, then cycles again
    run = generate(model, prompt(3), 60, GREEDY, draft=draft, tree=TREE, step_aside=gate)
    before = gate.trial_cycles  # a generation's first cycle carries no switch: timed
    resumed_at = 1 + sum(run.accept_lengths[:before]) + gate.probe_steps  # the root cycles resume from is tokens[-1]
    assert reads == [len(prompt(3)) + resumed_at - 1 - gate.probe_steps]  # the head stopped where the steps began
    fresh = generate(model, prompt(3) + run.tokens[:resumed_at - 1], 60 - resumed_at + 1, GREEDY, draft=draft,
                     tree=TREE)
    assert run.plain_tokens == gate.probe_steps and len(run.accept_lengths) > before + 3
    assert fresh.tokens == run.tokens[resumed_at - 1:]
    assert fresh.accept_lengths == run.accept_lengths[before:]


def test_a_head_that_never_pays_costs_at_most_its_share_of_a_256_token_reply(pair):
    """Cycles of 9 plain steps' time that never pay (StepAside's defaults, 5% share): past the first judgement's
    cycle, what the cycles cost beyond the plain steps they replaced stays within 5% of all the time, the trial
    that would break it deferred; a longer reply runs trials again, within the same share."""
    model, draft = pair
    for tokens in (256, 380):  # 380: as many as the cache holds
        now, gate = [0.0], StepAside()
        gate.clock = lambda: now.__setitem__(0, now[0] + (9.0 if gate.speculating else 1.0)) or now[0]
        run = generate(model, prompt(4, 8), tokens, GREEDY, draft=draft, tree=TREE, step_aside=gate)
        first = 9.0 - run.accept_lengths[0]  # the first judgement: one timed cycle, nothing known before it
        beyond = gate.beyond_plain(gate.cycle_total, gate.cycle_tokens)
        assert len(run.tokens) == tokens and beyond - first <= gate.share * gate.elapsed, (beyond, gate.elapsed)
        assert (len(run.accept_lengths) > 1) == (tokens > 256), run.accept_lengths  # trials resume only when affordable


def test_a_gate_that_switches_every_call_keeps_the_sampled_law(tmp_path):
    """Cycles and plain steps alternating at every call (3 tokens): the sequences follow the target's law."""
    from conftest import sampling_pair
    from test_sampling import PROMPT, N_TOKENS, TREE as SMALL_TREE, VOCAB, chi_square_p_below, exact_distribution
    target, model, draft = sampling_pair(tmp_path, VOCAB)
    sampling, counts, modes = SamplingConfig(temperature=1.0), Counter(), Counter()
    for i in range(STAT_SAMPLES):
        gate = fake_clock(cycle_seconds=50.0)
        gate.trial_cycles, gate.probe_steps, gate.retry_after = 1, 1, 1
        gate.speculating = i % 2 == 0  # half the runs start plain, half speculating
        torch.manual_seed(i)
        result = generate(model, PROMPT, N_TOKENS, sampling, draft=draft, tree=SMALL_TREE, step_aside=gate)
        counts[tuple(result.tokens)] += 1
        modes[(result.plain_tokens > 0, len(result.accept_lengths) > 0)] += 1
    assert modes[(True, True)] > STAT_SAMPLES // 4, modes  # both kinds of call in one generation, often
    assert not chi_square_p_below(counts, exact_distribution(target, sampling))


@pytest.mark.slow  # a server process on the demo
def test_the_server_steps_aside_per_engine_and_says_so(tmp_path):
    """serve.py with --step_aside on (the default): replies equal generate()'s plain ones; each reply's eaglet record
    says how many tokens plain steps made, and /metrics counts them all."""
    import re
    from test_serve import DEMO, PROMPTS, httpx, start_server
    from tokenizer import Tokenizer
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 512)
    tokenizer = Tokenizer(DEMO / "target")
    proc, url = start_server("--max_queue", "2", "--prefill_chunk", "8")
    try:
        made = 0
        for prompt in PROMPTS[:3]:
            reply = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 80, "temperature": 0},
                               timeout=HANG_S).json()
            ids = tokenizer.encode(prompt)
            want = generate(target, ids, 80, GREEDY, eos_ids=tokenizer.eos_ids).tokens
            assert reply["choices"][0]["text"] == tokenizer.decode(want)
            made += reply["eaglet"]["plain_tokens"]
        metrics = httpx.get(url + "/metrics").text
        assert int(re.search(r"eaglet_plain_tokens_total (\d+)", metrics).group(1)) == made
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)
