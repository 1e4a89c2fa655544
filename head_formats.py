"""Reading draft heads: the published layouts of EAGLE-1/2, EAGLE-3 and DFlash heads (their configs made flat,
their flags, the target layers they read), the checks that refuse a head that does not fit its target, and
load_head, which builds draft.py's classes from a converted draft.pth.

Imports draft.py (the heads), model.py and quantize.py (a quantized head's Linears); generate.py, train_draft.py
and convert_hf_checkpoint.py import it, the cycle never does.
"""
import json
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from checkpoint import EagletError, load_state_dict, mismatch_detail, read_config
from draft import DFlashDraft, DraftHead, Eagle3Draft, Eagle3Flags, EagleDraft
from model import ModelArgs
from quantize import pack_quantized, pop_quantization, use_quantized_linears


def load_head(checkpoint_path, target: ModelArgs, device="cpu", dtype=torch.float32) -> DraftHead:
    """An EAGLE-1/2, EAGLE-3 or DFlash head converted by convert_hf_checkpoint.py (or quantized by quantize.py),
    checked against its target."""
    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise EagletError(f"draft checkpoint not found: {checkpoint_path} "
                          "(run convert_hf_checkpoint.py --checkpoint_dir on the head's folder first)")
    config = head_config(read_config(checkpoint_path.parent), str(checkpoint_path.parent / "config.json"))
    state_dict = load_state_dict(checkpoint_path)
    pop_quantization(state_dict, checkpoint_path)  # its Linears are told by their keys (assign_weights)
    args, kind = head_args(config), head_kind(config, state_dict, str(checkpoint_path))
    if kind == "eagle3":
        model = eagle3_from_state_dict(config, args, state_dict, target, str(checkpoint_path))
    elif kind == "dflash":
        model = dflash_from_state_dict(config, args, state_dict, target, str(checkpoint_path))
    else:
        if args.dim != target.dim or config.get("vocab_size", target.vocab_size) != target.vocab_size:
            differ = [f"{name} {mine} vs {theirs}" for name, mine, theirs in
                      [("hidden size", args.dim, target.dim), ("vocabulary", args.vocab_size, target.vocab_size)]
                      if mine != theirs]
            raise EagletError(f"draft head {checkpoint_path} does not match the target (head vs target): "
                              + ", ".join(differ))
        with torch.device("meta"):
            model = EagleDraft(args, fc_bias="fc.bias" in state_dict)
        assign_weights(model, state_dict, str(checkpoint_path))
    model = model.to(device=device, dtype=dtype).eval()
    pack_quantized(model)
    return model


def assign_weights(model: nn.Module, state_dict: dict, where: str):
    with torch.device("meta"):
        use_quantized_linears(model, state_dict)
    try:
        model.load_state_dict(state_dict, assign=True)
    except RuntimeError as e:
        raise EagletError(f"{where} does not match its config.json: {mismatch_detail(e)}")


def eagle3_from_state_dict(config: dict, args: ModelArgs, state_dict: dict, target: ModelArgs,
                           where: str) -> Eagle3Draft:
    target_dim = config.get("target_hidden_size") or args.dim
    own_embedding = "embed.weight" in state_dict
    if target_dim != target.dim or (args.dim != target.dim and not own_embedding):
        raise EagletError(f"EAGLE-3 head {where} is for a target of hidden size {target_dim}, this target has "
                          f"{target.dim}")
    if args.vocab_size != target.vocab_size:
        raise EagletError(f"EAGLE-3 head {where} is for a vocabulary of {args.vocab_size}, the target has "
                          f"{target.vocab_size}")
    d2t = state_dict.pop("d2t").long()
    draft_vocab = state_dict["lm_head.weight"].shape[0]
    if d2t.shape != (draft_vocab,):
        raise EagletError(f"{where}: d2t has {tuple(d2t.shape)} entries but lm_head has {draft_vocab} rows")
    draft_to_target = torch.arange(draft_vocab) + d2t
    if draft_to_target.min() < 0 or draft_to_target.max() >= target.vocab_size or \
            draft_to_target.unique().numel() != draft_vocab:
        raise EagletError(f"{where}: d2t maps the draft vocabulary outside the target's {target.vocab_size} "
                          "tokens, or maps two draft tokens to one")
    with torch.device("meta"):
        model = Eagle3Draft(args, target_dim, draft_vocab, own_embedding, eagle3_flags(config, where))
    assign_weights(model, state_dict, where)
    model.draft_to_target = draft_to_target
    model.feature_layers = eagle3_feature_layers(config, target.n_layer, where)
    return model


def dflash_from_state_dict(config: dict, args: ModelArgs, state_dict: dict, target: ModelArgs,
                           where: str) -> DFlashDraft:
    """A DFlash head from its config.json (Qwen3 keys, block_size, num_target_layers, dflash_config) and weights,
    refused by name before any weight moves if it does not fit the target."""
    dflash = config.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise EagletError(f"{where}: dflash_config must be a JSON object, got {dflash!r}")
    differ = [f"{name} {mine} vs {theirs}" for name, mine, theirs in
              [("hidden size", args.dim, target.dim), ("vocabulary", args.vocab_size, target.vocab_size),
               ("target layers", config.get("num_target_layers", target.n_layer), target.n_layer)] if mine != theirs]
    if differ:
        raise EagletError(f"DFlash head {where} does not match the target (head vs target): {', '.join(differ)}")
    block_size, mask_id = dflash.get("block_size", config.get("block_size")), dflash.get("mask_token_id")
    if type(block_size) is not int or block_size < 2:
        raise EagletError(f"{where}: block_size must be a whole number of at least 2, got {block_size!r}")
    if type(mask_id) is not int or not 0 <= mask_id < target.vocab_size:
        raise EagletError(f"{where}: dflash_config.mask_token_id must be a token id below the target's vocabulary "
                          f"({target.vocab_size}), got {mask_id!r}")
    ids = dflash.get("target_layer_ids") or dflash_layer_ids(target.n_layer, args.n_layer)
    if not isinstance(ids, list) or not all(type(k) is int and 0 <= k <= target.n_layer - 2 for k in ids):
        raise EagletError(f"{where}: target_layer_ids {ids!r} must name layers 0..{target.n_layer - 2} of the "
                          f"{target.n_layer}-layer target (its last layer's output, after the final norm in "
                          "transformers' numbering, is not a feature eaglet taps)")
    if "sliding_attention" in (config.get("layer_types") or []) and config.get("use_sliding_window", True):
        args.sliding_window = config.get("sliding_window")
    args.qk_norm = True  # DFlash layers are Qwen3's, whatever model_type says
    with torch.device("meta"):
        model = DFlashDraft(args, len(ids), block_size, mask_id)
    assign_weights(model, state_dict, where)
    model.feature_layers = tuple(k + 1 for k in ids)  # layer k's output is the input of layer k + 1
    return model


def dflash_layer_ids(n_target_layers: int, n_draft_layers: int) -> list:
    """DFlash's default feature layers: the middle one for a one-layer head, else one per draft layer spread
    evenly from layer 1 to layer L - 3 (rounded half to even, as Python's round)."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    span = n_target_layers - 4
    return [round(1 + i * span / (n_draft_layers - 1)) for i in range(n_draft_layers)]


def eagle3_feature_layers(config: dict, n_layer: int, where: str) -> tuple:
    """The target layers whose input the head reads (L: the last layer's output, before the final norm):
    the configured ones, or by default 2, L//2, L-3, as EAGLE, vLLM and SGLang read them. An id k in
    eagle_config.eagle_aux_hidden_state_layer_ids names the OUTPUT of layer k, the input of layer k + 1
    (SpecForge and SGLang: "+ 1"); head_config has put speculators' ids (layer inputs) in these terms."""
    ids = feature_layer_ids(config, where)
    layers = tuple(k + 1 for k in ids) if ids else (2, n_layer // 2, n_layer - 3)
    if len(layers) != 3 or not all(0 <= i <= n_layer for i in layers):
        raise EagletError(f"{where} reads the target's layers {list(layers)}, which a {n_layer}-layer target "
                          "does not have three of")
    if not ids and not layers[0] < layers[1] < layers[2]:  # a shallow target: the defaults repeat or go back
        raise EagletError(f"{where}: on a {n_layer}-layer target the default EAGLE-3 feature layers 2, L//2, "
                          f"L-3 are {list(layers)}, not three distinct layers in order; name the ones the head "
                          "was trained on in its config.json (eagle_config.eagle_aux_hidden_state_layer_ids, "
                          "id k = the output of layer k; train_draft.py: --feature_layers)")
    return layers


def feature_layer_ids(config: dict, where: str):
    """eagle_config.eagle_aux_hidden_state_layer_ids checked: None (not set) or a list of three ints."""
    eagle_config = config.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise EagletError(f"{where}: eagle_config must be a JSON object, got {eagle_config!r}")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(type(k) is int for k in ids):
        raise EagletError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer numbers, got {ids!r}")
    if len(ids) != 3:
        raise EagletError(f"{where}: eagle_aux_hidden_state_layer_ids names {len(ids)} target layers; eaglet runs "
                          "EAGLE-3 heads that read three")
    return ids


FLAGS = tuple(Eagle3Flags.__dataclass_fields__)


def eagle3_flags(config: dict, where: str) -> Eagle3Flags:
    """The head's Eagle3Flags from its (flat) config, or an error naming the setting eaglet cannot run."""
    for name in FLAGS:
        if type(config.get(name, False)) is not bool:
            raise EagletError(f"{where}: {name} must be true or false, got {config[name]!r}")
    if config.get("fc_norm") and config.get("norm_before_fc"):
        raise EagletError(f"{where}: fc_norm and norm_before_fc are both set; a head normalises its features "
                          "one way or the other (speculators refuses both too)")
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state", True) is not True:
        raise EagletError(f"{where}: eagle_config.use_aux_hidden_state is not true: a head without fc over the "
                          "target's features is not an EAGLE-3 head eaglet runs")
    return Eagle3Flags(**{name: config.get(name, False) for name in FLAGS})


def head_config(config: dict, where: str) -> dict:
    """A head's config.json flat, in EAGLE's names, whichever layout published it. EAGLE's, SpecForge's and
    train_draft.py's configs are flat already. speculators' (vLLM's library: speculators_model_type "eagle3")
    nests the layer's shape in transformer_layer_config. Top-level eagle_aux_hidden_state_layer_ids
    (speculators' place for them, where vLLM reads them) name layer INPUTS, as vLLM takes the hidden state
    entering layer k: here they become eagle_config.eagle_aux_hidden_state_layer_ids k - 1 (layer outputs)."""
    kind = config.get("speculators_model_type")
    if kind is None and "eagle_aux_hidden_state_layer_ids" not in config:
        return config
    flat = dict(config)
    if kind is not None:
        if kind != "eagle3":
            raise EagletError(f"{where}: speculators_model_type {kind!r} is not an EAGLE-3 head; eaglet reads "
                              "speculators' eagle3 heads")
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise EagletError(f"{where}: a speculators config needs transformer_layer_config, a JSON object")
        if layer.get("model_type", "llama") not in ("llama", "qwen3"):
            raise EagletError(f"{where}: transformer_layer_config model_type {layer.get('model_type')!r}: "
                              "eaglet runs speculators' EAGLE-3 layers of model_type llama and qwen3")
        if "norm_before_residual" not in config:  # speculators reads false, vLLM true
            raise EagletError(f"{where}: norm_before_residual is not set, and speculators (false) and vLLM "
                              "(true) read it differently; set it to what the head was trained with")
        del flat["transformer_layer_config"]
        flat.update(layer)
    ids = flat.pop("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(type(k) is int for k in ids):
            raise EagletError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer numbers, "
                              f"got {ids!r}")
        eagle_config = flat.get("eagle_config") or {}
        nested = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
        if nested is not None and nested != [k - 1 for k in ids]:
            raise EagletError(f"{where}: eagle_aux_hidden_state_layer_ids {ids} (layer inputs) and "
                              f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (layer outputs) disagree")
        flat["eagle_config"] = {**eagle_config, "eagle_aux_hidden_state_layer_ids": [k - 1 for k in ids]}
    return flat


def head_args(config: dict) -> ModelArgs:
    args = ModelArgs.from_hf_config({"model_type": "llama", **config})
    args.qkv_bias = bool(config.get("qkv_bias", args.qkv_bias))
    return args


def head_kind(config: dict, keys, where: str) -> str:
    """'eagle' or 'eagle3', told apart by their keys (both configs look like a one-layer LLaMA), or 'dflash' (its
    config says so); or an error.
    config: flat (head_config)."""
    if is_dflash_config(config):
        architectures = [str(a) for a in config.get("architectures") or []]
        if architectures and architectures != ["DFlashDraftModel"]:
            raise EagletError(f"{where}: architectures {architectures}; eaglet runs DFlashDraftModel heads")
        return "dflash"
    nested = sorted(k for k in keys if k.startswith("model."))
    if nested and is_eagle3_config(config):
        raise EagletError(f"{where}: an EAGLE-3 head with its weights under model. ({nested[0]}, ...), a layout "
                          "eaglet does not read (EAGLE's and SpecForge's heads have midlayer.*, "
                          "speculators' layers.0.*)")
    if "fc.weight" not in keys or config.get("num_hidden_layers", 1) != 1:
        why = "no fc.weight" if "fc.weight" not in keys else \
            f"num_hidden_layers {config['num_hidden_layers']}; eaglet runs heads of one layer"
        raise EagletError(f"{where} is neither an EAGLE-1/2 nor an EAGLE-3 draft head eaglet runs ({why})")
    if "d2t" in keys or any(k.startswith(("midlayer.", "layer.hidden_norm", "layers.0.hidden_norm")) for k in keys):
        return "eagle3"
    return "eagle"


def is_eagle3_config(config: dict) -> bool:
    """Whether a (flat) config.json says it is an EAGLE-3 head's, whatever its weights."""
    architectures = config.get("architectures") or []
    return config.get("draft_vocab_size") is not None or "speculators_model_type" in config or \
        any("Eagle3" in str(a) for a in architectures)


def is_dflash_config(config: dict) -> bool:
    return "dflash_config" in config or any("DFlash" in str(a) for a in config.get("architectures") or [])


def read_draft_vocab(path, vocab_size: int) -> Tensor:
    """A draft vocabulary file written by scripts/draft_vocab.py: {"token_ids": [...]}, most frequent first."""
    path = Path(path)
    try:
        token_ids = json.loads(path.read_text())["token_ids"]
        token_ids = torch.tensor(token_ids, dtype=torch.long)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EagletError(f"cannot read the draft vocabulary {path}: {e}")
    if token_ids.ndim != 1 or len(token_ids) == 0 or token_ids.min() < 0 or token_ids.max() >= vocab_size \
            or token_ids.unique().numel() != len(token_ids):
        raise EagletError(f"{path}: token_ids must be distinct ids below the target's vocabulary ({vocab_size})")
    return token_ids
