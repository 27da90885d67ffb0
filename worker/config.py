"""Settings of one training worker: model, data, batches, schedule, transport and device."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from psgrid.psserver.protocol import DATA_PLANES, DEFAULT_CHUNK_BYTES, WIRE_DTYPES

DEVICES = ("auto", "cpu", "gpu")


@dataclass
class TrainConfig:
    """What a worker trains and how it talks to the shards."""

    model: str = "mlp"                     # softmax | mlp | cnn
    hidden: list[int] = field(default_factory=lambda: [128])   # MLP widths
    activation: str = "relu"               # relu | sigmoid
    dataset: str = "mnist5k"               # mnist5k | digits | synthetic
    synthetic_features: int = 784
    synthetic_samples: int = 10000
    synthetic_classes: int = 10
    synthetic_image: list[int] = field(default_factory=list)   # [C, H, W]: synthetic samples as images (the cnn)
    batch_size: int = 64                   # per worker; 0 means the worker's whole shard (full batch)
    steps: int = 200                       # steps per worker (ignored when epochs > 0)
    epochs: int = 0                        # passes over the worker's shard
    seed: int = 0
    init_scale: float = 1.0                # multiplies the default initialisation
    eval_every: int = 50                   # evaluate test accuracy every this many steps (rank 0); 0: only at the end
    device: str = "auto"                   # auto | cpu | gpu
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    data_plane: str = "tcp"                # "tcp": Pull/Push payloads over the shards' TCP data plane; "grpc"
    shared_memory: bool = True             # use the shards' shared memory where they run on this host
    overlap: bool | str = "auto"           # async/ssp: a step's push overlaps the next pull and compute (staleness >= 1);
                                           # "auto": except where every shard is in the worker's process (loop.overlaps)
    pull_ahead: bool = False               # async/ssp with overlap: the next step's pull runs during this step's compute
    wire_dtype: str = "float32"            # float32 | float16 | bfloat16 for gradients
    deadline_s: float = 60.0               # per-RPC deadline (a consistency wait counts against it)
    retry_s: float = 30.0                  # retry UNAVAILABLE with backoff for this long
    heartbeat_s: float = 1.0
    join_timeout_s: float = 120.0          # wait this long for all `world` workers to register before step 0
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    stragglers: list[str] = field(default_factory=list)  # e.g. ["3:3"] (worker 3 3x slower), ["1:exp:20"]
    aggregate: str = "none"                # "host": the workers of a host push their mean once (worker/aggregate.py)

    def validate(self) -> None:
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {tuple(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {DATA_PLANES}, got {self.data_plane!r}")
        if self.aggregate not in ("none", "host"):
            raise ValueError(f"aggregate must be 'none' or 'host', got {self.aggregate!r}")
        if not (isinstance(self.overlap, bool) or self.overlap == "auto"):
            raise ValueError(f"overlap must be true, false or \"auto\", got {self.overlap!r}")
        if not isinstance(self.pull_ahead, bool):
            raise ValueError(f"pull_ahead must be true or false, got {self.pull_ahead!r}")
        if self.pull_ahead and self.overlap is False:
            raise ValueError("pull_ahead = true needs overlap = true: the pull of step c+1 then runs beside step c "
                             "and its push, which overlap = false waits for")
        if self.pull_ahead and self.aggregate == "host":
            raise ValueError("pull_ahead = true does not apply with aggregate = \"host\": the host's leader pulls for "
                             "its workers step by step")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.synthetic_image and (len(self.synthetic_image) != 3 or min(self.synthetic_image) < 1):
            raise ValueError(f"synthetic_image must be [C, H, W] of positive sizes, got {self.synthetic_image}")
        for name in ("batch_size", "steps", "epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        from psgrid.worker.straggler import parse_stragglers

        try:
            parse_stragglers(self.stragglers)
        except ValueError as e:
            raise ValueError(f"stragglers: {e}") from None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
