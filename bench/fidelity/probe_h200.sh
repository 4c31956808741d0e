#!/bin/bash
# On the H200 machine: what the synchronize and the request cost look like from inside (check_sync.py, the
# daemon's profile under request_cost), and DISB-C under mps with this build's CUDA backend and with the one
# before it (old_cuda.py.txt, when present: a bisection of one change; it replaces mpsd/backends/cuda.py, so
# this runs last).
#   bash bench/fidelity/probe_h200.sh
set -u
source bench/fidelity/device_env.sh || exit 1
echo "== check_sync, mps, kernels last on the stream"
timeout 100 python3 bench/fidelity/check_sync.py --policy mps --requests 150 --no-events 2>&1 | tail -2
for policy in mps priority; do
    echo "== request_cost --policy $policy, the daemon profiled"
    timeout 100 python3 bench/request_cost.py --devices cuda:0 --policy $policy --repeat 2 --profile /tmp/prof_$policy \
        2>&1 | grep -E "mpsd |baseline|difference"
    python3 -c "import pstats; pstats.Stats('/tmp/prof_$policy/daemon.prof').sort_stats('tottime').print_stats(14)" \
        | grep -E "^ +[0-9]" | cut -c1-150
done
for build in this before; do
    if [ $build = before ]; then
        [ -f old_cuda.py.txt ] || break
        cp old_cuda.py.txt mpsd/backends/cuda.py
    fi
    echo "== disb_c, mps, the CUDA backend of $build build"
    timeout 100 python3 -m mpsd.stress.cli examples/workloads/disb_c.toml --devices cuda:0 --policy mps --duration 2 \
        --no-solo 2>&1 | grep -E "│ (critical|best_effort#0)"
done
