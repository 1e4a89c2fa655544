"""scripts/inflate_demo.py: the demo embedded in wider, deeper weights computes the demo's function -- the same
greedy tokens plain and speculative, the same accepted lengths -- at reduced LLaMA-2-like (MHA) and
LLaMA-3-like (GQA 4:1, wider heads) shapes built by the same code as the 7B and 8B ones, and the written
folder works as an ordinary checkpoint through the CLI."""
import json
import sys

import pytest
import torch

import generate
import decode
from conftest import ROOT, read_generation
from decode import TreeConfig
from sampling import SamplingConfig
from load import load_draft, load_target
from tokenizer import Tokenizer

sys.path.insert(0, str(ROOT / "scripts"))
import inflate_demo  # noqa: E402

DEMO = ROOT / "demo"
REDUCED = {  # 512 wide, 6 layers, 8000 tokens; head_dim 128 as in the real shapes
    "llama2-like": dict(vocab_size=8000, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=4, head_dim=128, max_position_embeddings=2048),
    "llama3-like": dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048),
}
GREEDY = SamplingConfig()
TREE = TreeConfig(depth=6, topk=10, total_tokens=60)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DEMO / "target" / "model.pth").is_file(), reason="no demo/")]


@pytest.fixture(scope="module")
def demo_pair():
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 256)
    return target, load_draft(DEMO / "head" / "draft.pth", target)


@pytest.fixture(scope="module")
def held_out_prompts():
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_demo import held_out_prompts
    return held_out_prompts(Tokenizer(DEMO / "target"), 3)


@pytest.mark.parametrize("shape", list(REDUCED))
def test_inflated_demo_decodes_exactly_as_the_demo(shape, demo_pair, held_out_prompts):
    small, small_head = demo_pair
    target, head, target_config, _ = inflate_demo.inflate(DEMO, REDUCED[shape])
    assert target.args.dim == 512 and target.args.n_layer == 6 and target.args.vocab_size == 8000
    assert target_config["tokenizer_vocab_size"] == 4096
    target.setup_caches(1, 256)
    head.setup_caches(256)
    taus = []
    for prompt in held_out_prompts:
        plain_small = decode.generate(small, prompt, 32, GREEDY)
        plain_big = decode.generate(target, prompt, 32, GREEDY)
        spec_small = decode.generate(small, prompt, 32, GREEDY, draft=small_head, tree=TREE)
        spec_big = decode.generate(target, prompt, 32, GREEDY, draft=head, tree=TREE)
        assert plain_big.tokens == plain_small.tokens == spec_big.tokens
        assert spec_big.accept_lengths == spec_small.accept_lengths
        taus.append(spec_big.tau)
    assert sum(taus) / len(taus) > 2.5  # real acceptance, not a random head's ~1
    print(f"{shape}: tau {sum(taus) / len(taus):.2f} on {len(taus)} held-out prompts, same as the demo")


def test_draft_vocab_of_the_demo_tokens_drafts_the_same(held_out_prompts):
    """gpu_check --draft_vocab: an inflated head restricted to the first ids (all of the demo's tokens) drafts
    the same trees -- the same tokens, the same accepted lengths -- while its lm_head shrinks."""
    target, head, target_config, _ = inflate_demo.inflate(DEMO, REDUCED["llama3-like"])
    target.setup_caches(1, 256)
    head.setup_caches(256)
    full = decode.generate(target, held_out_prompts[0], 32, GREEDY, draft=head, tree=TREE)
    head.restrict_vocab(target, torch.arange(target_config["tokenizer_vocab_size"]))
    assert head.lm_head_module(target).weight.shape[0] == 4096 < target.args.vocab_size
    restricted = decode.generate(target, held_out_prompts[0], 32, GREEDY, draft=head, tree=TREE)
    assert restricted.tokens == full.tokens and restricted.accept_lengths == full.accept_lengths


def test_inflated_folder_runs_through_the_cli(tmp_path, capsys):
    shape = dict(REDUCED["llama3-like"])
    inflate_demo.SHAPES["reduced-test"] = shape
    try:
        inflate_demo.main(["--shape", "reduced-test", "--out_dir", str(tmp_path / "big"), "--device", "cpu"])
    finally:
        del inflate_demo.SHAPES["reduced-test"]
    config = json.loads((tmp_path / "big" / "target" / "config.json").read_text())
    assert config["hidden_size"] == 512 and config["tokenizer_vocab_size"] == 4096
    out = tmp_path / "out.json"
    generate.main(["--checkpoint_path", str(tmp_path / "big" / "target" / "model.pth"), "--draft_checkpoint_path",
                   str(tmp_path / "big" / "head" / "draft.pth"), "--max_new_tokens", "24", "--json_out", str(out),
                   "--step_aside", "off"])  # the accepted lengths of every cycle, not where the clock says to step aside
    demo_out = tmp_path / "demo.json"
    generate.main(["--max_new_tokens", "24", "--json_out", str(demo_out), "--step_aside", "off"])
    big, small = read_generation(out), read_generation(demo_out)
    assert big["tokens"] == small["tokens"] and big["accept_lengths"] == small["accept_lengths"]
    with pytest.raises(SystemExit, match="exists"):  # never writes over a folder
        inflate_demo.main(["--shape", "llama2-7b", "--out_dir", str(tmp_path / "big")])


def test_bf16_inflation_rounds_the_fp32_one_once():
    """On CUDA the inflated model is built in bf16: every weight must be the fp32 build rounded once (the
    demo's numbers scaled in fp32, then cast), and greedy decoding must run in that dtype."""
    shape = REDUCED["llama3-like"]
    exact, exact_head, _, _ = inflate_demo.inflate(DEMO, shape)
    half, half_head, _, _ = inflate_demo.inflate(DEMO, shape, "cpu", torch.bfloat16)
    for full_module, bf16_module in [(exact, half), (exact_head, half_head)]:
        full_params, bf16_params = dict(full_module.named_parameters()), dict(bf16_module.named_parameters())
        assert full_params.keys() == bf16_params.keys()
        for name, p in bf16_params.items():
            assert p.dtype == torch.bfloat16 and torch.equal(p, full_params[name].to(torch.bfloat16)), name
    half.setup_caches(1, 128)
    half_head.setup_caches(128)
    out = decode.generate(half, list(range(5, 25)), 8, GREEDY, draft=half_head, tree=TREE)
    assert len(out.tokens) == 8 and out.accept_lengths
