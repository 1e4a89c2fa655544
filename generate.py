"""Decode from a converted LLaMA-family checkpoint: plain decoding, or EAGLE-2 speculative decoding.

    python generate.py --checkpoint_path checkpoints/meta-llama/Llama-2-7b-chat-hf/model.pth \\
        --prompt "Hello, my name is" --compile
"""
# (The docstring above is --help's text.) This file is the command line: flags, and main, over load.py (the target,
# the head, the tree and the caches, from the flags as keywords), decode.py (sampling, the cycle, generate),
# graphs.py (--compile), batch.py (generate_batch), step_aside.py (--step_aside), tune.py (--tree auto,
# --total_tokens auto) and chat.py (streaming, stop strings, the chat loop, a run's output). It imports those and
# model.py, quantize.py, draft.py, tp.py, tokenizer.py and cli.py, and re-exports nothing: the tools (bench.py,
# train_draft.py, serve.py, scripts/) import it for its flags and its report only.
import json
import os
import sys
from argparse import ArgumentTypeError
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Optional

from cli import (CALIBRATION_PROMPTS, CALIBRATION_TOKENS, DEFAULT_DRAFT_VOCAB, DEMO_PROMPT, DRAFT_VOCAB_ABOVE,
                 PRECISION_NAMES, cli_parser, float_flag, grid_text, int_flag, torchrun_rank, utf8_text)

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_MAX_NEW_TOKENS = 60


def total_tokens_flag(text: str):
    return text if text == "auto" else int_flag(2)(text)


def window_flag(text: str):
    """--draft_window: auto, full, or a positive number of positions."""
    return text if text in ("auto", "full") else int_flag(1)(text)


def json_paths(text: str) -> tuple:
    """--tree_choices: a JSON list of paths (lists); StaticTree checks what they say."""
    try:
        value = json.loads(text)
    except ValueError:
        raise ArgumentTypeError(f"not JSON: {text[:60]!r}")
    if not isinstance(value, list) or not all(isinstance(p, list) for p in value):
        raise ArgumentTypeError("a JSON list of paths, each a list of child ranks, e.g. [[0], [1], [0, 0]]")
    return tuple(tuple(p) for p in value)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ArgumentTypeError(f"is not valid JSON: {e}")
    if not isinstance(value, dict):
        raise ArgumentTypeError("must be a JSON object ({...})")
    return value


def model_flags(p):
    """The flags that say what runs and how: the target, the head and its tree, device, precision, compilation,
    the chat template and the cache (generate.py's, and serve.py's: one definition)."""
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="model.pth written by convert_hf_checkpoint.py (or quantize.py), or its folder "
                        "(default: the demo in demo/)")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="draft.pth of an EAGLE-1/2, EAGLE-3, P-EAGLE, DFlash, DSpark, DFlash2 or XPress head, or its "
                        "folder: switches to speculative decoding")
    p.add_argument("--draft_model", type=Path, default=None,
                   help="a converted model of the target's vocabulary (model.pth, a quantized one, or its folder) "
                        "drafting in a head's place: a chain (--tree_topk 1) or EAGLE-2's tree of its top-k "
                        "(default: depth 4, top-k 4)")
    p.add_argument("--ngram", action="store_true",
                   help="n-gram prompt lookup, without a head: the drafts are what followed the context's last "
                        "--ngram_max .. --ngram_min tokens where they occurred before (prompt and reply), up to "
                        "--tree_topk continuations of --depth tokens verified as one tree of at most --total_tokens "
                        "(default: 4 continuations of 8 tokens, at most 32); where nothing matches, a plain step")
    p.add_argument("--ngram_max", type=int_flag(1), default=4, help="--ngram: the longest suffix matched")
    p.add_argument("--ngram_min", type=int_flag(1), default=2, help="--ngram: the shortest suffix matched")
    p.add_argument("--draft_vocab", default=None,
                   help="EAGLE-1/2 heads: a file of the target ids the draft may propose (scripts/draft_vocab.py); "
                        "default: draft_vocab.json beside the head if there is one, else on a target of more than "
                        f"{DRAFT_VOCAB_ABOVE} ids its {DEFAULT_DRAFT_VOCAB} lowest (frequent first in a BPE "
                        "tokenizer); 0 or full: the whole vocabulary. The output is the same either way")
    p.add_argument("--no_draft", action="store_true",
                   help="plain decoding, without a head (also when --draft_checkpoint_path is given)")
    p.add_argument("--depth", type=int_flag(1), default=None,
                   help="draft tree expansion steps (default: 6; 7 for EAGLE-3 heads; a block drafter's drafts per "
                        "block - 1 (DFlash: block size - 2, DSpark: block size - 1): its tree has depth + 1 levels, "
                        "one per drafting block row)")
    p.add_argument("--tree_topk", type=int_flag(1), default=None,
                   help="children per node and nodes kept per level (default: 10; 1 for block drafters, a chain)")
    p.add_argument("--total_tokens", type=total_tokens_flag, default=None,
                   help="tokens verified per cycle, root included; auto measures the verify cost at start-up "
                        "(default: 60, or all the nodes of a smaller tree: a chain's depth + 2)")
    p.add_argument("--tree", choices=["given", "auto", "static"], default="given",
                   help="given: EAGLE-2's dynamic tree of --depth, --tree_topk and --total_tokens; static: the same "
                        "tree every cycle, --tree_choices; auto: measure each tree of "
                        f"depth/tree_topk/total_tokens {grid_text()} on this device at batch 1 (tau: greedy decoding "
                        f"of {len(CALIBRATION_PROMPTS)} built-in prompts, {CALIBRATION_TOKENS} tokens each; the time "
                        "of its cycle) and keep the most tokens/s = tau / cycle time; the choice is kept in "
                        "$EAGLET_CACHE/tree_choice.json (~/.cache/eaglet/) for this target, head, device, format and "
                        "precision, and later runs read it")
    p.add_argument("--tree_choices", type=json_paths, default=None,
                   help="--tree static: its nodes as paths of child ranks from the root, as JSON, e.g. "
                        "'[[0], [1], [0, 0], [0, 1], [0, 0, 0]]' ([1]: the root's second-best draft; [0, 0]: the best "
                        "draft after [0]); default: a built-in tree of 26 nodes, 6 deep")
    p.add_argument("--confidence", type=float_flag(0, 1), default=0.0,
                   help="DSpark heads: drafts from the first whose confidence (the head's estimate that it is "
                        "accepted, given the drafts before it were) is below this go unverified; 0 (default): "
                        "verify every draft. The verify keeps its fixed size: this trades drafts for nothing at "
                        "batch 1, and is there to match engines that cut")
    p.add_argument("--draft_window", type=window_flag, default="auto",
                   help="the head attends to the first --draft_sinks and the last W positions of the context only, so "
                        "its cost per cycle stays flat as the context grows (the output is the same: the target "
                        "verifies); auto (default): the window the head's config says it was trained with, else "
                        "2048; full: all of it")
    p.add_argument("--draft_sinks", type=int_flag(0), default=4,
                   help="with --draft_window, the first positions the head always sees (attention sinks)")
    p.add_argument("--step_aside", choices=["on", "off"], default="on",
                   help="on (default): where a cycle costs more than the tokens it gives (timed as it decodes), "
                        "decode with plain steps and try the head again every so many tokens; the output is the same. "
                        "Greedy decoding in one process only (a seeded sample would depend on the clock)")
    p.add_argument("--prefill_chunk", type=int_flag(1), default=None,
                   help="prompt tokens per prefill forward (default: 512, measured best on a CPU): the memory for "
                        "activations and masks grows with it, not with the prompt")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if available")
    p.add_argument("--precision", choices=PRECISION_NAMES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step or the cycle (CUDA graphs on CUDA)")
    p.add_argument("--exact", action="store_true",
                   help="speculative greedy output equals plain greedy output bit for bit in bf16 too (attention in "
                        "float64, no one-row matmul; plain's own rounding changes): docs/exact.md")
    p.add_argument("--chat_template", default="auto",
                   help="auto (the checkpoint's own, else a built-in one, named at start-up), llama2, vicuna, "
                        "or a .jinja file")
    p.add_argument("--chat_template_kwargs", type=json_object, default=None,
                   help='extra variables for the chat template, as JSON, e.g. \'{"enable_thinking": false}\' (Qwen3)')
    p.add_argument("--max_seq_length", type=int_flag(1), default=None,
                   help="cache size; default: what the prompt and max_new_tokens need, or 4096 with --interactive")
    return p


def check_model_flags(p, args):
    """model_flags' defaults and checks: the demo when no target is given, --no_draft, --tree auto."""
    args.demo = args.checkpoint_path is None
    if args.demo:  # a small code model and its head, shipped in demo/
        if not (DEMO_DIR / "target" / "model.pth").is_file():
            p.error(f"no --checkpoint_path given and no demo in {DEMO_DIR} (python scripts/make_demo.py builds it)")
        args.checkpoint_path = DEMO_DIR / "target" / "model.pth"
    if args.demo and not (args.draft_model or args.ngram):  # a small code model and its head, shipped in demo/
        args.draft_checkpoint_path = args.draft_checkpoint_path or DEMO_DIR / "head" / "draft.pth"
    if args.no_draft:
        args.draft_checkpoint_path = args.draft_model = None
        args.ngram = False
    drafters = [f for f, on in (("--draft_checkpoint_path", args.draft_checkpoint_path), ("--draft_model", args.draft_model),
                                ("--ngram", args.ngram)) if on]
    if len(drafters) > 1:
        p.error(f"give one drafter: {' and '.join(drafters)} were given")
    if args.ngram_min > args.ngram_max:
        p.error(f"--ngram_min ({args.ngram_min}) is larger than --ngram_max ({args.ngram_max})")
    if args.tree in ("auto", "static"):
        given = [f for f in ("depth", "tree_topk", "total_tokens") if getattr(args, f) is not None]
        if given:
            p.error(f"--tree {args.tree} {'picks' if args.tree == 'auto' else 'sets'} depth, tree_topk and "
                    f"total_tokens itself: leave out --{given[0]}")
        if not (args.draft_checkpoint_path or args.draft_model):
            p.error(f"--tree {args.tree} {'tunes' if args.tree == 'auto' else 'is'} the draft tree: it needs a head "
                    "(--draft_checkpoint_path or --draft_model, and no --no_draft)")
    if args.tree_choices is not None and args.tree != "static":
        p.error("--tree_choices is the shape of --tree static: give both")


def parse_args(argv=None):
    p = model_flags(cli_parser(__doc__))
    p.add_argument("--prompt", type=utf8_text, action="append", default=None,
                   help=f"the prompt (default: {DEMO_PROMPT!r}); give it several times to decode several prompts")
    p.add_argument("--prompt_file", type=Path, default=None,
                   help="prompts, one a line: a JSON string, or a FastChat question (its first turn)")
    p.add_argument("--batch_size", type=int_flag(1), default=None,
                   help="several prompts: decode this many together (default: all of them, or as many as the "
                        "caches' memory allows)")
    p.add_argument("--system", type=utf8_text, default=None, help="a system message for --chat and --interactive")
    p.add_argument("--max_new_tokens", type=int_flag(1), default=None,
                   help=f"stop after this many tokens or at EOS (default: 200; {DEMO_MAX_NEW_TOKENS} for the demo)")
    p.add_argument("--min_tokens", type=int_flag(0), default=0,
                   help="end-of-sequence masked until the reply holds this many tokens (exact under speculation)")
    p.add_argument("--ignore_eos", action="store_true",
                   help="decode past end-of-sequence up to --max_new_tokens (replies of a fixed length, for timing)")
    p.add_argument("--temperature", type=float_flag(0), default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float_flag(0, 1), default=1.0, help="nucleus sampling: keep this much mass")
    p.add_argument("--top_k", type=int_flag(0), default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--min_p", type=float_flag(0, 1), default=0.0,
                   help="keep the tokens at least this many times as likely as the likeliest; 0 = off")
    p.add_argument("--presence_penalty", type=float_flag(-2, 2), default=0.0,
                   help="subtracted from the logit of every token the reply holds (OpenAI's)")
    p.add_argument("--frequency_penalty", type=float_flag(-2, 2), default=0.0,
                   help="subtracted from a token's logit times how often the reply holds it (OpenAI's)")
    p.add_argument("--repetition_penalty", type=float_flag(0.01, 100), default=1.0,
                   help="a logit of a token the prompt or the reply holds divided by this (above 0) or multiplied "
                        "by it (below): transformers' rule; 1 = off. Every penalty stays exact under speculation")
    p.add_argument("--logit_bias", type=json_object, default=None,
                   help='added to the logits of these token ids, as JSON, e.g. \'{"13": -100}\' (OpenAI\'s)')
    p.add_argument("--seed", type=int_flag(0), default=0, help="sampling seed; sample i uses seed + i")
    p.add_argument("--num_samples", type=int_flag(1, 2 ** 31), default=1, help="generate this many times (timing)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stop", type=utf8_text, action="append", default=None,
                   help="end the reply where this text appears, cut before it (repeatable)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat in the terminal")
    p.add_argument("--json_schema", type=Path, default=None,
                   help="structured output: the reply is JSON valid under this JSON schema file (llguidance; exact "
                        "under speculation: the target's own distribution restricted to what the schema allows)")
    p.add_argument("--regex", type=utf8_text, default=None, help="structured output: the reply matches this regular "
                                                                 "expression (as --json_schema)")
    p.add_argument("--json_out", type=Path, default=None,
                   help="write the prompt's tokens and each sample's tokens, text, tokens/s, accept lengths and tau "
                        "as JSON, with their means (several prompts: a list of such objects)")
    p.add_argument("--overwrite", action="store_true", help="replace --json_out if it exists")
    args = p.parse_args(argv)
    if args.checkpoint_path is None and (args.chat or args.interactive):
        p.error("the demo is a code-completion model with no chat template: --chat and --interactive need a "
                "chat model (--checkpoint_path)")
    check_model_flags(p, args)
    if args.system is not None and not (args.chat or args.interactive):
        p.error("--system needs --chat or --interactive")
    if args.chat_template_kwargs is not None and not (args.chat or args.interactive):
        p.error("--chat_template_kwargs needs --chat or --interactive")
    if args.stop and not all(args.stop):
        p.error("--stop needs a non-empty text")
    if args.interactive and args.json_out:
        p.error("--json_out records one generation; --interactive has many (give a --prompt instead)")
    if args.json_out and args.json_out.is_file() and not args.overwrite:
        p.error(f"--json_out {args.json_out} exists; give another path, or --overwrite to replace it")
    try:
        args.prompts = (args.prompt or []) + (read_prompts(args.prompt_file) if args.prompt_file else [])
    except ValueError as e:
        p.error(str(e))
    if args.interactive and (args.prompts or args.num_samples > 1):
        p.error("--interactive starts an empty conversation and you type its messages: it takes no --prompt, "
                "--prompt_file or --num_samples")
    empty = [i + 1 for i, text in enumerate(args.prompts) if not text]
    if empty and len(args.prompts) > 1:
        p.error(f"prompt {empty[0]} of {len(args.prompts)} is empty")
    if args.interactive and torchrun_rank() is not None:
        p.error("--interactive reads the terminal in one process; under torchrun (tensor parallel) give a --prompt")
    args.prompts = args.prompts or [DEMO_PROMPT]
    args.prompt = args.prompts[0]
    if (args.json_schema or args.regex) and (args.interactive or len(args.prompts) > 1):
        p.error(f"--{'json_schema' if args.json_schema else 'regex'} constrains one reply: give one --prompt "
                "(not --interactive or several prompts)")
    if args.json_schema and args.regex:
        p.error("give --json_schema or --regex, not both")
    args.max_new_tokens = args.max_new_tokens or (DEMO_MAX_NEW_TOKENS if args.demo else 200)
    return args


def read_prompts(path: Path) -> list:
    """A prompt file: one prompt a line, a JSON string or a FastChat question ({"turns": [...]}, its first
    turn); blank lines skipped. ValueError names the line of a mistake."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt_file {path}: cannot read it ({getattr(e, 'strerror', None) or e})")
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompt_file {path} line {n}: not JSON ({e.msg})")
        if isinstance(item, dict) and isinstance(item.get("turns"), list) and item["turns"]:
            item = item["turns"][0]
        if not isinstance(item, str):
            raise ValueError(f"--prompt_file {path} line {n}: expected a JSON string or a question with \"turns\"")
        if not item:
            raise ValueError(f"--prompt_file {path} line {n}: the prompt is empty")
        prompts.append(item)
    if not prompts:
        raise ValueError(f"--prompt_file {path} holds no prompts")
    return prompts


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

from chat import encode_prompts, run_batches, run_interactive, run_once  # noqa: E402
from decode import GenerationResult, TreeConfig, decode_one_token, generate, speculative_cycle  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from graphs import compile_settings, compile_step  # noqa: E402
from batch import generate_batch  # noqa: E402
from step_aside import StepAside  # noqa: E402
from lookup import lookup_cycle, warm_up_lookup  # noqa: E402
from draft import DraftHead  # noqa: E402
from checkpoint import EagletError, converted_file  # noqa: E402
from load import describe, load, peak_memory_gb, pick_device  # noqa: E402
from model import Transformer  # noqa: E402
from quantize import weight_bytes  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
import tp  # noqa: E402
from tune import auto_tree, pick_total_tokens  # noqa: E402

# The flags load() takes, each as the keyword of its name (prompts: the texts parse_args gathered).
LOAD_FLAGS = ("checkpoint_path", "draft_checkpoint_path", "draft_model", "ngram", "ngram_min", "ngram_max",
              "draft_vocab", "device", "precision", "tree", "depth", "tree_topk", "total_tokens", "tree_choices",
              "confidence", "draft_window", "draft_sinks", "prefill_chunk", "chat_template", "chat_template_kwargs",
              "max_seq_length", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "logit_bias", "min_tokens", "prompts", "chat", "interactive", "system",
              "max_new_tokens", "batch_size", "json_out", "exact")


def load_settings(args) -> dict:
    """load()'s keywords from the parsed flags."""
    return {name: getattr(args, name) for name in LOAD_FLAGS}


def grammar_flag(args) -> Optional[str]:
    """--json_schema's file or --regex as a grammar, checked before anything is loaded (None: neither given)."""
    if args.json_schema is None and args.regex is None:
        return None
    from grammar import grammar_of  # llguidance is needed only here
    if args.regex is not None:
        return grammar_of("regex", args.regex)
    try:
        schema = json.loads(args.json_schema.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise EagletError(f"--json_schema {args.json_schema}: cannot read it ({getattr(e, 'strerror', None) or e})")
    except json.JSONDecodeError as e:
        raise EagletError(f"--json_schema {args.json_schema}: not JSON ({e.msg}, line {e.lineno})")
    if not isinstance(schema, dict):
        raise EagletError(f"--json_schema {args.json_schema}: a schema is a JSON object")
    return grammar_of("json_schema", json.dumps(schema))


def step_aside_on(args, draft: Optional[DraftHead], sampling: SamplingConfig, group) -> bool:
    """--step_aside on, with a head, where it cannot change the output: greedy (sampled, a seed's sample would depend
    on where the clock said to step aside), one process (tensor parallel ranks would time, and decide, apart)."""
    return draft is not None and args.step_aside == "on" and sampling.temperature == 0 and group is None


def with_step_aside(gen, plain_fn):
    """gen with a fresh StepAside for each generation (a warm-up's compile times are not carried into the next)."""
    return lambda *a, **k: gen(*a, step_aside=StepAside(), plain_fn=plain_fn, **k)


def constrained(gen, tokenizer: Tokenizer, n_vocab: int, grammar: str):
    from grammar import Constraint
    return lambda *a, **k: gen(*a, constraint=Constraint(tokenizer, n_vocab, grammar), **k)


def cycle_weight_bytes(target: Transformer, draft: DraftHead, tree: TreeConfig) -> int:
    """Weights one speculative cycle reads: the target once (verify), and per draft pass (EAGLE: depth + 1,
    DFlash: 1) the head and the lm_head it scores with (the target's, its rows for a draft vocabulary, or its own)."""
    lm_head = draft.lm_head_module(target)
    own = any(lm_head is m for m in draft.modules())
    passes = tree.draft_passes(draft)
    return weight_bytes(target) + passes * (weight_bytes(draft) + (0 if own else weight_bytes(lm_head)))


def report(result: GenerationResult, model: Transformer, device: str, draft: Optional[DraftHead] = None,
           tree: Optional[TreeConfig] = None):
    """Tokens/s, the weights read per second as they are read (plain: the target per token; speculative:
    the target per cycle and per plain step, the draft per draft pass; the prefill once), peak memory, and tau."""
    cycles = len(result.accept_lengths)
    if draft is None:  # plain steps, or n-gram lookup's verifies and plain steps: the target once each
        n_bytes = (1 + result.plain_tokens + cycles if cycles else len(result.tokens)) * weight_bytes(model)
    else:  # the prefill, the cycles and the plain steps taken where speculation stepped aside
        n_bytes = (1 + result.plain_tokens) * weight_bytes(model) + cycles * cycle_weight_bytes(model, draft, tree)
    per_rank = " per rank (rank 0's shard)" if model.tp_group is not None else ""
    print(f"\n{len(result.tokens)} tokens in {result.seconds:.2f} s: {result.tokens_per_s:.2f} tokens/s, "
          f"weights read {n_bytes / max(result.seconds, 1e-9) / 1e9:.2f} GB/s{per_rank}, "
          f"peak memory {peak_memory_gb(device):.2f} GB{per_rank}")
    if len(result.tokens) > 1:
        print(f"first token after {result.first_token_seconds * 1e3:.1f} ms (the prefill), then "
              f"{result.decode_tokens_per_s:.2f} tokens/s")
    if result.plain_tokens:
        why = "where the n-gram lookup found no drafts" if draft is None else "speculation stepped aside to time a " \
            "step, or where a cycle cost more than the tokens it gave (--step_aside off: never)"
        print(f"plain steps for {result.plain_tokens} of {len(result.tokens)} tokens: {why}")
    if cycles:
        counts = Counter(result.accept_lengths)
        histogram = ", ".join(f"{n}: {counts[n]}" for n in sorted(counts))
        print(f"tau {result.tau:.2f} tokens emitted per cycle over {cycles} cycles "
              f"(tokens per cycle: count -- {histogram})")


def main(argv=None):
    args = parse_args(argv)
    group, status = None, 0
    if torchrun_rank():  # tensor parallel: rank 0 prints for all
        sys.stdout = open(os.devnull, "w")
    try:
        args.device = pick_device(args.device)
        args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
        args.grammar = grammar_flag(args)
        group = tp.start(args.device)
        model, tokenizer, draft, sampling, tree, prompts, rows = tp.agreed(group, partial(load, group=group),
                                                                           **load_settings(args))
        # the checkpoints as the files load read (a folder names its one file): the tuning's key, the start-up line
        args.checkpoint_path = converted_file(args.checkpoint_path, "model.pth")
        if args.draft_checkpoint_path:
            args.draft_checkpoint_path = converted_file(args.draft_checkpoint_path, "draft.pth")
        if args.draft_model:
            args.draft_model = converted_file(args.draft_model, "model.pth")
        fewest = tp.smallest(group, rows)
        if fewest < rows:  # the ranks' free memory differs: every rank runs the same batches
            rows = fewest
            model.setup_caches(rows, model.max_seq_length)
            if draft is not None:
                draft.setup_caches(model.max_seq_length, rows)
        if draft is not None and args.total_tokens == "auto":  # timed on each rank, rank 0's choice for all
            tree = replace(tree, total_tokens=tp.rank0_value(group, pick_total_tokens(model, tree)))
        if args.tree == "auto":
            encode = partial(encode_prompts, tokenizer, chat=args.chat or args.interactive, system=args.system)
            tree = auto_tree(args, model, draft, encode, group, rows)
        describe(model, draft, tree, args.checkpoint_path, args.draft_checkpoint_path or args.draft_model, args.device,
                 args.precision)
        compile_settings(model, args.device)
        eos_ids = () if args.ignore_eos else tokenizer.eos_ids
        step_fn = speculative_cycle if draft is not None else lookup_cycle if args.ngram else decode_one_token
        step_fn = compile_step(step_fn, args.device) if args.compile else step_fn
        gen = partial(generate, model, sampling=sampling, eos_ids=eos_ids, draft=draft, tree=tree,
                      step_fn=step_fn, prefill_chunk=args.prefill_chunk)
        if args.ngram:  # plain steps where the lookup finds nothing
            gen = partial(gen, lookup=tree, tree=None,
                          plain_fn=compile_step(decode_one_token, args.device) if args.compile else None)
            if args.compile:
                warm_up_lookup(model, tree, step_fn, sampling)
        if step_aside_on(args, draft, sampling, group):  # each generation times its own cycles and steps
            plain_fn = compile_step(decode_one_token, args.device) if args.compile else None
            gen = with_step_aside(gen, plain_fn)
        if getattr(args, "grammar", None):  # a fresh grammar state for every generation (warm-up and samples)
            gen = constrained(gen, tokenizer, model.args.vocab_size, args.grammar)
        show = partial(report, model=model, device=args.device, draft=draft, tree=tree)
        if args.interactive:
            scratch = tree.scratch if draft is not None else 0
            run_interactive(args, gen, tokenizer, model.max_seq_length, scratch, show)
        elif len(prompts) > 1:
            gen_batch = partial(generate_batch, model, sampling=sampling, eos_ids=eos_ids, draft=draft,
                                tree=tree, step_fn=step_fn, prefill_chunk=args.prefill_chunk,
                                lookup=tree if args.ngram else None)
            run_batches(args, gen_batch, tokenizer, prompts, rows)
        else:
            run_once(args, gen, tokenizer, prompts[0], show)
    except EagletError as e:
        status = f"error: {e}" if not torchrun_rank() else 1
    except KeyboardInterrupt:
        print()
        status = 130
    if torchrun_rank() is not None:
        tp.finish(group, status)
    if status:
        sys.exit(status)

if __name__ == "__main__":
    main()
