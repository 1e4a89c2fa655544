"""Reasoning models (reasoning.py, grammar.after_thinking): where a rendered prompt leaves the reply; a reply split
into reasoning and content, streamed in any pieces exactly as whole; a constraint that starts where the thinking
ends, on a sentencepiece vocabulary (the tags are text), a byte-level one, and one that holds <think> and </think>
as tokens of their own as Qwen3's does; and such a constraint kept exactly under speculation."""
import json
from itertools import combinations

import pytest

from decode import TreeConfig, generate
from sampling import SamplingConfig
from load import load_draft, load_target
from conftest import ROOT, smollm2_gguf
from grammar import Constraint, after_thinking, grammar_of, grammar_tokenizer, tag_token
from reasoning import (ANSWERING, MAY_THINK, THINK_END, THINK_START, THINKING, ReasoningStream, reasoning_start,
                       reply_start, split, template_thinks)
from tokenizer import LLAMA2_CHAT_TEMPLATE, Tokenizer, template_environment

QWEN3_ENDING = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
                "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
R1_ENDING = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"


TEMPLATES = ROOT / "tests" / "data" / "templates"


def test_which_templates_think():
    assert template_thinks(QWEN3_ENDING) and template_thinks(R1_ENDING)
    assert template_thinks("{{ content.split('</think>')[-1] }}")  # one that strips past turns' thinking
    assert not template_thinks(LLAMA2_CHAT_TEMPLATE)
    assert template_thinks((TEMPLATES / "qwen3-8b.jinja").read_text(encoding="utf-8"))
    for name in ("qwen2.5-7b-instruct", "llama-3.1-8b-instruct", "mistral-7b-instruct-v0.3"):
        assert not template_thinks((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")), name


@pytest.mark.parametrize("kwargs, start", [({}, MAY_THINK), ({"enable_thinking": True}, MAY_THINK),
                                           ({"enable_thinking": False}, ANSWERING)])
def test_where_qwen3s_own_template_leaves_the_reply(kwargs, start):
    """Qwen3-8B's template as it ships, a second turn after a reply that thought (the template drops that thinking)."""
    template = template_environment().from_string((TEMPLATES / "qwen3-8b.jinja").read_text(encoding="utf-8"))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4"},
                {"role": "user", "content": "3+3?"}]
    prompt = template.render(messages=messages, add_generation_prompt=True, **kwargs)
    assert reply_start(prompt) == start and "Easy." not in prompt


@pytest.mark.parametrize("prompt, start", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", MAY_THINK),  # Qwen3
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", ANSWERING),  # thinking off
    ("<｜User｜>hi<｜Assistant｜><think>\n", THINKING),  # DeepSeek-R1, Qwen3-thinking-2507
    ("<think>a</think>b<｜User｜>hi<｜Assistant｜><think>\n", THINKING),  # an earlier turn's thinking kept
    ("<|im_start|>assistant\n<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", MAY_THINK),
    ("[INST] hi [/INST]", MAY_THINK)])
def test_where_the_prompt_leaves_the_reply(prompt, start):
    assert reply_start(prompt) == start


def test_reasoning_start_follows_the_parser_and_the_template():
    prompt = "<｜Assistant｜><think>\n"
    assert reasoning_start("auto", R1_ENDING, prompt) == THINKING
    assert reasoning_start("none", R1_ENDING, prompt) is None
    assert reasoning_start("auto", LLAMA2_CHAT_TEMPLATE, prompt) is None
    with pytest.raises(ValueError, match="'deepseek_r1' is not auto or none"):
        reasoning_start("deepseek_r1", R1_ENDING, prompt)


@pytest.mark.parametrize("text, start, reasoning, content", [
    ("<think>\nLet me see.\n\nYes.\n</think>\n\nIt is 4.", MAY_THINK, "Let me see.\n\nYes.", "It is 4."),
    ("It is 4.", MAY_THINK, None, "It is 4."),
    (" <think>x</think>y", MAY_THINK, None, " <think>x</think>y"),  # thinking only opens the reply
    ("Let me see.\n</think>\n\nIt is 4.\n", THINKING, "Let me see.", "It is 4.\n"),
    ("Let me see. Two and", THINKING, "Let me see. Two and", ""),  # cut by max_tokens while thinking
    ("<think>\nLet me", MAY_THINK, "Let me", ""),
    ("<think>\n\n</think>\n\n{}", MAY_THINK, None, "{}"),  # empty thinking
    ("</think>x", THINKING, None, "x"),
    ("a < b, </thin is no tag</think> \t\nc</think>d", THINKING, "a < b, </thin is no tag", "c</think>d"),
    ("x</think>\n\u3000y", THINKING, "x", "\u3000y"),  # only the whitespace the grammar allows there goes
    ("<thi", MAY_THINK, None, "<thi"),
    ("<think>\n\n</think>\n\nIt is 4.", ANSWERING, None, "<think>\n\n</think>\n\nIt is 4."),
    ("", THINKING, None, ""), ("", MAY_THINK, None, "")])
def test_split(text, start, reasoning, content):
    assert split(text, start) == (reasoning, content)


TEXTS = ["<think>\nab\n</think>\n\ncd\n", "<think>x</think>", "<think>\n\n</think>\n\n{}", "a < </thin b</think> \nc",
         "<thi", "<thinker>", "x\n</th\n</think>\t\n", "ab\n\n", "<think><think></think></think>", "</think>",
         "\n</think>\n", "<think>\n  a \n</think>  \n b </think> c"]


def streamed(text: str, start: str, cuts) -> tuple:
    stream, reasoning, content = ReasoningStream(start), "", ""
    for a, b in zip((0,) + cuts, cuts + (len(text),)):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.flush()
    return reasoning + r or None, content + c


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_equals_whole_for_every_cut(text):
    """Every way of cutting the shorter texts into pieces (empty pieces too); every one of up to three cuts in the
    longer ones."""
    for start in (THINKING, MAY_THINK, ANSWERING):
        whole = split(text, start)
        ways = len(text) - 1 if len(text) <= 14 else 3
        for n in range(ways + 1):
            for cuts in combinations(range(1, len(text)), n):
                assert streamed(text, start, cuts) == whole, (text, start, cuts)
        assert streamed(text, start, (0, 0, len(text), len(text))) == whole


def test_a_stream_holds_back_only_what_it_must():
    stream = ReasoningStream(MAY_THINK)
    pieces = ["<th", "ink>", "\nLet", " me", " see\n", "</th", "ink>", "\n\n", "It is", " 4."]
    out = [stream.feed(piece) for piece in pieces] + [stream.flush()]
    assert out == [("", ""), ("", ""), ("Let", ""), (" me", ""), (" see", ""), ("", ""), ("", ""), ("", ""),
                   ("", "It is"), ("", " 4."), ("", "")]
    stream = ReasoningStream(THINKING)
    assert [stream.feed("a</"), stream.feed("b"), stream.flush()] == [("a", ""), ("</b", ""), ("", "")]


# The grammar that starts where the thinking ends

GRAMMAR_ENGINE = "structured output's grammar engine: pip install llguidance"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["sentencepiece", "byte-level", "tags as tokens"])
def tokenizer(request, tmp_path_factory):
    """The demo's sentencepiece vocabulary, SmolLM2's byte-level BPE (the tags are text in both), and SmolLM2's with
    <think> and </think> added as Qwen3 adds them (one token each, not special: they decode to their text)."""
    pytest.importorskip("llguidance", reason=GRAMMAR_ENGINE)
    if request.param == "sentencepiece":
        return Tokenizer(ROOT / "demo" / "target")
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from convert_gguf import gguf_tokenizer, read_gguf
    folder = tmp_path_factory.mktemp("tokenizer")
    hf = HFTokenizer.from_str(gguf_tokenizer(read_gguf(smollm2_gguf()))["tokenizer.json"])
    if request.param == "tags as tokens":
        hf.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    hf.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def taken(tokenizer: Tokenizer, grammar: str, start: str, *texts) -> tuple:
    """(how many tokens of the texts, each tokenized apart, the wrapped grammar takes; of how many; whether done)."""
    n_vocab = tokenizer.vocab_size
    constraint = Constraint(tokenizer, n_vocab, after_thinking(tokenizer, n_vocab, grammar, start), forced_min=0)
    tokens = [t for text in texts for t in grammar_tokenizer(tokenizer, n_vocab).tokenize_str(text)]
    return constraint.take(tokens), len(tokens), constraint.done()


def test_the_tags_are_tokens_only_where_the_vocabulary_holds_them(tokenizer):
    as_tokens = tokenizer.token_id(THINK_END) is not None
    assert (tag_token(tokenizer, tokenizer.vocab_size, THINK_END) is not None) == as_tokens
    if as_tokens:  # what the model writes, and what the text round-trips through
        assert tokenizer.encode("a</think>b", bos=False)[1] == tokenizer.token_id(THINK_END)
        assert tokenizer.decode(tokenizer.encode("a</think>b", bos=False)) == "a</think>b"


def test_thinking_is_free_then_the_grammar_holds(tokenizer):
    grammar = grammar_of("json_schema", json.dumps(SCHEMA))
    thought = 'Say {"n": 1} or x < y, </thin or <think>? '
    used, total, done = taken(tokenizer, grammar, THINKING, thought, "</think>", "\n\n", '{"n":12}')
    assert used == total and done
    used, total, done = taken(tokenizer, grammar, THINKING, "So", "</think>", '{"n":3}')
    assert used == total and done  # no whitespace
    used, total, done = taken(tokenizer, grammar, THINKING, thought, "</think>", "\n\n", "It is 12.")
    assert used < total and not done  # the answer is the grammar's
    used, total, _ = taken(tokenizer, grammar, THINKING, thought, "</think>", "</think>")
    assert used < total  # the first </think> ends the thinking, as split ends it
    used, total, done = taken(tokenizer, grammar, THINKING, thought)
    assert used == total and not done  # no end of reply inside the thinking


def test_may_think_or_answer_at_once(tokenizer):
    grammar = grammar_of("json_schema", json.dumps(SCHEMA))
    used, total, done = taken(tokenizer, grammar, MAY_THINK, '{"n":5}')
    assert used == total and done
    used, total, done = taken(tokenizer, grammar, MAY_THINK, "<think>", "\nHm, {\n", "</think>", "\n\n", '{"n":5}')
    assert used == total and done
    used, total, _ = taken(tokenizer, grammar, MAY_THINK, "Hm", '{"n":5}')
    assert used == 0  # text before the answer is not thinking


def test_answering_is_the_grammar_itself(tokenizer):
    grammar = grammar_of("json_schema", json.dumps(SCHEMA))
    assert after_thinking(tokenizer, tokenizer.vocab_size, grammar, ANSWERING) == grammar
    assert taken(tokenizer, grammar, ANSWERING, "<think>")[0] == 0
    with pytest.raises(ValueError, match="unknown reply start 'open'"):
        after_thinking(tokenizer, tokenizer.vocab_size, grammar, "open")


@pytest.mark.parametrize("kind, value, answer", [("regex", r"\n*(yes|no)", "\nno"),
                                                 ("lark", 'start: "yes" | "no"', "no")])
def test_regex_and_lark_grammars_after_thinking(tokenizer, kind, value, answer):
    """A grammar that may begin with whitespace of its own, and Lark (grammar_from_lark's form is the text itself)."""
    grammar = grammar_of(kind, value)
    for start, head in [(THINKING, ["Hm."]), (MAY_THINK, ["<think>", "Hm."]), (MAY_THINK, [])]:
        end = ["</think>", "\n\n"] if head else []
        used, total, done = taken(tokenizer, grammar, start, *head, *end, answer)
        assert used == total and done, (start, head)


def test_a_spelled_out_end_is_refused_where_the_end_is_a_token(tokenizer):
    """With </think> a token of its own, the thinking cannot end in text: the model's text splits where its grammar
    moved on (a </think> spelled in pieces is never inside the thinking either)."""
    if tokenizer.token_id(THINK_END) is None:
        pytest.skip("the tags are text in this vocabulary")
    grammar, n_vocab = grammar_of("json_schema", json.dumps(SCHEMA)), tokenizer.vocab_size
    constraint = Constraint(tokenizer, n_vocab, after_thinking(tokenizer, n_vocab, grammar, THINKING), forced_min=0)
    pieces = [t for text in ("So </", "think", ">") for t in grammar_tokenizer(tokenizer, n_vocab).tokenize_str(text)]
    assert constraint.take(pieces) == len(pieces) - 1


# Exact under speculation

@pytest.fixture(scope="module")
def demo():
    pytest.importorskip("llguidance", reason=GRAMMAR_ENGINE)
    target = load_target(ROOT / "demo" / "target" / "model.pth", "cpu", "fp32", 512)
    head = load_draft(ROOT / "demo" / "head" / "draft.pth", target)
    target.set_feature_layers(head.feature_layers)
    return target, Tokenizer(ROOT / "demo" / "target"), head


@pytest.mark.parametrize("start", [THINKING, MAY_THINK])
def test_speculative_equals_plain_and_the_thinking_is_free(demo, start):
    """Greedy, constrained by a schema after the thinking: speculative decoding gives plain decoding's tokens; the
    thinking (the demo's code model never ends it) is the target's own greedy text up to the first token a
    thinking cannot hold (the end of the reply)."""
    target, tokenizer, head = demo
    prompt, n_vocab, n = tokenizer.encode("def read_lines(path):\n"), target.args.vocab_size, 48
    grammar = after_thinking(tokenizer, n_vocab, grammar_of("json_schema", json.dumps(SCHEMA)), start)
    results = [generate(target, prompt, n, SamplingConfig(), tokenizer.eos_ids, draft=draft,
                        tree=TreeConfig(6, 10, 60), constraint=Constraint(tokenizer, n_vocab, grammar))
               for draft in (None, head)]
    assert results[0].tokens == results[1].tokens
    text = tokenizer.decode(results[1].tokens)
    if start == THINKING:
        free = generate(target, prompt, n, SamplingConfig(), tokenizer.eos_ids).tokens
        free = free[:next((i for i, t in enumerate(free) if t in tokenizer.eos_ids), len(free))]
        assert results[1].tokens[:len(free)] == free and THINK_END not in tokenizer.decode(free)
    if THINK_END in text or start == MAY_THINK and not text.startswith(THINK_START):  # an answer: the schema's
        assert json.loads(split(text, start)[1])["n"] is not None


def test_speculative_equals_plain_after_the_thinking(demo):
    """A reply whose thinking has ended (the demo's model never ends one: its reply so far is given): the nested
    grammar's answer, speculative as plain, valid under the schema."""
    target, tokenizer, head = demo
    n_vocab = target.args.vocab_size
    grammar = after_thinking(tokenizer, n_vocab, grammar_of("json_schema", json.dumps(SCHEMA)), THINKING)
    thought = grammar_tokenizer(tokenizer, n_vocab).tokenize_str("Count the lines.\n</think>\n\n")
    replies = []
    for draft in (None, head):
        constraint = Constraint(tokenizer, n_vocab, grammar)
        assert constraint.take(thought) == len(thought)
        result = generate(target, tokenizer.encode("def read_lines(path):\n") + thought, 24, SamplingConfig(),
                          tokenizer.eos_ids, draft=draft, tree=TreeConfig(6, 10, 60), constraint=constraint)
        assert constraint.done() and constraint.cuts > 0  # the schema steered it
        replies.append(result.tokens)
    assert replies[0] == replies[1]
    assert split(tokenizer.decode(thought + replies[1]), THINKING)[0] == "Count the lines."
    assert isinstance(json.loads(split(tokenizer.decode(thought + replies[1]), THINKING)[1])["n"], int)
