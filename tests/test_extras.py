"""Without an extra, a command does everything else and says in one line what to install.

Each test runs psctl in a child whose ``sys.modules`` marks the extra's package absent (``None``),
as on a core install (``pip install psgrid``); tests/test_install.py runs the real core install.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import MPI_ENV, ROOT

TINY = ["--config", "mnist", "--steps", "20", "--eval-every", "10", "--batch-size", "32", "--shards", "1"]


def psctl_without(package: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``psctl ARGS`` in a child where importing ``package`` fails as it does when it is not installed."""
    code = f"import sys; sys.modules[{package!r}] = None\nfrom psgrid.cluster.cli import main\nsys.exit(main())"
    env = dict(os.environ, **MPI_ENV)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.mark.slow
def test_compare_without_matplotlib_writes_the_report_without_plots(tmp_path):
    out = tmp_path / "cmp"
    done = psctl_without(
        "matplotlib", "compare", *TINY, "--workers", "1", "--modes", "sync", "--out", str(out), "--no-progress"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "plots" in line or "matplotlib" in line]
    assert lines == ["psctl compare: plots skipped: pip install 'psgrid[plots]'"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "pip install 'psgrid[plots]'" in md and "sync" in md and "sync" in html
    assert (out / "summary.csv").exists() and not list(out.glob("plots/*.png"))
    assert "data:image/png" not in html


def test_certs_without_cryptography_names_the_extra_and_exits_2(tmp_path):
    done = psctl_without("cryptography", "certs", str(tmp_path / "pki"), timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "psctl certs: error: making certificates needs the cryptography package: pip install 'psgrid[tls]'"
    ]
    assert not (tmp_path / "pki").exists()  # nothing half-made


def test_a_shard_and_a_worker_need_no_extra():
    # What a node of a core install runs: the server, the worker and the launcher load without any extra.
    code = (
        "import sys\n"
        "for name in ('matplotlib', 'cryptography', 'mpi4py', 'scipy', 'pandas', 'sklearn', 'mlxtend'):\n"
        "    sys.modules[name] = None\n"
        "import psgrid, psgrid.psserver.service, psgrid.worker.loop, psgrid.cluster.run.launch\n"
        "from psgrid.cluster.cli import build_parser\n"
        "build_parser(None)\n"
        "from psgrid.worker.data import load_dataset\n"
        "print(len(load_dataset('mnist5k').train_y))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "4000"


@pytest.mark.parametrize("command", ["mpi", "allreduce"])
def test_mpi_commands_without_mpi4py_name_the_extra_and_exit_2(command):
    done = psctl_without("mpi4py", command, "--config", "mnist", timeout=60)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"psctl {command}: error: psctl {command} needs mpi4py: pip install 'psgrid[mpi]'")
