"""prazo behind a real load balancer: two prazo waitress servers on loopback, a shipped config in front.

HAProxy (``examples/loadbalancers/haproxy.cfg``, run as is) and nginx
(``nginx.conf``, its example addresses replaced), both installed by ``make test``
(``.ci/ensure-services``): without them these tests fail in CI and skip elsewhere.

What is proved, each against the real processes:

* the balancer stamps ``X-Request-Start`` (replacing whatever a client sent) and
  prazo believes a stamp only from the balancer's address (``trusted_proxies``);
* the time a request waited in HAProxy's queue (servers at ``maxconn``) comes
  off the budget the app sees, and the budget header passes through unchanged;
* a ``503 queue-full`` from one backend is retried on the other (GET), and the
  client gets 503 + ``Retry-After`` only when both are full; a POST is not
  retried (a 503 may come from an app that ran);
* a server that refused (busy, not broken) gets its share again at once;
* a 504 — the app ran out of time, or the request expired in prazo's queue —
  is never retried: every request ran (or was refused) exactly once;
* the recipe itself: ``prazo serve --trust-request-start --trusted-proxy``
  processes (waitress and the front door) behind the shipped haproxy.cfg.

HAProxy's queue (``maxconn``) has no nginx twin: nginx OSS does not queue.
The launchers are ``prazo.bench.loadbalancers``'. Direct requests to a backend come
from 127.0.0.3, the balancer's from 127.0.0.1 (the trusted proxy). Real time is
involved: every bound is generous, nothing asserts speed.
"""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _server_harness import APP_WAIT_S, CLIENT_TIMEOUT_S, TESTS_DIR
from _services import SHIPPED_HAPROXY_CONFIG, SHIPPED_NGINX_CONFIG, free_port, haproxy_binary, nginx_binary
from prazo.bench.loadbalancers import HAProxyProcess, LoadBalancerProcess, NginxProcess
from prazo.bindings.proxy_headers import parse_request_start_ns
from prazo.bindings.servers import waitress as prazo_waitress
from prazo.bindings.servers.settings import resolve_settings
from prazo.core import current_deadline

HAPROXY_ADDRESS = "127.0.0.1"
# Linux routes all of 127.0.0.0/8 to loopback: a direct client that is not the proxy.
DIRECT_CLIENT = "127.0.0.3"
BUDGET_HEADER = "X-Request-Budget-Ms"


@dataclass
class Backend:
    """One prazo waitress server whose app says who it is and counts its calls per path."""

    name: str
    threads: int
    max_queue: int
    calls: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: Any = None
    thread: threading.Thread | None = None
    holding: int = 0  # /hold requests running now

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        with self.lock:
            self.calls[path] = self.calls.get(path, 0) + 1
        query = dict(part.split("=", 1) for part in environ.get("QUERY_STRING", "").split("&") if "=" in part)
        if path == "/hold":
            # Holds this backend's thread until the test creates the gate file.
            with self.lock:
                self.holding += 1
            Path(query["mark"]).touch()
            end = time.monotonic() + APP_WAIT_S
            while not os.path.exists(query["gate"]) and time.monotonic() < end:
                time.sleep(0.005)
            with self.lock:
                self.holding -= 1
        elif path == "/expire":
            # Runs past its deadline and notices: DeadlineExceeded -> prazo's 504.
            deadline = current_deadline()
            assert deadline is not None
            time.sleep(max(deadline.remaining(), 0) + 0.05)
            deadline.check()
        deadline = environ["prazo.deadline"]
        body = (
            f"backend={self.name} remaining_ms={deadline.remaining_ms():.0f} "
            f"queue_wait_ms={environ.get('prazo.queue_wait_ms', 0):.0f} "
            f"budget_header={environ.get('HTTP_X_REQUEST_BUDGET_MS', '-')} "
            f"request_start={environ.get('HTTP_X_REQUEST_START', '-')}"
        ).encode("latin-1")
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    def start(self) -> None:
        settings = resolve_settings(
            threads=self.threads,
            max_queue=self.max_queue,
            default_budget_ms=10000,
            trust_request_start=True,
            trusted_proxies=[HAPROXY_ADDRESS],
            environ={},
        )
        self.server = prazo_waitress.create_server(self.app, host="127.0.0.1", port=0, settings=settings)
        self.thread = threading.Thread(target=self.server.run, name=f"backend-{self.name}", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.effective_port)

    def stats(self) -> dict[str, int]:
        return dict(self.server.task_dispatcher.stats())

    def count(self, path: str) -> int:
        with self.lock:
            return self.calls.get(path, 0)

    def settle(self) -> None:
        """Wait until only the held requests occupy a slot.

        A server frees a slot a moment after its answer reached the client, so
        the next request, sent at once, could find a one-thread backend still
        full and be refused: every test waits for this between requests.
        """
        end = time.monotonic() + CLIENT_TIMEOUT_S
        while self.stats()["in_flight"] > self.holding:
            assert time.monotonic() < end, self.stats()
            time.sleep(0.002)

    def stop(self) -> None:
        prazo_waitress.shutdown(self.server, 10.0)
        if self.thread is not None:
            self.thread.join(CLIENT_TIMEOUT_S)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    fields: dict[str, str]
    body: str


def call(
    port: int, path: str, headers: dict[str, str] | None = None, *, method: str = "GET", source: str | None = None
) -> Answer:
    """One request on a fresh connection (from ``source`` when given); the body's ``k=v`` words as ``fields``."""
    conn = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=CLIENT_TIMEOUT_S, source_address=(source, 0) if source else None
    )
    try:
        conn.request(method, path, body=b"x" if method == "POST" else None, headers=headers or {})
        response = conn.getresponse()
        body = response.read().decode("latin-1")
        fields = dict(word.split("=", 1) for word in body.split() if "=" in word)
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, fields, body)
    finally:
        conn.close()


def settled_calls(
    backends: tuple[Backend, Backend],
    count: int,
    port: int,
    path: str,
    headers: dict[str, str] | None = None,
    **options: Any,
) -> list[Answer]:
    """``count`` sequential requests, each sent once both backends have settled after the previous one."""
    answers = []
    for _ in range(count):
        answers.append(call(port, path, headers, **options))
        for backend in backends:
            backend.settle()
    return answers


class Holder:
    """A request to ``/hold`` that occupies one thread of whichever backend serves it, until ``release()``."""

    def __init__(self, port: int, workdir: Path, name: str, source: str | None = None, endpoint: str = "/hold") -> None:
        self.mark = workdir / f"{name}.mark"
        self.gate = workdir / f"{name}.gate"
        self.answer: Answer | None = None
        path = f"{endpoint}?mark={self.mark}&gate={self.gate}"
        self._thread = threading.Thread(target=self._run, args=(port, path, source), daemon=True)
        self._thread.start()
        end = time.monotonic() + CLIENT_TIMEOUT_S
        while not self.mark.exists():
            assert time.monotonic() < end, "the holding request never reached an app"
            time.sleep(0.005)

    def _run(self, port: int, path: str, source: str | None) -> None:
        self.answer = call(port, path, source=source)

    def release(self) -> Answer:
        self.gate.touch()
        self._thread.join(CLIENT_TIMEOUT_S)
        assert self.answer is not None
        return self.answer


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="prazo-lb-") as path:
        yield Path(path)


@pytest.fixture
def max_queue() -> int:
    """Each backend's prazo queue: none by default (full = one request running); a test may override it."""
    return 0


@pytest.fixture
def backends(max_queue: int) -> Iterator[tuple[Backend, Backend]]:
    """Two backends a and b, one thread each."""
    pair = (Backend("a", 1, max_queue), Backend("b", 1, max_queue))
    for backend in pair:
        backend.start()
    try:
        yield pair
    finally:
        for backend in pair:
            backend.stop()


def start_haproxy(backends: tuple[Backend, Backend], maxconn: int) -> HAProxyProcess:
    return HAProxyProcess.start(
        free_port(),
        [f"127.0.0.1:{b.port}" for b in backends],
        maxconn=maxconn,
        config=SHIPPED_HAPROXY_CONFIG,
        binary=haproxy_binary(),
    )


# Attempts a request gets when every backend answers 503: HAProxy `retries 2` -> 3; nginx
# `proxy_next_upstream_tries 2` -> 2.
ATTEMPTS = {"haproxy": 3, "nginx": 2}


@pytest.fixture(params=["haproxy", "nginx"])
def lb(
    request: pytest.FixtureRequest, backends: tuple[Backend, Backend], workdir: Path
) -> Iterator[LoadBalancerProcess]:
    """The balancer in front of both backends; HAProxy's per-server maxconn above what they hold (it never queues)."""
    proxy: LoadBalancerProcess
    if request.param == "haproxy":
        proxy = start_haproxy(backends, maxconn=10)
    else:
        binary = nginx_binary()
        backend_addresses = [f"127.0.0.1:{b.port}" for b in backends]
        proxy = NginxProcess.start(free_port(), backend_addresses, workdir, config=SHIPPED_NGINX_CONFIG, binary=binary)
    try:
        yield proxy
    finally:
        proxy.stop()


def test_the_balancer_stamps_request_start_and_prazo_trusts_it_only_from_there(
    backends: tuple[Backend, Backend], lb: LoadBalancerProcess
) -> None:
    forged = f"t={time.time() - 4.0:.3f}"  # claims the request waited 4 s in a proxy
    headers = {"X-Request-Start": forged, BUDGET_HEADER: "10000"}

    (through,) = settled_calls(backends, 1, lb.port, "/whoami", headers)
    assert through.status == 200
    # The balancer replaced the client's stamp with its own, a moment ago (HAProxy: ms since
    # the epoch, nginx: seconds with a fraction)...
    assert through.fields["request_start"] != forged
    stamp_ns = parse_request_start_ns(through.fields["request_start"])
    assert stamp_ns is not None and abs(stamp_ns / 1e9 - time.time()) < 60
    # ...which the backend trusted (so the forged 4 s were never taken), and the budget header is unchanged.
    assert int(through.fields["remaining_ms"]) > 8000
    assert through.fields["budget_header"] == "10000"

    # A direct client is not the proxy: its stamp is ignored ...
    for backend in backends:
        (direct,) = settled_calls(backends, 1, backend.port, "/whoami", headers, source=DIRECT_CLIENT)
        assert direct.status == 200
        assert int(direct.fields["remaining_ms"]) > 8000
    # ... while the same stamp from the trusted address (where the balancer connects from) counts.
    trusted = call(backends[0].port, "/whoami", headers, source=HAPROXY_ADDRESS)
    assert int(trusted.fields["remaining_ms"]) <= 6000 + 500


@pytest.mark.slow
def test_time_queued_in_haproxy_comes_off_the_budget(backends: tuple[Backend, Backend], workdir: Path) -> None:
    # maxconn 1: with both backends busy, HAProxy holds the next request in its own queue.
    proxy = start_haproxy(backends, maxconn=1)
    try:
        holders = [Holder(proxy.port, workdir, f"hold{i}") for i in range(2)]
        assert {backend.count("/hold") for backend in backends} == {1}  # one per backend
        result: dict[str, Any] = {}

        def queued() -> None:
            result["answer"] = call(proxy.port, "/whoami", {BUDGET_HEADER: "10000"})

        waiter = threading.Thread(target=queued, daemon=True)
        waiter.start()
        time.sleep(1.5)  # the request waits in HAProxy's queue all this time
        assert sum(backend.count("/whoami") for backend in backends) == 0
        for holder in holders:
            assert holder.release().status == 200
        waiter.join(CLIENT_TIMEOUT_S)
    finally:
        proxy.stop()
    answer: Answer = result["answer"]
    assert answer.status == 200
    # At least 1.5 s of the 10 s budget went in HAProxy's queue (a 0.5 s allowance for
    # HAProxy stamping late), not in prazo's: the backend took it off from the stamp.
    assert int(answer.fields["remaining_ms"]) <= 10000 - 1000
    assert int(answer.fields["queue_wait_ms"]) < 1000
    assert answer.fields["budget_header"] == "10000"


def test_queue_full_503_is_retried_on_the_other_backend(
    backends: tuple[Backend, Backend], lb: LoadBalancerProcess, workdir: Path
) -> None:
    a, b = backends
    holder = Holder(a.port, workdir, "hold-a", source=DIRECT_CLIENT)  # the balancer does not know a is full
    answers = settled_calls(backends, 6, lb.port, "/whoami", {BUDGET_HEADER: "5000"})
    holder.release()
    assert [answer.status for answer in answers] == [200] * 6
    assert {answer.fields["backend"] for answer in answers} == {"b"}
    # The balancer did send some of them to a first: a refused them at once (the app never ran) ...
    assert a.stats()["rejected_full"] >= 1
    assert a.count("/whoami") == 0
    # ... and each ran exactly once, on b.
    assert b.count("/whoami") == 6


def test_a_server_that_refused_is_not_taken_out_of_rotation(
    backends: tuple[Backend, Backend], lb: LoadBalancerProcess, workdir: Path
) -> None:
    a = backends[0]
    holder = Holder(a.port, workdir, "hold-a", source=DIRECT_CLIENT)
    settled_calls(backends, 4, lb.port, "/whoami")
    holder.release()
    a.settle()
    assert a.stats()["rejected_full"] >= 1
    # a was full, not broken: once it has room it gets its share again at once (nginx's
    # default max_fails=1 would have kept it out for fail_timeout, 10 s).
    answers = settled_calls(backends, 6, lb.port, "/whoami")
    assert [answer.status for answer in answers] == [200] * 6
    assert a.count("/whoami") >= 1


def test_both_backends_full_the_client_gets_the_503_with_retry_after(
    backends: tuple[Backend, Backend], lb: LoadBalancerProcess, workdir: Path
) -> None:
    holders = [Holder(backend.port, workdir, f"hold-{backend.name}", DIRECT_CLIENT) for backend in backends]
    answer = call(lb.port, "/whoami")
    for holder in holders:
        holder.release()
    assert answer.status == 503
    assert answer.headers["x-prazo-reason"] == "queue-full"
    assert answer.headers["retry-after"] == "1"
    # Every attempt the config allows, on both backends, none ran the app.
    refused = [backend.stats()["rejected_full"] for backend in backends]
    assert sum(refused) == ATTEMPTS[lb.name] and min(refused) >= 1, refused
    assert sum(backend.count("/whoami") for backend in backends) == 0


def test_a_post_is_not_retried(backends: tuple[Backend, Backend], lb: LoadBalancerProcess, workdir: Path) -> None:
    a, b = backends
    holder = Holder(a.port, workdir, "hold-a", source=DIRECT_CLIENT)
    answers = settled_calls(backends, 6, lb.port, "/whoami", method="POST")
    holder.release()
    refused = [answer for answer in answers if answer.status == 503]
    # Those the balancer sent to a came back 503 queue-full to the client (no L7 retry for a POST) ...
    assert len(refused) == a.stats()["rejected_full"] >= 1
    assert {answer.headers["x-prazo-reason"] for answer in refused} == {"queue-full"}
    # ... the rest ran once on b.
    assert b.count("/whoami") == len(answers) - len(refused)


def test_a_504_from_the_app_is_never_retried(backends: tuple[Backend, Backend], lb: LoadBalancerProcess) -> None:
    answers = settled_calls(backends, 4, lb.port, "/expire", {BUDGET_HEADER: "200"})
    assert [answer.status for answer in answers] == [504] * 4
    assert {answer.headers["x-prazo-reason"] for answer in answers} == {"deadline-exceeded"}
    # Four requests, four runs in all: no backend ran one a second time.
    assert sum(backend.count("/expire") for backend in backends) == 4


@pytest.mark.parametrize("max_queue", [1])
def test_a_504_expired_in_prazos_queue_is_never_retried(
    backends: tuple[Backend, Backend], lb: LoadBalancerProcess, workdir: Path
) -> None:
    a, b = backends
    holder = Holder(a.port, workdir, "hold-a", source=DIRECT_CLIENT)
    # Sent to a, a request waits in a's queue and expires there (504, the app never runs);
    # sent to b, it runs. A 504 retried on b would have come back 200 instead.
    answers = settled_calls(backends, 6, lb.port, "/whoami", {BUDGET_HEADER: "300"})
    holder.release()
    expired = [answer for answer in answers if answer.status == 504]
    assert {answer.headers["x-prazo-reason"] for answer in expired} == {"expired-in-queue"}
    assert len(expired) == a.stats()["expired"] >= 1
    assert a.count("/whoami") == 0
    assert b.count("/whoami") == len(answers) - len(expired)
    assert {answer.fields["backend"] for answer in answers if answer.status == 200} <= {"b"}


def start_prazo_serve(*flags: str) -> tuple[subprocess.Popen[str], int]:
    """``prazo serve _server_harness:app`` (waitress) with ``flags``, as a process; its port once it answers."""
    command = [sys.executable, "-m", "prazo.bindings.servers.serve", "_server_harness:app", "--port", "0", *flags]
    process = subprocess.Popen(command, cwd=TESTS_DIR, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    match = re.search(r"http://127\.0\.0\.1:(\d+) ", process.stdout.readline())
    assert match, "prazo serve did not announce its address"
    return process, int(match.group(1))


def call_once_free(port: int, path: str, headers: dict[str, str] | None = None, **options: Any) -> Answer:
    """``call``, sent again while the answer is a 503 ``queue-full`` (the app never ran).

    prazo serve runs in another process whose line cannot be watched, and a server gives its one
    place back only after the previous answer is on the wire: on a loaded machine the next request
    can still find it taken (CI saw a ``/calls`` read refused right after the holder's answer).
    """
    end = time.monotonic() + CLIENT_TIMEOUT_S
    while True:
        answer = call(port, path, headers, **options)
        refused = answer.status == 503 and answer.headers.get("x-prazo-reason") == "queue-full"
        if not refused or time.monotonic() > end:
            return answer
        time.sleep(0.02)


# "prazo": the front door, whose C thread takes the proxy's queue time off the deadline as
# it parses the head (a budget used up in HAProxy is answered 504 there, never by a worker).
@pytest.mark.slow
@pytest.mark.parametrize("server", ["waitress", "prazo"])
def test_the_recipe_prazo_serve_processes_behind_the_shipped_haproxy(server: str, workdir: Path) -> None:
    # The flags of the recipe in haproxy.cfg's header, HAProxy's address as the trusted proxy.
    flags = ("--server", server, "--threads", "1", "--max-queue", "0")
    flags += ("--trust-request-start", "--trusted-proxy", HAPROXY_ADDRESS)
    started = [start_prazo_serve(*flags) for _ in "ab"]
    proxy: HAProxyProcess | None = None
    try:
        (_, port_a), (_, port_b) = started
        proxy = HAProxyProcess.start(
            free_port(),
            [f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"],
            maxconn=10,
            config=SHIPPED_HAPROXY_CONFIG,
            binary=haproxy_binary(),
        )
        seen = call_once_free(proxy.port, "/budget-header", {BUDGET_HEADER: "5000"})
        assert seen.status == 200 and seen.fields["header"] == "5000"
        # The flags made a stamp count from HAProxy's address only ...
        forged = {"X-Request-Start": f"t={time.time() - 3.0:.3f}", BUDGET_HEADER: "10000"}
        assert (
            int(call_once_free(port_a, "/budget-header", forged, source=HAPROXY_ADDRESS).fields["remaining_ms"]) <= 7500
        )
        assert int(call_once_free(port_a, "/budget-header", forged, source=DIRECT_CLIENT).fields["remaining_ms"]) > 8000
        # ... and a request whose budget went by in the proxy never runs.
        spent = {**forged, BUDGET_HEADER: "2000"}
        late = call_once_free(port_a, "/work", spent, source=HAPROXY_ADDRESS)
        assert (late.status, late.headers["x-prazo-reason"]) == (504, "expired-on-arrival")
        assert call_once_free(port_a, "/calls").body == "0"
        # a full (held directly): every request through HAProxy still runs, once, on b.
        holder = Holder(port_a, workdir, "hold-a", DIRECT_CLIENT, endpoint="/work")
        answers = [call_once_free(proxy.port, "/work", {BUDGET_HEADER: "5000"}) for _ in range(4)]
        assert holder.release().status == 200
        assert [answer.status for answer in answers] == [200] * 4
        # /calls counts the app's /work runs in each process: the holder on a, the four on b.
        assert [int(call_once_free(port, "/calls").body) for port in (port_a, port_b)] == [1, 4]
    finally:
        if proxy is not None:
            proxy.stop()
        for process, _ in started:
            process.terminate()
            process.wait(CLIENT_TIMEOUT_S)
            if process.stdout is not None:
                process.stdout.close()
