# The built-in kernels as CUDA's runtime sees them: each one's signature and the byte ranges each pointer
# argument touches, so every access is bounds-checked against the client's address space before it runs. They
# are declared as a module's kernels are (mpsd.builtin_kernels, in mpsd.modules' terms): what a kernel does is
# its backend's business (the simulator models its cost and computes it with its numpy reference; a GPU runs the
# compiled kernel).
from __future__ import annotations

from mpsd.builtin_kernels import BUILTIN
from mpsd.modules import Kernel

KERNELS: dict[str, Kernel] = BUILTIN.kernels


def signatures() -> dict[str, list[str]]:
    """Every built-in kernel's parameter kinds, as the handshake sends them to clients."""
    return {name: list(k.params) for name, k in KERNELS.items()}
