# The environment an MPS client reads, read the same way: CUDA_VISIBLE_DEVICES picks and renumbers devices
# (the daemon applies it, since only it knows which devices exist),
# CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT and CUDA_MPS_CLIENT_PRIORITY ask for
# tighter quotas (the daemon never lets them loosen its own: a smaller share, a smaller limit, a less urgent
# priority than the daemon's level, whose finer levels only the control plane sets), MPSD_MIG_PARTITION picks
# a MIG instance, CUDA_MPS_SM_PARTITION a static SM partition (-S), CUDA_DEVICE_MAX_CONNECTIONS the hardware
# work queues its streams share (1 to 32, 8 by default, as CUDA documents it), CUDA_MPS_PIPE_DIRECTORY (or
# MPSD_PIPE_DIRECTORY) says where the daemon is. Only the daemon applies the rules; this module only reads and
# checks the variables.
from __future__ import annotations

import os
from typing import Any, Mapping

from mpsd_protocol import (
    MAX_CONNECTIONS,
    InvalidDeviceError,
    InvalidValueError,
    brief,
    parse_decimal,
    parse_integer,
    parse_mem_limits,
)



def visible_devices(environ: Mapping[str, str] = os.environ) -> list[int | str] | None:
    """The devices CUDA_VISIBLE_DEVICES names, in order (None when it is unset): indices, or UUIDs (``GPU-...``,
    whole or a prefix that names one device, as CUDA takes them), or MIG devices (``MIG-<uuid>``, or the older
    ``MIG-GPU-<uuid>/<gi>/<ci>``).

    Like CUDA, the list ends at the first entry that is neither; the daemon drops the devices it does not have
    (and what follows them), then renumbers what is left from 0.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    devices: list[int | str] = []
    for part in (p.strip() for p in visible.split(",")):
        if part.startswith(("GPU-", "MIG-")) and len(part) <= UUID_MAX and part.isascii():
            devices.append(part)
            continue
        try:
            devices.append(parse_integer(part))
        except ValueError:  # "²" and "٥" are not device indices either, whatever str.isdigit() says
            break
    return devices


UUID_MAX = 64  # characters of a device UUID (GPU- and 36), with room to spare; longer is no UUID


def check_ordinal(device: object) -> int:
    """Raises InvalidDeviceError unless `device` is a non-negative int."""
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise InvalidDeviceError(f"device ordinal {brief(device, 20)} is not a non-negative int")
    return device


def requested_limits(device: int, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The quotas this process asks for on `device` (its own ordinal), from the CUDA_MPS_* variables.

    Raises:
        InvalidValueError: a variable is malformed (naming it).
    """
    limits: dict[str, Any] = {}
    text = environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if text:
        try:
            limits["active_thread_percentage"] = parse_decimal(text.strip())
        except ValueError:
            raise InvalidValueError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={text!r} is not a number") from None
        if not 0 < limits["active_thread_percentage"] <= 100:
            raise InvalidValueError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={text!r} is outside (0, 100]")
    text = environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    if text:
        try:
            per_device = parse_mem_limits(text)
        except ValueError as exc:
            raise InvalidValueError(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: {exc}") from None
        limit = per_device.get(device, per_device.get(-1))
        if limit is not None:
            limits["pinned_mem_limit"] = limit
    text = environ.get("MPSD_MIG_PARTITION")
    if text:
        try:
            limits["partition"] = parse_integer(text.strip())
        except ValueError:
            raise InvalidValueError(f"MPSD_MIG_PARTITION={brief(text, 40)} must be a partition index") from None
    text = environ.get("CUDA_MPS_SM_PARTITION")
    if text:  # a static SM partition of a daemon started with -S, by the id sm_partition add printed
        if not text.strip().isascii() or not text.strip().isprintable() or len(text.strip()) > 64:
            raise InvalidValueError(f"CUDA_MPS_SM_PARTITION={brief(text, 40)} is not a partition id")
        limits["sm_partition"] = text.strip()
    text = environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if text:
        try:
            connections = parse_integer(text.strip())
        except ValueError:
            raise InvalidValueError(f"CUDA_DEVICE_MAX_CONNECTIONS={brief(text, 40)} is not a number") from None
        # CUDA's driver takes what it can of a request ("the number actually allocated may differ"): 1 to 32
        limits["connections"] = min(max(connections, 1), MAX_CONNECTIONS)
    text = environ.get("CUDA_MPS_CLIENT_PRIORITY")
    if text:
        if text.strip() not in ("0", "1"):
            raise InvalidValueError(f"CUDA_MPS_CLIENT_PRIORITY={text!r} must be 0 or 1")
        limits["priority"] = int(text)
    return limits
