"""--exact measured: greedy speculative decoding against plain decoding of the same target, token for token, with and
without --exact, and what --exact costs in tokens/s. Ten everyday chat prompts through the model's chat template
(or as text); speculation never steps aside (--step_aside off), so every token but the plain run's comes from a verify.

    python convert_hf_checkpoint.py --checkpoint_dir heads/smollm2-135m-instruct-eagle      # its head, once
    python scripts/exact_bench.py --checkpoint_path /tmp/smol/model.pth \\
        --head heads/smollm2-135m-instruct-eagle/draft.pth --precision bf16 --out /tmp/exact.md

The table (one row per setting: prompts whose speculative tokens equal plain's, where the others part, tokens/s of
each) is printed and written to --out as each setting finishes.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli import cli_parser, int_flag  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
           "Give me three tips for learning Python.", "What is 17 times 23?", "Tell me a short story about a robot.",
           "How do I boil an egg?", "Why is the sky blue?", "List five fruits that are red.",
           "Summarize the plot of Romeo and Juliet."]


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", type=Path, required=True, help="the target's model.pth (or a quantized file)")
    p.add_argument("--head", type=Path, required=True, help="its converted head (draft.pth)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--max_new_tokens", type=int_flag(1), default=128)
    p.add_argument("--prompts", type=int_flag(1, len(PROMPTS)), default=len(PROMPTS), help="the first N prompts")
    p.add_argument("--no_chat", action="store_true", help="the prompts as plain text (a model without a chat template)")
    p.add_argument("--compile", action="store_true", help="plain steps and cycles compiled (as generate.py --compile)")
    p.add_argument("--out", type=Path, required=True, help="a new markdown file for the table")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"--out {args.out} exists: give a new file")
    return args


def run_setting(model, tokenizer, draft, tree, prompts, args, exact: bool) -> dict:
    """Plain and speculative greedy decoding of every prompt: how many agree, where the others part, tokens/s."""
    from decode import decode_one_token, generate, speculative_cycle
    from graphs import compile_step
    from sampling import SamplingConfig
    model.set_exact(exact, tree.total_tokens)
    plain_fn = compile_step(decode_one_token, args.device) if args.compile else None
    cycle_fn = compile_step(speculative_cycle, args.device) if args.compile else None
    parted, equal, tokens, seconds = [], 0, {"plain": 0, "spec": 0}, {"plain": 0.0, "spec": 0.0}
    for p in prompts:
        plain = generate(model, p, args.max_new_tokens, SamplingConfig(), tokenizer.eos_ids, step_fn=plain_fn)
        spec = generate(model, p, args.max_new_tokens, SamplingConfig(), tokenizer.eos_ids, draft=draft, tree=tree,
                        step_fn=cycle_fn)
        for name, run in (("plain", plain), ("spec", spec)):
            tokens[name] += len(run.tokens) - 1  # after the first (the prefill's)
            seconds[name] += run.seconds - run.first_token_seconds
        first = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b), None)
        same = first is None and len(plain.tokens) == len(spec.tokens)
        if same:
            equal += 1
        else:
            parted.append(first if first is not None else min(len(plain.tokens), len(spec.tokens)))
        print(f"  {'--exact' if exact else 'default'}: {len(plain.tokens)} tokens, "
              + ("the same" if same else f"parted at token {parted[-1]}"), flush=True)
    model.set_exact(False)
    return {"equal": equal, "parted": parted, "plain_tps": tokens["plain"] / seconds["plain"],
            "spec_tps": tokens["spec"] / seconds["spec"]}


def main(argv=None):
    args = parse_args(argv)
    import torch
    from load import load, pick_device
    from measure import git_commit
    args.device = pick_device(args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from checkpoint import EagletError
    try:
        model, tokenizer, draft, _, tree, prompts, _ = load(
            args.checkpoint_path, draft_checkpoint_path=args.head, device=args.device, precision=args.precision,
            prompts=PROMPTS[:args.prompts], chat=not args.no_chat, max_new_tokens=args.max_new_tokens, batch_size=1)
    except EagletError as e:
        sys.exit(f"error: {e}")
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    lines = [f"{name}, {time.strftime('%Y-%m-%d')}, commit {git_commit()}, {args.checkpoint_path.name} in "
             f"{args.precision}, {len(prompts)} {'' if args.no_chat else 'chat '}prompts x {args.max_new_tokens} tokens, greedy, tree {tree.depth}/"
             f"{tree.topk}/{tree.total_tokens}{', compiled' if args.compile else ''}: "
             f"`python scripts/exact_bench.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             "| setting | speculative == plain | the others part at token | plain tokens/s | speculative tokens/s |",
             "| --- | --- | --- | --- | --- |"]
    for exact in (True, False):  # --exact first: a run cut at its time limit keeps its row
        r = run_setting(model, tokenizer, draft, tree, prompts, args, exact)
        lines.append(f"| {'--exact' if exact else 'default'} | {r['equal']} of {len(prompts)} | "
                     f"{', '.join(map(str, r['parted'])) or '-'} | {r['plain_tps']:.1f} | {r['spec_tps']:.1f} |")
        args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
