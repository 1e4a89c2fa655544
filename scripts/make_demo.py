"""Build the demo from nothing but this machine: a sentencepiece tokenizer, a small LLaMA-architecture
code model, its EAGLE-1/2 head, its EAGLE-3 head, its DFlash, DSpark and DFlash2 heads, all trained by eaglet's own code on the running
interpreter's standard-library sources (a few modules kept out for evaluation).

    python scripts/make_demo.py --out_dir my_demo     # writes my_demo/{target,head,head3}, my_demo/RECIPE.json
    python scripts/make_demo.py --out_dir demo --overwrite   # rebuilds the shipped demo itself
    python scripts/make_demo.py --out_dir demo --only_head3  # retrains only the EAGLE-3 head, for the target there
    python scripts/make_demo.py --out_dir demo --only_dflash # retrains only the DFlash head, for the target there
    python scripts/make_demo.py --out_dir demo --only_dspark # retrains only the DSpark head, measures only it
    python scripts/make_demo.py --out_dir demo --only_dflash2 # the same for the DFlash2 head

generate.py uses demo/ when no checkpoint is given.
"""
import io
import json
import platform
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from convert_hf_checkpoint import convert  # noqa: E402
from cli import cli_parser, int_flag  # noqa: E402
from decode import TreeConfig, generate  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from load import load_draft, load_target  # noqa: E402
from model import EagletError, ModelArgs, Transformer  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from train_data import batches  # noqa: E402
from train_draft import TrainConfig, causal, lr_at, train  # noqa: E402

# Modules kept out of every training step: the held-out code that tau is reported on.
HELD_OUT = ("json", "csv", "textwrap", "fractions", "statistics", "heapq", "bisect", "colorsys", "shlex", "string")
TARGET_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096,
                 "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                 "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                 "torch_dtype": "bfloat16"}
# The EAGLE-3 head reads the target's hidden states entering these layers (4 = the last layer's output): low,
# middle and top of the 4-layer target, as the default 2, L//2, L-3 are of a 32-layer one (here they would be 2, 2, 1).
HEAD3_FEATURE_LAYERS = (1, 2, 4)
HEAD3_STEPS, HEAD3_SEQ_LEN = 1000, 128  # each step unrolled 7 times: about 6x an EAGLE-1/2 step's compute per token
# The DFlash head: two layers over the outputs of the target's first three layers (inputs of layers 1-3; ids
# 0-2), blocks of 8 (a 4-layer target's default ids would repeat layer 1).
DFLASH = {"block_size": 8, "draft_layers": 2, "anchors": 32}
DFLASH_FEATURE_LAYERS, DFLASH_STEPS = (1, 2, 3), 1000
# The DSpark head: DFlash's recipe and budget, blocks of 7 whose every row drafts (7 drafts, as DFlash's 8), and a
# Markov head of rank 64 (the published heads: 256 over a 152k vocabulary).
DSPARK = {"block_size": 7, "draft_layers": 2, "anchors": 32, "markov_rank": 64}
# The DFlash2 head: DFlash's recipe and budget (blocks of 8: 7 drafts) and a selector of rank 64 over each row's
# 16 best drafts (the published heads: rank 256 over a 152k vocabulary).
DFLASH2 = {**DFLASH, "selector_rank": 64, "selector_top_k": 16}


def stdlib_files(held_out: bool) -> list:
    """The interpreter's own .py sources, tests and site-packages left out; held_out picks the other side."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).parts
        if "site-packages" in parts or any(p in ("test", "tests", "idle_test") for p in parts):
            continue
        if (parts[0].removesuffix(".py") in HELD_OUT) == held_out:
            files.append(f)
    return files


def train_tokenizer(files: list, out_dir: Path, vocab_size: int):
    import sentencepiece as spm

    def pieces():  # sentencepiece caps sentence length; code keeps its newlines and indentation
        for f in files:
            text = f.read_text(errors="replace")
            yield from (text[i:i + 2000] for i in range(0, len(text), 2000))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=pieces(), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        split_by_whitespace=False, allow_whitespace_only_pieces=True, byte_fallback=True, split_digits=True,
        user_defined_symbols=["\n"], max_sentence_length=4096, input_sentence_size=200000,
        shuffle_input_sentence=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (out_dir / "tokenizer.model").write_bytes(model.getvalue())


def code_examples(files: list, tokenizer: Tokenizer, seq_len: int) -> list:
    """Each file cut into seq_len pieces, every piece starting with BOS; every token counts."""
    examples = []
    for f in files:
        tokens = tokenizer.encode(f.read_text(errors="replace"), bos=False)
        for i in range(0, len(tokens), seq_len - 1):
            chunk = [1] + tokens[i:i + seq_len - 1]
            if len(chunk) > 16:
                examples.append((chunk, [1] * len(chunk)))
    return examples


def train_target(examples: list, cfg: TrainConfig, log=print) -> Transformer:
    torch.manual_seed(cfg.seed)
    model = Transformer(ModelArgs.from_hf_config(TARGET_CONFIG))
    for name, p in model.named_parameters():
        if p.dim() == 2:  # GPT-2 style init; residual projections scaled down by depth
            std = 0.02 / (2 * model.args.n_layer) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
            torch.nn.init.normal_(p, std=std)
    model.setup_rope(cfg.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    data = batches(examples, cfg.batch_size, cfg.seq_len, pad_id=0, seed=cfg.seed)
    pos, mask = torch.arange(cfg.seq_len), causal(cfg.seq_len, "cpu")
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        tokens, weight = next(data)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        logits, _ = model(tokens, pos, None, mask)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        loss = (loss * weight[:, 1:].flatten()).sum() / weight[:, 1:].sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        if step % 10 == 0 or step == cfg.steps - 1:
            log(f"target step {step + 1}/{cfg.steps} loss {loss.item():.3f} {time.perf_counter() - t0:.0f}s")
    return model.eval()


def held_out_prompts(tokenizer: Tokenizer, n: int, prompt_len: int = 48) -> list:
    """Prompts cut from the held-out modules: n beginnings of functions or classes."""
    prompts = []
    for f in stdlib_files(held_out=True):
        lines = f.read_text(errors="replace").splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith(("def ", "class ")) and len(prompts) < n:
                text = "".join(lines[max(0, i - 3):i + 1])
                prompts.append([1] + tokenizer.encode(text, bos=False)[-prompt_len:])
    return prompts[:n]


def measure_tau(target_dir: Path, head_dir: Path, n_prompts: int = 40, max_new_tokens: int = 64,
                tree: TreeConfig = TreeConfig()) -> dict:
    """tau on held-out code (by default at 60/6/10 for every head), greedy and at temperature 1, and the share of
    cycles that accepted a draft at each depth; greedy checked against plain."""
    tokenizer = Tokenizer(target_dir)
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 48 + 1 + max_new_tokens + tree.scratch)
    draft = load_draft(head_dir / "draft.pth", model)
    out = {}
    for name, sampling in [("greedy", SamplingConfig()), ("temperature_1", SamplingConfig(temperature=1.0))]:
        lengths, mismatches, t0 = [], 0, time.perf_counter()
        for i, prompt in enumerate(held_out_prompts(tokenizer, n_prompts)):
            torch.manual_seed(i)
            result = generate(model, prompt, max_new_tokens, sampling, draft=draft, tree=tree)
            lengths += result.accept_lengths
            if sampling.temperature == 0:
                mismatches += result.tokens != generate(model, prompt, max_new_tokens, sampling).tokens
        # acceptance by position: the share of cycles whose draft at depth k was accepted (k drafts or more)
        at_least = [round(sum(n - 1 >= k for n in lengths) / len(lengths), 3) for k in range(1, tree.levels)]
        out[name] = {"tau": round(sum(lengths) / len(lengths), 3), "cycles": len(lengths), "accepted_by_depth": at_least,
                     "prompts": n_prompts, "greedy_mismatches": mismatches,
                     "seconds": round(time.perf_counter() - t0, 1)}
    return out


def build_target_and_head(args, target_dir: Path, head_dir: Path, files: list, recipe: dict):
    """The tokenizer, the target and its EAGLE-1/2 head, each stage recorded in recipe."""
    t0 = time.perf_counter()
    train_tokenizer(files, target_dir, TARGET_CONFIG["vocab_size"])
    tokenizer = Tokenizer(target_dir)
    examples = code_examples(files, tokenizer, args.seq_len)
    recipe["tokenizer"] = {"files": len(files), "tokens": sum(len(e[0]) for e in examples),
                           "seconds": round(time.perf_counter() - t0, 1)}
    print(f"tokenizer: {recipe['tokenizer']}")

    t0 = time.perf_counter()
    target_cfg = TrainConfig(steps=args.target_steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=2e-3,
                             warmup=50, grad_clip=1.0)
    target = train_target(examples, target_cfg)
    weights = {k: v.to(torch.bfloat16) for k, v in target.state_dict().items() if k != "output.weight"}  # tied
    torch.save(weights, target_dir / "model.pth")
    (target_dir / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=2))
    recipe["target"] = {"config": TARGET_CONFIG, "train": asdict(target_cfg),
                        "seconds": round(time.perf_counter() - t0, 1)}
    print(f"target: {recipe['target']['seconds']} s")

    t0 = time.perf_counter()
    head_cfg = TrainConfig(steps=args.head_steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=2e-3,
                           warmup=50, save_every=10 ** 9)
    target = load_target(target_dir / "model.pth", "cpu", "fp32")  # the bf16-rounded weights the demo ships
    shutil.rmtree(head_dir, ignore_errors=True)  # --overwrite: a fresh head
    train(target, examples, head_dir, head_cfg, resume=False)
    (head_dir / "train_state.pt").unlink(missing_ok=True)
    convert(head_dir)
    recipe["head"] = {"train": asdict(head_cfg), "seconds": round(time.perf_counter() - t0, 1)}
    print(f"head: {recipe['head']['seconds']} s")


def train_head3(args, target_dir: Path, head3_dir: Path, files: list) -> dict:
    """The EAGLE-3 head, trained on the same sources; shipped as config.json + draft.pth in bf16 only."""
    t0 = time.perf_counter()
    examples = code_examples(files, Tokenizer(target_dir), args.head3_seq_len)
    cfg = TrainConfig(steps=args.head3_steps, batch_size=args.batch_size, seq_len=args.head3_seq_len, lr=2e-3,
                      warmup=50, save_every=10 ** 9)
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    shutil.rmtree(head3_dir, ignore_errors=True)
    train(target, examples, head3_dir, cfg, resume=False, kind="eagle3", feature_layers=HEAD3_FEATURE_LAYERS)
    ship_bf16(head3_dir)
    return {"train": asdict(cfg), "feature_layers": HEAD3_FEATURE_LAYERS, "draft_vocab_size": TARGET_CONFIG["vocab_size"],
            "threads": torch.get_num_threads(), "seconds": round(time.perf_counter() - t0, 1)}


def train_dflash(args, target_dir: Path, dflash_dir: Path, files: list, kind: str = "dflash") -> dict:
    """The DFlash head (or with kind "dspark" the DSpark head, DSPARK's settings), trained on the same sources with
    the same budget; shipped like the EAGLE-3 head."""
    t0 = time.perf_counter()
    examples = code_examples(files, Tokenizer(target_dir), args.seq_len)
    cfg = TrainConfig(steps=args.dflash_steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=2e-3, warmup=50,
                      save_every=10 ** 9, **{"dspark": DSPARK, "dflash2": DFLASH2}.get(kind, DFLASH))
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    shutil.rmtree(dflash_dir, ignore_errors=True)
    train(target, examples, dflash_dir, cfg, resume=False, kind=kind, feature_layers=DFLASH_FEATURE_LAYERS)
    ship_bf16(dflash_dir)
    return {"train": asdict(cfg), "feature_layers": DFLASH_FEATURE_LAYERS, "threads": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - t0, 1)}


def measure_dspark(target_dir: Path, dspark_dir: Path) -> dict:
    """The DSpark head's chain of its block (8 tokens verified, as the DFlash head's chain) and its tree at 60/6/10."""
    chain = TreeConfig(DSPARK["block_size"] - 1, 1, DSPARK["block_size"] + 1)
    return {"dspark_chain": measure_tau(target_dir, dspark_dir, tree=chain),
            "dspark_tree": measure_tau(target_dir, dspark_dir, tree=replace(chain, topk=10, total_tokens=60))}


def measure_dflash2(target_dir: Path, dflash2_dir: Path) -> dict:
    """The DFlash2 head at the DFlash head's verify sizes: the chain of its block (8 tokens) and the tree at 60/6/10."""
    chain = TreeConfig(DFLASH2["block_size"] - 2, 1, DFLASH2["block_size"])
    return {"dflash2_chain": measure_tau(target_dir, dflash2_dir, tree=chain),
            "dflash2_tree": measure_tau(target_dir, dflash2_dir, tree=replace(chain, topk=10, total_tokens=60))}


def ship_bf16(head_dir: Path):
    """Convert a trained head, keep config.json + draft.pth in bf16 only: demo/ stays small, and draft.pth is
    all generate.py reads."""
    convert(head_dir)
    weights = torch.load(head_dir / "draft.pth", weights_only=True)
    torch.save({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()},
               head_dir / "draft.pth")
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}, indent=2))
    for name in ("train_state.pt", "model.safetensors"):
        (head_dir / name).unlink(missing_ok=True)


def main(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--out_dir", type=Path, required=True,
                   help="where target/, head/, head3/, dflash/, dspark/, dflash2/ and RECIPE.json go")
    p.add_argument("--overwrite", action="store_true", help="replace what out_dir already holds (e.g. demo/)")
    p.add_argument("--only_head3", action="store_true",
                   help="train only the EAGLE-3 head for the target already in out_dir, and measure the heads")
    p.add_argument("--only_dflash", action="store_true",
                   help="train only the DFlash head for the target already in out_dir, and measure the heads")
    p.add_argument("--only_dspark", action="store_true",
                   help="train only the DSpark head for the target already in out_dir, and measure only it")
    p.add_argument("--only_dflash2", action="store_true",
                   help="train only the DFlash2 head for the target already in out_dir, and measure only it")
    p.add_argument("--dflash_steps", type=int_flag(1), default=DFLASH_STEPS,
                   help="DFlash and DSpark head training steps (as shipped)")
    p.add_argument("--target_steps", type=int_flag(1), default=2000, help="target training steps (as shipped)")
    p.add_argument("--head_steps", type=int_flag(1), default=1000, help="EAGLE-1/2 head training steps (as shipped)")
    p.add_argument("--head3_steps", type=int_flag(1), default=HEAD3_STEPS, help="EAGLE-3 head training steps (as shipped)")
    p.add_argument("--seq_len", type=int_flag(2), default=256, help="training sequence length (target, EAGLE-1/2 head)")
    p.add_argument("--head3_seq_len", type=int_flag(2), default=HEAD3_SEQ_LEN,
                   help="EAGLE-3 head training sequence length (each step is unrolled 7 times)")
    p.add_argument("--batch_size", type=int_flag(1), default=16, help="training batch size")
    args = p.parse_args(argv)
    try:
        target_dir, head_dir, head3_dir = args.out_dir / "target", args.out_dir / "head", args.out_dir / "head3"
        dflash_dir, dspark_dir, dflash2_dir = args.out_dir / "dflash", args.out_dir / "dspark", args.out_dir / "dflash2"
        recipe_path, t_start = args.out_dir / "RECIPE.json", time.perf_counter()
        files = stdlib_files(held_out=False)
        only = "--only_head3" if args.only_head3 else "--only_dflash" if args.only_dflash else \
            "--only_dspark" if args.only_dspark else "--only_dflash2" if args.only_dflash2 else None
        if only:
            if not (target_dir / "model.pth").is_file() or not (head_dir / "draft.pth").is_file() or not recipe_path.is_file():
                p.error(f"{only} needs a demo in {args.out_dir} (target/, head/, RECIPE.json)")
            recipe = json.loads(recipe_path.read_text())
        else:
            if (target_dir / "model.pth").exists() and not args.overwrite:
                p.error(f"{args.out_dir} already holds a demo; --overwrite replaces it (--only_head3 keeps its target)")
            target_dir.mkdir(parents=True, exist_ok=True)
            recipe = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
                      "python": platform.python_version()}
            build_target_and_head(args, target_dir, head_dir, files, recipe)
        if args.only_dspark or args.only_dflash2:
            kind, folder, measure = ("dspark", dspark_dir, measure_dspark) if args.only_dspark else \
                ("dflash2", dflash2_dir, measure_dflash2)
            recipe[kind] = train_dflash(args, target_dir, folder, files, kind)
            print(f"{kind}: {recipe[kind]['seconds']} s; measuring tau on the held-out modules", flush=True)
            recipe["held_out"] |= measure(target_dir, folder)
            recipe_path.write_text(json.dumps(recipe, indent=2))
            print(json.dumps({k: v for k, v in recipe["held_out"].items() if k.startswith(("dflash", "dspark"))}, indent=2))
            return
        if not args.only_dflash:
            recipe["head3"] = train_head3(args, target_dir, head3_dir, files)
            print(f"head3: {recipe['head3']['seconds']} s")
        if not args.only_head3:
            recipe["dflash"] = train_dflash(args, target_dir, dflash_dir, files)
            print(f"dflash: {recipe['dflash']['seconds']} s")
        if not only:
            recipe["dspark"] = train_dflash(args, target_dir, dspark_dir, files, "dspark")
            print(f"dspark: {recipe['dspark']['seconds']} s")
            recipe["dflash2"] = train_dflash(args, target_dir, dflash2_dir, files, "dflash2")
            print(f"dflash2: {recipe['dflash2']['seconds']} s")

        print("measuring tau on the held-out modules", flush=True)
        depth7 = TreeConfig(depth=7)  # generate.py's default for EAGLE-3 heads
        chain = TreeConfig(DFLASH["block_size"] - 2, 1, DFLASH["block_size"])  # DFlash's own shape, its default
        recipe["held_out"] = {"modules": HELD_OUT, "tree": asdict(TreeConfig()), "head": measure_tau(target_dir, head_dir),
                              "head3": measure_tau(target_dir, head3_dir),
                              "head3_depth7": measure_tau(target_dir, head3_dir, tree=depth7)}
        if (dflash_dir / "draft.pth").is_file():
            recipe["held_out"] |= {"dflash_chain": measure_tau(target_dir, dflash_dir, tree=chain),
                                   "dflash_tree": measure_tau(target_dir, dflash_dir, tree=replace(chain, topk=10, total_tokens=60))}
        if (dspark_dir / "draft.pth").is_file():
            recipe["held_out"] |= measure_dspark(target_dir, dspark_dir)
        if (dflash2_dir / "draft.pth").is_file():
            recipe["held_out"] |= measure_dflash2(target_dir, dflash2_dir)
        if not only:
            recipe["total_seconds"] = round(time.perf_counter() - t_start, 1)
        recipe_path.write_text(json.dumps(recipe, indent=2))
        print(json.dumps(recipe["held_out"], indent=2))
    except EagletError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # an out_dir that cannot be written
        sys.exit(f"error: {e.filename or args.out_dir}: {e.strerror or e}")


if __name__ == "__main__":
    main()
