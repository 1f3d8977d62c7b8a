"""How long a caller waits for a dependency: a fixed timeout or ``AdaptiveTimeout``.

The seed's rule: a timeout must be tight *relative to the normal latency*
(p99 80 ms → a 500 ms timeout is a defence, 30 s is a formality). A fixed
``timeout_ms`` needs someone to know the p99; ``AdaptiveTimeout`` follows it:
``multiplier`` × the live quantile of the dependency's latency histogram,
clamped to ``[floor_ms, ceiling_ms]``, and ``ceiling_ms`` until the window
holds ``min_samples`` calls. The ceiling is the real defence: when the
dependency slows down its p99 grows and the timeout follows it up to the
ceiling, never past it.

Quantile names (``"p50"`` … ``"p999"``) are shared with hedging; a live
quantile is read through ``LiveQuantiles``, which merges the window at most
every 100 ms, because merging a window's histograms costs far more than a
call's bookkeeping should.
"""

from __future__ import annotations

import math
import threading
from numbers import Real

from prazo.core import NS_PER_MS, LatencyHistogram, WindowedHistogram

__all__ = ["MAX_MS", "QUANTILES", "AdaptiveTimeout", "LiveQuantiles", "check_quantile_name", "positive_ms"]

# The quantile names a Dependency understands, and the fraction each means.
QUANTILES: dict[str, float] = {"p50": 0.5, "p75": 0.75, "p90": 0.9, "p95": 0.95, "p99": 0.99, "p999": 0.999}


def check_quantile_name(value: object, name: str) -> float:
    """The fraction a quantile name (``"p95"``) stands for; ValueError/TypeError naming ``name`` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a quantile name such as 'p95', not {type(value).__name__}")
    if value not in QUANTILES:
        raise ValueError(f"{name} must be one of {', '.join(QUANTILES)}, got {value!r}")
    return QUANTILES[value]


# The longest duration any of these arguments may name: one day. Anything
# longer is a mistake, not a timeout, and would overflow the waits.
MAX_MS = 86_400_000.0


def positive_ms(value: object, name: str) -> float:
    """A real number of milliseconds, > 0 and at most ``MAX_MS`` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number of milliseconds, not {type(value).__name__}")
    as_float = float(value)
    if not 0.0 < as_float <= MAX_MS:  # NaN and infinities fail this too
        raise ValueError(f"{name} must be > 0 and at most {MAX_MS:.0f} ms (a day), got {as_float!r}")
    return as_float


def _check_multiplier(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"multiplier must be a real number, not {type(value).__name__}")
    as_float = float(value)
    if not 1.0 <= as_float < math.inf:  # NaN fails this too
        raise ValueError(f"multiplier must be >= 1 and finite, got {as_float!r}")
    return as_float


class LiveQuantiles:
    """Quantiles of a ``WindowedHistogram``'s live window, from a snapshot taken at most every ``refresh_ns``.

    ``get(q, now_ns)`` returns ``(value_ns or None, samples in the window)``.
    Times are on the clock the histogram is recorded with. One thread
    refreshes an outdated snapshot while the others keep reading the previous
    one, so a burst of calls never merges the window more than once.
    """

    __slots__ = ("_at", "_count", "_histogram", "_lock", "_refresh_ns", "_refreshing", "_snapshot", "_values")

    def __init__(self, histogram: WindowedHistogram, *, refresh_ns: int = 100 * NS_PER_MS) -> None:
        self._histogram = histogram
        self._refresh_ns = refresh_ns
        self._lock = threading.Lock()
        self._snapshot: LatencyHistogram | None = None
        self._at = 0
        self._count = 0
        self._values: dict[float, int | None] = {}
        self._refreshing = False

    def get(self, q: float, now_ns: int) -> tuple[int | None, int]:
        with self._lock:
            outdated = self._snapshot is None or not 0 <= now_ns - self._at < self._refresh_ns
            refresh = outdated and (self._snapshot is None or not self._refreshing)
            if refresh:
                self._refreshing = True
        if refresh:
            snapshot = None
            try:
                snapshot = self._histogram.snapshot(now_ns)
            finally:
                with self._lock:
                    self._refreshing = False
                    if snapshot is not None:
                        self._snapshot, self._at, self._count, self._values = snapshot, now_ns, snapshot.count, {}
        with self._lock:
            snapshot, count = self._snapshot, self._count
            if q in self._values:
                return self._values[q], count
        value = None if snapshot is None else snapshot.quantile(q)
        with self._lock:
            if snapshot is self._snapshot:
                self._values[q] = value
        return value, count


class AdaptiveTimeout:
    """A timeout of ``multiplier`` × the live ``quantile``, clamped to ``[floor_ms, ceiling_ms]``.

    >>> from prazo.bindings.dependency import Dependency, AdaptiveTimeout
    >>> dep = Dependency("recs", max_concurrent=20,
    ...                  timeout_ms=AdaptiveTimeout(multiplier=3.0, quantile="p99", floor_ms=50, ceiling_ms=500))

    Until the live window holds ``min_samples`` calls the timeout is
    ``ceiling_ms``: with too few samples a p99 means nothing. Every attempt
    that completes (ok or error) is a sample; a call still hanging is not,
    until it returns — the ceiling bounds what such a dependency can cost.
    """

    __slots__ = ("_ceiling_ms", "_floor_ms", "_min_samples", "_multiplier", "_q", "_quantile")

    def __init__(
        self,
        multiplier: float = 3.0,
        quantile: str = "p99",
        *,
        floor_ms: float = 10.0,
        ceiling_ms: float = 1000.0,
        min_samples: int = 50,
    ) -> None:
        self._multiplier = _check_multiplier(multiplier)
        self._q = check_quantile_name(quantile, "quantile")
        self._quantile = quantile
        self._floor_ms = positive_ms(floor_ms, "floor_ms")
        self._ceiling_ms = positive_ms(ceiling_ms, "ceiling_ms")
        if self._floor_ms > self._ceiling_ms:
            raise ValueError(f"floor_ms ({self._floor_ms:g}) must be <= ceiling_ms ({self._ceiling_ms:g})")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int):
            raise TypeError(f"min_samples must be an int, not {type(min_samples).__name__}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self._min_samples = min_samples

    @property
    def multiplier(self) -> float:
        return self._multiplier

    @property
    def quantile(self) -> str:
        return self._quantile

    @property
    def floor_ms(self) -> float:
        return self._floor_ms

    @property
    def ceiling_ms(self) -> float:
        return self._ceiling_ms

    @property
    def min_samples(self) -> int:
        return self._min_samples

    def timeout_ms(self, quantiles: LiveQuantiles, now_ns: int) -> float:
        """The timeout now, in milliseconds, from the live window ``quantiles`` reads."""
        value_ns, samples = quantiles.get(self._q, now_ns)
        if value_ns is None or samples < self._min_samples:
            return self._ceiling_ms
        return min(max(self._multiplier * value_ns / NS_PER_MS, self._floor_ms), self._ceiling_ms)

    def __repr__(self) -> str:
        return (
            f"AdaptiveTimeout(multiplier={self._multiplier:g}, quantile={self._quantile!r}, "
            f"floor_ms={self._floor_ms:g}, ceiling_ms={self._ceiling_ms:g}, min_samples={self._min_samples})"
        )
