"""What the compiled code touches: a step writes only the cache slots it writes. inductor's own accounting of
each kernel it generates (the elements it reads and writes) is read after compiling a real step; no kernel may
span as much as one layer's keys and values, the most that a step's attention reads. A K/V write through a view
of the shared buffer once turned into a copy of the whole buffer in every layer (40x slower than eager at 2,048
slots): this is the test that fails then. No timing here (bench.py --kv_sizes times it)."""
from contextlib import contextmanager

import pytest
import torch
from torch._inductor import metrics

import measure
from draft import EagleDraft
from batch import generate_batch
from decode import TreeConfig, decode_one_token, generate, speculative_cycle
from sampling import SamplingConfig
from graphs import compile_step
import model
from model import KVCache, ModelArgs, Transformer
from quantize import quantize_state_dict

CONFIG = dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
SLOTS = 2048  # one layer's K and V: 2 x 2 heads x 2048 slots x 32 = 262,144 elements a row, far above any weight
TREE = TreeConfig(depth=2, topk=3, total_tokens=8)
GREEDY = SamplingConfig()


@contextmanager
def kernel_sizes():
    """[(kernel, elements it touches)] for every kernel inductor generates inside the block (cached graphs off,
    so each one is compiled, and counted, here). Library calls (matmuls, SDPA) are left out: inductor counts
    the whole buffer a view of it is passed, and they write only what they return."""
    torch._dynamo.reset()
    metrics.reset()
    sizes = []
    torch._logging.set_logs(inductor_metrics=True)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield sizes
    finally:
        torch._logging.set_logs()
        torch._dynamo.reset()
    sizes += [(str(node), n) for node, n in metrics.nodes_num_elem if type(node).__name__ != "ExternKernelSchedulerNode"]


def models(rows: int = 1, mode: str = ""):
    torch.manual_seed(0)
    args = ModelArgs.from_hf_config(CONFIG)
    target = measure.random_module(Transformer, args, "cpu", torch.float32)
    if mode:
        target = Transformer.from_state_dict(args, quantize_state_dict(target.state_dict(), mode, 32))
    target.setup_caches(rows, SLOTS)
    draft = measure.random_module(EagleDraft, args, "cpu", torch.float32)
    draft.setup_caches(SLOTS, rows)
    return target, draft


def one_layer_kv(target: Transformer) -> int:
    return target.kv_cache.kv.numel() // target.args.n_layer


def check_touches_one_layer_at_most(sizes: list, target: Transformer, draft=None):
    assert sizes, "nothing was compiled: the counts would prove nothing"
    limit = min([one_layer_kv(target)] + ([draft.kv_cache.kv.numel()] if draft is not None else []))
    assert [(k, n) for k, n in sizes if n >= limit] == [], f"kernels span {limit} elements or more"


@pytest.mark.parametrize("mode", ["", "int8"])
def test_compiled_plain_step_writes_only_its_slot(mode):
    """And one graph for every step of two prompts of different lengths, each decoded as eager code decodes it."""
    from torch._dynamo.utils import counters
    target, _ = models(mode=mode)
    with kernel_sizes() as sizes:
        counters.clear()
        step = compile_step(decode_one_token, "cpu")
        for prompt in ([1, 5, 9], [1, 7, 8, 9, 10, 11, 12]):
            assert generate(target, prompt, 6, GREEDY, step_fn=step).tokens == generate(target, prompt, 6, GREEDY).tokens
        assert counters["stats"]["unique_graphs"] == 1
    check_touches_one_layer_at_most(sizes, target)


@pytest.mark.slow  # a minute of compiling; the fast tier's plain step catches a write through a view
def test_compiled_cycle_writes_only_its_slots(tmp_path):
    """Expansion (the draft's cache), verify (the tree's scratch slots), commit (the accepted path moved after
    the context, every layer at once) and catch-up, in one compiled graph; and on a head that agrees in part with
    its target, the same graph for cycles that accept different lengths, each as eager code decodes (conftest's
    check_compiled_cycle, which the other heads' compiled tests use too)."""
    from conftest import check_compiled_cycle, make_agreeing_pair
    from convert_hf_checkpoint import convert
    from load import load_draft, load_target
    target, draft = models()
    eager = generate(target, [1, 5, 9], 8, GREEDY, draft=draft, tree=TREE)
    with kernel_sizes() as sizes:
        compiled = generate(target, [1, 5, 9], 8, GREEDY, draft=draft, tree=TREE,
                            step_fn=compile_step(speculative_cycle, "cpu"))
    assert compiled.tokens == eager.tokens and compiled.accept_lengths == eager.accept_lengths
    check_touches_one_layer_at_most(sizes, target, draft)
    target_dir, head_dir, _ = make_agreeing_pair(tmp_path, vocab=32, hidden=32, wrong_fraction=0.3)
    convert(target_dir), convert(head_dir)
    agreeing = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    lengths = check_compiled_cycle(agreeing, load_draft(head_dir / "draft.pth", agreeing), TREE, inductor=True)
    assert len(lengths) >= 2


@pytest.mark.slow
def test_compiled_batch_cycle_writes_only_its_slots():
    """Rows at different places: each row's own slots ([B, T] indices), and its own path compacted."""
    target, draft = models(rows=2)
    prompts = [[1, 5, 9], [1, 7, 8, 9, 10, 11]]
    eager = generate_batch(target, prompts, 8, GREEDY, draft=draft, tree=TREE)
    with kernel_sizes() as sizes:
        compiled = generate_batch(target, prompts, 8, GREEDY, draft=draft, tree=TREE,
                                  step_fn=compile_step(speculative_cycle, "cpu"))
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]
    assert [r.accept_lengths for r in compiled] == [r.accept_lengths for r in eager]
    check_touches_one_layer_at_most(sizes, target, draft)


def test_llama3_8b_cache_at_33k_slots_is_two_buffers_each_indexed_in_32_bits():
    """One buffer of every layer at 33k slots holds 2.2 billion elements: inductor then indexes in 64 bits and
    torch 2.11's flex_attention kernel fails to compile (seen on an H200). Each buffer stays under 2**31."""
    with torch.device("meta"):
        short, long = (KVCache(32, 1, slots, 8, 128, torch.bfloat16) for slots in (32_000, 33_000))
    assert short.n_buffers == 1
    assert long.n_buffers == 2 and [b.shape[0] for b in long.kv_buffers()] == [31, 1]
    assert all(b.numel() <= 2**31 - 1 for b in long.kv_buffers())


def test_cache_in_several_buffers_decodes_as_one(monkeypatch):
    """Each layer in a buffer of its own: plain (eager and compiled), speculative and batched decoding give the
    same tokens, accepted lengths and cache contents as one buffer of every layer."""
    prompts = [[1, 5, 9], [1, 7, 8, 9, 10, 11]]

    def run(target, draft):
        plain = generate(target, prompts[0], 6, GREEDY).tokens
        compiled = generate(target, prompts[0], 6, GREEDY, step_fn=compile_step(decode_one_token, "cpu")).tokens
        spec = generate(target, prompts[0], 8, GREEDY, draft=draft, tree=TREE)
        batch = generate_batch(target, prompts, 8, GREEDY, draft=draft, tree=TREE)
        return (plain, compiled, spec.tokens, spec.accept_lengths, [(r.tokens, r.accept_lengths) for r in batch],
                torch.cat(target.kv_cache.kv_buffers()))

    one = run(*models(rows=2))
    monkeypatch.setattr(model, "MAX_BUFFER_ELEMENTS", 2 * 2 * 2 * SLOTS * 32)  # one layer: K and V, 2 rows, 2 heads
    target, draft = models(rows=2)
    assert target.kv_cache.n_buffers == 2
    split = run(target, draft)
    torch._dynamo.reset()
    assert split[:5] == one[:5] and one[0] == one[1]
    assert torch.equal(split[5], one[5])


def test_cuda_plain_step_is_captured_by_default_and_the_cycle_on_graph_trees(monkeypatch):
    """The defaults that a GPU measured (the plain step as CapturedGraphs) and EAGLET_GRAPHS's two overrides. Only
    wrappers are built here: nothing runs, so no GPU is needed."""
    import graphs
    kinds = lambda: [type(compile_step(fn, "cuda")).__name__ for fn in (decode_one_token, speculative_cycle)]
    monkeypatch.setattr(graphs, "GRAPHS", "")  # EAGLET_GRAPHS unset (a script run earlier in this process may set it)
    assert kinds()[0] == "CapturedGraphs" and kinds()[1] != "CapturedGraphs"
    monkeypatch.setattr(graphs, "GRAPHS", "manual")
    assert kinds() == ["CapturedGraphs", "CapturedGraphs"]
    monkeypatch.setattr(graphs, "GRAPHS", "trees")
    assert "CapturedGraphs" not in kinds()
    assert type(compile_step(decode_one_token, "cpu")).__name__ != "CapturedGraphs"
