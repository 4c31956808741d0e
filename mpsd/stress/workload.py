# The workload file: who the tenants are, what they are promised and what they run. Parsed once, checked
# completely (every mistake names its tenant and setting), and turned into plain frozen records that both
# runners (real processes, virtual time) read, so a workload means the same thing either way.
#
# It is the one format of both mpsd-stress and `mpsd simulate` (which reads the old scenario files of
# mpsd.tools.scenario by translating them into this one):
#
#   [run]        duration (s), seed, policy, solo (bool: also run each group alone, for isolation),
#                module_path (directories of modules, kernels of one's own, relative to the file: the daemon's
#                --module-path),
#                [run.policy_options.<policy>] (that policy's settings, as the daemon takes them),
#                devices (simulated H200s, default 1), [run.device.N] (device N's own policy and options, as
#                the daemon's [mpsd.device.N] takes them: policy, timeslice, context-switch, aging,
#                mig-partitions; a device without one runs the run's policy)
#   [[tenant]]   name (unique on its device), device (the index its processes see through
#                CUDA_VISIBLE_DEVICES, default 0; tables name it name@device off device 0), count,
#                active_thread_percentage, pinned_mem_limit, priority, weight, partition,
#                deadline_ms, memory, churn (bytes allocated and freed by each request), allocator = "pytorch" |
#                "pytorch-expandable" | "buddy" | "slab" (churn through that caching allocator strategy, the
#                second PyTorch's with expandable_segments, instead: sizes up to churn, the
#                last few kept live, the allocator's figures in the results), stream_priority, input, output
#                (bytes copied host to device before each request's kernels and device to host after them, from
#                and to pinned memory),
#                arrival = "closed" | "uniform" | "poisson" | "bursty" | "trace", rate, burst, trace, think_ms,
#                start (s into the run when the tenant begins; a uniform tenant's first arrival),
#                requests (at most this many; without it, as many as the duration holds),
#                ipc = "producer" | "consumer", ipc_size, ipc_peer,
#                graph (bool: the request's device work, copies and kernels, is captured once as a CUDA graph
#                and each request launches it: one launch call instead of one per kernel and copy)
#   [[tenant.kernel]]  a request's calls in order: name, grid, block, repeat, and per kernel: duration_ms or
#                cycles (spin), iterations (work), elements (fill_f32, vector_add_f32, saxpy_f32,
#                reduce_sum_f32); a module's kernel by "module.kernel" and its args, a list in its parameters'
#                order (a pointer's: the size of a buffer the tenant allocates for it); or a copy:
#                name = memcpy_htod | memcpy_dtoh | memcpy_dtod | memset, bytes,
#                repeat
"""Stress workloads: parsing and checking the TOML file."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpsd.modules import Kernel, ModuleError, read_module
from mpsd.sim import H200, DeviceSpec, sm_cap
from mpsd_protocol import parse_size

__all__ = ["ARRIVALS", "COPIES", "KernelSpec", "TenantSpec", "Workload", "WorkloadError", "arrival_times",
           "entitlements", "load_workload", "parse_workload"]

ARRIVALS = ("closed", "uniform", "poisson", "bursty", "trace")
POINTER_KERNELS = {"fill_f32": 1, "vector_add_f32": 3, "saxpy_f32": 2, "reduce_sum_f32": 2}  # buffers each needs
ALLOCATORS = ("pytorch", "pytorch-expandable", "buddy", "slab")  # CachingAllocator's strategies, for a churn
COPIES = {"memcpy_htod": "h2d", "memcpy_dtoh": "d2h", "memcpy_dtod": "d2d", "memset": "memset"}  # -> the model's kind


class WorkloadError(Exception):
    """The workload file is wrong; the message says where."""


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One call of a request: a kernel launch or a copy (a name in COPIES).

    Attributes:
        name: a built-in kernel, a module's ("module.kernel"), or a copy.
        grid, block: blocks and threads per block (flattened; 1 for a copy).
        repeat: launches of it in a row.
        scalar: its scalar argument: cycles (spin), iterations (work), elements (the pointer kernels) or bytes
            (a copy).
        params, values: a module's kernel's parameter kinds and its arguments as written, a pointer's the bytes
            of the buffer the tenant allocates for it.
        shape: a module's kernel's grid and block as written (x, y, z), for a launch that reads its blockIdx.
        module_file: the module file its kernel is declared in (what the model alone reads).
    """

    name: str
    grid: int
    block: int
    repeat: int
    scalar: int
    params: tuple[str, ...] = ()
    values: tuple[int | float, ...] = ()
    shape: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    module_file: str = ""

    @property
    def buffers(self) -> list[int]:
        """The sizes of the buffers a module's kernel's pointers need, in order."""
        return [int(v) for kind, v in zip(self.params, self.values) if kind == "ptr"]

    def declared(self) -> Kernel:
        """A module's kernel's declaration, read from its file.

        Raises:
            WorkloadError: the file no longer reads, or lacks the kernel.
        """
        return _declared(self.module_file, self.name.partition(".")[2])

    def launch_shape(self) -> tuple[Any, Any]:
        """The grid and block a launch gives."""
        if self.shape is None:
            return self.grid, self.block
        return tuple(self.shape[0]), tuple(self.shape[1])

    def args(self, pointers: tuple[int, ...] = ()) -> list[Any]:
        """The launch's argument list, given the buffers a pointer kernel works on."""
        if self.params:
            given = iter(pointers)
            return [next(given, 0) if kind == "ptr" else value for kind, value in zip(self.params, self.values)]
        if self.name in ("spin", "work"):
            return [self.scalar]
        if self.name == "fill_f32":
            return [pointers[0], 1.0, self.scalar]
        if self.name == "vector_add_f32":
            return [*pointers[:3], self.scalar]
        if self.name == "saxpy_f32":
            return [2.0, *pointers[:2], self.scalar]
        return [*pointers[:2], self.scalar]  # reduce_sum_f32: x, out, n


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One workload entry (``count`` copies of it run).

    Times are seconds, sizes bytes; None means unset (the daemon's default, or none).
    """

    name: str
    device: int = 0
    count: int = 1
    active_thread_percentage: float = 100.0
    pinned_mem_limit: int | None = None
    priority: int = 0
    weight: float = 1.0
    partition: int | None = None
    deadline: float | None = None
    memory: int = 0
    churn: int = 0
    allocator: str | None = None
    stream_priority: int = 0
    arrival: str = "closed"
    rate: float = 0.0
    burst: int = 1
    trace: tuple[float, ...] = ()
    think: float = 0.0
    ipc: str | None = None
    ipc_size: int = 4 << 20
    ipc_peer: str | None = None
    input: int = 0
    output: int = 0
    start: float | None = None
    requests: int | None = None
    graph: bool = False
    kernels: tuple[KernelSpec, ...] = ()

    @property
    def label(self) -> str:
        """The entry as tables and results name it: its name, and on a device other than 0 "@" and the device
        (one name may stand for the same service on several devices)."""
        return self.name if self.device == 0 else f"{self.name}@{self.device}"

    def instance(self, copy: int) -> str:
        """The name of copy ``copy`` (0-based): the entry's label alone when there is one copy."""
        return self.label if self.count == 1 else f"{self.label}#{copy}"

    def sm_cap(self, spec: DeviceSpec = H200) -> int:
        return sm_cap(spec, self.active_thread_percentage)


@dataclass(frozen=True, slots=True)
class Workload:
    """A parsed workload file."""

    tenants: tuple[TenantSpec, ...]
    duration: float = 2.0
    seed: int = 1
    policy: str = "mps"
    policy_options: dict[str, Any] = field(default_factory=dict)
    solo: bool = True
    source: str = "<workload>"
    devices: int = 1
    device_tables: dict[int, dict[str, Any]] = field(default_factory=dict)  # [run.device.N], as written
    module_path: tuple[Path, ...] = ()  # [run] module_path, resolved: the daemon's --module-path


def load_workload(path: Path) -> Workload:
    """Read and check a workload file.

    Raises:
        WorkloadError: unreadable, not TOML, or a setting is wrong.
    """
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise WorkloadError(f"{path}: {exc}") from None
    return parse_workload(data, base=path.parent, source=str(path))


def parse_workload(data: dict[str, Any], base: Path = Path("."), source: str = "<workload>") -> Workload:
    """Check a parsed TOML document and build the Workload (trace files are read relative to ``base``).

    Raises:
        WorkloadError: a setting is missing, unknown or out of range.
    """
    run = _table(data, "run", "the file")
    _known(data, {"run", "tenant"}, "the file")
    _known(run, {"duration", "seed", "policy", "policy_options", "solo", "devices", "device", "module_path"}, "[run]")
    module_path = _module_path(run.get("module_path", []), base)
    devices = _integer(run, "devices", "[run]", 1, low=1)
    tables = _table(run, "device", "[run]")
    if not all(key.isdecimal() and int(key) < devices and isinstance(v, dict) for key, v in tables.items()):
        raise WorkloadError(f"[run.device.N] tables must name devices 0 to {devices - 1}: {sorted(tables)}")
    duration = _number(run, "duration", "[run]", 2.0, low=0.0)
    if duration <= 0:
        raise WorkloadError("[run] duration must be positive")
    entries = data.get("tenant")
    if not isinstance(entries, list) or not entries:
        raise WorkloadError("the workload has no [[tenant]]")
    tenants = tuple(_tenant(entry, i, base, module_path) for i, entry in enumerate(entries))
    names = [t.name for t in tenants]
    if len({(t.name, t.device) for t in tenants}) != len(names):
        raise WorkloadError(f"tenant names must be unique on each device: {names}")
    for t in tenants:
        if t.device >= devices:
            raise WorkloadError(f"tenant {t.name}: device {t.device} is not among the run's {devices} devices")
        if t.ipc == "consumer" and (t.ipc_peer not in names or _by_name(tenants, t.ipc_peer).ipc != "producer"):
            raise WorkloadError(f"tenant {t.name}: ipc_peer must name a tenant with ipc = \"producer\"")
        if t.ipc == "producer" and t.count != 1:
            raise WorkloadError(f"tenant {t.name}: an IPC producer must have count = 1")
        if t.ipc == "producer" and names.count(t.name) > 1:
            raise WorkloadError(f"tenant {t.name}: an IPC producer's name must be unique (its consumers name it)")
    options = run.get("policy_options", {})
    if not isinstance(options, dict):
        raise WorkloadError("[run.policy_options] must be a table")
    seed = run.get("seed", 1)
    if not isinstance(seed, int):
        raise WorkloadError("[run] seed must be an integer")
    solo = run.get("solo", True)
    if not isinstance(solo, bool):
        raise WorkloadError("[run] solo must be true or false")
    return Workload(tenants, duration, seed, str(run.get("policy", "mps")), dict(options), solo, source, devices,
                    {int(key): dict(table) for key, table in tables.items()}, module_path)


def _module_path(value: Any, base: Path) -> tuple[Path, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WorkloadError("[run] module_path must be a list of directories")
    found = tuple((base / v).resolve() for v in value)
    for text, path in zip(value, found):
        if not path.is_dir():
            raise WorkloadError(f"[run] module_path: {text!r} is no directory (relative to the workload file)")
    return found


@functools.lru_cache(maxsize=64)
def _declared(module_file: str, name: str) -> Kernel:
    try:
        kernel = read_module(Path(module_file)).kernels.get(name)
    except ModuleError as exc:
        raise WorkloadError(str(exc)) from None
    if kernel is None:
        raise WorkloadError(f"{Path(module_file).name} declares no kernel {name!r}")
    return kernel


def entitlements(tenants: list[TenantSpec]) -> dict[str, float]:
    """Each instance's due share of SM-time: its weight over the sum of every instance's weight."""
    total = sum(t.weight * t.count for t in tenants)
    return {t.instance(c): t.weight / total for t in tenants for c in range(t.count)}


def arrival_times(tenant: TenantSpec, duration: float, seed: int, copy: int = 0) -> list[float] | None:
    """When copy ``copy`` of an open-loop tenant has its requests due, in seconds from the start: from the
    tenant's ``start`` until ``duration``, its first ``requests`` at most; None for a closed loop (each
    request follows the last).

    Drawn from a generator of its own, seeded by the workload's seed and the instance's name: the same
    instance gets the same arrivals whoever else runs (alone for its isolation baseline, or under another
    policy), on whichever device, and on every run.
    """
    # Seeded by the name without the device, so one service placed on several devices meets the same requests.
    rng = random.Random(f"{seed}:{dataclasses.replace(tenant, device=0).instance(copy)}")
    if tenant.arrival == "closed":
        return None
    start, limit = tenant.start or 0.0, tenant.requests

    def more(t: float, made: int) -> bool:  # another arrival, at t after the start, after `made` of them?
        return start + t < duration and (limit is None or made < limit)

    out: list[float] = []
    if tenant.arrival == "trace":
        return [start + t for i, t in enumerate(tenant.trace) if more(t, i)]
    if tenant.arrival == "uniform":
        step = 1.0 / tenant.rate
        if tenant.start is not None:  # the first arrival at the start
            while more(len(out) * step, len(out)):
                out.append(start + len(out) * step)
            return out
        t = rng.uniform(0.0, step)  # a random phase, so copies of one tenant do not arrive in lockstep
        while more(t, len(out)):
            out.append(start + t)
            t += step
        return out
    per_event = tenant.burst if tenant.arrival == "bursty" else 1  # bursts arrive as Poisson at rate / burst
    t = rng.expovariate(tenant.rate / per_event)
    while more(t, len(out)):
        out.extend([start + t] * per_event)
        t += rng.expovariate(tenant.rate / per_event)
    return out if limit is None else out[:limit]


# -- checking ---------------------------------------------------------------------------------------------

_TENANT_KEYS = {"name", "device", "count", "active_thread_percentage", "pinned_mem_limit", "priority", "weight",
                "partition", "deadline_ms", "memory", "churn", "allocator", "stream_priority", "arrival", "rate",
                "burst", "trace", "think_ms", "ipc", "ipc_size", "ipc_peer", "input", "output", "start", "requests",
                "graph", "kernel"}
_KERNEL_KEYS = {"name", "grid", "block", "repeat", "duration_ms", "cycles", "iterations", "elements"}
_COPY_KEYS = {"name", "bytes", "repeat"}


def _tenant(entry: Any, index: int, base: Path, module_path: tuple[Path, ...] = ()) -> TenantSpec:
    if not isinstance(entry, dict):
        raise WorkloadError(f"tenant {index} is not a table")
    name = entry.get("name", f"tenant{index}")
    if not isinstance(name, str) or not name or any(c in name for c in "#\n "):
        raise WorkloadError(f"tenant {index}: name must be a word without '#' or spaces")
    where = f"tenant {name}"
    _known(entry, _TENANT_KEYS, where)
    count = _integer(entry, "count", where, 1, low=1)
    percentage = _number(entry, "active_thread_percentage", where, 100.0, low=0.0)
    if not 0 < percentage <= 100:
        raise WorkloadError(f"{where}: active_thread_percentage must be in (0, 100]")
    arrival = entry.get("arrival", "closed")
    if arrival not in ARRIVALS:
        raise WorkloadError(f"{where}: arrival must be one of {', '.join(ARRIVALS)}")
    rate = _number(entry, "rate", where, 0.0, low=0.0)
    if arrival in ("uniform", "poisson", "bursty") and rate <= 0:
        raise WorkloadError(f"{where}: arrival = {arrival!r} needs a positive rate (requests per second)")
    trace: tuple[float, ...] = ()
    if arrival == "trace":
        trace = _trace(entry.get("trace"), base, where)
    ipc = entry.get("ipc")
    if ipc not in (None, "producer", "consumer"):
        raise WorkloadError(f"{where}: ipc must be \"producer\" or \"consumer\"")
    kernels = entry.get("kernel", [])
    if not isinstance(kernels, list) or not kernels:
        raise WorkloadError(f"{where}: needs at least one [[tenant.kernel]]")
    deadline = entry.get("deadline_ms")
    partition = entry.get("partition")
    if partition is not None and (not isinstance(partition, int) or partition < 0):
        raise WorkloadError(f"{where}: partition must be a MIG partition index")
    limit = entry.get("pinned_mem_limit")
    requests = entry.get("requests")
    allocator = entry.get("allocator")
    if allocator not in (None, *ALLOCATORS):
        raise WorkloadError(f"{where}: allocator must be one of {', '.join(ALLOCATORS)}")
    if allocator is not None and not entry.get("churn"):
        raise WorkloadError(f"{where}: allocator needs churn (the largest size it allocates)")
    graph = entry.get("graph", False)
    if not isinstance(graph, bool):
        raise WorkloadError(f"{where}: graph must be true or false")
    return TenantSpec(
        name=name, device=_integer(entry, "device", where, 0, low=0), count=count, active_thread_percentage=percentage,
        pinned_mem_limit=None if limit is None else _size(entry, "pinned_mem_limit", where),
        priority=_integer(entry, "priority", where, 0), weight=_number(entry, "weight", where, 1.0, low=1e-9),
        partition=partition,
        deadline=None if deadline is None else _number(entry, "deadline_ms", where, 0.0, low=1e-9) / 1e3,
        memory=_size(entry, "memory", where), churn=_size(entry, "churn", where), allocator=allocator,
        stream_priority=_integer(entry, "stream_priority", where, 0),
        arrival=arrival, rate=rate, burst=_integer(entry, "burst", where, 1, low=1), trace=trace,
        think=_number(entry, "think_ms", where, 0.0, low=0.0) / 1e3,
        ipc=ipc, ipc_size=_size(entry, "ipc_size", where, 4 << 20), ipc_peer=entry.get("ipc_peer"),
        input=_size(entry, "input", where), output=_size(entry, "output", where),
        start=_number(entry, "start", where, 0.0, low=0.0) if "start" in entry else None,
        requests=None if requests is None else _integer(entry, "requests", where, 1, low=1), graph=graph,
        kernels=tuple(_kernel(k, j, where, module_path) for j, k in enumerate(kernels)),
    )


def _kernel(entry: Any, index: int, tenant: str, module_path: tuple[Path, ...] = ()) -> KernelSpec:
    if not isinstance(entry, dict):
        raise WorkloadError(f"{tenant}: kernel {index} is not a table")
    name = entry.get("name")
    where = f"{tenant}: kernel {index} ({name})"
    if name in COPIES:
        _known(entry, _COPY_KEYS, where)
        if "bytes" not in entry:
            raise WorkloadError(f"{where}: needs bytes")
        return KernelSpec(name, 1, 1, _integer(entry, "repeat", where, 1, low=1), _size(entry, "bytes", where))
    if isinstance(name, str) and "." in name:
        return _module_kernel(entry, name, where, module_path)
    _known(entry, _KERNEL_KEYS, where)
    grid, block = _dims(entry, "grid", where, 1), _dims(entry, "block", where, 256)
    repeat = _integer(entry, "repeat", where, 1, low=1)
    if name == "spin":
        if "cycles" in entry:
            scalar = _integer(entry, "cycles", where, 0, low=0)
        else:
            scalar = round(_number(entry, "duration_ms", where, None, low=0.0) * 1e-3 * H200.clock_hz)
    elif name == "work":
        scalar = _integer(entry, "iterations", where, None, low=0)
    elif name in POINTER_KERNELS:
        scalar = _integer(entry, "elements", where, None, low=1)
    else:
        raise WorkloadError(f"{where}: unknown kernel; known: spin, work, {', '.join(POINTER_KERNELS)}, "
                            f"a module's as module.kernel, and the copies {', '.join(COPIES)}")
    return KernelSpec(name, grid, block, repeat, scalar)


def _module_kernel(entry: dict[str, Any], name: str, where: str, module_path: tuple[Path, ...]) -> KernelSpec:
    """A module's kernel: its module found in [run] module_path as the daemon will find it (module.py, the first
    directory that has it), its args checked against the declaration's parameters."""
    _known(entry, {"name", "grid", "block", "repeat", "args"}, where)
    module, _, kernel = name.partition(".")
    found = next((d / f"{module}.py" for d in module_path if (d / f"{module}.py").is_file()), None)
    if found is None:
        raise WorkloadError(f"{where}: no module {module!r} in [run] module_path")
    declared = _declared(str(found), kernel)
    args = entry.get("args", [])
    if not isinstance(args, list) or len(args) != len(declared.params):
        raise WorkloadError(f"{where}: args must list its {len(declared.params)} arguments "
                            f"({', '.join(declared.params)})")
    values: list[int | float] = []
    for i, (kind, value) in enumerate(zip(declared.params, args)):
        if kind == "ptr":
            values.append(_size({"arg": value}, "arg", f"{where}: argument {i} (a buffer's size)"))
        elif kind == "i64" and isinstance(value, int) and not isinstance(value, bool):
            values.append(value)
        elif kind == "f32" and isinstance(value, (int, float)) and not isinstance(value, bool):
            values.append(float(value))
        else:
            raise WorkloadError(f"{where}: argument {i} must be {kind}, not {value!r}")
    shapes = []
    for key, default in (("grid", 1), ("block", 256)):
        value = entry.get(key, default)
        _dims(entry, key, where, default)  # checked as a built-in's
        shapes.append(tuple(value) if isinstance(value, list) else (value,))
    return KernelSpec(name, _dims(entry, "grid", where, 1), _dims(entry, "block", where, 256),
                      _integer(entry, "repeat", where, 1, low=1), 0, declared.params, tuple(values),
                      (shapes[0], shapes[1]), str(found))


def _trace(value: Any, base: Path, where: str) -> tuple[float, ...]:
    if isinstance(value, list):
        times = value
    elif isinstance(value, str):
        try:
            lines = (base / value).read_text().split()
            times = [float(x) for x in lines]
        except (OSError, ValueError) as exc:
            raise WorkloadError(f"{where}: trace file {value!r}: {exc}") from None
    else:
        raise WorkloadError(f"{where}: arrival = \"trace\" needs trace = a file of times or a list of seconds")
    if not all(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 for t in times):
        raise WorkloadError(f"{where}: trace times must be non-negative seconds")
    return tuple(sorted(float(t) for t in times))


def _by_name(tenants: tuple[TenantSpec, ...], name: str | None) -> TenantSpec:
    return next(t for t in tenants if t.name == name)


def _known(table: dict[str, Any], keys: set[str], where: str) -> None:
    unknown = sorted(set(table) - keys)
    if unknown:
        raise WorkloadError(f"{where}: unknown setting(s) {', '.join(unknown)}")


def _table(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise WorkloadError(f"{where}: [{key}] must be a table")
    return value


def _number(table: dict[str, Any], key: str, where: str, default: float | None, low: float = -math.inf) -> float:
    value = table.get(key, default)
    if value is None:
        raise WorkloadError(f"{where}: needs {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value < math.inf):
        raise WorkloadError(f"{where}: {key} must be a number >= {low:g}, not {value!r}")
    return float(value)


def _integer(table: dict[str, Any], key: str, where: str, default: int | None, low: int | None = None) -> int:
    value = table.get(key, default)
    if value is None:
        raise WorkloadError(f"{where}: needs {key}")
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise WorkloadError(f"{where}: {key} must be an integer" + (f" >= {low}" if low is not None else "")
                            + f", not {value!r}")
    return value


def _dims(table: dict[str, Any], key: str, where: str, default: int) -> int:
    value = table.get(key, default)
    dims = value if isinstance(value, list) else [value]
    if not dims or len(dims) > 3 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise WorkloadError(f"{where}: {key} must be a positive size or a list of up to 3, not {value!r}")
    return math.prod(dims)


def _size(table: dict[str, Any], key: str, where: str, default: int = 0) -> int:
    value = table.get(key, default)
    if isinstance(value, bool):
        raise WorkloadError(f"{where}: {key} must be a size such as \"512M\"")
    if isinstance(value, int) and value >= 0:
        return value
    try:
        return parse_size(str(value))
    except ValueError as exc:
        raise WorkloadError(f"{where}: {key}: {exc}") from None
