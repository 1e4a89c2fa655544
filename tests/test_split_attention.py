"""Split attention (EAGLET_SPLIT): the context part (no per-query mask, a key-length bound only) and the block's
own cache slots, merged by their log-sum-exps, give masked SDPA's result for prefill, decode, verify trees, the
draft frontier's scratch levels and batch rows at different contexts; the flex_attention context part (what
compiled CUDA code runs, here eager) gives the same; and generate() decodes the demo as without it."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from batch import generate_batch
from cli import DEMO_PROMPT
from decode import generate, speculative_cycle
from sampling import SamplingConfig
from load import load_draft, load_target
import attention
from conftest import ROOT
from attention import KV_BLOCK, SplitMask, attention_mask, context_block_mask, split_attention

SLOTS = 2 * KV_BLOCK + 40  # the cache ends inside a block
HEADS = {"GQA 8/2": (8, 2), "MHA 4/4": (4, 4)}
DTYPES = {"fp32": (torch.float32, 1e-5), "fp64": (torch.float64, 1e-10)}
DEMO = ROOT / "demo"


def causal_block(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


def tree_block(n, g):
    """Ancestors-and-self of a random tree whose parents precede their children."""
    parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


def frontier_block(topk, level, depth, g):
    """The draft frontier's mask at `level` over depth * topk scratch slots, as build_tree grows it: each node
    sees its own slot and one ancestor in each earlier level (their K/V written by earlier calls)."""
    anc = torch.zeros(topk, depth * topk, dtype=torch.bool)
    for i in range(level + 1):
        anc[torch.arange(topk), i * topk + (torch.arange(topk) if i == level else torch.randint(0, topk, (topk,),
                                                                                                 generator=g))] = True
    return anc


def inputs(heads, n_q, dtype, bsz=1, seed=0):
    n_head, n_kv = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, n_head, n_q, 16, generator=g, dtype=dtype)
    k, v = torch.randn(2, bsz, n_kv, SLOTS, 16, generator=g, dtype=dtype).unbind(0)
    return q, k, v


def reference(q, k, v, mask):
    """Masked SDPA over the boolean mask (per-row [B, T, L] masks broadcast over the heads)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask if mask.ndim == 2 else mask[:, None],
                                          enable_gqa=True)


def check_split(q, k, v, ctx_len, block, dtype_name):
    atol = DTYPES[dtype_name][1]
    expected = reference(q, k, v, attention_mask(ctx_len, block, SLOTS))
    for flex in (False, True):  # masked math (CPU), flex_attention over the filled blocks (compiled CUDA's)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex_attention's "use torch.compile" warning
            out = split_attention(q, k, v, SplitMask(ctx_len, block, SLOTS), flex=flex)
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, rtol=0, atol=atol, msg=f"flex={flex}")


CTX = [0, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1, 2 * KV_BLOCK - 1]  # 0, 127, 128, 129, 255


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("ctx", CTX)
@pytest.mark.parametrize("kind", ["prefill", "decode", "tree"])
def test_split_equals_masked_attention(kind, ctx, heads, dtype_name):
    g = torch.Generator().manual_seed(ctx)
    block = {"prefill": causal_block(9), "decode": causal_block(1), "tree": tree_block(30, g)}[kind]
    q, k, v = inputs(HEADS[heads], block.shape[0], DTYPES[dtype_name][0], seed=ctx)
    check_split(q, k, v, torch.tensor(ctx), block, dtype_name)


@pytest.mark.parametrize("level", [0, 2, 5])
@pytest.mark.parametrize("ctx", [0, KV_BLOCK - 12, KV_BLOCK])
def test_draft_frontier_sees_earlier_levels_scratch_slots(ctx, level):
    """Level i of build_tree's frontier (topk 10, depth 6) sees scratch slots of earlier levels, written by
    earlier calls: the block's own part reads all depth * topk slots from the cache, not only this call's."""
    g = torch.Generator().manual_seed(level)
    block = frontier_block(10, level, 6, g)
    q, k, v = inputs(HEADS["GQA 8/2"], 10, torch.float64, seed=level)
    check_split(q, k, v, torch.tensor(ctx), block, "fp64")


@pytest.mark.parametrize("per_row_block", [False, True], ids=["shared block", "a block per row"])
def test_batch_rows_at_different_contexts(per_row_block):
    ctx = torch.tensor([0, KV_BLOCK + 1, 2 * KV_BLOCK - 1, KV_BLOCK - 1])
    g = torch.Generator().manual_seed(3)
    block = torch.stack([tree_block(12, g) for _ in ctx]) if per_row_block else tree_block(12, g)
    q, k, v = inputs(HEADS["GQA 8/2"], 12, torch.float64, bsz=len(ctx), seed=3)
    check_split(q, k, v, ctx, block, "fp64")


def test_a_block_reaching_past_the_mask_reads_nothing_there():
    """n_kv (the boolean mask's L) bounds the block's slots too: a tree that would run past it sees only what
    the boolean mask shows (eager prefill passes L = the filled slots)."""
    q, k, v = inputs(HEADS["GQA 8/2"], 8, torch.float64)
    ctx, n_kv, block = torch.tensor(100), 104, causal_block(8)
    expected = reference(q[:, :, :4], k[:, :, :n_kv], v[:, :, :n_kv], attention_mask(ctx, block, n_kv)[:4])
    out = split_attention(q, k, v, SplitMask(ctx, block, n_kv))
    torch.testing.assert_close(out[:, :, :4], expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("ctx", [0, 1, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1, SLOTS])
def test_context_block_mask_lists_only_the_filled_blocks(ctx):
    bm = context_block_mask(torch.tensor([ctx, 0]), 60, SLOTS)
    full, partial = int(bm.full_kv_num_blocks[0, 0, 0]), int(bm.kv_num_blocks[0, 0, 0])
    assert sorted(bm.full_kv_indices[0, 0, 0, :full].tolist()) == list(range(ctx // KV_BLOCK))
    assert bm.kv_indices[0, 0, 0, :partial].tolist() == ([ctx // KV_BLOCK] if ctx % KV_BLOCK else [])
    assert int(bm.full_kv_num_blocks[1, 0, 0]) == int(bm.kv_num_blocks[1, 0, 0]) == 0  # the row at context 0


def test_context_block_mask_reads_only_listed_blocks_and_gives_the_context():
    """Eager flex_attention applies the mask_mod everywhere; CPU inductor's flex kernel reads only the listed
    blocks, so compiled, the lists and the mask_mod together must give attention over slots < ctx_len (rows at
    0, at block edges, and the whole cache; the BlockMask is built outside: CPU inductor cannot lower it inside)."""
    from torch.nn.attention.flex_attention import flex_attention
    ctx = torch.tensor([0, 1, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1, 2 * KV_BLOCK - 1, SLOTS])
    q, k, v = inputs(HEADS["GQA 8/2"], 10, torch.float32, bsz=len(ctx))
    compiled = torch.compile(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm, enable_gqa=True),
                             fullgraph=True)
    out = compiled(q, k, v, context_block_mask(ctx, 10, SLOTS))
    visible = torch.arange(SLOTS) < ctx[:, None, None]
    expected = F.scaled_dot_product_attention(q[1:], k[1:], v[1:], attn_mask=visible[1:, None], enable_gqa=True)
    torch.testing.assert_close(out[1:], expected, rtol=0, atol=1e-5)
    assert out[0].abs().max() == 0  # nothing to see at context 0: output 0, no NaN


def test_split_attention_is_off_by_default():
    assert not attention.SPLIT_ATTENTION and not attention.SPLIT_EAGER
    assert isinstance(attention_mask(torch.tensor(3), causal_block(2), 8), torch.Tensor)


def test_decoding_keeps_its_block_mask_with_split_attention_on(split_on):
    """One-token decoding keeps decode_block_mask (its BlockMask is built from the boolean mask), and its
    attention is the boolean mask's."""
    from torch.nn.attention.flex_attention import BlockMask
    from attention import attend, boolean_mask, decode_block_mask
    bm = decode_block_mask(torch.tensor([KV_BLOCK + 1]), SLOTS)
    assert isinstance(bm, BlockMask)
    q, k, v = inputs(HEADS["GQA 8/2"], 1, torch.float32)
    expected = reference(q, k, v, boolean_mask(torch.tensor(KV_BLOCK + 1), causal_block(1), SLOTS))
    torch.testing.assert_close(torch.compile(attend, fullgraph=True)(q, k, v, bm), expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_flex_probe_split_cases_run_on_cpu(capsys):
    """scripts/flex_probe.py --split on CPU (a smoke test of the GPU session's command): a line per case; CPU
    inductor has no flex log-sum-exp, but the whole split attention compiles there, equal to masked SDPA."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import flex_probe
    lines = flex_probe.main(["--device", "cpu", "--split", "--slots", "512", "--queries", "10", "--layouts", "32/8"])
    assert len(lines) == len(flex_probe.SPLIT_OPTIONS) + 2 and all(line[:4] in ("OK  ", "FAIL") for line in lines)
    whole = [line for line in lines if line.startswith("OK   split attention 32/8 T=10 slots=512")]
    assert len(whole) == 2 and all("max err 0.0000" in line for line in whole)


@pytest.fixture
def split_on(monkeypatch):
    """Split attention forced on in eager CPU code; returns a list that grows with each split call."""
    calls, split = [], attention.split_attention

    def counted(*args, **kwargs):
        if not torch.compiler.is_compiling():  # a list appended to in a graph would recompile it every call
            calls.append(args[0].shape[2])
        return split(*args, **kwargs)
    monkeypatch.setattr(attention, "SPLIT_ATTENTION", True)
    monkeypatch.setattr(attention, "SPLIT_EAGER", True)
    monkeypatch.setattr(attention, "split_attention", counted)
    return calls


@pytest.fixture(scope="module")
def demo():
    """The demo target and its EAGLE-2 head, and two code prompts as token ids."""
    from tokenizer import Tokenizer
    if not (DEMO / "head" / "draft.pth").exists():
        pytest.skip("no demo/ (scripts/make_demo.py)")
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 512)
    tokenizer = Tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(DEMO_PROMPT), tokenizer.encode("import os\n\n\ndef main():\n    for ")]
    return target, load_draft(DEMO / "head" / "draft.pth", target), prompts


def run_demo(target, draft, prompts, n_tokens=40, step_fn=None):
    greedy = SamplingConfig()
    return [generate(target, p, n_tokens, greedy, draft=draft, step_fn=step_fn) for p in prompts]


def test_generate_with_split_attention_equals_without(demo, split_on):
    """Greedy EAGLE-2 on the demo: the same tokens and accepted lengths with split attention in every call of
    the cycle (verify 60, frontier 10, catch-up 8) and prefill as with the boolean masks."""
    target, draft, prompts = demo
    split = run_demo(target, draft, prompts)
    assert {60, 10, 8} <= set(split_on)
    attention.SPLIT_ATTENTION = False
    masked = run_demo(target, draft, prompts)
    for s, m in zip(split, masked):  # (masked speculative == plain decoding: test_speculative.py, test_demo.py)
        assert s.tokens == m.tokens and s.accept_lengths == m.accept_lengths
    assert max(a for s in split for a in s.accept_lengths) > 2  # drafts were accepted, several deep


def test_generate_batch_with_split_attention_equals_each_row_alone(demo, split_on):
    """Several prompts at once: each row's split attention at its own context gives the row's tokens alone."""
    target, draft, prompts = demo
    target.setup_caches(max_batch_size=2, max_seq_length=512)
    draft.setup_caches(512, max_batch_size=2)
    try:
        batch = generate_batch(target, prompts, 40, SamplingConfig(), draft=draft)
        assert {60, 10, 8} <= set(split_on)
        attention.SPLIT_ATTENTION = False
        alone = run_demo(target, draft, prompts)
    finally:
        target.setup_caches(max_batch_size=1, max_seq_length=512)
        draft.setup_caches(512)
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert [r.accept_lengths for r in batch] == [r.accept_lengths for r in alone]


@pytest.mark.slow
def test_compiled_cycle_with_split_attention_equals_eager(demo, split_on):
    """torch.compile of the cycle with split attention inside (its masked math context part; the flex one compiles
    on CUDA only), in one graph: the tokens and accepted lengths of eager boolean masks. Traced by dynamo and run by
    AOTAutograd (conftest.traced_compile says why): the split's ops are einsums and a logsumexp, nothing of its own
    for inductor's CPU code."""
    target, draft, prompts = demo
    attention.SPLIT_ATTENTION = False
    masked = run_demo(target, draft, prompts, 24)
    attention.SPLIT_ATTENTION = True
    graphs = []

    def traced(gm, example_inputs):  # AOTAutograd, keeping the graph dynamo traced
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    torch._dynamo.reset()
    step = torch.compile(speculative_cycle, fullgraph=True, backend=traced)
    compiled = run_demo(target, draft, prompts, 24, step)
    assert [r.tokens for r in compiled] == [r.tokens for r in masked]
    assert [r.accept_lengths for r in compiled] == [r.accept_lengths for r in masked]
    assert len(graphs) == 1
    equations = [node.args[0] for node in graphs[0].graph.nodes if node.target is torch.einsum]
    assert "bgrtd,bgsd->bgrts" in equations  # the split's attention_with_lse is in the graph
