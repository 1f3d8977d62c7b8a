"""Health checks while a dependency is slow (the recipe of docs/how-to/slow-dependency.md, on a real server).

The seed's failure: a dependency that hangs holds every server thread, and
the health check, which never calls it, cannot get one. The recipe: the
health endpoint calls no dependency, and every dependency call goes through
a ``Dependency`` (bounded threads of its own, a tight timeout, a bulkhead
that refuses at once when full), so a request holds a server thread for at
most the timeout, never for the hang.

prazo's waitress embedding with 4 threads on 127.0.0.1; the dependency is a
real HTTP server on loopback whose every call hangs for 5 s; clients use
``http.client``. The only time bounds are generous ones: the probe must be
answered within 1 s while the calls hang for 5 s. A control runs the same
app with the calls made on the server's own threads: there the probe gets no
answer within that second, which shows the test can see the failure.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from _loopback import LoopbackServer
from prazo.bindings.dependency import Dependency
from prazo.bindings.servers.waitress import create_server, shutdown

pytestmark = pytest.mark.slow

THREADS = 4
HANG_S = 5
PROBE_TIMEOUT_S = 1.0


def _app(call: Callable[[Callable[[str], bytes], str], bytes], remote_port: int) -> Callable[..., Iterable[bytes]]:
    def fetch(key: str) -> bytes:
        # Plain client code with a long timeout: it waits for the whole hang.
        conn = http.client.HTTPConnection("127.0.0.1", remote_port, timeout=30)
        try:
            conn.request("GET", f"/recommendations?id={key}&sleep={HANG_S}")
            return conn.getresponse().read()
        finally:
            conn.close()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/health":
            start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
            return [b"ok"]
        body = call(fetch, environ.get("QUERY_STRING", ""))
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


@contextmanager
def _serving(app: Callable[..., Iterable[bytes]]) -> Iterator[int]:
    server = create_server(app, host="127.0.0.1", port=0, threads=THREADS, max_queue=32, default_budget_ms=10_000)
    runner = threading.Thread(target=server.run, daemon=True)
    runner.start()
    try:
        yield server.effective_port
    finally:
        shutdown(server, timeout=10)
        runner.join(10)


def _get(port: int, path: str, timeout: float) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status, time.monotonic() - started
    finally:
        conn.close()


def _flood(port: int, count: int) -> tuple[list[threading.Thread], list[tuple[int, float]]]:
    """``count`` recommendation requests at once, each in its own client thread."""
    answers: list[tuple[int, float]] = []

    def one(index: int) -> None:
        try:
            answers.append(_get(port, f"/recommendations?id={index}", timeout=HANG_S * 3))
        except OSError:
            answers.append((0, float("inf")))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, answers


def _wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_health_answers_while_the_bulkhead_is_full_and_every_call_hangs() -> None:
    dependency = Dependency("recommendations", max_concurrent=THREADS, timeout_ms=100)
    with LoopbackServer() as remote:
        app = _app(lambda fetch, key: dependency.call(fetch, key, key=key, idempotent=True), remote.port)
        with _serving(app) as port:
            threads, answers = _flood(port, 3 * THREADS)
            # Every place of the bulkhead holds a call that hangs for 5 s.
            assert _wait_for(lambda: dependency.stats()["in_flight"] == THREADS, timeout=HANG_S / 2)
            for _ in range(5):
                status, elapsed = _get(port, "/health", timeout=PROBE_TIMEOUT_S)
                assert status == 200
                assert elapsed < PROBE_TIMEOUT_S
                assert dependency.stats()["in_flight"] == THREADS, "the probe must run while the bulkhead is full"
            for thread in threads:
                thread.join(HANG_S * 3)
            # No stale value to fall back on: each caller got a fast, honest 503.
            assert len(answers) == 3 * THREADS
            assert {status for status, _ in answers} == {503}
            assert max(elapsed for _, elapsed in answers) < HANG_S / 2
            remote.stop()  # cuts the hanging calls short, so the bulkhead's threads end


def test_control_without_the_bulkhead_the_probe_finds_no_thread() -> None:
    with LoopbackServer() as remote:
        app = _app(lambda fetch, key: fetch(key), remote.port)
        with _serving(app) as port:
            threads, _ = _flood(port, THREADS)
            assert _wait_for(lambda: remote.count >= THREADS, timeout=HANG_S / 2)
            # Every server thread waits for the hung dependency: the probe waits in the queue.
            with pytest.raises(TimeoutError):
                _get(port, "/health", timeout=PROBE_TIMEOUT_S)
            remote.stop()
            for thread in threads:
                thread.join(HANG_S * 3)
