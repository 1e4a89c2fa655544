"""Embed the demo (a 4-layer, 256-wide code model and its EAGLE head) in weights of a real model's shape that
compute exactly the demo's function: the same greedy tokens, the same tau, at a real model's cost.

    python scripts/inflate_demo.py --shape llama2-7b --out_dir checkpoints/demo-llama2-7b --device cuda
    python generate.py --checkpoint_path checkpoints/demo-llama2-7b/target/model.pth \\
        --draft_checkpoint_path checkpoints/demo-llama2-7b/head/draft.pth --compile

How (zero padding, nothing trained): the demo's hidden dimensions come first and the rest stay zero, but
for one "bias channel" that holds a small constant c in the residual stream; RMSNorms average over the
wider dimension, so their weights are scaled by sqrt(small / big) and their eps is set so that the bias
channel's c^2 and the wider mean cancel exactly. Each demo head's dimensions sit in a wider head (the two
RoPE halves kept apart, rope_theta raised so that every frequency is the demo's, q scaled for the wider
1/sqrt(head_dim)); demo query heads go to wide heads that share the right key/value head. Extra layers
and heads have zero output projections; extra MLP units are zero. The extra vocabulary rows read only the
bias channel with a large negative weight, so they never win, in the target's lm_head nor in the draft's
use of it. The tokenizer is the demo's (config.json says so in tokenizer_vocab_size).

The demo's EAGLE-3 head (demo/head3, if there) is written to OUT_DIR/head3 the same way. It reads the wide
layers that hold the demo's feature layers (demo layer i sits at wide layer i x stride, the layers between
add nothing); fc reads each of the three wide features' demo dims and passes one feature's bias channel
on, so that the head's own hidden state carries it through its norms. Its draft vocabulary is padded to
32000 entries (the whole vocabulary if smaller; LLaMA-3-8B's heads have 32000) whose lm_head rows never
win, mapped to target ids the demo's entries do not use. The demo's DFlash head (demo/dflash, if there) goes to
OUT_DIR/dflash the same way (feature layers and fc as EAGLE-3's); its per-head q/k norms see the demo's
statistics through a constant channel in each head's q and k (copy_qk_norms).
"""
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from block_draft import DFlashDraft  # noqa: E402
from draft import Eagle3Draft, Eagle3Flags, EagleDraft  # noqa: E402
from head_formats import eagle3_feature_layers, head_args, load_head  # noqa: E402
from cli import cli_parser  # noqa: E402
from load import PRECISIONS, load_draft, load_target, pick_device  # noqa: E402
from checkpoint import EagletError, read_config  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
SHAPES = {  # the fields that make a model's cost: LLaMA-2-7B, LLaMA-2-13B and LLaMA-3-8B
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=4096),
    "llama2-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40, head_dim=128, max_position_embeddings=4096),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192),
}
BIAS = 2.0 ** -5  # the bias channel's value (exact in bf16); c^2 must stay below small dim x eps
NEVER = -2.0e4  # extra vocabulary rows' weight on the bias channel
DRAFT_VOCAB = 32000  # the EAGLE-3 head's draft vocabulary, as LLaMA-3-8B's heads (the whole vocabulary if smaller)


class Layout:
    """Where the demo's numbers go in the wide model: hidden dims, head dims, query heads, key/value heads."""

    def __init__(self, small: ModelArgs, big: ModelArgs):
        if not (big.dim > small.dim and big.n_layer >= small.n_layer and big.n_head >= small.n_head
                and big.head_dim >= small.head_dim and big.intermediate_size >= small.intermediate_size
                and big.vocab_size >= small.vocab_size and big.head_dim % 2 == 0):
            raise EagletError(f"cannot embed a {small.dim}-wide, {small.n_layer}-layer model in {big.dim} x "
                              f"{big.n_layer} (every size must be at least the demo's, the width larger)")
        self.small, self.big = small, big
        self.bias_dim = big.dim - 1
        self.ratio = small.dim / big.dim
        self.stride = big.n_layer // small.n_layer  # demo layer i sits at wide layer i * stride
        half, big_half = small.head_dim // 2, big.head_dim // 2
        i = torch.arange(small.head_dim)
        self.head_dims = torch.where(i < half, i, i - half + big_half)  # the two RoPE halves stay apart
        small_rep, big_rep = small.n_head // small.n_local_heads, big.n_head // big.n_local_heads
        h = torch.arange(small.n_head)
        if big_rep >= small_rep:  # each demo kv group keeps its query heads together inside one wide group
            self.q_heads = (h // small_rep) * big_rep + h % small_rep
        elif small_rep % big_rep == 0:  # smaller wide groups: head h stays h, kv heads are duplicated
            self.q_heads = h
        else:
            raise EagletError(f"{big.n_head} heads over {big.n_local_heads} key/value heads cannot hold the "
                              f"demo's {small.n_head} over {small.n_local_heads}")
        if int(self.q_heads.max()) >= big.n_head or big.n_local_heads * big.head_dim < small.head_dim:
            raise EagletError(f"{small.n_head} demo heads do not fit in {big.n_head} heads")
        self.kv_source = {bh // big_rep: hh // small_rep for bh, hh in zip(self.q_heads.tolist(), h.tolist())}
        # rope: frequency j of the wide head is theta'^(-2j/D); the demo's is theta^(-2j/d)
        self.rope_theta = small.rope_base ** (big.head_dim / small.head_dim)

    def eps(self, small_eps: float) -> float:
        """(sum + c^2) / D + eps' = (small / D) (sum / small + eps): the wide norm sees the demo's statistics."""
        eps = self.ratio * small_eps - BIAS ** 2 / self.big.dim
        if eps <= 0:
            raise EagletError("the bias channel is too large for this eps")
        return eps

    def head_rows(self, head: int, offset: int) -> torch.Tensor:
        return offset + head * self.big.head_dim + self.head_dims

    def wide_input(self, layer: int) -> int:
        """The wide layer whose input is the demo's input of this layer (n_layer: the last layer's output)."""
        return 0 if layer == 0 else (layer - 1) * self.stride + 1

    def columns(self, blocks: int) -> torch.Tensor:
        """Where the columns of a demo weight reading `blocks` demo-wide inputs side by side go."""
        return torch.cat([b * self.big.dim + torch.arange(self.small.dim) for b in range(blocks)])


def put(dst: torch.Tensor, index, src: torch.Tensor):
    """dst[index] = src, the fp32 demo numbers rounded once to the wide model's dtype on its device."""
    dst[index] = src.to(device=dst.device, dtype=dst.dtype)


def copy_attention(big, small, lay: Layout, in_blocks: int = 1, scale_q: bool = True):
    """wqkv and wo of one attention: demo rows and columns to their wide places, q scaled for 1/sqrt(head_dim)
    (unless scale_q is False: a q norm after the projection would undo it; copy_qk_norms scales instead).
    in_blocks: inputs side by side (EAGLE-3's attention reads 2: embedding and hidden state)."""
    s, b = lay.small, lay.big
    d, sd = s.head_dim, s.dim
    w, wb = small.wqkv.weight, big.wqkv.weight
    q_scale = math.sqrt(b.head_dim / s.head_dim) if scale_q else 1.0
    cols = lay.columns(in_blocks)
    for h, bh in enumerate(lay.q_heads.tolist()):
        put(wb, (lay.head_rows(bh, 0)[:, None], cols), w[h * d:(h + 1) * d] * q_scale)
        put(big.wo.weight, (slice(sd), lay.head_rows(bh, 0)), small.wo.weight[:, h * d:(h + 1) * d])
    k_off, v_off = s.n_head * d, (s.n_head + s.n_local_heads) * d
    bk_off, bv_off = b.n_head * b.head_dim, (b.n_head + b.n_local_heads) * b.head_dim
    for bg, g in lay.kv_source.items():
        put(wb, (lay.head_rows(bg, bk_off)[:, None], cols), w[k_off + g * d:k_off + (g + 1) * d])
        put(wb, (lay.head_rows(bg, bv_off)[:, None], cols), w[v_off + g * d:v_off + (g + 1) * d])


def copy_qk_norms(big, small, lay: Layout):
    """Qwen3's per-head q and k norms over the wider head_dim, with the one eps of every norm of the model.
    A constant channel c in each head's q and k (the projection's bias, on a dim no demo head uses, zeroed
    again by the norm's weight so no score sees it) makes the norm see the demo head's statistics:
    (sum + c^2) / D + eps' = (d / D) (sum / d + eps). q's weight also carries the 1/sqrt(head_dim) change."""
    s, b = lay.small, lay.big
    if b.head_dim <= s.head_dim:
        raise EagletError(f"a head with q/k norms needs wider heads than the demo's {s.head_dim} dims to embed in")
    head_ratio = s.head_dim / b.head_dim
    c_squared = b.head_dim * (head_ratio * s.norm_eps - b.norm_eps)
    if c_squared < 0:
        raise EagletError(f"the {b.dim}-wide model's eps ({b.norm_eps:.3g}) is too large for q/k norms over "
                          f"{b.head_dim} dims to see the demo's {s.head_dim} (a wider model has a smaller eps)")
    c = math.sqrt(c_squared)
    free = b.head_dim // 2 - 1  # the first RoPE half's last dim: neither it nor its RoPE partner holds demo dims
    k_off = b.n_head * b.head_dim
    for bh in lay.q_heads.tolist():
        big.wqkv.bias[bh * b.head_dim + free] = c
    for bg in lay.kv_source:
        big.wqkv.bias[k_off + bg * b.head_dim + free] = c
    put(big.q_norm.weight, lay.head_dims, small.q_norm.weight)  # sqrt(d / D) for the norm x sqrt(D / d) for q
    put(big.k_norm.weight, lay.head_dims, small.k_norm.weight * math.sqrt(head_ratio))


def copy_mlp(big, small, lay: Layout):
    inter, big_inter, sd = lay.small.intermediate_size, lay.big.intermediate_size, lay.small.dim
    w13 = small.w13.weight
    put(big.w13.weight, (slice(inter), slice(sd)), w13[:inter])
    put(big.w13.weight, (slice(big_inter, big_inter + inter), slice(sd)), w13[inter:])
    put(big.w2.weight, (slice(sd), slice(inter)), small.w2.weight)


def copy_norm(big, small, lay: Layout):
    put(big.weight, slice(lay.small.dim), small.weight * math.sqrt(lay.ratio))


def empty_module(cls, args: ModelArgs, device, dtype):
    with torch.device("meta"):
        module = cls(args).to(dtype)
    module = module.to_empty(device=device)
    for p in module.parameters():
        p.data.zero_()
    return module


def wide_args(small_config: dict, shape: dict, eps: float, rope_theta: float) -> dict:
    """The wide model's config.json."""
    keep = {k: small_config[k] for k in ("bos_token_id", "eos_token_id") if k in small_config}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "rms_norm_eps": eps,
            "rope_theta": rope_theta, "tie_word_embeddings": False, **keep}


@torch.no_grad()
def inflate_target(small: Transformer, shape: dict, device, dtype):
    """The demo target inside a model of this shape; returns (model, its config.json, the layout)."""
    small_config = {"bos_token_id": small.args.extra.get("bos_token_id"),
                    "eos_token_id": small.args.extra.get("eos_token_id")}
    probe = ModelArgs.from_hf_config({"model_type": "llama", **shape})
    lay = Layout(small.args, probe)
    config = wide_args(small_config, shape, lay.eps(small.args.norm_eps), lay.rope_theta)
    config["tokenizer_vocab_size"] = small.args.vocab_size
    args = ModelArgs.from_hf_config(config)
    lay.big = args
    big = empty_module(Transformer, args, device, dtype)
    sd, sv = small.args.dim, small.args.vocab_size
    put(big.tok_embeddings.weight, (slice(sv), slice(sd)), small.tok_embeddings.weight)
    big.tok_embeddings.weight[:, lay.bias_dim] = BIAS
    put(big.output.weight, (slice(sv), slice(sd)), small.output.weight)
    big.output.weight[sv:, lay.bias_dim] = NEVER
    copy_norm(big.norm, small.norm, lay)
    big.norm.weight[lay.bias_dim] = 1 / BIAS  # extra rows score NEVER x rms-normalised 1
    for layer in big.layers:  # extra layers: zero output projections, so they add nothing
        layer.attention_norm.weight.fill_(1.0)
        layer.ffn_norm.weight.fill_(1.0)
    for i, small_layer in enumerate(small.layers):
        layer = big.layers[i * lay.stride]
        copy_attention(layer.attention, small_layer.attention, lay)
        copy_mlp(layer.feed_forward, small_layer.feed_forward, lay)
        copy_norm(layer.attention_norm, small_layer.attention_norm, lay)
        copy_norm(layer.ffn_norm, small_layer.ffn_norm, lay)
    return big.eval(), config, lay


@torch.no_grad()
def inflate_head(small: EagleDraft, small_config: dict, lay: Layout, device, dtype):
    """The demo's EAGLE-1/2 head for the wide target; returns (head, its config.json)."""
    if not isinstance(small, EagleDraft):
        raise EagletError("only EAGLE-1/2 heads can be inflated")
    b = lay.big
    config = {**small_config, "hidden_size": b.dim, "num_attention_heads": b.n_head,
              "num_key_value_heads": b.n_local_heads, "head_dim": b.head_dim,
              "intermediate_size": b.intermediate_size, "vocab_size": b.vocab_size,
              "max_position_embeddings": b.max_position_embeddings, "rope_theta": lay.rope_theta,
              "rms_norm_eps": lay.eps(small.args.norm_eps), "bias": True}
    config.pop("rope_scaling", None)
    args = ModelArgs.from_hf_config({"model_type": "llama", **config})
    with torch.device("meta"):
        head = EagleDraft(args).to(dtype)
    head = head.to_empty(device=device)
    for p in head.parameters():
        p.data.zero_()
    sd = lay.small.dim
    put(head.fc.weight, (slice(sd), slice(sd)), small.fc.weight[:, :sd])  # embedding part
    put(head.fc.weight, (slice(sd), slice(b.dim, b.dim + sd)), small.fc.weight[:, sd:])  # feature part
    put(head.fc.bias, slice(sd), small.fc.bias)
    head.fc.bias[lay.bias_dim] = BIAS  # the head's own output carries the bias channel to the lm_head
    copy_attention(head.layer.attention, small.layer.attention, lay)
    copy_mlp(head.layer.feed_forward, small.layer.feed_forward, lay)
    copy_norm(head.layer.ffn_norm, small.layer.ffn_norm, lay)
    return head.eval(), config


@torch.no_grad()
def inflate_head3(demo_dir: Path, target: Transformer, draft_vocab_size: int = 0):
    """The demo's EAGLE-3 head (demo_dir/head3) for the demo inflated into target; returns (head, its
    config.json). draft_vocab_size: entries of its draft vocabulary, the demo's first (0: DRAFT_VOCAB, at most
    the target's vocabulary)."""
    small_target = ModelArgs.from_checkpoint_dir(demo_dir / "target")
    small = load_head(demo_dir / "head3" / "draft.pth", small_target)
    if not isinstance(small, Eagle3Draft) or small.embed is not None or small.flags != Eagle3Flags():
        raise EagletError(f"{demo_dir / 'head3'}: only an EAGLE-3 head without flags or an embedding of its own, "
                          "as the demo's, can be inflated")
    target_lay = Layout(small_target, target.args)
    b, small_vocab = target.args, small.vocab_size
    draft_vocab_size = draft_vocab_size or min(DRAFT_VOCAB, b.vocab_size)
    if not small_vocab <= draft_vocab_size <= b.vocab_size:
        raise EagletError(f"a draft vocabulary of {draft_vocab_size} cannot hold the demo head's {small_vocab} "
                          f"entries within the target's {b.vocab_size} tokens")
    ids = [target_lay.wide_input(j) - 1 for j in small.feature_layers]  # layer outputs: id k = input of k + 1
    small_config = read_config(demo_dir / "head3")
    config = {**small_config, "hidden_size": b.dim, "num_attention_heads": b.n_head,
              "num_key_value_heads": b.n_local_heads, "head_dim": b.head_dim,
              "intermediate_size": b.intermediate_size, "vocab_size": b.vocab_size,
              "max_position_embeddings": b.max_position_embeddings, "draft_vocab_size": draft_vocab_size,
              "eagle_config": {**(small_config.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": ids}}
    config.pop("rope_scaling", None)
    lay = Layout(small.args, ModelArgs.from_hf_config({"model_type": "llama", **config}))
    config.update({"rope_theta": lay.rope_theta, "rms_norm_eps": lay.eps(small.args.norm_eps)})
    lay.big = ModelArgs.from_hf_config({"model_type": "llama", **config})
    weight = target.tok_embeddings.weight
    head = empty_module(lambda args: Eagle3Draft(args, b.dim, draft_vocab_size, own_embedding=False), lay.big,
                        weight.device, weight.dtype)
    put(head.fc.weight, (slice(lay.small.dim), lay.columns(3)), small.fc.weight)
    head.fc.weight[lay.bias_dim, lay.bias_dim] = 1.0  # the first feature's bias channel: the head's own
    copy_attention(head.layer.attention, small.layer.attention, lay, in_blocks=2)
    copy_mlp(head.layer.feed_forward, small.layer.feed_forward, lay)
    for norm in ("embed_norm", "hidden_norm", "ffn_norm"):
        copy_norm(getattr(head.layer, norm), getattr(small.layer, norm), lay)
    copy_norm(head.norm, small.norm, lay)
    head.norm.weight[lay.bias_dim] = 1 / BIAS  # the padding rows score NEVER x rms-normalised 1, as the target's
    put(head.lm_head.weight, (slice(small_vocab), slice(lay.small.dim)), small.lm_head.weight)
    head.lm_head.weight[small_vocab:, lay.bias_dim] = NEVER
    unused = torch.ones(b.vocab_size, dtype=torch.bool)
    unused[small.draft_to_target] = False
    padding = unused.nonzero()[:draft_vocab_size - small_vocab, 0]  # the lowest target ids the demo's do not use
    head.draft_to_target = torch.cat([small.draft_to_target, padding]).to(weight.device)
    head.feature_layers = eagle3_feature_layers(config, b.n_layer, str(demo_dir / "head3"))
    return head.eval(), config


@torch.no_grad()
def inflate_dflash(demo_dir: Path, target: Transformer):
    """The demo's DFlash head (demo_dir/dflash) for the demo inflated into target; returns (head, its
    config.json). fc reads the wide layers that hold the demo's feature layers and passes one feature's bias
    channel on to the hidden norm; the block's embeddings and the lm_head are the wide target's own."""
    small_target = ModelArgs.from_checkpoint_dir(demo_dir / "target")
    small = load_head(demo_dir / "dflash" / "draft.pth", small_target)
    if not isinstance(small, DFlashDraft) or small.args.qkv_bias or small.args.o_bias or small.args.mlp_bias:
        raise EagletError(f"{demo_dir / 'dflash'}: only a DFlash head without biases, as the demo's, can be inflated")
    b, target_lay = target.args, Layout(small_target, target.args)
    ids = [target_lay.wide_input(j) - 1 for j in small.feature_layers]  # feature j: the output of layer j - 1
    small_config = read_config(demo_dir / "dflash")
    config = {**small_config, "hidden_size": b.dim, "num_attention_heads": b.n_head,
              "num_key_value_heads": b.n_local_heads, "head_dim": b.head_dim,
              "intermediate_size": b.intermediate_size, "vocab_size": b.vocab_size,
              "max_position_embeddings": b.max_position_embeddings, "num_target_layers": b.n_layer,
              "attention_bias": True, "dflash_config": {**small_config["dflash_config"], "target_layer_ids": ids}}
    config.pop("rope_scaling", None)
    lay = Layout(small.args, head_args(config))
    config.update({"rope_theta": lay.rope_theta, "rms_norm_eps": lay.eps(small.args.norm_eps)})
    lay.big = head_args(config)
    weight = target.tok_embeddings.weight
    head = empty_module(lambda args: DFlashDraft(args, len(ids), small.block_size, small.mask_token_id), lay.big,
                        weight.device, weight.dtype)
    put(head.fc.weight, (slice(lay.small.dim), lay.columns(len(ids))), small.fc.weight)
    head.fc.weight[lay.bias_dim, lay.bias_dim] = 1.0  # the first feature's bias channel, for the hidden norm
    copy_norm(head.hidden_norm, small.hidden_norm, lay)
    for layer, small_layer in zip(head.layers, small.layers):
        copy_attention(layer.attention, small_layer.attention, lay, scale_q=False)
        copy_qk_norms(layer.attention, small_layer.attention, lay)
        copy_mlp(layer.feed_forward, small_layer.feed_forward, lay)
        copy_norm(layer.attention_norm, small_layer.attention_norm, lay)
        copy_norm(layer.ffn_norm, small_layer.ffn_norm, lay)
    copy_norm(head.norm, small.norm, lay)
    head.norm.weight[lay.bias_dim] = 1 / BIAS  # the padding rows score NEVER x rms-normalised 1, as the target's
    head.feature_layers = tuple(k + 1 for k in ids)
    return head.eval(), config


def inflate(demo_dir: Path, shape: dict, device="cpu", dtype=torch.float32):
    """(target, head, target config, head config) of the demo in this shape, built on device in dtype."""
    small = load_target(demo_dir / "target" / "model.pth", "cpu", "fp32")
    small_head = load_draft(demo_dir / "head" / "draft.pth", small)
    target, target_config, lay = inflate_target(small, shape, device, dtype)
    head, head_config = inflate_head(small_head, read_config(demo_dir / "head"), lay, device, dtype)
    return target, head, target_config, head_config


def save(out_dir: Path, demo_dir: Path, target, head, target_config, head_config):
    (out_dir / "target").mkdir(parents=True)
    (out_dir / "head").mkdir()
    dtype = str(target.output.weight.dtype).removeprefix("torch.")
    (out_dir / "target" / "config.json").write_text(json.dumps({**target_config, "torch_dtype": dtype}, indent=2))
    (out_dir / "head" / "config.json").write_text(json.dumps({**head_config, "torch_dtype": dtype}, indent=2))
    torch.save(target.state_dict(), out_dir / "target" / "model.pth")
    torch.save(head.state_dict(), out_dir / "head" / "draft.pth")
    shutil.copy(demo_dir / "target" / "tokenizer.model", out_dir / "target" / "tokenizer.model")


def save_head3(out_dir: Path, head, config):
    """OUT_DIR/head3 as eaglet stores an EAGLE-3 head: its weights and d2t (target id = draft id + d2t)."""
    save_extra_head(out_dir, "head3", head, config, {"d2t": head.draft_to_target.cpu() - torch.arange(head.vocab_size)})


def save_extra_head(out_dir: Path, name: str, head, config, extra: Optional[dict] = None):
    """OUT_DIR/name (head3, dflash): its config.json and weights, as eaglet stores a converted head."""
    (out_dir / name).mkdir()
    dtype = str(next(head.parameters()).dtype).removeprefix("torch.")
    (out_dir / name / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
    torch.save({**head.state_dict(), **(extra or {})}, out_dir / name / "draft.pth")


def main(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--shape", choices=list(SHAPES), default="llama2-7b", help="the real model whose shape to take")
    p.add_argument("--out_dir", type=Path, required=True,
                   help="writes OUT_DIR/target, OUT_DIR/head and (if the demo has one) OUT_DIR/head3")
    p.add_argument("--demo_dir", type=Path, default=DEMO_DIR, help="the demo to embed")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if available")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    args = p.parse_args(argv)
    try:
        if args.out_dir.exists():
            raise EagletError(f"--out_dir {args.out_dir} exists; give a new folder (nothing is overwritten)")
        device = pick_device(args.device)
        precision = args.precision or ("bf16" if device == "cuda" else "fp32")
        print(f"embedding {args.demo_dir} in a {args.shape} shape ({precision} on {device})", flush=True)
        parts = inflate(args.demo_dir, SHAPES[args.shape], device, PRECISIONS[precision])
        head3 = inflate_head3(args.demo_dir, parts[0]) if (args.demo_dir / "head3").is_dir() else None
        dflash = inflate_dflash(args.demo_dir, parts[0]) if (args.demo_dir / "dflash").is_dir() else None
        print(f"writing {args.out_dir}", flush=True)
        save(args.out_dir, args.demo_dir, *parts)
        if head3:
            save_head3(args.out_dir, *head3)
        if dflash:
            save_extra_head(args.out_dir, "dflash", *dflash)
    except EagletError as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        sys.exit(f"error: cannot write {args.out_dir}: {e.strerror}")
    print(f"done: --checkpoint_path {args.out_dir / 'target' / 'model.pth'} "
          f"--draft_checkpoint_path {args.out_dir / 'head' / 'draft.pth'}"
          + (f" (EAGLE-3: {args.out_dir / 'head3' / 'draft.pth'})" if head3 else "")
          + (f" (DFlash: {args.out_dir / 'dflash' / 'draft.pth'})" if dflash else ""))


if __name__ == "__main__":
    main()
