"""``LoadReport``: the ORCA ``endpoint-load-metrics`` response header, computed from an admission line's counters.

Envoy's client-side weighted round robin (and Envoy Gateway's, and gRPC's
``weighted_round_robin``) weighs each endpoint by the ORCA load report its
responses carry, as ``qps / (utilization + eps / qps * error_utilization_penalty)``,
where ``qps`` is the report's ``rps_fractional``, ``eps`` its ``eps`` and the
utilization its ``application_utilization`` when above 0, else its
``cpu_utilization``. Without a report, a balancer learns that an instance is
overloaded only from its refusals. ``LoadReport`` writes one from a
``stats()`` dict (any of prazo's: the middleware's, a server embedding's, the
front door's), in the header's ``TEXT`` form::

    endpoint-load-metrics: TEXT application_utilization=0.5, cpu_utilization=0.31, rps_fractional=120.3, eps=2.5, named_metrics.queue=7

or its ``JSON`` form (``JSON {"application_utilization": 0.5, ..., "named_metrics": {"queue": 7}}``):

* ``application_utilization``: the busy share of the places that run work,
  ``in_flight / limit`` (``limit``, the limit in force, which a ``vegas``
  limit moves; else ``max_concurrency``). Not capped at 1: a vegas limit
  lowered below the requests already running is over 1, as the line is.
  Left out when the stats give no positive limit.
* ``cpu_utilization``: this process's CPU time over the interval's wall time,
  divided by the CPUs it may run on (its affinity, else ``os.cpu_count()``),
  at most 1. On a host of several processes it is the reporting process's
  share only; ``application_utilization`` is the host's line.
* ``rps_fractional``: every request answered per second over the interval:
  completed plus refused, because the ORCA report's ``qps`` counts every
  query whatever its result, and ``eps`` a subset of them.
* ``eps``: refusals per second over the interval, every reason (full,
  expired on arrival, in the queue or at start, insufficient budget, shed,
  evicted, shutting down).
* ``named_metrics.queue``: the requests waiting now.

The rates and the CPU share need two samples: the first report (at the
first request) carries the utilization and the queue only, and each later
one the rates since the report before it. A counter that went backwards
(a restarted host) counts as no change. The value is computed at most once
per ``interval_s`` (1 s by default) and cached: a response in between reads
one attribute; the one that finds it stale refreshes it, under a lock that
no other response waits for (they keep the cached value). When ``stats()``
raises, the previous value stays (none at first: the response then has no
header), and it is logged once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prazo.bindings.policies import checked_choice

__all__ = [
    "HEADER_NAME",
    "LOAD_REPORT_FORMATS",
    "REFUSAL_COUNTERS",
    "LoadReport",
    "LoadReportingStartResponse",
    "checked_load_report_format",
    "optional_load_report",
]

HEADER_NAME = "endpoint-load-metrics"
LOAD_REPORT_FORMATS = ("text", "json")
#: The counters of ``stats()`` that count refusals; ``expired`` (the sum of two of them) is left out.
REFUSAL_COUNTERS = (
    "rejected_full",
    "expired_on_arrival",
    "expired_in_queue",
    "expired_at_start",
    "insufficient_budget",
    "shed",
    "evicted",
    "cancelled",
)
DEFAULT_INTERVAL_S = 1.0
# A balancer compares weights, not the fourth decimal; short values keep the header short.
_DECIMALS = 4

_log = logging.getLogger("prazo.load_report")


def checked_load_report_format(value: object, name: str = "format") -> str:
    """``value`` when it is ``"text"`` or ``"json"``; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    return checked_choice(value, name, LOAD_REPORT_FORMATS)


def _checked_interval(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"interval_s must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"interval_s must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the system says it, else every CPU."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _count(stats: Mapping[str, Any], key: str) -> int:
    """A counter of ``stats``, or 0 when it is missing, not an int, or negative."""
    value = stats.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(0, value)


def _number(value: float) -> float | int:
    """``value`` rounded for the header; an integral value as an int (``7``, not ``7.0``)."""
    rounded = round(value, _DECIMALS)
    return int(rounded) if rounded.is_integer() else rounded


class _Sample:
    """What one refresh read: when, the CPU time so far, and the answered and refused counts so far."""

    __slots__ = ("answered", "cpu_s", "refused", "wall_s")

    def __init__(self, wall_s: float, cpu_s: float, answered: int, refused: int) -> None:
        self.wall_s = wall_s
        self.cpu_s = cpu_s
        self.answered = answered
        self.refused = refused


class LoadReport:
    """The ``endpoint-load-metrics`` header of ``stats()``, cached for ``interval_s`` (see the module).

    ``stats`` is called at most once per ``interval_s``; ``format`` is
    ``"text"`` or ``"json"``. ``clock`` (seconds, monotonic) and ``cpu_time``
    (this process's CPU seconds) are for tests; ``cpus`` is the CPU count the
    CPU share divides by (default: the process's affinity).

    >>> clock = iter([0.0, 2.0]).__next__
    >>> counters = {"in_flight": 1, "queued": 0, "completed": 0, "max_concurrency": 4}
    >>> report = LoadReport(lambda: counters, "text", clock=clock, cpu_time=lambda: 0.0, cpus=1)
    >>> report.value()
    'TEXT application_utilization=0.25, named_metrics.queue=0'
    >>> counters.update(completed=10, rejected_full=2, queued=3)
    >>> report.value()
    'TEXT application_utilization=0.25, cpu_utilization=0, rps_fractional=6, eps=1, named_metrics.queue=3'
    """

    def __init__(
        self,
        stats: Callable[[], Mapping[str, Any]],
        format: str = "text",
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        cpu_time: Callable[[], float] = time.process_time,
        cpus: int | None = None,
    ) -> None:
        if not callable(stats):
            raise TypeError(f"stats must be callable, not {type(stats).__name__}")
        if not callable(clock):
            raise TypeError(f"clock must be callable, not {type(clock).__name__}")
        if not callable(cpu_time):
            raise TypeError(f"cpu_time must be callable, not {type(cpu_time).__name__}")
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int)):
            raise TypeError(f"cpus must be an int or None, not {type(cpus).__name__}")
        if cpus is not None and cpus < 1:
            raise ValueError(f"cpus must be >= 1, got {cpus}")
        self._stats = stats
        self.format = checked_load_report_format(format)
        self.interval_s = _checked_interval(interval_s)
        self._clock = clock
        self._cpu_time = cpu_time
        self._cpus = _usable_cpus() if cpus is None else cpus
        self._previous: _Sample | None = None
        # (when it goes stale, the value): one attribute, so a reader never sees one without the other.
        self._cached: tuple[float, str | None] = (-math.inf, None)
        self._refreshing = threading.Lock()
        self._warned = False

    def value(self) -> str | None:
        """The header's value now: the cached one, refreshed first when ``interval_s`` has passed."""
        now = self._clock()
        stale_at, value = self._cached
        if now < stale_at:
            return value
        # One refresh at a time; the others answer with the value they have rather than wait.
        if not self._refreshing.acquire(blocking=False):
            return value
        try:
            return self._refresh(now)
        finally:
            self._refreshing.release()

    def header(self) -> tuple[str, str] | None:
        """``(HEADER_NAME, value())``, or None while there is no value."""
        value = self.value()
        return None if value is None else (HEADER_NAME, value)

    def start_response(self, start_response: Callable[..., Any]) -> LoadReportingStartResponse:
        """``start_response`` adding the header to every response started through it (see ``LoadReportingStartResponse``)."""
        return LoadReportingStartResponse(start_response, self)

    def _refresh(self, now: float) -> str | None:
        stale_at, value = self._cached
        if now < stale_at:
            return value  # another thread refreshed it between the check and the lock
        try:
            stats = self._stats()
            cpu_s = self._cpu_time()
            fields = self._fields(stats, now, cpu_s)
        except Exception:  # noqa: BLE001 - a report that cannot be made must never fail the response
            if not self._warned:
                self._warned = True
                _log.warning("prazo: the load report cannot read the counters; responses keep the last one")
            self._cached = (now + self.interval_s, value)
            return value
        value = self._encode(fields)
        self._cached = (now + self.interval_s, value)
        return value

    def _fields(self, stats: Mapping[str, Any], now: float, cpu_s: float) -> dict[str, float | int]:
        """The report's fields in the order they are written, from ``stats`` read at ``now``."""
        fields: dict[str, float | int] = {}
        limit = _count(stats, "limit") or _count(stats, "max_concurrency")
        if limit > 0:
            fields["application_utilization"] = _number(_count(stats, "in_flight") / limit)
        refused = sum(_count(stats, key) for key in REFUSAL_COUNTERS)
        sample = _Sample(now, cpu_s, _count(stats, "completed") + refused, refused)
        previous, self._previous = self._previous, sample
        elapsed = 0.0 if previous is None else now - previous.wall_s
        if previous is not None and elapsed > 0:
            cpu_share = max(0.0, sample.cpu_s - previous.cpu_s) / elapsed / self._cpus
            fields["cpu_utilization"] = _number(min(1.0, cpu_share) if math.isfinite(cpu_share) else 0.0)
            fields["rps_fractional"] = _number(max(0, sample.answered - previous.answered) / elapsed)
            fields["eps"] = _number(max(0, sample.refused - previous.refused) / elapsed)
        fields["named_metrics.queue"] = _count(stats, "queued")
        return fields

    def _encode(self, fields: Mapping[str, float | int]) -> str:
        if self.format == "text":
            return "TEXT " + ", ".join(f"{name}={value}" for name, value in fields.items())
        document: dict[str, Any] = {}
        for name, value in fields.items():
            group, dot, key = name.partition(".")
            if dot:
                document.setdefault(group, {})[key] = value
            else:
                document[name] = value
        return "JSON " + json.dumps(document)


class LoadReportingStartResponse:
    """A WSGI ``start_response`` that adds the load report's header to the headers it passes on.

    The app's list is copied, never extended (an app may pass the same list
    to every response). A response that already carries the header (an app
    reporting its own load, or an inner layer reporting too) keeps its own:
    one report per response, as the balancer reads one.
    """

    __slots__ = ("_report", "_start_response")

    def __init__(self, start_response: Callable[..., Any], report: LoadReport) -> None:
        self._start_response = start_response
        self._report = report

    def __call__(self, status: str, headers: Iterable[tuple[str, str]], exc_info: Any = None) -> Any:
        headers = list(headers)
        # Whatever the names are: a bad header is the server's to refuse, with its own words.
        if not any(isinstance(name, str) and name.lower() == HEADER_NAME for name, _ in headers):
            header = self._report.header()
            if header is not None:
                headers.append(header)
        # Without exc_info the server gets the two arguments an app passes most of the time.
        if exc_info is None:
            return self._start_response(status, headers)
        return self._start_response(status, headers, exc_info)


def optional_load_report(
    format: str | None,
    stats: Callable[[], Mapping[str, Any]],
    name: str = "load_report",
) -> LoadReport | None:
    """A ``LoadReport`` of ``stats`` in ``format``, or None when ``format`` is None (the option is off)."""
    if format is None:
        return None
    return LoadReport(stats, checked_load_report_format(format, name))
