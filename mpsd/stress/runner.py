# A workload played with real processes: a daemon of our own (recording its timeline), one worker process per
# tenant instance, every one started before any begins so they all start at one agreed instant. What the
# tenants saw (their requests) and what the device did (the daemon's trace) become one Timeline on the host's
# monotonic clock, relative to that instant. The runner only starts, watches and collects; it measures nothing
# itself, so its own Python cannot colour the figures.
"""Running a stress workload with real tenant processes against a real daemon."""

from __future__ import annotations

import json
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
from typing import Any, Callable

from mpsd.stress.timeline import KernelRecord, Request, Span, TenantInfo, Timeline
from mpsd.stress.workload import TenantSpec, Workload, arrival_times, entitlements
from mpsd.trace import read_chrome_trace

__all__ = ["RunError", "Progress", "run_real"]

START_DELAY = 0.3  # seconds between GO and the run's start: every tenant has read its GO by then
READY_TIMEOUT = 120.0  # 64 tenants importing numpy on 2 cores take a while
OPTION_FLAGS = {"timeslice": "--timeslice", "switch": "--context-switch", "aging": "--aging"}


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

    def elapsed(self) -> float:
        return 0.0 if self.started is None else max(0.0, time.monotonic() - self.started)


def run_real(workload: Workload, policy: str, policy_options: dict[str, Any], tenants: list[TenantSpec] | None = None,
             on_progress: Callable[[Progress], None] = lambda p: None, label: str | None = None,
             time_scale: float = 1.0) -> Timeline:
    """Run ``tenants`` (default: all of the workload's) against a fresh daemon under ``policy``.

    With ``time_scale`` below 1 the daemon's GPU runs that much slower than the wall clock (the daemon's
    ``--time-scale``) and the tenants' clocks are scaled to match: the workload's times (duration, arrivals,
    think time) are simulated seconds, and so is every time in the timeline. Host time, Python's included,
    then weighs ``time_scale`` times as much against device time as it would at full speed.

    Raises:
        RunError: the daemon or a tenant failed in a way that leaves no run to measure.
    """
    specs = list(workload.tenants if tenants is None else tenants)
    instances = [(t, c, t.instance(c)) for t in specs for c in range(t.count)]
    progress = Progress(label or policy, workload.duration / time_scale,
                        {t.name: [t.instance(c) for c in range(t.count)] for t in specs})
    work = Path(tempfile.mkdtemp(prefix="mpsd-stress-", dir="/tmp"))  # socket paths are limited to 107 bytes
    trace_path = work / "trace.json"
    daemon = _start_daemon(work, policy, policy_options, trace_path, max(48, len(instances)), time_scale)
    procs: dict[str, _TenantProcess] = {}
    try:
        lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        ready: dict[str, dict[str, Any]] = {}
        # Producers first: their consumers need the IPC handle they export.
        order = sorted(instances, key=lambda i: i[0].ipc != "producer")
        handles: dict[str, str | None] = {}
        for spec, copy, name in order:
            arrivals = arrival_times(spec, workload.duration, workload.seed, copy)
            wall_spec = asdict(spec) | {"think": spec.think / time_scale}
            setup = {"spec": wall_spec, "instance": name, "duration": workload.duration / time_scale,
                     "arrivals": None if arrivals is None else [a / time_scale for a in arrivals],
                     "ipc_handle": handles.get(spec.ipc_peer) if spec.ipc == "consumer" else None}
            procs[name] = _TenantProcess(name, spec, work, setup, lines)
            if spec.ipc == "producer":  # wait for its handle before starting anyone who needs it
                ready[name] = _await_ready(procs, lines, {name}, progress, on_progress)[name]
                handles[spec.name] = ready[name].get("ipc_handle")
        ready.update(_await_ready(procs, lines, set(procs) - set(ready), progress, on_progress))
        _configure(work, {name: (spec, ready[name].get("pid")) for spec, _, name in instances})
        t0 = time.monotonic() + START_DELAY
        for proc in procs.values():
            proc.send(f"GO {t0!r}")
        progress.phase, progress.started = "running", t0
        done = _collect(procs, lines, progress, on_progress)
    finally:
        for proc in procs.values():
            proc.kill()
        _stop_daemon(daemon)
    try:
        trace = json.loads(trace_path.read_text())
    except (OSError, ValueError) as exc:
        raise RunError(f"the daemon left no trace: {exc}; its log is in {work}") from None
    timeline = _timeline(workload, policy, specs, instances, ready, done, trace, t0, time_scale)
    shutil.rmtree(work, ignore_errors=True)
    return timeline


# -- the daemon -------------------------------------------------------------------------------------------

def _start_daemon(work: Path, policy: str, options: dict[str, Any], trace: Path, max_clients: int,
                  time_scale: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mpsd", "--pipe-dir", str(work), "--policy", policy, "--trace", str(trace),
           "--max-clients", str(max_clients), "--time-scale", repr(time_scale)]
    for key, value in options.items():
        if key == "partitions":
            cmd += ["--mig-partitions", ",".join(str(p) for p in value)]
        elif key in OPTION_FLAGS:
            cmd += [OPTION_FLAGS[key], str(value)]
        else:
            raise RunError(f"policy option {key!r} has no daemon option (known: partitions, {', '.join(OPTION_FLAGS)})")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    assert proc.stderr is not None
    for line in proc.stderr:  # the daemon says one line when it is ready
        if line.startswith("mpsd: ready on"):
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its stderr drained
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RunError(f"the daemon did not start: {line.strip() if 'line' in locals() else 'no output'}")


def _configure(work: Path, tenants: dict[str, tuple[TenantSpec, int | None]]) -> None:
    """What the environment cannot say, through the control plane (mpsd's extension commands): priority
    levels other than MPS's 0 and 1, and fair-share weights."""
    commands = []
    for spec, pid in tenants.values():
        if pid is None:
            continue
        if spec.priority not in (0, 1):
            commands.append(f"set_client_priority {pid} {spec.priority}")
        if spec.weight != 1.0:
            commands.append(f"set_client_weight {pid} {spec.weight!r}")
    if not commands:
        return
    done = subprocess.run([sys.executable, "-m", "mpsd.control_cli"], input="\n".join(commands) + "\n",
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, MPSD_PIPE_DIRECTORY=str(work)))
    if done.returncode != 0 or done.stdout.strip():
        raise RunError(f"the daemon refused the tenants' priorities or weights: {(done.stdout + done.stderr).strip()}")


def _stop_daemon(proc: subprocess.Popen) -> None:
    """A clean shutdown: SIGTERM, so it writes its trace."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the tenants ------------------------------------------------------------------------------------------

class _TenantProcess:
    """One tenant process and the thread that reads its lines."""

    def __init__(self, name: str, spec: TenantSpec, work: Path, setup: dict[str, Any],
                 lines: queue.Queue[tuple[str, str | None]]) -> None:
        self.name = name
        env = dict(os.environ, MPSD_PIPE_DIRECTORY=str(work),
                   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=f"{spec.active_thread_percentage:g}")
        for key in ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_CLIENT_PRIORITY", "MPSD_MIG_PARTITION",
                    "CUDA_VISIBLE_DEVICES"):
            env.pop(key, None)
        if spec.pinned_mem_limit is not None:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = str(spec.pinned_mem_limit)
        if spec.priority == 1:  # MPS's below-normal; other levels go through the control plane (_configure)
            env["CUDA_MPS_CLIENT_PRIORITY"] = "1"
        if spec.partition is not None:
            env["MPSD_MIG_PARTITION"] = str(spec.partition)
        self.stderr = open(work / f"{name}.stderr", "w+")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen([sys.executable, "-m", "mpsd.stress.tenant"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.send(json.dumps(setup))
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
        self.stderr.seek(0)
        text = self.stderr.read().strip().splitlines()
        return text[-1] if text else f"exit status {self.proc.poll()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.stderr.close()


def _await_ready(procs: dict[str, _TenantProcess], lines: queue.Queue, waiting: set[str], progress: Progress,
                 on_progress: Callable[[Progress], None]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + READY_TIMEOUT
    while waiting - set(out):
        try:
            name, line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise RunError(f"tenants not ready after {READY_TIMEOUT:.0f} s: {sorted(waiting - set(out))}") from None
        if line is None:
            raise RunError(f"tenant {name} exited while setting up: {procs[name].failure()}")
        if line.startswith("READY "):
            out[name] = json.loads(line[6:])
            progress.phase = f"starting ({len(out)}/{len(waiting)} ready)"
            on_progress(progress)
    return out


def _collect(procs: dict[str, _TenantProcess], lines: queue.Queue, progress: Progress,
             on_progress: Callable[[Progress], None]) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    # A tenant's last request may start just before the end and take long under contention; allow for it.
    deadline = progress.started + progress.duration + 60.0
    while len(done) < len(procs):
        try:
            name, line = lines.get(timeout=0.1)
        except queue.Empty:
            on_progress(progress)
            if time.monotonic() > deadline:
                raise RunError(f"tenants still running 60 s after the end: {sorted(set(procs) - set(done))}") from None
            continue
        if line is None:
            if name not in done:
                raise RunError(f"tenant {name} died: {procs[name].failure()}")
        elif line.startswith("P "):
            completed, failed = line.split()[1:3]
            progress.completed[name], progress.failed[name] = int(completed), int(failed)
        elif line.startswith("DONE "):
            done[name] = json.loads(line[5:])
            requests = done[name]["requests"]
            progress.failed[name] = sum(1 for r in requests if r[2] is not None)
            progress.completed[name] = len(requests) - progress.failed[name]
    progress.phase = "finished"
    on_progress(progress)
    return done


# -- the timeline -----------------------------------------------------------------------------------------

def _timeline(workload: Workload, policy: str, specs: list[TenantSpec], instances: list[tuple[TenantSpec, int, str]],
              ready: dict[str, dict[str, Any]], done: dict[str, dict[str, Any]], trace: dict[str, Any],
              t0: float, scale: float) -> Timeline:
    """Tenants' requests and the daemon's device, on one clock: simulated seconds from t0 (the daemon's
    simulated time s happened at wall time origin + s / scale; a tenant's wall time w is w x scale)."""
    device = read_chrome_trace(trace)
    meta = trace["otherData"]["mpsd"]
    shift = (meta["monotonic_origin"] - t0) * scale
    by_pid = {info["pid"]: name for name, info in ready.items() if info.get("pid") is not None}
    rename = {client: by_pid.get(info["pid"]) for client, info in meta["clients"].items()}
    seen_as = {name: t for t in device.tenants if (name := rename.get(t.name))}  # instance -> daemon's view
    entitlement = entitlements(specs)
    tenants, requests = [], []
    for spec, _copy, name in instances:
        seen = seen_as.get(name)
        tenants.append(TenantInfo(name=name, group=spec.name, sm_cap=seen.sm_cap if seen else spec.sm_cap(),
                                  mem_limit=seen.mem_limit if seen else spec.pinned_mem_limit,
                                  entitlement=entitlement[name], deadline=spec.deadline, priority=spec.priority))
        for submitted, completed, error in done[name]["requests"]:
            requests.append(Request(name, submitted * scale, float("nan") if completed is None else completed * scale,
                                    error))
        for error in ready[name].get("setup_errors", []):
            requests.append(Request(name, 0.0, float("nan"), error))
    kernels = [KernelRecord(rename[k.tenant], k.kernel, k.name, k.blocks, k.submitted + shift, k.started + shift,
                            k.ended + shift, k.eligible + shift) for k in device.kernels if rename.get(k.tenant)]
    spans = [Span(rename[s.tenant], s.kernel, s.sm, s.blocks, s.sm_fraction, s.start + shift, s.end + shift)
             for s in device.spans if rename.get(s.tenant)]
    ends = [r.completed for r in requests if r.completed == r.completed]
    return Timeline(policy=policy, sm_count=device.sm_count, duration=max([workload.duration, *ends]),
                    launch_overhead=device.launch_overhead, tenants=tenants, requests=requests, kernels=kernels,
                    spans=spans, partitions=device.partitions, lag=meta.get("max_lag", 0.0),
                    memory_high_water={rename[c]: v for c, v in device.memory_high_water.items() if rename.get(c)})
