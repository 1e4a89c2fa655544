"""train_draft.py's data and self-distillation: text files and FastChat question files read and tokenised into
(tokens, loss mask) examples, the target's own replies written once and kept in OUT_DIR/self_distill.jsonl with a
record of what wrote them (reused by a rerun with the same ones, resumed after an interruption), and the
shuffled batches the training loop takes.

Imports decode.py (SamplingConfig), checkpoint.py, tokenizer.py and cli.py; train_draft.py and bench.py
(read_questions) import it.
"""
import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from cli import Progress
from sampling import SamplingConfig
from checkpoint import EagletError
from tokenizer import Tokenizer


def chat_example(tokenizer: Tokenizer, turns: list, replies: list) -> tuple:
    """Tokens of a conversation and a mask that is 1 on the assistant's tokens only."""
    messages, tokens, mask = [], [], []
    for user, reply in zip(turns, replies):
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.encode_chat(messages)
        messages.append({"role": "assistant", "content": reply})
        full = tokenizer.encode_chat(messages[:-1]) + tokenizer.encode(reply, bos=False) + sorted(tokenizer.eos_ids)[:1]
        mask += [0] * (len(prompt) - len(tokens)) + [1] * (len(full) - len(prompt))
        tokens = full
    return tokens, mask


def read_utf8(path: Path) -> str:
    """A data file's text; one not in UTF-8 is a mistake to say, not text to train on with its bytes replaced."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EagletError(f"{path} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})")
    except OSError as e:
        raise EagletError(f"cannot read {path}: {e.strerror or e}")


def read_questions(path: Path) -> list:
    """A FastChat question file: one JSON object per line, each with a list of "turns" (user messages)."""
    questions = []
    for n, line in enumerate(read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            question = json.loads(line)
        except json.JSONDecodeError as e:
            raise EagletError(f"{path} line {n} is not JSON: {e}")
        turns = question.get("turns") if isinstance(question, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise EagletError(f"{path} line {n}: expected an object with \"turns\", a list of strings")
        questions.append(question)
    return questions


@dataclass
class DataItem:
    """One training example to be: a FastChat question (its user turns, and the file's replies if any) or a
    piece of a text file (its tokens)."""
    source: Path
    turns: Optional[list] = None
    references: Optional[list] = None
    question_id: object = None
    tokens: Optional[list] = None


def read_items(paths, tokenizer: Tokenizer, seq_len: int) -> list:
    """The data's questions and its text cut into pieces of seq_len tokens, file by file, in order."""
    items = []
    for path in map(Path, paths):
        if not path.is_file():
            raise EagletError(f"data file not found: {path}")
        if path.suffix == ".jsonl":
            items += [DataItem(path, turns=q["turns"], references=q.get("reference"), question_id=q.get("question_id"))
                      for q in read_questions(path)]
        else:
            tokens = tokenizer.encode(read_utf8(path), bos=False)
            items += [DataItem(path, tokens=tokens[start:start + seq_len])
                      for start in range(0, max(len(tokens) - 1, 1), seq_len)]
    return items


def target_replies(item: DataItem, tokenizer: Tokenizer, reply_fn) -> list:
    """What the target writes for an item: its reply to each turn of a question (having seen its own earlier
    replies), or the continuation of a text piece's first half. reply_fn: prompt tokens -> text."""
    if item.turns is None:
        first_half = item.tokens[:len(item.tokens) // 2]
        return [reply_fn(first_half) if first_half else ""]
    replies, messages = [], []
    for user in item.turns:
        messages.append({"role": "user", "content": user})
        replies.append(reply_fn(tokenizer.encode_chat(messages)))
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def make_example(item: DataItem, tokenizer: Tokenizer, seq_len: int, replies=None):
    """(tokens, loss mask) of at most seq_len tokens, with the file's replies or the target's (replies, from
    target_replies); None for a text piece too short to learn from."""
    if item.turns is None:
        tokens = item.tokens
        if replies is not None:  # the first half kept, the target's continuation after it
            tokens = (tokens[:len(tokens) // 2] + tokenizer.encode(replies[0], bos=False))[:seq_len]
        return (tokens, [1] * len(tokens)) if len(tokens) > 1 else None
    replies = item.references if replies is None else replies
    if not replies:
        raise EagletError(f"{item.source}: question {item.question_id} has no replies; "
                          "use --self_distill to let the target write them")
    tokens, mask = chat_example(tokenizer, item.turns, replies)
    return tokens[:seq_len], mask[:seq_len]


def examples_of(items: list, tokenizer: Tokenizer, seq_len: int, replies=None) -> list:
    """(tokens, loss mask) pairs of the items, with the files' replies or, if given, the target's (a list per item)."""
    examples = [make_example(item, tokenizer, seq_len, None if replies is None else replies[i])
                for i, item in enumerate(items)]
    examples = [e for e in examples if e is not None]
    if not examples:
        raise EagletError("no training examples in the data")
    return examples


def load_examples(paths, tokenizer: Tokenizer, seq_len: int) -> list:
    """(tokens, loss mask) pairs of at most seq_len tokens from text files and FastChat question files."""
    return examples_of(read_items(paths, tokenizer, seq_len), tokenizer, seq_len)


# Self-distillation's replies are kept beside the head: OUT_DIR/self_distill.jsonl, a header line (what wrote
# the replies: SELF_DISTILL_FORMAT, the record of what decides them, where the files were) and then one line per
# example, {"item": i, "replies": [...]} (i counts the data's questions and text pieces in order). It is written
# as self_distill.partial.jsonl, a line per example as the target finishes it (an interrupted run resumes there),
# and renamed once complete: a file under the final name is always whole.
SELF_DISTILL_FILE, SELF_DISTILL_PARTIAL = "self_distill.jsonl", "self_distill.partial.jsonl"
SELF_DISTILL_FORMAT = 1  # bump when the way the replies are written changes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja",
                   "chat_template.json", "config.json", "generation_config.json")  # config files: the EOS ids


def file_identity(path: Path) -> dict:
    """A large file as a record names it: its name, size and modification time (a file moved elsewhere is
    the same file; a rewritten one is not)."""
    stat = path.stat()
    return {"name": path.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def self_distill_record(checkpoint_path: Path, data_paths, tokenizer: Tokenizer, seq_len: int, max_new_tokens: int,
                        sampling: SamplingConfig, precision: str, device: str) -> dict:
    """Everything that decides the target's replies: the target, its tokenizer files and chat template, the data
    files, and the settings the replies are written with (seq_len cuts prompts and text pieces)."""
    folder = Path(checkpoint_path).parent
    return {"target": file_identity(Path(checkpoint_path)),
            "tokenizer_files": {n: sha256((folder / n).read_bytes()) for n in TOKENIZER_FILES
                                if (folder / n).is_file()},
            "chat_template_sha256": sha256(tokenizer.chat_template.encode("utf-8", "surrogatepass")),
            "eos_ids": sorted(tokenizer.eos_ids), "data": [file_identity(Path(p)) for p in data_paths],
            "seq_len": seq_len, "max_new_tokens": max_new_tokens, "sampling": asdict(sampling),
            "precision": precision, "device": device}


def flatten(value, prefix: str = "") -> dict:
    """{"a": {"b": [1]}} -> {"a.b.0": 1}: the record's leaves, for naming what differs."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}{i}.").items()}
    return {prefix[:-1]: value}


def record_differences(theirs: dict, ours: dict) -> list:
    """What differs between two records, as 'key: theirs -> ours'."""
    theirs, ours = flatten(theirs), flatten(ours)
    return [f"{k}: {theirs.get(k, 'none')} -> {ours.get(k, 'none')}" for k in dict.fromkeys([*ours, *theirs])
            if theirs.get(k) != ours.get(k)]


def json_or_none(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


@dataclass
class DistilledFile:
    header: dict
    replies: dict  # item -> its replies, as far as the file's lines are whole


def read_distilled(path: Path, header_only: bool = False) -> Optional[DistilledFile]:
    """A self-distillation file (None if there is none). Anything else under its name is refused, never
    replaced. Lines are read up to the first one that is not whole (an interrupted write)."""
    if not path.exists():
        return None
    not_ours = EagletError(f"{path} is not a self-distillation file written by train_draft.py; it is left as it "
                           "is: move it away, or give another --out_dir")
    if not path.is_file():
        raise not_ours
    replies = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:  # ours are ASCII (json.dumps escapes the rest)
            header = json_or_none(f.readline())
            if not (isinstance(header, dict) and "eaglet_self_distill" in header):
                raise not_ours
            for line in [] if header_only else f:
                entry = json_or_none(line) if line.endswith("\n") else None
                if not (isinstance(entry, dict) and isinstance(entry.get("item"), int) and isinstance(
                        entry.get("replies"), list) and all(isinstance(r, str) for r in entry["replies"])):
                    break
                replies[entry["item"]] = entry["replies"]
    except OSError as e:
        raise EagletError(f"cannot read {path}: {e.strerror or e}")
    return DistilledFile(header, replies)


def distilled_mismatch(found: DistilledFile, header: dict, complete: bool) -> str:
    """Why a self-distillation file cannot serve this run ('' if it can): another format, another record
    (naming what differs), or, if it must be complete, examples missing."""
    if found.header.get("eaglet_self_distill") != header["eaglet_self_distill"]:
        return f"it was written by another version of train_draft.py (format {found.header.get('eaglet_self_distill')})"
    differ = record_differences(found.header.get("record"), header["record"])
    if differ:
        return f"it was written with other inputs or settings ({'; '.join(differ[:3])}" + \
            (f"; {len(differ) - 3} more)" if len(differ) > 3 else ")")
    n = header["examples"]
    if any(not 0 <= i < n for i in found.replies) or (complete and len(found.replies) != n):
        return f"it holds {len(found.replies)} of the {n} examples"
    return ""


def write_lines(path: Path, lines: list):
    """Write a file whole or not at all: a temporary file beside it, renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def self_distill_paths(checkpoint_path: Path, data_paths, tokenizer: Tokenizer) -> dict:
    """Where the record's files were, for a reader of the header; not compared (moving a file changes nothing)."""
    return {"target": str(Path(checkpoint_path).resolve()), "data": [str(Path(p).resolve()) for p in data_paths],
            "chat_template": tokenizer.chat_template_source}


def self_distilled_replies(items: list, out_dir: Path, record: dict, write_replies, log=print,
                           paths: Optional[dict] = None) -> list:
    """The target's replies for every item (write_replies: item -> replies): reused from out_dir/self_distill.jsonl
    if it was written with this record, else written now, resuming self_distill.partial.jsonl if that was."""
    final, partial = out_dir / SELF_DISTILL_FILE, out_dir / SELF_DISTILL_PARTIAL
    header = {"eaglet_self_distill": SELF_DISTILL_FORMAT, "record": record, "paths": paths or {},
              "examples": len(items)}
    found = read_distilled(final)
    if found is not None:
        why = distilled_mismatch(found, header, complete=True)
        if not why:
            log(f"self-distillation: reusing the target's replies to all {len(items)} examples from {final}, written "
                "with this target, tokenizer, data and settings (delete it to have the target write them again)")
            return [found.replies[i] for i in range(len(items))]
        log(f"self-distillation: not reusing {final}: {why}; the target writes the replies again")
    found, done = read_distilled(partial), {}
    if found is not None:
        why = distilled_mismatch(found, header, complete=False)
        if why:
            log(f"self-distillation: starting over, not resuming {partial}: {why}")
        else:
            done = found.replies
            log(f"self-distillation: resuming at {len(done)}/{len(items)} examples from {partial}")
    try:
        write_lines(partial, [json.dumps(header)] + [json.dumps({"item": i, "replies": done[i]}) for i in sorted(done)])
        with open(partial, "a", encoding="utf-8") as f, \
                Progress("self-distilling", len(items), "examples", start=len(done), log=log) as progress:
            for i, item in enumerate(items):
                if i not in done:
                    done[i] = write_replies(item)
                    f.write(json.dumps({"item": i, "replies": done[i]}) + "\n")
                    f.flush()  # a line per example: an interruption loses at most the one being written
                    progress.update(len(done), item.source.name)
            os.fsync(f.fileno())
        os.replace(partial, final)
    except OSError as e:
        raise EagletError(f"cannot write {partial}: {e.strerror or e}")
    except KeyboardInterrupt:
        log(f"self-distillation stopped at {len(done)}/{len(items)} examples, kept in {partial}: "
            "the same command resumes there")
        raise
    log(f"self-distillation: wrote {final}; a run with the same target, tokenizer, data and settings reuses it")
    return [done[i] for i in range(len(items))]


def check_distill_files(out_dir: Path):
    """Before any long work: refuse an out_dir holding, under the self-distillation files' names, files that
    are not ours."""
    for name in (SELF_DISTILL_FILE, SELF_DISTILL_PARTIAL):
        read_distilled(out_dir / name, header_only=True)


def batches(examples: list, batch_size: int, seq_len: int, pad_id: int, seed: int):
    """Endless shuffled batches: tokens [B, seq_len] and loss mask [B, seq_len] (0 on padding).
    With fewer examples than batch_size, a batch holds each example once."""
    rng = random.Random(seed)
    batch_size = min(batch_size, len(examples))
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            tokens = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
            mask = torch.zeros(batch_size, seq_len)
            for row, j in enumerate(order[i:i + batch_size]):
                t, m = examples[j]
                tokens[row, :len(t)], mask[row, :len(m)] = torch.tensor(t), torch.tensor(m, dtype=torch.float)
            yield tokens, mask
