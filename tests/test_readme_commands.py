"""The README's real-model commands run verbatim, as a reader types them, and answer what the README says they
answer (tests/test_docs.py only parses every command's flags: a command that parses, then fails or answers
otherwise, passes there). Slow tier: each runs a whole tool."""
import re
import subprocess
import sys

import pytest

from conftest import HANG_S, ROOT, smollm2_gguf

README = (ROOT / "README.md").read_text()


def section(heading: str) -> str:
    """The README's text from this heading to the next one."""
    start = README.index(heading)
    return README[start:README.index("\n#", start + len(heading))]


def bash_block(text: str) -> list:
    """The commands of the first bash block in text (comments cut)."""
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.split(" #")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def run(command: str, cwd) -> str:
    """command as typed (`python TOOL.py ...`), run in cwd with this interpreter and the repository's tool."""
    assert command.startswith("python "), command
    tool, _, rest = command.removeprefix("python ").partition(" ")
    done = subprocess.run(f"{sys.executable} {ROOT / tool} {rest}", shell=True, cwd=cwd, capture_output=True,
                          text=True, timeout=HANG_S)
    assert done.returncode == 0, f"{command}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
    return done.stdout


@pytest.mark.slow
def test_readme_gguf_quickstart_answers_as_quoted(tmp_path):
    """Convert the package's SmolLM2 file, then generate from the folder with the README's own flags: the quoted
    answer, and nothing after it."""
    commands = bash_block(section("### A GGUF file"))
    assert len(commands) == 2 and "SmolLM2-135M-Instruct.Q4_1.gguf" in commands[0]
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(smollm2_gguf())
    run(commands[0], tmp_path)
    answer = re.search(r'it answers "(.*?)"', " ".join(section("### A GGUF file").split())).group(1)
    printed = run(commands[1], tmp_path)
    assert f"What is the capital of France?\n{answer}\n" in printed, printed[-800:]


@pytest.mark.slow
def test_readme_demo_command_completes_its_prompt():
    """`python generate.py` (the README's first command after the install) completes `def read_lines(path):` for 60
    tokens with demo/head, as the demo section says, and reports tau."""
    command = bash_block(README)[1]
    assert command == "python generate.py"
    said = re.search(r"`python generate\.py` completes `(.*?)` for (\d+) tokens", " ".join(section("## The demo").split()))
    printed = run(command, ROOT)
    assert said.group(1) in printed and f"{said.group(2)} tokens in " in printed and "tau " in printed, printed[-800:]
