"""Models written once against NumPy/CuPy, with hand-written gradients.

>>> model = build_model("mlp", (1, 28, 28), 10, hidden=(128,))
>>> params = model.init_params(seed=0)              # float32 host arrays
>>> grads = model.spec.views(model.spec.flat())     # views of one flat buffer
>>> loss = model.loss_and_grad(params, x, y, grads)  # doctest: +SKIP
"""

from __future__ import annotations

from psgrid.worker.models.base import Model, accuracy, loss_and_accuracy, softmax_cross_entropy
from psgrid.worker.models.cnn import SmallCNN
from psgrid.worker.models.mlp import MLP, SoftmaxRegression

MODELS = ("softmax", "mlp", "cnn")


def build_model(
    name: str, input_shape: tuple, num_classes: int, hidden=(128,), activation: str = "relu", channels=(8, 16)
) -> Model:
    """Build a model by name.

    Parameters
    ----------
    name : {"softmax", "mlp", "cnn"}
    input_shape : tuple of int
        One sample's shape, e.g. (1, 28, 28); the cnn needs (C, H, W).
    num_classes : int
    hidden : sequence of int
        MLP widths; the cnn uses ``hidden[0]`` for its dense layer; softmax ignores it.
    activation : {"relu", "sigmoid"}
        MLP only (the cnn always uses relu).
    channels : (int, int)
        The cnn's two convolution widths.
    """
    if name == "softmax":
        return SoftmaxRegression(input_shape, num_classes)
    if name == "mlp":
        return MLP(input_shape, num_classes, hidden=hidden, activation=activation)
    if name == "cnn":
        hidden = tuple(hidden)
        return SmallCNN(input_shape, num_classes, channels=channels, hidden=hidden[0] if hidden else 128)
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


__all__ = [
    "MLP",
    "MODELS",
    "Model",
    "SmallCNN",
    "SoftmaxRegression",
    "accuracy",
    "loss_and_accuracy",
    "build_model",
    "softmax_cross_entropy",
]
