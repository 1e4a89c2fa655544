"""The server's engine: the model, and the one thread that runs every request (a Job) in arrival order from a bounded
queue; a job's text, logprobs and last record go back to the HTTP side through its event loop. Every torch call of
the server runs in this thread.
"""
import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch

from batch import generate_batch
from chat import TextStreamer, warm_up
from checkpoint import converted_file
from decode import decode_one_token, generate, speculative_cycle
from sampling import SamplingConfig
from graphs import compile_settings, compile_step
from load import describe, load, short_path
from step_aside import StepAside
from grammar import grammar_tokenizer, token_bytes
from reasoning import thinking_tokens

GREEDY = SamplingConfig()
WARM_UP = [SamplingConfig(t, logprobs=k) for t in (0.0, 1.0) for k in (-1, 0)]


@dataclass(eq=False)  # hashed by identity: the server keeps a set of live jobs
class Job:
    """One request as the engine runs it; events go back to the HTTP side through its loop."""
    prompt: list
    max_tokens: int
    sampling: SamplingConfig
    seed: Optional[int]
    stop: list
    reuse: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    constraint: Optional[object] = None  # grammar.Constraint: structured output
    tool_form: Optional[str] = None  # tool_calls.py's format the reply's calls are read in (None: no tools)
    one_call: bool = False  # parallel_tool_calls false: the reply's first call only
    reasoning: Optional[str] = None  # where the reply starts (reasoning.py): split into reasoning and content
    scores: list = field(default_factory=list)  # with sampling.logprobs >= 0: generate appends each token's
    index: int = 0  # the choice it answers (several prompts, or n > 1: one job each, one events queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)

    def send(self, kind: str, value):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, value))


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


class Engine:
    """The model and the one thread that runs it: jobs from a bounded queue, in arrival order."""

    def __init__(self, args, max_queue: int, max_batch: int = 1):
        self.jobs, self.cached, self.metrics = queue.Queue(maxsize=max_queue), [], Metrics()
        self.max_batch, self.held = max_batch, []
        self.name, self.failure, ready = short_path(args.checkpoint_path), None, threading.Event()
        threading.Thread(target=self.loop, args=(args, ready), daemon=True, name="eaglet engine").start()
        ready.wait()
        if self.failure is not None:
            raise self.failure

    def load(self, args):
        # a server is one long conversation, as --interactive: caches of --max_seq_length (or 4096) slots
        (self.model, self.tokenizer, self.draft, self.sampling, self.tree, _, _) = load(
            args.checkpoint_path, draft_checkpoint_path=args.draft_checkpoint_path, draft_vocab=args.draft_vocab,
            device=args.device, precision=args.precision, tree=args.tree, depth=args.depth, tree_topk=args.tree_topk,
            total_tokens=args.total_tokens, tree_choices=args.tree_choices, confidence=args.confidence,
            draft_window=args.draft_window, draft_sinks=args.draft_sinks, prefill_chunk=args.prefill_chunk,
            chat_template=args.chat_template, chat_template_kwargs=args.chat_template_kwargs,
            max_seq_length=args.max_seq_length, interactive=True)
        draft_path = converted_file(args.draft_checkpoint_path, "draft.pth") if args.draft_checkpoint_path else None
        describe(self.model, self.draft, self.tree, converted_file(args.checkpoint_path, "model.pth"), draft_path,
                 args.device, args.precision)
        compile_settings(self.model, args.device)
        step = speculative_cycle if self.draft is not None else decode_one_token
        self.gen = partial(generate, self.model, eos_ids=self.tokenizer.eos_ids, draft=self.draft,
                           tree=self.tree, step_fn=compile_step(step, args.device) if args.compile else step,
                           prefill_chunk=args.prefill_chunk)
        self.scratch = self.tree.scratch if self.draft is not None else 0
        self.step_aside, self.plain_fn = None, None  # set by stepping_aside, once the warm-ups are done
        self.grammar_tokenizer()
        if self.max_batch > 1:  # caches of max_batch rows (one prompt alone uses the first)
            self.model.setup_caches(self.max_batch, self.model.max_seq_length)
            if self.draft is not None:
                self.draft.setup_caches(self.model.max_seq_length, self.max_batch)
            self.gen_batch = partial(generate_batch, self.model, eos_ids=self.tokenizer.eos_ids,
                                     draft=self.draft, tree=self.tree,
                                     step_fn=compile_step(step, args.device) if args.compile else step)
        if args.compile:  # every graph the step has (greedy or sampled, logprobs or not) before any request
            warm_up(lambda prompt, n: [self.gen(prompt, n, s) for s in WARM_UP], self.tokenizer.encode("Hello"), 16)

    def grammar_tokenizer(self):
        """llguidance's view of the tokenizer (every token's bytes: about a second for 128k ids) built now, in the
        engine's thread, not by the first request that asks for a grammar or logprobs."""
        try:
            grammar_tokenizer(self.tokenizer, self.model.args.vocab_size)
        except Exception as e:  # no llguidance, or a tokenizer it cannot read: the requests that need it say why
            print(f"warning: structured output and logprobs' token bytes are unavailable: {e}", flush=True)

    def stepping_aside(self, args):
        """--step_aside on with a head: plain steps wherever a cycle costs more than the tokens it gives, judged by one
        StepAside for the engine's life (its estimates carry from request to request); its compiled plain step warmed
        up first, and no compile time taken for a cost. Not for a sampled request with a seed: where the clock said to
        step aside would change which sample the seed gives."""
        if self.draft is None or args.step_aside != "on":
            return
        if args.compile:
            self.plain_fn = compile_step(decode_one_token, args.device)
            warm_up(lambda prompt, n: [self.gen(prompt, n, s, draft=None, step_fn=self.plain_fn) for s in WARM_UP],
                    self.tokenizer.encode("Hello"), 16)
        self.step_aside = StepAside()

    def room(self, prompt: list) -> int:
        return self.model.max_seq_length - self.scratch - len(prompt)

    def loop(self, args, ready: threading.Event):
        # Every torch call runs in this thread, loading included: on a CPU another thread's OpenMP workers, left
        # spinning by earlier torch work, competed with this thread's (a matmul took 15x as long).
        try:
            self.load(args)
            self.stepping_aside(args)
        except Exception as e:  # a user mistake (EagletError) or a bug: main raises it, never a server with no engine
            self.failure = e
        finally:
            ready.set()
        while self.failure is None:
            jobs = []
            for job in self.next_jobs():
                if job.cancelled.is_set():  # its client left, or the server is shutting down, while it waited
                    self.metrics.count("aborted")
                    job.send("done", {"finish_reason": "abort", "text": "", "usage": choice_usage(job.prompt, 0, 0),
                                      "logprobs": [] if job.sampling.logprobs >= 0 else None,
                                      "eaglet": {"cycles": 0, "tau": None, "tokens_per_s": 0.0, "seconds": 0.0}})
                else:
                    jobs.append(job)
            try:
                if len(jobs) == 1:
                    self.run(jobs[0])
                elif jobs:
                    self.run_batch(jobs)
            except Exception as e:  # the server stays up; what the cache holds is unknown
                self.cached = []
                for job in jobs:
                    self.metrics.count("error")
                    job.send("error", f"{type(e).__name__}: {e}")

    def stream(self, job: Job):
        """The job's streamer and its on_tokens for generate(): text to the client each cycle, with the range
        the cycle's drafts made (all its tokens but the last, the target's own: the page marks it); a stop
        string or the job's own max_tokens ends it, and so does its client leaving."""
        streamer = TextStreamer(self.tokenizer, job.prompt, stop=job.stop)
        state = {"stopped": False, "count": 0, "logprobs": []}  # logprobs: entries not sent yet

        def on_tokens(new: list):
            forced = len(job.constraint.last_run) if job.constraint is not None else 0  # new ends with a forced run
            cycle = len(new) - forced
            new = new[:job.max_tokens - state["count"]]
            marks = self.marks(streamer, new[:cycle], new[cycle:])
            written = []
            streamer.write = lambda text: written.append((text, streamer.printed))
            keep = streamer(new)
            state["stopped"] = keep is not None
            if keep is None and (job.cancelled.is_set() or state["count"] + len(new) >= job.max_tokens):
                keep = len(new)  # cancelled: the cycle's tokens are the reply's last (their text is sent)
            state["logprobs"] += self.logprobs(job, state["count"], new if keep is None else new[:keep])
            for i, (text, start) in enumerate(written):  # a token's logprobs go with the text that holds it
                job.send("text", (text, start, marks, self.unsent(state) if i == len(written) - 1 else []))
            state["count"] += len(new) if keep is None else keep
            return keep
        return streamer, state, on_tokens

    def marks(self, streamer: TextStreamer, cycle: list, forced: list) -> dict:
        """The reply's character ranges the page colours: drafted, from the cycle's accepted drafts (all its tokens but
        the last, the target's own); forced, the tokens the grammar forced after them (only where there are some)."""
        def end(tokens: list) -> int:
            return len(self.tokenizer.decode([t for t in streamer.tokens + tokens if t not in self.tokenizer.eos_ids])) \
                - streamer.skip
        marks = {"drafted": [len(streamer.text), end(cycle[:-1])]}
        return marks | ({"forced": [end(cycle), end(cycle + forced)]} if forced else {})

    def logprobs(self, job: Job, first: int, tokens: list) -> list:
        """OpenAI's chat logprobs entries of tokens, the job's tokens from index first on (EOS left out, as from the
        text): the token, its bytes, its logprob under the target and its likeliest alternatives."""
        if job.sampling.logprobs < 0:
            return []
        vocab = self.model.args.vocab_size

        def entry(token: int, logprob: float) -> dict:
            raw = token_bytes(self.tokenizer, vocab, token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
        return [entry(t, logprob) | {"top_logprobs": [entry(i, p) for i, p in top]}
                for t, (logprob, top) in zip(tokens, job.scores[first:]) if t not in self.tokenizer.eos_ids]

    @staticmethod
    def unsent(state: dict) -> list:
        entries, state["logprobs"] = state["logprobs"], []
        return entries

    def finish(self, job: Job, result, streamer: TextStreamer, state: dict, cached: int, seconds: float):
        """The rest of the text, the counters, and the job's last event."""
        streamer.write = lambda text: job.send("text", (text, streamer.printed, {"drafted": [0, 0]}, self.unsent(state)))
        streamer.flush()
        if state["logprobs"]:  # tokens whose text never came (held back, then cut)
            job.send("text", ("", streamer.printed, {"drafted": [0, 0]}, self.unsent(state)))
        eos = bool(result.tokens) and result.tokens[-1] in self.tokenizer.eos_ids
        finish = "stop" if state["stopped"] or eos else "length" if len(result.tokens) >= job.max_tokens \
            else "abort" if job.cancelled.is_set() else "stop"
        cycles = len(result.accept_lengths)
        self.metrics.count("aborted" if job.cancelled.is_set() else "ok", prompt_tokens=len(job.prompt),
                           completion_tokens=len(result.tokens), cached_tokens=cached, cycles=cycles,
                           emitted=sum(result.accept_lengths), seconds=time.perf_counter() - job.queued_at,
                           plain_tokens=result.plain_tokens)
        if job.constraint is not None:
            self.metrics.count(None, constrained=1, constrained_cycles=cycles, constrained_emitted=sum(result.accept_lengths),
                               grammar_cuts=job.constraint.cuts, forced_tokens=job.constraint.forced_tokens)
        usage = choice_usage(job.prompt, len(result.tokens), cached)
        if job.reasoning is not None:  # OpenAI's count of a reasoning model's thinking
            usage["completion_tokens_details"] = {"reasoning_tokens": thinking_tokens(
                self.tokenizer.decode, result.tokens, job.reasoning)}
        job.send("done", {"finish_reason": finish, "text": streamer.text, "usage": usage,
                          "logprobs": self.logprobs(job, 0, result.tokens) if job.sampling.logprobs >= 0 else None,
                          "eaglet": {"cycles": cycles, "tau": result.tau if cycles else None,
                                     "tokens_per_s": result.tokens_per_s, "seconds": seconds,
                                     "plain_tokens": result.plain_tokens}})

    def run(self, job: Job):
        start = 0
        if job.reuse:  # the longest prefix the cache holds, leaving at least one token to prefill
            while start < min(len(self.cached), len(job.prompt) - 1) and self.cached[start] == job.prompt[start]:
                start += 1
        self.cached = []
        if job.seed is not None:
            torch.manual_seed(job.seed)
        else:
            torch.seed()
        streamer, state, on_tokens = self.stream(job)
        t0 = time.perf_counter()
        result = self.gen(job.prompt, job.max_tokens, job.sampling, start_pos=start, on_tokens=on_tokens,
                          constraint=job.constraint, scores=job.scores, plain_fn=self.plain_fn,
                          step_aside=self.step_aside if job.sampling.temperature == 0 or job.seed is None else None)
        if not job.cancelled.is_set():
            self.cached = job.prompt + result.tokens[:len(result.tokens) - result.uncached]
        self.finish(job, result, streamer, state, start, time.perf_counter() - t0)

    def run_batch(self, jobs: list):
        """Greedy jobs that waited together, decoded as rows of one batch (generate_batch: each row's tokens are
        the ones it gets alone); the batch is filled up with copies of its last prompt so its shapes stay the
        same. No prefix reuse: the prompts are prefilled whole, and the cache then holds several conversations."""
        self.cached = []
        streams = [self.stream(job) for job in jobs]
        prompts = [job.prompt for job in jobs]
        prompts += prompts[-1:] * (self.max_batch - len(prompts))
        on_tokens = lambda row, new: streams[row][2](new) if row < len(jobs) else None  # noqa: E731
        t0 = time.perf_counter()
        results = self.gen_batch(prompts, max(job.max_tokens for job in jobs), GREEDY, on_tokens=on_tokens)
        for job, (streamer, state, _), result in zip(jobs, streams, results):
            self.metrics.count(None, batched=1)
            self.finish(job, result, streamer, state, 0, time.perf_counter() - t0)

    def next_jobs(self) -> list:
        """The next job; with --max_batch, the greedy jobs waiting behind a greedy one join it (up to max_batch).
        A job that cannot join (it samples) waits for the next turn, first in line."""
        job = self.held.pop(0) if self.held else self.jobs.get()
        batch = [job]
        batchable = lambda j: (j.sampling.temperature == 0 and j.sampling.logprobs < 0  # noqa: E731
                               and j.constraint is None)  # a grammar, logprobs: alone
        while self.max_batch > 1 and batchable(job) and len(batch) < self.max_batch:
            try:
                other = self.held.pop(0) if self.held else self.jobs.get_nowait()
            except queue.Empty:
                break
            fits = max(len(j.prompt) for j in batch + [other]) + max(j.max_tokens for j in batch + [other]) \
                + self.scratch <= self.model.max_seq_length  # generate_batch gives every row the longest reply
            (batch if batchable(other) and fits else self.held).append(other)
            if self.held:
                break
        return batch


def choice_usage(prompt: list, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
