"""The engine's results as OpenAI's replies, the one place OpenAI's objects are shaped: a whole chat.completion /
text_completion object, or a stream's chunks (one per cycle, with what eaglet adds under "eaglet": the range its
drafts made); a thinking reply's reasoning apart from its content (reasoning_content), tool calls read from the
content, logprobs entries from the engine's raw scores in the chat and the completions shapes, usage from its counts.
"""
import json

from reasoning import ReasoningStream, split
from server.engine import Job
from tool_calls import parse_calls, streamable


class StreamReply:
    """The chunks of one streamed request (its choices interleaved, each chunk naming its choice's index)."""

    def __init__(self, jobs: list, head: dict, chat: bool, usage_each_chunk: bool = False):
        self.jobs, self.head, self.chat, self.usage_each_chunk = jobs, head, chat, usage_each_chunk
        self.wants_logprobs, self.tool_form = jobs[0].sampling.logprobs >= 0, jobs[0].tool_form
        self.started, self.offsets, self.content_so_far, self.sent = set(), {}, {}, {}  # sent: of content_so_far
        self.reasoning_streams = {job.index: ReasoningStream(job.reasoning) for job in jobs if job.reasoning is not None}

    def chunk(self, index: int, text, finish=None, extra=None, logprobs=None, calls=None, reasoning="") -> str:
        choice = {"index": index, "finish_reason": finish}
        if self.chat:  # the role in a choice's first chunk only, as OpenAI sends it
            choice["delta"] = ({"role": "assistant"} if index not in self.started else {}) | (
                {"reasoning_content": reasoning} if reasoning else {}) | (
                {"content": text} if text is not None and (text or not reasoning) else {}) | (
                {"tool_calls": [{"index": i} | call for i, call in enumerate(calls)]} if calls else {})
            self.started.add(index)
            choice["logprobs"] = {"content": logprobs} if self.wants_logprobs and logprobs is not None else None
        else:
            choice["text"] = text or ""
            if self.wants_logprobs and logprobs is not None:
                choice["logprobs"], self.offsets[index] = completion_logprobs(logprobs, self.offsets.get(index, b""))
            else:
                choice["logprobs"] = None
        return f"data: {json.dumps({**self.head, 'choices': [choice], **(extra or {})})}\n\n"

    def text(self, index: int, value: tuple) -> list:
        """A cycle's text: its chunk (with tools, the content up to where a call starts or may; the rest at the end;
        a thinking reply's reasoning as it comes, and where its reasoning and content begin in the reply's text)."""
        text, start, marks, scores, count = value  # marks: the reply's characters from accepted drafts, forced; count:
        # the reply's tokens so far
        logprobs = logprob_entries(scores)
        reasoning, where = "", {}
        if index in self.reasoning_streams:
            parts = self.reasoning_streams[index]
            reasoning, text = parts.feed(text)
            where = {name: at for name, at in (("reasoning_at", parts.reasoning_at), ("content_at", parts.content_at))
                     if at is not None}
        text = self.content(index, text)
        if text or reasoning or logprobs:
            return [self.chunk(index, text, extra={"eaglet": {"start": start} | marks | where} | self.so_far(index, count),
                               logprobs=logprobs, reasoning=reasoning)]
        return []

    def so_far(self, index: int, count: int) -> dict:
        """stream_options.continuous_usage_stats, as vLLM sends it: each chunk's choice's usage so far."""
        if not self.usage_each_chunk:
            return {}
        prompt = len(self.jobs[index].prompt)
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": count, "total_tokens": prompt + count}}

    def content(self, index: int, text: str) -> str:
        """What of a reply's new content may be sent now: all of it, or with tools what cannot be part of a call."""
        if not self.tool_form:
            return text
        self.content_so_far[index] = self.content_so_far.get(index, "") + text
        upto = max(self.sent.get(index, 0), streamable(self.content_so_far[index], self.tool_form))
        text, self.sent[index] = self.content_so_far[index][self.sent.get(index, 0):upto], upto
        return text

    def done(self, index: int, value: dict) -> list:
        """A choice's last chunks: reasoning and content held back, its tool calls, its finish_reason and eaglet's
        record."""
        out, finish, job = [], value["finish_reason"], self.jobs[index]
        if index in self.reasoning_streams:
            reasoning, text = self.reasoning_streams[index].flush()
            text = self.content(index, text)
            if reasoning or text:
                out.append(self.chunk(index, text, reasoning=reasoning))
        if self.tool_form:
            content, calls = calls_of(job, reply_parts(job, value["text"])[1])
            if (content or "")[self.sent.get(index, 0):]:
                out.append(self.chunk(index, content[self.sent.get(index, 0):]))
            if calls:
                finish = "tool_calls"
                out.append(self.chunk(index, None, calls=calls))
        return out + [self.chunk(index, None if self.chat else "", finish,
                                 {"eaglet": value["eaglet"]} | self.so_far(index, value["completion_tokens"]))]

    def usage(self, finished: dict) -> str:
        return f"data: {json.dumps({**self.head, 'choices': [], 'usage': usage(self.jobs, finished)})}\n\n"


def whole_reply(jobs: list, done: dict, head: dict, chat: bool) -> dict:
    """The whole reply as one JSON object, its choices in order."""
    choices = []
    for index in sorted(done):
        reply = done[index]
        finish, scores = reply["finish_reason"], reply["logprobs"]
        logprobs = None if scores is None else logprob_entries(scores)
        if chat:
            reasoning, text = reply_parts(jobs[index], reply["text"])
            message = {"role": "assistant"} | ({} if jobs[index].reasoning is None else {"reasoning_content": reasoning})
            content, calls = calls_of(jobs[index], text) if jobs[index].tool_form else (text, [])
            message["content"] = text if not calls else content
            if calls:
                message, finish = message | {"tool_calls": calls}, "tool_calls"
            content = {"message": message, "logprobs": None if logprobs is None else {"content": logprobs}}
        else:
            content = completion_content(jobs[index], reply, logprobs)
        choices.append({"index": index, **content, "finish_reason": finish} | prompt_logprobs(jobs[index], reply))
    stats = done[0]["eaglet"] if len(jobs) == 1 else {"choices": [done[i]["eaglet"] for i in sorted(done)]}
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": usage(jobs, done), "eaglet": stats}


def completion_content(job: Job, reply: dict, logprobs) -> dict:
    """A completion's text and logprobs; with echo, the prompt first (its text as the request gave it, and its tokens'
    entries, the first one's logprob null: nothing came before it), as lm-evaluation-harness reads a loglikelihood."""
    text = reply["text"]
    if job.echo:
        text = job.prompt_text + text
        if logprobs is not None:
            logprobs = [prompt_entry(raw, logprob, top) for _, raw, logprob, top in reply["prompt_scores"]] + logprobs
    return {"text": text, "logprobs": None if logprobs is None else completion_logprobs(logprobs)[0]}


def prompt_entry(raw: bytes, logprob, top: list) -> dict:
    """A prompt token's logprobs entry (the first token's logprob and alternatives: None)."""
    entry = {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
    return entry | {"top_logprobs": None if logprob is None else logprob_entries([(r, p, []) for _, r, p in top])}


def prompt_logprobs(job: Job, reply: dict) -> dict:
    """vLLM's prompt_logprobs of a choice: null for the first prompt token, then per token a map from token id (as
    text) to {"logprob", "decoded_token"}: the prompt's own token and its k likeliest alternatives."""
    if job.prompt_logprobs is None:
        return {}

    def named(entries: list) -> dict:
        return {str(i): {"logprob": p, "decoded_token": raw.decode("utf-8", errors="replace")} for i, raw, p in entries}
    rows = [None if logprob is None else named([(t, raw, logprob)] + top[:job.prompt_logprobs])
            for t, raw, logprob, top in reply["prompt_scores"]]
    return {"prompt_logprobs": rows}


def logprob_entries(scores: list) -> list:
    """OpenAI's chat logprobs entries of the engine's scores, (bytes, logprob, [(bytes, logprob), ...]) a token: the
    token, its bytes, its logprob under the target and its likeliest alternatives."""
    def entry(raw: bytes, logprob: float) -> dict:
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
    return [entry(raw, logprob) | {"top_logprobs": [entry(r, p) for r, p in top]} for raw, logprob, top in scores]


def completion_logprobs(entries: list, before: bytes = b"") -> tuple:
    """Chat logprobs entries in the completions' shape -- tokens, token_logprobs, top_logprobs and text_offset, each
    token's first character in the text, counted over the bytes before it (before: the reply's bytes ahead of these
    entries), so a character split over several tokens counts once -- and the bytes so far. top_logprobs maps each
    alternative's name to its logprob, the sampled token always among them (OpenAI: up to logprobs + 1 entries)."""
    starts = []
    for e in entries:
        starts.append(len(before.decode("utf-8", errors="ignore")))  # a character not yet whole: not counted yet
        before += bytes(e["bytes"])
    return {"tokens": [token_name(e["bytes"]) for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["logprob"] is None else top_by_name(e) for e in entries],
            "text_offset": starts}, before


def token_name(raw: list, taken=()) -> str:
    """A token as the completions' logprobs name it: its text; OpenAI's bytes:\\xe2\\x80 where its bytes are not
    whole UTF-8 (part of a character), or where another token took the text (a byte token and a piece alike)."""
    try:
        text = bytes(raw).decode("utf-8")
        if text not in taken:
            return text
    except UnicodeDecodeError:
        pass
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def top_by_name(entry: dict) -> dict:
    """The alternatives of a token by name, most likely first: the sampled one named as in tokens, the others each
    under a name of its own (decoding partial bytes alone, several read \\ufffd and would share one key)."""
    sampled = token_name(entry["bytes"])
    top = {sampled: entry["logprob"]}
    for t in entry["top_logprobs"]:
        if not (t["bytes"] == entry["bytes"] and t["logprob"] == entry["logprob"]):  # the sampled one: in already
            top[token_name(t["bytes"], top)] = t["logprob"]
    return dict(sorted(top.items(), key=lambda kv: -kv[1]))


def calls_of(job: Job, text: str) -> tuple:
    """(content, OpenAI's tool_calls) of a reply; with parallel_tool_calls false, its first call only."""
    content, calls = parse_calls(text, job.tool_form)
    return content, calls[:1] if job.one_call else calls


def prompt_firsts(jobs: list) -> list:
    """Each distinct prompt's first choice: the one that prefilled it (later ones may reuse its cache)."""
    firsts = {}
    for job in jobs:
        firsts.setdefault(id(job.prompt), job)
    return list(firsts.values())


def usage(jobs: list, done: dict) -> dict:
    """OpenAI's usage of a request: each distinct prompt once, every choice's completion."""
    prompts = prompt_firsts(jobs)
    prompt_tokens = sum(len(job.prompt) for job in prompts)
    completion = sum(reply["completion_tokens"] for reply in done.values())
    cached = sum(done[job.index]["cached_tokens"] for job in prompts)
    thinking = [reply["reasoning_tokens"] for reply in done.values() if reply["reasoning_tokens"] is not None]
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}} | (
        {"completion_tokens_details": {"reasoning_tokens": sum(thinking)}} if thinking else {})


def reply_parts(job: Job, text: str) -> tuple:
    """(reasoning, content) of a whole reply: (None, text) where it is not split."""
    return (None, text) if job.reasoning is None else split(text, job.reasoning)
