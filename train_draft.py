"""Train an EAGLE-1/2 or EAGLE-3 draft head for a converted target; save it in the published format.

    python train_draft.py --checkpoint_path checkpoints/org/model/model.pth --data corpus/*.txt \\
        --out_dir checkpoints/org/model-eagle --steps 2000 [--head eagle3]
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/org/model-eagle   # -> draft.pth

Data: plain text files (every token counts), or FastChat question files (.jsonl with "turns"; only the
assistant's tokens count). --self_distill lets the target write the assistant's replies (and continue
plain text), so the head learns what the target itself says, which raises acceptance.
EAGLE-1/2 (--head eagle): the head learns the target's next feature (SmoothL1) and its next-token
distribution (0.1 x cross-entropy against the target's soft predictions), from features with small
uniform noise added.
EAGLE-3 (--head eagle3): the head reads the target's hidden states entering layers 2, L//2, L-3 and
learns only the target's next-token distributions over its draft vocabulary (the --draft_vocab_size
tokens most frequent in the data), unrolled --unroll_steps steps on its own outputs as the draft tree
runs it (the "training-time test"), step j's loss weighted step_decay^j.
"""
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cli import cli_parser, float_flag, int_flag


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

    def __post_init__(self):
        at_least = {"steps": 1, "batch_size": 1, "seq_len": 2, "save_every": 1, "warmup": 0, "seed": 0,
                    "weight_decay": 0, "noise": 0, "ce_weight": 0, "unroll_steps": 1, "draft_vocab_size": 0}
        bad = [f"{k} must be at least {low}" for k, low in at_least.items() if not getattr(self, k) >= low]
        bad += [f"{k} must be above 0" for k in ("lr", "grad_clip", "step_decay")
                if not 0 < getattr(self, k) < math.inf]
        bad += ["unroll_steps must be below seq_len"] if self.unroll_steps >= self.seq_len else []
        if bad or not all(math.isfinite(v) for v in asdict(self).values()):
            raise EagletError(f"training settings out of range: {', '.join(bad) or 'values must be finite'}")


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", type=Path, required=True, help="the target's model.pth")
    p.add_argument("--data", nargs="+", required=True, help="text files and/or FastChat .jsonl question files")
    p.add_argument("--out_dir", type=Path, required=True, help="where the head (and train_state.pt) go")
    p.add_argument("--self_distill", action="store_true", help="the target writes the replies / continuations")
    p.add_argument("--max_new_tokens", type=int_flag(1), default=256, help="reply length for --self_distill")
    p.add_argument("--no_resume", action="store_true", help="start over even if out_dir has a train_state.pt")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if available")
    p.add_argument("--head", choices=["eagle", "eagle3"], default="eagle", help="EAGLE-1/2 or EAGLE-3 head")
    p.add_argument("--feature_layers", type=int_flag(1), nargs=3, default=None,
                   help="EAGLE-3: the target layers whose input the head reads (default: 2, L//2, L-3; "
                        "L: the last layer's output)")
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
                                 "0: 32000, or the whole vocabulary if smaller"}
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
from draft import DraftHead, Eagle3Draft, EagleDraft, eagle3_feature_layers, head_args  # noqa: E402
from generate import SamplingConfig, check_writable, generate, load_target, pick_device  # noqa: E402
from model import EagletError, Int8Linear, ModelArgs, Transformer, mismatch_detail, read_config  # noqa: E402
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


def load_examples(paths, tokenizer: Tokenizer, seq_len: int, reply_fn=None, log=print) -> list:
    """(tokens, loss mask) pairs of at most seq_len tokens from text files and FastChat question files."""
    examples = []
    for path in map(Path, paths):
        if not path.is_file():
            raise EagletError(f"data file not found: {path}")
        if path.suffix == ".jsonl":
            questions = read_questions(path)
            for i, question in enumerate(questions):
                if reply_fn is not None:
                    log(f"{path.name}: the target answers question {i + 1}/{len(questions)}")
                examples.append(question_example(tokenizer, question, seq_len, reply_fn, path))
        else:
            tokens = tokenizer.encode(path.read_text(errors="replace"), bos=False)
            starts = range(0, max(len(tokens) - 1, 1), seq_len)
            for i, start in enumerate(starts):
                chunk = tokens[start:start + seq_len]
                if reply_fn is not None:  # keep the first half, let the target write the rest
                    log(f"{path.name}: the target continues piece {i + 1}/{len(starts)}")
                    chunk = chunk[:len(chunk) // 2] + tokenizer.encode(reply_fn(chunk[:len(chunk) // 2]), bos=False)
                    chunk = chunk[:seq_len]
                if len(chunk) > 1:
                    examples.append((chunk, [1] * len(chunk)))
    if not examples:
        raise EagletError("no training examples in the data")
    return examples


def question_example(tokenizer: Tokenizer, question: dict, seq_len: int, reply_fn, path: Path) -> tuple:
    """One conversation: the file's reference replies, or the target's own (reply_fn)."""
    turns = question["turns"]
    replies = question.get("reference") if reply_fn is None else None
    if reply_fn is not None:
        replies, messages = [], []
        for user in turns:
            messages.append({"role": "user", "content": user})
            replies.append(reply_fn(tokenizer.encode_chat(messages)))
            messages.append({"role": "assistant", "content": replies[-1]})
    if not replies:
        raise EagletError(f"{path}: question {question.get('question_id')} has no replies; "
                          "use --self_distill to let the target write them")
    tokens, mask = chat_example(tokenizer, turns, replies)
    return tokens[:seq_len], mask[:seq_len]


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
    head_logp = torch.log_softmax(target.output(h).float(), dim=-1)
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
    head = Eagle3Draft(head_args(config), dim, len(draft_ids), own_embedding=False).to(device)
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    head.feature_layers = eagle3_feature_layers(config, target.args.n_layer, "the EAGLE-3 head")
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


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_head(kind: str, target: Transformer, examples: list, cfg: TrainConfig, feature_layers=None):
    """A fresh head of this kind ("eagle" or "eagle3") for the target, the loss it trains with, its config.json."""
    if kind == "eagle":
        config = {**llama_head_config(target.args), "bias": True}
        return new_head(target.args, target.output.weight.device, cfg.seed), head_loss, config
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
    head.setup_rope(cfg.seq_len + cfg.unroll_steps)  # EAGLE-3's step j runs j positions ahead
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    data = batches(examples, cfg.batch_size, cfg.seq_len, pad_id=0, seed=cfg.seed + start)
    t0 = time.perf_counter()
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
        if step % 10 == 0 or step == cfg.steps - 1:
            done = (step + 1) / cfg.steps
            bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
            agreement = " ".join(f"{a:.3f}" for a in top1.view(-1).tolist())  # EAGLE-3: one per unrolled step
            log(f"[{bar}] step {step + 1}/{cfg.steps} loss {loss.item():.4f} top-1 {agreement} "
                f"{time.perf_counter() - t0:.0f}s")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                        "config": asdict(cfg), "target": target_shape(target), "kind": head_settings(head)}, state_path)
    save_head(head, config, out_dir)
    return head


def target_shape(target: Transformer) -> dict:
    return {k: v for k, v in asdict(target.args).items() if k != "extra"}


def head_settings(head: DraftHead) -> dict:
    """What a train_state.pt must agree on besides the target: the head's kind, features and draft vocabulary."""
    if isinstance(head, EagleDraft):
        return {"head": "eagle"}
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
    ours = (out_dir / "train_state.pt").is_file() and (
        not (out_dir / "config.json").is_file() or read_config(out_dir).get("num_hidden_layers") == 1)
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


def save_head(head: DraftHead, config: dict, out_dir: Path):
    """config.json + model.safetensors under the published EAGLE-1/2 or EAGLE-3 key names."""
    args, sd = head.args, {k: v.detach().float().cpu() for k, v in head.state_dict().items()}
    if isinstance(head, EagleDraft):
        weights = {"fc.weight": sd["fc.weight"], "fc.bias": sd["fc.bias"], **export_layer(sd, "layer.", "layers.0.", args)}
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
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
        check_out_dir(args.out_dir)
        if args.out_dir.resolve() == args.checkpoint_path.resolve().parent:
            raise EagletError(f"--out_dir {args.out_dir} is the target's own folder: the head would overwrite it")
        prepare_out_dir(args.out_dir)
        device = pick_device(args.device)
        precision = "bf16" if device == "cuda" else "fp32"  # weights for the target; training runs in autocast
        target = load_target(args.checkpoint_path, device, precision if args.self_distill else "fp32")
        check_lengths(target, cfg, args.max_new_tokens if args.self_distill else 0)
        check_head_flags(args, cfg, target)
        tokenizer = Tokenizer(args.checkpoint_path.parent)
        if any(str(path).endswith(".jsonl") for path in args.data):
            print(f"chat template: {tokenizer.chat_template_source}")
        reply_fn = None
        if args.self_distill:
            target.setup_caches(1, cfg.seq_len + args.max_new_tokens + 8)
            reply_fn = lambda prompt: tokenizer.decode(generate(  # noqa: E731
                target, prompt[-cfg.seq_len:], args.max_new_tokens, SamplingConfig(), tokenizer.eos_ids).tokens)
        examples = load_examples(args.data, tokenizer, cfg.seq_len, reply_fn)
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
    if args.head == "eagle":
        if args.feature_layers or cfg.draft_vocab_size:
            raise EagletError("--feature_layers and --draft_vocab_size are for EAGLE-3 heads (--head eagle3)")
        return
    draft_vocab_size(cfg, target.args.vocab_size)
    where = "--feature_layers" if args.feature_layers else "an EAGLE-3 head by default (layers 2, L//2, L-3)"
    eagle3_feature_layers(eagle3_config(target.args, 1, args.feature_layers), target.args.n_layer, where)


def check_lengths(target: Transformer, cfg: TrainConfig, max_new_tokens: int):
    """Sequences (and, self-distilling, the cache for seq_len + max_new_tokens) within the model's positions."""
    need, limit = cfg.seq_len + (max_new_tokens + 8 if max_new_tokens else 0), target.args.max_position_embeddings
    if need > limit:
        parts = f"seq_len ({cfg.seq_len}) + max_new_tokens ({max_new_tokens}) + 8 = {need}" if max_new_tokens \
            else f"seq_len ({cfg.seq_len})"
        raise EagletError(f"{parts} exceeds the model's max_position_embeddings ({limit})")


if __name__ == "__main__":
    main()
