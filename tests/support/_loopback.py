"""A real HTTP server on 127.0.0.1 for client tests: echoes the budget, can be slow or overloaded.

``LoopbackServer`` runs the stdlib ``ThreadingHTTPServer`` on port 0 in a
thread. Every request (any method, any path) is recorded and answered from its
query string:

``?sleep=S``       wait S seconds before answering (cut short when the server stops)
``?status=N``      answer with status N
``?retry_after=S`` add ``Retry-After: S``
``?redirect=PATH`` answer ``302`` to PATH on the same server
``?fail=N``        only the first N requests for this exact path and query get
                   ``status`` (503 unless given) and ``Retry-After``; later ones 200
``?reason=R``      add ``X-Prazo-Reason: R`` to a non-200 answer

The JSON body echoes what arrived: ``{"budget_ms": "980" or null,
"grpc_timeout": ... or null, "path": ...}``::

    with LoopbackServer() as server:
        requests.get(server.url("/echo?sleep=0.1"))
        assert server.count == 1
        assert server.requests[0].budget_ms is None
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only

BUDGET_HEADER = "X-Request-Budget-Ms"
GRPC_TIMEOUT_HEADER = "grpc-timeout"

# No handler ever sleeps longer than this, whatever a test asks for.
MAX_SLEEP_S = 30.0


@dataclass(frozen=True)
class Received:
    """One request as the server saw it."""

    method: str
    path: str
    budget_ms: str | None
    grpc_timeout: str | None
    # Every header field as it arrived, repeated ones included.
    headers: tuple[tuple[str, str], ...] = ()

    def values(self, name: str) -> list[str]:
        """Every value of the header ``name`` (any letter case), in arrival order."""
        return [value for key, value in self.headers if key.lower() == name.lower()]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    stopping: threading.Event
    received: list[Received]
    lock: threading.Lock
    seen: dict[str, int]

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (the point of most tests) makes the handler
        # write to a closed socket; that is expected, not a failure.
        pass


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        split = urlsplit(self.path)
        query = {key: values[0] for key, values in parse_qs(split.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        received = Received(
            self.command,
            split.path,
            self.headers.get(BUDGET_HEADER),
            self.headers.get(GRPC_TIMEOUT_HEADER),
            tuple(self.headers.items()),
        )
        with self.server.lock:
            self.server.received.append(received)
            seen = self.server.seen[self.path] = self.server.seen.get(self.path, 0) + 1
        if "sleep" in query:
            self.server.stopping.wait(min(float(query["sleep"]), MAX_SLEEP_S))
        status = int(query.get("status", "503" if "fail" in query else "200"))
        failing = "fail" not in query or seen <= int(query["fail"])
        if not failing:
            status = 200
        extra_headers = {}
        if "reason" in query and status != 200:
            extra_headers["X-Prazo-Reason"] = query["reason"]
        if "redirect" in query:
            status = 302
            extra_headers["Location"] = query["redirect"]
        if "retry_after" in query and failing:
            extra_headers["Retry-After"] = query["retry_after"]
        body = json.dumps(
            {"budget_ms": received.budget_ms, "grpc_timeout": received.grpc_timeout, "path": received.path}
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra_headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LoopbackServer:
    """The test server (see the module docstring); a context manager that always stops it."""

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.stopping = threading.Event()
        self._server.received = []
        self._server.lock = threading.Lock()
        self._server.seen = {}
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def requests(self) -> list[Received]:
        with self._server.lock:
            return list(self._server.received)

    @property
    def count(self) -> int:
        with self._server.lock:
            return len(self._server.received)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
