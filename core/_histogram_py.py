"""The pure-Python latency histogram: the readable specification of ``_histogram_c.pyx``.

Both twins have the same API, the same bucket layout and give the same
answers for the same inputs (``tests/core/test_histogram.py`` drives them in
lockstep). Read this file to learn what the C twin does.

Buckets (log-linear, like HdrHistogram)
---------------------------------------
A value is a non-negative integer number of nanoseconds. Values below 128 ns
get a bucket each (exact). Above, every power of two ``[2**e, 2**(e+1))`` is
split into 64 linear sub-buckets of width ``2**(e-6)``, so a bucket is never
wider than 1/64 of its lower bound. The range ends at ``MAX_NS`` = 100 s: a
larger value is counted in the top bucket (the one holding ``MAX_NS``) and in
``overflow``; ``sum_ns``, ``min_ns`` and ``max_ns`` still see its exact value.
That makes ``BUCKETS`` = 2014 counters of 8 bytes: 16,112 bytes of counts
per histogram.

Quantiles
---------
``quantile(q)`` is the nearest-rank quantile at bucket precision: with ``n``
values recorded, take the rank ``r = min(max(ceil(q * n), 1), n)`` (the value
that has ``r - 1`` values before it in sorted order), find the bucket holding
that rank, and report the middle of the bucket (``lo + (hi - lo) // 2``),
moved into ``[min_ns, max_ns]``; rank 1 is the exact ``min_ns`` and rank ``n``
the exact ``max_ns``. The exact sorted-sample quantile ``sorted(values)[r - 1]``
lies in that same bucket, so the relative error is at most half a bucket
width over its lower bound: ``1/128`` (0.79 %) from 128 ns up to 100 s, zero
below 128 ns. Above 100 s the answer is only known to be "at least 100 s"
(except for the exact max).

``count_le(bounds_ns)`` counts the values in every bucket up to and including
the one holding each bound (a value in the same bucket as a bound counts as
``<=`` it; a value above 100 s counts as ``<=`` any bound of 100 s or more).

Windows
-------
``WindowedHistogram`` keeps a ring of ``slices`` histograms, each covering
``window_s / slices`` seconds of the monotonic clock; a query at ``now`` merges
the slices younger than the window. See its docstring for the exact rule and
the concurrency argument.

Every operation that depends on time takes an optional ``now_ns`` (the
``time.monotonic_ns()`` value to use), so tests drive both twins with a fake clock.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterable, Sequence
from numbers import Real
from typing import TYPE_CHECKING

from .deadline import NS_PER_SECOND, clock_ns

if TYPE_CHECKING:
    from typing_extensions import Self

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

# Layout constants; the C twin's prazo_histogram.h spells the same numbers.
SUB_BUCKET_BITS = 6
SUB_BUCKETS = 1 << SUB_BUCKET_BITS  # linear sub-buckets per power of two
LINEAR_LIMIT = 2 * SUB_BUCKETS  # below this every value has its own bucket
MAX_NS = 100 * NS_PER_SECOND  # top of the range: 100 s
MAX_SLICES = 3600  # a window of more slices would cost more memory than it is worth
DEFAULT_QUANTILES = (0.5, 0.95, 0.99, 0.999)

_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)


def bucket_index(ns: int) -> int:
    """The bucket of the value ``ns`` (values above ``MAX_NS`` go to the top bucket)."""
    ns = checked_ns(ns, "ns")
    return _index(min(ns, MAX_NS))


def bucket_bounds(index: int) -> tuple[int, int]:
    """The smallest and the largest value (inclusive) of bucket ``index``."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"index must be an int, not {type(index).__name__}")
    if not 0 <= index < BUCKETS:
        raise ValueError(f"index must be in [0, {BUCKETS}), got {index}")
    return _bounds(index)


def _index(ns: int) -> int:
    if ns < LINEAR_LIMIT:
        return ns
    shift = ns.bit_length() - 1 - SUB_BUCKET_BITS
    return (shift << SUB_BUCKET_BITS) + (ns >> shift)


def _bounds(index: int) -> tuple[int, int]:
    if index < LINEAR_LIMIT:
        return index, index
    shift = (index >> SUB_BUCKET_BITS) - 1
    mantissa = index - (shift << SUB_BUCKET_BITS)
    return mantissa << shift, ((mantissa + 1) << shift) - 1


BUCKETS = _index(MAX_NS) + 1


def checked_ns(ns: object, name: str) -> int:
    if isinstance(ns, bool) or not isinstance(ns, int):
        raise TypeError(f"{name} must be an int of nanoseconds, not {type(ns).__name__}")
    if ns < 0:
        raise ValueError(f"{name} must be >= 0, got {ns}")
    if ns > _INT64_MAX:
        raise ValueError(f"{name} must be < 2**63, got {ns}")
    return int(ns)


def checked_q(q: object) -> float:
    if isinstance(q, bool) or not isinstance(q, Real):
        raise TypeError(f"q must be a real number, not {type(q).__name__}")
    as_float = float(q)
    if not 0.0 <= as_float <= 1.0:  # NaN fails this too
        raise ValueError(f"q must be between 0 and 1, got {as_float!r}")
    return as_float


def checked_qs(qs: Iterable[float]) -> list[float]:
    if isinstance(qs, (str, bytes)) or not isinstance(qs, Iterable):
        raise TypeError(f"qs must be a sequence of quantiles, not {type(qs).__name__}")
    return [checked_q(q) for q in qs]


def _quantile(counts: Sequence[int], total: int, min_ns: int, max_ns: int, q: float) -> int | None:
    """The nearest-rank quantile ``q`` of a bucket array holding ``total`` values (module docstring)."""
    if total <= 0:
        return None
    rank = min(max(math.ceil(q * total), 1), total)
    seen = 0
    for index, count in enumerate(counts):  # noqa: B007 - the bucket where the loop stopped is used below
        seen += count
        if seen >= rank:
            break
    lo, hi = _bounds(index)
    # The first and the last rank are the exact min and max; any other rank
    # gets the middle of its bucket, moved into [min, max]. Clamping into the
    # bucket last changes nothing here (the exact quantile lies in both
    # ranges), but keeps the C twin's answer in the bucket when a reader races
    # a recorder and sees a bucket count before the new min or max.
    if rank == 1:
        value = min_ns
    elif rank == total:
        value = max_ns
    else:
        value = min(max(lo + (hi - lo) // 2, min_ns), max_ns)
    return min(max(value, lo), hi)


def bound_indexes(bounds_ns: Sequence[int]) -> list[int]:
    """The bucket of each bound of ``count_le``, or -1 for a negative bound (nothing is <= it)."""
    if isinstance(bounds_ns, (str, bytes)) or not isinstance(bounds_ns, Iterable):
        raise TypeError(f"bounds_ns must be a sequence of ints, not {type(bounds_ns).__name__}")
    indexes = []
    for bound in bounds_ns:
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise TypeError(f"bounds_ns must hold ints of nanoseconds, not {type(bound).__name__}")
        indexes.append(-1 if bound < 0 else _index(min(bound, MAX_NS)))
    return indexes


def is_latency_histogram(other: object) -> bool:
    # Either twin's histogram: the bucket layouts are the same (tested), so
    # counts() from one can be added to the other.
    cls = type(other)
    return cls.__name__ == "LatencyHistogram" and cls.__module__ in (
        "prazo.core._histogram_c",
        "prazo.core._histogram_py",
    )


class LatencyHistogram:
    """Counts of latencies in log-linear buckets, with exact count, sum, min and max.

    >>> h = LatencyHistogram()
    >>> for ms in (1, 2, 3, 4, 100):
    ...     h.record(ms * 1_000_000)
    >>> h.count, h.min_ns, h.max_ns
    (5, 1000000, 100000000)
    >>> h.quantile(0.5)   # 3 ms, at bucket precision (within 0.79 %)
    2998271
    >>> h.quantile(1.0)   # the largest value's bucket answers the exact max
    100000000

    Thread-safe; this twin serialises everything on one lock (the C twin
    records with atomic increments instead).
    """

    __slots__ = ("_count", "_counts", "_lock", "_max", "_min", "_overflow", "_sum")

    BUCKETS = BUCKETS
    MAX_NS = MAX_NS

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self._counts = [0] * BUCKETS
        self._count = 0
        self._sum = 0
        self._min: int | None = None
        self._max: int | None = None
        self._overflow = 0

    def record(self, ns: int) -> None:
        """Count one latency of ``ns`` nanoseconds (an int >= 0)."""
        ns = checked_ns(ns, "ns")
        with self._lock:
            self._count_locked(ns)
            self._count += 1

    def record_many(self, values: Iterable[int]) -> None:
        """Count every value of ``values`` (all are checked before any is counted)."""
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise TypeError(f"values must be an iterable of ints, not {type(values).__name__}")
        checked = [checked_ns(ns, "values") for ns in values]
        with self._lock:
            for ns in checked:
                self._count_locked(ns)
            self._count += len(checked)

    def _count_locked(self, ns: int) -> None:
        """Count one checked value into its bucket, sum, min, max and overflow; the caller holds the lock."""
        over = ns > MAX_NS
        self._counts[_index(MAX_NS if over else ns)] += 1
        self._sum = min(self._sum + ns, _INT64_MAX)
        if self._min is None or ns < self._min:
            self._min = ns
        if self._max is None or ns > self._max:
            self._max = ns
        if over:
            self._overflow += 1

    @property
    def count(self) -> int:
        """How many values were recorded."""
        return self._count

    @property
    def sum_ns(self) -> int:
        """The exact sum of the recorded values (sticks at ``2**63 - 1``, 292 years, instead of wrapping)."""
        return self._sum

    @property
    def min_ns(self) -> int | None:
        """The smallest recorded value, exact; None when empty."""
        return self._min

    @property
    def max_ns(self) -> int | None:
        """The largest recorded value, exact; None when empty."""
        return self._max

    @property
    def overflow(self) -> int:
        """How many recorded values were above ``MAX_NS`` (100 s)."""
        return self._overflow

    def counts(self) -> list[int]:
        """A copy of the ``BUCKETS`` bucket counts (see ``bucket_bounds``)."""
        with self._lock:
            return list(self._counts)

    def quantile(self, q: float) -> int | None:
        """The ``q`` quantile in ns (``0 <= q <= 1``), within 0.79 % of the exact one; None when empty."""
        return self.quantiles((q,))[0]

    def quantiles(self, qs: Iterable[float] = DEFAULT_QUANTILES) -> tuple[int | None, ...]:
        """Several quantiles from one consistent read of the buckets."""
        checked = checked_qs(qs)
        with self._lock:
            counts = list(self._counts)
            total, min_ns, max_ns = self._count, self._min, self._max
        if min_ns is None or max_ns is None:
            return tuple(None for _ in checked)
        return tuple(_quantile(counts, total, min_ns, max_ns, q) for q in checked)

    def count_le(self, bounds_ns: Sequence[int]) -> list[int]:
        """For each bound, how many values are ``<=`` it at bucket precision (for Prometheus ``le`` buckets)."""
        indexes = bound_indexes(bounds_ns)
        with self._lock:
            counts = list(self._counts)
        cumulative = list(itertools.accumulate(counts))
        return [0 if index < 0 else cumulative[index] for index in indexes]

    def merge(self, other: LatencyHistogram) -> None:
        """Add everything ``other`` (a histogram of either twin) recorded to this one."""
        if not is_latency_histogram(other):
            raise TypeError(f"other must be a LatencyHistogram, not {type(other).__name__}")
        if isinstance(other, LatencyHistogram):
            with other._lock:
                counts = list(other._counts)
                total, sum_ns, min_ns, max_ns, overflow = (
                    other._count,
                    other._sum,
                    other._min,
                    other._max,
                    other._overflow,
                )
        else:
            counts = other.counts()
            total = sum(counts)
            sum_ns, min_ns, max_ns, overflow = other.sum_ns, other.min_ns, other.max_ns, other.overflow
        if total == 0:
            return
        with self._lock:
            for index, count in enumerate(counts):
                if count:
                    self._counts[index] += count
            self._count += total
            self._sum = min(self._sum + sum_ns, _INT64_MAX)
            if min_ns is not None and (self._min is None or min_ns < self._min):
                self._min = min_ns
            if max_ns is not None and (self._max is None or max_ns > self._max):
                self._max = max_ns
            self._overflow += overflow

    def reset(self) -> None:
        """Forget every recorded value."""
        with self._lock:
            self._clear()

    def copy(self) -> Self:
        """An independent histogram with the same contents."""
        clone = type(self)()
        clone.merge(self)
        return clone

    def __repr__(self) -> str:
        p50, p99 = self.quantiles((0.5, 0.99))
        return f"<LatencyHistogram count={self._count} p50_ns={p50} p99_ns={p99} max_ns={self._max}>"


def checked_window_ns(window_s: object) -> int:
    if isinstance(window_s, bool) or not isinstance(window_s, Real):
        raise TypeError(f"window_s must be a real number of seconds, not {type(window_s).__name__}")
    as_float = float(window_s)
    if not math.isfinite(as_float) or as_float <= 0:
        raise ValueError(f"window_s must be a finite number > 0, got {as_float!r}")
    scaled = as_float * NS_PER_SECOND
    if scaled >= 2.0**63:
        raise ValueError(f"window_s is too large for a 64-bit monotonic clock, got {as_float!r}")
    return round(scaled)


def checked_slices(slices: object) -> int:
    if isinstance(slices, bool) or not isinstance(slices, int):
        raise TypeError(f"slices must be an int, not {type(slices).__name__}")
    if not 1 <= slices <= MAX_SLICES:
        raise ValueError(f"slices must be between 1 and {MAX_SLICES}, got {slices}")
    return int(slices)


def window_slice_ns(window_s: object, slices: object) -> tuple[float, int, int]:
    """Validate ``WindowedHistogram``'s arguments: ``(window_s, slices, slice_ns)``.

    ``slice_ns = window_ns // slices``; the window really covered is
    ``slices * slice_ns`` (at most ``slices - 1`` ns shorter than asked).
    """
    window_ns = checked_window_ns(window_s)
    count = checked_slices(slices)
    slice_ns = window_ns // count
    if slice_ns < 1:
        raise ValueError(f"window_s must be at least slices nanoseconds, got {float(window_s)!r}")  # type: ignore[arg-type]
    return float(window_s), count, slice_ns  # type: ignore[arg-type]


class WindowedHistogram:
    """The latencies of the last ``window_s`` seconds, plus a cumulative total.

    >>> w = WindowedHistogram(10.0, slices=10)
    >>> w.record(2_000_000, now_ns=0)
    >>> w.count(now_ns=9_999_999_999), w.count(now_ns=10_000_000_000), w.total.count
    (1, 0, 1)

    The window is a ring of ``slices`` histograms; slice ``k`` holds the
    values whose clock reading falls in epoch ``e = now_ns // slice_ns`` with
    ``e % slices == k``. A value recorded in epoch ``e`` is in the window at
    ``now`` while ``now // slice_ns - e < slices``: the window covers between
    ``window_s * (1 - 1/slices)`` and ``window_s`` of the most recent time,
    and never anything older than ``window_s``. A slice is reset when its slot
    is first reused by a newer epoch, so a gap longer than the window clears
    everything. A value whose clock reading is older than its slot's current
    epoch (a thread preempted for a whole window between reading the clock and
    recording) is left out of the window; ``total`` always gets every value.

    Concurrency: ``record`` takes no lock on its path, only the rotation of a
    slice (once per slice per ``slice_ns``) does. The rotating thread first
    zeroes the slice, *then* publishes the new epoch; a thread recording in
    the new epoch that sees the old epoch waits for the rotation lock, so no
    value of the new epoch is ever wiped. The only records that can race the
    zeroing are those that read the *old* epoch, i.e. values from the slice
    that is leaving the window at that very moment: each may be wiped (it was
    about to expire anyway) or survive into the new slice (one stale value per
    thread caught in that race, at most). Making that exact would need a lock
    or a version check on every record, which is what this design avoids.
    """

    __slots__ = ("_epochs", "_ring", "_rotate_lock", "_slice_ns", "_slices", "_total", "_window_s")

    def __init__(self, window_s: float = 10.0, *, slices: int = 10) -> None:
        window_s, slices, slice_ns = window_slice_ns(window_s, slices)
        if hasattr(self, "_ring"):
            raise RuntimeError("WindowedHistogram.__init__ called on a histogram already initialised")
        self._window_s, self._slices, self._slice_ns = window_s, slices, slice_ns
        self._ring = [LatencyHistogram() for _ in range(self._slices)]
        # An unused slot is empty, so its epoch only needs to be older than any real one.
        self._epochs = [_INT64_MIN] * self._slices
        self._rotate_lock = threading.Lock()
        self._total = LatencyHistogram()

    @property
    def window_s(self) -> float:
        """The window asked for, in seconds."""
        return self._window_s

    @property
    def slices(self) -> int:
        """How many histograms the ring holds."""
        return self._slices

    @property
    def slice_ns(self) -> int:
        """The time each slice covers, in nanoseconds."""
        return self._slice_ns

    @property
    def total(self) -> LatencyHistogram:
        """Everything ever recorded (cumulative; what a Prometheus histogram exports)."""
        return self._total

    def record(self, ns: int, now_ns: int | None = None) -> None:
        """Count one latency of ``ns`` nanoseconds in the current slice and in ``total``."""
        ns = checked_ns(ns, "ns")
        self._record_at(ns, clock_ns(now_ns))

    def record_many(self, values: Iterable[int], now_ns: int | None = None) -> None:
        """Count every value of ``values`` (all checked first), each at ``now_ns`` or at its own clock reading."""
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise TypeError(f"values must be an iterable of ints, not {type(values).__name__}")
        checked = [checked_ns(ns, "values") for ns in values]
        fixed = None if now_ns is None else clock_ns(now_ns)
        for ns in checked:
            self._record_at(ns, time.monotonic_ns() if fixed is None else fixed)

    def _record_at(self, ns: int, now: int) -> None:
        epoch = now // self._slice_ns
        slot = epoch % self._slices
        if self._epochs[slot] != epoch:
            self._rotate(slot, epoch)
        if self._epochs[slot] == epoch:
            self._ring[slot].record(ns)
        self._total.record(ns)

    def _rotate(self, slot: int, epoch: int) -> None:
        with self._rotate_lock:
            if self._epochs[slot] < epoch:
                self._ring[slot].reset()
                self._epochs[slot] = epoch

    def _live(self, now_ns: int | None) -> list[LatencyHistogram]:
        oldest_excluded = max(clock_ns(now_ns) // self._slice_ns - self._slices, _INT64_MIN)
        return [self._ring[slot] for slot in range(self._slices) if self._epochs[slot] > oldest_excluded]

    def snapshot(self, now_ns: int | None = None) -> LatencyHistogram:
        """A new histogram holding the live window at ``now_ns``."""
        merged = LatencyHistogram()
        for histogram in self._live(now_ns):
            merged.merge(histogram)
        return merged

    def count(self, now_ns: int | None = None) -> int:
        """How many values the live window holds."""
        return sum(histogram.count for histogram in self._live(now_ns))

    def quantile(self, q: float, now_ns: int | None = None) -> int | None:
        """The ``q`` quantile of the live window, in ns; None when it is empty."""
        checked_q(q)
        return self.snapshot(now_ns).quantile(q)

    def quantiles(self, qs: Iterable[float] = DEFAULT_QUANTILES, now_ns: int | None = None) -> tuple[int | None, ...]:
        """Several quantiles of the live window from one merged read."""
        checked = checked_qs(qs)
        return self.snapshot(now_ns).quantiles(checked)

    def reset(self) -> None:
        """Forget everything, the window and ``total`` alike."""
        with self._rotate_lock:
            for slot in range(self._slices):
                self._ring[slot].reset()
                self._epochs[slot] = _INT64_MIN
        self._total.reset()

    def __repr__(self) -> str:
        return f"<WindowedHistogram window_s={self._window_s} slices={self._slices} total={self._total.count}>"
