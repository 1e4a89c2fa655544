"""Long prompts, measured: time to first token, prefill and decode tokens/s, peak memory and tau by prompt length,
plain and with a head (full context, a draft window, speculation stepping aside), beside transformers' own prefill
of the same prompt. Each case runs in a fresh process, so its peak memory is its own: the peak resident memory
during generation (its high-water mark reset after loading), beside what the weights and the KV caches take.

The prompt is the first N tokens of this repository's README and docs (real text, no file outside the repository).

    python scripts/long_context.py --checkpoint_path checkpoints/smollm2/model.pth \\
        --draft_checkpoint_path heads/smollm2-135m-instruct-eagle/draft.pth --hf_gguf $G --out /tmp/long.md
    python scripts/long_context.py ... --lengths 7000 --cases plain --chunks 128,256,512,1024,2048   # the chunk

--shape (a GPU call): random weights of a named shape (bench.py's SHAPES) in bf16 with a random head of --random_head
(eagle: EAGLE-2's 60/6/10 tree; dflash: a chain of its block), all in one process (--compile: the same graphs for
every length): time to first token, plain decode tokens/s, GPU peak memory, and the head's cycle time (a random head's drafts are seldom accepted: its tokens/s says little, its cycle time is
what the window changes). Tokens are random ids.

    python scripts/long_context.py --shape llama3-8b --device cuda --lengths 1024,8192,32768,131072 \
        --cases plain,head,window --random_head eagle --window 2048 --chunks 2048 --new_tokens 64 --compile \\
        --out $OUT/long.md
    python scripts/long_context.py --shape tiny --device cpu --lengths 300,900 --cases plain,head,window \
        --random_head dflash --window 128 --chunks 256 --new_tokens 16   # the CPU dry run
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cli import cli_parser, int_flag  # noqa: E402

CASES = ("hf", "plain", "head", "window", "step_aside")


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", type=Path, default=None)
    p.add_argument("--shape", default=None, help="random weights of this shape instead (bench.py's SHAPES)")
    p.add_argument("--random_head", default="eagle", help="with --shape: eagle or dflash")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="with --shape: compile the step and the cycle")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None)
    p.add_argument("--hf_gguf", type=Path, default=None, help="the GGUF file transformers loads for its side (hf case)")
    p.add_argument("--lengths", default="256,1024,4096,7000", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--chunks", default="512", help="prefill chunks to run each case with, comma-separated")
    p.add_argument("--window", type=int_flag(1), default=256, help="the window case's --draft_window")
    p.add_argument("--new_tokens", type=int_flag(2), default=64)
    p.add_argument("--depth", type=int_flag(1), default=3, help="the head's chain (tree_topk 1) depth")
    p.add_argument("--question", action="append", default=None,
                   help="chat instead: the docs as the system message, then this question; repeatable: tau over all "
                        "the replies (the first one's times)")
    p.add_argument("--out", type=Path, default=None, help="a markdown file for the table (written as rows come)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one case in this process: case:length:chunk
    args = p.parse_args(argv)
    if args.out and args.out.exists() and not args.one:  # a case's own process runs while the table is being written
        p.error(f"--out {args.out} exists: give a new file")
    return args


def memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak():
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the resident high-water mark starts again from now


def docs_text() -> str:
    return "\n\n".join(p.read_text() for p in [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")))


def prompt_tokens(encode, n: int) -> list:
    ids = encode(docs_text())
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def chat_prompt(tokenizer, n: int, question: str) -> list:
    """A chat of about n tokens: the docs' first tokens as the system message (a long context), then the question,
    which the head's accepted length is measured on (the reply to it)."""
    turn = [{"role": "user", "content": question}]
    overhead = len(tokenizer.encode_chat([{"role": "system", "content": ""}] + turn))
    context = tokenizer.decode(tokenizer.encode(docs_text(), bos=False)[:max(n - overhead, 0)])
    return tokenizer.encode_chat([{"role": "system", "content": context}] + turn)


def run_one(args, case: str, n: int, chunk: int) -> dict:
    import torch
    base_kb = memory_kb("VmRSS")
    if case == "hf":
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(args.hf_gguf.parent), gguf_file=args.hf_gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(str(args.hf_gguf.parent), gguf_file=args.hf_gguf.name,
                                                  dtype=torch.float32).eval()
        ids = torch.tensor([prompt_tokens(lambda t: tok(t)["input_ids"], n)])
        weights = sum(p.numel() * p.element_size() for p in hf.parameters())
        with torch.no_grad():
            hf(ids[:, :64], logits_to_keep=1)  # warm-up: the kernels' first calls
        reset_peak()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf(ids, logits_to_keep=1, use_cache=True)
        ttft = time.perf_counter() - t0
        kv = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
        return {"case": case, "n": n, "chunk": None, "ttft_s": ttft, "prefill_tps": n / ttft,
                "peak_gb": (memory_kb("VmHWM") - base_kb) / 1e6, "weights_kv_gb": (weights + kv) / 1e9}
    from decode import TreeConfig, generate
    from sampling import SamplingConfig
    from step_aside import StepAside
    from load import load_draft, load_target
    from tokenizer import Tokenizer
    tokenizer = Tokenizer(args.checkpoint_path.parent)
    prompts = [chat_prompt(tokenizer, n, q) for q in args.question] if args.question else \
        [prompt_tokens(tokenizer.encode, n)]
    prompt = max(prompts, key=len)
    tree = TreeConfig(depth=args.depth, topk=1, total_tokens=args.depth + 1)
    model = load_target(args.checkpoint_path, "cpu", "fp32", len(prompt) + args.new_tokens + tree.scratch)
    draft = load_draft(args.draft_checkpoint_path, model) if case != "plain" else None
    if case == "window":
        draft.set_window(args.window)
    kv = sum(b.nbytes for c in (model.kv_cache, draft and draft.kv_cache) if c for b in c.kv_buffers())
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        (sum(p.numel() * p.element_size() for p in draft.parameters()) if draft is not None else 0)
    generate(model, prompt[:64], 8, SamplingConfig(), draft=draft, tree=tree)  # warm-up: the kernels' first calls
    loaded_kb = memory_kb("VmRSS")
    reset_peak()
    results = [generate(model, p, args.new_tokens, SamplingConfig(), tokenizer.eos_ids if args.question else (),
                        draft=draft, tree=tree, prefill_chunk=min(chunk, model.max_seq_length),
                        step_aside=StepAside() if case == "step_aside" else None) for p in prompts]
    peak = (memory_kb("VmHWM") - base_kb) / 1e6
    result, prompt = results[0], prompts[0]
    lengths = [n for r in results for n in r.accept_lengths]  # tau over every reply
    return {"case": case, "n": len(prompt), "chunk": chunk, "ttft_s": result.first_token_seconds,
            "prefill_tps": len(prompt) / result.first_token_seconds, "decode_tps": result.decode_tokens_per_s,
            "tau": sum(lengths) / len(lengths) if lengths else None, "plain_tokens": result.plain_tokens,
            "peak_gb": peak, "weights_kv_gb": (weights + kv) / 1e9, "tokens": [t for r in results for t in r.tokens],
            "loaded_gb": (loaded_kb - base_kb) / 1e6}


def run_shapes(args, lengths: list, cases: list, chunk: int):
    """Every case on random weights of args.shape, in this process (see the module's docstring): one target and head
    with a cache for the longest prompt, so every length runs the same compiled graphs. Yields each case's row."""
    import torch
    from measure import SHAPES, random_models
    from decode import TreeConfig, decode_one_token, device_sync, generate, speculative_cycle
    from sampling import SamplingConfig
    from graphs import compile_settings, compile_step
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    tree = TreeConfig(6, 10, 60) if args.random_head == "eagle" else TreeConfig(14, 1, 16)
    size = max(lengths) + args.new_tokens + tree.scratch + 8
    target, head = random_models(args.shape, args.device, dtype, size, head=args.random_head)
    compile_settings(target, args.device)
    steps = {fn: compile_step(fn, args.device) if args.compile else fn for fn in (decode_one_token, speculative_cycle)}
    vocab = SHAPES[args.shape]["vocab_size"]
    weights_kv = sum(p.numel() * p.element_size() for p in target.parameters()) + \
        sum(b.nbytes for b in target.kv_cache.kv_buffers())
    for n in lengths:
        prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for case in cases:
            draft = None if case == "plain" else head
            if draft is not None:
                draft.set_window(args.window if case == "window" else None)
            run = dict(draft=draft, tree=tree, step_fn=steps[speculative_cycle if draft else decode_one_token],
                       prefill_chunk=min(chunk, size))
            generate(target, prompt[:256], 16, SamplingConfig(), **run)  # warm-up: compilation, first calls
            device_sync(args.device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            result = generate(target, prompt, args.new_tokens, SamplingConfig(), **run)
            cycles = len(result.accept_lengths)
            yield {"case": case, "n": n, "chunk": chunk, "ttft_s": result.first_token_seconds,
                   "prefill_tps": n / result.first_token_seconds, "decode_tps": result.decode_tokens_per_s,
                   "tau": result.tau if cycles else None, "plain_tokens": result.plain_tokens,
                   "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
                   "weights_kv_gb": weights_kv / 1e9, "tokens": result.tokens,
                   "call_ms": 1e3 * (result.seconds - result.first_token_seconds) / max(cycles or len(result.tokens) - 1, 1)}


def row_text(r: dict) -> str:
    def f(x, spec):
        return "" if x is None else format(x, spec)
    return (f"| {r['case']} | {r['n']} | {f(r.get('chunk'), 'd')} | {r['ttft_s']:.2f} | {r['prefill_tps']:.0f} | "
            f"{f(r.get('decode_tps'), '.1f')} | {f(r.get('tau'), '.2f')} | {f(r.get('plain_tokens'), 'd')} | "
            f"{r['peak_gb']:.2f} | {r['weights_kv_gb']:.2f} | {r['peak_gb'] / r['weights_kv_gb']:.2f} |"
            + (f" {r['call_ms']:.2f} |" if "call_ms" in r else ""))


def main(argv=None):
    args = parse_args(argv)
    if not (args.shape or args.checkpoint_path):
        sys.exit("error: give --checkpoint_path (a converted model) or --shape (random weights)")
    if args.one:
        case, n, chunk = args.one.split(":")
        print(json.dumps(run_one(args, case, int(n), int(chunk))))
        return
    header = ("| case | prompt tokens | chunk | time to first token (s) | prefill tokens/s | decode tokens/s | tau | "
              "plain tokens | peak (GB, above the process before loading) | weights + KV (GB) | peak / (weights + KV) |"
              + (" ms a step or cycle |" if args.shape else "") + "\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
              + (" --- |" if args.shape else ""))
    print(header, flush=True)
    lines, plain_tokens = [header], {}
    lengths, cases = [int(x) for x in args.lengths.split(",")], args.cases.split(",")
    if args.shape:
        for row in run_shapes(args, lengths, cases, int(args.chunks.split(",")[0])):
            lines.append(row_text(row))
            print(lines[-1], flush=True)
            if args.out:
                args.out.write_text("\n".join(lines) + "\n")
        return
    for n in lengths:
        for case in cases:
            for chunk in [int(x) for x in args.chunks.split(",")] if case != "hf" else [0]:
                argv_one = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--one", f"{case}:{n}:{chunk}"]
                done = subprocess.run([sys.executable, __file__] + argv_one, capture_output=True, text=True)
                if done.returncode:
                    print(f"| {case} | {n} | failed: {done.stderr.strip().splitlines()[-1]} |", flush=True)
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                if "tokens" in row:  # every eaglet case decodes the same tokens as plain decoding
                    same = plain_tokens.setdefault(n, row["tokens"]) == row["tokens"]
                    row["case"] += "" if same else " (TOKENS DIFFER FROM PLAIN)"
                lines.append(row_text(row))
                print(lines[-1], flush=True)
                if args.out:
                    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
