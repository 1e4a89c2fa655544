"""Count token frequencies over text with the target's tokenizer and write the N most frequent token ids:
a smaller draft vocabulary for an EAGLE-1/2 head (FR-Spec). The draft then scores only these tokens, so
the lm_head it reads per tree level shrinks by vocabulary / N; the target still verifies over its whole
vocabulary, so the output is unchanged (lossless). generate.py picks up draft_vocab.json beside the head.

    python scripts/draft_vocab.py --tokenizer checkpoints/meta-llama/Meta-Llama-3-8B-Instruct \\
        --data ../shared/data/prompts my_corpus.txt --size 32000 \\
        --out checkpoints/yuhuili/EAGLE-LLaMA3-Instruct-8B/draft_vocab.json

--data takes text files, FastChat question files (.jsonl: turns and references are counted) and folders
(every file under them). The EOS tokens are always kept.
"""
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli import cli_parser, int_flag  # noqa: E402
from model import EagletError  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def texts_of(path: Path):
    """The texts in one file: a FastChat .jsonl gives its turns and references, anything else its content."""
    try:
        content = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise EagletError(f"cannot read {path}: {e.strerror}")
    if path.suffix != ".jsonl":
        yield content
        return
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise EagletError(f"{path}:{n} is not JSON: {e}")
        if not isinstance(record, dict):
            raise EagletError(f"{path}:{n} is not a JSON object (a question with turns)")
        for key in ("turns", "reference"):
            value = record.get(key) or []
            yield from (value if isinstance(value, list) else [value])


def is_text(path: Path) -> bool:
    """No NUL byte in its first 8 KB: text in any 8-bit encoding or UTF-8, not a binary file."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def data_files(paths: list, log=print) -> list:
    """The files named and the text files under the folders named (binary ones there are skipped, and counted)."""
    files, skipped = [], 0
    for p in map(Path, paths):
        try:
            if p.is_dir():
                found = sorted(f for f in p.rglob("*") if f.is_file())
                text = [f for f in found if is_text(f)]
                files, skipped = files + text, skipped + len(found) - len(text)
            elif p.is_file():
                if not is_text(p):
                    raise EagletError(f"{p} is not a text file (it holds NUL bytes)")
                files.append(p)
            else:
                raise EagletError(f"no such file or folder: {p}")
        except OSError as e:
            raise EagletError(f"cannot read {e.filename or p}: {e.strerror}")
    if skipped:
        log(f"skipped {skipped} files under the folders that are not text")
    if not files:
        raise EagletError("--data holds no text files")
    return files


def count_tokens(tokenizer: Tokenizer, files: list, log=print) -> Counter:
    counts = Counter()
    for i, f in enumerate(files, 1):
        for text in texts_of(f):
            if isinstance(text, str):
                counts.update(tokenizer.encode(text, bos=False))
        if i % 50 == 0 or i == len(files):
            log(f"counted {i}/{len(files)} files, {sum(counts.values())} tokens, {len(counts)} distinct")
    return counts


def most_frequent(counts: Counter, size: int, always: set) -> list:
    kept = sorted(always)
    kept += [t for t, _ in counts.most_common() if t not in always][:max(size - len(kept), 0)]
    return kept


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="the target's checkpoint folder, or its tokenizer.json / tokenizer.model")
    p.add_argument("--data", nargs="+", required=True, help="text files, FastChat .jsonl files, folders")
    p.add_argument("--size", type=int_flag(1), default=32000, help="tokens to keep")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write, e.g. HEAD_DIR/draft_vocab.json")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = p.parse_args(argv)
    if args.out.exists() and not args.overwrite:
        p.error(f"{args.out} exists (--overwrite replaces it)")
    if not args.out.parent.is_dir():
        p.error(f"cannot write {args.out}: no folder {args.out.parent}")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        tokenizer = Tokenizer(args.tokenizer)
        counts = count_tokens(tokenizer, data_files(args.data))
        if not counts:
            raise EagletError("--data holds no text to count (.jsonl files give their questions' turns and "
                              "references)")
        token_ids = most_frequent(counts, min(args.size, tokenizer.vocab_size), tokenizer.eos_ids)
        covered = sum(counts[t] for t in token_ids) / max(sum(counts.values()), 1)
        args.out.write_text(json.dumps({"token_ids": token_ids, "vocab_size": tokenizer.vocab_size,
                                        "counted_tokens": sum(counts.values()), "coverage": round(covered, 6),
                                        "data": [str(d) for d in args.data]}) + "\n")
    except EagletError as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        sys.exit(f"error: cannot write {args.out}: {e.strerror}")
    print(f"wrote {args.out}: {len(token_ids)} of {tokenizer.vocab_size} tokens, covering {covered:.2%} "
          "of the counted text")


if __name__ == "__main__":
    main()
