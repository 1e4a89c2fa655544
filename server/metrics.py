"""The server's counters: requests by outcome, tokens, cycles, the grammar's work, as /metrics' Prometheus text."""
import threading
from typing import Optional


class Metrics:
    """Counters for /metrics (Prometheus text), written by both threads under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests, self.values = {}, {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                                          "cycles": 0, "emitted": 0, "seconds": 0.0, "batched": 0,
                                          "constrained": 0, "constrained_cycles": 0, "constrained_emitted": 0,
                                          "grammar_cuts": 0, "forced_tokens": 0, "plain_tokens": 0}

    def count(self, outcome: Optional[str], **values):
        with self.lock:
            if outcome is not None:
                self.requests[outcome] = self.requests.get(outcome, 0) + 1
            for k, v in values.items():
                self.values[k] += v

    def text(self, queue_depth: int) -> str:
        with self.lock:
            v, lines = dict(self.values), []
            lines += ["# TYPE eaglet_requests_total counter"]
            lines += [f'eaglet_requests_total{{outcome="{k}"}} {n}' for k, n in sorted(self.requests.items())]
            for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                lines += [f"# TYPE eaglet_{name}_total counter", f"eaglet_{name}_total {v[name]}"]
            lines += ["# TYPE eaglet_batched_requests_total counter", f"eaglet_batched_requests_total {v['batched']}",
                      "# TYPE eaglet_cycles_total counter", f"eaglet_cycles_total {v['cycles']}",
                      "# HELP eaglet_mean_tau tokens a cycle emits, over all cycles", "# TYPE eaglet_mean_tau gauge",
                      f"eaglet_mean_tau {v['emitted'] / v['cycles'] if v['cycles'] else 0:.4f}",
                      "# TYPE eaglet_constrained_requests_total counter",
                      f"eaglet_constrained_requests_total {v['constrained']}",
                      "# HELP eaglet_constrained_mean_tau tokens a cycle emits under a grammar, over those cycles",
                      "# TYPE eaglet_constrained_mean_tau gauge", "eaglet_constrained_mean_tau "
                      f"{v['constrained_emitted'] / v['constrained_cycles'] if v['constrained_cycles'] else 0:.4f}",
                      "# HELP eaglet_grammar_cuts_total positions where the grammar refused the target's pick",
                      "# TYPE eaglet_grammar_cuts_total counter", f"eaglet_grammar_cuts_total {v['grammar_cuts']}",
                      "# HELP eaglet_grammar_forced_tokens_total tokens the grammar forced, taken without the target",
                      "# TYPE eaglet_grammar_forced_tokens_total counter",
                      f"eaglet_grammar_forced_tokens_total {v['forced_tokens']}",
                      "# HELP eaglet_plain_tokens_total tokens plain steps made while a head was loaded (speculation "
                      "stepped aside: --step_aside)", "# TYPE eaglet_plain_tokens_total counter",
                      f"eaglet_plain_tokens_total {v['plain_tokens']}",
                      "# TYPE eaglet_queue_depth gauge", f"eaglet_queue_depth {queue_depth}",
                      "# TYPE eaglet_request_seconds_total counter", f"eaglet_request_seconds_total {v['seconds']:.4f}"]
            return "\n".join(lines) + "\n"
