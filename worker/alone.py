"""A script trained alone, with no servers: the reference ``psctl bench script`` measures psgrid against.

With ``PSGRID_ALONE=1`` in its environment (``psctl bench script`` sets it), :func:`psgrid.init`
returns an :class:`AloneSession` instead of joining a job: the same script, loop, model and data,
its parameters updated in place where they live by plain SGD at the job's ``lr`` and ``momentum``
(``torch.optim.SGD`` for a PyTorch module, as its own script would; ``p -= lr * g`` through the
arrays' NumPy or CuPy views otherwise), and the same step records as a session on the shards. The
ratio of the two runs' samples/s is what the parameter server costs that script.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from psgrid.worker import dlpack
from psgrid.worker.records import MetricsWriter

ALONE = "PSGRID_ALONE"


def wanted() -> bool:
    return os.environ.get(ALONE, "") == "1"


class AloneSession:
    """:class:`~psgrid.worker.api.Session`'s surface over a model trained where it lives, with no shards."""

    mode = "alone"
    first_step = 0  # nothing to resume: the script makes all its steps

    def __init__(
        self,
        params,
        *,
        names: list[str],
        originals: list,
        lr: float,
        momentum: float,
        metrics: str | None,
        device: int | None,
        local_rank: int = 0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        self.names, self._originals = names, originals
        self.rank, self.world, self.local_rank, self.gpu = 0, 1, local_rank, device
        self.steps, self.samples, self.final_loss, self.last_step = 0, 0, float("nan"), None
        self.clock = 0
        self._views = [dlpack.view(a) for a in originals]
        self.xp = dlpack.module_of(self._views[0])
        self.lr, self.momentum, self.weight_decay, self.nesterov = lr, momentum, weight_decay, nesterov
        self._optimizer = None
        self._torch = None
        if callable(getattr(params, "parameters", None)):
            import torch

            self._torch = torch
            self._optimizer = torch.optim.SGD(
                originals, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov
            )
        self._velocity = None
        self._metrics = MetricsWriter(metrics)
        self._device_name = "cpu" if device is None else f"cuda:{device}"
        self._t0 = time.perf_counter()
        self._pulled_at: float | None = None
        self._started: float | None = None
        self._metrics.write(
            event="start",
            rank=0,
            worker=0,
            host=socket.gethostname(),
            device=self._device_name,
            mode=self.mode,
            first_step=0,
            params=sum(int(v.size) for v in self._views),
            data_planes=[],
            stragglers=[],
            pull_ahead=False,
            overlap=False,
        )

    @property
    def params(self) -> dict:
        return dict(zip(self.names, self._views))

    def pull(self) -> dict:
        self._started, self._pulled_at = time.time(), time.perf_counter()
        return self.params

    def push(self, grads=None, *, loss=None, samples: int | None = None) -> None:
        t_push = time.perf_counter()
        if self._optimizer is not None and grads is None:
            self._optimizer.step()
        else:
            self._apply(grads)
        loss_value = float("nan") if loss is None else float(dlpack.exportable(loss))
        self._synchronize()  # the step's work done, as a session's push waits for its gradient
        t_done = time.perf_counter()
        record = dict(
            event="step",
            rank=0,
            worker=0,
            step=self.steps,
            clock=self.steps,
            started=self._started or time.time(),
            loss=loss_value,
            pull_s=0.0,
            compute_s=t_push - (self._pulled_at or t_push),
            delay_s=0.0,
            push_s=t_done - t_push,
            staleness=0,
            outcome="APPLIED",
            bytes=0,
        )
        if samples is not None:
            record["samples"] = int(samples)
            self.samples += int(samples)
        self._metrics.write(**record)
        self.last_step, self.final_loss = record, loss_value
        self.steps += 1
        self.clock = self.steps
        self._pulled_at = self._started = None

    def _synchronize(self) -> None:
        if self.gpu is None:
            return
        if self._torch is not None:
            self._torch.cuda.synchronize(self.gpu)
        else:
            self.xp.cuda.Device(self.gpu).synchronize()

    def _apply(self, grads) -> None:
        """``torch.optim.SGD``'s update, through the parameters' NumPy or CuPy views."""
        if grads is None:
            grads = [a.grad for a in self._originals]
        elif isinstance(grads, dict):
            grads = [grads[n] for n in self.names]
        if self.momentum and self._velocity is None:
            self._velocity = [None] * len(self._views)
        for i, (param, grad) in enumerate(zip(self._views, grads)):
            if grad is None:
                continue
            g = dlpack.view(grad)
            if self.weight_decay:
                g = g + self.weight_decay * param
            if self.momentum:
                if self._velocity[i] is None:  # torch's first step: the buffer is the gradient itself
                    self._velocity[i] = g.copy()
                else:
                    self._velocity[i] *= self.momentum
                    self._velocity[i] += g
                g = g + self.momentum * self._velocity[i] if self.nesterov else self._velocity[i]
            param -= self.lr * g

    def log_eval(self, test_accuracy: float | None = None, **values: float) -> None:
        fields = {k: float(v) for k, v in dict(values, test_accuracy=test_accuracy).items() if v is not None}
        self._metrics.write(event="eval", rank=0, step=self.steps, **fields)

    def result(self) -> dict:
        return {
            "rank": 0,
            "worker": 0,
            "steps": self.steps,
            "samples": self.samples,
            "wall_s": time.perf_counter() - self._t0,
            "final_loss": self.final_loss,
            "device": self._device_name,
        }

    def close(self) -> None:
        if self._metrics.file is not None and not self._metrics.file.closed:
            self._metrics.write(event="done", **self.result())
        self._metrics.close()

    def __enter__(self) -> AloneSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def alone_session(params, *, names, originals, job_table: dict, metrics, device, local_rank) -> AloneSession:
    """The session of a script run alone: the job's ``[server]`` SGD (lr 0.01, no momentum by default).

    Only SGD has a counterpart here; a job of another optimizer is refused in one line, since the
    reference would not train as the shards do.
    """
    server = job_table.get("server", {})
    optimizer = server.get("optimizer", "sgd")
    if optimizer != "sgd":
        raise RuntimeError(
            f"{ALONE}=1 trains alone with SGD, the reference of psctl bench script; the job's "
            f'optimizer is {optimizer!r}: use optimizer = "sgd"'
        )
    lr, momentum = float(server.get("lr", 0.01)), float(server.get("momentum", 0.0))
    if not (np.isfinite(lr) and lr > 0):
        raise RuntimeError(f"{ALONE}=1: the job's lr must be a finite number > 0, got {lr}")
    return AloneSession(
        params,
        names=names,
        originals=originals,
        lr=lr,
        momentum=momentum,
        metrics=metrics,
        device=device,
        local_rank=local_rank,
        weight_decay=float(server.get("weight_decay", 0.0)),
        nesterov=bool(server.get("nesterov", False)),
    )
