"""Graph memory nodes and event nodes on a real GPU: what CUDA answers for the rules mpsd.runtime.graph_memory and
the event nodes take from CUDA's documentation alone (not yet run on the H200; where the documentation says only
"an error", mpsd guessed cudaErrorNotSupported, and this says which it is).

    python3 bench/fidelity/measure_graph_memory.py [--json FILE]

Each case captures cudaMallocAsync / cudaFreeAsync (and external event records and waits) on a stream with
cuda.bindings.runtime, then makes the calls the case is about, and reports each call's error name (and the
captured nodes' types, and whether a relaunch keeps the address). Compare with tests/test_graph_memory.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the answers to this file")
    args = p.parse_args()
    from cuda.bindings import runtime as rt

    def name(result: Any) -> str:
        err = result[0] if isinstance(result, tuple) else result
        return err.name

    def value(result: Any) -> Any:
        assert int(result[0]) == 0, result[0]
        return result[1] if len(result) == 2 else result[1:]

    rt.cudaFree(0)
    s = value(rt.cudaStreamCreateWithFlags(1))
    other = value(rt.cudaStreamCreateWithFlags(1))
    nbytes = 1 << 20

    def captured(free_inside: bool) -> tuple[Any, int]:
        """A graph of cudaMallocAsync (and cudaFreeAsync) captured on s; and the address it gave."""
        value(rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal))
        ptr = value(rt.cudaMallocAsync(nbytes, s))
        value(rt.cudaMemsetAsync(ptr, 0, nbytes, s))
        if free_inside:
            value(rt.cudaFreeAsync(ptr, s))
        return value(rt.cudaStreamEndCapture(s)), int(ptr)

    def node_types(graph: Any) -> list[str]:
        _, _, count = rt.cudaGraphGetNodes(graph, 0)
        _, nodes, _ = rt.cudaGraphGetNodes(graph, count)
        return [value(rt.cudaGraphNodeGetType(node)).name for node in nodes]

    def case_freed_inside() -> list[Any]:
        graph, ptr = captured(True)
        out: list[Any] = [["nodes", node_types(graph)]]
        exec_ = value(rt.cudaGraphInstantiateWithFlags(graph, 0))
        for i in range(3):
            out.append([f"launch {i}", name(rt.cudaGraphLaunch(exec_, s))])
        out.append(["synchronize", name(rt.cudaStreamSynchronize(s))])
        out.append(["cudaFreeAsync outside of what the graph frees", name(rt.cudaFreeAsync(ptr, s))])
        out.append(["synchronize", name(rt.cudaStreamSynchronize(s))])
        out.append(["second instantiate", name(rt.cudaGraphInstantiateWithFlags(graph, 0))])
        out.append(["clone", name(rt.cudaGraphClone(graph))])
        parent = value(rt.cudaGraphCreate(0))
        out.append(["child graph node", name(rt.cudaGraphAddChildGraphNode(parent, None, 0, graph))])
        return out

    def case_kept() -> list[Any]:
        graph, ptr = captured(False)
        out: list[Any] = [["nodes", node_types(graph)]]
        out.append(["cudaFreeAsync before any launch", name(rt.cudaFreeAsync(ptr, s))])
        rt.cudaGetLastError()
        exec_ = value(rt.cudaGraphInstantiateWithFlags(graph, 0))
        out.append(["launch", name(rt.cudaGraphLaunch(exec_, s))])
        out.append(["synchronize", name(rt.cudaStreamSynchronize(s))])
        out.append(["launch again, unfreed", name(rt.cudaGraphLaunch(exec_, s))])
        out.append(["synchronize", name(rt.cudaStreamSynchronize(s))])
        out.append(["cudaFreeAsync after the launch", name(rt.cudaFreeAsync(ptr, s))])
        out.append(["launch after the free", name(rt.cudaGraphLaunch(exec_, s))])
        out.append(["synchronize", name(rt.cudaStreamSynchronize(s))])
        _, nodes, _ = rt.cudaGraphGetNodes(graph, 2)
        params = rt.cudaGraphMemAllocNodeGetParams(nodes[0])
        out.append(["same address", int(params[1].dptr) == ptr if int(params[0]) == 0 else params[0].name])
        out.append(["cudaFree (synchronous) of it", name(rt.cudaFree(ptr))])
        auto = value(rt.cudaGraphInstantiateWithFlags(captured(False)[0], 1))  # AutoFreeOnLaunch
        for i in range(3):
            out.append([f"auto-free launch {i}", name(rt.cudaGraphLaunch(auto, s))])
        out.append(["synchronize", name(rt.cudaStreamSynchronize(s))])
        return out

    def case_events() -> list[Any]:
        e = value(rt.cudaEventCreateWithFlags(2))
        outside = value(rt.cudaEventCreateWithFlags(2))
        value(rt.cudaEventRecord(outside, other))
        value(rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal))
        out: list[Any] = [["external wait on an event recorded outside", name(rt.cudaStreamWaitEvent(s, outside, 1))]]
        ptr = value(rt.cudaMallocAsync(nbytes, s))
        value(rt.cudaMemsetAsync(ptr, 0, nbytes, s))
        value(rt.cudaFreeAsync(ptr, s))
        out.append(["external record", name(rt.cudaEventRecordWithFlags(e, s, 1))])
        graph = value(rt.cudaStreamEndCapture(s))
        out.append(["nodes", node_types(graph)])
        exec_ = value(rt.cudaGraphInstantiateWithFlags(graph, 0))
        out.append(["launch", name(rt.cudaGraphLaunch(exec_, s))])
        out.append(["event synchronize", name(rt.cudaEventSynchronize(e))])
        return out

    cases: dict[str, Callable[[], list[Any]]] = {"freed inside": case_freed_inside, "kept": case_kept,
                                                 "events": case_events}
    answers = {}
    for label, case in cases.items():
        try:
            answers[label] = case()
        except Exception as exc:  # a case that broke: say so, and go on with the others
            answers[label] = [["raised", f"{type(exc).__name__}: {exc}"[:200]]]
        print(label, json.dumps(answers[label]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(answers, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
