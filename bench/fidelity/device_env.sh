# Source on the H200 machine (the device tool), from the repo root: installs the packages its image lacks from
# the wheels carried in .whl/ (trio, outcome, sniffio, pytest-trio, rich), makes mpsd_client and mpsd_protocol
# importable from the checkout, and keeps NVLink multicast off as the machine asks.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
mkdir -p /tmp/pk && ln -sfn "$PWD/client" /tmp/pk/mpsd_client && ln -sfn "$PWD/protocol" /tmp/pk/mpsd_protocol
export PYTHONPATH=/tmp/site:/tmp/pk:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
