"""The dequeue policies of docs/design.md on both twins: doomed-work skip, adaptive LIFO + CoDel, on_dropped.

Logic runs on a fake clock (``now_ns=``); the few real-thread tests (a gate
waiter leaving at its effective deadline, a gate waiter shed) decide by the
reason raised, never by how fast anything ran.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from _helpers import (
    JOIN_TIMEOUT_S,
    FakeClock,
    QueueClass,
    assert_counters,
    examples,
    reasons,
    recorder,
    spawn,
    wait_until,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.core import (
    NS_PER_MS,
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    REASON_INSUFFICIENT_BUDGET,
    REASON_QUEUE_FULL,
    REASON_SHED,
    Deadline,
    DeadlineExceeded,
    QueueFull,
)
from prazo.core._policy_py import (
    SERVICE_MIN_SAMPLES,
    CoDel,
    ServiceEstimate,
    deadline_verdict,
    effective_deadline_ns,
)

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled


def feed(q: Any, clock: FakeClock, service_ms: float, count: int = 1) -> None:
    """``count`` gate slots, each held for ``service_ms`` on the fake clock and released with its start."""
    for _ in range(count):
        started = q.acquire(None, now_ns=clock.ns)
        assert started == clock.ns
        clock.advance(service_ms)
        q.release(now_ns=clock.ns, started_ns=started)


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"order": "newest"}, ValueError, ["order"]),
        ({"order": 3}, TypeError, ["order"]),
        ({"codel_target_ms": 10.0}, ValueError, ["codel_target_ms", "adaptive"]),
        ({"order": "lifo", "codel_interval_ms": 50}, ValueError, ["codel_interval_ms", "adaptive"]),
        ({"order": "adaptive", "codel_target_ms": 0}, ValueError, ["codel_target_ms"]),
        ({"order": "adaptive", "codel_target_ms": math.nan}, ValueError, ["codel_target_ms"]),
        ({"order": "adaptive", "codel_interval_ms": -1.0}, ValueError, ["codel_interval_ms"]),
        ({"order": "adaptive", "codel_interval_ms": math.inf}, ValueError, ["codel_interval_ms"]),
        ({"order": "adaptive", "codel_target_ms": "5"}, TypeError, ["codel_target_ms"]),
        ({"expected_service_ms": 0}, ValueError, ["expected_service_ms"]),
        ({"expected_service_ms": -3.0}, ValueError, ["expected_service_ms"]),
        ({"expected_service_ms": math.nan}, ValueError, ["expected_service_ms"]),
        ({"expected_service_ms": math.inf}, ValueError, ["expected_service_ms"]),
        ({"expected_service_ms": "p42"}, ValueError, ["expected_service_ms"]),
        ({"expected_service_ms": True}, TypeError, ["expected_service_ms"]),
        ({"expected_service_ms": [10]}, TypeError, ["expected_service_ms"]),
        ({"on_dropped": "log"}, TypeError, ["on_dropped"]),
        ({"on_dropped": print, "on_expired": print}, ValueError, ["on_dropped", "on_expired"]),
    ],
)
def test_bad_policy_arguments_name_themselves(
    impl: QueueClass, kwargs: dict[str, Any], error: type[Exception], names: list[str]
) -> None:
    with pytest.raises(error) as caught:
        impl(1, 1, **kwargs)
    for name in names:
        assert name in str(caught.value)


def test_the_codel_defaults_are_accepted_with_any_order(impl: QueueClass) -> None:
    q = impl(1, 1, order="fifo", codel_target_ms=5.0, codel_interval_ms=100)
    assert (q.order, q.codel_target_ms, q.codel_interval_ms) == ("fifo", 5.0, 100.0)


def test_the_configuration_reads_back(impl: QueueClass) -> None:
    q = impl(2, 3, order="adaptive", codel_target_ms=2, codel_interval_ms=50.5, expected_service_ms=7)
    assert (q.order, q.codel_target_ms, q.codel_interval_ms) == ("adaptive", 2.0, 50.5)
    assert q.expected_service_ms == 7.0
    assert q.expected_service_ns == 7 * NS_PER_MS
    assert q.stats()["expected_service_ns"] == 7 * NS_PER_MS
    learned = impl(1, 0, expected_service_ms="p95")
    assert (learned.expected_service_ms, learned.expected_service_ns) == ("p95", 0)
    assert impl(1, 0).expected_service_ms is None


@pytest.mark.parametrize(("value", "error"), [("1", TypeError), (True, TypeError), (1.5, TypeError), (-1, ValueError)])
def test_a_bad_started_ns_names_itself_and_keeps_the_slot(
    impl: QueueClass, clock: FakeClock, value: object, error: type[Exception]
) -> None:
    q = impl(1, 0)
    q.acquire(None, now_ns=clock.ns)
    with pytest.raises(error, match="started_ns"):
        q.release(now_ns=clock.ns, started_ns=value)  # type: ignore[arg-type]
    with pytest.raises(error, match="started_ns"):
        q.task_done(now_ns=clock.ns, started_ns=value)  # type: ignore[arg-type]
    assert_counters(q, in_flight=1, completed=0)
    q.release(now_ns=clock.ns)


# -- service-time samples --------------------------------------------------------------------


def test_acquire_returns_its_start_and_slot_records_it(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 0)
    assert q.acquire(None, now_ns=clock.ns) == clock.ns
    q.release(now_ns=clock.ns)
    with q.slot(None, now_ns=clock.ns) as slot:
        assert slot.started_ns == clock.ns


def test_a_learned_estimate_needs_32_samples(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 0, expected_service_ms="p50")
    feed(q, clock, 10, SERVICE_MIN_SAMPLES - 1)
    assert q.expected_service_ns == 0
    feed(q, clock, 10)
    assert q.expected_service_ns == 10 * NS_PER_MS
    assert q.stats()["expected_service_ns"] == 10 * NS_PER_MS


def test_releases_without_started_ns_teach_nothing(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 0, expected_service_ms="p50")
    for _ in range(64):
        q.acquire(None, now_ns=clock.ns)
        clock.advance(10)
        q.release(now_ns=clock.ns)
    assert q.expected_service_ns == 0


def test_task_done_reports_the_service_time(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 1, expected_service_ms="p99")
    for _ in range(SERVICE_MIN_SAMPLES):
        q.put("job", None, now_ns=clock.ns)
        started = clock.ns
        assert q.get(block=False, now_ns=clock.ns) == "job"
        clock.advance(4)
        q.task_done(now_ns=clock.ns, started_ns=started)
    assert q.expected_service_ns == 4 * NS_PER_MS


def test_the_estimate_forgets_generations_older_than_the_last_two(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 0, expected_service_ms="p50")
    feed(q, clock, 1, 600)
    assert q.expected_service_ns == 1 * NS_PER_MS
    feed(q, clock, 50, 512)
    assert q.expected_service_ns == 50 * NS_PER_MS


def test_a_slot_on_the_real_clock_reports_its_service_time(impl: QueueClass) -> None:
    q = impl(1, 0, expected_service_ms="p50")
    for _ in range(SERVICE_MIN_SAMPLES):
        with q.slot():
            time.sleep(0.001)
    # Every body slept at least 1 ms, so the median service time is at least that.
    assert q.expected_service_ns >= NS_PER_MS * 63 // 64


def test_a_slot_on_a_fake_clock_reports_nothing(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 0, expected_service_ms="p50")
    for _ in range(2 * SERVICE_MIN_SAMPLES):
        with q.slot(None, now_ns=clock.ns):
            pass
    assert q.expected_service_ns == 0


@settings(max_examples=examples(60), deadline=None)
@given(
    permille=st.sampled_from(["p50", "p90", "p95", "p99"]),
    samples=st.lists(
        st.one_of(st.integers(0, 200), st.integers(0, 10**9), st.sampled_from([0, 127, 128, 10**11, 10**12])),
        min_size=30,
        max_size=700,
    ),
)
def test_both_twins_learn_the_same_estimate(
    twin_pair: tuple[QueueClass, QueueClass], permille: str, samples: list[int]
) -> None:
    """The C header and the Python twin give the same integer after every sample."""
    queues = [twin(1, 0, expected_service_ms=permille) for twin in twin_pair]
    reference = ServiceEstimate(0, int(permille[1:]) * 10)
    now = 10**15
    for service_ns in samples:
        for q in queues:
            q.acquire(None, now_ns=now)
            q.release(now_ns=now + service_ns, started_ns=now)
        reference.sample(service_ns)
        assert [q.expected_service_ns for q in queues] == [reference.ns, reference.ns]


def test_the_policy_arithmetic() -> None:
    codel = CoDel(5, 100, 1000)
    assert not codel.standing(1100)
    assert codel.standing(1101)
    assert codel.max_sojourn(1100) == 100
    assert codel.max_sojourn(1101) == 5
    codel.note_empty(2000)
    assert not codel.standing(2050)
    assert effective_deadline_ns(100, 30) == 70
    assert effective_deadline_ns(-(2**63) + 5, 10) == -(2**63)
    assert [deadline_verdict(now, 100, 30) for now in (69, 70, 99, 100)] == [0, 2, 2, 1]
    assert deadline_verdict(99, 100, 0) == 0
    assert ServiceEstimate(7, 0).ns == 7


# -- doomed-work skip ----------------------------------------------------------------------------


@pytest.mark.parametrize("face", ["gate", "work"])
def test_an_arrival_without_the_budget_for_its_service_is_refused(
    impl: QueueClass, clock: FakeClock, face: str
) -> None:
    q = impl(1, 0, expected_service_ms=10)
    arrive = q.acquire if face == "gate" else (lambda d, now_ns: q.put("x", d, now_ns=now_ns))
    with pytest.raises(DeadlineExceeded) as caught:
        arrive(clock.deadline_in(10), now_ns=clock.ns)
    assert (caught.value.reason, caught.value.status) == (REASON_INSUFFICIENT_BUDGET, 504)
    with pytest.raises(DeadlineExceeded, match=REASON_EXPIRED_ON_ARRIVAL):
        arrive(clock.deadline_in(0), now_ns=clock.ns)
    arrive(clock.deadline_in(10.5), now_ns=clock.ns)
    assert_counters(q, offered=3, insufficient_budget=1, expired_on_arrival=1, in_flight=1)


def test_a_waiting_item_whose_budget_ran_short_is_skipped_at_the_hand_over(impl: QueueClass, clock: FakeClock) -> None:
    seen, on_dropped = recorder()
    q = impl(1, 3, expected_service_ms=10, on_dropped=on_dropped)
    q.acquire(None, now_ns=clock.ns)
    q.put("doomed", clock.deadline_in(30), now_ns=clock.ns)
    q.put("late", clock.deadline_in(20), now_ns=clock.ns)
    q.put("fine", clock.deadline_in(60), now_ns=clock.ns)
    clock.advance(21)
    q.release(now_ns=clock.ns)
    assert reasons(seen) == [("doomed", REASON_INSUFFICIENT_BUDGET, 504), ("late", REASON_EXPIRED_IN_QUEUE, 504)]
    assert q.get(block=False, now_ns=clock.ns) == "fine"
    assert_counters(q, insufficient_budget=1, expired_in_queue=1, started=2, queued=0)


def test_get_skips_an_assigned_item_whose_budget_ran_short(impl: QueueClass, clock: FakeClock) -> None:
    seen, on_dropped = recorder()
    q = impl(1, 1, expected_service_ms=10, on_dropped=on_dropped)
    q.put("assigned", clock.deadline_in(30), now_ns=clock.ns)
    q.put("next", clock.deadline_in(100), now_ns=clock.ns)
    clock.advance(20)
    assert q.get(block=False, now_ns=clock.ns) == "next"
    assert reasons(seen) == [("assigned", REASON_INSUFFICIENT_BUDGET, 504)]
    assert_counters(q, insufficient_budget=1, started=1, in_flight=1, assigned=0)


def test_expire_overdue_sweeps_out_the_doomed_items(impl: QueueClass, clock: FakeClock) -> None:
    told: list[Any] = []
    q = impl(1, 3, expected_service_ms=10, on_expired=told.append)
    q.acquire(None, now_ns=clock.ns)
    for name, budget in (("a", 15), ("b", 50), ("c", 12)):
        q.put(name, clock.deadline_in(budget), now_ns=clock.ns)
    clock.advance(13)  # "a" has 2 ms left for 10 ms of work; "c" is past its deadline
    # The legacy callback hears of every item that left without a slot, whatever the reason.
    assert q.expire_overdue(now_ns=clock.ns) == 2
    assert told == ["a", "c"]
    assert_counters(q, insufficient_budget=1, expired_in_queue=1, queued=1)


def test_a_gate_waiter_leaves_at_its_effective_deadline(impl: QueueClass) -> None:
    q = impl(1, 1, expected_service_ms=2500)
    q.acquire()
    deadline = Deadline.after(3.0)

    def wait() -> tuple[str, int]:
        try:
            q.acquire(deadline)
        except DeadlineExceeded as exc:
            return exc.reason, time.monotonic_ns()
        raise AssertionError("the waiter got a slot nobody released")

    waiter = spawn(wait)
    reason, left_ns = waiter.result(JOIN_TIMEOUT_S)
    # "insufficient-budget" says it left before its deadline (after it, the reason is "expired-in-queue").
    assert reason == REASON_INSUFFICIENT_BUDGET
    assert left_ns >= deadline.ns - 2500 * NS_PER_MS
    q.release()
    assert_counters(q, insufficient_budget=1, queued=0, in_flight=0)


def test_a_granted_gate_waiter_with_budget_to_spare_starts(impl: QueueClass) -> None:
    q = impl(1, 1, expected_service_ms=10)
    q.acquire()
    budget = Deadline.after(5.0)
    waiter = spawn(q.acquire, budget)
    wait_until(lambda: q.qsize() == 1, "the gate waiter to queue")
    q.release()
    assert isinstance(waiter.result(JOIN_TIMEOUT_S), int)
    assert_counters(q, started=2, insufficient_budget=0)


# -- adaptive LIFO + CoDel ----------------------------------------------------------------------


def adaptive(impl: QueueClass, max_queue: int, on_dropped: Any = None, **kwargs: Any) -> Any:
    return impl(
        1, max_queue, order="adaptive", codel_target_ms=5, codel_interval_ms=100, on_dropped=on_dropped, **kwargs
    )


def test_a_draining_line_is_fifo(impl: QueueClass, clock: FakeClock) -> None:
    q = adaptive(impl, 3)
    q.acquire(None, now_ns=clock.ns)
    for name in "abc":
        q.put(name, None, now_ns=clock.ns)
        clock.advance(1)
    q.release(now_ns=clock.ns)
    assert q.get(block=False, now_ns=clock.ns) == "a"
    assert_counters(q, shed=0, queued=2)


def test_a_standing_line_serves_the_newest_and_sheds_the_stale(impl: QueueClass, clock: FakeClock) -> None:
    seen, on_dropped = recorder()
    q = adaptive(impl, 4, on_dropped)
    q.acquire(None, now_ns=clock.ns)
    q.put("old", None, now_ns=clock.ns)  # the line is non-empty from here on
    clock.advance(98)
    q.put("young", None, now_ns=clock.ns)
    clock.advance(1)
    q.put("newest", None, now_ns=clock.ns)
    clock.advance(3)  # 102 ms standing: LIFO, and 5 ms is the longest allowed wait
    q.release(now_ns=clock.ns)
    assert reasons(seen) == [("old", REASON_SHED, 503)]
    assert isinstance(seen[0][1], QueueFull)
    assert q.get(block=False, now_ns=clock.ns) == "newest"
    assert_counters(q, shed=1, started=2, queued=1)


def test_a_full_standing_line_sheds_before_it_refuses(impl: QueueClass, clock: FakeClock) -> None:
    seen, on_dropped = recorder()
    q = adaptive(impl, 2, on_dropped)
    q.acquire(None, now_ns=clock.ns)
    q.put("old", None, now_ns=clock.ns)
    clock.advance(99)
    q.put("young", None, now_ns=clock.ns)
    clock.advance(3)
    q.put("arrival", None, now_ns=clock.ns)  # full: "old" is shed to make room
    assert reasons(seen) == [("old", REASON_SHED, 503)]
    clock.advance(1)
    with pytest.raises(QueueFull) as caught:  # full, and nothing waited longer than 5 ms
        q.put("refused", None, now_ns=clock.ns)
    assert caught.value.reason == REASON_QUEUE_FULL
    assert_counters(q, shed=1, rejected_full=1, queued=2)


def test_a_stale_entry_past_its_deadline_is_expired_not_shed(impl: QueueClass, clock: FakeClock) -> None:
    seen, on_dropped = recorder()
    q = adaptive(impl, 3, on_dropped, expected_service_ms=20)
    q.acquire(None, now_ns=clock.ns)
    q.put("expired", clock.deadline_in(50), now_ns=clock.ns)
    q.put("doomed", clock.deadline_in(115), now_ns=clock.ns)
    q.put("stale", clock.deadline_in(1000), now_ns=clock.ns)
    clock.advance(101)
    q.put("fresh", None, now_ns=clock.ns)
    clock.advance(1)
    q.release(now_ns=clock.ns)
    assert reasons(seen) == [
        ("expired", REASON_EXPIRED_IN_QUEUE, 504),
        ("doomed", REASON_INSUFFICIENT_BUDGET, 504),
        ("stale", REASON_SHED, 503),
    ]
    assert q.get(block=False, now_ns=clock.ns) == "fresh"
    assert_counters(q, expired_in_queue=1, insufficient_budget=1, shed=1, started=2)


def test_a_gate_waiter_can_be_shed(impl: QueueClass) -> None:
    q = impl(1, 1, order="adaptive", codel_target_ms=1, codel_interval_ms=20)
    q.acquire()
    waiter = spawn(q.acquire, Deadline.after(JOIN_TIMEOUT_S))
    wait_until(lambda: q.qsize() == 1, "the gate waiter to queue")
    time.sleep(0.1)  # the line stands well past its 20 ms interval, the waiter past its 1 ms target
    q.release()
    with pytest.raises(QueueFull) as caught:
        waiter.result(JOIN_TIMEOUT_S)
    assert (caught.value.reason, caught.value.status) == (REASON_SHED, 503)
    assert_counters(q, shed=1, in_flight=0, queued=0)


def test_items_shed_by_an_arrival_are_reported_before_it_waits(impl: QueueClass, clock: FakeClock) -> None:
    seen: list[Any] = []
    q = impl(1, 1, order="adaptive", codel_target_ms=5, codel_interval_ms=100, on_expired=seen.append)
    q.acquire(None, now_ns=clock.ns)
    q.put("old", None, now_ns=clock.ns)
    clock.advance(200)
    # A gate arrival on the fake clock sheds "old", then waits (on the real clock) in its place.
    # No deadline: a real one could fall before the fake clock's now on a young machine.
    waiter = spawn(q.acquire, None, now_ns=clock.ns)
    wait_until(lambda: seen == ["old"], "the shed item to be reported while its shedder waits")
    assert not waiter.done()
    q.release(now_ns=clock.ns)
    assert waiter.result(JOIN_TIMEOUT_S) > 0
    assert_counters(q, shed=1, started=2)


def test_a_callback_error_is_logged_and_the_queue_goes_on(
    impl: QueueClass, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(item: Any, error: BaseException) -> None:
        raise RuntimeError("boom")

    q = impl(1, 1, on_dropped=broken)
    q.acquire(None, now_ns=clock.ns)
    q.put("late", clock.deadline_in(1), now_ns=clock.ns)
    clock.advance(2)
    q.release(now_ns=clock.ns)
    assert "on_dropped" in caplog.text
    assert_counters(q, expired_in_queue=1, in_flight=0)
