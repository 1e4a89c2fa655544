"""Decoding, the Python API's core, in the order a generation runs it: the settings and the result, the prompt's
checks and prefill, sampling, the plain step, the EAGLE-2 cycle in its phases (expand, verify, commit, catch-up:
speculative_cycle), the head's reads, the calls run ahead (run_calls), and generate / generate_constrained, which
run them and read their tokens back.

Built on it: graphs.py (compiling), batch.py (several prompts at once), step_aside.py, lookup.py (n-gram lookup);
the imports of every file are in docs/files.md. Forks import these names from here (from decode import generate);
load.py loads a target and a head for them.
"""
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor

from draft import DraftHead
from draft_tree import DraftTree, TreeConfig, take
from attention import attention_mask, causal_mask, decode_mask
from model import EagletError, Transformer
from sampling import (MAX_TOP_LOGPROBS, SamplingConfig, SamplingInputs, penalize, prompt_scorer, read_scores, sample,
                      token_scores)
import tp


@dataclass
class GenerationResult:
    prompt_tokens: list
    tokens: list  # generated ids, prompt excluded
    seconds: float  # from the call to the last token read back, the prefill included
    accept_lengths: list = field(default_factory=list)  # tokens emitted per cycle (speculative only)
    first_token_seconds: float = 0.0  # time to first token: the prefill (and the head's first pass), read back
    logprobs: list = field(default_factory=list)  # with sampling.logprobs = k: per token (logprob, [(id, logprob)] * k)
    uncached: int = 1  # the last tokens (of the prompt and the reply) whose K/V the cache lacks: the last one, sampled
    # and never fed back (or a run of forced tokens after it); a next turn reusing the cache starts before them
    plain_tokens: int = 0  # with a head and step_aside: the tokens decoded by plain steps, speculation stepped aside
    prompt_logprobs: list = field(default_factory=list)  # with prompt_logprobs = k: None, then per prompt token after
    # the first (logprob, [(id, logprob)] * k)

    @property
    def tokens_per_s(self) -> float:
        """End to end: every token over the whole time, the prefill included."""
        return len(self.tokens) / max(self.seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """The tokens after the first over the time after it: the steps' or cycles' rate, the prefill left out."""
        return (len(self.tokens) - 1) / max(self.seconds - self.first_token_seconds, 1e-9)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per cycle, bonus included."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


def one_prompt(prompt_tokens) -> list:
    """The prompt as a list of ints; a batch (several prompts) is refused by name."""
    if isinstance(prompt_tokens, Tensor):
        if prompt_tokens.ndim == 2 and prompt_tokens.shape[0] == 1:
            prompt_tokens = prompt_tokens[0]
        prompt_tokens = prompt_tokens.tolist() if prompt_tokens.ndim == 1 else [prompt_tokens.tolist()]
    prompt_tokens = list(prompt_tokens)
    if not all(isinstance(t, int) for t in prompt_tokens):
        raise EagletError("generate() takes one prompt, a list of token ids; for several prompts at once (a batch) "
                          "call generate_batch")
    return prompt_tokens


def check_fits(model: Transformer, n_prompt: int, max_new_tokens: int, extra: int = 0):
    need = n_prompt + max_new_tokens + extra
    if n_prompt == 0:
        raise EagletError("the prompt is empty")
    if max_new_tokens < 0:
        raise EagletError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if need > model.max_seq_length:
        raise EagletError(f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens})"
                          f"{f' + tree scratch ({extra})' if extra else ''} = {need} exceeds the cache "
                          f"({model.max_seq_length} tokens)")


# Tokens a prefill forward takes at once (--prefill_chunk): a prompt is written in chunks, each attending to the
# filled cache and causally within itself, so no tensor of T x T or T x L elements is ever made (a chunk's mask is
# [chunk, L]) and the MLP's activations are a chunk's, not the prompt's. 512 measured best on a CPU (BENCHMARKS.md).
PREFILL_CHUNK = 512


def prefill_chunks(model: Transformer, tokens: Tensor, start_pos: int, chunk: int = PREFILL_CHUNK,
                   on_logits: Optional[Callable] = None):
    """Write tokens [1, T] at positions start_pos.. into the cache, chunk tokens per forward; yield for each chunk
    (its offset in tokens, the logits after its last token [1, vocab], its features [1, n, F]). on_logits(offset,
    logits [n, vocab]) sees every position's logits, one chunk's at a time (the prompt's logprobs)."""
    check_chunk(chunk)
    for s in range(0, tokens.shape[1], chunk):
        e = min(s + chunk, tokens.shape[1])
        input_pos = torch.arange(start_pos + s, start_pos + e, device=tokens.device)
        mask = causal_mask(input_pos, start_pos + e)  # eager: attend over the filled slots only
        # (torch.full, not torch.tensor: a copy from the host would wait for the chunks before it, once a chunk)
        logits, features = model(tokens[:, s:e], input_pos, input_pos, mask,
                                 logits_idx=None if on_logits else torch.full((1,), -1, device=tokens.device))
        if on_logits:
            on_logits(s, logits[0])
        yield s, logits[:, -1], features


def prefill(model: Transformer, tokens: Tensor, start_pos: int, chunk: int = PREFILL_CHUNK):
    """Write tokens [1, T] at positions start_pos.. into the cache (in chunks); return (last logits, all features)."""
    chunks = list(prefill_chunks(model, tokens, start_pos, chunk))
    return chunks[-1][1], torch.cat([features for _, _, features in chunks], dim=1)


def prefill_chunk_of(chunk: Optional[int], cache: int) -> int:
    """The chunk a prefill uses: the one asked for (checked), or PREFILL_CHUNK (None)."""
    if chunk is None:
        return PREFILL_CHUNK
    check_chunk(chunk)
    if chunk > cache:
        raise EagletError(f"the prefill chunk ({chunk} tokens) is larger than the cache ({cache} tokens)")
    return chunk


def check_chunk(chunk):
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise EagletError(f"the prefill chunk must be a positive whole number of tokens, got {chunk!r}")


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, sampling, filled: int = 0):
    """token [1, 1] at input_pos [1] -> the next token [1] (and its token_scores, with sampling.logprobs >= 0).
    Shapes fixed: compiled once, replayed. Eager and compiled CPU callers pass filled
    (input_pos + 1, known on the host): only those cache slots are read (compile_step)."""
    logits, _ = model(token, input_pos, input_pos, decode_mask(input_pos, filled or model.max_seq_length))
    token = sample(penalize(logits[:, -1], sampling), sampling)
    token = token if model.tp_group is None else tp.flag_disagreement(model.tp_group, token)
    if sampling.logprobs >= 0:
        return token, token_scores(logits[:, -1], token.clamp(min=0), sampling.logprobs)
    return token


def verify(target: Transformer, tree: DraftTree, ctx_len: Tensor):
    """Phase 2: one target forward over the tree, K/V to the scratch slots after the context (per row: a batch
    of trees, each after its own row's context)."""
    n = tree.tokens.shape[-1]
    start = ctx_len[..., None]
    logits, features = target(tree.tokens.view(-1, n), start + tree.depths, start + torch.arange(n, device=ctx_len.device),
                              attention_mask(ctx_len, tree.ancestors, target.max_seq_length))
    return logits.view(*tree.tokens.shape, -1), features.view(*tree.tokens.shape, -1)


def accept(tree: DraftTree, logits: Tensor, sampling, levels: int):
    """The longest path of the tree the target agrees with, and the bonus token after it.

    At every node the target picks its own next token: argmax (greedy), or one draw from its processed
    distribution p. A child is accepted iff it is its parent's pick. For sampling this IS the recursive
    rule of tree speculative sampling (try the children in order, accept x with probability p(x), zero and renormalise on
    rejection, bonus from what is left): with deterministic drafts that rule accepts child x with
    probability exactly p(x), and otherwise yields a draw from p restricted to the non-children -- the
    same as one draw x ~ p, taken as the accepted child if it is one and as the bonus if not.
    Returns (path [levels]: the path's tree index at each depth, 0 past its end; accepted drafts; bonus);
    a batch of trees: the same per row, with a leading [B].
    """
    pick = sample(penalize(logits, sampling, tree.tokens, tree.ancestors, tree.depths), sampling)  # [N]
    correct = (tree.tokens == pick.gather(-1, tree.parents)) & (tree.draft_logp > float("-inf"))
    correct[..., 0] = True
    accepted = (tree.ancestors & ~correct[..., None, :]).sum(dim=-1) == 0  # the node and all its ancestors correct
    # Siblings differ, so the accepted nodes form one chain; take its end. (Indices stay 1-element
    # tensors: indexing with a 0-d tensor would read it back to the host.)
    best = torch.where(accepted, tree.depths, -1).argmax(dim=-1, keepdim=True)
    depth_of_row = torch.arange(levels, device=pick.device)[:, None]  # [levels, 1]
    at_depth = tree.ancestors.gather(-2, best[..., None].expand(*best.shape, tree.tokens.shape[-1])) & \
        (tree.depths[..., None, :] == depth_of_row)
    path = at_depth.int().argmax(dim=-1)
    return path, tree.depths.gather(-1, best)[..., 0], pick.gather(-1, best)[..., 0]


def commit(target: Transformer, tree: DraftTree, logits: Tensor, ctx_len: Tensor, sampling, levels: int):
    """Phase 3: acceptance, and the accepted path's K/V moved in place to the slots after the context.
    Returns the emitted tokens (padded to levels), accepted drafts, the bonus token and the path."""
    path, n_accepted, bonus = accept(tree, logits, sampling, levels)
    steps = torch.arange(levels, device=ctx_len.device)
    emitted = torch.where(steps == n_accepted[..., None], bonus[..., None], tree.tokens.gather(-1, path.roll(-1, -1)))
    start = ctx_len[..., None]
    target.compact_kv(start + path, start + steps)
    return emitted, n_accepted, bonus, path


def catch_up(target: Transformer, draft: DraftHead, emitted: Tensor, features: Tensor, ctx_len: Tensor,
             n_accepted: Tensor) -> Tensor:
    """Phase 4: the draft reads what was committed (the emitted tokens and the target's true features of the
    accepted path, padded to a fixed count) and returns the state the next expansion starts from (its h_last).
    An EAGLE head runs over the pairs (f_t, x_{t+1}); a DFlash head writes the context K/V of the features."""
    return draft.catch_up(target, emitted, features, ctx_len, n_accepted)


def speculative_cycle(target: Transformer, draft: DraftHead, root: Tensor, ctx_len: Tensor, h_last: Tensor,
                      tree_config: TreeConfig, sampling):
    """One EAGLE-2 cycle with fixed shapes: expand, verify, commit, catch up.

    On entry the target's cache holds ctx_len tokens, root is the next token (not yet in the cache) and
    h_last the draft's output for its last pair (f_{ctx_len-1}, root). Returns the emitted tokens (padded
    to tree_config.levels), how many drafts were accepted (tokens emitted = that + 1), and the next root, ctx_len
    and h_last; then, with sampling.logprobs >= 0, the emitted tokens' token_scores.
    Nothing here reads a value back to the host.
    """
    tree = tree_config.expand(target, draft, root, ctx_len, h_last)
    logits, features = verify(target, tree, ctx_len)
    emitted, n_accepted, bonus, path = commit(target, tree, logits, ctx_len, sampling, tree_config.levels)
    h_last = catch_up(target, draft, emitted, take(features, path), ctx_len, n_accepted)
    next_ctx = ctx_len + n_accepted + 1
    if target.tp_group is not None:  # every rank must have decided the same (tp.py); -1 says they did not
        n_accepted = tp.flag_disagreement(target.tp_group, n_accepted, tree.tokens, emitted)
    if sampling.logprobs >= 0:  # the path's own logits predicted the emitted tokens: no other target pass
        return emitted, n_accepted, bonus, next_ctx, h_last, token_scores(take(logits, path), emitted, sampling.logprobs)
    return emitted, n_accepted, bonus, next_ctx, h_last


def catch_up_chunks(target: Transformer, draft: DraftHead, next_tokens: Tensor, features: Tensor, first: int,
                    chunk: int = PREFILL_CHUNK) -> Tensor:
    """The head reads the pairs (features[i], next_tokens[i]) of positions first.., chunk pairs per call (its masks
    [chunk, L] at most); returns its output for the last pair."""
    check_chunk(chunk)
    at = partial(torch.full, (), dtype=torch.long, device=features.device)  # made on the device: no wait (prefill)
    for s in range(0, len(next_tokens), chunk):
        e = min(s + chunk, len(next_tokens))
        h_last = catch_up(target, draft, next_tokens[s:e], features[s:e], at(first + s), at(e - s - 1))
    return h_last


def catch_up_prompt(target: Transformer, draft: DraftHead, prompt: list, first: int, features: Tensor,
                    root: Tensor, chunk: int = PREFILL_CHUNK) -> Tensor:
    """The draft's h_last before the first cycle: it reads the prompt's pairs (f_t, x_{t+1}) from position first
    on (features: the target's over prompt[first:]), the last one pairing with the root."""
    device = root.device
    pairs = torch.cat([torch.tensor(prompt[first + 1:], dtype=torch.long, device=device), root.view(1)])
    return catch_up_chunks(target, draft, pairs, features[0], first, chunk)


def catch_up_after_plain(target: Transformer, draft: DraftHead, context: list, first: int, root: Tensor,
                         chunk: Optional[int] = None) -> Tensor:
    """The head's h_last after plain steps wrote context[first:]: the target's features of those tokens (their K/V
    written again, the same), and the head reads their pairs, the last with the root. --exact on CUDA: in calls of
    the plain steps' row count, as cuBLAS picks its kernel by the rows (Transformer.set_exact)."""
    chunk = target.exact_rows if target.exact_rows and root.is_cuda else chunk or PREFILL_CHUNK
    _, features = prefill(target, torch.tensor([context[first:]], device=root.device), first, chunk)
    return catch_up_prompt(target, draft, context, first, features, root, chunk)


def plain_call(model, sampling: SamplingInputs, step_fn, state, filled: int):
    """One plain step queued on the device: (what the host reads: [the token], the next state)."""
    token, ctx_len = state
    # attend over what is filled, but in a CUDA graph (fixed shapes: its BlockMask skips the unfilled blocks)
    read = {} if step_fn and token.is_cuda else {"filled": filled + 1}
    out = (step_fn or decode_one_token)(model, token.view(1, 1), ctx_len.view(1), sampling, **read)
    token, scores = out if sampling.logprobs >= 0 else (out, None)
    token = token.clone()
    return read_back(token.view(1), scores), (token, ctx_len + 1)


def cycle_call(model, draft, tree, sampling: SamplingInputs, step_fn, state, filled: int):
    """One speculative cycle queued on the device: ([accepted drafts, emitted tokens...], the next state). The
    outputs are cloned: a CUDA-graph replay of the next cycle overwrites its static outputs."""
    out = [t.clone() for t in (step_fn or speculative_cycle)(model, draft, *state, tree, sampling)]
    emitted, n_accepted, token, ctx_len, h_last = out[:5]
    return read_back(torch.cat([n_accepted.view(1), emitted]), out[5] if len(out) > 5 else None), (token, ctx_len, h_last)


def read_back(values: Tensor, scores: Optional[Tensor]) -> Tensor:
    """What the host reads of a call, one tensor (one sync): its tokens, then their token_scores if asked for (as
    floats then, exact for ids and counts below 2^24)."""
    return values if scores is None else torch.cat([values.float(), scores.flatten()])


# EAGLET_RUN_AHEAD=0 turns running ahead off (an A/B for measuring it; see run_calls).
RUN_AHEAD = os.environ.get("EAGLET_RUN_AHEAD", "1") != "0"


def run_calls(call: Callable, state, n_prompt: int, tokens: list, emit: Callable, max_new_tokens: int, widest: int,
              ahead: bool, accept_lengths: Optional[list], scores: Optional[list] = None, k: int = -1):
    """Steps or cycles until emit() says done, each read back to the host once (the one sync per call); with scores,
    the new tokens' scores (k alternatives) are appended to it before emit sees the tokens.

    Run ahead: call k+1 is queued (from call k's outputs, still on the device) before call k's tokens are read,
    so the GPU is not idle while the host reads, streams and checks them. When call k ends the generation (EOS,
    max_new_tokens, a stop string) call k+1 is thrown away: its tokens are never read and what it wrote lies
    past the kept context. It is queued only when call k cannot reach max_new_tokens (a cycle emits up to widest
    tokens: a last cycle queued ahead would cost a whole cycle's device time for nothing); then it also fits in
    the cache, since check_fits made room for max_new_tokens and the tree's scratch after the prompt."""
    pending, state = call(state, n_prompt + len(tokens) - 1)
    while True:
        ctx = n_prompt + len(tokens) - 1  # the context call k starts from (its root is not in the cache yet)
        queued = None
        if ahead and max_new_tokens - len(tokens) > widest:
            queued = call(state, ctx + widest)  # its context is at most call k's plus what call k emits
        out = pending.tolist()
        if accept_lengths is None:  # a plain step: [token]
            new, first = [check_agreed(int(out[0]))], 1
        else:  # a cycle: [accepted drafts, emitted tokens padded to the tree's levels]
            new, first = [int(t) for t in out[1:check_agreed(int(out[0])) + 2]], 1 + widest
        if scores is not None:
            scores += read_scores(out[first:], k)[:len(new)]
        n_before = len(tokens)
        done = emit(new)
        if accept_lengths is not None:  # tokens emitted, not accepted: those cut at EOS or max_new_tokens don't count
            accept_lengths.append(len(tokens) - n_before)
        if done:
            return
        pending, state = queued or call(state, n_prompt + len(tokens) - 1)


def check_agreed(value: int) -> int:
    """value, unless tensor parallel ranks decided differently (tp.flag_disagreement put -1 in its place)."""
    if value < 0:
        raise tp.RanksDisagree("tensor parallel ranks decided differently: their kernels are not deterministic "
                               "across ranks (different GPU models, libraries or tuning?), so the output would not "
                               "be exact; run on identical GPUs and software, or without --compile")
    return value


def keep_new(tokens: list, new: list, eos_ids, max_new_tokens: int, on_tokens: Optional[Callable] = None) -> bool:
    """Append new to tokens up to EOS or max_new_tokens (on_tokens may keep fewer: a stop string); True when
    the generation is done."""
    start = len(tokens)
    for t in new:
        tokens.append(t)
        if t in eos_ids or len(tokens) == max_new_tokens:
            break
    keep = on_tokens(tokens[start:]) if on_tokens else None
    if keep is not None:
        del tokens[start + keep:]
        return True
    return tokens[-1] in eos_ids or len(tokens) == max_new_tokens


def counted(emit: Callable, tokens: list, inputs: SamplingInputs, new: list) -> bool:
    """emit(new), the tokens it kept counted into the penalties' history."""
    n = len(tokens)
    done = emit(new)
    inputs.count(tokens[n:])
    return done


def device_sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: Transformer, prompt_tokens: list, max_new_tokens: int, sampling: SamplingConfig,
             eos_ids=(), start_pos: int = 0, on_tokens: Optional[Callable] = None,
             draft: Optional[DraftHead] = None, tree: Optional[TreeConfig] = None,
             step_fn: Optional[Callable] = None, run_ahead: Optional[bool] = None,
             constraint=None, first_pick: Optional[Callable] = None, scores: Optional[list] = None,
             prefill_chunk: Optional[int] = None, step_aside=None,
             plain_fn: Optional[Callable] = None, lookup=None, prompt_logprobs: Optional[int] = None,
             reply_start: Optional[int] = None) -> GenerationResult:
    """Plain decoding, or EAGLE-2 speculative decoding when a draft head is given.

    The caches must already hold prompt_tokens[:start_pos] (multi-turn chat reuse). step_fn replaces
    decode_one_token / speculative_cycle (their compiled versions). on_tokens(new) sees the tokens of each
    step; if it returns a number, that many of them are kept and generation ends (stop strings).
    run_ahead (default: on CUDA, unless EAGLET_RUN_AHEAD=0) queues step k+1 before reading step k's tokens
    (see run_calls). constraint (grammar.Constraint): structured output, exact under speculation
    (generate_constrained). sampling.logprobs >= 0: each token's logprobs, computed by the step or the verify that
    chose it, are appended to scores (a list the caller may pass to read them as on_tokens sees their tokens) and
    returned in the result. The prompt is prefilled prefill_chunk tokens per forward (default PREFILL_CHUNK), the
    head reading each chunk as it goes. step_aside (step_aside.StepAside, with a head): plain steps (plain_fn, e.g.
    compiled; default decode_one_token) wherever speculation does not pay. lookup (lookup.NgramLookup, without a
    head): drafts from the context itself, verified by step_fn (default lookup.lookup_cycle), and plain steps
    (plain_fn) where it finds none. prompt_logprobs k: every prompt token's logprob and k alternatives from the
    prefill itself (result.prompt_logprobs; start_pos 0: the cache must not hold the prompt already). reply_start:
    where the reply begins in prompt_tokens, for the penalties (a constrained generation's later segments; default:
    the prompt's end).
    """
    if constraint is not None:
        return generate_constrained(model, prompt_tokens, max_new_tokens, sampling, constraint, eos_ids, start_pos,
                                    on_tokens, draft=draft, tree=tree, step_fn=step_fn, run_ahead=run_ahead,
                                    scores=scores, prefill_chunk=prefill_chunk, step_aside=step_aside,
                                    plain_fn=plain_fn, lookup=lookup, prompt_logprobs=prompt_logprobs)
    prompt_tokens = one_prompt(prompt_tokens)
    if draft is not None and lookup is not None:
        raise EagletError("n-gram lookup drafts without a head: give a head or a lookup, not both")
    tree = lookup or tree or TreeConfig()
    check_fits(model, len(prompt_tokens), max_new_tokens, tree.scratch if draft or lookup else 0)
    prefill_chunk = prefill_chunk_of(prefill_chunk, model.max_seq_length)
    if prompt_logprobs is not None and start_pos:
        raise EagletError("a prompt's logprobs come from its prefill: give start_pos 0 (no reuse of the cache)")
    prompt_rows = []
    if max_new_tokens == 0:
        if prompt_logprobs is not None:  # the prompt scored alone (echo with no reply)
            for _ in prefill_chunks(model, torch.tensor([prompt_tokens], device=model.output.weight.device), 0,
                                    prefill_chunk, prompt_scorer(prompt_tokens, 0, prompt_logprobs, prompt_rows)):
                pass
        return GenerationResult(list(prompt_tokens), [], 0.0, prompt_logprobs=prompt_rows,
                                uncached=0 if prompt_logprobs is not None else len(prompt_tokens))
    device = model.output.weight.device
    device_sync(device)
    t0 = time.perf_counter()
    # The draft needs the feature of the token before the new ones, so re-run that one (same KV).
    first = max(start_pos - 1, 0) if draft else start_pos
    new_tokens = torch.tensor([prompt_tokens[first:]], device=device)
    if draft is not None and first == 0:
        draft.catch_up_first(model, new_tokens[0, :1])
    scorer = None if prompt_logprobs is None else prompt_scorer(prompt_tokens, first, prompt_logprobs, prompt_rows)
    for offset, logits, features in prefill_chunks(model, new_tokens, first, prefill_chunk, scorer):
        if draft is not None and offset + features.shape[1] < new_tokens.shape[1]:  # the pairs' tokens are known
            catch_up_chunks(model, draft, new_tokens[0, offset + 1:offset + 1 + features.shape[1]], features[0],
                            first + offset, prefill_chunk)
    # tensors, not constants: every setting shares the compiled step's graph (penalized: the history, counted as the
    # reply grows, so no call is run ahead of the tokens it is penalized by)
    reply_start = len(prompt_tokens) if reply_start is None else reply_start
    inputs = sampling.inputs(device, model.args.vocab_size, prompt_tokens[:reply_start], eos_ids)
    inputs.count(prompt_tokens[reply_start:])
    penalized = penalize(logits, inputs)  # logprobs stay the target's own: scored from logits
    token = first_pick(penalized[0]) if first_pick else sample(penalized, inputs)[0]  # 0-d, as every later root
    tokens, accept_lengths = [], []
    scores = None if sampling.logprobs < 0 else [] if scores is None else scores
    scored = len(scores or [])  # what the list held before this call (a constrained generation's earlier segments)
    if scores is not None:
        scores += read_scores(token_scores(logits[0], token, MAX_TOP_LOGPROBS).tolist(), sampling.logprobs)
    emit = partial(keep_new, tokens, eos_ids=eos_ids, max_new_tokens=max_new_tokens, on_tokens=on_tokens)
    if inputs.history is not None:
        emit = partial(counted, emit, tokens, inputs)
    done = emit([token.item()])
    first_token_seconds = time.perf_counter() - t0
    plain_tokens = 0
    if not done:
        ctx_len = torch.tensor(len(prompt_tokens), device=device)
        ahead = (device.type == "cuda" and RUN_AHEAD if run_ahead is None else run_ahead) and inputs.history is None
        if lookup is not None:
            plain_tokens = lookup.run(model, inputs, step_fn, partial(plain_call, model, inputs, plain_fn),
                                      (token, ctx_len), prompt_tokens, tokens, emit, accept_lengths, scores,
                                      sampling.logprobs)
        elif draft is None:
            run_calls(partial(plain_call, model, inputs, step_fn), (token, ctx_len), len(prompt_tokens), tokens, emit,
                      max_new_tokens, 1, ahead, None, scores, sampling.logprobs)
        else:
            h_last = catch_up_prompt(model, draft, prompt_tokens, first + offset, features, token, prefill_chunk)
            call, state = partial(cycle_call, model, draft, tree, inputs, step_fn), (token, ctx_len, h_last)
            if step_aside is None:
                run_calls(call, state, len(prompt_tokens), tokens, emit, max_new_tokens, tree.levels, ahead,
                          accept_lengths, scores, sampling.logprobs)
            else:
                plain_before = step_aside.plain_tokens
                step_aside.run(call, partial(plain_call, model, inputs, plain_fn), state, prompt_tokens, tokens, emit,
                               max_new_tokens, tree.levels, ahead, accept_lengths, scores, sampling.logprobs,
                               partial(catch_up_after_plain, model, draft, chunk=prefill_chunk))
                plain_tokens = step_aside.plain_tokens - plain_before
    seconds = time.perf_counter() - t0  # the last tokens are read: a call queued ahead and thrown away is not waited for
    device_sync(device)
    if scores is not None:
        del scores[scored + len(tokens):]  # those of tokens cut at EOS, max_new_tokens or a stop
    return GenerationResult(list(prompt_tokens), tokens, seconds, accept_lengths, first_token_seconds,
                            scores[scored:] if scores is not None else [], plain_tokens=plain_tokens,
                            prompt_logprobs=prompt_rows)


def generate_constrained(model: Transformer, prompt_tokens: list, max_new_tokens: int, sampling: SamplingConfig,
                         constraint, eos_ids=(), start_pos: int = 0, on_tokens: Optional[Callable] = None,
                         **kwargs) -> GenerationResult:
    """generate() under a grammar, in segments. A segment's tokens go through constraint.take; at the first one the
    grammar refuses, the segment ends with the tokens before it. The next segment starts from every kept token (the
    caches hold them: its prefill re-runs the last one, as a chat turn's reuse does) and its first token is
    constraint.pick of that prefill's logits -- the refused position's -- the masked pick. Drafts the grammar
    refuses thus cost a cut and a short prefill, never a wrong token; an unconstrained run never comes here.
    Where the grammar then forces a run of constraint.forced_min or more tokens (a schema's keys and punctuation),
    the segment ends too and the run is taken without asking the target (constraint.forced: each is the only token
    allowed, the one plain decoding emits); the next segment's prefill writes them into the cache in one forward.
    forced_min 0: never; nor with logprobs (a forced token has no logits of its own)."""
    prompt_tokens, tokens, accept_lengths, logprobs = one_prompt(prompt_tokens), [], [], []
    t0, first_token_seconds, plain_tokens = time.perf_counter(), None, 0
    prompt_k, prompt_rows = kwargs.pop("prompt_logprobs", None), []  # the first segment's prefill scores the prompt
    fast_forward = constraint.forced_min > 0 and sampling.logprobs < 0
    while True:
        ends, run, taken = {"cut": False, "stopped": False}, [], [0]

        def take_allowed(new: list):
            n = constraint.take(new)
            finished = constraint.done()  # the grammar is complete (it took an EOS or allows nothing more)
            ends["cut"] = n < len(new) and not finished
            if fast_forward and not ends["cut"] and not finished:
                run.extend(constraint.forced(max_new_tokens - len(tokens) - taken[0] - n))
                finished = constraint.done()
            taken[0] += n
            keep = on_tokens(new[:n] + run) if on_tokens else None
            if keep is not None:  # a stop string: the run's tokens past it go too
                del run[max(keep - n, 0):]
            ends["stopped"] = keep is not None or finished
            return min(keep, n) if keep is not None else (n if ends["cut"] or finished or run else None)
        context = prompt_tokens + tokens
        segment = generate(model, context, max_new_tokens - len(tokens), sampling, eos_ids, start_pos, take_allowed,
                           first_pick=partial(constraint.pick, sampling=sampling), prompt_logprobs=prompt_k,
                           reply_start=len(prompt_tokens), **kwargs)
        prompt_k, prompt_rows = None, prompt_rows or segment.prompt_logprobs
        first_token_seconds = first_token_seconds if first_token_seconds is not None else segment.first_token_seconds
        if ends["cut"] and not segment.tokens:  # never: a segment's first token is the pick, which the grammar allows
            raise EagletError("the grammar refused the token it had just allowed: no progress")
        tokens += segment.tokens + run
        accept_lengths += segment.accept_lengths
        logprobs += segment.logprobs
        plain_tokens += segment.plain_tokens
        if not (ends["cut"] or run) or ends["stopped"] or len(tokens) >= max_new_tokens or tokens[-1] in eos_ids:
            return GenerationResult(prompt_tokens, tokens, time.perf_counter() - t0, accept_lengths, first_token_seconds,
                                    logprobs, len(run) + 1 if segment.tokens else len(run), plain_tokens, prompt_rows)
        start_pos = len(context) + len(segment.tokens) - 1
