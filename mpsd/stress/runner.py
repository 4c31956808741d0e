# A workload played against a daemon of our own (recording its timeline), one tenant per instance, every one
# connected and set up before any begins so they all start at one agreed simulated instant. Two ways, one
# code: `run_real` starts the daemon and the tenants as processes (the tenant is mpsd.stress.tenant);
# `run_virtual` runs the daemon and the tenants as tasks of one trio loop in this process. Under the daemon's
# virtual clock both give the same figures, to the bit, whatever the host's speed: simulated time follows the
# tenants' simulated host clocks, and the runner connects the tenants one at a time in the workload's order,
# so that their client ids (which break ties) are the same every run. What the tenants saw (their requests)
# and what the device did (the daemon's trace) become one Timeline in simulated seconds from the start.
"""Running a stress workload against a real daemon: tenant processes, or tenant tasks in this process."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import trio

from mpsd.sim import H200
from mpsd.record.timeline import KernelRecord, Request, TenantInfo, Timeline
from mpsd.record.trace import as_drawn, read_chrome_trace
from mpsd.stress.workload import TenantSpec, Workload, arrival_times, entitlements

__all__ = ["RunError", "Progress", "device_policies", "run_real", "run_virtual"]

START_DELAY = 0.3  # wall seconds between GO and the run's start under the wall clock: every tenant has read it
VIRTUAL_START = 1.0  # the simulated second the run starts at under the virtual clock, after every set-up
READY_TIMEOUT = 120.0  # 64 tenants importing numpy on 2 cores take a while
SILENCE_TIMEOUT = 120.0  # wall seconds without a word from any tenant after which the run is given up
IDLE_GRACE = 30.0  # the daemon's idle grace: a tenant is never blocked outside mpsd once the run has begun
OPTION_FLAGS = {"timeslice": "--timeslice", "switch": "--context-switch", "aging": "--aging", "ahead": "--look-ahead",
                "dispatch": "--dispatch", "kernels_in_flight": "--kernels-in-flight",
                "dispatch_reaction": "--dispatch-reaction"}
LIMIT_VARIABLES = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_CLIENT_PRIORITY",
                   "MPSD_MIG_PARTITION", "CUDA_VISIBLE_DEVICES")


# `python -m` puts the working directory first on the path: started from a clone's directory, the daemon and the
# tenants would import its unbuilt mpsd/ ("No module named 'mpsd._core'") rather than the installed one. -P
# (Python 3.11 on) leaves the path as installed.
ISOLATED = ("-P",)


class RunError(Exception):
    """The run could not be carried out (daemon would not start, a tenant died); the message says why."""


@dataclass
class Progress:
    """What the live display shows, updated from the tenants' progress lines."""

    policy: str
    duration: float
    groups: dict[str, list[str]]  # workload entry -> its instances
    phase: str = "starting"
    started: float | None = None  # monotonic time of the run's start
    completed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    wall: bool = False  # `duration` is wall seconds (under the virtual clock, how long it takes is not known)

    def elapsed(self) -> float:
        return 0.0 if self.started is None else max(0.0, time.monotonic() - self.started)


@dataclass
class _Plan:
    """Who runs, in the order they connect (IPC producers first: their consumers need the handle)."""

    specs: list[TenantSpec]
    instances: list[tuple[TenantSpec, int, str]]
    setups: dict[str, dict[str, Any]]  # instance -> its tenant's first line

    @property
    def order(self) -> list[tuple[TenantSpec, int, str]]:
        return sorted(self.instances, key=lambda i: i[0].ipc != "producer")


def _plan(workload: Workload, tenants: list[TenantSpec] | None, clock: str) -> _Plan:
    specs = list(workload.tenants if tenants is None else tenants)
    instances = [(t, c, t.instance(c)) for t in specs for c in range(t.count)]
    setups = {name: {"spec": asdict(spec), "instance": name, "duration": workload.duration,
                     "arrivals": arrival_times(spec, workload.duration, workload.seed, copy),
                     "start": VIRTUAL_START if clock == "virtual" else None,
                     "environ": _environ(spec, workload.devices)}
              for spec, copy, name in instances}
    return _Plan(specs, instances, setups)


def _environ(spec: TenantSpec, devices: int = 1) -> dict[str, str]:
    """The MPS environment a tenant's process has: its quotas, and on a daemon of several devices the one it
    sees (CUDA_VISIBLE_DEVICES), as a user would set them."""
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{spec.active_thread_percentage:g}"}
    if devices > 1:
        env["CUDA_VISIBLE_DEVICES"] = str(spec.device)
    if spec.pinned_mem_limit is not None:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = str(spec.pinned_mem_limit)
    if spec.priority == 1:  # MPS's below-normal; other levels go through the control plane (_levels)
        env["CUDA_MPS_CLIENT_PRIORITY"] = "1"
    if spec.partition is not None:
        env["MPSD_MIG_PARTITION"] = str(spec.partition)
    return env


def _start_time(ready: dict[str, dict[str, Any]], clock: str, time_scale: float) -> float:
    """The simulated instant the run starts at: VIRTUAL_START under the virtual clock (the tenants are there
    already); under the wall clock, a moment from now that every tenant will have heard of.

    Raises:
        RunError: under the virtual clock, a tenant's set-up ended after VIRTUAL_START.
    """
    latest = max([info.get("clock", 0.0) for info in ready.values()], default=0.0)
    if clock == "virtual":
        if latest > VIRTUAL_START:
            raise RunError(f"the tenants' set-up took until simulated second {latest:.3f}, past the run's start at "
                           f"{VIRTUAL_START:g}")
        return VIRTUAL_START
    since = max([time.monotonic() - info["_heard"] for info in ready.values()], default=0.0)
    return latest + (since + START_DELAY) * time_scale


def _levels(tenants: list[tuple[TenantSpec, dict[str, Any]]]) -> list[tuple[str, dict[str, Any], Any]]:
    """What the environment cannot say, for the control plane (mpsd's extension commands): priority levels
    other than MPS's 0 and 1, and fair-share weights, as (command, the tenant's READY, value)."""
    out: list[tuple[str, dict[str, Any], Any]] = []
    for spec, info in tenants:
        if info.get("client") is None:
            continue
        if spec.priority not in (0, 1):
            out.append(("set_client_priority", info, spec.priority))
        if spec.weight != 1.0:
            out.append(("set_client_weight", info, spec.weight))
    return out


def _daemon_args(work: Path, policy: str, options: dict[str, Any], trace: Path | None, max_clients: int,
                 clock: str, time_scale: float, devices: str | None = None) -> list[str]:
    args = ["--pipe-dir", str(work), "--policy", policy, "--max-clients", str(max_clients)]
    if devices is not None and devices.startswith("cuda"):
        # A real GPU runs on the wall clock; a policy acts there by kernel; its trace is its traced kernels'.
        args += ["--devices", devices] + (["--trace", str(trace)] if trace is not None else [])
    else:
        args += ["--clock", clock] + (["--trace", str(trace)] if trace is not None else [])
        args += ["--devices", devices] if devices else []
        args += ["--idle-grace", repr(IDLE_GRACE)] if clock == "virtual" else ["--time-scale", repr(time_scale)]
    for key, value in options.items():
        if key == "partitions":
            args += ["--mig-partitions", ",".join(str(p) for p in value)]
        elif key in OPTION_FLAGS:
            args += [OPTION_FLAGS[key], str(value)]
        else:
            raise RunError(f"policy option {key!r} has no daemon option (known: partitions, {', '.join(OPTION_FLAGS)})")
    return args


def _module_args(workload: Workload) -> list[str]:
    """The daemon's --module-path for each directory of the workload's [run] module_path."""
    return [arg for path in workload.module_path for arg in ("--module-path", str(path))]


def _device_args(workload: Workload, work: Path) -> list[str]:
    """The daemon's options for a workload of several simulated devices: their number, and each [run.device.N]
    table as the daemon's own [mpsd.device.N] in a configuration file written in `work`."""
    if workload.devices == 1 and not workload.device_tables:
        return []
    path = work / "devices.toml"
    path.write_text("".join(f"[mpsd.device.{index}]\n" + "".join(f"{_toml(key)} = {_toml(value)}\n"
                                                                   for key, value in table.items()) + "\n"
                            for index, table in sorted(workload.device_tables.items())))
    return ["--devices", f"h200:{workload.devices}", "--config", str(path)]


def _toml(value: Any) -> str:
    """A device table's value written back as TOML (strings, numbers, booleans and lists of them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def device_policies(workload: Workload, policy: str, options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each device's policy and options under `policy` (the default for devices without a table of their own),
    as the daemon will read them.

    Raises:
        RunError: the daemon would refuse a device table (its message names the table).
    """
    from mpsd.daemon.config import ConfigError, load_config

    work = Path(tempfile.mkdtemp(prefix="mpsd-stress-", dir="/tmp"))
    try:
        config = load_config(_daemon_args(work, policy, options, work / "trace.json", 48, "virtual", 1.0)
                             + _device_args(workload, work), environ={})
    except ConfigError as exc:
        # The daemon names its own tables: say the workload's, which the user wrote.
        text = str(exc).replace(str(work / "devices.toml"), workload.source).replace("[mpsd.device.", "[run.device.")
        raise RunError(f"{workload.source}: {text}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [config.device_policy(index) for index in range(workload.devices)]


# -- tenant processes against a daemon process ------------------------------------------------------------

@contextlib.contextmanager
def _whole_heap_collections_after() -> Iterator[None]:
    """Python's collector scans the whole heap each time it has grown by a quarter; a run builds millions of
    objects that live until it ends (the daemon's, in process, and the spans of its timeline), so those scans
    found nothing and took 17 of the 46 seconds of DISB-C at --scale 10. They wait for the end of the run here,
    one then; the young generations are collected as ever, so what dies young goes at once."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)  # whole-heap collections: after 2**30 young ones
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()


@_whole_heap_collections_after()
def run_real(workload: Workload, policy: str, policy_options: dict[str, Any], tenants: list[TenantSpec] | None = None,
             on_progress: Callable[[Progress], None] = lambda p: None, label: str | None = None,
             time_scale: float = 1.0, clock: str = "virtual", devices: str | None = None,
             by_device: bool = False, device_trace: bool = True) -> Any:
    """Run ``tenants`` (default: all of the workload's) as processes against a fresh daemon under ``policy``.

    Returns the run's Timeline, or with ``by_device`` one per simulated device of the workload (its tenants and
    what that device did), by index.

    With ``devices`` a real GPU (``cuda:0``) the daemon owns it instead of the model: the wall clock and the
    hardware's own sharing; its device trace is what the GPU's traced kernels recorded of each block.

    Under the virtual clock (the default) the figures are the model's for the tenants' calls, whatever the
    host's speed. Under the wall clock the daemon's GPU runs at ``time_scale`` x real speed (its
    ``--time-scale``), and the tenants' own Python weighs that much less against it. Every time in the
    timeline is in simulated seconds from the start either way.

    Without ``device_trace`` the daemon records nothing of its device, and the timeline holds the tenants'
    requests alone: all that an isolation baseline needs, where recording and redrawing what the device did
    took most of the run.

    Raises:
        RunError: the daemon or a tenant failed in a way that leaves no run to measure.
    """
    plan = _plan(workload, tenants, clock)
    progress = Progress(label or policy, workload.duration / (time_scale if clock == "wall" else 1.0),
                        {t.label: [t.instance(c) for c in range(t.count)] for t in plan.specs}, wall=clock == "wall")
    work = Path(tempfile.mkdtemp(prefix="mpsd-stress-", dir="/tmp"))  # socket paths are limited to 107 bytes
    try:
        trace_path = work / "trace.json" if device_trace else None
        daemon = _start_daemon(_daemon_args(work, policy, policy_options, trace_path,
                                            max(48, len(plan.instances)), clock, time_scale, devices)
                               + ([] if devices else _device_args(workload, work)) + _module_args(workload))
        procs: dict[str, _TenantProcess] = {}
        try:
            lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
            for _, _, name in plan.order:  # all start (and import) at once; they connect one at a time
                procs[name] = _TenantProcess(name, work, plan.setups[name], lines)
            ready: dict[str, dict[str, Any]] = {}
            handles: dict[str, str | None] = {}
            for spec, _, name in plan.order:
                handle = handles.get(spec.ipc_peer) if spec.ipc == "consumer" and spec.ipc_peer else None
                procs[name].send(f"CONNECT {handle or '-'}")
                ready[name] = _await_ready(procs, lines, name, progress, on_progress)
                if spec.ipc == "producer":
                    handles[spec.name] = ready[name].get("ipc_handle")
            _configure(work, [(spec, ready[name]) for spec, _, name in plan.instances])
            t0 = _start_time(ready, clock, time_scale)
            for proc in procs.values():
                proc.send(f"GO {t0!r}")
            progress.phase, progress.started = "running", time.monotonic()
            done = _collect(procs, lines, progress, on_progress)
        finally:
            for proc in procs.values():
                proc.kill()
            _stop_daemon(daemon)
        on_gpu = bool(devices and devices.startswith("cuda"))
        traces = None if trace_path is None else _read_traces(workload, trace_path, daemon)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # A real GPU runs on the wall clock, whatever was asked.
    return _timelines(workload, policy, policy_options, plan, ready, done, traces, t0, by_device,
                      "wall" if on_gpu else clock)


@dataclass
class _Daemon:
    """The daemon process and what it has said on stderr since it was ready."""

    proc: subprocess.Popen
    said: list[str] = field(default_factory=list)


def _start_daemon(args: list[str]) -> _Daemon:
    # For finding where the daemon's time goes, not for figures: MPSD_STRESS_PROFILE=DIR runs each daemon under
    # cProfile, its profile written to DIR when it exits (as SIGTERM ends it).
    profile = os.environ.get("MPSD_STRESS_PROFILE")
    wrapper = ["-m", "cProfile", "-o", str(Path(profile) / f"daemon-{time.monotonic_ns()}.prof")] if profile else []
    proc = subprocess.Popen([sys.executable, *ISOLATED, *wrapper, "-m", "mpsd", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    assert proc.stderr is not None
    line = "no output"
    for line in proc.stderr:  # the daemon says one line when it is ready
        if line.startswith("mpsd: ready on"):
            daemon = _Daemon(proc)
            threading.Thread(target=daemon.said.extend, args=(proc.stderr,), daemon=True).start()  # kept drained
            return daemon
        if time.monotonic() > deadline:
            break
    proc.kill()
    proc.wait()
    raise RunError(f"the daemon did not start: {line.strip()}")


def _configure(work: Path, tenants: list[tuple[TenantSpec, dict[str, Any]]]) -> None:
    commands = [f"{command} {info['pid']} {value!r}" for command, info, value in _levels(tenants)]
    if not commands:
        return
    done = subprocess.run([sys.executable, "-m", "mpsd.tools.control"], input="\n".join(commands) + "\n",
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(work)))
    if done.returncode != 0 or done.stdout.strip():
        raise RunError(f"the daemon refused the tenants' priorities or weights: {(done.stdout + done.stderr).strip()}")


def _stop_daemon(daemon: _Daemon) -> None:
    """A clean shutdown: SIGTERM, so it writes its trace."""
    proc = daemon.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_traces(workload: Workload, path: Path, daemon: _Daemon | None) -> list[tuple[Timeline, dict[str, Any]]]:
    """Every device's timeline and the trace's mapping of it onto the clients (its otherData's "mpsd"), by
    index (device N's file beside device 0's, as the daemon names them)."""
    from mpsd.daemon.config import Config

    config = Config(path.parent, path.parent, trace=path)
    # (A config with a trace names a file for every device.)
    traces = [_read_trace(found, daemon) for index in range(workload.devices)
              if (found := config.trace_path(index)) is not None]
    return [(read_chrome_trace(trace), trace["otherData"]["mpsd"]) for trace in traces]


def _read_trace(path: Path, daemon: _Daemon | None) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        said = "".join(daemon.said if daemon else []).strip().splitlines()
        raise RunError(f"the daemon left no trace: {exc}" + (f"; it said: {said[-1]}" if said else "")) from None


class _TenantProcess:
    """One tenant process and the thread that reads its lines."""

    def __init__(self, name: str, work: Path, setup: dict[str, Any],
                 lines: queue.Queue[tuple[str, str | None]]) -> None:
        self.name = name
        env = {k: v for k, v in os.environ.items() if k not in LIMIT_VARIABLES}
        env.update(setup["environ"], CUDA_MPS_PIPE_DIRECTORY=str(work))
        self.stderr = open(work / f"{name}.stderr", "w+")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen([sys.executable, *ISOLATED, "-m", "mpsd.stress.tenant"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.send(json.dumps(dict(setup, environ=None)))
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died; its reader reports that

    def _read(self, lines: queue.Queue[tuple[str, str | None]]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.put((self.name, line.rstrip("\n")))
        lines.put((self.name, None))

    def failure(self) -> str:
        """Why it ended: the last line of what it wrote on stderr (a traceback ends with the error), or its
        exit status."""
        try:
            status = self.proc.wait(timeout=10)  # its stdout closes just before it exits
        except subprocess.TimeoutExpired:
            status = None
        self.stderr.seek(0)
        text = self.stderr.read().strip().splitlines()
        return text[-1] if text else f"exit status {status}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.stderr.close()


def _await_ready(procs: dict[str, _TenantProcess], lines: queue.Queue, name: str, progress: Progress,
                 on_progress: Callable[[Progress], None]) -> dict[str, Any]:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            who, line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise RunError(f"tenant {name} not ready after {READY_TIMEOUT:.0f} s") from None
        if line is None:
            raise RunError(f"tenant {who} exited while setting up: {procs[who].failure()}")
        if who == name and line.startswith("READY "):
            info = json.loads(line[6:]) | {"_heard": time.monotonic()}
            progress.phase = f"starting ({name} ready)"
            on_progress(progress)
            return info


def _collect(procs: dict[str, _TenantProcess], lines: queue.Queue, progress: Progress,
             on_progress: Callable[[Progress], None]) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    heard = time.monotonic()
    while len(done) < len(procs):
        try:
            name, line = lines.get(timeout=0.1)
        except queue.Empty:
            on_progress(progress)
            if time.monotonic() > heard + SILENCE_TIMEOUT:
                raise RunError(f"no word from the tenants for {SILENCE_TIMEOUT:.0f} s: "
                               f"{sorted(set(procs) - set(done))} still running") from None
            continue
        heard = time.monotonic()
        if line is None:
            if name not in done:
                raise RunError(f"tenant {name} died: {procs[name].failure()}")
        elif line.startswith("P "):
            completed, failed = line.split()[1:3]
            progress.completed[name], progress.failed[name] = int(completed), int(failed)
        elif line.startswith("DONE "):
            done[name] = json.loads(line[5:])
            _count(progress, name, done[name])
    progress.phase = "finished"
    on_progress(progress)
    return done


def _count(progress: Progress, name: str, result: dict[str, Any]) -> None:
    requests = result["requests"]
    progress.failed[name] = sum(1 for r in requests if r[2] is not None)
    progress.completed[name] = len(requests) - progress.failed[name]


# -- tenant tasks beside a daemon in this process ---------------------------------------------------------

@_whole_heap_collections_after()
def run_virtual(workload: Workload, policy: str, policy_options: dict[str, Any],
                tenants: list[TenantSpec] | None = None, on_progress: Callable[[Progress], None] = lambda p: None,
                label: str | None = None, by_device: bool = False, device_trace: bool = True) -> Any:
    """Run ``tenants`` as tasks of this process against a daemon in this process, on its virtual clock: no
    processes, the same figures as `run_real` gives, to the bit (and as it returns them; ``device_trace`` as
    there).

    Raises:
        RunError: the daemon could not start, or a tenant failed in a way that leaves no run to measure.
    """
    from mpsd.daemon.config import ConfigError, load_config
    from mpsd.daemon.server import DaemonError

    plan = _plan(workload, tenants, "virtual")
    progress = Progress(label or policy, workload.duration,
                        {t.label: [t.instance(c) for c in range(t.count)] for t in plan.specs})
    work = Path(tempfile.mkdtemp(prefix="mpsd-stress-", dir="/tmp"))
    try:
        # So that it records: its timeline comes back as data (keep_traces), no file.
        trace_path = work / "trace.json" if device_trace else None
        try:
            config = dataclasses.replace(load_config(_daemon_args(
                work, policy, policy_options, trace_path, max(48, len(plan.instances)), "virtual", 1.0)
                + _device_args(workload, work) + _module_args(workload), environ={}), shared_process=True)
            # What the run gives back comes in `out`, not as trio.run's result, which trio's runner keeps: the
            # runner lingers in reference cycles, and the timelines would stay with it until the collector
            # found them (millions of spans, scanned and freed at the end of the run instead of as they go).
            out: list[Any] = []
            trio.run(_in_process, config, plan, work, progress, on_progress, out, device_trace)
            ready, done, t0, traces = out.pop()
        except (ConfigError, DaemonError) as exc:
            raise RunError(f"the daemon did not start: {exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _timelines(workload, policy, policy_options, plan, ready, done, traces, t0, by_device, "virtual")


class _TaskLink:
    """The Link of a tenant task: its runner's cues and what it reported."""

    def __init__(self, progress: Progress, name: str) -> None:
        self.progress_of, self.name = progress, name
        self.cued, self.said_ready, self.started = trio.Event(), trio.Event(), trio.Event()
        self.handle: str | None = None
        self.t0 = 0.0
        self.info: dict[str, Any] = {}
        self.result: dict[str, Any] | None = None

    async def connect_cue(self) -> str | None:
        await self.cued.wait()
        return self.handle

    def ready(self, info: dict[str, Any]) -> None:
        self.info = info
        self.said_ready.set()

    async def go(self) -> float:
        await self.started.wait()
        return self.t0

    def progress(self, completed: int, failed: int) -> None:
        self.progress_of.completed[self.name], self.progress_of.failed[self.name] = completed, failed

    def done(self, result: dict[str, Any]) -> None:
        self.result = result


async def _in_process(config: Any, plan: _Plan, work: Path, progress: Progress,
                      on_progress: Callable[[Progress], None],
                      out: list[tuple[dict, dict, float, list[tuple[Timeline, dict[str, Any]]] | None]],
                      device_trace: bool) -> None:
    from mpsd.daemon.inprocess import open_daemon
    from mpsd.stress.tenant import play

    links = {name: _TaskLink(progress, name) for _, _, name in plan.instances}
    async with open_daemon(config, keep_traces=device_trace) as daemon:
        async with trio.open_nursery() as tenants:
            for _, _, name in plan.order:
                tenants.start_soon(play, plan.setups[name], links[name], str(work))
            handles: dict[str, str | None] = {}
            for spec, _, name in plan.order:
                link = links[name]
                link.handle = handles.get(spec.ipc_peer) if spec.ipc == "consumer" and spec.ipc_peer else None
                link.cued.set()
                await link.said_ready.wait()
                if spec.ipc == "producer":
                    handles[spec.name] = link.info.get("ipc_handle")
            contexts = {c.id: c for d in daemon.devices for c in d.contexts.values()}
            # Every tenant here has this process's pid: they are told apart by client id.
            for command, info, value in _levels([(spec, links[name].info) for spec, _, name in plan.instances]):
                setting = daemon.settings.priorities if command == "set_client_priority" else daemon.settings.weights
                setting[("client", info["client"])] = value
                daemon.reconfigure(contexts[info["client"]])
            ready = {name: link.info for name, link in links.items()}
            t0 = _start_time(ready, "virtual", 1.0)
            progress.phase, progress.started = "running", time.monotonic()
            for link in links.values():
                link.t0 = t0
                link.started.set()
    done = {}
    for name, link in links.items():
        if link.result is None:
            raise RunError(f"tenant {name} ended without a result")
        done[name] = link.result
        _count(progress, name, link.result)
    progress.phase = "finished"
    on_progress(progress)
    # Taken from the daemon, which lingers in reference cycles until the collector finds it: each device's
    # timeline goes as soon as it is redrawn, not with the daemon.
    traces, daemon.traces = daemon.traces, []
    if not device_trace:
        out.append((ready, done, t0, None))
        return
    kept = [trace for trace in traces if trace is not None]
    if not traces or len(kept) < len(traces):
        raise RunError("the daemon kept no trace of its devices")
    del traces  # (kept holds them, to let each go in turn)
    # As drawn in a trace file and read back: the figures a run of real processes gets, to the bit.
    drawn = []
    while kept:
        timeline, meta = kept.pop(0)
        drawn.append((as_drawn(timeline), meta))
        del timeline  # its spans, a copy of the drawn ones' size, go now rather than with this frame
    out.append((ready, done, t0, drawn))


# -- the timeline -----------------------------------------------------------------------------------------

def _timelines(workload: Workload, policy: str, policy_options: dict[str, Any], plan: _Plan,
               ready: dict[str, dict[str, Any]], done: dict[str, dict[str, Any]],
               traces: list[tuple[Timeline, dict[str, Any]]] | None, t0: float, by_device: bool, clock: str) -> Any:
    """The run's Timeline (device 0's, which is all of it on one device), or one per device: that device's
    tenants (their entitlements among themselves) and what it did, under its own policy's name."""
    if not by_device:
        return _timeline(workload, policy, plan, ready, done, traces[0] if traces else None, t0, clock)
    policies = device_policies(workload, policy, policy_options)
    out = {}
    for index in range(workload.devices):
        mine = _Plan([t for t in plan.specs if t.device == index],
                     [i for i in plan.instances if i[0].device == index], plan.setups)
        name = policies[index][0]
        out[index] = _timeline(workload, name if isinstance(name, str) else policy, mine, ready, done,
                               traces[index] if traces else None, t0, clock)
    return out


def _timeline(workload: Workload, policy: str, plan: _Plan, ready: dict[str, dict[str, Any]],
              done: dict[str, dict[str, Any]], trace: tuple[Timeline, dict[str, Any]] | None,
              t0: float, clock: str) -> Timeline:
    """Tenants' requests and the daemon's device, on one clock: simulated seconds from t0. Without a trace (none
    asked for), the tenants' requests alone, on an H200's SMs."""
    meta: dict[str, Any] = {"clients": {}, "clock": clock}
    device, meta = trace if trace is not None else (Timeline(
        policy=policy, sm_count=H200.sm_count, duration=0.0, launch_overhead=H200.kernel_overhead), meta)
    by_client = {info["client"]: name for name, info in ready.items() if info.get("client") is not None}
    # (A client of no tenant's is left out: its spans and kernels are dropped.)
    rename = {client: name for client, info in meta["clients"].items()
              if (name := by_client.get(info["client"])) is not None}
    seen_as = {name: t for t in device.tenants if (name := rename.get(t.name))}  # instance -> daemon's view
    entitlement = entitlements(plan.specs)
    tenants, requests = [], []
    for spec, _copy, name in plan.instances:
        seen = seen_as.get(name)
        tenants.append(TenantInfo(name=name, group=spec.name, sm_cap=seen.sm_cap if seen else spec.sm_cap(),
                                  mem_limit=seen.mem_limit if seen else spec.pinned_mem_limit,
                                  entitlement=entitlement[name], deadline=spec.deadline, priority=spec.priority))
        for submitted, completed, error, host in done[name]["requests"]:
            requests.append(Request(name, submitted, math.nan if completed is None else completed, error, host))
        for error in ready[name].get("setup_errors", []):
            requests.append(Request(name, 0.0, math.nan, error))
    kernels = [KernelRecord(rename[k.tenant], k.kernel, k.name, k.blocks, k.submitted - t0, k.started - t0,
                            k.ended - t0, k.eligible - t0) for k in device.kernels if rename.get(k.tenant)]
    spans = device.spans.renamed(rename).shifted(t0)
    ends = [r.completed for r in requests if r.completed == r.completed]
    if trace is not None:
        high_water = {rename[c]: v for c, v in device.memory_high_water.items() if rename.get(c)}
    else:  # what each tenant's context said of itself at the end (the daemon's ledger, on any device)
        high_water = {name: done[name]["statistics"]["memory_peak"] for _spec, _copy, name in plan.instances
                      if "memory_peak" in done[name].get("statistics", {})}
    return Timeline(policy=policy, sm_count=device.sm_count, duration=max([workload.duration, *ends]),
                    launch_overhead=device.launch_overhead, tenants=tenants, requests=requests, kernels=kernels,
                    spans=spans, partitions=device.partitions, lag=meta.get("max_lag", 0.0),
                    virtual=meta.get("clock") == "virtual", traced=trace is not None,
                    memory_high_water=high_water,
                    allocators={name: result["allocator"] for name, result in done.items() if result.get("allocator")},
                    allocator_series={name: [(row[0], *sample) for row, sample in zip(result["requests"],
                                                                                     result["allocator_series"])]
                                      for name, result in done.items() if result.get("allocator_series")})
