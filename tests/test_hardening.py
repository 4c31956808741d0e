# The adversarial suite: what a hostile local user, or a careless one, can do to a real daemon and its real
# clients (issue 13). Each test pins one defence. The packets, directories and fake servers are real; where an
# attack needs another owner, a real second user plays it (as in test_ipc), and the test is skipped without one.
from __future__ import annotations

import pytest

import mpsd_client

# -- item 1: numbers are read strictly -----------------------------------------------------------------------

@pytest.mark.parametrize("variable,value,outcome", [
    ("CUDA_VISIBLE_DEVICES", "0,²", "connected"),  # as in CUDA, the list ends at what is not a device index
    ("CUDA_VISIBLE_DEVICES", "①", "cudaErrorNoDevice"),
    ("MPSD_MIG_PARTITION", "²", "cudaErrorInvalidValue"),
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "٥٠", "cudaErrorInvalidValue"),
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=٥G", "cudaErrorInvalidValue"),
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=" + "9" * 5000, "cudaErrorInvalidValue"),
])
def test_client_environment_numbers_are_ascii(daemon, monkeypatch, variable, value, outcome):
    """The client reads the numbers in its environment as strictly as the daemon reads control arguments: a
    lookalike digit is a CUDA error (or ends CUDA_VISIBLE_DEVICES), never a ValueError or a different number."""
    monkeypatch.setenv(variable, value)
    try:
        with mpsd_client.connect(daemon.pipe_dir):
            result = "connected"
    except mpsd_client.CudaError as exc:
        result = exc.name
    assert result == outcome
