"""A plain decoding step at context 256 in a 512-slot and an 8192-slot cache (random weights of a mid-size LLaMA,
eager, CPU): with attention over the filled slots only the two cost the same; over the whole cache they do not.

    python scripts/experiments/cache_size_bench.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cli import cli_parser  # noqa: E402

if __name__ == "__main__":
    cli_parser(__doc__).parse_args()  # no flags: --help answers before torch's import

import torch  # noqa: E402

import measure  # noqa: E402
from decode import decode_one_token  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

CONFIG = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192)
WAYS = {"filled (eager default)": {"filled": 257}, "whole cache (before)": {}}


def median_step_ms(target: Transformer, **kwargs) -> float:
    token, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([256])
    times = []
    with torch.no_grad():
        for i in range(33):  # 3 warm-up steps
            t0 = time.perf_counter()
            decode_one_token(target, token, pos, SamplingConfig(), **kwargs)
            times += [time.perf_counter() - t0] if i >= 3 else []
    return sorted(times)[len(times) // 2] * 1e3


def main():
    torch.manual_seed(0)
    target = measure.random_module(Transformer, ModelArgs.from_hf_config(CONFIG), "cpu", torch.float32)
    ms = {}
    for size in (512, 8192):
        target.setup_caches(1, size)
        for name, kwargs in WAYS.items():
            ms[size, name] = median_step_ms(target, **kwargs)
            print(f"{size} slots, {name}: {ms[size, name]:.2f} ms (median of 30)")
    for name in WAYS:
        print(f"{name}: 8192 / 512 slots = {ms[8192, name] / ms[512, name]:.3f}")


if __name__ == "__main__":
    main()
