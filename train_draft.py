"""Train an EAGLE-1/2, EAGLE-3, DFlash, DSpark or DFlash2 draft head for a converted target; save it in the published
format.

    python train_draft.py --checkpoint_path checkpoints/org/model/model.pth --data corpus/*.txt \\
        --out_dir checkpoints/org/model-eagle --steps 2000 [--head eagle3 | dflash | dspark]
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/org/model-eagle   # -> draft.pth

Data: plain text files (every token counts), or FastChat question files (.jsonl with "turns"; only the
assistant's tokens count). --self_distill lets the target write the assistant's replies (and continue
plain text), so the head learns what the target itself says, which raises acceptance. The replies are kept in
OUT_DIR/self_distill.jsonl with a record of what wrote them (the target, its tokenizer and chat template, the
data files, --seq_len, --max_new_tokens, greedy decoding, the precision): a rerun with the same ones (a resumed
run, or other training flags) reuses them instead of running the target again, and an interrupted
self-distillation resumes where it stopped (self_distill.partial.jsonl).
EAGLE-1/2 (--head eagle): the head learns the target's next feature (SmoothL1) and its next-token
distribution (0.1 x cross-entropy against the target's soft predictions), from features with small
uniform noise added.
EAGLE-3 (--head eagle3): the head reads the target's hidden states entering layers 2, L//2, L-3 and
learns only the target's next-token distributions over its draft vocabulary (the --draft_vocab_size
tokens most frequent in the data), unrolled --unroll_steps steps on its own outputs as the draft tree
runs it (the "training-time test"), step j's loss weighted step_decay^j.
DFlash (--head dflash): --draft_layers Qwen3 layers read the target's hidden states entering --feature_layers
(default: one per draft layer, spread through the target); each step trains --anchors blocks per sequence at
once, each a random anchor token followed by --block_size - 1 masks that see only the context before the
anchor and their own block, and predict the target's own next tokens, block position k weighted
exp(-(k - 1) / gamma).
DSpark (--head dspark): DFlash's backbone with every block row drafting (the anchor's too: block_size drafts) and
a rank --markov_rank Markov head: row j's logits plus W2(W1[the token before it]), taught with the target's own
tokens before each row; and a confidence head learning whether each draft (the Markov-corrected argmax) is the
target's. Saved in DeepSpec's layout (Qwen3DSparkModel).
XPress (--head xpress): DFlash's head and recipe and a rank --xpress_rank refiner adding to each row's logits a
bias from the token before it, learned teacher-forced (the target's own picks before each row) and over 3 Jacobi
rounds from the block's own picks, beside a term on the block's own logits; saved in speculators' layout.
DFlash2 (--head dflash2): DFlash's head and loss, a causal convolution inside the block around each sublayer
(identity at the start) and a candidate selector learning, by cross-entropy over each draft's --selector_top_k
best tokens (the target's pick put in the last place where it is missing), which of them the target picks after
the token before it. Saved in vLLM speculators' layout (speculators_model_type dflash2).
"""
# (The docstring above is --help's text.) A tool on top: imports generate.py, draft.py, model.py, quantize.py,
# tokenizer.py, cli.py and convert_hf_checkpoint.py (export_layer); bench.py and scripts/make_demo.py import it.
import hashlib
import json
import math
import os
import random
import sys
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from cli import Progress, cli_parser, float_flag, int_flag


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 0.5
    noise: float = 0.1  # uniform noise on the input features, +-noise x their RMS
    ce_weight: float = 0.1
    seed: int = 0
    save_every: int = 200
    unroll_steps: int = 7  # EAGLE-3: steps of the training-time test
    step_decay: float = 0.8  # EAGLE-3: step j's loss weight is step_decay^j
    draft_vocab_size: int = 0  # EAGLE-3: 0 means 32000, or the whole vocabulary if smaller
    block_size: int = 16  # DFlash: tokens per block, the root and block_size - 1 masks
    draft_layers: int = 1  # DFlash: the head's decoder layers
    anchors: int = 32  # DFlash: blocks trained per sequence, each after a random anchor
    gamma: float = 0.0  # DFlash: block position k's loss weighs exp(-(k - 1) / gamma); 0: 7, or block_size / 2 below 16
    mask_token_id: int = -1  # DFlash: the token the masks are embedded as; -1: the last of the target's vocabulary
    markov_rank: int = 256  # DSpark: the Markov head's rank
    confidence_weight: float = 1.0  # DSpark: the confidence head's loss weight
    selector_rank: int = 256  # DFlash2: the candidate selector's rank
    selector_top_k: int = 16  # DFlash2: the drafts per row the selector rescores
    xpress_rank: int = 256  # XPress: the refiner's rank

    def __post_init__(self):
        at_least = {"steps": 1, "batch_size": 1, "seq_len": 2, "save_every": 1, "warmup": 0, "seed": 0,
                    "weight_decay": 0, "noise": 0, "ce_weight": 0, "unroll_steps": 1, "draft_vocab_size": 0,
                    "block_size": 2, "draft_layers": 1, "anchors": 1, "gamma": 0, "mask_token_id": -1, "markov_rank": 1,
                    "confidence_weight": 0, "selector_rank": 1, "selector_top_k": 1,
                    "xpress_rank": 1}
        bad = [f"{k} must be at least {low}" for k, low in at_least.items() if not getattr(self, k) >= low]
        bad += [f"{k} must be above 0" for k in ("lr", "grad_clip", "step_decay")
                if not 0 < getattr(self, k) < math.inf]
        bad += ["unroll_steps must be below seq_len"] if self.unroll_steps >= self.seq_len else []
        if bad or not all(math.isfinite(v) for v in asdict(self).values()):
            raise EagletError(f"training settings out of range: {', '.join(bad) or 'values must be finite'}")


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", type=Path, required=True, help="the target's model.pth (or its folder)")
    p.add_argument("--data", nargs="+", required=True, help="text files and/or FastChat .jsonl question files")
    p.add_argument("--out_dir", type=Path, required=True, help="where the head (and train_state.pt) go")
    p.add_argument("--self_distill", action="store_true", help="the target writes the replies / continuations")
    p.add_argument("--max_new_tokens", type=int_flag(1), default=256, help="reply length for --self_distill")
    p.add_argument("--no_resume", action="store_true", help="start over even if out_dir has a train_state.pt")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if available")
    p.add_argument("--head", choices=["eagle", "eagle3", "dflash", "dspark", "dflash2", "xpress"], default="eagle",
                   help="EAGLE-1/2, EAGLE-3, DFlash, DSpark, DFlash2 or XPress head")
    p.add_argument("--feature_layers", type=int_flag(1), nargs="+", default=None,
                   help="EAGLE-3 and DFlash (any number): the target layers whose input the head reads "
                        "(EAGLE-3 default: 2, L//2, L-3; L: the last layer's output; DFlash default: one per draft "
                        "layer, spread from the input of layer 2 to that of layer L - 2)")
    helps = {"steps": "optimizer steps", "batch_size": "sequences per step",
             "seq_len": "tokens per sequence: text is cut into pieces this long, conversations truncated",
             "lr": "peak learning rate (AdamW)", "warmup": "steps of linear warm-up; then a cosine decay to 0.1 x lr",
             "weight_decay": "AdamW weight decay", "grad_clip": "gradient norm clipped to this",
             "seed": "seed for the head's initialisation, batch order and noise",
             "noise": "EAGLE-1/2: uniform noise on the input features, +-noise x their RMS",
             "ce_weight": "EAGLE-1/2: weight of the cross-entropy against the target's predictions",
             "save_every": "steps between train_state.pt saves",
             "unroll_steps": "EAGLE-3: steps of the training-time test (the head unrolled on its own outputs)",
             "step_decay": "EAGLE-3: the loss of unrolled step j weighs step_decay^j",
             "draft_vocab_size": "EAGLE-3: the draft vocabulary, the most frequent tokens of the data; "
                                 "0: 32000, or the whole vocabulary if smaller",
             "block_size": "DFlash: tokens per block (the root and block_size - 1 masks); a head decodes with "
                           "blocks of this size or smaller",
             "draft_layers": "DFlash: the head's decoder layers (the published heads have 5)",
             "anchors": "DFlash: blocks trained at once per sequence, each after a random anchor position",
             "gamma": "DFlash: block position k's loss weighs exp(-(k - 1) / gamma); 0: 7 for blocks of 16 or "
                      "more, else block_size / 2 (the paper's 7, 5, 4 for 16, 10, 8)",
             "mask_token_id": "DFlash: the token whose embedding fills the block after the root; -1: the last id "
                              "of the target's vocabulary (use a real model's reserved mask token if it has one)",
             "markov_rank": "DSpark: the rank of the Markov head (W1: vocabulary x rank, W2: rank x vocabulary)",
             "confidence_weight": "DSpark: the confidence head's loss weight (binary cross-entropy)",
             "selector_rank": "DFlash2: the rank of the candidate selector's codebooks",
             "selector_top_k": "DFlash2: the drafts of each row the selector rescores (at most the vocabulary)",
             "xpress_rank": "XPress: the rank of the refiner (its embedding, projections and MLP)"}
    for name, value in asdict(TrainConfig()).items():
        flag = int_flag(0) if isinstance(value, int) else float_flag(0)
        p.add_argument(f"--{name}", type=flag, default=value, help=helps.get(name, name.replace("_", " ")))
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from convert_hf_checkpoint import export_layer  # noqa: E402
from block_draft import DFlash2Draft, DFlashDraft, DSparkDraft, XPressDraft  # noqa: E402
from draft import DraftHead, Eagle3Draft, EagleDraft, head_name  # noqa: E402
from head_formats import dflash_layer_ids, eagle3_feature_layers, head_args, is_dflash_config  # noqa: E402
from decode import SamplingConfig, generate  # noqa: E402
from load import check_writable, load_target, pick_device  # noqa: E402
from checkpoint import EagletError, converted_file, mismatch_detail, read_config  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from quantize import Int8Linear  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


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


def read_questions(path: Path) -> list:
    """A FastChat question file: one JSON object per line, each with a list of "turns" (user messages)."""
    questions = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
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
            tokens = tokenizer.encode(path.read_text(errors="replace"), bos=False)
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


def causal(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def head_loss(head: EagleDraft, target: Transformer, tokens, mask, cfg: TrainConfig):
    """EAGLE's loss on a batch: pairs (f_t, x_{t+1}) predict f_{t+1} and the target's p(x_{t+2})."""
    seq = tokens.shape[1]
    pos = torch.arange(seq, device=tokens.device)
    with torch.no_grad():
        logits, features = target(tokens, pos, None, causal(seq, tokens.device))
        rms = features.float().pow(2).mean(-1, keepdim=True).sqrt()
        noisy = features[:, :-1] + (torch.rand_like(features[:, :-1]) * 2 - 1) * cfg.noise * rms[:, :-1]
        embeds = target.tok_embeddings(tokens[:, 1:])
    h = head(embeds, noisy, pos[:-1], None, causal(seq - 1, tokens.device))
    feature_loss = F.smooth_l1_loss(h.float(), features[:, 1:].float(), reduction="none").mean(-1)
    target_p = torch.softmax(logits[:, 1:].float(), dim=-1)
    head_logp = torch.log_softmax(target.logits(h).float(), dim=-1)
    ce = -(target_p * head_logp).sum(-1)
    weight = mask[:, 1:] * mask[:, :-1]  # both the input pair and the predicted position are real
    loss = ((feature_loss + cfg.ce_weight * ce) * weight).sum() / weight.sum().clamp(min=1)
    top1 = ((head_logp.argmax(-1) == target_p.argmax(-1)).float() * weight).sum() / weight.sum().clamp(min=1)
    return loss, top1


def new_head(target_args: ModelArgs, device, seed: int) -> EagleDraft:
    torch.manual_seed(seed)
    head = EagleDraft(target_args, fc_bias=True).to(device)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    # Start near "the next feature is the current token's feature": the residual carries fc's output.
    with torch.no_grad():
        head.fc.weight[:, target_args.dim:] += torch.eye(target_args.dim, device=device)
        head.fc.bias.zero_()
    return head


DEFAULT_DRAFT_VOCAB = 32000


def draft_vocab_size(cfg: TrainConfig, vocab_size: int) -> int:
    """--draft_vocab_size, or 32000 (the whole vocabulary if smaller); more than the target has is refused."""
    if cfg.draft_vocab_size > vocab_size:
        raise EagletError(f"--draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary ({vocab_size})")
    return cfg.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, vocab_size)


def draft_vocabulary(examples: list, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` target tokens most frequent where the loss counts (ties: lower id first), as sorted ids."""
    tokens = torch.tensor([t for example, mask in examples for t, m in zip(example, mask) if m], dtype=torch.long)
    counts = torch.bincount(tokens, minlength=vocab_size)[:vocab_size]
    return counts.argsort(descending=True, stable=True)[:size].sort().values


def eagle3_config(args: ModelArgs, draft_vocab: int, feature_layers=None) -> dict:
    """The head's config.json: the target's shapes, one layer, its draft vocabulary; feature layers other
    than the default 2, L//2, L-3 named as the published heads name them (id k = the output of layer k)."""
    config = {**llama_head_config(args), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
    if feature_layers:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in feature_layers]}
    return config


def new_eagle3_head(target: Transformer, draft_ids: torch.Tensor, config: dict, seed: int) -> Eagle3Draft:
    """A fresh EAGLE-3 head: random layer; lm_head and norm start as the target's own (rows of the draft
    vocabulary), and fc passes the deepest feature through, so the head starts from the target's logit lens."""
    device, dim = target.output.weight.device, target.args.dim
    torch.manual_seed(seed)
    feature_layers = eagle3_feature_layers(config, target.args.n_layer, "the EAGLE-3 head")
    head = Eagle3Draft(head_args(config), dim, len(draft_ids), own_embedding=False,
                       n_features=len(feature_layers)).to(device)
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    head.feature_layers = feature_layers
    deepest = head.feature_layers.index(max(head.feature_layers))
    with torch.no_grad():
        lm_head = target.output  # an int8 lm_head (a quantized target) starts the head dequantized
        weight = lm_head.dequantize() if isinstance(lm_head, Int8Linear) else lm_head.weight
        head.lm_head.weight.copy_(weight[draft_ids.to(device)])
        head.norm.weight.copy_(target.norm.weight)
        head.fc.weight[:, deepest * dim:(deepest + 1) * dim] += torch.eye(dim, device=device)
    head.draft_to_target = draft_ids.to(device)
    return head


class UnrollCache:
    """The head's K/V during the training-time test: each step's appended out of place (autograd sees them
    all); attention reads every step's under the unroll mask. Stands in for model.KVCache's update()."""

    def __init__(self):
        self.k, self.v = [], []

    def update(self, cache_slots, k: torch.Tensor, v: torch.Tensor):
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)


def unroll_mask(n: int, step: int, device) -> torch.Tensor:
    """[n, n * (step + 1)]: at index t, step `step` sees step 0 at indices <= t (the context up to and
    including the tree's root) and steps 1..step at index t only (its ancestors in the tree, and itself)."""
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal(n, device)] + [eye] * step, dim=1)


def unroll(head: Eagle3Draft, target: Transformer, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list:
    """The training-time test: the head's outputs [B, T - 1, dim] at steps 0..steps-1, from tokens [B, T] and
    the target's features [B, T, 3 x dim]. At index t, step 0 reads the pair (f_t, x_{t+1}) at position t,
    as the catch-up does; step j reads (its own step j-1 output, x_{t+j+1}) at position t + j, as the tree
    node j levels below the root x_{t+1} does in build_tree. Tokens past the end read as 0 (their loss is masked)."""
    n, device = tokens.shape[1] - 1, tokens.device
    attention, target_embed = head.layer.attention, head.embed or target.tok_embeddings
    saved, attention.kv_cache = attention.kv_cache, UnrollCache()
    try:
        x, outputs = head.fc(features[:, :-1]), []
        for j in range(steps):
            cos, sin = head.rope(torch.arange(j, n + j, device=device), x.dtype)
            embeds = target_embed(F.pad(tokens[:, j + 1:], (0, j)))
            x = head.layer(embeds, x, cos, sin, None, unroll_mask(n, j, device))
            outputs.append(x)
    finally:
        attention.kv_cache = saved
    return outputs


def eagle3_step_losses(head: Eagle3Draft, target: Transformer, tokens, mask, steps: int):
    """Per unrolled step: the soft cross-entropy against the target's next-token distribution, and top-1 agreement.

    Step j at index t predicts what the target predicts at position t + j + 1. Target tokens outside the
    draft vocabulary are dropped and the target's distribution renormalised over the rest (the head cannot
    propose them, and renormalising keeps the order of the ones it can)."""
    n = tokens.shape[1] - 1
    pos = torch.arange(n + 1, device=tokens.device)
    with torch.no_grad():
        logits, features = target(tokens, pos, None, causal(n + 1, tokens.device))
        target_logp = torch.log_softmax(logits[:, 1:, head.draft_to_target].float(), dim=-1)
    losses, top1 = [], []
    for j, h in enumerate(unroll(head, target, tokens, features, steps)):
        target_p = F.pad(target_logp[:, j:], (0, 0, 0, j)).exp()
        weight = F.pad(mask[:, j + 1:] * mask[:, :n - j], (0, j))  # the root's pair and the predicted position are real
        head_logp = torch.log_softmax(head.logits(target, h).float(), dim=-1)
        ce = -(target_p * head_logp).sum(-1)
        agree = (head_logp.argmax(-1) == target_p.argmax(-1)).float()
        total = weight.sum().clamp(min=1)
        losses.append((ce * weight).sum() / total)
        top1.append((agree * weight).sum() / total)
    return torch.stack(losses), torch.stack(top1)


def eagle3_loss(head: Eagle3Draft, target: Transformer, tokens, mask, cfg: TrainConfig):
    """The training-time test's loss, sum_j step_decay^j x loss_j, and top-1 agreement at every step."""
    losses, top1 = eagle3_step_losses(head, target, tokens, mask, cfg.unroll_steps)
    decay = cfg.step_decay ** torch.arange(cfg.unroll_steps, device=losses.device)
    return (decay * losses).sum(), top1


def dflash_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple) -> dict:
    """A DFlash head's config.json as the published heads write it: Qwen3 keys of the target's shapes, the block
    size, the target's layer count and dflash_config (mask token, target layer ids: id k = the output of layer k)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": args.dim,
            "num_hidden_layers": cfg.draft_layers, "num_attention_heads": args.n_head,
            "num_key_value_heads": args.n_local_heads, "head_dim": args.head_dim,
            "intermediate_size": args.intermediate_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_base,
            "rope_scaling": args.rope_scaling, "max_position_embeddings": args.max_position_embeddings,
            "vocab_size": args.vocab_size, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "float32",
            "block_size": cfg.block_size, "num_target_layers": args.n_layer,
            "dflash_config": {"mask_token_id": dflash_mask_id(cfg, args),
                              "target_layer_ids": [k - 1 for k in feature_layers]}}


def dspark_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple) -> dict:
    """A DSpark head's config.json as DeepSpec writes it: the same Qwen3 keys, DSpark's settings at the top."""
    config = dflash_config(args, cfg, feature_layers)
    dflash = config.pop("dflash_config")
    return config | {"architectures": ["Qwen3DSparkModel"], **dflash, "markov_rank": cfg.markov_rank,
                     "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
                     "num_anchors": cfg.anchors, "tie_word_embeddings": False}


def dflash2_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple) -> dict:
    """A DFlash2 head's config.json as speculators writes it, with the convolution's and selector's settings
    (speculators' default convolution: 2 taps over groups of 16 channels)."""
    return speculators_config(args, cfg, feature_layers, "dflash2", ["DFlash2DraftModel"], conv_kernel_size=2,
                              conv_group_size=math.gcd(16, args.dim), selector_rank=cfg.selector_rank,
                              selector_top_k=cfg.selector_top_k)


def xpress_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple) -> dict:
    """An XPress head's config.json as speculators writes it (its refiner's MLP ratio and Jacobi passes: the
    released heads' 2 and 6)."""
    return speculators_config(args, cfg, feature_layers, "xpress", ["XPressSpeculator"], xpress_rank=cfg.xpress_rank,
                              xpress_mlp_ratio=2, num_jacobi_passes=6)


def speculators_config(args: ModelArgs, cfg: TrainConfig, feature_layers: tuple, kind: str, architectures: list,
                       **settings) -> dict:
    """A block drafter's config.json as speculators' save_pretrained writes it: the Qwen3 layers' keys nested in
    transformer_layer_config, the target layers as layer inputs, DFlash's layout (sample_from_anchor false)."""
    layer = dflash_config(args, cfg, feature_layers)
    layer = {k: v for k, v in layer.items() if k not in ("architectures", "block_size", "num_target_layers",
                                                         "dflash_config", "torch_dtype")}
    proposal = {"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1, "accept_tolerance": 0.0,
                "verifier_accept_k": 1}
    return {"architectures": architectures, "speculators_model_type": kind,
            "transformer_layer_config": layer, "draft_vocab_size": args.vocab_size, "block_size": cfg.block_size,
            "aux_hidden_state_layer_ids": list(feature_layers), "mask_token_id": dflash_mask_id(cfg, args),
            "sample_from_anchor": False, **settings, "num_target_layers": args.n_layer,
            "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                   "proposal_methods": [proposal], "verifier": {"architectures": ["LlamaForCausalLM"],
                                                                                "name_or_path": None}},
            "tie_word_embeddings": False, "dtype": "float32"}


def dflash_mask_id(cfg: TrainConfig, args: ModelArgs) -> int:
    return cfg.mask_token_id if cfg.mask_token_id >= 0 else args.vocab_size - 1


def dflash_feature_layers(cfg: TrainConfig, n_layer: int, feature_layers=None) -> tuple:
    """--feature_layers (layer inputs), or DFlash's default ids for the head's depth, as layer inputs."""
    layers = tuple(feature_layers) if feature_layers else tuple(k + 1 for k in dflash_layer_ids(n_layer, cfg.draft_layers))
    if not all(1 <= k <= n_layer - 1 for k in layers):
        raise EagletError(f"a DFlash head reads the inputs of layers 1..{n_layer - 1} of a {n_layer}-layer target "
                          f"(layer k's input is layer k - 1's output), not {list(layers)}")
    return layers


def new_dflash_head(target: Transformer, cfg: TrainConfig, config: dict) -> DFlashDraft:
    """A fresh DFlash head, or a DSpark one (config: dspark_config's), its Markov bias starting at zero."""
    device = target.output.weight.device
    torch.manual_seed(cfg.seed)
    args = replace(head_args(config.get("transformer_layer_config", config)), qk_norm=True, qkv_bias=False,
                   o_bias=False, mlp_bias=False)
    settings = config.get("dflash_config", config)
    if "aux_hidden_state_layer_ids" in config:  # speculators' layout: layer inputs
        settings = {**settings, "target_layer_ids": [k - 1 for k in config["aux_hidden_state_layer_ids"]]}
    ids, mask_id = settings["target_layer_ids"], settings["mask_token_id"]
    if "markov_rank" in config:
        head = DSparkDraft(args, len(ids), cfg.block_size, mask_id, cfg.markov_rank)
    elif "xpress_rank" in config:
        head = XPressDraft(args, len(ids), cfg.block_size, mask_id, cfg.xpress_rank, config["xpress_mlp_ratio"],
                           config["num_jacobi_passes"])
    elif "selector_rank" in config:
        head = DFlash2Draft(args, len(ids), cfg.block_size, mask_id, config["conv_kernel_size"],
                            config["conv_group_size"], cfg.selector_rank, cfg.selector_top_k)
    else:
        head = DFlashDraft(args, len(ids), cfg.block_size, mask_id)
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    if isinstance(head, DSparkDraft):  # the bias starts at zero; W1 as an embedding, so that W2 learns from the start
        torch.nn.init.normal_(head.markov_head.markov_w1.weight)
        torch.nn.init.zeros_(head.markov_head.markov_w2.weight)
    if isinstance(head, DFlash2Draft):  # each convolution starts as the identity and the selector's score at zero:
        for conv in [c for layer in head.layers for c in (layer.attention_conv, layer.mlp_conv)]:  # a DFlash head
            conv.base_kernel.data.zero_()[:, 0] = 1
            conv.kernel_projection.weight.data.zero_()
        selector = head.candidate_selector  # codebooks as embeddings, so that the projection learns from the start
        torch.nn.init.normal_(selector.predecessor_codebook)
        torch.nn.init.normal_(selector.successor_codebook)
        torch.nn.init.zeros_(selector.hidden_projection.weight)
    head.feature_layers = tuple(k + 1 for k in ids)
    return head.to(device)


def dflash_anchors(mask: torch.Tensor, n: int):
    """n random anchor positions per row whose next token counts (anchors [B, n]), and which are real
    (a row with fewer such positions repeats some, marked False)."""
    counts = mask[:, 1:] > 0  # anchor a predicts a + 1.. ; its own token is the block's root
    score = torch.rand(counts.shape, device=mask.device) + counts  # counting positions score above 1
    top = score.topk(min(n, counts.shape[1]), dim=-1)
    return top.indices, top.values >= 1


def dflash_blocks(head: DFlashDraft, target: Transformer, tokens, features, anchors) -> torch.Tensor:
    """Every anchor's block at once, as decoding drafts it: [B, A, block_size, dim] outputs of all its rows.
    Block (anchor a) queries see the context strictly before a and their own block only, never another block."""
    bsz, seq = tokens.shape
    n_anchors, size, device = anchors.shape[1], head.block_size, tokens.device
    offsets = torch.arange(size, device=device)
    pos = (anchors[..., None] + offsets).view(bsz, -1)  # [B, A x size]
    roots = tokens.gather(1, anchors)[..., None]
    x = target.tok_embeddings(torch.where(offsets == 0, roots, head.mask_token_id).view(bsz, -1))
    context = head.hidden_norm(head.fc(features))
    ctx_pos = torch.arange(seq, device=device)
    (cos_c, sin_c), (cos_b, sin_b) = head.rope(ctx_pos, x.dtype), head.rope(pos, x.dtype)
    block_of = torch.arange(n_anchors, device=device).repeat_interleave(size)
    sees_context = ctx_pos < anchors.repeat_interleave(size, dim=1)[..., None]  # [B, A x size, seq]
    sees_block = (block_of[:, None] == block_of).expand(bsz, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]
    for layer in head.layers:
        attention = layer.attention
        _, k_c, v_c = attention.project(context, cos_c, sin_c)
        h, conv = block_conv(layer, "attention_conv", layer.attention_norm(x), size)
        q, k_b, v_b = attention.project(conv(h, 0), cos_b, sin_b)
        y = F.scaled_dot_product_attention(q, torch.cat([k_c, k_b], 2), torch.cat([v_c, v_b], 2), attn_mask=mask,
                                           enable_gqa=attention.n_kv != attention.n_head)
        x = x + conv(attention.wo(y.transpose(1, 2).reshape(bsz, pos.shape[1], -1)), 1)
        h, conv = block_conv(layer, "mlp_conv", layer.ffn_norm(x), size)
        x = x + conv(layer.feed_forward(conv(h, 0)), 1)
    return head.norm(x).view(bsz, n_anchors, size, -1)


def block_conv(layer, name: str, h, size: int):
    """A DFlash2 layer's convolution (name) over the blocks of size rows in h [B, A x size, dim], as a function
    of (x, side) with its kernels made from h; the identity for a layer without one (DFlash, DSpark)."""
    conv = getattr(layer, name, None)
    if conv is None:
        return h, lambda x, side: x
    deltas = conv.deltas(h).unflatten(1, (-1, size))
    return h, lambda x, side: conv(x.unflatten(1, (-1, size)), deltas, side).flatten(1, 2)


def dflash_labels(picks, mask, anchors, real, levels: int):
    """For draft j = 0..levels-1 of each anchor a: the target's pick for position a + j + 1 (picks[t]: its next
    token after t, so picks[a + j]) [B, A, levels], and whether it counts (inside the sequence, a real anchor, a
    position the loss counts)."""
    seq = picks.shape[1]
    where = anchors[..., None] + torch.arange(levels, device=picks.device)  # the pick draft j predicts
    inside = (where + 1 < seq) & real[..., None]
    where = where.clamp(max=seq - 2)
    want = picks.gather(1, where.flatten(1)).view_as(where)
    return want, inside & (mask.gather(1, (where + 1).flatten(1)).view_as(where) > 0)


def dflash_loss(head: DFlashDraft, target: Transformer, tokens, mask, cfg: TrainConfig):
    """Cross-entropy of each draft j = 0.. (DFlash: block position j + 1; DSpark: row j) against the target's own
    pick for position a + j + 1, weighted exp(-j / gamma): the early drafts decide how much of a block is accepted.
    A DSpark head's logits carry the Markov bias of the token before each draft (the anchor, then the target's own
    picks: what an accepted prefix holds), and its confidence head learns, by binary cross-entropy with the same
    weights, whether each draft is the target's pick. Returns the loss and the top-1 agreement at each draft."""
    seq, levels = tokens.shape[1], head.max_levels
    pos = torch.arange(seq, device=tokens.device)
    with torch.no_grad():
        logits, features = target(tokens, pos, None, causal(seq, tokens.device))
        picks = logits.argmax(-1)  # picks[t]: the target's next token after position t
    anchors, real = dflash_anchors(mask, cfg.anchors)
    rows = dflash_blocks(head, target, tokens, features, anchors)
    h = rows[:, :, head.first_row:]  # the drafting rows
    want, counts = dflash_labels(picks, mask, anchors, real, levels)
    gamma = cfg.gamma or (7.0 if cfg.block_size >= 16 else cfg.block_size / 2)
    weight = torch.exp(-torch.arange(levels, device=tokens.device) / gamma) * counts
    head_logits = head.logits(target, h).float()
    prev = torch.cat([tokens.gather(1, anchors)[..., None], want[..., :-1]], dim=-1)  # [B, A, levels]: before each
    if isinstance(head, DSparkDraft):
        head_logits = head.next_logits(head_logits, prev, h).float()
    rounds = []
    if isinstance(head, XPressDraft):  # the teacher-forced refined logits; Jacobi rounds and the block's own beside
        before = torch.where(anchors > 0, tokens.gather(1, (anchors - 1).clamp(min=0)), tokens.gather(1, anchors))
        head_logits, rounds = xpress_logits(head, target, rows, before, prev, want)
    ce = F.cross_entropy(head_logits.flatten(0, 2), want.flatten(), reduction="none").view_as(weight)
    hit = head_logits.argmax(-1) == want
    loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
    for logits, share in rounds:
        ce = F.cross_entropy(logits.flatten(0, 2), want.flatten(), reduction="none").view_as(weight)
        loss, hit = loss + share * (ce * weight).sum() / weight.sum().clamp(min=1e-6), logits.argmax(-1) == want
    if isinstance(head, DFlash2Draft):
        selector_ce, hit = selector_loss(head, head_logits, prev, h, want)
        loss = loss + (selector_ce * weight).sum() / weight.sum().clamp(min=1e-6)
    if isinstance(head, DSparkDraft):
        confidence = head.confidence_head.proj(torch.cat([h, head.markov_head.markov_w1(prev)], -1))[..., 0].float()
        bce = F.binary_cross_entropy_with_logits(confidence, hit.float(), reduction="none")
        loss = loss + cfg.confidence_weight * (bce * weight).sum() / weight.sum().clamp(min=1e-6)
    agree = (hit & counts).float().sum((0, 1))
    return loss, agree / counts.float().sum((0, 1)).clamp(min=1)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def xpress_logits(head: XPressDraft, target: Transformer, rows, before, prev, want, passes: int = 3):
    """XPress's refined logits of the drafting rows, teacher-forced: the token before each row the target's own
    (before: the token before the anchor, or the anchor itself at position 0; prev: the anchor, then the target's
    picks). Also what a loss weighs beside them, as speculators trains (its defaults): the block's own logits
    (x 0.6) and the last of `passes` Jacobi rounds from the block's own picks, each after the previous round's
    picks, no gradient between rounds (x 0.3, the rounds decoding runs)."""
    first, size = head.first_row, rows.shape[-2]
    base = head.logits(target, rows).float()  # [B, A, size, vocab]: all rows
    states = head.refiner_head.states(rows)
    teacher = torch.cat([before[..., None], prev], -1)[..., 1 - first:][..., :size]  # the token before each row
    refined = base + head.refiner_head(teacher, states)
    picks = head.to_target(base.detach().argmax(-1))
    for _ in range(passes):
        jacobi = base + head.refiner_head(torch.cat([teacher[..., :1 + first], picks[..., first:-1]], -1), states)
        picks = head.to_target(jacobi.detach().argmax(-1))
    return refined[..., first:, :], [(base[..., first:, :], 0.6)] + ([(jacobi[..., first:, :], 0.3)] if passes else [])


def selector_loss(head: DFlash2Draft, logits, prev, h, want):
    """DFlash2's selector loss: cross-entropy over each draft's top_k tokens by the head's own logits (the ones it
    rescores when decoding), the target's pick put in the last place where it is missing, scored after the token
    before the draft. Returns it per draft, and whether the selector's pick among the drafts is the target's."""
    candidates = logits.detach().topk(head.candidate_selector.top_k, dim=-1).indices
    found = candidates == want[..., None]
    candidates[..., -1] = torch.where(found.any(-1), candidates[..., -1], want)
    label = (candidates == want[..., None]).float().argmax(-1)
    scores = head.candidate_selector.score(logits, prev, h, candidates).float()
    ce = F.cross_entropy(scores.flatten(0, -2), label.flatten(), reduction="none").view_as(want)
    return ce, (scores.argmax(-1) == label) & found.any(-1)


def make_head(kind: str, target: Transformer, examples: list, cfg: TrainConfig, feature_layers=None):
    """A fresh head of this kind ("eagle", "eagle3", "dflash" or "dspark") for the target, the loss it trains with,
    its config.json."""
    if kind == "eagle":
        config = {**llama_head_config(target.args), "bias": True}
        return new_head(target.args, target.output.weight.device, cfg.seed), head_loss, config
    if kind in ("dflash", "dspark", "dflash2", "xpress"):
        layers = dflash_feature_layers(cfg, target.args.n_layer, feature_layers)
        writer = {"dspark": dspark_config, "dflash2": dflash2_config, "xpress": xpress_config}.get(kind, dflash_config)
        config = writer(target.args, cfg, layers)
        return new_dflash_head(target, cfg, config), dflash_loss, config
    size = draft_vocab_size(cfg, target.args.vocab_size)
    config = eagle3_config(target.args, size, feature_layers)
    draft_ids = draft_vocabulary(examples, target.args.vocab_size, size)
    return new_eagle3_head(target, draft_ids, config, cfg.seed), eagle3_loss, config


def train(target: Transformer, examples: list, out_dir: Path, cfg: TrainConfig, resume: bool = True,
          log=print, kind: str = "eagle", feature_layers=None) -> DraftHead:
    """Train (or resume) a head of this kind ("eagle" or "eagle3"); returns it and writes
    out_dir/{config.json, model.safetensors}. feature_layers: EAGLE-3's, if not 2, L//2, L-3."""
    device = target.output.weight.device
    check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    head, loss_fn, config = make_head(kind, target, examples, cfg, feature_layers)
    target.set_feature_layers(head.feature_layers)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state_path, start = out_dir / "train_state.pt", 0
    if resume and state_path.is_file():
        start = resume_from(state_path, head, optimizer, target)
        log(f"resuming at step {start}")
    if len(examples) < cfg.batch_size:
        log(f"{len(examples)} examples, fewer than batch_size {cfg.batch_size}: each batch holds all of them")
    target.setup_rope(cfg.seq_len)
    head.setup_rope(cfg.seq_len + max(cfg.unroll_steps, cfg.block_size))  # EAGLE-3's step j runs j positions ahead
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    data = batches(examples, cfg.batch_size, cfg.seq_len, pad_id=0, seed=cfg.seed + start)
    with Progress("training", cfg.steps, "steps", start=start, log=log) as progress:
        recent = deque(maxlen=RECENT_STEPS)  # (loss, top-1) of the last steps, on the device: no sync until printed
        for step in range(start, cfg.steps):
            tokens, mask = (t.to(device) for t in next(data))
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            with autocast:
                loss, top1 = loss_fn(head, target, tokens, mask, cfg)
            if not torch.isfinite(loss):  # one sync a step; a NaN head must never be saved
                raise EagletError(f"the loss became {loss.item()} at step {step + 1}: training diverged "
                                  f"(a smaller --lr or --noise may help); nothing was saved at this step")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
            optimizer.step()
            recent.append((loss.detach(), top1.detach()))
            progress.update(step + 1, lambda: recent_means(recent, "drafts" if kind in BLOCK_HEADS else
                                                           "unrolled steps"))
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                            "config": asdict(cfg), "target": target_shape(target), "kind": head_settings(head)},
                           state_path)
    save_head(head, config, out_dir, target)
    return head


RECENT_STEPS = 50  # the progress line's loss and top-1 agreement: means over this many steps, not one batch's


def recent_means(recent, steps: str = "unrolled steps") -> str:
    """The loss and top-1 agreement (the share of positions where the head's most likely token is the
    target's; EAGLE-3: one per unrolled step, DFlash: per block position) of the last steps, averaged, and
    labelled with how many."""
    loss = torch.stack([loss for loss, _ in recent]).float().mean().item()
    top1 = torch.stack([top1.view(-1) for _, top1 in recent]).float().mean(0).tolist()
    label = "top-1 agreement" if len(top1) == 1 else f"top-1 agreement at {steps} 1-{len(top1)}"
    over = f"means of the last {len(recent)} steps" if len(recent) > 1 else "this step's batch"
    return f"loss {loss:.4f}, {label} {' '.join(f'{a:.3f}' for a in top1)} ({over})"


def target_shape(target: Transformer) -> dict:
    return {k: v for k, v in asdict(target.args).items() if k != "extra"}


def head_settings(head: DraftHead) -> dict:
    """What a train_state.pt must agree on besides the target: the head's kind, features and draft vocabulary."""
    if isinstance(head, EagleDraft):
        return {"head": "eagle"}
    if isinstance(head, DFlashDraft):
        return {"head": head_name(head).lower(), "feature_layers": list(head.feature_layers),
                "block_size": head.block_size, "mask_token_id": head.mask_token_id, "draft_layers": head.args.n_layer,
                **({"markov_rank": head.markov_head.markov_w1.weight.shape[1]} if isinstance(head, DSparkDraft) else {}),
                **({"selector_top_k": head.candidate_selector.top_k} if isinstance(head, DFlash2Draft) else {}),
                **({"xpress_rank": head.refiner_head.mix_l.shape[0]} if isinstance(head, XPressDraft) else {})}
    return {"head": "eagle3", "feature_layers": list(head.feature_layers),
            "draft_vocab": head.draft_to_target.tolist()}


def resume_from(state_path: Path, head: DraftHead, optimizer, target: Transformer) -> int:
    """Load a train_state.pt written for this target; returns the step it reached."""
    try:
        state = torch.load(state_path, map_location=target.output.weight.device, weights_only=True)
        step = int(state["step"])
    except Exception as e:
        raise EagletError(f"cannot resume from {state_path}: {(str(e).strip().splitlines() or [repr(e)])[0]} "
                          "(--no_resume starts over)")
    theirs, ours = state.get("target", target_shape(target)), target_shape(target)
    differ = [f"{k} {theirs.get(k)} vs {v}" for k, v in ours.items() if theirs.get(k) != v]
    if differ:
        raise EagletError(f"{state_path} was written while training a head for another target ({', '.join(differ)}); "
                          "give another --out_dir, or --no_resume to start over")
    theirs, ours = state.get("kind", {"head": "eagle"}), head_settings(head)
    differ = [k if k == "draft_vocab" else f"{k} {theirs.get(k)} vs {v}" for k, v in ours.items() if theirs.get(k) != v]
    if differ:
        raise EagletError(f"{state_path} was written while training another head ({', '.join(differ)} differ); "
                          "give another --out_dir, or --no_resume to start over")
    try:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise EagletError(f"{state_path} does not fit this target's head: {mismatch_detail(e)}")
    return step


WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors", ".gguf")


def check_out_dir(out_dir: Path):
    """Refuse an out_dir that holds a checkpoint other than a head being trained there (with its
    train_state.pt): the head's config.json and model.safetensors would overwrite it."""
    if out_dir.exists() and not out_dir.is_dir():
        raise EagletError(f"--out_dir {out_dir} is a file, not a folder")
    if not out_dir.is_dir():
        return
    found = sorted(f.name for f in out_dir.iterdir() if f.name == "config.json" or f.suffix in WEIGHT_SUFFIXES)
    ours = (out_dir / "train_state.pt").is_file() and (not (out_dir / "config.json").is_file() or
                                                       read_config(out_dir).get("num_hidden_layers") == 1 or
                                                       is_dflash_config(read_config(out_dir)))
    if found and not ours:
        raise EagletError(f"--out_dir {out_dir} already holds a checkpoint ({', '.join(found[:4])}) that is not a "
                          "head being trained there; writing the head would overwrite it: choose another folder")


def prepare_out_dir(out_dir: Path):
    """Make out_dir and check that the head can be written there, before loading and self-distilling."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EagletError(f"--out_dir {out_dir} cannot be made: {e.strerror or e}")
    check_writable(out_dir / "train_state.pt", "--out_dir")


def llama_head_config(args: ModelArgs) -> dict:
    """The config.json both kinds of head share: a one-layer LLaMA of the target's shapes."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "num_attention_heads": args.n_head, "num_key_value_heads": args.n_local_heads,
            "head_dim": args.head_dim, "intermediate_size": args.intermediate_size, "num_hidden_layers": 1,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_base,
            "rope_scaling": args.rope_scaling, "max_position_embeddings": args.max_position_embeddings,
            "hidden_act": "silu", "torch_dtype": "float32",
            # the target's biases, which a new head copies (a Qwen2 target: q/k/v only, not o)
            "attention_bias": args.o_bias, "qkv_bias": args.qkv_bias, "mlp_bias": args.mlp_bias}


def save_head(head: DraftHead, config: dict, out_dir: Path, target: Optional[Transformer] = None):
    """config.json + model.safetensors under the published key names of the head's kind."""
    args, sd = head.args, {k: v.detach().float().cpu() for k, v in head.state_dict().items()}
    if isinstance(head, EagleDraft):
        weights = {"fc.weight": sd["fc.weight"], "fc.bias": sd["fc.bias"], **export_layer(sd, "layer.", "layers.0.", args)}
    elif isinstance(head, DFlashDraft):
        weights = {k: sd[k] for k in ("fc.weight", "hidden_norm.weight", "norm.weight")}
        for i in range(args.n_layer):
            weights.update(export_layer(sd, f"layers.{i}.", f"layers.{i}.", args))
        if isinstance(head, DSparkDraft):  # DeepSpec's files carry frozen copies of the target's tables too
            weights.update({k: v for k, v in sd.items() if k.startswith(("markov_head.", "confidence_head."))})
            weights.update({"embed_tokens.weight": target.tok_embeddings.weight.detach().float().cpu(),
                            "lm_head.weight": lm_head_table(target)})
        if isinstance(head, (DFlash2Draft, XPressDraft)):  # speculators' names are the modules' own
            weights.update({k: v for k, v in sd.items() if k.startswith(("candidate_selector.", "refiner_head."))
                            or "_conv." in k})
    else:
        draft_ids = head.draft_to_target.cpu()
        t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        weights = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
                   "midlayer.input_layernorm.weight": sd["layer.embed_norm.weight"],
                   "midlayer.hidden_norm.weight": sd["layer.hidden_norm.weight"],
                   **export_layer(sd, "layer.", "midlayer.", args),
                   "d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d}  # target id = draft id + d2t
    save_file({k: t.contiguous() for k, t in weights.items()}, str(out_dir / "model.safetensors"))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(out_dir / "model.safetensors", 0o666 & ~umask)  # safetensors writes 0600: others could not read it
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


@torch.no_grad()
def lm_head_table(target: Transformer) -> torch.Tensor:
    """The target's lm_head as a float [vocab, dim] table, whatever its format: its logits of the unit vectors."""
    eye = torch.eye(target.args.dim, device=target.tok_embeddings.weight.device,
                    dtype=target.tok_embeddings.weight.dtype)
    return torch.cat([target.logits(rows) for rows in eye.split(512)]).T.float().cpu().contiguous()


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
        args.checkpoint_path = converted_file(args.checkpoint_path, "model.pth")  # the file, or its folder
        check_out_dir(args.out_dir)
        if args.out_dir.resolve() == args.checkpoint_path.resolve().parent:
            raise EagletError(f"--out_dir {args.out_dir} is the target's own folder: the head would overwrite it")
        prepare_out_dir(args.out_dir)
        if args.self_distill:
            check_distill_files(args.out_dir)
        device = pick_device(args.device)
        precision = "bf16" if device == "cuda" else "fp32"  # weights for the target; training runs in autocast
        target = load_target(args.checkpoint_path, device, precision if args.self_distill else "fp32")
        check_lengths(target, cfg, args.max_new_tokens if args.self_distill else 0)
        check_head_flags(args, cfg, target)
        tokenizer = Tokenizer(args.checkpoint_path.parent)
        if any(str(path).endswith(".jsonl") for path in args.data):
            print(f"chat template: {tokenizer.chat_template_source}")
        items, replies = read_items(args.data, tokenizer, cfg.seq_len), None
        if args.self_distill:
            target.setup_caches(1, cfg.seq_len + args.max_new_tokens + 8)
            sampling = SamplingConfig()  # greedy: the target's most likely replies
            reply_fn = lambda prompt: tokenizer.decode(generate(  # noqa: E731
                target, prompt[-cfg.seq_len:], args.max_new_tokens, sampling, tokenizer.eos_ids).tokens)
            record = self_distill_record(args.checkpoint_path, args.data, tokenizer, cfg.seq_len, args.max_new_tokens,
                                         sampling, precision, device)
            replies = self_distilled_replies(items, args.out_dir, record,
                                             lambda item: target_replies(item, tokenizer, reply_fn),
                                             paths=self_distill_paths(args.checkpoint_path, args.data, tokenizer))
        examples = examples_of(items, tokenizer, cfg.seq_len, replies)
        for layer in target.layers:  # training runs whole sequences without a cache
            layer.attention.kv_cache = None
        print(f"{len(examples)} examples; training {cfg.steps} steps on {device}")
        train(target, examples, args.out_dir, cfg, resume=not args.no_resume, kind=args.head,
              feature_layers=args.feature_layers)
    except EagletError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    print(f"wrote {args.out_dir / 'model.safetensors'}; convert it with "
          f"python convert_hf_checkpoint.py --checkpoint_dir {args.out_dir}")


def check_head_flags(args, cfg: TrainConfig, target: Transformer):
    """The EAGLE-3 settings against the target, before any long work (self-distillation)."""
    dflash = [f"--{k}" for k, v in asdict(cfg).items() if k in DFLASH_FLAGS and v != getattr(TrainConfig, k)]
    if dflash and args.head not in BLOCK_HEADS:
        raise EagletError(f"{dflash[0]} is for block drafters (--head {', '.join(BLOCK_HEADS)})")
    for kind, name, flags in (("dspark", "DSpark", DSPARK_FLAGS), ("dflash2", "DFlash2", DFLASH2_FLAGS),
                              ("xpress", "XPress", XPRESS_FLAGS)):
        given = [f"--{k}" for k, v in asdict(cfg).items() if k in flags and v != getattr(TrainConfig, k)]
        if given and args.head != kind:
            raise EagletError(f"{given[0]} is for {name} heads (--head {kind})")
    if args.head == "eagle":
        if args.feature_layers or cfg.draft_vocab_size:
            raise EagletError("--feature_layers and --draft_vocab_size are for EAGLE-3 heads (--head eagle3)")
        return
    if args.head in BLOCK_HEADS:
        if args.head == "dflash2" and cfg.selector_top_k > target.args.vocab_size:
            raise EagletError(f"--selector_top_k {cfg.selector_top_k} is more than the target's vocabulary "
                              f"({target.args.vocab_size})")
        if cfg.draft_vocab_size:
            raise EagletError("--draft_vocab_size is for EAGLE-3 heads: a block drafter scores the whole "
                              "vocabulary")
        dflash_feature_layers(cfg, target.args.n_layer, args.feature_layers)
        mask_id = dflash_mask_id(cfg, target.args)
        if mask_id >= target.args.vocab_size:
            raise EagletError(f"--mask_token_id {mask_id} is not below the target's vocabulary ({target.args.vocab_size})")
        if not target.tok_embeddings.weight[mask_id].any():
            raise EagletError(f"the mask token {mask_id} has an all-zero embedding: every mask would look alike to "
                              "the head; give another --mask_token_id")
        return
    draft_vocab_size(cfg, target.args.vocab_size)
    where = "--feature_layers" if args.feature_layers else "an EAGLE-3 head by default (layers 2, L//2, L-3)"
    eagle3_feature_layers(eagle3_config(target.args, 1, args.feature_layers), target.args.n_layer, where)


DFLASH_FLAGS = ("block_size", "draft_layers", "anchors", "gamma", "mask_token_id")
DSPARK_FLAGS = ("markov_rank", "confidence_weight")
DFLASH2_FLAGS = ("selector_rank", "selector_top_k")
XPRESS_FLAGS = ("xpress_rank",)
BLOCK_HEADS = ("dflash", "dspark", "dflash2", "xpress")


def check_lengths(target: Transformer, cfg: TrainConfig, max_new_tokens: int):
    """Sequences (and, self-distilling, the cache for seq_len + max_new_tokens) within the model's positions."""
    need, limit = cfg.seq_len + (max_new_tokens + 8 if max_new_tokens else 0), target.args.max_position_embeddings
    if need > limit:
        parts = f"seq_len ({cfg.seq_len}) + max_new_tokens ({max_new_tokens}) + 8 = {need}" if max_new_tokens \
            else f"seq_len ({cfg.seq_len})"
        raise EagletError(f"{parts} exceeds the model's max_position_embeddings ({limit})")


if __name__ == "__main__":
    main()
