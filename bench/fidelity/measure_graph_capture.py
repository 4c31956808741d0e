"""Stream capture on the H200: what each call returns before, during and after a capture, in each capture mode
(the rules mpsd_client's capture follows).

    python3 bench/fidelity/measure_graph_capture.py [--json FILE]

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
import json, sys
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
launch("warm launch on s", s); rt.cudaDeviceSynchronize()
_, host = rt.cudaMallocHost(1 << 20)
_, dev = rt.cudaMalloc(1 << 20)
target = {"legacy": 0, "s": s, "n": n}[case.split(":")[0]]
mode = rt.cudaStreamCaptureMode(mode)
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
call("stream sync after", rt.cudaStreamSynchronize(target))
launch("launch after", target)
call("device sync after", rt.cudaDeviceSynchronize())
print(json.dumps(out))
"""

CASES = ["legacy", "s:launch,memset,dtod,htod_pinned", "s:twice", "s:launch,device_sync,launch",
         "s:launch,stream_sync", "s:launch,stream_query", "s:launch,other_sync", "s:launch,legacy_launch",
         "n:launch,legacy_launch", "s:launch,other_launch", "s:malloc,launch", "s:free", "s:mem_get_info",
         "s:launch,record,event_query", "s:launch,record,event_sync", "s:sync_memcpy"]
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
    options = parser.parse_args()
    result = {}
    for mode_name, mode in MODES.items():
        for case in CASES if mode_name != "thread_local" else CASES[3:4] + CASES[10:11]:
            key = f"{mode_name} {case}"
            result[key] = run(case, mode)
            print(key, json.dumps(result[key]))
    if options.json:
        options.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
