"""Your own training script on the shards, in about five added lines (in the manner of Horovod)::

    import psgrid

    ps = psgrid.init(model)              # join the job: its shards, rank and size come from the environment
    for x, y in batches:
        ps.pull()                        # the shards' weights, written into the model's own tensors
        loss = loss_fn(model(x), y)
        model.zero_grad()
        loss.backward()
        ps.push(loss=loss)               # the model's .grads to the shards, whose optimizer applies them
    ps.close()

``model`` is a PyTorch ``nn.Module``, or parameters by name (a dict) or in order (a list) as
NumPy, CuPy or any DLPack arrays (PyTorch or JAX tensors, on the CPU or a GPU). They are never
copied into another framework's memory: each is viewed through DLPack (worker/dlpack.py), the
weights land in it in place and the gradients are read from it. Run the script with
``psctl launch -- python train.py`` or ``mpiexec -n N psctl mpi -- python train.py``, which set
the job's environment (worker/env.py) and show the records this writes (the same step, eval
and done records as the built-in loop, worker/loop.py) as one progress bar and summary.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

import numpy as np

from psgrid.psserver.exceptions import ShardUnavailable
from psgrid.psserver.security import job_token
from psgrid.psserver.spec import ModelSpec
from psgrid.worker import alone, dlpack
from psgrid.worker.backend import to_host
from psgrid.worker.config import TrainConfig
from psgrid.worker.core import CLIENT_SETTINGS, WorkerCore, open_exchange
from psgrid.worker.env import ADDRESSES, WORLD_SIZE, job_env, watch_launcher
from psgrid.worker.model_link import ModelLink
from psgrid.worker.records import MetricsWriter

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# What a script's worker takes from the job file's [train] table beside what its client takes (CLIENT_SETTINGS,
# core.py); the rest of the table, the model, data and schedule, is the built-in trainer's.
WORKER_SETTINGS = (
    "overlap",
    "pull_ahead",
    "stragglers",
    "aggregate",
    "seed",
    "join_timeout_s",
    "deadline_s",
    "retry_s",
    "wire_dtype",
)
WORKER_ONLY = tuple(key for key in WORKER_SETTINGS if key not in CLIENT_SETTINGS)

NO_JOB = (
    f"psgrid.init() found no job: run the script with `psctl launch -- python SCRIPT` (or under "
    f"`psctl mpi -- ...`), or pass addresses=[...] and world=N (or set {ADDRESSES} and {WORLD_SIZE})"
)


def init(
    params,
    *,
    addresses=None,
    rank: int | None = None,
    world: int | None = None,
    metrics: str | None = None,
    job_file: str | None = None,
    **client_options,
) -> Session:
    """Join the job this process belongs to with a model's parameters; returns the :class:`Session`.

    Waits until the job's ``world`` workers have joined every shard (sync and ssp count the
    workers they wait for) and, if the shards have no weights yet, gives them those of the
    worker with the lowest rank (Horovod's ``broadcast_parameters``).

    Parameters
    ----------
    params : nn.Module, dict of arrays or list of arrays
        The model's trainable parameters: a PyTorch module (its parameters that require grad),
        arrays by name, or arrays in order. NumPy, CuPy or DLPack arrays of a float dtype, all
        on the CPU or all on one GPU; exchanged as float32.
    addresses, rank, world, metrics, job_file
        The job, where it is not in the environment (worker/env.py): the shards' ``host:port``
        in shard order, this worker's rank (default: the shards assign one), the job's number
        of workers, the JSON-lines file for the records, the job file whose ``[train]``
        transport settings the client uses.
    **client_options
        Passed to :class:`psgrid.Client` (``token``, ``wire_dtype``, ``deadline_s``, ...), except a
        worker's own settings (``overlap``, ``pull_ahead``, ``stragglers``, ``aggregate``, ``seed``),
        which the session's worker core takes; they override the environment and the job file.

    Raises
    ------
    RuntimeError
        No job: no addresses or no size, neither given nor in the environment.
    """
    env = job_env()
    if alone.wanted():  # psctl bench script's reference run: this script with no servers
        named = named_parameters(params)
        return alone.alone_session(
            params,
            names=[n for n, _ in named],
            originals=[a for _, a in named],
            job_table=job_tables(job_file or env.job_file),
            metrics=metrics or env.metrics,
            device=_one_device([a for _, a in named]),
            local_rank=env.local_rank,
        )
    addresses = list(addresses) if addresses is not None else env.addresses
    world = world if world is not None else env.world
    if not addresses or world is None:
        raise RuntimeError(NO_JOB)
    rank = rank if rank is not None else env.rank
    _check_rank(rank, world)
    table = job_train_table(job_file or env.job_file)
    # A worker's own settings given here win over the job's, as the client's do; the rest go to the client.
    table = {**table, **{key: client_options.pop(key) for key in WORKER_ONLY if key in client_options}}
    settings = {key: table[key] for key in CLIENT_SETTINGS if key in table}
    settings.update(
        {
            key: value
            for key, value in (("tls_ca", env.tls_ca), ("tls_cert", env.tls_cert), ("tls_key", env.tls_key))
            if value
        }
    )
    settings.update(client_options)
    settings["token"] = job_token(settings.get("token"))  # the rule of every entry point: given, else PSGRID_TOKEN
    watch_launcher()
    return Session(
        params,
        addresses=addresses,
        world=world,
        rank=rank,
        metrics=metrics or env.metrics,
        local_rank=env.local_rank,
        gpu=env.gpu,
        train=worker_settings({**table, **{k: v for k, v in settings.items() if k in WORKER_SETTINGS}}),
        host_group=env.host_group,
        **settings,
    )


def _check_rank(rank: int | None, world) -> None:
    """A rank of the job, or None (the shards assign one): a rank past the world trained as a worker nobody counted."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"psgrid.init: world must be a positive whole number of workers, got {world!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world):
        raise ValueError(f"psgrid.init: rank must be in 0..{world - 1} for world {world}, got {rank!r}")


def unreachable(addresses: list[str], settings: Mapping) -> str | None:
    """Why a shard cannot be joined, in one line, within seconds (not after the client's retries); None: all answer.

    The line names the shard, its address and what happened: nothing listens, something that is
    not a psgrid shard answered, a TLS handshake failed and why.
    """
    from types import SimpleNamespace

    from psgrid.psserver.client.reach import probe

    tls = SimpleNamespace(**{key: settings.get(key) for key in ("tls_ca", "tls_cert", "tls_key")})
    for i, address in enumerate(addresses):
        problem = probe(address, tls)
        if problem:
            return f"psgrid.init: shard {i} at {address}: {problem}"
    return None


def job_tables(path: str | None) -> dict:
    """A job file's tables ({} without a file; its token is the environment's, not read from it)."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RuntimeError(f"cannot read the job file {path}: {exc}") from None


def job_train_table(path: str | None) -> dict:
    return job_tables(path).get("train", {})


def job_file_settings(path: str | None) -> dict:
    """The client settings of a job file's ``[train]`` table."""
    table = job_train_table(path)
    return {key: table[key] for key in CLIENT_SETTINGS if key in table}


def worker_settings(table: dict) -> TrainConfig:
    """What a script's worker takes from a job's ``[train]`` table beside the client's settings: overlap,
    pull-ahead, stragglers, aggregation and the seed (the straggler's draws), as the built-in trainer does."""
    train = TrainConfig(**{key: table[key] for key in WORKER_SETTINGS if key in table})
    try:
        train.validate()
    except ValueError as exc:
        raise RuntimeError(f"the job's [train] table: {exc}") from None
    return train


def named_parameters(params) -> list[tuple[str, object]]:
    """``(name, array)`` of a PyTorch module's trainable parameters, a dict's items, or a list's by index."""
    if callable(getattr(params, "named_parameters", None)):
        return [(name, p) for name, p in params.named_parameters() if getattr(p, "requires_grad", True)]
    if isinstance(params, Mapping):
        return [(str(name), a) for name, a in params.items()]
    if isinstance(params, (str, bytes)) or not hasattr(params, "__iter__") or hasattr(params, "__dlpack__"):
        raise dlpack.ArrayError("params must be a PyTorch module, a dict of arrays by name, or a list of arrays")
    return [(str(i), a) for i, a in enumerate(params)]


class Session:
    """One worker's exchange of a model's parameters and gradients with the shards (made by :func:`init`).

    ``pull()`` writes the shards' weights into the parameters, ``push()`` sends their gradients;
    each pull-push pair is one step, recorded with its loss and timings. Around the script's own
    compute everything is the built-in trainer's (worker/core.py): the push of a step overlaps the
    next step in async and ssp, the pull-ahead, the device gradient pushed over CUDA IPC to shards
    on this GPU, a straggler's delay, a host's aggregation, the records. ``params`` holds the
    weights of the last pull as NumPy or CuPy arrays by name (what a JAX user rebuilds from).
    ``rank``, ``world``, ``local_rank``, ``gpu``, ``mode`` and ``steps`` describe the job and
    this worker; ``last_step`` is the record of the latest completed step. ``first_step`` is
    where this worker starts: 0, or on a job resumed from its shards' checkpoints (``psctl launch
    --resume``) the steps it had made, which the shards applied; a script loops
    ``for step in range(ps.first_step, steps)``, so a resumed job makes only the steps that are
    left, and ``steps`` counts on from there.
    """

    def __init__(
        self,
        params,
        *,
        addresses,
        world: int,
        rank: int | None = None,
        metrics: str | None = None,
        local_rank: int = 0,
        gpu: int | None = None,
        train: TrainConfig | None = None,
        host_group: tuple[int, ...] | None = None,
        **client_options,
    ):
        train = train or TrainConfig()
        self.names, self._originals, self._device, views = _float_parameters(params)
        self.world, self.local_rank, self.gpu = world, local_rank, gpu
        self.xp = dlpack.module_of(views[0])
        self.spec = ModelSpec((name, tuple(v.shape)) for name, v in zip(self.names, views))
        self.link = ModelLink(self.names, self._originals, views, self.xp)

        def initial():  # the shards' first weights, where this worker is the one that gives them
            return self.spec.pack({n: to_host(v).astype(np.float32) for n, v in zip(self.names, views)})

        problem = unreachable(addresses, client_options)
        if problem:
            raise ShardUnavailable(problem) from None
        self._metrics = MetricsWriter(metrics)
        self._closed = False
        self._after_close: list = []
        try:
            exchange = open_exchange(
                train,
                addresses,
                self.spec,
                rank=rank,
                world=world,
                init=initial,
                xp=self.xp,
                gpu=self._device,
                local_rank=local_rank,
                options=client_options,
                host_group=_host_group(host_group),
            )
        except BaseException:
            self._metrics.close()
            raise
        self.core = WorkerCore(
            train,
            exchange,
            self.spec,
            rank=rank,
            xp=self.xp,
            metrics=self._metrics,
            device_name=self._device_name(),
            device=self._device,
        )
        try:
            self.core.__enter__()  # joins: the gradient buffers are made on the exchange's terms
        except BaseException:
            self._closed = True
            self._metrics.close()
            raise
        try:
            self.rank = self.core.rank
            self.mode = self.core.mode
            self.final_loss = float("nan")
            self._t0 = time.perf_counter()
            # A resumed job's shards (or a running job's, for a replacement) know this worker's clock: its steps
            # so far. The script loops from there, as the built-in trainer does, and its records keep their numbers.
            self.first_step = self.core.step = max(0, self.core.exchange.clock)
            self.core.start(first_step=self.first_step)
        except BaseException:
            self._closed = True
            self.core.__exit__(None, None, None)
            self._metrics.close()
            raise

    # ----- the exchange ---------------------------------------------------------------------------

    @property
    def client(self):
        """What this worker exchanges through: a :class:`psgrid.Client`, or its host's aggregation."""
        return self.core.exchange

    @property
    def bufs(self):
        return self.core.bufs

    @property
    def params(self) -> dict:
        """The weights of the last pull by name (NumPy or CuPy views of this session's buffer)."""
        return self.core.param_views

    @property
    def clock(self) -> int:
        return self.core.exchange.clock

    @property
    def steps(self) -> int:
        return self.core.step

    @property
    def samples(self) -> int:
        return self.core.samples

    @property
    def last_step(self) -> dict | None:
        return self.core.last_step

    @property
    def _overlap(self) -> bool:
        return self.core.overlap

    def pull(self) -> dict:
        """Wait for the shards' weights (as the mode says), write them into the parameters; returns :attr:`params`."""
        self._check_open()
        self.core.pull(then=self.link.weights_in)
        return self.params

    def push(self, grads=None, *, loss=None, samples: int | None = None) -> None:
        """Send one gradient to the shards; the shards' optimizer applies it as the mode says.

        Parameters
        ----------
        grads : dict or list of arrays, optional
            Gradients by name or in the parameters' order, each of its parameter's shape (any
            float dtype, NumPy, CuPy or DLPack). Default: each parameter's ``.grad`` (PyTorch);
            a parameter whose ``.grad`` is None pushes zeros.
        loss : float or scalar tensor, optional
            The step's loss, for the records and the progress bar.
        samples : int, optional
            The step's batch size, for samples/s in the summary.
        """
        self._check_open()
        _check_loss(loss)
        sources = self._gradients(grads)
        self.link.check(sources)  # before a buffer is taken: a refused push changes nothing
        views = self.core.gradient()
        with self.core.on_device():
            self.link.gradients_out(sources, views)
        record = self.core.push(None if loss is None else dlpack.exportable(loss), samples=samples)
        self.final_loss = record["loss"]

    def log_eval(self, test_accuracy: float | None = None, **values: float) -> None:
        """Record an evaluation (the progress bar and summary.json show the latest ``test_accuracy``)."""
        self._check_open()
        fields = {k: float(v) for k, v in dict(values, test_accuracy=test_accuracy).items() if v is not None}
        self._metrics.write(event="eval", rank=self.rank, step=self.steps, **fields)

    def result(self) -> dict:
        """This worker's totals: the fields of its ``done`` record."""
        return {
            "rank": self.rank,
            "worker": self.core.exchange.worker_id,
            "steps": self.steps - self.first_step,  # made by this session, as the built-in trainer counts them
            "samples": self.samples,
            "wall_s": time.perf_counter() - self._t0,
            "final_loss": self.final_loss,
            "device": self._device_name(),
        }

    # ----- leaving --------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the push in flight, leave the job (sync and ssp stop waiting for this worker), record ``done``."""
        self._close(completed=True)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._close(completed=exc_type is None)

    def after_close(self, action) -> None:
        """Run ``action(ended)`` once this session has closed (``ended``: its last push taken, its ``done`` written)."""
        self._after_close.append(action)

    def _close(self, completed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        ended = False  # whether it ended as asked: its last push taken, its done record written
        try:
            try:
                if completed:
                    self.core.finish()
            finally:
                self.core.__exit__(None, None, None)
            if completed:
                self._metrics.write(event="done", **self.result())
                ended = True
        finally:
            self._metrics.close()
            for action in self._after_close:
                action(ended)

    # ----- helpers --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this psgrid session is closed; call psgrid.init() again to rejoin")

    def _gradients(self, grads) -> list[tuple[str, object]]:
        if grads is None:
            missing = [n for n, a in zip(self.names, self._originals) if not hasattr(a, "grad")]
            if missing:
                raise dlpack.ArrayError(
                    f"push() needs the gradients: push(grads) by name or in the parameters' "
                    f"order ({missing[0]!r} has no .grad of its own)"
                )
            return [(n, a.grad) for n, a in zip(self.names, self._originals)]
        if isinstance(grads, Mapping):
            grads = {str(name): g for name, g in grads.items()}  # named as init named them (a dict's keys as str)
            unknown = sorted(set(grads) - set(self.names))
            missing = [n for n in self.names if n not in grads]
            if unknown or missing:
                raise dlpack.ArrayError(
                    f"push(grads): unknown parameter(s) {unknown}"
                    if unknown
                    else f"push(grads): no gradient for {missing}"
                )
            return [(n, grads[n]) for n in self.names]
        if isinstance(grads, (list, tuple)):
            if len(grads) != len(self.names):
                raise dlpack.ArrayError(f"push(grads): {len(grads)} gradients for {len(self.names)} parameters")
            return list(zip(self.names, grads))
        if np.isscalar(grads) or getattr(grads, "ndim", None) == 0:
            raise dlpack.ArrayError("push(grads): gradients by name or in order; pass the loss as push(loss=...)")
        raise dlpack.ArrayError(f"push(grads): a dict by name or a list in order, got {type(grads).__name__}")

    def _device_name(self) -> str:
        return "cpu" if self._device is None else f"cuda:{self._device}"


def _float_parameters(params) -> tuple[list[str], list, int | None, list]:
    """A model's parameter names, the arrays themselves, the GPU they are on (None: the CPU) and their NumPy
    or CuPy views; refused where there are none, where they are on different devices, or one is not a float."""
    named = named_parameters(params)
    if not named:
        raise dlpack.ArrayError(
            "params holds no parameters (a module whose parameters all have "
            "requires_grad=False, or an empty dict or list)"
        )
    names, originals = [name for name, _ in named], [a for _, a in named]
    device = _one_device(originals)
    views = [dlpack.view(a) for a in originals]
    for name, v in zip(names, views):
        if v.dtype.kind != "f":
            raise dlpack.ArrayError(f"parameter {name!r} is {v.dtype}: psgrid exchanges floating-point parameters")
    return names, originals, device, views


def _check_loss(loss) -> None:
    """A step's loss is a real number or a one-element array or tensor (read once its gradient is complete)."""
    if loss is None:
        return
    shape = getattr(loss, "shape", None)
    if shape is None:
        if not isinstance(loss, (str, bytes)) and _floats(loss):  # float() would also read a number's text
            return
    elif int(np.prod(tuple(shape))) == 1 and getattr(getattr(loss, "dtype", None), "kind", "f") in ("f", "i", "u"):
        return  # a torch dtype has no kind: a tensor is read as a float
    raise dlpack.ArrayError(
        f"push(loss=...): the step's loss must be a number or a one-element array, got {type(loss).__name__}"
        + (f" of shape {tuple(shape)}" if shape is not None else "")
    )


def _floats(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _host_group(values: tuple[int, ...] | None):
    """The HostGroup a launcher put in the environment (psctl mpi), else None: the rank says it."""
    if values is None:
        return None
    from psgrid.worker.aggregate import HostGroup

    return HostGroup(*values)


def _one_device(arrays: list) -> int | None:
    """The GPU every parameter is on (None: all on the CPU); parameters on different devices are refused."""
    devices = {dlpack.device_of(dlpack.exportable(a)) for a in arrays}
    if len(devices) > 1:
        found = ", ".join(sorted(f"{kind}:{index}" for kind, index in devices))
        raise dlpack.ArrayError(
            f"the parameters are on different devices ({found}): psgrid exchanges a model that lives on one device"
        )
    kind, index = devices.pop()
    return index if kind == "cuda" else None
