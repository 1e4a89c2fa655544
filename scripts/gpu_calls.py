"""The next GPU round's two calls (round 7), prepared: each call's steps in order, each a fresh process with its own time
limit, all within --budget_s. A step writes under OUT/<step> (a folder, or OUT/<step>.json / .md) as it goes and its
output to OUT/calls.log; OUT/calls.md gets a row per step as it ends (exit status, seconds, timed out or not), so a
call cut short keeps what it measured. Call 1 leaves 6 files, call 2 8: a GPU loan may bring back no more than 8. A
step that would start with less than half its time left is skipped and says so. --dry_run runs the same steps on this
CPU with shapes a CPU runs (tiny / reduced): what a session checks before it spends device time.

    python scripts/gpu_calls.py --call 1 --out $OUT --commit abc1234   # the speed A/Bs, exactness on CUDA
    python scripts/gpu_calls.py --call 2 --out $OUT --commit abc1234   # long context, the new drafters' cycles,
                                                                       # bf16 rows, --exact
    python scripts/gpu_calls.py --call 1 --out /tmp/c1 --dry_run       # the CPU dry run of call 1

The structured-output steps need llguidance, which the GPU machine's image lacks: carry its wheel (BENCHMARKS.md,
"The next GPU calls").
"""
import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = ("import platform, torch; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', "
       "torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')")

STEP_MARGIN_S = 15  # of a step's limit, for its imports, CUDA's start and its last writes

# speed_ab's rows, the cycle's graphs A/B first (a row that would end past the budget is skipped); GPU round 6 measured the
# plain rows and eagle2/trees/draft_vocab alone (BENCHMARKS.md), which comes again here as the A/B's other half
SPEED_ROWS = ("eagle2/trees/draft_vocab,eagle2/captured/draft_vocab,eagle2/captured/draft_vocab/split,"
              "eagle2/trees/whole")
# round 6 measured P-EAGLE's chain; each row compiles its cycle afresh, about 50 s on the 8B shape
CYCLE_ROWS = "DFlash2 chain,XPress chain,DFlash chain,P-EAGLE tree 32"


@dataclass
class Step:
    name: str
    item: str  # what it measures
    seconds: int  # its time limit
    gpu: list  # the script and its arguments on the GPU; {out} is OUT/<name>, {commit} --commit, {budget} the step's
    # own limit less STEP_MARGIN_S (the script skips a row that would end later: a row cut off keeps nothing)
    cpu: list  # the same on a CPU (--dry_run)


CALLS = {
    1: [Step("env", "the machine", 30, ["-c", ENV], ["-c", ENV]),
        Step("speed_ab", "the speed A/Bs and a timeline", 200,
             ["scripts/speed_ab.py", "--out", "{out}", "--budget_s", "{budget}", "--tokens", "256", "--rows", SPEED_ROWS,
              "--commit", "{commit}"],
             ["scripts/speed_ab.py", "--out", "{out}", "--device", "cpu", "--shape", "reduced", "--tokens", "24",
              "--repeats", "2", "--budget_s", "{budget}", "--rows", SPEED_ROWS, "--commit", "{commit}"]),
        Step("exact", "correctness on CUDA", 130,
             ["scripts/cuda_exact.py", "--out", "{out}.json", "--budget_s", "{budget}"],
             ["scripts/cuda_exact.py", "--out", "{out}.json", "--device", "cpu", "--tokens", "16", "--budget_s", "30"])],
    2: [Step("exact_bf16", "--exact on CUDA: speculative == plain in bf16 (demo, compiled), and its cost", 120,
             ["scripts/exact_bench.py", "--checkpoint_path", "demo/target/model.pth", "--head", "demo/head/draft.pth",
              "--device", "cuda", "--precision", "bf16", "--compile", "--prompts", "4", "--max_new_tokens", "96",
              "--no_chat", "--out", "{out}.md"],
             ["scripts/exact_bench.py", "--checkpoint_path", "demo/target/model.pth", "--head", "demo/head/draft.pth",
              "--device", "cpu", "--precision", "bf16", "--prompts", "2", "--max_new_tokens", "16", "--no_chat",
              "--out", "{out}.md"]),
        Step("long", "long context (round 6: the plain step failed to compile at 32k; fixed, unmeasured)", 150,
             ["scripts/long_context.py", "--shape", "llama3-8b", "--device", "cuda", "--compile", "--lengths",
              "32768,8192", "--cases", "plain,head", "--random_head", "eagle", "--chunks", "2048", "--new_tokens", "32",
              "--out", "{out}.md"],
             ["scripts/long_context.py", "--shape", "tiny", "--device", "cpu", "--lengths", "300,900", "--cases",
              "plain,head", "--random_head", "eagle", "--chunks", "256", "--new_tokens", "16", "--out", "{out}.md"]),
        Step("cycles", "the new drafters' cycles", 130,
             ["scripts/drafter_cycles.py", "--out", "{out}", "--budget_s", "{budget}", "--rows", CYCLE_ROWS,
              "--commit", "{commit}"],
             ["scripts/drafter_cycles.py", "--out", "{out}", "--shape", "tiny", "--device", "cpu", "--repeats", "2",
              "--budget_s", "{budget}", "--rows", "DFlash chain,P-EAGLE tree 32", "--commit", "{commit}"]),
        Step("bf16_rows", "where bf16 parts speculative from plain (split-K off under cuBLASLt)", 40,
             ["scripts/bf16_rows.py", "--out", "{out}", "--commit", "{commit}"],
             ["scripts/bf16_rows.py", "--out", "{out}", "--device", "cpu", "--shape", "tiny", "--rows", "8", "--context",
              "16", "--repeats", "2", "--commit", "{commit}"])],
}


def run_step(step: Step, out: Path, dry_run: bool, limit: float, commit: str) -> tuple:
    """(exit status or None if stopped at its limit, seconds)."""
    budget = str(max(int(limit - STEP_MARGIN_S), 1))
    args = [a.replace("{out}", str(out / step.name)).replace("{commit}", commit).replace("{budget}", budget)
            for a in (step.cpu if dry_run else step.gpu)]
    t0 = time.perf_counter()
    with open(out / "calls.log", "a") as log:
        log.write(f"== {step.name}: {' '.join(args)}\n")
        log.flush()
        # a new process group: a step stopped at its limit takes the processes it started with it
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: sys.exit(f"error: {message}")  # one line, as every eaglet tool says a mistake
    p.add_argument("--call", type=int, choices=sorted(CALLS), required=True)
    p.add_argument("--out", type=Path, required=True, help="a folder, empty or new")
    p.add_argument("--budget_s", type=float, default=None, help="the whole call's seconds (default: its steps' limits "
                   "added up, call 1 360, call 2 440; the device tool's limit is 600)")
    p.add_argument("--commit", default="unknown", help="the commit that runs (the device's copy has no history)")
    p.add_argument("--only", default="", help="comma-separated step names to run (default: all of the call's)")
    p.add_argument("--dry_run", action="store_true", help="the same steps on this CPU, on shapes a CPU runs")
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = sum(step.seconds for step in CALLS[args.call])
    if not 0 < args.budget_s < float("inf"):
        p.error(f"--budget_s must be a positive number of seconds, got {args.budget_s}")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        sys.exit(f"error: {args.out} is not an empty folder; give a new one")
    steps = [s for s in CALLS[args.call] if not args.only or s.name in args.only.split(",")]
    if not steps:
        sys.exit(f"error: --only names none of call {args.call}'s steps ({', '.join(s.name for s in CALLS[args.call])})")
    args.out.mkdir(parents=True, exist_ok=True)
    table = args.out / "calls.md"
    table.write_text(f"call {args.call}, commit {args.commit}, {'CPU dry run' if args.dry_run else 'GPU'}, "
                     f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
                     "| step | measures | exit | seconds | limit |\n| --- | --- | --- | --- | --- |\n")
    deadline = time.perf_counter() + args.budget_s
    for step in steps:
        left = deadline - time.perf_counter()
        if left < step.seconds / 2:
            row = f"| {step.name} | {step.item} | skipped: {left:.0f} s left | | {step.seconds} |"
        else:
            limit = min(step.seconds, left)
            print(f"{step.name} ({step.item}), at most {limit:.0f} s", flush=True)
            rc, seconds = run_step(step, args.out, args.dry_run, limit, args.commit)
            row = f"| {step.name} | {step.item} | {'stopped at its limit' if rc is None else rc} | {seconds:.0f} | {limit:.0f} |"
        with open(table, "a") as f:
            f.write(row + "\n")
        print(row, flush=True)


if __name__ == "__main__":
    main()
