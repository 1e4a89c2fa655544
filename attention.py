"""Attention over the static KV cache, and the masks that say which cache slots each new token sees.

model.Attention calls attend(); everything else here builds its mask argument. Three paths, one meaning:
a boolean mask [T, L] (masked SDPA over the first L slots: eager code passes L = what is filled), a flex
BlockMask (compiled CUDA decoding: only the 128-slot blocks holding visible slots are read), or a SplitMask
(EAGLET_SPLIT=1: a call of several tokens attends to the context and to its own slots separately, merged by
their log-sum-exps). attention_mask is the one mask builder the cycle uses. Imports torch only.
"""
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:  # torch >= 2.9 asks for flex_attention's log-sum-exp so (return_lse before)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None


# --exact (Transformer.set_exact): every attention in float64 (exact_attention), never flex or split.
EXACT = False


def attend(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """Attention of q [B, H, T, D] over the cache k, v [B, H_kv, S, D] as the mask allows.

    mask is a BlockMask (compiled CUDA decoding, see decode_mask: only the cache blocks holding visible slots
    are read), a SplitMask (split attention, EAGLET_SPLIT) or a boolean tensor [T, L]: then only the first L
    slots are read (eager prefill passes L = what is filled).
    """
    if EXACT:
        return exact_attention(q, k, v, mask)
    if isinstance(mask, BlockMask):
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    if isinstance(mask, SplitMask):
        return split_attention(q, k, v, mask)
    if isinstance(mask, WindowMask):
        k, v, mask = window_inputs(k, v, mask)
    return F.scaled_dot_product_attention(**sdpa_inputs(q, k, v, mask)).reshape(q.shape)


def exact_attention(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """--exact: the boolean mask's attention in float64, rounded to q's dtype once at the end. A verify holds a
    token's ancestors at other cache slots than plain decoding does, and its call has other rows, so the two add
    the same terms in different orders. The scores (bf16 x bf16 products, 53-bit sums of 64-256 of them) come
    out exact; the weighted sums differ by about 2^-53 x the slots, some 2^-36 of a bf16 step at 4k slots, so
    the final rounding agrees but for a value within that distance of a rounding boundary."""
    if isinstance(mask, WindowMask):  # a draft head's band
        k, v, mask = window_inputs(k, v, mask)
    visible = mask if mask.ndim == 3 else mask[None]  # [B or 1, T, L]
    n = visible.shape[-1]
    out, _ = attention_with_lse(q.double(), k[:, :, :n], v[:, :, :n], visible)
    return out.to(q.dtype)


def sdpa_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> dict:
    """SDPA's arguments for a 2-D boolean mask [T, L]: the first L cache slots, and the query heads that share
    a key/value head folded into the query length (q as [B, H_kv, rep * T, D], the mask repeated rep times).
    The same attention as enable_gqa, which with a boolean mask falls to the unfused math kernel on CUDA,
    and no copy of K/V per query head (repeat_interleave's: about 1 GB written and read back in a compiled
    60-token verify on LLaMA-3-8B over 2048 slots)."""
    bsz, n_head, seqlen, head_dim = q.shape
    n_kv = k.shape[1]
    rep = n_head // n_kv
    if mask.ndim == 3:  # [B, T, L]: each row its own mask, broadcast over the heads
        mask = mask.repeat(1, rep, 1)[:, None]
    elif rep > 1:
        mask = mask.repeat(rep, 1)
    return dict(query=q.reshape(bsz, n_kv, rep * seqlen, head_dim), key=k[:, :, :mask.shape[-1]],
                value=v[:, :, :mask.shape[-1]], attn_mask=mask)


KV_BLOCK = 128  # cache slots per block of a BlockMask; blocks with no visible slot are skipped


def block_mask(mask: Tensor, mask_mod=None) -> BlockMask:
    """The boolean mask [T, S] as a BlockMask for flex_attention: the same attention, but the kernel reads
    only the KV blocks in which some query sees a slot (the filled context and the block's own slots), so
    a step's cost follows the context, not the cache size. Fixed shapes: one compiled graph for all lengths.
    mask_mod decides inside partial blocks (default: reads the mask; another must say the same as the mask).
    (`mask_mod or read_mask` would not do: torch 2.11's dynamo cannot take the truth of a function, and the
    compiled plain step on CUDA failed to compile so, seen on an H200.)"""
    n_q, n_kv = mask.shape
    q_blocks, kv_blocks = -(-n_q // KV_BLOCK), -(-n_kv // KV_BLOCK)
    q_pad, kv_pad = q_blocks * KV_BLOCK - n_q, kv_blocks * KV_BLOCK - n_kv
    padded = F.pad(mask, (0, kv_pad, 0, q_pad))
    some = padded.view(q_blocks, KV_BLOCK, kv_blocks, KV_BLOCK).any(dim=3).any(dim=1)  # [q_blocks, kv_blocks]
    every = F.pad(padded[:n_q], (0, 0, 0, q_pad), value=True)  # padding rows must not make a block partial
    every = every.view(q_blocks, KV_BLOCK, kv_blocks, KV_BLOCK).all(dim=3).all(dim=1)
    partial = some & ~every

    def listed(chosen: Tensor):  # the chosen blocks' indices first, and how many there are
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return chosen.sum(-1, dtype=torch.int32)[None, None], order[None, None]

    def read_mask(b, h, q_idx, kv_idx):
        return padded[q_idx, kv_idx]

    return BlockMask.from_kv_blocks(*listed(partial), *listed(every), BLOCK_SIZE=KV_BLOCK,
                                    mask_mod=read_mask if mask_mod is None else mask_mod, seq_lengths=(n_q, n_kv))


def decode_block_mask(input_pos: Tensor, n_kv: int) -> BlockMask:
    """A decoding step's mask (one token at slot input_pos[0] sees slots 0..input_pos[0]) as a BlockMask: the
    block lists of block_mask, with a mask_mod that reads only input_pos, a graph input. (torch
    2.11's CUDA inductor cannot lower a mask_mod that reads a tensor computed inside the graph, as
    block_mask's does, nor flex_attention over more than one query here: both seen on an H100.)"""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= input_pos[0]

    return block_mask(boolean_mask(input_pos[0], torch.ones(1, 1, dtype=torch.bool, device=input_pos.device), n_kv),
                      mask_mod)


# EAGLET_FLEX=0 turns the block mask off: compiled CUDA decoding then attends over the whole cache, as on CPU
# (a fallback should flex_attention fail to compile on some torch / GPU; scripts/gpu_check.py uses it so).
FLEX_ATTENTION = os.environ.get("EAGLET_FLEX", "1") != "0"


# EAGLET_SPLIT=1: compiled CUDA calls of several tokens (verify, the draft's frontier, the catch-up) attend in two
# parts (split_attention), so that they read only the filled cache blocks as decoding does. Off by default: no GPU
# has run or measured it yet (BENCHMARKS.md has the commands). SPLIT_EAGER (tests): the split in eager and CPU code.
SPLIT_ATTENTION = os.environ.get("EAGLET_SPLIT", "0") == "1"
SPLIT_EAGER = False
SPLIT_BLOCK_M = 128  # flex decoding's query tile when a call's queries x GQA group exceed one 128-row block


@dataclass
class SplitMask:
    """attention_mask's mask in split form: T tokens written at cache slots ctx_len.. see every context slot
    (< ctx_len) and, among the W slots ctx_len..ctx_len+W-1, what block [T, W] allows; no slot from n_kv on
    (the L of the boolean mask it stands for). A batch: ctx_len [B], block [T, W] or [B, T, W]."""
    ctx_len: Tensor  # [] or [B]; under torch.compile on CUDA a graph input (flex's mask_mod reads it)
    block: Tensor
    n_kv: int


def split_attention_on(device: torch.device) -> bool:
    if not SPLIT_ATTENTION:
        return False
    return SPLIT_EAGER or (FLEX_ATTENTION and torch.compiler.is_compiling() and device.type == "cuda")


def split_attention(q: Tensor, k: Tensor, v: Tensor, mask: SplitMask, flex: Optional[bool] = None) -> Tensor:
    """The boolean mask's attention in two parts over disjoint slots, merged exactly by their log-sum-exps:
    the context (slots < ctx_len, no per-query mask: every new token sees all of it) and the block's own W
    slots, read back from the cache after this call's update (the draft frontier's block also holds earlier
    levels' slots). flex (default: in compiled CUDA code): the context through flex_attention over its filled
    blocks only; else through masked math over the first n_kv slots (exact, no faster than SDPA)."""
    bsz = q.shape[0]
    ctx_len = mask.ctx_len.reshape(-1).expand(bsz)
    k_ctx, v_ctx = k[:, :, :mask.n_kv], v[:, :, :mask.n_kv]
    if flex is None:
        flex = q.is_cuda and torch.compiler.is_compiling()
    if flex:
        out_c, lse_c = context_attention(q, k_ctx, v_ctx, mask.ctx_len)
    else:
        slots = torch.arange(mask.n_kv, device=q.device)
        out_c, lse_c = attention_with_lse(q, k_ctx, v_ctx, (slots < ctx_len[:, None])[:, None])
    lse_c = torch.where(ctx_len[:, None, None] > 0, lse_c, float("-inf"))  # an empty context weighs 0
    slots = ctx_len[:, None] + torch.arange(mask.block.shape[-1], device=q.device)  # [B, W]
    index = slots.clamp(max=mask.n_kv - 1)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    visible = mask.block.expand(bsz, -1, -1) & (slots < mask.n_kv)[:, None]
    out_b, lse_b = attention_with_lse(q, k.gather(2, index), v.gather(2, index), visible)
    return merge_attention(out_c, lse_c, out_b, lse_b).to(q.dtype)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, visible: Tensor):
    """Attention of q [B, H, T, D] over k, v [B, H_kv, S, D] where visible [B, T or 1, S] allows, in fp32 (or
    fp64), and its log-sum-exp [B, H, T]; a query that sees nothing gets output 0 and lse -inf."""
    bsz, n_head, seqlen, head_dim = q.shape
    n_kv = k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    q = q.reshape(bsz, n_kv, n_head // n_kv, seqlen, head_dim).to(dtype)  # the heads sharing a K/V head
    scores = torch.einsum("bgrtd,bgsd->bgrts", q, k.to(dtype)) * head_dim ** -0.5
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(dtype).min)  # finite where nothing is visible
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)  # 0 where nothing is visible, else >= 1 (the top's own exp(0))
    out = torch.einsum("bgrts,bgsd->bgrtd", weights, v.to(dtype)) / total.clamp(min=1)
    return out.reshape(bsz, n_head, seqlen, -1), (top + total.log()).reshape(bsz, n_head, seqlen)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Two attentions of the same queries over disjoint slots as one over both: each output weighed by its
    exp-sum, exp(lse - m) relative to the larger m (a part whose lse is -inf weighs 0)."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return (out_a.to(weight_a.dtype) * weight_a + out_b.to(weight_a.dtype) * weight_b) / (weight_a + weight_b)


def context_block_mask(ctx_len: Tensor, n_q: int, n_kv: int) -> BlockMask:
    """split_attention's context part as a BlockMask: every query sees the slots below ctx_len ([] or [B], a
    graph input under torch.compile). Its block lists come from ctx_len alone (the full blocks below it, and
    the one it ends inside), and its mask_mod reads only ctx_len: no [T, L] mask is built or read."""
    kv_blocks, q_blocks = -(-n_kv // KV_BLOCK), -(-n_q // KV_BLOCK)
    ctx = ctx_len.reshape(-1, 1, 1).to(torch.int32)  # [B or 1, 1, 1]
    n_full, n_partial = ctx // KV_BLOCK, (ctx % KV_BLOCK != 0).to(torch.int32)
    blocks = torch.arange(kv_blocks, dtype=torch.int32, device=ctx.device)
    full = blocks.expand(ctx.shape[0], 1, q_blocks, kv_blocks)  # blocks 0..n_full-1 lead the list
    partial = ((blocks + n_full[..., None]) % kv_blocks).expand(-1, -1, q_blocks, -1)  # block n_full leads

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < (ctx_len if ctx_len.ndim == 0 else ctx_len[b])

    return BlockMask.from_kv_blocks(n_partial.expand(-1, -1, q_blocks), partial, n_full.expand(-1, -1, q_blocks),
                                    full, BLOCK_SIZE=KV_BLOCK, mask_mod=mask_mod, seq_lengths=(n_q, n_kv))


def context_kernel_options(n_q: int, group: int) -> dict:
    """flex decoding (under 128 queries) packs a GQA group's queries into one tile, by default the next power of
    two of n_q x group rows; past the block mask's 128-row query block every config is filtered out
    (NoValidChoicesError on torch 2.11: 60 x 4 -> 256): a smaller tile, several per group, fits."""
    return {"BLOCK_M": SPLIT_BLOCK_M} if n_q * group > KV_BLOCK else {}


def context_attention(q: Tensor, k: Tensor, v: Tensor, ctx_len: Tensor, kernel_options=None):
    """flex_attention of q [B, H, T, D] over the cache slots below ctx_len, reading only the blocks that hold
    them, and its log-sum-exp [B, H, T] (natural log; -inf and output 0 where ctx_len is 0)."""
    n_q, group = q.shape[2], q.shape[1] // k.shape[1]
    options = context_kernel_options(n_q, group) if kernel_options is None else kernel_options
    kwargs = dict(block_mask=context_block_mask(ctx_len, n_q, k.shape[2]), enable_gqa=group > 1,
                  kernel_options=options or None)
    if AuxRequest is None:  # torch < 2.9
        return flex_attention(q, k, v, return_lse=True, **kwargs)
    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
    return out, aux.lse


def decode_mask(input_pos: Tensor, n_kv: int):
    """The mask of a decoding step over n_kv cache slots: inside torch.compile on CUDA a BlockMask, so the
    step reads only the filled cache blocks; elsewhere the boolean row. (Eager flex_attention is a slow
    reference, and CPU inductor's flex kernel cannot lower a mask computed inside the graph.) Calls of more
    than one token (prefill, verify, the draft's) attend through the boolean mask, or split (EAGLET_SPLIT=1)."""
    if FLEX_ATTENTION and torch.compiler.is_compiling() and input_pos.is_cuda and input_pos.ndim == 1 and not EXACT:
        return decode_block_mask(input_pos, n_kv)
    return causal_mask(input_pos, n_kv)


def attention_mask(ctx_len: Tensor, block: Tensor, max_seq_length: int) -> Tensor:
    """The one mask builder: [T, max_seq_length] booleans for T tokens written at slots ctx_len.. .

    Every token sees the context (slots < ctx_len); among the block's own slots ctx_len..ctx_len+W-1 it
    sees what `block` [T, W] allows: lower-triangular for prefill, ancestors-and-self for a tree.
    Several rows (a batch): ctx_len [B] and block [B, T, W] give [B, T, max_seq_length].
    With split attention on (EAGLET_SPLIT, compiled CUDA code) the same mask as a SplitMask instead.
    """
    if split_attention_on(block.device) and not EXACT:
        return SplitMask(ctx_len, block, max_seq_length)
    return boolean_mask(ctx_len, block, max_seq_length)


def boolean_mask(ctx_len: Tensor, block: Tensor, max_seq_length: int) -> Tensor:
    """attention_mask's booleans, whether split attention is on or not."""
    cols = torch.arange(max_seq_length, device=block.device)
    if ctx_len.ndim == 1:
        rel = cols - ctx_len[:, None]  # [B, L]
        in_block = (rel >= 0) & (rel < block.shape[-1])
        index = rel.clamp(0, block.shape[-1] - 1)[:, None].expand(-1, block.shape[-2], -1)
        seen = block.expand(len(ctx_len), -1, -1).gather(2, index) & in_block[:, None]
        return (cols < ctx_len[:, None])[:, None] | seen
    rel = cols - ctx_len
    in_block = (rel >= 0) & (rel < block.shape[1])
    return (cols < ctx_len) | (block.index_select(1, rel.clamp(0, block.shape[1] - 1)) & in_block)


@dataclass
class WindowMask:
    """A draft head's context window: T tokens written at cache slots ctx_len.. see the first `sinks` slots and the
    last `window` slots before ctx_len (not the context between), and among their own W slots what block [T, W]
    allows. Every query of a call sees the same context band. With ctx_len [B] and block [B, T, W]: a batch."""
    ctx_len: Tensor
    block: Tensor
    sinks: int
    window: int
    n_kv: int


def window_inputs(k: Tensor, v: Tensor, mask: WindowMask):
    """The band's K/V gathered from the cache [B, H_kv, S, D] and a boolean mask over it [T, band] (or [B, T, band]):
    sinks + window + W slots whatever the context's length, so a call's cost stays flat as the context grows."""
    bsz, width = k.shape[0], mask.block.shape[-1]
    ctx = mask.ctx_len.reshape(-1, 1).expand(bsz, 1)
    sink = torch.arange(mask.sinks, device=k.device).expand(bsz, -1)
    recent = ctx - mask.window + torch.arange(mask.window, device=k.device)
    own = ctx + torch.arange(width, device=k.device)
    slots = torch.cat([sink, recent, own], dim=1)  # [B, band]
    seen = torch.cat([sink < ctx, (recent >= mask.sinks) & (recent < ctx)], dim=1)  # a sink never twice
    block = mask.block.expand(bsz, -1, -1) & (own < mask.n_kv)[:, None]
    visible = torch.cat([seen[:, None].expand(-1, block.shape[1], -1), block], dim=2)  # [B, T, band]
    index = slots.clamp(0, mask.n_kv - 1)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    return k.gather(2, index), v.gather(2, index), visible if mask.ctx_len.ndim else visible[0]


def causal_mask(input_pos: Tensor, max_seq_length: int) -> Tensor:
    """Tokens at consecutive positions input_pos [T] (or [B, T], each row from its own start), written at slots
    equal to their positions."""
    n = input_pos.shape[-1]
    return attention_mask(input_pos[..., 0], torch.ones(n, n, dtype=torch.bool, device=input_pos.device).tril(),
                          max_seq_length)
