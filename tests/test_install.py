"""The core install, as a user on a fresh machine gets it: ``pip install psgrid`` in a new venv.

Its size is what an HPC user puts on every node, and it trains the default job with no extra.
pip resolves the dependencies as it is configured here (its index, its cache), like a user's pip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_packaging import build_wheel

CORE_MB = 120  # psgrid and its dependencies; measured: 98 MB (numpy 73, grpcio 19, protobuf 3)
NOT_IN_CORE = ("matplotlib", "cryptography", "scipy", "pandas", "sklearn", "mlxtend", "mpi4py")
VENV_TOOLS = ("pip", "setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence.pth")  # any venv's


def du_mb(folder: Path, leave_out=()) -> float:
    """MB of the files under ``folder``, less its top-level entries (and their dist-info) named in ``leave_out``."""

    def left_out(top: str) -> bool:
        return top in leave_out or top.split("-")[0] in leave_out

    return (
        sum(
            p.stat().st_size
            for p in folder.rglob("*")
            if p.is_file() and not p.is_symlink() and not left_out(p.relative_to(folder).parts[0])
        )
        / 1e6
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_core_wheel_in_a_fresh_venv_is_small_and_trains_the_default_job(tmp_path):
    t0 = time.monotonic()
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=60)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    installed_s = time.monotonic() - t0
    [site] = (venv / "lib").glob("python3*/site-packages")
    size, whole = du_mb(site, VENV_TOOLS), du_mb(site)
    assert size < CORE_MB, f"the core install takes {size:.0f} MB (bound {CORE_MB} MB)"
    present = subprocess.run(
        [str(python), "-c", f"import importlib.util as u, sys; print([m for m in {NOT_IN_CORE!r} if u.find_spec(m)])"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert present.stdout.strip() == "[]", present.stdout + present.stderr

    # The default job, from a folder outside the checkout: only the installed psgrid can be imported.
    t1 = time.monotonic()
    run = subprocess.run(
        [str(venv / "bin" / "psctl"), "launch", "--config", "mnist", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["workers_completed"] == summary["workers"] == 2, summary
    assert summary["test_accuracy"] >= 0.9, summary  # the README's default job: about 0.93
    print(
        f"core install: {size:.0f} MB ({whole:.0f} MB with the venv's pip and setuptools) in {installed_s:.0f} s "
        f"(wheel, venv, pip); "
        f"default job {time.monotonic() - t1:.0f} s, test accuracy {summary['test_accuracy']:.3f}"
    )
