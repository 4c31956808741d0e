# One tenant of a stress run: a worker using mpsd_client, as a user's service would, written once for trio so
# that the same code runs as a real process (`python -m mpsd.stress.tenant`, the default) and as a task beside
# an in-process daemon (mpsd-stress --virtual-time): under the virtual clock both give the same figures, to
# the bit. Its quotas come from the CUDA_MPS_* environment the runner sets, as for any MPS client. Every time
# is the client's simulated clock (ctx.clock(), ctx.sleep()), so it means the same under either daemon clock.
# A tenant and its runner talk through a Link; as a process, in lines:
#   stdin  <- one JSON line: {"spec": TenantSpec fields, "instance", "arrivals", "duration", "start", "environ"}
#   stdin  <- CONNECT <IPC handle or ->   (the runner connects tenants one at a time, so their client ids,
#                                          which break ties in the daemon, follow the workload's order)
#   stdout -> READY {"pid", "client", "clock", "ipc_handle", "setup_errors"}   (connected, memory allocated;
#                                          under the virtual clock, asleep until "start": see below)
#   stdin  <- GO <t0>        (the simulated time at which the run starts; every time it reports is relative to it)
#   stdout -> P <completed> <failed>  (now and then), then DONE {"requests": [[submitted, completed, error,
#             host]], "errors", "statistics"}
# A request is the tenant's input copied to the device, its kernels and copies called in order and its output
# copied back, all on its stream, then a synchronize; an open-loop request's submission time is when it was
# due, so time spent queued behind the previous request counts as latency. `host` is the time it took to issue it
# (its calls before the synchronize): under the wall clock, the host's own speed shows there.
# Under the virtual clock a tenant that has set up sleeps until the run's start before it says READY, so that
# while it waits for GO outside mpsd it holds the clock at the start, where it keeps no one else's set-up
# waiting, and every tenant leaves the barrier at the same simulated instant.
"""A stress tenant (``python -m mpsd.stress.tenant``)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Protocol

import trio

import mpsd_client
from mpsd.stress.churn import Churn
from mpsd.stress.workload import COPIES, POINTER_KERNELS, KernelSpec, TenantSpec
from mpsd_protocol import CudaError

PROGRESS_EVERY = 0.2  # wall seconds between progress lines


class Link(Protocol):
    """How a tenant hears from and reports to its runner."""

    async def connect_cue(self) -> str | None:
        """Wait for the runner's turn to connect; the IPC handle of the producer, for a consumer."""

    def ready(self, info: dict[str, Any]) -> None: ...

    async def go(self) -> float:
        """Wait for the start; the simulated time it is at."""

    def progress(self, completed: int, failed: int) -> None: ...

    def done(self, result: dict[str, Any]) -> None: ...


def spec_from_json(data: dict[str, Any]) -> TenantSpec:
    fields = dict(data)
    fields["kernels"] = tuple(KernelSpec(**{**k, "params": tuple(k["params"]), "values": tuple(k["values"]),
                                            "shape": None if k["shape"] is None else tuple(map(tuple, k["shape"]))})
                              for k in fields["kernels"])
    fields["trace"] = tuple(fields["trace"])
    return TenantSpec(**fields)


class Tenant:
    """A connected tenant: its buffers, its stream and its requests."""

    def __init__(self, ctx: mpsd_client.AsyncContext, spec: TenantSpec) -> None:
        self.ctx = ctx
        self.spec = spec
        self.errors: list[str] = []
        self.held: list[Any] = []
        self.shared = None  # the IPC buffer: ours to export, or the producer's, opened
        self.stream: Any = None
        self.pointers: dict[int, tuple[Any, ...]] = {}  # kernel -> its buffers (a copy's host one or None)
        self.copies: dict[str, tuple[Any, Any]] = {}  # "input" / "output" -> (device buffer, pinned host buffer)
        self.churn: Churn | None = None
        self.graph: Any = None  # the request's device work as an executable graph (spec.graph)

    async def set_up(self, ipc_handle: str | None) -> None:
        """Its stream and memory; a refusal is recorded (the run goes on, as a service's would not)."""
        try:
            await self._allocate(ipc_handle)
            if self.spec.allocator is not None:  # the allocator's device: what the tenant has left free now
                capacity = (await self.ctx.mem_get_info())[0]
                self.churn = Churn(self.ctx, self.spec.allocator, self.spec.churn, capacity)
            if self.spec.graph:  # captured once, as a service captures its decode step; launched per request
                await self.stream.begin_capture()
                await self._device_work()
                self.graph = await (await self.stream.end_capture()).instantiate()
        except CudaError as exc:
            self.errors.append(exc.name)

    async def _allocate(self, ipc_handle: str | None) -> None:
        spec, ctx = self.spec, self.ctx
        # Copies go on a stream of their own making, so the request stays one asynchronous chain, as a
        # service's cudaMemcpyAsync and launches would (copies on no stream are synchronous).
        # (A capture needs a stream of its own too: the legacy stream cannot be captured.)
        if (spec.stream_priority or spec.input or spec.output or spec.graph
                or any(k.name in COPIES for k in spec.kernels)):
            self.stream = await ctx.create_stream(priority=spec.stream_priority)
        if spec.memory:
            self.held.append(await ctx.malloc(spec.memory))
        for kind in ("input", "output"):
            nbytes = getattr(spec, kind)
            if nbytes:
                self.copies[kind] = (await ctx.malloc(nbytes), await ctx.host_alloc(nbytes))
        for module in dict.fromkeys(k.name.partition(".")[0] for k in spec.kernels if k.params):
            await ctx.module_load(module)  # from the daemon's --module-path: the workload's module_path
        for i, k in enumerate(spec.kernels):
            if k.params:  # a module's kernel: a buffer for each of its pointers
                self.pointers[i] = tuple([await ctx.malloc(max(1, size)) for size in k.buffers])
            elif k.name in POINTER_KERNELS:
                self.pointers[i] = tuple([await ctx.malloc(4 * k.scalar) for _ in range(POINTER_KERNELS[k.name])])
            elif k.name in COPIES:  # (destination, source): a device buffer, and one more or pinned host memory
                other = await ctx.host_alloc(k.scalar) if k.name in ("memcpy_htod", "memcpy_dtoh") else (
                    await ctx.malloc(k.scalar) if k.name == "memcpy_dtod" else None)
                device = await ctx.malloc(k.scalar)
                self.pointers[i] = (other, device) if k.name == "memcpy_dtoh" else (device, other)
        if spec.ipc == "producer":
            self.shared = await ctx.malloc(spec.ipc_size)
        elif spec.ipc == "consumer" and ipc_handle:
            self.shared = await ctx.ipc_open_mem_handle(bytes.fromhex(ipc_handle))
            self.sum_out = await ctx.malloc(4)

    async def handle(self) -> str | None:
        if self.spec.ipc == "producer" and self.shared is not None:
            return (await self.ctx.ipc_get_mem_handle(self.shared)).hex()
        return None

    async def request(self) -> tuple[float, float]:
        """Issue one request and wait for it: (when its synchronize was called, when it returned).

        Raises:
            CudaError: any call failed (the request counts as failed).
        """
        ctx, spec, stream = self.ctx, self.spec, self.stream
        if self.churn is not None:  # through its caching allocator: a segment call only when the cache has no room
            await self.churn.step()
        scratch = await ctx.malloc(spec.churn) if spec.churn and self.churn is None else None
        try:
            if self.graph is not None:
                await self.graph.launch(stream)
            else:
                await self._device_work()
            issued = await ctx.clock()
            if stream is not None:
                await stream.synchronize()
            else:
                await ctx.synchronize()
            return issued, await ctx.clock()
        finally:
            if scratch is not None:
                await ctx.free(scratch)

    async def _device_work(self) -> None:
        """A request's copies and kernels, queued on the tenant's stream (or captured there: spec.graph)."""
        ctx, spec, stream = self.ctx, self.spec, self.stream
        if "input" in self.copies:
            device, host = self.copies["input"]
            await ctx.memcpy_htod(device, host, stream=stream)
        if self.shared is not None:
            n = spec.ipc_size // 4
            if spec.ipc == "producer":
                await ctx.launch("fill_f32", 132, 256, [self.shared, 1.0, n], stream=stream)
            else:
                await ctx.launch("reduce_sum_f32", 132, 256, [self.shared, self.sum_out, n], stream=stream)
        for i, k in enumerate(spec.kernels):
            for _ in range(k.repeat):
                await self._call(i, k)
        if "output" in self.copies:
            device, host = self.copies["output"]
            await ctx.memcpy_dtoh(host, device, stream=stream)

    async def _call(self, i: int, k: KernelSpec) -> None:
        ctx, stream = self.ctx, self.stream
        if k.name not in COPIES:
            grid, block = k.launch_shape()
            await ctx.launch(k.name, grid, block, k.args(self.pointers.get(i, ())), stream=stream)
            return
        dst, src = self.pointers[i]
        if k.name == "memcpy_htod":
            await ctx.memcpy_htod(dst, src, stream=stream)
        elif k.name == "memcpy_dtoh":
            await ctx.memcpy_dtoh(dst, src, stream=stream)
        elif k.name == "memcpy_dtod":
            await ctx.memcpy_dtod(dst, src, k.scalar, stream=stream)
        else:
            await ctx.memset(dst, 0, k.scalar, stream=stream)

    async def run(self, t0: float, duration: float, arrivals: list[float] | None,
                  link: Link) -> list[list[Any]]:
        """Requests until the run's end or its ``requests`` (closed loop, from its start), or its last arrival
        (open loop); times relative to t0."""
        ctx, limit, start = self.ctx, self.spec.requests, self.spec.start
        out: list[list[Any]] = []
        failed = 0
        next_progress = time.monotonic() + PROGRESS_EVERY
        due = iter(arrivals) if arrivals is not None else None
        while True:
            now = await ctx.clock() - t0
            if due is None:
                if now >= duration or (limit is not None and len(out) >= limit):
                    break
                submitted = start if start is not None and start > now else now
            else:
                at = next(due, None)
                if at is None:
                    break
                submitted = at
            if submitted > now:
                await ctx.sleep(submitted - now)
            started = await ctx.clock() - t0
            try:
                issued, completed = await self.request()
                row = [submitted, completed - t0, None, issued - t0 - started]
            except CudaError as exc:
                failed += 1
                self.errors.append(exc.name)
                row = [submitted, math.nan, exc.name, 0.0]
            out.append(row)
            if time.monotonic() >= next_progress:
                link.progress(len(out) - failed, failed)
                next_progress += PROGRESS_EVERY
            if self.spec.think:
                await ctx.sleep(self.spec.think)
        return out


async def play(setup: dict[str, Any], link: Link, pipe_dir: str | None = None) -> None:
    """One tenant from connection to its last request, told what to do by `setup` (the runner's first line)."""
    handle = await link.connect_cue()
    connected = False
    try:
        async with mpsd_client.open_context(pipe_dir, environ=setup.get("environ")) as ctx:
            connected = True
            await _serve(ctx, setup, link, handle)
    except CudaError as exc:
        if connected:
            raise
        # Refused (max clients, a server in FAULT...): say so instead of hanging the run.
        link.ready({"pid": os.getpid(), "client": None, "clock": 0.0, "ipc_handle": None,
                    "setup_errors": [exc.name]})
        link.done({"requests": [], "errors": [exc.name], "statistics": {}})


async def _serve(ctx: mpsd_client.AsyncContext, setup: dict[str, Any], link: Link, handle: str | None) -> None:
    tenant = Tenant(ctx, spec_from_json(setup["spec"]))
    await tenant.set_up(handle)
    exported = await tenant.handle()
    if setup.get("start") is not None:
        await ctx.sleep(max(0.0, setup["start"] - await ctx.clock()))
    link.ready({"pid": os.getpid(), "client": ctx.client_id, "clock": await ctx.clock(), "ipc_handle": exported,
                "setup_errors": list(tenant.errors)})
    t0 = await link.go()
    await ctx.sleep(max(0.0, t0 - await ctx.clock()))
    requests = await tenant.run(t0, float(setup["duration"]), setup.get("arrivals"), link)
    statistics = await ctx.statistics()
    link.done({"requests": requests, "errors": tenant.errors,
               "statistics": {k: v for k, v in statistics.items() if isinstance(v, (int, float, str))},
               "allocator": tenant.churn.figures() if tenant.churn is not None else None,
               "allocator_series": tenant.churn.series if tenant.churn is not None else None})


class _Lines:
    """The Link of a tenant process: lines on stdin and stdout."""

    async def _line(self) -> list[str]:
        return (await trio.to_thread.run_sync(sys.stdin.readline)).split()

    async def connect_cue(self) -> str | None:
        words = await self._line()
        if words[:1] != ["CONNECT"]:
            raise SystemExit(1)
        return None if words[1:] in ([], ["-"]) else words[1]

    def ready(self, info: dict[str, Any]) -> None:
        print("READY " + json.dumps(info), flush=True)

    async def go(self) -> float:
        words = await self._line()
        if words[:1] != ["GO"]:
            raise SystemExit(1)
        return float(words[1])

    def progress(self, completed: int, failed: int) -> None:
        print(f"P {completed} {failed}", flush=True)

    def done(self, result: dict[str, Any]) -> None:
        print("DONE " + json.dumps(result), flush=True)


def main() -> int:
    setup = json.loads(sys.stdin.readline())
    trio.run(play, setup, _Lines())
    return 0


if __name__ == "__main__":
    sys.exit(main())
