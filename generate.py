"""Decode from a converted LLaMA-family checkpoint: plain (autoregressive) decoding.

    python generate.py --checkpoint_path checkpoints/meta-llama/Llama-2-7b-chat-hf/model.pth \\
        --prompt "Hello, my name is" --compile
"""
import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from model import EagletError, ModelArgs, Transformer, causal_mask
from tokenizer import Tokenizer

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter

    def __post_init__(self):
        if self.temperature < 0:
            raise EagletError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EagletError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EagletError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class GenerationResult:
    prompt_tokens: list
    tokens: list  # generated ids, prompt excluded
    seconds: float
    accept_lengths: list = field(default_factory=list)  # tokens emitted per cycle (speculative only)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.seconds, 1e-9)


def logits_to_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """The target distribution under temperature, top-k and top-p; the one place sampling is defined."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p  # keeps the token crossing top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(probs: Tensor) -> Tensor:
    # Exponential race instead of torch.multinomial: same distribution, no device-to-host sync.
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def sample(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    return sample_from_probs(logits_to_probs(logits, sampling))


def prefill(model: Transformer, tokens: Tensor, start_pos: int):
    """Write tokens [1, T] at positions start_pos.. into the cache; return (last logits, all features)."""
    input_pos = torch.arange(start_pos, start_pos + tokens.shape[1], device=tokens.device)
    mask = causal_mask(input_pos, model.max_seq_length)
    logits, hidden = model(tokens, input_pos, input_pos, mask, logits_idx=torch.tensor([-1], device=tokens.device))
    return logits[:, -1], hidden


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, sampling: SamplingConfig):
    """token [1, 1] at input_pos [1] -> the next token [1]. Shapes fixed: compiled once, replayed."""
    logits, _ = model(token, input_pos, input_pos, causal_mask(input_pos, model.max_seq_length))
    return sample(logits[:, -1], sampling)


def compile_decode(device: str):
    # CUDA graphs only make sense on CUDA; on CPU inductor alone still fuses the small ops.
    mode = "reduce-overhead" if device.startswith("cuda") else None
    return torch.compile(decode_one_token, mode=mode, fullgraph=True)


def device_sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: Transformer, prompt_tokens: list, max_new_tokens: int, sampling: SamplingConfig,
             eos_ids=(), start_pos: int = 0, on_tokens: Optional[Callable] = None,
             decode_fn: Callable = decode_one_token) -> GenerationResult:
    """Plain decoding. The cache must already hold prompt_tokens[:start_pos] (multi-turn chat reuse)."""
    check_fits(model, len(prompt_tokens), max_new_tokens)
    device = model.output.weight.device
    device_sync(device)
    t0 = time.perf_counter()
    new = torch.tensor([prompt_tokens[start_pos:]], dtype=torch.long, device=device)
    logits, _ = prefill(model, new, start_pos)
    token = sample(logits, sampling)
    input_pos = torch.tensor([len(prompt_tokens)], dtype=torch.long, device=device)
    tokens = []
    while True:
        tokens.append(token.item())
        if on_tokens:
            on_tokens(tokens[-1:])
        if tokens[-1] in eos_ids or len(tokens) == max_new_tokens:
            break
        token = decode_fn(model, token.view(1, 1), input_pos, sampling).clone()
        input_pos += 1
    device_sync(device)
    return GenerationResult(list(prompt_tokens), tokens, time.perf_counter() - t0)


def check_fits(model: Transformer, n_prompt: int, max_new_tokens: int, extra: int = 0):
    need = n_prompt + max_new_tokens + extra
    if n_prompt == 0:
        raise EagletError("the prompt is empty")
    if need > model.max_seq_length:
        raise EagletError(f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens})"
                          f"{f' + tree scratch ({extra})' if extra else ''} = {need} exceeds the cache "
                          f"({model.max_seq_length} tokens)")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read per forward (shared tensors, e.g. tied embeddings, counted once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def peak_memory_gb(device) -> float:
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise EagletError("--device cuda was asked for but no CUDA device is available")
    return name


def load_target(checkpoint_path, device: str, precision: str, max_seq_length: int) -> Transformer:
    model = Transformer.from_checkpoint(checkpoint_path, device=device, dtype=PRECISIONS[precision])
    with torch.device(device):
        model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)
    return model


class TextStreamer:
    """Prints text as tokens arrive. Decodes the whole reply after the prompt's last token, so that word
    boundaries (sentencepiece's leading spaces) and multi-token characters come out right."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: list, enabled: bool = True):
        self.tokenizer, self.enabled = tokenizer, enabled
        self.tokens = [t for t in prompt_tokens[-1:] if t not in tokenizer.eos_ids]
        self.skip = len(tokenizer.decode(self.tokens))
        self.printed = 0

    def __call__(self, new_tokens: list):
        self.tokens.extend(t for t in new_tokens if t not in self.tokenizer.eos_ids)
        text = self.tokenizer.decode(self.tokens)[self.skip:]
        if self.enabled and not text.endswith("\ufffd"):
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)


def report(result: GenerationResult, model: Transformer, device: str):
    tps = result.tokens_per_s
    print(f"\n{len(result.tokens)} tokens in {result.seconds:.2f} s: {tps:.2f} tokens/s, "
          f"bandwidth {weight_bytes(model) * tps / 1e9:.2f} GB/s, peak memory {peak_memory_gb(device):.2f} GB")


def run_once(args, model, tokenizer, prompt, sampling, decode_fn):
    result = None
    for i in range(args.num_samples):
        torch.manual_seed(args.seed + i)
        streamer = TextStreamer(tokenizer, prompt)
        print(f"--- sample {i + 1}/{args.num_samples}" + (" (includes compilation)" if args.compile and i == 0 else ""))
        print(args.prompt, end="", flush=True)
        result = generate(model, prompt, args.max_new_tokens, sampling, tokenizer.eos_ids,
                          on_tokens=streamer, decode_fn=decode_fn)
        report(result, model, args.device)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "prompt_tokens": result.prompt_tokens, "tokens": result.tokens,
            "text": tokenizer.decode(result.tokens), "tokens_per_s": result.tokens_per_s}))


def run_interactive(args, model, tokenizer, sampling, decode_fn):
    """Multi-turn chat; the conversation's KV stays in the cache and only new tokens are prefilled."""
    messages, cached = [], []
    torch.manual_seed(args.seed)
    while True:
        try:
            user = input("\nUser: ")
        except EOFError:
            return
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.encode_chat(messages)
        start = 0
        while start < min(len(cached), len(prompt) - 1) and cached[start] == prompt[start]:
            start += 1
        print("Assistant: ", end="", flush=True)
        streamer = TextStreamer(tokenizer, prompt)
        try:
            result = generate(model, prompt, args.max_new_tokens, sampling, tokenizer.eos_ids, start_pos=start,
                              on_tokens=streamer, decode_fn=decode_fn)
        except EagletError as e:
            print(f"\nerror: {e}; start a new conversation")
            messages, cached = [], []
            continue
        report(result, model, args.device)
        cached = prompt + result.tokens[:-1]  # the last token was sampled but never fed back
        messages.append({"role": "assistant", "content": tokenizer.decode(result.tokens)})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: sys.exit(f"error: {message}")
    p.add_argument("--checkpoint_path", type=Path, required=True, help="model.pth written by convert_hf_checkpoint.py")
    p.add_argument("--prompt", default="Hello, my name is")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_samples", type=int, default=1, help="generate this many times (timing)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on CUDA)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--chat_template", default="auto", help="auto (the checkpoint's own), llama2 or vicuna")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat in the terminal")
    p.add_argument("--max_seq_length", type=int, default=None,
                   help="cache size; default: prompt + max_new_tokens, or 4096 with --interactive")
    p.add_argument("--json_out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.num_samples < 1:
        p.error("--max_new_tokens and --num_samples must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        args.device = pick_device(args.device)
        args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
        sampling = SamplingConfig(args.temperature, args.top_p, args.top_k)
        if not args.checkpoint_path.is_file():
            raise EagletError(f"checkpoint not found: {args.checkpoint_path}")
        tokenizer = Tokenizer(args.checkpoint_path.parent, args.chat_template)
        if args.interactive:
            prompt = None
            max_positions = ModelArgs.from_checkpoint_dir(args.checkpoint_path.parent).max_position_embeddings
            max_seq_length = args.max_seq_length or min(4096, max_positions)
        else:
            prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat \
                else tokenizer.encode(args.prompt)
            max_seq_length = args.max_seq_length or len(prompt) + args.max_new_tokens
        model = load_target(args.checkpoint_path, args.device, args.precision, max_seq_length)
        if tokenizer.vocab_size > model.args.vocab_size:
            raise EagletError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{model.args.vocab_size}: they do not belong together")
        decode_fn = compile_decode(args.device) if args.compile else decode_one_token
        if args.interactive:
            run_interactive(args, model, tokenizer, sampling, decode_fn)
        else:
            run_once(args, model, tokenizer, prompt, sampling, decode_fn)
    except EagletError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
