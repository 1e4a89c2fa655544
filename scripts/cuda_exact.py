"""Exactness where it runs: the shipped demo decoded greedily in every way a user can run it on this device, each
output against plain eager decoding of the same target in the same precision, token for token.

The ways, in the order they are checked (PLAN: a cut budget drops the last): plain compiled; then what is new since
the last GPU run -- in bf16 first what no CPU can check (plain and EAGLE-2 as CUDA graphs captured by hand,
EAGLET_GRAPHS=manual's CapturedGraphs; the demo's DFlash2 head and random P-EAGLE and XPress heads, bench.py's, of the
published shapes on the demo's width: they accept next to nothing, yet their tokens must be plain's, as chains), then
EAGLE-2 compiled alone, under a JSON schema (against plain eager under the same schema), with logprobs (each against
one causal forward over the prompt and the reply), with the prompt prefilled in chunks of 4, with a draft window of
16; the same in fp32; then the new heads' trees and the rest; then what the last GPU run checked: EAGLE-2 eager and
without running ahead, EAGLE-3, DFlash and DSpark (chain and tree), three prompts at once, an int4 target (EAGLE-2
compiled against plain eager on the same int4 weights).

A difference is reported with its first position and whether it is a near-tie: the top-2 logit gap of plain
eager decoding there. In fp32 every way must agree; in bf16 compiled kernels round otherwise than eager ones, so
a flip at a gap of a few hundredths is rounding, and a flip at a wide gap is a bug. Logprobs are reported as their
largest difference from the causal forward's (in nats); past LOGPROB_TOLERANCE the way fails.

    python scripts/gpu_check.py --exact --quick --skip_checks --out results   # as one section of the GPU check
    python scripts/cuda_exact.py --device cpu --out exact.json                  # alone
"""
import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import measure  # noqa: E402
from batch import generate_batch  # noqa: E402
from decode import TreeConfig, decode_one_token, generate, prefill, speculative_cycle  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from graphs import compile_step  # noqa: E402
from load import load_draft, load_draft_model, load_target, pick_device  # noqa: E402
from lookup import NgramLookup, lookup_cycle  # noqa: E402
import graphs  # noqa: E402
from attention import causal_mask  # noqa: E402
from model import Transformer  # noqa: E402
from quantize import quantize_state_dict  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
PROMPTS = ["def read_lines(path):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef main():\n"]
# the demo's heads by folder; "random KIND": measure.random_head's head of that kind on the demo target (seed 0)
HEADS = {"EAGLE-2": "head", "EAGLE-3": "head3", "DFlash": "dflash", "DSpark": "dspark", "DFlash2": "dflash2",
         "P-EAGLE": "random peagle", "XPress": "random xpress"}
CHAIN, TREE16 = TreeConfig(6, 1, 8), TreeConfig(6, 4, 16)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                               "maximum": 999}, "maxItems": 4}},
          "required": ["name", "sizes"], "additionalProperties": False}
LOGPROB_TOLERANCE = {"fp32": 1e-3, "bf16": 0.5, "int4": 0.5}  # nats; bf16 logits near 16 are 0.125 apart


@dataclass(frozen=True)
class Way:
    head: Optional[str] = None  # a HEADS name; None: plain decoding
    tree: Optional[TreeConfig] = None
    compiled: bool = True
    run_ahead: Optional[bool] = None  # None: the device's default
    prompts: int = 1  # decoded at once (generate_batch)
    captured: bool = False  # CapturedGraphs (CUDA only) instead of torch.compile's CUDA-graph trees
    schema: bool = False  # under SCHEMA, against plain eager under it
    logprobs: bool = False  # each token's logprob and top 5, against one causal forward
    chunk: Optional[int] = None  # the prompt prefilled this many tokens a forward
    window: Optional[int] = None  # the head's draft window (4 sinks)
    penalized: bool = False  # under PENALIZED (penalties and a logit bias), against plain eager under it
    lookup: bool = False  # n-gram lookup (no head), its verify compiled


EAGLE2 = TreeConfig(6, 10, 60)
WAYS = {"plain, compiled": Way(),
        "EAGLE-2, eager": Way("EAGLE-2", EAGLE2, compiled=False),
        "EAGLE-2, compiled": Way("EAGLE-2", EAGLE2),
        "EAGLE-2, compiled, no running ahead": Way("EAGLE-2", EAGLE2, run_ahead=False),
        "plain, captured graphs": Way(captured=True),
        "EAGLE-2, captured graphs": Way("EAGLE-2", EAGLE2, captured=True),
        "EAGLE-2, compiled, a JSON schema": Way("EAGLE-2", EAGLE2, schema=True),
        "DFlash tree 16, compiled, a JSON schema": Way("DFlash", TREE16, schema=True),
        "plain, compiled, logprobs": Way(logprobs=True),
        "EAGLE-2, compiled, logprobs": Way("EAGLE-2", EAGLE2, logprobs=True),
        "plain, compiled, prefill chunks of 4": Way(chunk=4),
        "EAGLE-2, compiled, prefill chunks of 4": Way("EAGLE-2", EAGLE2, chunk=4),
        "EAGLE-2, compiled, draft window 16": Way("EAGLE-2", EAGLE2, window=16),
        "DFlash tree 16, compiled, draft window 16": Way("DFlash", TREE16, window=16),
        "EAGLE-3, compiled": Way("EAGLE-3", TreeConfig(7, 10, 60)),
        "plain, 3 prompts at once, compiled": Way(prompts=3),
        "EAGLE-2, 3 prompts at once, compiled": Way("EAGLE-2", EAGLE2, prompts=3),
        "plain, captured graphs, penalties": Way(captured=True, penalized=True),
        "EAGLE-2, captured graphs, penalties": Way("EAGLE-2", EAGLE2, captured=True, penalized=True),
        "EAGLE-2, compiled, penalties": Way("EAGLE-2", EAGLE2, penalized=True),
        "n-gram lookup, compiled": Way(lookup=True),
        "draft model (the target itself) chain 5, compiled": Way("draft model", TreeConfig(4, 1, 6))}
for _head in ("DFlash", "DSpark", "DFlash2", "P-EAGLE", "XPress"):
    WAYS[f"{_head} chain 8, compiled"] = Way(_head, CHAIN)
    WAYS[f"{_head} tree 16, compiled"] = Way(_head, TREE16)
# What is new since the last GPU run, in three groups: the ways that share EAGLE-2's compiled cycle (one compile for the
# five), what no CPU can check (CapturedGraphs, the new heads' CUDA kernels), the rest.
NEW_EAGLE2 = ["EAGLE-2, compiled", "EAGLE-2, compiled, a JSON schema", "EAGLE-2, compiled, logprobs",
              "EAGLE-2, compiled, prefill chunks of 4", "EAGLE-2, compiled, draft window 16"]
NEW_FIRST = ["XPress chain 8, compiled", "EAGLE-2, captured graphs, penalties", "plain, captured graphs, penalties",
             "EAGLE-2, compiled, penalties", "n-gram lookup, compiled", "draft model (the target itself) chain 5, compiled"]
# checked in bf16 on an H200 in GPU round 6 (2026-11-28): after the ways no GPU has checked yet
ROUND6 = ["plain, captured graphs", "EAGLE-2, captured graphs", "DFlash2 chain 8, compiled", "P-EAGLE chain 8, compiled"]
NEW_LATER = ["DFlash2 tree 16, compiled", "P-EAGLE tree 16, compiled", "XPress tree 16, compiled",
             "plain, compiled, logprobs", "plain, compiled, prefill chunks of 4", "DFlash tree 16, compiled, a JSON schema",
             "DFlash tree 16, compiled, draft window 16"]
# (target, way) in the order they are checked: the new ways (in bf16 what no CPU can check first: CapturedGraphs, the
# new heads' CUDA kernels), then what the last GPU run checked. Targets: the demo in bf16 or fp32, or its int4 g128
# weights with bf16 activations (CUDA's int4 kernel takes bf16).
PLAN = ([("bf16", way) for way in NEW_FIRST + NEW_EAGLE2] + [("fp32", way) for way in NEW_EAGLE2 + NEW_FIRST + ROUND6]
        + [(t, way) for t in ("bf16", "fp32") for way in NEW_LATER] + [("bf16", way) for way in ["plain, compiled"] + ROUND6]
        + [("bf16", "EAGLE-2, eager"), ("bf16", "EAGLE-2, compiled, no running ahead"), ("bf16", "EAGLE-3, compiled"),
           ("bf16", "DFlash chain 8, compiled"), ("bf16", "DFlash tree 16, compiled"), ("bf16", "DSpark chain 8, compiled"),
           ("bf16", "DSpark tree 16, compiled"), ("bf16", "EAGLE-2, 3 prompts at once, compiled"),
           ("int4", "EAGLE-2, compiled"), ("fp32", "DFlash tree 16, compiled"), ("fp32", "EAGLE-3, compiled"),
           ("bf16", "plain, 3 prompts at once, compiled"), ("fp32", "plain, compiled"),
           ("fp32", "DFlash chain 8, compiled"), ("fp32", "EAGLE-2, 3 prompts at once, compiled"),
           ("int4", "plain, compiled"), ("fp32", "DSpark chain 8, compiled"), ("fp32", "DSpark tree 16, compiled")])
GREEDY = SamplingConfig()
PENALIZED = SamplingConfig(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={13: 2.0})
CACHE = 512


def first_difference(a: list, b: list):
    """The first index where two token lists differ (a length counts), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@torch.no_grad()
def near_tie(target: Transformer, prompt: list, expected: list, got: list, pos: int) -> dict:
    """Plain eager logits where the outputs part: the top-2 gap, and the two tokens' logits."""
    tokens = torch.tensor([prompt + expected[:pos]], device=target.output.weight.device)
    logits = prefill(target, tokens, 0)[0][0].float()
    top = logits.topk(2).values
    row = {"position": pos, "top2_gap": round(float(top[0] - top[1]), 4)}
    for name, seq in (("expected", expected), ("got", got)):
        if pos < len(seq):
            row[f"{name}_token"], row[f"{name}_logit"] = seq[pos], round(float(logits[seq[pos]]), 4)
    return row


@torch.no_grad()
def logprob_difference(target: Transformer, result) -> float:
    """The largest difference, in nats, between a result's logprobs (the chosen token's and the top 5's) and what
    one causal forward over its prompt and tokens gives at the same positions (no tree, no cache reuse)."""
    tokens = result.prompt_tokens + result.tokens
    pos = torch.arange(len(tokens), device=target.output.weight.device)
    logits, _ = target(torch.tensor([tokens], device=pos.device), pos, pos, causal_mask(pos, len(tokens)))
    logp = torch.log_softmax(logits[0].float(), dim=-1)[len(result.prompt_tokens) - 1:]
    if len(result.logprobs) != len(result.tokens):
        return float("inf")
    diffs = [abs(chosen - float(logp[i, token])) for i, (token, (chosen, _)) in enumerate(zip(result.tokens, result.logprobs))]
    diffs += [abs(p - float(logp[i, t])) for i, (_, top) in enumerate(result.logprobs) for t, p in top]
    return max(diffs, default=0.0)


class Engine:
    """One target, its heads, and plain eager decoding's tokens for each prompt (the references: free, and under
    SCHEMA once a way asks for it)."""

    def __init__(self, name: str, target: Transformer, device: str, prompts: list, n_tokens: int):
        self.name, self.target, self.device, self.prompts, self.n_tokens = name, target, device, prompts, n_tokens
        self.tokenizer = Tokenizer(DEMO_DIR / "target")
        self.heads, self.rows, self.expected = {}, 0, {}
        self.set_rows(1)

    def reference(self, schema: bool, n_prompts: int, penalized: bool = False) -> list:
        """Plain eager decoding's tokens for the first n_prompts prompts, free, under SCHEMA or PENALIZED (each
        decoded once)."""
        for i in range(n_prompts):
            if (schema, penalized, i) not in self.expected:
                self.expected[schema, penalized, i] = self.run(
                    [self.prompts[i]], Way(compiled=False, schema=schema, penalized=penalized))[0].tokens
        return [self.expected[schema, penalized, i] for i in range(n_prompts)]

    def set_rows(self, rows: int):
        if rows != self.rows:
            self.rows = rows
            self.target.setup_caches(rows, CACHE)
            for head in self.heads.values():
                head.setup_caches(CACHE, rows)

    def head(self, name):
        if name is None:
            return None
        if name not in self.heads:
            where = HEADS.get(name, "")
            if name == "draft model":
                self.heads[name] = load_draft_model(DEMO_DIR / "target", self.target)
            elif where.startswith("random "):
                torch.manual_seed(0)
                weight = self.target.tok_embeddings.weight
                self.heads[name] = measure.random_head(where.split()[1], self.target, weight.device, weight.dtype)
            else:
                self.heads[name] = load_draft(DEMO_DIR / where / "draft.pth", self.target, "full")
            self.heads[name].setup_caches(CACHE, self.rows)
        self.target.set_feature_layers(self.heads[name].feature_layers)
        return self.heads[name]

    def constraint(self):
        from grammar import Constraint, grammar_of  # llguidance: only the schema ways need it
        return Constraint(self.tokenizer, self.target.args.vocab_size, grammar_of("json_schema", json.dumps(SCHEMA)))

    def run(self, prompts: list, way: Way) -> list:
        """Each prompt's GenerationResult, decoded the way way says."""
        self.set_rows(len(prompts))
        draft = self.head(way.head)
        kind = "lookup" if way.lookup else "plain" if way.head is None else "cycle"
        step = compiled_step((id(self), way.head, repr(way.tree), len(prompts), way.captured, kind), kind,
                             self.device, way.captured) if way.compiled else None
        sampling = SamplingConfig(logprobs=5) if way.logprobs else PENALIZED if way.penalized else GREEDY
        if way.lookup:
            return [generate(self.target, prompts[0], self.n_tokens, sampling, lookup=NgramLookup(), step_fn=step)]
        if len(prompts) > 1:
            return generate_batch(self.target, prompts, self.n_tokens, sampling, draft=draft, tree=way.tree,
                                  step_fn=step)
        window = draft.window if draft is not None else None
        if way.window:
            draft.set_window(way.window)
        try:
            return [generate(self.target, prompts[0], self.n_tokens, sampling, draft=draft, tree=way.tree,
                             step_fn=step, run_ahead=way.run_ahead, prefill_chunk=way.chunk,
                             constraint=self.constraint() if way.schema else None)]
        finally:
            if way.window:
                draft.window = window


_compiled = {}


def compiled_step(key, kind: str, device: str, captured: bool = False):
    """The compiled step or cycle for key (target, head, tree, rows, captured), compiled afresh when the key changes:
    one graph per function at a time, so never a recompile limit and never a graph of another target replayed.
    captured: replayed as CUDA graphs captured by hand (what EAGLET_GRAPHS=manual picks)."""
    if key not in _compiled:
        torch._dynamo.reset()
        _compiled.clear()
        step_fn = {"plain": decode_one_token, "cycle": speculative_cycle, "lookup": lookup_cycle}[kind]
        _compiled[key] = (graphs.CapturedGraphs(torch.compile(step_fn, fullgraph=True)) if captured
                          else compile_step(step_fn, device))
    return _compiled[key]


def check_way(engine: Engine, way_name: str) -> dict:
    """One way against the engine's plain eager tokens: same or not (and where, how close a tie), tau, seconds."""
    way = WAYS[way_name]
    if way.captured and not engine.device.startswith("cuda"):
        return {"skipped": "CUDA graphs need CUDA"}
    try:
        prompts = engine.prompts[:way.prompts]
        expected = engine.reference(way.schema, way.prompts, way.penalized)  # before the clock: the way's own seconds
        t0 = time.perf_counter()
        results = engine.run(prompts, way)
        seconds = time.perf_counter() - t0
        row = {"same_tokens": True}
        for i, result in enumerate(results):
            pos = first_difference(expected[i], result.tokens)
            if pos is not None:
                row["same_tokens"] = False
                row[f"prompt {i}"] = near_tie(engine.target, prompts[i], expected[i], result.tokens, pos)
                if way.schema:  # where the schema left a choice, the pick was among the tokens it allowed
                    row[f"prompt {i}"]["top2_gap_of"] = "the logits before the schema's mask"
        if way.logprobs:
            row["logprob_max_diff"] = round(max(logprob_difference(engine.target, r) for r in results), 5)
            row["logprobs_close"] = row["logprob_max_diff"] <= LOGPROB_TOLERANCE[engine.name]
        accepted = [a for r in results for a in r.accept_lengths]
        if accepted:
            row["tau"], row["cycles"] = round(sum(accepted) / len(accepted), 3), len(accepted)
        row["seconds"] = round(seconds, 1)
    except Exception as e:  # the next way may still run
        row = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return row


def make_engine(name: str, device: str, prompts: list, n_tokens: int) -> Engine:
    """The demo target as PLAN names it: bf16, fp32, or int4 (g128 weights, bf16 activations)."""
    target = load_target(DEMO_DIR / "target", device, "fp32" if name == "fp32" else "bf16")
    if name == "int4":
        weight = target.tok_embeddings.weight
        target = Transformer.from_state_dict(target.args, quantize_state_dict(target.state_dict(), "int4", 128),
                                             weight.device, weight.dtype, "the int4 weights")
    return Engine(name, target, device, prompts, n_tokens)


def check_all(device: str, plan=PLAN, n_tokens: int = 96, budget_s: float = 300, save=lambda rows: None) -> dict:
    """Each (target, way) of plan in order while budget_s lasts (a way that would end after it, at the pace of the
    longest way so far, is skipped: a caller's time limit would cut it with nothing kept); save(rows) after each (a
    crash keeps them)."""
    deadline, longest = time.perf_counter() + budget_s, 0.0
    tokenizer = Tokenizer(DEMO_DIR / "target")
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    rows, engines = {"tokens_per_prompt": n_tokens, "prompts": len(prompts), "ways": {}}, {}
    for name, way in plan:
        key = f"{name}: {way}"
        if time.perf_counter() + longest > deadline:
            rows["ways"][key] = {"skipped": "time budget spent"}
            continue
        t0 = time.perf_counter()
        if name not in engines:
            engines[name] = make_engine(name, device, prompts, n_tokens)
        rows["ways"][key] = check_way(engines[name], way)
        longest = max(longest, time.perf_counter() - t0)
        print(f"  {key}: {rows['ways'][key]}", flush=True)
        save(rows)
    ways = rows["ways"].values()
    rows["differ_or_failed"] = [k for k, row in rows["ways"].items()
                                if row.get("same_tokens") is False or row.get("logprobs_close") is False or "error" in row]
    rows["all_checked_and_same"] = not rows["differ_or_failed"] and not any("skipped" in row for row in ways)
    save(rows)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tokens", type=int, default=96, help="greedy tokens a prompt")
    p.add_argument("--budget_s", type=float, default=300, help="seconds; a way that would end later is skipped")
    p.add_argument("--out", type=Path, required=True, help="a new JSON file for the results")
    args = p.parse_args(argv)
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; give a new file")
    device = pick_device(args.device)
    rows = check_all(device, PLAN, args.tokens, args.budget_s,
                     lambda r: args.out.write_text(json.dumps(r, indent=1)))
    print(json.dumps(rows, indent=1))
    sys.exit(1 if rows["differ_or_failed"] else 0)  # ways skipped (budget, CUDA only) are in the JSON, not a failure


if __name__ == "__main__":
    main()
