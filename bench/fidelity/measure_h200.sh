#!/bin/bash
# On the H200 machine (the device tool; carry .whl, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so): the backend tests on the GPU, every
# crosscheck scenario (real MPS, mpsd on cuda:0, the model), and a request's cost through mpsd under mps and
# priority with the daemon and the client profiled (cProfile files, for where the time goes). In $OUT.
#   bash bench/fidelity/measure_h200.sh [--no-profile]     # without: the tests and the crosscheck only
set -u
source bench/fidelity/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -ra tests/test_backends.py -k cuda > "$OUT/test_backends.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/test_backends.log"
timeout 330 python3 bench/fidelity/crosscheck.py --json "$OUT/crosscheck_h200.json" > "$OUT/crosscheck_h200.txt" 2>&1
tail -40 "$OUT/crosscheck_h200.txt"
[ "${1:-}" = --no-profile ] && exit 0
for policy in mps priority; do
    mkdir -p "$OUT/prof_$policy"
    echo "== request_cost --policy $policy"
    timeout 60 python3 bench/request_cost.py --devices cuda:0 --policy $policy --repeat 3 2>&1 \
        | grep -E "mpsd|baseline|difference|result"
    timeout 60 python3 bench/request_cost.py --devices cuda:0 --policy $policy --repeat 1 --profile "$OUT/prof_$policy" \
        > /dev/null 2>&1
done
tar -C "$OUT" -czf /tmp/prof.tgz prof_mps prof_priority && rm -rf "$OUT"/prof_* && mv /tmp/prof.tgz "$OUT"/
