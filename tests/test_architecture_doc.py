"""docs/architecture.md's module tree matches the source folders: every module of `model/`, `pipeline/` and
`stages/` is named in it, in its folder, and every module it names exists. Read from the file system each
time, so a module added, moved or removed without its line fails here. The import rules the page states
hold too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = ("model", "pipeline", "stages")
DOC = REPO / "docs" / "architecture.md"


def modules_on_disk() -> set[str]:
    """Every .py file under the source folders, but an `__init__.py` that holds only a docstring (a
    package's name, no code of its own)."""
    found = set()
    for folder in SOURCE:
        for path in (REPO / folder).rglob("*.py"):
            body = ast.parse(path.read_text(encoding="utf-8")).body
            if path.name == "__init__.py" and all(_is_docstring(node) for node in body):
                continue
            found.add(path.relative_to(REPO).as_posix())
    return found


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def modules_in_doc(text: str) -> set[str]:
    """The modules of the page's tree blocks: a fenced block whose first line is a source folder. A line
    whose first word ends in `/` opens a folder at its indentation; the `.py` names that start a line are
    modules of the folder above them (descriptions, and their continuation lines, follow the names)."""
    named = set()
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        lines = block.splitlines()
        if not lines or lines[0].rstrip("/") not in SOURCE:
            continue
        folders: list[tuple[int, str]] = []
        for line in lines:
            words = line.split()
            if not words:
                continue
            indent = len(line) - len(line.lstrip())
            while folders and folders[-1][0] >= indent:
                folders.pop()
            parent = "/".join(name for _, name in folders)
            if words[0].endswith("/") and re.fullmatch(r"[a-z_]+/", words[0]):
                folders.append((indent, words[0].rstrip("/")))
                continue
            for word in words:
                if not re.fullmatch(r"\w+\.py", word):
                    break
                named.add(f"{parent}/{word}")
    return named


def test_the_tree_parser_reads_folders_and_modules():
    tree = ["stages/", "  a.py  b.py    what they do, naming x.py", "  sub/  helpers", "    c.py  one", "  d.py"]
    text = "```\n" + "\n".join(tree) + "\n```\n"
    assert modules_in_doc(text) == {"stages/a.py", "stages/b.py", "stages/sub/c.py", "stages/d.py"}


def test_every_module_is_named_in_the_architecture_page():
    named, on_disk = modules_in_doc(DOC.read_text(encoding="utf-8")), modules_on_disk()
    assert len(on_disk) > 50
    assert not on_disk - named, f"modules missing from docs/architecture.md's tree: {sorted(on_disk - named)}"
    assert not named - on_disk, f"docs/architecture.md names modules that do not exist: {sorted(named - on_disk)}"


def imports(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_import_rules_the_page_states_hold():
    stage_modules = {f"cram.stages.{p.stem}" for p in (REPO / "stages").glob("*.py") if p.stem != "__init__"}
    broken = []
    for folder in SOURCE:
        for path in (REPO / folder).rglob("*.py"):
            where = path.relative_to(REPO).as_posix()
            found = imports(path)
            if folder == "model":
                broken += [(where, n) for n in found if n.startswith(("cram.stages", "cram.pipeline"))]
            if folder == "stages":
                broken += [(where, n) for n in found if n.startswith("cram.pipeline")]
                if path.parent == REPO / "stages" and path.stem != "__init__":
                    own = f"cram.stages.{path.stem}"
                    broken += [(where, n) for n in found & stage_modules if n != own]
            if folder == "pipeline" and "commands" not in path.parts:
                broken += [(where, n) for n in found if n.startswith("cram.pipeline.commands")]
    assert not broken, broken


def test_task_kinds_are_wings_side_by_side_and_the_orchestration_dispatches_through_the_registry():
    """The page's "Task kinds": a wing imports no other wing nor the orchestration above it; the bottom
    (stages/tasks/) imports no wing; and outside the wings no code asks a task entry which kind it is."""
    wings = {
        "finetuning": "cram.stages.finetuning",
        "retrieval": "cram.stages.retrieval",
        "tagging": "cram.stages.tagging",
    }
    above = ("cram.stages.evaluating", "cram.stages.evaluate", "cram.stages.baseline")
    broken = []
    for wing in wings:
        for path in (REPO / "stages" / wing).rglob("*.py"):
            others = tuple(module for name, module in wings.items() if name != wing) + above
            broken += [(path.name, n) for n in imports(path) if n.startswith(others)]
    for path in (REPO / "stages" / "tasks").rglob("*.py"):
        broken += [(path.name, n) for n in imports(path) if n.startswith(tuple(wings.values()) + above)]
    assert not broken, broken
    orchestration = [*(REPO / "stages" / "evaluating").rglob("*.py"), REPO / "stages" / "evaluate.py"]
    orchestration.append(REPO / "stages" / "baseline.py")
    # `found.kind`: a checkpoint's kind (stages/shared/pretrained.py), no task's
    asks = re.compile(r"(?<!found)\.kind\s*(==|!=|in\b|not in\b)|isinstance\([^)]*Loaded")
    found = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in orchestration
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if asks.search(line)
    ]
    assert not found, found
