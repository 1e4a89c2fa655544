"""Speculation that steps aside where it does not pay: the gate (StepAside) that judges between cycles and plain
steps, and its runner, run_calls in segments of either. generate(..., step_aside=StepAside()) runs it. Imports
decode.py."""
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from decode import run_calls


@dataclass
class StepAside:
    """Speculation that steps aside where it does not pay: generate() keeps running estimates (the newest call weighs
    `smoothing`) of a cycle's time, of tokens per cycle (tau) and of a plain step's time, and decodes plainly while
    a cycle costs more than tau plain steps (by more than `margin`). After `retry_after` plain tokens it speculates
    again for `trial_cycles` timed cycles and judges anew, each trial that fails doubling the wait (up to
    `longest_wait`); and a trial starts only once what cycles have cost beyond plain steps, with the trial's own cost
    (the last failed one's), is at most `share` of all the time so far -- on any target, a head that never pays costs
    at most that share (past the first judgement's cycles). Where no plain step was timed yet, `probe_steps` plain
    steps time one. Switching happens between calls, and both ways are exact, so the output is what plain decoding
    gives (greedy) or follows the target's law (sampling) either way. One object may serve many generations: its
    estimates carry over (a server's, a CLI run's warm-up). plain_tokens and switches count what it did."""
    retry_after: int = 128
    longest_wait: int = 1024
    trial_cycles: int = 1
    probe_steps: int = 4
    margin: float = 0.05
    smoothing: float = 0.3
    share: float = 0.05
    clock: Callable = time.perf_counter
    step_seconds: float = 0.0
    cycle_seconds: float = 0.0
    tau: float = 0.0
    plain_tokens: int = 0
    switches: int = 0
    speculating: bool = True
    calls: int = 0  # in the current mode
    budget: int = 0  # plain tokens to go before the next judgement
    probing: bool = False  # the plain steps time a step (none was timed before)
    wait: int = 0  # plain tokens before the next trial: retry_after, doubled by every trial that fails
    carried: bool = False  # the mode's first call carries the switch (the head's catch-up): not timed
    elapsed: float = 0.0  # seconds of every call observed
    cycle_total: float = 0.0  # seconds of every cycle, and the tokens they gave: their cost beyond plain steps
    cycle_tokens: int = 0
    trial_seconds: float = 0.0  # the same for the cycles since speculation last resumed
    trial_tokens: int = 0
    trial_cost: float = 0.0  # seconds the last failed trial cost beyond plain steps

    def pays(self) -> bool:
        """Whether a cycle gives more tokens a second than plain steps (unknown costs: assume it does)."""
        if not (self.step_seconds and self.cycle_seconds and self.tau):
            return True
        return self.cycle_seconds / self.tau <= self.step_seconds * (1 + self.margin)

    def observe(self, seconds: float, n_tokens: int):
        """A call of the current mode took seconds (from the previous call's read to its own) and emitted n_tokens.
        A mode's first call is not timed: it carries the switch (the head's catch-up) or a compilation."""
        self.calls += 1
        self.elapsed += seconds
        timed = self.calls > 1 or not self.carried
        if self.speculating:
            if timed:
                self.cycle_seconds = self.average(self.cycle_seconds, seconds)
            self.tau = self.average(self.tau, n_tokens)
            self.cycle_total, self.cycle_tokens = self.cycle_total + seconds, self.cycle_tokens + n_tokens
            self.trial_seconds, self.trial_tokens = self.trial_seconds + seconds, self.trial_tokens + n_tokens
        else:
            if timed:
                self.step_seconds = self.average(self.step_seconds, seconds)
            self.plain_tokens += n_tokens
            self.budget -= n_tokens

    def average(self, old: float, new: float) -> float:
        return new if not old else (1 - self.smoothing) * old + self.smoothing * new

    def switch_now(self) -> bool:
        """Whether the next call should be of the other mode; if so, the mode is switched."""
        if self.speculating:
            timed = self.calls - self.carried
            if timed < self.trial_cycles or (self.step_seconds and self.pays()):
                self.wait = self.retry_after if timed > self.trial_cycles else self.wait
                return False
            # a trial that does not pay, or no plain step timed yet: plain steps, to wait or to time one
            self.wait = min(2 * self.wait, self.longest_wait) if self.wait else self.retry_after
            self.budget, self.probing = (self.wait, False) if self.step_seconds else (self.probe_steps, True)
            self.trial_cost = self.beyond_plain(self.trial_seconds, self.trial_tokens)
        elif self.budget > 0:
            return False
        elif self.probing and not self.pays():  # the probe timed a step, and speculation loses: wait
            self.budget, self.probing = self.wait, False
            self.trial_cost = self.beyond_plain(self.trial_seconds, self.trial_tokens)
            return False
        elif not self.probing and self.tokens_until_affordable() > 0:  # a trial now would cost more than its share
            self.budget = self.tokens_until_affordable()
            return False
        self.speculating, self.calls, self.switches, self.carried = not self.speculating, 0, self.switches + 1, True
        if self.speculating:  # a trial starts: its cycles counted apart
            self.trial_seconds, self.trial_tokens = 0.0, 0
        return True

    def beyond_plain(self, seconds: float, n_tokens: int) -> float:
        """What cycles that took seconds for n_tokens cost beyond the plain steps they replaced (0: they paid)."""
        return max(seconds - n_tokens * self.step_seconds, 0.0)

    def tokens_until_affordable(self) -> int:
        """Plain tokens to go before a trial's cost fits in `share` of the time, with what cycles cost so far."""
        if not self.step_seconds:
            return 0
        short = self.beyond_plain(self.cycle_total, self.cycle_tokens) + self.trial_cost - self.share * self.elapsed
        return math.ceil(short / (self.share * self.step_seconds)) if short > 0 else 0

    def run(self, *args):
        """run_step_aside with this gate: generate() calls it so, and decode.py need not import this file."""
        return run_step_aside(self, *args)


def run_step_aside(gate: StepAside, cycle, plain, state, prompt: list, tokens: list, emit: Callable,
                   max_new_tokens: int, widest: int, ahead: bool, accept_lengths: list, scores, k: int,
                   head_reads: Callable):
    """run_calls in segments of cycles or of plain steps, as gate says after each call. A segment ends at the
    gate's switch (a call queued ahead is thrown away, as at the end of a generation); plain steps start from the
    last root, and cycles again after the head has read what the plain steps wrote (head_reads)."""
    finished, last = [False], [gate.clock()]

    def emit_and_judge(new: list) -> bool:
        n_before = len(tokens)
        finished[0] = emit(new)
        now = gate.clock()
        gate.observe(now - last[0], len(tokens) - n_before)
        last[0] = now
        return finished[0] or gate.switch_now()

    head_at = len(prompt)  # where the head stopped reading: the prompt's end, or where speculation stepped aside
    while True:
        if gate.speculating:
            run_calls(cycle, state, len(prompt), tokens, emit_and_judge, max_new_tokens, widest, ahead,
                      accept_lengths, scores, k)
        else:
            run_calls(plain, state[:2], len(prompt), tokens, emit_and_judge, max_new_tokens, 1, ahead, None, scores, k)
        if finished[0]:
            return
        ctx, device = len(prompt) + len(tokens) - 1, state[0].device
        root = torch.tensor(tokens[-1], device=device)
        if gate.speculating:
            state = (root, torch.tensor(ctx, device=device), head_reads((prompt + tokens)[:ctx], head_at, root))
        else:
            state, head_at = (root, torch.tensor(ctx, device=device)), ctx
