"""The four queue policies of docs/design.md together, on both twins, on a fake clock.

Each policy has its own suite (``test_queue_policies_dequeue.py``,
``test_queue_policies_admission.py``) and the lockstep state machine drives
them in combination; these are the hand-written cases where two policies
meet: which runs first, and that one service-time sample feeds both learners.
"""

from __future__ import annotations

import pytest
from _helpers import FakeClock, QueueClass, assert_conservation, assert_counters, reasons, recorder
from prazo.core import (
    NS_PER_MS,
    REASON_EVICTED,
    REASON_INSUFFICIENT_BUDGET,
    REASON_SHED,
    DeadlineExceeded,
    QueueFull,
)

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled


def test_a_critical_arrival_into_a_full_standing_line_sheds_before_it_evicts(
    impl: QueueClass, clock: FakeClock
) -> None:
    seen, on_dropped = recorder()
    q = impl(1, 2, order="adaptive", codel_target_ms=5, codel_interval_ms=100, reserved=0, on_dropped=on_dropped)
    q.acquire(now_ns=clock.ns)
    q.put("stale", now_ns=clock.ns)  # the line stops being empty here
    clock.advance(101)
    q.put("fresh", now_ns=clock.ns)
    clock.advance(1)
    # Full and standing: CoDel makes room by shedding "stale"; nobody is evicted.
    q.put("vip", critical=True, now_ns=clock.ns)
    assert reasons(seen) == [("stale", REASON_SHED, 503)]
    # Full again, nothing stale: now the newest normal waiter makes room.
    q.put("vip2", critical=True, now_ns=clock.ns)
    assert reasons(seen) == [("stale", REASON_SHED, 503), ("fresh", REASON_EVICTED, 503)]
    assert_counters(q, shed=1, evicted=1, queued=2, in_flight=1, started=1)
    assert_conservation(q.stats())


def test_critical_waiters_come_first_even_in_a_standing_lifo_line(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 4, order="adaptive", codel_target_ms=50, codel_interval_ms=10, reserved=0)
    q.acquire(now_ns=clock.ns)
    q.put("normal-old", now_ns=clock.ns)
    q.put("vip-old", critical=True, now_ns=clock.ns)
    q.put("vip-new", critical=True, now_ns=clock.ns)
    q.put("normal-new", now_ns=clock.ns)
    clock.advance(20)  # standing (past the 10 ms interval), nobody past the 50 ms target
    served = []
    critical = False
    for _ in range(4):
        q.release(critical=critical, now_ns=clock.ns)
        served.append(q.get(block=False, now_ns=clock.ns))
        critical = served[-1].startswith("vip")
    # Critical FIFO among themselves, then the normal ones newest first.
    assert served == ["vip-old", "vip-new", "normal-new", "normal-old"]
    assert_counters(q, critical_started=2, started=5, shed=0)


def test_the_doomed_work_check_applies_to_a_critical_waiter(impl: QueueClass, clock: FakeClock) -> None:
    seen, on_dropped = recorder()
    q = impl(1, 2, expected_service_ms=10.0, reserved=0, on_dropped=on_dropped)
    q.acquire(now_ns=clock.ns)
    q.put("normal", clock.deadline_in(100), now_ns=clock.ns)
    q.put("vip", clock.deadline_in(15), critical=True, now_ns=clock.ns)
    clock.advance(6)  # "vip" has 9 ms left for 10 ms of work
    q.release(now_ns=clock.ns)
    assert reasons(seen) == [("vip", REASON_INSUFFICIENT_BUDGET, 504)]
    assert q.get(block=False, now_ns=clock.ns) == "normal"
    assert_counters(q, insufficient_budget=1, critical_started=0, started=2)


def test_a_critical_arrival_without_the_budget_for_its_service_evicts_nobody(
    impl: QueueClass, clock: FakeClock
) -> None:
    seen, on_dropped = recorder()
    q = impl(1, 1, expected_service_ms=10.0, on_dropped=on_dropped)
    q.acquire(now_ns=clock.ns)
    q.put("normal", now_ns=clock.ns)
    with pytest.raises(DeadlineExceeded) as refused:
        q.put("vip", clock.deadline_in(5), critical=True, now_ns=clock.ns)
    assert refused.value.reason == REASON_INSUFFICIENT_BUDGET
    assert seen == []
    assert_counters(q, insufficient_budget=1, evicted=0, queued=1)


def test_an_evicted_item_is_reported_with_a_503(impl: QueueClass, clock: FakeClock) -> None:
    seen, on_dropped = recorder()
    q = impl(1, 1, order="adaptive", on_dropped=on_dropped)
    q.acquire(now_ns=clock.ns)
    q.put("normal", now_ns=clock.ns)
    q.put("vip", critical=True, now_ns=clock.ns)
    assert reasons(seen) == [("normal", REASON_EVICTED, 503)]
    assert isinstance(seen[0][1], QueueFull)


def test_one_service_sample_feeds_the_learned_estimate_and_the_vegas_limit(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(16, 16, expected_service_ms="p50", limit="vegas")
    assert (q.limit, q.expected_service_ns) == (4, 0)
    # Flat 20 ms service at full demand: the estimate learns 20 ms and Vegas,
    # seeing no queueing, grows the limit.
    for _ in range(12):
        starts = [q.acquire(now_ns=clock.ns) for _ in range(q.limit)]
        clock.advance(20)
        for started in starts:
            q.release(started_ns=started, now_ns=clock.ns)
    assert abs(q.expected_service_ns - 20 * NS_PER_MS) <= 20 * NS_PER_MS // 100
    assert q.limit > 4
    stats = q.stats()
    assert (stats["limit"], stats["expected_service_ns"]) == (q.limit, q.expected_service_ns)
    assert_conservation(stats)
