"""serve.py --compile compiles before it answers and never while it answers: its warm-up compiles the cycle's
graphs and the plain step's it steps aside to (greedy or sampled, logprobs or not, penalized or not), then fourteen
requests, each with a temperature, top_p, top_k, min_p, penalties and logprobs of its own, compile nothing (torch's graph count, printed by the engine as it finishes each reply) and are all answered."""
import sys

import pytest

from conftest import HANG_S, launch_server

try:  # the HTTP client openai comes with (httpx2 in its newer releases, httpx before)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

# serve.py printing torch's count of compiled graphs after its warm-up and before each reply's last event
# (dynamo's count, which is what this checks, whatever runs the graphs: the AOTAutograd tracer does here, as
# conftest.traced_compile says why; inductor's CPU code for these graphs is held to eager code in test_sampling.py
# and test_penalties.py)
LAUNCH = """
import sys
import torch
from torch._dynamo.utils import counters
compile_ = torch.compile
torch.compile = lambda model=None, **kwargs: compile_(model, **{**kwargs, "backend": "aot_eager"})
import serve
from server.engine import Engine
start_step_aside, finish = Engine.start_step_aside, Engine.finish

def counting_warm_up(self, args):  # the engine's last warm-up: its plain step's, for stepping aside
    start_step_aside(self, args)
    print(f"graphs after warm-up {counters['stats']['unique_graphs']}", flush=True)

def counting_finish(self, job, *args):
    print(f"graphs {counters['stats']['unique_graphs']}", flush=True)
    finish(self, job, *args)

Engine.start_step_aside, Engine.finish = counting_warm_up, counting_finish
serve.main(sys.argv[1:])
"""
SETTINGS = [{"temperature": 0}, {"temperature": 0.7}, {"temperature": 1.3, "top_p": 0.9}, {"temperature": 0.9, "top_k": 3},
            {"temperature": 1.1, "top_p": 0.8, "top_k": 40}, {"temperature": 0.5, "logprobs": 0},
            {"temperature": 1.0, "logprobs": 3}, {"temperature": 0, "logprobs": 5}, {"temperature": 2.0, "top_k": 1},
            {"temperature": 0.6, "top_p": 0.5, "logprobs": 2}, {"temperature": 0.001}, {"temperature": 0.25, "seed": 7},
            {"temperature": 0, "frequency_penalty": 0.4, "logit_bias": {"13": -3}}, {"temperature": 0.8, "min_p": 0.1,
                                                                                  "repetition_penalty": 1.2}]


@pytest.mark.slow  # the cycle and the plain step compiled four times each on a CPU
def test_a_compiled_server_compiles_nothing_for_new_sampling_settings():
    proc, url, lines = launch_server([sys.executable, "-c", LAUNCH, "--port", "0", "--compile"])
    try:
        warm = int(next(l for l in lines if l.startswith("graphs after warm-up")).split()[-1])
        assert warm == 12  # the cycle's and the plain step's: greedy or sampled, logprobs or not, penalized or not
        for settings in SETTINGS:
            reply = httpx.post(url + "/v1/completions", json={"prompt": "def read_lines(path):\n", "max_tokens": 24,
                                                              **settings}, timeout=HANG_S)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert reply.json()["usage"]["completion_tokens"] > 0 and choice["finish_reason"] in ("length", "stop")
            if "logprobs" in settings:  # k alternatives, and the sampled token among them (OpenAI's rule)
                k, tops = settings["logprobs"], choice["logprobs"]["top_logprobs"]
                assert tops and all(max(k, 1) <= len(top) <= k + 1 for top in tops), tops
            line = ""
            while not line.startswith("graphs "):
                line = proc.stdout.readline()
                assert line, "serve.py ended"
            assert int(line.split()[-1]) == warm, (settings, line)
    finally:
        proc.kill()
        proc.wait()
