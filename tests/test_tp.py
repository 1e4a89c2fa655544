"""Tensor parallel (tp.py): a target sharded over 2 processes (torchrun, gloo, fp32) gives the tokens and accepted
lengths of the single-process run, plain and speculative, in bf16-converted, int8, int4 and biased targets;
the CLI under torchrun prints and writes once; each mistake is one error line from rank 0 and a non-zero exit
on every rank."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import quantize
import tp
from conftest import HANG_S, ROOT, make_agreeing_pair, read_generation
from model import EagletError, ModelArgs
from tokenizer import Tokenizer
from tp_worker import run_cases

DEMO = ROOT / "demo"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
CODE_PROMPTS = ["def read_lines(path):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self"]


def torchrun(n: int, argv: list, timeout: int = HANG_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(TORCHRUN + [f"--nproc_per_node={n}"] + argv, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def targets(tmp_path_factory, checkpoints):
    """name -> model.pth: the demo target (4 heads, 2 K/V heads, tied embeddings), its int8 and int4 files, and
    converted tiny LLaMA (q/k/v/o and MLP biases), Qwen2 (q/k/v biases) and Qwen3 (q/k norms) targets."""
    root = tmp_path_factory.mktemp("tp_targets")
    demo = root / "demo"
    shutil.copytree(DEMO / "target", demo)
    paths = {"demo": demo / "model.pth"}
    paths["demo_int8"] = quantize.quantize_checkpoint(demo / "model.pth", "int8", log=lambda *a: None)
    paths["demo_int4"] = quantize.quantize_checkpoint(demo / "model.pth", "int4", 32, log=lambda *a: None)
    for kind in ("llama_bias", "qwen2", "qwen3"):
        paths[kind] = checkpoints(kind)[0] / "model.pth"
    return paths


def code_prompts() -> list:
    tokenizer = Tokenizer(DEMO / "target")
    return [tokenizer.encode(p) for p in CODE_PROMPTS]


def cases(targets) -> list:
    head, head3, code = str(DEMO / "head"), str(DEMO / "head3"), code_prompts()
    g = torch.Generator().manual_seed(0)
    small = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (5, 11)]
    demo = str(targets["demo"])
    return [dict(target=demo, head=None, prompts=code, max_new_tokens=40),
            dict(target=demo, head=head, prompts=code, max_new_tokens=40),
            dict(target=demo, head=head3, prompts=code, max_new_tokens=40),
            dict(target=demo, head=head, prompts=code[:1], max_new_tokens=40, temperature=0.8, seed=3),
            dict(target=str(targets["demo_int8"]), head=head, prompts=code[:2], max_new_tokens=30),
            dict(target=str(targets["demo_int4"]), head=None, prompts=code[:2], max_new_tokens=30),
            dict(target=str(targets["demo_int4"]), head=head3, prompts=code[:2], max_new_tokens=30),
            dict(target=demo, head=head, prompts=code, max_new_tokens=40, batch=True),
            dict(target=demo, head=str(DEMO / "dflash"), prompts=code, max_new_tokens=40)] + \
        [dict(target=str(targets[kind]), head=None, prompts=small, max_new_tokens=16)
         for kind in ("llama_bias", "qwen2", "qwen3")] + \
        [dict(target=demo, head=None, prompts=code[:1], max_new_tokens=20, perturb="lm_head"),
         dict(target=demo, head=head, prompts=code[:1], max_new_tokens=20, perturb="head")]


@pytest.mark.slow
def test_tensor_parallel_equals_one_process(targets, tmp_path):
    todo = cases(targets)
    (tmp_path / "cases.json").write_text(json.dumps(todo))
    run = torchrun(2, ["tests/tp_worker.py", str(tmp_path / "cases.json"), str(tmp_path / "out.json")])
    assert run.returncode == 0, run.stderr[-3000:]
    sharded = json.loads((tmp_path / "out.json").read_text())
    alone = run_cases(todo[:-2])
    for case, a, b in zip(todo, alone, sharded):
        assert a == b, (case["target"], case["head"])
    for disagreeing in sharded[-2:]:  # rank 1 computing otherwise: every rank stops, none waits, the next case runs
        assert "tensor parallel ranks decided differently" in disagreeing["error"]
    plain, eagle2, eagle3 = sharded[:3]
    for spec in (eagle2, eagle3):  # greedy speculative == greedy plain under tensor parallel too
        assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
        emitted = [n for r in spec for n in r["accept_lengths"]]
        assert sum(emitted) / len(emitted) > 2  # the heads' trees were accepted deep: the cycle really ran
    assert [r["tokens"] for r in sharded[6]] == [r["tokens"] for r in sharded[5]]  # int4: speculative == plain
    assert sharded[7] == eagle2  # the prompts decoded together under tensor parallel: each as alone
    assert [r["tokens"] for r in sharded[8]] == [r["tokens"] for r in plain]  # a DFlash head (replicated), its block's tree
    assert max(n for r in sharded[8] for n in r["accept_lengths"]) > 1
    assert sharded[3][0]["tokens"] != plain[0]["tokens"]  # the sampled case sampled


@pytest.mark.slow
def test_cli_under_torchrun_prints_and_writes_once(tmp_path, capsys):
    import generate
    argv = ["generate.py", "--max_new_tokens", "30", "--step_aside", "off", "--json_out"]  # cycles alone, as sharded
    run = torchrun(2, argv + [str(tmp_path / "tp.json")])
    assert run.returncode == 0, run.stderr[-3000:]
    generate.main(argv[1:] + [str(tmp_path / "one.json")])
    assert run.stdout.count("tensor parallel over 2 ranks") == 1 and run.stdout.count("tokens in ") == 1
    assert "weights read" in run.stdout and "per rank" in run.stdout
    sharded, alone = read_generation(tmp_path / "tp.json"), read_generation(tmp_path / "one.json")
    assert sharded["tokens"] == alone["tokens"] and sharded["accept_lengths"] == alone["accept_lengths"]


def error_lines(run: subprocess.CompletedProcess) -> list:
    return [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("error: ")]


@pytest.mark.slow
@pytest.mark.parametrize("n, extra, match", [
    (3, [], "3 ranks are more than the model's 2 key/value heads"),
    (2, ["--interactive", "--checkpoint_path", str(DEMO / "target")], "--interactive reads the terminal in one process"),
    (2, ["--max_new_tokens", "0"], "--max_new_tokens: must be at least 1"),
])
def test_errors_under_torchrun(n, extra, match):
    run = torchrun(n, ["generate.py"] + extra)
    assert run.returncode != 0
    assert len(error_lines(run)) == 1 and match in error_lines(run)[0], run.stdout + run.stderr


@pytest.mark.slow
def test_errors_of_sizes_and_heads_under_torchrun(checkpoints, tmp_path):
    target = checkpoints("llama2")[0]  # 4 heads, 4 K/V heads, intermediate 96
    run = torchrun(3, ["generate.py", "--checkpoint_path", str(target), "--prompt", "w1 w2"])
    assert run.returncode != 0 and len(error_lines(run)) == 1
    assert "4 attention heads do not split evenly over 3 ranks" in error_lines(run)[0]
    _, head, _ = make_agreeing_pair(tmp_path)  # a head of hidden size 64, the demo target's is 256
    run = torchrun(2, ["generate.py", "--draft_checkpoint_path", str(head)])
    assert run.returncode != 0 and len(error_lines(run)) == 1 and "head" in error_lines(run)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_checkpoint_missing_on_one_rank_stops_every_rank(tmp_path):
    """Started as torchrun starts them, rank 1 given a path its machine lacks: both ranks exit with status 1,
    rank 0 alone says why, naming the rank; neither waits for the other."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    paths = [DEMO / "target" / "model.pth", tmp_path / "model.pth"]
    procs = [subprocess.Popen([sys.executable, "generate.py", "--checkpoint_path", str(paths[r]), "--no_draft"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=HANG_S) for p in procs]
    finally:  # a rank left waiting for the other is a failure, not a hung test run
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 1]
    assert outputs[1] == ("", "")
    assert outputs[0][1].strip().splitlines() == [f"error: rank 1: checkpoint not found: {paths[1]}"]


def test_cuda_with_fewer_gpus_than_ranks_is_refused(monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(EagletError, match="4 ranks on this machine need as many GPUs, and it has 2"):
        tp.start("cuda")


def test_shards_cover_the_weights_once(targets):
    """Each Linear's shards put back together (rows, or columns and bias once) give the whole tensor."""
    from model import load_state_dict
    from quantize import pop_quantization
    for name in ("demo", "demo_int4", "llama_bias"):
        whole = load_state_dict(targets[name])
        pop_quantization(whole, name)
        args = ModelArgs.from_checkpoint_dir(targets[name].parent)
        shards = [tp.shard_state_dict(whole, args, r, 2) for r in range(2)]
        q, kv = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
        for key, t in whole.items():
            parts = [s[key] for s in shards]
            if ".wqkv." in key:  # each rank's q, k and v rows
                sizes = [q // 2, kv // 2, kv // 2]
                per_rank = [p.split(sizes) for p in parts]
                assert torch.equal(torch.cat([torch.cat([r[i] for r in per_rank]) for i in range(3)]), t), key
            elif ".w13." in key:
                half = args.intermediate_size // 2
                per_rank = [p.split(half) for p in parts]
                assert torch.equal(torch.cat([torch.cat([r[i] for r in per_rank]) for i in range(2)]), t), key
            elif key.endswith(("wo.bias", "w2.bias")):
                assert torch.equal(parts[0] + parts[1], t) and not parts[1].any(), key
            elif (".wo." in key or ".w2." in key) and t.ndim == 2:
                assert torch.equal(torch.cat(parts, dim=1), t), key
            else:
                assert all(torch.equal(p, t) for p in parts), key


def test_int4_slices_must_hold_whole_groups():
    args = ModelArgs(dim=256, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=192)
    tp.check_shardable(args, 2, {"mode": "int4", "groupsize": 32})
    with pytest.raises(EagletError, match="int4 groups of 64 do not tile each rank's 96 MLP down input channels"):
        tp.check_shardable(args, 2, {"mode": "int4", "groupsize": 64})


# generate.py with torch.compile traced (conftest.traced_compile): dynamo must take the all-reduces into the one
# graph (fullgraph); inductor building each rank's C++ at once cost a minute with an empty cache, for kernels
# that test_compiled_kv.py's inductor cycle builds without the collectives
TRACED_GENERATE = """
import sys
import torch
sys.path.insert(0, {tests!r})
from conftest import traced_compile
torch.compile = traced_compile()
import generate
generate.main()
"""


@pytest.mark.slow
def test_compiled_cycle_under_torchrun_equals_one_process(tmp_path):
    """The whole cycle as one compiled graph per rank, its all-reduces inside it (fullgraph)."""
    import generate
    launcher = tmp_path / "traced_generate.py"
    launcher.write_text(TRACED_GENERATE.format(tests=str(ROOT / "tests")))
    argv = ["--max_new_tokens", "20", "--step_aside", "off", "--json_out"]  # cycles alone, as sharded
    run = torchrun(2, [str(launcher), "--compile"] + argv + [str(tmp_path / "tp.json")], timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    generate.main(argv + [str(tmp_path / "one.json")])
    sharded, alone = read_generation(tmp_path / "tp.json"), read_generation(tmp_path / "one.json")
    assert sharded["tokens"] == alone["tokens"] and sharded["accept_lengths"] == alone["accept_lengths"]


@pytest.mark.slow
def test_bench_reports_weights_per_rank_and_collectives(tmp_path):
    import measure
    run = torchrun(2, ["bench.py", "--model", "tiny", "--repeats", "2", "--side_tokens", "8", "--out",
                       str(tmp_path / "b")])
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "b.json").read_text())
    shape = measure.SHAPES["tiny"]
    dim, heads, kv, inter, layers = (shape[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                          "intermediate_size", "num_hidden_layers"))
    head_dim = dim // heads
    per_layer = dim * (heads + 2 * kv) * head_dim + heads * head_dim * dim + 3 * dim * inter  # the sharded Linears
    replicated = dim + 2 * layers * dim + dim + shape["vocab_size"] * dim  # an embedding row, norms, lm_head
    per_rank = (replicated + layers * per_layer / 2) * 4  # fp32 bytes
    assert results["tensor_parallel"]["weights_per_rank_GB"] * 1e9 == pytest.approx(per_rank)
    assert results["plain"]["weights_GB"] * 1e9 == pytest.approx(per_rank)  # every figure is rank 0's
    assert results["tensor_parallel"]["collectives_per_plain_step"] == 2 * layers + 1  # + the agreement check
    assert results["tensor_parallel"]["collectives_per_cycle"] == 2 * layers + 1
    assert results["setup"]["command"].startswith("torchrun --standalone --nproc_per_node=2 bench.py")
    assert "Tensor parallel over 2 ranks" in (tmp_path / "b.md").read_text()


def test_a_file_that_does_not_match_its_config_is_named_before_it_is_cut(targets):
    from dataclasses import replace
    from model import load_state_dict
    for name in ("demo", "demo_int4"):
        state_dict = load_state_dict(targets[name])
        args = ModelArgs.from_checkpoint_dir(targets[name].parent)
        tp.check_whole_shapes(state_dict, args, targets[name])  # as written
        with pytest.raises(EagletError, match=r"layers.0.feed_forward.w(13.weight is|2: .* int4 scales do not)"):
            tp.check_whole_shapes(state_dict, replace(args, intermediate_size=512), targets[name])
