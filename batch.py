"""Several prompts decoded together (generate_batch): prefilled as padded rows, then one step or one cycle serves
every row, each at its own context."""
import time
from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor

from draft import DraftHead
from draft_tree import TreeConfig
from attention import causal_mask
from decode import (GenerationResult, catch_up, check_agreed, check_fits, decode_one_token, device_sync, keep_new, one_prompt, prefill_chunk_of, speculative_cycle)
from sampling import SamplingConfig, sample
from lookup import NgramIndex, NgramLookup, batch_tree, lookup_cycle
from model import EagletError, Transformer


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list, max_new_tokens: int, sampling: SamplingConfig,
                   eos_ids=(), on_tokens: Optional[Callable] = None, draft: Optional[DraftHead] = None,
                   tree: Optional[TreeConfig] = None, step_fn: Optional[Callable] = None,
                   prefill_chunk: Optional[int] = None, lookup: Optional[NgramLookup] = None) -> list:
    """Several prompts decoded together, one GenerationResult each; greedy, every row gets the tokens and
    accepted lengths generate() gives it alone. The caches must hold len(prompts) rows (setup_caches).

    The prompts are prefilled together, padded after their ends: a row's K/V past its prompt is never seen
    (its masks stop at its own context) and is overwritten as it goes on. Then one step or one cycle serves
    every row, each at its own context. A row that is done (EOS, max_new_tokens, or on_tokens(row, new)
    keeping fewer tokens) stays where it is, its outputs ignored, while the others go on: the shapes never
    change. A result's seconds run until its own row was done. lookup (n-gram lookup, without a head): each row's
    tree from its own context, one verify for all (step_fn: a compiled lookup_cycle).
    """
    prompts = [one_prompt(p) for p in prompts]
    if sampling.logprobs >= 0 or sampling.penalized:
        raise EagletError(f"{'logprobs are' if sampling.logprobs >= 0 else 'penalties and logit_bias are'} read one "
                          "prompt at a time (generate), not in a batch")
    tree = lookup or tree or TreeConfig()
    for prompt in prompts:
        check_fits(model, len(prompt), max_new_tokens, tree.scratch if draft or lookup else 0)
    check_rows(model, draft, len(prompts))
    prefill_chunk = prefill_chunk_of(prefill_chunk, model.max_seq_length)
    device = model.output.weight.device
    device_sync(device)
    t0 = time.perf_counter()
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    padded = torch.tensor([p + [p[-1]] * (max(map(len, prompts)) - len(p)) for p in prompts], device=device)
    logits, features = prefill_rows(model, padded, lengths, prefill_chunk)
    if draft is not None:
        draft.catch_up_first(model, padded[:, 0])
    token = sample(logits, sampling)  # [B]
    rows = [[] for _ in prompts]
    accept_lengths, seconds = [[] for _ in prompts], [0.0] * len(prompts)
    emits = [partial(keep_new, rows[b], eos_ids=eos_ids, max_new_tokens=max_new_tokens,
                     on_tokens=partial(on_tokens, b) if on_tokens else None) for b in range(len(prompts))]
    new, ctx_len, next_ctx = [[t] for t in token.tolist()], lengths.clone(), lengths.clone()
    first_token_seconds = time.perf_counter() - t0
    inputs = sampling.inputs(device)
    if draft is not None:
        step_fn = step_fn or speculative_cycle
        # Row b's pairs (f_t, x_{t+1}): its prompt shifted by one, its root at index len_b - 1.
        pairs = torch.cat([padded[:, 1:], padded[:, :1]], dim=1).scatter(1, (lengths - 1)[:, None], token[:, None])
        h_last = catch_up_rows(model, draft, pairs, features, lengths, prefill_chunk)
    indexes = [NgramIndex(lookup) for _ in prompts] if lookup is not None else []
    for index, prompt in zip(indexes, prompts):
        index.extend(prompt)
    done, live, n_live = [False] * len(prompts), None, -1
    while True:
        for b in range(len(prompts)):
            if not done[b]:
                n_before = len(rows[b])
                done[b] = emits[b](new[b])
                if indexes:
                    indexes[b].extend(rows[b][n_before:])
                if (draft is not None or indexes) and n_before:  # the cycles' counts; the prefill's token is not one
                    accept_lengths[b].append(len(rows[b]) - n_before)
                seconds[b] = time.perf_counter() - t0 if done[b] else 0.0
        if all(done):
            break
        # A row that is done stays at the context its last step started from: below its end, so the steps
        # it still takes (their outputs ignored) write inside its cache. (The mask is sent only when it changes.)
        if n_live != done.count(False):
            n_live, live = done.count(False), torch.tensor([not d for d in done], device=device)
        ctx_len = torch.where(live, next_ctx, ctx_len)
        if indexes:
            emitted, n_accepted, token, next_ctx = [t.clone() for t in (step_fn or lookup_cycle)(
                model, batch_tree(indexes, lookup, device), ctx_len, inputs, lookup.levels)]
            out = torch.cat([n_accepted[:, None], emitted], dim=1).tolist()  # the one host sync of the cycle
            new = [o[1:check_agreed(o[0]) + 2] for o in out]
        elif draft is None:
            token = (step_fn or decode_one_token)(model, token[:, None], ctx_len[:, None], inputs).clone()
            next_ctx = ctx_len + 1
            new = [[check_agreed(t)] for t in token.tolist()]
        else:
            emitted, n_accepted, token, next_ctx, h_last = [
                t.clone() for t in step_fn(model, draft, token, ctx_len, h_last, tree, inputs)]
            out = torch.cat([n_accepted[:, None], emitted], dim=1).tolist()  # the one host sync of the cycle
            new = [o[1:check_agreed(o[0]) + 2] for o in out]
    return [GenerationResult(list(p), r, s, a, first_token_seconds)
            for p, r, s, a in zip(prompts, rows, seconds, accept_lengths)]


def prefill_rows(model: Transformer, padded: Tensor, lengths: Tensor, chunk: int):
    """A batch's prompts padded [B, T] prefilled in chunks (as prefill_chunks): each row's logits after its own last
    token [B, vocab] and every position's features [B, T, F]."""
    logits, features = None, []
    for s in range(0, padded.shape[1], chunk):
        e = min(s + chunk, padded.shape[1])
        pos = torch.arange(s, e, device=padded.device)
        last = (lengths - 1 - s).clamp(0, e - s - 1)  # each row's last token, where it is in this chunk
        chunk_logits, chunk_features = model(padded[:, s:e], pos, pos, causal_mask(pos, e), logits_idx=last[:, None])
        ends_here = ((lengths - 1 >= s) & (lengths - 1 < e))[:, None]
        logits = chunk_logits[:, 0] if logits is None else torch.where(ends_here, chunk_logits[:, 0], logits)
        features.append(chunk_features)
    return logits, torch.cat(features, dim=1)


def catch_up_rows(target: Transformer, draft: DraftHead, pairs: Tensor, features: Tensor, lengths: Tensor,
                  chunk: int) -> Tensor:
    """catch_up_chunks for a batch: row b's pairs (features [B, T, F], pairs [B, T]) up to its root at lengths[b] - 1,
    chunk pairs per call; the head's output for each row's last pair [B, dim]."""
    h_last = None
    for s in range(0, pairs.shape[1], chunk):
        e = min(s + chunk, pairs.shape[1])
        last = (lengths - 1 - s).clamp(0, e - s - 1)
        h = catch_up(target, draft, pairs[:, s:e], features[:, s:e], torch.full_like(lengths, s), last)
        ends_here = ((lengths - 1 >= s) & (lengths - 1 < e))[:, None]
        h_last = h if h_last is None else torch.where(ends_here, h, h_last)
    return h_last


def check_rows(model: Transformer, draft: Optional[DraftHead], n_rows: int):
    """The caches hold at least n_rows rows."""
    caches = [model.kv_cache] + ([draft.kv_cache] if draft is not None else [])
    held = min(c.kv.shape[2] for c in caches) if all(c is not None for c in caches) else 0
    if n_rows > held:
        raise EagletError(f"{n_rows} prompts at once need caches of {n_rows} rows; they hold {held} "
                          "(setup_caches(max_batch_size=...))")
