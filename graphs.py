"""Compiling the step and the cycle: torch.compile's settings, and how a compiled CUDA step or cycle is replayed
(torch.compile's CUDA-graph trees, or CapturedGraphs)."""
import os
from typing import Callable

import torch
from torch import Tensor

from draft_tree import TreeConfig
from decode import decode_one_token, speculative_cycle
from lookup import lookup_cycle
from sampling import SamplingConfig, SamplingInputs
from model import Transformer


# How a compiled CUDA step is replayed: CapturedGraphs, or torch.compile's CUDA-graph trees (mode="reduce-overhead"),
# which check and copy their inputs on every call. The plain step is captured by default: 200.9 tokens/s end to end
# against 174.4 with trees (H200, LLaMA-3-8B shape, 0.09 ms outside each call against 0.74; BENCHMARKS.md). The
# cycle's A/B is not measured yet, so it stays on trees. EAGLET_GRAPHS=manual captures both, =trees neither.
GRAPHS = os.environ.get("EAGLET_GRAPHS", "")


def captures(step_fn: Callable) -> bool:
    return GRAPHS == "manual" or (GRAPHS == "" and step_fn is decode_one_token)


def compile_step(step_fn: Callable, device: str):
    """CUDA: fixed shapes captured as a CUDA graph (a plain step's BlockMask keeps its reads to the filled cache
    blocks). CPU: inductor alone, no graph to capture, so the plain step is compiled with dynamic shapes and
    given the filled length as eager code is: one graph for every length, reading the filled slots only (over
    the whole cache, masked, a 30-layer model's step cost 1.4x as much at 4,096 slots as at 256; BENCHMARKS.md). An
    n-gram lookup's verify too: one graph for its trees of every size."""
    if device.startswith("cuda"):
        if step_fn in (decode_one_token, speculative_cycle) and captures(step_fn):
            return CapturedGraphs(torch.compile(step_fn, fullgraph=True))
        return torch.compile(step_fn, mode="reduce-overhead", fullgraph=True)
    return torch.compile(step_fn, fullgraph=True, dynamic=step_fn in (decode_one_token, lookup_cycle))


class CapturedGraphs:
    """A compiled step or cycle replayed as a torch.cuda.CUDAGraph, one per distinct call: per call only the input
    tensors are copied into the graph's own and the graph is replayed (no guards, no input checks). A call is told
    apart by its tensors' shapes and the identity or value of the rest (the model, the head, the tree; of the sampling,
    whether it is greedy, scores tokens and is penalized: a SamplingInputs' settings and history are copied in as
    tensors are).
    The outputs live in the graph's memory, overwritten by the next replay: callers clone them (plain_call,
    cycle_call, generate_batch do). Capturing runs the call three times first on a side stream (as CUDA graph
    capture needs); a step or a cycle run again from the same state writes only past the context it starts from,
    so that is harmless -- but when sampling, those runs draw random numbers: a seeded first generation differs
    from a later one with the same seed."""

    def __init__(self, compiled: Callable):
        self.compiled, self.graphs, self.pool = compiled, {}, None

    def __call__(self, *args):
        key = tuple((a.shape, a.dtype) if isinstance(a, Tensor) else (a.greedy, a.logprobs, a.history is not None)
                    if isinstance(a, SamplingInputs) else repr(a) if isinstance(a, (SamplingConfig, TreeConfig))
                    else id(a) for a in args) + (getattr(args[0], "exact_rows", 0),)  # the model's --exact padding
        if key not in self.graphs:
            self.graphs[key] = self.capture(args)
        inputs, graph, outputs = self.graphs[key]
        for static, a in zip(inputs, args):
            if isinstance(a, SamplingInputs):
                static.settings.copy_(a.settings)
                if a.history is not None:
                    static.history.copy_(a.history)
            elif static is not None:
                static.copy_(a)
        graph.replay()
        return outputs

    def capture(self, args):
        inputs = [a.clone() if isinstance(a, Tensor) else SamplingInputs(
            a.greedy, a.settings.clone(), a.logprobs, None if a.history is None else a.history.clone())
            if isinstance(a, SamplingInputs) else None for a in args]
        call_args = [a if static is None else static for static, a in zip(inputs, args)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.compiled(*call_args)
        torch.cuda.current_stream().wait_stream(side)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.compiled(*call_args)
        return inputs, graph, outputs


def compile_settings(target: Transformer, device: str):
    """A quantized Linear converts its weight inside the graph; inductor turns a one-row matmul over such a
    weight into a fused GEMV (reading int8 bytes, not a bf16 copy written each step) only with
    coordinate-descent tuning on (torch 2.13's mm decomposition), as gpt-fast sets it. bf16 targets keep
    cuBLAS's GEMV, as measured (BENCHMARKS.md)."""
    if str(device).startswith("cuda") and target.quantization:
        torch._inductor.config.coordinate_descent_tuning = True
