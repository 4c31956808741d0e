# One tenant of a stress run: a real worker process using mpsd_client, as a user's service would. Its quotas
# come from the CUDA_MPS_* environment the runner sets, exactly as for any MPS client. It talks to the runner
# in lines, so that every tenant starts at the same instant and the runner can show progress:
#   stdin  <- one JSON line: {"spec": TenantSpec fields, "instance", "arrivals", "duration", "ipc_handle"}
#             (every time in it is wall-clock seconds: the runner has already applied the daemon's time scale)
#   stdout -> READY {"pid", "client", "ipc_handle", "setup_errors"}   (connected, memory allocated)
#   stdin  <- GO <t0>        (time.monotonic() at which the run starts; every time it reports is relative to it)
#   stdout -> P <completed> <failed>  (now and then), then DONE {"requests": [[submitted, completed, error]], ...}
# A request is the tenant's input copied to the device, its kernels launched in order and its output copied
# back, all on its stream, then a synchronize; an open-loop request's submission time is when it was due, so
# time spent queued behind the previous request counts as latency.
"""A stress tenant process (``python -m mpsd.stress.tenant``)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import mpsd_client
from mpsd.stress.workload import POINTER_KERNELS, KernelSpec, TenantSpec
from mpsd_protocol import CudaError

PROGRESS_EVERY = 0.2  # seconds between progress lines


def spec_from_json(data: dict[str, Any]) -> TenantSpec:
    fields = dict(data)
    fields["kernels"] = tuple(KernelSpec(**k) for k in fields["kernels"])
    fields["trace"] = tuple(fields["trace"])
    return TenantSpec(**fields)


class Tenant:
    """A connected tenant, set up and ready to run its requests."""

    def __init__(self, ctx: mpsd_client.Context, spec: TenantSpec, ipc_handle: str | None) -> None:
        self.ctx = ctx
        self.spec = spec
        self.errors: list[str] = []
        self.held: list[Any] = []
        self.shared = None  # the IPC buffer: ours to export, or the producer's, opened
        # Copies go on a stream of their own making, so the request stays one asynchronous chain, as a
        # service's cudaMemcpyAsync and launches would (copies on no stream are synchronous).
        wants_stream = spec.stream_priority or spec.input or spec.output
        self.stream = ctx.create_stream(priority=spec.stream_priority) if wants_stream else None
        self.pointers: dict[int, tuple[int, ...]] = {}
        self.copies: dict[str, tuple[Any, Any]] = {}  # "input" / "output" -> (device buffer, pinned host buffer)
        self._try(self._allocate, ipc_handle)

    def _allocate(self, ipc_handle: str | None) -> None:
        spec, ctx = self.spec, self.ctx
        if spec.memory:
            self.held.append(ctx.malloc(spec.memory))
        for kind in ("input", "output"):
            nbytes = getattr(spec, kind)
            if nbytes:
                self.copies[kind] = (ctx.malloc(nbytes), ctx.host_alloc(nbytes))
        for i, k in enumerate(spec.kernels):
            if k.name in POINTER_KERNELS:
                self.pointers[i] = tuple(ctx.malloc(4 * k.scalar) for _ in range(POINTER_KERNELS[k.name]))
        if spec.ipc == "producer":
            self.shared = ctx.malloc(spec.ipc_size)
        elif spec.ipc == "consumer" and ipc_handle:
            self.shared = ctx.ipc_open_mem_handle(bytes.fromhex(ipc_handle))
            self.sum_out = ctx.malloc(4)

    def handle(self) -> str | None:
        if self.spec.ipc == "producer" and self.shared is not None:
            return self.ctx.ipc_get_mem_handle(self.shared).hex()
        return None

    def _try(self, call: Any, *args: Any) -> bool:
        try:
            call(*args)
            return True
        except CudaError as exc:
            self.errors.append(exc.name)
            return False

    def request(self) -> None:
        """Issue one request and wait for it.

        Raises:
            CudaError: any call failed (the request counts as failed).
        """
        ctx, spec, stream = self.ctx, self.spec, self.stream
        scratch = ctx.malloc(spec.churn) if spec.churn else None
        try:
            if "input" in self.copies:
                device, host = self.copies["input"]
                ctx.memcpy_htod(device, host, stream=stream)
            if self.shared is not None:
                n = spec.ipc_size // 4
                if spec.ipc == "producer":
                    ctx.launch("fill_f32", 132, 256, [self.shared, 1.0, n], stream=stream)
                else:
                    ctx.launch("reduce_sum_f32", 132, 256, [self.shared, self.sum_out, n], stream=stream)
            for i, k in enumerate(spec.kernels):
                args = k.args(self.pointers.get(i, ()))
                for _ in range(k.repeat):
                    ctx.launch(k.name, k.grid, k.block, args, stream=stream)
            if "output" in self.copies:
                device, host = self.copies["output"]
                ctx.memcpy_dtoh(host, device, stream=stream)
            if stream is not None:
                stream.synchronize()
            else:
                ctx.synchronize()
        finally:
            if scratch is not None:
                ctx.free(scratch)

    def run(self, t0: float, duration: float, arrivals: list[float] | None) -> list[list[Any]]:
        """Requests until the run's end (closed loop) or its last arrival (open loop); times relative to t0."""
        out: list[list[Any]] = []
        failed = 0
        next_progress = time.monotonic() + PROGRESS_EVERY
        due = iter(arrivals) if arrivals is not None else None
        end = t0 + duration
        while True:
            now = time.monotonic()
            if due is None:
                if now >= end:
                    break
                submitted = now
            else:
                at = next(due, None)
                if at is None:
                    break
                submitted = t0 + at
                if submitted > now:
                    time.sleep(submitted - now)
            error = None
            try:
                self.request()
                completed = time.monotonic() - t0
            except CudaError as exc:
                error, completed, failed = exc.name, math.nan, failed + 1
                self.errors.append(exc.name)
            out.append([submitted - t0, completed, error])
            if time.monotonic() >= next_progress:
                print(f"P {len(out) - failed} {failed}", flush=True)
                next_progress += PROGRESS_EVERY
            if self.spec.think:
                time.sleep(self.spec.think)
        return out


def main() -> int:
    setup = json.loads(sys.stdin.readline())
    spec = spec_from_json(setup["spec"])
    try:
        ctx = mpsd_client.connect()
    except CudaError as exc:  # refused (max clients, a server in FAULT...): say so instead of hanging the run
        print("READY " + json.dumps({"pid": None, "client": None, "ipc_handle": None, "setup_errors": [exc.name]}),
              flush=True)
        print("DONE " + json.dumps({"requests": [], "errors": [exc.name], "statistics": {}}), flush=True)
        return 0
    with ctx:
        tenant = Tenant(ctx, spec, setup.get("ipc_handle"))
        print("READY " + json.dumps({"pid": os.getpid(), "client": ctx.client_id,
                                     "ipc_handle": tenant.handle(), "setup_errors": tenant.errors}), flush=True)
        line = sys.stdin.readline().split()
        if line[:1] != ["GO"]:
            return 1
        requests = tenant.run(float(line[1]), float(setup["duration"]), setup.get("arrivals"))
        statistics = ctx.statistics()
        print("DONE " + json.dumps({"requests": requests, "errors": tenant.errors,
                                    "statistics": {k: v for k, v in statistics.items()
                                                   if isinstance(v, (int, float, str))}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
