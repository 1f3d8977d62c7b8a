"""prazo's own server, the front door: triage in C, without the GIL; only admitted requests reach Python.

Every Python server reads and parses requests in Python, so under a CPU-bound
app its I/O loop waits for the GIL and requests wait in the kernel's listen
backlog, where nothing can refuse or expire them. Here one C thread (started
from ``prazo.bindings.servers._frontdoor_c``, it never takes the GIL) owns the
listening socket and an epoll loop: it accepts, reads each request head under
the header timeout (408 on expiry), stamps its arrival with the kernel's
receive time of its first bytes (``SO_TIMESTAMPNS``; the read time when the
kernel gives none), parses it with the vendored picohttpparser (400 for what
it rejects or what is ambiguous: Content-Length with Transfer-Encoding,
differing Content-Lengths, a Transfer-Encoding other than ``chunked``, line
folding), reads the budget headers with the rules of ``prazo.bindings.headers``
and decides: at most ``threads`` requests run and ``max_queue`` wait; a full
line is answered ``503 queue-full`` at once, an expired deadline ``504
expired-on-arrival``, and a request still waiting at its deadline ``504
expired-in-queue`` at that moment — all written by the C thread::

    from prazo.bindings.servers.frontdoor import create_server

    server = create_server(app, host="0.0.0.0", port=8080, threads=4, max_queue=16)
    server.serve_forever()          # server.shutdown(timeout=5.0) from another thread

``threads`` Python workers wait (GIL released) for the next admitted
connection, run the app inside ``deadline_scope`` with a PEP 3333 environ
(``wsgi.input`` streams Content-Length and chunked bodies; ``prazo.deadline``,
``prazo.queue_wait_ms``, ``prazo.budget_source``, ``prazo.server_stats``),
write the response themselves (chunked when HTTP/1.1 and no Content-Length),
and hand a kept-alive connection back to the C thread, so its next request is
triaged too. Every wait on the client is bounded: a body read by the request's
deadline (``wsgi.input`` raises ``RequestBodyError``; 408 or 400 if the app
lets it out), a response write by the deadline, or the response's start if
later, plus ``write_grace_ms``, all of a request's waits together by
``max_io_wait_ms``, and each by ``io_timeout_ms`` without progress.
Shutdown: the listening socket closes (new connections are refused),
admitted requests — running and waiting — finish within the timeout, a
request arriving on an open connection meanwhile gets ``503 shutting-down``,
and what still waits at the end gets ``503 shutting-down``.
Linux only (epoll); TLS is not supported (terminate it in front). With
``trust_request_start`` the C thread also reads ``X-Request-Start`` /
``X-Queue-Start`` (the formats and rules of ``prazo.bindings.proxy_headers``)
from peers in ``trusted_proxies`` and takes the time the request queued in
that proxy (at most ``max_upstream_ms``) off its deadline as it parses the
head: a budget used up in the proxy is answered ``504 expired-on-arrival``
by the C thread, and the line expires and orders by the corrected deadline.

The queue policies of ``AdmissionQueue`` (docs/design.md) run in the same C
thread and in the workers' pickup, with the same semantics and reasons:
``expected_service_ms`` (a fixed number of ms, or ``"p50"``/``"p90"``/
``"p95"``/``"p99"`` learned from the engine's own service times) answers a
request whose remaining budget is smaller ``504 insufficient-budget``, on
arrival or when it would start; ``order="lifo"`` or ``"adaptive"`` (LIFO while
the line stands, and CoDel sheds stale waiters ``503 shed-standing-queue``);
``limit="vegas"`` moves the concurrency limit between ``min_concurrency`` and
``threads`` (the workers above the limit stay parked); ``reserved`` places
are kept for critical requests (``critical_paths``, or ``critical_header``
saying ``critical``), which are served first and push the newest normal
waiter out (``503 evicted-by-critical``) rather than be refused::

    server = create_server(app, threads=8, order="adaptive", expected_service_ms="p95",
                           limit="vegas", min_concurrency=2, reserved=1, critical_paths=["/healthz"])

Why one file of about 800 lines: this is the whole Python half of the front
door - option checking, the workers' environ and body stream, the response
writer, the server's life cycle - and each part is small but reads the same
engine handle; the C half is split along its concerns in ``_frontdoor/``.
"""

from __future__ import annotations

import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote_to_bytes

from prazo.core import (
    DEFAULT_CODEL_INTERVAL_MS,
    DEFAULT_CODEL_TARGET_MS,
    NS_PER_MS,
    REASON_EVICTED,
    REASON_INSUFFICIENT_BUDGET,
    REASON_SHED,
    Deadline,
    DeadlineExceeded,
    QueueFull,
    ShutDown,
    codel_option_ns,
    expected_service_option,
)

from ..headers import is_ambiguous_header_name
from ..policies import LIMITS, ORDERS, POLICY_DEFAULTS, checked_choice, checked_header_name, checked_paths
from ..proxy_headers import trusted_networks
from ..wsgi import BUDGET_SOURCE_KEY, WSGIApp, run_admitted
from .dispatcher import SERVER_STATS_KEY
from .heads import MAX_HEAD_BYTES
from .refusals import (
    BAD_REQUEST_ANSWER,
    DEFAULT_LINGER_S,
    DEFAULT_MAX_DRAIN_BYTES,
    DEFAULT_MAX_LINGERING,
    HEAD_TOO_LARGE_ANSWER,
    HEADER_TIMEOUT_ANSWER,
    REASON_BAD_REQUEST,
    REASON_HEAD_TOO_LARGE,
    REASON_HEADER_TIMEOUT,
    rejection_bytes,
    status_answer,
)
from .settings import ServerSettings, checked_count, resolve_settings

__all__ = [
    "DEFAULT_IO_TIMEOUT_MS",
    "DEFAULT_MAX_IO_WAIT_MS",
    "DEFAULT_WRITE_GRACE_MS",
    "POLICY_DEFAULTS",
    "FrontDoorServer",
    "RequestBodyError",
    "canned_answers",
    "compiled_engine",
    "create_server",
]

_log = logging.getLogger("prazo.servers.frontdoor")

# A worker's body read or response write that makes no progress this long fails
# (the client stalled); the worker is then free again.
DEFAULT_IO_TIMEOUT_MS = 30000.0
# A body read never waits past the request's deadline. A response write may wait
# this much longer (from the deadline, or from when the response began if that
# was later): an answer already computed is worth handing to a slow reader for
# a while, not for as long as it keeps reading.
DEFAULT_WRITE_GRACE_MS = 10000.0
# All of one request's waits on its client (body reads and response writes)
# together never exceed this, whatever its budget.
DEFAULT_MAX_IO_WAIT_MS = 60000.0
_READ_CHUNK = 65536
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                         "proxy-authenticate", "proxy-authorization"})  # fmt: skip
_NO_BODY_STATUS = ("1", "204", "304")
_INTERNAL_ERROR = status_answer("500 Internal Server Error", "internal-error")
_BODY_TIMEOUT = status_answer("408 Request Timeout", "body-timeout")
# What the app's start_response may hand over, or it is a 500 (RFC 9110/9112):
# a status is three digits, a space and a reason of HTAB, SP, VCHAR or obs-text;
# a header name is a token; a value holds no control character but HTAB. A CR
# or LF anywhere would end the line early and let the app's (or its client's)
# text become headers of its own.
_STATUS = re.compile(r"[0-9]{3} [\t\x20-\x7e\x80-\xff]*")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
# Status lines (str) and header fields ((str, str) tuples) that passed those
# checks: an app sends the same few on every response, and two regular
# expressions a field were 7 % of the instructions of a small answer. Exact
# str and tuple only (a subclass could compare equal to a checked one).
_CHECKED: set[object] = set()
_CHECKED_MAX = 1024


def _checked(item: object) -> None:
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED.add(item)


class RequestBodyError(OSError):
    """What ``wsgi.input`` raises when the request body failed; ``failure`` says how.

    ``"malformed"``: a broken chunked encoding; ``"lost"``: the client closed
    or reset before the body ended; ``"timeout"``: the body stalled for the
    I/O timeout, or the request's deadline came before it ended. If the app
    lets it out before its response began, the server answers 400
    (``bad-request``) or, for ``"timeout"``, 408 (``body-timeout``), and closes.
    """

    def __init__(self, failure: str) -> None:
        super().__init__(f"the request body failed: {failure}")
        self.failure = failure


def canned_answers() -> dict[str, tuple[bytes, bytes | None]]:
    """The front door's refusals as bytes, ``reason -> (close variant, keep-alive variant or None)``.

    The same statuses, headers and bodies as every embedding's refusals
    (``prazo.bindings.wsgi.rejection_response`` and ``refusals``).
    """
    refusals: dict[str, BaseException] = {
        "queue-full": QueueFull(),
        "expired-on-arrival": DeadlineExceeded("expired-on-arrival"),
        "expired-in-queue": DeadlineExceeded("expired-in-queue"),
        "shutting-down": ShutDown(),
        REASON_INSUFFICIENT_BUDGET: DeadlineExceeded(REASON_INSUFFICIENT_BUDGET),
        REASON_SHED: QueueFull(REASON_SHED),
        REASON_EVICTED: QueueFull(REASON_EVICTED),
    }
    answers: dict[str, tuple[bytes, bytes | None]] = {
        reason: (rejection_bytes(exc), rejection_bytes(exc, keep_alive=True)) for reason, exc in refusals.items()
    }
    answers[REASON_HEADER_TIMEOUT] = (HEADER_TIMEOUT_ANSWER, None)
    answers[REASON_BAD_REQUEST] = (BAD_REQUEST_ANSWER, None)
    answers[REASON_HEAD_TOO_LARGE] = (HEAD_TOO_LARGE_ANSWER, None)
    return answers


def engine_critical_paths(value: object) -> list[bytes]:
    """The ``critical_paths`` option as the engine takes it (latin-1 bytes, as PATH_INFO decodes), checked."""
    # The engine compares the raw request target's path: a space, a control
    # character or a query could never match one.
    paths = checked_paths(value, "critical_paths")
    for path in paths:
        if any(ch in path for ch in " \t\r\n\0?"):
            raise ValueError(f"a critical path has no spaces, controls or query, got {path!r}")
    return [path.encode("latin-1") for path in paths]


def _engine_policy_args(threads: int, options: dict[str, Any]) -> dict[str, Any]:
    """The engine's arguments for the queue-policy ``options`` (keys of ``POLICY_DEFAULTS``), checked.

    Wrong values raise ``ValueError``/``TypeError`` naming the option; the ms
    values are checked and converted by the core's own helpers, so the front
    door accepts exactly what ``AdmissionQueue`` accepts.
    """
    order = checked_choice(options["order"], "order", ORDERS)
    adaptive = order == "adaptive"
    fixed_ns, permille = expected_service_option(options["expected_service_ms"])
    limit = checked_choice(options["limit"], "limit", LIMITS)
    min_concurrency = checked_count(options["min_concurrency"], "min_concurrency", 1)
    if min_concurrency > threads:
        raise ValueError(f"min_concurrency must be <= threads ({threads}), got {min_concurrency}")
    reserved = checked_count(options["reserved"], "reserved", 0)
    if reserved >= threads:
        raise ValueError(f"reserved must be < threads ({threads}), got {reserved}")
    header = options["critical_header"]
    return {
        "order": order,
        "codel_target_ns": codel_option_ns(
            options["codel_target_ms"], "codel_target_ms", DEFAULT_CODEL_TARGET_MS, adaptive
        ),
        "codel_interval_ns": codel_option_ns(
            options["codel_interval_ms"], "codel_interval_ms", DEFAULT_CODEL_INTERVAL_MS, adaptive
        ),
        "expected_service_ns": fixed_ns,
        "expected_quantile_permille": permille,
        "vegas": limit == "vegas",
        "min_concurrency": min_concurrency,
        "reserved": reserved,
        "critical_header": None if header is None else checked_header_name(header, "critical_header").encode("ascii"),
        "critical_paths": engine_critical_paths(options["critical_paths"]),
    }


def compiled_engine() -> Any:
    """``prazo.bindings.servers._frontdoor_c``: the engine, and its C budget and head parsers (for tests)."""
    try:
        from . import _frontdoor_c
    except ImportError as exc:  # pragma: no cover - depends on the build
        raise RuntimeError(
            f"the front door needs its compiled engine prazo.bindings.servers._frontdoor_c ({exc}); "
            "rebuild with `make build` (it is not available with PRAZO_NO_EXTENSIONS=1)"
        ) from exc
    return _frontdoor_c


class _BodyInput:
    """``wsgi.input``: the request body, decoded (Content-Length or chunked), read on demand."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._buffer = b""
        self._eof = False

    def _read_body(self, size: int) -> bytes:
        try:
            data: bytes = self._conn.read_body(size)
        except OSError as exc:
            raise RequestBodyError(self._conn.body_failure) from exc
        return data

    def _fill(self, wanted: int) -> bool:
        if self._eof:
            return False
        data = self._read_body(max(wanted, _READ_CHUNK))
        if not data:
            self._eof = True
            return False
        self._buffer += data
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            parts = [self._buffer]
            while not self._eof:
                data = self._read_body(_READ_CHUNK)
                if not data:
                    self._eof = True
                parts.append(data)
            self._buffer = b""
            return b"".join(parts)
        while len(self._buffer) < size and self._fill(size - len(self._buffer)):
            pass
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def readline(self, size: int | None = -1) -> bytes:
        limit = -1 if size is None else size
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0 and (limit < 0 or end < limit):
                data, self._buffer = self._buffer[: end + 1], self._buffer[end + 1 :]
                return data
            if 0 <= limit <= len(self._buffer):
                data, self._buffer = self._buffer[:limit], self._buffer[limit:]
                return data
            if not self._fill(_READ_CHUNK):
                data, self._buffer = self._buffer, b""
                return data

    def readlines(self, hint: int = -1) -> list[bytes]:
        lines: list[bytes] = []
        total = 0
        while True:
            line = self.readline()
            if not line:
                return lines
            lines.append(line)
            total += len(line)
            if 0 < hint <= total:
                return lines

    def __iter__(self) -> _BodyInput:
        return self

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line


class _Response:
    """start_response, write() and the framing of one response."""

    def __init__(self, conn: Any, head_only: bool, may_keep_alive: bool) -> None:
        self.conn = conn
        self.head_only = head_only
        self.keep_alive = may_keep_alive
        self.status: str | None = None
        self.headers: list[tuple[str, str]] = []
        self.sent_headers = False
        self.chunked = False
        self.length: int | None = None
        self.sent = 0

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], None]:
        if exc_info is not None:
            try:
                if self.sent_headers:
                    raise exc_info[1].with_traceback(exc_info[2])
            finally:
                exc_info = None
        elif self.status is not None:
            raise AssertionError("start_response was already called")
        if not (type(status) is str and status in _CHECKED):
            if not isinstance(status, str) or not _STATUS.fullmatch(status):
                raise ValueError(f"bad status {status!r}: three digits, a space, a reason without control characters")
            if type(status) is str:
                _checked(status)
        for field in headers:
            if type(field) is tuple and field in _CHECKED:
                continue
            name, value = field
            if not isinstance(name, str) or not isinstance(value, str):
                raise TypeError("header names and values must be str")
            if not _TOKEN.fullmatch(name):
                raise ValueError(f"bad header name {name!r}: a token, without spaces, colons or control characters")
            if not _FIELD_VALUE.fullmatch(value):
                raise ValueError(f"bad value of header {name!r}: a control character or a line break")
            if type(field) is tuple and type(name) is str and type(value) is str:
                _checked(field)
        self.status = status
        self.headers = list(headers)
        return self.write

    def _head(self, whole_body: int | None) -> bytes:
        """The response head; ``whole_body`` is the body's length when all of it is known now."""
        assert self.status is not None
        lines = [f"HTTP/1.1 {self.status}", _date_line()]
        if self.status.startswith(_NO_BODY_STATUS):
            self.head_only = True  # 1xx, 204 and 304 never carry a body, whatever the app returns
        no_body = self.head_only
        for name, value in self.headers:
            lower = name.lower()
            if lower in _HOP_BY_HOP:
                if lower == "connection" and "close" in value.lower():
                    self.keep_alive = False
                continue
            if lower == "date":
                lines[1] = f"{name}: {value}"
                continue
            if lower == "content-length":
                if not (value.strip().isascii() and value.strip().isdigit()):
                    raise ValueError(f"bad Content-Length {value!r}")
                self.length = int(value)
            lines.append(f"{name}: {value}")
        if self.length is None and not no_body:
            if whole_body is not None:
                self.length = whole_body
                lines.append(f"Content-Length: {self.length}")
            elif self.conn.minor_version >= 1:
                self.chunked = True
                lines.append("Transfer-Encoding: chunked")
            else:
                self.keep_alive = False
        elif self.length is not None and whole_body is not None and whole_body != self.length and not no_body:
            # finish_body sends at most length bytes: a longer body is cut, a shorter one ends the connection.
            self.keep_alive = False
        # Keep-alive only if the request body is read, or can be once the app is
        # done (all of it has arrived): otherwise where the next request starts is unknown.
        # A streamed response's app may still read the body, so it is not dropped yet.
        if self.keep_alive and not (self.conn.discard_body() if whole_body is not None else self.conn.body_arrived()):
            self.keep_alive = False
        lines.append("Connection: keep-alive" if self.keep_alive else "Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def write(self, data: bytes) -> None:
        if self.status is None:
            raise AssertionError("write() before start_response()")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"a response body is bytes, not {type(data).__name__}")
        if not data:
            return
        out = b""
        if not self.sent_headers:
            out = self._head(None)
            self.sent_headers = True
        if not self.head_only:
            if self.chunked:
                out += b"%x\r\n" % len(data) + bytes(data) + b"\r\n"
            else:
                if self.length is not None and len(data) > self.length - self.sent:
                    # Bytes beyond the declared length would be read as the next response.
                    data = data[: self.length - self.sent]
                    self.keep_alive = False
                out += bytes(data)
            self.sent += len(data)
        self.conn.write(out)

    def finish_body(self, last: bytes | None) -> None:
        """The body ended; ``last`` is its only chunk when it was one piece (sent with the headers)."""
        if not self.sent_headers:
            out = self._head(len(last) if last else 0)
            self.sent_headers = True
            if last and not self.head_only:
                body = last if self.length is None else last[: self.length]
                out += body
                self.sent += len(body)
            self.conn.write(out)
            return
        if last:
            self.write(last)
        if self.chunked:
            self.conn.write(b"0\r\n\r\n")
        elif self.length is not None and self.sent != self.length and not self.head_only:
            self.keep_alive = False


class FrontDoorServer:
    """The front door: one C I/O thread for the triage, ``threads`` Python workers for the app.

    Build it with ``create_server``; ``serve_forever()`` runs it until
    ``shutdown()`` (from another thread) or Ctrl-C. ``server_address`` is the
    bound address, ``stats()`` the engine's counters. ``policies`` maps each
    queue-policy option (``POLICY_DEFAULTS``' keys) to its value: those not
    given come from ``settings`` when it has a field of that name.
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        host: str,
        port: int,
        settings: ServerSettings,
        backlog: int = 2048,
        io_timeout_ms: float = DEFAULT_IO_TIMEOUT_MS,
        write_grace_ms: float = DEFAULT_WRITE_GRACE_MS,
        max_io_wait_ms: float = DEFAULT_MAX_IO_WAIT_MS,
        shutdown_timeout: float = 5.0,
        policies: dict[str, Any] | None = None,
        reuse_port: bool = False,
    ) -> None:
        if not sys.platform.startswith("linux"):
            raise RuntimeError("the front door runs on Linux only (epoll)")
        engine_module = compiled_engine()
        # Each policy option: given here, else the settings' field (when ServerSettings has it), else the default.
        given = dict(policies or {})
        unknown = set(given) - set(POLICY_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown queue-policy options {sorted(unknown)}")
        self.policies: dict[str, Any] = {
            name: given[name] if given.get(name) is not None else getattr(settings, name, default)
            for name, default in POLICY_DEFAULTS.items()
        }
        engine_policies = _engine_policy_args(settings.threads, self.policies)
        self.app = app
        self.settings = settings
        self.shutdown_timeout = shutdown_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if not isinstance(reuse_port, bool):
            raise TypeError(f"reuse_port must be a bool, got {type(reuse_port).__name__}")
        # reuse_port: several independent front doors may share the port (the
        # kernel spreads connections); each admits on its own, with no view of
        # the others' room - what `--workers N` exists to avoid.
        listener = socket.create_server((host, port), family=family, backlog=backlog, reuse_port=reuse_port)
        self.server_address: tuple[str, int] = listener.getsockname()[:2]
        self._base_environ = {
            "SERVER_NAME": host,
            "SERVER_PORT": str(self.server_address[1]),
            "SERVER_SOFTWARE": "prazo-frontdoor",
            "SCRIPT_NAME": "",
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
            "wsgi.input_terminated": True,
            SERVER_STATS_KEY: self.stats,
        }
        # The engine owns the listening descriptor from here on and closes it itself.
        self._engine = engine_module.Engine(
            [listener.detach()],
            threads=settings.threads,
            max_queue=settings.max_queue,
            default_budget_ms=settings.default_budget_ms,
            max_budget_ms=settings.max_budget_ms,
            header_timeout_ms=settings.header_timeout_ms,
            io_timeout_ms=io_timeout_ms,
            write_grace_ms=write_grace_ms,
            max_io_wait_ms=max_io_wait_ms,
            linger_ms=DEFAULT_LINGER_S * 1000.0,
            max_drain_bytes=DEFAULT_MAX_DRAIN_BYTES,
            max_lingering=DEFAULT_MAX_LINGERING,
            max_head=MAX_HEAD_BYTES,
            answers=canned_answers(),
            # The front-proxy correction is the engine's: it needs the peer and
            # the arrival stamp, both C-side, and must act before the line does.
            trust_request_start=settings.trust_request_start,
            max_upstream_ns=int(settings.max_upstream_ms * NS_PER_MS),
            trusted_networks=engine_module.engine_networks(trusted_networks(settings.trusted_proxies)),
            **engine_policies,
        )
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._started = False
        self._shut_down = False
        self._stopped = threading.Event()
        self._expired_at_start = 0
        self._app_errors = 0

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> None:
        """Start serving in the background (``serve_forever`` calls this)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._engine.start()
            for index in range(self.settings.threads):
                worker = threading.Thread(target=self._work, name=f"prazo-frontdoor-{index}", daemon=True)
                worker.start()
                self._workers.append(worker)

    def serve_forever(self) -> None:
        """Serve until ``shutdown()``; Ctrl-C (``KeyboardInterrupt``) shuts down gracefully."""
        self.start()
        try:
            while not self._stopped.wait(0.5):
                pass
        except KeyboardInterrupt:
            self.shutdown(self.shutdown_timeout)

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Stop gracefully: refuse new connections, let admitted requests finish within ``timeout``.

        What still waits after ``timeout`` is answered 503 ``shutting-down``;
        returns True when everything admitted had finished in time.
        """
        with self._lock:
            if self._shut_down:
                self._stopped.wait()
                return True
            self._shut_down = True
        end = time.monotonic() + max(timeout, 0.0)
        self._engine.drain()
        idle = bool(self._engine.wait_idle(timeout)) if self._started else True
        self._engine.stop()
        for worker in self._workers:
            worker.join(max(0.0, end - time.monotonic()))
        self._stopped.set()
        return idle

    server_close = shutdown

    def stats(self) -> dict[str, int]:
        """The engine's counters (``offered``, ``rejected_full``, ``expired_in_queue``, ...) and the workers'.

        Every key of ``AdmissionQueue.stats()`` is there too, so metrics and
        tools read the front door like any admission point: ``cancelled`` is
        ``shutting_down`` (answered 503 by a shutdown, never started).
        """
        stats: dict[str, int] = self._engine.stats()
        stats["cancelled"] = stats["shutting_down"]
        stats["expired"] = stats["expired_on_arrival"] + stats["expired_in_queue"]
        stats["reserved"] = self.policies["reserved"]
        stats["max_concurrency"] = self.settings.threads
        stats["max_queue"] = self.settings.max_queue
        stats["expired_at_start"] = self._expired_at_start
        stats["app_errors"] = self._app_errors
        return stats

    # ---------------------------------------------------------------- workers

    def _work(self) -> None:
        engine = self._engine
        while True:
            conn = engine.next_connection()
            if conn is None:
                return
            keep = False
            try:
                keep = self._serve(conn)
            except Exception:  # noqa: BLE001 - the client went away, or a bug: the connection closes, the worker lives
                _log.debug("front door: connection dropped", exc_info=True)
            finally:
                conn.finish(keep)

    def _environ(self, conn: Any) -> dict[str, Any]:
        environ = self._base_environ.copy()
        target: bytes = conn.target
        if target.startswith((b"http://", b"https://")):
            # absolute-form: the path is what follows the authority
            slash = target.find(b"/", target.find(b"//") + 2)
            target = target[slash:] if slash >= 0 else b"/"
        path, _, query = target.partition(b"?")
        environ["REQUEST_METHOD"] = conn.method.decode("latin-1")
        environ["PATH_INFO"] = unquote_to_bytes(path).decode("latin-1")
        environ["QUERY_STRING"] = query.decode("latin-1")
        environ["RAW_URI"] = environ["REQUEST_URI"] = conn.target.decode("latin-1")
        environ["SERVER_PROTOCOL"] = f"HTTP/1.{conn.minor_version}"
        if conn.peer is not None:
            environ["REMOTE_ADDR"], port = conn.peer
            environ["REMOTE_PORT"] = str(port)
        for raw_name, raw_value in conn.headers:
            name = raw_name.decode("latin-1")
            if is_ambiguous_header_name(name):
                continue
            value = raw_value.decode("latin-1")
            key = name.upper().replace("-", "_")
            if key == "CONTENT_TYPE" or key == "CONTENT_LENGTH":
                environ[key] = value
                continue
            key = "HTTP_" + key
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        environ["wsgi.input"] = _BodyInput(conn)
        if conn.budget_source is not None:
            environ[BUDGET_SOURCE_KEY] = conn.budget_source
        return environ

    def _refuse_expired(self, conn: Any, reason: str, may_keep_alive: bool) -> bool:
        """Answer 504 ``reason`` to a request a worker picked up too late; True when the connection stays open."""
        self._expired_at_start += 1
        keep = may_keep_alive and conn.content_length <= 0 and not conn.chunked
        conn.write(rejection_bytes(DeadlineExceeded(reason), keep_alive=keep))
        return keep

    def _serve(self, conn: Any) -> bool:
        """Run one admitted request; True when the connection may carry the next one."""
        deadline = Deadline.at_ns(conn.deadline_ns)
        may_keep_alive = bool(conn.client_keep_alive) and not self._engine.draining
        if time.monotonic_ns() >= deadline.ns:
            # Waiting for the GIL after the engine handed it over took the rest of the budget.
            return self._refuse_expired(conn, "expired-in-queue", may_keep_alive)
        # conn.deadline_ns already has a trusted proxy's queue time taken off (the engine's pfd_upstream_ns).
        environ = self._environ(conn)
        response = _Response(conn, environ["REQUEST_METHOD"] == "HEAD", may_keep_alive)
        try:
            result = run_admitted(
                self.app,
                environ,
                response.start_response,
                deadline,
                _nothing,
                conn.queue_wait_ns,
                arrival_ns=conn.arrival_ns,
            )
        except Exception:  # noqa: BLE001 - any app error is a 500, as in every WSGI server
            self._answer_error(conn, response, "the app raised")
            return False
        try:
            self._write_body(response, result)
        except OSError as exc:
            if isinstance(exc, RequestBodyError):
                self._answer_error(conn, response, "the response body raised")
            return False
        except Exception:  # noqa: BLE001 - the body raised: 500 if nothing was sent, else the connection closes
            self._answer_error(conn, response, "the response body raised")
            return False
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        # The app is done: what it left of the body goes now (it has arrived, or keep_alive is False already).
        return response.keep_alive and bool(conn.discard_body())

    def _answer_error(self, conn: Any, response: _Response, what: str) -> None:
        """The app (or its body) raised: answer if no response began; the connection then closes.

        After a failed request body the client is answered 408 or 400, whatever
        the app made of the failure: the request was at fault, not the app.
        """
        failure = conn.body_failure
        if failure is None:
            self._app_errors += 1
            _log.exception("front door: %s", what)
        else:
            _log.debug("front door: %s after the request body failed (%s)", what, failure, exc_info=True)
        if not response.sent_headers:
            if failure is None:
                conn.write(_INTERNAL_ERROR)
            else:
                conn.write(_BODY_TIMEOUT if failure == "timeout" else BAD_REQUEST_ANSWER)

    @staticmethod
    def _write_body(response: _Response, result: Iterable[bytes]) -> None:
        # The first chunk waits for the second: a body of one chunk (the common
        # case) goes out with its Content-Length, in one write with the head.
        pending: bytes | None = None
        for chunk in result:
            if response.status is None:
                raise AssertionError("the app returned without calling start_response")
            if not chunk:
                continue
            if pending is not None:
                response.write(pending)
            pending = chunk
        if response.status is None:
            raise AssertionError("the app returned without calling start_response")
        response.finish_body(pending)


_date_cache: tuple[int, str] = (0, "")


def _date_line() -> str:
    """``Date: ...`` (RFC 9110 requires it of a server with a clock), formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, "Date: " + formatdate(now, usegmt=True))
    return _date_cache[1]


def _nothing() -> None:
    """The release ``run_admitted`` calls: the worker's place is given back by ``Connection.finish``."""


def create_server(
    app: WSGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    threads: int | None = None,
    max_queue: int | None = None,
    default_budget_ms: float | None = None,
    max_budget_ms: float | None = None,
    header_timeout_ms: float | None = None,
    settings: ServerSettings | None = None,
    backlog: int = 2048,
    io_timeout_ms: float = DEFAULT_IO_TIMEOUT_MS,
    write_grace_ms: float = DEFAULT_WRITE_GRACE_MS,
    max_io_wait_ms: float = DEFAULT_MAX_IO_WAIT_MS,
    shutdown_timeout: float = 5.0,
    reuse_port: bool = False,
    order: str | None = None,
    codel_target_ms: float | None = None,
    codel_interval_ms: float | None = None,
    expected_service_ms: float | str | None = None,
    limit: str | None = None,
    min_concurrency: int | None = None,
    reserved: int | None = None,
    critical_header: str | None = None,
    critical_paths: Iterable[str] | None = None,
) -> FrontDoorServer:
    """A front door serving ``app`` on ``host:port`` (``port=0``: any free port; see ``server_address``).

    Every limit not given comes from the environment (``PRAZO_MAX_QUEUE``,
    ...) or its default, or all of them from ``settings``; see
    ``prazo.bindings.servers.settings.resolve_settings``. The queue-policy
    options (``order`` ... ``critical_paths``, as ``AdmissionQueue``'s; see
    the module docstring) not given come from ``settings`` when it has them,
    else their defaults (``POLICY_DEFAULTS``). ``reuse_port=True`` sets
    ``SO_REUSEPORT`` so that several front doors can listen on one port; each
    still admits on its own (one host-wide line is what ``prazo serve --workers``
    gives).
    """
    policies = {
        "order": order, "codel_target_ms": codel_target_ms, "codel_interval_ms": codel_interval_ms,
        "expected_service_ms": expected_service_ms, "limit": limit, "min_concurrency": min_concurrency,
        "reserved": reserved, "critical_header": critical_header,
        "critical_paths": critical_paths,
    }  # fmt: skip
    settings = resolve_settings(
        threads=threads, max_queue=max_queue, default_budget_ms=default_budget_ms, max_budget_ms=max_budget_ms,
        header_timeout_ms=header_timeout_ms, settings=settings,
    )  # fmt: skip
    return FrontDoorServer(
        app,
        host=host,
        port=port,
        settings=settings,
        backlog=backlog,
        io_timeout_ms=io_timeout_ms,
        write_grace_ms=write_grace_ms,
        max_io_wait_ms=max_io_wait_ms,
        shutdown_timeout=shutdown_timeout,
        policies=policies,
        reuse_port=reuse_port,
    )
