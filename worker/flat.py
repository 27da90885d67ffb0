"""Flat parameter and gradient buffers: one device array each, per-parameter views, a pinned host mirror.

The training loop and the few-lines trainer (api.py) share this one layout. A pull lands in
the pinned host buffer and moves to the device in one copy; a gradient moves back in one
copy and is pushed from pinned memory. On the CPU host and device are the same array: no
copy at all.
"""

from __future__ import annotations

import numpy as np

from psgrid.psserver.spec import ModelSpec
from psgrid.worker.backend import pinned_empty


class FlatBuffers:
    """``params``/``grad`` on the device (views by name in ``param_views``/``grad_views``);
    ``host_params``/``host_grad`` what the client pulls into and pushes from."""

    def __init__(self, spec: ModelSpec, xp):
        self.xp = xp
        self.host_params = pinned_empty(spec.size, np.float32, xp)
        self.host_grad = pinned_empty(spec.size, np.float32, xp)
        if xp is np:
            self.params, self.grad = self.host_params, self.host_grad
        else:
            self.params, self.grad = spec.flat(xp), spec.flat(xp)
        self.param_views = spec.views(self.params)
        self.grad_views = spec.views(self.grad)

    def upload_params(self) -> None:
        if self.xp is not np:
            self.params.set(self.host_params)

    def download_grad(self) -> None:
        if self.xp is not np:
            self.grad.get(out=self.host_grad)
