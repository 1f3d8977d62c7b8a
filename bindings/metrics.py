"""Prometheus metrics for prazo: a collector, a ``/metrics`` WSGI app, and how to mount it.

Needs ``prometheus_client`` (``pip install 'prazo[metrics]'``); nothing else
in prazo imports this module, and the core never imports ``prometheus_client``.

Register what the service has, once, at start-up::

    from prazo.bindings import metrics

    collector = metrics.register(api=middleware, thumbnails=pool)   # into prometheus_client's REGISTRY
    collector.add_dependency(recommendations)                        # a Dependency names itself
    app = metrics.mount_metrics(middleware)                          # /metrics beside, not behind, admission

``PrazoCollector`` is a ``prometheus_client`` custom collector: every scrape
reads each registered object's ``stats()`` (one consistent snapshot per object,
copied under its lock) and its latency histograms, and yields metric families;
``prometheus_client`` writes the exposition format. Registration holds only a
weak reference, so a registered object that is garbage-collected leaves the
output at the next scrape instead of being kept alive by its metrics.

Every admission point — an ``AdmissionQueue`` of either twin, an
``AdmissionMiddleware``, an ``AdmissionPool``, a server embedding — is labelled
``queue="<name>"``; a ``Dependency`` is labelled ``dependency="<its name>"``.
The metric names are listed in ``METRIC_NAMES`` and in the README ("Metrics").
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(f"prazo.bindings.metrics needs prometheus_client ({exc}): pip install 'prazo[metrics]'") from exc

from prazo.core import NS_PER_SECOND

from .dependency import Dependency
from .wsgi import Environ, StartResponse, WSGIApp

__all__ = [
    "BUCKETS_S",
    "METRIC_NAMES",
    "MetricsMount",
    "PrazoCollector",
    "collector_for",
    "metrics_app",
    "mount_metrics",
    "register",
]

_log = logging.getLogger(__name__)

#: Upper bounds (seconds) of every latency histogram's buckets, from 1 ms to
#: 10 s; ``+Inf`` is added. Fixed, so ``histogram_quantile`` and alerts can
#: aggregate across instances.
BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BOUNDS_NS = tuple(round(bound * NS_PER_SECOND) for bound in BUCKETS_S)
_LE_LABELS = tuple(floatToGoString(bound) for bound in BUCKETS_S)

_COUNTER, _GAUGE, _HISTOGRAM = "counter", "gauge", "histogram"
_Q = ("queue",)
_D = ("dependency",)

# Every family: name (counters without _total) -> (type, labels, help).
_SPECS: dict[str, tuple[str, tuple[str, ...], str]] = {
    # Every admission point: a queue, a middleware, a pool, a server embedding.
    "prazo_queue_offered": (_COUNTER, _Q, "Arrivals offered to the admission queue."),
    "prazo_queue_started": (_COUNTER, _Q, "Items that got a slot and started."),
    "prazo_queue_completed": (_COUNTER, _Q, "Items that finished and gave their slot back."),
    "prazo_queue_cancelled": (_COUNTER, _Q, "Items that left the line without an outcome (cancelled, interrupted)."),
    "prazo_queue_refused": (_COUNTER, (*_Q, "reason"), "Arrivals refused by the queue, by X-Prazo-Reason."),
    "prazo_queue_wait_seconds": (_COUNTER, _Q, "Time waited for a slot by every item that got one, summed."),
    "prazo_queue_in_flight": (_GAUGE, _Q, "Items holding a slot now."),
    "prazo_queue_assigned": (_GAUGE, _Q, "Items handed a slot but not yet running."),
    "prazo_queue_queued": (_GAUGE, _Q, "Items waiting for a slot now."),
    "prazo_queue_peak_in_flight": (_GAUGE, _Q, "Most items ever holding a slot at once."),
    "prazo_queue_peak_queued": (_GAUGE, _Q, "Most items ever waiting at once."),
    "prazo_queue_max_concurrency": (_GAUGE, _Q, "Slots: items that may run at once."),
    "prazo_queue_max_queue": (_GAUGE, _Q, "Places in the waiting line."),
    "prazo_queue_saturation": (_GAUGE, _Q, "in_flight / max_concurrency: at 1 every further arrival waits."),
    "prazo_queue_limit": (_GAUGE, _Q, "The concurrency limit in force (moves with limit='vegas'; else max_concurrency)."),
    "prazo_queue_expected_service_seconds": (
        _GAUGE,
        _Q,
        "Expected service time of the doomed-work skip (0: off, or not learned yet).",
    ),
    # A middleware or a server embedding.
    "prazo_wsgi_invalid_budget_headers": (_COUNTER, _Q, "Budget headers that did not parse (ignored)."),
    "prazo_wsgi_bypassed": (_COUNTER, _Q, "Requests on a bypass path (never queued)."),
    "prazo_wsgi_app_deadline_exceeded": (_COUNTER, _Q, "Requests whose app raised DeadlineExceeded."),
    "prazo_wsgi_app_downstream_overloaded": (_COUNTER, _Q, "Requests whose app raised DownstreamOverloaded."),
    "prazo_wsgi_refusals": (_COUNTER, (*_Q, "code"), "Refusals answered by prazo (queue or app), by status code."),
    # An AdmissionPool.
    "prazo_pool_workers": (_GAUGE, _Q, "Worker threads started."),
    "prazo_pool_futures_cancelled": (_COUNTER, _Q, "Futures cancelled before they ran."),
    "prazo_pool_fn_raised": (_COUNTER, _Q, "Tasks whose function raised."),
    # A socket-level server embedding (werkzeug, wsgiref, cheroot).
    "prazo_server_header_timeouts": (_COUNTER, _Q, "Request heads not complete in time (answered 408)."),
    "prazo_server_pending_heads": (_GAUGE, _Q, "Connections whose request head is still arriving."),
    "prazo_server_lingering_connections": (_GAUGE, _Q, "Refused connections being drained before they close."),
    # Opt-in (record_latency=True) on a middleware or a pool.
    "prazo_request_duration_seconds": (
        _HISTOGRAM,
        _Q,
        "Admitted requests (pool: tasks) from arrival to the release of their slot, queue wait included.",
    ),
    "prazo_request_queue_wait_seconds": (_HISTOGRAM, _Q, "Time admitted requests (pool: tasks) waited for a slot."),
    # A Dependency.
    "prazo_dependency_calls": (_COUNTER, (*_D, "outcome"), "Calls by outcome."),
    "prazo_dependency_rejected": (_COUNTER, _D, "Calls rejected without running (bulkhead full, breaker open)."),
    "prazo_dependency_stale_served": (_COUNTER, _D, "Calls answered with a last-known-good value."),
    "prazo_dependency_unavailable": (_COUNTER, _D, "Calls answered DependencyUnavailable (503)."),
    "prazo_dependency_hedges_sent": (_COUNTER, _D, "Hedged second attempts started."),
    "prazo_dependency_hedges_won": (_COUNTER, _D, "Hedged attempts that answered first."),
    "prazo_dependency_late_results": (_COUNTER, _D, "Attempts that returned after their caller stopped waiting."),
    "prazo_dependency_in_flight": (
        _GAUGE,
        _D,
        "Calls holding a bulkhead place now (timed-out ones until they return).",
    ),
    "prazo_dependency_max_concurrent": (_GAUGE, _D, "Bulkhead size."),
    "prazo_dependency_saturation": (_GAUGE, _D, "in_flight / max_concurrent: at 1 every further call is rejected."),
    "prazo_dependency_threads": (_GAUGE, _D, "Threads the dependency runs calls on."),
    "prazo_dependency_lkg_entries": (_GAUGE, _D, "Last-known-good values kept."),
    "prazo_dependency_timeout_seconds": (_GAUGE, _D, "The timeout a call starting now gets (adaptive ones move)."),
    "prazo_dependency_breaker_state": (_GAUGE, (*_D, "state"), "1 for the breaker's current state, 0 for the others."),
    "prazo_dependency_latency_seconds": (
        _GAUGE,
        (*_D, "quantile"),
        "Live call latency quantiles over the dependency's recent window (NaN before any call).",
    ),
    "prazo_dependency_call_duration_seconds": (_HISTOGRAM, _D, "Durations of the calls that returned, since start."),
}

#: Every metric family the collector can export: counters without their
#: ``_total`` suffix, histograms without ``_bucket``/``_sum``/``_count``.
METRIC_NAMES: tuple[str, ...] = tuple(_SPECS)

# Plain stats keys exported one to one: family -> key of stats().
_QUEUE_KEYS = {
    "prazo_queue_offered": "offered",
    "prazo_queue_started": "started",
    "prazo_queue_completed": "completed",
    "prazo_queue_cancelled": "cancelled",
    "prazo_queue_in_flight": "in_flight",
    "prazo_queue_assigned": "assigned",
    "prazo_queue_queued": "queued",
    "prazo_queue_peak_in_flight": "peak_in_flight",
    "prazo_queue_peak_queued": "peak_queued",
    "prazo_queue_max_concurrency": "max_concurrency",
    "prazo_queue_max_queue": "max_queue",
}
# Exported when stats() has them (middleware, servers, pools).
_OPTIONAL_KEYS = {
    "prazo_wsgi_invalid_budget_headers": "invalid_budget_header",
    "prazo_wsgi_bypassed": "bypassed",
    "prazo_wsgi_app_deadline_exceeded": "app_deadline_exceeded",
    "prazo_wsgi_app_downstream_overloaded": "app_downstream_overloaded",
    "prazo_pool_workers": "workers",
    "prazo_pool_futures_cancelled": "futures_cancelled",
    "prazo_pool_fn_raised": "fn_raised",
    "prazo_server_header_timeouts": "header_timeouts",
    "prazo_server_pending_heads": "pending_heads",
    "prazo_server_lingering_connections": "lingering",
}
_REFUSAL_KEYS = {
    "queue-full": "rejected_full",
    "expired-on-arrival": "expired_on_arrival",
    "expired-in-queue": "expired_in_queue",
}
# Outcomes of the queue policies: exported when stats() has them (a queue
# built before the policies existed, or a server's own line, may not).
_POLICY_REFUSAL_KEYS = {
    "insufficient-budget": "insufficient_budget",
    "shed-standing-queue": "shed",
    "evicted-by-critical": "evicted",
}
_REQUIRED_QUEUE_KEYS = frozenset({*_QUEUE_KEYS.values(), *_REFUSAL_KEYS.values(), "queue_wait_ns_total"})
_RESPONSE_KEYS = {"503": "responses_503", "504": "responses_504"}
# Opt-in histograms: family -> attribute of the middleware or pool.
_HISTOGRAM_ATTRIBUTES = {
    "prazo_request_duration_seconds": "request_duration",
    "prazo_request_queue_wait_seconds": "queue_wait",
}
_DEPENDENCY_KEYS = {
    "prazo_dependency_rejected": "rejected",
    "prazo_dependency_stale_served": "stale_served",
    "prazo_dependency_unavailable": "unavailable",
    "prazo_dependency_hedges_sent": "hedges_sent",
    "prazo_dependency_hedges_won": "hedges_won",
    "prazo_dependency_late_results": "late_results",
    "prazo_dependency_in_flight": "in_flight",
    "prazo_dependency_max_concurrent": "max_concurrent",
    "prazo_dependency_saturation": "saturation",
    "prazo_dependency_threads": "threads",
    "prazo_dependency_lkg_entries": "lkg_entries",
}
_DEPENDENCY_OUTCOMES = ("ok", "error", "timeout", "bulkhead_full", "breaker_open", "no_budget")
_BREAKER_STATES = ("closed", "open", "half-open", "disabled")
_QUANTILE_KEYS = {"0.5": "p50_ms", "0.95": "p95_ms", "0.99": "p99_ms"}


def _new_family(name: str) -> Metric:
    kind, labels, doc = _SPECS[name]
    if kind == _COUNTER:
        return CounterMetricFamily(name, doc, labels=labels)
    if kind == _GAUGE:
        return GaugeMetricFamily(name, doc, labels=labels)
    return HistogramMetricFamily(name, doc, labels=labels)


class _Families:
    """The families of one scrape, each made when its first sample arrives, in ``_SPECS`` order."""

    def __init__(self) -> None:
        self._families: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = _new_family(name)
        return family

    def in_order(self) -> list[Metric]:
        return [self._families[name] for name in _SPECS if name in self._families]


def _stats_owner(thing: object) -> object:
    """The object whose ``stats()`` describes ``thing``'s admission queue.

    ``thing`` itself when it has ``stats()`` (a queue, a middleware, a pool,
    a werkzeug/wsgiref embedding); waitress's server keeps it on its task
    dispatcher, cheroot's on ``server.requests``.
    """
    for owner in (thing, getattr(thing, "task_dispatcher", None), getattr(thing, "requests", None)):
        if owner is not None and callable(getattr(owner, "stats", None)):
            return owner
    raise TypeError(f"{type(thing).__name__} has no stats() to export (nor a task_dispatcher or requests with one)")


def _weak(thing: object) -> weakref.ReferenceType[Any]:
    try:
        return weakref.ref(thing)
    except TypeError:
        raise TypeError(f"{type(thing).__name__} cannot be weakly referenced, so it cannot be registered") from None


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, not {name!r}")
    return name


def _histogram_buckets(histogram: Any) -> tuple[list[tuple[str, float]], float]:
    """A core ``LatencyHistogram`` as Prometheus buckets (cumulative, ``+Inf`` last) and its sum in seconds."""
    cumulative = histogram.count_le(_BOUNDS_NS)
    # Read after the buckets: a record landing in between makes the total
    # larger, never smaller than a bucket, so the buckets stay monotone.
    count = max(histogram.count, cumulative[-1])
    buckets: list[tuple[str, float]] = list(zip(_LE_LABELS, cumulative))
    buckets.append(("+Inf", count))
    return buckets, histogram.sum_ns / NS_PER_SECOND


def _stats_or_none(name: str, thing: Any) -> Mapping[str, Any] | None:
    try:
        stats: Mapping[str, Any] = thing.stats()
    except Exception:  # noqa: BLE001 - one broken object must not fail the whole scrape
        _log.exception("prazo metrics: cannot read the stats of %r", name)
        return None
    return stats


def _add_queue(families: _Families, name: str, stats: Mapping[str, Any], owner: object) -> None:
    labels = [name]
    for family, key in _QUEUE_KEYS.items():
        families[family].add_metric(labels, stats[key])
    for reason, key in _REFUSAL_KEYS.items():
        families["prazo_queue_refused"].add_metric([name, reason], stats[key])
    for reason, key in _POLICY_REFUSAL_KEYS.items():
        if key in stats:
            families["prazo_queue_refused"].add_metric([name, reason], stats[key])
    if "limit" in stats:
        families["prazo_queue_limit"].add_metric(labels, stats["limit"])
    if "expected_service_ns" in stats:
        families["prazo_queue_expected_service_seconds"].add_metric(labels, stats["expected_service_ns"] / NS_PER_SECOND)
    families["prazo_queue_wait_seconds"].add_metric(labels, stats["queue_wait_ns_total"] / NS_PER_SECOND)
    families["prazo_queue_saturation"].add_metric(labels, stats["in_flight"] / stats["max_concurrency"])
    for family, key in _OPTIONAL_KEYS.items():
        if key in stats:
            families[family].add_metric(labels, stats[key])
    if all(key in stats for key in _RESPONSE_KEYS.values()):
        for code, key in _RESPONSE_KEYS.items():
            families["prazo_wsgi_refusals"].add_metric([name, code], stats[key])
    for family, attribute in _HISTOGRAM_ATTRIBUTES.items():
        histogram = getattr(owner, attribute, None)
        if histogram is not None:
            families[family].add_metric(labels, *_histogram_buckets(histogram))


def _add_dependency(families: _Families, name: str, stats: Mapping[str, Any], histogram: Any) -> None:
    labels = [name]
    outcomes = stats["outcomes"]
    for outcome in _DEPENDENCY_OUTCOMES:
        families["prazo_dependency_calls"].add_metric([name, outcome], outcomes.get(outcome, 0))
    for family, key in _DEPENDENCY_KEYS.items():
        families[family].add_metric(labels, stats[key])
    for state in _BREAKER_STATES:
        families["prazo_dependency_breaker_state"].add_metric([name, state], float(stats["breaker_state"] == state))
    families["prazo_dependency_timeout_seconds"].add_metric(labels, stats["timeout_ms"] / 1000)
    for quantile, key in _QUANTILE_KEYS.items():
        value = stats[key]
        seconds = float("nan") if value is None else value / 1000
        families["prazo_dependency_latency_seconds"].add_metric([name, quantile], seconds)
    families["prazo_dependency_call_duration_seconds"].add_metric(labels, *_histogram_buckets(histogram))


class PrazoCollector:
    """A ``prometheus_client`` collector for prazo's queues, middleware, pools, servers and dependencies.

    Effects: ``add_*`` registers an object under a name (a weak reference:
    registering never keeps it alive); each ``collect()`` — each scrape —
    reads every live object's ``stats()`` and histograms and yields the
    metric families. An object that was garbage-collected is dropped and
    its series disappear from the output. Thread-safe: objects may be added
    while another thread scrapes, and a scrape never blocks the objects'
    hot paths beyond their own ``stats()`` snapshot.

    Names are label values, so any string works (``prometheus_client``
    escapes it). A name already registered to another live object raises
    ``ValueError``; registering the same object under the same name again
    does nothing; a name whose object died can be reused.

    >>> from prometheus_client import CollectorRegistry, generate_latest
    >>> from prazo.core import AdmissionQueue
    >>> q = AdmissionQueue(4, 16)
    >>> registry = CollectorRegistry()
    >>> collector = PrazoCollector(registry)
    >>> collector.add_queue("jobs", q)
    >>> b'prazo_queue_max_concurrency{queue="jobs"} 4.0' in generate_latest(registry)
    True
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, weakref.ReferenceType[Any]] = {}
        self._dependencies: dict[str, weakref.ReferenceType[Any]] = {}
        if registry is not None:
            registry.register(self)

    # -- registration ------------------------------------------------------------

    def _add(self, table: dict[str, weakref.ReferenceType[Any]], name: str, thing: object) -> None:
        ref = _weak(thing)
        with self._lock:
            current = table.get(name)
            if current is not None:
                other = current()
                if other is thing:
                    return
                if other is not None:
                    raise ValueError(f"{name!r} is already registered to {other!r}")
            table[name] = ref

    def _add_admission(self, name: str, owner: Any) -> None:
        missing = _REQUIRED_QUEUE_KEYS.difference(owner.stats())
        if missing:
            raise TypeError(f"{type(owner).__name__}.stats() lacks the admission queue's {sorted(missing)}")
        self._add(self._queues, _check_name(name), owner)

    def add_queue(self, name: str, queue: Any) -> None:
        """Export an ``AdmissionQueue`` (either twin) as ``queue=name``."""
        self._add_admission(name, _stats_owner(queue))

    def add_middleware(self, name: str, middleware: Any) -> None:
        """Export an ``AdmissionMiddleware``: its queue's counters, its own, and its opt-in histograms."""
        self._add_admission(name, _stats_owner(middleware))

    def add_pool(self, name: str, pool: Any) -> None:
        """Export an ``AdmissionPool``: its queue's counters, its own, and its opt-in histograms."""
        self._add_admission(name, _stats_owner(pool))

    def add_server(self, name: str, server: Any) -> None:
        """Export a server embedding's admission queue and refusals.

        ``server`` is what the embedding's factory returned: waitress's server
        (read through its ``task_dispatcher``), cheroot's (through
        ``server.requests``), werkzeug's, wsgiref's or the front door's. gunicorn's workers are
        other processes, which this collector cannot read.
        """
        self._add_admission(name, _stats_owner(server))

    def add_dependency(self, dependency: Dependency, name: str | None = None) -> None:
        """Export a ``prazo.bindings.dependency.Dependency`` as ``dependency=dependency.name`` (or ``name``)."""
        if not isinstance(dependency, Dependency):
            raise TypeError(
                f"dependency must be a prazo.bindings.dependency.Dependency, not {type(dependency).__name__}"
            )
        self._add(self._dependencies, _check_name(dependency.name if name is None else name), dependency)

    def remove(self, name: str) -> None:
        """Stop exporting what is registered as ``name`` (an admission point, a dependency, or both); KeyError if none."""
        with self._lock:
            found = [table.pop(name) for table in (self._queues, self._dependencies) if name in table]
        if not found:
            raise KeyError(name)

    def names(self) -> dict[str, list[str]]:
        """The live registrations: ``{"queue": [...], "dependency": [...]}``."""
        return {
            "queue": [name for name, _ in self._live(self._queues)],
            "dependency": [name for name, _ in self._live(self._dependencies)],
        }

    def _live(self, table: dict[str, weakref.ReferenceType[Any]]) -> list[tuple[str, Any]]:
        """The live entries of ``table``, dropping the dead ones."""
        live: list[tuple[str, Any]] = []
        with self._lock:
            for name, ref in list(table.items()):
                thing = ref()
                if thing is None:
                    del table[name]
                else:
                    live.append((name, thing))
        return live

    # -- the Collector protocol --------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        """Every family this collector may yield, without samples (the registry checks names with it)."""
        return [_new_family(name) for name in _SPECS]

    def collect(self) -> Iterable[Metric]:
        """The families for one scrape; an object whose ``stats()`` raises is left out (and logged)."""
        families = _Families()
        # stats() runs outside our lock: it takes the object's own.
        for name, thing in self._live(self._queues):
            stats = _stats_or_none(name, thing)
            if stats is not None:
                _add_queue(families, name, stats, thing)
        for name, dependency in self._live(self._dependencies):
            stats = _stats_or_none(name, dependency)
            if stats is not None:
                _add_dependency(families, name, stats, dependency.histogram.total)
        return families.in_order()

    def __repr__(self) -> str:
        names = self.names()
        return f"<{type(self).__name__} queues={names['queue']} dependencies={names['dependency']}>"


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, PrazoCollector] = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()


def collector_for(registry: CollectorRegistry | None = None) -> PrazoCollector:
    """The one ``PrazoCollector`` registered in ``registry`` (default ``REGISTRY``), created on first use."""
    registry = REGISTRY if registry is None else registry
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = PrazoCollector(registry)
        return collector


def register(*dependencies: Dependency, registry: CollectorRegistry | None = None, **named: Any) -> PrazoCollector:
    """Export ``dependencies`` (each names itself) and every ``name=thing``; return the collector.

    ``thing`` may be an ``AdmissionMiddleware``, an ``AdmissionPool``, an
    ``AdmissionQueue`` or a server embedding's server. Everything goes into
    the one collector of ``registry`` (default ``prometheus_client.REGISTRY``),
    so calling ``register`` again adds to it. Names that are not Python
    identifiers go through ``collector.add_queue(name, thing)`` and friends.

    >>> from prometheus_client import CollectorRegistry
    >>> from prazo.core import AdmissionQueue
    >>> q = AdmissionQueue(2, 8)
    >>> register(jobs=q, registry=CollectorRegistry()).names()
    {'queue': ['jobs'], 'dependency': []}
    """
    collector = collector_for(registry)
    for dependency in dependencies:
        collector.add_dependency(dependency)
    for name, thing in named.items():
        collector.add_server(name, thing)
    return collector


def metrics_app(registry: CollectorRegistry | None = None) -> WSGIApp:
    """A WSGI app answering every GET with the exposition of ``registry`` (default ``REGISTRY``).

    ``prometheus_client.make_wsgi_app``: it negotiates the text or
    OpenMetrics format and gzip, and honours ``?name[]=`` filters.
    """
    app: WSGIApp = make_wsgi_app(REGISTRY if registry is None else registry)
    return app


class MetricsMount:
    """A path dispatcher: ``path`` goes to the metrics app, everything else to ``app``.

    Put it *outside* the admission middleware, so a scrape never waits for
    (or is refused by) the admission queue it is measuring::

        app = MetricsMount(AdmissionMiddleware(service, max_concurrency=8, max_queue=32))

    ``PATH_INFO`` must equal ``path`` exactly. With a server embedding the
    admission happens in the server, before any app runs: serve metrics on a
    port of their own there (``prometheus_client.start_http_server``).
    """

    def __init__(self, app: WSGIApp, path: str = "/metrics", registry: CollectorRegistry | None = None) -> None:
        if not callable(app):
            raise TypeError(f"app must be a WSGI callable, not {type(app).__name__}")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"path must be a str starting with '/', got {path!r}")
        self.app = app
        self.path = path
        self.metrics = metrics_app(registry)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") == self.path:
            return self.metrics(environ, start_response)
        return self.app(environ, start_response)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path} beside {self.app!r}>"


def mount_metrics(app: WSGIApp, path: str = "/metrics", registry: CollectorRegistry | None = None) -> MetricsMount:
    """``MetricsMount(app, path, registry)``: serve ``path`` with the metrics, the rest with ``app``."""
    return MetricsMount(app, path, registry)
