"""The queue policies (docs/design.md) through the bindings: middleware (both paths), pool, settings, CLI, servers.

The policies themselves are the core's (tested in the queue suites); these
tests check that every binding passes them through, answers each new refusal
with its status and reason, feeds the queue service-time samples, and
classifies critical requests — with werkzeug's test client and real servers
on loopback, generous margins, and no assertion on speed.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import wait_until
from _server_harness import CLIENT_TIMEOUT_S, SERVER_KINDS, TESTS_DIR, Burst, Outcome, request, start_server
from prazo.bindings.policies import CriticalClassifier, parse_expected_service_ms
from prazo.bindings.pool import AdmissionPool
from prazo.bindings.servers.plumbing.heads import head_path
from prazo.bindings.servers.serve import main_serve
from prazo.bindings.servers.settings import ServerSettings, resolve_settings
from prazo.bindings.wsgi import AdmissionMiddleware
from prazo.core import Deadline, DeadlineExceeded, QueueFull, extension_wanted
from werkzeug.test import Client

WAIT_S = 20.0


@pytest.fixture(params=[False, True], ids=["python-path", "compiled-path"])
def fast_path(request: pytest.FixtureRequest) -> bool:
    """The middleware's Python path, then its compiled one (required unless PRAZO_NO_EXTENSIONS=1)."""
    if request.param and not extension_wanted():
        pytest.skip("PRAZO_NO_EXTENSIONS is set: there is no compiled WSGI path")
    return bool(request.param)


class GatedApp:
    """A WSGI app whose ``/gated`` requests wait until ``release()``; ``/sleep?ms=M`` sleeps; the rest answer at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ["PATH_INFO"]
        with self._lock:
            self.calls.append(path)
        if path == "/gated":
            assert self.gate.wait(WAIT_S)
        elif path == "/sleep":
            time.sleep(int(environ["QUERY_STRING"].partition("=")[2]) / 1000)
        start_response("200 OK", [("Content-Type", "text/plain")])
        if path == "/stream":
            return (chunk for chunk in (b"o", b"k"))
        return [b"ok"]

    def release(self) -> None:
        self.gate.set()


def client(app: Any) -> Client:
    """werkzeug's test client, reading each body to its end (so the slot is back when the call returns)."""

    class Buffered(Client):
        def open(self, *args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("buffered", True)
            return super().open(*args, **kwargs)

    return Buffered(app)


class InBackground:
    """One request through werkzeug's test client, in its own thread."""

    def __init__(self, app: Any, path: str, headers: dict[str, str] | None = None) -> None:
        self.response: Any = None
        self._thread = threading.Thread(target=self._run, args=(app, path, headers or {}), daemon=True)
        self._thread.start()

    def _run(self, app: Any, path: str, headers: dict[str, str]) -> None:
        self.response = client(app).get(path, headers=headers)

    def join(self) -> Any:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive()
        return self.response


def answer(response: Any) -> tuple[int, str | None]:
    return response.status_code, response.headers.get("X-Prazo-Reason")


def no_slot_held(mw: AdmissionMiddleware) -> None:
    wait_until(lambda: mw.stats()["in_flight"] == 0, "every slot released")


# -- the middleware, on both paths ---------------------------------------------------


def test_middleware_passes_the_queue_options_through(fast_path: bool) -> None:
    mw = AdmissionMiddleware(
        GatedApp(),
        max_concurrency=4,
        max_queue=8,
        order="adaptive",
        codel_target_ms=10,
        codel_interval_ms=200,
        expected_service_ms="p90",
        fast_path=fast_path,
    )
    q = mw.queue
    assert (q.order, q.codel_target_ms, q.codel_interval_ms, q.expected_service_ms) == ("adaptive", 10, 200, "p90")
    assert mw.fast_path is fast_path


def test_middleware_passes_limit_min_concurrency_and_reserved_through(fast_path: bool) -> None:
    mw = AdmissionMiddleware(
        GatedApp(), max_concurrency=4, max_queue=8, limit="vegas", min_concurrency=2, reserved=1, fast_path=fast_path
    )
    assert mw.queue.reserved == 1 and 2 <= mw.queue.limit <= 4


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        ({"order": "random"}, ValueError, "order"),
        ({"codel_target_ms": 5.5}, ValueError, "codel_target_ms"),  # only with order="adaptive"
        ({"expected_service_ms": "p42"}, ValueError, "expected_service_ms"),
        ({"expected_service_ms": -1}, ValueError, "expected_service_ms"),
        ({"critical": 42}, TypeError, "critical"),
        ({"critical": "X_Priority"}, ValueError, "critical"),
    ],
)
def test_middleware_bad_policy_options_raise_naming_them(options: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        AdmissionMiddleware(GatedApp(), max_concurrency=2, max_queue=2, **options)


@pytest.mark.parametrize("path", ["/", "/stream"])
def test_expected_service_ms_refuses_a_budget_below_it_without_the_app(fast_path: bool, path: str) -> None:
    app = GatedApp()
    mw = AdmissionMiddleware(app, max_concurrency=2, max_queue=2, expected_service_ms=500, fast_path=fast_path)
    browser = client(mw)
    refused = browser.get(path, headers={"X-Request-Budget-Ms": "100"})
    assert answer(refused) == (504, "insufficient-budget")
    assert refused.headers["Cache-Control"] == "no-store" and "Retry-After" not in refused.headers
    assert app.calls == []
    served = browser.get(path, headers={"X-Request-Budget-Ms": "5000"})
    assert served.status_code == 200 and served.get_data() == b"ok"
    stats = mw.stats()
    assert stats["insufficient_budget"] == 1 and stats["responses_504"] == 1
    no_slot_held(mw)


def test_learned_expected_service_time_comes_from_the_requests_served(fast_path: bool) -> None:
    """Every release carries its start time: list bodies and streamed ones alike teach the queue its p50."""
    app = GatedApp()
    mw = AdmissionMiddleware(app, max_concurrency=2, max_queue=4, expected_service_ms="p50", fast_path=fast_path)
    browser = client(mw)
    assert mw.queue.expected_service_ns == 0  # nothing learned yet: no skip
    for number in range(40):
        path = "/sleep?ms=20" if number % 2 else "/stream"
        assert browser.get(path).status_code == 200
    learned = mw.queue.expected_service_ns
    # Half the requests slept 20 ms: the median service time is no less than the quick ones' and
    # no more than a sleeper's, however loaded the machine.
    assert learned > 0
    # A budget below half the estimate is refused and never started (0 ms: expired on arrival).
    calls = len(app.calls)
    budget = f"{max(learned // 2_000_000 - 1, 0)}"
    refused = browser.get("/", headers={"X-Request-Budget-Ms": budget})
    assert answer(refused)[0] == 504
    assert answer(refused)[1] in ("insufficient-budget", "expired-on-arrival")
    assert len(app.calls) == calls
    no_slot_held(mw)


def test_adaptive_order_sheds_a_stale_waiter_with_503(fast_path: bool) -> None:
    app = GatedApp()
    mw = AdmissionMiddleware(
        app,
        max_concurrency=1,
        max_queue=2,
        order="adaptive",
        codel_interval_ms=50,
        default_budget_ms=30000,
        fast_path=fast_path,
    )
    running = InBackground(mw, "/gated")
    wait_until(lambda: mw.stats()["in_flight"] == 1, "the first request running")
    waiting = InBackground(mw, "/")
    wait_until(lambda: mw.stats()["queued"] == 1, "the second request waiting")
    time.sleep(0.3)  # far beyond the 50 ms CoDel allows a waiter, however slow the machine
    app.release()
    assert running.join().status_code == 200
    shed = waiting.join()
    assert answer(shed) == (503, "shed-standing-queue")
    assert shed.headers["Retry-After"] == "1"
    assert mw.stats()["shed"] == 1 and mw.stats()["responses_503"] == 1
    assert app.calls == ["/gated"]
    no_slot_held(mw)


@pytest.mark.parametrize(
    "critical",
    [
        pytest.param("X-Priority", id="header"),
        pytest.param(lambda environ: environ.get("HTTP_X_PRIORITY") == "critical", id="callable"),
    ],
)
def test_a_critical_request_evicts_the_newest_normal_waiter_and_runs_first(fast_path: bool, critical: Any) -> None:
    app = GatedApp()
    mw = AdmissionMiddleware(
        app, max_concurrency=1, max_queue=1, critical=critical, default_budget_ms=30000, fast_path=fast_path
    )
    running = InBackground(mw, "/gated")
    wait_until(lambda: mw.stats()["in_flight"] == 1, "the first request running")
    waiting = InBackground(mw, "/")
    wait_until(lambda: mw.stats()["queued"] == 1, "a normal request waiting")
    assert answer(client(mw).get("/")) == (503, "queue-full")  # the line is full for normal requests
    urgent = InBackground(mw, "/urgent", {"X-Priority": "critical"})
    assert answer(waiting.join()) == (503, "evicted-by-critical")
    app.release()
    assert running.join().status_code == 200
    assert urgent.join().status_code == 200
    assert app.calls == ["/gated", "/urgent"]
    stats = mw.stats()
    assert stats["evicted"] == 1 and stats["critical_started"] == 1
    no_slot_held(mw)


def test_the_critical_header_is_case_insensitive_and_other_values_are_normal(fast_path: bool) -> None:
    classify = AdmissionMiddleware(GatedApp(), max_concurrency=1, max_queue=1, critical="X-Priority").critical
    assert classify is not None
    assert classify({"HTTP_X_PRIORITY": "CRITICAL"}) and classify({"HTTP_X_PRIORITY": " Critical "})
    assert not classify({"HTTP_X_PRIORITY": "critical-ish"}) and not classify({})
    mw = AdmissionMiddleware(GatedApp(), max_concurrency=1, max_queue=1, critical="X-Priority", fast_path=fast_path)
    assert client(mw).get("/", headers={"X-Priority": "high"}).status_code == 200
    assert mw.stats()["started"] == 1


def test_a_raising_classifier_makes_the_request_normal_logs_and_leaks_nothing(
    fast_path: bool, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(environ: dict[str, Any]) -> bool:
        raise RuntimeError("classifier bug")

    mw = AdmissionMiddleware(GatedApp(), max_concurrency=1, max_queue=1, critical=broken, fast_path=fast_path)
    browser = client(mw)
    with caplog.at_level(logging.ERROR, logger="prazo.policies"):
        responses = [browser.get(path) for path in ("/", "/stream", "/")]
    assert [response.status_code for response in responses] == [200, 200, 200]
    assert [response.get_data() for response in responses] == [b"ok"] * 3
    assert sum("classifier bug" in record.getMessage() or record.exc_info is not None for record in caplog.records) == 3
    stats = mw.stats()
    assert stats["started"] == stats["completed"] == 3 and stats["in_flight"] == 0


def test_refusals_through_werkzeugs_test_client_are_answered_not_reraised(fast_path: bool) -> None:
    """PEP 3333: exc_info only when the app had started a response; werkzeug re-raises any exc_info it gets."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ["PATH_INFO"] == "/in-body":

            def body() -> Iterator[bytes]:
                raise DeadlineExceeded("downstream-timeout")
                yield b""  # pragma: no cover - makes this a generator

            return body()
        raise DeadlineExceeded("downstream-timeout")

    mw = AdmissionMiddleware(app, max_concurrency=1, max_queue=1, fast_path=fast_path)
    browser = client(mw)
    for path in ("/", "/in-body"):
        response = browser.get(path)
        assert answer(response) == (504, "downstream-timeout"), path
    assert mw.stats()["app_deadline_exceeded"] == 2
    no_slot_held(mw)


def test_an_app_that_started_its_response_still_gets_exc_info() -> None:
    """The other half of the rule: headers already set are replaced only through exc_info."""
    calls: list[tuple[str, bool]] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        if calls and exc_info is None:
            raise AssertionError("start_response called a second time without exc_info")
        calls.append((status, exc_info is not None))
        return lambda data: None

    def app(environ: dict[str, Any], sr: Callable[..., Any]) -> Any:
        sr("200 OK", [("Content-Type", "text/plain")])
        raise DeadlineExceeded("late")

    mw = AdmissionMiddleware(app, max_concurrency=1, max_queue=1)
    environ = {"PATH_INFO": "/", "REQUEST_METHOD": "GET"}
    body = b"".join(mw(environ, start_response))
    assert calls == [("200 OK", False), ("504 Gateway Timeout", True)]
    assert body == b"504 Gateway Timeout: late\n"


# -- the pool ------------------------------------------------------------------------


def test_pool_fails_a_future_whose_budget_is_below_the_expected_service_time() -> None:
    ran: list[int] = []
    with AdmissionPool(1, 4, expected_service_ms=200) as pool:
        future = pool.submit_until(Deadline.after(0.1), ran.append, 1)
        with pytest.raises(DeadlineExceeded) as info:
            future.result(WAIT_S)
        assert info.value.reason == "insufficient-budget"
        assert pool.submit_until(Deadline.after(30), ran.append, 2).result(WAIT_S) is None
    assert ran == [2]


def test_pool_drops_a_waiting_item_at_its_effective_deadline_with_the_queues_error() -> None:
    gate = threading.Event()
    ran: list[str] = []
    with AdmissionPool(1, 4, expected_service_ms=300) as pool:
        blocker = pool.submit_until(None, gate.wait, WAIT_S)
        wait_until(lambda: pool.stats()["started"] == 1, "the worker busy")
        # 0.5 s left, 0.3 s expected: doomed from 0.2 s on, answered by the reaper
        # then (at the deadline itself the reason would be expired-in-queue).
        doomed = pool.submit_until(Deadline.after(0.5), ran.append, "doomed")
        with pytest.raises(DeadlineExceeded) as info:
            doomed.result(WAIT_S)
        assert info.value.reason == "insufficient-budget"
        gate.set()
        assert blocker.result(WAIT_S) is True
    assert ran == []
    assert pool.stats()["insufficient_budget"] == 1


def test_pool_sheds_with_queue_full_under_adaptive_order() -> None:
    gate = threading.Event()
    with AdmissionPool(1, 4, order="adaptive", codel_interval_ms=50) as pool:
        blocker = pool.submit_until(None, gate.wait, WAIT_S)
        wait_until(lambda: pool.stats()["started"] == 1, "the worker busy")
        stale = pool.submit_until(None, lambda: "ran")
        time.sleep(0.3)  # far beyond what CoDel lets it wait
        gate.set()
        assert blocker.result(WAIT_S) is True
        with pytest.raises(QueueFull) as info:
            stale.result(WAIT_S)
        assert info.value.reason == "shed-standing-queue"


def test_pool_tasks_are_service_time_samples() -> None:
    with AdmissionPool(2, 64, expected_service_ms="p50") as pool:
        for future in [pool.submit_until(None, time.sleep, 0.005) for _ in range(40)]:
            future.result(WAIT_S)
        assert pool.stats()["expected_service_ns"] > 0


def test_pool_bad_policy_options_raise_naming_them() -> None:
    with pytest.raises(ValueError, match="expected_service_ms"):
        AdmissionPool(1, 1, expected_service_ms="p7")
    with pytest.raises(ValueError, match="codel_interval_ms"):
        AdmissionPool(1, 1, codel_interval_ms=20)


# -- settings, environment, command line ---------------------------------------------


def test_resolve_settings_reads_every_policy_variable() -> None:
    settings = resolve_settings(
        threads=4,
        environ={
            "PRAZO_ORDER": "Adaptive",
            "PRAZO_CODEL_TARGET_MS": "10",
            "PRAZO_CODEL_INTERVAL_MS": "250",
            "PRAZO_EXPECTED_SERVICE_MS": "p95",
            "PRAZO_LIMIT": "vegas",
            "PRAZO_MIN_CONCURRENCY": "2",
            "PRAZO_RESERVED": "1",
            "PRAZO_CRITICAL_HEADER": "X-Priority",
            "PRAZO_CRITICAL_PATHS": "/healthz, /readyz",
        },
    )
    assert settings.queue_options() == {
        "order": "adaptive",
        "codel_target_ms": 10.0,
        "codel_interval_ms": 250.0,
        "expected_service_ms": "p95",
        "limit": "vegas",
        "min_concurrency": 2,
        "reserved": 1,
    }
    assert settings.critical_paths == ("/healthz", "/readyz") and settings.critical_header == "X-Priority"
    classify = settings.classifier()
    assert classify is not None and classify({"PATH_INFO": "/readyz"}) and not classify({"PATH_INFO": "/"})
    line = settings.describe()
    for part in ("order=adaptive", "codel_target_ms=10", "expected_service_ms=p95", "limit=vegas", "reserved=1"):
        assert part in line
    assert "critical_paths=/healthz,/readyz" in line and "critical_header=X-Priority" in line
    # Arguments win over the environment; defaults say nothing.
    plain = resolve_settings(threads=2, order="lifo", environ={"PRAZO_ORDER": "adaptive"})
    assert plain.queue_options() == {"order": "lifo"} and plain.classifier() is None
    assert "order=lifo" in plain.describe() and "reserved" not in plain.describe()


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PRAZO_ORDER": "random"}, "PRAZO_ORDER must be one of fifo, lifo, adaptive"),
        ({"PRAZO_LIMIT": "aimd"}, "PRAZO_LIMIT must be one of fixed, vegas"),
        ({"PRAZO_EXPECTED_SERVICE_MS": "p42"}, "PRAZO_EXPECTED_SERVICE_MS must be a number"),
        ({"PRAZO_CODEL_TARGET_MS": "0"}, "PRAZO_CODEL_TARGET_MS must be > 0, got 0.0"),
        ({"PRAZO_RESERVED": "many"}, "PRAZO_RESERVED must be an integer"),
        ({"PRAZO_MIN_CONCURRENCY": "0"}, "PRAZO_MIN_CONCURRENCY must be >= 1, got 0"),
        ({"PRAZO_CRITICAL_HEADER": "X_Priority"}, "PRAZO_CRITICAL_HEADER must be an HTTP header name"),
        ({"PRAZO_CRITICAL_PATHS": "healthz"}, "PRAZO_CRITICAL_PATHS paths must start with '/'"),
        ({"PRAZO_RESERVED": "4"}, "reserved (--reserved, $PRAZO_RESERVED) must be < threads (4)"),
        ({"PRAZO_CODEL_TARGET_MS": "7", "PRAZO_ORDER": "adaptive", "PRAZO_CODEL_INTERVAL_MS": "x"}, "PRAZO_CODEL_INT"),
    ],
)
def test_malformed_policy_variables_raise_naming_them(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_settings(threads=4, environ=environ)
    assert message in str(info.value)


@pytest.mark.parametrize("order", [None, "fifo", "lifo"])
def test_codel_variables_without_adaptive_order_are_ignored_with_a_warning(
    order: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """One environment file shared by services with and without adaptive order must start them all."""
    environ = {"PRAZO_CODEL_TARGET_MS": "7", "PRAZO_CODEL_INTERVAL_MS": "250"}
    if order is not None:
        environ["PRAZO_ORDER"] = order
    with caplog.at_level(logging.WARNING, logger="prazo.settings"):
        settings = resolve_settings(threads=4, environ=environ)
    defaults = ServerSettings(threads=4, max_queue=16)
    assert (settings.codel_target_ms, settings.codel_interval_ms) == (
        defaults.codel_target_ms,
        defaults.codel_interval_ms,
    )
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "PRAZO_CODEL_TARGET_MS=7 ignored" in warned and "PRAZO_CODEL_INTERVAL_MS=250 ignored" in warned
    # With adaptive order the same variables apply, and flags stay strict without it.
    adaptive = resolve_settings(threads=4, environ={**environ, "PRAZO_ORDER": "adaptive"})
    assert (adaptive.codel_target_ms, adaptive.codel_interval_ms) == (7.0, 250.0)
    with pytest.raises(ValueError, match="only applies with order 'adaptive'"):
        resolve_settings(threads=4, codel_target_ms=7, environ={})


def test_server_settings_check_the_policy_fields() -> None:
    with pytest.raises(ValueError, match=re.escape("min_concurrency (--min-concurrency, $PRAZO_MIN_CONCURRENCY)")):
        ServerSettings(threads=2, max_queue=1, min_concurrency=3)
    with pytest.raises(TypeError, match="critical_paths"):
        ServerSettings(threads=2, max_queue=1, critical_paths=["/healthz"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="order"):
        ServerSettings(threads=2, max_queue=1, order=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        resolve_settings(settings=ServerSettings(threads=2, max_queue=1), order="lifo")


def test_expected_service_ms_is_a_number_or_a_quantile() -> None:
    assert parse_expected_service_ms(" P99 ", "x") == "p99"
    assert parse_expected_service_ms("12.5", "x") == 12.5
    for bad in ("p100", "inf", "-3", "soon"):
        with pytest.raises(ValueError, match="--flag"):
            parse_expected_service_ms(bad, "--flag")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--order", "random"], "--order: invalid choice"),
        (["--limit", "aimd"], "--limit: invalid choice"),
        (["--expected-service-ms", "p42"], "--expected-service-ms must be a number of milliseconds > 0 or one of"),
        (["--codel-target-ms", "-1"], "--codel-target-ms must be > 0, got -1.0"),
        (["--codel-interval-ms", "nan"], "--codel-interval-ms must not be NaN"),
        (["--min-concurrency", "0"], "--min-concurrency must be >= 1"),
        (["--reserved", "-1"], "--reserved must be >= 0"),
        (["--reserved", "2", "--threads", "2"], "reserved (--reserved, $PRAZO_RESERVED) must be < threads (2)"),
        (["--min-concurrency", "3", "--threads", "2"], "(--min-concurrency, $PRAZO_MIN_CONCURRENCY) must be <="),
        (["--codel-target-ms", "7"], "(--codel-target-ms, $PRAZO_CODEL_TARGET_MS) only applies with order"),
        (["--critical-header", "X_Priority"], "--critical-header must be an HTTP header name"),
        (["--critical-path", "/healthz", "--critical-path", "readyz"], "--critical-path paths must start with '/'"),
    ],
)
def test_bad_policy_flags_exit_2_naming_the_flag(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(TESTS_DIR)
    for name in [name for name in os.environ if name.startswith("PRAZO_") and name != "PRAZO_NO_EXTENSIONS"]:
        monkeypatch.delenv(name)
    try:
        status = main_serve(["_server_harness:app", *options])
    except SystemExit as exc:  # argparse's own refusals (choices)
        status = exc.code
    assert status == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("head", "path"),
    [
        (b"GET /healthz?full=1 HTTP/1.1\r\nHost: x\r\n", "/healthz"),
        (b"GET http://example.com:8080/a%20b HTTP/1.1\r\n", "/a b"),
        (b"GET http://example.com HTTP/1.1\r\n", "/"),
        (b"OPTIONS * HTTP/1.1\r\n", None),
        (b"garbage\r\n", None),
    ],
)
def test_head_path_is_the_path_info_a_server_would_give(head: bytes, path: str | None) -> None:
    assert head_path(head) == path


def test_classifier_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="paths"):
        CriticalClassifier(paths="/healthz")
    with pytest.raises(ValueError, match="paths"):
        CriticalClassifier(paths=["healthz"])
    with pytest.raises(TypeError, match="function"):
        CriticalClassifier(function=3)  # type: ignore[arg-type]
    assert CriticalClassifier.from_option(None) is None


# -- real servers under `prazo serve` ------------------------------------------------

_SERVE = (sys.executable, "-m", "prazo.bindings.servers.serve")


def _first_answer(port: int, process: subprocess.Popen[str]) -> None:
    end = time.monotonic() + CLIENT_TIMEOUT_S
    while True:  # gunicorn's worker boots after the line is printed
        try:
            assert request(port, "/healthz").status == 200
            return
        except OSError:
            assert time.monotonic() < end and process.poll() is None, "the server never answered"
            time.sleep(0.05)


@pytest.mark.parametrize("kind", ["waitress", "gunicorn"])
def test_a_critical_path_answers_200_while_the_normal_line_is_full(
    kind: str, processes: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    # CoDel's thresholds are set far beyond the test's pauses: the waiters
    # here must be evicted by the critical arrival, not shed for their age.
    command = [
        *_SERVE, "_server_harness:app", "--server", kind, "--port", "0",
        "--threads", "2", "--max-queue", "2", "--default-budget-ms", "30000", "--shutdown-timeout", "10",
        "--order", "adaptive", "--codel-target-ms", "60000", "--codel-interval-ms", "120000",
        "--reserved", "1", "--critical-path", "/healthz",
    ]  # fmt: skip
    env = {name: value for name, value in os.environ.items() if not name.startswith("PRAZO_")}
    if "PRAZO_NO_EXTENSIONS" in os.environ:
        env["PRAZO_NO_EXTENSIONS"] = os.environ["PRAZO_NO_EXTENSIONS"]
    process = subprocess.Popen(
        command, cwd=TESTS_DIR, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    processes.append(process)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert "order=adaptive" in line and "reserved=1" in line and "critical_paths=/healthz" in line, line
    match = re.search(r"http://127\.0\.0\.1:(\d+) ", line)
    assert match, line
    port = int(match.group(1))
    _first_answer(port, process)
    time.sleep(0.5)  # the probe's slot is back (gunicorn's queue is in another process: a generous pause)

    gate = tmp_path / "gate"
    marks = [tmp_path / f"running-{number}" for number in range(2)]
    # While no critical request is about, normal ones borrow the reserved thread: both run.
    running = Burst(port, [f"/work?mark={mark}&gate={gate}" for mark in marks])
    wait_until(lambda: all(mark.exists() for mark in marks), "both threads busy", CLIENT_TIMEOUT_S)
    waiting = Burst(port, [f"/work?gate={gate}"] * 2)
    time.sleep(1.0)  # generous: two loopback requests reach the line in milliseconds
    full: Outcome = request(port, "/work")
    assert (full.status, full.reason) == (503, "queue-full")

    health = Burst(port, ["/healthz"])
    evicted = waiting.wait(1)
    assert [(outcome.status, outcome.reason) for outcome in evicted] == [(503, "evicted-by-critical")]
    gate.touch()
    healthz = health.join()
    assert [(outcome.status, outcome.body) for outcome in healthz] == [(200, b"ok")]
    assert sorted(outcome.status for outcome in running.join()) == [200, 200]
    assert sorted(outcome.status for outcome in waiting.join()) == [200, 503]

    process.send_signal(signal.SIGTERM)
    assert process.wait(CLIENT_TIMEOUT_S) == 0


# -- every embedding: the queue's drops answered with their reason -------------------


@pytest.fixture
def running() -> Iterator[list[Any]]:
    servers: list[Any] = []
    yield servers
    for server in servers:
        if not server.stopped:
            server.stop()


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_every_embedding_answers_the_doomed_skip_with_504_insufficient_budget(
    kind: str, running: list[Any], tmp_path: Path
) -> None:
    server = start_server(kind, threads=1, max_queue=2, default_budget_ms=30000, policies={"expected_service_ms": 1000})
    running.append(server)
    calls = server.calls()  # the app's counter is shared by every server in this process
    # On arrival: 300 ms left, 1000 ms expected.
    doomed = request(server.port, "/work", {"X-Request-Budget-Ms": "300"})
    assert (doomed.status, doomed.reason) == (504, "insufficient-budget")
    # While waiting: 1500 ms left on arrival, doomed 500 ms later, while the only thread is busy.
    gate, mark = tmp_path / "gate", tmp_path / "running"
    busy = Burst(server.port, [f"/work?mark={mark}&gate={gate}"])
    wait_until(mark.exists, "the thread busy", CLIENT_TIMEOUT_S)
    waiter = request(server.port, "/work", {"X-Request-Budget-Ms": "1500"})
    assert (waiter.status, waiter.reason) == (504, "insufficient-budget")
    gate.touch()
    assert [outcome.status for outcome in busy.join()] == [200]
    assert server.calls() == calls + 1  # only the gated request ran the app
    if server.stats is not None:
        assert server.stats()["insufficient_budget"] == 2 and server.stats()["responses_504"] == 2


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_every_embedding_answers_a_shed_waiter_with_503_shed_standing_queue(
    kind: str, running: list[Any], tmp_path: Path
) -> None:
    server = start_server(
        kind, threads=1, max_queue=2, default_budget_ms=30000, policies={"order": "adaptive", "codel_interval_ms": 50}
    )
    running.append(server)
    gate, mark = tmp_path / "gate", tmp_path / "running"
    busy = Burst(server.port, [f"/work?mark={mark}&gate={gate}"])
    wait_until(mark.exists, "the thread busy", CLIENT_TIMEOUT_S)
    stale = Burst(server.port, ["/work"])
    server.wait_offered(2)  # the busy one and the stale one (gunicorn: a generous pause)
    time.sleep(0.5)  # ten times what CoDel lets it wait, on any machine
    gate.touch()
    assert [outcome.status for outcome in busy.join()] == [200]
    assert [(outcome.status, outcome.reason) for outcome in stale.join()] == [(503, "shed-standing-queue")]
