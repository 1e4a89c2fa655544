"""tau of an EAGLE-1/2 head over draft vocabularies of several sizes, greedy, on held-out questions, each run's
tokens checked against plain decoding; with the bytes each vocabulary's lm_head rows cost a draft pass on
LLaMA-3-8B's shape (128,256 x 4,096 in bf16). How generate.py's default draft vocabulary was chosen.

    python scripts/draft_vocab_tau.py --checkpoint_path checkpoints/smollm2 \\
        --draft_checkpoint_path heads/smollm2-135m-instruct-eagle --vocabs full ids:8192 ids:16384 ids:32768 \\
        heads/smollm2-135m-instruct-eagle/draft_vocab.json --questions ../shared/data/prompts/gsm8k.jsonl:45-48

A vocabulary is `full`, `ids:N` (the N lowest token ids with the EOS tokens: the default's rule, see
head_formats.default_draft_vocab) or a file written by scripts/draft_vocab.py.
"""
import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli import cli_parser, int_flag  # noqa: E402

LLAMA3_DIM, LLAMA3_VOCAB = 4096, 128256


def questions_of(spec: str) -> list:
    """FILE:A-B: the first turns of questions A..B (0-based, inclusive) of a FastChat .jsonl file; a mistake in the
    spec or the file is a ValueError naming it."""
    path, _, span = spec.rpartition(":")
    first, _, last = span.partition("-")
    if not (first.isdigit() and last.isdigit() and int(first) <= int(last)):
        raise ValueError(f"--questions {spec}: give FILE:A-B, question numbers A <= B")
    try:
        lines = Path(path).read_text().splitlines()[int(first):int(last) + 1]
        questions = [json.loads(line)["turns"][0] for line in lines]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"--questions {spec}: cannot read its questions ({e})")
    if not questions:
        raise ValueError(f"--questions {spec}: {path} has no questions {first}-{last}")
    return questions


def check_vocab(spec: str) -> str:
    """--vocabs' word: full, ids:N (N > 0) or an existing draft_vocab.json."""
    if spec == "full" or (spec.startswith("ids:") and spec[4:].isdigit() and int(spec[4:]) > 0) or Path(spec).is_file():
        return spec
    raise argparse.ArgumentTypeError(f"{spec!r} is neither full, ids:N nor a draft_vocab.json file")


def main(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", type=Path, required=True)
    p.add_argument("--draft_checkpoint_path", type=Path, required=True)
    p.add_argument("--vocabs", nargs="+", type=check_vocab, required=True,
                   help="full, ids:N or a draft_vocab.json file, each")
    p.add_argument("--questions", nargs="+", required=True, help="FILE:A-B, first turns of questions A..B")
    p.add_argument("--tree", default="5/3/16", help="depth/top-k/total_tokens")
    p.add_argument("--max_new_tokens", type=int_flag(1), default=64)
    args = p.parse_args(argv)
    try:
        questions = [q for spec in args.questions for q in questions_of(spec)]
    except ValueError as e:
        p.error(str(e))
    if not re.fullmatch(r"\d+/\d+/\d+", args.tree):
        p.error(f"--tree {args.tree}: give depth/top-k/total_tokens, e.g. 5/3/16")
    from decode import TreeConfig, generate
    from sampling import SamplingConfig
    from load import load_draft, load_target
    from head_formats import default_draft_vocab
    from model import EagletError
    from tokenizer import Tokenizer
    try:
        model = load_target(args.checkpoint_path, "cpu", "fp32", 1024)
        tokenizer = Tokenizer(args.checkpoint_path)
        prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
        greedy = SamplingConfig(temperature=0.0)
        tree = TreeConfig(*(int(v) for v in args.tree.split("/")))
        plain = [generate(model, p, args.max_new_tokens, greedy, tokenizer.eos_ids).tokens for p in prompts]
        rows = []
        for vocab in args.vocabs:
            if vocab.startswith("ids:"):
                path = Path("/tmp") / f"draft_vocab_ids_{vocab[4:]}.json"
                ids = default_draft_vocab(model.args.vocab_size, tokenizer.eos_ids, int(vocab[4:]))
                path.write_text(json.dumps({"token_ids": ids.tolist()}))
            else:
                path = vocab
            draft = load_draft(args.draft_checkpoint_path, model, draft_vocab=path)
            n_tokens = draft.vocab_size
            lengths, same = [], 0
            for prompt, reference in zip(prompts, plain):
                run = generate(model, prompt, args.max_new_tokens, greedy, tokenizer.eos_ids, draft=draft,
                               tree=tree)
                lengths += run.accept_lengths
                same += run.tokens == reference
            rows.append({"vocab": vocab, "tokens": n_tokens, "tau": sum(lengths) / len(lengths), "cycles": len(lengths),
                         "same_as_plain": f"{same}/{len(prompts)}",
                         "llama3_8b_lm_head_GB_per_pass": min(n_tokens, LLAMA3_VOCAB) * LLAMA3_DIM * 2 / 1e9})
            print(json.dumps(rows[-1]), flush=True)
    except EagletError as e:
        sys.exit(f"error: {e}")
    print(f"\n| draft vocabulary | tokens | tau (tree {args.tree}) | cycles | greedy == plain | LLaMA-3-8B lm_head rows "
          "a draft pass reads (GB, bf16) |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['vocab']} | {r['tokens']} | {r['tau']:.3f} | {r['cycles']} | {r['same_as_plain']} | "
              f"{r['llama3_8b_lm_head_GB_per_pass']:.2f} |")


if __name__ == "__main__":
    main()
