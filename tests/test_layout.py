"""The house: the file table (docs/files.md) lists every file and says truly what each imports, and imports go one
way (no circle); the server's files (server/) are named as they are imported, server.engine. Nothing here counts
lines: a fork that adds one breaks no test."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("*.py")) + sorted((ROOT / "scripts").glob("*.py")) + sorted(
    p for p in (ROOT / "server").glob("*.py") if p.stem != "__init__")
PACKAGES = {"server"}


def module_name(path: Path) -> str:
    """A file as it is imported: its stem, or package.stem for a file in a package folder."""
    folder = path.relative_to(ROOT).parts[0]
    return f"{folder}.{path.stem}" if folder in PACKAGES else path.stem


OURS = {module_name(p) for p in SOURCES}


def eaglet_imports(path: Path) -> tuple:
    """(eaglet modules imported at the top level, those imported only inside a function) of one file. Top level:
    at column 0 (no file imports under a module-level if or try)."""
    top, inside = set(), set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [imported(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [imported(node.module)]
        else:
            continue
        (top if node.col_offset == 0 else inside).update(n for n in names if n in OURS and n != module_name(path))
    return top, inside - top


def imported(module: str) -> str:
    """The file a module name reads: server.engine for server.engine.X, the first part otherwise."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in PACKAGES else parts[0]


def readme_table() -> dict:
    """file -> (imports at the top, imports inside a function) as docs/files.md's table gives them."""
    table = {}
    for line in (ROOT / "docs" / "files.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `([\w/]+)\.py` \| .* \| ([^|]*) \|$", line)
        if not m:
            continue
        column = m.group(2).strip()
        inside = re.search(r"\(inside a function: ([^)]*)\)", column)
        top = re.sub(r"\(inside a function: [^)]*\)", "", column).strip()
        name = m.group(1)
        table[name.replace("/", ".") if name.split("/")[0] in PACKAGES else name.split("/")[-1]] = (module_names(top), module_names(inside.group(1)) if inside else set())
    return table


def module_names(text: str) -> set:
    return {n.strip() for n in text.split(",") if n.strip()} - {"none", "torch only", "the standard library only"}


def test_readme_file_table_lists_every_file_and_its_imports():
    table = readme_table()
    assert set(table) == OURS - {"__init__"}, "files missing from (or extra in) docs/files.md's table"
    wrong = {}
    for path in SOURCES:
        actual = tuple(sorted(s) for s in eaglet_imports(path))
        said = tuple(sorted(s) for s in table[module_name(path)])
        if actual != said:
            wrong[path.name] = dict(actual=actual, readme=said)
    assert not wrong, wrong


def test_top_level_imports_have_no_circle():
    graph = {module_name(p): eaglet_imports(p)[0] for p in SOURCES}
    done, on_path = set(), []

    def visit(name):
        assert name not in on_path, "import circle: " + " -> ".join(on_path[on_path.index(name):] + [name])
        if name in done:
            return
        on_path.append(name)
        for dep in graph.get(name, ()):
            visit(dep)
        on_path.pop()
        done.add(name)

    for name in graph:
        visit(name)


def test_the_model_imports_only_attention_and_checkpoint():
    """model.py stands on attention.py and checkpoint.py alone: a fork reading the LLaMA reads only those."""
    assert eaglet_imports(ROOT / "model.py") == ({"attention", "checkpoint"}, {"quantize"})
    assert eaglet_imports(ROOT / "checkpoint.py") == (set(), set())
