"""The layers' import rules, checked on the source: who may import gRPC, and nothing imports upward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Only the transports speak gRPC (and the generated code, which is gRPC).
GRPC_ALLOWED = {"psserver/transports/grpc_server.py", "psserver/transports/grpc_health.py",
                "psserver/transports/grpc_client.py",
                "psserver/rpc/ps_pb2_grpc.py", "psserver/rpc/ps_pb2.py"}
# Modules the client side uses (the whole client/ folder): none of them may import the server side.
CLIENT_SIDE = [*sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "psserver/client").rglob("*.py")),
               "psserver/transports/base.py", "psserver/transports/grpc_client.py",
               "psserver/transports/tcp_client.py", "psserver/transports/shm_client.py",
               "psserver/transports/stream_client.py", "psserver/transports/stream_frames.py"]
SERVER_SIDE = {"psgrid.psserver.state.shard", "psgrid.psserver.service", "psgrid.psserver.server",
               "psgrid.psserver.transports.grpc_server", "psgrid.psserver.transports.grpc_health",
               "psgrid.psserver.transports.tcp_server",
               "psgrid.psserver.transports.shm_server", "psgrid.psserver.transports.stream_server",
               "psgrid.psserver.transports.stream_admission",
               "psgrid.psserver.state.weight_ring",
               "psgrid.psserver.state.checkpoint", "psgrid.psserver.kernels.optim", "psgrid.psserver.state.policy",
               "psgrid.psserver.state.membership", "psgrid.psserver.metrics"}


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports in functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", sources("psserver", "worker", "cluster", "psgrid"), ids=rel)
def test_only_the_transports_import_grpc(path):
    grpc = {m for m in imports(path) if m == "grpc" or m.startswith(("grpc.", "google.protobuf"))
            or m.endswith(".rpc") or ".rpc." in m}
    if rel(path) not in GRPC_ALLOWED:
        assert not grpc, f"{rel(path)} imports {sorted(grpc)}: only the transport modules may speak gRPC"


@pytest.mark.parametrize("path", CLIENT_SIDE)
def test_the_client_imports_nothing_of_the_server(path):
    server = imports(ROOT / path) & SERVER_SIDE
    assert not server, f"{path} imports {sorted(server)}"


@pytest.mark.parametrize("path", sources("psserver/client"), ids=rel)
def test_the_client_folder_imports_nothing_of_shard_state_the_service_or_the_server(path):
    shard = {m for m in imports(path) if m.startswith("psgrid.psserver.state")
             or m in ("psgrid.psserver.service", "psgrid.psserver.server")}
    assert not shard, f"{rel(path)} imports {sorted(shard)}: the client talks to shards only through transports"


@pytest.mark.parametrize("path", sources("psserver"), ids=rel)
def test_the_shard_side_knows_nothing_of_workers_or_jobs(path):
    upward = {m for m in imports(path) if m.startswith(("psgrid.worker", "psgrid.cluster"))}
    assert not upward, f"{rel(path)} imports {sorted(upward)}: psserver knows nothing of models, GPUs or jobs"


@pytest.mark.parametrize("path", sources("worker"), ids=rel)
def test_workers_never_import_the_cluster_tools(path):
    upward = {m for m in imports(path) if m.startswith("psgrid.cluster")}
    assert not upward, f"{rel(path)} imports {sorted(upward)}"


def test_psctl_server_does_not_import_the_worker_package():
    import subprocess
    import sys

    # What `psctl server --config mnist` runs before it serves: the parser, the job file, the server.
    code = ("import sys\n"
            "from psgrid.cluster.cli import build_parser\n"
            "from psgrid.cluster.commands.server import server_config_from_args\n"
            "import psgrid.psserver.server\n"
            "args = build_parser('server').parse_args(['server', '--config', 'mnist', '--shard', '1'])\n"
            "config = server_config_from_args(args)\n"
            "assert (config.num_shards, config.mode) == (2, 'sync'), config\n"
            "print(sorted(m for m in sys.modules if m.startswith('psgrid.worker')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"psctl server loads the worker package: {out.stdout}"


def test_no_import_circle_in_psserver():
    """No psserver module reaches itself through imports, lazy ones included (base.open_control and
    grpc_client were one: the registry every plane imports must import no plane)."""
    def name(path: Path) -> str:
        parts = path.relative_to(ROOT).with_suffix("").parts
        return "psgrid." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in sources("psserver")}
    graph = {}
    for module, path in modules.items():
        found = imports(path)
        found |= {f"{m}.{a.name}" for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
                  and node.module and not node.level for m in [node.module] for a in node.names}
        graph[module] = {m for m in found if m in modules and m != module}

    def reaches(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for nxt in graph[module]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [circle for module in sorted(graph) if (circle := reaches(module))]
    assert not circles, f"import circle: {' -> '.join(circles[0])}"


@pytest.mark.parametrize("path", sources("psserver/client"), ids=rel)
def test_the_client_folder_is_split_by_concept(path):
    """A module under 500 lines, a function under 80: split long before a scheduler.py."""
    tree = ast.parse(path.read_text())
    assert len(path.read_text().splitlines()) < 500, f"{rel(path)} is over 500 lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1})" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert not long, f"{rel(path)}: functions over 80 lines: {long}"
