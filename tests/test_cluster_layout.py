"""One job lifecycle: only JobRun (and the coordinator parts it uses) builds a job's summary or event log.

Read from the source (ast), nothing imported or run. The package-wide layout rules (private names, sizes,
folders) are tests/test_layers.py's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("cluster", "worker")
# Where a job's summary is built and written: JobRun (cluster/run/jobrun.py), from the coordinator's parts.
LIFECYCLE_PARTS = ("build_summary", "merge_metrics", "EventLog")
LIFECYCLE_HOMES = ("cluster/run/jobrun.py", "cluster/run/coordinator.py")


def sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (root / folder).rglob("*.py"))


def lifecycle_parts_used(path: Path) -> list[str]:
    """Names of the coordinator's summary and event-log parts that ``path`` uses."""
    tree = ast.parse(path.read_text())
    return sorted(
        {
            node.attr if isinstance(node, ast.Attribute) else node.id
            for node in ast.walk(tree)
            if (isinstance(node, ast.Attribute) and node.attr in LIFECYCLE_PARTS)
            or (isinstance(node, ast.Name) and node.id in LIFECYCLE_PARTS)
        }
    )


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", [p for p in sources() if rel(p) not in LIFECYCLE_HOMES], ids=rel)
def test_a_job_summary_is_built_and_written_by_jobrun_only(path):
    # launch, LocalCluster, psctl mpi, psctl allreduce and emulated hosts run one lifecycle (cluster/run/jobrun.py).
    assert lifecycle_parts_used(path) == [], f"{rel(path)} builds a job's summary or event log itself: use JobRun"


def lifecycle_ends_written(path: Path) -> list[str]:
    """Where ``path`` ends a job itself: ``X.ended_by(...)``, or ``X.end(...)`` with a summary's fields."""
    tree = ast.parse(path.read_text())
    return [
        f"line {node.lineno}: {ast.unparse(node)[:60]}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and (node.func.attr == "ended_by" or (node.func.attr == "end" and node.keywords))
    ]


@pytest.mark.parametrize("path", [p for p in sources() if rel(p) != "cluster/run/jobrun.py"], ids=rel)
def test_a_job_is_ended_by_jobrun_run_only(path):
    # How a job ends (its status from the exception, children stopped, summary written, folder released) is
    # JobRun.run's, written once; a backend says what to stop and what to report.
    assert lifecycle_ends_written(path) == [], f"{rel(path)} ends a job itself: be a Backend of JobRun.run"


def test_the_end_check_sees_a_lifecycle_written_again(tmp_path):
    probe = tmp_path / "launch.py"
    probe.write_text(
        "try:\n    pass\nexcept Exception as e:\n    jobrun.ended_by(e)\nfinally:\n"
        "    jobrun.end(addresses=[], worker_exits={})\nm.end()\n"
    )
    assert sorted(w.split(":")[0] for w in lifecycle_ends_written(probe)) == ["line 4", "line 6"]


def test_the_check_sees_what_it_looks_for(tmp_path):
    # The rule above would pass on anything if it saw nothing: it finds its target in a made-up module.
    user = tmp_path / "b.py"
    user.write_text("from psgrid.cluster.run import coordinator as co\nco.build_summary()\n")
    assert lifecycle_parts_used(user) == ["build_summary"]


# cluster/job/ is the job's files (config, credentials, output folder, records): what runs a job uses it.
JOB_FILES_FOLDER = "cluster/job"
ABOVE_JOB_FILES = (
    "psgrid.cluster.run",
    "psgrid.cluster.mpi",
    "psgrid.cluster.hosts",
    "psgrid.cluster.experiments",
    "psgrid.cluster.bench",
    "psgrid.cluster.commands",
)


def imports_above_job_files(path: Path) -> list[str]:
    """The modules of the folders that run jobs which ``path`` imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module
            else []
        )
        found |= {n for n in names if n.startswith(ABOVE_JOB_FILES)}
    return sorted(found)


@pytest.mark.parametrize("path", sorted((ROOT / JOB_FILES_FOLDER).rglob("*.py")), ids=rel)
def test_job_files_import_nothing_of_what_runs_a_job(path):
    assert imports_above_job_files(path) == [], f"{rel(path)} imports upward: pass what it needs in instead"


def test_the_upward_import_check_sees_a_lazy_import(tmp_path):
    probe = tmp_path / "outdir.py"
    probe.write_text("def prepare():\n    from psgrid.cluster.run.resume import archive_attempt\n")
    assert imports_above_job_files(probe) == ["psgrid.cluster.run.resume"]
