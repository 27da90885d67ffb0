"""Job files: one TOML file describes a whole run (shards, workers, model, data, consistency).

A job file has three optional tables::

    [job]     name, shards, workers, out, overwrite, timeout_s, start_timeout_s, restart_failed, max_restarts,
              shard_placement
    [server]  any ServerConfig field (mode, staleness, optimizer, lr, lease_s, checkpoints, ...)
    [train]   any TrainConfig field (model, dataset, batch_size, steps, eval_every, device, ...)

Any key may also be written at the top level, before the first table, when it is
unambiguous: ``mode = "ssp"`` means ``[server] mode``, ``steps = 300`` means
``[train] steps``.  ``chunk_bytes``, ``data_plane`` and ``token`` at the top level set
both the shards and the workers.  The TLS keys must sit in a table, because a shard's
certificate and a worker's client certificate are different files.  A key given
both at the top level and in a table is an error, so is an unknown key, and so is a
key that was renamed (:data:`RENAMED`): its message names the new one.

Precedence: dataclass defaults < job file < overrides (command-line flags and
``--set key=value``), see :func:`apply_overrides`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import difflib
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from psgrid.cluster.job.credentials import resolve_token
from psgrid.cluster.job.toml_writer import dump_toml
from psgrid.cluster.errors import ConfigError
from psgrid.psserver.config import ServerConfig

if typing.TYPE_CHECKING:
    from psgrid.worker.config import TrainConfig

SECTIONS = ("job", "server", "train")
SHARD_SECTIONS = ("job", "server")     # what one shard reads of a job file (load_shard_settings)
SHARD_PLACEMENTS = ("process", "worker")   # where a job's shards run: processes of their own, or in its workers


def _train_config():
    """The workers' settings class, imported only where a job's [train] part is read: a shard never loads it."""
    from psgrid.worker.config import TrainConfig

    return TrainConfig

# The job files of examples/ (psgrid/examples in the wheel, the repository's examples/ in a checkout).
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"

# Set per process by the launcher or the psctl server flags, never by a job file.
SERVER_PER_PROCESS = ("shard_index", "num_shards", "port", "extra")
# Same name, different meaning on the two sides: a shard's certificate is not a worker's.
AMBIGUOUS = ("tls_cert", "tls_key", "tls_ca")
# Same name and meaning on both sides: a top-level value sets both.
SHARED = ("chunk_bytes", "data_plane", "shared_memory", "token")
# Keys of earlier releases, refused wherever they appear (top level or any table) with what replaced them:
# a job file that still says `servers = 2` must fail loudly, not be read as something else.
RENAMED = {
    "servers": "'servers' was renamed: use shards = N (the number of shard processes)",
    "bulk": "'bulk' was replaced: use data_plane = \"tcp\" (the TCP data plane, the old bulk = true) "
            "or data_plane = \"grpc\" (gRPC only, the old bulk = false)",
    "step_delay_s": "'step_delay_s' was replaced: use stragglers = [\"K:F\"] (worker K F times slower than "
                    "its own compute) or [\"K:exp:MEAN_MS\"] (a random delay per step)",
    "straggler_ranks": "'straggler_ranks' was replaced: use stragglers = [\"K:F\"], e.g. [\"3:3\"]",
}


@dataclass
class JobConfig:
    """A whole job: how many processes, and the settings of every shard and every worker.

    Parameters
    ----------
    name : str
        Used in the default output folder ``runs/<name>-<timestamp>``.
    shards, workers : int
        Number of shard processes and worker processes.
    out : str or None
        Output folder (logs, metrics, summary); None picks a new ``runs/<name>-<timestamp>``
        (``-2``, ``-3``, ... when that is taken).
    overwrite : bool
        Replace an earlier run in ``out`` (its files only) instead of refusing to start.
    timeout_s : float
        Stop the job if training has not finished after this long; 0 means no limit.
    start_timeout_s : float
        How long to wait for the shards to publish their addresses.
    restart_failed : bool
        Start a shard that dies again, on its address, from its latest checkpoint (needs
        ``[server] checkpoint_dir`` and a checkpoint interval).
    max_restarts : int
        How many times each shard may be restarted before the job fails.
    shard_placement : str
        ``"process"``: every shard a process of its own, so a worker's death takes nothing of the
        model with it. ``"worker"``: GeePS' placement, shard i in worker i's own process (``psctl
        launch`` only), which calls it instead of reaching it over a socket; a worker's death then
        takes its shard down (the job ends, or under ``restart_failed`` the shard comes back from its
        checkpoint as a process of its own).
    server, train : ServerConfig, TrainConfig
        Settings shared by every shard (the shard index, count and port are set per
        process) and by every worker.
    source : str or None
        The file this job was read from, for error messages.
    """

    name: str = "job"
    shards: int = 1
    workers: int = 2
    out: str | None = None
    overwrite: bool = False
    timeout_s: float = 0.0
    start_timeout_s: float = 60.0
    restart_failed: bool = False
    max_restarts: int = 3
    shard_placement: str = "process"
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
    return [f.name for f in dataclasses.fields(JobConfig) if f.name not in ("server", "train", "source")]


def server_keys() -> list[str]:
    return [k for k in ServerConfig.field_names() if k not in SERVER_PER_PROCESS]


def train_keys() -> list[str]:
    return list(_train_config().field_names())


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


def with_suggestion(message: str) -> str:
    """A value error with ``(did you mean 'async'?)`` added where the value is close to one of the choices."""
    found = re.search(r"must be one of \(([^)]*)\), got '([^']*)'", message)
    if not found:
        return message
    close = difflib.get_close_matches(found[2], re.findall(r"'([^']*)'", found[1]), n=1)
    return f"{message} (did you mean {close[0]!r}?)" if close else message


def _unknown_message(key: str, where: str, valid: list[str], per_process: bool) -> str:
    if per_process and key in SERVER_PER_PROCESS:
        return (f"{key} cannot be set in {where}: it is set per shard process "
                f"(psctl server --shard/--num-shards/--port; [job] shards for launch and mpi)")
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r} in {where}{hint}; valid keys: {', '.join(sorted(valid))}"


# ---------------------------------------------------------------------------------------------
# Reading


def resolve_config_path(spec: str | Path) -> Path:
    """A job file path, or the name of a packaged example (``mnist`` -> ``examples/mnist.toml``)."""
    path = Path(spec)
    if path.is_file():
        return path
    name = path.name[:-5] if path.name.endswith(".toml") else path.name
    packaged = EXAMPLES_DIR / f"{name}.toml"
    if path.parent == Path(".") or path.parent.name == "examples":
        if packaged.is_file():
            return packaged
    raise ConfigError(
        f"job file {str(spec)!r} not found; give a path to a .toml file or one of the "
        f"packaged examples: {', '.join(example_names())}"
    )


def example_names() -> list[str]:
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.toml"))


def _read(spec: str | Path) -> tuple[Path, dict]:
    path = resolve_config_path(spec)
    try:
        return path, tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None


def load_job(spec: str | Path, *, redacted_ok: bool = False) -> JobConfig:
    """Read a job file (or a packaged example by name) into a validated JobConfig.

    A redacted token is taken from the environment (cluster/job/credentials.py); with
    ``redacted_ok`` and none there, the job has no token (its launcher makes a new one).
    """
    path, data = _read(spec)
    job = job_from_dict(data, source=str(path), redacted_ok=redacted_ok)
    if "name" not in data and "name" not in data.get("job", {}):
        job.name = path.stem
    return job


def load_shard_settings(spec: str | Path) -> tuple[ServerConfig, int]:
    """What one shard needs of a job file: its [server] settings and [job] shards.

    The workers' part ([train] and their top-level keys) is theirs to check: a shard
    never loads the worker package.
    """
    path, data = _read(spec)
    where = str(path)
    tables = _tables(data, where, SHARD_SECTIONS)
    job_hints = typing.get_type_hints(JobConfig, localns={"TrainConfig": object})
    srv = {k: _coerce(where, "server", k, v, typing.get_type_hints(ServerConfig)[k])
           for k, v in tables["server"].items()}
    srv["token"] = resolve_token(srv.get("token"), where)
    shards = _coerce(where, "job", "shards", tables["job"].get("shards", JobConfig.shards), job_hints["shards"])
    if shards < 1:
        raise ConfigError(f"{where}: [job] shards must be >= 1, got {shards}")
    try:
        return ServerConfig(**srv), shards
    except ValueError as e:
        raise ConfigError(f"{where}: [server] {e}") from None


def job_from_dict(data: Mapping[str, Any], source: str | None = None, *, redacted_ok: bool = False) -> JobConfig:
    """Build a JobConfig from a parsed job file (tables and top-level keys, see the module doc)."""
    where = source or "job"
    return _build(_tables(data, where, SECTIONS), where, redacted_ok=redacted_ok)


def _tables(data: Mapping[str, Any], where: str, sections: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The job file's keys sorted into its tables; those of sections not asked for are left out."""
    tables: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    origin: dict[tuple[str, str], str] = {}
    for key, value in data.items():
        if key in tables and isinstance(value, dict):
            for name, item in value.items():
                for place in _route_in(where, f"{key}.{name}", sections):
                    _put(tables, origin, place, item, f"[{key}] {name}", where)
        elif isinstance(value, dict):
            raise ConfigError(f"{where}: unknown table [{key}]; tables are [job], [server] and [train]")
        else:
            for place in _route_in(where, key, sections):
                _put(tables, origin, place, value, f"top-level {key}", where)
    return tables


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
    TrainConfig = _train_config()
    hints = {
        "job": typing.get_type_hints(JobConfig, localns={"TrainConfig": TrainConfig}),
        "server": typing.get_type_hints(ServerConfig),
        "train": typing.get_type_hints(TrainConfig),
    }
    typed = {
        section: {k: _coerce(where, section, k, v, hints[section][k]) for k, v in values.items()}
        for section, values in tables.items()
    }
    srv, trn = typed["server"], typed["train"]
    for table in (srv, trn):
        token = resolve_token(table.pop("token", None), where, redacted_ok=redacted_ok)
        if token:
            table["token"] = token
    # Workers of this job must carry the shards' token.
    if srv.get("token") and "token" not in trn:
        trn["token"] = srv["token"]
    try:
        server = ServerConfig(**srv)
    except ValueError as e:
        raise ConfigError(f"{where}: [server] {with_suggestion(str(e))}") from None
    train = TrainConfig(**trn)
    try:
        train.validate()
    except ValueError as e:
        raise ConfigError(f"{where}: [train] {with_suggestion(str(e))}") from None
    job = JobConfig(**typed["job"], server=server, train=train, source=where)
    _check_job(job, where)
    return job


def _check_job(job: JobConfig, where: str) -> None:
    if job.shards < 1:
        raise ConfigError(f"{where}: [job] shards must be >= 1, got {job.shards}")
    if job.workers < 1:
        raise ConfigError(f"{where}: [job] workers must be >= 1, got {job.workers}")
    if job.timeout_s < 0 or not job.start_timeout_s > 0:
        raise ConfigError(f"{where}: [job] timeout_s must be >= 0 and start_timeout_s > 0")
    if job.restart_failed and not (job.server.checkpoint_dir and (job.server.checkpoint_every
                                                                  or job.server.checkpoint_every_s)):
        raise ConfigError(f"{where}: [job] restart_failed needs [server] checkpoint_dir and checkpoint_every or "
                          f"checkpoint_every_s: a restarted shard starts from its latest checkpoint")
    if job.max_restarts < 0:
        raise ConfigError(f"{where}: [job] max_restarts must be >= 0, got {job.max_restarts}")
    if job.shard_placement not in SHARD_PLACEMENTS:
        raise ConfigError(with_suggestion(f"{where}: [job] shard_placement must be one of "
                                          f"({', '.join(map(repr, SHARD_PLACEMENTS))}), got {job.shard_placement!r}"))
    if job.shard_placement == "worker" and job.workers < job.shards:
        raise ConfigError(f"{where}: [job] shard_placement = \"worker\" puts shard i in worker i's process, so it needs "
                          f"workers >= shards; got {job.workers} worker(s) for {job.shards} shard(s)")
    if not job.name or "/" in job.name:
        raise ConfigError(f"{where}: [job] name must be a non-empty string without '/', got {job.name!r}")
    if job.server.mode == "sync" and job.train.pull_ahead:
        raise ConfigError(f"{where}: [train] pull_ahead = true applies to async and ssp only: a sync pull waits for "
                          f"the round the push before it closes, so there is nothing to pull ahead")
    if job.server.mode == "sync" and job.server.backup_workers >= job.workers:
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
    return _build(tables, "override" if job.source is None else f"{job.source} (with overrides)")


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
