"""``Retry-After``: how long a server asked its caller to wait, as seconds from now.

RFC 9110 §10.2.3 allows two forms: a whole number of seconds (``120``) or
an HTTP-date (``Fri, 31 Dec 1999 23:59:59 GMT``). The date form is read
against the wall clock, the only clock the server and the caller share;
a date in the past means "now". Anything else is ignored (None), as a
client must do with a field it cannot parse.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable

__all__ = ["MAX_RETRY_AFTER_S", "retry_after_ms_seconds", "retry_after_seconds"]

# Beyond a day a Retry-After is a maintenance notice, not a retry hint.
MAX_RETRY_AFTER_S = 86_400.0


def retry_after_seconds(value: object, *, wall_clock: Callable[[], float] = time.time) -> float | None:
    """The wait a ``Retry-After`` value asks for, in seconds (≥ 0), or None when it says nothing usable."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text:
        return None
    if text.isdigit():
        return min(float(int(text)), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000" or no zone: HTTP-dates are GMT
        return None
    return min(max(0.0, when.timestamp() - wall_clock()), MAX_RETRY_AFTER_S)


def retry_after_ms_seconds(value: object) -> float | None:
    """The wait a prazo server's ``X-Prazo-Retry-After-Ms`` (or gRPC's pushback) asks for, in seconds, or None.

    Only a whole number of ms counts: the same value as the ``Retry-After``
    beside it, finer than its whole seconds.
    """
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text.isdigit() or not text.isascii():
        return None
    return min(int(text) / 1000.0, MAX_RETRY_AFTER_S)
