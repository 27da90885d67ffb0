"""Regenerate psserver/rpc/ (installed as psgrid.psserver.rpc) from proto/ps.proto (run from anywhere).

Usage: python scripts/gen_proto.py [OUT_DIR]

Generates from the repository root with the proto path set so that imports in
the generated modules are package-qualified (``from psgrid.psserver.rpc import ps_pb2``).
tests/test_proto.py regenerates into a temporary folder and diffs against the
committed files.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        # Lay the proto out as psgrid/psserver/rpc/ps.proto so the generated import path is qualified.
        staged = Path(tmp) / "psgrid" / "psserver" / "rpc"
        staged.mkdir(parents=True)
        shutil.copy(ROOT / "proto" / "ps.proto", staged / "ps.proto")
        gen = Path(tmp) / "gen"
        gen.mkdir()
        args = ["protoc", f"-I{tmp}", f"--python_out={gen}", f"--pyi_out={gen}", f"--grpc_python_out={gen}",
                "psgrid/psserver/rpc/ps.proto"]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py"):
            shutil.copy(gen / "psgrid" / "psserver" / "rpc" / name, out_dir / name)
            written.append(out_dir / name)
        return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "psserver" / "rpc"
    for path in generate(target):
        print(path)
