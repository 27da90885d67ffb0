"""Settings of one shard: each key once (psserver/settings.py), with the rules that join two keys."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels.compensation import ASYNC_MOMENTUM, COMPENSATIONS, effective_momentum
from psgrid.psserver.kernels.optim import BOUNDS, HPARAMS, check_settings
from psgrid.psserver.kernels.schedule import LR_SCHEDULES, LrSchedule
from psgrid.psserver.protocol import (
    DATA_PLANES,
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    MODES,
    OPTIMIZERS,
    SHARD_DEVICES,
    mode_rules,
)
from psgrid.psserver.settings import above, at_least, between, check_fields, setting

# Keys that the optimizer's own check covers (kernels/optim.py check_settings, also run by a shard's Init).
OPTIMIZER_KEYS = HPARAMS


@dataclass
class ServerConfig:
    """Everything a shard needs to serve; ``psctl server`` flags map one to one onto these (psserver/settings.py)."""

    shard_index: int = setting(0, "index I of this shard, 0..S-1", flag="--shard")
    num_shards: int = setting(1, "number of shards S", bound=at_least(1), cli="([job] shards of --config when given)")
    host: str = setting(
        "127.0.0.1",
        "address `psctl server` binds (launch binds loopback; mpi: see `--host`/`--iface`)",
        cli="(0.0.0.0 for every interface)",
    )
    port: int = setting(0, "port to bind; 0 picks a free one", bound=between(0, 65535), cli="(see --address-file)")
    mode: str = setting("async", "`sync`, `async` or `ssp` (see the modes)", choices=MODES)
    staleness: int = setting(2, "ssp bound s", bound=at_least(0))
    backup_workers: int = setting(
        0, "sync: close a round when all but this many live workers pushed (must be < workers)", bound=at_least(0)
    )
    optimizer: str = setting("sgd", "`sgd` or `adam`, applied on the shards", choices=OPTIMIZERS)
    lr: float = setting(0.01, "learning rate", bound=BOUNDS["lr"])
    momentum: float = setting(0.0, "SGD momentum", bound=BOUNDS["momentum"])
    nesterov: bool = setting(False, "Nesterov momentum (needs momentum > 0)")
    weight_decay: float = setting(0.0, "L2 weight decay", bound=BOUNDS["weight_decay"])
    beta1: float = setting(0.9, "Adam's decay of the gradients' mean", bound=BOUNDS["beta1"])
    beta2: float = setting(0.999, "Adam's decay of the gradients' mean square", bound=BOUNDS["beta2"])
    eps: float = setting(1e-8, "Adam's term added to the root mean square", bound=BOUNDS["eps"])
    staleness_compensation: str = setting(
        "none",
        "async and ssp: what a stale update gets: `none`; `lr`, the step scaled by 1/max(1, staleness); "
        "`dc`, delay-compensated ASGD (Zheng et al. 2017): g + lambda * g * g * (w_now - w_pulled), w_pulled read "
        "from the versions the shard still holds (else uncompensated, counted in `uncompensated_updates`)",
        choices=COMPENSATIONS,
    )
    dc_lambda0: float = setting(
        2.0,
        "`dc`: lambda = dc_lambda0 / sqrt(mean square of the gradients, decaying by dc_beta), elementwise (DC-ASGD-a)",
        bound=((lambda v: 0.0 < v < math.inf), "finite and > 0"),
    )
    dc_beta: float = setting(
        0.95,
        "`dc`: decay of the gradients' mean square that scales lambda",
        bound=((lambda v: 0.0 <= v < 1.0), "in [0, 1)"),
    )
    dc_versions: int = setting(
        3,
        "`dc`: past versions each shard keeps to compensate a stale push from (a copy of its range each)",
        bound=between(1, 64),
    )
    async_momentum: str = setting(
        "off",
        "async and ssp: `auto` applies max(0, momentum - (1 - 1/W)), W the live workers, as W "
        "asynchronous workers add about 1 - 1/W of momentum themselves (Mitliagkas et al. 2016); Adam's beta1 "
        "is lowered the same way; the shard stats' `momentum` says what it applied. `psctl launch`, `psctl mpi`, `psctl compare` and LocalCluster run async "
        "and ssp with `auto` where the optimizer has momentum, unless the job file or the command line says this key",
        choices=ASYNC_MOMENTUM,
    )
    lr_schedule: str = setting(
        "constant",
        "the rate over the job's updates: `constant`, or decayed to 0 at `lr_updates`: `linear` or `cosine` "
        "(the shards keep it: a script's own scheduler cannot reach their optimizer)",
        choices=LR_SCHEDULES,
    )
    lr_warmup: float = setting(
        0.0,
        "share of `lr_updates` over which the rate rises linearly to `lr` first (0: none)",
        bound=((lambda v: 0.0 <= v < 1.0), "in [0, 1)"),
    )
    lr_updates: int = setting(
        0,
        "the schedule's length in the shard's updates; 0: psctl derives it from the job "
        "([train] steps in sync, workers x steps in async and ssp)",
        bound=at_least(0),
    )
    lease_s: float = setting(10.0, "drop a worker that has not heart-beaten for this long", bound=above(0))
    progress_timeout_s: float = setting(
        300.0,
        "sync and ssp: drop a worker the others wait on that has not pushed "
        "for this long, though its heartbeat lives; 0: never",
        bound=at_least(0),
    )
    checkpoint_dir: str | None = setting(
        None, "checkpoint weights, optimizer state and clocks here; restore the latest on start"
    )
    checkpoint_every: int = setting(0, "checkpoint every this many updates (0: never by count)", bound=at_least(0))
    checkpoint_every_s: float = setting(0.0, "checkpoint every this many seconds (0: never by time)", bound=at_least(0))
    checkpoint_keep: int = setting(3, "complete checkpoints kept (the newest)", bound=at_least(1))
    chunk_bytes: int = setting(
        DEFAULT_CHUNK_BYTES,
        "largest chunk of a streamed range on the wire, sent and taken over gRPC (RegisterReply.max_chunk_bytes)",
        bound=((lambda v: MIN_CHUNK_BYTES <= v <= MAX_CHUNK_BYTES), f"in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]"),
    )
    token: str | None = setting(
        None,
        "bearer token every request must carry (the workers of the job get it too); `psctl launch` and "
        "`psctl mpi` make a random one unless one is given, and never write it where others can read it",
        shown="made per job",
        cli="([server] token of --config, else $PSGRID_TOKEN, which is to be preferred: "
        "command lines are visible to other users)",
    )
    job_id: str | None = setting(
        None,
        "the job a shard belongs to: a Shutdown must name it (printed by the shard and written with its address)",
        shown="made per job",
        cli="(give every shard of one job the same id)",
    )
    tls_cert: str | None = setting(None, "the shard's certificate (PEM); enables TLS (with `tls_key`)")
    tls_key: str | None = setting(None, "the shard's private key (PEM)")
    tls_ca: str | None = setting(None, "require client certificates signed by this CA (mutual TLS)")
    metrics_port: int | None = setting(
        None, "serve Prometheus metrics; shard I uses `metrics_port + I` (0: any free port)", bound=between(0, 65535)
    )
    threads: int = setting(
        128,
        "handler threads per listener: the gRPC server and each data plane the shard "
        "serves (TCP, shared memory, CUDA IPC) has a pool of its own this size, so up to four "
        "pools; a request being served, a blocked pull included, holds a thread of its "
        "listener's pool",
        bound=at_least(1),
    )
    data_plane: str = setting(
        "tcp",
        "`tcp`: also serve Pull/Push payloads over a raw TCP data plane beside gRPC; `grpc`: gRPC only",
        choices=DATA_PLANES,
    )
    shared_memory: bool = setting(
        True,
        "offer workers on this host the shared-memory data plane: they read the weights in place and push "
        "from their own shared memory (off: they use `data_plane`). A device shard (`shard_device`) offers the CUDA "
        "IPC plane instead: GPU workers of this host that reach its GPU copy the weights device to device and push "
        "from their GPU. Where a process may not make shared files (a file-size limit, `ulimit -f`) or every reader "
        "slot is taken, the network plane serves, said in one line",
    )
    apply_threads: int = setting(
        0,
        "threads an update's passes over the shard's range use (the apply, the check "
        "for NaN and infinity); 0: a quarter of the machine's CPUs, 1 to 8",
        bound=at_least(0),
    )
    tcp_max_connections: int = setting(
        1024,
        "authenticated TCP data-plane connections a shard holds at once; past it a new one is refused and "
        "its client retries (idle ones cost no thread; connections still to show the token are bounded apart, see "
        "docs/reliability.md)",
        bound=at_least(1),
    )
    tcp_handshake_s: float = setting(
        3.0,
        "seconds a new TCP data-plane connection has to show the job's token (and finish TLS); then it is closed",
        bound=((lambda v: 0 < v <= 3600), "in (0, 3600]"),
    )
    shard_device: str = setting(
        "auto",
        "where a shard keeps its weights, optimizer state and update: `gpu` on a GPU (workers on the same "
        "host reach it over CUDA IPC), `cpu` in host memory; `auto`: the launcher puts the shards on the host's "
        'GPUs when the job\'s workers compute on a GPU there (`device = "gpu"`, or `"auto"` where CuPy sees one; '
        '`staleness_compensation = "dc"` stays on the host), and `psctl server` alone keeps to the CPU (README: '
        '"Where the shards run")',
        choices=SHARD_DEVICES,
        flag="--device",
    )
    gpu: int = setting(
        -1,
        'with `shard_device = "gpu"`: which of the GPUs the shard\'s process sees',
        bound=((lambda v: v >= -1), "a GPU's index (0, 1, ...) or -1 (shard i takes GPU i mod n)"),
    )

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Refuse, in one line naming the key, what the schema's bounds or a rule joining two keys forbid."""
        check_fields(self, InvalidArgument, leave=OPTIMIZER_KEYS)
        check_settings(self.optimizer_hparams())  # the optimizer's bounds (kernels/optim.py), before anything starts
        if not 0 <= self.shard_index < self.num_shards:
            raise InvalidArgument(f"shard index {self.shard_index} is outside 0..{self.num_shards - 1}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("tls_cert and tls_key must be given together")
        if self.shard_device == "gpu" and self.compensation == "dc":
            raise InvalidArgument(
                "staleness_compensation = 'dc' runs on host shards only: use shard_device = 'cpu', "
                "or staleness_compensation = 'lr' or 'none'"
            )

    def schedule(self) -> LrSchedule:
        """The rate's schedule over this shard's updates; refused (InvalidArgument) where it needs ``lr_updates``."""
        try:
            return LrSchedule(self.lr_schedule, self.lr_updates, self.lr_warmup)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None

    @property
    def momentum_key(self) -> str:
        """The setting that is the optimizer's momentum, which ``async_momentum = "auto"`` lowers: SGD's, Adam's beta1."""
        return "beta1" if self.optimizer == "adam" else "momentum"

    @property
    def compensation(self) -> str:
        """What the shard does about staleness: one of COMPENSATIONS."""
        return self.staleness_compensation

    def optimizer_hparams(self) -> dict:
        """The optimizer's settings, as :func:`~psgrid.psserver.kernels.optim.make_optimizer` takes them."""
        return dict(
            lr=self.lr,
            momentum=self.momentum,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
        )

    def applied_optimizer(self, workers: int | None = None) -> dict:
        """The optimizer and only the settings it uses (Adam has no momentum; SGD no betas).

        Where ``async_momentum = "auto"`` lowers the momentum (:attr:`auto_momentum`), ``async_momentum``
        says so and, given the job's ``workers``, ``{momentum}_applied`` is what the shards apply while
        all of them are live (fewer live, more of it: the shard stats' ``momentum``).
        """
        if self.optimizer == "adam":
            keys = ("lr", "beta1", "beta2", "eps", "weight_decay")
        else:
            keys = ("lr", "momentum", "nesterov", "weight_decay") if self.momentum else ("lr", "weight_decay")
        applied = {"optimizer": self.optimizer, **{k: getattr(self, k) for k in keys}}
        if self.auto_momentum:
            applied["async_momentum"] = "auto"
            if workers:
                applied[f"{self.momentum_key}_applied"] = effective_momentum(getattr(self, self.momentum_key), workers)
        return applied

    @property
    def auto_momentum(self) -> bool:
        """Whether ``async_momentum = "auto"`` lowers the momentum here: a stale mode, an optimizer with momentum."""
        stale = not mode_rules(self.mode).accumulates
        return self.async_momentum == "auto" and stale and getattr(self, self.momentum_key) > 0

    def describe_optimizer(self, workers: int | None = None) -> str:
        """``sgd (lr 0.05, momentum 0.9)``: the applied settings, those at zero or off left out.

        With auto momentum: ``momentum 0.9 less asynchrony's, 0.15 with 4 workers live``.
        """
        applied = self.applied_optimizer(workers)
        name = applied.pop("optimizer")
        auto = applied.pop("async_momentum", None)
        lowered = applied.pop(f"{self.momentum_key}_applied", None)
        parts = []
        for k, v in applied.items():
            if not v:
                continue
            text = k if v is True else f"{k} {v:g}"
            if auto and k == self.momentum_key:
                text += " less asynchrony's" + (
                    f", {lowered:g} with {workers} workers live" if lowered is not None else ""
                )
            parts.append(text)
        return f"{name} ({', '.join(parts)}{self.describe_schedule()})"

    def describe_schedule(self) -> str:
        """``, cosine to 0 over 1000 updates, warm-up 50``: the rate's schedule, empty where it is constant."""
        if not (self.lr_schedule != "constant" or self.lr_warmup):
            return ""
        over = f"over {self.lr_updates} updates" if self.lr_updates else "over the job's updates"
        shape = "constant" if self.lr_schedule == "constant" else f"{self.lr_schedule} to 0"
        warmup = self.schedule().warmup_updates if self.lr_updates else f"{self.lr_warmup:g} of them"
        warm = f", warm-up {warmup}" if self.lr_warmup else ""
        return f", {shape} {over}{warm}"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
