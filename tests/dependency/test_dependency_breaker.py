"""A ``Dependency`` and its ``Breaker``: slowness and errors open it, open means refused, permits balance.

Time logic runs on a fake clock shared by the dependency and the breaker:
``fn`` "takes" 100 ms by moving the clock, so a slow call is slow without
sleeping. The property test at the end runs random schedules on real threads
and checks the invariants every call must keep.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from _helpers import JOIN_TIMEOUT_S, CheckedThread, SecondsClock, examples, run_checked, spawn, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prazo.bindings.dependency import (
    REASON_BREAKER_OPEN,
    Breaker,
    Dependency,
    DependencyUnavailable,
)
from prazo.core import NS_PER_MS


class CountingBreaker(Breaker):
    """A Breaker that counts its permits and what became of each."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.counts = {"granted": 0, "refused": 0, "success": 0, "failure": 0, "release": 0}
        self.durations: list[int] = []
        self._count_lock = threading.Lock()

    def _count(self, what: str) -> None:
        with self._count_lock:
            self.counts[what] += 1

    def try_acquire(self, now_ns: int | None = None) -> bool:
        granted = super().try_acquire(now_ns)
        self._count("granted" if granted else "refused")
        return granted

    def on_success(self, duration_ns: int, now_ns: int | None = None) -> None:
        self.durations.append(duration_ns)
        self._count("success")
        super().on_success(duration_ns, now_ns)

    def on_failure(self, duration_ns: int, now_ns: int | None = None) -> None:
        self.durations.append(duration_ns)
        self._count("failure")
        super().on_failure(duration_ns, now_ns)

    def release(self, now_ns: int | None = None) -> None:
        self._count("release")
        super().release(now_ns)

    def settled(self) -> bool:
        """Every permit granted was answered exactly once."""
        counts = self.counts
        return counts["granted"] == counts["success"] + counts["failure"] + counts["release"]


def test_the_breaker_opens_on_slowness_alone() -> None:
    clock = SecondsClock()
    breaker = CountingBreaker(window=10, min_calls=5, slow_call_ms=50, slow_rate=0.5, open_for_s=5, clock=clock)
    dep = Dependency("recs", max_concurrent=4, timeout_ms=5000, breaker=breaker, clock=clock, stale_for_s=600)
    dep.call(lambda: "good", key="k")
    calls = []

    def slow_but_fine() -> str:
        calls.append(1)
        clock.advance(0.1)  # 100 ms on the dependency's clock: slow, and successful
        return "slow"

    for _ in range(4):
        assert dep.call(slow_but_fine) == "slow"
    assert dep.stats()["breaker_state"] == "open"
    assert max(breaker.durations) == 100 * NS_PER_MS
    # Open: the call is refused without running fn, and served stale or refused with a 503.
    result = dep.call_detailed(slow_but_fine, key="k")
    assert (result.value, result.stale, result.outcome, result.attempts) == ("good", True, "breaker_open", 0)
    with pytest.raises(DependencyUnavailable) as caught:
        dep.call(slow_but_fine)
    assert caught.value.reason == REASON_BREAKER_OPEN and caught.value.status == 503
    assert len(calls) == 4
    stats = dep.stats()
    assert stats["outcomes"]["breaker_open"] == 2 and stats["rejected"] == 2 and stats["outcomes"]["error"] == 0
    # After open_for_s it lets probes through, and fast answers close it again.
    clock.advance(5)
    for _ in range(3):
        assert dep.call(lambda: "fast") == "fast"
    assert dep.stats()["breaker_state"] == "closed"
    assert breaker.settled()


def test_the_breaker_opens_on_errors_alone() -> None:
    clock = SecondsClock()
    breaker = Breaker(window=10, min_calls=4, failure_rate=0.5, slow_call_ms=1000, clock=clock)
    dep = Dependency("recs", max_concurrent=4, timeout_ms=5000, breaker=breaker, clock=clock)

    def fails_fast() -> None:
        raise ConnectionError("refused")

    for _ in range(4):
        with pytest.raises(ConnectionError):
            dep.call(fails_fast)
    assert breaker.state == "open" == dep.stats()["breaker_state"]
    with pytest.raises(DependencyUnavailable, match="breaker-open"):
        dep.call(fails_fast)


def test_a_timeout_counts_as_a_failure_when_it_happens_even_if_fn_never_returns() -> None:
    release = threading.Event()
    breaker = CountingBreaker(window=4, min_calls=2, failure_rate=0.5, slow_call_ms=10_000)
    dep = Dependency("hung", max_concurrent=4, timeout_ms=50, breaker=breaker)
    try:
        for _ in range(2):
            with pytest.raises(DependencyUnavailable, match="dependency-timeout"):
                dep.call(release.wait, JOIN_TIMEOUT_S)
        # Both calls still hang, and the breaker already knows.
        assert dep.stats()["in_flight"] == 2
        assert breaker.counts["failure"] == 2 and breaker.state == "open"
    finally:
        release.set()
    assert dep.wait_idle(JOIN_TIMEOUT_S)
    wait_until(lambda: dep.stats()["late_results"] == 2, "the late results")
    assert breaker.counts["success"] == 0  # reported once, at the timeout, never again
    assert breaker.settled()


def test_a_caller_deadline_leaves_the_verdict_to_the_real_duration() -> None:
    from prazo.core import Deadline, DeadlineExceeded, deadline_scope

    release, started = threading.Event(), threading.Event()

    def hang() -> bool:
        started.set()
        return release.wait(JOIN_TIMEOUT_S)

    breaker = CountingBreaker(window=4, min_calls=1, failure_rate=0.5, slow_call_ms=10_000)
    dep = Dependency("ok-but-caller-late", max_concurrent=2, timeout_ms=5000, breaker=breaker)
    # Budget enough that a stalled test thread still gets fn started (a budget
    # under 1 ms at the call is refused before fn runs, which is another test).
    with deadline_scope(Deadline.after_ms(300)), pytest.raises(DeadlineExceeded) as raised:
        dep.call(hang)
    assert raised.value.reason != "no-budget-for-downstream" and started.is_set()
    assert breaker.counts["failure"] == 0  # the caller ran out, not the dependency
    release.set()
    assert dep.wait_idle(JOIN_TIMEOUT_S)
    wait_until(lambda: breaker.counts["success"] == 1, "the real result to reach the breaker")
    assert breaker.state == "closed" and breaker.settled()


def test_a_bulkhead_rejection_hands_the_permit_back() -> None:
    release = threading.Event()
    breaker = CountingBreaker()
    dep = Dependency("full", max_concurrent=1, timeout_ms=5000, breaker=breaker)
    holding = spawn(dep.call, release.wait, JOIN_TIMEOUT_S)
    wait_until(lambda: dep.stats()["in_flight"] == 1, "the place to be taken")
    with pytest.raises(DependencyUnavailable, match="bulkhead-full"):
        dep.call(release.wait, JOIN_TIMEOUT_S)
    assert breaker.counts["release"] == 1
    release.set()
    assert holding.result(JOIN_TIMEOUT_S) is True
    assert breaker.settled()


# -- invariants under random schedules (real threads) --------------------------

BEHAVIOURS = ("ok", "raise", "sleep", "hang", "base")


class Interrupt(BaseException):
    pass


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_concurrent=st.integers(1, 4),
    callers=st.integers(1, 6),
    plan=st.lists(st.tuples(st.sampled_from(BEHAVIOURS), st.booleans(), st.booleans()), min_size=1, max_size=30),
    seed=st.integers(0, 2**16),
)
def test_every_call_has_one_outcome_and_the_bulkhead_holds(
    max_concurrent: int, callers: int, plan: list[tuple[str, bool, bool]], seed: int
) -> None:
    rng = random.Random(seed)
    release = threading.Event()
    breaker = CountingBreaker(window=8, min_calls=4, failure_rate=0.5, slow_call_ms=15, open_for_s=0.02)
    dep = Dependency(
        "random",
        max_concurrent=max_concurrent,
        timeout_ms=20,
        stale_for_s=60,
        breaker=breaker,
        hedge=2,
        max_hedge_ratio=0.5,
        endpoints=["a", "b"],
        thread_idle_s=0.05,
    )
    ran = 0
    ran_lock = threading.Lock()

    def fn(behaviour: str) -> str:
        nonlocal ran
        with ran_lock:
            ran += 1
        if behaviour == "raise":
            raise ConnectionError("down")
        if behaviour == "sleep":
            time.sleep(rng.random() * 0.03)
        elif behaviour == "hang":
            release.wait(JOIN_TIMEOUT_S)
        elif behaviour == "base":
            raise Interrupt
        return behaviour

    peak = {"in_flight": 0, "threads": 0}
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            stats = dep.stats()
            peak["in_flight"] = max(peak["in_flight"], stats["in_flight"])
            peak["threads"] = max(peak["threads"], stats["threads"])
            time.sleep(0.001)

    watcher = CheckedThread(target=watch)
    watcher.start()
    lock = threading.Lock()
    pending = list(plan)

    def caller() -> None:
        while True:
            with lock:
                if not pending:
                    return
                behaviour, keyed, idempotent = pending.pop()
            try:
                dep.call(fn, behaviour, key="k" if keyed else None, idempotent=idempotent)
            except (ConnectionError, DependencyUnavailable, Interrupt):
                pass

    # Any other error a caller meets fails the test here (run_checked re-raises it).
    run_checked([caller] * callers)
    release.set()
    assert dep.wait_idle(JOIN_TIMEOUT_S)
    watching.set()
    watcher.join(JOIN_TIMEOUT_S)

    stats = dep.stats()
    assert stats["calls"] == len(plan)
    assert sum(stats["outcomes"].values()) == len(plan)
    assert stats["rejected"] == stats["outcomes"]["bulkhead_full"] + stats["outcomes"]["breaker_open"]
    assert peak["in_flight"] <= max_concurrent and peak["threads"] <= max_concurrent
    assert stats["hedges_won"] <= stats["hedges_sent"] <= stats["calls"]
    # fn ran once per started attempt: one per call that was not refused, plus the hedges.
    refused = stats["outcomes"]["bulkhead_full"] + stats["outcomes"]["breaker_open"]
    assert ran == len(plan) - refused + stats["hedges_sent"]
    assert stats["in_flight"] == 0
    assert dep.histogram.total.count == ran
    wait_until(breaker.settled, "every breaker permit to be answered")
