"""Published EAGLE-3 head layouts, each written to disk as its trainer publishes it, converted and loaded, and
run against a reference written here from that format's own description (not from eaglet's code):

- EAGLE (SafeAILab/EAGLE): flat LlamaForCausalLMEagle3 config, midlayer.* keys; the target's hidden states
  entering layers 2, L//2, L-3 (eagle/model/modeling_llama_kv.py collects them before those layers run).
- SpecForge (sgl-project/SpecForge): the same keys plus its embed_tokens copy; eagle_config.
  eagle_aux_hidden_state_layer_ids name layer OUTPUTS (SGLang's set_eagle3_layers_to_capture adds 1; SpecForge's
  own default [1, L//2 - 1, L - 4] is EAGLE's 2, L//2, L-3); EAGLE-3.1's fc_norm and norm_output, top level.
- speculators (vllm-project/speculators): config Eagle3Speculator, speculators_model_type eagle3, the layer's
  shape in transformer_layer_config (llama or qwen3), layers.0.* keys, norm_before_residual, norm_before_fc,
  fc_norm, norm_output; top-level eagle_aux_hidden_state_layer_ids name layer INPUTS (vLLM appends the hidden
  state entering layer k; its DFlash config maps output ids to these with + 1).

The flags, as their sources define them: norm_before_residual: the residual around the attention is
hidden_norm(x), not x. fc_norm: each of the three features RMS-normed on its own (fc_norm.i) before fc.
norm_before_fc: the three normed as one vector (input_norm). norm_output: the layer's output goes through the
final norm, is scored as is and fed to the next step (EAGLE-3.1); without it the scores read norm(h) and the
next step reads h. Then what is refused, each by the name of what it is."""
import json
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from decode import TreeConfig, generate
from sampling import SamplingConfig
from conftest import expect_error, head_config, random_head_weights, write_eagle_head, write_tokenizer
from convert_hf_checkpoint import convert, main as convert_main
from draft import Eagle3Draft
from head_formats import eagle3_feature_layers, head_config as flat_head_config
from load import load_draft, load_target
from attention import causal_mask
from model import EagletError

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 96, 96, 40
L = 8  # the llama8 target's layers
FLAGS = ("norm_before_residual", "fc_norm", "norm_before_fc", "norm_output")


@dataclass
class Case:
    layout: str  # "eagle", "specforge" or "speculators"
    ids: list = None  # the aux layer ids the config names (None: not set)
    flags: dict = field(default_factory=dict)
    layer_type: str = "llama"  # speculators' transformer_layer_config model_type
    feature_layers: tuple = ()  # what eaglet must read: the inputs of these target layers


CASES = {
    "eagle": Case("eagle", feature_layers=(2, 4, 5)),
    "specforge": Case("specforge", ids=[1, 3, 6], feature_layers=(2, 4, 7)),
    "specforge-eagle3.1": Case("specforge", ids=[0, 2, 5], flags={"fc_norm": True, "norm_output": True},
                               feature_layers=(1, 3, 6)),
    "speculators": Case("speculators", ids=[1, 4, 6], flags={"norm_before_residual": True}, feature_layers=(1, 4, 6)),
    "speculators-defaults": Case("speculators", flags={"norm_before_residual": False}, feature_layers=(2, 4, 5)),
    "speculators-eagle3.1": Case("speculators", ids=[2, 3, 7],
                                 flags={"norm_before_residual": False, "fc_norm": True, "norm_output": True},
                                 feature_layers=(2, 3, 7)),
    "speculators-norm_before_fc": Case("speculators", ids=[1, 4, 6],
                                       flags={"norm_before_residual": True, "norm_before_fc": True},
                                       feature_layers=(1, 4, 6)),
    "speculators-qwen3": Case("speculators", ids=[1, 4, 6], flags={"norm_before_residual": True},
                              layer_type="qwen3", feature_layers=(1, 4, 6)),
    # speculators names as many target layers as the head was trained on (its fc as wide as they are)
    "speculators-five-layers": Case("speculators", ids=[0, 2, 3, 5, 7], flags={"norm_before_residual": True,
                                                                         "fc_norm": True}, feature_layers=(0, 2, 3, 5, 7)),
    # an embedding trained with the head (not the target's): the head keeps its own
    "speculators-trained-embedding": Case("speculators", ids=[1, 4, 6],
                                          flags={"norm_before_residual": True, "embed_requires_grad": True},
                                          feature_layers=(1, 4, 6)),
}


def head_weights(case: Case, embed: torch.Tensor, seed=0) -> dict:
    """Random weights under the format's own key names; norms away from 1 so that a misplaced one shows."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=0.15):
        return torch.randn(*shape, generator=g) * s

    def norm(n):
        return 1 + 0.4 * torch.randn(n, generator=g)
    p = "layers.0." if case.layout == "speculators" else "midlayer."
    target_ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    n = len(case.ids or (0, 0, 0))  # the target layers it reads
    w = {"fc.weight": rnd(HIDDEN, n * HIDDEN, s=0.08), f"{p}input_layernorm.weight": norm(HIDDEN),
         f"{p}hidden_norm.weight": norm(HIDDEN), f"{p}post_attention_layernorm.weight": norm(HIDDEN),
         f"{p}self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, 2 * HIDDEN),
         f"{p}self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
         f"{p}self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
         f"{p}self_attn.o_proj.weight": rnd(HIDDEN, HEADS * HEAD_DIM),
         f"{p}mlp.gate_proj.weight": rnd(INTER, HIDDEN), f"{p}mlp.up_proj.weight": rnd(INTER, HIDDEN),
         f"{p}mlp.down_proj.weight": rnd(HIDDEN, INTER), "norm.weight": norm(HIDDEN),
         "lm_head.weight": rnd(DRAFT_VOCAB, HIDDEN, s=1.0), "d2t": target_ids - torch.arange(DRAFT_VOCAB)}
    w["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    w["t2d"][target_ids] = True
    if case.layer_type == "qwen3":
        w.update({f"{p}self_attn.q_norm.weight": norm(HEAD_DIM), f"{p}self_attn.k_norm.weight": norm(HEAD_DIM)})
    if case.flags.get("fc_norm"):
        w.update({f"fc_norm.{i}.weight": norm(HIDDEN) for i in range(n)})
    if case.flags.get("norm_before_fc"):
        w["input_norm.weight"] = norm(n * HIDDEN)
    if case.layout != "eagle":  # SpecForge and speculators save their (frozen) copy of the target's embedding
        w["embed_tokens.weight"] = embed + rnd(*embed.shape, s=0.5) * case.flags.get("embed_requires_grad", False)
    return w


def layer_shape(**extra) -> dict:
    return {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "intermediate_size": INTER, "num_hidden_layers": 1, "vocab_size": VOCAB, "hidden_act": "silu",
            "max_position_embeddings": 2048, "tie_word_embeddings": False, **extra}


def head_config_json(case: Case) -> dict:
    """config.json as each trainer writes it (the keys that matter, and some that do not)."""
    if case.layout == "speculators":
        layer = layer_shape(model_type=case.layer_type, rms_norm_eps=1e-6, rope_theta=500000.0,
                            attention_bias=False, torch_dtype="float32")
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "speculators_version": "0.3.0", "transformer_layer_config": layer, "draft_vocab_size": DRAFT_VOCAB,
                "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": case.ids,
                "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
                "speculators_config": {
                    "algorithm": "eagle3", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                    "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}},
                "torch_dtype": "float32", "transformers_version": "4.56.0", **case.flags}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layer_shape(),
              "rms_norm_eps": 1e-5, "draft_vocab_size": DRAFT_VOCAB, "torch_dtype": "float32", **case.flags}
    if case.layout == "specforge":
        config.update({"rope_theta": 1000000.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    if case.ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": case.ids}
    return config


def aux_indices(case: Case, config: dict, n_layer: int) -> list:
    """Which of transformers' hidden_states (index i: the state entering layer i) the format's head reads."""
    default = [2, n_layer // 2, n_layer - 3]
    if case.layout == "speculators":  # ids: layer inputs
        ids = config["eagle_aux_hidden_state_layer_ids"]
        return list(ids) if ids else default
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [k + 1 for k in ids] if ids else default  # ids: layer outputs


def other_convention(case: Case, config: dict, n_layer: int) -> list:
    """The other reading of the same ids: a head run under it reads the wrong layers."""
    shift = 1 if case.layout == "speculators" else -1
    return [i + shift for i in aux_indices(case, config, n_layer)]


def rms(t, weight, eps):
    return weight * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)


def reference(w: dict, config: dict, case: Case, embeds, x, positions, flags=None):
    """The format's step over a causal block, from its weights and config: x is fc(features) or the previous
    step's output; returns (what the next step reads, draft-vocabulary logits)."""
    flags = {name: bool(config.get(name, False)) for name in FLAGS} if flags is None else flags
    shape = config["transformer_layer_config"] if case.layout == "speculators" else config
    eps, theta = shape["rms_norm_eps"], shape.get("rope_theta", 10000.0)
    p = "layers.0." if case.layout == "speculators" else "midlayer."
    n, half = len(positions), HEAD_DIM // 2

    def rope(t):  # [heads, T, HEAD_DIM], the rotated halves are the two halves of head_dim
        inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = (positions[:, None].double() * inv_freq[None]).float()
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    def heads(t, count, norm=None):
        t = t.view(n, count, HEAD_DIM)
        if norm is not None:  # Qwen3's per-head q/k norms, before RoPE
            t = rms(t, w[f"{p}self_attn.{norm}.weight"], eps)
        return t.transpose(0, 1)
    qk_norm = shape.get("model_type") == "qwen3"
    hidden = rms(x, w[f"{p}hidden_norm.weight"], eps)
    attn_in = torch.cat([rms(embeds, w[f"{p}input_layernorm.weight"], eps), hidden], -1)
    q = rope(heads(attn_in @ w[f"{p}self_attn.q_proj.weight"].T, HEADS, "q_norm" if qk_norm else None))
    k = rope(heads(attn_in @ w[f"{p}self_attn.k_proj.weight"].T, KV_HEADS, "k_norm" if qk_norm else None))
    v = heads(attn_in @ w[f"{p}self_attn.v_proj.weight"].T, KV_HEADS)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = q @ k.transpose(1, 2) / HEAD_DIM ** 0.5 + torch.full((n, n), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, HEADS * HEAD_DIM) @ w[f"{p}self_attn.o_proj.weight"].T
    h = (hidden if flags["norm_before_residual"] else x) + attn
    post = rms(h, w[f"{p}post_attention_layernorm.weight"], eps)
    h = h + (F.silu(post @ w[f"{p}mlp.gate_proj.weight"].T) * (post @ w[f"{p}mlp.up_proj.weight"].T)) @ \
        w[f"{p}mlp.down_proj.weight"].T
    normed = rms(h, w["norm.weight"], eps)
    return (normed if flags["norm_output"] else h), normed @ w["lm_head.weight"].T


def reference_fuse(w: dict, config: dict, case: Case, features, flags=None):
    """fc over the n features [T, n x HIDDEN], after the norms the flags name."""
    flags = {name: bool(config.get(name, False)) for name in FLAGS} if flags is None else flags
    eps = (config["transformer_layer_config"] if case.layout == "speculators" else config)["rms_norm_eps"]
    if flags["norm_before_fc"]:
        features = rms(features, w["input_norm.weight"], eps)
    if flags["fc_norm"]:
        n = features.shape[-1] // HIDDEN
        features = torch.cat([rms(f, w[f"fc_norm.{i}.weight"], eps) for i, f in enumerate(features.chunk(n, -1))], -1)
    return features @ w["fc.weight"].T


def write_head(path, case: Case, embed) -> tuple:
    weights, config = head_weights(case, embed), head_config_json(case)
    write_eagle_head(path, weights, config, safetensors=True)
    return weights, config


@pytest.mark.parametrize("name", list(CASES))
def test_head_matches_its_format(checkpoints, tmp_path, name):
    """Converted and loaded, each layout reads the target layers its own convention names and computes what its
    description says, over a catch-up block and over a step fed its own outputs (a tree level)."""
    case = CASES[name]
    target_dir, hf = checkpoints("llama8")
    embed = hf.model.embed_tokens.weight.detach()
    weights, config = write_head(tmp_path / "head", case, embed)
    convert(tmp_path / "head", log=lambda *_: None)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
    draft = load_draft(tmp_path / "head" / "draft.pth", model)
    assert isinstance(draft, Eagle3Draft) and draft.feature_layers == case.feature_layers == model.feature_layers
    assert (draft.embed is not None) == case.flags.get("embed_requires_grad", False)  # else the target's is shared
    assert list(case.feature_layers) == aux_indices(case, config, L)
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    pos, mask = torch.arange(12), causal_mask(torch.arange(12), 64)
    with torch.no_grad():
        _, features = model(tokens[None], pos, pos, mask)
        states = hf(tokens[None], output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in aux_indices(case, config, L)], -1)
        embeds = weights.get("embed_tokens.weight", embed)[tokens]
        ref_out, ref_logits = reference(weights, config, case, embeds, reference_fuse(weights, config, case, aux), pos)
        out = draft.step(model, tokens, features[0], pos, pos, mask)
        torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(draft.logits(model, out), ref_logits, atol=1e-4, rtol=1e-4)
        again = draft.step(model, tokens, out, pos, pos, mask)  # a tree level: the head's own outputs, no fc
        ref_again, ref_logits2 = reference(weights, config, case, embeds, ref_out, pos)
        torch.testing.assert_close(again, ref_again, atol=1e-4, rtol=1e-4)
        _, ids = draft.topk(model, again, 5)
        assert torch.equal(ids, ref_logits2.topk(5).indices + weights["d2t"][ref_logits2.topk(5).indices])

        # teeth: the other aux-id convention, and each flag flipped, would give other outputs
        wrong = torch.cat([states[i][0] for i in other_convention(case, config, L)], -1)
        wrong_out, _ = reference(weights, config, case, embeds, reference_fuse(weights, config, case, wrong), pos)
        assert (wrong_out - out).abs().max() > 1e-2
        for flag in FLAGS:
            needs = {"fc_norm": "fc_norm.0.weight", "norm_before_fc": "input_norm.weight"}.get(flag)
            if needs is not None and needs not in weights:
                continue  # a norm the head has no weights for
            flipped = {f: bool(config.get(f, False)) != (f == flag) for f in FLAGS}
            fused = reference_fuse(weights, config, case, aux, flipped)
            flipped_out, _ = reference(weights, config, case, embeds, fused, pos, flipped)
            flipped_again, _ = reference(weights, config, case, embeds, flipped_out, pos, flipped)
            assert (flipped_again - again).abs().max() > 1e-2, flag


def test_speculators_head_decodes_like_the_target(checkpoints, tmp_path):
    """An EAGLE-3.1 speculators head (its normed outputs fed back down the tree) in the speculative cycle:
    greedy output equals plain decoding."""
    target_dir, hf = checkpoints("llama8")
    write_head(tmp_path / "head", CASES["speculators-eagle3.1"], hf.model.embed_tokens.weight.detach())
    convert(tmp_path / "head", log=lambda *_: None)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(tmp_path / "head" / "draft.pth", model)
    tree = TreeConfig(depth=4, topk=3, total_tokens=12)
    for prompt in ([1, 5, 9], [1, 7, 8, 30, 31]):
        plain = generate(model, prompt, 24, SamplingConfig())
        assert generate(model, prompt, 24, SamplingConfig(), draft=draft, tree=tree).tokens == plain.tokens


def edit(case_name, config_edit=None, weights_edit=None):
    """A maker of this case's (weights, config), the config and weights changed as given."""
    def make(embed):
        case = CASES[case_name]
        weights, config = head_weights(case, embed), head_config_json(case)
        if config_edit:
            config_edit(config)
        if weights_edit:
            weights_edit(weights)
        return weights, config
    return make


def under_model(weights):
    for k in list(weights):
        weights["model." + k] = weights.pop(k)


REFUSED = {  # id: (the head folder, what the one line of convert_hf_checkpoint.py must say)
    "SpecForge head with two layers": (edit("specforge", lambda c: c.update(num_hidden_layers=2)),
                                       "num_hidden_layers 2; eaglet runs heads of one layer"),
    "fc_norm and norm_before_fc": (edit("speculators-eagle3.1", lambda c: c.update(norm_before_fc=True)),
                                   "fc_norm and norm_before_fc are both set"),
    "norm_output not a boolean": (edit("specforge", lambda c: c.update(norm_output="yes")),
                                  "norm_output must be true or false, got 'yes'"),
    "speculators without norm_before_residual": (edit("speculators", lambda c: c.pop("norm_before_residual")),
                                                 "norm_before_residual is not set"),
    "speculators head of another algorithm": (edit("speculators", lambda c: c.update(speculators_model_type="mtp")),
                                              "speculators_model_type 'mtp'; eaglet reads speculators' eagle3, peagle, "
                                              "dflash, dspark, dflash2 and xpress heads"),
    "speculators layer of another model_type": (
        edit("speculators", lambda c: c["transformer_layer_config"].update(model_type="mistral")),
        "transformer_layer_config model_type 'mistral'"),
    "no feature layers": (edit("speculators", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[])),
                          "eagle_aux_hidden_state_layer_ids names no target layers"),
    "feature layers not numbers": (edit("specforge", lambda c: c.update(eagle_config={
        "eagle_aux_hidden_state_layer_ids": ["1", 2, 3]})), "must be a list of layer numbers"),
    "top-level and eagle_config ids disagree": (
        edit("speculators", lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 6]})),
        "eagle_aux_hidden_state_layer_ids [1, 4, 6] (layer inputs) and eagle_config"),
    "use_aux_hidden_state false": (edit("specforge", lambda c: c["eagle_config"].update(use_aux_hidden_state=False)),
                                   "use_aux_hidden_state is not true"),
    "weights under model.": (edit("specforge", weights_edit=under_model), "its weights under model. (model.d2t"),
    "fc_norm set, its weights missing": (
        edit("speculators-eagle3.1", weights_edit=lambda w: [w.pop(f"fc_norm.{i}.weight") for i in range(3)]),
        "weight fc_norm.0.weight is missing"),
    "fc_norm weights, fc_norm unset": (edit("speculators-eagle3.1", lambda c: c.update(fc_norm=False)),
                                       "unexpected weights fc_norm.0.weight"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_head_is_refused_by_name_and_nothing_written(tmp_path, case):
    make, match = REFUSED[case]
    weights, config = make(torch.randn(VOCAB, HIDDEN))
    write_eagle_head(tmp_path / "head", weights, config, safetensors=True)
    expect_error(["--checkpoint_dir", str(tmp_path / "head")], match, main=convert_main)
    assert not (tmp_path / "head" / "draft.pth").exists()


def test_flags_are_checked_at_load_too(checkpoints, tmp_path):
    """A converted head whose config.json was changed since: its weights no longer fit, said in one line."""
    target_dir, hf = checkpoints("llama8")
    write_head(tmp_path / "head", CASES["speculators-eagle3.1"], hf.model.embed_tokens.weight.detach())
    convert(tmp_path / "head", log=lambda *_: None)
    path = tmp_path / "head" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "fc_norm": False, "norm_before_fc": True}))
    expect_error(["--checkpoint_path", str(target_dir / "model.pth"), "--device", "cpu", "--prompt", "w1",
                  "--draft_checkpoint_path", str(tmp_path / "head" / "draft.pth")],
                 "does not match its config.json")


@pytest.mark.parametrize("n_layer", [3, 4, 5, 6, 7, 8])
def test_default_feature_layers_must_be_distinct_and_in_order(n_layer):
    """2, L//2, L-3 on a shallow target repeats or reverses layers (4 layers: 2, 2, 1): refused unless the config
    names the layers; named ones are read as they are."""
    if n_layer >= 7:
        assert eagle3_feature_layers({}, n_layer, "head") == (2, n_layer // 2, n_layer - 3)
    else:
        default = [2, n_layer // 2, n_layer - 3]
        with pytest.raises(EagletError) as e:
            eagle3_feature_layers({}, n_layer, "head")
        assert f"default EAGLE-3 feature layers 2, L//2, L-3 are {default}" in str(e.value)
        assert "eagle_aux_hidden_state_layer_ids" in str(e.value)
    named = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}}
    assert eagle3_feature_layers(named, n_layer, "head") == (1, 2, 2)


def test_top_level_ids_name_layer_inputs():
    """Top-level eagle_aux_hidden_state_layer_ids (speculators' place for them, where vLLM reads them) name layer
    inputs in any config; next to eagle_config's (layer outputs) they must agree."""
    flat = {"eagle_aux_hidden_state_layer_ids": [1, 4, 6], "hidden_size": HIDDEN}
    assert eagle3_feature_layers(flat_head_config(flat, "h"), L, "h") == (1, 4, 6)
    both = {**flat, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}}
    assert eagle3_feature_layers(flat_head_config(both, "h"), L, "h") == (1, 4, 6)
    assert flat_head_config({"hidden_size": HIDDEN}, "h") == {"hidden_size": HIDDEN}  # EAGLE's: as it is


def test_shallow_target_with_default_layers_is_one_line(tmp_path):
    """End to end: an EAGLE-3 head without named layers on a 4-layer target."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    shallow = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=4,
                          num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    LlamaForCausalLM(shallow).save_pretrained(tmp_path / "t")
    write_tokenizer(tmp_path / "t")
    write_head(tmp_path / "head", CASES["eagle"], torch.randn(VOCAB, HIDDEN))
    for folder in ("t", "head"):
        convert(tmp_path / folder, log=lambda *_: None)
    expect_error(["--checkpoint_path", str(tmp_path / "t" / "model.pth"), "--device", "cpu", "--prompt", "w1",
                  "--draft_checkpoint_path", str(tmp_path / "head" / "draft.pth")],
                 "on a 4-layer target the default EAGLE-3 feature layers 2, L//2, L-3 are [2, 2, 1]")


@pytest.mark.parametrize("hidden,vocab,match,absent", [(32, 96, "hidden size 32 vs 64", "vocabulary"),
                                                       (64, 80, "vocabulary 80 vs 96", "hidden size")])
def test_head_target_mismatch_names_only_what_differs(checkpoints, tmp_path, hidden, vocab, match, absent):
    target_dir, _ = checkpoints("llama2")  # hidden 64, vocabulary 96
    write_eagle_head(tmp_path / "head", random_head_weights(hidden, 4, 4, 96, vocab),
                     head_config(hidden, 4, 4, 96, vocab))
    convert(tmp_path / "head", log=lambda *_: None)
    with pytest.raises(EagletError, match="does not match the target") as e:
        load_draft(tmp_path / "head" / "draft.pth", load_target(target_dir / "model.pth", "cpu", "fp32"))
    assert match in str(e.value) and absent not in str(e.value).split("target (head vs target):")[1], str(e.value)
