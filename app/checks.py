"""Checks of the numbers and flags read from files a user gives (a model's config.json, an
inference-perf config, a trace): each returns the value, typed, or raises the caller's error
class with one line naming the field, what it must be and what it got.

A number is an ``int`` or a ``float`` (never a ``bool``, never a string) and finite; an integer
is an ``int`` (``5.7`` and ``"4096"`` are refused, not rounded or parsed).
"""

from __future__ import annotations

import math
import operator
from typing import Any


def _show(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _check_range(
    value: float,
    name: str,
    kind: str,
    error: type[ValueError],
    minimum: float | None,
    above: float | None,
    maximum: float | None,
) -> None:
    """Raise ``error`` naming ``kind`` and every bound given unless ``value`` is within them."""
    rules = ((">", above, operator.gt), (">=", minimum, operator.ge), ("<=", maximum, operator.le))
    bounds = [(sign, bound, holds) for sign, bound, holds in rules if bound is not None]
    if not all(holds(value, bound) for _, bound, holds in bounds):
        wanted = " and ".join(f"{sign} {_show(bound)}" for sign, bound, _ in bounds)
        raise error(f"{name} must be {kind} {wanted}, got {value!r}")


def number(
    value: Any,
    name: str,
    error: type[ValueError] = ValueError,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
) -> float:
    """``value`` as a finite float within ``[minimum, maximum]`` (and ``> above``)."""
    kind = "a finite number"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise error(f"{name} must be {kind}, got {value!r}")
    _check_range(value, name, kind, error, minimum, above, maximum)
    return float(value)


def positive(
    value: Any, name: str, error: type[ValueError] = ValueError, maximum: float | None = None
) -> float:
    """``value`` as a finite float ``> 0`` (and ``<= maximum``)."""
    return number(value, name, error, above=0, maximum=maximum)


def integer(
    value: Any,
    name: str,
    error: type[ValueError] = ValueError,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    """``value`` as an int within ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an integer, got {value!r}")
    _check_range(value, name, "an integer", error, minimum, None, maximum)
    return value


def flag(value: Any, name: str, error: type[ValueError] = ValueError) -> bool:
    """``value`` as a bool: JSON ``true``/``false`` only (the string ``"false"`` is refused)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be true or false, got {value!r}")
    return value
