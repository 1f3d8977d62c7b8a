"""The shared parts of the server embeddings: dispatcher, tickets, request heads, refusals, polite close."""

from __future__ import annotations

import http.client
import io
import socket
import threading
import time
from typing import Any

import pytest
from _helpers import JOIN_TIMEOUT_S, wait_until
from hypothesis import given
from hypothesis import strategies as st
from prazo.bindings.headers import BudgetPolicy
from prazo.bindings.servers.plumbing.connection import ConnectionAdmission
from prazo.bindings.servers.plumbing.dispatcher import AdmissionDispatcher, AdmittedApp, Ticket
from prazo.bindings.servers.plumbing.heads import find_head, head_environ, peek_bytes
from prazo.bindings.servers.plumbing.refusals import LingeringCloser, rejection_bytes
from prazo.bindings.servers.settings import ServerSettings
from prazo.bindings.wsgi import MiddlewareCounters
from prazo.core import Deadline, DeadlineExceeded, QueueFull, ShutDown

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled


class Recorder:
    """A dispatcher's two callbacks: ``serve`` may block on a gate; both record what they saw."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.served: list[Any] = []
        self.refused: list[tuple[Any, BaseException, float]] = []
        self.lock = threading.Lock()

    def serve(self, ticket: Ticket) -> None:
        self.gate.wait(JOIN_TIMEOUT_S)
        with self.lock:
            self.served.append(ticket.item)

    def reject(self, ticket: Ticket, exc: BaseException) -> None:
        with self.lock:
            self.refused.append((ticket.item, exc, time.monotonic()))


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def _ticket(item: Any, budget_s: float = 10.0) -> Ticket:
    return Ticket(item, Deadline.after(budget_s), time.monotonic_ns())


def _dispatcher(recorder: Recorder, threads: int, max_queue: int) -> AdmissionDispatcher:
    dispatcher = AdmissionDispatcher(threads, max_queue, serve=recorder.serve, reject=recorder.reject, name="test")
    dispatcher.start()
    return dispatcher


def test_admits_up_to_capacity_and_refuses_the_rest_at_once(recorder: Recorder) -> None:
    dispatcher = _dispatcher(recorder, threads=2, max_queue=3)
    admitted = [dispatcher.submit(_ticket(n)) for n in range(7)]
    assert admitted == [True] * 5 + [False] * 2
    assert [(item, type(exc), exc.reason) for item, exc, _ in recorder.refused] == [
        (5, QueueFull, "queue-full"),
        (6, QueueFull, "queue-full"),
    ]
    recorder.gate.set()
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    assert sorted(recorder.served) == [0, 1, 2, 3, 4]
    stats = dispatcher.stats()
    assert (stats["started"], stats["completed"], stats["in_flight"]) == (5, 5, 0)


def test_a_waiting_ticket_is_refused_at_its_own_deadline(recorder: Recorder) -> None:
    dispatcher = _dispatcher(recorder, threads=1, max_queue=2)
    dispatcher.submit(_ticket("busy"))
    submitted = time.monotonic()
    dispatcher.submit(_ticket("short", budget_s=0.2))
    wait_until(lambda: bool(recorder.refused), "the short ticket to expire")
    item, exc, when = recorder.refused[0]
    assert (item, type(exc), exc.reason) == ("short", DeadlineExceeded, "expired-in-queue")
    # Expired while the only worker was still busy: nobody pulled it from the line.
    assert 0.15 <= when - submitted < JOIN_TIMEOUT_S
    assert recorder.served == []
    recorder.gate.set()
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    assert recorder.served == ["busy"]


def test_a_ticket_past_its_deadline_is_refused_on_arrival(recorder: Recorder) -> None:
    dispatcher = _dispatcher(recorder, threads=1, max_queue=1)
    assert not dispatcher.submit(Ticket("late", Deadline.after(-1), time.monotonic_ns()))
    assert recorder.refused[0][1].reason == "expired-on-arrival"
    dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)


def test_shutdown_serves_the_admitted_and_refuses_newcomers(recorder: Recorder) -> None:
    dispatcher = _dispatcher(recorder, threads=1, max_queue=3)
    for n in range(4):
        dispatcher.submit(_ticket(n))
    stopper = threading.Thread(target=dispatcher.shutdown, kwargs={"timeout": JOIN_TIMEOUT_S})
    stopper.start()
    wait_until(lambda: dispatcher.queue.is_shutdown, "shutdown to begin")
    assert not dispatcher.submit(_ticket("late"))
    assert isinstance(recorder.refused[-1][1], ShutDown)
    recorder.gate.set()
    stopper.join(JOIN_TIMEOUT_S)
    assert recorder.served == [0, 1, 2, 3]


def test_shutdown_timeout_answers_what_still_waits(recorder: Recorder) -> None:
    dispatcher = _dispatcher(recorder, threads=1, max_queue=2)
    for n in range(3):
        dispatcher.submit(_ticket(n))
    assert dispatcher.shutdown(timeout=0.2) is False
    assert sorted(item for item, exc, _ in recorder.refused if isinstance(exc, ShutDown)) == [1, 2]
    recorder.gate.set()
    wait_until(lambda: recorder.served == [0], "the running ticket to finish")


def test_a_failing_serve_never_kills_a_worker_nor_leaks_a_slot() -> None:
    served: list[str] = []

    def serve(ticket: Ticket) -> None:
        served.append(ticket.item)
        if ticket.item == "exit":
            raise SystemExit("an app calling sys.exit() in a worker")
        raise ValueError("broken")

    dispatcher = AdmissionDispatcher(1, 0, serve=serve, reject=lambda t, e: None)
    dispatcher.start()
    for item in ("exit", "error", "after"):
        wait_until(lambda: dispatcher.stats()["in_flight"] == 0, "the slot to come back")
        assert dispatcher.submit(_ticket(item))
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    assert served == ["exit", "error", "after"]
    assert dispatcher.stats()["completed"] == 3


def test_ticket_release_gives_the_slot_back_once(recorder: Recorder) -> None:
    released: list[Ticket] = []

    def serve(ticket: Ticket) -> None:
        ticket.release()
        ticket.release()
        released.append(ticket)

    dispatcher = AdmissionDispatcher(1, 1, serve=serve, reject=recorder.reject)
    dispatcher.start()
    dispatcher.submit(_ticket("a"))
    dispatcher.submit(_ticket("b"))
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    assert dispatcher.stats()["completed"] == 2
    assert all(ticket.queue_wait_ns >= 0 for ticket in released)


def test_ticket_released_by_many_threads_at_once_gives_its_slot_back_once(recorder: Recorder) -> None:
    """Real threads race on each ticket's release (the body's, another thread's, the worker's): one wins."""
    racers, rounds = 6, 40
    errors: list[BaseException] = []

    def serve(ticket: Ticket) -> None:
        barrier = threading.Barrier(racers + 1)

        def race() -> None:
            try:
                barrier.wait(JOIN_TIMEOUT_S)
                ticket.release()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=race) for _ in range(racers)]
        for thread in threads:
            thread.start()
        barrier.wait(JOIN_TIMEOUT_S)
        ticket.release()
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
        # The worker releases once more after serve returns: that one must do nothing either.

    dispatcher = AdmissionDispatcher(1, rounds, serve=serve, reject=recorder.reject)
    dispatcher.start()
    for number in range(rounds):
        assert dispatcher.submit(_ticket(number))
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    assert errors == []
    stats = dispatcher.stats()
    assert (stats["started"], stats["completed"], stats["in_flight"]) == (rounds, rounds, 0)


def test_a_ticket_released_before_it_started_still_releases_once_started() -> None:
    """release() before a worker took the ticket gives nothing back and leaves the guard untaken."""
    served: list[Ticket] = []

    def serve(ticket: Ticket) -> None:
        served.append(ticket)

    dispatcher = AdmissionDispatcher(1, 1, serve=serve, reject=lambda t, e: None)
    ticket = _ticket("early")
    ticket.release()  # not started: nothing to give back
    dispatcher.start()
    assert dispatcher.submit(ticket)
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    assert served == [ticket]
    stats = dispatcher.stats()
    assert (stats["started"], stats["completed"], stats["in_flight"]) == (1, 1, 0)


@pytest.mark.parametrize("release_at_close", [True, False])
def test_admitted_app_gives_the_slot_back_at_the_close_or_when_serve_returns(release_at_close: bool) -> None:
    """``release_at_close=False`` keeps the slot through the body's close; the worker gives it back after serve."""
    seen: list[int] = []
    dispatcher: AdmissionDispatcher

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    def serve(ticket: Ticket) -> None:
        body = admitted({"PATH_INFO": "/"}, lambda status, headers, exc_info=None: None)
        assert b"".join(body) == b"ok"
        body.close()  # type: ignore[attr-defined]
        seen.append(dispatcher.stats()["in_flight"])

    dispatcher = AdmissionDispatcher(1, 0, serve=serve, reject=lambda t, e: None)
    admitted = AdmittedApp(
        app, dispatcher, BudgetPolicy(1000, 30000), MiddlewareCounters(), release_at_close=release_at_close
    )
    dispatcher.start()
    assert dispatcher.submit(_ticket("one"))
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    assert seen == [0 if release_at_close else 1]
    stats = dispatcher.stats()
    assert (stats["completed"], stats["in_flight"]) == (1, 0)
    with pytest.raises(TypeError, match="release_at_close"):
        AdmittedApp(app, dispatcher, BudgetPolicy(1000, 30000), MiddlewareCounters(), release_at_close=1)  # type: ignore[arg-type]


def test_the_callbacks_must_be_callable() -> None:
    with pytest.raises(TypeError, match="serve and reject must be callables"):
        AdmissionDispatcher(1, 0, serve=None, reject=print)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_concurrency"):
        AdmissionDispatcher(0, 0, serve=print, reject=print)


def _start_response_recorder() -> tuple[list[Any], Any]:
    seen: list[Any] = []

    def start_response(status: str, headers: list, exc_info: Any = None) -> Any:
        seen.append((status, dict(headers)))
        return lambda data: None

    return seen, start_response


def test_admitted_app_runs_only_for_the_ticket_the_worker_holds() -> None:
    calls: list[dict] = []

    def app(environ: dict, start_response: Any) -> list[bytes]:
        calls.append(environ)
        start_response("200 OK", [])
        return [b"ok"]

    outcomes: list[Any] = []
    counters = MiddlewareCounters()
    dispatcher: AdmissionDispatcher

    def serve(ticket: Ticket) -> None:
        seen, start_response = _start_response_recorder()
        body = b"".join(wrapped({"X": ticket.item}, start_response))
        outcomes.append((ticket.item, seen[0][0], body))
        with pytest.raises(RuntimeError, match="outside a request admitted"):
            wrapped({}, start_response)  # a second request on the same ticket

    dispatcher = AdmissionDispatcher(1, 2, serve=serve, reject=lambda t, e: None)
    wrapped = AdmittedApp(app, dispatcher, BudgetPolicy(1000, 5000), counters)
    with pytest.raises(RuntimeError, match="outside a request admitted"):
        wrapped({}, _start_response_recorder()[1])
    dispatcher.start()
    dispatcher.submit(_ticket("exact"))
    arrival = time.monotonic_ns()
    # Provisional: admitted before its head was read; the parsed budget decides.
    dispatcher.submit(Ticket("spent", Deadline.after(5), arrival, provisional=True))
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    assert outcomes[0] == ("exact", "200 OK", b"ok")
    assert outcomes[1][:2] == ("spent", "200 OK")
    assert calls[0]["prazo.deadline"] is not None and callable(calls[0]["prazo.server_stats"])
    assert calls[1]["prazo.budget_source"] is None  # no budget header: the default applied


class _EnvironSubclass(dict):  # type: ignore[type-arg]
    """An environ that is not exactly a dict: run_admitted's Python path, never the compiled call."""


@pytest.mark.parametrize("environ_type", [dict, _EnvironSubclass], ids=["dict", "dict-subclass"])
def test_admitted_app_runs_the_app_once_and_releases_the_slot_once_for_any_environ(environ_type: type) -> None:
    """The same keys, answer and single release whichever way AdmittedApp reaches the app."""
    seen: list[dict[str, Any]] = []
    outcomes: list[Any] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.append(dict(environ))
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    def serve(ticket: Ticket) -> None:
        status, start_response = _start_response_recorder()
        body = wrapped(environ_type(HTTP_X_REQUEST_BUDGET_MS="5000"), start_response)
        outcomes.append((type(body).__name__, b"".join(body), status[0][0]))
        body.close()  # type: ignore[attr-defined]

    dispatcher = AdmissionDispatcher(2, 2, serve=serve, reject=lambda t, e: None)
    wrapped = AdmittedApp(app, dispatcher, BudgetPolicy(1000, 5000), MiddlewareCounters())
    dispatcher.start()
    arrival = time.monotonic_ns()
    tickets = [Ticket(f"r{n}", Deadline.after(10), arrival) for n in range(3)]
    for ticket in tickets:
        assert dispatcher.submit(ticket)
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    assert [outcome[1:] for outcome in outcomes] == [(b"ok", "200 OK")] * 3
    assert len(seen) == 3
    for environ in seen:
        assert isinstance(environ["prazo.deadline"], Deadline)
        assert environ["prazo.queue_wait_ms"] >= 0
        assert callable(environ["prazo.server_stats"])
    # The body gave each slot back; the worker's release afterwards did nothing.
    stats = dispatcher.stats()
    assert (stats["in_flight"], stats["started"], stats["completed"]) == (0, 3, 3)


def test_admitted_app_answers_504_when_the_parsed_budget_is_already_spent() -> None:
    calls: list[dict] = []
    outcomes: list[Any] = []

    def serve(ticket: Ticket) -> None:
        seen, start_response = _start_response_recorder()
        body = b"".join(wrapped({"HTTP_X_REQUEST_BUDGET_MS": "50"}, start_response))
        outcomes.append((seen[0], body))

    dispatcher = AdmissionDispatcher(1, 0, serve=serve, reject=lambda t, e: None)
    wrapped = AdmittedApp(lambda e, s: calls.append(e) or [], dispatcher, BudgetPolicy(), MiddlewareCounters())
    dispatcher.start()
    # Arrived 100 ms ago with a 50 ms budget: spent before the app could start.
    dispatcher.submit(Ticket("slow head", Deadline.after(5), time.monotonic_ns() - 100_000_000, provisional=True))
    assert dispatcher.shutdown(timeout=JOIN_TIMEOUT_S)
    (status, headers), _ = outcomes[0]
    assert status.startswith("504") and headers["X-Prazo-Reason"] == "expired-in-queue"
    assert calls == []
    assert dispatcher.stats()["in_flight"] == 0


@pytest.mark.parametrize(
    ("data", "head"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", b"GET / HTTP/1.1\r\nHost: a\r\n"),
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r\nbody", b"GET / HTTP/1.1\r\nHost: a\r\n"),
        (b"GET / HTTP/1.0\n\n", b"GET / HTTP/1.0\n"),
        (b"\r\n\r\nGET / HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\n"),
        (b"GET / HTTP/1.1\r\nHost: a\r\n", None),
        (b"", None),
    ],
)
def test_find_head(data: bytes, head: bytes) -> None:
    assert find_head(data) == head


def test_head_environ_reads_what_a_budget_policy_needs() -> None:
    head = (
        b"GET / HTTP/1.1\r\n"
        b"X-Request-Budget-Ms: 250\r\n"
        b"x-request-budget-ms:  300 \r\n"
        b" folded continuation\r\n"
        b"Bad Name: x\r\n"
        b"no colon here\r\n"
        b"grpc-timeout: 2S\r\n"
    )
    environ = head_environ(head, "10.0.0.1")
    assert environ == {
        "REMOTE_ADDR": "10.0.0.1",
        "HTTP_X_REQUEST_BUDGET_MS": "250,300",
        "HTTP_GRPC_TIMEOUT": "2S",
    }
    # A repeated budget header counts by its smaller value, never the larger one.
    assert BudgetPolicy(1000, 30000).deadline_for(environ, 0)[0].ns == 250_000_000


@given(st.binary(max_size=300))
def test_heads_of_arbitrary_bytes_never_raise(data: bytes) -> None:
    head = find_head(data)
    if head is not None:
        environ = head_environ(head, None)
        BudgetPolicy(1000, 30000).deadline_for(environ, 0)


# Heads shaped like requests, so the property reaches head_environ and the
# budget rules on almost every example (arbitrary bytes rarely end a head):
# the budget headers with arbitrary values, repeated, in any case, folded,
# beside malformed lines, with either line ending.
_BUDGET_NAMES = ["X-Request-Budget-Ms", "x-request-budget-ms", "grpc-timeout", "x-envoy-expected-rq-timeout-ms"]
_BYTE_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=12)
_BUDGET_VALUE = st.one_of(
    st.integers(-5, 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.tuples(st.integers(0, 10**9), st.sampled_from("HMSmun")).map(lambda v: f"{v[0]}{v[1]}"),
    st.sampled_from(["", "nan", "inf", " 7 ", "1,2", "0x10", "1e3", "250ms"]),
    _BYTE_TEXT,
)
_BUDGET_LINE = st.tuples(st.sampled_from(_BUDGET_NAMES), _BUDGET_VALUE).map(lambda field: f"{field[0]}:{field[1]}")
_OTHER_LINE = st.one_of(
    st.tuples(st.sampled_from(["Host", "X-Other", "Bad Name", "X-\xe9"]), _BYTE_TEXT).map(
        lambda field: f"{field[0]}:{field[1]}"
    ),
    st.sampled_from([" folded continuation", "no colon here", ":empty name", "X-Empty:"]),
)
# At least one budget field in every head, among the others in any order.
_FIELD_LINES = st.tuples(st.lists(_BUDGET_LINE, min_size=1, max_size=3), st.lists(_OTHER_LINE, max_size=5)).flatmap(
    lambda lines: st.permutations(lines[0] + lines[1])
)
STRUCTURED_HEADS = st.tuples(
    st.sampled_from(["GET / HTTP/1.1", "POST /x?y=1 HTTP/1.0", "PUT http://h/p HTTP/1.1"]),
    _FIELD_LINES,
    st.sampled_from(["\r\n", "\n"]),
).map(lambda head: (head[0] + head[2] + "".join(line + head[2] for line in head[1]) + head[2]).encode("latin-1"))


@given(STRUCTURED_HEADS, st.integers(0, 2**62))
def test_structured_heads_reach_the_budget_rules_and_never_extend_the_cap(data: bytes, arrival_ns: int) -> None:
    head = find_head(data)
    assert head is not None, data
    environ = head_environ(head, "127.0.0.1")
    assert environ["REMOTE_ADDR"] == "127.0.0.1"
    deadline, incoming = BudgetPolicy(1000, 30000).deadline_for(environ, arrival_ns)
    if incoming.budget_ms is None:  # nothing usable: the server's default, never more
        assert deadline.ns == arrival_ns + 1000 * 1_000_000
    # Whatever the headers say, the deadline lies between the arrival (a used-up
    # budget) and the server's cap: a client may shorten it, never extend it.
    assert arrival_ns <= deadline.ns <= arrival_ns + 30000 * 1_000_000


def test_rejection_bytes_are_a_complete_http_response() -> None:
    for exc, status, reason in (
        (QueueFull(), 503, "queue-full"),
        (DeadlineExceeded("expired-in-queue"), 504, "expired-in-queue"),
        (ShutDown(), 503, "shutting-down"),
    ):
        raw = rejection_bytes(exc)
        response = http.client.HTTPResponse(_FakeSocket(raw))  # type: ignore[arg-type]
        response.begin()
        assert (response.status, response.getheader("X-Prazo-Reason")) == (status, reason)
        assert response.getheader("Connection") == "close"
        assert response.read() == f"{response.status} {response.reason}: {reason}\n".encode()
    assert b"Connection: keep-alive" in rejection_bytes(QueueFull(), keep_alive=True)


class _FakeSocket:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def makefile(self, *args: object, **kwargs: object) -> io.BytesIO:
        return io.BytesIO(self._data)


def test_peek_leaves_the_bytes_in_place_and_never_blocks() -> None:
    server, client = socket.socketpair()
    with server, client:
        server.settimeout(5.0)  # a timeout must not make the peek wait
        started = time.monotonic()
        assert peek_bytes(server) is None
        assert time.monotonic() - started < 1.0
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        wait_until(lambda: peek_bytes(server) is not None, "the bytes to arrive")
        assert peek_bytes(server) == b"GET / HTTP/1.1\r\n\r\n"
        assert server.gettimeout() == 5.0
        assert server.recv(100) == b"GET / HTTP/1.1\r\n\r\n"
        client.close()
        assert peek_bytes(server) == b""


def test_lingering_close_lets_an_uploading_client_finish_and_read_the_answer() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    closer = LingeringCloser(linger_s=5.0)
    try:
        client = socket.create_connection(listener.getsockname(), timeout=JOIN_TIMEOUT_S)
        accepted, _ = listener.accept()
        client.sendall(b"POST / HTTP/1.1\r\nContent-Length: 4194304\r\n\r\n")
        accepted.sendall(rejection_bytes(QueueFull()))
        closer.close(accepted)
        client.sendall(b"x" * 4 * 1024 * 1024)  # would fail with a reset after a plain close
        received = b""
        while chunk := client.recv(65536):
            received += chunk
        assert received.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        client.close()
        wait_until(lambda: closer.lingering == 0, "the lingering socket to close")
    finally:
        closer.stop()
        listener.close()


def test_lingering_gives_up_after_its_time_and_stop_closes_the_rest() -> None:
    closer = LingeringCloser(linger_s=0.2)
    silent_peer, lingering = socket.socketpair()
    with silent_peer:
        closer.close(lingering)
        assert closer.lingering == 1
        wait_until(lambda: closer.lingering == 0, "the linger time to pass")
        assert lingering.fileno() == -1
    full = LingeringCloser(max_sockets=0)
    peer, sock = socket.socketpair()
    with peer:
        full.close(sock)  # no room to linger: closed at once
        assert sock.fileno() == -1
    long = LingeringCloser(linger_s=60)
    peer, sock = socket.socketpair()
    with peer:
        long.close(sock)
        long.stop()
        assert sock.fileno() == -1 and long.lingering == 0
    with pytest.raises(ValueError, match="linger_s"):
        LingeringCloser(linger_s=-1)
    closer.stop()


def _connection_admission(served: list[Any]) -> ConnectionAdmission:
    def serve(ticket: Ticket) -> None:
        served.append(ticket)

    return ConnectionAdmission(
        ServerSettings(threads=1, max_queue=1, header_timeout_ms=JOIN_TIMEOUT_S * 1000),
        serve=serve,
        socket_of=lambda item: item,
        name="test",
    )


def test_a_head_is_offered_once_complete_with_its_deadline_counted_from_its_first_byte() -> None:
    served: list[Ticket] = []
    admission = _connection_admission(served)
    admission.start()
    server_side, client = socket.socketpair()
    try:
        client.sendall(b"GET / HTTP/1.1\r\nX-Request-Budget-Ms: 60")
        admission.admit(server_side, server_side, None)
        assert admission.stats()["pending_heads"] == 1
        time.sleep(0.05)
        assert (admission.stats()["offered"], served) == (0, [])
        client.sendall(b"00\r\n\r\n")
        wait_until(lambda: served, "the completed head to be served")
        ticket = served[0]
        assert not ticket.provisional
        assert ticket.deadline.ns - ticket.arrival_ns == 6000 * 1_000_000
        assert admission.stats()["pending_heads"] == 0
        # The head was peeked at, never consumed: the server reads it whole.
        assert server_side.recv(100).startswith(b"GET / HTTP/1.1\r\n")
    finally:
        assert admission.close(timeout=JOIN_TIMEOUT_S)
        client.close()
        server_side.close()


def test_after_close_a_pending_head_is_dropped_and_a_new_request_gets_503_shutting_down() -> None:
    served: list[Ticket] = []
    admission = _connection_admission(served)
    pending_side, pending_client = socket.socketpair()
    late_side, late_client = socket.socketpair()
    try:
        pending_client.sendall(b"GET / HTTP/1.1\r\n")
        admission.admit(pending_side, pending_side, None)
        assert admission.close(timeout=JOIN_TIMEOUT_S)
        # Closed without an answer (a reset, as its bytes were never read).
        with pytest.raises(ConnectionResetError):
            pending_client.recv(100)
        late_client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        admission.admit(late_side, late_side, None)
        response = http.client.HTTPResponse(late_client)  # type: ignore[arg-type]
        response.begin()
        assert (response.status, response.getheader("X-Prazo-Reason")) == (503, "shutting-down")
        assert served == [] and admission.stats()["offered"] == 0
    finally:
        for sock in (pending_side, pending_client, late_side, late_client):
            sock.close()
