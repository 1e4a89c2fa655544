"""scripts/inflate_demo.py's EAGLE-3 head: the demo's head3 inflated for the wide target reads the wide layers
that hold the demo's feature layers and drafts exactly as the demo does (the same greedy tokens, the same
accepted lengths); its padded draft vocabulary never wins; the written folder decodes through the CLI."""
import json
import sys

import pytest
import torch

import generate
import decode
from conftest import ROOT, read_generation
from decode import TreeConfig, prefill
from sampling import SamplingConfig
from load import load_draft, load_target
from attention import causal_mask
from model import EagletError
from test_inflate import REDUCED
from tokenizer import Tokenizer

sys.path.insert(0, str(ROOT / "scripts"))
import inflate_demo  # noqa: E402

DEMO = ROOT / "demo"
GREEDY = SamplingConfig()
TREE = TreeConfig(depth=6, topk=10, total_tokens=60)
DEMO_VOCAB = 4096  # demo/head3's draft vocabulary: the demo's whole vocabulary, target ids 0..4095
# 8 layers over the demo's 4: demo layer i sits at wide layer 2i, so the wide feature layers differ from the demo's
DEEPER = {**REDUCED["llama3-like"], "num_hidden_layers": 8}

pytestmark = pytest.mark.skipif(not (DEMO / "head3" / "draft.pth").is_file(), reason="no demo/head3")


@pytest.fixture(scope="module")
def demo_runs():
    """The demo target with demo/head3 on held-out prompts: (prompts, plain results, speculative results)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_demo import held_out_prompts
    prompts = held_out_prompts(Tokenizer(DEMO / "target"), 3)
    small = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 256)
    plain = [decode.generate(small, p, 32, GREEDY) for p in prompts]
    head3 = load_draft(DEMO / "head3" / "draft.pth", small)
    spec = [decode.generate(small, p, 32, GREEDY, draft=head3, tree=TREE) for p in prompts]
    return prompts, plain, spec


@pytest.mark.slow
@pytest.mark.parametrize("shape, draft_vocab, feature_ids", [
    ("llama3-like, 8 layers", 6000, [0, 2, 6]),  # GQA 4:1, a draft vocabulary padded within the target's
    ("llama2-like", 0, [0, 1, 3]),  # MHA, 6 layers (stride 1), padded to the whole vocabulary (8000)
])
def test_inflated_head3_drafts_exactly_as_the_demo(shape, draft_vocab, feature_ids, demo_runs):
    prompts, plain, spec = demo_runs
    target, _, _, _ = inflate_demo.inflate(DEMO, DEEPER if shape.endswith("8 layers") else REDUCED[shape])
    head3, config = inflate_demo.inflate_head3(DEMO, target, draft_vocab)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == feature_ids  # demo ids 0, 1, 3
    assert head3.vocab_size == config["draft_vocab_size"] == (draft_vocab or 8000)
    target.set_feature_layers(head3.feature_layers)
    target.setup_caches(1, 256)
    head3.setup_caches(256)
    taus = []
    for prompt, plain_small, spec_small in zip(prompts, plain, spec):
        spec_big = decode.generate(target, prompt, 32, GREEDY, draft=head3, tree=TREE)
        assert spec_big.tokens == plain_small.tokens
        assert spec_big.accept_lengths == spec_small.accept_lengths
        taus.append(spec_big.tau)
    assert sum(taus) / len(taus) > 2.5  # real acceptance, not a random head's ~1


@torch.no_grad()
def head_logits(model, head, tokens):
    """The head's scores after a prompt's real features (catch-up), then after its own outputs (as in the
    tree), for every position: [2 x T, draft vocab]."""
    model.setup_caches(1, 128)
    head.setup_caches(128)
    n = tokens.shape[1]
    pairs = torch.cat([tokens[0, 1:], torch.tensor([7])])
    _, features = prefill(model, tokens, 0)
    pos = torch.arange(n)
    h = head.step(model, pairs, features[0], pos, pos, causal_mask(pos, 128))
    own = head.step(model, pairs, h, n + pos, n + pos, causal_mask(n + pos, 128))
    return torch.cat([head.logits(model, h), head.logits(model, own)])


def test_padded_draft_vocab_never_wins():
    """Every padding row of the inflated head's lm_head scores below every one of the demo's rows, and those
    score as in demo/head3; the padding maps to the lowest target ids the demo's entries leave free."""
    small = load_target(DEMO / "target" / "model.pth", "cpu", "fp32")
    small_head = load_draft(DEMO / "head3" / "draft.pth", small)
    target, _, _, _ = inflate_demo.inflate(DEMO, REDUCED["llama3-like"])
    head3, _ = inflate_demo.inflate_head3(DEMO, target, 6000)
    assert torch.equal(head3.draft_to_target, torch.arange(6000))  # the demo's 0..4095, then 4096..5999
    target.set_feature_layers(head3.feature_layers)
    tokens = torch.tensor([[1] + Tokenizer(DEMO / "target").encode("def read_lines(path):\n", bos=False)])
    logits = head_logits(target, head3, tokens)
    assert logits.shape == (2 * tokens.shape[1], 6000)
    assert logits[:, DEMO_VOCAB:].max() < logits[:, :DEMO_VOCAB].min() - 1000
    torch.testing.assert_close(logits[:, :DEMO_VOCAB], head_logits(small, small_head, tokens), rtol=1e-4, atol=1e-4)
    with pytest.raises(EagletError, match="cannot hold the demo head's 4096"):
        inflate_demo.inflate_head3(DEMO, target, 4000)


def test_bf16_head3_rounds_the_fp32_one_once():
    """On CUDA the head is built in the target's bf16: every weight is the fp32 build rounded once, and the
    draft vocabulary and feature layers are the same."""
    target, _, _, _ = inflate_demo.inflate(DEMO, REDUCED["llama3-like"])
    half_target, _, _, _ = inflate_demo.inflate(DEMO, REDUCED["llama3-like"], "cpu", torch.bfloat16)
    exact, _ = inflate_demo.inflate_head3(DEMO, target, 6000)
    half, _ = inflate_demo.inflate_head3(DEMO, half_target, 6000)
    exact_params, half_params = dict(exact.named_parameters()), dict(half.named_parameters())
    assert exact_params.keys() == half_params.keys()
    for name, p in half_params.items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, exact_params[name].to(torch.bfloat16)), name
    assert torch.equal(half.draft_to_target, exact.draft_to_target) and half.feature_layers == exact.feature_layers


@pytest.mark.slow
def test_inflated_head3_folder_runs_through_the_cli(tmp_path, monkeypatch):
    """OUT_DIR/head3 next to OUT_DIR/head, loaded by load_draft and run by generate.py: the demo's tokens and
    accepted lengths with demo/head3."""
    monkeypatch.setitem(inflate_demo.SHAPES, "reduced-test", DEEPER)
    inflate_demo.main(["--shape", "reduced-test", "--out_dir", str(tmp_path / "big"), "--device", "cpu"])
    config = json.loads((tmp_path / "big" / "head3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["hidden_size"] == 512
    assert config["draft_vocab_size"] == 8000  # DRAFT_VOCAB capped at the target's vocabulary
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 6]
    target = load_target(tmp_path / "big" / "target", "cpu", "fp32")
    head3 = load_draft(tmp_path / "big" / "head3", target)
    assert target.feature_layers == head3.feature_layers == (1, 3, 7)
    assert torch.equal(head3.draft_to_target, torch.arange(8000))
    runs = {}
    for name, folder in [("inflated", tmp_path / "big"), ("demo", DEMO)]:
        out = tmp_path / f"{name}.json"
        generate.main(["--checkpoint_path", str(folder / "target" / "model.pth"), "--draft_checkpoint_path",
                       str(folder / "head3" / "draft.pth"), "--max_new_tokens", "24", "--json_out", str(out),
                       "--step_aside", "off"])  # every cycle's accepted length, not where the clock stepped aside
        runs[name] = read_generation(out)
    assert runs["inflated"]["tokens"] == runs["demo"]["tokens"]
    assert runs["inflated"]["accept_lengths"] == runs["demo"]["accept_lengths"]


@pytest.mark.slow
def test_gpu_check_eagle3_runs_on_cpu(tmp_path, monkeypatch, without_inductor):
    """gpu_check --eagle3 as a CPU smoke test on a small shape (8 layers, 5000 tokens: the head's feature
    layers moved, its draft vocabulary padded): after EAGLE-2's section, the EAGLE-3 cycle phase by phase and
    end to end in its own, lossless, with the demo head3's tau. The steps run eagerly (compile_step patched out) and the
    profiler's kernel tables are left out, to keep it short: test_bench.py's formats test runs those."""
    import gpu_check
    import measure
    monkeypatch.setitem(gpu_check.SHAPES, "small-test", dict(
        vocab_size=5000, hidden_size=320, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024))
    for module in (measure, generate):
        monkeypatch.setattr(module, "compile_step", lambda step_fn, device: step_fn)
    monkeypatch.setattr(measure, "kernel_table", lambda fn, device: {})
    gpu_check.main(["--skip_checks", "--device", "cpu", "--shapes", "small-test", "--formats", "bf16", "--eagle3",
                    "--out", str(tmp_path / "g"), "--repeats", "1", "--side_tokens", "12", "--depth", "2",
                    "--tree_topk", "3", "--total_tokens", "8", "--max_seq_length", "256"])
    results = json.loads((tmp_path / "g" / "results.json").read_text())
    assert not [name for name, r in results.items() if "error" in r], results
    small = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 256)
    expected = decode.generate(small, Tokenizer(DEMO / "target").encode(gpu_check.PROMPT), 12, GREEDY,
                               draft=load_draft(DEMO / "head3" / "draft.pth", small), tree=TreeConfig(2, 3, 8))
    row = results["small-test (inflated demo): formats side by side"]["bf16"]
    assert row["eagle3_tau"] == expected.tau > 1.5
    assert row["eagle3_same_tokens_as_plain"] and row["eagle2_same_tokens_as_plain"]
    measured, eagle3 = (results[f"small-test bf16{part} (inflated demo)"] for part in ("", " EAGLE-3"))
    assert eagle3["feature_layers"] == [1, 3, 7] and eagle3["draft_vocab"] == 5000
    assert eagle3["side_by_side"]["eaglet EAGLE-3"]["tokens_per_s"] > 0
    assert set(eagle3["cycle"]["phases"]) == set(measured["cycle"]["phases"])  # next to EAGLE-2's
    assert all(phase["ms"] > 0 for phase in eagle3["cycle"]["phases"].values())
