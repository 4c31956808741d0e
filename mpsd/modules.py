# Kernels of one's own: the vocabulary a module declares its kernels in, and the reader that turns a module file
# into a `Module`. A module is a Python file whose top level binds KERNELS to a list of `Kernel`s (and, for a real
# GPU, CUDA to the CUDA C or PTX file of their twins beside it). The built-in kernels are such a module too
# (mpsd.builtin_kernels), so every layer reads one kind of declaration: the runtime its signature, extents and
# resources (a launch's checks, occupancy), the simulator its cost, the simulated backend its numpy reference, the
# CUDA backend its twin's name. It imports nothing of mpsd (nor mpsd_protocol), so that the simulator can read
# the built-ins' costs from here as the runtime reads their signatures; a file's faults are `ModuleError`s, which
# the runtime turns into CUDA's errors.
"""Declaring kernels, and reading module files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["PARAM_KINDS", "Cost", "Kernel", "Module", "ModuleError", "read_module", "module_of"]

PARAM_KINDS = ("ptr", "i64", "f32")  # mpsd_protocol's PARAM_KINDS (a test holds the two equal)
MAX_REGISTERS = 255  # per thread, as sm_90's ISA allows
MAX_THREADS = 1024
Args = Sequence[int | float]


@dataclass(frozen=True, slots=True)
class Cost:
    """What one launch of a kernel costs, in the simulator's terms: give one or more; where several are given,
    whichever takes a block longest alone bounds it, and its blocks share what bounds them (a roofline).

    Attributes:
        seconds: each block's fixed time (latency-bound: co-resident blocks do not slow it).
        cycles: each block waits this many SM clock cycles (as a clock64() loop: the clock runs on while it
            is preempted).
        work: each block's thread-instructions (a dependent FMA a thread is one), which co-resident blocks
            issue at the SM's shared rate.
        traffic: the DRAM bytes the whole grid moves, at the device's bandwidth shared by every resident
            memory-bound block.
        weight: for traffic, what each thread counts for on the DRAM curve (a kernel that keeps more bytes in
            flight per thread than c = a + b counts more).
    """

    seconds: float | None = None
    cycles: float | None = None
    work: float | None = None
    traffic: float | None = None
    weight: float = 1.0


@dataclass(frozen=True, slots=True, eq=False)
class Kernel:
    """A kernel: its signature, what one block holds of an SM, its cost and, optionally, what it computes.

    Attributes:
        name: its name within the module (an identifier).
        params: parameter kinds, each "ptr", "i64" or "f32".
        cost: ``cost(args, blocks, threads) -> Cost`` for a launch of `blocks` blocks of `threads` threads.
        extents: ``extents(args) -> [(argument index, bytes touched from that pointer)]``, one pair for each
            pointer the kernel touches: each is bounds-checked before the kernel runs (a pointer outside live
            memory is an illegal address), and the reference gets a view of exactly those bytes. Needed where a
            parameter is a pointer.
        reference: ``reference(views, args)``: computes the kernel on memoryviews of its extents, in their order
            (None: it changes no bytes the emulator shows).
        registers: registers per thread (occupancy: the SM's register file holds so many).
        shared: static shared memory per block, in bytes (beside a launch's dynamic shared memory).
        max_threads: the most threads a block may have (``__launch_bounds__``).
        doc: one line on what it does.
        module: the module's name, set when the module is made (``module.name`` is how launches name it).
    """

    name: str
    params: tuple[str, ...]
    cost: Callable[[Args, int, int], Cost]
    extents: Callable[[Args], Sequence[tuple[int, int]]] | None = None
    reference: Callable[[list[memoryview], Args], None] | None = None
    registers: int = 32
    shared: int = 0
    max_threads: int = MAX_THREADS
    doc: str = ""
    module: str = field(default="", compare=False)

    @property
    def qualified(self) -> str:
        """The name a launch gives: ``module.kernel`` (a built-in's bare name)."""
        return f"{self.module}.{self.name}" if self.module else self.name


@dataclass(frozen=True, slots=True, eq=False)
class Module:
    """A module's kernels by name, where it was read from, and the CUDA C or PTX file of their twins (None:
    none; the CUDA backend cannot run it)."""

    name: str
    kernels: dict[str, Kernel]
    path: Path | None = None
    cuda: Path | None = None


class ModuleError(ValueError):
    """A module file that cannot be read, or whose declarations are wrong: the reason, for the client."""


def module_of(name: str, namespace: dict[str, Any], path: Path | None = None, qualify: bool = True) -> Module:
    """The module a file's top level declared (`namespace`: its globals), every declaration checked.

    Args:
        qualify: launches name its kernels ``name.kernel`` (False: by their bare names, as the built-ins).

    Raises:
        ModuleError: no KERNELS, or a declaration that is wrong (saying which and why).
    """
    declared = namespace.get("KERNELS")
    if not isinstance(declared, (list, tuple)) or not declared:
        raise ModuleError("a module binds KERNELS to a non-empty list of mpsd.modules.Kernel")
    kernels: dict[str, Kernel] = {}
    for index, kernel in enumerate(declared):
        if not isinstance(kernel, Kernel):
            raise ModuleError(f"KERNELS[{index}] is a {type(kernel).__name__}, not an mpsd.modules.Kernel")
        _check(kernel)
        if kernel.name in kernels:
            raise ModuleError(f"two kernels named {kernel.name!r}")
        object.__setattr__(kernel, "module", name if qualify else "")
        kernels[kernel.name] = kernel
    cuda = namespace.get("CUDA")
    twin: Path | None = None
    if cuda is not None:
        if not isinstance(cuda, (str, Path)):
            raise ModuleError("CUDA names the CUDA C (.cu) or PTX (.ptx) file of the kernels' twins")
        twin = Path(cuda) if path is None else path.parent / cuda
        if twin.suffix not in (".cu", ".ptx"):
            raise ModuleError(f"CUDA {str(cuda)!r} is neither a .cu nor a .ptx file")
    return Module(name, kernels, path, twin)


def _check(kernel: Kernel) -> None:
    where = f"kernel {kernel.name!r}" if isinstance(kernel.name, str) else "a kernel"
    if not isinstance(kernel.name, str) or not kernel.name.isidentifier():
        raise ModuleError(f"{where}: its name must be an identifier")
    if not isinstance(kernel.params, tuple) or any(p not in PARAM_KINDS for p in kernel.params):
        raise ModuleError(f"{where}: params must be a tuple of {', '.join(PARAM_KINDS)}, not {kernel.params!r}")
    if not callable(kernel.cost):
        raise ModuleError(f"{where}: cost must be a function (args, blocks, threads) -> Cost")
    if kernel.extents is None and "ptr" in kernel.params:
        raise ModuleError(f"{where}: it takes pointers, so it needs extents (what each one touches)")
    for attr in ("extents", "reference"):
        if getattr(kernel, attr) is not None and not callable(getattr(kernel, attr)):
            raise ModuleError(f"{where}: {attr} must be a function or None")
    for attr, low, high in (("registers", 0, MAX_REGISTERS), ("shared", 0, 1 << 30), ("max_threads", 1, MAX_THREADS)):
        value = getattr(kernel, attr)
        if type(value) is not int or not low <= value <= high:
            raise ModuleError(f"{where}: {attr} must be an int from {low} to {high}, not {value!r}")


def read_module(path: Path) -> Module:
    """Run a module file and take what it declares; its name is the file's stem. Anything the file does wrong
    (a syntax error, an exception at its top level, even SystemExit) is a ModuleError, so that a bad file never
    takes down the daemon that reads it.

    Raises:
        ModuleError: the file cannot be read, does not run, or declares kernels wrongly.
    """
    name = path.stem
    if not name.isidentifier():
        raise ModuleError(f"{path.name}: a module's name (its file's stem) must be an identifier")
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise ModuleError(f"cannot read {path}: {exc.strerror or exc}") from None
    namespace: dict[str, Any] = {"__name__": f"mpsd_module_{name}", "__file__": str(path)}
    try:
        exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 (the operator's --module-path chose it)
    except SyntaxError as exc:
        raise ModuleError(f"{path.name}, line {exc.lineno}: {exc.msg}") from None
    except (Exception, SystemExit) as exc:  # its top level failed: the reason, not a traceback in the daemon
        raise ModuleError(f"{path.name} raised {type(exc).__name__}: {exc}") from None
    return module_of(name, namespace, path)

