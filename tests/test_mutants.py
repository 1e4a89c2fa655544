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
        set(mutants.test_files_for("train_draft.py")[:4])  # test_train_*.py and test_draft*.py


def test_every_seeded_bug_is_found_once_in_the_code():
    for m in mutants.MUTANTS:
        assert (ROOT / m.path).read_text().count(m.old) == 1, (m.name, m.path)
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS), "two bugs share a name"


@pytest.mark.slow  # five pytest processes
def test_a_bug_the_fast_tier_misses_is_run_against_the_slow_tier(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: the slow tier\n")
    (project / "tests" / "test_calc.py").write_text(
        "import pytest\nfrom calc import add\n\n\ndef test_small():\n    assert add(1, 1) == 2\n\n\n"
        "@pytest.mark.slow\ndef test_large():\n    assert add(2, 3) == 5\n")
    monkeypatch.setattr(mutants, "ROOT", project)
    bugs = [mutants.Mutant("times", "calc.py", "a + b", "a * b"),  # add(1, 1) == 1: the fast tier fails
            mutants.Mutant("large only", "calc.py", "a + b", "a + b if a < 2 else 0"),  # only add(2, 3) is wrong
            mutants.Mutant("same sum", "calc.py", "a + b", "b + a")]  # no test can tell
    tiers = [("fast tier", ["-m", "not slow"], 120), ("slow tier", ["-m", "slow"], 120)]
    seen = []
    results = mutants.worker(["calc.py", "pytest.ini", "tests/test_calc.py"], bugs, tiers,
                             lambda m, caught_by, why, s: seen.append(m.name))
    assert [(m.name, caught_by) for m, caught_by, _, _ in results] == \
        [("times", "fast tier"), ("large only", "slow tier"), ("same sum", None)]
    assert [why for _, _, why, _ in results][:2] == ["tests/test_calc.py::test_small", "tests/test_calc.py::test_large"]
    assert seen == ["times", "large only", "same sum"]
    assert (project / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"  # the copies were changed, not it
