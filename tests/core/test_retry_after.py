"""The line's measured wait for a refused caller (``retry_after_ns``) on both twins, on a fake clock.

The wait is the line ahead (waiting entries + 1) at the measured time
between completions, sampled at arrivals in windows of 250 ms
(docs/design.md, "Retry-After from the drain rate"): 0 before the first
sample, never below one interval, never above 60 s; a window with work
running and nothing freed stays open, then counts as one slow interval; a
window that spanned a quiet stretch is dropped. The twins give the same
integers for the same calls.
"""

from __future__ import annotations

import queue as stdlib_queue

import pytest
from _helpers import FakeClock, QueueClass, examples
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.core import NS_PER_MS, DeadlineExceeded, QueueFull
from prazo.core._policy_py import (
    DRAIN_STALE_WINDOWS,
    DRAIN_WINDOW_NS,
    RETRY_AFTER_MAX_NS,
    DrainRate,
    retry_after_ns,
)
from prazo.core._queue_py import AdmissionQueue


def arrive(q: AdmissionQueue, clock: FakeClock) -> bool:
    """Offer one item at the fake now; False when the line refused it."""
    try:
        q.put(object(), now_ns=clock.ns)
    except QueueFull:
        return False
    return True


def finish_one(q: AdmissionQueue, clock: FakeClock) -> bool:
    """Take the next assigned item and finish it at the fake now; False when none was assigned."""
    try:
        q.get_nowait(now_ns=clock.ns)
    except stdlib_queue.Empty:
        return False
    q.task_done(now_ns=clock.ns)
    return True


def saturate(q: AdmissionQueue, clock: FakeClock, *, seconds: float, arrival_ms: float, finish_every: int) -> None:
    """Arrivals every ``arrival_ms``, one completion every ``finish_every`` arrivals, for ``seconds``."""
    for step in range(round(seconds * 1000 / arrival_ms)):
        clock.advance(arrival_ms)
        arrive(q, clock)
        if step % finish_every == 0:
            finish_one(q, clock)


def test_no_wait_is_suggested_before_the_line_has_measured_its_drain(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(2, 3)
    assert q.retry_after_ns == 0
    for _ in range(6):
        arrive(q, clock)  # two start, three wait, one is refused: no window has closed yet
    assert q.stats()["rejected_full"] == 1
    assert q.retry_after_ns == 0


def test_the_wait_is_the_line_ahead_at_the_measured_interval(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(2, 3)
    # A completion every 100 ms (every second arrival, 50 ms apart): the line stays full.
    saturate(q, clock, seconds=3, arrival_ms=50, finish_every=2)
    assert q.qsize() == 3
    assert q.stats()["rejected_full"] > 0
    per_place = q.retry_after_ns / (q.qsize() + 1)
    assert 90 * NS_PER_MS <= per_place <= 110 * NS_PER_MS


def test_a_faster_drain_asks_for_a_shorter_wait(impl: QueueClass) -> None:
    waits = []
    for finish_every in (4, 1):  # a completion every 200 ms, then every 50 ms
        clock = FakeClock()
        q = impl(2, 3)
        saturate(q, clock, seconds=3, arrival_ms=50, finish_every=finish_every)
        waits.append(q.retry_after_ns)
    assert waits[0] > 3 * waits[1]


def test_a_window_with_nothing_freed_stays_open_then_counts_as_one_slow_interval(
    impl: QueueClass, clock: FakeClock
) -> None:
    q = impl(1, 3)
    arrive(q, clock)  # holds the only place and never finishes; the first arrival opens the window
    for _ in range(DRAIN_STALE_WINDOWS * 4):
        clock.advance(DRAIN_WINDOW_NS / NS_PER_MS / 4)
        arrive(q, clock)
        assert q.retry_after_ns == 0, "the window stays open while nothing is freed"
    clock.advance(1)
    arrive(q, clock)
    slow = DRAIN_STALE_WINDOWS * DRAIN_WINDOW_NS + NS_PER_MS  # what elapsed since the window opened
    assert q.retry_after_ns == (q.qsize() + 1) * slow


def test_a_window_that_spanned_a_quiet_stretch_is_dropped(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(2, 3)
    saturate(q, clock, seconds=2, arrival_ms=50, finish_every=2)
    measured = q.retry_after_ns // (q.qsize() + 1)
    assert measured > 0
    # No arrival for 10 s while the line finishes what it holds: one window of 10 s with completions.
    clock.advance(10_000)
    while finish_one(q, clock):
        pass
    arrive(q, clock)
    assert q.retry_after_ns == (q.qsize() + 1) * measured


def test_a_clock_behind_the_window_opens_a_new_one(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(2, 3)
    saturate(q, clock, seconds=2, arrival_ms=50, finish_every=2)
    measured = q.retry_after_ns // (q.qsize() + 1)
    earlier = FakeClock(clock.ns - 60_000 * NS_PER_MS)
    arrive(q, earlier)
    assert q.retry_after_ns // (q.qsize() + 1) == measured


@given(interval=st.integers(0, 2 * RETRY_AFTER_MAX_NS), queued=st.integers(-5, 10**12))
@settings(max_examples=examples(200))
def test_the_wait_is_never_below_one_interval_nor_above_the_cap(interval: int, queued: int) -> None:
    wait = retry_after_ns(interval, queued)
    if interval == 0:
        assert wait == 0
    else:
        assert wait == min(interval * (max(queued, 0) + 1), RETRY_AFTER_MAX_NS)
        assert min(interval, RETRY_AFTER_MAX_NS) <= wait <= RETRY_AFTER_MAX_NS


@given(
    steps=st.lists(st.tuples(st.integers(0, 2 * DRAIN_WINDOW_NS), st.integers(0, 20), st.integers(0, 8)), max_size=60)
)
@settings(max_examples=examples(200))
def test_the_interval_is_a_mean_of_what_the_windows_measured(steps: list[tuple[int, int, int]]) -> None:
    drain, now, completed = DrainRate(), 10**12, 0
    longest = 0
    for elapsed, freed, in_flight in steps:
        now += elapsed
        completed += freed
        before = drain.mark_ns
        interval = drain.note(now, completed, in_flight)
        if before:
            longest = max(longest, now - before)
        assert 0 <= interval <= max(longest, 0)


OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["arrive", "finish"]), st.integers(0, 400)),
    max_size=120,
)


@pytest.mark.compiled
@given(operations=OPERATIONS)
@settings(max_examples=examples(100), deadline=None)
def test_the_twins_suggest_the_same_wait(twin_pair: tuple[QueueClass, QueueClass], operations: list) -> None:
    clocks = [FakeClock(), FakeClock()]
    queues = [cls(2, 4) for cls in twin_pair]
    for operation, ms in operations:
        outcomes = []
        for q, clock in zip(queues, clocks):
            clock.advance(ms)
            outcomes.append(arrive(q, clock) if operation == "arrive" else finish_one(q, clock))
        assert outcomes[0] == outcomes[1]
        assert queues[0].retry_after_ns == queues[1].retry_after_ns


@pytest.mark.compiled
def test_the_twins_agree_at_the_ends_of_the_clock(twin_pair: tuple[QueueClass, QueueClass]) -> None:
    # A caller's clock may jump anywhere in int64: no overflow, and both twins read it alike.
    int64_max = 2**63 - 1
    queues = [cls(1, 2) for cls in twin_pair]
    for now in (-(2**63), 0, 1, int64_max - 1, -(2**63), int64_max):
        for q in queues:
            try:
                q.put(object(), now_ns=now)
            except (QueueFull, DeadlineExceeded):  # at INT64_MAX even "no deadline" has passed
                pass
        assert queues[0].retry_after_ns == queues[1].retry_after_ns
        assert 0 <= queues[0].retry_after_ns <= RETRY_AFTER_MAX_NS
