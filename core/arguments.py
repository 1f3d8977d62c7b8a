"""The argument rules every layer shares: a count, milliseconds, and a yes/no environment variable.

Standard library only: ``setup.py`` loads this file by its path to read
``PRAZO_NO_EXTENSIONS`` the way ``prazo.core`` reads it, before anything is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real

__all__ = [
    "FALSE_WORDS",
    "INT32_LIMIT",
    "MAX_MS",
    "TRUE_WORDS",
    "checked_count",
    "checked_ms",
    "env_flag",
    "parse_flag",
]

# Sizes the C twins keep in a C int.
INT32_LIMIT = 2**31
# Every duration ends up as int64 nanoseconds (a deadline, a budget on the wire, a C field):
# the most milliseconds that fit.
MAX_MS = (2**63 - 1) // 1_000_000

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def checked_count(
    value: object, name: str, minimum: int, *, below: int | None = None, too_small: str | None = None
) -> int:
    """``value`` if it is an int (never a bool) of at least ``minimum`` (and under ``below``).

    TypeError or ValueError naming ``name``; ``too_small`` replaces the message
    of a value under ``minimum`` where an API mirrors another one's words
    (``AdmissionPool``'s ``max_workers`` says what ``ThreadPoolExecutor`` says).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(too_small or f"{name} must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        limit = "2**31" if below == INT32_LIMIT else str(below)
        raise ValueError(f"{name} must be < {limit}, got {value}")
    return int(value)


def checked_ms(value: object, name: str, *, positive: bool = False, allow_negative: bool = False) -> float:
    """Check an argument that holds milliseconds; return it as a float.

    It must be a finite real number (not a bool), ``>= 0`` — or ``> 0`` with
    ``positive``, or any sign with ``allow_negative`` — and no more than
    ``MAX_MS``. Raises ``TypeError``/``ValueError`` naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number of milliseconds, not {type(value).__name__}")
    ms = float(value)
    if math.isnan(ms):
        raise ValueError(f"{name} must not be NaN")
    if math.isinf(ms):
        raise ValueError(f"{name} must be finite, got {ms}")
    if positive and ms <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not allow_negative and ms < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    if abs(ms) > MAX_MS:
        raise ValueError(f"{name} must be at most {MAX_MS} ms, got {value!r}")
    return ms


def parse_flag(raw: str, name: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``, in any case and with spaces around; ValueError naming ``name``."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name} must be 1/0, true/false, yes/no or on/off, got {raw!r}")


def env_flag(environ: Mapping[str, str], name: str) -> bool | None:
    """The yes/no variable ``name`` of ``environ``: None when it is unset or blank, else ``parse_flag``."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    return parse_flag(raw, name)
