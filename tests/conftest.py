"""Small real checkpoints made with transformers' save_pretrained, and a tokenizer.json to go with them."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"

VOCAB = 96  # w0 .. w91 plus four specials
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' ' }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def tiny_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
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
