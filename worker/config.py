"""Settings of one training worker: model, data, batches, schedule, transport and device."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from psgrid.psserver.protocol import DATA_PLANES, DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, WIRE_DTYPES
from psgrid.psserver.settings import at_least, check_fields, setting

DEVICES = ("auto", "cpu", "gpu")
# A time in seconds: a NaN, an infinity or a value <= 0 would fail late, in every worker (a thread's wait, a deadline).
SECONDS = ((lambda v: 0.0 < v < math.inf), "finite and > 0")
SECONDS_OR_NONE = ((lambda v: 0.0 <= v < math.inf), "finite and >= 0")


@dataclass
class TrainConfig:
    """What a worker trains and how it talks to the shards (each key's schema: psserver/settings.py)."""

    model: str = setting("mlp", "`softmax`, `mlp` or `cnn`")
    hidden: list[int] = setting([128], "MLP widths (the cnn uses the first for its dense layer)")
    activation: str = setting("relu", "`relu` or `sigmoid` (MLP)")
    dataset: str = setting(
        "mnist5k",
        "`mnist5k` (5,000 MNIST images), `digits` (the 8x8 UCI digits), both shipped "
        "with psgrid (sources and licences in `worker/datasets/README.md`), or `synthetic` (a "
        "teacher network)",
    )
    synthetic_features: int = setting(784, "features of the synthetic task", bound=at_least(1))
    synthetic_samples: int = setting(
        10000, "training samples of the synthetic task (split among the workers)", bound=at_least(1)
    )
    synthetic_classes: int = setting(10, "classes of the synthetic task", bound=at_least(2))
    synthetic_seed: int = setting(
        0,
        "the synthetic task's own seed (its teacher, training and test samples), apart from `seed`: runs that "
        "vary `seed` (`psctl compare`'s repeats) vary the initialisation and the data's order on one task",
        bound=at_least(0),
    )
    synthetic_test_samples: int = setting(
        2000,
        "held-out samples of the synthetic task; test accuracy's noise from the sample alone is about "
        "sqrt(a(1 - a) / n): 0.011 at accuracy a = 0.5 and 2,000, 0.005 at 10,000",
        bound=at_least(1),
    )
    synthetic_image: list[int] = setting(
        [],
        "`[C, H, W]`: the synthetic samples are smooth images of that shape (a coarse field of about 8 x 8 per "
        "channel plus pixel noise, labelled from the coarse field; features = C·H·W), so the `cnn` trains on them",
    )
    batch_size: int = setting(64, "per worker; 0 means the worker's whole shard of the data", bound=at_least(0))
    steps: int = setting(200, "steps per worker (ignored when `epochs` > 0)", bound=at_least(0))
    epochs: int = setting(0, "passes over each worker's shard of the training set", bound=at_least(0))
    seed: int = setting(
        0, "random seed (data order, initialisation; a synthetic task has `synthetic_seed`)", bound=at_least(0)
    )
    init_scale: float = setting(
        1.0,
        "multiplies the default initialisation (0: every weight starts at zero)",
        bound=((lambda v: 0.0 <= v < math.inf), "finite and >= 0"),
    )
    eval_every: int = setting(
        50, "worker 0 measures test accuracy every this many steps (0: only at the end)", bound=at_least(0)
    )
    device: str = setting("auto", "`auto` (GPU if CuPy finds one), `cpu` or `gpu`", choices=DEVICES)
    chunk_bytes: int = setting(
        DEFAULT_CHUNK_BYTES,
        "largest chunk a worker sends",
        bound=((lambda v: MIN_CHUNK_BYTES <= v <= MAX_CHUNK_BYTES), f"in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]"),
    )
    data_plane: str = setting(
        "tcp",
        "`tcp`: Pull/Push payloads over the shards' TCP data plane (gRPC where a shard has none); `grpc`: gRPC only",
        choices=DATA_PLANES,
    )
    shared_memory: bool = setting(
        True,
        "use the shared-memory data plane of shards on this host, or the CUDA IPC plane of device shards on "
        "this host from a GPU worker (chosen automatically; a shard elsewhere is reached over `data_plane`)",
    )
    overlap: bool | str = setting(
        "auto",
        "async and ssp: the push of step c runs while step c+1 pulls and computes (into a second gradient "
        "buffer), so a step costs about the longest of the three, not their sum; a worker's gradient is then "
        "computed from weights one of its own updates behind (staleness 1 even alone). `false`: each pull waits for "
        'the push before it. `"auto"`: `true`, except for a worker whose every shard is in its own process '
        '(`shard_placement = "worker"` with one shard: the worker hosting it; unless `pull_ahead`): there the push '
        "is the shard's update run in the worker's process, and waiting for it measured faster "
        '(docs/performance.md, "The shard in the worker\'s process")',
        bound=((lambda v: isinstance(v, bool) or v == "auto"), 'true, false or "auto"'),
    )
    pull_ahead: bool = setting(
        False,
        "async and ssp, with `overlap`: the pull of step c+1 runs during step c's compute, into a second "
        "parameter buffer on the device (in host memory on the CPU), so a step costs about the longest of compute + "
        "the gradient's copy, the pull and the push. Its gradient is then computed from weights up to two of the "
        "worker's own updates behind (one more than `overlap` alone), and in ssp the bound the shards keep grows by "
        "one for this worker (its pull for step c+1 is made at clock c). With momentum 0.9 that costs accuracy "
        '(docs/performance.md, "The pull-ahead"). Refused in sync, with `overlap = false` and with '
        '`aggregate = "host"`',
        bound=((lambda v: isinstance(v, bool)), "true or false"),
    )
    wire_dtype: str = setting(
        "float32",
        "gradients on the wire as `float32`, `float16` or `bfloat16` (half the "
        "bytes; bfloat16 keeps float32's range and converts about 3x faster on the CPU than "
        "float16, whose finite values past ±65504 saturate)",
        choices=tuple(WIRE_DTYPES),
    )
    deadline_s: float = setting(60.0, "per-call deadline (a consistency wait counts against it)", bound=SECONDS)
    retry_s: float = setting(
        30.0, "retry an unavailable shard with backoff for this long (0: one try)", bound=SECONDS_OR_NONE
    )
    heartbeat_s: float = setting(
        1.0, "heartbeat interval (0: a quarter of the shards' lease, at most 1 s)", bound=SECONDS_OR_NONE
    )
    join_timeout_s: float = setting(
        120.0,
        "before step 0, wait this long for every worker of the job to register (sync and ssp count who is there)",
        bound=SECONDS,
    )
    token: str | None = setting(None, "bearer token (defaults to the servers')")
    tls_ca: str | None = setting(None, "CA that the shards' certificates chain to")
    tls_cert: str | None = setting(None, "the worker's client certificate (mutual TLS, with `tls_key`)")
    tls_key: str | None = setting(None, "the worker's client key")
    stragglers: list[str] = setting(
        [],
        'slow workers for experiments: `"K:F"` makes worker K F times slower than its own compute (it sleeps '
        '(F-1) x each step\'s compute time), `"K:exp:MEAN_MS"` adds a random delay per step, exponential with mean '
        "MEAN_MS ms; recorded per step as `delay_s`",
        cli="(comma-separated, e.g. 3:3,1:exp:20)",
    )
    aggregate: str = setting(
        "none",
        '`"host"`: the workers of one host (consecutive ranks, `LOCAL_SIZE` of them, or all of a `psctl '
        "launch` job) sum their gradients in shared memory and local rank 0 pulls for all and pushes their mean as "
        "one update: a host's link carries one pull and one push per step instead of one per worker. Sync ends on "
        'the same weights; in async and ssp the shards count a host as one worker (docs/architecture.md, "Per-host '
        "aggregation\"). A dead follower's gradient is left out of its host's mean; a dead leader's followers push "
        "on their own",
        choices=("none", "host"),
    )

    def validate(self) -> None:
        """Refuse, in one line naming the key, what the schema or a rule joining two keys forbids."""
        check_fields(self, ValueError)
        if self.pull_ahead and self.overlap is False:
            raise ValueError(
                "pull_ahead = true needs overlap = true: the pull of step c+1 then runs beside step c "
                "and its push, which overlap = false waits for"
            )
        if self.pull_ahead and self.aggregate == "host":
            raise ValueError(
                'pull_ahead = true does not apply with aggregate = "host": the host\'s leader pulls for '
                "its workers step by step"
            )
        if self.synthetic_image and (len(self.synthetic_image) != 3 or min(self.synthetic_image) < 1):
            raise ValueError(f"synthetic_image must be [C, H, W] of positive sizes, got {self.synthetic_image}")
        if self.model == "cnn" and self.dataset == "synthetic" and self.synthetic_image:
            from psgrid.worker.models.cnn import MIN_SIDE

            c, h, w = self.synthetic_image
            if min(h, w) < MIN_SIDE:
                raise ValueError(
                    f"synthetic_image {self.synthetic_image} is too small for the cnn, which pools twice by 2: give "
                    f"H and W of {MIN_SIDE} or more (e.g. [{c}, 8, 8]), or choose model mlp"
                )
        from psgrid.worker.straggler import parse_stragglers

        try:
            parse_stragglers(self.stragglers)
        except ValueError as e:
            raise ValueError(f"stragglers: {e}") from None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
