"""The README and docs/ as a reader uses them: every command they show parses with the tool's own flags (a
renamed or removed flag fails here, not in a reader's terminal), and every link to a file in the repository
leads to one."""
import argparse
import re
import runpy
import shlex
import sys

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown_commands(text: str):
    """`python TOOL ...` and `torchrun ... TOOL ...` lines of the bash blocks (continuations joined, comments cut)
    and of inline code."""
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith(("python ", "torchrun ")):
                yield line
    yield from re.findall(r"`((?:python|torchrun) [^`]+)`", text)


COMMANDS = sorted({(page.relative_to(ROOT).as_posix(), cmd) for page in PAGES
                   for cmd in shown_commands(page.read_text()) if ".py" in cmd})


class Parsed(Exception):
    pass


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_shown_command_parses(page, command, monkeypatch, capsys):
    words = shlex.split(command)
    tool = next(w for w in words if w.endswith(".py"))
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed  # the flags are known and well-typed: the tool's work is not what this test runs

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [tool] + words[words.index(tool) + 1:])
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.chdir(ROOT)
    try:
        runpy.run_path(str(ROOT / tool), run_name="__main__")
    except Parsed:
        return
    except SystemExit as e:
        assert e.code == 0 and "--help" in words, f"{page}: {command}\n{capsys.readouterr().err.strip()[-400:]}"
        return
    pytest.fail(f"{page}: {command} ran without parsing its flags")


def test_links_lead_to_files():
    broken = [f"{page.name}: {target}" for page in PAGES
              for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert not broken, broken
