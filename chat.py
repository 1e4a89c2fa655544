"""The user's side of a run: the streamer that prints text as tokens arrive and ends a reply at a stop string,
prompts through the chat template, the interactive chat, and what a run of one prompt or of several prints and
writes (--json_out).

Imports decode.py (GenerationResult), checkpoint.py, tokenizer.py and cli.py. The generation comes in as a function
(gen, gen_batch: generate.py's main binds generate() to the loaded model and flags), so nothing here imports
generate.py, which imports this file.
"""
import json
import time
from argparse import ArgumentTypeError
from pathlib import Path
from typing import Callable, Optional

import torch

from cli import torchrun_rank, utf8_text
from decode import GenerationResult
from checkpoint import EagletError
from tokenizer import Tokenizer


class TextStreamer:
    """Prints text as tokens arrive. Decodes the whole reply after the prompt's last token, so that word
    boundaries (sentencepiece's leading spaces) and multi-token characters come out right. `text` is the
    whole continuation: the prompt's text followed by it is what was printed. With stop strings, the text
    ends before the first one, and a call returns how many of its new tokens to keep (generate() stops)."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: list, enabled: bool = True, stop=(), write=None):
        self.tokenizer, self.enabled, self.stop = tokenizer, enabled, [s for s in stop or () if s]
        self.write = write or (lambda text: print(text, end="", flush=True))  # serve.py: into the reply's stream
        self.tokens = [t for t in prompt_tokens[-1:] if t not in tokenizer.eos_ids]
        self.skip = len(tokenizer.decode(self.tokens))
        self.text, self.printed = "", 0

    def __call__(self, new_tokens: list) -> Optional[int]:
        before = len(self.tokens)
        self.tokens.extend(t for t in new_tokens if t not in self.tokenizer.eos_ids)
        self.text = self.tokenizer.decode(self.tokens)[self.skip:]
        if self.stop and self.stop_at(self.text) is not None:
            for keep in range(1, len(new_tokens) + 1):  # the fewest new tokens whose text holds a stop string
                kept = [t for t in new_tokens[:keep] if t not in self.tokenizer.eos_ids]
                end = self.stop_at(self.tokenizer.decode(self.tokens[:before] + kept)[self.skip:])
                if end is not None:
                    self.text = self.text[:end]
                    self.flush()
                    return keep
        if not self.text.endswith("\ufffd"):  # wait for the rest of a multi-token character
            # hold back what could be the start of a stop string
            self.flush(len(self.text) - max((len(s) - 1 for s in self.stop), default=0))
        return None

    def stop_at(self, text: str) -> Optional[int]:
        ends = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(ends) if ends else None

    def flush(self, upto: Optional[int] = None):
        upto = len(self.text) if upto is None else max(upto, self.printed)
        if self.enabled and upto > self.printed:
            self.write(self.text[self.printed:upto])
        self.printed = upto


def encode_prompts(tokenizer: Tokenizer, texts, chat: bool = False, system: Optional[str] = None) -> list:
    """Prompts as token lists; with chat (--chat or --interactive), through the chat template (with --system). A string
    is one prompt (not one a character)."""
    texts = [texts] if isinstance(texts, str) else texts
    if not chat:
        return [tokenizer.encode(text) for text in texts]
    system = [{"role": "system", "content": system}] if system else []
    return [tokenizer.encode_chat(system + [{"role": "user", "content": text}]) for text in texts]


def warm_up(gen: Callable, prompt: list, max_new_tokens: int):
    """Run the compiled step a few times so that compilation and graph capture are not timed later
    (no more tokens than the run itself asks for: the cache is sized for that)."""
    t0 = time.perf_counter()
    gen(prompt, min(12, max_new_tokens))
    print(f"compilation and warm-up: {time.perf_counter() - t0:.1f} s")


def run_once(args, gen: Callable, tokenizer: Tokenizer, prompt: list, show: Callable):
    samples = []
    if args.compile:
        warm_up(gen, prompt, args.max_new_tokens)
    for i in range(args.num_samples):
        torch.manual_seed(args.seed + i)
        print(f"--- sample {i + 1}/{args.num_samples}")
        print(args.prompt, end="\n" if args.chat else "", flush=True)  # a reply starts a line; a continuation doesn't
        streamer = TextStreamer(tokenizer, prompt, stop=args.stop)
        result = gen(prompt, args.max_new_tokens, on_tokens=streamer)
        streamer.flush()
        show(result)
        samples.append(sample_record(args.seed + i, result, streamer.text))
    summary = summarize(samples)
    if args.num_samples > 1:
        print(f"\n{len(samples)} samples: {summary['tokens_per_s_mean']:.2f} tokens/s mean (min "
              f"{summary['tokens_per_s_min']:.2f}, max {summary['tokens_per_s_max']:.2f})"
              + (f", tau {summary['tau']:.2f} over all {summary['cycles']} cycles" if summary["cycles"] else ""))
    demo_note(args)
    if args.json_out and not torchrun_rank():
        write_output(args.json_out, json.dumps({"prompt_tokens": prompt, "samples": samples, **summary}))


def sample_record(seed: int, result: GenerationResult, text: str) -> dict:
    """One sample as --json_out writes it."""
    return {"seed": seed, "tokens": result.tokens, "text": text, "tokens_per_s": result.tokens_per_s,
            "accept_lengths": result.accept_lengths, "cycles": len(result.accept_lengths),
            "tau": result.tau if result.accept_lengths else None, "plain_tokens": result.plain_tokens}


def run_batches(args, gen_batch: Callable, tokenizer: Tokenizer, prompts: list, rows: int):
    """Several prompts, rows at a time (the last batch filled up with copies of its last prompt, so that shapes
    and the compiled graph stay the same; their results are dropped). Each prompt's text and figures after its
    batch; --json_out: a list, one object per prompt as for one prompt."""
    batches = [prompts[i:i + rows] for i in range(0, len(prompts), rows)]
    if args.compile:
        warm_up(gen_batch, batches[0] + batches[0][-1:] * (rows - len(batches[0])), args.max_new_tokens)
    samples = [[] for _ in prompts]
    tokens, seconds = 0, 0.0
    for i in range(args.num_samples):
        torch.manual_seed(args.seed + i)
        for n, batch in enumerate(batches):
            full = batch + batch[-1:] * (rows - len(batch))
            streamers = [TextStreamer(tokenizer, p, enabled=False, stop=args.stop) for p in full]
            t0 = time.perf_counter()
            results = gen_batch(full, args.max_new_tokens, on_tokens=lambda row, new: streamers[row](new))
            seconds += time.perf_counter() - t0
            for row, result in enumerate(results[:len(batch)]):
                k = n * rows + row
                sample = f", sample {i + 1}/{args.num_samples}" if args.num_samples > 1 else ""
                print(f"--- prompt {k + 1}/{len(prompts)}{sample}")
                print(args.prompts[k] + ("\n" if args.chat else "") + streamers[row].text)
                tau = f", tau {result.tau:.2f} over {len(result.accept_lengths)} cycles" if result.accept_lengths else ""
                print(f"({len(result.tokens)} tokens, done after {result.seconds:.2f} s: "
                      f"{result.tokens_per_s:.2f} tokens/s for this prompt{tau})")
                samples[k].append(sample_record(args.seed + i, result, streamers[row].text))
                tokens += len(result.tokens)
    print(f"\n{len(prompts)} prompts x {args.num_samples} samples, {rows} at a time: {tokens} tokens in "
          f"{seconds:.2f} s, {tokens / max(seconds, 1e-9):.2f} tokens/s in all")
    demo_note(args)
    if args.json_out and not torchrun_rank():
        write_output(args.json_out, json.dumps([{"prompt_tokens": p, "samples": s, **summarize(s)}
                                                for p, s in zip(prompts, samples)]))


def demo_note(args):
    """The demo's note, true where it prints: the speed claim on a CPU only (on a GPU speculation wins: BENCHMARKS.md),
    the same-text claim as exact as the precision makes it."""
    if not args.demo or args.draft_checkpoint_path is None:
        return
    if args.device == "cpu":
        print("(the demo's target has 4M parameters: on a CPU its forward costs about as much as a draft pass, so "
              "the tree's draft passes cost more than the target forwards they save and --no_draft is faster here. "
              "Speculation pays where each forward reads gigabytes of weights: a 7B model on a GPU)")
    if args.temperature == 0:
        print(f"({same_text_note(args.precision, args.exact)})")


def same_text_note(precision: str, exact: bool = False) -> str:
    if precision == "fp32" or exact:
        return "greedy: --no_draft gives the same text token for token" + (
            " (with --exact too; on CUDA with the same --total_tokens, the rows each call is padded to)" if exact else "")
    return (f"greedy in {precision}: --no_draft gives the same text up to near-ties, two tokens whose logits "
            f"{precision} cannot tell apart, where the two runs may part; --exact, or --precision fp32, gives the "
            "same text token for token")


def summarize(samples: list) -> dict:
    """Across samples: tokens/s mean, min and max, and tau over all their cycles (tokens emitted per cycle)."""
    speeds = [s["tokens_per_s"] for s in samples]
    cycles = sum(s["cycles"] for s in samples)
    emitted = sum(sum(s["accept_lengths"]) for s in samples)
    return {"tokens_per_s_mean": sum(speeds) / len(speeds), "tokens_per_s_min": min(speeds),
            "tokens_per_s_max": max(speeds), "cycles": cycles, "tau": emitted / cycles if cycles else None}


def write_output(path: Path, text: str):
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise EagletError(f"cannot write {path}: {e.strerror}")


CHAT_HELP = "/reset starts a new conversation, /help shows this; /quit, Ctrl-D or Ctrl-C quits; Ctrl-C in a reply stops it"


def read_turn() -> Optional[str]:
    """The user's next message; None when they quit (end of input, Ctrl-D, Ctrl-C or /quit)."""
    while True:
        try:  # undecodable bytes: a strict stdin refuses them, a surrogateescape one passes them on to utf8_text
            user = utf8_text(input("\nUser: "))
        except (EOFError, KeyboardInterrupt):
            print()
            return None
        except (UnicodeDecodeError, ArgumentTypeError):
            print("error: that line is not valid UTF-8; type it again")
            continue
        if user.strip() == "/quit":
            return None
        if user.strip():
            return user


def run_interactive(args, gen: Callable, tokenizer: Tokenizer, cache_slots: int, scratch: int, show: Callable):
    """Multi-turn chat; the conversation's KV stays in the cache and only new tokens are prefilled.
    A reply to a prompt has the cache's slots less the prompt and the draft tree's scratch."""
    cache_room = lambda prompt: cache_slots - scratch - len(prompt)  # noqa: E731
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages, cached = [], []
    if args.compile:
        warm_up(gen, tokenizer.encode_chat(system + [{"role": "user", "content": "Hi"}]), args.max_new_tokens)
    torch.manual_seed(args.seed)
    print(f"Chat with the model. {CHAT_HELP}.")
    while (user := read_turn()) is not None:
        if user.strip() in ("/help", "/reset"):
            if user.strip() == "/reset":
                messages, cached = [], []
            print(CHAT_HELP if user.strip() == "/help" else "(a new conversation)")
            continue
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.encode_chat(system + messages)
        if cache_room(prompt) < 1 and len(messages) > 1:
            print("(the conversation no longer fits in the cache: starting a new one with this message)")
            messages, cached = messages[-1:], []
            prompt = tokenizer.encode_chat(system + messages)
        room = cache_room(prompt)
        if room < 1:
            print(f"error: this message makes a prompt of {len(prompt)} tokens; with the tree scratch ({scratch}) "
                  f"the cache ({cache_slots} slots) has no room for a reply; it was not sent "
                  f"(a larger --max_seq_length makes room)")
            messages.pop()
            continue
        start = 0
        while start < min(len(cached), len(prompt) - 1) and cached[start] == prompt[start]:
            start += 1
        print("Assistant: ", end="", flush=True)
        streamer = TextStreamer(tokenizer, prompt, stop=args.stop)
        try:
            result = gen(prompt, min(args.max_new_tokens, room), start_pos=start, on_tokens=streamer)
        except KeyboardInterrupt:  # the reply so far stays in the conversation; what the cache holds is unknown,
            streamer.flush()      # so the next turn prefills the whole conversation again
            print("\n(stopped)")
            messages.append({"role": "assistant", "content": streamer.text})
            cached = []
            continue
        streamer.flush()
        if room < args.max_new_tokens and len(result.tokens) == room:
            print(f"\n(reply cut at {room} tokens: the cache is full)", end="")
        show(result)
        cached = prompt + result.tokens[:len(result.tokens) - result.uncached]
        messages.append({"role": "assistant", "content": streamer.text if args.stop else
                         tokenizer.decode(result.tokens)})


if __name__ == "__main__":
    raise SystemExit("error: chat.py is a part of generate.py, not a command: "
                     "`python generate.py --interactive` chats")
