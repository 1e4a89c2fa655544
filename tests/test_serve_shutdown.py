"""serve.py's shutdown as a supervisor meets it: a real server on the demo, real signals. SIGTERM with a long streamed
reply and a long whole one in flight: new requests get 503 at once, the replies run on for --shutdown_grace seconds,
then end cleanly (finish_reason "abort", the stream's [DONE]) and the process exits 0 soon after; idle, it exits at
once; a second signal ends it at once."""
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import HANG_S, ROOT, until, wait_ready

openai = pytest.importorskip("openai", reason="the official client: pip install openai")
try:  # the HTTP client openai comes with (httpx2 in its newer releases, httpx before)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx", reason="comes with openai")

GRACE = 2.0
LONG = 1500  # tokens: far more than the demo makes on a CPU in the grace


# serve.py with the backstop after the grace at a minute, not 2 s: on a loaded machine the cancelled replies may take
# longer to end than 2 s, and what the tests ask is that they end by themselves once cancelled, not how fast
LAUNCH = """
import sys
from server.app import DrainingUvicorn
import serve
DrainingUvicorn.CANCEL_WAIT = 60.0
serve.main(sys.argv[1:])
"""


class Served:
    """`python serve.py --port 0 FLAGS` once its ready line names the port; its output lines, with their times."""

    def __init__(self, *flags):
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "--port", "0", *flags], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url, self.lines = wait_ready(self.proc)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def signal(self, sig) -> float:
        self.proc.send_signal(sig)
        return time.monotonic()

    def exit(self, signalled_at: float) -> tuple:
        """(exit status, seconds from the signal to the exit as this test saw them: a loaded machine adds to them)."""
        status = self.proc.wait(timeout=HANG_S)
        return status, time.monotonic() - signalled_at

    def ended(self) -> tuple:
        """(how the server says the shutdown ended, the seconds after the signal by its own clock)."""
        line = next(line for line in self.lines if line.startswith("shutting down: ") and " after the signal" in line)
        how, seconds = line.removeprefix("shutting down: ").rsplit(", ", 1)
        return how, float(seconds.split()[0])

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def served():
    started = []
    yield lambda *flags: started.append(Served(*flags)) or started[-1]
    for s in started:
        s.close()


def stream_lines(url: str, out: dict, first_text: threading.Event):
    """A long streamed chat reply read raw, line by line (the client library hides [DONE])."""
    body = {"messages": [{"role": "user", "content": "def read_lines(path):"}], "max_tokens": LONG, "temperature": 0,
            "stream": True}
    out["lines"] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=HANG_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["lines"].append(line[6:])
                if '"content": "' in line and '"content": ""' not in line:
                    first_text.set()


def read_until_reset(url: str, out: dict, first_text: threading.Event):
    try:
        stream_lines(url, out, first_text)
    except httpx.HTTPError:
        pass


def whole_reply(url: str, out: dict):
    """A long whole completion, n 2, through the official client."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    out["reply"] = client.completions.create(model="eaglet", prompt="def read_lines(path):\n", max_tokens=LONG,
                                             temperature=0, n=2)


def queue_depth(url: str) -> int:
    """The requests waiting in the server's queue (its /metrics gauge; a whole reply's later choices count too)."""
    text = httpx.get(url + "/metrics", timeout=HANG_S).text
    return int(next(line for line in text.splitlines() if line.startswith("eaglet_queue_depth ")).split()[1])


def check_refused_while_draining(url: str):
    until(lambda: httpx.get(url + "/health", timeout=HANG_S).status_code == 503, "the server took the signal")
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=HANG_S)
    error = r.json()["error"]
    assert r.status_code == 503 and error["code"] == "shutting_down" and set(error) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health", timeout=HANG_S).status_code == 503


@pytest.mark.parametrize("running", ["stream", "whole"])
def test_sigterm_ends_the_replies_in_flight_within_the_grace(served, running):
    """The reply the engine runs (streamed, or the whole one's first choice) ends with what it generated and
    finish_reason abort; the one queued behind it (the other) ends empty, abort too; the stream ends with [DONE];
    exit 0, after the grace and well before the grace plus the cancel backstop."""
    server = served("--shutdown_grace", str(GRACE), "--max_queue", "4")
    streamed, whole, first_text = {}, {}, threading.Event()
    threads = [threading.Thread(target=stream_lines, args=(server.url, streamed, first_text)),
               threading.Thread(target=whole_reply, args=(server.url, whole))]
    if running == "whole":
        threads.reverse()
    threads[0].start()
    if running == "stream":
        assert first_text.wait(HANG_S), "the stream sent no text"
    else:
        time.sleep(1.0)  # the whole reply's first choice is generating (its request reached the engine)
    before = queue_depth(server.url)
    threads[1].start()
    until(lambda: queue_depth(server.url) > before, "the second request waits behind the first")
    signalled_at = server.signal(signal.SIGTERM)
    check_refused_while_draining(server.url)
    status, seconds = server.exit(signalled_at)
    for t in threads:
        t.join(timeout=HANG_S)
    assert status == 0 and seconds >= GRACE, server.lines
    how, waited = server.ended()  # the replies ended once cancelled: the server did not wait out its backstop
    assert how == "every reply ended" and waited >= GRACE, server.lines

    lines = streamed["lines"]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["abort"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    choices = whole["reply"].choices
    assert [c.finish_reason for c in choices] == ["abort", "abort"] and [c.index for c in choices] == [0, 1]
    if running == "stream":
        assert text and choices[0].text == choices[1].text == "" and whole["reply"].usage.completion_tokens == 0
    else:
        assert text == "" and choices[0].text and choices[1].text == ""
        assert 0 < whole["reply"].usage.completion_tokens < LONG
    assert any("generations cancelled" in line for line in server.lines)


def test_an_idle_server_exits_at_once_on_sigint(served):
    server = served("--no_draft")
    status, _ = server.exit(server.signal(signal.SIGINT))
    how, waited = server.ended()  # the grace (5 s by default) not waited out: nothing was in flight
    assert status == 0 and how == "every reply ended" and waited < 5.0, (status, server.lines)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    socket.create_server((host, int(port))).close()  # the port is free again


def test_a_second_signal_ends_it_at_once(served):
    """A grace of a minute, a stream in flight: the second SIGTERM does not wait for it."""
    server = served("--shutdown_grace", "60")
    streamed, first_text = {}, threading.Event()
    threading.Thread(target=read_until_reset, args=(server.url, streamed, first_text), daemon=True).start()
    assert first_text.wait(HANG_S), "the stream sent no text"
    server.signal(signal.SIGTERM)
    check_refused_while_draining(server.url)
    status, seconds = server.exit(server.signal(signal.SIGTERM))
    assert status == -signal.SIGTERM and seconds < 30, (status, seconds)  # the grace is 60 s: not waited out
