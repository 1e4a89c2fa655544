"""Sampling: the settings a request gives (SamplingConfig), the same as the compiled step and cycle read them
(SamplingInputs: one tensor, so every value runs the same graph), the target distribution they define
(logits_to_probs: the one place it is defined), a draw from it, and each token's logprobs. A new setting is a field
of SamplingConfig made with tensor_setting, checked in its __post_init__ and read by name in logits_to_probs.

Imports checkpoint.py (EagletError) and torch; decode.py and everything above it read their sampling from here.
"""
import math
from dataclasses import dataclass, field, fields

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
        if not -1 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise EagletError(f"logprobs must be -1 (none) or 0..{MAX_TOP_LOGPROBS} alternatives, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def inputs(self, device) -> "SamplingInputs":
        """These settings as the step and the cycle take them; made once a generation (a copy to the device). Whole
        numbers are capped at 2**24, exact in float32 (a top_k past any vocabulary filters nothing)."""
        values = [getattr(self, name) for name in TENSOR_SETTINGS]
        values = [float(min(v, 1 << 24)) if isinstance(v, int) else v for v in values]
        return SamplingInputs(self.greedy, torch.tensor(values, dtype=torch.float32, device=device),
                              MAX_TOP_LOGPROBS if self.logprobs >= 0 else -1)


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

    def inputs(self, device) -> "SamplingInputs":
        return self

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
    probs = torch.zeros_like(sorted_probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0))
    return probs / probs.sum(-1, keepdim=True)


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
