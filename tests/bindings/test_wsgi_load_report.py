"""``AdmissionMiddleware(load_report=...)`` on werkzeug's threaded server, with real HTTP on loopback.

On: every response the middleware lets through carries ``endpoint-load-metrics``
(the compiled path's and the Python path's, a bypass path's, a generator
body's), and so do its own refusals (503 ``queue-full``, 504). Off: none does.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _helpers import wait_until
from _load_reports import parse
from _required import require
from prazo.bindings.headers import BUDGET_HEADER
from prazo.bindings.wsgi import AdmissionMiddleware

# The compiled path adds the header too: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

serving = require("werkzeug.serving")

WAIT_S = 10.0  # generous bound for anything that should happen "soon" on a loaded machine


class QuietHandler(serving.WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        """Keep the test output readable."""


@pytest.fixture
def serve() -> Iterator[Callable[[Any], int]]:
    """Start a middleware on a threaded werkzeug server; always shut it down."""
    running: list[tuple[Any, threading.Thread]] = []

    def start(middleware: Any) -> int:
        server = serving.make_server("127.0.0.1", 0, middleware, threaded=True, request_handler=QuietHandler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        running.append((server, thread))
        return int(server.server_port)

    yield start
    for server, thread in running:
        server.shutdown()
        server.server_close()
        thread.join(WAIT_S)


class HeldApp:
    """``/hold`` waits on ``gate`` (and says it started on ``started``); ``/stream`` answers with a generator."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        # One list for every response: the middleware must not grow it.
        self.headers = [("Content-Type", "text/plain")]

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ["PATH_INFO"]
        if path == "/hold":
            self.started.set()
            self.gate.wait(WAIT_S)
        start_response("200 OK", self.headers)
        if path == "/stream":
            return (chunk for chunk in [b"a", b"b"])
        return [b"done"]


def get(port: int, path: str = "/", headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One real HTTP request; its status and headers."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        response.read()
        return response.status, response.headers
    finally:
        connection.close()


@pytest.mark.parametrize("fast_path", [None, False], ids=["default-path", "python-path"])
@pytest.mark.parametrize("format", ["text", "json"])
def test_every_response_carries_the_report_and_the_refusals_too(
    serve: Callable[[Any], int], fast_path: bool | None, format: str
) -> None:
    app = HeldApp()
    middleware = AdmissionMiddleware(
        app, max_concurrency=1, max_queue=0, bypass={"/healthz"}, load_report=format, fast_path=fast_path
    )
    port = serve(middleware)
    for path in ("/", "/stream", "/healthz"):
        status, headers = get(port, path)
        assert status == 200
        assert parse(headers["endpoint-load-metrics"])["named_metrics.queue"] == 0, path
        assert len(headers.get_all("endpoint-load-metrics")) == 1
    assert app.headers == [("Content-Type", "text/plain")]
    # One request holds the only place: the next is refused 503 queue-full, with the report.
    holder = threading.Thread(target=get, args=(port, "/hold"), daemon=True)
    holder.start()
    try:
        assert app.started.wait(WAIT_S)
        status, headers = get(port, "/")
        assert (status, headers["X-Prazo-Reason"]) == (503, "queue-full")
        parse(headers["endpoint-load-metrics"])
    finally:
        app.gate.set()
        holder.join(WAIT_S)
    status, headers = get(port, "/", {BUDGET_HEADER: "0"})
    assert status == 504
    parse(headers["endpoint-load-metrics"])


def test_the_report_counts_the_requests_and_the_refusals(serve: Callable[[Any], int]) -> None:
    app = HeldApp()
    middleware = AdmissionMiddleware(app, max_concurrency=2, max_queue=0, load_report="text")
    port = serve(middleware)
    holder = threading.Thread(target=get, args=(port, "/hold"), daemon=True)
    holder.start()
    try:
        assert app.started.wait(WAIT_S)
        for _ in range(3):
            assert get(port, "/", {BUDGET_HEADER: "0"})[0] == 504

        def report() -> dict[str, float]:
            status, headers = get(port, "/")
            assert status == 200
            return parse(headers["endpoint-load-metrics"])

        # The held request and the asking one fill both places; the report is renewed once a second.
        wait_until(lambda: report().get("application_utilization") == 1.0, "the report of a full line", WAIT_S * 3)
        wait_until(lambda: report().get("eps", 0) > 0, "refusals in a later report", WAIT_S * 3)
    finally:
        app.gate.set()
        holder.join(WAIT_S)
    assert middleware.load_report is not None


@pytest.mark.parametrize("fast_path", [None, False], ids=["default-path", "python-path"])
def test_off_by_default_no_response_carries_it(serve: Callable[[Any], int], fast_path: bool | None) -> None:
    middleware = AdmissionMiddleware(HeldApp(), max_concurrency=1, max_queue=0, fast_path=fast_path)
    assert middleware.load_report is None
    port = serve(middleware)
    for path, headers in (("/", {}), ("/stream", {}), ("/", {BUDGET_HEADER: "0"})):
        _, got = get(port, path, headers)
        assert "endpoint-load-metrics" not in got


def test_a_wrong_value_names_the_argument() -> None:
    with pytest.raises(ValueError, match="load_report"):
        AdmissionMiddleware(HeldApp(), max_concurrency=1, max_queue=0, load_report="orca")
    with pytest.raises(TypeError, match="load_report"):
        AdmissionMiddleware(HeldApp(), max_concurrency=1, max_queue=0, load_report=True)  # type: ignore[arg-type]
