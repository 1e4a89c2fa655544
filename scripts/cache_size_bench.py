"""A plain decoding step at context 256 in a 512-slot and an 8192-slot cache (random weights of a mid-size LLaMA,
eager, CPU): with attention over the filled slots only the two cost the same; over the whole cache they do not.

    python scripts/cache_size_bench.py
"""
import sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import bench
from generate import decode_one_token, SamplingConfig
from model import ModelArgs, Transformer
torch.manual_seed(0)
cfg = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192)
target = bench.random_module(Transformer, ModelArgs.from_hf_config(cfg), "cpu", torch.float32)
G = SamplingConfig()
tok, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([256])
res = {}
for size in (512, 8192):
    target.setup_caches(1, size)
    for name, kw in (("filled (eager default)", {"filled": 257}), ("whole cache (before)", {})):
        with torch.no_grad():
            for _ in range(3): decode_one_token(target, tok, pos, G, **kw)
            ts = []
            for _ in range(30):
                t = time.perf_counter(); decode_one_token(target, tok, pos, G, **kw); ts.append(time.perf_counter() - t)
        ts.sort(); res[(size, name)] = ts[len(ts)//2] * 1e3
for k, v in res.items(): print(k, f"{v:.2f} ms (median of 30)")
for name in ("filled (eager default)", "whole cache (before)"):
    print(name, "8192/512 =", f"{res[(8192, name)] / res[(512, name)]:.3f}")
