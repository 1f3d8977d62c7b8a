# Declarations of the C twin: the C helpers from prazo_sync.h, the admission
# line from prazo_line.h (shared with the front door's engine), and the
# AdmissionQueue's C-level state (so other Cython code could cimport it).
cimport cython
from libc.stdint cimport int64_t, uint64_t
from cpython.object cimport PyObject
# The admission line (prazo_line.h) and its counters' type, declared once for every extension that runs it.
from prazo.core.prazo_line cimport *


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
    int64_t prazo_monotonic_ns()
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
    int64_t prazo_effective_deadline_ns(int64_t, int64_t)
    int prazo_deadline_verdict(int64_t, int64_t, int64_t)
    enum:
        PRAZO_VERDICT_LIVE
        PRAZO_VERDICT_EXPIRED
        PRAZO_VERDICT_INSUFFICIENT

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


# An entry of the line: the token is the owner, a PyObject * (an owned
# reference: a work item) or a Waiter * with its lowest bit set (a gate waiter).
ctypedef prazo_line_entry Entry

# Entries that left the line without a slot ({token, reason}), collected with
# the mutex held; gate waiters among them are woken under it, work items
# answered after it is released (never copy this struct: `items` may point
# into it).
ctypedef prazo_line_drops Expired

# The counters, in the order of _COUNTER_NAMES.
ctypedef prazo_line_counters Counters


# final: the cdef methods are called directly (no vtable) on the hot path.
@cython.final
cdef class AdmissionQueue:
    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _ready_cond
    cdef prazo_line *_line        # the waiting line (prazo_line.h), one block allocated once: max_queue entries
    cdef Counters *_c             # the line's counters
    cdef Entry *_ready            # work items holding a slot, not yet taken by get()
    cdef Py_ssize_t _ready_cap
    cdef Py_ssize_t _ready_head
    cdef Py_ssize_t _ready_count
    cdef Py_ssize_t _ready_sleepers   # get() callers asleep on _ready_cond
    cdef Py_ssize_t _ready_owed       # signals _ready_push owes them, sent after unlocking
    cdef int64_t _max_concurrency
    cdef int64_t _max_queue
    cdef prazo_flag _initialised  # __init__ completed and the GC has not cleared it (read without the mutex: atomic)
    cdef bint _use_vegas
    cdef bint _learns             # a policy learns from service-time samples (Vegas, a learned estimate)
    cdef int64_t _min_concurrency
    cdef int64_t _reserved
    cdef object _on_expired
    cdef object _on_dropped
    cdef str _order
    cdef double _codel_target_ms
    cdef double _codel_interval_ms
    cdef object _expected_service_ms
    cdef object __weakref__

    cdef void _ready_push(self, Entry entry) noexcept nogil
    cdef void _unlock_signalling_ready(self) noexcept nogil
    cdef int _admit(self, int64_t deadline_ns, int64_t now, bint critical, Expired *dropped) noexcept nogil
    cdef bint _dismiss(self, Entry entry, int state, Expired *expired) noexcept nogil
    cdef void _hand_over(self, int64_t now, Expired *expired, Waiter **granted) noexcept nogil
    cdef void _hand_over_unlock(self, int64_t now, Expired *expired) noexcept nogil
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
