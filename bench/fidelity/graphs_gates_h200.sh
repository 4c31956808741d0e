#!/bin/bash
# On the H200 machine (the device tool; carry .whl, with py-spy's wheel, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so), in about four
# minutes: the gates' GPU cases under a watchdog (hang_h200.sh), the graph benchmark on cuda:0 beside direct
# cuda-python graph launches, the capture rules no run had answered (measure_graph_capture.py --more), and the
# nvidia-smi views mpsd-smi lacks (record_smi_views.sh). In $OUT.
#   bash bench/fidelity/graphs_gates_h200.sh
set -u
source bench/fidelity/device_env.sh || exit 1
MPSD_TEST_GATES=1 bash bench/fidelity/hang_h200.sh "gate or cuda-priority" 90 > "$OUT/gates.txt" 2>&1
tail -5 "$OUT/gates.txt"
echo "== graph_launch --devices cuda:0"
timeout 90 python3 bench/graph_launch.py --devices cuda:0 > "$OUT/graph_launch_cuda.txt" 2>&1; echo "rc=$?"
tail -15 "$OUT/graph_launch_cuda.txt"
echo "== measure_graph_capture --more"
timeout 90 python3 bench/fidelity/measure_graph_capture.py --more --json "$OUT/graph_capture_more_h200.json" \
    > "$OUT/graph_capture_more_h200.txt" 2>&1; echo "rc=$?"
tail -5 "$OUT/graph_capture_more_h200.txt"
timeout 120 bash bench/fidelity/record_smi_views.sh; echo "smi views rc=$?"; wc -l "$OUT/nvidia_smi_views_h200.txt"
