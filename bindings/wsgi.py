"""WSGI admission control: a bounded queue and a deadline in front of an app.

Wrap any WSGI application::

    from prazo.bindings.wsgi import AdmissionMiddleware

    app = AdmissionMiddleware(
        app,
        max_concurrency=8,        # requests running the app at once
        max_queue=32,             # requests waiting for one of those slots
        default_budget_ms=1000,   # when the caller sends no budget header
        max_budget_ms=30000,      # the most any caller can ask for
        bypass={"/healthz"},      # never queued, never rejected
    )

Each request gets a deadline when it reaches the middleware (see
``prazo.bindings.headers.BudgetPolicy``) and is then answered one of:

=======  =======================  =============================================
status   ``X-Prazo-Reason``       when
=======  =======================  =============================================
503      ``queue-full``           every slot busy and the waiting line full
503      ``shed-standing-queue``  ``order="adaptive"``: waited longer than CoDel allows
503      ``evicted-by-critical``  a critical request took its place in a full line
504      ``expired-on-arrival``   the caller's budget was already used up
504      ``expired-in-queue``     the deadline passed while waiting for a slot
504      ``insufficient-budget``  less budget left than ``expected_service_ms``
504      *the app's reason*       the app raised ``DeadlineExceeded``
503      *the app's reason*       the app raised ``DownstreamOverloaded``
=======  =======================  =============================================

A 503 carries ``Retry-After``. The app is never called for a request refused
by the queue. Everything else is the app's own response.

The pieces the middleware is built from are public, so a server embedding
that admits requests at its own queue reuses them instead of copying:
``request_deadline`` turns headers into a deadline (counting invalid ones),
``rejection_response``/``send_rejection`` write the answer for a refusal, and
``run_admitted`` runs an already admitted request and releases its slot
exactly once.

Environ keys set for the app: ``prazo.deadline`` (the ``Deadline``),
``prazo.queue_wait_ms`` (float) and ``prazo.budget_source`` (the header that
set the budget, or None when the default applied).

The response iterable is wrapped (that is how the slot follows the body), so
a server's ``wsgi.file_wrapper`` sendfile shortcut does not apply behind the
middleware; the file is still served, by iteration.

The common case (no bypass path, no budget header or a plain integer
``X-Request-Budget-Ms``, admitted, a list or tuple body) has a compiled twin,
``prazo.bindings._wsgi_c``, used when it is built and the middleware's queue
is the C twin of ``prazo.core`` (``PRAZO_NO_EXTENSIONS=1`` turns both off).
This module is its specification: everything else it hands back to the
functions below, so both paths answer, count and release identically.
``AdmissionMiddleware(..., fast_path=False)`` keeps a middleware on the
Python path; ``mw.fast_path`` says which one it runs.

Why one file of about 900 lines: it is the specification of the compiled
fast path, and the two must be read side by side; the refusal answers, the
response bodies that release the slot exactly once, and the middleware are
the three parts of that one contract, and every server embedding imports
them from here.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import Context
from functools import partial
from types import GeneratorType, ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, cast

from prazo.bindings.headers import (
    REASON_HEADER_NAME,
    RETRY_AFTER_MS_HEADER_NAME,
    BudgetPolicy,
    IncomingBudget,
    budget_limits,
)
from prazo.bindings.plumbing.expiry_cap import optional_expiry_cap
from prazo.bindings.plumbing.load_report import LoadReport, optional_load_report
from prazo.bindings.policies import CriticalClassifier, checked_paths, queue_options
from prazo.core import (
    IMPLEMENTATION,
    NS_PER_MS,
    REASON_DEADLINE_EXCEEDED,
    REASON_DOWNSTREAM_OVERLOADED,
    REASON_QUEUE_FULL,
    REASON_SHUTTING_DOWN,
    AdmissionQueue,
    Deadline,
    DeadlineExceeded,
    DownstreamOverloaded,
    LatencyHistogram,
    QueueFull,
    ShutDown,
    current_deadline,
    deadline_context,
)
from prazo.core.compiled import import_compiled
from prazo.core.shadow import OBSERVE_SETTLE_NS, ShadowLine

__all__ = [
    "BUDGET_SOURCE_KEY",
    "DEADLINE_KEY",
    "DEFAULT_RETRY_AFTER_S",
    "OUTCOME_ADMITTED",
    "OUTCOME_BYPASSED",
    "OUTCOME_REFUSED",
    "QUEUE_WAIT_MS_KEY",
    "REASON_SHUTTING_DOWN",
    "AdmissionMiddleware",
    "AdmissionObserver",
    "AdmittedResponse",
    "Environ",
    "ListBody",
    "MiddlewareCounters",
    "StartResponse",
    "TimedRelease",
    "WSGIApp",
    "admission_observer",
    "measured_or_fixed_retry_after",
    "rejection_response",
    "request_deadline",
    "retry_after_headers",
    "run_admitted",
    "send_rejection",
    "set_admission_observer",
    "status_and_reason",
]

DEADLINE_KEY = "prazo.deadline"
QUEUE_WAIT_MS_KEY = "prazo.queue_wait_ms"
BUDGET_SOURCE_KEY = "prazo.budget_source"

# Type aliases for the WSGI callables (PEP 3333), shared by the server embeddings.
Environ = dict[str, Any]
ExcInfo = tuple[Any, Any, Any]
StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

# What an admission decided, as an observer is told.
OUTCOME_ADMITTED = "admitted"
OUTCOME_BYPASSED = "bypassed"
OUTCOME_REFUSED = "refused"

#: ``observer(environ, outcome, arrival_ns, deadline_ns, queue_wait_ns, refusal)``:
#: called in the thread that decided, before the app runs (admitted, bypassed)
#: or the refusal is answered. ``environ`` is None where a server refuses
#: before it parsed the request; ``arrival_ns`` is None when unknown;
#: ``refusal`` is the ``QueueFull``/``DeadlineExceeded``/``ShutDown`` of a refusal.
AdmissionObserver = Callable[[Environ | None, str, int | None, int, int, BaseException | None], object]

# The one observer (prazo.bindings.integrations.opentelemetry installs one). None, the
# default, costs each request one global read and nothing else.
_observer: AdmissionObserver | None = None

_STATUS_LINES = {503: "503 Service Unavailable", 504: "504 Gateway Timeout"}
_INERT_BODIES = (list, tuple)
# Never equal to a body chunk: marks the end of iter(callable, sentinel).
_END_OF_BODY = object()
# A reason goes into a response header: only token characters, so an app's
# exception can never inject a header or a line break.
_REASON_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)


def status_and_reason(exc: BaseException) -> tuple[int, str]:
    """The status (503/504) and the ``X-Prazo-Reason`` of the refusal answering ``exc``; TypeError for others."""
    if isinstance(exc, DeadlineExceeded):
        status, fallback = 504, REASON_DEADLINE_EXCEEDED
    elif isinstance(exc, DownstreamOverloaded):
        status, fallback = 503, REASON_DOWNSTREAM_OVERLOADED
    elif isinstance(exc, QueueFull):
        status, fallback = 503, REASON_QUEUE_FULL
    elif isinstance(exc, ShutDown):
        return 503, REASON_SHUTTING_DOWN
    else:
        raise TypeError(
            f"exc must be QueueFull, DeadlineExceeded, DownstreamOverloaded or ShutDown, not {type(exc).__name__}"
        )
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and _REASON_RE.fullmatch(reason):
        return status, reason
    return status, fallback


# A 503's Retry-After when nothing else is known (a fixed retry_after_s, or the line before its first measurement).
DEFAULT_RETRY_AFTER_S = 1


def _validate_retry_after(retry_after_s: object) -> int:
    if isinstance(retry_after_s, bool) or not isinstance(retry_after_s, int):
        raise TypeError(f"retry_after_s must be an int of seconds, not {type(retry_after_s).__name__}")
    if retry_after_s < 0:
        raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
    return retry_after_s


def measured_or_fixed_retry_after(retry_after_s: object) -> tuple[bool, int]:
    """``retry_after_s=`` of a binding: None measures the wait from the line (True, with 1 s before the
    first measurement); an int of seconds is the fixed value of every 503 (False, it)."""
    if retry_after_s is None:
        return True, DEFAULT_RETRY_AFTER_S
    if isinstance(retry_after_s, bool) or not isinstance(retry_after_s, int):
        raise TypeError(
            f"retry_after_s must be None (measured) or an int of seconds, not {type(retry_after_s).__name__}"
        )
    return False, _validate_retry_after(retry_after_s)


def retry_after_headers(exc: BaseException, retry_after_s: int, retry_after_ns: int = 0) -> list[tuple[str, str]]:
    """The wait a 503 asks for: the line's measured wait for its overload refusals (``QueueFull``: queue-full,
    shed, evicted) when ``retry_after_ns`` > 0, in whole seconds (at least 1) and in ms beside it; else the fixed
    ``retry_after_s``.

    >>> retry_after_headers(QueueFull(), 1, 1_500_000_000)
    [('Retry-After', '2'), ('X-Prazo-Retry-After-Ms', '1500')]
    >>> retry_after_headers(QueueFull(), 1)
    [('Retry-After', '1')]
    """
    if retry_after_ns > 0 and isinstance(exc, QueueFull):
        seconds = max(1, -(-retry_after_ns // 1_000_000_000))
        return [("Retry-After", str(seconds)), (RETRY_AFTER_MS_HEADER_NAME, str(-(-retry_after_ns // 1_000_000)))]
    return [("Retry-After", str(retry_after_s))]


def rejection_response(
    exc: BaseException, *, retry_after_s: int = 1, retry_after_ns: int = 0
) -> tuple[str, list[tuple[str, str]], bytes]:
    """The ``(status, headers, body)`` answering a refusal.

    ``DeadlineExceeded`` gives 504; ``QueueFull``, ``DownstreamOverloaded``
    and ``ShutDown`` give 503 with ``Retry-After: retry_after_s``, or for a
    ``QueueFull`` the line's measured wait ``retry_after_ns`` when it is > 0
    (``retry_after_headers``). The reason goes into ``X-Prazo-Reason`` and a
    short text body; ``Content-Length`` is set. Any other exception raises
    ``TypeError``.

    >>> status, headers, body = rejection_response(QueueFull())
    >>> status, dict(headers)["X-Prazo-Reason"], body
    ('503 Service Unavailable', 'queue-full', b'503 Service Unavailable: queue-full\\n')
    """
    retry_after_s = _validate_retry_after(retry_after_s)
    status, reason = status_and_reason(exc)
    status_line = _STATUS_LINES[status]
    body = f"{status_line}: {reason}\n".encode("ascii")
    headers = [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(body))),
        # A refusal describes this moment only; no cache should replay it.
        ("Cache-Control", "no-store"),
        (REASON_HEADER_NAME, reason),
    ]
    if status == 503:
        headers.extend(retry_after_headers(exc, retry_after_s, retry_after_ns))
    return status_line, headers, body


def send_rejection(
    start_response: StartResponse,
    exc: BaseException,
    *,
    retry_after_s: int = 1,
    retry_after_ns: int = 0,
    exc_info: ExcInfo | None = None,
) -> list[bytes]:
    """Start the refusal response for ``exc`` and return its body iterable.

    Pass ``exc_info`` when the app may already have called ``start_response``
    (PEP 3333: the server then replaces the headers, or re-raises if they
    were already sent).
    """
    status, headers, body = rejection_response(exc, retry_after_s=retry_after_s, retry_after_ns=retry_after_ns)
    if exc_info is None:
        start_response(status, headers)
    else:
        start_response(status, headers, exc_info)
    return [body]


class MiddlewareCounters:
    """Thread-safe counters of what the WSGI layer did beyond the queue's own.

    ``invalid_budget_header`` (headers that did not parse), ``bypassed``,
    ``app_deadline_exceeded`` / ``app_downstream_overloaded`` (the app raised
    them), ``responses_503`` / ``responses_504`` (refusals sent by prazo).
    Only rare events are counted, so the lock is off the fast path.
    """

    NAMES = (
        "invalid_budget_header",
        "app_deadline_exceeded",
        "app_downstream_overloaded",
        "bypassed",
        "responses_503",
        "responses_504",
        "expiry_refusals_capped",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.NAMES, 0)

    def add(self, name: str, count: int = 1) -> None:
        """Add ``count`` to the counter ``name`` (one of ``NAMES``)."""
        if name not in self._values:
            raise ValueError(f"name must be one of {self.NAMES}, got {name!r}")
        with self._lock:
            self._values[name] += count

    def count_response(self, exc: BaseException) -> None:
        """Count the refusal response sent for ``exc`` (503 or 504)."""
        status, _ = status_and_reason(exc)
        self.add(f"responses_{status}")

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters."""
        with self._lock:
            return dict(self._values)


def request_deadline(
    policy: BudgetPolicy, environ: Environ, arrival_ns: int, counters: MiddlewareCounters | None = None
) -> tuple[Deadline, IncomingBudget]:
    """The request's deadline from ``policy``, with the bookkeeping every binding needs.

    Sets ``prazo.budget_source`` in ``environ`` and counts invalid budget
    headers in ``counters``; returns what ``policy.deadline_for`` returns,
    except that a current deadline that is earlier wins: with admission
    stacked (a server embedding around a middleware, a middleware called
    from a pool task) the inner layer never waits, nor starts the app, past
    the outer layer's deadline.
    """
    deadline, incoming = policy.deadline_for(environ, arrival_ns)
    if incoming.invalid and counters is not None:
        counters.add("invalid_budget_header", incoming.invalid)
    environ[BUDGET_SOURCE_KEY] = incoming.source
    outer = current_deadline()
    if outer is not None and outer.ns < deadline.ns:
        deadline = outer
    return deadline, incoming


def _reject(
    exc: QueueFull | DeadlineExceeded | ShutDown,
    start_response: StartResponse,
    counters: MiddlewareCounters,
    retry_after_s: int,
    retry_after_ns: int = 0,
) -> list[bytes]:
    """Answer and count a refusal by the queue (with its measured wait, when > 0): the app is never called."""
    counters.count_response(exc)
    return send_rejection(start_response, exc, retry_after_s=retry_after_s, retry_after_ns=retry_after_ns)


def _refuse(
    exc: DeadlineExceeded | DownstreamOverloaded,
    start_response: StartResponse,
    counters: MiddlewareCounters | None,
    retry_after_s: int,
) -> list[bytes]:
    """Answer a refusal the app raised; call it inside the ``except`` that caught ``exc``."""
    if counters is not None:
        counters.add("app_deadline_exceeded" if isinstance(exc, DeadlineExceeded) else "app_downstream_overloaded")
    exc_info = sys.exc_info()
    try:
        body = send_rejection(start_response, exc, retry_after_s=retry_after_s)
    except Exception:  # noqa: BLE001 - the server's way of saying "already started" (AssertionError, RuntimeError)
        # The app had started its response: PEP 3333 wants exc_info now, and
        # the server replaces headers not yet sent or re-raises ``exc`` if they
        # were. Not passed up front: a server must re-raise whenever it gets
        # exc_info without a response started (werkzeug's test client does).
        body = send_rejection(start_response, exc, retry_after_s=retry_after_s, exc_info=exc_info)
    finally:
        del exc_info
    if counters is not None:
        counters.count_response(exc)
    return body


class _ReleasedOnce:
    """Holds a request's ``release`` and calls it exactly once, from ``_finish``."""

    __slots__ = ("_claim",)

    def __init__(self, release: Callable[[], object]) -> None:
        # A one-element list: list.pop() is atomic, so concurrent paths
        # (close() racing exhaustion, the finaliser) release exactly once.
        self._claim = [release]

    def _finish(self) -> None:
        # The truth test spares the common repeat calls an exception;
        # pop() stays the atomic claim when two paths race.
        if self._claim:
            try:
                release = self._claim.pop()
            except IndexError:
                return
            release()


class ListBody(_ReleasedOnce):
    """A list or tuple body that calls ``release()`` once: exhausted, closed or collected.

    Iterating a list runs no app code, so no context is needed. ``len()`` is
    the app's list's: waitress sets ``Content-Length`` itself only for a body
    whose ``len()`` is 1 (without it, an HTTP/1.0 keep-alive client gets
    ``Connection: close``). After ``close()`` it yields nothing.
    """

    __slots__ = ("_chunks", "_length")

    def __init__(self, body: list[bytes] | tuple[bytes, ...], release: Callable[[], object]) -> None:
        super().__init__(release)
        self._chunks: Iterator[bytes] = iter(body)
        self._length = len(body)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._chunks)
        except StopIteration:
            self._finish()
            raise

    def close(self) -> None:
        """Release the slot if it is still held; later calls do nothing."""
        self._chunks = iter(())
        self._finish()

    def __del__(self) -> None:
        # A safety net for servers that drop the body without close().
        self._finish()


class AdmittedResponse(_ReleasedOnce):
    """The response iterable of an admitted request whose body runs app code.

    ``run_admitted`` returns one when the app's body is not a plain list or
    tuple (a generator, a framework's response iterable, ...). Effects: each
    chunk is produced inside ``context``, where the request's deadline is
    current, so streaming generators see it too. ``release()`` is called
    exactly once, at the first of: the body is exhausted, ``close()`` is
    called, the body raises, or the response is garbage collected. The app's
    own ``close()`` is called exactly once, from ``close()``. If the body
    raises ``DeadlineExceeded`` / ``DownstreamOverloaded`` while the server
    has not sent the headers yet, the response becomes a 504 / 503; once they
    are sent the exception propagates and the server closes the connection.

    >>> def numbers():
    ...     yield b"1"
    ...     yield b"2"
    >>> from contextvars import copy_context
    >>> released = []
    >>> response = AdmittedResponse(numbers(), copy_context(), None, lambda: released.append(1))
    >>> list(response), released
    ([b'1', b'2'], [1])
    >>> response.close(); released
    [1]
    """

    __slots__ = ("_closed", "_context", "_counters", "_result", "_retry_after_s", "_start_response")

    def __init__(
        self,
        result: Iterable[bytes],
        context: Context,
        start_response: StartResponse,
        release: Callable[[], object],
        counters: MiddlewareCounters | None = None,
        retry_after_s: int = 1,
    ) -> None:
        super().__init__(release)
        self._result = result
        self._context = context
        self._start_response = start_response
        self._counters = counters
        self._retry_after_s = retry_after_s
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        return self._stream()

    def _stream(self) -> Iterator[bytes]:
        run = self._context.run
        result = self._result
        try:
            # iter() of a generator is the generator itself: no app code runs, no context switch needed.
            iterator = result if type(result) is GeneratorType else run(iter, result)
            # iter(callable, sentinel) ends, in C, when ``next`` raises
            # StopIteration: each chunk costs one context switch and no
            # Python-level exception, which matters on every request.
            yield from iter(partial(run, next, iterator), _END_OF_BODY)
        except (DeadlineExceeded, DownstreamOverloaded) as exc:
            self._finish()
            # Serve the refusal instead; the app's iterable is still closed
            # by close(), as PEP 3333 requires.
            yield from _refuse(exc, self._start_response, self._counters, self._retry_after_s)
        finally:
            self._finish()

    def close(self) -> None:
        """Close the app's iterable (once) and release the slot if still held."""
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._result, "close", None)
            if close is not None:
                self._context.run(close)
        finally:
            self._finish()

    def __del__(self) -> None:
        # A safety net for servers that drop the iterable without close():
        # the slot must never leak, or capacity shrinks for good.
        self._finish()


def _call_admitted(
    app: WSGIApp,
    environ: Environ,
    start_response: StartResponse,
    deadline: Deadline,
    release: Callable[[], object],
    queue_wait_ns: int,
    counters: MiddlewareCounters | None,
    retry_after_s: int,
    arrival_ns: int | None,
    outcome: str,
) -> Iterable[bytes]:
    """``run_admitted`` with positional arguments only: keywords cost on every request."""
    try:
        if _observer is not None:
            # Inside the try: an observer that raises still gives the slot back.
            _observer(environ, outcome, arrival_ns, deadline.ns, queue_wait_ns, None)
        environ[QUEUE_WAIT_MS_KEY] = queue_wait_ns / NS_PER_MS
        outer = current_deadline()
        context = deadline_context(deadline)
        # With an outer deadline the earlier one wins (a callee never extends
        # its caller's); the environ shows the one actually in force.
        environ[DEADLINE_KEY] = deadline if outer is None else context.run(current_deadline)
        result = context.run(app, environ, start_response)
    except (DeadlineExceeded, DownstreamOverloaded) as exc:
        release()
        return _refuse(exc, start_response, counters, retry_after_s)
    except BaseException:
        release()
        raise
    if type(result) in _INERT_BODIES:
        return ListBody(cast("list[bytes] | tuple[bytes, ...]", result), release)
    return AdmittedResponse(result, context, start_response, release, counters, retry_after_s)


def run_admitted(
    app: WSGIApp,
    environ: Environ,
    start_response: StartResponse,
    deadline: Deadline,
    release: Callable[[], object],
    queue_wait_ns: int,
    *,
    counters: MiddlewareCounters | None = None,
    retry_after_s: int = 1,
    arrival_ns: int | None = None,
) -> Iterable[bytes]:
    """Run a request that already holds a slot; return its response iterable.

    Sets ``prazo.deadline`` and ``prazo.queue_wait_ms`` in ``environ`` and
    calls ``app`` in a copy of the current context where ``deadline`` is
    current (an earlier one already current wins). ``release()`` is called
    exactly once: at once if the app raises, otherwise when the body is
    exhausted, closed, raises or is garbage collected — whichever comes
    first. ``DeadlineExceeded`` / ``DownstreamOverloaded`` raised by the app
    become a 504 / 503 while no output has been sent, and are counted in
    ``counters``. A list or tuple body comes back wrapped in a ``ListBody``
    (it runs no app code, and keeps the list's ``len()``); any other body in
    an ``AdmittedResponse``. ``arrival_ns`` (when the request arrived, if
    known) is for the admission observer (``set_admission_observer``), which
    is told of the admission before the app runs.
    """
    if _COMPILED_PATH is not None and type(environ) is dict and type(deadline) is Deadline:
        # The same steps in C (prazo.bindings._wsgi_c.call_admitted): every
        # admitted request of the server embeddings and the front door.
        return _COMPILED_PATH.call_admitted(  # type: ignore[no-any-return]
            app, environ, start_response, deadline, release, queue_wait_ns, counters, retry_after_s, arrival_ns,
            OUTCOME_ADMITTED,
        )  # fmt: skip
    return _call_admitted(
        app,
        environ,
        start_response,
        deadline,
        release,
        queue_wait_ns,
        counters,
        retry_after_s,
        arrival_ns,
        OUTCOME_ADMITTED,
    )


class TimedRelease:
    """A ``release`` that also records, in a histogram, the time since ``start_ns``.

    What an admitted request's slot is released through when latency
    recording is on (``AdmissionMiddleware(..., record_latency=True)``): the
    duration is taken when the slot goes back, so it covers the queue wait,
    the app and the whole response body.
    """

    __slots__ = ("_record", "_release", "_start_ns")

    def __init__(self, release: Callable[[], object], record: Callable[[int], object], start_ns: int) -> None:
        self._release = release
        self._record = record
        self._start_ns = start_ns

    def __call__(self) -> None:
        try:
            self._release()
        finally:
            self._record(time.monotonic_ns() - self._start_ns)


def _nothing_to_release() -> None:
    """The release of a bypassed request, which never took a slot."""


def _shadow_finished(shadow: ShadowLine, token: object) -> None:
    """The release of an observed request: the shadow learns its service time."""
    shadow.finished(token, time.monotonic_ns())


def _import_compiled_path() -> ModuleType | None:
    """``prazo.bindings._wsgi_c``, or None when the C twin of the queue is not in use or it is not built."""
    if IMPLEMENTATION != "c":
        return None
    return import_compiled(
        "prazo.bindings._wsgi_c", "the compiled WSGI path", "AdmissionMiddleware runs on its Python path"
    )


_COMPILED_PATH = _import_compiled_path()


def set_admission_observer(observer: AdmissionObserver | None) -> AdmissionObserver | None:
    """Tell ``observer`` of every admission decision from now on (None: nobody); return the previous one.

    One observer for the process, shared by every middleware (both paths),
    ``run_admitted`` (the server embeddings, the front door's admitted
    requests) and the server dispatcher's refusals. It runs on the request's
    path, in the thread and context that decided, so it must be quick and
    must not raise (one that raises before an app runs makes that request
    fail, though its slot is given back). ``prazo.bindings.integrations.opentelemetry``
    installs one with ``instrument()``.
    """
    global _observer
    if observer is not None and not callable(observer):
        raise TypeError(f"observer must be a callable or None, not {type(observer).__name__}")
    previous, _observer = _observer, observer
    if _COMPILED_PATH is not None:
        _COMPILED_PATH.set_observer(observer)
    return previous


def admission_observer() -> AdmissionObserver | None:
    """The observer ``set_admission_observer`` installed, or None."""
    return _observer


def _compiled_path_for(
    fast_path: object,
    app: WSGIApp,
    queue: AdmissionQueue,
    policy: BudgetPolicy,
    bypass: frozenset[str],
    counters: MiddlewareCounters,
    retry_after_s: int,
    critical: CriticalClassifier | None,
    measured_retry_after: bool,
) -> Any:
    """The ``_wsgi_c.CompiledPath`` a middleware runs on, or None for the Python path (see ``fast_path``)."""
    if fast_path is not None and not isinstance(fast_path, bool):
        raise TypeError(f"fast_path must be True, False or None, not {type(fast_path).__name__}")
    if fast_path is False:
        return None
    if _COMPILED_PATH is None:
        missing = "the compiled extension prazo.bindings._wsgi_c, which is not built or PRAZO_NO_EXTENSIONS=1 disables"
    elif not _COMPILED_PATH.supports(queue):
        missing = f"the C twin of the admission queue, not {type(queue).__module__}.{type(queue).__qualname__}"
    else:
        return _COMPILED_PATH.CompiledPath(
            app, queue, policy, bypass, counters, retry_after_s, critical, measured_retry_after
        )
    if fast_path:
        raise ValueError(f"fast_path=True needs {missing}")
    return None


class AdmissionMiddleware:
    """Bounded concurrency, a bounded waiting line and deadlines for a WSGI app.

    Effects, per request:

    - the deadline is ``arrival + min(incoming budget or default_budget_ms,
      max_budget_ms)`` (invalid budget headers are ignored and counted);
      ``default_budget_ms`` not given is 1000, or ``max_budget_ms`` when that
      is lower, and one given above ``max_budget_ms`` is a ``ValueError``;
    - at most ``max_concurrency`` requests run the app; up to ``max_queue``
      more wait (``order="fifo"`` or ``"lifo"``); beyond that the answer is
      an immediate 503 ``queue-full`` with ``Retry-After: retry_after_s``;
    - a request whose deadline passes before it gets a slot is answered 504
      (``expired-on-arrival`` / ``expired-in-queue``) and the app never runs;
    - the app runs inside ``deadline_scope`` with ``prazo.deadline``,
      ``prazo.queue_wait_ms`` and ``prazo.budget_source`` in the environ;
      ``DeadlineExceeded`` / ``DownstreamOverloaded`` raised by the app become
      504 / 503 while no output has been sent;
    - the slot is held until the body is exhausted, closed or raises, and
      its service time (start to release) is a sample for the queue's
      learned policies.

    The queue policies are ``AdmissionQueue``'s, passed through (None keeps
    the queue's default): ``order="adaptive"`` (adaptive LIFO with CoDel
    shedding, ``codel_target_ms`` / ``codel_interval_ms``: 503
    ``shed-standing-queue``), ``expected_service_ms`` (a number or
    ``"p50"``/``"p90"``/``"p95"``/``"p99"``: a request with less budget left
    never waits or starts, 504 ``insufficient-budget``), ``limit="vegas"``
    with ``min_concurrency`` (an adaptive concurrency limit) and ``reserved``
    (slots only critical requests use). ``critical`` says which requests are
    critical: a callable ``environ -> bool`` (one that raises makes the
    request normal and is logged), or a header name (critical when its value
    is ``critical``, case-insensitive — a client can send it, so trust it only
    behind a proxy that strips it). A critical request that finds the line
    full pushes out the newest normal waiter (503 ``evicted-by-critical``).

    Requests whose ``PATH_INFO`` is exactly one of ``bypass`` skip the queue
    (never 503/504 from admission) but still get a deadline, its scope and
    the environ keys, so a health check's own outgoing calls stay bounded.

    ``fast_path``: None (the default) runs the common case on the compiled
    twin (``prazo.bindings._wsgi_c``) whenever it is built and the queue is
    the C twin; False always runs the Python path; True requires the compiled
    one (``ValueError`` when it cannot run). Both behave identically; the
    ``fast_path`` property says which one this middleware runs.

    >>> def hello(environ, start_response):
    ...     start_response("200 OK", [("Content-Type", "text/plain")])
    ...     return [b"hello"]
    >>> app = AdmissionMiddleware(hello, max_concurrency=4, max_queue=16)
    >>> app.stats()["max_concurrency"]
    4

    ``record_latency=True`` records every admitted request into two
    ``prazo.core.LatencyHistogram``: ``request_duration`` (arrival to the
    release of its slot: queue wait, app and body) and ``queue_wait``, on
    both paths; ``prazo.bindings.integrations.prometheus`` exports them as Prometheus
    histograms. Off (the default), they are None and cost nothing.

    ``load_report="text"`` or ``"json"`` adds the ORCA ``endpoint-load-metrics``
    header (``prazo.bindings.plumbing.load_report``), computed from ``stats()``
    at most once a second, to every response it lets through and to its own
    503/504 refusals, for a balancer that weighs endpoints by it (Envoy's
    client-side weighted round robin). None (the default) adds nothing.

    ``observe_only=True`` is the dry run before enforcing: every request
    runs at once, as it would with no middleware (on the Python path), and a
    shadow line (``prazo.core.shadow.ShadowLine``) with these limits and
    policies decides what this middleware would have done with the same
    arrivals and service times. Its decisions are ``stats()``' counters
    (``rejected_full``, ``expired_on_arrival``, ``expired_in_queue``,
    ``insufficient_budget``, ``shed``, ``evicted``: what would have been
    refused) and whatever exports them; ``responses_503`` / ``responses_504``
    stay what was really sent. The app still runs inside the request's
    deadline scope.

    ``max_expiry_refusal_fraction`` (off: None) caps the share of requests
    refused 504 ``expired-on-arrival`` for a budget header that arrived spent,
    over the last 10 s (``prazo.bindings.plumbing.expiry_cap``; Finagle's
    ``maxRejectFraction``): past it, such a request runs on the default budget
    and is counted ``expiry_refusals_capped``, so a broken upstream budget
    cannot refuse everything. On the Python path.

    ``queue_class`` is the admission queue it builds, the twin ``prazo.core``
    picked; a subclass may name the other twin (the benchmarks compare both).
    """

    queue_class: ClassVar[type[AdmissionQueue]] = AdmissionQueue

    def __init__(
        self,
        app: WSGIApp,
        *,
        max_concurrency: int,
        max_queue: int,
        default_budget_ms: float | None = None,
        max_budget_ms: float = 30000,
        bypass: Iterable[str] = (),
        order: str = "fifo",
        retry_after_s: int | None = None,
        fast_path: bool | None = None,
        record_latency: bool = False,
        codel_target_ms: float | None = None,
        codel_interval_ms: float | None = None,
        expected_service_ms: float | str | None = None,
        limit: str | None = None,
        min_concurrency: int | None = None,
        reserved: int | None = None,
        critical: Callable[[Environ], object] | str | None = None,
        load_report: str | None = None,
        observe_only: bool = False,
        max_expiry_refusal_fraction: float | None = None,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be a WSGI callable, not {type(app).__name__}")
        if not isinstance(observe_only, bool):
            raise TypeError(f"observe_only must be True or False, not {type(observe_only).__name__}")
        if observe_only and fast_path:
            raise ValueError("fast_path=True cannot observe only: observe_only runs on the Python path")
        self._expiry_cap = optional_expiry_cap(max_expiry_refusal_fraction)
        if self._expiry_cap is not None and fast_path:
            raise ValueError(
                "fast_path=True cannot cap expiry refusals: max_expiry_refusal_fraction runs on the Python path"
            )
        if not isinstance(record_latency, bool):
            raise TypeError(f"record_latency must be True or False, not {type(record_latency).__name__}")
        self._request_duration = LatencyHistogram() if record_latency else None
        self._queue_wait = LatencyHistogram() if record_latency else None
        self._app = app
        self._policy = BudgetPolicy(*budget_limits(default_budget_ms, max_budget_ms))
        options = queue_options(
            codel_target_ms=codel_target_ms,
            codel_interval_ms=codel_interval_ms,
            expected_service_ms=expected_service_ms,
            limit=limit,
            min_concurrency=min_concurrency,
            reserved=reserved,
        )
        # Observe-only: every request runs; the line it would have run is a shadow (its queue
        # is this middleware's queue, whose counters are the decisions it would have made).
        self._shadow = (
            ShadowLine(
                self.queue_class, max_concurrency, max_queue, order=order, settle_ns=OBSERVE_SETTLE_NS, **options
            )
            if observe_only
            else None
        )
        self._queue = (
            self._shadow.queue
            if self._shadow is not None
            else self.queue_class(max_concurrency, max_queue, order=order, **options)
        )
        self._critical = CriticalClassifier.from_option(critical)
        # Bound once: every request calls both.
        self._acquire = self._queue.acquire
        self._release = self._queue.release
        self._bypass = frozenset(checked_paths(bypass, "bypass"))
        self._measured_retry_after, self._retry_after_s = measured_or_fixed_retry_after(retry_after_s)
        self._counters = MiddlewareCounters()
        self._compiled = _compiled_path_for(
            False if observe_only or self._expiry_cap is not None else fast_path,
            app,
            self._queue,
            self._policy,
            self._bypass,
            self._counters,
            self._retry_after_s,
            self._critical,
            self._measured_retry_after,
        )
        if self._compiled is not None and record_latency:
            self._compiled.record_latency(self._request_duration, self._queue_wait)
        self._load_report = optional_load_report(load_report, self.stats)
        if self._compiled is not None and self._load_report is not None:
            self._compiled.report_load(self._load_report)

    @property
    def app(self) -> WSGIApp:
        """The wrapped application."""
        return self._app

    @property
    def queue(self) -> AdmissionQueue:
        """The admission queue (for metrics, or ``shutdown()`` when draining)."""
        return self._queue

    @property
    def policy(self) -> BudgetPolicy:
        """The budget policy that turns headers into deadlines."""
        return self._policy

    @property
    def request_duration(self) -> LatencyHistogram | None:
        """Admitted requests from arrival to the release of their slot, in ns (None unless ``record_latency``)."""
        return self._request_duration

    @property
    def queue_wait(self) -> LatencyHistogram | None:
        """How long admitted requests waited for a slot, in ns (None unless ``record_latency``)."""
        return self._queue_wait

    @property
    def load_report(self) -> LoadReport | None:
        """The ``endpoint-load-metrics`` report its responses carry (``load_report=``), or None."""
        return self._load_report

    @property
    def fast_path(self) -> bool:
        """True when the common case runs on the compiled twin (see ``fast_path=``)."""
        return self._compiled is not None

    @property
    def observe_only(self) -> bool:
        """True when every request runs and the line only counts what it would have done (``observe_only=``)."""
        return self._shadow is not None

    def stats(self) -> dict[str, int]:
        """The queue's counters merged with the middleware's own (observe-only: the shadow line's, as of now)."""
        if self._shadow is not None:
            self._shadow.catch_up(time.monotonic_ns())
            return {**self._queue.stats(), **self._counters.snapshot(), "observe_only": 1}
        return {**self._queue.stats(), **self._counters.snapshot()}

    @property
    def critical(self) -> CriticalClassifier | None:
        """What decides which requests are critical (``critical=``), or None when none are."""
        return self._critical

    def _call_python(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        """Serve one request on the Python path: every request, or those the compiled path hands over."""
        return self._serve_python(environ, start_response, None)

    def _serve_python(self, environ: Environ, start_response: StartResponse, critical: bool | None) -> Iterable[bytes]:
        """``_call_python`` for a request whose class is known (``critical`` True/False) or not yet (None).

        The compiled path hands a request over with its class once it has
        classified it, so a classifier runs once per request.
        """
        if self._load_report is not None:
            # Every response from here on, the refusals too, is started through it.
            start_response = self._load_report.start_response(start_response)
        arrival_ns = time.monotonic_ns()
        deadline, _ = request_deadline(self._policy, environ, arrival_ns, self._counters)
        if self._expiry_cap is not None:
            deadline = self._capped(deadline, arrival_ns)
        if self._bypass and environ.get("PATH_INFO", "") in self._bypass:
            self._counters.add("bypassed")
            return _call_admitted(
                self._app,
                environ,
                start_response,
                deadline,
                _nothing_to_release,
                0,
                self._counters,
                self._retry_after_s,
                arrival_ns,
                OUTCOME_BYPASSED,
            )
        if critical is None:
            critical = self._critical is not None and self._critical(environ)
        if self._shadow is not None:
            return self._observe(environ, start_response, deadline, arrival_ns, critical)
        try:
            # critical= only when set: the keyword is the core's, and a normal
            # request needs nothing beyond the plain acquire/release pair.
            started_ns = self._acquire(deadline, critical=True) if critical else self._acquire(deadline)
        except (QueueFull, DeadlineExceeded, ShutDown) as exc:
            if _observer is not None:
                _observer(environ, OUTCOME_REFUSED, arrival_ns, deadline.ns, time.monotonic_ns() - arrival_ns, exc)
            return _reject(
                exc,
                start_response,
                self._counters,
                self._retry_after_s,
                self._queue.retry_after_ns if self._measured_retry_after else 0,
            )
        queue_wait_ns = time.monotonic_ns() - arrival_ns
        # started_ns makes the request's service time a sample for the
        # learned doomed-work skip and the Vegas limit.
        release: Callable[[], object] = (
            partial(self._release, critical=True, started_ns=started_ns)
            if critical
            else partial(self._release, started_ns=started_ns)
        )
        return self._run_admitted(environ, start_response, deadline, release, queue_wait_ns, arrival_ns)

    def _run_admitted(
        self,
        environ: Environ,
        start_response: StartResponse,
        deadline: Deadline,
        release: Callable[[], object],
        queue_wait_ns: int,
        arrival_ns: int,
    ) -> Iterable[bytes]:
        """Run the app for a request let through, its latency recorded when asked (``record_latency``)."""
        if self._request_duration is not None and self._queue_wait is not None:
            self._queue_wait.record(queue_wait_ns)
            release = TimedRelease(release, self._request_duration.record, arrival_ns)
        return _call_admitted(
            self._app,
            environ,
            start_response,
            deadline,
            release,
            queue_wait_ns,
            self._counters,
            self._retry_after_s,
            arrival_ns,
            OUTCOME_ADMITTED,
        )

    def _capped(self, deadline: Deadline, arrival_ns: int) -> Deadline:
        """The deadline, or the default budget's when the cap on expiry refusals overrules a spent budget header."""
        outer = current_deadline()
        # A deadline the process already holds (an outer layer's) is real: only a header's is overruled.
        spent = deadline.ns <= arrival_ns and (outer is None or outer.ns != deadline.ns)
        if self._expiry_cap.should_refuse(spent) or not spent:  # type: ignore[union-attr]
            return deadline
        self._counters.add("expiry_refusals_capped")
        return Deadline.at_ns(arrival_ns + round(self._policy.default_budget_ms * NS_PER_MS))

    def _observe(
        self, environ: Environ, start_response: StartResponse, deadline: Deadline, arrival_ns: int, critical: bool
    ) -> Iterable[bytes]:
        """Run the request as if no line were there; tell the shadow line its arrival, and its end once it ends."""
        shadow = cast(ShadowLine, self._shadow)
        token = object()
        shadow.arrive(token, arrival_ns, deadline.ns, critical)
        return self._run_admitted(
            environ, start_response, deadline, partial(_shadow_finished, shadow, token), 0, arrival_ns
        )

    if TYPE_CHECKING:

        def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]: ...

    else:
        # Assigned rather than called from a Python ``__call__``, so the
        # compiled path costs no Python frame: ``serve`` runs the request on
        # it, or calls ``_call_python`` when this middleware has none.
        __call__ = _call_python if _COMPILED_PATH is None else _COMPILED_PATH.serve

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} app={self._app!r} max_concurrency={self._queue.max_concurrency} "
            f"max_queue={self._queue.max_queue} {self._policy!r}>"
        )
