"""``Dependency(retry=RetryPolicy(...))``: a failed attempt is tried again through the whole kit.

A retry is a new attempt of the call: it asks the breaker for a permit and
takes a bulkhead place like any other, goes to the next endpoint, and is
made only for an idempotent call whose ``fn`` failed with a 503 that did no
work or a refused connection. The call is counted once; each attempt feeds
the histogram and the breaker.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import scripted_throttle
from _loopback import LoopbackServer
from prazo.bindings.clients.requests import DeadlineSession
from prazo.bindings.dependency import Breaker, Dependency, DependencyUnavailable, current_attempt
from prazo.bindings.retries import RetryBudget, RetryPolicy
from prazo.core import Deadline, DeadlineExceeded, DownstreamOverloaded, deadline_scope


def policy(**overrides: Any) -> RetryPolicy:
    arguments: dict[str, Any] = {
        "budget": RetryBudget(percent=1.0, min_per_s=10),
        "attempt_ms": 0.0,
        "rng": random.Random(5),
        "sleep": lambda seconds: None,
    }
    arguments.update(overrides)
    return RetryPolicy(**arguments)


class Flaky:
    """``fn``: raises each of ``failures`` in turn, then returns the endpoint it ran on."""

    def __init__(self, *failures: BaseException) -> None:
        self.failures = list(failures)
        self.endpoints: list[Any] = []
        self.lock = threading.Lock()

    def __call__(self) -> Any:
        attempt = current_attempt()
        with self.lock:
            self.endpoints.append(None if attempt is None else attempt.endpoint)
            failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure
        return "ok"


@pytest.fixture
def dependency() -> Iterator[Dependency]:
    breaker = Breaker(min_calls=20)
    dep = Dependency(
        "recs", max_concurrent=4, timeout_ms=2000, endpoints=["b-1", "b-2", "b-3"], breaker=breaker, retry=policy()
    )
    yield dep
    dep.wait_idle(10)


def test_a_503_then_success_is_retried_on_the_next_endpoint(dependency: Dependency) -> None:
    fn = Flaky(DownstreamOverloaded())
    with deadline_scope(Deadline.after(5.0)):
        result = dependency.call_detailed(fn, idempotent=True)
    assert result.value == "ok" and result.outcome == "ok"
    first, second = fn.endpoints
    assert second != first
    stats = dependency.stats()
    assert stats["calls"] == 1 and stats["outcomes"]["ok"] == 1 and stats["retries"] == 1
    breaker = dependency.breaker
    assert breaker is not None
    # Both attempts asked the breaker and told it their result.
    assert breaker.stats()["permitted"] == 2
    assert breaker.stats()["failures"] == 1 and breaker.stats()["successes"] == 1


def test_a_non_idempotent_call_is_never_retried(dependency: Dependency) -> None:
    fn = Flaky(DownstreamOverloaded())
    with pytest.raises(DownstreamOverloaded):
        dependency.call(fn)
    assert len(fn.endpoints) == 1 and dependency.stats()["retries"] == 0


def test_a_deadline_exceeded_is_never_retried(dependency: Dependency) -> None:
    fn = Flaky(DeadlineExceeded())
    # fn's own client ran out of time: a 503 dependency-timeout, and never a second attempt.
    with deadline_scope(Deadline.after(5.0)), pytest.raises(DependencyUnavailable):
        dependency.call(fn, idempotent=True)
    assert len(fn.endpoints) == 1


def test_an_application_error_is_never_retried(dependency: Dependency) -> None:
    fn = Flaky(ValueError("bad input"))
    with pytest.raises(ValueError, match="bad input"):
        dependency.call(fn, idempotent=True)
    assert len(fn.endpoints) == 1


def test_a_refused_connection_is_retried(dependency: Dependency) -> None:
    fn = Flaky(OSError("wrapped"), ConnectionRefusedError())
    fn.failures[0].__cause__ = ConnectionRefusedError()
    assert dependency.call(fn, idempotent=True) == "ok"
    assert len(fn.endpoints) == 3


def test_the_budget_refuses_and_the_last_503_comes_back() -> None:
    dep = Dependency(
        "recs", max_concurrent=2, timeout_ms=2000, retry=policy(budget=RetryBudget(percent=0, min_per_s=0))
    )
    fn = Flaky(DownstreamOverloaded())
    with pytest.raises(DownstreamOverloaded):
        dep.call(fn, idempotent=True)
    assert dep.stats()["retries_refused_by_budget"] == 1
    dep.wait_idle(10)


def test_the_deadline_refuses_a_retry_the_attempt_would_not_fit_in() -> None:
    dep = Dependency("recs", max_concurrent=2, timeout_ms=2000, retry=policy(attempt_ms=5000.0))
    fn = Flaky(DownstreamOverloaded())
    with deadline_scope(Deadline.after(1.0)), pytest.raises(DownstreamOverloaded):
        dep.call(fn, idempotent=True)
    assert dep.stats()["retries_refused_by_deadline"] == 1 and len(fn.endpoints) == 1
    dep.wait_idle(10)


def test_a_stale_value_is_served_only_once_the_retries_are_over() -> None:
    dep = Dependency("recs", max_concurrent=2, timeout_ms=2000, stale_for_s=60, retry=policy(max_attempts=2))
    assert dep.call(lambda: "fresh", key="k") == "fresh"
    fn = Flaky(DownstreamOverloaded(), DownstreamOverloaded())
    result = dep.call_detailed(fn, key="k", idempotent=True)
    assert result.stale and result.value == "fresh" and len(fn.endpoints) == 2
    dep.wait_idle(10)


def test_a_retry_takes_a_bulkhead_place() -> None:
    # One place. While the retry waits its backoff, another call takes the
    # place and holds it: the retry meets a full bulkhead, as any call would.
    release = threading.Event()
    holding = threading.Event()
    threads: list[threading.Thread] = []

    def hold() -> None:
        holding.set()
        release.wait(10)

    def take_the_place(seconds: float) -> None:
        thread = threading.Thread(target=lambda: dep.call(hold), daemon=True)
        thread.start()
        threads.append(thread)
        assert holding.wait(10)

    dep = Dependency("recs", max_concurrent=1, timeout_ms=5000, retry=policy(sleep=take_the_place))
    try:
        with pytest.raises(DependencyUnavailable) as info:
            dep.call(Flaky(DownstreamOverloaded()), idempotent=True)
        assert info.value.reason == "bulkhead-full"
        assert dep.stats()["retries"] == 1 and dep.stats()["outcomes"]["bulkhead_full"] == 1
    finally:
        release.set()
        for thread in threads:
            thread.join(10)
        dep.wait_idle(10)


def test_through_a_real_server_with_a_deadline_session() -> None:
    dep = Dependency("b", max_concurrent=4, timeout_ms=3000, retry=policy())
    session = DeadlineSession()
    with LoopbackServer() as server:
        with deadline_scope(Deadline.after(5.0)):
            status = dep.call(
                lambda: session.get(server.url("/items?fail=1&reason=queue-full")).status_code, idempotent=True
            )
        assert status == 200 and server.count == 2
        budgets = [int(r.budget_ms or "-1") for r in server.requests]
        assert budgets[0] >= budgets[1] > 0
    session.close()
    dep.wait_idle(10)


def test_retry_must_be_a_retry_policy() -> None:
    with pytest.raises(TypeError, match="retry"):
        Dependency("x", max_concurrent=1, timeout_ms=10, retry=3)  # type: ignore[arg-type]


def test_a_call_the_throttle_refuses_never_runs_and_is_served_stale_or_refused() -> None:
    throttle = scripted_throttle(True, False, False)
    dep = Dependency("recs", max_concurrent=2, timeout_ms=2000, stale_for_s=60, retry=policy(throttle=throttle))
    assert dep.call(lambda: "fresh", key="k") == "fresh"
    ran: list[str] = []
    stale = dep.call_detailed(lambda: ran.append("x"), key="k")
    assert (stale.value, stale.stale, stale.outcome) == ("fresh", True, "throttled")
    with pytest.raises(DependencyUnavailable) as refused:
        dep.call(lambda: ran.append("y"), key="other")
    assert refused.value.reason == "throttled-locally" and refused.value.status == 503
    assert ran == [] and throttle.records == [True]
    stats = dep.stats()
    assert stats["outcomes"]["throttled"] == 2 and stats["throttled_locally"] == 2 and stats["rejected"] == 2


def test_the_throttle_is_told_of_every_attempt_a_call_makes() -> None:
    # A refused attempt (a 503 that did no work), its retry refused by the throttle: one record, one refusal.
    throttle = scripted_throttle(True, False, True, True)
    dep = Dependency("recs", max_concurrent=2, timeout_ms=2000, retry=policy(max_attempts=2, throttle=throttle))
    flaky = Flaky(DownstreamOverloaded("queue-full"))
    with pytest.raises(DownstreamOverloaded):
        dep.call(flaky, idempotent=True)
    assert throttle.records == [False] and dep.stats()["throttled_locally"] == 1
    # The next call: refused once, retried, then fine — two records, the first not taken.
    flaky = Flaky(DownstreamOverloaded("queue-full"))
    assert dep.call(flaky, idempotent=True) == "ok"
    assert throttle.records == [False, False, True]
