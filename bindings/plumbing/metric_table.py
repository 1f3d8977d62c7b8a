"""What prazo's metrics are and how each is read from ``stats()``, for any exporter.

One table, two exporters: ``prazo.bindings.integrations.prometheus`` (Prometheus, through
``prometheus_client``) and ``prazo.bindings.integrations.opentelemetry`` (OTel observable
instruments) both read it, so a metric is named, described and computed in
one place. Nothing here imports an exporter's library.

``SPECS`` maps each family name (Prometheus style: counters without
``_total``) to ``(kind, label names, description)``. ``queue_samples`` and
``dependency_samples`` turn one ``stats()`` snapshot into
``(family, label values, value)`` triples for every counter and gauge; the
latency histograms, which need buckets, are read by each exporter from
``HISTOGRAM_ATTRIBUTES`` / a dependency's ``histogram``. ``MetricSources``
is the registry of named objects both exporters read at collection time:
weak references, so registering never keeps an object alive.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from prazo.bindings.dependency import Dependency
from prazo.bindings.retries import RetryPolicy
from prazo.core import NS_PER_SECOND

__all__ = [
    "COUNTER",
    "GAUGE",
    "HISTOGRAM",
    "HISTOGRAM_ATTRIBUTES",
    "METRIC_NAMES",
    "SPECS",
    "MetricSources",
    "MetricSpec",
    "Sample",
    "dependency_samples",
    "queue_samples",
    "retry_samples",
    "stats_or_none",
    "stats_owner",
]

_log = logging.getLogger("prazo.bindings.integrations.prometheus")

#: ``(kind, label names, description)`` of one metric family.
MetricSpec = tuple[str, tuple[str, ...], str]
#: ``(family, label values in the order of its spec, value)``.
Sample = tuple[str, tuple[str, ...], float]

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
_Q = ("queue",)
_D = ("dependency",)
_P = ("policy",)

# The retry counters of a RetryPolicy's and a Dependency's stats(), and what each counts.
_RETRY_HELP = {
    "retries": "Retries started.",
    "retries_refused_by_budget": "Retries the retry budget refused.",
    "retries_refused_by_deadline": "Retries refused because the deadline (or a longer Retry-After) left no room.",
    "retry_after_honoured": "Retries that waited the Retry-After the server asked for.",
    "throttled_locally": "Attempts the adaptive throttle refused before sending (the destination was refusing).",
}

# Every family: name (counters without _total) -> (type, labels, help).
SPECS: dict[str, MetricSpec] = {
    # Every admission point: a queue, a middleware, a pool, a server embedding.
    "prazo_queue_offered": (COUNTER, _Q, "Arrivals offered to the admission queue."),
    "prazo_queue_started": (COUNTER, _Q, "Items that got a slot and started."),
    "prazo_queue_completed": (COUNTER, _Q, "Items that finished and gave their slot back."),
    "prazo_queue_cancelled": (COUNTER, _Q, "Items that left the line without an outcome (cancelled, interrupted)."),
    "prazo_queue_refused": (COUNTER, (*_Q, "reason"), "Arrivals refused by the queue, by X-Prazo-Reason."),
    "prazo_queue_wait_seconds": (COUNTER, _Q, "Time waited for a slot by every item that got one, summed."),
    "prazo_queue_in_flight": (GAUGE, _Q, "Items holding a slot now."),
    "prazo_queue_assigned": (GAUGE, _Q, "Items handed a slot but not yet running."),
    "prazo_queue_queued": (GAUGE, _Q, "Items waiting for a slot now."),
    "prazo_queue_peak_in_flight": (GAUGE, _Q, "Most items ever holding a slot at once."),
    "prazo_queue_peak_queued": (GAUGE, _Q, "Most items ever waiting at once."),
    "prazo_queue_max_concurrency": (GAUGE, _Q, "Slots: items that may run at once."),
    "prazo_queue_max_queue": (GAUGE, _Q, "Places in the waiting line."),
    "prazo_queue_saturation": (GAUGE, _Q, "in_flight / max_concurrency: at 1 every further arrival waits."),
    "prazo_queue_observe_only": (
        GAUGE,
        _Q,
        "1 while the admission point only observes: every request runs, and its refusals are what it would have refused.",
    ),
    "prazo_queue_limit": (
        GAUGE,
        _Q,
        "The concurrency limit in force (moves with limit='vegas'; else max_concurrency).",
    ),
    "prazo_queue_expected_service_seconds": (
        GAUGE,
        _Q,
        "Expected service time of the doomed-work skip (0: off, or not learned yet).",
    ),
    # A middleware or a server embedding.
    "prazo_wsgi_invalid_budget_headers": (COUNTER, _Q, "Budget headers that did not parse (ignored)."),
    "prazo_wsgi_bypassed": (COUNTER, _Q, "Requests on a bypass path (never queued)."),
    "prazo_wsgi_app_deadline_exceeded": (COUNTER, _Q, "Requests whose app raised DeadlineExceeded."),
    "prazo_wsgi_app_downstream_overloaded": (COUNTER, _Q, "Requests whose app raised DownstreamOverloaded."),
    "prazo_wsgi_expiry_refusals_capped": (
        COUNTER,
        _Q,
        "Requests whose budget arrived spent, run on the default budget because the cap on such refusals was reached.",
    ),
    "prazo_wsgi_refusals": (COUNTER, (*_Q, "code"), "Refusals answered by prazo (queue or app), by status code."),
    # An AdmissionPool.
    "prazo_pool_workers": (GAUGE, _Q, "Worker threads started."),
    "prazo_pool_futures_cancelled": (COUNTER, _Q, "Futures cancelled before they ran."),
    "prazo_pool_fn_raised": (COUNTER, _Q, "Tasks whose function raised."),
    # A socket-level server embedding (werkzeug, wsgiref, cheroot).
    "prazo_server_header_timeouts": (COUNTER, _Q, "Request heads not complete in time (answered 408)."),
    "prazo_server_pending_heads": (GAUGE, _Q, "Connections whose request head is still arriving."),
    "prazo_server_lingering_connections": (GAUGE, _Q, "Refused connections being drained before they close."),
    # A front-door host (prazo serve --server prazo --workers N): its triage's stats().
    "prazo_host_worker_processes": (GAUGE, _Q, "Worker processes of the host with a live channel to its triage."),
    "prazo_host_worker_lost": (
        COUNTER,
        _Q,
        "Requests lost with the worker process running them (it died, or had no free descriptor to take one; "
        "their connections were closed).",
    ),
    "prazo_host_worker_in_flight": (GAUGE, (*_Q, "worker"), "Requests running in each worker process now."),
    # Opt-in (record_latency=True) on a middleware or a pool.
    "prazo_request_duration_seconds": (
        HISTOGRAM,
        _Q,
        "Admitted requests (pool: tasks) from arrival to the release of their slot, queue wait included.",
    ),
    "prazo_request_queue_wait_seconds": (HISTOGRAM, _Q, "Time admitted requests (pool: tasks) waited for a slot."),
    # A Dependency.
    "prazo_dependency_calls": (COUNTER, (*_D, "outcome"), "Calls by outcome."),
    "prazo_dependency_rejected": (COUNTER, _D, "Calls rejected without running (bulkhead full, breaker open)."),
    "prazo_dependency_stale_served": (COUNTER, _D, "Calls answered with a last-known-good value."),
    "prazo_dependency_unavailable": (COUNTER, _D, "Calls answered DependencyUnavailable (503)."),
    "prazo_dependency_hedges_sent": (COUNTER, _D, "Hedged second attempts started."),
    "prazo_dependency_hedges_won": (COUNTER, _D, "Hedged attempts that answered first."),
    "prazo_dependency_late_results": (COUNTER, _D, "Attempts that returned after their caller stopped waiting."),
    "prazo_dependency_in_flight": (
        GAUGE,
        _D,
        "Calls holding a bulkhead place now (timed-out ones until they return).",
    ),
    "prazo_dependency_max_concurrent": (GAUGE, _D, "Bulkhead size."),
    "prazo_dependency_saturation": (GAUGE, _D, "in_flight / max_concurrent: at 1 every further call is rejected."),
    "prazo_dependency_observe_only": (
        GAUGE,
        _D,
        "1 while the bulkhead only observes: every call runs, and bulkhead_full is what it would have refused.",
    ),
    "prazo_dependency_threads": (GAUGE, _D, "Threads the dependency runs calls on."),
    "prazo_dependency_lkg_entries": (GAUGE, _D, "Last-known-good values kept."),
    "prazo_dependency_timeout_seconds": (GAUGE, _D, "The timeout a call starting now gets (adaptive ones move)."),
    "prazo_dependency_breaker_state": (GAUGE, (*_D, "state"), "1 for the breaker's current state, 0 for the others."),
    "prazo_dependency_latency_seconds": (
        GAUGE,
        (*_D, "quantile"),
        "Live call latency quantiles over the dependency's recent window (NaN before any call).",
    ),
    "prazo_dependency_call_duration_seconds": (HISTOGRAM, _D, "Durations of the calls that returned, since start."),
    # A RetryPolicy (the client adapters, the gRPC client interceptor): calls, and the
    # retry counters below, which a Dependency(retry=...) keeps for itself too.
    "prazo_retry_calls": (COUNTER, _P, "Calls made under the retry policy (one deposit each into their budget)."),
    **{f"prazo_retry_{counter}": (COUNTER, _P, text) for counter, text in _RETRY_HELP.items()},
    **{f"prazo_dependency_{counter}": (COUNTER, _D, text) for counter, text in _RETRY_HELP.items()},
}

#: Every metric family the collector can export: counters without their
#: ``_total`` suffix, histograms without ``_bucket``/``_sum``/``_count``.
METRIC_NAMES: tuple[str, ...] = tuple(SPECS)

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
    "prazo_wsgi_expiry_refusals_capped": "expiry_refusals_capped",
    "prazo_pool_workers": "workers",
    "prazo_pool_futures_cancelled": "futures_cancelled",
    "prazo_pool_fn_raised": "fn_raised",
    "prazo_server_header_timeouts": "header_timeouts",
    "prazo_server_pending_heads": "pending_heads",
    "prazo_server_lingering_connections": "lingering",
    "prazo_host_worker_processes": "worker_processes",
    "prazo_host_worker_lost": "worker_lost",
    "prazo_queue_observe_only": "observe_only",
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
HISTOGRAM_ATTRIBUTES = {
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
    **{f"prazo_dependency_{counter}": counter for counter in _RETRY_HELP},
}
_RETRY_KEYS = {"prazo_retry_calls": "calls", **{f"prazo_retry_{counter}": counter for counter in _RETRY_HELP}}
_DEPENDENCY_OUTCOMES = ("ok", "error", "timeout", "bulkhead_full", "breaker_open", "no_budget")
_BREAKER_STATES = ("closed", "open", "half-open", "disabled")
_QUANTILE_KEYS = {"0.5": "p50_ms", "0.95": "p95_ms", "0.99": "p99_ms"}


def queue_samples(name: str, stats: Mapping[str, Any]) -> Iterator[Sample]:
    """Every counter and gauge sample of the admission point registered as ``name``, from one ``stats()``."""
    labels = (name,)
    for family, key in _QUEUE_KEYS.items():
        yield family, labels, stats[key]
    for reason, key in _REFUSAL_KEYS.items():
        yield "prazo_queue_refused", (name, reason), stats[key]
    for reason, key in _POLICY_REFUSAL_KEYS.items():
        if key in stats:
            yield "prazo_queue_refused", (name, reason), stats[key]
    if "limit" in stats:
        yield "prazo_queue_limit", labels, stats["limit"]
    if "expected_service_ns" in stats:
        yield "prazo_queue_expected_service_seconds", labels, stats["expected_service_ns"] / NS_PER_SECOND
    yield "prazo_queue_wait_seconds", labels, stats["queue_wait_ns_total"] / NS_PER_SECOND
    yield "prazo_queue_saturation", labels, stats["in_flight"] / stats["max_concurrency"]
    for family, key in _OPTIONAL_KEYS.items():
        if key in stats:
            yield family, labels, stats[key]
    for worker, running in stats.get("worker_in_flight", {}).items():
        yield "prazo_host_worker_in_flight", (name, str(worker)), running
    if all(key in stats for key in _RESPONSE_KEYS.values()):
        for code, key in _RESPONSE_KEYS.items():
            yield "prazo_wsgi_refusals", (name, code), stats[key]


def dependency_samples(name: str, stats: Mapping[str, Any]) -> Iterator[Sample]:
    """Every counter and gauge sample of the dependency registered as ``name``, from one ``stats()``."""
    labels = (name,)
    outcomes = stats["outcomes"]
    for outcome in _DEPENDENCY_OUTCOMES:
        yield "prazo_dependency_calls", (name, outcome), outcomes.get(outcome, 0)
    for family, key in _DEPENDENCY_KEYS.items():
        yield family, labels, stats[key]
    for state in _BREAKER_STATES:
        yield "prazo_dependency_breaker_state", (name, state), float(stats["breaker_state"] == state)
    yield "prazo_dependency_timeout_seconds", labels, stats["timeout_ms"] / 1000
    for quantile, key in _QUANTILE_KEYS.items():
        value = stats[key]
        yield "prazo_dependency_latency_seconds", (name, quantile), float("nan") if value is None else value / 1000
    if "observe_only" in stats:
        yield "prazo_dependency_observe_only", labels, stats["observe_only"]


def retry_samples(name: str, stats: Mapping[str, Any]) -> Iterator[Sample]:
    """Every counter sample of the retry policy registered as ``name``, from one ``stats()``."""
    for family, key in _RETRY_KEYS.items():
        yield family, (name,), stats[key]


def stats_owner(thing: object) -> object:
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


def stats_or_none(name: str, thing: Any) -> Mapping[str, Any] | None:
    """``thing.stats()``, or None (logged) when it raises: one broken object must not fail a whole collection."""
    try:
        stats: Mapping[str, Any] = thing.stats()
    except Exception:  # noqa: BLE001 - see the docstring
        _log.exception("prazo metrics: cannot read the stats of %r", name)
        return None
    return stats


class MetricSources:
    """The named admission points and dependencies an exporter reads at each collection.

    Effects: ``add_*`` registers an object under a name (a weak reference:
    registering never keeps it alive); ``admission_points()`` /
    ``dependencies()`` return the live ones, dropping those that were
    garbage-collected. Thread-safe: objects may be added while another thread
    collects.

    A name already registered to another live object raises ``ValueError``;
    registering the same object under the same name again does nothing; a
    name whose object died can be reused.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, weakref.ReferenceType[Any]] = {}
        self._dependencies: dict[str, weakref.ReferenceType[Any]] = {}
        self._retry_policies: dict[str, weakref.ReferenceType[Any]] = {}

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
        self._add_admission(name, stats_owner(queue))

    def add_middleware(self, name: str, middleware: Any) -> None:
        """Export an ``AdmissionMiddleware``: its queue's counters, its own, and its opt-in histograms."""
        self._add_admission(name, stats_owner(middleware))

    def add_pool(self, name: str, pool: Any) -> None:
        """Export an ``AdmissionPool``: its queue's counters, its own, and its opt-in histograms."""
        self._add_admission(name, stats_owner(pool))

    def add_server(self, name: str, server: Any) -> None:
        """Export a server embedding's admission queue and refusals.

        ``server`` is what the embedding's factory returned: waitress's server
        (read through its ``task_dispatcher``), cheroot's (through
        ``server.requests``), werkzeug's, wsgiref's or the front door's. gunicorn's workers are
        other processes, which this process cannot read.
        """
        self._add_admission(name, stats_owner(server))

    def add_dependency(self, dependency: Dependency, name: str | None = None) -> None:
        """Export a ``prazo.bindings.dependency.Dependency`` as ``dependency=dependency.name`` (or ``name``)."""
        if not isinstance(dependency, Dependency):
            raise TypeError(
                f"dependency must be a prazo.bindings.dependency.Dependency, not {type(dependency).__name__}"
            )
        self._add(self._dependencies, _check_name(dependency.name if name is None else name), dependency)

    def add_retry_policy(self, name: str, policy: RetryPolicy) -> None:
        """Export a ``prazo.bindings.retries.RetryPolicy``'s counters as ``policy=name``."""
        if not isinstance(policy, RetryPolicy):
            raise TypeError(f"policy must be a prazo.bindings.retries.RetryPolicy, not {type(policy).__name__}")
        self._add(self._retry_policies, _check_name(name), policy)

    def add(self, *dependencies: Dependency, **named: Any) -> None:
        """Register ``dependencies`` (each names itself) and every ``name=thing`` (an admission point)."""
        for dependency in dependencies:
            self.add_dependency(dependency)
        for name, thing in named.items():
            self.add_server(name, thing)

    def remove(self, name: str) -> None:
        """Stop exporting what is registered as ``name`` (an admission point, a dependency, or both); KeyError if none."""
        with self._lock:
            tables = (self._queues, self._dependencies, self._retry_policies)
            found = [table.pop(name) for table in tables if name in table]
        if not found:
            raise KeyError(name)

    def names(self) -> dict[str, list[str]]:
        """The live registrations: ``{"queue": [...], "dependency": [...]}``."""
        return {
            "queue": [name for name, _ in self.admission_points()],
            "dependency": [name for name, _ in self.dependencies()],
        }

    def admission_points(self) -> list[tuple[str, Any]]:
        """The live admission points as ``(name, object with stats())``."""
        return self._live(self._queues)

    def dependencies(self) -> list[tuple[str, Any]]:
        """The live dependencies as ``(name, Dependency)``."""
        return self._live(self._dependencies)

    def retry_policies(self) -> list[tuple[str, Any]]:
        """The live retry policies as ``(name, RetryPolicy)``."""
        return self._live(self._retry_policies)

    def _live(self, table: dict[str, weakref.ReferenceType[Any]]) -> list[tuple[str, Any]]:
        live: list[tuple[str, Any]] = []
        with self._lock:
            for name, ref in list(table.items()):
                thing = ref()
                if thing is None:
                    del table[name]
                else:
                    live.append((name, thing))
        return live

    def samples(self) -> Iterator[Sample]:
        """Every counter and gauge sample of every live registration, one ``stats()`` per object.

        ``stats()`` runs outside this registry's lock: it takes the object's own.
        """
        for name, thing in self.admission_points():
            stats = stats_or_none(name, thing)
            if stats is not None:
                yield from queue_samples(name, stats)
        for name, dependency in self.dependencies():
            stats = stats_or_none(name, dependency)
            if stats is not None:
                yield from dependency_samples(name, stats)
        for name, policy in self.retry_policies():
            stats = stats_or_none(name, policy)
            if stats is not None:
                yield from retry_samples(name, stats)
