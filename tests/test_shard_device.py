"""Where a job's shards keep their state (shard_device), decided by the launchers; CPU only.

A GPU is faked where one is needed: ``gpu_unavailable`` monkeypatched, or a stand-in ``cupy`` module
whose runtime reports a number of GPUs and each one's free memory (cudaMemGetInfo).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types

import pytest

from psgrid.cluster.errors import ConfigError
from psgrid.cluster.job.config import JobConfig, apply_overrides
from psgrid.cluster.job.shard_device import mps_note, resolve_shard_device, shards_by_gpu, with_shard_device
from psgrid.cluster.run import preflight

GIB = 1 << 30
MIB = 1 << 20


def job(**settings) -> JobConfig:
    return apply_overrides(JobConfig(name="t"), settings)


def fake_cupy(monkeypatch, free: list[int]):
    """A ``cupy`` whose runtime sees ``len(free)`` GPUs, GPU g with ``free[g]`` bytes free; returns the GPUs asked."""
    current, asked = [0], []

    @contextlib.contextmanager
    def device(index):
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    def mem_get_info():
        asked.append(current[0])
        return free[current[0]], 80 * GIB

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: len(free), memGetInfo=mem_get_info, getDevice=lambda: current[0]
    )
    monkeypatch.setitem(
        sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=device))
    )
    return asked


# ---- the auto rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, gpu_here, expected",
    [
        ("gpu", None, "gpu"),
        ("cpu", None, "cpu"),
        ("auto", None, "gpu"),
        ("auto", "CuPy does not import here", "cpu"),
    ],
)
def test_auto_puts_the_shards_where_the_workers_compute(monkeypatch, device, gpu_here, expected):
    import psgrid.worker.backend as backend

    monkeypatch.setattr(backend, "gpu_unavailable", lambda: gpu_here)
    j = job(device=device)
    assert j.server.shard_device == "auto"
    assert resolve_shard_device(j.server, j.train) == expected
    resolved = with_shard_device(j)
    assert resolved.server.shard_device == expected and j.server.shard_device == "auto"  # the job is not changed


@pytest.mark.parametrize("explicit", ["cpu", "gpu"])
@pytest.mark.parametrize("device", ["cpu", "gpu", "auto"])
def test_an_explicit_shard_device_is_kept(monkeypatch, explicit, device):
    import psgrid.worker.backend as backend

    monkeypatch.setattr(backend, "gpu_unavailable", lambda: "no GPU")
    j = job(device=device, shard_device=explicit)
    assert with_shard_device(j) is j and resolve_shard_device(j.server, j.train) == explicit


def test_auto_keeps_dc_compensation_on_host_shards():
    # dc runs on host shards only: a GPU job with it must not resolve to shards that refuse it.
    j = job(device="gpu", staleness_compensation="dc")
    assert with_shard_device(j).server.shard_device == "cpu"


def test_cpu_workers_never_ask_for_cupy(monkeypatch):
    import psgrid.worker.backend as backend

    monkeypatch.setattr(backend, "gpu_unavailable", lambda: pytest.fail("CuPy probed for CPU workers"))
    assert with_shard_device(job(device="cpu")).server.shard_device == "cpu"


@pytest.mark.parametrize(
    "shard_device, device, gpu_here, said",
    [
        ("gpu", "gpu", None, True),
        ("gpu", "auto", None, True),
        ("gpu", "auto", "no GPU", False),
        ("gpu", "cpu", None, False),
        ("cpu", "gpu", None, False),
    ],
)
def test_the_launcher_names_mps_where_device_shards_share_the_gpu_with_gpu_workers(
    monkeypatch, tmp_path, shard_device, device, gpu_here, said
):
    import psgrid.worker.backend as backend

    monkeypatch.setattr(backend, "gpu_unavailable", lambda: gpu_here)
    j = job(device=device, shard_device=shard_device)
    pipe = tmp_path / "mps-pipe"
    without = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}  # no daemon's pipe there
    note = mps_note(j, without)
    assert (note is not None) == said
    if said:
        assert "--mps" in note and "mps = true" in note and "\n" not in note
        assert mps_note(dataclasses.replace(j, mps=True), without) is None  # the job starts its own: nothing to say
    pipe.mkdir()
    (pipe / "control").touch()  # a control daemon's pipe where CUDA looks: said no more
    assert mps_note(j, without) is None


def test_shard_i_takes_gpu_i_mod_n_unless_the_job_names_one():
    assert shards_by_gpu(range(5), -1, 2) == {0: [0, 2, 4], 1: [1, 3]}
    assert shards_by_gpu([1, 3], -1, 4) == {1: [1], 3: [3]}
    assert shards_by_gpu(range(3), 1, 2) == {1: [0, 1, 2]}


# ---- the preflight check -------------------------------------------------------------------------


def test_device_shards_that_fit_pass_and_free_memory_is_asked_per_gpu_only(monkeypatch):
    asked = fake_cupy(monkeypatch, [8 * GIB, 8 * GIB, 8 * GIB])
    preflight.check_shard_device(job(device="gpu", shards=2, hidden=[4096, 4096]))
    assert sorted(asked) == [0, 1]  # shards 0 and 1 on GPUs 0 and 1; GPU 2 holds none and is not asked


def test_host_shards_never_import_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # an import of it would raise
    preflight.check_shard_device(job(device="cpu"))
    preflight.check_shard_device(job(device="gpu", shard_device="cpu"))


def test_the_shards_on_one_gpu_are_summed_against_its_free_memory(monkeypatch):
    from psgrid.cluster.job.memory import footprint
    from psgrid.psserver.sharding import shard_ranges
    from psgrid.psserver.state.device import shard_device_bytes

    j = job(device="gpu", shards=3, workers=2, hidden=[4096, 4096], momentum=0.9)
    ranges = shard_ranges(footprint(j).params, 3)
    need = [shard_device_bytes(e - b, "sgd", 0.9, 2) for b, e in ranges]
    # Two GPUs: shards 0 and 2 share GPU 0. It has room for either alone, not for both.
    fake_cupy(monkeypatch, [need[0] + need[2] - 64 * MIB, 80 * GIB])
    with pytest.raises(ConfigError) as refused:
        preflight.check_shard_device(j)
    line = str(refused.value)
    assert "\n" not in line
    both = need[0] + need[2]
    assert line.startswith(
        'shard_device = "auto" (GPU workers, so the shards keep their state on a GPU): '
        f"shards 0, 2 need {both / MIB:,.1f} MiB on GPU 0 "
    ), line
    assert f"for a 20,037,642-parameter mlp), and it has {both / MIB - 64:,.1f} MiB free" in line
    assert line.endswith("use fewer workers or a smaller model, or --set shard_device=cpu (host shards)")
    fake_cupy(monkeypatch, [need[0] + need[2], 80 * GIB])
    preflight.check_shard_device(j)  # exactly enough


def test_shard_device_gpu_without_a_gpu_is_refused_in_one_line(monkeypatch):
    import psgrid.psserver.state.device as device

    monkeypatch.setattr(device, "gpu_problem", lambda: "CuPy finds no CUDA GPU: use shard_device = 'cpu'")
    with pytest.raises(ConfigError, match=r"^--shard-device gpu: CuPy finds no CUDA GPU: use shard_device = 'cpu'$"):
        preflight.check_shard_device(job(device="cpu", shard_device="gpu"), {"shard_device": "--shard-device"})


def test_a_named_gpu_the_host_lacks_is_refused(monkeypatch):
    fake_cupy(monkeypatch, [8 * GIB])
    with pytest.raises(ConfigError, match=r"gpu = 2 asked for, but this host has 1 GPU\(s\) \(0..0\); use gpu = -1"):
        preflight.check_shard_device(job(device="gpu", gpu=2))


def test_psctl_launch_refuses_device_shards_that_do_not_fit_before_anything_starts(monkeypatch, tmp_path, capsys):
    from psgrid.cluster import cli
    from psgrid.cluster.run import launch

    fake_cupy(monkeypatch, [64 * MIB])
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("the job started"))
    monkeypatch.chdir(tmp_path)
    code = cli.main(["launch", "--device", "gpu", "--model", "mlp", "--set", "hidden=[4096,4096]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(
        'psctl launch: error: shard_device = "auto" (GPU workers, so the shards keep their '
        "state on a GPU): shards 0, 1 need "
    ), err
    assert not (tmp_path / "runs").exists()


def test_a_launcher_writes_the_resolved_shard_device_into_the_job_it_runs(monkeypatch, tmp_path):
    import psgrid.worker.backend as backend
    from psgrid.cluster.job.config import load_job
    from psgrid.cluster.run.launch import Launcher, prepare_out

    monkeypatch.setattr(backend, "gpu_unavailable", lambda: "no GPU here")
    j = job(device="auto", out=str(tmp_path / "run"))
    launcher = Launcher(j, prepare_out(j), progress=False, quiet=True)
    try:
        assert launcher.job.server.shard_device == "cpu"
        assert load_job(str(tmp_path / "run" / "job.toml"), redacted_ok=True).server.shard_device == "cpu"
    finally:
        launcher.stop_all()
        launcher.jobrun.close()


# ---- psctl bench train --shard-device -----------------------------------------------------------


def test_bench_train_takes_a_shard_device(monkeypatch):
    from psgrid.cluster import cli
    from psgrid.cluster.bench import train

    seen = {}
    monkeypatch.setattr(train, "run", lambda **kw: seen.update(kw))
    assert cli.main(["bench", "train", "--shard-device", "cpu", "--models", "mlp"]) == 0
    assert seen["shard_device"] == "cpu"
    assert cli.main(["bench", "train"]) == 0 and seen["shard_device"] == "auto"
    with pytest.raises(SystemExit):
        cli.build_parser("bench").parse_args(["bench", "train", "--shard-device", "tpu"])


def test_bench_train_names_the_shard_device_and_refuses_a_gpu_it_lacks(monkeypatch, capsys):
    import psgrid.psserver.state.device as device
    from psgrid.cluster import cli
    from psgrid.cluster.bench import train

    assert train.base_job("mlp", "cpu", [32], 32, 5, "gpu").server.shard_device == "gpu"
    monkeypatch.setattr(device, "gpu_problem", lambda: "CuPy finds no CUDA GPU: use shard_device = 'cpu'")
    monkeypatch.setattr(train, "rows", lambda *a, **k: pytest.fail("a configuration ran"))
    assert cli.main(["bench", "train", "--shard-device", "gpu", "--models", "mlp", "--hidden", "32"]) == 2
    assert capsys.readouterr().err.strip() == (
        "psctl bench: error: --shard-device gpu: CuPy finds no CUDA GPU: use shard_device = 'cpu'"
    )


@pytest.mark.parametrize("command", [["launch"], ["compare", "--out", "cmp", "--modes", "sync"]])
def test_shard_device_gpu_from_set_is_named_as_given_and_nothing_starts(monkeypatch, tmp_path, capsys, command):
    import psgrid.psserver.state.device as device
    from psgrid.cluster import cli
    from psgrid.cluster.experiments import compare
    from psgrid.cluster.run import launch

    monkeypatch.setattr(device, "gpu_problem", lambda: "CuPy finds no CUDA GPU: use shard_device = 'cpu'")
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("the job started"))
    monkeypatch.setattr(compare.Compare, "run", lambda self: pytest.fail("the experiment started"))
    monkeypatch.chdir(tmp_path)
    assert cli.main([*command, "--device", "cpu", "--set", "shard_device=gpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"psctl {command[0]}: error: --set shard_device=gpu: CuPy finds no CUDA GPU: use shard_device = 'cpu'"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_local_cluster_refuses_device_shards_without_a_gpu_before_it_starts(monkeypatch, tmp_path):
    import psgrid
    import psgrid.psserver.state.device as device
    from psgrid.cluster.run import local

    monkeypatch.setattr(device, "gpu_problem", lambda: "CuPy finds no CUDA GPU: use shard_device = 'cpu'")
    monkeypatch.setattr(local, "Launcher", lambda *a, **k: pytest.fail("a launcher was made"))
    with pytest.raises(ConfigError, match=r"^shard_device = \"gpu\": CuPy finds no CUDA GPU"):
        psgrid.LocalCluster(shards=1, shard_device="gpu", out=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_an_experiments_job_line_names_where_its_shards_run(monkeypatch):
    import psgrid.worker.backend as backend
    from psgrid.cluster.experiments.settings import job_summary

    monkeypatch.setattr(backend, "gpu_unavailable", lambda: None)
    assert ", 1 GPU shard(s), " in job_summary(job(device="auto", shards=1))
    assert ", 2 CPU shard(s), " in job_summary(job(device="gpu", shards=2, shard_device="cpu"))
