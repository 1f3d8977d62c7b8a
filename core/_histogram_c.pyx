# cython: freethreading_compatible = True
"""The C twin of the latency histogram (see ``_histogram_py.py`` for the specification).

Same API, same buckets, same answers as the Python twin; what differs is how:

* a histogram is one C struct (``prazo_histogram.h``): 2014 bucket counters
  plus sum, min, max and overflow, 16,152 bytes, inside the Python object;
* ``record`` is lock-free — relaxed ``__atomic`` increments, a compare-and-swap
  only for a new min or max — and never needs the GIL at the C level
  (``record_ns`` / ``record_ns_at`` in the ``.pxd`` for ``nogil`` callers);
* readers copy the buckets once and work on the copy, so every answer comes
  from one self-consistent array even while other threads record;
* the window's ring is one ``malloc``'d array of histograms; only a slice's
  rotation takes a mutex (see ``WindowedHistogram`` in the Python twin for
  why that is safe without locking ``record``).

Argument checking and its error messages come from the Python twin, so the
two can never drift apart; only the common case (an exact ``int``, a ``float``
quantile) is checked here in C.
"""

cimport cython
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.math cimport ceil
from libc.stdint cimport int64_t, uint64_t, INT64_MIN, INT64_MAX
from libc.stdlib cimport calloc, free, malloc

from ._histogram_py import (
    DEFAULT_QUANTILES,
    MAX_SLICES,
    bound_indexes as _bound_indexes,
    checked_ns as _checked_ns,
    checked_q as _checked_q,
    checked_qs as _checked_qs,
    is_latency_histogram as _is_latency_histogram,
    window_slice_ns as _window_slice_ns,
)
from .deadline import clock_ns as _clock_ns

cdef extern from "<time.h>" nogil:
    ctypedef int clockid_t
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(clockid_t, timespec *)
    clockid_t CLOCK_MONOTONIC

__all__ = [
    "BUCKETS",
    "DEFAULT_QUANTILES",
    "MAX_NS",
    "MAX_SLICES",
    "LatencyHistogram",
    "WindowedHistogram",
    "bucket_bounds",
    "bucket_index",
]

BUCKETS = PRAZO_HIST_BUCKETS
MAX_NS = PRAZO_HIST_MAX_NS


cdef inline int64_t _monotonic_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline int64_t _checked_value_in(object ns, str name) except -1:
    """``ns`` as a C value >= 0, or the Python twin's TypeError/ValueError naming ``name``."""
    cdef int overflow = 0
    cdef long long value
    if type(ns) is int:
        value = PyLong_AsLongLongAndOverflow(ns, &overflow)
        if overflow == 0 and value >= 0:
            return value
    return _checked_ns(ns, name)


cdef inline int64_t _value_ns(object ns) except -1:
    """``ns`` as a C value >= 0, or the Python twin's TypeError/ValueError."""
    return _checked_value_in(ns, "ns")


cdef inline double _q_value(object q) except -1.0:
    cdef double value
    if type(q) is float:
        value = q
        if 0.0 <= value <= 1.0:
            return value
    return _checked_q(q)


cdef inline int64_t _now(object now_ns) except? -1:
    if now_ns is None:
        return _monotonic_ns()
    return _clock_ns(now_ns)


cdef int64_t _quantile(prazo_hist *copy, int64_t total, double q) noexcept nogil:
    """The nearest-rank quantile of a plain copy holding ``total`` > 0 values (see the Python twin)."""
    cdef double exact = q * <double>total
    cdef int64_t rank
    cdef int64_t seen = 0
    cdef int index
    cdef int64_t lo, hi, value
    # 2**63: a rank that large is capped at total anyway (and cannot be cast).
    if exact >= 9223372036854775808.0:
        rank = total
    else:
        rank = <int64_t>ceil(exact)
    if rank < 1:
        rank = 1
    if rank > total:
        rank = total
    for index in range(PRAZO_HIST_BUCKETS):
        seen += copy.counts[index]
        if seen >= rank:
            break
    lo = prazo_hist_lo(index)
    hi = prazo_hist_hi(index)
    if rank == 1:
        value = copy.min
    elif rank == total:
        value = copy.max
    else:
        value = min(max(lo + (hi - lo) // 2, copy.min), copy.max)
    return min(max(value, lo), hi)


def bucket_index(ns):
    """The bucket of the value ``ns`` (values above ``MAX_NS`` go to the top bucket)."""
    cdef int64_t value = _value_ns(ns)
    return prazo_hist_index(min(value, PRAZO_HIST_MAX_NS))


def bucket_bounds(index):
    """The smallest and the largest value (inclusive) of bucket ``index``."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"index must be an int, not {type(index).__name__}")
    if not 0 <= index < PRAZO_HIST_BUCKETS:
        raise ValueError(f"index must be in [0, {PRAZO_HIST_BUCKETS}), got {index}")
    return prazo_hist_lo(index), prazo_hist_hi(index)


@cython.final
cdef class LatencyHistogram:
    """Counts of latencies in log-linear buckets, with exact count, sum, min and max.

    Lock-free: any number of threads may record at once (see the module docstring).
    """

    BUCKETS = PRAZO_HIST_BUCKETS
    MAX_NS = PRAZO_HIST_MAX_NS

    def __cinit__(self):
        prazo_hist_clear(&self._h)

    cdef void record_ns(self, int64_t ns) noexcept nogil:
        prazo_hist_record(&self._h, ns)

    def record(self, ns):
        """Count one latency of ``ns`` nanoseconds (an int >= 0)."""
        prazo_hist_record(&self._h, _value_ns(ns))

    def record_many(self, values):
        """Count every value of ``values`` (all are checked before any is counted).

        The values are recorded with the GIL released: other threads keep
        running, and several threads can record into one histogram in parallel.
        """
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TypeError(f"values must be an iterable of ints, not {type(values).__name__}")
        cdef list checked = list(values)
        cdef Py_ssize_t n = len(checked)
        cdef Py_ssize_t i
        cdef int64_t *buffer = <int64_t *>malloc(max(n, 1) * sizeof(int64_t))
        if buffer == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                buffer[i] = _checked_value_in(checked[i], "values")
            with nogil:
                for i in range(n):
                    prazo_hist_record(&self._h, buffer[i])
        finally:
            free(buffer)

    @property
    def count(self):
        """How many values were recorded."""
        return prazo_hist_count(&self._h)

    @property
    def sum_ns(self):
        """The exact sum of the recorded values (sticks at ``2**63 - 1``, 292 years, instead of wrapping)."""
        return prazo_hist_sum_ns(&self._h)

    @property
    def min_ns(self):
        """The smallest recorded value, exact; None when empty."""
        # max is -1 exactly while nothing was recorded (values are >= 0).
        if prazo_hist_read(&self._h.max) < 0:
            return None
        return prazo_hist_read(&self._h.min)

    @property
    def max_ns(self):
        """The largest recorded value, exact; None when empty."""
        cdef int64_t value = prazo_hist_read(&self._h.max)
        return None if value < 0 else value

    @property
    def overflow(self):
        """How many recorded values were above ``MAX_NS`` (100 s)."""
        return prazo_hist_read(&self._h.overflow)

    def counts(self):
        """A copy of the ``BUCKETS`` bucket counts (see ``bucket_bounds``)."""
        cdef prazo_hist copy
        prazo_hist_load(&self._h, &copy)
        return [copy.counts[index] for index in range(PRAZO_HIST_BUCKETS)]

    def quantile(self, q):
        """The ``q`` quantile in ns (``0 <= q <= 1``), within 0.79 % of the exact one; None when empty."""
        cdef double value = _q_value(q)
        cdef prazo_hist copy
        cdef int64_t total = prazo_hist_load(&self._h, &copy)
        if total <= 0:
            return None
        return _quantile(&copy, total, value)

    def quantiles(self, qs=DEFAULT_QUANTILES):
        """Several quantiles from one consistent read of the buckets."""
        cdef list checked = _checked_qs(qs)
        cdef prazo_hist copy
        cdef int64_t total = prazo_hist_load(&self._h, &copy)
        if total <= 0:
            return tuple([None for _ in checked])
        return tuple([_quantile(&copy, total, q) for q in checked])

    def count_le(self, bounds_ns):
        """For each bound, how many values are ``<=`` it at bucket precision (for Prometheus ``le`` buckets)."""
        cdef list indexes = _bound_indexes(bounds_ns)
        cdef prazo_hist copy
        cdef int i
        prazo_hist_load(&self._h, &copy)
        for i in range(1, PRAZO_HIST_BUCKETS):
            copy.counts[i] += copy.counts[i - 1]
        return [0 if index < 0 else copy.counts[<int>index] for index in indexes]

    def merge(self, other):
        """Add everything ``other`` (a histogram of either twin) recorded to this one."""
        cdef prazo_hist copy
        cdef int64_t total = 0
        cdef int index
        if type(other) is LatencyHistogram:
            total = prazo_hist_load(&(<LatencyHistogram>other)._h, &copy)
        elif _is_latency_histogram(other):
            for index, count in enumerate(other.counts()):
                copy.counts[index] = count
                total += count
            copy.sum = other.sum_ns
            copy.min = INT64_MAX if other.min_ns is None else other.min_ns
            copy.max = -1 if other.max_ns is None else other.max_ns
            copy.overflow = other.overflow
        else:
            raise TypeError(f"other must be a LatencyHistogram, not {type(other).__name__}")
        prazo_hist_add(&self._h, &copy, total)

    def reset(self):
        """Forget every recorded value."""
        prazo_hist_clear(&self._h)

    def copy(self):
        """An independent histogram with the same contents."""
        cdef LatencyHistogram clone = LatencyHistogram.__new__(LatencyHistogram)
        cdef prazo_hist copy
        prazo_hist_add(&clone._h, &copy, prazo_hist_load(&self._h, &copy))
        return clone

    def __repr__(self):
        p50, p99 = self.quantiles((0.5, 0.99))
        return f"<LatencyHistogram count={self.count} p50_ns={p50} p99_ns={p99} max_ns={self.max_ns}>"


@cython.final
cdef class WindowedHistogram:
    """The latencies of the last ``window_s`` seconds, plus a cumulative total.

    The window's rule and its concurrency argument are in the Python twin's
    docstring; this is the same algorithm over C structs.
    """

    def __init__(self, window_s=10.0, *, slices=10):
        window, count, slice_ns = _window_slice_ns(window_s, slices)
        if self._ring != NULL:
            raise RuntimeError("WindowedHistogram.__init__ called on a histogram already initialised")
        if not self._mutex_ready:
            if pthread_mutex_init(&self._rotate_mutex, NULL) != 0:
                raise MemoryError()
            self._mutex_ready = True
        epochs = <int64_t *>calloc(count, sizeof(int64_t))
        ring = <prazo_hist *>calloc(count, sizeof(prazo_hist))
        if epochs == NULL or ring == NULL:
            free(epochs)
            free(ring)
            raise MemoryError()
        for slot in range(count):
            prazo_hist_clear(&ring[slot])
            # An unused slot is empty, so its epoch only needs to be older than any real one.
            epochs[slot] = INT64_MIN
        self._window_s = window
        self._slices = count
        self._slice_ns = slice_ns
        self._total = LatencyHistogram()
        self._epochs = epochs
        # Last: a ring that is not NULL means a usable window (record_ns_at checks it).
        self._ring = ring

    def __dealloc__(self):
        free(self._ring)
        free(self._epochs)
        if self._mutex_ready:
            pthread_mutex_destroy(&self._rotate_mutex)

    def __sizeof__(self):
        return object.__sizeof__(self) + self._slices * (sizeof(prazo_hist) + sizeof(int64_t))

    cdef int _ready(self) except -1:
        if self._ring == NULL:
            raise RuntimeError("WindowedHistogram not initialised (__init__ was not called or failed)")
        return 0

    @property
    def window_s(self):
        """The window asked for, in seconds."""
        return self._window_s

    @property
    def slices(self):
        """How many histograms the ring holds."""
        return self._slices

    @property
    def slice_ns(self):
        """The time each slice covers, in nanoseconds."""
        return self._slice_ns

    @property
    def total(self):
        """Everything ever recorded (cumulative; what a Prometheus histogram exports)."""
        self._ready()
        return self._total

    cdef void record_ns_at(self, int64_t ns, int64_t now_ns) noexcept nogil:
        cdef int64_t epoch, slot, seen
        if self._ring == NULL:
            return
        epoch = prazo_floor_div(now_ns, self._slice_ns)
        slot = epoch - prazo_floor_div(epoch, self._slices) * self._slices
        seen = prazo_epoch_load(&self._epochs[slot])
        if seen != epoch:
            self._rotate(slot, epoch)
            seen = prazo_epoch_load(&self._epochs[slot])
        # seen > epoch: this clock reading is older than the slot's epoch, so
        # the value is already outside the window; only the total gets it.
        if seen == epoch:
            prazo_hist_record(&self._ring[slot], ns)
        prazo_hist_record(&self._total._h, ns)

    cdef void _rotate(self, int64_t slot, int64_t epoch) noexcept nogil:
        # Zero first, publish the epoch after (release): see the Python twin.
        pthread_mutex_lock(&self._rotate_mutex)
        if prazo_epoch_load(&self._epochs[slot]) < epoch:
            prazo_hist_clear(&self._ring[slot])
            prazo_epoch_store(&self._epochs[slot], epoch)
        pthread_mutex_unlock(&self._rotate_mutex)

    def record(self, ns, now_ns=None):
        """Count one latency of ``ns`` nanoseconds in the current slice and in ``total``."""
        cdef int64_t value = _value_ns(ns)
        self._ready()
        self.record_ns_at(value, _now(now_ns))

    def record_many(self, values, now_ns=None):
        """Count every value of ``values`` (all checked first), each at ``now_ns`` or at its own clock reading.

        The values are recorded with the GIL released, like ``LatencyHistogram.record_many``.
        """
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TypeError(f"values must be an iterable of ints, not {type(values).__name__}")
        cdef list checked = list(values)
        cdef Py_ssize_t n = len(checked)
        cdef Py_ssize_t i
        cdef bint fixed = now_ns is not None
        cdef int64_t now = 0
        cdef int64_t *buffer = NULL
        self._ready()
        buffer = <int64_t *>malloc(max(n, 1) * sizeof(int64_t))
        if buffer == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                buffer[i] = _checked_value_in(checked[i], "values")
            if fixed:
                now = _clock_ns(now_ns)
            with nogil:
                for i in range(n):
                    self.record_ns_at(buffer[i], now if fixed else _monotonic_ns())
        finally:
            free(buffer)

    cdef int64_t _live(self, int64_t now_ns, prazo_hist *into) noexcept nogil:
        """Add the live slices to ``into`` (a private histogram, or NULL); return how many values they hold."""
        cdef int64_t oldest_excluded
        cdef int64_t total = 0
        cdef int64_t slot
        oldest_excluded = prazo_window_oldest_excluded(prazo_floor_div(now_ns, self._slice_ns), self._slices)
        for slot in range(self._slices):
            if prazo_epoch_load(&self._epochs[slot]) <= oldest_excluded:
                continue
            if into == NULL:
                total += prazo_hist_count(&self._ring[slot])
            else:
                total += prazo_hist_accumulate(into, &self._ring[slot])
        return total

    def snapshot(self, now_ns=None):
        """A new histogram holding the live window at ``now_ns``."""
        cdef int64_t now = _now(now_ns)
        cdef LatencyHistogram merged = LatencyHistogram.__new__(LatencyHistogram)
        self._ready()
        # No other thread can see `merged` yet, so it may be filled without atomics.
        self._live(now, &merged._h)
        return merged

    def count(self, now_ns=None):
        """How many values the live window holds."""
        cdef int64_t now = _now(now_ns)
        self._ready()
        return self._live(now, NULL)

    def quantile(self, q, now_ns=None):
        """The ``q`` quantile of the live window, in ns; None when it is empty."""
        cdef double value = _q_value(q)
        cdef int64_t now = _now(now_ns)
        cdef prazo_hist merged
        cdef int64_t total
        self._ready()
        prazo_hist_clear(&merged)
        total = self._live(now, &merged)
        if total <= 0:
            return None
        return _quantile(&merged, total, value)

    def quantiles(self, qs=DEFAULT_QUANTILES, now_ns=None):
        """Several quantiles of the live window from one merged read."""
        cdef list checked = _checked_qs(qs)
        cdef int64_t now = _now(now_ns)
        cdef prazo_hist merged
        cdef int64_t total
        self._ready()
        prazo_hist_clear(&merged)
        total = self._live(now, &merged)
        if total <= 0:
            return tuple([None for _ in checked])
        return tuple([_quantile(&merged, total, q) for q in checked])

    def reset(self):
        """Forget everything, the window and ``total`` alike."""
        cdef int64_t slot
        self._ready()
        # A C loop under the mutex: nothing that could run Python while it is held.
        pthread_mutex_lock(&self._rotate_mutex)
        for slot in range(self._slices):
            prazo_hist_clear(&self._ring[slot])
            prazo_epoch_store(&self._epochs[slot], INT64_MIN)
        pthread_mutex_unlock(&self._rotate_mutex)
        self._total.reset()

    def __repr__(self):
        total = None if self._total is None else self._total.count
        return f"<WindowedHistogram window_s={self._window_s} slices={self._slices} total={total}>"
