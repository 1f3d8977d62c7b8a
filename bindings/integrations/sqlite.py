"""Deadlines as cancellation of in-flight ``sqlite3`` work.

A query keeps running after its caller has given up unless something stops
it. ``deadline_guard`` installs a progress handler
(``Connection.set_progress_handler``) that SQLite calls every ``every_n``
virtual-machine instructions; once the deadline has passed the handler asks
SQLite to abort, the statement fails with ``OperationalError("interrupted")``,
and the guard turns that into ``DeadlineExceeded`` (reason
``deadline-exceeded``)::

    with deadline_scope(Deadline.after(0.5)):
        with deadline_guard(conn):
            rows = conn.execute(slow_report_sql).fetchall()

    rows = execute_until(conn, "SELECT * FROM t WHERE k = ?", (key,))

As with ``sqlite3_interrupt``, an interrupted INSERT/UPDATE/DELETE inside an
explicit transaction rolls the whole transaction back; the connection stays
usable. Long loops in Python have the same cooperative point in
``Deadline.check()``.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from prazo.core import REASON_DEADLINE_EXCEEDED, Deadline, DeadlineExceeded, deadline_scope

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only

__all__ = ["deadline_guard", "execute_until"]

_Handler = tuple[Callable[[], int], int]

# sqlite3 cannot report the progress handler it has, so the guards keep their
# own per-connection stack to put an outer guard's handler back on exit.
# Keyed by id(): sqlite3.Connection does not support weak references, and an
# entry lives only while a guard is open on that connection.
_installed: dict[int, list[_Handler]] = {}
_installed_lock = threading.Lock()


class deadline_guard:
    """Abort SQLite statements on ``conn`` once the deadline passes, as ``DeadlineExceeded``.

    The deadline is ``deadline`` or the current one (``current_deadline()``);
    when both exist, the earlier wins, as with nested ``deadline_scope``.
    Without any deadline the connection is left untouched. A deadline that
    has already passed raises on entry, before any statement runs.

    On exit the handler is removed — or, when this guard is nested in another
    ``deadline_guard`` on the same connection, the outer one's is put back. A
    progress handler installed by other code is not restored (sqlite3 gives
    no way to read it).

    ``every_n`` is how many SQLite VM instructions pass between two deadline
    checks: lower reacts sooner, higher costs less (each check is one Python
    call).

    ::

        with deadline_guard(conn, Deadline.after(0.2)):
            conn.execute("UPDATE big SET flag = 1")   # DeadlineExceeded after ~200 ms
    """

    def __init__(self, conn: sqlite3.Connection, deadline: Deadline | None = None, *, every_n: int = 1000) -> None:
        if not isinstance(conn, sqlite3.Connection):
            raise TypeError(f"conn must be a sqlite3.Connection, not {type(conn).__name__}")
        if deadline is not None and not isinstance(deadline, Deadline):
            raise TypeError(f"deadline must be a prazo.core.Deadline or None, not {type(deadline).__name__}")
        if isinstance(every_n, bool) or not isinstance(every_n, int):
            raise TypeError(f"every_n must be an int, not {type(every_n).__name__}")
        if every_n < 1:
            raise ValueError(f"every_n must be >= 1, got {every_n}")
        self._conn = conn
        self._deadline = deadline
        self._every_n = every_n
        self._entered = False
        self._effective: Deadline | None = None
        self._tripped = False

    @property
    def deadline(self) -> Deadline | None:
        """The deadline in force once entered (None: no deadline, nothing installed)."""
        return self._effective

    @property
    def interrupted(self) -> bool:
        """True once this guard has asked SQLite to abort a statement (its deadline had passed)."""
        return self._tripped

    def deadline_error(self, exc: BaseException) -> DeadlineExceeded | None:
        """The ``DeadlineExceeded`` that ``exc`` stands for, or None when the deadline did not cause it.

        ``exc`` counts when this guard interrupted a statement and ``exc`` is,
        or wraps (``__cause__``/``__context__``, as Django's
        ``django.db.utils.OperationalError`` does), the resulting
        ``sqlite3.OperationalError``. Lets code that keeps a guard open across
        several statements, or whose errors a framework wraps, map them itself.
        """
        if not self._tripped:
            return None
        seen: set[int] = set()
        cause: BaseException | None = exc
        while cause is not None and id(cause) not in seen:
            if isinstance(cause, sqlite3.OperationalError):
                return DeadlineExceeded(
                    REASON_DEADLINE_EXCEEDED, "the SQLite statement was interrupted at its deadline"
                )
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        return None

    def _abort_when_due(self) -> int:
        assert self._effective is not None
        if time.monotonic_ns() >= self._effective.ns:
            self._tripped = True
            return 1
        return 0

    def __enter__(self) -> Self:
        if self._entered:
            raise RuntimeError("deadline_guard is not reentrant; create a new one")
        with deadline_scope(self._deadline) as effective:
            self._effective = effective
        if effective is None:
            return self
        effective.check()
        self._entered = True
        handler: _Handler = (self._abort_when_due, self._every_n)
        with _installed_lock:
            _installed.setdefault(id(self._conn), []).append(handler)
        self._conn.set_progress_handler(*handler)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._entered:
            return
        self._entered = False
        key = id(self._conn)
        with _installed_lock:
            stack = _installed[key]
            stack.pop()
            outer = stack[-1] if stack else None
            if not stack:
                del _installed[key]
        if outer is None:
            self._conn.set_progress_handler(None, self._every_n)
        else:
            self._conn.set_progress_handler(*outer)
        error = None if exc is None else self.deadline_error(exc)
        if error is not None:
            raise error from exc


def execute_until(
    conn: sqlite3.Connection,
    sql: str,
    params: Iterable[Any] | Mapping[str, Any] = (),
    deadline: Deadline | None = None,
    *,
    every_n: int = 1000,
) -> list[Any]:
    """Run one statement under ``deadline_guard`` and return all its rows.

    The rows are fetched inside the guard — a SELECT does most of its work
    while rows are fetched, not in ``execute`` — so the whole query is bounded
    by the deadline.
    """
    if isinstance(params, Deadline):
        raise TypeError("params must be a sequence or a mapping, not a Deadline (pass it as deadline=)")
    with deadline_guard(conn, deadline, every_n=every_n):
        return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]
