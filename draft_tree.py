"""The draft tree: what one cycle verifies, the tree kinds that build it from a head, and EAGLE-2's rerank.

Every tree kind has the same interface, all the cycle, the cache and the tools ask of it:
    total_tokens        nodes the target verifies per cycle, the root included
    levels              tokens one cycle emits at most: the deepest path below the root, and the bonus token
    scratch             cache slots used past the context
    draft_passes(head)  forwards of the head per cycle, each scoring with an lm_head: the weights they read
    describe()          one line for the start-up message
    check(head)         refuse (EagletError) a head this tree cannot be drafted from
    expand(target, head, root, ctx_len, h_last) -> DraftTree
A new kind is one class with these and a flag in generate.model_flags. The kinds here: TreeConfig, EAGLE-2's
dynamic tree (from a block drafter, grown over its block's lattice), and StaticTree, a fixed node list
(Medusa's and EAGLE-1's trees).

Heads give building blocks, not trees: an EAGLE head step() (one draft pass over tokens paired with features)
and topk() (its k best next tokens: log-probabilities and target ids); a block drafter (DFlash, DSpark: block_size
set) draft_rows(), its block's draft rows from ONE pass, and next_logits(), a row's logits after a given token.

Imports model.py; draft.py and decode.py import this file. (Not named tree.py: torch.compile
skips a module of that name, taking it for the dm-tree package, and the cycle would not compile.)
"""
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from model import EagletError, Transformer


@dataclass
class DraftTree:
    """total_tokens tree nodes, the root (the last emitted token) first, parents before children. A batch of
    trees (one per row) has a leading [B] on every field."""
    tokens: Tensor  # [N] int64
    parents: Tensor  # [N] tree index of the parent; the root points to itself
    depths: Tensor  # [N] 0 for the root
    ancestors: Tensor  # [N, N] bool: ancestors[i, j] = j is i or an ancestor of i
    draft_logp: Tensor  # [N] the draft's log-probability of each node given its parent (0 for the root); -inf: a
    # node the head's confidence cut, which holds its place in the fixed shape but is never accepted


def take(x: Tensor, index: Tensor) -> Tensor:
    """x[..., index, :] row by row: x [..., n, d], index [..., m] -> [..., m, d] (a batch's own indices per row)."""
    return x.gather(-2, index[..., None].expand(*index.shape, x.shape[-1]))


def is_block_drafter(head) -> bool:
    """A head that drafts a whole block in one pass (DFlash) rather than one level per pass (EAGLE)."""
    return getattr(head, "block_size", None) is not None


def check_topk(head, topk: int):
    if topk > head.vocab_size:
        raise EagletError(f"tree_topk {topk} exceeds the draft's vocabulary ({head.vocab_size})")


def head_name(head) -> str:
    """A head's kind as messages name it: DFlash, DSpark, Eagle, Eagle3."""
    return type(head).__name__.removesuffix("Draft")


def check_block(head, depth: int):
    if is_block_drafter(head) and depth + 1 > head.max_levels:
        raise EagletError(f"a tree of depth {depth} needs a block of {depth + 1 + head.first_row} tokens; this "
                          f"{head_name(head)} head was trained on blocks of {head.block_size} (depth at most "
                          f"{head.max_levels - 1})")


@dataclass
class TreeConfig:
    """EAGLE-2's dynamic tree: the topk best nodes of each level grow topk children each, depth levels deep, and
    the total_tokens - 1 best of every candidate by path probability are verified. From a block drafter, the
    same growth over its block's lattice (one pass); --tree_topk 1 is a chain."""
    depth: int = 6  # expansion steps: the tree has depth + 1 levels below the root
    topk: int = 10  # children per expanded node, and nodes kept per level
    total_tokens: int = 60  # tokens the target verifies per cycle, root included

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1:
            raise EagletError(f"depth and tree_topk must be at least 1, got {self.depth} and {self.topk}")
        if not 2 <= self.total_tokens <= self.max_total_tokens:
            raise EagletError(f"total_tokens must be between 2 and {self.max_total_tokens} (1 + tree_topk + "
                              f"depth * tree_topk^2) for this depth and tree_topk, got {self.total_tokens}")

    @property
    def max_total_tokens(self) -> int:
        """The root plus every candidate the expansion produces."""
        return 1 + self.topk + self.depth * self.topk ** 2

    @property
    def levels(self) -> int:
        return self.depth + 2

    @property
    def scratch(self) -> int:
        """The verified tree, the draft's levels (depth x topk slots), the catch-up."""
        return max(self.total_tokens, self.depth * self.topk, self.levels)

    def draft_passes(self, head) -> int:
        return 1 if is_block_drafter(head) else self.depth + 1

    def describe(self) -> str:
        return f"tree {self.total_tokens} tokens, depth {self.depth}, top-k {self.topk}"

    def check(self, head):
        check_block(head, self.depth)
        check_topk(head, self.topk)

    def expand(self, target: Transformer, head, root: Tensor, ctx_len: Tensor, h_last: Tensor) -> DraftTree:
        if is_block_drafter(head):
            check_block(head, self.depth)
            children = lattice(target, head, root, ctx_len, h_last, self.depth + 1, self.topk)
            return grow_lattice(children, root, self.depth + 1, self.topk, self.total_tokens)
        return build_tree(partial(head.step, target), partial(head.topk, target), h_last, root, ctx_len,
                          self.topk, self.depth, self.total_tokens, head.context_mask)


def build_tree(step, topk_fn, h_last: Tensor, root: Tensor, ctx_len: Tensor, topk: int, depth: int,
               total_tokens: int, context_mask) -> DraftTree:
    """EAGLE-2's dynamic tree with fixed shapes and no loop over nodes: expand the topk best nodes of each
    level topk ways (depth draft passes), then keep the total_tokens - 1 best of all candidates by cumulative
    draft log-probability (a node's score is its whole path's).

    step(tokens [k], features [k, dim], input_pos [k], slots [k], mask) -> draft outputs [k, dim];
    context_mask(ctx_len, block [k, W]) -> the mask of a level's nodes (they see the context and the block's slots:
    the head's context_mask);
    topk_fn(h [..., dim], k) -> the k best draft log-probabilities and their token ids [..., k]. Level i of the frontier sits at position
    ctx_len + i and is written to draft slots ctx_len + i * topk + j. A batch: h_last [B, dim], root and
    ctx_len [B], every shape above with a leading [B], one tree per row (each at its own ctx_len).
    """
    device = h_last.device
    scores, tokens = topk_fn(h_last, topk)  # [..., k]
    features = h_last[..., None, :].expand(*tokens.shape, -1)
    frontier = torch.arange(topk, device=device).expand_as(tokens)  # pool indices of the frontier
    width = depth * topk  # draft scratch slots
    anc = torch.zeros(*tokens.shape, width, dtype=torch.bool, device=device)  # frontier's ancestors-and-self slots
    pool_tokens, pool_scores, pool_logp = [tokens], [scores], [scores]
    pool_parents = [torch.full_like(tokens, -1)]
    start = ctx_len[..., None]  # [1] for one row, [B, 1] for a batch
    for i in range(depth):
        slots = torch.arange(i * topk, (i + 1) * topk, device=device)
        anc[..., slots] |= torch.eye(topk, dtype=torch.bool, device=device)
        h = step(tokens, features, (start + i).expand_as(tokens), start + slots,
                 context_mask(ctx_len, anc))
        child_logp, child_tokens = topk_fn(h, topk)  # [..., k, k]
        child_scores = (scores[..., None] + child_logp).flatten(-2)
        base = topk + i * topk * topk
        pool_tokens.append(child_tokens.flatten(-2))
        pool_scores.append(child_scores)
        pool_logp.append(child_logp.flatten(-2))
        pool_parents.append(frontier.repeat_interleave(topk, dim=-1))
        scores, best = child_scores.topk(topk)
        parent = best // topk
        tokens, features, anc = child_tokens.flatten(-2).gather(-1, best), take(h, parent), take(anc, parent)
        frontier = base + best
    return pick_tree(pool_scores, pool_tokens, pool_logp, pool_parents, root, depth + 1, total_tokens)


def lattice(target: Transformer, head, root: Tensor, ctx_len: Tensor, h_last: Tensor, levels: int, k: int):
    """A block drafter's children function from ONE pass of its block: children(i, prev [..., m]) -> the k best
    drafts at level i after each prev token (log-probabilities and target ids [..., m, k]). Level i's logits are
    block row i's (once through the lm_head; XPress's refined), then head.next_logits(row, prev, state): DFlash's the
    same after every prev, DSpark's with the Markov bias of prev, DFlash2's candidates rescored after prev (the
    node's own token: each branch scored exactly). Drafts the head's
    confidence cuts get log-probability -inf: never verified as drafts (accept() skips them)."""
    states, rows = head.draft_rows(target, root, ctx_len, levels, h_last)  # rows [..., levels, vocab]

    def children(i, prev):
        logp, ids = head.topk_of_logits(head.next_logits(rows[..., i, None, :], prev, states[..., i, None, :]), k)
        cut = head.cut(states[..., i, None, :], prev)
        if cut is not None:
            logp = logp.masked_fill(cut[..., None], float("-inf"))
        shape = (*prev.shape, k)
        return logp.expand(shape), ids.expand(shape)
    return children


def grow_lattice(children, root: Tensor, levels: int, k: int, total_tokens: int) -> DraftTree:
    """EAGLE-2's growth over a block drafter's levels: the k best paths of each level grow k children each
    (children(i, tokens [..., m]) -> logp, ids [..., m, k]), then the total_tokens - 1 best nodes by path score
    are kept; k = 1 gives the chain (a Markov head's walk: each draft after the pick before it)."""
    scores, tokens = (t.flatten(-2) for t in children(0, root[..., None]))
    frontier = torch.arange(k, device=root.device).expand_as(tokens)
    pool_tokens, pool_scores, pool_logp, pool_parents = [tokens], [scores], [scores], [torch.full_like(frontier, -1)]
    for i in range(1, levels):
        child_logp, child_ids = (t.flatten(-2) for t in children(i, tokens))  # [..., k parents x k children]
        child_scores = scores.repeat_interleave(k, dim=-1) + child_logp
        pool_tokens.append(child_ids)
        pool_scores.append(child_scores)
        pool_logp.append(child_logp)
        pool_parents.append(frontier.repeat_interleave(k, dim=-1))
        scores, best = child_scores.topk(k)
        tokens, frontier = child_ids.gather(-1, best), k + (i - 1) * k * k + best
    return pick_tree(pool_scores, pool_tokens, pool_logp, pool_parents, root, levels, total_tokens)


def pick_tree(pool_scores: list, pool_tokens: list, pool_logp: list, pool_parents: list, root: Tensor, levels: int,
              total_tokens: int) -> DraftTree:
    """The tree kept from a grown pool, given level by level (lists of [..., n] tensors, level 0 first)."""
    depths = torch.cat([torch.full_like(s, i, dtype=torch.long) for i, s in enumerate(pool_scores)], dim=-1)
    parents = torch.cat(pool_parents, dim=-1)
    kept = choose_nodes(torch.cat(pool_scores, dim=-1), parents, depths, total_tokens)
    return layout_tree(kept, torch.cat(pool_tokens, dim=-1), torch.cat(pool_logp, dim=-1), parents, root, levels)


def choose_nodes(scores: Tensor, parents: Tensor, depths: Tensor, total_tokens: int) -> Tensor:
    """EAGLE-2's rerank: the pool indices of the total_tokens - 1 best nodes by cumulative score, in pool order
    (per row of a batch). Each candidate comes with its path's score, its parent's pool index (-1: the root) and
    its depth (0: a child of the root), all [..., pool]: a fork's rule (a cap per depth, a bonus by parent) reads
    them here. Whatever the rule, the kept set must be a tree: every kept node's parent kept.

    The pool is in level order, so parents come before children; a child never scores above its parent,
    and a stable sort breaks ties by pool order, so the kept set is a tree (every parent kept too)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :total_tokens - 1].sort(dim=-1).values


def layout_tree(kept: Tensor, pool_tokens, pool_logp, pool_parents, root, levels: int) -> DraftTree:
    """The kept pool nodes as a DraftTree, the root in front and parents before children. pool_parents holds
    pool indices (-1 for the first level: the root); levels bounds the depth below the root."""
    device = pool_tokens.device
    n, pool = kept.shape[-1] + 1, pool_tokens.shape[-1]
    tree_index = torch.zeros(*kept.shape[:-1], pool + 1, dtype=torch.long, device=device)  # pool -> tree index
    tree_index.scatter_(-1, kept, torch.arange(1, n, device=device).expand_as(kept))
    # pool_parents is -1 at level 0, read as the extra last entry, which stays 0: the root.
    parent_pool = pool_parents.gather(-1, kept) % (pool + 1)
    first = torch.zeros(*kept.shape[:-1], 1, dtype=torch.long, device=device)
    parents = torch.cat([first, tree_index.gather(-1, parent_pool)], dim=-1)
    ancestors = torch.eye(n, dtype=torch.bool, device=device).expand(*kept.shape[:-1], n, n)
    for _ in range(levels):  # each pass adds one more generation of ancestors
        ancestors = ancestors | take(ancestors, parents)
    depths = ancestors.sum(dim=-1) - 1
    tokens = torch.cat([root[..., None], pool_tokens.gather(-1, kept)], dim=-1)
    draft_logp = torch.cat([first.float(), pool_logp.gather(-1, kept).float()], dim=-1)
    return DraftTree(tokens, parents, depths, ancestors, draft_logp)


# A static tree of 26 nodes, 6 deep: wide near the root, where drafts are accepted most, one path deep below.
STATIC_CHOICES = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1),
                  (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
                  (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 1, 0), (0, 0, 1, 0, 0), (1, 0, 0, 0, 0),
                  (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 1, 0))


@dataclass
class StaticTree:
    """A fixed tree (Medusa's, EAGLE-1's): its nodes given as paths of child ranks from the root, (0,) the root's
    best draft, (1,) its second best, (0, 0) the best draft after (0,). Every node's token is its parent's
    rank-th best draft; level by level, one draft pass over a level's nodes gives the next level's (a DFlash
    head: one pass for all). The same shape every cycle, chosen ahead of time."""
    choices: tuple = STATIC_CHOICES

    def __post_init__(self):
        paths = {tuple(p) for p in self.choices} if isinstance(self.choices, (list, tuple)) else None
        if not paths or not all(p and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
                                for p in paths):
            raise EagletError("a static tree is a non-empty list of paths, each a non-empty list of child ranks "
                              "(integers from 0), e.g. [[0], [1], [0, 0]]")
        if len(paths) != len(self.choices):
            raise EagletError("a static tree lists a path twice")
        orphan = next((p for p in paths if len(p) > 1 and p[:-1] not in paths), None)
        if orphan is not None:
            raise EagletError(f"the static tree's path {list(orphan)} has no parent {list(orphan[:-1])} in the tree")
        self.choices = tuple(sorted(paths, key=lambda p: (len(p), p)))  # parents before children
        self.tables = {}

    @property
    def total_tokens(self) -> int:
        return len(self.choices) + 1

    @property
    def depth(self) -> int:
        """Levels below the root."""
        return max(len(p) for p in self.choices)

    @property
    def topk(self) -> int:
        """Drafts read per parent: the highest child rank, plus one."""
        return 1 + max(p[-1] for p in self.choices)

    @property
    def levels(self) -> int:
        return self.depth + 1

    @property
    def scratch(self) -> int:
        """The verified tree, and a draft slot for each node of the levels a pass runs over (all but the last)."""
        return max(self.total_tokens, sum(len(p) < self.depth for p in self.choices), self.levels)

    def draft_passes(self, head) -> int:
        return 1 if is_block_drafter(head) else self.depth

    def describe(self) -> str:
        return f"static tree of {self.total_tokens} tokens, depth {self.depth}"

    def check(self, head):
        check_block(head, self.depth - 1)
        if self.topk > head.vocab_size:
            raise EagletError(f"the static tree's child rank {self.topk - 1} is past the draft's vocabulary "
                              f"({head.vocab_size} tokens: ranks 0 to {head.vocab_size - 1})")

    def table(self, device) -> dict:
        """The shape as index tensors on device, made once: for each level its nodes' tree indices, their
        parents' places in the level above and their ranks; the tree's parents, depths and ancestors; each node's
        draft slot and the draft slots of its ancestors-and-self (for the levels a pass runs over)."""
        if device not in self.tables:
            index = {p: i + 1 for i, p in enumerate(self.choices)}
            stepped = [p for p in self.choices if len(p) < self.depth]
            slot = {p: i for i, p in enumerate(stepped)}
            levels = []
            for d in range(1, self.depth + 1):
                nodes = [p for p in self.choices if len(p) == d]
                above = [p for p in self.choices if len(p) == d - 1]
                levels.append({"tree": [index[p] for p in nodes], "rank": [p[-1] for p in nodes],
                               "parent": [above.index(p[:-1]) if d > 1 else 0 for p in nodes],
                               "slots": [slot[p] for p in nodes] if d < self.depth else []})
            n, width = self.total_tokens, max(1, len(stepped))
            ancestors = torch.eye(n, dtype=torch.bool)
            ancestors[:, 0] = True  # the root is everyone's
            draft_seen = torch.zeros(n, width, dtype=torch.bool)
            for p in self.choices:
                for k in range(1, len(p) + 1):
                    ancestors[index[p], index[p[:k]]] = True
                    if p[:k] in slot:
                        draft_seen[index[p], slot[p[:k]]] = True
            parents = [0] + [index[p[:-1]] if len(p) > 1 else 0 for p in self.choices]
            as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
            self.tables[device] = {
                "levels": [{k: as_tensor(v) for k, v in level.items()} for level in levels],
                "parents": as_tensor(parents), "depths": as_tensor([0] + [len(p) for p in self.choices]),
                "ancestors": ancestors.to(device), "draft_seen": draft_seen.to(device)}
        return self.tables[device]

    def expand(self, target: Transformer, head, root: Tensor, ctx_len: Tensor, h_last: Tensor) -> DraftTree:
        t = self.table(root.device)
        batch = root.shape
        tokens = root[..., None].repeat(*([1] * root.ndim), self.total_tokens)
        logp = torch.zeros(*batch, self.total_tokens, device=root.device)
        if is_block_drafter(head):  # one pass: a node's drafts are its level's block row's, after its parent
            check_block(head, self.depth - 1)
            children = lattice(target, head, root, ctx_len, h_last, self.depth, self.topk)
            for d, level in enumerate(t["levels"]):
                child_logp, child_ids = children(d, tokens[..., t["parents"][level["tree"]]])  # [..., nodes, k]
                rank = level["rank"].expand(*batch, -1)[..., None]
                tokens[..., level["tree"]] = child_ids.gather(-1, rank)[..., 0]
                logp[..., level["tree"]] = child_logp.gather(-1, rank)[..., 0]
        else:
            child_logp, child_ids = head.topk(target, h_last[..., None, :], self.topk)  # [..., 1, k]: the root's
            features = h_last[..., None, :]
            start = ctx_len[..., None]
            for d, level in enumerate(t["levels"]):
                tokens[..., level["tree"]] = child_ids[..., level["parent"], level["rank"]]
                logp[..., level["tree"]] = child_logp[..., level["parent"], level["rank"]].float()
                if d + 1 == self.depth:
                    break
                features = features[..., level["parent"], :]
                mask = head.context_mask(ctx_len, t["draft_seen"][level["tree"]])
                h = head.step(target, tokens[..., level["tree"]], features, (start + d).expand_as(level["slots"] + start),
                              start + level["slots"], mask)
                child_logp, child_ids, features = *head.topk(target, h, self.topk), h
        shape = (*batch, self.total_tokens)
        return DraftTree(tokens, t["parents"].expand(shape), t["depths"].expand(shape),
                         t["ancestors"].expand(*shape, self.total_tokens), logp)
