#!/bin/bash
# On the H200 machine (the device tool; carry .whl, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so): every crosscheck scenario under
# real MPS, through mpsd on cuda:0 and on the simulated H200 (issue 33, item 2). Results in $OUT.
#   bash bench/fidelity/crosscheck_h200.sh
set -u
source bench/fidelity/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 bench/fidelity/crosscheck.py --json "$OUT/crosscheck_h200.json" 2>&1 | tee "$OUT/crosscheck_h200.txt"
