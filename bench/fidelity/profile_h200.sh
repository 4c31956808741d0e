#!/bin/bash
# On the H200 machine (the device tool; carry .whl and mpsd/_core.abi3.so), in about a minute: DISB-C through
# mpsd on cuda:0 under priority with the daemon under cProfile (MPSD_STRESS_PROFILE), for where its time goes
# between a kernel's end and the next launch. The profile in $OUT.
#   bash bench/fidelity/profile_h200.sh
set -u
source bench/fidelity/device_env.sh || exit 1
mkdir -p /tmp/prof
MPSD_STRESS_PROFILE=/tmp/prof timeout 120 python3 -m mpsd.stress.cli examples/workloads/disb_c.toml --devices cuda:0 \
    --policy priority --duration 2 --no-solo --quiet 2>&1 | grep -E "critical |best_effort#0|all "
cp /tmp/prof/daemon-*.prof "$OUT/disb_c_priority_daemon.prof"
python3 -c "
import pstats, sys
p = pstats.Stats(sys.argv[1]); p.sort_stats('tottime').print_stats(35)" "$OUT/disb_c_priority_daemon.prof" | tail -45
