"""The tools' command lines, in the standard library only: each tool parses its flags before it imports
torch (seconds), so --help and usage mistakes answer at once."""
import argparse
import math
import os
import re
import sys
import time
from typing import Callable, Union

PRECISION_NAMES = ("bf16", "fp16", "fp32")
# generate.py's demo prompt and what its --tree auto measures (tune.py), here so that its --help can name them.
DEMO_PROMPT = "def read_lines(path):\n"  # where the small demo model writes plausible code for a while
# --tree auto's trees, as (depth, tree_topk, total_tokens): chains (tree_topk 1, total_tokens = depth + 1), which win
# where every verified token costs time (a batch-1 EAGLE-3 chain of 7 beat top-k trees on an H200), trees up to
# int4's first 16-row step and past it, and the default 6/10/60.
TREE_GRID = ((3, 1, 4), (5, 1, 6), (7, 1, 8), (5, 3, 16), (6, 4, 32), (6, 10, 60))
# Prompts --tree auto decodes (greedy, CALIBRATION_TOKENS each) to measure each tree's tau: code, prose, a question.
CALIBRATION_PROMPTS = (DEMO_PROMPT, "The history of the printing press begins",
                       "Question: why does ice float on water?\nAnswer:")
CALIBRATION_TOKENS = 64
# EAGLE-1/2 heads on targets of more than DRAFT_VOCAB_ABOVE ids (LLaMA-3: 128,256; Qwen2/3: 151,936) draft over the
# DEFAULT_DRAFT_VOCAB lowest ids (head_formats.default_draft_vocab) unless a draft_vocab.json lies beside the head: on
# LLaMA-3-8B the lm_head a draft pass reads shrinks from 1.05 GB to 0.27 GB; the SmolLM2 head's tau did not move at
# 32,768 of its 49,152 ids (BENCHMARKS.md).
DRAFT_VOCAB_ABOVE, DEFAULT_DRAFT_VOCAB = 65536, 32768
# bench.py's --model and the scripts' --shape, here so that their --help can list them (measure.py builds them).
SHAPES = {  # Hugging Face config fields of well-known models, for random-weight timing runs
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32),
    "llama2-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40),
    "llama2-70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every flag's default after its help line."""

    def _get_help_string(self, action):
        # `is`, not `in (None, False)`: a default of 0 or 0.0 equals False and must still be shown
        if "default" in (action.help or "") or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return action.help
        return f"{action.help or ''} (default: {action.default})"


def cli_parser(doc: str) -> argparse.ArgumentParser:
    """The tools' argument parser: --help shows every default; a usage mistake ends with one line,
    'error: ...', and exit status 1, like every other mistake."""
    p = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)
    p.error = lambda message: sys.exit(f"error: {message}" if not torchrun_rank() else after_rank_0(1))
    if torchrun_rank():  # --help and usage once, from rank 0
        p.print_help = p.print_usage = lambda *args, **kwargs: None
    return p


def grid_text(grid=TREE_GRID) -> str:
    return ", ".join(f"{d}/{k}/{n}" for d, k, n in grid)


RANK_EXIT_WAIT_S = 10.0


def after_rank_0(status: int = 1) -> int:
    """A rank other than 0 ending on an error says nothing and first waits, so that rank 0 prints the error and
    exits before it: torchrun stops every rank as soon as one fails, and would cut rank 0 off before its line."""
    if torchrun_rank():
        time.sleep(RANK_EXIT_WAIT_S)
    return status


def torchrun_rank():
    """This process's rank when torchrun started it (tensor parallel, tp.py), else None. Ranks other than 0
    print nothing: rank 0 speaks for all of them."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    return int(os.environ["RANK"])


def int_flag(low: int = 0, high: int = 2 ** 63 - 1) -> Callable:
    """An argparse type: an integer in ASCII digits between low and high."""
    def parse(text: str) -> int:
        if not re.fullmatch(r"[+-]?[0-9]{1,30}", text.strip()):
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if not low <= int(text) <= high:
            bounds = f"between {low} and {high}" if high < 2 ** 63 - 1 else \
                f"at least {low}" if int(text) < low else f"at most {high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {int(text)}")
        return int(text)
    return parse


def float_flag(low: float = 0.0, high: float = math.inf) -> Callable:
    """An argparse type: a finite number (ASCII) between low and high."""
    def parse(text: str) -> float:
        try:
            value = float(text) if text.isascii() else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value
    return parse


def utf8_text(text: str) -> str:
    """argv holds undecodable bytes as surrogates; refuse them here rather than deep in a tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not valid UTF-8 text")
    return text


def format_duration(seconds: float) -> str:
    """45s, 3m05s, 2h03m, 3d04h."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 48 * 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_rate(per_second: float) -> str:
    """Items per second, or seconds per item when that reads better (below one a second)."""
    if per_second >= 1:
        return f"{per_second:.3g}/s" if per_second < 1000 else f"{per_second:.0f}/s"
    return f"{1 / per_second:.3g} s each"


class Progress:
    """Progress of a long loop: `WHAT done/total UNIT (p%), RATE, elapsed E, ETA T[; detail]`.

    update(done) prints a line when one is worth it: when the work has advanced by every_fraction of the
    total since the last line, or when time has passed since it (every_s at first, then a twentieth of the
    time elapsed, at most max_every_s, so a day-long run writes hundreds of lines, not thousands), and
    always at the end (done == total, without the ETA). Written to a terminal, the line is redrawn in place
    instead (at most every redraw_s) and ends with a newline; written to a log (log= given, or stdout not a
    terminal) every line is a line. The rate counts this run's items only (start: those done before it,
    as a resumed training's steps). detail: text after the counts, or a function giving it, called only
    when a line is printed (a training step's means, which cost a device sync). clock: for tests.
    Used as a context manager, it ends a redrawn line the loop left open (an error or ^C), so that what is
    printed next starts on a line of its own."""

    def __init__(self, what: str, total: int, unit: str = "items", start: int = 0, log: Callable = None,
                 every_fraction: float = 0.05, every_s: float = 10.0, max_every_s: float = 120.0,
                 redraw_s: float = 0.5, clock: Callable = time.monotonic, stream=None):
        self.what, self.total, self.unit, self.start = what, max(total, 0), unit, start
        self.every_s, self.max_every_s, self.redraw_s = every_s, max_every_s, redraw_s
        self.every_items = max(1, round(every_fraction * self.total))
        self.clock, self.stream = clock, stream or sys.stdout
        self.log = None if log is print else log  # print is stdout, which may be a terminal
        self.live = self.log is None and getattr(self.stream, "isatty", lambda: False)()
        self.t0 = self.last_time = clock()
        self.last_done = start
        self.finished = self.open = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """End a line left open on a terminal."""
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False

    def line(self, done: int, detail: str = "", now: float = None) -> str:
        elapsed = (self.clock() if now is None else now) - self.t0
        percent = f" ({100 * done / self.total:.1f}%)" if self.total else ""
        parts = [f"{self.what} {done}/{self.total} {self.unit}{percent}"]
        rate = (done - self.start) / elapsed if elapsed > 0 and done > self.start else None
        parts.append(format_rate(rate) if rate else "rate not known yet")
        parts.append(f"elapsed {format_duration(elapsed)}")
        if done < self.total:
            parts.append(f"ETA {format_duration((self.total - done) / rate)}" if rate else "ETA not known yet")
        return ", ".join(parts) + (f"; {detail}" if detail else "")

    def due(self, done: int, now: float = None) -> bool:
        """Whether update(done) would print now."""
        now = self.clock() if now is None else now
        if done >= self.total:
            return not self.finished
        if self.live:
            return now - self.last_time >= self.redraw_s
        wait = min(max(self.every_s, (now - self.t0) / 20), self.max_every_s)
        return done - self.last_done >= self.every_items or now - self.last_time >= wait

    def update(self, done: int, detail: Union[str, Callable[[], str]] = "") -> Union[str, None]:
        """Print the line if it is due (see the class); returns it, or None."""
        now = self.clock()
        if not self.due(done, now):
            return None
        return self.show(done, detail, now)

    def show(self, done: int, detail: Union[str, Callable[[], str]] = "", now: float = None) -> str:
        """Print the line now, due or not."""
        now = self.clock() if now is None else now
        text = self.line(done, detail() if callable(detail) else detail, now)
        self.last_time, self.last_done, self.finished = now, done, done >= self.total
        if self.log is not None:
            self.log(text)
        elif self.live:  # \r and clear to the end of the line; the last line stays
            self.stream.write(f"\r{text}\x1b[K")
            self.open = True
            if self.finished:
                self.close()
        else:
            print(text, file=self.stream, flush=True)
        return text
