#!/bin/bash
# On the H200 machine, in one call (device time is scarce): the backend tests on cuda:0 and the crosscheck with
# every tenant capped at 50% (1, 2, 3 processes) and at 25% (1 to 4), with SM windows placed all together and
# clients moved as tenants come and go (mpsd/backends/smgroups.py). Results in $OUT.
#   bash bench/fidelity/run_windows.sh
set -u
source bench/fidelity/device_env.sh || exit 1
export PYTHONFAULTHANDLER=1
timeout 150 bash bench/fidelity/run_backends.sh 2>&1 | tail -8
timeout 120 python3 bench/fidelity/crosscheck.py --only "spin at 50%,3 x spin at 50%" --json "$OUT/crosscheck_atp50_h200.json" 2>&1 \
    | tee "$OUT/crosscheck_atp50_h200.txt"
timeout 150 python3 bench/fidelity/crosscheck.py --only "spin at 25%,4 x spin at 25%" --json "$OUT/crosscheck_atp25_h200.json" 2>&1 \
    | tee "$OUT/crosscheck_atp25_h200.txt"
