#!/bin/bash
# On the H200 machine, in one call (device time is scarce): the launch rate through mpsd on the real GPU, the
# crosscheck at 50% (SM caps as overlapping green contexts), the backend tests, and two shipped workloads under
# mpsd-stress, each bounded in time. Results in $OUT.
#   bash bench/fidelity/run_caps.sh
set -u
source bench/fidelity/device_env.sh || exit 1
export PYTHONFAULTHANDLER=1  # a process told SIGABRT below prints where it was
python3 bench/launch_rate.py --devices cuda:0 --repeat 3 > "$OUT/launch_rate.txt" 2>&1 &
bench=$!
for _ in $(seq 45); do kill -0 $bench 2>/dev/null || break; sleep 1; done
if kill -0 $bench 2>/dev/null; then  # stuck: the stacks of it and of its daemon (its child), then stop both
    children=$(pgrep -P $bench)
    for pid in $children $bench; do kill -ABRT "$pid"; done
    sleep 2
    for pid in $children $bench; do kill -KILL "$pid" 2>/dev/null; done
fi
wait $bench
tail -14 "$OUT/launch_rate.txt"
timeout 90 python3 bench/fidelity/crosscheck.py --only "spin at 50%,3 x spin at 50%" --json "$OUT/crosscheck_atp50.json" 2>&1 \
    | tee "$OUT/crosscheck_atp50.txt"
timeout 70 bash bench/fidelity/run_backends.sh 2>&1 | tail -6
for name in inference_training bandwidth; do
    timeout 30 python3 -m mpsd.stress.cli "examples/workloads/$name.toml" --devices cuda:0 --policy mps --duration 0.5 \
        --no-solo --quiet > "$OUT/stress_$name.txt" 2>&1
    echo "== $name: exit $?"; grep -E "^│ " "$OUT/stress_$name.txt" | head -6
done
