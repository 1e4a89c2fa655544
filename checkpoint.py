"""Reading a checkpoint's files safely: config.json with every size checked, and weight files saved with torch.save
(weights_only: a pickle's code never runs). Each user mistake (a missing, corrupt or mistyped file) becomes one
EagletError naming the file, which the tools print as one `error:` line, never a traceback or a shape error deep
inside the model.

Imports torch and nothing of eaglet: every other file may import this one.
"""
import json
import math
import pickle
import re
import zipfile
from pathlib import Path

import torch
from torch import Tensor


class EagletError(Exception):
    """A user mistake (bad path, bad checkpoint, bad value): printed as one line by the CLIs."""


QUANT_KEY = "eaglet_quantization"  # a quantized file's record of what it holds (written by quantize.py)


def read_config(checkpoint_dir) -> dict:
    """A folder's config.json as a dict, or one clear error (missing, not JSON, not an object)."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise EagletError(f"no config.json in {checkpoint_dir}")
    return read_json_object(path)


def read_json_object(path: Path) -> dict:
    """A JSON file holding one object, or one clear error (not JSON, not an object)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EagletError(f"{path} is not valid JSON: {e}")
    if not isinstance(config, dict):
        raise EagletError(f"{path} is not a JSON object")
    return config


REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "tokenizer_vocab_size")


def check_config_values(config: dict):
    """Missing or mistyped config fields as one clear error, before they become a shape error deep inside."""
    missing = [k for k in REQUIRED_SIZES if k not in config]
    if missing:
        raise EagletError(f"config is missing {', '.join(missing)}")
    for key in REQUIRED_SIZES + OPTIONAL_SIZES:
        value = config.get(key)
        if (key in REQUIRED_SIZES or value is not None) and (type(value) is not int or value < 1):
            raise EagletError(f"config {key} must be a positive integer, got {value!r}")
    rope, name = rope_settings(config)
    check_rope_scaling(rope, name)
    if config.get("hidden_act", "silu") not in ("silu", "swish"):  # swish: silu's other name
        raise EagletError(f"config hidden_act {config['hidden_act']!r} is not supported: the MLP is SwiGLU, silu "
                          "(LLaMA, Mistral, Qwen)")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
        if config.get(key) is not None and type(config[key]) is not bool:
            raise EagletError(f"config {key} must be true or false, got {config[key]!r}")
    values = {"rms_norm_eps": config.get("rms_norm_eps", 1.0),
              "rope_theta": config["rope_theta"] if "rope_theta" in config else rope.get("rope_theta", 1.0)}
    for key, value in values.items():
        if type(value) not in (int, float) or not 0 < value < math.inf:
            raise EagletError(f"config {key} must be a positive number, got {value!r}")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv_heads or (not config.get("head_dim") and config["hidden_size"] % heads):
        raise EagletError(f"config: num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}, "
                          f"and hidden_size {config['hidden_size']} of num_attention_heads (unless head_dim is set)")


def rope_settings(config: dict) -> tuple:
    """(RoPE's settings, the key they are named by): transformers >= 5 writes rope_parameters (rope_theta inside);
    published checkpoints, and a user turning YaRN on as Qwen's cards say, write rope_scaling. Where a config has
    both, transformers reads rope_scaling alone (rope_theta from the config's top level, else 10000): both are
    taken only where that reading is rope_parameters' own, else refused (a model that is neither one)."""
    params, scaling = config.get("rope_parameters"), config.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise EagletError(f"config {key} must be a JSON object, got {value!r}")
    if not (params and scaling):
        return (params, "rope_parameters") if params else (scaling or {}, "rope_scaling")
    theta = config.get("rope_theta", 10000.0)
    read = lambda rope: {"rope_type": rope.get("rope_type", rope.get("type", "default")), "rope_theta": theta,  # noqa: E731
                         **{k: v for k, v in rope.items() if k not in ("type", "rope_type")}}
    if read(params) != read(scaling):
        raise EagletError(f"config has rope_parameters (as transformers 5 writes it, rope_theta inside) and a "
                          f"rope_scaling that differs from it: transformers would read rope_scaling alone, with "
                          f"rope_theta {theta}; keep one of them (the scaling's fields in rope_parameters, beside "
                          "its rope_theta)")
    return params, "rope_parameters"


# The fields each rope scaling type needs, each a positive number; yarn's original_max_position_embeddings may be
# left out (transformers then takes max_position_embeddings).
ROPE_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                 "yarn": ("factor",)}
YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow")  # positive numbers when given


def check_rope_scaling(rope: dict, name: str):
    """A rope scaling's fields (name: the config key holding them) as one clear error: missing, mistyped or
    out of range."""
    def number(value) -> bool:
        return type(value) in (int, float) and math.isfinite(value)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    missing = [k for k in ROPE_REQUIRED.get(rope_type, ()) if k not in rope]
    if missing:
        raise EagletError(f"config {name} ({rope_type}) is missing {', '.join(missing)}")
    positive = ROPE_REQUIRED.get(rope_type, ()) + (YARN_OPTIONAL if rope_type == "yarn" else ())
    for key in positive:
        value = rope.get(key)
        if (key in ROPE_REQUIRED[rope_type] or value is not None) and not (number(value) and value > 0):
            raise EagletError(f"config {name} {key} must be a positive number, got {value!r}")
    old_len = rope.get("original_max_position_embeddings")
    if old_len is not None and (type(old_len) is not int or old_len < 1):
        raise EagletError(f"config {name} original_max_position_embeddings must be a positive integer, got {old_len!r}")
    if rope_type != "yarn":
        return
    for key in ("mscale", "mscale_all_dim"):
        value = rope.get(key)
        if value is not None and not (number(value) and value >= 0):
            raise EagletError(f"config {name} {key} must be a number >= 0, got {value!r}")
    if rope.get("truncate") is not None and type(rope["truncate"]) is not bool:
        raise EagletError(f"config {name} truncate must be true or false, got {rope['truncate']!r}")
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    if fast <= slow:
        raise EagletError(f"config {name} beta_fast ({fast}) must be greater than beta_slow ({slow})")


def load_state_dict(path) -> dict:
    """Tensors saved with torch.save: memory-mapped from the zip format, read whole from the legacy format
    (old checkpoints); a quantized file also holds its record under QUANT_KEY."""
    state_dict = torch_load(path)
    if not isinstance(state_dict, dict) or \
            not all(isinstance(v, Tensor) for k, v in state_dict.items() if k != QUANT_KEY):
        raise EagletError(f"{path} is not a state dict (a mapping of names to tensors)")
    return state_dict


def torch_load(path, mmap: bool = True):
    """What torch.save wrote, with weights_only (a pickle's code is never run); a file torch cannot read is one
    error naming it. mmap: the zip format memory-mapped (never for a file that is rewritten while in use)."""
    if Path(path).is_file() and Path(path).stat().st_size == 0:
        raise EagletError(f"{path} is empty")
    try:
        return torch.load(str(path), map_location="cpu", mmap=mmap and zipfile.is_zipfile(path), weights_only=True)
    except (pickle.UnpicklingError, KeyError, EOFError):
        raise EagletError(f"cannot read {path}: not a checkpoint of plain tensors (corrupt, or it pickles other "
                          "objects, which are never unpickled here)")
    except (RuntimeError, OSError) as e:  # torch's zip reader on a cut file: "failed finding central directory"
        if "zip" not in str(e).lower() and getattr(e, "errno", None) != 22:
            raise EagletError(f"cannot read {path}: {(str(e).strip().splitlines() or [type(e).__name__])[0][:200]}")
        raise EagletError(f"cannot read {path}: truncated or corrupt (not a whole checkpoint archive)")
    except Exception as e:
        raise EagletError(f"cannot read {path}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")


def mismatch_detail(e: RuntimeError, limit: int = 600) -> str:
    """load_state_dict's multi-line error on one line, keeping which tensors and which shapes."""
    detail = "; ".join(line.strip() for line in str(e).splitlines()[1:] if line.strip()) or str(e)
    return detail if len(detail) <= limit else detail[:limit] + " ..."


def converted_files(folder: Path, name: str) -> list:
    """The converted checkpoints of one kind in a folder: name itself (model.pth, draft.pth) and the quantized
    files quantize.py writes beside it (model_int8.pth, model_int4.g32.pth, ...)."""
    stem = re.escape(Path(name).stem)
    return sorted(p for p in folder.glob("*.pth") if re.fullmatch(stem + r"(_int8|_int4\.g\d+)?\.pth", p.name))


def converted_file(path, name: str) -> Path:
    """A converted checkpoint given as the file or as its folder. A folder must hold exactly one checkpoint of the
    kind name says (model.pth or draft.pth, or one quantized file in its place): several are refused by name,
    as is a Hugging Face file or folder, with the command that converts it."""
    path = Path(path)
    convert = "convert it first: python convert_hf_checkpoint.py --checkpoint_dir"
    if path.is_dir():
        found = converted_files(path, name)
        if len(found) == 1:
            return found[0]
        if found:
            raise EagletError(f"{path} holds {len(found)} checkpoints ({', '.join(p.name for p in found)}): "
                              "give the file itself")
        others = sorted(p.name for p in path.glob("*.pth"))
        if others:
            raise EagletError(f"no {name} in {path}; it holds {', '.join(others)}: give the file itself")
        if any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")):
            raise EagletError(f"{path} holds Hugging Face weights, not a converted {name}: {convert} {path}")
        gguf = sorted(path.glob("*.gguf"))
        if gguf:
            raise EagletError(f"{path} holds a GGUF file, not a converted {name}: {convert} {gguf[0]} --out_dir FOLDER")
        raise EagletError(f"no {name} in {path} ({convert} on the model's folder)")
    if path.suffix in (".safetensors", ".bin") or path.name.endswith(".index.json"):
        raise EagletError(f"{path} is a Hugging Face weights file, not a converted {name}: {convert} {path.parent}")
    if path.suffix == ".gguf":
        raise EagletError(f"{path} is a GGUF file, not a converted {name}: {convert} {path} --out_dir FOLDER")
    return path
