"""The server-side optimizers on a GPU: the maths of :mod:`~psgrid.psserver.kernels.optim`, one fused kernel a step.

On the host the update walks the range in cache-sized blocks because every NumPy operator streams
its operands through memory. On a GPU one ``cupy.ElementwiseKernel`` does the whole update in a
single pass: each element's weight, gradient and state are read once and written once, so SGD moves
12 bytes per element, momentum 20 and Adam 28, at the device's memory bandwidth.

The arithmetic is the host's, operation for operation and in float32 (the host's Python-float
hyper-parameters meet float32 arrays as float32 scalars): weight decay added to the gradient,
momentum folded into the velocity before the step, Nesterov's look-ahead, Adam's moments as torch
updates them and its bias correction folded into two scalars. The compiler may contract a multiply
and an add into one rounding, so device and host agree to float32 rounding, not bit for bit.

CuPy is imported here only: the module is loaded where a GPU is used, and the kernels are compiled
on their first launch (:meth:`DeviceOptimizer.warm_up` does that before the timed steps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import cupy
import numpy as np

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels.optim import NON_FINITE, checked_state, make_optimizer

# d: the gradient with weight decay; each kernel writes the next weights into `out` (may be `w` itself).
_DECAYED = "float d = g; if (wd != 0.0f) { d = w * wd + d; }\n"


def _kernels(inputs: str, outputs: str, body: str, name: str) -> dict:
    """The update as a kernel, by ``(published, guarded)``.

    ``published``: it also writes the next weights into ``pub``: a device shard publishes each version
    as a copy of its own weights, and writing it in the same pass saves reading them again.
    ``guarded``: it reads a flag (``raw int32 guard``) first and writes nothing where it is set: the
    check of a gradient queued before it on the same stream (state/device.py ``check_into``) then
    stops it on the GPU, and the shard waits for the GPU once, after both, instead of once between.
    """
    kernels = {}
    for published in (False, True):
        for guarded in (False, True):
            code = body + ("\npub = out;" if published else "")
            kernels[published, guarded] = cupy.ElementwiseKernel(
                inputs + (", raw int32 guard" if guarded else ""),
                outputs + (", float32 pub" if published else ""),
                f"if (guard[0] == 0) {{\n{code}\n}}" if guarded else code,
                name + ("_published" if published else "") + ("_guarded" if guarded else ""),
            )
    return kernels


# How many elements are NaN or infinite, in one pass that reads each once (no array of flags).
_NON_FINITE = cupy.ReductionKernel(
    "float32 x", "int32 bad", "isfinite(x) ? 0 : 1", "a + b", "bad = a", "0", "psgrid_non_finite"
)


def all_finite(array) -> bool:
    """Whether a float32 device array holds no NaN or infinity (one read of it, then a wait for the answer)."""
    return not int(_NON_FINITE(array))


_SGD = _kernels(
    "float32 w, float32 g, float32 lr, float32 wd", "float32 out", _DECAYED + "out = w - d * lr;", "psgrid_sgd"
)

_MOMENTUM = _kernels(
    "float32 w, float32 g, float32 lr, float32 wd, float32 mu, int32 nesterov",
    "float32 out, float32 v",
    _DECAYED
    + """
    float vel = v * mu + d;
    v = vel;
    float direction = nesterov ? vel * mu + d : vel;
    out = w - direction * lr;
    """,
    "psgrid_momentum",
)

# torch's order: m += (1 - b1) * (g - m); v = b2 * v + (1 - b2) * g * g; w -= step_size * m / (sqrt(v) + eps_hat)
_ADAM = _kernels(
    "float32 w, float32 g, float32 step_size, float32 wd, float32 one_minus_b1, float32 b2, "
    "float32 one_minus_b2, float32 eps_hat",
    "float32 out, float32 m, float32 v",
    _DECAYED
    + """
    float m_next = m + (d - m) * one_minus_b1;
    float v_next = v * b2 + (d * d) * one_minus_b2;
    m = m_next;
    v = v_next;
    out = w - m_next / (sqrt(v_next) + eps_hat) * step_size;
    """,
    "psgrid_adam",
)


class DeviceOptimizer:
    """An optimizer whose state lives on the current GPU; ``step`` is one kernel launch.

    Built by :func:`make_device_optimizer` from the host optimizer's own validation, so the same
    settings are accepted and refused with the same messages.

    Attributes
    ----------
    steps : int
        Updates applied so far (Adam's bias correction counts from it).
    """

    def __init__(self, host, buffers: tuple[str, ...]):
        self.size = host.size
        self.lr, self.weight_decay = host.lr, host.weight_decay
        self.steps = 0
        self._buffers = {name: cupy.zeros(self.size, cupy.float32) for name in buffers}

    def step(
        self, weights, grad, lr_scale: float = 1.0, *, out=None, check_finite: bool = False, publish=None, flag=None
    ) -> None:
        """Apply one update to ``weights``, in place or into ``out``; ``grad`` is only read.

        Parameters
        ----------
        weights, grad : cupy.ndarray
            1-D float32 device arrays of length ``size``.
        lr_scale : float, optional
            Multiplies ``lr`` for this step only. Finite and >= 0.
        out : cupy.ndarray, optional
            Where the updated weights go (``weights`` itself by default).
        check_finite : bool, optional
            Refuse a gradient with NaN or infinity first (one reduction over it), changing nothing.
        publish : cupy.ndarray, optional
            Also write the updated weights here, in the same pass (a device shard's published copy).
        flag : cupy.ndarray, optional
            One int32, set on the GPU by a check of ``grad`` queued before this step on the current
            stream (state/device.py ``GpuArrays.check_into``): the update reads it and writes nothing
            where it is set, then this waits for the stream and refuses as ``check_finite`` does.

        Raises
        ------
        InvalidArgument
            On a wrong shape, dtype or array type, a bad ``lr_scale``, or (``check_finite``) a
            gradient that is not finite; nothing is changed then.
        """
        out = weights if out is None else out
        arrays = (("weights", weights), ("grad", grad), ("out", out))
        for name, a in arrays + ((("publish", publish),) if publish is not None else ()):
            if not isinstance(a, cupy.ndarray) or a.dtype != np.float32 or a.shape != (self.size,):
                got = f"{a.dtype} {a.shape}" if hasattr(a, "dtype") else type(a).__name__
                raise InvalidArgument(
                    f"{name} must be a float32 CuPy array of shape ({self.size},), got "
                    f"{type(a).__module__}.{type(a).__name__} {got}"
                )
        if isinstance(lr_scale, bool) or not 0.0 <= float(lr_scale) < math.inf:
            raise InvalidArgument(f"lr_scale must be finite and >= 0, got {lr_scale!r}")
        if flag is not None and not (isinstance(flag, cupy.ndarray) and flag.dtype == np.int32 and flag.size == 1):
            raise InvalidArgument(f"flag must be one int32 on the GPU, got {type(flag).__name__}")
        if check_finite and not all_finite(grad):
            raise NON_FINITE()
        self.steps += 1
        self._launch(weights, grad, self.lr * float(lr_scale), out, publish, flag)
        if flag is not None and int(flag.get(stream=cupy.cuda.get_current_stream())[0]):
            self.steps -= 1  # the kernel wrote nothing: Adam's next step counts as this one would have
            raise NON_FINITE()

    def _launch(self, w, g, lr: float, out, publish, guard) -> None:
        """Queue the update; ``guard``: the flag it reads first (None: unguarded)."""
        raise NotImplementedError

    def warm_up(self) -> None:
        """Compile this optimizer's kernel now (CuPy compiles on first launch), on scratch arrays."""
        scratch = type(self).__new__(type(self))
        scratch.__dict__.update(self.__dict__)
        scratch.size = 1
        scratch._buffers = {name: cupy.zeros(1, cupy.float32) for name in self._buffers}
        one = cupy.ones(1, cupy.float32)
        scratch.step(one, one.copy(), check_finite=True)
        scratch.step(one, one.copy(), publish=one.copy())
        scratch.step(one, one.copy(), publish=one.copy(), flag=cupy.zeros(1, cupy.int32))
        cupy.cuda.get_current_stream().synchronize()

    def state_dict(self) -> dict[str, np.ndarray | int]:
        """Return the step count and host copies of the state arrays (the host optimizer's keys)."""
        state: dict[str, np.ndarray | int] = {"steps": self.steps}
        state.update((name, cupy.asnumpy(a)) for name, a in self._buffers.items())
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Replace the state with ``state`` (host or device arrays), as ``state_dict`` or the host optimizer gives it.

        Raises
        ------
        InvalidArgument
            If keys, shapes or values do not fit; nothing is changed then.
        """
        steps, arrays = checked_state(type(self).__name__, state, self._buffers, self.size, xp=cupy)
        for name, a in arrays.items():
            self._buffers[name][...] = a.astype(cupy.float32, copy=False)
        self.steps = steps


class DeviceSGD(DeviceOptimizer):
    """SGD with optional (Nesterov) momentum and weight decay: :class:`~psgrid.psserver.kernels.optim.SGD` on a GPU."""

    def __init__(self, host):
        super().__init__(host, ("momentum_buffer",) if host.momentum else ())
        self.momentum, self.nesterov = host.momentum, host.nesterov

    def set_momentum(self, momentum: float) -> None:
        """Change the momentum between steps, as the host optimizer's ``set_momentum`` does (0 clears the velocity)."""
        if "momentum_buffer" not in self._buffers or not 0.0 <= momentum < 1.0:
            raise InvalidArgument(f"momentum must be in [0, 1) on an optimizer built with momentum, got {momentum!r}")
        if momentum == 0.0 and self.momentum != 0.0:
            self._buffers["momentum_buffer"].fill(0.0)
        self.momentum = float(momentum)

    def _launch(self, w, g, lr, out, publish, guard):
        f32 = np.float32
        published = () if publish is None else (publish,)
        guarded = () if guard is None else (guard,)
        kind = (bool(published), bool(guarded))
        if self.momentum:
            _MOMENTUM[kind](
                w,
                g,
                f32(lr),
                f32(self.weight_decay),
                f32(self.momentum),
                np.int32(self.nesterov),
                *guarded,
                out,
                self._buffers["momentum_buffer"],
                *published,
            )
        else:
            _SGD[kind](w, g, f32(lr), f32(self.weight_decay), *guarded, out, *published)


class DeviceAdam(DeviceOptimizer):
    """Adam with L2 weight decay and bias correction: :class:`~psgrid.psserver.kernels.optim.Adam` on a GPU."""

    def __init__(self, host):
        super().__init__(host, ("exp_avg", "exp_avg_sq"))
        self.beta1, self.beta2, self.eps = host.beta1, host.beta2, host.eps

    def set_beta1(self, beta1: float) -> None:
        """Change beta1 between steps, as the host optimizer's ``set_beta1`` does."""
        if not 0.0 <= beta1 < 1.0:
            raise InvalidArgument(f"beta1 must be in [0, 1), got {beta1!r}")
        self.beta1 = float(beta1)

    def _launch(self, w, g, lr, out, publish, guard):
        # The host's scalars, computed the host's way in float64, then met as float32 by the arrays.
        sqrt_bc2 = math.sqrt(1.0 - self.beta2**self.steps)
        step_size = lr / (1.0 - self.beta1**self.steps) * sqrt_bc2
        f32 = np.float32
        published = () if publish is None else (publish,)
        guarded = () if guard is None else (guard,)
        _ADAM[bool(published), bool(guarded)](
            w,
            g,
            f32(step_size),
            f32(self.weight_decay),
            f32(1.0 - self.beta1),
            f32(self.beta2),
            f32(1.0 - self.beta2),
            f32(self.eps * sqrt_bc2),
            *guarded,
            out,
            self._buffers["exp_avg"],
            self._buffers["exp_avg_sq"],
            *published,
        )


_DEVICE_KINDS = {"sgd": DeviceSGD, "adam": DeviceAdam}


def make_device_optimizer(name: str, size: int, **hparams) -> DeviceOptimizer:
    """Build the optimizer ``name`` ("sgd" or "adam") for ``size`` elements, its state on the current GPU.

    ``hparams`` are those of :func:`~psgrid.psserver.kernels.optim.make_optimizer`, validated by it.

    Raises
    ------
    InvalidArgument
        For an unknown name or key, a missing ``lr``, or a hyperparameter out of range.
    """
    host = make_optimizer(name, 0, **hparams)  # size 0: the validation and the settings, no host state
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise InvalidArgument(f"size must be an integer >= 0, got {size!r}")
    host.size = int(size)
    return _DEVICE_KINDS[name](host)
