"""A chat or completions request as the Jobs the engine runs, one a choice: its prompts (through the chat template,
with tools and chat_template_kwargs), the room each needs in the cache, where a reasoning model's reply starts, and
the grammar that constrains it (structured output, or a forced tool call).
"""
import asyncio
import copy
import json
from typing import Optional

from checkpoint import EagletError
from grammar import Constraint, after_thinking, grammar_of, response_format_grammar
from reasoning import THINK_END, reasoning_start, template_thinks
from server.engine import Engine, Job
from server.fields import (MAX_CHOICES, NO_EFFECT, READ, REFUSED, TEMPLATE_HINTS, ApiError, choices_of, echo_of, fits_queue,
                           fits_room, grammar_field_of, flag_of, max_tokens_of, messages_of, model_of, number, one_call_of,
                           one_grammar, prompts_of, sampling_of, separate_reasoning_of, stream_of, template_kwargs_of)
from tool_calls import call_format, call_grammar, chosen_functions, functions_of, ids_for_template


class Requests:
    """Turns request bodies into Jobs for one engine; remembers which ignored fields it has warned about.
    reasoning_parser: auto (a reply of a template that thinks is split into reasoning and content, and a grammar
    starts where its thinking ends) or none."""

    def __init__(self, engine: Engine, model_ids: list, reasoning_parser: str = "auto"):
        self.engine, self.model_ids, self.warned = engine, model_ids, set()  # warned: (field, why) a log line named
        tokenizer = engine.tokenizer
        self.template = (tokenizer.chat_template or "") + (tokenizer.tool_template or "")  # the source, as read
        if reasoning_parser == "auto" and template_thinks(self.template) and \
                tokenizer.decode(tokenizer.encode(THINK_END, bos=False)) != THINK_END:
            print(f"warning: the tokenizer's {THINK_END} is a special token its decoding drops: replies are not split "
                  "into reasoning and content (as with --reasoning_parser none)", flush=True)
            reasoning_parser = "none"
        self.reasoning_parser = reasoning_parser

    def jobs(self, body: dict, chat: bool, loop: asyncio.AbstractEventLoop) -> tuple:
        """The request as Jobs, one a choice, their events sent through loop: each prompt (a completion's prompt may
        be a list) n times, each checked against the cache's room, with the request's grammar compiled; whether to
        stream, and usage in the stream. Slow work (the template, tokenizing, the grammar): run it in a worker
        thread, never on the event loop."""
        model_of(body, self.model_ids)
        sampling, seed, stop = sampling_of(body, chat)
        self.warn_once([name for name in body if name not in READ | NO_EFFECT | REFUSED.keys()],
                       "no OpenAI-compatible server eaglet knows defines it")
        elsewhere = ("prompt",) if chat else ("messages", "chat_template_kwargs", "separate_reasoning", "top_logprobs",
                                               "parallel_tool_calls", *TEMPLATE_HINTS)
        self.warn_once([name for name in elsewhere if body.get(name) is not None],
                       f"not read by /v1/{'chat/' if chat else ''}completions")
        n = number(body, "n", 1, 1, MAX_CHOICES, integer=True)
        tools, tool_form, calls = self.tools_of(body, chat)
        one_call = one_call_of(body)
        if chat:
            prompt, opening = self.render(body, messages_of(body), tools)
            prompts, (grammar_start, split_start) = [prompt], self.reply_starts(body, opening)
        else:
            prompts, grammar_start, split_start = self.prompts_of(body.get("prompt")), None, None
        texts = [self.engine.tokenizer.decode(p) for p in prompts] if chat else self.prompt_texts(body.get("prompt"))
        choices_of(len(prompts), n)
        echo, prompt_k = echo_of(body, chat)
        limit, max_tokens = max_tokens_of(body, echo)
        for prompt in prompts:
            fits_room(prompt, limit, max_tokens, self.engine.room(prompt), self.engine.scratch,
                      self.engine.model.max_seq_length, "messages" if chat else "prompt")
        stream, *usage_in_stream = stream_of(body)
        reuse, events = flag_of(body, "cache_prompt", True), asyncio.Queue()
        fits_queue(len(prompts) * n, self.engine.max_queue)
        one_grammar(body, calls)
        if any(t >= self.engine.model.args.vocab_size for t in sampling.logit_bias):
            raise ApiError(400, f"logit_bias names token ids past the vocabulary ({self.engine.model.args.vocab_size})",
                           "logit_bias")
        constraint = self.call_constraint(tool_form, body["tools"], calls, grammar_start) if calls \
            else self.constraint_of(body, grammar_start)
        jobs = [Job(prompt, self.engine.room(prompt) if max_tokens is None else max_tokens, sampling,
                    None if seed is None else seed + k, stop, reuse, loop, events,
                    constraint=None if constraint is None else constraint.copy(), tool_form=tool_form,
                    one_call=one_call, reasoning=split_start, index=i * n + k, ignore_eos=flag_of(body, "ignore_eos", False),
                    echo=echo, prompt_logprobs=prompt_k, prompt_text=text)
                for i, (prompt, text) in enumerate(zip(prompts, texts)) for k in range(n)]
        return jobs, stream, usage_in_stream

    def reply_starts(self, body: dict, opening: str) -> tuple:
        """Where a chat prompt leaves the reply (reasoning.reply_start: thinking, may think, answering), read from
        the generation prompt alone (a <think> in a user's or a tool's text says nothing), None where the template
        never thinks or --reasoning_parser is none: once for the grammar, which starts where the thinking ends, and
        once for the split into reasoning_content and content, which separate_reasoning false turns off."""
        separate = separate_reasoning_of(body)
        start = reasoning_start(self.reasoning_parser, self.template, opening)
        if separate and start is None:
            why = "--reasoning_parser none" if self.reasoning_parser == "none" else "the chat template never thinks"
            raise ApiError(400, f"separate_reasoning: this server has no reasoning to separate ({why})",
                           "separate_reasoning")
        return start, None if separate is False else start

    def tools_of(self, body: dict, chat: bool) -> tuple:
        """(tools for the chat template, the format its calls are read in, the names a call is forced among) of
        OpenAI's tools and tool_choice; (None, None, None) without tools or with tool_choice none."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        if tools is None and choice is None:
            return None, None, None
        if not chat:
            raise ApiError(400, "tools are for /v1/chat/completions", "tools")
        try:
            functions = functions_of(tools)
        except EagletError as e:
            raise ApiError(400, str(e), "tools")
        try:
            calls = chosen_functions(functions, choice)
        except EagletError as e:
            raise ApiError(400, str(e), "tool_choice")
        if choice == "none":
            return None, None, None
        try:
            return tools, call_format(self.engine.tokenizer), calls
        except EagletError as e:
            if calls is None:  # auto: the model decides to call, and it cannot without seeing the tools
                raise ApiError(400, f"{e}; tool_choice auto (the default with tools) needs a template that shows "
                                    "the model its tools: required or a named function forces a call without one, "
                                    "none answers a call's results in text", "tools", "tools_unsupported")
        # a forced call is the grammar's, whatever the template renders: Hermes' <tool_call> block; a template that
        # takes tools in a format eaglet cannot read still shows them
        return (tools if self.engine.tokenizer.takes_tools() else None), "hermes", calls

    def render(self, body: dict, messages: list, tools: Optional[list]) -> tuple:
        """(A conversation's tokens through the chat template, with the request's chat_template_kwargs and the hints
        (reasoning_effort, verbosity) as its variables, and its tool call ids as the template takes them; the text the
        template adds for the reply, its generation prompt, where the template thinks, else ""); a log line for a
        hint the template never reads."""
        tokenizer, kwargs = self.engine.tokenizer, template_kwargs_of(body)
        hints = {name: body[name] for name in TEMPLATE_HINTS if body.get(name) is not None}
        self.warn_once([name for name in hints if name not in self.template], "the chat template never reads it")
        if kwargs or hints:  # a copy of the tokenizer with these variables (no other request sees them)
            tokenizer = copy.copy(tokenizer)
            tokenizer.template_kwargs = {**tokenizer.template_kwargs, **hints, **kwargs}
        try:
            messages = ids_for_template(tokenizer, messages)
            text, opening = tokenizer.render_chat(messages, tools), ""
            if self.reasoning_parser == "auto" and template_thinks(self.template):
                before = tokenizer.render_chat(messages, tools, add_generation_prompt=False)
                opening = text[len(before):] if text.startswith(before) else text
            prompt = tokenizer.encode_with_specials(text)
            if not prompt:  # Llama 2's format, for one, writes nothing for a system message alone
                raise EagletError("the chat template renders these messages as an empty prompt (is a user message "
                                  "missing?)")
            return prompt, opening
        except EagletError as e:  # the template refused: the conversation, or the variables this request gave it
            raise ApiError(400, str(e), self.blamed(messages, tools, kwargs, hints))

    def blamed(self, messages: list, tools: Optional[list], kwargs: dict, hints: dict) -> str:
        """The field a template's refusal is named by: the request's variables where the template takes the
        conversation without them, else messages."""
        if not (kwargs or hints):
            return "messages"
        try:
            self.engine.tokenizer.render_chat(messages, tools)
        except EagletError:
            return "messages"
        return "chat_template_kwargs" if kwargs else next(iter(hints))

    def warn_once(self, names: list, why: str):
        """One log line for each field the reply goes without: the first time a request sends it."""
        for name in names:
            if (name, why) not in self.warned:
                self.warned.add((name, why))
                print(f"warning: a request's field {name!r} is accepted and has no effect: {why}", flush=True)

    def call_constraint(self, tool_form: str, tools: list, names: list, thinking: Optional[str]):
        """The grammar of a forced call (tool_choice required or a named function) as a fresh Constraint."""
        try:
            grammar = call_grammar(self.engine.tokenizer, self.engine.model.args.vocab_size, tool_form,
                                   functions_of(tools), names)
            return self.compiled(grammar, thinking)
        except EagletError as e:
            raise ApiError(400, str(e), "tools", "invalid_grammar")
        except RecursionError:  # (the body's own nesting is bounded by the JSON reader's: a schema's, a bit less)
            raise ApiError(400, "a tool's parameters schema is nested too deeply", "tools", "invalid_grammar")

    def prompts_of(self, prompt) -> list:
        """A completion's prompt as token lists (fields.prompts_of: OpenAI's four shapes); several prompts are
        answered as choices in their order."""
        return [self.engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
                for p in prompts_of(prompt, self.engine.model.args.vocab_size)]

    def prompt_texts(self, prompt) -> list:
        """A completion's prompts as text, as the request gave them (token ids decoded): what echo puts first."""
        return [p if isinstance(p, str) else self.engine.tokenizer.decode(p)
                for p in prompts_of(prompt, self.engine.model.args.vocab_size)]

    def constraint_of(self, body: dict, thinking: Optional[str]):
        """The request's grammar as a fresh grammar.Constraint (None: free text), started where the reply's thinking
        ends (thinking: the reply's start); 400 naming the field and the grammar engine's reason when it cannot be
        compiled."""
        field = grammar_field_of(body)  # checked there: one at most, of its kind
        if field is None:
            return None
        name, value = field
        try:
            if name == "response_format":
                grammar = response_format_grammar(value)
            elif name in ("guided_json", "json_schema", "response_format.schema"):
                grammar = grammar_of("json_schema", value if isinstance(value, str) else json.dumps(value))
            elif name == "guided_choice":
                grammar = grammar_of("lark", "start: " + " | ".join(json.dumps(c) for c in value))
            else:
                grammar = grammar_of("regex" if name.endswith("regex") else "lark", value)
            return self.compiled(grammar, thinking)  # None: response_format text
        except EagletError as e:
            raise ApiError(400, str(e), name.split(".")[0], "invalid_grammar")

    def compiled(self, grammar: Optional[str], thinking: Optional[str]):
        """A grammar as a fresh Constraint; where the reply may think (thinking: its start, not None), one grammar of
        free text up to </think> and then this one, so that decoding stays exact under speculation."""
        if grammar is None:
            return None
        tokenizer, vocab = self.engine.tokenizer, self.engine.model.args.vocab_size
        return Constraint(tokenizer, vocab, grammar if thinking is None else after_thinking(tokenizer, vocab, grammar,
                                                                                              thinking))
