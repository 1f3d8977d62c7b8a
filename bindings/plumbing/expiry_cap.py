"""``ExpiryRefusalCap``: at most a share of the requests refused because their budget arrived spent.

A request whose budget header says it is already out of time is refused at
once (504 ``expired-on-arrival``): right when a caller really gave up, wrong
when the budget is what is broken (a proxy that sends 0, a clock-skewed
``X-Request-Start``, a caller's bug). Then every request is refused and the
service is down for a header. Finagle's ``DeadlineFilter`` guards against
that with ``maxRejectFraction``; this is prazo's: over the last ``window_s``
seconds, at most ``fraction`` of the arrivals may be refused for a budget
spent on arrival. Past it, such an arrival runs on the server's default
budget instead, and is counted (``expiry_refusals_capped``), so the
operator sees the bad budgets while the service keeps serving.

Only a budget that came from the request's headers is overruled; a deadline
the process already holds (an outer layer's) is real and stands.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from prazo.core import NS_PER_SECOND

from ..retries.window import SlidingSums

__all__ = ["DEFAULT_CAP_WINDOW_S", "ExpiryRefusalCap", "optional_expiry_cap"]

DEFAULT_CAP_WINDOW_S = 10.0
_ARRIVALS, _REFUSED = 0, 1


class ExpiryRefusalCap:
    """At most ``fraction`` (0 < fraction < 1) of the last ``window_s`` seconds' arrivals refused as spent on arrival."""

    def __init__(
        self,
        fraction: float,
        *,
        window_s: float = DEFAULT_CAP_WINDOW_S,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError(f"max_expiry_refusal_fraction must be a number, not {type(fraction).__name__}")
        if not (math.isfinite(fraction) and 0 < fraction < 1):
            raise ValueError(f"max_expiry_refusal_fraction must be > 0 and < 1, got {fraction!r}")
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)):
            raise TypeError(f"window_s must be a number of seconds, not {type(window_s).__name__}")
        if not (math.isfinite(window_s) and 0 < window_s <= 86_400):
            raise ValueError(f"window_s must be > 0 and at most a day, got {window_s!r}")
        if not callable(clock):
            raise TypeError(f"clock must be callable, not {type(clock).__name__}")
        self.fraction = float(fraction)
        self.window_s = float(window_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._sums = SlidingSums(2, round(self.window_s * NS_PER_SECOND), clock())

    def should_refuse(self, spent: bool) -> bool:
        """Count an arrival; True when its budget is ``spent`` and refusing it keeps the share within the cap."""
        now = self._clock()
        with self._lock:
            self._sums.add(now, _ARRIVALS, 1)
            if not spent:
                return False
            sums = self._sums.current(now)
            if sums[_REFUSED] + 1 > self.fraction * sums[_ARRIVALS]:
                return False
            self._sums.add(now, _REFUSED, 1)
            return True

    def stats(self) -> dict[str, int]:
        """The window's arrivals and refusals for a spent budget."""
        with self._lock:
            arrivals, refused = self._sums.current(self._clock())
        return {"arrivals": arrivals, "refused": refused}


def optional_expiry_cap(fraction: object) -> ExpiryRefusalCap | None:
    """``max_expiry_refusal_fraction=`` of a binding: None (no cap) or the cap, checked."""
    return None if fraction is None else ExpiryRefusalCap(fraction)  # type: ignore[arg-type]
