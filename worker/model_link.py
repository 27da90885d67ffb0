"""A model's own tensors tied to psgrid's flat buffers: weights written in, gradients gathered out.

A script's parameters live where its framework put them (PyTorch tensors, CuPy or NumPy arrays,
JAX arrays), one tensor each; psgrid exchanges one flat buffer (worker/flat.py). Each step the
pulled weights go from the flat buffer into the parameters and the gradients from their tensors
into the flat gradient, on the device where they are. For PyTorch both are one fused copy each
(``torch._foreach_copy_``: a few kernel launches for all the tensors, as DDP's gradient buckets
and Horovod's fusion buffer batch them) over views of the flat buffers that are made once; for
other arrays, one copy per parameter through their NumPy or CuPy view (worker/dlpack.py).
"""

from __future__ import annotations

import numpy as np

from psgrid.worker import dlpack


def _is_torch(a) -> bool:
    return type(a).__module__.split(".", 1)[0] == "torch"


class ModelLink:
    """The copies between a model's parameters (``originals``, by ``names``) and a flat buffer's views.

    Parameters
    ----------
    names : list of str
    originals : list
        The model's parameter tensors or arrays, in ``names``' order.
    views : list
        Their NumPy or CuPy views (:func:`dlpack.view`).
    xp : module
        numpy or cupy: where the flat buffers are.
    """

    def __init__(self, names: list[str], originals: list, views: list, xp):
        self.names, self.originals, self.xp = names, originals, xp
        self.shapes = {name: tuple(v.shape) for name, v in zip(names, views)}
        # Weights are written into the parameters themselves, where their framework lets them be changed.
        self.targets = [(name, v) for name, v, a in zip(names, views, originals) if dlpack.writable(a, v)]
        self.torch = bool(originals) and all(_is_torch(a) for a in originals)
        if self.torch:
            import torch

            self._torch = torch
            self._torch_targets = [
                a.detach() for name, a in zip(names, originals) if any(name == t for t, _ in self.targets)
            ]
        self._flat_views: list[tuple[dict, dict]] = []  # (a buffer's views by name, the same as torch tensors)

    # ----- weights in ------------------------------------------------------------------------------

    def weights_in(self, param_views: dict) -> None:
        """Copy the weights in ``param_views`` (a flat buffer's views by name) into the parameters; done on return
        as the parameters' framework sees it (its current stream is ordered after the copy)."""
        if self.torch:
            flat = self._as_torch(param_views, [name for name, _ in self.targets])
            with self._torch.no_grad():
                self._torch._foreach_copy_(self._torch_targets, flat)
            return
        for name, target in self.targets:
            target[...] = param_views[name]
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()  # the model's framework may read them on another stream

    # ----- gradients out ---------------------------------------------------------------------------

    def check(self, sources: list[tuple[str, object]]) -> None:
        """A gradient of the wrong shape is an :class:`dlpack.ArrayError` naming its parameter."""
        for name, source in sources:
            if source is None:
                continue
            shape = tuple(source.shape) if hasattr(source, "shape") else tuple(dlpack.view(source).shape)
            if shape != self.shapes[name]:
                raise dlpack.ArrayError(
                    f"the gradient of {name!r} has shape {shape}, the parameter {self.shapes[name]}"
                )

    def gradients_out(self, sources: list[tuple[str, object]], grad_views: dict) -> None:
        """Copy each ``(name, gradient)`` (:meth:`check`-ed) into ``grad_views`` (a flat gradient's views);
        None copies zeros."""
        if self.torch and all(s is None or _is_torch(s) for _, s in sources):
            self._torch_gradients_out(sources, grad_views)
            return
        for name, source in sources:
            _copy_into(grad_views[name], source, self.xp)

    def _torch_gradients_out(self, sources, grad_views: dict) -> None:
        torch = self._torch
        flat = dict(zip(self.names, self._as_torch(grad_views, self.names)))
        given = [(flat[name], source.detach()) for name, source in sources if source is not None]
        with torch.no_grad():
            if given:
                torch._foreach_copy_([t for t, _ in given], [s for _, s in given])
            for name, source in sources:
                if source is None:  # a parameter that took no part in the loss
                    flat[name].zero_()
        device = next(iter(flat.values())).device
        if device.type == "cuda" and torch.cuda.current_stream(device).cuda_stream != 0:
            # psgrid waits on CuPy's default stream before it pushes: a script on a stream of its own is waited for here.
            torch.cuda.current_stream(device).synchronize()

    def _as_torch(self, views: dict, names: list[str]) -> list:
        """The torch tensors over a flat buffer's views (made once per buffer: a pull-ahead or overlap has two)."""
        tensors = next((known for buffer, known in self._flat_views if buffer is views), None)
        if tensors is None:
            tensors = {name: self._torch.from_dlpack(views[name]) for name in self.names}
            self._flat_views.append((views, tensors))
        return [tensors[name] for name in names]


def _copy_into(target, source, xp) -> None:
    """Copy a gradient into a flat buffer's view (through a view of ``source``, never a copy in its framework)."""
    if source is None:  # a parameter that took no part in the loss
        target.fill(0)
        return
    array = dlpack.view(source)
    if dlpack.module_of(array) is not xp:
        from psgrid.worker.backend import to_host

        array = to_host(array) if xp is np else xp.asarray(array)
    target[...] = array
