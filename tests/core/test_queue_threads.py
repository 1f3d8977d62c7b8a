"""Real-thread stress on both faces, both orders and both twins.

Dozens of threads hammer one queue with random budgets (some already passed,
most a few ms) and random service times, and the tests then assert what must
hold whatever the scheduling was: no body started at or after its deadline,
never more than ``max_concurrency`` bodies at once, every attempt has exactly
one outcome, the counters agree with what the threads saw, and the queue ends
empty with every slot back.

How a start time is known differs by face. A gate body reads
``slot.started_ns``, the instant the queue checked the deadline and let it
start, so the check is exact; the body also reads ``time.monotonic_ns()`` to
make sure that instant is not in its future. A work-queue consumer cannot see
the instant ``get`` checked the item, and a clock read after ``get`` returns
can lag it by a preemption (over 1 ms on a loaded 2-core machine, which made a
fixed lag allowance flaky). So the consumer checks the one thing that is exact:
the item's deadline was still ahead when it *asked* (``get`` checks after
that). An item that died waiting in line and is handed out anyway fails this
(a twin with the hand-over and pickup checks removed fails with dozens of such
starts). The exact boundary (``now == deadline`` never starts) is proven on a
fake clock in ``test_queue_statemachine.py``, and the re-check of a gate
waiter that wakes too late in ``test_queue_semantics.py``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from _helpers import JOIN_TIMEOUT_S, ConcurrencyMeter, QueueClass, assert_conservation, spawn
from prazo.core import Deadline, DeadlineExceeded, QueueFull, ShutDown

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

MAX_CONCURRENCY = 4
MAX_QUEUE = 16
GATE_THREADS = 32
GATE_ATTEMPTS_PER_THREAD = 100
PRODUCERS = 24
CONSUMERS = 8
PUTS_PER_PRODUCER = 80
SEED = 20240607
# Sweeps are sparse so that dead items do sit in the line and the checks at
# hand-over and at pickup are what keeps them from starting.
SWEEP_EVERY_S = 0.01

ORDERS = ("fifo", "lifo")


def random_budget_ms(rng: random.Random) -> float:
    """Mostly a few ms (so some expire while waiting); sometimes already passed."""
    return rng.choice((-1.0, 0.0)) if rng.random() < 0.05 else rng.uniform(0.5, 25.0)


def random_service_s(rng: random.Random) -> float:
    return rng.uniform(0.0, 0.002)


@dataclass
class Observed:
    """What the threads saw, merged over all of them."""

    outcomes: Counter = field(default_factory=Counter)
    late_starts_ns: list[int] = field(default_factory=list)

    def merge(self, other: Observed) -> None:
        self.outcomes.update(other.outcomes)
        self.late_starts_ns.extend(other.late_starts_ns)


def run_body(meter: ConcurrencyMeter, observed: Observed, deadline_ns: int, checked_ns: int, service_s: float) -> None:
    """The common body: note a late start, count concurrency, do the "work".

    ``checked_ns`` is an instant at or before the queue's deadline check for
    this body (see the module docstring), so it must be before the deadline.
    """
    if checked_ns >= deadline_ns:
        observed.late_starts_ns.append(checked_ns - deadline_ns)
    observed.outcomes["started"] += 1
    with meter:
        time.sleep(service_s)


def outcome_name(exc: BaseException) -> str:
    return f"{type(exc).__name__}:{getattr(exc, 'reason', '')}"


def assert_accounted(stats: dict, observed: Observed, meter: ConcurrencyMeter, attempts: int) -> None:
    """The counters match what the threads saw, and the queue ended drained."""
    assert observed.late_starts_ns == [], "bodies started at or after their deadline (ns late)"
    assert stats["offered"] == attempts
    assert stats["rejected_full"] == observed.outcomes["QueueFull:queue-full"]
    assert stats["expired_on_arrival"] == observed.outcomes["DeadlineExceeded:expired-on-arrival"]
    assert 1 <= meter.peak <= MAX_CONCURRENCY
    assert stats["peak_in_flight"] <= MAX_CONCURRENCY
    assert stats["peak_queued"] <= MAX_QUEUE
    assert (stats["in_flight"], stats["queued"], stats["assigned"], stats["cancelled"]) == (0, 0, 0, 0)
    assert stats["started"] == stats["completed"] == observed.outcomes["started"]
    assert_conservation(stats)


@pytest.mark.parametrize("order", ORDERS)
def test_gate_under_real_threads(impl: QueueClass, order: str) -> None:
    q = impl(MAX_CONCURRENCY, MAX_QUEUE, order=order)
    meter = ConcurrencyMeter()
    barrier = threading.Barrier(GATE_THREADS)

    def caller(seed: int) -> Observed:
        rng = random.Random(seed)
        observed = Observed()
        barrier.wait(JOIN_TIMEOUT_S)
        for _ in range(GATE_ATTEMPTS_PER_THREAD):
            deadline = Deadline.after_ms(random_budget_ms(rng))
            service_s = random_service_s(rng)
            try:
                with q.slot(deadline) as slot:
                    assert slot.started_ns <= time.monotonic_ns()
                    run_body(meter, observed, deadline.ns, slot.started_ns, service_s)
            except (QueueFull, DeadlineExceeded) as exc:
                observed.outcomes[outcome_name(exc)] += 1
        return observed

    callers = [spawn(caller, SEED + index) for index in range(GATE_THREADS)]
    observed = Observed()
    for future in callers:
        observed.merge(future.result(JOIN_TIMEOUT_S * 3))

    attempts = GATE_THREADS * GATE_ATTEMPTS_PER_THREAD
    assert sum(observed.outcomes.values()) == attempts
    assert set(observed.outcomes) <= {
        "started",
        "QueueFull:queue-full",
        "DeadlineExceeded:expired-on-arrival",
        "DeadlineExceeded:expired-in-queue",
    }
    stats = q.stats()
    assert stats["expired_in_queue"] == observed.outcomes["DeadlineExceeded:expired-in-queue"]
    assert_accounted(stats, observed, meter, attempts)


@pytest.mark.parametrize("order", ORDERS)
def test_work_queue_under_real_threads(impl: QueueClass, order: str) -> None:
    expired_items: list[tuple[int, int]] = []
    q = impl(MAX_CONCURRENCY, MAX_QUEUE, order=order, on_expired=expired_items.append)
    meter = ConcurrencyMeter()
    barrier = threading.Barrier(PRODUCERS + CONSUMERS)
    producing = threading.Event()
    producing.set()

    def producer(seed: int) -> tuple[Observed, set[int]]:
        rng = random.Random(seed)
        observed, accepted = Observed(), set()
        barrier.wait(JOIN_TIMEOUT_S)
        for index in range(PUTS_PER_PRODUCER):
            item_id = seed * PUTS_PER_PRODUCER + index
            deadline = Deadline.after_ms(random_budget_ms(rng))
            try:
                q.put((item_id, deadline.ns), deadline)
            except (QueueFull, DeadlineExceeded) as exc:
                observed.outcomes[outcome_name(exc)] += 1
            else:
                accepted.add(item_id)
            time.sleep(rng.uniform(0.0, 0.003))
        return observed, accepted

    def consumer(seed: int) -> tuple[Observed, list[int]]:
        rng = random.Random(seed)
        observed = Observed()
        consumed: list[int] = []
        barrier.wait(JOIN_TIMEOUT_S)
        while True:
            asked_ns = time.monotonic_ns()
            try:
                item_id, deadline_ns = q.get()
            except ShutDown:
                return observed, consumed
            run_body(meter, observed, deadline_ns, asked_ns, random_service_s(rng))
            consumed.append(item_id)
            q.task_done()

    def sweeper() -> int:
        # Work items cannot wake themselves: sweep the dead ones out meanwhile.
        swept = 0
        while producing.is_set():
            swept += q.expire_overdue()
            time.sleep(SWEEP_EVERY_S)
        return swept

    consumers = [spawn(consumer, -1 - index) for index in range(CONSUMERS)]
    sweep = spawn(sweeper)
    producers = [spawn(producer, index) for index in range(PRODUCERS)]
    observed, accepted = Observed(), set()
    for producing_future in producers:
        produced, produced_ids = producing_future.result(JOIN_TIMEOUT_S * 3)
        observed.merge(produced)
        accepted |= produced_ids
    producing.clear()
    swept = sweep.result(JOIN_TIMEOUT_S)
    q.shutdown()
    consumed: list[int] = []
    for consuming_future in consumers:
        taken, taken_ids = consuming_future.result(JOIN_TIMEOUT_S * 3)
        observed.merge(taken)
        consumed.extend(taken_ids)

    attempts = PRODUCERS * PUTS_PER_PRODUCER
    refused = observed.outcomes["QueueFull:queue-full"] + observed.outcomes["DeadlineExceeded:expired-on-arrival"]
    assert len(accepted) + refused == attempts
    expired_ids = [item_id for item_id, _ in expired_items]
    # Every accepted item ends exactly once: consumed or reported expired.
    assert len(consumed) == len(set(consumed))
    assert len(expired_ids) == len(set(expired_ids))
    assert set(consumed).isdisjoint(expired_ids)
    assert set(consumed) | set(expired_ids) == accepted
    stats = q.stats()
    assert stats["expired_in_queue"] == len(expired_ids)
    assert swept <= len(expired_ids)
    assert_accounted(stats, observed, meter, attempts)
