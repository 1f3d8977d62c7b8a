# The workers' request loop, start_response and the response's framing and writes, compiled.
#
# runner.py is the specification: RequestRunner.work and serve, _Response and
# _write_body there say what this does, line for line, and the tests run the
# front door on both (runner.use_compiled_path). What is C here: the loop, the
# response object, the checks start_response makes, the head's framing, the
# body iteration and the writes, reaching the engine's Connection without
# Python calls. What stays Python: the app, its body's chunks and close(), and
# the rare paths (a late pickup, an app's error), which call the runner's own
# methods so that both paths count and answer them the same way.
from cpython.unicode cimport PyUnicode_AsLatin1String

import logging as _logging

_runner_log = _logging.getLogger("prazo.servers.frontdoor")
cdef tuple _NO_BODY_STATUS = ("1", "204", "304")
cdef bytes _LAST_CHUNK = b"0\r\n\r\n"
cdef str _KEEP_ALIVE_END = "\r\nConnection: keep-alive\r\n\r\n"
cdef str _CLOSE_END = "\r\nConnection: close\r\n\r\n"
cdef str _CHUNKED_LINE = "\r\nTransfer-Encoding: chunked"


cdef inline bint _is_text_char(Py_UCS4 ch) noexcept:
    """HTAB, SP, VCHAR or obs-text: what a reason phrase and a field value may hold."""
    return ch == 9 or 0x20 <= ch <= 0x7e or 0x80 <= ch <= 0xff


cdef inline bint _is_token_char(Py_UCS4 ch) noexcept:
    if ch >= 0x80:
        return False
    if c'0' <= ch <= c'9' or c'a' <= ch <= c'z' or c'A' <= ch <= c'Z':
        return True
    return ch in u"!#$%&'*+-.^_`|~"


cdef bint _status_ok(str status):
    """``runner._STATUS``: three digits, a space and a reason of text characters."""
    cdef Py_ssize_t i = 0
    cdef Py_UCS4 ch
    if len(status) < 4:
        return False
    for ch in status:  # Cython reads the string's own storage: no index calls
        if i < 3:
            if not (c'0' <= ch <= c'9'):
                return False
        elif i == 3:
            if ch != c' ':
                return False
        elif not _is_text_char(ch):
            return False
        i += 1
    return True


cdef bint _token_ok(str name):
    """``runner._TOKEN``: one or more token characters."""
    cdef Py_UCS4 ch
    if len(name) == 0:
        return False
    for ch in name:
        if not _is_token_char(ch):
            return False
    return True


cdef bint _value_ok(str value):
    """``runner._FIELD_VALUE``: text characters only (no CR, LF or other control character)."""
    cdef Py_UCS4 ch
    for ch in value:
        if not _is_text_char(ch):
            return False
    return True


cdef Py_ssize_t _READ_CHUNK = 65536


@cython.final
cdef class BodyInput:
    """``runner._BodyInput``, compiled: ``wsgi.input``, the body decoded (Content-Length or chunked), read on demand.

    Made for every request, read by few: a Python object there cost more than
    the rest of the environ's keys together.
    """

    cdef Connection _conn
    cdef object _error
    cdef bytes _buffer
    cdef bint _eof

    def __cinit__(self, Connection conn, error):
        self._conn = conn
        self._error = error
        self._buffer = b""

    cdef bytes _read_body(self, Py_ssize_t size):
        try:
            return self._conn.read_body(size)
        except OSError as exc:
            raise self._error(self._conn.body_failure) from exc

    cdef bint _fill(self, Py_ssize_t wanted) except -1:
        if self._eof:
            return False
        data = self._read_body(wanted if wanted > _READ_CHUNK else _READ_CHUNK)
        if not data:
            self._eof = True
            return False
        self._buffer += data
        return True

    # Each method's work runs in the object's critical section: nothing with a GIL, and
    # without one it keeps an app's threads that share a wsgi.input (a misuse) from
    # replacing the buffer at once. A body read that waits lets the section go meanwhile.
    def read(self, size=-1):
        with cython.critical_section(self):
            return self._read(size)

    def readline(self, size=-1):
        with cython.critical_section(self):
            return self._readline(size)

    def readlines(self, hint=-1):
        with cython.critical_section(self):
            return self._readlines(hint)

    def __iter__(self):
        return self

    def __next__(self):
        with cython.critical_section(self):
            line = self._readline(-1)
        if not line:
            raise StopIteration
        return line

    cdef bytes _read(self, size):
        cdef Py_ssize_t wanted
        if size is None or size < 0:
            parts = [self._buffer]
            while not self._eof:
                data = self._read_body(_READ_CHUNK)
                if not data:
                    self._eof = True
                parts.append(data)
            self._buffer = b""
            return b"".join(parts)
        wanted = size
        while len(self._buffer) < wanted and self._fill(wanted - len(self._buffer)):
            pass
        data, self._buffer = self._buffer[:wanted], self._buffer[wanted:]
        return data

    cdef bytes _readline(self, size):
        cdef Py_ssize_t limit = -1 if size is None else size
        cdef Py_ssize_t end
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

    cdef list _readlines(self, hint):
        cdef list lines = []
        cdef Py_ssize_t total = 0
        while True:
            line = self._readline(-1)
            if not line:
                return lines
            lines.append(line)
            total += len(line)
            if 0 < hint <= total:
                return lines


@cython.final
cdef class Response:
    """``runner._Response``, compiled: start_response, write() and the framing of one response."""

    cdef Connection conn
    cdef readonly bint head_only
    cdef readonly bint keep_alive
    cdef readonly object status
    cdef readonly list headers
    cdef readonly bint sent_headers
    cdef readonly bint chunked
    cdef readonly object length
    cdef readonly long long sent

    def __cinit__(self, Connection conn, bint head_only, bint may_keep_alive):
        self.conn = conn
        self.head_only = head_only
        self.keep_alive = may_keep_alive
        self.headers = []

    # As BodyInput's: the work of start_response, write() and finish_body runs in the
    # object's critical section (an app's threads may share its write callable).
    def start_response(self, status, headers, exc_info=None):
        with cython.critical_section(self):
            return self._start_response(status, headers, exc_info)

    cdef object _start_response(self, status, headers, exc_info):
        if exc_info is not None:
            try:
                if self.sent_headers:
                    raise exc_info[1].with_traceback(exc_info[2])
            finally:
                exc_info = None
        elif self.status is not None:
            raise AssertionError("start_response was already called")
        if not isinstance(status, str) or not _status_ok(<str>status):
            raise ValueError(f"bad status {status!r}: three digits, a space, a reason without control characters")
        cdef list fields = list(headers)
        for field in fields:
            name, value = field
            if not isinstance(name, str) or not isinstance(value, str):
                raise TypeError("header names and values must be str")
            if not _token_ok(<str>name):
                raise ValueError(f"bad header name {name!r}: a token, without spaces, colons or control characters")
            if not _value_ok(<str>value):
                raise ValueError(f"bad value of header {name!r}: a control character or a line break")
        self.status = status
        self.headers = fields
        return self.write

    cdef bytes _head(self, long long whole_body):
        """The response head; ``whole_body`` is the body's length when all of it is known now, else -1."""
        cdef str status = self.status
        if status.startswith(_NO_BODY_STATUS):
            self.head_only = True  # 1xx, 204 and 304 never carry a body, whatever the app returns
        cdef bint no_body = self.head_only
        text, length, close = _response_fields(status, self.headers)
        if close:
            self.keep_alive = False
        if length is not None:
            self.length = length
        if self.length is None and not no_body:
            if whole_body >= 0:
                self.length = whole_body
                text = f"{text}\r\nContent-Length: {whole_body}"
            elif self.conn.minor_version >= 1:
                self.chunked = True
                text = text + _CHUNKED_LINE
            else:
                self.keep_alive = False
        elif self.length is not None and whole_body >= 0 and whole_body != self.length and not no_body:
            # finish_body sends at most length bytes: a longer body is cut, a shorter one ends the connection.
            self.keep_alive = False
        # Keep-alive only if the request body is read, or can be once the app is
        # done (all of it has arrived): otherwise where the next request starts is unknown.
        # A streamed response's app may still read the body, so it is not dropped yet.
        if self.keep_alive and not (self.conn._discard() if whole_body >= 0 else self.conn._arrived()):
            self.keep_alive = False
        return PyUnicode_AsLatin1String(text + (_KEEP_ALIVE_END if self.keep_alive else _CLOSE_END))

    def write(self, data):
        with cython.critical_section(self):
            self._write(data)

    cdef int _write(self, data) except -1:
        if self.status is None:
            raise AssertionError("write() before start_response()")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"a response body is bytes, not {type(data).__name__}")
        if not data:
            return 0
        cdef bytes out = b""
        cdef Py_ssize_t room
        if not self.sent_headers:
            out = self._head(-1)
            self.sent_headers = True
        if not self.head_only:
            if self.chunked:
                out += b"%x\r\n" % len(data) + bytes(data) + b"\r\n"
            else:
                if self.length is not None and len(data) > self.length - self.sent:
                    # Bytes beyond the declared length would be read as the next response.
                    room = self.length - self.sent
                    data = data[:room]
                    self.keep_alive = False
                out += bytes(data)
            self.sent += len(data)
        return self.conn._send(PyBytes_AS_STRING(out), PyBytes_GET_SIZE(out))

    cdef int finish_body(self, object last) except -1:
        """The body ended; ``last`` is its only chunk when it was one piece (sent with the headers)."""
        with cython.critical_section(self):
            return self._finish_body(last)

    cdef int _finish_body(self, object last) except -1:
        cdef bytes out
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
            self.conn._send(PyBytes_AS_STRING(out), PyBytes_GET_SIZE(out))
            return 0
        if last:
            self._write(last)
        if self.chunked:
            self.conn._send(PyBytes_AS_STRING(_LAST_CHUNK), PyBytes_GET_SIZE(_LAST_CHUNK))
        elif self.length is not None and self.sent != self.length and not self.head_only:
            self.keep_alive = False
        return 0


cdef int _write_body(Response response, object result) except -1:
    # The first chunk waits for the second: a body of one chunk (the common
    # case) goes out with its Content-Length, in one write with the head.
    pending = None
    for chunk in result:
        if response.status is None:
            raise AssertionError("the app returned without calling start_response")
        if not chunk:
            continue
        if pending is not None:
            response.write(pending)  # the def: in the response's critical section
        pending = chunk
    if response.status is None:
        raise AssertionError("the app returned without calling start_response")
    return response.finish_body(pending)


def _no_release():
    """The release the admitted request's body calls: the worker's place goes back with ``Connection.finish``."""


@cython.final
cdef class RequestLoop:
    """``RequestRunner.work`` and ``serve``, compiled, for one runner (which it calls on the rare paths).

    ``call_admitted`` is ``prazo.bindings._wsgi_c.call_admitted``, ``body_error``
    what ``wsgi.input`` raises when the body failed (``runner.RequestBodyError``),
    ``deadline_at`` ``prazo.core.Deadline.at_ns``: passed in, so that this module
    imports nothing of the bindings'.
    """

    cdef object runner
    cdef object app
    cdef dict base_environ
    cdef object draining
    cdef object load_report
    cdef object observer
    cdef bint observe_only
    cdef object call_admitted
    cdef object body_error
    cdef object deadline_at
    cdef object budget_source_key
    cdef object outcome

    def __cinit__(self, runner, *, call_admitted, body_error, deadline_at, budget_source_key, outcome):
        self.runner = runner
        self.app = runner.app
        self.base_environ = runner.base_environ
        self.draining = runner._draining
        self.load_report = runner.load_report
        self.observer = runner.observer
        self.observe_only = runner.observe_only
        self.call_admitted = call_admitted
        self.body_error = body_error
        self.deadline_at = deadline_at
        self.budget_source_key = budget_source_key
        self.outcome = outcome

    def work(self, next_connection):
        """Serve the connections ``next_connection()`` gives until it gives None (the engine stopped)."""
        cdef bint keep
        while True:
            conn = next_connection()
            if conn is None:
                return
            keep = False
            try:
                if type(conn) is Connection:
                    keep = self._serve(<Connection>conn)
                else:
                    keep = self.runner.serve(conn)
            except Exception:  # the client went away, or a bug: the connection closes, the worker lives
                _runner_log.debug("front door: connection dropped", exc_info=True)
            except BaseException as exc:  # SystemExit & co. from the body's close(): the worker lives
                self.runner._app_error(exc, "the response's close() raised")
            finally:
                if type(conn) is Connection:
                    (<Connection>conn)._finish(keep)
                else:
                    conn.finish(keep)
                if self.observer is not None:
                    self.observer.take()

    cdef bint _serve(self, Connection conn) except -1:
        """Run one admitted request; True when the connection may carry the next one."""
        cdef bint may_keep_alive = conn.client_keep_alive and not self.draining()
        if pfd_now_ns() >= conn.deadline_ns and not self.observe_only:
            # Waiting for the GIL after the engine handed it over took the rest of the budget.
            return self.runner._refuse_expired(conn, "expired-in-queue", may_keep_alive)
        # conn.deadline_ns already has a trusted proxy's queue time taken off (the engine's pfd_upstream_ns).
        cdef dict environ = head_environ(self.base_environ, conn)
        environ["wsgi.input"] = BodyInput.__new__(BodyInput, conn, self.body_error)
        if conn.budget_source is not None:
            environ[self.budget_source_key] = conn.budget_source
        cdef Response response = Response.__new__(Response, conn, conn.method == b"HEAD", may_keep_alive)
        start_response = response.start_response
        if self.load_report is not None:
            start_response = self.load_report.start_response(start_response)
        deadline = self.deadline_at(conn.deadline_ns)
        try:
            result = self.call_admitted(self.app, environ, start_response, deadline, _no_release, conn.queue_wait_ns,
                                        None, 1, conn.arrival_ns, self.outcome)
        except BaseException as exc:  # any app error is a 500, as in every WSGI server; SystemExit too
            self.runner._answer_error(conn, response, "the app raised", exc)
            return False
        try:
            _write_body(response, result)
        except OSError as exc:
            if isinstance(exc, self.body_error):
                self.runner._answer_error(conn, response, "the response body raised", exc)
            return False
        except BaseException as exc:  # the body raised: 500 if nothing was sent, else the connection closes
            self.runner._answer_error(conn, response, "the response body raised", exc)
            return False
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        # The app is done: what it left of the body goes now (it has arrived, or keep_alive is False already).
        return response.keep_alive and conn._discard()
