#!/bin/sh
# Start MPS on this node, as an HPC site's job prologue does (ALCF's Polaris documents a script of this shape,
# run once per node before the ranks start): choose the pipe and log directories, export them so that the
# control daemon and every CUDA process of the job agree, and start the daemon in the background.
# MPS_NODE_DIR picks where the directories go (a site uses /tmp or a job-local disk).
node_dir=${MPS_NODE_DIR:-/tmp}
export CUDA_MPS_PIPE_DIRECTORY="$node_dir/nvidia-mps"
export CUDA_MPS_LOG_DIRECTORY="$node_dir/nvidia-log"
nvidia-cuda-mps-control -d && echo "MPS started on $(hostname)"
