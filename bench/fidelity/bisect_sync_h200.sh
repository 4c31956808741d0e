#!/bin/bash
# On the H200 machine: does a stream's synchronize return only after its work, beside best-effort clients
# (check_sync.py), with this build's CUDA backend; then DISB-C under mps, priority and fair. In $OUT.
#   bash bench/fidelity/bisect_sync_h200.sh
source bench/fidelity/device_env.sh
timeout 60 python3 bench/fidelity/check_sync.py --policy mps --requests 150 --no-events 2>&1 | tail -2
python3 -m mpsd.stress.cli examples/workloads/disb_c.toml --devices cuda:0 --compare-policies mps,priority,fair \
    --duration 2 --json $OUT/dispatch_disb_c.json > $OUT/dispatch_disb_c.txt 2>&1
sed -n '/policies compared/,$p' $OUT/dispatch_disb_c.txt | head -12
