"""OpenAI's request fields, each checked on its own: sampling, logprobs, stop strings, the conversation. A wrong one is
an ApiError -- the HTTP status and OpenAI's error JSON naming the field; a field that would change the reply and that
eaglet does not do is refused, never silently ignored.
"""
import json
import math
from typing import Optional

from fastapi.responses import JSONResponse

from sampling import MAX_TOP_LOGPROBS, SamplingConfig, is_token_id

MAX_CHOICES = 16  # prompts x n of one request
# Fields that would change the reply and that eaglet does not do -- OpenAI's, then vLLM's, SGLang's, llama.cpp's --
# with the value that asks for nothing (None: no value does): any other value is a 400 naming the field.
REFUSED = {"functions": None, "function_call": None, "best_of": 1, "suffix": "", "audio": None, "modalities": ["text"],
           "web_search_options": None, "use_beam_search": False, "length_penalty": 1, "early_stopping": False,
           "stop_token_ids": [],
           "include_stop_str_in_output": False, "skip_special_tokens": True, "bad_words": [], "allowed_token_ids": None,
           "guided_whitespace_pattern": None, "structural_tag": None, "ebnf": None,
           "chat_template": None, "documents": None, "add_generation_prompt": True, "continue_final_message": False,
           "repeat_penalty": 1, "typical_p": 1, "tfs_z": 1, "mirostat": 0, "n_probs": 0}
# structured output: OpenAI's response_format, and the fields other engines name (vLLM's guided_*, SGLang's regex,
# llama.cpp's json_schema)
GRAMMAR_FIELDS = ("response_format", "guided_json", "json_schema", "regex", "guided_regex", "grammar",
                  "guided_grammar", "guided_choice")
TEMPLATE_HINTS = ("reasoning_effort", "verbosity")  # passed to the chat template, for one that reads them
READ = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
        "seed", "n", "stream", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "cache_prompt", "chat_template_kwargs", "separate_reasoning", "ignore_eos", "echo",
        "prompt_logprobs", *GRAMMAR_FIELDS,
        *TEMPLATE_HINTS}
# defined by OpenAI or another server, and the reply is the same with them: accepted without a word
NO_EFFECT = {"user", "store", "metadata", "service_tier", "prediction", "prompt_cache_key", "safety_identifier",
             "request_id", "priority", "guided_decoding_backend"}


class ApiError(Exception):
    """A request the server refuses: OpenAI's error JSON with this status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self, headers=None) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error", 503: "server_overloaded"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


def number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    """body[name] (or default) as a finite number in [low, high]; an integer where integer."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:60]}", name)
    if not low <= value <= high or isinstance(value, float) and not math.isfinite(value):  # ints: any size
        raise ApiError(400, f"{name} must be between {low} and {high}, got {str(value)[:60]}", name)
    return value


def harmless(name: str, value) -> bool:
    """value asks for nothing this server would leave undone: equal to the harmless value AND of its kind (in
    Python 0 == False and True == 1, so use_beam_search 1 or best_of true would pass as off); 0 and 0.0 alike."""
    default = REFUSED[name]
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default
    return default is not None and type(value) is type(default) and value == default


def logprobs_of(body: dict, chat: bool) -> int:
    """How many alternatives logprobs report per token, -1 for none: chat's logprobs (true / false) and top_logprobs,
    or a completion's logprobs (a count)."""
    if not chat:
        count = number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
        return -1 if count is None else count
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"logprobs must be true or false, got {json.dumps(wanted)[:40]}", "logprobs")
    top = number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else -1


def logit_bias_of(body: dict) -> dict:
    """OpenAI's logit_bias: token ids (as JSON keys, text) to biases from -100 to 100, as {id: bias}."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or not all(map(is_token_id, bias)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100 for v in bias.values()):
        raise ApiError(400, "logit_bias must map token ids to numbers from -100 to 100", "logit_bias")
    return {int(k): float(v) for k, v in bias.items()}


def sampling_of(body: dict, chat: bool = True) -> tuple:
    """(SamplingConfig, seed, stop strings) from a request's fields."""
    for name in REFUSED:
        if body.get(name) is not None and not harmless(name, body[name]):
            hint = " (give tools)" if name.startswith("function") else ""
            raise ApiError(400, f"this server cannot honour {name} {json.dumps(body[name])[:60]}{hint}", name,
                           "unsupported_parameter")
    temperature = number(body, "temperature", 1.0, 0, 100)
    top_p = number(body, "top_p", 1.0, 0, 1)
    if top_p == 0:
        raise ApiError(400, "top_p must be above 0", "top_p")
    top_k = number(body, "top_k", 0, 0, 1 << 31, integer=True)
    seed = number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "stop must be a non-empty string or a list of at most 4 of them", "stop")
    min_p = number(body, "min_p", 0.0, 0, 1)
    penalties = {name: number(body, name, default, low, high) for name, default, low, high in (
        ("presence_penalty", 0.0, -2, 2), ("frequency_penalty", 0.0, -2, 2), ("repetition_penalty", 1.0, 0.01, 100))}
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, **penalties,
                              logit_bias=logit_bias_of(body), logprobs=logprobs_of(body, chat),
                              min_tokens=number(body, "min_tokens", 0, 0, 1 << 31, integer=True))
    return sampling, seed, stop


def messages_of(body: dict) -> list:
    """The conversation as the chat template reads it: text content; an assistant's tool_calls with their
    arguments as objects (as templates expect them); a tool's result with the id of the call it answers."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out, call_ids = [], set()  # the ids of the calls made so far: a tool result answers one of them
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", "messages")
        role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role must be system, developer, user, assistant or tool, got "
                                f"{json.dumps(role)[:40]}", "messages")
        if isinstance(content, list):  # parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if content is None and role == "assistant" and calls:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        message = {"role": "system" if role == "developer" else role, "content": content}
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(400, f"messages[{i}]: a tool message needs the tool_call_id it answers", "messages")
            if m["tool_call_id"] not in call_ids:
                raise ApiError(400, f"messages[{i}]: tool_call_id {json.dumps(m['tool_call_id'])[:60]} answers no call "
                                    "an assistant message before it made", "messages")
            message |= {"tool_call_id": m["tool_call_id"]} | ({"name": m["name"]} if isinstance(m.get("name"), str) else {})
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):  # Qwen3's template shows it again
            message["reasoning_content"] = m["reasoning_content"]
        if role == "assistant" and calls is not None:
            message["tool_calls"] = [call_of(i, call) for call in (calls if isinstance(calls, list) else [None])]
            call_ids.update(call["id"] for call in message["tool_calls"])
        out.append(message)
    return out


def call_of(i: int, call) -> dict:
    """An assistant message's tool call, its arguments (OpenAI sends JSON text) parsed into an object."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"messages[{i}].tool_calls: each must be {{\"id\", \"type\": \"function\", \"function\": "
                            '{"name", "arguments": a JSON object as text}}', "messages")
    return {"id": str(call.get("id", "")), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def model_of(body: dict, model_ids: list):
    """The request's model: one of the names this server answers to, or absent (the page's requests, and lenient
    clients)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string, the name of a model (GET /v1/models lists them)", "model")
    if model is not None and model not in model_ids:
        raise ApiError(404, f"the model {json.dumps(model)[:80]} does not exist here; this server has "
                            f"{', '.join(model_ids)}", "model", "model_not_found")
    return model


def one_call_of(body: dict) -> bool:
    """parallel_tool_calls false: the reply's first call only."""
    return not flag_of(body, "parallel_tool_calls", True)


def flag_of(body: dict, name: str, default: bool) -> bool:
    """A true / false field (null: the default), e.g. ignore_eos (vLLM's, which load testers send for replies of a
    fixed length: decode past end-of-sequence up to max_tokens) or cache_prompt."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):  # (1 == True: not a test of value)
        raise ApiError(400, f"{name} must be true or false", name)
    return default if value is None else value


def choices_of(prompts: int, n: int):
    if prompts * n > MAX_CHOICES:
        raise ApiError(400, f"{prompts} prompts x n {n} = {prompts * n} choices; at most {MAX_CHOICES}", "n")


def max_tokens_of(body: dict, echo: bool = False) -> tuple:
    """(the field that limits the reply, its value or None): max_completion_tokens where given, else max_tokens; 0
    only with echo (the prompt scored, no reply: lm-evaluation-harness's loglikelihood)."""
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = number(body, limit, None, 0 if echo else 1, 1 << 31, integer=True)
    if limit == "max_completion_tokens" and body.get("max_tokens") not in (None, value):
        raise ApiError(400, "max_tokens and max_completion_tokens differ: give one of them (max_completion_tokens "
                            "is OpenAI's newer name)", "max_tokens")
    least = body.get("min_tokens")
    if value is not None and type(least) is int and least > value:  # (its own checks: sampling_of)
        raise ApiError(400, f"min_tokens ({least}) is over {limit} ({value})", "min_tokens")
    return limit, value


def echo_of(body: dict, chat: bool) -> tuple:
    """(echo: a completion's reply starts with its prompt, scored with logprobs; vLLM's prompt_logprobs k or None).
    Both come from the prompt's own prefill and are answered whole (a stream of them is refused)."""
    echo, k = flag_of(body, "echo", False), number(body, "prompt_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    if echo and chat:
        raise ApiError(400, "echo is for /v1/completions", "echo")
    for name, given in (("echo", echo), ("prompt_logprobs", k is not None)):
        if given and flag_of(body, "stream", False):
            raise ApiError(400, f"{name} is answered whole: leave out stream", name)
    return echo is True, k


def fits_room(prompt: list, limit: str, max_tokens: Optional[int], room: int, scratch: int, slots: int,
              prompt_field: str = "prompt"):
    """A prompt and the reply's limit fit the cache: room, what the cache's slots leave past the prompt and the draft
    tree's scratch. Without a limit sent, the prompt is what does not fit: its field is named."""
    if max_tokens is None and room < 1:
        raise ApiError(400, f"the {prompt_field} ({len(prompt)} tokens) leaves no room for a reply: with one token "
                            f"and the draft tree's scratch ({scratch}) it needs {len(prompt) + 1 + scratch} slots; the "
                            f"cache holds {slots}", prompt_field, "context_length_exceeded")
    if room < 1 or (max_tokens or 1) > room:
        raise ApiError(400, f"the prompt ({len(prompt)} tokens) and {limit} ({max_tokens or 1}) need "
                            f"{len(prompt) + (max_tokens or 1) + scratch} slots with the draft tree's "
                            f"scratch ({scratch}); the cache holds {slots}",
                       limit, "context_length_exceeded")


def stream_of(body: dict) -> tuple:
    """(whether to stream, whether the stream ends with usage, whether every chunk carries the usage so far: vLLM's
    continuous_usage_stats) of stream and stream_options."""
    stream, options = flag_of(body, "stream", False), body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    if body.get("stream_options") is not None and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    return stream, flag_of(options, "include_usage", False), flag_of(options, "continuous_usage_stats", False)


def fits_queue(choices: int, max_queue: int):
    if choices > max_queue:
        raise ApiError(400, f"{choices} choices (prompts x n) would never fit the queue of "
                            f"{max_queue} (--max_queue)", "n")


def one_grammar(body: dict, calls: Optional[list]):
    """A forced tool call is a grammar itself: no other grammar field beside it."""
    if calls and any(body.get(name) not in (None, {"type": "text"}) for name in GRAMMAR_FIELDS):
        raise ApiError(400, "a tool_choice that forces a call is a grammar itself: give it or a response_format "
                            "(or regex, grammar), not both", "tool_choice")


def separate_reasoning_of(body: dict) -> Optional[bool]:
    return flag_of(body, "separate_reasoning", None)


def template_kwargs_of(body: dict) -> dict:
    """chat_template_kwargs: the chat template's own variables, none of those the server sets."""
    kwargs = body.get("chat_template_kwargs") or {}
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}
    if not isinstance(kwargs, dict) or reserved & kwargs.keys():
        raise ApiError(400, f"chat_template_kwargs must be an object without {', '.join(sorted(reserved))}",
                       "chat_template_kwargs")
    return kwargs


def prompts_of(prompt, vocab: int) -> list:
    """A completion's prompt as a list of prompts, each a string or a list of token ids (OpenAI's four shapes: a
    string, a list of strings, a list of token ids, or a list of such lists)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    ok = isinstance(prompt, list) and prompt
    if ok and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    if not ok or not all(p and (isinstance(p, str) or isinstance(p, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p)) for p in prompt):
        raise ApiError(400, "prompt must be a non-empty string or token-id list, or a list of them", "prompt")
    for p in prompt:
        if isinstance(p, list) and not all(0 <= t < vocab for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    return prompt


def grammar_field_of(body: dict) -> Optional[tuple]:
    """(the grammar field given, its value) of a request (None: free text): one of them at most, its value of the
    kind the field takes; llama.cpp's schema in response_format named response_format.schema."""
    given = [name for name in GRAMMAR_FIELDS if body.get(name) is not None
             and body[name] != {"type": "text"}]
    if not given:
        return None
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(given)}, not several", given[1])
    name, value = given[0], body[given[0]]
    if name == "response_format" and isinstance(value, dict) and value.get("type") == "json_object" \
            and value.get("schema") is not None:  # llama.cpp's way to give a schema
        value, name = value["schema"], "response_format.schema"
    if name in ("guided_json", "json_schema", "response_format.schema"):
        if not isinstance(value, (dict, str)):
            raise ApiError(400, f"{name} must be a JSON schema (an object or its text)", name.split(".")[0],
                           "invalid_grammar")
    elif name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, "guided_choice must be a non-empty list of non-empty strings", name, "invalid_grammar")
    elif name != "response_format" and (not isinstance(value, str) or not value):
        raise ApiError(400, f"{name} must be a non-empty string", name, "invalid_grammar")
    return name, value
