"""A draft model: a small LLaMA-family model of the target's vocabulary drafting for it (gpt-fast's way), as a
DraftHead, so the cycle, the trees (a chain, or EAGLE-2's dynamic tree), batches and stepping aside take it as they
take a trained head.

A head reads pairs (f_t, x_{t+1}) at position t; a model reads tokens: x_{t+1} at position t + 1, in its own static
cache, and ignores the target's features. So its calls sit one position (and one slot) after a head's: the root of a
cycle at ctx_len is in its cache already (the last catch-up read it, as the bonus token), its tree's level i sits at
ctx_len + 1 + i, and its h_last is its logits after the root. The catch-up reads the emitted tokens after the root
(the accepted drafts and the bonus; past them, padding whose K/V lies beyond the context and is overwritten later).

load.py builds it from a converted checkpoint (generate.py --draft_model).
"""
import torch
from torch import Tensor

from draft import DraftHead
from model import EagletError, Transformer


class DraftModel(DraftHead):
    default_depth = 4  # a chain of 4 or a tree of depth 4: one draft forward per level
    default_topk = 4

    def __init__(self, model: Transformer):
        super().__init__(model.args)
        self.model = model

    def blocks(self) -> list:
        return list(self.model.layers)

    def setup_caches(self, max_seq_length: int, max_batch_size: int = 1):
        """A cache as long as the target's. Its calls sit one slot after a head's, and still fit: a cycle starts only
        while tokens are left to make, so its root lies at least one slot before the end of the context the target's
        cache made room for, beside the tree's scratch."""
        self.max_seq_length = max_seq_length
        self.model.setup_caches(max_batch_size, max_seq_length)
        self.kv_cache = self.model.kv_cache

    def setup_rope(self, max_seq_length: int):
        self.model.setup_rope(max_seq_length)

    def context_mask(self, ctx_len: Tensor, block: Tensor):
        """The root, at slot ctx_len, is context: a column every row sees before block's. Built on ctx_len itself, not
        ctx_len + 1: split attention's flex mask_mod may read only a graph input (attention.decode_block_mask says
        why). A window keeps counting back from the root."""
        if self.windowed:
            return super().context_mask(ctx_len + 1, block)
        root = torch.ones(*block.shape[:-1], 1, dtype=torch.bool, device=block.device)
        return super().context_mask(ctx_len, torch.cat([root, block], dim=-1))

    def catch_up_first(self, target: Transformer, tokens: Tensor):
        """The context's first token (tokens [1] or [B], at position 0): a head's first pair starts there, a model's
        first call one position later."""
        pos = torch.zeros(1, dtype=torch.long, device=tokens.device)
        self.model(tokens.view(-1, 1), pos, pos, torch.ones(1, 1, dtype=torch.bool, device=tokens.device))

    def step(self, target: Transformer, tokens, inputs, input_pos, slots, mask) -> Tensor:
        """tokens [T] or [B, T] at input_pos + 1 (slots + 1) -> their logits [..., T, vocab]; inputs ignored."""
        if tokens.ndim == 1:
            return self.step(target, tokens[None], inputs, input_pos, slots, mask)[0]
        logits, _ = self.model(tokens, input_pos + 1, slots + 1, mask)
        return logits

    def logits(self, target: Transformer, h: Tensor) -> Tensor:
        return h

    def lm_head_module(self, target: Transformer):
        return self.model.output


def check_draft_model(draft: Transformer, target: Transformer, where: str):
    """A draft model proposes target ids: the two must share one vocabulary (the tokenizers are compared by load)."""
    if draft.args.vocab_size != target.args.vocab_size:
        raise EagletError(f"the draft model {where} has a vocabulary of {draft.args.vocab_size} tokens and the target "
                          f"{target.args.vocab_size}: a draft model must share the target's vocabulary")
