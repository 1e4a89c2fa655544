"""Training EAGLE-3 heads (train_draft.py --head eagle3): the unrolled training forward is the decode-time
tree, training raises acceptance, the saved head converts and decodes losslessly, and mistakes are refused."""
import json

import pytest
import torch
from safetensors.torch import load_file

from decode import TreeConfig, catch_up, generate
from sampling import SamplingConfig
from tokenizer import Tokenizer
import train_draft
import train_data
import train_heads
from conftest import cli_plain_and_speculative, expect_error
from convert_hf_checkpoint import convert
from draft import Eagle3Draft, build_tree
from load import load_draft, load_target

GREEDY = SamplingConfig()
PUBLISHED_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{k}.weight" for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def fresh_head(target, draft_vocab=40, seed=0, std=0.3):
    """An untrained head with a reduced draft vocabulary, its layer weights large enough that every input matters."""
    config = train_heads.eagle3_config(target.args, draft_vocab)
    draft_ids = torch.randperm(target.args.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    head = train_heads.new_eagle3_head(target, draft_ids.sort().values, config, seed)
    with torch.no_grad():
        for p in head.layer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * std)
    return head


def tree_outputs(target, head, tokens, features, t, steps, topk=3):
    """The head's outputs along one root-to-leaf path of the decode-time tree: catch-up over the pairs
    (f_0, x_1) .. (f_t, x_{t+1}) (root x_{t+1}), then build_tree with a top-k that ranks the data's next token
    first at every node, so that the path x_{t+2}, x_{t+3}, ... stays at the front of the frontier while
    other candidates fill the rest of it (and their own cache slots)."""
    head.setup_caches(64)
    h_last = catch_up(target, head, tokens[1:t + 2], features[:t + 1], torch.tensor(0), torch.tensor(t))
    level = iter(range(steps))
    path_outputs = [h_last]

    def topk_fn(h, k):
        i = next(level)
        rows = h.view(-1, h.shape[-1]).shape[0]
        ids = torch.stack([torch.roll(torch.arange(k) * 7 + 3 + r, 1) for r in range(rows)])
        ids[:, 0] = tokens[min(t + 2 + i, len(tokens) - 1)]  # the last level's children are never run
        logp = -torch.arange(k, dtype=torch.float).expand(rows, k) - torch.arange(rows)[:, None]
        return (logp[0], ids[0]) if h.dim() == 1 else (logp, ids)

    def step(node_tokens, inputs, input_pos, slots, mask):
        out = head.step(target, node_tokens, inputs, input_pos, slots, mask)
        assert node_tokens[0] == tokens[t + 1 + len(path_outputs)]  # the data's path leads the frontier
        path_outputs.append(out[0])
        return out

    build_tree(step, topk_fn, h_last, tokens[t + 1], torch.tensor(t + 1), topk, steps - 1, 10, head.context_mask)
    return torch.stack(path_outputs)


def test_unrolled_training_forward_is_the_decode_time_tree(checkpoints):
    """Step j of the training-time test at index t equals the tree node j levels below the root x_{t+1},
    run by the decode-time machinery (catch-up, build_tree, the draft's KV cache and tree mask)."""
    target_dir, _ = checkpoints("llama8")
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    head = fresh_head(target)
    target.set_feature_layers(head.feature_layers)
    steps, seq = 5, 20
    tokens = torch.randint(3, target.args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(seq)
    target.setup_rope(seq)
    head.setup_rope(seq + steps)
    with torch.no_grad():
        _, features = target(tokens, pos, None, train_draft.causal(seq, "cpu"))
        unrolled = torch.stack(train_draft.unroll(head, target, tokens, features, steps), dim=1)  # [B, steps, T-1, dim]
        target.setup_caches(1, 64)
        for b in range(2):
            for t in (0, 4, seq - steps - 1):
                decoded = tree_outputs(target, head, tokens[b], features[b], t, steps)
                torch.testing.assert_close(unrolled[b, :, t], decoded, atol=1e-4, rtol=1e-4)
    # the unroll's steps differ from one another (each reads its own parent), so the comparison has teeth
    assert (unrolled[:, 1] - unrolled[:, 0]).abs().max() > 0.1


def own_text(target, n=16, new_tokens=48):
    """The target's own writing: n continuations, sampled at temperature 1, of short random prompts."""
    target.setup_caches(1, 128)
    g, examples = torch.Generator().manual_seed(0), []
    for i in range(n):
        torch.manual_seed(i)
        prompt = [1] + torch.randint(3, target.args.vocab_size, (4,), generator=g).tolist()
        tokens = prompt + generate(target, prompt, new_tokens, SamplingConfig(temperature=1.0)).tokens
        examples.append((tokens, [1] * len(tokens)))
    return examples


def measured_tau(target, head, examples, tree=TreeConfig(depth=4, topk=4, total_tokens=20)):
    target.setup_caches(1, 128)
    head.setup_caches(128)
    lengths = []
    for tokens, _ in examples[:8]:
        result = generate(target, tokens[:20], 32, GREEDY, draft=head, tree=tree)
        assert result.tokens == generate(target, tokens[:20], 32, GREEDY).tokens
        lengths += result.accept_lengths
    return sum(lengths) / len(lengths)


@pytest.mark.slow
def test_training_lowers_the_loss_at_every_step_and_raises_tau(checkpoints, tmp_path):
    target_dir, _ = checkpoints("llama8")
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    examples = own_text(target)
    for layer in target.layers:  # training runs whole sequences without a cache
        layer.attention.kv_cache = None
    cfg = train_draft.TrainConfig(steps=40, batch_size=8, seq_len=53, lr=3e-3, warmup=5, unroll_steps=4)
    untrained, _, _ = train_draft.make_head("eagle3", target, examples, cfg)
    untrained.setup_rope(cfg.seq_len + cfg.unroll_steps)
    trained = train_draft.train(target, examples, tmp_path / "head", cfg, kind="eagle3", log=lambda *_: None)
    tokens, mask = next(train_data.batches(examples, 16, cfg.seq_len, 0, seed=5))
    with torch.no_grad():
        (before, top1_before), (after, top1_after) = (
            train_draft.eagle3_step_losses(head, target, tokens, mask, cfg.unroll_steps) for head in (untrained, trained))
    tau_before, tau_after = measured_tau(target, untrained, examples), measured_tau(target, trained, examples)
    print(f"per-step loss {before.tolist()} -> {after.tolist()}; top-1 {top1_before.tolist()} -> "
          f"{top1_after.tolist()}; tau {tau_before:.2f} -> {tau_after:.2f}")
    assert (after < before - 0.05).all() and (top1_after > top1_before).all()
    assert tau_after > tau_before + 0.2


def corpus(path, n_words=2000, seed=0):
    """Text with structure to learn: runs of consecutive word ids with random jumps, some words more common."""
    g = torch.Generator().manual_seed(seed)
    words, w = [], 0
    for _ in range(n_words):
        w = int(torch.randint(0, 60, (1,), generator=g)) if torch.rand(1, generator=g) < 0.2 else (w + 1) % 60
        words.append(f"w{w}")
    path.write_text(" ".join(words))
    return path


@pytest.mark.slow
def test_cli_trains_resumes_converts_and_decodes_losslessly(checkpoints, tmp_path, capsys):
    """--head eagle3 with chosen feature layers and a reduced draft vocabulary: the published keys and config,
    d2t/t2d naming the data's most frequent tokens, a resumed run, and greedy output equal to plain."""
    target_dir, _ = checkpoints("llama8")
    text, out = corpus(tmp_path / "corpus.txt"), tmp_path / "head3"
    argv = ["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(text), "--out_dir", str(out),
            "--head", "eagle3", "--feature_layers", "1", "4", "8", "--draft_vocab_size", "48", "--device", "cpu",
            "--batch_size", "4", "--seq_len", "32", "--unroll_steps", "3", "--save_every", "4", "--lr", "3e-3"]
    train_draft.main(argv + ["--steps", "4"])
    train_draft.main(argv + ["--steps", "30"])
    printed = capsys.readouterr().out
    assert "resuming at step 4" in printed and "training 30/30 steps (100.0%)" in printed
    assert "top-1 agreement at unrolled steps 1-3 " in printed and "(means of the last 26 steps)" in printed

    weights = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert set(weights) == PUBLISHED_KEYS and config["draft_vocab_size"] == 48 and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 7]  # id k = the output of layer k
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    draft_ids = torch.arange(48) + weights["d2t"]
    assert torch.equal(weights["t2d"].nonzero().flatten(), draft_ids)
    tokenizer = Tokenizer(target_dir)
    counts = torch.bincount(torch.tensor(tokenizer.encode(text.read_text(), bos=False)), minlength=96)
    assert counts[draft_ids].min() >= counts[~weights["t2d"]].max()  # the 48 most frequent tokens of the data

    from convert_hf_checkpoint import main as convert_main
    convert_main(["--checkpoint_dir", str(out)])
    plain, spec = cli_plain_and_speculative(target_dir, out / "draft.pth", tmp_path)
    assert spec["tokens"] == plain["tokens"] and spec["cycles"] > 0
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 128)
    draft = load_draft(out / "draft.pth", model)
    assert isinstance(draft, Eagle3Draft) and draft.feature_layers == (1, 4, 8)
    assert torch.equal(draft.draft_to_target, draft_ids)


def test_errors(checkpoints, tmp_path):
    target_dir, _ = checkpoints("llama8")
    shallow, _ = checkpoints("llama2")
    text = corpus(tmp_path / "corpus.txt", n_words=200)
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(text), "--device", "cpu",
            "--steps", "1", "--batch_size", "2", "--seq_len", "16", "--head", "eagle3"]

    def fails(extra, match, out="h"):
        expect_error(base + ["--out_dir", str(tmp_path / out)] + extra, match, main=train_draft.main)
    fails(["--draft_vocab_size", "97"], "--draft_vocab_size 97 exceeds the target's vocabulary (96)")
    fails(["--feature_layers", "1", "4", "9"], "which a 8-layer target does not all have")
    fails(["--feature_layers", "0", "4", "5"], "--feature_layers: must be at least 1")
    fails(["--unroll_steps", "0"], "unroll_steps must be at least 1")
    fails(["--step_decay", "0"], "step_decay must be above 0")
    fails(["--data", str(tmp_path / "missing.txt")], "data file not found")
    expect_error(["--checkpoint_path", str(shallow / "model.pth"), "--data", str(text), "--out_dir", str(tmp_path / "s"),
                  "--head", "eagle3", "--device", "cpu"], "a 2-layer target does not all have", main=train_draft.main)
    eagle = [a for a in base if a not in ("--head", "eagle3")] + ["--out_dir", str(tmp_path / "e")]
    expect_error(eagle + ["--draft_vocab_size", "32"], "are for EAGLE-3 heads", main=train_draft.main)
    # a train_state.pt of one kind of head is not resumed as another
    train_draft.main(base + ["--out_dir", str(tmp_path / "three")])
    expect_error(eagle[:-1] + [str(tmp_path / "three")], "written while training another head (head eagle3 vs eagle",
                 main=train_draft.main)
    fails(["--draft_vocab_size", "40", "--steps", "2"], "draft_vocab differ", out="three")
