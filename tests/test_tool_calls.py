"""Tool calls (tool_calls.py, serve.py): the call format read from the chat template, replies parsed into OpenAI's
tool_calls for the three formats, a forced call (tool_choice required or named) that is always a valid call of a
given function whose arguments satisfy its schema -- speculative output equal to plain -- and the whole loop through
the official client: a call, streamed or not, the tool's result sent back, the next reply. Hermes' <tool_call> tags
where they are tokens of their own (Qwen2.5's and Qwen3's vocabularies), and Mistral's 9-character call ids for a
conversation carried over from another server."""
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("llguidance", reason="forced calls are grammars: pip install llguidance")
jsonschema = pytest.importorskip("jsonschema", reason="validates the calls' arguments: pip install jsonschema")

from decode import TreeConfig, generate  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from load import load_draft, load_target  # noqa: E402
from conftest import HANG_S, ROOT, smollm2_gguf  # noqa: E402
from grammar import Constraint, grammar_of, grammar_tokenizer, tag_token  # noqa: E402
from model import EagletError  # noqa: E402
from server.fields import messages_of  # noqa: E402
from server.requests import Requests  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from tool_calls import (JSON_EXACT, call_format, call_grammar, chosen_functions, functions_of,  # noqa: E402
                        ids_for_template, mistral_id, parse_calls, streamable)

DEMO = ROOT / "demo"
# A small template in the Hermes style (Qwen's): tools listed as JSON, calls as <tool_call> blocks, results back
# as <tool_response> blocks.
HERMES = (
    "{%- if tools %}{{ '<|system|>\\nCall a function as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. "
    "Functions:\\n' }}{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{ '<|user|>\\n<tool_response>' + m.content + '</tool_response>\\n' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{ '<|assistant|>\\n' + m.content }}"
    "{%- for c in m.tool_calls %}{{ '<tool_call>' + {'name': c.function.name, 'arguments': c.function.arguments} | tojson"
    " + '</tool_call>' }}{%- endfor %}{{ '\\n' }}"
    "{%- else %}{{ '<|' + m.role + '|>\\n' + m.content + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}")
LLAMA = "{%- if tools %}Reply {\"name\": function name, \"parameters\": {...}}: {{ tools | tojson }}{%- endif %}" \
        "{%- for m in messages %}{{ m.content }}{%- endfor %}"
MISTRAL = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}" \
          "{%- for m in messages %}{{ m.content }}{%- endfor %}[TOOL_CALLS]"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"],
    "additionalProperties": False}}}


def tokenizer_with(tmp_path, template: str) -> Tokenizer:
    (tmp_path / "t.jinja").write_text(template)
    return Tokenizer(DEMO / "target", chat_template=str(tmp_path / "t.jinja"))


def test_the_format_comes_from_the_template(tmp_path):
    assert call_format(tokenizer_with(tmp_path, HERMES)) == "hermes"
    assert call_format(tokenizer_with(tmp_path, LLAMA)) == "llama"
    assert call_format(tokenizer_with(tmp_path, MISTRAL)) == "mistral"
    with pytest.raises(EagletError, match="no tool support"):
        call_format(Tokenizer(DEMO / "target"))  # the built-in LLaMA-2 template never reads tools
    with pytest.raises(EagletError, match="does not read"):
        call_format(tokenizer_with(tmp_path, "{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}"))


def test_tools_render_as_json_not_html_escaped(tmp_path):
    tokenizer = tokenizer_with(tmp_path, HERMES)
    tool = {"type": "function", "function": {"name": "f", "description": "a < b & c"}}
    text = tokenizer.decode(tokenizer.encode_chat([{"role": "user", "content": "hi"}], [tool]))
    assert json.dumps(tool) in text


def test_replies_parse_into_calls_in_each_format():
    content, calls = parse_calls('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
                                 '<tool_call>{"name": "b", "arguments": {}}</tool_call>', "hermes")
    assert content == "Let me look.\n" and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1} and calls[0]["id"] != calls[1]["id"]
    assert parse_calls('<tool_call>{"name": "a", "argu', "hermes") == ('<tool_call>{"name": "a", "argu', [])  # cut short
    content, calls = parse_calls(' {"name": "a", "parameters": {"y": "z"}}', "llama")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"y": "z"}
    assert parse_calls("The answer is {1}", "llama") == ("The answer is {1}", [])
    content, calls = parse_calls('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": [1]}}]', "mistral")
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert parse_calls("[1, 2]", "mistral") == ("[1, 2]", [])
    assert streamable("Sure.\n<tool_", "hermes") == len("Sure.\n") and streamable("Sure.", "hermes") == 5
    assert streamable("  {", "llama") == 0 and streamable("Hello {", "llama") == 7


def test_parameters_with_their_own_definitions_and_mistral_ids(tmp_path):
    """A pydantic-made parameters schema ($defs and $ref) keeps its references inside the call's grammar; Mistral's
    templates take only 9-character ids; a checkpoint's template named tool_use is the one rendered with tools."""
    place = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
             "additionalProperties": False, "$defs": {"Place": {"type": "object", "properties": {
                 "city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": False}}}
    tokenizer = tokenizer_with(tmp_path, HERMES)
    grammar = call_grammar(tokenizer, tokenizer.vocab_size, "hermes", {"go": place}, ["go"])
    constraint = Constraint(tokenizer, tokenizer.vocab_size, grammar)
    text = '<tool_call>\n{"name":"go","arguments":{"where":{"city":"Oslo"}}}\n</tool_call>'
    assert constraint.take(tokenizer.encode(text, bos=False)) > 0 and not constraint.matcher.is_error()
    assert parse_calls('[{"name": "a", "arguments": {}}]', "mistral")[1][0]["id"].isalnum()
    assert len(parse_calls('[{"name": "a", "arguments": {}}]', "mistral")[1][0]["id"]) == 9
    loose = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # additionalProperties unset
    grammar = call_grammar(tokenizer, tokenizer.vocab_size, "hermes", {"go": loose}, ["go"])
    for text, whole in (('<tool_call>\n{"name":"go","arguments":{"city":"Paris"}}\n</tool_call>', True),
                        ('<tool_call>\n{"name":"go","arguments":{"city":"Paris","country"', False)):
        tokens = tokenizer.encode(text, bos=False)
        assert (Constraint(tokenizer, tokenizer.vocab_size, grammar).take(tokens) == len(tokens)) == whole, text
    folder = tmp_path / "named"
    folder.mkdir()
    for name in ("tokenizer.model", "config.json"):
        (folder / name).write_bytes((DEMO / "target" / name).read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": HERMES}]}))
    named = Tokenizer(folder)
    assert named.takes_tools() and call_format(named) == "hermes"
    text = named.decode(named.encode_chat([{"role": "user", "content": "hi"}], [WEATHER]))
    assert "get_weather" in text and named.decode(named.encode_chat([{"role": "user", "content": "hi"}])) == "hi"


def test_tool_choice_and_tools_are_checked_by_name():
    functions = functions_of([WEATHER, CLOCK])
    assert chosen_functions(functions, "required") == ["get_weather", "get_time"]
    assert chosen_functions(functions, {"type": "function", "function": {"name": "get_time"}}) == ["get_time"]
    assert chosen_functions(functions, "auto") is None
    with pytest.raises(EagletError, match="not one of the tools"):
        chosen_functions(functions, {"type": "function", "function": {"name": "nope"}})
    for bad in ({"type": "function", "function": "get_time"}, {"type": "function", "function": None}, "always"):
        with pytest.raises(EagletError, match="tool_choice must be"):
            chosen_functions(functions, bad)
    for bad, words in [([], "non-empty"), ([{"type": "function", "function": {}}], "name"),
                       ([WEATHER, WEATHER], "second function"), ([{"type": "code"}], "tools\\[0\\]")]:
        with pytest.raises(EagletError, match=words):
            functions_of(bad)


@pytest.mark.parametrize("form", ["hermes", "llama"])
def test_a_forced_call_is_valid_and_speculation_keeps_it_exact(tmp_path, form):
    tokenizer = tokenizer_with(tmp_path, HERMES if form == "hermes" else LLAMA)
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 512)
    head = load_draft(DEMO / "head" / "draft.pth", target)
    functions = functions_of([WEATHER, CLOCK])
    for names in (["get_weather", "get_time"], ["get_time"]):
        grammar = call_grammar(tokenizer, target.args.vocab_size, form, functions, names)
        prompt = tokenizer.encode_chat([{"role": "user", "content": "def weather(city):"}], [WEATHER, CLOCK])
        replies = []
        for draft in (None, head):
            constraint = Constraint(tokenizer, target.args.vocab_size, grammar)
            result = generate(target, prompt, 120, SamplingConfig(), tokenizer.eos_ids, draft=draft,
                              tree=TreeConfig(3, 4, 8), constraint=constraint)
            assert constraint.done(), "the call is complete"
            replies.append(result.tokens)
        assert replies[0] == replies[1]
        _, calls = parse_calls(tokenizer.decode(replies[0]), form)
        assert len(calls) == 1 and calls[0]["function"]["name"] in names
        arguments = json.loads(calls[0]["function"]["arguments"])
        jsonschema.validate(arguments, functions[calls[0]["function"]["name"]])


def test_mistral_calls_need_their_token(tmp_path):
    with pytest.raises(EagletError, match="no such token"):
        tokenizer = tokenizer_with(tmp_path, MISTRAL)
        call_grammar(tokenizer, tokenizer.vocab_size, "mistral", functions_of([WEATHER]), ["get_weather"])


def test_the_tool_loop_through_the_openai_client(tmp_path):
    """A forced call (non-streamed and streamed: the same call), its result sent back as a tool message, the next
    reply; a named function; what is refused, by name."""
    openai = pytest.importorskip("openai", reason="the official client: pip install openai")
    from test_serve import start_server
    (tmp_path / "t.jinja").write_text(HERMES)
    proc, url = start_server("--chat_template", str(tmp_path / "t.jinja"))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        reply = client.chat.completions.create(model="eaglet", messages=messages, tools=[WEATHER, CLOCK],
                                               tool_choice="required", temperature=0, max_tokens=100)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, reply
        call = choice.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), {"get_weather": WEATHER, "get_time": CLOCK}[
            call.function.name]["function"]["parameters"])
        chunks = list(client.chat.completions.create(model="eaglet", messages=messages, tools=[WEATHER, CLOCK],
                                                     tool_choice="required", temperature=0, max_tokens=100,
                                                     stream=True))
        streamed = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
        assert [(t.function.name, t.function.arguments) for t in streamed] == [(call.function.name, call.function.arguments)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 14})}]
        after = client.chat.completions.create(model="eaglet", messages=messages, tools=[WEATHER, CLOCK],
                                               temperature=0, max_tokens=20)
        assert after.usage.prompt_tokens > reply.usage.prompt_tokens and after.choices[0].finish_reason in (
            "stop", "length", "tool_calls")
        named = client.chat.completions.create(model="eaglet", messages=messages[:1], tools=[WEATHER, CLOCK],
                                               tool_choice={"type": "function", "function": {"name": "get_time"}},
                                               temperature=0, max_tokens=60)
        assert named.choices[0].message.tool_calls[0].function.name == "get_time"
        for kwargs, param in [({"tools": [{"type": "function", "function": {}}]}, "tools"),
                              ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                               "tool_choice"),
                              ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                               "tool_choice")]:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="eaglet", messages=messages[:1], max_tokens=5, **kwargs)
            assert e.value.body["param"] == param
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)


# Hermes' tags as tokens of their own

TAGS = ("<tool_call>", "</tool_call>")
STOP = {"type": "function", "function": {"name": "stop", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}
TEMPLATES = ROOT / "tests" / "data" / "templates"


def smollm2_tokenizer(folder, renamed=(), special=True, added=(), config=None,
                      template="qwen2.5-7b-instruct") -> Tokenizer:
    """SmolLM2's byte-level vocabulary (its GGUF file's tokenizer.json): renamed, tokens in the place of its unused
    special ones (<repo_name>, <reponame>, ...: ids its embedding has rows for), special or not; added, tokens after
    its vocabulary as Qwen adds its tags (not special: they decode to their text); config: tokenizer_config.json;
    template: one of tests/data/templates."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from convert_gguf import gguf_tokenizer, read_gguf
    tok = json.loads(gguf_tokenizer(read_gguf(smollm2_gguf()))["tokenizer.json"])
    for slot, content in zip(tok["added_tokens"][3:], renamed):
        tok["model"]["vocab"][content] = tok["model"]["vocab"].pop(slot["content"])
        slot["content"], slot["special"] = content, special
    hf = HFTokenizer.from_str(json.dumps(tok))
    hf.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in added])
    hf.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(folder, chat_template=str(TEMPLATES / f"{template}.jinja"))


@pytest.fixture(scope="module", params=["added", "renamed", "text", "sentencepiece"])
def vocabulary(request, tmp_path_factory):
    """The tags added after SmolLM2's vocabulary as Qwen adds them, in the place of two of its unused special tokens
    (not special either), as text in it, and as text in the demo's sentencepiece vocabulary."""
    if request.param == "sentencepiece":
        return Tokenizer(DEMO / "target")
    folder = tmp_path_factory.mktemp(request.param)
    return smollm2_tokenizer(folder, **{"added": {"added": TAGS}, "renamed": {"renamed": TAGS, "special": False},
                                        "text": {}}[request.param])


def literal_grammar(functions: dict, name: str) -> str:
    """The Hermes grammar as it was: the tags as text literals, whatever the vocabulary."""
    call = {"type": "object", "properties": {"name": {"const": name}, "arguments": functions[name]},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_EXACT}
    return grammar_of("lark", f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(call)}')


def test_hermes_tags_are_tokens_where_the_vocabulary_holds_them(vocabulary):
    """The call as the model writes it (the tags' own tokens where they are tokens, else text) is a sentence of the
    grammar, and its decoded text reads back as the call."""
    tokenizer, n_vocab = vocabulary, vocabulary.vocab_size
    tags = [tokenizer.token_id(tag) for tag in TAGS]
    assert [tag_token(tokenizer, n_vocab, tag) for tag in TAGS] == tags  # tokens here are held apart from text
    text = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}\n</tool_call>'
    tokens = grammar_tokenizer(tokenizer, n_vocab).tokenize_str(text)
    assert (tokens[0], tokens[-1]) == tuple(tags) or None in tags
    grammar = call_grammar(tokenizer, n_vocab, "hermes", functions_of([WEATHER, CLOCK]), ["get_weather", "get_time"])
    constraint = Constraint(tokenizer, n_vocab, grammar, forced_min=0)
    assert constraint.take(tokens) == len(tokens) and constraint.done()
    content, calls = parse_calls(tokenizer.decode(tokens), "hermes")
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})]


def test_a_forced_call_writes_the_tag_tokens_where_a_text_literal_fails(vocabulary):
    """A call the grammar forces whole (a function without parameters): its run holds the tags' own tokens where they
    are tokens and reads back as the call; a grammar with the tags as text literals refuses those tokens: unusable."""
    tokenizer, n_vocab = vocabulary, vocabulary.vocab_size
    functions = functions_of([STOP])
    constraint = Constraint(tokenizer, n_vocab, call_grammar(tokenizer, n_vocab, "hermes", functions, ["stop"]))
    run = constraint.forced(100)
    assert constraint.done() and tokenizer.decode(run) == '<tool_call>\n{"name":"stop","arguments":{}}\n</tool_call>'
    assert [c["function"]["name"] for c in parse_calls(tokenizer.decode(run), "hermes")[1]] == ["stop"]
    if tokenizer.token_id(TAGS[0]) is None:
        assert Constraint(tokenizer, n_vocab, literal_grammar(functions, "stop"), forced_min=0).take(run) == len(run)
        return
    assert (run[0], run[-1]) == tuple(tokenizer.token_id(tag) for tag in TAGS)
    # the literal's mask allows the tag's token alone, which the engine then refuses: refused before any decoding
    with pytest.raises(EagletError, match="the grammar cannot be used: .*doesn't satisfy the grammar"):
        Constraint(tokenizer, n_vocab, literal_grammar(functions, "stop"))


@pytest.mark.slow
def test_smollm2_decodes_a_forced_call_through_the_tag_tokens(smollm2, tmp_path):
    """SmolLM2 under a named call's grammar, with Qwen2.5's template, where the tags are tokens of their own: the tags
    are renamed unused special tokens (SmolLM2's embedding has exactly its tokenizer's 49152 rows, none spare for
    tokens added after them), not special, so they decode to their text as Qwen's do."""
    tokenizer = smollm2_tokenizer(tmp_path, renamed=TAGS, special=False)
    target = load_target(smollm2[1] / "model.pth", "cpu", "fp32", 1024)
    n_vocab, functions = target.args.vocab_size, functions_of([WEATHER, CLOCK])
    constraint = Constraint(tokenizer, n_vocab, call_grammar(tokenizer, n_vocab, "hermes", functions, ["get_weather"]))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the weather in Paris?"}], [WEATHER, CLOCK])
    result = generate(target, prompt, 80, SamplingConfig(), tokenizer.eos_ids, constraint=constraint)
    tags = [tokenizer.token_id(tag) for tag in TAGS]
    assert constraint.done() and [t for t in result.tokens if t in tags] == tags
    content, calls = parse_calls(tokenizer.decode(result.tokens), "hermes")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), functions["get_weather"])


# Mistral's call ids

MISTRAL_MARKERS = ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


def test_mistral_ids_are_mapped_before_its_template_sees_them(tmp_path):
    """A conversation carried over from another server (OpenAI's call_... ids), through Mistral v3's own template (on
    SmolLM2's vocabulary with Mistral's markers as special tokens, as tests/test_real_templates.py builds it): it
    renders, each call's id is 9 letters and digits derived from its own (the same every time), each result names its
    call's, an id already 9 letters and digits is kept; a Hermes template's ids are left as they are."""
    tokenizer = smollm2_tokenizer(tmp_path, renamed=MISTRAL_MARKERS, config={
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"},
                                  template="mistral-7b-instruct-v0.3")
    ids = ["call_" + "a1b2c3" * 4, "call_" + "9z8y7x" * 4, "Ab3dE5gh9"]
    calls = [{"id": i, "type": "function", "function": {"name": "get_time", "arguments": json.dumps({"zone": n})}}
             for n, i in enumerate(ids)]
    body = {"messages": [{"role": "user", "content": "The time in three zones?"},
                         {"role": "assistant", "content": None, "tool_calls": calls}] +
                        [{"role": "tool", "tool_call_id": i, "content": f"{n}:00"} for n, i in enumerate(ids)][::-1]}
    messages = messages_of(body)
    with pytest.raises(EagletError, match="alphanumeric strings with length 9"):
        tokenizer.encode_chat(messages, [CLOCK])
    mapped = [mistral_id(i) for i in ids]
    assert mapped[2] == ids[2] and len(set(mapped)) == 3 and mapped == [mistral_id(i) for i in ids]
    assert all(len(m) == 9 and m.isalnum() for m in mapped)
    text = tokenizer.decode(Requests(SimpleNamespace(tokenizer=tokenizer), ["eaglet"]).render(body, messages, [CLOCK])[0])
    assert not any(i in text for i in ids[:2])
    for n, m in enumerate(mapped):
        assert f'"arguments": {{"zone": {n}}}, "id": "{m}"}}' in text
        assert f'{{"content": {n}:00, "call_id": "{m}"}}' in text
    hermes = [{**m, "tool_calls": calls} if m["role"] == "assistant" else m for m in messages]
    assert ids_for_template(tokenizer_with(tmp_path, HERMES), hermes) is hermes
