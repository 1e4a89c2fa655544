"""Decode from a converted LLaMA-family checkpoint: plain decoding, or EAGLE-2 speculative decoding.

    python generate.py --checkpoint_path checkpoints/meta-llama/Llama-2-7b-chat-hf/model.pth \\
        --prompt "Hello, my name is" --compile
"""
import hashlib
import json
import math
import os
import resource
import sys
import time
from argparse import ArgumentTypeError
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable, Optional

from cli import PRECISION_NAMES, cli_parser, int_flag, float_flag, torchrun_rank, utf8_text

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_PROMPT = "def read_lines(path):\n"  # where the small demo model writes plausible code for a while
DEMO_MAX_NEW_TOKENS = 60
# --tree auto's trees, as (depth, tree_topk, total_tokens): chains (tree_topk 1, total_tokens = depth + 1), which win
# where every verified token costs time (a batch-1 EAGLE-3 chain of 7 beat top-k trees on an H200), trees up to
# int4's first 16-row step and past it, and the default 6/10/60.
TREE_GRID = ((3, 1, 4), (5, 1, 6), (7, 1, 8), (5, 3, 16), (6, 4, 32), (6, 10, 60))
# Prompts --tree auto decodes (greedy, CALIBRATION_TOKENS each) to measure each tree's tau: code, prose, a question.
CALIBRATION_PROMPTS = (DEMO_PROMPT, "The history of the printing press begins",
                       "Question: why does ice float on water?\nAnswer:")
CALIBRATION_TOKENS = 64


def total_tokens_flag(text: str):
    return text if text == "auto" else int_flag(2)(text)


def grid_text(grid=TREE_GRID) -> str:
    return ", ".join(f"{d}/{k}/{n}" for d, k, n in grid)


def tree_cache_file() -> Path:
    """Where --tree auto keeps its choices: $EAGLET_CACHE/tree_choice.json, by default under ~/.cache/eaglet."""
    return Path(os.environ.get("EAGLET_CACHE") or Path.home() / ".cache" / "eaglet") / "tree_choice.json"


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ArgumentTypeError(f"is not valid JSON: {e}")
    if not isinstance(value, dict):
        raise ArgumentTypeError("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="model.pth written by convert_hf_checkpoint.py (or quantize.py), or its folder "
                        "(default: the demo in demo/)")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="draft.pth of an EAGLE-1/2 or EAGLE-3 head, or its folder: switches to speculative decoding")
    p.add_argument("--draft_vocab", default=None,
                   help="EAGLE-1/2 heads: a file of the target ids the draft may propose (scripts/draft_vocab.py); "
                        "default: draft_vocab.json beside the head if there is one; full: the whole vocabulary")
    p.add_argument("--no_draft", action="store_true",
                   help="plain decoding, without a head (also when --draft_checkpoint_path is given)")
    p.add_argument("--depth", type=int_flag(1), default=None,
                   help="draft tree expansion steps (default: 6; 7 for EAGLE-3 heads)")
    p.add_argument("--tree_topk", type=int_flag(1), default=None,
                   help="children per node and nodes kept per level (default: 10)")
    p.add_argument("--total_tokens", type=total_tokens_flag, default=None,
                   help="tokens verified per cycle, root included; auto measures the verify cost at start-up "
                        "(default: 60)")
    p.add_argument("--tree", choices=["given", "auto"], default="given",
                   help="given: the tree of --depth, --tree_topk and --total_tokens; auto: measure each tree of "
                        f"depth/tree_topk/total_tokens {grid_text()} on this device at batch 1 (tau: greedy decoding "
                        f"of {len(CALIBRATION_PROMPTS)} built-in prompts, {CALIBRATION_TOKENS} tokens each; the time "
                        "of its cycle) and keep the most tokens/s = tau / cycle time; the choice is kept in "
                        "$EAGLET_CACHE/tree_choice.json (~/.cache/eaglet/) for this target, head, device, format and "
                        "precision, and later runs read it")
    p.add_argument("--prompt", type=utf8_text, action="append", default=None,
                   help=f"the prompt (default: {DEMO_PROMPT!r}); give it several times to decode several prompts")
    p.add_argument("--prompt_file", type=Path, default=None,
                   help="prompts, one a line: a JSON string, or a FastChat question (its first turn)")
    p.add_argument("--batch_size", type=int_flag(1), default=None,
                   help="several prompts: decode this many together (default: all of them, or as many as the "
                        "caches' memory allows)")
    p.add_argument("--system", type=utf8_text, default=None, help="a system message for --chat and --interactive")
    p.add_argument("--max_new_tokens", type=int_flag(1), default=None,
                   help=f"stop after this many tokens or at EOS (default: 200; {DEMO_MAX_NEW_TOKENS} for the demo)")
    p.add_argument("--temperature", type=float_flag(0), default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float_flag(0, 1), default=1.0, help="nucleus sampling: keep this much mass")
    p.add_argument("--top_k", type=int_flag(0), default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=int_flag(0), default=0, help="sampling seed; sample i uses seed + i")
    p.add_argument("--num_samples", type=int_flag(1, 2 ** 31), default=1, help="generate this many times (timing)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if available")
    p.add_argument("--precision", choices=PRECISION_NAMES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step or the cycle (CUDA graphs on CUDA)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--chat_template", default="auto",
                   help="auto (the checkpoint's own, else a built-in one, named at start-up), llama2, vicuna, "
                        "or a .jinja file")
    p.add_argument("--chat_template_kwargs", type=json_object, default=None,
                   help='extra variables for the chat template, as JSON, e.g. \'{"enable_thinking": false}\' (Qwen3)')
    p.add_argument("--stop", type=utf8_text, action="append", default=None,
                   help="end the reply where this text appears, cut before it (repeatable)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat in the terminal")
    p.add_argument("--max_seq_length", type=int_flag(1), default=None,
                   help="cache size; default: what the prompt and max_new_tokens need, or 4096 with --interactive")
    p.add_argument("--json_out", type=Path, default=None,
                   help="write the prompt's tokens and each sample's tokens, text, tokens/s, accept lengths and tau "
                        "as JSON, with their means (several prompts: a list of such objects)")
    args = p.parse_args(argv)
    args.demo = args.checkpoint_path is None
    if args.demo:  # a small code model and its head, shipped in demo/
        if not (DEMO_DIR / "target" / "model.pth").is_file():
            p.error(f"no --checkpoint_path given and no demo in {DEMO_DIR} (python scripts/make_demo.py builds it)")
        if args.chat or args.interactive:
            p.error("the demo is a code-completion model with no chat template: --chat and --interactive need a "
                    "chat model (--checkpoint_path)")
        args.checkpoint_path = DEMO_DIR / "target" / "model.pth"
        args.draft_checkpoint_path = args.draft_checkpoint_path or DEMO_DIR / "head" / "draft.pth"
    if args.system is not None and not (args.chat or args.interactive):
        p.error("--system needs --chat or --interactive")
    if args.chat_template_kwargs is not None and not (args.chat or args.interactive):
        p.error("--chat_template_kwargs needs --chat or --interactive")
    if args.stop and not all(args.stop):
        p.error("--stop needs a non-empty text")
    if args.interactive and args.json_out:
        p.error("--json_out records one generation; --interactive has many (give a --prompt instead)")
    try:
        args.prompts = (args.prompt or []) + (read_prompts(args.prompt_file) if args.prompt_file else [])
    except ValueError as e:
        p.error(str(e))
    if args.interactive and len(args.prompts) > 1:
        p.error("--interactive is one conversation: it takes no --prompt_file and at most one --prompt")
    empty = [i + 1 for i, text in enumerate(args.prompts) if not text]
    if empty and len(args.prompts) > 1:
        p.error(f"prompt {empty[0]} of {len(args.prompts)} is empty")
    if args.interactive and torchrun_rank() is not None:
        p.error("--interactive reads the terminal in one process; under torchrun (tensor parallel) give a --prompt")
    if args.no_draft:
        args.draft_checkpoint_path = None
    if args.tree == "auto":
        given = [f for f in ("depth", "tree_topk", "total_tokens") if getattr(args, f) is not None]
        if given:
            p.error(f"--tree auto picks depth, tree_topk and total_tokens itself: leave out --{given[0]}")
        if not args.draft_checkpoint_path:
            p.error("--tree auto tunes the draft tree: it needs a head (--draft_checkpoint_path, and no --no_draft)")
    args.tree_topk = args.tree_topk or 10
    args.total_tokens = args.total_tokens or 60
    args.prompts = args.prompts or [DEMO_PROMPT]
    args.prompt = args.prompts[0]
    args.max_new_tokens = args.max_new_tokens or (DEMO_MAX_NEW_TOKENS if args.demo else 200)
    return args


def read_prompts(path: Path) -> list:
    """A prompt file: one prompt a line, a JSON string or a FastChat question ({"turns": [...]}, its first
    turn); blank lines skipped. ValueError names the line of a mistake."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt_file {path}: cannot read it ({getattr(e, 'strerror', None) or e})")
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompt_file {path} line {n}: not JSON ({e.msg})")
        if isinstance(item, dict) and isinstance(item.get("turns"), list) and item["turns"]:
            item = item["turns"][0]
        if not isinstance(item, str):
            raise ValueError(f"--prompt_file {path} line {n}: expected a JSON string or a question with \"turns\"")
        if not item:
            raise ValueError(f"--prompt_file {path} line {n}: the prompt is empty")
        prompts.append(item)
    if not prompts:
        raise ValueError(f"--prompt_file {path} holds no prompts")
    return prompts


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor  # noqa: E402

from draft import (DraftHead, DraftTree, EagleDraft, build_tree, head_config, load_head,  # noqa: E402
                   read_draft_vocab, take)
from model import (EagletError, Int4Linear, Int8Linear, Transformer, attention_mask, causal_mask,  # noqa: E402
                   decode_mask, read_config)
from tokenizer import Tokenizer  # noqa: E402
import tp  # noqa: E402

PRECISIONS = dict(zip(PRECISION_NAMES, (torch.bfloat16, torch.float16, torch.float32)))


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter

    def __post_init__(self):
        if not all(map(math.isfinite, (self.temperature, self.top_p))):
            raise EagletError(f"temperature and top_p must be finite numbers, got {self.temperature} and {self.top_p}")
        if self.temperature < 0:
            raise EagletError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EagletError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EagletError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class GenerationResult:
    prompt_tokens: list
    tokens: list  # generated ids, prompt excluded
    seconds: float
    accept_lengths: list = field(default_factory=list)  # tokens emitted per cycle (speculative only)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.seconds, 1e-9)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per cycle, bonus included."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


def logits_to_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """The target distribution under temperature, top-k and top-p; the one place sampling is defined."""
    logits = logits.float()
    # (logits - max) keeps the top logit at exactly 0, so a tiny temperature cannot make inf - inf = nan: it
    # tends to greedy. Below float32's smallest normal the temperature would round to 0 (0 / 0): clamp it.
    temperature = max(sampling.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p  # keeps the token crossing top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(probs: Tensor) -> Tensor:
    # Exponential race instead of torch.multinomial: same distribution, no device-to-host sync.
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def sample(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    return sample_from_probs(logits_to_probs(logits, sampling))


def prefill(model: Transformer, tokens: Tensor, start_pos: int):
    """Write tokens [1, T] at positions start_pos.. into the cache; return (last logits, all features)."""
    input_pos = torch.arange(start_pos, start_pos + tokens.shape[1], device=tokens.device)
    mask = causal_mask(input_pos, start_pos + tokens.shape[1])  # eager: attend over the filled slots only
    logits, hidden = model(tokens, input_pos, input_pos, mask, logits_idx=torch.tensor([-1], device=tokens.device))
    return logits[:, -1], hidden


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, sampling: SamplingConfig,
                     filled: int = 0):
    """token [1, 1] at input_pos [1] -> the next token [1]. Shapes fixed: compiled once, replayed.
    Eager callers may pass filled (input_pos + 1, known on the host): only those cache slots are read."""
    logits, _ = model(token, input_pos, input_pos, decode_mask(input_pos, filled or model.max_seq_length))
    token = sample(logits[:, -1], sampling)
    return token if model.tp_group is None else tp.flag_disagreement(model.tp_group, token)


def compile_step(step_fn: Callable, device: str):
    # CUDA graphs only make sense on CUDA; on CPU inductor alone still fuses the small ops.
    mode = "reduce-overhead" if device.startswith("cuda") else None
    return torch.compile(step_fn, mode=mode, fullgraph=True)


def compile_settings(target: Transformer, device: str):
    """A quantized Linear converts its weight inside the graph; inductor turns a one-row matmul over such a
    weight into a fused GEMV (reading int8 bytes, not a bf16 copy written each step) only with
    coordinate-descent tuning on (torch 2.13's mm decomposition), as gpt-fast sets it. bf16 targets keep
    cuBLAS's GEMV, as measured (BENCHMARKS.md)."""
    if str(device).startswith("cuda") and target.quantization:
        torch._inductor.config.coordinate_descent_tuning = True


def device_sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


@dataclass
class TreeConfig:
    """EAGLE-2's dynamic tree. What the cycle asks of a tree rule: total_tokens (nodes verified, root
    included), levels (the most tokens one cycle can emit), scratch (cache slots used past the context) and
    expand(). A static tree or a chain is another such class; --tree_topk 1 --total_tokens depth + 1 is a chain."""
    depth: int = 6  # expansion steps: the tree has depth + 1 levels below the root
    topk: int = 10  # children per expanded node, and nodes kept per level
    total_tokens: int = 60  # tokens the target verifies per cycle, root included

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1:
            raise EagletError(f"depth and tree_topk must be at least 1, got {self.depth} and {self.topk}")
        if not 2 <= self.total_tokens <= self.max_total_tokens:
            raise EagletError(f"total_tokens must be between 2 and {self.max_total_tokens} (1 + tree_topk + "
                              f"depth * tree_topk^2) for this depth and tree_topk, got {self.total_tokens}")

    @property
    def max_total_tokens(self) -> int:
        """The root plus every candidate the expansion produces."""
        return 1 + self.topk + self.depth * self.topk ** 2

    @property
    def levels(self) -> int:
        """Tokens a cycle emits at most: a path through every level below the root, and the bonus token."""
        return self.depth + 2

    @property
    def scratch(self) -> int:
        """Cache slots needed past the context: the verified tree, the draft's levels, the catch-up."""
        return max(self.total_tokens, self.depth * self.topk, self.levels)

    def expand(self, target: Transformer, draft: DraftHead, root, ctx_len, h_last) -> DraftTree:
        """Phase 1: the draft tree for this cycle (depth draft passes over the frontier, then the rerank)."""
        return build_tree(partial(draft.step, target), partial(draft.topk, target), h_last, root, ctx_len,
                          self.topk, self.depth, self.total_tokens, target.max_seq_length)


AUTO_SIZES = (16, 24, 32, 48, 64, 80, 96, 128)


def time_forward(target: Transformer, n_tokens: int, repeats: int = 5) -> float:
    """Seconds for one target forward over n_tokens (a verify of that many tree tokens costs the same)."""
    device = target.output.weight.device
    pos = torch.arange(n_tokens, device=device)
    tokens, mask = torch.zeros(1, n_tokens, dtype=torch.long, device=device), causal_mask(pos, target.max_seq_length)
    with torch.no_grad():
        # A tensor parallel target is timed eagerly: its all-reduces are not captured outside torch.compile.
        return seconds_per_call(partial(target, tokens, pos, pos, mask), device, repeats, target.tp_group is None)


def seconds_per_call(run: Callable, device, repeats: int, graph: bool = True) -> float:
    """run() timed as the compiled cycle runs its graphs: on CUDA captured once as a CUDA graph and replayed
    (timed eagerly, kernel launches would dominate and hide what the kernels cost)."""
    if str(device).startswith("cuda") and graph:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
            run(), run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    for _ in range(2):
        run()
    device_sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    device_sync(device)
    return (time.perf_counter() - t0) / repeats


def pick_total_tokens(target: Transformer, tree: TreeConfig, tolerance: float = 0.1, log=print) -> int:
    """--total_tokens auto: the largest tree whose verify costs at most (1 + tolerance) x the smallest's.
    While a forward is memory bound, extra tree tokens are nearly free; past that knee they cost time. The
    forward timed is this target's in its own format: an int4 target's knee comes earlier (tinygemm reads
    the weights again for every 16 rows), and the choice follows it."""
    largest = min(tree.max_total_tokens, target.max_seq_length)
    sizes = [n for n in AUTO_SIZES if n <= largest] or [largest]
    times = {n: time_forward(target, n) for n in sizes}
    chosen = max(n for n in sizes if times[n] <= (1 + tolerance) * times[sizes[0]])
    weights = (target.quantization or {}).get("mode") or str(target.tok_embeddings.weight.dtype)[6:]
    log(f"total_tokens auto ({weights} weights): verify "
        + ", ".join(f"{n}: {t * 1e3:.2f} ms" for n, t in times.items()) + f" -> {chosen}")
    return chosen


@dataclass
class TreeMeasure:
    """One tree of --tree auto's grid as measured: tau (tokens emitted per cycle) and seconds per cycle."""
    tree: TreeConfig
    tau: float
    cycle_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tau / self.cycle_s


def tree_name(tree: TreeConfig) -> str:
    return f"depth {tree.depth}, top-k {tree.topk}, {tree.total_tokens} tokens"


def check_tune_fits(trees: list, prompts: list, new_tokens: int, cache_slots: int, draft_vocab: int):
    """Refuse, before anything is measured, a tree the tuning cannot run: one whose scratch, after the longest
    calibration prompt and its new tokens, overflows the KV cache, or whose top-k exceeds the draft's vocabulary."""
    longest = max(len(p) for p in prompts)
    for tree in trees:
        need = longest + new_tokens + tree.scratch
        if need > cache_slots:
            raise EagletError(f"--tree auto: the tree {tree_name(tree)} needs {tree.scratch} scratch slots; with "
                              f"the longest calibration prompt ({longest} tokens) and its {new_tokens} new tokens "
                              f"that is {need}, over the KV cache ({cache_slots} slots; a larger --max_seq_length "
                              "makes room)")
        if tree.topk > draft_vocab:
            raise EagletError(f"--tree auto: the tree {tree_name(tree)} has tree_topk {tree.topk}, over the draft's "
                              f"vocabulary ({draft_vocab})")


@torch.no_grad()
def cycle_start(target: Transformer, draft: Optional[DraftHead], prompt: list) -> tuple:
    """(root, ctx_len, h_last) as generate() holds them after prefilling prompt: a cycle's fixed inputs (h_last
    None without a draft)."""
    device = target.output.weight.device
    logits, features = prefill(target, torch.tensor([prompt], device=device), 0)
    root = sample(logits, SamplingConfig())[0]
    h_last = draft_start(target, draft, prompt, 0, features, root) if draft is not None else None
    return root, torch.tensor(len(prompt), device=device), h_last


def draft_start(target: Transformer, draft: DraftHead, prompt: list, first: int, features: Tensor,
                root: Tensor) -> Tensor:
    """The draft's h_last before the first cycle: it reads the prompt's pairs (f_t, x_{t+1}) from position first
    on (features: the target's over prompt[first:]), the last one pairing with the root."""
    device = root.device
    pairs = torch.cat([torch.tensor(prompt[first + 1:], dtype=torch.long, device=device), root.view(1)])
    return catch_up(target, draft, pairs, features[0], torch.tensor(first, device=device),
                    torch.tensor(len(pairs) - 1, device=device))


def cycle_timing(target: Transformer) -> str:
    """How time_cycle times a cycle on this target's device."""
    cuda = target.output.weight.device.type == "cuda"
    return "the eager cycle replayed as a CUDA graph" if cuda and target.tp_group is None else "the eager cycle"


@torch.no_grad()
def time_cycle(target: Transformer, draft: DraftHead, tree: TreeConfig, start: tuple, repeats: int = 10) -> float:
    """Seconds per speculative_cycle of this tree from the fixed inputs start. The eager cycle, on CUDA captured
    as a CUDA graph and replayed (no launch overhead, as a compiled run has none), also for --compile runs:
    compiling the cycle for every tree of the grid would cost a compilation each."""
    run = partial(speculative_cycle, target, draft, *start, tree, SamplingConfig())
    return seconds_per_call(run, target.output.weight.device, repeats, target.tp_group is None)


def measure_tau(target: Transformer, draft: DraftHead, tree: TreeConfig, prompts: list, new_tokens: int) -> float:
    """Tokens emitted per cycle decoding each prompt greedily for new_tokens (no EOS stop), over full cycles:
    a run's last cycle, cut at new_tokens, is left out unless it is the only one."""
    emitted = cycles = 0
    for prompt in prompts:
        lengths = generate(target, prompt, new_tokens, SamplingConfig(), draft=draft, tree=tree).accept_lengths
        lengths = lengths[:-1] or lengths
        emitted, cycles = emitted + sum(lengths), cycles + len(lengths)
    return emitted / max(cycles, 1)


def best_tree(measured: list) -> TreeMeasure:
    """The most tokens/s; on a tie the fewest total_tokens, then the smaller depth, then the smaller top-k."""
    return max(measured, key=lambda m: (m.tokens_per_s, -m.tree.total_tokens, -m.tree.depth, -m.tree.topk))


def tune_tree(target: Transformer, draft: DraftHead, prompts: list, grid=TREE_GRID,
              new_tokens: int = CALIBRATION_TOKENS, timer: Optional[Callable] = None, log=print) -> tuple:
    """--tree auto's measurement: for each (depth, tree_topk, total_tokens) of grid, tau from decoding the
    prompts (token lists) and the seconds of one cycle from timer(target, draft, tree, start) (default
    time_cycle); keeps the most tokens/s = tau / cycle seconds (best_tree). Returns (tree, [TreeMeasure])."""
    trees = [TreeConfig(*point) for point in grid]
    check_tune_fits(trees, prompts, new_tokens, target.max_seq_length, draft.vocab_size)
    t0 = time.perf_counter()
    log(f"tree auto: measuring {len(trees)} trees (depth/top-k/tokens {grid_text(grid)}): tau from {len(prompts)} "
        f"prompts x {new_tokens} greedy tokens, cycle time of {cycle_timing(target)}")
    start = cycle_start(target, draft, prompts[0])
    measured = []
    for tree in trees:
        m = TreeMeasure(tree, measure_tau(target, draft, tree, prompts, new_tokens),
                        (timer or time_cycle)(target, draft, tree, start))
        log(f"  {tree_name(tree)}: tau {m.tau:.2f}, {m.cycle_s * 1e3:.2f} ms per cycle, "
            f"{m.tokens_per_s:.1f} tokens/s (tau / cycle)")
        measured.append(m)
    best = best_tree(measured)
    log(f"tree auto: {tree_name(best.tree)} ({best.tokens_per_s:.1f} tokens/s estimated), chosen in "
        f"{time.perf_counter() - t0:.1f} s of tuning")
    return best.tree, measured


def file_identity(path) -> dict:
    """A checkpoint as the cache knows it: its path, size and modification time (a rewritten file is another)."""
    path = Path(path).resolve()
    stat = path.stat()
    return {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def device_name(device) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if str(device).startswith("cuda") else "cpu"


def tree_key(target_path, head_path, target: Transformer, draft: DraftHead, device, precision: str, prompts: list,
             grid=TREE_GRID, new_tokens: int = CALIBRATION_TOKENS) -> dict:
    """What --tree auto's choice depends on, as the cache matches it: the checkpoints, the device, the weights'
    formats, the precision, tensor parallel's world size, how the cycle is timed (the same with and without
    --compile: see time_cycle), the grid and the calibration (prompts as tokens, new tokens)."""
    calibration = json.dumps([list(p) for p in prompts]).encode()
    return {"target": file_identity(target_path), "head": file_identity(head_path), "device": device_name(device),
            "weights": weights_format(target), "head_weights": weights_format(draft), "precision": precision,
            "draft_vocab": draft.vocab_size, "world_size": dist.get_world_size(target.tp_group) if target.tp_group
            else 1, "cycle_timing": cycle_timing(target), "grid": [list(point) for point in grid],
            "calibration": {"prompts_sha256": hashlib.sha256(calibration).hexdigest(), "new_tokens": new_tokens}}


def read_tree_choice(path: Path, key: dict, log=print) -> Optional[TreeConfig]:
    """The tree cached for key, or None: none cached, or a file that cannot be read (said, then tuned again)."""
    if not path.exists():
        return None
    try:
        for entry in json.loads(path.read_text())["choices"]:
            if entry["key"] == key:
                tree = TreeConfig(**entry["tree"])
                if [tree.depth, tree.topk, tree.total_tokens] not in key["grid"]:
                    raise ValueError(f"its tree {tree_name(tree)} is not in the grid")
                return tree
    except (OSError, ValueError, KeyError, TypeError, AttributeError, EagletError) as e:
        log(f"warning: the tree cache {path} cannot be read ({type(e).__name__}: {e}); tuning again")
    return None


def write_tree_choice(path: Path, key: dict, measured: list, chosen: TreeConfig, log=print):
    """Add (or replace) key's entry in the cache file, with what was measured; a file that cannot be read is
    replaced, one that cannot be written is said and left (the run goes on with its choice)."""
    try:
        entries = [e for e in json.loads(path.read_text())["choices"] if e["key"] != key]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        entries = []
    entries.append({"key": key, "tree": asdict(chosen), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "measured": [{**asdict(m.tree), "tau": m.tau, "cycle_ms": m.cycle_s * 1e3,
                                  "tokens_per_s": m.tokens_per_s} for m in measured]})
    partial_file = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial_file.write_text(json.dumps({"choices": entries}, indent=1))
        os.replace(partial_file, path)  # whole or not at all, also when two runs write at once
    except OSError as e:
        partial_file.unlink(missing_ok=True)
        log(f"warning: could not save the tree choice to {path}: {e.strerror or e}")


def pick_tree(target: Transformer, draft: DraftHead, prompts: list, key: dict, cache: Optional[Path],
              grid=TREE_GRID, new_tokens: int = CALIBRATION_TOKENS, group=None, timer: Optional[Callable] = None,
              log=print) -> TreeConfig:
    """--tree auto: the tree cached for key in the file cache, else tune_tree's choice, then cached (cache None:
    always measured, never saved). Under tensor parallel every rank tunes, in step; rank 0 reads and writes the
    cache, and its choice is every rank's."""
    cached = read_tree_choice(cache, key, log) if cache and not torchrun_rank() else None
    cached = tp.rank0_value(group, cached)
    if cached is not None:
        log(f"tree auto: {tree_name(cached)}, read from {cache} (tuned before for this target, head, device and "
            "format; not measured again: delete the file to tune again)")
        return cached
    chosen, measured = tune_tree(target, draft, prompts, grid, new_tokens, timer, log)
    chosen = tp.rank0_value(group, chosen)
    if cache and not torchrun_rank():
        write_tree_choice(cache, key, measured, chosen, log)
    return chosen


def accept(tree: DraftTree, logits: Tensor, sampling: SamplingConfig, levels: int):
    """The longest path of the tree the target agrees with, and the bonus token after it.

    At every node the target picks its own next token: argmax (greedy), or one draw from its processed
    distribution p. A child is accepted iff it is its parent's pick. For sampling this IS the recursive
    rule of tree speculative sampling (try the children in order, accept x with probability p(x), zero and renormalise on
    rejection, bonus from what is left): with deterministic drafts that rule accepts child x with
    probability exactly p(x), and otherwise yields a draw from p restricted to the non-children -- the
    same as one draw x ~ p, taken as the accepted child if it is one and as the bonus if not.
    Returns (path [levels]: the path's tree index at each depth, 0 past its end; accepted drafts; bonus);
    a batch of trees: the same per row, with a leading [B].
    """
    pick = sample(logits, sampling)  # [N]
    correct = tree.tokens == pick.gather(-1, tree.parents)
    correct[..., 0] = True
    accepted = (tree.ancestors & ~correct[..., None, :]).sum(dim=-1) == 0  # the node and all its ancestors correct
    # Siblings differ, so the accepted nodes form one chain; take its end. (Indices stay 1-element
    # tensors: indexing with a 0-d tensor would read it back to the host.)
    best = torch.where(accepted, tree.depths, -1).argmax(dim=-1, keepdim=True)
    depth_of_row = torch.arange(levels, device=pick.device)[:, None]  # [levels, 1]
    at_depth = tree.ancestors.gather(-2, best[..., None].expand(*best.shape, tree.tokens.shape[-1])) & \
        (tree.depths[..., None, :] == depth_of_row)
    path = at_depth.int().argmax(dim=-1)
    return path, tree.depths.gather(-1, best)[..., 0], pick.gather(-1, best)[..., 0]


def verify(target: Transformer, tree: DraftTree, ctx_len: Tensor):
    """Phase 2: one target forward over the tree, K/V to the scratch slots after the context (per row: a batch
    of trees, each after its own row's context)."""
    n = tree.tokens.shape[-1]
    start = ctx_len[..., None]
    logits, features = target(tree.tokens.view(-1, n), start + tree.depths, start + torch.arange(n, device=ctx_len.device),
                              attention_mask(ctx_len, tree.ancestors, target.max_seq_length))
    return logits.view(*tree.tokens.shape, -1), features.view(*tree.tokens.shape, -1)


def commit(target: Transformer, tree: DraftTree, logits: Tensor, ctx_len: Tensor, sampling: SamplingConfig,
           levels: int):
    """Phase 3: acceptance, and the accepted path's K/V moved in place to the slots after the context.
    Returns the emitted tokens (padded to levels), accepted drafts, the bonus token and the path."""
    path, n_accepted, bonus = accept(tree, logits, sampling, levels)
    steps = torch.arange(levels, device=ctx_len.device)
    emitted = torch.where(steps == n_accepted[..., None], bonus[..., None], tree.tokens.gather(-1, path.roll(-1, -1)))
    start = ctx_len[..., None]
    target.compact_kv(start + path, start + steps)
    return emitted, n_accepted, bonus, path


def catch_up(target: Transformer, draft: DraftHead, emitted: Tensor, features: Tensor, ctx_len: Tensor,
             n_accepted: Tensor) -> Tensor:
    """Phase 4: the draft reads the new pairs (f_t, x_{t+1}) with the target's true features, padded to a
    fixed count; returns its output for the last real pair."""
    pos = ctx_len[..., None] + torch.arange(emitted.shape[-1], device=ctx_len.device)
    causal = torch.ones(pos.shape[-1], pos.shape[-1], dtype=torch.bool, device=ctx_len.device).tril()
    # causal_mask(pos, ...) built from ctx_len itself: split attention's flex mask_mod reads it, a graph input
    h = draft.step(target, emitted, features, pos, pos, attention_mask(ctx_len, causal, draft.max_seq_length))
    return take(h, n_accepted[..., None])[..., 0, :]


def speculative_cycle(target: Transformer, draft: DraftHead, root: Tensor, ctx_len: Tensor, h_last: Tensor,
                      tree_config: TreeConfig, sampling: SamplingConfig):
    """One EAGLE-2 cycle with fixed shapes: expand, verify, commit, catch up.

    On entry the target's cache holds ctx_len tokens, root is the next token (not yet in the cache) and
    h_last the draft's output for its last pair (f_{ctx_len-1}, root). Returns the emitted tokens (padded
    to tree_config.levels), how many drafts were accepted (tokens emitted = that + 1), and the next root, ctx_len
    and h_last. Nothing here reads a value back to the host.
    """
    tree = tree_config.expand(target, draft, root, ctx_len, h_last)
    logits, features = verify(target, tree, ctx_len)
    emitted, n_accepted, bonus, path = commit(target, tree, logits, ctx_len, sampling, tree_config.levels)
    h_last = catch_up(target, draft, emitted, take(features, path), ctx_len, n_accepted)
    next_ctx = ctx_len + n_accepted + 1
    if target.tp_group is not None:  # every rank must have decided the same (tp.py); -1 says they did not
        n_accepted = tp.flag_disagreement(target.tp_group, n_accepted, tree.tokens, emitted)
    return emitted, n_accepted, bonus, next_ctx, h_last


# EAGLET_RUN_AHEAD=0 turns running ahead off (an A/B for measuring it; see run_calls).
RUN_AHEAD = os.environ.get("EAGLET_RUN_AHEAD", "1") != "0"


@torch.no_grad()
def generate(model: Transformer, prompt_tokens: list, max_new_tokens: int, sampling: SamplingConfig,
             eos_ids=(), start_pos: int = 0, on_tokens: Optional[Callable] = None,
             draft: Optional[DraftHead] = None, tree: Optional[TreeConfig] = None,
             step_fn: Optional[Callable] = None, run_ahead: Optional[bool] = None) -> GenerationResult:
    """Plain decoding, or EAGLE-2 speculative decoding when a draft head is given.

    The caches must already hold prompt_tokens[:start_pos] (multi-turn chat reuse). step_fn replaces
    decode_one_token / speculative_cycle (their compiled versions). on_tokens(new) sees the tokens of each
    step; if it returns a number, that many of them are kept and generation ends (stop strings).
    run_ahead (default: on CUDA, unless EAGLET_RUN_AHEAD=0) queues step k+1 before reading step k's tokens
    (see run_calls).
    """
    prompt_tokens = one_prompt(prompt_tokens)
    tree = tree or TreeConfig()
    check_fits(model, len(prompt_tokens), max_new_tokens, tree.scratch if draft else 0)
    if max_new_tokens == 0:
        return GenerationResult(list(prompt_tokens), [], 0.0)
    device = model.output.weight.device
    device_sync(device)
    t0 = time.perf_counter()
    # The draft needs the feature of the token before the new ones, so re-run that one (same KV).
    first = max(start_pos - 1, 0) if draft else start_pos
    logits, features = prefill(model, torch.tensor([prompt_tokens[first:]], device=device), first)
    token = sample(logits, sampling)[0]  # 0-d, the shape every later root has too
    tokens, accept_lengths = [], []
    emit = partial(keep_new, tokens, eos_ids=eos_ids, max_new_tokens=max_new_tokens, on_tokens=on_tokens)
    if not emit([token.item()]):
        ctx_len = torch.tensor(len(prompt_tokens), device=device)
        if draft is None:
            call, state, widest = partial(plain_call, model, sampling, step_fn), (token, ctx_len), 1
        else:
            h_last = draft_start(model, draft, prompt_tokens, first, features, token)
            call, state = partial(cycle_call, model, draft, tree, sampling, step_fn), (token, ctx_len, h_last)
            widest = tree.levels
        ahead = device.type == "cuda" and RUN_AHEAD if run_ahead is None else run_ahead
        run_calls(call, state, len(prompt_tokens), tokens, emit, max_new_tokens, widest,
                  tree.scratch if draft else 1, model.max_seq_length, ahead,
                  accept_lengths if draft is not None else None)
    device_sync(device)
    return GenerationResult(list(prompt_tokens), tokens, time.perf_counter() - t0, accept_lengths)


def plain_call(model, sampling, step_fn, state, filled: int):
    """One plain step queued on the device: (what the host reads: [the token], the next state)."""
    token, ctx_len = state
    eager = {} if step_fn else {"filled": filled + 1}  # compiled: fixed shapes; eager: attend over what is filled
    token = (step_fn or decode_one_token)(model, token.view(1, 1), ctx_len.view(1), sampling, **eager).clone()
    return token.view(1), (token, ctx_len + 1)


def cycle_call(model, draft, tree, sampling, step_fn, state, filled: int):
    """One speculative cycle queued on the device: ([accepted drafts, emitted tokens...], the next state). The
    outputs are cloned: a CUDA-graph replay of the next cycle overwrites its static outputs."""
    emitted, n_accepted, token, ctx_len, h_last = [t.clone() for t in (step_fn or speculative_cycle)(
        model, draft, *state, tree, sampling)]
    return torch.cat([n_accepted.view(1), emitted]), (token, ctx_len, h_last)


def run_calls(call: Callable, state, n_prompt: int, tokens: list, emit: Callable, max_new_tokens: int, widest: int,
              scratch: int, max_seq_length: int, ahead: bool, accept_lengths: Optional[list]):
    """Steps or cycles until emit() says done, each read back to the host once (the one sync per call).

    Run ahead: call k+1 is queued (from call k's outputs, still on the device) before call k's tokens are read,
    so the GPU is not idle while the host reads, streams and checks them. When call k ends the generation (EOS,
    max_new_tokens, a stop string) call k+1 is thrown away: its tokens are never read and what it wrote lies
    past the kept context. It is queued only when call k may not end it and when it surely fits in the cache."""
    pending, state = call(state, n_prompt + len(tokens) - 1)
    while True:
        ctx = n_prompt + len(tokens) - 1  # the context call k starts from (its root is not in the cache yet)
        queued = None
        if ahead and max_new_tokens - len(tokens) > 1 and ctx + widest + scratch <= max_seq_length:
            queued = call(state, ctx + widest)  # its context is at most call k's plus what call k emits
        out = pending.tolist()
        new = [check_agreed(out[0])] if accept_lengths is None else out[1:check_agreed(out[0]) + 2]
        n_before = len(tokens)
        done = emit(new)
        if accept_lengths is not None:  # tokens emitted, not accepted: those cut at EOS or max_new_tokens don't count
            accept_lengths.append(len(tokens) - n_before)
        if done:
            return
        pending, state = queued or call(state, n_prompt + len(tokens) - 1)


def check_agreed(value: int) -> int:
    """value, unless tensor parallel ranks decided differently (tp.flag_disagreement put -1 in its place)."""
    if value < 0:
        raise tp.RanksDisagree("tensor parallel ranks decided differently: their kernels are not deterministic "
                               "across ranks (different GPU models, libraries or tuning?), so the output would not "
                               "be exact; run on identical GPUs and software, or without --compile")
    return value


def keep_new(tokens: list, new: list, eos_ids, max_new_tokens: int, on_tokens: Optional[Callable] = None) -> bool:
    """Append new to tokens up to EOS or max_new_tokens (on_tokens may keep fewer: a stop string); True when
    the generation is done."""
    start = len(tokens)
    for t in new:
        tokens.append(t)
        if t in eos_ids or len(tokens) == max_new_tokens:
            break
    keep = on_tokens(tokens[start:]) if on_tokens else None
    if keep is not None:
        del tokens[start + keep:]
        return True
    return tokens[-1] in eos_ids or len(tokens) == max_new_tokens


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list, max_new_tokens: int, sampling: SamplingConfig,
                   eos_ids=(), on_tokens: Optional[Callable] = None, draft: Optional[DraftHead] = None,
                   tree: Optional[TreeConfig] = None, step_fn: Optional[Callable] = None) -> list:
    """Several prompts decoded together, one GenerationResult each; greedy, every row gets the tokens and
    accepted lengths generate() gives it alone. The caches must hold len(prompts) rows (setup_caches).

    The prompts are prefilled together, padded after their ends: a row's K/V past its prompt is never seen
    (its masks stop at its own context) and is overwritten as it goes on. Then one step or one cycle serves
    every row, each at its own context. A row that is done (EOS, max_new_tokens, or on_tokens(row, new)
    keeping fewer tokens) stays where it is, its outputs ignored, while the others go on: the shapes never
    change. A result's seconds run until its own row was done.
    """
    prompts = [one_prompt(p) for p in prompts]
    tree = tree or TreeConfig()
    for prompt in prompts:
        check_fits(model, len(prompt), max_new_tokens, tree.scratch if draft else 0)
    check_rows(model, draft, len(prompts))
    device = model.output.weight.device
    device_sync(device)
    t0 = time.perf_counter()
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    padded = torch.tensor([p + [p[-1]] * (max(map(len, prompts)) - len(p)) for p in prompts], device=device)
    pos = torch.arange(padded.shape[1], device=device)
    logits, features = model(padded, pos, pos, causal_mask(pos, padded.shape[1]), logits_idx=(lengths - 1)[:, None])
    token = sample(logits[:, 0], sampling)  # [B]
    rows = [[] for _ in prompts]
    accept_lengths, seconds = [[] for _ in prompts], [0.0] * len(prompts)
    emits = [partial(keep_new, rows[b], eos_ids=eos_ids, max_new_tokens=max_new_tokens,
                     on_tokens=partial(on_tokens, b) if on_tokens else None) for b in range(len(prompts))]
    new, ctx_len, next_ctx = [[t] for t in token.tolist()], lengths.clone(), lengths.clone()
    if draft is not None:
        step_fn = step_fn or speculative_cycle
        # Row b's pairs (f_t, x_{t+1}): its prompt shifted by one, its root at index len_b - 1.
        pairs = torch.cat([padded[:, 1:], padded[:, :1]], dim=1).scatter(1, (lengths - 1)[:, None], token[:, None])
        h_last = catch_up(model, draft, pairs, features, torch.zeros_like(lengths), lengths - 1)
    done, live, n_live = [False] * len(prompts), None, -1
    while True:
        for b in range(len(prompts)):
            if not done[b]:
                n_before = len(rows[b])
                done[b] = emits[b](new[b])
                if draft is not None and n_before:  # the cycles' counts; the prefill's token is not one
                    accept_lengths[b].append(len(rows[b]) - n_before)
                seconds[b] = time.perf_counter() - t0 if done[b] else 0.0
        if all(done):
            break
        # A row that is done stays at the context its last step started from: below its end, so the steps
        # it still takes (their outputs ignored) write inside its cache. (The mask is sent only when it changes.)
        if n_live != done.count(False):
            n_live, live = done.count(False), torch.tensor([not d for d in done], device=device)
        ctx_len = torch.where(live, next_ctx, ctx_len)
        if draft is None:
            token = (step_fn or decode_one_token)(model, token[:, None], ctx_len[:, None], sampling).clone()
            next_ctx = ctx_len + 1
            new = [[check_agreed(t)] for t in token.tolist()]
        else:
            emitted, n_accepted, token, next_ctx, h_last = [
                t.clone() for t in step_fn(model, draft, token, ctx_len, h_last, tree, sampling)]
            out = torch.cat([n_accepted[:, None], emitted], dim=1).tolist()  # the one host sync of the cycle
            new = [o[1:check_agreed(o[0]) + 2] for o in out]
    return [GenerationResult(list(p), r, s, a) for p, r, s, a in zip(prompts, rows, seconds, accept_lengths)]


def check_rows(model: Transformer, draft: Optional[DraftHead], n_rows: int):
    """The caches hold at least n_rows rows."""
    caches = [model.layers[0].attention.kv_cache] + ([draft.layer.attention.kv_cache] if draft is not None else [])
    held = min(c.k_cache.shape[0] for c in caches if c is not None) if all(caches) else 0
    if n_rows > held:
        raise EagletError(f"{n_rows} prompts at once need caches of {n_rows} rows; they hold {held} "
                          "(setup_caches(max_batch_size=...))")


def one_prompt(prompt_tokens) -> list:
    """The prompt as a list of ints; a batch (several prompts) is refused by name."""
    if isinstance(prompt_tokens, Tensor):
        if prompt_tokens.ndim == 2 and prompt_tokens.shape[0] == 1:
            prompt_tokens = prompt_tokens[0]
        prompt_tokens = prompt_tokens.tolist() if prompt_tokens.ndim == 1 else [prompt_tokens.tolist()]
    prompt_tokens = list(prompt_tokens)
    if not all(isinstance(t, int) for t in prompt_tokens):
        raise EagletError("generate() takes one prompt, a list of token ids; for several prompts at once (a batch) "
                          "call generate_batch")
    return prompt_tokens


def check_fits(model: Transformer, n_prompt: int, max_new_tokens: int, extra: int = 0):
    need = n_prompt + max_new_tokens + extra
    if n_prompt == 0:
        raise EagletError("the prompt is empty")
    if max_new_tokens < 0:
        raise EagletError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if need > model.max_seq_length:
        raise EagletError(f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens})"
                          f"{f' + tree scratch ({extra})' if extra else ''} = {need} exceeds the cache "
                          f"({model.max_seq_length} tokens)")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one forward over one token reads: every weight once (shared tensors, e.g. tied
    embeddings, once; quantized ones as they are read: values, scales and zeros), but only one row of an embedding
    table that is not also an lm_head."""
    sizes = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    linear = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding) and m.weight.data_ptr() not in linear:
            sizes[m.weight.data_ptr()] = m.weight[0].numel() * m.weight.element_size()
    return sum(sizes.values())


def weights_format(module: torch.nn.Module) -> str:
    """How a model's weights are stored: 'int4 g128, lm_head int8', 'int8', or the dtype of float weights."""
    int4 = [m for m in module.modules() if isinstance(m, Int4Linear)]
    int8 = any(isinstance(m, Int8Linear) for m in module.modules())
    if int4:
        return f"int4 g{int4[0].groupsize}" + (", lm_head int8" if int8 else "")
    if int8:
        return "int8"
    return str(next(module.parameters()).dtype).removeprefix("torch.")


def cycle_weight_bytes(target: Transformer, draft: DraftHead, tree: TreeConfig) -> int:
    """Weights one speculative cycle reads: the target once (verify), and per draft pass (depth + 1 of
    them) the head and the lm_head it scores with (the target's, its rows for a draft vocabulary, or its own)."""
    lm_head = draft.lm_head_module(target)
    own = any(lm_head is m for m in draft.modules())
    return weight_bytes(target) + (tree.depth + 1) * (weight_bytes(draft) + (0 if own else weight_bytes(lm_head)))


def peak_memory_gb(device) -> float:
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise EagletError("--device cuda was asked for but no CUDA device is available")
    return name


def converted_file(path, name: str) -> Path:
    """A converted checkpoint given as the file or as its folder (holding name: model.pth or draft.pth);
    a Hugging Face file or folder is refused with the command that converts it."""
    path = Path(path)
    convert = "convert it first: python convert_hf_checkpoint.py --checkpoint_dir"
    if path.is_dir():
        if (path / name).is_file():
            return path / name
        others = sorted(p.name for p in path.glob("*.pth"))
        if others:
            raise EagletError(f"no {name} in {path}; it holds {', '.join(others)}: give the file itself")
        if any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")):
            raise EagletError(f"{path} holds Hugging Face weights, not a converted {name}: {convert} {path}")
        raise EagletError(f"no {name} in {path} ({convert} on the model's folder)")
    if path.suffix in (".safetensors", ".bin") or path.name.endswith(".index.json"):
        raise EagletError(f"{path} is a Hugging Face weights file, not a converted {name}: {convert} {path.parent}")
    return path


def load_target(checkpoint_path, device: str, precision: str, max_seq_length: int = 0, group=None) -> Transformer:
    """The target on device in precision, with a KV cache of max_seq_length slots (none if 0).
    checkpoint_path: model.pth (or a quantized one) or its folder. group: tensor parallel, this rank's shard."""
    path, dtype = converted_file(checkpoint_path, "model.pth"), PRECISIONS[precision]
    model = tp.load_sharded(path, group, device, dtype) if group is not None else \
        Transformer.from_checkpoint(path, device=device, dtype=dtype)
    if max_seq_length:
        with torch.device(device):
            model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)
    return model


def load_draft(checkpoint_path, target: Transformer, draft_vocab=None, log=None) -> DraftHead:
    """An EAGLE-1/2 or EAGLE-3 head for this target, on its device and in its dtype, with a cache as long as
    the target's (if that has one yet). The target is set to return the features the head reads.
    draft_vocab: a file of the target ids an EAGLE-1/2 head may propose; by default draft_vocab.json
    beside the head, if there is one ("full": the whole vocabulary)."""
    checkpoint_path = converted_file(checkpoint_path, "draft.pth")
    weight = target.tok_embeddings.weight  # float in every format: the activations' device and dtype
    draft = load_head(checkpoint_path, target.args, device=weight.device, dtype=weight.dtype)
    target.set_feature_layers(draft.feature_layers)
    beside = Path(checkpoint_path).parent / "draft_vocab.json"
    if draft_vocab is None and isinstance(draft, EagleDraft) and beside.is_file():
        draft_vocab = beside
    if draft_vocab is not None and str(draft_vocab) != "full":
        if not isinstance(draft, EagleDraft):
            raise EagletError("an EAGLE-3 head has its own draft vocabulary (d2t); --draft_vocab is for EAGLE-1/2 heads")
        draft.restrict_vocab(target, read_draft_vocab(draft_vocab, target.args.vocab_size))
        if log:
            log(f"draft vocabulary: {draft.vocab_size} of {target.args.vocab_size} tokens, from {draft_vocab}")
    if target.max_seq_length:
        draft.setup_caches(target.max_seq_length)
    return draft


class TextStreamer:
    """Prints text as tokens arrive. Decodes the whole reply after the prompt's last token, so that word
    boundaries (sentencepiece's leading spaces) and multi-token characters come out right. `text` is the
    whole continuation: the prompt's text followed by it is what was printed. With stop strings, the text
    ends before the first one, and a call returns how many of its new tokens to keep (generate() stops)."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: list, enabled: bool = True, stop=()):
        self.tokenizer, self.enabled, self.stop = tokenizer, enabled, [s for s in stop or () if s]
        self.tokens = [t for t in prompt_tokens[-1:] if t not in tokenizer.eos_ids]
        self.skip = len(tokenizer.decode(self.tokens))
        self.text, self.printed = "", 0

    def __call__(self, new_tokens: list) -> Optional[int]:
        before = len(self.tokens)
        self.tokens.extend(t for t in new_tokens if t not in self.tokenizer.eos_ids)
        self.text = self.tokenizer.decode(self.tokens)[self.skip:]
        if self.stop and self.stop_at(self.text) is not None:
            for keep in range(1, len(new_tokens) + 1):  # the fewest new tokens whose text holds a stop string
                kept = [t for t in new_tokens[:keep] if t not in self.tokenizer.eos_ids]
                end = self.stop_at(self.tokenizer.decode(self.tokens[:before] + kept)[self.skip:])
                if end is not None:
                    self.text = self.text[:end]
                    self.flush()
                    return keep
        if not self.text.endswith("\ufffd"):  # wait for the rest of a multi-token character
            # hold back what could be the start of a stop string
            self.flush(len(self.text) - max((len(s) - 1 for s in self.stop), default=0))
        return None

    def stop_at(self, text: str) -> Optional[int]:
        ends = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(ends) if ends else None

    def flush(self, upto: Optional[int] = None):
        upto = len(self.text) if upto is None else max(upto, self.printed)
        if self.enabled:
            print(self.text[self.printed:upto], end="", flush=True)
        self.printed = upto


def report(result: GenerationResult, model: Transformer, device: str, draft: Optional[DraftHead] = None,
           tree: Optional[TreeConfig] = None):
    """Tokens/s, the weights read per second as they are read (plain: the target per token; speculative:
    the target per cycle and the draft per draft pass; the prefill once), peak memory, and tau."""
    cycles = len(result.accept_lengths)
    if draft is None:
        n_bytes = len(result.tokens) * weight_bytes(model)
    else:
        n_bytes = weight_bytes(model) + cycles * cycle_weight_bytes(model, draft, tree)
    per_rank = " per rank (rank 0's shard)" if model.tp_group is not None else ""
    print(f"\n{len(result.tokens)} tokens in {result.seconds:.2f} s: {result.tokens_per_s:.2f} tokens/s, "
          f"weights read {n_bytes / max(result.seconds, 1e-9) / 1e9:.2f} GB/s{per_rank}, "
          f"peak memory {peak_memory_gb(device):.2f} GB{per_rank}")
    if cycles:
        counts = Counter(result.accept_lengths)
        histogram = ", ".join(f"{n}: {counts[n]}" for n in sorted(counts))
        print(f"tau {result.tau:.2f} tokens emitted per cycle over {cycles} cycles "
              f"(tokens per cycle: count -- {histogram})")


def warm_up(gen: Callable, prompt: list, max_new_tokens: int):
    """Run the compiled step a few times so that compilation and graph capture are not timed later
    (no more tokens than the run itself asks for: the cache is sized for that)."""
    t0 = time.perf_counter()
    gen(prompt, min(12, max_new_tokens))
    print(f"compilation and warm-up: {time.perf_counter() - t0:.1f} s")


def run_once(args, gen: Callable, tokenizer: Tokenizer, prompt: list, show: Callable):
    samples = []
    if args.compile:
        warm_up(gen, prompt, args.max_new_tokens)
    for i in range(args.num_samples):
        torch.manual_seed(args.seed + i)
        print(f"--- sample {i + 1}/{args.num_samples}")
        print(args.prompt, end="", flush=True)
        streamer = TextStreamer(tokenizer, prompt, stop=args.stop)
        result = gen(prompt, args.max_new_tokens, on_tokens=streamer)
        streamer.flush()
        show(result)
        samples.append(sample_record(args.seed + i, result, streamer.text))
    summary = summarize(samples)
    if args.num_samples > 1:
        print(f"\n{len(samples)} samples: {summary['tokens_per_s_mean']:.2f} tokens/s mean (min "
              f"{summary['tokens_per_s_min']:.2f}, max {summary['tokens_per_s_max']:.2f})"
              + (f", tau {summary['tau']:.2f} over all {summary['cycles']} cycles" if summary["cycles"] else ""))
    demo_note(args)
    if args.json_out and not torchrun_rank():
        write_output(args.json_out, json.dumps({"prompt_tokens": prompt, "samples": samples, **summary}))


def sample_record(seed: int, result: GenerationResult, text: str) -> dict:
    """One sample as --json_out writes it."""
    return {"seed": seed, "tokens": result.tokens, "text": text, "tokens_per_s": result.tokens_per_s,
            "accept_lengths": result.accept_lengths, "cycles": len(result.accept_lengths),
            "tau": result.tau if result.accept_lengths else None}


def run_batches(args, gen_batch: Callable, tokenizer: Tokenizer, prompts: list, rows: int):
    """Several prompts, rows at a time (the last batch filled up with copies of its last prompt, so that shapes
    and the compiled graph stay the same; their results are dropped). Each prompt's text and figures after its
    batch; --json_out: a list, one object per prompt as for one prompt."""
    batches = [prompts[i:i + rows] for i in range(0, len(prompts), rows)]
    if args.compile:
        warm_up(gen_batch, batches[0] + batches[0][-1:] * (rows - len(batches[0])), args.max_new_tokens)
    samples = [[] for _ in prompts]
    tokens, seconds = 0, 0.0
    for i in range(args.num_samples):
        torch.manual_seed(args.seed + i)
        for n, batch in enumerate(batches):
            full = batch + batch[-1:] * (rows - len(batch))
            streamers = [TextStreamer(tokenizer, p, enabled=False, stop=args.stop) for p in full]
            t0 = time.perf_counter()
            results = gen_batch(full, args.max_new_tokens, on_tokens=lambda row, new: streamers[row](new))
            seconds += time.perf_counter() - t0
            for row, result in enumerate(results[:len(batch)]):
                k = n * rows + row
                sample = f", sample {i + 1}/{args.num_samples}" if args.num_samples > 1 else ""
                print(f"--- prompt {k + 1}/{len(prompts)}{sample}")
                print(args.prompts[k] + streamers[row].text)
                tau = f", tau {result.tau:.2f} over {len(result.accept_lengths)} cycles" if result.accept_lengths else ""
                print(f"({len(result.tokens)} tokens, done after {result.seconds:.2f} s: "
                      f"{result.tokens_per_s:.2f} tokens/s for this prompt{tau})")
                samples[k].append(sample_record(args.seed + i, result, streamers[row].text))
                tokens += len(result.tokens)
    print(f"\n{len(prompts)} prompts x {args.num_samples} samples, {rows} at a time: {tokens} tokens in "
          f"{seconds:.2f} s, {tokens / max(seconds, 1e-9):.2f} tokens/s in all")
    demo_note(args)
    if args.json_out and not torchrun_rank():
        write_output(args.json_out, json.dumps([{"prompt_tokens": p, "samples": s, **summarize(s)}
                                                for p, s in zip(prompts, samples)]))


def demo_note(args):
    if args.demo:
        print("(the demo's target has 4M parameters: on a CPU its forward costs about as much as a draft pass, so "
              "the tree's draft passes cost more than the target forwards they save and --no_draft is faster here; "
              "the text is the same either way. Speculation pays where each forward reads gigabytes of weights: "
              "a 7B model on a GPU)")


def summarize(samples: list) -> dict:
    """Across samples: tokens/s mean, min and max, and tau over all their cycles (tokens emitted per cycle)."""
    speeds = [s["tokens_per_s"] for s in samples]
    cycles = sum(s["cycles"] for s in samples)
    emitted = sum(sum(s["accept_lengths"]) for s in samples)
    return {"tokens_per_s_mean": sum(speeds) / len(speeds), "tokens_per_s_min": min(speeds),
            "tokens_per_s_max": max(speeds), "cycles": cycles, "tau": emitted / cycles if cycles else None}


CHAT_HELP = "/reset starts a new conversation, /help shows this; /quit, Ctrl-D or Ctrl-C quits; Ctrl-C in a reply stops it"


def read_turn() -> Optional[str]:
    """The user's next message; None when they quit (end of input, Ctrl-D, Ctrl-C or /quit)."""
    while True:
        try:  # undecodable bytes: a strict stdin refuses them, a surrogateescape one passes them on to utf8_text
            user = utf8_text(input("\nUser: "))
        except (EOFError, KeyboardInterrupt):
            print()
            return None
        except (UnicodeDecodeError, ArgumentTypeError):
            print("error: that line is not valid UTF-8; type it again")
            continue
        if user.strip() == "/quit":
            return None
        if user.strip():
            return user


def run_interactive(args, gen: Callable, tokenizer: Tokenizer, cache_slots: int, scratch: int, show: Callable):
    """Multi-turn chat; the conversation's KV stays in the cache and only new tokens are prefilled.
    A reply to a prompt has the cache's slots less the prompt and the draft tree's scratch."""
    cache_room = lambda prompt: cache_slots - scratch - len(prompt)  # noqa: E731
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages, cached = [], []
    if args.compile:
        warm_up(gen, tokenizer.encode_chat(system + [{"role": "user", "content": "Hi"}]), args.max_new_tokens)
    torch.manual_seed(args.seed)
    print(f"Chat with the model. {CHAT_HELP}.")
    while (user := read_turn()) is not None:
        if user.strip() in ("/help", "/reset"):
            if user.strip() == "/reset":
                messages, cached = [], []
            print(CHAT_HELP if user.strip() == "/help" else "(a new conversation)")
            continue
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.encode_chat(system + messages)
        if cache_room(prompt) < 1 and len(messages) > 1:
            print("(the conversation no longer fits in the cache: starting a new one with this message)")
            messages, cached = messages[-1:], []
            prompt = tokenizer.encode_chat(system + messages)
        room = cache_room(prompt)
        if room < 1:
            print(f"error: this message makes a prompt of {len(prompt)} tokens; with the tree scratch ({scratch}) "
                  f"the cache ({cache_slots} slots) has no room for a reply; it was not sent "
                  f"(a larger --max_seq_length makes room)")
            messages.pop()
            continue
        start = 0
        while start < min(len(cached), len(prompt) - 1) and cached[start] == prompt[start]:
            start += 1
        print("Assistant: ", end="", flush=True)
        streamer = TextStreamer(tokenizer, prompt, stop=args.stop)
        try:
            result = gen(prompt, min(args.max_new_tokens, room), start_pos=start, on_tokens=streamer)
        except KeyboardInterrupt:  # the reply so far stays in the conversation; what the cache holds is unknown,
            streamer.flush()      # so the next turn prefills the whole conversation again
            print("\n(stopped)")
            messages.append({"role": "assistant", "content": streamer.text})
            cached = []
            continue
        streamer.flush()
        if room < args.max_new_tokens and len(result.tokens) == room:
            print(f"\n(reply cut at {room} tokens: the cache is full)", end="")
        show(result)
        cached = prompt + result.tokens[:-1]  # the last token was sampled but never fed back
        messages.append({"role": "assistant", "content": streamer.text if args.stop else
                         tokenizer.decode(result.tokens)})


def check_writable(path: Path, what: str):
    """Refuse, before any long work, an output file that cannot be written (missing folder, a directory,
    a read-only place). Creates nothing that was not there."""
    path = Path(path)
    if path.is_dir():
        raise EagletError(f"{what} {path} is a directory")
    if not path.parent.is_dir():
        raise EagletError(f"{what} {path}: the folder {path.parent} does not exist")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise EagletError(f"{what} {path} cannot be written: {e.strerror}")
    if not existed:
        path.unlink()


def write_output(path: Path, text: str):
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise EagletError(f"cannot write {path}: {e.strerror}")


def configs(args, draft: Optional[DraftHead] = None):
    """SamplingConfig and TreeConfig from the flags (the depth by default the head's); with --total_tokens
    auto or --tree auto, the tree sized for its largest candidate (the cache is sized for it; the choice itself
    is made once the model is loaded)."""
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k)
    if args.tree == "auto":  # the grid's tree of the most scratch, for the cache; the tree itself is tuned later
        return sampling, max((TreeConfig(*point) for point in TREE_GRID), key=lambda t: t.scratch)
    depth = args.depth or (draft.default_depth if draft is not None else TreeConfig.depth)
    tree = TreeConfig(depth, args.tree_topk, 2)  # checks depth and tree_topk
    auto = args.total_tokens == "auto"
    size = min(max(AUTO_SIZES), tree.max_total_tokens) if auto else args.total_tokens
    return sampling, replace(tree, total_tokens=size)  # checks the size


def cache_length(args, model: Transformer, prompt: Optional[list], scratch: int) -> int:
    """--max_seq_length, or what this run needs; a total over the model's limit names its parts."""
    limit = model.args.max_position_embeddings
    if prompt is None:
        size = args.max_seq_length or min(4096, limit)
        if size < scratch + 16:  # --interactive: room for a short turn and its reply
            raise EagletError(f"--max_seq_length {size} leaves no room for a conversation beside the tree scratch "
                              f"({scratch}): give at least {scratch + 16}")
        return size
    need = len(prompt) + args.max_new_tokens + scratch
    bound, what = (args.max_seq_length, f"--max_seq_length ({args.max_seq_length})") if args.max_seq_length else \
        (limit, f"the model's max_position_embeddings ({limit})")
    if need > bound:
        raise EagletError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({args.max_new_tokens})"
                          f"{f' + tree scratch ({scratch})' if scratch else ''} = {need} exceeds {what}")
    return args.max_seq_length or need


def check_tokenizer(tokenizer: Tokenizer, model: Transformer):
    """A model's embedding table may be padded a little past its tokenizer (Qwen2: by 0.3%), never by 10%,
    unless its config.json says which tokens it emits (tokenizer_vocab_size: the inflated demo's)."""
    n_tok, n_model = tokenizer.vocab_size, model.args.extra.get("tokenizer_vocab_size") or model.args.vocab_size
    if n_tok > n_model or n_tok < 0.9 * n_model:
        raise EagletError(f"the tokenizer has {n_tok} tokens but the model {n_model}: they do not belong together")


def load(args, group=None):
    """Model, tokenizer, draft, the tree, the prompts' tokens (None for --interactive) and the rows the caches
    hold, as the flags ask; under tensor parallel (group) this rank's shard of the target. No collective
    here: tp.agreed runs it."""
    sampling, tree = configs(args)  # checks the flags before anything is loaded
    if args.json_out and not torchrun_rank():  # rank 0 writes it
        check_writable(args.json_out, "--json_out")
    args.checkpoint_path = converted_file(args.checkpoint_path, "model.pth")
    if args.draft_checkpoint_path:
        args.draft_checkpoint_path = converted_file(args.draft_checkpoint_path, "draft.pth")
    model = load_target(args.checkpoint_path, args.device, args.precision, group=group)
    draft = load_draft(args.draft_checkpoint_path, model, args.draft_vocab, log=print) \
        if args.draft_checkpoint_path else None
    if draft is not None:
        sampling, tree = configs(args, draft)
    tokenizer = Tokenizer(args.checkpoint_path.parent, args.chat_template, args.chat_template_kwargs)
    check_tokenizer(tokenizer, model)
    if args.chat or args.interactive:
        print(f"chat template: {tokenizer.chat_template_source}")
    prompts = None if args.interactive else encode_prompts(args, tokenizer, args.prompts)
    scratch = tree.scratch if draft is not None else 0
    size = cache_length(args, model, max(prompts, key=len) if prompts else None, scratch)
    if args.tree == "auto":  # room for the tuning's decoding too, or a clear refusal before it starts
        calibration = encode_prompts(args, tokenizer, CALIBRATION_PROMPTS)
        need = max(map(len, calibration)) + CALIBRATION_TOKENS + scratch
        size = size if args.max_seq_length else max(size, min(need, model.args.max_position_embeddings))
        check_tune_fits([TreeConfig(*point) for point in TREE_GRID], calibration, CALIBRATION_TOKENS, size,
                        draft.vocab_size)
    rows = batch_rows(args, model, draft, len(prompts), size) if prompts and len(prompts) > 1 else 1
    with torch.device(args.device):
        model.setup_caches(max_batch_size=rows, max_seq_length=size)
    if draft is not None:
        draft.setup_caches(model.max_seq_length, rows)
    if draft is not None and tree.topk > draft.vocab_size:
        raise EagletError(f"tree_topk {tree.topk} exceeds the draft's vocabulary ({draft.vocab_size})")
    return model, tokenizer, draft, sampling, tree, prompts, rows


def encode_prompts(args, tokenizer: Tokenizer, texts) -> list:
    """Prompts as token lists, through the chat template (with --system) under --chat or --interactive."""
    if not (args.chat or args.interactive):
        return [tokenizer.encode(text) for text in texts]
    system = [{"role": "system", "content": args.system}] if args.system else []
    return [tokenizer.encode_chat(system + [{"role": "user", "content": text}]) for text in texts]


def auto_tree(args, model: Transformer, draft: DraftHead, tokenizer: Tokenizer, group, rows: int) -> TreeConfig:
    """--tree auto: the tree tuned for this run's target, head, device and format (or read from the cache),
    measured at batch 1 (the caches are made one row for it, then set back to rows)."""
    if rows > 1:
        model.setup_caches(1, model.max_seq_length)
        draft.setup_caches(model.max_seq_length)
    prompts = encode_prompts(args, tokenizer, CALIBRATION_PROMPTS)
    key = tree_key(args.checkpoint_path, args.draft_checkpoint_path, model, draft, args.device, args.precision,
                   prompts, TREE_GRID, CALIBRATION_TOKENS)
    tree = pick_tree(model, draft, prompts, key, tree_cache_file(), TREE_GRID, CALIBRATION_TOKENS, group)
    if rows > 1:
        model.setup_caches(rows, model.max_seq_length)
        draft.setup_caches(model.max_seq_length, rows)
    return tree


def free_memory(device: str) -> int:
    """Bytes free for the caches: the GPU's free memory, or the machine's available RAM."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: no figure, no limit
        return 2 ** 62


def batch_rows(args, model: Transformer, draft: Optional[DraftHead], n_prompts: int, size: int) -> int:
    """Prompts decoded together: --batch_size, else all of them; at most what 90% of the free memory holds in
    caches of size slots (the target's and the head's)."""
    per_row = 2 * size * model.tok_embeddings.weight.element_size() * sum(
        layer.attention.n_kv * model.args.head_dim for layer in model.layers)
    if draft is not None:
        per_row += 2 * size * model.tok_embeddings.weight.element_size() * draft.args.n_local_heads * draft.args.head_dim
    free = free_memory(args.device)
    fit = max(1, int(0.9 * free // per_row))
    if args.batch_size and args.batch_size > fit:
        raise EagletError(f"--batch_size {args.batch_size}: caches of {size} slots for {args.batch_size} rows need "
                          f"{args.batch_size * per_row / 1e9:.2f} GB, and {free / 1e9:.2f} GB is free on "
                          f"{args.device}: the largest batch that fits is {fit} (or a smaller --max_seq_length)")
    rows = min(args.batch_size or n_prompts, n_prompts, fit)
    print(f"{n_prompts} prompts, {rows} at a time (caches {rows * per_row / 1e9:.2f} GB of {free / 1e9:.2f} GB free"
          + (f"; all {n_prompts} would need {n_prompts * per_row / 1e9:.2f} GB" if rows < min(n_prompts, args.batch_size or n_prompts) else "")
          + ")")
    return rows


def describe(args, model: Transformer, draft: Optional[DraftHead], tree: TreeConfig):
    """The start-up line: what runs, in which formats, where."""
    head = f"head {short_path(args.draft_checkpoint_path)} ({weights_format(draft)}), tree {tree.total_tokens} " \
        f"tokens, depth {tree.depth}, top-k {tree.topk}" if draft is not None else "no head (plain decoding)"
    ranks = f", tensor parallel over {dist.get_world_size(model.tp_group)} ranks" if model.tp_group else ""
    print(f"target {short_path(args.checkpoint_path)} ({weights_format(model)}); {head}; {args.device}, "
          f"{args.precision}{ranks}")
    trained = head_config(read_config(args.draft_checkpoint_path.parent), "the head").get(
        "max_position_embeddings") if draft else None
    if isinstance(trained, int) and trained < model.max_seq_length:
        print(f"note: the head was trained on up to {trained} positions (its max_position_embeddings) and the "
              f"cache holds {model.max_seq_length}: past {trained}, expect fewer tokens per cycle (the output "
              "stays exact)")
    quantized = [weights_format(m) for m in (model, draft) if m is not None and weights_format(m).startswith("int")]
    if args.device == "cpu" and quantized and args.precision != "bf16":
        print(f"note: on a CPU, quantized weights ({quantized[0]}) are fast with bf16 activations only (torch's CPU "
              f"kernels); in {args.precision} a step took 4-6x the fp32 model's (README.md): --precision bf16")


def short_path(path: Path) -> str:
    """folder/file: names a checkpoint (every target is a model.pth) without the whole path."""
    return f"{path.parent.name}/{path.name}"


def main(argv=None):
    args = parse_args(argv)
    group, status = None, 0
    if torchrun_rank():  # tensor parallel: rank 0 prints for all
        sys.stdout = open(os.devnull, "w")
    try:
        args.device = pick_device(args.device)
        args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
        group = tp.start(args.device)
        model, tokenizer, draft, sampling, tree, prompts, rows = tp.agreed(group, load, args, group)
        fewest = tp.smallest(group, rows)
        if fewest < rows:  # the ranks' free memory differs: every rank runs the same batches
            rows = fewest
            model.setup_caches(rows, model.max_seq_length)
            if draft is not None:
                draft.setup_caches(model.max_seq_length, rows)
        if draft is not None and args.total_tokens == "auto":  # timed on each rank, rank 0's choice for all
            tree = replace(tree, total_tokens=tp.rank0_value(group, pick_total_tokens(model, tree)))
        if args.tree == "auto":
            tree = auto_tree(args, model, draft, tokenizer, group, rows)
        describe(args, model, draft, tree)
        compile_settings(model, args.device)
        step_fn = speculative_cycle if draft is not None else decode_one_token
        step_fn = compile_step(step_fn, args.device) if args.compile else step_fn
        gen = partial(generate, model, sampling=sampling, eos_ids=tokenizer.eos_ids, draft=draft, tree=tree,
                      step_fn=step_fn)
        show = partial(report, model=model, device=args.device, draft=draft, tree=tree)
        if args.interactive:
            scratch = tree.scratch if draft is not None else 0
            run_interactive(args, gen, tokenizer, model.max_seq_length, scratch, show)
        elif len(prompts) > 1:
            gen_batch = partial(generate_batch, model, sampling=sampling, eos_ids=tokenizer.eos_ids, draft=draft,
                                tree=tree, step_fn=step_fn)
            run_batches(args, gen_batch, tokenizer, prompts, rows)
        else:
            run_once(args, gen, tokenizer, prompts[0], show)
    except EagletError as e:
        status = f"error: {e}" if not torchrun_rank() else 1
    except KeyboardInterrupt:
        print()
        status = 130
    if torchrun_rank() is not None:
        tp.finish(group, status)
    if status:
        sys.exit(status)

if __name__ == "__main__":
    main()
