"""tau of the demo's heads over tree shapes, on the held-out modules the demo never trained on (make_demo's
prompts: 40 x 64 tokens, greedy and temperature 1, greedy output checked against plain): a DFlash head's chain
against its trees at equal verify size, beside the EAGLE heads.

    python scripts/experiments/tree_shapes_tau.py --heads demo/dflash demo/head --trees 6/1/8 6/2/8 6/4/8 6/4/32 6/10/60
"""
import json
import sys
from argparse import ArgumentTypeError
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: make_demo
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cli import cli_parser, int_flag  # noqa: E402


def tree_flag(text: str) -> tuple:
    try:
        depth, topk, total = (int(v) for v in text.split("/"))
    except ValueError:
        raise ArgumentTypeError(f"a tree is depth/top-k/total_tokens like 6/1/8, got {text!r}")
    return depth, topk, total


def main(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--heads", nargs="+", type=Path, required=True, help="head folders (with draft.pth) of the demo target")
    p.add_argument("--trees", nargs="+", type=tree_flag, required=True, help="depth/top-k/total_tokens each")
    p.add_argument("--demo", type=Path, default=Path(__file__).resolve().parents[2] / "demo", help="the demo folder")
    p.add_argument("--prompts", type=int_flag(1), default=40, help="held-out prompts")
    args = p.parse_args(argv)
    import make_demo
    from decode import TreeConfig
    from model import EagletError
    rows = []
    try:
        for head in args.heads:
            for depth, topk, total in args.trees:
                tau = make_demo.measure_tau(args.demo / "target", head, args.prompts, tree=TreeConfig(depth, topk, total))
                rows.append({"head": str(head), "tree": f"{depth}/{topk}/{total}", **tau})
                print(json.dumps(rows[-1]), flush=True)
    except EagletError as e:
        sys.exit(f"error: {e}")
    print("\n| head | tree (depth/top-k/tokens) | greedy tau | temperature 1 tau | greedy: a draft accepted at depth "
          "1, 2, ... (share of cycles) | greedy == plain |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        depths = " ".join(f"{a:.2f}" for a in r["greedy"]["accepted_by_depth"])
        print(f"| {r['head']} | {r['tree']} | {r['greedy']['tau']:.2f} | {r['temperature_1']['tau']:.2f} | {depths} | "
              f"{r['greedy']['greedy_mismatches'] == 0} |")


if __name__ == "__main__":
    main()
