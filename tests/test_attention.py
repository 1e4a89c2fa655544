"""Attention that reads only the filled cache: the block-sparse (flex) path compiled CUDA code takes gives
the masked attention's result for prefill, decode and tree blocks, its block mask lists only the cache
blocks that hold a visible slot, and the eager path over the filled slots only gives the same. (CPU
inductor's flex kernel needs the mask as a graph input, so here the BlockMask is built outside.)"""
import pytest
import torch
import torch.nn.functional as F

from attention import KV_BLOCK, attend, attention_mask, block_mask, decode_block_mask, sdpa_inputs

HEADS, KV_HEADS, HEAD_DIM, SLOTS = 4, 2, 16, 3 * KV_BLOCK + 40  # the cache ends inside a block


def prefill_block(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


def tree_block(n, seed=0):
    """Ancestors-and-self of a random tree whose parents precede their children."""
    g = torch.Generator().manual_seed(seed)
    parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


CASES = {  # name: (context length, the block's own mask)
    "prefill from empty": (0, prefill_block(9)),
    "prefill across a block edge": (KV_BLOCK - 3, prefill_block(9)),
    "decode, first slot": (0, prefill_block(1)),
    "decode, last slot of a block": (KV_BLOCK - 1, prefill_block(1)),
    "decode, first slot of a block": (KV_BLOCK, prefill_block(1)),
    "decode in the cache's last block": (SLOTS - 1, prefill_block(1)),
    "tree across a block edge": (2 * KV_BLOCK - 7, tree_block(20)),
}


@torch.compile(fullgraph=True)
def attend_compiled(q, k, v, mask):
    return attend(q, k, v, mask)


@pytest.mark.parametrize("case", list(CASES))
def test_block_sparse_attention_equals_masked_attention(case):
    ctx, block = CASES[case]
    torch.manual_seed(0)
    n = block.shape[0]
    q = torch.randn(1, HEADS, n, HEAD_DIM)
    k, v = torch.randn(2, 1, KV_HEADS, SLOTS, HEAD_DIM).unbind(0)
    mask = attention_mask(torch.tensor(ctx), block, SLOTS)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attend_compiled(q, k, v, block_mask(mask)), reference, rtol=1e-5, atol=1e-5)
    # The eager path over only the filled slots (what prefill passes) gives the same as well.
    filled = ctx + n
    torch.testing.assert_close(attend(q, k, v, mask[:, :filled]), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ctx,n,expected_full,expected_partial", [
    (0, 1, [], [0]),
    (KV_BLOCK - 1, 1, [0], []),  # the query sits in slot 127: all of block 0 is visible
    (KV_BLOCK, 1, [0], [1]),
    (200, 1, [0], [1]),
    (2 * KV_BLOCK - 7, 20, [0], [1, 2]),
    (SLOTS - 1, 1, [0, 1, 2], [3]),
])
def test_block_mask_lists_only_the_filled_blocks(ctx, n, expected_full, expected_partial):
    mask = attention_mask(torch.tensor(ctx), tree_block(n), SLOTS)
    bm = block_mask(mask)
    full_n, partial_n = int(bm.full_kv_num_blocks[0, 0, 0]), int(bm.kv_num_blocks[0, 0, 0])
    assert sorted(bm.full_kv_indices[0, 0, 0, :full_n].tolist()) == expected_full
    assert sorted(bm.kv_indices[0, 0, 0, :partial_n].tolist()) == expected_partial


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("decode")])
def test_decode_block_mask_equals_masked_attention(case):
    """Compiled CUDA decoding's BlockMask (its mask_mod reads the position, not a mask built in the graph)."""
    ctx, block = CASES[case]
    torch.manual_seed(1)
    q = torch.randn(1, HEADS, 1, HEAD_DIM)
    k, v = torch.randn(2, 1, KV_HEADS, SLOTS, HEAD_DIM).unbind(0)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(torch.tensor(ctx), block, SLOTS),
                                               enable_gqa=True)
    bm = decode_block_mask(torch.tensor([ctx]), SLOTS)
    torch.testing.assert_close(attend_compiled(q, k, v, bm), reference, rtol=1e-5, atol=1e-5)
    read = int(bm.kv_num_blocks[0, 0, 0] + bm.full_kv_num_blocks[0, 0, 0])
    assert read == ctx // KV_BLOCK + 1  # the blocks up to the query's own, no further


def test_grouped_query_attention_reads_the_cache_unexpanded():
    """GQA through SDPA: the query heads sharing a K/V head ride in the query length, so SDPA gets the cache's
    own K/V (no per-head copy) and no enable_gqa, and the result is grouped attention's."""
    torch.manual_seed(2)
    ctx, block = CASES["tree across a block edge"]
    n = block.shape[0]
    q = torch.randn(1, HEADS, n, HEAD_DIM)
    k, v = torch.randn(2, 1, KV_HEADS, SLOTS, HEAD_DIM).unbind(0)
    mask = attention_mask(torch.tensor(ctx), block, SLOTS)
    args = sdpa_inputs(q, k, v, mask)
    assert args["key"].data_ptr() == k.data_ptr() and args["key"].shape[1] == KV_HEADS
    assert args["query"].shape == (1, KV_HEADS, HEADS // KV_HEADS * n, HEAD_DIM) and "enable_gqa" not in args
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, mask), reference, rtol=1e-5, atol=1e-5)
