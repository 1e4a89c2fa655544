"""A random 4-bit Hub checkpoint of one of bench.py's shapes in AutoAWQ's GEMM layout, for timing a converted
file where none can be downloaded (the GPU machines have no network); with --dense_dir, the same weights as a
plain fp16 checkpoint, in which quantize.py finds the same integers (each group holds a 0 and a 15, every
scale is a power of two), so its int4 file is the converted one tensor for tensor.

    python scripts/hub_int4_shape.py --shape llama2-7b --out_dir /tmp/awq7b --dense_dir /tmp/dense7b
    python convert_hf_checkpoint.py --checkpoint_dir /tmp/awq7b          # -> /tmp/awq7b/model_int4.g128.pth
    python convert_hf_checkpoint.py --checkpoint_dir /tmp/dense7b
    python quantize.py --checkpoint_path /tmp/dense7b/model.pth --mode int4 --groupsize 128
    python bench.py --checkpoint_path /tmp/awq7b/model_int4.g128.pth --compile

One safetensors shard per decoder layer, written as it is made (memory: one layer).
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from measure import SHAPES  # noqa: E402
from cli import cli_parser  # noqa: E402
from quantize import GROUPSIZES  # noqa: E402


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--shape", choices=list(SHAPES), required=True, help="bench.py's shape of a known model")
    p.add_argument("--out_dir", type=Path, required=True, help="the AWQ folder to write (must not exist)")
    p.add_argument("--dense_dir", type=Path, default=None, help="also the same weights in fp16, here")
    p.add_argument("--groupsize", type=int, choices=GROUPSIZES, default=128, help="input channels per group")
    p.add_argument("--seed", type=int, default=0, help="of the random integers and scales")
    args = p.parse_args(argv)
    for folder in (args.out_dir, args.dense_dir):
        if folder is not None and folder.exists():
            p.error(f"{folder} exists: give a new folder")
    return args


if __name__ == "__main__":
    parse_args()  # --help and usage mistakes answer here, before the seconds torch takes to import

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from convert_hub_int4 import AWQ_ORDER, linear_shapes  # noqa: E402
from model import ModelArgs  # noqa: E402


def awq_words(values: torch.Tensor) -> torch.Tensor:
    """[rows, 8 n] values 0..15 -> int32 [rows, n], column 8k + AWQ_ORDER[j] in each word's 4-bit slot j."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for j, column in enumerate(AWQ_ORDER):
        words |= values[:, column::8].to(torch.int32) << (4 * j)  # slot 7 reaches the sign bit, as AWQ's does
    return words


def random_linear(out_features: int, in_features: int, groupsize: int, g: torch.Generator) -> tuple:
    """q [out, in] with a 0 and a 15 in every group, z [out, groups] in 1..15, power-of-two fp16 scales s."""
    q = torch.randint(0, 16, (out_features, in_features // groupsize, groupsize), dtype=torch.uint8, generator=g)
    q[..., 0], q[..., 1] = 0, 15
    z = torch.randint(1, 16, q.shape[:2], dtype=torch.uint8, generator=g)
    s = (2.0 ** -torch.randint(7, 10, q.shape[:2], generator=g).float()).half()
    return q.flatten(1), z, s


def layer_tensors(i: int, args: ModelArgs, groupsize: int, g: torch.Generator, dense: bool) -> tuple:
    """Decoder layer i in AWQ's GEMM layout, and (if dense) as fp16 weights w = (q - z) * s."""
    awq, plain = {}, {}
    for module, (out_features, in_features, has_bias) in linear_shapes(args).items():
        name = f"model.layers.{i}.{module}"
        q, z, s = random_linear(out_features, in_features, groupsize, g)
        awq.update({f"{name}.qweight": awq_words(q.T), f"{name}.qzeros": awq_words(z.T),
                    f"{name}.scales": s.T.contiguous()})
        if dense:
            plain[f"{name}.weight"] = ((q.float() - z.float().repeat_interleave(groupsize, 1))
                                       * s.float().repeat_interleave(groupsize, 1)).half()
        if has_bias:
            awq[f"{name}.bias"] = plain[f"{name}.bias"] = torch.zeros(out_features, dtype=torch.float16)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        awq[f"model.layers.{i}.{norm}.weight"] = plain[f"model.layers.{i}.{norm}.weight"] = \
            torch.ones(args.dim, dtype=torch.float16)
    return awq, plain


def main(argv=None):
    args = parse_args(argv)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float16",
              "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 8192, **SHAPES[args.shape]}
    shape, g = ModelArgs.from_hf_config(config), torch.Generator().manual_seed(args.seed)
    folders = [args.out_dir] + ([args.dense_dir] if args.dense_dir else [])
    quantization = {"quant_method": "awq", "bits": 4, "group_size": args.groupsize, "version": "gemm",
                    "zero_point": True}
    maps = {folder: {} for folder in folders}

    def write(folder, name, tensors):
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / name))
        maps[folder].update({k: name for k in tensors})
    rest = {"model.embed_tokens.weight": (torch.randn(shape.vocab_size, shape.dim, generator=g) * 0.02).half(),
            "model.norm.weight": torch.ones(shape.dim, dtype=torch.float16),
            "lm_head.weight": (torch.randn(shape.vocab_size, shape.dim, generator=g) * 0.02).half()}
    for folder in folders:
        write(folder, "model-rest.safetensors", rest)
    for i in range(shape.n_layer):
        awq, plain = layer_tensors(i, shape, args.groupsize, g, args.dense_dir is not None)
        write(args.out_dir, f"model-layer{i:03d}.safetensors", awq)
        if args.dense_dir:
            write(args.dense_dir, f"model-layer{i:03d}.safetensors", plain)
        print(f"layer {i + 1}/{shape.n_layer}", flush=True)
    for folder in folders:
        extra = {"quantization_config": quantization} if folder == args.out_dir else {}
        (folder / "config.json").write_text(json.dumps({**config, **extra}, indent=1))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": maps[folder]}))
    print(f"wrote {', '.join(str(f) for f in folders)}")


if __name__ == "__main__":
    main()
