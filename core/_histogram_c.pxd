# Declarations of the C histogram twin, so other Cython code can cimport it and
# record from a `nogil` block: `hist.record_ns(ns)`, `window.record_ns_at(ns, now_ns)`.
cimport cython
from libc.stdint cimport int64_t, uint64_t


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *, void *)
    int pthread_mutex_destroy(pthread_mutex_t *)
    int pthread_mutex_lock(pthread_mutex_t *)
    int pthread_mutex_unlock(pthread_mutex_t *)


cdef extern from "prazo_histogram.h" nogil:
    enum:
        PRAZO_HIST_BUCKETS
        PRAZO_HIST_LINEAR
    int64_t PRAZO_HIST_MAX_NS
    ctypedef struct prazo_hist:
        int64_t counts[PRAZO_HIST_BUCKETS]
        uint64_t sum
        int64_t min
        int64_t max
        int64_t overflow
    int prazo_hist_index(int64_t ns)
    int64_t prazo_hist_lo(int index)
    int64_t prazo_hist_hi(int index)
    void prazo_hist_clear(prazo_hist *h)
    void prazo_hist_record(prazo_hist *h, int64_t ns)
    int64_t prazo_hist_sum_ns(prazo_hist *h)
    int64_t prazo_hist_load(prazo_hist *src, prazo_hist *dst)
    int64_t prazo_hist_count(prazo_hist *h)
    void prazo_hist_add(prazo_hist *dst, const prazo_hist *copy, int64_t copy_count)
    int64_t prazo_hist_accumulate(prazo_hist *dst, prazo_hist *src)
    int64_t prazo_epoch_load(int64_t *epoch)
    void prazo_epoch_store(int64_t *epoch, int64_t value)
    int64_t prazo_floor_div(int64_t a, int64_t b)
    int64_t prazo_hist_read(int64_t *field)
    int64_t prazo_window_oldest_excluded(int64_t now_epoch, int64_t slices)


@cython.final
cdef class LatencyHistogram:
    cdef prazo_hist _h
    # Count one value; ns must be >= 0 (unchecked). Lock-free, callable without the GIL.
    cdef void record_ns(self, int64_t ns) noexcept nogil


@cython.final
cdef class WindowedHistogram:
    cdef prazo_hist *_ring        # `_slices` histograms, allocated once
    cdef int64_t *_epochs         # the epoch (now_ns // slice_ns) each slot holds
    cdef int64_t _slices
    cdef int64_t _slice_ns
    cdef double _window_s
    cdef pthread_mutex_t _rotate_mutex
    cdef bint _mutex_ready
    cdef LatencyHistogram _total
    # Count one value at monotonic time now_ns; ns must be >= 0 (unchecked).
    # Takes no lock unless a slice has to rotate; callable without the GIL.
    cdef void record_ns_at(self, int64_t ns, int64_t now_ns) noexcept nogil
    cdef int _ready(self) except -1
    cdef void _rotate(self, int64_t slot, int64_t epoch) noexcept nogil
    cdef int64_t _live(self, int64_t now_ns, prazo_hist *into) noexcept nogil
