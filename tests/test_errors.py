"""Every user mistake ends with one line, 'error: ...', and a non-zero exit: one fixture per mistake, across
generate.py, convert_hf_checkpoint.py, train_draft.py, bench.py and scripts/download.py."""
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import bench
import convert_hf_checkpoint
import generate
import train_draft
from conftest import ROOT, head_config, random_head_weights, write_eagle_head, write_tokenizer

sys.path.insert(0, str(ROOT / "scripts"))
import download  # noqa: E402


class Unpicklable:
    """Stands for code inside a pickle: weights_only loading must refuse it, never run it."""


def set_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (path / "config.json").write_text(json.dumps(config))


def questions(path, lines):
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def w(checkpoints, tmp_path_factory):
    """The good target and head, and copies of the target with one thing broken each."""
    good, _ = checkpoints("llama2")
    other, _ = checkpoints("llama31")
    root = tmp_path_factory.mktemp("mistakes")
    head = root / "head"
    write_eagle_head(head, random_head_weights(64, 4, 4, 96, 96), head_config(64, 4, 4, 96, 96))
    convert_hf_checkpoint.convert(head, log=lambda *_: None)
    (root / "headless").mkdir()
    shutil.copy(head / "draft.pth", root / "headless" / "draft.pth")

    def broken(name, edit):
        path = root / name
        shutil.copytree(good, path)
        edit(path)
        return path / "model.pth"
    ns = SimpleNamespace(good=good / "model.pth", other=other / "model.pth", head=head / "draft.pth",
                         headless=root / "headless" / "draft.pth", root=root)
    ns.no_key = broken("no_key", lambda p: set_config(p, hidden_size=None))
    ns.bad_type = broken("bad_type", lambda p: set_config(p, hidden_size="64"))
    ns.not_json = broken("not_json", lambda p: (p / "config.json").write_text("{'vocab_size': 96"))
    ns.truncated = broken("truncated", lambda p: (p / "model.pth").write_bytes((p / "model.pth").read_bytes()[:2000]))
    ns.garbage = broken("garbage", lambda p: (p / "model.pth").write_bytes(b"\x80\x02 not a checkpoint" * 50))
    ns.pickle = broken("pickle", lambda p: torch.save({"x": Unpicklable()}, p / "model.pth"))
    ns.shapes = broken("shapes", lambda p: set_config(p, intermediate_size=128))
    ns.bad_tok_json = broken("bad_tok_json", lambda p: (p / "tokenizer.json").write_text("{not json"))
    ns.bad_tok_model = broken("bad_tok_model", lambda p: ((p / "tokenizer.json").unlink(),
                                                          (p / "tokenizer.model").write_bytes(b"garbage" * 10)))
    ns.small_tok = broken("small_tok", lambda p: write_tokenizer(p, vocab_size=40))
    (root / "a_dir.json").mkdir()
    ns.data = questions(root / "q.jsonl", [json.dumps({"turns": ["w1 w2"], "reference": ["w3 w4"]})] * 4)
    ns.bad_data = questions(root / "bad.jsonl", ['{"turns": ["w1"]', '{"no": "turns"}'])
    ns.state = root / "state_of_other"  # a head being trained for another target
    train_draft.main(["--checkpoint_path", str(ns.other), "--data", str(ns.data), "--out_dir", str(ns.state),
                      "--steps", "1", "--batch_size", "2", "--seq_len", "16", "--device", "cpu"])
    (root / "bad_state").mkdir()
    (root / "bad_state" / "train_state.pt").write_bytes(b"not a checkpoint")
    return ns


def gen(w, *extra, ckpt="good"):
    return ["--checkpoint_path", str(getattr(w, ckpt)), "--device", "cpu", "--prompt", "w1 w2", *extra]


def train(w, *extra, out=None, data=None):
    return ["--checkpoint_path", str(w.good), "--data", str(data or w.data), "--out_dir", str(out or w.root / "new"),
            "--device", "cpu", "--steps", "1", "--seq_len", "16", *extra]


MISTAKES = {  # id: (tool, argv from the fixture, what the one line must say)
    "config missing a key": ("generate", lambda w: gen(w, ckpt="no_key"), "missing hidden_size"),
    "config wrong type": ("generate", lambda w: gen(w, ckpt="bad_type"), "hidden_size must be a positive integer"),
    "config not JSON": ("generate", lambda w: gen(w, ckpt="not_json"), "is not valid JSON"),
    "weights truncated": ("generate", lambda w: gen(w, ckpt="truncated"), "cannot read"),
    "weights garbage": ("generate", lambda w: gen(w, ckpt="garbage"), "cannot read"),
    "weights a pickle": ("generate", lambda w: gen(w, ckpt="pickle"), "never unpickled"),
    "weights of another shape": ("generate", lambda w: gen(w, ckpt="shapes"),
                                 "size mismatch for layers.0.feed_forward.w13.weight: copying a param with shape"),
    "tokenizer.json garbage": ("generate", lambda w: gen(w, ckpt="bad_tok_json"), "cannot read the tokenizer"),
    "tokenizer.model garbage": ("generate", lambda w: gen(w, ckpt="bad_tok_model"), "cannot read the tokenizer"),
    "tokenizer smaller than the model": ("generate", lambda w: gen(w, ckpt="small_tok"), "do not belong together"),
    "head without config.json": ("generate", lambda w: gen(w, "--draft_checkpoint_path", str(w.headless)),
                                 "no config.json"),
    "json_out in a missing folder": ("generate", lambda w: gen(w, "--json_out", str(w.root / "nope" / "o.json")),
                                     "does not exist"),
    "json_out a directory": ("generate", lambda w: gen(w, "--json_out", str(w.root / "a_dir.json")), "is a directory"),
    "json_out read-only": ("generate", lambda w: gen(w, "--json_out", "/proc/eaglet.json"), "cannot be written"),
    "max_new_tokens negative": ("generate", lambda w: gen(w, "--max_new_tokens", "-3"), "--max_new_tokens"),
    "max_new_tokens zero": ("generate", lambda w: gen(w, "--max_new_tokens", "0"), "--max_new_tokens"),
    "max_new_tokens huge": ("generate", lambda w: gen(w, "--max_new_tokens", "100000"),
                            "prompt (3 tokens) + max_new_tokens (100000) = 100003 exceeds the model's max_position"),
    "tree scratch named": ("generate", lambda w: gen(w, "--max_new_tokens", "500", "--draft_checkpoint_path", str(w.head)),
                           "+ tree scratch (60)"),
    "seed overflow": ("generate", lambda w: gen(w, "--seed", str(2 ** 64)), "--seed: must be between"),
    "seed non-ASCII digits": ("generate", lambda w: gen(w, "--seed", "\u0663"), "expected an integer"),
    "temperature nan": ("generate", lambda w: gen(w, "--temperature", "nan"), "finite"),
    "temperature inf": ("generate", lambda w: gen(w, "--temperature", "inf"), "finite"),
    "temperature negative": ("generate", lambda w: gen(w, "--temperature", "-1"), "--temperature"),
    "top_p zero": ("generate", lambda w: gen(w, "--top_p", "0"), "top_p"),
    "top_k negative": ("generate", lambda w: gen(w, "--top_k", "-2"), "--top_k"),
    "depth zero": ("generate", lambda w: gen(w, "--depth", "0"), "--depth"),
    "total_tokens superscript": ("generate", lambda w: gen(w, "--total_tokens", "\u00b2"), "--total_tokens"),
    "total_tokens too large": ("generate", lambda w: gen(w, "--total_tokens", "9999"), "total_tokens must be between"),
    "max_seq_length negative": ("generate", lambda w: gen(w, "--max_seq_length", "-1"), "--max_seq_length"),
    "num_samples zero": ("generate", lambda w: gen(w, "--num_samples", "0"), "--num_samples"),
    "prompt not UTF-8": ("generate", lambda w: gen(w, "--prompt", "w1 \udcff"), "not valid UTF-8"),
    "system without chat": ("generate", lambda w: gen(w, "--system", "be brief"), "--system needs --chat"),
    "demo with chat": ("generate", lambda w: ["--chat"], "no chat template"),
    "interactive with json_out": ("generate", lambda w: gen(w, "--interactive", "--json_out", str(w.root / "i.json")),
                                  "--json_out records one generation"),
    "interactive cache within the scratch": ("generate", lambda w: gen(w, "--interactive", "--max_seq_length", "64",
                                                                       "--draft_checkpoint_path", str(w.head)),
                                             "leaves no room for a conversation beside the tree scratch (60)"),
    "convert usage": ("convert", lambda w: [], "the following arguments are required: --checkpoint_dir"),
    "convert config not JSON": ("convert", lambda w: ["--checkpoint_dir", str(w.not_json.parent)], "not valid JSON"),
    "convert config wrong type": ("convert", lambda w: ["--checkpoint_dir", str(w.bad_type.parent)],
                                  "hidden_size must be a positive integer"),
    "out_dir is the target's folder": ("train", lambda w: train(w, out=w.good.parent), "already holds a checkpoint"),
    "out_dir holds another checkpoint": ("train", lambda w: train(w, out=w.no_key.parent), "would overwrite it"),
    "resume from another target": ("train", lambda w: train(w, out=w.state), "another target (n_local_heads 2 vs 4"),
    "resume from a corrupt state": ("train", lambda w: train(w, out=w.root / "bad_state"), "cannot resume"),
    "lr nan": ("train", lambda w: train(w, "--lr", "nan"), "finite"),
    "batch_size zero": ("train", lambda w: train(w, "--batch_size", "0"), "batch_size must be at least 1"),
    "seq_len beyond the model": ("train", lambda w: train(w, "--seq_len", "100000"), "seq_len (100000) exceeds"),
    "out_dir cannot be made": ("train", lambda w: train(w, out="/proc/eaglet/head"),
                               "cannot be made"),
    "lr so large training diverges": ("train", lambda w: train(w, "--lr", "1e30", "--steps", "5", "--batch_size", "2",
                                                               out=w.root / "diverged_lr"), "training diverged"),
    "noise so large training diverges": ("train", lambda w: train(w, "--noise", "1e308", "--batch_size", "2",
                                                                  out=w.root / "diverged_noise"), "training diverged"),
    "question file not JSON": ("train", lambda w: train(w, data=w.bad_data), "line 1 is not JSON"),
    "bench repeats zero": ("bench", lambda w: ["--model", "tiny", "--repeats", "0"], "--repeats"),
    "bench two models": ("bench", lambda w: ["--model", "tiny", "--checkpoint_path", str(w.good)], "exactly one"),
    "bench tree past the cache": ("bench", lambda w: ["--model", "tiny", "--depth", "300"], "+ tree scratch (3000) = 3192"),
    "bench cache beyond memory": ("bench", lambda w: ["--model", "tiny", "--max_seq_length", str(10 ** 11)],
                                  "does not fit in memory"),
    "bench results exist": ("bench", lambda w: ["--model", "tiny", "--out", str(w.root / "a_dir")], "a_dir.json exists"),
    "bench eval without room": ("bench", lambda w: ["--model", "tiny", "--eval", str(w.root), "--tokenizer",
                                                    str(w.good.parent), "--max_new_tokens", "2000"],
                                "max_new_tokens (2000) + tree scratch (60) leaves no room"),
    "unroll_steps past seq_len": ("train", lambda w: train(w, "--unroll_steps", "16"), "unroll_steps must be below seq_len"),
    "bench eval missing": ("bench", lambda w: ["--model", "tiny", "--eval", str(w.root / "nope")], "not a folder"),
    "bench eval without tokenizer": ("bench", lambda w: ["--model", "tiny", "--eval", str(w.root)], "--tokenizer"),
    "download bad repo id": ("download", lambda w: ["--repo_id", "../etc"], "org/name"),
}
MAINS = {"generate": generate.main, "convert": convert_hf_checkpoint.main, "train": train_draft.main,
         "bench": bench.main, "download": download.main}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistake_gives_one_error_line(w, mistake, capsys):
    tool, argv, match = MISTAKES[mistake]
    with pytest.raises(SystemExit) as e:
        MAINS[tool](argv(w))
    message = str(e.value.code)  # sys.exit(str) prints it to stderr and exits with status 1
    assert message.startswith("error: ") and "\n" not in message and match in message, message
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("tool, argv", [
    ("convert_hf_checkpoint.py", []),
    ("train_draft.py", ["--checkpoint_path", "x.pth", "--data", "d", "--out_dir", "o", "--batch_size", "-1"]),
    ("bench.py", ["--model", "tiny", "--depth", "1e3"]),
    ("scripts/download.py", ["--repo_id", "nope"]),
])
def test_real_process_prints_one_line_and_fails(tool, argv):
    proc = subprocess.run([sys.executable, str(ROOT / tool), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_outputs_are_not_clobbered(w):
    before = {f.name: f.read_bytes() for f in w.good.parent.iterdir() if f.is_file()}
    with pytest.raises(SystemExit):
        train_draft.main(train(w, out=w.good.parent))
    assert {f.name: f.read_bytes() for f in w.good.parent.iterdir() if f.is_file()} == before


def test_a_diverged_training_saves_nothing(w):
    with pytest.raises(SystemExit):
        train_draft.main(train(w, "--lr", "1e30", "--steps", "5", "--batch_size", "2", "--save_every", "1",
                               out=w.root / "diverged_saves"))
    saved = torch.load(w.root / "diverged_saves" / "train_state.pt", weights_only=True)
    assert saved["step"] >= 1 and all(torch.isfinite(t).all() for t in saved["head"].values())
    assert not (w.root / "diverged_saves" / "model.safetensors").exists()


@pytest.mark.parametrize("tool", ["generate.py", "bench.py", "train_draft.py", "convert_hf_checkpoint.py"])
def test_help_and_usage_mistakes_answer_before_torch_is_imported(tool):
    """--help lists every flag with its default without the seconds torch's import takes (-X importtime
    names every module a process imports)."""
    for argv, rc in ((["--help"], 0), (["--no_such_flag"], 1)):
        proc = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / tool), *argv], capture_output=True,
                              text=True, timeout=120)
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
        assert proc.returncode == rc and "torch" not in imported and "cli" in imported, proc.stderr[-500:]
    assert "usage:" in subprocess.run([sys.executable, str(ROOT / tool), "--help"], capture_output=True,
                                      text=True, timeout=120).stdout
