"""The array backend: numpy without a GPU, cupy with one, and cupy never imported on a CPU run."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from psgrid.worker import backend
from psgrid.worker.backend import array_module, get_xp, pinned_empty, sync, to_host
from tests.gpu import cupy_or_skip

REPO = Path(__file__).resolve().parents[1]


def test_cpu_is_numpy():
    assert get_xp("cpu") == (np, "cpu")


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="device must be one of"):
        get_xp("tpu")


def test_gpu_without_cupy_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(RuntimeError, match=r"install psgrid\[gpu\] or use device='cpu'"):
        get_xp("gpu")
    with pytest.raises(RuntimeError, match="no CUDA GPU/CuPy"):
        backend.select_gpu(0)


def test_auto_without_cupy_falls_back_to_numpy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert get_xp("auto") == (np, "cpu")


def test_host_helpers_on_numpy():
    a = np.arange(6.0).reshape(2, 3)
    assert to_host(a) is a
    assert isinstance(to_host([1, 2]), np.ndarray)
    assert array_module(a) is np
    sync(np)  # a no-op
    p = pinned_empty(5, np.float32, np)
    assert p.shape == (5,) and p.dtype == np.float32
    assert pinned_empty((2, 3), np.int64, np).shape == (2, 3)


def test_cpu_run_never_imports_cupy():
    """A device='cpu' process that builds a model, trains a step and loads batches never tries to import cupy."""
    script = textwrap.dedent("""
        import sys

        tried = []

        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("cupy", "cupyx"):
                    tried.append(name)
                return None

        sys.meta_path.insert(0, Watch())

        from psgrid.worker.backend import get_xp, to_host, sync
        from psgrid.worker.data import BatchLoader, load_dataset
        from psgrid.worker.models import accuracy, build_model

        xp, name = get_xp("cpu")
        ds = load_dataset("synthetic", features=16, samples=64, classes=3, test_samples=8)
        model = build_model("mlp", ds.input_shape, ds.num_classes, hidden=(8,))
        params = {k: xp.asarray(v) for k, v in model.init_params(0).items()}
        grads = model.spec.views(model.spec.flat(xp))
        with BatchLoader(ds.train_x, ds.train_y, 16, xp=xp, epochs=1) as loader:
            for x, y in loader:
                loss = model.loss_and_grad(params, x, y, grads)
        sync(xp)
        to_host(loss)
        accuracy(model, params, ds.test_x, ds.test_y)
        assert name == "cpu", name
        assert "cupy" not in sys.modules, "cupy was imported"
        assert not tried, f"an import of {tried} was attempted"
        print("ok")
    """)
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.gpu
def test_gpu_backend():
    cupy = cupy_or_skip()
    xp, name = get_xp("gpu")
    assert xp is cupy and name.startswith("cuda:")
    assert get_xp("auto")[0] is cupy
    assert backend.select_gpu(0) == 0
    a = cupy.arange(10, dtype=cupy.float32)
    assert array_module(a) is cupy
    host = to_host(a)
    assert isinstance(host, np.ndarray) and host.tolist() == list(range(10))
    pinned = pinned_empty((4, 3), np.float32, cupy)
    assert isinstance(pinned, np.ndarray) and pinned.shape == (4, 3) and pinned.dtype == np.float32
    pinned[...] = 1.5
    d = cupy.empty((4, 3), cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    d.set(pinned, stream=stream)
    stream.synchronize()
    sync(cupy)
    assert float(d.sum()) == 18.0
