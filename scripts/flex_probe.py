"""Which ways of building a BlockMask inside torch.compile lower on this torch + GPU, and for how many queries
(a diagnostic; its first output, on an H100 with torch 2.11, is in benchmarks/h100-2026-11-23/
flex-probe-db3323a.txt). Run it on a new torch or GPU to see whether flex_attention over several queries
(verify, draft, catch-up) can be turned on.

    python scripts/flex_probe.py                 # every case (a few minutes on an H100)
    python scripts/flex_probe.py --device cpu    # a smoke test: CPU inductor lowers none of these
    python scripts/flex_probe.py --split --slots 2048   # split attention (EAGLET_SPLIT=1) on the real head layouts

Each line says OK with the largest difference from masked SDPA, or FAIL with the error's first words.
--split: split attention's context part alone (flex_attention over the slots below ctx_len, a graph input; block
lists built in the graph; return_lse) with each set of kernel options, then the whole split attention as the
cycle calls it (attend over attention_mask's SplitMask, compiled, CUDA graphs too), each OK line with its time
per call against the masked SDPA over the whole cache it replaces (bf16, context CTX).
"""
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attention  # noqa: E402
from cli import cli_parser  # noqa: E402
from attention import attention_mask, attend, block_mask, causal_mask  # noqa: E402

S, H, HKV, D = 1024, 8, 2, 128
FORCE = {"FORCE_USE_FLEX_ATTENTION": True}  # the main flex kernel even for few queries (not flex decoding)


def in_graph_mask(q, pos, tree):
    """The mask built in the graph, as the cycle builds it: attention_mask of the tree's ancestors."""
    return causal_mask(pos, S) if tree is None else attention_mask(pos[0], tree, S)


def blocks_only(q, pos, tree, mask_mod=None):
    """block_mask's block lists with another mask_mod (none: every slot of a listed block is read)."""
    bm = block_mask(in_graph_mask(q, pos, tree))
    return BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                    BLOCK_SIZE=attention.KV_BLOCK, mask_mod=mask_mod, seq_lengths=(q.shape[2], S))


def causal_from_inputs(q, pos):
    """A mask_mod reading graph inputs only: the block is causal after the context (not a tree)."""
    def mask_mod(b, h, q_idx, kv_idx):
        rel = kv_idx - pos[0]
        return (kv_idx < pos[0]) | ((rel >= 0) & (rel <= q_idx) & (q_idx < q.shape[2]))
    return mask_mod


def current(q, k, v, pos, tree):  # model.py's block_mask: its mask_mod reads the in-graph mask
    return attend(q, k, v, block_mask(in_graph_mask(q, pos, tree)))


def force_flex(q, k, v, pos, tree):
    return flex_attention(q, k, v, block_mask=block_mask(in_graph_mask(q, pos, tree)), enable_gqa=True,
                          kernel_options=FORCE)


def noop_mask_mod(q, k, v, pos, tree):  # wrong inside partial blocks: tells whether the block lists lower
    return flex_attention(q, k, v, block_mask=blocks_only(q, pos, tree), enable_gqa=True)


def input_only_mask_mod(q, k, v, pos, tree):
    return flex_attention(q, k, v, block_mask=blocks_only(q, pos, tree, causal_from_inputs(q, pos)), enable_gqa=True)


def force_flex_input_only(q, k, v, pos, tree):
    return flex_attention(q, k, v, block_mask=blocks_only(q, pos, tree, causal_from_inputs(q, pos)), enable_gqa=True,
                          kernel_options=FORCE)


CASES = [(current, (1, 60)), (force_flex, (1, 60)), (noop_mask_mod, (1, 60)),
         (input_only_mask_mod, (1, 16, 32, 60)), (force_flex_input_only, (1, 16, 60))]


def probe(fn, T: int, mode, device: str, dtype) -> str:
    q = torch.randn(1, H, T, D, device=device, dtype=dtype)
    k, v = torch.randn(2, 1, HKV, S, D, device=device, dtype=dtype).unbind(0)
    pos = torch.arange(300, 300 + T, device=device)
    tree = None if T == 1 else torch.ones(T, T, dtype=torch.bool, device=device).tril()
    ref = attend(q, k, v, causal_mask(pos, S))
    torch._dynamo.reset()
    name = f"{fn.__name__} T={T} mode={mode}"
    try:
        f = torch.compile(fn, fullgraph=True, mode=mode)
        f(q, k, v, pos, tree)
        out = f(q, k, v, pos, tree)
        return f"OK   {name}: max err {(out.float() - ref.float()).abs().max().item():.4f}"
    except Exception as e:
        if fn is current and T == 1 and mode is None and device == "cuda":
            tb = traceback.format_exc()
            print(tb[:6000], "\n...\n", tb[-4000:])
        return f"FAIL {name}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


CTX = 300  # the split cases' context: 3 of the cache's 128-slot blocks, the last one partial
SPLIT_LAYOUTS = {"32/32": (32, 32), "32/8": (32, 8)}  # query / K/V heads of LLaMA-2-7B and LLaMA-3-8B, head_dim 128
SPLIT_OPTIONS = {  # kernel_options for the context part; "model" is what attention.context_kernel_options picks
    "model": None, "flex default": {}, "BLOCK_M=64": {"BLOCK_M": 64}, "BLOCK_M=128": {"BLOCK_M": 128},
    "main kernel BLOCK_M=64": {**FORCE, "BLOCK_M": 64}}


def ms_per_call(fn, *args, repeats: int = 50) -> float:
    for _ in range(3):
        fn(*args)
    if args[0].is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    if args[0].is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def split_inputs(heads, T: int, slots: int, device: str, dtype):
    n_head, n_kv = heads
    q = torch.randn(1, n_head, T, D, device=device, dtype=dtype)
    k, v = torch.randn(2, 1, n_kv, slots, D, device=device, dtype=dtype).unbind(0)
    return q, k, v, torch.tensor(CTX, device=device), torch.ones(T, T, dtype=torch.bool, device=device).tril()


def masked_sdpa(q, k, v, ctx_len, block):  # what compiled calls of several tokens run without EAGLET_SPLIT
    return attend(q, k, v, attention_mask(ctx_len, block, k.shape[2]))


def probe_split_context(layout: str, T: int, slots: int, options: str, device: str, dtype) -> str:
    """The context part alone, compiled: output and log-sum-exp against the masked math over slots < CTX."""
    q, k, v, ctx_len, _ = split_inputs(SPLIT_LAYOUTS[layout], T, slots, device, dtype)
    visible = (torch.arange(slots, device=device) < CTX)[None, None]
    ref_out, ref_lse = attention.attention_with_lse(q, k, v, visible)
    name = f"split context {layout} T={T} slots={slots} {options}"
    torch._dynamo.reset()
    try:
        f = torch.compile(partial(attention.context_attention, kernel_options=SPLIT_OPTIONS[options]), fullgraph=True)
        out, lse = f(q, k, v, ctx_len)
        err = max((out.float() - ref_out).abs().max().item(), (lse.float() - ref_lse).abs().max().item())
        return f"OK   {name}: max err {err:.4f}, {ms_per_call(f, q, k, v, ctx_len):.3f} ms"
    except Exception as e:
        return f"FAIL {name}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def probe_split_attention(layout: str, T: int, slots: int, mode, device: str, dtype) -> str:
    """The whole split attention through attend (the SplitMask built in the graph, as the cycle builds it),
    compiled in this mode, against the masked SDPA over the whole cache: error, and both times."""
    args = split_inputs(SPLIT_LAYOUTS[layout], T, slots, device, dtype)
    name = f"split attention {layout} T={T} slots={slots} mode={mode}"
    torch._dynamo.reset()
    try:
        dense = torch.compile(masked_sdpa, fullgraph=True, mode=mode)
        ref = dense(*args).clone()  # CUDA graphs overwrite their outputs on the next replay
        dense_ms = ms_per_call(dense, *args)
        attention.SPLIT_ATTENTION, attention.SPLIT_EAGER = True, device == "cpu"  # CPU: its masked math context part
        split = torch.compile(masked_sdpa, fullgraph=True, mode=mode)
        out = split(*args).clone()
        err = (out.float() - ref.float()).abs().max().item()
        return f"OK   {name}: max err {err:.4f}, {ms_per_call(split, *args):.3f} ms (masked SDPA {dense_ms:.3f} ms)"
    except Exception as e:
        return f"FAIL {name}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    finally:
        attention.SPLIT_ATTENTION, attention.SPLIT_EAGER = False, False


def split_cases(args, dtype) -> list:
    lines = []
    for slots in args.slots:
        for layout in args.layouts:
            for T in args.queries:
                for options in SPLIT_OPTIONS:
                    lines.append(probe_split_context(layout, T, slots, options, args.device, dtype))
                    print(lines[-1], flush=True)
                for mode in (None, "reduce-overhead"):
                    lines.append(probe_split_attention(layout, T, slots, mode, args.device, dtype))
                    print(lines[-1], flush=True)
    return lines


def number_list(text: str) -> list:
    return [int(n) for n in text.split(",")]


def main(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--split", action="store_true", help="the split attention cases only")
    p.add_argument("--slots", type=number_list, default=[2048], help="--split: cache sizes, e.g. 2048,4096")
    p.add_argument("--queries", type=number_list, default=[1, 8, 10, 60],
                   help="--split: tokens per call (decode, catch-up, draft frontier, verify)")
    p.add_argument("--layouts", type=lambda t: t.split(","), default=list(SPLIT_LAYOUTS),
                   help=f"--split: head layouts among {', '.join(SPLIT_LAYOUTS)}")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here (--device cpu runs the cases through CPU inductor)")
    if not set(args.layouts) <= set(SPLIT_LAYOUTS) or min(args.slots) <= CTX + max(args.queries):
        sys.exit(f"error: --layouts are among {', '.join(SPLIT_LAYOUTS)}; --slots must exceed {CTX} + the queries")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(torch.__version__, torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    if args.split:
        return split_cases(args, dtype)
    lines = []
    for fn, query_counts in CASES:
        for T in query_counts:
            for mode in (None, "reduce-overhead"):  # CUDA graphs only for what compiled without them
                lines.append(probe(fn, T, mode, args.device, dtype))
                print(lines[-1], flush=True)
                if lines[-1].startswith("FAIL") or args.device == "cpu":
                    break
    return lines


if __name__ == "__main__":
    main()
