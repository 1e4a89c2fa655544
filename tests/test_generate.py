"""Plain decoding through the CLI against transformers, and the errors a user can run into."""
import json
import subprocess
import sys

import pytest
import torch

import decode
from checkpoint import EagletError
from decode import generate
from sampling import SamplingConfig, logits_to_probs
from load import load_target
from tokenizer import Tokenizer
from conftest import ROOT, SHARED, expect_error, make_hf_checkpoint, run_cli, tiny_config, write_tokenizer
from convert_hf_checkpoint import convert, main as convert_main

PROMPTS = ["w5 w17 w42", "w3", "w60 w61 w62 w63 w64 w65 w66"]


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
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.5, top_p=0.9))
    full = torch.softmax(logits / 0.5, -1)
    assert full[0, 0] < 0.9 < full[0, :2].sum()  # so top_p keeps exactly two tokens
    assert torch.allclose(probs, torch.cat([full[:, :2] / full[0, :2].sum(), torch.zeros(1, 2)], -1))
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=3))
    assert probs[0, 3] == 0 and torch.allclose(probs[0, :3], torch.softmax(logits[0, :3], -1))


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
    (tmp_path / "dynamic").mkdir()
    config = tiny_config("llama2").to_dict()
    config.pop("rope_parameters", None)
    (tmp_path / "dynamic" / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}))
    expect_convert_error(tmp_path / "dynamic", "rope scaling type 'dynamic' is not supported")
    make_hf_checkpoint(tmp_path / "noweights", "llama2")
    (tmp_path / "noweights" / "model.safetensors").unlink()
    expect_convert_error(tmp_path / "noweights", "no weights")
    make_hf_checkpoint(tmp_path / "vocab", "llama2")  # a config.json whose vocab_size is not the weights'
    config = json.loads((tmp_path / "vocab" / "config.json").read_text())
    (tmp_path / "vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] - 4}))
    expect_convert_error(tmp_path / "vocab", f"vocab_size {config['vocab_size'] - 4}, but the embeddings have "
                                             f"{config['vocab_size']} rows")
    assert not (tmp_path / "vocab" / "model.pth").exists()


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
    tok = Tokenizer(tmp_path)
    assert tok.vocab_size == 32000 and tok.eos_ids == {2}
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                           {"role": "user", "content": "Bye"}])
    # Meta's format: each turn encoded as "[INST] {user} [/INST] {answer} " between BOS and EOS.
    expected = [1] + tok.sp.encode("[INST] Hi [/INST] Hello! ") + [2, 1] + tok.sp.encode("[INST] Bye [/INST]")
    assert ids == expected
    assert tok.decode(tok.encode("The quick brown fox", bos=True)) == "The quick brown fox"


def test_checkpoint_folders_are_accepted_and_hugging_face_files_refused(spec_pair, tmp_path):
    target, head = spec_pair
    # cycles compared: every one of them, not where the clock says to step aside
    base = ["--prompt", "w5 w6", "--max_new_tokens", "12", "--device", "cpu", "--step_aside", "off"]
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
    (hf_only / "notes.pth").write_bytes(b"")
    expect_error(["--checkpoint_path", str(hf_only)] + base, "no model.pth in")
    expect_error(["--checkpoint_path", str(hf_only)] + base, "it holds notes.pth: give the file itself")


def test_a_folder_of_one_converted_checkpoint_is_that_file_and_of_several_refused(spec_pair, tmp_path):
    """A folder holding one target checkpoint, model.pth or a quantized file alone (what a GGUF file converts
    into), is taken as that file by every tool; a folder holding several is refused, naming them."""
    import shutil
    from quantize import quantize_checkpoint
    target, head = spec_pair
    folder = tmp_path / "target"
    shutil.copytree(target, folder)
    int8 = quantize_checkpoint(folder / "model.pth", "int8", log=lambda s: None)
    base = ["--prompt", "w5 w6", "--max_new_tokens", "12", "--device", "cpu", "--draft_checkpoint_path", str(head),
            "--step_aside", "off"]  # cycles compared: every one of them, not where the clock stepped aside
    expect_error(["--checkpoint_path", str(folder)] + base,
                 f"{folder} holds 2 checkpoints (model.pth, model_int8.pth): give the file itself")
    by_file = run_cli(tmp_path, ["--checkpoint_path", str(int8)] + base)
    (folder / "model.pth").unlink()
    by_folder = run_cli(tmp_path, ["--checkpoint_path", str(folder)] + base)
    assert by_folder["tokens"] == by_file["tokens"] and by_folder["cycles"] == by_file["cycles"] > 0
    import bench
    import quantize
    import train_draft
    for tool, argv in ((bench, ["--checkpoint_path", str(folder), "--draft_checkpoint_path", str(head)]),
                       (train_draft, ["--checkpoint_path", str(folder), "--data", str(folder / "config.json"),
                                      "--out_dir", str(tmp_path / "out")])):
        (folder / "model.pth").write_bytes(b"")  # a second checkpoint: the folder is refused before any work
        expect_error(argv, "holds 2 checkpoints (model.pth, model_int8.pth): give the file itself", tool.main)
    # quantize.py's input is the unquantized file, whatever it wrote beside it
    expect_error(["--checkpoint_path", str(folder), "--mode", "int8"],
                 f"{folder / 'model_int8.pth'} exists; give --overwrite to replace it", quantize.main)
    expect_error(["--checkpoint_path", str(folder), "--mode", "int4"], f"{folder / 'model.pth'} is empty", quantize.main)


def test_generate_takes_one_prompt(checkpoints):
    path, _ = checkpoints("llama2")
    model = load_target(path / "model.pth", "cpu", "fp32", 64)
    sampling = SamplingConfig()
    as_list = generate(model, [1, 5, 6], 4, sampling).tokens
    assert generate(model, torch.tensor([[1, 5, 6]]), 4, sampling).tokens == as_list
    with pytest.raises(EagletError, match="takes one prompt"):
        generate(model, [[1, 5, 6], [1, 7, 8]], 4, sampling)


def test_a_too_small_cache_is_refused_before_the_prompt_is_echoed(checkpoints, capsys):
    path, _ = checkpoints("llama2")
    expect_error(["--checkpoint_path", str(path / "model.pth"), "--prompt", "w5 w6", "--max_new_tokens", "50",
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


def test_ignore_eos_decodes_past_the_end_of_sequence(spec_pair, tmp_path):
    """A prompt whose greedy reply ends early (its end-of-sequence, id 2, reached): with --ignore_eos the reply runs to
    --max_new_tokens, the end-of-sequence kept inside it, and equals plain decoding without an end."""
    target, head = spec_pair
    model = load_target(target / "model.pth", "cpu", "fp32", 128)
    prompt = next(p for p in ([1, x] for x in range(4, 64)) if len(generate(model, p, 40, SamplingConfig(),
                                                                             eos_ids=(2,)).tokens) < 20)
    words = " ".join(f"w{t - 4}" for t in prompt[1:])
    base = ["--checkpoint_path", str(target), "--device", "cpu", "--prompt", words, "--max_new_tokens", "40"]
    assert len(run_cli(tmp_path, base)["tokens"]) < 20
    fixed = run_cli(tmp_path, base + ["--ignore_eos", "--draft_checkpoint_path", str(head)])
    assert fixed["tokens"] == generate(model, prompt, 40, SamplingConfig(), eos_ids=()).tokens and 2 in fixed["tokens"]
