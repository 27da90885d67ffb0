"""The committed generated modules are exactly what scripts/gen_proto.py makes from proto/ps.proto."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(60)
def test_generated_code_matches_proto(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=50,
    )
    for name in ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py"):
        committed = (ROOT / "psserver" / "rpc" / name).read_text()
        assert (tmp_path / name).read_text() == committed, (
            f"psserver/rpc/{name} is stale: run `python scripts/gen_proto.py` and commit the result"
        )


def test_every_rpc_and_field_is_commented():
    lines = (ROOT / "proto" / "ps.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        is_field = (
            stripped
            and "=" in stripped
            and stripped.endswith(";")
            and not stripped.startswith(("//", "syntax", "option"))
        )
        if stripped.startswith("rpc ") or is_field:
            commented = "//" in line or lines[i - 1].strip().startswith("//")
            assert commented, f"proto/ps.proto:{i + 1} has no comment: {stripped}"


def test_generated_code_does_not_refuse_older_runtimes():
    # grpcio-tools writes checks that refuse any grpcio/protobuf older than itself; gen_proto.py cuts them out,
    # and pyproject.toml's lower bounds are what scripts/check_oldest_deps.py runs the wire tests on.
    for name in ("ps_pb2.py", "ps_pb2_grpc.py"):
        text = (ROOT / "psserver" / "rpc" / name).read_text()
        for check in (
            "ValidateProtobufRuntimeVersion",
            "runtime_version",
            "GRPC_GENERATED_VERSION",
            "first_version_is_lower",
        ):
            assert check not in text, f"psserver/rpc/{name} has {check}: regenerate with scripts/gen_proto.py"


def test_the_oldest_deps_script_reads_the_lower_bounds_of_pyproject():
    script = importlib.util.spec_from_file_location("check_oldest_deps", ROOT / "scripts" / "check_oldest_deps.py")
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    bounds = module.lower_bounds()
    assert set(bounds) == {"grpcio", "grpcio-health-checking", "protobuf"}
    # the health service's generated code needs a protobuf of its own release: the floors must move together
    assert bounds["grpcio"] == bounds["grpcio-health-checking"]


def test_the_proto_and_the_docs_name_every_reason_a_shard_sends():
    from psgrid.psserver.protocol import CLIENT_SIDE_REASONS, Reason

    for doc in ("proto/ps.proto", "docs/contract.md"):
        text = (ROOT / doc).read_text()
        missing = [r.wire_name for r in Reason if r not in CLIENT_SIDE_REASONS and f"`{r.wire_name}`" not in text]
        assert not missing, f"{doc} does not list the ps-reason names {missing}"
