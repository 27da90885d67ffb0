"""A job's records written whole (cluster/job/records.py), and a resume that finds its job.toml damaged.

The processes that are killed in the middle of a rewrite are in tests/test_recovery.py; these run in
this process, fast.
"""

from __future__ import annotations

import ast
import os
import signal
import stat
from pathlib import Path

import pytest

from psgrid.cluster.cli import main
from psgrid.cluster.errors import UsageError
from psgrid.cluster.job.config import job_from_dict, load_job
from psgrid.cluster.job.records import signals_held, write_job_file, write_whole
from psgrid.cluster.run.resume import archive_attempt, job_file_to_resume


def _job(tmp_path, **server):
    return job_from_dict(
        {
            "job": {"shards": 2, "out": str(tmp_path / "run")},
            "server": {"checkpoint_dir": str(tmp_path / "ckpt"), **server},
        }
    )


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ----- writing whole ------------------------------------------------------------------------------


def test_a_record_is_replaced_whole_with_its_mode_said_and_no_temporary_file_left(tmp_path):
    path = tmp_path / "token"
    path.write_text("old\n")
    os.chmod(path, 0o666)
    old = os.umask(0)
    try:
        write_whole(path, "secret\n", 0o600)
        write_whole(tmp_path / "job.toml", "[job]\n")
    finally:
        os.umask(old)
    assert path.read_text() == "secret\n" and _mode(path) == 0o600  # made afresh: not the old file's mode
    assert _mode(tmp_path / "job.toml") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml", "token"]


def test_a_write_that_fails_half_way_leaves_the_old_record(tmp_path, monkeypatch):
    path = tmp_path / "job.toml"
    write_whole(path, "[job]\nworkers = 3\n")

    def dies_before_the_rename(*args, **kwargs):  # what SIGKILL or a signal's exception does mid-write
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", dies_before_the_rename)
    with pytest.raises(KeyboardInterrupt):
        write_whole(path, "[job]\nworkers = 4\n")
    assert path.read_text() == "[job]\nworkers = 3\n"
    assert [p.name for p in tmp_path.iterdir()] == ["job.toml"]


def test_a_signal_inside_the_file_wrapper_comes_out_as_itself_not_as_a_second_close(tmp_path, monkeypatch):
    # io.open closes the descriptor when its text layer fails (a Ctrl-C landing there, seen in CI):
    # closing it again raised EBADF, which hid the Ctrl-C and made psctl exit 1 instead of 130.
    from psgrid.psserver import files

    real_fdopen = os.fdopen

    def interrupted_after_wrapping(fd, *args, **kwargs):
        real_fdopen(fd, "rb").close()  # what io.open's own cleanup does to the descriptor
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "fdopen", interrupted_after_wrapping)
    with pytest.raises(KeyboardInterrupt):
        files.open_new(tmp_path / "events.jsonl", "a")


def test_signals_are_held_across_a_rewrite_then_delivered_to_the_handler_they_had():
    heard = []
    before = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum)),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            assert heard == []  # held: a handler would run at once, here
        assert heard == [signal.SIGTERM]  # the first one heard, once the block ends
        with pytest.raises(KeyboardInterrupt):  # Python's own SIGINT handler, restored
            with signals_held():
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_the_job_file_reads_back_as_the_job(tmp_path):
    job = _job(tmp_path, lr=0.125)
    path = write_job_file(tmp_path, job, "by psctl launch")
    assert path == tmp_path / "job.toml"
    assert path.read_text().startswith("# resolved job, as run by psctl launch\n")
    again = load_job(str(path))
    assert (again.server.lr, again.server.checkpoint_dir, again.shards) == (0.125, str(tmp_path / "ckpt"), 2)


# ----- a resume's job file ------------------------------------------------------------------------


def _attempt(out, text: str | None) -> None:
    """A finished attempt in ``out``: its summary, and its job.toml holding ``text`` (None: no job.toml)."""
    out.mkdir(exist_ok=True)
    (out / "summary.json").write_text("{}\n")
    (out / "job.toml").unlink(missing_ok=True)
    if text is not None:
        (out / "job.toml").write_text(text)


def test_each_attempt_keeps_a_copy_of_its_job_and_a_damaged_job_is_taken_from_the_latest_whole_one(tmp_path, capsys):
    out = tmp_path / "run"
    _attempt(out, write_job_file(tmp_path, _job(tmp_path, lr=0.25), "by psctl launch").read_text())
    assert archive_attempt(out) == out / "attempts" / "1"
    assert load_job(str(out / "attempts" / "1" / "job.toml")).server.lr == 0.25
    assert job_file_to_resume(out) == out / "job.toml"  # whole: read as it is
    _attempt(out, "")  # attempt 2 died in the middle of an in-place rewrite
    assert archive_attempt(out) == out / "attempts" / "2"
    assert not (out / "attempts" / "2" / "job.toml").exists()  # no copy of a damaged job
    for damaged in ("", "\n# resolved job, as run by psctl launch\n", "[server\nlr = ", b"\xff\xfe[job]"):
        (out / "job.toml").write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
        assert job_file_to_resume(out) == out / "attempts" / "1" / "job.toml"
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "resuming the job as attempt 1 ran it" in err, err
    (out / "job.toml").unlink()
    assert job_file_to_resume(out) == out / "attempts" / "1" / "job.toml"


def test_a_damaged_job_without_a_copy_is_refused_in_one_line_that_says_what_to_do(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "job.toml").write_text("")
    with pytest.raises(
        UsageError,
        match=r"job.toml is empty \(0 bytes, no table\) and no earlier attempt .* kept "
        r"a copy: put the job back in",
    ):
        job_file_to_resume(out)
    assert main(["launch", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "put the job back in" in err and "without checkpoints" not in err, err
    (out / "job.toml").unlink()
    (out / ".psgrid.lock").write_text("")  # a launch began here, and was stopped before it wrote its job
    with pytest.raises(UsageError, match=r"no job.toml there; .* launch it again with --out .* --overwrite"):
        job_file_to_resume(out)


def test_the_next_job_in_a_folder_sweeps_the_temporary_files_of_a_killed_writer(tmp_path):
    from psgrid.cluster.job.outdir import prepare, release

    out = tmp_path / "run"
    out.mkdir()
    left = [".job.toml.4242.tmp", ".token.4242.tmp"]  # a launcher SIGKILLed inside write_whole
    mine = ["notes.tmp", "summary.json.tmp", ".hidden.tmp", "job.toml"]
    for name in left + mine:
        (out / name).write_text("x")
    try:
        assert prepare(_job(tmp_path), resume=True) == out
    finally:
        release(out)
    assert not any((out / name).exists() for name in left)
    assert all((out / name).exists() for name in mine)


# ----- one writer of job.toml ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
WRITER = "cluster/job/records.py"
SCANNED = ("cluster", "worker", "psserver", "psgrid", "benchmarks", "scripts")
WRITES = {"write_text", "write_bytes", "write_whole", "replace_text", "open", "open_new", "copy", "copy2", "copyfile"}


def job_file_writes(path: Path) -> list[str]:
    """Where ``path`` renders a job file (``to_toml()``) or writes to a path that names ``job.toml``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        target = " ".join(ast.unparse(part) for part in [node.func, *node.args])
        if name == "to_toml" or (name in WRITES and ("job.toml" in target or "JOB_FILE" in target)):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def sources_outside_the_writer() -> list[Path]:
    return sorted(
        p for folder in SCANNED for p in (ROOT / folder).rglob("*.py") if p.relative_to(ROOT).as_posix() != WRITER
    )


def test_job_toml_is_written_by_the_records_module_only():
    # Written elsewhere it was written in place (an empty job for the next resume) or without its first line.
    found = {p.relative_to(ROOT).as_posix(): w for p in sources_outside_the_writer() if (w := job_file_writes(p))}
    assert found == {}, f"job.toml written outside {WRITER} (use write_job_file / copy_job_file): {found}"


def test_the_writer_check_sees_each_way_of_writing_a_job_file(tmp_path):
    # The rule above would pass on anything if it saw nothing: it finds each form in a made-up module, and
    # finds the writer itself.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "(out / 'job.toml').write_text(job.to_toml())\n"
        "write_whole(target / JOB_FILE, text)\n"
        "files.replace_text(out / 'job.toml', text)\n"
        "(out / 'summary.json').write_text(text)\n"
    )
    assert sorted(w.split(":")[0] for w in job_file_writes(probe)) == ["line 1", "line 1", "line 2", "line 3"]
    assert job_file_writes(ROOT / WRITER)


def test_a_synthetic_job_recorded_before_synthetic_seed_resumes_on_its_seeds_task(tmp_path):
    """Its seed chose its task then: resumed on task 0 its shards' weights would go on training on another."""
    from psgrid.cluster.run.resume import job_to_resume

    job = load_job("synthetic-50m")
    job_file = tmp_path / "job.toml"
    text = job_from_dict({**job.public_dict(), "train": {**job.public_dict()["train"], "seed": 3}}).to_toml()
    job_file.write_text("\n".join(line for line in text.splitlines() if not line.startswith("synthetic_seed")))
    assert job_to_resume(job_file).train.synthetic_seed == 3
    job_file.write_text(text)  # recorded with the key: as recorded
    assert (job_to_resume(job_file).train.seed, job_to_resume(job_file).train.synthetic_seed) == (3, 0)
