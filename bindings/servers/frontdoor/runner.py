"""The front door's Python workers: from an admitted connection to the app's answer on the wire.

Whoever holds the engine - one front door (``FrontDoorServer``) or a worker
process of a host (``prazo.bindings.servers.frontdoor.supervisor``) - runs ``RequestRunner.work``
in each worker thread: it builds the PEP 3333 environ from the engine's parsed
head, streams the body (``wsgi.input``), runs the app inside its deadline with
``run_admitted``, frames the response (Content-Length when the body is one
piece, chunked when HTTP/1.1 streams, a close otherwise) and tells the engine
whether the connection may carry the next request. The engine's ``Connection``
does every wait on the client without the GIL.
"""

from __future__ import annotations

import _thread
import logging
import re
import time
from collections.abc import Callable, Iterable
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote_to_bytes

from prazo.core import Deadline, DeadlineExceeded

from ... import wsgi as wsgi_module
from ...headers import is_ambiguous_header_name
from ...plumbing.load_report import LoadReport
from ...wsgi import BUDGET_SOURCE_KEY, OUTCOME_ADMITTED, WSGIApp, run_admitted
from ..plumbing.refusals import BAD_REQUEST_ANSWER, rejection_bytes, status_answer
from .observer import EngineObserver

__all__ = [
    "RequestBodyError",
    "RequestRunner",
    "compiled_path",
    "date_line_py",
    "head_environ_py",
    "response_fields_py",
    "use_compiled_path",
]

_log = logging.getLogger("prazo.servers.frontdoor")

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
        if self.status.startswith(_NO_BODY_STATUS):
            self.head_only = True  # 1xx, 204 and 304 never carry a body, whatever the app returns
        no_body = self.head_only
        text, length, close = response_fields(self.status, self.headers)
        if close:
            self.keep_alive = False
        if length is not None:
            self.length = length
        lines = [text]
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
        lines.append("Connection: keep-alive\r\n\r\n" if self.keep_alive else "Connection: close\r\n\r\n")
        return "\r\n".join(lines).encode("latin-1")

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
        if last is not None and not isinstance(last, (bytes, bytearray, memoryview)):
            # Before the head is marked sent: the app's error is then still answered 500.
            raise TypeError(f"a response body is bytes, not {type(last).__name__}")
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


def head_environ_py(base: dict[str, Any], conn: Any) -> dict[str, Any]:
    """A copy of ``base`` with the CGI keys of ``conn``'s parsed head: the spec of the engine's ``head_environ``.

    ``conn`` has the head as the engine parsed it: ``method``, ``target`` and
    each header's name and value as bytes (latin-1, as PEP 3333 says),
    ``minor_version`` and ``peer``. A name with an underscore is dropped
    (``is_ambiguous_header_name``); repeated headers are joined with ``,``; an
    absolute-form target's path is what follows the authority; PATH_INFO is
    percent-decoded as ``unquote_to_bytes`` does. The compiled twin,
    ``_engine_c.head_environ``, builds the same dict, keys in the same order.
    """
    environ = base.copy()
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
    return environ


def response_fields_py(status: str, headers: list[tuple[str, str]]) -> tuple[str, int | None, bool]:
    """``(text, content_length or None, close)``: the app's part of a response head, the spec of ``response_fields``.

    ``text``: the status line, the Date line (the app's own Date replaces the
    server's) and every field of the app's but the hop-by-hop ones, joined by
    CRLF; ``close``: the app's Connection field says close; a Content-Length
    that is not digits raises ValueError (the app's error: a 500).
    """
    lines = [f"HTTP/1.1 {status}", date_line_py()]
    close = False
    length = None
    for name, value in headers:
        lower = name.lower()
        if lower in _HOP_BY_HOP:
            if lower == "connection" and "close" in value.lower():
                close = True
            continue
        if lower == "date":
            lines[1] = f"{name}: {value}"
            continue
        if lower == "content-length":
            if not (value.strip().isascii() and value.strip().isdigit()):
                raise ValueError(f"bad Content-Length {value!r}")
            length = int(value)
        lines.append(f"{name}: {value}")
    return "\r\n".join(lines), length, close


try:
    from ._engine_c import RequestLoop, head_environ, response_fields
except ImportError:  # the front door itself needs the engine; the specs serve where only it is missing
    RequestLoop = None  # type: ignore[assignment,misc]
    head_environ = head_environ_py
    response_fields = response_fields_py

# The compiled request loop (``_engine_c.RequestLoop``: ``work``, ``serve``, the response
# and its writes in Cython) needs the engine and the compiled run_admitted; the methods
# below are its specification, and run where either is missing or a test asks for them.
_COMPILED_LOOP = RequestLoop is not None and wsgi_module._COMPILED_PATH is not None


def compiled_path() -> bool:
    """True when runners created from now on serve on the compiled loop (``_engine_c.RequestLoop``)."""
    return _COMPILED_LOOP


def use_compiled_path(enabled: bool) -> bool:
    """Choose the loop of runners created from now on (the tests run the front door on both); returns the old choice.

    Raises ``RuntimeError`` when ``enabled`` and the compiled loop is not available.
    """
    global _COMPILED_LOOP
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, not {type(enabled).__name__}")
    if enabled and (RequestLoop is None or wsgi_module._COMPILED_PATH is None):
        raise RuntimeError("the compiled request loop (prazo.bindings.servers.frontdoor._engine_c) is not available")
    previous = _COMPILED_LOOP
    _COMPILED_LOOP = enabled
    return previous


class RequestRunner:
    """Serves admitted connections with ``app``; ``base_environ`` is copied for each request.

    ``draining()`` says whether the server is shutting down (then no response
    promises keep-alive). ``expired_at_start`` counts requests a worker picked
    up after their deadline (answered 504 ``expired-in-queue``), ``app_errors``
    the app's exceptions (answered 500): plain ints, each written by the
    worker threads under the GIL.

    Whatever the app (its call, its body, its ``close()``) raises ends that
    request only, never the worker thread: the thread gave its place back to
    the engine, so a thread that ended would leave the place to no one and,
    with one thread, every later request would wait forever. That holds for a
    ``BaseException`` that is no ``Exception`` (``sys.exit()`` or argparse's
    ``error()`` in a view) too: an app error like any other. A
    ``KeyboardInterrupt`` keeps its meaning besides: the first one is passed
    on to the main thread as a Ctrl-C (``serve_forever()`` then stops
    gracefully; a host's worker ignores Ctrl-C, so there it is an app error
    only).

    With a ``load_report``, every response the app starts carries its
    ``endpoint-load-metrics`` header (the app's refusals too); the answers
    written here as bytes (the 504 of a late pickup, a 500) and the engine's
    own refusals carry none.
    """

    def __init__(
        self,
        app: WSGIApp,
        base_environ: dict[str, Any],
        draining: Callable[[], bool],
        load_report: LoadReport | None = None,
        observe_only: bool = False,
        observer: EngineObserver | None = None,
    ) -> None:
        self.app = app
        self.load_report = load_report
        # Observe-only: a late start runs (the shadow line counted it); a one-process front
        # door's observer takes the engine's notes after each request.
        self.observe_only = observe_only
        self.observer = observer
        self.base_environ = base_environ
        self._draining = draining
        self.expired_at_start = 0
        self.app_errors = 0
        # Claimed by list.pop(), atomic: one Ctrl-C starts the graceful stop; a
        # second one, from another thread's app, would cut that stop short.
        self._interrupt = [_thread.interrupt_main]
        self._loop: Any = None
        compiled_wsgi = wsgi_module._COMPILED_PATH
        if _COMPILED_LOOP and compiled_wsgi is not None:
            self._loop = RequestLoop(
                self,
                call_admitted=compiled_wsgi.call_admitted,
                body_error=RequestBodyError,
                deadline_at=Deadline.at_ns,
                budget_source_key=BUDGET_SOURCE_KEY,
                outcome=OUTCOME_ADMITTED,
            )

    def work(self, next_connection: Callable[[], Any]) -> None:
        """Serve the connections ``next_connection()`` gives until it gives None (the engine stopped)."""
        if self._loop is not None:
            self._loop.work(next_connection)
            return
        while True:
            conn = next_connection()
            if conn is None:
                return
            keep = False
            try:
                keep = self.serve(conn)
            except Exception:  # noqa: BLE001 - the client went away, or a bug: the connection closes, the worker lives
                _log.debug("front door: connection dropped", exc_info=True)
            except BaseException as exc:  # noqa: BLE001 - SystemExit & co. from the body's close(): the worker lives
                self._app_error(exc, "the response's close() raised")
            finally:
                conn.finish(keep)
                if self.observer is not None:
                    self.observer.take()

    def environ(self, conn: Any) -> dict[str, Any]:
        """The PEP 3333 environ of ``conn``'s request: ``head_environ`` of the head, then the body and budget keys."""
        environ = head_environ(self.base_environ, conn)
        environ["wsgi.input"] = _BodyInput(conn)
        if conn.budget_source is not None:
            environ[BUDGET_SOURCE_KEY] = conn.budget_source
        return environ

    def _refuse_expired(self, conn: Any, reason: str, may_keep_alive: bool) -> bool:
        """Answer 504 ``reason`` to a request a worker picked up too late; True when the connection stays open."""
        self.expired_at_start += 1
        keep = may_keep_alive and conn.content_length <= 0 and not conn.chunked
        conn.write(rejection_bytes(DeadlineExceeded(reason), keep_alive=keep))
        return keep

    def serve(self, conn: Any) -> bool:
        """Run one admitted request; True when the connection may carry the next one."""
        deadline = Deadline.at_ns(conn.deadline_ns)
        may_keep_alive = bool(conn.client_keep_alive) and not self._draining()
        if time.monotonic_ns() >= deadline.ns and not self.observe_only:
            # Waiting for the GIL after the engine handed it over took the rest of the budget.
            return self._refuse_expired(conn, "expired-in-queue", may_keep_alive)
        # conn.deadline_ns already has a trusted proxy's queue time taken off (the engine's pfd_upstream_ns).
        environ = self.environ(conn)
        response = _Response(conn, environ["REQUEST_METHOD"] == "HEAD", may_keep_alive)
        start_response = (
            response.start_response
            if self.load_report is None
            else self.load_report.start_response(response.start_response)
        )
        try:
            result = run_admitted(
                self.app,
                environ,
                start_response,
                deadline,
                _nothing,
                conn.queue_wait_ns,
                arrival_ns=conn.arrival_ns,
            )
        except BaseException as exc:  # noqa: BLE001 - any app error is a 500, as in every WSGI server; SystemExit too
            self._answer_error(conn, response, "the app raised", exc)
            return False
        try:
            self._write_body(response, result)
        except OSError as exc:
            if isinstance(exc, RequestBodyError):
                self._answer_error(conn, response, "the response body raised", exc)
            return False
        except BaseException as exc:  # noqa: BLE001 - the body raised: 500 if nothing was sent, else the connection closes
            self._answer_error(conn, response, "the response body raised", exc)
            return False
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        # The app is done: what it left of the body goes now (it has arrived, or keep_alive is False already).
        return response.keep_alive and bool(conn.discard_body())

    def _app_error(self, exc: BaseException, what: str) -> None:
        """Count and log (with its traceback) what the app raised; pass a ``KeyboardInterrupt`` on as a Ctrl-C."""
        self.app_errors += 1
        _log.exception("front door: %s", what)
        self._pass_on_interrupt(exc)

    def _pass_on_interrupt(self, exc: BaseException) -> None:
        """The first ``KeyboardInterrupt`` the app raised goes to the main thread, as a Ctrl-C would."""
        if not isinstance(exc, KeyboardInterrupt):
            return
        try:
            interrupt_main = self._interrupt.pop()
        except IndexError:
            return
        # Raised on in a worker thread it would only end the thread; the main
        # thread is where Ctrl-C means "stop" (serve_forever). Where SIGINT is
        # ignored (a host's worker: the supervisor decides) this does nothing.
        interrupt_main()

    def _answer_error(self, conn: Any, response: _Response, what: str, exc: BaseException) -> None:
        """The app (or its body) raised ``exc``: answer if no response began; the connection then closes.

        After a failed request body the client is answered 408 or 400, whatever
        the app made of the failure: the request was at fault, not the app.
        """
        failure = conn.body_failure
        if failure is None:
            self._app_error(exc, what)
        else:
            _log.debug("front door: %s after the request body failed (%s)", what, failure, exc_info=True)
            self._pass_on_interrupt(exc)
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


def date_line_py() -> str:
    """``Date: ...`` (RFC 9110 requires it of a server with a clock), formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, "Date: " + formatdate(now, usegmt=True))
    return _date_cache[1]


def _nothing() -> None:
    """The release ``run_admitted`` calls: the worker's place is given back by ``Connection.finish``."""
