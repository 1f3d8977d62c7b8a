"""The arithmetic of the queue policies in pure Python: the readable twin of ``prazo_policy.h``.

Every function and class here gives the same integers as its C counterpart
for the same inputs; ``_queue_py.py`` uses these, the C twin of the queue
(and the front door) the header. Sections follow the header's, one owner each.
"""

from __future__ import annotations

import math
from numbers import Real

from ._histogram_py import bucket_bounds, bucket_index
from .deadline import NS_PER_MS

__all__ = [
    "LEARNED_QUANTILES",
    "SERVICE_EVERY",
    "SERVICE_GENERATION",
    "SERVICE_MIN_SAMPLES",
    "VERDICT_EXPIRED",
    "VERDICT_INSUFFICIENT",
    "VERDICT_LIVE",
    "CoDel",
    "ServiceEstimate",
    "checked_started_ns",
    "codel_option_ns",
    "deadline_verdict",
    "effective_deadline_ns",
    "expected_service_option",
]

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _positive_ms(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number of milliseconds, not {type(value).__name__}")
    ms = float(value)
    if not (math.isfinite(ms) and ms > 0):
        raise ValueError(f"{name} must be a finite number of milliseconds > 0, got {value!r}")
    if ms * NS_PER_MS >= _INT64_MAX:
        raise ValueError(f"{name} is too large, got {value!r}")
    return ms


def _ms_to_ns(ms: float) -> int:
    # At least 1 ns: a positive setting must never read as "off" (0).
    return max(1, round(ms * NS_PER_MS))


# -- CoDel / adaptive LIFO (owner: core-dequeue) -----------------------------------

DEFAULT_CODEL_TARGET_MS = 5.0
DEFAULT_CODEL_INTERVAL_MS = 100.0


def codel_option_ns(value: object, name: str, default: float, adaptive: bool) -> int:
    """Validate ``codel_target_ms`` / ``codel_interval_ms``; return it in ns.

    A value other than the default is only accepted with ``order="adaptive"``,
    where it means something.
    """
    ms = _positive_ms(value, name)
    if not adaptive and ms != default:
        raise ValueError(f"{name} only applies to order='adaptive', got {name}={value!r}")
    return _ms_to_ns(ms)


class CoDel:
    """``struct prazo_codel``: when the line is standing and how long an entry may wait.

    The line is *standing* when it has not been empty for longer than
    ``interval_ns``: then the newest entry is served first and an entry that
    waited longer than ``target_ns`` is shed; otherwise FIFO, shedding only
    beyond ``interval_ns``. ``last_empty_ns`` is noted at every arrival that
    finds the line empty, which makes it exactly the start of the current
    non-empty stretch whenever the line is non-empty.
    """

    __slots__ = ("interval_ns", "last_empty_ns", "target_ns")

    def __init__(self, target_ns: int, interval_ns: int, now_ns: int) -> None:
        self.target_ns = target_ns
        self.interval_ns = interval_ns
        self.last_empty_ns = now_ns

    def note_empty(self, now_ns: int) -> None:
        self.last_empty_ns = now_ns

    def standing(self, now_ns: int) -> bool:
        # Both are int64 in C: a difference beyond that range saturates there.
        since = max(_INT64_MIN, min(_INT64_MAX, now_ns - self.last_empty_ns))
        return since > self.interval_ns

    def max_sojourn(self, now_ns: int) -> int:
        return self.target_ns if self.standing(now_ns) else self.interval_ns


# -- doomed-work skip: learned service-time estimate (owner: core-dequeue) -----------

SERVICE_GENERATION = 256
SERVICE_EVERY = 16
SERVICE_MIN_SAMPLES = 32

# The quantiles a learned estimate may use, by the name expected_service_ms takes.
LEARNED_QUANTILES = {"p50": 500, "p90": 900, "p95": 950, "p99": 990}


def expected_service_option(value: object) -> tuple[int, int]:
    """Validate ``expected_service_ms``: ``(fixed_ns, quantile_permille)``; ``(0, 0)`` is off."""
    if value is None:
        return 0, 0
    if isinstance(value, str):
        permille = LEARNED_QUANTILES.get(value)
        if permille is None:
            raise ValueError(
                f"expected_service_ms must be a number of ms > 0 or one of {', '.join(LEARNED_QUANTILES)}, got {value!r}"
            )
        return 0, permille
    return _ms_to_ns(_positive_ms(value, "expected_service_ms")), 0


class _Generation:
    """One generation of samples: counts per histogram bucket, with the exact extremes (a ``prazo_hist``)."""

    __slots__ = ("counts", "high", "low", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0
        self.low = _INT64_MAX
        self.high = -1

    def record(self, ns: int) -> None:
        index = bucket_index(ns)
        self.counts[index] = self.counts.get(index, 0) + 1
        self.total += 1
        self.low = min(self.low, ns)
        self.high = max(self.high, ns)


class ServiceEstimate:
    """``struct prazo_service_estimate``: the expected service time, fixed or learned.

    Learned: two generations of ``SERVICE_GENERATION`` samples; every
    ``SERVICE_EVERY`` samples, once ``SERVICE_MIN_SAMPLES`` exist, the
    estimate becomes the nearest-rank quantile of both generations at the
    histogram's bucket precision (rank 1: the exact minimum; rank n: the exact
    maximum; otherwise the middle of the rank's bucket, moved into [min, max]).
    """

    __slots__ = ("_current", "_estimate_ns", "_fixed_ns", "_generations", "_permille", "_samples")

    def __init__(self, fixed_ns: int, quantile_permille: int) -> None:
        self._fixed_ns = max(0, fixed_ns)
        self._permille = quantile_permille
        self._generations = [_Generation(), _Generation()]
        self._current = 0
        self._samples = 0
        self._estimate_ns = 0

    @property
    def ns(self) -> int:
        """The expected service time; 0 = no skip (off, or not learned yet)."""
        return self._fixed_ns if self._fixed_ns > 0 else self._estimate_ns

    def sample(self, service_ns: int) -> None:
        """One service time (a negative one counts as 0); ignored by a fixed estimate."""
        if self._fixed_ns > 0:
            return
        generation = self._generations[self._current]
        generation.record(max(0, min(_INT64_MAX, service_ns)))
        self._samples += 1
        if self._samples % SERVICE_EVERY == 0 and self._samples >= SERVICE_MIN_SAMPLES:
            self._estimate_ns = self._quantile()
        if generation.total == SERVICE_GENERATION:
            self._current ^= 1
            self._generations[self._current] = _Generation()

    def _quantile(self) -> int:
        older, newer = self._generations
        n = older.total + newer.total
        low, high = min(older.low, newer.low), max(older.high, newer.high)
        rank = max(1, (self._permille * n + 999) // 1000)
        if rank >= n:
            return high
        if rank == 1:
            return low
        seen = 0
        for index in sorted(older.counts.keys() | newer.counts.keys()):
            seen += older.counts.get(index, 0) + newer.counts.get(index, 0)
            if seen >= rank:
                lo, hi = bucket_bounds(index)
                return min(max(lo + (hi - lo) // 2, low), high)
        return high


# The verdict of an entry's deadline at a moment (prazo_deadline_verdict).
VERDICT_LIVE, VERDICT_EXPIRED, VERDICT_INSUFFICIENT = range(3)


def effective_deadline_ns(deadline_ns: int, expected_ns: int) -> int:
    """When an entry stops being worth starting: its deadline minus the expected service time."""
    return max(_INT64_MIN, deadline_ns - expected_ns)


def deadline_verdict(now_ns: int, deadline_ns: int, expected_ns: int) -> int:
    """``VERDICT_LIVE``: start it; ``VERDICT_EXPIRED`` / ``VERDICT_INSUFFICIENT``: drop it."""
    if now_ns >= deadline_ns:
        return VERDICT_EXPIRED
    if expected_ns > 0 and now_ns >= effective_deadline_ns(deadline_ns, expected_ns):
        return VERDICT_INSUFFICIENT
    return VERDICT_LIVE


def checked_started_ns(started_ns: object) -> int | None:
    """Validate ``release(started_ns=)``: None, or an int of monotonic ns in [0, 2**63)."""
    if started_ns is None:
        return None
    if isinstance(started_ns, bool) or not isinstance(started_ns, int):
        raise TypeError(f"started_ns must be an int of monotonic nanoseconds, not {type(started_ns).__name__}")
    # Negative is refused (not just out of range): the C twin spells "no sample" as -1.
    if not 0 <= started_ns <= _INT64_MAX:
        raise ValueError(f"started_ns must be a monotonic clock reading in [0, 2**63), got {started_ns}")
    return int(started_ns)


# -- Vegas adaptive limit (owner: core-admission) ------------------------------------
#
# The constants and the rule are documented once, in prazo_policy.h's Vegas section.

__all__ += [
    "LIMIT_POLICIES",
    "VEGAS_WINDOW",
    "Vegas",
    "critical_option",
    "limit_option",
    "priority_may_start",
    "reserved_option",
    "vegas_log10",
    "vegas_queue",
]

VEGAS_WINDOW = 16
VEGAS_PROBE_EVERY = 32
VEGAS_INITIAL = 4
VEGAS_ALPHA = 2
VEGAS_BETA = 2
VEGAS_MAX_SAMPLE_NS = 1 << 40


LIMIT_POLICIES = ("fixed", "vegas")


def _int_option(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    return value


def limit_option(limit: object, min_concurrency: object, max_concurrency: int) -> tuple[bool, int]:
    """Validate ``limit`` and ``min_concurrency``: ``(vegas, min_concurrency)``.

    ``min_concurrency`` other than 1 only means something with ``limit="vegas"``.
    """
    if not isinstance(limit, str):
        raise TypeError(f"limit must be 'fixed' or 'vegas', not {type(limit).__name__}")
    if limit not in LIMIT_POLICIES:
        raise ValueError(f"limit must be 'fixed' or 'vegas', got {limit!r}")
    floor = _int_option(min_concurrency, "min_concurrency")
    if not 1 <= floor <= max_concurrency:
        raise ValueError(f"min_concurrency must be between 1 and max_concurrency ({max_concurrency}), got {floor}")
    if limit == "fixed" and floor != 1:
        raise ValueError(f"min_concurrency only applies to limit='vegas', got min_concurrency={floor}")
    return limit == "vegas", floor


def vegas_log10(limit: int) -> int:
    """``max(1, floor(log10(limit)))`` in integers (Netflix's Log10RootFunction)."""
    lg = 0
    while limit >= 10:
        limit //= 10
        lg += 1
    return max(1, lg)


def vegas_queue(limit: int, rtt: int, noload: int) -> int:
    """``ceil(limit * (rtt - noload) / rtt)``, with the C twin's scaling of both times below 2**31."""
    while rtt >= 1 << 31:
        rtt >>= 1
        noload >>= 1
    return (limit * (rtt - noload) + rtt - 1) // rtt


class Vegas:
    """``struct prazo_vegas``: an adaptive concurrency limit from service-time samples."""

    __slots__ = (
        "limit",
        "max_limit",
        "min_limit",
        "probe_restore",
        "rtt_noload_ns",
        "window_count",
        "window_demand",
        "window_sum_ns",
        "windows",
    )

    def __init__(self, min_limit: int, max_limit: int) -> None:
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.limit = max(min_limit, min(max_limit, VEGAS_INITIAL))
        self.rtt_noload_ns = 0
        self.window_sum_ns = 0
        self.window_count = 0
        self.window_demand = 0
        self.windows = 0
        self.probe_restore = 0

    def sample(self, service_ns: int, in_flight: int) -> int:
        """One service time of a slot released while ``in_flight`` were taken; return the limit."""
        if self.probe_restore > 0 and self.window_count == 0 and in_flight > self.limit:
            return self.limit
        service_ns = max(1, min(VEGAS_MAX_SAMPLE_NS, service_ns))
        self.window_sum_ns += service_ns
        if self.window_count == 0 or in_flight > self.window_demand:
            self.window_demand = in_flight
        self.window_count += 1
        if self.window_count < VEGAS_WINDOW:
            return self.limit
        rtt = self.window_sum_ns // VEGAS_WINDOW
        self.window_count = 0
        self.window_sum_ns = 0
        return self._decide(rtt, self.window_demand)

    def _decide(self, rtt: int, demand: int) -> int:
        limit = self.limit
        if self.probe_restore > 0:
            self.rtt_noload_ns = rtt
            self.limit = self.probe_restore
            self.probe_restore = 0
            self.windows = 0
            return self.limit
        if self.rtt_noload_ns == 0 or rtt < self.rtt_noload_ns:
            self.rtt_noload_ns = rtt
            return limit
        self.windows += 1
        if self.windows >= VEGAS_PROBE_EVERY:
            probe = max(self.min_limit, limit // 2)
            if probe < limit:
                self.probe_restore = limit
                self.limit = probe
                return probe
            self.rtt_noload_ns = rtt
            self.windows = 0
            return limit
        queue = vegas_queue(limit, rtt, self.rtt_noload_ns)
        lg = vegas_log10(limit)
        if queue > VEGAS_BETA * lg:
            limit -= lg
        elif demand * 2 < limit:
            pass  # app-limited: no evidence that more concurrency would help
        elif queue < VEGAS_ALPHA * lg:
            limit += lg
        self.limit = max(self.min_limit, min(self.max_limit, limit))
        return self.limit


# -- priority classes (owner: core-admission) ------------------------------------------


def reserved_option(reserved: object, max_concurrency: int) -> int:
    """Validate ``reserved``: ``0 <= reserved < max_concurrency``."""
    value = _int_option(reserved, "reserved")
    if not 0 <= value < max_concurrency:
        raise ValueError(f"reserved must be >= 0 and < max_concurrency ({max_concurrency}), got {value}")
    return value


def critical_option(critical: object) -> bool:
    """Validate a ``critical=`` flag: a bool (a header value or a callable is the binding's business)."""
    if not isinstance(critical, bool):
        raise TypeError(f"critical must be a bool, not {type(critical).__name__}")
    return critical


def priority_may_start(in_flight: int, limit: int, reserved: int, critical: bool, critical_active: int) -> bool:
    """Whether an entry may take a slot now (``prazo_priority_may_start``).

    A critical entry: whenever a slot under ``limit`` is free. A normal one:
    below ``limit - reserved``, or up to ``limit`` while the critical class is
    idle (``critical_active``, its entries in flight plus waiting, is 0).
    """
    if in_flight >= limit:
        return False
    if critical or critical_active == 0:
        return True
    return in_flight < limit - reserved


# -- drain rate and Retry-After (owner: core-admission) ----------------------------

__all__ += ["DRAIN_STALE_WINDOWS", "DRAIN_WINDOW_NS", "RETRY_AFTER_MAX_NS", "DrainRate", "retry_after_ns"]

DRAIN_WINDOW_NS = 250_000_000
DRAIN_STALE_WINDOWS = 4
RETRY_AFTER_MAX_NS = 60_000_000_000


class DrainRate:
    """``struct prazo_drain``: the line's measured time between completions, sampled at arrivals.

    At an arrival, once a window of ``DRAIN_WINDOW_NS`` has passed, the
    completions since it opened give one sample (elapsed / completions),
    averaged with the previous interval. A window with running work and no
    completion stays open up to ``DRAIN_STALE_WINDOWS`` windows, then is
    itself the sample; a longer window with completions spanned a quiet
    stretch and is dropped. ``interval_ns`` is 0 until the first sample.
    """

    __slots__ = ("interval_ns", "mark_completed", "mark_ns")

    def __init__(self) -> None:
        self.mark_ns = 0  # no window open: the first arrival opens one
        self.mark_completed = 0
        self.interval_ns = 0

    def note(self, now_ns: int, completed: int, in_flight: int) -> int:
        """``prazo_drain_note``: close the window if it has run long enough; the interval now."""
        elapsed = now_ns - self.mark_ns
        if self.mark_ns == 0 or elapsed < 0:  # the first arrival, or a caller's clock behind the window
            self.mark_ns = now_ns
            self.mark_completed = completed
            return self.interval_ns
        if elapsed < DRAIN_WINDOW_NS:
            return self.interval_ns
        freed = completed - self.mark_completed
        stale = elapsed > DRAIN_STALE_WINDOWS * DRAIN_WINDOW_NS
        sample = 0
        if freed > 0 and not stale:
            sample = elapsed // freed
        elif freed == 0 and in_flight > 0 and not stale:
            return self.interval_ns  # nothing freed yet: the window stays open
        elif freed == 0 and in_flight > 0:
            sample = min(elapsed, RETRY_AFTER_MAX_NS)  # a place takes at least this long; past the cap, the cap
        if sample > 0:
            # Halved separately, as C does to stay clear of overflow.
            self.interval_ns = self.interval_ns // 2 + sample // 2 if self.interval_ns > 0 else sample
        self.mark_ns = now_ns
        self.mark_completed = completed
        return self.interval_ns


def retry_after_ns(interval_ns: int, queued: int) -> int:
    """``prazo_retry_after_ns``: (queued + 1) intervals within [interval, max]; 0 without a measurement."""
    if interval_ns <= 0:
        return 0
    return min((max(queued, 0) + 1) * interval_ns, RETRY_AFTER_MAX_NS)
