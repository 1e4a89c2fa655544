"""P-EAGLE heads (speculators' "peagle": an EAGLE-3 head drafting a block of positions in one pass, mask positions
after the root's pair) as speculators saves them: the drafts of every block row equal what speculators' own model
code computes for that rollout; decoding stays exact (chain and tree, compiled, batch rows); heads that do not fit
are refused by name. speculators' EAGLE-3 heads of several layers, which P-EAGLE's share, decode exactly too."""
import json

import pytest
import torch

import decode
from batch import generate_batch
from decode import TreeConfig, generate
from sampling import SamplingConfig
from conftest import check_compiled_cycle, expect_error
from convert_hf_checkpoint import convert
from block_draft import PEagleDraft
from load import load_draft, load_target
from test_dflash import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, target8  # noqa: F401 (target8: a fixture)

VOCAB, MASK, BLOCK = 96, 7, 5
speculators = pytest.importorskip("speculators", reason="the speculators package (the oracle for its layout) is not "
                                                        "installed")


def peagle_head(tmp_path, draft_vocab: int, ids=(1, 3, 5, 7), seed=0, norm_output=False, n_layers=1, kind="peagle",
                vocab=VOCAB, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, inter=INTER, mask=MASK):
    """A P-EAGLE head (kind "eagle3": speculators' EAGLE-3 head) written by speculators' save_pretrained with random
    weights (large enough to tell rows apart), converted; and speculators' model, the oracle."""
    from transformers import LlamaConfig
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    layer = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=n_layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                        max_position_embeddings=2048)
    layer._attn_implementation = "eager"
    settings = SpeculatorsConfig(algorithm=kind, default_proposal_method="greedy",
                                 proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
                                 verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))
    common = dict(transformer_layer_config=layer, draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=list(ids),
                  norm_before_residual=True, norm_output=norm_output, speculators_config=settings)
    oracle = PEagleDraftModel(PEagleSpeculatorConfig(**common, mask_token_id=mask)) if kind == "peagle" else \
        Eagle3DraftModel(Eagle3SpeculatorConfig(**common))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in oracle.named_parameters():
            scale = 0.4 if name.endswith("norm.weight") else 1.0 if name in ("lm_head.weight", "mask_hidden") else 0.15
            p.copy_((1 if name.endswith("norm.weight") else 0) + scale * torch.randn(p.shape, generator=g))
    if draft_vocab < vocab:
        kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        oracle.load_vocab_mappings(t2d, kept - torch.arange(draft_vocab))
    folder = tmp_path / f"{kind}-{draft_vocab}-{norm_output}-{n_layers}"
    oracle.eval().save_pretrained(str(folder))
    convert(folder, log=lambda *_: None)
    return folder, oracle


def oracle_rows(oracle, hf, committed: list, root: int, monkeypatch) -> torch.Tensor:
    """speculators' forward with one rollout anchored at the root's pair (its COD sampling replaced by that rollout):
    the draft logits of the anchor and of its BLOCK - 1 mask positions [BLOCK, draft vocab]."""
    import speculators.models.peagle.core as core
    seq = len(committed)
    anchors = torch.cat([torch.arange(seq), torch.full((BLOCK - 1,), seq - 1)])
    depths = torch.cat([torch.zeros(seq, dtype=torch.long), torch.arange(1, BLOCK)])
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **_: (anchors, depths))
    monkeypatch.setattr(core, "compute_metrics", lambda **_: (torch.zeros(()), {}))  # the loss: not what is compared
    pad = BLOCK - 1  # speculators reads its inputs at every rollout position (then masks them): room for them
    with torch.no_grad():
        states = hf(torch.tensor([committed + [0] * pad]), output_hidden_states=True).hidden_states
        features = torch.cat([states[k] for k in oracle.config.eagle_aux_hidden_state_layer_ids], -1)
        pairs = torch.tensor([committed[1:] + [root] + [0] * pad])  # position p: (f_p, x_{p+1})
        seen = []
        hook = oracle.lm_head.register_forward_hook(lambda m, i, out: seen.append(out))
        try:
            oracle(features, pairs, torch.zeros(1, seq + pad, dtype=torch.long), loss_mask=torch.ones(1, seq + pad),
                   verifier_last_hidden_states=states[-1], num_depths=BLOCK)
        finally:
            hook.remove()
    logits = seen[0][0]
    return torch.cat([logits[seq - 1:seq], logits[seq:]])


@pytest.mark.parametrize("draft_vocab, norm_output, n_layers", [(VOCAB, False, 1), (40, False, 1), (40, True, 1),
                                                                (40, False, 2)])
def test_block_rows_draft_what_speculators_computes(target8, tmp_path, monkeypatch, draft_vocab, norm_output, n_layers):
    target_dir, hf = target8
    folder, oracle = peagle_head(tmp_path, draft_vocab, norm_output=norm_output, n_layers=n_layers)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    assert isinstance(draft, PEagleDraft) and draft.block_size == BLOCK and draft.max_levels == BLOCK
    assert draft.feature_layers == (1, 3, 5, 7) and draft.vocab_size == draft_vocab
    committed, root = [1, 17, 40, 8, 33, 71, 5], 22
    want = oracle_rows(oracle, hf, committed, root, monkeypatch)
    _, features = decode.prefill(model, torch.tensor([committed]), 0)
    with torch.no_grad():
        h_last = decode.catch_up_prompt(model, draft, committed, 0, features, torch.tensor(root))
        states = draft.block_states(model, torch.tensor(root), torch.tensor(len(committed)), BLOCK, h_last)
        mine = draft.logits(model, states)
    torch.testing.assert_close(mine, want, atol=2e-4, rtol=1e-4)
    assert (want[1:] - want[:1]).abs().max() > 1e-2  # the mask rows draft something of their own


def test_decoding_stays_exact_chain_tree_compiled_and_batched(target8, tmp_path):
    target_dir, hf = target8
    folder, _ = peagle_head(tmp_path, 40)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 160)
    draft = load_draft(folder / "draft.pth", model)
    prompts = [[1, 5, 9], [1, 7, 8, 30, 31, 2]]
    for tree in (TreeConfig(BLOCK - 1, 1, BLOCK + 1), TreeConfig(3, 3, 10)):
        for prompt in prompts:
            plain = generate(model, prompt, 24, SamplingConfig())
            assert generate(model, prompt, 24, SamplingConfig(), draft=draft, tree=tree).tokens == plain.tokens
    check_compiled_cycle(model, draft, TreeConfig(BLOCK - 1, 1, BLOCK + 1), n_tokens=20)
    model.setup_caches(2, 160)
    draft.setup_caches(160, 2)
    rows = generate_batch(model, prompts, 16, SamplingConfig(), draft=draft, tree=TreeConfig(3, 3, 10))
    for prompt, row in zip(prompts, rows):
        assert row.tokens == generate(model, prompt, 16, SamplingConfig()).tokens[:len(row.tokens)]
    with pytest.raises(Exception, match=f"trained on blocks of {BLOCK}"):
        generate(model, prompts[0], 8, SamplingConfig(), draft=draft, tree=TreeConfig(BLOCK, 1, BLOCK + 2))
    import quantize  # the head in int8 (its mask_hidden kept as it is): still exact
    quantize.main(["--checkpoint_path", str(folder / "draft.pth"), "--mode", "int8"])
    small = load_target(target_dir / "model.pth", "cpu", "fp32", 160)
    int8 = load_draft(folder / "draft_int8.pth", small)
    assert isinstance(int8, PEagleDraft) and int8.mask_hidden.dtype == torch.float32
    plain = generate(small, prompts[1], 24, SamplingConfig())
    assert generate(small, prompts[1], 24, SamplingConfig(), draft=int8, tree=TreeConfig(3, 3, 10)).tokens == \
        plain.tokens


def test_speculators_eagle3_heads_of_several_layers_decode_exactly(target8, tmp_path):
    """speculators' EAGLE-3 heads may stack decoder layers after the first (as its P-EAGLE heads do): run as the
    head's steps, each layer with its own cache, the tree decodes as plain decoding does."""
    target_dir, _ = target8
    folder, _ = peagle_head(tmp_path, 40, n_layers=3, kind="eagle3")
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    assert len(draft.blocks()) == 3 and not isinstance(draft, PEagleDraft)
    for prompt in ([1, 5, 9], [1, 7, 8, 30, 31, 2]):
        plain = generate(model, prompt, 24, SamplingConfig())
        spec = generate(model, prompt, 24, SamplingConfig(), draft=draft, tree=TreeConfig(3, 3, 10))
        assert spec.tokens == plain.tokens


def test_heads_that_do_not_fit_are_refused_by_name(target8, tmp_path):
    target_dir, _ = target8
    folder, _ = peagle_head(tmp_path, VOCAB)
    config = json.loads((folder / "config.json").read_text())
    for edit, words in [(lambda c: c.update(mask_token_id=VOCAB), "mask_token_id, a token of the target's 96"),
                        (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=0),
                         "speculative_tokens"),
                        (lambda c: c.update(speculators_model_type="mtp"), "speculators_model_type 'mtp'")]:
        changed = json.loads(json.dumps(config))
        edit(changed)
        (folder / "config.json").write_text(json.dumps(changed))
        expect_error(["--checkpoint_path", str(target_dir / "model.pth"), "--draft_checkpoint_path",
                      str(folder / "draft.pth"), "--prompt", "x", "--max_new_tokens", "2", "--device", "cpu"], words)
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file
    weights = load_file(folder / "model.safetensors")
    del weights["mask_hidden"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(Exception, match="needs mask_hidden"):
        convert(folder, log=lambda *_: None)


def test_sampling_with_a_peagle_head_matches_the_target_distribution(tmp_path):
    """Sampled output follows the target's own distribution over whole sequences (chi-square), with a P-EAGLE tree
    whose drafts are accepted at times."""
    from conftest import make_agreeing_pair
    from test_sampling import VOCAB as V, check_sampled_sequences
    target, _, _ = make_agreeing_pair(tmp_path, vocab=V, hidden=16, alpha=2.5, layer_scale=20.0, lm_head_noise=1.0)
    convert(target, log=lambda *_: None)
    folder, _ = peagle_head(tmp_path, V, ids=(0, 1, 2), vocab=V, hidden=16, heads=4, kv_heads=2, head_dim=4, inter=32,
                            mask=V - 1)
    model = load_target(target / "model.pth", "cpu", "fp32", 64)
    draft = load_draft(folder / "draft.pth", model)
    check_sampled_sequences(target, model, draft, TreeConfig(2, 3, 8))


@pytest.mark.slow
def test_bench_times_a_random_peagle_head(tmp_path):
    import bench
    bench.main(["--model", "tiny", "--random_head", "peagle", "--device", "cpu", "--repeats", "1", "--side_tokens", "8",
                "--max_seq_length", "512", "--out", str(tmp_path / "b")])
    results = json.loads((tmp_path / "b.json").read_text())
    assert results["setup"]["tree"] == {"depth": 7, "topk": 1, "total_tokens": 9}  # the chain of its 8 drafts
    assert results["cycle"]["draft_passes"] == 1 and "PEagle" in results["setup"]["head"]
    assert results["side_by_side"]["eaglet EAGLE-2"]["same_tokens_as_plain"]
