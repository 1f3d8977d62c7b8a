# The C declarations of core/prazo_line.h, the admission line, for every
# extension that runs it (the queue's C twin through _queue_c.pxd, the front
# door's compiled face): one copy of the declarations as of the line. Only
# extern declarations: cimporting this file imports no module at run time.
from libc.stdint cimport int64_t, uint64_t


cdef extern from "prazo_sync.h" nogil:
    ctypedef long long prazo_atomic_i64
    int64_t prazo_load(prazo_atomic_i64 *)


cdef extern from "prazo_line.h" nogil:
    enum:
        PRAZO_LINE_FIFO
        PRAZO_LINE_LIFO
        PRAZO_LINE_ADAPTIVE
        PRAZO_LINE_ASSIGN
        PRAZO_LINE_PICKUP
    enum:
        PRAZO_ADMIT_START
        PRAZO_ADMIT_WAIT
        PRAZO_ADMIT_SHUTDOWN
        PRAZO_ADMIT_EXPIRED
        PRAZO_ADMIT_FULL
        PRAZO_ADMIT_INSUFFICIENT
    enum:
        PRAZO_DROP_CANCELLED
        PRAZO_DROP_EXPIRED
        PRAZO_DROP_INSUFFICIENT
        PRAZO_DROP_SHED
        PRAZO_DROP_EVICTED
    enum:
        PRAZO_NEXT_NONE
        PRAZO_NEXT_TAKEN
        PRAZO_NEXT_UNREPORTED
    cdef struct prazo_line_entry:
        int64_t deadline_ns
        int64_t enqueued_ns
        uint64_t token
        int critical
    cdef struct prazo_line_counters:
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
    cdef struct prazo_line:
        int64_t capacity
        int64_t count
        int shutdown
        int64_t critical_in_flight
        prazo_atomic_i64 limit
        prazo_line_counters c
    cdef struct prazo_line_drop:
        uint64_t token
        int reason
    cdef struct prazo_line_drops:
        prazo_line_drop *items
        int64_t count
        int64_t cap
    void prazo_line_drops_init(prazo_line_drops *)
    bint prazo_line_drops_reserve(prazo_line_drops *, int64_t)
    bint prazo_line_drops_push(prazo_line_drops *, uint64_t, int)
    void prazo_line_drops_free(prazo_line_drops *)
    size_t prazo_line_size(int64_t)
    void prazo_line_init(prazo_line *, int64_t, int64_t, int64_t, int, int, int64_t, int64_t, int64_t, int64_t, int,
                         int, int64_t, int64_t)
    int64_t prazo_line_in_flight(prazo_line *)
    int64_t prazo_line_expected_ns(const prazo_line *)
    int64_t prazo_line_retry_after_ns(prazo_line *)
    prazo_line_entry *prazo_line_at(prazo_line *, int64_t)
    bint prazo_line_full(prazo_line *)
    void prazo_line_count_drop(prazo_line *, int)
    int prazo_line_drop_reason(int)
    void prazo_line_push(prazo_line *, const prazo_line_entry *)
    prazo_line_entry prazo_line_take(prazo_line *, int64_t)
    bint prazo_line_remove(prazo_line *, uint64_t, int)
    void prazo_line_count_start(prazo_line *, int64_t, int64_t, int)
    void prazo_line_give_back(prazo_line *, int)
    void prazo_line_release(prazo_line *, int, int64_t)
    void prazo_line_shed_stale(prazo_line *, int64_t, prazo_line_drops *)
    int prazo_line_admit(prazo_line *, int64_t, int64_t, int, prazo_line_drops *)
    int prazo_line_next(prazo_line *, int64_t, prazo_line_drops *, prazo_line_entry *)
    int64_t prazo_line_sweep(prazo_line *, int64_t, prazo_line_drops *)
