#!/bin/bash
# On the H200 machine: what nvidia-smi prints for the views mpsd-smi follows beyond -L and the CSV queries
# (the default table, -q and its -d sections, -i, bad ids), with exit codes. Writes $OUT/nvidia_smi_q_h200.txt.
#   bash bench/fidelity/record_nvidia_smi.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
{
  for args in "" "-q" "-q -d MEMORY" "-q -d UTILIZATION" "-q -d COMPUTE" "-q -d PIDS" "-q -d MEMORY,UTILIZATION" \
              "-i 0 -q -d MEMORY" "-i 0 -L" "-i 1 -q -d MEMORY" "-i GPU-nonexistent -q" "-i 0 -q -d PIDS,COMPUTE" \
              "-i 0" "-i 7" "-i 0 --query-gpu=name --format=csv" "-i 3 --query-gpu=name --format=csv" "-q -d BOGUS" \
              "-i GPU-8 --query-gpu=index --format=csv" "--query-gpu=index,name --format=csv -i 0" "-L -q" \
              "--query-gpu=pci.bus_id,compute_mode,count,driver_version,serial,gpu_uuid --format=csv" \
              "--query-gpu=index,pci.bus_id --format=csv,noheader"; do
    echo "===== nvidia-smi $args"
    nvidia-smi $args 2>&1
    echo "===== rc=$?"
  done
  echo "# The errors above are on stdout: the same commands with 2>/dev/null printed"
  for a in "-i 7" "-q -d BOGUS" "-L -i 0" "--query-gpu=bogus --format=csv"; do
    echo "== $a stdout only:"; nvidia-smi $a 2>/dev/null; echo "rc=$?"
  done
} > "$OUT/nvidia_smi_q_h200.txt"
