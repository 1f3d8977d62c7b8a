"""What ``AdmissionQueue`` answers, operation by operation, on both twins.

Work items and every non-blocking gate call run on a fake clock (``now_ns``),
so each deadline passes exactly when the test says. The few tests that need a
gate waiter use real threads with generous margins: they check *that* a waiter
is woken with the right outcome, never how fast.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import (
    COUNTER_NAMES,
    JOIN_TIMEOUT_S,
    FakeClock,
    QueueClass,
    assert_conservation,
    assert_counters,
    needs_the_gil,
    spawn,
    wait_until,
)
from prazo.core import (
    NS_PER_MS,
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    REASON_QUEUE_FULL,
    Deadline,
    DeadlineExceeded,
    QueueFull,
    ShutDown,
)
from prazo.core._queue_py import AdmissionQueue

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

FACES = ("gate", "work")
ORDERS = ("fifo", "lifo")

STATS_KEYS = {*COUNTER_NAMES, "expired", "max_concurrency", "max_queue", "expected_service_ns", "limit"}


def arrive(q: AdmissionQueue, face: str, deadline: Deadline | None, clock: FakeClock) -> None:
    """One arrival through ``face``: a gate ``acquire`` or a work-queue ``put``."""
    if face == "gate":
        q.acquire(deadline, now_ns=clock.ns)
    else:
        q.put(object(), deadline, now_ns=clock.ns)


def drain(q: AdmissionQueue, clock: FakeClock) -> list[Any]:
    """Take and finish every item the queue will still hand out."""
    taken = []
    while True:
        try:
            taken.append(q.get(block=False, now_ns=clock.ns))
        except (queue.Empty, ShutDown):
            return taken
        q.task_done(now_ns=clock.ns)


# -- the four outcomes of an arrival, on both faces ----------------------------------


@pytest.mark.parametrize("face", FACES)
def test_an_arrival_with_a_free_slot_takes_it_at_once(impl: QueueClass, clock: FakeClock, face: str) -> None:
    q = impl(2, 1)
    arrive(q, face, clock.deadline_in(100), clock)
    holding = {"gate": {"started": 1, "assigned": 0}, "work": {"started": 0, "assigned": 1}}[face]
    assert_counters(q, offered=1, in_flight=1, queued=0, **holding)
    assert not q.full()


@pytest.mark.parametrize("face", FACES)
def test_an_arrival_waits_when_every_slot_is_taken(impl: QueueClass, clock: FakeClock, face: str) -> None:
    q = impl(1, 2)
    q.acquire(None, now_ns=clock.ns)
    if face == "gate":
        future = spawn(q.acquire, Deadline.after(JOIN_TIMEOUT_S))
        wait_until(lambda: q.qsize() == 1, "the gate waiter to queue")
        assert not future.done()
        q.release()
        assert isinstance(future.result(JOIN_TIMEOUT_S), int)  # acquire() returns its start time
    else:
        q.put("waiting", clock.deadline_in(100), now_ns=clock.ns)
        assert q.qsize() == 1
        assert_counters(q, queued=1, peak_queued=1, in_flight=1)
        q.release(now_ns=clock.ns)
        assert q.get(block=False, now_ns=clock.ns) == "waiting"
    assert_counters(q, started=2, completed=1, in_flight=1, queued=0)


@pytest.mark.parametrize("face", FACES)
def test_an_arrival_is_refused_at_once_when_the_line_is_full(impl: QueueClass, clock: FakeClock, face: str) -> None:
    q = impl(1, 1)
    q.acquire(None, now_ns=clock.ns)
    q.put("waiting", None, now_ns=clock.ns)
    assert q.full()
    with pytest.raises(QueueFull) as info:
        arrive(q, face, clock.deadline_in(100), clock)
    assert info.value.reason == REASON_QUEUE_FULL
    assert info.value.status == 503
    assert_counters(q, offered=3, rejected_full=1, queued=1, in_flight=1)


@pytest.mark.parametrize("budget_ms", [0, -0.000_001, -1, -60_000])
@pytest.mark.parametrize("face", FACES)
def test_an_arrival_past_its_deadline_never_starts_even_with_a_free_slot(
    impl: QueueClass, clock: FakeClock, face: str, budget_ms: float
) -> None:
    expired: list[Any] = []
    q = impl(1, 1, on_expired=expired.append)
    with pytest.raises(DeadlineExceeded) as info:
        arrive(q, face, clock.deadline_in(budget_ms), clock)
    assert info.value.reason == REASON_EXPIRED_ON_ARRIVAL
    assert info.value.status == 504
    assert_counters(q, offered=1, expired_on_arrival=1, in_flight=0, started=0, assigned=0)
    # The caller already got the exception; on_expired is for items that waited.
    assert expired == []


@pytest.mark.parametrize("face", FACES)
def test_an_expired_arrival_is_a_deadline_error_even_when_the_line_is_full(
    impl: QueueClass, clock: FakeClock, face: str
) -> None:
    q = impl(1, 0)
    q.acquire(None, now_ns=clock.ns)
    with pytest.raises(DeadlineExceeded):
        arrive(q, face, clock.deadline_in(-1), clock)
    assert_counters(q, rejected_full=0, expired_on_arrival=1)


@pytest.mark.parametrize("face", FACES)
def test_max_queue_zero_is_a_bulkhead_with_no_waiting(impl: QueueClass, clock: FakeClock, face: str) -> None:
    q = impl(2, 0)
    assert q.max_queue == 0
    arrive(q, face, None, clock)
    arrive(q, face, None, clock)
    with pytest.raises(QueueFull):
        arrive(q, face, None, clock)
    if face == "work":
        q.get(block=False, now_ns=clock.ns)
    q.release(now_ns=clock.ns)
    arrive(q, face, None, clock)
    assert_counters(q, offered=4, rejected_full=1, in_flight=2, peak_queued=0)


# -- hand-over ---------------------------------------------------------------------------


@pytest.mark.parametrize(("order", "expected"), [("fifo", "abcd"), ("lifo", "adcb")])
def test_a_freed_slot_goes_to_the_oldest_or_the_newest_waiter(
    impl: QueueClass, clock: FakeClock, order: str, expected: str
) -> None:
    q = impl(1, 5, order=order)
    assert q.order == order
    for name in "abcd":
        q.put(name, clock.deadline_in(1000), now_ns=clock.ns)
        clock.advance(1)
    assert "".join(drain(q, clock)) == expected
    assert_counters(q, started=4, completed=4, in_flight=0, queued=0)


def test_a_gate_release_hands_the_slot_to_a_waiting_work_item(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 1)
    q.acquire(None, now_ns=clock.ns)
    q.put("next", None, now_ns=clock.ns)
    q.release(now_ns=clock.ns)
    assert_counters(q, in_flight=1, assigned=1, queued=0)
    assert q.get(block=False, now_ns=clock.ns) == "next"


@pytest.mark.parametrize("order", ORDERS)
def test_waiters_that_expired_are_skipped_at_hand_over_and_reported(
    impl: QueueClass, clock: FakeClock, order: str
) -> None:
    expired: list[Any] = []
    q = impl(1, 4, order=order, on_expired=expired.append)
    q.put("running", None, now_ns=clock.ns)
    q.put("short-1", clock.deadline_in(10), now_ns=clock.ns)
    q.put("live", clock.deadline_in(100), now_ns=clock.ns)
    q.put("short-2", clock.deadline_in(10), now_ns=clock.ns)
    assert q.get(block=False, now_ns=clock.ns) == "running"
    clock.advance(10)
    q.task_done(now_ns=clock.ns)
    # The short item at the served end of the line is dead: it is reported and
    # skipped, and the slot goes on to the live one behind it.
    expected_expired = ["short-1"] if order == "fifo" else ["short-2"]
    assert expired == expected_expired
    assert q.get(block=False, now_ns=clock.ns) == "live"
    assert_counters(q, expired_in_queue=1, started=2, queued=1)
    q.task_done(now_ns=clock.ns)
    assert expired == (["short-1", "short-2"] if order == "fifo" else ["short-2", "short-1"])
    assert_counters(q, expired_in_queue=2, in_flight=0, queued=0)


def test_an_item_that_expired_after_its_slot_was_assigned_is_reported_by_get(
    impl: QueueClass, clock: FakeClock
) -> None:
    expired: list[Any] = []
    q = impl(1, 2, on_expired=expired.append)
    q.put("assigned", clock.deadline_in(10), now_ns=clock.ns)
    q.put("behind", clock.deadline_in(100), now_ns=clock.ns)
    assert_counters(q, assigned=1, queued=1)
    clock.advance(10)
    # The assigned item is dead by pickup: get reports it, passes the slot on
    # and returns the next live item in the same call.
    assert q.get(block=False, now_ns=clock.ns) == "behind"
    assert expired == ["assigned"]
    assert_counters(q, expired_in_queue=1, started=1, in_flight=1, assigned=0)


def test_get_frees_the_slot_of_a_dead_item_when_nobody_waits(impl: QueueClass, clock: FakeClock) -> None:
    expired: list[Any] = []
    q = impl(1, 2, on_expired=expired.append)
    q.put("alone", clock.deadline_in(5), now_ns=clock.ns)
    clock.advance(5)
    with pytest.raises(queue.Empty):
        q.get(block=False, now_ns=clock.ns)
    assert expired == ["alone"]
    assert_counters(q, in_flight=0, assigned=0, started=0)


# -- the work-queue face in detail ------------------------------------------------------------


def test_get_on_an_empty_queue_raises_empty(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 1)
    with pytest.raises(queue.Empty):
        q.get(block=False, now_ns=clock.ns)
    with pytest.raises(queue.Empty):
        q.get_nowait(now_ns=clock.ns)
    started = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert time.monotonic() - started >= 0.04


@pytest.mark.parametrize(("timeout", "error"), [(-1, ValueError), (float("nan"), ValueError), ("1", TypeError)])
def test_get_refuses_a_bad_timeout(impl: QueueClass, timeout: Any, error: type) -> None:
    with pytest.raises(error, match="timeout"):
        impl(1, 1).get(timeout=timeout)


def test_put_nowait_is_put(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 0)
    q.put_nowait("x", None, now_ns=clock.ns)
    with pytest.raises(QueueFull):
        q.put_nowait("y", None, now_ns=clock.ns)
    assert q.get_nowait(now_ns=clock.ns) == "x"


def test_a_blocked_get_wakes_up_for_a_put(impl: QueueClass) -> None:
    q = impl(1, 1)
    future = spawn(q.get)
    time.sleep(0.05)
    assert not future.done()
    q.put("wake", Deadline.after(JOIN_TIMEOUT_S))
    assert future.result(JOIN_TIMEOUT_S) == "wake"


def test_acquire_returns_its_start_time_and_a_kept_one_never_changes(impl: QueueClass) -> None:
    # The C twin rewrites the int it returned last when nobody kept it.
    q = impl(2, 0)
    start = 2**40
    kept = q.acquire(now_ns=start)
    assert kept == start
    for offset in range(1, 4):
        assert q.acquire(now_ns=start + offset) == start + offset  # dropped at once: reusable
        q.release(now_ns=start + offset)
    assert kept == start and kept + 0 == 2**40
    times = []
    for offset in (10, 2**31, 2**61, 7):  # two-digit, three-digit and small ints alike
        times.append(q.acquire(now_ns=start + offset if offset != 7 else offset))
        q.release()
    assert times == [start + 10, start + 2**31, start + 2**61, 7]
    q.release()
    real = q.acquire()
    assert isinstance(real, int) and real > 0
    q.release()


def test_every_blocked_get_gets_an_item_made_ready_by_a_put_or_by_a_release_elsewhere(impl: QueueClass) -> None:
    # Three consumers asleep in get(): two items take free slots at once, the
    # third waits in line until this thread (not a consumer) gives a slot
    # back. Each item reaches exactly one consumer, and no consumer is left
    # asleep while an item is ready.
    q = impl(3, 3)
    q.put("held", Deadline.after(JOIN_TIMEOUT_S))
    assert q.get_nowait() == "held"
    consumers = [spawn(q.get) for _ in range(3)]
    time.sleep(0.05)
    assert not any(future.done() for future in consumers)
    for item in ("a", "b", "c"):
        q.put(item, Deadline.after(JOIN_TIMEOUT_S))
    assert q.qsize() == 1  # "c" waits for a slot
    q.task_done()  # from this thread: the slot goes to "c"
    assert sorted(future.result(JOIN_TIMEOUT_S) for future in consumers) == ["a", "b", "c"]
    assert_counters(q, queued=0, assigned=0, in_flight=3, started=4, completed=1)


def test_expire_overdue_sweeps_dead_waiting_items_only(impl: QueueClass, clock: FakeClock) -> None:
    expired: list[Any] = []
    q = impl(1, 5, on_expired=expired.append)
    q.put("assigned", clock.deadline_in(5), now_ns=clock.ns)
    q.put("dies-1", clock.deadline_in(10), now_ns=clock.ns)
    q.put("lives", clock.deadline_in(100), now_ns=clock.ns)
    q.put("dies-2", clock.deadline_in(5), now_ns=clock.ns)
    q.put("forever", None, now_ns=clock.ns)
    assert q.expire_overdue(now_ns=clock.ns) == 0
    clock.advance(10)
    assert q.expire_overdue(now_ns=clock.ns) == 2
    assert sorted(expired) == ["dies-1", "dies-2"]
    assert_counters(q, queued=2, expired_in_queue=2, assigned=1)
    assert q.expire_overdue(now_ns=clock.ns) == 0
    # The item already holding a slot is not in the line: get() reports it.
    assert drain(q, clock) == ["lives", "forever"]
    assert sorted(expired) == ["assigned", "dies-1", "dies-2"]


def test_queue_wait_counts_from_arrival_to_start(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 1)
    q.put("a", None, now_ns=clock.ns)
    q.put("b", None, now_ns=clock.ns)
    clock.advance(30)
    assert q.get(block=False, now_ns=clock.ns) == "a"
    q.task_done(now_ns=clock.ns)
    clock.advance(20)
    assert q.get(block=False, now_ns=clock.ns) == "b"
    assert q.stats()["queue_wait_ns_total"] == (30 + 50) * NS_PER_MS


# -- shutdown -----------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_shutdown_refuses_arrivals_but_finishes_the_line(impl: QueueClass, clock: FakeClock, order: str) -> None:
    q = impl(1, 3, order=order)
    for name in "abc":
        q.put(name, None, now_ns=clock.ns)
    assert not q.is_shutdown
    assert q.shutdown() == []
    assert q.is_shutdown
    with pytest.raises(ShutDown):
        q.put("late", None, now_ns=clock.ns)
    with pytest.raises(ShutDown):
        q.acquire(None, now_ns=clock.ns)
    with pytest.raises(ShutDown):
        q.slot(None, now_ns=clock.ns).__enter__()
    assert drain(q, clock) == (["a", "b", "c"] if order == "fifo" else ["a", "c", "b"])
    with pytest.raises(ShutDown):
        q.get(block=False, now_ns=clock.ns)
    with pytest.raises(ShutDown):
        q.get(timeout=JOIN_TIMEOUT_S)
    assert_counters(q, offered=3, started=3, completed=3, cancelled=0, in_flight=0)


@pytest.mark.parametrize("order", ORDERS)
def test_shutdown_cancel_waiting_returns_the_line_oldest_first(impl: QueueClass, clock: FakeClock, order: str) -> None:
    q = impl(1, 3, order=order)
    for name in "abc":
        q.put(name, None, now_ns=clock.ns)
    assert q.shutdown(cancel_waiting=True) == ["b", "c"]
    assert_counters(q, cancelled=2, queued=0, assigned=1)
    # The item that already held a slot still runs.
    assert drain(q, clock) == ["a"]
    assert_counters(q, started=1, completed=1, in_flight=0)


def test_a_consumer_blocked_in_get_is_woken_by_shutdown(impl: QueueClass) -> None:
    q = impl(1, 1)
    future = spawn(q.get)
    time.sleep(0.05)
    q.shutdown()
    with pytest.raises(ShutDown):
        future.result(JOIN_TIMEOUT_S)


def test_shutdown_cancel_waiting_wakes_gate_waiters_with_shutdown(impl: QueueClass) -> None:
    q = impl(1, 3)
    q.acquire()
    waiters = [spawn(q.acquire, None), spawn(q.acquire, Deadline.after(3600))]
    wait_until(lambda: q.qsize() == 2, "both gate waiters to queue")
    assert q.shutdown(cancel_waiting=True) == []
    for waiter in waiters:
        with pytest.raises(ShutDown):
            waiter.result(JOIN_TIMEOUT_S)
    assert_counters(q, cancelled=2, queued=0, in_flight=1)
    q.release()
    assert_counters(q, in_flight=0, completed=1)


# -- releasing -------------------------------------------------------------------------------


def test_releasing_more_than_was_taken_is_a_value_error(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(2, 1)
    with pytest.raises(ValueError):
        q.release(now_ns=clock.ns)
    q.acquire(None, now_ns=clock.ns)
    q.release(now_ns=clock.ns)
    with pytest.raises(ValueError):
        q.release(now_ns=clock.ns)
    with pytest.raises(ValueError):
        q.task_done(now_ns=clock.ns)
    assert_counters(q, completed=1, in_flight=0)


def test_task_done_before_get_is_a_value_error(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 1)
    q.put("assigned, not taken", None, now_ns=clock.ns)
    with pytest.raises(ValueError):
        q.task_done(now_ns=clock.ns)
    assert_counters(q, in_flight=1, assigned=1, completed=0)


def test_slot_releases_when_the_body_raises_and_refuses_to_nest(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 0)
    slot = q.slot(clock.deadline_in(100), now_ns=clock.ns)
    with pytest.raises(KeyError), slot:
        assert_counters(q, in_flight=1, started=1)
        with pytest.raises(RuntimeError):
            slot.__enter__()
        raise KeyError("the body failed")
    assert_counters(q, in_flight=0, completed=1)


def test_slot_started_ns_is_when_the_queue_let_it_start(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 0)
    slot = q.slot(clock.deadline_in(100), now_ns=clock.ns)
    assert slot.started_ns == 0
    with slot:
        assert slot.started_ns == clock.ns


def test_slot_raises_before_the_body_runs(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(1, 0)
    ran = []
    with pytest.raises(DeadlineExceeded), q.slot(clock.deadline_in(-1), now_ns=clock.ns):
        ran.append("expired")
    with q.slot(None, now_ns=clock.ns), pytest.raises(QueueFull), q.slot(None, now_ns=clock.ns):
        ran.append("full")
    assert ran == []
    assert_counters(q, in_flight=0, completed=1)


# -- on_expired -------------------------------------------------------------------------------


def test_an_on_expired_callback_that_raises_is_logged_and_the_queue_goes_on(
    impl: QueueClass, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(item: object) -> None:
        raise RuntimeError(f"cannot answer {item}")

    q = impl(1, 3, on_expired=broken)
    q.put("running", None, now_ns=clock.ns)
    q.put("dies", clock.deadline_in(5), now_ns=clock.ns)
    q.put("lives", None, now_ns=clock.ns)
    assert q.get(block=False, now_ns=clock.ns) == "running"
    clock.advance(5)
    with caplog.at_level(logging.ERROR, logger="prazo"):
        q.task_done(now_ns=clock.ns)
    assert [record.name for record in caplog.records] == ["prazo"]
    assert "dies" in caplog.records[0].getMessage()
    assert caplog.records[0].exc_info is not None
    assert q.get(block=False, now_ns=clock.ns) == "lives"
    q.task_done(now_ns=clock.ns)
    assert_counters(q, in_flight=0, expired_in_queue=1, completed=2)


# -- stats --------------------------------------------------------------------------------


def test_stats_has_the_documented_keys_and_starts_at_zero(impl: QueueClass) -> None:
    stats = impl(3, 7).stats()
    assert set(stats) == STATS_KEYS
    assert stats["max_concurrency"] == 3
    assert stats["max_queue"] == 7
    assert stats["limit"] == 3
    assert all(stats[key] == 0 for key in STATS_KEYS - {"max_concurrency", "max_queue", "limit"})


def test_stats_count_every_outcome_once(impl: QueueClass, clock: FakeClock) -> None:
    q = impl(2, 2)
    q.acquire(clock.deadline_in(50), now_ns=clock.ns)
    q.put("a", clock.deadline_in(50), now_ns=clock.ns)
    q.put("b", clock.deadline_in(10), now_ns=clock.ns)
    q.put("c", clock.deadline_in(50), now_ns=clock.ns)
    with pytest.raises(QueueFull):
        q.put("d", clock.deadline_in(50), now_ns=clock.ns)
    with pytest.raises(DeadlineExceeded):
        q.acquire(clock.deadline_in(-1), now_ns=clock.ns)
    clock.advance(10)
    assert q.get(block=False, now_ns=clock.ns) == "a"
    q.task_done(now_ns=clock.ns)
    q.release(now_ns=clock.ns)
    assert q.get(block=False, now_ns=clock.ns) == "c"
    q.task_done(now_ns=clock.ns)
    stats = q.stats()
    assert_conservation(stats)
    assert {
        key: stats[key] for key in STATS_KEYS - {"max_concurrency", "max_queue", "limit", "evicted", "critical_started"}
    } == {
        "offered": 6,
        "started": 3,
        "completed": 3,
        "rejected_full": 1,
        "expired": 2,
        "expired_on_arrival": 1,
        "expired_in_queue": 1,
        "cancelled": 0,
        "in_flight": 0,
        "assigned": 0,
        "queued": 0,
        "peak_in_flight": 2,
        "peak_queued": 2,
        "queue_wait_ns_total": (10 + 10) * NS_PER_MS,
        "insufficient_budget": 0,
        "shed": 0,
        "expected_service_ns": 0,
    }


# -- bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "argument"),
    [
        ((0, 1), {}, ValueError, "max_concurrency"),
        ((-1, 1), {}, ValueError, "max_concurrency"),
        ((True, 1), {}, TypeError, "max_concurrency"),
        ((1.0, 1), {}, TypeError, "max_concurrency"),
        (("4", 1), {}, TypeError, "max_concurrency"),
        ((None, 1), {}, TypeError, "max_concurrency"),
        ((1, -1), {}, ValueError, "max_queue"),
        ((1, False), {}, TypeError, "max_queue"),
        ((1, 2.5), {}, TypeError, "max_queue"),
        ((1, "20"), {}, TypeError, "max_queue"),
        ((1, 1), {"order": "FIFO"}, ValueError, "order"),
        ((1, 1), {"order": "random"}, ValueError, "order"),
        ((1, 1), {"order": 1}, TypeError, "order"),
        ((1, 1), {"on_expired": 5}, TypeError, "on_expired"),
        ((1, 1), {"on_expired": "print"}, TypeError, "on_expired"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(
    impl: QueueClass, args: tuple, kwargs: dict, error: type, argument: str
) -> None:
    with pytest.raises(error, match=argument):
        impl(*args, **kwargs)


BAD_CALLS: dict[str, Callable[[AdmissionQueue, Any, Any], object]] = {
    "acquire": lambda q, deadline, now: q.acquire(deadline, now_ns=now),
    "slot": lambda q, deadline, now: q.slot(deadline, now_ns=now),
    "put": lambda q, deadline, now: q.put("item", deadline, now_ns=now),
    "put_nowait": lambda q, deadline, now: q.put_nowait("item", deadline, now_ns=now),
}


@pytest.mark.parametrize("call", BAD_CALLS)
@pytest.mark.parametrize("deadline", [1.5, 100, "2s", Deadline])
def test_a_deadline_that_is_not_a_deadline_is_a_type_error(
    impl: QueueClass, clock: FakeClock, call: str, deadline: object
) -> None:
    q = impl(1, 1)
    with pytest.raises(TypeError, match="deadline"):
        BAD_CALLS[call](q, deadline, clock.ns)
    assert q.stats()["offered"] == 0


@pytest.mark.parametrize("call", BAD_CALLS)
@pytest.mark.parametrize("now", [1.5, True, "0", Deadline.at_ns(0)])
def test_a_now_ns_that_is_not_an_int_is_a_type_error(impl: QueueClass, call: str, now: object) -> None:
    q = impl(1, 1)
    with pytest.raises(TypeError, match="now_ns"):
        BAD_CALLS[call](q, None, now)
    assert q.stats()["offered"] == 0


@pytest.mark.parametrize("now", [2**63, -(2**63) - 1])
def test_a_now_ns_outside_the_64_bit_clock_is_a_value_error(impl: QueueClass, now: int) -> None:
    q = impl(1, 1)
    for call in BAD_CALLS.values():
        with pytest.raises(ValueError, match="now_ns"):
            call(q, None, now)
    assert q.stats()["offered"] == 0


@pytest.mark.parametrize("now", [1.5, True, "0"])
def test_the_other_operations_check_now_ns_too(impl: QueueClass, now: Any) -> None:
    q = impl(1, 1)
    q.acquire()
    for call in (q.release, q.task_done, q.expire_overdue, q.get_nowait):
        with pytest.raises(TypeError, match="now_ns"):
            call(now_ns=now)
    with pytest.raises(TypeError, match="now_ns"):
        q.get(block=False, now_ns=now)
    assert_counters(q, in_flight=1, completed=0)


def test_configuration_is_readable(impl: QueueClass) -> None:
    q = impl(3, 7, order="lifo")
    assert (q.max_concurrency, q.max_queue, q.order, q.is_shutdown) == (3, 7, "lifo", False)
    assert impl(1, 0).order == "fifo"


# -- gate waiters on real threads ---------------------------------------------------------------


@pytest.mark.parametrize(("order", "expected"), [("fifo", ["first", "second"]), ("lifo", ["second", "first"])])
def test_a_released_slot_is_handed_to_a_gate_waiter(impl: QueueClass, order: str, expected: list[str]) -> None:
    q = impl(1, 2, order=order)
    granted: list[str] = []
    started_at: dict[str, int] = {}
    q.acquire()

    def wait_then_run(name: str, deadline: Deadline | None) -> None:
        with q.slot(deadline) as slot:
            granted.append(name)
            started_at[name] = slot.started_ns

    first = spawn(wait_then_run, "first", Deadline.after(JOIN_TIMEOUT_S))
    wait_until(lambda: q.qsize() == 1, "the first waiter to queue")
    second = spawn(wait_then_run, "second", None)
    wait_until(lambda: q.qsize() == 2, "the second waiter to queue")
    assert granted == []
    released_ns = time.monotonic_ns()
    q.release()
    first.result(JOIN_TIMEOUT_S)
    second.result(JOIN_TIMEOUT_S)
    assert granted == expected
    assert released_ns < started_at[expected[0]] <= started_at[expected[1]]
    assert_counters(q, started=3, completed=3, in_flight=0, queued=0, expired=0)


def test_a_gate_waiter_leaves_at_its_own_deadline_while_the_head_is_blocked(impl: QueueClass) -> None:
    q = impl(1, 2)
    q.acquire()
    head = spawn(q.acquire, Deadline.after(JOIN_TIMEOUT_S))
    wait_until(lambda: q.qsize() == 1, "the head waiter to queue")
    short_deadline = Deadline.after_ms(200)

    def wait_briefly() -> int:
        try:
            q.acquire(short_deadline)
        except DeadlineExceeded as exc:
            assert exc.reason == REASON_EXPIRED_IN_QUEUE
            return time.monotonic_ns()
        raise AssertionError("the short waiter was granted a slot nobody released")

    short = spawn(wait_briefly)
    # The holder keeps its slot until the short waiter is gone: the waiter must
    # leave on its own, not when it reaches the head of the line.
    left_at_ns = short.result(JOIN_TIMEOUT_S)
    assert left_at_ns >= short_deadline.ns
    assert not head.done()
    assert_counters(q, expired_in_queue=1, queued=1, in_flight=1)
    q.release()
    assert isinstance(head.result(JOIN_TIMEOUT_S), int)  # acquire() returns its start time
    q.release()
    assert_counters(q, started=2, completed=2, in_flight=0)


def hold_the_gil(seconds: float) -> None:
    """Sleep without releasing the GIL, so no other Python thread runs meanwhile."""
    # PyDLL calls a C function with the GIL held (CDLL would release it), and
    # usleep is in the libc every supported POSIX system links into Python.
    ctypes.PyDLL(None).usleep(max(0, round(seconds * 1_000_000)))


@needs_the_gil
def test_a_gate_waiter_granted_a_slot_too_late_passes_it_on(impl: QueueClass) -> None:
    q = impl(1, 2, order="lifo")
    q.acquire()
    patient = spawn(q.acquire, None)
    wait_until(lambda: q.qsize() == 1, "the patient waiter to queue")
    deadline = Deadline.after_ms(500)
    hurried = spawn(q.acquire, deadline)
    wait_until(lambda: q.qsize() == 2, "the hurried waiter to queue")
    released_ns = time.monotonic_ns()
    assert released_ns < deadline.ns, "setting up took longer than the 500 ms budget"
    # The newest waiter is granted the slot before its deadline, but cannot run
    # until after it: it must re-check, never start, and pass the slot on.
    q.release()
    hold_the_gil(deadline.remaining() + 0.1)
    assert deadline.expired()
    with pytest.raises(DeadlineExceeded) as info:
        hurried.result(JOIN_TIMEOUT_S)
    assert info.value.reason == REASON_EXPIRED_IN_QUEUE
    assert isinstance(patient.result(JOIN_TIMEOUT_S), int)  # acquire() returns its start time
    assert_counters(q, started=2, completed=1, expired_in_queue=1, in_flight=1, assigned=0, queued=0)
    q.release()


def test_a_gate_waiter_without_deadline_waits_for_its_turn(impl: QueueClass) -> None:
    q = impl(1, 1)
    q.acquire()
    waiter = spawn(q.acquire, None)
    wait_until(lambda: q.qsize() == 1, "the waiter to queue")
    time.sleep(0.05)
    assert not waiter.done()
    q.release()
    assert isinstance(waiter.result(JOIN_TIMEOUT_S), int)  # acquire() returns its start time
    assert q.stats()["in_flight"] == 1


def test_concurrent_releases_never_lose_a_slot(impl: QueueClass) -> None:
    q = impl(4, 64)
    barrier = threading.Barrier(16)

    def hold_briefly() -> None:
        barrier.wait(JOIN_TIMEOUT_S)
        for _ in range(50):
            with q.slot(Deadline.after(JOIN_TIMEOUT_S)):
                pass

    workers = [spawn(hold_briefly) for _ in range(16)]
    for worker in workers:
        worker.result(JOIN_TIMEOUT_S)
    assert_counters(q, started=800, completed=800, in_flight=0, queued=0, rejected_full=0, expired=0)
