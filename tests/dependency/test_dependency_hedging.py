"""Hedged calls: only idempotent ones, to another endpoint, first answer wins, capped, inside the bulkhead.

Real threads and real time: the first attempt of a hedged call blocks on an
event (or sleeps), the hedge answers at once. The assertions are on counts
and on which attempt answered, never on how fast.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from typing import Any

import pytest
from _helpers import JOIN_TIMEOUT_S, spawn, wait_until
from hypothesis import given
from hypothesis import strategies as st
from prazo.bindings.dependency import Attempt, Dependency, current_attempt
from prazo.bindings.dependency.hedging import HEDGE_BURST, HEDGE_MIN_SAMPLES, HedgeBudget, HedgePolicy
from prazo.core import current_deadline


class Recorder:
    """fn for hedging tests: records every attempt; the first one blocks until released."""

    def __init__(self, *, first_fails: bool = False, hedge_fails: bool = False) -> None:
        self.release = threading.Event()
        self.attempts: list[Attempt] = []
        self.deadlines: list[Any] = []
        self.lock = threading.Lock()
        self.first_fails = first_fails
        self.hedge_fails = hedge_fails

    def __call__(self, tag: Any = None) -> Any:
        attempt = current_attempt()
        assert attempt is not None
        with self.lock:
            self.attempts.append(attempt)
            self.deadlines.append(current_deadline())
        if attempt.number == 1:
            assert self.release.wait(JOIN_TIMEOUT_S)
            if self.first_fails:
                raise ConnectionError("first attempt failed")
            return ("first", attempt.endpoint, tag)
        if self.hedge_fails:
            raise ConnectionError("hedge failed")
        return ("hedge", attempt.endpoint, tag)


def test_a_non_idempotent_call_is_never_hedged() -> None:
    dep = Dependency("writes", max_concurrent=50, timeout_ms=5000, hedge=1, max_hedge_ratio=1.0, endpoints=["a", "b"])
    runs: Counter[int] = Counter()
    lock = threading.Lock()

    def write(n: int) -> int:
        with lock:
            runs[n] += 1
        time.sleep(0.05)  # far past the 1 ms hedge delay
        return n

    futures = [spawn(dep.call, write, n) for n in range(40)]
    assert sorted(future.result(JOIN_TIMEOUT_S) for future in futures) == list(range(40))
    futures = [spawn(dep.call, write, n, idempotent=False) for n in range(40, 60)]
    assert sorted(future.result(JOIN_TIMEOUT_S) for future in futures) == list(range(40, 60))
    assert dep.wait_idle(JOIN_TIMEOUT_S)
    assert runs == Counter(range(60))  # exactly one run per call
    stats = dep.stats()
    assert stats["hedges_sent"] == 0 and stats["hedges_won"] == 0 and stats["outcomes"]["ok"] == 60


def test_a_hedge_goes_to_another_endpoint_and_the_first_answer_wins() -> None:
    fn = Recorder()
    dep = Dependency(
        "recs", max_concurrent=4, timeout_ms=5000, hedge=20, max_hedge_ratio=1.0, endpoints=["a", "b", "c"]
    )
    try:
        result = dep.call_detailed(fn, "x", idempotent=True)
    finally:
        fn.release.set()
    first, hedge = fn.attempts
    assert (first.number, hedge.number) == (1, 2)
    assert first.endpoint != hedge.endpoint
    assert result.value == ("hedge", hedge.endpoint, "x")
    assert (result.outcome, result.stale, result.attempts) == ("ok", False, 2)
    # Both attempts run under the same budget.
    assert fn.deadlines[0] == fn.deadlines[1]
    assert dep.wait_idle(JOIN_TIMEOUT_S)
    stats = dep.stats()
    assert (stats["hedges_sent"], stats["hedges_won"]) == (1, 1)
    wait_until(lambda: dep.stats()["late_results"] == 1, "the loser to finish")
    assert dep.histogram.total.count == 2


def test_endpoints_rotate_so_each_hedge_targets_the_next_instance() -> None:
    dep = Dependency(
        "recs", max_concurrent=4, timeout_ms=5000, hedge=10, max_hedge_ratio=1.0, endpoints=["a", "b", "c"]
    )
    pairs = []
    for _ in range(6):
        fn = Recorder()
        try:
            dep.call(fn, idempotent=True)
        finally:
            fn.release.set()
        assert dep.wait_idle(JOIN_TIMEOUT_S)
        pairs.append(tuple(attempt.endpoint for attempt in fn.attempts))
    assert pairs == [("a", "b"), ("b", "c"), ("c", "a")] * 2


def test_the_first_attempt_still_wins_when_the_hedge_fails() -> None:
    fn = Recorder(hedge_fails=True)
    dep = Dependency("recs", max_concurrent=4, timeout_ms=5000, hedge=10, max_hedge_ratio=1.0)
    releaser = spawn(lambda: (wait_until(lambda: len(fn.attempts) == 2, "the hedge"), fn.release.set()))
    result = dep.call_detailed(fn, idempotent=True)
    releaser.result(JOIN_TIMEOUT_S)
    assert result.value == ("first", None, None) and result.attempts == 2
    assert dep.stats()["hedges_won"] == 0 and dep.stats()["hedges_sent"] == 1


def test_the_hedge_still_wins_when_the_first_attempt_fails() -> None:
    fn = Recorder(first_fails=True)
    fn.release.set()  # the first attempt fails at once...
    dep = Dependency("recs", max_concurrent=4, timeout_ms=5000, hedge=10, max_hedge_ratio=1.0)
    with pytest.raises(ConnectionError):  # ... before the hedge delay: no hedge, its error
        dep.call(fn, idempotent=True)
    assert dep.stats()["hedges_sent"] == 0

    slow_failure = Recorder(first_fails=True)
    releaser = spawn(
        lambda: (wait_until(lambda: len(slow_failure.attempts) == 2, "the hedge"), slow_failure.release.set())
    )
    result = dep.call_detailed(slow_failure, idempotent=True)
    releaser.result(JOIN_TIMEOUT_S)
    assert result.value == ("hedge", None, None)


def test_every_attempt_failing_raises_the_first_attempts_error() -> None:
    fn = Recorder(first_fails=True, hedge_fails=True)
    dep = Dependency("recs", max_concurrent=4, timeout_ms=5000, hedge=10, max_hedge_ratio=1.0)
    releaser = spawn(lambda: (wait_until(lambda: len(fn.attempts) == 2, "the hedge"), fn.release.set()))
    with pytest.raises(ConnectionError, match="first attempt failed"):
        dep.call(fn, idempotent=True)
    releaser.result(JOIN_TIMEOUT_S)
    assert dep.stats()["outcomes"]["error"] == 1


def test_hedges_are_capped_at_max_hedge_ratio_of_calls() -> None:
    dep = Dependency("recs", max_concurrent=4, timeout_ms=5000, hedge=1, max_hedge_ratio=0.1)
    for _ in range(100):
        dep.call(time.sleep, 0.01, idempotent=True)
    stats = dep.stats()
    assert 5 <= stats["hedges_sent"] <= 10  # every call wanted a hedge; one in ten may have one
    assert stats["outcomes"]["ok"] == 100


def test_max_hedge_ratio_zero_turns_hedging_off() -> None:
    dep = Dependency("recs", max_concurrent=4, timeout_ms=5000, hedge=1, max_hedge_ratio=0)
    for _ in range(5):
        dep.call(time.sleep, 0.01, idempotent=True)
    assert dep.stats()["hedges_sent"] == 0


def test_hedges_count_against_the_bulkhead() -> None:
    dep = Dependency("recs", max_concurrent=1, timeout_ms=5000, hedge=5, max_hedge_ratio=1.0)
    for _ in range(3):
        assert dep.call(lambda: time.sleep(0.05) or "only", idempotent=True) == "only"
    assert dep.stats()["hedges_sent"] == 0  # the first attempt holds the only place

    # One place held by a slow write, the other by the first attempt: no room for its hedge.
    dep = Dependency("recs", max_concurrent=2, timeout_ms=5000, hedge=5, max_hedge_ratio=1.0)
    write_done = threading.Event()
    writing = spawn(dep.call, write_done.wait, JOIN_TIMEOUT_S)
    wait_until(lambda: dep.stats()["in_flight"] == 1, "the write to start")
    fn = Recorder()
    releaser = spawn(lambda: (time.sleep(0.1), fn.release.set()))
    assert dep.call(fn, idempotent=True) == ("first", None, None)
    releaser.result(JOIN_TIMEOUT_S)
    assert len(fn.attempts) == 1 and dep.stats()["hedges_sent"] == 0
    write_done.set()
    assert writing.result(JOIN_TIMEOUT_S) is True
    # With the place free again the same call is hedged.
    fn = Recorder()
    try:
        assert dep.call(fn, idempotent=True) == ("hedge", None, None)
    finally:
        fn.release.set()
    assert dep.stats()["hedges_sent"] == 1


def test_a_quantile_hedge_waits_for_enough_samples() -> None:
    dep = Dependency("recs", max_concurrent=4, timeout_ms=5000, hedge="p95", max_hedge_ratio=1.0)
    fn = Recorder()
    releaser = spawn(lambda: (time.sleep(0.1), fn.release.set()))
    assert dep.call(fn, idempotent=True) == ("first", None, None)  # no samples yet: no hedge
    releaser.result(JOIN_TIMEOUT_S)
    assert dep.stats()["hedges_sent"] == 0
    for _ in range(HEDGE_MIN_SAMPLES):
        dep.call(lambda: "fast")
    time.sleep(0.15)  # past the live-quantile snapshot (100 ms)
    fn = Recorder()
    try:
        assert dep.call(fn, idempotent=True) == ("hedge", None, None)
    finally:
        fn.release.set()
    assert dep.stats()["hedges_won"] == 1


def test_hedge_budget_is_a_token_bucket() -> None:
    budget = HedgeBudget(0.25, burst=2)
    assert not budget.take()
    for _ in range(3):
        budget.credit()
    assert not budget.take()
    budget.credit()
    assert budget.take() and not budget.take()
    for _ in range(100):
        budget.credit()
    assert budget.tokens == 2
    assert budget.take() and budget.take() and not budget.take()
    budget.refund()
    assert budget.take()


def test_hedge_policy_parses_its_argument() -> None:
    assert not HedgePolicy(None).enabled
    assert HedgePolicy("p99").enabled and HedgePolicy(2.5).enabled
    with pytest.raises(ValueError, match="hedge"):
        HedgePolicy("95")


@given(
    ratio=st.floats(0, 1),
    steps=st.lists(st.sampled_from(["credit", "take", "refund-if-taken"]), max_size=300),
)
def test_hedges_never_exceed_the_ratio_of_calls(ratio: float, steps: list[str]) -> None:
    budget = HedgeBudget(ratio)
    credits = taken = 0
    for step in steps:
        if step == "credit":
            budget.credit()
            credits += 1
        elif step == "take":
            taken += budget.take()
        elif taken and budget.tokens <= HEDGE_BURST - 1:
            budget.refund()  # a hedge taken but never started gives its token back
            taken -= 1
        assert 0 <= budget.tokens <= HEDGE_BURST
        assert taken <= math.floor(round(ratio * 1_000_000) * credits / 1_000_000)
