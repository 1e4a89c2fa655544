"""scripts/mutants.py: every seeded bug's text is in the code once, and a bug the fast tier misses goes on to the slow
tier (on a two-test project made here, so the real suite is not run)."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import mutants  # noqa: E402


def test_the_changed_files_tests_run_first_then_those_that_catch_most():
    files = mutants.test_files_for("tp.py")
    assert files[:5] == ["tests/test_tp.py", *mutants.CATCH_MOST] and len(files) == len(set(files))
    assert set(files) == {f"tests/{f.name}" for f in (ROOT / "tests").glob("test_*.py")} - {"tests/test_mutants.py"}
    assert {"tests/test_train_dflash.py", "tests/test_train_draft.py", "tests/test_train_eagle3.py"} <= \
        set(mutants.test_files_for("train_draft.py")[:5])  # test_train_*.py and test_draft*.py


def test_every_seeded_bug_is_found_once_in_the_code():
    for m in mutants.MUTANTS:
        assert (ROOT / m.path).read_text().count(m.old) == 1, (m.name, m.path)
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS), "two bugs share a name"


@pytest.mark.slow  # seven pytest processes
def test_a_bug_the_fast_tier_misses_is_run_against_the_slow_tier(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: the slow tier\n")
    (project / "tests" / "test_calc.py").write_text(
        "import pytest\nfrom calc import add\n\n\ndef test_small():\n    assert add(1, 1) == 2\n\n\n"
        "@pytest.mark.slow\ndef test_large():\n    assert add(2, 3) == 5\n")
    monkeypatch.setattr(mutants, "ROOT", project)
    monkeypatch.setattr(mutants, "repository_files", lambda: ["calc.py", "pytest.ini", "tests/test_calc.py"])
    monkeypatch.setattr(mutants, "MUTANTS", [
        mutants.Mutant("times", "calc.py", "a + b", "a * b"),  # add(1, 1) == 1: the fast tier fails
        mutants.Mutant("large only", "calc.py", "a + b", "a + b if a < 2 else 0"),  # only add(2, 3) is wrong
        mutants.Mutant("same sum", "calc.py", "a + b", "b + a")])  # no test can tell
    with pytest.raises(SystemExit, match="survived:\n  same sum"):
        mutants.main(["--jobs", "1", "--timeout", "120", "--slow_timeout", "120"])
    out = capsys.readouterr().out
    assert "baseline: the unchanged fast tier passes" in out and "baseline: the unchanged slow tier passes" in out
    assert "caught   times  [fast tier: tests/test_calc.py::test_small" in out
    assert "caught   large only  [slow tier: tests/test_calc.py::test_large" in out
    assert "SURVIVED same sum  [every tier" in out
    assert "2 of 3 seeded bugs caught, 1 of them only by the slow tier (fast tier then slow tier" in out
    assert (project / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"  # the copies were changed, not it
