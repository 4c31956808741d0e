# Modules as users hold them: a `Module` a context loaded (cuModuleLoad), its `Function`s (cuModuleGetFunction),
# their attributes (cuFuncGetAttribute) and occupancy (cudaOccupancyMaxActiveBlocksPerMultiprocessor). The
# daemon reads the module (only from its --module-path: a module's code runs there) and answers each kernel's
# parameter kinds, which the core adds to the signatures it checks launches against, as "module.kernel": a
# Function is that name, so a launch of one is a launch by name, checked and sent as a built-in's is.
"""Modules and their functions."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from mpsd_protocol import Calls, CudaError, InvalidResourceHandleError, NotFoundError, brief, runtime_error

if TYPE_CHECKING:
    from ._api import ContextBase
    from ._core import Core, Op

__all__ = ["Function", "Module", "function_name"]


class Function:
    """A kernel of a module (or a built-in): what ``launch`` and ``launch_kernel`` take in place of its name.

    Attributes:
        name: the name launches give it, "module.kernel" (a built-in's bare name).
        params: its parameter kinds ("ptr", "i64", "f32").
    """

    def __init__(self, ctx: ContextBase, name: str, params: list[str], module: Module | None = None) -> None:
        self.ctx, self.name, self.params, self.module = ctx, name, list(params), module
        self._attributes: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"<Function {self.name}({', '.join(self.params)})>"


class Module:
    """A module a context loaded: its name and its functions by name."""

    def __init__(self, ctx: ContextBase, handle: int, name: str, functions: dict[str, list[str]]) -> None:
        self.ctx, self.handle, self.name = ctx, handle, name
        self.functions = {fname: Function(ctx, f"{name}.{fname}", params, self) for fname, params in functions.items()}
        self.loaded = True

    def get_function(self, name: str) -> Function:
        """``cuModuleGetFunction``: its kernel `name`.

        Raises:
            NotFoundError: no such kernel in it (CUDA_ERROR_NOT_FOUND), or it was unloaded
                (InvalidResourceHandleError).
        """
        if not self.loaded:
            raise InvalidResourceHandleError(f"module {self.name} was unloaded")
        found = self.functions.get(name) if type(name) is str else None
        if found is None:
            raise NotFoundError(f"no kernel {brief(name, 60)} in module {self.name} "
                                f"(it has {', '.join(self.functions)})")
        return found

    def __repr__(self) -> str:
        return f"<Module {self.name} [{', '.join(self.functions)}]{'' if self.loaded else ' unloaded'}>"


def function_name(f: Any) -> Any:
    """A launch's kernel as the wire names it: a Function's name, or what was given (the checks judge it)."""
    return f.name if isinstance(f, Function) else f


# Loads of each module not yet unloaded, by connection (as the daemon counts them). Kept here, not on the Core:
# a 30th attribute there took its instances past CPython's shared-keys limit, and every method call on them onto
# the slow path (about 1,100 instructions a launch more, bench/daemon_instructions.py).
_LOADS: weakref.WeakKeyDictionary[Core, dict[str, int]] = weakref.WeakKeyDictionary()


def loaded_modules(core: Core) -> dict[str, int]:
    """The modules loaded on `core`'s connection, each with its loads not yet unloaded."""
    loads = _LOADS.get(core)
    if loads is None:
        loads = _LOADS[core] = {}
    return loads


def load(ctx: ContextBase, path: str, runtime: bool) -> Op:
    """Load the module at `path` in `ctx`: `runtime`, errors as the runtime reports them (a missing file is
    cudaErrorInvalidValue there, CUDA_ERROR_FILE_NOT_FOUND to the driver: mpsd_protocol's table)."""
    core = ctx._core
    try:
        result = yield from core.invoke(Calls.module_load, str(path) if hasattr(path, "__fspath__") else path)
    except CudaError as exc:
        raise (runtime_error(exc) if runtime else exc) from None
    module = Module(ctx, result["module"], result["name"], result["functions"])
    for function in module.functions.values():
        core.kernels[function.name] = function.params
    loads = loaded_modules(core)
    loads[module.name] = loads.get(module.name, 0) + 1  # as the daemon counts them
    return module


def unload(ctx: ContextBase, module: Module) -> Op:
    if not isinstance(module, Module) or module.ctx is not ctx or not module.loaded:
        raise InvalidResourceHandleError(f"{brief(module, 40)} is not a module loaded in this context")
    yield from ctx._core.invoke(Calls.module_unload, module.handle)
    module.loaded = False
    loads = loaded_modules(ctx._core)
    loads[module.name] -= 1
    if not loads[module.name]:  # its last load: launches can no longer name its kernels
        del loads[module.name]
        for function in module.functions.values():
            ctx._core.kernels.pop(function.name, None)


def attributes(ctx: ContextBase, f: Function | str) -> Op:
    """A function's attributes (cached on the Function: they never change)."""
    if isinstance(f, Function) and f._attributes is not None:
        return f._attributes
    found = yield from ctx._core.invoke(Calls.func_get_attributes, function_name(f))
    if isinstance(f, Function):
        f._attributes = found
    return found


def occupancy(ctx: ContextBase, f: Function | str, block: Any, shared_mem: int) -> Op:
    return (yield from ctx._core.invoke(Calls.occupancy_max_active_blocks, function_name(f),
                                        list(block) if isinstance(block, tuple) else block, shared_mem))
