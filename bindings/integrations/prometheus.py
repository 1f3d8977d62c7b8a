"""Prometheus metrics for prazo: a collector, a ``/metrics`` WSGI app, and how to mount it.

Needs ``prometheus_client`` (``pip install 'prazo[metrics]'``); nothing else
in prazo imports this module, and the core never imports ``prometheus_client``.

Register what the service has, once, at start-up::

    from prazo.bindings.integrations import prometheus

    collector = prometheus.register(api=middleware, thumbnails=pool)   # into prometheus_client's REGISTRY
    collector.add_dependency(recommendations)                        # a Dependency names itself
    app = prometheus.mount_metrics(middleware)                          # /metrics beside, not behind, admission

``PrazoCollector`` is a ``prometheus_client`` custom collector: every scrape
reads each registered object's ``stats()`` (one consistent snapshot per object,
copied under its lock) and its latency histograms, and yields metric families;
``prometheus_client`` writes the exposition format. Registration holds only a
weak reference, so a registered object that is garbage-collected leaves the
output at the next scrape instead of being kept alive by its metrics.

Every admission point — an ``AdmissionQueue`` of either twin, an
``AdmissionMiddleware``, an ``AdmissionPool``, a server embedding — is labelled
``queue="<name>"``; a ``Dependency`` is labelled ``dependency="<its name>"``.
The metric names are listed in ``METRIC_NAMES`` and in docs/how-to/metrics.md.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"prazo.bindings.integrations.prometheus needs prometheus_client ({exc}): pip install 'prazo[metrics]'"
    ) from exc

from prazo.bindings.dependency import Dependency
from prazo.bindings.plumbing.metric_table import (
    COUNTER,
    GAUGE,
    HISTOGRAM_ATTRIBUTES,
    METRIC_NAMES,
    SPECS,
    MetricSources,
    dependency_samples,
    queue_samples,
    retry_samples,
    stats_or_none,
)
from prazo.bindings.wsgi import Environ, StartResponse, WSGIApp
from prazo.core import NS_PER_SECOND

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

#: Upper bounds (seconds) of every latency histogram's buckets, from 1 ms to
#: 10 s; ``+Inf`` is added. Fixed, so ``histogram_quantile`` and alerts can
#: aggregate across instances.
BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BOUNDS_NS = tuple(round(bound * NS_PER_SECOND) for bound in BUCKETS_S)
# prometheus_client leaves floatToGoString unannotated; it returns the text of a bucket bound.
_LE_LABELS = tuple(str(floatToGoString(bound)) for bound in BUCKETS_S)  # type: ignore[no-untyped-call]


def _new_family(name: str) -> Metric:
    kind, labels, doc = SPECS[name]
    if kind == COUNTER:
        return CounterMetricFamily(name, doc, labels=labels)
    if kind == GAUGE:
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
        return [self._families[name] for name in SPECS if name in self._families]


def _histogram_buckets(histogram: Any) -> tuple[list[tuple[str, float]], float]:
    """A core ``LatencyHistogram`` as Prometheus buckets (cumulative, ``+Inf`` last) and its sum in seconds."""
    cumulative = histogram.count_le(_BOUNDS_NS)
    # Read after the buckets: a record landing in between makes the total
    # larger, never smaller than a bucket, so the buckets stay monotone.
    count = max(histogram.count, cumulative[-1])
    buckets: list[tuple[str, float]] = list(zip(_LE_LABELS, cumulative))
    buckets.append(("+Inf", count))
    return buckets, histogram.sum_ns / NS_PER_SECOND


def _add_histograms(families: _Families, name: str, owner: object) -> None:
    for family, attribute in HISTOGRAM_ATTRIBUTES.items():
        histogram = getattr(owner, attribute, None)
        if histogram is not None:
            families[family].add_metric([name], *_histogram_buckets(histogram))


class PrazoCollector(MetricSources):
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
        super().__init__()
        if registry is not None:
            registry.register(self)

    # -- the Collector protocol --------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        """Every family this collector may yield, without samples (the registry checks names with it)."""
        return [_new_family(name) for name in SPECS]

    def collect(self) -> Iterable[Metric]:
        """The families for one scrape; an object whose ``stats()`` raises is left out (and logged)."""
        families = _Families()
        for name, thing in self.admission_points():
            stats = stats_or_none(name, thing)
            if stats is not None:
                for family, labels, value in queue_samples(name, stats):
                    families[family].add_metric(labels, value)
                _add_histograms(families, name, thing)
        for name, dependency in self.dependencies():
            stats = stats_or_none(name, dependency)
            if stats is not None:
                for family, labels, value in dependency_samples(name, stats):
                    families[family].add_metric(labels, value)
                families["prazo_dependency_call_duration_seconds"].add_metric(
                    [name], *_histogram_buckets(dependency.histogram.total)
                )
        for name, policy in self.retry_policies():
            stats = stats_or_none(name, policy)
            if stats is not None:
                for family, labels, value in retry_samples(name, stats):
                    families[family].add_metric(labels, value)
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
    collector.add(*dependencies, **named)
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
