"""A LLaMA-family decoder (LLaMA-2/3/3.1/3.2, Vicuna, Mistral, Qwen2, Qwen3) with a static KV cache.

One forward serves prefill, one-token decode and a token tree: the caller passes the token ids,
their RoPE positions, the cache slots their K/V go to, and a mask over the cache (attention.py builds it
and attends through it; compiled code on CUDA reads only the blocks of the cache the mask lets some token see).
It returns the logits (optionally only at some positions) and the features its EAGLE draft head
reads: the last hidden state after the final norm (EAGLE-1/2), or the hidden states entering the layers
listed in `feature_layers`, concatenated (EAGLE-3).

Imports attention.py (the attention kernels and masks), checkpoint.py (reading config.json and weight files,
with the checks of what a user gives) and torch. A file of quantized weights loads into quantize.py's Linears,
imported only then (quantize_module): a float model needs nothing of it.
"""
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

import attention
from attention import attend
from checkpoint import (QUANT_KEY, EagletError, check_config_values, load_state_dict, mismatch_detail, read_config,
                        rope_settings)


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_local_heads: int = -1  # key/value heads (GQA); -1 means n_head
    head_dim: int = 0  # 0 means dim // n_head
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    sliding_window: Optional[int] = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False  # LLaMA's mlp_bias: gate, up and down projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    extra: dict = field(default_factory=dict)  # eos/bos ids and anything else worth keeping

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if not self.head_dim:
            self.head_dim = self.dim // self.n_head

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArgs":
        model_type = config.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise EagletError(f"unsupported architecture {model_type or config.get('architectures')!r}; "
                              f"supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}")
        check_config_values(config)
        rope = dict(rope_settings(config)[0])
        rope_base = config.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise EagletError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3, yarn are)")
        if rope_type in ("llama3", "yarn"):  # as transformers: the length trained at is max_position_embeddings
            rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings", 4096))
        sliding = config.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
            sliding = None
        return cls(
            vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layer=config["num_hidden_layers"],
            n_head=config["num_attention_heads"],
            n_local_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or 0, intermediate_size=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-5), rope_base=float(rope_base),
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=config.get("max_position_embeddings", 4096), sliding_window=sliding,
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias")),
            o_bias=model_type in ("llama", "qwen3") and bool(config.get("attention_bias")),
            mlp_bias=model_type == "llama" and bool(config.get("mlp_bias")),  # transformers reads it for llama only
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), model_type=model_type,
            extra={k: config.get(k) for k in ("bos_token_id", "eos_token_id", "tokenizer_vocab_size")},
        )

    @classmethod
    def from_checkpoint_dir(cls, checkpoint_dir) -> "ModelArgs":
        config = read_config(checkpoint_dir)
        try:
            return cls.from_hf_config(config)
        except EagletError as e:
            raise EagletError(f"{Path(checkpoint_dir) / 'config.json'}: {e}")


def rope_type(scaling: Optional[dict]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"


def rope_inv_freq(head_dim: int, base: float, scaling: Optional[dict]) -> Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    factor = scaling["factor"]
    if rope_type(scaling) == "linear":
        return (inv_freq / factor).float()
    if rope_type(scaling) == "yarn":
        return yarn_inv_freq(inv_freq, head_dim, base, scaling).float()
    # llama3: wavelengths beyond old_len / low are slowed down by factor, those below old_len / high
    # kept, the band between interpolated; the clamp does all three.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    smooth = ((old_len * inv_freq / (2 * math.pi) - low) / (high - low)).clamp(0, 1)
    return ((1 - smooth) * inv_freq / factor + smooth * inv_freq).float()


def yarn_inv_freq(inv_freq: Tensor, head_dim: int, base: float, scaling: dict) -> Tensor:
    """YaRN: the frequencies that turn more than beta_fast times over the original context are kept, those that
    turn fewer than beta_slow times are divided by factor, and a linear ramp over the dimensions between."""
    old_len = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_turning(turns):  # the dimension pair whose frequency turns `turns` times over old_len (fractional)
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_turning(fast), dim_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return ramp * inv_freq / scaling["factor"] + (1 - ramp) * inv_freq


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """What YaRN multiplies cos and sin by (so every q.k by its square): the config's attention_factor, else
    mscale(mscale) / mscale(mscale_all_dim) where both are given (DeepSeek's form), else mscale(1); 1 for the
    other types."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale(1)


def context_limit(args: ModelArgs) -> tuple:
    """The longest cache the model's positions allow, and its words for an error: max_position_embeddings, or
    with rope scaling factor x original_max_position_embeddings where more (as vLLM and SGLang: Qwen3 and
    Qwen2.5 enable YaRN by adding rope_scaling to a config that keeps max_position_embeddings 32768 or 40960).
    Linear scaling names no original length: max_position_embeddings is it."""
    max_pos, scaling = args.max_position_embeddings, args.rope_scaling
    if scaling is None:
        return max_pos, f"max_position_embeddings ({max_pos})"
    old_len = scaling.get("original_max_position_embeddings", max_pos)
    stretched = int(scaling["factor"] * old_len)
    if stretched <= max_pos:
        return max_pos, f"max_position_embeddings ({max_pos})"
    return stretched, (f"limit under {rope_type(scaling)} rope scaling ({stretched} = factor {scaling['factor']} x "
                       f"original_max_position_embeddings {old_len})")


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # Hugging Face layout: the two rotated halves are the first and second half of head_dim.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# At most this many elements a cache buffer. torch.compile indexes a kernel in 64 bits when a buffer it reads holds
# more, and torch 2.11's flex_attention kernel then fails to compile (a ternary of int64 and int32): seen on an H200
# with LLaMA-3-8B's shape at 33k slots, where one buffer of every layer holds 2.2 billion elements.
MAX_BUFFER_ELEMENTS = 2**31 - 1


class KVCache(nn.Module):
    """Every layer's keys and values in buffers [layers, 2, B, H, S, D]: one for all layers unless that would hold
    more than MAX_BUFFER_ELEMENTS, then as few as keep under it. Moving an accepted tree path into place is one
    gather and one scatter a buffer, not a pair per layer and per K and V."""
    def __init__(self, n_layer, max_batch_size, max_seq_length, n_heads, head_dim, dtype):
        super().__init__()
        one_layer = (2, max_batch_size, n_heads, max_seq_length, head_dim)
        self.layers_per_buffer = max(1, MAX_BUFFER_ELEMENTS // math.prod(one_layer))
        self.n_buffers = -(-n_layer // self.layers_per_buffer)
        for j in range(self.n_buffers):
            n = min(self.layers_per_buffer, n_layer - j * self.layers_per_buffer)
            self.register_buffer(self.buffer_name(j), torch.zeros((n,) + one_layer, dtype=dtype), persistent=False)

    @staticmethod
    def buffer_name(j: int) -> str:
        return "kv" if j == 0 else f"kv{j}"  # kv alone in all but very long caches

    def kv_buffers(self) -> list:
        return [getattr(self, self.buffer_name(j)) for j in range(self.n_buffers)]

    def layer(self, i: int) -> "LayerCache":
        return LayerCache(self, i)

    def compact(self, src_slots: Tensor, dst_slots: Tensor):
        """K/V of every layer moved from src_slots to dst_slots: [n] in every row, or [B, n] per row. The source
        is read whole before anything is written, so overlapping ranges are safe."""
        for kv in self.kv_buffers():
            if src_slots.ndim == 1:
                kv.index_copy_(4, dst_slots, kv.index_select(4, src_slots))
            else:
                rows = torch.arange(src_slots.shape[0], device=src_slots.device)[:, None]
                kv[:, :, rows, :, dst_slots] = kv[:, :, rows, :, src_slots]


class LayerCache:
    """One layer's part of a KVCache (what its Attention writes and reads). A plain object, not a module: the
    compiled graph sees the shared buffer, never 2 x n_layer aliasing views of it."""
    def __init__(self, cache: KVCache, layer: int):
        self.cache = cache
        self.buffer, self.index = divmod(layer, cache.layers_per_buffer)

    @property
    def kv(self) -> Tensor:  # the buffer that holds this layer
        return getattr(self.cache, KVCache.buffer_name(self.buffer))

    @property
    def k_cache(self) -> Tensor:  # [B, H, S, D]
        return self.kv[self.index, 0]

    @property
    def v_cache(self) -> Tensor:
        return self.kv[self.index, 1]

    def update(self, cache_slots: Tensor, k: Tensor, v: Tensor):
        """k, v [B, H, T, D] to cache_slots: [T], the same slots in every row, or [B, T], each row its own.

        One index_put_ on the whole buffer, an index tensor for each of its first five dimensions. Written
        through a view instead (kv[layer][:, :, slots] = k), torch.compile turns the write into a copy of the
        WHOLE buffer, every layer, every step; the base written at explicit indices stays in place."""
        kv, device = self.kv, k.device
        bsz, n_kv, n_new, _ = k.shape
        layer = torch.full((1, 1, 1, 1), self.index, device=device)
        k_or_v = torch.arange(2, device=device).view(2, 1, 1, 1)
        rows = torch.arange(bsz, device=device).view(1, bsz, 1, 1)
        heads = torch.arange(n_kv, device=device).view(1, 1, n_kv, 1)
        slots = cache_slots.view(1, -1, 1, n_new)  # [1, 1 or B, 1, T]
        kv.index_put_((layer, k_or_v, rows, heads, slots), torch.stack([k, v]))
        return self.k_cache[:bsz], self.v_cache[:bsz]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_dim: int = 0):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        qkv_dim = (self.n_head + 2 * self.n_kv) * self.head_dim
        self.wqkv = nn.Linear(in_dim or args.dim, qkv_dim, bias=args.qkv_bias)  # EAGLE-3 heads read 2 x dim
        self.wo = nn.Linear(self.n_head * self.head_dim, args.dim, bias=args.o_bias)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.kv_cache: Optional[LayerCache] = None  # set by setup_caches
        self.tp_group = None  # tensor parallel (tp.py): this rank holds some heads; wo's output is a partial sum

    def project(self, x: Tensor, cos: Tensor, sin: Tensor):
        """q [B, H, T, D], k and v [B, H_kv, T, D] of x [B, T, dim]: normed (Qwen3) and rotated."""
        bsz, seqlen, _ = x.shape
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.wqkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache_slots: Tensor, mask: Tensor) -> Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if self.kv_cache is not None:  # without a cache (training) the block attends to itself only
            k, v = self.kv_cache.update(cache_slots, k, v)
        y = attend(q, k, v, mask)
        return all_reduce(self.wo(y.transpose(1, 2).reshape(bsz, seqlen, -1)), self.tp_group)


def all_reduce(x: Tensor, group) -> Tensor:
    """Tensor parallel: a row-parallel Linear's output on each rank is a partial sum; every rank gets their total
    (a functional collective: it compiles into the graph, CUDA graphs included). No group: x itself."""
    return x if group is None else funcol.all_reduce(x, "sum", group)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=args.mlp_bias)  # gate and up, fused
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)
        self.tp_group = None  # tensor parallel (tp.py): this rank holds a slice of the intermediate dimension

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return all_reduce(self.w2(F.silu(gate) * up), self.tp_group)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, input_norm: bool = True):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        # EAGLE-1/2 draft heads drop the input norm of their only layer.
        self.attention_norm = RMSNorm(args.dim, args.norm_eps) if input_norm else nn.Identity()
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, cache_slots, mask):
        h = x + self.attention(self.attention_norm(x), cos, sin, cache_slots, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class RotaryTable(nn.Module):
    """cos/sin for every position of the cache, indexed by a position tensor (compile friendly)."""

    def __init__(self, head_dim, base, scaling, max_seq_length, device=None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, base, scaling).to(device)
        freqs = torch.outer(torch.arange(max_seq_length, device=device, dtype=torch.float32), inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        scale = rope_attention_factor(scaling)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, input_pos: Tensor, dtype):
        """input_pos [T] (every row at the same positions) or [B, T]; cos and sin broadcast over the heads."""
        cos, sin = self.cos[input_pos].to(dtype), self.sin[input_pos].to(dtype)
        return (cos, sin) if input_pos.ndim == 1 else (cos[:, None], sin[:, None])


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope: Optional[RotaryTable] = None
        self.kv_cache: Optional[KVCache] = None  # every layer's K/V, set by setup_caches
        self.max_seq_length = 0
        self.feature_layers: tuple = ()  # set by an EAGLE-3 head: the layers whose input it reads
        self.quantization: Optional[dict] = None  # a quantized checkpoint's record (mode, groupsize, ...)
        self.tp_group = None  # tensor parallel: the process group its layers are sharded over (tp.py)
        self.exact_rows = 0  # --exact: no Linear call has fewer rows (set_exact)

    def set_exact(self, on: bool = True, verify_rows: int = 2):
        """--exact: a token's logits round alike as one row of a verify and as a plain step. No Linear call has
        fewer than 2 rows (a one-row call is padded with a copy of its row): on a CPU a one-row bf16 matmul takes
        another kernel than a call of 2 or more, whose rows do not depend on each other. On CUDA, where cuBLAS picks
        kernels by the row count, no fewer than verify_rows (the verify's). Attention runs in float64
        (attention.exact_attention), process-wide: every model attends so while it is on."""
        attention.EXACT = on
        self.exact_rows = 0 if not on else max(2, verify_rows) if self.tok_embeddings.weight.is_cuda else 2

    def exact_padding(self, n: int, device) -> Tensor:
        """--exact: the indices of n rows padded to exact_rows, the last row repeated."""
        return torch.arange(self.exact_rows, device=device).clamp(max=n - 1)

    def set_feature_layers(self, layers):
        """Return the hidden states entering these layers (len(layers) x dim wide) as the features, instead
        of the final-normed last hidden state; index n_layer means the last layer's output, before the norm."""
        if not all(0 <= i <= self.args.n_layer for i in layers):
            raise EagletError(f"feature layers {list(layers)} do not exist in a {self.args.n_layer}-layer target")
        self.feature_layers = tuple(layers)

    def setup_rope(self, max_seq_length: int):
        """RoPE tables only: enough for training, where forward gets cache_slots=None and a [T, T] mask."""
        self.rope = RotaryTable(self.args.head_dim, self.args.rope_base, self.args.rope_scaling, max_seq_length,
                                self.tok_embeddings.weight.device)

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        args = self.args
        limit, what = context_limit(args)
        if max_seq_length > limit:
            raise EagletError(f"{max_seq_length} tokens exceed the model's {what}")
        if args.sliding_window and max_seq_length > args.sliding_window:
            raise EagletError(f"{max_seq_length} tokens exceed the sliding window ({args.sliding_window}); "
                              "eaglet treats attention as full, which is exact only within the window")
        weight = self.tok_embeddings.weight  # float in every format: the activations' dtype
        self.max_seq_length = max_seq_length
        n_kv = self.layers[0].attention.n_kv  # this rank's K/V heads (all of them unless tensor parallel)
        for layer in self.layers:  # the old cache's memory is free before the new one is allocated
            layer.attention.kv_cache = None
        self.kv_cache = None
        try:
            self.kv_cache = KVCache(len(self.layers), max_batch_size, max_seq_length, n_kv, args.head_dim,
                                    weight.dtype).to(weight.device)
        except RuntimeError as e:  # CUDA's OutOfMemoryError, or the CPU allocator's refusal
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            kv_gb = 2 * args.n_layer * max_batch_size * max_seq_length * n_kv * args.head_dim \
                * weight.element_size() / 1e9
            raise EagletError(f"a KV cache of {max_seq_length} slots ({kv_gb:.1f} GB) does not fit in memory on "
                              f"{weight.device}: a smaller --max_seq_length needs less")
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = self.kv_cache.layer(i)
        self.setup_rope(max_seq_length)

    def forward(self, idx: Tensor, input_pos: Tensor, cache_slots: Tensor, mask: Tensor,
                logits_idx: Optional[Tensor] = None):
        """idx [B, T]; input_pos and cache_slots [T]; mask [T, L] (True = may attend) over the first L cache
        slots: L = max_seq_length in compiled code (fixed shapes), what is filled in an eager prefill; or, for
        compiled CUDA decoding, decode_mask's BlockMask. Rows at different places (a batch of prompts):
        input_pos and cache_slots [B, T], mask [B, T, L], logits_idx [B, k].

        Returns (logits at logits_idx, or at every position; features [B, T, dim * max(1, len(feature_layers))]).
        """
        if idx.shape[0] * idx.shape[1] < self.exact_rows:  # --exact: the last row again, its output dropped
            pad = self.exact_padding(idx.shape[1], idx.device)
            logits, features = self(idx[:, pad], input_pos[..., pad], cache_slots[..., pad],
                                    mask[..., pad, :], logits_idx)
            return (logits if logits_idx is not None else logits[:, :idx.shape[1]]), features[:, :idx.shape[1]]
        x = self.tok_embeddings(idx)
        cos, sin = self.rope(input_pos, x.dtype)
        layer_inputs = {}  # kept only for the layers the draft head reads
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                layer_inputs[i] = x
            x = layer(x, cos, sin, cache_slots, mask)
        layer_inputs[len(self.layers)] = x
        hidden = self.norm(x)
        if logits_idx is None or logits_idx.ndim == 1:  # [k]: the same positions in every row
            selected = hidden if logits_idx is None else hidden[:, logits_idx]
        else:  # [B, k]: each row its own positions
            selected = hidden.gather(1, logits_idx[..., None].expand(-1, -1, hidden.shape[-1]))
        if not self.feature_layers:
            return self.logits(selected), hidden
        return self.logits(selected), torch.cat([layer_inputs[i] for i in self.feature_layers], dim=-1)

    def logits(self, hidden: Tensor, rows: Optional[nn.Module] = None) -> Tensor:
        """Final-normed hidden states -> logits: the one place they are made (the forward, every head that scores
        with this lm_head, and head training call it), so a change here (a soft-cap, a scale) reaches them all.
        rows: a Linear of some of the lm_head's rows (a draft vocabulary's), used in its place."""
        lm_head = self.output if rows is None else rows
        if hidden.ndim > 1 and hidden.numel() < self.exact_rows * hidden.shape[-1]:  # --exact: padded (set_exact)
            n = hidden.shape[-2]
            return lm_head(hidden[..., self.exact_padding(n, hidden.device), :])[..., :n, :]
        return lm_head(hidden)

    def compact_kv(self, src_slots: Tensor, dst_slots: Tensor):
        """Copy K/V from src_slots to dst_slots in every layer, in place (accepted tree path -> context)."""
        self.kv_cache.compact(src_slots, dst_slots)

    @classmethod
    def from_checkpoint(cls, checkpoint_path, device="cpu", dtype=torch.float32) -> "Transformer":
        checkpoint_path = Path(checkpoint_path)
        if not checkpoint_path.is_file():
            raise EagletError(f"checkpoint not found: {checkpoint_path} "
                              "(run convert_hf_checkpoint.py --checkpoint_dir on its folder first)")
        args = ModelArgs.from_checkpoint_dir(checkpoint_path.parent)
        return cls.from_state_dict(args, load_state_dict(checkpoint_path), device, dtype, str(checkpoint_path))

    @classmethod
    def from_state_dict(cls, args: ModelArgs, state_dict: dict, device="cpu", dtype=torch.float32,
                        where: str = "the state dict") -> "Transformer":
        """The model of these weights (as saved, or as quantize.py writes them) on device in dtype."""
        with torch.device("meta"):
            model = cls(args)
        state_dict = dict(state_dict)
        quantize = quantize_module(state_dict)
        model.quantization = quantize.pop_quantization(state_dict, where) if quantize else None
        if "fc.weight" in state_dict:
            raise EagletError(f"{where} is an EAGLE draft head, not a target model "
                              "(give it as --draft_checkpoint_path)")
        if args.tie_word_embeddings and "tok_embeddings.weight" in state_dict:
            state_dict.setdefault("output.weight", state_dict["tok_embeddings.weight"])
        if quantize:
            with torch.device("meta"):
                quantize.use_quantized_linears(model, state_dict)  # a quantized lm_head is its own copy, no longer tied
        expected = model.state_dict()  # (on the meta device: names and dtypes only)
        whole = [n for n, t in state_dict.items() if n in expected and expected[n].is_floating_point()
                 and isinstance(t, Tensor) and not t.is_floating_point()]
        if whole:  # load_state_dict would blame the shapes, which agree
            raise EagletError(f"{where}: {whole[0]} holds {state_dict[whole[0]].dtype} values where the model's weights "
                              "are floating point: the file was made wrong")
        try:
            model.load_state_dict(state_dict, assign=True)
        except RuntimeError as e:
            raise EagletError(f"{where} does not match its config.json: {mismatch_detail(e)}")
        if args.tie_word_embeddings and isinstance(model.output, nn.Linear):
            model.output.weight = model.tok_embeddings.weight
        model = model.to(device=device, dtype=dtype).eval()
        if quantize:
            quantize.pack_quantized(model)
        own_copies(model, state_dict)
        return model


def own_copies(model: nn.Module, state_dict: dict):
    """A weight already in its dtype and on its device is the state dict's own tensor, which for a memory-mapped file
    keeps the whole map alive (its pages counted as the process's memory beside the converted copies): copy those."""
    mapped = {t.untyped_storage().data_ptr() for t in state_dict.values() if isinstance(t, Tensor) and t.device.type == "cpu"}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() in mapped:
            t.data = t.data.clone()


def quantize_module(state_dict: dict):
    """quantize.py, whose Linears a file of quantized weights (its record, or a Linear's NAME.scales) loads into;
    None for float weights. Imported here, not at the top: a float model needs nothing of it."""
    if QUANT_KEY in state_dict or any(name.endswith(".scales") for name in state_dict):
        import quantize
        return quantize
    return None

