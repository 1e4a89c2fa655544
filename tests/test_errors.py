"""Every user mistake ends with one line, 'error: ...', and a non-zero exit: one fixture per mistake, across
generate.py, convert_hf_checkpoint.py, train_draft.py, bench.py and scripts/download.py."""
import copy
import json
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import bench
import convert_hf_checkpoint
import generate
import train_draft
from conftest import (HANG_S, ROOT, eagle3_config, eagle3_head_weights, expect_error, head_config, random_head_weights,
                      write_eagle_head, write_tokenizer)
from model import QUANT_KEY

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


def damage_record(path):
    weights = torch.load(path / "model.pth", weights_only=True)
    torch.save({**weights, QUANT_KEY: {"mode": "int8"}}, path / "model.pth")  # no format_version


def copy_head(head, path, edit):
    shutil.copytree(head.parent, path)
    edit(path)
    return path / "draft.pth"


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
    ns.hf_file = good / "model.safetensors"
    # every .pth: model.pth, and those test_quantize.py may have written into the shared folder
    ns.hf_folder = broken("hf_folder", lambda p: [f.unlink() for f in p.glob("*.pth")]).parent
    ns.hf_head = root / "hf_head"
    write_eagle_head(ns.hf_head, random_head_weights(64, 4, 4, 96, 96), head_config(64, 4, 4, 96, 96))
    ns.not_object = broken("not_object", lambda p: (p / "config.json").write_text("[1, 2]"))
    ns.not_dict = broken("not_dict", lambda p: torch.save([torch.zeros(2)], p / "model.pth"))
    ns.int_norm = broken("int_norm", lambda p: torch.save({**torch.load(p / "model.pth", weights_only=True),
                                                           "norm.weight": torch.ones(64, dtype=torch.int32)}, p / "model.pth"))
    ns.eos = broken("eos", lambda p: set_config(p, eos_token_id=[2, 999999]))
    ns.nan = broken("nan", lambda p: with_weight(p / "model.pth", "layers.0.attention.wqkv.weight", float("nan")))
    ns.head_inf = copy_head(ns.head, root / "head_inf", lambda p: with_weight(p / "draft.pth", "fc.weight", float("inf")))
    ns.bad_record = broken("bad_record", damage_record)
    ns.head_not_object = copy_head(ns.head, root / "head_not_object",
                                   lambda p: (p / "config.json").write_text("[1, 2]"))
    ns.head_two_layers = copy_head(ns.head, root / "head_two_layers", lambda p: set_config(p, num_hidden_layers=2))
    (root / "a_dir.json").mkdir()
    (root / "kept.json").write_text('{"kept": true}')
    (root / "gguf").mkdir()
    (root / "gguf" / "model.Q4_0.gguf").write_bytes(b"GGUF")  # named, never read: refused before any reading
    ns.data = questions(root / "q.jsonl", [json.dumps({"turns": ["w1 w2"], "reference": ["w3 w4"]})] * 4)
    ns.bad_data = questions(root / "bad.jsonl", ['{"turns": ["w1"]', '{"no": "turns"}'])
    ns.state = root / "state_of_other"  # a head being trained for another target
    train_draft.main(["--checkpoint_path", str(ns.other), "--data", str(ns.data), "--out_dir", str(ns.state),
                      "--steps", "1", "--batch_size", "2", "--seq_len", "16", "--device", "cpu"])
    (root / "bad_state").mkdir()
    (root / "bad_state" / "train_state.pt").write_bytes(b"not a checkpoint")
    return ns


def with_weight(path, name, value):
    """The file's tensor name with one value set to value (a NaN or an inf)."""
    state = torch.load(path, weights_only=True)
    state[name].view(-1)[0] = value
    torch.save(state, path)


def gen(w, *extra, ckpt="good"):
    return ["--checkpoint_path", str(getattr(w, ckpt)), "--device", "cpu", "--prompt", "w1 w2", *extra]


def train(w, *extra, out=None, data=None):
    return ["--checkpoint_path", str(w.good), "--data", str(data or w.data), "--out_dir", str(out or w.root / "new"),
            "--device", "cpu", "--steps", "1", "--seq_len", "16", *extra]


MISTAKES = {  # id: (tool, argv from the fixture, what the one line must say)
    "config missing a key": ("generate", lambda w: gen(w, ckpt="no_key"), "missing hidden_size"),
    "config wrong type": ("generate", lambda w: gen(w, ckpt="bad_type"), "hidden_size must be a positive integer"),
    "config not JSON": ("generate", lambda w: gen(w, ckpt="not_json"), "is not valid JSON"),
    "config a JSON list": ("generate", lambda w: gen(w, ckpt="not_object"), "config.json is not a JSON object"),
    "head config a JSON list": ("generate", lambda w: gen(w, "--draft_checkpoint_path", str(w.head_not_object)),
                                "config.json is not a JSON object"),
    "head config with two layers": ("generate", lambda w: gen(w, "--draft_checkpoint_path", str(w.head_two_layers)),
                                    "is neither an EAGLE-1/2 nor an EAGLE-3 draft head"),
    "weights a list, not a state dict": ("generate", lambda w: gen(w, ckpt="not_dict"), "is not a state dict"),
    "quantization record damaged": ("generate", lambda w: gen(w, ckpt="bad_record"),
                                    "its quantization record is damaged"),
    "weights truncated": ("generate", lambda w: gen(w, ckpt="truncated"), "cannot read"),
    "weights of integers": ("generate", lambda w: gen(w, ckpt="int_norm"),
                            "norm.weight holds torch.int32 values where the model's weights are floating point"),
    "config eos past the tokenizer": ("generate", lambda w: gen(w, ckpt="eos"),
                                      "eos_token_id 999999 is not a token id of the tokenizer (96 tokens)"),
    "weights holding a NaN": ("generate", lambda w: gen(w, ckpt="nan"),
                              "layers.0.attention.wqkv.weight holds values that are not finite (NaN or inf)"),
    "head holding an inf": ("generate", lambda w: gen(w, "--draft_checkpoint_path", str(w.head_inf)),
                            "fc.weight holds values that are not finite"),
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
    "json_out exists": ("generate", lambda w: gen(w, "--json_out", str(w.root / "kept.json")),
                        "kept.json exists; give another path, or --overwrite"),
    "json_out read-only": ("generate", lambda w: gen(w, "--json_out", "/proc/eaglet.json"), "cannot be written"),
    "max_new_tokens negative": ("generate", lambda w: gen(w, "--max_new_tokens", "-3"), "--max_new_tokens"),
    "max_new_tokens zero": ("generate", lambda w: gen(w, "--max_new_tokens", "0"), "--max_new_tokens"),
    "max_new_tokens huge": ("generate", lambda w: gen(w, "--max_new_tokens", "100000"),
                            "prompt (3 tokens) + max_new_tokens (100000) = 100003 exceeds the model's max_position"),
    "tree scratch named": ("generate", lambda w: gen(w, "--max_new_tokens", "500", "--draft_checkpoint_path", str(w.head)),
                           "+ tree scratch (60)"),
    "seed overflow": ("generate", lambda w: gen(w, "--seed", str(2 ** 64)), "--seed: must be at most"),
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
    "checkpoint a Hugging Face file": ("generate", lambda w: gen(w, ckpt="hf_file"), "convert it first"),
    "checkpoint a Hugging Face folder": ("generate", lambda w: gen(w, ckpt="hf_folder"), "holds Hugging Face weights"),
    "checkpoint a GGUF file": ("generate", lambda w: ["--checkpoint_path", str(w.root / "gguf" / "model.Q4_0.gguf")],
                               "is a GGUF file, not a converted model.pth: convert it first"),
    "checkpoint a folder with a GGUF file": ("generate", lambda w: ["--checkpoint_path", str(w.root / "gguf")],
                                             "holds a GGUF file, not a converted model.pth: convert it first"),
    "head a Hugging Face folder": ("generate", lambda w: gen(w, "--draft_checkpoint_path", str(w.hf_head)),
                                   "holds Hugging Face weights, not a converted draft.pth"),
    "stop empty": ("generate", lambda w: gen(w, "--stop", ""), "--stop needs a non-empty text"),
    "chat_template_kwargs not JSON": ("generate", lambda w: gen(w, "--chat", "--chat_template_kwargs", "{x"),
                                      "is not valid JSON"),
    "chat_template file missing": ("generate", lambda w: gen(w, "--chat", "--chat_template", "no/such.jinja"),
                                   "chat template file not found"),
    "prompt not UTF-8": ("generate", lambda w: gen(w, "--prompt", "w1 \udcff"), "not valid UTF-8"),
    "system without chat": ("generate", lambda w: gen(w, "--system", "be brief"), "--system needs --chat"),
    "demo with chat": ("generate", lambda w: ["--chat"], "no chat template"),
    "interactive with json_out": ("generate", lambda w: gen(w, "--interactive", "--json_out", str(w.root / "i.json")),
                                  "--json_out records one generation"),
    "interactive cache within the scratch": ("generate", lambda w: ["--checkpoint_path", str(w.good), "--interactive",
                                                                    "--max_seq_length", "64", "--draft_checkpoint_path",
                                                                    str(w.head)],
                                             "leaves no room for a conversation beside the tree scratch (60)"),
    "convert usage": ("convert", lambda w: [], "the following arguments are required: --checkpoint_dir"),
    "convert config not JSON": ("convert", lambda w: ["--checkpoint_dir", str(w.not_json.parent)], "not valid JSON"),
    "convert config wrong type": ("convert", lambda w: ["--checkpoint_dir", str(w.bad_type.parent)],
                                  "hidden_size must be a positive integer"),
    "convert config a JSON list": ("convert", lambda w: ["--checkpoint_dir", str(w.not_object.parent)],
                                   "config.json is not a JSON object"),
    "convert head config a JSON list": ("convert", lambda w: ["--checkpoint_dir", str(w.head_not_object.parent)],
                                        "config.json is not a JSON object"),
    "out_dir is the target's folder": ("train", lambda w: train(w, out=w.good.parent), "already holds a checkpoint"),
    "out_dir holds another checkpoint": ("train", lambda w: train(w, out=w.no_key.parent), "would overwrite it"),
    "resume from another target": ("train", lambda w: train(w, out=w.state), "another target (n_local_heads 2 vs 4"),
    "resume from a corrupt state": ("train", lambda w: train(w, out=w.root / "bad_state"),
                                    "cannot resume: cannot read"),
    "feature layer twice": ("train", lambda w: train(w, "--head", "dflash", "--feature_layers", "1", "1"),
                            "--feature_layers names layer 1 twice"),
    "unknown chat template": ("train", lambda w: train(w, "--chat_template", "chatml"), "unknown chat template"),
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
    proc = subprocess.run([sys.executable, str(ROOT / tool), *argv], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("module, command", [("tune.py", "generate.py --tree auto"),
                                             ("chat.py", "generate.py --interactive"),
                                             ("convert_gguf.py", "convert_hf_checkpoint.py --checkpoint_dir FILE.gguf"),
                                             ("tp.py", "torchrun --standalone --nproc_per_node=N generate.py")])
def test_a_module_run_as_a_command_names_the_command_that_runs_it(module, command):
    """python tune.py (or chat.py, convert_gguf.py, tp.py) once printed nothing and exited 0, whatever its flags."""
    import runpy
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / module), run_name="__main__")
    assert e.value.code.startswith(f"error: {module} is a part of") and command in e.value.code


def test_outputs_are_not_clobbered(w):
    before = {f.name: f.read_bytes() for f in w.good.parent.iterdir() if f.is_file()}
    with pytest.raises(SystemExit):
        train_draft.main(train(w, out=w.good.parent))
    assert {f.name: f.read_bytes() for f in w.good.parent.iterdir() if f.is_file()} == before
    with pytest.raises(SystemExit):  # a file of the target's folder as --json_out
        generate.main(gen(w, "--max_new_tokens", "2", "--json_out", str(w.good.parent / "config.json")))
    assert {f.name: f.read_bytes() for f in w.good.parent.iterdir() if f.is_file()} == before


def test_a_state_that_does_not_fit_is_refused_before_self_distilling(w, tmp_path, capsys):
    """A train_state.pt of another target or another kind of head is refused before the target writes any reply
    (self-distillation is the long work); a folder made for a run that failed is removed, a corrupt state's error
    is one line of ours; --chat_template picks how conversations are written out."""
    with pytest.raises(SystemExit, match="another target"):
        train_draft.main(train(w, "--self_distill", "--max_new_tokens", "4", out=w.state))
    assert not list(w.state.glob("self_distill*"))
    eagle = tmp_path / "eagle"
    train_draft.main(train(w, "--batch_size", "2", "--chat_template", "vicuna", out=eagle))
    assert "chat template: built-in vicuna" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"another head \(head eagle vs dflash\)"):
        train_draft.main(train(w, "--self_distill", "--max_new_tokens", "4", "--head", "dflash", "--feature_layers",
                               "1", out=eagle))
    assert not list(eagle.glob("self_distill*"))
    with pytest.raises(SystemExit, match="seq_len"):
        train_draft.main(train(w, "--seq_len", "100000", out=tmp_path / "made" / "head"))
    assert (tmp_path / "made").is_dir() and not (tmp_path / "made" / "head").exists()
    with pytest.raises(SystemExit) as e:
        train_draft.main(train(w, out=w.root / "bad_state"))
    assert "weights_only" not in str(e.value.code) and "--no_resume starts over" in str(e.value.code)


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
                              text=True, timeout=HANG_S)
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
        assert proc.returncode == rc and "torch" not in imported and "cli" in imported, proc.stderr[-500:]
    assert "usage:" in subprocess.run([sys.executable, str(ROOT / tool), "--help"], capture_output=True,
                                      text=True, timeout=HANG_S).stdout


def test_help_shows_defaults_of_zero(capsys):
    """0 and 0.0 equal False: they must still be shown as defaults."""
    with pytest.raises(SystemExit):
        generate.parse_args(["--help"])
    flags = " ".join(capsys.readouterr().out.split()).split(" --")  # one entry per flag, line breaks undone
    help_of = {f.split()[0]: f for f in flags if f and f[0].isalpha()}
    for flag, default in (("temperature", "0.0"), ("top_k", "0"), ("seed", "0"), ("top_p", "1.0")):
        assert f"(default: {default})" in help_of[flag], help_of[flag]


BAD_VALUES = {  # id: (config.json changes, what the one line must say)
    "rms_norm_eps zero": ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive number, got 0"),
    "rms_norm_eps negative": ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a positive number, got -1e-06"),
    "rms_norm_eps NaN": ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive number, got nan"),
    "rms_norm_eps infinite": ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a positive number, got inf"),
    "rms_norm_eps a string": ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number, got '1e-6'"),
    "rope_theta zero": ({"rope_theta": 0}, "rope_theta must be a positive number, got 0"),
    "rope_theta negative": ({"rope_theta": -10000.0}, "rope_theta must be a positive number, got -10000.0"),
    "rope_theta NaN": ({"rope_theta": float("nan")}, "rope_theta must be a positive number, got nan"),
    "rope_theta infinite": ({"rope_theta": float("inf")}, "rope_theta must be a positive number, got inf"),
    "rope_theta a string": ({"rope_theta": "10000"}, "rope_theta must be a positive number, got '10000'"),
    "rope_theta a boolean": ({"rope_theta": True}, "rope_theta must be a positive number, got True"),
    # transformers >= 5 writes rope_theta inside rope_parameters
    "rope_parameters rope_theta zero": ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
                                        "rope_theta must be a positive number, got 0"),
    "rope_parameters rope_theta a string": ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
                                            "rope_theta must be a positive number, got '1e4'"),
    "rope_parameters a string": ({"rope_parameters": "default"},
                                 "config rope_parameters must be a JSON object, got 'default'"),
    "heads not a multiple of kv heads": ({"num_key_value_heads": 3},
                                         "num_attention_heads 4 must be a multiple of num_key_value_heads 3"),
    "hidden_size not a multiple of heads": ({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None},
                                            "and hidden_size 64 of num_attention_heads"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_config_value_is_refused_for_target_and_head(w, tmp_path, case):
    """checkpoint.check_config_values: generate and convert refuse the target's config.json, generate the head's."""
    changes, match = BAD_VALUES[case]
    shutil.copytree(w.good.parent, tmp_path / "target")
    set_config(tmp_path / "target", **changes)
    expect_error(["--checkpoint_path", str(tmp_path / "target" / "model.pth"), "--device", "cpu"], match)
    expect_error(["--checkpoint_dir", str(tmp_path / "target")], match, main=convert_hf_checkpoint.main)
    head = copy_head(w.head, tmp_path / "head", lambda p: set_config(p, **changes))
    expect_error(gen(w, "--draft_checkpoint_path", str(head)), match)


def edit_weights(change):
    """A folder edit that changes the tensors of its model.safetensors."""
    def edit(path):
        weights = load_file(str(path / "model.safetensors"))
        change(weights)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return edit


def add_layer_2(weights):  # the weights of a third layer, which the two-layer config does not have
    weights.update({k.replace(".layers.1.", ".layers.2."): v.clone() for k, v in weights.items() if ".layers.1." in k})


def index_not_json(path):
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')


TARGET_FOLDERS = {  # id: (edit of a Hugging Face target folder, what the one line must say)
    "a layer the config does not have": (edit_weights(add_layer_2),
                                         "unexpected weights model.layers.2.input_layernorm.weight, "
                                         "model.layers.2.mlp.down_proj.weight"),
    "a weight missing": (edit_weights(lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
                         "weight model.layers.1.mlp.up_proj.weight is missing"),
    "lm_head missing, embeddings untied": (edit_weights(lambda w: w.pop("lm_head.weight")),
                                           "lm_head.weight is missing and tie_word_embeddings is false"),
    "index not JSON": (index_not_json, "model.safetensors.index.json is not a valid index"),
    "shard not safetensors": (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 64), "cannot read"),
}


@pytest.mark.parametrize("case", list(TARGET_FOLDERS))
def test_target_folder_is_refused_and_nothing_written(w, tmp_path, case):
    """convert_hf_checkpoint.convert_target and weight_files: no weight is dropped or made up."""
    edit, match = TARGET_FOLDERS[case]
    shutil.copytree(w.good.parent, tmp_path / "target", ignore=shutil.ignore_patterns("model.pth"))
    edit(tmp_path / "target")
    expect_error(["--checkpoint_dir", str(tmp_path / "target")], match, main=convert_hf_checkpoint.main)
    assert not (tmp_path / "target" / "model.pth").exists()


def eagle(fc_bias=True, edit=None, **config):
    """An EAGLE-1/2 head for the llama2 target, as published: fc.bias and a copy of the embedding."""
    weights = random_head_weights(64, 4, 4, 96, 96, fc_bias=fc_bias)
    if edit:
        edit(weights)
    return weights, head_config(64, 4, 4, 96, 96, **config)


def eagle3(edit=None, hidden=64, vocab=96, **config):
    """An EAGLE-3 head with a 40-token draft vocabulary (d2t and t2d), for a target of hidden size 64."""
    weights = eagle3_head_weights(hidden, 4, 2, 96, 40, vocab, target_hidden=64)
    if edit:
        edit(weights)
    return weights, eagle3_config(hidden, 4, 2, 96, vocab, 40, **config)


def d2t_two_to_one(weights, keep_t2d=True):
    """Draft tokens 0 and 1 both propose the target token of draft token 0. t2d still marks 40 tokens, and every
    token d2t reaches is among them."""
    target_ids = torch.arange(40) + weights["d2t"]
    target_ids[1] = target_ids[0]
    weights["d2t"] = target_ids - torch.arange(40)
    if not keep_t2d:
        del weights["t2d"]


def add_second_layer(weights):
    weights.update({k.replace("layers.0.", "layers.1."): v for k, v in weights.items() if k.startswith("layers.0.")})


def set_embed(shape):
    return lambda weights: weights.update({"embed_tokens.weight": torch.zeros(shape)})


HEAD_FOLDERS = {  # id: (head weights and config.json, what the one line of convert_hf_checkpoint.py must say)
    "EAGLE head with two layers": (lambda: eagle(num_hidden_layers=2), "neither an EAGLE-1/2 nor an EAGLE-3"),
    "EAGLE-3 head with two layers": (lambda: eagle3(num_hidden_layers=2), "neither an EAGLE-1/2 nor an EAGLE-3"),
    "fc.bias present, bias false": (lambda: eagle(bias=False), "config.json says bias=False but fc.bias is present"),
    "fc.bias missing, bias true": (lambda: eagle(fc_bias=False, bias=True),
                                   "config.json says bias=True but fc.bias is missing"),
    "fc.bias missing, bias unset": (lambda: eagle(fc_bias=False), "config.json says bias=True but fc.bias is missing"),
    "EAGLE embed_tokens of another vocabulary": (lambda: eagle(edit=set_embed((90, 64))),
                                                 "embed_tokens (90, 64) does not match config.json"),
    "EAGLE weight missing": (lambda: eagle(edit=lambda w: w.pop("layers.0.mlp.up_proj.weight")),
                             "weight layers.0.mlp.up_proj.weight is missing"),
    "EAGLE weights of a second layer": (lambda: eagle(edit=add_second_layer),
                                        "unexpected weights layers.1.mlp.down_proj.weight"),
    "d2t two to one, with t2d": (lambda: eagle3(edit=d2t_two_to_one), "d2t maps two draft tokens to one target token"),
    "d2t two to one, without t2d": (lambda: eagle3(edit=lambda w: d2t_two_to_one(w, keep_t2d=False)),
                                    "d2t maps two draft tokens to one target token"),
    "no d2t for a smaller draft vocabulary": (lambda: eagle3(edit=lambda w: (w.pop("d2t"), w.pop("t2d"))),
                                              "no d2t to map its 40 draft tokens to target tokens"),
    "EAGLE-3 embed_tokens of another shape": (lambda: eagle3(hidden=32, target_hidden_size=64,
                                                             edit=set_embed((90, 32))),
                                              "embed_tokens (90, 32) does not match config.json"),
    "EAGLE-3 weight it does not have": (lambda: eagle3(edit=lambda w: w.update({"lm_head.bias": torch.zeros(40)})),
                                        "unexpected weights lm_head.bias"),
}


@pytest.mark.parametrize("case", list(HEAD_FOLDERS))
def test_head_folder_is_refused_and_nothing_written(tmp_path, case):
    """head_formats.head_kind and convert_hf_checkpoint.convert_head / convert_eagle3_head."""
    make, match = HEAD_FOLDERS[case]
    write_eagle_head(tmp_path / "head", *make())
    expect_error(["--checkpoint_dir", str(tmp_path / "head")], match, main=convert_hf_checkpoint.main)
    assert not (tmp_path / "head" / "draft.pth").exists()


def edit_d2t(change):
    """A folder edit that changes d2t in the converted draft.pth (one written by another tool, or damaged)."""
    def edit(path):
        weights = torch.load(path / "draft.pth", weights_only=True)
        torch.save({**weights, "d2t": change(weights["d2t"])}, path / "draft.pth")
    return edit


EAGLE3_AT_LOAD = {  # id: (the head, an edit of its folder after conversion, what the one line must say)
    "d2t two to one": (eagle3, edit_d2t(lambda d2t: torch.cat([d2t[:1], d2t[:1] - 1, d2t[2:]])),
                       "or maps two draft tokens to one"),
    "d2t shorter than lm_head": (eagle3, edit_d2t(lambda d2t: d2t[:-1]),
                                 "d2t has (39,) entries but lm_head has 40 rows"),
    "another vocabulary": (lambda: eagle3(vocab=80), None, "is for a vocabulary of 80, the target has 96"),
}


@pytest.mark.parametrize("case", list(EAGLE3_AT_LOAD))
def test_eagle3_head_is_checked_at_load(checkpoints, tmp_path, case):
    """head_formats.eagle3_from_state_dict: what conversion cannot see (the target), or a draft.pth changed since."""
    make, edit, match = EAGLE3_AT_LOAD[case]
    target, _ = checkpoints("llama8")
    write_eagle_head(tmp_path / "head", *make())
    convert_hf_checkpoint.convert(tmp_path / "head", log=lambda *_: None)
    if edit:
        edit(tmp_path / "head")
    expect_error(["--checkpoint_path", str(target / "model.pth"), "--device", "cpu", "--prompt", "w1 w2",
                  "--draft_checkpoint_path", str(tmp_path / "head" / "draft.pth")], match)


@pytest.mark.parametrize("key,bad", [("num_hidden_layers", 0), ("vocab_size", -3), ("num_key_value_heads", 0),
                                     ("hidden_size", 64.0), ("intermediate_size", "96")])
def test_config_sizes_must_be_positive_integers(key, bad):
    from model import EagletError, ModelArgs
    config = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, key: bad}
    with pytest.raises(EagletError, match=f"config {key} must be a positive integer, got {bad!r}"):
        ModelArgs.from_hf_config(config)


@pytest.mark.parametrize("extra,match", [
    ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new' is not supported"),
    ({"hidden_act": "foo"}, "hidden_act 'foo' is not supported"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false, got 'no'"),
    ({"attention_bias": 1}, "attention_bias must be true or false, got 1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
     "transformers would read rope_scaling alone, with rope_theta 10000.0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5},  # alike, but for rope_theta
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "keep one of them"),
])
def test_config_fields_read_otherwise_than_transformers_would_are_refused(extra, match):
    """Each of these was once read without a word: an activation never applied, a string taken as true (an untied
    lm_head dropped), a rope_scaling beside transformers 5's rope_parameters ignored (transformers reads it alone,
    rope_theta back at 10000: a model that is neither)."""
    from model import EagletError, ModelArgs
    config = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, **extra}
    with pytest.raises(EagletError, match=re.escape(match)):
        ModelArgs.from_hf_config(config)


def test_rope_settings_are_read_where_transformers_reads_them():
    """transformers' own reading of the config is the oracle: rope_parameters alone, rope_scaling alone, both alike."""
    from transformers import LlamaConfig
    from model import ModelArgs
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    base = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 256}
    for extra in ({"rope_parameters": {**yarn, "rope_theta": 5e5}}, {"rope_scaling": yarn, "rope_theta": 5e5},
                  {"rope_parameters": {**yarn, "rope_theta": 5e5}, "rope_scaling": yarn, "rope_theta": 5e5},
                  {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": None}):
        theirs = LlamaConfig.from_dict(copy.deepcopy({**base, **extra})).rope_parameters  # it edits what it is given
        ours = ModelArgs.from_hf_config(copy.deepcopy({**base, **extra}))
        assert ours.rope_base == theirs["rope_theta"] == 5e5, extra
        assert (ours.rope_scaling or {}).get("rope_type", "default") == theirs["rope_type"], extra
        assert (ours.rope_scaling or {}).get("factor") == theirs.get("factor"), extra


def test_the_python_apis_load_target_refuses_a_precision_or_device_it_cannot_give(monkeypatch):
    """Once a bare KeyError ('float16') and torch's 'Torch not compiled with CUDA enabled'."""
    from load import load_target
    from model import EagletError
    with pytest.raises(EagletError, match="precision 'float16': one of bf16, fp16, fp32"):
        load_target(ROOT / "demo" / "target", "cpu", "float16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EagletError, match="no CUDA device is available"):
        load_target(ROOT / "demo" / "target", "cuda", "fp32")
    assert load_target(ROOT / "demo" / "target", "auto", "fp32").output.weight.device.type == "cpu"


def test_sampling_settings_out_of_range_are_refused():
    """The CLI's flags refuse these before parsing ends; the Python API's SamplingConfig refuses them too."""
    from sampling import SamplingConfig
    from model import EagletError
    for bad, match in [(dict(temperature=-0.5), "temperature must be >= 0"), (dict(top_p=0.0), "top_p must be in"),
                       (dict(top_p=1.5), "top_p must be in"), (dict(top_k=-1), "top_k must be >= 0")]:
        with pytest.raises(EagletError, match=match):
            SamplingConfig(**bad)
