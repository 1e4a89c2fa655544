"""Reasoning models: a reply that thinks first, <think> ... </think>, then answers, split into its reasoning and its
content (OpenAI-compatible servers' message.reasoning_content and message.content).

Whether a reply thinks is read from the prompt the chat template rendered: Qwen3 leaves the reply free to open
<think> itself (MAY_THINK), with enable_thinking false it writes an empty <think>\\n\\n</think>\\n\\n (ANSWERING),
DeepSeek-R1 and Qwen3's thinking-2507 models open the thinking in the prompt (THINKING). The split follows vLLM's
and SGLang's reasoning parsers: the tags go, so do the newlines just inside them and the whitespace between
</think> and the answer; a reply cut short inside its thinking is all reasoning. Imports nothing of eaglet's.
"""
from typing import Optional

THINK_START, THINK_END = "<think>", "</think>"
WHITESPACE = " \t\r\n"  # what separates </think> from the answer (grammar.py's grammar allows the same)

# Where the rendered prompt leaves the reply
THINKING = "thinking"  # the prompt opened the thinking: the reply thinks until </think>, then answers
MAY_THINK = "may_think"  # the reply may open <think> at its very start, or answer at once
ANSWERING = "answering"  # the prompt closed the thinking (or the template never opened one): all answer


def template_thinks(chat_template: str) -> bool:
    """Whether a chat template's source writes or reads thinking (Qwen3, QwQ, DeepSeek-R1 distills, SmolLM3)."""
    return THINK_START in chat_template or THINK_END in chat_template


def reply_start(prompt: str) -> str:
    """Where a rendered prompt's text leaves the reply: THINKING, MAY_THINK or ANSWERING."""
    if prompt.rstrip().endswith(THINK_END):
        return ANSWERING
    if prompt.rfind(THINK_START) > prompt.rfind(THINK_END):
        return THINKING
    return MAY_THINK


def reasoning_start(parser: str, chat_template: str, prompt: str) -> Optional[str]:
    """The reply's start (reply_start) when replies are split for --reasoning_parser parser (auto or none);
    None when they are not: the parser is none or the template does not think."""
    if parser not in ("auto", "none"):
        raise ValueError(f"reasoning parser {parser!r} is not auto or none")
    return reply_start(prompt) if parser == "auto" and template_thinks(chat_template) else None


def split(text: str, start: str) -> tuple:
    """(reasoning, content) of a whole reply that begins at start: reasoning None where the reply has none."""
    if start == MAY_THINK and text.startswith(THINK_START):
        text, start = text[len(THINK_START):], THINKING
    if start != THINKING:
        return None, text
    reasoning, end, content = text.partition(THINK_END)
    return reasoning.strip("\n") or None, content.lstrip(WHITESPACE) if end else ""


def thinking_tokens(decode, tokens: list, start: str) -> int:
    """How many of a reply's tokens are its thinking (usage's reasoning_tokens): up to the one that completes
    </think>, all of them where it never comes, none where the reply does not think (as split reads it); decode:
    the tokenizer's. A search over prefixes: a dozen decodes for thousands of tokens."""
    text = decode(tokens)
    if start == ANSWERING or (start == MAY_THINK and not text.startswith(THINK_START)):
        return 0
    if THINK_END not in text:
        return len(tokens)
    lo, hi = 1, len(tokens)  # the shortest prefix whose text holds </think>
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if THINK_END in decode(tokens[:mid]) else (mid + 1, hi)
    return lo


class ReasoningStream:
    """split() for a reply that arrives in pieces: feed() each piece, then flush(); each returns the
    (reasoning, content) text it makes known ("" for none). Joined, the pieces are split() of the whole reply
    (a reasoning of "" is None there): what may yet turn out a tag, or whitespace a tag would strip, is held back.
    reasoning_at and content_at: where in the reply's text the reasoning and the content begin, once either is given
    (the held text is always the end of what was fed, so its place is known without keeping the reply)."""

    def __init__(self, start: str):
        self.phase = {THINKING: "thinking", MAY_THINK: "start", ANSWERING: "answer"}[start]
        self.held = ""  # text whose role is not known yet: the last len(held) characters fed
        self.fed = 0  # characters fed
        self.reasoning_at, self.content_at = None, None
        self.thought = False  # whether any reasoning has been given (its leading newlines are stripped until then)

    def feed(self, piece: str) -> tuple:
        self.held += piece
        self.fed += len(piece)
        if self.phase == "start":
            if self.held.startswith(THINK_START):
                self.held, self.phase = self.held[len(THINK_START):], "thinking"
            elif not THINK_START.startswith(self.held):
                self.phase = "answer"
        reasoning = ""
        if self.phase == "thinking":
            at = self.fed - len(self.held)
            reasoning, end, rest = self.held.partition(THINK_END)
            if end:
                self.held, self.phase = rest, "after"
                reasoning = reasoning.rstrip("\n")
            else:
                kept = len(reasoning[:len(reasoning) - partial_tag(reasoning)].rstrip("\n"))
                reasoning, self.held = reasoning[:kept], reasoning[kept:]
            reasoning = self.give_reasoning(reasoning, at)
        if self.phase == "after" and self.held.lstrip(WHITESPACE):
            self.held, self.phase = self.held.lstrip(WHITESPACE), "answer"
        content = self.give_content() if self.phase == "answer" else ""
        return reasoning, content

    def give_reasoning(self, text: str, at: int) -> str:
        """text, which begins at character at of the reply, as reasoning: its leading newlines go, at its start."""
        if not self.thought:
            stripped = text.lstrip("\n")
            at, text = at + len(text) - len(stripped), stripped
            self.reasoning_at = at if text else None
        self.thought = self.thought or bool(text)
        return text

    def give_content(self) -> str:
        content, self.held = self.held, ""
        if content and self.content_at is None:
            self.content_at = self.fed - len(content)
        return content

    def flush(self) -> tuple:
        """What the held text turns out to be when the reply ends: reasoning cut short, or an unfinished <think>."""
        if self.phase == "thinking":
            held, at, self.held = self.held, self.fed - len(self.held), ""
            return self.give_reasoning(held.rstrip("\n"), at), ""
        if self.phase in ("start", "answer"):
            return "", self.give_content()
        self.held = ""
        return "", ""


def partial_tag(text: str) -> int:
    """The length of the longest end of text that begins </think> (0 if none)."""
    return next((n for n in range(min(len(text), len(THINK_END) - 1), 0, -1) if THINK_END.startswith(text[-n:])), 0)
