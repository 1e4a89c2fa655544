"""Structured output: a JSON schema, JSON mode, a regular expression or a Lark grammar, kept exactly under speculation.

The grammar engine is llguidance (the one vLLM and llama.cpp use): it compiles the grammar against the target's
tokenizer and says, token by token, which tokens may come next. The rule that keeps decoding exact: at every
position the constrained distribution is the target's own, restricted to the tokens the grammar allows and
renormalised. So the speculative cycle runs as it always does; its emitted tokens are walked through the
grammar on the host, and at the first one the grammar refuses the path is cut (decode.generate ends its segment
there and starts the next from the kept tokens, whose prefill gives that position's logits). The pick at a position
(Constraint.pick): the target's own pick if the grammar allows it; if not, greedy takes the masked argmax and
sampling a fresh draw from the restricted distribution. A draw from the whole distribution kept when allowed and
otherwise replaced by a draw from the restricted one is distributed as the restricted one: p(x) + p(refused) p(x) /
p(allowed) = p(x) / p(allowed).
"""
import copy
import json
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from checkpoint import EagletError
from sampling import SamplingConfig, logits_to_probs, sample, sample_from_probs
from reasoning import ANSWERING, MAY_THINK, THINK_END, THINK_START, THINKING
from tokenizer import Tokenizer


def llguidance():
    try:
        import llguidance as module
    except ImportError:
        raise EagletError("structured output needs the llguidance package: pip install llguidance")
    return module


class SentencePieceTokens:
    """A sentencepiece model as llguidance's TokenizerWrapper reads one: every id's bytes, and an encoder."""

    def __init__(self, sp, n_vocab: int, eos_id: int):
        self.sp, self.eos_token_id, self.bos_token_id = sp, eos_id, sp.bos_id()
        self.tokens = [self.piece_bytes(i) if i < sp.get_piece_size() else b"" for i in range(n_vocab)]
        self.special_token_ids = [i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]

    def piece_bytes(self, i: int) -> bytes:
        piece = self.sp.id_to_piece(i)
        if self.sp.is_byte(i):  # <0x0A>
            return bytes([int(piece[3:5], 16)])
        if self.sp.is_control(i) or self.sp.is_unknown(i):
            return b""
        return piece.replace("\u2581", " ").encode("utf-8")

    def __call__(self, text: str) -> list:
        return self.sp.encode(text)


@lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer: Tokenizer, n_vocab: int):
    """The tokenizer as llguidance needs it (building it reads every token: done once per tokenizer)."""
    ll = llguidance()
    eos = sorted(tokenizer.eos_ids)
    if tokenizer.hf is not None:
        return ll.LLTokenizer(tokenizer.hf.to_str(), n_vocab=n_vocab, eos_token=eos or None)
    wrapper = ll.TokenizerWrapper(SentencePieceTokens(tokenizer.sp, n_vocab, eos[0] if eos else tokenizer.sp.eos_id()))
    return ll.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos or None)


def token_bytes(tokenizer: Tokenizer, n_vocab: int, token: int) -> bytes:
    """A token's own bytes (a byte-level token may hold part of a UTF-8 character): what logprobs report."""
    return grammar_tokenizer(tokenizer, n_vocab).decode_bytes([token])


# Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas: where closed() looks.
SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
             "propertyNames", "unevaluatedItems", "unevaluatedProperties")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema):
    """The schema with every object that names its properties and leaves additionalProperties unset closed to other
    keys (additionalProperties false), as OpenAI's strict mode, vLLM's default grammar engine and guidance read a
    tool's parameters: JSON Schema's own reading (any other key allowed) lets a small model wander into keys no one
    asked for. An object that says what else it allows (additionalProperties, patternProperties,
    unevaluatedProperties) is left as written; so is one that names no properties (any object)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in SUBSCHEMA or k in SUBSCHEMA_LISTS else
           {name: closed(v2) for name, v2 in v.items()} if k in SUBSCHEMA_MAPS and isinstance(v, dict) else v
           for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                          "unevaluatedProperties"} & schema.keys():
        out["additionalProperties"] = False
    return out


def grammar_of(kind: str, value, strict: bool = False) -> str:
    """llguidance's grammar for a json_schema (a dict), json_object, regex or lark (a string); EagletError when it
    cannot be compiled. strict: a schema keyword the engine would ignore is refused rather than loosened."""
    ll = llguidance()
    try:
        if kind in ("json_schema", "json_object"):  # JSON as json.dumps writes it: no runs of whitespace to wander in
            schema = closed(json.loads(value) if isinstance(value, str) else value) if kind == "json_schema" \
                else {"type": "object"}
            grammar = ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = ll.LLMatcher.grammar_from_regex(value)
        elif kind == "lark":
            grammar = ll.LLMatcher.grammar_from_lark(value)
        else:
            raise EagletError(f"unknown grammar kind {kind!r}")
    except (ValueError, TypeError, RuntimeError) as e:
        raise EagletError(f"the {kind} cannot be compiled: {one_line(str(e))}")
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or (strict and messages):
        raise EagletError(f"the {kind} cannot be compiled{' strictly' if not is_error else ''}: "
                          f"{one_line('; '.join(messages))}")
    return grammar


def one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def engine_error(matcher) -> str:
    """llguidance's error, its first line: the rest is the engine's state, the whole grammar at times."""
    return (matcher.get_error().splitlines() or [""])[0][:500]


class Constraint:
    """One generation's grammar state: which tokens may come next, the tokens it has taken, and the pick."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, grammar: str, forced_min: int = 1):
        """forced_min: the shortest run of forced tokens taken without the target (0: none; decode.generate_constrained)."""
        ll = llguidance()
        self.n_vocab, self.forced_min = n_vocab, forced_min
        self.matcher = ll.LLMatcher(grammar_tokenizer(tokenizer, n_vocab), grammar, log_level=0)
        self.check_start(grammar_tokenizer(tokenizer, n_vocab))
        self.start_counts()

    def check_start(self, tokens):
        """Refuse, before any decoding, a grammar that matches nothing (its first mask puts the engine in error) or
        whose first token already takes it past its limits (e.g. 2,000 alternatives in one rule): a copy of the
        matcher takes the first token of text the mask allows (a special token's own quirks are not the grammar's)."""
        allowed = self.allowed("cpu").nonzero().flatten().tolist()
        probe = self.matcher.deep_copy()
        if allowed and not self.matcher.is_error() and not self.matcher.is_stopped():
            probe.consume_token(next((t for t in allowed if not tokens.is_special_token(t)), allowed[0]))
        for matcher in (self.matcher, probe):
            if matcher.is_error():
                first = engine_error(matcher)
                raise EagletError("the grammar cannot be used: " + (
                    "no token starts a text it matches" if first == "NoExtensionBias" else first))

    def start_counts(self):
        self.cuts = 0  # positions where the target's pick was refused and the masked pick taken
        self.forced_runs, self.forced_tokens = 0, 0  # runs of forced tokens taken without the target (forced)
        self.last_run = []  # the run the last take() was followed by (serve.py marks those tokens)

    def copy(self) -> "Constraint":
        """Another generation's Constraint on the same grammar (a request's n choices), compiled once: the copy's
        matcher is a deep copy of this one's, in the state this one is in (make copies before taking tokens)."""
        other = copy.copy(self)
        other.matcher = self.matcher.deep_copy()
        other.start_counts()
        return other

    def allowed(self, device) -> Tensor:
        """bool [n_vocab]: the tokens the grammar allows next."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        bits = (words[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # little-endian words: bit i = token i
        return bits.flatten()[:self.n_vocab].bool().to(device)

    def allows(self, token: int) -> bool:
        """Whether token is in the grammar's mask here. The mask, not validate_tokens, is what "allowed" means
        everywhere (the check and the masked pick must restrict to one set, or the law is neither restriction):
        llguidance's mask keeps a forced text to its canonical tokens, where validate_tokens would also take
        another spelling of it (four spaces then "return" for "    return")."""
        mask = self.matcher.compute_bitmask()
        return 0 <= token < self.n_vocab and bool(mask[token >> 3] >> (token & 7) & 1)

    def take(self, tokens: list) -> int:
        """Advance over the longest prefix of tokens the grammar allows; how many that is."""
        self.last_run = []
        for n, token in enumerate(tokens):
            if not self.allows(token):
                return n
            if not self.matcher.consume_token(token):
                raise EagletError("the grammar engine refused a token its mask allowed: "
                                  f"{engine_error(self.matcher)}")
        return len(tokens)

    def forced(self, limit: int) -> list:
        """The run of tokens the grammar forces from here, taken (at most limit; none if shorter than forced_min): each
        is the only token the mask allows at its position, so the constrained distribution there is that token with
        probability 1 whatever the target says -- greedy or sampled, plain decoding would emit it too."""
        run = []
        while len(run) < limit and not self.matcher.is_stopped():
            allowed = self.allowed("cpu")
            if int(allowed.sum()) != 1:
                break
            token = int(allowed.nonzero()[0])
            if not self.matcher.consume_token(token):
                raise EagletError("the grammar engine refused the token it forced: "
                                  f"{engine_error(self.matcher)}")
            run.append(token)
        if len(run) < max(self.forced_min, 1):
            self.matcher.rollback(len(run))
            return []
        self.forced_runs, self.forced_tokens, self.last_run = self.forced_runs + 1, self.forced_tokens + len(run), run
        return run

    def pick(self, logits: Tensor, sampling: SamplingConfig) -> Tensor:
        """The next token at a position whose logits [V] are given: the target's pick if allowed, else the masked one."""
        token = sample(logits, sampling)
        if self.allows(int(token)):
            return token
        self.cuts += 1
        allowed = self.allowed(logits.device)
        if not bool(allowed.any()):
            raise EagletError("the grammar allows no token here (the grammar engine's state is "
                              f"{engine_error(self.matcher) or 'stopped'})")
        if sampling.temperature == 0:
            return logits.float().masked_fill(~allowed, float("-inf")).argmax(-1)
        probs = logits_to_probs(logits, sampling) * allowed
        if not float(probs.sum()) > 0:
            # top-k / top-p left no allowed token, or a low temperature rounded every allowed one to 0: the
            # temperature's distribution restricted, computed from masked logits (the law is the same: softmax of
            # the allowed logits alone)
            masked = logits.float().masked_fill(~allowed, float("-inf"))
            probs = logits_to_probs(masked, SamplingConfig(sampling.temperature))
        return sample_from_probs(probs / probs.sum())

    def done(self) -> bool:
        return self.matcher.is_stopped()


def response_format_grammar(response_format) -> Optional[str]:
    """OpenAI's response_format as a grammar (None for text); EagletError names what is wrong."""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise EagletError('response_format must be an object with a "type"')
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar_of("json_object", None)
    if kind != "json_schema":
        raise EagletError(f"response_format type {kind!r} is not text, json_object or json_schema")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise EagletError('response_format json_schema must be an object holding a "schema" object (and its "name")')
    if "name" in spec and not isinstance(spec["name"], str):  # OpenAI requires one; llama.cpp's clients send none
        raise EagletError('response_format json_schema\'s "name" must be a string')
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise EagletError('response_format json_schema\'s "strict" must be true or false')
    return grammar_of("json_schema", json.dumps(spec.get("schema", {})), strict=spec.get("strict") is True)


def after_thinking(tokenizer: Tokenizer, n_vocab: int, grammar: str, start: str) -> str:
    """grammar (grammar_of's, or any llguidance grammar) started where the reply's thinking ends, for a reply that
    begins at start (reasoning.reply_start): THINKING -> any text up to </think>, whitespace, then grammar;
    MAY_THINK -> either <think>, any text up to </think> and whitespace, or nothing, then grammar; ANSWERING ->
    grammar. The thinking ends at its first </think>, where reasoning.split ends it, so the content split from a
    reply is a sentence of grammar (less any whitespace grammar itself begins with: the split strips it)."""
    if start not in (THINKING, MAY_THINK, ANSWERING):
        raise ValueError(f"unknown reply start {start!r}")
    if start == ANSWERING:
        return grammar
    try:
        top = json.loads(grammar)
    except ValueError:
        top = None
    if not isinstance(top, dict) or "grammars" not in top:  # grammar_from_lark's form: the Lark text itself
        top = {"grammars": [{"lark_grammar": grammar}]}
    answer = {**top["grammars"][0]}
    answer["name"] = answer.get("name") or "answer"
    thinking = {"name": "thinking_first", "lark_grammar": thinking_lark(tokenizer, n_vocab, start, answer["name"])}
    return json.dumps({**top, "grammars": [thinking, answer] + top["grammars"][1:]})


def thinking_lark(tokenizer: Tokenizer, n_vocab: int, start: str, answer: str) -> str:
    """The Lark grammar of a reply's thinking, then the grammar named answer (llguidance's @answer: a nested grammar,
    with lexemes of its own). Where </think> is text, the thinking is a lazy lexeme, which ends at the first </think>
    it holds. Where it is a token of its own (tag_token), the thinking is text without a </think> in it (a greedy
    lexeme, which ends where a token that is no text comes) and the added tokens that decode to text (Qwen3's
    <tool_call>), then that token."""
    opening, end = tag_token(tokenizer, n_vocab, THINK_START), tag_token(tokenizer, n_vocab, THINK_END)
    opening = json.dumps(THINK_START) if opening is None else f"<[{opening}]>"
    tag = THINK_END.replace("/", "\\/")  # as a /regex/ holds it
    lines = [f"start: thought WS? @{answer}" if start == THINKING else f"start: ({opening} thought WS?)? @{answer}",
             "WS: /[ \\t\\r\\n]{1,4}/"]  # reasoning.WHITESPACE; bounded, as grammar_of's JSON is: none to wander in
    if end is None:
        return "\n".join(lines + [f"thought[lazy]: /(?s:.*){tag}/"]) + "\n"
    others = [t for t in added_text_tokens(tokenizer, n_vocab) if t != end]
    between = f"(<[{','.join(map(str, others))}]> THOUGHT?)* " if others else ""
    return "\n".join(lines + [f"thought: THOUGHT? {between}<[{end}]>",
                              f"THOUGHT: /(?s:.+)/ & ~/(?s:.*){tag}(?s:.*)/"]) + "\n"


def added_text_tokens(tokenizer: Tokenizer, n_vocab: int) -> list:
    """The added tokens that decode to their text (not special to the tokenizer) but that llguidance holds apart from
    text: Qwen3's <think>, </think>, <tool_call>."""
    if tokenizer.hf is None:
        return []
    ll = grammar_tokenizer(tokenizer, n_vocab)
    return sorted(t for t, added in tokenizer.hf.get_added_tokens_decoder().items()
                  if not added.special and t < n_vocab and ll.is_special_token(t))


def tag_token(tokenizer: Tokenizer, n_vocab: int, tag: str) -> Optional[int]:
    """The id of the tag's own token where llguidance holds it apart from text, else None.
    Qwen3's <think> and </think> are added tokens that are not special (they decode to their text), but llguidance
    treats its added tokens as special: their bytes are not text to it, so a text literal would refuse the token the
    model writes. The <[id]> form matches that token, and the thinking's text then refuses a </think> spelled in
    pieces, so the text splits where the grammar moved on. A tag that is an ordinary token, or several (a
    sentencepiece vocabulary), is text. (A tag special in the tokenizer itself, which decoding drops, must be decoded
    kept for reasoning.split to find it.)"""
    token = tokenizer.token_id(tag)
    if token is None or not 0 <= token < n_vocab:
        return None
    return token if grammar_tokenizer(tokenizer, n_vocab).is_special_token(token) else None
