"""scripts/inflate_demo.py's DFlash head: the demo's DFlash head inflated for the wide target reads the wide layers
that hold the demo's feature layers and drafts exactly as the demo does (the same greedy tokens, the same accepted
lengths, chain and tree), its per-head q/k norms over the wider heads included; the written folder decodes
through the CLI."""
import json
import sys

import pytest
import torch

import generate
import decode
from conftest import ROOT, assert_close_in_scale, read_generation
from decode import TreeConfig
from sampling import SamplingConfig
from load import load_draft, load_target
from test_inflate import REDUCED
from test_inflate_eagle3 import DEEPER
from tokenizer import Tokenizer

sys.path.insert(0, str(ROOT / "scripts"))
import inflate_demo  # noqa: E402

DEMO = ROOT / "demo"
GREEDY = SamplingConfig()
TREES = {"chain": TreeConfig(depth=6, topk=1, total_tokens=8), "tree": TreeConfig(depth=6, topk=4, total_tokens=16)}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DEMO / "dflash" / "draft.pth").is_file(),
                                                   reason="no demo/dflash")]


@pytest.fixture(scope="module")
def demo_runs():
    """The demo target with demo/dflash on held-out prompts: (prompts, plain results, {tree: results})."""
    from make_demo import held_out_prompts
    prompts = held_out_prompts(Tokenizer(DEMO / "target"), 3)
    small = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 256)
    plain = [decode.generate(small, p, 32, GREEDY) for p in prompts]
    head = load_draft(DEMO / "dflash" / "draft.pth", small)
    spec = {name: [decode.generate(small, p, 32, GREEDY, draft=head, tree=tree) for p in prompts]
            for name, tree in TREES.items()}
    return prompts, plain, spec


@pytest.mark.parametrize("shape, feature_ids", [
    ("llama3-like, 8 layers", [0, 2, 4]),  # GQA 4:1 over the demo head's 2:1, demo layer i at wide layer 2i
    ("llama2-like", [0, 1, 2]),  # MHA: the demo head's key/value heads duplicated
])
def test_inflated_dflash_drafts_exactly_as_the_demo(shape, feature_ids, demo_runs):
    prompts, plain, spec = demo_runs
    target, _, _, _ = inflate_demo.inflate(DEMO, DEEPER if shape.endswith("8 layers") else REDUCED[shape])
    head, config = inflate_demo.inflate_dflash(DEMO, target)
    assert config["dflash_config"]["target_layer_ids"] == feature_ids and config["num_target_layers"] == target.args.n_layer
    assert head.args.head_dim == 128 > 64 and head.args.qk_norm and head.args.dim == 512
    target.set_feature_layers(head.feature_layers)
    target.setup_caches(1, 256)
    head.setup_caches(256)
    for name, tree in TREES.items():
        for prompt, plain_small, spec_small in zip(prompts, plain, spec[name]):
            spec_big = decode.generate(target, prompt, 32, GREEDY, draft=head, tree=tree)
            assert spec_big.tokens == plain_small.tokens
            assert spec_big.accept_lengths == spec_small.accept_lengths, name
    assert max(n for r in spec["chain"] for n in r.accept_lengths) > 2  # the demo head's drafts were accepted


@pytest.mark.parametrize("scale", [1.0, 1e-3])  # 1e-3: q and k so small that the norms' eps counts
def test_each_layer_projects_the_demo_heads_q_k_and_v(scale):
    """q, k and v of every layer (q/k normed, rotated) at the demo heads' places: the demo's, q scaled by
    sqrt(128 / 64) for the wider 1/sqrt(head_dim). Greedy decoding alone could not see the norms' eps."""
    small = load_draft(DEMO / "dflash" / "draft.pth", load_target(DEMO / "target" / "model.pth", "cpu", "fp32"))
    target, _, _, _ = inflate_demo.inflate(DEMO, REDUCED["llama3-like"])
    head, _ = inflate_demo.inflate_dflash(DEMO, target)
    lay = inflate_demo.Layout(small.args, head.args)
    small.setup_caches(64)
    head.setup_caches(64)
    pos = torch.arange(5, 17)
    x = torch.randn(1, len(pos), small.args.dim, generator=torch.Generator().manual_seed(0)) * scale
    wide_x = torch.cat([x, torch.zeros(1, len(pos), head.args.dim - small.args.dim)], dim=-1)
    wide_groups, demo_groups = list(lay.kv_source), list(lay.kv_source.values())  # every wide group holding one
    for layer, small_layer in zip(head.layers, small.layers):
        q, k, v = small_layer.attention.project(x, *small.rope(pos, x.dtype))
        wq, wk, wv = layer.attention.project(wide_x, *head.rope(pos, x.dtype))
        dims = lay.head_dims
        assert_close_in_scale(wq[:, lay.q_heads][..., dims], q * 2 ** 0.5)  # wider matmuls: their own rounding
        assert_close_in_scale(wk[:, wide_groups][..., dims], k[:, demo_groups])
        assert_close_in_scale(wv[:, wide_groups][..., dims], v[:, demo_groups])


def test_inflate_cli_writes_a_dflash_head_the_cli_decodes(tmp_path, monkeypatch):
    monkeypatch.setitem(inflate_demo.SHAPES, "llama2-7b", REDUCED["llama2-like"])
    out = tmp_path / "wide"
    inflate_demo.main(["--out_dir", str(out), "--device", "cpu"])
    config = json.loads((out / "dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["attention_bias"] is True
    argv = ["--checkpoint_path", str(out / "target" / "model.pth"), "--max_new_tokens", "24", "--max_seq_length",
            "256", "--prompt", "def add(a, b):", "--json_out"]
    generate.main(argv + [str(tmp_path / "plain.json")])
    generate.main(argv + [str(tmp_path / "dflash.json"), "--draft_checkpoint_path", str(out / "dflash" / "draft.pth"),
                          "--step_aside", "off"])  # every cycle, whatever the clock says
    plain, dflash = read_generation(tmp_path / "plain.json"), read_generation(tmp_path / "dflash.json")
    assert dflash["tokens"] == plain["tokens"] and max(dflash["accept_lengths"]) > 1
