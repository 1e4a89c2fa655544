"""The shipped demo (demo/): speculative greedy output equals plain output on held-out code, and tau stays
above a floor set from the value measured when the demo was built (demo/RECIPE.json)."""
import json
import sys

import pytest
import torch

from conftest import ROOT, read_generation
from decode import TreeConfig, generate
from sampling import SamplingConfig
from load import load_draft, load_target
from tokenizer import Tokenizer

DEMO = ROOT / "demo"
sys.path.insert(0, str(ROOT / "scripts"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DEMO / "head" / "draft.pth").exists(), reason="no demo/ (scripts/make_demo.py)")]
# Floors just under the greedy tau measured on these 12 prompts (tokens emitted per cycle, tree 60/6/10), fp32
# on a CPU, which repeats it exactly: a bug that only costs acceptance still shows (a catch-up reading the
# wrong features gave 4.04 for `head`). Measured: head 4.91 (4.94 over 40 in demo/RECIPE.json), head3 3.45,
# dflash 1.82 with its chain of 8 (1.93 over 40), dspark 1.85 with its chain of 8 (2.06 over 40).
TAU_FLOOR = {"head": 4.85, "head3": 3.40, "dflash": 1.78, "dspark": 1.80}
QUANTIZED_TAU_FLOOR = {"int8": 4.9, "int4": 4.95}  # measured: int8 4.97 over 6 prompts, int4 g128 5.04 over 2


@pytest.fixture(scope="module")
def demo():
    import make_demo
    tokenizer = Tokenizer(DEMO / "target")
    prompts = make_demo.held_out_prompts(tokenizer, 12)
    if len(prompts) < 12:
        pytest.skip("this interpreter's standard library lacks the held-out modules")
    model = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 512)
    return model, prompts  # each test loads its head: load_draft sets which features the target returns


@pytest.mark.parametrize("head, tree, recorded_as", [("head", TreeConfig(), "head"), ("head3", TreeConfig(), "head3"),
                                                     ("dflash", TreeConfig(6, 1, 8), "dflash_chain"),
                                                     ("dspark", TreeConfig(6, 1, 8), "dspark_chain")])
def test_demo_greedy_is_lossless_and_tau_stays_above_the_floor(demo, head, tree, recorded_as):
    model, prompts = demo
    draft = load_draft(DEMO / head / "draft.pth", model)
    lengths = []
    for prompt in prompts:
        spec = generate(model, prompt, 64, SamplingConfig(), draft=draft, tree=tree)
        assert spec.tokens == generate(model, prompt, 64, SamplingConfig()).tokens
        lengths += spec.accept_lengths
    tau = sum(lengths) / len(lengths)
    recorded = json.loads((DEMO / "RECIPE.json").read_text())["held_out"][recorded_as]["greedy"]["tau"]
    print(f"demo/{head} greedy tau on held-out code: {tau:.2f} (recorded at build time over 40 prompts: {recorded})")
    assert tau >= TAU_FLOOR[head]


@pytest.mark.parametrize("mode,groupsize,n_prompts", [("int8", 0, 6), ("int4", 128, 2)])  # int4 is slow on CPU
def test_quantized_demo_is_lossless_and_keeps_its_tau(demo, tmp_path, mode, groupsize, n_prompts):
    """The demo target quantized (quantize.py), its EAGLE-1/2 head quantized to int8: speculative output equals
    plain output of the same quantized target, and the head keeps most of its acceptance."""
    import shutil
    from quantize import quantize_checkpoint
    _, prompts = demo
    shutil.copytree(DEMO / "target", tmp_path / "target")
    shutil.copytree(DEMO / "head", tmp_path / "head")
    target_path = quantize_checkpoint(tmp_path / "target" / "model.pth", mode, groupsize or 128)
    model = load_target(target_path, "cpu", "fp32", 512)
    draft = load_draft(quantize_checkpoint(tmp_path / "head" / "draft.pth", "int8"), model)
    lengths = []
    for prompt in prompts[:n_prompts]:
        spec = generate(model, prompt, 64, SamplingConfig(), draft=draft)
        assert spec.tokens == generate(model, prompt, 64, SamplingConfig()).tokens
        lengths += spec.accept_lengths
    tau = sum(lengths) / len(lengths)
    print(f"demo {mode}{f' g{groupsize}' if groupsize else ''} target, int8 head: greedy tau {tau:.2f}")
    assert tau >= QUANTIZED_TAU_FLOOR[mode]


def test_demo_sampling_runs(demo):
    model, prompts = demo
    draft = load_draft(DEMO / "head" / "draft.pth", model)
    torch.manual_seed(0)
    result = generate(model, prompts[0], 64, SamplingConfig(temperature=1.0), draft=draft)
    assert len(result.tokens) == 64 and result.tau >= 1.7  # measured 1.80 with this seed (temperature 1)


def test_generate_without_flags_uses_the_demo(tmp_path):
    import generate as generate_module
    out = tmp_path / "out.json"
    generate_module.main(["--json_out", str(out)])  # what a new user runs first, less nothing but the file
    result = read_generation(out)
    assert result["cycles"] > 0 and len(result["tokens"]) == generate_module.DEMO_MAX_NEW_TOKENS
    assert result["text"].count("\n    ") >= 5 and "..." not in result["text"]  # indented code, not a run of dots
