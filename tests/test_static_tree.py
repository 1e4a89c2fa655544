"""--tree static (draft_tree.StaticTree): a fixed tree given as paths of child ranks, the same shape every cycle.
Lossless against plain greedy decoding with every head kind, eager, compiled and in a batch; its DraftTree
against a reading of the paths; its checks."""
import pytest
import torch

import generate
from batch import generate_batch
import decode
from load import load_draft, load_target
from conftest import ROOT, expect_error, read_generation
from attention import causal_mask
from decode import catch_up_prompt, prefill, speculative_cycle
from sampling import SamplingConfig
from graphs import compile_step
from draft_tree import StaticTree
from model import EagletError
from tokenizer import Tokenizer

DEMO = ROOT / "demo"
CHOICES = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0))


@pytest.fixture(scope="module")
def demo():
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 512)
    tokenizer = Tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(p) for p in ("def read_lines(path):\n", "class Stack:\n    def __init__(self):\n")]
    return target, prompts, [decode.generate(target, p, 64, SamplingConfig()).tokens for p in prompts]


def test_the_shape_read_from_the_paths():
    tree = StaticTree(((1,), (0,), (0, 0), (1, 0), (0, 0, 2)))  # given out of order: parents first after sorting
    assert tree.choices == ((0,), (1,), (0, 0), (1, 0), (0, 0, 2))
    assert (tree.total_tokens, tree.depth, tree.levels, tree.topk) == (6, 3, 4, 3)
    assert tree.scratch == 6  # the verified nodes; 4 draft slots (levels 1 and 2), 4 levels
    t = tree.table("cpu")
    assert t["parents"].tolist() == [0, 0, 0, 1, 2, 3] and t["depths"].tolist() == [0, 1, 1, 2, 2, 3]
    want = torch.zeros(6, 6, dtype=torch.bool)
    for i, chain in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 1, 3, 5]]):
        want[i, chain] = True
    assert torch.equal(t["ancestors"], want)
    for bad, words in (((), "non-empty list"), (((0,), (0,)), "twice"), (((0,), (1, 0)), "no parent"),
                       (((0,), (-1,)), "child ranks"), (((0,), ()), "child ranks")):
        with pytest.raises(EagletError, match=words):
            StaticTree(bad)


@pytest.mark.parametrize("head", ["head", "head3", "dflash"])
def test_greedy_equals_plain_with_every_head_kind(demo, head):
    target, prompts, plain = demo
    draft = load_draft(DEMO / head / "draft.pth", target)
    tree = StaticTree(CHOICES)
    tree.check(draft)
    accepted = []
    for prompt, want in zip(prompts, plain):
        result = decode.generate(target, prompt, 64, SamplingConfig(), draft=draft, tree=tree)
        assert result.tokens == want
        accepted += result.accept_lengths
    assert max(accepted) >= 3 and len(accepted) < 2 * 64  # drafts were accepted, deep ones too


def test_a_dflash_block_drafts_each_node_from_its_levels_position(demo):
    target, prompts, _ = demo
    draft = load_draft(DEMO / "dflash" / "draft.pth", target)
    tree = StaticTree(CHOICES)
    root, ctx = torch.tensor(prompts[0][-1]), torch.tensor(len(prompts[0]) - 1)
    with torch.no_grad():
        _, features = target(torch.tensor([prompts[0][:-1]]), torch.arange(ctx), torch.arange(ctx),
                             causal_mask(torch.arange(ctx), 512))
        draft.catch_up(target, torch.tensor(prompts[0][1:]), features[0], torch.tensor(0), ctx - 1)
        built = tree.expand(target, draft, root, ctx, None)
        logp, ids = draft.topk(target, draft.block_states(target, root, ctx, tree.depth), tree.topk)  # marginals
    for i, path in enumerate(tree.choices, start=1):
        assert built.tokens[i] == ids[len(path) - 1, path[-1]] and built.draft_logp[i] == logp[len(path) - 1, path[-1]]
    deep = StaticTree(tuple(tuple([0] * d) for d in range(1, draft.block_size + 1)))  # one level too deep
    with pytest.raises(EagletError, match="needs a block of"):
        deep.check(draft)


@pytest.mark.slow
def test_compiled_and_batched_static_cycles_equal_plain(demo, without_inductor):
    target, prompts, plain = demo
    draft = load_draft(DEMO / "head" / "draft.pth", target)
    tree = StaticTree(CHOICES)
    step = compile_step(speculative_cycle, "cpu")
    for prompt, want in zip(prompts, plain):
        assert decode.generate(target, prompt, 64, SamplingConfig(), draft=draft, tree=tree, step_fn=step).tokens == want
    target.setup_caches(2, 512)
    draft.setup_caches(512, 2)
    rows = generate_batch(target, prompts, 64, SamplingConfig(), draft=draft, tree=tree)
    assert [r.tokens for r in rows] == plain


def test_the_cli_flag(tmp_path):
    out = {}
    for name, flags in (("plain", ["--no_draft"]), ("static", ["--tree", "static", "--tree_choices", "[[0], [1], [0, 0], [0, 0, 0]]"])):
        generate.main(["--max_new_tokens", "40", "--json_out", str(tmp_path / f"{name}.json"), *flags])
        out[name] = read_generation(tmp_path / f"{name}.json")
    assert out["static"]["tokens"] == out["plain"]["tokens"] and out["static"]["cycles"] < 40
    expect_error(["--tree", "static", "--tree_choices", "[[0], [2, 0]]"], "has no parent [2]")
    expect_error(["--tree", "static", "--depth", "3"], "leave out --depth")
    expect_error(["--tree_choices", "[[0]]"], "give both")


@pytest.mark.parametrize("head", ["head", "head3"])
def test_a_nodes_drafts_depend_on_its_ancestors_alone(demo, head):
    """From an EAGLE head, a node's token is its own parent's rank-th draft: the same in the whole tree and in a
    tree of its path alone (a draft taken after another node of the level above would differ)."""
    target, prompts, _ = demo
    draft = load_draft(DEMO / head / "draft.pth", target)
    tree = StaticTree(CHOICES)
    with torch.no_grad():
        logits, features = prefill(target, torch.tensor([prompts[0]]), 0)
        root, ctx = logits.argmax(-1)[0], torch.tensor(len(prompts[0]))
        h_last = catch_up_prompt(target, draft, prompts[0], 0, features, root)
        whole = tree.expand(target, draft, root, ctx, h_last)
        for path in ((1, 0), (0, 1, 0), (0, 0, 1)):
            alone = StaticTree(tuple(path[:k] for k in range(1, len(path) + 1))).expand(target, draft, root, ctx, h_last)
            i = tree.choices.index(path) + 1
            assert whole.tokens[i] == alone.tokens[-1], path
            assert torch.allclose(whole.draft_logp[i], alone.draft_logp[-1], atol=1e-5), path
