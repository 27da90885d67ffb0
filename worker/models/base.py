"""The model interface: a stack of layers, a softmax cross-entropy loss, accuracy.

Parameters and gradients are dicts of named arrays. In training both are views
into flat buffers laid out by ``model.spec`` (:class:`psserver.spec.ModelSpec`),
so a pull fills the parameters with one copy and a push sends the gradients
with one copy; :meth:`Model.loss_and_grad` therefore writes into ``grads`` in
place and never rebinds an entry.
"""

from __future__ import annotations

import numpy as np

from psgrid.psserver.spec import ModelSpec
from psgrid.worker.backend import array_module
from psgrid.worker.models.layers import Layer


def softmax_cross_entropy(logits, y):
    """Mean softmax cross-entropy of integer labels ``y``, and its gradient w.r.t. ``logits``.

    Returns
    -------
    loss : 0-d array (no host synchronisation)
    dlogits : array like ``logits``
    """
    xp = array_module(logits)
    n = logits.shape[0]
    rows = xp.arange(n)
    shifted = logits - logits.max(axis=1, keepdims=True)  # exp() <= 1: no overflow
    log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    loss = -log_probs[rows, y].mean()
    dlogits = xp.exp(log_probs)
    dlogits[rows, y] -= 1
    dlogits /= n
    return xp.asarray(loss), dlogits


class Model:
    """A feed-forward stack of :class:`~worker.models.layers.Layer` ending in class logits.

    Parameters
    ----------
    layers : list of Layer
    input_shape : tuple of int
        One sample's shape; inputs may come flat, they are reshaped to it.
    num_classes : int
    """

    def __init__(self, layers: list[Layer], input_shape: tuple[int, ...], num_classes: int):
        self.layers = list(layers)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes = int(num_classes)
        shape = self.input_shape
        for layer in self.layers:
            shape = layer.output_shape(shape)
        if shape != (self.num_classes,):
            raise ValueError(f"the last layer gives shape {shape}, expected ({self.num_classes},)")
        self.spec = ModelSpec((name, shape) for layer in self.layers for name, shape in layer.params().items())
        # Layers before the first one with parameters need no backward pass at all.
        trained = [i for i, layer in enumerate(self.layers) if layer.params()]
        if not trained:
            raise ValueError("a model needs at least one layer with parameters")
        self._first_trained = trained[0]

    def init_params(self, seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
        """Fresh float32 host parameters, the same for the same seed and scale."""
        rng = np.random.default_rng(seed)
        params = {}
        for layer in self.layers:
            params.update(layer.init(rng, scale))
        return params

    def forward(self, params: dict, x):
        """Logits of a batch, and the caches the backward pass needs."""
        x = x.reshape((x.shape[0],) + self.input_shape)
        caches = []
        for layer in self.layers:
            x, cache = layer.forward(params, x)
            caches.append(cache)
        return x, caches

    def backward(self, params: dict, caches: list, dlogits, grads: dict) -> None:
        """Write the gradients of the loss into ``grads`` given its gradient w.r.t. the logits."""
        d = dlogits
        for i in range(len(self.layers) - 1, self._first_trained - 1, -1):
            d = self.layers[i].backward(params, caches[i], d, grads, need_dx=i > self._first_trained)

    def loss_and_grad(self, params: dict, x, y, grads: dict):
        """Mean softmax cross-entropy of the batch ``(x, y)``; its gradient goes into ``grads``.

        Parameters
        ----------
        params : dict of arrays
            Named as ``self.spec``; NumPy or CuPy, float32 or float64 like ``x``.
        x : array (batch, *input_shape) or (batch, prod(input_shape))
        y : integer array (batch,)
        grads : dict of arrays
            Written in place (typically views of one flat buffer).

        Returns
        -------
        loss : 0-d array on the same device (reading it synchronises).
        """
        logits, caches = self.forward(params, x)
        loss, dlogits = softmax_cross_entropy(logits, y)
        self.backward(params, caches, dlogits, grads)
        return loss

    def predict(self, params: dict, x):
        """Logits of a batch, keeping no caches."""
        x = x.reshape((x.shape[0],) + self.input_shape)
        for layer in self.layers:
            x, _ = layer.forward(params, x)
        return x

    def __repr__(self):
        names = ", ".join(type(layer).__name__ for layer in self.layers)
        return f"{type(self).__name__}({self.input_shape} -> [{names}] -> {self.num_classes}, {self.spec.size} params)"


def accuracy(model: Model, params: dict, x, y, batch: int = 1000) -> float:
    """Fraction of ``x`` classified as ``y``; host inputs are moved to the parameters' device in batches."""
    xp = array_module(next(iter(params.values())))
    n = len(y)
    if n == 0:
        raise ValueError("accuracy of an empty set")
    correct = 0
    for start in range(0, n, batch):
        xb = xp.asarray(x[start : start + batch])
        yb = xp.asarray(y[start : start + batch])
        correct = correct + (model.predict(params, xb).argmax(axis=1) == yb).sum()
    return float(correct) / n


def loss_and_accuracy(model: Model, params: dict, x, y, batch: int = 1000) -> tuple[float, float]:
    """Mean softmax cross-entropy and :func:`accuracy` in one pass of the same batches: the coordinator's final
    evaluation (a whole test set's logits at once, and the cnn's unfolded inputs behind them, took gigabytes)."""
    xp = array_module(next(iter(params.values())))
    n = len(y)
    if n == 0:
        raise ValueError("accuracy of an empty set")
    loss = correct = 0
    for start in range(0, n, batch):
        xb = xp.asarray(x[start : start + batch])
        yb = xp.asarray(y[start : start + batch])
        logits = model.predict(params, xb)
        loss = loss + softmax_cross_entropy(logits, yb)[0] * len(yb)
        correct = correct + (logits.argmax(axis=1) == yb).sum()
    return float(loss) / n, float(correct) / n
