"""The pure-Python admission queue: the readable specification of the C twin.

Both twins have the same API and give the same observable outcome for every
operation (the Hypothesis state machine in ``tests/`` drives them in lockstep
on a fake clock). Read this file to learn what ``_queue_c.pyx`` does.

Model
-----
There are ``max_concurrency`` *slots* and a waiting line of at most
``max_queue`` entries. An arrival (``acquire``/``slot`` on the gate face,
``put`` on the work-queue face) is answered in one of four ways, in order:

1. its deadline has already passed   -> ``DeadlineExceeded("expired-on-arrival")``
2. its budget is shorter than the expected service time (``expected_service_ms``)
                                     -> ``DeadlineExceeded("insufficient-budget")``
3. a slot is free                    -> it gets the slot at once
4. the waiting line has room (``order="adaptive"`` first sheds the stale
   entries of a full line, see the class docstring) -> it waits
5. otherwise                         -> ``QueueFull("queue-full")``

When a slot is released, it is *handed over* to the next waiting entry (the
oldest for ``order="fifo"``, the newest for ``"lifo"``, either for
``"adaptive"`` as CoDel decides); entries whose deadline has passed on the way
are expired (counted, gate waiters woken with
``DeadlineExceeded("expired-in-queue")``, work items reported through
``on_dropped``/``on_expired``) and never get the slot, and so are the entries
whose budget became too short (``insufficient-budget``) or that CoDel sheds
(``QueueFull("shed-standing-queue")``). A slot is only ever idle when nobody
waits (work conservation).

A slot handed over is *assigned*: a gate waiter still has to wake up, a work
item still has to be taken by ``get``. At that moment the deadline is checked
once more; an entry that expired in between never starts, and the slot moves
on. Only then does the entry count as ``started``.

Gate waiters do not wait for the head of the line to find out they expired:
each one wakes at its own deadline and leaves (active expiry). Work items
cannot wake themselves; ``expire_overdue()`` sweeps them out on demand.

Counters (``stats()``), with ``expired = expired_on_arrival + expired_in_queue``::

    offered == started + rejected_full + expired + insufficient_budget + shed
               + cancelled + queued + assigned
    in_flight == started - completed + assigned
    0 <= in_flight <= max_concurrency,  0 <= queued <= max_queue

``stats()`` reads them under the lock, so they hold in every snapshot.

Every operation that decides on time takes an optional ``now_ns`` (the
``time.monotonic_ns()`` value to use), so tests can run both twins on one
fake clock. Blocking waits always run on the real monotonic clock.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # typing.Self is 3.11+ and core has no runtime dependencies: with postponed
    # annotations Self is only ever read by type checkers, which ship typing_extensions.
    from typing_extensions import Self

from ._policy_py import (
    DEFAULT_CODEL_INTERVAL_MS,
    DEFAULT_CODEL_TARGET_MS,
    VERDICT_EXPIRED,
    VERDICT_LIVE,
    CoDel,
    ServiceEstimate,
    checked_started_ns,
    codel_option_ns,
    deadline_verdict,
    effective_deadline_ns,
    expected_service_option,
)
from .deadline import Deadline
from .deadline import clock_ns as _clock
from .errors import (
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    REASON_INSUFFICIENT_BUDGET,
    REASON_QUEUE_FULL,
    REASON_SHED,
    DeadlineExceeded,
    QueueFull,
    ShutDown,
)

__all__ = ["NO_DEADLINE_NS", "AdmissionQueue", "Slot"]

_log = logging.getLogger("prazo")

# "No deadline" is the largest int64: it compares after every real deadline
# and matches what the C twin stores.
NO_DEADLINE_NS = 2**63 - 1

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

# A get() timeout this long (about 31.7 years) or longer waits like
# timeout=None (threading refuses waits beyond threading.TIMEOUT_MAX).
_UNBOUNDED_TIMEOUT_S = 1e9

# Waiting happens in slices, as in the C twin: an exception raised into a
# thread from outside (PyThreadState_SetAsyncExc) is only delivered while it
# runs bytecode, never during a wait on a lock.
_WAIT_SLICE_S = 0.1

# Entry states. The last three are also the ways a waiting entry can leave
# the line without a slot (a "drop"), each with its counter and its error.
_WAITING, _GRANTED, _CANCELLED, _EXPIRED, _INSUFFICIENT, _SHED = range(6)

_DROP_COUNTER = {_EXPIRED: "_expired_in_queue", _INSUFFICIENT: "_insufficient_budget", _SHED: "_shed"}

_NOT_INITIALISED = (
    "the AdmissionQueue is not initialised: its __init__ did not complete (or the garbage collector has cleared it)"
)

_COUNTERS = (
    "offered",
    "started",
    "completed",
    "rejected_full",
    "expired_on_arrival",
    "expired_in_queue",
    "cancelled",
    "in_flight",
    "assigned",
    "queued",
    "peak_in_flight",
    "peak_queued",
    "queue_wait_ns_total",
    "insufficient_budget",
    "shed",
)


def _deadline_ns(deadline: Deadline | None) -> int:
    if deadline is None:
        return NO_DEADLINE_NS
    if isinstance(deadline, Deadline):
        return deadline.ns
    raise TypeError(f"deadline must be a prazo.core.Deadline or None, not {type(deadline).__name__}")


def _validate_size(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > 2**31 - 1:
        raise ValueError(f"{name} must be < 2**31, got {value}")
    return value


_ORDERS = ("fifo", "lifo", "adaptive")


def _validate_order(order: object) -> str:
    if not isinstance(order, str):
        raise TypeError(f"order must be 'fifo', 'lifo' or 'adaptive', not {type(order).__name__}")
    if order not in _ORDERS:
        raise ValueError(f"order must be 'fifo', 'lifo' or 'adaptive', got {order!r}")
    return order


def _saturate(value: int) -> int:
    """Clamp to the int64 range, where the C twin's counters saturate instead of wrapping."""
    return max(_INT64_MIN, min(_INT64_MAX, value))


def _validate_callbacks(on_expired: object, on_dropped: object) -> None:
    if on_expired is not None and not callable(on_expired):
        raise TypeError("on_expired must be callable or None")
    if on_dropped is not None and not callable(on_dropped):
        raise TypeError("on_dropped must be callable or None")
    if on_expired is not None and on_dropped is not None:
        raise ValueError("pass on_expired or on_dropped, not both: on_dropped(item, error) sees every dropped item")


def _drop_error(state: int) -> DeadlineExceeded | QueueFull:
    """The exception that answers an entry dropped from the line in ``state``."""
    if state == _INSUFFICIENT:
        return DeadlineExceeded(REASON_INSUFFICIENT_BUDGET)
    if state == _SHED:
        return QueueFull(REASON_SHED)
    return DeadlineExceeded(REASON_EXPIRED_IN_QUEUE)


def _drop_state(verdict: int) -> int:
    return _EXPIRED if verdict == VERDICT_EXPIRED else _INSUFFICIENT


class _Entry:
    """One waiting arrival: a work item, or a gate waiter (``cond`` is set)."""

    __slots__ = ("cond", "deadline_ns", "enqueued_ns", "item", "state")

    def __init__(self, deadline_ns: int, enqueued_ns: int, item: Any, cond: threading.Condition | None) -> None:
        self.deadline_ns = deadline_ns
        self.enqueued_ns = enqueued_ns
        self.item = item
        self.cond = cond
        self.state = _WAITING


class Slot:
    """Context manager returned by ``AdmissionQueue.slot()``.

    ``__enter__`` waits for a slot (or raises ``QueueFull`` /
    ``DeadlineExceeded`` before the body runs); ``__exit__`` releases it.
    """

    __slots__ = ("_deadline", "_held", "_now_ns", "_queue", "started_ns")

    def __init__(self, q: AdmissionQueue, deadline: Deadline | None, now_ns: int | None) -> None:
        self._queue = q
        self._deadline = deadline
        self._now_ns = now_ns
        self._held = False
        #: The monotonic time at which the queue let this slot start (the
        #: instant its deadline was last checked); 0 until entered.
        self.started_ns = 0

    def __enter__(self) -> Self:
        try:
            queue = self._queue
        except AttributeError:
            raise RuntimeError("this Slot was not made by AdmissionQueue.slot()") from None
        if self._held:
            raise RuntimeError("this slot is already held; call q.slot() again for another")
        self.started_ns = queue._acquire(_deadline_ns(self._deadline), _clock(self._now_ns))
        self._held = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._held:
            self._held = False
            # A service-time sample only on the real clock: a slot entered on
            # a fake clock has a start that the real release time cannot meet.
            self._queue.release(started_ns=self.started_ns if self._now_ns is None else None)


class AdmissionQueue:
    """Bounded admission with deadlines: ``max_concurrency`` slots, ``max_queue`` waiting.

    Gate face (callers wait themselves)::

        q = AdmissionQueue(4, 20)
        with q.slot(Deadline.after(2.0)):
            work()                      # never runs once the deadline passed

    Work-queue face (consumers pull items)::

        q.put(item, Deadline.after(2.0))     # QueueFull / DeadlineExceeded at once
        item = q.get()                       # the next live item, holding a slot
        ...
        q.task_done()                        # releases the slot

    ``on_dropped(item, error)`` is called (outside any lock, in whichever
    thread noticed) for every work item that leaves the line without a slot
    (expired, insufficient budget, shed), once the operation that met it is
    complete, in the order met; ``error`` is the exception to answer it with.
    ``on_expired(item)`` is the older form without the error (both at once
    are refused). A callback's Exception is logged; the first BaseException
    is raised once every item has been reported.

    Policies (see ``_policy_py.py`` and POLICIES.md):

    * ``expected_service_ms`` (doomed-work skip): an entry whose remaining
      budget is shorter than the expected service time never starts; it is
      answered ``DeadlineExceeded("insufficient-budget")`` on arrival, at the
      hand-over, at the grant re-check or in ``get()``, and a gate waiter
      leaves at its *effective deadline* (deadline - expected). A number is
      a fixed time in ms; ``"p50"``/``"p90"``/``"p95"``/``"p99"`` learn that
      quantile of the service times reported with ``release(started_ns=)``.
    * ``order="adaptive"`` (adaptive LIFO with CoDel shedding): FIFO while the
      line drains; once it has not been empty for ``codel_interval_ms`` it is
      *standing*: the newest entry is served first and entries waiting longer
      than ``codel_target_ms`` are shed (``QueueFull("shed-standing-queue")``),
      swept from the oldest end at every hand-over and at every arrival that
      finds the line full. While not standing, entries waiting longer than the
      interval are shed the same way.

    A waiter interrupted by an exception (a signal handler's, or one raised
    into its thread) leaves the line counted ``cancelled`` and passes on a
    slot just granted to it; a blocked ``get()`` interrupted so takes nothing.
    """

    # An instance whose __init__ never completed (or whose __dict__ the
    # garbage collector cleared) finds this class default and refuses every call.
    _initialised = False

    def __init__(
        self,
        max_concurrency: int,
        max_queue: int,
        *,
        order: str = "fifo",
        on_expired: Callable[[Any], object] | None = None,
        on_dropped: Callable[[Any, BaseException], object] | None = None,
        codel_target_ms: float = DEFAULT_CODEL_TARGET_MS,
        codel_interval_ms: float = DEFAULT_CODEL_INTERVAL_MS,
        expected_service_ms: float | str | None = None,
    ) -> None:
        # A second __init__ would reset the counters and the line under the
        # threads already using them.
        if self._initialised:
            raise RuntimeError("AdmissionQueue.__init__ must not be called twice")
        # Everything is validated before anything is assigned, so a failed
        # __init__ leaves the queue refusing every call, never half-built.
        concurrency = _validate_size(max_concurrency, "max_concurrency", 1)
        waiting = _validate_size(max_queue, "max_queue", 0)
        order = _validate_order(order)
        _validate_callbacks(on_expired, on_dropped)
        adaptive = order == "adaptive"
        target_ns = codel_option_ns(codel_target_ms, "codel_target_ms", DEFAULT_CODEL_TARGET_MS, adaptive)
        interval_ns = codel_option_ns(codel_interval_ms, "codel_interval_ms", DEFAULT_CODEL_INTERVAL_MS, adaptive)
        fixed_ns, permille = expected_service_option(expected_service_ms)
        self._max_concurrency = concurrency
        self._max_queue = waiting
        self._order = order
        self._lifo = order == "lifo"
        self._on_expired = on_expired
        self._on_dropped = on_dropped
        self._codel_target_ms = float(codel_target_ms)
        self._codel_interval_ms = float(codel_interval_ms)
        self._expected_service_ms = (
            expected_service_ms if expected_service_ms is None or permille else float(expected_service_ms)
        )
        self._codel = CoDel(target_ns, interval_ns, time.monotonic_ns()) if adaptive else None
        self._estimate = ServiceEstimate(fixed_ns, permille) if fixed_ns or permille else None
        # An RLock although nothing re-enters it: Condition.wait re-takes an
        # RLock in C, uninterruptibly, whereas it re-takes a Lock with an
        # acquire() that a signal handler's exception can break off, leaving
        # wait() without the lock it must hold.
        self._lock = threading.RLock()
        self._waiting: deque[_Entry] = deque()
        self._ready: deque[_Entry] = deque()
        self._ready_cond = threading.Condition(self._lock)
        self._shutdown = False
        # The counters (see _COUNTERS); ints written under the lock.
        self._offered = 0
        self._started = 0
        self._completed = 0
        self._rejected_full = 0
        self._expired_on_arrival = 0
        self._expired_in_queue = 0
        self._cancelled = 0
        self._in_flight = 0
        self._assigned = 0
        self._queued = 0
        self._peak_in_flight = 0
        self._peak_queued = 0
        self._queue_wait_ns_total = 0
        self._insufficient_budget = 0
        self._shed = 0
        self._initialised = True

    def _check_initialised(self) -> None:
        if not self._initialised:
            raise RuntimeError(_NOT_INITIALISED)

    # -- configuration -------------------------------------------------------

    @property
    def max_concurrency(self) -> int:
        self._check_initialised()
        return self._max_concurrency

    @property
    def max_queue(self) -> int:
        self._check_initialised()
        return self._max_queue

    @property
    def order(self) -> str:
        self._check_initialised()
        return self._order

    @property
    def codel_target_ms(self) -> float:
        self._check_initialised()
        return self._codel_target_ms

    @property
    def codel_interval_ms(self) -> float:
        self._check_initialised()
        return self._codel_interval_ms

    @property
    def expected_service_ms(self) -> float | str | None:
        """The constructor's value: None (off), a fixed time in ms, or a learned quantile's name."""
        self._check_initialised()
        return self._expected_service_ms

    @property
    def expected_service_ns(self) -> int:
        """The expected service time in use now; 0 when off or not learned yet."""
        self._check_initialised()
        with self._lock:
            return self._expected_ns()

    @property
    def is_shutdown(self) -> bool:
        self._check_initialised()
        return self._shutdown

    def qsize(self) -> int:
        """Entries waiting for a slot (not counting the ones holding one)."""
        self._check_initialised()
        return self._queued

    def full(self) -> bool:
        """True when an arrival now would get ``QueueFull`` (``order="adaptive"`` may shed instead)."""
        self._check_initialised()
        return self._in_flight >= self._max_concurrency and self._queued >= self._max_queue

    def stats(self) -> dict[str, int]:
        """A consistent snapshot of the counters: they balance in every snapshot.

        Read under the lock: a thread switch can fall between two counter
        updates of one operation, and an unlocked read would see half of it.
        """
        self._check_initialised()
        with self._lock:
            snapshot = {name: getattr(self, "_" + name) for name in _COUNTERS}
            snapshot["expected_service_ns"] = self._expected_ns()
        snapshot["expired"] = snapshot["expired_on_arrival"] + snapshot["expired_in_queue"]
        snapshot["max_concurrency"] = self._max_concurrency
        snapshot["max_queue"] = self._max_queue
        return snapshot

    # -- the policies (lock held) -------------------------------------------------

    def _expected_ns(self) -> int:
        return 0 if self._estimate is None else self._estimate.ns

    def _on_service_sample(self, service_ns: int, now: int) -> None:
        """A finished slot's service time (lock held): feeds the learned estimate."""
        if self._estimate is not None:
            self._estimate.sample(service_ns)

    def _count_drop_locked(self, state: int) -> None:
        counter = _DROP_COUNTER[state]
        setattr(self, counter, getattr(self, counter) + 1)

    def _drop_locked(self, entry: _Entry, state: int, dropped: list[tuple[Any, int]]) -> None:
        """An entry out of the line leaves without a slot (``state``: why): counted,
        its gate waiter woken, or its work item added to ``dropped``."""
        self._count_drop_locked(state)
        if entry.cond is not None:
            entry.state = state
            entry.cond.notify()
        else:
            dropped.append((entry.item, state))

    def _shed_stale_locked(self, now: int, dropped: list[tuple[Any, int]]) -> None:
        """CoDel: drop the entries at the old end that waited longer than allowed now.

        One whose deadline (or effective deadline) has passed is dropped as
        that, not as shed: its caller is owed a 504, not a 503.
        """
        assert self._codel is not None
        limit = self._codel.max_sojourn(now)
        expected = self._expected_ns()
        while self._waiting and _saturate(now - self._waiting[0].enqueued_ns) > limit:
            entry = self._waiting.popleft()
            self._queued -= 1
            verdict = deadline_verdict(now, entry.deadline_ns, expected)
            self._drop_locked(entry, _SHED if verdict == VERDICT_LIVE else _drop_state(verdict), dropped)

    # -- the shared admission decision (lock held) ------------------------------

    def _admit_locked(self, deadline_ns: int, now: int, dropped: list[tuple[Any, int]]) -> bool:
        """Decide an arrival; True when it gets a slot at once, False when it must wait.

        ``offered`` is counted together with the outcome, with no call in
        between, so an interrupt never leaves an arrival counted without one:
        an arrival that must wait is counted by ``_enqueue_locked`` as it joins
        the line.
        """
        if self._shutdown:
            raise ShutDown("the admission queue is shut down")
        if self._codel is not None and not self._waiting:
            self._codel.note_empty(now)
        verdict = deadline_verdict(now, deadline_ns, self._expected_ns())
        if verdict == VERDICT_EXPIRED:
            self._offered += 1
            self._expired_on_arrival += 1
            raise DeadlineExceeded(REASON_EXPIRED_ON_ARRIVAL)
        if verdict != VERDICT_LIVE:
            self._offered += 1
            self._insufficient_budget += 1
            raise DeadlineExceeded(REASON_INSUFFICIENT_BUDGET)
        if self._in_flight < self._max_concurrency:
            # No call between taking the slot and returning (see _acquire).
            self._offered += 1
            self._in_flight += 1
            if self._in_flight > self._peak_in_flight:  # noqa: PLR1730 - max() is a call, where an interrupt could land
                self._peak_in_flight = self._in_flight
            return True
        if self._queued >= self._max_queue and self._codel is not None:
            # A full standing line makes room by shedding its stale entries first.
            self._shed_stale_locked(now, dropped)
        if self._queued >= self._max_queue:
            self._offered += 1
            self._rejected_full += 1
            raise QueueFull(REASON_QUEUE_FULL)
        return False

    def _enqueue_locked(self, entry: _Entry) -> None:
        # Counted first (offered too, see _admit_locked), then one call: an
        # interrupt finds the entry either not in line and not counted, or
        # both (see _abandon_locked).
        self._offered += 1
        self._queued += 1
        if self._queued > self._peak_queued:  # noqa: PLR1730 - max() is a call, where an interrupt could land
            self._peak_queued = self._queued
        self._waiting.append(entry)

    def _pop_next_locked(self, now: int) -> _Entry:
        newest = self._lifo or (self._codel is not None and self._codel.standing(now))
        entry = self._waiting.pop() if newest else self._waiting.popleft()
        self._queued -= 1
        return entry

    def _hand_over_locked(self, now: int, dropped: list[tuple[Any, int]]) -> None:
        """Give the slot in hand to the next live waiting entry, or free it.

        The whole hand-over happens here, under the lock and before any
        Python code outside the queue runs: every entry met on the way that
        must not start (stale for CoDel, expired, insufficient budget) leaves
        the line (work items into ``dropped``, reported by the caller after
        unlocking) and the slot reaches its new holder.
        """
        if self._codel is not None and self._waiting:
            self._shed_stale_locked(now, dropped)
        expected = self._expected_ns()
        while self._waiting:
            entry = self._pop_next_locked(now)
            verdict = deadline_verdict(now, entry.deadline_ns, expected)
            if verdict != VERDICT_LIVE:
                self._drop_locked(entry, _drop_state(verdict), dropped)
                continue
            self._assigned += 1
            if entry.cond is not None:
                entry.state = _GRANTED
                entry.cond.notify()
            else:
                self._ready.append(entry)
                self._ready_cond.notify()
            return
        self._in_flight -= 1
        if self._shutdown and self._in_flight == 0:
            self._ready_cond.notify_all()

    def _wait_total_with(self, entry: _Entry, now: int) -> int:
        """``queue_wait_ns_total`` once ``entry``, waiting since it arrived, starts at ``now``."""
        return _saturate(self._queue_wait_ns_total + _saturate(now - entry.enqueued_ns))

    def _report_dropped(self, dropped: list[tuple[Any, int]]) -> None:
        """Tell the callback about each dropped work item, in the order met (no lock held).

        A callback's Exception is logged. A BaseException (KeyboardInterrupt,
        SystemExit) does not stop the others from being told either; the
        first one is raised once every item has been reported.
        """
        on_dropped, on_expired = self._on_dropped, self._on_expired
        if on_dropped is None and on_expired is None:
            return
        interrupt: BaseException | None = None
        for item, state in dropped:
            try:
                if on_dropped is not None:
                    on_dropped(item, _drop_error(state))
                else:
                    assert on_expired is not None
                    on_expired(item)
            except Exception:  # noqa: BLE001 - a callback bug must not break the queue; it is logged
                _log.exception("prazo: %s callback raised for %r", "on_dropped" if on_dropped else "on_expired", item)
            except BaseException as exc:  # noqa: BLE001 - raised below, once every item has been told
                if interrupt is None:
                    interrupt = exc
        if interrupt is not None:
            try:
                raise interrupt
            finally:
                # The traceback holds this frame: without this, frame -> interrupt -> traceback -> frame.
                interrupt = None

    # -- gate face -----------------------------------------------------------

    def slot(self, deadline: Deadline | None = None, *, now_ns: int | None = None) -> Slot:
        """A context manager holding one slot for the body of a ``with``."""
        self._check_initialised()
        _deadline_ns(deadline)
        if now_ns is not None:
            _clock(now_ns)
        return Slot(self, deadline, now_ns)

    def acquire(self, deadline: Deadline | None = None, *, now_ns: int | None = None) -> int:
        """Take a slot, waiting in line if needed; pair with ``release()``.

        Returns the monotonic time (ns) at which the slot started: pass it to
        ``release(started_ns=)`` to report the service time. Raises
        ``QueueFull`` at once when the line is full, and ``DeadlineExceeded``
        when the deadline passes before a slot is granted (on arrival, while
        waiting, or just as the slot arrives) or the remaining budget is
        shorter than the expected service time.
        """
        self._check_initialised()
        return self._acquire(_deadline_ns(deadline), _clock(now_ns))

    def _acquire(self, deadline_ns: int, now: int) -> int:
        """Take a slot; return the monotonic time at which it started."""
        dropped: list[tuple[Any, int]] = []
        started = False
        try:
            try:
                with self._lock:
                    if self._admit_locked(deadline_ns, now, dropped):
                        self._started += 1
                        started = True
                        return now
                    entry = _Entry(deadline_ns, now, None, threading.Condition(self._lock))
                    try:
                        self._enqueue_locked(entry)
                        if dropped:
                            self._report_while_waiting(dropped)
                        self._wait_for_grant(entry)
                        now = time.monotonic_ns()
                        wait_total = self._wait_total_with(entry, now)
                        verdict = deadline_verdict(now, deadline_ns, self._expected_ns())
                        state = _drop_state(verdict)
                    except BaseException:
                        self._abandon_locked(entry, time.monotonic_ns(), dropped)
                        raise
                    # No call from here to the start, so an interrupt (a
                    # signal handler runs only at a call) lands either above,
                    # where the grant is passed on, or after the lock is let
                    # go, where the start is given back.
                    self._assigned -= 1
                    if verdict == VERDICT_LIVE:
                        self._started += 1
                        self._queue_wait_ns_total = wait_total
                        started = True
                        return now
                    # Granted, but the time ran out (or got too short) while
                    # this thread woke up: it never starts, and the slot moves on.
                    if state == _EXPIRED:
                        self._expired_in_queue += 1
                    else:
                        self._insufficient_budget += 1
                    self._hand_over_locked(now, dropped)
                    raise _drop_error(state)
            finally:
                self._report_dropped(dropped)
        except BaseException:
            if started:
                # A signal handler raised just as the lock was let go, after
                # the start (the C twin has no such moment): the caller will
                # never release this slot, so it is given back here.
                self.release()
            raise

    def _report_while_waiting(self, dropped: list[tuple[Any, int]]) -> None:
        """Report what an arrival shed, once it is in line and before it waits (the lock is let go meanwhile)."""
        items = dropped[:]
        dropped.clear()
        self._lock.release()
        try:
            self._report_dropped(items)
        finally:
            self._lock.acquire()

    def _wait_for_grant(self, entry: _Entry) -> None:
        """Wait (lock held) until the entry is granted; raise if it ends otherwise."""
        cond = entry.cond
        assert cond is not None
        while entry.state == _WAITING:
            now = time.monotonic_ns()
            # The effective deadline with the estimate current now: it may move.
            effective = effective_deadline_ns(entry.deadline_ns, self._expected_ns())
            remaining_s = (effective - now) / 1e9
            if remaining_s <= 0:
                # Active expiry: leave the line at our own (effective) deadline
                # instead of waiting to reach its head (counted before the
                # one call, see _enqueue_locked).
                state = _EXPIRED if now >= entry.deadline_ns else _INSUFFICIENT
                entry.state = state
                self._queued -= 1
                # Counted inline: no call may fall between these and the state change.
                if state == _EXPIRED:
                    self._expired_in_queue += 1
                else:
                    self._insufficient_budget += 1
                self._waiting.remove(entry)
                break
            cond.wait(min(remaining_s, _WAIT_SLICE_S))
        if entry.state == _CANCELLED:
            raise ShutDown("the admission queue was shut down while waiting")
        if entry.state != _GRANTED:
            raise _drop_error(entry.state)

    def _abandon_locked(self, entry: _Entry, now: int, dropped: list[tuple[Any, int]]) -> None:
        """A waiter leaves because of an exception (e.g. KeyboardInterrupt)."""
        if entry.state == _WAITING:
            entry.state = _CANCELLED
            self._cancelled += 1
            # The interrupt may have come before the entry joined the line.
            if entry in self._waiting:
                self._queued -= 1
                self._waiting.remove(entry)
        elif entry.state == _GRANTED:
            self._assigned -= 1
            self._cancelled += 1
            entry.state = _CANCELLED
            self._hand_over_locked(now, dropped)

    def release(self, *, now_ns: int | None = None, started_ns: int | None = None) -> None:
        """Give back a slot taken by ``acquire()``; it goes to the next live waiter.

        With ``started_ns`` (what ``acquire()`` returned), the time since then
        is a service-time sample for the policies that learn from them.
        """
        self._check_initialised()
        now = _clock(now_ns)
        started = checked_started_ns(started_ns)
        dropped: list[tuple[Any, int]] = []
        with self._lock:
            if self._in_flight - self._assigned <= 0:
                raise ValueError("release() called more times than a slot was taken")
            self._completed += 1
            if started is not None:
                self._on_service_sample(max(0, _saturate(now - started)), now)
            self._hand_over_locked(now, dropped)
        self._report_dropped(dropped)

    # -- work-queue face -------------------------------------------------------

    def put(self, item: Any, deadline: Deadline | None = None, *, now_ns: int | None = None) -> None:
        """Offer ``item``; never blocks.

        A free slot is assigned to it at once (so rejection never depends on
        how fast consumers wake up); otherwise it waits in line. Raises
        ``QueueFull`` or ``DeadlineExceeded`` (``expired-on-arrival``,
        ``insufficient-budget``).
        """
        self._check_initialised()
        deadline_ns = _deadline_ns(deadline)
        now = _clock(now_ns)
        dropped: list[tuple[Any, int]] = []
        try:
            with self._lock:
                entry = _Entry(deadline_ns, now, item, None)
                if self._admit_locked(deadline_ns, now, dropped):
                    self._assigned += 1
                    self._ready.append(entry)
                    self._ready_cond.notify()
                else:
                    self._enqueue_locked(entry)
        finally:
            self._report_dropped(dropped)

    def put_nowait(self, item: Any, deadline: Deadline | None = None, *, now_ns: int | None = None) -> None:
        """Same as ``put`` (which never blocks); named after ``queue.Queue``."""
        self.put(item, deadline, now_ns=now_ns)

    def get(self, block: bool = True, timeout: float | None = None, *, now_ns: int | None = None) -> Any:
        """Take the next live item that holds a slot; pair with ``task_done()``.

        Items that expired (or whose budget got too short) after their slot
        was assigned are reported through the callback and skipped. Raises
        ``queue.Empty`` when nothing is ready (at once, or after ``timeout``
        seconds), and ``ShutDown`` once the queue is shut down and nothing is
        left to hand out.
        """
        self._check_initialised()
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be a number or None, not {type(timeout).__name__}")
            if not timeout >= 0:
                raise ValueError("'timeout' must be a non-negative number")
        if now_ns is not None:
            _clock(now_ns)
        end = None if timeout is None or timeout >= _UNBOUNDED_TIMEOUT_S else time.monotonic() + timeout
        while True:
            dropped: list[tuple[Any, int]] = []
            try:
                with self._lock:
                    if self._ready:
                        entry = self._ready[0]
                        now = _clock(now_ns)
                        wait_total = self._wait_total_with(entry, now)
                        verdict = deadline_verdict(now, entry.deadline_ns, self._expected_ns())
                        state = _drop_state(verdict)
                        # No call from the take to the start (see _acquire).
                        del self._ready[0]
                        self._assigned -= 1
                        if verdict == VERDICT_LIVE:
                            self._started += 1
                            self._queue_wait_ns_total = wait_total
                            return entry.item
                        # Its slot came too late: the slot moves on, then it
                        # is reported (finally), then we look again.
                        if state == _EXPIRED:
                            self._expired_in_queue += 1
                        else:
                            self._insufficient_budget += 1
                        dropped.append((entry.item, state))
                        self._hand_over_locked(now, dropped)
                        continue
                    if self._shutdown and not self._waiting:
                        raise ShutDown("the admission queue is shut down")
                    if not block:
                        raise queue.Empty
                    remaining = _WAIT_SLICE_S if end is None else end - time.monotonic()
                    if remaining <= 0:
                        raise queue.Empty
                    self._ready_cond.wait(min(remaining, _WAIT_SLICE_S))
            finally:
                self._report_dropped(dropped)

    def get_nowait(self, *, now_ns: int | None = None) -> Any:
        """``get(block=False)``."""
        return self.get(False, now_ns=now_ns)

    def task_done(self, *, now_ns: int | None = None, started_ns: int | None = None) -> None:
        """Give back the slot of an item taken by ``get()`` (``started_ns``: see ``release``)."""
        self.release(now_ns=now_ns, started_ns=started_ns)

    def expire_overdue(self, *, now_ns: int | None = None) -> int:
        """Remove every waiting entry whose deadline (or effective deadline) has passed; return how many.

        Gate waiters already leave at their own deadline; this is how work
        items, which cannot wake themselves, get the same treatment.
        """
        self._check_initialised()
        now = _clock(now_ns)
        dropped: list[tuple[Any, int]] = []
        with self._lock:
            keep: deque[_Entry] = deque()
            count = 0
            expected = self._expected_ns()
            for entry in self._waiting:
                verdict = deadline_verdict(now, entry.deadline_ns, expected)
                if verdict != VERDICT_LIVE:
                    self._queued -= 1
                    self._drop_locked(entry, _drop_state(verdict), dropped)
                    count += 1
                else:
                    keep.append(entry)
            self._waiting = keep
        self._report_dropped(dropped)
        return count

    def cancel(self, item: Any) -> bool:
        """Take a waiting work item out of the line (the first one that ``is`` it).

        Returns True when it was waiting (it is counted ``cancelled`` and will
        never be handed out), False when it was not in line (already holding a
        slot, taken, expired or never put).
        """
        self._check_initialised()
        with self._lock:
            for entry in self._waiting:
                if entry.cond is None and entry.item is item:
                    self._waiting.remove(entry)
                    self._queued -= 1
                    self._cancelled += 1
                    return True
        return False

    def shutdown(self, *, cancel_waiting: bool = False) -> list[Any]:
        """Refuse new arrivals with ``ShutDown``; optionally cancel the waiting line.

        Entries already holding a slot always finish. With
        ``cancel_waiting=True`` every waiting entry is removed and counted
        ``cancelled``: gate waiters raise ``ShutDown`` and the work items are
        returned (oldest first) so the caller can answer them.
        """
        self._check_initialised()
        cancelled: list[Any] = []
        with self._lock:
            self._shutdown = True
            if cancel_waiting:
                while self._waiting:
                    entry = self._waiting.popleft()
                    self._queued -= 1
                    self._cancelled += 1
                    if entry.cond is not None:
                        entry.state = _CANCELLED
                        entry.cond.notify()
                    else:
                        cancelled.append(entry.item)
            self._ready_cond.notify_all()
        return cancelled

    def __repr__(self) -> str:
        if not self._initialised:
            return f"<{type(self).__module__}.{type(self).__name__} (not initialised)>"
        return (
            f"<{type(self).__module__}.{type(self).__name__} max_concurrency={self._max_concurrency} "
            f"max_queue={self._max_queue} order={self.order!r} in_flight={self._in_flight} queued={self._queued}>"
        )
