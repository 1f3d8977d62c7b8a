"""``RetryPolicy``: whether to try a failed call again, and when; and the loop that does it.

A retry is made only when all of these hold, checked in this order (the
first that fails is the ``why`` of the decision, and the caller gets the
last real answer at once):

1. the failure is worth retrying (``failures.RETRYABLE_KINDS``): a 503 that
   did no work, a refused connection, a reset before any response byte;
   never a 504 or a client timeout (``"not-retryable"``);
2. the request may be sent twice: idempotent (GET, HEAD, OPTIONS, PUT,
   DELETE, TRACE, or ``idempotent=True`` from the caller, the rule hedging
   follows) and its body was not streamed (``"not-idempotent"``,
   ``"streamed-body"``);
3. fewer than ``max_attempts`` attempts were made (``"attempts"``);
4. the caller's deadline still covers a wait and an attempt: remaining −
   ``margin_ms`` − the expected attempt (``attempt_ms``: a fixed number of
   ms, or a live quantile of this destination's successful attempts) must
   leave at least 1 ms (``"deadline"``); a ``Retry-After`` (or gRPC
   ``grpc-retry-pushback-ms``) longer than that gives up at once too
   (``"retry-after"``); both count as ``retries_refused_by_deadline``;
5. the destination's ``RetryBudget`` has a token (``"budget"``,
   ``retries_refused_by_budget``) — asked after the rules above, so no token
   is spent on a retry that one of them refuses;
6. with ``throttle``, the destination's ``AdaptiveThrottle`` lets the attempt
   go (``"throttled"``, ``throttled_locally``). It is asked before every
   attempt, the first included (refused: ``Throttled`` is raised and nothing
   is sent), and told after each whether the destination took it; a retry it
   refuses has spent its budget token (both say the destination is refusing).

The wait is the ``Retry-After`` when the server sent one that fits
(``retry_after_honoured``), else exponential backoff with full jitter:
uniform in ``[0, min(max_backoff_ms, backoff_ms × 2^(n−1))]`` after attempt
``n``, capped so the attempt still fits in the budget. Every attempt
computes its budget header afresh from the same deadline, so the budget a
retry carries is what is left: it shrinks, never resets.

With ``endpoints`` (the base URLs of one service's instances, as
``Dependency(endpoints=)`` takes them) a retry of a request to one of them
goes to the next one: a 503 means "elsewhere".
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from numbers import Real
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit, urlunsplit

from prazo.core import NS_PER_MS, NS_PER_SECOND, Deadline, WindowedHistogram, current_deadline

from ..outgoing import DEFAULT_MARGIN_MS, validate_margin_ms
from .budget import RetryBudget, RetryBudgets, check_clock
from .failures import RETRYABLE_KINDS, RETRYABLE_REASONS, Failure
from .throttle import NOT_ACCEPTED_KINDS, AdaptiveThrottle, AdaptiveThrottles, Throttled

__all__ = [
    "DEFAULT_ATTEMPT_QUANTILE",
    "IDEMPOTENT_METHODS",
    "RETRY_COUNTERS",
    "RetryDecision",
    "RetryPolicy",
    "idempotent_request",
    "replayable_body",
]

T = TypeVar("T")

# RFC 9110 §9.2.2: the methods whose repetition has the effect of one request.
IDEMPOTENT_METHODS = frozenset(("GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"))
DEFAULT_ATTEMPT_QUANTILE = "p50"
_QUANTILES = {"p50": 0.5, "p75": 0.75, "p90": 0.9, "p95": 0.95, "p99": 0.99}
# Successful attempts a destination's window must hold before its quantile counts.
_MIN_SAMPLES = 5
_MIN_ROOM_NS = NS_PER_MS
_MAX_MS = 86_400_000.0
# Every counter of ``RetryPolicy.stats()``, the names the metrics export.
RETRY_COUNTERS = (
    "calls",
    "retries",
    "retries_refused_by_budget",
    "retries_refused_by_deadline",
    "retry_after_honoured",
    "throttled_locally",
)


def idempotent_request(method: str, idempotent: bool | None) -> bool:
    """May this request be sent twice? ``idempotent`` (the caller's word) wins; else the method decides."""
    if idempotent is not None:
        if not isinstance(idempotent, bool):
            raise TypeError(f"idempotent must be a bool or None, not {type(idempotent).__name__}")
        return idempotent
    return method.upper() in IDEMPOTENT_METHODS


def replayable_body(body: object) -> bool:
    """Can a request body be sent again as it was? Only one held in memory (or none); a stream cannot."""
    return body is None or isinstance(body, (bytes, bytearray, str))


class RetryDecision(NamedTuple):
    """``retry``: try again after ``delay_s`` (the server's ``Retry-After`` when ``retry_after``); else ``why`` names the rule that said no."""

    retry: bool
    delay_s: float
    why: str
    retry_after: bool = False


def _check_ms(value: object, name: str, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number of milliseconds, not {type(value).__name__}")
    as_float = float(value)
    low_ok = as_float >= 0.0 if allow_zero else as_float > 0.0
    if not (low_ok and as_float <= _MAX_MS):  # NaN too
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and at most a day in ms, got {as_float!r}")
    return as_float


def _origin(url: str) -> tuple[str, str]:
    split = urlsplit(url)
    return split.scheme.lower(), split.netloc.lower()


class RetryPolicy:
    """When to retry a failed call (see the module docstring for the rules, in order).

    >>> policy = RetryPolicy(max_attempts=3, budget=RetryBudget(percent=0.1))

    Args:
        max_attempts: attempts per call, the first included (≥ 1; 1 never retries).
        budget: a ``RetryBudget`` shared by every destination, or
            ``RetryBudgets`` (the default: 20 % + 10/s per destination, 10 s).
        backoff_ms: the first backoff's cap (> 0); it doubles per attempt.
        max_backoff_ms: the largest backoff cap (≥ ``backoff_ms``).
        attempt_ms: what an attempt is expected to take, kept free of the
            budget before retrying: a number of ms (≥ 0) or a quantile name
            (``"p50"``, ``"p75"``, ``"p90"``, ``"p95"``, ``"p99"``) of the
            destination's successful attempts (0 until 5 are known).
        margin_ms: kept back for the caller's own work, as for the budget header.
        endpoints: base URLs of one service's instances; a retry goes to the next.
        retryable_reasons: the ``X-Prazo-Reason`` values of a 503 that may be retried.
        rng: the ``random.Random`` the jitter draws from (tests seed one).
        sleep: waits between attempts (``time.sleep``; tests pass a fake one).
        clock: monotonic nanoseconds for the deadline arithmetic and the budgets' clock.
        throttle: an ``AdaptiveThrottle`` shared by every destination, or
            ``AdaptiveThrottles`` (one per destination); None (the default): no
            attempt is refused here.
    """

    def __init__(
        self,
        *,
        max_attempts: int = 3,
        budget: RetryBudget | RetryBudgets | None = None,
        backoff_ms: float = 25.0,
        max_backoff_ms: float = 1000.0,
        attempt_ms: float | str = DEFAULT_ATTEMPT_QUANTILE,
        margin_ms: float = DEFAULT_MARGIN_MS,
        endpoints: Sequence[str] | None = None,
        retryable_reasons: Iterable[str] = RETRYABLE_REASONS,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], int] | None = None,
        throttle: AdaptiveThrottle | AdaptiveThrottles | None = None,
    ) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
            raise TypeError(f"max_attempts must be an int, not {type(max_attempts).__name__}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.max_attempts = max_attempts
        if budget is None:
            budget = RetryBudgets(clock=clock)
        if not isinstance(budget, (RetryBudget, RetryBudgets)):
            raise TypeError(f"budget must be a RetryBudget, RetryBudgets or None, not {type(budget).__name__}")
        self.budget = budget
        self.backoff_ms = _check_ms(backoff_ms, "backoff_ms", allow_zero=False)
        self.max_backoff_ms = _check_ms(max_backoff_ms, "max_backoff_ms", allow_zero=False)
        if self.max_backoff_ms < self.backoff_ms:
            raise ValueError(f"max_backoff_ms must be >= backoff_ms ({self.backoff_ms:g}), got {self.max_backoff_ms:g}")
        if isinstance(attempt_ms, str):
            if attempt_ms not in _QUANTILES:
                raise ValueError(
                    f"attempt_ms must be a number of ms or one of {', '.join(_QUANTILES)}, got {attempt_ms!r}"
                )
            self._quantile: float | None = _QUANTILES[attempt_ms]
            self._fixed_attempt_ns = 0
        else:
            self._quantile = None
            self._fixed_attempt_ns = round(_check_ms(attempt_ms, "attempt_ms", allow_zero=True) * NS_PER_MS)
        self.attempt_ms = attempt_ms
        self.margin_ms = validate_margin_ms(margin_ms)
        self._margin_ns = round(self.margin_ms * NS_PER_MS)
        self.endpoints = self._check_endpoints(endpoints)
        if isinstance(retryable_reasons, str):
            raise TypeError("retryable_reasons must be an iterable of reason names, not a str")
        self.retryable_reasons = frozenset(retryable_reasons)
        if rng is not None and not isinstance(rng, random.Random):
            raise TypeError(f"rng must be a random.Random or None, not {type(rng).__name__}")
        self._rng = random.Random() if rng is None else rng
        if not callable(sleep):
            raise TypeError(f"sleep must be callable, not {type(sleep).__name__}")
        self._sleep = sleep
        self._clock = check_clock(clock)
        if throttle is not None and not isinstance(throttle, (AdaptiveThrottle, AdaptiveThrottles)):
            raise TypeError(
                f"throttle must be an AdaptiveThrottle, AdaptiveThrottles or None, not {type(throttle).__name__}"
            )
        self.throttle = throttle
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(RETRY_COUNTERS, 0)
        self._refused: dict[str, int] = {}
        self._histograms: dict[Hashable, WindowedHistogram] = {}

    @staticmethod
    def _check_endpoints(endpoints: object) -> tuple[str, ...] | None:
        if endpoints is None:
            return None
        if isinstance(endpoints, (str, bytes)) or not isinstance(endpoints, Sequence):
            raise TypeError(f"endpoints must be a sequence of base URLs or None, not {type(endpoints).__name__}")
        if not endpoints:
            raise ValueError("endpoints must not be empty (pass None for a single instance)")
        for endpoint in endpoints:
            if not isinstance(endpoint, str) or not urlsplit(endpoint).netloc:
                raise ValueError(f"endpoints must be base URLs such as 'http://b-1:8080', got {endpoint!r}")
        return tuple(endpoints)

    # -- what the adapters ask ------------------------------------------------

    def destination_of(self, url: str) -> Hashable:
        """The budget key of a URL: its service (all of ``endpoints``) or its scheme and host."""
        origin = _origin(url)
        if self.endpoints is not None and origin in {_origin(endpoint) for endpoint in self.endpoints}:
            return self.endpoints
        return origin

    def url_for_attempt(self, url: str, number: int) -> str:
        """``url`` for attempt ``number`` (1 = the first): moved to the next endpoint on each retry."""
        if self.endpoints is None or number <= 1:
            return url
        origins = [_origin(endpoint) for endpoint in self.endpoints]
        origin = _origin(url)
        if origin not in origins:
            return url
        target = urlsplit(self.endpoints[(origins.index(origin) + number - 1) % len(self.endpoints)])
        split = urlsplit(url)
        return urlunsplit((target.scheme, target.netloc, split.path, split.query, split.fragment))

    def record_success(self, destination: Hashable, duration_ns: int, now_ns: int | None = None) -> None:
        """Feed a successful attempt's duration to ``destination``'s window (for a quantile ``attempt_ms``)."""
        if self._quantile is None:
            return
        with self._lock:
            histogram = self._histograms.get(destination)
            if histogram is None:
                if len(self._histograms) >= 1024:
                    self._histograms.pop(next(iter(self._histograms)))
                histogram = self._histograms[destination] = WindowedHistogram(10.0)
        histogram.record(duration_ns, self._clock() if now_ns is None else now_ns)

    def expected_attempt_ns(
        self, destination: Hashable, quantile_ns: Callable[[float], int | None] | None = None
    ) -> int:
        """What the next attempt to ``destination`` should take: the fixed value, or the live quantile (0 unknown).

        ``quantile_ns`` reads the quantile from elsewhere (a ``Dependency``'s own histogram).
        """
        if self._quantile is None:
            return self._fixed_attempt_ns
        if quantile_ns is not None:
            return quantile_ns(self._quantile) or 0
        with self._lock:
            histogram = self._histograms.get(destination)
        if histogram is None:
            return 0
        snapshot = histogram.snapshot(self._clock())
        if snapshot.count < _MIN_SAMPLES:
            return 0
        (value,) = snapshot.quantiles((self._quantile,))
        return 0 if value is None else int(value)

    def start_call(self, destination: Hashable) -> RetryBudget:
        """Count a call (one deposit into its destination's budget) and return that budget."""
        budget = self.budget.for_destination(destination)
        budget.deposit()
        with self._lock:
            self._counters["calls"] += 1
        return budget

    def throttle_for(self, destination: Hashable) -> AdaptiveThrottle | None:
        """The adaptive throttle of ``destination``; None without ``throttle``."""
        return None if self.throttle is None else self.throttle.for_destination(destination)

    def admit_first(self, throttle: AdaptiveThrottle | None, destination: Hashable) -> None:
        """Before a call's first attempt: ``Throttled`` when ``throttle`` refuses it (nothing is sent)."""
        if throttle is not None and not throttle.admit():
            with self._lock:
                self._counters["throttled_locally"] += 1
            raise Throttled(destination)

    @staticmethod
    def record_attempt(throttle: AdaptiveThrottle | None, failure: Failure | None) -> None:
        """After an attempt that was sent: tell ``throttle`` whether the destination took it."""
        if throttle is not None:
            throttle.record(failure is None or failure.kind not in NOT_ACCEPTED_KINDS)

    def decide(
        self,
        failure: Failure | None,
        attempt: int,
        budget: RetryBudget,
        *,
        idempotent: bool,
        replayable: bool = True,
        deadline: Deadline | None = None,
        expected_attempt_ns: int | None = None,
        throttle: AdaptiveThrottle | None = None,
    ) -> RetryDecision:
        """Whether attempt ``attempt`` (1 = the first), which failed with ``failure``, is followed by another.

        ``expected_attempt_ns``: what the next attempt should take (None: the
        fixed ``attempt_ms``, 0 for a quantile). A retry decision has taken
        its token from ``budget``, been let through by ``throttle`` (when
        given) and been counted.
        """
        if expected_attempt_ns is None:
            expected_attempt_ns = self._fixed_attempt_ns
        if failure is None or failure.kind not in RETRYABLE_KINDS:
            return self._no("not-retryable")
        if not idempotent:
            return self._no("not-idempotent")
        if not replayable:
            return self._no("streamed-body")
        if attempt >= self.max_attempts:
            return self._no("attempts")
        backoff_ns = (
            self._rng.uniform(0.0, min(self.max_backoff_ms, self.backoff_ms * 2.0 ** (attempt - 1))) * NS_PER_MS
        )
        retry_after_ns = None if failure.retry_after_s is None else failure.retry_after_s * NS_PER_SECOND
        if deadline is not None:
            room_ns = deadline.ns - self._clock() - self._margin_ns - expected_attempt_ns - _MIN_ROOM_NS
            if room_ns < 0:
                return self._no("deadline", "retries_refused_by_deadline")
            if retry_after_ns is not None and retry_after_ns > room_ns:
                return self._no("retry-after", "retries_refused_by_deadline")
            backoff_ns = min(backoff_ns, room_ns)
        elif retry_after_ns is not None and retry_after_ns > self.max_backoff_ms * NS_PER_MS:
            # No deadline to measure it against: the longest backoff is the limit.
            return self._no("retry-after", "retries_refused_by_deadline")
        if not budget.try_withdraw():
            return self._no("budget", "retries_refused_by_budget")
        if throttle is not None and not throttle.admit():
            return self._no("throttled", "throttled_locally")
        with self._lock:
            self._counters["retries"] += 1
            if retry_after_ns is not None:
                self._counters["retry_after_honoured"] += 1
        delay_ns = backoff_ns if retry_after_ns is None else retry_after_ns
        return RetryDecision(True, delay_ns / NS_PER_SECOND, "retry", retry_after_ns is not None)

    def _no(self, why: str, counter: str | None = None) -> RetryDecision:
        with self._lock:
            self._refused[why] = self._refused.get(why, 0) + 1
            if counter is not None:
                self._counters[counter] += 1
        return RetryDecision(False, 0.0, why)

    def wait(self, delay_s: float) -> None:
        """Wait ``delay_s`` before the next attempt (with the ``sleep`` given)."""
        if delay_s > 0:
            self._sleep(delay_s)

    def call(
        self,
        attempt: Callable[[int], T],
        classify: Callable[[BaseException], Failure | None],
        *,
        destination: Hashable,
        idempotent: bool,
        replayable: bool = True,
        judge: Callable[[T], Failure | None] | None = None,
        discard: Callable[[BaseException], None] | None = None,
    ) -> T:
        """Run ``attempt(number)`` until it succeeds or this policy says no more; then its last answer.

        ``classify`` turns an exception of an attempt into a ``Failure``
        (None: not retryable); ``judge`` does the same for a returned value
        (a 503 response outside a deadline, which the adapter returns as it
        is); ``discard`` releases what a failed attempt holds (a response)
        once it is certain to be retried. The deadline is the caller's current one.
        """
        budget = self.start_call(destination)
        throttle = self.throttle_for(destination)
        self.admit_first(throttle, destination)
        deadline = current_deadline()
        number = 1
        while True:
            began = self._clock()
            try:
                result = attempt(number)
            except Exception as exc:
                failure: Failure | None = classify(exc)
                if throttle is not None:  # no call per attempt without a throttle
                    self.record_attempt(throttle, failure)
                if not self._again(failure, number, budget, destination, idempotent, replayable, deadline, throttle):
                    raise
                if discard is not None:
                    discard(exc)
                number += 1
                continue
            failure = None if judge is None else judge(result)
            if throttle is not None:
                self.record_attempt(throttle, failure)
            if failure is None:
                ended = self._clock()
                self.record_success(destination, max(0, ended - began), ended)
                return result
            if not self._again(failure, number, budget, destination, idempotent, replayable, deadline, throttle):
                return result
            number += 1

    def _again(
        self,
        failure: Failure | None,
        number: int,
        budget: RetryBudget,
        destination: Hashable,
        idempotent: bool,
        replayable: bool,
        deadline: Deadline | None,
        throttle: AdaptiveThrottle | None,
    ) -> bool:
        """Decide after a failed attempt; wait the delay when the answer is yes."""
        decision = self.decide(
            failure,
            number,
            budget,
            idempotent=idempotent,
            replayable=replayable,
            deadline=deadline,
            expected_attempt_ns=self.expected_attempt_ns(destination),
            throttle=throttle,
        )
        if decision.retry:
            self.wait(decision.delay_s)
        return decision.retry

    def stats(self) -> dict[str, Any]:
        """The counters of ``RETRY_COUNTERS`` and ``not_retried``: how many times each rule said no."""
        with self._lock:
            return {**self._counters, "not_retried": dict(self._refused)}

    def __repr__(self) -> str:
        throttle = "" if self.throttle is None else f", throttle={self.throttle!r}"
        return (
            f"RetryPolicy(max_attempts={self.max_attempts}, budget={self.budget!r}, "
            f"attempt_ms={self.attempt_ms!r}{throttle})"
        )
