"""The user's side (chat.py): chat templates, the streamer and stop strings, --json_out's samples, and the
interactive chat with its cache reuse, /help, /reset and Ctrl-C."""
import argparse
import json

import pytest

import chat
import generate
import decode
from sampling import SamplingConfig
from tokenizer import Tokenizer
from conftest import ROOT, expect_error, run_cli, scripted_input


def test_chat_uses_the_checkpoint_template(checkpoints, tmp_path):
    path, _ = checkpoints("llama2")
    result = run_cli(tmp_path, ["--checkpoint_path", str(path / "model.pth"), "--prompt", "w7 w8", "--chat",
                                "--max_new_tokens", "3", "--device", "cpu"])
    tok = Tokenizer(path)
    assert result["prompt_tokens"] == tok.encode_with_specials("<s>user: w7 w8 assistant:")


def test_interactive_keeps_the_conversation_in_the_cache(checkpoints, monkeypatch, capsys):
    path, _ = checkpoints("llama2")
    calls, results = [], []
    real_generate = decode.generate
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
    assert real_generate(model, second_prompt, 5, SamplingConfig()).tokens == results[1].tokens
    assert "Assistant:" in capsys.readouterr().out


def test_streamer_waits_for_whole_multibyte_characters(tmp_path, capsys):
    """A byte-level BPE tokenizer splits 'é', '世' and '🙂' over several tokens: the streamer prints a character
    only once it is whole (never U+FFFD), and in the end exactly the decoded text."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 bytes as printable characters
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"Ã©": 256, "Ġä": 257})  # é whole; a space and the first byte of 世
    tok = tokenizers.Tokenizer(models.BPE(vocab, [("Ã", "©"), ("Ġ", "ä")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    text = "Café 世界 🙂!"
    ids = tokenizer.encode(text, bos=False)
    assert 256 in ids and 257 in ids and tokenizer.decode(ids) == text
    assert sum("\ufffd" in tokenizer.decode([t]) for t in ids) == 10  # tokens holding part of a character
    streamer = chat.TextStreamer(tokenizer, ids[:1])  # the prompt's last token, "C"
    printed = ""
    for t in ids[1:]:
        streamer([t])
        printed += capsys.readouterr().out
        assert "\ufffd" not in printed
    streamer.flush()
    printed += capsys.readouterr().out
    assert "C" + printed == text


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
    tok = Tokenizer(target)
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
    real_generate, real_call = decode.generate, chat.TextStreamer.__call__
    streamed = []

    def ctrl_c_in_the_second_reply(self, new_tokens):
        streamed.append(len(calls))
        if streamed.count(2) == 1 and len(calls) == 2:
            raise KeyboardInterrupt
        return real_call(self, new_tokens)
    monkeypatch.setattr(chat.TextStreamer, "__call__", ctrl_c_in_the_second_reply)
    monkeypatch.setattr("builtins.input", scripted_input(["w5 w6", "w7", "w9", "/help", "/reset", "w8", "/quit", "w1"]))
    monkeypatch.setattr(generate, "generate",
                        lambda *a, **k: calls.append((a, k)) or results.append(real_generate(*a, **k)) or results[-1])
    generate.main(["--checkpoint_path", str(path), "--interactive", "--max_new_tokens", "5", "--device", "cpu",
                   "--max_seq_length", "128"])
    out = capsys.readouterr().out
    assert len(calls) == 4 and len(results) == 3  # Ctrl-C stopped the second reply, not the session; /quit quit
    assert "(stopped)" in out and "/reset starts a new conversation" in out and "(a new conversation)" in out
    tok = Tokenizer(path)
    first = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": tok.decode(results[0].tokens)}]
    third = tok.encode_chat(first + [{"role": "user", "content": "w7"}, {"role": "assistant", "content": ""},
                                     {"role": "user", "content": "w9"}])
    assert calls[1][1]["start_pos"] > 0  # the second turn reused the first one's cache
    assert calls[2][0][1] == third and calls[2][1]["start_pos"] == 0  # the cut reply kept; the cache not trusted
    assert calls[3][0][1] == tok.encode_chat([{"role": "user", "content": "w8"}])  # after /reset: w8 alone
    model = calls[2][0][0]
    for call, result in zip([calls[0]] + calls[2:], results):  # each reply equals a fresh run on its prompt
        assert real_generate(model, call[0][1], 5, SamplingConfig()).tokens == result.tokens


def test_chat_template_file_and_its_variables(checkpoints, tmp_path):
    path, _ = checkpoints("llama2")
    template = tmp_path / "mine.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                        "{% if enable_thinking %}w9 {% endif %}assistant:")
    argv = ["--checkpoint_path", str(path), "--prompt", "w7", "--chat", "--chat_template", str(template),
            "--max_new_tokens", "2", "--device", "cpu"]
    tok = Tokenizer(path)
    assert run_cli(tmp_path, argv)["prompt_tokens"] == tok.encode_with_specials("<s>user: w7 assistant:")
    thinking = run_cli(tmp_path, argv + ["--chat_template_kwargs", '{"enable_thinking": true}'])
    assert thinking["prompt_tokens"] == tok.encode_with_specials("<s>user: w7 w9 assistant:")
    expect_error(argv + ["--chat_template_kwargs", "[1]"], "must be a JSON object")
    expect_error(argv + ["--chat_template_kwargs", '{"messages": []}'], "set by eaglet itself")
    expect_error(argv[:6] + [str(tmp_path / "missing.jinja")], "chat template file not found")
    expect_error(argv[:4] + ["--chat_template_kwargs", "{}"], "--chat_template_kwargs needs --chat")


@pytest.mark.parametrize("device, precision, exact, speed_note, exact_note", [
    ("cpu", "fp32", False, True, "token for token"), ("cuda", "bf16", False, False, "near-ties"),
    ("cuda", "fp32", False, False, "token for token"), ("cuda", "bf16", True, False, "token for token (with --exact")])
def test_demo_note_says_only_what_holds_where_it_prints(capsys, device, precision, exact, speed_note, exact_note):
    args = argparse.Namespace(demo=True, draft_checkpoint_path="demo/head/draft.pth", device=device,
                              precision=precision, temperature=0.0, exact=exact)
    chat.demo_note(args)
    out = capsys.readouterr().out
    assert ("--no_draft is faster here" in out) == speed_note
    assert exact_note in out
    chat.demo_note(argparse.Namespace(**{**vars(args), "temperature": 1.0, "device": "cuda"}))
    assert capsys.readouterr().out == ""  # sampled text differs run to run anyway: no note


def test_the_python_apis_load_takes_a_string_as_one_prompt():
    """load(prompts="def f():") once made a prompt of each character (a string is a sequence of them)."""
    from load import load
    *_, prompts, rows = load(ROOT / "demo" / "target", draft_checkpoint_path=ROOT / "demo" / "head", device="cpu",
                             prompts="def f():", max_new_tokens=8)
    assert prompts == [Tokenizer(ROOT / "demo" / "target").encode("def f():")] and rows == 1
