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
autocommit and inside a transaction. Figures in the README (prazo's
``bench/test_bench_psycopg.py``). ``statement_limit_ms`` gives the same
budget as a ``statement_timeout`` value for code that prefers the server-side
limit.

The connection stays usable: an autocommit connection is idle again after
the error; inside a transaction the transaction is aborted, as with any
error, and the usual rollback (``with conn.transaction()``, a pool's return,
Django's atomic) clears it.

If the deadline passes while ``call`` is between two statements (Python work
on the client), the server ignores a cancel that finds it idle, so the
watcher repeats the cancel every ``_RECANCEL_INTERVAL_NS`` until ``call``
returns: a statement sent after the deadline ends within that interval.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from prazo.core import (
    REASON_DEADLINE_EXCEEDED,
    REASON_NO_BUDGET_FOR_DOWNSTREAM,
    Deadline,
    DeadlineExceeded,
    deadline_scope,
)

from .outgoing import DEFAULT_MARGIN_MS, validate_margin_ms

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
# A cancel that reaches an idle backend is ignored; repeat it this often while
# the call is still running past its deadline.
_RECANCEL_INTERVAL_NS = 50 * _NS_PER_MS
# psycopg 3's cancel_safe() gives up after this many seconds (an unreachable server).
_CANCEL_TIMEOUT_S = 5.0
# Done entries are dropped lazily; compact the heap once they outnumber live ones by this much.
_COMPACT_SLACK = 64


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
    margin_ns = round(validate_margin_ms(margin_ms) * _NS_PER_MS)
    with deadline_scope(deadline) as effective:
        if effective is None:
            return None
        now = time.monotonic_ns() if now_ns is None else now_ns
        return _budget_ns(effective, margin_ns, now) // _NS_PER_MS


def _canceller(connection: object) -> Callable[[], None]:
    """How to send ``connection``'s server a cancel request (psycopg 3 or psycopg2)."""
    cancel_safe = getattr(connection, "cancel_safe", None)
    if callable(cancel_safe):  # psycopg 3.2+: interruptible, with a timeout
        return lambda: cancel_safe(timeout=_CANCEL_TIMEOUT_S)
    cancel = getattr(connection, "cancel", None)
    if callable(cancel):  # psycopg2, older psycopg 3
        return cancel  # type: ignore[no-any-return]
    raise TypeError(
        f"connection must be a psycopg 3 or psycopg2 connection (with cancel()), not {type(connection).__name__}"
    )


class _Watch:
    """One bounded call: cancel its connection at ``fire_ns`` unless it finished first.

    ``lock`` orders the cancel against the call's end: once ``finish()``
    returned, no cancel for this call is being or will be sent, so a later
    statement on the connection can never be hit by it.
    """

    __slots__ = ("cancel", "done", "fire_ns", "fired", "lock")

    def __init__(self, cancel: Callable[[], None], fire_ns: int) -> None:
        self.cancel = cancel
        self.fire_ns = fire_ns
        self.fired = False
        self.done = False
        self.lock = threading.Lock()

    def finish(self) -> bool:
        """Mark the call ended (waits for a cancel in progress); True if a cancel was sent."""
        with self.lock:
            self.done = True
            return self.fired


class _Watcher:
    """One daemon thread for the whole process that sends each overdue call's cancel.

    A heap ordered by fire time; finished entries are dropped lazily when they
    reach the top (or by compaction), so starting and ending a bounded call is
    a heap push and a lock, with no thread woken unless the new entry is the
    earliest.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[int, int, _Watch]] = []
        self._seq = itertools.count()
        self._live = 0
        self._thread: threading.Thread | None = None

    def watch(self, cancel: Callable[[], None], fire_ns: int) -> _Watch:
        entry = _Watch(cancel, fire_ns)
        with self._cond:
            self._live += 1
            if len(self._heap) > 2 * self._live + _COMPACT_SLACK:
                self._heap = [item for item in self._heap if not item[2].done]
                heapq.heapify(self._heap)
            earliest = not self._heap or fire_ns < self._heap[0][0]
            heapq.heappush(self._heap, (fire_ns, next(self._seq), entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prazo-psycopg-cancel", daemon=True)
                self._thread.start()
            elif earliest:
                self._cond.notify()
        return entry

    def finish(self, entry: _Watch) -> bool:
        fired = entry.finish()
        with self._cond:
            self._live -= 1
        return fired

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][2].done:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait_ns = self._heap[0][0] - time.monotonic_ns()
                    if wait_ns <= 0:
                        entry = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(wait_ns / 1e9)
            self._fire(entry)

    def _fire(self, entry: _Watch) -> None:
        with entry.lock:
            if entry.done:
                return
            entry.fired = True
            try:
                entry.cancel()
            except Exception:  # noqa: BLE001 - the watcher must survive; a gone server fails the statement anyway
                _log.warning("could not send PostgreSQL a cancel request at the deadline", exc_info=True)
        # Still running: the cancel may have found the backend between two
        # statements (ignored there); send it again until the call ends.
        with self._cond:
            if not entry.done:
                entry.fire_ns = time.monotonic_ns() + _RECANCEL_INTERVAL_NS
                heapq.heappush(self._heap, (entry.fire_ns, next(self._seq), entry))


_watcher = _Watcher()


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
    margin_ns = round(validate_margin_ms(margin_ms) * _NS_PER_MS)
    cancel = _canceller(connection)
    with deadline_scope(deadline) as effective:
        if effective is None:
            return call()
        now = time.monotonic_ns()
        entry = _watcher.watch(cancel, now + _budget_ns(effective, margin_ns, now))
        try:
            result = call()
        except BaseException as exc:
            fired = _watcher.finish(entry)
            canceled = _query_canceled(exc) if fired else None
            if canceled is None:
                raise
            raise DeadlineExceeded(
                REASON_DEADLINE_EXCEEDED, "the PostgreSQL statement was cancelled at its deadline"
            ) from exc
        _watcher.finish(entry)
        return result
