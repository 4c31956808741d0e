#!/bin/bash
# On the H200 machine (the device tool; carry .whl, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so): the kernel-level dispatcher on the
# real GPU, beside DISB-C's shape run straight under real MPS. Everything lands in $OUT as dispatch_*.
#   bash bench/fidelity/dispatch_h200.sh
set -u
source bench/fidelity/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stress() {  # name, then mpsd-stress's arguments
    local name=$1; shift
    echo "== $name: mpsd-stress $*"
    python3 -m mpsd.stress.cli "$@" --json "$OUT/dispatch_$name.json" > "$OUT/dispatch_$name.txt" 2>&1 || echo "(failed)"
    sed -n '/policies compared/,$p' "$OUT/dispatch_$name.txt"
    grep -E "^│ (critical|best_effort#0|inference|training)" "$OUT/dispatch_$name.txt" | head -6
    grep -iE "error|Traceback" "$OUT/dispatch_$name.txt" | head -5
}
echo "== DISB-C's shape, direct cuda-python processes"
python3 bench/fidelity/disb_direct.py --duration 2 --json "$OUT/dispatch_disb_direct.json"
stress disb_c examples/workloads/disb_c.toml --devices cuda:0 --compare-policies mps,priority,fair,round-robin,timeslice \
    --duration 2
for n in 1 4; do  # the bound on a client's kernels in flight (default 2, in the run above)
    sed "s/^aging = 0.05$/aging = 0.05\nkernels_in_flight = $n/" examples/workloads/disb_c.toml > /tmp/disb_c_k$n.toml
    stress disb_c_k$n /tmp/disb_c_k$n.toml --devices cuda:0 --policy priority --duration 2 --no-solo
done
stress inference_training examples/workloads/inference_training.toml --devices cuda:0 \
    --compare-policies mps,priority,fair --duration 2 --no-solo
for policy in mps priority; do
    echo "== launch_rate --policy $policy"
    python3 bench/launch_rate.py --devices cuda:0 --policy $policy --repeat 3 2>&1 | grep -E "rate|ratio|CPU"
    echo "== request_cost --policy $policy"
    python3 bench/request_cost.py --devices cuda:0 --policy $policy --repeat 3 2>&1 | grep -E "mpsd|baseline|difference|result"
done
# The device tool brings back at most 8 files: everything as one archive.
tar -C "$OUT" -czf /tmp/dispatch_h200.tgz . && rm -f "$OUT"/dispatch_* && mv /tmp/dispatch_h200.tgz "$OUT"/
