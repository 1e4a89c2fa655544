"""Training EAGLE-3 heads (train_draft.py --head eagle3): the unrolled training forward is the decode-time
tree, training raises acceptance, the saved head converts and decodes losslessly, and mistakes are refused."""
import json

import pytest
import torch
from safetensors.torch import load_file

import generate
import train_draft
from conftest import expect_error
from convert_hf_checkpoint import convert
from draft import Eagle3Draft, build_tree
from generate import SamplingConfig, TreeConfig, catch_up, load_draft, load_target

GREEDY = SamplingConfig()
PUBLISHED_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{k}.weight" for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def fresh_head(target, draft_vocab=40, seed=0, std=0.3):
    """An untrained head with a reduced draft vocabulary, its layer weights large enough that every input matters."""
    config = train_draft.eagle3_config(target.args, draft_vocab)
    draft_ids = torch.randperm(target.args.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    head = train_draft.new_eagle3_head(target, draft_ids.sort().values, config, seed)
    with torch.no_grad():
        for p in head.layer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * std)
    return head


def tree_outputs(target, head, tokens, features, t, steps, topk=3):
    """The head's outputs along one root-to-leaf path of the decode-time tree: catch-up over the pairs
    (f_0, x_1) .. (f_t, x_{t+1}) (root x_{t+1}), then build_tree with a top-k that ranks the data's next token
    first at every node, so that the path x_{t+2}, x_{t+3}, ... stays at the front of the frontier while
    other candidates fill the rest of it (and their own cache slots)."""
    head.setup_caches(64)
    h_last = catch_up(target, head, tokens[1:t + 2], features[:t + 1], torch.tensor(0), torch.tensor(t))
    level = iter(range(steps))
    path_outputs = [h_last]

    def topk_fn(h, k):
        i = next(level)
        rows = h.view(-1, h.shape[-1]).shape[0]
        ids = torch.stack([torch.roll(torch.arange(k) * 7 + 3 + r, 1) for r in range(rows)])
        ids[:, 0] = tokens[min(t + 2 + i, len(tokens) - 1)]  # the last level's children are never run
        logp = -torch.arange(k, dtype=torch.float).expand(rows, k) - torch.arange(rows)[:, None]
        return (logp[0], ids[0]) if h.dim() == 1 else (logp, ids)

    def step(node_tokens, inputs, input_pos, slots, mask):
        out = head.step(target, node_tokens, inputs, input_pos, slots, mask)
        assert node_tokens[0] == tokens[t + 1 + len(path_outputs)]  # the data's path leads the frontier
        path_outputs.append(out[0])
        return out

    build_tree(step, topk_fn, h_last, tokens[t + 1], torch.tensor(t + 1), topk, steps - 1, 10, 64)
    return torch.stack(path_outputs)


def test_unrolled_training_forward_is_the_decode_time_tree(checkpoints):
    """Step j of the training-time test at index t equals the tree node j levels below the root x_{t+1},
    run by the decode-time machinery (catch-up, build_tree, the draft's KV cache and tree mask)."""
    target_dir, _ = checkpoints("llama8")
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    head = fresh_head(target)
    target.set_feature_layers(head.feature_layers)
    steps, seq = 5, 20
    tokens = torch.randint(3, target.args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(seq)
    target.setup_rope(seq)
    head.setup_rope(seq + steps)
    with torch.no_grad():
        _, features = target(tokens, pos, None, train_draft.causal(seq, "cpu"))
        unrolled = torch.stack(train_draft.unroll(head, target, tokens, features, steps), dim=1)  # [B, steps, T-1, dim]
        target.setup_caches(1, 64)
        for b in range(2):
            for t in (0, 4, seq - steps - 1):
                decoded = tree_outputs(target, head, tokens[b], features[b], t, steps)
                torch.testing.assert_close(unrolled[b, :, t], decoded, atol=1e-4, rtol=1e-4)
    # the unroll's steps differ from one another (each reads its own parent), so the comparison has teeth
    assert (unrolled[:, 1] - unrolled[:, 0]).abs().max() > 0.1
