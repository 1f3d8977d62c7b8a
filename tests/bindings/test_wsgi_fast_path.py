"""The compiled common path of AdmissionMiddleware (``prazo.bindings._wsgi_c``) against the Python path.

The Python path is the specification. The same requests served through a
middleware on each path must give the same answers, environ keys, counters
and releases; these tests drive both side by side, with list and tuple
bodies (the case the compiled path serves itself), and check when the
compiled path runs at all. ``test_wsgi.py`` runs every middleware behaviour
test on both paths too.
"""

from __future__ import annotations

import contextvars
import gc
import os
import subprocess
import sys
import threading
import time
from wsgiref.validate import validator

import pytest
from _helpers import JOIN_TIMEOUT_S, examples, run_checked
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.headers import (
    BUDGET_ENVIRON_KEY,
    BUDGET_HEADER,
    ENVOY_TIMEOUT_ENVIRON_KEY,
    GRPC_TIMEOUT_ENVIRON_KEY,
    REASON_HEADER_NAME,
)
from prazo.bindings.wsgi import BUDGET_SOURCE_KEY, DEADLINE_KEY, QUEUE_WAIT_MS_KEY, AdmissionMiddleware, ListBody
from prazo.core import (
    Deadline,
    DeadlineExceeded,
    DownstreamOverloaded,
    current_deadline,
    deadline_scope,
    extension_wanted,
)
from prazo.core._queue_py import AdmissionQueue as PythonTwinQueue
from test_wsgi import Probe, Server, call, fast_path, make_environ

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

# Re-exported: the fixture of test_wsgi.py, so every test below that takes it runs on both paths.
__all__ = ["fast_path"]


PLAIN = {"max_concurrency": 1, "max_queue": 0}


def middleware_pair(app, **options):
    """The same middleware on the Python path and on the compiled one.

    Skipped when PRAZO_NO_EXTENSIONS=1 asks for no extensions; otherwise
    ``fast_path=True`` fails the test if the compiled path is not built.
    """
    if not extension_wanted():
        pytest.skip("PRAZO_NO_EXTENSIONS is set: there is no compiled WSGI path")
    return AdmissionMiddleware(app, fast_path=False, **options), AdmissionMiddleware(app, fast_path=True, **options)


def served_by_compiled_path(body):
    """Whether a response body came from the compiled path's own list wrapper."""
    return type(body).__module__ == "prazo.bindings._wsgi_c"


# -- which path runs -------------------------------------------------------------------


def test_the_compiled_path_is_the_default_on_the_c_twin():
    middleware = AdmissionMiddleware(Probe(), **PLAIN)
    assert middleware.fast_path is extension_wanted()
    assert AdmissionMiddleware(Probe(), fast_path=False, **PLAIN).fast_path is False


def test_the_python_twin_always_runs_the_python_path():
    class OnPythonTwin(AdmissionMiddleware):
        queue_class = PythonTwinQueue

    assert OnPythonTwin(Probe(), **PLAIN).fast_path is False
    with pytest.raises(ValueError, match="fast_path=True needs"):
        OnPythonTwin(Probe(), fast_path=True, **PLAIN)


@pytest.mark.parametrize("value", ["yes", 1, 0])
def test_fast_path_must_be_a_bool_or_none(value):
    with pytest.raises(TypeError, match="fast_path"):
        AdmissionMiddleware(Probe(), fast_path=value, **PLAIN)


def test_prazo_no_extensions_turns_the_compiled_path_off():
    script = (
        "import sys\n"
        "from prazo.bindings.wsgi import AdmissionMiddleware\n"
        "app = AdmissionMiddleware(lambda e, s: [], max_concurrency=1, max_queue=0)\n"
        "print(app.fast_path, 'prazo.bindings._wsgi_c' in sys.modules)\n"
        "try:\n"
        "    AdmissionMiddleware(lambda e, s: [], max_concurrency=1, max_queue=0, fast_path=True)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PRAZO_NO_EXTENSIONS": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    first, second = done.stdout.splitlines()
    assert first == "False False"
    assert "fast_path=True needs the compiled extension" in second


@pytest.mark.parametrize(
    ("extra", "path", "compiled"),
    [
        ({}, "/", True),
        ({BUDGET_ENVIRON_KEY: "250"}, "/", True),
        ({BUDGET_ENVIRON_KEY: " \t250 "}, "/", True),
        ({BUDGET_ENVIRON_KEY: "0000250"}, "/", True),
        ({BUDGET_ENVIRON_KEY: "99999999"}, "/", True),  # capped at max_budget_ms
        ({BUDGET_ENVIRON_KEY: "1250.5"}, "/", False),  # a fraction: left to the Python parser
        ({BUDGET_ENVIRON_KEY: "1e3"}, "/", False),
        ({BUDGET_ENVIRON_KEY: "junk"}, "/", False),
        ({BUDGET_ENVIRON_KEY: "1" * 14}, "/", False),  # longer than any value the wire allows
        ({BUDGET_ENVIRON_KEY: "0" * 11 + "2500"}, "/", False),  # valid, but left to the Python parser
        ({BUDGET_ENVIRON_KEY: "١٢٣"}, "/", False),
        ({BUDGET_ENVIRON_KEY: "250", GRPC_TIMEOUT_ENVIRON_KEY: "1S"}, "/", False),
        ({GRPC_TIMEOUT_ENVIRON_KEY: "1S"}, "/", False),
        ({ENVOY_TIMEOUT_ENVIRON_KEY: "100"}, "/", False),
        ({}, "/healthz", False),
    ],
)
def test_which_requests_the_compiled_path_serves(extra, path, compiled):
    python_path, compiled_path = middleware_pair(Probe(body_type=list), bypass={"/healthz"}, **PLAIN)
    environ = make_environ(path, **extra)
    body = compiled_path(environ, Server().start_response)
    assert served_by_compiled_path(body) is compiled
    assert isinstance(body, ListBody) is not compiled  # the Python path's list wrapper
    assert list(body) == [b"ok"]
    body.close()
    python_body = python_path(make_environ(path, **extra), Server().start_response)
    assert not served_by_compiled_path(python_body)
    python_body.close()


def test_a_body_that_runs_app_code_goes_to_the_python_wrapper():
    _, compiled_path = middleware_pair(Probe(chunks=[b"a", b"b"]), **PLAIN)
    body = compiled_path(make_environ(), Server().start_response)
    assert type(body).__name__ == "AdmittedResponse"
    assert list(body) == [b"a", b"b"]
    body.close()
    assert compiled_path.stats()["in_flight"] == 0


def test_an_environ_that_is_not_a_plain_dict_goes_to_the_python_path():
    class Environ(dict):
        pass

    probe = Probe(body_type=list)
    _, compiled_path = middleware_pair(probe, **PLAIN)
    server, body = call(compiled_path, Environ(make_environ()))
    assert (server.status, body) == ("200 OK", b"ok")
    assert probe.environ[BUDGET_SOURCE_KEY] is None
    assert compiled_path.stats()["completed"] == 1


# -- the same outcome on both paths ----------------------------------------------------


ACTION_KEY = "test.action"


def lockstep_app(environ, start_response):
    """Does what ``environ["test.action"]`` says; records the deadline current while it runs."""
    action = environ[ACTION_KEY]
    environ["test.deadline_in_call"] = current_deadline()
    write = start_response("200 OK", [("Content-Type", "text/plain")])
    if action == "raise-deadline":
        raise DeadlineExceeded("db-timeout")
    if action == "raise-overloaded":
        raise DownstreamOverloaded()
    if action == "raise-other":
        raise KeyError("boom")
    if action == "write":
        write(b"written ")
    if action == "tuple":
        return (b"t", b"uple")
    if action == "empty":
        return []
    if action == "generator":
        return iter([b"gen"])
    return [b"li", b"st"]


# A budget shorter than this may run out while a step is handled: its outcome is left out.
SHORTEST_COMPARED_NS = 100_000_000
SERVE_ACTIONS = ["list", "tuple", "empty", "write", "generator", "raise-deadline", "raise-overloaded", "raise-other"]
BUDGET_KEYS = [BUDGET_ENVIRON_KEY, GRPC_TIMEOUT_ENVIRON_KEY, ENVOY_TIMEOUT_ENVIRON_KEY]
HEADER_VALUE = (
    st.from_regex(r"\A[ \t]{0,2}[0-9]{1,15}[ \t]{0,2}\Z")
    | st.from_regex(r"\A-?[0-9]{1,6}(\.[0-9]{1,3})?[HMSmun]?\Z")
    | st.text(max_size=12)
)
STEP = st.one_of(
    st.tuples(st.just("serve"), st.sampled_from(SERVE_ACTIONS), st.sampled_from(["/", "/healthz"])),
    st.tuples(st.just("header"), st.sampled_from(BUDGET_KEYS), HEADER_VALUE),
    st.tuples(st.just("hold"), st.sampled_from(["list", "generator"]), st.just("/")),
    st.tuples(st.sampled_from(["close-held", "drop-held"]), st.just(""), st.just("")),
)


class Lockstep:
    """One middleware of a pair, with the bodies it was asked to hold open."""

    def __init__(self, middleware):
        self.middleware = middleware
        self.held = []

    def step(self, kind, first, second):
        """Run one step; return what a client or the server would observe (never a timing)."""
        if kind in ("close-held", "drop-held"):
            if not self.held:
                return None
            body = self.held.pop(0)
            if kind == "close-held" and hasattr(body, "close"):  # a refusal's body is a plain list
                body.close()
            del body
            gc.collect()
            return None
        action, path, extra = first, second, {}
        if kind == "header":
            action, path, extra = "list", "/", {first: second}
            budget_ns = self.middleware.policy.deadline_for({first: second}, 0)[0].ns
            if 0 < budget_ns < SHORTEST_COMPARED_NS:
                # Microseconds of budget ("7920n") may pass while a loaded machine handles the
                # step on one path and not on the other: that outcome is a timing, not a rule.
                return ("timing", first)
        environ = make_environ(path, **{ACTION_KEY: action, **extra})
        server = Server()
        before = time.monotonic_ns()
        if kind == "hold":
            body = self.middleware(environ, server.start_response)
            self.held.append(body)
            return ("held", server.statuses, server.headers, self.seen(environ, before))
        try:
            payload = server.run(self.middleware, environ)
        except KeyError as exc:  # what the "raise-other" app raises: it must propagate unchanged
            return ("raised", type(exc), exc.args, self.seen(environ, before))
        return ("served", server.statuses, server.headers, payload, self.seen(environ, before))

    def seen(self, environ, before):
        """The prazo environ keys as the app saw them, checked against the policy's own deadline."""
        after = time.monotonic_ns()
        keys = sorted(key for key in environ if key.startswith("prazo."))
        deadline = environ.get(DEADLINE_KEY)
        if deadline is not None:
            headers = {key: environ[key] for key in BUDGET_KEYS if key in environ}
            budget_ns = self.middleware.policy.deadline_for(headers, 0)[0].ns
            assert before + budget_ns <= deadline.ns <= after + budget_ns
            assert environ["test.deadline_in_call"] is deadline
            assert type(environ[QUEUE_WAIT_MS_KEY]) is float
        return keys, environ.get(BUDGET_SOURCE_KEY)


@settings(max_examples=examples(60), deadline=None)
@given(steps=st.lists(STEP, max_size=14))
def test_both_paths_answer_count_and_release_alike(steps):
    options = {"max_concurrency": 2, "max_queue": 0, "default_budget_ms": 800, "max_budget_ms": 5000}
    # Every close/drop step runs a full gc.collect(); frozen, the objects the session
    # built before this example (modules, Hypothesis' data) are not scanned by it, so a
    # collection costs this example's objects only (it took most of the test's 40 s in a
    # full run). Whatever this example creates is collected exactly as before.
    gc.freeze()
    try:
        pair = [Lockstep(middleware) for middleware in middleware_pair(lockstep_app, bypass={"/healthz"}, **options)]
        for kind, first, second in steps:
            python_side, compiled_side = (side.step(kind, first, second) for side in pair)
            assert python_side == compiled_side, (kind, first, second)
            assert pair[0].middleware.stats() == pair[1].middleware.stats()
        for side in pair:
            while side.held:
                side.step("close-held", "", "")
        assert pair[0].middleware.stats() == pair[1].middleware.stats()
        assert pair[1].middleware.stats()["in_flight"] == 0
    finally:
        gc.unfreeze()


@settings(max_examples=examples(200), deadline=None)
@given(value=HEADER_VALUE)
def test_a_budget_header_means_the_same_on_both_paths(value):
    probe = Probe(body_type=list)
    options = {"max_concurrency": 1, "max_queue": 0, "default_budget_ms": 300, "max_budget_ms": 4000}
    outcomes = []
    for middleware in middleware_pair(probe, **options):
        probe.environ = None
        environ = make_environ(**{BUDGET_ENVIRON_KEY: value})
        before = time.monotonic_ns()
        server, _ = call(middleware, environ)
        after = time.monotonic_ns()
        budget_ns = middleware.policy.deadline_for({BUDGET_ENVIRON_KEY: value}, 0)[0].ns
        if probe.environ is not None:
            assert before + budget_ns <= probe.environ[DEADLINE_KEY].ns <= after + budget_ns
        else:
            # A budget of a few ms may run out before admission on a loaded
            # machine; a 504 is right only once the budget has really passed.
            assert after - before >= budget_ns
            assert server.header.get(REASON_HEADER_NAME) == "expired-on-arrival"
        outcomes.append((budget_ns, environ[BUDGET_SOURCE_KEY]))
    # Both paths read the header the same way; the outcome follows from the
    # budget and the clock, checked for each path above.
    assert outcomes[0] == outcomes[1]


# -- the slot is released exactly once ---------------------------------------------------------

BODY_TYPES = pytest.mark.parametrize("body_type", [list, tuple], ids=["list", "tuple"])


def one_slot(fast_path, body_type, chunks=(b"a", b"b")):
    return AdmissionMiddleware(Probe(chunks=chunks, body_type=body_type), fast_path=fast_path, **PLAIN)


def assert_released_once(middleware, requests=1):
    stats = middleware.stats()
    assert (stats["in_flight"], stats["completed"], stats["started"]) == (0, requests, requests)
    # The one slot really is free: another request gets it.
    server, _ = call(middleware)
    assert server.status == "200 OK"


@BODY_TYPES
def test_released_at_exhaustion_then_close_does_nothing(fast_path, body_type):
    middleware = one_slot(fast_path, body_type)
    body = middleware(make_environ(), Server().start_response)
    iterator = iter(body)
    assert next(iterator) == b"a"
    assert middleware.stats()["in_flight"] == 1  # held while the body is pending
    assert list(iterator) == [b"b"]
    assert middleware.stats()["in_flight"] == 0  # at exhaustion, before close()
    assert list(iterator) == []
    body.close()
    body.close()
    assert_released_once(middleware)


@BODY_TYPES
@pytest.mark.parametrize("chunks_read", [0, 1], ids=["before-the-first-chunk", "in-the-middle"])
def test_released_by_close_before_the_end(fast_path, body_type, chunks_read):
    middleware = one_slot(fast_path, body_type)
    body = middleware(make_environ(), Server().start_response)
    iterator = iter(body)
    assert [next(iterator) for _ in range(chunks_read)] == [b"a"][:chunks_read]
    body.close()  # the client went away
    assert middleware.stats()["in_flight"] == 0
    assert list(iterator) == []
    body.close()
    assert_released_once(middleware)


@BODY_TYPES
@pytest.mark.parametrize("chunks_read", [0, 1])
def test_released_when_dropped_without_close(fast_path, body_type, chunks_read):
    middleware = one_slot(fast_path, body_type)
    # Several in a row: a body whose memory is reused must be finalised too.
    for _ in range(3):
        body = middleware(make_environ(), Server().start_response)
        for _ in range(chunks_read):
            next(iter(body))
        del body  # a server that forgets close()
        gc.collect()
        assert middleware.stats()["in_flight"] == 0
    assert_released_once(middleware, requests=3)


@BODY_TYPES
def test_released_when_dropped_inside_a_reference_cycle(fast_path, body_type):
    middleware = one_slot(fast_path, body_type)
    cycle = [middleware(make_environ(), Server().start_response)]
    cycle.append(cycle)
    del cycle
    gc.collect()
    assert_released_once(middleware)


def test_an_empty_list_body_is_released_at_the_first_next(fast_path):
    middleware = one_slot(fast_path, list, chunks=())
    body = middleware(make_environ(), Server().start_response)
    assert middleware.stats()["in_flight"] == 1
    assert list(body) == []
    assert middleware.stats()["in_flight"] == 0
    body.close()
    assert_released_once(middleware)


def test_close_racing_on_many_threads_releases_once(fast_path):
    middleware = one_slot(fast_path, list)
    body = middleware(make_environ(), Server().start_response)
    start = threading.Barrier(8)
    errors = []

    def close():
        start.wait(JOIN_TIMEOUT_S)
        try:
            body.close()
        except ValueError as exc:  # what the queue raises on a second release
            errors.append(exc)

    # Anything but the queue's ValueError fails the test in run_checked.
    run_checked([close] * 8)
    assert errors == []
    assert_released_once(middleware)


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (DeadlineExceeded("late"), "504 Gateway Timeout"),
        (DownstreamOverloaded(), "503 Service Unavailable"),
        (KeyError("boom"), None),
    ],
)
def test_an_app_that_raises_releases_once(fast_path, exc, status):
    probe = Probe(fail_in_call=exc, body_type=list)
    middleware = AdmissionMiddleware(probe, fast_path=fast_path, **PLAIN)
    server = Server()
    if status is None:
        with pytest.raises(KeyError) as raised:
            server.run(middleware, make_environ())
        assert raised.value is exc
    else:
        body = server.run(middleware, make_environ())
        assert server.statuses == ["200 OK", status]  # the refusal replaced the app's status
        assert body == f"{status}: {exc.reason}\n".encode()
    probe.fail_in_call = None
    assert_released_once(middleware)


# -- the deadline while the app runs -----------------------------------------------------------


@BODY_TYPES
def test_the_app_runs_in_a_copied_context_with_its_deadline(fast_path, body_type):
    variable = contextvars.ContextVar("test.left_by_the_app", default="untouched")

    def app(environ, start_response):
        environ["test.deadline_in_call"] = current_deadline()
        variable.set("set by the app")
        start_response("200 OK", [("Content-Type", "text/plain")])
        return body_type([b"ok"])

    middleware = AdmissionMiddleware(app, fast_path=fast_path, default_budget_ms=700, **PLAIN)
    environ = make_environ()
    before = time.monotonic_ns()
    server, body = call(validator(middleware), environ)
    after = time.monotonic_ns()
    assert (server.status, body) == ("200 OK", b"ok")
    deadline = environ[DEADLINE_KEY]
    assert type(deadline) is Deadline and environ["test.deadline_in_call"] is deadline
    assert before + 700_000_000 <= deadline.ns <= after + 700_000_000
    assert (environ[BUDGET_SOURCE_KEY], type(environ[QUEUE_WAIT_MS_KEY])) == (None, float)
    assert current_deadline() is None and variable.get() == "untouched"  # nothing leaks to the server


def test_an_integer_budget_header_sets_the_deadline_and_its_source(fast_path):
    probe = Probe(body_type=list)
    middleware = AdmissionMiddleware(probe, fast_path=fast_path, max_budget_ms=900, **PLAIN)
    for value, budget_ns in (("250", 250_000_000), ("\t40 ", 40_000_000), ("60000", 900_000_000)):
        before = time.monotonic_ns()
        call(middleware, make_environ(**{BUDGET_ENVIRON_KEY: value}))
        after = time.monotonic_ns()
        assert before + budget_ns <= probe.environ[DEADLINE_KEY].ns <= after + budget_ns
        assert probe.deadline_in_call is probe.environ[DEADLINE_KEY]
        assert probe.environ[BUDGET_SOURCE_KEY] == BUDGET_HEADER
    server, _ = call(middleware, make_environ(**{BUDGET_ENVIRON_KEY: "0"}))
    assert (server.status, server.header[REASON_HEADER_NAME]) == ("504 Gateway Timeout", "expired-on-arrival")
    assert probe.calls == 3


@pytest.mark.parametrize(("outer_s", "outer_wins"), [(0.5, True), (300.0, False)])
def test_an_outer_deadline_wins_only_when_earlier(fast_path, outer_s, outer_wins):
    probe = Probe(body_type=list)
    middleware = AdmissionMiddleware(probe, fast_path=fast_path, default_budget_ms=5000, **PLAIN)
    outer = Deadline.after(outer_s)
    with deadline_scope(outer):
        call(middleware)
        assert current_deadline() is outer
    assert (probe.environ[DEADLINE_KEY] is outer) is outer_wins
    assert probe.deadline_in_call is probe.environ[DEADLINE_KEY]


# -- real threads --------------------------------------------------------------------------------


def test_many_threads_leave_every_slot_released_and_every_request_answered(fast_path):
    middleware = AdmissionMiddleware(
        Probe(chunks=[b"x"], body_type=list), fast_path=fast_path, max_concurrency=2, max_queue=2
    )
    statuses = []

    def client():
        for index in range(150):
            server = Server()
            body = middleware(make_environ(), server.start_response)
            if index % 3 == 0:
                del body  # dropped without close
            else:
                list(body)
                body.close()
            statuses.append(server.status)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    gc.collect()
    stats = middleware.stats()
    assert len(statuses) == stats["offered"] == 600
    assert stats["in_flight"] == stats["queued"] == 0
    assert stats["started"] == stats["completed"] == statuses.count("200 OK")
    assert stats["offered"] == stats["started"] + stats["rejected_full"] + stats["expired"]
    assert stats["responses_503"] + stats["responses_504"] == stats["rejected_full"] + stats["expired"]


# -- opt-in latency recording -------------------------------------------------------------------


@pytest.mark.parametrize("body_type", [list, tuple, None], ids=["list", "tuple", "generator"])
def test_record_latency_records_each_admitted_request_once_at_its_release(fast_path, body_type):
    """Both histograms see every admitted request (refusals never), the duration ending at the release."""
    middleware = AdmissionMiddleware(
        Probe(chunks=(b"a", b"b"), body_type=body_type), fast_path=fast_path, record_latency=True, **PLAIN
    )
    duration, wait = middleware.request_duration, middleware.queue_wait
    assert duration is not None and wait is not None
    body = middleware(make_environ(), Server().start_response)
    assert (duration.count, wait.count) == (0, 1)  # waited (not at all) on admission; still running
    refused = Server()
    refused.run(middleware, make_environ())  # the one slot is busy: 503, in neither histogram
    assert refused.statuses == ["503 Service Unavailable"]
    iterator = iter(body)  # held, as a server does: a generator body releases when its iterator ends
    assert next(iterator) == b"a"
    time.sleep(0.02)
    body.close()  # the release: the duration ends here
    assert (duration.count, wait.count) == (1, 1)
    assert duration.min_ns is not None and duration.min_ns >= 20_000_000
    body = middleware(make_environ(), Server().start_response)
    assert list(body) == [b"a", b"b"]  # released at exhaustion
    body = middleware(make_environ(), Server().start_response)
    iterator = iter(body)
    assert next(iterator) == b"a"
    del body, iterator  # released when dropped without close()
    gc.collect()
    assert (duration.count, wait.count) == (3, 3)
    assert_released_once(middleware, requests=3)


@pytest.mark.parametrize("exc", [DeadlineExceeded("late"), KeyError("boom")], ids=["refusal", "error"])
def test_record_latency_counts_an_app_that_raises(fast_path, exc):
    middleware = AdmissionMiddleware(Probe(fail_in_call=exc), fast_path=fast_path, record_latency=True, **PLAIN)
    try:
        call(middleware)
    except KeyError:
        pass
    assert middleware.request_duration is not None and middleware.request_duration.count == 1
    assert middleware.stats()["in_flight"] == 0


def test_record_latency_is_off_by_default_and_must_be_a_bool(fast_path):
    middleware = AdmissionMiddleware(Probe(), fast_path=fast_path, **PLAIN)
    assert middleware.request_duration is None and middleware.queue_wait is None
    with pytest.raises(TypeError):
        AdmissionMiddleware(Probe(), fast_path=fast_path, record_latency=1, **PLAIN)
