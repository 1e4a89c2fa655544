"""Draft heads (EAGLE-1/2 and EAGLE-3) and the EAGLE-2 dynamic draft tree.

EAGLE-1/2: one LLaMA decoder layer without its input norm, fed fc(cat(embed(x_{t+1}), f_t)), where f_t is
the target's last hidden state (after its final norm). Its output h_t goes to the TARGET's lm_head and
doubles as the estimate of f_{t+1}. It shares the target's embedding and lm_head.

EAGLE-3: the target's hidden states entering three of its layers, fused by fc (3 x dim -> dim); one layer
whose attention reads cat(norm(embed(x_{t+1})), norm(x)); its own norm and lm_head over a smaller draft
vocabulary, mapped to target ids by d2t. During tree expansion a node's input x is its parent's output.
"""
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from model import (Attention, EagletError, FeedForward, Int8Linear, KVCache, ModelArgs, RMSNorm, RotaryTable,
                   Transformer, TransformerBlock, attention_mask, load_state_dict, mismatch_detail, pack_quantized,
                   pop_quantization, read_config, use_quantized_linears)


class DraftHead(nn.Module):
    """What the speculative cycle asks of a head, whatever its kind:
    feature_layers: the target layers whose input the head reads (() = the target's final-normed hidden state);
    step(): its outputs for tokens paired with target features (catch-up) or with its own outputs (the tree);
    topk(): its k best next tokens, as log-probabilities and TARGET token ids;
    default_depth: the tree depth its authors decode with."""
    default_depth = 6

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.rope = None
        self.max_seq_length = 0
        self.feature_layers: tuple = ()
        self.register_buffer("draft_to_target", None, persistent=False)  # [draft vocab] target ids; None: all

    @property
    def vocab_size(self) -> int:
        """Candidates the head can propose."""
        return len(self.draft_to_target) if self.draft_to_target is not None else self.args.vocab_size

    def setup_rope(self, max_seq_length: int):
        """RoPE tables only: enough for training (cache_slots=None, a [T, T] mask)."""
        self.rope = RotaryTable(self.args.head_dim, self.args.rope_base, self.args.rope_scaling,
                                max_seq_length, self.layer.ffn_norm.weight.device)

    def setup_caches(self, max_seq_length: int):
        weight = self.layer.ffn_norm.weight  # float in every format (fc may be int8): the activations' dtype
        self.max_seq_length = max_seq_length
        self.layer.attention.kv_cache = KVCache(1, max_seq_length, self.args.n_local_heads, self.args.head_dim,
                                                weight.dtype).to(weight.device)
        self.setup_rope(max_seq_length)

    def topk(self, target: Transformer, h: Tensor, k: int):
        logp, ids = torch.log_softmax(self.logits(target, h).float(), dim=-1).topk(k, dim=-1)
        return logp, ids if self.draft_to_target is None else self.draft_to_target[ids]


class EagleDraft(DraftHead):
    def __init__(self, args: ModelArgs, fc_bias: bool = True):
        super().__init__(args)
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=fc_bias)
        self.layer = TransformerBlock(args, input_norm=False)
        self.vocab_lm_head = None  # a Linear of some rows of the target's lm_head (a draft vocabulary)

    def forward(self, embeds: Tensor, features: Tensor, input_pos: Tensor, cache_slots: Tensor, mask: Tensor):
        """embeds = target embedding of x_{t+1} [1, T, dim], features = f_t [1, T, dim] -> h_t [1, T, dim]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rope(input_pos, x.dtype)
        return self.layer(x, cos, sin, cache_slots, mask)

    def step(self, target: Transformer, tokens, inputs, input_pos, slots, mask) -> Tensor:
        return self(target.tok_embeddings(tokens)[None], inputs[None], input_pos, slots, mask)[0]

    def logits(self, target: Transformer, h: Tensor) -> Tensor:
        return self.lm_head_module(target)(h)

    def lm_head_module(self, target: Transformer) -> nn.Module:
        return target.output if self.vocab_lm_head is None else self.vocab_lm_head

    def restrict_vocab(self, target: Transformer, token_ids: Tensor):
        """Score only these target tokens (FR-Spec): the lm_head read per draft pass shrinks with them.
        Its rows stay in the lm_head's format (an int8 lm_head gives int8 rows)."""
        self.draft_to_target = token_ids.to(target.tok_embeddings.weight.device)
        self.vocab_lm_head = linear_rows(target.output, self.draft_to_target)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads cat(embed_norm(embedding), hidden_norm(x)), 2 x dim wide."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_norm = RMSNorm(args.dim, args.norm_eps)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, in_dim=2 * args.dim)
        self.feed_forward = FeedForward(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, embeds, x, cos, sin, cache_slots, mask):
        attn_in = torch.cat([self.embed_norm(embeds), self.hidden_norm(x)], dim=-1)
        h = x + self.attention(attn_in, cos, sin, cache_slots, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Eagle3Draft(DraftHead):
    default_depth = 7

    def __init__(self, args: ModelArgs, target_dim: int, draft_vocab_size: int, own_embedding: bool):
        super().__init__(args)
        self.fc = nn.Linear(3 * target_dim, args.dim, bias=False)
        self.layer = Eagle3Layer(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, draft_vocab_size, bias=False)
        self.embed = nn.Embedding(args.vocab_size, args.dim) if own_embedding else None

    def step(self, target: Transformer, tokens, inputs, input_pos, slots, mask) -> Tensor:
        """inputs: target features (3 x target dim, fused by fc) or the head's own earlier outputs (used as is)."""
        embeds = (self.embed or target.tok_embeddings)(tokens)
        x = inputs if inputs.shape[-1] == self.args.dim else self.fc(inputs)
        cos, sin = self.rope(input_pos, x.dtype)
        return self.layer(embeds[None], x[None], cos, sin, slots, mask)[0]

    def logits(self, target: Transformer, h: Tensor) -> Tensor:
        return self.lm_head(self.norm(h))

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


def load_head(checkpoint_path, target: ModelArgs, device="cpu", dtype=torch.float32) -> DraftHead:
    """An EAGLE-1/2 or EAGLE-3 head converted by convert_hf_checkpoint.py (or quantized by quantize.py),
    checked against its target."""
    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise EagletError(f"draft checkpoint not found: {checkpoint_path} "
                          "(run convert_hf_checkpoint.py --checkpoint_dir on the head's folder first)")
    config = read_config(checkpoint_path.parent)  # the head's shape is in it
    state_dict = load_state_dict(checkpoint_path)
    pop_quantization(state_dict, checkpoint_path)  # its Linears are told by their keys (assign_weights)
    args = head_args(config)
    if head_kind(config, state_dict, str(checkpoint_path)) == "eagle3":
        model = eagle3_from_state_dict(config, args, state_dict, target, str(checkpoint_path))
    else:
        if args.dim != target.dim or config.get("vocab_size", target.vocab_size) != target.vocab_size:
            raise EagletError(f"draft head {checkpoint_path} does not match the target: hidden size {args.dim} "
                              f"vs {target.dim}, vocabulary {config.get('vocab_size')} vs {target.vocab_size}")
        with torch.device("meta"):
            model = EagleDraft(args, fc_bias="fc.bias" in state_dict)
        assign_weights(model, state_dict, str(checkpoint_path))
    model = model.to(device=device, dtype=dtype).eval()
    pack_quantized(model)
    return model


def assign_weights(model: nn.Module, state_dict: dict, where: str):
    with torch.device("meta"):
        use_quantized_linears(model, state_dict)
    try:
        model.load_state_dict(state_dict, assign=True)
    except RuntimeError as e:
        raise EagletError(f"{where} does not match its config.json: {mismatch_detail(e)}")


def eagle3_from_state_dict(config: dict, args: ModelArgs, state_dict: dict, target: ModelArgs,
                           where: str) -> Eagle3Draft:
    target_dim = config.get("target_hidden_size") or args.dim
    own_embedding = "embed.weight" in state_dict
    if target_dim != target.dim or (args.dim != target.dim and not own_embedding):
        raise EagletError(f"EAGLE-3 head {where} is for a target of hidden size {target_dim}, this target has "
                          f"{target.dim}")
    if args.vocab_size != target.vocab_size:
        raise EagletError(f"EAGLE-3 head {where} is for a vocabulary of {args.vocab_size}, the target has "
                          f"{target.vocab_size}")
    d2t = state_dict.pop("d2t").long()
    draft_vocab = state_dict["lm_head.weight"].shape[0]
    if d2t.shape != (draft_vocab,):
        raise EagletError(f"{where}: d2t has {tuple(d2t.shape)} entries but lm_head has {draft_vocab} rows")
    draft_to_target = torch.arange(draft_vocab) + d2t
    if draft_to_target.min() < 0 or draft_to_target.max() >= target.vocab_size or \
            draft_to_target.unique().numel() != draft_vocab:
        raise EagletError(f"{where}: d2t maps the draft vocabulary outside the target's {target.vocab_size} "
                          "tokens, or maps two draft tokens to one")
    with torch.device("meta"):
        model = Eagle3Draft(args, target_dim, draft_vocab, own_embedding)
    assign_weights(model, state_dict, where)
    model.draft_to_target = draft_to_target
    model.feature_layers = eagle3_feature_layers(config, target.n_layer, where)
    return model


def eagle3_feature_layers(config: dict, n_layer: int, where: str) -> tuple:
    """The target layers whose input the head reads: 2, L//2, L-3, or the configured ones (an id k in
    eagle_aux_hidden_state_layer_ids names the OUTPUT of layer k, the input of layer k + 1)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(k + 1 for k in ids) if ids else (2, n_layer // 2, n_layer - 3)
    if len(layers) != 3 or not all(0 <= i <= n_layer for i in layers):
        raise EagletError(f"{where} reads the target's layers {list(layers)}, which a {n_layer}-layer target "
                          "does not have three of")
    return layers


def head_args(config: dict) -> ModelArgs:
    args = ModelArgs.from_hf_config({"model_type": "llama", **config})
    args.qkv_bias = bool(config.get("qkv_bias", args.qkv_bias))
    return args


def head_kind(config: dict, keys, where: str) -> str:
    """'eagle' or 'eagle3', told apart by their keys (both configs look like a one-layer LLaMA); or an error."""
    if "fc.weight" not in keys or config.get("num_hidden_layers", 1) != 1:
        raise EagletError(f"{where} is neither an EAGLE-1/2 nor an EAGLE-3 draft head "
                          "(expected fc.weight and num_hidden_layers 1)")
    if "d2t" in keys or any(k.startswith(("midlayer.", "layer.hidden_norm")) for k in keys):
        return "eagle3"
    return "eagle"


def read_draft_vocab(path, vocab_size: int) -> Tensor:
    """A draft vocabulary file written by scripts/draft_vocab.py: {"token_ids": [...]}, most frequent first."""
    path = Path(path)
    try:
        token_ids = json.loads(path.read_text())["token_ids"]
        token_ids = torch.tensor(token_ids, dtype=torch.long)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EagletError(f"cannot read the draft vocabulary {path}: {e}")
    if token_ids.ndim != 1 or len(token_ids) == 0 or token_ids.min() < 0 or token_ids.max() >= vocab_size \
            or token_ids.unique().numel() != len(token_ids):
        raise EagletError(f"{path}: token_ids must be distinct ids below the target's vocabulary ({vocab_size})")
    return token_ids


@dataclass
class DraftTree:
    """total_tokens tree nodes, the root (the last emitted token) first, parents before children."""
    tokens: Tensor  # [N] int64
    parents: Tensor  # [N] tree index of the parent; the root points to itself
    depths: Tensor  # [N] 0 for the root
    ancestors: Tensor  # [N, N] bool: ancestors[i, j] = j is i or an ancestor of i
    draft_logp: Tensor  # [N] the draft's log-probability of each node given its parent (0 for the root)


def build_tree(step, topk_fn, h_last: Tensor, root: Tensor, ctx_len: Tensor, topk: int, depth: int,
               total_tokens: int, max_seq_length: int) -> DraftTree:
    """EAGLE-2's dynamic tree with fixed shapes and no loop over nodes: expand the topk best nodes of each
    level topk ways (depth draft passes), then keep the total_tokens - 1 best of all candidates by cumulative
    draft log-probability (a node's score is its whole path's).

    step(tokens [k], features [k, dim], input_pos [k], slots [k], mask [k, S]) -> draft outputs [k, dim];
    topk_fn(h [..., dim], k) -> the k best draft log-probabilities and their token ids [..., k]. Level i of the frontier sits at position
    ctx_len + i and is written to draft slots ctx_len + i * topk + j.
    """
    device = h_last.device
    scores, tokens = topk_fn(h_last, topk)
    features = h_last.expand(topk, -1)
    frontier = torch.arange(topk, device=device)  # pool indices of the frontier
    width = depth * topk  # draft scratch slots
    anc = torch.zeros(topk, width, dtype=torch.bool, device=device)  # frontier's ancestors-and-self slots
    pool_tokens, pool_scores, pool_logp = [tokens], [scores], [scores]
    pool_parents = [torch.full((topk,), -1, device=device)]
    for i in range(depth):
        slots = torch.arange(i * topk, (i + 1) * topk, device=device)
        anc[:, slots] |= torch.eye(topk, dtype=torch.bool, device=device)
        h = step(tokens, features, (ctx_len + i).expand(topk), ctx_len + slots,
                 attention_mask(ctx_len, anc, max_seq_length))
        child_logp, child_tokens = topk_fn(h, topk)  # [k, k]
        child_scores = (scores[:, None] + child_logp).flatten()
        base = topk + i * topk * topk
        pool_tokens.append(child_tokens.flatten())
        pool_scores.append(child_scores)
        pool_logp.append(child_logp.flatten())
        pool_parents.append(frontier.repeat_interleave(topk))
        scores, best = child_scores.topk(topk)
        parent = best // topk
        tokens, features, anc = child_tokens.flatten()[best], h[parent], anc[parent]
        frontier = base + best
    pool_scores = torch.cat(pool_scores)
    return layout_tree(choose_nodes(pool_scores, total_tokens), torch.cat(pool_tokens), torch.cat(pool_logp),
                       torch.cat(pool_parents), root, depth + 1)


def choose_nodes(pool_scores: Tensor, total_tokens: int) -> Tensor:
    """EAGLE-2's rerank: the pool indices of the total_tokens - 1 best nodes by cumulative score, in pool order.

    The pool is in level order, so parents come before children; a child never scores above its parent,
    and a stable sort breaks ties by pool order, so the kept set is a tree (every parent kept too)."""
    return torch.sort(pool_scores, descending=True, stable=True).indices[:total_tokens - 1].sort().values


def layout_tree(kept: Tensor, pool_tokens, pool_logp, pool_parents, root, levels: int) -> DraftTree:
    """The kept pool nodes as a DraftTree, the root in front and parents before children. pool_parents holds
    pool indices (-1 for the first level: the root); levels bounds the depth below the root."""
    device = pool_tokens.device
    n = kept.shape[0] + 1
    tree_index = torch.zeros(pool_tokens.shape[0] + 1, dtype=torch.long, device=device)  # pool -> tree index
    tree_index[kept] = torch.arange(1, n, device=device)
    parents = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree_index[pool_parents[kept]]])
    # pool_parents is -1 at level 0, which reads tree_index[-1] = 0: the root.
    ancestors = torch.eye(n, dtype=torch.bool, device=device)
    for _ in range(levels):  # each pass adds one more generation of ancestors
        ancestors = ancestors | ancestors[parents]
    depths = ancestors.sum(dim=1) - 1
    tokens = torch.cat([root.view(1), pool_tokens[kept]])
    draft_logp = torch.cat([torch.zeros(1, device=device), pool_logp[kept].float()])
    return DraftTree(tokens, parents, depths, ancestors, draft_logp)
