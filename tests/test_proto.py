"""The committed generated modules are exactly what scripts/gen_proto.py makes from proto/ps.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(60)
def test_generated_code_matches_proto(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)], check=True,
                   capture_output=True, timeout=50)
    for name in ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py"):
        committed = (ROOT / "psserver" / "rpc" / name).read_text()
        assert (tmp_path / name).read_text() == committed, (
            f"psserver/rpc/{name} is stale: run `python scripts/gen_proto.py` and commit the result")


def test_every_rpc_and_field_is_commented():
    lines = (ROOT / "proto" / "ps.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        is_field = stripped and "=" in stripped and stripped.endswith(";") and not stripped.startswith(
            ("//", "syntax", "option"))
        if stripped.startswith("rpc ") or is_field:
            commented = "//" in line or lines[i - 1].strip().startswith("//")
            assert commented, f"proto/ps.proto:{i + 1} has no comment: {stripped}"
