"""DSpark heads (DFlash's block, every row drafting, and a Markov head) and block drafters in every layout they ship
in: the cached head scores what a slow recompute written here from the method's description scores, at every cycle
of a generation, chain and tree; speculators' own model code is a second oracle for its layouts; decoding stays
exact; heads that do not fit are refused by name."""
import json

import pytest
import torch

import decode
from batch import generate_batch
from checkpoint import EagletError
from decode import TreeConfig, generate
from sampling import SamplingConfig
from load import load_draft, load_target, set_confidence
from conftest import check_compiled_cycle
from convert_hf_checkpoint import convert
from block_draft import DFlashDraft, DSparkDraft
from draft_tree import StaticTree
from test_dflash import (HEAD_DIM, HIDDEN, INTER, KV_HEADS, HEADS, dflash_config, dflash_weights, reference_block,
                         target8, write_dflash_head)  # noqa: F401 (target8: a fixture)

RANK, MASK, VOCAB = 8, 3, 96


def markov_weights(g: torch.Generator, draft_vocab=VOCAB, with_markov=True) -> dict:
    """Random Markov and confidence heads under the published names, the bias large enough to change picks."""
    return {"markov_head.markov_w1.weight": torch.randn(VOCAB, RANK, generator=g),
            "markov_head.markov_w2.weight": torch.randn(draft_vocab, RANK, generator=g) * 0.6,
            "confidence_head.proj.weight": torch.randn(1, HIDDEN + (RANK if with_markov else 0), generator=g) * 0.3,
            "confidence_head.proj.bias": torch.randn(1, generator=g)}


def deepspec_config(n_layers: int, block: int, ids: list, **extra) -> dict:
    """DeepSpec's config.json: the Qwen3 keys and DSpark's own at the top level."""
    config = dflash_config(n_layers, block, MASK, ids, VOCAB, 8)
    del config["dflash_config"]
    return config | {"architectures": ["Qwen3DSparkModel"], "target_layer_ids": ids, "mask_token_id": MASK,
                     "markov_rank": RANK, "markov_head_type": "vanilla", "enable_confidence_head": True,
                     "confidence_head_with_markov": True, "num_anchors": 512} | extra


def deepspec_head(tmp_path, hf, n_layers=2, block=4, ids=(1, 5), seed=0, copies=None, **extra):
    """A DeepSpec DSpark folder (with the frozen copies of the target's embedding and lm_head), converted."""
    g = torch.Generator().manual_seed(seed)
    w = dflash_weights(n_layers, len(ids), g) | markov_weights(g)
    copies = copies or {"embed_tokens.weight": hf.model.embed_tokens.weight, "lm_head.weight": hf.lm_head.weight}
    folder = write_dflash_head(tmp_path / f"dspark{seed}", w | {k: v.detach().clone() for k, v in copies.items()},
                               deepspec_config(n_layers, block, list(ids), **extra))
    convert(folder)
    return folder, w


def recording(draft, tree, truth: list, seed: int = 0, p: float = 0.6) -> list:
    """Record each cycle's block pass (root, ctx_len), each level's logits with the tokens before them, and the
    tree it grew; at random levels add a large bonus to the target's own next token (truth: the plain greedy
    sequence, prompt included), so that cycles accept 0..all drafts. Eager only (it reads ctx_len on the host)."""
    passes, g = [], torch.Generator().manual_seed(seed)
    block_states, next_logits, expand = draft.block_states, draft.next_logits, tree.expand

    def states(target, root, ctx_len, levels, h_last=None):
        passes.append({"root": int(root), "ctx": int(ctx_len), "levels": []})
        return block_states(target, root, ctx_len, levels)

    def logits(row, prev, state):
        out = next_logits(row, prev, state)
        rec = passes[-1]
        want = rec["ctx"] + 1 + len(rec["levels"])
        boosted = out.clone()
        if want < len(truth) and torch.rand(1, generator=g).item() < p:
            boosted[..., truth[want]] += 100.0
        rec["levels"].append((prev.clone(), out.clone(), boosted))
        return boosted

    def grow(target, head, root, ctx_len, h_last):
        passes[-1]["tree"] = expand(target, head, root, ctx_len, h_last)
        return passes[-1]["tree"]
    draft.block_states, draft.next_logits, tree.expand = states, logits, grow
    return passes


def check_pass(rec: dict, w: dict, hf, truth: list, ids: list, n_layers: int, levels: int, first_row: int = 0):
    """One block pass against the reference: every level's logits are base_i + W2(W1[prev]) for each prev, base_i
    the recomputed block's row first_row + i; every tree node sits under a parent whose token was the prev its
    draft was scored after, with that score's log-probability."""
    rows = reference_block(w, ids, MASK, n_layers, hf, truth[:rec["ctx"]], rec["root"], first_row + levels)
    base = hf.lm_head(rows[first_row:])
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    assert set(rec["levels"][0][0].flatten().tolist()) == {rec["root"]}  # the first drafts are scored after the root
    for i, (prev, out, _) in enumerate(rec["levels"]):
        expected = base[i] + w1[prev.flatten()] @ w2.T
        torch.testing.assert_close(out.reshape(-1, VOCAB), expected, atol=2e-4, rtol=1e-4)
    tree = rec["tree"]
    for j in range(1, tree.tokens.shape[-1]):
        prev, _, boosted = rec["levels"][int(tree.depths[j]) - 1]
        where = (prev.flatten() == tree.tokens[tree.parents[j]]).nonzero()
        assert len(where), f"node {j}'s parent token was never a prev of its level"
        logp = torch.log_softmax(boosted.reshape(-1, VOCAB)[where[0, 0]].float(), -1)[tree.tokens[j]]
        assert float(tree.draft_logp[j]) == pytest.approx(float(logp), abs=1e-4)


CASES = [pytest.param(2, 4, [1, 5], TreeConfig(3, 1, 5), id="block4-chain"),
         pytest.param(3, 7, [0, 3, 6], TreeConfig(6, 1, 8), id="block7-chain"),
         pytest.param(1, 7, [4], TreeConfig(5, 3, 16), id="block7-tree"),
         pytest.param(2, 4, [2, 6], StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))),
                      id="block4-static")]


@pytest.mark.parametrize("n_layers, block, ids, tree", CASES)
def test_cached_head_scores_what_a_full_recompute_scores(target8, tmp_path, n_layers, block, ids, tree):
    target_dir, hf = target8
    folder, w = deepspec_head(tmp_path, hf, n_layers, block, ids)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    assert isinstance(draft, DSparkDraft) and draft.anchor_drafts and draft.default_depth == block - 1
    prompt = [1, 17, 40, 8, 33, 71, 5]
    plain = generate(model, prompt, 30, SamplingConfig())
    truth = prompt + plain.tokens
    passes = recording(draft, tree, truth)
    spec = generate(model, prompt, 30, SamplingConfig(), draft=draft, tree=tree)
    assert spec.tokens == plain.tokens
    assert max(spec.accept_lengths) >= 3 and min(spec.accept_lengths) < tree.levels  # accepted and rejected drafts
    for rec in passes:
        assert rec["root"] == truth[rec["ctx"]]
        check_pass(rec, w, hf, truth, ids, n_layers, tree.levels - 1)


def test_the_confidence_cut_leaves_the_drafts_after_it_unverified(target8, tmp_path):
    """With --confidence t, a chain's drafts from the first one whose confidence sigmoid(proj([h_k ; W1[prev_k]]))
    is below t onwards are never accepted (that draft's log-probability -inf, so every path through it); the output
    stays plain decoding's."""
    target_dir, hf = target8
    folder, w = deepspec_head(tmp_path, hf, 2, 7, [1, 5])
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    draft.confidence = 0.02  # this random head's confidences lie around it
    prompt, tree = [1, 17, 40, 8, 33, 71, 5], TreeConfig(5, 1, 7)
    plain = generate(model, prompt, 30, SamplingConfig())
    truth = prompt + plain.tokens
    passes = recording(draft, tree, truth, p=0.9)
    spec = generate(model, prompt, 30, SamplingConfig(), draft=draft, tree=tree)
    assert spec.tokens == plain.tokens
    proj_w, proj_b = w["confidence_head.proj.weight"], w["confidence_head.proj.bias"]
    cuts = set()
    for rec in passes:
        rows = reference_block(w, [1, 5], MASK, 2, hf, truth[:rec["ctx"]], rec["root"], 6)
        chain = rec["tree"].tokens.tolist()  # a chain: node i at depth i
        conf = [torch.sigmoid(torch.cat([rows[i], w["markov_head.markov_w1.weight"][chain[i]]]) @ proj_w[0] + proj_b)
                for i in range(6)]
        first_low = next((i for i, c in enumerate(conf) if c < 0.02), 6)
        cuts.add(first_low)
        path = rec["tree"].draft_logp.cumsum(0).tolist()  # a chain: the path score down to each depth
        assert all(x > float("-inf") for x in path[:first_low + 1]) and all(x == float("-inf") for x in path[first_low + 1:])
    assert len(cuts) > 1  # chains were cut at different places
    assert max(spec.accept_lengths) >= 2


@pytest.mark.parametrize("change, match", [
    ({"markov_head_type": "gated"}, "markov_head_type 'gated'; eaglet runs DSpark's vanilla Markov head"),
    ({"markov_rank": 0}, "markov_rank must be a whole number of at least 1"),
    ({"mask_token_id": 96}, "mask_token_id must be a token id below the target's vocabulary"),
    ({"hidden_size": 32}, "DSpark head .* hidden size 32 vs 64"),
    ({"vocab_size": 90}, "vocabulary 90 vs 96"),
    ({"num_target_layers": 36}, "target layers 36 vs 8"),
    ({"target_layer_ids": [1, 7]}, "target_layer_ids .* must name layers -1..6"),
    ({"architectures": ["Qwen3DSpark2Model"]}, "eaglet runs DFlashDraftModel \\(z-lab\\), Qwen3DSparkModel")])
def test_a_deepspec_head_that_does_not_fit_is_refused_by_name(target8, tmp_path, change, match):
    target_dir, hf = target8
    folder, _ = deepspec_head(tmp_path, hf)
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
    with pytest.raises(EagletError, match=match):
        load_draft(folder / "draft.pth", model)


@pytest.mark.parametrize("copy", ["embed_tokens.weight", "lm_head.weight"])
def test_a_head_whose_copy_of_the_target_is_another_model_s_is_refused(target8, tmp_path, copy):
    target_dir, hf = target8
    other = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(5))
    copies = {"embed_tokens.weight": hf.model.embed_tokens.weight, "lm_head.weight": hf.lm_head.weight} | {copy: other}
    folder, _ = deepspec_head(tmp_path, hf, copies=copies)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
    name = copy.split(".")[0].replace("embed_tokens", "embed")
    with pytest.raises(EagletError, match=f"the head's copy of the target's {name} is not this target's"):
        load_draft(folder / "draft.pth", model)


def test_greedy_equals_plain_on_an_int8_target_in_a_batch_and_compiled(target8, tmp_path):
    """The copies' check passes on the int8 target (its lm_head rounded); a batch decodes as its rows alone; the
    compiled cycle (one graph) as eager, chain and tree."""
    import shutil
    import quantize
    target_dir = shutil.copytree(target8[0], tmp_path / "target")
    folder, _ = deepspec_head(tmp_path, target8[1])
    quantize.main(["--checkpoint_path", str(target_dir / "model.pth"), "--mode", "int8"])
    model = load_target(quantize.output_path(target_dir / "model.pth", "int8", 128), "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    prompts, tree = [[1, 5, 9], [1, 7, 8, 9, 10, 11, 12], [1, 40]], TreeConfig(3, 3, 10)
    alone = [generate(model, p, 20, SamplingConfig(), draft=draft, tree=tree) for p in prompts]
    assert all(r.tokens == generate(model, p, 20, SamplingConfig()).tokens for r, p in zip(alone, prompts))
    model.setup_caches(3, 128)
    draft.setup_caches(128, 3)
    together = generate_batch(model, prompts, 20, SamplingConfig(), draft=draft, tree=tree)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    model.setup_caches(1, 128)
    draft.setup_caches(128)
    draft.confidence = 0.3
    check_compiled_cycle(model, draft, TreeConfig(3, 1, 5))


@pytest.mark.slow
@pytest.mark.stat
def test_sampling_with_a_dspark_head_matches_the_target_distribution(tmp_path):
    from conftest import make_agreeing_pair
    from test_sampling import VOCAB as V, check_sampled_sequences
    target, _, _ = make_agreeing_pair(tmp_path, vocab=V, hidden=16, alpha=2.5, layer_scale=20.0, lm_head_noise=1.0)
    convert(target)
    g = torch.Generator().manual_seed(0)
    dims = dict(hidden=16, heads=4, kv=2, head_dim=4, inter=32)
    w = dflash_weights(1, 1, g, **dims) | {"markov_head.markov_w1.weight": torch.randn(V, 4, generator=g),
                                           "markov_head.markov_w2.weight": torch.randn(V, 4, generator=g)}
    config = dflash_config(1, 3, V - 1, [0], V, 2, **dims)
    del config["dflash_config"]
    config |= {"architectures": ["Qwen3DSparkModel"], "target_layer_ids": [0], "mask_token_id": V - 1,
               "markov_rank": 4, "enable_confidence_head": False}
    head = write_dflash_head(tmp_path / "dspark", {k: v * 3 if k.endswith("proj.weight") else v for k, v in w.items()},
                             config)
    convert(head)
    model = load_target(target / "model.pth", "cpu", "fp32", 64)
    draft = load_draft(head / "draft.pth", model)
    check_sampled_sequences(target, model, draft, TreeConfig(2, 3, 8))


# ---- speculators' layout, held to speculators' own model code -----------------------------------------------

def speculators_head(tmp_path, hf, kind: str, anchor: bool, draft_vocab: int, n_layers=2, block=4, ids=(1, 5),
                     seed=0, arch="qwen3"):
    """A head written by the speculators package itself (save_pretrained) with our random weights, and that
    package's model (the oracle). draft_vocab < 96: a draft vocabulary with its own lm_head, d2t and t2d.
    arch: its transformer_layer_config's model_type (speculators' training CLI: --draft-arch qwen3 or llama)."""
    pytest.importorskip("speculators", reason="the speculators package (the oracle for its layout) is not installed")
    from transformers import LlamaConfig, Qwen3Config
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    layer_config = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    layer = layer_config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=n_layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position_embeddings=2048)
    layer._attn_implementation = "eager"
    settings = SpeculatorsConfig(algorithm=kind, default_proposal_method="greedy",
                                 proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1 + anchor)],
                                 verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))
    common = dict(transformer_layer_config=layer, draft_vocab_size=draft_vocab, block_size=block,
                  aux_hidden_state_layer_ids=[k + 1 for k in ids], mask_token_id=MASK, sample_from_anchor=anchor,
                  speculators_config=settings)
    oracle = DSparkDraftModel(DSparkSpeculatorConfig(**common, markov_rank=RANK)) if kind == "dspark" else \
        DFlashDraftModel(DFlashSpeculatorConfig(**common))
    g = torch.Generator().manual_seed(seed)
    w = dflash_weights(n_layers, len(ids), g) | (markov_weights(g, draft_vocab) if kind == "dspark" else {})
    kept = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
    state = w | {"embed_tokens.weight": hf.model.embed_tokens.weight, "lm_head.weight": hf.lm_head.weight[kept],
                 "verifier_lm_head.weight": hf.lm_head.weight[kept]}
    unexpected = oracle.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False).unexpected_keys
    assert not unexpected
    if draft_vocab < VOCAB:
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        oracle.load_vocab_mappings(t2d, kept - torch.arange(draft_vocab))
    folder = tmp_path / (f"{kind}-{anchor}-{draft_vocab}" + ("" if arch == "qwen3" else f"-{arch}"))
    oracle.eval().save_pretrained(str(folder))
    assert json.loads((folder / "config.json").read_text())["transformer_layer_config"]["model_type"] == arch
    convert(folder)
    return folder, oracle, kept


def oracle_block(oracle, hf, committed: list, root: int, block: int):
    """speculators' training forward with its one anchor at the root's position: the block's normed rows and
    their logits (draft vocabulary), the context being the target's hidden states before the root."""
    seq = committed + [root] + [0] * block
    with torch.no_grad():
        states = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
        features = torch.cat([states[k] for k in oracle.config.aux_hidden_state_layer_ids], -1)
        loss_mask = torch.zeros(1, len(seq))
        loss_mask[0, len(committed)] = 1  # the only place an anchor may be drawn
        hidden, logits, *_ = oracle._backbone_forward(features, torch.tensor([seq]), loss_mask, states[-1],
                                                      torch.zeros(1, len(seq), dtype=torch.long), max_anchors=1)
    return hidden[0], logits[0]


@pytest.mark.parametrize("kind, anchor, draft_vocab, arch", [
    ("dspark", True, VOCAB, "qwen3"), ("dspark", False, VOCAB, "qwen3"), ("dspark", True, 40, "qwen3"),
    ("dflash", False, VOCAB, "qwen3"), ("dflash", True, 40, "qwen3"), ("dflash", False, 40, "qwen3"),
    ("dspark", True, 40, "llama"), ("dflash", False, VOCAB, "llama")])  # llama: the same layers, LlamaConfig's keys
def test_speculators_layouts_draft_what_speculators_computes(target8, tmp_path, kind, anchor, draft_vocab, arch):
    target_dir, hf = target8
    folder, oracle, kept = speculators_head(tmp_path, hf, kind, anchor, draft_vocab, arch=arch)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    assert isinstance(draft, DSparkDraft) == (kind == "dspark") and draft.anchor_drafts == anchor
    assert draft.vocab_size == draft_vocab and (draft_vocab == VOCAB or draft.draft_to_target.tolist() == kept.tolist())
    committed, root = [1, 17, 40, 8, 33, 71, 5], 22
    rows, logits = oracle_block(oracle, hf, committed, root, 4)
    _, features = decode.prefill(model, torch.tensor([committed]), 0)
    decode.catch_up_prompt(model, draft, committed, 0, features, torch.tensor(root))
    with torch.no_grad():
        states = draft.block_states(model, torch.tensor(root), torch.tensor(len(committed)), draft.max_levels)
        mine = draft.logits(model, states)
    first = 0 if anchor else 1  # speculators' slot 0 drafts only with sample_from_anchor
    torch.testing.assert_close(mine, logits[first:], atol=2e-4, rtol=1e-4)
    if kind == "dspark":
        prev = torch.arange(VOCAB)
        with torch.no_grad():
            bias = oracle.markov_head.block_bias(prev_token_ids=prev[None], hidden_states=None)[0]
            torch.testing.assert_close(draft.next_logits(mine[1, None], prev, states[1, None]), mine[1] + bias,
                                       atol=1e-4, rtol=1e-4)
            want = torch.sigmoid(oracle.confidence_head(torch.cat([rows[first + 1].expand(VOCAB, -1),
                                                                   oracle.markov_head.prev_embeddings(prev)], -1)))
            torch.testing.assert_close(draft.confidence_of(states[1, None], prev), want, atol=1e-5, rtol=1e-5)
    plain = generate(model, committed, 24, SamplingConfig())
    spec = generate(model, committed, 24, SamplingConfig(), draft=draft, tree=TreeConfig(2, 3, 10))
    assert spec.tokens == plain.tokens


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_what_a_layer_config_leaves_out_is_its_config_class_default(arch):
    """speculators rebuilds transformer_layer_config with transformers' Qwen3Config or LlamaConfig, as its model_type
    says: a key the file leaves out is that class's default (LLaMA's head_dim from its heads, Qwen3's 128)."""
    from transformers import LlamaConfig, Qwen3Config
    from head_formats import block_layer_config, head_args
    written = {"model_type": arch, "hidden_size": 256, "num_hidden_layers": 1}
    theirs = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch](**written)
    args = head_args(block_layer_config({"speculators_model_type": "dflash", "transformer_layer_config": written}, "x"))
    assert (args.vocab_size, args.intermediate_size, args.n_head, args.n_local_heads, args.head_dim, args.norm_eps,
            args.rope_base, args.max_position_embeddings, args.qkv_bias, args.o_bias) == \
        (theirs.vocab_size, theirs.intermediate_size, theirs.num_attention_heads, theirs.num_key_value_heads,
         theirs.head_dim, theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"], theirs.max_position_embeddings,
         theirs.attention_bias, theirs.attention_bias)
    with pytest.raises(EagletError, match="model_type 'mistral': eaglet runs speculators' DFlash-family"):
        block_layer_config({"transformer_layer_config": written | {"model_type": "mistral"}}, "x")


def test_a_speculators_head_without_sample_from_anchor_is_refused(target8, tmp_path):
    target_dir, hf = target8
    folder, _, _ = speculators_head(tmp_path, hf, "dspark", True, VOCAB)
    config = json.loads((folder / "config.json").read_text())
    del config["sample_from_anchor"]
    (folder / "config.json").write_text(json.dumps(config))
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
    with pytest.raises(EagletError, match="a speculators dspark head without sample_from_anchor"):
        load_draft(folder / "draft.pth", model)



@pytest.mark.slow
def test_bench_times_a_random_dspark_head_of_the_published_shape(tmp_path):
    import bench
    bench.main(["--model", "tiny", "--random_head", "dspark", "--device", "cpu", "--repeats", "1", "--side_tokens", "8",
                "--max_seq_length", "512", "--out", str(tmp_path / "b")])
    results = json.loads((tmp_path / "b.json").read_text())
    assert results["setup"]["tree"] == {"depth": 6, "topk": 1, "total_tokens": 8}  # the chain of its 7 drafts
    assert results["cycle"]["draft_passes"] == 1 and "DSpark" in results["setup"]["head"]
    assert results["side_by_side"]["eaglet EAGLE-2"]["same_tokens_as_plain"]


def test_generate_s_confidence_flag(target8, tmp_path):
    """--confidence reaches the head's cut and the output stays plain decoding's; a head without a confidence head,
    or no head, is refused."""
    from conftest import expect_error, run_cli
    from test_dflash import head_for
    target_dir, hf = target8
    folder, _ = deepspec_head(tmp_path, hf)
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--prompt", "w1 w2", "--max_new_tokens", "12"]
    plain = run_cli(tmp_path, base + ["--no_draft"])
    cut = run_cli(tmp_path, base + ["--draft_checkpoint_path", str(folder / "draft.pth"), "--confidence", "0.4"])
    assert cut["tokens"] == plain["tokens"]
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
    draft = load_draft(folder / "draft.pth", model)
    set_confidence(draft, 0.4)
    assert draft.confidence == 0.4 and draft.cut(torch.zeros(1, HIDDEN), torch.tensor([5])) is not None
    dflash_dir, _, _ = head_for(tmp_path, target_dir, 2, 4, [1, 5])
    expect_error(base + ["--draft_checkpoint_path", str(dflash_dir / "draft.pth"), "--confidence", "0.4"],
                 "--confidence is for DSpark heads with a confidence head; this head has none")
    expect_error(base + ["--no_draft", "--confidence", "0.4"], "--confidence is for DSpark heads with a confidence "
                                                               "head; no head is loaded")
    expect_error(base + ["--confidence", "2"], "must be between 0 and 1")


def test_an_int8_dspark_head_decodes_losslessly(target8, tmp_path):
    """quantize.py --mode int8 on a DSpark draft.pth: its Linears (the Markov head's W2, the confidence head's proj)
    in int8, W1 (an embedding) as it is; decoding with it stays plain decoding's."""
    import quantize
    target_dir, hf = target8
    folder, _ = deepspec_head(tmp_path, hf)
    quantize.main(["--checkpoint_path", str(folder / "draft.pth"), "--mode", "int8"])
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(quantize.output_path(folder / "draft.pth", "int8", 128), model)
    assert type(draft.markov_head.markov_w2).__name__ == "Int8Linear"
    assert isinstance(draft.markov_head.markov_w1, torch.nn.Embedding)
    prompt = [1, 17, 40, 8, 33, 71, 5]
    for tree in (TreeConfig(3, 1, 5), TreeConfig(3, 3, 10)):
        assert generate(model, prompt, 20, SamplingConfig(), draft=draft, tree=tree).tokens == \
            generate(model, prompt, 20, SamplingConfig()).tokens


@pytest.mark.slow
def test_compiled_lattice_tree_decodes_as_eager_in_one_graph(target8, tmp_path):
    target_dir, hf = target8
    folder, _ = deepspec_head(tmp_path, hf)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    check_compiled_cycle(model, load_draft(folder / "draft.pth", model), TreeConfig(3, 3, 10))
