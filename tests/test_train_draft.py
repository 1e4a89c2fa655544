"""Training a head: the loss goes down, the head is saved under the published keys, and the tools load it."""
import json

import torch
from safetensors.torch import load_file

import generate
import train_draft
from conftest import expect_error
from convert_hf_checkpoint import convert
from generate import SamplingConfig, load_draft, load_target

PUBLISHED_KEYS = {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                  "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                  "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
                  "layers.0.post_attention_layernorm.weight"}


def corpus(path, n_words=3000, seed=0):
    """Text with structure to learn: runs of consecutive word ids with random jumps."""
    g = torch.Generator().manual_seed(seed)
    words, w = [], 10
    for _ in range(n_words):
        w = int(torch.randint(4, 96, (1,), generator=g)) if torch.rand(1, generator=g) < 0.15 else 4 + (w - 3) % 92
        words.append(f"w{w - 4}")
    path.write_text(" ".join(words))
    return path


def test_training_lowers_the_loss_and_tools_accept_the_head(checkpoints, tmp_path):
    target_dir, _ = checkpoints("llama31")
    text = corpus(tmp_path / "corpus.txt")
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    tokenizer = generate.Tokenizer(target_dir)
    cfg = train_draft.TrainConfig(steps=60, batch_size=4, seq_len=48, lr=3e-3, warmup=5, noise=0.0)
    examples = train_draft.load_examples([text], tokenizer, cfg.seq_len)
    tokens, mask = next(train_draft.batches(examples, 8, cfg.seq_len, 0, seed=123))
    target.setup_rope(cfg.seq_len)

    def loss_of(head):
        head.setup_rope(cfg.seq_len)
        with torch.no_grad():
            return train_draft.head_loss(head, target, tokens, mask, cfg)
    before, top1_before = loss_of(train_draft.new_head(target.args, torch.device("cpu"), cfg.seed))
    head = train_draft.train(target, examples, tmp_path / "head", cfg, log=lambda *_: None)
    after, top1_after = loss_of(head)
    print(f"loss {before:.4f} -> {after:.4f}, top-1 agreement {top1_before:.3f} -> {top1_after:.3f}")
    assert after < 0.9 * before and top1_after > top1_before

    assert set(load_file(str(tmp_path / "head" / "model.safetensors"))) == PUBLISHED_KEYS
    assert json.loads((tmp_path / "head" / "config.json").read_text())["num_hidden_layers"] == 1
    convert(tmp_path / "head")
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 200)
    draft = load_draft(tmp_path / "head" / "draft.pth", model)
    prompt = tokenizer.encode("w5 w6 w7 w8")
    spec = generate.generate(model, prompt, 40, SamplingConfig(), draft=draft)
    assert spec.tokens == generate.generate(model, prompt, 40, SamplingConfig()).tokens


def test_cli_self_distillation_on_question_files_and_resume(checkpoints, tmp_path, capsys):
    target_dir, _ = checkpoints("llama2")
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "x", "turns": [f"w{i} w{i + 1}", f"w{i + 2}"]})
                                   for i in range(12)))
    argv = ["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(questions), "--self_distill",
            "--out_dir", str(tmp_path / "head"), "--device", "cpu", "--batch_size", "2", "--seq_len", "64",
            "--max_new_tokens", "6", "--save_every", "5"]
    train_draft.main(argv + ["--steps", "5"])
    assert (tmp_path / "head" / "train_state.pt").exists()
    train_draft.main(argv + ["--steps", "8"])
    out = capsys.readouterr().out
    assert "12 examples" in out and "resuming at step 5" in out and "step 8/8" in out
    assert "q.jsonl: the target answers question 12/12" in out and "chat template: " in out  # progress, named
    convert(tmp_path / "head")
    assert (tmp_path / "head" / "draft.pth").exists()


def test_chat_examples_mask_only_the_assistant(checkpoints):
    target_dir, _ = checkpoints("llama2")
    tokenizer = generate.Tokenizer(target_dir)
    tokens, mask = train_draft.chat_example(tokenizer, ["w1 w2", "w3"], ["w10 w11", "w12"])
    masked = [t for t, m in zip(tokens, mask) if m]
    assert masked == tokenizer.encode("w10 w11", bos=False) + [2] + tokenizer.encode("w12", bos=False) + [2]
    assert len(tokens) == len(mask)


def test_training_errors(checkpoints, tmp_path):
    target_dir, _ = checkpoints("llama2")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["w1"]}))
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--out_dir", str(tmp_path / "h"), "--device", "cpu"]
    expect_error(base + ["--data", str(tmp_path / "missing.txt")], "data file not found", main=train_draft.main)
    expect_error(base + ["--data", str(questions)], "--self_distill", main=train_draft.main)


def test_a_head_trained_on_a_biased_target_loads_back(checkpoints, tmp_path):
    """A new head copies its target's layer shapes, biases included (Qwen2: q/k/v; LLaMA: attention_bias,
    mlp_bias): its config.json must say so, or the head cannot be loaded again."""
    for kind in ("qwen2", "llama_bias"):
        target_dir, _ = checkpoints(kind)
        target = load_target(target_dir / "model.pth", "cpu", "fp32")
        cfg = train_draft.TrainConfig(steps=2, batch_size=2, seq_len=16, warmup=1)
        examples = train_draft.load_examples([corpus(tmp_path / "c.txt", 200)], generate.Tokenizer(target_dir), 16)
        train_draft.train(target, examples, tmp_path / kind, cfg, log=lambda *_: None)
        convert(tmp_path / kind, log=lambda *_: None)
        model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
        draft = load_draft(tmp_path / kind / "draft.pth", model)
        assert draft.layer.attention.wqkv.bias is not None
        assert (draft.layer.feed_forward.w2.bias is not None) == (kind == "llama_bias")
