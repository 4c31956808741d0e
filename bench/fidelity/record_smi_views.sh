#!/bin/bash
# On the H200 machine: the nvidia-smi views mpsd-smi lacks (dmon, pmon, topo -m, mig -lgi/-lci) and the full field
# lists of --query-gpu and --query-compute-apps, with exit codes, idle and with one CUDA process running.
# Writes $OUT/nvidia_smi_views_h200.txt.
#   bash bench/fidelity/record_smi_views.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
views() {
  for args in "dmon -c 2" "dmon -c 1 -s u" "dmon -c 1 -s pucvmet" "dmon -c 1 -o T" "dmon -c 1 --format csv" \
              "dmon -c 1 -i 0" "dmon -c 1 -i 5" "dmon -c 1 -s z" \
              "pmon -c 2" "pmon -c 1 -s u" "pmon -c 1 -s m" "pmon -c 1 -o T" "pmon -c 1 -i 5" \
              "topo -m" "topo -mp" "topo -p2p r" "topo -c 0" \
              "mig -lgi" "mig -lci" "mig -lgip" "mig -lgipp" "mig -lcip" "-q -d MIG" \
              "--query-gpu=mig.mode.current,mig.mode.pending --format=csv"; do
    echo "===== nvidia-smi $args"
    timeout 20 nvidia-smi $args 2>&1
    echo "===== rc=$?"
  done
}
{
  echo "##### idle"
  views
  echo "##### one CUDA process (python, a spinning kernel)"
  python3 - <<'PY' &
import time, torch
x = torch.ones(1 << 26, device="cuda")
end = time.time() + 30
while time.time() < end:
    x.mul_(1.0000001)
    torch.cuda.synchronize()
PY
  sleep 6
  for args in "pmon -c 2" "pmon -c 1 -s um" "dmon -c 2" "--query-compute-apps=pid,process_name,used_memory --format=csv"; do
    echo "===== nvidia-smi $args"
    timeout 20 nvidia-smi $args 2>&1
    echo "===== rc=$?"
  done
  kill %1 2>/dev/null; wait
  echo "##### field lists"
  echo "===== nvidia-smi --help-query-gpu"; nvidia-smi --help-query-gpu 2>&1; echo "===== rc=$?"
  echo "===== nvidia-smi --help-query-compute-apps"; nvidia-smi --help-query-compute-apps 2>&1; echo "===== rc=$?"
  echo "===== nvidia-smi dmon -h"; nvidia-smi dmon -h 2>&1; echo "===== rc=$?"
  echo "===== nvidia-smi pmon -h"; nvidia-smi pmon -h 2>&1; echo "===== rc=$?"
} > "$OUT/nvidia_smi_views_h200.txt"
