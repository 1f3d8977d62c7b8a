"""When to send a second copy of an idempotent call, and how many may be sent.

``HedgePolicy`` turns the ``hedge`` argument into a delay: a fixed number of
milliseconds, or a live quantile (``"p95"``: after the time 95 % of recent
calls took, a call is late enough that a second copy on another instance is
likely to answer first). A quantile delay needs ``HEDGE_MIN_SAMPLES`` calls in
the live window; before that no hedge is sent — a p95 of three samples would
hedge at random — and is never under 1 ms.

``HedgeBudget`` caps the extra load: a token bucket in which every call
admitted to run adds ``ratio`` of a token and a hedge spends one whole token;
the bucket starts empty and holds at most ``burst`` tokens. So over any run of
calls ``hedges <= ratio × calls`` (plus nothing: the bucket starts empty), and
after a quiet period at most ``burst`` hedges go out back to back. Integer
arithmetic (millionths of a token), so no rounding drift over millions of calls.
"""

from __future__ import annotations

import threading
from numbers import Real

from prazo.core import NS_PER_MS

from .timeouts import QUANTILES, LiveQuantiles, check_quantile_name, positive_ms

__all__ = ["HEDGE_BURST", "HEDGE_MIN_DELAY_NS", "HEDGE_MIN_SAMPLES", "HedgeBudget", "HedgePolicy", "check_ratio"]

# Tokens the bucket can save up: the longest burst of back-to-back hedges.
HEDGE_BURST = 10
# Calls the live window must hold before a quantile names a hedge delay.
HEDGE_MIN_SAMPLES = 20
# The shortest delay a quantile may name: below a millisecond the hand-over to
# a dependency thread is a large part of the latency, and a hedge would only
# double the load of a dependency that is fast anyway.
HEDGE_MIN_DELAY_NS = NS_PER_MS
_MICRO = 1_000_000


def check_ratio(value: object, name: str) -> float:
    """A real number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}")
    as_float = float(value)
    if not 0.0 <= as_float <= 1.0:  # NaN fails this too
        raise ValueError(f"{name} must be between 0 and 1, got {as_float!r}")
    return as_float


class HedgeBudget:
    """A token bucket: ``credit()`` per call adds ``ratio`` of a token, ``take()`` spends one."""

    __slots__ = ("_burst", "_lock", "_per_call", "_tokens")

    def __init__(self, ratio: float, *, burst: int = HEDGE_BURST) -> None:
        self._per_call = round(check_ratio(ratio, "max_hedge_ratio") * _MICRO)
        self._burst = burst * _MICRO
        self._tokens = 0
        self._lock = threading.Lock()

    def credit(self) -> None:
        with self._lock:
            self._tokens = min(self._tokens + self._per_call, self._burst)

    def take(self) -> bool:
        """Spend one token for a hedge; False (and nothing spent) when less than one is saved."""
        with self._lock:
            if self._tokens < _MICRO:
                return False
            self._tokens -= _MICRO
            return True

    def refund(self) -> None:
        """Give back a token taken for a hedge that could not start."""
        with self._lock:
            self._tokens = min(self._tokens + _MICRO, self._burst)

    @property
    def tokens(self) -> float:
        return self._tokens / _MICRO


class HedgePolicy:
    """The ``hedge`` argument: None, a quantile name (``"p95"``) or a fixed delay in ms."""

    __slots__ = ("_fixed_ns", "_q", "spec")

    def __init__(self, hedge: object) -> None:
        self.spec = hedge
        self._fixed_ns: int | None = None
        self._q: float | None = None
        if hedge is None:
            return
        if isinstance(hedge, str):
            self._q = check_quantile_name(hedge, "hedge")
        elif isinstance(hedge, Real) and not isinstance(hedge, bool):
            self._fixed_ns = max(1, round(positive_ms(hedge, "hedge") * NS_PER_MS))
        else:
            raise TypeError(
                f"hedge must be None, a quantile name ({', '.join(QUANTILES)}) or a number of ms, "
                f"not {type(hedge).__name__}"
            )

    @property
    def enabled(self) -> bool:
        return self._fixed_ns is not None or self._q is not None

    def delay_ns(self, quantiles: LiveQuantiles, now_ns: int) -> int | None:
        """How long to wait for the first attempt before hedging; None: do not hedge (yet)."""
        if self._fixed_ns is not None:
            return self._fixed_ns
        if self._q is None:
            return None
        value_ns, samples = quantiles.get(self._q, now_ns)
        if value_ns is None or samples < HEDGE_MIN_SAMPLES:
            return None
        return max(HEDGE_MIN_DELAY_NS, value_ns)

    def __repr__(self) -> str:
        return f"HedgePolicy({self.spec!r})"
