"""The target model against transformers, and the tree block / KV compaction the EAGLE cycle needs."""
import pytest
import torch

from attention import causal_mask
from model import Transformer

CASES = [("llama2", {}, 0), ("llama31", {}, 0), ("llama31", {}, 3000), ("mistral", {}, 0), ("qwen2", {}, 0),
         ("qwen3", {}, 0), ("llama_bias", {}, 0), ("llama_mlp_bias", {}, 0),
         ("llama2", {"max_shard_size": "100KB"}, 0),  # sharded safetensors
         ("llama31", {"bin_shards": 1}, 0),  # pytorch_model.bin
         ("qwen2", {"bin_shards": 3}, 0)]  # sharded .bin with its index
CASE_IDS = ["llama2", "llama31", "llama31-rope-scaled-positions", "mistral", "qwen2-bias-tied", "qwen3-qk-norm",
            "llama-attention-and-mlp-bias", "llama-mlp-bias", "sharded-safetensors", "bin", "sharded-bin"]


def load(path, max_seq_length=64):
    model = Transformer.from_checkpoint(path / "model.pth")
    model.setup_caches(1, max_seq_length)
    return model


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kind,save_kwargs,offset", CASES, ids=CASE_IDS)
def test_logits_match_transformers(checkpoints, kind, save_kwargs, offset):
    """Prefill then decode steps, at positions starting at `offset` (so llama3 rope scaling is exercised):
    logits and the final-normed hidden states. The fixture's biases are random, so a dropped one shows."""
    path, hf = checkpoints(kind, **save_kwargs)
    assert all(p.abs().max() > 0 for n, p in hf.named_parameters() if n.endswith("bias"))
    if save_kwargs.get("max_shard_size"):
        assert (path / "model.safetensors.index.json").exists()
    if save_kwargs.get("bin_shards"):
        assert not list(path.glob("*.safetensors"))
    size = offset + 16  # the rope table covers the cache; slots (0..) and positions (offset..) differ here
    model = load(path, size)
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (1, 12))
    positions = torch.arange(offset, offset + 12)
    with torch.no_grad():
        out = hf(ids, position_ids=positions[None], output_hidden_states=True)
        ref, ref_hidden = out.logits, out.hidden_states[-1]  # transformers applies the final norm to the last
        slots = torch.arange(8)
        logits, hidden = model(ids[:, :8], positions[:8], slots, torch.arange(size) <= slots[:, None])
        assert rel_err(logits, ref[:, :8]) < 1e-4 and rel_err(hidden, ref_hidden[:, :8]) < 1e-4
        for t in range(8, 12):  # one-token decode steps
            slot = torch.tensor([t])
            logits, hidden = model(ids[:, t:t + 1], positions[t:t + 1], slot, torch.arange(size) <= slot[:, None])
            assert rel_err(logits[:, 0], ref[:, t]) < 1e-4 and rel_err(hidden[:, 0], ref_hidden[:, t]) < 1e-4


def test_features_are_final_normed_hidden_state(checkpoints):
    path, hf = checkpoints("llama31")
    model = load(path)
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states[-1]  # transformers applies the final norm here
        pos = torch.arange(10)
        logits, hidden = model(ids, pos, pos, causal_mask(pos, 64), logits_idx=torch.tensor([9]))
    assert rel_err(hidden, ref) < 1e-4
    assert logits.shape == (1, 1, 96)


@pytest.mark.parametrize("layers", [(2, 4, 5), (1, 7, 3, 3)], ids=["eagle3-default", "configured-unsorted"])
def test_feature_layers_are_hidden_states_entering_them(checkpoints, layers):
    """EAGLE-3 features: transformers' output_hidden_states[i] is the residual stream entering layer i."""
    path, hf = checkpoints("llama8")
    model = load(path)
    model.set_feature_layers(layers)
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
        pos = torch.arange(10)
        _, features = model(ids, pos, pos, causal_mask(pos, 64))
    assert features.shape == (1, 10, 64 * len(layers))
    for chunk, i in zip(features.split(64, dim=-1), layers):
        assert rel_err(chunk, states[i]) < 1e-4


def test_feature_layers_out_of_range(checkpoints):
    from model import EagletError
    model = load(checkpoints("llama8")[0])
    with pytest.raises(EagletError, match="do not exist"):
        model.set_feature_layers((2, 4, 9))


# A tree over 7 nodes after the context: node i has parent PARENTS[i] (-1 = child of the last context token).
PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def tree_inputs(n_ctx, parents, max_seq_length):
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    n = len(parents)
    ancestor = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            ancestor[i] |= ancestor[p]
    mask = torch.zeros(n, max_seq_length, dtype=torch.bool)
    mask[:, :n_ctx] = True
    mask[:, n_ctx:n_ctx + n] = ancestor
    return torch.tensor(depth) + n_ctx, torch.arange(n_ctx, n_ctx + n), mask


def path_to(i, parents):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("kind", ["llama31", "qwen2"])
def test_tree_block_matches_causal_paths(checkpoints, kind):
    path, _ = checkpoints(kind)
    model = load(path)
    torch.manual_seed(2)
    context = torch.randint(0, 96, (1, 9))
    tree = torch.randint(0, 96, (1, len(PARENTS)))
    with torch.no_grad():
        pos = torch.arange(9)
        model(context, pos, pos, causal_mask(pos, 64))
        tree_pos, tree_slots, mask = tree_inputs(9, PARENTS, 64)
        logits, hidden = model(tree, tree_pos, tree_slots, mask)
        for i in range(len(PARENTS)):
            seq = torch.cat([context, tree[:, path_to(i, PARENTS)]], dim=1)
            pos = torch.arange(seq.shape[1])
            ref_logits, ref_hidden = load(path)(seq, pos, pos, causal_mask(pos, 64))
            assert rel_err(logits[:, i], ref_logits[:, -1]) < 1e-4
            assert rel_err(hidden[:, i], ref_hidden[:, -1]) < 1e-4


def test_kv_compaction_equals_plain_decoding(checkpoints):
    path, _ = checkpoints("llama31")
    model = load(path)
    torch.manual_seed(3)
    context = torch.randint(0, 96, (1, 9))
    tree = torch.randint(0, 96, (1, len(PARENTS)))
    accepted = path_to(6, PARENTS)  # nodes 0, 1, 4, 6
    with torch.no_grad():
        pos = torch.arange(9)
        model(context, pos, pos, causal_mask(pos, 64))
        tree_pos, tree_slots, mask = tree_inputs(9, PARENTS, 64)
        model(tree, tree_pos, tree_slots, mask)
        model.compact_kv(tree_slots[accepted], torch.arange(9, 9 + len(accepted)))
        plain = load(path)
        seq = torch.cat([context, tree[:, accepted]], dim=1)
        pos = torch.arange(seq.shape[1])
        plain(seq, pos, pos, causal_mask(pos, 64))
    n = seq.shape[1]
    for layer, ref in zip(model.layers, plain.layers):
        got, want = layer.attention.kv_cache, ref.attention.kv_cache
        assert torch.allclose(got.k_cache[:, :, :n], want.k_cache[:, :, :n], atol=1e-5)
        assert torch.allclose(got.v_cache[:, :, :n], want.v_cache[:, :, :n], atol=1e-5)
