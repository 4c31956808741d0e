# Source on the H200 machine (the device tool), from the repo root: installs the packages its image lacks from
# the wheels carried in .whl/ (trio, outcome, sniffio, pytest-trio, rich, setproctitle), puts the checkout on the path (the
# compiled parts, mpsd/_core.abi3.so and protocol/mpsd_protocol/_wire.abi3.so, must be carried: the machine has
# no Rust), and keeps NVLink multicast off
# as the machine asks.
# (.whl/ may hold a compiled wheel for several Pythons: pip takes the one this Python can use.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    --find-links .whl $(ls .whl | sed 's/-.*//' | sort -u) || return 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/protocol:$PWD/client PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
