# Declarations of the C twin: the C helpers from prazo_sync.h, the ring entry,
# and the AdmissionQueue's C-level state (so other Cython code could cimport it).
cimport cython
from libc.stdint cimport int64_t
from cpython.object cimport PyObject


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *, void *)
    int pthread_mutex_destroy(pthread_mutex_t *)
    int pthread_mutex_lock(pthread_mutex_t *)
    int pthread_mutex_unlock(pthread_mutex_t *)
    int pthread_cond_destroy(pthread_cond_t *)
    int pthread_cond_signal(pthread_cond_t *)
    int pthread_cond_broadcast(pthread_cond_t *)


cdef extern from "prazo_sync.h" nogil:
    ctypedef long long prazo_atomic_i64
    int64_t prazo_monotonic_ns()
    int64_t prazo_load(prazo_atomic_i64 *)
    void prazo_store(prazo_atomic_i64 *, int64_t)
    void prazo_add(prazo_atomic_i64 *, int64_t)
    void prazo_raise_peak(prazo_atomic_i64 *, int64_t)
    int64_t prazo_sub_saturating(int64_t, int64_t)
    void prazo_add_saturating(prazo_atomic_i64 *, int64_t)
    int prazo_cond_init_monotonic(pthread_cond_t *)
    int prazo_cond_wait_until(pthread_cond_t *, pthread_mutex_t *, int64_t)
    int ETIMEDOUT
    ctypedef int prazo_flag
    void prazo_flag_set(prazo_flag *)
    int prazo_flag_is_set(prazo_flag *)
    void prazo_flag_clear(prazo_flag *)


cdef extern from "prazo_policy.h" nogil:
    cdef struct prazo_codel:
        int64_t target_ns
        int64_t interval_ns
        int64_t last_empty_ns
    cdef struct prazo_service_estimate:
        int64_t fixed_ns
    void prazo_codel_init(prazo_codel *, int64_t, int64_t, int64_t)
    void prazo_codel_note_empty(prazo_codel *, int64_t)
    int prazo_codel_standing(const prazo_codel *, int64_t)
    int64_t prazo_codel_max_sojourn(const prazo_codel *, int64_t)
    void prazo_service_estimate_init(prazo_service_estimate *, int64_t, int)
    void prazo_service_estimate_sample(prazo_service_estimate *, int64_t)
    int64_t prazo_service_estimate_ns(const prazo_service_estimate *)
    int64_t prazo_effective_deadline_ns(int64_t, int64_t)
    int prazo_deadline_verdict(int64_t, int64_t, int64_t)
    enum:
        PRAZO_VERDICT_LIVE
        PRAZO_VERDICT_EXPIRED
        PRAZO_VERDICT_INSUFFICIENT
    cdef struct prazo_vegas:
        int64_t limit
    void prazo_vegas_init(prazo_vegas *, int64_t, int64_t)
    int64_t prazo_vegas_sample(prazo_vegas *, int64_t, int64_t)
    int64_t prazo_vegas_limit(const prazo_vegas *)
    int prazo_priority_may_start(int64_t, int64_t, int64_t, int, int64_t)


cdef extern from "<sched.h>" nogil:
    int sched_yield()


# A gate waiter lives on its own thread's C stack for as long as it waits.
# A granted waiter is signalled *after* the granter unlocks (so it does not
# wake only to block on the mutex); `handed` says a grant is in flight and
# `signalled` when the granter is done with this memory.
cdef struct Waiter:
    pthread_cond_t cond
    int state
    bint handed
    bint critical
    int64_t granted_ns    # when a slot was handed to it: its service starts there
    prazo_flag signalled


cdef struct Entry:
    int64_t deadline_ns
    int64_t enqueued_ns
    PyObject *item        # owned reference for work items; NULL for gate waiters
    Waiter *waiter        # NULL for work items
    bint critical         # the critical class (reserved slots, served first)


# A work item that left the line without a slot, and why (the entry state:
# expired, insufficient budget, shed, evicted, cancelled).
cdef struct Dropped:
    PyObject *item
    int state


# Work items dropped during a hand-over, a sweep or a shutdown, collected
# with the mutex held and answered after it is released. Small batches stay on
# the caller's stack; a larger one moves to the heap (never copy this struct:
# `items` may point into it).
cdef struct Expired:
    Dropped *items
    Py_ssize_t count
    Py_ssize_t cap
    Dropped on_stack[16]


cdef struct Counters:
    prazo_atomic_i64 offered
    prazo_atomic_i64 started
    prazo_atomic_i64 completed
    prazo_atomic_i64 rejected_full
    prazo_atomic_i64 expired_on_arrival
    prazo_atomic_i64 expired_in_queue
    prazo_atomic_i64 cancelled
    prazo_atomic_i64 in_flight
    prazo_atomic_i64 assigned
    prazo_atomic_i64 queued
    prazo_atomic_i64 peak_in_flight
    prazo_atomic_i64 peak_queued
    prazo_atomic_i64 queue_wait_ns_total
    prazo_atomic_i64 insufficient_budget
    prazo_atomic_i64 shed
    prazo_atomic_i64 evicted
    prazo_atomic_i64 critical_started


# final: the cdef methods are called directly (no vtable) on the hot path.
@cython.final
cdef class AdmissionQueue:
    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _ready_cond
    cdef Entry *_ring             # waiting line, allocated once: max_queue entries
    cdef Py_ssize_t _ring_cap
    cdef Py_ssize_t _ring_head
    cdef Py_ssize_t _ring_count
    cdef Entry *_ready            # work items holding a slot, not yet taken by get()
    cdef Py_ssize_t _ready_cap
    cdef Py_ssize_t _ready_head
    cdef Py_ssize_t _ready_count
    cdef int64_t _max_concurrency
    cdef int64_t _max_queue
    cdef bint _lifo
    cdef bint _adaptive           # order="adaptive": CoDel decides LIFO and shedding
    cdef prazo_codel _codel
    cdef prazo_service_estimate *_estimate   # NULL: no doomed-work skip
    cdef bint _shutdown
    cdef bint _initialised        # __init__ completed and the GC has not cleared it
    cdef Counters _c
    cdef prazo_atomic_i64 _limit  # the current concurrency limit, read without the mutex by .limit
    cdef bint _use_vegas
    cdef prazo_vegas _vegas
    cdef int64_t _min_concurrency
    cdef int64_t _reserved
    cdef int64_t _critical_in_flight  # slots the critical class holds (assigned or started)
    cdef int64_t _critical_waiting    # critical entries in the line
    cdef object _on_expired
    cdef object _on_dropped
    cdef str _order
    cdef double _codel_target_ms
    cdef double _codel_interval_ms
    cdef object _expected_service_ms
    cdef object __weakref__

    cdef void _ring_push(self, Entry entry) noexcept nogil
    cdef Py_ssize_t _ring_next_position(self, int64_t now) noexcept nogil
    cdef Entry _ring_take(self, Py_ssize_t position) noexcept nogil
    cdef void _ring_remove_at(self, Py_ssize_t position) noexcept nogil
    cdef void _ring_remove_waiter(self, Waiter *waiter) noexcept nogil
    cdef void _ready_push(self, Entry entry) noexcept nogil
    cdef int _admit(self, int64_t deadline_ns, int64_t now, bint critical, Expired *dropped) noexcept nogil
    cdef int64_t _expected_ns(self) noexcept nogil
    cdef void _count_drop(self, int state) noexcept nogil
    cdef void _shed_stale(self, int64_t now, Expired *dropped) noexcept nogil
    cdef bint _evict_newest_normal(self, Expired *dropped) noexcept nogil
    cdef bint _may_start(self, bint critical) noexcept nogil
    cdef void _on_service_sample(self, int64_t service_ns, int64_t now) noexcept nogil
    cdef void _start(self, int64_t enqueued_ns, int64_t now) noexcept nogil
    cdef bint _dismiss(self, Entry entry, int state, Expired *expired) noexcept nogil
    cdef void _hand_over(self, int64_t now, Expired *expired, Waiter **granted, bint critical) noexcept nogil
    cdef void _hand_over_unlock(self, int64_t now, Expired *expired, bint critical) noexcept nogil
    cdef int _report(self, Expired *expired) except -1
    cdef int64_t _acquire(self, int64_t deadline_ns, int64_t now) except? -1
    cdef int64_t _acquire_class(self, int64_t deadline_ns, int64_t now, bint critical) except? -1
    cdef int64_t _wait_in_line(self, int64_t deadline_ns, int64_t now, bint critical, Expired *dropped) except? -1
    cdef int _wait_slice(self, Waiter *waiter, int64_t deadline_ns) noexcept nogil
    cdef void _await_granter_locked(self, Waiter *waiter) noexcept nogil
    cdef void _leave_line(self, Waiter *waiter, Expired *expired) noexcept nogil
    cdef int _abandon(self, Waiter *waiter) except -1
    cdef int _release(self, int64_t now, bint real_clock) except -1
    cdef int _release_sampled(self, int64_t now, bint real_clock, int64_t started_ns) except -1
    cdef int _release_class(self, int64_t now, bint real_clock, int64_t started_ns, bint critical) except -1
    cdef void _wait_ready(self, int64_t end_ns) noexcept nogil
