"""AdmissionMiddleware on werkzeug's threaded server, with real HTTP on loopback.

With ``load_report=`` every response the middleware lets through (the
compiled path's and the Python path's, a bypass path's, a generator body's)
carries ``endpoint-load-metrics``, and so do its own refusals (503
``queue-full``, 504); off, none does.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from _load_reports import parse
from _required import require
from prazo.bindings.headers import BUDGET_HEADER, GRPC_TIMEOUT_HEADER, REASON_HEADER_NAME
from prazo.bindings.wsgi import DEADLINE_KEY, AdmissionMiddleware

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

serving = require("werkzeug.serving")

WAIT_S = 10  # generous bound for anything that should happen "soon" on a loaded machine


class QuietHandler(serving.WSGIRequestHandler):
    def log_request(self, *args, **kwargs):
        """Keep the test output readable."""


@pytest.fixture
def serve():
    """Start a middleware on a threaded werkzeug server; always shut it down."""
    running = []

    def start(middleware):
        server = serving.make_server("127.0.0.1", 0, middleware, threaded=True, request_handler=QuietHandler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        running.append((server, thread))
        return server.server_port

    yield start
    for server, thread in running:
        server.shutdown()
        server.server_close()
        thread.join(WAIT_S)


class GatedApp:
    """Blocks every request on ``gate`` (except paths in ``fast``); records the paths it ran and their budgets."""

    def __init__(self, fast=()):
        self.gate = threading.Event()
        self.fast = set(fast)
        self.paths = []
        self.remaining_ms = []
        self._lock = threading.Lock()

    def __call__(self, environ, start_response):
        path = environ["PATH_INFO"]
        with self._lock:
            self.paths.append(path)
            self.remaining_ms.append(environ[DEADLINE_KEY].remaining_ms())
        if path not in self.fast:
            self.gate.wait(WAIT_S)
        body = f"done {path}".encode()
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]


def get(port, path="/", headers=()):
    """One real HTTP request; returns (status, headers, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        connection.putrequest("GET", path)
        for name, value in headers:
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def wait_until(predicate, what):
    end = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_burst_is_bounded_by_concurrency_plus_queue(serve):
    app = GatedApp()
    middleware = AdmissionMiddleware(app, max_concurrency=2, max_queue=4, default_budget_ms=20_000, retry_after_s=2)
    port = serve(middleware)
    with ThreadPoolExecutor(max_workers=12) as clients:
        try:
            futures = [clients.submit(get, port, f"/burst/{index}") for index in range(12)]
            # 2 run, 4 wait and 6 are refused before the slow work ends.
            wait_until(lambda: middleware.stats()["offered"] == 12, "all 12 requests to arrive")
        finally:
            app.gate.set()
        results = [future.result() for future in futures]

    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * 6 + [503] * 6
    for status, headers, body in results:
        if status == 503:
            assert headers["Retry-After"] == "2"
            assert headers[REASON_HEADER_NAME] == "queue-full"
            assert headers["Content-Length"] == str(len(body))
            assert body == b"503 Service Unavailable: queue-full\n"
    # The app ran exactly for the admitted ones.
    assert len(app.paths) == 6
    stats = middleware.stats()
    assert (stats["started"], stats["rejected_full"], stats["responses_503"]) == (6, 6, 6)
    assert (stats["peak_in_flight"], stats["peak_queued"]) == (2, 4)
    wait_until(lambda: middleware.stats()["in_flight"] == 0, "every slot to be released")


def test_short_budget_behind_a_long_request_expires_in_queue(serve):
    app = GatedApp()
    middleware = AdmissionMiddleware(app, max_concurrency=1, max_queue=4, default_budget_ms=20_000)
    port = serve(middleware)
    with ThreadPoolExecutor(max_workers=1) as clients:
        try:
            long_request = clients.submit(get, port, "/long")
            wait_until(lambda: app.paths == ["/long"], "the long request to start")
            started = time.monotonic()
            status, headers, body = get(port, "/quick", [(BUDGET_HEADER, "50")])
            waited = time.monotonic() - started
        finally:
            app.gate.set()
        assert long_request.result()[0] == 200

    assert status == 504
    assert headers[REASON_HEADER_NAME] == "expired-in-queue"
    assert "Retry-After" not in headers
    assert body == b"504 Gateway Timeout: expired-in-queue\n"
    assert waited >= 0.04
    assert "/quick" not in app.paths
    stats = middleware.stats()
    assert (stats["expired_in_queue"], stats["responses_504"]) == (1, 1)


MALFORMED = [
    (BUDGET_HEADER, "banana"),
    (BUDGET_HEADER, "nan"),
    (BUDGET_HEADER, "inf"),
    (BUDGET_HEADER, "-inf"),
    (BUDGET_HEADER, "1e309"),
    (BUDGET_HEADER, ""),
    (BUDGET_HEADER, "99999999999999999999999999"),
    (BUDGET_HEADER, "250ms"),
    (BUDGET_HEADER, "0x10"),
    (BUDGET_HEADER, "junk, nan"),  # a comma list with no valid element
    (BUDGET_HEADER, "\u0661\u0662".encode()),  # Arabic-Indic digits, sent as UTF-8 bytes
    (BUDGET_HEADER, b"\xff\xfe"),
    (GRPC_TIMEOUT_HEADER, "1h"),
    (GRPC_TIMEOUT_HEADER, "123456789S"),
    (GRPC_TIMEOUT_HEADER, "-1S"),
    ("x-envoy-expected-rq-timeout-ms", "1.5"),
]


def test_malformed_budget_headers_never_500_nor_extend(serve):
    app = GatedApp(fast={"/"})
    middleware = AdmissionMiddleware(app, max_concurrency=2, max_queue=2, default_budget_ms=1000)
    port = serve(middleware)
    for name, value in MALFORMED:
        status, _, body = get(port, "/", [(name, value)])
        assert (status, body) == (200, b"done /"), (name, value)
    assert middleware.stats()["invalid_budget_header"] == len(MALFORMED)
    # A header sent twice is joined by the server ("1000, 200"): the smaller
    # counts, so the duplicate never falls back to a longer default.
    status, _, _ = get(port, "/", [(BUDGET_HEADER, "1000"), (BUDGET_HEADER, "200")])
    assert status == 200
    assert 0 < app.remaining_ms[-1] <= 200
    assert middleware.stats()["invalid_budget_header"] == len(MALFORMED)
    # A valid "no time left" is a 504 without running the app.
    runs = len(app.paths)
    status, headers, _ = get(port, "/", [(BUDGET_HEADER, "0")])
    assert (status, headers[REASON_HEADER_NAME]) == (504, "expired-on-arrival")
    assert len(app.paths) == runs


# -- load_report="text"|"json": every response it lets through carries endpoint-load-metrics, its refusals too --


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
        status, headers, _ = get(port, path)
        assert status == 200
        assert parse(headers["endpoint-load-metrics"])["named_metrics.queue"] == 0, path
        assert len(headers.get_all("endpoint-load-metrics")) == 1
    assert app.headers == [("Content-Type", "text/plain")]
    # One request holds the only place: the next is refused 503 queue-full, with the report.
    holder = threading.Thread(target=get, args=(port, "/hold"), daemon=True)
    holder.start()
    try:
        assert app.started.wait(WAIT_S)
        status, headers, _ = get(port, "/")
        assert (status, headers["X-Prazo-Reason"]) == (503, "queue-full")
        parse(headers["endpoint-load-metrics"])
    finally:
        app.gate.set()
        holder.join(WAIT_S)
    status, headers, _ = get(port, "/", [(BUDGET_HEADER, "0")])
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
            assert get(port, "/", [(BUDGET_HEADER, "0")])[0] == 504

        def report() -> dict[str, float]:
            status, headers, _ = get(port, "/")
            assert status == 200
            return parse(headers["endpoint-load-metrics"])

        # The held request and the asking one fill both places; the report is renewed once a second.
        wait_until(lambda: report().get("application_utilization") == 1.0, "the report of a full line")
        wait_until(lambda: report().get("eps", 0) > 0, "refusals in a later report")
    finally:
        app.gate.set()
        holder.join(WAIT_S)
    assert middleware.load_report is not None


@pytest.mark.parametrize("fast_path", [None, False], ids=["default-path", "python-path"])
def test_off_by_default_no_response_carries_it(serve: Callable[[Any], int], fast_path: bool | None) -> None:
    middleware = AdmissionMiddleware(HeldApp(), max_concurrency=1, max_queue=0, fast_path=fast_path)
    assert middleware.load_report is None
    port = serve(middleware)
    for path, headers in (("/", ()), ("/stream", ()), ("/", [(BUDGET_HEADER, "0")])):
        _, got, _ = get(port, path, headers)
        assert "endpoint-load-metrics" not in got


def test_a_wrong_value_names_the_argument() -> None:
    with pytest.raises(ValueError, match="load_report"):
        AdmissionMiddleware(HeldApp(), max_concurrency=1, max_queue=0, load_report="orca")
    with pytest.raises(TypeError, match="load_report"):
        AdmissionMiddleware(HeldApp(), max_concurrency=1, max_queue=0, load_report=True)  # type: ignore[arg-type]


# -- observe-only: every request runs, the counters say what would have been refused ----------------


def test_observe_only_runs_the_whole_burst_and_counts_what_it_would_have_refused(serve):
    app = GatedApp()
    middleware = AdmissionMiddleware(
        app, max_concurrency=2, max_queue=4, default_budget_ms=20_000, retry_after_s=2, observe_only=True
    )
    assert (middleware.observe_only, middleware.fast_path) == (True, False)
    port = serve(middleware)
    with ThreadPoolExecutor(max_workers=12) as clients:
        try:
            futures = [clients.submit(get, port, f"/burst/{index}") for index in range(12)]
            # Every one of the 12 runs the app at once: nothing waits for a place.
            wait_until(lambda: len(app.paths) == 12, "all 12 requests to run the app")
            # The same 12 against an enforcing middleware (test_burst_is_bounded_...): 2 run, 4 wait, 6 refused.
            wait_until(lambda: middleware.stats()["offered"] == 12, "the shadow to decide all 12")
            stats = middleware.stats()
            assert (stats["started"], stats["queued"], stats["rejected_full"]) == (2, 4, 6)
        finally:
            app.gate.set()
        results = [future.result() for future in futures]
    assert sorted(status for status, _, _ in results) == [200] * 12
    wait_until(lambda: middleware.stats()["completed"] == 6, "the shadow's six admitted to end")
    stats = middleware.stats()
    assert (stats["responses_503"], stats["responses_504"]) == (0, 0), "nothing was refused for real"
    assert (stats["peak_in_flight"], stats["peak_queued"]) == (2, 4)


def test_observe_only_counts_an_expiry_in_line_and_still_runs_the_request(serve):
    app = GatedApp()
    middleware = AdmissionMiddleware(app, max_concurrency=1, max_queue=4, default_budget_ms=20_000, observe_only=True)
    port = serve(middleware)
    with ThreadPoolExecutor(max_workers=2) as clients:
        try:
            holder = clients.submit(get, port, "/long")
            wait_until(lambda: app.paths == ["/long"], "the long request to run")
            short = clients.submit(get, port, "/short", [(BUDGET_HEADER, "100")])
            wait_until(lambda: len(app.paths) == 2, "the short request to run too")
            # Enforcing, it would have waited behind /long and expired in line at its 100 ms.
            wait_until(lambda: middleware.stats()["expired_in_queue"] == 1, "the shadow to see the expiry")
        finally:
            app.gate.set()
        assert (holder.result()[0], short.result()[0]) == (200, 200)


def test_observe_only_cannot_insist_on_the_compiled_path():
    with pytest.raises(ValueError, match="observe_only"):
        AdmissionMiddleware(GatedApp(), max_concurrency=1, max_queue=0, fast_path=True, observe_only=True)
    with pytest.raises(TypeError, match="observe_only"):
        AdmissionMiddleware(GatedApp(), max_concurrency=1, max_queue=0, observe_only="yes")
