"""--exact (Transformer.set_exact): in bf16 on a CPU, a token's logits come out bit for bit the same as one row of a
verify and as a plain one-row step, so speculative greedy decoding gives plain greedy decoding's tokens exactly.
The real model first (SmolLM2-135M-Instruct in bf16, where the default path parts within a few tokens), layer by
layer; then every head kind, batches, chunked prefill and the draft window on random bf16 targets."""
from pathlib import Path

import pytest
import torch

import attention
from attention import causal_mask
from batch import generate_batch
from decode import TreeConfig, generate, prefill, verify
from draft_model import DraftModel
from draft_tree import DraftTree, StaticTree
from load import load_draft, load_target
from lookup import NgramLookup
from measure import random_head
from sampling import SamplingConfig
from step_aside import StepAside
from tokenizer import Tokenizer

GREEDY = SamplingConfig()
# a tree of 12 nodes, parents before children: two branches at the root, one at depth 2, depth 4 at most
PARENTS = [0, 0, 0, 1, 1, 2, 3, 3, 5, 6, 7, 8]


@pytest.fixture
def exact():
    """--exact on for the test, off after it (attention's switch is process-wide)."""
    yield
    attention.EXACT = False


def tree_of(tokens: list, parents: list) -> DraftTree:
    n = len(parents)
    depths, ancestors = [0] * n, torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        ancestors[i] |= ancestors[parents[i]]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), ancestors, torch.zeros(n))


def path_to(i: int, parents: list) -> list:
    path = [i]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


def layer_outputs(model, call) -> tuple:
    """call()'s logits and every block's output (the residual stream after it)."""
    outs = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outs.append(out)) for layer in model.layers]
    try:
        logits, _ = call()
    finally:
        for h in hooks:
            h.remove()
    return logits, outs


def verify_against_plain_steps(model, prompt: list, tokens: list) -> list:
    """The tree's verify beside one-row plain steps along each node's path (its ancestors committed at consecutive
    slots, as plain decoding writes them): for each node, the blocks (and then the logits) whose rows differ."""
    kv = model.kv_cache.kv
    with torch.no_grad():
        prefill(model, torch.tensor([prompt]), 0)
        context = kv.clone()
        ctx = torch.tensor(len(prompt))
        logits, blocks = layer_outputs(model, lambda: verify(model, tree_of(tokens, PARENTS), ctx))
        parted = []
        for i in range(len(PARENTS)):
            kv.copy_(context)
            for depth, node in enumerate(path_to(i, PARENTS)):
                pos = torch.tensor([len(prompt) + depth])
                one, one_blocks = layer_outputs(model, lambda: model(torch.tensor([[tokens[node]]]), pos, pos,
                                                                     causal_mask(pos, int(pos) + 1)))
            diff = [j for j, (b, o) in enumerate(zip(blocks, one_blocks)) if not torch.equal(b[0, i], o[0, 0])]
            parted.append(diff + (["logits"] if not torch.equal(logits[i], one[0, 0]) else []))
    return parted


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2):
    _, out = smollm2
    model = load_target(out / "model.pth", "cpu", "bf16", 512)
    tokenizer = Tokenizer(out)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Why is the sky blue? Answer in two sentences."}])
    return model, tokenizer, prompt


@pytest.mark.slow  # the real model, converted first
def test_a_verify_row_is_the_plain_step_bit_for_bit_layer_by_layer(smollm2_bf16, exact):
    """SmolLM2 in bf16, a 12-node tree of depth 4 after a chat prompt: under --exact every node's every block output
    and its logits equal those of plain one-row steps along its path, bit for bit."""
    model, tokenizer, prompt = smollm2_bf16
    tokens = tokenizer.encode(" The sky looks blue because the air scatters blue sunlight more than red")[:len(PARENTS)]
    model.set_exact(True)
    try:
        parted = verify_against_plain_steps(model, prompt, tokens)
    finally:
        model.set_exact(False)
    assert parted == [[] for _ in PARENTS]


@pytest.mark.slow
def test_smollm2_speculative_greedy_is_plain_greedy_in_bf16(smollm2_bf16, exact, tmp_path):
    """SmolLM2 in bf16, greedy, under --exact: its shipped EAGLE head (a tree) and the model drafting for itself
    (every draft accepted: every row of every verify is a committed token) give plain decoding's tokens."""
    import shutil
    from convert_hf_checkpoint import convert
    from test_smollm2_head import HEAD
    model, tokenizer, _ = smollm2_bf16
    shutil.copytree(HEAD, tmp_path / "head")
    head = load_draft(convert(tmp_path / "head", log=lambda *_: None), model)
    model.set_exact(True)
    try:
        for text in ["Give me three tips for learning Python.", "Tell me a short story about a robot."]:
            prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
            plain = generate(model, prompt, 40, GREEDY, tokenizer.eos_ids)
            run = generate(model, prompt, 40, GREEDY, tokenizer.eos_ids, draft=head,
                           tree=TreeConfig(depth=4, topk=4, total_tokens=16))
            assert run.tokens == plain.tokens, text
    finally:
        model.set_exact(False)


def test_the_lm_head_never_makes_a_one_row_call(demo_bf16, exact):
    """Under --exact the logits of each row alone equal that row's logits in a call of 16, for an lm_head reading 1536
    features (a width where a CPU's one-row bf16 matmul rounds otherwise: the one-row call is padded)."""
    target = demo_bf16[0]
    lm_head = torch.nn.Linear(1536, 512, bias=False, dtype=torch.bfloat16)
    h = torch.randn(1, 16, 1536, generator=torch.Generator().manual_seed(0)).bfloat16()
    target.set_exact(True)
    try:
        with torch.no_grad():
            many = target.logits(h, lm_head)
            assert all(torch.equal(target.logits(h[:, j:j + 1], lm_head)[0, 0], many[0, j]) for j in range(16))
    finally:
        target.set_exact(False)


DEMO = Path(__file__).resolve().parents[1] / "demo"
# the demo's code prompts on which, in bf16 without --exact, speculation parts from plain decoding at token 3
DEMO_PROMPTS = ["import os\n\n\ndef main():\n    args = ", "x = 1\n"]
TREE = TreeConfig(depth=4, topk=4, total_tokens=16)


@pytest.fixture(scope="module")
def demo_bf16():
    """The demo target in bf16, its prompts, and plain greedy decoding of each under --exact."""
    target = load_target(DEMO / "target", "cpu", "bf16", 256)
    prompts = [Tokenizer(DEMO / "target").encode(p) for p in DEMO_PROMPTS]
    target.set_exact(True)
    try:
        plain = [generate(target, p, 48, GREEDY).tokens for p in prompts]
    finally:
        target.set_exact(False)
    return target, prompts, plain


def demo_head(kind: str, target):
    """The demo's trained heads, or a random head of the kind where the demo has none (P-EAGLE, XPress)."""
    torch.manual_seed(0)
    draft = random_head(kind, target, "cpu", torch.bfloat16) if kind in ("peagle", "xpress") else \
        load_draft(DEMO / kind, target)
    draft.setup_caches(target.max_seq_length)
    target.set_feature_layers(draft.feature_layers)
    return draft


CHAIN = TreeConfig(depth=6, topk=1, total_tokens=7)


@pytest.mark.parametrize("kind, tree", [
    ("head", StaticTree()), ("head", TREE), ("head3", TREE), ("dflash", TREE), ("dspark", TREE), ("dflash2", TREE),
    ("peagle", TREE), ("xpress", TREE), ("dflash", CHAIN), ("dspark", CHAIN), ("dflash2", CHAIN), ("peagle", CHAIN),
    ("xpress", CHAIN)])
def test_every_head_kind_decodes_as_plain_in_bf16(demo_bf16, exact, kind, tree):
    """EAGLE-1's static tree, EAGLE-2 and EAGLE-3 trees; DFlash, DSpark, DFlash2, P-EAGLE and XPress trees and chains:
    under --exact, greedy speculative decoding of the bf16 demo target gives plain decoding's tokens bit for bit."""
    target, prompts, plain = demo_bf16
    draft = demo_head(kind, target)
    target.set_exact(True)
    try:
        for p, want in zip(prompts, plain):
            assert generate(target, p, 48, GREEDY, draft=draft, tree=tree).tokens == want
    finally:
        target.set_exact(False)


def test_batches_chunked_prefill_and_the_draft_window_decode_as_plain_in_bf16(demo_bf16, exact):
    """Under --exact: a batch's rows (one verify for both), a prompt prefilled in chunks of 5 (plain's in one), a head
    that sees only a window of the context, stepping aside, n-gram lookup, and the demo model drafting for itself
    (every draft accepted, so every row of every verify is committed) each give plain decoding's tokens."""
    target, prompts, plain = demo_bf16
    draft = demo_head("head", target)
    target.set_exact(True)
    try:
        target.setup_caches(2, 256)
        draft.setup_caches(256, 2)
        batched = generate_batch(target, prompts, 48, GREEDY, draft=draft, tree=TREE)
        assert [r.tokens for r in batched] == plain
        target.setup_caches(1, 256)
        draft.setup_caches(256)
        for p, want in zip(prompts, plain):
            assert generate(target, p, 48, GREEDY, draft=draft, tree=TREE, prefill_chunk=5).tokens == want
        draft.set_window(8, sinks=2)
        for p, want in zip(prompts, plain):
            assert generate(target, p, 48, GREEDY, draft=draft, tree=TREE).tokens == want
            assert generate(target, p, 48, GREEDY, draft=draft, tree=TREE,
                            step_aside=StepAside(retry_after=4, probe_steps=1)).tokens == want
            assert generate(target, p, 48, GREEDY, lookup=NgramLookup(depth=4, topk=2, total_tokens=8)).tokens == want
        target.set_feature_layers(())
        itself = DraftModel(load_target(DEMO / "target", "cpu", "bf16", 256))
        itself.setup_caches(256)
        for p, want in zip(prompts, plain):
            run = generate(target, p, 48, GREEDY, draft=itself, tree=TreeConfig(depth=4, topk=1, total_tokens=5))
            assert run.tokens == want and min(run.accept_lengths[:-1]) == 5
    finally:
        target.set_exact(False)


def test_the_command_line_s_exact_gives_no_draft_s_tokens_in_bf16(exact, tmp_path):
    """generate.py --precision bf16 --exact: with the demo's head, the tokens --no_draft gives."""
    from conftest import run_cli
    base = ["--device", "cpu", "--precision", "bf16", "--exact", "--prompt", DEMO_PROMPTS[0], "--max_new_tokens", "40",
            "--step_aside", "off"]
    plain = run_cli(tmp_path, base + ["--no_draft"])
    spec = run_cli(tmp_path, base)
    assert spec["tokens"] == plain["tokens"] and spec["tau"] > 1
