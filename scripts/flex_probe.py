"""Which ways of building a BlockMask inside torch.compile lower on this torch + GPU, and for how many queries
(a diagnostic; its first output, on an H100 with torch 2.11, is in benchmarks/h100-2026-11-23/
flex-probe-db3323a.txt). Run it on a new torch or GPU to see whether flex_attention over several queries
(verify, draft, catch-up) can be turned on.

    python scripts/flex_probe.py                 # every case (a few minutes on an H100)
    python scripts/flex_probe.py --device cpu    # a smoke test: CPU inductor lowers none of these

Each line says OK with the largest difference from masked SDPA, or FAIL with the error's first words.
"""
import sys
import traceback
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model  # noqa: E402
from cli import cli_parser  # noqa: E402
from model import attention_mask, attend, block_mask, causal_mask  # noqa: E402

S, H, HKV, D = 1024, 8, 2, 128
FORCE = {"FORCE_USE_FLEX_ATTENTION": True}  # the main flex kernel even for few queries (not flex decoding)


def in_graph_mask(q, pos, tree):
    """The mask built in the graph, as the cycle builds it: attention_mask of the tree's ancestors."""
    return causal_mask(pos, S) if tree is None else attention_mask(pos[0], tree, S)


def blocks_only(q, pos, tree, mask_mod=None):
    """block_mask's block lists with another mask_mod (none: every slot of a listed block is read)."""
    bm = block_mask(in_graph_mask(q, pos, tree))
    return BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                    BLOCK_SIZE=model.KV_BLOCK, mask_mod=mask_mod, seq_lengths=(q.shape[2], S))


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


def main(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here (--device cpu runs the cases through CPU inductor)")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(torch.__version__, torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
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
