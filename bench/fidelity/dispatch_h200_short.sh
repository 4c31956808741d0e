#!/bin/bash
# On the H200 machine, when device time is short: DISB-C through mpsd on cuda:0 under mps, priority and fair;
# the crosscheck's cap scenarios (spin); whether a synchronize returns after its work (check_sync.py); and
# DISB-C under mps with the CUDA backend of the build before (old_cuda.py.txt, when present: it replaces
# mpsd/backends/cuda.py, so this runs last). Tables in $OUT, as one archive and the crosscheck's two files.
#   bash bench/fidelity/dispatch_h200_short.sh
set -u
source bench/fidelity/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m mpsd.stress.cli examples/workloads/disb_c.toml --devices cuda:0 --compare-policies mps,priority,fair \
    --duration 2 --json "$OUT/dispatch_disb_c.json" > "$OUT/dispatch_disb_c.txt" 2>&1 || echo "(failed)"
sed -n '/policies compared/,$p' "$OUT/dispatch_disb_c.txt" | head -12
grep -E "^│ critical" "$OUT/dispatch_disb_c.txt"
echo "== check_sync, mps, kernels last on the stream"
timeout 60 python3 bench/fidelity/check_sync.py --policy mps --requests 150 --no-events 2>&1 | tail -2
scenarios=$(python3 bench/fidelity/crosscheck.py --list | cut -d: -f1 | grep -E "spin at|x spin|beside" | paste -sd,)
timeout 200 python3 bench/fidelity/crosscheck.py --only "$scenarios" --json "$OUT/crosscheck_h200.json" \
    > "$OUT/crosscheck_h200.txt" 2>&1
tail -4 "$OUT/crosscheck_h200.txt"
if [ -f old_cuda.py.txt ]; then
    cp old_cuda.py.txt mpsd/backends/cuda.py
    echo "== disb_c, mps, the CUDA backend of the build before"
    timeout 60 python3 -m mpsd.stress.cli examples/workloads/disb_c.toml --devices cuda:0 --policy mps --duration 2 \
        --no-solo 2>&1 | grep -E "│ (critical|best_effort#0)"
fi
tar -C "$OUT" -czf /tmp/dispatch_h200.tgz dispatch_disb_c.json dispatch_disb_c.txt && rm -f "$OUT"/dispatch_* \
    && mv /tmp/dispatch_h200.tgz "$OUT"/
