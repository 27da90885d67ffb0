"""Run the wire tests on the oldest grpcio, grpcio-health-checking and protobuf that pyproject.toml allows.

Usage: python scripts/check_oldest_deps.py [PYTEST ARGS...]

Makes a scratch virtual environment (removed afterwards), installs psgrid with those
three packages pinned at their lower bounds (the rest as pyproject.toml resolves them),
and runs, from this checkout, the tests that exercise the generated code and both
transports: tests/test_proto.py (but the regeneration diff, which needs the newest
grpcio-tools), tests/test_grpc_contract.py, tests/test_contract.py and
tests/test_tcp_contract.py. Exits with pytest's code. It needs the package index,
and takes about two minutes on two cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PINNED = ("grpcio", "grpcio-health-checking", "protobuf")
TESTS = [
    "tests/test_proto.py",
    "tests/test_grpc_contract.py",
    "tests/test_contract.py",
    "tests/test_tcp_contract.py",
    "-k",
    "not test_generated_code_matches_proto",
]
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.80"]


def lower_bounds(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``{"grpcio": "1.76.0", ...}``: the ``>=`` bound of each pinned package in ``[project] dependencies``."""
    found = {}
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", requirement)
        if m and m.group(1).lower() in PINNED:
            found[m.group(1).lower()] = m.group(2)
    missing = set(PINNED) - set(found)
    if missing:
        raise SystemExit(f"pyproject.toml gives no >= bound for {sorted(missing)}")
    return found


def main(pytest_args: list[str]) -> int:
    bounds = lower_bounds()
    print("oldest allowed: " + ", ".join(f"{k}=={v}" for k, v in bounds.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="psgrid-oldest-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = str(venv / "bin" / "python")
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("".join(f"{k}=={v}\n" for k, v in bounds.items()))
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "-c", str(constraints), "-e", str(ROOT), *TEST_TOOLS], check=True
        )
        versions = subprocess.run(
            [
                python,
                "-c",
                "import grpc, google.protobuf as p; print('grpcio', grpc.__version__, 'protobuf', p.__version__)",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        print("testing with " + versions.stdout.strip(), flush=True)
        # From the checkout, as the README's test command runs (editable: the tests import this tree).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return subprocess.run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *pytest_args], cwd=ROOT, env=env
        ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
