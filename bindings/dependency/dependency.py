"""``Dependency``: one slow dependency, isolated so it can only hurt its own callers.

The seed's incident: recommendations go from 20 ms to 2 s, the calls in
flight go from 4 to 400, a pool shared by everything fills, and the health
check — which never touched recommendations — fails. ``Dependency`` is the
kit that keeps that to "20 requests suffer, the other 180 per second keep
flowing":

* **its own bounded threads** (``BoundedThreads``): ``fn`` runs on one of at
  most ``max_concurrent`` threads that belong to this dependency, and the
  caller waits at most its *budget* — the smaller of the timeout and what is
  left of its own deadline. A call that timed out keeps its thread and its
  place until ``fn`` really returns (Python cannot kill it), so a hung
  dependency holds at most ``max_concurrent`` threads, ever;
* **a bulkhead without a queue**: when ``max_concurrent`` calls are in
  flight, one more is refused at once;
* **a timeout** fixed or adaptive (``AdaptiveTimeout``);
* **last-known-good** values per key, served when young enough, counted as
  stale; a ``critical`` dependency never serves them and fails fast;
* **hedging** of idempotent calls (never of the others) after a live quantile
  or a fixed delay, on another endpoint, capped at a share of the calls;
* **a breaker** (``Breaker``) that sees slowness as well as errors.

Every call ends in exactly one *outcome*, counted in ``stats()``:

=================  ==================================================  =====================================
outcome            what happened                                       what the caller gets (no stale value)
=================  ==================================================  =====================================
``ok``             ``fn`` returned (the first attempt, or the hedge)   the value
``error``          every attempt raised                                ``fn``'s own exception, unchanged
``timeout``        no answer within the budget                         503 ``dependency-timeout``, or 504
                                                                       ``deadline-exceeded`` when the
                                                                       caller's deadline ended the wait
``bulkhead_full``  ``max_concurrent`` calls already in flight          503 ``bulkhead-full``
``breaker_open``   the breaker refused the call                        503 ``breaker-open``
``no_budget``      the caller's deadline left less than 1 ms           504 ``no-budget-for-downstream``
``throttled``      the retry policy's adaptive throttle refused the    503 ``throttled-locally``
                   call (the dependency has been refusing)
=================  ==================================================  =====================================

``error``, ``timeout``, ``bulkhead_full``, ``breaker_open`` and ``throttled`` serve a
last-known-good value instead when one is young enough (``stale_for_s``);
``no_budget`` never does (nobody is left to use it).

Why one file of about 870 lines: each mechanism lives in its own module
(threads, timeouts, breaker, hedging, last-known-good, retries); what stays
here is the one call path that orders them (breaker, bulkhead, hedge, retry,
stale fallback) and counts its single outcome, which must be read whole.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from contextvars import Context, ContextVar
from dataclasses import dataclass
from functools import partial
from numbers import Real
from typing import Any, Generic, NamedTuple, TypeVar

from prazo.core import (
    NS_PER_MS,
    NS_PER_SECOND,
    REASON_BREAKER_OPEN,
    REASON_BULKHEAD_FULL,
    REASON_DEADLINE_EXCEEDED,
    REASON_DEPENDENCY_TIMEOUT,
    REASON_DEPENDENCY_UNAVAILABLE,
    REASON_NO_BUDGET_FOR_DOWNSTREAM,
    REASON_THROTTLED_LOCALLY,
    Deadline,
    DeadlineExceeded,
    DownstreamOverloaded,
    WindowedHistogram,
    current_deadline,
    deadline_context,
)

from ..retries import Failure, RetryBudget, RetryPolicy, response_failure
from ._arguments import check_count
from .breaker import Breaker
from .hedging import HEDGE_MIN_SAMPLES, HedgeBudget, HedgePolicy
from .last_known_good import LastKnownGood
from .threads import BoundedThreads
from .timeouts import AdaptiveTimeout, LiveQuantiles, positive_ms

__all__ = [
    "MIN_BUDGET_MS",
    "OUTCOMES",
    "REASON_BREAKER_OPEN",
    "REASON_BULKHEAD_FULL",
    "REASON_DEPENDENCY_TIMEOUT",
    "REASON_DEPENDENCY_UNAVAILABLE",
    "RETRY_STATS",
    "Attempt",
    "CallResult",
    "Dependency",
    "DependencyUnavailable",
    "current_attempt",
]

T = TypeVar("T")

OUTCOMES = ("ok", "error", "timeout", "bulkhead_full", "breaker_open", "no_budget", "throttled")
# Observe-only: the threads' safety valve, this many per bulkhead place (at least the floor).
OBSERVED_THREADS_PER_PLACE = 8
OBSERVED_THREADS_FLOOR = 64
# The retry counters of stats() (all 0 without a retry policy).
RETRY_STATS = (
    "retries",
    "retries_refused_by_budget",
    "retries_refused_by_deadline",
    "retry_after_honoured",
    "throttled_locally",
)
# Outcomes of a call that the dependency did not take, for the adaptive throttle:
# its own bulkhead and breaker refuse because it is not keeping up.
_NOT_TAKEN = frozenset(("bulkhead_full", "breaker_open"))
_RETRY_COUNTER_OF = {
    "budget": "retries_refused_by_budget",
    "throttled": "throttled_locally",
    "deadline": "retries_refused_by_deadline",
    "retry-after": "retries_refused_by_deadline",
}

# A call with less budget than this is not started (as for outgoing HTTP
# calls: a downstream budget is passed on in whole milliseconds).
MIN_BUDGET_MS = 1.0
_MIN_BUDGET_NS = round(MIN_BUDGET_MS * NS_PER_MS)

DEFAULT_THREAD_IDLE_S = 30.0


class DependencyUnavailable(DownstreamOverloaded):
    """The dependency could not answer in time, or was not even tried: an honest, fast 503.

    A ``prazo.core.DownstreamOverloaded``, so the WSGI middleware answers
    ``503`` with ``X-Prazo-Reason`` = ``.reason``: ``bulkhead-full``,
    ``breaker-open``, ``dependency-timeout`` or ``dependency-unavailable``
    (no thread could be started for the call). ``.dependency`` names the
    dependency.
    """

    status = 503

    def __init__(
        self, reason: str = REASON_DEPENDENCY_UNAVAILABLE, message: str | None = None, *, dependency: str | None = None
    ) -> None:
        super().__init__(reason, message)
        self.dependency = dependency

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.reason, str(self)), {"dependency": self.dependency})


class Attempt(NamedTuple):
    """Which copy of a call is running: ``number`` 1 is the first, 2 the hedge; ``endpoint`` from ``endpoints``."""

    number: int
    endpoint: Any


_attempt: ContextVar[Attempt | None] = ContextVar("prazo.dependency.attempt", default=None)


def current_attempt() -> Attempt | None:
    """Inside ``fn`` run by a ``Dependency``: which attempt this is and its endpoint; None elsewhere.

    ::

        def fetch(user_id):
            base = current_attempt().endpoint      # "http://recs-2:8080" for the hedge
            return session.get(f"{base}/recs/{user_id}").json()
    """
    return _attempt.get()


@dataclass(frozen=True)
class CallResult(Generic[T]):
    """What ``Dependency.call_detailed`` returns.

    ``value``: fn's result, or a last-known-good value when ``stale``;
    ``age_s``: the stale value's age in seconds (None when fresh);
    ``outcome``: one of ``OUTCOMES`` — ``"ok"`` for a fresh value, otherwise
    why a stale one was served; ``attempts``: how many copies of ``fn``
    were started (0 when refused before starting, 2 when hedged).
    """

    value: T
    stale: bool
    age_s: float | None
    outcome: str
    attempts: int


class _Run:
    """One attempt of a call, as the call's lock guards it."""

    __slots__ = ("done", "number", "permit", "reported", "shadow_place", "started_ns")

    def __init__(self, number: int, permit: bool, started_ns: int) -> None:
        self.number = number
        # Observe-only: this attempt holds a place of the bulkhead that would have been.
        self.shadow_place = False
        self.permit = permit  # holds a breaker permit, to be reported exactly once
        self.reported = False
        self.done = False
        self.started_ns = started_ns


class _Call:
    """What the caller and the attempts of one call share; ``cond`` guards it."""

    __slots__ = (
        "args",
        "cond",
        "deadline",
        "failures",
        "finished",
        "fn",
        "key",
        "kwargs",
        "runs",
        "settled",
        "started",
        "success",
        "value",
        "winner",
    )

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: Any, deadline: Deadline
    ) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.key = key
        self.deadline = deadline
        self.runs: list[_Run] = []
        self.started = 0
        self.finished = 0
        self.success = False
        self.value: Any = None
        self.winner = 0
        self.failures: list[tuple[int, BaseException]] = []
        # True once the caller has left (answered, or interrupted): results
        # arriving later are "late" and only feed the histogram, breaker and LKG.
        self.settled = False


class _Tally:
    """The outcome a call ended with; counted once, whatever way the call leaves.

    With a retry policy, ``retry`` decides (and waits) after a failed attempt,
    and ``endpoint`` is the endpoint index the last attempt started with.
    """

    __slots__ = ("end_ns", "endpoint", "outcome", "recorded", "retry", "would_refuse")

    def __init__(self) -> None:
        self.outcome = "error"
        # Observe-only: the bulkhead would have refused this call (it ran all the same).
        self.would_refuse = False
        # Whether the adaptive throttle has been told how the current attempt went.
        self.recorded = False
        self.retry: Callable[[BaseException], bool] | None = None
        self.endpoint: int | None = None
        # Set by the first attempt: when the call's own timeout ends, which
        # its retries share (a retry never gets a fresh timeout).
        self.end_ns: int | None = None


class _Retrying(Exception):
    """The attempt failed and the retry policy said "again": the call starts over."""


def _dependency_failure(exc: BaseException, retryable_reasons: frozenset[str]) -> Failure | None:
    """What ``fn``'s exception was, as far as retrying it is safe.

    ``fn`` is opaque: a 503 (``DownstreamOverloaded``) that did no work, or a
    refused connection, which sent nothing; a reset only when ``fn`` let it
    out as it is, since wrapped ones may come from the middle of a response.
    """
    failure = response_failure(exc, retryable_reasons=retryable_reasons)
    if failure is not None:
        return failure
    cause: BaseException | None = exc
    for _ in range(16):
        if cause is None:
            break
        if isinstance(cause, ConnectionRefusedError) or isinstance(
            getattr(cause, "reason", None), ConnectionRefusedError
        ):
            return Failure("refused")
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, ConnectionResetError):
        return Failure("reset")
    return None


def _check_seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number of seconds, not {type(value).__name__}")
    as_float = float(value)
    if not as_float >= 0.0:  # NaN fails this too
        raise ValueError(f"{name} must be >= 0, got {as_float!r}")
    return as_float


class Dependency:
    """A dependency behind its own threads, bulkhead, timeout, last-known-good, hedging and breaker.

    >>> recs = Dependency("recommendations", max_concurrent=20, timeout_ms=300, stale_for_s=600)
    >>> def fetch(user_id):
    ...     return ["a", "b"]
    >>> recs.call(fetch, 42, key=("recs", 42))
    ['a', 'b']

    Args:
        name: names the dependency in errors, thread names and metrics.
        max_concurrent: the bulkhead: calls of ``fn`` in flight at once,
            abandoned ones (timed out, still running) included; also the
            most threads this dependency ever has. One more is refused at once.
        timeout_ms: the longest a caller waits, in ms (> 0), or an
            ``AdaptiveTimeout``. The caller's own deadline can shorten it.
        stale_for_s: serve a last-known-good value at most this old (≥ 0)
            when a call fails, times out or is refused; None: never.
        critical: this data must never be stale (the seed's allergy list):
            no last-known-good at all, a fast 503 instead. Excludes ``stale_for_s``.
        hedge: None; a quantile name (``"p50"``, ``"p75"``, ``"p90"``,
            ``"p95"``, ``"p99"``, ``"p999"``): send a second copy of an
            *idempotent* call that has not answered after that live quantile
            (once the window holds 20 calls); or a fixed delay in ms.
        breaker: a ``Breaker`` consulted before every attempt and told every
            result; None (the default): no breaker.
        endpoints: instances to rotate through; each attempt's is
            ``current_attempt().endpoint`` inside ``fn``, and a hedge goes to
            the next one after its call's first attempt.
        max_hedge_ratio: at most this share of calls (0 to 1) is hedged.
        lkg_entries: keys the last-known-good store keeps (LRU, ≥ 1).
        clock: a callable returning monotonic nanoseconds for the
            histogram, the last-known-good ages and the breaker (tests pass
            a fake one); waiting always uses the real monotonic clock.
        thread_idle_s: an idle thread exits after this many seconds.
        window_s: the live latency window (quantiles, adaptive timeout, hedging).
        retry: a ``RetryPolicy`` (``prazo.bindings.retries``): a call whose
            ``fn`` failed with a 503 that did no work or a refused
            connection is tried again, on the next endpoint, within the
            caller's deadline and the policy's budget for this dependency's
            name; an attempt's expected duration is this dependency's live
            quantile. Each retry takes a bulkhead place and asks the breaker
            like any call. ``idempotent=True`` is needed, as for hedging.
            None (the default): never retried.
        observe_only: the bulkhead only counts: a call it would have
            refused runs all the same (on up to 8 threads per place, at
            least 64: a safety valve against a hung dependency), and is
            counted ``bulkhead_full`` in ``stats()`` and every export, as
            it would have been; ``in_flight`` is then the places it would
            hold. The timeout, breaker and hedging work as usual.
    """

    def __init__(
        self,
        name: str,
        *,
        max_concurrent: int,
        timeout_ms: float | AdaptiveTimeout,
        stale_for_s: float | None = None,
        critical: bool = False,
        hedge: str | float | None = None,
        breaker: Breaker | None = None,
        endpoints: Sequence[Any] | None = None,
        max_hedge_ratio: float = 0.1,
        lkg_entries: int = 1024,
        clock: Callable[[], int] | None = None,
        thread_idle_s: float = DEFAULT_THREAD_IDLE_S,
        window_s: float = 10.0,
        retry: RetryPolicy | None = None,
        observe_only: bool = False,
    ) -> None:
        if not isinstance(observe_only, bool):
            raise TypeError(f"observe_only must be a bool, not {type(observe_only).__name__}")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        if not name:
            raise ValueError("name must not be empty")
        self._name = name
        self._max = check_count(max_concurrent, "max_concurrent")
        if isinstance(timeout_ms, AdaptiveTimeout):
            self._adaptive: AdaptiveTimeout | None = timeout_ms
            self._fixed_timeout_ns = 0
        else:
            self._adaptive = None
            self._fixed_timeout_ns = max(1, round(positive_ms(timeout_ms, "timeout_ms") * NS_PER_MS))
        if not isinstance(critical, bool):
            raise TypeError(f"critical must be a bool, not {type(critical).__name__}")
        self._critical = critical
        if stale_for_s is not None:
            if critical:
                raise ValueError("stale_for_s must be None when critical=True: critical data is never served stale")
            stale_for_s = _check_seconds(stale_for_s, "stale_for_s")
        self._stale_for_s = stale_for_s
        self._hedge = HedgePolicy(hedge)
        self._hedge_budget = HedgeBudget(max_hedge_ratio)
        self._max_hedge_ratio = float(max_hedge_ratio)
        if breaker is not None and not isinstance(breaker, Breaker):
            raise TypeError(f"breaker must be a prazo Breaker or None, not {type(breaker).__name__}")
        self._breaker = breaker
        if endpoints is not None:
            if isinstance(endpoints, (str, bytes)) or not isinstance(endpoints, Sequence):
                raise TypeError(f"endpoints must be a sequence of endpoints or None, not {type(endpoints).__name__}")
            if not endpoints:
                raise ValueError("endpoints must not be empty (pass None for a single instance)")
            self._endpoints: tuple[Any, ...] | None = tuple(endpoints)
        else:
            self._endpoints = None
        lkg_entries = check_count(lkg_entries, "lkg_entries")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning monotonic nanoseconds, not {type(clock).__name__}")
        # With a clock of its own the dependency passes its readings on; without
        # one, the breaker and the LKG store read their own clocks.
        self._own_clock = clock is not None
        self._clock: Callable[[], int] = clock if clock is not None else time.monotonic_ns
        self._lkg = LastKnownGood(lkg_entries) if stale_for_s is not None else None
        self._histogram = WindowedHistogram(window_s)
        self._quantiles = LiveQuantiles(self._histogram)
        # Observe-only: the bulkhead only counts (its places are _shadow_in_flight); the threads
        # are bounded by a safety valve well above it, so a hung dependency cannot take them all.
        self._observe_only = observe_only
        self._shadow_in_flight = 0
        threads = max(OBSERVED_THREADS_FLOOR, OBSERVED_THREADS_PER_PLACE * self._max) if observe_only else self._max
        self._threads = BoundedThreads(threads, idle_s=thread_idle_s, name=f"prazo-dependency-{name}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a prazo RetryPolicy or None, not {type(retry).__name__}")
        self._retry = retry

        self._lock = threading.Lock()
        self._next_endpoint = 0
        self._calls = 0
        self._outcomes = dict.fromkeys(OUTCOMES, 0)
        self._stale_served = 0
        self._unavailable = 0
        self._hedges_sent = 0
        self._hedges_won = 0
        self._late_results = 0
        self._retry_counts = dict.fromkeys(RETRY_STATS, 0)

    # -- public properties -------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_concurrent(self) -> int:
        return self._max

    @property
    def critical(self) -> bool:
        return self._critical

    @property
    def stale_for_s(self) -> float | None:
        return self._stale_for_s

    @property
    def breaker(self) -> Breaker | None:
        return self._breaker

    @property
    def endpoints(self) -> tuple[Any, ...] | None:
        return self._endpoints

    @property
    def histogram(self) -> WindowedHistogram:
        """The durations of ``fn`` (every attempt that returned or raised), on the dependency's clock."""
        return self._histogram

    @property
    def retry(self) -> RetryPolicy | None:
        """The retry policy (None: calls are never retried)."""
        return self._retry

    @property
    def last_known_good(self) -> LastKnownGood | None:
        """The store of last-known-good values (None when ``stale_for_s`` is None)."""
        return self._lkg

    def timeout_ms(self) -> float:
        """The timeout a call starting now gets (before the caller's deadline shortens it)."""
        return self._timeout_ns(self._clock()) / NS_PER_MS

    # -- calling -----------------------------------------------------------

    def call(
        self, fn: Callable[..., T], /, *args: Any, key: Hashable = None, idempotent: bool = False, **kwargs: Any
    ) -> T:
        """``fn(*args, **kwargs)`` on the dependency's threads, within the caller's budget; its value.

        ``key`` names the value for last-known-good (None: none for this
        call); ``idempotent=True`` allows hedging. Raises ``fn``'s own
        exception, ``DependencyUnavailable`` (503) or ``DeadlineExceeded``
        (504) unless a young enough stale value is served instead (see
        ``call_detailed`` to tell).
        """
        return self.call_detailed(fn, *args, key=key, idempotent=idempotent, **kwargs).value

    def call_detailed(
        self, fn: Callable[..., T], /, *args: Any, key: Hashable = None, idempotent: bool = False, **kwargs: Any
    ) -> CallResult[T]:
        """Like ``call``, returning a ``CallResult``: the value, whether it is stale and how old, the outcome."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        if inspect.iscoroutinefunction(fn):
            # Its call would only make a coroutine, which no thread ever awaits.
            raise TypeError("fn must be a blocking callable, not a coroutine function")
        if not isinstance(idempotent, bool):
            raise TypeError(f"idempotent must be a bool, not {type(idempotent).__name__}")
        if key is not None:
            try:
                hash(key)
            except TypeError:
                raise TypeError(f"key must be hashable, not {type(key).__name__}") from None
        tally = _Tally()
        with self._lock:
            self._calls += 1
        try:
            if self._retry is None:
                return self._call(fn, args, kwargs, key, idempotent, tally)
            return self._call_with_retries(self._retry, fn, args, kwargs, key, idempotent, tally)
        finally:
            with self._lock:
                # Observe-only: the outcome the call would have had (the bulkhead's), not the one it had.
                self._outcomes["bulkhead_full" if tally.would_refuse else tally.outcome] += 1

    def _call_with_retries(
        self,
        policy: RetryPolicy,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: Hashable,
        idempotent: bool,
        tally: _Tally,
    ) -> CallResult[T]:
        """``_call`` again, on the next endpoint, while ``policy`` says a failed attempt may be retried."""
        budget: RetryBudget = policy.start_call(self._name)
        throttle = policy.throttle_for(self._name)
        if throttle is not None and not throttle.admit():
            with self._lock:
                self._retry_counts["throttled_locally"] += 1
            return self._fallback(tally, "throttled", key, 0, REASON_THROTTLED_LOCALLY)
        caller_deadline = current_deadline()
        number = 1

        def quantile_ns(q: float) -> int | None:
            value, samples = self._quantiles.get(q, self._clock())
            return value if samples >= HEDGE_MIN_SAMPLES else None

        def again(error: BaseException) -> bool:
            # The retry must fit in what is left of the call: the caller's
            # deadline or the call's own timeout, whichever ends first.
            end_ns = tally.end_ns
            deadline = caller_deadline
            if end_ns is not None and (deadline is None or end_ns < deadline.ns):
                deadline = Deadline.at_ns(end_ns)
            failure = _dependency_failure(error, policy.retryable_reasons)
            policy.record_attempt(throttle, failure)
            tally.recorded = True
            decision = policy.decide(
                failure,
                number,
                budget,
                idempotent=idempotent,
                deadline=deadline,
                expected_attempt_ns=policy.expected_attempt_ns(self._name, quantile_ns),
                throttle=throttle,
            )
            counter = "retries" if decision.retry else _RETRY_COUNTER_OF.get(decision.why)
            with self._lock:
                if counter is not None:
                    self._retry_counts[counter] += 1
                if decision.retry_after:
                    self._retry_counts["retry_after_honoured"] += 1
            if decision.retry:
                policy.wait(decision.delay_s)
            return decision.retry

        tally.retry = again
        while True:
            tally.recorded = False
            try:
                return self._call(fn, args, kwargs, key, idempotent, tally)
            except _Retrying:
                number += 1
            finally:
                if throttle is not None and not tally.recorded:
                    # The last attempt, not judged by a retry decision: the dependency took it
                    # (a value, a timeout, an error of fn's own) unless its bulkhead or breaker refused.
                    throttle.record(tally.outcome not in _NOT_TAKEN)

    def _now_arg(self, now: int) -> int | None:
        return now if self._own_clock else None

    def _timeout_ns(self, now: int) -> int:
        if self._adaptive is None:
            return self._fixed_timeout_ns
        return max(1, round(self._adaptive.timeout_ms(self._quantiles, now) * NS_PER_MS))

    def _call(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: Hashable,
        idempotent: bool,
        tally: _Tally,
    ) -> CallResult[T]:
        now = self._clock()
        timeout_ns = self._timeout_ns(now)
        start_ns = time.monotonic_ns()
        budget_ns = timeout_ns
        caller_limited = False
        deadline = current_deadline()
        if deadline is not None:
            remaining_ns = deadline.ns - start_ns
            if remaining_ns < _MIN_BUDGET_NS:
                tally.outcome = "no_budget"
                raise DeadlineExceeded(
                    REASON_NO_BUDGET_FOR_DOWNSTREAM,
                    f"no budget left to call {self._name} ({remaining_ns / NS_PER_MS:.1f} ms)",
                )
            if remaining_ns < timeout_ns:
                budget_ns = remaining_ns
                caller_limited = True
        if tally.end_ns is not None and tally.end_ns - start_ns < budget_ns:
            budget_ns = max(0, tally.end_ns - start_ns)
        end_ns = start_ns + budget_ns
        if tally.end_ns is None:
            tally.end_ns = end_ns

        breaker = self._breaker
        if breaker is not None and not breaker.try_acquire(self._now_arg(now)):
            return self._fallback(tally, "breaker_open", key, 0, REASON_BREAKER_OPEN)
        call = _Call(fn, args, kwargs, key, Deadline.at_ns(end_ns))
        first = 0
        if self._endpoints is not None:
            if tally.endpoint is not None:
                # A retry: the next endpoint after the one that just failed ("elsewhere").
                first = (tally.endpoint + 1) % len(self._endpoints)
            else:
                with self._lock:
                    first = self._next_endpoint
                    self._next_endpoint = (first + 1) % len(self._endpoints)
        tally.endpoint = first
        try:
            started = self._start(call, 1, first, now, tally)
        except RuntimeError as exc:  # the system refused a thread
            if breaker is not None:
                breaker.release(self._now_arg(self._clock()))
            return self._fallback(
                tally, "bulkhead_full", key, 0, REASON_DEPENDENCY_UNAVAILABLE, cause=exc, message="no thread to run it"
            )
        except BaseException:
            if breaker is not None:
                breaker.release(self._now_arg(self._clock()))
            raise
        if not started:
            if breaker is not None:
                breaker.release(self._now_arg(self._clock()))
            return self._fallback(tally, "bulkhead_full", key, 0, REASON_BULKHEAD_FULL)
        hedge_at: int | None = None
        if not self._hedge.enabled:
            return self._wait(call, tally, end_ns, hedge_at, first, caller_limited)
        self._hedge_budget.credit()
        if idempotent:
            delay_ns = self._hedge.delay_ns(self._quantiles, now)
            if delay_ns is not None and start_ns + delay_ns < end_ns:
                hedge_at = start_ns + delay_ns
        return self._wait(call, tally, end_ns, hedge_at, first, caller_limited)

    def _start(self, call: _Call, number: int, endpoint_index: int, now: int, tally: _Tally | None = None) -> bool:
        """Start attempt ``number`` of ``call`` on a free thread; False when the bulkhead is full.

        Observe-only: the bulkhead that would have been only counts; a first
        attempt (``tally`` given) it would have refused still starts, and its
        call is counted as the bulkhead would have counted it.
        """
        endpoint = None if self._endpoints is None else self._endpoints[endpoint_index % len(self._endpoints)]
        context = deadline_context(call.deadline)
        context.run(_attempt.set, Attempt(number, endpoint))
        run = _Run(number, self._breaker is not None, now)
        with call.cond:
            call.started += 1
            call.runs.append(run)
        if self._observe_only:
            with self._lock:
                run.shadow_place = self._shadow_in_flight < self._max
                self._shadow_in_flight += run.shadow_place
            if not run.shadow_place and tally is not None:
                tally.would_refuse = True
        started = False
        try:
            started = self._threads.try_start(partial(self._run, call, run, context))
        finally:
            if not started:
                self._give_back_shadow_place(run)
                with call.cond:
                    call.started -= 1
                    call.runs.remove(run)
        return started

    def _give_back_shadow_place(self, run: _Run) -> None:
        if run.shadow_place:
            run.shadow_place = False
            with self._lock:
                self._shadow_in_flight -= 1

    def _run(self, call: _Call, run: _Run, context: Context, release: Callable[[], None]) -> None:
        """One attempt, on a dependency thread: run ``fn``, feed the histogram, breaker and LKG, publish."""
        clock = self._clock
        began = clock()
        value: Any = None
        error: BaseException | None = None
        try:
            value = context.run(call.fn, *call.args, **call.kwargs)
        except BaseException as exc:  # noqa: BLE001 - every error goes to the caller
            error = exc
        ended = clock()
        duration_ns = max(0, ended - began)
        try:
            self._histogram.record(duration_ns, ended)
            breaker = self._breaker
            report = False
            if run.permit:
                with call.cond:
                    report = not run.reported
                    run.reported = True
            if report and breaker is not None:
                if error is None:
                    breaker.on_success(duration_ns, self._now_arg(ended))
                else:
                    breaker.on_failure(duration_ns, self._now_arg(ended))
            if error is None and call.key is not None and self._lkg is not None:
                # A late success is a good value too: it refreshes last-known-good.
                self._lkg.put(call.key, value, self._now_arg(ended))
        finally:
            # The place is free before the caller hears of the result, so a
            # caller that calls again at once finds it free.
            release()
            self._give_back_shadow_place(run)
            with call.cond:
                run.done = True
                call.finished += 1
                late = call.settled
                if not late:
                    if error is None:
                        if not call.success:
                            call.success = True
                            call.value = value
                            call.winner = run.number
                    else:
                        call.failures.append((run.number, error))
                call.cond.notify_all()
            if late:
                with self._lock:
                    self._late_results += 1

    def _wait(
        self, call: _Call, tally: _Tally, end_ns: int, hedge_at: int | None, first: int, caller_limited: bool
    ) -> CallResult[Any]:
        cond = call.cond
        hedge_pending = hedge_at is not None
        hedge_ns = end_ns if hedge_at is None else hedge_at
        try:
            while True:
                with cond:
                    now_ns = 0
                    while not call.success and call.finished < call.started:
                        now_ns = time.monotonic_ns()
                        if now_ns >= end_ns or (hedge_pending and now_ns >= hedge_ns):
                            break
                        wake_ns = min(end_ns, hedge_ns) if hedge_pending else end_ns
                        cond.wait((wake_ns - now_ns) / NS_PER_SECOND)
                    if call.success or call.finished >= call.started or now_ns >= end_ns:
                        call.settled = True
                        success, value, winner = call.success, call.value, call.winner
                        failures = sorted(call.failures, key=lambda failure: failure[0])
                        unfinished = [run for run in call.runs if not run.done]
                        attempts = call.started
                        call.value = None
                        call.failures = []
                        break
                hedge_pending = False
                self._send_hedge(call, first + 1)
        except BaseException:
            with cond:
                call.settled = True
            raise

        if success:
            tally.outcome = "ok"
            if winner == 2:
                with self._lock:
                    self._hedges_won += 1
            return CallResult(value, False, None, "ok", attempts)
        if not unfinished:
            error = failures[0][1]
            if not isinstance(error, Exception):
                raise error  # KeyboardInterrupt, SystemExit...: never covered by a stale value
            if isinstance(error, DeadlineExceeded):
                # fn ran out of the time it was given (its own client timed out
                # at the budget): the dependency was too slow, not fn broken.
                return self._fallback(
                    tally,
                    "timeout",
                    key=call.key,
                    attempts=attempts,
                    reason=REASON_DEPENDENCY_TIMEOUT,
                    cause=error,
                    caller_deadline=caller_limited,
                )
            if tally.retry is not None and tally.retry(error):
                raise _Retrying
            return self._fallback(tally, "error", call.key, attempts, cause=error)
        breaker = self._breaker
        if breaker is not None and not caller_limited:
            # The dependency missed its own timeout: tell the breaker now, not
            # when (if ever) the call returns, so a hang opens it too.
            now = self._clock()
            for run in unfinished:
                with cond:
                    report = run.permit and not run.reported
                    run.reported = True
                if report:
                    breaker.on_failure(max(0, now - run.started_ns), self._now_arg(now))
        return self._fallback(
            tally, "timeout", call.key, attempts, REASON_DEPENDENCY_TIMEOUT, caller_deadline=caller_limited
        )

    def _send_hedge(self, call: _Call, endpoint_index: int) -> None:
        """Start the second attempt of ``call`` if the budget, the breaker and the bulkhead all allow it."""
        with call.cond:
            if call.success or call.finished >= call.started:
                return
        if not self._hedge_budget.take():
            return
        now = self._clock()
        breaker = self._breaker
        if breaker is not None and not breaker.try_acquire(self._now_arg(now)):
            self._hedge_budget.refund()
            return
        started = False
        try:
            started = self._start(call, 2, endpoint_index, now)
        except RuntimeError:
            pass
        finally:
            if not started:
                if breaker is not None:
                    breaker.release(self._now_arg(now))
                self._hedge_budget.refund()
        if started:
            with self._lock:
                self._hedges_sent += 1

    def _fallback(
        self,
        tally: _Tally,
        outcome: str,
        key: Hashable,
        attempts: int,
        reason: str = REASON_DEPENDENCY_UNAVAILABLE,
        *,
        cause: BaseException | None = None,
        caller_deadline: bool = False,
        message: str | None = None,
    ) -> CallResult[Any]:
        """A stale value for a call that got none, or the error it ends with."""
        tally.outcome = outcome
        lkg = self._lkg
        if lkg is not None and key is not None and self._stale_for_s is not None:
            hit = lkg.get(key, self._stale_for_s, self._now_arg(self._clock()))
            if hit is not None:
                with self._lock:
                    self._stale_served += 1
                return CallResult(hit[0], True, hit[1], outcome, attempts)
        if outcome == "error" and cause is not None:
            raise cause
        if caller_deadline:
            if cause is not None:
                raise cause
            raise DeadlineExceeded(REASON_DEADLINE_EXCEEDED, f"{self._name} did not answer within the deadline")
        with self._lock:
            self._unavailable += 1
        error = DependencyUnavailable(reason, f"{self._name}: {message or reason}", dependency=self._name)
        if cause is not None:
            raise error from cause
        raise error

    # -- observing ---------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters and the live latency quantiles, as flat keys (docs/how-to/slow-dependency.md has each)."""
        now = self._clock()
        snapshot = self._histogram.snapshot(now)
        p50, p95, p99 = snapshot.quantiles((0.5, 0.95, 0.99))
        in_flight = self._threads.running
        with self._lock:
            if self._observe_only:
                in_flight = self._shadow_in_flight  # the places the bulkhead that would have been holds
            outcomes = dict(self._outcomes)
            counters = {
                "calls": self._calls,
                "stale_served": self._stale_served,
                "unavailable": self._unavailable,
                "hedges_sent": self._hedges_sent,
                "hedges_won": self._hedges_won,
                "late_results": self._late_results,
                **self._retry_counts,
            }
        breaker = self._breaker
        return {
            "name": self._name,
            "max_concurrent": self._max,
            "in_flight": in_flight,
            "saturation": in_flight / self._max,
            "threads": self._threads.threads,
            "outcomes": outcomes,
            "rejected": outcomes["bulkhead_full"] + outcomes["breaker_open"] + outcomes["throttled"],
            **counters,
            "breaker_state": "disabled" if breaker is None else breaker.current_state(self._now_arg(now)),
            "p50_ms": None if p50 is None else p50 / NS_PER_MS,
            "p95_ms": None if p95 is None else p95 / NS_PER_MS,
            "p99_ms": None if p99 is None else p99 / NS_PER_MS,
            "timeout_ms": self._timeout_ns(now) / NS_PER_MS,
            "lkg_entries": 0 if self._lkg is None else len(self._lkg),
            **({"observe_only": 1} if self._observe_only else {}),
        }

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no call of ``fn`` is running (abandoned ones included); False on timeout."""
        return self._threads.wait_idle(timeout)

    def __repr__(self) -> str:
        return (
            f"<Dependency {self._name!r} in_flight={self._threads.running}/{self._max} "
            f"threads={self._threads.threads} calls={self._calls}>"
        )
