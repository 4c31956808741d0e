# Kernels of one's own, as CUDA's module calls see them. A module's reference code runs inside the daemon, as a
# kernel runs inside the GPU's server, so the daemon reads module files only from the directories its operator
# named (--module-path): `ModuleLibrary` holds that rule and each file read (once, until it changes), and gives
# every fault a CUDA error: a file outside the directories or missing is the driver's CUDA_ERROR_FILE_NOT_FOUND,
# one that does not run or declares its kernels wrongly CUDA_ERROR_INVALID_IMAGE, with the reason. `ModuleCalls`,
# mixed into the client's Context, is what a client loaded: launches name a module's kernel "module.kernel"
# (Context.plan looks it up through `function`), and its attributes and occupancy are its declaration's.
"""Modules: which files a client may load, and what a context has loaded."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpsd_protocol import (
    InvalidConfigurationError,
    InvalidDeviceFunctionError,
    InvalidKernelImageError,
    InvalidResourceHandleError,
    InvalidValueError,
    KernelFileNotFoundError,
    brief,
    dims,
)

from mpsd.modules import Kernel, Module, ModuleError, read_module
from mpsd.runtime.kernels import KERNELS

if TYPE_CHECKING:
    from mpsd.backends.base import Backend

__all__ = ["MAX_MODULES", "ModuleCalls", "ModuleLibrary"]

MAX_MODULES = 256  # modules one context may hold at once
_MAX_READ = 1024  # files a device keeps read


class ModuleLibrary:
    """The module files a device's clients may load: those within `directories`, each read once (again when it
    changes: its size or mtime), its kernels made ready on `backend` (a GPU compiles their twins)."""

    def __init__(self, directories: tuple[Path, ...], backend: Backend) -> None:
        self.directories = tuple(Path(d).resolve() for d in directories)
        self.backend = backend
        self._read: dict[tuple[str, int, int], Module] = {}

    def find(self, path: str) -> Path:
        """The file `path` names: an absolute path within one of the directories, or a path relative to them (the
        first directory that has it wins; a name without a suffix is also looked for as name.py).

        Raises:
            InvalidValueError: an empty path. KernelFileNotFoundError: none such within the directories.
        """
        if not path or "\0" in path:
            raise InvalidValueError(f"module path {brief(path, 60)} is empty or holds a NUL")
        where = ", ".join(map(str, self.directories))
        if not self.directories:
            raise KernelFileNotFoundError(f"{brief(path, 80)}: this daemon loads no modules (it has no "
                                          "--module-path)")
        given = Path(path)
        tries = [given] if given.is_absolute() else [d / given for d in self.directories]
        inside = False
        for candidate in tries:
            for name in (candidate, *(() if candidate.suffix else (candidate.with_suffix(".py"),))):
                resolved = name.resolve()
                if not any(resolved.is_relative_to(d) for d in self.directories):
                    continue  # (a symlink or .. that leads out is no way in)
                inside = True
                if resolved.is_file():
                    return resolved
        if not inside:
            raise KernelFileNotFoundError(f"{brief(path, 80)} is outside the daemon's --module-path ({where})")
        raise KernelFileNotFoundError(f"no module {brief(path, 80)} in the daemon's --module-path ({where})")

    def load(self, path: str) -> Module:
        """The module of the file `path` names, read (and made ready on the device) the first time.

        Raises:
            InvalidValueError, KernelFileNotFoundError: as `find`.
            InvalidKernelImageError: the file is no module (not Python, does not run, declares kernels wrongly),
                or the device cannot run it (its reason).
        """
        found = self.find(path)
        if found.suffix != ".py":
            raise InvalidKernelImageError(f"{found.name}: a module is a Python file declaring its kernels "
                                          "(mpsd.modules); its CUDA C or PTX twin is the file its CUDA names")
        try:
            stat = found.stat()
        except OSError as exc:
            raise KernelFileNotFoundError(f"{found}: {exc.strerror}") from None
        key = (str(found), stat.st_mtime_ns, stat.st_size)
        module = self._read.get(key)
        if module is None:
            try:
                module = read_module(found)
                self.backend.load_module(module)
            except ModuleError as exc:
                raise InvalidKernelImageError(str(exc)) from None
            except ValueError as exc:  # the device's reason (a compile error, no twin)
                raise InvalidKernelImageError(f"{found.name}: {exc}") from None
            if len(self._read) >= _MAX_READ:
                self._read.clear()
            self._read[key] = module
        return module


class ModuleCalls:
    """The module calls of a client's context (mixed into mpsd.runtime.context.Context): the modules it loaded,
    by handle and by name, and its kernels' lookup for launches."""

    device: Any
    backend: Any
    _plans: dict[Any, Any]
    _handle: Any

    def _modules_init(self) -> None:
        self.modules: dict[int, Module] = {}  # handle -> module
        self._module_names: dict[str, tuple[int, int]] = {}  # name -> (handle, loads not yet unloaded)

    def module_load(self, path: str) -> dict[str, Any]:
        """``cuModuleLoad``: the module at `path` (mpsd.runtime.modules.ModuleLibrary's rules). Loading a module
        this context holds already gives its handle again (one more load for `module_unload` to undo).

        Raises:
            KernelFileNotFoundError, InvalidKernelImageError: as ModuleLibrary.load.
            InvalidValueError: a module of the same name from another file is loaded, or too many are.
        """
        module = self.device.modules.load(path)
        held = self._module_names.get(module.name)
        if held is not None:
            handle, loads = held
            if self.modules[handle].path != module.path:
                raise InvalidValueError(f"a module named {module.name!r} is loaded already, from "
                                        f"{self.modules[handle].path}: unload it first")
            self._module_names[module.name] = (handle, loads + 1)
        else:
            if len(self.modules) >= MAX_MODULES:
                raise InvalidValueError(f"a context holds {MAX_MODULES} modules at most")
            handle = self._handle()
            self.modules[handle] = module
            self._module_names[module.name] = (handle, 1)
        return {"module": handle, "name": module.name,
                "functions": {name: list(k.params) for name, k in module.kernels.items()}}

    def module_unload(self, module: int) -> None:
        """``cuModuleUnload``: one load of the module less; with the last, launches can no longer name its kernels
        (work queued before still runs).

        Raises:
            InvalidResourceHandleError: no such module in this context.
        """
        found = self.modules.get(module)
        if found is None:
            raise InvalidResourceHandleError(f"no module {brief(module, 20)} in this context")
        handle, loads = self._module_names[found.name]
        if loads > 1:
            self._module_names[found.name] = (handle, loads - 1)
            return
        del self.modules[module], self._module_names[found.name]
        self._plans.clear()  # plans of its kernels must not be found again

    def function(self, name: str) -> Kernel:
        """The kernel a launch names: a built-in's bare name, or "module.kernel" of a module this context holds.

        Raises:
            InvalidDeviceFunctionError: no such kernel.
        """
        found = KERNELS.get(name)
        if found is not None:
            return found
        module, _, kernel = name.partition(".") if type(name) is str else ("", "", "")
        held = self._module_names.get(module)
        found = self.modules[held[0]].kernels.get(kernel) if held is not None else None
        if found is None:
            raise InvalidDeviceFunctionError(f"no kernel named {brief(name, 60)}"
                                             + ("" if held is not None or not kernel else
                                                f" (no module {brief(module, 40)} is loaded)"))
        return found

    def func_get_attributes(self, name: str) -> dict[str, Any]:
        """``cuFuncGetAttribute``'s answers for the kernel `name` names, as its declaration gives them.

        Raises:
            InvalidDeviceFunctionError: no such kernel.
        """
        kernel = self.function(name)
        properties = self.device.properties
        warp = properties["warp_size"]
        most = 0  # the largest block that fits, in whole warps, within its launch bounds
        for threads in range(kernel.max_threads - kernel.max_threads % warp, 0, -warp):
            if self.backend.fits(threads, kernel.shared, kernel.registers):
                most = threads
                break
        return {"max_threads_per_block": most, "shared_size_bytes": kernel.shared, "const_size_bytes": 0,
                "local_size_bytes": 0, "num_regs": kernel.registers,
                "ptx_version": 10 * properties["major"] + properties["minor"],
                "binary_version": 10 * properties["major"] + properties["minor"],
                "max_dynamic_shared_size_bytes": max(0, properties["shared_memory_per_block_optin"] - kernel.shared),
                "params": list(kernel.params)}

    def occupancy_max_active_blocks(self, name: str, block: object, shared_mem: int) -> int:
        """``cudaOccupancyMaxActiveBlocksPerMultiprocessor``: the blocks of `block` threads of the kernel with
        `shared_mem` bytes of dynamic shared memory one SM holds at once, by its declared registers and static
        shared memory (0 where none fits).

        Raises:
            InvalidDeviceFunctionError: no such kernel. InvalidValueError: a bad block or shared memory size.
        """
        kernel = self.function(name)
        try:
            bx, by, bz = dims(block, self.device.properties["max_block_dims"], "block")
        except InvalidConfigurationError as exc:  # the driver's answer for a bad block size
            raise InvalidValueError(str(exc.detail)) from None
        if type(shared_mem) is not int or shared_mem < 0:
            raise InvalidValueError(f"dynamic shared memory {brief(shared_mem, 20)} is not a byte count")
        return int(self.backend.occupancy(kernel, bx * by * bz, shared_mem))


def check_extents(kernel: Kernel, values: list[int | float]) -> tuple[tuple[int, int], ...]:
    """What a kernel's pointer arguments touch, from its declaration: a module's extents are checked (each a
    pointer parameter, a byte count), and whatever its function raises is the launch's invalid value, not the
    daemon's fault.

    Raises:
        InvalidValueError: its extents function failed, or gave something that is no extent.
    """
    extents = kernel.extents
    if extents is None:
        return ()
    if not kernel.module:  # a built-in's: ours, and on every launch's way
        return tuple(extents(values))
    try:
        found = tuple((int(index), int(nbytes)) for index, nbytes in extents(values))
    except Exception as exc:  # noqa: BLE001 (a module's code may raise anything)
        raise InvalidValueError(f"{kernel.qualified}'s extents raised {type(exc).__name__}: {str(exc)[:200]}") from None
    for index, nbytes in found:
        if not 0 <= index < len(kernel.params) or kernel.params[index] != "ptr" or nbytes < 0:
            raise InvalidValueError(f"{kernel.qualified}'s extents gave ({index}, {nbytes}): not a pointer "
                                    "parameter and a byte count")
    return found

