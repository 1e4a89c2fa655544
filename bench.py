"""Where the time goes: plain decoding against the memory-bandwidth limit, one EAGLE-2 cycle phase by
phase, an evaluation over FastChat question files, and transformers' own generate on the same weights.

    python bench.py --model llama3-8b --compile                  # random bf16 weights of a named shape
    python bench.py --checkpoint_path .../model.pth --draft_checkpoint_path .../draft.pth --compile \\
        --eval ../shared/data/prompts --hf

    python bench.py                                              # the demo in demo/, as generate.py runs it
    torchrun --standalone --nproc_per_node=4 bench.py --model llama2-70b --compile   # tensor parallel (tp.py)

Writes OUT.json and OUT.md (--out; default bench_out/DATE-TIME, never over an existing file unless --overwrite);
numbers are printed, never asserted. Every derived figure names the measured inputs it comes from.
"""
# (The docstring above is --help's text.) This file is the command line: flags, the inputs (prompts, questions),
# main, and the report it writes; measure.py measures. A tool on top: imports measure.py, generate.py and what is below
# them (decode, tune, chat, draft, model, tp, tokenizer, cli) and train_data.py's question reader; only tests import it.
import json
import os
import sys
import time
from argparse import ArgumentTypeError
from dataclasses import asdict, replace
from pathlib import Path

from cli import (DEFAULT_DRAFT_VOCAB, DEMO_PROMPT, DRAFT_VOCAB_ABOVE, PRECISION_NAMES, SHAPES, cli_parser,
                 int_flag, torchrun_rank)

SIDE_TOKENS = 128  # tokens generated in the side-by-side run (its prompt: measure.py's SIDE_PROMPT)


DEMO_DIR = Path(__file__).resolve().parent / "demo"  # generate.py's (not imported here: it imports torch)
DEMO_NAMES = ("read_lines", "write_lines", "load_json", "save_json", "parse_args", "main", "count_words", "copy_file",
              "read_config", "list_files", "make_dirs", "run", "get_path", "open_file", "clean", "split_lines")


def sizes_flag(what: str, example: str):
    """An argparse type: sizes, comma-separated, each at least 1, increasing."""
    def parse(text: str) -> list:
        try:
            sizes = [int(s) for s in text.split(",")]
        except ValueError:
            raise ArgumentTypeError(f"expected {what} like {example}, got {text!r}")
        if not sizes or min(sizes) < 1 or sizes != sorted(set(sizes)):
            raise ArgumentTypeError(f"expected increasing {what} of at least 1, like {example}, got {text!r}")
        return sizes
    return parse


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--model", choices=list(SHAPES), help="random weights of this shape, no checkpoint needed "
                                                          "(default: none; --checkpoint_path or the demo)")
    p.add_argument("--checkpoint_path", type=Path,
                   help="a converted target (model.pth) (default: the demo in demo/ when --model is not given)")
    p.add_argument("--draft_checkpoint_path", type=Path,
                   help="its draft.pth, any head kind eaglet reads (default: demo/head/draft.pth for the demo, "
                        "else a random head of --random_head's kind and the target's shape)")
    p.add_argument("--random_head", choices=["eagle", "dflash", "dspark", "peagle", "dflash2", "xpress"],
                   default="eagle",
                   help="the random head when no draft.pth is given: EAGLE-1/2, DFlash as published (5 layers, "
                        "blocks of 16, features of 5 layers), DSpark as published for Qwen3-8B (5 layers, blocks "
                        "of 7 every row drafting, Markov rank 256), P-EAGLE as speculators makes one by default "
                        "(one layer, 3 feature layers, 8 drafts a pass, a draft vocabulary of 32,000), DFlash2 or "
                        "XPress as speculators makes them by default (DFlash's shape; convolutions of 2 taps over "
                        "groups of 16 and a rank-256 selector of 16 candidates; a rank-256 refiner, 6 Jacobi "
                        "passes); its tau means nothing, its cycle's cost does")
    p.add_argument("--draft_vocab", default=None,
                   help="EAGLE-1/2 heads: a file of the target ids the draft may propose (scripts/draft_vocab.py); "
                        "default: as generate.py (draft_vocab.json beside the head, else on a target of more than "
                        f"{DRAFT_VOCAB_ABOVE} ids its {DEFAULT_DRAFT_VOCAB} lowest); 0 or full: the whole vocabulary")
    p.add_argument("--tokenizer", type=Path,
                   help="for --eval: a tokenizer file or folder (default: the checkpoint's folder; --model has none)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if available")
    p.add_argument("--precision", choices=PRECISION_NAMES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the step and the cycle")
    p.add_argument("--exact", action="store_true", help="every measurement under generate.py's --exact (docs/exact.md)")
    p.add_argument("--depth", type=int_flag(1), default=None,
                   help="draft tree expansion steps (default: the head's, as generate.py: 6; 7 for EAGLE-3 heads; "
                        "a DFlash head's block size - 2; a DSpark head's block size - 1)")
    p.add_argument("--tree_topk", type=int_flag(1), default=None,
                   help="children per node and nodes kept per level (default: 10; 1 for DFlash and DSpark heads, a chain)")
    p.add_argument("--total_tokens", type=int_flag(2), default=None,
                   help="tokens verified per cycle, root included (default: 60, or all the nodes of a smaller tree)")
    p.add_argument("--repeats", type=int_flag(1), default=20, help="timed calls per measurement")
    p.add_argument("--side_tokens", type=int_flag(1), default=None,
                   help=f"tokens generated in the side-by-side run (default: {SIDE_TOKENS}; 60 for the demo, as "
                        "generate.py)")
    p.add_argument("--hf", action="store_true", help="include transformers' generate in the side-by-side run")
    p.add_argument("--batch_sizes", type=sizes_flag("batch sizes", "1,2,4,8"), default=None,
                   help="several prompts at once: total tokens/s and latency per sequence at these batch sizes, plain "
                        "and EAGLE-2, e.g. 1,2,4,8,16 (default: not run)")
    p.add_argument("--cache_sizes", type=sizes_flag("cache sizes", "256,2048,4096"), default=None,
                   help="a plain step in caches of these many slots, eager and compiled, as generate.py runs "
                        "them, e.g. 256,2048,4096 (default: not run)")
    p.add_argument("--tune_tree", action="store_true",
                   help="run generate.py --tree auto's tuner here (measured, never read from its cache) and decode the "
                        "side-by-side prompt end to end with its choice and with the flags' tree (60/6/10 by default)")
    p.add_argument("--eval", type=Path, help="folder of FastChat .jsonl question files (default: no evaluation)")
    p.add_argument("--questions", type=int_flag(1), default=5, help="questions per task in --eval")
    p.add_argument("--max_new_tokens", type=int_flag(1), default=128, help="per turn in --eval")
    p.add_argument("--max_seq_length", type=int_flag(1), default=2048, help="size of the KV caches")
    p.add_argument("--out", type=Path, default=None,
                   help="writes OUT.json and OUT.md (default: bench_out/DATE-TIME)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT.json and OUT.md if they exist")
    args = p.parse_args(argv)
    if args.model is not None and args.checkpoint_path is not None:
        p.error("give exactly one of --model and --checkpoint_path")
    args.demo = args.model is None and args.checkpoint_path is None
    if args.demo:  # as generate.py: the small code model and its head shipped in demo/
        if not (DEMO_DIR / "target" / "model.pth").is_file():
            p.error(f"no --model or --checkpoint_path given and no demo in {DEMO_DIR} "
                    "(python scripts/make_demo.py builds it)")
        args.checkpoint_path = DEMO_DIR / "target" / "model.pth"
        args.draft_checkpoint_path = args.draft_checkpoint_path or DEMO_DIR / "head" / "draft.pth"
    if args.draft_vocab not in (None, "full", "0") and not Path(args.draft_vocab).is_file():
        p.error(f"--draft_vocab {args.draft_vocab}: no such file (0 or full: the whole vocabulary)")
    if args.eval and not args.eval.is_dir():
        p.error(f"--eval {args.eval} is not a folder")
    if args.eval and args.model and not args.tokenizer:
        p.error("--eval with --model needs --tokenizer (random weights come with none)")
    if args.hf and torchrun_rank() is not None:
        p.error("--hf runs transformers in one process: leave it out under torchrun (tensor parallel)")
    args.out = args.out or Path("bench_out") / time.strftime("%Y%m%d-%H%M%S")
    return args


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

import torch  # noqa: E402

from chat import write_output  # noqa: E402
from block_draft import DFlashDraft, PEagleDraft  # noqa: E402
from draft import DraftHead, EagleDraft, head_name as draft_kind  # noqa: E402
from decode import TreeConfig, decode_one_token, speculative_cycle  # noqa: E402
from graphs import compile_settings, compile_step  # noqa: E402
from quantize import weights_format  # noqa: E402
from generate import DEMO_MAX_NEW_TOKENS  # noqa: E402
from load import PRECISIONS, check_writable, draft_vocab_of, load_draft, load_target, pick_device  # noqa: E402
from checkpoint import converted_file  # noqa: E402
from model import EagletError, Transformer  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from train_data import read_questions  # noqa: E402
import tp  # noqa: E402
from tune import CALIBRATION_PROMPTS, CALIBRATION_TOKENS, TREE_GRID, check_tune_fits, tree_name  # noqa: E402
from measure import (SIDE_PROMPT, START_PROMPT, batch_sweep, bench_cycle, bench_plain, cache_size_sweep,  # noqa: E402
                     copy_bandwidth, git_commit, loop_host_us, random_head, random_models, run_eval, side_by_side,
                     speedup_base, tensor_parallel, tuned_tree)


def cache_size_lines(results: dict) -> list:
    if "cache_sizes" not in results:
        return []
    sweep = results["cache_sizes"]
    lines = ["", f"| plain step at context {sweep['context']} by cache size | eager ms | compiled ms | compiled / eager "
             "| recompiles |", "| --- | --- | --- | --- | --- |"]
    for size, r in sweep["rows"].items():
        lines.append(f"| {size} slots | {r['eager_step_ms']:.2f} | {r['compiled_step_ms']:.2f} | "
                     f"{r['compiled_step_ms'] / r['eager_step_ms']:.2f}x | {r['recompiles_after_warmup']} |")
    return lines + ["", f"Compiled step, largest cache over smallest: {sweep['compiled_largest_over_smallest']:.2f}x."]


def load_questions(eval_dir: Path, per_task: int) -> dict:
    tasks = {}
    for path in sorted(Path(eval_dir).glob("*.jsonl")):
        tasks[path.stem] = read_questions(path)[:per_task]
    if not tasks:
        raise EagletError(f"no .jsonl question files in {eval_dir}")
    return tasks


def outside_the_graph(results: dict) -> dict:
    """Per step (plain) and per cycle (EAGLE-2) of the side-by-side run, after its first token: the time a call took
    end to end against the time the same call takes back to back (the plain step, the whole cycle: bench_plain's
    and bench_cycle's, at context START_PROMPT; the run's own contexts span its prompt's to its end). The rest is
    spent outside the call: launching it, reading its tokens back, the host's loop. at_call_rate = the run's
    decode rate / the rate its calls alone would give."""
    out = {}
    for name, call_ms in [("eaglet plain", results["plain"]["step_ms"]),
                          ("eaglet EAGLE-2", results["cycle"]["phases"]["whole cycle"]["ms"])]:
        run = results["side_by_side"][name]
        if run["calls"]:
            per_call = run["decode_ms"] / run["calls"]
            out[name] = {"call_ms": call_ms, "end_to_end_ms_per_call": per_call, "outside_ms_per_call": per_call - call_ms,
                         "at_call_rate": call_ms / per_call, "first_token_ms": run["first_token_ms"]}
    return out


def outside_lines(results: dict) -> list:
    rows, loop = results.get("outside_the_graph", {}), results.get("host_loop_us", {})
    if not rows:
        return []
    lines = ["", "| side by side, after the first token | a call back to back (ms) | the same call end to end (ms) | "
             "outside the call (ms) | decode rate / the calls' own rate | time to first token (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {r['call_ms']:.3f} | {r['end_to_end_ms_per_call']:.3f} | {r['outside_ms_per_call']:.3f} | "
              f"{pct(r['at_call_rate'])} | {r['first_token_ms']:.1f} |" for name, r in rows.items()]
    if any(r["outside_ms_per_call"] < 0 for r in rows.values()):
        lines += ["", "Below zero outside the call: the run's calls took less than the same call back to back (timed "
                  "apart, at another context); what is spent outside is below what these timings resolve here."]
    if loop:
        lines += ["", f"The host loop alone (run_calls with the device work taken out): {loop['plain']:.1f} us a plain "
                  f"step, {loop['EAGLE-2']:.1f} us a cycle."]
    return lines


def calibration_prompts(args, target: Transformer) -> tuple:
    """--tune_tree's prompts and what they are: generate.py --tree auto's, encoded by the checkpoint's tokenizer
    (or --tokenizer); for --model, random ids as many (its head is random: tau means nothing there)."""
    if args.model:
        g = torch.Generator().manual_seed(2)
        vocab = min(target.args.vocab_size, 32000)
        return [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in CALIBRATION_PROMPTS], \
            f"{len(CALIBRATION_PROMPTS)} prompts of 16 random token ids"
    tokenizer = Tokenizer(args.tokenizer or args.checkpoint_path.parent)
    return [tokenizer.encode(text) for text in CALIBRATION_PROMPTS], "generate.py --tree auto's prompts"


def tuned_tree_lines(results: dict) -> list:
    if "tuned_tree" not in results:
        return []
    tuned, setup = results["tuned_tree"], results["setup"]
    lines = ["", f"| tree (depth, top-k, tokens), tuned as generate.py --tree auto: tau from "
             f"{setup['calibration_prompts']} x {tuned['calibration_tokens']} greedy tokens, cycle time of "
             f"{tuned['cycle_timing']} | tau | ms per cycle | tokens/s = tau / cycle |", "| --- | --- | --- | --- |"]
    lines += [f"| {tree_name(TreeConfig(r['depth'], r['topk'], r['total_tokens']))} | {r['tau']:.2f} | "
              f"{r['cycle_ms']:.3f} | {r['tokens_per_s']:.1f} |" for r in tuned["grid"]]
    lines += ["", f"Chosen: {tree_name(TreeConfig(**tuned['chosen']))}, in {tuned['tuning_s']:.1f} s of tuning.", "",
              f"| end to end: {setup['side_by_side_prompt']}, {setup['side_tokens']} tokens, greedy | tokens/s | tau |",
              "| --- | --- | --- |"]
    for name, run in tuned["end_to_end"].items():
        tau = f"{run['tau']:.2f}" if run["tau"] else "-"
        lines.append(f"| {name}: {tree_name(TreeConfig(**run['tree']))} | {run['tokens_per_s']:.1f} | {tau} |")
    lines += ["", f"Tuned / flags' tree: {tuned['speedup']:.2f}x tokens/s; same tokens: {tuned['same_tokens']}."]
    return lines


def batch_prompts(args, target: Transformer, n: int) -> tuple:
    """n prompts of their own and what they are: the demo's prompt with other function names, or random ids of
    SIDE_PROMPT - 0..7 tokens (rows of different lengths)."""
    if args.demo:
        tokenizer = Tokenizer(args.checkpoint_path.parent)
        names = [DEMO_NAMES[i % len(DEMO_NAMES)] for i in range(n)]
        return [tokenizer.encode(f"def {name}(path):\n") for name in names], "the demo's prompt with 16 function names"
    g = torch.Generator().manual_seed(1)
    vocab = min(target.args.vocab_size, 32000)
    return [torch.randint(0, vocab, (SIDE_PROMPT - i % 8,), generator=g).tolist() for i in range(n)], \
        f"random token ids, {SIDE_PROMPT - 7} to {SIDE_PROMPT} a prompt"


def batch_lines(results: dict) -> list:
    if "batches" not in results:
        return []
    sweep, prompts = results["batches"], results["setup"]["batch_prompts"]
    lines = ["", f"| several prompts at once: {prompts}, {sweep['tokens']} tokens each, greedy | plain tok/s in all | "
             "EAGLE-2 tok/s in all | EAGLE-2 / plain | plain s per sequence | EAGLE-2 s per sequence | tau |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for b, plain in sweep["rows"]["plain"].items():
        spec = sweep["rows"]["EAGLE-2"][b]
        lines.append(f"| batch {b} | {plain['tokens_per_s']:.1f} | {spec['tokens_per_s']:.1f} | "
                     f"{spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x | {plain['latency_s']:.3f} | "
                     f"{spec['latency_s']:.3f} | {spec['tau']:.2f} |")
    stops = sweep["eagle_stops_beating_plain_at"]
    first = next(iter(sweep["rows"]["plain"]))
    lines += ["", "EAGLE-2 beats plain decoding at every batch size measured here." if stops is None else
              f"EAGLE-2 does not beat plain decoding at any batch size measured here (from {first})." if stops == first
              else f"EAGLE-2 stops beating plain decoding at batch size {stops} on this device."]
    return lines


def draft_passes_text(cycle: dict, tree: dict) -> str:
    passes = cycle.get("draft_passes", tree["depth"] + 1)
    return "once (one block)" if passes == 1 else f"depth + 1 = {passes} times"


def kernels_cell(table: dict) -> str:
    return table["error"] if "error" in table else f"{table['per_call']:.0f} ({table['ms_per_call']:.3f} ms)"


def pct(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"


def markdown(results: dict) -> str:
    setup, plain, cycle, side = results["setup"], results["plain"], results["cycle"], results["side_by_side"]
    copy, ctx, step, tree = setup["copy_GB_per_s"], cycle["context"], plain["step_ms"], setup["tree"]
    unit = plain["kernels"]["unit"]
    lines = [f"## {setup['model']} on {setup['device_name']} (weights {setup['weights']}, head "
             f"{setup['draft_weights']}, activations {setup['precision']}, compile={setup['compile']}"
             f"{', --exact' if setup.get('exact') else ''})", "",
             f"Command: `{setup['command']}`  ", f"Date: {setup['date']}, commit {setup['commit']}", "",
             f"Head: {setup['head']}  ", f"Draft vocabulary: {setup['draft_vocab']['text']}  ",
             f"Measured copy bandwidth: {copy:.4g} GB/s (bytes read and written per second by a large copy)", "",
             *tensor_parallel_lines(results),
             f"| plain decoding at context {ctx} | value |", "| --- | --- |",
             f"| step | {step:.3f} ms |", f"| tokens/s = 1 / step | {plain['tokens_per_s']:.1f} |",
             f"| weights read per step | {plain['weights_GB']:.4g} GB |",
             f"| GB/s = weights / step | {plain['GB_per_s']:.4g}, {pct(plain['fraction_of_copy_bandwidth'])} of the "
             f"copy bandwidth |",
             f"| recompiles after warm-up | {plain['recompiles_after_warmup']} |",
             f"| {unit} per step | {kernels_cell(plain['kernels'])} |", "",
             f"| EAGLE-2 cycle ({tree['total_tokens']}/{tree['depth']}/{tree['topk']}) at context {ctx} | ms | "
             f"plain steps = ms / {step:.3f} ms | recompiles | {unit} |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {r['ms']:.3f} | {r['plain_steps']:.2f} | {r['recompiles_after_warmup']} | "
              f"{kernels_cell(r['kernels'])} |" for name, r in cycle["phases"].items()]
    lines += ["", f"Bytes floor of a cycle at context {ctx}: {cycle['cycle_bytes_GB']:.4g} GB (the target's weights "
              f"once; the head and the lm_head it scores with, {setup['draft_vocab']['tokens']} rows, "
              f"{draft_passes_text(cycle, tree)}; the KV) = {cycle['floor_plain_steps']:.2f} x a plain step's "
              f"{cycle['plain_step_bytes_GB']:.4g} GB (weights + KV). Read at the copy bandwidth it takes "
              f"{cycle['floor_ms']:.4g} ms; the measured whole cycle, {cycle['phases']['whole cycle']['ms']:.3f} ms, "
              f"is {cycle['measured_over_floor']:.2f} x that.", "",
              f"| side by side on the same weights: {setup['side_by_side_prompt']}, {setup['side_tokens']} tokens, "
              f"greedy | tokens/s, end to end | tau | speedup = tokens/s / {speedup_base(side)}'s | "
              "same tokens as plain |", "| --- | --- | --- | --- | --- |"]
    for name, r in side.items():
        tau = f"{r['tau']:.2f}" if r.get("tau") else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {tau} | {r['speedup']:.2f}x | {r['same_tokens_as_plain']} |")
    if "side_by_side" in results["limit"]:
        limit = results["limit"]["side_by_side"]
        lines += ["", f"Physical limit of this EAGLE-2 run: its tau {limit['tau']:.2f} x the copy bandwidth "
                  f"{limit['copy_GB_per_s']:.4g} GB/s / the bytes floor {limit['cycle_bytes_GB']:.4g} GB per cycle "
                  f"(at context {limit['context']}) = {limit['tokens_per_s']:.1f} tokens/s; it measured "
                  f"{limit['measured_tokens_per_s']:.1f} tokens/s, {pct(limit['fraction'])} of that."]
    if "eval" in results:
        limits = results["limit"].get("eval", {})
        lines += ["", "| task | turns (skipped: too long) | tau | plain tok/s | EAGLE-2 tok/s | speedup = EAGLE-2 / "
                  "plain | greedy mismatches | physical limit at its tau, tok/s | EAGLE-2 / limit |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for task, r in results["eval"].items():
            limit = limits.get(task)
            lines.append(f"| {task} | {r['turns']} ({r['skipped']}) | {r['tau']:.2f} | {r['plain_tokens_per_s']:.1f} | "
                         f"{r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {len(r['mismatches'])} | "
                         + (f"{limit['tokens_per_s']:.1f} | {pct(limit['fraction'])} |" if limit else "- | - |"))
        lines += ["", f"Physical limit of a task: its tau x the copy bandwidth {copy:.4g} GB/s / the bytes floor "
                  f"{cycle['cycle_bytes_GB']:.4g} GB per cycle (at context {ctx}; the turns' own contexts differ)."]
    return "\n".join(lines + outside_lines(results) + tuned_tree_lines(results) + batch_lines(results) + cache_size_lines(results)) + "\n"


def launcher(group) -> str:
    return "python " if group is None else f"torchrun --standalone --nproc_per_node={tp.dist.get_world_size(group)} "


def tensor_parallel_lines(results: dict) -> list:
    if "tensor_parallel" not in results:
        return []
    tp_ = results["tensor_parallel"]
    return [f"Tensor parallel over {tp_['ranks']} ranks (every figure here is rank 0's): "
            f"{tp_['weights_per_rank_GB']:.4g} GB of weights per rank per forward; collectives counted as they ran: "
            f"{tp_['collectives_per_plain_step']} per plain step, {tp_['collectives_per_cycle']} per EAGLE-2 cycle "
            "(an all-reduce after each layer's attention and MLP in each target forward, and one that checks the "
            "ranks decided the same; the draft runs whole on every rank)", ""]


def flags_tree(args, head) -> TreeConfig:
    """The tree of --depth, --tree_topk and --total_tokens, each by default the head's (a class before loading)."""
    tree = TreeConfig(args.depth or head.default_depth, args.tree_topk or head.default_topk, 2)
    return replace(tree, total_tokens=args.total_tokens or min(TreeConfig.total_tokens, tree.max_total_tokens))


def check_lengths(args, tree: TreeConfig):
    """The longest run, and the tree's scratch, within --max_seq_length."""
    prompt, scratch = max(SIDE_PROMPT + args.side_tokens, START_PROMPT), tree.scratch
    if args.max_seq_length < prompt + scratch:
        raise EagletError(f"--max_seq_length {args.max_seq_length} is below the longest run ({prompt} tokens: "
                          f"{START_PROMPT} for the timings, {SIDE_PROMPT} + --side_tokens for the side by side) + "
                          f"tree scratch ({scratch}) = {prompt + scratch}")
    if args.eval and args.max_new_tokens + scratch >= args.max_seq_length:
        raise EagletError(f"--eval: max_new_tokens ({args.max_new_tokens}) + tree scratch ({scratch}) leaves no room "
                          f"for a prompt in --max_seq_length {args.max_seq_length}")
    if args.cache_sizes and min(args.cache_sizes) <= START_PROMPT + 1:
        raise EagletError(f"--cache_sizes: the steps run at context {START_PROMPT}; give caches of more than "
                          f"{START_PROMPT + 1} slots, not {min(args.cache_sizes)}")


def out_files(out: Path) -> tuple:
    """OUT.json and OUT.md (a --out ending in .json or .md names the pair; other dots stay: run.v2.json)."""
    base = out.with_suffix("") if out.suffix in (".json", ".md") else out
    return Path(f"{base}.json"), Path(f"{base}.md")


def check_out(paths: tuple, overwrite: bool):
    """Before the long work: the files writable (or their folder one that can be made), and none replaced without
    --overwrite. Makes nothing: a mistake found later (a missing checkpoint) leaves no empty folder behind."""
    folder = paths[0].parent
    if not folder.is_dir():
        existing = next(p for p in folder.absolute().parents if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise EagletError(f"--out {folder}: cannot make the folder: {existing} is not a writable folder")
        return
    for path in paths:
        if path.exists() and not overwrite:
            raise EagletError(f"--out: {path} exists; give another --out, or --overwrite")
        check_writable(path, "--out")


def make_out_folder(paths: tuple):
    folder = paths[0].parent
    if not folder.is_dir():
        try:
            folder.mkdir(parents=True)
        except OSError as e:
            raise EagletError(f"--out {folder}: cannot make the folder: {e.strerror}")
        print(f"made the folder {folder} for --out")


def load_models(args, device: str, group=None, paths: tuple = ()):
    """The target (under tensor parallel, this rank's shard) and a head, with the draft vocabulary --draft_vocab
    asks for (as generate.py applies it); the output files (paths) checked first, by rank 0, which writes them."""
    if paths and not torchrun_rank():
        check_out(paths, args.overwrite)
    dtype = PRECISIONS[args.precision]
    if args.model:
        target, draft = random_models(args.model, device, dtype, args.max_seq_length, group, args.random_head)
    else:
        target = load_target(args.checkpoint_path, device, args.precision, args.max_seq_length, group)
        if args.draft_checkpoint_path:
            return target, load_draft(args.draft_checkpoint_path, target, args.draft_vocab)
        draft = random_head(args.random_head, target, device, dtype)
        draft.setup_caches(args.max_seq_length)
    if isinstance(draft, EagleDraft):  # a random head: as load_draft, but no folder to hold a draft_vocab.json
        token_ids, source = draft_vocab_of(args.draft_vocab, None, target.args.vocab_size)
        if token_ids is not None:
            draft.restrict_vocab(target, token_ids, source)
    return target, draft


def head_name(args, draft) -> str:
    kind = "EAGLE-1/2" if isinstance(draft, EagleDraft) else \
        draft_kind(draft) if isinstance(draft, (DFlashDraft, PEagleDraft)) else "EAGLE-3"
    return f"{args.draft_checkpoint_path} ({kind})" if args.draft_checkpoint_path else \
        f"random weights of the target's shape ({kind}, tau means nothing)"


def draft_vocab_used(args, target, draft) -> dict:
    """The target tokens the head may propose (tau and the bytes floor follow them), and where they come from."""
    n = target.args.vocab_size
    if isinstance(draft, DFlashDraft) and draft.draft_to_target is None:
        return {"tokens": n, "of": n, "source": "full",
                "text": f"full vocabulary ({n}): a {draft_kind(draft)} head scores them all"}
    if not isinstance(draft, EagleDraft):
        return {"tokens": draft.vocab_size, "of": n, "source": "d2t",
                "text": f"the head's own d2t of {draft.vocab_size} (of the target's {n} tokens)"}
    if draft.draft_to_target is None:
        return {"tokens": n, "of": n, "source": "full", "text": f"full vocabulary ({n})"}
    return {"tokens": draft.vocab_size, "of": n, "source": draft.draft_vocab_source,
            "text": f"{draft.vocab_size} of {n} tokens from {draft.draft_vocab_source}"}


def side_prompt(args) -> tuple:
    """The side-by-side run's prompt (None: random tokens) and its description: the demo's is generate.py's."""
    if args.demo:
        tokens = Tokenizer(args.checkpoint_path.parent).encode(DEMO_PROMPT)
        return tokens, f"generate.py's demo prompt {DEMO_PROMPT!r} ({len(tokens)} tokens)"
    return None, f"{SIDE_PROMPT} random token ids"


def physical_limit(tau: float, tokens_per_s: float, copy_bw: float, cycle: dict) -> dict:
    """The fastest a run at this tau could go: each cycle reads at least the cycle's bytes floor (at the
    context bench_cycle measured it) at the copy bandwidth and emits tau tokens; beside it, the tokens/s of the
    run that tau is from."""
    limit = tau * copy_bw / (cycle["cycle_bytes_GB"] * 1e9)
    return {"tau": tau, "copy_GB_per_s": copy_bw / 1e9, "cycle_bytes_GB": cycle["cycle_bytes_GB"],
            "context": cycle["context"], "tokens_per_s": limit, "measured_tokens_per_s": tokens_per_s,
            "fraction": tokens_per_s / limit}


def limits(results: dict, copy_bw: float) -> dict:
    """The physical limit of each run at its own tau: the side by side, and each evaluated task."""
    out, spec, cycle = {}, results["side_by_side"]["eaglet EAGLE-2"], results["cycle"]
    if spec["tau"]:  # no tau: the run stopped at its first token
        out["side_by_side"] = physical_limit(spec["tau"], spec["tokens_per_s"], copy_bw, cycle)
    tasks = {task: r for task, r in results.get("eval", {}).items() if r["turns"]}
    if tasks:
        out["eval"] = {task: physical_limit(r["tau"], r["spec_tokens_per_s"], copy_bw, cycle)
                       for task, r in tasks.items()}
    return out


def main(argv=None):
    args = parse_args(argv)
    args.side_tokens = args.side_tokens or (DEMO_MAX_NEW_TOKENS if args.demo else SIDE_TOKENS)
    paths = out_files(args.out)
    group, status = None, 0
    if torchrun_rank():  # tensor parallel: rank 0 prints and writes for all
        sys.stdout = open(os.devnull, "w")
    try:
        tree = flags_tree(args, DraftHead)
        check_lengths(args, tree)  # before loading; again once the head's own depth is known
        if args.checkpoint_path is not None:  # the file, or its folder (the tokenizer is read beside it)
            args.checkpoint_path = converted_file(args.checkpoint_path, "model.pth")
        device = pick_device(args.device)
        args.precision = args.precision or ("bf16" if device == "cuda" else "fp32")
        group = tp.start(device)
        torch.manual_seed(0)  # the same random weights and prompts on every rank
        target, draft = tp.agreed(group, load_models, args, device, group, paths)
        tree = flags_tree(args, draft)
        tree.check(draft)
        check_lengths(args, tree)
        target.set_exact(args.exact, tree.total_tokens)
        if args.tune_tree:  # refused now, not after the other measurements, if its grid cannot run here
            calibration, calibration_text = tp.agreed(group, calibration_prompts, args, target)
            check_tune_fits([TreeConfig(*point) for point in draft.tree_grid() or TREE_GRID], calibration, CALIBRATION_TOKENS,
                            target.max_seq_length, draft.vocab_size)
        vocab, head = draft_vocab_used(args, target, draft), head_name(args, draft)
        print(f"head: {head}; draft vocabulary: {vocab['text']}", flush=True)
        quantization = getattr(target, "quantization", None)
        compile_settings(target, device)
        if args.hf and quantization:
            raise EagletError("--hf runs transformers on the same weights, which it cannot read quantized: "
                              "bench the bf16 model.pth for that row")
        prompt, prompt_text = tp.agreed(group, side_prompt, args)
        if not torchrun_rank():
            make_out_folder(paths)
        copy_bw = copy_bandwidth(device)
        name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
        results = {"setup": {"model": args.model or str(args.checkpoint_path), "device_name": name,
                             "precision": args.precision, "compile": args.compile, "exact": args.exact, "tree": asdict(tree),
                             "weights": weights_format(target), "draft_weights": weights_format(draft),
                             "head": head, "draft_vocab": vocab, "side_by_side_prompt": prompt_text,
                             "side_tokens": args.side_tokens,
                             "command": launcher(group) + " ".join(sys.argv if argv is None else ["bench.py", *argv]),
                             "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                             "copy_GB_per_s": copy_bw / 1e9}}
        print(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s; timing plain decoding", flush=True)
        results["plain"] = bench_plain(target, args.compile, copy_bw, args.repeats)
        print("timing one EAGLE-2 cycle, phase by phase", flush=True)
        step_s = results["plain"]["step_ms"] / 1e3
        results["cycle"] = bench_cycle(target, draft, tree, args.compile, args.repeats, step_s, copy_bw)
        step_fns = {"plain": compile_step(decode_one_token, device) if args.compile else decode_one_token,
                    "spec": compile_step(speculative_cycle, device) if args.compile else speculative_cycle}
        print(f"side by side on the same weights: {prompt_text}", flush=True)
        results["side_by_side"] = side_by_side(target, draft, tree, step_fns, args.side_tokens, args.hf, prompt)
        results["outside_the_graph"] = outside_the_graph(results)
        results["host_loop_us"] = loop_host_us(tree.levels)
        if args.tune_tree:
            print("tuning the tree as generate.py --tree auto does, then both trees end to end", flush=True)
            results["setup"]["calibration_prompts"] = calibration_text
            results["tuned_tree"] = tuned_tree(target, draft, tree, calibration, prompt, args.side_tokens,
                                               args.compile, group)
        if args.eval:
            tokenizer = tp.agreed(group, Tokenizer, args.tokenizer or args.checkpoint_path.parent)
            print(f"chat template: {tokenizer.chat_template_source}")
            results["setup"]["chat_template"] = tokenizer.chat_template_source
            print(f"evaluating on {args.eval}", flush=True)
            tasks = tp.agreed(group, load_questions, args.eval, args.questions)
            results["eval"] = run_eval(target, draft, tree, tokenizer, tasks, args.max_new_tokens, step_fns)
        if args.batch_sizes:
            prompts, described = tp.agreed(group, batch_prompts, args, target, max(args.batch_sizes))
            results["setup"]["batch_prompts"] = described
            results["batches"] = batch_sweep(target, draft, tree, args.batch_sizes, prompts, args.side_tokens,
                                             args.compile)
        if args.cache_sizes:
            print(f"timing a plain step in caches of {args.cache_sizes} slots, eager and compiled", flush=True)
            results["cache_sizes"] = cache_size_sweep(target, args.cache_sizes, args.repeats)
        results["limit"] = limits(results, copy_bw)
        if group is not None:
            results["tensor_parallel"] = tensor_parallel(target, draft, tree, group)
        if not torchrun_rank():
            write_output(paths[0], json.dumps(results, indent=2))
            write_output(paths[1], markdown(results))
            print(markdown(results))
            print(f"wrote {paths[0]} and {paths[1]}")
    except EagletError as e:
        status = f"error: {e}" if not torchrun_rank() else 1
    if torchrun_rank() is not None:
        tp.finish(group, status)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
