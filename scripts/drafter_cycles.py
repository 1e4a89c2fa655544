"""Every drafter's cycle on one target of a named shape (random weights, bf16 on CUDA), compiled, whole (a cycle
phase by phase compiles five graphs: a minute or more each on the 8B shape): a chain of the whole block for each
block drafter of the published shapes (P-EAGLE, DFlash2, XPress, DFlash: bench.py's random heads), EAGLE-2's 60/6/10
tree, then 32-token trees from one pass of the newer ones -- each beside the plain step (its time in plain
steps) and its bytes floor. One target, one process: the rows compare like with like. Random heads accept next to
nothing: what is measured is what a cycle costs, not what it emits. A row is written to OUT/cycles.md and
OUT/cycles.json as soon as it is measured; a row that would end after --budget_s (counted from the start, at the pace
of the longest row so far) is skipped and says so. The plain step comes after the rows (the GPU has measured it before:
BENCHMARKS.md), where the budget leaves room; each row's plain steps are then filled in.

    python scripts/drafter_cycles.py --out $OUT/cycles                                        # the 8B shape
    python scripts/drafter_cycles.py --out /tmp/cycles --shape tiny --device cpu --repeats 2   # a CPU dry run
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli import cli_parser, int_flag  # noqa: E402

# name: (measure.random_head's kind, the tree: None for a chain of the head's whole block, else (topk, total tokens)), the
# newer drafters first (a row starting late in the budget is cut). The EAGLE-2 head drafts over the whole vocabulary.
ROWS = {"P-EAGLE chain": ("peagle", None), "DFlash2 chain": ("dflash2", None), "XPress chain": ("xpress", None),
        "DFlash chain": ("dflash", None), "EAGLE-2 60/6/10 whole vocabulary": ("eagle", (10, 60)),
        "P-EAGLE tree 32": ("peagle", (4, 32)), "DFlash2 tree 32": ("dflash2", (4, 32)), "XPress tree 32": ("xpress", (4, 32))}


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--out", type=Path, required=True, help="a new folder for cycles.md and cycles.json")
    p.add_argument("--shape", default="llama3-8b", help="a bench.py shape (llama3-8b, llama2-7b, ... tiny)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--repeats", type=int_flag(1), default=10, help="back-to-back cycles timed per row")
    p.add_argument("--budget_s", type=int_flag(1), default=300, help="seconds from the start; a row that would end later is skipped")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated, from: " + ", ".join(ROWS))
    p.add_argument("--commit", default=None, help="the commit that runs (default: git's; a copy without history has none)")
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown or not args.rows:
        p.error(f"unknown --rows {unknown}; known: {list(ROWS)}")
    if args.out.exists():
        p.error(f"--out {args.out} exists: give a new folder")
    return args


def table(results: dict) -> str:
    setup, plain = results["setup"], results.get("plain")
    plain_ms = plain["step_ms"] if plain else None
    lines = [f"# Drafter cycles: {setup['shape']}, {setup['device']}, {setup['precision']} ({setup['date']}, commit "
             f"{setup['commit']})", "", f"Command: `{setup['command']}`; plain step "
             f"{f'{plain_ms:.3f} ms' if plain else plain_unmeasured(results)}; compiled, {setup['repeats']} cycles a row, "
             "random heads (tau means nothing)", "",
             "| row | verified tokens | draft passes | cycle (ms) | plain steps | floor (ms) | cycle / floor |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    if plain:
        lines.append(f"| plain step | 1 | - | {plain_ms:.3f} | 1.00 | - | {plain['fraction_of_copy_bandwidth']:.0%} of the "
                     "copy bandwidth |")
    for name, row in results["rows"].items():
        if "error" in row or "skipped" in row:
            lines.append(f"| {name} | {row.get('skipped') or 'error: ' + row['error'][:200]} |")
            continue
        ms = row["phases"]["whole cycle"]["ms"]
        steps = f"{ms / plain_ms:.2f}" if plain else "-"
        lines.append(f"| {name} | {row['tree'][2]} | {row['draft_passes']} | {ms:.3f} | {steps} | {row['floor_ms']:.3f} "
                     f"| {row['measured_over_floor']:.2f} |")
    return "\n".join(lines) + "\n"


def plain_unmeasured(results: dict) -> str:
    return "not measured" + (f" ({results['plain_skipped']})" if "plain_skipped" in results else " yet: after the rows")


def main(argv=None):
    start = time.perf_counter()  # --budget_s counts from here: making the target's weights is part of it
    args = parse_args(argv)
    import torch
    import measure
    from decode import TreeConfig
    from load import PRECISIONS, pick_device
    args.out.mkdir(parents=True)
    device = pick_device(args.device)
    dtype = PRECISIONS["bf16" if device == "cuda" else "fp32"]
    torch.manual_seed(0)
    target, _ = measure.random_models(args.shape, device, dtype, 2048)
    copy_bw = measure.copy_bandwidth(device)
    results = {"setup": {"shape": args.shape, "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
                         "precision": str(dtype), "commit": args.commit or measure.git_commit(), "date": time.strftime("%Y-%m-%d"),
                         "command": "python scripts/drafter_cycles.py " + " ".join(sys.argv[1:] if argv is None else argv),
                         "copy_GB_per_s": copy_bw / 1e9, "repeats": args.repeats},
               "rows": {}}

    def write():
        (args.out / "cycles.md").write_text(table(results))
        (args.out / "cycles.json").write_text(json.dumps(results, indent=1))

    def over_budget(longest: float) -> str:  # why a unit is not started ("" if it fits)
        elapsed = time.perf_counter() - start
        return f"{elapsed:.0f} s of {args.budget_s} spent; the longest row took {longest:.0f} s" \
            if elapsed + longest > args.budget_s else ""
    heads, longest = {}, 0.0
    for name in args.rows:  # the rows first, the plain step (compiled, captured) after: round 6 measured it already
        if over_budget(longest):
            results["rows"][name] = {"skipped": over_budget(longest)}
            write()
            continue
        t0 = time.perf_counter()
        kind, shape = ROWS[name]
        try:
            # each row compiled afresh: dynamo would otherwise make later rows' sizes symbolic (not the graphs a run
            # uses) and stop at its recompile limit
            torch._dynamo.reset()
            if kind not in heads:
                heads.clear()  # one random head at a time on the device
                heads[kind] = measure.random_head(kind, target, device, dtype)
                heads[kind].setup_caches(2048)
            draft = heads[kind]
            target.set_feature_layers(draft.feature_layers)
            depth = 6 if kind == "eagle" else draft.default_depth
            tree = TreeConfig(depth, *shape) if shape else TreeConfig(depth, 1, depth + 2)
            cycle = measure.bench_cycle(target, draft, tree, True, args.repeats, None, copy_bw, phases=False)
            results["rows"][name] = {"tree": [tree.depth, tree.topk, tree.total_tokens], **cycle}
        except Exception as e:  # the next row may still run
            results["rows"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        longest = max(longest, time.perf_counter() - t0)
        write()
        print(table(results).splitlines()[-1], flush=True)
    heads.clear()
    if over_budget(longest):
        results["plain_skipped"] = over_budget(longest)
    else:
        torch._dynamo.reset()
        try:
            results["plain"] = measure.bench_plain(target, True, copy_bw, args.repeats)
        except Exception as e:  # the rows are kept
            results["plain_skipped"] = f"error: {type(e).__name__}: {e}"[:500]
    if "plain" in results:
        for row in results["rows"].values():
            if "phases" in row:
                row["phases"]["whole cycle"]["plain_steps"] = row["phases"]["whole cycle"]["ms"] / results["plain"]["step_ms"]
    write()
    print(table(results), flush=True)


if __name__ == "__main__":
    main()
