"""serve.py as its users meet it: a real server on a free loopback port serving the demo, talked to by the official
openai client (and by raw HTTP for what a client library hides): replies equal generate()'s greedy output token for
token, streamed or not; stop strings, usage, seeds; concurrent clients, a full queue, a client that leaves; every
bad input's status and error JSON; prefix reuse on a three-turn chat."""
import json
import re
import socket
import sys
import threading
import time

import pytest
import torch

from conftest import HANG_S, ROOT, launch_server, until

openai = pytest.importorskip("openai", reason="the official client: pip install openai")
try:  # the HTTP client openai comes with (httpx2 in its newer releases, httpx before)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx", reason="comes with openai")

from decode import generate  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from load import load_draft, load_target  # noqa: E402
from chat import TextStreamer  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

DEMO = ROOT / "demo"
LOGS = {}  # a started server's URL -> the lines it has printed
PROMPTS = ["def read_lines(path):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef main():\n",
           "def add(a, b):\n"]


def start_server(*flags) -> tuple:
    """(process, base URL) of `python serve.py --port 0 FLAGS`, once its ready line names the port."""
    proc, url, _ = launch_server([sys.executable, str(ROOT / "serve.py"), "--port", "0", *flags])
    LOGS[url] = []
    threading.Thread(target=lambda: LOGS[url].extend(proc.stdout), daemon=True).start()  # keep its pipe drained
    return proc, url


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--max_queue", "3", "--step_aside", "off")  # cycles throughout (stepping aside:
    yield url  # tests/test_step_aside.py)
    proc.terminate()
    assert proc.wait(timeout=HANG_S) in (0, -15)  # SIGTERM: uvicorn shuts down, then ends by the signal it caught
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socket.create_server((host, int(port))).close()  # the port is free again


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """generate()'s own greedy reply (text, tokens) on the demo with its head, as generate.py decodes it."""
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 1024)
    draft = load_draft(DEMO / "head" / "draft.pth", target)
    tokenizer = Tokenizer(DEMO / "target")

    def reply(prompt: list, n: int, stop=()):
        streamer = TextStreamer(tokenizer, prompt, enabled=False, stop=stop)
        result = generate(target, prompt, n, SamplingConfig(), eos_ids=tokenizer.eos_ids, draft=draft,
                          on_tokens=streamer)
        streamer.flush()
        return streamer.text, result.tokens
    reply.tokenizer, reply.target = tokenizer, target
    return reply


def test_completions_equal_generate_streamed_or_not(client, reference):
    for prompt in PROMPTS[:2]:
        text, tokens = reference(reference.tokenizer.encode(prompt), 40)
        whole = client.completions.create(model="eaglet", prompt=prompt, max_tokens=40, temperature=0)
        assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == len(tokens) == 40
        assert whole.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
        chunks = list(client.completions.create(model="eaglet", prompt=prompt, max_tokens=40, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 40
        assert len(chunks) < 40  # one chunk a cycle, not one a token


def test_chat_equals_generate_and_stop_strings_end_it_exactly(client, reference):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def read_lines(path):"}]
    prompt = reference.tokenizer.encode_chat(messages)
    text, _ = reference(prompt, 60)
    reply = client.chat.completions.create(model="eaglet", messages=messages, max_tokens=60, temperature=0)
    assert reply.choices[0].message.content == text and reply.choices[0].message.role == "assistant"
    # a stop string that first appears mid-reply: cut before it, finish_reason stop, streamed the same
    stop = next(s for s in ("\n    ", "(", " ") if s in text[3:])
    cut, cut_tokens = reference(prompt, 60, stop=[stop])
    assert cut == text[:text.index(stop)] and len(cut_tokens) < 60
    for stream in (False, True):
        got = client.chat.completions.create(model="eaglet", messages=messages, max_tokens=60, temperature=0,
                                             stop=[stop, "@@never@@"], stream=stream,
                                             stream_options={"include_usage": True} if stream else None)
        if stream:
            chunks = list(got)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
            assert chunks[-2].choices[0].finish_reason == "stop"
            usage = chunks[-1].usage
        else:
            assert got.choices[0].message.content == cut and got.choices[0].finish_reason == "stop"
            usage = got.usage
        assert usage.completion_tokens == len(cut_tokens)  # generation ended at the token that made the stop string
    # a stop string that never appears holds back its length less one at each cycle: all of it comes at the end
    chunks = list(client.chat.completions.create(model="eaglet", messages=messages, max_tokens=60, temperature=0,
                                                 stop="@@never@@", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [c.choices[0].delta.role for c in chunks] == ["assistant"] + [None] * (len(chunks) - 1)  # the first only


def test_seeded_sampling_repeats(client):
    def sample(seed):
        return client.completions.create(model="eaglet", prompt=PROMPTS[0], max_tokens=30, temperature=1.0,
                                         seed=seed).choices[0].text
    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_models_health_metrics(server, client):
    client.completions.create(model="eaglet", prompt=PROMPTS[0], max_tokens=4, temperature=0)  # one ok request at least
    assert [m.id for m in client.models.list().data] == ["target/model.pth", "eaglet"]  # its id, then the alias
    assert client.completions.create(model="target/model.pth", prompt="x", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.NotFoundError) as e:  # OpenAI answers 404 for a model it does not have
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    assert client.models.retrieve("target/model.pth").id == "target/model.pth"  # a name with a slash in it
    assert httpx.get(server + "/v1/models/eaglet").json() == {"id": "eaglet", "object": "model", "owned_by": "eaglet",
                                                               "created": 0}
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    metrics = httpx.get(server + "/metrics").text
    assert 'eaglet_requests_total{outcome="ok"}' in metrics and "eaglet_mean_tau " in metrics


BAD = [  # (path, body or raw bytes, status, param, words in the message)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "non-empty string"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "non-empty string"),
    ("/v1/chat/completions", {}, 400, "messages", "non-empty list"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages", "string"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "between"),
    ("/v1/completions", b'{"prompt": "x", "top_p": NaN}', 400, "top_p", "between"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "between"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens", "the cache holds"),
    ("/v1/completions", {"prompt": "x " * 5000}, 400, "prompt", "leaves no room for a reply"),  # no max_tokens sent
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "between"),
    ("/v1/completions", {"prompt": ["x"] * 5, "n": 4}, 400, "n", "at most 16"),
    ("/v1/completions", {"prompt": "x", "n": 4}, 400, "n", "never fit the queue of 3"),  # the fixture's --max_queue
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt", "non-empty"),
    ("/v1/completions", {"prompt": ["x", 3]}, 400, "prompt", "non-empty"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "x", "model": 123}, 400, "model", "must be a string"),
    ("/v1/completions", {"prompt": "x", "suffix": "\n}"}, 400, "suffix", "cannot honour"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                              "max_completion_tokens": 5}, 400, "max_tokens", "differ"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 5000}]}, 400, "messages",
     "leaves no room for a reply"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "between 0 and 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs", "integer"),  # True == 1
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs",
     "true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", "between 0 and 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs",
     "needs logprobs"),
    ("/v1/completions", {"prompt": "x", "n": True}, 400, "n", "integer"),  # True == 1
    ("/v1/completions", {"prompt": "x", "best_of": True}, 400, "best_of", "cannot honour"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools", "tools[0] must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}]}, 400, "tools", "no tool support"),  # the demo's template (LLaMA-2's) never reads tools
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "chat/completions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     400, "functions", "cannot honour"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", "tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}]}, 400, "messages", "empty prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "x"}]}, 400, "messages", "empty prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"},
                                           {"role": "system", "content": "z"}]}, 400, "messages",
     "not a system message there"),  # LLaMA-2's format has no place for it
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type":
        "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "call_2",
        "content": "x"}]}, 400, "messages", "answers no call"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {
        "name": "f", "arguments": "{oops"}}]}]}, 400, "messages", "tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "separate_reasoning": True}, 400,
     "separate_reasoning", "never thinks"),  # the demo's template (LLaMA-2's)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "separate_reasoning": "yes"}, 400,
     "separate_reasoning", "true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}, 400,
     "chat_template_kwargs", "object"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", 3]}, 400, "stop", "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "stream"),
    ("/v1/completions", {"prompt": "x", "cache_prompt": "no"}, 400, "cache_prompt", "true or false"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", "over max_tokens (4)"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object"}, "strict": "yes"}}}, 400, "response_format", "true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, 400, "tools", "of an object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f", "strict": "yes"}}]}, 400, "tools", "strict must be true or false"),
    ("/v1/completions", b"{" + b" " * (1 << 20) + b"}", 413, None, "over"),
    ("/v1/completions", b'{"prompt": "x", "temperature": ' + b"9" * 400 + b"}", 400, "temperature", "between"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10 ** 30}, 400, "max_tokens", "between"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\u00b2": 5}}, 400, "logit_bias", "token ids"),  # isdigit()
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\u0661": 5}}, 400, "logit_bias", "token ids"),  # int() reads 1
    ("/v1/completions", {"prompt": "x", "logit_bias": {"9" * 5000: 5}}, 400, "logit_bias", "token ids"),  # int()'s limit
    ("/v1/completions", {"prompt": "x", "echo": 1}, 400, "echo", "true or false"),  # 1 == True, yet not `is True`
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "false"}}, 400,
     "include_usage", "true or false"),  # a truthy string
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": 0}, 400,
     "parallel_tool_calls", "true or false"),
    ("/v1/completions", b"[" * 200000 + b"]" * 200000, 400, None, "nested too deeply"),
    ("/v1/completions", b'{"prompt": "abc \\ud800 def"}', 400, None, "not Unicode"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, None, "not Unicode"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "foo"}}}}, 400, "response_format", "Invalid type: foo"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format", "name"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}, 400, "response_format", "'yaml'"),
    ("/v1/completions", {"prompt": "x", "regex": "(["}, 400, "regex", "unclosed character class"),
    ("/v1/completions", {"prompt": "x", "regex": "[^\\x00-\\x{10FFFF}]"}, 400, "regex", "no token starts a text"),
    ("/v1/completions", {"prompt": "x", "guided_choice": [f"o{i}" for i in range(2001)]}, 400, "guided_choice",
     "max is 2000"),  # llguidance's limit, met at the first token: refused before decoding
    ("/v1/completions", {"prompt": "x", "regex": "a", "grammar": "start: x"}, 400, "grammar", "not several"),
    ("/v1/nowhere", {}, 404, None, "no such path"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto", "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tools", "none answers a call's results in text"),
    ("/v1/completions", {"prompt": "x", "n": 2, "use_beam_search": True}, 400, "use_beam_search", "cannot honour"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": 1}, 400, "use_beam_search", "cannot honour"),  # 1 == True
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "between 0.01 and 100"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 200}}, 400, "logit_bias", "from -100 to 100"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", "past the vocabulary"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", "between 0 and"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p", "between 0 and 1"),
    ("/v1/completions", {"prompt": "x", "echo": True, "stream": True}, 400, "echo", "answered whole"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "between 1 and"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2]}, 400, "stop_token_ids", "cannot honour"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, 400,
     "modalities", "cannot honour"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "no"}, 400,
     "parallel_tool_calls", "true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
     400, "chat_template_kwargs", "without"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, 400, "guided_choice", "non-empty list"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object", "schema": {"type": "foo"}}}, 400,
     "response_format", "Invalid type: foo"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD, ids=[f"{b[2]} {b[4]}" for b in BAD])
def test_bad_requests_get_openai_errors(server, path, body, status, param, words):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=raw, headers={"content-type": "application/json"}, timeout=HANG_S)
    error = r.json()["error"]
    assert r.status_code == status and error["param"] == param and words in error["message"], r.text
    assert set(error) == {"message", "type", "param", "code"}
    assert httpx.get(server + "/health").status_code == 200


def test_a_body_without_content_length_is_refused_once_it_passes_the_limit(server):
    """A chunked body (no Content-Length) is read no further than 1 MiB: the 413 comes while the client is still
    sending, not after whatever it sends (a server that read it all first would hold every byte in memory)."""
    import select
    host, port = server.removeprefix("http://").rsplit(":", 1)
    piece, sent = b"[" + b" " * (1 << 16), 0
    with socket.create_connection((host, int(port)), timeout=HANG_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        while sent < 8 << 20 and not select.select([sock], [], [], 0.01)[0]:  # until the server answers
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError):  # it answered and closed between the select and the send
                break
            sent += len(piece)
        if sent >= 8 << 20:
            sock.sendall(b"0\r\n\r\n")
        answer = b""
        while b"over 1048576 bytes" not in answer:  # the headers and the body may come apart
            part = sock.recv(65536)
            if not part:
                break
            answer += part
    assert answer.startswith(b"HTTP/1.1 413") and b"over 1048576 bytes" in answer, answer[:200]
    assert sent < 4 << 20


def test_wrong_method_and_the_context_numbers(server):
    r = httpx.get(server + "/v1/completions")
    assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": 100000})
    assert "(100000)" in r.json()["error"]["message"] and r.json()["error"]["code"] == "context_length_exceeded"


def test_concurrent_clients_get_their_own_replies_or_a_clear_503(server, reference):
    """8 clients x 3 requests against a queue of 3: each reply is its single-client reply, or 503 with
    Retry-After; none lost or mixed; the server answers afterwards."""
    expected = {p: reference(reference.tokenizer.encode(p), 24)[0] for p in PROMPTS}
    outcomes, lock = [], threading.Lock()

    def client_thread(i):
        for j in range(3):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            r = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0},
                           timeout=HANG_S)
            with lock:
                outcomes.append((prompt, r.status_code, r.json(), r.headers.get("retry-after")))
    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 24
    for prompt, status, body, retry in outcomes:
        assert status in (200, 503), body
        if status == 200:
            assert body["choices"][0]["text"] == expected[prompt]
        else:
            assert retry == "1" and "queue is full" in body["error"]["message"]
    assert sum(status == 200 for _, status, _, _ in outcomes) >= 3
    assert httpx.get(server + "/health").status_code == 200


def test_a_client_that_leaves_stops_its_generation(server, client, reference):
    def aborted():
        line = next(l for l in httpx.get(server + "/metrics").text.splitlines() if 'outcome="aborted"' in l) \
            if 'outcome="aborted"' in httpx.get(server + "/metrics").text else "x 0"
        return int(line.split()[-1])
    before = aborted()
    with httpx.stream("POST", server + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 900,
                                                               "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk read, then the connection closes
    until(lambda: aborted() > before, "the generation stopped once its client left")
    text, _ = reference(reference.tokenizer.encode(PROMPTS[1]), 16)
    assert client.completions.create(model="eaglet", prompt=PROMPTS[1], max_tokens=16, temperature=0).choices[0].text == text


def outcomes(server) -> dict:
    """/metrics' requests by outcome (ok, aborted, error)."""
    found = re.findall(r'eaglet_requests_total\{outcome="(\w+)"\} (\d+)', httpx.get(server + "/metrics").text)
    return {outcome: int(n) for outcome, n in found}


def test_a_client_that_leaves_a_whole_reply_stops_its_generation(server, client, reference):
    """Not streamed: a client that sends its request and leaves stops the generation (the server asks whether it is
    still there while the cycles' events come; it once asked only when none came, so a long reply ran to its end
    for nobody while the queue waited)."""
    before = outcomes(server)
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "ignore_eos": True}).encode()
    host, port = server.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: eaglet\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    ended = lambda: sum(outcomes(server).values()) > sum(before.values())  # noqa: E731
    until(ended, "the request left by its client ended")
    after = outcomes(server)
    assert after.get("aborted", 0) == before.get("aborted", 0) + 1 and after.get("ok", 0) == before.get("ok", 0), (before, after)
    text, _ = reference(reference.tokenizer.encode(PROMPTS[1]), 16)
    assert client.completions.create(model="eaglet", prompt=PROMPTS[1], max_tokens=16, temperature=0).choices[0].text == text


def three_turns(client, reuse: bool) -> tuple:
    """A three-turn chat (greedy, 20 tokens a reply): the replies and each turn's cached_tokens."""
    messages, replies, cached = [{"role": "system", "content": "Python only."}], [], []
    for turn in ("def read_lines(path):", "def add(a, b):", "class Stack:"):
        messages.append({"role": "user", "content": turn})
        r = client.chat.completions.create(model="eaglet", messages=messages, max_tokens=20, temperature=0,
                                           extra_body={"cache_prompt": reuse})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        replies.append(r.choices[0].message.content)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    return replies, cached


def test_prefix_reuse_keeps_replies_and_counts_cached_tokens(client):
    """With and without reuse (cache_prompt: false): the same replies; with it each later turn's prompt tokens up
    to the last reply come from the cache."""
    client.completions.create(model="eaglet", prompt="import sys\n", max_tokens=4, temperature=0)  # another cache
    with_reuse, cached = three_turns(client, True)
    without, none = three_turns(client, False)
    assert with_reuse == without and none == [0, 0, 0]
    assert cached[0] < 5 and cached[1] > 20 and cached[2] > cached[1]


def test_prefix_reuse_without_a_head():
    """Plain decoding prefills from the first new token on (a head re-reads the one before): a cached token whose
    K/V was never written (a reply's last, sampled but never fed back) would show here."""
    proc, url = start_server("--no_draft")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for prompt in PROMPTS:  # a reply continued: the next prompt holds the last one's tokens, all but its last cached
            replies = []
            for reuse in (True, False):
                first = client.completions.create(model="eaglet", prompt=prompt, max_tokens=20, temperature=0,
                                                   extra_body={"cache_prompt": reuse})
                second = client.completions.create(model="eaglet", prompt=prompt + first.choices[0].text + "\n",
                                                   max_tokens=20, temperature=0, extra_body={"cache_prompt": reuse})
                replies.append(second.choices[0].text)
                cached = second.usage.prompt_tokens_details.cached_tokens
                assert cached > first.usage.prompt_tokens if reuse else cached == 0
            assert replies[0] == replies[1], prompt
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)


def test_the_api_key_is_required_when_set():
    proc, url = start_server("--api_key", "s3cret", "--no_draft", "--checkpoint_path", str(DEMO / "target"))
    try:
        listed = httpx.get(url + "/v1/models", headers={"authorization": "Bearer s3cret"}).json()["data"]
        assert listed[0]["id"] == "target/model.pth"  # the checkpoint given as its folder: named by the file in it
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 401
        wrong = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret").completions.create(
            model="eaglet", prompt="x", max_tokens=2, temperature=0)
        assert good.usage.completion_tokens == 2
        for header in ("bearer s3cret", "BEARER s3cret"):  # the scheme's name is case-insensitive (RFC 9110)
            assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              headers={"authorization": header}).status_code == 200
        for header in ("s3cret", "Basic s3cret", "Bearer s3cret2", "Bearer"):
            assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              headers={"authorization": header}).status_code == 401, header
        assert httpx.get(url + "/health").status_code == 200  # health and metrics stay open
        # a page from another origin: its preflight is answered without the key (a browser sends none), the
        # request itself still needs it
        preflight = httpx.options(url + "/v1/chat/completions", headers={
            "origin": "http://elsewhere.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in (
            "*", "http://elsewhere.example")
        cross = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                           headers={"origin": "http://elsewhere.example", "authorization": "Bearer s3cret"})
        assert cross.status_code == 200 and "access-control-allow-origin" in cross.headers
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)


def test_max_batch_runs_waiting_greedy_requests_together_each_exact(reference):
    """--max_batch 4: greedy requests that wait together run as rows of one batch, each reply (its own max_tokens
    and stop string) exactly its single-client reply; a sampling request runs alone."""
    proc, url = start_server("--max_batch", "4", "--max_queue", "8")
    try:
        asks = [(PROMPTS[i % 4], 12 + 5 * i, "(" if i == 5 else None) for i in range(7)]
        expected = [reference(reference.tokenizer.encode(p), n, stop=[stop] if stop else ())[0] for p, n, stop in asks]
        replies = [None] * len(asks)

        def ask(i):
            prompt, n, stop = asks[i]
            replies[i] = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                                    "stop": stop}, timeout=HANG_S).json()
        sampled = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 1}, timeout=HANG_S))
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
        for t in threads[:1] + [sampled] + threads[1:]:
            t.start()
        for t in threads + [sampled]:
            t.join()
        for i, reply in enumerate(replies):
            assert reply["choices"][0]["text"] == expected[i], (i, reply)
            assert reply["usage"]["completion_tokens"] <= asks[i][1]
        metrics = httpx.get(url + "/metrics").text
        batched = int(next(l for l in metrics.splitlines() if l.startswith("eaglet_batched_requests_total")).split()[-1])
        assert batched >= 2  # some of them did run together
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)


def test_structured_output_through_the_openai_client(server, client):
    """response_format as the official client sends it: parse() with a pydantic model (a strict json_schema) gets
    a reply its own parser accepts; json_object and a streamed schema reply parse as JSON; a regex is matched; greedy
    replies are the same streamed or not; /metrics counts the constrained requests and the grammar's cuts."""
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal

    class Entry(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        kind: Literal["file", "dir"]
        size: int = pydantic.Field(ge=0, le=999)
        tags: list[str] = pydantic.Field(max_length=2)

    messages = [{"role": "user", "content": "def read_lines(path):"}]
    reply = client.chat.completions.parse(model="eaglet", messages=messages, response_format=Entry, temperature=0,
                                          max_tokens=120)
    entry = reply.choices[0].message.parsed
    assert isinstance(entry, Entry) and reply.choices[0].finish_reason == "stop", reply
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    whole = client.completions.create(model="eaglet", prompt="def f():\n", max_tokens=40, temperature=0,
                                      extra_body={"response_format": response_format})
    chunks = client.completions.create(model="eaglet", prompt="def f():\n", max_tokens=40, temperature=0, stream=True,
                                       extra_body={"response_format": response_format})
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text and 0 <= json.loads(streamed)["n"] <= 99
    anything = client.chat.completions.create(model="eaglet", messages=messages, temperature=0.7, seed=3, max_tokens=120,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    matched = client.completions.create(model="eaglet", prompt="def f():\n", max_tokens=20, temperature=0,
                                        extra_body={"regex": "    return [0-9]+\n"})
    assert re.fullmatch(r"    return [0-9]+\n", matched.choices[0].text)
    metrics = httpx.get(server + "/metrics").text
    assert int(re.search(r"eaglet_constrained_requests_total (\d+)", metrics).group(1)) >= 5
    assert int(re.search(r"eaglet_grammar_cuts_total (\d+)", metrics).group(1)) > 0
    assert int(re.search(r"eaglet_grammar_forced_tokens_total (\d+)", metrics).group(1)) > 0
    forced = [c.model_extra["eaglet"].get("forced") for c in client.completions.create(
        model="eaglet", prompt="def f():\n", max_tokens=40, temperature=0, stream=True,
        extra_body={"response_format": response_format}) if c.choices and c.choices[0].text]
    assert any(f is not None and f[1] > f[0] for f in forced)  # the page's marks: '{"n":' is forced


def test_allowed_origins_limits_cross_origin_pages():
    proc, url = start_server("--allowed_origins", "http://mine.example", "--no_draft", "--served_model_name", "mine")
    try:
        ask = lambda origin: httpx.options(url + "/v1/completions", headers={  # noqa: E731
            "origin": origin, "access-control-request-method": "POST"})
        assert ask("http://mine.example").headers.get("access-control-allow-origin") == "http://mine.example"
        assert "access-control-allow-origin" not in ask("http://other.example").headers
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["target/model.pth", "mine"]  # the flag's alias replaces "eaglet"
        assert httpx.post(url + "/v1/completions", json={"model": "eaglet", "prompt": "x"}).status_code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)


def test_prompt_lists_and_n_choices(server, client, reference):
    """A completion's prompt as a list of strings, as token ids, or a list of token-id lists: one choice each, in
    order, each generate()'s own reply; n > 1 greedy gives n equal choices, sampled n seeded draws (seed + i each:
    the same as n requests seeded so), streamed with their index."""
    tok = reference.tokenizer
    prompts = [PROMPTS[0], PROMPTS[1]]
    expected = [reference(tok.encode(p), 16)[0] for p in prompts]
    by_text = client.completions.create(model="eaglet", prompt=prompts, max_tokens=16, temperature=0)
    assert [c.text for c in by_text.choices] == expected and [c.index for c in by_text.choices] == [0, 1]
    by_ids = client.completions.create(model="eaglet", prompt=[tok.encode(p) for p in prompts], max_tokens=16,
                                       temperature=0)
    assert [c.text for c in by_ids.choices] == expected
    one_by_ids = client.completions.create(model="eaglet", prompt=tok.encode(prompts[1]), max_tokens=16, temperature=0)
    assert one_by_ids.choices[0].text == expected[1]
    assert by_text.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    greedy = client.completions.create(model="eaglet", prompt=prompts[0], max_tokens=16, temperature=0, n=3)
    assert [c.text for c in greedy.choices] == [expected[0]] * 3 and greedy.usage.completion_tokens == 48
    logged = lambda: [line for line in LOGS[server] if ", 3 choices, " in line]  # noqa: E731
    until(logged, "the server's line for the request of 3 choices")
    assert f"prompt {greedy.usage.prompt_tokens} tokens, completion 48" in logged()[-1]  # the prompt once, as usage
    sampled = client.completions.create(model="eaglet", prompt=prompts[0], max_tokens=16, temperature=1, n=3, seed=7)
    alone = [client.completions.create(model="eaglet", prompt=prompts[0], max_tokens=16, temperature=1, seed=7 + i)
             .choices[0].text for i in range(3)]
    assert [c.text for c in sampled.choices] == alone and len(set(alone)) > 1
    chunks = list(client.chat.completions.create(model="eaglet", messages=[{"role": "user", "content": "def f():"}],
                                                 max_tokens=12, temperature=0, n=2, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] and texts[0]
    roles = [choice.delta.role for c in chunks for choice in c.choices if choice.delta.role]
    assert roles == ["assistant", "assistant"]  # each choice's first chunk


def test_text_offsets_count_a_character_split_over_tokens_once():
    from server.replies import completion_logprobs
    entries = [{"token": t, "bytes": list(b), "logprob": -1.0, "top_logprobs": []}
               for t, b in [("a", b"a"), ("\ufffd", b"\xc3"), ("\ufffd", b"\xa9"), ("b", b"b")]]
    shaped, seen = completion_logprobs(entries)
    assert shaped["text_offset"] == [0, 1, 1, 2] and seen.decode() == "a\u00e9b"
    assert completion_logprobs(entries[3:], seen[:-1])[0]["text_offset"] == [2]


def test_logprobs_equal_a_plain_forward_streamed_or_not(client, reference):
    """logprobs as the official client reads them, chat (logprobs, top_logprobs) and completions (logprobs: k): one
    entry per token of the reply, its bytes spelling the reply, its logprob and top alternatives those of one plain
    forward over prompt and reply; streamed entries equal the whole reply's."""
    from test_logprobs import forward_logprobs
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 512)
    tokenizer = reference.tokenizer
    messages = [{"role": "user", "content": "def read_lines(path):"}]
    whole = client.chat.completions.create(model="eaglet", messages=messages, temperature=0, max_tokens=30,
                                           logprobs=True, top_logprobs=3)
    chunks = client.chat.completions.create(model="eaglet", messages=messages, temperature=0, max_tokens=30,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    entries = whole.choices[0].logprobs.content
    assert [e.bytes for e in streamed] == [e.bytes for e in entries]  # (the second reuses the cache: values may
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)  # differ in ulps)
    assert bytes(b for e in entries for b in e.bytes).decode() == whole.choices[0].message.content
    prompt = tokenizer.encode_chat(messages)
    text, tokens = reference(prompt, 30)
    assert text == whole.choices[0].message.content
    kept = [t for t in tokens if t not in tokenizer.eos_ids]
    logp = forward_logprobs(target, prompt + tokens)[len(prompt) - 1:]
    for i, (token, e) in enumerate(zip(kept, entries)):
        assert e.logprob == pytest.approx(float(logp[i, token]), abs=1e-4)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(logp[i].topk(3).values.tolist(), abs=1e-4)
    assert len(entries) == len(kept)

    completion = client.completions.create(model="eaglet", prompt=PROMPTS[0], temperature=0, max_tokens=12, logprobs=2)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text and len(lp.token_logprobs) == len(lp.tokens) > 0
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and max(top.values()) >= p - 1e-6 for top, p in zip(lp.top_logprobs, lp.token_logprobs))
    parts = client.completions.create(model="eaglet", prompt=PROMPTS[0], temperature=0, max_tokens=12, logprobs=2,
                                      stream=True)
    assert [t for c in parts if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] \
        == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_completion_logprobs_keep_the_sampled_token_and_name_each_alternative(client):
    """A completion's logprobs: k as OpenAI shapes them: top_logprobs has the sampled token always (one entry for
    logprobs 0; k, or k + 1 where the sampled one is not among the k likeliest), each alternative under its own key:
    tokens that are part of a UTF-8 character are named bytes:\\xe2\\x80, not all "\\ufffd"; streamed the same."""
    prompt = "# \u201cquoted\u201d \u2014 dash\n"  # the demo's reply holds curly quotes: three byte tokens each
    for k in (0, 5):
        lp = client.completions.create(model="eaglet", prompt=prompt, max_tokens=12, temperature=0,
                                       logprobs=k).choices[0].logprobs
        assert all(top[t] == p for t, top, p in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs))
        assert [len(top) for top in lp.top_logprobs] == [max(k, 1)] * len(lp.tokens)  # greedy: the sampled is the top
        assert any(re.fullmatch(r"bytes:(\\x[0-9a-f]{2})+", t) for t in lp.tokens)
        parts = client.completions.create(model="eaglet", prompt=prompt, max_tokens=12, temperature=0, logprobs=k,
                                          stream=True)
        streamed = [c.choices[0].logprobs for c in parts if c.choices and c.choices[0].logprobs]
        assert [t for s in streamed for t in s.tokens] == lp.tokens
        tops = [top for s in streamed for top in s.top_logprobs]  # (reusing the cache: values may differ in ulps)
        assert [list(top) for top in tops] == [list(top) for top in lp.top_logprobs]
        assert [v for top in tops for v in top.values()] == pytest.approx(
            [v for top in lp.top_logprobs for v in top.values()], abs=1e-4)
    sizes = []
    for seed in (1, 2, 3):
        lp = client.completions.create(model="eaglet", prompt=PROMPTS[0], max_tokens=24, temperature=1.5, seed=seed,
                                       logprobs=2).choices[0].logprobs
        assert all(top[t] == p for t, top, p in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs))
        sizes += [len(top) for top in lp.top_logprobs]
    assert set(sizes) == {2, 3}  # the sampled token beside the two likeliest, where it is not one of them


def test_completion_logprobs_names():
    from server.replies import completion_logprobs
    entry = {"token": "\ufffd", "bytes": [0xe2, 0x80], "logprob": -1.0, "top_logprobs": [
        {"token": "\ufffd", "bytes": [0xe2, 0x81], "logprob": -0.5}, {"token": "A", "bytes": [65], "logprob": -2.0},
        {"token": "A", "bytes": [65], "logprob": -3.0},  # a byte token (<0x41>) beside the piece "A"
        {"token": "\ufffd", "bytes": [0xe2, 0x80], "logprob": -1.0}]}  # the sampled one
    shaped = completion_logprobs([entry])[0]
    assert shaped["tokens"] == ["bytes:\\xe2\\x80"]
    assert shaped["top_logprobs"] == [{"bytes:\\xe2\\x81": -0.5, "bytes:\\xe2\\x80": -1.0, "A": -2.0,
                                       "bytes:\\x41": -3.0}]
    assert list(shaped["top_logprobs"][0].values()) == [-0.5, -1.0, -2.0, -3.0]  # likeliest first


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                               "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "integer", "minimum": -99, "maximum": 99},
             "b": {"type": "integer", "minimum": -99, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def valid_call(call) -> bool:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return set(arguments) == {"city", "days"} and len(arguments["city"]) <= 12 and 1 <= arguments["days"] <= 7
    return call.function.name == "add" and all(isinstance(arguments[k], int) for k in "ab")


def test_a_forced_call_on_a_template_without_tools(client):
    """The demo's template (LLaMA-2's) never reads tools: tool_choice naming a function, or required, still gets a
    call of an allowed function with arguments its schema accepts (the grammar writes it; the template shows no
    tools), streamed or not, with finish_reason tool_calls; parallel_tool_calls false is one call."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        whole = client.chat.completions.create(model="eaglet", messages=messages, tools=TOOLS, tool_choice=choice,
                                               temperature=0, max_tokens=80, parallel_tool_calls=False)
        calls = whole.choices[0].message.tool_calls
        assert whole.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and valid_call(calls[0])
        assert calls[0].id.startswith("call_") and (choice == "required" or calls[0].function.name == "add")
        chunks = list(client.chat.completions.create(model="eaglet", messages=messages, tools=TOOLS, tool_choice=choice,
                                                     temperature=0, max_tokens=80, stream=True))
        streamed = [call for c in chunks if c.choices and c.choices[0].delta.tool_calls
                    for call in c.choices[0].delta.tool_calls]
        assert [(c.function.name, c.function.arguments) for c in streamed] == \
            [(c.function.name, c.function.arguments) for c in calls]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_fields_that_change_the_reply_are_honoured_or_refused_and_unknown_ones_logged(server, client):
    """llama.cpp's schema inside json_object and top-level json_schema, vLLM's guided_choice: honoured; a field at
    the value that asks for nothing (use_beam_search false, 0.0 penalties): served; a field no server defines:
    served, and named once in the log."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    for extra in ({"response_format": {"type": "json_object", "schema": schema}}, {"json_schema": schema}):
        reply = client.completions.create(model="eaglet", prompt="def f():\n", max_tokens=30, temperature=0,
                                          extra_body=extra)
        assert set(json.loads(reply.choices[0].text)) == {"n"}
    choices = ["sunny", "rainy", "caf\u00e9 au lait"]
    reply = client.chat.completions.create(model="eaglet", messages=[{"role": "user", "content": "Weather?"}],
                                           max_tokens=10, temperature=1, seed=2, extra_body={"guided_choice": choices})
    assert reply.choices[0].message.content in choices
    for _ in range(2):
        reply = client.completions.create(model="eaglet", prompt="x", max_tokens=2, temperature=0, presence_penalty=0.0,
                                          frequency_penalty=0, suffix="", extra_body={"use_beam_search": False, "min_p": 0.0,
                                                                           "eaglet_unknown_field": 1, "user": "u"})
        assert reply.usage.completion_tokens == 2
    until(lambda: any("eaglet_unknown_field" in line for line in LOGS[server]), "the server's warning line")
    named = [line for line in LOGS[server] if "eaglet_unknown_field" in line]
    assert len(named) == 1 and named[0].startswith("warning:")
    warnings = [line for line in LOGS[server] if line.startswith("warning:")]  # refusals have lines of their own
    assert not any("'user'" in line or "use_beam_search" in line for line in warnings)
    client.completions.create(model="eaglet", prompt="x", max_tokens=1, logprobs=1,  # chat's fields: not read here
                              extra_body={"top_logprobs": 2, "parallel_tool_calls": False})
    for name in ("top_logprobs", "parallel_tool_calls"):
        until(lambda: any(f"field '{name}' is accepted and has no effect: not read by /v1/completions" in line
                          for line in LOGS[server]), f"the warning line naming {name}")


AGENT_BODIES = {  # request bodies the agent frameworks send (from their sources' documented parameters)
    "langchain ChatOpenAI invoke": {"model": "eaglet", "messages": [{"role": "user", "content": "def f():"}],
                                    "stream": False, "n": 1, "temperature": 0.0, "max_completion_tokens": 8},
    "langchain streaming": {"model": "eaglet", "messages": [{"role": "user", "content": "def f():"}], "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.7, "max_tokens": 8},
    "langchain with_structured_output, function_calling": {
        "model": "eaglet", "messages": [{"role": "user", "content": "Weather in Paris?"}], "stream": False,
        "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
        "max_tokens": 80},
    "langchain with_structured_output, json_schema": {
        "model": "eaglet", "messages": [{"role": "user", "content": "Weather in Paris?"}], "stream": False,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "get_weather", "description": "The weather", "strict": True,
            "schema": TOOLS[0]["function"]["parameters"]}}, "max_tokens": 80},
    "openai agents sdk": {
        "model": "eaglet", "messages": [{"role": "system", "content": "You are terse."},
                                        {"role": "user", "content": "Weather in Paris?"}],
        "stream": True, "stream_options": {"include_usage": True}, "store": False, "metadata": {"run": "1"},
        "parallel_tool_calls": False, "top_p": 1.0, "temperature": 0.0, "max_tokens": 80,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "final_output", "strict": True, "schema": TOOLS[0]["function"]["parameters"]}}},
    "pydantic-ai output tool": {
        "model": "eaglet", "messages": [{"role": "user", "content": "Weather in Paris?"}], "n": 1,
        "tools": [{"type": "function", "function": {"name": "final_result", "description": "The final response",
                                                    "parameters": TOOLS[0]["function"]["parameters"], "strict": True}}],
        "tool_choice": "required", "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": 80, "temperature": 0.0, "seed": 1, "user": "someone", "reasoning_effort": "low",
        "service_tier": "auto"},
    "instructor TOOLS": {
        "model": "eaglet", "messages": [{"role": "user", "content": "Add 2 and 3."}],
        "tools": [{"type": "function", "function": {"name": "add", "description": "Correctly extracted `add` with all "
                                                    "the required parameters with correct types",
                                                    "parameters": TOOLS[1]["function"]["parameters"]}}],
        "tool_choice": {"type": "function", "function": {"name": "add"}}, "max_tokens": 60, "temperature": 0},
    "instructor JSON": {
        "model": "eaglet", "messages": [{"role": "system", "content": "Answer in JSON."},
                                        {"role": "user", "content": "Add 2 and 3."}],
        "response_format": {"type": "json_object"}, "max_tokens": 60, "temperature": 0},
}


@pytest.mark.parametrize("name", AGENT_BODIES)
def test_agent_frameworks_requests_are_served(server, name):
    """Each framework's own fields (parallel_tool_calls, store, metadata, stream_options, max_completion_tokens,
    reasoning_effort, strict tools, ...) are served, never a 400; forced calls and schemas give what they ask."""
    body = AGENT_BODIES[name]
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.text.rstrip().endswith("data: [DONE]") and events[-1]["usage"]["completion_tokens"] > 0
        message = {"content": "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]),
                   "tool_calls": [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls", [])]}
        finish = next(e["choices"][0]["finish_reason"] for e in reversed(events) if e["choices"])
    else:
        message, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
    if "tools" in body:
        (call,) = message["tool_calls"]
        assert finish == "tool_calls" and call["function"]["name"] == body["tools"][0]["function"]["name"]
        json.loads(call["function"]["arguments"])
    elif "response_format" in body and finish == "stop":
        json.loads(message["content"])


def test_a_template_refusal_names_the_field_that_caused_it(tmp_path):
    """A template that raises on a variable the request set names chat_template_kwargs (or the hint); one that
    raises on the conversation names messages."""
    from types import SimpleNamespace

    from server.fields import ApiError
    from server.requests import Requests
    (tmp_path / "t.jinja").write_text("{% if strict %}{{ raise_exception('strict mode') }}{% endif %}"
                                      "{% if reasoning_effort == 'max' %}{{ raise_exception('no max') }}{% endif %}"
                                      "{% for m in messages %}{% if m.content == 'bad' %}{{ raise_exception('bad') }}"
                                      "{% endif %}{{ m.content }}{% endfor %}")
    requests = Requests(SimpleNamespace(tokenizer=Tokenizer(DEMO / "target", str(tmp_path / "t.jinja"))), ["eaglet"])
    for body, content, param in [({"chat_template_kwargs": {"strict": True}}, "x", "chat_template_kwargs"),
                                 ({"reasoning_effort": "max"}, "x", "reasoning_effort"),
                                 ({"chat_template_kwargs": {"strict": False}}, "bad", "messages"),
                                 ({}, "bad", "messages")]:
        with pytest.raises(ApiError) as refused:
            requests.render(body, [{"role": "user", "content": content}], None)
        assert (refused.value.status, refused.value.param) == (400, param)
    assert requests.render({}, [{"role": "user", "content": "fine"}], None)[0]


@pytest.mark.parametrize("flags", [("--ngram",), ("--draft_model", str(DEMO / "target"), "--tree_topk", "1")],
                         ids=["ngram", "draft_model"])
def test_a_server_drafts_without_a_head(reference, flags):
    """n-gram lookup, and a draft model (the demo's target itself: every draft accepted), behind the server: greedy
    replies, streamed or not, are generate()'s; a reply that quotes its prompt is drafted (tau over 1)."""
    proc, url = start_server("--step_aside", "off", *flags)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for prompt in (PROMPTS[0], "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"):
            text, _ = reference(reference.tokenizer.encode(prompt), 30)
            whole = client.completions.create(model="eaglet", prompt=prompt, max_tokens=30, temperature=0)
            chunks = client.completions.create(model="eaglet", prompt=prompt, max_tokens=30, temperature=0, stream=True)
            assert whole.choices[0].text == text == "".join(c.choices[0].text for c in chunks if c.choices)
        assert whole.model_extra["eaglet"]["tau"] > 1
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)


def test_an_exact_server_replies_as_plain_decoding_in_bf16():
    """serve.py --precision bf16 --exact: greedy replies drafted by the demo's head are plain decoding's, on a prompt
    where bf16 speculation without --exact parts from it (tests/test_exact.py)."""
    target = load_target(DEMO / "target" / "model.pth", "cpu", "bf16", 1024)
    tokenizer, prompt = Tokenizer(DEMO / "target"), "import os\n\n\ndef main():\n    args = "
    target.set_exact(True)
    try:
        streamer = TextStreamer(tokenizer, tokenizer.encode(prompt), enabled=False)
        generate(target, tokenizer.encode(prompt), 30, SamplingConfig(), eos_ids=tokenizer.eos_ids, on_tokens=streamer)
        streamer.flush()
    finally:
        target.set_exact(False)
    proc, url = start_server("--precision", "bf16", "--exact", "--step_aside", "off")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model="eaglet", prompt=prompt, max_tokens=30, temperature=0)
        assert reply.choices[0].text == streamer.text and reply.model_extra["eaglet"]["tau"] > 1
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)


def test_what_evaluation_and_load_clients_read(server, client, reference):
    """The reply's model is the name the request used; HEAD answers on the GET routes (aiperf probes /metrics so);
    continuous_usage_stats puts the usage so far in every chunk (vLLM's); ignore_eos (guidellm's and aiperf's fixed
    lengths) gives max_tokens tokens, generate()'s without an end-of-sequence; one log line a request, a refusal's
    reason in it."""
    named = client.completions.create(model="eaglet", prompt=PROMPTS[3], max_tokens=5, temperature=0)
    assert named.model == "eaglet"
    unset = httpx.post(server + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 5, "temperature": 0,
                                                          "stream": None, "cache_prompt": None}, timeout=HANG_S)
    assert unset.json()["choices"][0]["text"] == named.choices[0].text  # null: the default (a whole reply)
    assert client.completions.create(model="target/model.pth", prompt=PROMPTS[3], max_tokens=5).model == "target/model.pth"
    for path in ("/metrics", "/health", "/v1/models", "/"):
        answer = httpx.head(server + path)
        assert answer.status_code == 200 and answer.content == b"", path
    chunks = list(client.completions.create(model="eaglet", prompt=PROMPTS[3], max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].text]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens == 30
    (last,) = [c for c in chunks if c.choices and c.choices[0].finish_reason]  # the finish_reason's chunk has it too
    assert last.usage.completion_tokens == 30 and last.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    prompt = reference.tokenizer.encode(PROMPTS[1])
    fixed = client.completions.create(model="eaglet", prompt=PROMPTS[1], max_tokens=60, temperature=0,
                                      extra_body={"ignore_eos": True})
    plain = generate(reference.target, prompt, 60, SamplingConfig(), eos_ids=())
    text, tokens = reference(prompt, 60)  # the demo writes no end-of-sequence in 60 tokens: the same reply
    assert fixed.usage.completion_tokens == 60 == len(plain.tokens) and fixed.choices[0].finish_reason == "length"
    assert fixed.choices[0].text == text and tokens == plain.tokens
    with pytest.raises(openai.BadRequestError, match="ignore_eos must be true or false"):
        client.completions.create(model="eaglet", prompt="x", max_tokens=2, extra_body={"ignore_eos": "yes"})
    until(lambda: any("request: POST /v1/completions 400: ignore_eos must be" in line for line in LOGS[server]),
          "the refusal's log line")
    assert any(re.match(r"request: POST /v1/completions 200, 1 choice, prompt \d+ tokens, completion 60, tau [\d.]+, "
                        r"[\d.]+ s$", line.strip()) for line in LOGS[server])


def test_with_ignore_eos_every_reply_token_has_its_logprobs_entry():
    """The reply's EOS tokens are reply tokens under ignore_eos (usage counts them): one logprobs entry each, with
    empty text; without it the EOS that ends the reply has none."""
    from types import SimpleNamespace
    from server.engine import scored
    tokenizer = Tokenizer(DEMO / "target")
    eos, word = min(tokenizer.eos_ids), tokenizer.encode("x")[-1]
    scores = [(-0.5, [(eos, -0.5)]), (-1.0, [(word, -1.0)]), (-0.25, [(eos, -0.25)])]
    for ignore_eos in (True, False):
        job = SimpleNamespace(sampling=SamplingConfig(logprobs=1), scores=scores, ignore_eos=ignore_eos)
        scores_of = scored(tokenizer, 4096, job, 0, [eos, word, eos])
        entries = [(text, logprob) for text, logprob, _ in scores_of]
        x = tokenizer.decode([word]).encode()
        assert entries == ([(b"", -0.5), (x, -1.0), (b"", -0.25)] if ignore_eos else [(x, -1.0)])
        if ignore_eos:  # an EOS among the alternatives is named as the chosen EOS is: one name a token
            assert scores_of[0][2] == [(b"", -0.5)]


def test_echo_and_prompt_logprobs_score_the_prompt_as_a_forward_does(client, reference):
    """lm-evaluation-harness's loglikelihood request (local-completions: token ids, max_tokens 1, logprobs 1, echo) gets
    the prompt back with every token's logprob under the target, the first null, then the reply's: each equal to a
    plain forward's log-softmax over the whole prompt; max_tokens 0 with echo scores the prompt alone; vLLM's
    prompt_logprobs names each token by id; echo is refused where it cannot be honoured (a stream, a chat)."""
    tokenizer, target = reference.tokenizer, reference.target
    context, continuation = tokenizer.encode("def read_lines(path):\n"), tokenizer.encode("    with open", bos=False)
    ids = context + continuation
    with torch.no_grad():
        pos = torch.arange(len(ids))
        logits, _ = target(torch.tensor([ids]), pos, pos, torch.ones(len(ids), len(ids), dtype=torch.bool).tril())
    want = torch.log_softmax(logits[0].float(), -1)
    raw = httpx.post(client.base_url.join("completions"), json={
        "model": "eaglet", "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
        "seed": 1234}, timeout=HANG_S).json()
    logprobs = raw["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == len(ids) + 1
    for i in range(1, len(ids) + 1):
        assert logprobs["token_logprobs"][i] == pytest.approx(want[i - 1, (ids + [None])[i] or want[i - 1].argmax()].item(),
                                                              abs=1e-4)
    ctxlen = len(context)  # what lm-eval then computes
    score = sum(logprobs["token_logprobs"][ctxlen:-1])
    assert score == pytest.approx(sum(want[i - 1, ids[i]].item() for i in range(ctxlen, len(ids))), abs=1e-3)
    greedy = all(lp == max(top.values()) for lp, top in zip(logprobs["token_logprobs"][ctxlen:-1],
                                                          logprobs["top_logprobs"][ctxlen:-1]))
    assert greedy == all(want[i - 1].argmax().item() == ids[i] for i in range(ctxlen, len(ids)))
    assert raw["choices"][0]["text"].startswith(tokenizer.decode(ids))
    alone = client.completions.create(model="eaglet", prompt="def add(a, b):", max_tokens=0, echo=True, logprobs=2,
                                      extra_body={"prompt_logprobs": 1})
    choice = alone.choices[0]
    assert choice.text == "def add(a, b):" and alone.usage.completion_tokens == 0
    prompt = tokenizer.encode("def add(a, b):")
    named = choice.model_extra["prompt_logprobs"]
    assert named[0] is None and len(named) == len(prompt) == len(choice.logprobs.token_logprobs)
    assert all(str(t) in row and row[str(t)]["logprob"] == lp
               for t, row, lp in zip(prompt[1:], named[1:], choice.logprobs.token_logprobs[1:]))
    for extra, words in (({"stream": True, "echo": True}, "echo is answered whole"),
                         ({"echo": True, "messages": [{"role": "user", "content": "x"}]}, None)):
        with pytest.raises(openai.BadRequestError, match=words or "."):
            client.completions.create(model="eaglet", prompt="x", max_tokens=2, extra_body=extra) if words else \
                client.chat.completions.create(model="eaglet", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                               extra_body={"echo": True})


def test_penalties_and_logit_bias_give_plain_decoding_s_reply(client, reference):
    """presence, frequency and repetition penalties and logit_bias, greedy, streamed or not: the reply plain decoding
    gives under them (the server speculates with the demo's head); a bias of -100 keeps a token out."""
    tokenizer, target = reference.tokenizer, reference.target
    prompt = tokenizer.encode(PROMPTS[1])
    banned = generate(target, prompt, 40, SamplingConfig()).tokens[3]
    fields = {"presence_penalty": 0.8, "frequency_penalty": 0.3, "repetition_penalty": 1.2,
              "logit_bias": {str(banned): -100}}
    want = generate(target, prompt, 40, SamplingConfig(presence_penalty=0.8, frequency_penalty=0.3,
                                                       repetition_penalty=1.2, logit_bias={banned: -100.0}))
    assert banned not in want.tokens
    whole = client.completions.create(model="eaglet", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                      presence_penalty=0.8, frequency_penalty=0.3, logit_bias=fields["logit_bias"],
                                      extra_body={"repetition_penalty": 1.2})
    chunks = client.completions.create(model="eaglet", prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True,
                                       presence_penalty=0.8, frequency_penalty=0.3, logit_bias=fields["logit_bias"],
                                       extra_body={"repetition_penalty": 1.2})
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == streamed == tokenizer.decode(want.tokens)
    assert whole.model_extra["eaglet"]["cycles"] > 0  # speculated
