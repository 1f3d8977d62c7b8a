"""OpenTelemetry for prazo: admission decisions on the current span, prazo's metrics as OTel instruments.

Needs ``opentelemetry-api`` (``pip install 'prazo[otel]'``); an SDK (or any
other API implementation) decides where spans and metrics go. Nothing else in
prazo imports this module, so a service without OpenTelemetry never loads it.

Turn it on once, at start-up, next to the rest of the service's OTel set-up::

    from prazo.bindings.integrations import opentelemetry as prazo_otel

    prazo_otel.instrument()                                       # spans: every admission point
    prazo_otel.register_metrics(api=middleware, jobs=pool)        # metrics: read at collection time

Spans. ``instrument()`` installs an admission observer
(``prazo.bindings.wsgi.set_admission_observer``): every decision of an
``AdmissionMiddleware`` (compiled and Python paths), of ``run_admitted`` (the
server embeddings and the front door's admitted requests) and of the server
dispatcher's refusals is written on the span current in the thread that
decided, when that span is recording:

==================================  =======  ==========================================================
attribute                           type     value
==================================  =======  ==========================================================
``prazo.admission.outcome``         string   ``admitted``, ``bypassed`` (a bypass path) or ``refused``
``prazo.admission.reason``          string   a refusal's ``X-Prazo-Reason`` (``queue-full``,
                                             ``expired-in-queue``, ...); refusals only
``prazo.admission.queue_wait``      double   seconds from arrival to the slot (refused: to the refusal)
``prazo.deadline.budget``           double   seconds from arrival to the deadline the request got
``prazo.deadline.budget_source``    string   the header that set the budget, or ``default`` (left out
                                             when the server refused before parsing the request)
==================================  =======  ==========================================================

A refusal also adds the event ``prazo.admission.refused`` with
``prazo.admission.reason``, ``http.response.status_code`` (503 or 504) and
``prazo.admission.queue_wait``. The span is the caller's: prazo never starts,
ends or sets the status of one (the HTTP instrumentation around it marks a
5xx as an error).

Where the span comes from. With ``opentelemetry-instrumentation-wsgi`` (or a
framework's) *around* the middleware, its server span is current when prazo
decides. When the instrumentation sits *inside* — a server embedding
(``prazo serve``) or the front door admits before any app runs — no span is
current yet: the observer leaves its record in the environ and
``request_hook(span, environ)``, given to that instrumentation as its request
hook, copies it onto the span it starts. Refusals made by a server before
the app runs have no span at all: the metrics count them, and
``instrument(refusal_spans=True)`` makes each one a short span of its own.
The front door's own refusals are made in C without the GIL and are not
observed (metrics again).

Why explicit: ``instrument()`` rather than "on whenever opentelemetry-api
is importable". The API is often installed as some other library's
dependency; turning on by import would make every prazo import load it and
every request pay ``get_current_span()`` for a service that never configured
OpenTelemetry. Explicit is also how OTel instrumentations work
(``FlaskInstrumentor().instrument()``). Not instrumented, the cost is one
``None`` check per request (measured in ``bench/test_bench_opentelemetry.py``).

Metrics. ``PrazoMetrics`` registers, on a ``Meter``, one observable
instrument per counter and gauge of ``prazo.bindings.plumbing.metric_table`` (the table
``prazo.bindings.integrations.prometheus`` exports to Prometheus): their callbacks read each
registered object's ``stats()`` when the SDK collects, so the request path
pays nothing. The latency histograms are not exported (the OTel API has no
observable histogram). Names: ``prazo_queue_offered`` becomes
``prazo.queue.offered``; a ``_seconds`` suffix becomes the unit ``s``
(``prazo_queue_wait_seconds`` is ``prazo.queue.wait``). Labels become
attributes: see ``ATTRIBUTE_FOR_LABEL``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

try:
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import propagate, trace
    from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"prazo.bindings.integrations.opentelemetry needs opentelemetry-api ({exc}): pip install 'prazo[otel]'"
    ) from exc

from prazo.bindings.dependency import Dependency
from prazo.bindings.plumbing.metric_table import COUNTER, GAUGE, METRIC_NAMES, SPECS, MetricSources
from prazo.bindings.wsgi import (
    BUDGET_SOURCE_KEY,
    OUTCOME_ADMITTED,
    QUEUE_WAIT_MS_KEY,
    AdmissionObserver,
    Environ,
    admission_observer,
    set_admission_observer,
    status_and_reason,
)
from prazo.core import NS_PER_SECOND

__all__ = [
    "ADMISSION_KEY",
    "ATTRIBUTE_FOR_LABEL",
    "BUDGET",
    "BUDGET_SOURCE",
    "EVENT_REFUSED",
    "HTTP_STATUS_CODE",
    "OUTCOME",
    "QUEUE_WAIT",
    "REASON",
    "REFUSAL_SPAN_NAME",
    "PrazoMetrics",
    "budget_source_of",
    "instrument",
    "instrument_name",
    "is_instrumented",
    "metric_attributes",
    "observe_admission",
    "record_admission",
    "register_metrics",
    "request_hook",
    "uninstrument",
]

_log = logging.getLogger(__name__)

OUTCOME = "prazo.admission.outcome"
REASON = "prazo.admission.reason"
QUEUE_WAIT = "prazo.admission.queue_wait"
BUDGET = "prazo.deadline.budget"
BUDGET_SOURCE = "prazo.deadline.budget_source"
EVENT_REFUSED = "prazo.admission.refused"
#: The name of the span ``instrument(refusal_spans=True)`` makes for a refusal no span saw.
REFUSAL_SPAN_NAME = "prazo refusal"
# The W3C trace-context headers a refusal span continues, as environ keys.
_TRACE_HEADERS = (("traceparent", "HTTP_TRACEPARENT"), ("tracestate", "HTTP_TRACESTATE"))
# The semantic conventions' own name, so backends group refusals with HTTP statuses.
HTTP_STATUS_CODE = "http.response.status_code"

#: environ key where the observer leaves an admission no recording span saw,
#: for ``request_hook``: ``(outcome, arrival_ns, deadline_ns, queue_wait_ns)``.
ADMISSION_KEY = "prazo.otel.admission"

#: The attribute each label of ``prazo.bindings.plumbing.metric_table`` becomes.
ATTRIBUTE_FOR_LABEL: dict[str, str] = {
    "queue": "prazo.queue.name",
    "dependency": "prazo.dependency.name",
    "reason": REASON,
    "code": HTTP_STATUS_CODE,
    "outcome": "prazo.dependency.outcome",
    "state": "prazo.breaker.state",
    "quantile": "prazo.quantile",
    "policy": "prazo.retry.policy",
}
# Label values that are numbers in the semantic conventions.
_INTEGER_LABELS = frozenset({"code"})

INSTRUMENTATION_SCOPE = "prazo"


def budget_source_of(environ: Mapping[str, Any]) -> str:
    """``prazo.deadline.budget_source`` of a parsed request: the header that set its budget, or ``default``."""
    source = environ.get(BUDGET_SOURCE_KEY)
    return source if isinstance(source, str) else "default"


def record_admission(
    span: trace.Span,
    outcome: str,
    arrival_ns: int | None,
    deadline_ns: int,
    queue_wait_ns: int,
    refusal: BaseException | None = None,
    budget_source: str | None = None,
) -> None:
    """Write one admission decision on ``span`` (the attributes and, for a refusal, the event).

    ``budget_source`` is ``budget_source_of(environ)``; None (the request
    was not parsed) leaves ``prazo.deadline.budget_source`` out, as
    ``arrival_ns`` None (unknown) leaves out ``prazo.deadline.budget``.
    """
    queue_wait_s = max(queue_wait_ns, 0) / NS_PER_SECOND
    attributes: dict[str, str | float] = {OUTCOME: outcome, QUEUE_WAIT: queue_wait_s}
    if budget_source is not None:
        attributes[BUDGET_SOURCE] = budget_source
    if arrival_ns is not None:
        attributes[BUDGET] = (deadline_ns - arrival_ns) / NS_PER_SECOND
    if refusal is not None:
        status, reason = status_and_reason(refusal)
        attributes[REASON] = reason
        span.add_event(EVENT_REFUSED, {REASON: reason, HTTP_STATUS_CODE: status, QUEUE_WAIT: queue_wait_s})
    span.set_attributes(attributes)


def observe_admission(
    environ: Environ | None,
    outcome: str,
    arrival_ns: int | None,
    deadline_ns: int,
    queue_wait_ns: int,
    refusal: BaseException | None,
) -> None:
    """The admission observer ``instrument()`` installs (``prazo.bindings.wsgi.AdmissionObserver``).

    Records on the current span when it is recording; otherwise leaves the
    decision of an admitted request in ``environ[ADMISSION_KEY]`` for
    ``request_hook``, and a refusal becomes a span of its own with
    ``instrument(refusal_spans=True)``. Never raises: tracing must not cost a
    request its answer.
    """
    try:
        span = trace.get_current_span()
        if span.is_recording():
            source = None if environ is None else budget_source_of(environ)
            record_admission(span, outcome, arrival_ns, deadline_ns, queue_wait_ns, refusal, source)
        elif refusal is None:
            if environ is not None:
                environ[ADMISSION_KEY] = (outcome, arrival_ns, deadline_ns, queue_wait_ns)
        elif _refusal_tracer is not None:
            _refusal_span(_refusal_tracer, environ, outcome, arrival_ns, deadline_ns, queue_wait_ns, refusal)
    except Exception:  # noqa: BLE001 - see the docstring
        _log.exception("prazo: recording the admission on the current span failed")


def _refusal_span(
    tracer: trace.Tracer,
    environ: Environ | None,
    outcome: str,
    arrival_ns: int | None,
    deadline_ns: int,
    queue_wait_ns: int,
    refusal: BaseException,
) -> None:
    """A server span for a refusal no span saw, from the request's arrival to now; a child of its ``traceparent``."""
    status, reason = status_and_reason(refusal)
    attributes: dict[str, str | int] = {HTTP_STATUS_CODE: status}
    context = None
    if environ is not None:
        carrier = {name: environ[key] for name, key in _TRACE_HEADERS if key in environ}
        if carrier:
            context = propagate.extract(carrier)
        method = environ.get("REQUEST_METHOD")
        if isinstance(method, str):
            attributes["http.request.method"] = method
    # Span times are wall-clock; the arrival is on the monotonic clock.
    end = time.time_ns()
    start = end - (time.monotonic_ns() - arrival_ns) if arrival_ns is not None else end
    span = tracer.start_span(
        REFUSAL_SPAN_NAME, context, trace.SpanKind.SERVER, attributes=attributes, start_time=min(start, end)
    )
    try:
        source = None if environ is None else budget_source_of(environ)
        record_admission(span, outcome, arrival_ns, deadline_ns, queue_wait_ns, refusal, source)
        span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
    finally:
        span.end(end)


def request_hook(span: trace.Span, environ: Mapping[str, Any]) -> None:
    """Copy the admission of the request ``environ`` describes onto ``span``; give it to an instrumentation.

    For instrumentations that start their span inside prazo's admission (a
    server embedding, the front door, or a middleware order where the
    instrumentation wraps the app rather than the middleware)::

        OpenTelemetryMiddleware(app, request_hook=prazo_otel.request_hook)
        FlaskInstrumentor().instrument_app(app, request_hook=prazo_otel.request_hook)
        DjangoInstrumentor().instrument(request_hook=lambda span, request: prazo_otel.request_hook(span, request.META))

    With ``instrument()`` on it copies everything the observer saw; without
    it, what the environ holds anyway (outcome ``admitted``, the queue wait
    and the budget source; the budget needs the arrival, which only the
    observer knows). A request prazo did not admit leaves ``span`` alone.
    """
    if span is None or not span.is_recording():
        return
    source = budget_source_of(environ)
    record = environ.get(ADMISSION_KEY)
    if record is not None:
        outcome, arrival_ns, deadline_ns, queue_wait_ns = record
        record_admission(span, outcome, arrival_ns, deadline_ns, queue_wait_ns, None, source)
        return
    queue_wait_ms = environ.get(QUEUE_WAIT_MS_KEY)
    if queue_wait_ms is not None:
        span.set_attributes(
            {OUTCOME: OUTCOME_ADMITTED, QUEUE_WAIT: max(queue_wait_ms, 0) / 1000, BUDGET_SOURCE: source}
        )


_instrument_lock = threading.Lock()
# The tracer of refusal spans (instrument(refusal_spans=True)), None when off.
_refusal_tracer: trace.Tracer | None = None


def instrument(*, refusal_spans: bool = False, tracer_provider: trace.TracerProvider | None = None) -> None:
    """Record every admission decision from now on (see the module docstring).

    ``refusal_spans=True``: a refusal made where no span is recording — a
    server embedding's, before any app or instrumentation ran — becomes a
    span of its own, ``prazo refusal`` (kind SERVER, status ERROR, from the
    request's arrival to the refusal, a child of the request's
    ``traceparent`` when the request was parsed), from ``tracer_provider``
    (default: the global one). Off by default: a span costs tens of
    microseconds, far more than the refusal itself, and refusals come in
    bursts exactly when the service is overloaded; the metrics count them.
    Calling ``instrument`` again changes these settings.

    Raises ``RuntimeError`` if another admission observer is installed:
    there is one per process and this one will not silently replace it.
    """
    global _refusal_tracer
    if not isinstance(refusal_spans, bool):
        raise TypeError(f"refusal_spans must be True or False, not {type(refusal_spans).__name__}")
    with _instrument_lock:
        current = admission_observer()
        if current is not None and current is not observe_admission:
            raise RuntimeError(f"another admission observer is installed ({current!r}); uninstall it first")
        _refusal_tracer = (
            trace.get_tracer(INSTRUMENTATION_SCOPE, tracer_provider=tracer_provider) if refusal_spans else None
        )
        set_admission_observer(observe_admission)


def uninstrument() -> None:
    """Stop recording admission decisions (the observer ``instrument()`` installed); nothing if not instrumented."""
    global _refusal_tracer
    with _instrument_lock:
        if admission_observer() is observe_admission:
            set_admission_observer(None)
            _refusal_tracer = None


def is_instrumented() -> bool:
    """True while ``instrument()``'s observer is installed."""
    current: AdmissionObserver | None = admission_observer()
    return current is observe_admission


def instrument_name(family: str) -> tuple[str, str]:
    """The OTel instrument name and unit of a metric family of ``prazo.bindings.plumbing.metric_table``.

    >>> instrument_name("prazo_queue_offered")
    ('prazo.queue.offered', '')
    >>> instrument_name("prazo_queue_wait_seconds")
    ('prazo.queue.wait', 's')
    """
    if family not in SPECS:
        raise ValueError(f"family must be one of prazo's metrics (METRIC_NAMES), got {family!r}")
    unit = ""
    if family.endswith("_seconds"):
        family, unit = family[: -len("_seconds")], "s"
    prefix, group, rest = family.split("_", 2)
    return f"{prefix}.{group}.{rest}", unit


def metric_attributes(labels: tuple[str, ...], values: tuple[str, ...]) -> dict[str, str | int]:
    """The OTel attributes of a sample whose label names are ``labels`` and label values ``values``."""
    return {
        ATTRIBUTE_FOR_LABEL[label]: int(value) if label in _INTEGER_LABELS else value
        for label, value in zip(labels, values)
    }


class PrazoMetrics(MetricSources):
    """prazo's counters and gauges as OpenTelemetry observable instruments.

    Effects: creates, on ``meter`` (default: the ``prazo`` meter of
    ``meter_provider``, or of the global provider), one observable counter
    per counter and one observable gauge per gauge of
    ``prazo.bindings.plumbing.metric_table`` — histograms excepted. Register objects
    with ``add_*`` (weak references, as ``prazo.bindings.integrations.prometheus.PrazoCollector``);
    at each collection every callback reads the live objects' ``stats()``.
    Nothing runs on the request path.

    >>> from opentelemetry.sdk.metrics import MeterProvider
    >>> from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    >>> from prazo.core import AdmissionQueue
    >>> reader = InMemoryMetricReader()
    >>> otel = PrazoMetrics(meter_provider=MeterProvider(metric_readers=[reader]))
    >>> q = AdmissionQueue(4, 16)
    >>> otel.add_queue("jobs", q)
    >>> [m.data.data_points[0].value for rm in reader.get_metrics_data().resource_metrics
    ...  for sm in rm.scope_metrics for m in sm.metrics if m.name == "prazo.queue.max_concurrency"]
    [4]
    """

    def __init__(self, meter_provider: MeterProvider | None = None, *, meter: Meter | None = None) -> None:
        super().__init__()
        if meter is None:
            provider = otel_metrics.get_meter_provider() if meter_provider is None else meter_provider
            meter = provider.get_meter(INSTRUMENTATION_SCOPE)
        elif meter_provider is not None:
            raise ValueError("pass meter_provider or meter, not both")
        self.meter = meter
        self.instruments: dict[str, Any] = {}
        for family in METRIC_NAMES:
            kind, _, description = SPECS[family]
            if kind not in (COUNTER, GAUGE):
                continue
            name, unit = instrument_name(family)
            create = meter.create_observable_counter if kind == COUNTER else meter.create_observable_gauge
            self.instruments[family] = create(
                name, callbacks=[self._callback(family)], unit=unit, description=description
            )

    def _callback(self, family: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        labels = SPECS[family][1]

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            # One stats() per object per instrument: a collection is rare and
            # stats() is a copy of counters, so no snapshot is shared (which
            # would need to know where one collection ends).
            return [
                Observation(value, metric_attributes(labels, values))
                for sample, values, value in self.samples()
                if sample == family
            ]

        return observe

    def __repr__(self) -> str:
        names = self.names()
        return f"<{type(self).__name__} queues={names['queue']} dependencies={names['dependency']}>"


_global_metrics: PrazoMetrics | None = None
_global_lock = threading.Lock()


def register_metrics(
    *dependencies: Dependency, meter_provider: MeterProvider | None = None, **named: Any
) -> PrazoMetrics:
    """Export ``dependencies`` (each names itself) and every ``name=thing`` as OTel metrics; return the exporter.

    Without ``meter_provider``, everything goes into one ``PrazoMetrics`` on
    the global meter provider (set it first, e.g. ``metrics.set_meter_provider``),
    so calling this again adds to it; with one, a new ``PrazoMetrics`` on it.
    ``thing`` may be an ``AdmissionMiddleware``, an ``AdmissionPool``, an
    ``AdmissionQueue`` or a server embedding's server.
    """
    global _global_metrics
    if meter_provider is not None:
        exporter = PrazoMetrics(meter_provider)
    else:
        with _global_lock:
            if _global_metrics is None:
                _global_metrics = PrazoMetrics()
            exporter = _global_metrics
    exporter.add(*dependencies, **named)
    return exporter
