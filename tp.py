"""Tensor parallelism: one target sharded over the processes torchrun starts, the EAGLE cycle included.

    torchrun --standalone --nproc_per_node=4 generate.py --compile \\
        --checkpoint_path checkpoints/meta-llama/Llama-2-70b-chat-hf/model.pth \\
        --draft_checkpoint_path checkpoints/yuhuili/EAGLE-llama2-chat-70B/draft.pth

Each rank (process) holds 1/N of every layer, cut where no communication is needed inside it:
  attention   its n_head / N query heads and n_kv / N key/value heads (rows of wqkv's q, k and v parts),
              the output projection's matching input columns, and a KV cache of only those heads; rank r's
              query heads read rank r's K/V heads, so GQA stays grouped (N must divide the K/V heads)
  MLP         intermediate_size / N rows of the gate and up projections, those input columns of down
so each rank's output projection and down projection give a partial sum, and one all-reduce after each
(model.all_reduce) gives every rank the layer's output: 2 per layer per forward, none in the draft.
Replicated on every rank: the embeddings, norms and lm_head (the draft scores every candidate with the
lm_head; splitting it would add a collective per draft pass), and the draft head, which each rank runs.
Quantized files (quantize.py) shard the same way: int8 and int4 Linears are cut on the same dimensions,
their scales and zero points with them (an int4 layer's slice must hold whole groups).

Why every rank makes the same decisions without a broadcast: every value a token depends on is computed
from replicated weights or is an all-reduce's result, which hands every rank the same bits; the same
kernels on the same inputs give the same bits, so each rank builds the same tree, accepts the same path
and emits the same tokens, with the cycle's one host sync and no more (sampling: the same seed on every
rank). Should some kernel not be deterministic across ranks (different GPU models or libraries, tuning that
picks other kernels), each step and cycle checks it: one small all-reduce of what it decided (max and min
over the ranks) in the graph, read at the cycle's one host sync, so every rank stops with the same error.

Each rank reads only its part of model.pth: the file is memory-mapped and only its slices are copied.
Imports model.py, quantize.py and cli.py; decode.py and generate.py call it.
"""
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol
from torch.utils._python_dispatch import TorchDispatchMode

from cli import after_rank_0, torchrun_rank
from checkpoint import EagletError, load_state_dict
from model import ModelArgs, Transformer
from quantize import pop_quantization, use_quantized_linears

COLUMN_PARALLEL = ("attention.wqkv", "feed_forward.w13")  # output rows are split: each rank computes some outputs
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")  # input columns are split: each rank adds a partial sum


def start(device: str) -> Optional[dist.ProcessGroup]:
    """Under torchrun: join the process group (NCCL on CUDA, each rank on GPU LOCAL_RANK; gloo on CPU) and
    return it. Otherwise None: one process, no sharding."""
    if torchrun_rank() is None:
        return None
    local_rank = int(os.environ["LOCAL_RANK"])
    on_this_machine = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if device == "cuda":
        if torch.cuda.device_count() < on_this_machine:
            raise EagletError(f"{on_this_machine} ranks on this machine need as many GPUs, and it has "
                              f"{torch.cuda.device_count()}: give --nproc_per_node {torch.cuda.device_count()} "
                              "or fewer")
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    return dist.group.WORLD


def finish(group, status=0):
    """Leave the process group together (a rank that tears its connections down while another still uses them
    fails), then exit with status: a number, or a message for stderr and status 1. The interpreter's own
    teardown is skipped: torch 2.13's gloo can abort in it ('terminate called without an active exception',
    about 1 run in 10 on a loaded 2-core machine), which would turn a finished run into a failed one."""
    if group is not None and dist.is_initialized():
        dist.barrier(group)
        dist.destroy_process_group()
    if isinstance(status, str):
        print(status, file=sys.stderr)
        status = 1
    elif status:
        status = after_rank_0(status)  # rank 0 prints and exits first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def agreed(group, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) on every rank. If it fails with an EagletError on some rank (a checkpoint missing on
    one machine), it fails on every rank with that message, so none is left waiting in a collective. fn must
    not itself run collectives that a failing rank would miss."""
    if group is None:
        return fn(*args, **kwargs)
    try:
        result, error = fn(*args, **kwargs), None
    except EagletError as e:
        result, error = None, str(e)
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, message = failed[0]  # rank 0 prints it: its own needs no name (a check only rank 0 runs, too)
        raise EagletError(message if r == 0 or all(e == message for _, e in failed) and len(failed) == len(errors)
                          else f"rank {r}: {message}")
    return result


def smallest(group, value: int) -> int:
    """The smallest of the ranks' values (rows the caches of every rank can hold)."""
    if group is None:
        return value
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return min(every)


def rank0_value(group, value):
    """Rank 0's value on every rank (a choice made from timings, which differ a little between ranks)."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class RanksDisagree(EagletError):
    """Tensor parallel ranks decided differently: the output would no longer be exact."""


def flag_disagreement(group, decision: Tensor, *decided: Tensor) -> Tensor:
    """decision, or -1 in its place on every rank if the ranks hold different values anywhere in decision or
    decided (a cycle's accepted count, tree tokens and emitted tokens; a step's token). One small all-reduce
    inside the compiled graph: every rank learns it at the cycle's one host sync and all stop together (a rank
    that went on alone would wait forever in its next collective)."""
    mine = torch.cat([t.reshape(-1) for t in (decision, *decided)])
    extremes = funcol.all_reduce(torch.cat([mine, -mine]), "max", group)
    spread = extremes[:mine.numel()] + extremes[mine.numel():]  # each value's max - min over the ranks
    return torch.where(spread.any(), torch.full_like(decision, -1), decision)


def check_shardable(args: ModelArgs, world: int, quantization: Optional[dict]):
    """Heads, K/V heads and the MLP width must split evenly; an int4 slice must hold whole groups."""
    if world > args.n_local_heads:
        raise EagletError(f"{world} ranks are more than the model's {args.n_local_heads} key/value heads: "
                          f"tensor parallel runs on at most {args.n_local_heads}")
    for what, n in (("attention heads", args.n_head), ("key/value heads", args.n_local_heads),
                    ("MLP intermediate_size", args.intermediate_size)):
        if n % world:
            raise EagletError(f"the model's {n} {what} do not split evenly over {world} ranks: use a world size "
                              f"that divides {args.n_head} heads, {args.n_local_heads} key/value heads and "
                              f"intermediate_size {args.intermediate_size}")
    groupsize = (quantization or {}).get("groupsize") if (quantization or {}).get("mode") == "int4" else None
    widths = {"attention output": args.n_head // world * args.head_dim, "MLP down": args.intermediate_size // world}
    for what, width in widths.items():
        if groupsize and width % groupsize:
            raise EagletError(f"int4 groups of {groupsize} do not tile each rank's {width} {what} input channels "
                              f"over {world} ranks: use fewer ranks or a smaller --groupsize")


def local_args(args: ModelArgs, world: int) -> ModelArgs:
    """The sizes one rank's modules are built with (head_dim stated: dim // n_head no longer gives it)."""
    return replace(args, n_head=args.n_head // world, n_local_heads=args.n_local_heads // world,
                   intermediate_size=args.intermediate_size // world, head_dim=args.head_dim)


def rows(t: torch.Tensor, parts: list, rank: int, world: int) -> torch.Tensor:
    """Rank's share of each consecutive part (sizes along dim 0: q, k, v or gate, up), concatenated."""
    return torch.cat([part.chunk(world)[rank] for part in t.split(parts)])


def shard_state_dict(state_dict: dict, args: ModelArgs, rank: int, world: int) -> dict:
    """This rank's tensors: column-parallel Linears' rows, row-parallel Linears' input columns (an int4
    weight holds two columns a byte, its scales and zeros one column a group: each is cut into world equal
    slices), a row-parallel bias on rank 0 only (it must be added once). Everything else whole."""
    q, kv = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    parts = {"attention.wqkv": [q, kv, kv], "feed_forward.w13": [args.intermediate_size] * 2}
    out = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):  # a quantized file's record
            out[name] = t
            continue
        module, _, kind = name.rpartition(".")
        linear = module.split(".", 2)[-1] if module.startswith("layers.") else ""
        if linear in COLUMN_PARALLEL:
            t = rows(t, parts[linear], rank, world)
        elif linear in ROW_PARALLEL and kind == "bias":
            t = t if rank == 0 else torch.zeros_like(t)
        elif linear in ROW_PARALLEL and t.ndim == 2:  # weight, int4 scales and zeros; int8's [out] scales whole
            t = t.chunk(world, dim=1)[rank]
        out[name] = t.clone()  # a copy of the slice only: the rest of the memory-mapped file is never read
    return out


def load_sharded(checkpoint_path, group, device="cpu", dtype=torch.float32) -> Transformer:
    """This rank's shard of model.pth (or a quantize.py file). model.args stays the whole model's config;
    the modules hold the rank's share, and their all-reduces run over group."""
    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise EagletError(f"checkpoint not found: {checkpoint_path}")
    args = ModelArgs.from_checkpoint_dir(checkpoint_path.parent)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    state_dict = load_state_dict(checkpoint_path)
    quantization = pop_quantization(dict(state_dict), checkpoint_path)
    check_shardable(args, world, quantization)
    check_whole_shapes(state_dict, args, checkpoint_path)
    model = Transformer.from_state_dict(local_args(args, world), shard_state_dict(state_dict, args, me, world),
                                       device, dtype, str(checkpoint_path))
    return joined(model, args, group)


def check_whole_shapes(state_dict: dict, args: ModelArgs, path):
    """Every tensor as the config makes it, before it is cut (a cut would hide which file tensor is wrong)."""
    with torch.device("meta"):
        whole = Transformer(args)
        use_quantized_linears(whole, state_dict)
    for name, t in whole.state_dict().items():
        found = state_dict.get(name)
        if isinstance(found, Tensor) and found.shape != t.shape:
            raise EagletError(f"{path} does not match its config.json: {name} is {tuple(found.shape)}, the config "
                              f"makes it {tuple(t.shape)}")


def joined(model: Transformer, args: ModelArgs, group) -> Transformer:
    """A model built with local_args, made one rank of the whole: its config the whole model's, its row-parallel
    Linears' outputs all-reduced over group."""
    model.args, model.tp_group = args, group
    for layer in model.layers:
        layer.attention.tp_group = layer.feed_forward.tp_group = group
    return model


NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # the functional collectives' helper ops


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives the ops under it run (functional collectives, as model.all_reduce calls them)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._overloadpacket.__name__ not in NOT_COLLECTIVES:
            self.count += 1
        return func(*args, **(kwargs or {}))


def collectives(fn: Callable) -> int:
    """How many collectives one eager call of fn runs, counted as they run."""
    with CollectiveCounter() as counter:
        fn()
    return counter.count


if __name__ == "__main__":
    raise SystemExit("error: tp.py is a part of generate.py, not a command: "
                     "`torchrun --standalone --nproc_per_node=N generate.py ...` shards a target over N processes")
