#!/bin/sh
# Stop MPS on this node at the end of the job (the epilogue to enable_mps.sh): the same directories, then
# `quit` on the control daemon's stdin, which returns once the daemon and its servers have gone.
node_dir=${MPS_NODE_DIR:-/tmp}
export CUDA_MPS_PIPE_DIRECTORY="$node_dir/nvidia-mps"
export CUDA_MPS_LOG_DIRECTORY="$node_dir/nvidia-log"
echo quit | nvidia-cuda-mps-control && echo "MPS stopped on $(hostname)"
