"""Long prompts, measured: time to first token, prefill and decode tokens/s, peak memory and tau by prompt length,
plain and with a head (full context, a draft window, speculation stepping aside), beside transformers' own prefill
of the same prompt. Each case runs in a fresh process, so its peak memory is its own: the peak resident memory
during generation (its high-water mark reset after loading), beside what the weights and the KV caches take.

The prompt is the first N tokens of this repository's README and docs (real text, no file outside the repository).

    python scripts/long_context.py --checkpoint_path checkpoints/smollm2/model.pth \\
        --draft_checkpoint_path heads/smollm2-135m-instruct-eagle/draft.pth --hf_gguf $G --out /tmp/long.md
    python scripts/long_context.py ... --lengths 7000 --cases plain --chunks 128,256,512,1024,2048   # the chunk
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
    p.add_argument("--checkpoint_path", type=Path, required=True)
    p.add_argument("--draft_checkpoint_path", type=Path, default=None)
    p.add_argument("--hf_gguf", type=Path, default=None, help="the GGUF file transformers loads for its side (hf case)")
    p.add_argument("--lengths", default="256,1024,4096,7000", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--chunks", default="512", help="prefill chunks to run each case with, comma-separated")
    p.add_argument("--window", type=int_flag(1), default=256, help="the window case's --draft_window")
    p.add_argument("--new_tokens", type=int_flag(2), default=64)
    p.add_argument("--depth", type=int_flag(1), default=3, help="the head's chain (tree_topk 1) depth")
    p.add_argument("--out", type=Path, default=None, help="a markdown file for the table (written as rows come)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one case in this process: case:length:chunk
    return p.parse_args(argv)


def memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak():
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the resident high-water mark starts again from now


def prompt_tokens(encode, n: int) -> list:
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")))
    ids = encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


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
    from decode import SamplingConfig, StepAside, TreeConfig, generate
    from generate import load_draft, load_target
    from tokenizer import Tokenizer
    prompt = prompt_tokens(Tokenizer(args.checkpoint_path.parent).encode, n)
    tree = TreeConfig(depth=args.depth, topk=1, total_tokens=args.depth + 1)
    model = load_target(args.checkpoint_path, "cpu", "fp32", n + args.new_tokens + tree.scratch)
    draft = load_draft(args.draft_checkpoint_path, model) if case != "plain" else None
    if case == "window":
        draft.set_window(args.window)
    kv = model.kv_cache.kv.nbytes + (draft.kv_cache.kv.nbytes if draft is not None else 0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        (sum(p.numel() * p.element_size() for p in draft.parameters()) if draft is not None else 0)
    generate(model, prompt[:64], 8, SamplingConfig(), draft=draft, tree=tree)  # warm-up: the kernels' first calls
    loaded_kb = memory_kb("VmRSS")
    reset_peak()
    result = generate(model, prompt, args.new_tokens, SamplingConfig(), draft=draft, tree=tree,
                      prefill_chunk=min(chunk, model.max_seq_length),
                      step_aside=StepAside() if case == "step_aside" else None)
    peak = (memory_kb("VmHWM") - base_kb) / 1e6
    return {"case": case, "n": n, "chunk": chunk, "ttft_s": result.first_token_seconds,
            "prefill_tps": n / result.first_token_seconds, "decode_tps": result.decode_tokens_per_s,
            "tau": result.tau if result.accept_lengths else None, "plain_tokens": result.plain_tokens,
            "peak_gb": peak, "weights_kv_gb": (weights + kv) / 1e9, "tokens": result.tokens,
            "loaded_gb": (loaded_kb - base_kb) / 1e6}


def row_text(r: dict) -> str:
    def f(x, spec):
        return "" if x is None else format(x, spec)
    return (f"| {r['case']} | {r['n']} | {f(r.get('chunk'), 'd')} | {r['ttft_s']:.2f} | {r['prefill_tps']:.0f} | "
            f"{f(r.get('decode_tps'), '.1f')} | {f(r.get('tau'), '.2f')} | {f(r.get('plain_tokens'), 'd')} | "
            f"{r['peak_gb']:.2f} | {r['weights_kv_gb']:.2f} | {r['peak_gb'] / r['weights_kv_gb']:.2f} |")


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        case, n, chunk = args.one.split(":")
        print(json.dumps(run_one(args, case, int(n), int(chunk))))
        return
    header = ("| case | prompt tokens | chunk | time to first token (s) | prefill tokens/s | decode tokens/s | tau | "
              "plain tokens | peak (GB, above the process before loading) | weights + KV (GB) | peak / (weights + KV) |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(header, flush=True)
    lines, plain_tokens = [header], {}
    for n in [int(x) for x in args.lengths.split(",")]:
        for case in args.cases.split(","):
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
