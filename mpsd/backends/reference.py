# What the built-in kernels (mpsd.runtime.kernels) do to device memory, computed on the CPU with numpy: the
# simulated backend runs these on the bytes of its memfd segments when a kernel completes, so programs get real
# results. Each takes memoryviews of the kernel's extents, in the order its signature lists them, and the
# arguments.
"""Reference implementations of the built-in kernels."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

Args = Sequence[int | float]


def _f32(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.float32)


def _nothing(views: list[memoryview], args: Args) -> None:
    return None


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


RUN: dict[str, Callable[[list[memoryview], Args], None]] = {
    "spin": _nothing, "work": _nothing, "fill_f32": _fill, "vector_add_f32": _vector_add, "saxpy_f32": _saxpy,
    "reduce_sum_f32": _reduce_sum,
}
