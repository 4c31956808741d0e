#!/bin/bash
# On the H200 machine: every shipped workload through mpsd-stress against the real GPU (--devices cuda:0, the
# mps policy, half a second each, no solo runs), its table and JSON in $OUT.
set -u
source bench/fidelity/device_env.sh || exit 1
status=0
for workload in examples/workloads/*.toml; do
    name=$(basename "$workload" .toml)
    echo "== $name"
    if ! python3 -m mpsd.stress.cli "$workload" --devices cuda:0 --policy mps --duration 0.5 --no-solo --quiet \
            --json "$OUT/stress_$name.json" > "$OUT/stress_$name.txt" 2>&1; then
        status=1
    fi
    grep -E "^│ (all|[a-z_#0-9]+) " "$OUT/stress_$name.txt" | head -8
    tail -2 "$OUT/stress_$name.txt" | grep -i "error\|mpsd-stress" || true
done
exit $status
