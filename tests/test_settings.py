"""One schema for settings: the checks, psctl's flags and README.md's tables all come from it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from psgrid.cluster.errors import ConfigError
from psgrid.cluster.job.config import SERVER_PER_PROCESS, JobConfig, job_from_dict, load_job, load_shard_settings
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels.optim import BOUNDS, HPARAMS
from psgrid.psserver.settings import at_least, check_fields, keys, plain_type, setting
from psgrid.worker.config import TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CLASSES = {"job": JobConfig, "server": ServerConfig, "train": TrainConfig}


def generator():
    spec = importlib.util.spec_from_file_location("gen_settings_tables", ROOT / "scripts" / "gen_settings_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_rows(section: str) -> dict[str, tuple[str, str]]:
    """``{key: (default cell, meaning cell)}`` of README.md's table of ``section``."""
    text = (ROOT / "README.md").read_text()
    begin = generator().BEGIN.format(section=section)
    table = text[text.index(begin) :].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines():
        found = re.match(r"\| `(\w+)` \| (.*?) \| (.*) \|$", line)
        if found:
            rows[found[1]] = (found[2], found[3])
    return rows


def test_readme_tables_are_what_the_schema_writes():
    gen = generator()
    text = (ROOT / "README.md").read_text()
    assert gen.updated(text) == text, "README.md's settings tables are stale: run python scripts/gen_settings_tables.py"
    # A table edited by hand is written back.
    edited = text.replace("| `lease_s` | `10.0` |", "| `lease_s` | `5.0` |")
    assert edited != text and gen.updated(edited) == text


@pytest.mark.parametrize("section", ["job", "server", "train"])
def test_every_key_is_in_the_readme_with_its_default(section):
    rows = readme_rows(section)
    defaults = CLASSES[section]()
    expected = [k.name for k in keys(CLASSES[section]) if not (section == "server" and k.name in SERVER_PER_PROCESS)]
    assert list(rows) == expected
    for key in keys(CLASSES[section]):
        if key.name not in rows or key.setting.shown is not None:
            continue
        cell = rows[key.name][0]
        if key.default is None:
            assert cell == "none", key.name
        else:  # the cell is the TOML a job file would write: read back, it is the dataclass's default
            assert tomllib.loads(f"v = {cell.strip('`')}")["v"] == getattr(defaults, key.name), key.name
        assert key.setting.doc in rows[key.name][1]


def _flag_actions(argv: list[str]) -> dict[str, argparse.Action]:
    from psgrid.cluster.cli import build_parser

    parser = build_parser().parse_args(argv).parser
    return {a.dest: a for a in parser._actions}  # argparse has no public accessor for its options


def test_psctl_server_has_a_flag_for_every_key_of_the_schema_and_no_other():
    actions = {dest[len("cfg_") :]: a for dest, a in _flag_actions(["server"]).items() if dest.startswith("cfg_")}
    assert list(actions) == [k.name for k in keys(ServerConfig)]
    for key in keys(ServerConfig):
        action = actions[key.name]
        assert key.flag in action.option_strings
        kind = plain_type(key.type)
        if key.setting.choices is not None:
            assert tuple(action.choices) == key.setting.choices, key.name
        elif kind is bool:
            assert isinstance(action, argparse.BooleanOptionalAction), key.name
        else:
            assert action.type is kind, key.name
        assert key.setting.doc.replace("`", "") in action.help, key.name
    assert "--lr-staleness" not in {s for a in actions.values() for s in a.option_strings}


def test_the_job_file_flags_are_typed_and_described_by_the_schema():
    from psgrid.cluster.commands.common import TRAINING_FLAG_KEYS

    actions = {
        dest[len("override_") :]: a
        for dest, a in _flag_actions(["launch"]).items()
        if dest.startswith("override_") and dest[len("override_") :] in TRAINING_FLAG_KEYS
    }
    assert set(actions) == set(TRAINING_FLAG_KEYS)
    schema = {k.name: k for k in keys(ServerConfig)} | {k.name: k for k in keys(TrainConfig)}
    for name, action in actions.items():
        key = schema[name]
        if key.setting.choices is not None:
            assert tuple(action.choices) == key.setting.choices, name
        elif plain_type(key.type) is bool:
            assert isinstance(action, argparse.BooleanOptionalAction), name
        assert key.setting.doc.replace("`", "") in action.help, name


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--threads", "0"], "--threads 0: threads must be >= 1, got 0"),
        (["--beta2", "1.5"], "--beta2 1.5: beta2 must be in [0, 1), got 1.5"),
        (["--checkpoint-every", "-1"], "--checkpoint-every -1: checkpoint_every must be >= 0, got -1"),
    ],
)
def test_a_server_flag_out_of_its_bounds_is_one_line_naming_the_flag(argv, words):
    from psgrid.cluster.cli import build_parser
    from psgrid.cluster.commands.server import server_config_from_args

    with pytest.raises(ConfigError) as err:
        server_config_from_args(build_parser().parse_args(["server", *argv]))
    assert str(err.value) == words


def test_optimizer_bounds_are_kernels_bounds_and_checked_there():
    by_name = {k.name: k for k in keys(ServerConfig)}
    for name in BOUNDS:
        assert by_name[name].setting.bound is BOUNDS[name]  # stated once: the README says the kernels' words
    assert set(BOUNDS) <= set(HPARAMS)
    with pytest.raises(InvalidArgument, match=r"^lr must be finite and > 0, got inf$"):
        ServerConfig(lr=float("inf"))


@dataclasses.dataclass
class _Example:
    size: int = setting(1, "how many", bound=at_least(1))
    colour: str = setting("red", "which", choices=("red", "blue"))


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"size": 0}, "size must be >= 1, got 0"),
        ({"size": "3"}, "size must be >= 1, got '3'"),  # a value of another type: refused, not a TypeError
        ({"colour": "green"}, "colour must be one of ('red', 'blue'), got 'green'"),
    ],
)
def test_check_fields_refuses_in_one_line_naming_the_key(changes, words):
    with pytest.raises(ValueError) as err:
        check_fields(dataclasses.replace(_Example(), **changes), ValueError)
    assert str(err.value) == words
    check_fields(_Example(), ValueError)


def test_a_list_default_is_not_shared_between_instances():
    a, b = TrainConfig(), TrainConfig()
    a.hidden.append(7)
    assert b.hidden == [128] and a.stragglers is not b.stragglers


def test_a_shard_and_a_whole_job_read_a_job_file_the_same_way(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("lr = 0.5\nlr_staleness = true\n[job]\nshards = 3\n[server]\nthreads = 8\nmetrics_port = 9100\n")
    server, shards = load_shard_settings(path)
    job = load_job(path)
    assert shards == job.shards == 3
    assert server == job.server and (server.lr, server.compensation, server.threads) == (0.5, "lr", 8)
    for bad, words in (
        ("[server]\nthreads = 0\n", "[server] threads must be >= 1, got 0"),
        ("[server]\nthreads = 1.5\n", "[server] threads must be an integer, got 1.5"),
        ("[job]\nshards = 0\n", "[job] shards must be >= 1, got 0"),
    ):
        path.write_text(bad)
        for read in (load_shard_settings, load_job):
            with pytest.raises(ConfigError) as err:
                read(path)
            assert str(err.value) == f"{path}: {words}"


def test_job_keys_are_checked_from_the_schema_in_one_line():
    with pytest.raises(ConfigError) as err:
        job_from_dict({"start_timeout_s": 0}, source="f.toml")
    assert str(err.value) == "f.toml: [job] start_timeout_s must be > 0, got 0.0"


def test_settings_saved_by_earlier_releases_are_still_read():
    import json

    # Saved experiments (compare's report is rewritten from them) and job.toml files of earlier releases
    # say lr_staleness = false: the alias is read there, so their folders can be resumed and reported.
    saved = sorted((ROOT / "docs" / "experiments").glob("**/experiment.json"))
    assert saved
    for path in saved:
        job = job_from_dict(json.loads(path.read_text())["job"], source=str(path))
        assert job.server.compensation in ("none", "lr", "dc")
