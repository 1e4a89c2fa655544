"""Real chat templates held to transformers: Qwen3-8B's, Qwen2.5-7B-Instruct's, Llama-3.1-8B-Instruct's and
Mistral-7B-Instruct-v0.3's, as their checkpoints ship them (tests/data/templates, provenance in its README). A
conversation with a system prompt, tools, an assistant turn of tool calls and the tools' results renders to the text
and the tokens transformers' apply_chat_template(tools=...) gives; a forced call decodes to a call the template's
format reads back, and its id passes the template's check when the call comes back in the next request.

The vocabulary is SmolLM2-135M-Instruct's (from its GGUF file, as tests/test_gguf.py reads it), a ChatML one:
<|im_start|> and <|im_end|> are its own special tokens, Qwen's <tool_call> and <tool_response> are plain text. For the
LLaMA-3.1 and Mistral templates some of its unused special tokens are renamed to their markers (<|start_header_id|>,
[INST], [TOOL_CALLS]...), so that each is one special token as in those checkpoints' own vocabularies."""
import json

import pytest

from conftest import ROOT, smollm2_gguf
from model import EagletError
from tokenizer import Tokenizer
from tool_calls import call_format, call_grammar, call_id, chosen_functions, functions_of, parse_calls

TEMPLATES = ROOT / "tests" / "data" / "templates"
# the special tokens each vocabulary gets, in the place of SmolLM2's <repo_name>, <reponame>, <file_sep>, ...
MARKERS = {"chatml": [],
           "llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                     "<|eom_id|>", "<|python_tag|>"],
           "mistral": ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                       "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]}
SPECIAL = {"chatml": {"eos_token": "<|im_end|>"},
           "llama": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
           "mistral": {"bos_token": "<s>", "eos_token": "</s>"}}
# template -> (vocabulary, call format, the most calls one assistant turn may make)
REAL = {"qwen3-8b": ("chatml", "hermes", 2), "qwen2.5-7b-instruct": ("chatml", "hermes", 2),
        "llama-3.1-8b-instruct": ("llama", "llama", 1), "mistral-7b-instruct-v0.3": ("mistral", "mistral", 2)}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a place, for a time < a week from now & in a unit",
    "parameters": {"type": "object", "properties": {
        "place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                   "country": {"enum": ["FR", "NO", "JP"]}},
                  "required": ["city", "country"], "additionalProperties": False},
        "unit": {"enum": ["c", "f"]}}, "required": ["place", "unit"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "description": "Set alarms, each at an hour and a minute",
    "parameters": {"type": "object", "properties": {
        "alarms": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                             "minute": {"type": "integer", "minimum": 0, "maximum": 59}},
            "required": ["hour", "minute"], "additionalProperties": False}},
        "label": {"type": "string", "maxLength": 20}}, "required": ["alarms"], "additionalProperties": False}}}
TOOLS = [WEATHER, ALARM]


@pytest.fixture(scope="session")
def vocabularies(tmp_path_factory):
    """vocabulary name -> a folder with its tokenizer.json and tokenizer_config.json, read alike by both sides."""
    from convert_gguf import gguf_tokenizer, read_gguf
    smollm2 = json.loads(gguf_tokenizer(read_gguf(smollm2_gguf()))["tokenizer.json"])
    folders = {}
    for name, markers in MARKERS.items():
        tok = json.loads(json.dumps(smollm2))
        for slot, marker in zip(tok["added_tokens"][3:], markers):
            tok["model"]["vocab"][marker] = tok["model"]["vocab"].pop(slot["content"])
            slot["content"] = marker
        folders[name] = tmp_path_factory.mktemp(name)
        (folders[name] / "tokenizer.json").write_text(json.dumps(tok))
        (folders[name] / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIAL[name]}))
    return folders


def both(vocabularies, template: str, **kwargs) -> tuple:
    """(eaglet's Tokenizer with the template, transformers' AutoTokenizer of the same files)."""
    from transformers import AutoTokenizer
    folder = vocabularies[REAL[template][0]]
    return (Tokenizer(folder, chat_template=str(TEMPLATES / f"{template}.jinja"), template_kwargs=kwargs),
            AutoTokenizer.from_pretrained(folder))


def transformers_render(theirs, template: str, messages: list, tools, **kwargs) -> tuple:
    """(text, token ids) of apply_chat_template with the template file."""
    chat_template = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    common = dict(tools=tools, add_generation_prompt=True, chat_template=chat_template, **kwargs)
    return (theirs.apply_chat_template(messages, tokenize=False, **common),
            theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **common))


def as_sent_back(call: dict) -> dict:
    """An OpenAI tool call as serve.py hands it to the template: its arguments parsed into an object."""
    function = call["function"]
    return {"id": call["id"], "type": "function",
            "function": {"name": function["name"], "arguments": json.loads(function["arguments"])}}


def conversation(template: str, reasoning: bool = False) -> list:
    """System, user, an assistant turn of tool calls (as many as the template allows, ids in the template's
    format, as eaglet writes them) and their results, as serve.py hands them to the template."""
    form, most = REAL[template][1:]
    calls = [{"id": call_id(form), "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
                 {"place": {"city": "Tromsø", "country": "NO"}, "unit": "c"})}},
             {"id": call_id(form), "type": "function", "function": {"name": "set_alarm", "arguments": json.dumps(
                 {"alarms": [{"hour": 7, "minute": 30}], "label": "Réveil ☀"})}}][:most]
    results = [json.dumps({"temperature": -3, "sky": "snow"}), "done"]
    assistant = {"role": "assistant", "content": "", "tool_calls": [as_sent_back(c) for c in calls]}
    if reasoning:
        assistant["reasoning_content"] = "Two questions, two tools."
    return ([{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
             {"role": "user", "content": "What's the weather in Tromsø? And wake me at 7:30."}, assistant] +
            [{"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": r}
             for c, r in zip(calls, results)])


@pytest.mark.parametrize("template", REAL)
def test_each_real_template_takes_tools_in_its_format(vocabularies, template):
    ours, _ = both(vocabularies, template)
    assert ours.takes_tools() and call_format(ours) == REAL[template][1]


CASES = [("qwen3-8b", {}, False), ("qwen3-8b", {"enable_thinking": True}, True),
         ("qwen3-8b", {"enable_thinking": False}, True), ("qwen2.5-7b-instruct", {}, False),
         ("llama-3.1-8b-instruct", {}, False), ("mistral-7b-instruct-v0.3", {}, False)]


@pytest.mark.parametrize("template, kwargs, reasoning", CASES)
def test_a_tool_conversation_renders_as_transformers_renders_it(vocabularies, template, kwargs, reasoning):
    """Tools, tool calls with their arguments as objects, tool results with their ids and names, the generation
    prompt (Qwen3's thinking switch through the template's own variable): the same text, token for token."""
    ours, theirs = both(vocabularies, template, **kwargs)
    messages = conversation(template, reasoning)
    text, ids = transformers_render(theirs, template, messages, TOOLS, **kwargs)
    assert ours.render_chat(messages, TOOLS) == text
    assert ours.encode_chat(messages, TOOLS) == ids
    assert '"city": "Tromsø"' in text and "< a week from now &" in text  # as json.dumps writes it, not HTML-escaped
    plain = messages[:2]  # no tools at all: the same again
    assert ours.encode_chat(plain) == transformers_render(theirs, template, plain, None, **kwargs)[1]
    if reasoning:  # Qwen3 writes the reasoning of a turn after the last user message in its <think> block
        assert "<|im_start|>assistant\n<think>\nTwo questions, two tools.\n</think>\n\n<tool_call>" in text
    if "enable_thinking" in kwargs:
        empty_thought = "" if kwargs["enable_thinking"] else "<think>\n\n</think>\n\n"
        assert text.endswith("<|im_start|>assistant\n" + empty_thought)


def test_the_template_refusals_are_one_error(vocabularies):
    """What a real template refuses (LLaMA-3.1: two calls in one turn; Mistral: a call id that is not 9 characters,
    as OpenAI's are) is one EagletError carrying the template's own words, where transformers raises them too."""
    from jinja2 import TemplateError
    messages = conversation("mistral-7b-instruct-v0.3")
    openai_id = "call_" + "a" * 24
    messages[2]["tool_calls"][0]["id"] = messages[3]["tool_call_id"] = openai_id
    llama = conversation("qwen3-8b")  # two calls
    for template, wrong, words in [("mistral-7b-instruct-v0.3", messages, "alphanumeric strings with length 9"),
                                   ("llama-3.1-8b-instruct", llama, "only supports single tool-calls")]:
        ours, theirs = both(vocabularies, template)
        with pytest.raises(EagletError, match=words):
            ours.encode_chat(wrong, TOOLS)
        with pytest.raises(TemplateError, match=words):
            transformers_render(theirs, template, wrong, TOOLS)


def test_a_template_failing_in_python_is_one_error(vocabularies, tmp_path):
    """A template's own bug (here: iterating tools, which are None without tools, as transformers passes them) is one
    EagletError naming what Python raised, where transformers raises it as it is."""
    from transformers import AutoTokenizer
    template = "{% for t in tools %}{{ t }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    messages = [{"role": "user", "content": "u"}]
    with pytest.raises(EagletError, match="chat template: TypeError: 'NoneType' object is not iterable"):
        Tokenizer(vocabularies["chatml"], chat_template=str(tmp_path / "t.jinja")).encode_chat(messages)
    with pytest.raises(TypeError):
        AutoTokenizer.from_pretrained(vocabularies["chatml"]).apply_chat_template(messages, chat_template=template,
                                                                                  tokenize=False)


ENVIRONMENT = [  # what transformers' jinja environment gives a template, one feature a line
    "{{ tools is defined }} {{ tools is none }} {{ documents is defined }}",
    "{{ {'b': '<é>', 'a': [1, 2]} | tojson(indent=2, sort_keys=True) }}"
    "{{ [1, {'x': 'é'}] | tojson(separators=(',', ':'), ensure_ascii=True) }}",
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.role }}{% endfor %}",
    "a{% generation %}{% set x = 1 %}[{{ messages[0].content }}{{ x }}]{% endgeneration %}{{ x is defined }}",
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }}{{ dict(a=1) | tojson }}{{ eos_token }}{{ add_generation_prompt }}"]


@pytest.mark.parametrize("template", ENVIRONMENT)
def test_the_template_environment_is_transformers(vocabularies, tmp_path, template):
    from transformers import AutoTokenizer
    (tmp_path / "t.jinja").write_text(template)
    ours = Tokenizer(vocabularies["mistral"], chat_template=str(tmp_path / "t.jinja"))
    theirs = AutoTokenizer.from_pretrained(vocabularies["mistral"])
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert ours.render_chat(messages) == theirs.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                                    add_generation_prompt=True)


@pytest.fixture(scope="module")
def smollm2_target(smollm2):
    from load import load_target
    return load_target(smollm2[1] / "model.pth", "cpu", "fp32", 1024)


@pytest.mark.slow
@pytest.mark.parametrize("template, function", [("qwen3-8b", "get_weather"), ("qwen2.5-7b-instruct", "set_alarm"),
                                                ("llama-3.1-8b-instruct", "set_alarm"),
                                                ("mistral-7b-instruct-v0.3", "get_weather")])
def test_a_forced_call_is_read_back_and_goes_back_through_the_template(vocabularies, smollm2_target, template,
                                                                       function):
    """tool_choice naming a function: SmolLM2 decodes under the call's grammar in the template's format; the reply
    parses into one call of it whose arguments its schema accepts; sent back with its result, the next prompt is
    transformers' too (Mistral's template takes the call's id)."""
    pytest.importorskip("llguidance", reason="forced calls are grammars: pip install llguidance")
    jsonschema = pytest.importorskip("jsonschema", reason="validates the calls' arguments: pip install jsonschema")
    from decode import generate
    from sampling import SamplingConfig
    from grammar import Constraint
    ours, theirs = both(vocabularies, template)
    form, functions = call_format(ours), functions_of(TOOLS)
    names = chosen_functions(functions, {"type": "function", "function": {"name": function}})
    n_vocab = smollm2_target.args.vocab_size
    constraint = Constraint(ours, n_vocab, call_grammar(ours, n_vocab, form, functions, names))
    messages = conversation(template)[:2]
    result = generate(smollm2_target, ours.encode_chat(messages, TOOLS), 120, SamplingConfig(), ours.eos_ids,
                      constraint=constraint)
    assert constraint.done(), "the call is complete"
    content, calls = parse_calls(ours.decode(result.tokens), form)
    assert content is None and [c["function"]["name"] for c in calls] == [function]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), functions[function])
    messages += [{"role": "assistant", "content": "", "tool_calls": [as_sent_back(calls[0])]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "name": function, "content": "ok"}]
    text, ids = transformers_render(theirs, template, messages, TOOLS)
    assert ours.render_chat(messages, TOOLS) == text and ours.encode_chat(messages, TOOLS) == ids
