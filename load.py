"""Load a target and a head from explicit settings: the checkpoints on a device in a precision, the tokenizer, the
sampling and the tree, the prompts' tokens, and caches sized for the run. generate.py's command line and serve.py
call load() with their flags as keywords; the tools call load_target and load_draft.

    from load import load_draft, load_target
    model = load_target("checkpoints/meta-llama/Llama-2-7b-chat-hf", "cuda", "bf16", max_seq_length=2048)
    draft = load_draft("checkpoints/yuhuili/EAGLE-llama2-chat-7B", model)
"""
import os
import resource
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from chat import encode_prompts
from cli import DEFAULT_DRAFT_VOCAB, DRAFT_VOCAB_ABOVE, PRECISION_NAMES, torchrun_rank
from draft_tree import STATIC_CHOICES, StaticTree
from decode import TreeConfig, prefill_chunk_of
from sampling import SamplingConfig, is_token_id
from draft import DRAFT_WINDOW, DraftHead, Eagle3Draft, EagleDraft, head_name
from draft_model import DraftModel, check_draft_model
from lookup import NgramLookup
from head_formats import check_target_copies, default_draft_vocab, head_config, load_head, read_draft_vocab
from checkpoint import EagletError, converted_file, read_config
from model import Transformer, context_limit
from quantize import Int8Linear, weight_bytes, weights_format
from tokenizer import Tokenizer
import tp
from tune import AUTO_SIZES, tuning_cache_size, widest_tree

PRECISIONS = dict(zip(PRECISION_NAMES, (torch.bfloat16, torch.float16, torch.float32)))


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


def load_target(checkpoint_path, device: str, precision: str, max_seq_length: int = 0, group=None) -> Transformer:
    """The target on device in precision, with a KV cache of max_seq_length slots (none if 0).
    checkpoint_path: model.pth (or a quantized one) or its folder. group: tensor parallel, this rank's shard."""
    if precision not in PRECISIONS:
        raise EagletError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    device = pick_device(device)  # "auto" too; "cuda" without one is one clear error, not torch's assertion
    path, dtype = converted_file(checkpoint_path, "model.pth"), PRECISIONS[precision]
    model = tp.load_sharded(path, group, device, dtype) if group is not None else \
        Transformer.from_checkpoint(path, device=device, dtype=dtype)
    check_finite(model, path)
    if max_seq_length:
        with torch.device(device):
            model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)
    return model


def check_finite(model: torch.nn.Module, path):
    """Weights holding NaN or inf (a corrupt or badly made file) would decode garbage in silence: one error instead.
    Each floating tensor summed in float32 (NaN and inf carry through a sum; weights this large never overflow it),
    one read-back for all."""
    named = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()]
    if not named:
        return
    # in pieces: on a CPU a float32 sum of a bf16 tensor makes a float32 copy of it first
    sums = [torch.stack([c.sum(dtype=torch.float32) for c in t.reshape(-1).split(1 << 24)]).sum() for _, t in named]
    finite = torch.stack(sums).isfinite().tolist()
    bad = [(n, t) for (n, t), ok in zip(named, finite) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise EagletError(f"{path}: {bad[0][0]} holds values that are not finite (NaN or inf){more} in "
                          f"{bad[0][1].dtype}: the file is corrupt or was made wrong, or holds values too large for "
                          "this precision")


def load_draft(checkpoint_path, target: Transformer, draft_vocab=None, log=None, keep_ids=()) -> DraftHead:
    """A head of any kind eaglet reads for this target, on its device and in its dtype, with a cache as long as
    the target's (if that has one yet). The target is set to return the features the head reads.
    draft_vocab: the target ids an EAGLE-1/2 head may propose (draft_vocab_of; "0" or "full": all of them);
    keep_ids (the EOS tokens) join the default draft vocabulary."""
    checkpoint_path = converted_file(checkpoint_path, "draft.pth")
    weight = target.tok_embeddings.weight  # float in every format: the activations' device and dtype
    draft = load_head(checkpoint_path, target.args, device=weight.device, dtype=weight.dtype)
    check_finite(draft, checkpoint_path)
    check_target_copies(draft, target)
    target.set_feature_layers(draft.feature_layers)
    if not isinstance(draft, EagleDraft):
        if draft_vocab is not None and str(draft_vocab) not in ("full", "0"):
            raise EagletError(f"--draft_vocab is for EAGLE-1/2 heads; {why_no_draft_vocab(draft)}")
    else:
        token_ids, source = draft_vocab_of(draft_vocab, Path(checkpoint_path).parent, target.args.vocab_size, keep_ids)
        if token_ids is not None and (draft_vocab is not None or can_take_rows(target)):
            draft.restrict_vocab(target, token_ids, source)
            if log:
                log(f"draft vocabulary: {draft.vocab_size} of {target.args.vocab_size} tokens, from {draft.draft_vocab_source}")
    if target.max_seq_length:
        draft.setup_caches(target.max_seq_length)
    return draft


def load_draft_model(checkpoint_path, target: Transformer) -> DraftModel:
    """A converted model of the target's vocabulary (model.pth, a quantized one, or its folder) as a drafter, on the
    target's device and in its dtype, with a cache as long as the target's (if that has one yet)."""
    path = converted_file(checkpoint_path, "model.pth")
    weight = target.tok_embeddings.weight
    model = Transformer.from_checkpoint(path, device=weight.device, dtype=weight.dtype)
    check_finite(model, path)
    check_draft_model(model, target, str(path))
    draft = DraftModel(model).eval()
    target.set_feature_layers(draft.feature_layers)
    if target.max_seq_length:
        draft.setup_caches(target.max_seq_length)
    return draft


def can_take_rows(target: Transformer) -> bool:
    """Whether the target's lm_head gives a draft vocabulary its rows (bf16 or int8); the default draft vocabulary
    is left out where it does not, a file asked for is refused there (draft.linear_rows says why)."""
    return isinstance(target.output, torch.nn.Linear) or hasattr(target.output, "rows")


def draft_vocab_of(draft_vocab, head_dir: Optional[Path], vocab_size: int, keep_ids=()) -> tuple:
    """(the target ids an EAGLE-1/2 head drafts over, None for all; where they come from). The file draft_vocab names;
    else draft_vocab.json beside the head; else, on a target of more than DRAFT_VOCAB_ABOVE ids, the
    DEFAULT_DRAFT_VOCAB lowest ids with keep_ids (head_formats.default_draft_vocab: most frequent first, roughly, in a
    BPE tokenizer); else all. The target verifies over every id whatever the draft proposes: the output is the same."""
    if str(draft_vocab) in ("full", "0"):
        return None, "full"
    if draft_vocab is None and head_dir is not None and (head_dir / "draft_vocab.json").is_file():
        draft_vocab = head_dir / "draft_vocab.json"
    if draft_vocab is not None:
        return read_draft_vocab(draft_vocab, vocab_size), str(draft_vocab)
    if vocab_size > DRAFT_VOCAB_ABOVE:
        return (default_draft_vocab(vocab_size, keep_ids, DEFAULT_DRAFT_VOCAB),
                f"the {DEFAULT_DRAFT_VOCAB} lowest ids (the default over {DRAFT_VOCAB_ABOVE}; --draft_vocab 0: all)")
    return None, "full"


def why_no_draft_vocab(draft: DraftHead) -> str:
    if isinstance(draft, Eagle3Draft) or getattr(draft, "lm_head", None) is not None:
        return "this head has its own draft vocabulary (d2t)"
    return f"a {head_name(draft)} head scores the target's whole vocabulary"


def check_writable(path: Path, what: str):
    """Refuse, before any long work, an output file that cannot be written (missing folder, a directory,
    a read-only place). Creates nothing that was not there."""
    path = Path(path)
    if path.is_dir():
        raise EagletError(f"{what} {path} is a directory")
    if not path.parent.is_dir():
        raise EagletError(f"{what} {path}: the folder {path.parent} does not exist")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise EagletError(f"{what} {path} cannot be written: {e.strerror}")
    if not existed:
        path.unlink()


def set_confidence(draft: Optional[DraftHead], confidence: float):
    """--confidence: the threshold a DSpark head's confidence head cuts its drafts at."""
    if confidence and getattr(draft, "confidence_head", None) is None:
        raise EagletError(f"--confidence is for DSpark heads with a confidence head; "
                          f"{'no head is loaded' if draft is None else 'this head has none'}")
    if confidence:
        draft.confidence = confidence


def tree_config(kind: str, tree_choices, depth, tree_topk, total_tokens, draft: Optional[DraftHead] = None):
    """The TreeConfig the tree settings (load's) ask for (the depth by default the head's); with total_tokens
    auto or tree auto, the tree sized for its largest candidate (the cache is sized for it; the choice itself
    is made once the model is loaded)."""
    if kind == "static":
        tree = StaticTree(STATIC_CHOICES if tree_choices is None else tree_choices)
        if draft is not None:
            tree.check(draft)
        return tree
    if kind == "auto":  # the grid's tree of the most scratch, for the cache; the tree itself is tuned later
        return widest_tree(draft)
    head = draft or DraftHead
    tree = TreeConfig(depth or head.default_depth, tree_topk or head.default_topk, 2)  # checks them
    auto = total_tokens == "auto"
    if draft is not None:
        tree.check(draft)
    size = min(max(AUTO_SIZES), tree.max_total_tokens) if auto else \
        total_tokens or min(TreeConfig.total_tokens, tree.max_total_tokens)  # a chain: all its nodes
    return replace(tree, total_tokens=size)  # checks the size


def ngram_lookup(tree: str, depth, tree_topk, total_tokens, ngram_min: int, ngram_max: int) -> NgramLookup:
    """--ngram's lookup: the tree flags read as its continuations' length, their number and the nodes verified."""
    if tree != "given" or total_tokens == "auto":
        raise EagletError("--ngram builds its tree from the context: it takes --depth, --tree_topk and "
                          "--total_tokens as numbers, not --tree auto, --tree static or --total_tokens auto")
    lookup = NgramLookup(depth or NgramLookup.depth, tree_topk or NgramLookup.topk, 2, ngram_max, ngram_min)
    return replace(lookup, total_tokens=total_tokens or min(NgramLookup.total_tokens, 1 + lookup.depth * lookup.topk))


def cache_length(max_seq_length: Optional[int], max_new_tokens: int, model: Transformer, prompt: Optional[list],
                 scratch: int) -> int:
    """max_seq_length, or what this run needs; a total over the model's limit names its parts."""
    limit, limit_words = context_limit(model.args)
    if prompt is None:
        size = max_seq_length or min(4096, limit)
        if size < scratch + 16:  # --interactive: room for a short turn and its reply
            raise EagletError(f"--max_seq_length {size} leaves no room for a conversation beside the tree scratch "
                              f"({scratch}): give at least {scratch + 16}")
        return size
    need = len(prompt) + max_new_tokens + scratch
    bound, what = (max_seq_length, f"--max_seq_length ({max_seq_length})") if max_seq_length else \
        (limit, f"the model's {limit_words}")
    if need > bound:
        raise EagletError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens})"
                          f"{f' + tree scratch ({scratch})' if scratch else ''} = {need} exceeds {what}")
    return max_seq_length or need


def check_tokenizer(tokenizer: Tokenizer, model: Transformer):
    """A model's embedding table may be padded a little past its tokenizer (Qwen2: by 0.3%), never by 10%,
    unless its config.json says which tokens it emits (tokenizer_vocab_size: the inflated demo's)."""
    n_tok, n_model = tokenizer.vocab_size, model.args.extra.get("tokenizer_vocab_size") or model.args.vocab_size
    if n_tok > n_model or n_tok < 0.9 * n_model:
        raise EagletError(f"the tokenizer has {n_tok} tokens but the model {n_model}: they do not belong together")


def load(checkpoint_path, *, draft_checkpoint_path=None, draft_model=None, ngram=False, ngram_min=2, ngram_max=4,
         draft_vocab=None, device="auto", precision=None,
         tree="given", depth=None, tree_topk=None, total_tokens=None, tree_choices=None, confidence=0.0,
         draft_window="auto", draft_sinks=4, prefill_chunk=None, chat_template="auto", chat_template_kwargs=None,
         max_seq_length=None, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
         frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, min_tokens=0, prompts=None, chat=False, interactive=False,
         system=None, max_new_tokens=200, batch_size=None, json_out=None, group=None, exact=False):
    """Model, tokenizer, draft, sampling, the tree, the prompts' tokens (None for interactive) and the rows the caches
    hold. Each setting is generate.py's flag of that name, with its default (device auto: cuda if available;
    precision None: bf16 on CUDA, fp32 on CPU); prompts: texts, encoded through the chat template with chat or
    interactive; interactive: one long conversation, no prompts; draft_model: a model drafting in a head's place; ngram:
    n-gram lookup (the tree returned is its NgramLookup); exact: --exact (Transformer.set_exact). The checkpoints: the
    files or their folders. Under tensor parallel (group) this rank's shard of the target. No collective here:
    tp.agreed runs it."""
    device = pick_device(device)
    precision = precision or ("bf16" if device == "cuda" else "fp32")
    sampling = SamplingConfig(temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty,
                              logit_bias_of(logit_bias), min_tokens)
    tree_of = partial(tree_config, tree, tree_choices, depth, tree_topk, total_tokens)
    shape = ngram_lookup(tree, depth, tree_topk, total_tokens, ngram_min, ngram_max) if ngram else \
        tree_of()  # checks the settings before anything is loaded
    if exact and device == "cuda" and "auto" in (tree, total_tokens):
        raise EagletError("--exact on CUDA pads every call to the verify's rows, which --tree auto and --total_tokens "
                          "auto choose only once running (and time padded): give the tree's sizes")
    if json_out and not torchrun_rank():  # rank 0 writes it
        check_writable(json_out, "--json_out")
    checkpoint_path = converted_file(checkpoint_path, "model.pth")
    if draft_checkpoint_path:
        draft_checkpoint_path = converted_file(draft_checkpoint_path, "draft.pth")
    model = load_target(checkpoint_path, device, precision, group=group)
    tokenizer = Tokenizer(checkpoint_path.parent, chat_template, chat_template_kwargs)
    if draft_checkpoint_path and draft_model:
        raise EagletError("give a head (--draft_checkpoint_path) or a draft model (--draft_model), not both")
    draft = load_draft(draft_checkpoint_path, model, draft_vocab, log=print, keep_ids=tokenizer.eos_ids) \
        if draft_checkpoint_path else load_draft_model(draft_model, model) if draft_model else None
    set_confidence(draft, confidence)
    if draft is not None:
        shape = tree_of(draft)
    check_tokenizer(tokenizer, model)
    if chat or interactive:
        print(f"chat template: {tokenizer.chat_template_source}")
    encode = partial(encode_prompts, tokenizer, chat=chat or interactive, system=system)
    encoded = None if interactive else encode(prompts)
    scratch = shape.scratch if draft is not None or ngram else 0
    size = cache_length(max_seq_length, max_new_tokens, model, max(encoded, key=len) if encoded else None, scratch)
    if tree == "auto":  # room for the tuning's decoding too, or a clear refusal before it starts
        size = tuning_cache_size(max_seq_length, model, draft, encode, size, scratch)
    rows = batch_rows(batch_size, device, model, draft, len(encoded), size) if encoded and len(encoded) > 1 else 1
    with torch.device(device):
        model.setup_caches(max_batch_size=rows, max_seq_length=size)
    if draft is not None:
        draft.setup_caches(model.max_seq_length, rows)
        set_window(draft, draft_window, draft_sinks)
    if draft is not None:
        shape.check(draft)
    if exact:
        model.set_exact(True, shape.total_tokens)  # without a head too: plain decoding pads as the verify would
    prefill_chunk_of(prefill_chunk, model.max_seq_length)  # a chunk larger than the cache: refused now
    return model, tokenizer, draft, sampling, shape, encoded, rows


def logit_bias_of(bias: Optional[dict]) -> dict:
    """--logit_bias's JSON object as {token id: bias}: its keys (JSON's are text) token ids, its values numbers."""
    bias = bias or {}
    if not all(is_token_id(str(k)) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in bias.items()):
        raise EagletError(f"--logit_bias maps token ids to numbers, e.g. '{{\"13\": -100}}', got {bias}")
    return {int(k): float(v) for k, v in bias.items()}


def set_window(draft: DraftHead, window, sinks: int):
    """--draft_window and --draft_sinks on a loaded head. auto: the window its config says it was trained with, else
    DRAFT_WINDOW where the cache is longer."""
    if window == "full":
        draft.set_window(None)
    elif window != "auto":
        draft.set_window(window, sinks)
    elif draft.window is None and DRAFT_WINDOW + sinks < draft.max_seq_length:
        draft.set_window(DRAFT_WINDOW, sinks)


def free_memory(device: str) -> int:
    """Bytes free for the caches: the GPU's free memory, or the machine's available RAM."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: no figure, no limit
        return 2 ** 62


def batch_rows(batch_size: Optional[int], device: str, model: Transformer, draft: Optional[DraftHead], n_prompts: int,
               size: int) -> int:
    """Prompts decoded together: batch_size, else all of them; at most what 90% of the free memory holds in
    caches of size slots (the target's and the head's)."""
    per_row = 2 * size * model.tok_embeddings.weight.element_size() * sum(
        layer.attention.n_kv * model.args.head_dim for layer in model.layers)
    if draft is not None:
        per_row += 2 * size * model.tok_embeddings.weight.element_size() * draft.args.n_local_heads * draft.args.head_dim
    free = free_memory(device)
    fit = max(1, int(0.9 * free // per_row))
    if batch_size and batch_size > fit:
        raise EagletError(f"--batch_size {batch_size}: caches of {size} slots for {batch_size} rows need "
                          f"{batch_size * per_row / 1e9:.2f} GB, and {free / 1e9:.2f} GB is free on "
                          f"{device}: the largest batch that fits is {fit} (or a smaller --max_seq_length)")
    rows = min(batch_size or n_prompts, n_prompts, fit)
    print(f"{n_prompts} prompts, {rows} at a time (caches {rows * per_row / 1e9:.2f} GB of {free / 1e9:.2f} GB free"
          + (f"; all {n_prompts} would need {n_prompts * per_row / 1e9:.2f} GB" if rows < min(n_prompts, batch_size or n_prompts) else "")
          + ")")
    return rows


def describe(model: Transformer, draft: Optional[DraftHead], tree: TreeConfig, checkpoint_path: Path,
             draft_checkpoint_path: Optional[Path], device: str, precision: str):
    """The start-up line: what runs, in which formats, where (the checkpoints as files, as load read them)."""
    kind = "draft model" if isinstance(draft, DraftModel) else "head"
    head = f"{kind} {short_path(draft_checkpoint_path)} ({weights_format(draft)}), {tree.describe()}" \
        if draft is not None else tree.describe() if isinstance(tree, NgramLookup) else "no head (plain decoding)"
    ranks = f", tensor parallel over {dist.get_world_size(model.tp_group)} ranks" if model.tp_group else ""
    print(f"target {short_path(checkpoint_path)} ({weights_format(model)}); {head}; {device}, "
          f"{precision}{ranks}")
    trained = head_config(read_config(draft_checkpoint_path.parent), "the head").get(
        "max_position_embeddings") if draft is not None and not isinstance(draft, DraftModel) else None
    if isinstance(trained, int) and trained < model.max_seq_length:
        print(f"note: the head was trained on up to {trained} positions (its max_position_embeddings) and the "
              f"cache holds {model.max_seq_length}: past {trained}, expect fewer tokens per cycle (the output "
              "stays exact)")
    if any(getattr(m, "packed_for", None) == "cpu, dequantized" for m in model.modules()):
        print(f"note: int4 weights in fp32 on a CPU are kept dequantized, the same values (torch's CPU int4 kernel "
              f"is fast with bf16 activations only): {weight_bytes(model) / 1e9:.2f} GB in memory; --precision bf16 "
              "keeps them 4-bit")
    if model.exact_rows and model.tok_embeddings.weight.is_cuda:
        print(f"note: --exact on CUDA pads every call to {model.exact_rows} rows (the verify's, as cuBLAS picks kernels "
              f"by rows): plain decoding gives the same text with --no_draft --total_tokens {model.exact_rows}")
    # int4 in fp32 is kept dequantized (above); int8 in fp32 dequantizes at every call
    int8 = [name for name, m in (("target", model), ("head", draft))
            if m is not None and any(isinstance(x, Int8Linear) for x in m.modules())]
    if device == "cpu" and int8 and precision != "bf16":
        print(f"note: on a CPU, int8 weights (the {' and '.join(int8)}'s) are fast with bf16 activations only "
              f"(torch's CPU kernel); in {precision} each is dequantized at every call (a whole int8 model's step "
              "took about 4x the fp32 model's, docs/quantization.md): --precision bf16")


def short_path(path: Path) -> str:
    """folder/file: names a checkpoint (every target is a model.pth) without the whole path."""
    return f"{path.parent.name}/{path.name}"
