# A user's module: a tiled single-precision matrix multiply, C = A @ B (row-major, A m x k, B k x n), in three
# tile sizes. A block of T x T threads computes a T x T tile of C, walking k in steps of T: each step loads a
# T x T tile of A and of B into shared memory (2 T^2 floats: its static shared memory) and every thread does T
# FMAs from it. So the tile size sets the cost: the grid reads A and B k/T times over from DRAM (traffic falls
# as 1/T), while each thread's arithmetic (an FMA and its two shared loads for each of k) stays; small tiles are
# bound by DRAM, large ones by the SMs' issue rate, and occupancy follows the shared memory and threads.
#   mpsd --module-path examples/modules ...  then  ctx.module_load("matmul"); ctx.launch("matmul.matmul_t16", ...)
# Its CUDA C twin, for a real GPU, is matmul.cu beside it.
import numpy as np

from mpsd.modules import Cost, Kernel

CUDA = "matmul.cu"
INSTRUCTIONS_PER_FMA = 3  # the FMA and its two shared-memory loads


def grid(m: int, n: int, tile: int) -> tuple[int, int]:
    """The grid a launch of the `tile` kernel takes for an m x n C: (x over columns, y over rows)."""
    return -(-n // tile), -(-m // tile)


def _cost(tile: int):
    def cost(args, blocks, threads):
        _a, _b, _c, m, n, k = args
        steps = -(-int(k) // tile)
        traffic = blocks * steps * 2 * tile * tile * 4 + 4 * int(m) * int(n)  # A and B tiles in, C out
        return Cost(work=float(threads) * steps * tile * INSTRUCTIONS_PER_FMA, traffic=traffic)
    return cost


def _extents(args):
    _a, _b, _c, m, n, k = (int(v) for v in args)
    m, n, k = max(m, 0), max(n, 0), max(k, 0)
    return [(0, 4 * m * k), (1, 4 * k * n), (2, 4 * m * n)]


def reference(views, args):
    a, b, c = (np.frombuffer(v, dtype=np.float32) for v in views)
    _pa, _pb, _pc, m, n, k = (int(v) for v in args)
    c[:] = (a.reshape(m, k) @ b.reshape(k, n)).ravel()


KERNELS = [
    Kernel(f"matmul_t{tile}", ("ptr", "ptr", "ptr", "i64", "i64", "i64"), _cost(tile), _extents, reference,
           registers=32 if tile < 32 else 40, shared=2 * tile * tile * 4, max_threads=tile * tile,
           doc=f"matmul_t{tile}(a, b, c, m, n, k): c = a @ b, blocks of {tile} x {tile} threads")
    for tile in (8, 16, 32)
]
