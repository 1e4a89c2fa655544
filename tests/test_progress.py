"""cli.Progress: the line's format, rate and ETA from the counts and a fake clock, when lines are printed
(to a log, and redrawn in place on a terminal)."""
import io
import shutil
import subprocess
import sys

import pytest

from cli import Progress, format_duration, format_rate
from conftest import HANG_S, ROOT


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def run(progress, clock, times_and_counts):
    """Advance the fake clock to each time and update to each count; the lines printed."""
    lines = []
    for t, done in times_and_counts:
        clock.now = 1000.0 + t
        line = progress.update(done)
        if line is not None:
            lines.append(line)
    return lines


def test_line_format_rate_and_eta_come_from_the_counts():
    clock, logged = Clock(), []
    p = Progress("self-distilling", 200, "examples", log=logged.append, clock=clock)
    clock.now += 40.0
    assert p.show(10) == "self-distilling 10/200 examples (5.0%), 4 s each, elapsed 40s, ETA 12m40s"
    clock.now += 10.0  # 30 done in 50 s: 0.6/s, 170 left
    assert p.show(30, "q.jsonl") == ("self-distilling 30/200 examples (15.0%), 1.67 s each, elapsed 50s, "
                                     "ETA 4m43s; q.jsonl")
    clock.now += 50.0  # 200 in 100 s: the last line has no ETA
    assert p.show(200) == "self-distilling 200/200 examples (100.0%), 2/s, elapsed 1m40s"
    assert logged == [logged[0], logged[1], "self-distilling 200/200 examples (100.0%), 2/s, elapsed 1m40s"]


def test_a_resumed_run_counts_only_its_own_items():
    clock = Clock()
    p = Progress("training", 1000, "steps", start=600, log=lambda _: None, clock=clock)
    assert "rate not known yet" in p.show(600) and "ETA not known yet" in p.show(600)
    clock.now += 20.0  # 100 steps in 20 s: 5/s, not (700 / 20)/s
    assert p.show(700) == "training 700/1000 steps (70.0%), 5/s, elapsed 20s, ETA 1m00s"


def test_lines_every_fraction_of_the_work_or_when_time_has_passed_and_always_the_last():
    clock = Clock()
    p = Progress("quantizing", 1000, "tensors", log=lambda _: None, clock=clock)  # 5%: every 50
    fast = run(p, clock, [(0.001 * i, i) for i in range(1, 1001)])
    assert [line.split()[1] for line in fast] == [f"{n}/1000" for n in range(50, 1001, 50)]

    clock = Clock()
    p = Progress("self-distilling", 68000, "examples", log=lambda _: None, clock=clock)
    slow = run(p, clock, [(i, i) for i in range(1, 6001)] + [(6001, 68000)])  # one a second: by time
    counts = [int(line.split()[1].split("/")[0]) for line in slow]
    assert counts[:3] == [10, 20, 30]  # every 10 s at first
    gaps = {b: b - a for a, b in zip(counts, counts[1:-1])}
    assert all(abs(gap - b / 20) < 1 for b, gap in gaps.items() if 200 < b < 2400)  # then a twentieth of the time
    assert all(gap == 120 for b, gap in gaps.items() if b > 2600)  # at most 2 minutes apart
    assert len(slow) < 100 and counts[-1] == 68000  # 6001 updates


def test_the_last_line_is_printed_once():
    clock = Clock()
    p = Progress("training", 3, "steps", log=lambda _: None, clock=clock)
    assert run(p, clock, [(1, 1), (2, 2), (3, 3), (3, 3)])[-1].startswith("training 3/3 steps (100.0%)")
    assert p.update(3) is None


def test_detail_is_computed_only_for_printed_lines():
    clock, calls = Clock(), []

    def detail():
        calls.append(1)
        return "loss 1.0"
    p = Progress("training", 100, "steps", log=lambda _: None, clock=clock)
    for step in range(1, 101):
        clock.now += 0.01
        p.update(step, detail)
    assert len(calls) == 20  # every 5 steps, not every step


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_one_line_redrawn_and_a_log_gets_lines():
    clock, out = Clock(), Terminal()
    p = Progress("training", 10, "steps", clock=clock, stream=out)
    run(p, clock, [(0.25 * i, i) for i in range(1, 11)])
    text = out.getvalue()
    assert text.count("\r") == 5 and text.count("\n") == 1  # every 0.5 s, the last line ended
    assert text.endswith("\rtraining 10/10 steps (100.0%), 4/s, elapsed 2s\x1b[K\n")
    clock, out = Clock(), Terminal()
    with Progress("training", 10, "steps", clock=clock, stream=out) as p:  # stopped at step 3: the line is ended
        run(p, clock, [(0.25 * i, i) for i in range(1, 4)])
    assert out.getvalue() == "\rtraining 2/10 steps (20.0%), 4/s, elapsed 0s, ETA 2s\x1b[K\n"
    clock, out = Clock(), io.StringIO()  # not a terminal: lines
    run(Progress("training", 10, "steps", clock=clock, stream=out), clock, [(0.25 * i, i) for i in range(1, 11)])
    assert "\r" not in out.getvalue() and len(out.getvalue().splitlines()) == 10


def test_durations_and_rates():
    assert [format_duration(s) for s in (0, 59.4, 61, 3599, 3600, 7380, 49 * 3600)] == \
        ["0s", "59s", "1m01s", "59m59s", "1h00m", "2h03m", "2d01h"]
    assert [format_rate(r) for r in (0.25, 1, 12.34, 5000.4)] == ["4 s each", "1/s", "12.3/s", "5000/s"]


@pytest.mark.slow
def test_a_real_process_writing_to_a_pipe_prints_plain_lines(checkpoints, tmp_path):
    target_dir, _ = checkpoints("llama2")
    shutil.copy(target_dir / "model.pth", tmp_path / "model.pth")
    proc = subprocess.run([sys.executable, str(ROOT / "quantize.py"), "--checkpoint_path", str(tmp_path / "model.pth"),
                           "--mode", "int8"], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "\r" not in proc.stdout and "\x1b" not in proc.stdout
    assert [line.split(",")[0] for line in lines[:3]] == [f"quantizing {i}/3 layer groups ({100 * i / 3:.1f}%)"
                                                          for i in (1, 2, 3)]
    assert lines[2].endswith("; quantized layers.1") and "ETA" in lines[1] and "ETA" not in lines[2]
