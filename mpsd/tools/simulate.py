# `mpsd simulate SCENARIO.toml`: the daemon's GPU model alone, in virtual time, as fast as it can run. A
# scheduling question about many tenants is answered in seconds, identically on every run: the same engine,
# policies and virtual-clock driver (mpsd.sim.clock) the daemon runs, fed from a file instead of from client
# processes.
#
#   [device]                       model = "h200", policy = "mps", [device.policy_options] (as the daemon's)
#   [[tenant]]                     name, count (copies), active_thread_percentage, priority, weight, partition
#   [[tenant.kernel]]              name (a built-in), grid, block, args, repeat, stream, stream_priority,
#                                  at (first submission, s), period (s between submissions: open loop;
#                                  without it the repeats queue back to back on their stream), sleep (s
#                                  after each synchronise before the next launch: closed loop)
#   [[tenant.copy]]                kind ("h2d", "d2h": PCIe copy engines; "d2d", "memset": kernels the runtime
#                                  launches), bytes, and repeat, stream, stream_priority, at, period, sleep as
#                                  for a kernel (a tenant's `kernels` figure counts its copies too)
# Times are what the tenant observes: each tenant is one host thread whose launch calls follow one another,
# each reaching the device as it returns, and a synchronise returns a while after the kernel ends; both cost
# more the longer the thread was idle before (mpsd.sim.host, DeviceSpec's figures measured on a real H200).
from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import math
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpsd.daemon.config import DEVICE_MODELS
from mpsd.sim import COPY_KINDS, ENGINES, Copy, Kernel, Op, Simulator, copy_kernel, kernel_cost, sm_cap
from mpsd.sim.clock import VirtualClock


class ScenarioError(Exception):
    """The scenario file is wrong; the message says where."""


@dataclass
class TenantResult:
    name: str
    client: int
    kernels: int = 0
    latencies: list[float] = field(default_factory=list)  # synchronise returned - launch called, seconds
    last_end: float = 0.0

    def summary(self, sm_seconds: float, total_sm_seconds: float) -> dict[str, Any]:
        ordered = sorted(self.latencies)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] * 1e3 if ordered else 0.0

        return {"tenant": self.name, "client": self.client, "kernels": self.kernels,
                "makespan_ms": self.last_end * 1e3, "latency_p50_ms": pct(0.5), "latency_p99_ms": pct(0.99),
                "sm_seconds": sm_seconds, "sm_share": sm_seconds / total_sm_seconds if total_sm_seconds else 0.0}


@dataclass
class _Loop:
    """A closed-loop kernel: each launch follows the previous one's synchronise and a sleep."""

    make: Callable[[], Op]
    left: int
    sleep: float


# What each table of a scenario may hold: anything else is a mistake, never silently a default.
KEYS = {
    "scenario": {"device", "tenant"},
    "[device]": {"model", "policy", "policy_options"},
    "tenant": {"name", "count", "active_thread_percentage", "priority", "weight", "partition", "kernel", "copy"},
    "kernel": {"name", "grid", "block", "args", "repeat", "stream", "stream_priority", "at", "period", "sleep"},
    "copy": {"kind", "bytes", "repeat", "stream", "stream_priority", "at", "period", "sleep"},
}


def _known(table: Any, kind: str, where: str) -> None:
    if not isinstance(table, dict):
        raise ScenarioError(f"{where} must be a table")
    unknown = sorted(set(table) - KEYS[kind])
    if unknown:
        raise ScenarioError(f"{where}: unknown setting(s) {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(KEYS[kind]))})")


def _check_keys(scenario: dict[str, Any]) -> None:
    _known(scenario, "scenario", "the scenario")
    _known(scenario.get("device", {}), "[device]", "[device]")
    for i, tenant in enumerate(scenario.get("tenant", [])):
        where = f"tenant {tenant.get('name', i) if isinstance(tenant, dict) else i}"
        _known(tenant, "tenant", where)
        for kind in ("kernel", "copy"):
            for entry in tenant.get(kind, []):
                named = entry.get("name", entry.get("kind")) if isinstance(entry, dict) else ""
                _known(entry, kind, f"{where}: {kind} {named}")


def run_scenario(scenario: dict[str, Any]) -> dict[str, Any]:
    """Simulate a parsed scenario; returns per-tenant results and the device's figures.

    Raises:
        ScenarioError: a missing, unknown or invalid setting.
    """
    _check_keys(scenario)
    device = scenario.get("device", {})
    spec = DEVICE_MODELS.get(str(device.get("model", "h200")).lower())
    if spec is None:
        raise ScenarioError(f"unknown device model {device.get('model')!r}")
    try:
        sim = Simulator(spec, policy=device.get("policy", "mps"), policy_options=device.get("policy_options"))
    except ValueError as exc:
        raise ScenarioError(f"[device]: {exc}") from None
    arrivals: list[tuple[float, int, Op, _Loop | None]] = []  # (launch called, seq, op, loop)
    results: dict[int, TenantResult] = {}
    for t_index, tenant in enumerate(scenario.get("tenant", [])):
        for copy in range(int(tenant.get("count", 1))):
            client = len(results) + 1
            name = tenant.get("name", f"tenant{t_index}") + (f"#{copy}" if tenant.get("count", 1) > 1 else "")
            results[client] = TenantResult(name, client)
            try:
                sim.configure_client(client, priority=int(tenant.get("priority", 0)),
                                     weight=float(tenant.get("weight", 1.0)), partition=tenant.get("partition"))
                cap = sm_cap(spec, float(tenant.get("active_thread_percentage", 100)))
            except ValueError as exc:
                raise ScenarioError(f"tenant {name}: {exc}") from None
            for k in tenant.get("kernel", []):
                arrivals.extend(_kernels(spec, client, cap, k, name, len(arrivals)))
            for c in tenant.get("copy", []):
                arrivals.extend(_copies(spec, client, cap, c, name, len(arrivals)))
    if not arrivals:
        raise ScenarioError("the scenario launches no kernels")
    # Each tenant is one host thread: its launch calls are made one after another (``calls``, in the order
    # they are due), and only its next one is posted to the daemon's driver (mpsd.sim.clock), at the time its
    # work reaches the device; the driver applies them and the device's events in time order, the device's
    # first at equal times, calls due alike in the order they were listed. No tenant holds the clock: each
    # call is posted as soon as it is known, and the driver runs the device on until the next.
    done: list = []
    calls: dict[int, list[tuple[float, int, Op, _Loop | None]]] = {client: [] for client in results}
    for call in arrivals:
        heapq.heappush(calls[call[2].client], call)
    posted: set[int] = set()  # the tenants with a call posted
    launched: dict[int, tuple[float, float]] = {}  # id(op) -> (when the tenant called launch, its warmth)
    following: dict[int, _Loop] = {}  # closed loops waiting for their op to end, by id(op)
    scales = dict(spec.copy_calls)  # a copy call's host time against a launch's, by kind (the ops' tag)
    seq = itertools.count(len(arrivals))

    def call_next(client: int) -> None:
        if calls[client] and client not in posted:
            posted.add(client)
            at, n, op, loop = heapq.heappop(calls[client])
            thread = hosts[client].thread
            reaches = thread.launch(at, scales.get(op.tag, 1.0))
            launched[id(op)] = (at, thread.warmth)
            clock.post(hosts[client], reaches, functools.partial(submit, op, loop), order=n)

    def submit(op: Op, loop: _Loop | None) -> None:
        posted.discard(op.client)
        sim.submit(op)
        if loop is not None:
            following[id(op)] = loop
        call_next(op.client)

    def finished(ops: list) -> None:
        # A closed loop's next launch: the synchronise returns, the tenant sleeps, then calls launch.
        done.extend(ops)
        for op in ops:
            loop = following.pop(id(op), None)
            if loop is not None and loop.left > 0:
                at = hosts[op.client].thread.synchronize(op.ended) + loop.sleep
                heapq.heappush(calls[op.client], (at, next(seq), loop.make(),
                                                  _Loop(loop.make, loop.left - 1, loop.sleep)))
                call_next(op.client)

    clock = VirtualClock(sim, finished)
    hosts = {client: clock.join(client) for client in results}
    for host in hosts.values():
        clock.wait(host)
    for client in calls:
        call_next(client)
    while clock.pump(1 << 16):
        pass
    for op in done:
        result = results[op.client]
        result.kernels += 1
        at, warmth = launched[id(op)]
        returned = op.ended + hosts[op.client].thread.sync_latency(warmth)
        result.latencies.append(returned - at)
        result.last_end = max(result.last_end, returned)
    stats = sim.statistics()
    total = sum(c.sm_seconds for c in stats.per_client.values())
    return {
        "policy": device.get("policy", "mps"), "simulated_seconds": stats.now,
        "blocks": stats.blocks_completed, "kernels": stats.kernels_completed,
        "tenants": [r.summary(stats.per_client[c].sm_seconds if c in stats.per_client else 0.0, total)
                    for c, r in results.items()],
    }


def _kernels(spec, client: int, cap: int, k: dict[str, Any], tenant: str,
             seq: int) -> list[tuple[float, int, Op, _Loop | None]]:
    try:
        grid, block = _count(k.get("grid", 1)), _count(k.get("block", 256))
        args = list(k.get("args", []))
        cost = kernel_cost(spec, k["name"], grid, block, args)
    except (KeyError, TypeError, ValueError) as exc:
        raise ScenarioError(f"tenant {tenant}: kernel {k.get('name')!r}: {exc}") from None

    def make() -> Op:
        return Kernel(client=client, stream=int(k.get("stream", 0)), blocks=grid, threads=block, cost=cost,
                      priority=int(k.get("stream_priority", 0)), sm_cap=cap)

    return _timed(k, make, seq, f"tenant {tenant}: kernel {k.get('name')!r}")


def _copies(spec, client: int, cap: int, c: dict[str, Any], tenant: str,
            seq: int) -> list[tuple[float, int, Op, _Loop | None]]:
    where = f"tenant {tenant}: copy {c.get('kind')!r}"
    kind, nbytes = c.get("kind"), c.get("bytes")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ScenarioError(f"{where}: bytes must be a count >= 0, got {nbytes!r}")
    try:
        stream, priority = int(c.get("stream", 0)), int(c.get("stream_priority", 0))
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    if kind in COPY_KINDS:  # a kernel the runtime launches: the tenant's SM cap holds
        blocks, threads, cost = copy_kernel(spec, kind, nbytes, cap)

        def make() -> Op:
            return Kernel(client=client, stream=stream, tag=kind, blocks=blocks, threads=threads, cost=cost,
                          priority=priority, sm_cap=cap)
    elif kind in ENGINES:
        def make() -> Op:
            return Copy(client=client, stream=stream, tag=kind, engine=kind, nbytes=nbytes)
    else:
        raise ScenarioError(f"{where}: kind must be one of {ENGINES + COPY_KINDS}")
    return _timed(c, make, seq, where)


def _timed(entry: dict[str, Any], make: Callable[[], Op], seq: int,
           where: str) -> list[tuple[float, int, Op, _Loop | None]]:
    """An entry's launches: ``repeat`` of them at ``at``, one per ``period`` (open loop), or each after the
    previous one's synchronise and a ``sleep`` (closed loop)."""
    try:
        at, period, sleep = float(entry.get("at", 0.0)), entry.get("period"), entry.get("sleep")
        if period is not None and sleep is not None:
            raise ValueError("give period (open loop) or sleep (closed loop), not both")
        if sleep is not None and not float(sleep) >= 0.0:
            raise ValueError(f"sleep must be >= 0, got {sleep!r}")
        repeat = int(entry.get("repeat", 1))
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    if sleep is not None:
        return [(at, seq, make(), _Loop(make, repeat - 1, float(sleep)))] if repeat > 0 else []
    return [(at + (i * float(period) if period else 0.0), seq + i, make(), None) for i in range(repeat)]


def _count(value: Any) -> int:
    dims = value if isinstance(value, list) else [value]
    if not dims or not all(isinstance(d, int) and d > 0 for d in dims):
        raise ValueError(f"{value!r} is not a positive size")
    return math.prod(dims)


def render(result: dict[str, Any]) -> str:
    lines = [f"policy {result['policy']}: {result['kernels']} kernels, {result['blocks']} blocks, "
             f"{result['simulated_seconds'] * 1e3:.3f} ms simulated", "",
             f"{'tenant':<16} {'kernels':>7} {'makespan ms':>12} {'p50 ms':>9} {'p99 ms':>9} {'SM share':>8}"]
    for t in result["tenants"]:
        lines.append(f"{t['tenant']:<16} {t['kernels']:>7} {t['makespan_ms']:>12.3f} {t['latency_p50_ms']:>9.3f} "
                     f"{t['latency_p99_ms']:>9.3f} {t['sm_share']:>8.1%}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="mpsd simulate", description="Run a scenario on the GPU model alone, "
                                                                       "in virtual time.")
    parser.add_argument("scenario", type=Path, help="a TOML scenario file")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    options = parser.parse_args(argv)
    try:
        scenario = tomllib.loads(options.scenario.read_text())
        result = run_scenario(scenario)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ScenarioError) as exc:
        print(f"mpsd simulate: {options.scenario}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if options.json else render(result))
    return 0
