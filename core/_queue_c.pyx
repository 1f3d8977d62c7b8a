# cython: freethreading_compatible = True, embedsignature.format = clinic
"""The C twin of the admission queue (see ``_queue_py.py`` for the specification).

Same API and same observable outcomes as the Python twin; what differs is how:

* the waiting line is ``prazo_line.h``'s ring of ``max_queue`` entries,
  allocated once (the same C line the front door's engine runs: arrival
  decision, hand-over, drops, counters), and the hand-off buffer a ring of
  ``max_concurrency`` entries; the line names its entries by tokens (a gate
  waiter or a work item), this file turns them back into Python;
* a pthread mutex guards both, held only for O(1) work (O(n) only when an
  entry leaves from the middle of the line or while a critical entry waits or
  evicts, O(entries shed) when CoDel sheds,
  and a bounded rescan of the histogram buckets every 16th learned service
  sample) and never while Python code runs or while this thread waits for the
  GIL, so correctness never rests on the GIL;
* counters are C11 atomics written under the mutex: ``qsize()`` and
  ``full()`` read one or two without it, ``stats()`` copies them all under it
  so that every snapshot balances;
* waiting releases the GIL and sleeps on a condition variable that times out
  on CLOCK_MONOTONIC; each gate waiter has its own condition, so a release
  wakes exactly the thread it hands its slot to.

The mutex is taken while holding the GIL on the fast path (cheaper than
releasing the GIL); that is deadlock-free because a thread holding the mutex
never asks for the GIL. The garbage collector's traversal takes the mutex too
(see the end of this file), so a thread holding it must also never create or
release a Python object, which could start a collection on that thread.

Why one file of about 1 250 lines: a Cython extension type is one module, and
the two faces (gate and work queue) share the ring, the mutex and the
reporting of dropped items; it follows ``_queue_py.py`` section by section.
"""

cimport cython
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_DECREF, Py_XDECREF
from libc.stdint cimport int64_t, uint64_t, uintptr_t, INT64_MAX
from libc.stdlib cimport malloc, free

cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1
    # Declared here with PyObject * and noexcept, as the collector calls them.
    ctypedef int (*visitproc)(PyObject *, void *) noexcept
    ctypedef int (*traverseproc)(PyObject *, visitproc, void *) noexcept
    ctypedef int (*inquiry)(PyObject *) noexcept
    ctypedef struct PyTypeObject:
        unsigned long tp_flags
        traverseproc tp_traverse
        inquiry tp_clear
    unsigned long Py_TPFLAGS_HAVE_GC

import queue as _stdlib_queue

from ._checkpoint import checkpoint as _checkpoint
from ._policy_py import (
    DEFAULT_CODEL_INTERVAL_MS,
    DEFAULT_CODEL_TARGET_MS,
    checked_started_ns,
    codel_option_ns,
    critical_option,
    expected_service_option,
    limit_option,
    reserved_option,
)
from .deadline import Deadline as _Deadline
from .errors import (
    DeadlineExceeded,
    QueueFull,
    ShutDown,
    REASON_EVICTED,
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    REASON_INSUFFICIENT_BUDGET,
    REASON_QUEUE_FULL,
    REASON_SHED,
)

__all__ = ["AdmissionQueue", "Slot", "NO_DEADLINE_NS"]

NO_DEADLINE_NS = INT64_MAX

cdef object _Empty = _stdlib_queue.Empty

# Waiting happens in slices so a signal (Ctrl-C) reaches the main thread
# even while it waits for a slot with no deadline.
cdef int64_t _SIGNAL_SLICE_NS = 100000000

# A gate waiter's states; the last five are the line's drop reasons
# (PRAZO_DROP_*), why an entry left the line without a slot.
cdef enum:
    _WAITING = 0
    _GRANTED = 1
    _CANCELLED = 2
    _EXPIRED = 3
    _INSUFFICIENT = 4
    _SHED = 5
    _EVICTED = 6

if (_CANCELLED, _EXPIRED, _INSUFFICIENT, _SHED, _EVICTED) != (
        PRAZO_DROP_CANCELLED, PRAZO_DROP_EXPIRED, PRAZO_DROP_INSUFFICIENT, PRAZO_DROP_SHED, PRAZO_DROP_EVICTED):
    raise ImportError("prazo: the waiter states and prazo_line.h's drop reasons disagree; rebuild the C twin")

# A get() timeout this long (about 31.7 years) or longer waits like timeout=None.
cdef double _UNBOUNDED_TIMEOUT_S = 1e9

_COUNTER_NAMES = (
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
    "evicted",
    "critical_started",
)

# Counters (prazo_line.h's) is a struct of atomics only, in the order of _COUNTER_NAMES.
cdef Py_ssize_t _N_COUNTERS = sizeof(Counters) // sizeof(prazo_atomic_i64)
if _N_COUNTERS != len(_COUNTER_NAMES):
    raise ImportError("prazo: the Counters struct and _COUNTER_NAMES disagree; rebuild the C twin")

_NOT_INITIALISED = ("the AdmissionQueue is not initialised: its __init__ did not complete "
                    "(or the garbage collector has cleared it)")


cdef extern from "prazo_slots.h":
    Py_ssize_t prazo_slot_offset(object descr)
    PyObject *prazo_slot_value(object obj, Py_ssize_t offset)
    object prazo_reuse_int(PyObject **cache, int64_t value)

# The int acquire() returned last, rewritten for the next when nobody kept it.
cdef PyObject *_start_int = NULL

cdef type _DeadlineType = _Deadline
# Where Deadline keeps its `_ns` slot, so the hot path reads it directly.
cdef Py_ssize_t _DEADLINE_NS_OFFSET = prazo_slot_offset(_Deadline.__dict__["_ns"])


cdef inline int64_t _deadline_ns(object deadline) except? -1:
    cdef PyObject *ns
    if deadline is None:
        return INT64_MAX
    if type(deadline) is _DeadlineType and _DEADLINE_NS_OFFSET >= 0:
        ns = prazo_slot_value(deadline, _DEADLINE_NS_OFFSET)
        if ns != NULL:
            return <object>ns
    if isinstance(deadline, _DeadlineType):
        return deadline._ns
    raise TypeError(f"deadline must be a prazo.core.Deadline or None, not {type(deadline).__name__}")


cdef inline int64_t _clock(object now_ns) except? -1:
    if now_ns is None:
        return prazo_monotonic_ns()
    if isinstance(now_ns, bool) or not isinstance(now_ns, int):
        raise TypeError(f"now_ns must be an int of monotonic nanoseconds, not {type(now_ns).__name__}")
    try:
        return now_ns
    except OverflowError:
        raise ValueError("now_ns is out of range for a 64-bit monotonic clock") from None


cdef inline int64_t _started(object started_ns) except? -2:
    """``release(started_ns=)`` as the C side spells it: -1 for None (no sample)."""
    if started_ns is None:
        return -1
    if type(started_ns) is int and 0 <= started_ns <= INT64_MAX:
        return started_ns
    return checked_started_ns(started_ns)  # the other ints, and the errors naming the argument


cdef inline bint _critical(object critical) except -1:
    if critical is False:
        return False
    if critical is True:
        return True
    return critical_option(critical)  # the error naming the argument


cdef object _validate_size(object value, str name, int minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > 2**31 - 1:
        raise ValueError(f"{name} must be < 2**31, got {value}")
    return value


cdef object _admission_error(int outcome):
    if outcome == PRAZO_ADMIT_SHUTDOWN:
        return ShutDown("the admission queue is shut down")
    if outcome == PRAZO_ADMIT_EXPIRED:
        return DeadlineExceeded(REASON_EXPIRED_ON_ARRIVAL)
    if outcome == PRAZO_ADMIT_INSUFFICIENT:
        return DeadlineExceeded(REASON_INSUFFICIENT_BUDGET)
    return QueueFull(REASON_QUEUE_FULL)


cdef object _drop_error(int state):
    """The exception that answers an entry dropped from the line in ``state``."""
    if state == _INSUFFICIENT:
        return DeadlineExceeded(REASON_INSUFFICIENT_BUDGET)
    if state == _SHED:
        return QueueFull(REASON_SHED)
    if state == _EVICTED:
        return QueueFull(REASON_EVICTED)
    return DeadlineExceeded(REASON_EXPIRED_IN_QUEUE)


cdef inline int _check_initialised(AdmissionQueue queue) except -1:
    if not prazo_flag_is_set(&queue._initialised):
        raise RuntimeError(_NOT_INITIALISED)
    return 0


cdef void _log_callback_error(str name, object item):
    import logging

    logging.getLogger("prazo").exception("prazo: %s callback raised for %r", name, item)


cdef int _check_interrupts() except -1:
    """Raise what a signal handler or another thread wants this thread to raise.

    A wait with the GIL released runs no bytecode, so nothing is delivered
    during it: PyErr_CheckSignals runs the signal handlers, and running a line
    of Python lets the interpreter raise a pending asynchronous exception
    (PyThreadState_SetAsyncExc) here, before this thread takes a slot or an
    item it could not hand back.
    """
    PyErr_CheckSignals()
    _checkpoint()
    return 0


# -- tokens: how the line names a gate waiter or a work item ---------------------
#
# Both are at least 8-byte aligned, so the lowest bit is free to tell them apart.

cdef inline uint64_t _item_token(PyObject *item) noexcept nogil:
    return <uint64_t><uintptr_t>item


cdef inline uint64_t _waiter_token(Waiter *waiter) noexcept nogil:
    return (<uint64_t><uintptr_t>waiter) | 1


cdef inline Waiter *_token_waiter(uint64_t token) noexcept nogil:
    if token & 1:
        return <Waiter *><uintptr_t>(token & ~(<uint64_t>1))
    return NULL


cdef inline PyObject *_token_item(uint64_t token) noexcept nogil:
    if token & 1:
        return NULL
    return <PyObject *><uintptr_t>token


cdef void _wake_dropped(Expired *dropped) noexcept nogil:
    """With the mutex held: wake each gate waiter the line dropped, with its reason as its state.

    Only the work items stay in ``dropped``, to be reported once the mutex is released.
    """
    cdef Py_ssize_t i, kept = 0
    cdef Waiter *waiter
    for i in range(dropped.count):
        waiter = _token_waiter(dropped.items[i].token)
        if waiter != NULL:
            waiter.state = dropped.items[i].reason
            pthread_cond_signal(&waiter.cond)
        else:
            dropped.items[kept] = dropped.items[i]
            kept += 1
    dropped.count = kept


@cython.freelist(64)
cdef class Slot:
    """Context manager returned by ``AdmissionQueue.slot()``.

    ``__enter__`` waits for a slot (or raises ``QueueFull`` /
    ``DeadlineExceeded`` before the body runs); ``__exit__`` releases it.
    """

    cdef AdmissionQueue _queue
    cdef int64_t _deadline_ns
    cdef int64_t _now_ns
    cdef bint _fake_now
    cdef bint _held
    cdef bint _critical
    cdef readonly int64_t started_ns

    def __cinit__(self):
        self._held = False
        self.started_ns = 0

    @cython.binding(False)
    def __enter__(self):
        if self._queue is None:
            raise RuntimeError("this Slot was not made by AdmissionQueue.slot()")
        if self._held:
            raise RuntimeError("this slot is already held; call q.slot() again for another")
        self.started_ns = self._queue._acquire_class(
            self._deadline_ns, self._now_ns if self._fake_now else prazo_monotonic_ns(), self._critical)
        self._held = True
        return self

    @cython.binding(False)
    def __exit__(self, exc_type, exc, tb):
        if self._held:
            self._held = False
            # A service-time sample only on the real clock: a slot entered on
            # a fake clock has a start that the real release time cannot meet.
            self._queue._release_class(-1, True, -1 if self._fake_now else self.started_ns, self._critical)
        return None


cdef class AdmissionQueue:
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
    (expired, insufficient budget, shed, evicted by a critical arrival), once
    the operation that met it is complete, in the order met; ``error`` is the
    exception to answer it with. ``on_expired(item)`` is the older form
    without the error (both at once are refused): it is called for the items
    that expired, had too little budget or were shed, but NOT for evicted
    ones. A callback's Exception is logged; the first BaseException is raised
    once every item has been reported. The policies (``order="adaptive"``,
    ``expected_service_ms``, ``limit="vegas"``, ``reserved``) are described
    in ``_queue_py.py``.

    A waiter interrupted by an exception (a signal handler's, or one raised
    into its thread) leaves the line counted ``cancelled`` and passes on a
    slot just granted to it; a blocked ``get()`` interrupted so takes nothing.
    """

    def __cinit__(self, *args, **kwargs):
        # Until __init__ succeeds every method refuses (_check_initialised),
        # and _line == NULL says no C resource is owned yet.
        self._line = NULL
        self._c = NULL
        self._ready = NULL
        prazo_flag_clear(&self._initialised)

    def __init__(self, max_concurrency, max_queue, *, order="fifo", on_expired=None, on_dropped=None,
                 codel_target_ms=DEFAULT_CODEL_TARGET_MS, codel_interval_ms=DEFAULT_CODEL_INTERVAL_MS,
                 expected_service_ms=None, limit="fixed", min_concurrency=1, reserved=0):
        cdef prazo_line *line
        cdef Entry *ready
        cdef Py_ssize_t concurrency, waiting, ring_cap
        cdef int64_t target_ns, interval_ns, fixed_ns
        cdef int permille
        cdef bint adaptive
        # A second __init__ would reset the counters and the rings under the
        # threads already using them.
        if self._line != NULL:
            raise RuntimeError("AdmissionQueue.__init__ must not be called twice")
        # Everything is validated and allocated before anything is assigned,
        # so a failed __init__ leaves the queue as __new__ made it (refusing
        # every call) and never half-built: a zero capacity would divide by zero.
        concurrency = _validate_size(max_concurrency, "max_concurrency", 1)
        waiting = _validate_size(max_queue, "max_queue", 0)
        if not isinstance(order, str):
            raise TypeError(f"order must be 'fifo', 'lifo' or 'adaptive', not {type(order).__name__}")
        if order not in ("fifo", "lifo", "adaptive"):
            raise ValueError(f"order must be 'fifo', 'lifo' or 'adaptive', got {order!r}")
        if on_expired is not None and not callable(on_expired):
            raise TypeError("on_expired must be callable or None")
        if on_dropped is not None and not callable(on_dropped):
            raise TypeError("on_dropped must be callable or None")
        if on_expired is not None and on_dropped is not None:
            raise ValueError("pass on_expired or on_dropped, not both: on_dropped(item, error) sees every dropped item")
        adaptive = order == "adaptive"
        target_ns = codel_option_ns(codel_target_ms, "codel_target_ms", DEFAULT_CODEL_TARGET_MS, adaptive)
        interval_ns = codel_option_ns(codel_interval_ms, "codel_interval_ms", DEFAULT_CODEL_INTERVAL_MS, adaptive)
        fixed_ns, permille = expected_service_option(expected_service_ms)
        use_vegas, floor = limit_option(limit, min_concurrency, concurrency)
        kept = reserved_option(reserved, concurrency)
        # One extra entry so a max_queue of 0 still gets a valid allocation.
        ring_cap = waiting if waiting > 0 else 1
        line = <prazo_line *>malloc(prazo_line_size(ring_cap))
        ready = <Entry *>malloc(concurrency * sizeof(Entry))
        try:
            if line == NULL or ready == NULL:
                raise MemoryError("cannot allocate the admission ring")
            if pthread_mutex_init(&self._mutex, NULL) != 0:
                raise OSError("pthread_mutex_init failed")
            if prazo_cond_init_monotonic(&self._ready_cond) != 0:
                pthread_mutex_destroy(&self._mutex)
                raise OSError("pthread_cond_init failed")
        except BaseException:
            free(line)
            free(ready)
            raise
        self._max_concurrency = concurrency
        self._max_queue = waiting
        self._order = order
        prazo_line_init(
            line, ring_cap, waiting, concurrency,
            PRAZO_LINE_ADAPTIVE if adaptive else (PRAZO_LINE_LIFO if order == "lifo" else PRAZO_LINE_FIFO),
            PRAZO_LINE_ASSIGN, target_ns, interval_ns, prazo_monotonic_ns(), fixed_ns, permille, use_vegas, floor, kept)
        self._codel_target_ms = float(codel_target_ms)
        self._codel_interval_ms = float(codel_interval_ms)
        self._expected_service_ms = (
            expected_service_ms if expected_service_ms is None or permille else float(expected_service_ms))
        self._on_expired = on_expired
        self._on_dropped = on_dropped
        self._use_vegas = use_vegas
        self._learns = use_vegas or permille > 0
        self._min_concurrency = floor
        self._reserved = kept
        self._ready_cap = concurrency
        self._ready_head = self._ready_count = 0
        self._ready_sleepers = self._ready_owed = 0
        self._ready = ready
        self._c = &line.c
        self._line = line
        # Last, with release ordering: a thread that sees it set (acquire) sees the whole line.
        prazo_flag_set(&self._initialised)

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._line == NULL:
            return
        for i in range(self._line.count):
            Py_XDECREF(_token_item(prazo_line_at(self._line, i).token))
        for i in range(self._ready_count):
            Py_XDECREF(_token_item(self._ready[(self._ready_head + i) % self._ready_cap].token))
        free(self._line)
        free(self._ready)
        pthread_cond_destroy(&self._ready_cond)
        pthread_mutex_destroy(&self._mutex)

    # -- configuration -------------------------------------------------------

    @property
    def max_concurrency(self):
        _check_initialised(self)
        return self._max_concurrency

    @property
    def max_queue(self):
        _check_initialised(self)
        return self._max_queue

    @property
    def order(self):
        _check_initialised(self)
        return self._order

    @property
    def codel_target_ms(self):
        _check_initialised(self)
        return self._codel_target_ms

    @property
    def codel_interval_ms(self):
        _check_initialised(self)
        return self._codel_interval_ms

    @property
    def expected_service_ms(self):
        """The constructor's value: None (off), a fixed time in ms, or a learned quantile's name."""
        _check_initialised(self)
        return self._expected_service_ms

    @property
    def expected_service_ns(self):
        """The expected service time in use now; 0 when off or not learned yet."""
        cdef int64_t expected
        _check_initialised(self)
        pthread_mutex_lock(&self._mutex)
        expected = prazo_line_expected_ns(self._line)
        pthread_mutex_unlock(&self._mutex)
        return expected

    @property
    def is_shutdown(self):
        cdef bint shutdown
        _check_initialised(self)
        # Under the mutex: shutdown() writes it there, and without a GIL a reader runs at the same time.
        pthread_mutex_lock(&self._mutex)
        shutdown = self._line.shutdown
        pthread_mutex_unlock(&self._mutex)
        return shutdown

    @property
    def retry_after_ns(self):
        """The wait to suggest to a caller refused now, in ns; 0 before the line has measured its drain.

        The line ahead (waiting entries + 1) at the measured time between
        completions, within [that time, 60 s]; the overload refusals'
        ``Retry-After`` (docs/design.md, "Retry-After from the drain rate").
        """
        _check_initialised(self)
        return prazo_line_retry_after_ns(self._line)

    @property
    def limit(self):
        """The current concurrency limit (``max_concurrency`` unless ``limit="vegas"`` moves it)."""
        _check_initialised(self)
        return prazo_load(&self._line.limit)

    @property
    def limit_policy(self):
        """The ``limit`` argument: ``"fixed"`` or ``"vegas"``."""
        _check_initialised(self)
        return "vegas" if self._use_vegas else "fixed"

    @property
    def min_concurrency(self):
        _check_initialised(self)
        return self._min_concurrency

    @property
    def reserved(self):
        """Slots kept for critical arrivals (normal ones borrow them while the class is idle)."""
        _check_initialised(self)
        return self._reserved

    def qsize(self):
        """Entries waiting for a slot (not counting the ones holding one)."""
        _check_initialised(self)
        return prazo_load(&self._c.queued)

    def full(self):
        """True when an arrival now would get ``QueueFull`` (``order="adaptive"`` may shed instead)."""
        cdef bint full
        _check_initialised(self)
        pthread_mutex_lock(&self._mutex)
        full = prazo_line_full(self._line)
        pthread_mutex_unlock(&self._mutex)
        return full

    def stats(self):
        """A consistent snapshot of the counters: they balance in every snapshot.

        Every counter is written with the mutex held, but some writers run
        without the GIL (a waiter leaving at its own deadline), so reading
        the atomics one by one could catch half of an update; copying them
        under the mutex cannot. The mutex may be taken with the GIL held
        because no thread holding it ever asks for the GIL.
        """
        cdef Counters copy
        cdef prazo_atomic_i64 *fields = <prazo_atomic_i64 *>self._c
        cdef prazo_atomic_i64 *copied = <prazo_atomic_i64 *>&copy
        cdef Py_ssize_t i
        cdef int64_t expected, limit
        _check_initialised(self)
        pthread_mutex_lock(&self._mutex)
        for i in range(_N_COUNTERS):
            prazo_store(&copied[i], prazo_load(&fields[i]))
        expected = prazo_line_expected_ns(self._line)
        limit = prazo_load(&self._line.limit)
        pthread_mutex_unlock(&self._mutex)
        snapshot = {}
        for i in range(_N_COUNTERS):
            snapshot[_COUNTER_NAMES[i]] = prazo_load(&copied[i])
        snapshot["expected_service_ns"] = expected
        snapshot["limit"] = limit
        snapshot["expired"] = snapshot["expired_on_arrival"] + snapshot["expired_in_queue"]
        snapshot["max_concurrency"] = self._max_concurrency
        snapshot["max_queue"] = self._max_queue
        return snapshot

    # -- the line (mutex held, no Python) -----------------------------------------
    #
    # The ring and its policies are prazo_line.h's; what stays here is what
    # only this queue has: gate waiters to wake and the hand-off buffer of
    # work items that hold a slot until get() takes them.

    cdef void _ready_push(self, Entry entry) noexcept nogil:
        """With the mutex held: hand a work item holding a slot to get().

        A consumer asleep in get() is owed a signal, sent once the mutex is
        released (_unlock_signalling_ready): signalled under it, a woken
        consumer on a busy CPU would run only to block on the mutex. Nobody
        asleep, no signal: the consumer that made the slot free takes the
        item at its next get().
        """
        self._ready[(self._ready_head + self._ready_count) % self._ready_cap] = entry
        self._ready_count += 1
        if self._ready_owed < self._ready_sleepers:
            self._ready_owed += 1

    cdef void _unlock_signalling_ready(self) noexcept nogil:
        """Release the mutex, then wake the consumers _ready_push owes a signal."""
        cdef Py_ssize_t owed = self._ready_owed
        self._ready_owed = 0
        pthread_mutex_unlock(&self._mutex)
        while owed > 0:
            pthread_cond_signal(&self._ready_cond)
            owed -= 1

    cdef int _admit(self, int64_t deadline_ns, int64_t now, bint critical, Expired *dropped) noexcept nogil:
        """Count an arrival and decide: start now, wait, or refuse (``prazo_line_admit``).

        Gate waiters shed or evicted to make room are woken here; work items
        dropped so stay in ``dropped``.
        """
        cdef int outcome = prazo_line_admit(self._line, deadline_ns, now, critical, dropped)
        if dropped.count:
            _wake_dropped(dropped)
        return outcome

    cdef bint _dismiss(self, Entry entry, int state, Expired *expired) noexcept nogil:
        """An entry taken off the line without a slot: wake its gate waiter with
        ``state``, or add its work item to ``expired`` for the caller to answer.

        False (nothing done) only when a work item finds no room in
        ``expired`` because memory ran out.
        """
        cdef Waiter *waiter = _token_waiter(entry.token)
        if waiter != NULL:
            waiter.state = state
            pthread_cond_signal(&waiter.cond)
            return True
        return prazo_line_drops_push(expired, entry.token, state)

    cdef void _hand_over(self, int64_t now, Expired *expired, Waiter **granted) noexcept nogil:
        """A slot came back (the caller gave it back to the line): hand free slots
        to the next live entries while they may start.

        The whole hand-over happens here, with the mutex held and before any
        Python code runs: ``prazo_line_next`` takes each next entry, and every
        entry met on the way that must not start (stale for CoDel, expired,
        insufficient budget) leaves the line (gate waiters are woken, work
        items go into ``expired`` for the caller to report after unlocking).
        Usually one slot moves; several when the limit has just risen. The
        first gate waiter given a slot is returned in ``granted`` for the
        caller to signal after unlocking; any further one is signalled here
        (it cannot wake before the mutex is let go anyway).
        """
        cdef Entry entry
        cdef Waiter *waiter
        # PRAZO_NEXT_UNREPORTED (out of memory for reporting) is handed over
        # like a live entry: its gate waiter or get() checks the deadline
        # again and passes the slot on, so it still never starts and the slot
        # is not lost.
        while prazo_line_next(self._line, now, expired, &entry) != PRAZO_NEXT_NONE:
            prazo_add(&self._c.assigned, 1)
            waiter = _token_waiter(entry.token)
            if waiter != NULL:
                waiter.state = _GRANTED
                # The releaser's clock was read before the lock: never grant
                # before the waiter arrived.
                waiter.granted_ns = now if now > entry.enqueued_ns else entry.enqueued_ns
                if granted[0] == NULL:
                    waiter.handed = True
                    granted[0] = waiter
                else:
                    pthread_cond_signal(&waiter.cond)
            else:
                self._ready_push(entry)
        _wake_dropped(expired)
        if self._line.shutdown and prazo_load(&self._c.in_flight) == 0:
            pthread_cond_broadcast(&self._ready_cond)

    cdef void _hand_over_unlock(self, int64_t now, Expired *expired) noexcept nogil:
        """With the mutex held: hand the slot over, unlock, then wake the waiter granted it."""
        cdef Waiter *granted = NULL
        self._hand_over(now, expired, &granted)
        self._unlock_signalling_ready()
        if granted != NULL:
            pthread_cond_signal(&granted.cond)
            prazo_flag_set(&granted.signalled)

    # -- reporting expired work items (GIL held, mutex not held) ----------------

    cdef int _report(self, Expired *expired) except -1:
        """Tell the callback about each dropped item, in the order met, and free ``expired``.

        ``on_dropped(item, error)``, or ``on_expired(item)``. A callback's
        Exception is logged. A BaseException (KeyboardInterrupt, SystemExit)
        does not stop the others from being told either; the first one is
        raised once every item has been reported.
        """
        cdef Py_ssize_t i
        cdef object item
        cdef object interrupt = None
        for i in range(expired.count):
            item = <object>_token_item(expired.items[i].token)
            Py_DECREF(item)  # the ring's reference; `item` keeps one of its own
            if self._on_dropped is None and self._on_expired is None:
                continue
            try:
                if self._on_dropped is not None:
                    self._on_dropped(item, _drop_error(expired.items[i].reason))
                elif expired.items[i].reason != _EVICTED:
                    # on_expired predates eviction; an evicted item is a 503
                    # for live work, which only on_dropped can express.
                    self._on_expired(item)
            except Exception:
                _log_callback_error("on_dropped" if self._on_dropped is not None else "on_expired", item)
            except BaseException as exc:
                if interrupt is None:
                    interrupt = exc
        prazo_line_drops_free(expired)
        if interrupt is not None:
            raise interrupt
        return 0

    # -- gate face -----------------------------------------------------------

    @cython.binding(False)
    def slot(self, deadline=None, *, critical=False, now_ns=None):
        """A context manager holding one slot for the body of a ``with``.

        Its ``__exit__`` gives the slot back with the slot's own start time,
        so the queue learns the body's service time (``limit="vegas"``,
        learned ``expected_service_ms``).
        """
        _check_initialised(self)
        cdef Slot s = Slot.__new__(Slot)
        s._queue = self
        s._deadline_ns = _deadline_ns(deadline)
        s._critical = _critical(critical)
        if now_ns is None:
            s._fake_now = False
        else:
            s._now_ns = _clock(now_ns)
            s._fake_now = True
        return s

    @cython.binding(False)
    def acquire(self, deadline=None, *, critical=False, now_ns=None):
        """Take a slot, waiting in line if needed; pair with ``release()``.

        Returns the monotonic time (ns) at which the slot became the caller's
        (on arrival, or when it was handed over from the line): pass it back
        as ``release(started_ns=...)`` so the queue learns the service time.
        A ``critical`` arrival may use the reserved slots and is served first;
        release its slot with ``release(critical=True)``.

        Raises ``QueueFull`` at once when the line is full (or when a critical
        arrival evicts this waiter), and ``DeadlineExceeded`` when the
        deadline passes before a slot is granted (on arrival, while waiting,
        or just as the slot arrives) or the remaining budget is shorter than
        the expected service time.
        """
        _check_initialised(self)
        return prazo_reuse_int(&_start_int, self._acquire_class(_deadline_ns(deadline), _clock(now_ns),
                                                                _critical(critical)))

    cdef int64_t _acquire(self, int64_t deadline_ns, int64_t now) except? -1:
        """Take a normal slot; returns the monotonic time at which it started."""
        return self._acquire_class(deadline_ns, now, False)

    cdef int64_t _acquire_class(self, int64_t deadline_ns, int64_t now, bint critical) except? -1:
        """Take a slot of this class; returns the monotonic time at which it became this caller's."""
        cdef int outcome
        cdef Expired dropped
        # A signal that arrived before this call (e.g. while this thread waited
        # for the GIL) is raised now, before the slot is taken: after the
        # return it would be raised in the caller, with the slot leaked.
        PyErr_CheckSignals()
        prazo_line_drops_init(&dropped)
        pthread_mutex_lock(&self._mutex)
        outcome = self._admit(deadline_ns, now, critical, &dropped)
        if outcome == PRAZO_ADMIT_START:
            prazo_line_count_start(self._line, now, now, critical)
            pthread_mutex_unlock(&self._mutex)
            return now
        if outcome != PRAZO_ADMIT_WAIT:
            pthread_mutex_unlock(&self._mutex)
            self._report(&dropped)
            raise _admission_error(outcome)
        return self._wait_in_line(deadline_ns, now, critical, &dropped)

    cdef int64_t _wait_in_line(self, int64_t deadline_ns, int64_t now, bint critical, Expired *dropped) except? -1:
        """Called with the mutex held; returns the start time (the grant) of a started slot, or raises.

        ``dropped`` holds the entries the arrival shed or evicted to make
        room; they are reported once this waiter is in line and the mutex is
        released.
        """
        cdef Waiter waiter
        cdef Entry entry
        cdef int state
        cdef Expired expired
        cdef int verdict
        if prazo_cond_init_monotonic(&waiter.cond) != 0:
            pthread_mutex_unlock(&self._mutex)
            self._report(dropped)
            raise OSError("pthread_cond_init failed")
        waiter.state = _WAITING
        waiter.handed = False
        waiter.critical = critical
        waiter.granted_ns = now
        prazo_flag_clear(&waiter.signalled)
        entry.deadline_ns = deadline_ns
        entry.enqueued_ns = now
        entry.token = _waiter_token(&waiter)
        entry.critical = critical
        prazo_line_push(self._line, &entry)
        pthread_mutex_unlock(&self._mutex)
        try:
            self._report(dropped)
            while True:
                with nogil:
                    state = self._wait_slice(&waiter, deadline_ns)
                # Also after a grant, as the Python twin does: an interrupt
                # that arrived during the wait wins, and the slot moves on.
                _check_interrupts()
                if state != _WAITING:
                    break
        except BaseException:
            self._abandon(&waiter)
            raise
        finally:
            # Every path that leaves has taken the waiter off the line and
            # waited for any granter to finish signalling it.
            pthread_cond_destroy(&waiter.cond)
        if state == _CANCELLED:
            raise ShutDown("the admission queue was shut down while waiting")
        if state != _GRANTED:
            raise _drop_error(state)
        # Granted. The deadline is checked once more now that this thread
        # holds the GIL again, as close as it gets to running the body.
        pthread_mutex_lock(&self._mutex)
        prazo_add(&self._c.assigned, -1)
        now = prazo_monotonic_ns()
        verdict = prazo_deadline_verdict(now, deadline_ns, prazo_line_expected_ns(self._line))
        if verdict == PRAZO_VERDICT_LIVE:
            prazo_line_count_start(self._line, entry.enqueued_ns, now, critical)
            pthread_mutex_unlock(&self._mutex)
            # The slot has been this caller's since the grant: the time its
            # thread took to wake (under a busy GIL, often longer than the
            # work) is part of the slot's service (see the Python twin).
            return waiter.granted_ns
        # The time ran out (or got too short) while this thread woke up: it
        # never starts, and the slot moves on.
        state = prazo_line_drop_reason(verdict)
        prazo_line_count_drop(self._line, state)
        prazo_line_give_back(self._line, critical)
        prazo_line_drops_init(&expired)
        self._hand_over_unlock(now, &expired)
        self._report(&expired)
        raise _drop_error(state)

    cdef int _wait_slice(self, Waiter *waiter, int64_t deadline_ns) noexcept nogil:
        """Wait (GIL released) for at most one slice; leave the line at the deadline."""
        cdef int64_t now, until, effective
        cdef int state, verdict
        pthread_mutex_lock(&self._mutex)
        if waiter.state == _WAITING:
            now = prazo_monotonic_ns()
            # The effective deadline with the estimate current now: it may move.
            effective = prazo_effective_deadline_ns(deadline_ns, prazo_line_expected_ns(self._line))
            until = now + _SIGNAL_SLICE_NS
            if effective < until:
                until = effective
            if now < effective:
                prazo_cond_wait_until(&waiter.cond, &self._mutex, until)
            if waiter.state == _WAITING:
                now = prazo_monotonic_ns()
                verdict = prazo_deadline_verdict(now, deadline_ns, prazo_line_expected_ns(self._line))
                if verdict != PRAZO_VERDICT_LIVE:
                    # Active expiry: leave at our own (effective) deadline, not at the head.
                    waiter.state = prazo_line_drop_reason(verdict)
                    prazo_line_remove(self._line, _waiter_token(waiter), waiter.state)
        state = waiter.state
        if state == _GRANTED:
            self._await_granter_locked(waiter)
        pthread_mutex_unlock(&self._mutex)
        return state

    cdef void _await_granter_locked(self, Waiter *waiter) noexcept nogil:
        """With the mutex held: wait until the granter has finished signalling us.

        The granter signals right after it unlocks (O(1)), so this is brief;
        until then the waiter's condition variable must stay alive.
        """
        if not waiter.handed:
            return
        pthread_mutex_unlock(&self._mutex)
        while not prazo_flag_is_set(&waiter.signalled):
            sched_yield()
        pthread_mutex_lock(&self._mutex)

    cdef void _leave_line(self, Waiter *waiter, Expired *expired) noexcept nogil:
        """Take the mutex, take the waiter off the line (passing on a slot just
        granted to it), and release the mutex again."""
        pthread_mutex_lock(&self._mutex)
        if waiter.state == _GRANTED:
            self._await_granter_locked(waiter)
        if waiter.state == _WAITING:
            prazo_line_remove(self._line, _waiter_token(waiter), PRAZO_DROP_CANCELLED)
            waiter.state = _CANCELLED
        elif waiter.state == _GRANTED:
            prazo_add(&self._c.assigned, -1)
            prazo_add(&self._c.cancelled, 1)
            waiter.state = _CANCELLED
            prazo_line_give_back(self._line, waiter.critical)
            self._hand_over_unlock(prazo_monotonic_ns(), expired)
            return
        pthread_mutex_unlock(&self._mutex)

    cdef int _abandon(self, Waiter *waiter) except -1:
        """A waiter leaves because of an exception (e.g. KeyboardInterrupt).

        The mutex is taken with the GIL held, as the fast path takes it, and
        released before any Python runs: a thread that asked for the GIL
        while holding the mutex would deadlock with a thread holding the GIL
        and waiting for the mutex. Keeping the GIL matters too: a hand-over
        may take expired work items out of the rings, and items must leave
        the rings only while the GIL is held, or a garbage collection running
        meanwhile could see an item in one traversal and not in the next and
        clear it while this thread still reports it. Waiting for a granter
        with the GIL held is safe: a granter signals right after unlocking,
        without asking for the GIL in between.
        """
        cdef Expired expired
        prazo_line_drops_init(&expired)
        self._leave_line(waiter, &expired)
        return self._report(&expired)

    @cython.binding(False)
    def release(self, *, critical=False, started_ns=None, now_ns=None):
        """Give back a slot taken by ``acquire()``; it goes to the next live waiter.

        With ``started_ns`` (what ``acquire()`` returned), the time since then
        is a service-time sample for the policies that learn from them
        (``limit="vegas"``, learned ``expected_service_ms``); ``critical``
        must match the ``acquire(critical=...)`` of the slot.
        """
        _check_initialised(self)
        self._release_class(-1 if now_ns is None else _clock(now_ns), now_ns is None, _started(started_ns),
                            _critical(critical))

    cdef int _release(self, int64_t now, bint real_clock) except -1:
        return self._release_class(now, real_clock, -1, False)

    cdef int _release_sampled(self, int64_t now, bint real_clock, int64_t started_ns) except -1:
        """``_release``, with the slot's start time (< 0: none) as a service-time sample."""
        return self._release_class(now, real_clock, started_ns, False)

    cdef int _release_class(self, int64_t now, bint real_clock, int64_t started_ns, bint critical) except -1:
        """Release a slot of this class; ``started_ns`` >= 0 makes ``now - started_ns`` a service-time sample."""
        cdef Expired expired
        cdef int64_t service_ns
        pthread_mutex_lock(&self._mutex)
        if prazo_load(&self._c.in_flight) - prazo_load(&self._c.assigned) <= 0:
            pthread_mutex_unlock(&self._mutex)
            raise ValueError("release() called more times than a slot was taken")
        if critical and self._line.critical_in_flight <= 0:
            pthread_mutex_unlock(&self._mutex)
            raise ValueError("release(critical=True) called with no critical slot taken")
        service_ns = -1
        # Only the learned estimate and Vegas use a sample: without them, no clock read.
        if started_ns >= 0 and self._learns:
            if real_clock:
                now = prazo_monotonic_ns()
                real_clock = False
            service_ns = prazo_sub_saturating(now, started_ns)
            if service_ns < 0:
                service_ns = 0
        # The sample is taken before the slot moves on (the work still counts as in flight).
        prazo_line_release(self._line, critical, service_ns)
        if self._line.count == 0:
            # Nobody waits: the common case needs no clock read at all.
            if self._line.shutdown and prazo_load(&self._c.in_flight) == 0:
                pthread_cond_broadcast(&self._ready_cond)
            pthread_mutex_unlock(&self._mutex)
            return 0
        if real_clock:
            now = prazo_monotonic_ns()
        prazo_line_drops_init(&expired)
        self._hand_over_unlock(now, &expired)
        return self._report(&expired)

    # -- work-queue face -------------------------------------------------------

    def put(self, item, deadline=None, *, critical=False, now_ns=None):
        """Offer ``item``; never blocks.

        A free slot is assigned to it at once (so rejection never depends on
        how fast consumers wake up); otherwise it waits in line. Raises
        ``QueueFull`` or ``DeadlineExceeded`` (``expired-on-arrival``,
        ``insufficient-budget``). A ``critical`` item is served first and may
        push the newest normal item out of a full line (reported to
        ``on_dropped``); finish it with ``task_done(critical=True)``.
        """
        cdef Entry entry
        cdef int outcome
        cdef Expired dropped
        _check_initialised(self)
        entry.deadline_ns = _deadline_ns(deadline)
        entry.enqueued_ns = _clock(now_ns)
        entry.critical = _critical(critical)
        # A pending signal is raised before the item is queued, not after (see _acquire).
        PyErr_CheckSignals()
        entry.token = _item_token(<PyObject *>item)
        Py_INCREF(item)
        prazo_line_drops_init(&dropped)
        pthread_mutex_lock(&self._mutex)
        outcome = self._admit(entry.deadline_ns, entry.enqueued_ns, entry.critical, &dropped)
        if outcome == PRAZO_ADMIT_START:
            prazo_add(&self._c.assigned, 1)
            self._ready_push(entry)
        elif outcome == PRAZO_ADMIT_WAIT:
            prazo_line_push(self._line, &entry)
        self._unlock_signalling_ready()
        if outcome != PRAZO_ADMIT_START and outcome != PRAZO_ADMIT_WAIT:
            Py_DECREF(item)
            self._report(&dropped)
            raise _admission_error(outcome)
        self._report(&dropped)

    def put_nowait(self, item, deadline=None, *, critical=False, now_ns=None):
        """Same as ``put`` (which never blocks); named after ``queue.Queue``."""
        self.put(item, deadline, critical=critical, now_ns=now_ns)

    def get(self, block=True, timeout=None, *, now_ns=None):
        """Take the next live item that holds a slot; pair with ``task_done()``.

        Items that expired after their slot was assigned are reported through
        ``on_expired`` and skipped. Raises ``queue.Empty`` when nothing is
        ready (at once, or after ``timeout`` seconds), and ``ShutDown`` once
        the queue is shut down and nothing is left to hand out.
        """
        cdef int64_t end_ns = INT64_MAX
        cdef int64_t fake_now = 0
        cdef int64_t now
        cdef bint use_fake = now_ns is not None
        cdef bint blocking = bool(block)
        cdef Entry entry
        cdef Expired expired
        cdef int verdict, state
        _check_initialised(self)
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be a number or None, not {type(timeout).__name__}")
            if not timeout >= 0:
                raise ValueError("'timeout' must be a non-negative number")
            if timeout < _UNBOUNDED_TIMEOUT_S:
                end_ns = prazo_monotonic_ns() + <int64_t>(float(timeout) * 1e9)
        if use_fake:
            fake_now = _clock(now_ns)
        # A pending signal is raised before an item is taken, not after (see _acquire).
        PyErr_CheckSignals()
        while True:
            pthread_mutex_lock(&self._mutex)
            if self._ready_count > 0:
                entry = self._ready[self._ready_head]
                self._ready_head = (self._ready_head + 1) % self._ready_cap
                self._ready_count -= 1
                prazo_add(&self._c.assigned, -1)
                now = fake_now if use_fake else prazo_monotonic_ns()
                verdict = prazo_deadline_verdict(now, entry.deadline_ns, prazo_line_expected_ns(self._line))
                if verdict == PRAZO_VERDICT_LIVE:
                    prazo_line_count_start(self._line, entry.enqueued_ns, now, entry.critical)
                    pthread_mutex_unlock(&self._mutex)
                    item = <object>_token_item(entry.token)
                    Py_DECREF(item)  # the ring's reference moves to `item`
                    return item
                # Its slot came too late: the slot moves on, then it is reported.
                state = prazo_line_drop_reason(verdict)
                prazo_line_count_drop(self._line, state)
                prazo_line_drops_init(&expired)
                prazo_line_drops_push(&expired, entry.token, state)  # fits on the stack
                prazo_line_give_back(self._line, entry.critical)
                self._hand_over_unlock(now, &expired)
                self._report(&expired)
                continue
            if self._line.shutdown and self._line.count == 0:
                pthread_mutex_unlock(&self._mutex)
                raise ShutDown("the admission queue is shut down")
            pthread_mutex_unlock(&self._mutex)
            if not blocking or prazo_monotonic_ns() >= end_ns:
                raise _Empty
            with nogil:
                self._wait_ready(end_ns)
            # Before taking anything: an item taken by a thread that then
            # raises would be lost with its slot.
            _check_interrupts()

    cdef void _wait_ready(self, int64_t end_ns) noexcept nogil:
        """Sleep (GIL released) until an item may be ready, for at most one slice."""
        cdef int64_t until = prazo_monotonic_ns() + _SIGNAL_SLICE_NS
        if end_ns < until:
            until = end_ns
        pthread_mutex_lock(&self._mutex)
        if self._ready_count == 0 and not (self._line.shutdown and self._line.count == 0):
            self._ready_sleepers += 1
            prazo_cond_wait_until(&self._ready_cond, &self._mutex, until)
            self._ready_sleepers -= 1
        pthread_mutex_unlock(&self._mutex)

    def get_nowait(self, *, now_ns=None):
        """``get(block=False)``."""
        return self.get(False, now_ns=now_ns)

    def task_done(self, *, critical=False, started_ns=None, now_ns=None):
        """Give back the slot of an item taken by ``get()`` (see ``release()`` for the keywords)."""
        _check_initialised(self)
        self._release_class(-1 if now_ns is None else _clock(now_ns), now_ns is None, _started(started_ns),
                            _critical(critical))

    def expire_overdue(self, *, now_ns=None):
        """Remove every waiting entry whose deadline (or effective deadline) has passed; return how many.

        Gate waiters already leave at their own deadline; this is how work
        items, which cannot wake themselves, get the same treatment.
        """
        cdef int64_t now = _clock(now_ns)
        cdef Py_ssize_t count
        cdef Expired expired
        _check_initialised(self)
        prazo_line_drops_init(&expired)
        pthread_mutex_lock(&self._mutex)
        # Room for every entry first, so the sweep never stops half-way.
        if not prazo_line_drops_reserve(&expired, self._line.count):
            pthread_mutex_unlock(&self._mutex)
            raise MemoryError()
        prazo_line_sweep(self._line, now, &expired)
        count = expired.count
        _wake_dropped(&expired)
        pthread_mutex_unlock(&self._mutex)
        self._report(&expired)
        return count

    def cancel(self, item):
        """Take a waiting work item out of the line (the first one that ``is`` it).

        Returns True when it was waiting (it is counted ``cancelled`` and will
        never be handed out), False when it was not in line (already holding a
        slot, taken, expired or never put).
        """
        cdef bint found
        _check_initialised(self)
        pthread_mutex_lock(&self._mutex)
        found = prazo_line_remove(self._line, _item_token(<PyObject *>item), PRAZO_DROP_CANCELLED)
        pthread_mutex_unlock(&self._mutex)
        if found:
            Py_DECREF(item)  # the ring's reference
        return found

    def shutdown(self, *, cancel_waiting=False):
        """Refuse new arrivals with ``ShutDown``; optionally cancel the waiting line.

        Entries already holding a slot always finish. With
        ``cancel_waiting=True`` every waiting entry is removed and counted
        ``cancelled``: gate waiters raise ``ShutDown`` and the work items are
        returned (oldest first) so the caller can answer them.
        """
        cdef bint cancel = bool(cancel_waiting)
        cdef Py_ssize_t i
        cdef Expired items
        _check_initialised(self)
        prazo_line_drops_init(&items)
        pthread_mutex_lock(&self._mutex)
        if cancel and not prazo_line_drops_reserve(&items, self._line.count):
            pthread_mutex_unlock(&self._mutex)
            raise MemoryError()
        self._line.shutdown = True
        if cancel:
            while self._line.count > 0:
                prazo_add(&self._c.cancelled, 1)
                self._dismiss(prazo_line_take(self._line, 0), _CANCELLED, &items)
        pthread_cond_broadcast(&self._ready_cond)
        pthread_mutex_unlock(&self._mutex)
        cancelled = []
        for i in range(items.count):
            item = <object>_token_item(items.items[i].token)
            Py_DECREF(item)  # the ring's reference moves to the list
            cancelled.append(item)
        prazo_line_drops_free(&items)
        return cancelled

    def __repr__(self):
        if not prazo_flag_is_set(&self._initialised):
            return f"<{type(self).__module__}.{type(self).__name__} (not initialised)>"
        return (
            f"<{type(self).__module__}.{type(self).__name__} max_concurrency={self._max_concurrency} "
            f"max_queue={self._max_queue} order={self.order!r} in_flight={prazo_load(&self._c.in_flight)} "
            f"queued={prazo_load(&self._c.queued)}>"
        )


# -- garbage collection of the items in the rings --------------------------------
#
# The rings hold owned references that Cython cannot see, so without help a
# cycle through a waiting item (queue -> item -> queue) is never collected.
# Cython does not let a class define tp_traverse / tp_clear, so the slots it
# generates (which cover _on_expired) are wrapped here, once, at import.
#
# Both take the mutex: a waiter leaving at its deadline moves entries of the
# ring without the GIL, and the collector must see one consistent set of
# items. That is deadlock-free for the same reason as the fast path (no thread
# holding the mutex asks for the GIL), and it also needs no Python object to
# be allocated while the mutex is held, which could start a collection on
# that same thread. An item leaves the rings only with the GIL held, so the
# set cannot change between the collector's passes.

cdef traverseproc _generated_traverse
cdef inquiry _generated_clear


cdef int _traverse_queue(PyObject *o, visitproc visit, void *arg) noexcept:
    cdef AdmissionQueue queue = <AdmissionQueue>o
    cdef Py_ssize_t i
    cdef PyObject *item
    cdef int err = _generated_traverse(o, visit, arg)
    if err or queue._line == NULL:
        return err
    pthread_mutex_lock(&queue._mutex)
    for i in range(queue._line.count):
        item = _token_item(prazo_line_at(queue._line, i).token)
        if item != NULL:
            err = visit(item, arg)
            if err:
                break
    if not err:
        for i in range(queue._ready_count):
            err = visit(_token_item(queue._ready[(queue._ready_head + i) % queue._ready_cap].token), arg)
            if err:
                break
    pthread_mutex_unlock(&queue._mutex)
    return err


cdef int _clear_queue(PyObject *o) noexcept:
    """Drop every item the rings hold and leave the queue refusing every call.

    The entries are counted ``cancelled`` (an item holding an assigned slot
    gives it back), so the counters still balance; the references are
    dropped outside the mutex, since that can run arbitrary code: all at
    once when memory allows, otherwise a stack buffer's worth per round.
    """
    cdef AdmissionQueue queue = <AdmissionQueue>o
    cdef Expired dropped
    cdef Py_ssize_t i, count
    cdef Entry entry
    if queue._line == NULL:
        return _generated_clear(o)
    while True:
        prazo_line_drops_init(&dropped)
        pthread_mutex_lock(&queue._mutex)
        prazo_flag_clear(&queue._initialised)
        queue._line.shutdown = True
        prazo_line_drops_reserve(&dropped, queue._line.count + queue._ready_count)
        while dropped.count < dropped.cap and queue._line.count > 0:
            prazo_add(&queue._c.cancelled, 1)
            queue._dismiss(prazo_line_take(queue._line, 0), _CANCELLED, &dropped)
        while dropped.count < dropped.cap and queue._ready_count > 0:
            entry = queue._ready[queue._ready_head]
            queue._ready_head = (queue._ready_head + 1) % queue._ready_cap
            queue._ready_count -= 1
            prazo_add(&queue._c.assigned, -1)
            prazo_line_give_back(queue._line, entry.critical)
            prazo_add(&queue._c.cancelled, 1)
            prazo_line_drops_push(&dropped, entry.token, _CANCELLED)  # within the room checked above
        pthread_mutex_unlock(&queue._mutex)
        count = dropped.count
        for i in range(count):
            Py_XDECREF(_token_item(dropped.items[i].token))
        prazo_line_drops_free(&dropped)
        if count == 0:
            return _generated_clear(o)


cdef PyTypeObject *_queue_type = <PyTypeObject *><PyObject *>AdmissionQueue
if not _queue_type.tp_flags & Py_TPFLAGS_HAVE_GC or _queue_type.tp_traverse == NULL or _queue_type.tp_clear == NULL:
    raise ImportError("prazo: AdmissionQueue must be a garbage-collected type (it lost its object attributes?)")
_generated_traverse = _queue_type.tp_traverse
_generated_clear = _queue_type.tp_clear
_queue_type.tp_traverse = _traverse_queue
_queue_type.tp_clear = _clear_queue
