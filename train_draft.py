"""Train an EAGLE-1/2, EAGLE-3, DFlash, DSpark, DFlash2 or XPress draft head for a converted target; save it in the
published format.

    python train_draft.py --checkpoint_path checkpoints/org/model/model.pth --data corpus/*.txt \\
        --out_dir checkpoints/org/model-eagle --steps 2000 [--head eagle3 | dflash | dspark]
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/org/model-eagle   # -> draft.pth

Data: plain text files (every token counts), or FastChat question files (.jsonl with "turns"; only the
assistant's tokens count). --self_distill lets the target write the assistant's replies (and continue
plain text), so the head learns what the target itself says, which raises acceptance. The replies are kept in
OUT_DIR/self_distill.jsonl with a record of what wrote them (the target, its tokenizer and chat template, the
data files, --seq_len, --max_new_tokens, greedy decoding, the precision): a rerun with the same ones (a resumed
run, or other training flags) reuses them instead of running the target again, and an interrupted
self-distillation resumes where it stopped (self_distill.partial.jsonl).
EAGLE-1/2 (--head eagle): the head learns the target's next feature (SmoothL1) and its next-token
distribution (0.1 x cross-entropy against the target's soft predictions), from features with small
uniform noise added.
EAGLE-3 (--head eagle3): the head reads the target's hidden states entering layers 2, L//2, L-3 and
learns only the target's next-token distributions over its draft vocabulary (the --draft_vocab_size
tokens most frequent in the data), unrolled --unroll_steps steps on its own outputs as the draft tree
runs it (the "training-time test"), step j's loss weighted step_decay^j.
DFlash (--head dflash): --draft_layers Qwen3 layers read the target's hidden states entering --feature_layers
(default: one per draft layer, spread through the target); each step trains --anchors blocks per sequence at
once, each a random anchor token followed by --block_size - 1 masks that see only the context before the
anchor and their own block, and predict the target's own next tokens, block position k weighted
exp(-(k - 1) / gamma).
DSpark (--head dspark): DFlash's backbone with every block row drafting (the anchor's too: block_size drafts) and
a rank --markov_rank Markov head: row j's logits plus W2(W1[the token before it]), taught with the target's own
tokens before each row; and a confidence head learning whether each draft (the Markov-corrected argmax) is the
target's. Saved in DeepSpec's layout (Qwen3DSparkModel).
XPress (--head xpress): DFlash's head and recipe and a rank --xpress_rank refiner adding to each row's logits a
bias from the token before it, learned teacher-forced (the target's own picks before each row) and over 3 Jacobi
rounds from the block's own picks, beside a term on the block's own logits; saved in speculators' layout.
DFlash2 (--head dflash2): DFlash's head and loss, a causal convolution inside the block around each sublayer
(identity at the start) and a candidate selector learning, by cross-entropy over each draft's --selector_top_k
best tokens (the target's pick put in the last place where it is missing), which of them the target picks after
the token before it. Saved in vLLM speculators' layout (speculators_model_type dflash2).
"""
# (The docstring above is --help's text.) A tool on top: the command line, each head kind's loss and the training
# loop. Imports train_data.py (the data and self-distillation), train_heads.py (a fresh head, resuming, saving),
# generate.py, draft.py, block_draft.py, model.py, tokenizer.py and cli.py; bench.py and scripts/make_demo.py import it.
import math
import sys
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cli import Progress, cli_parser, float_flag, int_flag


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 0.5
    noise: float = 0.1  # uniform noise on the input features, +-noise x their RMS
    ce_weight: float = 0.1
    seed: int = 0
    save_every: int = 200
    unroll_steps: int = 7  # EAGLE-3: steps of the training-time test
    step_decay: float = 0.8  # EAGLE-3: step j's loss weight is step_decay^j
    draft_vocab_size: int = 0  # EAGLE-3: 0 means 32000, or the whole vocabulary if smaller
    block_size: int = 16  # DFlash: tokens per block, the root and block_size - 1 masks
    draft_layers: int = 1  # DFlash: the head's decoder layers
    anchors: int = 32  # DFlash: blocks trained per sequence, each after a random anchor
    gamma: float = 0.0  # DFlash: block position k's loss weighs exp(-(k - 1) / gamma); 0: 7, or block_size / 2 below 16
    mask_token_id: int = -1  # DFlash: the token the masks are embedded as; -1: the last of the target's vocabulary
    markov_rank: int = 256  # DSpark: the Markov head's rank
    confidence_weight: float = 1.0  # DSpark: the confidence head's loss weight
    selector_rank: int = 256  # DFlash2: the candidate selector's rank
    selector_top_k: int = 16  # DFlash2: the drafts per row the selector rescores
    xpress_rank: int = 256  # XPress: the refiner's rank

    def __post_init__(self):
        at_least = {"steps": 1, "batch_size": 1, "seq_len": 2, "save_every": 1, "warmup": 0, "seed": 0,
                    "weight_decay": 0, "noise": 0, "ce_weight": 0, "unroll_steps": 1, "draft_vocab_size": 0,
                    "block_size": 2, "draft_layers": 1, "anchors": 1, "gamma": 0, "mask_token_id": -1, "markov_rank": 1,
                    "confidence_weight": 0, "selector_rank": 1, "selector_top_k": 1,
                    "xpress_rank": 1}
        bad = [f"{k} must be at least {low}" for k, low in at_least.items() if not getattr(self, k) >= low]
        bad += [f"{k} must be above 0" for k in ("lr", "grad_clip", "step_decay")
                if not 0 < getattr(self, k) < math.inf]
        bad += ["unroll_steps must be below seq_len"] if self.unroll_steps >= self.seq_len else []
        if bad or not all(math.isfinite(v) for v in asdict(self).values()):
            raise EagletError(f"training settings out of range: {', '.join(bad) or 'values must be finite'}")


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", type=Path, required=True, help="the target's model.pth (or its folder)")
    p.add_argument("--data", nargs="+", required=True, help="text files and/or FastChat .jsonl question files")
    p.add_argument("--out_dir", type=Path, required=True, help="where the head (and train_state.pt) go")
    p.add_argument("--self_distill", action="store_true", help="the target writes the replies / continuations")
    p.add_argument("--max_new_tokens", type=int_flag(1), default=256, help="reply length for --self_distill")
    p.add_argument("--no_resume", action="store_true", help="start over even if out_dir has a train_state.pt")
    p.add_argument("--chat_template", default="auto",
                   help="how .jsonl conversations are written out: auto (the checkpoint's own, else a built-in one, "
                        "named at start-up), llama2, vicuna, or a .jinja file")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if available")
    p.add_argument("--head", choices=["eagle", "eagle3", "dflash", "dspark", "dflash2", "xpress"], default="eagle",
                   help="EAGLE-1/2, EAGLE-3, DFlash, DSpark, DFlash2 or XPress head")
    p.add_argument("--feature_layers", type=int_flag(1), nargs="+", default=None,
                   help="EAGLE-3 and DFlash (any number): the target layers whose input the head reads "
                        "(EAGLE-3 default: 2, L//2, L-3; L: the last layer's output; DFlash default: one per draft "
                        "layer, spread from the input of layer 2 to that of layer L - 2)")
    helps = {"steps": "optimizer steps", "batch_size": "sequences per step",
             "seq_len": "tokens per sequence: text is cut into pieces this long, conversations truncated",
             "lr": "peak learning rate (AdamW)", "warmup": "steps of linear warm-up; then a cosine decay to 0.1 x lr",
             "weight_decay": "AdamW weight decay", "grad_clip": "gradient norm clipped to this",
             "seed": "seed for the head's initialisation, batch order and noise",
             "noise": "EAGLE-1/2: uniform noise on the input features, +-noise x their RMS",
             "ce_weight": "EAGLE-1/2: weight of the cross-entropy against the target's predictions",
             "save_every": "steps between train_state.pt saves",
             "unroll_steps": "EAGLE-3: steps of the training-time test (the head unrolled on its own outputs)",
             "step_decay": "EAGLE-3: the loss of unrolled step j weighs step_decay^j",
             "draft_vocab_size": "EAGLE-3: the draft vocabulary, the most frequent tokens of the data; "
                                 "0: 32000, or the whole vocabulary if smaller",
             "block_size": "DFlash: tokens per block (the root and block_size - 1 masks); a head decodes with "
                           "blocks of this size or smaller",
             "draft_layers": "DFlash: the head's decoder layers (the published heads have 5)",
             "anchors": "DFlash: blocks trained at once per sequence, each after a random anchor position",
             "gamma": "DFlash: block position k's loss weighs exp(-(k - 1) / gamma); 0: 7 for blocks of 16 or "
                      "more, else block_size / 2 (the paper's 7, 5, 4 for 16, 10, 8)",
             "mask_token_id": "DFlash: the token whose embedding fills the block after the root; -1: the last id "
                              "of the target's vocabulary (use a real model's reserved mask token if it has one)",
             "markov_rank": "DSpark: the rank of the Markov head (W1: vocabulary x rank, W2: rank x vocabulary)",
             "confidence_weight": "DSpark: the confidence head's loss weight (binary cross-entropy)",
             "selector_rank": "DFlash2: the rank of the candidate selector's codebooks",
             "selector_top_k": "DFlash2: the drafts of each row the selector rescores (at most the vocabulary)",
             "xpress_rank": "XPress: the rank of the refiner (its embedding, projections and MLP)"}
    for name, value in asdict(TrainConfig()).items():
        flag = int_flag(0) if isinstance(value, int) else float_flag(0)
        p.add_argument(f"--{name}", type=flag, default=value, help=helps.get(name, name.replace("_", " ")))
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from block_draft import DFlash2Draft, DFlashDraft, DSparkDraft, XPressDraft  # noqa: E402
from draft import DraftHead, Eagle3Draft, EagleDraft  # noqa: E402
from head_formats import dflash_layer_ids, eagle3_feature_layers, head_args  # noqa: E402
from decode import generate  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from load import load_target, pick_device  # noqa: E402
from checkpoint import EagletError, converted_file  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from train_data import (batches, check_distill_files, examples_of, read_items, self_distill_paths,  # noqa: E402
                        self_distill_record, self_distilled_replies, target_replies)
from train_heads import (check_out_dir, draft_vocabulary, eagle3_config, head_settings, llama_head_config,  # noqa: E402
                         new_eagle3_head, new_head, prepare_out_dir, read_train_state, resume_from, save_head,
                         target_shape)
from tokenizer import Tokenizer  # noqa: E402


def causal(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def head_loss(head: EagleDraft, target: Transformer, tokens, mask, cfg: TrainConfig):
    """EAGLE's loss on a batch: pairs (f_t, x_{t+1}) predict f_{t+1} and the target's p(x_{t+2})."""
    seq = tokens.shape[1]
    pos = torch.arange(seq, device=tokens.device)
    with torch.no_grad():
        logits, features = target(tokens, pos, None, causal(seq, tokens.device))
        rms = features.float().pow(2).mean(-1, keepdim=True).sqrt()
        noisy = features[:, :-1] + (torch.rand_like(features[:, :-1]) * 2 - 1) * cfg.noise * rms[:, :-1]
        embeds = target.tok_embeddings(tokens[:, 1:])
    h = head(embeds, noisy, pos[:-1], None, causal(seq - 1, tokens.device))
    feature_loss = F.smooth_l1_loss(h.float(), features[:, 1:].float(), reduction="none").mean(-1)
    target_p = torch.softmax(logits[:, 1:].float(), dim=-1)
    head_logp = torch.log_softmax(target.logits(h).float(), dim=-1)
    ce = -(target_p * head_logp).sum(-1)
    weight = mask[:, 1:] * mask[:, :-1]  # both the input pair and the predicted position are real
    loss = ((feature_loss + cfg.ce_weight * ce) * weight).sum() / weight.sum().clamp(min=1)
    top1 = ((head_logp.argmax(-1) == target_p.argmax(-1)).float() * weight).sum() / weight.sum().clamp(min=1)
    return loss, top1


DEFAULT_DRAFT_VOCAB = 32000


def draft_vocab_size(cfg: TrainConfig, vocab_size: int) -> int:
    """--draft_vocab_size, or 32000 (the whole vocabulary if smaller); more than the target has is refused."""
    if cfg.draft_vocab_size > vocab_size:
        raise EagletError(f"--draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary ({vocab_size})")
    return cfg.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, vocab_size)


class UnrollCache:
    """The head's K/V during the training-time test: each step's appended out of place (autograd sees them
    all); attention reads every step's under the unroll mask. Stands in for model.KVCache's update()."""

    def __init__(self):
        self.k, self.v = [], []

    def update(self, cache_slots, k: torch.Tensor, v: torch.Tensor):
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)


def unroll_mask(n: int, step: int, device) -> torch.Tensor:
    """[n, n * (step + 1)]: at index t, step `step` sees step 0 at indices <= t (the context up to and
    including the tree's root) and steps 1..step at index t only (its ancestors in the tree, and itself)."""
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal(n, device)] + [eye] * step, dim=1)


def unroll(head: Eagle3Draft, target: Transformer, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list:
    """The training-time test: the head's outputs [B, T - 1, dim] at steps 0..steps-1, from tokens [B, T] and
    the target's features [B, T, 3 x dim]. At index t, step 0 reads the pair (f_t, x_{t+1}) at position t,
    as the catch-up does; step j reads (its own step j-1 output, x_{t+j+1}) at position t + j, as the tree
    node j levels below the root x_{t+1} does in build_tree. Tokens past the end read as 0 (their loss is masked)."""
    n, device = tokens.shape[1] - 1, tokens.device
    attention, target_embed = head.layer.attention, head.embed or target.tok_embeddings
    saved, attention.kv_cache = attention.kv_cache, UnrollCache()
    try:
        x, outputs = head.fc(features[:, :-1]), []
        for j in range(steps):
            cos, sin = head.rope(torch.arange(j, n + j, device=device), x.dtype)
            embeds = target_embed(F.pad(tokens[:, j + 1:], (0, j)))
            x = head.layer(embeds, x, cos, sin, None, unroll_mask(n, j, device))
            outputs.append(x)
    finally:
        attention.kv_cache = saved
    return outputs


def eagle3_step_losses(head: Eagle3Draft, target: Transformer, tokens, mask, steps: int):
    """Per unrolled step: the soft cross-entropy against the target's next-token distribution, and top-1 agreement.

    Step j at index t predicts what the target predicts at position t + j + 1. Target tokens outside the
    draft vocabulary are dropped and the target's distribution renormalised over the rest (the head cannot
    propose them, and renormalising keeps the order of the ones it can)."""
    n = tokens.shape[1] - 1
    pos = torch.arange(n + 1, device=tokens.device)
    with torch.no_grad():
        logits, features = target(tokens, pos, None, causal(n + 1, tokens.device))
        target_logp = torch.log_softmax(logits[:, 1:, head.draft_to_target].float(), dim=-1)
    losses, top1 = [], []
    for j, h in enumerate(unroll(head, target, tokens, features, steps)):
        target_p = F.pad(target_logp[:, j:], (0, 0, 0, j)).exp()
        weight = F.pad(mask[:, j + 1:] * mask[:, :n - j], (0, j))  # the root's pair and the predicted position are real
        head_logp = torch.log_softmax(head.logits(target, h).float(), dim=-1)
        ce = -(target_p * head_logp).sum(-1)
        agree = (head_logp.argmax(-1) == target_p.argmax(-1)).float()
        total = weight.sum().clamp(min=1)
        losses.append((ce * weight).sum() / total)
        top1.append((agree * weight).sum() / total)
    return torch.stack(losses), torch.stack(top1)


def eagle3_loss(head: Eagle3Draft, target: Transformer, tokens, mask, cfg: TrainConfig):
    """The training-time test's loss, sum_j step_decay^j x loss_j, and top-1 agreement at every step."""
    losses, top1 = eagle3_step_losses(head, target, tokens, mask, cfg.unroll_steps)
    decay = cfg.step_decay ** torch.arange(cfg.unroll_steps, device=losses.device)
    return (decay * losses).sum(), top1


def dflash_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple) -> dict:
    """A DFlash head's config.json as the published heads write it: Qwen3 keys of the target's shapes, the block
    size, the target's layer count and dflash_config (mask token, target layer ids: id k = the output of layer k)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": args.dim,
            "num_hidden_layers": cfg.draft_layers, "num_attention_heads": args.n_head,
            "num_key_value_heads": args.n_local_heads, "head_dim": args.head_dim,
            "intermediate_size": args.intermediate_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_base,
            "rope_scaling": args.rope_scaling, "max_position_embeddings": args.max_position_embeddings,
            "vocab_size": args.vocab_size, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "float32",
            "block_size": cfg.block_size, "num_target_layers": args.n_layer,
            "dflash_config": {"mask_token_id": dflash_mask_id(cfg, args),
                              "target_layer_ids": [k - 1 for k in feature_layers]}}


def dspark_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple) -> dict:
    """A DSpark head's config.json as DeepSpec writes it: the same Qwen3 keys, DSpark's settings at the top."""
    config = dflash_config(args, cfg, feature_layers)
    dflash = config.pop("dflash_config")
    return config | {"architectures": ["Qwen3DSparkModel"], **dflash, "markov_rank": cfg.markov_rank,
                     "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
                     "num_anchors": cfg.anchors, "tie_word_embeddings": False}


def dflash2_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple) -> dict:
    """A DFlash2 head's config.json as speculators writes it, with the convolution's and selector's settings
    (speculators' default convolution: 2 taps over groups of 16 channels)."""
    return speculators_config(args, cfg, feature_layers, "dflash2", ["DFlash2DraftModel"], conv_kernel_size=2,
                              conv_group_size=math.gcd(16, args.dim), selector_rank=cfg.selector_rank,
                              selector_top_k=cfg.selector_top_k)


def xpress_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple) -> dict:
    """An XPress head's config.json as speculators writes it (its refiner's MLP ratio and Jacobi passes: the
    released heads' 2 and 6)."""
    return speculators_config(args, cfg, feature_layers, "xpress", ["XPressSpeculator"], xpress_rank=cfg.xpress_rank,
                              xpress_mlp_ratio=2, num_jacobi_passes=6)


def speculators_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple, kind: str, architectures: list,
                       **settings) -> dict:
    """A block drafter's config.json as speculators' save_pretrained writes it: the Qwen3 layers' keys nested in
    transformer_layer_config, the target layers as layer inputs, DFlash's layout (sample_from_anchor false)."""
    layer = dflash_config(args, cfg, feature_layers)
    layer = {k: v for k, v in layer.items() if k not in ("architectures", "block_size", "num_target_layers",
                                                         "dflash_config", "torch_dtype")}
    proposal = {"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1, "accept_tolerance": 0.0,
                "verifier_accept_k": 1}
    return {"architectures": architectures, "speculators_model_type": kind,
            "transformer_layer_config": layer, "draft_vocab_size": args.vocab_size, "block_size": cfg.block_size,
            "aux_hidden_state_layer_ids": list(feature_layers), "mask_token_id": dflash_mask_id(cfg, args),
            "sample_from_anchor": False, **settings, "num_target_layers": args.n_layer,
            "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                   "proposal_methods": [proposal], "verifier": {"architectures": ["LlamaForCausalLM"],
                                                                                "name_or_path": None}},
            "tie_word_embeddings": False, "dtype": "float32"}


def dflash_mask_id(cfg: TrainConfig, args: ModelArgs) -> int:
    return cfg.mask_token_id if cfg.mask_token_id >= 0 else args.vocab_size - 1


def dflash_feature_layers(cfg: TrainConfig, n_layer: int, feature_layers=None) -> tuple:
    """--feature_layers (layer inputs), or DFlash's default ids for the head's depth, as layer inputs."""
    layers = tuple(feature_layers) if feature_layers else tuple(k + 1 for k in dflash_layer_ids(n_layer, cfg.draft_layers))
    if not all(1 <= k <= n_layer - 1 for k in layers):
        raise EagletError(f"a DFlash head reads the inputs of layers 1..{n_layer - 1} of a {n_layer}-layer target "
                          f"(layer k's input is layer k - 1's output), not {list(layers)}")
    return layers


def new_dflash_head(target: Transformer, cfg: TrainConfig, config: dict) -> DFlashDraft:
    """A fresh DFlash head, or a DSpark one (config: dspark_config's), its Markov bias starting at zero."""
    device = target.output.weight.device
    torch.manual_seed(cfg.seed)
    args = replace(head_args(config.get("transformer_layer_config", config)), qk_norm=True, qkv_bias=False,
                   o_bias=False, mlp_bias=False)
    settings = config.get("dflash_config", config)
    if "aux_hidden_state_layer_ids" in config:  # speculators' layout: layer inputs
        settings = {**settings, "target_layer_ids": [k - 1 for k in config["aux_hidden_state_layer_ids"]]}
    ids, mask_id = settings["target_layer_ids"], settings["mask_token_id"]
    if "markov_rank" in config:
        head = DSparkDraft(args, len(ids), cfg.block_size, mask_id, cfg.markov_rank)
    elif "xpress_rank" in config:
        head = XPressDraft(args, len(ids), cfg.block_size, mask_id, cfg.xpress_rank, config["xpress_mlp_ratio"],
                           config["num_jacobi_passes"])
    elif "selector_rank" in config:
        head = DFlash2Draft(args, len(ids), cfg.block_size, mask_id, config["conv_kernel_size"],
                            config["conv_group_size"], cfg.selector_rank, cfg.selector_top_k)
    else:
        head = DFlashDraft(args, len(ids), cfg.block_size, mask_id)
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    if isinstance(head, DSparkDraft):  # the bias starts at zero; W1 as an embedding, so that W2 learns from the start
        torch.nn.init.normal_(head.markov_head.markov_w1.weight)
        torch.nn.init.zeros_(head.markov_head.markov_w2.weight)
    if isinstance(head, DFlash2Draft):  # each convolution starts as the identity and the selector's score at zero:
        for conv in [c for layer in head.layers for c in (layer.attention_conv, layer.mlp_conv)]:  # a DFlash head
            conv.base_kernel.data.zero_()[:, 0] = 1
            conv.kernel_projection.weight.data.zero_()
        selector = head.candidate_selector  # codebooks as embeddings, so that the projection learns from the start
        torch.nn.init.normal_(selector.predecessor_codebook)
        torch.nn.init.normal_(selector.successor_codebook)
        torch.nn.init.zeros_(selector.hidden_projection.weight)
    head.feature_layers = tuple(k + 1 for k in ids)
    return head.to(device)


def dflash_anchors(mask: torch.Tensor, n: int):
    """n random anchor positions per row whose next token counts (anchors [B, n]), and which are real
    (a row with fewer such positions repeats some, marked False)."""
    counts = mask[:, 1:] > 0  # anchor a predicts a + 1.. ; its own token is the block's root
    score = torch.rand(counts.shape, device=mask.device) + counts  # counting positions score above 1
    top = score.topk(min(n, counts.shape[1]), dim=-1)
    return top.indices, top.values >= 1


def dflash_blocks(head: DFlashDraft, target: Transformer, tokens, features, anchors) -> torch.Tensor:
    """Every anchor's block at once, as decoding drafts it: [B, A, block_size, dim] outputs of all its rows.
    Block (anchor a) queries see the context strictly before a and their own block only, never another block."""
    bsz, seq = tokens.shape
    n_anchors, size, device = anchors.shape[1], head.block_size, tokens.device
    offsets = torch.arange(size, device=device)
    pos = (anchors[..., None] + offsets).view(bsz, -1)  # [B, A x size]
    roots = tokens.gather(1, anchors)[..., None]
    x = target.tok_embeddings(torch.where(offsets == 0, roots, head.mask_token_id).view(bsz, -1))
    context = head.hidden_norm(head.fc(features))
    ctx_pos = torch.arange(seq, device=device)
    (cos_c, sin_c), (cos_b, sin_b) = head.rope(ctx_pos, x.dtype), head.rope(pos, x.dtype)
    block_of = torch.arange(n_anchors, device=device).repeat_interleave(size)
    sees_context = ctx_pos < anchors.repeat_interleave(size, dim=1)[..., None]  # [B, A x size, seq]
    sees_block = (block_of[:, None] == block_of).expand(bsz, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]
    for layer in head.layers:
        attention = layer.attention
        _, k_c, v_c = attention.project(context, cos_c, sin_c)
        h, conv = block_conv(layer, "attention_conv", layer.attention_norm(x), size)
        q, k_b, v_b = attention.project(conv(h, 0), cos_b, sin_b)
        y = F.scaled_dot_product_attention(q, torch.cat([k_c, k_b], 2), torch.cat([v_c, v_b], 2), attn_mask=mask,
                                           enable_gqa=attention.n_kv != attention.n_head)
        x = x + conv(attention.wo(y.transpose(1, 2).reshape(bsz, pos.shape[1], -1)), 1)
        h, conv = block_conv(layer, "mlp_conv", layer.ffn_norm(x), size)
        x = x + conv(layer.feed_forward(conv(h, 0)), 1)
    return head.norm(x).view(bsz, n_anchors, size, -1)


def block_conv(layer, name: str, h, size: int):
    """A DFlash2 layer's convolution (name) over the blocks of size rows in h [B, A x size, dim], as a function
    of (x, side) with its kernels made from h; the identity for a layer without one (DFlash, DSpark)."""
    conv = getattr(layer, name, None)
    if conv is None:
        return h, lambda x, side: x
    deltas = conv.deltas(h).unflatten(1, (-1, size))
    return h, lambda x, side: conv(x.unflatten(1, (-1, size)), deltas, side).flatten(1, 2)


def dflash_labels(picks, mask, anchors, real, levels: int):
    """For draft j = 0..levels-1 of each anchor a: the target's pick for position a + j + 1 (picks[t]: its next
    token after t, so picks[a + j]) [B, A, levels], and whether it counts (inside the sequence, a real anchor, a
    position the loss counts)."""
    seq = picks.shape[1]
    where = anchors[..., None] + torch.arange(levels, device=picks.device)  # the pick draft j predicts
    inside = (where + 1 < seq) & real[..., None]
    where = where.clamp(max=seq - 2)
    want = picks.gather(1, where.flatten(1)).view_as(where)
    return want, inside & (mask.gather(1, (where + 1).flatten(1)).view_as(where) > 0)


def dflash_loss(head: DFlashDraft, target: Transformer, tokens, mask, cfg: TrainConfig):
    """Cross-entropy of each draft j = 0.. (DFlash: block position j + 1; DSpark: row j) against the target's own
    pick for position a + j + 1, weighted exp(-j / gamma): the early drafts decide how much of a block is accepted.
    A DSpark head's logits carry the Markov bias of the token before each draft (the anchor, then the target's own
    picks: what an accepted prefix holds), and its confidence head learns, by binary cross-entropy with the same
    weights, whether each draft is the target's pick. Returns the loss and the top-1 agreement at each draft."""
    seq, levels = tokens.shape[1], head.max_levels
    pos = torch.arange(seq, device=tokens.device)
    with torch.no_grad():
        logits, features = target(tokens, pos, None, causal(seq, tokens.device))
        picks = logits.argmax(-1)  # picks[t]: the target's next token after position t
    anchors, real = dflash_anchors(mask, cfg.anchors)
    rows = dflash_blocks(head, target, tokens, features, anchors)
    h = rows[:, :, head.first_row:]  # the drafting rows
    want, counts = dflash_labels(picks, mask, anchors, real, levels)
    gamma = cfg.gamma or (7.0 if cfg.block_size >= 16 else cfg.block_size / 2)
    weight = torch.exp(-torch.arange(levels, device=tokens.device) / gamma) * counts
    head_logits = head.logits(target, h).float()
    prev = torch.cat([tokens.gather(1, anchors)[..., None], want[..., :-1]], dim=-1)  # [B, A, levels]: before each
    if isinstance(head, DSparkDraft):
        head_logits = head.next_logits(head_logits, prev, h).float()
    rounds = []
    if isinstance(head, XPressDraft):  # the teacher-forced refined logits; Jacobi rounds and the block's own beside
        before = torch.where(anchors > 0, tokens.gather(1, (anchors - 1).clamp(min=0)), tokens.gather(1, anchors))
        head_logits, rounds = xpress_logits(head, target, rows, before, prev, want)
    ce = F.cross_entropy(head_logits.flatten(0, 2), want.flatten(), reduction="none").view_as(weight)
    hit = head_logits.argmax(-1) == want
    loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
    for logits, share in rounds:
        ce = F.cross_entropy(logits.flatten(0, 2), want.flatten(), reduction="none").view_as(weight)
        loss, hit = loss + share * (ce * weight).sum() / weight.sum().clamp(min=1e-6), logits.argmax(-1) == want
    if isinstance(head, DFlash2Draft):
        selector_ce, hit = selector_loss(head, head_logits, prev, h, want)
        loss = loss + (selector_ce * weight).sum() / weight.sum().clamp(min=1e-6)
    if isinstance(head, DSparkDraft):
        confidence = head.confidence_head.proj(torch.cat([h, head.markov_head.markov_w1(prev)], -1))[..., 0].float()
        bce = F.binary_cross_entropy_with_logits(confidence, hit.float(), reduction="none")
        loss = loss + cfg.confidence_weight * (bce * weight).sum() / weight.sum().clamp(min=1e-6)
    agree = (hit & counts).float().sum((0, 1))
    return loss, agree / counts.float().sum((0, 1)).clamp(min=1)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def xpress_logits(head: XPressDraft, target: Transformer, rows, before, prev, want, passes: int = 3):
    """XPress's refined logits of the drafting rows, teacher-forced: the token before each row the target's own
    (before: the token before the anchor, or the anchor itself at position 0; prev: the anchor, then the target's
    picks). Also what a loss weighs beside them, as speculators trains (its defaults): the block's own logits
    (x 0.6) and the last of `passes` Jacobi rounds from the block's own picks, each after the previous round's
    picks, no gradient between rounds (x 0.3, the rounds decoding runs)."""
    first, size = head.first_row, rows.shape[-2]
    base = head.logits(target, rows).float()  # [B, A, size, vocab]: all rows
    states = head.refiner_head.states(rows)
    teacher = torch.cat([before[..., None], prev], -1)[..., 1 - first:][..., :size]  # the token before each row
    refined = base + head.refiner_head(teacher, states)
    picks = head.to_target(base.detach().argmax(-1))
    for _ in range(passes):
        jacobi = base + head.refiner_head(torch.cat([teacher[..., :1 + first], picks[..., first:-1]], -1), states)
        picks = head.to_target(jacobi.detach().argmax(-1))
    return refined[..., first:, :], [(base[..., first:, :], 0.6)] + ([(jacobi[..., first:, :], 0.3)] if passes else [])


def selector_loss(head: DFlash2Draft, logits, prev, h, want):
    """DFlash2's selector loss: cross-entropy over each draft's top_k tokens by the head's own logits (the ones it
    rescores when decoding), the target's pick put in the last place where it is missing, scored after the token
    before the draft. Returns it per draft, and whether the selector's pick among the drafts is the target's."""
    candidates = logits.detach().topk(head.candidate_selector.top_k, dim=-1).indices
    found = candidates == want[..., None]
    candidates[..., -1] = torch.where(found.any(-1), candidates[..., -1], want)
    label = (candidates == want[..., None]).float().argmax(-1)
    scores = head.candidate_selector.score(logits, prev, h, candidates).float()
    ce = F.cross_entropy(scores.flatten(0, -2), label.flatten(), reduction="none").view_as(want)
    return ce, (scores.argmax(-1) == label) & found.any(-1)


def make_head(kind: str, target: Transformer, examples: list, cfg: TrainConfig, feature_layers=None):
    """A fresh head of this kind ("eagle", "eagle3", "dflash" or "dspark") for the target, the loss it trains with,
    its config.json."""
    if kind == "eagle":
        config = {**llama_head_config(target.args), "bias": True}
        return new_head(target.args, target.output.weight.device, cfg.seed), head_loss, config
    if kind in ("dflash", "dspark", "dflash2", "xpress"):
        layers = dflash_feature_layers(cfg, target.args.n_layer, feature_layers)
        writer = {"dspark": dspark_config, "dflash2": dflash2_config, "xpress": xpress_config}.get(kind, dflash_config)
        config = writer(target.args, cfg, layers)
        return new_dflash_head(target, cfg, config), dflash_loss, config
    size = draft_vocab_size(cfg, target.args.vocab_size)
    config = eagle3_config(target.args, size, feature_layers)
    draft_ids = draft_vocabulary(examples, target.args.vocab_size, size)
    return new_eagle3_head(target, draft_ids, config, cfg.seed), eagle3_loss, config


def train(target: Transformer, examples: list, out_dir: Path, cfg: TrainConfig, resume: bool = True,
          log=print, kind: str = "eagle", feature_layers=None) -> DraftHead:
    """Train (or resume) a head of this kind ("eagle" or "eagle3"); returns it and writes
    out_dir/{config.json, model.safetensors}. feature_layers: EAGLE-3's, if not 2, L//2, L-3."""
    device = target.output.weight.device
    check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    head, loss_fn, config = make_head(kind, target, examples, cfg, feature_layers)
    target.set_feature_layers(head.feature_layers)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state_path, start = out_dir / "train_state.pt", 0
    if resume and state_path.is_file():
        start = resume_from(state_path, head, optimizer, target)
        log(f"resuming at step {start}")
    if len(examples) < cfg.batch_size:
        log(f"{len(examples)} examples, fewer than batch_size {cfg.batch_size}: each batch holds all of them")
    target.setup_rope(cfg.seq_len)
    head.setup_rope(cfg.seq_len + max(cfg.unroll_steps, cfg.block_size))  # EAGLE-3's step j runs j positions ahead
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    data = batches(examples, cfg.batch_size, cfg.seq_len, pad_id=0, seed=cfg.seed + start)
    with Progress("training", cfg.steps, "steps", start=start, log=log) as progress:
        recent = deque(maxlen=RECENT_STEPS)  # (loss, top-1) of the last steps, on the device: no sync until printed
        for step in range(start, cfg.steps):
            tokens, mask = (t.to(device) for t in next(data))
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            with autocast:
                loss, top1 = loss_fn(head, target, tokens, mask, cfg)
            if not torch.isfinite(loss):  # one sync a step; a NaN head must never be saved
                raise EagletError(f"the loss became {loss.item()} at step {step + 1}: training diverged "
                                  f"(a smaller --lr or --noise may help); nothing was saved at this step")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
            optimizer.step()
            recent.append((loss.detach(), top1.detach()))
            progress.update(step + 1, lambda: recent_means(recent, "drafts" if kind in BLOCK_HEADS else
                                                           "unrolled steps"))
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                            "config": asdict(cfg), "target": target_shape(target), "kind": head_settings(head)},
                           state_path)
    save_head(head, config, out_dir, target)
    return head


RECENT_STEPS = 50  # the progress line's loss and top-1 agreement: means over this many steps, not one batch's


def recent_means(recent, steps: str = "unrolled steps") -> str:
    """The loss and top-1 agreement (the share of positions where the head's most likely token is the
    target's; EAGLE-3: one per unrolled step, DFlash: per block position) of the last steps, averaged, and
    labelled with how many."""
    loss = torch.stack([loss for loss, _ in recent]).float().mean().item()
    top1 = torch.stack([top1.view(-1) for _, top1 in recent]).float().mean(0).tolist()
    label = "top-1 agreement" if len(top1) == 1 else f"top-1 agreement at {steps} 1-{len(top1)}"
    over = f"means of the last {len(recent)} steps" if len(recent) > 1 else "this step's batch"
    return f"loss {loss:.4f}, {label} {' '.join(f'{a:.3f}' for a in top1)} ({over})"


def main(argv=None):
    args = parse_args(argv)
    made_out_dir = False
    try:
        cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
        args.checkpoint_path = converted_file(args.checkpoint_path, "model.pth")  # the file, or its folder
        check_out_dir(args.out_dir)
        if args.out_dir.resolve() == args.checkpoint_path.resolve().parent:
            raise EagletError(f"--out_dir {args.out_dir} is the target's own folder: the head would overwrite it")
        made_out_dir = not args.out_dir.exists()
        prepare_out_dir(args.out_dir)
        if args.self_distill:
            check_distill_files(args.out_dir)
        device = pick_device(args.device)
        precision = "bf16" if device == "cuda" else "fp32"  # weights for the target; training runs in autocast
        target = load_target(args.checkpoint_path, device, precision if args.self_distill else "fp32")
        check_lengths(target, cfg, args.max_new_tokens if args.self_distill else 0)
        check_head_flags(args, cfg, target)
        if not args.no_resume and (args.out_dir / "train_state.pt").is_file():  # before self-distilling
            done = read_train_state(args.out_dir / "train_state.pt", target, args.head)["step"]
            saved = (args.out_dir / "model.safetensors").is_file()  # (a run stopped at its last save: not yet)
            if done > cfg.steps or done == cfg.steps and saved:  # nothing to train: the head would be saved as is
                raise EagletError(f"{args.out_dir / 'train_state.pt'} has trained {done} steps, and --steps asks for "
                                  f"{cfg.steps}: give more --steps to go on, --no_resume to start over, or another "
                                  "--out_dir")
        tokenizer = Tokenizer(args.checkpoint_path.parent, args.chat_template)
        if any(str(path).endswith(".jsonl") for path in args.data):
            print(f"chat template: {tokenizer.chat_template_source}")
        items, replies = read_items(args.data, tokenizer, cfg.seq_len), None
        if args.self_distill:
            target.setup_caches(1, cfg.seq_len + args.max_new_tokens + 8)
            sampling = SamplingConfig()  # greedy: the target's most likely replies
            reply_fn = lambda prompt: tokenizer.decode(generate(  # noqa: E731
                target, prompt[-cfg.seq_len:], args.max_new_tokens, sampling, tokenizer.eos_ids).tokens)
            record = self_distill_record(args.checkpoint_path, args.data, tokenizer, cfg.seq_len, args.max_new_tokens,
                                         sampling, precision, device)
            replies = self_distilled_replies(items, args.out_dir, record,
                                             lambda item: target_replies(item, tokenizer, reply_fn),
                                             paths=self_distill_paths(args.checkpoint_path, args.data, tokenizer))
        examples = examples_of(items, tokenizer, cfg.seq_len, replies)
        for layer in target.layers:  # training runs whole sequences without a cache
            layer.attention.kv_cache = None
        print(f"{len(examples)} examples; training {cfg.steps} steps on {device}")
        train(target, examples, args.out_dir, cfg, resume=not args.no_resume, kind=args.head,
              feature_layers=args.feature_layers)
    except EagletError as e:
        if made_out_dir and args.out_dir.is_dir() and not any(args.out_dir.iterdir()):
            args.out_dir.rmdir()  # made for this run, which wrote nothing into it
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    print(f"wrote {args.out_dir / 'model.safetensors'}; convert it with "
          f"python convert_hf_checkpoint.py --checkpoint_dir {args.out_dir}")


def check_head_flags(args, cfg: TrainConfig, target: Transformer):
    """The EAGLE-3 settings against the target, before any long work (self-distillation)."""
    twice = sorted({i for i in args.feature_layers or [] if args.feature_layers.count(i) > 1})
    if twice:
        raise EagletError(f"--feature_layers names layer {twice[0]} twice: each layer's features are read once")
    dflash = [f"--{k}" for k, v in asdict(cfg).items() if k in DFLASH_FLAGS and v != getattr(TrainConfig, k)]
    if dflash and args.head not in BLOCK_HEADS:
        raise EagletError(f"{dflash[0]} is for block drafters (--head {', '.join(BLOCK_HEADS)})")
    for kind, name, flags in (("dspark", "DSpark", DSPARK_FLAGS), ("dflash2", "DFlash2", DFLASH2_FLAGS),
                              ("xpress", "XPress", XPRESS_FLAGS)):
        given = [f"--{k}" for k, v in asdict(cfg).items() if k in flags and v != getattr(TrainConfig, k)]
        if given and args.head != kind:
            raise EagletError(f"{given[0]} is for {name} heads (--head {kind})")
    if args.head == "eagle":
        if args.feature_layers or cfg.draft_vocab_size:
            raise EagletError("--feature_layers and --draft_vocab_size are for EAGLE-3 heads (--head eagle3)")
        return
    if args.head in BLOCK_HEADS:
        if args.head == "dflash2" and cfg.selector_top_k > target.args.vocab_size:
            raise EagletError(f"--selector_top_k {cfg.selector_top_k} is more than the target's vocabulary "
                              f"({target.args.vocab_size})")
        if cfg.draft_vocab_size:
            raise EagletError("--draft_vocab_size is for EAGLE-3 heads: a block drafter scores the whole "
                              "vocabulary")
        dflash_feature_layers(cfg, target.args.n_layer, args.feature_layers)
        mask_id = dflash_mask_id(cfg, target.args)
        if mask_id >= target.args.vocab_size:
            raise EagletError(f"--mask_token_id {mask_id} is not below the target's vocabulary ({target.args.vocab_size})")
        if not target.tok_embeddings.weight[mask_id].any():
            raise EagletError(f"the mask token {mask_id} has an all-zero embedding: every mask would look alike to "
                              "the head; give another --mask_token_id")
        return
    draft_vocab_size(cfg, target.args.vocab_size)
    where = "--feature_layers" if args.feature_layers else "an EAGLE-3 head by default (layers 2, L//2, L-3)"
    eagle3_feature_layers(eagle3_config(target.args, 1, args.feature_layers), target.args.n_layer, where)


DFLASH_FLAGS = ("block_size", "draft_layers", "anchors", "gamma", "mask_token_id")
DSPARK_FLAGS = ("markov_rank", "confidence_weight")
DFLASH2_FLAGS = ("selector_rank", "selector_top_k")
XPRESS_FLAGS = ("xpress_rank",)
BLOCK_HEADS = ("dflash", "dspark", "dflash2", "xpress")


def check_lengths(target: Transformer, cfg: TrainConfig, max_new_tokens: int):
    """Sequences (and, self-distilling, the cache for seq_len + max_new_tokens) within the model's positions."""
    need, limit = cfg.seq_len + (max_new_tokens + 8 if max_new_tokens else 0), target.args.max_position_embeddings
    if need > limit:
        parts = f"seq_len ({cfg.seq_len}) + max_new_tokens ({max_new_tokens}) + 8 = {need}" if max_new_tokens \
            else f"seq_len ({cfg.seq_len})"
        raise EagletError(f"{parts} exceeds the model's max_position_embeddings ({limit})")


if __name__ == "__main__":
    main()
