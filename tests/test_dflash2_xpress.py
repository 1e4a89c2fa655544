"""DFlash2 heads (DFlash's block with a causal convolution around each sublayer, and a candidate selector) and XPress
heads (DFlash's block and a causal refiner resolved by Jacobi passes) as speculators saves them: every block row's
states and logits, the selector's scores after every token and the refined logits after the passes equal what
speculators' own model code computes; decoding stays exact (chain and tree, compiled, batch rows, int8 target and
head, sampling by the target's distribution); heads that do not fit are refused by name."""
import json

import pytest
import torch

import decode
from batch import generate_batch
from decode import TreeConfig, generate
from sampling import SamplingConfig
from block_draft import DFlash2Draft, XPressDraft
from conftest import check_compiled_cycle, expect_error
from convert_hf_checkpoint import convert
from load import load_draft, load_target
from test_dflash import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, target8  # noqa: F401 (target8: a fixture)

VOCAB, MASK, BLOCK, PASSES = 96, 3, 5, 3
speculators = pytest.importorskip("speculators", reason="the speculators package (the oracle for its layout) is not "
                                                        "installed")


def speculators_head(tmp_path, hf, kind: str, anchor: bool, draft_vocab: int = 0, ids=(1, 5), n_layers=2, seed=0,
                     vocab=VOCAB, hidden=HIDDEN, heads=HEADS, kv=KV_HEADS, head_dim=HEAD_DIM, inter=INTER, mask=MASK,
                     arch="qwen3"):
    """A dflash2 or xpress head written by speculators' save_pretrained with random weights (the convolutions, the
    selector and the refiner large enough to change picks), converted; and speculators' model, the oracle. Its
    embedding and (full-vocabulary) lm_head are the target's, as a trained head's are. arch: its
    transformer_layer_config's model_type (speculators' training CLI: --draft-arch qwen3 or llama)."""
    from transformers import LlamaConfig, Qwen3Config
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    draft_vocab = draft_vocab or vocab
    layer_config = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    layer = layer_config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=n_layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position_embeddings=2048)
    layer._attn_implementation = "eager"
    settings = SpeculatorsConfig(algorithm=kind, default_proposal_method="greedy",
                                 proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1 + anchor)],
                                 verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))
    common = dict(transformer_layer_config=layer, draft_vocab_size=draft_vocab, block_size=BLOCK,
                  aux_hidden_state_layer_ids=[k + 1 for k in ids], mask_token_id=mask, sample_from_anchor=anchor,
                  speculators_config=settings)
    oracle = DFlash2DraftModel(DFlash2SpeculatorConfig(**common, conv_group_size=8, selector_rank=8, selector_top_k=6)) \
        if kind == "dflash2" else XPressDraftModel(XPressSpeculatorConfig(**common, xpress_rank=8,
                                                                           num_jacobi_passes=PASSES))
    g = torch.Generator().manual_seed(seed)
    kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    own = {"embed_tokens.weight": hf.model.embed_tokens.weight, "lm_head.weight": hf.lm_head.weight[kept],
           "verifier_lm_head.weight": hf.lm_head.weight[kept]}
    with torch.no_grad():
        for name, p in oracle.named_parameters():
            if name in own:
                p.copy_(own[name])
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.4 * torch.randn(p.shape, generator=g))
            else:
                scale = 1.0 if any(k in name for k in ("codebook", "readout", "token_embed")) else \
                    0.3 if "conv" in name or "mix_l" in name else 0.15
                p.copy_(scale * torch.randn(p.shape, generator=g))
    if draft_vocab < vocab:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        oracle.load_vocab_mappings(t2d, kept - torch.arange(draft_vocab))
    folder = tmp_path / (f"{kind}-{anchor}-{draft_vocab}-{seed}" + ("" if arch == "qwen3" else f"-{arch}"))
    oracle.eval().save_pretrained(str(folder))
    assert json.loads((folder / "config.json").read_text())["transformer_layer_config"]["model_type"] == arch
    convert(folder, log=lambda *_: None)
    return folder, oracle


def oracle_pass(oracle, hf, committed: list, root: int, monkeypatch=None):
    """speculators' training forward with its one anchor at the root's position: the block's normed rows and
    their logits; for XPress also the refined logits of its last Jacobi round (speculators' consistency rounds are
    inference's passes: each after the previous round's picks), caught from what its forward hands its loss."""
    seq = committed + [root] + [0] * BLOCK
    with torch.no_grad():
        states = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
        features = torch.cat([states[k] for k in oracle.config.aux_hidden_state_layer_ids], -1)
        loss_mask = torch.zeros(1, len(seq))
        loss_mask[0, len(committed)] = 1  # the only place an anchor may be drawn
        inputs = (features, torch.tensor([seq]), loss_mask, states[-1], torch.zeros(1, len(seq), dtype=torch.long))
        hidden, logits, *_ = oracle._backbone_forward(*inputs, max_anchors=1)
        if monkeypatch is None:
            return hidden[0], logits[0], None
        import speculators.models.xpress.core as core
        seen = {}
        monkeypatch.setattr(core, "compute_metrics", lambda *a, **_: seen.update(rounds=a[1]) or (torch.zeros(()), {}))
        oracle(*inputs, max_anchors=1, consistency_passes=PASSES, consistency_weight=1.0)
    return hidden[0], logits[0], [r[0] for r in seen["rounds"]]


def my_pass(model, draft, committed: list, root: int):
    """eaglet's block after catching up on the committed tokens: the draft rows' states and logits."""
    _, features = decode.prefill(model, torch.tensor([committed]), 0)
    with torch.no_grad():
        h_last = decode.catch_up_prompt(model, draft, committed, 0, features, torch.tensor(root))
        return draft.draft_rows(model, torch.tensor(root), torch.tensor(len(committed)), draft.max_levels, h_last)


@pytest.mark.parametrize("anchor", [False, True])
def test_dflash2_rows_and_selector_score_what_speculators_computes(target8, tmp_path, anchor):
    target_dir, hf = target8
    folder, oracle = speculators_head(tmp_path, hf, "dflash2", anchor)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    assert isinstance(draft, DFlash2Draft) and draft.anchor_drafts == anchor and draft.candidate_selector.top_k == 6
    committed, root = [1, 17, 40, 8, 33, 71, 5], 22
    hidden, unary, _ = oracle_pass(oracle, hf, committed, root)
    states, rows = my_pass(model, draft, committed, root)
    first = 0 if anchor else 1
    torch.testing.assert_close(states, hidden[first:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(rows, unary[first:], atol=2e-4, rtol=1e-4)
    with torch.no_grad():  # without the convolutions (base kernel the identity, no deltas) the rows would differ
        plain = [(c.base_kernel.clone(), c.kernel_projection.weight.clone()) for layer in draft.layers
                 for c in (layer.attention_conv, layer.mlp_conv)]
        for layer in draft.layers:
            for c in (layer.attention_conv, layer.mlp_conv):
                c.base_kernel.zero_()[:, 0] = 1
                c.kernel_projection.weight.zero_()
        assert (my_pass(model, draft, committed, root)[1] - rows).abs().max() > 0.1
        for (base, proj), c in zip(plain, [c for layer in draft.layers for c in (layer.attention_conv, layer.mlp_conv)]):
            c.base_kernel.copy_(base), c.kernel_projection.weight.copy_(proj)
    prev = torch.arange(VOCAB)
    changed = 0
    for i in range(draft.max_levels):
        with torch.no_grad():
            mine = draft.next_logits(rows[i, None], prev, states[i, None])  # [VOCAB prevs, VOCAB]
            ids, scores = oracle.candidate_selector.select(unary[first + i].expand(VOCAB, -1),
                                                           hidden[first + i].expand(VOCAB, -1), prev)
        torch.testing.assert_close(mine.gather(-1, ids), scores, atol=1e-4, rtol=1e-4)
        assert bool((mine.isinf().sum(-1) == VOCAB - 6).all())  # every other token out of the draft's reach
        changed += int((mine.argmax(-1) != rows[i].argmax()).sum())
    assert changed > 20  # the selector changes the pick after many tokens
    plain = generate(model, committed, 24, SamplingConfig())
    for tree in (TreeConfig(draft.default_depth, 1, draft.default_depth + 2), TreeConfig(2, 3, 10)):
        assert generate(model, committed, 24, SamplingConfig(), draft=draft, tree=tree).tokens == plain.tokens


def truth_boost(rows, truth: list, ctx: int, g: torch.Generator):
    """+100 on the target's own next token in random rows of a block after position ctx (row i drafts the token
    i + 1 after the root), so that cycles accept 0..all drafts."""
    boost = torch.zeros_like(rows)
    for i in range(rows.shape[-2]):
        if ctx + 1 + i < len(truth) and torch.rand(1, generator=g).item() < 0.6:
            boost[i, truth[ctx + 1 + i]] = 100.0
    return boost


def test_dflash2_drafts_what_speculators_computes_at_every_cycle(target8, tmp_path, monkeypatch):
    """At every cycle of a generation (chain of the block after 0..all accepted drafts, and a tree) the block rows
    and the selector's scores after every token a level was scored after are what speculators computes for the
    committed text: an independent recompute per cycle. The target's own next tokens are boosted in random rows
    (so that cycles accept 0..all drafts), the same boost added to the recompute."""
    target_dir, hf = target8
    folder, oracle = speculators_head(tmp_path, hf, "dflash2", False)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    prompt = [1, 17, 40, 8, 33, 71, 5]
    plain = generate(model, prompt, 30, SamplingConfig())
    truth, g = prompt + plain.tokens, torch.Generator().manual_seed(0)
    draft_rows, next_logits, passes = draft.draft_rows, draft.next_logits, []

    def boosted(target, root, ctx_len, levels, h_last):
        states, rows = draft_rows(target, root, ctx_len, levels, h_last)
        boost = truth_boost(rows, truth, int(ctx_len), g)
        passes.append({"root": int(root), "ctx": int(ctx_len), "rows": rows, "boost": boost, "levels": []})
        return states, rows + boost

    def scored(row, prev, state):
        out = next_logits(row, prev, state)
        passes[-1]["levels"].append((prev.clone(), out.clone()))
        return out
    monkeypatch.setattr(draft, "draft_rows", boosted)
    monkeypatch.setattr(draft, "next_logits", scored)
    for tree in (TreeConfig(3, 1, 5), TreeConfig(3, 3, 10)):  # both a block of 5: the oracle's
        passes.clear()
        spec = generate(model, prompt, 30, SamplingConfig(), draft=draft, tree=tree)
        assert spec.tokens == plain.tokens and len(set(spec.accept_lengths)) > 2
        for rec in passes:
            assert rec["root"] == truth[rec["ctx"]]
            hidden, unary, _ = oracle_pass(oracle, hf, truth[:rec["ctx"]], rec["root"])
            torch.testing.assert_close(rec["rows"], unary[1:], atol=2e-4, rtol=1e-4)
            for i, (prev, out) in enumerate(rec["levels"]):
                m = prev.numel()
                ids, scores = oracle.candidate_selector.select((unary[1 + i] + rec["boost"][i]).expand(m, -1),
                                                               hidden[1 + i].expand(m, -1), prev.flatten())
                torch.testing.assert_close(out.reshape(m, -1).gather(-1, ids), scores, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("anchor, draft_vocab", [(False, VOCAB), (True, VOCAB), (False, 40)])
def test_xpress_refined_rows_are_what_speculators_computes(target8, tmp_path, monkeypatch, anchor, draft_vocab):
    target_dir, hf = target8
    folder, oracle = speculators_head(tmp_path, hf, "xpress", anchor, draft_vocab)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    assert isinstance(draft, XPressDraft) and draft.anchor_drafts == anchor and draft.jacobi_passes == PASSES
    assert draft.vocab_size == draft_vocab
    committed, root = [1, 17, 40, 8, 33, 71, 5], 22
    hidden, base, rounds = oracle_pass(oracle, hf, committed, root, monkeypatch)
    refined = rounds[-1]
    states, rows = my_pass(model, draft, committed, root)
    first = 0 if anchor else 1
    torch.testing.assert_close(states, hidden[first:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(rows, refined[first:], atol=2e-4, rtol=1e-4)
    assert (rows - base[first:]).abs().max() > 0.5  # the refiner moves the logits
    if draft_vocab == VOCAB:  # and the last pass still moves them (these two heads: the pass count matters)
        assert (rounds[-1] - rounds[-2])[first:].abs().max() > 0.5
    plain = generate(model, committed, 24, SamplingConfig())
    for tree in (TreeConfig(draft.default_depth, 1, draft.default_depth + 2), TreeConfig(2, 3, 10)):
        assert generate(model, committed, 24, SamplingConfig(), draft=draft, tree=tree).tokens == plain.tokens


@pytest.mark.parametrize("kind", ["dflash2", "xpress"])
def test_a_llama_layer_config_runs_as_speculators_runs_it(target8, tmp_path, monkeypatch, kind):
    """speculators builds the same Qwen3-style layers whether transformer_layer_config says qwen3 or llama
    (--draft-arch llama): such a head's rows are what speculators computes."""
    target_dir, hf = target8
    folder, oracle = speculators_head(tmp_path, hf, kind, False, arch="llama")
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    assert isinstance(draft, DFlash2Draft if kind == "dflash2" else XPressDraft)
    committed, root = [1, 17, 40, 8, 33, 71, 5], 22
    hidden, unary, rounds = oracle_pass(oracle, hf, committed, root, monkeypatch if kind == "xpress" else None)
    states, rows = my_pass(model, draft, committed, root)
    torch.testing.assert_close(states, hidden[1:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(rows, (unary if kind == "dflash2" else rounds[-1])[1:], atol=2e-4, rtol=1e-4)
    plain = generate(model, committed, 16, SamplingConfig())
    assert generate(model, committed, 16, SamplingConfig(), draft=draft, tree=TreeConfig(2, 3, 10)).tokens \
        == plain.tokens


def test_xpress_reads_the_committed_token_before_the_root_every_cycle(target8, tmp_path, monkeypatch):
    """At every cycle of a generation the fill-in block's first 'token before' is the committed token before the
    root (whatever was accepted: none of the drafts, some, all), read from what the head caught up on. The target's
    own next tokens are boosted in random rows, so that cycles accept 0..all drafts."""
    target_dir, hf = target8
    folder, _ = speculators_head(tmp_path, hf, "xpress", False)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    prompt = [1, 17, 40, 8, 33, 71, 5]
    plain = generate(model, prompt, 30, SamplingConfig())
    truth, seen, g = prompt + plain.tokens, [], torch.Generator().manual_seed(0)
    refine, draft_rows = draft.refine, draft.draft_rows
    monkeypatch.setattr(draft, "refine", lambda base, h, root, before: seen.append((int(root), int(before))) or
                        refine(base, h, root, before))

    def boosted(target, root, ctx_len, levels, h_last):
        states, rows = draft_rows(target, root, ctx_len, levels, h_last)
        seen.append(int(ctx_len))
        return states, rows + truth_boost(rows, truth, int(ctx_len), g)
    monkeypatch.setattr(draft, "draft_rows", boosted)
    spec = generate(model, prompt, 30, SamplingConfig(), draft=draft, tree=TreeConfig(3, 3, 10))
    assert spec.tokens == plain.tokens and len(set(spec.accept_lengths)) > 2
    for (root, before), ctx in zip(seen[0::2], seen[1::2]):
        assert (root, before) == (truth[ctx], truth[ctx - 1])


def test_decoding_stays_exact_compiled_batched_int8_head_and_target(target8, tmp_path):
    import quantize
    target_dir, hf = target8
    prompts = [[1, 5, 9], [1, 7, 8, 30, 31, 2]]
    for kind in ("dflash2", "xpress"):
        folder, _ = speculators_head(tmp_path, hf, kind, False, seed=1)
        model = load_target(target_dir / "model.pth", "cpu", "fp32", 160)
        draft = load_draft(folder / "draft.pth", model)
        check_compiled_cycle(model, draft, TreeConfig(3, 3, 10), n_tokens=20)
        model.setup_caches(2, 160)
        draft.setup_caches(160, 2)
        rows = generate_batch(model, prompts, 16, SamplingConfig(), draft=draft, tree=TreeConfig(3, 3, 10))
        for prompt, row in zip(prompts, rows):
            assert row.tokens == generate(model, prompt, 16, SamplingConfig()).tokens[:len(row.tokens)]
        quantize.main(["--checkpoint_path", str(folder / "draft.pth"), "--mode", "int8"])
        small = load_target(target_dir / "model.pth", "cpu", "fp32", 160)
        int8 = load_draft(folder / "draft_int8.pth", small)
        linear = int8.layers[0].attention_conv.kernel_projection if kind == "dflash2" else int8.refiner_head.readout
        assert type(linear).__name__ == "Int8Linear"
        assert kind == "dflash2" or isinstance(int8.refiner_head.token_embed, torch.nn.Embedding)
        plain = generate(small, prompts[1], 24, SamplingConfig())
        assert generate(small, prompts[1], 24, SamplingConfig(), draft=int8,
                        tree=TreeConfig(3, 3, 10)).tokens == plain.tokens
    target_int8 = quantize.output_path(int8_target_dir(tmp_path, target_dir) / "model.pth", "int8", 128)
    model = load_target(target_int8, "cpu", "fp32", 160)  # an int8 target, the head in fp32
    for kind in ("dflash2", "xpress"):
        draft = load_draft(tmp_path / f"{kind}-False-96-1" / "draft.pth", model)
        for tree in (TreeConfig(3, 1, 5), TreeConfig(3, 3, 10)):
            assert generate(model, prompts[1], 24, SamplingConfig(), draft=draft, tree=tree).tokens == \
                generate(model, prompts[1], 24, SamplingConfig()).tokens


def int8_target_dir(tmp_path, target_dir):
    """A copy of the target folder with its int8 file written beside model.pth."""
    import shutil
    import quantize
    copy = shutil.copytree(target_dir, tmp_path / "target-int8")
    quantize.main(["--checkpoint_path", str(copy / "model.pth"), "--mode", "int8"])
    return copy


@pytest.mark.parametrize("kind, edit, words", [
    ("dflash2", {"draft_vocab_size": 40}, "a DFlash2 head with a draft vocabulary of 40 tokens"),
    ("dflash2", {"conv_group_size": 7}, "conv_group_size 7 must divide the hidden size"),
    ("dflash2", {"selector_top_k": 0}, "selector_top_k must be a whole number of at least 1"),
    ("xpress", {"num_jacobi_passes": -1}, "num_jacobi_passes must be a whole number of at least 0"),
    ("xpress", {"xpress_rank": "8"}, "xpress_rank must be a whole number"),
    ("xpress", {"mask_token_id": VOCAB}, "mask_token_id must be a token id below"),
    ("dflash2", {"speculators_model_type": "dflash3"}, "speculators_model_type 'dflash3'; eaglet reads"),
    ("xpress", {"sliding_window": 64, "transformer_layer_config": "sliding"},
     "sliding-window layers with sliding_window_non_causal false")])
def test_heads_that_do_not_fit_are_refused_by_name(target8, tmp_path, kind, edit, words):
    target_dir, hf = target8
    folder, _ = speculators_head(tmp_path, hf, kind, False)
    config = json.loads((folder / "config.json").read_text()) | edit
    if config["transformer_layer_config"] == "sliding":  # every layer a sliding-window one, speculators' default mask
        layers = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
        config["transformer_layer_config"] = layers | {"layer_types": ["sliding_attention"] * 2, "sliding_window": 64,
                                                       "use_sliding_window": True}
    (folder / "config.json").write_text(json.dumps(config))
    expect_error(["--checkpoint_path", str(target_dir / "model.pth"), "--draft_checkpoint_path",
                  str(folder / "draft.pth"), "--prompt", "x", "--max_new_tokens", "2", "--device", "cpu"], words)


@pytest.mark.slow
@pytest.mark.stat
@pytest.mark.parametrize("kind", ["dflash2", "xpress"])
def test_sampling_follows_the_target_distribution(tmp_path, kind):
    from conftest import make_agreeing_pair
    from test_sampling import VOCAB as V, check_sampled_sequences
    from transformers import AutoModelForCausalLM
    target, _, _ = make_agreeing_pair(tmp_path, vocab=V, hidden=16, alpha=2.5, layer_scale=20.0, lm_head_noise=1.0)
    convert(target, log=lambda *_: None)
    hf = AutoModelForCausalLM.from_pretrained(target)
    folder, _ = speculators_head(tmp_path, hf, kind, False, ids=(0,), n_layers=1, vocab=V, hidden=16, heads=4, kv=2,
                                 head_dim=4, inter=32, mask=V - 1)
    model = load_target(target / "model.pth", "cpu", "fp32", 64)
    draft = load_draft(folder / "draft.pth", model)
    check_sampled_sequences(target, model, draft, TreeConfig(2, 3, 8))


@pytest.mark.slow
@pytest.mark.parametrize("kind, name", [("dflash2", "DFlash2"), ("xpress", "XPress")])
def test_bench_times_a_random_head_of_the_published_shape(tmp_path, kind, name):
    import bench
    bench.main(["--model", "tiny", "--random_head", kind, "--device", "cpu", "--repeats", "1", "--side_tokens", "8",
                "--max_seq_length", "512", "--out", str(tmp_path / "b")])
    results = json.loads((tmp_path / "b.json").read_text())
    assert results["setup"]["tree"] == {"depth": 14, "topk": 1, "total_tokens": 16}  # the chain of its 15 drafts
    assert results["cycle"]["draft_passes"] == 1 and name in results["setup"]["head"]
    assert results["side_by_side"]["eaglet EAGLE-2"]["same_tokens_as_plain"]
