"""``deadline_guard`` / ``execute_until`` against real sqlite3 queries."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prazo.bindings.integrations.sqlite import deadline_guard, execute_until
from prazo.bindings.pool import AdmissionPool
from prazo.core import REASON_DEADLINE_EXCEEDED, Deadline, DeadlineExceeded, deadline_scope

# Counting to a billion takes minutes; every test that runs it expects to be
# stopped within a fraction of a second and allows seconds.
ENDLESS = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000000) SELECT count(*) FROM n"
# Long enough (tens of thousands of VM steps) to meet a progress handler.
MODEST = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000) SELECT count(*) FROM n"
GENEROUS_S = 5.0


@pytest.fixture
def conn() -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(":memory:")
    yield connection
    connection.close()


def _assert_interrupted_quickly(started: float, info: pytest.ExceptionInfo[DeadlineExceeded]) -> None:
    assert time.monotonic() - started < GENEROUS_S
    assert info.value.reason == REASON_DEADLINE_EXCEEDED and info.value.status == 504
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)


def test_a_long_query_stops_at_the_current_deadline(conn: sqlite3.Connection) -> None:
    started = time.monotonic()
    with deadline_scope(Deadline.after(0.1)), pytest.raises(DeadlineExceeded) as info, deadline_guard(conn):
        conn.execute(ENDLESS).fetchall()
    assert time.monotonic() - started >= 0.09
    _assert_interrupted_quickly(started, info)
    # Still usable, and the handler is gone: the deadline has passed, so a
    # handler left behind would interrupt this query at once.
    assert conn.execute(MODEST).fetchone() == (100000,)


def test_execute_until_with_an_explicit_deadline(conn: sqlite3.Connection) -> None:
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        execute_until(conn, ENDLESS, deadline=Deadline.after(0.1))
    _assert_interrupted_quickly(started, info)
    assert execute_until(conn, "SELECT ? + ?", (2, 3), Deadline.after(5.0)) == [(5,)]
    assert execute_until(conn, "SELECT :a", {"a": "x"}) == [("x",)]


def test_a_fast_query_under_a_deadline_succeeds(conn: sqlite3.Connection) -> None:
    with deadline_scope(Deadline.after(5.0)), deadline_guard(conn) as guard:
        assert conn.execute(MODEST).fetchone() == (100000,)
    assert guard.deadline is not None


def test_the_earlier_of_the_given_and_the_current_deadline_wins(conn: sqlite3.Connection) -> None:
    started = time.monotonic()
    with deadline_scope(Deadline.after(0.1)), pytest.raises(DeadlineExceeded):
        execute_until(conn, ENDLESS, deadline=Deadline.after(60.0))
    assert time.monotonic() - started < GENEROUS_S
    with deadline_scope(Deadline.after(60.0)), pytest.raises(DeadlineExceeded):
        execute_until(conn, ENDLESS, deadline=Deadline.after(0.1))
    assert time.monotonic() - started < 2 * GENEROUS_S


def test_without_a_deadline_the_connection_is_untouched(conn: sqlite3.Connection) -> None:
    calls = []

    def own_handler() -> int:
        calls.append(1)
        return 0

    conn.set_progress_handler(own_handler, 100)
    with deadline_guard(conn) as guard:
        assert conn.execute(MODEST).fetchone() == (100000,)
    assert guard.deadline is None
    assert calls, "the application's own progress handler was replaced"
    calls.clear()
    conn.execute(MODEST)
    assert calls, "the application's own progress handler was removed"


def test_a_passed_deadline_raises_before_any_statement(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE t (x)")
    with pytest.raises(DeadlineExceeded) as info, deadline_guard(conn, Deadline.after(-0.001)):
        conn.execute("INSERT INTO t VALUES (1)")
    assert info.value.reason == REASON_DEADLINE_EXCEEDED
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)


def test_an_interrupted_write_rolls_back_its_transaction(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.execute("INSERT INTO t VALUES (1)")  # opens the (implicit) transaction
    with pytest.raises(DeadlineExceeded), deadline_guard(conn, Deadline.after(0.1)):
        conn.execute(f"INSERT INTO t {ENDLESS.replace('SELECT count(*) FROM n', 'SELECT i FROM n')}")
    assert not conn.in_transaction
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)


def test_a_nested_guard_puts_the_outer_handler_back(conn: sqlite3.Connection) -> None:
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded), deadline_guard(conn, Deadline.after(0.2)):
        with deadline_guard(conn, Deadline.after(60.0)):
            conn.execute("SELECT 1")
        # The outer guard's deadline is in force again.
        conn.execute(ENDLESS).fetchall()
    assert time.monotonic() - started < GENEROUS_S
    assert conn.execute(MODEST).fetchone() == (100000,)


def test_a_deadline_in_place_of_params_is_refused(conn: sqlite3.Connection) -> None:
    with pytest.raises(TypeError, match="params"):
        execute_until(conn, "SELECT 1", Deadline.after(5.0))  # type: ignore[arg-type]


def test_an_error_that_is_not_the_deadline_passes_through(conn: sqlite3.Connection) -> None:
    with deadline_scope(Deadline.after(5.0)), pytest.raises(sqlite3.OperationalError, match="no such table"):
        execute_until(conn, "SELECT * FROM missing")


def test_work_in_an_admission_pool_stops_at_the_items_deadline() -> None:
    def report() -> list[Any]:
        connection = sqlite3.connect(":memory:")
        try:
            return execute_until(connection, ENDLESS)
        finally:
            connection.close()

    started = time.monotonic()
    with AdmissionPool(1, 1) as pool:
        exc = pool.submit_until(Deadline.after(0.1), report).exception(GENEROUS_S * 2)
    assert isinstance(exc, DeadlineExceeded)
    assert time.monotonic() - started < GENEROUS_S


def test_a_guard_cannot_be_entered_twice(conn: sqlite3.Connection) -> None:
    guard = deadline_guard(conn, Deadline.after(5.0))
    with guard, pytest.raises(RuntimeError, match="reentrant"), guard:
        pass


@pytest.mark.parametrize(
    "args, kwargs, error, name",
    [
        (("not a connection",), {}, TypeError, "conn"),
        ((None, 1.0), {}, TypeError, "deadline"),
        ((None,), {"every_n": 0}, ValueError, "every_n"),
        ((None,), {"every_n": 1.5}, TypeError, "every_n"),
        ((None,), {"every_n": True}, TypeError, "every_n"),
    ],
)
def test_bad_arguments_name_the_argument(
    conn: sqlite3.Connection, args: tuple[Any, ...], kwargs: dict[str, Any], error: type, name: str
) -> None:
    if args[0] is None:
        args = (conn, *args[1:])
    with pytest.raises(error, match=name):
        deadline_guard(*args, **kwargs)
