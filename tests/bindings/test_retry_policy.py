"""``RetryPolicy.decide`` and ``call`` on a fake clock, with a seeded jitter; ``retry_after_seconds``.

Each rule of the policy's module docstring, in its order: what is retried,
what never is, what the deadline and the budget refuse, how long the wait
is, and which endpoint the retry goes to.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from _helpers import SecondsClock
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.retries import Failure, RetryBudget, RetryPolicy, retry_after_ms_seconds, retry_after_seconds
from prazo.bindings.retries.failures import connection_failure, overloaded_failure
from prazo.bindings.retries.retry_after import MAX_RETRY_AFTER_S
from prazo.core import Deadline, DeadlineExceeded, DownstreamOverloaded, deadline_scope

OVERLOADED = Failure("overloaded")


def make(clock: SecondsClock, **overrides: Any) -> RetryPolicy:
    arguments: dict[str, Any] = {
        "budget": RetryBudget(percent=1.0, min_per_s=10, clock=clock),
        "attempt_ms": 0.0,
        "margin_ms": 20.0,
        "rng": random.Random(1),
        "sleep": clock.advance,
        "clock": clock,
    }
    arguments.update(overrides)
    return RetryPolicy(**arguments)


def deadline_in(clock: SecondsClock, seconds: float) -> Deadline:
    return Deadline.at_ns(clock() + round(seconds * 1e9))


@pytest.mark.parametrize("kind", ["overloaded", "refused", "reset"])
def test_safe_failures_are_retried(kind: str) -> None:
    clock = SecondsClock()
    policy = make(clock)
    budget = policy.start_call("b")
    decision = policy.decide(Failure(kind), 1, budget, idempotent=True, deadline=deadline_in(clock, 1.0))
    assert decision.retry and decision.why == "retry"


@pytest.mark.parametrize("failure", [Failure("deadline"), Failure("other"), None])
def test_a_504_a_timeout_and_anything_else_never_are(failure: Failure | None) -> None:
    clock = SecondsClock()
    policy = make(clock)
    decision = policy.decide(failure, 1, policy.start_call("b"), idempotent=True, deadline=deadline_in(clock, 1.0))
    assert not decision.retry and decision.why == "not-retryable"


def test_the_rules_in_order() -> None:
    clock = SecondsClock()
    policy = make(clock, max_attempts=2, budget=RetryBudget(percent=0.0, min_per_s=0.0, clock=clock))
    budget = policy.start_call("b")
    soon = deadline_in(clock, 1.0)
    assert policy.decide(OVERLOADED, 1, budget, idempotent=False, deadline=soon).why == "not-idempotent"
    assert policy.decide(OVERLOADED, 1, budget, idempotent=True, replayable=False, deadline=soon).why == "streamed-body"
    assert policy.decide(OVERLOADED, 2, budget, idempotent=True, deadline=soon).why == "attempts"
    assert policy.decide(OVERLOADED, 1, budget, idempotent=True, deadline=deadline_in(clock, 0.02)).why == "deadline"
    late = Failure("overloaded", retry_after_s=5.0)
    assert policy.decide(late, 1, budget, idempotent=True, deadline=soon).why == "retry-after"
    assert policy.decide(OVERLOADED, 1, budget, idempotent=True, deadline=soon).why == "budget"
    stats = policy.stats()
    assert stats["retries"] == 0
    assert stats["retries_refused_by_deadline"] == 2 and stats["retries_refused_by_budget"] == 1


def test_the_expected_attempt_is_kept_free_of_the_budget() -> None:
    clock = SecondsClock()
    policy = make(clock, attempt_ms=300.0)
    budget = policy.start_call("b")
    # 20 ms margin + 300 ms attempt + 1 ms: 320 ms left is not enough, 322 ms is.
    assert policy.decide(OVERLOADED, 1, budget, idempotent=True, deadline=deadline_in(clock, 0.320)).why == "deadline"
    assert policy.decide(OVERLOADED, 1, budget, idempotent=True, deadline=deadline_in(clock, 0.322)).retry


def test_a_live_quantile_of_successes_is_the_expected_attempt() -> None:
    clock = SecondsClock()
    policy = make(clock, attempt_ms="p90")
    assert policy.expected_attempt_ns("b") == 0  # nothing known yet
    for _ in range(20):
        policy.record_success("b", 200_000_000)
    assert 190_000_000 <= policy.expected_attempt_ns("b") <= 210_000_000
    assert policy.expected_attempt_ns("other") == 0
    assert policy.expected_attempt_ns("b", lambda q: 7) == 7


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32), attempt=st.integers(1, 8), remaining_ms=st.floats(25.0, 5000.0))
def test_backoff_is_full_jitter_capped_by_the_remaining_budget(seed: int, attempt: int, remaining_ms: float) -> None:
    clock = SecondsClock()
    policy = make(clock, max_attempts=10, backoff_ms=25.0, max_backoff_ms=1000.0, rng=random.Random(seed))
    budget = policy.start_call("b")
    decision = policy.decide(
        OVERLOADED, attempt, budget, idempotent=True, deadline=deadline_in(clock, remaining_ms / 1000)
    )
    if remaining_ms - 20.0 - 1.0 < 0:
        assert not decision.retry
        return
    assert decision.retry
    cap_ms = min(1000.0, 25.0 * 2 ** (attempt - 1), remaining_ms - 21.0)
    assert 0.0 <= decision.delay_s * 1000 <= cap_ms + 1e-6


def test_the_same_seed_gives_the_same_waits() -> None:
    def waits(seed: int) -> list[float]:
        clock = SecondsClock()
        policy = make(clock, max_attempts=10, rng=random.Random(seed))
        budget = policy.start_call("b")
        return [policy.decide(OVERLOADED, n, budget, idempotent=True).delay_s for n in range(1, 6)]

    assert waits(3) == waits(3) != waits(4)


def test_a_retry_after_that_fits_is_the_wait() -> None:
    clock = SecondsClock()
    policy = make(clock)
    budget = policy.start_call("b")
    decision = policy.decide(Failure("overloaded", 0.5), 1, budget, idempotent=True, deadline=deadline_in(clock, 1.0))
    assert decision.retry and decision.delay_s == 0.5
    assert policy.stats()["retry_after_honoured"] == 1


def test_call_retries_then_gives_the_last_real_answer_and_never_passes_the_deadline() -> None:
    clock = SecondsClock()
    policy = make(clock, max_attempts=5, backoff_ms=100.0)
    attempts: list[int] = []

    def attempt(number: int) -> str:
        attempts.append(number)
        clock.advance(0.1)  # each attempt takes 100 ms of the fake clock
        raise DownstreamOverloaded()

    with deadline_scope(Deadline.at_ns(clock() + 250_000_000)), pytest.raises(DownstreamOverloaded):
        policy.call(attempt, lambda exc: OVERLOADED, destination="b", idempotent=True)
    # 250 ms: the first two attempts fit with their waits; a third would start past 229 ms.
    assert 1 <= len(attempts) <= 3
    assert policy.stats()["retries_refused_by_deadline"] == 1


def test_call_returns_the_first_success() -> None:
    clock = SecondsClock()
    policy = make(clock)
    answers = iter([DownstreamOverloaded(), "ok"])

    def attempt(number: int) -> str:
        answer = next(answers)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    assert policy.call(attempt, lambda exc: OVERLOADED, destination="b", idempotent=True) == "ok"
    assert policy.stats()["retries"] == 1 and policy.stats()["calls"] == 1


def test_a_504_raised_by_an_attempt_comes_back_unretried() -> None:
    clock = SecondsClock()
    policy = make(clock)
    calls = []

    def attempt(number: int) -> str:
        calls.append(number)
        raise DeadlineExceeded()

    with pytest.raises(DeadlineExceeded):
        policy.call(attempt, lambda exc: Failure("deadline"), destination="b", idempotent=True)
    assert calls == [1]


def test_endpoints_rotate_and_share_one_budget() -> None:
    policy = RetryPolicy(endpoints=["http://b-1:80", "http://b-2:80", "http://b-3:80"])
    url = "http://b-2:80/items?x=1"
    assert [policy.url_for_attempt(url, n) for n in (1, 2, 3, 4)] == [
        url,
        "http://b-3:80/items?x=1",
        "http://b-1:80/items?x=1",
        url,
    ]
    assert policy.destination_of(url) == policy.destination_of("http://b-1:80/other")
    assert policy.url_for_attempt("http://elsewhere/x", 2) == "http://elsewhere/x"
    assert policy.destination_of("http://Elsewhere:81/x") == ("http", "elsewhere:81")


@pytest.mark.parametrize(
    ("arguments", "error", "name"),
    [
        ({"max_attempts": 0}, ValueError, "max_attempts"),
        ({"max_attempts": 2.0}, TypeError, "max_attempts"),
        ({"budget": 0.2}, TypeError, "budget"),
        ({"backoff_ms": 0}, ValueError, "backoff_ms"),
        ({"backoff_ms": 100, "max_backoff_ms": 50}, ValueError, "max_backoff_ms"),
        ({"attempt_ms": "p42"}, ValueError, "attempt_ms"),
        ({"attempt_ms": -1}, ValueError, "attempt_ms"),
        ({"margin_ms": float("nan")}, ValueError, "margin_ms"),
        ({"endpoints": "http://b:80"}, TypeError, "endpoints"),
        ({"endpoints": []}, ValueError, "endpoints"),
        ({"endpoints": ["b-1"]}, ValueError, "endpoints"),
        ({"retryable_reasons": "queue-full"}, TypeError, "retryable_reasons"),
        ({"rng": 3}, TypeError, "rng"),
        ({"sleep": 3}, TypeError, "sleep"),
        ({"clock": 3}, TypeError, "clock"),
    ],
)
def test_wrong_arguments_name_themselves(arguments: dict[str, Any], error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=name):
        RetryPolicy(**arguments)


def test_a_503_is_retryable_only_when_it_did_no_work() -> None:
    reasons = frozenset({"queue-full"})
    assert overloaded_failure(None, None, retryable_reasons=reasons).kind == "overloaded"
    assert overloaded_failure("queue-full", "3", retryable_reasons=reasons) == Failure("overloaded", 3.0, "queue-full")
    assert overloaded_failure("dependency-timeout", None, retryable_reasons=reasons).kind == "other"


def test_a_measured_wait_in_ms_wins_over_the_whole_seconds_beside_it() -> None:
    reasons = frozenset({"queue-full"})
    assert overloaded_failure("queue-full", "1", retryable_reasons=reasons, retry_after_ms="180").retry_after_s == 0.18
    # A malformed ms value is ignored, never trusted: the Retry-After beside it stands.
    for garbage in ("", "-5", "1.5", "soon", "١٢", None):
        failure = overloaded_failure("queue-full", "2", retryable_reasons=reasons, retry_after_ms=garbage)
        assert failure.retry_after_s == 2.0, garbage
    assert retry_after_ms_seconds("999999999999") == MAX_RETRY_AFTER_S


def test_connection_failures_are_found_in_the_cause_chain() -> None:
    def chained(cause: BaseException) -> BaseException:
        outer = RuntimeError("wrapped")
        outer.__cause__ = cause
        return outer

    assert connection_failure(chained(ConnectionRefusedError())) == Failure("refused")
    assert connection_failure(chained(ConnectionResetError())) == Failure("reset")
    assert connection_failure(OSError("unreachable")) is None


def test_retry_after_reads_seconds_and_http_dates() -> None:
    wall = 784_111_777.0  # Sun, 06 Nov 1994 08:49:37 GMT
    assert retry_after_seconds("120") == 120.0
    assert retry_after_seconds(b" 3 ") == 3.0
    assert retry_after_seconds("Sun, 06 Nov 1994 08:49:40 GMT", wall_clock=lambda: wall) == 3.0
    assert retry_after_seconds("Sun, 06 Nov 1994 08:49:00 GMT", wall_clock=lambda: wall) == 0.0
    for garbage in ("", "soon", "-1", "1.5", None, 3):
        assert retry_after_seconds(garbage) is None
