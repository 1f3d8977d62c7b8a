"""PostgreSQL statement deadlines for psycopg 3 and psycopg2.

A statement sent to PostgreSQL keeps running on the server after its caller
has given up, holding a backend, locks and I/O. ``run_bounded`` bounds the
statements a call sends by the deadline::

    with deadline_scope(Deadline.after(0.5)):
        rows = run_bounded(conn, lambda: conn.execute("SELECT ...").fetchall())

* no budget left (remaining minus ``margin_ms`` under one millisecond) ->
  ``DeadlineExceeded("no-budget-for-downstream")`` and ``call`` is not run,
  so nothing is sent;
* otherwise the connection is cancelled (PostgreSQL's cancel request, what
  ``Connection.cancel_safe()`` / psycopg2's ``connection.cancel()`` send) at
  ``deadline - margin_ms`` by one shared watcher thread; the statement fails
  server-side with ``QueryCanceled`` and that surfaces as
  ``DeadlineExceeded("deadline-exceeded")`` (504) — also when a framework
  wrapped it (Django's ``OperationalError``: the ``__cause__``/``__context__``
  chain is walked);
* any other error, and a ``QueryCanceled`` prazo did not cause (the server's
  own ``statement_timeout``, another client's cancel), passes unchanged.

Why a cancel and not ``SET LOCAL statement_timeout``: the cancel costs no
round trip when the statement finishes in time (the timeout needs one more
statement per call, two in autocommit to put the old value back), bounds the
whole call rather than each of its statements, and works the same in
autocommit and inside a transaction. Figures in docs/benchmarks (prazo's
``bench/test_bench_psycopg.py``). ``statement_limit_ms`` gives the same
budget as a ``statement_timeout`` value for code that prefers the server-side
limit.

The connection stays usable: an autocommit connection is idle again after
the error; inside a transaction the transaction is aborted, as with any
error, and the usual rollback (``with conn.transaction()``, a pool's return,
Django's atomic) clears it.

If the deadline passes while ``call`` is between two statements (Python work
on the client), the server ignores a cancel that finds it idle, so the
watcher repeats the cancel until ``call`` returns — 50 ms after the first,
then at doubling intervals up to one second (each cancel is a connection to
the server) — so a statement sent after the deadline still ends soon.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from prazo.bindings.outgoing import DEFAULT_MARGIN_MS, validate_margin_ms
from prazo.core import (
    REASON_DEADLINE_EXCEEDED,
    REASON_NO_BUDGET_FOR_DOWNSTREAM,
    Deadline,
    DeadlineExceeded,
    current_deadline,
    deadline_scope,
)

__all__ = ["DEFAULT_MARGIN_MS", "QUERY_CANCELED_SQLSTATE", "run_bounded", "statement_limit_ms"]

T = TypeVar("T")

_log = logging.getLogger(__name__)

# SQLSTATE 57014 query_canceled: both psycopg 3 (``.sqlstate``) and psycopg2
# (``.pgcode``) expose it, so neither library has to be imported to match it.
QUERY_CANCELED_SQLSTATE = "57014"

_NS_PER_MS = 1_000_000
# statement_timeout counts whole milliseconds and 0 turns it off, so a budget
# under one millisecond is no budget at all (as for outgoing HTTP calls).
_MIN_BUDGET_NS = _NS_PER_MS
# A cancel that reaches an idle backend is ignored: while the call runs on past
# its deadline the cancel is repeated, first after _RECANCEL_FIRST_NS, then at
# doubling intervals capped at _RECANCEL_MAX_NS.
_RECANCEL_FIRST_NS = 50 * _NS_PER_MS
_RECANCEL_MAX_NS = 1000 * _NS_PER_MS
# psycopg 3's cancel_safe() gives up after this many seconds (an unreachable server).
_CANCEL_TIMEOUT_S = 5.0
# Done entries are dropped lazily; the heap is compacted once it reaches this size, then at each doubling.
_COMPACT_SLACK = 64
_DEFAULT_MARGIN_NS = round(DEFAULT_MARGIN_MS * _NS_PER_MS)


def _budget_ns(deadline: Deadline, margin_ns: int, now_ns: int) -> int:
    """The time a statement may run from ``now_ns``; raises when under one millisecond."""
    budget = deadline.ns - margin_ns - now_ns
    if budget < _MIN_BUDGET_NS:
        raise DeadlineExceeded(
            REASON_NO_BUDGET_FOR_DOWNSTREAM,
            f"no budget left for a PostgreSQL statement ({budget / _NS_PER_MS:.1f} ms after the margin)",
        )
    return budget


def _checked_deadline(deadline: object) -> Deadline | None:
    if deadline is not None and not isinstance(deadline, Deadline):
        raise TypeError(f"deadline must be a prazo.core.Deadline or None, not {type(deadline).__name__}")
    return deadline


def _margin_ns(margin_ms: object) -> int:
    # The default is already valid: skip the (comparatively slow) numeric checks on the per-statement path.
    if margin_ms is DEFAULT_MARGIN_MS:
        return _DEFAULT_MARGIN_NS
    return round(validate_margin_ms(margin_ms) * _NS_PER_MS)


def statement_limit_ms(
    deadline: Deadline | None = None, margin_ms: float = DEFAULT_MARGIN_MS, *, now_ns: int | None = None
) -> int | None:
    """The remaining budget as a ``statement_timeout`` value (whole ms, >= 1), or None without a deadline.

    ``deadline`` or the current one — the earlier when both exist — minus
    ``margin_ms``, rounded down so the limit never exceeds what is left.
    Raises ``DeadlineExceeded("no-budget-for-downstream")`` under one
    millisecond (``statement_timeout = 0`` would mean no limit at all)::

        limit = statement_limit_ms()
        if limit is not None:
            cur.execute(f"SET LOCAL statement_timeout = {limit}")
    """
    _checked_deadline(deadline)
    margin_ns = _margin_ns(margin_ms)
    with deadline_scope(deadline) as effective:
        if effective is None:
            return None
        now = time.monotonic_ns() if now_ns is None else now_ns
        return _budget_ns(effective, margin_ns, now) // _NS_PER_MS


# The cancel method of each connection class seen so far: a dict hit per statement
# instead of two attribute probes.
_cancel_method: dict[type, str] = {}


def _cancel_method_name(connection: object) -> str:
    """How to send ``connection``'s server a cancel request (psycopg 3 or psycopg2); TypeError otherwise."""
    cls = type(connection)
    name = _cancel_method.get(cls)
    if name is None:
        # psycopg 3.2+: cancel_safe() is interruptible and has a timeout; psycopg2 and older psycopg 3: cancel().
        for candidate in ("cancel_safe", "cancel"):
            method = getattr(cls, candidate, None)
            # A coroutine (AsyncConnection.cancel_safe) cannot run on the watcher thread; its plain cancel() can.
            if callable(method) and not inspect.iscoroutinefunction(method):
                name = _cancel_method[cls] = candidate
                break
        else:
            raise TypeError(
                "connection must be a psycopg 3 or psycopg2 connection (with cancel()), "
                f"not {type(connection).__name__}"
            )
    return name


def _send_cancel(connection: Any, method: str) -> None:
    if method == "cancel_safe":
        connection.cancel_safe(timeout=_CANCEL_TIMEOUT_S)
    else:
        getattr(connection, method)()


class _Watch:
    """One bounded call: cancel its connection at ``fire_ns`` unless it finished first."""

    __slots__ = ("cancelling", "connection", "done", "fire_ns", "fired", "method", "repeat_ns")

    def __init__(self, connection: Any, method: str, fire_ns: int) -> None:
        self.connection = connection
        self.method = method
        self.fire_ns = fire_ns
        self.fired = False  # a cancel was sent (or is being sent) for this call
        self.cancelling = False  # the watcher is sending one right now, outside the lock
        self.done = False  # the call has ended: never cancel it again
        self.repeat_ns = 0  # the interval before the next repeated cancel (0: none sent yet)


class _Watcher:
    """One daemon thread for the whole process that sends each overdue call's cancel.

    A heap ordered by fire time under one lock; finished entries are dropped
    lazily when they reach the top, or by a compaction whenever the heap
    doubled since the last one (amortised O(1)). Starting a bounded call is a
    heap push and ending it a flag, each under the lock for a few
    instructions; the thread is woken only when a new entry is the earliest.

    The cancel itself (a connection to the server, ~1 ms) is sent outside the
    lock, and ``finish`` waits for one in progress: once ``finish`` returned,
    no cancel for that call is being or will be sent, so a later statement on
    the connection is never hit by it.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A fresh, empty watcher: at start, and in a forked child (the thread did not survive the fork)."""
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # wakes the watcher thread
        self._cancel_sent = threading.Condition(self._lock)  # wakes a finish() waiting for a cancel
        self._heap: list[tuple[int, int, _Watch]] = []
        self._seq = itertools.count()
        self._compact_at = _COMPACT_SLACK
        self._thread: threading.Thread | None = None

    def watch(self, connection: Any, method: str, fire_ns: int) -> _Watch:
        entry = _Watch(connection, method, fire_ns)
        # The bare lock (C-level enter/exit) is the condition's own: holding it is holding the condition.
        with self._lock:
            heap = self._heap
            if len(heap) >= self._compact_at:
                heap[:] = [item for item in heap if not item[2].done]
                heapq.heapify(heap)
                self._compact_at = max(_COMPACT_SLACK, 2 * len(heap))
            earliest = not heap or fire_ns < heap[0][0]
            heapq.heappush(heap, (fire_ns, next(self._seq), entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prazo-psycopg-cancel", daemon=True)
                self._thread.start()
            elif earliest:
                self._cond.notify()
        return entry

    def finish(self, entry: _Watch) -> bool:
        """Mark the call ended (waiting for a cancel being sent); True if a cancel was sent."""
        with self._lock:
            entry.done = True
            while entry.cancelling:
                self._cancel_sent.wait()
            entry.connection = None  # the entry may linger in the heap until its fire time
            return entry.fired

    def _run(self) -> None:
        heap = self._heap
        with self._lock:
            while True:
                while heap and heap[0][2].done:
                    heapq.heappop(heap)
                if not heap:
                    self._cond.wait()
                    continue
                wait_ns = heap[0][0] - time.monotonic_ns()
                if wait_ns > 0:
                    self._cond.wait(wait_ns / 1e9)
                    continue
                entry = heapq.heappop(heap)[2]
                entry.fired = entry.cancelling = True
                self._lock.release()
                try:
                    _send_cancel(entry.connection, entry.method)
                except Exception:  # noqa: BLE001 - the watcher must survive; a gone server fails the statement anyway
                    _log.warning("could not send PostgreSQL a cancel request at the deadline", exc_info=True)
                finally:
                    self._lock.acquire()
                entry.cancelling = False
                self._cancel_sent.notify_all()
                if not entry.done:
                    # Still running: the cancel may have found the backend between two
                    # statements (ignored there); send it again until the call ends.
                    entry.repeat_ns = (
                        min(2 * entry.repeat_ns, _RECANCEL_MAX_NS) if entry.repeat_ns else _RECANCEL_FIRST_NS
                    )
                    entry.fire_ns = time.monotonic_ns() + entry.repeat_ns
                    heapq.heappush(heap, (entry.fire_ns, next(self._seq), entry))


_watcher = _Watcher()
if hasattr(os, "register_at_fork"):
    # A pre-forking server (gunicorn --preload) imports this before forking its workers;
    # a child inherits the heap and the lock in whatever state, but not the thread.
    os.register_at_fork(after_in_child=_watcher.reset)


def _query_canceled(exc: BaseException | None) -> BaseException | None:
    """The QueryCanceled in ``exc``'s cause/context chain (a framework may wrap it), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
        if code == QUERY_CANCELED_SQLSTATE:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def run_bounded(
    connection: Any,
    call: Callable[[], T],
    deadline: Deadline | None = None,
    *,
    margin_ms: float = DEFAULT_MARGIN_MS,
) -> T:
    """Run ``call()`` — statements sent on ``connection`` — within the deadline; return its result.

    ``connection`` is a psycopg 3 or psycopg2 DB-API connection, in
    autocommit or inside a transaction. The deadline is ``deadline`` or the
    current one (the earlier when both exist: a deadline never extends an
    outer one); ``call`` runs inside it, so nested ``run_bounded`` calls and
    outgoing calls see it. Without any deadline this is just ``call()``.

    Raises ``DeadlineExceeded`` (reason ``no-budget-for-downstream``) before
    running ``call`` when less than ``margin_ms`` + 1 ms is left, and
    (reason ``deadline-exceeded``, from the original error) when the
    statement was cancelled at ``deadline - margin_ms``. Other errors pass
    unchanged.
    """
    _checked_deadline(deadline)
    if not callable(call):
        raise TypeError(f"call must be callable, not {type(call).__name__}")
    margin_ns = _margin_ns(margin_ms)
    method = _cancel_method_name(connection)
    current = current_deadline()
    if deadline is None or (current is not None and current <= deadline):
        # The current deadline is in force already: no scope to open (the per-statement path).
        return call() if current is None else _run_watched(connection, method, call, current, margin_ns)
    with deadline_scope(deadline) as effective:
        assert effective is not None
        return _run_watched(connection, method, call, effective, margin_ns)


def _run_watched(connection: Any, method: str, call: Callable[[], T], deadline: Deadline, margin_ns: int) -> T:
    now = time.monotonic_ns()
    entry = _watcher.watch(connection, method, now + _budget_ns(deadline, margin_ns, now))
    try:
        result = call()
    except BaseException as exc:
        canceled = _query_canceled(exc) if _watcher.finish(entry) else None
        if canceled is None:
            raise
        raise DeadlineExceeded(
            REASON_DEADLINE_EXCEEDED, "the PostgreSQL statement was cancelled at its deadline"
        ) from exc
    _watcher.finish(entry)
    return result
