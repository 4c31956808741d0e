# The old scenario files of `mpsd simulate`, kept readable by translating them into the one format, the
# workload file (mpsd.stress.workload): nothing here runs anything or builds a record; it rewrites the old
# tables as new ones, and parse_workload checks them like any workload. A scenario tenant's entries became one
# request loop:
#   back to back (no period, no sleep)  ->  requests = 1 (its entries, in order, are the request's calls)
#   period = P, repeat = N              ->  arrival = "uniform", rate = 1 / P (or a trace), requests = N
#   sleep = S, repeat = N               ->  the closed loop, think_ms = S * 1e3, requests = N
#   at = T                              ->  start = T
#   [[tenant.copy]] kind                ->  a [[tenant.kernel]] call memcpy_htod, memcpy_dtoh, memcpy_dtod, memset
#   [device] policy, policy_options     ->  [run] policy, [run.policy_options.<policy>]
# and [run] duration is one that every request is due within (an hour when a closed loop's end is not known).
# What has no such translation is refused, naming the tenant: one tenant's entries paced apart or on streams
# of their own (a workload tenant is one loop on one stream), several closed loops in one tenant.
"""Reading and converting the deprecated scenario format of `mpsd simulate`."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from mpsd.stress.workload import WorkloadError

__all__ = ["is_scenario", "to_toml", "to_workload"]

# What each table of a scenario may hold: anything else is a mistake, never silently a default.
KEYS = {
    "the scenario": {"device", "tenant"},
    "[device]": {"model", "policy", "policy_options"},
    "tenant": {"name", "count", "active_thread_percentage", "priority", "weight", "partition", "kernel", "copy"},
    "kernel": {"name", "grid", "block", "args", "repeat", "stream", "stream_priority", "at", "period", "sleep"},
    "copy": {"kind", "bytes", "repeat", "stream", "stream_priority", "at", "period", "sleep"},
}
CLOSED_DURATION = 3600.0  # simulated seconds: longer than any scenario's closed loops take
_OLD_ONLY = {"args", "stream", "stream_priority", "at", "period", "sleep"}  # kernel keys no workload has
_SCALARS = {"spin": ("cycles", 1), "work": ("iterations", 1), "fill_f32": ("elements", 3),
            "vector_add_f32": ("elements", 4), "saxpy_f32": ("elements", 4), "reduce_sum_f32": ("elements", 3)}
_COPIES = {"h2d": "memcpy_htod", "d2h": "memcpy_dtoh", "d2d": "memcpy_dtod", "memset": "memset"}


def is_scenario(data: dict[str, Any]) -> bool:
    """Whether a parsed TOML document is in the old scenario format rather than a workload."""
    if "device" in data:
        return True
    tenants = data.get("tenant")
    if "run" in data or not isinstance(tenants, list):
        return False
    return any(isinstance(t, dict) and ("copy" in t or any(isinstance(k, dict) and _OLD_ONLY & set(k)
                                                           for k in _list(t.get("kernel"))))
               for t in tenants)


def to_workload(scenario: dict[str, Any]) -> dict[str, Any]:
    """The workload document that says what a scenario says (check it with parse_workload).

    Raises:
        WorkloadError: an unknown key, or a scenario that has no workload form.
    """
    _known(scenario, "the scenario", "the scenario")
    device = scenario.get("device", {})
    _known(device, "[device]", "[device]")
    if str(device.get("model", "h200")).lower() != "h200":
        raise WorkloadError(f"[device]: unknown device model {device.get('model')!r} (known: h200)")
    run: dict[str, Any] = {}
    if "policy" in device:
        run["policy"] = device["policy"]
    if device.get("policy_options"):
        run["policy_options"] = {str(device.get("policy", "mps")): device["policy_options"]}
    tenants = [_tenant(t, i) for i, t in enumerate(_list(scenario.get("tenant")))]
    idle = [t.get("name", f"tenant{i}") for i, t in enumerate(tenants) if "kernel" not in t]
    if len(idle) == len(tenants):
        raise WorkloadError("the scenario launches no kernels")
    if idle:
        raise WorkloadError(f"tenant {idle[0]}: launches nothing (leave it out)")
    last = [due for t in tenants if (due := _last_due(t)) is not None]
    run["duration"] = CLOSED_DURATION if len(last) < len(tenants) else math.floor(max(last)) + 1.0
    return {"run": run, "tenant": tenants}


def _last_due(tenant: dict[str, Any]) -> float | None:
    """When a converted tenant's last request is due; None for a closed loop of several (that depends on the
    model)."""
    start, requests = tenant.get("start", 0.0), tenant["requests"]
    if tenant.get("arrival") == "uniform":
        return start + (requests - 1) / tenant["rate"]
    if tenant.get("arrival") == "trace":
        return start + tenant["trace"][-1]
    return start if requests == 1 else None


def _tenant(tenant: Any, index: int) -> dict[str, Any]:
    where = f"tenant {tenant.get('name', index) if isinstance(tenant, dict) else index}"
    _known(tenant, "tenant", where)
    out = {k: v for k, v in tenant.items() if k not in ("kernel", "copy")}
    entries, pacing = [], set()
    for kind in ("kernel", "copy"):
        for entry in _list(tenant.get(kind)):
            name = f"{where}: {kind} {entry.get('name', entry.get('kind', '')) if isinstance(entry, dict) else ''}"
            _known(entry, kind, name)
            at, period, sleep = (_number(entry, key, name) for key in ("at", "period", "sleep"))
            repeat, stream = entry.get("repeat", 1), entry.get("stream", 0)
            if period is not None and sleep is not None:
                raise WorkloadError(f"{name}: give period (open loop) or sleep (closed loop), not both")
            if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 0:
                raise WorkloadError(f"{name}: repeat must be a count >= 0, not {repeat!r}")
            if not isinstance(stream, int) or isinstance(stream, bool):
                raise WorkloadError(f"{name}: stream must be an integer, not {stream!r}")
            looped = bool(period) or sleep is not None  # repeat counts requests, not calls of one request
            if repeat:
                entries.append((kind, entry, looped))
                pacing.add((at or 0.0, period or None, sleep, stream, entry.get("stream_priority", 0),
                            repeat if looped else None))
    if not entries:
        return out
    if len(pacing) > 1 or (len(entries) > 1 and entries[0][1].get("sleep") is not None):
        raise WorkloadError(f"{where}: its kernels and copies are paced apart or on streams of their own, "
                            "which one workload tenant cannot say: split it into tenants")
    ((at, period, sleep, _stream, priority, repeat),) = pacing
    if at:
        out["start"] = at
    if priority:
        out["stream_priority"] = priority
    if sleep is not None:
        out.update(think_ms=sleep * 1e3, requests=repeat)
    elif period:
        assert repeat is not None  # (paced by a period, it loops: its count is kept)
        out.update(start=at, requests=repeat)
        if 1.0 / (1.0 / period) == period:
            out.update(arrival="uniform", rate=1.0 / period)
        else:
            out.update(arrival="trace", trace=[i * period for i in range(repeat)])
    else:
        out["requests"] = 1
    out["kernel"] = [_call(kind, entry, where, looped) for kind, entry, looped in entries]
    return out


def _call(kind: str, entry: dict[str, Any], where: str, looped: bool) -> dict[str, Any]:
    out: dict[str, Any] = {} if looped else {"repeat": entry.get("repeat", 1)}
    if kind == "copy":
        name = _COPIES.get(entry.get("kind", ""))  # ("" is no kind, as a missing one is not)
        if name is None:
            raise WorkloadError(f"{where}: copy {entry.get('kind')!r}: kind must be one of {', '.join(_COPIES)}")
        return {"name": name, "bytes": entry.get("bytes"), **out}
    name = entry.get("name")
    out = {"name": name, "grid": entry.get("grid", 1), "block": entry.get("block", 256), **out}
    if name not in _SCALARS:
        return out  # parse_workload names the unknown kernel
    key, count = _SCALARS[name]
    args = _list(entry.get("args"))
    value = args[-1] if len(args) == count else None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise WorkloadError(f"{where}: kernel {name!r}: args must be {count} values ending in a count "
                            f"(its {key}), not {entry.get('args')!r}")
    return {**out, key: value}


def _number(entry: dict[str, Any], key: str, where: str) -> float | None:
    value = entry.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
        raise WorkloadError(f"{where}: {key} must be a number >= 0 (seconds), not {value!r}")
    return value


def _known(table: Any, kind: str, where: str) -> None:
    if not isinstance(table, dict):
        raise WorkloadError(f"{where} must be a table")
    unknown = sorted(set(table) - KEYS[kind])
    if unknown:
        raise WorkloadError(f"{where}: unknown setting(s) {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(KEYS[kind]))})")


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


# -- writing TOML ----------------------------------------------------------------------------------------

def to_toml(doc: dict[str, Any]) -> str:
    """A TOML document of ``doc`` (tables, arrays of tables, and values tomllib reads back the same)."""
    lines: list[str] = []
    _write(doc, [], lines, array=False)
    return "\n".join(lines).strip() + "\n"


def _write(table: dict[str, Any], path: list[str], lines: list[str], array: bool) -> None:
    def nested(v: Any) -> bool:
        return isinstance(v, dict) or (isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v))

    if path and (array or any(not nested(v) for v in table.values())):
        lines.append(("[[{}]]" if array else "[{}]").format(".".join(map(_key, path))))
    lines.extend(f"{_key(k)} = {_value(v)}" for k, v in table.items() if not nested(v))
    for k, v in table.items():
        if isinstance(v, dict):
            _write(v, [*path, k], lines, array=False)
        elif nested(v):
            for item in v:
                _write(item, [*path, k], lines, array=True)


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key, ensure_ascii=False)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")
