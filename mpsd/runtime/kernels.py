# The built-in kernels as CUDA's runtime sees them: each one's signature and the byte ranges each pointer
# argument touches, so every access is bounds-checked against the client's address space before it runs. What
# a kernel does is its backend's business: the simulator computes it with numpy (mpsd.backends.reference) and
# models how long it takes (mpsd.sim.costs); a GPU runs the compiled kernel.
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Args = Sequence[int | float]


@dataclass(frozen=True, slots=True)
class KernelDef:
    """A built-in kernel.

    Attributes:
        params: parameter kinds, each "ptr", "i64" or "f32".
        extents: for given arguments, (argument index, bytes touched from that pointer) for each pointer used.
    """

    name: str
    params: tuple[str, ...]
    extents: Callable[[Args], list[tuple[int, int]]]
    doc: str


def _count(n: int | float) -> int:
    return max(int(n), 0)


KERNELS: dict[str, KernelDef] = {k.name: k for k in [
    KernelDef("spin", ("i64",), lambda a: [],
              "spin(cycles): every block busy-waits `cycles` clock cycles"),
    KernelDef("work", ("i64",), lambda a: [],
              "work(iters): every thread runs `iters` dependent FMAs; co-resident blocks share an SM's issue rate"),
    KernelDef("fill_f32", ("ptr", "f32", "i64"), lambda a: [(0, 4 * _count(a[2]))],
              "fill_f32(ptr, value, n): ptr[0:n] = value"),
    KernelDef("vector_add_f32", ("ptr", "ptr", "ptr", "i64"),
              lambda a: [(0, 4 * _count(a[3])), (1, 4 * _count(a[3])), (2, 4 * _count(a[3]))],
              "vector_add_f32(a, b, c, n): c[i] = a[i] + b[i] for i < n"),
    KernelDef("saxpy_f32", ("f32", "ptr", "ptr", "i64"),
              lambda a: [(1, 4 * _count(a[3])), (2, 4 * _count(a[3]))],
              "saxpy_f32(alpha, x, y, n): y[i] = alpha * x[i] + y[i] for i < n"),
    KernelDef("reduce_sum_f32", ("ptr", "ptr", "i64"), lambda a: [(0, 4 * _count(a[2])), (1, 4)],
              "reduce_sum_f32(x, out, n): out[0] = x[0] + ... + x[n-1]"),
]}


def signatures() -> dict[str, list[str]]:
    """Every kernel's parameter kinds, as the handshake sends them to clients."""
    return {name: list(k.params) for name, k in KERNELS.items()}
