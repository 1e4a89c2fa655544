"""The server's engine: the model, and the one thread that runs every request (a Job) in arrival order from its own
bounded queue; a job's text, its tokens' scores (raw: bytes and logprobs) and one last record of counts go back to the
HTTP side through its event loop (replies.py shapes them as OpenAI's objects). Every torch call of the server runs in
this thread.
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
from lookup import lookup_cycle, warm_up_lookup
from grammar import grammar_tokenizer, token_bytes
from reasoning import thinking_tokens
from server.metrics import Metrics

GREEDY = SamplingConfig()
WARM_UP = [SamplingConfig(t, logprobs=k) for t in (0.0, 1.0) for k in (-1, 0)] + [  # and penalized, without logprobs
    SamplingConfig(t, presence_penalty=0.5) for t in (0.0, 1.0)]


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
    ignore_eos: bool = False  # decode past end-of-sequence, up to max_tokens
    echo: bool = False  # a completion's reply starts with its prompt (its text, and with logprobs its tokens' scores)
    prompt_logprobs: Optional[int] = None  # vLLM's prompt_logprobs: each prompt token's logprob and k alternatives
    prompt_text: str = ""  # the prompt as the request gave it (echo)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)

    def send(self, kind: str, value):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, value))


def done_record(job: Job, finish: str, text: str, completion_tokens: int = 0, cached: int = 0,
                reasoning_tokens: Optional[int] = None, scores: Optional[list] = None, cycles: int = 0,
                tau: Optional[float] = None, tokens_per_s: float = 0.0, seconds: float = 0.0, plain_tokens: int = 0,
                prompt_scores: Optional[list] = None):
    """A job's last event, in its one shape: why it ended, its whole text, the counts (reasoning_tokens: None where the
    reply is not split), its tokens' scores (None: no logprobs asked for) and eaglet's record of the run."""
    return {"finish_reason": finish, "text": text, "prompt_tokens": len(job.prompt),
            "completion_tokens": completion_tokens, "cached_tokens": cached, "reasoning_tokens": reasoning_tokens,
            "logprobs": scores if job.sampling.logprobs >= 0 else None, "prompt_scores": prompt_scores,
            "eaglet": {"cycles": cycles, "tau": tau, "tokens_per_s": tokens_per_s, "seconds": seconds,
                       "plain_tokens": plain_tokens}}


class Waiting:
    """The engine's own bounded queue, in arrival order, and the jobs held back for the next turn."""

    def __init__(self, max_queue: int, max_batch: int):
        self.jobs, self.held, self.max_batch = queue.Queue(maxsize=max_queue), [], max_batch

    def put(self, jobs: list) -> bool:
        """A request's jobs, all or none: False where the queue is full (those queued are cancelled: dropped unrun)."""
        for queued, job in enumerate(jobs):
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                for j in jobs[:queued]:  # the engine drops them unrun
                    j.cancelled.set()
                return False
        return True

    def next(self, slots: int) -> list:
        """The next job; with --max_batch, the greedy jobs waiting behind a greedy one join it (up to max_batch) where
        the batch fits slots. A job that cannot join (it samples) waits for the next turn, first in line."""
        job = self.held.pop(0) if self.held else self.jobs.get()
        batch = [job]
        batchable = lambda j: (j.sampling.temperature == 0 and j.sampling.logprobs < 0  # noqa: E731
                               and j.constraint is None and j.ignore_eos == job.ignore_eos  # a grammar, logprobs,
                               and j.prompt_logprobs is None and not j.echo  # the prompt's,
                               and not j.sampling.penalized)  # penalties: alone
        while self.max_batch > 1 and batchable(job) and len(batch) < self.max_batch:
            try:
                other = self.held.pop(0) if self.held else self.jobs.get_nowait()
            except queue.Empty:
                break
            fits = max(len(j.prompt) for j in batch + [other]) + max(j.max_tokens for j in batch + [other]) \
                <= slots  # generate_batch gives every row the longest reply
            (batch if batchable(other) and fits else self.held).append(other)
            if self.held:
                break
        return batch


class Engine:
    """The model and the one thread that runs it: jobs from its own bounded queue, in arrival order."""

    def __init__(self, args, max_queue: int, max_batch: int = 1):
        self._waiting, self.cached, self.metrics = Waiting(max_queue, max_batch), [], Metrics()
        self.max_batch, self.max_queue = max_batch, max_queue
        self.failure, ready = None, threading.Event()
        threading.Thread(target=self.loop, args=(args, ready), daemon=True, name="eaglet engine").start()
        ready.wait()
        if self.failure is not None:
            raise self.failure
        self.name = short_path(converted_file(args.checkpoint_path, "model.pth"))  # a folder: the file in it

    def load(self, args):
        # a server is one long conversation, as --interactive: caches of --max_seq_length (or 4096) slots
        (self.model, self.tokenizer, self.draft, self.sampling, self.tree, _, _) = load(
            args.checkpoint_path, draft_checkpoint_path=args.draft_checkpoint_path, draft_model=args.draft_model,
            ngram=args.ngram, ngram_min=args.ngram_min, ngram_max=args.ngram_max, draft_vocab=args.draft_vocab,
            device=args.device, precision=args.precision, tree=args.tree, depth=args.depth, tree_topk=args.tree_topk,
            total_tokens=args.total_tokens, tree_choices=args.tree_choices, confidence=args.confidence,
            draft_window=args.draft_window, draft_sinks=args.draft_sinks, prefill_chunk=args.prefill_chunk,
            chat_template=args.chat_template, chat_template_kwargs=args.chat_template_kwargs,
            max_seq_length=args.max_seq_length, interactive=True, exact=args.exact)
        draft_path = converted_file(args.draft_checkpoint_path, "draft.pth") if args.draft_checkpoint_path else \
            converted_file(args.draft_model, "model.pth") if args.draft_model else None
        describe(self.model, self.draft, self.tree, converted_file(args.checkpoint_path, "model.pth"), draft_path,
                 args.device, args.precision)
        compile_settings(self.model, args.device)
        base = speculative_cycle if self.draft is not None else lookup_cycle if args.ngram else decode_one_token
        step = compile_step(base, args.device) if args.compile else base
        self.gen = partial(generate, self.model, eos_ids=self.tokenizer.eos_ids, draft=self.draft,
                           tree=self.tree, step_fn=step, prefill_chunk=args.prefill_chunk)
        self.scratch = self.tree.scratch if self.draft is not None or args.ngram else 0
        self.step_aside, self.plain_fn = None, None  # set by start_step_aside, once the warm-ups are done
        if args.ngram:  # the lookup's verifies, and plain steps where it finds nothing
            self.plain_fn = compile_step(decode_one_token, args.device) if args.compile else None
            self.gen = partial(self.gen, lookup=self.tree, tree=None, plain_fn=self.plain_fn)
            if args.compile:
                warm_up_lookup(self.model, self.tree, step, self.sampling)
        grammar_tokenizer_now(self.tokenizer, self.model.args.vocab_size)
        if self.max_batch > 1:  # caches of max_batch rows (one prompt alone uses the first)
            self.model.setup_caches(self.max_batch, self.model.max_seq_length)
            if self.draft is not None:
                self.draft.setup_caches(self.model.max_seq_length, self.max_batch)
            self.gen_batch = partial(generate_batch, self.model, eos_ids=self.tokenizer.eos_ids, draft=self.draft,
                                     tree=self.tree, step_fn=compile_step(base, args.device) if args.compile else base,
                                     lookup=self.tree if args.ngram else None)
        if args.compile:  # every graph the step has (greedy or sampled, logprobs or not) before any request
            warm_up(lambda prompt, n: [self.gen(prompt, n, s) for s in WARM_UP], self.tokenizer.encode("Hello"), 16)

    def start_step_aside(self, args):
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

    def submit(self, jobs: list) -> bool:
        """A request's jobs into the queue, all or none: False where it is full."""
        return self._waiting.put(jobs)

    def queue_depth(self) -> int:
        return self._waiting.jobs.qsize()

    def loop(self, args, ready: threading.Event):
        # Every torch call runs in this thread, loading included: on a CPU another thread's OpenMP workers, left
        # spinning by earlier torch work, competed with this thread's (a matmul took 15x as long).
        try:
            self.load(args)
            self.start_step_aside(args)
        except Exception as e:  # a user mistake (EagletError) or a bug: main raises it, never a server with no engine
            self.failure = e
        finally:
            ready.set()
        while self.failure is None:
            jobs = []
            for job in self._waiting.next(self.model.max_seq_length - self.scratch):
                if job.cancelled.is_set():  # its client left, or the server is shutting down, while it waited
                    self.metrics.count("aborted")
                    job.send("done", done_record(job, "abort", "", scores=[]))
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
        state = {"stopped": False, "count": 0, "logprobs": []}  # logprobs: scores not sent yet
        vocab = self.model.args.vocab_size

        def on_tokens(new: list):
            forced = len(job.constraint.last_run) if job.constraint is not None else 0  # new ends with a forced run
            cycle = len(new) - forced
            new = new[:job.max_tokens - state["count"]]
            marks = drafted_marks(self.tokenizer, streamer, new[:cycle], new[cycle:])
            written = []
            streamer.write = lambda text: written.append((text, streamer.printed))
            keep = streamer(new)
            state["stopped"] = keep is not None
            if keep is None and (job.cancelled.is_set() or state["count"] + len(new) >= job.max_tokens):
                keep = len(new)  # cancelled: the cycle's tokens are the reply's last (their text is sent)
            state["logprobs"] += scored(self.tokenizer, vocab, job, state["count"], new if keep is None else new[:keep])
            state["count"] += len(new) if keep is None else keep
            for i, (text, start) in enumerate(written):  # a token's logprobs go with the text that holds it
                job.send("text", (text, start, marks, unsent(state) if i == len(written) - 1 else [], state["count"]))
            return keep
        return streamer, state, on_tokens

    def finish(self, job: Job, result, streamer: TextStreamer, state: dict, cached: int, seconds: float):
        """The rest of the text, the counters, and the job's last event."""
        streamer.write = lambda text: job.send("text", (text, streamer.printed, {"drafted": [0, 0]}, unsent(state),
                                                        state["count"]))
        streamer.flush()
        if state["logprobs"]:  # tokens whose text never came (held back, then cut)
            job.send("text", ("", streamer.printed, {"drafted": [0, 0]}, unsent(state), state["count"]))
        eos = bool(result.tokens) and result.tokens[-1] in self.tokenizer.eos_ids and not job.ignore_eos
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
        thinking = None if job.reasoning is None else thinking_tokens(  # the count of a reasoning model's thinking
            self.tokenizer.decode, result.tokens, job.reasoning)
        job.send("done", done_record(job, finish, streamer.text, len(result.tokens), cached, thinking,
                                     scored(self.tokenizer, self.model.args.vocab_size, job, 0, result.tokens),
                                     cycles, result.tau if cycles else None, result.tokens_per_s, seconds,
                                     result.plain_tokens, self.prompt_scored(job, result.prompt_logprobs)))

    def prompt_scored(self, job: Job, rows: list) -> Optional[list]:
        """The prompt's scores as the replies show them (None where none were asked for): per prompt token (its id, its
        bytes, its logprob, [(id, bytes, logprob)] of its likeliest alternatives); the first token's logprob None."""
        if not rows:
            return None
        as_bytes = partial(token_bytes, self.tokenizer, self.model.args.vocab_size)
        return [(t, as_bytes(t), None, []) if row is None else
                (t, as_bytes(t), row[0], [(i, as_bytes(i), p) for i, p in row[1]]) for t, row in zip(job.prompt, rows)]

    def prompt_k(self, job: Job) -> Optional[int]:
        """The alternatives a job's prompt tokens are scored with: echo's logprobs, prompt_logprobs (None: unscored)."""
        wanted = [k for k in (job.sampling.logprobs if job.echo else -1, job.prompt_logprobs) if k is not None and k >= 0]
        return max(wanted) if wanted else None

    def run(self, job: Job):
        scored_prompt = self.prompt_k(job)
        start = reusable(self.cached, job) if scored_prompt is None else 0  # scores come from the prompt's prefill
        self.cached = []
        if job.seed is not None:
            torch.manual_seed(job.seed)
        else:
            torch.seed()
        streamer, state, on_tokens = self.stream(job)
        t0 = time.perf_counter()
        result = self.gen(job.prompt, job.max_tokens, job.sampling, start_pos=start, on_tokens=on_tokens,
                          eos_ids=() if job.ignore_eos else self.tokenizer.eos_ids, prompt_logprobs=scored_prompt,
                          constraint=job.constraint, scores=job.scores, plain_fn=self.plain_fn,
                          step_aside=self.step_aside if job.sampling.temperature == 0 or job.seed is None else None)
        if not job.cancelled.is_set():
            self.cached = (job.prompt + result.tokens)[:len(job.prompt) + len(result.tokens) - result.uncached]
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
        results = self.gen_batch(prompts, max(job.max_tokens for job in jobs), GREEDY, on_tokens=on_tokens,
                                 eos_ids=() if jobs[0].ignore_eos else self.tokenizer.eos_ids)  # the same in a batch
        for job, (streamer, state, _), result in zip(jobs, streams, results):
            self.metrics.count(None, batched=1)
            self.finish(job, result, streamer, state, 0, time.perf_counter() - t0)


def reusable(cached: list, job: Job) -> int:
    """The tokens of the job's prompt the cache holds already (none where the job asks for no reuse)."""
    start = 0
    if job.reuse:  # the longest prefix the cache holds, leaving at least one token to prefill
        while start < min(len(cached), len(job.prompt) - 1) and cached[start] == job.prompt[start]:
            start += 1
    return start


def grammar_tokenizer_now(tokenizer, vocab: int):
    """llguidance's view of the tokenizer (every token's bytes: about a second for 128k ids) built now, in the
    engine's thread, not by the first request that asks for a grammar or logprobs."""
    try:
        grammar_tokenizer(tokenizer, vocab)
    except Exception as e:  # no llguidance, or a tokenizer it cannot read: the requests that need it say why
        print(f"warning: structured output and logprobs' token bytes are unavailable: {e}", flush=True)


def drafted_marks(tokenizer, streamer: TextStreamer, cycle: list, forced: list) -> dict:
    """The reply's character ranges the page colours: drafted, from the cycle's accepted drafts (all its tokens but
    the last, the target's own); forced, the tokens the grammar forced after them (only where there are some)."""
    def end(tokens: list) -> int:
        return len(tokenizer.decode([t for t in streamer.tokens + tokens if t not in tokenizer.eos_ids])) \
            - streamer.skip
    marks = {"drafted": [len(streamer.text), end(cycle[:-1])]}
    return marks | ({"forced": [end(cycle), end(cycle + forced)]} if forced else {})


def scored(tokenizer, vocab: int, job: Job, first: int, tokens: list) -> list:
    """The scores of tokens, the job's tokens from index first on, raw: each token's bytes, its logprob under the
    target and its likeliest alternatives as (bytes, logprob); replies.py shapes them as OpenAI's logprobs. EOS has no
    text: the one ending a reply is left out; with ignore_eos, where every EOS is one of the reply's tokens (usage
    counts it), its bytes are empty."""
    if job.sampling.logprobs < 0:
        return []
    own = lambda t: b"" if job.ignore_eos and t in tokenizer.eos_ids else token_bytes(tokenizer, vocab, t)  # noqa: E731
    return [(own(t), logprob, [(own(i), p) for i, p in top])
            for t, (logprob, top) in zip(tokens, job.scores[first:]) if job.ignore_eos or t not in tokenizer.eos_ids]


def unsent(state: dict) -> list:
    scores, state["logprobs"] = state["logprobs"], []
    return scores
