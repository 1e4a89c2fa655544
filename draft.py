"""Draft heads (EAGLE-1/2, EAGLE-3, P-EAGLE, DFlash and DSpark): the building blocks the draft trees (draft_tree.py) are made from.

EAGLE-1/2: one LLaMA decoder layer without its input norm, fed fc(cat(embed(x_{t+1}), f_t)), where f_t is
the target's last hidden state (after its final norm). Its output h_t goes to the TARGET's lm_head and
doubles as the estimate of f_{t+1}. It shares the target's embedding and lm_head.

EAGLE-3: the target's hidden states entering three of its layers (or more), fused by fc (3 x dim -> dim); one layer
whose attention reads cat(norm(embed(x_{t+1})), norm(x)); its own norm and lm_head over a smaller draft
vocabulary, mapped to target ids by d2t. During tree expansion a node's input x is its parent's output.
Published EAGLE-3 heads come in EAGLE's and SpecForge's flat layout or in speculators' nested one (head_config),
some with flags that change the math (Eagle3Flags).

DFlash: a block [last token, mask x (B-1)] drafted in one forward of a few non-causal Qwen3 layers whose keys and
values also come from fc(the target's hidden states of several layers); B-1 draft distributions at once.

DSpark: DFlash's block with every row drafting, and a Markov head that adds to each row's logits a low-rank bias
from the token drafted before it (and a confidence head).

P-EAGLE: an EAGLE-3 head that drafts a block of positions in one pass, mask positions after the root's pair.

Every head is a DraftHead: the cycle calls its catch_up(), and the tree kind its step() and topk() (a block
drafter: block_states(), next_logits() and cut()), so the cycle has no branch per head kind.

Imports model.py (the layers it is built of), attention.py, quantize.py (an int8 lm_head's rows) and draft_tree.py;
the cycle in decode.py imports this file, and head_formats.py, which reads the published layouts into these classes.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from attention import attention_mask
from model import (Attention, EagletError, FeedForward, KVCache, ModelArgs, RMSNorm, RotaryTable, Transformer,
                   TransformerBlock)
from quantize import Int8Linear
from draft_tree import DraftTree, build_tree, head_name, take  # noqa: F401 (DraftTree, build_tree: their old import path)


class DraftHead(nn.Module):
    """What the speculative cycle asks of a head, whatever its kind:
    feature_layers: the target layers whose input the head reads (() = the target's final-normed hidden state);
    step(): its outputs for tokens paired with target features (catch-up) or with its own outputs (the tree);
    topk(): its k best next tokens, as log-probabilities and TARGET token ids;
    default_depth, default_topk: the tree its authors decode with."""
    default_depth = 6
    default_topk = 10

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.rope = None
        self.kv_cache: Optional[KVCache] = None  # set by setup_caches
        self.max_seq_length = 0
        self.feature_layers: tuple = ()
        self.register_buffer("draft_to_target", None, persistent=False)  # [draft vocab] target ids; None: all

    @property
    def vocab_size(self) -> int:
        """Candidates the head can propose."""
        return len(self.draft_to_target) if self.draft_to_target is not None else self.args.vocab_size

    def blocks(self) -> list:
        """The head's decoder layers (one for EAGLE heads), each with its part of the head's KV cache."""
        return [self.layer]

    def setup_rope(self, max_seq_length: int):
        """RoPE tables only: enough for training (cache_slots=None, a [T, T] mask)."""
        self.rope = RotaryTable(self.args.head_dim, self.args.rope_base, self.args.rope_scaling,
                                max_seq_length, self.blocks()[0].ffn_norm.weight.device)

    def setup_caches(self, max_seq_length: int, max_batch_size: int = 1):
        blocks = self.blocks()
        weight = blocks[0].ffn_norm.weight  # float in every format (fc may be int8): the activations' dtype
        self.max_seq_length = max_seq_length
        for block in blocks:
            block.attention.kv_cache = None
        self.kv_cache = KVCache(len(blocks), max_batch_size, max_seq_length, self.args.n_local_heads,
                                self.args.head_dim, weight.dtype).to(weight.device)
        for i, block in enumerate(blocks):
            block.attention.kv_cache = self.kv_cache.layer(i)
        self.setup_rope(max_seq_length)

    def catch_up(self, target: Transformer, tokens: Tensor, features: Tensor, ctx_len: Tensor,
                 n_accepted: Tensor) -> Tensor:
        """The head reads the committed pairs (f_t, x_{t+1}) at positions ctx_len.. (tokens [T] and the target's
        features [T, F], padded past n_accepted; or [B, T] and [B, T, F]); returns its output for the last real
        pair, the h_last the next expansion starts from."""
        pos = ctx_len[..., None] + torch.arange(tokens.shape[-1], device=ctx_len.device)
        causal = torch.ones(pos.shape[-1], pos.shape[-1], dtype=torch.bool, device=ctx_len.device).tril()
        # the mask built from ctx_len itself: split attention's flex mask_mod reads it, a graph input
        h = self.step(target, tokens, features, pos, pos, attention_mask(ctx_len, causal, self.max_seq_length))
        return take(h, n_accepted[..., None])[..., 0, :]

    def tree_grid(self) -> tuple:
        """--tree auto's trees (depth, top-k, total_tokens) for this head; (): the default grid."""
        return ()

    def topk(self, target: Transformer, h: Tensor, k: int):
        return self.topk_of_logits(self.logits(target, h), k)

    def topk_of_logits(self, logits: Tensor, k: int):
        # Top-k of the raw logits, log-probabilities from their log-sum-exp: log_softmax shifts each row by one
        # constant, so the same tokens win, without writing a float32 [rows, vocab] copy to pick them from.
        values, ids = logits.topk(k, dim=-1)
        logp = values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        return logp, ids if self.draft_to_target is None else self.draft_to_target[ids]


class EagleDraft(DraftHead):
    def __init__(self, args: ModelArgs, fc_bias: bool = True):
        super().__init__(args)
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=fc_bias)
        self.layer = TransformerBlock(args, input_norm=False)
        self.vocab_lm_head = None  # a Linear of some rows of the target's lm_head (a draft vocabulary)
        self.draft_vocab_source = "full"  # where the draft vocabulary came from, as reports name it

    def forward(self, embeds: Tensor, features: Tensor, input_pos: Tensor, cache_slots: Tensor, mask: Tensor):
        """embeds = target embedding of x_{t+1} [1, T, dim], features = f_t [1, T, dim] -> h_t [1, T, dim]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rope(input_pos, x.dtype)
        return self.layer(x, cos, sin, cache_slots, mask)

    def step(self, target: Transformer, tokens, inputs, input_pos, slots, mask) -> Tensor:
        """tokens [T] and inputs [T, dim] (one row), or [B, T] and [B, T, dim] (a batch) -> outputs like inputs."""
        if tokens.ndim == 1:
            return self.step(target, tokens[None], inputs[None], input_pos, slots, mask)[0]
        return self(target.tok_embeddings(tokens), inputs, input_pos, slots, mask)

    def logits(self, target: Transformer, h: Tensor) -> Tensor:
        return target.logits(h, self.vocab_lm_head)

    def lm_head_module(self, target: Transformer) -> nn.Module:
        return target.output if self.vocab_lm_head is None else self.vocab_lm_head

    def restrict_vocab(self, target: Transformer, token_ids: Tensor, source: str = "given ids"):
        """Score only these target tokens (FR-Spec): the lm_head read per draft pass shrinks with them.
        Its rows stay in the lm_head's format (an int8 lm_head gives int8 rows)."""
        token_ids = token_ids.to(target.tok_embeddings.weight.device)
        self.vocab_lm_head = linear_rows(target.output, token_ids)  # first: it refuses an lm_head it cannot cut
        self.draft_to_target, self.draft_vocab_source = token_ids, source


@dataclass(frozen=True)
class Eagle3Flags:
    """What later EAGLE-3 heads change (all off: the first heads, EAGLE's own).
    norm_before_residual: the residual around the attention is hidden_norm(x), not x (speculators, vLLM);
    fc_norm: each of the three target features RMS-normed on its own before fc (EAGLE-3.1; fc_norm.i.weight);
    norm_before_fc: the three features normed as one vector before fc (gpt-oss heads; input_norm.weight);
    norm_output: the layer's output goes through the final norm before it is scored AND fed to the next
    step (EAGLE-3.1); without it only the scores read the normed output."""
    norm_before_residual: bool = False
    norm_output: bool = False
    fc_norm: bool = False
    norm_before_fc: bool = False


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads cat(embed_norm(embedding), hidden_norm(x)), 2 x dim wide."""

    def __init__(self, args: ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.embed_norm = RMSNorm(args.dim, args.norm_eps)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, in_dim=2 * args.dim)
        self.feed_forward = FeedForward(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, embeds, x, cos, sin, cache_slots, mask):
        attn_in = torch.cat([self.embed_norm(embeds), self.hidden_norm(x)], dim=-1)
        if self.norm_before_residual:
            x = self.hidden_norm(x)
        h = x + self.attention(attn_in, cos, sin, cache_slots, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Eagle3Draft(DraftHead):
    default_depth = 7

    def __init__(self, args: ModelArgs, target_dim: int, draft_vocab_size: int, own_embedding: bool,
                 flags: Eagle3Flags = Eagle3Flags(), n_features: int = 3, n_layers: int = 1):
        """n_features: the target layers it reads (EAGLE's three; speculators' heads may read more); n_layers:
        its layers, the EAGLE-3 layer and then plain decoder layers (speculators' heads may have several)."""
        super().__init__(args)
        self.flags = flags
        self.fc = nn.Linear(n_features * target_dim, args.dim, bias=False)
        self.fc_norm = nn.ModuleList(RMSNorm(target_dim, args.norm_eps) for _ in range(n_features)) \
            if flags.fc_norm else None
        self.input_norm = RMSNorm(n_features * target_dim, args.norm_eps) if flags.norm_before_fc else None
        self.layer = Eagle3Layer(args, flags.norm_before_residual)
        self.decoder_layers = nn.ModuleList(TransformerBlock(args) for _ in range(n_layers - 1))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, draft_vocab_size, bias=False)
        self.embed = nn.Embedding(args.vocab_size, args.dim) if own_embedding else None

    def blocks(self) -> list:
        return [self.layer, *self.decoder_layers]

    def step(self, target: Transformer, tokens, inputs, input_pos, slots, mask) -> Tensor:
        """inputs: target features (3 x target dim, fused by fc) or the head's own earlier outputs (used as is);
        tokens [T] (one row) or [B, T] (a batch)."""
        if tokens.ndim == 1:
            return self.step(target, tokens[None], inputs[None], input_pos, slots, mask)[0]
        embeds = (self.embed or target.tok_embeddings)(tokens)
        x = inputs if inputs.shape[-1] == self.args.dim else self.fuse(inputs)
        cos, sin = self.rope(input_pos, x.dtype)
        h = self.layer(embeds, x, cos, sin, slots, mask)
        for block in self.decoder_layers:
            h = block(h, cos, sin, slots, mask)
        return self.norm(h) if self.flags.norm_output else h

    def fuse(self, features: Tensor) -> Tensor:
        """fc over the target's features [..., n x target dim], after the norms the head's flags ask for."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            features = torch.cat([norm(f) for norm, f in zip(self.fc_norm, features.chunk(len(self.fc_norm), dim=-1))],
                                 dim=-1)
        return self.fc(features)

    def logits(self, target: Transformer, h: Tensor) -> Tensor:
        return self.lm_head(h if self.flags.norm_output else self.norm(h))  # norm_output: step() normed it

    def lm_head_module(self, target: Transformer) -> nn.Module:
        return self.lm_head


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
        h = self.step(target, tokens, inputs, pos, pos, attention_mask(ctx_len, causal, self.max_seq_length))
        return torch.cat([h_last[..., None, :], h], dim=-2)

    def next_logits(self, row_logits: Tensor, prev: Tensor) -> Tensor:
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

    def setup_caches(self, max_seq_length: int, max_batch_size: int = 1):
        window = self.args.sliding_window
        if window and max_seq_length > window:
            raise EagletError(f"{max_seq_length} tokens exceed the {head_name(self)} head's sliding window ({window}); "
                              "eaglet runs its layers with full attention, which is exact only within the window")
        super().setup_caches(max_seq_length, max_batch_size)

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
        """The block [root, mask...] at positions ctx_len.. (root the anchor, at its own position), long enough for
        levels drafts -> the final-normed outputs of its draft rows [..., levels, dim] (root and ctx_len 0-d, or
        [B] for a batch). h_last is not read: the block has its own anchor row."""
        n = self.first_row + levels
        masks = torch.full((*root.shape, n - 1), self.mask_token_id, dtype=root.dtype, device=root.device)
        tokens = torch.cat([root[..., None], masks], dim=-1)
        pos = ctx_len[..., None] + torch.arange(n, device=ctx_len.device)
        x = target.tok_embeddings(tokens.view(-1, n))
        cos, sin = self.rope(pos, x.dtype)
        every = torch.ones(n, n, dtype=torch.bool, device=root.device)  # not causal: the whole block sees itself
        mask = attention_mask(ctx_len, every, self.max_seq_length)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return self.norm(x[:, self.first_row:]).view(*root.shape, levels, -1)

    def next_logits(self, row_logits: Tensor, prev: Tensor) -> Tensor:
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

    def next_logits(self, row_logits: Tensor, prev: Tensor) -> Tensor:
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


def linear_rows(linear: nn.Module, ids: Tensor) -> nn.Module:
    if isinstance(linear, Int8Linear):
        return linear.rows(ids)
    if not isinstance(linear, nn.Linear):
        raise EagletError(f"a draft vocabulary takes rows of a bf16 or int8 lm_head, not of a {type(linear).__name__}")
    rows = nn.Linear(linear.in_features, len(ids), bias=False, device="meta")
    rows.weight = nn.Parameter(linear.weight[ids], requires_grad=False)
    return rows
