"""AdmissionMiddleware and its pieces, called in-process as a WSGI server would.

Every test that serves requests through a middleware runs twice (the
``fast_path`` fixture): on the Python path and on the compiled one
(``prazo.bindings._wsgi_c``), which must behave identically. Tests of the
compiled path as such are in ``test_wsgi_fast_path.py``.
"""

from __future__ import annotations

import gc
import io
import time
from concurrent.futures import ThreadPoolExecutor
from wsgiref.util import setup_testing_defaults
from wsgiref.validate import validator

import prazo.bindings.wsgi as wsgi_module
import pytest
from _helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.headers import (
    BUDGET_ENVIRON_KEY,
    BUDGET_HEADER,
    ENVOY_TIMEOUT_ENVIRON_KEY,
    GRPC_TIMEOUT_ENVIRON_KEY,
    REASON_HEADER_NAME,
    RETRY_AFTER_MS_HEADER_NAME,
    BudgetPolicy,
)
from prazo.bindings.wsgi import (
    BUDGET_SOURCE_KEY,
    DEADLINE_KEY,
    QUEUE_WAIT_MS_KEY,
    AdmissionMiddleware,
    MiddlewareCounters,
    rejection_response,
    request_deadline,
    run_admitted,
    send_rejection,
)
from prazo.core import (
    NS_PER_MS,
    Deadline,
    DeadlineExceeded,
    DownstreamOverloaded,
    QueueFull,
    ShutDown,
    current_deadline,
    deadline_context,
    deadline_scope,
    extension_wanted,
)

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

# -- the two paths ----------------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["python-path", "compiled-path"])
def fast_path(request):
    """``fast_path=`` for the middleware under test: False, then True (the compiled path, required).

    The compiled run is skipped only when ``PRAZO_NO_EXTENSIONS=1`` asks for
    the Python twins; otherwise ``fast_path=True`` raises if it is not built,
    so ``make test`` can never pass without exercising it.
    """
    if request.param and not extension_wanted():
        pytest.skip("PRAZO_NO_EXTENSIONS is set: there is no compiled WSGI path")
    return request.param


# -- a minimal in-process WSGI server ---------------------------------------------


def make_environ(path="/", **extra):
    environ = {
        "PATH_INFO": path,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "wsgi.input": io.BytesIO(b""),
        "wsgi.errors": io.StringIO(),
    }
    setup_testing_defaults(environ)
    environ.update(extra)
    return environ


class Server:
    """start_response plus the PEP 3333 rules about when headers are sent."""

    def __init__(self):
        self.statuses = []
        self.headers = []
        self.written = []
        self.sent = False

    def start_response(self, status, headers, exc_info=None):
        if exc_info is not None and self.sent:
            raise exc_info[1].with_traceback(exc_info[2])
        assert exc_info is not None or not self.statuses, "start_response called twice without exc_info"
        self.statuses.append(status)
        self.headers.append(dict(headers))
        return self._write

    def _write(self, data):
        self.sent = True
        self.written.append(data)

    @property
    def status(self):
        return self.statuses[-1]

    @property
    def header(self):
        return self.headers[-1]

    def run(self, app, environ):
        """Call the app, drain and close its body; return the body bytes."""
        result = app(environ, self.start_response)
        try:
            for chunk in result:
                self.sent = True
                self.written.append(chunk)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        return b"".join(self.written)


def call(app, environ=None):
    server = Server()
    body = server.run(app, environ if environ is not None else make_environ())
    return server, body


def validated(app, fast_path, **options):
    """validator(middleware(validator(app))): both sides are checked against PEP 3333."""
    middleware = AdmissionMiddleware(validator(app), fast_path=fast_path, **options)
    return validator(middleware), middleware


class Probe:
    """A WSGI app that records what it saw and can stream or fail on demand."""

    def __init__(self, chunks=(b"ok",), fail_in_call=None, fail_at_chunk=None, fail_exc=None, body_type=None):
        self.calls = 0
        self.chunks = list(chunks)
        self.body_type = body_type  # list or tuple: return the chunks as one (no app code in the body)
        self.fail_in_call = fail_in_call
        self.fail_at_chunk = fail_at_chunk
        self.fail_exc = fail_exc
        self.environ = None
        self.deadline_in_call = None
        self.deadlines_in_body = []
        self.closed = 0

    def __call__(self, environ, start_response):
        self.calls += 1
        self.environ = environ
        self.deadline_in_call = current_deadline()
        start_response("200 OK", [("Content-Type", "text/plain")])
        if self.fail_in_call is not None:
            raise self.fail_in_call
        if self.body_type is not None:
            return self.body_type(self.chunks)
        return self._body()

    def _body(self):
        try:
            for index, chunk in enumerate(self.chunks):
                self.deadlines_in_body.append(current_deadline())
                if index == self.fail_at_chunk:
                    raise self.fail_exc
                yield chunk
        finally:
            self.closed += 1


def hold_slot(middleware, environ=None):
    """Admit a request whose body is not read yet: it holds its slot."""
    server = Server()
    response = middleware(environ or make_environ(), server.start_response)
    assert middleware.stats()["in_flight"] >= 1
    return response


# -- the happy path --------------------------------------------------------------


def test_passes_through_and_sets_environ(fast_path):
    probe = Probe(chunks=[b"hel", b"lo"])
    app, middleware = validated(probe, fast_path, max_concurrency=2, max_queue=2)
    before = time.monotonic_ns()
    server, body = call(app, make_environ(**{BUDGET_ENVIRON_KEY: "800"}))
    assert (server.status, body) == ("200 OK", b"hello")
    deadline = probe.environ[DEADLINE_KEY]
    assert isinstance(deadline, Deadline)
    assert before + 800 * NS_PER_MS <= deadline.ns <= time.monotonic_ns() + 800 * NS_PER_MS
    assert probe.environ[BUDGET_SOURCE_KEY] == BUDGET_HEADER
    assert isinstance(probe.environ[QUEUE_WAIT_MS_KEY], float)
    assert 0 <= probe.environ[QUEUE_WAIT_MS_KEY] < 5000
    stats = middleware.stats()
    assert (stats["started"], stats["completed"], stats["in_flight"]) == (1, 1, 0)


def test_app_and_streaming_body_run_inside_the_deadline_scope(fast_path):
    probe = Probe(chunks=[b"a", b"b", b"c"])
    app, _ = validated(probe, fast_path, max_concurrency=1, max_queue=0)
    call(app)
    deadline = probe.environ[DEADLINE_KEY]
    assert probe.deadline_in_call is deadline
    assert probe.deadlines_in_body == [deadline] * 3
    assert current_deadline() is None  # nothing leaks into the server's context


def test_default_budget_when_no_header(fast_path):
    probe = Probe()
    app, _ = validated(probe, fast_path, max_concurrency=1, max_queue=0, default_budget_ms=250)
    before = time.monotonic_ns()
    call(app)
    assert probe.environ[BUDGET_SOURCE_KEY] is None
    assert before + 250 * NS_PER_MS <= probe.environ[DEADLINE_KEY].ns <= time.monotonic_ns() + 250 * NS_PER_MS


def test_an_outer_earlier_deadline_wins(fast_path):
    probe = Probe()
    app, _ = validated(probe, fast_path, max_concurrency=1, max_queue=0)
    outer = Deadline.after(0.5)
    with deadline_scope(outer):
        call(app)
    assert probe.environ[DEADLINE_KEY] is outer
    assert probe.deadline_in_call is outer


def test_an_outer_deadline_already_passed_refuses_before_the_app(fast_path):
    # Stacked admission (an embedding around the middleware, a pool task
    # calling it): the inner layer must not start the app past the outer deadline.
    probe = Probe()
    app, middleware = validated(probe, fast_path, max_concurrency=1, max_queue=1)
    server, body = deadline_context(Deadline.after_ms(-5)).run(call, app)
    assert_refusal(server, body, "504 Gateway Timeout", "expired-on-arrival")
    assert probe.calls == 0
    assert middleware.stats()["started"] == 0


def test_an_outer_deadline_bounds_the_wait_in_line(fast_path):
    probe = Probe()
    app, middleware = validated(probe, fast_path, max_concurrency=1, max_queue=1, default_budget_ms=30000)
    held = hold_slot(middleware)
    started = time.monotonic()
    # In a thread, so a regression that waits for the 30 s policy fails instead of hanging.
    with ThreadPoolExecutor(max_workers=1) as waiter:
        try:
            server, body = waiter.submit(deadline_context(Deadline.after_ms(50)).run, call, app).result(timeout=10)
        finally:
            held.close()
    assert_refusal(server, body, "504 Gateway Timeout", "expired-in-queue")
    assert time.monotonic() - started >= 0.04
    assert middleware.stats()["in_flight"] == 0


# -- refusals by the queue -----------------------------------------------------------


def assert_refusal(server, body, status, reason, *, retry_after=None):
    assert server.status == status
    assert server.header[REASON_HEADER_NAME] == reason
    assert server.header["Content-Length"] == str(len(body))
    assert server.header["Content-Type"].startswith("text/plain")
    assert reason in body.decode()
    assert server.header.get("Retry-After") == retry_after


def test_queue_full_is_503_and_the_app_is_not_called(fast_path):
    probe = Probe()
    app, middleware = validated(probe, fast_path, max_concurrency=1, max_queue=0, retry_after_s=3)
    held = hold_slot(middleware)
    calls_before = probe.calls
    server, body = call(app)
    assert_refusal(server, body, "503 Service Unavailable", "queue-full", retry_after="3")
    assert probe.calls == calls_before
    held.close()
    stats = middleware.stats()
    assert (stats["rejected_full"], stats["responses_503"], stats["in_flight"]) == (1, 1, 0)


def refused_after_measuring(app, middleware):
    """Traffic for longer than one measuring window (250 ms), then a request refused queue-full."""
    until = time.monotonic() + 0.4
    while time.monotonic() < until:
        call(app)
    held = hold_slot(middleware)
    server, body = call(app)
    held.close()
    return server, body


def test_queue_full_carries_the_lines_measured_wait_by_default(fast_path):
    app, middleware = validated(Probe(), fast_path, max_concurrency=1, max_queue=0)
    server, body = refused_after_measuring(app, middleware)
    wait_ns = middleware.queue.retry_after_ns
    assert wait_ns > 0, "the line measured its drain"
    ms = -(-wait_ns // 1_000_000)
    assert server.header[RETRY_AFTER_MS_HEADER_NAME] == str(ms)
    assert_refusal(server, body, "503 Service Unavailable", "queue-full", retry_after=str(max(1, -(-ms // 1000))))


def test_a_fixed_retry_after_is_sent_as_it_is(fast_path):
    app, middleware = validated(Probe(), fast_path, max_concurrency=1, max_queue=0, retry_after_s=3)
    server, _ = refused_after_measuring(app, middleware)
    assert middleware.queue.retry_after_ns > 0
    assert (server.header["Retry-After"], server.header.get(RETRY_AFTER_MS_HEADER_NAME)) == ("3", None)


@pytest.mark.parametrize("budget", ["0", "-25", "0.0"])
def test_no_budget_left_is_504_expired_on_arrival(budget, fast_path):
    probe = Probe()
    app, middleware = validated(probe, fast_path, max_concurrency=1, max_queue=1)
    server, body = call(app, make_environ(**{BUDGET_ENVIRON_KEY: budget}))
    assert_refusal(server, body, "504 Gateway Timeout", "expired-on-arrival")
    assert probe.calls == 0
    stats = middleware.stats()
    assert (stats["expired_on_arrival"], stats["responses_504"], stats["started"]) == (1, 1, 0)


def test_deadline_passing_in_the_queue_is_504_expired_in_queue(fast_path):
    probe = Probe()
    app, middleware = validated(probe, fast_path, max_concurrency=1, max_queue=1)
    held = hold_slot(middleware)
    calls_before = probe.calls
    started = time.monotonic()
    # In a thread, so a regression that ignores the deadline fails instead of hanging.
    with ThreadPoolExecutor(max_workers=1) as waiter:
        try:
            server, body = waiter.submit(call, app, make_environ(**{BUDGET_ENVIRON_KEY: "50"})).result(timeout=10)
        finally:
            held.close()
    waited = time.monotonic() - started
    assert_refusal(server, body, "504 Gateway Timeout", "expired-in-queue")
    assert probe.calls == calls_before
    assert 0.04 <= waited < 5
    stats = middleware.stats()
    assert (stats["expired_in_queue"], stats["in_flight"], stats["queued"]) == (1, 0, 0)


def test_shut_down_queue_answers_503(fast_path):
    probe = Probe()
    app, middleware = validated(probe, fast_path, max_concurrency=1, max_queue=1)
    middleware.queue.shutdown()
    server, body = call(app)
    assert_refusal(server, body, "503 Service Unavailable", "shutting-down", retry_after="1")
    assert RETRY_AFTER_MS_HEADER_NAME not in server.header, "a drain is not measured: the fixed second"
    assert probe.calls == 0


# -- refusals raised by the app ----------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status", "reason", "retry_after", "counter"),
    [
        (DeadlineExceeded(), "504 Gateway Timeout", "deadline-exceeded", None, "app_deadline_exceeded"),
        (DeadlineExceeded("db-timeout"), "504 Gateway Timeout", "db-timeout", None, "app_deadline_exceeded"),
        (
            DeadlineExceeded("no-budget-for-downstream"),
            "504 Gateway Timeout",
            "no-budget-for-downstream",
            None,
            "app_deadline_exceeded",
        ),
        (DownstreamOverloaded(), "503 Service Unavailable", "downstream-overloaded", "1", "app_downstream_overloaded"),
        (DownstreamOverloaded("queue-full"), "503 Service Unavailable", "queue-full", "1", "app_downstream_overloaded"),
    ],
)
@pytest.mark.parametrize("where", ["call", "first-chunk"])
def test_app_refusals_keep_their_status(exc, status, reason, retry_after, counter, where, fast_path):
    probe = Probe(fail_in_call=exc) if where == "call" else Probe(chunks=[b"never"], fail_at_chunk=0, fail_exc=exc)
    app, middleware = validated(probe, fast_path, max_concurrency=1, max_queue=0)
    server, body = call(app)
    assert_refusal(server, body, status, reason, retry_after=retry_after)
    # The app had called start_response("200 OK"); the refusal replaced it.
    assert server.statuses == ["200 OK", status]
    stats = middleware.stats()
    assert stats[counter] == 1
    assert stats["responses_" + status[:3]] == 1
    assert (stats["in_flight"], stats["completed"]) == (0, 1)


def test_generator_app_refusing_before_start_response(fast_path):
    def generator_app(environ, start_response):
        raise DeadlineExceeded("late")
        yield b""  # makes this a generator: start_response is never reached

    app, middleware = validated(generator_app, fast_path, max_concurrency=1, max_queue=0)
    server, body = call(app)
    assert_refusal(server, body, "504 Gateway Timeout", "late")
    assert server.statuses == ["504 Gateway Timeout"]
    assert middleware.stats()["in_flight"] == 0


def test_unsafe_reason_from_the_app_is_replaced(fast_path):
    probe = Probe(fail_in_call=DeadlineExceeded("bad\r\nX-Evil: 1"))
    app, _ = validated(probe, fast_path, max_concurrency=1, max_queue=0)
    server, body = call(app)
    assert_refusal(server, body, "504 Gateway Timeout", "deadline-exceeded")
    assert "X-Evil" not in server.header


@pytest.mark.parametrize("exc", [DeadlineExceeded("late"), DownstreamOverloaded()])
def test_refusal_after_output_propagates_and_releases(exc, fast_path):
    probe = Probe(chunks=[b"first", b"second"], fail_at_chunk=1, fail_exc=exc)
    middleware = AdmissionMiddleware(probe, fast_path=fast_path, max_concurrency=1, max_queue=0)
    server = Server()
    with pytest.raises(type(exc)):
        server.run(middleware, make_environ())
    assert server.statuses == ["200 OK"]
    assert server.written == [b"first"]
    stats = middleware.stats()
    assert (stats["in_flight"], stats["completed"], stats["responses_503"], stats["responses_504"]) == (0, 1, 0, 0)
    assert probe.closed == 1


def test_other_exceptions_propagate_unchanged_and_release(fast_path):
    boom = ValueError("boom")
    probe = Probe(fail_in_call=boom)
    middleware = AdmissionMiddleware(probe, fast_path=fast_path, max_concurrency=1, max_queue=0)
    with pytest.raises(ValueError) as info:
        call(middleware)
    assert info.value is boom
    assert middleware.stats()["in_flight"] == 0
    # The only slot really is free again: the next request runs.
    probe.fail_in_call = None
    server, _ = call(middleware)
    assert server.status == "200 OK"


# -- the write() callable -------------------------------------------------------------


def write_app(environ, start_response):
    write = start_response("200 OK", [("Content-Type", "text/plain")])
    write(b"written ")
    return [b"returned"]


def test_write_callable_app(fast_path):
    app, middleware = validated(write_app, fast_path, max_concurrency=1, max_queue=0)
    server, body = call(app)
    assert (server.status, body) == ("200 OK", b"written returned")
    assert middleware.stats()["in_flight"] == 0


def test_refusal_after_write_propagates(fast_path):
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])(b"partial")
        raise DeadlineExceeded("late")

    middleware = AdmissionMiddleware(app, fast_path=fast_path, max_concurrency=1, max_queue=0)
    server = Server()
    with pytest.raises(DeadlineExceeded):
        server.run(middleware, make_environ())
    assert server.statuses == ["200 OK"]
    stats = middleware.stats()
    assert (stats["in_flight"], stats["app_deadline_exceeded"], stats["responses_504"]) == (0, 1, 0)


# -- the slot is released exactly once --------------------------------------------------


class CountingRelease:
    def __init__(self):
        self.count = 0

    def __call__(self):
        self.count += 1


class ClosingBody:
    """A non-generator body that counts close() calls."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.closed = 0

    def __iter__(self):
        return iter(self.chunks)

    def close(self):
        self.closed += 1


@pytest.fixture(params=["python", "compiled"])
def admitted_path(request, monkeypatch):
    """``run_admitted`` on its Python specification, then on the compiled twin (``_wsgi_c.call_admitted``)."""
    if request.param == "python":
        monkeypatch.setattr(wsgi_module, "_COMPILED_PATH", None)
    elif wsgi_module._COMPILED_PATH is None:
        if extension_wanted():
            pytest.fail("the compiled WSGI path is not built")
        pytest.skip("PRAZO_NO_EXTENSIONS is set: there is no compiled WSGI path")
    return request.param


def admitted(app, environ=None):
    release = CountingRelease()
    server = Server()
    response = run_admitted(
        app, environ or make_environ(), server.start_response, Deadline.after(5), release, 2_500_000
    )
    return response, release, server


def body_app(body):
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return body

    return app


@pytest.mark.usefixtures("admitted_path")
def test_release_once_when_exhausted_then_closed():
    body = ClosingBody([b"a", b"b"])
    response, release, _ = admitted(body_app(body))
    assert list(response) == [b"a", b"b"]
    assert release.count == 1  # at exhaustion, before close()
    response.close()
    response.close()
    assert (release.count, body.closed) == (1, 1)


@pytest.mark.usefixtures("admitted_path")
def test_release_once_when_closed_without_iterating():
    body = ClosingBody([b"a"])
    response, release, _ = admitted(body_app(body))
    assert release.count == 0  # holds the slot while the body is pending
    response.close()
    assert (release.count, body.closed) == (1, 1)


@pytest.mark.usefixtures("admitted_path")
def test_streaming_body_holds_its_slot_until_done():
    probe = Probe(chunks=[b"1", b"2", b"3"])
    response, release, _ = admitted(probe)
    iterator = iter(response)
    assert next(iterator) == b"1"
    assert next(iterator) == b"2"
    assert release.count == 0
    assert next(iterator) == b"3"
    with pytest.raises(StopIteration):
        next(iterator)
    assert release.count == 1
    response.close()
    assert (release.count, probe.closed) == (1, 1)


@pytest.mark.usefixtures("admitted_path")
def test_abandoned_generator_is_closed_and_released_once():
    probe = Probe(chunks=[b"1", b"2", b"3"])
    response, release, _ = admitted(probe)
    iterator = iter(response)
    assert next(iterator) == b"1"
    response.close()  # the client went away mid-stream
    assert (release.count, probe.closed) == (1, 1)
    with pytest.raises(StopIteration):
        next(iterator)  # a closed generator ends; nothing is released twice
    assert release.count == 1


@pytest.mark.usefixtures("admitted_path")
def test_release_once_when_the_app_call_raises():
    response_release = CountingRelease()
    with pytest.raises(KeyError):
        run_admitted(
            Probe(fail_in_call=KeyError("x")),
            make_environ(),
            Server().start_response,
            Deadline.after(5),
            response_release,
            0,
        )
    gc.collect()
    assert response_release.count == 1


@pytest.mark.usefixtures("admitted_path")
def test_release_once_when_iteration_raises_then_close():
    probe = Probe(chunks=[b"1", b"2"], fail_at_chunk=1, fail_exc=RuntimeError("mid-body"))
    response, release, _ = admitted(probe)
    iterator = iter(response)
    assert next(iterator) == b"1"
    with pytest.raises(RuntimeError, match="mid-body"):
        next(iterator)
    assert release.count == 1
    response.close()
    assert (release.count, probe.closed) == (1, 1)


@pytest.mark.usefixtures("admitted_path")
def test_release_once_when_inner_close_raises():
    class FailingClose(ClosingBody):
        def close(self):
            super().close()
            raise OSError("close failed")

    body = FailingClose([b"a"])
    response, release, _ = admitted(body_app(body))
    with pytest.raises(OSError, match="close failed"):
        response.close()
    response.close()
    assert (release.count, body.closed) == (1, 1)


@pytest.mark.usefixtures("admitted_path")
def test_release_once_for_write_callable_app():
    response, release, server = admitted(write_app)
    assert list(response) == [b"returned"]
    response.close()
    assert server.written == [b"written "]
    assert release.count == 1


@pytest.mark.usefixtures("admitted_path")
def test_converted_refusal_releases_once_and_closes_the_app_body():
    body_closed = []

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])

        def body():
            try:
                raise DownstreamOverloaded()
                yield b""
            finally:
                body_closed.append(True)

        return body()

    counters = MiddlewareCounters()
    release = CountingRelease()
    server = Server()
    response = run_admitted(
        app, make_environ(), server.start_response, Deadline.after(5), release, 0, counters=counters, retry_after_s=7
    )
    body = b"".join(response)
    response.close()
    assert server.status == "503 Service Unavailable"
    assert server.header["Retry-After"] == "7"
    assert body == b"503 Service Unavailable: downstream-overloaded\n"
    assert release.count == 1
    assert body_closed == [True]
    assert counters.snapshot()["app_downstream_overloaded"] == 1
    assert counters.snapshot()["responses_503"] == 1


@pytest.mark.parametrize("body", [[b"a", b"b"], (b"a", b"b")], ids=["list", "tuple"])
@pytest.mark.usefixtures("admitted_path")
def test_list_body_releases_once_at_exhaustion_close_or_collection(body):
    response, release, _ = admitted(body_app(body))
    assert release.count == 0  # held while the body is pending
    assert len(response) == 2  # the app's, so a server can still size the response
    iterator = iter(response)
    assert next(iterator) == b"a"
    assert release.count == 0
    assert list(iterator) == [b"b"]
    assert release.count == 1  # at exhaustion, before close()
    response.close()
    assert release.count == 1

    response, release, _ = admitted(body_app(body))
    response.close()  # the client went away before the first chunk
    assert (release.count, list(response)) == (1, [])

    response, release, _ = admitted(body_app(body))
    del response  # a server that forgets close()
    gc.collect()
    assert release.count == 1


def test_dropped_without_close_still_releases(fast_path):
    middleware = AdmissionMiddleware(Probe(), fast_path=fast_path, max_concurrency=1, max_queue=0)
    response = middleware(make_environ(), Server().start_response)
    assert middleware.stats()["in_flight"] == 1
    del response
    gc.collect()
    assert middleware.stats()["in_flight"] == 0


@pytest.mark.usefixtures("admitted_path")
def test_run_admitted_sets_queue_wait():
    probe = Probe()
    response, _, _ = admitted(probe)
    response.close()
    assert probe.environ[QUEUE_WAIT_MS_KEY] == 2.5


# -- bypass -------------------------------------------------------------------------


def test_bypass_skips_the_queue_but_keeps_the_deadline(fast_path):
    probe = Probe()
    app, middleware = validated(probe, fast_path, max_concurrency=1, max_queue=0, bypass=["/healthz"])
    held = hold_slot(middleware)
    server, body = call(app, make_environ("/healthz"))
    assert (server.status, body) == ("200 OK", b"ok")
    assert isinstance(probe.environ[DEADLINE_KEY], Deadline)
    assert probe.environ[QUEUE_WAIT_MS_KEY] == 0.0
    assert probe.deadline_in_call is probe.environ[DEADLINE_KEY]
    # Exact PATH_INFO match only.
    server, _ = call(app, make_environ("/healthz/deep"))
    assert server.status == "503 Service Unavailable"
    held.close()
    stats = middleware.stats()
    assert (stats["bypassed"], stats["offered"], stats["in_flight"]) == (1, 2, 0)


def test_bypassed_app_refusal_is_still_translated(fast_path):
    app, middleware = validated(
        Probe(fail_in_call=DeadlineExceeded()), fast_path, max_concurrency=1, max_queue=0, bypass={"/healthz"}
    )
    server, _ = call(app, make_environ("/healthz"))
    assert server.status == "504 Gateway Timeout"
    assert middleware.stats()["app_deadline_exceeded"] == 1


@pytest.mark.parametrize(
    ("bypass", "error"),
    [("/healthz", TypeError), ([b"/healthz"], TypeError), (["healthz"], ValueError), (5, TypeError)],
)
def test_bypass_validation(bypass, error):
    with pytest.raises(error, match="bypass"):
        AdmissionMiddleware(Probe(), max_concurrency=1, max_queue=0, bypass=bypass)


# -- budget headers ------------------------------------------------------------------


def test_invalid_headers_are_counted_and_never_extend(fast_path):
    probe = Probe()
    app, middleware = validated(probe, fast_path, max_concurrency=1, max_queue=0, default_budget_ms=200)
    before = time.monotonic_ns()
    call(app, make_environ(**{BUDGET_ENVIRON_KEY: "99999999999999999999", GRPC_TIMEOUT_ENVIRON_KEY: "1h"}))
    assert probe.environ[DEADLINE_KEY].ns <= time.monotonic_ns() + 200 * NS_PER_MS
    assert probe.environ[DEADLINE_KEY].ns >= before + 200 * NS_PER_MS
    assert middleware.stats()["invalid_budget_header"] == 2


def test_client_cannot_extend_the_policy(fast_path):
    probe = Probe()
    app, _ = validated(probe, fast_path, max_concurrency=1, max_queue=0, max_budget_ms=300)
    call(app, make_environ(**{BUDGET_ENVIRON_KEY: "60000"}))
    assert probe.environ[DEADLINE_KEY].ns <= time.monotonic_ns() + 300 * NS_PER_MS


HEADER_VALUE = st.text(max_size=24) | st.from_regex(r"\A-?[0-9]{1,14}(\.[0-9]{1,4})?[HMSmun]?\Z")
BUDGET_KEYS = [BUDGET_ENVIRON_KEY, GRPC_TIMEOUT_ENVIRON_KEY, ENVOY_TIMEOUT_ENVIRON_KEY]


@settings(max_examples=examples(150), deadline=None)
@given(extra=st.dictionaries(st.sampled_from(BUDGET_KEYS), HEADER_VALUE))
def test_random_headers_never_500_and_never_beyond_policy(extra, fast_path):
    probe = Probe()
    middleware = AdmissionMiddleware(
        probe, fast_path=fast_path, max_concurrency=1, max_queue=0, default_budget_ms=100, max_budget_ms=400
    )
    server, _ = call(validator(middleware), make_environ(**extra))
    assert server.status in ("200 OK", "504 Gateway Timeout")
    if server.status == "200 OK":
        assert probe.environ[DEADLINE_KEY].ns <= time.monotonic_ns() + 400 * NS_PER_MS
    else:
        assert server.header[REASON_HEADER_NAME] == "expired-on-arrival"
        assert probe.calls == 0
    assert middleware.stats()["in_flight"] == 0


# -- construction, pieces and stats ---------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"max_concurrency": 0}, ValueError, "max_concurrency"),
        ({"max_concurrency": 1.5}, TypeError, "max_concurrency"),
        ({"max_queue": -1}, ValueError, "max_queue"),
        ({"default_budget_ms": float("nan")}, ValueError, "default_budget_ms"),
        ({"max_budget_ms": 0}, ValueError, "max_budget_ms"),
        ({"order": "random"}, ValueError, "order"),
        ({"retry_after_s": -1}, ValueError, "retry_after_s"),
        ({"retry_after_s": 1.5}, TypeError, "retry_after_s"),
        ({"retry_after_s": "measured"}, TypeError, "retry_after_s"),
    ],
)
def test_constructor_validation(kwargs, error, argument):
    options = {"max_concurrency": 1, "max_queue": 0, **kwargs}
    with pytest.raises(error, match=argument):
        AdmissionMiddleware(Probe(), **options)


def test_a_default_budget_above_the_maximum_is_refused_naming_both():
    """Issue 33: accepted before, though no request could ever get that default (the maximum caps it)."""
    with pytest.raises(ValueError, match=r"default_budget_ms must be <= max_budget_ms, got 100 > 10"):
        AdmissionMiddleware(Probe(), max_concurrency=1, max_queue=0, default_budget_ms=100, max_budget_ms=10)
    with pytest.raises(ValueError, match=r"default_budget_ms must be <= max_budget_ms, got 40000 > 30000"):
        AdmissionMiddleware(Probe(), max_concurrency=1, max_queue=0, default_budget_ms=40000)


def test_a_maximum_alone_below_the_default_budget_brings_the_default_down():
    middleware = AdmissionMiddleware(Probe(), max_concurrency=1, max_queue=0, max_budget_ms=300)
    assert (middleware.policy.default_budget_ms, middleware.policy.max_budget_ms) == (300, 300)
    assert AdmissionMiddleware(Probe(), max_concurrency=1, max_queue=0).policy.default_budget_ms == 1000


def test_app_must_be_callable():
    with pytest.raises(TypeError, match="app"):
        AdmissionMiddleware("not an app", max_concurrency=1, max_queue=0)


def test_properties_and_repr(fast_path):
    probe = Probe()
    middleware = AdmissionMiddleware(
        probe, fast_path=fast_path, max_concurrency=3, max_queue=5, order="lifo", max_budget_ms=700
    )
    assert middleware.app is probe
    assert (middleware.queue.max_concurrency, middleware.queue.max_queue, middleware.queue.order) == (3, 5, "lifo")
    assert middleware.policy.max_budget_ms == 700
    assert "max_concurrency=3" in repr(middleware)


def test_stats_has_queue_and_middleware_counters(fast_path):
    stats = AdmissionMiddleware(Probe(), fast_path=fast_path, max_concurrency=1, max_queue=0).stats()
    for key in (*MiddlewareCounters.NAMES, "offered", "started", "completed", "rejected_full", "expired", "in_flight"):
        assert stats[key] == 0


def test_request_deadline_sets_source_and_counts_invalid():
    counters = MiddlewareCounters()
    environ = make_environ(**{BUDGET_ENVIRON_KEY: "junk", GRPC_TIMEOUT_ENVIRON_KEY: "300m"})
    deadline, incoming = request_deadline(BudgetPolicy(), environ, 10**12, counters)
    assert deadline.ns == 10**12 + 300 * NS_PER_MS
    assert environ[BUDGET_SOURCE_KEY] == incoming.source == "grpc-timeout"
    assert counters.snapshot()["invalid_budget_header"] == 1
    environ = make_environ(**{BUDGET_ENVIRON_KEY: "junk"})
    deadline, _ = request_deadline(BudgetPolicy(default_budget_ms=50), environ, 10**12)
    assert (deadline.ns, environ[BUDGET_SOURCE_KEY]) == (10**12 + 50 * NS_PER_MS, None)


def test_counters_reject_unknown_names():
    with pytest.raises(ValueError, match="name"):
        MiddlewareCounters().add("responses_500")


@pytest.mark.parametrize(
    ("exc", "status", "reason"),
    [
        (QueueFull(), "503 Service Unavailable", "queue-full"),
        (DeadlineExceeded("expired-in-queue"), "504 Gateway Timeout", "expired-in-queue"),
        (DownstreamOverloaded(), "503 Service Unavailable", "downstream-overloaded"),
        (ShutDown(), "503 Service Unavailable", "shutting-down"),
        (DeadlineExceeded(""), "504 Gateway Timeout", "deadline-exceeded"),
        (QueueFull("x" * 200), "503 Service Unavailable", "queue-full"),
    ],
)
def test_rejection_response(exc, status, reason):
    status_line, headers, body = rejection_response(exc, retry_after_s=9)
    headers = dict(headers)
    assert status_line == status
    assert headers[REASON_HEADER_NAME] == reason
    assert headers["Content-Length"] == str(len(body))
    assert headers["Cache-Control"] == "no-store"
    assert body == f"{status}: {reason}\n".encode()
    assert headers.get("Retry-After") == ("9" if status.startswith("503") else None)


def test_rejection_response_refuses_other_exceptions():
    with pytest.raises(TypeError, match="exc"):
        rejection_response(ValueError("nope"))
    with pytest.raises(TypeError, match="retry_after_s"):
        rejection_response(QueueFull(), retry_after_s="1")


def test_send_rejection_passes_exc_info_to_the_server():
    server = Server()
    server.start_response("200 OK", [("Content-Type", "text/plain")])
    try:
        raise DeadlineExceeded("late")
    except DeadlineExceeded as exc:
        import sys

        body = send_rejection(server.start_response, exc, exc_info=sys.exc_info())
    assert server.statuses == ["200 OK", "504 Gateway Timeout"]
    assert body == [b"504 Gateway Timeout: late\n"]
