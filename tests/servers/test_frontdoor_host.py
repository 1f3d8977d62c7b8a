"""The front door as a host (``--workers N``): one triage process, N worker processes, one admission decision.

Real processes on loopback, real HTTP clients. Two entry points: a
``create_server(app, workers=2, ...)`` started in this process (the app is
forked with the workers; the tests read ``stats()`` and ``worker_pids()``),
and a real ``prazo serve ... --server prazo --workers 2`` subprocess, signalled
as an operator would (SIGTERM, SIGHUP). Both serve ``_host_app`` (the
harness's app, plus ``/pid`` and ``/host-stats``, which say which worker
answered). Requests are held at gate files the test creates, and a test
waits for the mark file of each held request, or for the host's counters,
before it acts; every wait is bounded generously, and nothing asserts on speed
but the issue's own bound (a dead worker replaced within 2 s).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import assert_conservation, wait_until
from _host_app import app
from _server_harness import (
    CLIENT_TIMEOUT_S,
    TEST_DEFAULT_BUDGET_MS,
    TESTS_DIR,
    Burst,
    Outcome,
    connection_refused,
    exchange,
    request,
    statuses,
)
from prazo.bindings.servers.frontdoor import FrontDoorHost, create_server
from prazo.bindings.servers.settings import resolve_settings

# slow: real time; compiled: its subject is the engine's C (triage and channels), so `make sanitize` runs it.
pytestmark = [pytest.mark.slow, pytest.mark.compiled]

WAIT_S = 30.0
BUDGET = "X-Request-Budget-Ms"
# `prazo serve` as a deployment without prazo.bench runs it.
_SERVE = (sys.executable, "-m", "prazo.bindings.servers.serve")
# The bound of issue 21 for a dead worker's replacement.
REPLACED_WITHIN_S = 2.0


# -- in this process: create_server(workers=N) --------------------------------------------------


@pytest.fixture
def hosts() -> Iterator[Callable[..., FrontDoorHost]]:
    """``hosts(**options)``: a started ``create_server(app, port=0, workers=2, threads=2, ...)``; all shut down after."""
    started: list[FrontDoorHost] = []

    def start(application: Any = app, **options: Any) -> FrontDoorHost:
        options.setdefault("workers", 2)
        if "settings" not in options:
            options.setdefault("threads", 2)
            options.setdefault("max_queue", 20)
            options.setdefault("default_budget_ms", TEST_DEFAULT_BUDGET_MS)
        host = create_server(application, port=0, **options)
        assert isinstance(host, FrontDoorHost)
        host.start()
        started.append(host)
        return host

    yield start
    for host in started:
        host.shutdown(5.0)


def idle(host: FrontDoorHost) -> dict[str, Any]:
    """Wait until nothing runs or waits in the host; its stats then."""
    wait_until(
        lambda: (lambda s: s["in_flight"] + s["queued"] + s["assigned"] == 0)(host.stats()), "the host idle", WAIT_S
    )
    return host.stats()


def waiting(stats: dict[str, Any]) -> int:
    """Admitted requests not running yet (a normal one kept from a free thread by a reserved place is ``assigned``)."""
    return int(stats["queued"] + stats["assigned"])


def hold(port: int, marks: list[Path], gate: Path, path: str = "/work", **query: str) -> Burst:
    """One request per mark, each held at ``gate``; returns once every one of them runs."""
    extra = "".join(f"&{name}={value}" for name, value in query.items())
    burst = Burst(port, [f"{path}?gate={gate}&mark={mark}{extra}" for mark in marks])
    wait_until(lambda: all(mark.exists() for mark in marks), f"{len(marks)} held requests running", WAIT_S)
    return burst


def loads(host: FrontDoorHost) -> list[int]:
    """The requests running on each worker, smallest first."""
    return sorted(host.stats()["worker_in_flight"].values())


def pid_of(outcome: Outcome) -> int:
    assert outcome.status == 200, outcome
    return int(json.loads(outcome.body)["pid"]) if outcome.body.startswith(b"{") else int(outcome.body)


def serving_pids(port: int, tmp_path: Path, name: str) -> set[int]:
    """The pids of the two workers, each seen answering: one request held on one worker, so the next goes to the other."""
    gate = tmp_path / f"{name}-gate"
    held = hold(port, [tmp_path / f"{name}-mark"], gate, "/host-stats")
    other = pid_of(request(port, "/pid"))
    gate.touch()
    return {pid_of(held.join()[0]), other}


def test_the_seed_scenario_through_two_workers_splits_host_wide(hosts: Any, tmp_path: Path) -> None:
    # 2 workers x 2 threads = 4 places, one line of 20: 24 run, 16 are refused at once, as one process does.
    host = hosts(workers=2, threads=2, max_queue=20)
    gate = tmp_path / "gate"
    # The first wave holds at the gate until the 16 refusals are out, so the split never
    # depends on how fast a loaded machine reads 40 connections; the budget outlasts the six
    # 300 ms waves by far on any machine (the split is the subject here, not expiry: with the
    # issue's 2 s budgets the last wave starts with about 0.45 s to spare on an idle 2-core
    # machine, and its requests were seen to expire at a load average of 8).
    burst = Burst(host.port, [f"/work?ms=300&gate={gate}"] * 40, {BUDGET: "20000"})
    early = burst.wait(16)
    assert statuses(early) == {503: 16}
    assert {outcome.reason for outcome in early} == {"queue-full"}
    stats = host.stats()
    # Refused while every admitted request was still held: 4 running, spread 2 and 2, and 20 in line.
    assert (stats["offered"], stats["started"], stats["queued"], stats["rejected_full"]) == (40, 4, 20, 16), stats
    assert loads(host) == [2, 2]
    gate.touch()
    assert statuses(burst.join()) == {200: 24, 503: 16}
    stats = idle(host)
    assert (stats["started"], stats["completed"], stats["rejected_full"], stats["worker_lost"]) == (24, 24, 16, 0)
    assert stats["peak_in_flight"] <= 4 and stats["peak_queued"] == 20
    assert (stats["worker_processes"], stats["worker_threads"], stats["max_concurrency"], stats["max_queue"]) == (
        2,
        4,
        4,
        20,
    )
    assert_conservation(stats)
    assert stats["offered"] == stats["admitted"] + stats["rejected_full"] + stats["expired_on_arrival"], stats


def test_no_refusal_while_a_sibling_has_room(hosts: Any, tmp_path: Path) -> None:
    # One place a worker and no line: the only room is the idle worker's thread.
    host = hosts(workers=2, threads=1, max_queue=0)
    gate = tmp_path / "gate"
    held = hold(host.port, [tmp_path / "held"], gate)
    assert loads(host) == [0, 1]
    served_by = set()
    for _ in range(8):
        outcome = request(host.port, "/pid")
        assert (outcome.status, outcome.reason) == (200, None), outcome
        served_by.add(pid_of(outcome))
        # A place comes back a moment after its answer: the next request must not race it.
        wait_until(lambda: host.stats()["in_flight"] == 1, "the idle worker's place back", WAIT_S)
    assert len(served_by) == 1 and served_by < set(host.worker_pids())
    assert host.stats()["rejected_full"] == 0
    gate.touch()
    assert statuses(held.join()) == {200: 1}
    assert_conservation(idle(host))


def test_the_triage_sends_each_request_to_the_least_loaded_worker(hosts: Any, tmp_path: Path) -> None:
    host = hosts(workers=2, threads=2, max_queue=0)
    gate = tmp_path / "gate"
    bursts, seen = [], []
    for number in range(4):
        bursts.append(hold(host.port, [tmp_path / f"held-{number}"], gate))
        seen.append(loads(host))
    # Never two on one worker while the other has none.
    assert seen == [[0, 1], [1, 1], [1, 2], [2, 2]]
    refused = request(host.port, "/work")
    assert (refused.status, refused.reason) == (503, "queue-full")  # every place of the host taken, no line
    gate.touch()
    for burst in bursts:
        assert statuses(burst.join()) == {200: 1}
    stats = idle(host)
    assert (stats["started"], stats["rejected_full"]) == (4, 1)
    assert_conservation(stats)


def test_a_worker_killed_under_load_is_replaced_and_every_request_has_one_outcome(hosts: Any, tmp_path: Path) -> None:
    host = hosts(workers=2, threads=2, max_queue=20)
    gate = tmp_path / "gate"
    running = hold(host.port, [tmp_path / f"running-{n}" for n in range(4)], gate)
    assert loads(host) == [2, 2]  # whichever worker dies, two of its requests were running
    waiting = Burst(host.port, [f"/work?gate={gate}"] * 4)
    wait_until(lambda: host.stats()["queued"] == 4, "four requests in line", WAIT_S)
    before = host.worker_pids()
    ids_before = set(host.stats()["worker_in_flight"])
    victim = before[0]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        pids = host.worker_pids()
        return len(pids) == 2 and victim not in pids

    wait_until(replaced, "a new worker in place of the killed one", REPLACED_WITHIN_S)
    (newcomer,) = set(host.worker_pids()) - set(before)
    # The replacement serves: the line's first two go to its threads (still held at the gate).
    wait_until(lambda: loads(host) == [2, 2] and host.stats()["queued"] == 2, "the newcomer serving", WAIT_S)
    assert time.monotonic() - killed_at < WAIT_S
    ids_after = set(host.stats()["worker_in_flight"])
    assert len(ids_after) == 2 and len(ids_after & ids_before) == 1  # the victim's id gone, a new one serving
    stats = host.stats()
    assert stats["worker_lost"] == 2, stats
    gate.touch()
    # The victim's two clients saw their connection close (never a hang to the client's timeout).
    running.wait(4)
    assert len(running.errors) == 2, running.errors
    for error in running.errors:
        assert isinstance(error, ConnectionError) and not isinstance(error, TimeoutError), repr(error)
    assert statuses(running.outcomes) == {200: 2}
    assert statuses(waiting.join()) == {200: 4}
    assert serving_pids(host.port, tmp_path, "after") == set(host.worker_pids()) == set(before) - {victim} | {newcomer}
    stats = idle(host)
    assert (stats["worker_lost"], stats["started"], stats["rejected_full"]) == (2, 10, 0), stats
    assert stats["started"] == stats["completed"], stats  # a lost request's place came back too
    assert_conservation(stats)
    assert host.replaced == 1


def test_kept_alive_and_pipelined_requests_come_back_to_the_triage_between_requests(hosts: Any) -> None:
    host = hosts(workers=2, threads=2, max_queue=4)
    head = b"GET /pid HTTP/1.1\r\nHost: test\r\n\r\n"
    answer = exchange(host.port, head * 2 + head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
    assert answer.count(b"HTTP/1.1 200 ") == 3, answer
    # A body the worker reads from the descriptor it was handed, past what the triage had read.
    body = bytes(range(256)) * 1200
    posted = request(host.port, "/work", method="POST", body=body, headers={"Content-Type": "application/octet-stream"})
    assert posted.status == 200, posted
    stats = idle(host)
    assert (stats["offered"], stats["admitted"], stats["completed"]) == (4, 4, 4), stats  # each triaged anew
    assert_conservation(stats)


def test_a_kept_alive_connection_outlives_the_worker_that_served_it(hosts: Any) -> None:
    host = hosts(workers=2, threads=2, max_queue=4)
    conn = http.client.HTTPConnection("127.0.0.1", host.port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request("GET", "/pid")
        first = conn.getresponse()
        served_by = int(first.read())
        assert first.status == 200 and first.getheader("Connection") == "keep-alive"
        # Its place comes back with the connection itself: then the triage holds it, waiting for the next head.
        idle(host)
        os.kill(served_by, signal.SIGKILL)
        wait_until(
            lambda: served_by not in host.worker_pids() and len(host.worker_pids()) == 2, "a replacement", WAIT_S
        )
        conn.request("GET", "/pid")
        second = conn.getresponse()
        assert second.status == 200 and int(second.read()) in host.worker_pids()
    finally:
        conn.close()
    stats = idle(host)
    assert (stats["worker_lost"], stats["completed"]) == (0, 2), stats


# The triage's engine in a process of its own, this script playing a worker that gives a
# kept-alive connection back and closes its copy of the descriptor a second later (a
# worker process descheduled between its DONE and its close). The client leaves meanwhile.
_STALE_COPY = """
import socket, sys, time
import test_frontdoor_channels as ch

triage = ch.Triage()
worker = triage.channel(0)
ch.send(worker, ch.HELLO)
browser = ch.client(triage.port, b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
one = ch.dispatched(worker)
one.conn.sendall(ch.RESPONSE)
ch.send(worker, ch.FINISH, one.token, verdict=1)
received = b""
while not received.endswith(b"ok"):
    received += browser.recv(4096)
browser.close()
end = time.monotonic() + 10
while triage.stats()["open_connections"] and time.monotonic() < end:
    time.sleep(0.01)
cpu = time.process_time()
time.sleep(1.0)
print(f"cpu_s={time.process_time() - cpu:.3f}", flush=True)
one.conn.close()
second = ch.client(triage.port, b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
print("dispatched" if ch.dispatched(worker).data.startswith(b"GET / ") else "lost", flush=True)
triage.engine.stop()
"""


def test_the_triage_forgets_a_closed_connection_while_a_worker_still_holds_a_copy() -> None:
    # epoll drops a descriptor when the last copy of its open file closes: the triage's
    # close() alone leaves the freed connection registered while the worker's copy lives,
    # and epoll then reports the client's hang-up for it again and again.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TESTS_DIR), str(Path(__file__).parent), env.get("PYTHONPATH")])
    )
    result = subprocess.run(
        [sys.executable, "-c", _STALE_COPY], check=False, env=env, capture_output=True, text=True, timeout=WAIT_S
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cpu_s = float(re.search(r"cpu_s=([0-9.]+)", result.stdout).group(1))  # type: ignore[union-attr]
    # Idle, the engine sleeps in epoll_wait; woken for a freed connection it spins (or crashes).
    assert cpu_s < 0.1, result.stdout
    assert "dispatched" in result.stdout, result.stdout


# -- policies, host-wide -----------------------------------------------------------------------


def test_a_reserved_place_on_any_worker_serves_the_critical_path_when_normal_places_are_full(
    hosts: Any, tmp_path: Path
) -> None:
    host = hosts(workers=2, threads=2, max_queue=20, reserved=1, critical_paths=["/healthz", "/critical-work"])
    gate = tmp_path / "gate"
    # Critical work runs: normal requests get the host's places but the reserved one (3 of 4).
    critical = hold(host.port, [tmp_path / "critical"], gate, "/critical-work")
    normal = hold(host.port, [tmp_path / "normal-0", tmp_path / "normal-1"], gate)
    parked = Burst(host.port, [f"/work?gate={gate}&mark={tmp_path / 'parked'}"])
    wait_until(lambda: waiting(host.stats()) == 1, "a normal request in line", WAIT_S)
    assert loads(host) == [1, 2]  # a thread is free, yet the normal request waits
    health = request(host.port, "/healthz")
    assert (health.status, health.body) == (200, b"ok")  # the reserved place, while every normal one is taken
    assert not (tmp_path / "parked").exists() and waiting(host.stats()) == 1
    gate.touch()
    for burst in (critical, normal, parked):
        assert set(statuses(burst.join())) == {200}
    stats = idle(host)
    assert (stats["critical_started"], stats["started"], stats["rejected_full"]) == (2, 5, 0), stats
    assert_conservation(stats)


def test_lifo_serves_the_newest_waiter_first_whichever_worker_frees_a_thread(hosts: Any, tmp_path: Path) -> None:
    host = hosts(workers=2, threads=2, max_queue=20, order="lifo")
    gates = [tmp_path / f"gate-{n}" for n in range(4)]
    # One at a time, so the least-loaded rule puts holders 0 and 1 on different workers.
    holders = [hold(host.port, [tmp_path / f"holder-{n}"], gates[n], "/host-stats") for n in range(4)]
    assert loads(host) == [2, 2]
    waiter_gate = tmp_path / "waiters"
    waiters = {}
    for name in ("b", "c", "d"):
        queued = host.stats()["queued"]
        waiters[name] = Burst(host.port, [f"/host-stats?gate={waiter_gate}&mark={tmp_path / name}"])
        wait_until(lambda queued=queued: host.stats()["queued"] == queued + 1, f"{name} in line", WAIT_S)
    gates[0].touch()  # one thread frees: it takes the newest
    wait_until((tmp_path / "d").exists, "the newest waiter to start", WAIT_S)
    assert not (tmp_path / "c").exists() and not (tmp_path / "b").exists()
    gates[1].touch()  # a thread of the other worker frees
    wait_until((tmp_path / "c").exists, "the next newest waiter to start", WAIT_S)
    assert not (tmp_path / "b").exists()
    for gate in (*gates, waiter_gate):
        gate.touch()
    held_by = [pid_of(burst.join()[0]) for burst in holders]
    served_by = {name: pid_of(burst.join()[0]) for name, burst in waiters.items()}
    assert held_by[0] != held_by[1]
    assert (served_by["d"], served_by["c"]) == (held_by[0], held_by[1])
    assert_conservation(idle(host))


def _from(port: int, headers: dict[str, str], source: str, path: str = "/budget-header") -> Outcome:
    """``request`` from the loopback address ``source``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S, source_address=(source, 0))
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return Outcome(response.status, response.getheader("X-Prazo-Reason"), response.read(), 0.0)
    finally:
        conn.close()


def _remaining_ms(outcome: Outcome) -> int:
    assert outcome.status == 200, outcome
    match = re.search(rb"remaining_ms=(-?\d+)", outcome.body)
    assert match, outcome.body
    return int(match.group(1))


def _stamp(seconds_ago: float) -> str:
    return f"t={time.time() - seconds_ago:.3f}"


def test_trust_request_start_corrects_the_deadline_the_workers_run_by(hosts: Any, tmp_path: Path) -> None:
    settings = resolve_settings(
        threads=2, max_queue=4, default_budget_ms=TEST_DEFAULT_BUDGET_MS, trust_request_start=True,
        trusted_proxies=["127.0.0.1"], environ={},
    )  # fmt: skip
    host = hosts(settings=settings)
    # From the trusted proxy, on both workers: 10 s of budget, 3 s spent in the proxy.
    for _ in range(4):
        remaining = _remaining_ms(_from(host.port, {BUDGET: "10000", "X-Request-Start": _stamp(3.0)}, "127.0.0.1"))
        assert 1000 < remaining <= 7050
    # From another peer the stamp counts for nothing.
    assert _remaining_ms(_from(host.port, {BUDGET: "10000", "X-Request-Start": _stamp(3.0)}, "127.0.0.3")) > 8000
    assert host.stats()["upstream_stamps"] == 4
    # Every place of the host held: a budget used up in the proxy is answered by the triage.
    gate = tmp_path / "gate"
    held = hold(host.port, [tmp_path / f"held-{n}" for n in range(4)], gate)
    spent = _from(host.port, {BUDGET: "2000", "X-Request-Start": _stamp(3.0)}, "127.0.0.1", "/work")
    assert (spent.status, spent.reason) == (504, "expired-on-arrival")
    # 6 s of budget, 5 s spent: it expires in the host's line, at the corrected deadline, workers still held.
    late = _from(host.port, {BUDGET: "6000", "X-Request-Start": _stamp(5.0)}, "127.0.0.1", "/work")
    assert (late.status, late.reason) == (504, "expired-in-queue")
    assert not gate.exists()
    gate.touch()
    assert statuses(held.join()) == {200: 4}
    stats = idle(host)
    assert (stats["expired_on_arrival"], stats["expired_in_queue"], stats["upstream_stamps"]) == (1, 1, 6), stats
    assert stats["started"] == 9
    assert_conservation(stats)


# -- the host's figures inside a worker, max_requests, wrong arguments ------------------------


def test_server_stats_in_a_worker_are_the_hosts(hosts: Any, tmp_path: Path) -> None:
    host = hosts(workers=2, threads=2, max_queue=4)
    gate = tmp_path / "gate"
    # Held on one worker, it reads the host's figures once the other worker has served five requests.
    asking = hold(host.port, [tmp_path / "asking"], gate, "/host-stats")
    others = set()
    for _ in range(5):
        others.add(pid_of(request(host.port, "/pid")))
        wait_until(lambda: host.stats()["in_flight"] == 1, "the place back", WAIT_S)
    gate.touch()
    answer = json.loads(asking.join()[0].body)
    seen = answer["stats"]
    assert len(others) == 1 and answer["pid"] not in others  # the least-loaded rule
    assert {answer["pid"], *others} == set(host.worker_pids())
    # The asking worker counts what its sibling served, and itself running.
    assert (seen["offered"], seen["completed"], seen["in_flight"], seen["worker_processes"]) == (6, 5, 1, 2), seen
    assert sorted(seen["worker_in_flight"].values()) == [0, 1]
    stats = idle(host)
    assert (stats["offered"], stats["completed"]) == (6, 6)


def test_a_request_reading_the_hosts_figures_during_a_drain_is_answered_and_the_drain_ends(
    hosts: Any, tmp_path: Path
) -> None:
    # A metrics scrape admitted before a shutdown (prometheus.register(host=current_host())) asks
    # the triage for the host's figures while the triage drains: it must get them, and the drain
    # must end when that request does, not at the shutdown timeout.
    host = hosts(workers=2, threads=2, max_queue=4)
    gate = tmp_path / "gate"
    scrape = hold(host.port, [tmp_path / "scrape"], gate, "/host-stats")
    drained: list[bool] = []
    stopping = threading.Thread(target=lambda: drained.append(host.shutdown(15.0)), daemon=True)
    stopping.start()
    wait_until(lambda: connection_refused(host.port), "the port to close", WAIT_S)
    gate.touch()
    seen = json.loads(scrape.join()[0].body)["stats"]
    stopping.join(WAIT_S)
    assert drained == [True]  # idle before the timeout: the drain ended with the request
    assert seen.get("offered") == 1 and seen.get("in_flight") == 1, seen


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "host"])
def test_a_request_pipelined_behind_a_running_one_during_a_drain_is_answered_shutting_down(
    workers: int, tmp_path: Path
) -> None:
    # Issue 33, defect 6: keep-alive was decided when the first request started, and the
    # connection handed back during the drain was closed without a look at the next request
    # already read: the client got neither `Connection: close` nor the documented 503.
    server = create_server(
        app, port=0, workers=workers, threads=1, max_queue=4, default_budget_ms=TEST_DEFAULT_BUDGET_MS
    )
    server.start()
    mark, gate = tmp_path / "mark", tmp_path / "gate"
    drained: list[bool] = []
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as client:
        client.sendall(
            f"GET /work?gate={gate}&mark={mark} HTTP/1.1\r\nHost: t\r\n\r\nGET /pid HTTP/1.1\r\nHost: t\r\n\r\n".encode()
        )
        wait_until(mark.exists, "the first request running", WAIT_S)
        stopping = threading.Thread(target=lambda: drained.append(server.shutdown(15.0)), daemon=True)
        stopping.start()
        wait_until(lambda: connection_refused(server.port), "the port to close", WAIT_S)
        gate.touch()
        received = b""
        while chunk := client.recv(65536):  # until the server closes (the timeout fails the test)
            received += chunk
    stopping.join(WAIT_S)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"200", b"503"], received  # a body ends without a newline
    assert b"X-Prazo-Reason: shutting-down" in received.split(b"HTTP/1.1 503", 1)[1], received
    assert drained == [True]


@pytest.mark.parametrize("jitter", [0, 2])
def test_max_requests_replaces_workers_without_refusing(hosts: Any, jitter: int) -> None:
    host = hosts(workers=2, threads=1, max_queue=0, max_requests=3, max_requests_jitter=jitter)
    served_by: dict[int, int] = {}
    sent = 0
    # Until both first workers are replaced: a retiring worker serves on until its successor
    # does, so how many requests that takes depends on how fast the successors start.
    end = time.monotonic() + WAIT_S
    while len(served_by) < 4 and time.monotonic() < end:
        outcome = request(host.port, "/pid")
        sent += 1
        assert (outcome.status, outcome.reason) == (200, None), outcome
        pid = pid_of(outcome)
        served_by[pid] = served_by.get(pid, 0) + 1
        wait_until(lambda: host.stats()["in_flight"] == 0, "the place back", WAIT_S)
    assert len(served_by) >= 4, served_by
    wait_until(lambda: len(host.worker_pids()) == 2, "two workers serving", WAIT_S)
    # Each retired worker served its 3, and serves on past them until its successor serves (issue 33).
    retired = set(served_by) - set(host.worker_pids())
    assert len(retired) >= 2 and min(served_by[pid] for pid in retired) >= 3, served_by
    assert host.replaced >= 2
    stats = idle(host)
    assert (stats["rejected_full"], stats["worker_lost"], stats["started"]) == (0, 0, sent), stats
    assert_conservation(stats)


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        ({"workers": 0}, ValueError, "workers"),
        ({"workers": 65}, ValueError, "workers"),
        ({"workers": "2"}, TypeError, "workers"),
        ({"workers": 2.0}, TypeError, "workers"),
        ({"workers": True}, TypeError, "workers"),
        ({"workers": 2, "max_requests": 0}, ValueError, "max_requests"),
        ({"workers": 2, "max_requests": "3"}, TypeError, "max_requests"),
        ({"workers": 2, "max_requests": True}, TypeError, "max_requests"),
        ({"workers": 2, "max_requests": 3, "max_requests_jitter": -1}, ValueError, "max_requests_jitter"),
        ({"workers": 2, "max_requests": 3, "max_requests_jitter": "2"}, TypeError, "max_requests_jitter"),
        ({"workers": 2, "max_requests": 3, "max_requests_jitter": True}, TypeError, "max_requests_jitter"),
        ({"workers": 2, "max_requests_jitter": 2}, ValueError, "max_requests_jitter"),
        ({"workers": 2, "reuse_port": True}, ValueError, "reuse_port"),
        ({"workers": 2, "threads": 2, "reserved": 4}, ValueError, "reserved"),  # the host's 4 places
    ],
)
def test_wrong_arguments_raise_naming_the_argument(options: dict[str, Any], error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=name):
        create_server(app, port=0, **options)


def test_a_shutdown_timeout_that_is_no_number_of_seconds_is_refused_and_loses_nothing() -> None:
    host = create_server(app, port=0, workers=2, threads=1)
    port = host.port
    for timeout, error in ((math.nan, ValueError), (-1.0, ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="timeout"):
            host.shutdown(timeout)
    assert host.shutdown(0.0)  # never started: the port is just let go
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # free again


# -- a real `prazo serve --server prazo --workers 2` ------------------------------------------


class Served:
    """A ``prazo serve`` process in its own session (so the test can find anything it leaves behind)."""

    def __init__(self, options: list[str], app_spec: str = "_host_app:app", path: tuple[Path, ...] = ()) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, path), str(TESTS_DIR), env.get("PYTHONPATH")]))
        command = [
            *_SERVE, app_spec, "--server", "prazo", "--port", "0", "--workers", "2",
            "--default-budget-ms", str(TEST_DEFAULT_BUDGET_MS), *options,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        assert self.process.stdout is not None
        self.line = self.process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+) ", self.line)
        self.port = int(match.group(1)) if match else 0

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr.append(line)

    def serving(self) -> None:
        """Wait until both workers answer (the supervisor boots them after its startup line)."""
        assert self.port, self.line + "".join(self.stderr)

        def answers() -> bool:
            assert self.process.poll() is None, "".join(self.stderr)
            try:
                return request(self.port, "/healthz").status == 200
            except OSError:
                return False

        wait_until(answers, "prazo serve to answer", WAIT_S)

    def host_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = json.loads(request(self.port, "/host-stats").body)["stats"]
        return stats

    def children(self) -> set[int]:
        pid = self.process.pid
        return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}

    def wait(self) -> int:
        try:
            code = self.process.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError("prazo serve did not exit:\n" + "".join(self.stderr)) from None
        self._reader.join(WAIT_S)
        return code

    def left_behind(self) -> list[int]:
        """Processes still in its session."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.process.pid and fields[0] != "Z":  # the session id
                found.append(int(entry.name))
        return found

    def kill(self) -> None:
        """Everything of its session, by its process group (the test's own processes only)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(WAIT_S)


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(*options: str, **how: Any) -> Served:
        served = Served(list(options), **how)
        started.append(served)
        return served

    yield start
    for served in started:
        served.kill()


def test_sigterm_under_load_loses_nothing_admitted(serve: Any, tmp_path: Path) -> None:
    # A reserved place and critical paths let the test ask the host's figures while the
    # normal places are all taken and requests wait in line.
    served = serve(
        "--threads", "2", "--max-queue", "20", "--shutdown-timeout", "20", "--reserved", "1",
        "--critical-path", "/critical-work", "--critical-path", "/host-stats",
    )  # fmt: skip
    served.serving()
    gate = tmp_path / "gate"
    running = [hold(served.port, [tmp_path / "critical"], gate, "/critical-work")]
    running.append(hold(served.port, [tmp_path / "normal-0", tmp_path / "normal-1"], gate))
    in_line = Burst(served.port, [f"/work?gate={gate}"] * 5)
    wait_until(lambda: waiting(served.host_stats()) == 5, "five requests in line", WAIT_S)
    assert served.host_stats()["in_flight"] == 4  # three held, and the one asking
    served.process.send_signal(signal.SIGTERM)
    wait_until(lambda: connection_refused(served.port), "the port to close", WAIT_S)
    gate.touch()
    for burst in running:
        assert set(statuses(burst.join())) == {200}
    assert statuses(in_line.join()) == {200: 5}  # waiting when the signal came: served all the same
    assert served.wait() == 0
    assert connection_refused(served.port)
    assert served.left_behind() == []


def test_sighup_reloads_every_worker_under_a_steady_stream_refusing_nothing(serve: Any) -> None:
    # Two clients, four places: a reload that dropped places would show as 503s with this small line.
    served = serve("--threads", "2", "--max-queue", "2", "--shutdown-timeout", "10")
    served.serving()
    seen: list[tuple[float, int, int | None]] = []  # (sent, status, pid)
    errors: list[BaseException] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                outcome = request(served.port, "/pid?ms=20")
            except BaseException as exc:  # noqa: BLE001 - the test asserts there were none
                errors.append(exc)
                return
            seen.append((sent, outcome.status, pid_of(outcome) if outcome.status == 200 else None))

    def stream_seen(what: str, predicate: Callable[[], bool]) -> None:
        wait_until(lambda: bool(errors) or predicate(), what, WAIT_S)
        assert not errors, errors

    clients = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for thread in clients:
        thread.start()
    try:
        stream_seen("both workers serving the stream", lambda: len({pid for _, _, pid in seen}) == 2)
        old = {pid for _, _, pid in seen}
        assert old < served.children()
        served.process.send_signal(signal.SIGHUP)

        def reloaded() -> bool:
            children = served.children()
            return len(children) == 3 and not old & children  # the triage and two new workers

        stream_seen("both workers replaced", reloaded)
        after = time.monotonic()  # a request sent from now on can only reach a new worker
        stream_seen("the new workers serving", lambda: len({pid for sent, _, pid in seen if sent > after}) == 2)
    finally:
        stop.set()
        for thread in clients:
            thread.join(CLIENT_TIMEOUT_S)
    assert not errors, errors
    assert {status for _, status, _ in seen} == {200}, [entry for entry in seen if entry[1] != 200]
    new = {pid for sent, _, pid in seen if sent > after}
    assert not new & old and new < served.children()
    served.process.send_signal(signal.SIGTERM)
    assert served.wait() == 0


def test_a_reload_lets_the_old_workers_finish_what_they_run(serve: Any, tmp_path: Path) -> None:
    served = serve("--threads", "2", "--max-queue", "4", "--shutdown-timeout", "20")
    served.serving()
    gate = tmp_path / "gate"
    held = [hold(served.port, [tmp_path / f"held-{n}"], gate, "/host-stats") for n in range(2)]  # one on each
    old = served.children()
    served.process.send_signal(signal.SIGHUP)
    # A new worker serves beside the retiring ones, which keep their running requests.
    wait_until(lambda: len(served.children()) >= 4, "a new worker beside the old ones", WAIT_S)
    fresh = served.children() - old
    assert len(fresh) == 1
    meanwhile = {pid_of(request(served.port, "/pid")) for _ in range(4)}  # served meanwhile, never refused
    assert meanwhile <= old | fresh
    gate.touch()
    held_by = {pid_of(burst.join()[0]) for burst in held}
    assert len(held_by) == 2 and held_by < old  # answered by the old workers, 200
    wait_until(lambda: len(served.children()) == 3 and not held_by & served.children(), "the reload", WAIT_S)
    served.process.send_signal(signal.SIGTERM)
    assert served.wait() == 0


def test_a_worker_whose_app_import_fails_stops_prazo_serve_with_the_error(serve: Any, tmp_path: Path) -> None:
    (tmp_path / "broken_host_app.py").write_text('raise RuntimeError("boom at import")\napp = None\n')
    served = serve("--threads", "2", app_spec="broken_host_app:app", path=(tmp_path,))
    code = served.wait()
    stderr = "".join(served.stderr)
    assert code != 0, stderr
    assert "boom at import" in stderr and "failed to start" in stderr, stderr
    assert stderr.count("Traceback") == 1, stderr  # the supervisor's report, not one per worker
    assert served.left_behind() == []


def test_an_app_that_cannot_be_imported_is_one_line_not_a_traceback_per_worker(serve: Any, tmp_path: Path) -> None:
    """Issue 33: each worker printed its chained traceback (43 lines for two); now the host says it once."""
    (tmp_path / "missing_dependency_app.py").write_text("import no_such_module_for_prazo_tests\napp = None\n")
    served = serve("--threads", "2", app_spec="missing_dependency_app:app", path=(tmp_path,))
    code = served.wait()
    stderr = "".join(served.stderr)
    # Whichever worker fails first is named: both start at once, and either may lose the race.
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    (line,) = lines
    assert re.fullmatch(
        r"prazo serve: error: worker [01] failed to start: cannot import 'missing_dependency_app': "
        r"No module named 'no_such_module_for_prazo_tests'",
        line,
    ), stderr
    assert code == 1
    assert served.left_behind() == []


def test_an_app_that_exits_at_import_stops_the_host_instead_of_respawning_forever(serve: Any, tmp_path: Path) -> None:
    """A SystemExit at import used to look like a crash: each worker was replaced, and failed again, forever."""
    (tmp_path / "exiting_app.py").write_text("import sys\nsys.exit(5)\n")
    served = serve("--threads", "2", app_spec="exiting_app:app", path=(tmp_path,))
    code = served.wait()  # the failure before the fix: it never exits
    stderr = "".join(served.stderr)
    assert code == 1, stderr
    assert "failed to start" in stderr and "SystemExit: 5" in stderr, stderr
    assert stderr.count("Traceback") == 1, stderr
    assert served.left_behind() == []


def _no_new_descriptor(pid: int) -> int:
    """A soft RLIMIT_NOFILE that leaves ``pid`` no new descriptor, whichever of its descriptors it closes later.

    A new descriptor takes the lowest free number, and only one below the
    limit: so the limit is the first of 0, 1, 2 that is free, else 3.
    """
    taken = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
    return min({0, 1, 2} - taken, default=3)


def test_a_worker_start_without_descriptors_in_the_triage_fails_alone_and_the_host_serves_on(
    serve: Any, tmp_path: Path
) -> None:
    """Issue 33: a SIGHUP with the triage at its descriptor limit killed the triage (the port closed).

    The new worker's channels arrived without their descriptors, and the
    triage's handling of them raised on the empty list. Now the start fails
    alone: the old workers serve on, and the reload finishes once the
    triage has descriptors again.
    """
    served = serve("--threads", "2", "--shutdown-timeout", "10")
    served.serving()
    old = serving_pids(served.port, tmp_path, "before")
    (triage,) = served.children() - old
    # One kept-alive connection, opened before the pressure: with no descriptor to accept
    # a new connection, this is how the test sees the host serve.
    kept = http.client.HTTPConnection("127.0.0.1", served.port, timeout=CLIENT_TIMEOUT_S)

    def kept_status() -> int:
        kept.request("GET", "/pid")
        response = kept.getresponse()
        response.read()
        return response.status

    try:
        assert kept_status() == 200
        soft, hard = resource.prlimit(triage, resource.RLIMIT_NOFILE)
        resource.prlimit(triage, resource.RLIMIT_NOFILE, (_no_new_descriptor(triage), hard))
        served.process.send_signal(signal.SIGHUP)
        failed = "cannot start a worker"
        wait_until(lambda: failed in "".join(served.stderr) or served.process.poll() is not None, failed, WAIT_S)
        for _ in range(3):
            assert kept_status() == 200  # served by an old worker (before the fix: the triage was gone)
        assert old < served.children() and served.process.poll() is None
        # A crashed worker's replacement fails alike (the same start: the descriptors its exit freed
        # in the triage are above the limit), and its sibling serves meanwhile.
        crashed = min(old)
        os.kill(crashed, signal.SIGKILL)
        wait_until(lambda: crashed not in served.children(), "the killed worker reaped", WAIT_S)
        vacant = re.compile(r"cannot start a worker for slot \d+: ")  # no worker to replace: the crashed one's slot
        wait_until(lambda: bool(vacant.search("".join(served.stderr))), "its replacement's failed start", WAIT_S)
        for _ in range(3):
            assert kept_status() == 200
        resource.prlimit(triage, resource.RLIMIT_NOFILE, (soft, hard))

        def reloaded() -> bool:
            children = served.children()
            return len(children) == 3 and not old & children  # the triage and two new workers

        wait_until(reloaded, "the reload to finish once descriptors are free", WAIT_S)
        assert kept_status() == 200
    finally:
        kept.close()
    assert request(served.port, "/pid").status == 200
    stderr = "".join(served.stderr)
    assert "did not receive" in stderr, stderr  # the triage says why
    served.process.send_signal(signal.SIGTERM)
    assert served.wait() == 0, "".join(served.stderr)


def test_max_requests_replaces_one_worker_at_a_time_each_after_its_successor_serves(serve: Any, tmp_path: Path) -> None:
    """Issue 33: every worker reached --max-requests together and stopped before its successor imported the app.

    The triage spreads work evenly, so both workers retired at once and the
    host served nothing while their successors imported (28 x 504 in 16 s).
    The budget, 1.5 s, is far more than a request here takes, but less than
    the app's 2 s import: a host with no worker serving answers 504.
    """
    (tmp_path / "slow_import_app.py").write_text(
        "import time\n\ntime.sleep(2)  # an app that takes its time to import\nfrom _host_app import app  # noqa: E402\n"
    )
    served = serve(
        "--threads", "1", "--max-requests", "20", "--shutdown-timeout", "10",
        app_spec="slow_import_app:app", path=(tmp_path,),
    )  # fmt: skip
    served.serving()
    seen: list[tuple[int, str | None, int | None]] = []  # (status, reason, pid)
    errors: list[BaseException] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                outcome = request(served.port, "/pid", {BUDGET: "1500"})
            except BaseException as exc:  # noqa: BLE001 - the test asserts there were none
                errors.append(exc)
                return
            seen.append((outcome.status, outcome.reason, pid_of(outcome) if outcome.status == 200 else None))

    retirements = re.compile(r"worker \d+ \(pid (\d+)\) served its max_requests; worker \d+ \(pid (\d+)\) serves")
    clients = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for thread in clients:
        thread.start()
    try:
        # Five workers served: both first ones retired, and a successor too (each retirement takes over 2 s).
        wait_until(
            lambda: bool(errors) or any(pid is None for *_, pid in seen) or len({pid for *_, pid in seen}) >= 5,
            "five workers serving in turn",
            3 * WAIT_S,
        )
    finally:
        stop.set()
        for thread in clients:
            thread.join(CLIENT_TIMEOUT_S)
    assert not errors, errors
    refused = [entry for entry in seen if entry[0] != 200]
    assert not refused, (len(refused), refused[:5], len(seen))
    # The log says each retirement, old pid and new: the first three at least, each worker retired once.
    wait_until(lambda: len(retirements.findall("".join(served.stderr))) >= 3, "three retirements logged", WAIT_S)
    replaced = [(int(old), int(new)) for old, new in retirements.findall("".join(served.stderr))]
    retired = [old for old, _ in replaced]
    assert len(set(retired)) == len(retired) and set(retired) <= {pid for *_, pid in seen}, replaced
    assert {new for _, new in replaced[:2]} <= {pid for *_, pid in seen}, replaced  # their successors served
    wait_until(lambda: not set(retired) & served.children(), "the retired workers gone", WAIT_S)
    served.process.send_signal(signal.SIGTERM)
    assert served.wait() == 0, "".join(served.stderr)


def _command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_the_hosts_processes_are_named_and_its_lifecycle_is_logged_with_pids(serve: Any) -> None:
    """Issue 33: every process of a host had the same command line, and a reload or a drain printed nothing."""
    served = serve("--threads", "1")
    served.serving()
    assert _command_line(served.process.pid).startswith("prazo: supervisor ["), _command_line(served.process.pid)
    names = {pid: _command_line(pid) for pid in served.children()}
    roles = sorted(name.split(" [", 1)[0] for name in names.values())
    assert roles == ["prazo: triage", "prazo: worker 0", "prazo: worker 1"], names
    workers = {pid for pid, name in names.items() if name.startswith("prazo: worker")}
    wait_until(lambda: any("serving:" in line for line in served.stderr), "the serving line", WAIT_S)
    serving = next(line for line in served.stderr if "serving:" in line)
    assert all(f"pid {pid}" in serving for pid in workers), serving

    served.process.send_signal(signal.SIGHUP)
    replaced = lambda: [line for line in served.stderr if "reloaded; worker" in line]  # noqa: E731
    wait_until(lambda: len(replaced()) == 2, "both workers reloaded", WAIT_S)
    for pid in workers:  # each old worker is named with the one that took its place
        assert sum(f"(pid {pid}) reloaded" in line for line in replaced()) == 1, replaced()
    assert any("reload (SIGHUP): 2 workers" in line for line in served.stderr), served.stderr

    served.process.send_signal(signal.SIGTERM)
    assert served.wait() == 0
    assert any(f"draining (supervisor pid {served.process.pid})" in line for line in served.stderr), served.stderr
    assert any("drained: everything admitted finished" in line for line in served.stderr), served.stderr
    assert not any("Traceback" in line for line in served.stderr), served.stderr


def test_without_setproctitle_a_process_is_named_for_top_by_prctl() -> None:
    script = (
        "import sys; sys.modules['setproctitle'] = None\n"  # as where the servers extra is not installed
        "from prazo.bindings.servers.plumbing.process_names import name_process\n"
        "name_process('worker 1')\n"
        "print(open('/proc/self/comm').read().strip())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "prazo: worker 1"


def test_a_successor_killed_before_it_serves_leaves_the_host_serving(serve: Any, tmp_path: Path) -> None:
    """The soak found it: a reload's new worker SIGKILLed while it imported the app stopped the whole host.

    A worker that never served stopped the host, so that an app that cannot import
    is not started again forever; a kill by a signal is no fault of the app. The old
    worker serves on, and the host with it.
    """
    (tmp_path / "slow_import_app.py").write_text(
        "import time\n\ntime.sleep(3)  # an app that takes its time to import\nfrom _host_app import app  # noqa: E402\n"
    )
    served = serve("--threads", "1", app_spec="slow_import_app:app", path=(tmp_path,))
    served.serving()
    first = served.children()
    served.process.send_signal(signal.SIGHUP)
    wait_until(lambda: len(served.children() - first) == 1, "the first successor forked", WAIT_S)
    (successor,) = served.children() - first
    os.kill(successor, signal.SIGKILL)  # importing the app still: it has not served
    wait_until(lambda: any("before it served" in line for line in served.stderr), "the kill logged", WAIT_S)
    for _ in range(5):
        try:
            outcome = request(served.port, "/pid")
        except OSError as exc:
            raise AssertionError(f"{exc!r}; prazo serve said:\n{''.join(served.stderr)}") from exc
        assert outcome.status == 200, (outcome, "".join(served.stderr))
    assert served.process.poll() is None, "".join(served.stderr)
    served.process.send_signal(signal.SIGTERM)
    assert served.wait() == 0, "".join(served.stderr)
    assert served.left_behind() == []
