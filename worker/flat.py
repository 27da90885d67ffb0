"""Flat parameter and gradient buffers: one device array each, with per-parameter views.

The training loop and the few-lines trainer (api.py) share this one layout, and the copies
between the shards and the device happen here, as few as the exchange allows:

* a pull lands on the device straight from where the exchange has the weights: from a shard's
  own memory when it is on this host (one DMA, or one copy on the CPU), else from the pinned
  buffer a network plane received into;
* the gradient is computed into, or copied from the GPU into, the exchange's gradient buffer
  (shared memory a shard on this host reads in place), so a push copies nothing more;
* an exchange that keeps the weights on this GPU (``on_device``, the all-reduce baseline there)
  lends its weights as ``params`` and takes the gradient where it was computed: nothing crosses
  to the host;
* a client whose shards keep their weights on a GPU it reaches (CUDA IPC, ``device_push``) hands
  the pull a device array to copy from and pushes the device gradient itself: nothing crosses to
  the host either.

On the CPU the device arrays are host arrays: a pull is one copy, a gradient none.
"""

from __future__ import annotations

import numpy as np

from psgrid.psserver.spec import ModelSpec
from psgrid.worker.backend import pinned_empty


class FlatBuffers:
    """``params``/``grad`` on the device (views by name in ``param_views``/``grad_views``);
    ``host_grad`` what the exchange pushes from.

    Parameters
    ----------
    spec : ModelSpec
    xp : module
        numpy or cupy.
    exchange : optional
        The :class:`~psgrid.psserver.client.client.Client` (or another exchange with ``pull``/``push``)
        these buffers move through; one with ``gradient_buffer()`` lends the gradient's host
        memory, and one whose ``pull`` takes ``into=`` hands the weights over in place.
    double : bool
        Two host gradients, taken in turn (:meth:`swap_gradient`): the next gradient is
        computed (on the CPU) or copied from the GPU into one while the push of the other is in
        flight, so a step's compute overlaps the shards' update of the step before.
    """

    def __init__(self, spec: ModelSpec, xp, exchange=None, *, double: bool = False):
        self.xp = xp
        self.exchange = exchange
        self.in_place = exchange is not None and hasattr(exchange, "gradient_buffer")
        self.on_device = xp is not np and getattr(exchange, "on_device", False)
        self.device_push = (
            xp is not np and not self.on_device and getattr(exchange, "takes_device_gradients", lambda: False)()
        )
        count = 2 if double else 1
        if self.on_device or self.device_push:
            self.host_grads = []
        elif self.in_place:
            self.host_grads = [exchange.gradient_buffer(i) for i in range(count)]
        else:
            self.host_grads = [pinned_empty(spec.size, np.float32, xp) for _ in range(count)]
        self.current = 0
        self._host_params = None
        self._stream = None
        if xp is np:
            self.params = np.empty(spec.size, np.float32)
            self._grad_views = [spec.views(g) for g in self.host_grads]
            self.grads = []
        else:
            self.params = exchange.weights if self.on_device else spec.flat(xp)
            # Two device gradients where the push takes them as they are: the next is computed into one
            # while the other's push copies it out.
            self.grads = [spec.flat(xp) for _ in range(count if self.device_push else 1)]
            self._device_views = [spec.views(g) for g in self.grads]
            self.grad, self.grad_views = self.grads[0], self._device_views[0]
        self.param_views = spec.views(self.params)
        self._use(0)

    @property
    def host_grad(self) -> np.ndarray:
        """The host gradient of this step: what the exchange pushes from."""
        return self.host_grads[self.current]

    @property
    def pushed(self):
        """What the exchange pushes: the device gradient where the exchange takes one, else ``host_grad``."""
        return self.grad if self.on_device or self.device_push else self.host_grad

    def swap_gradient(self) -> None:
        """Take the other gradient buffer for this step (its push, of the step before last, has ended)."""
        self._use((self.current + 1) % len(self.grads if self.device_push else self.host_grads))

    def _use(self, index: int) -> None:
        self.current = index
        if self.xp is np:  # on the CPU the model writes its gradient straight into the host buffer
            self.grad, self.grad_views = self.host_grads[index], self._grad_views[index]
        elif self.device_push:
            self.grad, self.grad_views = self.grads[index], self._device_views[index]

    @property
    def host_params(self) -> np.ndarray:
        """A pinned host mirror of the weights, for exchanges that can only fill a host array."""
        if self.xp is np:
            return self.params
        if self._host_params is None:
            self._host_params = pinned_empty(self.params.size, np.float32, self.xp)
        return self._host_params

    def pull(self, exchange=None):
        """Pull the weights onto the device; returns the exchange's handle (done: versions in ``wait()``)."""
        exchange = exchange or self.exchange
        if self.xp is np or self.on_device:  # on the device: the exchange's own weights, or a device copy
            return exchange.pull(self.params)
        if self.in_place:
            return exchange.pull(into=self._to_device)
        handle = exchange.pull(self.host_params)
        self.upload_params()
        return handle

    def _to_device(self, begin: int, end: int, values: np.ndarray) -> None:
        # Called from the client's threads, one per shard: the device is named, not taken from the thread.
        # CuPy's set() only queues the copy (from page-locked memory it runs as a DMA after set() returns),
        # and ``values`` is the shard's own memory, which it may write again once this returns: wait for it.
        self.land(self.params, begin, end, values)

    def land(self, target, begin: int, end: int, values) -> None:
        """Copy ``values`` (host memory, or a shard's device array over CUDA IPC) into ``target[begin:end]``; done on return."""
        with target.device:
            stream = self.upload_stream()
            part = target[begin:end]
            if isinstance(values, np.ndarray):
                part.set(values, stream=stream)
            else:
                part.data.copy_from_device_async(values.data, part.nbytes, stream)
            stream.synchronize()

    def upload_stream(self):
        if self._stream is None:
            self._stream = self.xp.cuda.Stream(non_blocking=True)
        return self._stream

    def upload_params(self) -> None:
        """Copy ``host_params`` (filled by hand) to the device; done when this returns."""
        if self.xp is not np:
            stream = self.upload_stream()
            self.params.set(self.host_params, stream=stream)
            stream.synchronize()

    def download_grad(self) -> None:
        """Copy the gradient to ``host_grad`` (the exchange's buffer); nothing to do on the CPU.

        A gradient pushed from the device is only waited for: the push copies it on a stream of its
        own, which does not wait for the compute's.
        """
        if self.device_push:
            self.xp.cuda.get_current_stream().synchronize()
        elif self.xp is not np and not self.on_device:
            self.grad.get(out=self.host_grad)

    def use_params(self, params, views: dict) -> None:
        """Compute from ``params`` (an array like ``params``, with its ``views``) from now on: the pull-ahead's swap."""
        self.params, self.param_views = params, views

    def pull_to(self, target, *, background: bool = False):
        """Pull the weights into ``target``, a second array like ``params`` that the model does not read meanwhile.

        With ``background`` the pull runs on the exchange's threads and ``target`` is the pull's until its
        handle's ``wait()`` returns; on a GPU the weights land through the upload stream, so the copy runs
        beside the model's kernels. For exchanges that take ``into=`` (or on the CPU), as the pull-ahead
        (worker/prefetch.py) needs.
        """
        if self.xp is np:
            return self.exchange.pull(target, background=background)
        if self.on_device or not self.in_place:
            raise ValueError("a pull into a second device buffer needs an exchange that takes into=")
        # The model may have read ``target`` in the step before: its kernels end before the copy may begin.
        self.xp.cuda.get_current_stream().synchronize()
        # A pull made ahead has a step's compute to hide in, and each client thread beside the compute's
        # launches stretches them (benchmarks/host_step_parts.py): it takes none where the client posts its
        # calls (the shards on this host, over shared memory), else one, shard after shard.
        if background and getattr(self.exchange, "posts", lambda: False)():
            return self.exchange.post_pull(Landing(self, target))
        land = lambda begin, end, values: self.land(target, begin, end, values)  # noqa: E731
        return self.exchange.pull(into=land, background=background, one_thread=background)


class Landing:
    """Where a posted pull (Client.post_pull) lands: ranges of ``target`` on the device, from host memory.

    :meth:`queue` starts a range's copy on the buffers' upload stream, which runs beside the model's
    kernels, and returns; :meth:`wait` returns once all have ended. Calling it copies one range and
    returns when done (a shard the client pulls again in the usual way).
    """

    def __init__(self, bufs: FlatBuffers, target):
        self.bufs, self.target = bufs, target

    def queue(self, begin: int, end: int, values: np.ndarray) -> None:
        with self.target.device:
            self.target[begin:end].set(values, stream=self.bufs.upload_stream())

    def wait(self) -> None:
        self.bufs.upload_stream().synchronize()

    def __call__(self, begin: int, end: int, values) -> None:
        self.bufs.land(self.target, begin, end, values)
