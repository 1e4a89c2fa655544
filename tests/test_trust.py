"""The issue's worst cases (a hang, a clobbered checkpoint, silent garbage, crashes on edge inputs) and the
reports (tau, bandwidth, the JSON text) telling the truth."""
import json
import math
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import generate
import decode
from quantize import weight_bytes
import train_draft
import train_data
from conftest import (HANG_S, ROOT, SHARED, head_config, make_agreeing_pair, make_hf_checkpoint, random_head_weights,
                      read_generation, scripted_input, tiny_config, write_eagle_head)
from convert_hf_checkpoint import convert
from decode import TreeConfig
from sampling import SamplingConfig
from load import load_draft, load_target
from model import EagletError
from tokenizer import Tokenizer

QUIET = {"log": lambda *_: None}


def bounded(fn, seconds=300):
    """Run fn in a thread; fail (instead of hanging the suite) if it has not returned after `seconds`."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a hang"
    return result.get("value")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and a head that agrees with it most of the time (long accepted paths), loaded."""
    target_dir, head_dir, _ = make_agreeing_pair(tmp_path_factory.mktemp("pair"), wrong_fraction=0.2)
    convert(target_dir, **QUIET), convert(head_dir, **QUIET)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 256)
    return target_dir, head_dir, model, load_draft(head_dir / "draft.pth", model)


def test_fewer_examples_than_batch_size_trains_instead_of_hanging(checkpoints, tmp_path, capsys):
    target, _ = checkpoints("llama2")
    data = tmp_path / "five.jsonl"
    data.write_text("\n".join(json.dumps({"turns": [f"w{i}"], "reference": [f"w{i + 1} w{i + 2}"]}) for i in range(5)))
    argv = ["--checkpoint_path", str(target / "model.pth"), "--data", str(data), "--out_dir", str(tmp_path / "h"),
            "--batch_size", "8", "--steps", "3", "--seq_len", "32", "--device", "cpu"]
    bounded(lambda: train_draft.main(argv))
    assert "each batch holds all of them" in capsys.readouterr().out
    assert (tmp_path / "h" / "model.safetensors").is_file()
    tokens, mask = bounded(lambda: next(train_data.batches([([1, 2, 3], [1, 1, 1])], 8, 4, 0, seed=0)))
    assert tokens.shape == (1, 4) and mask.sum() == 3


def test_out_dir_with_a_target_is_refused_and_left_alone(checkpoints, tmp_path):
    target, _ = checkpoints("llama2")
    victim = tmp_path / "victim"
    shutil.copytree(target, victim)
    before = {f.name: f.read_bytes() for f in victim.iterdir()}
    for out_dir in (victim, target):  # another model's folder, and the target's own
        with pytest.raises(SystemExit, match="already holds a checkpoint"):
            train_draft.main(["--checkpoint_path", str(target / "model.pth"), "--data", str(tmp_path / "x.txt"),
                              "--out_dir", str(out_dir), "--device", "cpu"])
    assert {f.name: f.read_bytes() for f in victim.iterdir()} == before


def test_non_finite_and_underflowing_temperatures(pair):
    *_, model, _ = pair
    for bad in (math.nan, math.inf):
        with pytest.raises(EagletError, match="finite"):
            SamplingConfig(temperature=bad)
        with pytest.raises(EagletError):
            SamplingConfig(top_p=bad)
    prompt = [1, 5, 9, 11]
    greedy = decode.generate(model, prompt, 12, SamplingConfig()).tokens
    assert len(set(greedy)) > 1
    for tiny in (1e-38, 1e-45, 5e-324):  # at and below float32's smallest normal, and the smallest double
        assert decode.generate(model, prompt, 12, SamplingConfig(temperature=tiny)).tokens == greedy


def test_one_token_prompt_speculative(pair, tmp_path):
    target_dir, head_dir, model, draft = pair
    plain = decode.generate(model, [1], 20, SamplingConfig())
    spec = decode.generate(model, [1], 20, SamplingConfig(), draft=draft)
    assert spec.tokens == plain.tokens and spec.accept_lengths
    out = tmp_path / "o.json"
    generate.main(["--checkpoint_path", str(target_dir / "model.pth"), "--draft_checkpoint_path",
                   str(head_dir / "draft.pth"), "--prompt", "", "--max_new_tokens", "8", "--device", "cpu",
                   "--json_out", str(out)])
    result = read_generation(out)
    assert result["prompt_tokens"] == [1] and len(result["tokens"]) == 8


def test_compile_with_few_new_tokens(pair, tmp_path, monkeypatch):
    """The warm-up asks for no more tokens than the run (compiling itself is tested in test_bench.py)."""
    target_dir, head_dir, *_ = pair
    compiled = []
    monkeypatch.setattr(generate, "compile_step", lambda fn, device: compiled.append(fn) or fn)
    for head in ([], ["--draft_checkpoint_path", str(head_dir / "draft.pth")]):
        for n in ("1", "3"):
            out = tmp_path / "o.json"
            generate.main(["--checkpoint_path", str(target_dir / "model.pth"), "--prompt", "w1 w2", "--compile",
                           "--max_new_tokens", n, "--device", "cpu", "--json_out", str(out), "--overwrite", *head])
            assert len(read_generation(out)["tokens"]) == int(n)
    assert len(compiled) == 6  # the step, and with the head the cycle and the plain step it may step aside to


def test_max_new_tokens_zero_returns_nothing(pair):
    *_, model, draft = pair
    for d in (None, draft):
        result = bounded(lambda: decode.generate(model, [1, 5], 0, SamplingConfig(), draft=d))
        assert result.tokens == [] and result.accept_lengths == []
    with pytest.raises(EagletError, match="max_new_tokens"):
        decode.generate(model, [1, 5], -1, SamplingConfig())


def test_tokenizer_smaller_than_the_model(tmp_path):
    make_hf_checkpoint(tmp_path, "llama2")
    convert(tmp_path, **QUIET)
    from conftest import write_tokenizer
    write_tokenizer(tmp_path, vocab_size=40)
    tokenizer = Tokenizer(tmp_path)
    with pytest.raises(EagletError, match="token id 50 is beyond the tokenizer's 40 tokens"):
        tokenizer.decode([5, 50])
    with pytest.raises(SystemExit, match="tokenizer has 40 tokens but the model 96"):
        generate.main(["--checkpoint_path", str(tmp_path / "model.pth"), "--device", "cpu", "--prompt", "w1"])


def test_legacy_format_bin_converts(tmp_path):
    from safetensors.torch import load_file
    make_hf_checkpoint(tmp_path / "new", "llama2")
    convert(tmp_path / "new", **QUIET)
    (tmp_path / "old").mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "new" / f, tmp_path / "old" / f)
    weights = load_file(str(tmp_path / "new" / "model.safetensors"))
    torch.save(weights, tmp_path / "old" / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    convert(tmp_path / "old", **QUIET)
    new, old = (torch.load(tmp_path / d / "model.pth", weights_only=True) for d in ("new", "old"))
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)


def test_no_draft_wins_over_a_draft_path(pair, tmp_path):
    target_dir, head_dir, *_ = pair
    out = tmp_path / "o.json"
    argv = ["--checkpoint_path", str(target_dir / "model.pth"), "--draft_checkpoint_path", str(head_dir / "draft.pth"),
            "--prompt", "w1", "--max_new_tokens", "12", "--device", "cpu", "--json_out", str(out)]
    generate.main(argv)
    assert read_generation(out)["cycles"] > 0
    generate.main(argv + ["--no_draft", "--overwrite"])
    assert read_generation(out)["cycles"] == 0


MULTI_TURN = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
              "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_template_jinja_is_read_and_named(checkpoints, tmp_path, capsys):
    source, _ = checkpoints("llama2")
    shutil.copytree(source, tmp_path / "m")
    path = tmp_path / "m"
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(path).chat_template_source.startswith("built-in llama2")  # said, not silent
    (path / "chat_template.jinja").write_text(MULTI_TURN)
    tok = Tokenizer(path)
    assert tok.chat_template_source == str(path / "chat_template.jinja")
    messages = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"},
                {"role": "assistant", "content": "w3"}, {"role": "user", "content": "w4"}]
    assert tok.encode_chat(messages) == tok.encode_with_specials(
        "<|system|>w1<|user|>w2<|assistant|>w3</s><|user|>w4<|assistant|>")
    out = tmp_path / "o.json"
    generate.main(["--checkpoint_path", str(path / "model.pth"), "--chat", "--system", "w1", "--prompt", "w2",
                   "--max_new_tokens", "2", "--device", "cpu", "--json_out", str(out)])
    assert f"chat template: {path / 'chat_template.jinja'}" in capsys.readouterr().out
    assert read_generation(out)["prompt_tokens"] == tok.encode_with_specials("<|system|>w1<|user|>w2<|assistant|>")


def test_tau_counts_emitted_tokens(pair):
    """A cycle cut by max_new_tokens counts the tokens it emitted, not those it accepted: each shorter run's
    cycles are a longer run's, the last one cut where the token count ends."""
    *_, model, draft = pair
    full = decode.generate(model, [1, 5, 9], 60, SamplingConfig(), draft=draft)
    cut_inside_a_cycle = 0
    for n in (5, 9, 23):
        result = decode.generate(model, [1, 5, 9], n, SamplingConfig(), draft=draft)
        expected, left = [], n - 1  # the first token comes from the prefill
        for length in full.accept_lengths:
            if left == 0:
                break
            expected.append(min(length, left))
            left -= expected[-1]
        assert result.tokens == full.tokens[:n] and result.accept_lengths == expected
        cut_inside_a_cycle += expected[-1] < full.accept_lengths[len(expected) - 1]
    assert cut_inside_a_cycle and max(full.accept_lengths) > 1


def test_weights_read_counts_one_embedding_row_and_draft_passes(pair):
    *_, model, draft = pair
    params = {p.data_ptr(): p for p in model.parameters()}
    embed = model.tok_embeddings.weight
    expected = sum(p.numel() for p in params.values()) - embed.numel() + embed.shape[1]
    assert weight_bytes(model) == 4 * expected  # fp32, untied: one row of the table per token
    tree = TreeConfig(depth=3, topk=4, total_tokens=16)
    draft_bytes = 4 * sum(p.numel() for p in draft.parameters())
    assert generate.cycle_weight_bytes(model, draft, tree) == 4 * expected + 4 * (draft_bytes + 4 * model.output.weight.numel())


@pytest.mark.skipif(not (SHARED / "data/tokenizers/llama2-tokenizer.model").exists(), reason="needs ../shared")
def test_json_text_is_what_was_streamed_with_sentencepiece(tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    config = tiny_config("llama2")
    config.vocab_size = 32000
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    shutil.copy(SHARED / "data/tokenizers/llama2-tokenizer.model", tmp_path / "tokenizer.model")
    convert(tmp_path, **QUIET)
    out = tmp_path / "o.json"
    generate.main(["--checkpoint_path", str(tmp_path / "model.pth"), "--prompt", "Hello", "--max_new_tokens", "12",
                   "--device", "cpu", "--json_out", str(out), "--temperature", "1"])
    text = read_generation(out)["text"]
    printed = capsys.readouterr().out.split("--- sample 1/1\n")[1]
    assert printed.startswith("Hello" + text + "\n")


def test_interactive_quits_quietly_and_answers_a_turn_too_long_for_the_history(checkpoints, monkeypatch, capsys):
    path, _ = checkpoints("llama2")
    long_turn = " ".join(f"w{i % 90}" for i in range(40))

    def turns():
        yield from ["w1 w2", long_turn]
        raise KeyboardInterrupt
    lines = turns()
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    generate.main(["--checkpoint_path", str(path / "model.pth"), "--interactive", "--max_new_tokens", "20",
                   "--device", "cpu", "--max_seq_length", "64"])  # returns: no SystemExit, no traceback
    out = capsys.readouterr().out
    assert "/quit, Ctrl-D or Ctrl-C quits" in out and out.count("Assistant:") == 2
    assert "starting a new one with this message" in out
    monkeypatch.setattr("builtins.input", scripted_input([" ".join(["w1"] * 80), "w1 \udcff w2", "w3"]))
    generate.main(["--checkpoint_path", str(path / "model.pth"), "--interactive", "--device", "cpu",
                   "--max_seq_length", "64", "--max_new_tokens", "4"])
    out = capsys.readouterr().out  # the long turn refused with its parts, the undecodable line asked again
    assert "prompt of 83 tokens; with the tree scratch (0) the cache (64 slots) has no room" in out
    assert "not valid UTF-8; type it again" in out and out.count("Assistant:") == 1


def test_head_without_matching_shapes_keeps_the_detail(checkpoints, tmp_path):
    target, _ = checkpoints("llama2")
    weights = random_head_weights(64, 4, 4, 96, 96)
    weights["layers.0.mlp.down_proj.weight"] = torch.zeros(64, 80)
    write_eagle_head(tmp_path / "h", weights, head_config(64, 4, 4, 96, 96))
    convert(tmp_path / "h", **QUIET)
    model = load_target(target / "model.pth", "cpu", "fp32", 64)
    with pytest.raises(EagletError, match=r"size mismatch for layer.feed_forward.w2.weight.*\[64, 80\]"):
        load_draft(tmp_path / "h" / "draft.pth", model)


MEASURE_CONVERT = """
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from convert_hf_checkpoint import convert

def anon_kb():  # memory the process owns (mapped files, which the kernel can drop, are not counted)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))

base, peak, done = anon_kb(), [0], []
def watch():
    while not done:
        peak[0] = max(peak[0], anon_kb())
        time.sleep(0.002)
thread = threading.Thread(target=watch)
thread.start()
convert(sys.argv[2])
done.append(1)
thread.join()
print("peak_kb", peak[0] - base)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_conversion_shows_progress_and_holds_about_one_layer(tmp_path):
    """A 4-shard, 8-layer checkpoint of 138 MB: progress per shard and per layer, and the converter's own
    memory stays far below the model's size (a converter that loads everything needs all of it)."""
    from safetensors.torch import save_file
    hidden, inter, layers, vocab = 512, 2048, 8, 1000
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "vocab_size": vocab,
         "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 8,
         "num_key_value_heads": 8, "max_position_embeddings": 512, "rms_norm_eps": 1e-5}))
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
              "self_attn.v_proj": (hidden, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    weight_map = {}
    for s in range(4):
        shard = {f"model.layers.{i}.{n}.weight": torch.randn(shape) for i in (2 * s, 2 * s + 1) for n, shape in shapes.items()}
        shard.update({f"model.layers.{i}.{n}.weight": torch.rand(hidden) for i in (2 * s, 2 * s + 1)
                      for n in ("input_layernorm", "post_attention_layernorm")})
        if s == 3:
            shard.update({"model.embed_tokens.weight": torch.randn(vocab, hidden), "model.norm.weight": torch.rand(hidden),
                          "lm_head.weight": torch.randn(vocab, hidden)})
        name = f"model-{s + 1:05d}-of-00004.safetensors"
        save_file(shard, str(tmp_path / name))
        weight_map.update({k: name for k in shard})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    total_kb = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) / 1024

    proc = subprocess.run([sys.executable, "-c", MEASURE_CONVERT, str(ROOT), str(tmp_path)], capture_output=True,
                          text=True, timeout=HANG_S)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert [l for l in lines if l.startswith("reading shard")] == [
        f"reading shard {s}/4: model-{s:05d}-of-00004.safetensors" for s in range(1, 5)]
    progress = [l for l in lines if l.startswith("converting ")]  # a line per layer (each is 1/8 of the work)
    assert [l.split(" (")[0] for l in progress] == [f"converting {i}/8 layers" for i in range(1, 9)]
    assert all("ETA" in l for l in progress[:-1]) and "ETA" not in progress[-1] and "/s" in progress[-1]
    peak_kb = int(lines[-1].split()[1])
    assert peak_kb < 0.5 * total_kb, (peak_kb, total_kb)
    from safetensors.torch import load_file
    converted = torch.load(tmp_path / "model.pth", weights_only=True)
    layer5 = load_file(str(tmp_path / "model-00003-of-00004.safetensors"))
    assert torch.equal(converted["layers.5.attention.wqkv.weight"], torch.cat(
        [layer5[f"model.layers.5.self_attn.{p}_proj.weight"] for p in "qkv"]))


@pytest.mark.slow
def test_make_demo_never_overwrites_a_demo(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "model.pth").write_bytes(b"a demo that must stay")
    for argv, says in ((["--out_dir", str(tmp_path)], "already holds a demo; --overwrite replaces it"),
                       (["--out_dir", str(tmp_path / "empty"), "--only_head3"], "--only_head3 needs a demo"),
                       (["--out_dir", "/proc/eaglet_demo/x"], "error: /proc/eaglet_demo")):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo.py"), *argv], capture_output=True,
                              text=True, timeout=HANG_S)
        assert proc.returncode == 1 and proc.stderr.startswith("error: ") and says in proc.stderr, proc.stderr
        assert len(proc.stderr.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["model.pth", "target"]
    assert (tmp_path / "target" / "model.pth").read_bytes() == b"a demo that must stay"
