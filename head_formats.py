"""Reading draft heads: the published layouts of EAGLE-1/2, EAGLE-3 (and P-EAGLE), DFlash, DSpark, DFlash2 and XPress
heads (their configs made flat, their flags, the target layers they read), the checks that refuse a head that does
not fit its target, and load_head, which builds draft.py's and block_draft.py's classes from a converted draft.pth.

Imports draft.py and block_draft.py (the heads), model.py and quantize.py (a quantized head's Linears); generate.py, train_draft.py
and convert_hf_checkpoint.py import it, the cycle never does.
"""
import json
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from checkpoint import EagletError, load_state_dict, mismatch_detail, read_config
from block_draft import DFlash2Draft, DFlashDraft, DSparkDraft, PEagleDraft, XPressDraft
from draft import DraftHead, Eagle3Draft, Eagle3Flags, EagleDraft
from model import ModelArgs
from quantize import pack_quantized, pop_quantization, use_quantized_linears


BLOCK_KINDS = ("dflash", "dspark", "dflash2", "xpress")  # speculators' block drafters, all read by block_settings
BLOCK_NAMES = {"dflash2": "DFlash2", "xpress": "XPress"}
SPECULATORS_KINDS = "eaglet reads speculators' eagle3, peagle, dflash, dspark, dflash2 and xpress heads"


def load_head(checkpoint_path, target: ModelArgs, device="cpu", dtype=torch.float32) -> DraftHead:
    """An EAGLE-1/2, EAGLE-3, DFlash or DSpark head converted by convert_hf_checkpoint.py (or quantized by quantize.py),
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
    draft_vocab = state_dict["lm_head.weight"].shape[0]
    ids = draft_to_target(state_dict.pop("d2t"), draft_vocab, target.vocab_size, where)
    feature_layers = eagle3_feature_layers(config, target.n_layer, where)
    with torch.device("meta"):
        if config.get("speculators_model_type") == "peagle":
            model = PEagleDraft(args, target_dim, draft_vocab, own_embedding, eagle3_flags(config, where),
                                len(feature_layers), *peagle_block(config, target, where), n_layers=args.n_layer)
        else:
            model = Eagle3Draft(args, target_dim, draft_vocab, own_embedding, eagle3_flags(config, where),
                                len(feature_layers), args.n_layer)
    assign_weights(model, state_dict, where)
    model.draft_to_target, model.feature_layers = ids, feature_layers
    return model


def peagle_block(config: dict, target: ModelArgs, where: str) -> tuple:
    """A P-EAGLE head's (block_size, mask_token_id): the drafts its proposal makes in one pass (speculators_config's
    speculative_tokens, the depth it was trained to) and the token its mask positions read."""
    settings = config.get("speculators_config") if isinstance(config.get("speculators_config"), dict) else {}
    methods = settings.get("proposal_methods") or [{}]
    default = next((m for m in methods if isinstance(m, dict) and m.get("proposal_type") == settings.get(
        "default_proposal_method")), methods[0])
    block = default.get("speculative_tokens") if isinstance(default, dict) else None
    if type(block) is not int or block < 1:
        raise EagletError(f"{where}: a P-EAGLE head needs speculators_config's proposal speculative_tokens (the drafts "
                          f"one pass makes), a positive integer; got {block!r}")
    mask = config.get("mask_token_id")
    if type(mask) is not int or not 0 <= mask < target.vocab_size:
        raise EagletError(f"{where}: a P-EAGLE head needs mask_token_id, a token of the target's {target.vocab_size}; "
                          f"got {mask!r}")
    return block, mask


def dflash_from_state_dict(config: dict, args: ModelArgs, state_dict: dict, target: ModelArgs,
                           where: str) -> DFlashDraft:
    """A DFlash or DSpark head in any layout block_settings reads, refused by name before any weight moves if it
    does not fit the target."""
    b = block_settings(config, args, target, where)
    if "sliding_attention" in (config.get("layer_types") or []) and config.get("use_sliding_window", True):
        kind = config.get("speculators_model_type")
        if kind and not config.get("sliding_window_non_causal", kind == "dflash2"):
            raise EagletError(f"{where}: sliding-window layers with sliding_window_non_causal false: speculators "
                              "runs their blocks causally, eaglet a block as a whole (not causal)")
        args.sliding_window = config.get("sliding_window")
    args.qk_norm = True  # DFlash layers are Qwen3's, whatever model_type says
    checks = {k.removeprefix("target_check."): state_dict.pop(k) for k in [k for k in state_dict
                                                                           if k.startswith("target_check.")]}
    d2t = state_dict.pop("d2t", None)
    with torch.device("meta"):
        common = dict(anchor_drafts=b["anchor_drafts"], draft_vocab_size=b["draft_vocab_size"])
        block = (args, len(b["feature_layers"]), b["block_size"], b["mask_token_id"])
        if b["kind"] == "dspark":
            model = DSparkDraft(*block, b["markov_rank"], confidence_head=b["confidence_head"],
                                confidence_with_markov=b["confidence_with_markov"], **common)
        elif b["kind"] == "dflash2":
            model = DFlash2Draft(*block, b["conv_kernel_size"], b["conv_group_size"], b["selector_rank"],
                                 b["selector_top_k"], anchor_drafts=b["anchor_drafts"])
        elif b["kind"] == "xpress":
            model = XPressDraft(*block, b["xpress_rank"], b["xpress_mlp_ratio"], b["num_jacobi_passes"], **common)
        else:
            model = DFlashDraft(*block, **common)
    assign_weights(model, state_dict, where)
    if b["draft_vocab_size"]:
        if d2t is None:
            raise EagletError(f"{where}: a draft vocabulary of {b['draft_vocab_size']} tokens and no d2t")
        model.draft_to_target = draft_to_target(d2t, b["draft_vocab_size"], target.vocab_size, where)
    model.feature_layers = b["feature_layers"]
    model.target_check = checks  # the head's copies of the target's embedding and lm_head, as probes
    return model


def block_settings(config: dict, args: ModelArgs, target: ModelArgs, where: str) -> dict:
    """A block drafter's settings from its layout, each told by its own markers, never guessed: speculators'
    (speculators_model_type dflash, dspark, dflash2 or xpress; head_config has put transformer_layer_config at the
    top), DeepSpec's
    DSpark (architectures Qwen3DSparkModel, its settings at the top level) or z-lab's DFlash (dflash_config).
    feature_layers are layer INPUTS as eaglet taps them: z-lab's and DeepSpec's target_layer_ids name layer
    outputs (hidden_states[id + 1]), speculators' aux_hidden_state_layer_ids layer inputs."""
    kind, architectures = config.get("speculators_model_type"), [str(a) for a in config.get("architectures") or []]
    top = config
    if kind is not None:
        if kind not in BLOCK_KINDS:
            raise EagletError(f"{where}: speculators_model_type {kind!r}; {SPECULATORS_KINDS}")
        if type(config.get("sample_from_anchor")) is not bool:
            raise EagletError(f"{where}: a speculators {kind} head without sample_from_anchor (true or false): whether "
                              "the anchor's row drafts too, which engines have read both ways (a head read the wrong "
                              "way drafts nothing right); set it to what the head was trained with")
        anchor, ids, dspark = config["sample_from_anchor"], config.get("aux_hidden_state_layer_ids"), kind == "dspark"
        lowest, name = 0, "aux_hidden_state_layer_ids"
    elif architectures == ["Qwen3DSparkModel"]:
        anchor, ids, dspark, lowest, name = True, config.get("target_layer_ids"), True, -1, "target_layer_ids"
    elif architectures in ([], ["DFlashDraftModel"]) and "dflash_config" in config:
        top = config.get("dflash_config") or {}
        if not isinstance(top, dict):
            raise EagletError(f"{where}: dflash_config must be a JSON object, got {top!r}")
        anchor, dspark, lowest, name = False, False, -1, "target_layer_ids"
        ids = top.get("target_layer_ids") or dflash_layer_ids(target.n_layer, args.n_layer)
    else:
        raise EagletError(f"{where}: architectures {architectures}; eaglet runs DFlashDraftModel (z-lab), "
                          "Qwen3DSparkModel (DeepSpec) and speculators' dflash and dspark heads")
    differ = [f"{what} {mine} vs {theirs}" for what, mine, theirs in
              [("hidden size", config.get("target_hidden_size") or args.dim, target.dim), ("hidden size", args.dim, target.dim),
               ("vocabulary", args.vocab_size, target.vocab_size),
               ("target layers", config.get("num_target_layers", target.n_layer), target.n_layer)] if mine != theirs]
    if differ:
        raise EagletError(f"{BLOCK_NAMES.get(kind, 'DSpark' if dspark else 'DFlash')} head {where} does not match "
                          "the target (head vs "
                          f"target): {', '.join(dict.fromkeys(differ))}")
    block_size, mask_id = top.get("block_size", config.get("block_size")), top.get("mask_token_id")
    if type(block_size) is not int or block_size < 2:
        raise EagletError(f"{where}: block_size must be a whole number of at least 2, got {block_size!r}")
    if type(mask_id) is not int or not 0 <= mask_id < target.vocab_size:
        raise EagletError(f"{where}: mask_token_id must be a token id below the target's vocabulary "
                          f"({target.vocab_size}), got {mask_id!r}")
    last = target.n_layer if lowest == 0 else target.n_layer - 2
    if not isinstance(ids, list) or not ids or not all(type(k) is int and lowest <= k <= last for k in ids):
        raise EagletError(f"{where}: {name} {ids!r} must name layers {lowest}..{last} of the {target.n_layer}-layer "
                          "target" + ("" if lowest == 0 else " (its last layer's output, after the final norm in "
                                      "transformers' numbering, is not a feature eaglet taps)"))
    draft_vocab = config.get("draft_vocab_size", target.vocab_size) if kind is not None else target.vocab_size
    if type(draft_vocab) is not int or not 1 <= draft_vocab <= target.vocab_size:
        raise EagletError(f"{where}: draft_vocab_size must be a whole number from 1 to the target's vocabulary "
                          f"({target.vocab_size}), got {draft_vocab!r}")
    settings = {"kind": "dspark" if dspark else kind or "dflash", "dspark": dspark, "anchor_drafts": anchor,
                "block_size": block_size, "mask_token_id": mask_id,
                "feature_layers": tuple(k if lowest == 0 else k + 1 for k in ids),
                "draft_vocab_size": draft_vocab if draft_vocab < target.vocab_size else 0}
    if kind == "dflash2":
        return settings | dflash2_settings(config, args, block_size, draft_vocab, where)
    if kind == "xpress":
        return settings | whole_numbers(config, where, xpress_rank=(256, 1), xpress_mlp_ratio=(2, 1),
                                        num_jacobi_passes=(6, 0))
    return settings | (markov_settings(config, where) if dspark else {})


def whole_numbers(config: dict, where: str, **defaults) -> dict:
    """Settings that are whole numbers: name=(speculators' default, the least allowed), checked."""
    values = {name: config.get(name, default) for name, (default, _) in defaults.items()}
    for name, value in values.items():
        if type(value) is not int or value < defaults[name][1]:
            raise EagletError(f"{where}: {name} must be a whole number of at least {defaults[name][1]}, got {value!r}")
    return values


def dflash2_settings(config: dict, args: ModelArgs, block_size: int, draft_vocab: int, where: str) -> dict:
    """A DFlash2 head's convolution and selector, refused where speculators refuses them."""
    values = whole_numbers(config, where, conv_kernel_size=(2, 1), conv_group_size=(16, 1), selector_rank=(256, 1),
                           selector_top_k=(16, 1))
    if draft_vocab != args.vocab_size:
        raise EagletError(f"{where}: a DFlash2 head with a draft vocabulary of {draft_vocab} tokens; DFlash2's "
                          f"candidate selector reads the target's whole vocabulary ({args.vocab_size}), and "
                          "speculators refuses a smaller one too")
    if args.dim % values["conv_group_size"] or values["conv_kernel_size"] > block_size \
            or values["selector_top_k"] > args.vocab_size:
        raise EagletError(f"{where}: conv_group_size {values['conv_group_size']} must divide the hidden size "
                          f"({args.dim}), conv_kernel_size {values['conv_kernel_size']} be at most block_size "
                          f"({block_size}) and selector_top_k {values['selector_top_k']} at most the vocabulary")
    return values


def markov_settings(config: dict, where: str) -> dict:
    head_type, rank = config.get("markov_head_type", "vanilla"), config.get("markov_rank", 256)
    if head_type != "vanilla":
        raise EagletError(f"{where}: markov_head_type {head_type!r}; eaglet runs DSpark's vanilla Markov head "
                          "(the published heads' own)")
    if type(rank) is not int or rank < 1:
        raise EagletError(f"{where}: markov_rank must be a whole number of at least 1, got {rank!r} (a DSpark head "
                          "without its Markov head is a DFlash head)")
    flags = {name: config.get(name, True) for name in ("enable_confidence_head", "confidence_head_with_markov")}
    for name, value in flags.items():
        if type(value) is not bool:
            raise EagletError(f"{where}: {name} must be true or false, got {value!r}")
    return {"markov_rank": rank, "confidence_head": flags["enable_confidence_head"],
            "confidence_with_markov": flags["confidence_head_with_markov"]}


def draft_to_target(d2t: Tensor, draft_vocab: int, vocab_size: int, where: str) -> Tensor:
    """EAGLE-3's and speculators' d2t (offsets: target id = draft id + d2t[draft id]) as target ids, checked."""
    d2t = d2t.long()
    if d2t.shape != (draft_vocab,):
        raise EagletError(f"{where}: d2t has {tuple(d2t.shape)} entries but lm_head has {draft_vocab} rows")
    ids = torch.arange(draft_vocab) + d2t
    if ids.min() < 0 or ids.max() >= vocab_size or ids.unique().numel() != draft_vocab:
        raise EagletError(f"{where}: d2t maps the draft vocabulary outside the target's {vocab_size} "
                          "tokens, or maps two draft tokens to one")
    return ids


def probe_vectors(dim: int) -> Tensor:
    return torch.randn(dim, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def probe(weight: Tensor) -> Tensor:
    """A [vocab, dim] table times a fixed random [dim, 4]: what the converter keeps of a head's copy of the
    target's embedding or lm_head, and what check_target_copies compares with the target's own."""
    return (weight.double() @ probe_vectors(weight.shape[1]).to(weight.device)).float()


def check_target_copies(head: DraftHead, target) -> None:
    """A head that shipped copies of its target's embedding and lm_head (DeepSpec's DSpark files) runs only on that
    target: each copy's probe must match the target's (correlation 0.99 and up in every column: equal tables, up to
    a quantized target's rounding), else the head is refused by name."""
    checks = getattr(head, "target_check", None) or {}
    weight = target.tok_embeddings.weight
    vectors = probe_vectors(target.args.dim)
    theirs = {"embed": lambda: probe(weight),  # the lm_head in any format: its logits of the probe vectors
              "lm_head": lambda: target.logits(vectors.T.to(weight.device, weight.dtype)).T.float()}
    for name, mine in checks.items():
        other = theirs[name]().double().cpu()
        mine = mine.double().cpu()
        if mine.shape != other.shape:
            raise EagletError(f"the head's copy of the target's {name} has {mine.shape[0]} rows, the target "
                              f"{other.shape[0]}")
        corr = torch.nn.functional.cosine_similarity(mine - mine.mean(0), other - other.mean(0), dim=0)
        if not bool((corr >= 0.99).all()):
            raise EagletError(f"the head's copy of the target's {name} is not this target's (probe correlation "
                              f"{float(corr.min()):.3f}): the head was trained for another model")


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
    if not all(0 <= i <= n_layer for i in layers):
        raise EagletError(f"{where} reads the target's layers {list(layers)}, which a {n_layer}-layer target "
                          "does not all have")
    if not ids and not layers[0] < layers[1] < layers[2]:  # a shallow target: the defaults repeat or go back
        raise EagletError(f"{where}: on a {n_layer}-layer target the default EAGLE-3 feature layers 2, L//2, "
                          f"L-3 are {list(layers)}, not three distinct layers in order; name the ones the head "
                          "was trained on in its config.json (eagle_config.eagle_aux_hidden_state_layer_ids, "
                          "id k = the output of layer k; train_draft.py: --feature_layers)")
    return layers


def feature_layer_ids(config: dict, where: str):
    """eagle_config.eagle_aux_hidden_state_layer_ids checked: None (not set) or a list of ints (EAGLE's heads read
    three layers; speculators' may read more, its fc as wide as they are)."""
    eagle_config = config.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise EagletError(f"{where}: eagle_config must be a JSON object, got {eagle_config!r}")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(type(k) is int for k in ids):
        raise EagletError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer numbers, got {ids!r}")
    if not ids:
        raise EagletError(f"{where}: eagle_aux_hidden_state_layer_ids names no target layers")
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
    if kind in BLOCK_KINDS:
        return block_layer_config(config, where)
    if kind is None and "eagle_aux_hidden_state_layer_ids" not in config:
        return config
    flat = dict(config)
    if kind is not None:
        if kind not in ("eagle3", "peagle"):
            raise EagletError(f"{where}: speculators_model_type {kind!r}; {SPECULATORS_KINDS}")
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


# The defaults of the config class speculators rebuilds transformer_layer_config with (transformers' Qwen3Config or
# LlamaConfig, as its model_type says) for any key the file leaves out. Either way speculators builds the same
# Qwen3-style layers (q and k norms, attention_bias on q, k, v and o, no MLP bias); only these defaults differ.
# LlamaConfig's head_dim and num_key_value_heads follow from its heads, as ModelArgs' own do.
QWEN3_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6,
                  "rope_theta": 10000.0, "max_position_embeddings": 32768, "attention_bias": False}
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "max_position_embeddings": 2048, "attention_bias": False}
LAYER_DEFAULTS = {"qwen3": QWEN3_DEFAULTS, "llama": LLAMA_DEFAULTS}


def block_layer_config(config: dict, where: str) -> dict:
    """A speculators block drafter's config flat: its layers' settings (transformer_layer_config, its config class's
    defaults where it is silent) at the top, beside speculators' own keys."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise EagletError(f"{where}: a speculators config needs transformer_layer_config, a JSON object")
    arch = layer.get("model_type", "qwen3")
    if arch not in LAYER_DEFAULTS:
        raise EagletError(f"{where}: transformer_layer_config model_type {arch!r}: eaglet runs speculators' "
                          "DFlash-family layers of model_type qwen3 and llama")
    defaults = {k: v for k, v in LAYER_DEFAULTS[arch].items() if k != "rope_theta" or "rope_parameters" not in layer}
    if arch == "llama":  # LlamaConfig keeps sliding_window whatever use_sliding_window says (Qwen3Config drops it)
        layer = layer | {"use_sliding_window": layer.get("sliding_window") is not None}
    flat = {k: v for k, v in config.items() if k != "transformer_layer_config"}
    return flat | defaults | layer | {"model_type": "qwen3"}


def head_args(config: dict) -> ModelArgs:
    args = ModelArgs.from_hf_config({"model_type": "llama", **config})
    args.qkv_bias = bool(config.get("qkv_bias", args.qkv_bias))
    return args


def head_kind(config: dict, keys, where: str) -> str:
    """'eagle' or 'eagle3', told apart by their keys (both configs look like a one-layer LLaMA), or 'dflash' (its
    config says so); or an error.
    config: flat (head_config)."""
    if is_dflash_config(config):
        return "dflash"  # DFlash or DSpark, in one of the layouts block_settings reads
    nested = sorted(k for k in keys if k.startswith("model."))
    if nested and is_eagle3_config(config):
        raise EagletError(f"{where}: an EAGLE-3 head with its weights under model. ({nested[0]}, ...), a layout "
                          "eaglet does not read (EAGLE's and SpecForge's heads have midlayer.*, "
                          "speculators' layers.0.*)")
    stacked = config.get("speculators_model_type") in ("eagle3", "peagle")  # its first layer, then decoder layers
    if "fc.weight" not in keys or (config.get("num_hidden_layers", 1) != 1 and not stacked):
        why = "no fc.weight" if "fc.weight" not in keys else \
            f"num_hidden_layers {config['num_hidden_layers']}; eaglet runs heads of one layer (but speculators' " \
            "EAGLE-3 heads of several)"
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
    """Whether a (flat) config.json is a block drafter's: DFlash or DSpark, in any layout."""
    return "dflash_config" in config or config.get("speculators_model_type") in BLOCK_KINDS or \
        any("DFlash" in str(a) or "DSpark" in str(a) for a in config.get("architectures") or [])


def default_draft_vocab(vocab_size: int, keep_ids, size: int) -> Tensor:
    """The size lowest token ids, with keep_ids (the EOS tokens) in place of the highest of them where they lie above.
    A byte-level BPE tokenizer (LLaMA-3, Qwen, Mistral's Tekken, SmolLM2) numbers its tokens in the order it
    merged them, most frequent pair first, so low ids are, roughly, frequent tokens: the draft vocabulary
    needs no counted text (FR-Spec counts a corpus; scripts/draft_vocab.py does, and its file wins)."""
    extra = sorted({int(t) for t in keep_ids if size <= t < vocab_size})
    return torch.cat([torch.arange(min(size, vocab_size) - len(extra)), torch.tensor(extra, dtype=torch.long)])


def read_draft_vocab(path, vocab_size: int) -> Tensor:
    """A draft vocabulary file written by scripts/draft_vocab.py: {"token_ids": [...]}, most frequent first."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EagletError(f"cannot read the draft vocabulary {path}: {e}")
    token_ids = data.get("token_ids") if isinstance(data, dict) else None
    if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):  # not 1.5 or true as ids
        raise EagletError(f'{path}: a draft vocabulary is {{"token_ids": [whole numbers, ...]}} (scripts/draft_vocab.py '
                          "writes one)")
    token_ids = torch.tensor(token_ids, dtype=torch.long)
    if token_ids.ndim != 1 or len(token_ids) == 0 or token_ids.min() < 0 or token_ids.max() >= vocab_size \
            or token_ids.unique().numel() != len(token_ids):
        raise EagletError(f"{path}: token_ids must be distinct ids below the target's vocabulary ({vocab_size})")
    return token_ids
