"""The EAGLE cycle on a target whose attention matters (its next token depends on the last three tokens) and
heads that agree with it through its features (conftest.make_context_pair): a wrong mask, position or feature
costs exactness or acceptance here, where a target that barely attends would hide it."""
import pytest
import torch

import decode
from decode import TreeConfig, generate
from sampling import SamplingConfig
from conftest import CTX_A, CTX_B1, CTX_B2, CTX_VOCAB, make_context_pair
from convert_hf_checkpoint import convert
from load import load_draft, load_target
from attention import causal_mask

GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=1.0)
CACHE = 320
QUIET = {"log": lambda *_: None}


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    """name -> (target folder, head folder): agreeing heads ('eagle', 'eagle3') and noisy ones (partial
    acceptance: 'noisy', 'noisy3')."""
    out = {}
    for noise, suffix in ((0.0, ""), (0.3, "noisy")):
        # the noisy EAGLE-3 head also lacks 8 of the 64 tokens: its d2t maps a draft vocabulary of 56
        target, head, head3 = make_context_pair(tmp_path_factory.mktemp(f"context{suffix}"), noise=noise,
                                                missing=8 if noise else 0)
        for folder in (target, head, head3):
            convert(folder, **QUIET)
        out[suffix or "eagle"], out[suffix + "3" if suffix else "eagle3"] = (target, head), (target, head3)
    return out


def load(pair):
    target_dir, head_dir = pair
    model = load_target(target_dir / "model.pth", "cpu", "fp32", CACHE)
    return model, load_draft(head_dir / "draft.pth", model)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, CTX_VOCAB, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_the_target_reads_the_two_tokens_before_through_attention(context):
    """The fixture is what it claims (transformers as the oracle): layer 0's output holds the previous token in
    B1 and the one before in B2, and the next token often depends on them."""
    from transformers import AutoModelForCausalLM
    target_dir, _ = context["eagle"]
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    x = torch.randint(3, CTX_VOCAB, (1, 200), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf(x, output_hidden_states=True)
    h, u = out.hidden_states[1][0], hf.model.embed_tokens.weight[:, CTX_A]
    o = hf.model.layers[0].self_attn.o_proj.weight
    seen = lambda dims, cols: torch.linalg.lstsq(o[dims, cols], h[:, dims].T).solution.T  # noqa: E731
    prev1, prev2 = seen(CTX_B1, slice(0, 31)), seen(CTX_B2, slice(32, 63))  # the values each head read
    scale = (96 / 32) ** 0.5
    assert torch.allclose(prev1[2:], scale * u[x[0, 1:-1]], atol=1e-3)
    assert torch.allclose(prev2[2:], scale * u[x[0, :-2]], atol=1e-3)
    without = out.logits[0] - h[:, CTX_B2] / h.pow(2).mean(-1, keepdim=True).sqrt() @ hf.lm_head.weight[:, CTX_B2].T
    assert (without.argmax(-1) != out.logits[0].argmax(-1)).float().mean() > 0.3  # x_{t-2} decides often


@pytest.mark.parametrize("name,tau_floor,tau_ceiling", [("eagle", 7.7, 8), ("eagle3", 7.7, 8),
                                                       ("noisy", 3.9, 5.0), ("noisy3", 3.4, 4.5)])
def test_greedy_speculative_equals_plain_and_accepts_deep(context, name, tau_floor, tau_ceiling):
    """Every node reads its parent (B1) and grandparent (B2) through the verify mask at its own position: a
    mask, position or compaction bug changes the target's tokens. The agreeing heads are right at every
    depth (measured tau 7.88 of at most depth + 2 = 8: a run's last cycle is cut by max_new_tokens); the
    noisy ones measured 4.34 / 3.78 (floors just under: fp32 on a CPU repeats these exactly). A catch-up
    that pairs the wrong features loses most of it."""
    model, draft = load(context[name])
    lengths = []
    for prompt in prompts(6):
        spec = generate(model, prompt, 64, GREEDY, draft=draft)
        assert spec.tokens == generate(model, prompt, 64, GREEDY).tokens
        lengths += spec.accept_lengths
    tau = sum(lengths) / len(lengths)
    print(f"{name}: tau {tau:.2f}, accepted lengths seen {sorted(set(lengths))}")
    assert tau_floor <= tau <= tau_ceiling
    if name.startswith("noisy"):
        assert len(set(lengths)) >= 5


def reference_features(model, draft, seq, n):
    """The target's features and the draft's outputs over the first n pairs (f_t, x_{t+1}) of seq, computed
    in one causal pass each, as plain decoding and the head's training see them."""
    with torch.no_grad():
        pos = torch.arange(n)
        _, features = model(torch.tensor([seq[:n]]), pos, pos, causal_mask(pos, model.max_seq_length))
        h = draft.step(model, torch.tensor(seq[1:n + 1]), features[0], pos, pos, causal_mask(pos, draft.max_seq_length))
    return features[0], h


@pytest.mark.parametrize("name", ["noisy", "noisy3"])
def test_catch_up_output_matches_a_reference_recomputation(context, name, monkeypatch):
    """Every h_last generate() hands on (the prompt's, then each cycle's: the draft's output for the last
    accepted pair) equals the head run over the whole sequence with the target's true features."""
    model, draft = load(context[name])
    ref_model, ref_draft = load(context[name])
    handed_on = []  # (position of the pair's token, h_last)

    def recording_catch_up(target, draft, emitted, features, ctx_len, n_accepted):
        h = generate_catch_up(target, draft, emitted, features, ctx_len, n_accepted)
        handed_on.append(((ctx_len + n_accepted).item(), h.clone()))
        return h
    generate_catch_up = decode.catch_up
    monkeypatch.setattr(decode, "catch_up", recording_catch_up)
    prompt = prompts(1, seed=4)[0]
    result = generate(model, prompt, 60, GREEDY, draft=draft)
    seq = prompt + result.tokens
    _, h_ref = reference_features(ref_model, ref_draft, seq, len(seq) - 1)
    assert handed_on[0][0] == len(prompt) - 1 and len(handed_on) == len(result.accept_lengths) + 1
    for pos, h in handed_on[:-1]:  # the last cycle's pairs run past the tokens kept (max_new_tokens cut them)
        assert torch.allclose(h, h_ref[pos], atol=1e-4), f"h_last at position {pos} is not the reference"
    assert len(set(result.accept_lengths)) >= 3  # paths of several lengths were caught up


def check_caches(model, draft, ref_model, ref_draft, seq):
    """Target K/V = a plain prefill of seq (less its last token, the next root); draft K/V = the head over
    seq's pairs with the target's true features."""
    n = len(seq) - 1
    reference_features(ref_model, ref_draft, seq, n)
    for got, want in zip(model.layers + [draft.layer], ref_model.layers + [ref_draft.layer]):
        for name in ("k_cache", "v_cache"):
            a, b = getattr(got.attention.kv_cache, name), getattr(want.attention.kv_cache, name)
            assert torch.allclose(a[:, :, :n], b[:, :, :n], atol=1e-4), f"{name} differs from the reference"


@pytest.mark.parametrize("name", ["noisy", "noisy3"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_caches_equal_a_plain_recomputation_after_cycles(context, name, sampling):
    model, draft = load(context[name])
    prompt = prompts(1, seed=5)[0]
    torch.manual_seed(0)
    result = generate(model, prompt, 60, sampling, draft=draft)
    assert len(set(result.accept_lengths)) >= 2
    check_caches(model, draft, *load(context[name]), prompt + result.tokens)


@pytest.mark.parametrize("name", ["noisy", "noisy3"])
def test_multi_turn_reuse_with_a_draft(context, name):
    """A second turn that keeps the first turn's cache up to where the prompts part (as --interactive does)
    decodes and accepts as a fresh run of the whole prompt, and leaves both caches as a plain recomputation
    would: the token before start_pos is re-run, so the draft pairs its feature with the NEW next token."""
    model, draft = load(context[name])
    first = prompts(1, seed=6)[0]
    turn1 = generate(model, first, 20, GREEDY, draft=draft)
    cached = first + turn1.tokens[:-1]
    start = len(first) + 7  # the second prompt keeps a prefix and then says something else
    second = cached[:start] + [(cached[start] + 1) % CTX_VOCAB or 3] + prompts(1, seed=7)[0][1:]
    turn2 = generate(model, second, 30, GREEDY, draft=draft, start_pos=start)
    fresh_model, fresh_draft = load(context[name])
    fresh = generate(fresh_model, second, 30, GREEDY, draft=fresh_draft)
    assert turn2.tokens == fresh.tokens == generate(fresh_model, second, 30, GREEDY).tokens
    assert turn2.accept_lengths == fresh.accept_lengths
    check_caches(model, draft, *load(context[name]), second + turn2.tokens)


def cycle_ends(accept_lengths):
    """Indices (into the generated tokens) of the last token of each cycle; token 0 comes from the prefill."""
    ends, i = [0], 0
    for n in accept_lengths:
        i += n
        ends.append(i)
    return ends


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_eos_inside_an_accepted_path_ends_the_output_there(context, sampling, speculative):
    """An EOS token in the middle of an accepted path is the last token emitted: the drafts accepted after it
    are dropped, and the cycle counts the tokens up to it."""
    model, draft = load(context["eagle" if sampling is GREEDY else "noisy"])
    draft = draft if speculative else None
    prompt = prompts(1, seed=8)[0]
    torch.manual_seed(1)
    full = generate(model, prompt, 80, sampling, draft=draft)
    ends = set(cycle_ends(full.accept_lengths)) if speculative else set()
    # an EOS: the first token, past the first few, that did not occur before and does not end a cycle
    k = next(i for i in range(4, len(full.tokens)) if full.tokens[i] not in full.tokens[:i] and i not in ends)
    eos = full.tokens[k]
    torch.manual_seed(1)
    cut = generate(model, prompt, 80, sampling, draft=draft, eos_ids=(eos,))
    assert cut.tokens == full.tokens[:k + 1]
    if speculative:
        n_cycles = next(c for c, end in enumerate(cycle_ends(full.accept_lengths)) if end >= k)
        assert cut.accept_lengths[:-1] == full.accept_lengths[:n_cycles - 1]
        assert 0 < cut.accept_lengths[-1] < full.accept_lengths[n_cycles - 1]


def test_chain_tree_is_lossless(context):
    """A chain (one child per node: --tree_topk 1 --total_tokens depth + 1) is a tree like any other."""
    model, draft = load(context["noisy"])
    chain = TreeConfig(depth=5, topk=1, total_tokens=6)
    lengths = []
    for prompt in prompts(3, seed=9):
        spec = generate(model, prompt, 40, GREEDY, draft=draft, tree=chain)
        assert spec.tokens == generate(model, prompt, 40, GREEDY).tokens
        lengths += spec.accept_lengths
    assert max(lengths) <= 7 and len(set(lengths)) >= 3
