"""Several rows at once: a target whose rows sit at different positions of their own cache rows (per-row
positions, slots, masks and compaction) computes for each row what it computes for that row alone."""
import json

import pytest
import torch

from conftest import ROOT, assert_close_in_scale, expect_error
from sampling import SamplingConfig
from load import load_target
from attention import attention_mask, causal_mask

LENGTHS = (5, 9, 3)


def random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """Ancestors-and-self [n, n] of a random tree whose nodes come after their parents."""
    parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


@pytest.mark.parametrize("kind", ["llama31", "qwen3", "llama_bias"])
def test_rows_at_different_places_equal_each_row_alone(checkpoints, kind):
    path = checkpoints(kind)[0]
    batch, alone = load_target(path, "cpu", "fp32", 64), load_target(path, "cpu", "fp32", 64)
    batch.setup_caches(max_batch_size=len(LENGTHS), max_seq_length=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (n,), generator=g) for n in LENGTHS]
    width = max(LENGTHS)
    padded = torch.stack([torch.cat([p, torch.full((width - len(p),), 3)]) for p in prompts])  # padding after
    pos = torch.arange(width).expand(len(LENGTHS), -1)
    last = torch.tensor(LENGTHS)[:, None] - 1
    with torch.no_grad():
        logits, hidden = batch(padded, pos, pos, causal_mask(pos, 64), logits_idx=last)
        n_tree, ctx = 7, torch.tensor(LENGTHS)
        trees = torch.stack([random_tree(n_tree, g) for _ in LENGTHS])
        tokens = torch.randint(4, 96, (len(LENGTHS), n_tree), generator=g)
        depths = trees.sum(-1) - 1
        slots = ctx[:, None] + torch.arange(n_tree)
        tree_logits, tree_hidden = batch(tokens, ctx[:, None] + depths, slots, attention_mask(ctx, trees, 64))
        keep = torch.stack([torch.tensor([0, 3, 5]) for _ in LENGTHS])  # a path's slots, moved after the context
        batch.compact_kv(ctx[:, None] + keep, ctx[:, None] + torch.arange(3))
        step_pos = (ctx + 3)[:, None]
        step_logits, _ = batch(tokens[:, :1], step_pos, step_pos, causal_mask(step_pos, 64))
        for b, prompt in enumerate(prompts):
            alone.setup_caches(max_batch_size=1, max_seq_length=64)
            n = len(prompt)
            p = torch.arange(n)
            one_logits, one_hidden = alone(prompt[None], p, p, causal_mask(p, 64), logits_idx=torch.tensor([-1]))
            assert_close_in_scale(logits[b], one_logits[0])
            assert_close_in_scale(hidden[b, :n], one_hidden[0])
            c = torch.tensor(n)
            one_logits, one_hidden = alone(tokens[b:b + 1], c + depths[b], c + torch.arange(n_tree),
                                           attention_mask(c, trees[b], 64))
            assert_close_in_scale(tree_logits[b], one_logits[0])
            assert_close_in_scale(tree_hidden[b], one_hidden[0])
            alone.compact_kv(c + keep[0], c + torch.arange(3))
            one_logits, _ = alone(tokens[b:b + 1, :1], (c + 3).view(1), (c + 3).view(1), causal_mask((c + 3).view(1), 64))
            assert_close_in_scale(step_logits[b], one_logits[0])


def test_batched_mask_builder_equals_one_row_at_a_time():
    g = torch.Generator().manual_seed(1)
    ctx = torch.tensor([0, 4, 9])
    blocks = torch.stack([random_tree(6, g) for _ in ctx])
    batched = attention_mask(ctx, blocks, 20)
    for b in range(3):
        assert torch.equal(batched[b], attention_mask(ctx[b], blocks[b], 20))
    shared = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(attention_mask(ctx, shared, 20)[2], attention_mask(ctx[2], shared, 20))


DEMO = ROOT / "demo"
CODE = ["def read_lines(path):\n", "import os\n\n\ndef main():\n    args = ", "class Stack:\n    def __init__(self",
        "x = 1\n"]


@pytest.fixture(scope="module")
def demo():
    from load import load_draft
    from tokenizer import Tokenizer
    target = load_target(DEMO / "target", "cpu", "fp32")
    heads = {"plain": None, "eagle2": load_draft(DEMO / "head", target), "eagle3": load_draft(DEMO / "head3", target)}
    target.set_feature_layers(())  # load_draft set the last head's; each run sets its own again
    return target, heads, [Tokenizer(DEMO / "target").encode(p) for p in CODE]


def run_alone_and_batched(target, draft, prompts, max_new_tokens, eos_ids, step_fn=None):
    from decode import TreeConfig, generate
    from batch import generate_batch
    target.set_feature_layers(draft.feature_layers if draft is not None else ())
    tree = TreeConfig(depth=draft.default_depth if draft else 6, topk=4, total_tokens=24)
    greedy = SamplingConfig()
    alone = []
    for p in prompts:
        target.setup_caches(1, 160)
        if draft is not None:
            draft.setup_caches(160)
        alone.append(generate(target, p, max_new_tokens, greedy, eos_ids, draft=draft, tree=tree))
    target.setup_caches(len(prompts), 160)
    if draft is not None:
        draft.setup_caches(160, len(prompts))
    batched = generate_batch(target, prompts, max_new_tokens, greedy, eos_ids, draft=draft, tree=tree,
                             step_fn=step_fn)
    return alone, batched


@pytest.mark.parametrize("head", ["plain", "eagle2", "eagle3"])
def test_every_row_of_a_batch_equals_that_prompt_alone(demo, head):
    """Prompts of different lengths; an EOS that ends some rows early while the others go on."""
    target, heads, prompts = demo
    first, _ = run_alone_and_batched(target, None, prompts[:1], 12, ())
    eos = {first[0].tokens[9]}  # a token row 0 emits 10th: it ends there, the others whenever they meet it
    alone, batched = run_alone_and_batched(target, heads[head], prompts, 40, eos)
    for a, b in zip(alone, batched):
        assert b.tokens == a.tokens and b.accept_lengths == a.accept_lengths
    lengths = sorted(len(r.tokens) for r in alone)
    assert lengths[0] <= 10 < lengths[-1]  # rows really finished at different times
    if head != "plain":
        emitted = [n for r in batched for n in r.accept_lengths]
        assert sum(emitted) / len(emitted) > 2  # deep trees accepted: the batched cycle really ran


def test_too_few_cache_rows_are_named(demo):
    from batch import generate_batch
    from model import EagletError
    target, _, prompts = demo
    target.set_feature_layers(())
    target.setup_caches(2, 160)
    with pytest.raises(EagletError, match="3 prompts at once need caches of 3 rows; they hold 2"):
        generate_batch(target, prompts[:3], 8, SamplingConfig())


@pytest.mark.slow
@pytest.mark.parametrize("head", ["plain", "eagle2"])
def test_compiled_batch_equals_eager_in_one_graph(demo, head, without_inductor):
    from decode import decode_one_token, speculative_cycle
    from graphs import compile_step
    from torch._dynamo.utils import counters
    target, heads, prompts = demo
    torch._dynamo.reset()
    counters.clear()
    fn = speculative_cycle if head != "plain" else decode_one_token
    step = compile_step(fn, "cpu")
    _, eager = run_alone_and_batched(target, heads[head], prompts[:3], 30, ())
    _, compiled = run_alone_and_batched(target, heads[head], prompts[:3], 30, (), step_fn=step)
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]
    assert [r.accept_lengths for r in compiled] == [r.accept_lengths for r in eager]
    assert counters["stats"]["unique_graphs"] == 1


def cli_json(argv: list, path) -> object:
    import generate
    generate.main(argv + ["--json_out", str(path), "--overwrite"])
    return json.loads(path.read_text())


def test_cli_several_prompts_equal_each_alone(tmp_path, capsys):
    """Three prompts of different lengths and a FastChat question, two at a time (the last batch filled up),
    caches sized as tightly as the flags allow; each equals its own run, stop strings included."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["for i in range(", "second turn"]}) + "\n\n")
    argv = ["--max_new_tokens", "24", "--stop", ", ", "--step_aside", "off"]  # alone, cycles throughout as in a batch
    out = cli_json(argv + ["--prompt", CODE[0], "--prompt", CODE[1], "--prompt", CODE[3], "--prompt_file",
                           str(questions), "--batch_size", "2"], tmp_path / "batch.json")
    printed = capsys.readouterr().out
    assert "4 prompts, 2 at a time" in printed and printed.count("--- prompt ") == 4
    assert [o["samples"][0]["text"] for o in out] != [""] * 4
    for i, prompt in enumerate([CODE[0], CODE[1], CODE[3], "for i in range("]):
        alone = cli_json(argv + ["--prompt", prompt], tmp_path / f"alone{i}.json")
        assert out[i]["prompt_tokens"] == alone["prompt_tokens"]
        for key in ("tokens", "text", "accept_lengths"):
            assert out[i]["samples"][0][key] == alone["samples"][0][key], (i, key)
    assert all(", " not in o["samples"][0]["text"] for o in out)  # cut before the stop string,
    assert min(len(o["samples"][0]["tokens"]) for o in out) < 24  # which ended at least one row early


def test_cli_chat_template_on_each_prompt(checkpoints, tmp_path):
    target = checkpoints("llama2")[0]
    argv = ["--checkpoint_path", str(target), "--chat", "--max_new_tokens", "6"]
    out = cli_json(argv + ["--prompt", "w1 w2", "--prompt", "w3 w4 w5 w6"], tmp_path / "batch.json")
    for i, prompt in enumerate(["w1 w2", "w3 w4 w5 w6"]):
        alone = cli_json(argv + ["--prompt", prompt], tmp_path / f"alone{i}.json")
        assert out[i]["prompt_tokens"] == alone["prompt_tokens"] and out[i]["samples"][0]["tokens"] == \
            alone["samples"][0]["tokens"]


@pytest.mark.parametrize("lines, match", [
    ("", "holds no prompts"),
    ('"one"\n\n{"turns": []}\n', "line 3: expected a JSON string or a question"),
    ('"one"\nnot json\n', "line 2: not JSON"),
    ('"one"\n""\n', "line 2: the prompt is empty"),
])
def test_prompt_file_mistakes_name_the_line(tmp_path, lines, match):
    path = tmp_path / "p.jsonl"
    path.write_text(lines)
    expect_error(["--prompt_file", str(path)], match)


def test_several_prompts_mistakes(tmp_path, monkeypatch):
    import load
    expect_error(["--prompt", "a", "--prompt", ""], "prompt 2 of 2 is empty")
    for extra in (["--prompt", "a"], ["--prompt", "a", "--prompt", "b"], ["--num_samples", "2"]):  # never used
        expect_error([*extra, "--interactive", "--checkpoint_path", str(DEMO / "target")],
                     "--interactive starts an empty conversation and you type its messages: it takes no --prompt")
    monkeypatch.setattr(load, "free_memory", lambda device: 3_000_000)
    expect_error(["--prompt", "a", "--prompt", "b", "--prompt", "c", "--batch_size", "3", "--max_seq_length", "1024"],
                 "--batch_size 3: caches of 1024 slots for 3 rows need")
