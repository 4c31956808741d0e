#!/bin/bash
# On the H200 machine (the device tool; carry .whl, with py-spy's wheel, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so): run the GPU
# tests named by -k "$1" and, if they have not ended after $2 seconds (default 60), dump the Python stacks of
# every process of the run with py-spy, then stop them: for finding where a test hangs on the GPU.
#   bash bench/fidelity/hang_h200.sh "gate or cuda-priority" 60   (MPSD_TEST_GATES=1 for the gates' cases)
set -u
source bench/fidelity/device_env.sh || exit 1
python3 -m pytest -v --tb=short -p no:cacheprovider -ra tests/test_backends.py -k "$1" > "$OUT/hang.log" 2>&1 &
runner=$!
for _ in $(seq "${2:-60}"); do
    sleep 1
    kill -0 $runner 2>/dev/null || break
done
if kill -0 $runner 2>/dev/null; then
    for pid in $(pgrep -f "python3|python -m mpsd|mpsd"); do
        echo "== $pid: $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-150)"
        /tmp/site/bin/py-spy dump --pid "$pid" 2>&1 | head -60
    done
    pkill -P $runner; kill $runner
fi
grep -vE "^(tests|$)" "$OUT/hang.log" | tail -60; grep -E "PASSED|FAILED" "$OUT/hang.log"
