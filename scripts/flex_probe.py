"""Which ways of building a BlockMask inside torch.compile lower on this torch + GPU (a diagnostic; its output
on an H100 with torch 2.11 is in benchmarks/h100-2026-11-23/flex-probe-db3323a.txt). Run it on a newer torch to
see whether flex_attention over several queries (verify, draft, catch-up) can be turned on.

    python scripts/flex_probe.py
"""
import sys
import traceback
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model  # noqa: E402
from model import attention_mask, attend, block_mask, causal_mask  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("error: flex_probe needs a CUDA GPU")
dev, dt = "cuda", torch.bfloat16
S, H, HKV, D = 1024, 8, 2, 128
k = torch.randn(1, HKV, S, D, device=dev, dtype=dt)
v = torch.randn(1, HKV, S, D, device=dev, dtype=dt)


def current(q, pos, tree):
    m = causal_mask(pos, S) if tree is None else attention_mask(pos[0], tree, S)
    return attend(q, k, v, block_mask(m))


def force_flex(q, pos, tree):
    m = causal_mask(pos, S) if tree is None else attention_mask(pos[0], tree, S)
    return flex_attention(q, k, v, block_mask=block_mask(m), enable_gqa=True,
                          kernel_options={"FORCE_USE_FLEX_ATTENTION": True})


def noop_mask_mod(q, pos, tree):  # the same block lists, mask_mod left out (wrong result for partial blocks)
    bm = block_mask(causal_mask(pos, S) if tree is None else attention_mask(pos[0], tree, S))
    bm2 = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                   BLOCK_SIZE=model.KV_BLOCK, seq_lengths=(q.shape[2], S))
    return flex_attention(q, k, v, block_mask=bm2, enable_gqa=True)


def input_only_mask_mod(q, pos, tree):  # mask_mod reads graph inputs only
    bm = block_mask(causal_mask(pos, S) if tree is None else attention_mask(pos[0], tree, S))
    n = q.shape[2]

    def mask_mod(b, h, q_idx, kv_idx):
        rel = kv_idx - pos[0]
        return (kv_idx < pos[0]) | ((rel >= 0) & (rel <= q_idx) & (q_idx < n))
    bm2 = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                   BLOCK_SIZE=model.KV_BLOCK, mask_mod=mask_mod, seq_lengths=(n, S))
    return flex_attention(q, k, v, block_mask=bm2, enable_gqa=True)


def main():
    print(torch.__version__, torch.cuda.get_device_name())
    for name, fn in [("current", current), ("force_flex", force_flex), ("noop_mask_mod", noop_mask_mod),
                     ("input_only_mask_mod", input_only_mask_mod)]:
        for T in (1, 60):
            for mode in (None, "reduce-overhead"):
                q = torch.randn(1, H, T, D, device=dev, dtype=dt)
                pos = torch.arange(300, 300 + T, device=dev)
                tree = None if T == 1 else torch.ones(T, T, dtype=torch.bool, device=dev).tril()
                ref = attend(q, k, v, causal_mask(pos, S))
                torch._dynamo.reset()
                try:
                    f = torch.compile(fn, fullgraph=True, mode=mode)
                    out = f(q, pos, tree)
                    out = f(q, pos, tree)
                    print(f"OK   {name} T={T} mode={mode}: max err {(out.float() - ref.float()).abs().max().item():.4f}",
                          flush=True)
                except Exception as e:
                    print(f"FAIL {name} T={T} mode={mode}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    if name == "current" and T == 1 and mode is None:
                        tb = traceback.format_exc()
                        print(tb[:6000], "\n...\n", tb[-4000:])


if __name__ == "__main__":
    main()
