"""Load on a running serve.py: N concurrent clients, M streamed requests in all. Prints throughput, time to first
token and inter-token latency (p50 / p99), errors by kind, and at concurrency 1 the server's overhead: the
tokens/s a client sees against the tokens/s generate() measured for the same generation (what generate.py
prints), so the difference is HTTP, queueing and streaming.

    python serve.py --port 8000 &
    python scripts/load_test.py --url http://127.0.0.1:8000 --clients 4 --requests 32 --max_tokens 64

Standard library only (http.client, threads): nothing to install beside the server.
"""
import argparse
import http.client
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

PROMPTS = ["def read_lines(path):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef main():\n",
           "def add(a, b):\n"]


def streamed_request(url: str, prompt: str, max_tokens: int, api_key: str = None, timeout: float = 300) -> dict:
    """One streamed completion: seconds to the first text and in all, tokens, generate()'s own tokens/s; or the
    error's kind."""
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, headers)
        response = conn.getresponse()
        if response.status != 200:
            return {"error": f"HTTP {response.status}"}
        first = last = None
        tokens, engine = 0, None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first or time.perf_counter()
                last = time.perf_counter()
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                engine = chunk["eaglet"]["tokens_per_s"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
    except (OSError, http.client.HTTPException) as e:
        return {"error": type(e).__name__}
    finally:
        conn.close()
    if first is None:
        return {"error": "no text"}
    return {"ttft": first - t0, "seconds": end - t0, "tokens": tokens, "engine_tokens_per_s": engine,
            "itl": (last - first) / (tokens - 1) if tokens > 1 else None}


def percentile(values: list, p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] if values else float("nan")


def run(url: str, clients: int, requests: int, max_tokens: int, api_key: str = None) -> dict:
    """requests spread over clients threads; the figures of load_test's summary."""
    results, lock, next_request = [], threading.Lock(), iter(range(requests))

    def client():
        while True:
            with lock:
                i = next(next_request, None)
            if i is None:
                return
            result = streamed_request(url, PROMPTS[i % len(PROMPTS)], max_tokens, api_key)
            with lock:
                results.append(result)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    itl = [r["itl"] for r in ok if r["itl"] is not None]
    summary = {"clients": clients, "requests": requests, "completed": len(ok), "seconds": wall,
               "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
               "ttft_p50_s": percentile([r["ttft"] for r in ok], 50), "ttft_p99_s": percentile([r["ttft"] for r in ok], 99),
               "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
               "errors": dict(Counter(r["error"] for r in results if "error" in r))}
    if clients == 1 and ok:  # a client's tokens/s against generate()'s own timing of the same generations
        client_rate = sum(r["tokens"] for r in ok) / sum(r["seconds"] for r in ok)
        engine_rate = sum(r["tokens"] for r in ok) / sum(r["tokens"] / r["engine_tokens_per_s"] for r in ok)
        summary.update(client_tokens_per_s=client_rate, generate_tokens_per_s=engine_rate,
                       server_overhead=1 - client_rate / engine_rate)
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--requests", type=int, default=32, help="requests in all")
    p.add_argument("--max_tokens", type=int, default=64, help="tokens a reply")
    p.add_argument("--api_key", default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the summary as JSON here (a new file)")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        sys.exit("error: --clients, --requests and --max_tokens must be at least 1")
    if args.out is not None and args.out.exists():
        sys.exit(f"error: {args.out} exists; give a new file")
    try:
        http.client.HTTPConnection(urlparse(args.url).hostname, urlparse(args.url).port or 80, timeout=10).request("GET", "/health")
    except (OSError, ValueError) as e:
        sys.exit(f"error: no server answers at {args.url}: {e}")
    print(f"{args.requests} requests of {args.max_tokens} tokens from {args.clients} clients ...", flush=True)
    summary = run(args.url, args.clients, args.requests, args.max_tokens, args.api_key)
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
