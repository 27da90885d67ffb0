"""Values a job cannot run with are refused while it is read, in one line naming the key: never in a worker later.

Each case here once passed every check and then failed late: a traceback from the model's constructor, a
UnicodeDecodeError, every worker crashing in its random generator, a wait of ``join_timeout_s``, or a job
that said ok with a worker that trained nothing.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from psgrid.cluster.job.config import ConfigError, apply_overrides, job_from_dict, load_job, resolve_config_path

ROOT = Path(__file__).resolve().parent.parent

CNN_ON_IMAGES = {"model": "cnn", "dataset": "synthetic", "synthetic_samples": 256}


def launch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``psctl launch ARGS --out OUT``, expected to be refused before it starts anything."""
    return subprocess.run(
        [sys.executable, "-m", "psgrid.cluster.cli", "launch", *args, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def refused_in_one_line(p: subprocess.CompletedProcess, tmp_path) -> str:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("psctl launch: error: "), p.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
    return lines[0]


# ---------------------------------------------------------------------------------------------
# The cnn's smallest image


@pytest.mark.parametrize("image", [[1, 3, 3], [3, 3, 16], [1, 16, 2], [2, 1, 1]])
def test_a_synthetic_image_too_small_for_the_cnn_is_refused_naming_synthetic_image(image):
    with pytest.raises(ConfigError) as err:
        job_from_dict({"train": {**CNN_ON_IMAGES, "synthetic_image": image}}, source="f.toml")
    message = str(err.value)
    assert message.startswith(f"f.toml: [train] synthetic_image {image} is too small for the cnn"), message
    assert "H and W of 4 or more" in message and "\n" not in message


@pytest.mark.parametrize(
    "train",
    [
        {**CNN_ON_IMAGES, "synthetic_image": [1, 4, 4]},  # the least the cnn takes: 4 x 4 -> 1 x 1 after pooling
        {**CNN_ON_IMAGES, "synthetic_image": [3, 5, 7]},
        {"model": "mlp", "dataset": "synthetic", "synthetic_image": [1, 3, 3]},  # the mlp flattens any image
        {"model": "cnn", "dataset": "digits", "synthetic_image": [1, 3, 3]},  # not the synthetic task: unused
    ],
)
def test_images_the_models_can_take_are_accepted(train):
    job_from_dict({"train": train})


def test_launch_refuses_an_image_too_small_for_the_cnn_in_one_line(tmp_path):
    p = launch(
        tmp_path,
        "--config",
        "synthetic-cnn",
        "--device",
        "cpu",
        "--set",
        "train.synthetic_image=[1,3,3]",
        "--set",
        "batch_size=16",
        "--steps",
        "10",
        "--set",
        "synthetic_samples=256",
    )
    line = refused_in_one_line(p, tmp_path)
    assert line.startswith("psctl launch: error: --set train.synthetic_image=[1,3,3]: "), line
    assert "synthetic_image [1, 3, 3] is too small for the cnn" in line


# ---------------------------------------------------------------------------------------------
# Job files that are not UTF-8 TOML files


def test_a_job_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    path = tmp_path / "j.toml"
    path.write_bytes(b"# r\xe9glages\n[train]\nsteps = 3\n")
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert str(err.value) == f"{path}: not UTF-8 (byte 0xe9 on line 1): a job file must be UTF-8 TOML; save it as UTF-8"


def test_launch_refuses_a_job_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "j.toml"
    path.write_bytes(b"[train]\nsteps = 3\n# r\xe9glages\n")
    line = refused_in_one_line(launch(tmp_path, "--config", str(path)), tmp_path)
    assert line == f"psctl launch: error: {path}: not UTF-8 (byte 0xe9 on line 3): a job file must be UTF-8 TOML; " + (
        "save it as UTF-8"
    )


@pytest.mark.parametrize("spec, what", [("/dev/null", "a character device"), (".", "a directory")])
def test_a_config_that_is_no_file_says_what_it_is(spec, what):
    with pytest.raises(ConfigError) as err:
        resolve_config_path(spec)
    assert str(err.value).startswith(f"job file {spec!r} is {what}, not a file; give a path to a .toml file"), err


def test_a_directory_given_as_config_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        load_job(tmp_path)


def test_a_folder_named_like_an_example_still_leaves_the_example_to_the_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mnist").mkdir()
    assert resolve_config_path("mnist").name == "mnist.toml"


# ---------------------------------------------------------------------------------------------
# [train] numbers


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("seed", -5, "seed must be >= 0, got -5"),
        ("synthetic_seed", -1, "synthetic_seed must be >= 0, got -1"),
        ("init_scale", math.nan, "init_scale must be finite and >= 0, got nan"),
        ("init_scale", math.inf, "init_scale must be finite and >= 0, got inf"),
        ("init_scale", -1.0, "init_scale must be finite and >= 0, got -1.0"),
        ("deadline_s", -5, "deadline_s must be finite and > 0, got -5.0"),
        ("deadline_s", math.nan, "deadline_s must be finite and > 0, got nan"),
        ("deadline_s", 0, "deadline_s must be finite and > 0, got 0.0"),
        ("join_timeout_s", -1, "join_timeout_s must be finite and > 0, got -1.0"),
        ("join_timeout_s", 0, "join_timeout_s must be finite and > 0, got 0.0"),
        ("heartbeat_s", math.inf, "heartbeat_s must be finite and >= 0, got inf"),
        ("heartbeat_s", -1, "heartbeat_s must be finite and >= 0, got -1.0"),
        ("retry_s", -1, "retry_s must be finite and >= 0, got -1.0"),
        ("retry_s", math.inf, "retry_s must be finite and >= 0, got inf"),
        ("eval_every", -1, "eval_every must be >= 0, got -1"),
        ("train.chunk_bytes", 1, "chunk_bytes must be in [4096, 4128768], got 1"),
    ],
)
def test_train_numbers_out_of_bounds_are_refused_naming_the_key(key, value, words):
    for given in ({key: value}, {"train": {key.removeprefix("train."): value}}):
        with pytest.raises(ConfigError) as err:
            job_from_dict(given, source="f.toml")
        assert str(err.value) == f"f.toml: [train] {words}"
    with pytest.raises(ConfigError) as err:
        apply_overrides(job_from_dict({}), {key: value})  # as --set KEY=VALUE gives it
    assert str(err.value).endswith(f"[train] {words}")


@pytest.mark.parametrize(
    "key, value",
    [("seed", 0), ("synthetic_seed", 7), ("init_scale", 0.0), ("init_scale", 0.5), ("eval_every", 0)]
    + [("deadline_s", 0.5), ("join_timeout_s", 1), ("heartbeat_s", 0.1), ("retry_s", 0.3)]
    + [("heartbeat_s", 0), ("retry_s", 0)],  # 0: from the lease; one try
)
def test_sensible_train_numbers_are_accepted(key, value):
    assert getattr(job_from_dict({key: value}).train, key) == value


@pytest.mark.parametrize(
    "assignment, words",
    [
        ("join_timeout_s=-1", "join_timeout_s must be finite and > 0, got -1.0"),
        ("heartbeat_s=inf", "heartbeat_s must be finite and >= 0, got inf"),
        ("train.seed=-5", "seed must be >= 0, got -5"),
    ],
)
def test_launch_refuses_a_train_number_out_of_bounds_in_one_line(tmp_path, assignment, words):
    p = launch(tmp_path, "--config", "mnist", "--steps", "3", "--set", assignment)
    line = refused_in_one_line(p, tmp_path)
    assert line == f"psctl launch: error: --set {assignment}: [train] {words}"


def test_a_job_overridden_again_and_again_says_so_once():
    """Each apply_overrides added one more " (with overrides)" to the job's source, and errors quoted all of them."""
    from psgrid.cluster.job.config import apply_overrides, load_job

    job = load_job("mnist")
    for _ in range(3):
        job = apply_overrides(job, {"lr": 0.1})
    assert job.source.endswith("mnist.toml (with overrides)") and job.source.count("(with overrides)") == 1
