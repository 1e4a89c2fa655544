"""Long prompts: chunked prefill (the target's and every head's catch-up over a prompt) gives what one forward gives,
held to transformers, and never makes a tensor of prompt x cache size."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from measure import random_models
from batch import generate_batch
from decode import TreeConfig, catch_up_prompt, generate, prefill
from sampling import SamplingConfig
from load import load_target
from model import EagletError

GREEDY = SamplingConfig()


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any operation makes (views and in-place writes make none)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                    self.numel, self.op = t.numel(), f"{func} {tuple(t.shape)}"
        return out


@pytest.mark.parametrize("kind", ["llama31", "qwen3"])
def test_chunked_prefill_gives_transformers_logits_at_every_position(checkpoints, kind):
    """Chunks of 1, 7, 64 tokens and the whole prompt at once: the logits at every position equal transformers'
    (fp32), and the features of every chunking equal one forward's."""
    path, hf = checkpoints(kind)
    model = load_target(path / "model.pth", "cpu", "fp32", 400)
    tokens = torch.randint(4, 96, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(tokens).logits[0]
        runs = {chunk: prefill(model, tokens, 0, chunk) for chunk in (1, 7, 64, 300)}
    for chunk, (last, features) in runs.items():
        logits = model.logits(features)[0]  # the features are the final-normed hidden states
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4, msg=f"chunk {chunk}")
        torch.testing.assert_close(last[0], want[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(features, runs[300][1], atol=1e-5, rtol=1e-5)


def test_a_16k_prefill_allocates_nothing_of_prompt_times_cache_size():
    """A 16,000-token prompt on a small model, chunks of 256: no operation makes a tensor larger than a few
    chunk x cache elements (a one-shot prefill makes prompt x cache ones, which the same recorder sees)."""
    target, _ = random_models("tiny", "cpu", torch.float32, 16384)
    tokens = torch.randint(0, 1024, (1, 16000), generator=torch.Generator().manual_seed(0))
    chunk, cache = 256, target.max_seq_length
    with torch.no_grad(), LargestAllocation() as chunked:
        generate(target, tokens[0].tolist(), 1, GREEDY, prefill_chunk=chunk)
    assert chunked.numel <= target.args.n_head * chunk * cache, chunked.op
    with torch.no_grad(), LargestAllocation() as one_shot:
        prefill(target, tokens[:, :4000], 0, 4000)
    assert one_shot.numel >= 4000 * 4000, one_shot.op  # the recorder does see a prompt x prompt mask


@pytest.mark.parametrize("head", ["eagle", "dflash", "peagle", "xpress"])
def test_a_head_reads_a_prompt_in_chunks_as_in_one_call(head):
    """catch_up_prompt over a 300-token prompt in chunks of 7, 41 and 300 pairs: the same h_last and the same K/V in
    the head's cache; and generate() with any chunk decodes the same tokens as plain decoding."""
    target, draft = random_models("tiny", "cpu", torch.float32, 1024, head=head)
    prompt = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    root = torch.tensor(5)
    with torch.no_grad():
        _, features = prefill(target, torch.tensor([prompt]), 0)
        states = {}
        for chunk in (300, 41, 7):
            draft.kv_cache.kv.zero_()
            h_last = catch_up_prompt(target, draft, prompt, 0, features, root, chunk)
            states[chunk] = (h_last, draft.kv_cache.kv[:, :, :, :, :300].clone())
    for chunk in (41, 7):
        torch.testing.assert_close(states[chunk][0], states[300][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[chunk][1], states[300][1], atol=1e-5, rtol=1e-5)
    tree = TreeConfig(depth=3, topk=2, total_tokens=8) if head == "eagle" else TreeConfig(depth=3, topk=1, total_tokens=5)
    plain = generate(target, prompt, 12, GREEDY, prefill_chunk=300)
    for chunk in (64, 300):
        run = generate(target, prompt, 12, GREEDY, draft=draft, tree=tree, prefill_chunk=chunk)
        assert run.tokens == plain.tokens


class HostCopies(TorchDispatchMode):
    """Counts tensors made from host data (torch.tensor(...): aten.lift_fresh); on CUDA each such copy to the device
    waits for the work queued before it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


def test_a_chunked_prefill_copies_from_the_host_once_not_once_a_chunk():
    """The target's prefill and the head's read of the prompt, 300 tokens in chunks of 16: the values each chunk needs
    are made on the device, so on a GPU the host queues every chunk without waiting for the one before; the one copy
    is the head's pairs (the prompt's tokens)."""
    target, draft = random_models("tiny", "cpu", torch.float32, 512, head="eagle")
    tokens = torch.randint(0, 1024, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), HostCopies() as copies:
        _, features = prefill(target, tokens, 0, 16)
        catch_up_prompt(target, draft, tokens[0].tolist(), 0, features, tokens[0, -1], 16)
    assert copies.count == 1


@pytest.mark.parametrize("head", ["eagle", "peagle"])
def test_generate_reads_a_chunked_prompt_into_the_head_as_one_read(head):
    """generate() hands the head each chunk's pairs as it goes: the head's cache over the prompt is what one read of the
    whole prompt writes."""
    target, draft = random_models("tiny", "cpu", torch.float32, 512, head=head)
    prompt = torch.randint(0, 1024, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    tree = TreeConfig(depth=2, topk=1, total_tokens=3)
    caches = []
    for chunk in (200, 16):
        draft.kv_cache.kv.zero_()
        generate(target, prompt, 2, GREEDY, draft=draft, tree=tree, prefill_chunk=chunk)
        caches.append(draft.kv_cache.kv[..., :len(prompt) - 1, :].clone())
    torch.testing.assert_close(caches[1], caches[0], atol=1e-5, rtol=1e-5)


def test_batch_rows_prefilled_in_chunks_decode_as_each_alone():
    """generate_batch with chunks shorter than the prompts (whose ends fall in different chunks): each row decodes
    what it decodes alone, plain and with a head."""
    target, draft = random_models("tiny", "cpu", torch.float32, 512, head="eagle")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (70, 33, 130)]
    tree = TreeConfig(depth=2, topk=2, total_tokens=6)
    target.setup_caches(3, 512)
    draft.setup_caches(512, 3)
    for head in (None, draft):
        rows = generate_batch(target, prompts, 10, GREEDY, draft=head, tree=tree, prefill_chunk=32)
        target.setup_caches(1, 512)
        draft.setup_caches(512)
        alone = [generate(target, p, 10, GREEDY, draft=head, tree=tree) for p in prompts]
        target.setup_caches(3, 512)
        draft.setup_caches(512, 3)
        assert [r.tokens for r in rows] == [a.tokens for a in alone]


@pytest.mark.parametrize("chunk, match", [(0, "positive whole number"), (-3, "positive whole number"),
                                          (2.5, "positive whole number"), ("64", "positive whole number"),
                                          (True, "positive whole number"), (4096, "larger than the cache")])
def test_a_bad_prefill_chunk_is_one_error(chunk, match):
    target, _ = random_models("tiny", "cpu", torch.float32, 256)
    with pytest.raises(EagletError, match=match):
        generate(target, [1, 2, 3], 2, GREEDY, prefill_chunk=chunk)


def test_a_prompt_longer_than_the_cache_names_both_lengths():
    target, _ = random_models("tiny", "cpu", torch.float32, 256)
    with pytest.raises(EagletError, match=r"prompt \(300 tokens\).*exceeds the cache \(256 tokens\)"):
        generate(target, list(range(300)), 1, GREEDY)


def test_the_cli_chunks_windows_and_steps_aside_and_decodes_as_plain(spec_pair, tmp_path):
    """generate.py with --prefill_chunk, --draft_window and --step_aside (on and off): plain decoding's tokens; the
    record says how many tokens plain steps made."""
    from conftest import run_cli
    target, head = spec_pair
    base = ["--checkpoint_path", str(target / "model.pth"), "--device", "cpu", "--prompt", "w3 w4 w5 w6 " * 30,
            "--max_new_tokens", "40", "--prefill_chunk", "16"]
    plain = run_cli(tmp_path, base)
    for extra in (["--draft_window", "8", "--draft_sinks", "2"], ["--step_aside", "off"], ["--draft_window", "full"]):
        run = run_cli(tmp_path, base + ["--draft_checkpoint_path", str(head)] + extra)
        assert run["tokens"] == plain["tokens"], extra
        assert run["plain_tokens"] == 0 or extra[0] != "--step_aside"


@pytest.mark.parametrize("flags, match", [(["--prefill_chunk", "0"], "--prefill_chunk: must be at least 1"),
                                          (["--prefill_chunk", "x"], "--prefill_chunk: expected an integer"),
                                          (["--prefill_chunk", "5000"], "prefill chunk (5000 tokens) is larger than the cache"),
                                          (["--draft_window", "0"], "--draft_window: must be at least 1"),
                                          (["--draft_window", "wide"], "--draft_window: expected an integer"),
                                          (["--draft_window", "5000"], "draft window (5000 positions, and 4 sinks) is larger"),
                                          (["--draft_sinks", "-1"], "--draft_sinks: must be at least 0")])
def test_bad_chunk_and_window_flags_are_one_error_line(spec_pair, flags, match):
    from conftest import expect_error
    target, head = spec_pair
    expect_error(["--checkpoint_path", str(target / "model.pth"), "--draft_checkpoint_path", str(head), "--device",
                  "cpu", "--prompt", "w3 w4", "--max_new_tokens", "8", "--max_seq_length", "256"] + flags, match)


def test_the_help_names_the_defaults_the_code_uses():
    from decode import PREFILL_CHUNK
    from draft import DRAFT_SINKS
    from generate import model_flags
    from cli import cli_parser
    from lookup import NgramLookup
    text = " ".join(model_flags(cli_parser("")).format_help().split())
    assert f"default: {PREFILL_CHUNK}," in text and f"(default: {DRAFT_SINKS})" in text
    assert f"(default: {NgramLookup.topk} continuations of {NgramLookup.depth} tokens, at most " \
           f"{NgramLookup.total_tokens})" in text


@pytest.mark.slow  # transformers loads the real model; both sides read a 7,200-token prompt
def test_smollm2_prefilled_in_chunks_gives_transformers_logits_at_7200_tokens(tmp_path):
    """SmolLM2-135M-Instruct's first 6 layers (its own weights as transformers loads the GGUF file, fp32, saved and
    converted as a user converts a checkpoint), a 7,200-token prompt of real text (this repository's docs) in chunks
    of 512: the logits at every 400th position and the last equal transformers' up to fp32 rounding, and greedy decoding
    gives transformers' next tokens."""
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from conftest import assert_close_in_scale, smollm2_gguf
    from convert_hf_checkpoint import convert
    path = smollm2_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # a GGUF-loaded model will not save; its weights, in a plain one, do
    config["num_hidden_layers"] = 6
    hf = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config), dtype=torch.float32).eval()
    hf.load_state_dict(loaded.state_dict(), strict=False)
    hf.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    convert(tmp_path, log=lambda *_: None)
    root = Path(__file__).resolve().parents[1]
    text = "\n\n".join(p.read_text() for p in [root / "README.md"] + sorted((root / "docs").glob("*.md")))
    from tokenizer import Tokenizer
    ids = Tokenizer(tmp_path).encode(text)[:7200]
    assert len(ids) == 7200
    model = load_target(tmp_path / "model.pth", "cpu", "fp32", 7300)
    at = torch.tensor(list(range(0, 7200, 400)) + [7199])
    with torch.no_grad():
        out = hf.model(torch.tensor([ids]), use_cache=True)
        want = hf.lm_head(out.last_hidden_state[0, at])
        _, features = prefill(model, torch.tensor([ids]), 0, 512)
        got = model.logits(features[0, at])
        # fp32 sums over 7,200 positions in another order: 1.5e-4 measured on logits up to about 30 (one-shot alike)
        assert_close_in_scale(got, want, ulps=128)
        expected, past, token = [], out.past_key_values, int(want[-1].argmax())  # transformers' greedy steps
        for _ in range(6):
            expected.append(token)
            step = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, token = step.past_key_values, int(step.logits[0, -1].argmax())
    run = generate(model, ids, 6, GREEDY, start_pos=7199)  # the caches hold the prompt: only its last token again
    assert run.tokens == expected


@pytest.mark.parametrize("head", [None, "eagle", "dflash"])
def test_a_next_turn_reusing_the_cache_prefills_its_new_tokens_in_chunks(head):
    """A conversation's second turn (the cache holds the first; start_pos after it) prefilled in chunks of 8: the
    tokens a fresh generation over the whole conversation gives."""
    target, draft = random_models("tiny", "cpu", torch.float32, 1024, head=head or "eagle")
    draft = draft if head else None
    tree = TreeConfig(depth=3, topk=2, total_tokens=8) if head == "eagle" else TreeConfig(depth=3, topk=1, total_tokens=5)
    g = torch.Generator().manual_seed(3)
    first = torch.randint(0, 1024, (90,), generator=g).tolist()
    reply = generate(target, first, 20, GREEDY, draft=draft, tree=tree, prefill_chunk=8)
    turn = first + reply.tokens + torch.randint(0, 1024, (50,), generator=g).tolist()
    reused = generate(target, turn, 20, GREEDY, draft=draft, tree=tree, prefill_chunk=8,
                      start_pos=len(first) + len(reply.tokens) - reply.uncached)
    fresh = generate(target, turn, 20, GREEDY, prefill_chunk=512)
    assert reused.tokens == fresh.tokens
