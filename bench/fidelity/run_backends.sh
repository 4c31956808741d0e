#!/bin/bash
# On the H200 machine: the backend tests on the real GPU and on the simulator (tests/test_backends.py).
#   bash bench/fidelity/run_backends.sh [pytest options]
set -u
source bench/fidelity/device_env.sh || exit 1
nvidia-smi -L
python3 -c "import cuda.bindings, sys; print('cuda-python', cuda.bindings.__version__, sys.version.split()[0])"
python3 -m pytest -q -p no:cacheprovider -ra tests/test_backends.py "$@" 2>&1 | tee "$OUT/test_backends.log"
