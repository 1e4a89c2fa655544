"""EAGLE-3 heads in their published format: the forward against a reference written from the format's
definition, lossless greedy decoding with random and agreeing heads, the draft vocabulary, and errors."""

import pytest
import torch
import torch.nn.functional as F

import generate
import decode
from conftest import (assert_close_in_scale, check_compiled_cycle, eagle3_config, eagle3_head_weights, expect_error, make_agreeing_eagle3_pair,
                      read_generation, write_eagle_head)
from convert_hf_checkpoint import convert, main as convert_main
from draft import Eagle3Draft
from decode import TreeConfig
from sampling import SamplingConfig
from load import load_draft, load_target
from attention import causal_mask
from model import EagletError

GREEDY = SamplingConfig()
HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 96, 96, 40


def random_eagle3_head(path, safetensors=False, seed=0, **config):
    weights = eagle3_head_weights(HIDDEN, HEADS, KV_HEADS, INTER, DRAFT_VOCAB, VOCAB,
                                  generator=torch.Generator().manual_seed(seed))
    write_eagle_head(path, weights, eagle3_config(HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, DRAFT_VOCAB, **config),
                     safetensors=safetensors)
    convert(path)
    return weights


def reference_forward(w, embeds, x, positions, eps=1e-6, rope_base=10000.0):
    """One EAGLE-3 layer over a causal block, from the published weights and nothing of eaglet's."""
    def rms(t, weight):
        return weight * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    def rope(t):  # t [heads, T, head_dim]; rotated halves are the first and second half of head_dim
        half = t.shape[-1] // 2
        inv_freq = rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = (positions[:, None].double() * inv_freq[None]).float()
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    m = "midlayer."
    attn_in = torch.cat([rms(embeds, w[m + "input_layernorm.weight"]), rms(x, w[m + "hidden_norm.weight"])], -1)
    head_dim, n = HIDDEN // HEADS, len(positions)
    q = rope((attn_in @ w[m + "self_attn.q_proj.weight"].T).view(n, HEADS, head_dim).transpose(0, 1))
    k = rope((attn_in @ w[m + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, head_dim).transpose(0, 1))
    v = (attn_in @ w[m + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, head_dim).transpose(0, 1)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (q @ k.transpose(1, 2)) / head_dim ** 0.5 + torch.full((n, n), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, HIDDEN)
    h = x + attn @ w[m + "self_attn.o_proj.weight"].T
    post = rms(h, w[m + "post_attention_layernorm.weight"])
    mlp = (F.silu(post @ w[m + "mlp.gate_proj.weight"].T) * (post @ w[m + "mlp.up_proj.weight"].T))
    return h + mlp @ w[m + "mlp.down_proj.weight"].T


@pytest.mark.parametrize("safetensors", [False, True], ids=["bin", "safetensors"])
def test_forward_matches_reference(checkpoints, tmp_path, safetensors):
    """Catch-up (target features through fc) and a tree level (the head's own outputs, no fc); the head's
    RoPE base is 10000 (its config has none) although the target's is 500000."""
    target_dir, _ = checkpoints("llama8")
    w = random_eagle3_head(tmp_path / "head", safetensors)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
    draft = load_draft(tmp_path / "head" / "draft.pth", model)
    assert isinstance(draft, Eagle3Draft) and model.feature_layers == (2, 4, 5)
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)
    with torch.no_grad():
        _, features = model(tokens[None], pos, pos, causal_mask(pos, 64))
        embeds = model.tok_embeddings(tokens)
        x = features[0] @ w["fc.weight"].T
        out = draft.step(model, tokens, features[0], pos, pos, causal_mask(pos, 64))
        assert_close_in_scale(out, reference_forward(w, embeds, x, pos))
        again = draft.step(model, tokens, out, pos, pos, causal_mask(pos, 64))  # own outputs: used as is
        assert_close_in_scale(again, reference_forward(w, embeds, out, pos))
        logp, ids = draft.topk(model, out, 5)
        ref_logits = F.linear(F.rms_norm(out, (HIDDEN,), w["norm.weight"], 1e-6), w["lm_head.weight"])
        ref_logp, ref_draft_ids = torch.log_softmax(ref_logits, -1).topk(5)
    assert_close_in_scale(logp, ref_logp)
    assert torch.equal(ids, ref_draft_ids + w["d2t"][ref_draft_ids])  # target id = draft id + d2t[draft id]
    assert w["t2d"][ids].all()


def test_configured_feature_layers_and_own_embedding(checkpoints, tmp_path):
    """eagle_aux_hidden_state_layer_ids name layer OUTPUTS; a head with target_hidden_size carries its embedding."""
    target_dir, _ = checkpoints("llama8")
    path = tmp_path / "head"
    weights = eagle3_head_weights(32, 4, 2, 48, DRAFT_VOCAB, VOCAB, target_hidden=64)
    config = eagle3_config(32, 4, 2, 48, VOCAB, DRAFT_VOCAB, target_hidden_size=64,
                           eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6]})
    write_eagle_head(path, weights, config)
    convert(path)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(path / "draft.pth", model)
    assert draft.feature_layers == (1, 4, 7) and model.feature_layers == (1, 4, 7)
    assert torch.equal(draft.embed.weight, weights["embed_tokens.weight"])
    prompt = [1, 5, 9, 30]
    assert decode.generate(model, prompt, 20, GREEDY, draft=draft).tokens == \
        decode.generate(model, prompt, 20, GREEDY).tokens


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """missing -> (target folder, head folder): an agreeing EAGLE-3 head with 0 or 8 target tokens left out
    of its draft vocabulary."""
    out = {}
    for missing in (0, 8):
        target, head = make_agreeing_eagle3_pair(tmp_path_factory.mktemp(f"eagle3_{missing}"), missing=missing)
        convert(target), convert(head)
        out[missing] = (target, head)
    return out


def prompts(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("name,tau_range", [("random", (1.0, 1.5)), ("agreeing", (7.5, 9.0)),
                                            ("vocab-missing-8", (3.0, 8.0))])
def test_greedy_speculative_equals_plain(checkpoints, agreeing, tmp_path, name, tau_range):
    if name == "random":
        target_dir, head_dir = checkpoints("llama8")[0], tmp_path / "head"
        random_eagle3_head(head_dir)
    else:
        target_dir, head_dir = agreeing[0 if name == "agreeing" else 8]
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 256)
    draft = load_draft(head_dir / "draft.pth", model)
    tree = TreeConfig(depth=draft.default_depth)
    lengths = []
    for prompt in prompts(model.args.vocab_size, 6):
        plain = decode.generate(model, prompt, 48, GREEDY)
        spec = decode.generate(model, prompt, 48, GREEDY, draft=draft, tree=tree)
        assert spec.tokens == plain.tokens
        lengths += spec.accept_lengths
    tau = sum(lengths) / len(lengths)
    print(f"EAGLE-3 {name} head: tau {tau:.2f} over {len(lengths)} cycles, lengths seen {sorted(set(lengths))}")
    assert tau_range[0] <= tau <= tau_range[1]
    if name == "vocab-missing-8":
        assert len(set(lengths)) >= 4
    if name == "agreeing":  # every cycle but a run's last (cut at max_new_tokens) accepts the deepest path
        assert lengths.count(9) >= len(lengths) - 6


def test_cli_runs_eagle3_head_with_its_default_tree(agreeing, capsys, tmp_path):
    target_dir, head_dir = agreeing[0]
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--device", "cpu", "--prompt", "w5 w9",
            "--max_new_tokens", "40"]
    generate.main(base + ["--json_out", str(tmp_path / "plain.json")])
    generate.main(base + ["--draft_checkpoint_path", str(head_dir / "draft.pth"),
                          "--json_out", str(tmp_path / "spec.json")])
    plain, spec = (read_generation(tmp_path / f"{n}.json") for n in ("plain", "spec"))
    assert spec["tokens"] == plain["tokens"]
    assert max(spec["accept_lengths"]) == 9  # depth 7 by default for EAGLE-3 heads: 7 + 1 drafts + bonus
    expect_error(base + ["--draft_checkpoint_path", str(head_dir / "draft.pth"), "--draft_vocab",
                         str(tmp_path / "v.json")], "its own draft vocabulary")


def corrupt(weights, **changes):
    return {**weights, **changes}


def test_errors(checkpoints, tmp_path):
    target_dir, _ = checkpoints("llama8")
    good = eagle3_head_weights(HIDDEN, HEADS, KV_HEADS, INTER, DRAFT_VOCAB, VOCAB)
    config = eagle3_config(HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, DRAFT_VOCAB)
    cases = {  # name -> (weights, config, message at conversion)
        "d2t-short": (corrupt(good, d2t=good["d2t"][:-1]), config, "d2t has (39,) entries but lm_head has 40 rows"),
        "d2t-out-of-range": (corrupt(good, d2t=good["d2t"] + VOCAB), config, "t2d and d2t disagree"),
        "vocab-size": (good, {**config, "draft_vocab_size": 50}, "lm_head has 40 rows but draft_vocab_size is 50"),
        "missing-weight": ({k: v for k, v in good.items() if k != "midlayer.hidden_norm.weight"}, config,
                           "weight midlayer.hidden_norm.weight is missing"),
    }
    for name, (weights, cfg, message) in cases.items():
        write_eagle_head(tmp_path / name, weights, cfg)
        expect_error(["--checkpoint_dir", str(tmp_path / name)], message, main=convert_main)
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--device", "cpu", "--prompt", "w5"]
    # caught at load too, where conversion cannot see the target: d2t beyond the target's vocabulary
    bad_map = tmp_path / "bad_map"
    no_t2d = {k: v for k, v in good.items() if k != "t2d"}  # t2d is optional; without it conversion passes
    write_eagle_head(bad_map, corrupt(no_t2d, d2t=good["d2t"] + VOCAB), config)
    convert(bad_map)
    expect_error(base + ["--draft_checkpoint_path", str(bad_map / "draft.pth")], "outside the target's 96 tokens")
    # a head for another hidden size, without target_hidden_size: its fc and embedding do not fit
    narrow = tmp_path / "narrow"
    write_eagle_head(narrow, eagle3_head_weights(32, 4, 2, 48, DRAFT_VOCAB, VOCAB, target_hidden=32),
                     eagle3_config(32, 4, 2, 48, VOCAB, DRAFT_VOCAB))
    convert(narrow)
    expect_error(base + ["--draft_checkpoint_path", str(narrow / "draft.pth")],
                 "is for a target of hidden size 32, this target has 64")
    # a target too shallow for the default feature layers 2, L//2, L-3
    shallow, _ = checkpoints("llama2")
    random_eagle3_head(tmp_path / "head")
    with pytest.raises(EagletError, match="does not all have"):
        load_draft(tmp_path / "head" / "draft.pth", load_target(shallow / "model.pth", "cpu", "fp32", 64))
    # neither kind of head
    neither = tmp_path / "neither"
    write_eagle_head(neither, {"lm_head.weight": torch.zeros(4, 4)}, config)
    expect_error(["--checkpoint_dir", str(neither)], "neither an EAGLE-1/2 nor an EAGLE-3", main=convert_main)


@pytest.mark.slow
def test_compiled_eagle3_cycle_does_not_recompile(agreeing):
    """The whole cycle with an EAGLE-3 head (own lm_head, d2t, fc only on target features) compiles to one
    graph and decodes exactly as eager across prompts and accepted lengths."""
    target_dir, head_dir = agreeing[8]
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(head_dir / "draft.pth", model)
    assert len(check_compiled_cycle(model, draft, TreeConfig(depth=3, topk=3, total_tokens=10))) >= 2
