"""What the server-embedding tests share: one test app, real clients, each server started alike.

The app (``app``) is also what the gunicorn subprocess serves
(``_server_harness:app``), so every server runs exactly the same code:

``/work?ms=M&mark=PATH&gate=PATH``
    creates ``mark`` (the test learns the app is running), waits until
    ``gate`` exists (the test releases it), sleeps ``M`` ms and answers 200
    with the remaining budget; every wait is bounded.
``/calls``
    how many times ``/work`` ran the app, as a decimal body.
``/healthz``
    ``ok``: a health check (the policy tests make its path critical).
``/server-stats``
    the counters of the server's line as JSON (``prazo.server_stats``).
``/echo``
    the request's body, read whole, as the answer's body.
``/budget-header``
    what reached the app: ``HTTP_X_REQUEST_BUDGET_MS`` from its environ (or
    ``-``) and the remaining budget, as ``header=V remaining_ms=M``.

Every server is started through ``start_server(kind, ...)`` and stopped
gracefully with ``RunningServer.stop()``; clients use ``http.client`` and raw
sockets on 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

# The folder of the harness and the apps that subprocesses load by name
# (``_server_harness:app``, ``_multiprocess_app:app``): tests/support, put on a
# subprocess's PYTHONPATH or made its working directory.
TESTS_DIR = Path(__file__).resolve().parent
# gunicorn runs in another process, so its queue cannot be watched: a pause
# far longer than a worker needs to finish a task after sending its answer.
_GUNICORN_SETTLE_S = 0.2

SERVER_KINDS = ("waitress", "werkzeug", "wsgiref", "cheroot", "gunicorn")
# The embeddings that read request heads themselves (waitress's I/O thread does it for it).
SOCKET_KINDS = tuple(kind for kind in SERVER_KINDS if kind != "waitress")

# Bounds of every wait in the app and the clients: far above anything a
# healthy run needs on a loaded 2-core machine, far below the suite's budget.
APP_WAIT_S = 15.0
CLIENT_TIMEOUT_S = 20.0
# The budget a request without a budget header gets from a test server: it
# outlives every test, so a request held in line while a loaded machine is slow
# never expires by accident. A test about expiry sends its budget in a header.
TEST_DEFAULT_BUDGET_MS = 30000

_calls_lock = threading.Lock()
_calls = 0


def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not predicate() and time.monotonic() < end:
        time.sleep(0.002)


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    """The one test application (see the module docstring)."""
    global _calls
    path = environ.get("PATH_INFO", "")
    if path == "/calls":
        with _calls_lock:
            body = str(_calls).encode()
    elif path == "/healthz":
        body = b"ok"
    elif path == "/server-stats":  # the counters of the server's line, as its app sees them
        body = json.dumps(environ["prazo.server_stats"]()).encode()
    elif path == "/echo":
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    elif path == "/budget-header":
        deadline = environ["prazo.deadline"]
        header = environ.get("HTTP_X_REQUEST_BUDGET_MS", "-")
        body = f"header={header} remaining_ms={deadline.remaining_ms():.0f}".encode("latin-1")
    elif path == "/work":
        query = {key: values[0] for key, values in parse_qs(environ.get("QUERY_STRING", "")).items()}
        with _calls_lock:
            _calls += 1
        length = int(environ.get("CONTENT_LENGTH") or 0)
        if length:
            environ["wsgi.input"].read(length)
        if "mark" in query:
            Path(query["mark"]).touch()
        if "gate" in query:
            _wait_for(lambda: os.path.exists(query["gate"]), APP_WAIT_S)
        time.sleep(int(query.get("ms", "0")) / 1000)
        deadline = environ.get("prazo.deadline")
        body = b"no deadline" if deadline is None else f"remaining_ms={deadline.remaining_ms():.0f}".encode()
    else:
        start_response("404 Not Found", [("Content-Length", "0")])
        return []
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


@dataclass
class Outcome:
    """What one client saw."""

    status: int
    reason: str | None
    body: bytes
    elapsed_s: float
    connection: str | None = None


def request(
    port: int, path: str, headers: dict[str, str] | None = None, method: str = "GET", body: bytes = b""
) -> Outcome:
    """One request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    try:
        start = time.monotonic()
        conn.request(method, path, body=body or None, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
        return Outcome(
            response.status,
            response.getheader("X-Prazo-Reason"),
            data,
            time.monotonic() - start,
            response.getheader("Connection"),
        )
    finally:
        conn.close()


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset ends it too; a hang fails on the socket's timeout)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def exchange(port: int, data: bytes) -> bytes:
    """Send raw ``data`` on a fresh connection and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(data)
        return read_to_eof(sock)


class FrontDoors:
    """Front-door servers of one test, started with ``defaults`` (a call's own options win), all shut down at the end.

    ``with FrontDoors(threads=4, max_queue=20) as start: server = start(my_app)``;
    requests without a budget header get ``TEST_DEFAULT_BUDGET_MS`` unless the
    options say otherwise (or pass a ``settings`` object, which holds its own).
    """

    def __init__(self, **defaults: Any) -> None:
        self.defaults = defaults
        self.started: list[Any] = []

    def __call__(self, application: Any = app, **options: Any) -> Any:
        from prazo.bindings.servers.frontdoor import create_server

        options = {**self.defaults, **options}
        if "settings" not in options:
            options.setdefault("default_budget_ms", TEST_DEFAULT_BUDGET_MS)
        server = create_server(application, port=0, **options)
        server.start()
        self.started.append(server)
        return server

    def __enter__(self) -> FrontDoors:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for server in self.started:
            server.shutdown(5.0)


class Burst:
    """``n`` clients that connect first and then send at once, each on its own connection.

    ``outcomes`` fills in as responses arrive; ``wait(count)`` waits for that
    many. Connecting first means every request reaches the server within a
    few milliseconds, whatever the machine's load.
    """

    def __init__(self, port: int, paths: Iterable[str], headers: dict[str, str] | None = None) -> None:
        self.outcomes: list[Outcome] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._paths = list(paths)
        self._connected = threading.Barrier(len(self._paths) + 1)
        self._threads = [
            threading.Thread(target=self._client, args=(port, path, headers or {}), daemon=True) for path in self._paths
        ]
        for thread in self._threads:
            thread.start()
        self._connected.wait(CLIENT_TIMEOUT_S)

    def _client(self, port: int, path: str, headers: dict[str, str]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
        try:
            conn.connect()
            self._connected.wait(CLIENT_TIMEOUT_S)
            start = time.monotonic()
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            data = response.read()
            outcome = Outcome(response.status, response.getheader("X-Prazo-Reason"), data, time.monotonic() - start)
            with self._lock:
                self.outcomes.append(outcome)
        except BaseException as exc:  # noqa: BLE001 - the test asserts there were none
            with self._lock:
                self.errors.append(exc)
        finally:
            conn.close()

    def wait(self, count: int, timeout: float = CLIENT_TIMEOUT_S) -> list[Outcome]:
        _wait_for(lambda: len(self.outcomes) + len(self.errors) >= count, timeout)
        with self._lock:
            return list(self.outcomes)

    def join(self) -> list[Outcome]:
        for thread in self._threads:
            thread.join(CLIENT_TIMEOUT_S)
        assert not self.errors, self.errors
        return list(self.outcomes)


def statuses(outcomes: Iterable[Outcome]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    return counts


class RunningServer:
    """One server on 127.0.0.1 serving ``app``; ``stop()`` shuts it down gracefully."""

    def __init__(
        self,
        kind: str,
        port: int,
        stop: Callable[[], Any],
        thread: threading.Thread | None = None,
        stats: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.kind = kind
        self.port = port
        self._stop = stop
        self._thread = thread
        # The queue's counters when the server runs in this process (None for gunicorn).
        self.stats = stats
        self.stopped = False

    def wait_offered(self, count: int) -> None:
        """Wait until the queue has seen ``count`` arrivals (gunicorn: a generous pause instead)."""
        if self.stats is None:
            time.sleep(1.0)
            return
        stats = self.stats
        _wait_for(lambda: stats()["offered"] >= count, CLIENT_TIMEOUT_S)
        assert stats()["offered"] >= count, stats()

    def calls(self) -> int:
        calls = int(request(self.port, "/calls").body)
        self.settle()
        return calls

    def settle(self) -> None:
        """Wait until the slot of the last answered request is free again.

        A server frees a slot a moment after its answer reached the client, so
        a test counting exact refusals right after a request would race it.
        """
        if self.stats is None:
            time.sleep(_GUNICORN_SETTLE_S)
            return
        stats = self.stats
        _wait_for(lambda: stats()["in_flight"] == 0, CLIENT_TIMEOUT_S)

    def stop(self, *how: Any) -> Any:
        """Graceful shutdown (gunicorn: ``how`` may name another signal); returns what the shutdown returned."""
        result = self._stop(*how)
        if self._thread is not None:
            self._thread.join(CLIENT_TIMEOUT_S)
            assert not self._thread.is_alive(), f"{self.kind} did not stop"
        self.stopped = True
        return result


class Trickler:
    """A slow-loris client: a request head that never ends, one byte every ``interval_s``.

    It sends the start of a head and then one header byte at a time, and
    watches between bytes for the server's answer. ``answer`` is what the
    server sent before closing (``b""`` when it closed without one), and
    ``ended_after_s`` how long after the first byte that happened; both stay
    None while the server keeps reading. It gives up after ``max_s``.
    """

    def __init__(self, port: int, interval_s: float = 0.5, max_s: float = CLIENT_TIMEOUT_S) -> None:
        self.answer: bytes | None = None
        self.ended_after_s: float | None = None
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S)
        self._interval_s = interval_s
        self._max_s = max_s
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trickler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        try:
            self._sock.sendall(b"GET /work HTTP/1.1\r\nHost: test\r\nX-Slow: ")
            self.started.set()
            while time.monotonic() - start < self._max_s:
                readable, _, _ = select.select([self._sock], [], [], self._interval_s)
                if readable:
                    self._read_answer()
                    break
                self._sock.sendall(b"a")
        except OSError:
            self.answer = b""  # reset while sending: closed without an answer
        finally:
            self.started.set()
            if self.answer is not None:
                self.ended_after_s = time.monotonic() - start
            self._sock.close()

    def _read_answer(self) -> None:
        received = b""
        try:
            while chunk := self._sock.recv(65536):
                received += chunk
        except OSError:
            pass  # a reset after the answer: what was read still counts
        self.answer = received

    def join(self) -> None:
        self._thread.join(self._max_s + CLIENT_TIMEOUT_S)
        assert not self._thread.is_alive()


def run_waitress_until(server: Any, stop_requested: threading.Event) -> threading.Thread:
    """Run ``server.run()`` in a thread whose I/O loop ends with SystemExit once ``stop_requested`` is set.

    That is how Ctrl-C (or SIGTERM under ``prazo serve``) ends ``run()``: the
    loop is turned one iteration at a time so the test decides the moment.
    """

    def run() -> None:
        original_loop = server.asyncore.loop

        def loop(*args: object, **kwargs: object) -> None:
            kwargs["count"] = 1
            while not stop_requested.is_set():
                original_loop(*args, **kwargs)
            raise SystemExit

        server.asyncore = type("Shim", (), {"loop": staticmethod(loop)})
        server.run()

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    return runner


def connection_refused(port: int) -> bool:
    """True when a new connection to ``port`` is refused; a connection that opens is closed unused.

    A connection caught in the listen backlog as the listening socket closes
    is reset instead: False, as the next one will tell.
    """
    try:
        socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        pass
    return False


def _in_thread(target: Callable[[], Any], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def start_server(
    kind: str,
    *,
    threads: int,
    max_queue: int,
    default_budget_ms: float = TEST_DEFAULT_BUDGET_MS,
    max_budget_ms: float = 30000,
    header_timeout_ms: float | None = None,
    policies: dict[str, Any] | None = None,
) -> RunningServer:
    """Start server ``kind`` (one of ``SERVER_KINDS``) with prazo's admission serving ``app``.

    ``header_timeout_ms`` applies to the socket-level servers only (waitress
    reads heads in its I/O thread and has no such setting). ``policies`` are
    queue-policy options of ``resolve_settings`` (``order``, ``reserved``, ...).
    """
    limits: dict[str, Any] = {
        "threads": threads,
        "max_queue": max_queue,
        "default_budget_ms": default_budget_ms,
        "max_budget_ms": max_budget_ms,
    }
    if header_timeout_ms is not None:
        limits["header_timeout_ms"] = header_timeout_ms
    if kind == "gunicorn":
        return start_gunicorn(**limits, policies=policies)
    if policies:
        from prazo.bindings.servers.settings import resolve_settings

        limits = {"settings": resolve_settings(**limits, **policies)}
    if kind == "waitress":
        from prazo.bindings.servers import waitress as prazo_waitress

        server = prazo_waitress.create_server(app, host="127.0.0.1", port=0, **limits)
        thread = _in_thread(server.run, "waitress-io")
        stop = lambda: prazo_waitress.shutdown(server, 10.0)
        return RunningServer(kind, server.effective_port, stop, thread, server.task_dispatcher.stats)
    if kind in ("werkzeug", "wsgiref"):
        if kind == "werkzeug":
            from prazo.bindings.servers.werkzeug import make_server
        else:
            from prazo.bindings.servers.wsgiref import WSGIRequestHandler, make_server

            class QuietHandler(WSGIRequestHandler):
                def log_message(self, *args: Any) -> None:
                    pass

        extra = {} if kind == "werkzeug" else {"handler_class": QuietHandler}
        server = make_server("127.0.0.1", 0, app, **limits, **extra)
        server.shutdown_timeout = 10.0
        # A 50 ms poll (the default is 0.5 s): every stop waits out one poll.
        thread = _in_thread(lambda: server.serve_forever(poll_interval=0.05), f"{kind}-accept")
        return RunningServer(kind, server.server_address[1], server.shutdown, thread, server.stats)
    if kind == "cheroot":
        from prazo.bindings.servers.cheroot import create_server

        server = create_server(app, ("127.0.0.1", 0), shutdown_timeout=10, **limits)
        server.prepare()
        thread = _in_thread(server.serve, "cheroot-serve")
        return RunningServer(kind, server.bind_addr[1], server.stop, thread, server.requests.stats)
    if kind == "gunicorn":
        return start_gunicorn(**limits)
    raise ValueError(f"kind must be one of {SERVER_KINDS}, got {kind!r}")


def start_gunicorn(
    threads: int,
    max_queue: int,
    default_budget_ms: float = TEST_DEFAULT_BUDGET_MS,
    max_budget_ms: float = 30000,
    header_timeout_ms: float | None = None,
    *,
    workers: int = 1,
    app_spec: str = "_server_harness:app",
    extra_env: dict[str, str] | None = None,
    policies: dict[str, Any] | None = None,
) -> RunningServer:
    """``gunicorn -w workers`` with prazo's worker serving ``app_spec`` (a module in tests/support/), started and probed."""
    env = dict(os.environ)
    for name, value in (policies or {}).items():
        env["PRAZO_" + name.upper()] = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
    env.update(
        PRAZO_MAX_QUEUE=str(max_queue),
        PRAZO_DEFAULT_BUDGET_MS=str(default_budget_ms),
        PRAZO_MAX_BUDGET_MS=str(max_budget_ms),
        PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")])),
    )
    if header_timeout_ms is not None:
        env["PRAZO_HEADER_TIMEOUT_MS"] = str(header_timeout_ms)
    env.update(extra_env or {})
    command = [
        sys.executable, "-m", "gunicorn",
        "-k", "prazo.bindings.servers.gunicorn.AdmissionWorker",
        "--threads", str(threads), "--workers", str(workers),
        "--bind", "127.0.0.1:0", "--graceful-timeout", "10", "--keep-alive", "5",
        "--no-control-socket", "--error-logfile", "-", "--log-level", "info",
        app_spec,
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    booted = threading.Event()
    found: dict[str, int] = {}

    def read_log() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            log.append(line)
            match = re.search(r"Listening at: http://127\.0\.0\.1:(\d+)", line)
            if match:
                found["port"] = int(match.group(1))
            if "Booting worker" in line:
                booted.set()

    threading.Thread(target=read_log, daemon=True).start()
    if not booted.wait(CLIENT_TIMEOUT_S) or "port" not in found:
        process.kill()
        raise AssertionError("gunicorn did not start:\n" + "".join(log))
    port = found["port"]
    # The worker has booted when its first request is answered.
    end = time.monotonic() + CLIENT_TIMEOUT_S
    while True:
        try:
            if request(port, "/calls").status == 200:
                break
        except OSError:
            if time.monotonic() > end or process.poll() is not None:
                process.kill()
                raise AssertionError("gunicorn never answered:\n" + "".join(log)) from None
            time.sleep(0.05)

    def stop(sig: signal.Signals = signal.SIGTERM) -> int:
        if process.poll() is None:
            process.send_signal(sig)
        try:
            return process.wait(CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError("gunicorn did not stop:\n" + "".join(log)) from None

    server = RunningServer("gunicorn", port, stop)
    server.settle()  # the start-up probe's slot
    server.log = log  # type: ignore[attr-defined]
    server.process = process  # type: ignore[attr-defined]
    return server
