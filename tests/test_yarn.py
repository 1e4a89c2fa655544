"""YaRN rope scaling against transformers: logits past original_max_position_embeddings, the attention factor
and its mscale form, a head's table, the cache limit it lifts, a whole greedy generation, and bad configs."""
import json
import math
import subprocess
import sys

import pytest
import torch

from decode import TreeConfig, generate
from sampling import SamplingConfig
import model as model_module
from conftest import ROOT, head_config, random_head_weights, tiny_config, write_eagle_head, write_tokenizer
from convert_hf_checkpoint import convert
from load import load_draft, load_target
from model import EagletError, ModelArgs

ORIGINAL = 64  # original_max_position_embeddings: every case runs to 3 x past it
N_TOKENS = 220


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def yarn_checkpoint(path, kind, rope: dict, max_pos=ORIGINAL, legacy=False):
    """A random transformers model of tiny_config(kind) with this rope scaling, saved and converted; returns it.
    legacy: config.json says rope_theta + rope_scaling (published checkpoints) instead of transformers 5's
    rope_parameters."""
    from transformers import AutoModelForCausalLM
    config = tiny_config(kind).to_dict()
    theta = config["rope_parameters"]["rope_theta"]
    config.update(max_position_embeddings=max_pos, rope_parameters={"rope_type": "yarn", "rope_theta": theta, **rope})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(type(tiny_config(kind)).from_dict(config)).eval()
    with torch.no_grad():  # norms away from one, so that a misplaced one shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())  # its rope fields as given: none filled in
    saved["rope_parameters"] = {"rope_type": "yarn", "rope_theta": theta, **rope}
    if legacy:
        saved.update(rope_theta=theta, rope_scaling={"rope_type": "yarn", **rope})
        del saved["rope_parameters"]
    (path / "config.json").write_text(json.dumps(saved))
    write_tokenizer(path)
    convert(path, log=lambda *_: None)
    return hf


CASES = {  # id: (kind, rope fields beside rope_type, max_position_embeddings, config.json in the legacy form)
    "llama": ("llama2", {"factor": 4.0, "original_max_position_embeddings": ORIGINAL}, ORIGINAL, False),
    # Qwen's recipe: rope_scaling added to a config whose max_position_embeddings stays (40960 for Qwen3)
    "qwen3-rope_scaling": ("qwen3", {"factor": 4.0, "original_max_position_embeddings": ORIGINAL}, 80, True),
    "original-left-out": ("llama2", {"factor": 4.0}, ORIGINAL, True),  # transformers: max_position_embeddings
    "attention_factor": ("llama2", {"factor": 4.0, "attention_factor": 1.5}, ORIGINAL, False),
    "mscale": ("qwen3", {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5}, ORIGINAL, False),
    "betas-untruncated": ("qwen3", {"factor": 3.5, "beta_fast": 8, "beta_slow": 2, "truncate": False}, ORIGINAL,
                          False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_past_the_original_length(tmp_path, name):
    """A prefill of 200 tokens then one-token steps, all positions but the first 64 past the original length."""
    kind, rope, max_pos, legacy = CASES[name]
    hf = yarn_checkpoint(tmp_path, kind, rope, max_pos, legacy)
    model = load_target(tmp_path / "model.pth", "cpu", "fp32", N_TOKENS)
    assert model_module.rope_type(model.args.rope_scaling) == "yarn"
    ids = torch.randint(0, hf.config.vocab_size, (1, N_TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        pos = torch.arange(200)
        logits, _ = model(ids[:, :200], pos, pos, torch.arange(N_TOKENS) <= pos[:, None])
        assert rel_err(logits, ref[:, :200]) < 1e-4
        assert rel_err(logits[:, ORIGINAL:], ref[:, ORIGINAL:200]) < 1e-4
        for t in range(200, N_TOKENS):
            slot = torch.tensor([t])
            logits, _ = model(ids[:, t:t + 1], slot, slot, torch.arange(N_TOKENS) <= slot[:, None])
            assert rel_err(logits[:, 0], ref[:, t]) < 1e-4


def off_from_transformers(path, hf, n=128) -> float:
    model = load_target(path / "model.pth", "cpu", "fp32", n)
    ids = torch.randint(0, hf.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pos = torch.arange(n)
        logits, _ = model(ids, pos, pos, torch.arange(n) <= pos[:, None])
        return rel_err(logits, hf(ids).logits)


@pytest.mark.parametrize("name", ["llama", "attention_factor", "mscale"])
def test_the_attention_factor_matters(tmp_path, monkeypatch, name):
    """With cos and sin left unscaled the logits are off by far more than the tolerance: the factor is applied."""
    kind, rope, max_pos, legacy = CASES[name]
    hf = yarn_checkpoint(tmp_path, kind, rope, max_pos, legacy)
    expected = {"llama": 0.1 * math.log(4) + 1, "attention_factor": 1.5,
                "mscale": (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)}[name]
    assert model_module.rope_attention_factor(ModelArgs.from_hf_config(hf.config.to_dict()).rope_scaling) == \
        pytest.approx(expected)
    monkeypatch.setattr(model_module, "rope_attention_factor", lambda scaling: 1.0)
    assert off_from_transformers(tmp_path, hf) > 1e-3


def test_the_frequency_ramp_matters(tmp_path, monkeypatch):
    """With the frequencies left unscaled (the attention factor kept) the logits are off: the ramp is applied."""
    kind, rope, max_pos, legacy = CASES["llama"]
    hf = yarn_checkpoint(tmp_path, kind, rope, max_pos, legacy)
    monkeypatch.setattr(model_module, "yarn_inv_freq", lambda inv_freq, *_: inv_freq)
    assert off_from_transformers(tmp_path, hf) > 1e-3


def test_cache_limit_is_factor_times_the_original_length(tmp_path):
    """Qwen's case: max_position_embeddings 80, yarn factor 4 over 64 -> 256 slots, and one more is refused
    with the limit said; without scaling the limit stays max_position_embeddings."""
    yarn_checkpoint(tmp_path, "qwen3", CASES["qwen3-rope_scaling"][1], 80, legacy=True)
    model = load_target(tmp_path / "model.pth", "cpu", "fp32", 256)
    assert model.rope.cos.shape[0] == 256
    with pytest.raises(EagletError, match=r"^257 tokens exceed the model's limit under yarn rope scaling "
                                          r"\(256 = factor 4.0 x original_max_position_embeddings 64\)$"):
        model.setup_caches(1, 257)
    args = ModelArgs.from_hf_config(tiny_config("llama2").to_dict())
    assert model_module.context_limit(args) == (512, "max_position_embeddings (512)")
    llama31 = ModelArgs.from_hf_config(tiny_config("llama31").to_dict())  # 8 x 256 < its 16384
    assert model_module.context_limit(llama31)[0] == 16384


def test_a_head_with_yarn_builds_the_table_transformers_does(tmp_path):
    """An EAGLE head whose config.json says yarn: its cos/sin at every position are transformers' rotary
    embedding's for that config (attention factor included)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 16}
    yarn_checkpoint(tmp_path / "target", "llama2", rope)
    config = head_config(64, 4, 4, 96, 96, max_position_embeddings=ORIGINAL, rope_theta=10000.0, rope_scaling=rope)
    write_eagle_head(tmp_path / "head", random_head_weights(64, 4, 4, 96, 96), config)
    convert(tmp_path / "head", log=lambda *_: None)
    target = load_target(tmp_path / "target" / "model.pth", "cpu", "fp32", N_TOKENS)
    draft = load_draft(tmp_path / "head" / "draft.pth", target)
    assert draft.rope.cos.shape[0] == N_TOKENS
    x = torch.zeros(1, N_TOKENS, 16)
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**config))(x, torch.arange(N_TOKENS)[None])
    assert torch.allclose(draft.rope.cos, cos[0], atol=1e-5) and torch.allclose(draft.rope.sin, sin[0], atol=1e-5)


def test_greedy_generation_past_the_original_length_is_transformers(tmp_path):
    """generate(): a 40-token prompt and 180 new tokens, greedy: transformers' tokens, plain and speculative
    (a random yarn head drafting; what the target verifies is emitted)."""
    rope = {"factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    hf = yarn_checkpoint(tmp_path / "target", "llama2", rope)
    config = head_config(64, 4, 4, 96, 96, max_position_embeddings=ORIGINAL, rope_theta=10000.0,
                         rope_scaling={"rope_type": "yarn", **rope})
    write_eagle_head(tmp_path / "head", random_head_weights(64, 4, 4, 96, 96), config)
    convert(tmp_path / "head", log=lambda *_: None)
    prompt = torch.randint(4, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=180, min_new_tokens=180, do_sample=False,
                          pad_token_id=0)[0, 40:].tolist()
    tree = TreeConfig(4, 4, 16)
    model = load_target(tmp_path / "target" / "model.pth", "cpu", "fp32", 40 + 180 + tree.scratch)
    plain = generate(model, prompt, 180, SamplingConfig())
    assert plain.tokens == ref
    draft = load_draft(tmp_path / "head" / "draft.pth", model)
    model.setup_caches(1, model.max_seq_length)
    draft.setup_caches(model.max_seq_length)
    spec = generate(model, prompt, 180, SamplingConfig(), draft=draft, tree=tree)
    assert spec.tokens == ref


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
BAD = {  # id: (rope_scaling, what the one line must say)
    "no factor": ({"rope_type": "yarn"}, "config rope_scaling (yarn) is missing factor"),
    "factor zero": ({**YARN, "factor": 0}, "config rope_scaling factor must be a positive number, got 0"),
    "factor negative": ({**YARN, "factor": -2.0}, "rope_scaling factor must be a positive number, got -2.0"),
    "factor infinite": ({**YARN, "factor": float("inf")}, "rope_scaling factor must be a positive number, got inf"),
    "factor NaN": ({**YARN, "factor": float("nan")}, "rope_scaling factor must be a positive number, got nan"),
    "factor a string": ({**YARN, "factor": "4"}, "rope_scaling factor must be a positive number, got '4'"),
    "factor null": ({**YARN, "factor": None}, "rope_scaling factor must be a positive number, got None"),
    "factor a boolean": ({**YARN, "factor": True}, "rope_scaling factor must be a positive number, got True"),
    "original a float": ({**YARN, "original_max_position_embeddings": 64.5},
                         "original_max_position_embeddings must be a positive integer, got 64.5"),
    "original zero": ({**YARN, "original_max_position_embeddings": 0},
                      "original_max_position_embeddings must be a positive integer, got 0"),
    "attention_factor zero": ({**YARN, "attention_factor": 0.0},
                              "rope_scaling attention_factor must be a positive number, got 0.0"),
    "attention_factor a string": ({**YARN, "attention_factor": "1"},
                                  "attention_factor must be a positive number, got '1'"),
    "beta_fast negative": ({**YARN, "beta_fast": -32}, "beta_fast must be a positive number, got -32"),
    "beta_slow a list": ({**YARN, "beta_slow": [1]}, "beta_slow must be a positive number, got [1]"),
    "betas crossed": ({**YARN, "beta_fast": 1, "beta_slow": 32}, "beta_fast (1) must be greater than beta_slow (32)"),
    "betas equal": ({**YARN, "beta_fast": 2, "beta_slow": 2}, "beta_fast (2) must be greater than beta_slow (2)"),
    "mscale negative": ({**YARN, "mscale": -1.0}, "rope_scaling mscale must be a number >= 0, got -1.0"),
    "mscale_all_dim a string": ({**YARN, "mscale_all_dim": "1"}, "mscale_all_dim must be a number >= 0, got '1'"),
    "truncate a string": ({**YARN, "truncate": "false"}, "truncate must be true or false, got 'false'"),
    "llama3 without its band": ({"rope_type": "llama3", "factor": 8.0},
                                "rope_scaling (llama3) is missing low_freq_factor, high_freq_factor"),
    "linear factor zero": ({"rope_type": "linear", "factor": 0},
                           "rope_scaling factor must be a positive number, got 0"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_rope_scaling_is_one_clear_error(name):
    rope, message = BAD[name]
    config = {**tiny_config("llama2").to_dict(), "rope_scaling": rope}
    config.pop("rope_parameters")
    with pytest.raises(EagletError) as e:
        ModelArgs.from_hf_config(config)
    assert str(e.value).startswith("config rope_scaling") and str(e.value).endswith(message), str(e.value)
    # transformers 5's key: the same error, naming it
    config = {**tiny_config("llama2").to_dict(), "rope_parameters": {**rope, "rope_theta": 10000.0}}
    with pytest.raises(EagletError, match="config rope_parameters"):
        ModelArgs.from_hf_config(config)


def run_cli(path, *flags):
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), "--checkpoint_path", str(path / "model.pth"),
                           "--prompt", "w1 w2 w3", *flags], capture_output=True, text=True)


def test_generate_cli_runs_to_the_yarn_limit_and_says_it(tmp_path):
    """max_position_embeddings 64, yarn factor 4: 200 new tokens run; past 256 one line names the limit."""
    yarn_checkpoint(tmp_path, "llama2", {"factor": 4.0}, legacy=True)
    proc = run_cli(tmp_path, "--max_new_tokens", "200")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(tmp_path, "--max_new_tokens", "260")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: prompt (4 tokens) + max_new_tokens (260) = 264 exceeds the model's limit under yarn rope scaling "
        "(256 = factor 4.0 x original_max_position_embeddings 64)"], proc.stderr
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_scaling"]["factor"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = run_cli(tmp_path, "--max_new_tokens", "2")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'config.json'}: config rope_scaling (yarn) is missing factor"], proc.stderr
