# Sizes and limits in the syntax MPS users already write (`10G`, `900M`, `0=1G,1=512MB`), parsed the same way
# by the daemon's options and the client's environment.
from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in a size such as ``"512M"``, ``"1G"``, ``"1.5G"``, ``"512MB"`` or ``"4096"`` (binary units).

    Raises:
        ValueError: not a size.
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (expected e.g. 512M or 1G)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def parse_mem_limits(text: str) -> dict[int, int]:
    """Per-device limits from ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` syntax: ``"0=1G,1=512M"``.

    A bare size (``"2G"``) applies to every device and is returned under key -1.

    Raises:
        ValueError: malformed text.
    """
    limits: dict[int, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" in part:
            device, _, size = part.partition("=")
            if not device.strip().isdigit():
                raise ValueError(f"not a device ordinal: {device!r} in {text!r}")
            limits[int(device)] = parse_size(size)
        else:
            limits[-1] = parse_size(part)
    return limits


def format_size(nbytes: int) -> str:
    """A size for people: ``1.5 GiB``, ``512 MiB``, ``12 KiB``, ``100 B``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"
