#!/bin/bash
# On the H200 machine (the device tool; carry .whl, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so), in about four minutes: every GPU test
# of tests/test_backends.py, trace_h200.sh (DISB-C and inference_training traced, under mps and priority), and
# the dispatcher's cost (launch_rate, request_cost under mps and priority). In $OUT.
#   bash bench/fidelity/session_h200.sh
set -u
source bench/fidelity/device_env.sh || exit 1
timeout 240 python3 -m pytest -q -p no:cacheprovider -ra tests/test_backends.py tests/test_cuda_trace.py -k "cuda or trace or gate" \
    > "$OUT/test_backends.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/test_backends.log"
bash bench/fidelity/trace_h200.sh 2>&1 | grep -v "^NVIDIA\|passed\|failed"
for policy in mps priority; do
    echo "== launch_rate, request_cost --policy $policy"
    timeout 40 python3 bench/launch_rate.py --devices cuda:0 --policy $policy --repeat 3 2>&1 | grep -E "rate|ratio"
    timeout 40 python3 bench/request_cost.py --devices cuda:0 --policy $policy --repeat 3 2>&1 | grep -E "mpsd|baseline|diff"
done
