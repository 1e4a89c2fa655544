"""Check and measure a GPU in one command: the environment, the attention kernel of every call the cycle
makes, compiled == eager, CUDA-graph skips and recompilations, then the demo inflated to LLaMA-2-7B and
LLaMA-3-8B shapes, in each weight format of --formats side by side (bf16, and int8 / int4 quantized in
memory from it): plain decoding against the copy bandwidth, one EAGLE-2 cycle against its bytes floor (the
first format of the first shape), plain vs EAGLE-2 end to end on the same weights (real acceptance: the
demo's, through each format's rounding), the weight bytes a token costs, and the tree size
--total_tokens auto picks for that format. --eagle3 adds the demo's EAGLE-3 head (demo/head3 inflated beside
the EAGLE-2 head, its draft vocabulary padded to 32000 on LLaMA-3-8B's shape) on the same target weights: its
cycle phase by phase next to EAGLE-2's, and plain vs EAGLE-3 end to end with the demo head3's tau. --dflash adds
a random DFlash head of the published shape (5 layers, blocks of 16): its cycle phase by phase, chain and tree;
and the demo's DFlash head inflated: plain vs DFlash end to end with its tau. --dspark adds a random DSpark head
of the published 8B shape beside a random DFlash head: both cycles phase by phase, chain and tree.

    python scripts/gpu_check.py --out gpu_results --quick     # a first, short call: environment and checks
    python scripts/gpu_check.py --out gpu_results             # everything, within --budget_s seconds
    python scripts/gpu_check.py --out g7 --skip_checks --skip_cycle_table --shapes llama2-7b --budget_s 330
    python scripts/gpu_check.py --out gk --quick --skip_checks --linear_kernels --int4_13b
    python scripts/gpu_check.py --out gt --quick --skip_checks --tp1
    python scripts/gpu_check.py --out g3 --skip_checks --shapes llama3-8b --formats bf16 --eagle3
    python scripts/gpu_check.py --out gd --skip_checks --shapes llama3-8b --formats bf16 --dflash
    python scripts/gpu_check.py --out gs --skip_checks --shapes llama3-8b --formats bf16 --dspark

--tp1 runs the demo compiled under torchrun at world size 1 (the NCCL path of tensor parallelism, its
all-reduces inside the CUDA-graphed cycle) and in one process, and compares tokens, accepted lengths and
tokens/s.

--linear_kernels times one bf16 / int8 / int4 g128 Linear of the 7B shape at 1 to 64 rows (does a kernel
read its weights once, or once per tile of rows?); --int4_13b runs LLaMA-2-13B's shape in int4 g128 and
records its peak GPU memory (does it fit in 24 GB?). Results are written after every section
(OUT/results.json and OUT/results.md), so a crash or a timeout keeps what was measured; a failing section
is recorded with its error and the next one runs. Sections that would start after --budget_s are skipped
and say so. On a CPU (--device cpu) the same code runs as a smoke test on reduced shapes.
"""
import gc
import json
import logging
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
import cuda_exact  # noqa: E402
import decode  # noqa: E402
import generate  # noqa: E402
from decode import TreeConfig, decode_one_token, speculative_cycle  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from graphs import compile_settings, compile_step  # noqa: E402
from load import PRECISIONS, check_writable, pick_device  # noqa: E402
from quantize import (GROUPSIZES, pack_quantized, quantize_state_dict, use_quantized_linears, weight_bytes,  # noqa: E402
                      weights_format)
from cli import cli_parser, int_flag  # noqa: E402
from inflate_demo import DEMO_DIR, SHAPES, inflate, inflate_dflash, inflate_head3  # noqa: E402
import attention  # noqa: E402
import model  # noqa: E402
from attention import attention_mask, causal_mask, decode_block_mask, sdpa_inputs  # noqa: E402
from model import QUANT_KEY, EagletError, Transformer  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
import tune  # noqa: E402

REDUCED = dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
               num_key_value_heads=2, head_dim=128, max_position_embeddings=8192)  # as tests/test_inflate.py
SHAPES = {**SHAPES, "reduced": REDUCED}  # --shapes reduced: a CPU dry run of a GPU call's sections
GREEDY = SamplingConfig()
PROMPT = "def read_lines(path):\n"
# weight formats: None = the inflated weights as they are (bf16 on CUDA, fp32 on CPU); (mode, groupsize)
FORMATS = {"bf16": None, "int8": ("int8", 0), "int4": ("int4", 128),
           **{f"int4.g{g}": ("int4", g) for g in GROUPSIZES}}
# linear kernels by rows: LLaMA-2-7B's matrices (out x in) on CUDA, one tiny one as a CPU smoke test
LINEAR_SHAPES = {"cuda": {"4096x4096 (wqkv part, wo)": (4096, 4096), "11008x4096 (w1, w3)": (11008, 4096),
                          "4096x11008 (w2)": (4096, 11008)},
                 "cpu": {"64x128 (CPU smoke test)": (64, 128)}}
LINEAR_ROWS = {"cuda": (1, 16, 17, 32, 48, 60, 64), "cpu": (1, 16, 17)}
L2_SPILL_BYTES = 256 << 20  # weights timed in one graph: several times an H100's 50 MB L2, so none is re-read from it
INT4_13B_CACHE = 2048  # KV cache slots of the 13B int4 run


class Report:
    """Results written as they come: OUT/results.json and a markdown rendering of it."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s, self.t0 = out, budget_s, time.perf_counter()
        self.results = {}

    def section(self, name: str, fn, *args):
        if time.perf_counter() - self.t0 > self.budget_s:
            self.results[name] = {"skipped": f"time budget of {self.budget_s:.0f} s spent"}
        else:
            print(f"== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                self.results[name] = fn(*args)
            except Exception as e:  # keep going: the next section may still measure something
                self.results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            if isinstance(self.results[name], dict):
                self.results[name]["section_seconds"] = round(time.perf_counter() - t0, 1)
        self.write()
        return self.results[name]

    def write(self):
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        lines = [f"# GPU check ({time.strftime('%Y-%m-%d')}, commit {measure.git_commit()})", ""]
        for name, value in self.results.items():
            lines += [f"## {name}", "", "```", json.dumps(value, indent=1, default=str)[:30000], "```", ""]
        (self.out / "results.md").write_text("\n".join(lines))


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
           "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"}
    env["copy_GB_per_s"] = measure.copy_bandwidth(device) / 1e9
    return env


def backend_name(inputs: dict) -> str:
    from torch.nn.attention import SDPBackend
    return SDPBackend(torch._fused_sdp_choice(**inputs)).name


def attention_backends(target, draft, tree: TreeConfig, n_prompt: int = 128) -> dict:
    """For each attention call of a run: what the eager code gives SDPA (and which kernel SDPA picks), and
    what the compiled code runs (flex_attention over a block mask when it decodes on CUDA, else SDPA)."""
    device, dtype = target.tok_embeddings.weight.device, target.tok_embeddings.weight.dtype
    S = target.max_seq_length
    ctx = torch.tensor(n_prompt, device=device)

    def qkv(model_args, n):
        q = torch.randn(1, model_args.n_head, n, model_args.head_dim, device=device, dtype=dtype)
        k = torch.randn(1, model_args.n_local_heads, S, model_args.head_dim, device=device, dtype=dtype)
        return q, k, k.clone()

    eye = torch.eye(tree.topk, dtype=torch.bool, device=device)
    calls = {  # name: (model args, eager mask, compiled mask)
        f"prefill T={n_prompt}": (target.args, causal_mask(torch.arange(n_prompt, device=device), n_prompt), None),
        "decode T=1": (target.args, causal_mask(ctx.view(1), n_prompt + 1), causal_mask(ctx.view(1), S)),
        f"verify T={tree.total_tokens}": (target.args, None, attention_mask(
            ctx, torch.ones(tree.total_tokens, tree.total_tokens, dtype=torch.bool, device=device).tril(), S)),
        f"draft frontier T={tree.topk}": (draft.args, None, attention_mask(ctx, eye, S)),
        f"catch-up T={tree.levels}": (draft.args, None, causal_mask(ctx + torch.arange(tree.levels, device=device), S)),
    }
    rows = {}
    for name, (args, eager_mask, compiled_mask) in calls.items():
        row = {}
        if eager_mask is not None:
            row["eager"] = "SDPA " + backend_name(sdpa_inputs(*qkv(args, eager_mask.shape[0]), eager_mask))
        if compiled_mask is not None:
            if device.type == "cuda" and attention.FLEX_ATTENTION and compiled_mask.shape[0] == 1:
                bm = decode_block_mask(ctx.view(1), S)
                read = int(bm.kv_num_blocks[0, 0].max() + bm.full_kv_num_blocks[0, 0].max())
                row["compiled"] = f"flex_attention, {read} of {bm.kv_indices.shape[-1]} cache blocks read"
            else:
                row["compiled"] = "SDPA " + backend_name(sdpa_inputs(*qkv(args, compiled_mask.shape[0]), compiled_mask))
        rows[name] = row
    math_calls = [n for n, r in rows.items() for v in r.values() if "MATH" in v]
    rows["math_backend_on_cuda"] = math_calls if device.type == "cuda" else "n/a (CPU)"
    return rows


def compiled_vs_eager(target, draft, tree: TreeConfig, prompt: list, n_tokens: int) -> dict:
    """Greedy tokens eager and compiled (plain and EAGLE-2), compile times, graphs compiled after warm-up,
    CUDA-graph skips (counter and log)."""
    from torch._dynamo.utils import counters
    device = str(target.output.weight.device)
    skips_logged = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "skipping cudagraphs" in record.getMessage():
                skips_logged.append(record.getMessage()[:300])
    handler = Catch()
    logging.getLogger("torch").addHandler(handler)
    out = {}
    try:
        for name, kwargs, fn in [("plain", {}, decode_one_token),
                                 ("EAGLE-2", {"draft": draft, "tree": tree}, speculative_cycle)]:
            eager = decode.generate(target, prompt, n_tokens, GREEDY, **kwargs)
            step = compile_step(fn, device)
            t0 = time.perf_counter()
            decode.generate(target, prompt, 16, GREEDY, step_fn=step, **kwargs)  # compilation, capture
            compile_s = time.perf_counter() - t0
            graphs = counters["stats"]["unique_graphs"]
            compiled = decode.generate(target, prompt, n_tokens, GREEDY, step_fn=step, **kwargs)
            compiled2 = decode.generate(target, prompt[:-3], n_tokens, GREEDY, step_fn=step, **kwargs)
            first_diff = next((i for i, (a, b) in enumerate(zip(eager.tokens, compiled.tokens)) if a != b), None)
            out[name] = {"same_tokens": eager.tokens == compiled.tokens, "first_difference": first_diff,
                         "compile_and_warm_up_s": round(compile_s, 1),
                         "graphs_compiled_after_warm_up": counters["stats"]["unique_graphs"] - graphs,
                         "tau_eager": eager.tau if eager.accept_lengths else None,
                         "tau_compiled": compiled.tau if compiled.accept_lengths else None,
                         "same_tokens_second_prompt": compiled2.tokens == decode.generate(
                             target, prompt[:-3], n_tokens, GREEDY, **kwargs).tokens}
        out["cudagraph_skips_counter"] = int(counters["inductor"]["cudagraph_skips"])
        out["cudagraph_skips_logged"] = skips_logged
    finally:
        logging.getLogger("torch").removeHandler(handler)
    return out


def cache_size_check(target, n_ctx: int = 256, repeats: int = 50) -> dict:
    """A compiled plain step at context n_ctx in caches of 512, 4096 and 8192 slots (at most the model's
    longest): besides the masked read of the unused slots it should cost the same. (A K/V write that compiled
    into a copy of the whole cache once made it grow with layers x slots.)"""
    device = str(target.output.weight.device)
    sizes = sorted({min(s, target.args.max_position_embeddings) for s in (512, 4096, 8192)})
    rows = {}
    for size in sizes:
        target.setup_caches(1, size)
        torch._dynamo.reset()  # a graph of its own for each size, never one with a dynamic cache length
        step = compile_step(decode_one_token, device)
        token, pos = torch.zeros(1, 1, dtype=torch.long, device=device), torch.tensor([n_ctx], device=device)
        with torch.no_grad():
            seconds, recompiles = measure.timed(lambda: step(target, token, pos, GREEDY), repeats, device)
        rows[f"{size} slots"] = {"step_ms": seconds * 1e3, "recompiles_after_warmup": recompiles}
    first, last = (rows[f"{s} slots"]["step_ms"] for s in (sizes[0], sizes[-1]))
    rows["largest_over_smallest"] = last / first
    return rows


def release_memory(device: str):
    """Drop every compiled graph (each format compiles its own; CUDA-graph pools hold memory, and dynamo's
    cache per function is bounded) and the blocks of freed models."""
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def format_target(source: Transformer, fmt: str) -> Transformer:
    """source itself for bf16; else its weights quantized in memory, on its device, activations in its dtype."""
    if FORMATS[fmt] is None:
        return source
    mode, groupsize = FORMATS[fmt]
    weight = source.tok_embeddings.weight
    return Transformer.from_state_dict(source.args, quantize_state_dict(source.state_dict(), mode, groupsize),
                                       weight.device, weight.dtype, f"the {fmt} weights")


def eagle_bytes(target, draft, tree: TreeConfig, side: dict) -> dict:
    """EAGLE-2 end to end, and the weight bytes a token costs: a cycle's (the target once, the head and the
    lm_head it scores with depth + 1 times) over the tokens a cycle emits (tau)."""
    spec, plain = side["eaglet EAGLE-2"], side["eaglet plain"]
    cycle_gb = generate.cycle_weight_bytes(target, draft, tree) / 1e9
    per_token_gb = cycle_gb / (spec["tau"] or 1)  # no tau: the run stopped at the first token
    return {"tokens_per_s": spec["tokens_per_s"], "tau": spec["tau"],
            "same_tokens_as_plain": spec["same_tokens_as_plain"],
            "over_plain_end_to_end": spec["tokens_per_s"] / plain["tokens_per_s"],
            "plain_end_to_end_tokens_per_s": plain["tokens_per_s"], "cycle_weight_GB": cycle_gb,
            "weight_GB_per_token": per_token_gb, "GB_per_s": per_token_gb * spec["tokens_per_s"]}


def format_ready(source: Transformer, fmt: str, args) -> Transformer:
    """The target in this format with its KV cache, compiled as graphs.compile_settings would."""
    target = format_target(source, fmt)
    # as graphs.compile_settings: coordinate-descent tuning for quantized weights (global: reset per format)
    torch._inductor.config.coordinate_descent_tuning = args.coordinate_descent or target.quantization is not None
    target.setup_caches(1, args.max_seq_length)
    return target


def measure_format(source: Transformer, draft, fmt: str, copy_bw: float, prompt: list, args, first: bool) -> dict:
    """One shape in one weight format: plain decoding, the cycle phase by phase (if first), plain vs EAGLE-2
    end to end, and the tree size --total_tokens auto picks (verify costs differ by format)."""
    target = format_ready(source, fmt, args)
    target.set_feature_layers(draft.feature_layers)  # as load_draft does: the inflated head fits any format
    tree = TreeConfig(args.depth, args.tree_topk, args.total_tokens)
    out = {"weights": weights_format(target),
           "weights_GB": weight_bytes(target) / 1e9}
    if args.draft_vocab and args.draft_vocab < target.args.vocab_size:
        # the first ids hold all of the demo's tokens (the rows past them never win), so the drafts are the
        # same as with the whole vocabulary: this measures FR-Spec's cost, not its effect on acceptance
        draft.restrict_vocab(target, torch.arange(args.draft_vocab))  # rows of this format's lm_head
        out["draft_vocab"] = args.draft_vocab
    out["plain"] = measure.bench_plain(target, True, copy_bw, args.repeats)
    if args.plain_only:
        return out
    device = str(target.output.weight.device)
    if first and not args.skip_cycle_table:
        step_s = out["plain"]["step_ms"] / 1e3
        out["cycle"] = measure.bench_cycle(target, draft, tree, True, args.repeats, step_s, copy_bw)
    step_fns = {"plain": compile_step(decode_one_token, device),
                "spec": compile_step(speculative_cycle, device)}
    with_hf = first and args.hf and target.quantization is None
    out["side_by_side"] = measure.side_by_side(target, draft, tree, step_fns, args.side_tokens, with_hf, prompt)
    out["EAGLE-2"] = eagle_bytes(target, draft, tree, out["side_by_side"])
    timings = []
    out["total_tokens_auto"] = tune.pick_total_tokens(target, tree, log=timings.append)
    out["total_tokens_auto_log"] = timings[-1]  # the verify's ms at each tree size
    return out


def measure_eagle3(source: Transformer, draft3, fmt: str, plain_step_s: float, copy_bw: float, prompt: list, args,
                   first: bool) -> dict:
    """The EAGLE-3 head on the same target weights and tree as EAGLE-2 (measure_format's): its cycle phase by
    phase (if first), plain vs EAGLE-3 end to end, the weight bytes a token costs (its own lm_head over its
    draft vocabulary). plain_step_s: measure_format's plain step, the unit of the cycle's phases."""
    target = format_ready(source, fmt, args)
    target.set_feature_layers(draft3.feature_layers)
    tree = TreeConfig(args.depth, args.tree_topk, args.total_tokens)
    device = str(target.output.weight.device)
    out = {"feature_layers": list(draft3.feature_layers), "draft_vocab": draft3.vocab_size}
    if first and not args.skip_cycle_table:
        out["cycle"] = measure.bench_cycle(target, draft3, tree, True, args.repeats, plain_step_s, copy_bw)
    step_fns = {"plain": compile_step(decode_one_token, device),
                "spec": compile_step(speculative_cycle, device)}
    side = measure.side_by_side(target, draft3, tree, step_fns, args.side_tokens, False, prompt)
    out["end_to_end"] = eagle_bytes(target, draft3, tree, side)
    out["side_by_side"] = {"eaglet EAGLE-3" if name == "eaglet EAGLE-2" else name: row for name, row in side.items()}
    return out


def measure_dflash(source: Transformer, fmt: str, plain_step_s: float, copy_bw: float, args) -> dict:
    """A random DFlash head shaped as the published ones (5 layers, blocks of 16, 5 feature layers) on the same
    target weights: its cycle phase by phase as a chain of the whole block and as a 32-token tree at the block's
    depth, beside EAGLE-2's (random weights: tau means nothing; the cycle's cost is what is measured)."""
    target = format_ready(source, fmt, args)
    device = target.output.weight.device
    draft = measure.random_dflash(target, device, target.tok_embeddings.weight.dtype)
    draft.setup_caches(args.max_seq_length)
    out = {"feature_layers": list(draft.feature_layers), "block_size": draft.block_size, "layers": draft.args.n_layer}
    for i, (name, tree) in enumerate((("chain", TreeConfig(14, 1, 16)), ("tree", TreeConfig(14, 4, 32)))):
        out[name] = timed_cycle(target, draft, tree, plain_step_s, copy_bw, args, phases=i == 0)
    return out


def timed_cycle(target, draft, tree: TreeConfig, plain_step_s: float, copy_bw: float, args, phases: bool) -> dict:
    """bench_cycle within the call's budget: phase by phase for a section's first configuration only (each phase is
    a graph to compile: the rest get the whole cycle), none at all once --budget_s is spent."""
    if time.perf_counter() > args.deadline:
        return {"skipped": f"time budget of {args.budget_s} s spent"}
    return measure.bench_cycle(target, draft, tree, True, args.repeats, plain_step_s, copy_bw, phases=phases)


def measure_dflash_demo(source: Transformer, fmt: str, prompt: list, args) -> dict:
    """The demo's DFlash head (blocks of 8), inflated for the same target: plain vs DFlash end to end with its real
    tau, as a chain of the whole block and as a 16-token tree from the same pass, and the weight bytes a token
    costs."""
    head = inflate_dflash(DEMO_DIR, source)[0]
    head.setup_caches(args.max_seq_length)
    target = format_ready(source, fmt, args)
    target.set_feature_layers(head.feature_layers)
    device = str(target.output.weight.device)
    out = {"feature_layers": list(head.feature_layers), "block_size": head.block_size}
    step_fns = {"plain": compile_step(decode_one_token, device),
                "spec": compile_step(speculative_cycle, device)}
    for name, tree in (("chain 8", TreeConfig(6, 1, 8)), ("tree 16", TreeConfig(6, 4, 16))):
        side = measure.side_by_side(target, head, tree, step_fns, args.side_tokens, False, prompt)
        out[name] = eagle_bytes(target, head, tree, side)
    return out


def measure_dspark(source: Transformer, fmt: str, plain_step_s: float, copy_bw: float, args) -> dict:
    """A random DSpark head shaped as deepseek-ai/dspark_qwen3_8b_block7 (5 layers, blocks of 7 every row drafting,
    Markov rank 256) beside a random DFlash head of the published shape, on the same target weights: each cycle
    at equal verify sizes, a chain of 8 (7 drafts) and a 32-token tree over 7 levels (the DSpark tree walks its
    Markov lattice; the DFlash one grows from the rows alone): DSpark's chain phase by phase, the rest whole (a
    phase table compiles five graphs: four of them over-ran a 190 s budget on an H200). Random weights: tau means nothing,
    the cost of the Markov walk and of each tree is what is measured."""
    target = format_ready(source, fmt, args)
    device, dtype = target.output.weight.device, target.tok_embeddings.weight.dtype
    out = {}
    for kind, draft in (("DSpark", measure.random_dflash(target, device, dtype, block_size=7, markov_rank=256)),
                        ("DFlash", measure.random_dflash(target, device, dtype))):
        draft.setup_caches(args.max_seq_length)
        for name, tree in (("chain 8", TreeConfig(6, 1, 8)), ("tree 32", TreeConfig(6, 4, 32))):
            out[f"{kind} {name}"] = timed_cycle(target, draft, tree, plain_step_s, copy_bw, args, phases=not out)
        del draft
        release_memory(device)
    return out


def format_row(result: dict, eagle3: dict) -> dict:
    """One format's line of the side-by-side table (or why it has none); eagle3: its EAGLE-3 section's."""
    if "plain" not in result:
        return {k: result[k] for k in ("skipped", "error") if k in result}
    plain = result["plain"]
    row = {"weights": result["weights"], "weights_GB": result["weights_GB"], "plain_step_ms": plain["step_ms"],
           "plain_tokens_per_s": plain["tokens_per_s"], "plain_GB_per_s": plain["GB_per_s"],
           "plain_fraction_of_copy": plain["fraction_of_copy_bandwidth"]}
    if "EAGLE-2" in result:
        spec = result["EAGLE-2"]
        row.update({"eagle2_tokens_per_s": spec["tokens_per_s"], "tau": spec["tau"],
                    "eagle2_same_tokens_as_plain": spec["same_tokens_as_plain"],
                    "eagle2_over_plain_end_to_end": spec["over_plain_end_to_end"],
                    "eagle2_weight_GB_per_token": spec["weight_GB_per_token"], "eagle2_GB_per_s": spec["GB_per_s"],
                    "total_tokens_auto": result["total_tokens_auto"]})
    if "end_to_end" in eagle3:
        spec = eagle3["end_to_end"]
        row.update({"eagle3_tokens_per_s": spec["tokens_per_s"], "eagle3_tau": spec["tau"],
                    "eagle3_same_tokens_as_plain": spec["same_tokens_as_plain"],
                    "eagle3_over_plain_end_to_end": spec["over_plain_end_to_end"],
                    "eagle3_weight_GB_per_token": spec["weight_GB_per_token"]})
    elif eagle3:  # skipped (time budget) or failed
        row["eagle3"] = {k: eagle3[k] for k in ("skipped", "error") if k in eagle3}
    return row


def measure_shape(report: Report, name: str, shape: dict, device: str, dtype, prompt: list, args, first: bool) -> dict:
    """The inflated demo in one shape, each of --formats in its own section (written as it is measured,
    models freed between them); returns the formats side by side. The bf16 weights stay: the source of the
    quantized ones. --eagle3: the demo's EAGLE-3 head too, inflated for the same target; --dflash: a random DFlash
    head's cycle and the demo's DFlash head inflated, end to end (the first format)."""
    source, draft, _, _ = inflate(DEMO_DIR, shape, device, dtype)
    draft.setup_caches(args.max_seq_length)
    draft3 = inflate_head3(DEMO_DIR, source)[0] if args.eagle3 else None
    if draft3 is not None:
        draft3.setup_caches(args.max_seq_length)
    copy_bw = measure.copy_bandwidth(device)
    rows = {}
    for i, fmt in enumerate(args.formats):
        result = report.section(f"{name} {fmt} (inflated demo)", measure_format, source, draft, fmt, copy_bw, prompt,
                                args, first and i == 0)
        release_memory(device)
        eagle3 = {}
        if draft3 is not None and "EAGLE-2" in result:  # its own section: EAGLE-2's is written first
            eagle3 = report.section(f"{name} {fmt} EAGLE-3 (inflated demo)", measure_eagle3, source, draft3, fmt,
                                    result["plain"]["step_ms"] / 1e3, copy_bw, prompt, args, first and i == 0)
            release_memory(device)
        rows[fmt] = format_row(result, eagle3)
        if args.dflash and i == 0 and "plain" in result:
            report.section(f"{name} {fmt} DFlash cycle (random head, published shape)", measure_dflash, source, fmt,
                           result["plain"]["step_ms"] / 1e3, copy_bw, args)
            release_memory(device)
            report.section(f"{name} {fmt} DFlash end to end (inflated demo)", measure_dflash_demo, source, fmt,
                           prompt, args)
            release_memory(device)
        if args.dspark and i == 0 and "plain" in result:
            report.section(f"{name} {fmt} DSpark cycle beside DFlash's (random heads, published shapes)",
                           measure_dspark, source, fmt, result["plain"]["step_ms"] / 1e3, copy_bw, args)
            release_memory(device)
    return rows


def random_weights(name: str, out_features: int, in_features: int, mode, groupsize: int, device: str, dtype) -> dict:
    """NAME.weight of random values, as stored: in dtype, or quantized (NAME.weight, .scales[, .zeros])."""
    stored = {f"{name}.weight": (torch.randn(out_features, in_features, device=device) * 0.02).to(dtype)}
    if mode is None:
        return stored
    quantized = quantize_state_dict(stored, mode, groupsize)
    quantized.pop(QUANT_KEY)
    return quantized


def linear_copies(kind: str, out_features: int, in_features: int, device: str, dtype) -> torch.nn.ModuleList:
    """Linears of random weights of this kind ("linear", "int8", "int4": g128), built as a model builds them,
    in enough distinct copies that their weights together spill the L2 cache (on CUDA)."""
    mode, groupsize = {"linear": (None, 0), "int8": ("int8", 0), "int4": ("int4", 128)}[kind]
    state = random_weights("0", out_features, in_features, mode, groupsize, device, dtype)
    layer_bytes = sum(t.numel() * t.element_size() for t in state.values())
    copies = min(64, -(-L2_SPILL_BYTES // layer_bytes)) if device == "cuda" else 2
    for i in range(1, copies):
        state.update(random_weights(str(i), out_features, in_features, mode, groupsize, device, dtype))
    with torch.device("meta"):
        layers = torch.nn.ModuleList(torch.nn.Linear(in_features, out_features, bias=False) for _ in range(copies))
        use_quantized_linears(layers, state)
    layers.load_state_dict(state, assign=True)
    layers = layers.to(device=device, dtype=dtype)  # float tensors (scales) in the activations' dtype, as a model's
    pack_quantized(layers)
    return layers


def call_each(layers, x):
    """Each Linear on its own rows of x [copies, M, in]: every call reads its own weights."""
    return [layer(x[i]) for i, layer in enumerate(layers)]


def seconds_per_replay(fn, device: str, repeats: int) -> float:
    """fn compiled on its first call, then timed as the compiled cycle runs it (a CUDA graph on CUDA)."""
    fn()
    return tune.seconds_per_call(fn, device, repeats)


@torch.no_grad()
def linear_by_rows(kind: str, out_features: int, in_features: int, device: str, dtype, rows: tuple,
                   repeats: int) -> dict:
    """One kind of Linear at each row count M: ms a call, GB/s of its weight bytes (values, scales, zeros),
    and the time over M=1's (near 1: the weights are read once; steps at 16-row tiles: read once a tile)."""
    layers = linear_copies(kind, out_features, in_features, device, dtype)
    layer_bytes = weight_bytes(layers[0])
    torch._dynamo.reset()  # one compiled function, one graph per M: within dynamo's limit of 8
    torch._inductor.config.coordinate_descent_tuning = kind != "linear"  # as graphs.compile_settings runs them
    compiled = torch.compile(call_each, fullgraph=True, dynamic=False)
    out = {"copies_per_graph": len(layers), "weight_MB": layer_bytes / 1e6}
    one_row_s = None
    for m in rows:
        x = torch.randn(len(layers), m, in_features, device=device, dtype=dtype)
        seconds = seconds_per_replay(lambda: compiled(layers, x), device, repeats) / len(layers)
        one_row_s = one_row_s or seconds  # rows start at M=1
        out[f"M={m}"] = {"ms": seconds * 1e3, "GB_per_s": layer_bytes / seconds / 1e9, "over_M1": seconds / one_row_s}
    return out


def linear_kernels(device: str, dtype) -> dict:
    """A Linear of each of LLaMA-2-7B's matrix shapes as nn.Linear (the run's dtype), Int8Linear and Int4Linear
    g128, compiled (fullgraph), at the row counts of a decode step (1) and of verified trees (16 to 64)."""
    precision = str(dtype).removeprefix("torch.")
    kinds = {f"{precision} nn.Linear": "linear", "int8 Int8Linear": "int8", "int4 g128 Int4Linear": "int4"}
    out = {"timing": "CUDA graph of one call per copy, replayed" if device == "cuda" else "compiled calls (CPU)",
           "rows": list(LINEAR_ROWS[device])}
    for shape_name, (out_features, in_features) in LINEAR_SHAPES[device].items():
        out[shape_name] = {}
        for label, kind in kinds.items():
            out[shape_name][label] = linear_by_rows(kind, out_features, in_features, device, dtype,
                                                    LINEAR_ROWS[device], 50 if device == "cuda" else 3)
            release_memory(device)
    return out


def int4_13b(device: str, dtype, prompt: list, args) -> dict:
    """LLaMA-2-13B's shape in int4 g128: the demo inflated in bf16, quantized in memory and moved to the host
    (as if read from its file), the bf16 model freed; then the peak GPU memory from building the int4 target
    on (weights, a KV cache of INT4_13B_CACHE slots, the bf16 draft head, compiled graphs, plain and EAGLE-2
    end to end): does it fit a 24 GB card?"""
    if device != "cuda":
        return {"skipped": "CUDA only: a 13B model at full size is not built on a CPU"}
    release_memory(device)
    source, draft, _, _ = inflate(DEMO_DIR, SHAPES["llama2-13b"], device, dtype)
    model_args = source.args
    state = {k: v.cpu() if isinstance(v, torch.Tensor) else v
             for k, v in quantize_state_dict(source.state_dict(), "int4", 128).items()}
    del source
    release_memory(device)
    torch.cuda.reset_peak_memory_stats()
    out = {"allocated_before_GB": torch.cuda.memory_allocated() / 1e9}  # the bf16 draft head
    target = Transformer.from_state_dict(model_args, state, device, dtype, "the int4 g128 weights")
    del state
    target.setup_caches(1, INT4_13B_CACHE)
    target.set_feature_layers(draft.feature_layers)
    draft.setup_caches(INT4_13B_CACHE)
    compile_settings(target, device)
    tree = TreeConfig(args.depth, args.tree_topk, args.total_tokens)
    step_fns = {"plain": compile_step(decode_one_token, device),
                "spec": compile_step(speculative_cycle, device)}
    side = measure.side_by_side(target, draft, tree, step_fns, args.side_tokens, False, prompt)
    peak = torch.cuda.max_memory_allocated()
    weights_gb = weight_bytes(target) / 1e9
    plain_tps = side["eaglet plain"]["tokens_per_s"]
    out.update({"weights": weights_format(target), "weights_GB": weights_gb,
                "cache_slots": INT4_13B_CACHE, "plain_end_to_end_tokens_per_s": plain_tps,
                "plain_end_to_end_GB_per_s": weights_gb * plain_tps, "EAGLE-2": eagle_bytes(target, draft, tree, side),
                "peak_allocated_GB": peak / 1e9, "peak_reserved_GB": torch.cuda.max_memory_reserved() / 1e9,
                "peak_allocated_under_24_GB": peak < 24e9})
    return out


def cache_size_section(shape: dict, device: str, dtype) -> dict:
    """cache_size_check on the demo inflated to this shape (built here, freed on return)."""
    return cache_size_check(inflate(DEMO_DIR, shape, device, dtype)[0])


def run_checks(report: Report, device: str, dtype, tree: TreeConfig, prompt: list):
    """The reduced shape: attention kernels (bf16 on CUDA), compiled == eager (fp32), falling back to dense
    attention if the compiled check fails."""
    small, small_draft, _, _ = inflate(DEMO_DIR, REDUCED, device, dtype)
    small.setup_caches(1, 1024)
    small_draft.setup_caches(1024)
    report.section("attention kernels (reduced shape)", attention_backends, small, small_draft, tree)
    # exactness in fp32: in bf16 compiled and eager kernels round differently, and near-ties flip tokens
    small, small_draft, _, _ = inflate(DEMO_DIR, REDUCED, device, torch.float32)
    small.setup_caches(1, 1024)
    small_draft.setup_caches(1024)
    checked = report.section("compiled vs eager (reduced shape, fp32)", compiled_vs_eager, small, small_draft, tree,
                             prompt, 48)
    if device == "cuda" and "error" in checked:  # measure the rest with the dense fallback rather than nothing
        attention.FLEX_ATTENTION = False
        torch._dynamo.reset()
        report.results["setup"]["flex_attention"] = "off (EAGLET_FLEX=0) after it failed in the section above"
        report.section("compiled vs eager, dense attention (reduced shape, fp32)", compiled_vs_eager, small, small_draft,
                       tree, prompt, 48)


def exact_section(report: Report, device: str, budget_s: float, only: str = "") -> dict:
    """cuda_exact.check_all, its rows written into the report after each way."""
    name = "exact: the demo decoded every way against plain eager (greedy)"

    def save(rows):
        report.results[name] = rows
        report.write()
    plan = [(target, way) for target, way in cuda_exact.PLAN if only in way]
    return cuda_exact.check_all(device, plan, budget_s=budget_s, save=save)


def tensor_parallel_1(out: Path, device: str) -> dict:
    """The demo compiled under torchrun at world size 1 against one process: same tokens, both speeds."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    flags = ["generate.py", "--compile", "--device", device, "--max_new_tokens", "128", "--num_samples", "3"]
    runs = {"one process": [sys.executable] + flags,
            "torchrun, 1 rank": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"] + flags}
    result = {}
    for name, command in runs.items():
        path = out / f"tp1_{name.split(',')[0].replace(' ', '_')}.json"
        done = subprocess.run(command + ["--json_out", str(path)], cwd=root, capture_output=True, text=True,
                              timeout=900)
        if done.returncode:
            raise RuntimeError(f"{name} failed: {(done.stderr or done.stdout)[-1500:]}")
        written = json.loads(path.read_text())
        result[name] = {"tokens_per_s_mean": written["tokens_per_s_mean"], "tau": written["tau"],
                        "tokens": written["samples"][0]["tokens"],
                        "accept_lengths": written["samples"][0]["accept_lengths"]}
    one, tp1 = result["one process"], result["torchrun, 1 rank"]
    result["same tokens and accepted lengths"] = one["tokens"] == tp1["tokens"] and \
        one["accept_lengths"] == tp1["accept_lengths"]
    for row in (one, tp1):
        del row["tokens"], row["accept_lengths"]
    return result


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--out", type=Path, default=Path("gpu_results"), help="folder for results.json and results.md")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="no shape measured: environment, attention kernels and compiled == eager, and the "
                           "sections of --linear_kernels and --int4_13b if given")
    p.add_argument("--shapes", default="llama2-7b,llama3-8b", help="comma-separated, from " + ", ".join(SHAPES))
    p.add_argument("--formats", default="bf16,int8,int4",
                   help="weight formats measured side by side in each shape, from " + ", ".join(FORMATS)
                        + " (bf16: the inflated weights, fp32 on CPU; int4: int4.g128; the lm_head is int8 in every "
                          "quantized format)")
    p.add_argument("--skip_checks", action="store_true",
                   help="no reduced-shape checks (attention kernels, compiled == eager): for calls after one that "
                        "ran them")
    p.add_argument("--skip_cycle_table", action="store_true",
                   help="no phase-by-phase cycle (5 more compilations) for the first format of the first shape")
    p.add_argument("--linear_kernels", action="store_true",
                   help="time one bf16 / int8 / int4 g128 Linear of each LLaMA-2-7B matrix shape at 1 to 64 rows "
                        "(on CPU one tiny shape, a smoke test)")
    p.add_argument("--int4_13b", action="store_true",
                   help="LLaMA-2-13B's shape in int4 g128: speed and peak GPU memory (CUDA only; skipped on CPU)")
    p.add_argument("--tp1", action="store_true",
                   help="the demo compiled under torchrun at world size 1 against one process (tensor parallel's path)")
    p.add_argument("--eagle3", action="store_true",
                   help="also the demo's EAGLE-3 head on each shape and format: its cycle phase by phase (where "
                        "EAGLE-2's is measured) and end to end against plain, on the same target weights")
    p.add_argument("--dflash", action="store_true",
                   help="also a random DFlash head shaped as the published ones (5 layers, blocks of 16) on each "
                        "shape's first format: its cycle phase by phase, as a chain of 16 and a 32-token tree; and "
                        "the demo's DFlash head inflated, end to end against plain with its tau (chain 8, tree 16)")
    p.add_argument("--dspark", action="store_true",
                   help="also a random DSpark head shaped as the published 8B one (blocks of 7, Markov rank 256) and a "
                        "random DFlash head on each shape's first format: their cycles phase by phase, chains of 8 "
                        "and 32-token trees")
    p.add_argument("--exact", action="store_true",
                   help="first: the demo decoded every way a user can run it (plain, EAGLE-2/3, DFlash and DSpark chain and tree, "
                        "compiled or eager, running ahead or not, several prompts, int4) against plain eager, token "
                        "for token, in bf16 and fp32 (scripts/cuda_exact.py)")
    p.add_argument("--exact_budget_s", type=int_flag(1), default=240,
                   help="--exact starts no new way after this many seconds")
    p.add_argument("--exact_only", default="",
                   help="--exact checks only the ways whose name holds this text (e.g. 'plain')")
    p.add_argument("--hf", action="store_true",
                   help="transformers' generate beside the first shape's first format, if unquantized (slow)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if available")
    p.add_argument("--budget_s", type=int_flag(1), default=500, help="start no section after this many seconds")
    p.add_argument("--depth", type=int_flag(1), default=6, help="draft tree expansion steps")
    p.add_argument("--tree_topk", type=int_flag(1), default=10, help="children per node and nodes kept per level")
    p.add_argument("--total_tokens", type=int_flag(2), default=60, help="tokens verified per cycle")
    p.add_argument("--repeats", type=int_flag(1), default=20, help="timed calls per measurement")
    p.add_argument("--side_tokens", type=int_flag(1), default=128, help="tokens generated side by side")
    p.add_argument("--max_seq_length", type=int_flag(64), default=2048, help="KV cache slots")
    mode.add_argument("--plain_only", action="store_true",
                      help="no checks; per shape only the compiled plain step, then the cache-size check (an A/B run)")
    p.add_argument("--draft_vocab", type=int_flag(1), default=0,
                   help="the draft scores only the first N token ids on shapes with more (FR-Spec's cost); "
                        "default: all")
    p.add_argument("--coordinate_descent", action="store_true",
                   help="inductor's coordinate_descent_tuning on (gpt-fast's setting), for an A/B run")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if not args.shapes:
        p.error("--shapes names no shape")
    if unknown:
        p.error(f"unknown --shapes {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    args.formats = list(dict.fromkeys(f.strip() for f in args.formats.split(",") if f.strip()))
    unknown = [f for f in args.formats if f not in FORMATS]
    if not args.formats:
        p.error("--formats names no format")
    if unknown:
        p.error(f"unknown --formats {', '.join(unknown)}; known: {', '.join(FORMATS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        tree = TreeConfig(args.depth, args.tree_topk, args.total_tokens)
        device = pick_device(args.device)
        if not (DEMO_DIR / "target" / "model.pth").is_file():
            raise EagletError(f"no demo in {DEMO_DIR}")
        demo_vocab = model.read_config(DEMO_DIR / "target")["vocab_size"]
        if 0 < args.draft_vocab < demo_vocab:
            raise EagletError(f"--draft_vocab {args.draft_vocab} would leave out demo tokens: "
                              f"give at least {demo_vocab}")
        if any((args.out / name).exists() for name in ("results.json", "results.md")):
            raise EagletError(f"--out {args.out} already holds results; give a new folder")
        args.out.mkdir(parents=True, exist_ok=True)
        check_writable(args.out / "results.json", "--out")
    except (EagletError, OSError) as e:
        sys.exit(f"error: {e}")
    torch._inductor.config.coordinate_descent_tuning = args.coordinate_descent
    torch.manual_seed(0)
    dtype = PRECISIONS["bf16" if device == "cuda" else "fp32"]
    report = Report(args.out, args.budget_s)
    args.deadline = report.t0 + args.budget_s  # sections of several configurations stop inside themselves too
    report.results["setup"] = {"command": "python " + " ".join(sys.argv if argv is None else ["scripts/gpu_check.py", *argv]),
                               "date": time.strftime("%Y-%m-%d"), "commit": measure.git_commit(),
                               "coordinate_descent_tuning": args.coordinate_descent, "precision": str(dtype),
                               "flex_attention": attention.FLEX_ATTENTION, "draft_vocab": args.draft_vocab or "all",
                               "formats": args.formats, "eagle3": args.eagle3, "dflash": args.dflash, "dspark": args.dspark,
                               "run_ahead": decode.RUN_AHEAD}
    report.section("environment", environment, device)
    if args.exact:
        report.section("exact: the demo decoded every way against plain eager (greedy)", exact_section, report, device,
                       args.exact_budget_s, args.exact_only)
        release_memory(device)
    prompt = Tokenizer(DEMO_DIR / "target").encode(PROMPT)
    if not (args.plain_only or args.skip_checks):
        run_checks(report, device, dtype, tree, prompt)
    if args.linear_kernels:
        release_memory(device)
        report.section("linear kernels by rows", linear_kernels, device, dtype)
    if not args.quick:
        for i, name in enumerate(args.shapes):
            report.section(f"{name} (inflated demo): formats side by side", measure_shape, report, name, SHAPES[name],
                           device, dtype, prompt, args, i == 0)
            release_memory(device)
        report.section("compiled plain step at context 256: 512, 4096 and 8192 cache slots", cache_size_section,
                       SHAPES[args.shapes[0]], device, dtype)
        release_memory(device)
    if args.tp1:
        release_memory(device)
        report.section("tensor parallel at world size 1 (torchrun) against one process", tensor_parallel_1, args.out,
                       device)
    if args.int4_13b:
        report.section("llama2-13b int4 g128 (inflated demo): speed and peak memory", int4_13b, device, dtype, prompt,
                       args)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
