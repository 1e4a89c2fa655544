"""Reasoning models behind the server: a reply that thinks (<think> ... </think>) comes back with its thinking in
reasoning_content and its answer in content, streamed (delta.reasoning_content as it comes) exactly as whole; a
grammar or a forced tool call starts where the thinking ends. First the reply shaping alone, over every way a reply's
text can arrive in pieces; then the real model (SmolLM2-135M-Instruct with its EAGLE head) behind serve.py, with a
template that thinks as Qwen3's does and a few-shot conversation it follows: it thinks, then answers."""
import json
import shutil

import pytest

from conftest import HANG_S, ROOT
from sampling import SamplingConfig
from server.replies import StreamReply, whole_reply
from reasoning import ANSWERING, MAY_THINK, THINKING
from server.engine import Job, done_record

TEMPLATE = ROOT / "tests" / "data" / "thinking_chatml.jinja"

# (reply start, text, tool format, reasoning and content as a reader of the text sees them, the call's name or None)
REPLIES = [
    (MAY_THINK, "<think>\nplan: call f\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n"
                "</tool_call>", "hermes", "plan: call f", "", "f"),
    (THINKING, "a < b, </thin is no tag\n</think>  the answer", None, "a < b, </thin is no tag", "the answer", None),
    (THINKING, "cut short while thinking\n", None, "cut short while thinking", "", None),
    (MAY_THINK, "Hello <think> world", None, None, "Hello <think> world", None),
    (MAY_THINK, "<think></think>\n{\"a\": 1}", None, None, "{\"a\": 1}", None),
    (ANSWERING, "<think>x</think>y", None, None, "<think>x</think>y", None),
]


def job(start, tool_form) -> Job:
    return Job([1, 2], 100, SamplingConfig(), None, [], False, None, None, tool_form=tool_form, reasoning=start)


def done(text: str) -> dict:
    return done_record(job(None, None), "stop", text, completion_tokens=5)


def streamed(start, tool_form, pieces: list) -> tuple:
    """(reasoning, content, tool call names) a stream of these pieces gives its client, checking on the way that each
    chunk's reasoning and content sit where its reasoning_at / content_at say in the reply's text (the page's marks)."""
    jobs = [job(start, tool_form)]
    reply, text, got = StreamReply(jobs, {"id": "x"}, chat=True), "".join(pieces), {"reasoning_content": "", "content": ""}
    chunks = []
    for piece in pieces:
        new = [json.loads(c[6:]) for c in reply.text(0, (piece, 0, {"drafted": [0, 0]}, [], 0))]
        chunks += new
        for c in new:
            for name, at in (("reasoning_content", "reasoning_at"), ("content", "content_at")):
                delta = c["choices"][0]["delta"].get(name)
                if delta and at in c["eaglet"]:
                    where = c["eaglet"][at] + len(got[name])
                    assert text[where:where + len(delta)] == delta, (pieces, name)
                got[name] += delta or ""
    chunks += [json.loads(c[6:]) for c in reply.done(0, done(text))]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    return (reasoning or None, "".join(d.get("content") or "" for d in deltas),
            [call["function"]["name"] for d in deltas for call in d.get("tool_calls", [])])


@pytest.mark.parametrize("start, text, tool_form, reasoning, content, call", REPLIES)
def test_a_stream_in_any_pieces_says_what_the_whole_reply_says(start, text, tool_form, reasoning, content, call):
    whole = whole_reply([job(start, tool_form)], {0: done(text)}, {"id": "x"}, chat=True)
    message = whole["choices"][0]["message"]
    assert message.get("reasoning_content") == reasoning and (message["content"] or "") == content  # None with calls
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == ([call] if call else [])
    assert "reasoning_content" in message  # null where this reply has none (a template that thinks has the field)
    cuts = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for i, j in cuts[::7] + [(i, i) for i in range(len(text) + 1)]:
        assert streamed(start, tool_form, [text[:i], text[i:j], text[j:]]) == (reasoning, content, [call] if call
                                                                                 else []), (i, j)
    assert streamed(start, tool_form, list(text)) == (reasoning, content, [call] if call else [])  # a character a cycle


@pytest.mark.parametrize("kwargs, start", [({}, MAY_THINK), ({"think_open": True}, THINKING),
                                           ({"enable_thinking": False}, ANSWERING)])
def test_the_reply_starts_where_the_generation_prompt_leaves_it(kwargs, start):
    """Read from what the template adds for the reply, never from the conversation: a user's or a tool's text that
    holds a <think> opens nothing."""
    from types import SimpleNamespace

    from server.requests import Requests
    from tokenizer import Tokenizer
    requests = Requests(SimpleNamespace(tokenizer=Tokenizer(ROOT / "demo" / "target", str(TEMPLATE))), ["eaglet"])
    messages = [{"role": "user", "content": "What does a <think> tag do?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "look_up", "arguments": {"q": "think"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "<think> opens a model's thinking"}]
    for conversation in (messages[:1], messages):
        _, opening = requests.render({"chat_template_kwargs": kwargs}, conversation, None)
        assert requests.reply_starts({}, opening) == (start, start)
        assert requests.reply_starts({"separate_reasoning": False}, opening) == (start, None)


@pytest.mark.parametrize("pieces, start, thinking", [
    (["<thi", "nk>", "a", "</th", "ink>", "\n", "b"], MAY_THINK, 5),  # the token that completes </think> counts
    (["<thi", "nk>", "a", "</th", "ink>", "\n", "b"], ANSWERING, 0),
    (["Hello", " <think>", "</think>"], MAY_THINK, 0),  # not at the reply's start: no thinking
    (["a", "b</think>", "c"], THINKING, 2),
    (["a", "b", "c"], THINKING, 3),  # cut while thinking: all of it
    (["</think>", "c"], THINKING, 1)])
def test_reasoning_tokens_count_the_thinking(pieces, start, thinking):
    from reasoning import thinking_tokens
    assert thinking_tokens(lambda tokens: "".join(pieces[t] for t in tokens), list(range(len(pieces))), start) == \
        thinking


# The real model behind serve.py
FEW_SHOT = [("Spain", "Madrid"), ("Italy", "Rome"), ("Japan", "Tokyo")]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                             "required": ["city"]}}}]


def conversation(json_answers: bool = False) -> list:
    messages = [{"role": "system", "content": "Think inside <think> </think> first, then answer in one word."}]
    for country, city in FEW_SHOT:
        answer = json.dumps({"city": city}) if json_answers else city
        messages += [{"role": "user", "content": f"Capital of {country}?"},
                     {"role": "assistant", "content": f"<think>\n{country}'s capital is {city}.\n</think>\n\n{answer}"}]
    return messages + [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def thinking_server(smollm2, tmp_path_factory):
    from convert_hf_checkpoint import convert
    from test_serve import httpx, start_server
    _, folder = smollm2
    head = tmp_path_factory.mktemp("head") / "head"
    shutil.copytree(ROOT / "heads" / "smollm2-135m-instruct-eagle", head)  # converting writes draft.pth beside it
    proc, url = start_server("--checkpoint_path", str(folder / "model.pth"), "--draft_checkpoint_path",
                             str(convert(head, log=lambda *_: None)), "--chat_template", str(TEMPLATE),
                             "--depth", "3", "--tree_topk", "1", "--total_tokens", "4", "--step_aside", "off",
                             "--precision", "fp32", "--device", "cpu", "--max_seq_length", "1024")
    yield url, httpx
    proc.terminate()
    proc.wait(timeout=HANG_S)


def ask(server, body: dict, stream: bool) -> dict:
    """The message a request's reply makes: whole, or its stream's deltas joined (tool calls as they come)."""
    url, httpx = server
    body = {"temperature": 0, "max_tokens": 48, **body, "stream": stream}
    if not stream:
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=HANG_S)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]
    message = {"reasoning_content": "", "content": ""}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=HANG_S) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                message["reasoning_content"] += delta.get("reasoning_content", "")
                message["content"] += delta.get("content") or ""
                for call in delta.get("tool_calls", []):
                    message.setdefault("tool_calls", []).append(call)
    return message


def both(server, body: dict) -> dict:
    """The whole reply's message, after checking that the stream says the same (reasoning, content, calls)."""
    whole, stream = ask(server, body, False), ask(server, body, True)
    assert (whole.get("reasoning_content") or "", whole["content"] or "") == \
        (stream["reasoning_content"], stream["content"])
    calls = lambda m: [(c["function"]["name"], json.loads(c["function"]["arguments"]))  # noqa: E731
                       for c in m.get("tool_calls", [])]
    assert calls(whole) == calls(stream)
    return whole


@pytest.mark.slow  # a server process on the real model
def test_the_real_model_thinks_then_answers_and_its_thinking_is_apart(thinking_server):
    message = both(thinking_server, {"messages": conversation()})
    assert message["reasoning_content"] == "France's capital is Paris."
    assert message["content"] == "Paris"
    # one way each from here (the stream and the whole reply agree above; test_serve.py holds them alike throughout)
    kept = ask(thinking_server, {"messages": conversation(), "separate_reasoning": False}, stream=False)
    assert "reasoning_content" not in kept and kept["content"].startswith("<think>\nFrance's capital")
    opened = ask(thinking_server, {"messages": conversation(), "chat_template_kwargs": {"think_open": True}},
                 stream=True)
    assert opened["reasoning_content"] and opened["content"]  # the prompt opened the thinking: no <think> to write
    off = ask(thinking_server, {"messages": conversation(), "chat_template_kwargs": {"enable_thinking": False}},
              stream=False)
    assert off["reasoning_content"] is None and "think>" not in off["content"]
    url, httpx = thinking_server
    usages = [httpx.post(url + "/v1/chat/completions", timeout=HANG_S, json={
        "messages": conversation(), "temperature": 0, "max_tokens": 48, "n": n, **extra}).json()["usage"]
        for n, extra in ((2, {}), (1, {"chat_template_kwargs": {"enable_thinking": False}}))]
    thinking = usages[0]["completion_tokens_details"]["reasoning_tokens"]
    assert 2 * 8 <= thinking < usages[0]["completion_tokens"]  # two choices' thinking, "France's capital is Paris."
    assert usages[1]["completion_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.slow
def test_a_schema_and_a_forced_call_start_where_the_thinking_ends(thinking_server):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    message = both(thinking_server, {"messages": conversation(json_answers=True), "response_format": {
        "type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    assert message["reasoning_content"], "the grammar constrained the thinking too"
    assert set(json.loads(message["content"])) == {"city"}
    message = ask(thinking_server, {"messages": conversation(), "tools": WEATHER, "max_tokens": 64,
                                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                  stream=True)
    assert message["reasoning_content"], "the forced call constrained the thinking too"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}


@pytest.mark.slow
def test_the_page_shows_the_thinking_apart_and_marks_both_parts(thinking_server):
    """The page, in a real browser, on the real model: the thinking in grey spans, the answer in others, each
    coloured by where its characters came from (the marks name the reply's characters: the page maps them onto
    each part), their text the API's reasoning_content and content."""
    page = pytest.importorskip("test_serve_page", reason="selenium: pip install selenium")
    if not (page.CHROMIUM and page.DRIVER):
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    url, _ = thinking_server
    *earlier, question = conversation()
    driver = page.browser()
    try:
        driver.get(url + "/")
        driver.execute_script("messages = arguments[0];", earlier)  # the few-shot turns the model follows
        driver.find_element(By.ID, "prompt").send_keys(question["content"])
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "log").get_attribute("data-done") == "1")
        spans = [(s.get_attribute("class").split(), s.get_attribute("textContent"))
                 for s in driver.find_elements(By.CSS_SELECTOR, "#log span")][1:]  # after the user's line
        thinking = "".join(text for kinds, text in spans if "thinking" in kinds)
        answer = "".join(text for kinds, text in spans if "thinking" not in kinds)
        message = ask(thinking_server, {"messages": conversation()}, stream=False)
        assert (thinking, answer) == (message["reasoning_content"], message["content"])
        assert {"drafted", "target"} <= {k for kinds, _ in spans if "thinking" in kinds for k in kinds}
        assert {k for kinds, _ in spans if "thinking" not in kinds for k in kinds} <= {"drafted", "target"}
        sent = driver.execute_script("return messages[messages.length - 1];")
        assert sent == {"role": "assistant", "content": "Paris", "reasoning_content": "France's capital is Paris."}
    finally:
        driver.quit()
