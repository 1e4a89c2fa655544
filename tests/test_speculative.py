"""EAGLE-2 speculative decoding: greedy output equals plain greedy output, caches stay exact, the CLI works."""

import pytest
import torch
from safetensors.torch import load_file

import generate
import decode
from conftest import expect_error, head_config, make_agreeing_pair, random_head_weights, read_generation, scripted_input, write_eagle_head
from convert_hf_checkpoint import convert
from decode import TreeConfig
from sampling import SamplingConfig
from load import load_draft, load_target
from attention import causal_mask

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, checkpoints):
    """name -> (target folder, head folder): a random head, an agreeing head, and a partly wrong one."""
    out = {}
    target, _ = checkpoints("llama31")
    head = tmp_path_factory.mktemp("random_head")
    write_eagle_head(head, random_head_weights(64, 4, 2, 96, 96, generator=torch.Generator().manual_seed(0)),
                     head_config(64, 4, 2, 96, 96))
    convert(head)
    out["random"] = (target, head)
    for name, wrong in [("agreeing", 0.0), ("perturbed", 0.3)]:
        t, h, _ = make_agreeing_pair(tmp_path_factory.mktemp(name), wrong_fraction=wrong)
        convert(t), convert(h)
        out[name] = (t, h)
    return out


def prompts(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("name,tau_range", [("random", (1.0, 1.5)), ("agreeing", (6.0, 8.0)),
                                            ("perturbed", (2.0, 5.5))])
def test_greedy_speculative_equals_plain(pairs, name, tau_range):
    target_dir, head_dir = pairs[name]
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 256)
    draft = load_draft(head_dir / "draft.pth", model)
    vocab = model.args.vocab_size
    lengths = []
    for prompt in prompts(vocab, 8):
        plain = decode.generate(model, prompt, 48, GREEDY)
        spec = decode.generate(model, prompt, 48, GREEDY, draft=draft)
        assert spec.tokens == plain.tokens
        lengths += spec.accept_lengths
    tau = sum(lengths) / len(lengths)
    print(f"{name} head: tau {tau:.2f} over {len(lengths)} cycles, accepted lengths seen {sorted(set(lengths))}")
    assert tau_range[0] <= tau <= tau_range[1]
    if name == "perturbed":
        assert len(set(lengths)) >= 4  # partial and varied acceptance
    if name == "agreeing":
        assert max(lengths) == TreeConfig().depth + 2  # the deepest possible path is reached


@pytest.mark.parametrize("depth,topk,total_tokens", [(3, 4, 12), (6, 10, 60), (1, 2, 3)])
def test_greedy_other_tree_shapes(pairs, depth, topk, total_tokens):
    target_dir, head_dir = pairs["perturbed"]
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 256)
    draft = load_draft(head_dir / "draft.pth", model)
    tree = TreeConfig(depth, topk, total_tokens)
    for prompt in prompts(64, 4, seed=1):
        assert decode.generate(model, prompt, 40, GREEDY, draft=draft, tree=tree).tokens == \
            decode.generate(model, prompt, 40, GREEDY).tokens


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=["greedy", "sampled"])
def test_caches_equal_plain_decoding_after_cycles(pairs, sampling):
    """Target KV = plain prefill of the emitted text; draft KV = the head run over (f_t, x_{t+1}) pairs
    with the target's true features."""
    target_dir, head_dir = pairs["perturbed"]
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 256)
    draft = load_draft(head_dir / "draft.pth", model)
    prompt = prompts(64, 1, seed=5)[0]
    torch.manual_seed(0)
    result = decode.generate(model, prompt, 60, sampling, draft=draft)
    assert len(result.accept_lengths) >= 5 and len(set(result.accept_lengths)) >= 2
    seq = prompt + result.tokens
    n = len(seq) - 1  # the last emitted token is the next root: not in the caches yet

    ref_model = load_target(target_dir / "model.pth", "cpu", "fp32", 256)
    ref_draft = load_draft(head_dir / "draft.pth", ref_model)
    with torch.no_grad():
        pos = torch.arange(n)
        _, features = ref_model(torch.tensor([seq[:n]]), pos, pos, causal_mask(pos, 256))
        ref_draft.step(ref_model, torch.tensor(seq[1:n + 1]), features[0], pos, pos, causal_mask(pos, 256))
    for got, want in zip(model.layers, ref_model.layers):
        for name in ("k_cache", "v_cache"):
            a, b = getattr(got.attention.kv_cache, name), getattr(want.attention.kv_cache, name)
            assert torch.allclose(a[:, :, :n], b[:, :, :n], atol=1e-5)
    for name in ("k_cache", "v_cache"):
        a, b = getattr(draft.layer.attention.kv_cache, name), getattr(ref_draft.layer.attention.kv_cache, name)
        assert torch.allclose(a[:, :, :n], b[:, :, :n], atol=1e-5)


@pytest.mark.parametrize("fmt", ["bin-embed-bias", "safetensors-no-embed-no-bias"])
def test_cli_end_to_end_with_published_head_format(checkpoints, tmp_path, fmt):
    target, _ = checkpoints("llama2")
    with_extras = fmt == "bin-embed-bias"
    head = tmp_path / "head"
    weights = random_head_weights(64, 4, 4, 96, 96, fc_bias=with_extras, embed_copy=with_extras)
    write_eagle_head(head, weights, head_config(64, 4, 4, 96, 96, **({} if with_extras else {"bias": False})),
                     safetensors=not with_extras)
    saved = torch.load(head / "pytorch_model.bin") if with_extras else load_file(str(head / "model.safetensors"))
    assert sorted(saved) == sorted(weights)  # the published key names, embedding copy and bias as asked
    generate_args = ["--checkpoint_path", str(target / "model.pth"), "--prompt", "w5 w9 w11",
                     "--max_new_tokens", "30", "--device", "cpu"]
    from convert_hf_checkpoint import main as convert_main
    convert_main(["--checkpoint_dir", str(head)])
    assert (head / "draft.pth").exists()
    out = tmp_path / "spec.json"
    generate.main(generate_args + ["--draft_checkpoint_path", str(head / "draft.pth"), "--depth", "4",
                                   "--tree_topk", "5", "--total_tokens", "20", "--json_out", str(out)])
    spec = read_generation(out)
    generate.main(generate_args + ["--json_out", str(tmp_path / "plain.json")])
    plain = read_generation(tmp_path / "plain.json")
    assert spec["tokens"] == plain["tokens"]
    assert spec["cycles"] > 0 and plain["cycles"] == 0  # the head ran, and only when asked


def test_interactive_with_draft(pairs, monkeypatch, capsys):
    target_dir, head_dir = pairs["agreeing"]
    monkeypatch.setattr("builtins.input", scripted_input(["w5 w6", "w7 w8 w9"]))
    generate.main(["--checkpoint_path", str(target_dir / "model.pth"), "--draft_checkpoint_path",
                   str(head_dir / "draft.pth"), "--interactive", "--max_new_tokens", "12", "--device", "cpu",
                   "--max_seq_length", "256"])
    out = capsys.readouterr().out
    assert out.count("tau ") == 2


def test_draft_errors(pairs, checkpoints, tmp_path):
    target_dir, head_dir = pairs["agreeing"]  # hidden 64, vocab 64
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--device", "cpu", "--prompt", "w5"]
    draft = ["--draft_checkpoint_path", str(head_dir / "draft.pth")]
    expect_error(base + ["--draft_checkpoint_path", str(tmp_path / "nope.pth")], "draft checkpoint not found")
    expect_error(base + draft + ["--total_tokens", "1"], "total_tokens")
    expect_error(base + draft + ["--depth", "1", "--tree_topk", "2", "--total_tokens", "8"], "total_tokens")
    expect_error(base + draft + ["--depth", "0"], "depth")
    expect_error(base + draft + ["--tree_topk", "65"], "exceeds the draft's vocabulary (64)")
    static = ["--tree", "static", "--tree_choices"]
    expect_error(base + draft + static + ["[[0], [64]]"], "the static tree's child rank 64 is past the draft's "
                 "vocabulary (64 tokens: ranks 0 to 63)")  # ranks, not a --tree_topk the user never gave
    expect_error(base + draft + static + ["[]"], "a static tree is a non-empty list of paths")  # not the default tree
    # a head for another target: vocabulary 96 instead of 64
    other_target, _ = checkpoints("llama31")
    expect_error(["--checkpoint_path", str(other_target / "model.pth"), "--device", "cpu"] + draft,
                 "does not match the target")
    # hidden size 32 instead of 64
    small = tmp_path / "small"
    write_eagle_head(small, random_head_weights(32, 4, 2, 64, 64), head_config(32, 4, 2, 64, 64))
    convert(small)
    expect_error(base + ["--draft_checkpoint_path", str(small / "draft.pth")], "hidden size 32 vs 64")
    # a whole model given as the draft, and a draft given as the target
    expect_error(base + ["--draft_checkpoint_path", str(target_dir / "model.pth")],
                 "neither an EAGLE-1/2 nor an EAGLE-3 draft head")
    expect_error(["--checkpoint_path", str(head_dir / "draft.pth"), "--device", "cpu"], "draft head")
