"""Both twins in lockstep on one fake clock, checked against a model after every step.

A Hypothesis ``RuleBasedStateMachine`` puts work items with random relative
deadlines (already passed, short, long, none), takes them with
``get(block=False)``, finishes them, moves the clock, sweeps with
``expire_overdue``, makes non-blocking gate arrivals, and sometimes shuts the
queue down. Every step is applied to the C twin and the Python twin and to a
small model of the slots and the waiting line; after every step the
invariants of DESIGN.md hold:

1. no item is returned by ``get`` at a time >= its deadline;
2. ``0 <= in_flight <= max_concurrency`` and ``0 <= queued <= max_queue``;
3. conservation: ``offered == started + rejected_full + expired + cancelled + queued + assigned``;
4. work conservation: never an idle slot while an entry waits;
5. start order is FIFO (LIFO) among live items: the model serves its line
   from the oldest (newest) end, and every returned item must be the model's;
6. both twins give the same outcome, the same ``on_expired`` reports and the
   same ``stats()`` for every step.
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
from _helpers import COUNTER_NAMES, FakeClock, QueueClass, assert_conservation
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
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
    ShutDown,
)
from prazo.core._histogram_py import bucket_bounds, bucket_index
from prazo.core._queue_py import NO_DEADLINE_NS, AdmissionQueue

# What a step answered: ("returned", value) or ("raised", exception name, reason).
Outcome = tuple[Any, ...]

# Relative budgets in ms: zero and negatives are already passed on arrival.
# Budgets and clock steps share a coarse grid so that "now == deadline", the
# edge where off-by-one bugs live, happens often.
GRID_MS = (1, 5, 10, 20)
BUDGETS_MS = st.one_of(st.none(), st.sampled_from((-5, 0, *GRID_MS)), st.integers(min_value=-5, max_value=60))
CLOCK_STEPS_MS = st.one_of(st.sampled_from(GRID_MS), st.integers(min_value=0, max_value=40))

# Service times reported on release (ms): around the grid, so the learned
# estimate moves through the budgets in play.
SERVICE_MS = st.one_of(st.none(), st.sampled_from(GRID_MS), st.integers(min_value=0, max_value=30))

# CoDel target and interval for order="adaptive", on the grid: both the
# standing (LIFO, shed beyond the target) and the draining state happen.
CODEL_MS = (5, 20)

# Shutdown is terminal, so it is only allowed late in a run.
SHUTDOWN_AFTER_STEPS = 30


def returned(value: Any) -> Outcome:
    return ("returned", value)


def raised(error: type, reason: str | None = None) -> Outcome:
    return ("raised", error.__name__, reason)


def outcome_of(call: Callable[[], Any]) -> Outcome:
    """Run one operation and describe its result the way the model does."""
    try:
        return returned(call())
    except (QueueFull, DeadlineExceeded) as exc:
        return raised(type(exc), exc.reason)
    except (ShutDown, queue.Empty, ValueError) as exc:
        return raised(type(exc))


class StepRefused(Exception):
    """The model's answer for a step that raises instead of returning."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome)
        self.outcome = outcome


@dataclass
class Entry:
    item: int
    deadline_ns: int
    enqueued_ns: int


class ServiceModel:
    """The expected service time of POLICIES.md, from the whole list of samples.

    Fixed: the constant. Learned ("pNN"): every 16th sample, once there are
    32, the nearest-rank quantile (at the histogram's bucket precision) of the
    samples since the start of the previous generation of 256.
    """

    def __init__(self, expected_service_ms: float | str | None) -> None:
        self.fixed_ns = round(expected_service_ms * NS_PER_MS) if isinstance(expected_service_ms, float) else 0
        self.permille = {"p50": 500, "p90": 900, "p95": 950, "p99": 990}.get(str(expected_service_ms), 0)
        self.samples: list[int] = []
        self.learned_ns = 0

    @property
    def ns(self) -> int:
        return self.fixed_ns or self.learned_ns

    def sample(self, service_ns: int) -> None:
        if not self.permille:
            return
        self.samples.append(service_ns)
        k = len(self.samples)
        if k % 16 or k < 32:
            return
        in_current = k % 256 or 256
        window = sorted(self.samples[-(in_current + 256) :])
        n = len(window)
        rank = min(max(-(-self.permille * n // 1000), 1), n)
        if rank == n:
            self.learned_ns = window[-1]
        elif rank == 1:
            self.learned_ns = window[0]
        else:
            lo, hi = bucket_bounds(bucket_index(window[rank - 1]))
            self.learned_ns = min(max(lo + (hi - lo) // 2, window[0]), window[-1])


class QueueModel:
    """The admission queue of ``_queue_py``'s docstring, written as plainly as possible.

    Each method returns what the operation returns, or raises
    ``StepRefused`` with the outcome the real queue must raise; work items
    dropped from the line are appended to ``reports`` as ``(item, reason)``
    in the order ``on_dropped`` must see them.
    """

    def __init__(
        self,
        max_concurrency: int,
        max_queue: int,
        order: str,
        expected_service_ms: float | str | None = None,
        codel_ms: tuple[int, int] = (5, 100),
    ) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.lifo = order == "lifo"
        self.adaptive = order == "adaptive"
        self.target_ns, self.interval_ns = (ms * NS_PER_MS for ms in codel_ms)
        self.last_empty_ns = 0
        self.service = ServiceModel(expected_service_ms)
        self.waiting: list[Entry] = []
        self.ready: list[Entry] = []
        self.shut = False
        self.reports: list[tuple[int, str]] = []
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)

    def _count(self, name: str, delta: int = 1) -> None:
        self.counters[name] += delta
        for level, peak in (("in_flight", "peak_in_flight"), ("queued", "peak_queued")):
            self.counters[peak] = max(self.counters[peak], self.counters[level])

    @property
    def held(self) -> int:
        """Slots taken by a started gate arrival or an item returned by get."""
        return self.counters["in_flight"] - self.counters["assigned"]

    def would_wait(self, deadline_ns: int, now: int) -> bool:
        """True when a gate arrival now would block (so the machine must not make it)."""
        try:
            return not copy.deepcopy(self)._admit(deadline_ns, now)
        except StepRefused:
            return False

    def dropped_as(self, entry: Entry, now: int) -> str | None:
        """Why ``entry`` must not start at ``now`` (its reason), or None: it may."""
        if now >= entry.deadline_ns:
            return REASON_EXPIRED_IN_QUEUE
        if self.service.ns and now >= entry.deadline_ns - self.service.ns:
            return REASON_INSUFFICIENT_BUDGET
        return None

    def _drop(self, entry: Entry, reason: str) -> None:
        counter = {
            REASON_EXPIRED_IN_QUEUE: "expired_in_queue",
            REASON_INSUFFICIENT_BUDGET: "insufficient_budget",
            REASON_SHED: "shed",
        }[reason]
        self._count(counter)
        self.reports.append((entry.item, reason))

    def standing(self, now: int) -> bool:
        return now - self.last_empty_ns > self.interval_ns

    def _shed_stale(self, now: int) -> None:
        limit = self.target_ns if self.standing(now) else self.interval_ns
        while self.waiting and now - self.waiting[0].enqueued_ns > limit:
            entry = self.waiting.pop(0)
            self._count("queued", -1)
            self._drop(entry, self.dropped_as(entry, now) or REASON_SHED)

    def _admit(self, deadline_ns: int, now: int) -> bool:
        if self.shut:
            raise StepRefused(raised(ShutDown))
        if self.adaptive and not self.waiting:
            self.last_empty_ns = now
        self._count("offered")
        if now >= deadline_ns:
            self._count("expired_on_arrival")
            raise StepRefused(raised(DeadlineExceeded, REASON_EXPIRED_ON_ARRIVAL))
        if self.service.ns and now >= deadline_ns - self.service.ns:
            self._count("insufficient_budget")
            raise StepRefused(raised(DeadlineExceeded, REASON_INSUFFICIENT_BUDGET))
        if self.counters["in_flight"] < self.max_concurrency:
            self._count("in_flight")
            return True
        if self.adaptive and self.counters["queued"] >= self.max_queue:
            self._shed_stale(now)
        if self.counters["queued"] >= self.max_queue:
            self._count("rejected_full")
            raise StepRefused(raised(QueueFull, REASON_QUEUE_FULL))
        return False

    def _hand_over(self, now: int) -> None:
        if self.adaptive:
            self._shed_stale(now)
        newest = self.lifo or (self.adaptive and self.standing(now))
        while self.waiting:
            entry = self.waiting.pop() if newest else self.waiting.pop(0)
            self._count("queued", -1)
            reason = self.dropped_as(entry, now)
            if reason:
                self._drop(entry, reason)
                continue
            self._count("assigned")
            self.ready.append(entry)
            return
        self._count("in_flight", -1)

    def put(self, entry: Entry, now: int) -> None:
        if self._admit(entry.deadline_ns, now):
            self._count("assigned")
            self.ready.append(entry)
        else:
            self.waiting.append(entry)
            self._count("queued")

    def acquire(self, deadline_ns: int, now: int) -> int:
        if self._admit(deadline_ns, now):
            self._count("started")
            return now
        raise AssertionError("the machine must never make a gate arrival that waits")

    def get(self, now: int) -> int:
        while self.ready:
            entry = self.ready.pop(0)
            self._count("assigned", -1)
            reason = self.dropped_as(entry, now)
            if reason:
                self._drop(entry, reason)
                self._hand_over(now)
                continue
            self._count("started")
            self._count("queue_wait_ns_total", now - entry.enqueued_ns)
            return entry.item
        if self.shut and not self.waiting:
            raise StepRefused(raised(ShutDown))
        raise StepRefused(raised(queue.Empty))

    def release(self, now: int, service_ns: int | None = None) -> None:
        if self.held <= 0:
            raise StepRefused(raised(ValueError))
        self._count("completed")
        if service_ns is not None:
            self.service.sample(service_ns)
        self._hand_over(now)

    def expire_overdue(self, now: int) -> int:
        overdue = [entry for entry in self.waiting if self.dropped_as(entry, now)]
        self.waiting = [entry for entry in self.waiting if not self.dropped_as(entry, now)]
        self._count("queued", -len(overdue))
        for entry in overdue:
            self._drop(entry, self.dropped_as(entry, now) or REASON_SHED)
        return len(overdue)

    def cancel(self, item: int) -> bool:
        for entry in self.waiting:
            if entry.item == item:
                self.waiting.remove(entry)
                self._count("queued", -1)
                self._count("cancelled")
                return True
        return False

    def shutdown(self, cancel_waiting: bool) -> list[int]:
        self.shut = True
        if not cancel_waiting:
            return []
        cancelled = [entry.item for entry in self.waiting]
        self._count("cancelled", len(cancelled))
        self._count("queued", -len(cancelled))
        self.waiting = []
        return cancelled

    def answer(self, step: Callable[[], Any]) -> Outcome:
        try:
            return returned(step())
        except StepRefused as refused:
            return refused.outcome


class LockstepMachine(RuleBasedStateMachine):
    """Drives two twins and the model with the same steps on one fake clock.

    Subclassed per run by ``lockstep_machine`` to set the twins and the order.
    """

    twin_classes: tuple[QueueClass, QueueClass]
    order: str
    expected_service_ms: float | str | None

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.steps = 0
        self.next_item = 0
        self.deadlines: dict[int, int] = {}
        # The very objects put, so cancel() can find them by identity.
        self.items: list[int] = []

    @initialize(max_concurrency=st.integers(1, 3), max_queue=st.integers(0, 4))
    def create(self, max_concurrency: int, max_queue: int) -> None:
        self.reports: tuple[list[Any], list[Any]] = ([], [])
        codel = (
            {"codel_target_ms": float(CODEL_MS[0]), "codel_interval_ms": float(CODEL_MS[1])}
            if self.order == "adaptive"
            else {}
        )
        self.queues: list[AdmissionQueue] = [
            twin(
                max_concurrency,
                max_queue,
                order=self.order,
                on_dropped=lambda item, error, reports=reports: reports.append((item, error.reason)),
                expected_service_ms=self.expected_service_ms,
                **codel,
            )
            for twin, reports in zip(self.twin_classes, self.reports)
        ]
        self.model = QueueModel(max_concurrency, max_queue, self.order, self.expected_service_ms, CODEL_MS)

    def step(self, operation: Callable[[AdmissionQueue], Any], model_step: Callable[[], Any]) -> Outcome:
        """Apply one operation to both twins and the model; all three must agree."""
        self.steps += 1
        self.model.reports.clear()
        expected = self.model.answer(model_step)
        for q, reports in zip(self.queues, self.reports):
            reports.clear()
            assert outcome_of(partial(operation, q)) == expected, f"{q!r} disagrees with the model"
            assert reports == self.model.reports, f"{q!r} reported other dropped items"
        return expected

    def deadline(self, budget_ms: int | None) -> tuple[Deadline | None, int]:
        if budget_ms is None:
            return None, NO_DEADLINE_NS
        deadline = Deadline.at_ns(self.clock.ns + budget_ms * NS_PER_MS)
        return deadline, deadline.ns

    # -- work-queue face ---------------------------------------------------------

    @rule(budget_ms=BUDGETS_MS)
    def put(self, budget_ms: int | None) -> None:
        deadline, deadline_ns = self.deadline(budget_ms)
        item, now = self.next_item, self.clock.ns
        self.next_item += 1
        self.items.append(item)
        self.deadlines[item] = deadline_ns
        self.step(
            lambda q: q.put(item, deadline, now_ns=now),
            lambda: self.model.put(Entry(item, deadline_ns, now), now),
        )

    @rule(nowait=st.booleans())
    def get(self, nowait: bool) -> None:
        now = self.clock.ns
        outcome = self.step(
            (lambda q: q.get_nowait(now_ns=now)) if nowait else (lambda q: q.get(block=False, now_ns=now)),
            lambda: self.model.get(now),
        )
        if outcome[0] == "returned":
            # Invariant 1: a returned item starts strictly before its deadline,
            # and before its effective deadline under the doomed-work skip.
            assert now < self.deadlines[outcome[1]] - self.model.service.ns

    @rule(as_task_done=st.booleans(), service_ms=SERVICE_MS)
    def finish(self, as_task_done: bool, service_ms: int | None) -> None:
        now = self.clock.ns
        service_ns = None if service_ms is None else service_ms * NS_PER_MS
        started = None if service_ns is None else now - service_ns
        self.step(
            (lambda q: q.task_done(now_ns=now, started_ns=started))
            if as_task_done
            else (lambda q: q.release(now_ns=now, started_ns=started)),
            lambda: self.model.release(now, service_ns),
        )

    @precondition(lambda self: self.items)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(self.items), label="item")
        self.step(lambda q: q.cancel(item), lambda: self.model.cancel(item))

    @rule()
    def expire_overdue(self) -> None:
        now = self.clock.ns
        self.step(lambda q: q.expire_overdue(now_ns=now), lambda: self.model.expire_overdue(now))

    # -- gate face, only where it cannot block ----------------------------------------

    @rule(budget_ms=BUDGETS_MS)
    def acquire(self, budget_ms: int | None) -> None:
        deadline, deadline_ns = self.deadline(budget_ms)
        now = self.clock.ns
        if self.model.would_wait(deadline_ns, now):
            return
        self.step(lambda q: q.acquire(deadline, now_ns=now), lambda: self.model.acquire(deadline_ns, now))

    @rule(cycles=st.integers(1, 40), service_ms=SERVICE_MS.filter(lambda ms: ms is not None))
    def serve(self, cycles: int, service_ms: int) -> None:
        """Gate arrivals that start at once and finish after ``service_ms``: samples, fast."""
        for _ in range(cycles):
            if not self.serve_once(service_ms):
                return

    def serve_once(self, service_ms: int) -> bool:
        now = self.clock.ns
        if self.model.counters["in_flight"] >= self.model.max_concurrency or self.model.would_wait(NO_DEADLINE_NS, now):
            return False
        outcome = self.step(lambda q: q.acquire(None, now_ns=now), lambda: self.model.acquire(NO_DEADLINE_NS, now))
        if outcome[0] != "returned":
            return False
        done = self.clock.advance(service_ms)
        self.step(
            lambda q: q.release(now_ns=done, started_ns=now),
            lambda: self.model.release(done, service_ms * NS_PER_MS),
        )
        return True

    # -- time and lifecycle -------------------------------------------------------------

    @rule(ms=CLOCK_STEPS_MS)
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    @precondition(lambda self: self.steps >= SHUTDOWN_AFTER_STEPS and not self.model.shut)
    @rule(cancel_waiting=st.booleans())
    def shutdown(self, cancel_waiting: bool) -> None:
        self.step(
            lambda q: q.shutdown(cancel_waiting=cancel_waiting),
            lambda: self.model.shutdown(cancel_waiting),
        )

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def twins_and_model_agree_on_every_counter(self) -> None:
        reference, candidate = (q.stats() for q in self.queues)
        assert reference == candidate
        assert {name: reference[name] for name in COUNTER_NAMES} == self.model.counters
        assert reference["expected_service_ns"] == self.model.service.ns
        for q in self.queues:
            assert q.qsize() == self.model.counters["queued"]
            assert q.is_shutdown == self.model.shut

    def teardown(self) -> None:
        # What a run reached, for --hypothesis-show-statistics.
        stats = self.queues[0].stats() if hasattr(self, "queues") else {}
        for key in ("shed", "insufficient_budget", "expected_service_ns"):
            if stats.get(key):
                event(f"{key} > 0")

    @invariant()
    def bounds_conservation_and_no_stranded_waiter(self) -> None:
        stats = self.queues[0].stats()
        assert 0 <= stats["in_flight"] <= stats["max_concurrency"]
        assert 0 <= stats["queued"] <= stats["max_queue"]
        assert 0 <= stats["assigned"] <= stats["in_flight"]
        assert_conservation(stats)
        if stats["in_flight"] < stats["max_concurrency"]:
            assert stats["queued"] == 0, f"an idle slot while entries wait: {stats}"


def lockstep_machine(
    twins: tuple[QueueClass, QueueClass], line_order: str, expected_service: float | str | None = None
) -> type[LockstepMachine]:
    class Lockstep(LockstepMachine):
        twin_classes = twins
        order = line_order
        expected_service_ms = expected_service

    return Lockstep


@pytest.mark.parametrize(
    ("order", "expected_service_ms"),
    [
        ("fifo", None),
        ("lifo", None),
        ("adaptive", None),
        ("fifo", 3.0),
        ("adaptive", 3.0),
        ("lifo", "p50"),
        ("adaptive", "p90"),
    ],
)
def test_twins_agree_with_each_other_and_the_model(
    twin_pair: tuple[QueueClass, QueueClass], order: str, expected_service_ms: float | str | None
) -> None:
    run_state_machine_as_test(
        lockstep_machine(twin_pair, order, expected_service_ms),
        settings=settings(max_examples=200, stateful_step_count=50, deadline=None),
    )
