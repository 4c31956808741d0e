"""Stream capture on the H200: what each call returns before, during and after a capture, in each capture mode
(the rules mpsd_client's capture follows).

    python3 bench/fidelity/measure_graph_capture.py [--json FILE] [--more]

--more runs, in every mode, the cases of the rules mpsd builds from CUDA's documentation alone (forks and joins,
ending on a forked stream, waiting on an event recorded outside the capture, merging two captures, synchronous
copies of some bytes, a pageable copy, calls from another thread): not run on the H200 yet, their answers are for
graph_capture_more_h200.json when they are.

Each case runs in a fresh process (a failed capture can leave the context's state behind it): it makes a
blocking stream `s` and a non-blocking stream `n`, begins a capture where the case says, makes the calls the
case lists, ends the capture, and reports every call's error name. Kernels are an empty CuPy RawKernel launched
on the stream; runtime calls go through cuda.bindings.runtime.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CASE = r"""
import json, sys, threading
import numpy as np
import cupy as cp
from cuda.bindings import runtime as rt
case, mode = sys.argv[1], int(sys.argv[2])
empty = cp.RawKernel(r'extern "C" __global__ void empty() {}', "empty")
out = []
def call(name, result):
    err = result[0] if isinstance(result, tuple) else result
    out.append([name, err.name])
    return result
def launch(name, stream):
    try:
        empty((1,), (32,), (), stream=cp.cuda.ExternalStream(int(stream)))
        out.append([name, "cudaSuccess"])
    except Exception as exc:
        out.append([name, type(exc).__name__ + ": " + str(exc)[:80]])
rt.cudaFree(0)
_, s = rt.cudaStreamCreateWithFlags(0)
_, n = rt.cudaStreamCreateWithFlags(1)
_, e = rt.cudaEventCreateWithFlags(2)
_, e2 = rt.cudaEventCreateWithFlags(2)
_, pre = rt.cudaEventCreateWithFlags(2)
_, f = rt.cudaStreamCreateWithFlags(1)
launch("warm launch on s", s); rt.cudaDeviceSynchronize()
_, host = rt.cudaMallocHost(1 << 20)
_, dev = rt.cudaMalloc(1 << 20)
target = {"legacy": 0, "s": s, "n": n}[case.split(":")[0]]
mode = rt.cudaStreamCaptureMode(mode)
pageable = np.ones(1 << 16, np.uint8)
if "wait_outside" in case:
    rt.cudaEventRecord(pre, n)  # recorded outside the capture
def status(name, stream):
    found = rt.cudaStreamIsCapturing(stream)
    out.append([name, [found[0].name, getattr(found[1], "name", str(found[1]))]])
def in_thread(work):
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
def relaxed_malloc():
    rt.cudaThreadExchangeStreamCaptureMode(rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
    call("cudaMalloc in a relaxed thread", rt.cudaMalloc(1 << 20))
D2D, H2D = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, rt.cudaMemcpyKind.cudaMemcpyHostToDevice
call("begin capture", rt.cudaStreamBeginCapture(target, mode))
call("begin again", rt.cudaStreamBeginCapture(target, mode)) if case.endswith("twice") else None
status = rt.cudaStreamIsCapturing(target)
out.append(["is capturing", [status[0].name, getattr(status[1], "name", str(status[1]))]])
steps = case.split(":")[1].split(",") if ":" in case else []
for step in steps:
    if step == "launch": launch("launch on it", target)
    elif step == "memset": call("memset on it", rt.cudaMemsetAsync(dev, 0, 1 << 20, target))
    elif step == "dtod": call("dtod on it", rt.cudaMemcpyAsync(dev, dev, 0, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                                               target))
    elif step == "htod_pinned": call("htod pinned on it",
                                     rt.cudaMemcpyAsync(dev, host, 1 << 20, rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
                                                        target))
    elif step == "device_sync": call("cudaDeviceSynchronize", rt.cudaDeviceSynchronize())
    elif step == "stream_sync": call("cudaStreamSynchronize(it)", rt.cudaStreamSynchronize(target))
    elif step == "stream_query": call("cudaStreamQuery(it)", rt.cudaStreamQuery(target))
    elif step == "other_sync": call("cudaStreamSynchronize(n)", rt.cudaStreamSynchronize(n))
    elif step == "legacy_launch": launch("launch on the legacy stream", 0)
    elif step == "other_launch": launch("launch on n", n)
    elif step == "malloc": call("cudaMalloc", rt.cudaMalloc(1 << 20))
    elif step == "free": call("cudaFree", rt.cudaFree(dev))
    elif step == "mem_get_info": call("cudaMemGetInfo", rt.cudaMemGetInfo())
    elif step == "record": call("cudaEventRecord(e, it)", rt.cudaEventRecord(e, target))
    elif step == "event_query": call("cudaEventQuery(e)", rt.cudaEventQuery(e))
    elif step == "event_sync": call("cudaEventSynchronize(e)", rt.cudaEventSynchronize(e))
    elif step == "sync_memcpy": call("cudaMemcpy dtod",
                                     rt.cudaMemcpy(dev, dev, 0, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice))
    elif step == "fork":
        call("cudaEventRecord(e, it)", rt.cudaEventRecord(e, target))
        call("cudaStreamWaitEvent(f, e)", rt.cudaStreamWaitEvent(f, e, 0))
    elif step == "launch_f": launch("launch on f", f)
    elif step == "f_status": status("is f capturing", f)
    elif step == "join":
        call("cudaEventRecord(e2, f)", rt.cudaEventRecord(e2, f))
        call("cudaStreamWaitEvent(it, e2)", rt.cudaStreamWaitEvent(target, e2, 0))
    elif step == "end_f": call("end capture on f", rt.cudaStreamEndCapture(f))
    elif step == "wait_outside": call("cudaStreamWaitEvent(it, pre)", rt.cudaStreamWaitEvent(target, pre, 0))
    elif step == "begin_n": call("begin capture on n", rt.cudaStreamBeginCapture(n, mode))
    elif step == "merge":
        call("cudaEventRecord(e, it)", rt.cudaEventRecord(e, target))
        call("cudaStreamWaitEvent(n, e)", rt.cudaStreamWaitEvent(n, e, 0))
    elif step == "end_n": call("end capture on n", rt.cudaStreamEndCapture(n))
    elif step == "sync_memcpy_bytes": call("cudaMemcpy dtod 64 KiB", rt.cudaMemcpy(dev, dev + (1 << 19), 1 << 16, D2D))
    elif step == "sync_htod": call("cudaMemcpy htod pinned 64 KiB", rt.cudaMemcpy(dev, host, 1 << 16, H2D))
    elif step == "pageable_htod": call("cudaMemcpyAsync htod pageable on it",
                                       rt.cudaMemcpyAsync(dev, pageable.ctypes.data, 1 << 16, H2D, target))
    elif step == "thread_malloc": in_thread(lambda: call("cudaMalloc in another thread", rt.cudaMalloc(1 << 20)))
    elif step == "thread_end": in_thread(lambda: call("end capture in another thread", rt.cudaStreamEndCapture(target)))
    elif step == "relaxed_thread_malloc": in_thread(relaxed_malloc)
status = rt.cudaStreamIsCapturing(target)
out.append(["is capturing", [status[0].name, getattr(status[1], "name", str(status[1]))]])
result = call("end capture", rt.cudaStreamEndCapture(target))
graph = result[1]
if result[0].name == "cudaSuccess" and graph:
    _, nodes, count = rt.cudaGraphGetNodes(graph)
    out.append(["nodes", count])
    inst = call("instantiate", rt.cudaGraphInstantiate(graph, 0))
    if inst[0].name == "cudaSuccess":
        call("graph launch on n", rt.cudaGraphLaunch(inst[1], n))
        call("graph launch on legacy", rt.cudaGraphLaunch(inst[1], 0))
        call("synchronize", rt.cudaDeviceSynchronize())
call("end again", rt.cudaStreamEndCapture(target))
if "fork" in case:
    status("is f capturing after", f)
call("stream sync after", rt.cudaStreamSynchronize(target))
launch("launch after", target)
call("device sync after", rt.cudaDeviceSynchronize())
print(json.dumps(out))
"""

CASES = ["legacy", "s:launch,memset,dtod,htod_pinned", "s:twice", "s:launch,device_sync,launch",
         "s:launch,stream_sync", "s:launch,stream_query", "s:launch,other_sync", "s:launch,legacy_launch",
         "n:launch,legacy_launch", "s:launch,other_launch", "s:malloc,launch", "s:free", "s:mem_get_info",
         "s:launch,record,event_query", "s:launch,record,event_sync", "s:sync_memcpy"]
MORE = ["s:fork,launch_f,f_status", "s:fork,launch_f,join,launch", "s:fork,end_f", "s:wait_outside",
        "s:begin_n,merge,end_n", "s:sync_memcpy_bytes", "n:sync_memcpy_bytes", "s:sync_htod", "s:pageable_htod",
        "s:thread_malloc", "s:thread_end", "s:relaxed_thread_malloc"]
MODES = {"global": 0, "thread_local": 1, "relaxed": 2}


def run(case: str, mode: int) -> object:
    done = subprocess.run([sys.executable, "-c", CASE, case, str(mode)], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-3:]}
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--more", action="store_true", help="the cases no run on the H200 has answered yet")
    options = parser.parse_args()
    result = {}
    for mode_name, mode in MODES.items():
        cases = MORE if options.more else CASES if mode_name != "thread_local" else CASES[3:4] + CASES[10:11]
        for case in cases:
            key = f"{mode_name} {case}"
            result[key] = run(case, mode)
            print(key, json.dumps(result[key]))
    if options.json:
        options.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
