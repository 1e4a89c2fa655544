"""serve.py's event loop does no slow work: a request with a large schema, whose compile is made SLOW seconds longer
here (a sleep inside grammar.Constraint, the compile), is compiled once for its n choices and off the loop, so a
stream already running keeps getting its chunks meanwhile. The bound on the stream's gaps is generous (a loaded
2-core machine) yet well below SLOW: a compile on the loop would hold every chunk for the whole sleep."""
import sys
import threading
import time

import pytest

from conftest import HANG_S, launch_server

pytest.importorskip("llguidance", reason="structured output's grammar engine: pip install llguidance")
try:  # the HTTP client openai comes with (httpx2 in its newer releases, httpx before)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

SLOW = 6.0  # seconds the compile sleeps (the gap bound below is half of it: room for a loaded machine)
GAP = SLOW / 2  # the largest gap allowed between the running stream's chunks
# serve.py with the compile slowed and timed, and each chunk of a reply 5 ms apart at least, so that the running
# stream outlasts the compile on any machine (it is closed once the compile is done)
LAUNCH = f"""
import sys, time
import grammar, serve
from server.engine import Engine
compile_grammar, stream = grammar.Constraint.__init__, Engine.stream

def slow_compile(self, *args, **kwargs):
    print(f"compiling {{time.time():.3f}}", flush=True)
    time.sleep({SLOW})
    compile_grammar(self, *args, **kwargs)
    print(f"compiled {{time.time():.3f}}", flush=True)

def paced_stream(self, job):
    streamer, state, on_tokens = stream(self, job)
    return streamer, state, lambda new: time.sleep(0.005) or on_tokens(new)

grammar.Constraint.__init__, Engine.stream = slow_compile, paced_stream
serve.main(sys.argv[1:])
"""
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name"],  # 120 fields of four kinds
          "properties": {"name": {"type": "string", "maxLength": 12}} | {
              f"field_{i}": [{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": 0, "maximum": 999},
                             {"enum": ["red", "green", "blue"]}, {"type": "array", "items": {"type": "boolean"}}][i % 4]
              for i in range(120)}}


def test_a_slow_grammar_compile_does_not_hold_up_a_running_stream():
    proc, url, _ = launch_server([sys.executable, "-c", LAUNCH, "--port", "0", "--no_draft"])
    lines = []
    try:
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        replies = []
        schema_request = threading.Thread(target=lambda: replies.append(httpx.post(url + "/v1/completions", json={
            "prompt": "def f():\n", "max_tokens": 12, "temperature": 0, "n": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": SCHEMA}}}, timeout=HANG_S)))
        arrivals, compiled = [], None
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "def read_lines(path):\n", "max_tokens": 1900,
                                                                 "temperature": 0, "stream": True}, timeout=HANG_S) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                arrivals.append(time.time())
                if len(arrivals) == 1:
                    schema_request.start()
                compiled = compiled or next((float(l.split()[1]) for l in lines if l.startswith("compiled ")), None)
                if compiled is not None and arrivals[-1] > compiled + 0.5:
                    break  # leaving: the engine stops this stream and runs the schema request's choices
        schema_request.join(timeout=HANG_S)
        assert compiled is not None, "the stream ended before the compile did"
        compiling = [float(l.split()[1]) for l in lines if l.startswith("compiling ")]
        assert len(compiling) == 1  # once for the request's three choices
        during = [t for t in arrivals if compiling[0] < t < compiled]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        print(f"{len(during)} chunks during the {compiled - compiling[0]:.2f} s compile, the largest gap "
              f"{max(gaps):.3f} s (bound {GAP} s)")
        assert len(during) >= 3 and max(gaps) < GAP
        reply = replies[0].json()
        assert replies[0].status_code == 200 and len(reply["choices"]) == 3, reply
        assert all(c["text"].startswith('{"') for c in reply["choices"])
    finally:
        proc.kill()
        proc.wait()
