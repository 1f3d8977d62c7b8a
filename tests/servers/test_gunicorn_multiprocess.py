"""gunicorn ``-w N`` with prazo's worker: the host's shared occupancy table, and full workers yielding.

The table itself is tested in this process (``OccupancyTable``, through a
real fork too); the rest runs a real ``gunicorn -w 2`` on loopback serving
``_multiprocess_app`` (the harness's app plus ``GET /_prazo/host``, which
answers the table as JSON from whichever worker takes it). Requests are held
at gate files the test opens; every wait is bounded generously, and a test
never depends on which worker the kernel hands a connection to.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import wait_until
from _server_harness import TESTS_DIR, Burst, RunningServer, request, start_gunicorn, statuses
from hypothesis import given
from hypothesis import strategies as st
from prazo.bench.multiprocess import HOST_PATH
from prazo.bindings.freethreading import gil_enabled
from prazo.bindings.servers.gunicorn import settings_for
from prazo.bindings.servers.plumbing.dispatcher import AdmissionDispatcher, Ticket
from prazo.bindings.servers.plumbing.occupancy import (
    ROW_BYTES,
    STALE_HEARTBEAT_NS,
    STATE_SERVING,
    STATE_STOPPING,
    STATE_YIELDING,
    OccupancyTable,
    child_alive,
)
from prazo.bindings.servers.serve import main_serve
from prazo.bindings.servers.settings import resolve_settings
from prazo.core import Deadline

WAIT_S = 30.0
# A worker frees a slot a moment after its answer reached the client: far longer than that.
SETTLE_S = 0.3


# -- the dispatcher's hook ----------------------------------------------------------------------


def test_on_change_follows_every_occupancy_change_and_precedes_a_refusals_answer() -> None:
    events: list[tuple[str, int, int]] = []
    gate = threading.Event()
    serving = threading.Event()

    def serve(ticket: Ticket) -> None:
        serving.set()
        gate.wait(WAIT_S)

    def reject(ticket: Ticket, exc: BaseException) -> None:
        events.append(("answer", -1, -1))

    def changed() -> None:
        stats = dispatcher.stats()
        events.append(("change", stats["in_flight"], stats["queued"]))

    with pytest.raises(TypeError, match="on_change"):
        AdmissionDispatcher(1, 0, serve=serve, reject=reject, on_change=42)  # type: ignore[arg-type]
    dispatcher = AdmissionDispatcher(1, 0, serve=serve, reject=reject, on_change=changed)
    dispatcher.start()
    assert dispatcher.submit(Ticket("first", Deadline.after(WAIT_S), time.monotonic_ns()))
    assert serving.wait(WAIT_S)
    # The admission; the start moves none of the figures an observer publishes.
    assert events == [("change", 1, 0)]
    events.clear()
    assert not dispatcher.submit(Ticket("second", Deadline.after(WAIT_S), time.monotonic_ns()))
    assert events == [("change", 1, 0), ("answer", -1, -1)]  # observed before the 503 goes out
    events.clear()
    gate.set()
    wait_until(lambda: ("change", 0, 0) in events, "the release", WAIT_S)
    assert dispatcher.shutdown(timeout=WAIT_S)


# -- the setting ---------------------------------------------------------------------------------


def test_yield_when_full_is_on_by_default_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_settings(environ={}).yield_when_full is True
    assert resolve_settings(environ={"PRAZO_YIELD_WHEN_FULL": "0"}).yield_when_full is False
    assert resolve_settings(yield_when_full=True, environ={"PRAZO_YIELD_WHEN_FULL": "off"}).yield_when_full is True
    with pytest.raises(ValueError, match="PRAZO_YIELD_WHEN_FULL"):
        resolve_settings(environ={"PRAZO_YIELD_WHEN_FULL": "maybe"})
    with pytest.raises(TypeError, match="yield_when_full"):
        resolve_settings(yield_when_full="no", environ={})  # type: ignore[arg-type]

    class Config:
        threads, is_ssl, http_protocols = 2, False, ("h1",)

    monkeypatch.setenv("PRAZO_YIELD_WHEN_FULL", "no")
    assert settings_for(Config()).yield_when_full is False


def test_serve_refuses_no_yield_when_full_for_a_single_process_server(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(TESTS_DIR)
    assert main_serve(["_server_harness:app", "--server", "waitress", "--no-yield-when-full"]) == 2
    assert "--no-yield-when-full is for --server gunicorn only" in capsys.readouterr().err


# -- the table, in this process ------------------------------------------------------------------


def test_rows_are_cache_line_multiples_and_arguments_are_checked() -> None:
    assert ROW_BYTES % 64 == 0
    with pytest.raises(TypeError, match="rows"):
        OccupancyTable("4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows"):
        OccupancyTable(0)
    table = OccupancyTable(2)
    with pytest.raises(ValueError, match="generation"):
        table.claim(0, threads=1, max_queue=0, live=lambda generation: True)
    row = table.claim(1, threads=1, max_queue=0, live=lambda generation: True)
    assert row is not None
    with pytest.raises(ValueError, match="state"):
        row.set_state(0)
    with pytest.raises(ValueError, match="field"):
        row.add("in_flight", 1)


def test_claim_takes_free_rows_and_resets_the_rows_of_dead_owners() -> None:
    table = OccupancyTable(2)
    alive = {1, 2}
    first = table.claim(1, threads=2, max_queue=3, live=alive.__contains__)
    second = table.claim(2, threads=2, max_queue=3, live=alive.__contains__)
    assert first is not None and second is not None and first.index != second.index
    assert table.claim(3, threads=2, max_queue=3, live=alive.__contains__) is None  # no free row
    first.booted(4242)
    first.set_state(STATE_SERVING)
    first.publish(in_flight=2, queued=3, arriving=0)
    with first.lock:
        first.add("refused_full", 5)
    alive.discard(1)  # its worker died
    third = table.claim(3, threads=2, max_queue=3, live=alive.__contains__)
    assert third is not None and third.index == first.index
    (reused,) = [row for row in table.snapshot() if row["row"] == first.index]
    assert reused["generation"] == 3 and reused["pid"] == 0 and reused["in_flight"] == 0
    assert reused["refused_full"] == 0 and reused["state_name"] == "booting"


@given(st.lists(st.one_of(st.just("spawn"), st.integers(0, 7)), max_size=40), st.integers(1, 4))
def test_claims_never_share_a_row_between_live_workers_and_fail_only_when_all_rows_are_live(
    steps: list[str | int], rows: int
) -> None:
    """A script of spawns and deaths (an int kills the n-th live worker, if any), like the arbiter's."""
    table = OccupancyTable(rows)
    live: dict[int, int] = {}  # generation -> row index
    generation = 0
    for step in steps:
        if step == "spawn":
            generation += 1
            row = table.claim(generation, threads=1, max_queue=0, live=live.__contains__)
            if len(live) == rows:
                assert row is None
                continue
            assert row is not None
            assert row.index not in live.values()
            live[generation] = row.index
        elif live:
            del live[sorted(live)[int(step) % len(live)]]
    claimed = {int(row["generation"]): int(row["row"]) for row in table.snapshot()}
    assert {gen: claimed[gen] for gen in live} == live  # every live worker still holds its row


def test_room_counts_serving_fresh_rows_with_a_free_place_only() -> None:
    table = OccupancyTable(3)
    a = table.claim(1, threads=1, max_queue=1, live=lambda generation: True)
    b = table.claim(2, threads=1, max_queue=1, live=lambda generation: True)
    assert a is not None and b is not None
    now = 10 * STALE_HEARTBEAT_NS
    a.beat(now)
    b.beat(now)
    assert not table.sibling_has_room(a.index, now)  # b is still booting
    b.set_state(STATE_SERVING)
    assert table.sibling_has_room(a.index, now)
    b.publish(in_flight=1, queued=0, arriving=1)  # its last place is taken by an arriving request
    assert not table.sibling_has_room(a.index, now)
    b.publish(in_flight=1, queued=0, arriving=0)
    assert table.sibling_has_room(a.index, now)
    assert not table.sibling_has_room(a.index, now + STALE_HEARTBEAT_NS + 1)  # b hung: not counted on
    for state in (STATE_YIELDING, STATE_STOPPING):
        b.set_state(state)
        assert not table.sibling_has_room(a.index, now)
    b.set_state(STATE_SERVING)
    assert not table.sibling_has_room(b.index, now)  # a row is not its own sibling
    assert table.totals()["workers"] == 1


def test_a_forked_child_writes_its_row_and_the_parent_reads_it() -> None:
    table = OccupancyTable(2)
    row = table.claim(1, threads=4, max_queue=4, live=lambda generation: True)
    assert row is not None
    pid = os.fork()
    if pid == 0:  # the child: write and leave at once, without pytest's teardown
        try:
            row.booted(os.getpid())
            row.publish(in_flight=3, queued=2, arriving=1)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert not child_alive(pid)
    (seen,) = table.snapshot()
    assert (seen["pid"], seen["in_flight"], seen["queued"], seen["arriving"]) == (pid, 3, 2, 1)


# -- a real gunicorn -w 2 ------------------------------------------------------------------------


def _host(server: RunningServer) -> dict[str, Any]:
    outcome = request(server.port, HOST_PATH)
    assert outcome.status == 200, outcome
    table: dict[str, Any] = json.loads(outcome.body)
    return table


def _serving_rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in table["rows"] if row["state"] in (STATE_SERVING, STATE_YIELDING)]


def _start(
    servers: list[RunningServer], *, workers: int, threads: int, max_queue: int, yield_when_full: bool
) -> RunningServer:
    server = start_gunicorn(
        threads,
        max_queue,
        workers=workers,
        app_spec="_multiprocess_app:app",
        extra_env={"PRAZO_YIELD_WHEN_FULL": "1" if yield_when_full else "0"},
    )
    servers.append(server)
    wait_until(lambda: len(_serving_rows(_host(server))) == workers, f"{workers} workers serving", WAIT_S)
    time.sleep(SETTLE_S)
    return server


def _hold(server: RunningServer, tmp_path: Path, count: int, gate: Path) -> Burst:
    marks = [tmp_path / f"running-{number}" for number in range(count)]
    burst = Burst(server.port, [f"/work?gate={gate}&mark={mark}" for mark in marks])
    wait_until(lambda: all(mark.exists() for mark in marks), f"{count} held requests running", WAIT_S)
    return burst


def _worker_pids(server: RunningServer) -> set[int]:
    arbiter = server.process.pid  # type: ignore[attr-defined]
    children = Path(f"/proc/{arbiter}/task/{arbiter}/children").read_text().split()
    return {int(pid) for pid in children}


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads worker pids from /proc")
def test_the_table_shows_the_requests_really_in_flight_in_each_worker(
    servers: list[RunningServer], tmp_path: Path
) -> None:
    # Eight threads a worker: the three held requests and the question never wait in line.
    server = _start(servers, workers=2, threads=8, max_queue=0, yield_when_full=True)
    gate = tmp_path / "gate"
    burst = _hold(server, tmp_path, 3, gate)
    table = _host(server)
    rows = _serving_rows(table)
    assert {row["pid"] for row in rows} == _worker_pids(server)
    assert all(row["threads"] == 8 and row["max_queue"] == 0 for row in rows)
    # The three held requests, and the one asking. The asking one's admission is published at
    # the end of the main loop's turn: with a GIL that turn ends before the request's thread
    # runs; without one (a free-threaded build) the thread may read the table first.
    asking = {1} if gil_enabled() else {0, 1}
    assert table["totals"]["in_flight"] - 3 in asking and table["totals"]["queued"] == 0, rows
    gate.touch()
    assert statuses(burst.join()) == {200: 3}
    time.sleep(SETTLE_S)
    assert _host(server)["totals"]["in_flight"] in asking


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads worker pids from /proc")
def test_a_dead_workers_row_is_reset_when_the_arbiter_replaces_it(servers: list[RunningServer], tmp_path: Path) -> None:
    server = _start(servers, workers=2, threads=8, max_queue=0, yield_when_full=True)
    gate = tmp_path / "gate"
    burst = _hold(server, tmp_path, 4, gate)
    table = _host(server)
    victim = max(_serving_rows(table), key=lambda row: row["in_flight"])
    # The worker that answered counts the question among its requests in flight.
    held_by_victim = victim["in_flight"] - (victim["pid"] == table["answered_by"])
    assert held_by_victim > 0  # four held on two workers: one has at least two
    os.kill(victim["pid"], signal.SIGKILL)

    def replaced() -> bool:
        rows = _serving_rows(_host(server))
        return len(rows) == 2 and victim["pid"] not in {row["pid"] for row in rows}

    wait_until(replaced, "the arbiter to replace the killed worker", WAIT_S)
    table = _host(server)
    assert all(row["generation"] != victim["generation"] and row["pid"] != victim["pid"] for row in table["rows"])
    replacement = [row for row in table["rows"] if row["generation"] > victim["generation"]]
    assert replacement and all(row["pid"] in _worker_pids(server) for row in replacement)
    gate.touch()
    outcomes = burst.wait(4)
    # The survivor's held requests were answered; the victim's clients lost their connection.
    assert len(burst.errors) == held_by_victim, burst.errors
    survivors = 4 - held_by_victim
    assert statuses(outcomes) == ({200: survivors} if survivors else {})
    time.sleep(SETTLE_S)
    # The one asking, whose admission is published at the end of the main loop's turn: without a
    # GIL its thread may read the table first (as in the test above).
    assert _host(server)["totals"]["in_flight"] in ({1} if gil_enabled() else {0, 1})


def _one_full_worker_then_requests(
    servers: list[RunningServer], tmp_path: Path, yield_when_full: bool, requests: int
) -> tuple[dict[int, int], dict[str, int]]:
    """-w 2, one place per worker; one worker held full while ``requests`` others arrive one by one."""
    server = _start(servers, workers=2, threads=1, max_queue=0, yield_when_full=yield_when_full)
    before = _host(server)["totals"]
    time.sleep(SETTLE_S)
    gate = tmp_path / "gate"
    burst = _hold(server, tmp_path, 1, gate)
    seen: dict[int, int] = {}
    for _ in range(requests):
        outcome = request(server.port, "/work")
        seen[outcome.status] = seen.get(outcome.status, 0) + 1
        time.sleep(SETTLE_S)
    gate.touch()
    assert statuses(burst.join()) == {200: 1}
    time.sleep(SETTLE_S)
    after = _host(server)["totals"]
    return seen, {name: after[name] - before[name] for name in ("refused_full", "refused_sibling_room", "yields")}


def test_with_yield_a_request_is_served_by_the_sibling_with_room_never_refused(
    servers: list[RunningServer], tmp_path: Path
) -> None:
    seen, counted = _one_full_worker_then_requests(servers, tmp_path, yield_when_full=True, requests=8)
    assert seen == {200: 8}
    assert counted["refused_full"] == 0 and counted["refused_sibling_room"] == 0


def test_without_yield_every_503_while_the_sibling_had_room_is_counted(
    servers: list[RunningServer], tmp_path: Path
) -> None:
    seen, counted = _one_full_worker_then_requests(servers, tmp_path, yield_when_full=False, requests=8)
    assert set(seen) <= {200, 503} and sum(seen.values()) == 8
    assert counted["refused_full"] == counted["refused_sibling_room"] == seen.get(503, 0)
    assert counted["yields"] == 0


def test_with_yield_a_full_host_still_refuses_at_once(servers: list[RunningServer], tmp_path: Path) -> None:
    server = _start(servers, workers=2, threads=1, max_queue=0, yield_when_full=True)
    gate = tmp_path / "gate"
    # One place per worker: with yield, the second held request must land on the other worker.
    burst = _hold(server, tmp_path, 2, gate)
    outcome = request(server.port, "/work")
    assert (outcome.status, outcome.reason) == (503, "queue-full")
    assert outcome.elapsed_s < 10.0  # answered, not left in the backlog until a place frees
    gate.touch()
    assert statuses(burst.join()) == {200: 2}
    time.sleep(SETTLE_S)
    totals = _host(server)["totals"]
    assert totals["refused_full"] == 1 and totals["refused_sibling_room"] == 0, _host(server)["rows"]


def test_after_a_reload_the_new_workers_have_rows_and_the_old_ones_no_longer_count(
    servers: list[RunningServer], tmp_path: Path
) -> None:
    server = _start(servers, workers=2, threads=1, max_queue=0, yield_when_full=True)
    old = {row["generation"] for row in _serving_rows(_host(server))}
    server.process.send_signal(signal.SIGHUP)  # type: ignore[attr-defined]

    def reloaded() -> bool:
        rows = _serving_rows(_host(server))
        return len(rows) == 2 and not old & {row["generation"] for row in rows}

    wait_until(reloaded, "two new workers serving in place of the old ones", WAIT_S)
    time.sleep(SETTLE_S)
    # The reloaded host still sends a request to the worker with room.
    gate = tmp_path / "gate"
    burst = _hold(server, tmp_path, 1, gate)
    assert request(server.port, "/work").status == 200
    gate.touch()
    assert statuses(burst.join()) == {200: 1}
