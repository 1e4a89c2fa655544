"""The dynamic draft tree against a brute-force, node-by-node reading of EAGLE-2's rule: expand the topk best
nodes of each level topk ways, then keep the total_tokens - 1 best candidates by cumulative log-probability."""
import pytest
from functools import partial
import torch

from draft import build_tree
from attention import attention_mask

H, V = 16, 40


class FakeDraft:
    """A deterministic draft: each node's output depends on its token and its parent's output (its path)."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.A, self.B, self.C = (torch.randn(V, H, generator=g), torch.randn(H, H, generator=g) / H ** 0.5,
                                  torch.randn(H, V, generator=g))
        self.calls = []

    def step(self, tokens, features, input_pos, slots, mask):
        self.calls.append((tokens.clone(), input_pos.clone(), slots.clone(), mask.clone()))
        return torch.tanh(self.A[tokens] + features @ self.B)

    def logp(self, h):
        return torch.log_softmax(3 * h @ self.C, dim=-1)


def reference_tree(draft, h_last, topk, depth, total_tokens):
    """Plain Python: every node is (path of tokens, score, own output used by its children)."""
    logp = draft.logp(h_last)
    frontier = [((t,), logp[t].item(), h_last) for t in logp.topk(topk).indices.tolist()]
    pool, levels = list(frontier), [frontier]
    for _ in range(depth):
        children = []
        for path, score, feature in frontier:
            h = draft.step(torch.tensor([path[-1]]), feature[None], torch.zeros(1, dtype=torch.long),
                           torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))[0]
            child_logp = draft.logp(h)
            children += [(path + (t,), score + child_logp[t].item(), h) for t in child_logp.topk(topk).indices.tolist()]
        pool += children
        frontier = sorted(children, key=lambda n: -n[1])[:topk]
        levels.append(frontier)
    kept = sorted(pool, key=lambda n: -n[1])[:total_tokens - 1]
    return {n[0] for n in kept}, levels


def node_paths(tree):
    paths = []
    for i in range(len(tree.tokens)):
        path, j = [], i
        while j != 0:
            path.append(tree.tokens[j].item())
            j = tree.parents[j].item()
        paths.append(tuple(reversed(path)))
    return paths


@pytest.mark.parametrize("topk,depth,total_tokens", [(4, 3, 20), (3, 5, 16), (10, 6, 60), (2, 2, 7)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_matches_brute_force(topk, depth, total_tokens, seed):
    draft = FakeDraft(seed)
    h_last = torch.randn(H, generator=torch.Generator().manual_seed(100 + seed))
    root, ctx_len, size = torch.tensor(7), torch.tensor(11), 11 + max(depth * topk, total_tokens) + 5
    tree = build_tree(draft.step, lambda h, k: draft.logp(h).topk(k), h_last, root, ctx_len, topk, depth, total_tokens,
                       partial(attention_mask, max_seq_length=size))
    calls = list(draft.calls)
    expected, levels = reference_tree(draft, h_last, topk, depth, total_tokens)

    paths = node_paths(tree)
    assert paths[0] == () and tree.tokens[0] == root
    assert set(paths[1:]) == expected and len(paths) == total_tokens
    assert all(tree.parents[i] < i for i in range(1, total_tokens))  # parents before children
    assert tree.depths.tolist() == [len(p) for p in paths]
    for i, p in enumerate(paths):  # ancestors = the nodes whose path is a prefix of this node's
        assert tree.ancestors[i].tolist() == [p[:len(q)] == q for q in paths]
    # The mask the target verifies with: the whole context plus the node's ancestors and itself.
    mask = attention_mask(ctx_len, tree.ancestors, size)
    assert mask[:, :11].all() and not mask[:, 11 + total_tokens:].any()
    assert torch.equal(mask[:, 11:11 + total_tokens], tree.ancestors)

    # Each expansion step ran on the expected frontier, at the right position, seeing its own ancestors.
    assert len(calls) == depth
    slot_token = {}
    for i, (tokens, input_pos, slots, mask) in enumerate(calls):
        assert (input_pos == ctx_len + i).all()
        assert torch.equal(slots, ctx_len + torch.arange(i * topk, (i + 1) * topk))
        slot_token.update(zip(slots.tolist(), tokens.tolist()))
        assert mask[:, :11].all() and not mask[:, 11 + (i + 1) * topk:].any()
        seen = [tuple(slot_token[s] for s in range(11, size) if mask[row, s]) for row in range(topk)]
        assert sorted(seen) == sorted(n[0] for n in levels[i])


def test_the_rerank_is_given_each_candidates_parent_and_depth(monkeypatch):
    """choose_nodes, the rule a fork changes, gets every candidate's parent (pool index, -1: the root) and depth,
    true to the grown pool: a parent one level up, 0 at the root's children. A fork's cap of two nodes a depth,
    written against them, gives a tree of at most two nodes a depth."""
    import draft_tree
    seen, default = [], draft_tree.choose_nodes

    def capped(scores, parents, depths, total_tokens):
        kept, per_depth = [], {}  # the best first, two a depth, a node only below a kept parent
        for i in torch.sort(scores, descending=True, stable=True).indices.tolist():
            d, p = depths[i].item(), parents[i].item()
            if per_depth.get(d, 0) < 2 and (p < 0 or p in kept) and len(kept) < total_tokens - 1:
                kept.append(i)
                per_depth[d] = per_depth.get(d, 0) + 1
        return torch.tensor(sorted(kept))

    draft, h_last = FakeDraft(0), torch.randn(H, generator=torch.Generator().manual_seed(100))
    grow = partial(build_tree, draft.step, lambda h, k: draft.logp(h).topk(k), h_last, torch.tensor(7),
                   torch.tensor(11), 3, 4, 9, partial(attention_mask, max_seq_length=40))
    monkeypatch.setattr(draft_tree, "choose_nodes", lambda *a: seen.append(a[:3]) or default(*a))
    grow()
    scores, parents, depths = seen[0]
    assert depths.tolist() == [0] * 3 + [1] * 9 + [2] * 9 + [3] * 9 + [4] * 9
    assert all((p == -1) == (d == 0) for p, d in zip(parents.tolist(), depths.tolist()))
    assert all(depths[p] == d - 1 for p, d in zip(parents.tolist(), depths.tolist()) if p >= 0)
    assert all(scores[p] >= s for p, s in zip(parents.tolist(), scores.tolist()) if p >= 0)
    monkeypatch.setattr(draft_tree, "choose_nodes", capped)
    tree = grow()
    counts = torch.bincount(tree.depths)[1:]
    assert counts.sum() == 8 and counts.max() == 2 and all(tree.parents[i] < i for i in range(1, 9))
    assert torch.bincount(depths[default(scores, parents, depths, 9)]).max() > 2  # the cap changed the tree
