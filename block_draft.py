"""Block drafters: heads that draft a block of positions in ONE forward (P-EAGLE, DFlash, DSpark, DFlash2, XPress).

P-EAGLE: an EAGLE-3 head that drafts a block of positions in one pass, mask positions after the root's pair.

DFlash: a block [last token, mask x (B-1)] drafted in one forward of a few non-causal Qwen3 layers whose keys and
values also come from fc(the target's hidden states of several layers); B-1 draft distributions at once.

DSpark: DFlash's block with every row drafting, and a Markov head that adds to each row's logits a low-rank bias
from the token drafted before it (and a confidence head).

DFlash2: DFlash's block with a token-conditioned causal convolution inside the block around each sublayer, and a
candidate selector that rescores each row's top-k drafts by the token drafted before it.

XPress: DFlash's block and a low-rank causal refiner that adds to each row's logits a bias from the tokens drafted
before it, resolved by a fixed number of parallel (Jacobi) passes over the whole block.

Each gives the lattice in draft_tree.py its rows: draft_rows() (the block's draft rows from one pass, and their
logits), next_logits() (a row's logits after a given token) and cut() (drafts to leave unverified).

Imports draft.py (DraftHead, Eagle3Draft) and model.py; head_formats.py builds these from the
published layouts, and the cycle reaches them only through DraftHead's methods.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from draft import DraftHead, Eagle3Draft, Eagle3Flags
from draft_tree import head_name, take
from model import EagletError, ModelArgs, RMSNorm, Transformer, TransformerBlock


class PEagleDraft(Eagle3Draft):
    """P-EAGLE: an EAGLE-3 head trained to draft a block of positions in one pass. Its catch-up is EAGLE-3's (the
    committed pairs' K/V; h_last, the root pair's output, drafts the token after the root); the block is the
    mask positions after the root pair, each reading the head's embedding of mask_token_id and fc(mask_hidden) in
    place of a token and the target's features, and attending to the context (the root pair included) and to the
    mask positions before it: mask position d drafts the token d + 1 after the root. A block drafter, so the
    lattice grows the chain or the tree from its rows; a row's logits do not depend on the token before it."""

    default_topk = 1  # a chain of the block, as vLLM runs it
    first_row = 0  # the root pair's own output drafts the first token

    def __init__(self, args: ModelArgs, target_dim: int, draft_vocab_size: int, own_embedding: bool,
                 flags: Eagle3Flags, n_features: int, block_size: int, mask_token_id: int, n_layers: int = 1):
        super().__init__(args, target_dim, draft_vocab_size, own_embedding, flags, n_features, n_layers)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, n_features * target_dim))
        self.block_size, self.mask_token_id = block_size, mask_token_id

    @property
    def max_levels(self) -> int:
        return self.block_size

    @property
    def default_depth(self) -> int:
        return self.block_size - 1

    def block_states(self, target: Transformer, root: Tensor, ctx_len: Tensor, levels: int,
                     h_last: Optional[Tensor] = None) -> Tensor:
        """The rows of levels drafts [..., levels, dim]: h_last, then the levels - 1 mask positions at ctx_len..,
        their K/V in scratch slots after the context (the next catch-up overwrites them)."""
        n = levels - 1
        if n == 0:
            return h_last[..., None, :]
        tokens = torch.full((*root.shape, n), self.mask_token_id, dtype=root.dtype, device=root.device)
        pos = ctx_len[..., None] + torch.arange(n, device=ctx_len.device)
        inputs = self.fuse(self.mask_hidden[0]).expand(*tokens.shape, -1)
        causal = torch.ones(n, n, dtype=torch.bool, device=root.device).tril()
        h = self.step(target, tokens, inputs, pos, pos, self.context_mask(ctx_len, causal))
        return torch.cat([h_last[..., None, :], h], dim=-2)

    def next_logits(self, row_logits: Tensor, prev: Tensor, row_state: Tensor) -> Tensor:
        return row_logits

    def cut(self, row_state: Tensor, prev: Tensor):
        return None

    def tree_grid(self) -> tuple:
        return DFlashDraft.tree_grid(self)


class DFlashDraft(DraftHead):
    """DFlash: a block [root, mask x (block - 1)] drafted in ONE forward of a few Qwen3 layers. The context is
    fc(the target's features of several layers) -> hidden_norm; each layer projects it to keys and values
    (k_norm, RoPE at the context's own positions) that catch_up writes to the head's cache once, with no attention.
    The block's queries see all that context and the WHOLE block (not causal); the final norm and an lm_head turn
    the block's draft rows into one draft distribution each: rows 1.. (DFlash's convention), or every row, the
    root's included (anchor_drafts: speculators' sample_from_anchor, DSpark's convention), row k drafting the token
    k + 1 after the root either way. The lm_head is the TARGET's, or the head's own over a smaller draft vocabulary
    (speculators' heads: lm_head and d2t). The block's own K/V go to scratch slots after the context and are
    overwritten by the next catch-up."""

    default_topk = 1  # the chain, as DFlash's authors decode

    def __init__(self, args: ModelArgs, n_features: int, block_size: int, mask_token_id: int,
                 anchor_drafts: bool = False, draft_vocab_size: int = 0):
        super().__init__(args)
        self.fc = nn.Linear(n_features * args.dim, args.dim, bias=False)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, draft_vocab_size, bias=False) if draft_vocab_size else None
        self.block_size, self.mask_token_id, self.anchor_drafts = block_size, mask_token_id, anchor_drafts
        if args.sliding_window:  # trained attending to a window of the context: drafted with that window
            self.set_window(args.sliding_window, sinks=0)

    @property
    def first_row(self) -> int:
        """The block row that drafts the token after the root."""
        return 0 if self.anchor_drafts else 1

    @property
    def max_levels(self) -> int:
        """Drafts one block of block_size gives: the levels of a tree below its root."""
        return self.block_size - self.first_row

    @property
    def default_depth(self) -> int:
        """A tree's depth + 1 levels below the root: the whole block's drafts."""
        return self.max_levels - 1

    def blocks(self) -> list:
        return list(self.layers)

    def catch_up(self, target: Transformer, tokens: Tensor, features: Tensor, ctx_len: Tensor,
                 n_accepted: Tensor) -> Tensor:
        """Context K/V of the committed positions ctx_len.. from the target's features [T, F] (or [B, T, F]) in
        every layer. The padding past n_accepted is written too: no mask shows it, the next catch-up overwrites it.
        Returns the last committed position's context vector (the cycle's h_last, which the block does not read)."""
        pos = ctx_len[..., None] + torch.arange(features.shape[-2], device=ctx_len.device)
        context = self.hidden_norm(self.fc(features))
        x = context if context.ndim == 3 else context[None]
        cos, sin = self.rope(pos, x.dtype)
        for layer in self.layers:
            _, k, v = layer.attention.project(x, cos, sin)
            layer.attention.kv_cache.update(pos, k, v)
        return take(context, n_accepted[..., None])[..., 0, :]

    def block_states(self, target: Transformer, root: Tensor, ctx_len: Tensor, levels: int,
                     h_last: Optional[Tensor] = None) -> Tensor:
        """The final-normed outputs of a block's draft rows [..., levels, dim] (root and ctx_len 0-d, or [B] for a
        batch). h_last is not read: the block has its own anchor row."""
        return self.block_rows(target, root, ctx_len, self.first_row + levels)[..., self.first_row:, :]

    def block_rows(self, target: Transformer, root: Tensor, ctx_len: Tensor, n: int) -> Tensor:
        """The block [root, mask x (n - 1)] at positions ctx_len.. (root the anchor, at its own position) -> the
        final-normed outputs of all its rows [..., n, dim]."""
        masks = torch.full((*root.shape, n - 1), self.mask_token_id, dtype=root.dtype, device=root.device)
        tokens = torch.cat([root[..., None], masks], dim=-1)
        pos = ctx_len[..., None] + torch.arange(n, device=ctx_len.device)
        x = target.tok_embeddings(tokens.view(-1, n))
        cos, sin = self.rope(pos, x.dtype)
        every = torch.ones(n, n, dtype=torch.bool, device=root.device)  # not causal: the whole block sees itself
        mask = self.context_mask(ctx_len, every)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return self.norm(x).view(*root.shape, n, -1)

    def next_logits(self, row_logits: Tensor, prev: Tensor, row_state: Tensor) -> Tensor:
        """A row's draft logits given the token before it (prev [..., m], target ids): a DFlash row ignores it,
        the same logits [..., 1, vocab] for every m."""
        return row_logits

    def cut(self, row_state: Tensor, prev: Tensor):
        """Which drafts after prev to leave unverified (a confidence threshold); None: none."""
        return None

    def tree_grid(self) -> tuple:
        """Chains of the whole block and of half of it, and trees of the block's depth (at most as wide as
        their nodes allow)."""
        depth = self.default_depth
        half = max(1, depth // 2)
        points = [(depth, 1, depth + 2), (half, 1, half + 2)] + [(depth, k, n) for k, n in ((3, 16), (4, 32), (10, 60))]
        return tuple(dict.fromkeys((d, k, min(n, 1 + k + d * k * k)) for d, k, n in points))

    def logits(self, target: Transformer, h: Tensor) -> Tensor:
        return target.logits(h, self.lm_head)

    def lm_head_module(self, target: Transformer) -> nn.Module:
        return target.output if self.lm_head is None else self.lm_head


class DSparkDraft(DFlashDraft):
    """DSpark: DFlash's block (by default every row drafting, the root's too) and a Markov head that makes each
    draft depend on the token before it: logits_k = base_k + markov_w2(markov_w1[prev_k]), base_k the block row's
    own logits, prev_k the token drafted before it (the root for the first). markov_w1 is a rank-r embedding of
    the target's vocabulary, markov_w2 a Linear r -> draft vocabulary. In a chain prev_k is the pick at k - 1;
    in a tree each node's own token, so every branch is scored as the head would score it alone. The confidence
    head, sigmoid(proj([h_k ; markov_w1[prev_k]])) (or [h_k] alone), estimates the chance draft k is accepted
    given the drafts before it were; with confidence > 0, drafts below it (and all after them) go unverified."""

    def __init__(self, args: ModelArgs, n_features: int, block_size: int, mask_token_id: int, markov_rank: int,
                 anchor_drafts: bool = True, draft_vocab_size: int = 0, confidence_head: bool = True,
                 confidence_with_markov: bool = True):
        super().__init__(args, n_features, block_size, mask_token_id, anchor_drafts, draft_vocab_size)
        self.markov_head = nn.ModuleDict({
            "markov_w1": nn.Embedding(args.vocab_size, markov_rank),
            "markov_w2": nn.Linear(markov_rank, draft_vocab_size or args.vocab_size, bias=False)})
        features = args.dim + (markov_rank if confidence_with_markov else 0)
        self.confidence_head = nn.ModuleDict({"proj": nn.Linear(features, 1)}) if confidence_head else None
        self.confidence_with_markov = confidence_with_markov
        self.confidence = 0.0  # the threshold (generate.py --confidence); 0: verify every draft

    def next_logits(self, row_logits: Tensor, prev: Tensor, row_state: Tensor) -> Tensor:
        """row_logits [..., 1, vocab] plus the Markov bias of each prev [..., m] -> [..., m, vocab]."""
        return row_logits + self.markov_head.markov_w2(self.markov_head.markov_w1(prev))

    def confidence_of(self, row_state: Tensor, prev: Tensor) -> Tensor:
        """The chance the row's draft after each prev [..., m] is accepted, given the drafts before it were."""
        h = row_state.expand(*prev.shape, row_state.shape[-1])
        features = torch.cat([h, self.markov_head.markov_w1(prev)], dim=-1) if self.confidence_with_markov else h
        return torch.sigmoid(self.confidence_head.proj(features).float())[..., 0]

    def cut(self, row_state: Tensor, prev: Tensor):
        """The drafts after each prev [..., m] whose confidence is below the threshold (bool [..., m]); None when
        the threshold is 0."""
        return self.confidence_of(row_state, prev) < self.confidence if self.confidence else None


class BlockConv(nn.Module):
    """DFlash2's convolution around a sublayer: each channel of a block row mixes in the rows kernel_size - 1 back
    (within the block only), with per-row weights base_kernel + a delta that kernel_projection makes from the
    sublayer's normed input, one delta per group of group_size channels. Index 0: the input side, 1: the output."""

    def __init__(self, dim: int, kernel_size: int, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, dim))
        self.kernel_projection = nn.Linear(dim, 2 * kernel_size * (dim // group_size), bias=False)

    def deltas(self, x: Tensor) -> Tensor:
        """[..., n, dim] -> the per-row kernel deltas [..., n, 2, kernel_size, groups] (input side, output side)."""
        return self.kernel_projection(x).unflatten(-1, (2, self.base_kernel.shape[1], -1))

    def forward(self, x: Tensor, deltas: Tensor, side: int) -> Tensor:
        n, out = x.shape[-2], 0
        for tap in range(self.base_kernel.shape[1]):
            back = F.pad(x, (0, 0, tap, 0))[..., :n, :]  # row t sees row t - tap, zeros before the block
            weight = self.base_kernel[side, tap] + deltas[..., side, tap, :].repeat_interleave(self.group_size, -1)
            out = out + back * weight
        return out


class DFlash2Layer(TransformerBlock):
    """A DFlash layer whose attention and MLP each read the block through BlockConv's input side and write through
    its output side (kernels from the sublayer's normed input). The context K/V (catch-up) are DFlash's."""

    def __init__(self, args: ModelArgs, kernel_size: int, group_size: int):
        super().__init__(args)
        self.attention_conv = BlockConv(args.dim, kernel_size, group_size)
        self.mlp_conv = BlockConv(args.dim, kernel_size, group_size)

    def forward(self, x, cos, sin, cache_slots, mask):
        h = self.attention_norm(x)
        deltas = self.attention_conv.deltas(h)
        attended = self.attention(self.attention_conv(h, deltas, 0), cos, sin, cache_slots, mask)
        x = x + self.attention_conv(attended, deltas, 1)
        h = self.ffn_norm(x)
        deltas = self.mlp_conv.deltas(h)
        return x + self.mlp_conv(self.feed_forward(self.mlp_conv(h, deltas, 0)), deltas, 1)


class CandidateSelector(nn.Module):
    """DFlash2's rescoring of a row's top_k drafts c after the token p before them: the row's logit of c plus
    sum_r predecessor_codebook[p, r] * hidden_projection(h)[r] * successor_codebook[c, r], h the row's state."""

    def __init__(self, vocab_size: int, dim: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(dim, rank, bias=False)

    def forward(self, row_logits: Tensor, prev: Tensor, row_state: Tensor) -> Tensor:
        candidates = row_logits.topk(self.top_k, dim=-1).indices  # [..., rows, top_k]
        scores = self.score(row_logits, prev, row_state, candidates)
        out = row_logits.new_full((*scores.shape[:-1], row_logits.shape[-1]), float("-inf"))
        return out.scatter(-1, candidates.expand_as(scores), scores)

    def score(self, row_logits: Tensor, prev: Tensor, row_state: Tensor, candidates: Tensor) -> Tensor:
        """The candidates' scores after each prev [..., m] -> [..., m, top_k] (a row of logits, states and
        candidates for all m, or one each)."""
        context = self.predecessor_codebook[prev] * self.hidden_projection(row_state)  # [..., m, rank]
        transition = (context[..., None, :] * self.successor_codebook[candidates]).sum(-1)  # [..., m, top_k]
        return row_logits.gather(-1, candidates) + transition.to(row_logits.dtype)


class DFlash2Draft(DFlashDraft):
    """DFlash2: DFlash's block through DFlash2Layers, then the candidate selector: a row's drafts are its top_k
    tokens rescored after the token drafted before it (the root for the first), every other token at -inf. In a
    chain that token is the pick before; in a tree each node's own, as DSpark's Markov walk. Full vocabulary only
    (the selector's codebooks are the target's; speculators refuses a smaller draft vocabulary too)."""

    def __init__(self, args: ModelArgs, n_features: int, block_size: int, mask_token_id: int, kernel_size: int,
                 group_size: int, selector_rank: int, selector_top_k: int, anchor_drafts: bool = False):
        super().__init__(args, n_features, block_size, mask_token_id, anchor_drafts)
        self.layers = nn.ModuleList(DFlash2Layer(args, kernel_size, group_size) for _ in range(args.n_layer))
        self.candidate_selector = CandidateSelector(args.vocab_size, args.dim, selector_rank, selector_top_k)

    def next_logits(self, row_logits: Tensor, prev: Tensor, row_state: Tensor) -> Tensor:
        """The row's top_k drafts rescored after each prev [..., m] -> [..., m, vocab] (-inf outside them)."""
        return self.candidate_selector(row_logits, prev, row_state)


class XPressRefiner(nn.Module):
    """XPress's refiner: a logit bias for every block row from the token before it and the rows' states, in a
    low-rank space: x_k = in_proj([down_h(h_k) ; down_g(mean of the block's h) ; token_embed(prev_k)]), mixed
    causally across the block (x_k += sum_{j <= k} mix_l[:, k, j] * x_j, per channel), a SwiGLU MLP with a
    residual, then readout to the draft vocabulary."""

    def __init__(self, vocab_size: int, dim: int, block_size: int, rank: int, mlp_ratio: int, draft_vocab: int):
        super().__init__()
        self.token_embed = nn.Embedding(vocab_size, rank)
        self.down_h = nn.Linear(dim, rank, bias=False)
        self.down_g = nn.Linear(dim, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(rank, block_size, block_size))
        self.mlp_gate = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(rank * mlp_ratio, rank, bias=False)
        self.readout = nn.Linear(rank, draft_vocab, bias=False)

    def states(self, h: Tensor) -> Tensor:
        """What every pass reuses: [down_h(h) ; down_g(the block's mean h)] [..., n, 2 rank]."""
        return torch.cat([self.down_h(h), self.down_g(h.mean(-2, keepdim=True)).expand(*h.shape[:-1], -1)], -1)

    def forward(self, prev: Tensor, states: Tensor) -> Tensor:
        x = self.in_proj(torch.cat([states, self.token_embed(prev).to(states.dtype)], -1))  # [..., n, rank]
        n = x.shape[-2]
        mix = self.mix_l[:, :n, :n] * torch.ones(n, n, device=x.device, dtype=x.dtype).tril()
        x = x + torch.einsum("ckj,...jc->...kc", mix, x)
        x = x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))
        return self.readout(x)


class XPressDraft(DFlashDraft):
    """XPress: DFlash's block, and its rows' logits refined by XPressRefiner given the token before each row:
    the root for the first draft row, the previous pass's picks after it; with DFlash's layout (anchor_drafts
    off) the anchor row's own 'token before' is the committed token before the root. jacobi_passes passes, the
    first after the block's own picks; the last pass's logits are the drafts' distributions, the same for every
    parent in a tree (a DFlash row's, refined along the block's own best path).

    The token before the root is read from tokens_at, every token the head has caught up on, by position (the
    block needs it and the cycle hands a head the emitted tokens only). The first token the head reads is never
    one: after a one-token prompt the first block reads token 0 there (exact still; that block drafts worse)."""

    def __init__(self, args: ModelArgs, n_features: int, block_size: int, mask_token_id: int, rank: int,
                 mlp_ratio: int, jacobi_passes: int, anchor_drafts: bool = False, draft_vocab_size: int = 0):
        super().__init__(args, n_features, block_size, mask_token_id, anchor_drafts, draft_vocab_size)
        self.refiner_head = XPressRefiner(args.vocab_size, args.dim, block_size, rank, mlp_ratio,
                                          draft_vocab_size or args.vocab_size)
        self.jacobi_passes = jacobi_passes
        self.register_buffer("tokens_at", None, persistent=False)

    def setup_caches(self, max_seq_length: int, max_batch_size: int = 1):
        super().setup_caches(max_seq_length, max_batch_size)
        self.tokens_at = torch.zeros(max_batch_size, max_seq_length + 1, dtype=torch.long,
                                     device=self.norm.weight.device)

    def catch_up(self, target: Transformer, tokens: Tensor, features: Tensor, ctx_len: Tensor,
                 n_accepted: Tensor) -> Tensor:
        pos = ctx_len[..., None] + 1 + torch.arange(tokens.shape[-1], device=ctx_len.device)  # pair j's token
        rows = torch.arange(pos.shape[0], device=pos.device)[:, None] if pos.ndim == 2 else 0
        self.tokens_at[rows, pos] = tokens
        return super().catch_up(target, tokens, features, ctx_len, n_accepted)

    def draft_rows(self, target: Transformer, root: Tensor, ctx_len: Tensor, levels: int, h_last: Tensor):
        h = self.block_rows(target, root, ctx_len, self.first_row + levels)
        before = (ctx_len - 1).view(-1, 1)  # the position of the token before each root (a gather: no host read)
        before_root = self.tokens_at[:before.shape[0]].gather(1, before).view(root.shape)
        logits = self.refine(self.logits(target, h), h, root, before_root)
        return h[..., self.first_row:, :], logits[..., self.first_row:, :]

    def refine(self, base: Tensor, h: Tensor, root: Tensor, before_root: Tensor) -> Tensor:
        """The block's logits [..., n, draft vocab] after jacobi_passes passes of the refiner."""
        states, logits = self.refiner_head.states(h), base
        for _ in range(self.jacobi_passes):
            picks = self.to_target(logits.argmax(-1))  # [..., n]: each row's pick, in target ids
            first = root[..., None] if self.anchor_drafts else torch.stack([before_root, root], -1)
            prev = torch.cat([first, picks[..., first.shape[-1] - 1:base.shape[-2] - 1]], -1)  # row k: k - 1's pick
            logits = base + self.refiner_head(prev, states)
        return logits

    def to_target(self, ids: Tensor) -> Tensor:
        return ids if self.draft_to_target is None else self.draft_to_target[ids]

