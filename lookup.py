"""N-gram prompt lookup: drafts without a head or a draft forward, verified as a tree by the cycle's own verify and
commit. The drafts are what followed the context's last n tokens (n from max_ngram down to min_ngram) where those n
tokens occurred before, in the prompt or the reply; the most recent occurrences first, several of them the branches
of one tree, so one target forward checks them all. Where nothing matches, a plain step: a lookup that finds nothing
costs what plain decoding costs.

Exact, greedy or sampled: accept() draws the target's own pick at every node and accepts a child iff it is that pick.
A lookup's draft is deterministic (a one-hot draft distribution q): speculative sampling then accepts draft x with
probability min(1, p(x) / q(x)) = p(x), and on rejection draws from p with x removed; the pick does exactly that.

generate() runs it (lookup=NgramLookup(...)).
"""
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from decode import check_agreed, commit, read_back, verify
from draft_tree import DraftTree, take
from model import EagletError, Transformer
from sampling import read_scores, token_scores
import tp


@dataclass
class NgramLookup:
    """The tree kind of n-gram lookup: up to topk continuations of depth tokens, at most total_tokens nodes with the
    root. A tree of fewer real nodes is verified in the smallest of a few fixed sizes that holds it (powers of two),
    so a compiled verify has a handful of shapes, not one per tree."""
    depth: int = 8
    topk: int = 4
    total_tokens: int = 32
    max_ngram: int = 4
    min_ngram: int = 2

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.min_ngram < 1:
            raise EagletError(f"n-gram lookup: depth, tree_topk and ngram_min must be at least 1, got {self.depth}, "
                              f"{self.topk} and {self.min_ngram}")
        if self.min_ngram > self.max_ngram:
            raise EagletError(f"ngram_min ({self.min_ngram}) is larger than ngram_max ({self.max_ngram})")
        if self.total_tokens < 2:
            raise EagletError(f"total_tokens must be at least 2, got {self.total_tokens}")

    @property
    def levels(self) -> int:
        return self.depth + 2

    @property
    def scratch(self) -> int:
        return max(self.total_tokens, self.levels)

    def describe(self) -> str:
        return (f"n-gram lookup (suffixes of {self.max_ngram}..{self.min_ngram} tokens), up to {self.topk} "
                f"continuations of {self.depth} tokens, tree of at most {self.total_tokens} tokens")

    def run(self, *args) -> int:
        """run_lookup with this lookup: generate() calls it so, and decode.py need not import this file."""
        return run_lookup(args[0], self, *args[1:])

    def sizes(self) -> list:
        """The node counts a tree is verified in: powers of two from 4, and total_tokens."""
        return sorted({min(2 ** i, self.total_tokens) for i in range(2, self.total_tokens.bit_length() + 1)})


@dataclass
class NgramIndex:
    """Where every n-gram of the context (min_ngram <= n <= max_ngram) ended, kept as the context grows: the lookup
    reads the continuations of the context's own suffix without a scan."""
    config: NgramLookup
    context: list = field(default_factory=list)
    ends: dict = field(default_factory=dict)  # n-gram (a tuple) -> positions after it, oldest first

    def extend(self, tokens: list):
        for t in tokens:
            self.context.append(t)
            for n in range(self.config.min_ngram, min(self.config.max_ngram, len(self.context)) + 1):
                self.ends.setdefault(tuple(self.context[-n:]), []).append(len(self.context))

    def continuations(self) -> list:
        """Up to topk distinct continuations of depth tokens (or fewer, at the context's end) of the context's
        suffix: the longest suffix that occurred before first, its most recent occurrence first."""
        found, seen, size = [], set(), len(self.context)
        for n in range(min(self.config.max_ngram, size - 1), self.config.min_ngram - 1, -1):
            for end in reversed(self.ends.get(tuple(self.context[-n:]), [])):
                run = tuple(self.context[end:end + self.config.depth])
                if end < size and run not in seen:
                    seen.add(run)
                    found.append(run)
                    if len(found) == self.config.topk:
                        return found
        return found

    def nodes(self) -> tuple:
        """The continuations as one tree after the root (the context's last token), shared prefixes merged, at most
        total_tokens nodes: (tokens, parents, depths), parents before children; the root alone where nothing matched."""
        tokens, parents, depths, children = [self.context[-1]], [0], [0], {}
        for run in self.continuations():
            node = 0
            for t in run:
                if (node, t) not in children:
                    if len(tokens) == self.config.total_tokens:
                        break
                    children[node, t] = len(tokens)
                    tokens.append(t), parents.append(node), depths.append(depths[node] + 1)
                node = children[node, t]
        return tokens, parents, depths

    def tree(self, device) -> Optional[DraftTree]:
        """nodes() as a DraftTree in the smallest size that holds it (the rest padding); None: nothing matched."""
        nodes = self.nodes()
        if len(nodes[0]) == 1:
            return None
        return tree_of(*nodes, next(s for s in self.config.sizes() if s >= len(nodes[0])), device)


def tree_of(tokens: list, parents: list, depths: list, n: int, device) -> DraftTree:
    """A DraftTree of n nodes from host lists (parents before children), one copy to the device; past the lists,
    padding nodes (children of the root that are never accepted)."""
    real = len(tokens)
    tokens, parents, depths = tokens + [0] * (n - real), parents + [0] * (n - real), depths + [1] * (n - real)
    ancestors = torch.eye(n, dtype=torch.bool)
    for i in range(1, real):
        ancestors[i] |= ancestors[parents[i]]
    logp = torch.zeros(n)
    logp[real:] = float("-inf")
    packed = torch.cat([torch.tensor([tokens, parents, depths]).flatten(), ancestors.flatten().long(),
                        logp.view(torch.int32).long()]).to(device)
    tokens, parents, depths = packed[:3 * n].view(3, n)
    ancestors = packed[3 * n:3 * n + n * n].view(n, n).bool()
    logp = packed[3 * n + n * n:].int().view(torch.float32)
    return DraftTree(tokens, parents, depths, ancestors, logp)


def batch_tree(indexes: list, config: NgramLookup, device) -> DraftTree:
    """Each row's tree (a batch's: indexes, one a row), padded to the size that holds the largest, stacked [B, N]. A
    row where nothing matched verifies its root alone, riding along with the others in the same forward."""
    rows = [index.nodes() for index in indexes]
    n = next(s for s in config.sizes() if s >= max(len(r[0]) for r in rows))
    trees = [vars(tree_of(*r, n, "cpu")) for r in rows]
    return DraftTree(**{name: torch.stack([t[name] for t in trees]).to(device) for name in trees[0]})


def lookup_cycle(target: Transformer, tree: DraftTree, ctx_len: Tensor, sampling, levels: int):
    """A cycle without a draft: verify the lookup's tree, commit. Returns (emitted padded to levels, accepted
    drafts, the bonus token, the next ctx_len), then with sampling.logprobs >= 0 the emitted tokens' scores."""
    logits, _ = verify(target, tree, ctx_len)
    emitted, n_accepted, bonus, path = commit(target, tree, logits, ctx_len, sampling, levels)
    if target.tp_group is not None:
        n_accepted = tp.flag_disagreement(target.tp_group, n_accepted, tree.tokens, emitted)
    if sampling.logprobs >= 0:
        return emitted, n_accepted, bonus, ctx_len + n_accepted + 1, token_scores(take(logits, path), emitted,
                                                                                 sampling.logprobs)
    return emitted, n_accepted, bonus, ctx_len + n_accepted + 1


@torch.no_grad()
def warm_up_lookup(model: Transformer, lookup: NgramLookup, cycle_fn: Callable, sampling):
    """Compile (or capture) a compiled verify for each tree size it will meet (lookup.sizes()), so that none is
    compiled in a timed run. Writes cache slots from 0 on: call it before the first generation, never between turns."""
    device = model.output.weight.device
    for n in lookup.sizes():
        tree = tree_of(list(range(n)), [max(i - 1, 0) for i in range(n)], list(range(n)), n, device)
        cycle_fn(model, tree, torch.tensor(0, device=device), sampling.inputs(device), lookup.levels)


def run_lookup(model: Transformer, lookup: NgramLookup, sampling, cycle_fn: Optional[Callable], plain: Callable,
               state, prompt: list, tokens: list, emit: Callable, accept_lengths: list, scores, k: int) -> int:
    """Cycles where the lookup finds drafts, plain steps (plain: decode.plain_call) where it does not, each read back
    once, until emit() says done; returns the tokens plain steps gave. Not run ahead: the next tree is built from
    the tokens this call emits, read on the host."""
    index, plain_tokens = NgramIndex(lookup), 0
    index.extend(prompt + tokens)
    while True:
        ctx = len(prompt) + len(tokens) - 1
        tree = index.tree(state[0].device)
        if tree is None:
            pending, state = plain(state, ctx)
            out = pending.tolist()
            new, first = [check_agreed(int(out[0]))], 1
        else:
            out = (cycle_fn or lookup_cycle)(model, tree, state[1], sampling, lookup.levels)
            emitted, n_accepted, token, ctx_len = (t.clone() for t in out[:4])
            state = (token, ctx_len)
            out = read_back(torch.cat([n_accepted.view(1), emitted]), out[4] if len(out) > 4 else None).tolist()
            new, first = [int(t) for t in out[1:check_agreed(int(out[0])) + 2]], 1 + lookup.levels
        if scores is not None:
            scores += read_scores(out[first:], k)[:len(new)]
        n_before = len(tokens)
        done = emit(new)
        index.extend(tokens[n_before:])
        if tree is None:
            plain_tokens += len(tokens) - n_before
        else:
            accept_lengths.append(len(tokens) - n_before)
        if done:
            return plain_tokens
