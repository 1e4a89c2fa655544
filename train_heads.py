"""train_draft.py's heads at the start and in their files: a fresh EAGLE-1/2 or EAGLE-3 head and its config.json
(the LLaMA keys every head shares, EAGLE-3's draft vocabulary), what a train_state.pt must agree on to be
resumed, the checks on --out_dir, and the trained head written in its kind's published layout
(config.json + model.safetensors).

Imports load.py (check_writable), draft.py, block_draft.py, head_formats.py, model.py, quantize.py,
checkpoint.py and convert_common.py (export_layer); train_draft.py imports it.
"""
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from convert_common import export_layer
from block_draft import DFlash2Draft, DFlashDraft, DSparkDraft, XPressDraft
from draft import DraftHead, Eagle3Draft, EagleDraft, head_name
from head_formats import eagle3_feature_layers, head_args, is_dflash_config
from load import check_writable
from checkpoint import EagletError, mismatch_detail, read_config, torch_load
from model import ModelArgs, Transformer
from quantize import Int8Linear


def new_head(target_args: ModelArgs, device, seed: int) -> EagleDraft:
    torch.manual_seed(seed)
    head = EagleDraft(target_args, fc_bias=True).to(device)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    # Start near "the next feature is the current token's feature": the residual carries fc's output.
    with torch.no_grad():
        head.fc.weight[:, target_args.dim:] += torch.eye(target_args.dim, device=device)
        head.fc.bias.zero_()
    return head


def draft_vocabulary(examples: list, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` target tokens most frequent where the loss counts (ties: lower id first), as sorted ids."""
    tokens = torch.tensor([t for example, mask in examples for t, m in zip(example, mask) if m], dtype=torch.long)
    counts = torch.bincount(tokens, minlength=vocab_size)[:vocab_size]
    return counts.argsort(descending=True, stable=True)[:size].sort().values


def eagle3_config(args: ModelArgs, draft_vocab: int, feature_layers=None) -> dict:
    """The head's config.json: the target's shapes, one layer, its draft vocabulary; feature layers other
    than the default 2, L//2, L-3 named as the published heads name them (id k = the output of layer k)."""
    config = {**llama_head_config(args), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
    if feature_layers:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in feature_layers]}
    return config


def new_eagle3_head(target: Transformer, draft_ids: torch.Tensor, config: dict, seed: int) -> Eagle3Draft:
    """A fresh EAGLE-3 head: random layer; lm_head and norm start as the target's own (rows of the draft
    vocabulary), and fc passes the deepest feature through, so the head starts from the target's logit lens."""
    device, dim = target.output.weight.device, target.args.dim
    torch.manual_seed(seed)
    feature_layers = eagle3_feature_layers(config, target.args.n_layer, "the EAGLE-3 head")
    head = Eagle3Draft(head_args(config), dim, len(draft_ids), own_embedding=False,
                       n_features=len(feature_layers)).to(device)
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    head.feature_layers = feature_layers
    deepest = head.feature_layers.index(max(head.feature_layers))
    with torch.no_grad():
        lm_head = target.output  # an int8 lm_head (a quantized target) starts the head dequantized
        weight = lm_head.dequantize() if isinstance(lm_head, Int8Linear) else lm_head.weight
        head.lm_head.weight.copy_(weight[draft_ids.to(device)])
        head.norm.weight.copy_(target.norm.weight)
        head.fc.weight[:, deepest * dim:(deepest + 1) * dim] += torch.eye(dim, device=device)
    head.draft_to_target = draft_ids.to(device)
    return head


def target_shape(target: Transformer) -> dict:
    return {k: v for k, v in asdict(target.args).items() if k != "extra"}


def head_settings(head: DraftHead) -> dict:
    """What a train_state.pt must agree on besides the target: the head's kind, features and draft vocabulary."""
    if isinstance(head, EagleDraft):
        return {"head": "eagle"}
    if isinstance(head, DFlashDraft):
        return {"head": head_name(head).lower(), "feature_layers": list(head.feature_layers),
                "block_size": head.block_size, "mask_token_id": head.mask_token_id, "draft_layers": head.args.n_layer,
                **({"markov_rank": head.markov_head.markov_w1.weight.shape[1]} if isinstance(head, DSparkDraft) else {}),
                **({"selector_top_k": head.candidate_selector.top_k} if isinstance(head, DFlash2Draft) else {}),
                **({"xpress_rank": head.refiner_head.mix_l.shape[0]} if isinstance(head, XPressDraft) else {})}
    return {"head": "eagle3", "feature_layers": list(head.feature_layers),
            "draft_vocab": head.draft_to_target.tolist()}


def read_train_state(state_path: Path, target: Transformer, kind: str) -> dict:
    """A train_state.pt written while training a head of this kind for this target (checked before any long work:
    self-distillation)."""
    try:
        state = torch_load(state_path, mmap=False)  # training rewrites the file while the state is in use
    except EagletError as e:
        raise EagletError(f"cannot resume: {e} (--no_resume starts over)")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "head" not in state or \
            not isinstance(state.setdefault("kind", {"head": "eagle"}), dict):  # states before kinds: EAGLE's
        raise EagletError(f"cannot resume from {state_path}: not a train_state.pt this tool wrote "
                          "(--no_resume starts over)")
    theirs, ours = state.get("target", target_shape(target)), target_shape(target)
    differ = [f"{k} {theirs.get(k)} vs {v}" for k, v in ours.items() if theirs.get(k) != v]
    if differ:
        raise EagletError(f"{state_path} was written while training a head for another target ({', '.join(differ)}); "
                          "give another --out_dir, or --no_resume to start over")
    if state["kind"].get("head") != kind:
        raise EagletError(f"{state_path} was written while training another head (head {state['kind'].get('head')} "
                          f"vs {kind}); give another --out_dir, or --no_resume to start over")
    return state


def resume_from(state_path: Path, head: DraftHead, optimizer, target: Transformer) -> int:
    """Load a train_state.pt written for this target; returns the step it reached."""
    ours = head_settings(head)
    state = read_train_state(state_path, target, ours["head"])
    theirs = state["kind"]
    differ = [k if k == "draft_vocab" else f"{k} {theirs.get(k)} vs {v}" for k, v in ours.items() if theirs.get(k) != v]
    if differ:
        raise EagletError(f"{state_path} was written while training another head ({', '.join(differ)} differ); "
                          "give another --out_dir, or --no_resume to start over")
    try:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise EagletError(f"{state_path} does not fit this target's head: {mismatch_detail(e)}")
    return state["step"]


WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors", ".gguf")


def check_out_dir(out_dir: Path):
    """Refuse an out_dir that holds a checkpoint other than a head being trained there (with its
    train_state.pt): the head's config.json and model.safetensors would overwrite it."""
    if out_dir.exists() and not out_dir.is_dir():
        raise EagletError(f"--out_dir {out_dir} is a file, not a folder")
    if not out_dir.is_dir():
        return
    found = sorted(f.name for f in out_dir.iterdir() if f.name == "config.json" or f.suffix in WEIGHT_SUFFIXES)
    ours = (out_dir / "train_state.pt").is_file() and (not (out_dir / "config.json").is_file() or
                                                       read_config(out_dir).get("num_hidden_layers") == 1 or
                                                       is_dflash_config(read_config(out_dir)))
    if found and not ours:
        raise EagletError(f"--out_dir {out_dir} already holds a checkpoint ({', '.join(found[:4])}) that is not a "
                          "head being trained there; writing the head would overwrite it: choose another folder")


def prepare_out_dir(out_dir: Path):
    """Make out_dir and check that the head can be written there, before loading and self-distilling."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EagletError(f"--out_dir {out_dir} cannot be made: {e.strerror or e}")
    check_writable(out_dir / "train_state.pt", "--out_dir")


def llama_head_config(args: ModelArgs) -> dict:
    """The config.json both kinds of head share: a one-layer LLaMA of the target's shapes."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "num_attention_heads": args.n_head, "num_key_value_heads": args.n_local_heads,
            "head_dim": args.head_dim, "intermediate_size": args.intermediate_size, "num_hidden_layers": 1,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_base,
            "rope_scaling": args.rope_scaling, "max_position_embeddings": args.max_position_embeddings,
            "hidden_act": "silu", "torch_dtype": "float32",
            # the target's biases, which a new head copies (a Qwen2 target: q/k/v only, not o)
            "attention_bias": args.o_bias, "qkv_bias": args.qkv_bias, "mlp_bias": args.mlp_bias}


def save_head(head: DraftHead, config: dict, out_dir: Path, target: Optional[Transformer] = None):
    """config.json + model.safetensors under the published key names of the head's kind."""
    args, sd = head.args, {k: v.detach().float().cpu() for k, v in head.state_dict().items()}
    if isinstance(head, EagleDraft):
        weights = {"fc.weight": sd["fc.weight"], "fc.bias": sd["fc.bias"], **export_layer(sd, "layer.", "layers.0.", args)}
    elif isinstance(head, DFlashDraft):
        weights = {k: sd[k] for k in ("fc.weight", "hidden_norm.weight", "norm.weight")}
        for i in range(args.n_layer):
            weights.update(export_layer(sd, f"layers.{i}.", f"layers.{i}.", args))
        if isinstance(head, DSparkDraft):  # DeepSpec's files carry frozen copies of the target's tables too
            weights.update({k: v for k, v in sd.items() if k.startswith(("markov_head.", "confidence_head."))})
            weights.update({"embed_tokens.weight": target.tok_embeddings.weight.detach().float().cpu(),
                            "lm_head.weight": lm_head_table(target)})
        if isinstance(head, (DFlash2Draft, XPressDraft)):  # speculators' names are the modules' own
            weights.update({k: v for k, v in sd.items() if k.startswith(("candidate_selector.", "refiner_head."))
                            or "_conv." in k})
    else:
        draft_ids = head.draft_to_target.cpu()
        t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        weights = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
                   "midlayer.input_layernorm.weight": sd["layer.embed_norm.weight"],
                   "midlayer.hidden_norm.weight": sd["layer.hidden_norm.weight"],
                   **export_layer(sd, "layer.", "midlayer.", args),
                   "d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d}  # target id = draft id + d2t
    save_file({k: t.contiguous() for k, t in weights.items()}, str(out_dir / "model.safetensors"))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(out_dir / "model.safetensors", 0o666 & ~umask)  # safetensors writes 0600: others could not read it
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


@torch.no_grad()
def lm_head_table(target: Transformer) -> torch.Tensor:
    """The target's lm_head as a float [vocab, dim] table, whatever its format: its logits of the unit vectors."""
    eye = torch.eye(target.args.dim, device=target.tok_embeddings.weight.device,
                    dtype=target.tok_embeddings.weight.dtype)
    return torch.cat([target.logits(rows) for rows in eye.split(512)]).T.float().cpu().contiguous()
