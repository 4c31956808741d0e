#!/bin/bash
# On the H200 machine (the device tool; carry .whl, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so): the cap tests on the GPU and the
# crosscheck's cap, overlap and latency scenarios (real MPS, mpsd on cuda:0, the model). In $OUT.
#   bash bench/fidelity/caps_h200.sh
set -u
source bench/fidelity/device_env.sh || exit 1
timeout 100 python3 -m pytest -q -p no:cacheprovider -ra tests/test_backends.py -k "cuda and (caps or capped)" \
    > "$OUT/test_caps.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/test_caps.log"
scenarios=$(python3 bench/fidelity/crosscheck.py --list | cut -d: -f1 \
    | grep -E "^(spin at (20|25|33|50)%|3 x spin|4 x spin at|spin at 50% beside|latency)" | paste -sd,)
timeout 200 python3 bench/fidelity/crosscheck.py --only "$scenarios" --json "$OUT/crosscheck_caps_h200.json" \
    > "$OUT/crosscheck_caps_h200.txt" 2>&1
cat "$OUT/crosscheck_caps_h200.txt"
