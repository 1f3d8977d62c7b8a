"""Every server's overload 503s carry the line's measured wait, on loopback with real HTTP.

One worker, two places in line, an app that takes 100 ms, and more clients
than places: once the line has measured its drain (a window of 250 ms), a
``queue-full`` refusal says ``Retry-After`` in whole seconds (at least 1)
and ``X-Prazo-Retry-After-Ms`` the same wait in ms, which is the line ahead
at about 100 ms a place. The bounds are wide: a loaded machine drains more
slowly, and the wait says so.
"""

from __future__ import annotations

import http.client
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _server_harness import CLIENT_TIMEOUT_S, SERVER_KINDS, FrontDoors, RunningServer, start_server
from prazo.bindings.headers import RETRY_AFTER_MS_HEADER_NAME

SERVICE_MS = 100
LOAD_S = 1.2
CLIENTS = 5


@pytest.fixture
def frontdoors() -> Iterator[FrontDoors]:
    with FrontDoors() as start:
        yield start


def refusals_under_load(port: int, load_s: float = LOAD_S) -> list[tuple[str | None, str | None]]:
    """(Retry-After, X-Prazo-Retry-After-Ms) of every queue-full 503 while CLIENTS keep the line full."""
    seen: list[tuple[str | None, str | None]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + load_s

    def client() -> None:
        while time.monotonic() < stop_at:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
            try:
                conn.request("GET", f"/work?ms={SERVICE_MS}")
                response = conn.getresponse()
                response.read()
            finally:
                conn.close()
            if response.status == 503 and response.getheader("X-Prazo-Reason") == "queue-full":
                with lock:
                    seen.append((response.getheader("Retry-After"), response.getheader(RETRY_AFTER_MS_HEADER_NAME)))
                time.sleep(0.02)  # a refused client pauses: the test is the header, not a spin

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(load_s + 2 * CLIENT_TIMEOUT_S)
    return seen


def assert_measured_waits(seen: list[tuple[str | None, str | None]]) -> None:
    measured = [(seconds, int(ms)) for seconds, ms in seen if ms is not None]
    assert measured, f"no refusal carried a measured wait: {seen[:5]}"
    for seconds, ms in measured:
        assert seconds == str(max(1, -(-ms // 1000))), (seconds, ms)
    for seconds, ms in seen:
        if ms is None:
            assert seconds == "1", "before the first measurement the wait is the fixed second"
    # One place ahead at least (about 100 ms), three at most, with room for a loaded machine.
    assert SERVICE_MS / 2 <= statistics.median(ms for _, ms in measured) <= 20 * SERVICE_MS, measured


# The embeddings answer a full line from two places: waitress's own, and ConnectionAdmission's for
# the socket-level ones (cheroot, werkzeug, wsgiref, gunicorn alike): one of each, and gunicorn
# (its settings come through the environment) for the fixed value.
MEASURED_KINDS = ("waitress", "werkzeug")
FIXED_KINDS = ("frontdoor", "waitress", "werkzeug", "gunicorn")
assert set(MEASURED_KINDS + FIXED_KINDS) - {"frontdoor"} <= set(SERVER_KINDS)


@pytest.mark.parametrize("kind", MEASURED_KINDS)
def test_an_embeddings_overload_refusals_carry_the_measured_wait(kind: str, servers: list[RunningServer]) -> None:
    server = start_server(kind, threads=1, max_queue=2)
    servers.append(server)
    assert_measured_waits(refusals_under_load(server.port))


def test_the_front_doors_overload_refusals_carry_the_measured_wait(frontdoors: Any) -> None:
    server = frontdoors(threads=1, max_queue=2)
    assert_measured_waits(refusals_under_load(server.port))


@pytest.mark.parametrize("kind", FIXED_KINDS)
def test_a_fixed_retry_after_is_every_overload_refusals_wait(
    kind: str, servers: list[RunningServer], frontdoors: Any
) -> None:
    if kind == "frontdoor":
        from prazo.bindings.servers.settings import resolve_settings

        port = frontdoors(settings=resolve_settings(threads=1, max_queue=2, retry_after_s=3)).port
    else:
        server = start_server(kind, threads=1, max_queue=2, policies={"retry_after_s": 3})
        servers.append(server)
        port = server.port
    seen = refusals_under_load(port, load_s=0.5)  # a fixed wait needs no measuring window
    assert seen, "the line was never full"
    assert set(seen) == {("3", None)}
