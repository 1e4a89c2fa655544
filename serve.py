"""eaglet behind an OpenAI-compatible HTTP server: any chat front end, editor plugin or agent framework that speaks
OpenAI's wire protocol can use the speculative decoder, and a greedy reply is the text generate.py prints.

    python serve.py                                              # the shipped demo on 127.0.0.1:8000
    python serve.py --checkpoint_path checkpoints/meta-llama/Llama-2-7b-chat-hf \\
        --draft_checkpoint_path checkpoints/yuhuili/EAGLE-llama2-chat-7B --compile --api_key secret

One engine thread owns the model and runs requests in arrival order from a bounded queue (full: 503 at once);
the HTTP side only parses, checks, queues and streams. A stream sends one chunk per cycle (the tokens a cycle
emits arrive together). A client that goes away stops its generation at the end of the cycle under way. The
last request's tokens stay in the cache: a request that extends them (the next turn of a chat) prefills only
its new tokens and says so in usage.prompt_tokens_details.cached_tokens. docs/serve.md has the details.
"""
import asyncio
import copy
import hmac
import json
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse

import generate
from chat import TextStreamer, warm_up
from checkpoint import EagletError
from cli import cli_parser, float_flag, int_flag
from decode import (MAX_TOP_LOGPROBS, SamplingConfig, StepAside, compile_settings, compile_step, decode_one_token,
                    speculative_cycle)
from grammar import Constraint, grammar_of, grammar_tokenizer, response_format_grammar, token_bytes
from tool_calls import call_format, call_grammar, chosen_functions, functions_of, parse_calls, streamable

PAGE = Path(__file__).resolve().parent / "serve.html"
MAX_BODY = 1 << 20  # bytes of a request body
MAX_CHOICES = 16  # prompts x n of one request
# Fields that would change the reply and that eaglet does not do -- OpenAI's, then vLLM's, SGLang's, llama.cpp's --
# with the value that asks for nothing (None: no value does): any other value is a 400 naming the field.
REFUSED = {"functions": None, "function_call": None, "best_of": 1, "echo": False, "suffix": None, "logit_bias": {},
           "presence_penalty": 0, "frequency_penalty": 0, "audio": None, "modalities": ["text"],
           "web_search_options": None, "use_beam_search": False, "length_penalty": 1, "early_stopping": False,
           "min_p": 0, "repetition_penalty": 1, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": [],
           "include_stop_str_in_output": False, "skip_special_tokens": True, "bad_words": [], "allowed_token_ids": None,
           "prompt_logprobs": None, "guided_whitespace_pattern": None, "structural_tag": None, "ebnf": None,
           "chat_template": None, "documents": None, "add_generation_prompt": True, "continue_final_message": False,
           "repeat_penalty": 1, "typical_p": 1, "tfs_z": 1, "mirostat": 0, "n_probs": 0}
# structured output: OpenAI's response_format, and the fields other engines name (vLLM's guided_*, SGLang's regex,
# llama.cpp's json_schema)
GRAMMAR_FIELDS = ("response_format", "guided_json", "json_schema", "regex", "guided_regex", "grammar",
                  "guided_grammar", "guided_choice")
TEMPLATE_HINTS = ("reasoning_effort", "verbosity")  # passed to the chat template, for one that reads them
READ = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop",
        "seed", "n", "stream", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "cache_prompt", "chat_template_kwargs", *GRAMMAR_FIELDS, *TEMPLATE_HINTS}
# defined by OpenAI or another server, and the reply is the same with them: accepted without a word
NO_EFFECT = {"user", "store", "metadata", "service_tier", "prediction", "prompt_cache_key", "safety_identifier",
             "request_id", "priority", "guided_decoding_backend"}


class ApiError(Exception):
    """A request the server refuses: OpenAI's error JSON with this status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self, headers=None) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error", 503: "server_overloaded"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


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
        self.name, self.failure, ready = generate.short_path(args.checkpoint_path), None, threading.Event()
        threading.Thread(target=self.loop, args=(args, ready), daemon=True, name="eaglet engine").start()
        ready.wait()
        if self.failure is not None:
            raise self.failure

    def load(self, args):
        (self.model, self.tokenizer, self.draft, self.sampling, self.tree, _, _) = generate.load(args)
        generate.describe(args, self.model, self.draft, self.tree)
        compile_settings(self.model, args.device)
        step = speculative_cycle if self.draft is not None else decode_one_token
        self.gen = partial(generate.generate, self.model, eos_ids=self.tokenizer.eos_ids, draft=self.draft,
                           tree=self.tree, step_fn=compile_step(step, args.device) if args.compile else step,
                           prefill_chunk=args.prefill_chunk)
        self.scratch = self.tree.scratch if self.draft is not None else 0
        self.step_aside, self.plain_fn = None, None  # set by stepping_aside, once the warm-ups are done
        self.grammar_tokenizer()
        if self.max_batch > 1:  # caches of max_batch rows (one prompt alone uses the first)
            self.model.setup_caches(self.max_batch, self.model.max_seq_length)
            if self.draft is not None:
                self.draft.setup_caches(self.model.max_seq_length, self.max_batch)
            self.gen_batch = partial(generate.generate_batch, self.model, eos_ids=self.tokenizer.eos_ids,
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
        job.send("done", {"finish_reason": finish, "text": streamer.text,
                          "usage": choice_usage(job.prompt, len(result.tokens), cached),
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

GREEDY = SamplingConfig()
WARM_UP = [SamplingConfig(t, logprobs=k) for t in (0.0, 1.0) for k in (-1, 0)]


def number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    """body[name] (or default) as a finite number in [low, high]; an integer where integer."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:60]}", name)
    if not math.isfinite(value) or not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}, got {value}", name)
    return value


def harmless(name: str, value) -> bool:
    """value asks for nothing this server would leave undone: equal to the harmless value AND of its kind (in
    Python 0 == False and True == 1, so use_beam_search 1 or best_of true would pass as off); 0 and 0.0 alike."""
    default = REFUSED[name]
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default
    return default is not None and type(value) is type(default) and value == default


def logprobs_of(body: dict, chat: bool) -> int:
    """How many alternatives logprobs report per token, -1 for none: chat's logprobs (true / false) and top_logprobs,
    or a completion's logprobs (a count)."""
    if not chat:
        count = number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
        return -1 if count is None else count
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"logprobs must be true or false, got {json.dumps(wanted)[:40]}", "logprobs")
    top = number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else -1


def sampling_of(body: dict, chat: bool = True) -> tuple:
    """(SamplingConfig, seed, stop strings) from a request's fields."""
    for name in REFUSED:
        if body.get(name) is not None and not harmless(name, body[name]):
            hint = " (give tools)" if name.startswith("function") else ""
            raise ApiError(400, f"this server cannot honour {name} {json.dumps(body[name])[:60]}{hint}", name,
                           "unsupported_parameter")
    temperature = number(body, "temperature", 1.0, 0, 100)
    top_p = number(body, "top_p", 1.0, 0, 1)
    if top_p == 0:
        raise ApiError(400, "top_p must be above 0", "top_p")
    top_k = number(body, "top_k", 0, 0, 1 << 31, integer=True)
    seed = number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "stop must be a non-empty string or a list of at most 4 of them", "stop")
    return SamplingConfig(temperature, top_p, top_k, logprobs_of(body, chat)), seed, stop


def messages_of(body: dict) -> list:
    """The conversation as the chat template reads it: text content; an assistant's tool_calls with their
    arguments as objects (as templates expect them); a tool's result with the id of the call it answers."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", "messages")
        role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role must be system, developer, user, assistant or tool, got "
                                f"{json.dumps(role)[:40]}", "messages")
        if isinstance(content, list):  # parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if content is None and role == "assistant" and calls:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        message = {"role": "system" if role == "developer" else role, "content": content}
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(400, f"messages[{i}]: a tool message needs the tool_call_id it answers", "messages")
            message |= {"tool_call_id": m["tool_call_id"]} | ({"name": m["name"]} if isinstance(m.get("name"), str) else {})
        if role == "assistant" and calls is not None:
            message["tool_calls"] = [call_of(i, call) for call in (calls if isinstance(calls, list) else [None])]
        out.append(message)
    return out


def call_of(i: int, call) -> dict:
    """An assistant message's tool call, its arguments (OpenAI sends JSON text) parsed into an object."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"messages[{i}].tool_calls: each must be {{\"id\", \"type\": \"function\", \"function\": "
                            '{"name", "arguments": a JSON object as text}}', "messages")
    return {"id": str(call.get("id", "")), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


class Server:
    """The HTTP side: parse and check a request, queue it, stream or return its reply."""

    def __init__(self, engine: Engine, api_key: Optional[str], allowed_origins=("*",), aliases=("eaglet",)):
        self.engine, self.api_key = engine, api_key
        self.draining, self.live = False, set()  # live: the jobs of replies not yet sent whole
        self.warned = set()  # (field, why) a warning line named
        self.model_ids = [engine.name] + [a for a in aliases if a != engine.name]
        self.app = app = FastAPI(title="eaglet", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/", self.page, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.middleware("http")(self.guard)
        if allowed_origins:  # added last, so outermost: a preflight is answered before the key is asked for
            app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                               allow_headers=["*"], max_age=600)
        app.exception_handler(404)(lambda r, e: ApiError(404, f"no such path: {r.url.path}").response())
        app.exception_handler(405)(lambda r, e: ApiError(405, f"{r.method} is not allowed on {r.url.path}").response())

    async def guard(self, request: Request, call_next):
        """The API key (compared in constant time) and the body's size, before any route runs."""
        if self.api_key and request.url.path.startswith("/v1/") and request.method != "OPTIONS":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return ApiError(401, "a missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key").response()
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return ApiError(413, f"the request body is over {MAX_BODY} bytes").response()
        return await call_next(request)

    async def page(self):
        return FileResponse(PAGE, media_type="text/html")

    async def health(self):  # 503 once shutting down, so that a load balancer sends no more
        return JSONResponse({"status": "shutting down"}, 503) if self.draining else {"status": "ok"}

    async def metrics(self):
        return PlainTextResponse(self.engine.metrics.text(self.engine.jobs.qsize()))

    async def models(self):
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "eaglet", "created": 0}
                                           for name in self.model_ids]}

    async def chat_completions(self, request: Request):
        return await self.complete(request, chat=True)

    async def completions(self, request: Request):
        return await self.complete(request, chat=False)

    async def complete(self, request: Request, chat: bool):
        if self.draining:
            return self.refuse_draining()
        try:
            jobs, stream, usage_in_stream, compile_grammar = self.make_jobs(await self.body(request), chat)
            await self.constrain(jobs, compile_grammar)
        except ApiError as e:
            self.engine.metrics.count("refused")
            return e.response()
        if self.draining:  # it began while the grammar compiled
            return self.refuse_draining()
        for queued, job in enumerate(jobs):
            try:
                self.engine.jobs.put_nowait(job)
            except queue.Full:
                for j in jobs[:queued]:  # the engine drops them unrun
                    j.cancelled.set()
                self.engine.metrics.count("queue_full")
                return ApiError(503, "the server is busy: its queue is full; try again shortly").response(
                    {"Retry-After": "1"})
        self.live.update(jobs)
        reply_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": reply_id, "created": int(time.time()), "model": self.engine.name,
                "object": "chat.completion.chunk" if chat else "text_completion"}
        if stream:
            return StreamingResponse(self.chunks(jobs, head, chat, usage_in_stream), media_type="text/event-stream")
        return await self.whole(request, jobs, head, chat)

    def refuse_draining(self) -> JSONResponse:
        self.engine.metrics.count("refused")
        return ApiError(503, "the server is shutting down", code="shutting_down").response({"Connection": "close"})

    @staticmethod
    async def constrain(jobs: list, compile_grammar):
        """The request's grammar compiled once, in a worker thread (a large schema takes a while, and the event loop
        sends every other stream's chunks meanwhile); each job gets its own copy of the compiled matcher."""
        constraint = await asyncio.to_thread(compile_grammar)
        if constraint is not None:
            for job in jobs:
                job.constraint = constraint.copy()

    async def body(self, request: Request) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def make_jobs(self, body: dict, chat: bool) -> tuple:
        """The request as Jobs, one a choice: each prompt (a completion's prompt may be a list) n times, each checked
        against the cache's room; whether to stream, and usage in the stream; and the call that compiles its grammar
        (a Constraint, or None) for Server.constrain to run off the event loop."""
        model = body.get("model")
        if model is not None and model not in self.model_ids:  # absent: the page's requests, and lenient clients
            raise ApiError(404, f"the model {json.dumps(model)[:80]} does not exist here; this server has "
                                f"{', '.join(self.model_ids)}", "model", "model_not_found")
        sampling, seed, stop = sampling_of(body, chat)
        self.warn_once([name for name in body if name not in READ | NO_EFFECT | REFUSED.keys()],
                       "no OpenAI-compatible server eaglet knows defines it")
        elsewhere = ("prompt",) if chat else ("messages", "chat_template_kwargs", *TEMPLATE_HINTS)
        self.warn_once([name for name in elsewhere if body.get(name) is not None],
                       f"not read by /v1/{'chat/' if chat else ''}completions")
        n = number(body, "n", 1, 1, MAX_CHOICES, integer=True)
        tools, tool_form, calls = self.tools_of(body, chat)
        if body.get("parallel_tool_calls") not in (None, True, False):
            raise ApiError(400, "parallel_tool_calls must be true or false", "parallel_tool_calls")
        prompts = [self.render(body, messages_of(body), tools)] if chat else self.prompts_of(body.get("prompt"))
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n {n} = {len(prompts) * n} choices; at most {MAX_CHOICES}", "n")
        limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = number(body, limit, None, 1, 1 << 31, integer=True)
        for prompt in prompts:
            room = self.engine.room(prompt)
            if room < 1 or (max_tokens or 1) > room:
                raise ApiError(400, f"the prompt ({len(prompt)} tokens) and {limit} ({max_tokens or 1}) need "
                                    f"{len(prompt) + (max_tokens or 1) + self.engine.scratch} slots with the draft tree's "
                                    f"scratch ({self.engine.scratch}); the cache holds {self.engine.model.max_seq_length}",
                               limit, "context_length_exceeded")
        stream, options = body.get("stream", False), body.get("stream_options") or {}
        if not isinstance(stream, bool) or not isinstance(options, dict):
            raise ApiError(400, "stream must be true or false and stream_options an object", "stream")
        if body.get("stream_options") is not None and not stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
        reuse, loop, events = body.get("cache_prompt", True) is not False, asyncio.get_running_loop(), asyncio.Queue()
        if len(prompts) * n > self.engine.jobs.maxsize:
            raise ApiError(400, f"{len(prompts) * n} choices (prompts x n) would never fit the queue of "
                                f"{self.engine.jobs.maxsize} (--max_queue)", "n")
        compile_grammar = partial(self.call_constraint, tool_form, body["tools"], calls) if calls \
            else partial(self.constraint_of, body)
        if calls and any(body.get(name) not in (None, {"type": "text"}) for name in GRAMMAR_FIELDS):
            raise ApiError(400, "a tool_choice that forces a call is a grammar itself: give it or a response_format "
                                "(or regex, grammar), not both", "tool_choice")
        jobs = [Job(prompt, max_tokens or self.engine.room(prompt), sampling, None if seed is None else seed + k, stop,
                    reuse, loop, events, None, tool_form, body.get("parallel_tool_calls") is False, index=i * n + k)
                for i, prompt in enumerate(prompts) for k in range(n)]
        return jobs, stream, bool(options.get("include_usage")), compile_grammar

    def tools_of(self, body: dict, chat: bool) -> tuple:
        """(tools for the chat template, the format its calls are read in, the names a call is forced among) of
        OpenAI's tools and tool_choice; (None, None, None) without tools or with tool_choice none."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        if tools is None and choice is None:
            return None, None, None
        if not chat:
            raise ApiError(400, "tools are for /v1/chat/completions", "tools")
        try:
            functions = functions_of(tools)
        except EagletError as e:
            raise ApiError(400, str(e), "tools")
        try:
            calls = chosen_functions(functions, choice)
        except EagletError as e:
            raise ApiError(400, str(e), "tool_choice")
        if choice == "none":
            return None, None, None
        try:
            return tools, call_format(self.engine.tokenizer), calls
        except EagletError as e:
            if calls is None:  # auto: the model decides to call, and it cannot without seeing the tools
                raise ApiError(400, f"{e}; tool_choice auto needs a template that shows the model its tools "
                                    "(required or a named function needs none)", "tools", "tools_unsupported")
        # a forced call is the grammar's, whatever the template renders: Hermes' <tool_call> block; a template that
        # takes tools in a format eaglet cannot read still shows them
        return (tools if self.engine.tokenizer.takes_tools() else None), "hermes", calls

    def render(self, body: dict, messages: list, tools: Optional[list]) -> list:
        """A conversation's tokens through the chat template, with the request's chat_template_kwargs and the hints
        (reasoning_effort, verbosity) as its variables; a log line for a hint the template never reads."""
        tokenizer, kwargs = self.engine.tokenizer, body.get("chat_template_kwargs") or {}
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}
        if not isinstance(kwargs, dict) or reserved & kwargs.keys():
            raise ApiError(400, f"chat_template_kwargs must be an object without {', '.join(sorted(reserved))}",
                           "chat_template_kwargs")
        hints = {name: body[name] for name in TEMPLATE_HINTS if body.get(name) is not None}
        source = (tokenizer.chat_template or "") + (tokenizer.tool_template or "")
        self.warn_once([name for name in hints if name not in source], "the chat template never reads it")
        if kwargs or hints:  # a copy of the tokenizer with these variables (no other request sees them)
            tokenizer = copy.copy(tokenizer)
            tokenizer.template_kwargs = {**tokenizer.template_kwargs, **hints, **kwargs}
        try:
            return tokenizer.encode_chat(messages, tools)
        except EagletError as e:  # the checkpoint's template refused the conversation (raise_exception)
            raise ApiError(400, str(e), "messages")

    def warn_once(self, names: list, why: str):
        """One log line for each field the reply goes without: the first time a request sends it."""
        for name in names:
            if (name, why) not in self.warned:
                self.warned.add((name, why))
                print(f"warning: a request's field {name!r} is accepted and has no effect: {why}", flush=True)

    def call_constraint(self, tool_form: str, tools: list, names: list):
        """The grammar of a forced call (tool_choice required or a named function) as a fresh Constraint."""
        try:
            grammar = call_grammar(self.engine.tokenizer, tool_form, functions_of(tools), names)
            return Constraint(self.engine.tokenizer, self.engine.model.args.vocab_size, grammar)
        except EagletError as e:
            raise ApiError(400, str(e), "tools", "invalid_grammar")

    def prompts_of(self, prompt) -> list:
        """A completion's prompt as token lists: a string, a list of strings, a list of token ids, or a list of such
        lists (OpenAI's four shapes); several prompts are answered as choices in their order."""
        if isinstance(prompt, str):
            prompt = [prompt]
        ok = isinstance(prompt, list) and prompt
        if ok and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt = [prompt]
        if not ok or not all(p and (isinstance(p, str) or isinstance(p, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p)) for p in prompt):
            raise ApiError(400, "prompt must be a non-empty string or token-id list, or a list of them", "prompt")
        vocab = self.engine.model.args.vocab_size
        for p in prompt:
            if isinstance(p, list) and not all(0 <= t < vocab for t in p):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return [self.engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    def constraint_of(self, body: dict):
        """The request's grammar as a fresh grammar.Constraint (None: free text); 400 naming the field and the
        grammar engine's reason when it cannot be compiled."""
        given = [name for name in GRAMMAR_FIELDS if body.get(name) is not None
                 and body[name] != {"type": "text"}]
        if not given:
            return None
        if len(given) > 1:
            raise ApiError(400, f"give one of {', '.join(given)}, not several", given[1])
        name, value = given[0], body[given[0]]
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "json_object" \
                and value.get("schema") is not None:  # llama.cpp's way to give a schema
            value, name = value["schema"], "response_format.schema"
        try:
            if name == "response_format":
                grammar = response_format_grammar(value)
            elif name in ("guided_json", "json_schema", "response_format.schema"):
                if not isinstance(value, (dict, str)):
                    raise EagletError(f"{name} must be a JSON schema (an object or its text)")
                grammar = grammar_of("json_schema", value if isinstance(value, str) else json.dumps(value))
            elif name == "guided_choice":
                if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                    raise EagletError("guided_choice must be a non-empty list of non-empty strings")
                grammar = grammar_of("lark", "start: " + " | ".join(json.dumps(c) for c in value))
            elif not isinstance(value, str) or not value:
                raise EagletError(f"{name} must be a non-empty string")
            else:
                grammar = grammar_of("regex" if name.endswith("regex") else "lark", value)
            if grammar is None:  # response_format text
                return None
            return Constraint(self.engine.tokenizer, self.engine.model.args.vocab_size, grammar)
        except EagletError as e:
            raise ApiError(400, str(e), name.split(".")[0], "invalid_grammar")

    async def chunks(self, jobs: list, head: dict, chat: bool, usage_in_stream: bool):
        """Server-sent events: one chunk per cycle (its choice's index), a last one per choice with its finish_reason,
        usage if asked, [DONE]. Leaving early (the client went away) cancels the jobs: the engine stops at the end
        of the cycle under way."""
        started, finished, offsets, texts, sent = set(), {}, {}, {}, {}
        wants_logprobs, tool_form = jobs[0].sampling.logprobs >= 0, jobs[0].tool_form

        def chunk(index: int, text: str, finish=None, extra=None, logprobs=None, calls=None) -> str:
            choice = {"index": index, "finish_reason": finish}
            if chat:  # the role in a choice's first chunk only, as OpenAI sends it
                choice["delta"] = ({"role": "assistant"} if index not in started else {}) | (
                    {"content": text} if text is not None else {}) | (
                    {"tool_calls": [{"index": i} | call for i, call in enumerate(calls)]} if calls else {})
                started.add(index)
                choice["logprobs"] = {"content": logprobs} if wants_logprobs and logprobs is not None else None
            else:
                choice["text"] = text or ""
                if wants_logprobs and logprobs is not None:
                    choice["logprobs"], offsets[index] = completion_logprobs(logprobs, offsets.get(index, b""))
                else:
                    choice["logprobs"] = None
            return f"data: {json.dumps({**head, 'choices': [choice], **(extra or {})})}\n\n"
        try:
            async for index, kind, value in events(jobs):
                if kind == "text":
                    text, start, marks, logprobs = value  # marks: the reply's characters from accepted drafts, forced
                    if tool_form:  # content up to where a call starts (or may): the rest when the reply is done
                        texts[index] = texts.get(index, "") + text
                        upto = max(sent.get(index, 0), streamable(texts[index], tool_form))
                        text, sent[index] = texts[index][sent.get(index, 0):upto], upto
                    if text or logprobs:
                        yield chunk(index, text, extra={"eaglet": {"start": start} | marks}, logprobs=logprobs)
                elif kind == "done" and value is not None:
                    finished[index], finish, calls = value, value["finish_reason"], []
                    if tool_form:
                        content, calls = calls_of(jobs[index], value["text"])
                        if (content or "")[sent.get(index, 0):]:
                            yield chunk(index, content[sent.get(index, 0):])
                        if calls:
                            finish = "tool_calls"
                            yield chunk(index, None, calls=calls)
                    yield chunk(index, None if chat else "", finish, {"eaglet": value["eaglet"]})
                elif kind == "error":
                    yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
            if usage_in_stream and len(finished) == len(jobs):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(jobs, finished)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.live.difference_update(jobs)
            for job in jobs:
                job.cancelled.set()  # no-op when it ended; else the engine stops at the end of the cycle

    async def whole(self, request: Request, jobs: list, head: dict, chat: bool):
        """The whole reply as one JSON object, its choices in order; a client that goes away while it waits cancels
        the jobs."""
        done = {}
        try:
            async for index, kind, value in events(jobs, request):
                if kind == "done" and value is not None:
                    done[index] = value
                elif kind == "error":
                    return ApiError(500, f"generation failed: {value}").response()
        finally:
            self.live.difference_update(jobs)
            for job in jobs:
                job.cancelled.set()
        if len(done) < len(jobs):
            return ApiError(499, "the client went away").response()
        choices = []
        for index in sorted(done):
            reply = done[index]
            logprobs, finish = reply["logprobs"], reply["finish_reason"]
            if chat:
                message = {"role": "assistant", "content": reply["text"]}
                text, calls = calls_of(jobs[index], reply["text"]) if jobs[index].tool_form else (None, [])
                if calls:
                    message, finish = {"role": "assistant", "content": text, "tool_calls": calls}, "tool_calls"
                content = {"message": message, "logprobs": None if logprobs is None else {"content": logprobs}}
            else:
                content = {"text": reply["text"], "logprobs": None if logprobs is None else completion_logprobs(logprobs)[0]}
            choices.append({"index": index, **content, "finish_reason": finish})
        stats = done[0]["eaglet"] if len(jobs) == 1 else {"choices": [done[i]["eaglet"] for i in sorted(done)]}
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": usage(jobs, done), "eaglet": stats}


def completion_logprobs(entries: list, before: bytes = b"") -> tuple:
    """Chat logprobs entries in the completions' shape -- tokens, token_logprobs, top_logprobs and text_offset, each
    token's first character in the text, counted over the bytes before it (before: the reply's bytes ahead of these
    entries), so a character split over several tokens counts once -- and the bytes so far. top_logprobs maps each
    alternative's name to its logprob, the sampled token always among them (OpenAI: up to logprobs + 1 entries)."""
    starts = []
    for e in entries:
        starts.append(len(before.decode("utf-8", errors="ignore")))  # a character not yet whole: not counted yet
        before += bytes(e["bytes"])
    return {"tokens": [token_name(e["bytes"]) for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [top_by_name(e) for e in entries], "text_offset": starts}, before


def token_name(raw: list, taken=()) -> str:
    """A token as the completions' logprobs name it: its text; OpenAI's bytes:\\xe2\\x80 where its bytes are not
    whole UTF-8 (part of a character), or where another token took the text (a byte token and a piece alike)."""
    try:
        text = bytes(raw).decode("utf-8")
        if text not in taken:
            return text
    except UnicodeDecodeError:
        pass
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def top_by_name(entry: dict) -> dict:
    """The alternatives of a token by name, most likely first: the sampled one named as in tokens, the others each
    under a name of its own (decoding partial bytes alone, several read \\ufffd and would share one key)."""
    sampled = token_name(entry["bytes"])
    top = {sampled: entry["logprob"]}
    for t in entry["top_logprobs"]:
        if not (t["bytes"] == entry["bytes"] and t["logprob"] == entry["logprob"]):  # the sampled one: in already
            top[token_name(t["bytes"], top)] = t["logprob"]
    return dict(sorted(top.items(), key=lambda kv: -kv[1]))


def calls_of(job: Job, text: str) -> tuple:
    """(content, OpenAI's tool_calls) of a reply; with parallel_tool_calls false, its first call only."""
    content, calls = parse_calls(text, job.tool_form)
    return content, calls[:1] if job.one_call else calls


def choice_usage(prompt: list, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def usage(jobs: list, done: dict) -> dict:
    """OpenAI's usage of a request: each distinct prompt once, every choice's completion."""
    firsts = {}
    for job in jobs:  # a prompt's first choice: the one that prefilled it (later ones may reuse its cache)
        firsts.setdefault(id(job.prompt), job)
    prompts = firsts.values()
    prompt_tokens = sum(len(job.prompt) for job in prompts)
    completion = sum(reply["usage"]["completion_tokens"] for reply in done.values())
    cached = sum(done[job.index]["usage"]["prompt_tokens_details"]["cached_tokens"] for job in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def events(jobs: list, request: Optional[Request] = None):
    """The jobs' events, (choice index, kind, value), until each is done; with request, stop early when its
    client disconnects."""
    left = len(jobs)
    while left:
        try:
            index, kind, value = await asyncio.wait_for(jobs[0].events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                return
            continue
        yield index, kind, value
        left -= kind in ("done", "error")


class DrainingUvicorn(uvicorn.Server):
    """uvicorn with a shutdown that ends within a bound: the first SIGTERM or SIGINT turns new requests away (503)
    and gives the replies in flight grace seconds; then it cancels them (the engine stops at the end of the cycle
    under way: finish_reason "abort") and exits 0 once they are sent. A second signal ends the process at once."""
    CANCEL_WAIT = 2.0  # seconds past the grace for the cancelled replies (a long prefill runs on); then exit anyway

    def __init__(self, config: uvicorn.Config, api: "Server", grace: float):
        super().__init__(config)
        self.api, self.grace, self.signalled_at, self.stage = api, grace, None, "running"

    def handle_exit(self, sig: int, frame):  # replaces uvicorn's, which waits for every reply however long
        if self.signalled_at is not None:
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)
        self.signalled_at, self.api.draining = time.monotonic(), True

    async def on_tick(self, counter: int) -> bool:
        if self.signalled_at is not None and not self.should_exit:
            waited, live = time.monotonic() - self.signalled_at, self.api.live
            if self.stage == "running":
                print(f"shutting down: {len(live)} generations in flight, {self.grace:g} s to finish", flush=True)
                self.stage = "draining"
            if waited >= self.grace and self.stage == "draining":
                if live:
                    print(f"shutting down: {len(live)} generations cancelled", flush=True)
                for job in live:
                    job.cancelled.set()
                self.stage = "cancelled"
            self.should_exit = not live or waited >= self.grace + self.CANCEL_WAIT
        return await super().on_tick(counter)


def parse_args(argv=None):
    p = generate.model_flags(cli_parser(__doc__))
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int_flag(0, 65535), default=8000, help="0: any free port (the ready line names it)")
    p.add_argument("--api_key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ requests")
    p.add_argument("--max_queue", type=int_flag(1), default=16, help="requests waiting at most; more get 503")
    p.add_argument("--allowed_origins", default="*",
                   help="comma-separated origins whose pages may call the API (CORS; a preflight needs no key); "
                        "'' allows none")
    p.add_argument("--served_model_name", action="append", default=None,
                   help="a name requests may give as model besides the checkpoint's own id (repeatable; default: "
                        "eaglet); any other name gets 404")
    p.add_argument("--max_batch", type=int_flag(1), default=1,
                   help="greedy requests that wait together run as one batch of up to this many rows, each row "
                        "exactly its own reply (caches of this many rows)")
    p.add_argument("--shutdown_grace", type=float_flag(0, 3600), default=5.0,
                   help="on SIGTERM / SIGINT, seconds the replies in flight may run on before they are cancelled "
                        "(new requests get 503 at once; a second signal exits at once)")
    args = p.parse_args(argv)
    generate.check_model_flags(p, args)
    # what generate.load reads beside the model flags: a server is one long conversation, as --interactive
    defaults = dict(interactive=True, chat=False, system=None, prompts=None, json_out=None, batch_size=None,
                    max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, stop=None)
    for name, value in defaults.items():
        setattr(args, name, value)
    return args


def listening_socket(host: str, port: int) -> socket.socket:
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise EagletError(f"cannot listen on {host}:{port}: {e.strerror}")
    return sock


def main(argv=None):
    args = parse_args(argv)
    try:
        args.device = generate.pick_device(args.device)
        args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
        sock = listening_socket(args.host, args.port)
        engine = Engine(args, args.max_queue, args.max_batch)
    except EagletError as e:
        sys.exit(f"error: {e}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: listening on {args.host} without --api_key: anyone who reaches it can use it")
    host, port = sock.getsockname()[:2]
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    api = Server(engine, args.api_key, origins, args.served_model_name or ["eaglet"])
    # timeout_graceful_shutdown: a connection still open once the replies are done or cancelled gets 1 s more
    server = DrainingUvicorn(uvicorn.Config(api.app, log_level="warning", timeout_graceful_shutdown=1), api,
                             args.shutdown_grace)
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the ready line: a signal right after it is a drain too
        signal.signal(sig, server.handle_exit)
    print(f"eaglet serving {engine.name} at http://{host}:{port} (OpenAI API under /v1, a chat page at /)", flush=True)
    server.run(sockets=[sock])  # returns after the first SIGTERM / SIGINT, within the bound above
    sys.stdout.flush()
    sys.stderr.flush()
    # not the interpreter's teardown: it takes a second with torch loaded, and the engine may still be in a prefill
    os._exit(0)


if __name__ == "__main__":
    main()
