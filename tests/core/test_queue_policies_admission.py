"""The admission policies of docs/design.md on both twins, on a fake clock.

* ``limit="vegas"``: a simulated service whose service time grows with
  concurrency (a CPU-bound app under the GIL) drives the limit down to a
  handful; a flat one (I/O-bound) drives it up to ``max_concurrency``; the
  twins compute the same limit after every sample, and it stays within
  ``[min_concurrency, max_concurrency]``.
* ``reserved`` / ``critical=True``: critical entries first, borrowing while
  the critical class is idle, eviction of the newest normal waiter.
* Service-time samples: ``acquire()`` returns the start time; ``release`` /
  ``task_done`` take ``started_ns``.
* Wrong arguments raise errors that name the argument.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import JOIN_TIMEOUT_S, FakeClock, QueueClass, assert_conservation, examples, spawn, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.core import (
    NS_PER_MS,
    REASON_EVICTED,
    REASON_EXPIRED_IN_QUEUE,
    REASON_QUEUE_FULL,
    Deadline,
    DeadlineExceeded,
    QueueFull,
)
from prazo.core._policy_py import VEGAS_WINDOW, Vegas, priority_may_start
from prazo.core._queue_py import AdmissionQueue

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

# -- a simulated service on the fake clock ---------------------------------------------

ServiceModel = Callable[[int], float]


def cpu_bound(concurrency: int) -> float:
    """ms of service for a 10 ms CPU request under the GIL: 5 ms switch slices shared round-robin."""
    return (concurrency + 1) * 5.0


def io_bound(concurrency: int) -> float:
    """ms of service for a 50 ms sleep: the same at any concurrency."""
    return 50.0


def simulate(q: AdmissionQueue, clock: FakeClock, service: ServiceModel, completions: int) -> list[int]:
    """Keep ``q`` saturated (every free slot under the limit taken at once) for ``completions``.

    Each request's service time follows ``service(in_flight at its start)``;
    requests finish in order of their end time and give their slot back with
    ``started_ns``. Returns the limit after every completion, and checks at
    each step that the limit is obeyed (invariant 2 and the current limit).
    """
    running: list[tuple[int, int, int]] = []  # (end_ns, sequence, started_ns)
    sequence = 0
    limits = []
    for _ in range(completions):
        while q.stats()["in_flight"] < q.limit:
            started = q.acquire(now_ns=clock.ns)
            end = started + round(service(q.stats()["in_flight"]) * NS_PER_MS)
            heapq.heappush(running, (end, sequence, started))
            sequence += 1
        end, _, started = heapq.heappop(running)
        clock.ns = max(clock.ns, end)
        q.release(started_ns=started, now_ns=clock.ns)
        stats = q.stats()
        assert stats["limit"] == q.limit
        assert q.min_concurrency <= q.limit <= q.max_concurrency
        assert stats["in_flight"] <= stats["max_concurrency"]
        limits.append(q.limit)
    for _, _, started in running:
        q.release(started_ns=started, now_ns=clock.ns)
    return limits


def test_vegas_settles_small_when_service_time_grows_with_concurrency(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(64, 0, limit="vegas")
    limits = simulate(q, clock, cpu_bound, 3000)
    assert_settled_small(limits[-1000:])


def assert_settled_small(settled: list[int]) -> None:
    """Mostly 1-4; after each probe of the no-load time it may overshoot by one step for a window."""
    assert sum(limit <= 4 for limit in settled) >= 0.9 * len(settled), Counter(settled)
    assert max(settled) <= 6, Counter(settled)


def test_vegas_climbs_to_the_maximum_when_service_time_is_flat(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(64, 0, limit="vegas")
    limits = simulate(q, clock, io_bound, 6000)
    assert limits[0] == 4, "the limit starts at 4"
    settled = limits[-1000:]
    # Every PROBE_EVERY windows the limit halves for one window (the probe of the no-load time).
    assert sum(limit == 64 for limit in settled) > 0.8 * len(settled), settled
    assert min(settled) >= 32


def test_vegas_tracks_a_capacity_drop(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(64, 0, limit="vegas")
    simulate(q, clock, io_bound, 4000)
    assert q.limit >= 32
    limits = simulate(q, clock, cpu_bound, 6000)
    assert_settled_small(limits[-1000:])


@pytest.mark.parametrize("service", [cpu_bound, io_bound], ids=["cpu", "io"])
def test_the_twins_move_the_limit_identically(twin_pair: tuple[QueueClass, QueueClass], service: ServiceModel) -> None:
    runs = [simulate(twin(32, 0, limit="vegas", min_concurrency=2), FakeClock(), service, 2000) for twin in twin_pair]
    assert runs[0] == runs[1]
    assert min(runs[0]) >= 2


def test_vegas_stays_within_its_bounds(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(6, 0, limit="vegas", min_concurrency=3)
    assert q.limit == 4
    assert set(simulate(q, clock, cpu_bound, 1500)) <= {3, 4, 5, 6}
    assert min(simulate(q, clock, cpu_bound, 1500)[-500:]) == 3
    pinned = impl(5, 0, limit="vegas", min_concurrency=5)
    assert set(simulate(pinned, FakeClock(), cpu_bound, 500)) == {5}


@settings(max_examples=examples(60), deadline=None)
@given(
    samples=st.lists(st.tuples(st.integers(0, 2**62), st.integers(1, 70)), min_size=1, max_size=200),
    bounds=st.tuples(st.integers(1, 70), st.integers(1, 70)).map(sorted),
)
def test_the_vegas_arithmetic_stays_in_bounds_for_any_samples(
    samples: list[tuple[int, int]], bounds: list[int]
) -> None:
    vegas = Vegas(bounds[0], bounds[1])
    for service_ns, in_flight in samples:
        assert bounds[0] <= vegas.sample(service_ns, in_flight) <= bounds[1]


def test_a_rising_limit_grants_waiting_entries_at_once(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(16, 300, limit="vegas")
    for _ in range(q.limit):
        q.acquire(now_ns=clock.ns)
    for item in range(300):
        q.put(item, now_ns=clock.ns)
    # Every slot gives back a flat 50 ms service time, at full demand: the
    # limit rises, and each rise is filled from the line in the same release.
    taken = 0
    while q.limit < 16 and q.qsize():
        clock.advance(1)
        q.release(started_ns=clock.ns - 50 * NS_PER_MS, now_ns=clock.ns)
        stats = q.stats()
        # Work conservation w.r.t. the current limit.
        assert stats["in_flight"] >= stats["limit"], stats
        while q.stats()["assigned"]:
            q.get_nowait(now_ns=clock.ns)
            taken += 1
    assert q.limit == 16
    assert q.stats()["in_flight"] == 16
    assert taken > 16
    assert_conservation(q.stats())


def test_fixed_limit_is_max_concurrency(impl: QueueClass) -> None:
    q = impl(7, 3)
    assert q.limit == 7
    assert q.stats()["limit"] == 7
    assert q.limit_policy == "fixed"
    assert impl(7, 3, limit="vegas").limit_policy == "vegas"


# -- service-time samples ----------------------------------------------------------------


def test_acquire_returns_the_start_time(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 1)
    assert q.acquire(now_ns=clock.ns) == clock.ns
    q.release(started_ns=clock.ns, now_ns=clock.advance(3))
    with q.slot(now_ns=clock.ns) as slot:
        assert slot.started_ns == clock.ns


def test_the_service_sample_is_taken_under_the_lock_before_the_hand_over(clock: FakeClock) -> None:
    seen: list[tuple[int, int, int]] = []

    class Spy(AdmissionQueue):
        def _on_service_sample(self, service_ns: int, now: int) -> None:
            seen.append((service_ns, now, self._in_flight))
            super()._on_service_sample(service_ns, now)

    q = Spy(1, 1)
    start = q.acquire(now_ns=clock.ns)
    q.put("next", now_ns=clock.ns)
    q.release(started_ns=start, now_ns=clock.advance(7))
    q.get_nowait(now_ns=clock.ns)
    q.task_done(now_ns=clock.advance(1))  # no started_ns: no sample
    q.acquire(now_ns=clock.ns)
    q.release(started_ns=clock.ns + 5, now_ns=clock.ns)  # a start after the end clamps to 0
    with q.slot():
        pass
    assert seen[:2] == [(7 * NS_PER_MS, clock.ns - NS_PER_MS, 1), (0, clock.ns, 1)]
    assert len(seen) == 3 and seen[2][0] >= 0  # the real-clock slot gave its own sample


@pytest.mark.parametrize("started_ns", [-1, 2**63])
def test_started_ns_out_of_range_is_a_value_error(impl: QueueClass, started_ns: int) -> None:
    q = impl(1, 0)
    q.acquire()
    with pytest.raises(ValueError, match="started_ns"):
        q.release(started_ns=started_ns)
    with pytest.raises(TypeError, match="started_ns"):
        q.release(started_ns="0")  # type: ignore[arg-type]
    q.release()


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"limit": "gradient"}, ValueError, "limit"),
        ({"limit": 3}, TypeError, "limit"),
        ({"limit": "vegas", "min_concurrency": 0}, ValueError, "min_concurrency"),
        ({"limit": "vegas", "min_concurrency": 5}, ValueError, "min_concurrency"),
        ({"limit": "vegas", "min_concurrency": 2.0}, TypeError, "min_concurrency"),
        ({"min_concurrency": 2}, ValueError, "min_concurrency"),
        ({"reserved": -1}, ValueError, "reserved"),
        ({"reserved": 4}, ValueError, "reserved"),
        ({"reserved": True}, TypeError, "reserved"),
        ({"on_dropped": 3}, TypeError, "on_dropped"),
        ({"on_dropped": print, "on_expired": print}, ValueError, "on_expired or on_dropped"),
    ],
)
def test_wrong_arguments_name_themselves(impl: QueueClass, kwargs: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        impl(4, 2, **kwargs)


def test_critical_must_be_a_bool(impl: QueueClass) -> None:
    q = impl(1, 1)
    for call in (q.acquire, q.slot, lambda **kw: q.put("x", **kw)):
        with pytest.raises(TypeError, match="critical"):
            call(critical="yes")
    with pytest.raises(ValueError, match="critical"):
        q.acquire()
        q.release(critical=True)
    q.release()
    assert_conservation(q.stats())


# -- priority classes --------------------------------------------------------------------


def test_critical_waiters_are_served_first(impl: QueueClass, clock: FakeClock) -> None:
    for order in ("fifo", "lifo"):
        q = impl(1, 5, order=order)
        q.acquire(now_ns=clock.ns)
        for item, critical in (("a", False), ("c1", True), ("b", False), ("c2", True)):
            q.put(item, critical=critical, now_ns=clock.ns)
        q.release(now_ns=clock.ns)
        served = []
        for _ in range(4):
            item = q.get_nowait(now_ns=clock.ns)
            served.append(item)
            q.task_done(critical=item.startswith("c"), now_ns=clock.ns)
        assert served[:2] == ["c1", "c2"]
        assert served[2:] == (["a", "b"] if order == "fifo" else ["b", "a"])
        assert q.stats()["critical_started"] == 2


def test_normal_arrivals_borrow_reserved_slots_while_the_critical_class_is_idle(
    impl: QueueClass, clock: FakeClock
) -> None:
    q = impl(3, 5, reserved=1)
    assert q.reserved == 1
    # The critical class is idle: every slot may be borrowed.
    for _ in range(3):
        q.acquire(now_ns=clock.ns)
    q.release(now_ns=clock.ns)
    q.release(now_ns=clock.ns)
    # A critical slot in use: normal arrivals keep off the reserved share.
    q.acquire(critical=True, now_ns=clock.ns)
    q.put("normal", now_ns=clock.ns)
    assert q.stats()["queued"] == 1 and q.stats()["in_flight"] == 2
    # ...while another critical arrival still gets the last slot.
    q.acquire(critical=True, now_ns=clock.ns)
    assert q.stats()["in_flight"] == 3
    q.release(critical=True, now_ns=clock.ns)
    # in_flight is back to 2 = limit - reserved, a critical slot still held: no start.
    assert q.stats()["queued"] == 1
    q.release(critical=True, now_ns=clock.ns)
    # The class is idle again: the waiting normal item borrows at once.
    assert q.get_nowait(now_ns=clock.ns) == "normal"
    assert_conservation(q.stats())


def test_a_critical_arrival_into_a_full_line_evicts_the_newest_normal_item(impl: QueueClass, clock: FakeClock) -> None:
    dropped: list[tuple[Any, BaseException]] = []
    expired: list[Any] = []
    q = impl(1, 2, on_dropped=lambda item, error: dropped.append((item, error)))
    q.acquire(now_ns=clock.ns)
    q.put("old", now_ns=clock.ns)
    q.put("new", now_ns=clock.ns)
    q.put("vip", critical=True, now_ns=clock.ns)
    assert [item for item, _ in dropped] == ["new"]
    error = dropped[0][1]
    assert isinstance(error, QueueFull) and error.reason == REASON_EVICTED and error.status == 503
    # Every waiter critical: the next critical arrival is refused as usual.
    q.put("vip2", critical=True, now_ns=clock.ns)
    with pytest.raises(QueueFull) as refused:
        q.put("vip3", critical=True, now_ns=clock.ns)
    assert refused.value.reason == REASON_QUEUE_FULL
    stats = q.stats()
    assert stats["evicted"] == 2 and stats["rejected_full"] == 1
    assert_conservation(stats)
    # on_expired is never told about evictions.
    quiet = impl(1, 1, on_expired=expired.append)
    quiet.acquire(now_ns=clock.ns)
    quiet.put("x", now_ns=clock.ns)
    quiet.put("y", critical=True, now_ns=clock.ns)
    assert expired == [] and quiet.stats()["evicted"] == 1


def test_on_dropped_hears_about_expired_items_with_their_error(impl: QueueClass, clock: FakeClock) -> None:
    dropped: list[tuple[Any, BaseException]] = []
    q = impl(1, 2, on_dropped=lambda item, error: dropped.append((item, error)))
    q.acquire(now_ns=clock.ns)
    q.put("late", clock.deadline_in(5), now_ns=clock.ns)
    clock.advance(10)
    q.release(now_ns=clock.ns)
    assert [item for item, _ in dropped] == ["late"]
    assert isinstance(dropped[0][1], DeadlineExceeded) and dropped[0][1].reason == REASON_EXPIRED_IN_QUEUE


def test_an_evicted_gate_waiter_raises_queue_full(impl: QueueClass) -> None:
    q = impl(1, 1)
    q.acquire()
    waiter = spawn(q.acquire, Deadline.after(JOIN_TIMEOUT_S))
    wait_until(lambda: q.qsize() == 1, "the gate waiter to queue")
    q.put("vip", critical=True)
    with pytest.raises(QueueFull) as evicted:
        waiter.result(JOIN_TIMEOUT_S)
    assert evicted.value.reason == REASON_EVICTED
    q.release()
    assert q.get_nowait() == "vip"
    q.task_done(critical=True)
    stats = q.stats()
    assert stats["evicted"] == 1 and stats["critical_started"] == 1 and stats["in_flight"] == 0
    assert_conservation(stats)


def test_a_critical_gate_waiter_is_served_before_older_normal_ones(impl: QueueClass) -> None:
    q = impl(1, 3)
    q.acquire()
    q.put("normal")
    critical = spawn(lambda: q.acquire(Deadline.after(JOIN_TIMEOUT_S), critical=True))
    wait_until(lambda: q.qsize() == 2, "the critical waiter to queue")
    q.release()
    assert critical.result(JOIN_TIMEOUT_S) > 0
    assert q.qsize() == 1
    q.release(critical=True)
    assert q.get_nowait() == "normal"
    q.task_done()
    assert_conservation(q.stats())


def test_a_critical_slot_context_manager_releases_its_class(impl: QueueClass) -> None:
    q = impl(2, 1, reserved=1)
    with q.slot(critical=True):
        q.put("normal")  # in_flight 1 = limit - reserved and a critical slot is held: no borrowing
        assert q.qsize() == 1
    # Released as critical: the class is idle, so the normal item borrows at once.
    assert q.get_nowait() == "normal"
    q.task_done()
    assert q.stats()["in_flight"] == 0 and q.stats()["critical_started"] == 1
    # Released as critical: the class is idle again, so normal arrivals may use both slots.
    q.acquire()
    q.acquire()
    assert q.stats()["in_flight"] == 2


@pytest.mark.parametrize(
    ("in_flight", "limit", "reserved", "critical", "active", "expected"),
    [
        (3, 4, 1, False, 1, False),
        (2, 4, 1, False, 1, True),
        (3, 4, 1, False, 0, True),
        (3, 4, 1, True, 5, True),
        (4, 4, 1, True, 0, False),
        (0, 1, 1, False, 1, False),
    ],
)
def test_priority_may_start(
    in_flight: int, limit: int, reserved: int, critical: bool, active: int, expected: bool
) -> None:
    assert priority_may_start(in_flight, limit, reserved, critical, active) is expected


def test_the_vegas_window_is_the_documented_one() -> None:
    vegas = Vegas(1, 100)
    for _ in range(VEGAS_WINDOW - 1):
        vegas.sample(10 * NS_PER_MS, 4)
    assert vegas.rtt_noload_ns == 0
    vegas.sample(10 * NS_PER_MS, 4)
    assert vegas.rtt_noload_ns == 10 * NS_PER_MS


def test_a_slot_feeds_its_own_service_time_to_the_limit(impl: QueueClass) -> None:
    """Real clock: 16 empty bodies measure the no-load time, 16 bodies of 20 ms then
    show a queue estimate of 4 (> 2): the limit backs off from 4 to 3."""
    q = impl(8, 0, limit="vegas")
    for _ in range(VEGAS_WINDOW):
        with q.slot():
            pass
    assert q.limit == 4
    for _ in range(VEGAS_WINDOW):
        with q.slot():
            time.sleep(0.02)
    assert q.limit == 3
