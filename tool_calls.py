"""Tool calls for serve.py: OpenAI's tools and tool_choice, rendered through the checkpoint's own chat template and read
back from the reply in the format that template teaches its model.

Three formats cover the checkpoints that take tools:
    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block a call (Qwen2.5, Qwen3, Hermes)
    llama    {"name": ..., "parameters": {...}} as the whole reply (LLaMA-3.1, 3.2, 3.3)
    mistral  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...] (Mistral v3 tokenizers; the special token is not
             in the decoded text, so the reply is the JSON list)
tool_choice "required" or a named function makes the call a grammar (grammar.py): the reply can only be a call in the
template's format whose arguments satisfy the function's JSON schema, and decoding stays exact (the target's own
distribution restricted to what the grammar allows); Hermes' tags are their own tokens there where the vocabulary
holds them so (Qwen2.5's, Qwen3's). A conversation's call ids reach a Mistral template as the 9 letters and digits it
takes (ids_for_template). Imports grammar.py and tokenizer.py.
"""
import hashlib
import json
import re
import uuid
from typing import Optional

from checkpoint import EagletError
from grammar import closed, grammar_of, tag_token
from tokenizer import Tokenizer

JSON_EXACT = {"whitespace_flexible": False}  # JSON as json.dumps writes it: no runs of whitespace to wander in


def call_format(tokenizer: Tokenizer) -> str:
    """The chat template's tool call format; EagletError when it takes no tools or writes calls eaglet cannot read."""
    if not tokenizer.takes_tools():
        raise EagletError(f"the chat template ({tokenizer.chat_template_source}) has no tool support: it never reads "
                          "the tools it would be given (serve with --chat_template FILE.jinja, one that does)")
    template = tokenizer.tool_template or tokenizer.chat_template
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama"
    raise EagletError("the chat template takes tools, but in a call format eaglet does not read (it reads "
                      "<tool_call> JSON blocks, LLaMA-3.1's JSON and Mistral's [TOOL_CALLS] list)")


def functions_of(tools) -> dict:
    """OpenAI's tools as {name: parameters schema}; EagletError naming what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise EagletError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise EagletError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name, parameters = function.get("name"), function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise EagletError(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ . or -")
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise EagletError(f"tools[{i}].function.parameters must be a JSON schema of an object (a call's arguments "
                              "are one)")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise EagletError(f"tools[{i}].function.strict must be true or false")
        if name in functions:
            raise EagletError(f"tools[{i}]: a second function named {name}")
        functions[name] = parameters
    return functions


def chosen_functions(functions: dict, tool_choice) -> Optional[list]:
    """The names a reply must call (tool_choice required: any of them; a named function: it), or None where the
    model decides (auto) or calls nothing (none)."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return list(functions)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise EagletError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                          '{"name": ...}}')
    if name not in functions:
        raise EagletError(f"tool_choice names {name!r}, which is not one of the tools given")
    return [name]


def call_grammar(tokenizer: Tokenizer, n_vocab: int, form: str, functions: dict, names: list) -> str:
    """A grammar whose every sentence is one call, in the template's format, of one of names with arguments its
    schema accepts (a Lark grammar with llguidance's inline %json); n_vocab: the model's vocabulary size."""
    arguments = "parameters" if form == "llama" else "arguments"
    definitions = {}
    calls = [{"type": "object", "properties": {"name": {"const": name}, arguments: hoisted(closed(functions[name]), i, definitions)},
              "required": ["name", arguments], "additionalProperties": False} for i, name in enumerate(names)]
    call = (calls[0] if len(calls) == 1 else {"anyOf": calls}) | ({"$defs": definitions} if definitions else {})
    if form == "hermes":
        opening, closing = (tag_lark(tokenizer, n_vocab, tag) for tag in ("<tool_call>", "</tool_call>"))
        call_json = json.dumps(call | {"x-guidance": JSON_EXACT})
        lark = f'start: {opening} "\\n" call "\\n" {closing}\ncall: %json {call_json}'
    elif form == "llama":
        lark = f"start: call\ncall: %json {json.dumps(call | {'x-guidance': JSON_EXACT})}"
    else:
        marker = tokenizer.token_id("[TOOL_CALLS]")
        if marker is None:
            raise EagletError("the chat template writes [TOOL_CALLS], but the tokenizer has no such token")
        listed = {"type": "array", "items": call, "minItems": 1, "maxItems": 1, "x-guidance": JSON_EXACT}
        lark = f'start: <[{marker}]> " "? calls\ncalls: %json {json.dumps(listed)}'
    return grammar_of("lark", lark)


def tag_lark(tokenizer: Tokenizer, n_vocab: int, tag: str) -> str:
    """A Hermes tag as the grammar says it: its own token where llguidance holds it apart from text (Qwen2.5's and
    Qwen3's <tool_call> are added tokens that decode to their text; grammar.tag_token), else the text."""
    token = tag_token(tokenizer, n_vocab, tag)
    return json.dumps(tag) if token is None else f"<[{token}]>"


def hoisted(schema: dict, i: int, definitions: dict) -> dict:
    """A function's parameters schema nested inside the call's: its own definitions ($defs, or draft-07's definitions)
    moved into definitions (the root's $defs) as f{i}_NAME and every reference to them rewritten, since a pointer like
    #/$defs/Loc is read from the root of the whole schema."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    renamed = {f"#/{where}/{name}": f"#/$defs/f{i}_{name}" for where in ("$defs", "definitions") for name in own}

    def rewrite(node):
        if isinstance(node, dict):
            return {k: (renamed.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v))
                    for k, v in node.items() if k not in ("$defs", "definitions") or node is not schema}
        return [rewrite(v) for v in node] if isinstance(node, list) else node
    definitions.update({f"f{i}_{name}": rewrite(value) for name, value in own.items()})
    return rewrite(schema)


def parse_calls(text: str, form: str) -> tuple:
    """(content, calls) of a reply: the text before the first call (None if blank) and OpenAI's tool_calls; no
    calls (the reply is not one, or one cut short) -> (text, [])."""
    if form == "hermes":
        content, found = text[:text.find("<tool_call>")], re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
    else:
        content, body = "", text.strip().removeprefix("<|python_tag|>")
        found = [body] if form == "llama" else list_items(body)
    calls = []
    for block in found:
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(call.get("name") if isinstance(call, dict) else None, str) or not isinstance(arguments, dict):
            return text, []
        calls.append({"id": call_id(form), "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
    if not calls:
        return text, []
    return (content if content.strip() else None), calls


def call_id(form: str) -> str:
    """A new call's id: OpenAI's call_ and 24 hex digits; Mistral's templates refuse any id but 9 letters and digits."""
    return uuid.uuid4().hex[:9] if form == "mistral" else "call_" + uuid.uuid4().hex[:24]


def ids_for_template(tokenizer: Tokenizer, messages: list) -> list:
    """The conversation with its tool call ids as the chat template takes them. Mistral's templates refuse any id but
    9 letters and digits, so a conversation carried over from another server (OpenAI's call_... ids) has each id
    mapped to one (mistral_id: the same id always the same, so a tool result still names its call); other formats'
    ids are left as they are."""
    if not any("tool_calls" in m or "tool_call_id" in m for m in messages):
        return messages
    try:
        form = call_format(tokenizer)
    except EagletError:  # the template takes no tools: it has no ids to refuse
        return messages
    if form != "mistral":
        return messages
    return [with_mistral_ids(m) for m in messages]


def with_mistral_ids(message: dict) -> dict:
    message = dict(message)
    if "tool_calls" in message:
        message["tool_calls"] = [call | {"id": mistral_id(call["id"])} for call in message["tool_calls"]]
    if "tool_call_id" in message:
        message["tool_call_id"] = mistral_id(message["tool_call_id"])
    return message


def mistral_id(call: str) -> str:
    """A call id as 9 letters and digits: kept where it is already, else the first 9 hex digits of its SHA-256."""
    return call if re.fullmatch(r"[A-Za-z0-9]{9}", call) else hashlib.sha256(call.encode()).hexdigest()[:9]


def list_items(body: str) -> list:
    """The items of a JSON list, each as JSON text; [] if body is not a list."""
    try:
        items = json.loads(body) if body.startswith("[") else []
    except ValueError:
        return []
    return [json.dumps(item) for item in items] if isinstance(items, list) else []


def streamable(text: str, form: str) -> int:
    """How much of a reply so far may be streamed as content: all of it but what is, or may grow into, a call (the
    rest is sent when the reply is done and parsed)."""
    if form != "hermes":  # a call is the whole reply: hold it while it is blank or starts as one
        stripped = text.lstrip()
        return 0 if not stripped or stripped[0] in "{[<" else len(text)
    marker = "<tool_call>"
    if marker in text:
        return text.index(marker)
    partial = next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)
    return len(text) - partial
