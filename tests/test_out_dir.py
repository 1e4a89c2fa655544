"""convert_hf_checkpoint.py --out_dir: a checkpoint folder that is read-only or shared (a hub cache) converts into
another folder, which then holds all that generate.py reads: each kind of conversion (target, EAGLE-1/2 head,
EAGLE-3 head, Hub 4-bit target) runs from there exactly as a conversion in place does, and the input folder is
left as it was. Existing outputs are replaced only with --overwrite; an out_dir that cannot be written is refused
before any weight is converted."""
import json
import os
import shutil

import pytest
import torch

import generate
from conftest import CHAT_TEMPLATE, expect_error, make_agreeing_eagle3_pair, make_agreeing_pair, make_hf_checkpoint
from convert_hf_checkpoint import convert
from convert_hf_checkpoint import main as convert_main
from test_hub_int4 import round_to_grid, write_hub

QUIET = {"log": lambda *_: None}
# The files of the target folder below that generate.py reads beside model.pth, and so the ones copied.
TARGET_FILES = ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json"]


def snapshot(folder) -> dict:
    """Every path under folder (and the folder) with its size and modification time: a file added, removed or
    rewritten shows (chmod does not stop root, who runs these tests in some places)."""
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns)
            for p in [folder, *sorted(folder.rglob("*"))]}


@pytest.fixture
def read_only():
    """folder -> the folder, its files and subfolders made read-only; made writable again at the end (for
    pytest to remove them)."""
    folders = []

    def make(folder):
        for p in [*folder.rglob("*"), folder]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        folders.append(folder)
        return folder
    yield make
    for folder in folders:
        for p in [folder, *folder.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A target's Hugging Face folder whose own chat template file (which generate.py prefers to the one in
    tokenizer_config.json) ends the prompt in words, so that a run reading the other shows in its tokens."""
    folder = tmp_path_factory.mktemp("out_dir") / "hub"
    make_hf_checkpoint(folder, "llama2")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE.replace("assistant:", "w5 w6"))
    return folder


def generated(checkpoint, json_out, *extra) -> tuple:
    """What generate.py's CLI writes for one greedy prompt: the prompt's tokens and each sample's tokens and
    accept lengths."""
    generate.main(["--checkpoint_path", str(checkpoint), "--device", "cpu", "--prompt", "w1 w2 w3",
                   "--max_new_tokens", "12", "--json_out", str(json_out), "--overwrite", "--step_aside", "off",
                   *extra])
    record = json.loads(json_out.read_text())
    return record["prompt_tokens"], [(s["tokens"], s["accept_lengths"]) for s in record["samples"]]


def converted_in_place(folder, copy):
    """A copy of folder converted in place: its converted file."""
    shutil.copytree(folder, copy)
    return convert(copy, **QUIET)


def same_state_dicts(a, b) -> bool:
    a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return a.keys() == b.keys() and all(a[k] == b[k] if not torch.is_tensor(a[k]) else torch.equal(a[k], b[k])
                                        for k in a)


def test_a_read_only_target_converts_into_out_dir_and_runs_from_there(hub, tmp_path, read_only, capsys):
    in_place = converted_in_place(hub, tmp_path / "in_place")
    source = read_only(shutil.copytree(hub, tmp_path / "source"))
    before = snapshot(source)
    out = tmp_path / "new" / "parents" / "out"
    convert_main(["--checkpoint_dir", str(source), "--out_dir", str(out)])
    assert f"wrote {out / 'model.pth'}" in capsys.readouterr().out
    assert snapshot(source) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(TARGET_FILES + ["model.pth"])
    assert all((out / name).read_bytes() == (source / name).read_bytes() for name in TARGET_FILES)
    assert same_state_dicts(out / "model.pth", in_place)
    for chat in ([], ["--chat"]):
        ours = generated(out / "model.pth", tmp_path / "out.json", *chat)
        assert ours == generated(in_place, tmp_path / "in_place.json", *chat)
    assert ours[0][-2:] == [9, 10]  # w5 w6: the template copied beside model.pth was the one read


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_read_only_head_converts_into_out_dir_and_runs_from_there(tmp_path, read_only, kind):
    target, head = make_agreeing_pair(tmp_path)[:2] if kind == "eagle" else make_agreeing_eagle3_pair(tmp_path)
    convert(target, **QUIET)
    beside = ["config.json", "draft.pth"]
    if kind == "eagle":  # an EAGLE-1/2 head's draft vocabulary is read beside it: it changes the accept lengths
        (head / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(0, 64, 2))}))
        beside.append("draft_vocab.json")
    in_place = converted_in_place(head, tmp_path / "head_in_place")
    before = snapshot(read_only(head))
    out = tmp_path / "head_out"
    assert convert(head, out_dir=out, **QUIET) == out / "draft.pth"
    assert snapshot(head) == before
    assert sorted(p.name for p in out.iterdir()) == beside
    assert same_state_dicts(out / "draft.pth", in_place)
    ours = generated(target / "model.pth", tmp_path / "out.json", "--draft_checkpoint_path", str(out / "draft.pth"))
    assert ours == generated(target / "model.pth", tmp_path / "in_place.json", "--draft_checkpoint_path",
                             str(in_place))


def test_a_read_only_hub_int4_target_converts_into_out_dir_and_runs_from_there(hub, tmp_path, read_only):
    write_hub(tmp_path / "awq", hub, "awq", 32, lambda w: round_to_grid(w, 32, False, torch.bfloat16))
    in_place = converted_in_place(tmp_path / "awq", tmp_path / "awq_in_place")
    source = read_only(tmp_path / "awq")
    before = snapshot(source)
    out = tmp_path / "awq_out"
    assert convert(source, out_dir=out, **QUIET) == out / "model_int4.g32.pth"
    assert snapshot(source) == before
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model_int4.g32.pth", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert same_state_dicts(out / "model_int4.g32.pth", in_place)
    assert generated(out / "model_int4.g32.pth", tmp_path / "out.json") == \
        generated(in_place, tmp_path / "in_place.json")


def test_an_existing_converted_file_in_out_dir_is_replaced_only_with_overwrite(hub, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pth").write_bytes(b"the user's own file")
    expect_error(["--checkpoint_dir", str(hub), "--out_dir", str(out)],
                 f"{out / 'model.pth'} exists; give --overwrite to replace it", main=convert_main)
    assert [p.name for p in out.iterdir()] == ["model.pth"]
    assert (out / "model.pth").read_bytes() == b"the user's own file"
    convert(hub, out_dir=out, overwrite=True, **QUIET)
    assert "tok_embeddings.weight" in torch.load(out / "model.pth", weights_only=True)


def test_a_different_copy_is_replaced_only_with_overwrite_and_an_identical_one_is_kept(hub, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(hub / "config.json", out / "config.json")  # identical: kept as it is
    (out / "tokenizer_config.json").write_text("{}")  # another model's: refused
    (out / "chat_template.json").write_text('{"chat_template": "mine"}')  # not in the checkpoint: left alone
    before = snapshot(out)
    expect_error(["--checkpoint_dir", str(hub), "--out_dir", str(out)],
                 f"{out / 'tokenizer_config.json'} exists and differs from {hub / 'tokenizer_config.json'}; give "
                 "--overwrite to replace it", main=convert_main)
    assert snapshot(out) == before
    convert_main(["--checkpoint_dir", str(hub), "--out_dir", str(out), "--overwrite"])
    assert f"note: {out / 'chat_template.json'} is not from {hub}" in capsys.readouterr().out
    assert (out / "tokenizer_config.json").read_bytes() == (hub / "tokenizer_config.json").read_bytes()
    assert (out / "config.json").stat().st_mtime_ns == before["config.json"][2]
    assert (out / "chat_template.json").read_text() == '{"chat_template": "mine"}'
    assert sorted(p.name for p in out.iterdir()) == sorted(TARGET_FILES + ["chat_template.json", "model.pth"])


def test_a_second_conversion_into_the_same_out_dir_needs_overwrite(hub, tmp_path):
    out = tmp_path / "out"
    convert(hub, out_dir=out, **QUIET)
    expect_error(["--checkpoint_dir", str(hub), "--out_dir", str(out)], "model.pth exists; give --overwrite",
                 main=convert_main)
    convert(hub, out_dir=out, overwrite=True, **QUIET)  # the copies are identical: only model.pth is replaced


@pytest.mark.parametrize("where", ["cannot be made", "a file"])
def test_an_unwritable_out_dir_is_one_error_line_before_any_work(hub, tmp_path, capsys, where):
    (tmp_path / "a_file").write_text("mine")
    out, match = {"cannot be made": ("/proc/eaglet/out", "--out_dir /proc/eaglet/out cannot be made"),
                  "a file": (tmp_path / "a_file", f"--out_dir {tmp_path / 'a_file'} is a file, not a folder")}[where]
    expect_error(["--checkpoint_dir", str(hub), "--out_dir", str(out)], match, main=convert_main)
    assert capsys.readouterr().out == ""  # nothing converted


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_read_only_out_dir_is_one_error_line_before_any_work(hub, tmp_path, read_only, capsys):
    out = tmp_path / "out"
    out.mkdir()
    read_only(out)
    expect_error(["--checkpoint_dir", str(hub), "--out_dir", str(out)], f"cannot write in {out}", main=convert_main)
    assert capsys.readouterr().out == "" and list(out.iterdir()) == []


def test_out_dir_that_is_the_checkpoint_folder_converts_in_place(hub, tmp_path):
    folder = shutil.copytree(hub, tmp_path / "folder")
    convert(folder, **QUIET)
    names = sorted(p.name for p in folder.iterdir())
    os.symlink(folder, tmp_path / "link")
    for out_dir in (folder / ".", tmp_path / "link"):  # model.pth replaced without --overwrite, as in place
        assert convert(folder, out_dir=out_dir, **QUIET) == folder / "model.pth"
    assert sorted(p.name for p in folder.iterdir()) == names


def test_in_place_a_file_of_the_converted_name_that_is_no_checkpoint_is_kept(hub, tmp_path):
    """A model.pth in the folder that torch.save did not write (a user's file of that name) is refused without
    --overwrite, unchanged; an earlier conversion is replaced (above)."""
    folder = shutil.copytree(hub, tmp_path / "folder")
    (folder / "model.pth").write_text("my notes")
    expect_error(["--checkpoint_dir", str(folder)], f"{folder / 'model.pth'} exists and is not a PyTorch checkpoint; "
                 "give --overwrite to replace it", main=convert_main)
    assert (folder / "model.pth").read_text() == "my notes"
    convert(folder, overwrite=True, **QUIET)
    assert torch.load(folder / "model.pth", weights_only=True)["tok_embeddings.weight"].ndim == 2
