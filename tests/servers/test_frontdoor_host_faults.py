"""The front-door host (``--workers N``) when a worker process fails under the engine (issue 33).

Real processes on loopback, real clients, as ``test_frontdoor_host.py``: a
worker whose app forked a child and is then SIGKILLed, and a worker that has
no free descriptor for a moment. Each test asserts that every client gets an
answer or a closed connection (a hang would show as the client's timeout, far
above anything a healthy run takes), that the places come back and that the
host serves on with as many threads as before.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
from _helpers import assert_conservation, wait_until
from _host_app import app as host_app
from _server_harness import TEST_DEFAULT_BUDGET_MS, Burst, read_to_eof, request, statuses
from prazo.bindings.servers.frontdoor import FrontDoorHost, create_server, supervisor
from prazo.bindings.servers.frontdoor.triage import DUMP_STACKS_SIGNAL
from prazo.bindings.servers.settings import resolve_settings
from test_frontdoor_host import idle  # the host's at-rest wait, one definition

# slow: real time; compiled: its subject is the engine's C (triage and channels), so `make sanitize` runs it.
pytestmark = [pytest.mark.slow, pytest.mark.compiled]

WAIT_S = 30.0
# A client waits this long before it calls its request hung; a closed connection must come well before.
HANG_S = 20.0
ENDED_WITHIN_S = HANG_S / 2
# How long a child the app forks lives on its own: past the end of the test, which kills it.
CHILD_LIFE_S = 120.0


def _query(environ: dict[str, Any]) -> dict[str, str]:
    return {key: values[0] for key, values in parse_qs(environ.get("QUERY_STRING", "")).items()}


def _wait_for_path(path: str) -> None:
    """Poll for ``path`` (os.path.exists takes no descriptor: it works while a worker has none free)."""
    end = time.monotonic() + WAIT_S
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.002)


def _hold_no_free_descriptor(exhaust: str, exhausted: str, free: str, freed: str) -> None:
    """Once ``exhaust`` exists: leave this process no free descriptor until ``free`` exists.

    The soft RLIMIT_NOFILE comes down to just above the descriptors open now
    and the gap is filled, so a descriptor passed to this process is dropped
    (MSG_CTRUNC). Directories mark the states: mkdir takes no descriptor.
    """
    _wait_for_path(exhaust)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        os.mkdir(exhausted)
        _wait_for_path(free)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    os.mkdir(freed)


def fault_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    """``_host_app``'s app, plus ``/fork`` and ``/arm-exhaust``.

    ``/fork`` forks a child that sleeps, holding every descriptor the worker
    had (its channels, the sockets of the clients it serves), as a
    ``multiprocessing`` job with the fork start method does; it writes the
    child's pid to ``mark`` when given, then waits for ``gate`` when given,
    and answers the child's pid.
    ``/arm-exhaust`` starts ``_hold_no_free_descriptor`` in a thread of this worker.
    """
    path = environ.get("PATH_INFO", "")
    if path == "/fork":
        q = _query(environ)
        child = os.fork()
        if child == 0:
            time.sleep(CHILD_LIFE_S)
            os._exit(0)
        if "mark" in q:
            Path(q["mark"]).write_text(str(child))
        if "gate" in q:
            _wait_for_path(q["gate"])
        body = str(child).encode()
    elif path == "/arm-exhaust":
        q = _query(environ)
        args = (q["exhaust"], q["exhausted"], q["free"], q["freed"])
        threading.Thread(target=_hold_no_free_descriptor, args=args, daemon=True).start()
        body = str(os.getpid()).encode()
    else:
        return host_app(environ, start_response)
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


@pytest.fixture
def hosts() -> Iterator[Callable[..., FrontDoorHost]]:
    """``hosts(threads)``: a started host of one worker serving ``fault_app``; all shut down after.

    One worker process (which ``create_server(workers=1)`` would make a
    one-process front door): every request, and every copy a forked child
    holds, is on the worker the test breaks.
    """
    started: list[FrontDoorHost] = []

    def start(threads: int) -> FrontDoorHost:
        settings = resolve_settings(
            threads=threads, max_queue=20, default_budget_ms=TEST_DEFAULT_BUDGET_MS, host_workers=1
        )
        host = FrontDoorHost(fault_app, host="127.0.0.1", port=0, settings=settings, workers=1, shutdown_timeout=10.0)
        host.start()
        started.append(host)
        return host

    yield start
    for host in started:
        host.shutdown(5.0)


def raw_get(port: int, target: str) -> socket.socket:
    """A connection that has sent one request for ``target`` (its response is the caller's to read)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
    return sock


def to_the_end(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sent until it ended the connection, and how long that took. A hang fails here."""
    start = time.monotonic()
    with sock:
        try:
            received = read_to_eof(sock)
        except TimeoutError:
            raise AssertionError(f"the client hung: no end of its connection within {HANG_S} s") from None
    return received, time.monotonic() - start


def test_a_dead_worker_whose_app_forked_ends_its_clients_and_gives_back_its_places(hosts: Any, tmp_path: Path) -> None:
    host = hosts(threads=2)
    children: list[int] = []
    try:
        forked = request(host.port, "/fork")
        assert forked.status == 200, forked
        children.append(int(forked.body))
        (victim,) = host.worker_pids()
        # The request the worker runs when it dies forks too: that child holds its client's socket.
        gate, mark = tmp_path / "gate", tmp_path / "mark"
        running = raw_get(host.port, f"/fork?gate={gate}&mark={mark}")
        wait_until(lambda: mark.exists() and mark.read_text() != "", "the request running", WAIT_S)
        children.append(int(mark.read_text()))
        os.kill(victim, signal.SIGKILL)
        # Its client sees its connection end: the forked children's copies do not keep it open.
        received, took = to_the_end(running)
        assert received == b"" and took < ENDED_WITHIN_S, (received, took)
        wait_until(lambda: host.worker_pids() not in ([], [victim]), "a worker in place of the killed one", WAIT_S)
        (newcomer,) = host.worker_pids()
        # More at once than the newcomer's two threads: the dead worker's idle thread,
        # had it still counted as free, would be handed one of them.
        later = Burst(host.port, ["/pid?ms=20"] * 12)
        later.wait(12, HANG_S)
        later_errors = list(later.errors)
        assert later_errors == [], later_errors
        assert {int(outcome.body) for outcome in later.join()} == {newcomer}
        assert statuses(later.outcomes) == {200: 12}
        stats = idle(host)
        assert (stats["worker_lost"], stats["started"], stats["completed"]) == (1, 14, 14), stats
        assert (stats["worker_processes"], stats["worker_threads"]) == (1, 2), stats
        assert_conservation(stats)
        # The drain finds nothing held by the dead worker: it ends at once, not at its timeout.
        gate.touch()
        start = time.monotonic()
        assert host.shutdown(10.0) is True
        assert time.monotonic() - start < 5.0
    finally:
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_worker_with_no_free_descriptor_closes_the_hand_off_and_keeps_its_threads(hosts: Any, tmp_path: Path) -> None:
    host = hosts(threads=2)
    (worker,) = host.worker_pids()
    marks = {name: tmp_path / name for name in ("exhaust", "exhausted", "free", "freed")}
    query = "&".join(f"{name}={path}" for name, path in marks.items())
    # Read to the end of the connection: the triage ends it only once the worker has
    # closed its copy, so the worker holds no client socket when its descriptors run out.
    armed, _ = to_the_end(raw_get(host.port, f"/arm-exhaust?{query}"))
    assert armed.startswith(b"HTTP/1.1 200 ") and armed.endswith(str(worker).encode()), armed
    marks["exhaust"].touch()
    wait_until(marks["exhausted"].exists, "the worker out of descriptors", WAIT_S)
    # More than the worker's threads: each thread gets a connection it cannot receive, and more after it.
    clients = [raw_get(host.port, "/pid") for _ in range(4)]
    ends = [to_the_end(client) for client in clients]
    assert all(took < ENDED_WITHIN_S for _, took in ends), ends
    # Closed unanswered (the hand-off failed), or answered should a descriptor have come free.
    closed = sum(received == b"" for received, _ in ends)
    assert closed + sum(received.startswith(b"HTTP/1.1 200 ") for received, _ in ends) == 4, ends
    assert closed >= 1, ends  # the test did take the worker's descriptors away
    stats = idle(host)
    assert (stats["worker_processes"], stats["worker_threads"]) == (1, 2), stats  # no thread ended
    assert (stats["worker_lost"], stats["started"], stats["completed"]) == (closed, 5, 5), stats
    marks["free"].touch()
    wait_until(marks["freed"].exists, "the worker's descriptors free again", WAIT_S)
    # The same worker serves on with both its threads: two requests run there at once.
    gate = tmp_path / "gate"
    held = Burst(host.port, [f"/host-stats?gate={gate}&mark={tmp_path / f'running-{n}'}" for n in range(2)])
    wait_until(lambda: all((tmp_path / f"running-{n}").exists() for n in range(2)), "two requests running", WAIT_S)
    gate.touch()
    assert statuses(held.join()) == {200: 2}
    assert host.worker_pids() == [worker] and host.replaced == 0
    stats = idle(host)
    assert (stats["worker_processes"], stats["worker_threads"]) == (1, 2), stats
    assert (stats["worker_lost"], stats["started"], stats["completed"]) == (closed, 7, 7), stats
    assert_conservation(stats)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "host"])
def test_an_idle_connection_the_server_closes_ends_although_a_forked_child_holds_it(workers: int) -> None:
    """The class of defect 1: every connection the engine ends is shut down, not only closed.

    A kept-alive connection past its header timeout is closed by the engine (the
    one-process front door's I/O thread, or a host's triage); a process the app
    forked while serving it holds a copy of its socket, and close() alone ended
    nothing: the client's next request went to a socket no one read.
    """
    server = create_server(
        fault_app, port=0, workers=workers, threads=1, max_queue=4, header_timeout_ms=300,
        default_budget_ms=TEST_DEFAULT_BUDGET_MS,
    )  # fmt: skip
    server.start()
    child = 0
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S) as client:
            client.sendall(b"GET /fork HTTP/1.1\r\nHost: t\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += client.recv(65536)
            head, body = head.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
            while len(body) < length:
                body += client.recv(65536)
            child = int(body)
            assert b"keep-alive" in head.lower(), head  # the connection stays open for a next request ...
            started = time.monotonic()
            rest = read_to_eof(client)  # ... until the header timeout ends it
            took = time.monotonic() - started
        assert rest == b"" and took < ENDED_WITHIN_S, (rest, took)
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        server.shutdown(5.0)


@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_a_triage_that_stops_answering_or_dies_stops_the_host_instead_of_wedging_it(
    hosts: Callable[..., FrontDoorHost], monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A triage silent to its supervisor (SIGSTOP here: a deadlock would look the same) is killed
    after the control timeout, and the host stops as when the triage dies: no question to it
    waits for ever, so neither ``stats()`` nor a drain nor a worker's replacement can hang."""
    monkeypatch.setattr(supervisor, "CONTROL_TIMEOUT_S", 1.0)
    host = hosts(1)
    assert request(host.port, "/pid").status == 200
    triage = host.triage_pid
    os.kill(triage, signal.SIGSTOP if fault == "stopped" else signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="not running"):
        host.stats()
    assert time.monotonic() - started < HANG_S
    assert host._stopped.wait(HANG_S), "the supervisor did not stop"
    assert host.triage_pid == 0  # reaped: it is not left stopped, holding the port
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", host.port), timeout=1.0)


def test_the_triage_writes_its_threads_stacks_on_the_signal_and_serves_on(
    hosts: Callable[..., FrontDoorHost], tmp_path: Path
) -> None:
    """What the supervisor sends a wedged triage before it kills it: the dump is written, nothing ends.

    The host's processes are started with their stderr on a file of the test's own (the
    capture's file is emptied on every read, which could drop the dump meanwhile)."""
    log = tmp_path / "stderr"
    saved = os.dup(2)
    try:
        with log.open("w") as stderr:
            os.dup2(stderr.fileno(), 2)
        host = hosts(1)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    os.kill(host.triage_pid, DUMP_STACKS_SIGNAL)
    wait_until(lambda: "triage_main" in log.read_text(errors="replace"), "the triage's stacks on stderr", HANG_S)
    assert request(host.port, "/pid").status == 200
