"""Regenerate psserver/rpc/ (installed as psgrid.psserver.rpc) from proto/ps.proto (run from anywhere).

Usage: python scripts/gen_proto.py [OUT_DIR]

Generates from the repository root with the proto path set so that imports in
the generated modules are package-qualified (``from psgrid.psserver.rpc import ps_pb2``).
tests/test_proto.py regenerates into a temporary folder and diffs against the
committed files.

The generated modules would refuse every grpcio and protobuf runtime older than the
grpcio-tools that made them (``ValidateProtobufRuntimeVersion`` and a
``GRPC_GENERATED_VERSION`` check), though the code itself runs on releases of the
year before. Those two checks are cut out here, and pyproject.toml's lower bounds say
what the code really needs: scripts/check_oldest_deps.py installs exactly those
versions into a scratch environment and runs the proto and contract tests there.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

NOTE = (
    "# scripts/gen_proto.py removed the generator's runtime version check: this module runs on the\n"
    "# grpcio and protobuf releases that pyproject.toml allows (scripts/check_oldest_deps.py proves the oldest).\n"
)

# protobuf: the import of runtime_version (absent before protobuf 5.26) and the call that refuses older runtimes.
_PROTOBUF_CHECK = re.compile(
    r"from google\.protobuf import runtime_version as _runtime_version\n"
    r"|_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:    .*\n)*?\)\n"
)
# grpc: from GRPC_GENERATED_VERSION to the end of the `raise RuntimeError(...)` that refuses older grpcio.
_GRPC_CHECK = re.compile(r"GRPC_GENERATED_VERSION = .*?\n    \)\n", re.S)


def without_version_checks(name: str, text: str) -> str:
    """The generated module ``name`` with its runtime version check cut out (and a note saying so)."""
    if name == "ps_pb2.py":
        text, n = _PROTOBUF_CHECK.subn("", text)
        expected = 2
    elif name == "ps_pb2_grpc.py":
        text, n = _GRPC_CHECK.subn("", text.replace("import warnings\n", ""))
        expected = 1
    else:
        return text
    if n != expected:
        raise SystemExit(
            f"gen_proto.py: the version check of {name} has changed shape (found {n} of {expected} "
            "parts); update without_version_checks()"
        )
    first, _, rest = text.partition("\n")
    return f"{first}\n{NOTE}{rest}"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        # Lay the proto out as psgrid/psserver/rpc/ps.proto so the generated import path is qualified.
        staged = Path(tmp) / "psgrid" / "psserver" / "rpc"
        staged.mkdir(parents=True)
        shutil.copy(ROOT / "proto" / "ps.proto", staged / "ps.proto")
        gen = Path(tmp) / "gen"
        gen.mkdir()
        args = [
            "protoc",
            f"-I{tmp}",
            f"--python_out={gen}",
            f"--pyi_out={gen}",
            f"--grpc_python_out={gen}",
            "psgrid/psserver/rpc/ps.proto",
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py"):
            text = (gen / "psgrid" / "psserver" / "rpc" / name).read_text()
            (out_dir / name).write_text(without_version_checks(name, text))
            written.append(out_dir / name)
        return written


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Regenerate psserver/rpc/ from proto/ps.proto.")
    parser.add_argument(
        "out_dir", nargs="?", type=Path, default=ROOT / "psserver" / "rpc", help="where (default: psserver/rpc)"
    )
    for path in generate(parser.parse_args().out_dir):
        print(path)
