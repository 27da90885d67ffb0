"""Server-side optimizers that update a shard's flat float32 weight range (in place, or into another buffer).

Each optimizer owns the state of one shard's range (momentum, Adam moments) and a few scratch
blocks, so ``step`` is not reentrant: the shard calls it under its update lock.

Why blockwise: ``w -= lr * g`` on whole arrays creates a range-sized temporary and streams it
through memory, once written and once read, for every operator; at 64 MiB that traffic, not the
arithmetic, sets the speed. Walking the range in blocks that stay in cache keeps every temporary
there, so memory sees only one read of the gradient and one read and one write of the weights and
of each state array.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels.compensation import DelayCompensation
from psgrid.psserver.kernels.parallel import SERIAL, Chunks
from psgrid.psserver.protocol import Reason

# Elements per block. 256K float32 = 1 MiB per array, so the up to six blocks one iteration touches
# (weights, gradient, two state, two scratch) stay in L3. Measured on 64 MiB (AMD EPYC, 1 MiB L2,
# 32 MiB L3): L2-sized 32K blocks ran SGD 1.5x slower (8x the ufunc calls, each restarting its
# memory streams), 256K to 1M was flat, and 4M or whole-range blocks fell out of L3 (Adam 1.3-1.7x).
BLOCK = 1 << 18

HPARAMS = ("lr", "momentum", "nesterov", "weight_decay", "beta1", "beta2", "eps")


def _real(name: str, value, ok, expect: str) -> float:
    """Return ``value`` as a float if it is a real number that passes ``ok``, else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(float(value)):
        raise InvalidArgument(f"{name} must be {expect}, got {value!r}")
    return float(value)


def _positive(v: float) -> bool:
    return 0.0 < v < math.inf


def _non_negative(v: float) -> bool:
    return 0.0 <= v < math.inf


def _unit(v: float) -> bool:
    return 0.0 <= v < 1.0


# The bounds of every optimizer setting, stated once. The optimizers hold to them as they are built (at a
# shard's Init) and check_settings before anything starts (the job check, psserver/config.py), so a job
# file, a flag and a shard refuse the same values with the same words.
BOUNDS = {
    "lr": (_positive, "finite and > 0"),
    "momentum": (_unit, "in [0, 1)"),
    "weight_decay": (_non_negative, "finite and >= 0"),
    "beta1": (_unit, "in [0, 1)"),
    "beta2": (_unit, "in [0, 1)"),
    "eps": (_positive, "finite and > 0"),
}


def _hparam(name: str, value) -> float:
    """``value`` of the setting ``name`` as a float, if it is within :data:`BOUNDS`; else raise."""
    return _real(name, value, *BOUNDS[name])


def _nesterov(nesterov, momentum: float) -> bool:
    if not isinstance(nesterov, (bool, np.bool_)):
        raise InvalidArgument(f"nesterov must be a bool, got {nesterov!r}")
    if nesterov and momentum == 0.0:
        raise InvalidArgument("nesterov needs momentum > 0")
    return bool(nesterov)


def check_settings(hparams: Mapping) -> None:
    """Refuse any setting of ``hparams`` (keys of ``HPARAMS``) outside its bounds, whichever optimizer runs.

    A job's every setting is checked, not only those its optimizer uses: ``momentum = 1.5`` with Adam is
    a mistake as much as with SGD, and would be applied the day the optimizer changes.

    Raises
    ------
    InvalidArgument
        Naming the first setting out of bounds, its bounds and its value.
    """
    for name, value in hparams.items():
        if name in BOUNDS:
            _hparam(name, value)
    if "nesterov" in hparams:
        _nesterov(hparams["nesterov"], float(hparams.get("momentum", 0.0)))


class Optimizer:
    """Base of the server-side optimizers: validation, the block loop, step count and state.

    Parameters
    ----------
    size : int
        Number of float32 elements in the shard's range.
    lr : float
        Learning rate, finite and > 0.
    weight_decay : float, optional
        L2 penalty: ``weight_decay * w`` is added to the gradient. Finite and >= 0.

    Attributes
    ----------
    steps : int
        Updates applied so far (Adam's bias correction counts from it).
    """

    def __init__(self, size: int, lr: float, weight_decay: float = 0.0, chunks: Chunks = SERIAL):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise InvalidArgument(f"size must be an integer >= 0, got {size!r}")
        self.size = int(size)
        self.lr = _hparam("lr", lr)
        self.weight_decay = _hparam("weight_decay", weight_decay)
        self.steps = 0
        self._buffers: dict[str, np.ndarray] = {}
        self._block = BLOCK
        self.chunks = chunks  # the range is cut among this many threads (parallel.py)
        self._scratch = [np.empty((2, min(self.size, self._block)), np.float32) for _ in range(chunks.threads)]

    def _buffer(self, name: str) -> np.ndarray:
        """Allocate a zeroed state array that ``state_dict`` saves under ``name``."""
        self._buffers[name] = np.zeros(self.size, np.float32)
        return self._buffers[name]

    def _blocks(self, lo: int, hi: int, index: int):
        """Yield ``(slice, scratch, scratch2)`` per block of ``[lo, hi)``, with thread ``index``'s scratch."""
        t, u = self._scratch[index]
        for start in range(lo, hi, self._block):
            stop = min(start + self._block, hi)
            yield slice(start, stop), t[: stop - start], u[: stop - start]

    def step(
        self,
        weights: np.ndarray,
        grad: np.ndarray,
        lr_scale: float = 1.0,
        *,
        out: np.ndarray | None = None,
        check_finite: bool = False,
        delay: DelayCompensation | None = None,
        pulled: np.ndarray | None = None,
    ) -> None:
        """Apply one update to ``weights``, in place or into ``out``; ``grad`` is only read.

        Parameters
        ----------
        weights, grad : numpy.ndarray
            1-D float32 arrays of length ``size``.
        lr_scale : float, optional
            Multiplies ``lr`` for this step only (the schedule, staleness-aware scaling). Finite and >= 0.
        out : numpy.ndarray, optional
            Where the updated weights go (``weights`` itself by default). A shard writes each
            version into a buffer of its own (weight_ring.py), so readers of the previous one
            never see it change; the traffic is the same as in place.
        check_finite : bool, optional
            Refuse a gradient with NaN or infinity, leaving the state as it was (``out`` may have
            been written). Without state (plain SGD) each block is checked as the update reads it,
            while it is in cache, which costs far less than a pass of its own; otherwise a pass
            over the gradient comes first.
        delay : DelayCompensation, optional
            Correct ``grad`` for the versions between ``pulled`` and ``weights`` (DC-ASGD-a,
            compensation.py) block by block, as the update reads it.
        pulled : numpy.ndarray, optional
            With ``delay``: the weights the gradient was computed from; None when they are no
            longer held (the gradient goes on uncompensated, the mean square still takes it).

        Raises
        ------
        InvalidArgument
            On a wrong shape or dtype or a bad ``lr_scale``; nothing is changed then.
        """
        out = weights if out is None else out
        given = [("weights", weights), ("grad", grad), ("out", out)]
        if pulled is not None:
            given.append(("pulled", pulled))
        for name, a in given:
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (self.size,):
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise InvalidArgument(f"{name} must be float32 of shape ({self.size},), got {got}")
        if not out.flags.writeable:
            raise InvalidArgument(f"{'weights' if out is weights else 'out'} must be writeable")
        # 0 past the end of a decaying schedule (kernels/schedule.py): the state moves on, the weights stay
        scale = _real("lr_scale", lr_scale, lambda v: 0.0 <= v < math.inf, "finite and >= 0")
        fused = check_finite and not self._buffers and delay is None
        if check_finite and not fused and not self.chunks.all_finite(grad):
            raise NON_FINITE()
        lr = self.lr * scale
        blocks = (lambda lo, hi, i: _checked(self._blocks(lo, hi, i), grad)) if fused else self._blocks
        if delay is not None:
            raw, own_blocks = grad, blocks
            blocks = lambda lo, hi, i: delay.blocks(own_blocks(lo, hi, i), raw, weights, pulled)  # noqa: E731
            grad = delay.compensated
        self.steps += 1
        try:
            self.chunks.map(lambda lo, hi, i: self._apply(weights, grad, lr, out, blocks(lo, hi, i)), self.size)
        except InvalidArgument:
            self.steps -= 1  # only a fused check raises here, and no state was changed
            raise

    def _apply(self, w: np.ndarray, g: np.ndarray, lr: float, out: np.ndarray, blocks) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray | float | int]:
        """Return the step count and copies of the state arrays."""
        state: dict[str, np.ndarray | float | int] = {"steps": self.steps}
        state.update((name, a.copy()) for name, a in self._buffers.items())
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Replace the state with ``state``, as returned by ``state_dict``.

        Scalars may come back as 0-d arrays (``numpy.load``); arrays of any float dtype are cast.

        Raises
        ------
        InvalidArgument
            If keys, shapes or values do not fit this optimizer; nothing is changed then.
        """
        steps, arrays = checked_state(type(self).__name__, state, self._buffers, self.size)
        for name, a in arrays.items():
            np.copyto(self._buffers[name], a, casting="same_kind")
        self.steps = steps


def checked_state(kind: str, state, names, size: int, xp=np) -> tuple[int, dict]:
    """``state``'s step count and its arrays (as ``xp`` arrays), each checked against an optimizer's own.

    Shared by the host optimizers and the device ones (``xp = cupy``), so both refuse the same things.

    Raises
    ------
    InvalidArgument
        If the keys are not ``steps`` and ``names``, or a value does not fit.
    """
    expected = {"steps", *names}
    if not isinstance(state, Mapping) or set(state) != expected:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise InvalidArgument(f"{kind} state needs keys {sorted(expected)}, got {got}")
    steps = np.asarray(state["steps"])
    if steps.shape != () or steps.dtype.kind not in "iu" or steps < 0:
        raise InvalidArgument(f"{kind} state: steps must be an integer >= 0, got {state['steps']!r}")
    arrays = {}
    for name in names:
        a = xp.asarray(state[name])
        if a.shape != (size,) or a.dtype.kind != "f":
            raise InvalidArgument(f"{kind} state: {name} must be float of shape ({size},), got {a.dtype} {a.shape}")
        if not bool(xp.isfinite(a).all()):
            raise InvalidArgument(f"{kind} state: {name} has non-finite values")
        arrays[name] = a
    return int(steps), arrays


def NON_FINITE() -> InvalidArgument:
    return InvalidArgument("payload contains NaN or infinity", Reason.NON_FINITE)


def _checked(blocks, grad: np.ndarray):
    """The blocks of ``blocks``, each refused (InvalidArgument) if its gradient holds NaN or infinity.

    A block is finite exactly when its smallest and its largest element are: NumPy's min and max
    carry a NaN through, and an infinity is one of the two. Each reads the block in cache, just
    before the update reads it again. They are NumPy's own loops on the calling thread: a dot
    product with zeros (NaN exactly when an element is not finite) went through BLAS, whose own
    pool of a thread a core woke in every shard process for every block and spun on the cores the
    update's threads and the workers needed.
    """
    for block in blocks:
        part = grad[block[0]]
        if not (math.isfinite(np.minimum.reduce(part)) and math.isfinite(np.maximum.reduce(part))):
            raise NON_FINITE()
        yield block


class SGD(Optimizer):
    """Stochastic gradient descent with optional (Nesterov) momentum, as ``torch.optim.SGD``.

    ``g = grad + weight_decay * w``; with momentum ``v = momentum * v + g`` and the direction is
    ``g + momentum * v`` (Nesterov) or ``v``; then ``w -= lr * lr_scale * direction``.

    Parameters
    ----------
    size : int
        Number of float32 elements in the shard's range.
    lr : float
        Learning rate, finite and > 0.
    momentum : float, optional
        In [0, 1); 0 keeps no state.
    nesterov : bool, optional
        Nesterov momentum; needs ``momentum > 0``.
    weight_decay : float, optional
        L2 penalty, finite and >= 0.
    """

    def __init__(
        self,
        size: int,
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        chunks: Chunks = SERIAL,
    ):
        super().__init__(size, lr, weight_decay, chunks)
        self.momentum = _hparam("momentum", momentum)
        self.nesterov = _nesterov(nesterov, self.momentum)
        self._v = self._buffer("momentum_buffer") if self.momentum else None

    def set_momentum(self, momentum: float) -> None:
        """Change the momentum between steps (in [0, 1); the optimizer must have been built with some).

        Used by ``async_momentum = "auto"`` as workers come and go (compensation.py). At 0 the
        velocity is cleared: momentum that comes back starts afresh rather than from a stale one.
        """
        if self._v is None or not 0.0 <= momentum < 1.0:
            raise InvalidArgument(f"momentum must be in [0, 1) on an optimizer built with momentum, got {momentum!r}")
        if momentum == 0.0 and self.momentum != 0.0:
            self._v.fill(0.0)
        self.momentum = float(momentum)

    def _apply(self, w, g, lr, out, blocks):
        mu, wd, v = self.momentum, self.weight_decay, self._v
        for s, t, u in blocks:
            wb, d = w[s], g[s]
            if wd:
                np.multiply(wb, wd, out=t)
                d = np.add(t, d, out=t)
            if mu:
                vb = v[s]
                vb *= mu
                vb += d
                if self.nesterov:
                    np.multiply(vb, mu, out=u)
                    d = np.add(u, d, out=u)
                else:
                    d = vb
            np.multiply(d, lr, out=t)
            np.subtract(wb, t, out=out[s])


class Adam(Optimizer):
    """Adam with L2 weight decay added to the gradient and bias correction, as ``torch.optim.Adam``.

    Parameters
    ----------
    size : int
        Number of float32 elements in the shard's range.
    lr : float
        Learning rate, finite and > 0.
    beta1, beta2 : float, optional
        Decay rates of the first and second moment estimates, in [0, 1).
    eps : float, optional
        Added to the denominator, finite and > 0.
    weight_decay : float, optional
        L2 penalty, finite and >= 0 (not decoupled: this is Adam, not AdamW).
    """

    def __init__(
        self,
        size: int,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        chunks: Chunks = SERIAL,
    ):
        super().__init__(size, lr, weight_decay, chunks)
        self.beta1 = _hparam("beta1", beta1)
        self.beta2 = _hparam("beta2", beta2)
        self.eps = _hparam("eps", eps)
        self._m = self._buffer("exp_avg")
        self._v = self._buffer("exp_avg_sq")

    def set_beta1(self, beta1: float) -> None:
        """Change beta1 between steps (in [0, 1)): ``async_momentum = "auto"`` as workers come and go (compensation.py).

        The bias correction takes the current beta1 (1 - beta1**steps), which is exact for a beta1 held
        since the first step and, once a few steps have passed, 1 to within float32 either way.
        """
        if not 0.0 <= beta1 < 1.0:
            raise InvalidArgument(f"beta1 must be in [0, 1), got {beta1!r}")
        self.beta1 = float(beta1)

    def _apply(self, w, g, lr, out, blocks):
        b1, b2, eps, wd = self.beta1, self.beta2, self.eps, self.weight_decay
        # torch: w -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps); multiplying through by sqrt(bc2)
        # folds the bias correction into two scalars and saves a pass per block
        sqrt_bc2 = math.sqrt(1.0 - b2**self.steps)
        step_size = lr / (1.0 - b1**self.steps) * sqrt_bc2
        eps_hat = eps * sqrt_bc2
        for s, t, u in blocks:
            wb, gb, m, v = w[s], g[s], self._m[s], self._v[s]
            if wd:
                np.multiply(wb, wd, out=t)
                gb = np.add(t, gb, out=t)
            # m += (1 - b1) * (g - m), torch's lerp_, rather than b1*m + (1-b1)*g
            np.subtract(gb, m, out=u)
            u *= 1.0 - b1
            m += u
            np.multiply(gb, gb, out=u)
            u *= 1.0 - b2
            v *= b2
            v += u
            np.sqrt(v, out=u)
            u += eps_hat
            np.divide(m, u, out=u)
            u *= step_size
            np.subtract(wb, u, out=out[s])


_KINDS = {
    "sgd": (SGD, ("lr", "momentum", "nesterov", "weight_decay")),
    "adam": (Adam, ("lr", "beta1", "beta2", "eps", "weight_decay")),
}


def make_optimizer(name: str, size: int, *, chunks: Chunks = SERIAL, **hparams) -> Optimizer:
    """Build the optimizer ``name`` ("sgd" or "adam") for a range of ``size`` elements.

    ``hparams`` may hold any of ``HPARAMS``, so one settings dict serves every optimizer; those
    that do not apply to ``name`` (momentum for Adam, betas for SGD) are ignored, unvalidated.

    Raises
    ------
    InvalidArgument
        For an unknown name or key, a missing ``lr``, or a hyperparameter out of range.
    """
    if name not in _KINDS:
        raise InvalidArgument(f"unknown optimizer {name!r}; choose one of {sorted(_KINDS)}")
    unknown = sorted(set(hparams) - set(HPARAMS))
    if unknown:
        raise InvalidArgument(f"unknown hyperparameters {unknown}; accepted are {list(HPARAMS)}")
    if "lr" not in hparams:
        raise InvalidArgument(f"{name} needs lr")
    cls, keys = _KINDS[name]
    return cls(size, chunks=chunks, **{k: v for k, v in hparams.items() if k in keys})
