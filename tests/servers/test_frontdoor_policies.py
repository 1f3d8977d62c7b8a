"""The queue policies of docs/design.md in the front door's C engine, on real loopback sockets.

Each policy is checked by what a client sees (status, ``X-Prazo-Reason``,
the order the app runs requests in) and by the engine's counters; after
every test the counters balance (the conservation identity of docs/design.md)
and no worker place or connection is left behind. Time margins are wide:
the assertions say "before the held worker was released", never "within
so many ms".
"""

from __future__ import annotations

import dataclasses
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import examples, wait_until
from _server_harness import CLIENT_TIMEOUT_S, TEST_DEFAULT_BUDGET_MS, Burst, FrontDoors, Outcome, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prazo.bindings.servers.frontdoor import FrontDoorServer, create_server
from prazo.bindings.servers.settings import ServerSettings

# slow: real time; compiled: its subject is C code, so `make sanitize` runs it.
pytestmark = [pytest.mark.slow, pytest.mark.compiled]


class Recorder:
    """A WSGI app that records the paths it runs, in order; paths under /hold/ wait for ``release``."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.paths: list[str] = []
        self.release = threading.Event()
        self.sleep_s = sleep_s
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = environ["PATH_INFO"]
        with self._lock:
            self.paths.append(path)
        if path.startswith("/hold"):
            self.release.wait(CLIENT_TIMEOUT_S)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [path.encode()]


def balance(stats: dict[str, int]) -> int:
    """The conservation identity (docs/design.md): offered minus every outcome (0 when it holds)."""
    return stats["offered"] - (
        stats["started"]
        + stats["rejected_full"]
        + stats["expired"]
        + stats["insufficient_budget"]
        + stats["shed"]
        + stats["evicted"]
        + stats["cancelled"]
        + stats["queued"]
        + stats["assigned"]
    )


def idle(stats: dict[str, int]) -> bool:
    return stats["in_flight"] + stats["queued"] + stats["assigned"] == 0


def settled(server: FrontDoorServer) -> dict[str, int]:
    """Wait until nothing runs or waits and every connection is closed; check the counters balance."""
    wait_until(lambda: idle(server.stats()), "every place free")
    wait_until(lambda: server.stats()["open_connections"] == 0, "every connection closed")
    stats = server.stats()
    assert balance(stats) == 0, stats
    assert stats["expired"] == stats["expired_on_arrival"] + stats["expired_in_queue"], stats
    assert stats["started"] == stats["completed"], stats
    assert stats["peak_in_flight"] <= stats["max_concurrency"], stats
    return stats


@pytest.fixture
def start() -> Iterator[FrontDoors]:
    with FrontDoors(threads=1, max_queue=4) as start_server:
        yield start_server


def in_background(
    port: int, path: str, headers: dict[str, str] | None = None
) -> tuple[threading.Thread, list[Outcome]]:
    """``request`` on its own thread; the outcome lands in the returned list."""
    result: list[Outcome] = []
    thread = threading.Thread(target=lambda: result.append(request(port, path, headers)), daemon=True)
    thread.start()
    return thread, result


def hold_worker(server: FrontDoorServer, app: Recorder, path: str = "/hold") -> tuple[threading.Thread, list[Outcome]]:
    """Occupy one worker with a request that waits for ``app.release``."""
    busy = server.stats()["in_flight"]
    held = in_background(server.port, path)
    wait_until(lambda: server.stats()["in_flight"] == busy + 1, "the held request to run")
    return held


def enqueue(
    server: FrontDoorServer, path: str, headers: dict[str, str] | None = None
) -> tuple[threading.Thread, list[Outcome]]:
    """Send a request that must wait in line; return once the engine has admitted it."""
    admitted = server.stats()["admitted"]
    waiting = in_background(server.port, path, headers)
    wait_until(lambda: server.stats()["admitted"] == admitted + 1, f"{path} to be admitted")
    return waiting


def outcome_of(background: tuple[threading.Thread, list[Outcome]]) -> Outcome:
    thread, result = background
    thread.join(CLIENT_TIMEOUT_S)
    assert result, "the request got no answer"
    return result[0]


# -- doomed-work skip ---------------------------------------------------------------


def test_insufficient_budget_on_arrival_never_runs_the_app_and_keeps_the_connection(start: Any) -> None:
    app = Recorder()
    server = start(app, expected_service_ms=300)
    assert server.stats()["expected_service_ns"] == 300_000_000
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    conn.request("GET", "/short", headers={"X-Request-Budget-Ms": "200"})
    response = conn.getresponse()
    assert (response.status, response.getheader("X-Prazo-Reason")) == (504, "insufficient-budget")
    assert response.getheader("Connection") == "keep-alive"
    response.read()
    # The same connection carries the next request: the refusal kept it alive.
    conn.request("GET", "/long", headers={"X-Request-Budget-Ms": "5000"})
    response = conn.getresponse()
    assert (response.status, response.read()) == (200, b"/long")
    conn.close()
    assert app.paths == ["/long"]
    stats = settled(server)
    assert (stats["insufficient_budget"], stats["started"], stats["expired"]) == (1, 1, 0)


def test_a_waiter_is_answered_insufficient_budget_while_the_worker_is_still_busy(start: Any) -> None:
    app = Recorder()
    server = start(app, expected_service_ms=300)
    held = hold_worker(server, app)
    # 600 ms of budget, 300 ms expected: doomed once it has waited 300 ms, long before its deadline.
    waiting = enqueue(server, "/waiting", {"X-Request-Budget-Ms": "600"})
    outcome = outcome_of(waiting)
    assert (outcome.status, outcome.reason) == (504, "insufficient-budget")
    assert not app.release.is_set()  # answered by the engine's sweep, not at a pickup
    app.release.set()
    assert outcome_of(held).status == 200
    assert app.paths == ["/hold"]
    stats = settled(server)
    assert (stats["insufficient_budget"], stats["expired_in_queue"]) == (1, 0)


def test_a_learned_estimate_appears_after_32_samples_and_skips_doomed_work(start: Any) -> None:
    app = Recorder(sleep_s=0.1)
    server = start(app, threads=4, max_queue=40, expected_service_ms="p50", default_budget_ms=20000)
    assert server.stats()["expected_service_ns"] == 0  # nothing learned: nothing skipped
    burst = Burst(server.port, [f"/learn/{i}" for i in range(32)])
    assert {outcome.status for outcome in burst.join()} == {200}
    wait_until(lambda: server.stats()["completed"] == 32, "the 32 samples")
    expected_ns = server.stats()["expected_service_ns"]
    # Every service time is at least the app's 100 ms sleep; the estimate lies within the samples.
    assert expected_ns >= 100_000_000
    outcome = request(server.port, "/doomed", {"X-Request-Budget-Ms": "60"})
    assert (outcome.status, outcome.reason) == (504, "insufficient-budget")
    assert "/doomed" not in app.paths
    settled(server)


# -- order: lifo and adaptive -----------------------------------------------------------


def test_lifo_serves_the_newest_waiter_first(start: Any) -> None:
    app = Recorder()
    server = start(app, order="lifo")
    held = hold_worker(server, app)
    waiters = [enqueue(server, path) for path in ("/b", "/c", "/d")]
    app.release.set()
    assert outcome_of(held).status == 200
    assert [outcome_of(waiter).status for waiter in waiters] == [200, 200, 200]
    assert app.paths == ["/hold", "/d", "/c", "/b"]
    settled(server)


def test_adaptive_sheds_stale_waiters_503_while_the_worker_is_busy(start: Any) -> None:
    app = Recorder()
    server = start(app, order="adaptive", codel_target_ms=5, codel_interval_ms=100, default_budget_ms=20000)
    held = hold_worker(server, app)
    waiters = [enqueue(server, path) for path in ("/b", "/c")]
    outcomes = [outcome_of(waiter) for waiter in waiters]
    assert [(o.status, o.reason) for o in outcomes] == [(503, "shed-standing-queue")] * 2
    assert not app.release.is_set()
    app.release.set()
    assert outcome_of(held).status == 200
    assert app.paths == ["/hold"]
    stats = settled(server)
    assert (stats["shed"], stats["expired"], stats["started"]) == (2, 0, 1)


def test_adaptive_is_lifo_once_the_line_stands(start: Any) -> None:
    app = Recorder()
    # Standing after 100 ms; nobody waits long enough (10 s) to be shed.
    server = start(app, order="adaptive", codel_target_ms=10000, codel_interval_ms=100, default_budget_ms=20000)
    held = hold_worker(server, app)
    waiters = [enqueue(server, path) for path in ("/b", "/c", "/d")]
    time.sleep(0.3)  # > interval: the line stands now
    app.release.set()
    assert outcome_of(held).status == 200
    assert [outcome_of(waiter).status for waiter in waiters] == [200, 200, 200]
    assert app.paths[:2] == ["/hold", "/d"]
    assert sorted(app.paths) == ["/b", "/c", "/d", "/hold"]
    assert settled(server)["shed"] == 0


def test_adaptive_stays_fifo_while_the_line_empties(start: Any) -> None:
    app = Recorder()
    server = start(app, order="adaptive", codel_interval_ms=10000, default_budget_ms=20000)
    held = hold_worker(server, app)
    waiters = [enqueue(server, path) for path in ("/b", "/c", "/d")]
    app.release.set()
    assert outcome_of(held).status == 200
    assert [outcome_of(waiter).status for waiter in waiters] == [200, 200, 200]
    assert app.paths == ["/hold", "/b", "/c", "/d"]
    settled(server)


# -- the critical class and reserved places ---------------------------------------------------


def test_a_critical_path_evicts_the_newest_normal_waiter_and_is_served_first(start: Any) -> None:
    app = Recorder()
    server = start(app, max_queue=2, critical_paths=["/healthz"])
    held = hold_worker(server, app)
    first, newest = enqueue(server, "/first"), enqueue(server, "/newest")
    refused = request(server.port, "/normal")  # a normal arrival into the full line is refused
    assert (refused.status, refused.reason) == (503, "queue-full")
    health = enqueue(server, "/healthz?probe=1")
    evicted = outcome_of(newest)
    assert (evicted.status, evicted.reason) == (503, "evicted-by-critical")
    app.release.set()
    assert [outcome_of(b).status for b in (held, health, first)] == [200, 200, 200]
    assert app.paths == ["/hold", "/healthz", "/first"]
    stats = settled(server)
    assert (stats["evicted"], stats["rejected_full"], stats["critical_started"]) == (1, 1, 1)


def test_a_critical_path_matches_as_path_info_says_it(start: Any) -> None:
    app = Recorder()
    server = start(app, critical_paths=["/healthz"])
    targets = ("/healthz", "/healthz?full=1", "http://example.test/healthz?x", "https://h:1/healthz", "/health%7a")
    for target in targets:
        raw = f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as sock:
            sock.sendall(raw)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    for path in ("/healthz/", "/healthzz", "/other", "/healthz%", "/health%7"):
        assert request(server.port, path).status == 200
    assert settled(server)["critical_started"] == len(targets)


def test_a_critical_arrival_with_no_normal_waiter_to_evict_is_refused(start: Any) -> None:
    app = Recorder()
    server = start(app, max_queue=0, critical_paths=["/healthz"])
    held = hold_worker(server, app)
    refused = request(server.port, "/healthz")
    assert (refused.status, refused.reason) == (503, "queue-full")
    app.release.set()
    assert outcome_of(held).status == 200
    assert settled(server)["evicted"] == 0


def test_the_critical_header_says_critical_case_insensitively(start: Any) -> None:
    app = Recorder()
    server = start(app, critical_header="X-Priority")
    assert request(server.port, "/a", {"X-Priority": " Critical "}).status == 200
    assert request(server.port, "/b", {"X-Priority": "high"}).status == 200
    assert request(server.port, "/c").status == 200
    assert settled(server)["critical_started"] == 1


def test_reserved_places_wait_for_critical_work_and_are_borrowed_while_it_is_idle(start: Any) -> None:
    app = Recorder()
    server = start(app, threads=3, reserved=1, critical_paths=["/hold/critical"])
    # No critical work: normal requests borrow the reserved place, all three run.
    normal = [hold_worker(server, app, "/hold/normal") for _ in range(3)]
    app.release.set()
    assert [outcome_of(b).status for b in normal] == [200] * 3
    settled(server)
    # Critical work in flight: normal requests start only below limit - reserved (2 places in all).
    app.release.clear()
    critical = hold_worker(server, app, "/hold/critical")
    first = hold_worker(server, app, "/hold/first")  # the one unreserved place left
    parked = enqueue(server, "/parked")
    time.sleep(0.2)  # a worker is free, yet the reserved place is not lent while critical work runs
    stats = server.stats()
    assert (stats["in_flight"], stats["queued"] + stats["assigned"]) == (2, 1), stats
    assert "/parked" not in app.paths
    app.release.set()
    assert [outcome_of(b).status for b in (critical, first, parked)] == [200] * 3
    assert settled(server)["critical_started"] == 1


# -- the Vegas limit --------------------------------------------------------------------


def test_vegas_workers_above_the_limit_stay_parked(start: Any) -> None:
    app = Recorder()
    server = start(app, threads=8, max_queue=16, limit="vegas", min_concurrency=1)
    limit = server.stats()["limit"]
    assert 1 <= limit <= 8
    held = [in_background(server.port, f"/hold/{i}") for i in range(8)]
    wait_until(lambda: server.stats()["admitted"] == 8, "the eight requests to be admitted")
    wait_until(lambda: server.stats()["in_flight"] == min(8, limit), "the limit's worth to run")
    time.sleep(0.2)  # parked workers stay parked: no sample came, the limit did not move
    stats = server.stats()
    assert (stats["in_flight"], stats["limit"], stats["queued"]) == (min(8, limit), limit, 8 - min(8, limit)), stats
    app.release.set()
    assert [outcome_of(b).status for b in held] == [200] * 8
    settled(server)


def test_vegas_limit_stays_between_min_concurrency_and_threads_under_load(start: Any) -> None:
    app = Recorder(sleep_s=0.005)
    server = start(app, threads=6, max_queue=30, limit="vegas", min_concurrency=2, default_budget_ms=20000)
    limits = []
    for wave in range(4):
        burst = Burst(server.port, [f"/w{wave}/{i}" for i in range(30)])
        limits.append(server.stats()["limit"])
        outcomes = burst.join()
        assert {o.status for o in outcomes} <= {200, 503}
        limits.append(server.stats()["limit"])
    assert all(2 <= limit <= 6 for limit in limits), limits
    stats = settled(server)
    assert 2 <= stats["limit"] <= 6
    assert stats["peak_in_flight"] <= 6
    assert stats["completed"] >= 30


def test_a_fixed_limit_is_the_thread_count(start: Any) -> None:
    server = start(Recorder(), threads=3)
    stats = server.stats()
    assert (stats["limit"], stats["expected_service_ns"], stats["reserved"]) == (3, 0, 0)


# -- the options --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicySettings(ServerSettings):
    """ServerSettings carrying queue-policy fields, as ``prazo serve`` builds them from its flags."""

    order: str = "lifo"
    critical_paths: tuple[str, ...] = ("/critical",)


def test_the_policy_fields_of_the_settings_configure_the_front_door(start: Any) -> None:
    app = Recorder()
    policy_settings = PolicySettings(threads=1, max_queue=4, default_budget_ms=TEST_DEFAULT_BUDGET_MS)
    server = start(app, settings=policy_settings, threads=None, max_queue=None)
    assert (server.policies["order"], server.policies["critical_paths"]) == ("lifo", ("/critical",))
    held = hold_worker(server, app)
    waiters = [enqueue(server, path) for path in ("/b", "/c", "/critical")]
    app.release.set()
    assert [outcome_of(b).status for b in (held, *waiters)] == [200] * 4
    assert app.paths == ["/hold", "/critical", "/c", "/b"]
    assert settled(server)["critical_started"] == 1


def test_create_server_arguments_win_over_the_settings() -> None:
    server = create_server(Recorder(), port=0, settings=PolicySettings(threads=2, max_queue=1), order="fifo")
    try:
        assert (server.policies["order"], server.policies["critical_paths"]) == ("fifo", ("/critical",))
    finally:
        server.shutdown(1.0)


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        ({"order": "random"}, ValueError, "order"),
        ({"order": 1}, TypeError, "order"),
        ({"limit": "aimd"}, ValueError, "limit"),
        ({"min_concurrency": 0}, ValueError, "min_concurrency"),
        ({"min_concurrency": 5, "threads": 4}, ValueError, "min_concurrency"),
        ({"reserved": 4, "threads": 4}, ValueError, "reserved"),
        ({"reserved": -1}, ValueError, "reserved"),
        ({"reserved": 1.5}, TypeError, "reserved"),
        ({"expected_service_ms": "p42"}, ValueError, "expected_service_ms"),
        ({"expected_service_ms": 0}, ValueError, "expected_service_ms"),
        ({"expected_service_ms": float("nan")}, ValueError, "expected_service_ms"),
        ({"codel_target_ms": 7}, ValueError, "codel_target_ms"),
        ({"order": "adaptive", "codel_interval_ms": -1}, ValueError, "codel_interval_ms"),
        ({"critical_paths": "/healthz"}, TypeError, "critical_paths"),
        ({"critical_paths": ["healthz"]}, ValueError, "critical_paths"),
        ({"critical_header": "X Bad"}, ValueError, "critical_header"),
    ],
)
def test_wrong_options_raise_naming_the_option(options: dict[str, Any], error: type[Exception], name: str) -> None:
    options.setdefault("threads", 4)
    with pytest.raises(error, match=name):
        create_server(Recorder(), port=0, **options)


# -- every policy at once -----------------------------------------------------------------

KNOWN_ANSWERS = {
    (200, None),
    (503, "queue-full"),
    (503, "shed-standing-queue"),
    (503, "evicted-by-critical"),
    (504, "insufficient-budget"),
    (504, "expired-on-arrival"),
    (504, "expired-in-queue"),
}


def test_every_policy_at_once_under_overload_answers_everyone_and_balances(start: Any) -> None:
    """A seeded mix of critical and normal requests with short and long budgets, overloading
    an engine with every policy on: each client gets one known answer, nothing leaks."""
    import random

    rng = random.Random(11)
    app = Recorder(sleep_s=0.01)
    server = start(
        app, threads=4, max_queue=6, order="adaptive", codel_target_ms=20, codel_interval_ms=50,
        expected_service_ms="p90", limit="vegas", min_concurrency=1, reserved=1,
        critical_paths=["/critical"], critical_header="X-Priority", default_budget_ms=20000,
    )  # fmt: skip
    # Every snapshot balances, even mid-overload: the engine counts each outcome under the lock stats() holds.
    unbalanced: list[dict[str, int]] = []
    polling = threading.Event()

    def poll() -> None:
        while not polling.is_set():
            stats = server.stats()
            if balance(stats) != 0:
                unbalanced.append(stats)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    for wave in range(5):
        clients = []
        for i in range(24):
            path = "/critical" if rng.random() < 0.2 else f"/w{wave}/{i}"
            headers = {"X-Request-Budget-Ms": str(rng.choice([15, 60, 250, 5000]))}
            if rng.random() < 0.1:
                headers["X-Priority"] = "critical"
            clients.append(in_background(server.port, path, headers))
        answers = [outcome_of(client) for client in clients]
        assert {(o.status, o.reason) for o in answers} <= KNOWN_ANSWERS
    polling.set()
    poller.join(CLIENT_TIMEOUT_S)
    assert not unbalanced, unbalanced[:3]
    stats = settled(server)
    assert stats["offered"] == 5 * 24
    assert 1 <= stats["limit"] <= 4
    # A started request whose budget ran out while its worker waited for the GIL gets 504 without the app.
    assert stats["started"] == len(app.paths) + stats["expired_at_start"]


policy_options = st.fixed_dictionaries(
    {
        "threads": st.integers(1, 4),
        "max_queue": st.integers(0, 6),
        "order": st.sampled_from(["fifo", "lifo", "adaptive"]),
        "expected_service_ms": st.sampled_from([None, 20, "p50"]),
        "limit": st.sampled_from(["fixed", "vegas"]),
        "reserved": st.integers(0, 3),
    }
)
request_plans = st.lists(
    st.tuples(st.booleans(), st.sampled_from([5, 40, 200, 5000]), st.sampled_from([0.0, 0.005, 0.03])),
    min_size=1,
    max_size=16,
)


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(options=policy_options, plan=request_plans)
def test_any_policy_mix_answers_every_request_once_and_balances(
    options: dict[str, Any], plan: list[tuple[bool, int, float]]
) -> None:
    """Whatever the policies and the requests (critical or not, budget, service time) sent at once:
    one known answer each, the counters balance, the limit stays in bounds, nothing leaks."""
    options["reserved"] = min(options["reserved"], options["threads"] - 1)

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        time.sleep(float(environ["QUERY_STRING"] or 0))
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    server = create_server(app, port=0, critical_paths=["/critical"], default_budget_ms=20000, **options)
    server.start()
    try:
        clients = [
            in_background(
                server.port, f"/{'critical' if critical else 'normal'}?{sleep_s}", {"X-Request-Budget-Ms": str(budget)}
            )
            for critical, budget, sleep_s in plan
        ]
        answers = [outcome_of(client) for client in clients]
        assert {(o.status, o.reason) for o in answers} <= KNOWN_ANSWERS
        stats = settled(server)
        assert stats["offered"] == len(plan)
        assert (1 if options["limit"] == "vegas" else options["threads"]) <= stats["limit"] <= options["threads"]
        assert stats["critical_started"] <= sum(critical for critical, _, _ in plan)
    finally:
        server.shutdown(5.0)
