"""logprobs from the step or the verify that chose each token (sampling.logprobs = k): every emitted token's
log-probability under the target and its k likeliest tokens there equal what one plain forward over the prompt and
the reply gives at those positions -- for plain decoding and every head kind, running ahead, sampled and under
a grammar (compiled: tests/test_sampling.py) -- and there is exactly one entry per kept token."""
import pytest
import torch

from batch import generate_batch
from decode import TreeConfig, generate
from sampling import SamplingConfig
from load import load_draft, load_target
from tokenizer import Tokenizer
from conftest import ROOT
from attention import causal_mask
from model import EagletError

DEMO = ROOT / "demo"
PROMPTS = ["def read_lines(path):\n", "class Stack:\n    def push(self, item):"]
HEADS = ("head", "head3", "dflash", "dspark")

pytestmark = pytest.mark.skipif(not (DEMO / "target" / "model.pth").is_file(), reason="no demo/")


@pytest.fixture(scope="module")
def demo():
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 384)
    tokenizer = Tokenizer(DEMO / "target")
    heads = {name: load_draft(DEMO / name / "draft.pth", target) for name in HEADS}
    return target, tokenizer, heads


def forward_logprobs(target, tokens: list) -> torch.Tensor:
    """log_softmax of the target's logits at every position of tokens, from one causal forward (no tree, no cache
    reuse): row i predicts tokens[i + 1]."""
    pos = torch.arange(len(tokens))
    with torch.no_grad():
        logits, _ = target(torch.tensor([tokens]), pos, pos, causal_mask(pos, len(tokens)))
    return torch.log_softmax(logits[0].float(), dim=-1)


def check_scores(target, result, k: int):
    assert len(result.logprobs) == len(result.tokens) > 0
    logp = forward_logprobs(target, result.prompt_tokens + result.tokens)[len(result.prompt_tokens) - 1:]
    for i, (token, (chosen, top)) in enumerate(zip(result.tokens, result.logprobs)):
        assert chosen == pytest.approx(float(logp[i, token]), abs=1e-4), f"token {i}"
        assert len(top) == k
        want = logp[i].topk(k)
        assert [p for _, p in top] == pytest.approx(want.values.tolist(), abs=1e-4)
        for (got_id, p), want_id in zip(top, want.indices.tolist()):  # ids equal, or a tie within the tolerance
            assert got_id == want_id or float(logp[i, got_id]) == pytest.approx(p, abs=1e-4)


@pytest.mark.parametrize("head", [None, *HEADS])
def test_greedy_logprobs_equal_a_plain_forward(demo, head):
    target, tokenizer, heads = demo
    draft = heads.get(head)
    if draft is not None:
        target.set_feature_layers(draft.feature_layers)
    tree = TreeConfig(3, 4, 8) if head in ("head", "head3") else None
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        plain = generate(target, ids, 24, SamplingConfig(), tokenizer.eos_ids)
        result = generate(target, ids, 24, SamplingConfig(logprobs=3), tokenizer.eos_ids, draft=draft,
                          tree=tree)
        assert result.tokens == plain.tokens and plain.logprobs == []
        check_scores(target, result, 3)


def test_run_ahead_and_a_cut_at_max_new_tokens_keep_one_entry_per_token(demo):
    target, tokenizer, heads = demo
    target.set_feature_layers(heads["head"].feature_layers)
    ids = tokenizer.encode(PROMPTS[0])
    for n in (1, 5, 13):
        result = generate(target, ids, n, SamplingConfig(logprobs=0), tokenizer.eos_ids, draft=heads["head"],
                          tree=TreeConfig(3, 4, 8), run_ahead=True)
        assert len(result.tokens) == n
        check_scores(target, result, 0)


def test_sampled_tokens_have_their_own_logprobs(demo):
    target, tokenizer, heads = demo
    target.set_feature_layers(heads["head"].feature_layers)
    torch.manual_seed(3)
    result = generate(target, tokenizer.encode(PROMPTS[1]), 20, SamplingConfig(0.9, top_k=20, logprobs=2),
                      tokenizer.eos_ids, draft=heads["head"], tree=TreeConfig(3, 4, 8))
    check_scores(target, result, 2)  # the target's own distribution, not the temperature's


def test_scores_list_is_filled_before_on_tokens_sees_the_tokens(demo):
    target, tokenizer, heads = demo
    target.set_feature_layers(heads["head"].feature_layers)
    scores, chunks = [], []

    def on_tokens(new):  # the scores of every token so far, these included, are in the list already
        assert len(scores) >= sum(map(len, chunks)) + len(new)
        chunks.append(new)
    result = generate(target, tokenizer.encode(PROMPTS[0]), 20, SamplingConfig(logprobs=1), draft=heads["head"],
                      tree=TreeConfig(3, 4, 8), on_tokens=on_tokens, scores=scores)
    assert scores == result.logprobs and len(chunks) > 1


def test_logprobs_out_of_range_or_in_a_batch_are_refused(demo):
    for k in (-2, 21):
        with pytest.raises(EagletError, match="logprobs"):
            SamplingConfig(logprobs=k)
    target, tokenizer, _ = demo
    with pytest.raises(EagletError, match="one prompt at a time"):
        generate_batch(target, [tokenizer.encode(p) for p in PROMPTS], 4, SamplingConfig(logprobs=0))


@pytest.mark.parametrize("head", [None, "head3"])
def test_the_prompt_s_logprobs_come_from_its_chunked_prefill(demo, head):
    """prompt_logprobs = k: None for the first prompt token, then each one's logprob and k alternatives, equal to one
    whole forward's however the prefill is chunked (7 tokens a forward), with or without a head reading along, with no
    reply (max_new_tokens 0), and under a grammar (its first segment scores the prompt); the reply is unchanged."""
    from grammar import Constraint, grammar_of
    target, tokenizer, heads = demo
    draft = heads.get(head)
    if draft is not None:
        target.set_feature_layers(draft.feature_layers)
    ids = tokenizer.encode(PROMPTS[1] + " " + PROMPTS[0] * 3)
    logp = forward_logprobs(target, ids)
    plain = generate(target, ids, 12, SamplingConfig(), tokenizer.eos_ids)
    constraint = Constraint(tokenizer, target.args.vocab_size, grammar_of("regex", "[a-z_ ]{1,20}\\n"))
    for n, kwargs in ((12, {}), (0, {}), (12, {"constraint": constraint})):
        result = generate(target, ids, n, SamplingConfig(), tokenizer.eos_ids, draft=draft, prefill_chunk=7,
                          prompt_logprobs=2, **kwargs)
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(ids)
        for i, (chosen, top) in enumerate(result.prompt_logprobs[1:]):
            assert chosen == pytest.approx(float(logp[i, ids[i + 1]]), abs=1e-4)
            assert [p for _, p in top] == pytest.approx(logp[i].topk(2).values.tolist(), abs=1e-4)
        if not kwargs:  # the reply is the same as without scoring the prompt
            assert result.tokens == plain.tokens[:n]
    with pytest.raises(EagletError, match="start_pos 0"):
        generate(target, ids, 4, SamplingConfig(), start_pos=3, prompt_logprobs=1)
