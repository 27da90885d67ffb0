"""Every file and folder a job writes has its mode said where it is made, so ``umask 000`` opens nothing.

Workers read the shards' address files and send the job's token to what they name: one that others
may write lets them collect the token. So under any umask nothing a job writes is writable by the
group or the world, and its secrets (the token, private keys) are readable by their owner alone.
"""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import launch_env

ROOT = Path(__file__).resolve().parent.parent
SECRETS = ("token", "ca.key", "shard.key", "client.key")


def loose(top: Path) -> list[str]:
    """What under ``top`` (itself included) the group or the world may write, or read where it is a secret."""
    found = []
    for path in [top, *top.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        if mode & 0o022:
            found.append(f"{path.relative_to(top.parent)} {stat.filemode(mode)} (writable by others)")
        if path.name in SECRETS and mode & 0o077:
            found.append(f"{path.relative_to(top.parent)} {stat.filemode(mode)} (a secret others may read)")
    return found


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_job_under_umask_000_leaves_nothing_others_may_write(tmp_path):
    top = tmp_path / "made"  # --out's parents are made by the job too
    out, checkpoints = top / "runs" / "job", top / "ckpt"
    argv = [
        sys.executable,
        "-m",
        "psgrid.cluster.cli",
        "launch",
        "--config",
        "mnist",
        "--steps",
        "20",
        "--eval-every",
        "0",
        "--no-progress",
        "--out",
        str(out),
        "--set",
        f"server.checkpoint_dir={checkpoints}",
        "--set",
        "server.checkpoint_every=5",
    ]
    done = subprocess.run(argv, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=150, umask=0)
    assert done.returncode == 0, done.stdout + done.stderr
    for expected in (
        "token",
        "job.toml",
        "summary.json",
        "addr/shard-0",
        "logs/server-0.log",
        "metrics/worker-0.jsonl",
    ):
        assert (out / expected).is_file(), expected
    assert any(checkpoints.rglob("*.npz"))
    assert loose(top) == []


def test_psctl_certs_under_umask_000_keeps_its_keys_to_their_owner(tmp_path):
    from psgrid.cluster.job.pki import make_certs

    old = os.umask(0)
    try:
        make_certs(tmp_path / "made" / "pki", ["localhost"], days=1)
    finally:
        os.umask(old)
    assert loose(tmp_path / "made") == []


# Calls that create a file or folder with the mode the umask leaves: each would make it writable by
# others under umask 000. Everything a job writes goes through psserver/files.py, which says the mode.
UMASKED = {"mkdir", "makedirs", "write_text", "write_bytes", "touch", "savefig"}


def _creates_by_umask(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    keywords = {k.arg: k.value for k in node.keywords}
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "files":
        return False  # psserver/files.py says the mode
    if name == "mkdir" and "mode" in keywords and "parents" not in keywords:
        return False  # one folder, its mode given
    if name == "savefig" and "format" in keywords:
        return False  # into a file opened here, not a path
    if name in UMASKED:
        return True
    if name == "open" and isinstance(func, ast.Name):  # the builtin open, for writing
        modes = [a for a in node.args[1:2]] + [k.value for k in node.keywords if k.arg == "mode"]
        return any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax+") for m in modes)
    return False


def test_no_module_makes_a_file_or_folder_whose_mode_the_umask_decides():
    offenders = []
    for folder in ("cluster", "psserver", "worker"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "files.py" and folder == "psserver":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and _creates_by_umask(node):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], "create these through psgrid.psserver.files (explicit modes): " + ", ".join(offenders)
