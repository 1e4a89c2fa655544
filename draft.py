"""The EAGLE-1/2 draft head and the EAGLE-2 dynamic draft tree.

The head is one LLaMA decoder layer without its input norm, fed fc(cat(embed(x_{t+1}), f_t)), where f_t
is the target's last hidden state (after its final norm). Its output h_t goes to the TARGET's lm_head
and doubles as the estimate of f_{t+1}. It shares the target's embedding and lm_head.
"""
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from model import (EagletError, KVCache, ModelArgs, RotaryTable, TransformerBlock, attention_mask, load_state_dict,
                   mismatch_detail, read_config)


class EagleDraft(nn.Module):
    def __init__(self, args: ModelArgs, fc_bias: bool = True):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=fc_bias)
        self.layer = TransformerBlock(args, input_norm=False)
        self.rope = None
        self.max_seq_length = 0

    def setup_rope(self, max_seq_length: int):
        """RoPE tables only: enough for training (cache_slots=None, a [T, T] mask)."""
        self.rope = RotaryTable(self.args.head_dim, self.args.rope_base, self.args.rope_scaling,
                                max_seq_length, self.fc.weight.device)

    def setup_caches(self, max_seq_length: int):
        weight = self.fc.weight
        self.max_seq_length = max_seq_length
        self.layer.attention.kv_cache = KVCache(1, max_seq_length, self.args.n_local_heads, self.args.head_dim,
                                                weight.dtype).to(weight.device)
        self.setup_rope(max_seq_length)

    def forward(self, embeds: Tensor, features: Tensor, input_pos: Tensor, cache_slots: Tensor, mask: Tensor):
        """embeds = target embedding of x_{t+1} [1, T, dim], features = f_t [1, T, dim] -> h_t [1, T, dim]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rope(input_pos, x.dtype)
        return self.layer(x, cos, sin, cache_slots, mask)

    @classmethod
    def from_checkpoint(cls, checkpoint_path, target_args: ModelArgs, device="cpu", dtype=torch.float32):
        checkpoint_path = Path(checkpoint_path)
        if not checkpoint_path.is_file():
            raise EagletError(f"draft checkpoint not found: {checkpoint_path} "
                              "(run convert_hf_checkpoint.py --checkpoint_dir on the head's folder first)")
        config = read_config(checkpoint_path.parent)  # the head's shape is in it
        state_dict = load_state_dict(checkpoint_path)
        check_eagle_head(config, state_dict, str(checkpoint_path))
        args = head_args(config)
        if args.dim != target_args.dim or config.get("vocab_size", target_args.vocab_size) != target_args.vocab_size:
            raise EagletError(f"draft head {checkpoint_path} does not match the target: hidden size "
                              f"{args.dim} vs {target_args.dim}, vocabulary {config.get('vocab_size')} vs "
                              f"{target_args.vocab_size}")
        with torch.device("meta"):
            model = cls(args, fc_bias="fc.bias" in state_dict)
        try:
            model.load_state_dict(state_dict, assign=True)
        except RuntimeError as e:
            raise EagletError(f"{checkpoint_path} does not match its config.json: {mismatch_detail(e)}")
        return model.to(device=device, dtype=dtype).eval()


def head_args(config: dict) -> ModelArgs:
    args = ModelArgs.from_hf_config({"model_type": "llama", **config})
    args.qkv_bias = bool(config.get("qkv_bias", args.qkv_bias))
    return args


def check_eagle_head(config: dict, keys, where: str):
    """Refuse, by name, what is not an EAGLE-1/2 head: EAGLE-3 heads and whole models look alike at a glance."""
    if "d2t" in keys or any(k.startswith("midlayer.") for k in keys) or "draft_vocab_size" in config:
        raise EagletError(f"{where} is an EAGLE-3 head (midlayer/d2t/draft vocabulary); "
                          "eaglet loads EAGLE-1/2 heads (fc over cat(embedding, feature), one layer)")
    if "fc.weight" not in keys or config.get("num_hidden_layers", 1) != 1:
        raise EagletError(f"{where} is not an EAGLE-1/2 draft head (expected fc.weight and num_hidden_layers 1)")


@dataclass
class DraftTree:
    """total_tokens tree nodes, the root (the last emitted token) first, parents before children."""
    tokens: Tensor  # [N] int64
    parents: Tensor  # [N] tree index of the parent; the root points to itself
    depths: Tensor  # [N] 0 for the root
    ancestors: Tensor  # [N, N] bool: ancestors[i, j] = j is i or an ancestor of i
    draft_logp: Tensor  # [N] the draft's log-probability of each node given its parent (0 for the root)


def build_tree(step, logp_fn, h_last: Tensor, root: Tensor, ctx_len: Tensor, topk: int, depth: int,
               total_tokens: int, max_seq_length: int) -> DraftTree:
    """EAGLE-2's dynamic tree (DESIGN.md section 2, steps 2-4) with fixed shapes and no loop over nodes.

    step(tokens [k], features [k, dim], input_pos [k], slots [k], mask [k, S]) -> draft outputs [k, dim];
    logp_fn(h [..., dim]) -> draft log-probabilities [..., vocab]. Level i of the frontier sits at position
    ctx_len + i and is written to draft slots ctx_len + i * topk + j.
    """
    device = h_last.device
    logp = logp_fn(h_last)  # [V]
    scores, tokens = logp.topk(topk)
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
        child_logp, child_tokens = logp_fn(h).topk(topk, dim=-1)  # [k, k]
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
    return rerank(torch.cat(pool_tokens), torch.cat(pool_scores), torch.cat(pool_logp), torch.cat(pool_parents),
                  root, total_tokens, depth + 1)


def rerank(pool_tokens, pool_scores, pool_logp, pool_parents, root, total_tokens: int, levels: int) -> DraftTree:
    """Keep the total_tokens - 1 best pool nodes by cumulative score and put the root in front.

    The pool is in level order, so parents come before children; a child never scores above its parent,
    and a stable sort breaks ties by pool order, so the kept set is a tree and stays parent-first.
    """
    device = pool_tokens.device
    pool_size = pool_tokens.shape[0]
    order = torch.sort(pool_scores, descending=True, stable=True).indices[:total_tokens - 1]
    kept = order.sort().values
    tree_index = torch.zeros(pool_size + 1, dtype=torch.long, device=device)  # pool index -> tree index
    tree_index[kept] = torch.arange(1, total_tokens, device=device)
    parents = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree_index[pool_parents[kept]]])
    # pool_parents is -1 at level 0, which reads tree_index[-1] = 0: the root.
    n = total_tokens
    ancestors = torch.eye(n, dtype=torch.bool, device=device)
    for _ in range(levels):  # each pass adds one more generation of ancestors
        ancestors = ancestors | ancestors[parents]
    depths = ancestors.sum(dim=1) - 1
    tokens = torch.cat([root.view(1), pool_tokens[kept]])
    draft_logp = torch.cat([torch.zeros(1, device=device), pool_logp[kept].float()])
    return DraftTree(tokens, parents, depths, ancestors, draft_logp)
