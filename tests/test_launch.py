"""psctl launch through subprocesses: a tiny job, fatal and tolerated failures, SIGTERM cleanup."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from psgrid.cluster.run.coordinator import JobState, MetricsTail, merge_metrics
from psgrid.cluster.run.procs import Child, stop_children
from tests.support import Launch, alive, child_pids, run_launch, steps_seen, wait_for

TINY = ["--config", "mnist", "--steps", "100", "--eval-every", "25", "--no-progress"]


# -- units -------------------------------------------------------------------------------------


def test_metrics_tail_reads_whole_lines_only(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = MetricsTail([path, tmp_path / "missing.jsonl"])
    assert tail.read() == []
    with open(path, "w") as f:
        f.write('{"event": "step", "rank": 0, "step": 0, "samples": 4, "loss": 1.0}\n{"event": "st')
        f.flush()
        assert [e["event"] for e in tail.read()] == ["step"]
        f.write('ep", "rank": 0, "step": 1, "samples": 4, "loss": 0.5}\nnot json\n')
    events = tail.read()
    assert [e["step"] for e in events] == [1]
    state = JobState()
    state.update([{"event": "step", "rank": 0, "step": 0, "samples": 4, "loss": 1.0}] + events)
    assert (state.steps, state.total_samples, state.mean_loss) == (2, 8, 0.5)


def test_a_worker_whose_done_record_the_launcher_made_keeps_its_step_records_samples():
    """A script that exits without close() writes no done record; the launcher's stand-in has no count."""
    state = JobState()
    steps = [{"event": "step", "rank": r, "step": s, "samples": 8, "loss": 1.0} for r in (0, 1) for s in range(3)]
    state.update([*steps, {"event": "done", "rank": 0}, {"event": "done", "rank": 1, "samples": 30}])
    assert (state.worker_samples(0), state.worker_samples(1), state.total_samples) == (24, 30, 54)


def test_a_ranks_sessions_one_after_another_all_count():
    """A notebook's LocalCluster: rank 0 joins, trains 5 steps, closes, joins again and trains 7 (the summary said 7)."""
    state = JobState()
    for first, steps in ((0, 5), (5, 7)):
        state.update([{"event": "start", "rank": 0, "time": 1.0 + first, "first_step": first}])
        state.update([{"event": "step", "rank": 0, "step": s, "samples": 10} for s in range(first, first + steps)])
        state.update([{"event": "done", "rank": 0, "steps": steps, "samples": 10 * steps}])
    assert (state.steps, state.total_samples, state.worker_steps(0)) == (12, 120, 12)
    # psctl mpi's rank 0 reads a worker's records from its file and again from its message: one record, once.
    twice = {"event": "done", "rank": 1, "time": 9.0, "steps": 3, "samples": 30}
    state.update([twice, dict(twice)])
    assert state.worker_samples(1) == 30


def test_a_second_early_ctrl_c_is_remembered_without_a_second_exception():
    from psgrid.cluster.run import interrupts

    previous = interrupts.hear_early()
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupts._early(signal.SIGINT, None)
        interrupts._early(signal.SIGTERM, None)  # the first one's unwinding is under way: nothing raised into it
        assert interrupts.heard_early() == signal.SIGTERM
        interrupts._defer["early_at"] -= interrupts.AGAIN_S  # a second later: it may have been swallowed
        with pytest.raises(KeyboardInterrupt):
            interrupts._early(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, previous)
        interrupts._defer["early"] = None


def test_merge_metrics_sorts_by_time(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"time": 3, "x": "a3"}\n{"time": 1, "x": "a1"}\n')
    b.write_text('{"time": 2, "x": "b2"}\n')
    assert merge_metrics([a, b, [{"time": 0, "x": "l0"}], tmp_path / "none.jsonl"], tmp_path / "all.jsonl") == 4
    lines = [json.loads(line)["x"] for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert lines == ["l0", "a1", "b2", "a3"]


def test_stop_children_escalates_to_sigkill(tmp_path):
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    kids = [Child(f"stubborn {i}", [sys.executable, "-c", stubborn], tmp_path / f"{i}.log") for i in range(2)]
    kids.append(Child("polite", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "p.log"))
    try:
        wait_for(lambda: all("up" in (tmp_path / f"{i}.log").read_text() for i in range(2)), 30, "children up")
        t = time.monotonic()
        stop_children(kids, grace=1.0)
        assert time.monotonic() - t < 10
        assert [k.returncode for k in kids] == [-signal.SIGKILL, -signal.SIGKILL, -signal.SIGTERM]
        assert "was killed by SIGKILL" in kids[0].describe_exit()
    finally:
        for k in kids:
            if k.poll() is None:
                k.proc.kill()
                k.proc.wait(10)


# -- whole jobs --------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_job_completes_with_a_summary(tmp_path):
    t = time.monotonic()
    code, text, out = run_launch(tmp_path, *TINY)
    elapsed = time.monotonic() - t
    assert code == 0, text
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "mode",
        "steps",
        "wall_s",
        "samples_per_s",
        "train_accuracy",
        "test_accuracy",
        "shards",
        "workers",
        "failures",
        "shard_stats",
        "config",
    ):
        assert key in summary, key
    assert (summary["status"], summary["mode"], summary["shards"], summary["workers"]) == ("ok", "sync", 2, 2)
    assert summary["steps"] == 200 and summary["failures"] == []
    assert summary["samples_per_s"] > 0 and summary["wall_s"] > 0
    assert summary["test_accuracy"] >= 0.85, summary
    assert [s["shard_index"] for s in summary["shard_stats"]] == [0, 1]
    assert all(s["dropped_late"] >= 0 and "mean_staleness" in s for s in summary["shard_stats"])
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [e["time"] for e in events]
    assert times == sorted(times)
    kinds = {e["event"] for e in events}
    assert {"job_start", "shards_ready", "step", "eval", "done", "final_eval", "job_end"} <= kinds
    (start,) = [e for e in events if e["event"] == "job_start"]
    assert (start["shards"], start["workers"]) == (2, 2)
    assert "starting 2 worker(s) of a 101,770-parameter mlp; logs in " in text  # a job says its size first
    assert "mnist (sync, 2 shards, 2 workers): 200 steps in " in text
    assert "test accuracy" in text and "summary in" in text
    print(f"tiny launch took {elapsed:.1f} s")


@pytest.mark.slow
def test_a_server_that_cannot_start_fails_the_job_by_name(tmp_path):
    code, text, out = run_launch(
        tmp_path,
        *TINY,
        "--shards",
        "1",
        "--set",
        "server.tls_cert=/nonexistent/cert.pem",
        "--set",
        "server.tls_key=/nonexistent/key.pem",
        "--set",
        "train.tls_ca=/nonexistent/ca.pem",
    )  # the workers' side agrees
    assert code == 1, text
    assert "psctl launch: job failed: server 0 (pid" in text and "exited with code 2" in text
    assert "psctl server: error: tls_cert '/nonexistent/cert.pem': no such file" in text  # its log's tail
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["failures"][0]["name"] == "server 0" and not summary["failures"][0]["tolerated"]


@pytest.mark.slow
def test_a_server_killed_mid_run_ends_the_job_and_every_child(tmp_path):
    with Launch(tmp_path, *TINY, "--steps", "5000") as launch:
        launch.wait_for(lambda: steps_seen(launch.out, 0) >= 5, 60, "worker 0 training")
        pids = child_pids(launch.out)
        os.kill(pids["shards"][1], signal.SIGKILL)
        code = launch.wait(60)
        text = launch.text()
        assert code == 1, text
        assert f"server 1 (pid {pids['shards'][1]}) was killed by SIGKILL" in text
        for pid in pids["shards"] + pids["workers"]:
            assert not alive(pid), f"pid {pid} outlived the launcher"


@pytest.mark.slow
def test_a_dead_worker_is_tolerated(tmp_path):
    with Launch(tmp_path, *TINY, "--steps", "300", "--lease-s", "2") as launch:
        launch.wait_for(lambda: steps_seen(launch.out, 1) >= 5, 60, "worker 1 training")
        victim = child_pids(launch.out)["workers"][1]
        os.kill(victim, signal.SIGKILL)
        code = launch.wait(120)
        text = launch.text()
        assert code == 0, text
        summary = json.loads((launch.out / "summary.json").read_text())
        (failure,) = summary["failures"]
        assert (failure["name"], failure["exit_code"], failure["tolerated"]) == ("worker 1", -9, True)
        assert summary["workers_completed"] == 1 and summary["worker_results"][0]["completed"]
        assert "tolerated failure: worker 1" in text


@pytest.mark.slow
def test_sigterm_stops_every_child(tmp_path):
    with Launch(tmp_path, *TINY, "--steps", "5000") as launch:
        launch.wait_for(
            lambda: steps_seen(launch.out, 0) >= 5 and steps_seen(launch.out, 1) >= 5, 60, "workers training"
        )
        pids = child_pids(launch.out)
        t = time.monotonic()
        launch.proc.send_signal(signal.SIGTERM)
        code = launch.wait(30)
        assert code == 128 + signal.SIGTERM, launch.text()
        assert time.monotonic() - t < 15
        left = [pid for pid in pids["shards"] + pids["workers"] if alive(pid)]
        assert not left, f"still running after SIGTERM to launch: {left}"
        summary = json.loads((launch.out / "summary.json").read_text())
        assert summary["status"] == "interrupted"
        # The summary counts every step the stopped workers recorded, those after the last progress read too.
        events = [json.loads(line) for line in (launch.out / "metrics.jsonl").read_text().splitlines()]
        recorded = [e for e in events if e.get("event") == "step"]
        assert summary["steps"] == len(recorded), (summary["steps"], len(recorded))
        assert summary["samples"] == sum(e["samples"] for e in recorded)
        by_rank = {r["rank"]: r["steps"] for r in summary["worker_results"]}
        assert by_rank == {rank: sum(e["rank"] == rank for e in recorded) for rank in (0, 1)}, by_rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failure_after_training_fails_the_job(tmp_path, monkeypatch, capsys):
    # Training completes, then the final evaluation cannot reach a shard: the job did not end
    # cleanly, and neither the exit code nor summary.json may say otherwise.
    import psgrid.cluster.run.coordinator as co
    from psgrid.cluster.job.config import apply_overrides, load_job
    from psgrid.cluster.run.launch import launch
    from psgrid.psserver.exceptions import Unauthenticated

    def refuse(job, addresses, **options):
        raise Unauthenticated("shard 0: missing or wrong bearer token", shard=0)

    monkeypatch.setattr(co, "finish", refuse)
    job = apply_overrides(load_job("mnist"), {"steps": 20, "eval_every": 0, "out": str(tmp_path / "run")})
    assert launch(job, progress=False) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "missing or wrong bearer token" in summary["message"]
    assert "job failed: Unauthenticated: shard 0: missing or wrong bearer token" in capsys.readouterr().err


def test_a_ctrl_c_that_code_on_the_way_swallowed_still_stops_the_launcher():
    """The signal's exception lands wherever the main thread is; tqdm, starting its monitor thread, catches
    it and carries on (seen: a resumed job that trained on after its Ctrl-C). The loops raise it again."""
    import signal

    from psgrid.cluster.run.interrupts import Interrupted, check_interrupted, listen_for_interrupts

    old = listen_for_interrupts()
    try:
        check_interrupted()  # nothing came: nothing raised
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, in the main thread
        except Exception:  # noqa: BLE001 - as the library on the way does
            pass
        with pytest.raises(Interrupted) as raised:
            check_interrupted()
        assert raised.value.signum == signal.SIGINT
        listen_for_interrupts()  # a new job does not inherit it
        check_interrupted()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def test_a_ctrl_c_swallowed_before_the_launcher_listens_still_stops_the_job():
    """psctl hears Ctrl-C from its first line: one that lands while a module is still importing, where
    CPython ignores the exception (importlib's module-lock callback; seen: a resumed job trained on),
    is carried into the job, whose first check raises it."""
    import signal

    from psgrid.cluster.run.interrupts import Interrupted, check_interrupted, hear_early, listen_for_interrupts

    before = hear_early()
    old = None
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, in the main thread
        except KeyboardInterrupt:  # as "Exception ignored in: ... cb" does
            pass
        old = listen_for_interrupts()
        with pytest.raises(Interrupted) as raised:
            check_interrupted()
        assert raised.value.signum == signal.SIGINT
        listen_for_interrupts()  # heard once: the next job does not inherit it
        check_interrupted()
    finally:
        for sig, handler in (old or {}).items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGINT, before)
