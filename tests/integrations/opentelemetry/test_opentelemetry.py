"""OpenTelemetry (``prazo.bindings.integrations.opentelemetry``): what the SDK's in-memory exporter and reader receive.

Spans come from a real SDK ``TracerProvider`` with an ``InMemorySpanExporter``
(not the global provider: the current span is whatever the context holds, so
a local provider is enough); metrics from a ``MeterProvider`` with an
``InMemoryMetricReader``. Requests are driven through the real middleware
(both paths), the server dispatcher, waitress and the front door, with real
threads where a request must wait.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.util import setup_testing_defaults

import pytest
from _helpers import CheckedThread, wait_until
from _server_harness import CLIENT_TIMEOUT_S, request, start_server
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prazo.bindings import wsgi
from prazo.bindings.dependency import Dependency
from prazo.bindings.integrations import opentelemetry as prazo_otel
from prazo.bindings.integrations.prometheus import PrazoCollector
from prazo.bindings.plumbing.metric_table import COUNTER, GAUGE, METRIC_NAMES, SPECS
from prazo.bindings.servers.plumbing.dispatcher import AdmissionDispatcher, Ticket
from prazo.bindings.wsgi import AdmissionMiddleware
from prazo.core import Deadline, extension_wanted

PATHS = [pytest.param(False, id="python-path"), pytest.param(True, id="compiled-path")]
if not extension_wanted():
    PATHS = PATHS[:1]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Any:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("tests")


@pytest.fixture
def instrumented() -> Iterator[None]:
    prazo_otel.instrument()
    try:
        yield
    finally:
        prazo_otel.uninstrument()


def environ_for(path: str = "/", **headers: str) -> dict[str, Any]:
    environ: dict[str, Any] = {"PATH_INFO": path}
    setup_testing_defaults(environ)
    for name, value in headers.items():
        environ["HTTP_" + name.upper()] = value
    return environ


class Gate:
    """An app that holds its slot until ``open()``; ``entered`` is set once it runs."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("PATH_INFO") == "/hold":
            self.entered.set()
            assert self._open.wait(CLIENT_TIMEOUT_S)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]


def serve(
    tracer: Any, mw: Any, environ: dict[str, Any], name: str = "request"
) -> tuple[str, dict[str, str], list[bytes]]:
    """One request through ``mw`` inside a span ``name``, as an instrumentation around the middleware would."""
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        seen["status"], seen["headers"] = status, dict(headers)
        return lambda data: None

    with tracer.start_as_current_span(name):
        body = mw(environ, start_response)
        try:
            chunks = list(body)
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
    return seen["status"], seen["headers"], chunks


def span_named(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    spans = [span for span in exporter.get_finished_spans() if span.name == name]
    assert len(spans) == 1, [span.name for span in exporter.get_finished_spans()]
    return spans[0]


def prazo_attributes(span: ReadableSpan) -> dict[str, Any]:
    return {key: value for key, value in (span.attributes or {}).items() if key.startswith("prazo.")}


def in_thread(fn: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


# -- spans: the middleware ------------------------------------------------------------


@pytest.mark.parametrize("fast_path", PATHS)
def test_admitted_request_records_outcome_budget_and_source(
    tracer: Any, exporter: InMemorySpanExporter, instrumented: None, fast_path: bool
) -> None:
    mw = AdmissionMiddleware(Gate(), max_concurrency=2, max_queue=2, fast_path=fast_path)
    assert mw.fast_path is fast_path
    status, _, body = serve(tracer, mw, environ_for(x_request_budget_ms="250"))
    assert (status, body) == ("200 OK", [b"ok"])
    attributes = prazo_attributes(span_named(exporter, "request"))
    assert attributes[prazo_otel.OUTCOME] == "admitted"
    assert attributes[prazo_otel.BUDGET] == pytest.approx(0.25)
    assert attributes[prazo_otel.BUDGET_SOURCE] == "X-Request-Budget-Ms"
    assert 0 <= attributes[prazo_otel.QUEUE_WAIT] < 0.25
    assert prazo_otel.REASON not in attributes
    assert not span_named(exporter, "request").events


@pytest.mark.parametrize("fast_path", PATHS)
def test_default_budget_is_named_default(
    tracer: Any, exporter: InMemorySpanExporter, instrumented: None, fast_path: bool
) -> None:
    mw = AdmissionMiddleware(Gate(), max_concurrency=1, max_queue=0, default_budget_ms=700, fast_path=fast_path)
    serve(tracer, mw, environ_for())
    attributes = prazo_attributes(span_named(exporter, "request"))
    assert attributes[prazo_otel.BUDGET] == pytest.approx(0.7)
    assert attributes[prazo_otel.BUDGET_SOURCE] == "default"


@pytest.mark.parametrize("fast_path", PATHS)
def test_queue_wait_of_a_request_that_waited_with_real_threads(
    tracer: Any, exporter: InMemorySpanExporter, instrumented: None, fast_path: bool
) -> None:
    gate = Gate()
    mw = AdmissionMiddleware(gate, max_concurrency=1, max_queue=1, max_budget_ms=30000, fast_path=fast_path)
    holder = in_thread(lambda: serve(tracer, mw, environ_for("/hold", x_request_budget_ms="20000"), "holder"))
    assert gate.entered.wait(CLIENT_TIMEOUT_S)
    waiter = in_thread(lambda: serve(tracer, mw, environ_for(x_request_budget_ms="20000"), "waiter"))
    wait_until(lambda: mw.stats()["queued"] == 1, "the second request waits")
    # It is in line before this pause starts, so it waits at least this long.
    time.sleep(0.1)
    gate.open()
    holder.join(CLIENT_TIMEOUT_S)
    waiter.join(CLIENT_TIMEOUT_S)
    attributes = prazo_attributes(span_named(exporter, "waiter"))
    assert attributes[prazo_otel.OUTCOME] == "admitted"
    assert 0.1 <= attributes[prazo_otel.QUEUE_WAIT] < CLIENT_TIMEOUT_S
    assert attributes[prazo_otel.BUDGET] == pytest.approx(20.0)
    assert mw.stats()["in_flight"] == 0


def refused_behind_a_holder(
    tracer: Any, exporter: InMemorySpanExporter, fast_path: bool, max_queue: int, budget_ms: str
) -> tuple[str, dict[str, str], ReadableSpan]:
    """One request sent while another holds the only slot (real threads); its status, headers and span."""
    gate = Gate()
    mw = AdmissionMiddleware(gate, max_concurrency=1, max_queue=max_queue, fast_path=fast_path)
    holder = in_thread(lambda: serve(tracer, mw, environ_for("/hold", x_request_budget_ms="20000"), "holder"))
    assert gate.entered.wait(CLIENT_TIMEOUT_S)
    try:
        status, headers, _ = serve(tracer, mw, environ_for(x_request_budget_ms=budget_ms), "refused")
    finally:
        gate.open()
        holder.join(CLIENT_TIMEOUT_S)
    assert mw.stats()["in_flight"] == 0
    return status, headers, span_named(exporter, "refused")


@pytest.mark.parametrize("fast_path", PATHS)
def test_queue_full_refusal_records_reason_and_event(
    tracer: Any, exporter: InMemorySpanExporter, instrumented: None, fast_path: bool
) -> None:
    status, headers, span = refused_behind_a_holder(tracer, exporter, fast_path, max_queue=0, budget_ms="3000")
    assert status.startswith("503") and headers["X-Prazo-Reason"] == "queue-full"
    attributes = prazo_attributes(span)
    assert attributes[prazo_otel.OUTCOME] == "refused"
    assert attributes[prazo_otel.REASON] == "queue-full"
    assert attributes[prazo_otel.BUDGET] == pytest.approx(3.0)
    [event] = span.events
    assert event.name == prazo_otel.EVENT_REFUSED
    assert dict(event.attributes or {})[prazo_otel.REASON] == "queue-full"
    assert dict(event.attributes or {})[prazo_otel.HTTP_STATUS_CODE] == 503


@pytest.mark.parametrize("fast_path", PATHS)
def test_expired_in_queue_records_504_and_the_wait(
    tracer: Any, exporter: InMemorySpanExporter, instrumented: None, fast_path: bool
) -> None:
    status, headers, span = refused_behind_a_holder(tracer, exporter, fast_path, max_queue=1, budget_ms="80")
    assert status.startswith("504") and headers["X-Prazo-Reason"] == "expired-in-queue"
    attributes = prazo_attributes(span)
    assert attributes[prazo_otel.OUTCOME] == "refused"
    assert attributes[prazo_otel.REASON] == "expired-in-queue"
    assert attributes[prazo_otel.BUDGET] == pytest.approx(0.08)
    # It waited its whole budget in line (active expiry answers at the deadline).
    assert 0.08 <= attributes[prazo_otel.QUEUE_WAIT] < CLIENT_TIMEOUT_S
    [event] = span.events
    assert dict(event.attributes or {})[prazo_otel.HTTP_STATUS_CODE] == 504


@pytest.mark.parametrize("fast_path", PATHS)
def test_expired_on_arrival(tracer: Any, exporter: InMemorySpanExporter, instrumented: None, fast_path: bool) -> None:
    mw = AdmissionMiddleware(Gate(), max_concurrency=1, max_queue=1, fast_path=fast_path)
    status, headers, _ = serve(tracer, mw, environ_for(x_request_budget_ms="0"))
    assert status.startswith("504") and headers["X-Prazo-Reason"] == "expired-on-arrival"
    attributes = prazo_attributes(span_named(exporter, "request"))
    assert (attributes[prazo_otel.REASON], attributes[prazo_otel.BUDGET]) == ("expired-on-arrival", 0.0)


def test_bypassed_request(tracer: Any, exporter: InMemorySpanExporter, instrumented: None) -> None:
    mw = AdmissionMiddleware(Gate(), max_concurrency=1, max_queue=0, bypass={"/healthz"})
    serve(tracer, mw, environ_for("/healthz"))
    attributes = prazo_attributes(span_named(exporter, "request"))
    assert attributes[prazo_otel.OUTCOME] == "bypassed"
    assert attributes[prazo_otel.QUEUE_WAIT] == 0


@pytest.mark.parametrize("fast_path", PATHS)
def test_nothing_recorded_unless_instrumented(tracer: Any, exporter: InMemorySpanExporter, fast_path: bool) -> None:
    assert not prazo_otel.is_instrumented()
    mw = AdmissionMiddleware(Gate(), max_concurrency=1, max_queue=0, fast_path=fast_path)
    environ = environ_for()
    serve(tracer, mw, environ)
    prazo_otel.instrument()
    prazo_otel.uninstrument()
    serve(tracer, mw, environ_for(), "after")
    assert prazo_attributes(span_named(exporter, "request")) == {}
    assert prazo_attributes(span_named(exporter, "after")) == {}
    assert prazo_otel.ADMISSION_KEY not in environ


# -- spans: instrumentation inside the admission (request_hook) -------------------------


def hooked_app(tracer: Any) -> Callable[..., list[bytes]]:
    """An app that starts its own server span and calls ``request_hook``, as an OTel WSGI middleware inside would."""

    def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with tracer.start_as_current_span("inner") as span:
            prazo_otel.request_hook(span, environ)
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]

    return application


@pytest.mark.parametrize("fast_path", PATHS)
def test_request_hook_copies_what_no_span_saw(
    tracer: Any, exporter: InMemorySpanExporter, instrumented: None, fast_path: bool
) -> None:
    mw = AdmissionMiddleware(hooked_app(tracer), max_concurrency=1, max_queue=0, fast_path=fast_path)
    environ = environ_for(x_request_budget_ms="400")
    # No span around the middleware: the API's current span is not recording.
    assert list(mw(environ, lambda *a: None)) == [b"ok"]
    assert environ[prazo_otel.ADMISSION_KEY][0] == "admitted"
    attributes = prazo_attributes(span_named(exporter, "inner"))
    assert attributes[prazo_otel.OUTCOME] == "admitted"
    assert attributes[prazo_otel.BUDGET] == pytest.approx(0.4)
    assert attributes[prazo_otel.BUDGET_SOURCE] == "X-Request-Budget-Ms"


def test_request_hook_without_instrument_uses_the_environ(tracer: Any, exporter: InMemorySpanExporter) -> None:
    mw = AdmissionMiddleware(hooked_app(tracer), max_concurrency=1, max_queue=0)
    list(mw(environ_for(), lambda *a: None))
    attributes = prazo_attributes(span_named(exporter, "inner"))
    assert attributes[prazo_otel.OUTCOME] == "admitted"
    assert attributes[prazo_otel.BUDGET_SOURCE] == "default"
    assert attributes[prazo_otel.QUEUE_WAIT] >= 0
    assert prazo_otel.BUDGET not in attributes


def test_request_hook_leaves_requests_prazo_did_not_admit(tracer: Any, exporter: InMemorySpanExporter) -> None:
    with tracer.start_as_current_span("plain") as span:
        prazo_otel.request_hook(span, environ_for())
    assert prazo_attributes(span_named(exporter, "plain")) == {}


# -- spans: servers --------------------------------------------------------------------


@pytest.mark.slow
def test_waitress_embedding_records_through_request_hook(
    tracer: Any, exporter: InMemorySpanExporter, instrumented: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import _server_harness

    monkeypatch.setattr(_server_harness, "app", hooked_app(tracer))
    server = start_server("waitress", threads=2, max_queue=4)
    try:
        outcome = request(server.port, "/", {"X-Request-Budget-Ms": "1500"})
        assert (outcome.status, outcome.body) == (200, b"ok")
    finally:
        server.stop()
    attributes = prazo_attributes(span_named(exporter, "inner"))
    assert attributes[prazo_otel.OUTCOME] == "admitted"
    assert attributes[prazo_otel.BUDGET] == pytest.approx(1.5)
    assert attributes[prazo_otel.BUDGET_SOURCE] == "X-Request-Budget-Ms"
    assert 0 <= attributes[prazo_otel.QUEUE_WAIT] < 1.5


@pytest.mark.slow
def test_front_door_records_through_request_hook(
    tracer: Any, exporter: InMemorySpanExporter, instrumented: None
) -> None:
    from prazo.bindings.servers.frontdoor import create_server

    server = create_server(hooked_app(tracer), port=0, threads=2, max_queue=4)
    server.start()
    try:
        outcome = request(server.port, "/", {"X-Request-Budget-Ms": "1200"})
        assert (outcome.status, outcome.body) == (200, b"ok")
    finally:
        server.shutdown(5.0)
    attributes = prazo_attributes(span_named(exporter, "inner"))
    assert attributes[prazo_otel.OUTCOME] == "admitted"
    assert attributes[prazo_otel.BUDGET] == pytest.approx(1.2)
    assert 0 <= attributes[prazo_otel.QUEUE_WAIT] < 1.2


def test_dispatcher_refusal_on_the_submitting_threads_span(
    tracer: Any, exporter: InMemorySpanExporter, instrumented: None
) -> None:
    """A server's I/O thread that is itself traced sees the refusal on its span."""
    refused: list[BaseException] = []
    served = threading.Event()
    release = threading.Event()

    def work(ticket: Ticket) -> None:
        served.set()
        release.wait(CLIENT_TIMEOUT_S)

    dispatcher = AdmissionDispatcher(1, 0, serve=work, reject=lambda ticket, exc: refused.append(exc))
    dispatcher.start()
    try:
        assert dispatcher.submit(Ticket("first", Deadline.after(10), time.monotonic_ns()))
        assert served.wait(CLIENT_TIMEOUT_S)
        with tracer.start_as_current_span("io"):
            assert not dispatcher.submit(Ticket("second", Deadline.after(2), time.monotonic_ns()))
    finally:
        release.set()
        assert dispatcher.shutdown(timeout=CLIENT_TIMEOUT_S)
    assert [type(exc).__name__ for exc in refused] == ["QueueFull"]
    span = span_named(exporter, "io")
    attributes = prazo_attributes(span)
    assert (attributes[prazo_otel.OUTCOME], attributes[prazo_otel.REASON]) == ("refused", "queue-full")
    # Refused before the request was parsed: where its budget came from is unknown.
    assert prazo_otel.BUDGET_SOURCE not in attributes
    assert attributes[prazo_otel.BUDGET] == pytest.approx(2.0, abs=0.01)
    assert dict(span.events[0].attributes or {})[prazo_otel.HTTP_STATUS_CODE] == 503


@pytest.fixture
def refusal_spans(exporter: InMemorySpanExporter) -> Iterator[None]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    prazo_otel.instrument(refusal_spans=True, tracer_provider=provider)
    try:
        yield
    finally:
        prazo_otel.uninstrument()


def test_server_refusal_becomes_a_span_of_its_own(exporter: InMemorySpanExporter, refusal_spans: None) -> None:
    """A waiting ticket expires in the dispatcher's line, where no span is current: a ``prazo refusal`` span."""
    refused = threading.Event()
    release = threading.Event()
    dispatcher = AdmissionDispatcher(
        1, 1, serve=lambda ticket: release.wait(CLIENT_TIMEOUT_S), reject=lambda ticket, exc: refused.set()
    )
    dispatcher.start()
    try:
        assert dispatcher.submit(Ticket("holder", Deadline.after(20), time.monotonic_ns()))
        wait_until(lambda: dispatcher.stats()["in_flight"] == 1, "the holder runs")
        assert dispatcher.submit(Ticket("waiter", Deadline.after(0.08), time.monotonic_ns()))
        assert refused.wait(CLIENT_TIMEOUT_S)
    finally:
        release.set()
        assert dispatcher.shutdown(timeout=CLIENT_TIMEOUT_S)
    span = span_named(exporter, prazo_otel.REFUSAL_SPAN_NAME)
    assert span.kind.name == "SERVER" and span.status.status_code.name == "ERROR"
    attributes = dict(span.attributes or {})
    assert attributes[prazo_otel.REASON] == "expired-in-queue"
    assert attributes[prazo_otel.HTTP_STATUS_CODE] == 504
    assert 0.08 <= attributes[prazo_otel.QUEUE_WAIT] < CLIENT_TIMEOUT_S
    # The span covers the wait: from arrival to the refusal.
    assert span.end_time is not None and span.start_time is not None
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(attributes[prazo_otel.QUEUE_WAIT], abs=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["waitress", "werkzeug"])
def test_an_embeddings_refusal_span_says_what_the_server_read(
    kind: str, exporter: InMemorySpanExporter, refusal_spans: None, tmp_path: Path
) -> None:
    """The server had parsed the request it refused: its span has the method, the trace parent and the budget."""
    server = start_server(kind, threads=1, max_queue=0)
    gate, mark = tmp_path / "gate", tmp_path / "running"
    holder = CheckedThread(target=request, args=(server.port, f"/work?gate={gate}&mark={mark}"))
    holder.start()
    try:
        wait_until(mark.exists, "the holder to occupy the only worker")
        trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Request-Budget-Ms": "5000"}
        refused = request(server.port, "/refused", headers, method="POST", body=b"x")
        assert (refused.status, refused.reason) == (503, "queue-full")
    finally:
        gate.touch()
        holder.join(CLIENT_TIMEOUT_S)
        server.stop()
    span = span_named(exporter, prazo_otel.REFUSAL_SPAN_NAME)
    assert format(span.context.trace_id, "032x") == trace_id
    assert span.parent is not None and format(span.parent.span_id, "016x") == parent_id
    attributes = dict(span.attributes or {})
    assert attributes["http.request.method"] == "POST"
    assert attributes[prazo_otel.BUDGET_SOURCE] == "X-Request-Budget-Ms"
    assert attributes[prazo_otel.BUDGET] == pytest.approx(5.0)
    assert attributes[prazo_otel.REASON] == "queue-full"


@pytest.mark.parametrize("fast_path", PATHS)
def test_refusal_span_continues_the_callers_trace(
    exporter: InMemorySpanExporter, refusal_spans: None, fast_path: bool
) -> None:
    mw = AdmissionMiddleware(Gate(), max_concurrency=1, max_queue=0, fast_path=fast_path)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    environ = environ_for(x_request_budget_ms="0", traceparent=f"00-{trace_id}-00f067aa0ba902b7-01")
    mw(environ, lambda *a: None)
    span = span_named(exporter, prazo_otel.REFUSAL_SPAN_NAME)
    assert format(span.context.trace_id, "032x") == trace_id
    assert span.parent is not None and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert dict(span.attributes or {})["http.request.method"] == "GET"
    assert dict(span.attributes or {})[prazo_otel.REASON] == "expired-on-arrival"


def test_no_refusal_span_unless_asked(exporter: InMemorySpanExporter, instrumented: None) -> None:
    mw = AdmissionMiddleware(Gate(), max_concurrency=1, max_queue=0)
    mw(environ_for(x_request_budget_ms="0"), lambda *a: None)
    assert exporter.get_finished_spans() == ()
    with pytest.raises(TypeError, match="refusal_spans"):
        prazo_otel.instrument(refusal_spans="yes")  # type: ignore[arg-type]


# -- the observer hook ------------------------------------------------------------------


@pytest.mark.parametrize("fast_path", PATHS)
def test_an_observer_that_raises_never_leaks_the_slot(fast_path: bool) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("observer")

    mw = AdmissionMiddleware(Gate(), max_concurrency=1, max_queue=0, fast_path=fast_path)
    previous = wsgi.set_admission_observer(broken)
    try:
        with pytest.raises(RuntimeError, match="observer"):
            mw(environ_for(), lambda *a: None)
    finally:
        wsgi.set_admission_observer(previous)
    assert mw.stats()["in_flight"] == 0
    assert list(mw(environ_for(), lambda *a: None)) == [b"ok"]


def test_instrument_refuses_to_replace_another_observer() -> None:
    def other(*args: Any) -> None:
        pass

    wsgi.set_admission_observer(other)
    try:
        with pytest.raises(RuntimeError, match="another admission observer"):
            prazo_otel.instrument()
        prazo_otel.uninstrument()  # not ours: left alone
        assert wsgi.admission_observer() is other
    finally:
        wsgi.set_admission_observer(None)
    prazo_otel.instrument()
    prazo_otel.instrument()
    assert prazo_otel.is_instrumented()
    prazo_otel.uninstrument()
    assert not prazo_otel.is_instrumented()


def test_set_admission_observer_checks_its_argument() -> None:
    with pytest.raises(TypeError, match="observer"):
        wsgi.set_admission_observer(42)  # type: ignore[arg-type]


# -- metrics ----------------------------------------------------------------------------


def collect(reader: InMemoryMetricReader) -> dict[str, dict[frozenset[tuple[str, Any]], float]]:
    """``{instrument name: {attributes: value}}`` of one collection."""
    data = reader.get_metrics_data()
    found: dict[str, dict[frozenset[tuple[str, Any]], float]] = {}
    for resource_metrics in data.resource_metrics if data else []:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                points = found.setdefault(metric.name, {})
                for point in metric.data.data_points:
                    points[frozenset((point.attributes or {}).items())] = point.value
    return found


def test_every_counter_and_gauge_of_the_table_is_an_instrument() -> None:
    otel = prazo_otel.PrazoMetrics(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    expected = {name for name in METRIC_NAMES if SPECS[name][0] in (COUNTER, GAUGE)}
    assert set(otel.instruments) == expected
    assert len({prazo_otel.instrument_name(name) for name in expected}) == len(expected)
    with pytest.raises(ValueError, match="family"):
        prazo_otel.instrument_name("prazo_nope")


@pytest.mark.parametrize("fast_path", PATHS)
def test_metrics_after_real_traffic_match_the_prometheus_export(fast_path: bool) -> None:
    reader = InMemoryMetricReader()
    gate = Gate()
    mw = AdmissionMiddleware(gate, max_concurrency=1, max_queue=0, fast_path=fast_path)
    recommendations = Dependency("recommendations", max_concurrent=2, timeout_ms=5000)
    otel = prazo_otel.register_metrics(recommendations, meter_provider=MeterProvider(metric_readers=[reader]), api=mw)
    assert otel.names() == {"queue": ["api"], "dependency": ["recommendations"]}
    assert recommendations.call(lambda: "ok") == "ok"
    with pytest.raises(ValueError):
        recommendations.call(int, "not a number")
    for _ in range(3):
        list(mw(environ_for(), lambda *a: None))
    holder = in_thread(lambda: list(mw(environ_for("/hold"), lambda *a: None)))
    assert gate.entered.wait(CLIENT_TIMEOUT_S)
    try:
        mw(environ_for(), lambda *a: None)  # 503 queue-full
        mw(environ_for(x_request_budget_ms="0"), lambda *a: None)  # 504 expired-on-arrival
    finally:
        gate.open()
        holder.join(CLIENT_TIMEOUT_S)
    found = collect(reader)
    api = frozenset({("prazo.queue.name", "api")})
    assert found["prazo.queue.offered"][api] == 6
    assert found["prazo.queue.completed"][api] == 4
    assert found["prazo.queue.max_concurrency"][api] == 1
    assert found["prazo.queue.refused"][api | {("prazo.admission.reason", "queue-full")}] == 1
    assert found["prazo.queue.refused"][api | {("prazo.admission.reason", "expired-on-arrival")}] == 1
    assert found["prazo.wsgi.refusals"][api | {("http.response.status_code", 503)}] == 1
    assert found["prazo.wsgi.refusals"][api | {("http.response.status_code", 504)}] == 1
    assert found["prazo.queue.wait"][api] >= 0
    recs = frozenset({("prazo.dependency.name", "recommendations")})
    assert found["prazo.dependency.calls"][recs | {("prazo.dependency.outcome", "ok")}] == 1
    assert found["prazo.dependency.calls"][recs | {("prazo.dependency.outcome", "error")}] == 1
    assert found["prazo.dependency.max_concurrent"][recs] == 2
    assert found["prazo.dependency.timeout"][recs] == pytest.approx(5.0)
    # Every sample equals what the Prometheus collector reads from the same table.
    collector = PrazoCollector()
    collector.add_middleware("api", mw)
    collector.add_dependency(recommendations)
    for family in collector.collect():
        if family.type not in ("counter", "gauge"):
            continue
        name, _ = prazo_otel.instrument_name(family.name)
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            attributes = frozenset(
                prazo_otel.metric_attributes(tuple(sample.labels), tuple(sample.labels.values())).items()
            )
            got = found[name][attributes]
            assert got == sample.value or (math.isnan(got) and math.isnan(sample.value)), (name, attributes)


def test_metrics_drop_collected_objects() -> None:
    reader = InMemoryMetricReader()
    otel = prazo_otel.PrazoMetrics(MeterProvider(metric_readers=[reader]))
    mw = AdmissionMiddleware(Gate(), max_concurrency=2, max_queue=0)
    otel.add_middleware("gone", mw)
    assert collect(reader)["prazo.queue.max_concurrency"]
    del mw
    import gc

    gc.collect()
    assert not collect(reader).get("prazo.queue.max_concurrency")
    assert otel.names() == {"queue": [], "dependency": []}


# -- without opentelemetry --------------------------------------------------------------

BLOCKED = textwrap.dedent(
    """
    import sys

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
            return None

    sys.meta_path.insert(0, Blocker())

    from prazo.bindings.wsgi import AdmissionMiddleware
    from prazo.bindings.servers.plumbing.dispatcher import AdmissionDispatcher

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    env = {"PATH_INFO": "/", "REQUEST_METHOD": "GET", "HTTP_X_REQUEST_BUDGET_MS": "300"}
    for fast_path in (False, None):
        mw = AdmissionMiddleware(app, max_concurrency=1, max_queue=0, fast_path=fast_path)
        assert list(mw(dict(env), lambda *a: None)) == [b"ok"]
        assert mw.stats()["completed"] == 1
    assert not any(name.split(".")[0] == "opentelemetry" for name in sys.modules)
    try:
        import prazo.bindings.integrations.opentelemetry
    except ImportError as exc:
        assert "pip install 'prazo[otel]'" in str(exc), exc
        print("ok")
    """
)


def test_prazo_works_when_opentelemetry_cannot_be_imported() -> None:
    result = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.slow
def test_the_console_recipe_runs() -> None:
    """``examples/opentelemetry/console.py``, the example the tracing page includes, as a user runs it."""
    recipe = Path(__file__).resolve().parents[3] / "examples" / "opentelemetry" / "console.py"
    result = subprocess.run([sys.executable, str(recipe)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert sorted(line.strip() for line in lines if line[:3].isdigit()) == [
        "200 OK",
        "200 OK",
        "200 OK",
        "503 Service Unavailable queue-full",
        "504 Gateway Timeout expired-in-queue",
    ]
    assert '"prazo.admission.reason": "expired-in-queue"' in result.stdout
    assert '"name": "prazo.queue.offered"' in result.stdout
