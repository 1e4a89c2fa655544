"""DFlash heads: the cached head drafts what a slow full recompute written here from the method's description
drafts, at every cycle of a generation; the published layout loads; decoding stays exact (greedy, batched,
compiled, sampled); heads that do not fit are refused by name."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import decode
import generate
from batch import generate_batch
from checkpoint import EagletError
from conftest import STAT_SAMPLES, check_compiled_cycle, expect_error
from convert_hf_checkpoint import convert
from decode import TreeConfig
from sampling import SamplingConfig
from block_draft import DFlashDraft
from draft_tree import grow_lattice
from head_formats import dflash_layer_ids
from load import load_draft, load_target

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 96  # GQA, head_dim set apart from hidden / heads


def dflash_weights(n_layers: int, n_features: int, g: torch.Generator, hidden=HIDDEN, heads=HEADS, kv=KV_HEADS,
                   head_dim=HEAD_DIM, inter=INTER, prefix="") -> dict:
    """Random weights under the published names (q/k/v/o_proj, q_norm, k_norm, mlp.*, fc, hidden_norm, norm)."""
    def rnd(*shape, s=0.15):
        return torch.randn(*shape, generator=g) * s

    def norm(n):
        return 0.5 + torch.rand(n, generator=g)
    w = {"fc.weight": rnd(hidden, n_features * hidden), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden)}
    for i in range(n_layers):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": rnd(kv * head_dim, hidden),
                  p + "self_attn.v_proj.weight": rnd(kv * head_dim, hidden),
                  p + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
                  p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
                  p + "mlp.gate_proj.weight": rnd(inter, hidden), p + "mlp.up_proj.weight": rnd(inter, hidden),
                  p + "mlp.down_proj.weight": rnd(hidden, inter),
                  p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden)})
    return {prefix + k: v for k, v in w.items()}


def dflash_config(n_layers: int, block_size: int, mask_id: int, ids, vocab: int, n_target_layers: int,
                  hidden=HIDDEN, heads=HEADS, kv=KV_HEADS, head_dim=HEAD_DIM, inter=INTER, **extra) -> dict:
    dflash = {"mask_token_id": mask_id} | ({"target_layer_ids": ids} if ids is not None else {})
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
            "num_hidden_layers": n_layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": head_dim, "intermediate_size": inter, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "vocab_size": vocab, "max_position_embeddings": 2048, "attention_bias": False, "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * n_layers, "use_sliding_window": False, "sliding_window": None,
            "block_size": block_size, "num_target_layers": n_target_layers, "dflash_config": dflash, **extra}


def write_dflash_head(path, weights: dict, config: dict):
    """A DFlash head folder as published: config.json + model.safetensors."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


# ---- the reference: the whole draft recomputed from the committed tokens, no cache --------------------------

def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, pos, base=10000.0):
    """RoPE, Hugging Face layout: x [n, heads, d] at positions pos [n]."""
    d = x.shape[-1]
    angles = pos[:, None].float() * base ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def reference_draft_logits(w: dict, config: dict, hf_target, committed: list, root: int, block: int):
    """The draft logits of block positions 1..block-1 after the tokens committed (DFlash's rows)."""
    ids, mask_id = config["dflash_config"]["target_layer_ids"], config["dflash_config"]["mask_token_id"]
    rows = reference_block(w, ids, mask_id, config["num_hidden_layers"], hf_target, committed, root, block)
    return hf_target.lm_head(rows[1:])


def reference_block(w: dict, ids: list, mask_id: int, n_layers: int, hf_target, committed: list, root: int,
                    block: int, heads=HEADS, kv=KV_HEADS, d=HEAD_DIM):
    """The final-normed outputs of every block row after the tokens committed, by the method's description:
    context = hidden_norm(fc(the target's hidden states after the listed layers)); the block [root, mask...]
    embedded by the target at positions len(committed)..; per layer q from the normed block, k and v from
    [context ; normed block], attention over all of it with no mask; the final norm."""
    with torch.no_grad():
        states = hf_target(torch.tensor([committed]), output_hidden_states=True).hidden_states
        context = rms(torch.cat([states[i + 1][0] for i in ids], -1) @ w["fc.weight"].T, w["hidden_norm.weight"])
        x = hf_target.model.embed_tokens(torch.tensor([root] + [mask_id] * (block - 1)))
        n_ctx = len(committed)
        pos = torch.arange(n_ctx + block)
        for i in range(n_layers):
            p = f"layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"])
            both = torch.cat([context, h])
            q = rotate(rms((h @ w[p + "self_attn.q_proj.weight"].T).view(block, heads, d), w[p + "self_attn.q_norm.weight"]), pos[n_ctx:])
            k = rotate(rms((both @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv, d), w[p + "self_attn.k_norm.weight"]), pos)
            v = (both @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv, d)
            k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d), -1)
            x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(block, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return rms(x, w["norm.weight"])


# ---- a head that agrees at times: its drafts, at random block positions, replaced by the target's own -------

def agreeing(draft: DFlashDraft, truth: list, seed: int = 0, p: float = 0.6):
    """Record each block pass (root, ctx_len, draft logits) and, at random levels, put the target's true next
    token (truth: the plain greedy sequence, prompt included) first among the drafts, so that cycles accept
    0..depth + 1 tokens. Eager only (it reads ctx_len on the host); the tree asks for its levels in order."""
    seen, g, level = [], torch.Generator().manual_seed(seed), [0]
    block_states, topk_of_logits = draft.block_states, draft.topk_of_logits

    def recording(target, root, ctx_len, levels, h_last=None):
        h = block_states(target, root, ctx_len, levels)
        seen.append((int(root), int(ctx_len), target.output(h)))
        level[0] = 0
        return h

    def injected(logits, k):
        logp, ids = topk_of_logits(logits, k)
        ctx, j = seen[-1][1], level[0]
        level[0] += 1
        want = truth[ctx + 1 + j] if ctx + 1 + j < len(truth) else None
        if want is None or torch.rand(1, generator=g).item() > p:
            return logp, ids
        for row in ids.view(-1, k):
            found = row.tolist()
            where = found.index(want) if want in found else k - 1  # siblings stay distinct: swap, or replace the last
            row[where], row[0] = row[0].clone(), want
        return logp, ids
    draft.block_states, draft.topk_of_logits = recording, injected
    return seen


@pytest.fixture(scope="module")
def target8(checkpoints):
    """An 8-layer LLaMA target (GQA) and its transformers twin."""
    path, hf = checkpoints("llama8")
    return path, hf


def head_for(tmp_path, target_dir, n_layers, block, ids, seed=0, prefix="", mask_id=3, **extra):
    w = dflash_weights(n_layers, len(ids), torch.Generator().manual_seed(seed), prefix=prefix)
    config = dflash_config(n_layers, block, mask_id, ids, 96, 8, **extra)
    folder = write_dflash_head(tmp_path / f"dflash{seed}{prefix}", w, config)
    convert(folder)
    return folder, {k[len(prefix):]: v for k, v in w.items()}, config


CASES = [pytest.param(2, 4, [1, 5], TreeConfig(2, 1, 4), id="block4-chain"),
         pytest.param(3, 16, [0, 3, 6], TreeConfig(14, 1, 16), id="block16-chain"),
         pytest.param(1, 16, [4], TreeConfig(6, 3, 20), id="block16-depth6-tree"),
         pytest.param(2, 4, [2, 6], TreeConfig(2, 4, 12), id="block4-tree")]


@pytest.mark.parametrize("n_layers, block, ids, tree", CASES)
def test_cached_head_drafts_what_a_full_recompute_drafts(target8, tmp_path, n_layers, block, ids, tree):
    target_dir, hf = target8
    folder, w, config = head_for(tmp_path, target_dir, n_layers, block, ids)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    prompt = [1, 17, 40, 8, 33, 71, 5]
    plain = decode.generate(model, prompt, 30, SamplingConfig())
    truth = prompt + plain.tokens
    seen = agreeing(draft, truth)
    spec = decode.generate(model, prompt, 30, SamplingConfig(), draft=draft, tree=tree)
    assert spec.tokens == plain.tokens
    assert max(spec.accept_lengths) >= 3 and min(spec.accept_lengths) == 1  # accepted and rejected drafts both
    for root, ctx_len, logits in seen:
        assert root == truth[ctx_len]
        expected = reference_draft_logits(w, config, hf, truth[:ctx_len], root, tree.depth + 2)
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


def test_published_names_with_a_model_prefix_load_the_same_head(target8, tmp_path):
    target_dir, _ = target8
    plain_dir, _, _ = head_for(tmp_path, target_dir, 2, 4, [1, 5])
    prefixed_dir, _, _ = head_for(tmp_path, target_dir, 2, 4, [1, 5], prefix="model.")
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
    a, b = load_draft(plain_dir / "draft.pth", model).state_dict(), load_draft(prefixed_dir / "draft.pth", model).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_default_feature_layers_are_dflash_s():
    assert dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's published head
    assert dflash_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # LLaMA-3.1-8B's
    assert dflash_layer_ids(8, 1) == [4]


def test_the_default_layers_are_read_when_the_config_names_none(target8, tmp_path):
    target_dir, _ = target8
    folder, _, _ = head_for(tmp_path, target_dir, 2, 4, dflash_layer_ids(8, 2))
    config = json.loads((folder / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (folder / "config.json").write_text(json.dumps(config))
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
    assert load_draft(folder / "draft.pth", model).feature_layers == (2, 6)  # ids [1, L - 3 = 5]: layer outputs


@pytest.mark.slow
@pytest.mark.parametrize("tree", [TreeConfig(2, 1, 4), TreeConfig(2, 3, 10)], ids=["chain", "tree"])
def test_compiled_cycle_decodes_as_eager_in_one_graph(target8, tmp_path, tree):
    target_dir, _ = target8
    folder, _, _ = head_for(tmp_path, target_dir, 2, 4, [1, 5])
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    check_compiled_cycle(model, load_draft(folder / "draft.pth", model), tree)


def test_batch_rows_decode_as_each_alone(target8, tmp_path):
    target_dir, _ = target8
    folder, _, _ = head_for(tmp_path, target_dir, 2, 4, [1, 5])
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(folder / "draft.pth", model)
    prompts, tree = [[1, 5, 9], [1, 7, 8, 9, 10, 11, 12], [1, 40]], TreeConfig(2, 3, 10)
    alone = [decode.generate(model, p, 20, SamplingConfig(), draft=draft, tree=tree) for p in prompts]
    model.setup_caches(3, 128)
    draft.setup_caches(128, 3)
    together = generate_batch(model, prompts, 20, SamplingConfig(), draft=draft, tree=tree)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.accept_lengths for r in together] == [r.accept_lengths for r in alone]


def test_block_tree_keeps_the_best_paths_of_the_marginals():
    logp = torch.log_softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(1)), -1)
    top, ids = logp.topk(2, dim=-1)

    def block_tree(top, ids, root, total_tokens):  # a DFlash head's lattice: the same children after every parent
        def children(i, prev):
            shape = (*prev.shape, top.shape[-1])
            return top[..., i, None, :].expand(shape), ids[..., i, None, :].expand(shape)
        return grow_lattice(children, root, *top.shape[-2:], total_tokens)
    chain = block_tree(top[:, :1], ids[:, :1], torch.tensor(7), 4)
    assert chain.tokens.tolist() == [7] + ids[:, 0].tolist() and chain.parents.tolist() == [0, 0, 1, 2]
    tree = block_tree(top, ids, torch.tensor(7), 7)
    for i in range(1, 7):  # each node: its depth's candidate, its marginal, under a node one level up
        d = int(tree.depths[i])
        j = ids[d - 1].tolist().index(int(tree.tokens[i]))
        assert tree.draft_logp[i] == top[d - 1, j] and tree.depths[tree.parents[i]] == d - 1
    paths = {}  # every kept node's path score beats every path of its length that was left out
    for i in range(1, 7):
        node, score = i, 0.0
        while node:
            score, node = score + float(tree.draft_logp[node]), int(tree.parents[node])
        paths[i] = score
    all_scores = sorted((sum(float(top[d, c[d]]) for d in range(n)) for n in (1, 2, 3)
                         for c in [[(m >> b) & 1 for b in range(n)] for m in range(2 ** n)]), reverse=True)
    assert sorted(paths.values(), reverse=True) == pytest.approx(all_scores[:6])


# ---- sampling: the target's own distribution -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.stat
def test_sampling_with_a_dflash_head_matches_the_target_distribution(tmp_path):
    from conftest import make_agreeing_pair
    from test_sampling import N_TOKENS, PROMPT, VOCAB, chi_square_p_below, exact_distribution
    target, _, _ = make_agreeing_pair(tmp_path, vocab=VOCAB, hidden=16, alpha=2.5, layer_scale=20.0,
                                      lm_head_noise=1.0)
    convert(target)
    w = dflash_weights(1, 1, torch.Generator().manual_seed(0), hidden=16, heads=4, kv=2, head_dim=4, inter=32)
    head = write_dflash_head(tmp_path / "dflash", {k: v * 3 if k.endswith("proj.weight") else v for k, v in w.items()},
                             dflash_config(1, 4, VOCAB - 1, [0], VOCAB, 2, hidden=16, heads=4, kv=2, head_dim=4, inter=32))
    convert(head)
    model = load_target(target / "model.pth", "cpu", "fp32", 64)
    draft = load_draft(head / "draft.pth", model)
    sampling, counts, lengths = SamplingConfig(temperature=1.0), {}, []
    for i in range(STAT_SAMPLES):
        torch.manual_seed(i)
        result = decode.generate(model, PROMPT, N_TOKENS, sampling, draft=draft, tree=TreeConfig(2, 3, 8))
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        lengths += result.accept_lengths
    assert max(lengths) > 1  # drafts were accepted: the acceptance rule was exercised
    from collections import Counter
    assert not chi_square_p_below(Counter(counts), exact_distribution(target, sampling))


# ---- heads that do not fit, and what a DFlash head cannot do ---------------------------------------------

@pytest.mark.parametrize("change, match", [
    ({"hidden_size": 32}, "hidden size 32 vs 64"),
    ({"vocab_size": 90}, "vocabulary 90 vs 96"),
    ({"num_target_layers": 36}, "target layers 36 vs 8"),
    ({"dflash_config": {"mask_token_id": 96, "target_layer_ids": [1, 5]}}, "mask_token_id must be a token id"),
    ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 7]}}, "target_layer_ids .* must name layers -1..6"),
    ({"block_size": 1}, "block_size must be"),
    ({"architectures": ["DFlash2DraftModel"]}, "eaglet runs DFlashDraftModel \\(z-lab\\)")])
def test_a_head_that_does_not_fit_is_refused_by_name(target8, tmp_path, change, match):
    target_dir, _ = target8
    folder, _, _ = head_for(tmp_path, target_dir, 2, 4, [1, 5])
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
    with pytest.raises(EagletError, match=match):
        load_draft(folder / "draft.pth", model)


@pytest.mark.parametrize("edit, match", [(lambda w: w.pop("layers.1.mlp.up_proj.weight"), "layers.1.mlp.up_proj.weight is missing"),
                                         (lambda w: w.update({"layers.2.extra.weight": torch.ones(2)}), "unexpected weights layers.2.extra.weight")])
def test_a_missing_or_unknown_weight_is_named(tmp_path, edit, match):
    w = dflash_weights(2, 2, torch.Generator().manual_seed(0))
    edit(w)
    folder = write_dflash_head(tmp_path / "head", w, dflash_config(2, 4, 3, [1, 5], 96, 8))
    with pytest.raises(EagletError, match=match):
        convert(folder)


def test_the_cli_refuses_a_tree_deeper_than_the_block_and_a_draft_vocab(target8, tmp_path):
    target_dir, _ = target8
    folder, _, _ = head_for(tmp_path, target_dir, 2, 4, [1, 5])
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--draft_checkpoint_path", str(folder / "draft.pth"),
            "--prompt", "w1 w2", "--max_new_tokens", "4"]
    expect_error(base + ["--depth", "3"], "a tree of depth 3 needs a block of 5 tokens; this DFlash head was trained "
                                          "on blocks of 4 (depth at most 2)")
    (tmp_path / "vocab.json").write_text(json.dumps({"token_ids": [4, 5, 6]}))
    expect_error(base + ["--draft_vocab", str(tmp_path / "vocab.json")], "a DFlash head scores the target's whole vocabulary")


@pytest.mark.slow
def test_tree_auto_measures_the_head_s_own_grid(target8, tmp_path, monkeypatch, capsys):
    """--tree auto with a DFlash head tunes over trees its block can draft: chains of the block and of half of
    it, and trees at the block's depth."""
    target_dir, _ = target8
    folder, _, _ = head_for(tmp_path, target_dir, 2, 4, [1, 5])
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))
    generate.main(["--checkpoint_path", str(target_dir / "model.pth"), "--draft_checkpoint_path",
                   str(folder / "draft.pth"), "--prompt", "w1 w2", "--max_new_tokens", "8", "--tree", "auto"])
    assert "trees (depth/top-k/tokens 2/1/4, 1/1/3, 2/3/16, 2/4/32, 2/10/60)" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_times_a_random_dflash_head_of_the_published_shape(tmp_path):
    import bench
    bench.main(["--model", "tiny", "--random_head", "dflash", "--device", "cpu", "--repeats", "1", "--side_tokens", "8",
                "--max_seq_length", "512", "--out", str(tmp_path / "b")])
    results = json.loads((tmp_path / "b.json").read_text())
    assert results["setup"]["tree"] == {"depth": 14, "topk": 1, "total_tokens": 16}  # the chain of its block of 16
    assert results["cycle"]["draft_passes"] == 1 and "DFlash" in results["setup"]["head"]
    assert results["side_by_side"]["eaglet EAGLE-2"]["same_tokens_as_plain"]


def test_greedy_equals_plain_on_an_int8_target_and_running_ahead(target8, tmp_path):
    """The exactness of any head, here a DFlash one with acceptance injected: on an int8 target (against plain
    decoding of the same int8 target), and with call k + 1 queued before call k's tokens are read."""
    import shutil
    import quantize
    target_dir = shutil.copytree(target8[0], tmp_path / "target")  # the int8 file is written beside it
    folder, _, _ = head_for(tmp_path, target_dir, 2, 4, [1, 5])
    quantize.main(["--checkpoint_path", str(target_dir / "model.pth"), "--mode", "int8"])
    for path, ahead in ((quantize.output_path(target_dir / "model.pth", "int8", 128), False),
                        (target_dir / "model.pth", True)):
        model = load_target(path, "cpu", "fp32", 128)
        draft = load_draft(folder / "draft.pth", model)
        for prompt in ([1, 5, 9], [1, 7, 8, 9, 10, 11, 12]):
            plain = decode.generate(model, prompt, 24, SamplingConfig())
            agreeing(draft, prompt + plain.tokens, seed=len(prompt))
            spec = decode.generate(model, prompt, 24, SamplingConfig(), draft=draft, tree=TreeConfig(2, 3, 10),
                                   run_ahead=ahead)
            del draft.block_states, draft.topk_of_logits  # the class's own again
            assert spec.tokens == plain.tokens and max(spec.accept_lengths) >= 2
