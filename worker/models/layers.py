"""Layers with hand-written forward and backward passes, written once for NumPy and CuPy.

A layer is a few lines: ``params()`` names and shapes its parameters,
``init(rng, scale)`` draws them on the host, ``forward(params, x)`` returns the
output and what the backward pass needs, and ``backward(params, cache, dout,
grads)`` writes the parameter gradients *into* ``grads`` (views of one flat
buffer, so never rebind them) and returns the gradient of the input.

Arrays are NCHW for images. The array module comes from the arrays themselves
(:func:`worker.backend.array_module`), and every result keeps the input dtype,
so the same code runs in float32 on a GPU and in float64 in a gradient check.
"""

from __future__ import annotations

import math

import numpy as np

from psgrid.worker.backend import array_module


class Layer:
    """A layer without parameters unless a subclass says otherwise."""

    def params(self) -> dict[str, tuple[int, ...]]:
        return {}

    def init(self, rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
        return {}

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one sample's output, given one sample's input shape."""
        return shape

    def forward(self, params, x):
        raise NotImplementedError

    def backward(self, params, cache, dout, grads, need_dx=True):
        raise NotImplementedError


def _normal(rng, shape, std):
    return (rng.standard_normal(shape) * std).astype(np.float32)


class Dense(Layer):
    """``y = x @ w + b`` with ``w`` of shape (fan_in, fan_out).

    ``init="he"`` (std sqrt(2/fan_in)) suits a following ReLU; ``"xavier"``
    (std sqrt(2/(fan_in+fan_out))) a sigmoid or the logits.
    """

    def __init__(self, name: str, fan_in: int, fan_out: int, init: str = "he"):
        if init not in ("he", "xavier"):
            raise ValueError(f"init must be 'he' or 'xavier', got {init!r}")
        self.w, self.b = f"{name}.w", f"{name}.b"
        self.fan_in, self.fan_out, self.init_rule = int(fan_in), int(fan_out), init

    def params(self):
        return {self.w: (self.fan_in, self.fan_out), self.b: (self.fan_out,)}

    def init(self, rng, scale):
        fan = self.fan_in if self.init_rule == "he" else (self.fan_in + self.fan_out) / 2
        w = _normal(rng, (self.fan_in, self.fan_out), scale * math.sqrt(2.0 / fan))
        return {self.w: w, self.b: np.zeros(self.fan_out, dtype=np.float32)}

    def output_shape(self, shape):
        return (self.fan_out,)

    def forward(self, params, x):
        return x @ params[self.w] + params[self.b], x

    def backward(self, params, x, dout, grads, need_dx=True):
        xp = array_module(dout)
        xp.matmul(x.T, dout, out=grads[self.w])
        grads[self.b][...] = dout.sum(axis=0)
        return dout @ params[self.w].T if need_dx else None


class ReLU(Layer):
    def forward(self, params, x):
        positive = x > 0
        return x * positive, positive

    def backward(self, params, positive, dout, grads, need_dx=True):
        return dout * positive


class Sigmoid(Layer):
    def forward(self, params, x):
        xp = array_module(x)
        y = 0.5 * (1 + xp.tanh(0.5 * x))  # = 1/(1+exp(-x)), without overflow for large -x
        return y, y

    def backward(self, params, y, dout, grads, need_dx=True):
        return dout * y * (1 - y)


class Flatten(Layer):
    def output_shape(self, shape):
        return (math.prod(shape),)

    def forward(self, params, x):
        return x.reshape(x.shape[0], -1), x.shape

    def backward(self, params, shape, dout, grads, need_dx=True):
        return dout.reshape(shape)


class Conv2D(Layer):
    """A k x k convolution, stride 1, 'same' zero padding, as im2col + one matmul.

    im2col is built from the k*k shifted slices of the padded input (plain
    slicing, identical on NumPy and CuPy); col2im adds them back.
    ``w`` has shape (out_channels, in_channels, k, k).
    """

    def __init__(self, name: str, in_channels: int, out_channels: int, k: int = 3):
        if k % 2 != 1:
            raise ValueError(f"'same' padding needs an odd kernel size, got {k}")
        self.w, self.b = f"{name}.w", f"{name}.b"
        self.cin, self.cout, self.k = int(in_channels), int(out_channels), int(k)

    def params(self):
        return {self.w: (self.cout, self.cin, self.k, self.k), self.b: (self.cout,)}

    def init(self, rng, scale):
        fan_in = self.cin * self.k * self.k
        w = _normal(rng, (self.cout, self.cin, self.k, self.k), scale * math.sqrt(2.0 / fan_in))
        return {self.w: w, self.b: np.zeros(self.cout, dtype=np.float32)}

    def output_shape(self, shape):
        return (self.cout,) + tuple(shape[1:])

    def _shifts(self):
        return [(i, j) for i in range(self.k) for j in range(self.k)]

    def forward(self, params, x):
        xp = array_module(x)
        n, c, h, w = x.shape
        p = self.k // 2
        padded = xp.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
        patches = xp.stack([padded[:, :, i : i + h, j : j + w] for i, j in self._shifts()], axis=2)
        cols = patches.transpose(0, 3, 4, 1, 2).reshape(n * h * w, c * self.k * self.k)  # rows: pixels
        out = cols @ params[self.w].reshape(self.cout, -1).T + params[self.b]
        return out.reshape(n, h, w, self.cout).transpose(0, 3, 1, 2), (x.shape, cols)

    def backward(self, params, cache, dout, grads, need_dx=True):
        xp = array_module(dout)
        (n, c, h, w), cols = cache
        d = dout.transpose(0, 2, 3, 1).reshape(n * h * w, self.cout)
        xp.matmul(d.T, cols, out=grads[self.w].reshape(self.cout, -1))
        grads[self.b][...] = d.sum(axis=0)
        if not need_dx:
            return None
        dcols = (d @ params[self.w].reshape(self.cout, -1)).reshape(n, h, w, c, self.k * self.k)
        p = self.k // 2
        dpadded = xp.zeros((n, c, h + 2 * p, w + 2 * p), dtype=dout.dtype)
        for s, (i, j) in enumerate(self._shifts()):
            dpadded[:, :, i : i + h, j : j + w] += dcols[..., s].transpose(0, 3, 1, 2)
        return dpadded[:, :, p : p + h, p : p + w]


class MaxPool2(Layer):
    """2x2 max pooling, stride 2; an odd last row or column is dropped.

    The gradient goes to the first maximum of each window only, which is exact
    even where a window holds ties.
    """

    def output_shape(self, shape):
        return (shape[0], shape[1] // 2, shape[2] // 2)

    @staticmethod
    def _windows(x):
        n, c, h, w = x.shape
        ho, wo = h // 2, w // 2
        x = x[:, :, : 2 * ho, : 2 * wo].reshape(n, c, ho, 2, wo, 2)
        return x.transpose(0, 1, 2, 4, 3, 5).reshape(n, c, ho, wo, 4)

    def forward(self, params, x):
        windows = self._windows(x)
        first_max = windows.argmax(axis=-1)
        return windows.max(axis=-1), (x.shape, first_max)

    def backward(self, params, cache, dout, grads, need_dx=True):
        xp = array_module(dout)
        (n, c, h, w), first_max = cache
        ho, wo = dout.shape[2:]
        dwindows = (xp.arange(4) == first_max[..., None]) * dout[..., None]
        dwindows = dwindows.reshape(n, c, ho, wo, 2, 2).transpose(0, 1, 2, 4, 3, 5)
        dx = xp.zeros((n, c, h, w), dtype=dout.dtype)
        dx[:, :, : 2 * ho, : 2 * wo] = dwindows.reshape(n, c, 2 * ho, 2 * wo)
        return dx
