"""The server's HTTP side and its process: the routes, the API key and the body's size, a request queued and its reply
streamed or sent whole, a shutdown within a bound; the page serve.html. serve.py's flags start it (run).
"""
import asyncio
import hmac
import json
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse

from checkpoint import EagletError
from load import pick_device
from server.engine import Engine
from server.fields import ApiError, model_of
from server.replies import StreamReply, prompt_firsts, whole_reply
from server.requests import Requests

PAGE = Path(__file__).resolve().parent / "serve.html"
MAX_BODY = 1 << 20  # bytes of a request body


class Server:
    """The HTTP side: parse and check a request, queue it, stream or return its reply."""

    def __init__(self, engine: Engine, api_key: Optional[str], allowed_origins=("*",), aliases=("eaglet",),
                 reasoning_parser: str = "auto"):
        self.engine, self.api_key = engine, api_key
        self.draining, self.live = False, set()  # live: the jobs of replies not yet sent whole
        self.model_ids = [engine.name] + [a for a in aliases if a != engine.name]
        self.requests = Requests(engine, self.model_ids, reasoning_parser)
        self.app = app = FastAPI(title="eaglet", docs_url=None, redoc_url=None, openapi_url=None)
        for path, route in (("/", self.page), ("/health", self.health), ("/metrics", self.metrics),
                            ("/v1/models", self.models)):  # HEAD too: monitors and load testers probe with it
            app.add_api_route(path, route, methods=["GET", "HEAD"])
        app.add_api_route("/v1/models/{name:path}", self.model, methods=["GET", "HEAD"])  # a name may hold slashes
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_middleware(Guarded, check=self.guard)
        if allowed_origins:  # added last, so outermost: a preflight is answered before the key is asked for
            app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "HEAD", "POST"],
                               allow_headers=["*"], max_age=600)
        app.exception_handler(404)(lambda r, e: ApiError(404, f"no such path: {r.url.path}").response())
        app.exception_handler(405)(lambda r, e: ApiError(405, f"{r.method} is not allowed on {r.url.path}").response())

    def guard(self, request: Request) -> Optional[JSONResponse]:
        """The refusal of a wrong API key (compared in constant time) or a body too large, before any route runs."""
        if self.api_key and request.url.path.startswith("/v1/") and request.method != "OPTIONS":
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            # (the scheme's name is case-insensitive in HTTP: "bearer" is "Bearer")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
                return ApiError(401, "a missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key").response()
        length = request.headers.get("content-length")
        if length is not None and (not (length.isascii() and length.isdigit()) or int(length) > MAX_BODY):
            return ApiError(413, f"the request body is over {MAX_BODY} bytes").response()
        return None

    async def page(self):
        return FileResponse(PAGE, media_type="text/html")

    async def health(self):  # 503 once shutting down, so that a load balancer sends no more
        return JSONResponse({"status": "shutting down"}, 503) if self.draining else {"status": "ok"}

    async def metrics(self):
        return PlainTextResponse(self.engine.metrics.text(self.engine.queue_depth()))

    async def models(self):
        return {"object": "list", "data": [model_object(name) for name in self.model_ids]}

    async def model(self, name: str):
        try:
            return model_object(model_of({"model": name}, self.model_ids))
        except ApiError as e:
            return e.response()

    async def chat_completions(self, request: Request):
        return await self.complete(request, chat=True)

    async def completions(self, request: Request):
        return await self.complete(request, chat=False)

    async def complete(self, request: Request, chat: bool):
        route, t0 = request.url.path, time.perf_counter()
        if self.draining:
            return self.refuse_draining(route)
        try:
            body = await self.body(request)  # then the template, tokenizing and the grammar in a worker thread:
            jobs, stream, usage_in_stream = await asyncio.to_thread(  # every other stream's chunks go on meanwhile
                self.requests.jobs, body, chat, asyncio.get_running_loop())
        except ApiError as e:
            self.engine.metrics.count("refused")
            log_request(route, e.status, why=e.message)
            return e.response()
        if self.draining:  # it began while the request was prepared
            return self.refuse_draining(route)
        if not self.engine.submit(jobs):  # all or none
            self.engine.metrics.count("queue_full")
            log_request(route, 503, why="the queue is full")
            return ApiError(503, "the server is busy: its queue is full; try again shortly").response(
                {"Retry-After": "1"})
        self.live.update(jobs)
        reply_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        model = body["model"] if body.get("model") in self.model_ids else self.engine.name  # the name it was asked by
        head = {"id": reply_id, "created": int(time.time()), "model": model,
                "object": "chat.completion.chunk" if chat else "text_completion"}
        if stream:
            return StreamingResponse(self.chunks(jobs, head, chat, usage_in_stream, route, t0),
                                     media_type="text/event-stream")
        return await self.whole(request, jobs, head, chat, t0)

    def refuse_draining(self, route: str) -> JSONResponse:
        self.engine.metrics.count("refused")
        log_request(route, 503, why="shutting down")
        return ApiError(503, "the server is shutting down", code="shutting_down").response({"Connection": "close"})

    async def body(self, request: Request) -> dict:
        raw = bytearray()
        async for part in request.stream():  # read no further than MAX_BODY: a body without Content-Length too
            raw += part
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
            # JSON's \ud800 escapes decode to lone surrogates, text no tokenizer or grammar can take
            json.dumps(body, ensure_ascii=False).encode()
        except RecursionError:
            raise ApiError(400, "the request body is not valid JSON: nested too deeply")
        except UnicodeEncodeError:
            raise ApiError(400, "the request body holds text that is not Unicode (an unpaired surrogate escape, "
                                "e.g. \\ud800)")
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def chunks(self, jobs: list, head: dict, chat: bool, usage_in_stream: list, route: str, t0: float):
        """Server-sent events: one chunk per cycle (its choice's index), a last one per choice with its finish_reason,
        usage if asked, [DONE]. Leaving early (the client went away) cancels the jobs: the engine stops at the end
        of the cycle under way."""
        (usage_at_end, usage_each_chunk), finished, failed = usage_in_stream, {}, None
        reply = StreamReply(jobs, head, chat, usage_each_chunk)
        try:
            async for index, kind, value in events(jobs):
                if kind == "text":
                    for chunk in reply.text(index, value):
                        yield chunk
                elif kind == "done" and value is not None:
                    finished[index] = value
                    for chunk in reply.done(index, value):
                        yield chunk
                elif kind == "error":
                    failed = value
                    yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
            if usage_at_end and len(finished) == len(jobs):
                yield reply.usage(finished)
            yield "data: [DONE]\n\n"
        finally:
            self.release(jobs)
            log_request(route, 200, finished, time.perf_counter() - t0, failed, streamed=True, jobs=jobs)

    async def whole(self, request: Request, jobs: list, head: dict, chat: bool, t0: float):
        """The whole reply as one JSON object; a client that goes away while it waits cancels the jobs."""
        done, route = {}, request.url.path
        try:
            async for index, kind, value in events(jobs, request):
                if kind == "done" and value is not None:
                    done[index] = value
                elif kind == "error":
                    log_request(route, 500, done, time.perf_counter() - t0, value, jobs=jobs)
                    return ApiError(500, f"generation failed: {value}").response()
        finally:
            self.release(jobs)
        if len(done) < len(jobs):
            log_request(route, 499, done, time.perf_counter() - t0, "the client went away",
                        jobs=jobs)
            return ApiError(499, "the client went away").response()
        log_request(route, 200, done, time.perf_counter() - t0, jobs=jobs)
        return whole_reply(jobs, done, head, chat)

    def release(self, jobs: list):
        self.live.difference_update(jobs)
        for job in jobs:
            job.cancelled.set()  # no-op when it ended; else the engine stops at the end of the cycle


def model_object(name: str) -> dict:
    return {"id": name, "object": "model", "owned_by": "eaglet", "created": 0}


class Guarded:
    """An ASGI app behind a check that may answer a request first (Server.guard). Plain ASGI rather than
    @app.middleware("http"): starlette's BaseHTTPMiddleware hands the route a request whose is_disconnected()
    never sees its client leave, so a whole reply's generation ran on for nobody while the queue waited."""

    def __init__(self, app, check):
        self.app, self.check = app, check

    async def __call__(self, scope, receive, send):
        refusal = self.check(Request(scope)) if scope["type"] == "http" else None
        await (refusal or self.app)(scope, receive, send)


def log_request(route: str, status: int, done: Optional[dict] = None, seconds: float = 0.0, why: Optional[str] = None,
                streamed: bool = False, jobs: tuple = ()):
    """One line a request: its route and status, then its tokens (the prompt's as usage counts them: each distinct
    prompt of the jobs once, not once a choice), tau and seconds (a reply), or why it was refused."""
    line = f"request: POST {route} {status}"
    if done:
        records = list(done.values())
        prompt = sum(len(job.prompt) for job in prompt_firsts(jobs))
        completion = sum(r["completion_tokens"] for r in records)
        cycles = sum(r["eaglet"]["cycles"] for r in records)
        emitted = sum(r["eaglet"]["tau"] * r["eaglet"]["cycles"] for r in records if r["eaglet"]["tau"])
        line += f", {len(records)} choice{'s' * (len(records) > 1)}, prompt {prompt} tokens, completion {completion}" + \
            (f", tau {emitted / cycles:.2f}" if cycles else "") + f", {seconds:.2f} s" + (", streamed" if streamed else "")
    if why:
        line += f": {why}"
    print(line, flush=True)


DISCONNECT_CHECK_S = 0.25


async def events(jobs: list, request: Optional[Request] = None):
    """The jobs' events, (choice index, kind, value), until each is done; with request, stop early when its
    client disconnects, asked every DISCONNECT_CHECK_S whether events come or not (a cycle's event comes more
    often than that: asked only when none came, a client that left was never noticed)."""
    left, asked = len(jobs), time.monotonic()
    while left:
        try:
            event = await asyncio.wait_for(jobs[0].events.get(), timeout=DISCONNECT_CHECK_S)
        except asyncio.TimeoutError:
            event = None
        if request is not None and time.monotonic() - asked >= DISCONNECT_CHECK_S:
            if await request.is_disconnected():
                return
            asked = time.monotonic()
        if event is not None:
            yield event
            left -= event[1] in ("done", "error")


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
            if not live or waited >= self.grace + self.CANCEL_WAIT:
                print("shutting down: " + ("every reply ended" if not live else
                      f"{len(live)} replies still running: exiting anyway") + f", {waited:.2f} s after the signal",
                      flush=True)
                self.should_exit = True
        return await super().on_tick(counter)


def listening_socket(host: str, port: int) -> socket.socket:
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise EagletError(f"cannot listen on {host}:{port}: {e.strerror}")
    return sock


def run(args):
    """The server of serve.py's flags: the engine loaded, then HTTP until the first SIGTERM / SIGINT; exits."""
    try:
        args.device = pick_device(args.device)
        args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
        sock = listening_socket(args.host, args.port)
        engine = Engine(args, args.max_queue, args.max_batch)
    except EagletError as e:
        sys.exit(f"error: {e}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: listening on {args.host} without --api_key: anyone who reaches it can use it")
    host, port = sock.getsockname()[:2]
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    api = Server(engine, args.api_key, origins, args.served_model_name or ["eaglet"], args.reasoning_parser)
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
