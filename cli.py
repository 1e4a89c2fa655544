"""The tools' command lines, in the standard library only: each tool parses its flags before it imports
torch (seconds), so --help and usage mistakes answer at once."""
import argparse
import math
import re
import sys
from typing import Callable

PRECISION_NAMES = ("bf16", "fp16", "fp32")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every flag's default after its help line."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.default in (None, False, argparse.SUPPRESS):
            return action.help
        return f"{action.help or ''} (default: {action.default})"


def cli_parser(doc: str) -> argparse.ArgumentParser:
    """The tools' argument parser: --help shows every default; a usage mistake ends with one line,
    'error: ...', and exit status 1, like every other mistake."""
    p = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)
    p.error = lambda message: sys.exit(f"error: {message}")
    return p


def int_flag(low: int = 0, high: int = 2 ** 63 - 1) -> Callable:
    """An argparse type: an integer in ASCII digits between low and high."""
    def parse(text: str) -> int:
        if not re.fullmatch(r"[+-]?[0-9]{1,30}", text.strip()):
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {int(text)}")
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
