"""The tree tuner. --tree auto: each tree of TREE_GRID (a DFlash head: its own, shaped by its block) measured on this device (tau from greedy decoding of the
calibration prompts, seconds per cycle from the cycle replayed), the most tokens/s = tau / cycle time kept, and
the choice cached per target, head, device and format. --total_tokens auto: the largest verify that costs about
what the smallest does.

Imports decode.py (the cycle it measures), draft.py, attention.py, model.py, tp.py and cli.py; generate.py's main calls it
(auto_tree, pick_total_tokens), never the other way. The grid and the calibration prompts are defined in cli.py,
where generate.py's --help names them before torch is imported.
"""
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from cli import CALIBRATION_PROMPTS, CALIBRATION_TOKENS, TREE_GRID, grid_text, torchrun_rank
from decode import TreeConfig, device_sync, catch_up_prompt, generate, prefill, speculative_cycle
from sampling import SamplingConfig, sample
from draft import DraftHead
from attention import causal_mask
from model import EagletError, Transformer, context_limit
from quantize import weights_format
import tp


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
    widest = max(trees, key=lambda tree: tree.scratch)  # named alone, so that one --max_seq_length fits them all
    need = longest + new_tokens + widest.scratch
    if need > cache_slots:
        raise EagletError(f"--tree auto: the tree {tree_name(widest)} needs {widest.scratch} scratch slots; with "
                          f"the longest calibration prompt ({longest} tokens) and its {new_tokens} new tokens "
                          f"that is {need}, over the KV cache ({cache_slots} slots; --max_seq_length {need} or more "
                          "makes room for every tree tried)")
    for tree in trees:
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
    if draft is not None:
        draft.catch_up_first(target, torch.tensor(prompt[:1], device=device))
    h_last = catch_up_prompt(target, draft, prompt, 0, features, root) if draft is not None else None
    return root, torch.tensor(len(prompt), device=device), h_last

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


def tree_cache_file() -> Path:
    """Where --tree auto keeps its choices: $EAGLET_CACHE/tree_choice.json, by default under ~/.cache/eaglet."""
    return Path(os.environ.get("EAGLET_CACHE") or Path.home() / ".cache" / "eaglet") / "tree_choice.json"


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
        try:
            partial_file.unlink(missing_ok=True)
        except OSError:  # its folder is not one (EAGLET_CACHE naming a file): nothing was written
            pass
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



def tree_grid(draft: Optional[DraftHead]) -> tuple:
    """--tree auto's trees for this head: its own (a DFlash head's, shaped by its block), else TREE_GRID."""
    return (draft.tree_grid() if draft is not None else ()) or TREE_GRID


def widest_tree(draft: Optional[DraftHead] = None) -> TreeConfig:
    """The grid's tree of the most scratch: the cache is sized for it before the tuning picks one."""
    return max((TreeConfig(*point) for point in tree_grid(draft)), key=lambda t: t.scratch)


def tuning_cache_size(max_seq_length: Optional[int], model: Transformer, draft: DraftHead, encode: Callable, size: int,
                      scratch: int) -> int:
    """The run's cache size (size slots), grown to hold the tuning's decoding too unless max_seq_length fixed
    it; a grid that does not fit is refused before anything is measured. encode: texts -> token lists."""
    calibration = encode(CALIBRATION_PROMPTS)
    need = max(map(len, calibration)) + CALIBRATION_TOKENS + scratch
    size = size if max_seq_length else max(size, min(need, context_limit(model.args)[0]))
    check_tune_fits([TreeConfig(*point) for point in tree_grid(draft)], calibration, CALIBRATION_TOKENS, size,
                    draft.vocab_size)
    return size


def auto_tree(args, model: Transformer, draft: DraftHead, encode: Callable, group, rows: int) -> TreeConfig:
    """--tree auto: the tree tuned for this run's target, head, device and format (or read from the cache),
    measured at batch 1 (the caches are made one row for it, then set back to rows). encode: texts -> token
    lists, as the run encodes its prompts."""
    if rows > 1:
        model.setup_caches(1, model.max_seq_length)
        draft.setup_caches(model.max_seq_length)
    prompts = encode(CALIBRATION_PROMPTS)
    key = tree_key(args.checkpoint_path, args.draft_checkpoint_path or args.draft_model, model, draft, args.device,
                   args.precision, prompts, tree_grid(draft), CALIBRATION_TOKENS)
    tree = pick_tree(model, draft, prompts, key, tree_cache_file(), tree_grid(draft), CALIBRATION_TOKENS, group)
    if rows > 1:
        model.setup_caches(rows, model.max_seq_length)
        draft.setup_caches(model.max_seq_length, rows)
    return tree


if __name__ == "__main__":
    raise SystemExit("error: tune.py is a part of generate.py, not a command: "
                     "`python generate.py --tree auto` tunes the draft tree")
