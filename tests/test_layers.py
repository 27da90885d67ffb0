"""The layers' rules, checked on the source: who may import what, no private name crossing modules,
and the size of functions and modules.

The folders are the architecture (docs/architecture.md): ``psserver/client/`` is the client and knows
nothing of a shard's state or service; ``worker/`` uses psserver through the client and the update
maths only; ``cluster/experiments/`` uses ``cluster/run/`` and ``cluster/mpi/`` through public names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ("psserver", "worker", "cluster", "psgrid")
GENERATED = "psserver/rpc/"
# In lines as `ruff format` writes them (.ci/run checks it): it gives each argument of a long call a line
# of its own, so the same code runs about 1.2x the hand-wrapped lines these were first set for (80 and 500).
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 600

# Only the transports speak gRPC (and the generated code, which is gRPC).
GRPC_ALLOWED = {
    "psserver/transports/grpc_server.py",
    "psserver/transports/grpc_health.py",
    "psserver/transports/grpc_client.py",
    "psserver/rpc/ps_pb2_grpc.py",
    "psserver/rpc/ps_pb2.py",
}

# What the client side (psserver/client/, each plane's client end transports/*_client.py, and
# transports/base.py) may not import: a shard's state, its update maths, its one data path, its
# listeners and its metrics.
SHARD_SIDE = (
    "psgrid.psserver.state",
    "psgrid.psserver.kernels",
    "psgrid.psserver.service",
    "psgrid.psserver.server",
    "psgrid.psserver.metrics",
    "psgrid.psserver.transports.grpc_health",
)

# What worker/ may import of psserver: the client, the update maths, the model's layout and the errors,
# and the few shared modules below, each for a reason.
WORKER_MAY_USE = (
    "psgrid.psserver.client",
    "psgrid.psserver.kernels",
    "psgrid.psserver.spec",
    "psgrid.psserver.exceptions",
    "psgrid.psserver.protocol",  # the vocabulary both ends speak: Outcome, PushResult, planes, sizes
    "psgrid.psserver.dtypes",  # the all-reduce baseline rounds its gradients as a push's dtype does
    "psgrid.psserver.config",  # ... and applies a shard's optimizer with a shard's settings
    "psgrid.psserver.settings",  # the [train] keys are declared in the one schema of every setting
    "psgrid.psserver.security",  # the job's token, which a worker reads and hands to its client
    "psgrid.psserver.files",  # metrics files created owner-only, as every file psgrid writes
    "psgrid.psserver.lifeline",  # a script stops when its launcher is gone, as psctl's children do
    "psgrid.psserver.shared_memory",  # a host's aggregation shares sealed memfds as the shm plane does,
    "psgrid.psserver.transports.unix_peers",  # ... over the same abstract socket, peer check and fd passing
)


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def module_name(path: Path) -> str:
    """The name ``path`` is imported by: ``psserver/client/admin.py`` is ``psgrid.psserver.client.admin``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] != "psgrid":
        parts.insert(0, "psgrid")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PACKAGE_SOURCES = [p for p in sources(*PACKAGE) if not rel(p).startswith(GENERATED)]
MODULES = {module_name(p) for p in sources(*PACKAGE)}


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports in functions included);
    ``from package import module`` counts as an import of that module."""
    found = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names} & MODULES
    return found


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names_of_other_modules(path: Path) -> list[str]:
    """``from m import _x`` and ``m._x`` in ``path``, for every psgrid module ``m`` (another one by definition)."""
    code = tree(path)
    bound = {}  # local name -> the psgrid module it is
    found = []
    for node in ast.walk(code):
        if isinstance(node, ast.Import):
            bound |= {alias.asname or alias.name: alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES:
            found += [f"from {node.module} import {a.name}" for a in node.names if private(a.name)]
            bound |= {
                a.asname or a.name: f"{node.module}.{a.name}"
                for a in node.names
                if f"{node.module}.{a.name}" in MODULES
            }
    for node in ast.walk(code):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = ast.unparse(node.value)
            if bound.get(owner, owner) in MODULES:
                found.append(f"{bound.get(owner, owner)}.{node.attr} (line {node.lineno})")
    return found


# ----- who may import what ------------------------------------------------------------------------


@pytest.mark.parametrize("path", sources("psserver", "worker", "cluster", "psgrid"), ids=rel)
def test_only_the_transports_import_grpc(path):
    grpc = {
        m
        for m in imports(path)
        if m == "grpc" or m.startswith(("grpc.", "google.protobuf")) or m.endswith(".rpc") or ".rpc." in m
    }
    if rel(path) not in GRPC_ALLOWED:
        assert not grpc, f"{rel(path)} imports {sorted(grpc)}: only the transport modules may speak gRPC"


# The client folder, each plane's client end, and the registry the client finds the planes in.
CLIENT_SIDE = (
    sources("psserver/client")
    + sorted((ROOT / "psserver" / "transports").glob("*_client.py"))
    + [ROOT / "psserver" / "transports" / "base.py"]
)


@pytest.mark.parametrize("path", CLIENT_SIDE, ids=rel)
def test_the_client_imports_nothing_of_the_shard_side(path):
    shard_side = {
        m
        for m in imports(path)
        if within(m, SHARD_SIDE) or (m.startswith("psgrid.psserver.transports.") and m.endswith("_server"))
    }
    assert not shard_side, f"{rel(path)} imports {sorted(shard_side)}: the client knows nothing of a shard's insides"


def test_the_client_side_rule_sees_the_client_folder():
    # The rule above checks what it says: the folder holds the client, and each plane's client end is in it.
    names = {rel(p) for p in CLIENT_SIDE}
    assert {
        "psserver/client/client.py",
        "psserver/transports/tcp_client.py",
        "psserver/transports/shm_client.py",
        "psserver/transports/grpc_client.py",
    } <= names


@pytest.mark.parametrize("path", sources("psserver"), ids=rel)
def test_the_shard_side_knows_nothing_of_workers_or_jobs(path):
    upward = {m for m in imports(path) if m.startswith(("psgrid.worker", "psgrid.cluster"))}
    assert not upward, f"{rel(path)} imports {sorted(upward)}: psserver knows nothing of models, GPUs or jobs"


# What a shard's state and its update maths stand below: the data path, the planes, the client.
ABOVE_THE_STATE = (
    "psgrid.psserver.transports",
    "psgrid.psserver.client",
    "psgrid.psserver.service",
    "psgrid.psserver.server",
    "psgrid.psserver.intake",
    "psgrid.psserver.metrics",
)


@pytest.mark.parametrize("path", sources("psserver/state", "psserver/kernels"), ids=rel)
def test_a_shards_state_and_update_maths_import_nothing_above_them(path):
    upward = {m for m in imports(path) if within(m, ABOVE_THE_STATE)}
    assert not upward, f"{rel(path)} imports {sorted(upward)}: state/ and kernels/ sit below the data path"


@pytest.mark.parametrize("path", sources("worker"), ids=rel)
def test_workers_never_import_the_cluster_tools(path):
    upward = {m for m in imports(path) if m.startswith("psgrid.cluster")}
    assert not upward, f"{rel(path)} imports {sorted(upward)}"


@pytest.mark.parametrize("path", sources("worker"), ids=rel)
def test_workers_use_psserver_through_the_client_and_the_update_maths(path):
    psserver = {m for m in imports(path) if within(m, ("psgrid.psserver",)) and m != "psgrid.psserver"}
    beyond = {m for m in psserver if not within(m, WORKER_MAY_USE)}
    assert not beyond, f"{rel(path)} imports {sorted(beyond)}: a worker uses psserver through its client"


@pytest.mark.parametrize("path", PACKAGE_SOURCES, ids=rel)
def test_nothing_puts_a_source_root_on_a_path(path):
    # A checkout is used through an editable install: a root on the path made worker, cluster and tests
    # top-level names again in children, and let the tests import a tree CI never installs.
    tricks = [
        node
        for node in ast.walk(tree(path))
        if isinstance(node, ast.Name)
        and node.id == "__path__"
        or isinstance(node, ast.Attribute)
        and ast.unparse(node) in ("sys.path.insert", "sys.path.append")
    ]
    assert not tricks, f"{rel(path)} extends an import path (line {tricks[0].lineno}): install the checkout instead"


# ----- private names stay in their module ---------------------------------------------------------


@pytest.mark.parametrize("path", PACKAGE_SOURCES, ids=rel)
def test_no_private_name_is_used_across_modules(path):
    crossing = private_names_of_other_modules(path)
    assert not crossing, f"{rel(path)} uses private names of other modules: {crossing}"


@pytest.mark.parametrize("path", sources("cluster/experiments"), ids=rel)
def test_experiments_use_run_and_mpi_through_public_names(path):
    reached = [
        name
        for name in private_names_of_other_modules(path)
        if name.removeprefix("from ").startswith(("psgrid.cluster.run", "psgrid.cluster.mpi"))
    ]
    # ... nor any object's private attribute (a Launcher's, a job's): only their own, through self or cls
    # (and the standard library's few, such as os._exit)
    own = {"self", "cls"} | {
        alias.asname or alias.name
        for node in ast.walk(tree(path))
        if isinstance(node, ast.Import)
        for alias in node.names
        if not alias.name.startswith("psgrid")
    }
    reached += [
        f"{ast.unparse(node)} (line {node.lineno})"
        for node in ast.walk(tree(path))
        if isinstance(node, ast.Attribute)
        and private(node.attr)
        and not (isinstance(node.value, ast.Name) and node.value.id in own)
    ]
    assert not reached, f"{rel(path)} reaches into cluster/run or cluster/mpi: {reached}"


def test_the_private_name_rule_finds_both_forms(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from psgrid.cluster.run.coordinator import _finite\n"
        "from psgrid.cluster.run import procs as p\n"
        "import psgrid.cluster.run.coordinator\n"
        "p._hidden, psgrid.cluster.run.coordinator._other, p.__name__, p.child_env\n"
    )
    found = private_names_of_other_modules(probe)
    assert found == [
        "from psgrid.cluster.run.coordinator import _finite",
        "psgrid.cluster.run.procs._hidden (line 4)",
        "psgrid.cluster.run.coordinator._other (line 4)",
    ]


# ----- sizes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PACKAGE_SOURCES, ids=rel)
def test_no_function_is_over_100_lines(path):
    functions = [node for node in ast.walk(tree(path)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in functions
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{rel(path)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("path", PACKAGE_SOURCES, ids=rel)
def test_no_module_is_over_600_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{rel(path)} is {lines} lines (at most {MAX_MODULE_LINES}): split it"


def test_psctl_server_does_not_import_the_worker_package():
    import subprocess
    import sys

    # What `psctl server --config mnist` runs before it serves: the parser, the job file, the server.
    code = (
        "import sys\n"
        "from psgrid.cluster.cli import build_parser\n"
        "from psgrid.cluster.commands.server import server_config_from_args\n"
        "import psgrid.psserver.server\n"
        "args = build_parser('server').parse_args(['server', '--config', 'mnist', '--shard', '1'])\n"
        "config = server_config_from_args(args)\n"
        "assert (config.num_shards, config.mode) == (2, 'sync'), config\n"
        "print(sorted(m for m in sys.modules if m.startswith('psgrid.worker')))"
    )
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
        found |= {
            f"{m}.{a.name}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            for m in [node.module]
            for a in node.names
        }
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
