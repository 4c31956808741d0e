#!/bin/bash
# On the H200 machine (the device tool; carry .whl, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so), in about three minutes: the traced
# CUDA backend's tests, then DISB-C and inference_training through mpsd on cuda:0 under mps and priority with
# the device traced, each policy's trace summarised by trace_gaps.py. In $OUT.
#   bash bench/fidelity/trace_h200.sh
set -u
source bench/fidelity/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -n "${NO_TESTS:-}" ] || timeout 120 python3 -m pytest -q -p no:cacheprovider -ra tests/test_cuda_trace.py tests/test_backends.py \
    -k "trace" > "$OUT/test_trace.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/test_trace.log"
for workload in ${WORKLOADS:-disb_c inference_training}; do
    echo "== $workload"
    timeout 150 python3 -m mpsd.stress.cli examples/workloads/$workload.toml --devices cuda:0 --quiet \
        --compare-policies mps,priority --duration 2 --json "$OUT/trace_$workload.json" \
        --report "/tmp/report_$workload" > "/tmp/trace_$workload.txt" 2>&1 || { echo "(failed)"; tail -5 "/tmp/trace_$workload.txt"; }
    sed -n '/policies compared/,/└/p' "/tmp/trace_$workload.txt" | sed -n 4,30p
    python3 bench/fidelity/trace_gaps.py /tmp/report_$workload/trace_*.json
    python3 bench/fidelity/trace_reaction.py /tmp/report_$workload/trace_*.json
    for trace in /tmp/report_$workload/trace_*.json; do  # what comes back: 8 files at most, 16 MiB each
        gzip -c "$trace" > "$OUT/${workload}_$(basename "$trace").gz"
        [ "$(stat -c %s "$OUT/${workload}_$(basename "$trace").gz")" -lt 15000000 ] || rm "$OUT/${workload}_$(basename "$trace").gz"
    done
done
