"""Every drafter's cycle on one target of a named shape (random weights, bf16 on CUDA), compiled, whole (a cycle
phase by phase compiles five graphs: a minute or more each on the 8B shape): a chain of the whole block for each
block drafter of the published shapes (P-EAGLE, DFlash2, XPress, DFlash: bench.py's random heads), EAGLE-2's 60/6/10
tree, then 32-token trees from one pass of the newer ones -- each beside the plain step (its time in plain
steps) and its bytes floor. One target, one process: the rows compare like with like. Random heads accept next to
nothing: what is measured is what a cycle costs, not what it emits. A row is written to OUT/cycles.md and
OUT/cycles.json as soon as it is measured; a row that would start after --budget_s is skipped and says so.

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
    p.add_argument("--budget_s", type=int_flag(1), default=300, help="start no row after this many seconds")
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


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    import torch
    import measure
    from decode import TreeConfig
    from load import PRECISIONS, pick_device
    device = pick_device(args.device)
    dtype = PRECISIONS["bf16" if device == "cuda" else "fp32"]
    torch.manual_seed(0)
    target, _ = measure.random_models(args.shape, device, dtype, 2048)
    copy_bw = measure.copy_bandwidth(device)
    plain = measure.bench_plain(target, True, copy_bw, args.repeats)
    args.out.mkdir(parents=True)
    results = {"setup": {"shape": args.shape, "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
                         "precision": str(dtype), "commit": args.commit or measure.git_commit(), "date": time.strftime("%Y-%m-%d"),
                         "command": "python scripts/drafter_cycles.py " + " ".join(sys.argv[1:] if argv is None else argv),
                         "copy_GB_per_s": copy_bw / 1e9},
               "plain": plain, "rows": {}}
    lines = [f"# Drafter cycles: {args.shape}, {results['setup']['device']}, {dtype} "
             f"({results['setup']['date']}, commit {results['setup']['commit']})", "",
             f"Command: `{results['setup']['command']}`; plain step {plain['step_ms']:.3f} ms; compiled, "
             f"{args.repeats} cycles a row, random heads (tau means nothing)", "",
             "| row | verified tokens | draft passes | cycle (ms) | plain steps | floor (ms) | cycle / floor |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def write(line: str):
        lines.append(line)
        (args.out / "cycles.md").write_text("\n".join(lines) + "\n")
        (args.out / "cycles.json").write_text(json.dumps(results, indent=1))
        print(line, flush=True)
    write(f"| plain step | 1 | - | {plain['step_ms']:.3f} | 1.00 | - | {plain['fraction_of_copy_bandwidth']:.0%} "
          "of the copy bandwidth |")
    heads = {}
    for name in args.rows:
        if time.perf_counter() - t0 > args.budget_s:
            write(f"| {name} | budget of {args.budget_s} s spent |")
            continue
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
            cycle = measure.bench_cycle(target, draft, tree, True, args.repeats, plain["step_ms"] / 1e3, copy_bw,
                                      phases=False)
            whole = cycle["phases"]["whole cycle"]
            results["rows"][name] = {"tree": [tree.depth, tree.topk, tree.total_tokens], **cycle}
            write(f"| {name} | {tree.total_tokens} | {cycle['draft_passes']} | {whole['ms']:.3f} | "
                  f"{whole['plain_steps']:.2f} | {cycle['floor_ms']:.3f} | {cycle['measured_over_floor']:.2f} |")
        except Exception as e:  # the next row may still run
            results["rows"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            write(f"| {name} | error: {type(e).__name__}: {str(e)[:200]} |")


if __name__ == "__main__":
    main()
