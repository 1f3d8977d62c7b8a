"""Fuzz target: ``AdmissionMiddleware`` fed arbitrary requests and misbehaving apps.

Input: the text format of ``_common``. The first line is ``METHOD PATH?QUERY``;
header lines become the ``HTTP_*`` keys a server makes (duplicates joined,
letter case and ``_``/``-`` folded); a header line ``$KEY: value`` sets the raw
environ key ``KEY`` instead, and ``%KEY: value`` sets it to *bytes* (a broken
server). Options:

=================  ==========================================================
``default/max``    the policy's budgets, ms
``concurrency``    1-4 (default 2); ``queue``: 0-4 (default 2); ``order``
``app``            what the app does: ``list`` (default), ``raise``,
                   ``deadline``, ``overloaded`` (raise those), ``read`` (reads
                   ``wsgi.input``), ``check`` (``Deadline.check()``, then a
                   list), ``no-start`` (never calls ``start_response``);
                   generators: ``gen``, ``gen-raise``, ``gen-deadline`` and
                   ``gen-overloaded`` (refuse before any output),
                   ``gen-deadline-late`` and ``gen-overloaded-late`` (after
                   the first chunk); bodies whose ``__iter__`` or ``close``
                   raises: ``iter-raise``, ``close-raise``; other bodies:
                   ``tuple``, ``empty``, ``none``, ``str``, ``bytes``,
                   ``mixed``, ``list-subclass``
``reason``         the reason the app's exceptions carry (any text)
``input``          ``raise``: ``wsgi.input`` raises on every read
``busy``           1: every slot is held by other work when the request
                   arrives (it waits when its budget is at most 5 ms, else the
                   line has no room: ``max_queue`` becomes 0)
``shutdown``       1: the queue is shut down first
``bypass``         a bypass path
``consume``        how much of the body the server reads: ``all`` (default),
                   ``first``, ``none``; ``close=0`` drops it without ``close()``
``outer``          ms: a deadline already current around the call
``subclass``       1: the environ is a ``dict`` subclass
=================  ==========================================================

Each input runs on every path it can: the compiled WSGI path over the C twin,
the Python path over the C twin and the Python path over the Python twin.

Properties, for any input and on every path:

* nothing escapes but what the app (its body, its ``close``, ``wsgi.input``)
  raised, and a ``TypeError`` for a body that is not iterable (PEP 3333 makes
  both the server's business): no exception of the middleware's own, and
  never a 500 from it;
* the status is the app's own, or one of the documented refusals with its
  ``X-Prazo-Reason`` (a header-safe token) and ``Retry-After`` on a 503;
* the app never runs with a budget <= 0 (its request is answered 504) or with
  an already expired deadline, and the deadline it sees is at most
  ``arrival + max_budget_ms`` and is the current deadline;
* every admitted request releases its slot exactly once, and no finaliser
  fails doing it: afterwards the queue's counters balance, nothing is in flight or queued, and ``started ==
  completed``;
* where the outcome cannot depend on timing (the time the request has, its
  budget or an ``outer`` deadline if that is shorter, is 0 or at least
  ``_STABLE_BUDGET_NS``), all paths answer and count the same.
"""

from __future__ import annotations

import gc
import io
import re
import sys
import time
from typing import Any, NamedTuple

from prazo.bindings.wsgi import (
    BUDGET_SOURCE_KEY,
    DEADLINE_KEY,
    QUEUE_WAIT_MS_KEY,
    AdmissionMiddleware,
)
from prazo.core import (
    IMPLEMENTATION,
    NS_PER_MS,
    REASON_DEADLINE_EXCEEDED,
    REASON_DOWNSTREAM_OVERLOADED,
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    REASON_QUEUE_FULL,
    Deadline,
    DeadlineExceeded,
    DownstreamOverloaded,
    current_deadline,
    deadline_context,
)
from prazo.core._queue_py import AdmissionQueue as PythonQueue

from ._common import Spec, budget_options, cgi_environ, option_int, parse_spec, policy_from

_SHUTTING_DOWN = "shutting-down"
_503 = "503 Service Unavailable"
_504 = "504 Gateway Timeout"
_APP_STATUS = "200 OK"
# The answers of a request the app never saw (docs/how-to/wsgi-middleware.md).
_REFUSALS = {
    (_503, REASON_QUEUE_FULL),
    (_503, _SHUTTING_DOWN),
    (_504, REASON_EXPIRED_ON_ARRIVAL),
    (_504, REASON_EXPIRED_IN_QUEUE),
}
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)
# A request waits for a busy slot only when its budget is this short, so an
# input costs milliseconds at most.
_MAX_WAIT_NS = 5 * NS_PER_MS
# From this budget on, only a stall of a second between arrival and admission
# could change the outcome, so every path must give the same one. An outer
# deadline bounds admission too (``request_deadline``): a short one makes the
# outcome timing-dependent whatever the headers say (``_time_available_ns``).
_STABLE_BUDGET_NS = 1000 * NS_PER_MS
_FAR_DEADLINE_S = 3600.0


class AppError(Exception):
    """What the app, its body and ``wsgi.input`` raise: the server's to answer."""


class _PythonTwinMiddleware(AdmissionMiddleware):
    queue_class = PythonQueue  # type: ignore[assignment]


# (middleware class, fast_path): the compiled path needs the C twin.
_PATHS: tuple[tuple[type[AdmissionMiddleware], bool], ...] = (
    ((AdmissionMiddleware, True), (AdmissionMiddleware, False)) if IMPLEMENTATION == "c" else ()
) + ((_PythonTwinMiddleware, False),)


class _RaisingInput(io.RawIOBase):
    """A ``wsgi.input`` whose client went away: every read raises."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        raise AppError("wsgi.input: connection reset")


class _FailingBody:
    """An app's response iterable whose ``__iter__`` or ``close()`` (called by the server, PEP 3333) raises."""

    def __init__(self, raised: list[BaseException], failing: str) -> None:
        self._raised = raised
        self._failing = failing

    def _fail(self, where: str) -> None:
        if self._failing == where:
            self._raised.append(AppError(f"{where} failed"))
            raise self._raised[-1]

    def __iter__(self) -> Any:
        self._fail("iter")
        return iter((b"a", b"b"))

    def close(self) -> None:
        self._fail("close")


class _ListSubclass(list):  # type: ignore[type-arg]
    """Looks like a list body but is not one: neither path may treat it as inert."""


# Bodies the app returns as they are (``app=NAME``); the default is a list.
_BODIES = {
    "tuple": (b"a", b"b"),
    "empty": [],
    "none": None,
    "str": "text, not bytes",
    "bytes": b"bytes, not a list of them",
    "mixed": [b"a", "b", 3, None],
    "list-subclass": _ListSubclass([b"a", b"b"]),
}
# ``app=NAME`` whose body is not iterable: the TypeError is the server's to answer.
_NOT_ITERABLE = ("none",)


class _AppRun:
    """The app of one request, recording what it saw and what it raised."""

    def __init__(self, behaviour: str, reason: str) -> None:
        self.behaviour = behaviour
        self.reason = reason
        self.calls = 0
        self.raised: list[BaseException] = []
        self.seen: tuple[int, float, Deadline, Deadline | None] | None = None

    def _raise(self, exc: BaseException) -> None:
        self.raised.append(exc)
        raise exc

    def _refusal(self, kind: str) -> BaseException:
        return DeadlineExceeded(self.reason) if kind == "deadline" else DownstreamOverloaded(self.reason)

    def _generator(self, start_response: Any) -> Any:
        start_response(_APP_STATUS, [("Content-Type", "text/plain")])
        # gen-deadline / gen-overloaded refuse before any output, so the
        # refusal replaces the response; "-late" refuses after the first chunk.
        kind = self.behaviour.removeprefix("gen-").removesuffix("-late")
        if kind in ("deadline", "overloaded") and not self.behaviour.endswith("-late"):
            self._raise(self._refusal(kind))
        yield b"first"
        if kind == "raise":
            self._raise(AppError("body failed"))
        if kind in ("deadline", "overloaded"):
            self._raise(self._refusal(kind))
        yield b"second"

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        self.calls += 1
        now_ns = time.monotonic_ns()
        self.seen = (now_ns, environ[QUEUE_WAIT_MS_KEY], environ[DEADLINE_KEY], current_deadline())
        behaviour = self.behaviour
        if behaviour.startswith("gen"):
            return self._generator(start_response)
        if behaviour == "raise":
            self._raise(AppError("app failed"))
        if behaviour in ("deadline", "overloaded"):
            self._raise(self._refusal(behaviour))
        if behaviour == "check":
            try:
                environ[DEADLINE_KEY].check()
            except DeadlineExceeded as exc:
                self.raised.append(exc)
                raise
        if behaviour == "read":
            environ["wsgi.input"].read()
        if behaviour != "no-start":
            start_response(_APP_STATUS, [("Content-Type", "text/plain")])
        if behaviour in ("iter-raise", "close-raise"):
            return _FailingBody(self.raised, behaviour.removesuffix("-raise"))
        return _BODIES.get(behaviour, [b"hello"])


class _Server:
    """The server side of one request: ``start_response`` and the body loop (PEP 3333)."""

    def __init__(self) -> None:
        self.status: str | None = None
        self.headers: list[tuple[str, str]] = []
        self.headers_sent = False
        self.chunks: list[Any] = []

    def start_response(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        if exc_info is not None and self.headers_sent:
            raise exc_info[1].with_traceback(exc_info[2])
        self.status, self.headers = status, headers
        return self.chunks.append

    def serve(self, app: Any, environ: Any, consume: str, close: bool) -> None:
        result = app(environ, self.start_response)
        try:
            if consume != "none":
                for chunk in result:
                    self.headers_sent = self.headers_sent or bool(chunk)
                    self.chunks.append(chunk)
                    if consume == "first":
                        break
        finally:
            if close and hasattr(result, "close"):
                result.close()


class _Outcome(NamedTuple):
    status: str | None
    reason: str | None
    body: tuple[Any, ...]
    app_calls: int
    escaped: str | None
    budget_source: object
    counters: tuple[tuple[str, int], ...]


# Counters that do not depend on timing, compared across paths.
_COMPARED_COUNTERS = (
    "offered",
    "started",
    "completed",
    "rejected_full",
    "expired_on_arrival",
    "expired_in_queue",
    "invalid_budget_header",
    "app_deadline_exceeded",
    "app_downstream_overloaded",
    "bypassed",
    "responses_503",
    "responses_504",
)


def _environ(spec: Spec, input_raises: bool, subclass: bool) -> dict[str, Any]:
    method, _, target = spec.first_line.partition(" ")
    path, _, query = target.partition("?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "SERVER_NAME": "fuzz",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": _RaisingInput() if input_raises else io.BytesIO(b"body"),
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    environ.update(cgi_environ((name, value) for name, value in spec.headers if name[:1] not in "$%"))
    for name, value in spec.headers:
        if name[:1] == "$":
            environ[name[1:]] = value
        elif name[:1] == "%":
            environ[name[1:]] = value.encode("utf-8", "surrogateescape")
    return type("FuzzEnviron", (dict,), {})(environ) if subclass else environ


def _outer_ms(options: dict[str, str]) -> int:
    """The ``outer`` option: ms of a deadline made current just before the call, 0 for none."""
    return option_int(options, "outer", 0, 0, 10**9)


def _check_response(server: _Server, app: _AppRun) -> str | None:
    """The status and headers are the app's or a documented refusal; return the reason header."""
    for _name, value in server.headers:
        assert "\r" not in value and "\n" not in value, server.headers
    headers = dict(server.headers)
    reason = headers.get("X-Prazo-Reason")
    if reason is not None:
        assert _TOKEN.fullmatch(reason), reason
        assert server.status == _504 or "Retry-After" in headers, server.headers
    if app.calls == 0:
        assert (server.status, reason) in _REFUSALS, (server.status, reason)
    elif reason is not None:
        # The app raised DeadlineExceeded / DownstreamOverloaded before its output.
        refusal = next(exc for exc in app.raised if isinstance(exc, (DeadlineExceeded, DownstreamOverloaded)))
        status, fallback = (
            (_504, REASON_DEADLINE_EXCEEDED)
            if isinstance(refusal, DeadlineExceeded)
            else (_503, REASON_DOWNSTREAM_OVERLOADED)
        )
        assert server.status == status and reason in (refusal.reason, fallback), (server.status, reason)
    else:
        assert server.status in (_APP_STATUS, None), server.status
    return reason


def _run_path(middleware_class: type[AdmissionMiddleware], fast_path: bool, spec: Spec, budget_ns: int) -> _Outcome:
    options = spec.options
    behaviour = options.get("app", "list")
    concurrency = option_int(options, "concurrency", 2, 1, 4)
    busy = options.get("busy") == "1"
    max_queue = option_int(options, "queue", 2, 0, 4) if not busy or budget_ns <= _MAX_WAIT_NS else 0
    bypass = options.get("bypass", "")
    mw = middleware_class(
        _AppRun(behaviour, options.get("reason", "app-reason")),
        max_concurrency=concurrency,
        max_queue=max_queue,
        **budget_options(options),
        order="lifo" if options.get("order") == "lifo" else "fifo",
        bypass=(bypass,) if bypass.startswith("/") else (),
        fast_path=fast_path,
    )
    app: _AppRun = mw.app  # type: ignore[assignment]
    queue = mw.queue
    holders = concurrency if busy else 0
    for _ in range(holders):
        queue.acquire(Deadline.after(_FAR_DEADLINE_S))
    if options.get("shutdown") == "1":
        queue.shutdown()
    environ = _environ(spec, options.get("input") == "raise", options.get("subclass") == "1")
    server = _Server()
    outer = _outer_ms(options)
    context = deadline_context(Deadline.after_ms(outer)) if outer else None
    serve = (server.serve, mw, environ, options.get("consume", "all"), options.get("close") != "0")

    escaped = None
    before_ns = time.monotonic_ns()
    try:
        if context is None:
            serve[0](*serve[1:])
        else:
            context.run(*serve)
    except BaseException as exc:
        allowed = (
            any(exc is raised for raised in app.raised)
            or (isinstance(exc, TypeError) and behaviour in _NOT_ITERABLE)
            or (isinstance(exc, AppError) and behaviour == "read")
        )
        if not allowed:
            raise
        escaped = type(exc).__name__
    # The exceptions' tracebacks hold the frames that hold the response body,
    # and ``app.raised`` holds the exceptions: drop the frames so an unclosed
    # body is collected (and releases its slot) as it would be on a server.
    for raised in app.raised:
        raised.__traceback__ = None
    for _ in range(holders):
        queue.release()

    is_bypass = environ.get("PATH_INFO") == bypass and bypass.startswith("/")
    if app.seen is not None:
        called_ns, queue_wait_ms, deadline, current = app.seen
        assert current is deadline, (deadline, current)
        assert deadline.ns <= called_ns + int(mw.policy.max_budget_ms * NS_PER_MS), (deadline.ns, called_ns)
        assert queue_wait_ms >= 0
        if not is_bypass:
            # Admitted: the queue granted the slot before the deadline in
            # force (an outer one included), and so after the request arrived
            # (which is after before_ns).
            assert budget_ns > 0 and deadline.ns > before_ns, (budget_ns, deadline.ns)
    reason = _check_response(server, app)
    if budget_ns == 0 and not is_bypass:
        # No time left: answered 504 at once (a shut-down queue says so first).
        assert (server.status, reason) in ((_504, REASON_EXPIRED_ON_ARRIVAL), (_503, _SHUTTING_DOWN)), server.status

    stats = mw.stats()
    if stats["in_flight"]:
        # A body dropped without close() is released when it is collected,
        # which a reference cycle through an exception can postpone.
        gc.collect()
        stats = mw.stats()
    assert stats["in_flight"] == 0 and stats["queued"] == 0 and stats["assigned"] == 0, stats
    assert stats["started"] == stats["completed"], stats
    assert stats["offered"] == (stats["started"] + stats["rejected_full"] + stats["expired"] + stats["cancelled"]), (
        stats
    )
    return _Outcome(
        server.status,
        reason,
        tuple(server.chunks),
        app.calls,
        escaped,
        environ.get(BUDGET_SOURCE_KEY),
        tuple((name, stats[name]) for name in _COMPARED_COUNTERS),
    )


def _time_available_ns(spec: Spec, budget_ns: int) -> int:
    """The time a request with this budget has on every path: an outer deadline that comes first bounds it.

    Each path takes ``outer`` ms from just before its call, so a stall of that
    long on one path alone (a busy machine, a garbage collection) expires it
    there and not on the others: the outcome depends on timing unless this is
    0 or at least ``_STABLE_BUDGET_NS``.
    """
    outer = _outer_ms(spec.options)
    return min(budget_ns, outer * NS_PER_MS) if outer else budget_ns


def test_one_input(data: bytes) -> None:
    spec = parse_spec(data)
    # The budget every path grants this request (the environ it reads is the same).
    budget_ns = policy_from(spec.options).deadline_for(_environ(spec, False, False), 0)[0].ns
    available_ns = _time_available_ns(spec, budget_ns)
    # A finaliser that releases a slot (a body dropped without close()) must
    # not fail either; Python would only print what it raised.
    unraisable: list[Any] = []
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        outcomes = [_run_path(middleware_class, fast_path, spec, budget_ns) for middleware_class, fast_path in _PATHS]
    finally:
        sys.unraisablehook = previous_hook
    assert not unraisable, [(hook.exc_value, hook.object) for hook in unraisable]
    if available_ns == 0 or available_ns >= _STABLE_BUDGET_NS:
        assert all(outcome == outcomes[0] for outcome in outcomes), outcomes
