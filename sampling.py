"""Sampling: the settings a request gives (SamplingConfig), the same as the compiled step and cycle read them
(SamplingInputs: one tensor, so every value runs the same graph), the target distribution they define
(logits_to_probs: the one place it is defined), a draw from it, and each token's logprobs. A new setting is a field
of SamplingConfig made with tensor_setting, checked in its __post_init__ and read by name in logits_to_probs.

Imports checkpoint.py (EagletError) and torch; decode.py and everything above it read their sampling from here.
"""
import math
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

import torch
from torch import Tensor

from checkpoint import EagletError


MAX_TOP_LOGPROBS = 20


def tensor_setting(default):
    """A sampling setting that compiled code reads from a tensor (SamplingInputs): each value runs the same graph. A
    new one is a field made so, read by name in logits_to_probs, and checked in __post_init__."""
    return field(default=default, metadata={"tensor": True})


@dataclass
class SamplingConfig:
    temperature: float = tensor_setting(0.0)  # 0 means greedy
    top_p: float = tensor_setting(1.0)
    top_k: int = tensor_setting(0)  # 0 means no top-k filter
    min_p: float = tensor_setting(0.0)  # keep the tokens at least min_p times as likely as the likeliest; 0 means off
    presence_penalty: float = tensor_setting(0.0)  # OpenAI's: subtracted from the logit of a token the reply holds
    frequency_penalty: float = tensor_setting(0.0)  # OpenAI's: times how often the reply holds it
    repetition_penalty: float = tensor_setting(1.0)  # transformers' and vLLM's: a logit of a token the prompt or the
    # reply holds divided by it (above 0) or multiplied by it (below)
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit (OpenAI's logit_bias)
    min_tokens: int = tensor_setting(0)  # vLLM's: end-of-sequence masked until the reply holds this many tokens
    logprobs: int = -1  # k >= 0: each token's logprob under the target and its k likeliest tokens (token_scores)

    def __post_init__(self):
        if not all(map(math.isfinite, (self.temperature, self.top_p, self.min_p))):
            raise EagletError(f"temperature, top_p and min_p must be finite numbers, got {self.temperature}, "
                              f"{self.top_p} and {self.min_p}")
        if not 0 <= self.min_p <= 1:
            raise EagletError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.temperature < 0:
            raise EagletError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EagletError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EagletError(f"top_k must be >= 0, got {self.top_k}")
        penalties = (self.presence_penalty, self.frequency_penalty, self.repetition_penalty, *self.logit_bias.values())
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in penalties) or self.repetition_penalty <= 0:
            raise EagletError(f"the penalties and biases must be finite numbers (repetition_penalty above 0), got "
                              f"{penalties[:3]} and logit_bias {self.logit_bias}")
        if not all(isinstance(t, int) and t >= 0 for t in self.logit_bias):
            raise EagletError(f"logit_bias maps token ids (whole numbers >= 0) to biases, got {list(self.logit_bias)}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise EagletError(f"min_tokens must be a whole number >= 0, got {self.min_tokens!r}")
        if not -1 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise EagletError(f"logprobs must be -1 (none) or 0..{MAX_TOP_LOGPROBS} alternatives, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a token's logits depend on what came before it (penalties) or are biased."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
                    or self.min_tokens)

    def inputs(self, device, vocab: int = 0, prompt=(), eos_ids=()) -> "SamplingInputs":
        """These settings as the step and the cycle take them; made once a generation (a copy to the device). Whole
        numbers are capped at 2**24, exact in float32 (a top_k past any vocabulary filters nothing). Penalized: the
        history too, [4, vocab] -- the logit bias, how often the reply holds each token (counted as it grows: count()),
        which tokens the prompt holds, and the end-of-sequence tokens (min_tokens masks them)."""
        values = [getattr(self, name) for name in TENSOR_SETTINGS]
        values = [float(min(v, 1 << 24)) if isinstance(v, int) else v for v in values]
        history = None
        if self.penalized:
            if any(t >= vocab for t in self.logit_bias):
                raise EagletError(f"logit_bias names token ids past the vocabulary ({vocab} tokens)")
            history = torch.zeros(4, vocab, device=device)
            history[0, list(self.logit_bias)] = torch.tensor(list(self.logit_bias.values()), device=device).float()
            history[2, list(prompt)] = 1.0
            history[3, list(eos_ids)] = 1.0
        return SamplingInputs(self.greedy, torch.tensor(values, dtype=torch.float32, device=device),
                              MAX_TOP_LOGPROBS if self.logprobs >= 0 else -1, history)


def is_token_id(text) -> bool:
    """logit_bias's key naming a token id (JSON's keys are text): ASCII digits, ten at most (int() refuses 4,300, and
    no vocabulary holds 10**10 tokens; a superscript passes isdigit(), an Arabic-Indic digit int() too)."""
    return isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 10


TENSOR_SETTINGS = tuple(f.name for f in fields(SamplingConfig) if f.metadata.get("tensor"))


@dataclass
class SamplingInputs:
    """A SamplingConfig as a compiled step or cycle reads it: the tensor settings (TENSOR_SETTINGS) are one tensor,
    so every value runs the same graph (as constants, each distinct value would compile another, and past torch's
    recompile limit a request would fail). Two things stay constants, for what they leave out of the graph: greedy (argmax, no
    filter) and whether logprobs are asked for (token_scores of MAX_TOP_LOGPROBS alternatives, whatever the k: the
    host reads the k asked for). So a step or cycle has four graphs at most, whatever the settings."""
    greedy: bool
    settings: Tensor  # float32, one value a name of TENSOR_SETTINGS, in its order
    logprobs: int = -1  # MAX_TOP_LOGPROBS with logprobs, or -1
    history: Optional[Tensor] = None  # penalized: [4, vocab] float32, the bias, the reply's counts, the prompt's tokens,
    # the end-of-sequence tokens

    def inputs(self, device, vocab: int = 0, prompt=(), eos_ids=()) -> "SamplingInputs":
        return self

    def count(self, tokens: list):
        """The reply's new tokens counted into the history (a copy to the device, no sync), before the next call."""
        if self.history is not None and tokens:
            self.history[1].index_add_(0, torch.tensor(tokens, device=self.history.device),
                                       torch.ones(len(tokens), device=self.history.device))

    def named(self) -> dict:
        return dict(zip(TENSOR_SETTINGS, self.settings.unbind()))


def logits_to_probs(logits: Tensor, sampling) -> Tensor:
    """The target distribution under temperature, top-k, top-p and min-p; the one place sampling is defined. sampling:
    a SamplingConfig or its SamplingInputs; the settings are read as tensors either way (no shape depends on them)."""
    settings = sampling.inputs(logits.device).named()
    temperature, top_p, top_k, min_p = settings["temperature"], settings["top_p"], settings["top_k"], settings["min_p"]
    logits = logits.float()
    # (logits - max) keeps the top logit at exactly 0, so a tiny temperature cannot make inf - inf = nan: it
    # tends to greedy. Below float32's smallest normal the temperature would round to 0 (0 / 0): clamp it.
    temperature = temperature.clamp(min=torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    # One sort serves the three filters: top-k keeps the tokens at least as likely as the k-th (ties kept), top-p those
    # whose more likely tokens hold less than top_p (so the token crossing top_p is kept), min-p those at least min_p
    # times as likely as the first (a ratio the other two leave as it is: the order they run in does not matter).
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).long()
    kth = sorted_logits.gather(-1, (k - 1).expand(*logits.shape[:-1], 1))
    sorted_probs = torch.softmax(sorted_logits.masked_fill(sorted_logits < kth, float("-inf")), dim=-1)
    drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p) & (top_p < 1)
    drop |= sorted_probs < min_p * sorted_probs[..., :1]
    drop[..., 0] = False  # the most likely token stays: a top_p below float32's smallest (1e-300) is 0 here
    probs = torch.zeros_like(sorted_probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0))
    return probs / probs.sum(-1, keepdim=True)


def penalize(logits: Tensor, sampling, tokens: Optional[Tensor] = None, ancestors: Optional[Tensor] = None,
             depths: Optional[Tensor] = None) -> Tensor:
    """logits [..., vocab] as the penalties and the bias make them, where they predict the token after the reply so far
    (the history's counts) and, for the nodes of a draft tree (tokens [N], ancestors [N, N], depths [N]: logits
    [N, vocab]), after the node's own path below the root too: a draft is verified under the distribution plain
    decoding would use there, so a rejected draft leaves the law unchanged. The bias is added first, then the
    repetition penalty (transformers' rule), then OpenAI's presence and frequency penalties; end-of-sequence is masked
    where the reply would hold fewer than min_tokens before it. Unpenalized: logits as they are."""
    history = getattr(sampling, "history", None)
    if history is None:
        return logits
    settings = sampling.named()
    counts = history[1]
    position = counts.sum() + (0 if depths is None else depths[:, None])  # the reply's index of the token predicted
    early = (position < settings["min_tokens"]) & (history[3] > 0)
    if tokens is not None:  # each node's path, the root (counted already) left out: [N, vocab]
        path = ancestors.float() * (torch.arange(len(tokens), device=tokens.device) > 0)
        counts = counts + torch.zeros(len(tokens), history.shape[1], device=tokens.device).scatter_add_(
            1, tokens.expand(len(tokens), -1), path)
    logits = logits.float() + history[0]
    penalty = settings["repetition_penalty"]
    seen = (counts > 0) | (history[2] > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits - counts * settings["frequency_penalty"] - (counts > 0).float() * settings["presence_penalty"]
    return logits.masked_fill(early, float("-inf"))


def sample_from_probs(probs: Tensor) -> Tensor:
    # Exponential race instead of torch.multinomial: same distribution, no device-to-host sync.
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def sample(logits: Tensor, sampling) -> Tensor:
    """A token from logits [..., V] under a SamplingConfig or its SamplingInputs."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return sample_from_probs(logits_to_probs(logits, sampling))


def token_scores(logits: Tensor, tokens: Tensor, k: int) -> Tensor:
    """What logprobs report, from the logits [..., V] that predicted tokens [...]: [..., 1 + 2k] floats, the token's
    log-probability, then the k likeliest tokens' log-probabilities and their ids (exact as floats: ids < 2^24;
    past a vocabulary smaller than k, -inf and 0). The distribution is the target's own, before temperature, top-k
    and top-p (what a plain forward gives)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    pad = (0, k - top.values.shape[-1])
    values = torch.nn.functional.pad(top.values, pad, value=float("-inf"))
    ids = torch.nn.functional.pad(top.indices, pad)
    return torch.cat([logp.gather(-1, tokens[..., None]), values, ids.float()], dim=-1)


def read_scores(values: list, k: int) -> list:
    """Rows of token_scores' MAX_TOP_LOGPROBS alternatives (what SamplingInputs asks for), read back, as
    [(logprob, [(id, logprob)] * k)]: the k likeliest."""
    n = MAX_TOP_LOGPROBS
    rows = [values[i:i + 1 + 2 * n] for i in range(0, len(values), 1 + 2 * n)]
    return [(row[0], [(int(i), p) for i, p in zip(row[1 + n:1 + n + k], row[1:1 + k])]) for row in rows]


def prompt_scorer(prompt: list, first: int, k: int, rows: list, block: int = 64) -> Callable:
    """on_logits for prefill_chunks over prompt[first:]: each prompt token's logprob under the target given the tokens
    before it, and its k likeliest alternatives, appended to rows as (logprob, [(id, logprob)] * k) in prompt order
    (the first token has none: rows starts with None where first is 0). Scored block rows at a time, so the memory is
    a chunk's logits and a block's log-softmax, whatever the prompt's length."""
    if first == 0:
        rows.append(None)
    targets = torch.tensor(prompt[first + 1:] + [0])  # the last position predicts the reply, not a prompt token

    def score(offset: int, logits: Tensor):
        n = min(logits.shape[0], len(prompt) - 1 - first - offset)
        for b in range(0, n, block):
            e = min(b + block, n)
            ids = targets[offset + b:offset + e].to(logits.device)
            rows.extend(read_scores(token_scores(logits[b:e], ids, MAX_TOP_LOGPROBS).flatten().tolist(), k))
    return score
