"""Several rows at once: a target whose rows sit at different positions of their own cache rows (per-row
positions, slots, masks and compaction) computes for each row what it computes for that row alone."""
import pytest
import torch

from generate import load_target
from model import attention_mask, causal_mask

LENGTHS = (5, 9, 3)


def random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """Ancestors-and-self [n, n] of a random tree whose nodes come after their parents."""
    parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


@pytest.mark.parametrize("kind", ["llama31", "qwen3", "llama_bias"])
def test_rows_at_different_places_equal_each_row_alone(checkpoints, kind):
    path = checkpoints(kind)[0]
    batch, alone = load_target(path, "cpu", "fp32", 64), load_target(path, "cpu", "fp32", 64)
    batch.setup_caches(max_batch_size=len(LENGTHS), max_seq_length=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (n,), generator=g) for n in LENGTHS]
    width = max(LENGTHS)
    padded = torch.stack([torch.cat([p, torch.full((width - len(p),), 3)]) for p in prompts])  # padding after
    pos = torch.arange(width).expand(len(LENGTHS), -1)
    last = torch.tensor(LENGTHS)[:, None] - 1
    with torch.no_grad():
        logits, hidden = batch(padded, pos, pos, causal_mask(pos, 64), logits_idx=last)
        n_tree, ctx = 7, torch.tensor(LENGTHS)
        trees = torch.stack([random_tree(n_tree, g) for _ in LENGTHS])
        tokens = torch.randint(4, 96, (len(LENGTHS), n_tree), generator=g)
        depths = trees.sum(-1) - 1
        slots = ctx[:, None] + torch.arange(n_tree)
        tree_logits, tree_hidden = batch(tokens, ctx[:, None] + depths, slots, attention_mask(ctx, trees, 64))
        keep = torch.stack([torch.tensor([0, 3, 5]) for _ in LENGTHS])  # a path's slots, moved after the context
        batch.compact_kv(ctx[:, None] + keep, ctx[:, None] + torch.arange(3))
        step_pos = (ctx + 3)[:, None]
        step_logits, _ = batch(tokens[:, :1], step_pos, step_pos, causal_mask(step_pos, 64))
        for b, prompt in enumerate(prompts):
            alone.setup_caches(max_batch_size=1, max_seq_length=64)
            n = len(prompt)
            p = torch.arange(n)
            one_logits, one_hidden = alone(prompt[None], p, p, causal_mask(p, 64), logits_idx=torch.tensor([-1]))
            torch.testing.assert_close(logits[b], one_logits[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hidden[b, :n], one_hidden[0], rtol=1e-5, atol=1e-5)
            c = torch.tensor(n)
            one_logits, one_hidden = alone(tokens[b:b + 1], c + depths[b], c + torch.arange(n_tree),
                                           attention_mask(c, trees[b], 64))
            torch.testing.assert_close(tree_logits[b], one_logits[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tree_hidden[b], one_hidden[0], rtol=1e-5, atol=1e-5)
            alone.compact_kv(c + keep[0], c + torch.arange(3))
            one_logits, _ = alone(tokens[b:b + 1, :1], (c + 3).view(1), (c + 3).view(1), causal_mask((c + 3).view(1), 64))
            torch.testing.assert_close(step_logits[b], one_logits[0], rtol=1e-5, atol=1e-5)


def test_batched_mask_builder_equals_one_row_at_a_time():
    g = torch.Generator().manual_seed(1)
    ctx = torch.tensor([0, 4, 9])
    blocks = torch.stack([random_tree(6, g) for _ in ctx])
    batched = attention_mask(ctx, blocks, 20)
    for b in range(3):
        assert torch.equal(batched[b], attention_mask(ctx[b], blocks[b], 20))
    shared = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(attention_mask(ctx, shared, 20)[2], attention_mask(ctx[2], shared, 20))
