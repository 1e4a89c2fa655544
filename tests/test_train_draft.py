"""Training a head: the loss goes down, the head is saved under the published keys, and the tools load it."""
import json
import os
from collections import deque
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from decode import generate
from sampling import SamplingConfig
from tokenizer import Tokenizer
import train_draft
import train_data
import train_heads
from conftest import expect_error
from convert_hf_checkpoint import convert
from load import load_draft, load_target

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
    tokenizer = Tokenizer(target_dir)
    cfg = train_draft.TrainConfig(steps=60, batch_size=4, seq_len=48, lr=3e-3, warmup=5, noise=0.0)
    examples = train_data.load_examples([text], tokenizer, cfg.seq_len)
    tokens, mask = next(train_data.batches(examples, 8, cfg.seq_len, 0, seed=123))
    target.setup_rope(cfg.seq_len)

    def loss_of(head):
        head.setup_rope(cfg.seq_len)
        with torch.no_grad():
            return train_draft.head_loss(head, target, tokens, mask, cfg)
    before, top1_before = loss_of(train_heads.new_head(target.args, torch.device("cpu"), cfg.seed))
    head = train_draft.train(target, examples, tmp_path / "head", cfg, log=lambda *_: None)
    after, top1_after = loss_of(head)
    print(f"loss {before:.4f} -> {after:.4f}, top-1 agreement {top1_before:.3f} -> {top1_after:.3f}")
    assert after < 0.9 * before and top1_after > top1_before

    assert set(load_file(str(tmp_path / "head" / "model.safetensors"))) == PUBLISHED_KEYS
    umask = os.umask(0o022)
    os.umask(umask)  # the head is readable as any file this user writes is (safetensors alone makes it 0600)
    assert (tmp_path / "head" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert json.loads((tmp_path / "head" / "config.json").read_text())["num_hidden_layers"] == 1
    convert(tmp_path / "head")
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 200)
    draft = load_draft(tmp_path / "head" / "draft.pth", model)
    prompt = tokenizer.encode("w5 w6 w7 w8")
    spec = generate(model, prompt, 40, SamplingConfig(), draft=draft)
    assert spec.tokens == generate(model, prompt, 40, SamplingConfig()).tokens


@pytest.mark.slow
def test_cli_self_distillation_on_question_files_and_resume(checkpoints, tmp_path, capsys, monkeypatch):
    """The target's replies are written once: a resumed run reuses them (the target is not run, the examples are
    the same), a run with another reply length writes them again and says why."""
    target_dir, _ = checkpoints("llama2")
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "x", "turns": [f"w{i} w{i + 1}", f"w{i + 2}"]})
                                   for i in range(12)))
    text = corpus(tmp_path / "corpus.txt", 100)  # two pieces of 64 tokens the target continues
    head, cache = tmp_path / "head", tmp_path / "head" / "self_distill.jsonl"
    argv = ["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(questions), str(text), "--self_distill",
            "--out_dir", str(head), "--device", "cpu", "--batch_size", "2", "--seq_len", "64",
            "--max_new_tokens", "6", "--save_every", "5"]
    trained_on, real_train, replies_written = [], train_draft.train, []
    monkeypatch.setattr(train_draft, "train", lambda target, examples, *a, **k: (
        trained_on.append(examples), real_train(target, examples, *a, **k))[1])
    monkeypatch.setattr(train_draft, "generate",
                        lambda *a, **k: (replies_written.append(1), generate(*a, **k))[1])
    train_draft.main(argv + ["--steps", "5"])
    out = capsys.readouterr().out
    assert "self-distilling 14/14 examples (100.0%)" in out and "chat template: " in out  # progress, named
    assert f"self-distillation: wrote {cache}" in out and (head / "train_state.pt").exists()
    assert replies_written and not (head / "self_distill.partial.jsonl").exists()
    header = json.loads(cache.read_text().splitlines()[0])
    assert header["record"]["max_new_tokens"] == 6 and header["examples"] == 14
    assert [d["name"] for d in header["record"]["data"]] == ["q.jsonl", "corpus.txt"]
    first_written = cache.read_bytes()

    replies_written.clear()
    train_draft.main(argv + ["--steps", "8"])
    out = capsys.readouterr().out
    assert f"self-distillation: reusing the target's replies to all 14 examples from {cache}" in out
    assert replies_written == [] and trained_on[1] == trained_on[0] and cache.read_bytes() == first_written
    assert "14 examples" in out and "resuming at step 5" in out and "training 8/8 steps (100.0%)" in out
    assert "top-1 agreement" in out and "(means of the last 3 steps)" in out  # what the numbers are

    train_draft.main(argv[:-3] + ["5", "--save_every", "5", "--steps", "10"])  # --max_new_tokens 5
    out = capsys.readouterr().out
    assert f"not reusing {cache}: it was written with other inputs or settings (max_new_tokens: 6 -> 5)" in out
    assert replies_written and "self-distilling 14/14 examples" in out
    assert json.loads(cache.read_text().splitlines()[0])["record"]["max_new_tokens"] == 5
    assert trained_on[2] != trained_on[0]
    convert(head)
    assert (head / "draft.pth").exists()
    replies_written.clear()  # no more steps to take: said before any long work, and nothing is rewritten
    saved = (head / "model.safetensors").read_bytes()
    expect_error(argv + ["--steps", "7"], f"{head / 'train_state.pt'} has trained 10 steps, and --steps asks for 7",
                 main=train_draft.main)
    assert replies_written == [] and (head / "model.safetensors").read_bytes() == saved
    (head / "model.safetensors").unlink()  # a run stopped in its last save: the same command writes the head
    train_draft.main(argv + ["--steps", "10"])
    assert (head / "model.safetensors").read_bytes() == saved


def test_chat_examples_mask_only_the_assistant(checkpoints):
    target_dir, _ = checkpoints("llama2")
    tokenizer = Tokenizer(target_dir)
    tokens, mask = train_data.chat_example(tokenizer, ["w1 w2", "w3"], ["w10 w11", "w12"])
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
    for name in ("latin1.txt", "latin1.jsonl"):  # trained on with its bytes replaced, once
        (tmp_path / name).write_bytes(b"caf\xe9 au lait\n")
        expect_error(base + ["--data", str(tmp_path / name)], f"{tmp_path / name} is not UTF-8 text (byte 3: b'\\xe9')",
                     main=train_draft.main)


def test_a_head_trained_on_a_biased_target_loads_back(checkpoints, tmp_path):
    """A new head copies its target's layer shapes, biases included (Qwen2: q/k/v; LLaMA: attention_bias,
    mlp_bias): its config.json must say so, or the head cannot be loaded again."""
    for kind in ("qwen2", "llama_bias"):
        target_dir, _ = checkpoints(kind)
        target = load_target(target_dir / "model.pth", "cpu", "fp32")
        cfg = train_draft.TrainConfig(steps=2, batch_size=2, seq_len=16, warmup=1)
        examples = train_data.load_examples([corpus(tmp_path / "c.txt", 200)], Tokenizer(target_dir), 16)
        train_draft.train(target, examples, tmp_path / kind, cfg, log=lambda *_: None)
        convert(tmp_path / kind, log=lambda *_: None)
        model = load_target(target_dir / "model.pth", "cpu", "fp32", 64)
        draft = load_draft(tmp_path / kind / "draft.pth", model)
        assert draft.layer.attention.wqkv.bias is not None
        assert (draft.layer.feed_forward.w2.bias is not None) == (kind == "llama_bias")


def distill_items(n):
    return [train_data.DataItem(Path("q.jsonl"), turns=[f"w{i}"]) for i in range(n)]


def test_an_interrupted_self_distillation_resumes_where_it_stopped(tmp_path):
    """Each example is kept as the target finishes it: a rerun asks the target only for the rest, never trusts a
    line cut by the interruption, and the complete file appears only at the end; another record starts over."""
    items, written, lines = distill_items(10), [], []

    def replies(item, stop_at=None):
        written.append(item.turns[0])
        if len(written) == stop_at:
            raise KeyboardInterrupt
        return [f"reply to {item.turns[0]}", "second turn"]
    with pytest.raises(KeyboardInterrupt):
        train_data.self_distilled_replies(items, tmp_path, {"max_new_tokens": 6}, lambda i: replies(i, stop_at=5),
                                           log=lines.append)
    partial, final = tmp_path / "self_distill.partial.jsonl", tmp_path / "self_distill.jsonl"
    assert not final.exists() and len(partial.read_text().splitlines()) == 1 + 4  # the header and 4 examples
    assert lines[-1] == f"self-distillation stopped at 4/10 examples, kept in {partial}: the same command resumes there"
    with open(partial, "a") as f:
        f.write('{"item": 4, "replies": ["cut sh')  # a line the interruption cut

    written.clear()
    got = train_data.self_distilled_replies(items, tmp_path, {"max_new_tokens": 6}, replies, log=lines.append)
    assert written == [f"w{i}" for i in range(4, 10)]  # only the rest
    assert got == [[f"reply to w{i}", "second turn"] for i in range(10)]
    assert f"self-distillation: resuming at 4/10 examples from {partial}" in lines
    assert final.exists() and not partial.exists() and not list(tmp_path.glob(".*tmp"))
    assert [json.loads(line) for line in final.read_text().splitlines()[1:]] == [
        {"item": i, "replies": r} for i, r in enumerate(got)]

    with pytest.raises(KeyboardInterrupt):  # another record: the partial file is not resumed
        train_data.self_distilled_replies(items, tmp_path, {"max_new_tokens": 7}, lambda i: replies(i, stop_at=13),
                                           log=lines.append)
    written.clear()
    train_data.self_distilled_replies(items, tmp_path, {"max_new_tokens": 8}, replies, log=lines.append)
    assert len(written) == 10 and any(line.startswith(f"self-distillation: starting over, not resuming {partial}: "
                                                      "it was written with other inputs or settings "
                                                      "(max_new_tokens: 7 -> 8)") for line in lines)


def test_a_damaged_or_incomplete_file_is_written_again(tmp_path):
    items, lines = distill_items(3), []
    train_data.self_distilled_replies(items, tmp_path, {}, lambda item: ["a"], log=lines.append)
    final = tmp_path / "self_distill.jsonl"
    final.write_text("\n".join(final.read_text().splitlines()[:-1]) + "\n")  # the last example lost
    got = train_data.self_distilled_replies(items, tmp_path, {}, lambda item: ["b"], log=lines.append)
    assert f"self-distillation: not reusing {final}: it holds 2 of the 3 examples; the target writes the replies " \
           "again" in lines
    assert got == [["b"]] * 3


def test_a_file_that_is_not_ours_is_never_replaced(checkpoints, tmp_path):
    target_dir, _ = checkpoints("llama2")
    text = corpus(tmp_path / "corpus.txt", 100)
    for name in ("self_distill.jsonl", "self_distill.partial.jsonl"):
        out = tmp_path / name.replace(".", "_")
        out.mkdir()
        (out / name).write_text('{"question_id": 1, "turns": ["my own data"]}\n')
        expect_error(["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(text), "--self_distill",
                      "--out_dir", str(out), "--device", "cpu", "--steps", "1", "--seq_len", "16"],
                     f"{out / name} is not a self-distillation file written by train_draft.py; it is left as it is",
                     main=train_draft.main)
        assert (out / name).read_text() == '{"question_id": 1, "turns": ["my own data"]}\n'
        assert sorted(f.name for f in out.iterdir()) == [name]


def test_the_record_names_every_input_that_changes_the_replies(checkpoints, tmp_path):
    """The target file, its tokenizer files and chat template, each data file, and the generation settings."""
    target_dir, _ = checkpoints("llama2")
    folder = tmp_path / "target"
    folder.mkdir()
    for f in target_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    data = corpus(tmp_path / "corpus.txt", 100)

    def record(**settings):
        args = {"seq_len": 64, "max_new_tokens": 6, "sampling": SamplingConfig(), "precision": "fp32", "device": "cpu",
                **settings}
        tokenizer = Tokenizer(folder)
        return train_data.self_distill_record(folder / "model.pth", [data], tokenizer, **args)

    def changed(edit=None, **settings):
        before = record()
        if edit:
            edit()
        return [d.split(":")[0] for d in train_data.record_differences(before, record(**settings))]
    assert changed() == []
    assert changed(seq_len=32) == ["seq_len"] and changed(precision="bf16") == ["precision"]
    assert changed(sampling=SamplingConfig(temperature=1.0)) == ["sampling.temperature"]
    assert "data.0.bytes" in changed(lambda: data.write_text(data.read_text() + " w1"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert changed(lambda: (folder / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": config["chat_template"] + " "}))) == [
        "tokenizer_files.tokenizer_config.json", "chat_template_sha256"]
    rewritten = (folder / "model.pth").stat().st_mtime_ns + 10 ** 9  # the same size, written again a second later
    assert changed(lambda: os.utime(folder / "model.pth", ns=(rewritten, rewritten))) == ["target.mtime_ns"]


def test_the_progress_line_shows_means_over_the_last_steps():
    recent = deque([(torch.tensor(1.0), torch.tensor(0.2)), (torch.tensor(2.0), torch.tensor(0.4))], maxlen=50)
    assert train_draft.recent_means(recent) == "loss 1.5000, top-1 agreement 0.300 (means of the last 2 steps)"
    eagle3 = deque([(torch.tensor(1.0), torch.tensor([0.5, 0.2, 0.1])),
                    (torch.tensor(3.0), torch.tensor([0.7, 0.4, 0.1]))])
    assert train_draft.recent_means(eagle3) == \
        "loss 2.0000, top-1 agreement at unrolled steps 1-3 0.600 0.300 0.100 (means of the last 2 steps)"
    assert train_draft.recent_means(deque([(torch.tensor(1.0), torch.tensor(0.2))])).endswith("(this step's batch)")
