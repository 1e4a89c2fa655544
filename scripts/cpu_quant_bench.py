"""Plain decoding on a CPU in each weight format: random weights of SmolLM2-135M's shape (bench.py's
smollm2-135m: 30 layers, 576 wide, tied embeddings), quantized in memory by quantize.py, one token a step.

    python scripts/cpu_quant_bench.py                                   # fp32 activations, 1 thread, eager
    python scripts/cpu_quant_bench.py --formats float,int8 --precision bf16 --compile

Prints one line per format: the median step over --steps steps after a 16-token prompt, and tokens/s.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli import cli_parser, int_flag  # noqa: E402

FORMATS = ("float", "int8", "int4.g32", "int4.g64", "int4.g128")  # float: unquantized, in the activations' dtype
SHAPE = "smollm2-135m"
PROMPT = 16


def parse_args(argv=None):
    p = cli_parser(__doc__)
    p.add_argument("--formats", default="float,int8,int4.g32,int4.g64", help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="the activations' dtype")
    p.add_argument("--threads", type=int_flag(1), default=1, help="torch.set_num_threads")
    p.add_argument("--steps", type=int_flag(1), default=32, help="timed decoding steps (after 3 untimed)")
    p.add_argument("--compile", action="store_true", help="torch.compile the step (generate.py --compile)")
    args = p.parse_args(argv)
    args.formats = args.formats.split(",")
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        p.error(f"unknown format {unknown[0]!r}; known: {', '.join(FORMATS)}")
    return args


if __name__ == "__main__":
    parse_args()

import torch  # noqa: E402

import measure  # noqa: E402
from load import PRECISIONS  # noqa: E402
from decode import decode_one_token  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from graphs import compile_step  # noqa: E402
from quantize import quantize_state_dict, weights_format  # noqa: E402
from model import EagletError, ModelArgs, Transformer  # noqa: E402


def target_in(fmt: str, source: Transformer, dtype) -> Transformer:
    """The fp32 source's weights in this format, activations in dtype."""
    state_dict = source.state_dict()
    if fmt != "float":
        mode, _, group = fmt.partition(".g")
        state_dict = quantize_state_dict(state_dict, mode, int(group or 128))
    return Transformer.from_state_dict(source.args, state_dict, "cpu", dtype, f"the {fmt} weights")


def median_step_s(target: Transformer, steps: int, compiled: bool) -> float:
    target.setup_caches(1, PROMPT + steps + 8)
    prompt = torch.randint(0, target.args.vocab_size, (1, PROMPT))
    step_fn = compile_step(decode_one_token, "cpu") if compiled else decode_one_token
    times = []
    with torch.no_grad():
        token = decode_one_token(target, prompt[:, :1], torch.tensor([0]), SamplingConfig())
        for pos in range(1, PROMPT + 3 + steps):  # the prompt's tokens one by one, 3 untimed steps, then timed
            token = prompt[:, pos:pos + 1] if pos < PROMPT else token.view(1, 1)
            t0 = time.perf_counter()
            kwargs = {} if compiled else {"filled": pos + 1}
            token = step_fn(target, token, torch.tensor([pos]), SamplingConfig(), **kwargs)
            times += [time.perf_counter() - t0] if pos >= PROMPT + 3 else []
    return sorted(times)[len(times) // 2]


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = {"model_type": "llama", "max_position_embeddings": 8192, **measure.SHAPES[SHAPE]}
    source = measure.random_module(Transformer, ModelArgs.from_hf_config(config), "cpu", torch.float32)
    for fmt in args.formats:
        try:
            target = target_in(fmt, source, PRECISIONS[args.precision])
        except EagletError as e:
            print(f"{fmt}: {e}")
            continue
        step_s = median_step_s(target, args.steps, args.compile)
        print(f"{fmt} ({weights_format(target)}), {args.precision} activations, {args.threads} thread(s), "
              f"{'compiled' if args.compile else 'eager'}: {step_s * 1e3:.1f} ms a step, {1 / step_s:.1f} tokens/s",
              flush=True)


if __name__ == "__main__":
    main()
