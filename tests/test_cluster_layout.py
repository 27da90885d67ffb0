"""How cluster/ and worker/ are laid out: short functions and modules, private names kept private, one job lifecycle.

Read from the source (ast), nothing imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("cluster", "worker")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500
# Where a job's summary is built and written: JobRun (cluster/run/jobrun.py), from the coordinator's parts.
LIFECYCLE_PARTS = ("build_summary", "merge_metrics", "EventLog")
LIFECYCLE_HOMES = ("cluster/run/jobrun.py", "cluster/run/coordinator.py")


def sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (root / folder).rglob("*.py"))


def module_file(root: Path, dotted: str) -> Path | None:
    """The file of a ``psgrid.*`` module in this tree (``psgrid.cluster.run.coordinator``), else None."""
    parts = dotted.split(".")
    if parts[0] != "psgrid" or len(parts) < 2:
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path, root: Path = ROOT) -> list[str]:
    """``from psgrid.x import _y`` and ``module._y`` (a psgrid module imported under any name) in ``path``."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()       # local names bound to psgrid modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if module_file(root, f"{node.module}.{alias.name}"):
                    modules.add(alias.asname or alias.name)
                elif private(alias.name) and module_file(root, node.module):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
            if module_file(root, node.module) and private(node.module.rpartition(".")[2]):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and module_file(root, alias.name):
                    modules.add(alias.asname)
                if private(alias.name.rpartition(".")[2]) and module_file(root, alias.name):
                    found.append(f"line {node.lineno}: import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and private(node.attr)):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def lifecycle_parts_used(path: Path) -> list[str]:
    """Names of the coordinator's summary and event-log parts that ``path`` uses."""
    tree = ast.parse(path.read_text())
    return sorted({node.attr if isinstance(node, ast.Attribute) else node.id for node in ast.walk(tree)
                   if (isinstance(node, ast.Attribute) and node.attr in LIFECYCLE_PARTS)
                   or (isinstance(node, ast.Name) and node.id in LIFECYCLE_PARTS)})


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", sources(), ids=rel)
def test_no_private_name_crosses_modules(path):
    assert private_uses(path) == [], f"{rel(path)} uses another module's private names: make them public there"


@pytest.mark.parametrize("path", sources(), ids=rel)
def test_functions_and_modules_stay_short(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{rel(path)}: {lines} lines; split it by concept"
    assert long_functions(path) == [], f"{rel(path)}: functions over {MAX_FUNCTION_LINES} lines"


@pytest.mark.parametrize("path", [p for p in sources() if rel(p) not in LIFECYCLE_HOMES], ids=rel)
def test_a_job_summary_is_built_and_written_by_jobrun_only(path):
    # launch, LocalCluster, psctl mpi and psctl allreduce run one lifecycle (cluster/run/jobrun.py).
    assert lifecycle_parts_used(path) == [], f"{rel(path)} builds a job's summary or event log itself: use JobRun"


def test_the_checks_see_what_they_look_for(tmp_path):
    # The checks above would pass on anything if they saw nothing: each finds its target in a made-up tree.
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "a.py").write_text("def _hidden():\n    pass\n")
    user = tmp_path / "cluster" / "b.py"
    user.write_text("from psgrid.cluster.a import _hidden\nfrom psgrid.cluster import a as co\nco._hidden()\n"
                    "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "co.build_summary()\n")
    assert len(private_uses(user, tmp_path)) == 2
    assert len(long_functions(user)) == 1
    assert lifecycle_parts_used(user) == ["build_summary"]
