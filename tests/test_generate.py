"""Plain decoding through the CLI against transformers, and the errors a user can run into."""
import json
import subprocess
import sys

import pytest
import torch

import decode
import generate
from conftest import (ROOT, SHARED, expect_error, make_agreeing_pair, make_hf_checkpoint, read_generation,
                      scripted_input, tiny_config, write_tokenizer)
from convert_hf_checkpoint import convert
from convert_hf_checkpoint import main as convert_main

PROMPTS = ["w5 w17 w42", "w3", "w60 w61 w62 w63 w64 w65 w66"]


def run_cli(tmp_path, argv):
    out = tmp_path / "out.json"
    generate.main(argv + ["--json_out", str(out)])
    return read_generation(out)


@pytest.mark.parametrize("kind", ["llama2", "llama31", "qwen2", "llama_bias"])
def test_greedy_cli_matches_transformers_generate(checkpoints, tmp_path, kind):
    path, hf = checkpoints(kind)
    for prompt in PROMPTS:
        result = run_cli(tmp_path, ["--checkpoint_path", str(path / "model.pth"), "--prompt", prompt,
                                    "--max_new_tokens", "24", "--temperature", "0", "--device", "cpu"])
        ids = torch.tensor([result["prompt_tokens"]])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          eos_token_id=2, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert result["tokens"] == ref
        assert result["prompt_tokens"][0] == 1 and len(result["prompt_tokens"]) == len(prompt.split()) + 1


def test_chat_uses_the_checkpoint_template(checkpoints, tmp_path):
    path, _ = checkpoints("llama2")
    result = run_cli(tmp_path, ["--checkpoint_path", str(path / "model.pth"), "--prompt", "w7 w8", "--chat",
                                "--max_new_tokens", "3", "--device", "cpu"])
    tok = generate.Tokenizer(path)
    assert result["prompt_tokens"] == tok.encode_with_specials("<s>user: w7 w8 assistant:")


def test_sampling_is_seeded_and_respects_top_k(checkpoints, tmp_path):
    path, _ = checkpoints("llama2")
    argv = ["--checkpoint_path", str(path / "model.pth"), "--prompt", "w5", "--max_new_tokens", "16",
            "--temperature", "1.0", "--top_k", "1", "--seed", "3", "--device", "cpu"]
    greedy = run_cli(tmp_path, argv[:6] + ["--device", "cpu"])
    assert run_cli(tmp_path, argv)["tokens"] == greedy["tokens"]  # top_k 1 is greedy
    argv[argv.index("--top_k") + 1] = "0"
    assert run_cli(tmp_path, argv)["tokens"] == run_cli(tmp_path, argv)["tokens"]


def test_sampling_distribution_processing():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = decode.logits_to_probs(logits, generate.SamplingConfig(temperature=0.5, top_p=0.9))
    full = torch.softmax(logits / 0.5, -1)
    assert full[0, 0] < 0.9 < full[0, :2].sum()  # so top_p keeps exactly two tokens
    assert torch.allclose(probs, torch.cat([full[:, :2] / full[0, :2].sum(), torch.zeros(1, 2)], -1))
    probs = decode.logits_to_probs(logits, generate.SamplingConfig(temperature=1.0, top_k=3))
    assert probs[0, 3] == 0 and torch.allclose(probs[0, :3], torch.softmax(logits[0, :3], -1))


def test_interactive_keeps_the_conversation_in_the_cache(checkpoints, monkeypatch, capsys):
    path, _ = checkpoints("llama2")
    calls, results = [], []
    real_generate = generate.generate
    monkeypatch.setattr("builtins.input", scripted_input(["w5 w6", "w7"]))
    monkeypatch.setattr(generate, "generate",
                        lambda *a, **k: calls.append((a, k)) or results.append(real_generate(*a, **k)) or results[-1])
    generate.main(["--checkpoint_path", str(path / "model.pth"), "--interactive", "--max_new_tokens", "5",
                   "--device", "cpu", "--max_seq_length", "128"])
    assert len(calls) == 2
    first_prompt, second_prompt = calls[0][0][1], calls[1][0][1]
    first_reply = results[0].tokens
    # The cache holds the first prompt and the reply but its last token (sampled, never fed back); the
    # second turn's prompt repeats them, so only what follows is prefilled.
    reused = first_prompt + first_reply[:-1]
    assert second_prompt[:len(reused)] == reused and len(first_reply) > 1
    assert calls[1][1]["start_pos"] == len(reused)
    model = calls[1][0][0]  # a fresh prefill of the whole second prompt gives the same reply
    assert real_generate(model, second_prompt, 5, generate.SamplingConfig()).tokens == results[1].tokens
    assert "Assistant:" in capsys.readouterr().out


def test_generate_errors(checkpoints, tmp_path):
    path, _ = checkpoints("llama2")
    ckpt = ["--checkpoint_path", str(path / "model.pth"), "--device", "cpu"]
    expect_error(["--checkpoint_path", str(tmp_path / "nope/model.pth")], "checkpoint not found")
    expect_error(ckpt + ["--temperature", "-1"], "temperature")
    expect_error(ckpt + ["--top_p", "0"], "top_p")
    expect_error(ckpt + ["--top_p", "1.5"], "top_p")
    expect_error(ckpt + ["--top_k", "-2"], "top_k")
    expect_error(ckpt + ["--max_new_tokens", "0"], "max_new_tokens")
    expect_error(ckpt + ["--device", "tpu"], "invalid choice")
    expect_error(ckpt + ["--precision", "int3"], "invalid choice")
    expect_error(ckpt + ["--chat", "--chat_template", "nope"], "unknown chat template")
    expect_error(ckpt + ["--max_new_tokens", "600"], "max_position_embeddings")  # the model has 512
    expect_error(ckpt + ["--max_new_tokens", "50", "--max_seq_length", "20"], "exceeds --max_seq_length (20)")


def test_mistral_cache_longer_than_sliding_window_is_refused(checkpoints):
    path, _ = checkpoints("mistral")  # sliding_window 512, max_position_embeddings 512
    config = json.loads((path / "config.json").read_text())
    import model
    args = model.ModelArgs.from_hf_config({**config, "max_position_embeddings": 4096})
    with torch.device("meta"):
        with pytest.raises(model.EagletError, match="sliding window"):
            model.Transformer(args).setup_caches(1, 600)


def test_tokenizer_larger_than_model_is_refused(tmp_path):
    make_hf_checkpoint(tmp_path, "llama2")
    convert(tmp_path)
    write_tokenizer(tmp_path, vocab_size=200)
    expect_error(["--checkpoint_path", str(tmp_path / "model.pth"), "--device", "cpu"], "do not belong together")


def test_checkpoint_not_matching_config_is_refused(tmp_path):
    make_hf_checkpoint(tmp_path, "llama2")
    convert(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    expect_error(["--checkpoint_path", str(tmp_path / "model.pth"), "--device", "cpu"], "does not match")


def expect_convert_error(path, match):
    expect_error(["--checkpoint_dir", str(path)], match, main=convert_main)


def test_convert_errors(tmp_path):
    expect_convert_error(tmp_path / "missing", "not found")
    (tmp_path / "empty").mkdir()
    expect_convert_error(tmp_path / "empty", "no config.json")
    make_hf_checkpoint(tmp_path / "sharded", "llama2", max_shard_size="100KB")
    next((tmp_path / "sharded").glob("model-00002-*.safetensors")).unlink()
    expect_convert_error(tmp_path / "sharded", "missing")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    expect_convert_error(tmp_path / "gpt2", "supported model_type values: llama, mistral, qwen2, qwen3")
    (tmp_path / "yarn").mkdir()
    config = tiny_config("llama2").to_dict()
    config.pop("rope_parameters", None)
    (tmp_path / "yarn" / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    expect_convert_error(tmp_path / "yarn", "rope scaling type 'yarn' is not supported")
    make_hf_checkpoint(tmp_path / "noweights", "llama2")
    (tmp_path / "noweights" / "model.safetensors").unlink()
    expect_convert_error(tmp_path / "noweights", "no weights")


def test_cli_error_is_one_line_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--checkpoint_path", str(tmp_path / "x.pth")],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint not found: {tmp_path / 'x.pth'}")


@pytest.mark.skipif(not (SHARED / "data/tokenizers/llama2-tokenizer.model").exists(), reason="needs ../shared")
def test_sentencepiece_tokenizer_and_llama2_chat_format(tmp_path):
    import shutil
    shutil.copy(SHARED / "data/tokenizers/llama2-tokenizer.model", tmp_path / "tokenizer.model")
    tok = generate.Tokenizer(tmp_path)
    assert tok.vocab_size == 32000 and tok.eos_ids == {2}
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                           {"role": "user", "content": "Bye"}])
    # Meta's format: each turn encoded as "[INST] {user} [/INST] {answer} " between BOS and EOS.
    expected = [1] + tok.sp.encode("[INST] Hi [/INST] Hello! ") + [2, 1] + tok.sp.encode("[INST] Bye [/INST]")
    assert ids == expected
    assert tok.decode(tok.encode("The quick brown fox", bos=True)) == "The quick brown fox"


def test_streamer_waits_for_whole_multibyte_characters(tmp_path, capsys):
    """A byte-level BPE tokenizer splits 'é', '世' and '🙂' over several tokens: the streamer prints a character
    only once it is whole (never U+FFFD), and in the end exactly the decoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 bytes as printable characters
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"Ã©": 256, "Ġä": 257})  # é whole; a space and the first byte of 世
    tok = Tokenizer(models.BPE(vocab, [("Ã", "©"), ("Ġ", "ä")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = generate.Tokenizer(tmp_path)
    text = "Café 世界 🙂!"
    ids = tokenizer.encode(text, bos=False)
    assert 256 in ids and 257 in ids and tokenizer.decode(ids) == text
    assert sum("\ufffd" in tokenizer.decode([t]) for t in ids) == 10  # tokens holding part of a character
    streamer = generate.TextStreamer(tokenizer, ids[:1])  # the prompt's last token, "C"
    printed = ""
    for t in ids[1:]:
        streamer([t])
        printed += capsys.readouterr().out
        assert "\ufffd" not in printed
    streamer.flush()
    printed += capsys.readouterr().out
    assert "C" + printed == text


@pytest.fixture(scope="module")
def spec_pair(tmp_path_factory):
    target, head, _ = make_agreeing_pair(tmp_path_factory.mktemp("first_hour"), wrong_fraction=0.3, layer_scale=0.3)
    convert(target, log=lambda *_: None), convert(head, log=lambda *_: None)
    return target, head


def test_checkpoint_folders_are_accepted_and_hugging_face_files_refused(spec_pair, tmp_path):
    target, head = spec_pair
    base = ["--prompt", "w5 w6", "--max_new_tokens", "12", "--device", "cpu"]
    by_file = run_cli(tmp_path, ["--checkpoint_path", str(target / "model.pth"),
                                 "--draft_checkpoint_path", str(head / "draft.pth")] + base)
    by_folder = run_cli(tmp_path, ["--checkpoint_path", str(target), "--draft_checkpoint_path", str(head)] + base)
    assert by_folder["tokens"] == by_file["tokens"] and by_folder["cycles"] == by_file["cycles"] > 0
    expect_error(["--checkpoint_path", str(target / "model.safetensors")] + base,
                 f"is a Hugging Face weights file, not a converted model.pth: convert it first: python "
                 f"convert_hf_checkpoint.py --checkpoint_dir {target}")
    hf_only = tmp_path / "hf_only"
    hf_only.mkdir()
    for f in ("config.json", "model.safetensors"):
        (hf_only / f).write_bytes((target / f).read_bytes())
    expect_error(["--checkpoint_path", str(hf_only)] + base, f"{hf_only} holds Hugging Face weights")
    (hf_only / "model_int8.pth").write_bytes(b"")
    expect_error(["--checkpoint_path", str(hf_only)] + base, "no model.pth in")
    expect_error(["--checkpoint_path", str(hf_only)] + base, "it holds model_int8.pth: give the file itself")


def test_json_out_holds_every_sample_and_their_summary(spec_pair, tmp_path, capsys):
    target, head = spec_pair
    argv = ["--checkpoint_path", str(target), "--draft_checkpoint_path", str(head), "--prompt", "w5 w6",
            "--max_new_tokens", "16", "--device", "cpu", "--temperature", "8", "--seed", "4"]
    out = tmp_path / "three.json"
    generate.main(argv + ["--num_samples", "3", "--json_out", str(out)])
    written = json.loads(out.read_text())
    assert [s["seed"] for s in written["samples"]] == [4, 5, 6]
    for sample in written["samples"]:  # sample i is the run with seed + i
        alone = run_cli(tmp_path, argv[:-1] + [str(sample["seed"])])
        assert sample["tokens"] == alone["tokens"] and sample["accept_lengths"] == alone["accept_lengths"]
    assert len({tuple(s["tokens"]) for s in written["samples"]}) > 1  # the seeds differ, so do the samples
    speeds = [s["tokens_per_s"] for s in written["samples"]]
    lengths = [n for s in written["samples"] for n in s["accept_lengths"]]
    assert written["tokens_per_s_mean"] == pytest.approx(sum(speeds) / 3)
    assert written["tau"] == pytest.approx(sum(lengths) / len(lengths)) and written["cycles"] == len(lengths)
    assert f"3 samples: {written['tokens_per_s_mean']:.2f} tokens/s mean" in capsys.readouterr().out


@pytest.mark.parametrize("head", [False, True])
def test_stop_strings_cut_the_text_at_their_first_appearance(spec_pair, tmp_path, capsys, head):
    target, head_dir = spec_pair
    argv = ["--checkpoint_path", str(target), "--prompt", "w5 w6", "--max_new_tokens", "20", "--device", "cpu"]
    argv += ["--draft_checkpoint_path", str(head_dir)] if head else ["--no_draft"]
    full = run_cli(tmp_path, argv)
    tok = generate.Tokenizer(target)
    prefix = lambda n: tok.decode(full["prompt_tokens"][-1:] + full["tokens"][:n])  # noqa: E731
    for word in full["text"].split()[2:7]:  # words a few tokens in: with a head, some end inside a cycle
        stop = " " + word
        capsys.readouterr()
        cut = run_cli(tmp_path, argv + ["--stop", stop, "--stop", "no such text"])
        assert cut["text"] == full["text"][:full["text"].index(stop)]
        assert cut["tokens"] == full["tokens"][:len(cut["tokens"])]  # the same decoding, ended early
        assert stop in prefix(len(cut["tokens"])) and stop not in prefix(len(cut["tokens"]) - 1)  # the fewest
        printed = capsys.readouterr().out.split("--- sample 1/1\n")[1]
        assert printed.startswith("w5 w6" + cut["text"] + "\n") and stop not in printed.split("\n")[0]


def test_interactive_help_reset_and_ctrl_c(checkpoints, monkeypatch, capsys):
    path, _ = checkpoints("llama2")
    calls, results = [], []
    real_generate, real_call = generate.generate, generate.TextStreamer.__call__
    streamed = []

    def ctrl_c_in_the_second_reply(self, new_tokens):
        streamed.append(len(calls))
        if streamed.count(2) == 1 and len(calls) == 2:
            raise KeyboardInterrupt
        return real_call(self, new_tokens)
    monkeypatch.setattr(generate.TextStreamer, "__call__", ctrl_c_in_the_second_reply)
    monkeypatch.setattr("builtins.input", scripted_input(["w5 w6", "w7", "w9", "/help", "/reset", "w8", "/quit", "w1"]))
    monkeypatch.setattr(generate, "generate",
                        lambda *a, **k: calls.append((a, k)) or results.append(real_generate(*a, **k)) or results[-1])
    generate.main(["--checkpoint_path", str(path), "--interactive", "--max_new_tokens", "5", "--device", "cpu",
                   "--max_seq_length", "128"])
    out = capsys.readouterr().out
    assert len(calls) == 4 and len(results) == 3  # Ctrl-C stopped the second reply, not the session; /quit quit
    assert "(stopped)" in out and "/reset starts a new conversation" in out and "(a new conversation)" in out
    tok = generate.Tokenizer(path)
    first = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": tok.decode(results[0].tokens)}]
    third = tok.encode_chat(first + [{"role": "user", "content": "w7"}, {"role": "assistant", "content": ""},
                                     {"role": "user", "content": "w9"}])
    assert calls[1][1]["start_pos"] > 0  # the second turn reused the first one's cache
    assert calls[2][0][1] == third and calls[2][1]["start_pos"] == 0  # the cut reply kept; the cache not trusted
    assert calls[3][0][1] == tok.encode_chat([{"role": "user", "content": "w8"}])  # after /reset: w8 alone
    model = calls[2][0][0]
    for call, result in zip([calls[0]] + calls[2:], results):  # each reply equals a fresh run on its prompt
        assert real_generate(model, call[0][1], 5, generate.SamplingConfig()).tokens == result.tokens


def test_chat_template_file_and_its_variables(checkpoints, tmp_path):
    path, _ = checkpoints("llama2")
    template = tmp_path / "mine.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                        "{% if enable_thinking %}w9 {% endif %}assistant:")
    argv = ["--checkpoint_path", str(path), "--prompt", "w7", "--chat", "--chat_template", str(template),
            "--max_new_tokens", "2", "--device", "cpu"]
    tok = generate.Tokenizer(path)
    assert run_cli(tmp_path, argv)["prompt_tokens"] == tok.encode_with_specials("<s>user: w7 assistant:")
    thinking = run_cli(tmp_path, argv + ["--chat_template_kwargs", '{"enable_thinking": true}'])
    assert thinking["prompt_tokens"] == tok.encode_with_specials("<s>user: w7 w9 assistant:")
    expect_error(argv + ["--chat_template_kwargs", "[1]"], "must be a JSON object")
    expect_error(argv + ["--chat_template_kwargs", '{"messages": []}'], "set by eaglet itself")
    expect_error(argv[:6] + [str(tmp_path / "missing.jinja")], "chat template file not found")
    expect_error(argv[:4] + ["--chat_template_kwargs", "{}"], "--chat_template_kwargs needs --chat")


def test_generate_takes_one_prompt(checkpoints):
    path, _ = checkpoints("llama2")
    model = generate.load_target(path, "cpu", "fp32", 64)
    sampling = generate.SamplingConfig()
    as_list = generate.generate(model, [1, 5, 6], 4, sampling).tokens
    assert generate.generate(model, torch.tensor([[1, 5, 6]]), 4, sampling).tokens == as_list
    with pytest.raises(generate.EagletError, match="takes one prompt"):
        generate.generate(model, [[1, 5, 6], [1, 7, 8]], 4, sampling)


def test_a_too_small_cache_is_refused_before_the_prompt_is_echoed(checkpoints, capsys):
    path, _ = checkpoints("llama2")
    expect_error(["--checkpoint_path", str(path), "--prompt", "w5 w6", "--max_new_tokens", "50",
                  "--max_seq_length", "20", "--device", "cpu"], "exceeds --max_seq_length (20)")
    assert "w5 w6" not in capsys.readouterr().out


def test_a_head_trained_on_shorter_contexts_is_named_at_start_up(spec_pair, tmp_path, capsys):
    target, head = spec_pair
    short = tmp_path / "short_head"
    short.mkdir()
    config = json.loads((head / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    (short / "draft.pth").write_bytes((head / "draft.pth").read_bytes())
    argv = ["--checkpoint_path", str(target), "--prompt", "w5", "--max_new_tokens", "30", "--device", "cpu"]
    run_cli(tmp_path, argv + ["--draft_checkpoint_path", str(short)])
    out = capsys.readouterr().out
    assert "the head was trained on up to 40 positions" in out and out.count("trained on up to") == 1
    run_cli(tmp_path, argv + ["--draft_checkpoint_path", str(head)])
    assert "trained on up to" not in capsys.readouterr().out
