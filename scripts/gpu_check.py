"""Check and measure a GPU in one command: the environment, the attention kernel of every call the cycle
makes, compiled == eager, CUDA-graph skips and recompilations, then the demo inflated to LLaMA-2-7B and
LLaMA-3-8B shapes: plain decoding against the copy bandwidth, one EAGLE-2 cycle against its bytes floor,
and plain vs EAGLE-2 vs transformers' generate on the same weights (real acceptance: the demo's).

    python scripts/gpu_check.py --out gpu_results --quick     # a first, short call: environment and checks
    python scripts/gpu_check.py --out gpu_results             # everything, within --budget_s seconds

Results are written after every section (OUT/results.json and OUT/results.md), so a crash or a timeout
keeps what was measured; a failing section is recorded with its error and the next one runs. Sections
that would start after --budget_s are skipped and say so. On a CPU (--device cpu) the same code runs as
a smoke test on the reduced shape.
"""
import json
import logging
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import generate  # noqa: E402
from cli import cli_parser, int_flag  # noqa: E402
from generate import PRECISIONS, SamplingConfig, TreeConfig, pick_device  # noqa: E402
from inflate_demo import DEMO_DIR, SHAPES, inflate  # noqa: E402
import model  # noqa: E402
from model import EagletError, causal_mask, attention_mask, decode_block_mask, sdpa_inputs  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

REDUCED = dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
               num_key_value_heads=2, head_dim=128, max_position_embeddings=8192)  # as tests/test_inflate.py
GREEDY = SamplingConfig()
PROMPT = "def read_lines(path):\n"


class Report:
    """Results written as they come: OUT/results.json and a markdown rendering of it."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s, self.t0 = out, budget_s, time.perf_counter()
        self.results = {}

    def section(self, name: str, fn, *args):
        if time.perf_counter() - self.t0 > self.budget_s:
            self.results[name] = {"skipped": f"time budget of {self.budget_s:.0f} s spent"}
        else:
            print(f"== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                self.results[name] = fn(*args)
            except Exception as e:  # keep going: the next section may still measure something
                self.results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            if isinstance(self.results[name], dict):
                self.results[name]["section_seconds"] = round(time.perf_counter() - t0, 1)
        self.write()
        return self.results[name]

    def write(self):
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        lines = [f"# GPU check ({time.strftime('%Y-%m-%d')}, commit {bench.git_commit()})", ""]
        for name, value in self.results.items():
            lines += [f"## {name}", "", "```", json.dumps(value, indent=1, default=str)[:30000], "```", ""]
        (self.out / "results.md").write_text("\n".join(lines))


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
           "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"}
    env["copy_GB_per_s"] = bench.copy_bandwidth(device) / 1e9
    return env


def backend_name(inputs: dict) -> str:
    from torch.nn.attention import SDPBackend
    return SDPBackend(torch._fused_sdp_choice(**inputs)).name


def attention_backends(target, draft, tree: TreeConfig, n_prompt: int = 128) -> dict:
    """For each attention call of a run: what the eager code gives SDPA (and which kernel SDPA picks), and
    what the compiled code runs (flex_attention over a block mask when it decodes on CUDA, else SDPA)."""
    device, dtype = target.tok_embeddings.weight.device, target.tok_embeddings.weight.dtype
    S = target.max_seq_length
    ctx = torch.tensor(n_prompt, device=device)

    def qkv(model_args, n):
        q = torch.randn(1, model_args.n_head, n, model_args.head_dim, device=device, dtype=dtype)
        k = torch.randn(1, model_args.n_local_heads, S, model_args.head_dim, device=device, dtype=dtype)
        return q, k, k.clone()

    eye = torch.eye(tree.topk, dtype=torch.bool, device=device)
    calls = {  # name: (model args, eager mask, compiled mask)
        f"prefill T={n_prompt}": (target.args, causal_mask(torch.arange(n_prompt, device=device), n_prompt), None),
        "decode T=1": (target.args, causal_mask(ctx.view(1), n_prompt + 1), causal_mask(ctx.view(1), S)),
        f"verify T={tree.total_tokens}": (target.args, None, attention_mask(
            ctx, torch.ones(tree.total_tokens, tree.total_tokens, dtype=torch.bool, device=device).tril(), S)),
        f"draft frontier T={tree.topk}": (draft.args, None, attention_mask(ctx, eye, S)),
        f"catch-up T={tree.depth + 2}": (draft.args, None, causal_mask(ctx + torch.arange(tree.depth + 2, device=device), S)),
    }
    rows = {}
    for name, (args, eager_mask, compiled_mask) in calls.items():
        row = {}
        if eager_mask is not None:
            row["eager"] = "SDPA " + backend_name(sdpa_inputs(*qkv(args, eager_mask.shape[0]), eager_mask))
        if compiled_mask is not None:
            if device.type == "cuda" and model.FLEX_ATTENTION and compiled_mask.shape[0] == 1:
                bm = decode_block_mask(ctx.view(1), S)
                read = int(bm.kv_num_blocks[0, 0].max() + bm.full_kv_num_blocks[0, 0].max())
                row["compiled"] = f"flex_attention, {read} of {bm.kv_indices.shape[-1]} cache blocks read"
            else:
                row["compiled"] = "SDPA " + backend_name(sdpa_inputs(*qkv(args, compiled_mask.shape[0]), compiled_mask))
        rows[name] = row
    math_calls = [n for n, r in rows.items() for v in r.values() if "MATH" in v]
    rows["math_backend_on_cuda"] = math_calls if device.type == "cuda" else "n/a (CPU)"
    return rows


def compiled_vs_eager(target, draft, tree: TreeConfig, prompt: list, n_tokens: int) -> dict:
    """Greedy tokens eager and compiled (plain and EAGLE-2), compile times, graphs compiled after warm-up,
    CUDA-graph skips (counter and log)."""
    from torch._dynamo.utils import counters
    device = str(target.output.weight.device)
    skips_logged = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "skipping cudagraphs" in record.getMessage():
                skips_logged.append(record.getMessage()[:300])
    handler = Catch()
    logging.getLogger("torch").addHandler(handler)
    out = {}
    try:
        for name, kwargs, fn in [("plain", {}, generate.decode_one_token),
                                 ("EAGLE-2", {"draft": draft, "tree": tree}, generate.speculative_cycle)]:
            eager = generate.generate(target, prompt, n_tokens, GREEDY, **kwargs)
            step = generate.compile_step(fn, device)
            t0 = time.perf_counter()
            generate.generate(target, prompt, 16, GREEDY, step_fn=step, **kwargs)  # compilation, capture
            compile_s = time.perf_counter() - t0
            graphs = counters["stats"]["unique_graphs"]
            compiled = generate.generate(target, prompt, n_tokens, GREEDY, step_fn=step, **kwargs)
            compiled2 = generate.generate(target, prompt[:-3], n_tokens, GREEDY, step_fn=step, **kwargs)
            first_diff = next((i for i, (a, b) in enumerate(zip(eager.tokens, compiled.tokens)) if a != b), None)
            out[name] = {"same_tokens": eager.tokens == compiled.tokens, "first_difference": first_diff,
                         "compile_and_warm_up_s": round(compile_s, 1),
                         "graphs_compiled_after_warm_up": counters["stats"]["unique_graphs"] - graphs,
                         "tau_eager": eager.tau if eager.accept_lengths else None,
                         "tau_compiled": compiled.tau if compiled.accept_lengths else None,
                         "same_tokens_second_prompt": compiled2.tokens == generate.generate(
                             target, prompt[:-3], n_tokens, GREEDY, **kwargs).tokens}
        out["cudagraph_skips_counter"] = int(counters["inductor"]["cudagraph_skips"])
        out["cudagraph_skips_logged"] = skips_logged
    finally:
        logging.getLogger("torch").removeHandler(handler)
    return out


def cache_size_check(target, n_ctx: int = 256, repeats: int = 50) -> dict:
    """A compiled plain step at context n_ctx in a 512-slot cache and in an 8192-slot one (or the model's
    longest): it should cost the same."""
    device = str(target.output.weight.device)
    sizes = (512, min(8192, target.args.max_position_embeddings))
    rows = {}
    for size in sizes:
        target.setup_caches(1, size)
        step = generate.compile_step(generate.decode_one_token, device)
        token, pos = torch.zeros(1, 1, dtype=torch.long, device=device), torch.tensor([n_ctx], device=device)
        with torch.no_grad():
            seconds, recompiles = bench.timed(lambda: step(target, token, pos, GREEDY), repeats, device)
        rows[f"{size} slots"] = {"step_ms": seconds * 1e3, "recompiles_after_warmup": recompiles}
    first, last = (rows[f"{s} slots"]["step_ms"] for s in (sizes[0], sizes[-1]))
    rows["largest_over_smallest"] = last / first
    return rows


def measure_shape(name: str, shape: dict, device: str, dtype, prompt: list, args, full: bool) -> dict:
    """The inflated demo in one shape: plain decoding, a cycle (phase by phase if full), side by side."""
    target, draft, _, _ = inflate(DEMO_DIR, shape, device, dtype)
    target.setup_caches(1, args.max_seq_length)
    draft.setup_caches(args.max_seq_length)
    tree = TreeConfig(args.depth, args.tree_topk, args.total_tokens)
    copy_bw = bench.copy_bandwidth(device)
    out = {"weights_GB": generate.weight_bytes(target) / 1e9}
    if args.draft_vocab and args.draft_vocab < target.args.vocab_size:
        # the first ids hold all of the demo's tokens (the rows past them never win), so the drafts are the
        # same as with the whole vocabulary: this measures FR-Spec's cost, not its effect on acceptance
        draft.restrict_vocab(target, torch.arange(args.draft_vocab))
        out["draft_vocab"] = args.draft_vocab
    out["plain"] = bench.bench_plain(target, True, copy_bw, args.repeats)
    if args.plain_only:
        return out
    step_s = out["plain"]["step_ms"] / 1e3
    if full:
        out["cycle"] = bench.bench_cycle(target, draft, tree, True, args.repeats, step_s, copy_bw)
    step_fns = {"plain": generate.compile_step(generate.decode_one_token, device),
                "spec": generate.compile_step(generate.speculative_cycle, device)}
    out["side_by_side"] = bench.side_by_side(target, draft, tree, step_fns, args.side_tokens, full, prompt)
    out["total_tokens_auto"] = generate.pick_total_tokens(target, tree, log=lambda s: None)
    return out


def run_checks(report: Report, device: str, dtype, tree: TreeConfig, prompt: list):
    """The reduced shape: attention kernels (bf16 on CUDA), compiled == eager (fp32), falling back to dense
    attention if the compiled check fails."""
    small, small_draft, _, _ = inflate(DEMO_DIR, REDUCED, device, dtype)
    small.setup_caches(1, 1024)
    small_draft.setup_caches(1024)
    report.section("attention kernels (reduced shape)", attention_backends, small, small_draft, tree)
    # exactness in fp32: in bf16 compiled and eager kernels round differently, and near-ties flip tokens
    small, small_draft, _, _ = inflate(DEMO_DIR, REDUCED, device, torch.float32)
    small.setup_caches(1, 1024)
    small_draft.setup_caches(1024)
    checked = report.section("compiled vs eager (reduced shape, fp32)", compiled_vs_eager, small, small_draft, tree,
                             prompt, 48)
    if device == "cuda" and "error" in checked:  # measure the rest with the dense fallback rather than nothing
        model.FLEX_ATTENTION = False
        torch._dynamo.reset()
        report.results["setup"]["flex_attention"] = "off (EAGLET_FLEX=0) after it failed in the section above"
        report.section("compiled vs eager, dense attention (reduced shape, fp32)", compiled_vs_eager, small, small_draft,
                       tree, prompt, 48)


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--out", type=Path, default=Path("gpu_results"), help="folder for results.json and results.md")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="environment, kernels and compiled == eager only")
    p.add_argument("--shapes", default="llama2-7b,llama3-8b", help="comma-separated, from " + ", ".join(SHAPES))
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if available")
    p.add_argument("--budget_s", type=int_flag(1), default=500, help="start no section after this many seconds")
    p.add_argument("--depth", type=int_flag(1), default=6, help="draft tree expansion steps")
    p.add_argument("--tree_topk", type=int_flag(1), default=10, help="children per node and nodes kept per level")
    p.add_argument("--total_tokens", type=int_flag(2), default=60, help="tokens verified per cycle")
    p.add_argument("--repeats", type=int_flag(1), default=20, help="timed calls per measurement")
    p.add_argument("--side_tokens", type=int_flag(1), default=128, help="tokens generated side by side")
    p.add_argument("--max_seq_length", type=int_flag(64), default=2048, help="KV cache slots")
    mode.add_argument("--plain_only", action="store_true",
                      help="no checks; per shape only the compiled plain step, then the cache-size check (an A/B run)")
    p.add_argument("--draft_vocab", type=int_flag(1), default=0,
                   help="the draft scores only the first N token ids on shapes with more (FR-Spec's cost); "
                        "default: all")
    p.add_argument("--coordinate_descent", action="store_true",
                   help="inductor's coordinate_descent_tuning on (gpt-fast's setting), for an A/B run")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if not args.shapes:
        p.error("--shapes names no shape")
    if unknown:
        p.error(f"unknown --shapes {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        tree = TreeConfig(args.depth, args.tree_topk, args.total_tokens)
        device = pick_device(args.device)
        if not (DEMO_DIR / "target" / "model.pth").is_file():
            raise EagletError(f"no demo in {DEMO_DIR}")
        demo_vocab = model.read_config(DEMO_DIR / "target")["vocab_size"]
        if 0 < args.draft_vocab < demo_vocab:
            raise EagletError(f"--draft_vocab {args.draft_vocab} would leave out demo tokens: "
                              f"give at least {demo_vocab}")
        if any((args.out / name).exists() for name in ("results.json", "results.md")):
            raise EagletError(f"--out {args.out} already holds results; give a new folder")
        args.out.mkdir(parents=True, exist_ok=True)
        generate.check_writable(args.out / "results.json", "--out")
    except (EagletError, OSError) as e:
        sys.exit(f"error: {e}")
    torch._inductor.config.coordinate_descent_tuning = args.coordinate_descent
    torch.manual_seed(0)
    dtype = PRECISIONS["bf16" if device == "cuda" else "fp32"]
    report = Report(args.out, args.budget_s)
    report.results["setup"] = {"command": "python " + " ".join(sys.argv if argv is None else ["scripts/gpu_check.py", *argv]),
                               "date": time.strftime("%Y-%m-%d"), "commit": bench.git_commit(),
                               "coordinate_descent_tuning": args.coordinate_descent, "precision": str(dtype),
                               "flex_attention": model.FLEX_ATTENTION, "draft_vocab": args.draft_vocab or "all"}
    report.section("environment", environment, device)
    prompt = Tokenizer(DEMO_DIR / "target").encode(PROMPT)
    if not args.plain_only:
        run_checks(report, device, dtype, tree, prompt)
    if not args.quick:
        for i, name in enumerate(args.shapes):
            report.section(f"{name} (inflated demo)", measure_shape, name, SHAPES[name], device, dtype, prompt, args,
                           i == 0)
            if device == "cuda":
                torch.cuda.empty_cache()
        big = inflate(DEMO_DIR, SHAPES[args.shapes[-1]], device, dtype)[0]
        report.section("plain step at context 256: 512 vs 8192 cache slots", cache_size_check, big)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
