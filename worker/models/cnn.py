"""A small convolutional network for (C, H, W) images."""

from __future__ import annotations

from psgrid.worker.models.base import Model
from psgrid.worker.models.layers import Conv2D, Dense, Flatten, MaxPool2, ReLU

# The least height and width of an image the cnn takes: it pools twice by 2 (a job whose synthetic_image is
# smaller is refused while it is read, worker/config.py TrainConfig.validate).
MIN_SIDE = 4


class SmallCNN(Model):
    """conv 3x3 -> relu -> maxpool 2x2 -> conv 3x3 -> relu -> maxpool 2x2 -> dense -> relu -> dense.

    Convolutions keep the image size ('same' padding), so (1, 28, 28) becomes
    7 x 7 and (1, 8, 8) becomes 2 x 2 before the dense layers. Parameters are
    named ``conv1.w, conv1.b, conv2.w, conv2.b, fc1.w, fc1.b, fc2.w, fc2.b``.
    """

    def __init__(self, input_shape, num_classes, channels=(8, 16), hidden=128):
        if len(input_shape) != 3:
            raise ValueError(f"the cnn needs an image input_shape (C, H, W), got {tuple(input_shape)}")
        c, h, w = input_shape
        if h < MIN_SIDE or w < MIN_SIDE:
            raise ValueError(
                f"the cnn pools twice by 2 and needs images of at least {MIN_SIDE} x {MIN_SIDE}, got {h} x {w}"
            )
        c1, c2 = channels
        flat = c2 * (h // 2 // 2) * (w // 2 // 2)
        layers = [
            Conv2D("conv1", c, c1),
            ReLU(),
            MaxPool2(),
            Conv2D("conv2", c1, c2),
            ReLU(),
            MaxPool2(),
            Flatten(),
            Dense("fc1", flat, hidden),
            ReLU(),
            Dense("fc2", hidden, num_classes, init="xavier"),
        ]
        super().__init__(layers, input_shape, num_classes)
