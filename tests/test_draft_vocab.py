"""A smaller draft vocabulary for EAGLE-1/2 heads (FR-Spec): the mapping is honoured, output stays lossless,
and scripts/draft_vocab.py writes the most frequent tokens."""
import json

import pytest
import torch

import decode
import generate
import load
from conftest import expect_error, make_agreeing_pair, write_tokenizer
from convert_hf_checkpoint import convert
from decode import TreeConfig
from sampling import SamplingConfig
from load import load_draft, load_target

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, head, perm = make_agreeing_pair(tmp_path_factory.mktemp("vocab_pair"))  # vocab 64, tau 8 at 60/6/10
    convert(target), convert(head)
    return target, head, perm


def write_vocab(path, token_ids):
    path.write_text(json.dumps({"token_ids": [int(t) for t in token_ids]}))
    return path


def run(model, draft, prompts):
    lengths = []
    for prompt in prompts:
        spec = decode.generate(model, prompt, 40, GREEDY, draft=draft)
        assert spec.tokens == decode.generate(model, prompt, 40, GREEDY).tokens
        lengths += spec.accept_lengths
    return sum(lengths) / len(lengths)


PROMPTS = [[1, 5, 9], [1, 20, 33, 40], [1, 63], [1, 7, 7, 12, 50]]


def test_reordered_full_vocabulary_keeps_every_acceptance(pair, tmp_path):
    """Every token, shuffled: the draft's ids must go through the mapping or nothing would be accepted."""
    target_dir, head_dir, _ = pair
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 256)
    shuffled = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    draft = load_draft(head_dir / "draft.pth", model, write_vocab(tmp_path / "v.json", shuffled))
    assert draft.vocab_size == 64 and draft.vocab_lm_head.weight.shape == (64, 64)
    full = run(model, load_draft(head_dir / "draft.pth", model), PROMPTS)
    assert full > 7 and run(model, draft, PROMPTS) == full


def test_reduced_vocabulary_is_lossless_and_proposes_only_its_tokens(pair, tmp_path):
    target_dir, head_dir, perm = pair
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 256)
    kept = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:40]
    draft = load_draft(head_dir / "draft.pth", model, write_vocab(tmp_path / "v.json", kept))
    tau = run(model, draft, PROMPTS)
    print(f"tau with 40 of 64 tokens: {tau:.2f} (8.00 with all)")
    assert 1.0 < tau < 8.0
    with torch.no_grad():  # one expansion after a prefill: every proposed token is in the draft vocabulary
        logits, features = decode.prefill(model, torch.tensor([[1, 5, 9]]), 0)
        root = logits.argmax(-1)[0]
        h = decode.catch_up(model, draft, torch.tensor([5, 9, int(root)]), features[0], torch.tensor(0),
                            torch.tensor(2))
        tree = TreeConfig().expand(model, draft, root, torch.tensor(3), h)
    assert set(tree.tokens[1:].tolist()) <= set(kept.tolist())


def test_cli_finds_the_vocabulary_beside_the_head(pair, tmp_path, capsys):
    target_dir, head_dir, _ = pair
    head = tmp_path / "head"
    head.mkdir()
    for name in ("config.json", "draft.pth"):
        (head / name).write_bytes((head_dir / name).read_bytes())
    write_vocab(head / "draft_vocab.json", range(10, 50))
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--device", "cpu", "--prompt", "w5",
            "--max_new_tokens", "20", "--draft_checkpoint_path", str(head / "draft.pth")]
    generate.main(base)
    assert "draft vocabulary: 40 of 64 tokens" in capsys.readouterr().out
    generate.main(base + ["--draft_vocab", "full"])
    assert "draft vocabulary" not in capsys.readouterr().out
    expect_error(base + ["--tree_topk", "41", "--total_tokens", "40"], "tree_topk 41 exceeds the draft's vocabulary (40)")
    for name, ids in [("dup", [3, 3, 4]), ("range", [3, 64]), ("empty", [])]:
        expect_error(base + ["--draft_vocab", str(write_vocab(tmp_path / f"{name}.json", ids))],
                     "token_ids must be distinct ids below the target's vocabulary (64)")
    (tmp_path / "bad.json").write_text("{not json")
    expect_error(base + ["--draft_vocab", str(tmp_path / "bad.json")], "cannot read the draft vocabulary")
    for name, text in (("list", "[1, 2]"), ("floats", '{"token_ids": [1.5, 2]}'), ("bools", '{"token_ids": [true, 2]}')):
        (tmp_path / f"{name}.json").write_text(text)  # a list, not the object; ids read as other ids
        expect_error(base + ["--draft_vocab", str(tmp_path / f"{name}.json")],
                     'a draft vocabulary is {"token_ids": [whole numbers, ...]}')


def test_script_writes_the_most_frequent_tokens(tmp_path, capsys):
    import scripts.draft_vocab as script
    write_tokenizer(tmp_path)
    text = tmp_path / "a.txt"
    text.write_text("w7 w7 w7 w9 w9 w11\nw7 w9 w30")  # ids = word index + 4
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["w30 w30 w30 w30"], "reference": ["w12"]}) + "\n")
    out = tmp_path / "draft_vocab.json"
    script.main(["--tokenizer", str(tmp_path), "--data", str(text), str(questions), "--size", "4", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["token_ids"] == [2, 34, 11, 13]  # EOS first (always kept), then w30 (5), w7 (4), w9 (3)
    assert written["counted_tokens"] == 14 and "4 of 96 tokens" in capsys.readouterr().out
    expect_error(["--tokenizer", str(tmp_path), "--data", str(text), "--out", str(out)], "exists", main=script.main)
    expect_error(["--tokenizer", str(tmp_path), "--data", str(text), "--out", str(tmp_path / "v.json"), "--size", "0"],
                 "--size: must be at least 1, got 0", main=script.main)
    expect_error(["--tokenizer", str(tmp_path), "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "v.json")],
                 "no such file or folder", main=script.main)
    expect_error(["--tokenizer", str(tmp_path), "--data", str(text), "--out", str(tmp_path / "no" / "v.json")],
                 "no folder", main=script.main)


def test_script_skips_binary_files_in_folders_and_refuses_data_without_text(tmp_path, capsys):
    """A folder's binary files are skipped (and counted in a note), a binary file named is refused, and data that
    gives no text (questions without turns) is an error, never a vocabulary of the EOS token alone."""
    import scripts.draft_vocab as script
    write_tokenizer(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("w7 w7 w9")
    (data / "weights.bin").write_bytes(bytes(range(256)) * 4)
    out = tmp_path / "v.json"
    script.main(["--tokenizer", str(tmp_path), "--data", str(data), "--size", "3", "--out", str(out)])
    assert json.loads(out.read_text())["counted_tokens"] == 3
    assert "skipped 1 files under the folders that are not text" in capsys.readouterr().out
    expect_error(["--tokenizer", str(tmp_path), "--data", str(data / "weights.bin"), "--out", str(tmp_path / "b.json")],
                 "is not a text file", main=script.main)
    no_turns = tmp_path / "q.jsonl"
    no_turns.write_text(json.dumps({"question_id": 1, "category": "writing"}) + "\n")
    expect_error(["--tokenizer", str(tmp_path), "--data", str(no_turns), "--out", str(tmp_path / "c.json")],
                 "holds no text to count", main=script.main)
    no_turns.write_text("[1, 2]\n")
    expect_error(["--tokenizer", str(tmp_path), "--data", str(no_turns), "--out", str(tmp_path / "c.json")],
                 "is not a JSON object", main=script.main)
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "c.json").exists()


def test_default_draft_vocabulary_is_the_lowest_ids_with_the_eos_tokens():
    from head_formats import default_draft_vocab
    ids = default_draft_vocab(128256, keep_ids=(128001, 128009, 7), size=32768)
    assert len(ids) == 32768 and ids.unique().numel() == 32768
    assert ids[:-2].tolist() == list(range(32766)) and ids[-2:].tolist() == [128001, 128009]  # 7 is among the lowest
    assert default_draft_vocab(1000, (999,), 32768).tolist() == list(range(1000))  # a small vocabulary: all of it


def test_a_large_vocabulary_gets_the_default_draft_vocabulary(pair, monkeypatch, capsys):
    """Above DRAFT_VOCAB_ABOVE ids and with no draft_vocab.json beside the head, an EAGLE-1/2 head drafts over the
    DEFAULT_DRAFT_VOCAB lowest ids and the EOS tokens; the output is plain decoding's; --draft_vocab 0 keeps all.
    (The 64-token pair stands in for a 128k vocabulary: the thresholds scaled down with it.)"""
    target_dir, head_dir, _ = pair
    monkeypatch.setattr(load, "DRAFT_VOCAB_ABOVE", 32)
    monkeypatch.setattr(load, "DEFAULT_DRAFT_VOCAB", 40)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 256)
    draft = load_draft(head_dir / "draft.pth", model, keep_ids=(60,))
    assert draft.draft_to_target.tolist() == list(range(39)) + [60]
    assert draft.draft_vocab_source.startswith("the 40 lowest ids")
    tau = run(model, draft, PROMPTS)  # run() checks every output against plain decoding
    assert 1.0 < tau < 8.0
    assert load_draft(head_dir / "draft.pth", model, "0").draft_to_target is None
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--device", "cpu", "--prompt", "w5",
            "--max_new_tokens", "8", "--draft_checkpoint_path", str(head_dir / "draft.pth")]
    generate.main(base)
    assert "draft vocabulary: 40 of 64 tokens, from the 40 lowest ids (the default over 32" in capsys.readouterr().out
    generate.main(base + ["--draft_vocab", "0"])
    assert "draft vocabulary" not in capsys.readouterr().out
