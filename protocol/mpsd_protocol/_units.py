# Numbers, sizes and limits in the syntax MPS users already write (`50`, `10G`, `900M`, `0=1G,1=512MB`), parsed
# the same way by the daemon's options and control language and by the client's environment. Parsing is strict
# on purpose: ASCII digits only, of bounded length. Python's `str.isdigit()` is true of "²" and "①", which
# `int()` then refuses, and `int()`/`float()` take "٥٠" (Arabic-Indic digits), "1_0", " 5 ", "nan" and numbers
# of any length; what reaches the daemon from other users must not be able to surprise it, so every number
# goes through the two regular expressions here.
from __future__ import annotations

import re

MAX_DIGITS = 10  # enough for any pid, uid (32 bits), device index or priority level
_UNSIGNED = re.compile(r"[0-9]+", re.ASCII)
_SIGNED = re.compile(r"-?[0-9]+", re.ASCII)
_DECIMAL = re.compile(r"(?P<int>[0-9]+)(?:\.(?P<frac>[0-9]+))?(?:[eE](?P<exp>[-+]?[0-9]{1,3}))?", re.ASCII)
_SIZE = re.compile(r"\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([KMGT]?)(?:i?B)?\s*", re.ASCII | re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_SIZE = (1 << 63) - 1  # bytes: what a signed 64-bit count (and msgpack) can carry
# CUDA_DEVICE_MAX_CONNECTIONS: the hardware work queues a context's streams are aliased onto, 1 to 32, 8 unset
DEFAULT_CONNECTIONS, MAX_CONNECTIONS = 8, 32


def parse_integer(text: str, *, signed: bool = False, max_digits: int = MAX_DIGITS) -> int:
    """An integer written as 1 to `max_digits` ASCII digits, after a ``-`` only where `signed`.

    Raises:
        ValueError: anything else (other digits, signs, spaces, underscores, too many digits).
    """
    if not (_SIGNED if signed else _UNSIGNED).fullmatch(text) or len(text.lstrip("-")) > max_digits:
        raise ValueError(f"not an integer of at most {max_digits} digits: {text[:24]!r}")
    return int(text)


def parse_percentage(text: str) -> float | None:
    """An active thread percentage as MPS v3 and its configuration file take one: a decimal in (0, 100]; None if
    `text` is not one."""
    try:
        value = parse_decimal(text)
    except ValueError:
        return None
    return value if 0 < value <= 100 else None


def parse_decimal(text: str, *, max_digits: int = MAX_DIGITS) -> float:
    """A non-negative decimal number in ASCII (``50``, ``2.5``, ``1e-05``), with at most `max_digits` digits
    before and after the point. The caller checks its range (it may be ``inf`` from a large exponent).

    Raises:
        ValueError: anything else (other digits, signs, spaces, ``nan``, ``inf``, too many digits).
    """
    match = _DECIMAL.fullmatch(text)
    if not match or len(match["int"]) > max_digits or len(match["frac"] or "") > max_digits:
        raise ValueError(f"not a decimal number: {text[:24]!r}")
    return float(text)


def parse_size(text: str) -> int:
    """Bytes in a size such as ``"512M"``, ``"1G"``, ``"1.5G"``, ``"512MB"`` or ``"4096"`` (binary units).

    Raises:
        ValueError: not a size, or more than 2**63 - 1 bytes.
    """
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"not a size: {text[:24]!r} (expected e.g. 512M or 1G)")
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if nbytes > MAX_SIZE:
        raise ValueError(f"size too large: {text[:24]!r} (at most 8 EiB)")
    return nbytes


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
            try:
                ordinal = parse_integer(device.strip())
            except ValueError:
                raise ValueError(f"not a device ordinal: {device[:24]!r} in {text[:80]!r}") from None
            limits[ordinal] = parse_size(size)
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
