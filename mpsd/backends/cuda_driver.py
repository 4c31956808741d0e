# The driver's plumbing for the CUDA backend: cuda-python imported only when a real GPU is asked for, and
# every call's status turned into a value or an exception where it is made.
"""cuda-python's driver and NVRTC, and their statuses."""

from __future__ import annotations

import functools
from typing import Any

from mpsd_protocol import OutOfMemoryError

__all__ = ["CudaFailure", "cuda_device_count"]


@functools.cache
def _bindings() -> tuple[Any, Any]:
    """cuda-python's driver and NVRTC modules, imported the first time a real GPU is asked for (CI has
    neither); cached, as every driver call's status goes through here. Before the driver starts, the daemon
    asks for the most hardware queues a context may have (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default, unless
    its environment says otherwise): streams beyond that share them, and a stream waiting at a gate
    (cuda.CudaGate) holds up every stream that shares its queue."""
    import os

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    # And every kernel loaded with its module: a kernel loaded at its first launch (CUDA's lazy loading, the
    # default) waits for the context's running work, which may be work waiting at a closed gate.
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    from cuda.bindings import driver, nvrtc

    return driver, nvrtc


def cuda_device_count() -> int:
    """GPUs the driver sees; 0 where cuda-python or a driver is missing."""
    try:
        cu, _ = _bindings()
        if cu.cuInit(0)[0] != cu.CUresult.CUDA_SUCCESS:
            return 0
        err, count = cu.cuDeviceGetCount()
        return count if err == cu.CUresult.CUDA_SUCCESS else 0
    except (ImportError, OSError, RuntimeError):
        return 0


class CudaFailure(RuntimeError):
    """A driver call failed where the runtime has no CUDA error to give for it."""


def _check(result: Any) -> Any:
    """The values a cuda-python call returns after its status, or CudaFailure."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status):  # CUDA_SUCCESS and NVRTC_SUCCESS are both 0
        cu, _ = _bindings()
        if status == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise OutOfMemoryError("the GPU has no room for it")
        raise CudaFailure(f"{status!r}")
    return values[0] if len(values) == 1 else tuple(values)
