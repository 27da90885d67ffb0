"""Softmax regression and multi-layer perceptrons."""

from __future__ import annotations

import math

from psgrid.worker.models.base import Model
from psgrid.worker.models.layers import Dense, Flatten, ReLU, Sigmoid

ACTIVATIONS = {"relu": ReLU, "sigmoid": Sigmoid}


class MLP(Model):
    """Dense layers of widths ``hidden`` with ``activation`` between them, then the logits.

    Parameters are named ``fc1.w, fc1.b, fc2.w, ...``; ``hidden=()`` is softmax regression.
    """

    def __init__(self, input_shape, num_classes, hidden=(128,), activation="relu"):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        widths = [math.prod(input_shape), *(int(h) for h in hidden), num_classes]
        init = "he" if activation == "relu" else "xavier"
        layers = [Flatten()]
        for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:]), start=1):
            last = i == len(widths) - 1
            layers.append(Dense(f"fc{i}", fan_in, fan_out, init="xavier" if last else init))
            if not last:
                layers.append(ACTIVATIONS[activation]())
        super().__init__(layers, input_shape, num_classes)


class SoftmaxRegression(MLP):
    """One dense layer from the (flattened) input to the logits."""

    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes, hidden=())
