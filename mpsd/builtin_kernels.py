# The built-in kernels, declared as any module's are (mpsd.modules): launches name them by their bare names, and
# every daemon has them without a --module-path. Their costs are the H200 model's calibrated ones
# (bench/fidelity/): spin waits on the clock, work issues FMAs at the SM's shared rate, the others move DRAM
# bytes (4 per element written or read); what they compute is numpy over the device's bytes.
"""The built-in kernels: spin, work, fill_f32, vector_add_f32, saxpy_f32, reduce_sum_f32."""

from __future__ import annotations

import numpy as np

from mpsd.modules import Args, Cost, Kernel, Module, module_of

__all__ = ["BUILTIN", "KERNELS"]


def _count(n: int | float) -> int:
    return max(int(n), 0)


def _f32(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.float32)


def _fill(views: list[memoryview], args: Args) -> None:
    _f32(views[0])[:] = np.float32(args[1])


def _vector_add(views: list[memoryview], args: Args) -> None:
    a, b, c = (_f32(v) for v in views)
    np.add(a, b, out=c)


def _saxpy(views: list[memoryview], args: Args) -> None:
    x, y = (_f32(v) for v in views)
    y += np.float32(args[0]) * x


def _reduce_sum(views: list[memoryview], args: Args) -> None:
    x, out = (_f32(v) for v in views)
    out[0] = np.sum(x, dtype=np.float32) if len(x) else np.float32(0)


def _spin_cost(args: Args, blocks: int, threads: int) -> Cost:
    # Each block busy-waits until clock64() has advanced `cycles` past its start. Time-slicing on a real H200
    # showed the clock running on while a context is switched out: a preempted 5-ms spin still took 5.0 ms from
    # start to end (bench/fidelity/h200_timing_host.json, "timeline, 2 x FULL spin 5 ms x 8").
    (cycles,) = args
    return Cost(cycles=float(cycles))


def _work_cost(args: Args, blocks: int, threads: int) -> Cost:
    (iters,) = args
    return Cost(work=float(iters) * threads)


class _Traffic:
    """A memory-bound kernel's cost: `per_element` DRAM bytes for each of its `args[count]` elements."""

    def __init__(self, per_element: int, count: int) -> None:
        self.per_element, self.count = per_element, count

    def __call__(self, args: Args, blocks: int, threads: int) -> Cost:
        if len(args) != self.count + 1:
            raise ValueError(f"{len(args)} arguments")
        return Cost(traffic=self.per_element * int(args[self.count]))


KERNELS = [
    Kernel("spin", ("i64",), _spin_cost, lambda a: [],
           doc="spin(cycles): every block busy-waits `cycles` clock cycles"),
    Kernel("work", ("i64",), _work_cost, lambda a: [],
           doc="work(iters): every thread runs `iters` dependent FMAs; co-resident blocks share an SM's issue rate"),
    Kernel("fill_f32", ("ptr", "f32", "i64"), _Traffic(4, 2), lambda a: [(0, 4 * _count(a[2]))], _fill,
           doc="fill_f32(ptr, value, n): ptr[0:n] = value"),
    Kernel("vector_add_f32", ("ptr", "ptr", "ptr", "i64"), _Traffic(12, 3),
           lambda a: [(0, 4 * _count(a[3])), (1, 4 * _count(a[3])), (2, 4 * _count(a[3]))], _vector_add,
           doc="vector_add_f32(a, b, c, n): c[i] = a[i] + b[i] for i < n"),
    Kernel("saxpy_f32", ("f32", "ptr", "ptr", "i64"), _Traffic(12, 3),
           lambda a: [(1, 4 * _count(a[3])), (2, 4 * _count(a[3]))], _saxpy,
           doc="saxpy_f32(alpha, x, y, n): y[i] = alpha * x[i] + y[i] for i < n"),
    Kernel("reduce_sum_f32", ("ptr", "ptr", "i64"), _Traffic(4, 2), lambda a: [(0, 4 * _count(a[2])), (1, 4)],
           _reduce_sum, doc="reduce_sum_f32(x, out, n): out[0] = x[0] + ... + x[n-1]"),
]

BUILTIN: Module = module_of("builtin", globals(), qualify=False)
