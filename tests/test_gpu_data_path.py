"""A GPU worker's data path on every plane: weights onto the device, the gradient off it, checked on CuPy.

On the shared-memory plane the shard's own pages are page-locked in the worker (CudaPinner) and
copied to the device in one DMA, and the gradient is copied from the device straight into the
client's shared buffer, which the shard reads in place. These tests run where CuPy sees a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.psserver.spec import ModelSpec
from psgrid.worker.backend import pinner_for
from psgrid.worker.flat import FlatBuffers
from tests.gpu import cupy_or_skip

SPEC = ModelSpec([("w", (512, 300)), ("b", (300,))])


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_weights_reach_the_device_and_gradients_the_shards(cluster, data_plane):
    cupy = cupy_or_skip()
    c = cluster(2, mode="async", lr=1.0)
    rng = np.random.default_rng(0)
    init = rng.standard_normal(SPEC.size).astype(np.float32)
    with c.client(SPEC, init=init, pin_memory=pinner_for(cupy)) as client:
        bufs = FlatBuffers(SPEC, cupy, client)
        bufs.pull()
        np.testing.assert_array_equal(cupy.asnumpy(bufs.params), init)
        grad = rng.standard_normal(SPEC.size).astype(np.float32)
        bufs.grad[...] = cupy.asarray(grad)
        bufs.download_grad()
        assert bufs.host_grad is client.gradient_buffer()  # the push copies nothing more
        client.push(bufs.host_grad).wait()
        bufs.pull()
        np.testing.assert_allclose(cupy.asnumpy(bufs.params), init - grad, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(c.weights(), init - grad, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("data_plane", ["shm"])
@pytest.mark.timeout(60)
def test_shared_pages_are_page_locked_for_dma(cluster, data_plane):
    cupy = cupy_or_skip()
    c = cluster(1, mode="async", lr=1.0)
    with c.client(SPEC, init=np.zeros(SPEC.size, np.float32), pin_memory=pinner_for(cupy)) as client:
        assert client.data_planes == ["shm"]
        bufs = FlatBuffers(SPEC, cupy, client)
        bufs.pull()
        plane = client._conn.planes[0]
        mapped = list(plane.buffers.values())
        assert mapped
        for host in [*mapped, client.gradient_buffer()]:
            attributes = cupy.cuda.runtime.pointerGetAttributes(host.ctypes.data)
            assert attributes.type == cupy.cuda.runtime.memoryTypeHost, attributes.type  # registered, not pageable
