"""Argument checks shared by the dependency kit: each error names the argument it refuses."""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real

from prazo.core.arguments import checked_count
from prazo.core.deadline import NS_PER_SECOND


def check_count(value: object, name: str, minimum: int = 1) -> int:
    """An int (never a bool) of at least ``minimum``."""
    return checked_count(value, name, minimum)


def check_real(value: object, name: str) -> float:
    """A real number (never a bool) that is not NaN, as a float."""
    # int and float first: the Real ABC check costs more than the rest of a LastKnownGood.get.
    if type(value) is not float and type(value) is not int and (isinstance(value, bool) or not isinstance(value, Real)):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}")
    as_float = float(value)
    if math.isnan(as_float):
        raise ValueError(f"{name} must not be NaN")
    return as_float


def check_rate(value: object, name: str) -> float:
    """A rate in (0, 1]: 0 would trip on any window, above 1 never."""
    rate = check_real(value, name)
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {rate}")
    return rate


def check_duration_ns(value: object, name: str, unit_ns: int, *, allow_zero: bool, allow_inf: bool = False) -> float:
    """A duration in some unit, checked and converted to nanoseconds (inf only when ``allow_inf``)."""
    as_float = check_real(value, name)
    if math.isinf(as_float) and not (allow_inf and as_float > 0):
        raise ValueError(f"{name} must be finite, got {as_float}")
    if as_float < 0 or (as_float == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {as_float}")
    if math.isinf(as_float):
        return as_float
    scaled = as_float * unit_ns
    if scaled >= 2.0**63:
        raise ValueError(f"{name} is out of range for a 64-bit count of nanoseconds")
    return float(round(scaled))


def check_seconds_ns(value: object, name: str, *, allow_zero: bool) -> int:
    """A finite number of seconds as integer nanoseconds."""
    return int(check_duration_ns(value, name, NS_PER_SECOND, allow_zero=allow_zero))


def check_clock(clock: object) -> Callable[[], int] | None:
    """None (the monotonic clock) or a callable returning monotonic nanoseconds."""
    if clock is not None and not callable(clock):
        raise TypeError(f"clock must be a callable returning monotonic nanoseconds, not {type(clock).__name__}")
    return clock


def check_elapsed_ns(value: object, name: str) -> int:
    """A measured duration in integer nanoseconds, never negative."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int of nanoseconds, not {type(value).__name__}")
        value = int(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
