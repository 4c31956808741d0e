#!/bin/bash
# On the H200 machine (the device tool; carry .whl, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so), in about a minute: DISB-C through
# mpsd on cuda:0 under priority with the daemon under cProfile (MPSD_STRESS_PROFILE), for where its time goes
# between a kernel's end and the next launch; then bench/request_cost.py under mps, daemon and client profiled.
# The profiles in $OUT.
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
# Then a request of launches and a synchronize (bench/request_cost.py) under mps, daemon and client profiled.
mkdir -p /tmp/prof_request
timeout 60 python3 bench/request_cost.py --devices cuda:0 --policy mps --repeat 1 --profile /tmp/prof_request 2>&1 \
    | grep -E "mpsd|baseline|diff"
for f in /tmp/prof_request/*.prof; do
    cp "$f" "$OUT/request_cost_$(basename "$f")"
    echo "== $(basename "$f")"
    python3 -c "
import pstats, sys
p = pstats.Stats(sys.argv[1]); p.sort_stats('tottime').print_stats(25)" "$f" | tail -32
done
