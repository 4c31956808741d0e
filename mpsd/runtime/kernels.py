# The built-in kernels: what each takes and what it does to device memory. How long a kernel takes is the
# simulator's business (mpsd.sim.costs); here is only the signature, the byte ranges each pointer argument
# touches (so every access is bounds-checked before anything is written) and a CPU reference that really
# computes on the device bytes with numpy.
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

Args = Sequence[int | float]


@dataclass(frozen=True, slots=True)
class KernelDef:
    """A built-in kernel.

    Attributes:
        params: parameter kinds, each "ptr", "i64" or "f32".
        extents: for given arguments, (argument index, bytes touched from that pointer) for each pointer used.
        run: computes the kernel on memoryviews of those extents (in the same order) and the arguments.
    """

    name: str
    params: tuple[str, ...]
    extents: Callable[[Args], list[tuple[int, int]]]
    run: Callable[[list[memoryview], Args], None]
    doc: str


def _f32(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.float32)


def _count(n: int | float) -> int:
    return max(int(n), 0)


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


KERNELS: dict[str, KernelDef] = {k.name: k for k in [
    KernelDef("spin", ("i64",), lambda a: [], _nothing,
              "spin(cycles): every block busy-waits `cycles` clock cycles"),
    KernelDef("work", ("i64",), lambda a: [], _nothing,
              "work(iters): every thread runs `iters` dependent FMAs; co-resident blocks share an SM's issue rate"),
    KernelDef("fill_f32", ("ptr", "f32", "i64"), lambda a: [(0, 4 * _count(a[2]))], _fill,
              "fill_f32(ptr, value, n): ptr[0:n] = value"),
    KernelDef("vector_add_f32", ("ptr", "ptr", "ptr", "i64"),
              lambda a: [(0, 4 * _count(a[3])), (1, 4 * _count(a[3])), (2, 4 * _count(a[3]))], _vector_add,
              "vector_add_f32(a, b, c, n): c[i] = a[i] + b[i] for i < n"),
    KernelDef("saxpy_f32", ("f32", "ptr", "ptr", "i64"),
              lambda a: [(1, 4 * _count(a[3])), (2, 4 * _count(a[3]))], _saxpy,
              "saxpy_f32(alpha, x, y, n): y[i] = alpha * x[i] + y[i] for i < n"),
    KernelDef("reduce_sum_f32", ("ptr", "ptr", "i64"), lambda a: [(0, 4 * _count(a[2])), (1, 4)], _reduce_sum,
              "reduce_sum_f32(x, out, n): out[0] = x[0] + ... + x[n-1]"),
]}


def signatures() -> dict[str, list[str]]:
    """Every kernel's parameter kinds, as the handshake sends them to clients."""
    return {name: list(k.params) for name, k in KERNELS.items()}
