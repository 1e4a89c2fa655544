"""What bench.py measures, as plain functions that scripts/ and tests call too: random weights of a named shape
(SHAPES) and random heads of each kind, the device's copy bandwidth, timed calls and their kernels, plain decoding
and one EAGLE-2 cycle phase by phase, the side by side with transformers' generate, the evaluation, the tuned tree,
several prompts at once, cache sizes and tensor parallel's collectives. Each returns its figures as a dict; bench.py
turns them into its report.
"""
# Imports generate.py and what is below it (decode, tune, draft, block_draft, model, tp, tokenizer, cli); bench.py,
# scripts/ and tests import it.
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

from cli import SHAPES
from block_draft import DFlash2Draft, DFlashDraft, DSparkDraft, PEagleDraft, XPressDraft
from draft import DraftHead, Eagle3Flags, EagleDraft
from head_formats import dflash_layer_ids
from decode import (TreeConfig, catch_up, commit, decode_one_token, device_sync, generate, keep_new, run_calls,
                    speculative_cycle, verify)
from sampling import SamplingConfig
from graphs import compile_step
from batch import generate_batch
from quantize import weight_bytes
from generate import cycle_weight_bytes
from model import EagletError, ModelArgs, Transformer
from tokenizer import Tokenizer
import tp
from tune import CALIBRATION_TOKENS, TREE_GRID, cycle_start, cycle_timing, tune_tree

SIDE_PROMPT = 64  # the side-by-side run's random prompt tokens


def random_module(module_cls, args, device, dtype, **kwargs):
    """A module of random weights built straight on the device (no checkpoint, no fp32 copy)."""
    with torch.device("meta"):
        module = module_cls(args, **kwargs).to(dtype)
    module = module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
    if isinstance(module, Transformer) and args.tie_word_embeddings:  # to_empty unties shared weights
        module.output.weight = module.tok_embeddings.weight
    return module.eval()


def random_dflash(target: Transformer, device, dtype, n_layers: int = 5, block_size: int = 16, kind=DFlashDraft,
                  **extra) -> DFlashDraft:
    """A random block drafter (DFlashDraft or a subclass, with its own settings in extra) as the published ones are
    shaped: 5 Qwen3 layers of the target's width, blocks of 16, the features of 5 target layers spread as DFlash
    spreads them. The target is set to return the features."""
    args = replace(target.args, n_layer=n_layers, qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False)
    ids = dflash_layer_ids(target.args.n_layer, n_layers)
    draft = random_module(kind, args, device, dtype, n_features=len(ids), block_size=block_size,
                          mask_token_id=target.args.vocab_size - 1, **extra)
    draft.feature_layers = tuple(k + 1 for k in ids)
    target.set_feature_layers(draft.feature_layers)
    return draft


def random_peagle(target: Transformer, device, dtype, block_size: int = 8, draft_vocab: int = 32000) -> PEagleDraft:
    """A random P-EAGLE head as speculators makes one by default: one EAGLE-3 layer of the target's width over the
    features of 3 target layers (2, L//2, L-3), 8 drafts a pass, its own embedding and an lm_head over a draft
    vocabulary of 32,000 (or the whole vocabulary if smaller). The target is set to return the features."""
    n, draft_vocab = target.args.n_layer, min(draft_vocab, target.args.vocab_size)
    layers = tuple(sorted({max(0, min(k, n)) for k in (2, n // 2, n - 3)}))  # fewer on a target of a few layers
    draft = random_module(PEagleDraft, target.args, device, dtype, target_dim=target.args.dim,
                          draft_vocab_size=draft_vocab, own_embedding=True, flags=Eagle3Flags(norm_before_residual=True),
                          n_features=len(layers), block_size=block_size, mask_token_id=target.args.vocab_size - 1)
    draft.draft_to_target = torch.arange(draft_vocab, device=device)
    draft.feature_layers = layers
    target.set_feature_layers(draft.feature_layers)
    return draft


def random_head(kind: str, target: Transformer, device, dtype) -> DraftHead:
    if kind == "dspark":  # deepseek-ai/dspark_qwen3_8b_block7's shape: every row drafting, a rank-256 Markov head
        return random_dflash(target, device, dtype, block_size=7, kind=DSparkDraft, markov_rank=256)
    if kind == "dflash2":  # speculators' defaults: kernels of 2 taps over groups of 16, a rank-256 selector of 16
        return random_dflash(target, device, dtype, kind=DFlash2Draft, kernel_size=2, group_size=16, selector_rank=256,
                             selector_top_k=16)
    if kind == "xpress":  # speculators' defaults (the released heads'): rank 256, MLP ratio 2, 6 Jacobi passes
        return random_dflash(target, device, dtype, kind=XPressDraft, rank=256, mlp_ratio=2, jacobi_passes=6)
    if kind == "peagle":
        return random_peagle(target, device, dtype)
    return random_dflash(target, device, dtype) if kind == "dflash" else random_module(EagleDraft, target.args, device, dtype)


def random_models(shape: str, device, dtype, max_seq_length: int, group=None, head: str = "eagle"):
    """A random target of a named shape (under tensor parallel, this rank's shard of it) and a random head."""
    config = {"model_type": "llama", "max_position_embeddings": max(8192, max_seq_length), **SHAPES[shape]}
    args = ModelArgs.from_hf_config(config)
    if group is None:
        target = random_module(Transformer, args, device, dtype)
    else:
        tp.check_shardable(args, tp.dist.get_world_size(group), None)
        local = tp.local_args(args, tp.dist.get_world_size(group))
        target = tp.joined(random_module(Transformer, local, device, dtype), args, group)
    target.setup_caches(1, max_seq_length)
    draft = random_head(head, target, device, dtype)  # a head of the target's own shape
    draft.setup_caches(max_seq_length)
    return target, draft


def copy_bandwidth(device, n_bytes=1 << 30) -> float:
    """The device's own measured memory bandwidth (bytes/s): a large copy reads and writes every byte."""
    n_bytes = n_bytes if str(device).startswith("cuda") else n_bytes // 4
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    device_sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    device_sync(device)
    return 2 * n_bytes * 10 / (time.perf_counter() - t0)


def graph_count() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def timed(fn, repeats: int, device):
    """Seconds per call after three warm-up calls (compilation, graph capture), and how many new graphs
    were compiled during the timed calls (recompilations: should be 0)."""
    for _ in range(3):
        fn()
    device_sync(device)
    graphs, t0 = graph_count(), time.perf_counter()
    for _ in range(repeats):
        fn()
    device_sync(device)
    return (time.perf_counter() - t0) / repeats, graph_count() - graphs


GREEDY = SamplingConfig()
START_PROMPT = 128  # the context of the timed steps and cycles


def start_state(target: Transformer, draft: EagleDraft, n_prompt: int = START_PROMPT):
    """Caches holding a random prompt, as after generate()'s prefill: (root, ctx_len, h_last)."""
    tokens = torch.randint(0, target.args.vocab_size, (n_prompt,), device=target.output.weight.device)
    return cycle_start(target, draft, tokens.tolist())


@contextmanager
def without_profiler_markers():
    """kineto writes a 'USDT: ... profiler_start' and a '... profiler_stop' line to stderr for every profile,
    below Python (file descriptor 2); KINETO_LOG_LEVEL cannot drop them without dropping its errors too.
    What is written to stderr meanwhile is caught and passed on, all but those lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            os.write(2, b"".join(line for line in caught.read().splitlines(keepends=True)
                                 if not line.startswith(b"USDT:")))


def kernel_table(fn, device, calls: int = 10, top: int = 10) -> dict:
    """Where a call's time goes, by kernel (torch.profiler): on CUDA the kernels launched per call and their
    device time; on CPU the operators and their self time. Run after timed() (compiled, graphs captured)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = str(device).startswith("cuda")
    unit = "CUDA kernels" if cuda else "CPU operators (self time)"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    try:
        with without_profiler_markers(), profile(activities=[activity]) as prof:
            for _ in range(calls):
                fn()
            device_sync(device)
    except Exception as e:  # a diagnostic: a profiler failure must not cost the timings measured beside it
        return {"unit": unit, "error": f"{type(e).__name__}: {e}"[:300]}
    rows = sorted(((e.key, e.count / calls, (e.self_device_time_total if cuda else e.self_cpu_time_total) / calls)
                   for e in prof.key_averages() if e.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU)),
                  key=lambda row: -row[2])
    total_us = sum(us for _, _, us in rows)
    return {"unit": unit, "per_call": sum(n for _, n, _ in rows), "ms_per_call": total_us / 1e3,
            "top": [{"name": name[:100], "per_call": n, "us_per_call": us, "share": us / max(total_us, 1e-9)}
                    for name, n, us in rows[:top]]}


def bench_plain(target, compile_, copy_bw, repeats) -> dict:
    device = target.output.weight.device
    step_fn = compile_step(decode_one_token, str(device)) if compile_ else decode_one_token
    root, ctx_len, _ = start_state(target, None)
    with torch.no_grad():
        read = {} if device.type == "cuda" else {"filled": START_PROMPT + 1}  # as generate.py runs it on a CPU
        step = lambda: step_fn(target, root.view(1, 1), ctx_len.view(1), GREEDY, **read)  # noqa: E731
        step_s, recompiles = timed(step, repeats, device)
        kernels = kernel_table(step, device)
    n_bytes = weight_bytes(target)
    return {"step_ms": step_s * 1e3, "tokens_per_s": 1 / step_s, "weights_GB": n_bytes / 1e9,
            "GB_per_s": n_bytes / step_s / 1e9, "fraction_of_copy_bandwidth": n_bytes / step_s / copy_bw,
            "recompiles_after_warmup": recompiles, "kernels": kernels}


def cache_size_sweep(target, sizes: list, repeats: int) -> dict:
    """A plain step at context START_PROMPT in caches of these sizes, eager and compiled, as generate() runs
    them: on a CPU both attend over the filled slots; compiled on CUDA, over the filled blocks of a fixed-shape
    BlockMask. A step should cost the same at every size; the caches are set back after."""
    device, restore = str(target.output.weight.device), target.max_seq_length
    rows = {}
    for size in sizes:
        target.setup_caches(1, size)
        root, ctx_len, _ = start_state(target, None)
        token, pos, filled = root.view(1, 1), ctx_len.view(1), START_PROMPT + 1
        torch._dynamo.reset()  # a new graph for each size, never one with a dynamic cache length
        step = compile_step(decode_one_token, device)
        with torch.no_grad():
            eager_s, _ = timed(lambda: decode_one_token(target, token, pos, GREEDY, filled), repeats, device)
            read = {} if device.startswith("cuda") else {"filled": filled}
            compiled_s, recompiles = timed(lambda: step(target, token, pos, GREEDY, **read), repeats, device)
        rows[size] = {"eager_step_ms": eager_s * 1e3, "compiled_step_ms": compiled_s * 1e3,
                      "recompiles_after_warmup": recompiles}
        print(f"  {size} slots: eager {eager_s * 1e3:.2f} ms, compiled {compiled_s * 1e3:.2f} ms", flush=True)
    target.setup_caches(1, restore)
    first, last = rows[sizes[0]]["compiled_step_ms"], rows[sizes[-1]]["compiled_step_ms"]
    return {"context": START_PROMPT, "rows": rows, "compiled_largest_over_smallest": last / first}


def cycle_bytes(target, draft, tree: TreeConfig, ctx: int) -> dict:
    """Bytes a cycle must read at least: the target once, the draft head + lm_head once per draft pass, the KV."""
    args, elt = target.args, target.tok_embeddings.weight.element_size()  # the KV cache's dtype
    kv = 2 * args.n_layer * target.layers[0].attention.n_kv * args.head_dim * elt * ctx  # this rank's heads
    return {"plain_step": weight_bytes(target) + kv, "cycle": cycle_weight_bytes(target, draft, tree) + kv}


def bench_cycle(target, draft, tree: TreeConfig, compile_, repeats, plain_step_s, copy_bw, phases: bool = True) -> dict:
    """One cycle at a fixed state, phase by phase (unless phases is False: each phase is one more graph to compile)
    and whole, in ms and in plain decoding steps (None without plain_step_s)."""
    device = target.output.weight.device
    wrap = (lambda f: compile_step(f, str(device))) if compile_ else (lambda f: f)
    levels, keep_phases = tree.levels, phases
    root, ctx_len, h_last = start_state(target, draft)
    with torch.no_grad():
        t = tree.expand(target, draft, root, ctx_len, h_last)
        logits, features = verify(target, t, ctx_len)
        emitted, n_acc, _, path = commit(target, t, logits, ctx_len, GREEDY, levels)
        phases = {
            "catch-up": (wrap(catch_up), (target, draft, emitted, features[path], ctx_len, n_acc)),
            "expansion (draft tree)": (wrap(tree.expand), (target, draft, root, ctx_len, h_last)),
            "verify": (wrap(verify), (target, t, ctx_len)),
            "accept + compaction": (wrap(commit), (target, t, logits, ctx_len, GREEDY, levels)),
            "whole cycle": (wrap(speculative_cycle), (target, draft, root, ctx_len, h_last, tree, GREEDY)),
        }
        rows = {}
        for name, (fn, args) in (phases.items() if keep_phases else [("whole cycle", phases["whole cycle"])]):
            seconds, recompiles = timed(lambda: fn(*args), repeats, device)
            rows[name] = {"ms": seconds * 1e3, "plain_steps": seconds / plain_step_s if plain_step_s else None,
                          "recompiles_after_warmup": recompiles, "kernels": kernel_table(lambda: fn(*args), device)}
    floor = cycle_bytes(target, draft, tree, int(ctx_len))
    whole = rows["whole cycle"]["ms"] / 1e3
    return {"phases": rows, "context": int(ctx_len), "draft_passes": tree.draft_passes(draft),
            "floor_plain_steps": floor["cycle"] / floor["plain_step"],
            "floor_ms": floor["cycle"] / copy_bw * 1e3, "measured_over_floor": whole / (floor["cycle"] / copy_bw),
            "cycle_bytes_GB": floor["cycle"] / 1e9, "plain_step_bytes_GB": floor["plain_step"] / 1e9}


def run_eval(target, draft, tree, tokenizer: Tokenizer, tasks: dict, max_new_tokens: int, step_fns: dict) -> dict:
    """Multi-turn chat over FastChat question files, each turn decoded plainly and speculatively (greedy).
    Each conversation goes on with the speculative reply; differing outputs are counted and shown."""
    rows = {}
    for task, questions in tasks.items():
        stats = {"plain_tokens": 0, "plain_s": 0.0, "spec_tokens": 0, "spec_s": 0.0, "accept_lengths": [],
                 "turns": 0, "mismatches": [], "skipped": 0}
        for i, q in enumerate(questions):
            print(f"{task}: question {i + 1}/{len(questions)}", flush=True)
            messages = []
            for turn in q["turns"]:
                messages.append({"role": "user", "content": turn})
                prompt = tokenizer.encode_chat(messages)
                try:
                    plain = generate(target, prompt, max_new_tokens, GREEDY, tokenizer.eos_ids, step_fn=step_fns["plain"])
                    spec = generate(target, prompt, max_new_tokens, GREEDY, tokenizer.eos_ids, draft=draft, tree=tree,
                                    step_fn=step_fns["spec"])
                except tp.RanksDisagree:
                    raise
                except EagletError:  # the conversation outgrew the cache
                    stats["skipped"] += 1
                    break
                stats["turns"] += 1
                stats["plain_tokens"] += len(plain.tokens)
                stats["plain_s"] += plain.seconds
                stats["spec_tokens"] += len(spec.tokens)
                stats["spec_s"] += spec.seconds
                stats["accept_lengths"] += spec.accept_lengths
                if spec.tokens != plain.tokens:
                    first = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b),
                                 min(len(spec.tokens), len(plain.tokens)))
                    stats["mismatches"].append({"question_id": q.get("question_id"), "first_differing_token": first})
                messages.append({"role": "assistant", "content": tokenizer.decode(spec.tokens)})
        lengths = stats.pop("accept_lengths")
        plain_tps = stats["plain_tokens"] / max(stats["plain_s"], 1e-9)
        spec_tps = stats["spec_tokens"] / max(stats["spec_s"], 1e-9)
        rows[task] = {**stats, "tau": sum(lengths) / max(len(lengths), 1), "plain_tokens_per_s": plain_tps,
                      "spec_tokens_per_s": spec_tps, "speedup": spec_tps / max(plain_tps, 1e-9)}
    return rows


def hf_twin(target: Transformer):
    """The same weights inside transformers (the baseline the EAGLE papers measure against)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from convert_common import export_layer
    a = target.args
    config = AutoConfig.for_model(
        a.model_type, vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.n_layer, num_attention_heads=a.n_head, num_key_value_heads=a.n_local_heads,
        head_dim=a.head_dim, rms_norm_eps=a.norm_eps, rope_theta=a.rope_base, rope_scaling=a.rope_scaling,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
        attention_bias=a.qkv_bias, mlp_bias=a.mlp_bias)
    sd = target.state_dict()
    weights = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"],
               "lm_head.weight": sd["output.weight"]}
    for i in range(a.n_layer):
        weights.update(export_layer(sd, f"layers.{i}.", f"model.layers.{i}.", a))
    weight = target.tok_embeddings.weight
    with torch.device(weight.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=weight.dtype)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    # Only rotary buffers (persistent in older transformers) may be missing: any other weight left out of the
    # export would run on its random initial values, and the side-by-side would compare different models.
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise EagletError(f"transformers' {a.model_type} does not hold the same weights as ours: missing "
                          f"{missing[:5]}, unexpected {unexpected[:5]} (export_layer and hf_twin disagree)")
    return hf.eval()


@torch.no_grad()
def hf_step_ms(hf, ids, steps: int = 16) -> float:
    """One decoding forward of the transformers model with its KV cache, outside generate (what generate's
    own overhead adds is the difference)."""
    out = hf(ids, use_cache=True)
    device_sync(ids.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = hf(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    device_sync(ids.device)
    return (time.perf_counter() - t0) / steps * 1e3


def side_by_side(target, draft, tree, step_fns, n_tokens: int, with_hf: bool, prompt=None) -> dict:
    """The same prompt (default: SIDE_PROMPT random tokens) and weights: transformers' generate, our plain
    decoding, our EAGLE-2 (tokens/s); speedups over the first of them."""
    device = target.output.weight.device
    prompt = prompt or torch.randint(0, min(target.args.vocab_size, 32000), (SIDE_PROMPT,)).tolist()
    rows = {}
    if with_hf:
        hf, ids = hf_twin(target), torch.tensor([prompt], device=device)
        kwargs = dict(max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            hf.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
            device_sync(device)
            t0 = time.perf_counter()
            hf_tokens = hf.generate(ids, **kwargs)[0, len(prompt):].tolist()
            device_sync(device)
        rows["transformers generate"] = {"tokens_per_s": n_tokens / (time.perf_counter() - t0),
                                         "forward_step_ms": hf_step_ms(hf, ids)}
        del hf
    for name, kwargs in [("eaglet plain", {"step_fn": step_fns["plain"]}),
                         ("eaglet EAGLE-2", {"draft": draft, "tree": tree, "step_fn": step_fns["spec"]})]:
        generate(target, prompt, 16, GREEDY, **kwargs)  # warm-up (compilation)
        result = generate(target, prompt, n_tokens, GREEDY, **kwargs)
        rows[name] = {"tokens_per_s": result.tokens_per_s, "tau": result.tau if result.accept_lengths else None,
                      "tokens": result.tokens, "first_token_ms": result.first_token_seconds * 1e3,
                      "decode_tokens_per_s": result.decode_tokens_per_s,
                      "decode_ms": (result.seconds - result.first_token_seconds) * 1e3,
                      "calls": len(result.accept_lengths) if "draft" in kwargs else len(result.tokens) - 1}
    if with_hf:  # same weights, same greedy tokens (bf16 may flip a rare near-tie)
        rows["transformers generate"]["tokens"] = hf_tokens
    base = rows[speedup_base(rows)]["tokens_per_s"]
    plain_tokens = rows["eaglet plain"]["tokens"]
    for row in rows.values():
        row["speedup"] = row["tokens_per_s"] / base
        row["same_tokens_as_plain"] = row.pop("tokens") == plain_tokens
    return rows


def loop_host_us(levels: int, calls: int = 20000) -> dict:
    """The host's own cost per call of generate's loop (run_calls: queue, read back, emit, stop checks) with the
    device work taken out: the call returns tokens already computed, on the CPU."""
    out = {}
    for name, width in [("plain", 1), ("EAGLE-2", levels + 1)]:
        done = torch.tensor([levels - 1] + [7] * levels) if width > 1 else torch.tensor([7])
        tokens = []
        emit = partial(keep_new, tokens, eos_ids=(), max_new_tokens=calls * width)
        t0 = time.perf_counter()
        run_calls(lambda state, filled: (done, state), None, 1, tokens, emit, calls * width, width, True,
                  [] if width > 1 else None)
        n_calls = len(tokens) / (levels if width > 1 else 1)
        out[name] = (time.perf_counter() - t0) / n_calls * 1e6
    return out


def tuned_tree(target, draft, flags_tree: TreeConfig, calibration: list, prompt, n_tokens: int, compile_: bool,
               group) -> dict:
    """generate.py --tree auto's grid measured here (tau, cycle time, tokens/s = tau / cycle), its choice, and the
    side-by-side prompt (default: SIDE_PROMPT random tokens) decoded end to end with that tree and with the
    flags' tree (greedy: both must give the same tokens)."""
    device = str(target.output.weight.device)
    t0 = time.perf_counter()
    chosen, measured = tune_tree(target, draft, calibration, draft.tree_grid() or TREE_GRID, CALIBRATION_TOKENS,
                                 log=print)
    chosen = tp.rank0_value(group, chosen)
    tuning_s = time.perf_counter() - t0
    prompt = prompt or torch.randint(0, min(target.args.vocab_size, 32000), (SIDE_PROMPT,)).tolist()
    runs = {}
    for name, tree in (("flags", flags_tree), ("tuned", chosen)):
        step_fn = compile_step(speculative_cycle, device) if compile_ else speculative_cycle
        generate(target, prompt, 16, GREEDY, draft=draft, tree=tree, step_fn=step_fn)  # warm-up (compilation)
        result = generate(target, prompt, n_tokens, GREEDY, draft=draft, tree=tree, step_fn=step_fn)
        runs[name] = {"tree": asdict(tree), "tokens_per_s": result.tokens_per_s,
                      "tau": result.tau if result.accept_lengths else None, "tokens": result.tokens}
    same = runs["flags"].pop("tokens") == runs["tuned"].pop("tokens")
    return {"grid": [{**asdict(m.tree), "tau": m.tau, "cycle_ms": m.cycle_s * 1e3, "tokens_per_s": m.tokens_per_s}
                     for m in measured],
            "chosen": asdict(chosen), "tuning_s": tuning_s, "cycle_timing": cycle_timing(target),
            "calibration_tokens": CALIBRATION_TOKENS, "end_to_end": runs, "same_tokens": same,
            "speedup": runs["tuned"]["tokens_per_s"] / runs["flags"]["tokens_per_s"]}


def batch_sweep(target, draft, tree, sizes: list, prompts: list, n_tokens: int, compile_: bool) -> dict:
    """Several prompts at once, greedy, n_tokens each (no EOS): total tokens/s and the mean time until a row is
    done, plain and EAGLE-2, per batch size; and the first batch size at which EAGLE-2 no longer beats plain."""
    device, size = str(target.output.weight.device), target.max_seq_length
    target.setup_caches(max(sizes), size)
    draft.setup_caches(size, max(sizes))
    rows = {"plain": {}, "EAGLE-2": {}}
    for mode, fn in (("plain", decode_one_token), ("EAGLE-2", speculative_cycle)):
        kwargs = {"step_fn": compile_step(fn, device) if compile_ else fn}
        if mode == "EAGLE-2":
            kwargs.update(draft=draft, tree=tree)
        for b in sizes:
            print(f"batch size {b}: {mode}", flush=True)
            generate_batch(target, prompts[:b], min(16, n_tokens), GREEDY, **kwargs)  # warm-up (compilation)
            device_sync(device)
            t0 = time.perf_counter()
            results = generate_batch(target, prompts[:b], n_tokens, GREEDY, **kwargs)
            seconds = time.perf_counter() - t0
            cycles = sum(len(r.accept_lengths) for r in results)
            rows[mode][b] = {"tokens_per_s": sum(len(r.tokens) for r in results) / seconds,
                             "latency_s": sum(r.seconds for r in results) / b,
                             "tau": sum(sum(r.accept_lengths) for r in results) / cycles if cycles else None}
    target.setup_caches(1, size)
    draft.setup_caches(size)
    stops = next((b for b in sizes if rows["EAGLE-2"][b]["tokens_per_s"] <= rows["plain"][b]["tokens_per_s"]), None)
    return {"rows": rows, "tokens": n_tokens, "eagle_stops_beating_plain_at": stops}


def speedup_base(rows: dict) -> str:
    """The side-by-side row the speedups divide by: transformers' generate if it ran, else our plain decoding."""
    return "transformers generate" if "transformers generate" in rows else "eaglet plain"


def git_commit() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def tensor_parallel(target, draft, tree: TreeConfig, group) -> dict:
    """Under torchrun: ranks, the weights one rank reads per forward, and the collectives a plain step and a
    cycle run, counted as they run (eagerly) at the benchmark's start state."""
    root, ctx_len, h_last = start_state(target, draft)
    with torch.no_grad():
        step = tp.collectives(lambda: decode_one_token(target, root.view(1, 1), ctx_len.view(1), GREEDY))
        cycle = tp.collectives(lambda: speculative_cycle(target, draft, root, ctx_len, h_last, tree, GREEDY))
    return {"ranks": tp.dist.get_world_size(group), "weights_per_rank_GB": weight_bytes(target) / 1e9,
            "collectives_per_plain_step": step, "collectives_per_cycle": cycle}
