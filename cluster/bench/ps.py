"""``psctl bench ps``: the parameter server alone, in updates per second, beside the floor of one update.

Workers pull the weights and push a fixed, precomputed gradient as fast as they can: no model, no
data, nothing but the system. Shards and workers are separate processes, as in a job. Beside every
model size the same run measures the floor: what one update must cost on this machine whatever the
system, the copy of the weights to a worker, the copy of a gradient back, and the shard's own apply
(``numpy.copyto`` of P floats twice, the optimizer's apply once).

``--against REV`` runs the same grid, interleaved, with the code of another revision (checked out
in a temporary git worktree): the ratio of the two is what a change bought, on a machine too noisy
for absolute figures to mean much.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from psgrid.cluster.bench.transport import median_time
from psgrid.psserver import files
from psgrid.psserver.protocol import mode_rules

PLANES = ("shm", "tcp", "grpc")
START_TIMEOUT_S = 120.0
# Where this psgrid's code is: a git checkout's root in an editable install, the psgrid folder in a wheel.
CODE_ROOT = Path(__file__).resolve().parents[2]

# The worker, as a script of the public Client API (the same text drives an older revision's code).
WORKER = r"""
import json, statistics, sys, time
import numpy as np
from psgrid import Client, ModelSpec   # the public names: module paths differ between revisions

cfg = json.loads(sys.argv[1])
spec = ModelSpec([("x", (cfg["params"],))])
options = {"data_plane": cfg["data_plane"]}
if cfg["plane"] != "shm":
    try:
        Client.__init__.__code__.co_varnames.index("shared_memory")
        options["shared_memory"] = False
    except ValueError:
        pass                       # a revision without shared memory
init = (lambda: np.zeros(spec.size, np.float32)) if cfg["rank"] == 0 else None
with Client(cfg["addresses"], spec, worker_id=cfg["rank"], world=cfg["workers"], init=init, deadline_s=600,
            join_timeout_s=300, **options) as client:
    out = np.empty(spec.size, np.float32)
    grad = client.gradient_buffer() if hasattr(client, "gradient_buffer") else np.empty(spec.size, np.float32)
    grad[:] = np.random.default_rng(cfg["rank"]).standard_normal(spec.size).astype(np.float32) * 1e-6
    client.pull(out).wait()
    client.push(grad).wait()       # warm: connections, buffers and mappings made
    print(json.dumps({"ready": True, "planes": client.data_planes}), flush=True)
    start = float(sys.stdin.readline())
    time.sleep(max(0.0, start - time.time()))
    pulls, pushes, end = [], [], start + cfg["seconds"]
    while time.time() < end:
        t0 = time.perf_counter()
        client.pull(out).wait()
        t1 = time.perf_counter()
        client.push(grad).wait()
        pulls.append(t1 - t0)
        pushes.append(time.perf_counter() - t1)
    print(json.dumps({"steps": len(pulls), "pull_s": statistics.median(pulls) if pulls else None,
                      "push_s": statistics.median(pushes) if pushes else None,
                      "seconds": time.time() - start}), flush=True)
"""


@dataclass(frozen=True)
class Code:
    """Which code a run measures: this tree, or another revision's checkout."""

    label: str
    root: Path | None  # None: this interpreter's own psgrid

    def env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if self.root is not None:
            site = str(self.root.parent / "site")
            env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env


def installed_layout(tree: Path, site: Path) -> None:
    """Lay out ``tree``'s code in ``site`` as a wheel does (``psgrid/`` with its subpackages inside), by symlinks.

    A checkout's root on the path would not do: its subpackages are mapped in by pyproject.toml's
    ``package-dir``, and without them there the missing ones would come from this interpreter's psgrid.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    settings = tomllib.loads((tree / "pyproject.toml").read_text())
    mapped = settings.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    package = site / "psgrid"
    files.make_dirs(package)
    for entry in (tree / "psgrid").iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in mapped.items():
        if name.count(".") == 1 and name.startswith("psgrid."):
            (package / name.split(".")[1]).symlink_to(tree / folder)


def checkout(revision: str) -> Code:
    """A temporary worktree of ``revision`` of the git checkout psgrid runs from."""
    from psgrid.cluster.errors import UsageError

    if not (CODE_ROOT / ".git").exists():
        raise UsageError(
            f"--against needs psgrid run from a git checkout, and this one runs from {CODE_ROOT}: "
            f"install it from the checkout with pip install -e ."
        )
    known = subprocess.run(
        ["git", "-C", str(CODE_ROOT), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"], capture_output=True
    )
    if known.returncode != 0:
        raise UsageError(f"--against {revision}: no such revision in {CODE_ROOT} (try HEAD~1 or a commit id)")
    where = Path(tempfile.mkdtemp(prefix="psgrid-bench-"))
    try:
        subprocess.run(
            ["git", "-C", str(CODE_ROOT), "worktree", "add", "--detach", str(where / "tree"), revision],
            check=True,
            capture_output=True,
        )
        installed_layout(where / "tree", where / "site")
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(where, ignore_errors=True)
        raise UsageError(f"--against {revision}: git could not check it out: {exc.stderr.decode().strip()}") from None
    label = subprocess.run(
        ["git", "-C", str(where / "tree"), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    return Code(label, where / "tree")


def remove_checkout(code: Code) -> None:
    subprocess.run(["git", "-C", str(CODE_ROOT), "worktree", "remove", "--force", str(code.root)], capture_output=True)
    shutil.rmtree(code.root.parent, ignore_errors=True)


# ----- the floor --------------------------------------------------------------------------------


def floor(params: int, optimizer: str = "sgd", repeat: int = 7) -> dict:
    """The copies and the apply one update needs on this machine, and the updates/s they allow."""
    from psgrid.psserver.kernels.optim import make_optimizer

    rng = np.random.default_rng(0)
    weights = rng.standard_normal(params).astype(np.float32)
    grad = (rng.standard_normal(params) * 1e-6).astype(np.float32)
    target = np.empty_like(weights)
    opt = make_optimizer(optimizer, params, lr=1e-9)
    copy_s = median_time(lambda: np.copyto(target, weights), repeat)
    apply_s = median_time(lambda: opt.step(weights, grad, out=target), repeat)
    seconds = 2 * copy_s + apply_s
    return {"copy_s": copy_s, "apply_s": apply_s, "floor_s": seconds, "floor_updates_per_s": 1.0 / seconds}


# ----- one configuration ------------------------------------------------------------------------


class Shards:
    """S ``psctl server`` processes of ``code`` on loopback port 0."""

    def __init__(self, code: Code, count: int, mode: str, folder: Path):
        self.procs: list[subprocess.Popen] = []
        address_files = [folder / f"shard-{i}" for i in range(count)]
        job_id = secrets.token_hex(6)  # the shards of one set are one job (Admin and clients check)
        try:
            for i, path in enumerate(address_files):
                argv = [
                    sys.executable,
                    "-m",
                    "psgrid.cluster.cli",
                    "server",
                    "--shard",
                    str(i),
                    "--num-shards",
                    str(count),
                    "--port",
                    "0",
                    "--address-file",
                    str(path),
                    "--mode",
                    mode,
                    "--lr",
                    "1e-9",
                    "--threads",
                    "32",
                    "--lease-s",
                    "60",
                    "--job-id",
                    job_id,
                ]
                # From their own folder: python puts the current one first on the path, and it may hold
                # another revision's psgrid.
                with files.open_new(folder / f"shard-{i}.log", "w") as log:
                    self.procs.append(
                        subprocess.Popen(argv, env=code.env(), stdout=subprocess.DEVNULL, stderr=log, cwd=folder)
                    )
            deadline = time.monotonic() + START_TIMEOUT_S
            while not all(p.exists() for p in address_files):
                if any(proc.poll() is not None for proc in self.procs) or time.monotonic() > deadline:
                    raise RuntimeError(f"shards of {code.label} did not start; see {folder}")
                time.sleep(0.05)
            self.addresses = [p.read_text().splitlines()[0] for p in address_files]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def measure(
    code: Code, shards: Shards, *, params: int, workers: int, plane: str, mode: str, seconds: float, folder: Path
) -> dict:
    """W worker processes pulling and pushing for ``seconds``; their steps, medians and planes."""
    procs = []
    try:
        for rank in range(workers):
            cfg = {
                "params": params,
                "rank": rank,
                "workers": workers,
                "addresses": shards.addresses,
                "data_plane": "grpc" if plane == "grpc" else "tcp",
                "plane": plane,
                "seconds": seconds,
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER, json.dumps(cfg)],
                    env=code.env(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=folder,
                )
            )
        ready = [_line(p) for p in procs]
        start = time.time() + 0.2
        for p in procs:
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        done = [_line(p) for p in procs]
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
    steps = sum(d["steps"] for d in done)
    wall = max(d["seconds"] for d in done)
    updates = steps / workers if mode_rules(mode).accumulates else steps
    planes = sorted({x for r in ready for x in r["planes"]})
    return {
        "steps": steps,
        "updates_per_s": updates / wall,
        "gbps": steps * 8 * params / wall / 1e9,
        "pull_s": statistics.median(d["pull_s"] for d in done),
        "push_s": statistics.median(d["push_s"] for d in done),
        "planes_used": planes,
    }


def _line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise RuntimeError(f"a bench worker exited with code {proc.returncode} before answering")
    return json.loads(line)


# ----- the grid -----------------------------------------------------------------------------------


def memory_needed(params: int, shards: int, workers: int) -> int:
    """Bytes a configuration holds at once: each worker's weights and gradient, each shard's versions."""
    return 4 * params * (2 * workers + 2 + workers + 2 * workers)


def available_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def rows(
    params=(1_000_000, 10_000_000, 100_000_000),
    shards=(1, 2, 4),
    workers=(1, 2, 4, 8),
    planes=PLANES,
    mode: str = "async",
    seconds: float = 2.0,
    against: Code | None = None,
    repeats: int = 1,
):
    """Yield one dict per configuration (and code): the figures and the floor measured beside them."""
    codes = [Code("this", None)] + ([against] if against is not None else [])
    for p in params:
        base = floor(p)
        for s in shards:
            for w in workers:
                need = memory_needed(p, s, w)
                if need > 0.8 * available_memory():
                    yield {
                        "suite": "ps",
                        "params": p,
                        "shards": s,
                        "workers": w,
                        "mode": mode,
                        "model": None,
                        "skipped": f"needs about {need / 2**30:.1f} GiB; "
                        f"{available_memory() / 2**30:.1f} GiB available",
                    }
                    continue
                for plane in planes:
                    results: dict[str, list[dict]] = {c.label: [] for c in codes}
                    with tempfile.TemporaryDirectory(prefix="psgrid-bench-ps-") as tmp:
                        for r in range(repeats):
                            for code in codes if r % 2 == 0 else codes[::-1]:  # alternate who goes first
                                folder = Path(tmp) / f"{code.label}-{r}"
                                files.make_dirs(folder)
                                servers = Shards(code, s, mode, folder)
                                try:
                                    results[code.label].append(
                                        measure(
                                            code,
                                            servers,
                                            params=p,
                                            workers=w,
                                            plane=plane,
                                            mode=mode,
                                            seconds=seconds,
                                            folder=folder,
                                        )
                                    )
                                finally:
                                    servers.close()
                    for code in codes:
                        runs = results[code.label]
                        ups = statistics.median(x["updates_per_s"] for x in runs)
                        row = {
                            "suite": "ps",
                            "code": code.label,
                            "params": p,
                            "shards": s,
                            "workers": w,
                            "mode": mode,
                            "model": None,
                            "data_plane": plane,
                            "planes_used": runs[0]["planes_used"],
                            "updates_per_s": ups,
                            "gbps": statistics.median(x["gbps"] for x in runs),
                            "pull_s": statistics.median(x["pull_s"] for x in runs),
                            "push_s": statistics.median(x["push_s"] for x in runs),
                            **base,
                            "ratio_vs_floor": ups / base["floor_updates_per_s"],
                            "repeats": repeats,
                        }
                        yield row


def run(
    params,
    shards,
    workers,
    planes,
    mode: str,
    seconds: float,
    against: str | None,
    repeats: int,
    as_json: bool,
    out=sys.stdout,
) -> list[dict]:
    code = checkout(against) if against else None
    found = []
    try:
        if not as_json:
            print(
                f"{'params':>8} {'S':>2} {'W':>2} {'plane':>5} {'code':>8} {'updates/s':>10} {'GB/s':>6} "
                f"{'pull ms':>8} {'push ms':>8} {'floor/s':>8} {'x floor':>7}",
                file=out,
                flush=True,
            )
        for row in rows(params, shards, workers, planes, mode, seconds, code, repeats):
            found.append(row)
            if as_json:
                print(json.dumps(row), file=out, flush=True)
            elif "skipped" in row:
                print(
                    f"{_count(row['params']):>8} {row['shards']:>2} {row['workers']:>2}  skipped: {row['skipped']}",
                    file=out,
                    flush=True,
                )
            else:
                print(
                    f"{_count(row['params']):>8} {row['shards']:>2} {row['workers']:>2} {row['data_plane']:>5} "
                    f"{row['code']:>8} {row['updates_per_s']:10.1f} {row['gbps']:6.2f} {1e3 * row['pull_s']:8.2f} "
                    f"{1e3 * row['push_s']:8.2f} {row['floor_updates_per_s']:8.1f} {row['ratio_vs_floor']:7.2f}",
                    file=out,
                    flush=True,
                )
    finally:
        if code is not None:
            remove_checkout(code)
    return found


def _count(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}K"
