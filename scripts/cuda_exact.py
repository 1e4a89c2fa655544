"""Exactness where it runs: the shipped demo decoded greedily in every way a user can run it on this device, each
output against plain eager decoding of the same target in the same precision, token for token.

The ways, in the order they are checked (most used first, so a cut budget drops the least used): plain compiled;
EAGLE-2 eager, compiled (CUDA graphs, running ahead as on CUDA by default), compiled without running ahead;
EAGLE-3, DFlash and DSpark (chain and tree) compiled; three prompts at once, plain and EAGLE-2; an int4 target, EAGLE-2
compiled against plain eager on the same int4 weights. Each in bf16 (CUDA's default) and fp32.

A difference is reported with its first position and whether it is a near-tie: the top-2 logit gap of plain
eager decoding there. In fp32 every way must agree; in bf16 compiled kernels round otherwise than eager ones, so
a flip at a gap of a few hundredths is rounding, and a flip at a wide gap is a bug.

    python scripts/gpu_check.py --exact --quick --skip_checks --out results   # as one section of the GPU check
    python scripts/cuda_exact.py --device cpu --out exact.json                  # alone
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import generate  # noqa: E402
from decode import SamplingConfig, TreeConfig, prefill  # noqa: E402
from model import Transformer  # noqa: E402
from quantize import quantize_state_dict  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
PROMPTS = ["def read_lines(path):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef main():\n"]
HEADS = {"EAGLE-2": "head", "EAGLE-3": "head3", "DFlash": "dflash", "DSpark": "dspark"}
TREES = {"EAGLE-2": TreeConfig(6, 10, 60), "EAGLE-3": TreeConfig(7, 10, 60), "DFlash chain 8": TreeConfig(6, 1, 8),
         "DFlash tree 16": TreeConfig(6, 4, 16), "DSpark chain 8": TreeConfig(6, 1, 8),
         "DSpark tree 16": TreeConfig(6, 4, 16)}
# name: (head, tree, compiled, run_ahead (None: the device's default), prompts at once)
WAYS = {"plain, compiled": (None, None, True, None, 1),
        "EAGLE-2, eager": ("EAGLE-2", "EAGLE-2", False, None, 1),
        "EAGLE-2, compiled": ("EAGLE-2", "EAGLE-2", True, None, 1),
        "EAGLE-2, compiled, no running ahead": ("EAGLE-2", "EAGLE-2", True, False, 1),
        "EAGLE-3, compiled": ("EAGLE-3", "EAGLE-3", True, None, 1),
        "DFlash chain 8, compiled": ("DFlash", "DFlash chain 8", True, None, 1),
        "DFlash tree 16, compiled": ("DFlash", "DFlash tree 16", True, None, 1),
        "DSpark chain 8, compiled": ("DSpark", "DSpark chain 8", True, None, 1),
        "DSpark tree 16, compiled": ("DSpark", "DSpark tree 16", True, None, 1),
        "plain, 3 prompts at once, compiled": (None, None, True, None, 3),
        "EAGLE-2, 3 prompts at once, compiled": ("EAGLE-2", "EAGLE-2", True, None, 3)}
# (target, way) in the order they are checked: what users run most first, so a cut budget drops the least used.
# Targets: the demo in bf16 or fp32, or its int4 g128 weights with bf16 activations (CUDA's int4 kernel takes bf16).
PLAN = [("bf16", "plain, compiled"), ("bf16", "EAGLE-2, eager"), ("bf16", "EAGLE-2, compiled"),
        ("bf16", "EAGLE-2, compiled, no running ahead"), ("fp32", "EAGLE-2, compiled"),
        ("bf16", "EAGLE-3, compiled"), ("bf16", "DFlash chain 8, compiled"), ("bf16", "DFlash tree 16, compiled"),
        ("bf16", "DSpark chain 8, compiled"), ("bf16", "DSpark tree 16, compiled"),
        ("bf16", "EAGLE-2, 3 prompts at once, compiled"), ("int4", "EAGLE-2, compiled"),
        ("fp32", "DFlash tree 16, compiled"), ("fp32", "EAGLE-3, compiled"), ("bf16", "plain, 3 prompts at once, compiled"),
        ("fp32", "plain, compiled"), ("fp32", "DFlash chain 8, compiled"), ("fp32", "EAGLE-2, 3 prompts at once, compiled"),
        ("int4", "plain, compiled"), ("fp32", "DSpark chain 8, compiled"), ("fp32", "DSpark tree 16, compiled")]
GREEDY = SamplingConfig()
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


class Engine:
    """One target, its heads, and plain eager decoding's tokens for each prompt (the reference)."""

    def __init__(self, target: Transformer, device: str, prompts: list, n_tokens: int):
        self.target, self.device = target, device
        self.heads, self.rows = {}, 0
        self.set_rows(1)
        self.expected = [self.run([p], n_tokens)[0][0] for p in prompts]

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
            self.heads[name] = generate.load_draft(DEMO_DIR / HEADS[name] / "draft.pth", self.target, "full")
            self.heads[name].setup_caches(CACHE, self.rows)
        self.target.set_feature_layers(self.heads[name].feature_layers)
        return self.heads[name]

    def run(self, prompts: list, n_tokens: int, head=None, tree=None, compiled=False, run_ahead=None) -> list:
        """(tokens, accepted lengths) of each prompt."""
        self.set_rows(len(prompts))
        draft, tree_config = self.head(head), TREES[tree] if tree else None
        step = compiled_step((id(self), head, tree, len(prompts)), head is None, self.device) if compiled else None
        if len(prompts) > 1:
            results = generate.generate_batch(self.target, prompts, n_tokens, GREEDY, draft=draft, tree=tree_config,
                                              step_fn=step)
        else:
            results = [generate.generate(self.target, prompts[0], n_tokens, GREEDY, draft=draft, tree=tree_config,
                                         step_fn=step, run_ahead=run_ahead)]
        return [(r.tokens, r.accept_lengths) for r in results]


_compiled = {}


def compiled_step(key, plain: bool, device: str):
    """The compiled step or cycle for key (target, head, tree, rows), compiled afresh when the key changes: one
    graph per function at a time, so never a recompile limit and never a graph of another target replayed."""
    if key not in _compiled:
        torch._dynamo.reset()
        _compiled.clear()
        _compiled[key] = generate.compile_step(generate.decode_one_token if plain else generate.speculative_cycle,
                                               device)
    return _compiled[key]


def check_way(engine: Engine, way: str, prompts: list, n_tokens: int) -> dict:
    """One way against the engine's plain eager tokens: same or not (and where, how close a tie), tau, seconds."""
    head, tree, compiled, run_ahead, n_prompts = WAYS[way]
    t0 = time.perf_counter()
    try:
        outputs = engine.run(prompts[:n_prompts], n_tokens, head, tree, compiled, run_ahead)
        row = {"same_tokens": True}
        for i, (tokens, _) in enumerate(outputs):
            pos = first_difference(engine.expected[i], tokens)
            if pos is not None:
                row["same_tokens"] = False
                row[f"prompt {i}"] = near_tie(engine.target, prompts[i], engine.expected[i], tokens, pos)
        accepted = [a for _, lengths in outputs for a in lengths]
        if accepted:
            row["tau"] = round(sum(accepted) / len(accepted), 3)
    except Exception as e:  # the next way may still run
        row = {"error": f"{type(e).__name__}: {e}"[:2000]}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def make_engine(name: str, device: str, prompts: list, n_tokens: int) -> Engine:
    """The demo target as PLAN names it: bf16, fp32, or int4 (g128 weights, bf16 activations)."""
    target = generate.load_target(DEMO_DIR / "target", device, "fp32" if name == "fp32" else "bf16")
    if name == "int4":
        weight = target.tok_embeddings.weight
        target = Transformer.from_state_dict(target.args, quantize_state_dict(target.state_dict(), "int4", 128),
                                             weight.device, weight.dtype, "the int4 weights")
    return Engine(target, device, prompts, n_tokens)


def check_all(device: str, plan=PLAN, n_tokens: int = 96, budget_s: float = 300, save=lambda rows: None) -> dict:
    """Each (target, way) of plan in order while budget_s lasts; save(rows) after each (a crash keeps them)."""
    deadline = time.perf_counter() + budget_s
    tokenizer = Tokenizer(DEMO_DIR / "target")
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    rows, engines = {"tokens_per_prompt": n_tokens, "prompts": len(prompts), "ways": {}}, {}
    for name, way in plan:
        key = f"{name}: {way}"
        if time.perf_counter() > deadline:
            rows["ways"][key] = {"skipped": "time budget spent"}
            continue
        if name not in engines:
            engines[name] = make_engine(name, device, prompts, n_tokens)
        rows["ways"][key] = check_way(engines[name], way, prompts, n_tokens)
        print(f"  {key}: {rows['ways'][key]}", flush=True)
        save(rows)
    ways = rows["ways"].values()
    rows["differ_or_failed"] = [k for k, row in rows["ways"].items() if row.get("same_tokens") is False or "error" in row]
    rows["all_checked_and_same"] = not rows["differ_or_failed"] and not any("skipped" in row for row in ways)
    save(rows)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tokens", type=int, default=96, help="greedy tokens a prompt")
    p.add_argument("--budget_s", type=float, default=300, help="start no way after this many seconds")
    p.add_argument("--out", type=Path, required=True, help="a new JSON file for the results")
    args = p.parse_args(argv)
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; give a new file")
    device = generate.pick_device(args.device)
    rows = check_all(device, PLAN, args.tokens, args.budget_s,
                     lambda r: args.out.write_text(json.dumps(r, indent=1)))
    print(json.dumps(rows, indent=1))
    sys.exit(0 if rows["all_checked_and_same"] else 1)


if __name__ == "__main__":
    main()
