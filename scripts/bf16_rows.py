"""Where bf16 rounding parts speculative decoding from plain decoding: a verify computes a token's logits in a call
of many rows, a plain step in a call of one, and the two may round differently. For each operation of a random
target of a named shape (default LLaMA-3-8B's) -- the fused q/k/v projection, the output projection, the fused
gate/up and the down projection, the lm_head, the norm, attention over the cache -- and for the whole model's
logits, this says whether row j of a ROWS-row call equals the same input's one-row call bit for bit, with torch's
defaults and with cuBLAS's reduced-precision and split-K reductions off
(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)). For the linear layers it also
times a path that rounds alike -- the one row computed as a ROWS-row call, zero-padded -- against the one-row call.

Each section is written to OUT/bf16_rows.json and OUT/bf16_rows.md as soon as it is measured.

    python scripts/bf16_rows.py --out $OUT/rows                                   # on the GPU, bf16
    python scripts/bf16_rows.py --out /tmp/rows --device cpu --shape tiny          # the CPU dry run
"""
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli import cli_parser, int_flag  # noqa: E402

SETTINGS = {"defaults": (True, True), "reduced precision and split-K off (cuBLASLt)": (False, False)}


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--out", type=Path, required=True, help="a new folder for bf16_rows.json and bf16_rows.md")
    p.add_argument("--commit", default=None, help="the commit that runs (default: git's; a copy without history has none)")
    p.add_argument("--shape", default="llama3-8b", help="a bench.py shape: llama3-8b, llama2-7b, ... tiny (a dry run)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--rows", type=int_flag(2, 512), default=60, help="rows of the many-row call (a verify's tree)")
    p.add_argument("--context", type=int_flag(1), default=512, help="tokens in the cache before the rows")
    p.add_argument("--repeats", type=int_flag(1), default=50, help="calls timed per linear layer")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"--out {args.out} exists: give a new folder")
    return args


def set_reduction(torch, device: str, setting: tuple):
    if device == "cuda":  # torch 2.11 turns split-K off only under cuBLASLt (under cuBLAS an H200 raised an error)
        torch.backends.cuda.preferred_blas_library("cublas" if setting[1] else "cublaslt")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = setting


def compare(many, ones: list) -> dict:
    """Row j of the many-row result against the j-th one-row result: how many rows are equal bit for bit, the
    largest difference, and how many rows' argmax differ (for logits)."""
    import torch
    ones = torch.cat(ones)
    equal = (many == ones).all(dim=-1)
    return {"rows_equal": int(equal.sum()), "rows": int(equal.numel()),
            "max_abs_diff": float((many.float() - ones.float()).abs().max()),
            "argmax_differs": int((many.argmax(-1) != ones.argmax(-1)).sum())}


def linears(target, x, device, repeats: int) -> dict:
    """Each linear layer of the first block (and the lm_head): bit equality of row j, then the one-row call's time
    beside the same row computed as a padded many-row call (which rounds as the verify does)."""
    import torch
    import measure
    block = target.layers[0]
    layers = {"wqkv": (block.attention.wqkv, x), "wo": (block.attention.wo, x),
              "w13": (block.feed_forward.w13, x), "lm_head": (target.output, x)}
    hidden = block.feed_forward.w2.in_features
    layers["w2"] = (block.feed_forward.w2, torch.randn(x.shape[0], hidden, device=device, dtype=x.dtype))
    out = {}
    with torch.no_grad():
        for name, (layer, rows) in layers.items():
            many = layer(rows)
            ones = [layer(rows[j:j + 1]) for j in range(rows.shape[0])]
            padded = torch.zeros_like(rows)
            padded[0] = rows[0]
            one_s, _ = measure.timed(lambda: layer(rows[:1]), repeats, device)
            padded_s, _ = measure.timed(lambda: layer(padded), repeats, device)
            out[name] = compare(many, ones) | {
                "padded_row_equal": bool((layer(padded)[0] == many[0]).all()),
                "one_row_us": one_s * 1e6, "padded_us": padded_s * 1e6, "shape": list(layer.weight.shape)}
    return out


def norm_and_attention(target, x, context: int) -> dict:
    """The first block's norm (row-wise: it should never part) and its attention over a cache of context tokens:
    the rows at positions context.. attend causally, each one-row call over the slots filled up to its own."""
    import torch
    from attention import causal_mask
    block, n = target.layers[0], x.shape[0]
    with torch.no_grad():
        norm = compare(block.attention_norm(x), [block.attention_norm(x[j:j + 1]) for j in range(n)])
        pos = torch.arange(context, context + n, device=x.device)
        cos, sin = target.rope(pos, x.dtype)
        h = x[None]
        many = block.attention(h, cos, sin, pos, causal_mask(pos, context + n))[0]
        ones = []
        for j in range(n):
            p = pos[j:j + 1]
            c, s = target.rope(p, x.dtype)
            ones.append(block.attention(h[:, j:j + 1], c, s, p, causal_mask(p, context + j + 1))[0])
    return {"attention_norm": norm, "attention (q/k/v, cache, SDPA, wo)": compare(many, ones)}


def whole_model(target, tokens, context: int) -> dict:
    """The logits of n tokens after a context: one n-row forward (a verify of a chain) against n one-row forwards,
    each over the slots filled up to its own (plain decoding)."""
    import torch
    from attention import causal_mask
    n, device = tokens.shape[1] - context, tokens.device
    with torch.no_grad():
        pos = torch.arange(context, device=device)
        target(tokens[:, :context], pos, pos, causal_mask(pos, context))
        pos = torch.arange(context, context + n, device=device)
        many, _ = target(tokens[:, context:], pos, pos, causal_mask(pos, context + n),
                         logits_idx=torch.arange(n, device=device))
        ones = []
        for j in range(n):
            p = pos[j:j + 1]
            logits, _ = target(tokens[:, context + j:context + j + 1], p, p, causal_mask(p, context + j + 1),
                               logits_idx=torch.tensor([0], device=device))
            ones.append(logits[0])
    return {"logits": compare(many[0], ones)}


def markdown(results: dict) -> str:
    s = results["setup"]
    lines = [f"{s['device_name']}, {s['date']}, commit {s['commit']}, shape {s['shape']}, {s['dtype']}, "
             f"{s['rows']} rows after {s['context']} tokens: `{s['command']}`", "",
             "| setting | operation | rows equal bit for bit | largest difference | argmax differs | one row (us) | "
             "padded to the rows (us), equal |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for setting, sections in results["settings"].items():
        for op, r in sections.items():
            if "error" in r:
                lines.append(f"| {setting} | {op} | error: {r['error']} | | | | |")
                continue
            timing = (f"| {r['one_row_us']:.1f} | {r['padded_us']:.1f}, {'yes' if r['padded_row_equal'] else 'no'}"
                      if "one_row_us" in r else "| |")
            lines.append(f"| {setting} | {op} | {r['rows_equal']} of {r['rows']} | {r['max_abs_diff']:.3g} | "
                         f"{r['argmax_differs']} {timing} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    import torch
    import measure
    from load import pick_device
    device = pick_device(args.device)
    dtype = torch.bfloat16
    args.out.mkdir(parents=True)
    torch.manual_seed(0)
    target, _ = measure.random_models(args.shape, device, dtype, args.context + args.rows + 8)
    x = torch.randn(args.rows, target.args.dim, device=device, dtype=dtype)
    tokens = torch.randint(0, target.args.vocab_size, (1, args.context + args.rows), device=device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    results = {"setup": {"shape": args.shape, "device_name": name, "date": time.strftime("%Y-%m-%d"),
                         "commit": args.commit or measure.git_commit(), "dtype": "bf16", "rows": args.rows, "context": args.context,
                         "command": "python " + " ".join(sys.argv if argv is None else ["scripts/bf16_rows.py", *argv])},
               "settings": {}}
    for setting, value in SETTINGS.items():
        set_reduction(torch, device, value)
        sections = results["settings"].setdefault(setting, {})
        # the whole model first: its prefill fills the cache the attention section reads, alike in both settings
        for part in (lambda: linears(target, x, device, args.repeats), lambda: whole_model(target, tokens, args.context),
                     lambda: norm_and_attention(target, x, args.context)):
            try:
                sections.update(part())
            except Exception as e:  # the next section may still measure something
                sections[f"section {len(sections)}"] = {"error": f"{type(e).__name__}: {e}",
                                                        "traceback": traceback.format_exc()[-2000:]}
            (args.out / "bf16_rows.json").write_text(json.dumps(results, indent=1))
            (args.out / "bf16_rows.md").write_text(markdown(results))
    set_reduction(torch, device, SETTINGS["defaults"])
    print(markdown(results))


if __name__ == "__main__":
    main()
