# The CUDA backend's built-in kernels: their CUDA C source, the parameter kinds their module declares
# (mpsd.builtin_kernels), and their compilation, once per daemon, with NVRTC for the device's architecture.
# The kernels whose blocks differ take two more parameters than their signature, last: the launch's first block
# (`base`) and the blocks of the whole grid (`total`), so that the backend can give a capped client's grid as
# several launches in a row (CudaBackend._launch) and each block still computes what it would in one; spin's and
# work's blocks are all alike (and bench/ launches them straight, with their signature's one argument).
"""The built-in kernels on a real GPU."""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Any

from mpsd.backends.cuda_driver import CudaFailure, _check
from mpsd.builtin_kernels import BUILTIN

__all__ = ["CTYPES", "KERNEL_PARAMS", "Kernel", "compile_kernels", "kernel_source"]

# Each kernel's parameters as C declares them and its body, a device function the kernel calls: the kernels are
# made from these twice, as they are and, for a traced device (`mpsd --trace`), with one more parameter last
# (where to write what each block did: mpsd.backends.cuda_trace), so that the body runs the same in both.
BODIES = {
    "spin": ("long long cycles", """
    long long start = clock64();
    while (clock64() - start < cycles) { }"""),
    "work": ("long long iters", """
    float x = threadIdx.x;
    for (long long i = 0; i < iters; ++i) x = fmaf(x, 0.9999999f, 1e-7f);
    if (x == -12345.0f) *(volatile float *)0 = x;  /* never true: keeps the loop */"""),
    "fill_f32": ("float *p, float value, long long n, long long base, long long total", """
    for (long long i = (base + blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += total * blockDim.x)
        p[i] = value;"""),
    "vector_add_f32": ("const float *a, const float *b, float *c, long long n, long long base, long long total", """
    for (long long i = (base + blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += total * blockDim.x)
        c[i] = a[i] + b[i];"""),
    "saxpy_f32": ("float alpha, const float *x, float *y, long long n, long long base, long long total", """
    for (long long i = (base + blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += total * blockDim.x)
        y[i] = alpha * x[i] + y[i];"""),
    "reduce_sum_f32": ("const float *x, float *out, long long n, long long base, long long total", """
    __shared__ float partial[1024];
    if (base + blockIdx.x != 0) return;  /* one block sums it all, so the result does not depend on the grid */
    float sum = 0.0f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) sum += x[i];
    partial[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float whole = 0.0f;
        for (unsigned t = 0; t < blockDim.x; ++t) whole += partial[t];
        out[0] = whole;
    }"""),
}
# A traced block's record, two words at its place in the launch's slots: when its first thread began (the GPU's
# global timer, ns), and its time (ns, up to 2^32) above the SM it ran on. Its last thread to finish writes it,
# after the block's barrier (every body returns to the kernel, never out of it). A null pointer: not traced.
TRACE_PARAM = ", unsigned long long *mpsd_trace"
TRACE_BEGIN = """
    unsigned long long mpsd_began;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(mpsd_began));"""
TRACE_END = """
    __syncthreads();
    if (mpsd_trace != 0 && threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        unsigned long long now;
        unsigned sm;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        asm("mov.u32 %0, %%smid;" : "=r"(sm));
        unsigned long long slot = blockIdx.x + gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
        mpsd_trace[2 * slot] = mpsd_began;
        mpsd_trace[2 * slot + 1] = ((now - mpsd_began) << 32) | sm;
    }"""
STAMP = """
extern "C" __global__ void mpsd_stamp(unsigned long long *out) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    out[0] = now;
}"""


def kernel_source(traced: bool) -> str:
    """The built-in kernels' CUDA C, traced or not."""
    parts = []
    for name, (params, body) in BODIES.items():
        args = ", ".join(re.split(r"[ *]", p.strip())[-1] for p in params.split(","))
        parts.append(f"__device__ __forceinline__ void {name}_body({params}) {{{body}\n}}")
        parts.append(f'extern "C" __global__ void {name}({params}{TRACE_PARAM if traced else ""}) {{'
                     f'{TRACE_BEGIN if traced else ""}\n    {name}_body({args});{TRACE_END if traced else ""}\n}}')
    return "\n".join(parts) + (STAMP if traced else "")


KERNEL_PARAMS = {name: kernel.params for name, kernel in BUILTIN.kernels.items()}  # as their module declares
PLACED = frozenset(KERNEL_PARAMS) - {"spin", "work"}  # kernels that take `base` and `total`
CTYPES = {"ptr": ctypes.c_uint64, "i64": ctypes.c_int64, "f32": ctypes.c_float}


@dataclass(eq=False, slots=True)
class Kernel:
    """A built-in kernel and its argument buffer: one ctypes value per parameter, then `base` and `total` where
    its blocks differ (None where they do not), and the array of their addresses, filled in place for each launch
    (cuLaunchKernel copies the arguments when it is called)."""

    function: Any
    values: tuple[Any, ...]
    pointers: Any
    address: int
    base: Any
    total: Any
    trace: Any = None  # where its blocks write their records (traced kernels only)


def compile_kernels(cu: Any, nvrtc: Any, major: int, minor: int, traced: bool = False) -> dict[str, Kernel]:
    """The built-in kernels compiled with NVRTC for compute capability major.minor, each with its argument
    buffer; `traced`, the kernels that write what each block did, and "mpsd_stamp" (which writes the GPU's
    timer at one address) among them."""
    program = _check(nvrtc.nvrtcCreateProgram(kernel_source(traced).encode(), b"mpsd_kernels.cu", 0, [], []))
    options = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-default-device"]
    try:
        _check(nvrtc.nvrtcCompileProgram(program, len(options), options))
    except CudaFailure:
        size = _check(nvrtc.nvrtcGetProgramLogSize(program))
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
        raise CudaFailure(f"NVRTC could not compile the built-in kernels: {log.decode(errors='replace')}")
    size = _check(nvrtc.nvrtcGetCUBINSize(program))
    cubin = b" " * size
    _check(nvrtc.nvrtcGetCUBIN(program, cubin))
    # A library's kernels are not bound to one context: they launch in whichever a stream belongs to.
    library = _check(cu.cuLibraryLoadData(cubin, [], [], 0, [], [], 0))
    kernels: dict[str, Kernel] = {}
    for name, params in (KERNEL_PARAMS | ({"mpsd_stamp": ("ptr",)} if traced else {})).items():
        values = tuple(CTYPES[kind]() for kind in params)
        base, total = (ctypes.c_int64(), ctypes.c_int64()) if name in PLACED else (None, None)
        trace = ctypes.c_uint64() if traced and name in KERNEL_PARAMS else None
        every = (*values, *((base, total) if name in PLACED else ()), *(() if trace is None else (trace,)))
        pointers = (ctypes.c_void_p * len(every))(*[ctypes.addressof(v) for v in every])
        kernels[name] = Kernel(_check(cu.cuLibraryGetKernel(library, name.encode())), values, pointers,
                               ctypes.addressof(pointers), base, total, trace)
    return kernels
