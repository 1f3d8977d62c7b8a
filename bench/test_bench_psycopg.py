"""What a PostgreSQL statement deadline costs, and how the two ways of enforcing it compare.

Against a real server (a private cluster started here, or ``PRAZO_BENCH_PG_DSN``),
over loopback, one connection, ``SELECT 1`` + fetch per operation:

* ``plain`` — psycopg as is (the baseline);
* ``run_bounded`` — ``prazo.bindings.psycopg.run_bounded`` under a 10 s deadline:
  a cancel armed on the shared watcher thread, disarmed when the statement returns;
* ``run_bounded-no-deadline`` — the pass-through outside any deadline scope;
* ``set-timeout`` — the server-side alternative done right in autocommit:
  ``SET statement_timeout = <budget>``, the statement, ``SET statement_timeout = 0``
  (three round trips; the old value must be put back);
* ``set-timeout-pipelined`` — the same three statements in one psycopg pipeline
  (one round trip, but only possible when prazo sends the statements itself);
* in a transaction (``BEGIN``/``COMMIT`` around each): ``tx-plain``, ``tx-run_bounded``,
  ``tx-set-local`` (``SET LOCAL statement_timeout`` first: one more round trip);
* psycopg2: ``pg2-plain`` and ``pg2-run_bounded``.

One round is ``INNER_LOOPS`` statements, so us/round reads as ns/statement.
The ``reaction`` group times ``pg_sleep(5)`` under a 200 ms budget (20 ms margin)
until the error is back, with the cancel and with ``SET LOCAL statement_timeout``.

::

    .venv/bin/python -m pytest -p no:cacheprovider bench/test_bench_psycopg.py --benchmark-only \\
        --benchmark-columns=min,median,mean,rounds
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prazo.bench.harness import LoopRunner
from prazo.bindings.psycopg import run_bounded, statement_limit_ms
from prazo.core import Deadline, DeadlineExceeded, deadline_scope

psycopg = pytest.importorskip("psycopg")
psycopg2 = pytest.importorskip("psycopg2")

GROUP_AUTOCOMMIT = "psycopg SELECT 1, autocommit"
GROUP_TRANSACTION = "psycopg SELECT 1, one transaction each"
GROUP_PSYCOPG2 = "psycopg2 SELECT 1, autocommit"
GROUP_REACTION = "reaction: pg_sleep(5) under a 200 ms budget (1 round = 1 statement: read us as us)"
LONG_BUDGET_S = 10.0
REACTION_ROUNDS = 10


@contextlib.contextmanager
def server_dsn() -> Iterator[str]:
    """``PRAZO_BENCH_PG_DSN``, or a private cluster started for the run and stopped after it."""
    given = os.environ.get("PRAZO_BENCH_PG_DSN")
    if given:
        yield given
        return
    # The test suite's server helper (initdb + pg_ctl on a free port); bench/ is not a test package.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from _services import start_postgres

    server = start_postgres()
    try:
        yield server.dsn
    finally:
        server.stop()


@pytest.fixture(scope="module")
def dsn() -> Iterator[str]:
    with server_dsn() as value:
        yield value


@pytest.fixture(scope="module")
def conn(dsn: str) -> Iterator[Any]:
    connection = psycopg.connect(dsn, autocommit=True)
    yield connection
    connection.close()


def _autocommit_runners(conn: Any) -> dict[str, LoopRunner]:
    cur = conn.cursor()

    def select1() -> Any:
        cur.execute("SELECT 1")
        return cur.fetchone()

    def plain(loops: int) -> None:
        for _ in range(loops):
            select1()

    def bounded(loops: int) -> None:
        with deadline_scope(Deadline.after(LONG_BUDGET_S)):
            for _ in range(loops):
                run_bounded(conn, select1)

    def bounded_without_deadline(loops: int) -> None:
        for _ in range(loops):
            run_bounded(conn, select1)

    def set_timeout(loops: int) -> None:
        with deadline_scope(Deadline.after(LONG_BUDGET_S)):
            for _ in range(loops):
                cur.execute(f"SET statement_timeout = {statement_limit_ms()}")
                select1()
                cur.execute("SET statement_timeout = 0")

    def set_timeout_pipelined(loops: int) -> None:
        with deadline_scope(Deadline.after(LONG_BUDGET_S)):
            for _ in range(loops):
                with conn.pipeline():
                    cur.execute(f"SET statement_timeout = {statement_limit_ms()}")
                    cur.execute("SELECT 1")
                    cur.execute("SET statement_timeout = 0")
                # The pipeline ends with one sync: the SELECT ran and its row arrived (in the
                # cursor's earlier result set), one round trip for all three statements.

    return {
        "plain": plain,
        "run_bounded": bounded,
        "run_bounded-no-deadline": bounded_without_deadline,
        "set-timeout": set_timeout,
        "set-timeout-pipelined": set_timeout_pipelined,
    }


@pytest.mark.parametrize(
    "name", ["plain", "run_bounded", "run_bounded-no-deadline", "set-timeout", "set-timeout-pipelined"]
)
def test_autocommit(loop_benchmark: Callable[[LoopRunner, str], None], conn: Any, name: str) -> None:
    loop_benchmark(_autocommit_runners(conn)[name], GROUP_AUTOCOMMIT)


def _select1_loop(connection: Any, name: str, *, commit: bool = False) -> LoopRunner:
    """``SELECT 1`` + fetch per operation: plain, through run_bounded, or after SET LOCAL statement_timeout."""
    cur = connection.cursor()

    def select1() -> Any:
        cur.execute("SELECT 1")
        return cur.fetchone()

    def run(loops: int) -> None:
        with deadline_scope(Deadline.after(LONG_BUDGET_S)):
            for _ in range(loops):
                if name.endswith("run_bounded"):
                    run_bounded(connection, select1)
                else:
                    if name.endswith("set-local"):
                        cur.execute(f"SET LOCAL statement_timeout = {statement_limit_ms()}")
                    select1()
                if commit:
                    connection.commit()

    return run


@pytest.mark.parametrize("name", ["tx-plain", "tx-run_bounded", "tx-set-local"])
def test_transaction(loop_benchmark: Callable[[LoopRunner, str], None], dsn: str, name: str) -> None:
    with psycopg.connect(dsn) as connection:
        loop_benchmark(_select1_loop(connection, name, commit=True), GROUP_TRANSACTION)


@pytest.mark.parametrize("name", ["pg2-plain", "pg2-run_bounded"])
def test_psycopg2(loop_benchmark: Callable[[LoopRunner, str], None], dsn: str, name: str) -> None:
    connection = psycopg2.connect(dsn)
    connection.autocommit = True
    try:
        loop_benchmark(_select1_loop(connection, name), GROUP_PSYCOPG2)
    finally:
        connection.close()


@pytest.mark.parametrize("mechanism", ["cancel", "set-local-statement_timeout"])
def test_reaction(benchmark: Any, conn: Any, mechanism: str) -> None:
    def once() -> None:
        started = time.monotonic()
        with deadline_scope(Deadline.after(0.2)):
            try:
                if mechanism == "cancel":
                    run_bounded(conn, lambda: conn.execute("SELECT pg_sleep(5)"))
                else:
                    with conn.transaction():
                        conn.execute(f"SET LOCAL statement_timeout = {statement_limit_ms()}")
                        conn.execute("SELECT pg_sleep(5)")
            except (DeadlineExceeded, psycopg.errors.QueryCanceled):
                pass
            else:
                raise AssertionError("pg_sleep(5) was not stopped")
        assert time.monotonic() - started < 2.0

    benchmark.group = GROUP_REACTION
    benchmark.pedantic(once, rounds=REACTION_ROUNDS, iterations=1, warmup_rounds=1)


def interleaved_overhead(dsn: str, batches: int = 40, loops: int = 500) -> list[str]:
    """Plain vs run_bounded in alternating batches: robust to a machine whose load drifts over a run.

    pytest-benchmark runs one variant after the other, so on a shared machine
    a load change between them reads as a difference; alternating batches
    give both the same conditions. Returns one line per driver.
    """
    lines = []
    for driver in ("psycopg", "psycopg2"):
        connection = psycopg.connect(dsn, autocommit=True) if driver == "psycopg" else psycopg2.connect(dsn)
        connection.autocommit = True
        try:
            runners = {name: _select1_loop(connection, name) for name in ("plain", "run_bounded")}
            per_op_us: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(batches):
                for name, run in runners.items():
                    started = time.perf_counter()
                    run(loops)
                    per_op_us[name].append((time.perf_counter() - started) / loops * 1e6)
        finally:
            connection.close()
        plain, bounded = per_op_us["plain"], per_op_us["run_bounded"]
        for stat, pick in (("min", min), ("median", statistics.median)):
            p, b = pick(plain), pick(bounded)
            lines.append(
                f"{driver:<9} {stat:<6} plain {p:6.1f} us  run_bounded {b:6.1f} us  overhead {b - p:+5.1f} us ({b / p:.2f}x)"
            )
    return lines


if __name__ == "__main__":
    # .venv/bin/python bench/test_bench_psycopg.py  (PRAZO_BENCH_PG_DSN=... to use a running server)
    with server_dsn() as running:
        print("\n".join(interleaved_overhead(running)))
