"""A GGUF file (llama.cpp, ollama, LM Studio) read and converted for convert_hf_checkpoint.py: a config.json, the
tokenizer files, and the weights under Hugging Face names, then in ours, written as model.pth or
model_int4.g32.pth (convert_gguf_file). The file is parsed here (header, metadata, tensor table, memory-mapped
data), so no GGUF library is needed.

Weights keep the file's values exactly. F32 / F16 / BF16 are taken as they are; Q8_0, Q5_0, Q5_1, Q5_K and Q6_K
are dequantized as llama.cpp computes them, in fp32, and kept in fp16 where that holds every value of a tensor
(other types too if the gguf package is installed: it has code for more, Q2_K, Q3_K, the IQ types); Q4_0,
Q4_1 and Q4_K Linears map onto Int4Linear's group-32 form with minimums without going through floats
(w = q * scale + minimum per 32 input channels, the scales and minimums in fp16 as the file has them, or in
fp32 where fp16 does not hold them: Q4_K's are products of two fields). llama.cpp stores the query and key
rows of LLaMA-family attention permuted for its RoPE; they are put back in Hugging Face's order.

Imports checkpoint.py, model.py, quantize.py, cli.py, convert_common.py (a layer in our names, the output file's
place) and convert_hub_int4.py (the int4 width check); convert_hf_checkpoint.py imports it.
"""
import json
import mmap
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from cli import Progress
from checkpoint import QUANT_KEY, EagletError
from model import ModelArgs
from quantize import output_path, pack_int4, quantization_record, spill
from convert_common import convert_layer, make_folder, refuse_existing
from convert_hub_int4 import check_int4_widths

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
VALUE_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# ggml type id -> (name, values per block, bytes per block)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
         6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
         13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


@dataclass
class GGUFTensor:
    name: str
    type: str
    shape: tuple  # torch order: [out, in] for a matrix (GGUF lists the dimensions innermost first)
    start: int  # byte offset in the file
    nbytes: int
    block_bytes: int = 0  # a quantized type's bytes per block


@dataclass
class GGUFFile:
    path: Path
    metadata: dict
    tensors: dict  # name -> GGUFTensor
    data: mmap.mmap

    def raw(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return np.frombuffer(self.data, np.uint8, t.nbytes, t.start)


class Reader:
    """Little-endian values from the mapped file, in order."""

    def __init__(self, data, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise EagletError(f"{self.path} is truncated (its header ends at byte {len(self.data)})")
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise EagletError(f"{self.path} is truncated (its header ends at byte {len(self.data)})")
        raw = self.data[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item_kind, n = self.take("<I"), self.take("<Q")
            if item_kind in VALUE_FORMATS and item_kind != 7:  # numbers: one read for the whole array
                fmt = VALUE_FORMATS[item_kind]
                size = struct.calcsize(fmt) * n
                if self.pos + size > len(self.data):
                    raise EagletError(f"{self.path} is truncated (its header ends at byte {len(self.data)})")
                values = np.frombuffer(self.data, fmt, n, self.pos).tolist()
                self.pos += size
                return values
            return [self.value(item_kind) for _ in range(n)]
        if kind not in VALUE_FORMATS:
            raise EagletError(f"{self.path}: metadata value of unknown type {kind} (a damaged file?)")
        return self.take(VALUE_FORMATS[kind])


def read_gguf(path: Path) -> GGUFFile:
    """The header, metadata and tensor table of a GGUF file (versions 2 and 3), its data memory-mapped."""
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise EagletError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}")
    r = Reader(data, path)
    if data[:4] != b"GGUF":
        raise EagletError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    r.pos = 4
    version = r.take("<I")
    if version not in (2, 3):
        raise EagletError(f"{path}: GGUF version {version}; eaglet reads versions 2 and 3")
    n_tensors, n_values = r.take("<Q"), r.take("<Q")
    metadata = {}
    for _ in range(n_values):
        key = r.string()
        metadata[key] = r.value(r.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.take("<Q") for _ in range(r.take("<I"))]
        infos.append((name, dims, r.take("<I"), r.take("<Q")))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise EagletError(f"{path}: general.alignment is {alignment!r}, not a positive integer")
    data_start = -(-r.pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        type_name, block, block_bytes = TYPES.get(kind) or other_type(kind, name, path)
        count = int(np.prod(dims)) if dims else 1
        if not dims or dims[0] % block:
            raise EagletError(f"{path}: tensor {name} has rows of {dims[0]}, not whole {type_name} blocks")
        t = GGUFTensor(name, type_name, tuple(reversed(dims)), data_start + offset, count // block * block_bytes,
                       block_bytes)
        if t.start + t.nbytes > len(data):
            raise EagletError(f"{path} is truncated: tensor {name} ends at byte {t.start + t.nbytes}, the file "
                              f"at {len(data)}")
        tensors[name] = t
    return GGUFFile(path, metadata, tensors, data)


def other_type(kind: int, name: str, path: Path) -> tuple:
    """A type eaglet has no code for (Q2_K, Q3_K, the IQ types, ...): the gguf package dequantizes it, if
    installed and if it can; else one error naming the type."""
    try:
        import gguf
        qtype = gguf.GGMLQuantizationType(kind)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), qtype)  # raises if it has no code either
        return qtype.name, block, block_bytes
    except ImportError:
        where = "; pip install gguf dequantizes more types"
    except (ValueError, KeyError, NotImplementedError):
        where = " (nor does the gguf package)"
    readable = ", ".join(t[0] for t in TYPES.values())
    raise EagletError(f"{path}: tensor {name} is of ggml type {kind}, which eaglet does not read{where}; it reads "
                      f"{readable}")


# Dequantization: blocks [n, bytes per block] (uint8) -> values [n, values per block] (float32)
def halves(blocks: Tensor, at: int) -> Tensor:
    """fp16 fields at byte offset `at` of each block, as float32 [n, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def low_high(qs: Tensor) -> Tensor:
    """Bytes [n, 16] -> 32 4-bit values: the low nibbles first, then the high ones (ggml's Q4/Q5 order)."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def k_scales(scales: Tensor) -> tuple:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit minimums, one each per 32 values."""
    s = scales.long()
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mins = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return sc.float(), mins.float()


def q4k_groups(blocks: Tensor) -> tuple:
    """Q4_K blocks -> (q [n, 8, 32], scale [n, 8], minimum [n, 8]): w = scale * q - minimum."""
    sc, mins = k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(-1, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32)  # each 32 bytes: 32 low, then 32 high
    return q, halves(blocks, 0) * sc, halves(blocks, 2) * mins


def q5k_values(blocks: Tensor) -> Tensor:
    """Q5_K: Q4_K's layout with a fifth bit per value (32 bytes after the scales: sub-block s uses bit s)."""
    sc, mins = k_scales(blocks[:, 4:16])
    qs = blocks[:, 48:176].reshape(-1, 4, 32)
    low = torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32).int()
    fifth = (blocks[:, None, 16:48].int() >> torch.arange(8, dtype=torch.int32)[None, :, None]) & 1
    q = (low | (fifth << 4)).float()
    return ((halves(blocks, 0) * sc)[..., None] * q - (halves(blocks, 2) * mins)[..., None]).reshape(-1, 256)


def q5_values(blocks: Tensor, at: int) -> Tensor:
    """Q5_0 / Q5_1: 4 bytes of fifth bits at `at`, then the low nibbles; value i's fifth bit is bit i."""
    high = blocks[:, at:at + 4].contiguous().view(torch.int32)
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1
    return (low_high(blocks[:, at + 4:at + 20]).int() | (bits << 4)).float()


def q6k_values(blocks: Tensor) -> Tensor:
    ql, qh = blocks[:, :128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)
    q = torch.cat([(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
                   (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)],
                  dim=2).float() - 32  # [n, 2 halves, 128]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 2, 8, 1)
    return (q.reshape(-1, 2, 8, 16) * scales).reshape(-1, 256) * halves(blocks, 208)


def dequantize_blocks(blocks: Tensor, kind: str) -> Tensor:
    if kind == "Q8_0":
        return halves(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()
    if kind == "Q4_0":
        return halves(blocks, 0) * (low_high(blocks[:, 2:18]).float() - 8)
    if kind == "Q4_1":
        return halves(blocks, 0) * low_high(blocks[:, 4:20]).float() + halves(blocks, 2)
    if kind == "Q5_0":
        return halves(blocks, 0) * (q5_values(blocks, 2) - 16)
    if kind == "Q5_1":
        return halves(blocks, 0) * q5_values(blocks, 4) + halves(blocks, 2)
    if kind == "Q4_K":
        q, scale, minimum = q4k_groups(blocks)
        return (scale[..., None] * q.float() - minimum[..., None]).reshape(-1, 256)
    if kind == "Q5_K":
        return q5k_values(blocks)
    if kind == "Q6_K":
        return q6k_values(blocks)
    import gguf  # a type only the gguf package reads (other_type checked it can)
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(values.astype(np.float32)).reshape(blocks.shape[0], -1)


def blocks_of(f: GGUFFile, name: str) -> Tensor:
    return torch.from_numpy(f.raw(name).copy()).reshape(-1, f.tensors[name].block_bytes)


def narrowest_exact(values: Tensor) -> Tensor:
    """fp32 values in fp16 where that holds every one of them exactly (half the bytes), else as they are."""
    half = values.half()
    return half if torch.equal(half.float(), values) else values


def dequantize(f: GGUFFile, name: str, dtype=None) -> Tensor:
    """A tensor as float: F32 / F16 / BF16 as stored, a quantized one as llama.cpp computes it (fp32), kept in
    fp16 if that holds it exactly; in dtype if given."""
    t = f.tensors[name]
    if t.type in ("F32", "F16", "BF16"):
        stored = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[t.type]
        return torch.from_numpy(f.raw(name).copy()).view(stored).reshape(t.shape).to(dtype or stored)
    values = dequantize_blocks(blocks_of(f, name), t.type).reshape(t.shape)
    return values.to(dtype) if dtype else narrowest_exact(values)


def int4_groups(f: GGUFFile, name: str) -> tuple:
    """A Q4_0 / Q4_1 / Q4_K matrix [out, in] as (q uint8 [out, in] in 0..15, scale and minimum [out, in / 32],
    float32): w = q * scale + minimum, in fp32 exactly the file's weights as llama.cpp computes them (q * scale
    is exact, only the sum rounds)."""
    t = f.tensors[name]
    blocks = blocks_of(f, name)
    if t.type == "Q4_K":
        q, scale, minimum = q4k_groups(blocks)
        scale, minimum = scale.reshape(-1), -minimum.reshape(-1)
    else:
        offset = 4 if t.type == "Q4_1" else 2
        q, scale = low_high(blocks[:, offset:offset + 16]), halves(blocks, 0).reshape(-1)
        minimum = halves(blocks, 2).reshape(-1) if t.type == "Q4_1" else -8 * scale  # Q4_0: d * (q - 8)
    out_features, in_features = t.shape
    return (q.reshape(out_features, in_features), scale.reshape(out_features, -1), minimum.reshape(out_features, -1))


def unpermute(t: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's reordering of query / key rows: within each head it stores the rotary pairs
    interleaved (0, d/2, 1, d/2 + 1, ...), where Hugging Face keeps the two halves apart."""
    return t.reshape(n_head, -1, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


# Configuration
def key(meta: dict, arch: str, name: str, default=None):
    return meta.get(f"{arch}.{name}", default)


def llama3_rope(freqs: Tensor, dim: int, base: float, contexts: tuple) -> dict:
    """llama.cpp stores LLaMA-3.1's RoPE scaling as the divisor of each frequency (rope_freqs). The scaling
    that gives exactly those divisors, from the published settings; an error if none does."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    factor = float(freqs.max())
    for original in contexts + (8192, 4096, 2048, 16384):
        for low, high in ((1.0, 4.0), (1.0, 2.0)):
            wavelen = 2 * torch.pi / inv_freq
            smooth = (original / wavelen - low) / (high - low)
            divisor = torch.where(wavelen < original / high, torch.ones_like(inv_freq),
                                  torch.where(wavelen > original / low, torch.full_like(inv_freq, factor),
                                              1 / ((1 - smooth) / factor + smooth)))
            if torch.allclose(divisor, freqs.double(), rtol=1e-3):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": original}
    raise EagletError("rope_freqs holds a RoPE scaling eaglet cannot name (not LLaMA-3's with its published "
                      "settings)")


def gguf_config(f: GGUFFile) -> dict:
    """config.json as transformers writes it for the model the metadata describes."""
    meta = f.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise EagletError(f"{f.path}: architecture {arch!r}; eaglet runs {', '.join(ARCHITECTURES)}")
    try:
        dim, n_head = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
        config = {"architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                     "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
                  "model_type": arch, "hidden_size": dim, "num_hidden_layers": meta[f"{arch}.block_count"],
                  "intermediate_size": meta[f"{arch}.feed_forward_length"], "num_attention_heads": n_head,
                  "num_key_value_heads": key(meta, arch, "attention.head_count_kv", n_head),
                  "head_dim": key(meta, arch, "attention.key_length", dim // n_head),
                  "vocab_size": len(meta["tokenizer.ggml.tokens"])}
    except KeyError as e:
        raise EagletError(f"{f.path}: metadata {e.args[0]} is missing")
    config.update(rms_norm_eps=key(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6),
                  rope_theta=key(meta, arch, "rope.freq_base", 10000.0),
                  max_position_embeddings=key(meta, arch, "context_length", 4096),
                  tie_word_embeddings="output.weight" not in f.tensors, torch_dtype="float32",
                  bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    else:  # LLaMA's biases (qwen2's on q, k, v come with its model type)
        config.update(attention_bias="blk.0.attn_q.bias" in f.tensors, mlp_bias="blk.0.ffn_up.bias" in f.tensors)
    scaling = key(meta, arch, "rope.scaling.type", "none")
    if "rope_freqs.weight" in f.tensors:
        original = key(meta, arch, "rope.scaling.original_context_length")
        config["rope_scaling"] = llama3_rope(dequantize(f, "rope_freqs.weight", torch.float32), config["head_dim"],
                                             config["rope_theta"], (original,) if original else ())
    elif scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": key(meta, arch, "rope.scaling.factor")}
    elif scaling != "none":
        raise EagletError(f"{f.path}: RoPE scaling {scaling!r}; eaglet runs none, linear and LLaMA-3's")
    return config


# Tokenizer
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how text is split before byte-level BPE: (regexes applied in turn, whether a word
# found whole in the vocabulary skips the merges, as LLaMA-3's tokenizer does)
BPE_SPLITS = {"default": ([GPT2_SPLIT], False), "gpt-2": ([GPT2_SPLIT], False),
              "smollm": ([r"\p{N}", GPT2_SPLIT], False),
              "llama-bpe": ([LLAMA3_SPLIT], True), "llama3": ([LLAMA3_SPLIT], True), "llama-v3": ([LLAMA3_SPLIT], True),
              "qwen2": ([QWEN2_SPLIT], False), "deepseek-r1-qwen": ([QWEN2_SPLIT], False)}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def bpe_tokenizer(meta: dict, path: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in BPE_SPLITS:
        raise EagletError(f"{path}: its tokenizer splits text as {pre!r} (tokenizer.ggml.pre), which eaglet "
                          f"cannot build; it builds {', '.join(BPE_SPLITS)}")
    splits, ignore_merges = BPE_SPLITS[pre]
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def merges_from_scores(tokens: list, scores: list) -> list:
    """A sentencepiece vocabulary's BPE merges: every split of a token into two tokens, the merge ranked by
    the score of the token it makes (higher first)."""
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                merges.append((-score, ids[left], ids[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def sentencepiece_tokenizer(meta: dict, path: Path):
    from tokenizers import Tokenizer, decoders, models, normalizers
    tokens, scores = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise EagletError(f"{path}: a sentencepiece vocabulary without scores (tokenizer.ggml.scores)")
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges_from_scores(tokens, scores),
                               unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
    prefix = [normalizers.Prepend("\u2581")] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def gguf_tokenizer(f: GGUFFile) -> dict:
    """tokenizer.json, tokenizer_config.json (special tokens, the chat template) and generation_config.json,
    as text, from the vocabulary in the metadata."""
    from tokenizers import AddedToken, processors
    meta = f.metadata
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": bpe_tokenizer, "llama": sentencepiece_tokenizer}
    if kind not in builders:
        raise EagletError(f"{f.path}: tokenizer {kind!r} (tokenizer.ggml.model); eaglet builds gpt2 (byte-level "
                          "BPE) and llama (sentencepiece) vocabularies")
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    try:
        tok = builders[kind](meta, f.path)
    except EagletError:
        raise
    except Exception as e:  # the tokenizers library raises plain Exception on a vocabulary it cannot take
        raise EagletError(f"{f.path}: cannot build its tokenizer from the metadata: {e}")
    # Control tokens (<|im_start|>, </s>) are matched whole in text and dropped when decoding; user-defined
    # ones (<think>) are matched whole and kept.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], bos)])
    tok_config = {"add_bos_token": bool(add_bos), "bos_token": tokens[bos] if bos is not None else None,
                  "eos_token": tokens[eos] if eos is not None else None}
    if meta.get("tokenizer.chat_template"):
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(tok_config, indent=2),
            "generation_config.json": json.dumps(generation, indent=2)}


# Weights, under Hugging Face names
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Linears eaglet fuses into one (q, k, v; gate, up): 4-bit together or not at all
FUSED = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def linear_types(f: GGUFFile) -> list:
    return [t.type for n, t in f.tensors.items() if n.startswith("blk.") and n.endswith(".weight") and len(t.shape) == 2]


def layer_linear(f: GGUFFile, name: str, int4: bool, n_head: int) -> dict:
    """One Linear (GGUF name without .weight) as weight [+ bias], or Int4Linear's weight, scales and minimums;
    its rows put back in Hugging Face's order if n_head (a LLaMA-family query or key)."""
    if int4:
        q, scale, minimum = int4_groups(f, f"{name}.weight")
        parts = {"weight": q, "scales": narrowest_exact(scale), "minimums": narrowest_exact(minimum)}
    else:
        parts = {"weight": dequantize(f, f"{name}.weight")}
    if f"{name}.bias" in f.tensors:
        parts["bias"] = dequantize(f, f"{name}.bias")
    if n_head:
        parts = {k: unpermute(v, n_head) for k, v in parts.items()}
    if int4:
        parts["weight"] = pack_int4(parts["weight"])
    return parts


def gguf_layer(f: GGUFFile, i: int, config: dict, int4_allowed: bool = True) -> dict:
    """Decoder layer i under Hugging Face names (model.layers.i.*); its 4-bit Linears in Int4Linear's form if
    int4_allowed, else dequantized."""
    src, dst = f"blk.{i}.", f"model.layers.{i}."
    permuted = config["model_type"] in ("llama", "mistral")  # llama.cpp permutes these only
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]} if permuted else {}
    out, taken = {}, set()
    for group in FUSED:
        present = [m for m in group if f"{src}{m}.weight" in f.tensors]
        if len(present) < len(group):
            raise EagletError(f"{f.path}: tensor {src}{next(m for m in group if m not in present)}.weight is missing")
        int4 = int4_allowed and all(f.tensors[f"{src}{m}.weight"].type in INT4_TYPES for m in group)
        for m in group:
            parts = layer_linear(f, src + m, int4, heads.get(m, 0))
            out.update({f"{dst}{LAYER_NAMES[m]}.{k}": v for k, v in parts.items()})
            taken.update({f"{src}{m}.weight", f"{src}{m}.bias"})
    for m in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm"):
        if f"{src}{m}.weight" in f.tensors:
            out[f"{dst}{LAYER_NAMES[m]}.weight"] = dequantize(f, f"{src}{m}.weight")
            taken.add(f"{src}{m}.weight")
    unknown = sorted(n for n in f.tensors if n.startswith(src) and n not in taken)
    if unknown:
        raise EagletError(f"{f.path}: tensor {unknown[0]} is not one eaglet knows")
    return out


def check_tensor_names(f: GGUFFile, n_layer: int):
    known = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    unknown = sorted(n for n in f.tensors if n not in known and not re.fullmatch(r"blk\.\d+\..*", n))
    beyond = sorted(n for n in f.tensors if n.startswith("blk.") and int(n.split(".")[1]) >= n_layer)
    if unknown or beyond:
        raise EagletError(f"{f.path}: tensor {(unknown or beyond)[0]} is not one eaglet knows")
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in f.tensors:
            raise EagletError(f"{f.path}: tensor {name} is missing")


def find_gguf(path: Path) -> Path:
    """The .gguf file a path names: itself, or the one .gguf file in a folder."""
    if path.is_file():
        return path
    found = sorted(path.glob("*.gguf"))
    if not found:
        raise EagletError(f"no .gguf file in {path}")
    if len(found) > 1:
        raise EagletError(f"{path} holds {len(found)} .gguf files ({', '.join(p.name for p in found[:3])}); give "
                          "--checkpoint_dir the one to convert")
    return found[0]


def gguf_state_dict(f, config: dict, tmp_dir: Path, int4: bool, log=print) -> dict:
    """A GGUF file's weights in our names, its values exactly: dequantized ones in fp16 where that holds them,
    else fp32; where its Linears are 4-bit, Int4Linear's g32 form with the file's scales and minimums. The
    embedding and lm_head (a tied one stays tied) as the file has them, not requantized."""
    args = ModelArgs.from_hf_config(config)
    check_tensor_names(f, args.n_layer)
    types = sorted(set(linear_types(f)))
    record = quantization_record("int4", 32, f"{f.path.name} ({', '.join(types)})", format_version=2)
    out = {QUANT_KEY: record | {"lm_head": "as in the file"}} if int4 else {}
    rest = {"tok_embeddings.weight": dequantize(f, "token_embd.weight"),
            "norm.weight": dequantize(f, "output_norm.weight")}
    if "output.weight" in f.tensors:
        rest["output.weight"] = dequantize(f, "output.weight")
    out.update(spill(rest, tmp_dir, "embeddings"))
    with Progress("converting", args.n_layer, "layers", log=log) as progress:
        for i in range(args.n_layer):
            layer = gguf_layer(f, i, config, int4_allowed=int4)
            out.update(spill(convert_layer(layer, f"model.layers.{i}.", f"layers.{i}."), tmp_dir, f"layer{i}"))
            progress.update(i + 1)
    return out


def convert_gguf_file(path: Path, out_dir, overwrite: bool, log=print, keep_4bit: bool = True) -> Path:
    """DIR/model.pth (dequantized) or DIR/model_int4.g32.pth (its 4-bit Linears kept 4-bit) and, beside it, the
    config.json, tokenizer.json, tokenizer_config.json and generation_config.json the metadata describes.
    DIR: out_dir, else the file's folder. A file there that differs is replaced only if overwrite."""
    f = read_gguf(find_gguf(path))
    config = gguf_config(f)
    try:
        args = ModelArgs.from_hf_config(config)
    except EagletError as e:
        raise EagletError(f"{f.path}: {e}")
    texts = {"config.json": json.dumps(config, indent=2), **gguf_tokenizer(f)}
    types = linear_types(f)
    int4 = keep_4bit and any(t in INT4_TYPES for t in types)
    other = sorted(set(t for t in types if t not in INT4_TYPES + ("F32", "F16", "BF16")))
    if other:
        log(f"note: {f.path.name} holds {', '.join(other)} Linears: eaglet dequantizes them (fp32, or fp16 "
            "where that holds them exactly)"
            + (" (and the other Linears fused with them: q, k, v and gate, up go together)" if int4 else ""))
    if int4:
        check_int4_widths(args, 32)
    out_dir = Path(out_dir) if out_dir is not None else f.path.parent
    if out_dir.exists() and not out_dir.is_dir():
        raise EagletError(f"--out_dir {out_dir} is a file, not a folder")
    out_path = output_path(out_dir / "model.pth", "int4", 32) if int4 else out_dir / "model.pth"
    refuse_existing(out_path, overwrite)
    for name, text in texts.items():
        if (out_dir / name).is_file() and (out_dir / name).read_bytes() != text.encode():
            refuse_existing(out_dir / name, overwrite, f" and is not what {f.path.name} describes")
    make_folder(out_dir)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".eaglet-convert-") as tmp_dir:
            state_dict = gguf_state_dict(f, config, Path(tmp_dir), int4, log)
            log(f"writing {out_path}")
            torch.save(state_dict, Path(tmp_dir) / out_path.name)
            for name, text in texts.items():
                (Path(tmp_dir) / name).write_text(text, encoding="utf-8")
                os.replace(Path(tmp_dir) / name, out_dir / name)
            os.replace(Path(tmp_dir) / out_path.name, out_path)
    except OSError as e:
        raise EagletError(f"cannot write in {out_dir}: {e.strerror or e} (give --out_dir to write elsewhere)")
    return out_path


if __name__ == "__main__":
    raise SystemExit("error: convert_gguf.py is a part of convert_hf_checkpoint.py, not a command: "
                     "`python convert_hf_checkpoint.py --checkpoint_dir FILE.gguf` converts a GGUF file")
