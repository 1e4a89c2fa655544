"""Small real checkpoints made with transformers' save_pretrained, and a tokenizer.json to go with them."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB = 96  # w0 .. w91 plus four specials
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
    with torch.no_grad():  # norms away from their all-ones start, so that a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
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


def check_compiled_cycle(model, draft, tree, n_tokens=30):
    """The compiled speculative cycle decodes as eager (tokens and accepted lengths) over two prompts, in one
    graph; returns the accepted lengths seen (the last cycle of each run, cut by n_tokens, left out)."""
    import generate
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    step = generate.compile_step(generate.speculative_cycle, "cpu")
    greedy, lengths = generate.SamplingConfig(), set()
    for prompt in ([1, 5, 9], [1, 7, 8, 9, 10, 11, 12]):
        eager = generate.generate(model, prompt, n_tokens, greedy, draft=draft, tree=tree)
        compiled = generate.generate(model, prompt, n_tokens, greedy, draft=draft, tree=tree, step_fn=step)
        assert compiled.tokens == eager.tokens and compiled.accept_lengths == eager.accept_lengths
        lengths |= set(compiled.accept_lengths[:-1])
    assert counters["stats"]["unique_graphs"] == 1
    return lengths


def scripted_input(lines):
    """A stand-in for input(): returns the lines in turn, then raises EOFError like a closed terminal."""
    turns = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(turns)
        except StopIteration:
            raise EOFError
    return fake_input


def expect_error(argv, match, main=None):
    """Run a CLI's main(argv) and check that it exits with one line, 'error: ...', containing match."""
    if main is None:
        from generate import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message and match in message, message
