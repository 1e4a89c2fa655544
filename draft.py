"""Draft heads (EAGLE-1/2, EAGLE-3) and DraftHead, what every head gives the cycle: the building blocks the draft trees
(draft_tree.py) are made from. The block drafters (P-EAGLE, DFlash, DSpark, DFlash2, XPress) are in block_draft.py.

EAGLE-1/2: one LLaMA decoder layer without its input norm, fed fc(cat(embed(x_{t+1}), f_t)), where f_t is
the target's last hidden state (after its final norm). Its output h_t goes to the TARGET's lm_head and
doubles as the estimate of f_{t+1}. It shares the target's embedding and lm_head.

EAGLE-3: the target's hidden states entering three of its layers (or more), fused by fc (3 x dim -> dim); one layer
whose attention reads cat(norm(embed(x_{t+1})), norm(x)); its own norm and lm_head over a smaller draft
vocabulary, mapped to target ids by d2t. During tree expansion a node's input x is its parent's output.
Published EAGLE-3 heads come in EAGLE's and SpecForge's flat layout or in speculators' nested one (head_config),
some with flags that change the math (Eagle3Flags).

Every head is a DraftHead: the cycle calls its catch_up(), and the tree kind its step() and topk() (a block
drafter: draft_rows(), next_logits() and cut()), so the cycle has no branch per head kind.

Imports model.py (the layers it is built of), attention.py, quantize.py (an int8 lm_head's rows) and draft_tree.py;
the cycle in decode.py imports this file, block_draft.py builds on it, and head_formats.py reads the published
layouts into these classes.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from attention import WindowMask, attention_mask
from model import (Attention, EagletError, FeedForward, KVCache, ModelArgs, RMSNorm, RotaryTable, Transformer,
                   TransformerBlock)
from quantize import Int8Linear
from draft_tree import DraftTree, build_tree, head_name, take  # noqa: F401 (DraftTree, build_tree: their old import path)


DRAFT_SINKS = 4  # with a draft window, the first positions a head always sees (attention sinks, as StreamingLLM keeps)
# The window of a head whose config names none (--draft_window auto): the whole context up to 2k, where heads are
# mostly trained; past it, a flat cost. SmolLM2's head kept its tau at 7k of context with 256 and with 2048.
DRAFT_WINDOW = 2048


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
        self.window: Optional[tuple] = None  # (sinks, window): the context it attends to (set_window); None: all

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

    def set_window(self, window: Optional[int], sinks: int = DRAFT_SINKS):
        """Attend to the first sinks positions and the last window positions of the context only (None: all of it),
        so the head's cost per call stays flat as the context grows. Only the drafts change: the target verifies."""
        for name, value in (("draft window", window), ("draft sinks", sinks)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < (name == "draft window")):
                raise EagletError(f"the {name} must be a {'positive' if name == 'draft window' else 'non-negative'} whole "
                                  f"number of positions, got {value!r}")
        if window is not None and self.max_seq_length and sinks + window > self.max_seq_length:
            raise EagletError(f"the draft window ({window} positions, and {sinks} sinks) is larger than the cache "
                              f"({self.max_seq_length} tokens)")
        self.window = None if window is None else (sinks, window)

    def context_mask(self, ctx_len: Tensor, block: Tensor):
        """The mask of a call of the head's over its cache: tokens at slots ctx_len.. see the context (or its window)
        and what block [T, W] allows of their own slots (attention.attention_mask)."""
        if not self.windowed:
            return attention_mask(ctx_len, block, self.max_seq_length)
        return WindowMask(ctx_len, block, *self.window, self.max_seq_length)

    @property
    def windowed(self) -> bool:
        """Whether a window leaves part of the cache unseen (a window as long as the cache holds all of it)."""
        return self.window is not None and sum(self.window) < self.max_seq_length

    def catch_up(self, target: Transformer, tokens: Tensor, features: Tensor, ctx_len: Tensor,
                 n_accepted: Tensor) -> Tensor:
        """The head reads the committed pairs (f_t, x_{t+1}) at positions ctx_len.. (tokens [T] and the target's
        features [T, F], padded past n_accepted; or [B, T] and [B, T, F]); returns its output for the last real
        pair, the h_last the next expansion starts from."""
        pos = ctx_len[..., None] + torch.arange(tokens.shape[-1], device=ctx_len.device)
        causal = torch.ones(pos.shape[-1], pos.shape[-1], dtype=torch.bool, device=ctx_len.device).tril()
        # the mask built from ctx_len itself: split attention's flex mask_mod reads it, a graph input
        h = self.step(target, tokens, features, pos, pos, self.context_mask(ctx_len, causal))
        return take(h, n_accepted[..., None])[..., 0, :]

    def catch_up_first(self, target: Transformer, tokens: Tensor):
        """The context's first tokens ([1], or [B] for a batch) before a prefill from position 0: a head's first pair
        starts there, so nothing to read (a draft model, which reads tokens, overrides this)."""

    def tree_grid(self) -> tuple:
        """--tree auto's trees (depth, top-k, total_tokens) for this head; (): the default grid."""
        return ()

    def draft_rows(self, target: Transformer, root: Tensor, ctx_len: Tensor, levels: int, h_last: Tensor):
        """A block drafter's levels draft rows from one pass: their states [..., levels, dim] and logits
        [..., levels, vocab] (the lm_head read once); block_states() and logits() unless a head refines them."""
        states = self.block_states(target, root, ctx_len, levels, h_last)
        return states, self.logits(target, states)

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


def linear_rows(linear: nn.Module, ids: Tensor) -> nn.Module:
    if isinstance(linear, Int8Linear):
        return linear.rows(ids)
    if not isinstance(linear, nn.Linear):
        raise EagletError(f"a draft vocabulary takes rows of a bf16 or int8 lm_head, not of a {type(linear).__name__}")
    rows = nn.Linear(linear.in_features, len(ids), bias=False, device="meta")
    rows.weight = nn.Parameter(linear.weight[ids], requires_grad=False)
    return rows
