"""``RetryBudget``: how many retries a destination may receive, shared by every caller of it.

A per-call retry limit ("3 attempts") multiplies the load on a saturated
service by 3 exactly when it can least take it. A budget bounds retries
*across* calls instead, as Finagle's ``RetryBudget``, tower's
``retry::budget`` and gRPC's retry throttling do: retries may add at most
``percent`` to the calls, plus a small floor of ``min_per_s`` retries per
second so that a quiet client can still retry now and then.

The arithmetic, exactly (integer micro-tokens, so no rounding drift):

* time is cut into generations of ``ttl_s / GENERATIONS`` on the budget's
  clock; generation ``g`` is ``now_ns // generation_ns``;
* ``deposit()`` (once per call, before its first attempt) adds
  ``round(percent × 10⁶)`` micro-tokens to the current generation;
* ``try_withdraw()`` (once per retry) succeeds when the balance is at least
  one token (10⁶) and then subtracts one token from the current generation;
* the balance at generation ``g`` is
  ``reserve + Σ`` (deposits − withdrawals) of generations ``g − GENERATIONS + 1 … g``,
  where ``reserve = round(min_per_s × ttl_s × 10⁶)``: a deposit expires
  ``ttl_s`` after it was made (within one generation), and so does a
  withdrawal, which gives its share of the reserve back.

So over any ``ttl_s``, retries ≤ ``percent`` × calls + ``min_per_s`` × ``ttl_s``
(with generation rounding: any window of ``GENERATIONS`` generations). Both
operations are O(1) under one lock: advancing clears at most ``GENERATIONS``
slots, and a running sum holds the window's total.

``RetryBudgets`` keeps one ``RetryBudget`` per destination (a host, a
``Dependency``'s name, any name), created on first use with the same
arguments. A ``RetryPolicy`` takes either: one ``RetryBudget`` shared by
everything it retries, or ``RetryBudgets`` for one budget per destination.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from numbers import Real

from prazo.core import NS_PER_SECOND

from .destinations import PerDestination
from .window import GENERATIONS, SlidingSums

__all__ = [
    "DEFAULT_MIN_PER_S",
    "DEFAULT_PERCENT",
    "DEFAULT_TTL_S",
    "TOKEN",
    "RetryBudget",
    "RetryBudgets",
    "check_clock",
]

# Finagle's defaults: 20 % of the calls on top, 10 retries a second, tokens live 10 s.
DEFAULT_TTL_S = 10.0
DEFAULT_MIN_PER_S = 10.0
DEFAULT_PERCENT = 0.2
# One retry, in micro-tokens.
TOKEN = 1_000_000


def _check_real(value: object, name: str, *, low: float, high: float, low_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}")
    as_float = float(value)
    above_low = as_float > low if low_open else as_float >= low
    if not (above_low and as_float <= high):  # NaN fails this too
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low:g} and <= {high:g}, got {as_float!r}")
    return as_float


def check_clock(clock: object) -> Callable[[], int]:
    """None (``time.monotonic_ns``) or a callable returning monotonic nanoseconds."""
    if clock is None:
        return time.monotonic_ns
    if not callable(clock):
        raise TypeError(f"clock must be a callable returning monotonic nanoseconds, not {type(clock).__name__}")
    return clock


class RetryBudget:
    """A thread-safe token bucket for retries to one destination (see the module docstring for the arithmetic).

    >>> budget = RetryBudget(ttl_s=10, min_per_s=0, percent=0.5)
    >>> budget.deposit(); budget.try_withdraw()
    False
    >>> budget.deposit(); budget.try_withdraw()
    True

    Args:
        ttl_s: how long a deposit (and a withdrawal) counts, in seconds (> 0, ≤ a day).
        min_per_s: retries per second always allowed, whatever the calls (≥ 0).
        percent: retries allowed per call, as a fraction (0 to 1; 0.2 = 20 %).
        clock: a callable returning monotonic nanoseconds (tests pass a fake one).
    """

    __slots__ = (
        "_clock",
        "_deposits",
        "_lock",
        "_min_per_s",
        "_per_call",
        "_percent",
        "_refused",
        "_reserve",
        "_ttl_s",
        "_window",
        "_withdrawn",
    )

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        min_per_s: float = DEFAULT_MIN_PER_S,
        percent: float = DEFAULT_PERCENT,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self._ttl_s = _check_real(ttl_s, "ttl_s", low=0.0, high=86_400.0, low_open=True)
        self._min_per_s = _check_real(min_per_s, "min_per_s", low=0.0, high=1e6, low_open=False)
        self._percent = _check_real(percent, "percent", low=0.0, high=1.0, low_open=False)
        self._clock = check_clock(clock)
        self._per_call = round(self._percent * TOKEN)
        self._reserve = round(self._min_per_s * self._ttl_s * TOKEN)
        # One sum (width 1: generation g's slot is g % GENERATIONS): deposits minus withdrawals,
        # in micro-tokens, over the last ttl_s.
        self._window = SlidingSums(1, round(self._ttl_s * NS_PER_SECOND), self._clock())
        self._lock = threading.Lock()
        self._deposits = 0
        self._withdrawn = 0
        self._refused = 0

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    @property
    def min_per_s(self) -> float:
        return self._min_per_s

    @property
    def percent(self) -> float:
        return self._percent

    def for_destination(self, destination: Hashable) -> RetryBudget:
        """This budget, whatever the destination: one budget shared by everything a policy retries."""
        return self

    def deposit(self) -> None:
        """Count one call: adds ``percent`` of a token, for ``ttl_s``."""
        window = self._window
        generation = self._clock() // window.generation_ns
        with self._lock:
            # The window's add, written out: this runs on every call.
            if generation != window.generation:
                window.move(generation)
            window.slots[generation % GENERATIONS] += self._per_call
            window.sums[0] += self._per_call
            self._deposits += 1

    def try_withdraw(self) -> bool:
        """Take one token for a retry; False (nothing taken) when less than one is left."""
        window = self._window
        generation = self._clock() // window.generation_ns
        with self._lock:
            if generation != window.generation:
                window.move(generation)
            if window.sums[0] + self._reserve < TOKEN:
                self._refused += 1
                return False
            window.slots[generation % GENERATIONS] -= TOKEN
            window.sums[0] -= TOKEN
            self._withdrawn += 1
            return True

    def balance(self) -> float:
        """Retries that could be taken now, in tokens (may be fractional, never below ``-reserve``)."""
        now = self._clock()
        with self._lock:
            return (self._window.current(now)[0] + self._reserve) / TOKEN

    def stats(self) -> dict[str, float]:
        """``deposits``, ``withdrawn`` and ``refused`` since creation, and the ``balance`` now."""
        balance = self.balance()
        with self._lock:
            return {
                "deposits": self._deposits,
                "withdrawn": self._withdrawn,
                "refused": self._refused,
                "balance": balance,
            }

    def __repr__(self) -> str:
        return f"RetryBudget(ttl_s={self._ttl_s:g}, min_per_s={self._min_per_s:g}, percent={self._percent:g})"


class RetryBudgets:
    """One ``RetryBudget`` per destination, each made on first use with these arguments.

    Keeps the 1024 most recently used destinations; a forgotten one starts
    again from its reserve alone, which is what a new destination gets.
    """

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        min_per_s: float = DEFAULT_MIN_PER_S,
        percent: float = DEFAULT_PERCENT,
        clock: Callable[[], int] | None = None,
    ) -> None:
        # Checked once here, so a bad argument fails at construction, not at the first call.
        template = RetryBudget(ttl_s=ttl_s, min_per_s=min_per_s, percent=percent, clock=clock)
        self._arguments = {"ttl_s": template.ttl_s, "min_per_s": template.min_per_s, "percent": template.percent}
        self._budgets = PerDestination(lambda: RetryBudget(clock=clock, **self._arguments))

    def for_destination(self, destination: Hashable) -> RetryBudget:
        """The budget of ``destination``, made now if it has none yet."""
        return self._budgets.get(destination)

    def destinations(self) -> list[Hashable]:
        """The destinations that have a budget now, least recently used first."""
        return [destination for destination, _ in self._budgets.items()]

    def __repr__(self) -> str:
        arguments = ", ".join(f"{name}={value:g}" for name, value in self._arguments.items())
        return f"RetryBudgets({arguments})"
