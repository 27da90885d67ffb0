"""Job files: one TOML file describes a whole run (shards, workers, model, data, consistency).

A job file has three optional tables::

    [job]     a JobConfig key (name, shards, workers, out, ...)
    [server]  a ServerConfig key (mode, staleness, optimizer, lr, lease_s, checkpoints, ...)
    [train]   a TrainConfig key (model, dataset, batch_size, steps, eval_every, device, ...)

and one optional table per mode, [sync], [async] and [ssp]: [server] keys that mode runs with
instead (:func:`mode_tables`; applied once the mode is known, cluster/job/mode_defaults.py).

Each key is declared once, with its type, bounds, default and meaning, in its class
(psserver/settings.py says how); a file is read the same way for a whole job
(:func:`load_job`) and for one shard (:func:`load_shard_settings`, which leaves [train] alone).

Any key may also be written at the top level, before the first table, when it is
unambiguous: ``mode = "ssp"`` means ``[server] mode``, ``steps = 300`` means
``[train] steps``.  ``chunk_bytes``, ``data_plane`` and ``token`` at the top level set
both the shards and the workers.  The TLS keys must sit in a table, because a shard's
certificate and a worker's client certificate are different files.  A key given
both at the top level and in a table is an error, so is an unknown key, and so is a
key that was renamed (:data:`RENAMED`): its message names the new one.

Precedence: dataclass defaults < job file < the job file's table of the mode it runs in <
overrides (command-line flags and ``--set key=value``), see :func:`apply_overrides`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import difflib
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from psgrid.cluster.errors import ConfigError
from psgrid.cluster.job.credentials import resolve_token
from psgrid.cluster.job.job_files import EXAMPLES_DIR, example_names, read_job_file, resolve_config_path  # noqa: F401
from psgrid.cluster.job.rate_schedule import schedule_updates
from psgrid.cluster.job.suggestions import with_suggestion
from psgrid.cluster.job.toml_writer import dump_toml
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.protocol import mode_rules
from psgrid.psserver.settings import above, at_least, keys, problem, setting

if typing.TYPE_CHECKING:
    from psgrid.worker.config import TrainConfig

SECTIONS = ("job", "server", "train")
# Tables of [server] keys that one mode runs with (cluster/job/mode_defaults.py applies them).
MODE_TABLES = ("sync", "async", "ssp")
SHARD_SECTIONS = ("job", "server")  # what one shard reads of a job file (load_shard_settings)
SHARD_PLACEMENTS = ("process", "worker")  # where a job's shards run: processes of their own, or in its workers


def _train_config():
    """The workers' settings class, imported only where a job's [train] part is read: a shard never loads it."""
    from psgrid.worker.config import TrainConfig

    return TrainConfig


# Set per process by the launcher or the psctl server flags, never by a job file.
SERVER_PER_PROCESS = ("shard_index", "num_shards", "port")
# Same name, different meaning on the two sides: a shard's certificate is not a worker's.
AMBIGUOUS = ("tls_cert", "tls_key", "tls_ca")
# Same name and meaning on both sides: a top-level value sets both.
SHARED = ("chunk_bytes", "data_plane", "shared_memory", "token")
# Keys of earlier releases, refused wherever they appear (top level or any table) with what replaced them:
# a job file that still says `servers = 2` must fail loudly, not be read as something else.
RENAMED = {
    "servers": "'servers' was renamed: use shards = N (the number of shard processes)",
    "bulk": "'bulk' was replaced: use data_plane = \"tcp\" (the TCP data plane, the old bulk = true) "
    'or data_plane = "grpc" (gRPC only, the old bulk = false)',
    "step_delay_s": "'step_delay_s' was replaced: use stragglers = [\"K:F\"] (worker K F times slower than "
    'its own compute) or ["K:exp:MEAN_MS"] (a random delay per step)',
    "straggler_ranks": '\'straggler_ranks\' was replaced: use stragglers = ["K:F"], e.g. ["3:3"]',
    "lr_staleness": "'lr_staleness' was replaced: use staleness_compensation = \"lr\" (the old lr_staleness = true), "
    "or leave it out (false)",
}
# Still read where a job file of an earlier release says it at the top level or in [server]: every job.toml
# written before it went says `lr_staleness = false`, and `psctl launch --resume` (or compare's report
# rewritten) reads those folders. Anywhere else, and on a command line, it is refused as RENAMED says.
OLD_ALIAS = "lr_staleness"


@dataclass
class JobConfig:
    """A whole job: how many processes, and the settings of every shard and every worker.

    Each key of ``[job]`` is declared once here, with its bounds, default and meaning
    (psserver/settings.py); ``server`` and ``train`` hold the shards' and the workers' settings
    (the shard index, count and port are set per process), and ``source`` names the file the job
    was read from, for error messages.
    """

    name: str = setting(
        "job",
        "names the default output folder `runs/NAME-TIMESTAMP`",
        shown="file name",
        bound=((lambda v: bool(v) and "/" not in v), "a non-empty string without '/'"),
    )
    shards: int = setting(1, "shard processes (S)", bound=at_least(1))
    workers: int = setting(2, "worker processes (W); under `psctl mpi` it is N-1-S", bound=at_least(1))
    out: str | None = setting(
        None,
        "output folder; must not hold an earlier run (the default is a new folder every time)",
        shown="`runs/NAME-TIMESTAMP`",
    )
    overwrite: bool = setting(
        False, "replace an earlier run in `out` (its files only) instead of refusing (`--overwrite`)"
    )
    timeout_s: float = setting(0.0, "stop the job if training takes longer (0: no limit)", bound=at_least(0))
    start_timeout_s: float = setting(60.0, "how long to wait for the shards to publish their addresses", bound=above(0))
    restart_failed: bool = setting(
        False,
        "start a shard that dies again, on its address, from its latest "
        "checkpoint (`--restart-failed`; needs `checkpoint_dir` and an interval)",
    )
    max_restarts: int = setting(3, "restarts allowed per shard before the job fails", bound=at_least(0))
    shard_placement: str = setting(
        "process",
        "`process`: every shard a process of its own, so a worker's death takes nothing of the model "
        "with it; `worker`: shard i in worker i's process, which calls it instead of reaching it over a socket "
        "(GeePS' placement; `--shard-placement worker`; `psctl launch` only, needs workers >= shards; a worker's "
        "death is then its shard's too)",
        choices=SHARD_PLACEMENTS,
    )
    mps: bool = setting(
        False,
        "start a CUDA MPS control daemon for this job alone, unless one serves it already (`--mps`): its device "
        "shards and GPU workers then share one GPU context, so a push and the pull after it no longer move the GPU "
        "between processes and their kernels run side by side (`psctl launch`, compare and bench; needs "
        "`nvidia-cuda-mps-control`)",
    )
    server: ServerConfig = field(default_factory=ServerConfig)
    train: TrainConfig = field(default_factory=lambda: _train_config()())
    source: str | None = field(default=None, compare=False)

    @property
    def mode(self) -> str:
        return self.server.mode

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The job as ``{"job": {...}, "server": {...}, "train": {...}}``, every field, Nones left out."""
        return {
            "job": {k: getattr(self, k) for k in job_keys() if getattr(self, k) is not None},
            "server": {k: getattr(self.server, k) for k in server_keys() if getattr(self.server, k) is not None},
            "train": {k: getattr(self.train, k) for k in train_keys() if getattr(self.train, k) is not None},
        }

    def public_dict(self) -> dict[str, dict[str, Any]]:
        """:meth:`to_dict` fit to be written where others may read it: the token redacted."""
        from psgrid.cluster.job.credentials import redact

        return redact(self.to_dict())

    def to_toml(self) -> str:
        """A job file that :func:`load_job` reads back into an equal JobConfig, but for its token.

        The token is redacted: a process that reads the file takes it from its environment
        (see cluster/job/credentials.py).
        """
        return dump_toml(self.public_dict())

    def server_config(self, shard_index: int, *, host: str | None = None, port: int = 0) -> ServerConfig:
        """The ServerConfig of shard ``shard_index`` of this job."""
        changes: dict[str, Any] = {"shard_index": shard_index, "num_shards": self.shards, "port": port}
        changes["lr_updates"] = schedule_updates(self)
        if host is not None:
            changes["host"] = host
        if self.server.metrics_port:
            # One port per shard, counting up from the configured one (0 stays "any free port").
            changes["metrics_port"] = self.server.metrics_port + shard_index
        try:
            return dataclasses.replace(self.server, **changes)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def default_out(self, now: _dt.datetime | None = None) -> str:
        stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
        return str(Path("runs") / f"{self.name}-{stamp}")


def job_keys() -> list[str]:
    return [k.name for k in keys(JobConfig)]


def server_keys() -> list[str]:
    return [k.name for k in keys(ServerConfig) if k.name not in SERVER_PER_PROCESS]


def train_keys() -> list[str]:
    return [k.name for k in keys(_train_config())]


def _section_keys(section: str) -> list[str]:
    return {"job": job_keys, "server": server_keys, "train": train_keys}[section]()


def route(key: str, sections: tuple[str, ...] = SECTIONS) -> list[tuple[str, str]]:
    """Where a key goes: ``"lr"`` -> ``[("server", "lr")]``; ``"train.steps"`` -> ``[("train", "steps")]``.

    Raises ConfigError naming the valid keys when the key is unknown or ambiguous. With
    ``sections`` lacking "train", a key that is none of the others' is left to the workers
    (routed nowhere) unchecked.
    """
    if "." in key:
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise ConfigError(f"unknown table {section!r} in {key!r}; tables are job, server and train")
        if name in RENAMED:
            raise ConfigError(RENAMED[name])
        if section not in sections:
            return []
        valid = _section_keys(section)
        if name not in valid:
            raise ConfigError(_unknown_message(name, f"[{section}]", valid, per_process=section == "server"))
        return [(section, name)]
    if key in AMBIGUOUS:
        raise ConfigError(
            f"{key} is ambiguous at the top level: put it under [server] (the shard's file) "
            f"or [train] (the worker's file), or write server.{key} / train.{key}"
        )
    if key in RENAMED:
        raise ConfigError(RENAMED[key])
    if key in SHARED:
        return [(s, key) for s in ("server", "train") if s in sections]
    places = [s for s in sections if key in _section_keys(s)]
    if not places and "train" not in sections:
        return []
    if not places:
        valid = sorted(set(job_keys()) | set(server_keys()) | set(train_keys()))
        raise ConfigError(_unknown_message(key, "a job file", valid, per_process=True))
    return [(places[0], key)]


def _unknown_message(key: str, where: str, valid: list[str], per_process: bool) -> str:
    if per_process and key in SERVER_PER_PROCESS:
        return (
            f"{key} cannot be set in {where}: it is set per shard process "
            f"(psctl server --shard/--num-shards/--port; [job] shards for launch and mpi)"
        )
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r} in {where}{hint}; valid keys: {', '.join(sorted(valid))}"


# ---------------------------------------------------------------------------------------------
# Reading


def load_job(spec: str | Path, *, redacted_ok: bool = False) -> JobConfig:
    """Read a job file (or a packaged example by name) into a validated JobConfig.

    A redacted token is taken from the environment (cluster/job/credentials.py); with
    ``redacted_ok`` and none there, the job has no token (its launcher makes a new one).
    """
    path, data = read_job_file(spec)
    job = job_from_dict(data, source=str(path), redacted_ok=redacted_ok)
    if "name" not in data and "name" not in data.get("job", {}):
        job.name = path.stem
    return job


def load_shard_settings(spec: str | Path) -> tuple[ServerConfig, int]:
    """What one shard needs of a job file: its [server] settings and [job] shards.

    Read as :func:`load_job` reads the whole file, but the workers' part ([train] and their
    top-level keys) is theirs to check: a shard never loads the worker package.
    """
    path, data = read_job_file(spec)
    where = str(path)
    mode_tables(data, where)
    typed = _typed(_tables(data, where, SHARD_SECTIONS), where)
    shards = typed["job"].get("shards", JobConfig.shards)
    _check_job_keys({"shards": shards}, where)
    return _server_config(typed["server"], where), shards


def job_from_dict(data: Mapping[str, Any], source: str | None = None, *, redacted_ok: bool = False) -> JobConfig:
    """Build a JobConfig from a parsed job file (tables and top-level keys, see the module doc)."""
    where = source or "job"
    tables = mode_tables(data, where)  # checked with the rest, though applied only once the mode is known
    job = _build(_tables(data, where, SECTIONS), where, redacted_ok=redacted_ok)
    for mode, table in tables.items():  # a mode's rate schedule needs its length as the job's does
        if {"lr_schedule", "lr_warmup", "lr_updates"} & set(table):
            server = dataclasses.replace(job.server, mode=mode, **table)
            _check_job(dataclasses.replace(job, server=server), f"{where} [{mode}]")
    return job


def mode_tables(data: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """A job file's [sync], [async] and [ssp] tables: the [server] settings each mode runs with, typed and checked.

    ``lr = 0.01`` under [async] means: in async, lr 0.01 whatever [server] says (the command line still
    wins). A table cannot change the mode, and takes the shards' keys only.
    """
    tables = {}
    valid = [k for k in server_keys() if k != "mode"]
    for mode in MODE_TABLES:
        table = data.get(mode)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{mode}] must be a table of [server] keys, got {table!r}")
        for name in table:
            if name == "mode":
                raise ConfigError(f"{where}: [{mode}] mode: a mode's table cannot change the mode")
            if name not in valid and name in job_keys() + train_keys():
                raise ConfigError(
                    f"{where}: [{mode}] {name}: a mode's table takes the shards' [server] keys only; set "
                    f"{name} in [{'job' if name in job_keys() else 'train'}] or per run (--set {name}=...)"
                )
            if name not in valid:
                raise ConfigError(
                    _unknown_message(name, f"[{mode}] (a mode's [server] settings)", valid, per_process=True)
                )
        typed = _typed({"server": dict(table)}, f"{where} [{mode}]")["server"]
        for key in keys(ServerConfig):
            if key.name in typed and (reason := problem(key.name, typed[key.name], key.setting)):
                raise ConfigError(with_suggestion(f"{where}: [{mode}] {reason}"))
        tables[mode] = typed
    return tables


def file_choices(spec: str | Path) -> tuple[set[str], dict[str, dict[str, Any]]]:
    """What job file ``spec`` chooses for the shards, in one read: the [server] keys it gives (in [server] or
    at the top level), and its modes' tables (:func:`mode_tables`, checked)."""
    path, data = read_job_file(spec)
    # SHARD_SECTIONS: a shard (psctl server) reads this too, and never loads the workers' settings
    return set(_tables(data, str(path), SHARD_SECTIONS)["server"]), mode_tables(data, str(path))


def _tables(data: Mapping[str, Any], where: str, sections: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The job file's keys sorted into its tables; those of sections not asked for are left out."""
    tables: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    origin: dict[tuple[str, str], str] = {}
    aliased = []
    for key, value in data.items():
        if key in tables and isinstance(value, dict):
            for name, item in value.items():
                if (key, name) == ("server", OLD_ALIAS):
                    aliased.append((item, f"[server] {name}"))
                    continue
                for place in _route_in(where, f"{key}.{name}", sections):
                    _put(tables, origin, place, item, f"[{key}] {name}", where)
        elif key in MODE_TABLES and isinstance(value, dict):
            continue  # a mode's own settings: mode_tables() reads them
        elif isinstance(value, dict):
            raise ConfigError(
                f"{where}: unknown table [{key}]; tables are [job], [server] and [train], and [sync], [async] "
                f"and [ssp] for one mode's own [server] settings"
            )
        elif key == OLD_ALIAS:
            aliased.append((value, f"top-level {key}"))
        else:
            for place in _route_in(where, key, sections):
                _put(tables, origin, place, value, f"top-level {key}", where)
    for value, label in aliased:
        _read_old_alias(tables["server"], value, label, where)
    return tables


def _read_old_alias(server: dict[str, Any], value: Any, label: str, where: str) -> None:
    """``lr_staleness`` of an earlier release's job file: false is no setting, true is staleness_compensation = "lr"."""
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {label} must be true or false, got {value!r} ({RENAMED[OLD_ALIAS]})")
    if not value:
        return
    given = server.setdefault("staleness_compensation", "lr")
    if given != "lr":
        raise ConfigError(
            f"{where}: {label} = true means staleness_compensation = 'lr', but it is {given!r}: keep "
            f"one of the two ({RENAMED[OLD_ALIAS]})"
        )


def _route_in(where: str, key: str, sections: tuple[str, ...] = SECTIONS) -> list[tuple[str, str]]:
    try:
        return route(key, sections)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _put(tables, origin, place, value, label, where):
    if place in origin:
        raise ConfigError(f"{where}: {place[1]} is given twice ({origin[place]} and {label}); keep one")
    origin[place] = label
    tables[place[0]][place[1]] = value


def _build(tables: dict[str, dict[str, Any]], where: str, *, redacted_ok: bool = False) -> JobConfig:
    typed = _typed(tables, where)
    srv, trn = typed["server"], typed["train"]
    server = _server_config(srv, where, redacted_ok=redacted_ok)
    token = resolve_token(trn.pop("token", None), where, redacted_ok=redacted_ok)
    if token:
        trn["token"] = token
    # Workers of this job must carry the shards' token.
    if server.token and "token" not in trn:
        trn["token"] = server.token
    train = _train_config()(**trn)
    try:
        train.validate()
    except ValueError as e:
        raise ConfigError(f"{where}: [train] {with_suggestion(str(e))}") from None
    job = JobConfig(**typed["job"], server=server, train=train, source=where)
    _check_job(job, where)
    return job


def _typed(tables: dict[str, dict[str, Any]], where: str) -> dict[str, dict[str, Any]]:
    """Every value of ``tables`` checked against its key's type in the schema (ints are accepted for floats).

    A table with nothing in it needs no class: a shard, which reads no [train], never loads the worker's.
    """
    typed = {}
    for section, values in tables.items():
        hints = {k.name: k.type for k in keys(_settings_class(section))} if values else {}
        typed[section] = {k: _coerce(where, section, k, v, hints[k]) for k, v in values.items()}
    return typed


def _settings_class(section: str) -> type:
    """The class that declares a table's keys (the workers' imported only when asked for)."""
    return {"job": JobConfig, "server": ServerConfig}.get(section) or _train_config()


def _server_config(srv: dict[str, Any], where: str, *, redacted_ok: bool = False) -> ServerConfig:
    """The shards' settings of a job file's typed [server] table, its token taken where a file redacted it."""
    srv = dict(srv)
    token = resolve_token(srv.pop("token", None), where, redacted_ok=redacted_ok)
    if token:
        srv["token"] = token
    try:
        return ServerConfig(**srv)
    except ValueError as e:
        raise ConfigError(f"{where}: [server] {with_suggestion(str(e))}") from None


def _check_job_keys(values: Mapping[str, Any], where: str) -> None:
    """Raise ConfigError for the first of the [job] ``values`` that its key's schema refuses."""
    for key in keys(JobConfig):
        if key.name in values:
            reason = problem(key.name, values[key.name], key.setting)
            if reason:
                raise ConfigError(with_suggestion(f"{where}: [job] {reason}"))


def _check_job(job: JobConfig, where: str) -> None:
    """The [job] keys' schema, then the rules that join keys of two tables."""
    _check_job_keys({k.name: getattr(job, k.name) for k in keys(JobConfig)}, where)
    if job.restart_failed and not (
        job.server.checkpoint_dir and (job.server.checkpoint_every or job.server.checkpoint_every_s)
    ):
        raise ConfigError(
            f"{where}: [job] restart_failed needs [server] checkpoint_dir and checkpoint_every or "
            f"checkpoint_every_s: a restarted shard starts from its latest checkpoint"
        )
    if job.shard_placement == "worker" and job.workers < job.shards:
        raise ConfigError(
            f'{where}: [job] shard_placement = "worker" puts shard i in worker i\'s process, so it needs '
            f"workers >= shards; got {job.workers} worker(s) for {job.shards} shard(s)"
        )
    if job.train.epochs:
        try:
            schedule_updates(job)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    if mode_rules(job.server.mode).accumulates and job.train.pull_ahead:
        raise ConfigError(
            f"{where}: [train] pull_ahead = true applies to async and ssp only: a sync pull waits for "
            f"the round the push before it closes, so there is nothing to pull ahead"
        )
    if job.train.dataset == "synthetic" and job.train.synthetic_samples < job.workers:
        raise ConfigError(
            f"{where}: [train] synthetic_samples ({job.train.synthetic_samples}) leaves a worker without a "
            f"training sample: the samples are split among the [job] workers ({job.workers}); give at least that many"
        )
    if mode_rules(job.server.mode).accumulates and job.server.backup_workers >= job.workers:
        raise ConfigError(
            f"{where}: [server] backup_workers ({job.server.backup_workers}) must be less than "
            f"[job] workers ({job.workers}): a sync round needs at least one push"
        )


def _coerce(where: str, section: str, key: str, value: Any, hint: Any) -> Any:
    """Check a TOML value against a dataclass field's type; ints are accepted for floats."""

    def bad(expected: str):
        return ConfigError(f"{where}: [{section}] {key} must be {expected}, got {value!r}")

    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return None if value is None else _coerce(where, section, key, value, inner)
    if hint is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if origin is list:
        (item,) = args or (Any,)
        if not isinstance(value, list):
            raise bad(f"a list of {getattr(item, '__name__', 'values')}")
        return [_coerce(where, section, f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    return value


# ---------------------------------------------------------------------------------------------
# Overrides


def apply_overrides(job: JobConfig, overrides: Mapping[str, Any]) -> JobConfig:
    """A new JobConfig with ``overrides`` applied on top of ``job``; ``None`` values are skipped.

    Keys are routed as in a job file: ``"mode"``, ``"lr"``, ``"workers"``, or qualified
    ``"server.lr"``, ``"train.hidden"``, ``"job.out"``.
    """
    tables = job.to_dict()
    for key, value in overrides.items():
        if value is None:
            continue
        for section, name in route(key):
            tables[section][name] = value
    return _build(tables, _overridden(job.source))


def _overridden(source: str | None) -> str:
    """Where a job with overrides came from: said once however many times it was overridden."""
    said = " (with overrides)"
    if source is None:
        return "override"
    return source if source.endswith(said) or source == "override" else source + said


def parse_assignment(text: str) -> tuple[str, Any]:
    """``"train.hidden=[256, 256]"`` -> ``("train.hidden", [256, 256])``; values are TOML, bare words are strings."""
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. --set train.hidden=[256,256]), got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value
