"""prazo with the OpenTelemetry SDK console exporters: admission on spans, prazo's metrics.

pip install 'prazo[otel]' opentelemetry-sdk && python examples/opentelemetry/console.py
"""

import threading
import time
from wsgiref.util import setup_testing_defaults

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from prazo.bindings.integrations import opentelemetry as prazo_otel
from prazo.bindings.wsgi import AdmissionMiddleware

# The usual OTel SDK set-up: spans and metrics printed on stdout.
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
trace.set_tracer_provider(tracer_provider)
reader = PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=60_000)
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))


def service(environ, start_response):
    time.sleep(0.2)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello\n"]


api = AdmissionMiddleware(service, max_concurrency=1, max_queue=1, default_budget_ms=1000)
prazo_otel.instrument()  # admission decisions on the current span
prazo_otel.register_metrics(api=api)  # prazo's counters as OTel metrics, read at collection


# Stands in for opentelemetry-instrumentation-wsgi's OpenTelemetryMiddleware(api),
# which goes in the same place: around the admission middleware.
def traced(environ, start_response):
    with trace.get_tracer("recipe").start_as_current_span("GET /", kind=trace.SpanKind.SERVER):
        return list(api(environ, start_response))


def request(budget_ms):
    environ = {"HTTP_X_REQUEST_BUDGET_MS": budget_ms}
    setup_testing_defaults(environ)
    traced(environ, lambda status, headers, exc_info=None: print(status, dict(headers).get("X-Prazo-Reason", "")))


def until(predicate):
    while not predicate():
        time.sleep(0.001)


# One slot and one place in line: the first runs, the second waits ~200 ms,
# the third is refused 503 queue-full; then one whose 100 ms budget runs out
# in line is refused 504 expired-in-queue.
first = threading.Thread(target=request, args=("1000",))
first.start()
until(lambda: api.stats()["in_flight"] == 1)
second = threading.Thread(target=request, args=("1000",))
second.start()
until(lambda: api.stats()["queued"] == 1)
request("1000")
first.join()
second.join()
until(lambda: api.stats()["in_flight"] == 0)
holder = threading.Thread(target=request, args=("1000",))
holder.start()
until(lambda: api.stats()["in_flight"] == 1)
request("100")
holder.join()
reader.force_flush()
