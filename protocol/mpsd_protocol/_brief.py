# What a peer sent, as an error message or a log line may quote it: short, on one line, and safe to build
# whatever the value is. repr() of a list nested a thousand deep raises RecursionError, and of a 1 MiB string
# builds a 1 MiB message, before any `:.40` could cut it; reprlib stops at a depth and a length first.
from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def brief(value: Any, limit: int = 40) -> str:
    """``repr(value)``, bounded in depth and cut to `limit` characters (ending in ``...`` when cut)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # a hostile __repr__ cannot reach us over msgpack, but a bug must not escape from here
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."
