"""What ``prazo.bindings.integrations.opentelemetry`` costs per request, and that it costs nothing when it is off.

The middleware (C twin of the queue; compiled path as built, then the Python
path) serves ``X-Request-Budget-Ms`` requests with a list body, in five
configurations of one group each:

``absent``
    OpenTelemetry not instrumented: the code path of a service without
    opentelemetry installed (``prazo.bindings.wsgi`` never imports it; the
    only check left is the observer's ``None``; the subprocess test in
    ``tests/integrations/opentelemetry/test_opentelemetry.py`` shows nothing of it is imported).
``api-only``
    ``instrument()`` with the API alone: the current span is the API's
    non-recording one, so each request pays ``get_current_span()``,
    ``is_recording()`` and the environ record for ``request_hook``.
``sdk-span-only``
    An SDK span current (recording), prazo not instrumented: the baseline of
    the next row.
``sdk-recording``
    ``instrument()`` with that SDK span current: the attributes are written
    on it for every request.

One round is ``INNER_LOOPS`` (1000) requests, so µs per round read as ns per request::

    .venv/bin/python -m pytest bench/test_bench_opentelemetry.py --benchmark-only
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prazo.bench.harness import LoopRunner
from prazo.bench.wsgi import KIND_HEADER, middleware_for, minimal_environ, serve_requests
from prazo.bindings.integrations import opentelemetry as prazo_otel
from prazo.core import AdmissionQueue

LoopBenchmark = Callable[[LoopRunner, str], None]

CONFIGURATIONS = ("absent", "api-only", "sdk-span-only", "sdk-recording")


@pytest.fixture(params=CONFIGURATIONS)
def configuration(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param in ("api-only", "sdk-recording"):
        prazo_otel.instrument()
    try:
        yield request.param
    finally:
        prazo_otel.uninstrument()


def _within_span(runner: LoopRunner) -> LoopRunner:
    # One recording SDK span per round of requests: the span's own cost is
    # not what is measured, the attributes written on it are.
    tracer = TracerProvider().get_tracer("bench")

    def run(loops: int) -> None:
        with tracer.start_as_current_span("round"):
            runner(loops)

    return run


@pytest.mark.parametrize("fast_path", [None, False], ids=["as-built", "python-path"])
def test_opentelemetry_middleware(loop_benchmark: LoopBenchmark, configuration: str, fast_path: bool | None) -> None:
    middleware = middleware_for(KIND_HEADER.app, AdmissionQueue, fast_path=fast_path)
    runner = serve_requests(middleware, minimal_environ(budget_ms=KIND_HEADER.budget_ms))
    if configuration.startswith("sdk"):
        runner = _within_span(runner)
    path = "compiled path" if middleware.fast_path else "Python path"
    loop_benchmark(runner, f"opentelemetry, middleware on the {path}")
