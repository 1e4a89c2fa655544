"""The demo in every weight format: how far quantization moves the demo target, and the tau its heads keep.

    python scripts/quantize_demo.py                       # 40 held-out prompts x 64 tokens, tree 60/6/10
    python scripts/quantize_demo.py --prompts 8 --formats int8,int4.g128

Quantizes demo/target (and demo/head to int8) into a temporary folder with quantize.py (the shipped demo is
not touched), then for each format: greedy agreement with the unquantized (bf16) target (the tokens each prompt's
greedy output shares with the unquantized one before they first differ, as a share of all tokens, and the
prompts whose output is identical), greedy tau of demo/head, of demo/head quantized to int8 and of
demo/head3, each checked token for token against plain decoding of the same quantized target. Prints a
markdown table.
"""
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli import cli_parser, int_flag  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "demo"
FORMATS = ("bf16", "int8", "int4.g32", "int4.g64", "int4.g128")


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--prompts", type=int_flag(1, 100), default=40, help="held-out prompts")
    p.add_argument("--max_new_tokens", type=int_flag(1, 512), default=64, help="tokens per prompt")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    args = p.parse_args(argv)
    args.formats = args.formats.split(",")
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        p.error(f"unknown format {unknown[0]!r}; known: {', '.join(FORMATS)}")
    return args


if __name__ == "__main__":
    parse_args()

import torch  # noqa: E402

from decode import TreeConfig, generate  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from load import load_draft, load_target  # noqa: E402
from make_demo import held_out_prompts  # noqa: E402
from model import EagletError  # noqa: E402
from quantize import quantize_checkpoint  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

GREEDY = SamplingConfig()


def agreement(reference: list, outputs: list) -> tuple:
    """(tokens shared before the first difference / all tokens, prompts with identical output)."""
    shared = identical = total = 0
    for want, got in zip(reference, outputs):
        n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        shared, total = shared + n, total + len(want)
        identical += want == got
    return shared / total, identical


def run_format(target_path: Path, heads: dict, prompts: list, max_new_tokens: int) -> dict:
    tree = TreeConfig()
    model = load_target(target_path, "cpu", "fp32", 49 + max_new_tokens + tree.scratch)
    plain = [generate(model, p, max_new_tokens, GREEDY).tokens for p in prompts]
    row = {"plain": plain}
    for name, head_path in heads.items():
        draft = load_draft(head_path, model)
        lengths, mismatches = [], 0
        for prompt, want in zip(prompts, plain):
            result = generate(model, prompt, max_new_tokens, GREEDY, draft=draft, tree=tree)
            lengths += result.accept_lengths
            mismatches += result.tokens != want
        row[name] = {"tau": sum(lengths) / len(lengths), "mismatches": mismatches}
    return row


def main(argv=None):
    args = parse_args(argv)
    try:
        prompts = held_out_prompts(Tokenizer(DEMO / "target"), args.prompts)
        if not prompts:
            raise EagletError("this interpreter's standard library lacks the held-out modules")
        rows = {}
        with tempfile.TemporaryDirectory(prefix="eaglet-quantize-demo-") as tmp:
            demo = Path(tmp) / "demo"
            shutil.copytree(DEMO, demo)
            heads = {"head": demo / "head" / "draft.pth",
                     "head int8": quantize_checkpoint(demo / "head" / "draft.pth", "int8", log=lambda s: None),
                     "head3": demo / "head3" / "draft.pth"}
            for fmt in args.formats:
                t0 = time.perf_counter()
                mode, _, group = fmt.partition(".g")
                path = demo / "target" / "model.pth" if fmt == "bf16" else \
                    quantize_checkpoint(demo / "target" / "model.pth", mode, int(group or 128), log=lambda s: None)
                rows[fmt] = run_format(path, heads, prompts, args.max_new_tokens)
                print(f"{fmt}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    except EagletError as e:
        sys.exit(f"error: {e}")
    reference = rows.get("bf16", next(iter(rows.values())))["plain"]
    print(f"{len(prompts)} held-out prompts x {args.max_new_tokens} tokens, greedy, tree 60/6/10, fp32 activations\n")
    print("| target | agreement with bf16 (tokens before the first difference) | identical outputs | "
          "tau demo/head | tau demo/head int8 | tau demo/head3 | speculative != plain |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fmt, row in rows.items():
        share, identical = agreement(reference, row["plain"])
        mismatches = sum(row[h]["mismatches"] for h in ("head", "head int8", "head3"))
        print(f"| {fmt} | {100 * share:.1f}% | {identical}/{len(prompts)} | {row['head']['tau']:.2f} | "
              f"{row['head int8']['tau']:.2f} | {row['head3']['tau']:.2f} | {mismatches} |")


if __name__ == "__main__":
    main()
