# Launch validation (shape, then arguments), shared by both ends: the client checks a launch before it
# leaves (so a bad launch raises at the call, as cudaLaunchKernel returns its error), and the daemon checks
# again because it trusts no client. Kernel signatures come from the daemon in the handshake: a list of
# parameter kinds per kernel.
from __future__ import annotations

from typing import Any, Sequence

from ._brief import brief
from ._errors import InvalidConfigurationError, InvalidValueError

PARAM_KINDS = frozenset({"ptr", "i64", "f32"})
_I64 = (-(2**63), 2**63 - 1)
_U64_MAX = 2**64 - 1


def dims(value: Any, maximum: Sequence[int], what: str) -> tuple[int, int, int]:
    """`value` (an int or a tuple of 1 to 3 ints) as an (x, y, z) triple within `maximum`.

    Raises:
        InvalidConfigurationError: a dimension is not a positive int within its limit.
    """
    if type(value) is list and len(value) == 3:  # the shape every launch from our client arrives in
        x, y, z = value
        if (type(x) is int and type(y) is int and type(z) is int
                and 0 < x <= maximum[0] and 0 < y <= maximum[1] and 0 < z <= maximum[2]):
            return x, y, z
    triple = (value,) if isinstance(value, int) else tuple(value) if isinstance(value, (tuple, list)) else None
    if triple is None or not 1 <= len(triple) <= 3:
        raise InvalidConfigurationError(f"{what} must be an int or a tuple of 1 to 3 ints, not {brief(value, 60)}")
    triple = triple + (1,) * (3 - len(triple))
    for size, limit in zip(triple, maximum):
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= limit:
            raise InvalidConfigurationError(f"{what} {brief(value, 60)} is outside 1..{tuple(maximum)}")
    return triple


def check_shape(name: str, grid: Any, block: Any, shared_mem: Any,
                limits: dict[str, Any]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Validate a launch's grid, block and dynamic shared memory against the device's limits.

    Returns:
        The grid and block as (x, y, z) triples.

    Raises:
        InvalidConfigurationError: bad grid or block shape.
        InvalidValueError: too much shared memory.
    """
    if type(grid) is list and type(block) is list and len(grid) == 3 and len(block) == 3 and type(shared_mem) is int:
        # The shape every launch from our client arrives in, checked in one go (most of a launch's checking
        # was calls); anything else, and any launch that breaks a rule, takes the path below, which names it.
        (gx, gy, gz), (bx, by, bz) = grid, block
        mg, mb = limits["max_grid_dims"], limits["max_block_dims"]
        if (type(gx) is int and type(gy) is int and type(gz) is int and type(bx) is int and type(by) is int
                and type(bz) is int and 0 < gx <= mg[0] and 0 < gy <= mg[1] and 0 < gz <= mg[2] and 0 < bx <= mb[0]
                and 0 < by <= mb[1] and 0 < bz <= mb[2] and bx * by * bz <= limits["max_threads_per_block"]
                and 0 <= shared_mem <= limits["shared_memory_per_block_optin"]):
            return (gx, gy, gz), (bx, by, bz)
    grid3 = dims(grid, limits["max_grid_dims"], "grid")
    block3 = dims(block, limits["max_block_dims"], "block")
    if block3[0] * block3[1] * block3[2] > limits["max_threads_per_block"]:
        raise InvalidConfigurationError(
            f"block {block!r} has more than {limits['max_threads_per_block']} threads")
    if not isinstance(shared_mem, int) or isinstance(shared_mem, bool) or not (
            0 <= shared_mem <= limits["shared_memory_per_block_optin"]):
        raise InvalidValueError(f"shared_mem {brief(shared_mem, 40)} is outside "
                                f"0..{limits['shared_memory_per_block_optin']}")
    return grid3, block3


def check_args(name: str, params: Sequence[str], args: Any) -> list[int | float]:
    """Validate a launch's arguments against the kernel's parameter kinds.

    Returns:
        The arguments as a plain list (pointers and i64 as ints, f32 as floats).

    Raises:
        InvalidValueError: wrong argument count or kind.
    """
    if type(args) is list and len(args) == len(params):
        # Ints and floats as our client sends them, checked in one pass; anything else takes the path below.
        fast: list[int | float] = []
        for kind, arg in zip(params, args):
            if type(arg) is int and (0 <= arg <= _U64_MAX if kind == "ptr" else _I64[0] <= arg <= _I64[1]
                                     if kind == "i64" else True):
                fast.append(float(arg) if kind == "f32" else arg)
            elif type(arg) is float and kind == "f32":
                fast.append(arg)
            else:
                break
        else:
            return fast
    if not isinstance(args, (list, tuple)) or len(args) != len(params):
        count = len(args) if isinstance(args, (list, tuple)) else "no list of"
        raise InvalidValueError(f"{name} takes {len(params)} arguments ({', '.join(params)}), got {count}")
    checked: list[int | float] = []
    for index, (kind, arg) in enumerate(zip(params, args)):
        if isinstance(arg, bool):
            ok = False
        elif kind == "ptr":
            ok = isinstance(arg, int) and 0 <= arg <= _U64_MAX
            arg = int(arg) if ok else arg
        elif kind == "i64":
            ok = isinstance(arg, int) and _I64[0] <= arg <= _I64[1]
            arg = int(arg) if ok else arg
        else:  # f32
            ok = isinstance(arg, (int, float))
            arg = float(arg) if ok else arg
        if not ok:
            raise InvalidValueError(f"{name} argument {index} must be {kind}, got {brief(arg, 40)}")
        checked.append(arg)
    return checked
