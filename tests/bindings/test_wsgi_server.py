"""AdmissionMiddleware on werkzeug's threaded server, with real HTTP on loopback."""

from __future__ import annotations

import http.client
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
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
