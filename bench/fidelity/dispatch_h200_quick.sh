#!/bin/bash
# On the H200 machine (the device tool; carry .whl, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so), in about five minutes: the backend
# tests of the policies, synchronize and caps on the GPU, the crosscheck's latency scenarios, DISB-C's shape straight under real MPS, DISB-C and
# inference_training through mpsd on cuda:0 under mps, priority and fair, and the dispatcher's cost. In $OUT.
#   bash bench/fidelity/dispatch_h200_quick.sh
set -u
source bench/fidelity/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider -ra tests/test_backends.py \
    -k "cuda and (kernel_policy or synchronize or caps)" > "$OUT/test_backends.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/test_backends.log"
scenarios=$(python3 bench/fidelity/crosscheck.py --list | cut -d: -f1 | grep -E "^latency" | paste -sd,)
timeout 90 python3 bench/fidelity/crosscheck.py --only "$scenarios" --json "$OUT/crosscheck_latency_h200.json" \
    > "$OUT/crosscheck_latency_h200.txt" 2>&1
cat "$OUT/crosscheck_latency_h200.txt"
echo "== DISB-C's shape, direct cuda-python processes"
timeout 60 python3 bench/fidelity/disb_direct.py --duration 2 --json "$OUT/dispatch_disb_direct.json"
for workload in disb_c inference_training; do
    echo "== $workload"
    timeout 100 python3 -m mpsd.stress.cli examples/workloads/$workload.toml --devices cuda:0 \
        --compare-policies mps,priority,fair --duration 2 $([ $workload = disb_c ] || echo --no-solo) --json "$OUT/dispatch_$workload.json" \
        > "$OUT/dispatch_$workload.txt" 2>&1 || echo "(failed)"
    sed -n '/policies compared/,/└/p' "$OUT/dispatch_$workload.txt" | sed -n 4,11p
done
for policy in mps priority; do
    echo "== launch_rate, request_cost --policy $policy"
    timeout 40 python3 bench/launch_rate.py --devices cuda:0 --policy $policy --repeat 3 2>&1 | grep -E "rate|ratio"
    timeout 40 python3 bench/request_cost.py --devices cuda:0 --policy $policy --repeat 3 2>&1 | grep -E "mpsd|baseline|diff"
done
