"""A circuit breaker that opens on slowness as well as on errors.

A slow dependency produces no errors until the timeouts fire, and by then the
pools are gone (docs/design.md, failure mode 2). So the breaker counts two things
separately over a sliding window of the last ``window`` calls: calls that
failed (raised or timed out) and calls that were slow (took at least
``slow_call_ms``, whether they succeeded or not — a slow failure counts in
both). Once the window holds at least ``min_calls`` calls, either rate
reaching its threshold opens the breaker.

States and transitions::

    closed --(failure rate >= failure_rate or slow rate >= slow_rate)--> open
    open --(open_for_s elapsed, seen at the next try_acquire/state/stats)--> half-open
    half-open --(the half_open_calls probes reported, both rates below)--> closed
    half-open --(the probes' result can no longer be below a threshold)--> open

* **closed**: every ``try_acquire`` succeeds; every result goes into the window.
* **open**: every ``try_acquire`` is refused (counted in ``rejected``);
  results reported meanwhile (calls admitted before it opened) are ignored.
* **half-open**: exactly ``half_open_calls`` probe permits are handed out.
  Each result consumes one outstanding probe. The rates are taken over
  ``half_open_calls``, so the breaker re-opens as soon as the probes reported
  so far already reach a threshold whatever the others say (with the defaults
  — 3 probes, rates 0.5 — at the second failed or slow probe), and closes with
  a fresh window when the last probe reports and neither threshold was
  reached. A result reported while no probe is outstanding is ignored;
  ``release()`` hands an unused probe permit back to the pool.

Without a permit token a result cannot say when its permit was taken: in
half-open it is counted for an outstanding probe, even when it comes from a
call admitted before the breaker opened (one reporting more than
``open_for_s`` after its permit). Such a straggler counts as slow whenever
``slow_call_ms`` <= ``open_for_s``, so the mistake errs towards re-opening, and it can make the probes the breaker counts
outstanding — never more than ``half_open_calls`` — fewer than the calls
really running. A dependency timeout below ``open_for_s`` keeps it rare.

``window`` counts calls; ``window_s`` (optional) also bounds their age: a
result older than ``window_s`` leaves the window, evicted lazily when the
next result is recorded or ``stats()`` is read, so a quiet breaker forgets an
old burst of failures instead of opening on the first new one.

The clock is ``time.monotonic_ns()`` (the clock of ``prazo.core.Deadline``),
or ``clock``; every operation also takes ``now_ns`` to decide at a given
instant, which is how the tests drive it. Durations are reported by the
caller, measured from the moment ``try_acquire`` said yes.

Thread safety: one lock, held for O(1) work (amortized: an expired result is
evicted once), never while calling the clock or anything else outside this
module.

Example::

    breaker = Breaker(slow_call_ms=250, open_for_s=5.0)
    if not breaker.try_acquire():
        return fallback()                     # open: no call at all
    start = time.monotonic_ns()
    try:
        value = call_dependency()
    except Exception:
        breaker.on_failure(time.monotonic_ns() - start)
        raise
    breaker.on_success(time.monotonic_ns() - start)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prazo.core.deadline import NS_PER_MS, clock_ns

from ._arguments import (
    check_clock,
    check_count,
    check_duration_ns,
    check_elapsed_ns,
    check_rate,
    check_seconds_ns,
)

__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "Breaker"]

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"

_FAILED = 1
_SLOW = 2


class Breaker:
    """A count-based (optionally also time-bounded) sliding-window circuit breaker.

    Keyword Args:
        window: how many of the most recent calls the closed state judges by.
        min_calls: no verdict before the window holds this many calls (≤ ``window``).
        failure_rate: open when failed calls / calls in the window reach it, in (0, 1].
        slow_rate: open when slow calls / calls in the window reach it, in (0, 1].
        slow_call_ms: a call taking at least this long is slow. The default,
            1000 ms, only catches a dependency that has become very slow; set
            it a little above the dependency's normal p99 and below its timeout
            (the seed's example: p99 80 ms, timeout 500 ms → e.g. 250 ms).
        open_for_s: how long the breaker stays open before probing (≥ 0).
        half_open_calls: how many probe calls half-open lets through and waits for.
        window_s: if given, results older than this leave the window too.
        clock: a callable returning monotonic nanoseconds; default ``time.monotonic_ns``.

    Bad arguments raise ``TypeError`` (wrong type) or ``ValueError`` (NaN,
    infinity, out of range), naming the argument.
    """

    def __init__(
        self,
        *,
        window: int = 100,
        min_calls: int = 20,
        failure_rate: float = 0.5,
        slow_rate: float = 0.5,
        slow_call_ms: float = 1000.0,
        open_for_s: float = 5.0,
        half_open_calls: int = 3,
        window_s: float | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self._window = check_count(window, "window")
        self._min_calls = check_count(min_calls, "min_calls")
        if self._min_calls > self._window:
            raise ValueError(f"min_calls must be <= window ({self._window}), got {self._min_calls}")
        self._failure_rate = check_rate(failure_rate, "failure_rate")
        self._slow_rate = check_rate(slow_rate, "slow_rate")
        self._slow_call_ns = int(check_duration_ns(slow_call_ms, "slow_call_ms", NS_PER_MS, allow_zero=False))
        self._open_for_ns = check_seconds_ns(open_for_s, "open_for_s", allow_zero=True)
        self._half_open_calls = check_count(half_open_calls, "half_open_calls")
        self._window_ns = None if window_s is None else check_seconds_ns(window_s, "window_s", allow_zero=False)
        self._clock = check_clock(clock) or time.monotonic_ns

        self._lock = threading.Lock()
        self._state = CLOSED
        # The closed window: (recorded at ns, _FAILED|_SLOW flags), oldest first.
        self._outcomes: deque[tuple[int, int]] = deque()
        self._failed = 0
        self._slow = 0
        self._opened_at = 0
        # Half-open: permits handed out (reported + outstanding), outstanding, and the reported probes' tally.
        self._probes_issued = 0
        self._probes_out = 0
        self._probes_reported = 0
        self._probes_failed = 0
        self._probes_slow = 0
        # Totals since construction (reset() keeps them: they are counters for metrics).
        self._opened_total = 0
        self._rejected_total = 0
        self._permitted_total = 0
        self._successes_total = 0
        self._failures_total = 0
        self._slow_total = 0
        self._ignored_total = 0
        self._released_total = 0

    @property
    def slow_call_ms(self) -> float:
        return self._slow_call_ns / NS_PER_MS

    def _now(self, now_ns: int | None) -> int:
        return self._clock() if now_ns is None else clock_ns(now_ns)

    def try_acquire(self, now_ns: int | None = None) -> bool:
        """Ask to make a call: True claims a permit (a probe when half-open), False means don't call.

        Every True must be followed by exactly one of ``on_success``,
        ``on_failure`` or ``release``.
        """
        now = self._now(now_ns)
        with self._lock:
            if self._state is CLOSED:
                self._permitted_total += 1
                return True
            if self._state is OPEN:
                if now - self._opened_at < self._open_for_ns:
                    self._rejected_total += 1
                    return False
                self._half_open()
            if self._probes_issued < self._half_open_calls:
                self._probes_issued += 1
                self._probes_out += 1
                self._permitted_total += 1
                return True
            self._rejected_total += 1
            return False

    def on_success(self, duration_ns: int, now_ns: int | None = None) -> None:
        """The call returned after ``duration_ns``; it is slow if that is at least ``slow_call_ms``."""
        self._record(check_elapsed_ns(duration_ns, "duration_ns"), False, now_ns)

    def on_failure(self, duration_ns: int, now_ns: int | None = None) -> None:
        """The call raised or timed out after ``duration_ns`` (slow too if that is at least ``slow_call_ms``)."""
        self._record(check_elapsed_ns(duration_ns, "duration_ns"), True, now_ns)

    def release(self, now_ns: int | None = None) -> None:
        """A permit was claimed but the call never ran: hand it back, record nothing.

        In half-open the probe permit returns to the pool; in the other states
        there is nothing to return. ``now_ns`` is accepted for symmetry and only checked.
        """
        if now_ns is not None:
            clock_ns(now_ns)
        with self._lock:
            self._released_total += 1
            if self._state is HALF_OPEN and self._probes_out:
                self._probes_out -= 1
                self._probes_issued -= 1

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half-open"`` — open turns half-open here once ``open_for_s`` has passed."""
        return self.current_state()

    def current_state(self, now_ns: int | None = None) -> str:
        """``state`` as seen at ``now_ns`` (default: the clock)."""
        now = self._now(now_ns)
        with self._lock:
            self._expire_open(now)
            return self._state

    def stats(self, now_ns: int | None = None) -> dict[str, Any]:
        """A snapshot: the state, the window's rates, the probes, and totals since construction.

        ``calls``, ``failed_calls``, ``slow_calls``, ``failure_rate`` and
        ``slow_rate`` describe the closed window — while open or half-open,
        the window that opened the breaker. ``opened`` counts the times it
        opened, ``rejected`` the refused ``try_acquire`` calls, ``ignored`` the
        results that arrived when no permit of the current state could be
        theirs (open, or half-open with no probe outstanding).
        """
        now = self._now(now_ns)
        with self._lock:
            self._expire_open(now)
            if self._state is CLOSED:
                self._evict_old(now)
            calls = len(self._outcomes)
            return {
                "state": self._state,
                "calls": calls,
                "failed_calls": self._failed,
                "slow_calls": self._slow,
                "failure_rate": self._failed / calls if calls else 0.0,
                "slow_rate": self._slow / calls if calls else 0.0,
                "probes_in_flight": self._probes_out,
                "probes_reported": self._probes_reported,
                "opened": self._opened_total,
                "rejected": self._rejected_total,
                "permitted": self._permitted_total,
                "successes": self._successes_total,
                "failures": self._failures_total,
                "slow": self._slow_total,
                "ignored": self._ignored_total,
                "released": self._released_total,
            }

    def reset(self) -> None:
        """Back to closed with an empty window; the totals in ``stats()`` are kept."""
        with self._lock:
            self._close()

    def __repr__(self) -> str:
        return (
            f"<Breaker {self._state} window={self._window} min_calls={self._min_calls} "
            f"failure_rate={self._failure_rate} slow_rate={self._slow_rate} slow_call_ms={self.slow_call_ms}>"
        )

    # -- under the lock --------------------------------------------------

    def _record(self, duration_ns: int, failed: bool, now_ns: int | None) -> None:
        now = self._now(now_ns)
        slow = duration_ns >= self._slow_call_ns
        with self._lock:
            if failed:
                self._failures_total += 1
            else:
                self._successes_total += 1
            if slow:
                self._slow_total += 1
            if self._state is CLOSED:
                self._add_to_window(now, failed, slow)
                calls = len(self._outcomes)
                if calls >= self._min_calls and (
                    self._failed / calls >= self._failure_rate or self._slow / calls >= self._slow_rate
                ):
                    self._open(now)
            elif self._state is HALF_OPEN and self._probes_out:
                self._probes_out -= 1
                self._probes_reported += 1
                self._probes_failed += failed
                self._probes_slow += slow
                probes = self._half_open_calls
                if self._probes_failed / probes >= self._failure_rate or self._probes_slow / probes >= self._slow_rate:
                    self._open(now)
                elif self._probes_reported == probes:
                    self._close()
            else:
                self._ignored_total += 1

    def _add_to_window(self, now: int, failed: bool, slow: bool) -> None:
        flags = (_FAILED if failed else 0) | (_SLOW if slow else 0)
        self._outcomes.append((now, flags))
        self._failed += failed
        self._slow += slow
        if len(self._outcomes) > self._window:
            self._drop_oldest()
        self._evict_old(now)

    def _evict_old(self, now: int) -> None:
        if self._window_ns is None:
            return
        outcomes = self._outcomes
        horizon = now - self._window_ns
        while outcomes and outcomes[0][0] <= horizon:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, flags = self._outcomes.popleft()
        self._failed -= flags & _FAILED
        self._slow -= (flags & _SLOW) >> 1

    def _expire_open(self, now: int) -> None:
        if self._state is OPEN and now - self._opened_at >= self._open_for_ns:
            self._half_open()

    def _open(self, now: int) -> None:
        self._state = OPEN
        self._opened_at = now
        self._opened_total += 1
        self._clear_probes()

    def _half_open(self) -> None:
        self._state = HALF_OPEN
        self._clear_probes()

    def _close(self) -> None:
        self._state = CLOSED
        self._outcomes.clear()
        self._failed = 0
        self._slow = 0
        self._clear_probes()

    def _clear_probes(self) -> None:
        self._probes_issued = 0
        self._probes_out = 0
        self._probes_reported = 0
        self._probes_failed = 0
        self._probes_slow = 0
