# A module's kernels on a real GPU. A module is its Python declaration (mpsd.modules: the signatures and extents
# the runtime checks launches by) and the twin its CUDA names beside it: CUDA C, compiled here with NVRTC for the
# device's architecture, or PTX, which the driver compiles as it loads it. Each declared kernel must be an
# `extern "C" __global__` function of the twin with that name and its parameters in the declared order and kinds
# (ptr: a pointer, i64: long long, f32: float); the backend fills one ctypes value per parameter and launches it
# as it launches a built-in, but in one piece (a module's kernel takes no `base`, so a capped client's grid is
# not split: its blocks are held to the cap's SMs by its green context alone).
#
# The image is loaded with cuLibraryLoadData, not cuModuleLoadData: a module is bound to the context current when
# it loads, and the backend launches in a green context per capped client; a library's kernels launch in any
# context (CUDA 12's context-independent loading, which the built-ins use too). Both take the same cubin or PTX.
# cuda-python is imported by the backend (mpsd.backends.cuda_driver) only when a GPU is opened, so this module
# imports without it.
"""Modules' kernels on a real GPU: NVRTC, PTX and the driver's library loading."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from mpsd.backends.cuda_driver import CudaFailure, _check
from mpsd.backends.cuda_kernels import CTYPES, Kernel
from mpsd.modules import Module

__all__ = ["compile_source", "load_module"]


def compile_source(nvrtc: Any, source: bytes, name: str, major: int, minor: int) -> bytes:
    """CUDA C compiled with NVRTC for compute capability major.minor: its cubin.

    Raises:
        ValueError: it does not compile (NVRTC's log).
    """
    program = _check(nvrtc.nvrtcCreateProgram(source, name.encode(), 0, [], []))
    options = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-default-device"]
    try:
        try:
            _check(nvrtc.nvrtcCompileProgram(program, len(options), options))
        except CudaFailure:
            size = _check(nvrtc.nvrtcGetProgramLogSize(program))
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            raise ValueError(f"NVRTC could not compile {name}: {log.decode(errors='replace').strip()}") from None
        size = _check(nvrtc.nvrtcGetCUBINSize(program))
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin))
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def image(nvrtc: Any, twin: Path, major: int, minor: int) -> bytes:
    """What the driver loads for a twin: CUDA C compiled to a cubin, or PTX as it is (NUL-terminated, as
    cuLibraryLoadData reads PTX).

    Raises:
        ValueError: the file cannot be read, or does not compile.
    """
    try:
        text = twin.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read its CUDA twin {twin}: {exc.strerror or exc}") from None
    if twin.suffix == ".ptx":
        return text if text.endswith(b"\0") else text + b"\0"
    return compile_source(nvrtc, text, twin.name, major, minor)


def load_module(cu: Any, nvrtc: Any, module: Module, major: int, minor: int) -> dict[str, Kernel]:
    """The module's kernels, ready to launch: by their qualified names ("module.kernel"), each its CUkernel and
    argument buffer.

    Raises:
        ValueError: the module names no twin, or the twin does not compile or load, or lacks one of its kernels.
    """
    if module.cuda is None:
        raise ValueError(f"module {module.name} names no CUDA C or PTX twin (CUDA = \"file.cu\"): a GPU cannot "
                         "run its kernels")
    data = image(nvrtc, module.cuda, major, minor)
    try:
        library = _check(cu.cuLibraryLoadData(data, [], [], 0, [], [], 0))
    except CudaFailure as exc:
        raise ValueError(f"the driver refused {module.cuda.name}: {exc}") from None
    kernels: dict[str, Kernel] = {}
    for name, declared in module.kernels.items():
        try:
            function = _check(cu.cuLibraryGetKernel(library, name.encode()))
        except CudaFailure:
            raise ValueError(f"{module.cuda.name} has no extern \"C\" __global__ {name}") from None
        values: tuple[Any, ...] = tuple(CTYPES[kind]() for kind in declared.params)
        pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        kernels[declared.qualified] = Kernel(function, values, pointers, ctypes.addressof(pointers), None, None)
    return kernels
