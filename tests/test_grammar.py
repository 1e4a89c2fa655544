"""Structured output (grammar.py, llguidance): every reply is valid under its schema, regex or grammar; constrained
speculative decoding gives constrained plain decoding's tokens (greedy) for every head kind, compiled too; sampling
follows the target's distribution restricted to what the grammar allows (chi-square); bad grammars are refused
by name, in generate.py and in serve.py."""
import json
import math
from collections import Counter

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output's grammar engine: pip install llguidance")
jsonschema = pytest.importorskip("jsonschema", reason="validates the replies: pip install jsonschema")

import generate  # noqa: E402
import decode  # noqa: E402
from decode import TreeConfig, prefill, speculative_cycle  # noqa: E402
from sampling import SamplingConfig, logits_to_probs  # noqa: E402
from graphs import compile_step  # noqa: E402
from load import load_draft, load_target  # noqa: E402
from conftest import ROOT, expect_error  # noqa: E402
from grammar import Constraint, grammar_of, response_format_grammar  # noqa: E402
from model import EagletError  # noqa: E402
from test_sampling import chi_square_p_below  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

DEMO = ROOT / "demo"
GREEDY = SamplingConfig()
PROMPTS = ["def read_lines(path):\n", "class Stack:\n    def push(self, item):"]
SCHEMAS = [  # nested objects, arrays, enums, numbers, required fields (numbers
    # bounded: the demo's code model, left free inside a number, repeats a digit to the end of its budget)
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": -99,
                                                                                          "maximum": 999}},
     "required": ["name", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["file", "dir", "link"]}, "size": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 4096}},
     "required": ["kind", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"owner": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999}, "admin": {"type": "boolean"}},
        "required": ["id", "admin"], "additionalProperties": False}}, "required": ["owner"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def demo():
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 512)
    tokenizer = Tokenizer(DEMO / "target")
    heads = {name: load_draft(DEMO / name / "draft.pth", target) for name in ("head", "head3", "dflash", "dspark")}
    target.set_feature_layers(heads["head"].feature_layers)
    return target, tokenizer, heads


def run(target, tokenizer, prompt: str, grammar: str, sampling=GREEDY, head=None, tree=None, n=64, forced_min=1,
        **kwargs):
    if head is not None:
        target.set_feature_layers(head.feature_layers)
    constraint = Constraint(tokenizer, target.args.vocab_size, grammar, forced_min)
    result = decode.generate(target, tokenizer.encode(prompt), n, sampling, tokenizer.eos_ids, draft=head,
                             tree=tree, constraint=constraint, **kwargs)
    return result, constraint


@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_every_reply_is_valid_and_speculative_equals_plain(demo, schema):
    target, tokenizer, heads = demo
    grammar = grammar_of("json_schema", json.dumps(SCHEMAS[schema]))
    for prompt in PROMPTS:
        plain, plain_state = run(target, tokenizer, prompt, grammar)
        spec, spec_state = run(target, tokenizer, prompt, grammar, head=heads["head"], tree=TreeConfig(6, 10, 60))
        assert spec.tokens == plain.tokens
        assert plain_state.done() and spec_state.done() and plain_state.cuts > 0  # the grammar did steer it
        jsonschema.validate(json.loads(tokenizer.decode(spec.tokens)), SCHEMAS[schema])


def test_forced_tokens_taken_without_the_target_change_nothing(demo):
    """Runs the grammar forces (a schema's keys and punctuation) taken without the target: the same tokens as when
    every token is the target's pick, plain or speculative; fewer cycles. (Sampled, a forced token draws no random
    number, so seeded draws differ after one; the law is the same -- a point mass there -- and
    test_sampling_follows_the_restricted_distribution runs with forced runs on.)"""
    target, tokenizer, heads = demo
    grammar = grammar_of("json_schema", json.dumps(SCHEMAS[3]))
    for head in (None, heads["head"]):
        results = [run(target, tokenizer, PROMPTS[0], grammar, head=head, tree=TreeConfig(6, 10, 60), forced_min=forced_min)
                   for forced_min in (0, 1)]
        (whole, none), (fast, forced) = results
        assert fast.tokens == whole.tokens and forced.done()
        assert none.forced_tokens == 0 and forced.forced_tokens >= 6 and forced.forced_runs >= 2  # '{"owner":{"id":'...
        if head is not None:  # the forced tokens are not cycles' tokens: fewer cycles
            assert len(fast.accept_lengths) < len(whole.accept_lengths)
    with_logprobs, state = run(target, tokenizer, PROMPTS[0], grammar, SamplingConfig(logprobs=1))
    assert state.forced_tokens == 0 and len(with_logprobs.logprobs) == len(with_logprobs.tokens)  # each has its logits


def test_a_reply_ending_in_a_forced_run_says_which_tokens_the_cache_lacks(demo):
    """A regex whose end is forced: the reply's last tokens were taken without a forward, so the cache holds the
    prompt and the reply but those (result.uncached); a next turn that reuses the cache from there gets the tokens a
    fresh prefill gives (serve.py and the interactive chat reuse it so)."""
    target, tokenizer, heads = demo
    grammar = grammar_of("regex", "    return [a-z]{1,8} # the final answer to it all\n")
    result, state = run(target, tokenizer, PROMPTS[0], grammar, head=heads["head"], tree=TreeConfig(3, 4, 8))
    assert state.done() and result.uncached == len(state.last_run) + 1 > 2
    context = tokenizer.encode(PROMPTS[0]) + result.tokens + tokenizer.encode("\ndef", bos=False)
    reused = decode.generate(target, context, 12, GREEDY, start_pos=len(context) - len(tokenizer.encode("\ndef", bos=False))
                             - result.uncached)
    fresh = decode.generate(target, context, 12, GREEDY)
    assert reused.tokens == fresh.tokens


@pytest.mark.parametrize("head, tree", [("head3", TreeConfig(7, 10, 60)), ("dflash", TreeConfig(6, 1, 8)),
                                        ("dflash", TreeConfig(6, 4, 16)), ("dspark", TreeConfig(6, 1, 8)),
                                        ("dspark", TreeConfig(6, 4, 16))])
def test_every_head_kind_keeps_constrained_plain_tokens(demo, head, tree):
    target, tokenizer, heads = demo
    grammar = grammar_of("json_schema", json.dumps(SCHEMAS[0]))
    target.set_feature_layers(heads[head].feature_layers)
    plain, _ = run(target, tokenizer, PROMPTS[0], grammar)
    spec, _ = run(target, tokenizer, PROMPTS[0], grammar, head=heads[head], tree=tree)
    assert spec.tokens == plain.tokens and json.loads(tokenizer.decode(spec.tokens))["name"] is not None


def test_a_constrained_reply_counts_the_plain_steps_of_every_segment(demo):
    """Stepped aside under a grammar: the reply's plain_tokens are every segment's (what the step-aside gate did),
    so that tokens = cycles' + plain steps' + one pick a segment + the forced runs; they read 0 once."""
    from step_aside import StepAside
    target, tokenizer, heads = demo
    grammar = grammar_of("regex", r"[^\n]{10,200}\n(    [^\n]{5,200}\n){1,6}")  # free enough for cycles to run
    now, gate = [0.0], StepAside(retry_after=6, trial_cycles=2, probe_steps=3, share=math.inf)
    gate.clock = lambda: now.__setitem__(0, now[0] + (30.0 if gate.speculating else 1.0)) or now[0]  # cycles never pay
    plain, _ = run(target, tokenizer, PROMPTS[0], grammar, n=96)
    spec, _ = run(target, tokenizer, PROMPTS[0], grammar, head=heads["head"], tree=TreeConfig(6, 10, 60), n=96,
                  step_aside=gate)
    assert spec.tokens == plain.tokens
    assert spec.plain_tokens == gate.plain_tokens > 0 and spec.accept_lengths  # both ways ran
    assert sum(spec.accept_lengths) + spec.plain_tokens < len(spec.tokens)  # the rest: picks and forced runs


def test_regex_and_lark_grammars(demo):
    target, tokenizer, heads = demo
    for kind, text, check in [("regex", r"    return \[[a-z_]+( [a-z_]+)*\]\n", r"    return \[[a-z_]+( [a-z_]+)*\]\n"),
                              ("lark", 'start: "    with open(" NAME ") as f:\\n"\nNAME: /[a-z_]+/', None)]:
        grammar = grammar_of(kind, text)
        plain, _ = run(target, tokenizer, PROMPTS[0], grammar)
        spec, _ = run(target, tokenizer, PROMPTS[0], grammar, head=heads["head"], tree=TreeConfig(6, 10, 60))
        out = tokenizer.decode(spec.tokens)
        assert spec.tokens == plain.tokens
        assert out.startswith("    return [" if kind == "regex" else "    with open(") and out.endswith("\n")


def test_compiled_cycle_and_running_ahead_keep_the_tokens(demo, without_inductor):
    target, tokenizer, heads = demo
    grammar = grammar_of("json_schema", json.dumps(SCHEMAS[1]))
    target.set_feature_layers(heads["head"].feature_layers)
    plain, _ = run(target, tokenizer, PROMPTS[1], grammar)
    step = compile_step(speculative_cycle, "cpu")
    for ahead in (False, True):
        spec, _ = run(target, tokenizer, PROMPTS[1], grammar, head=heads["head"], tree=TreeConfig(6, 10, 60),
                      step_fn=step, run_ahead=ahead)
        assert spec.tokens == plain.tokens


def test_sampling_follows_the_restricted_distribution(demo):
    """The second token under a grammar that forces the first: its law is the target's (temperature 1) restricted to
    the tokens the grammar allows there and renormalised, whether the cycle's own draw was allowed or replaced."""
    target, tokenizer, heads = demo
    grammar = grammar_of("regex", r"    return (path|lines|line|f|data|result|[a-z])\n")
    prompt, sampling = tokenizer.encode(PROMPTS[0]), SamplingConfig(temperature=1.0)
    state = Constraint(tokenizer, target.args.vocab_size, grammar)
    forced = state.pick(torch.zeros(target.args.vocab_size), GREEDY)  # the one token allowed first ("    return")
    assert state.allowed("cpu").sum() == 1 and state.take([int(forced)]) == 1
    with torch.no_grad():
        target.setup_caches(1, 512)
        logits, _ = prefill(target, torch.tensor([prompt + [int(forced)]]), 0)
    probs = logits_to_probs(logits[0], sampling) * state.allowed("cpu")
    exact = {t: float(p) for t, p in enumerate(probs / probs.sum()) if p > 0}
    assert len(exact) > 3 and sum(p for p in logits_to_probs(logits[0], sampling)[list(exact)]) < 0.9  # it restricts
    counts = Counter()
    torch.manual_seed(0)
    for _ in range(300):
        result, _ = run(target, tokenizer, PROMPTS[0], grammar, sampling, head=heads["head"], tree=TreeConfig(3, 4, 8),
                        n=2)
        assert result.tokens[0] == int(forced)
        counts[result.tokens[1]] += 1
    assert not chi_square_p_below(counts, exact)


def test_bad_grammars_are_refused_by_name():
    for kind, value, message in [("json_schema", '{"type": "foo"}', "Invalid type: foo"),
                                 ("regex", "([", "unclosed character class"),
                                 ("lark", "start: foo", 'unknown name: "foo"')]:
        with pytest.raises(EagletError, match=f"the {kind} cannot be compiled: .*{message}"):
            grammar_of(kind, value)
    for response_format, message in [({"type": "json_schema"}, 'holding a "schema"'), ({"type": "xml"}, "'xml' is not"),
                                     ("json", 'an object with a "type"'),
                                     ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, '"name" must')]:
        with pytest.raises(EagletError, match=message):
            response_format_grammar(response_format)
    assert response_format_grammar({"type": "text"}) is None
    assert math.isfinite(len(response_format_grammar({"type": "json_object"})))


def test_an_object_that_names_its_properties_takes_no_other_keys_unless_it_says_so(demo):
    """A schema leaves additionalProperties unset: no key beyond its properties (nested objects, $defs and anyOf too),
    for response_format with or without a name; one that allows more (or names no properties) is honoured as written."""
    target, tokenizer, _ = demo
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/B"},
                                               "c": {"anyOf": [inner, {"type": "null"}]}}, "$defs": {"B": inner}}

    def accepts(grammar: str, text: str) -> bool:
        constraint = Constraint(tokenizer, target.args.vocab_size, grammar)
        return constraint.take(tokenizer.encode(text, bos=False)) == len(tokenizer.encode(text, bos=False))
    unnamed = response_format_grammar({"type": "json_schema", "json_schema": {"schema": schema}})
    for text in ('{"a":1,"z":2', '{"b":{"x":1,"y"', '{"c":{"x":1,"y"'):
        assert not accepts(unnamed, text), text
    assert accepts(unnamed, '{"a":1,"b":{"x":2},"c":null}')
    opened = grammar_of("json_schema", json.dumps({**schema, "additionalProperties": True}))
    assert accepts(opened, '{"a":1,"z":2') and not accepts(opened, '{"b":{"x":1,"y"')
    assert accepts(grammar_of("json_schema", json.dumps({"type": "object"})), '{"anything":1')


def test_generate_cli_constrains_and_refuses(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS[2]))
    out = tmp_path / "out.json"
    generate.main(["--json_schema", str(schema), "--max_new_tokens", "40", "--json_out", str(out)])
    reply = json.loads(out.read_text())["samples"][0]["text"]
    jsonschema.validate(json.loads(reply), SCHEMAS[2])
    (tmp_path / "bad.json").write_text("{bad")
    expect_error(["--json_schema", str(tmp_path / "bad.json")], "--json_schema")
    expect_error(["--json_schema", str(tmp_path / "missing.json")], "cannot read it")
    expect_error(["--regex", "(["], "the regex cannot be compiled")
    expect_error(["--regex", "a", "--prompt", "x", "--prompt", "y"], "constrains one reply")


def test_a_low_temperature_still_picks_an_allowed_token(demo):
    """At temperature 0.01 every allowed token's probability rounds to 0 when the target prefers a refused one:
    the pick must still be an allowed token (it was token 0 from all-NaN probabilities, and the reply looped)."""
    target, tokenizer, _ = demo
    grammar = grammar_of("regex", "    return x\n")
    state = Constraint(tokenizer, target.args.vocab_size, grammar)
    allowed = state.allowed("cpu")
    logits = torch.zeros(target.args.vocab_size)
    logits[~allowed] = 30.0  # the target prefers every refused token by far
    for _ in range(5):
        assert state.allows(int(state.pick(logits, SamplingConfig(temperature=0.01))))
    result, _ = run(target, tokenizer, PROMPTS[0], grammar, SamplingConfig(temperature=0.01), n=12)
    assert tokenizer.decode(result.tokens) == "    return x\n"
