"""Structured output with and without forced runs (grammar.Constraint.forced_min: the shortest run of forced tokens
taken without the target): over a few JSON schemas (and JSON mode) and prompts,
greedy, the target's forwards a reply costs (cycles and the prefills that start segments), tokens per forward, the
tokens a cycle kept (not tau: a cycle cut at a draft the grammar refuses keeps those before it, maybe none, and the
refused position's token comes from the next segment's prefill, so this can be below 1), the grammar's host time per
cycle, and whether the tokens are the same both ways.

    python scripts/forced_tokens_tau.py                      # the demo and its EAGLE-2 head
    python scripts/forced_tokens_tau.py --checkpoint_path /tmp/smol/model.pth --draft_checkpoint_path /tmp/smolhead \\
        --chat
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cli import cli_parser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 999}},
     "required": ["name", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["file", "directory", "symlink"]},
                                      "size": {"type": "integer", "minimum": 0, "maximum": 4096},
                                      "readable": {"type": "boolean"}},
     "required": ["kind", "size", "readable"], "additionalProperties": False},
    {"type": "object", "properties": {"owner": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999}, "admin": {"type": "boolean"}},
        "required": ["id", "admin"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
     "required": ["owner", "tags"], "additionalProperties": False},
    None,  # JSON mode: any object
]
PROMPTS = ["def read_lines(path):\n", "class Stack:\n    def push(self, item):", "Describe the file /etc/hosts as JSON."]


def main(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--checkpoint_path", default=str(ROOT / "demo" / "target" / "model.pth"))
    p.add_argument("--draft_checkpoint_path", default=str(ROOT / "demo" / "head" / "draft.pth"))
    p.add_argument("--chat", action="store_true", help="prompts through the chat template")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model runs (the grammar runs on the host either way)")
    p.add_argument("--max_new_tokens", type=int, default=96)
    p.add_argument("--forced_min", type=int, nargs="+", default=[0, 1, 2, 3],
                   help="the shortest forced runs taken without the target, each measured (0: never)")
    args = p.parse_args(argv)
    import decode
    from load import load_draft, load_target
    from tokenizer import Tokenizer

    target = load_target(args.checkpoint_path, args.device, "fp32", 1024)
    draft = load_draft(args.draft_checkpoint_path, target)
    tokenizer = Tokenizer(Path(args.checkpoint_path).parent)
    encode = (lambda text: tokenizer.encode_chat([{"role": "user", "content": text}])) if args.chat else tokenizer.encode
    prefills, real_prefill = [0], decode.prefill_chunks

    def counted_prefill(*a, **k):  # a forward a chunk (generate's prefill goes through prefill_chunks)
        for chunk in real_prefill(*a, **k):
            prefills[0] += 1
            yield chunk
    decode.prefill_chunks = counted_prefill
    try:
        totals, same = measure(args, target, draft, tokenizer, encode, prefills)
    finally:
        decode.prefill_chunks = real_prefill
    print(f"{len(SCHEMAS) - 1} schemas and JSON mode x {len(PROMPTS)} prompts, greedy, {Path(args.checkpoint_path).parent.name} "
          f"with {Path(args.draft_checkpoint_path).parent.name if args.draft_checkpoint_path.endswith('.pth') else Path(args.draft_checkpoint_path).name}; "
          f"the same tokens every way: {same}")
    print("| forced runs | tokens | cycles | prefills | target forwards | tokens / forward | kept / cycle | forced tokens "
          "| grammar host ms / cycle | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for forced_min, t in totals.items():
        forwards = t["cycles"] + t["prefills"]
        print(f"| {f'{forced_min}+' if forced_min else 'off'} | {t['tokens']} | {t['cycles']} | {t['prefills']} | {forwards} | "
              f"{t['tokens'] / forwards:.2f} | {t['emitted'] / max(t['cycles'], 1):.2f} | {t['forced']} | "
              f"{1e3 * t['host'] / max(t['cycles'], 1):.3f} | {t['seconds']:.2f} |")


def measure(args, target, draft, tokenizer, encode, prefills: list) -> tuple:
    """Each schema x prompt x forced_min, greedy with the head: totals by forced_min, and whether every forced_min
    gave the same tokens."""
    import decode
    import sampling
    from grammar import Constraint, grammar_of
    totals = {m: dict(tokens=0, cycles=0, emitted=0, prefills=0, host=0.0, seconds=0.0, forced=0) for m in args.forced_min}
    same = True
    for schema in SCHEMAS:
        grammar = grammar_of("json_schema", json.dumps(schema)) if schema else grammar_of("json_object", None)
        for prompt in PROMPTS:
            outs = []
            for forced_min in args.forced_min:
                constraint, host = Constraint(tokenizer, target.args.vocab_size, grammar, forced_min), [0.0]
                for name in ("take", "forced", "pick"):
                    setattr(constraint, name, timed(getattr(constraint, name), host))
                prefills[0] = 0
                result = decode.generate(target, encode(prompt), args.max_new_tokens, sampling.SamplingConfig(),
                                         tokenizer.eos_ids, draft=draft, constraint=constraint)
                t = totals[forced_min]
                t["tokens"] += len(result.tokens)
                t["cycles"] += len(result.accept_lengths)
                t["emitted"] += sum(result.accept_lengths)
                t["prefills"] += prefills[0]
                t["host"] += host[0]
                t["seconds"] += result.seconds
                t["forced"] += constraint.forced_tokens
                outs.append(result.tokens)
            same &= all(out == outs[0] for out in outs)
    return totals, same


def timed(method, spent: list):
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    return run


if __name__ == "__main__":
    main()
