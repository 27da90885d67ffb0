"""The user API: psgrid.init() joins the job of the environment and exchanges any framework's arrays in place."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import psgrid
from psgrid.cluster.run.coordinator import JobState, MetricsTail
from psgrid.worker import env as job_vars
from psgrid.worker.api import NO_JOB, init, job_file_settings
from psgrid.worker.dlpack import ArrayError
from tests.support import plane_options
from tests.test_dlpack import Foreign, Immutable, TorchLike

ROOT = Path(__file__).resolve().parent.parent
USER_SCRIPT = ROOT / "tests" / "user_script.py"


class Module:
    """Enough of a PyTorch nn.Module: named parameters that carry their own .grad."""

    def __init__(self, **params):
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


def no_job(monkeypatch):
    for name in job_vars.NAMES:
        monkeypatch.delenv(name, raising=False)


# -- the job's environment -----------------------------------------------------------------------


def test_the_job_is_read_from_the_environment():
    described = job_vars.JobEnv(
        addresses=["127.0.0.1:1", "h:2"],
        rank=1,
        world=3,
        local_rank=1,
        gpu=0,
        token="t",
        metrics="/m.jsonl",
        job_file="/job.toml",
        out="/out",
        seed=7,
    )
    variables = described.to_env()
    assert variables["PSGRID_ADDRESSES"] == "127.0.0.1:1,h:2" and variables["PSGRID_WORLD_SIZE"] == "3"
    assert variables["PSGRID_SEED"] == "7"
    assert "PSGRID_TLS_CA" not in variables  # unset values are left out
    assert job_vars.job_env(variables) == described and described.device == "cuda:0"
    assert job_vars.job_env({}).device == "cpu" and job_vars.job_env({}).addresses == []


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"PSGRID_RANK": "-1"}, "PSGRID_RANK must be an integer >= 0, got '-1'"),
        ({"PSGRID_WORLD_SIZE": "0"}, "PSGRID_WORLD_SIZE must be an integer >= 1"),
        (
            {"PSGRID_RANK": "2", "PSGRID_WORLD_SIZE": "2"},
            r"PSGRID_RANK \(2\) must be less than PSGRID_WORLD_SIZE \(2\)",
        ),
        ({"PSGRID_ADDRESSES": "127.0.0.1"}, "PSGRID_ADDRESSES must be host:port"),
    ],
)
def test_a_wrong_variable_is_named(variables, message):
    with pytest.raises(ValueError, match=message):
        job_vars.job_env(variables)


def test_without_a_job_init_says_how_to_get_one(monkeypatch):
    no_job(monkeypatch)
    with pytest.raises(RuntimeError) as caught:
        init({"w": np.zeros(2, np.float32)})
    assert str(caught.value) == NO_JOB and "psctl launch -- python SCRIPT" in NO_JOB
    monkeypatch.setenv("PSGRID_ADDRESSES", "127.0.0.1:1")
    with pytest.raises(RuntimeError, match="PSGRID_WORLD_SIZE"):  # the job's size is never guessed
        init({"w": np.zeros(2, np.float32)})


@pytest.mark.parametrize(
    "rank, world, message",
    [
        (3, 1, "rank must be in 0..0 for world 1, got 3"),
        (-1, 2, "rank must be in 0..1 for world 2, got -1"),
        ("0", 2, "rank must be in 0..1 for world 2, got '0'"),
        (0, 0, "world must be a positive whole number of workers, got 0"),
    ],
)
def test_a_rank_outside_the_world_is_refused_before_joining(monkeypatch, rank, world, message):
    """A rank past the world trained as a worker the job never counted (seen: rank 3 of world 1 ran)."""
    no_job(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(f"psgrid.init: {message}")):
        init({"w": np.zeros(2, np.float32)}, addresses=["127.0.0.1:1"], rank=rank, world=world)


def test_the_job_file_gives_the_clients_transport_settings(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[train]\nwire_dtype = "bfloat16"\ndeadline_s = 5.0\ntoken = "<redacted>"\nsteps = 3\n')
    assert job_file_settings(str(path)) == {"wire_dtype": "bfloat16", "deadline_s": 5.0}
    assert job_file_settings(None) == {}
    with pytest.raises(RuntimeError, match="cannot read the job file"):
        job_file_settings(str(tmp_path / "missing.toml"))


# -- a session against in-process shards ---------------------------------------------------------


@pytest.mark.timeout(60)
def test_weights_land_in_the_users_arrays_and_gradients_leave_them(cluster, data_plane, no_job_env, tmp_path):
    c = cluster(2, mode="sync", lr=1.0)
    a, b = np.zeros((2, 3), np.float32), np.ones(4)  # b is float64: exchanged as float32
    frozen = np.full(2, 5.0, np.float32)
    metrics = tmp_path / "worker-0.jsonl"
    with init(
        {"a": Foreign(a), "b": b, "c": Immutable(frozen)},
        addresses=c.addresses,
        world=1,
        rank=0,
        metrics=str(metrics),
        **plane_options(data_plane),
    ) as ps:
        assert (ps.rank, ps.world, ps.mode, ps.names) == (0, 1, "sync", ["a", "b", "c"])
        weights = ps.pull()
        np.testing.assert_array_equal(a, 0)
        np.testing.assert_array_equal(weights["b"], 1)
        for step in range(2):
            ps.push(
                {"a": Foreign(np.full((2, 3), step + 1, np.float32)), "b": np.zeros(4), "c": np.ones(2)},
                loss=0.5,
                samples=4,
            )
            ps.pull()
        np.testing.assert_array_equal(a, -3)  # written in place through the DLPack view
        np.testing.assert_array_equal(b, 1)
        np.testing.assert_array_equal(frozen, 5)  # an immutable array is read, never written...
        np.testing.assert_array_equal(ps.params["c"], 3)  # ...its weights are there for the program
        ps.log_eval(test_accuracy=0.75)
        assert ps.last_step["outcome"] == "APPLIED" and ps.steps == 2
    assert c.shard().stats()["members"] == []  # closing left the job
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "step", "step", "eval", "done"]
    step = events[1]
    for key in (
        "time",
        "started",
        "rank",
        "worker",
        "step",
        "clock",
        "loss",
        "staleness",
        "bytes",
        "pull_s",
        "compute_s",
        "delay_s",
        "push_s",
        "samples",
        "outcome",
    ):
        assert key in step, key
    state = JobState()
    state.update(MetricsTail([metrics]).read())
    assert (state.steps, state.total_samples, state.test_accuracy, sorted(state.done)) == (2, 8, 0.75, [0])


@pytest.fixture
def no_job_env(monkeypatch):
    no_job(monkeypatch)


@pytest.mark.timeout(60)
def test_a_module_pushes_its_own_grads(cluster, data_plane, no_job_env):
    c = cluster(1, mode="sync", lr=0.5)
    weight, bias, frozen = (
        TorchLike(np.ones((2, 2), np.float32)),
        TorchLike(np.zeros(2, np.float32)),
        TorchLike(np.zeros(1, np.float32)),
    )
    frozen.requires_grad = False  # not trained: stays out of the exchange
    model = Module(weight=weight, bias=bias, frozen=frozen)
    with init(model, addresses=c.addresses, world=1, **plane_options(data_plane)) as ps:
        assert ps.names == ["weight", "bias"] and ps.client.data_planes == [data_plane]
        ps.pull()
        weight.grad = Foreign(np.full((2, 2), 2.0, np.float32))
        bias.grad = None  # took no part in the loss: zeros
        ps.push(loss=0.25)
        ps.pull()
        np.testing.assert_array_equal(weight._array, 0.0)
        np.testing.assert_array_equal(bias._array, 0.0)
        with pytest.raises(ArrayError, match="pass the loss as push"):
            ps.push(0.25)
        with pytest.raises(ArrayError, match=r"no gradient for \['bias'\]"):
            ps.push({"weight": np.zeros((2, 2))})
        with pytest.raises(ArrayError, match="has shape"):
            ps.push([np.zeros(3), np.zeros(2)])
        for loss, said in [("x", "got str"), (np.zeros(3), "got ndarray of shape (3,)"), (1j, "got complex")]:
            with pytest.raises(ArrayError, match=re.escape(f"a number or a one-element array, {said}")):
                ps.push(loss=loss)
        ps.push(loss=np.array([0.5], np.float32))  # a one-element array is a loss
    with pytest.raises(RuntimeError, match="closed"):
        ps.pull()


@pytest.mark.parametrize(
    "params, message",
    [
        ({"i": np.zeros(2, np.int64)}, "'i' is int64: psgrid exchanges floating-point parameters"),
        ({}, "no parameters"),
        ({"x": np.zeros(2, np.float32), "y": Foreign(np.zeros(2, np.float32), (2, 0))}, "on different devices"),
        (np.zeros(3, np.float32), "params must be a PyTorch module, a dict"),
    ],
)
def test_parameters_psgrid_cannot_exchange_are_refused_before_joining(params, message):
    with pytest.raises(ArrayError, match=message):
        init(params, addresses=["127.0.0.1:1"], world=1)


@pytest.mark.timeout(60)
def test_gradients_by_the_keys_init_was_given_are_taken(cluster, data_plane, no_job_env):
    """A dict keyed by numbers: init named its parameters "0" and "1", and push refused the same keys."""
    c = cluster(1, mode="sync", lr=1.0)
    w0, w1 = np.zeros(2, np.float32), np.zeros(3, np.float32)
    with init({0: w0, 1: w1}, addresses=c.addresses, world=1, **plane_options(data_plane)) as ps:
        ps.pull()
        ps.push({0: np.ones(2, np.float32), 1: np.full(3, 2, np.float32)})
        ps.pull()
    np.testing.assert_array_equal(w0, -1.0)
    np.testing.assert_array_equal(w1, -2.0)


@pytest.mark.slow
@pytest.mark.parametrize("data_plane", ["shm"])  # its processes take the client's default plane
@pytest.mark.timeout(90)
def test_two_scripts_started_3_s_apart_average_every_round(cluster, data_plane, tmp_path):
    # Sync with lr 1: worker r pushes r + 1 every step, so a round that averages both moves the weight
    # by -1.5; a round applied with one worker's gradient alone would move it by -1 or -2.
    c = cluster(2, mode="sync", lr=1.0)
    steps = 40
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            PSGRID_ADDRESSES=",".join(c.addresses),
            PSGRID_RANK=str(rank),
            PSGRID_WORLD_SIZE="2",
            PSGRID_METRICS=str(tmp_path / f"worker-{rank}.jsonl"),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(USER_SCRIPT), str(steps)],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
        if rank == 0:
            time.sleep(3.0)
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
        seen = json.loads(out)["seen"]
        assert seen == [-1.5 * k for k in range(steps + 1)], seen
    for i in range(2):
        stats = c.shard(i).stats()
        assert (stats["pushes"], stats["applied_updates"], stats["version"]) == (2 * steps, steps, steps)
        assert stats["dropped_late"] == 0 and stats["members"] == []
    np.testing.assert_array_equal(c.weights(), -1.5 * steps)


def test_the_user_api_is_exported():
    # psgrid.init is the session's init, or a script hosting a shard first (cluster/run/hosted_script.py)
    assert psgrid.init.__wrapped__ is init and psgrid.job_env is job_vars.job_env
    assert not hasattr(psgrid, "DistributedTrainer")
    assert job_vars.TOKEN == __import__("psgrid.cluster.job.credentials", fromlist=["TOKEN_ENV"]).TOKEN_ENV
    assert job_vars.PARENT == __import__("psgrid.cluster.run.procs", fromlist=["PARENT_ENV"]).PARENT_ENV


def test_what_a_caller_of_the_client_needs_is_exported(tmp_path):
    # An address file read, and a push's outcome tested, with nothing but `import psgrid`.
    from psgrid.psserver import protocol

    assert psgrid.Outcome is protocol.Outcome and psgrid.PushResult is protocol.PushResult
    assert {"Outcome", "PushResult", "parse_address_file"} <= set(psgrid.__all__)
    assert psgrid.parse_address_file(protocol.format_address_file("127.0.0.1:5", "j1")) == ("127.0.0.1:5", "j1")
    assert psgrid.Outcome.APPLIED in psgrid.Outcome


OWN_WORKER = Path(__file__).resolve().parent.parent / "examples" / "own_worker.py"


def test_the_readmes_worker_is_examples_own_worker_verbatim():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("## Your own worker") :]
    block = section[section.index("```python\n") + len("```python\n") : section.index("```\n", 10)]
    code = OWN_WORKER.read_text()
    assert block == code[code.index("import sys") :]
    loop = block[block.index("with psgrid.Client") : block.index("print(")].strip().splitlines()
    assert len(loop) <= 10 and "Thread" not in block


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["shm"])  # the README's worker takes the client's default: shared memory here
def test_the_readmes_worker_pushes_its_gradient_buffer_so_no_push_copies(cluster, data_plane, monkeypatch, capsys):
    # The fast way first: a push of client.gradient_buffer() is read in place by a shard on this host;
    # any other array is copied into it on every push.
    c = cluster(1, mode="async", lr=0.1)
    pushed = []
    real = psgrid.Client.push

    def push(self, grad, **kw):
        pushed.append(any(np.shares_memory(grad, self.gradient_buffer(i)) for i in (0, 1)))
        return real(self, grad, **kw)

    monkeypatch.setattr(psgrid.Client, "push", push)
    monkeypatch.setattr(sys, "argv", [str(OWN_WORKER), ",".join(c.addresses)])
    import runpy

    runpy.run_path(str(OWN_WORKER), run_name="__main__")
    assert len(pushed) == 300 and all(pushed)
    assert float(capsys.readouterr().out.split("loss")[1]) < 1e-3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["shm"])  # its processes take the client's default plane
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_readmes_worker_trains_against_running_shards(cluster, data_plane, mode):
    c = cluster(2, mode=mode, lr=0.1)
    runs = [
        subprocess.Popen(
            [sys.executable, str(OWN_WORKER), ",".join(c.addresses)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=50) for proc in runs]
    for proc, (out, err) in zip(runs, outputs):
        assert proc.returncode == 0, err
        assert float(out.split("loss")[1]) < 1e-3, out
    # two workers joined, pushed and left. In async every push is an update; in sync a round is one
    # update, of both workers where both were there (without world=, one may run rounds alone: on a
    # loaded machine the second process can even start after the first has finished).
    stats = c.shard().stats()
    assert stats["members"] == [] and stats["pushes"] == 600
    if mode == "async":
        assert stats["applied_updates"] == 600
    else:
        assert 300 <= stats["applied_updates"] <= 600 and stats["dropped_late"] == 0
        assert stats["version"] == stats["applied_updates"] == c.shard().policy.closed_rounds


@pytest.mark.timeout(60)
def test_async_pushes_overlap_the_next_pull_and_all_land(cluster, data_plane, no_job_env):
    c = cluster(2, mode="async", lr=1.0)
    w = np.zeros(5, np.float32)
    ps = init([w], addresses=c.addresses, world=1, **plane_options(data_plane))
    assert ps.names == ["0"] and ps._overlap and ps.client.data_planes == [data_plane, data_plane]
    for _ in range(5):
        ps.pull()
        ps.push([np.ones(5, np.float32)])
    ps.close()  # waits for the push in flight before leaving
    np.testing.assert_array_equal(c.weights(), -5.0)
    assert ps.last_step["outcome"] == "APPLIED" and ps.last_step["step"] == 4


# The built-in trainer: its loop, data sets and models, its evaluation and all-reduce baseline (a straggler's
# delay is the worker core's, which a script's session goes through too).
TRAINER = (
    "psgrid.worker.loop",
    "psgrid.worker.data",
    "psgrid.worker.models",
    "psgrid.worker.evaluate",
    "psgrid.worker.allreduce",
)


@pytest.mark.timeout(60)
def test_the_user_api_does_not_import_the_built_in_trainer():
    # A script brings its own model and data: psgrid.init and Session must not load (and pay for) ours.
    code = (
        "import json, sys\n"
        "import psgrid\n"
        "psgrid.init, psgrid.Session\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('psgrid.worker'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    assert "psgrid.worker.api" in loaded
    assert [m for m in loaded if m.startswith(TRAINER)] == []
