# A class of one's own, named ``module:Class`` where mpsd takes a name (a block-level policy of the simulator, a
# kernel-level one of the dispatcher): one rule, and one set of errors, for every layer that takes one. It
# imports nothing of mpsd, so that the simulator and the runtime can both use it.
"""Loading classes of one's own by ``module:Class``."""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

T = TypeVar("T")


def load(name: str, base: type[T], options: dict[str, Any] | None = None) -> T:
    """An instance of the class named ``module:Class``, a subclass of `base`, built with `options` as keyword
    arguments.

    Raises:
        ValueError: the module or class cannot be found, is not a subclass of `base`, or refuses the options.
    """
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:  # ValueError: an empty module name
        raise ValueError(f"cannot load {name}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{name} is not a {base.__name__} ({base.__module__})")
    try:
        return cls(**(options or {}))
    except TypeError as exc:  # an option its constructor does not take
        raise ValueError(f"{name}: {exc}") from None
