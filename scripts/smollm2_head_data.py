"""Split the shared FastChat question files into the training and held-out sets of the SmolLM2-135M-Instruct
head in heads/smollm2-135m-instruct-eagle (see its README.md).

    python scripts/smollm2_head_data.py --prompts ../shared/data/prompts --tokenizer /tmp/smol-bf16 --out /tmp/smol-data

Writes OUT/train_extra.jsonl: from the first half of gsm8k, humaneval and mt_bench, the first PER_FILE questions
whose first turn fits in MAX_PROMPT chat tokens, first turn only (so that the reply fits in --seq_len); the
training data is alpaca.jsonl, qa.jsonl and this file. sum.jsonl is left out: its articles are longer than
--seq_len, which would leave no reply to learn from. OUT/heldout/{gsm8k,humaneval,mt_bench}.jsonl: the second
half of each file, all turns, never trained on.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoint import EagletError  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

HELD_OUT = ("gsm8k", "humaneval", "mt_bench")
PER_FILE = 25
MAX_PROMPT = 128


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True, help="folder of the shared FastChat question files")
    p.add_argument("--tokenizer", type=Path, required=True, help="the converted SmolLM2 folder")
    p.add_argument("--out", type=Path, required=True)
    p.error = lambda message: sys.exit(f"error: {message}")  # one line, as every eaglet tool says a mistake
    args = p.parse_args()
    files = [args.prompts / f"{name}.jsonl" for name in HELD_OUT]
    if missing := [str(f) for f in files if not f.is_file()]:
        p.error(f"--prompts: no {', '.join(missing)}")
    written = [args.out / "train_extra.jsonl"] + [args.out / "heldout" / f.name for f in files]
    if existing := [str(f) for f in written if f.exists()]:
        p.error(f"--out already holds {', '.join(existing)}: give a new folder")
    try:
        tokenizer = Tokenizer(args.tokenizer)
    except EagletError as e:
        p.error(str(e))
    (args.out / "heldout").mkdir(parents=True, exist_ok=True)
    extra = []
    for name in HELD_OUT:
        lines = (args.prompts / f"{name}.jsonl").read_text().splitlines()
        questions = [json.loads(line) for line in lines if line.strip()]
        half = len(questions) // 2
        fits = [q for q in questions[:half]
                if len(tokenizer.encode_chat([{"role": "user", "content": q["turns"][0]}])) <= MAX_PROMPT]
        extra += [{**q, "turns": q["turns"][:1], "source": name} for q in fits[:PER_FILE]]
        (args.out / "heldout" / f"{name}.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions[half:]))
        print(f"{name}: {len(fits[:PER_FILE])} of the first {half} for training, the last {len(questions) - half} held out")
    for q in extra:
        q.pop("reference", None)  # the target writes the replies (--self_distill)
    (args.out / "train_extra.jsonl").write_text("".join(json.dumps(q) + "\n" for q in extra))
    print(f"wrote {args.out / 'train_extra.jsonl'} ({len(extra)} questions) and {args.out / 'heldout'}")


if __name__ == "__main__":
    main()
