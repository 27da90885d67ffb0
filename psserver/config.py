"""Settings of one shard, with validation that names the bad field."""

from __future__ import annotations

from dataclasses import dataclass, fields

from psgrid.psserver.kernels.compensation import ASYNC_MOMENTUM, COMPENSATIONS
from psgrid.psserver.kernels.optim import check_settings
from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import (DATA_PLANES, DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, MODES,
                                      OPTIMIZERS, SHARD_DEVICES)


@dataclass
class ServerConfig:
    """Everything a shard needs to serve; ``psctl server`` flags map one to one onto these."""

    shard_index: int = 0
    num_shards: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    mode: str = "async"
    staleness: int = 2                 # ssp bound s
    backup_workers: int = 0            # sync: close a round when all but this many live workers pushed
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    lr_staleness: bool = False         # the older spelling of staleness_compensation = "lr"
    staleness_compensation: str | None = None   # "none", "lr" or "dc" (None: "lr" if lr_staleness, else "none")
    dc_lambda0: float = 2.0            # dc: lambda before its adaptive scaling (DC-ASGD-a)
    dc_beta: float = 0.95              # dc: decay of the gradients' mean square that scales lambda
    dc_versions: int = 3               # dc: past versions kept to compensate from (a range-sized buffer each)
    async_momentum: str = "off"        # "auto": async/ssp lower momentum by the 1 - 1/W asynchrony adds
    lease_s: float = 10.0
    progress_timeout_s: float = 300.0  # sync/ssp: evict a worker others wait on that has not pushed this long (0: off)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0          # updates between checkpoints (0: never by count)
    checkpoint_every_s: float = 0.0    # seconds between checkpoints (0: never by time)
    checkpoint_keep: int = 3           # complete checkpoints kept on disk (the newest ones)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES     # largest gRPC chunk it sends and takes (RegisterReply.max_chunk_bytes)
    token: str | None = None           # bearer token every request must carry
    job_id: str | None = None          # the job this shard belongs to: a Shutdown must name it (made when not given)
    tls_cert: str | None = None        # server certificate (PEM); enables TLS
    tls_key: str | None = None         # server private key (PEM)
    tls_ca: str | None = None          # CA that client certificates must chain to (mutual TLS)
    metrics_port: int | None = None    # serve Prometheus metrics here (0: any free port)
    threads: int = 128                 # gRPC handler threads; blocked pulls each hold one
    data_plane: str = "tcp"            # "tcp": also serve Pull/Push payloads over plain TCP; "grpc": gRPC only
    shared_memory: bool = True         # offer workers on this host the shared-memory data plane
    apply_threads: int = 0             # threads an update's passes over the range use (0: a quarter of the CPUs, 1..8)
    tcp_max_connections: int = 1024    # data-plane connections at once; past it a new one is refused (clients retry)
    tcp_handshake_s: float = 3.0       # a new data-plane connection must show its token (and TLS) within this
    shard_device: str = "auto"         # "gpu": weights, optimizer state and update on a GPU; "auto": see SHARD_DEVICES
    gpu: int = -1                      # shard_device = "gpu": which of the GPUs this process sees (-1: shard i mod n)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.optimizer not in OPTIMIZERS:
            raise InvalidArgument(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise InvalidArgument(f"shard index {self.shard_index} is outside 0..{self.num_shards - 1}")
        if self.staleness < 0:
            raise InvalidArgument(f"staleness must be >= 0, got {self.staleness}")
        if self.staleness_compensation is not None and self.staleness_compensation not in COMPENSATIONS:
            raise InvalidArgument(f"staleness_compensation must be one of {COMPENSATIONS}, "
                                  f"got {self.staleness_compensation!r}")
        if self.lr_staleness and self.staleness_compensation not in (None, "lr"):
            raise InvalidArgument(f"lr_staleness = true means staleness_compensation = 'lr', but it is "
                                  f"{self.staleness_compensation!r}: keep one of the two (lr_staleness = false)")
        if not 0.0 < self.dc_lambda0 < float("inf"):
            raise InvalidArgument(f"dc_lambda0 must be finite and > 0, got {self.dc_lambda0}")
        if not 0.0 <= self.dc_beta < 1.0:
            raise InvalidArgument(f"dc_beta must be in [0, 1), got {self.dc_beta}")
        if not 1 <= self.dc_versions <= 64:
            raise InvalidArgument(f"dc_versions must be in 1..64, got {self.dc_versions}")
        if self.async_momentum not in ASYNC_MOMENTUM:
            raise InvalidArgument(f"async_momentum must be one of {ASYNC_MOMENTUM}, got {self.async_momentum!r}")
        if self.async_momentum == "auto" and self.optimizer != "sgd":
            raise InvalidArgument(f"async_momentum = 'auto' lowers SGD's momentum; optimizer is {self.optimizer!r}")
        if self.backup_workers < 0:
            raise InvalidArgument(f"backup_workers must be >= 0, got {self.backup_workers}")
        check_settings(self.optimizer_hparams())     # the optimizer's bounds (kernels/optim.py), before anything starts
        if not self.lease_s > 0:
            raise InvalidArgument(f"lease_s must be > 0, got {self.lease_s}")
        if not self.progress_timeout_s >= 0:
            raise InvalidArgument(f"progress_timeout_s must be >= 0 (0 turns it off), got {self.progress_timeout_s}")
        if self.checkpoint_keep < 1:
            raise InvalidArgument(f"checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], "
                                  f"got {self.chunk_bytes}")
        if self.data_plane not in DATA_PLANES:
            raise InvalidArgument(f"data_plane must be one of {DATA_PLANES}, got {self.data_plane!r}")
        if self.apply_threads < 0:
            raise InvalidArgument(f"apply_threads must be >= 0 (0: chosen from the CPUs), got {self.apply_threads}")
        if self.tcp_max_connections < 1:
            raise InvalidArgument(f"tcp_max_connections must be >= 1, got {self.tcp_max_connections}")
        if not 0 < self.tcp_handshake_s <= 3600:
            raise InvalidArgument(f"tcp_handshake_s must be in (0, 3600], got {self.tcp_handshake_s}")
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port must be in 0..65535, got {self.port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("tls_cert and tls_key must be given together")
        if self.shard_device not in SHARD_DEVICES:
            raise InvalidArgument(f"shard_device must be one of {SHARD_DEVICES}, got {self.shard_device!r}")
        if self.gpu < -1:
            raise InvalidArgument(f"gpu must be a GPU's index (0, 1, ...) or -1 (shard i takes GPU i mod n), got {self.gpu}")
        if self.shard_device == "gpu" and self.compensation == "dc":
            raise InvalidArgument("staleness_compensation = 'dc' runs on host shards only: use shard_device = 'cpu', "
                                  "or staleness_compensation = 'lr' or 'none'")

    @property
    def compensation(self) -> str:
        """What the shard does about staleness: one of COMPENSATIONS (``lr_staleness`` read as "lr")."""
        if self.staleness_compensation is not None:
            return self.staleness_compensation
        return "lr" if self.lr_staleness else "none"

    def optimizer_hparams(self) -> dict:
        """The optimizer's settings, as :func:`~psgrid.psserver.kernels.optim.make_optimizer` takes them."""
        return dict(lr=self.lr, momentum=self.momentum, nesterov=self.nesterov, weight_decay=self.weight_decay,
                    beta1=self.beta1, beta2=self.beta2, eps=self.eps)

    def applied_optimizer(self) -> dict:
        """The optimizer and only the settings it uses (Adam has no momentum; SGD no betas)."""
        if self.optimizer == "adam":
            keys = ("lr", "beta1", "beta2", "eps", "weight_decay")
        else:
            keys = ("lr", "momentum", "nesterov", "weight_decay") if self.momentum else ("lr", "weight_decay")
        return {"optimizer": self.optimizer, **{k: getattr(self, k) for k in keys}}

    def describe_optimizer(self) -> str:
        """``sgd (lr 0.05, momentum 0.9)``: the applied settings, those at zero or off left out."""
        applied = self.applied_optimizer()
        name = applied.pop("optimizer")
        said = ", ".join(k if v is True else f"{k} {v:g}" for k, v in applied.items() if v)
        return f"{name} ({said})"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
