"""The speed A/Bs of one GPU call, in one process, on the demo inflated to a shape (default LLaMA-3-8B's; real
acceptance: the demo head's), greedy, --tokens new tokens a run:

- plain and EAGLE-2 end to end, the time to first token apart, each beside its call timed back to back (the step,
  the whole cycle): what is spent outside the call per step and per cycle;
- CUDA-graph trees (torch.compile mode="reduce-overhead", today's default) against CapturedGraphs
  (EAGLET_GRAPHS=manual);
- EAGLE-2 over the whole vocabulary against the default draft vocabulary (the lowest ids: the demo's tokens are all
  among them, so tau is the same and the row measures what the smaller lm_head saves);
- split attention (EAGLET_SPLIT=1) off and on;
- a torch.profiler timeline of a few cycles of the first EAGLE-2 row: device busy time against wall time
  (OUT/timeline.json.gz, gzip: it opens in Perfetto as it is, in chrome://tracing once unzipped).

Each row is written to OUT/speed_ab.json and OUT/speed_ab.md as soon as it is measured; a row that would end after
--budget_s (counted from the start, at the pace of the longest row so far) is skipped and says so. Every row's tokens
are compared with the first row measured (the reference, named in the table: plain's where a plain row comes first).

    python scripts/speed_ab.py --out $OUT/ab --budget_s 330
    python scripts/speed_ab.py --out /tmp/ab --device cpu --shape reduced --tokens 24   # the CPU dry run
"""
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import cli_parser, int_flag  # noqa: E402

# name (its parts: what runs / graphs / vocabulary / split): (speculative, graphs, draft vocabulary, split attention)
ROWS = {
    "plain/trees": (False, "trees", None, False),
    "plain/captured": (False, "manual", None, False),
    "eagle2/trees/whole": (True, "trees", None, False),
    "eagle2/trees/draft_vocab": (True, "trees", "default", False),
    "eagle2/captured/draft_vocab": (True, "manual", "default", False),
    "eagle2/trees/draft_vocab/split": (True, "trees", "default", True),
    "eagle2/captured/draft_vocab/split": (True, "manual", "default", True),
}


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--out", type=Path, required=True, help="a new folder for speed_ab.json, speed_ab.md, timeline.json.gz")
    p.add_argument("--shape", default="llama3-8b", help="llama2-7b, llama3-8b or reduced (a CPU dry run)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tokens", type=int_flag(2), default=256, help="new tokens a run")
    p.add_argument("--repeats", type=int_flag(1), default=20, help="back-to-back calls timed per row")
    p.add_argument("--budget_s", type=int_flag(1), default=330, help="seconds from the start; a row that would end later is skipped")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated, from: " + ", ".join(ROWS) + " (trees: torch.compile's CUDA-graph trees; captured: "
                   "EAGLET_GRAPHS=manual; draft_vocab: the default draft vocabulary; split: EAGLET_SPLIT=1)")
    p.add_argument("--commit", default=None, help="the commit that runs (default: git's; a copy without history has none)")
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown or not args.rows:
        p.error(f"unknown --rows {unknown}; known: {list(ROWS)}")
    if args.out.exists():
        p.error(f"--out {args.out} exists: give a new folder")
    return args


def setup(args):
    import torch
    import measure
    from gpu_check import SHAPES
    from inflate_demo import DEMO_DIR, inflate
    from load import PRECISIONS, pick_device
    from tokenizer import Tokenizer
    device = pick_device(args.device)
    dtype = PRECISIONS["bf16" if device == "cuda" else "fp32"]
    torch.manual_seed(0)
    target, draft, _, _ = inflate(DEMO_DIR, SHAPES[args.shape], device, dtype)
    target.setup_caches(1, 2048)
    draft.setup_caches(2048)
    target.set_feature_layers(draft.feature_layers)
    prompt = Tokenizer(DEMO_DIR / "target").encode("def read_lines(path):\n")
    return target, draft, prompt, device, measure.copy_bandwidth(device)


def measure_row(target, draft, prompt, device, name, args, plain_tokens):
    import torch
    import attention
    import measure
    import decode
    import graphs as step_graphs  # (graphs: a row's name for them, below)
    from decode import TreeConfig, generate
    from sampling import SamplingConfig
    from cli import DEFAULT_DRAFT_VOCAB
    from head_formats import default_draft_vocab
    speculative, graphs, vocab, split = ROWS[name]
    GREEDY = SamplingConfig()
    step_graphs.GRAPHS, attention.SPLIT_ATTENTION = graphs, split
    torch._dynamo.reset()
    draft.draft_to_target = draft.vocab_lm_head = None  # the whole vocabulary
    if vocab:
        draft.restrict_vocab(target, default_draft_vocab(target.args.vocab_size, (), DEFAULT_DRAFT_VOCAB))
    fn = step_graphs.compile_step(decode.speculative_cycle if speculative else decode.decode_one_token, device)
    tree = TreeConfig(6, 10, 60)
    kwargs = {"draft": draft, "tree": tree} if speculative else {}
    t0, graphs_before = time.perf_counter(), measure.graph_count()
    generate(target, prompt, 16, GREEDY, step_fn=fn, **kwargs)  # compilation, graph capture
    compile_s = time.perf_counter() - t0
    result = generate(target, prompt, args.tokens, GREEDY, step_fn=fn, **kwargs)
    root, ctx_len, h_last = measure.start_state(target, draft if speculative else None)
    inputs = GREEDY.inputs(device, target.args.vocab_size)  # as generate() passes them: the graph it compiled
    with torch.no_grad():
        if speculative:
            call = lambda: fn(target, draft, root, ctx_len, h_last, tree, inputs)  # noqa: E731
        else:
            read = {} if device == "cuda" else {"filled": int(ctx_len) + 1}
            call = lambda: fn(target, root.view(1, 1), ctx_len.view(1), inputs, **read)  # noqa: E731
        call_s, recompiles = measure.timed(call, args.repeats, device)
    calls = len(result.accept_lengths) if speculative else len(result.tokens) - 1
    decode_s = result.seconds - result.first_token_seconds
    row = {"tokens_per_s": result.tokens_per_s, "decode_tokens_per_s": result.decode_tokens_per_s,
           "first_token_ms": result.first_token_seconds * 1e3, "tau": result.tau if speculative else None,
           "call_ms": call_s * 1e3, "end_to_end_ms_per_call": decode_s / calls * 1e3,
           "outside_ms_per_call": decode_s / calls * 1e3 - call_s * 1e3, "at_call_rate": call_s * calls / decode_s,
           "recompiles_after_warmup": recompiles, "graphs_compiled": measure.graph_count() - graphs_before,
           "compile_and_capture_s": compile_s,
           "draft_vocab": draft.vocab_size if speculative else None,
           "same_tokens_as_reference": None if plain_tokens is None else result.tokens == plain_tokens,
           "tokens": result.tokens}
    if speculative and args.timeline and not args.timeline_done:
        row["timeline"] = timeline(target, prompt, fn, kwargs, args.out / "timeline.json.gz")
        args.timeline_done = True
    return row


def timeline(target, prompt, fn, kwargs, path: Path) -> dict:
    """A profiled run of 48 tokens: the device's busy time (sum of its kernels, overlaps not merged) against wall."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from decode import generate
    from sampling import SamplingConfig
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        result = generate(target, prompt, 48, SamplingConfig(), step_fn=fn, **kwargs)
    prof.export_chrome_trace(str(path))
    device_us = sum(e.self_device_time_total for e in prof.key_averages())
    return {"wall_ms": result.seconds * 1e3, "device_busy_ms": device_us / 1e3,
            "device_busy_fraction": device_us / 1e3 / max(result.seconds * 1e3, 1e-9), "trace": path.name}


def markdown(results: dict) -> str:
    setup = results["setup"]
    lines = [f"# Speed A/B: {setup['shape']} on {setup['device_name']} ({setup['date']}, commit {setup['commit']})", "",
             f"Command: `{setup['command']}`; copy bandwidth {setup['copy_GB_per_s']:.0f} GB/s; {setup['tokens']} "
             "tokens a run, greedy, the demo inflated", "",
             "| row | tokens/s end to end | decode tokens/s | first token (ms) | tau | call back to back (ms) | "
             f"per call end to end (ms) | outside (ms) | decode / call rate | same tokens as {results['reference']} | "
             "compile (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results["rows"].items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | {r.get('skipped') or r.get('error')} |")
            continue
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        same = "(the reference)" if name == results["reference"] else r["same_tokens_as_reference"]
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | {r['first_token_ms']:.1f} | "
                     f"{tau} | {r['call_ms']:.3f} | {r['end_to_end_ms_per_call']:.3f} | {r['outside_ms_per_call']:.3f} | "
                     f"{100 * r['at_call_rate']:.1f}% | {same} | {r['compile_and_capture_s']:.0f} |")
        if "timeline" in r:
            t = r["timeline"]
            lines.append(f"| (timeline of its 48-token run) | wall {t['wall_ms']:.1f} ms, device busy {t['device_busy_ms']:.1f} "
                         f"ms = {100 * t['device_busy_fraction']:.0f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    start = time.perf_counter()  # --budget_s counts from here: the setup (the shape's weights) is part of it
    args = parse_args(argv)
    import torch
    import measure
    from model import EagletError
    args.out.mkdir(parents=True)
    args.timeline, args.timeline_done = True, False
    try:
        target, draft, prompt, device, copy_bw = setup(args)
    except EagletError as e:
        sys.exit(f"error: {e}")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    results = {"setup": {"shape": args.shape, "device_name": name, "date": time.strftime("%Y-%m-%d"),
                         "commit": args.commit or measure.git_commit(), "tokens": args.tokens, "copy_GB_per_s": copy_bw / 1e9,
                         "command": "python " + " ".join(sys.argv if argv is None else ["scripts/speed_ab.py", *argv])},
               "rows": {}, "reference": "the first row measured"}
    plain_tokens, longest = None, 0.0
    for row in args.rows:
        elapsed = time.perf_counter() - start
        if elapsed + longest > args.budget_s:  # a row cut off by the caller's time limit would keep nothing
            results["rows"][row] = {"skipped": f"{elapsed:.0f} s of {args.budget_s} spent; the longest row took "
                                               f"{longest:.0f} s"}
        else:
            print(f"== {row}", flush=True)
            t0 = time.perf_counter()
            try:
                results["rows"][row] = measure_row(target, draft, prompt, device, row, args, plain_tokens)
                if plain_tokens is None:
                    plain_tokens, results["reference"] = results["rows"][row]["tokens"], row
            except Exception as e:  # the next row may still measure something
                results["rows"][row] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            longest = max(longest, time.perf_counter() - t0)
        (args.out / "speed_ab.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "speed_ab.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
