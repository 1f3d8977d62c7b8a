"""Django: ``DeadlineMiddleware`` in the example project, in process and served by ``prazo serve``.

The in-process tests drive ``examples/django_project`` (SQLite in a temporary
file) through Django's own test client; the served tests run the project as
a deployment would, ``prazo serve seedsite.wsgi:application`` in a
subprocess, with the seed article's scenario (40 arrivals, 4 threads, a
queue of 20, 300 ms of work) on SQLite and on the real PostgreSQL server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import examples
from _required import require
from _server_harness import CLIENT_TIMEOUT_S, Burst, request, statuses
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.headers import BudgetPolicy, budget_from_headers
from prazo.bindings.wsgi import rejection_response
from prazo.core import Deadline, DeadlineExceeded, DownstreamOverloaded, QueueFull, deadline_scope

require("django")

PROJECT_DIR = Path(__file__).resolve().parents[3] / "examples" / "django_project"
DEFAULT_BUDGET_MS = 1000  # the example's PRAZO_DEFAULT_BUDGET_MS
ARRIVALS, THREADS, MAX_QUEUE, WORK_MS = 40, 4, 20, 300
REFUSED_AT_ONCE = ARRIVALS - THREADS - MAX_QUEUE
# Generous for a loaded 2-core machine; the real figure is printed (-s) and reported in NOTES.
SLOW_QUERY_BOUND_S = 1.5


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Django's test client on the example project, SQLite in a fresh file."""
    os.environ["SEEDSITE_SQLITE_PATH"] = str(tmp_path_factory.mktemp("django") / "db.sqlite3")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "seedsite.settings")
    sys.path.insert(0, str(PROJECT_DIR))
    import django
    from django.core.management import call_command
    from django.test import Client

    django.setup()
    call_command("migrate", verbosity=0)
    return Client()


def hits(client: Any) -> int:
    return int(client.get("/hits").json()["hits"])


def test_the_view_sees_the_budget_header_as_its_deadline(client: Any) -> None:
    body = client.get("/deadline", headers={"X-Request-Budget-Ms": "500"}).json()
    assert 0 < body["meta_remaining_ms"] <= 500
    assert 0 < body["current_remaining_ms"] <= 500
    assert body["budget_source"] == "X-Request-Budget-Ms"


def test_without_a_header_the_default_budget_applies(client: Any) -> None:
    body = client.get("/deadline").json()
    assert 0 < body["meta_remaining_ms"] <= DEFAULT_BUDGET_MS
    assert body["budget_source"] is None


@settings(max_examples=examples(60), deadline=None)
@given(value=st.one_of(st.text(max_size=50), st.sampled_from(["NaN", "inf", "1e9", "", "250ms", "5,abc", "٣٠٠", "1H"])))
def test_a_malformed_budget_header_never_500s_and_never_extends_the_deadline(client: Any, value: str) -> None:
    response = client.get("/deadline", headers={"X-Request-Budget-Ms": value, "grpc-timeout": value})
    if response.status_code == 504:  # a valid value <= 0: no time left, the view never ran
        assert response["X-Prazo-Reason"] == "expired-on-arrival"
        return
    assert response.status_code == 200, (value, response.content)
    # A value valid for one of the two (e.g. "1H", a valid grpc-timeout) may ask for more than the
    # default, up to the cap; an invalid one never gets more than the default.
    allowed = BudgetPolicy(default_budget_ms=DEFAULT_BUDGET_MS).budget_ms_for(
        budget_from_headers({"X-Request-Budget-Ms": value, "grpc-timeout": value})
    )
    assert response.json()["meta_remaining_ms"] <= allowed


@pytest.mark.parametrize("budget", ["0", "-5"])
def test_no_budget_left_is_answered_504_before_the_view_runs(client: Any, budget: str) -> None:
    before = hits(client)
    response = client.get("/work", headers={"X-Request-Budget-Ms": budget})
    assert response.status_code == 504
    assert response["X-Prazo-Reason"] == "expired-on-arrival"
    assert hits(client) == before


def test_a_deadline_set_by_prazo_in_the_environ_wins(client: Any) -> None:
    deadline = Deadline.after_ms(300)
    with deadline_scope(deadline):
        body = client.get("/deadline", headers={"X-Request-Budget-Ms": "20000"}, **{"prazo.deadline": deadline}).json()
    assert 0 < body["meta_remaining_ms"] <= 300 and 0 < body["current_remaining_ms"] <= 300


@pytest.mark.parametrize("query", ["", "?rows=1"], ids=["in-execute", "in-fetch"])
def test_a_slow_sqlite_query_ends_at_the_deadline_with_504_and_the_connection_stays_usable(
    client: Any, query: str
) -> None:
    start = time.monotonic()
    response = client.get(f"/slow-query{query}", headers={"X-Request-Budget-Ms": "200"})
    elapsed = time.monotonic() - start
    print(f"sqlite slow query{query} under 200 ms: answered {response.status_code} after {elapsed * 1000:.0f} ms")
    assert response.status_code == 504
    assert response["X-Prazo-Reason"] == "deadline-exceeded"
    assert elapsed < SLOW_QUERY_BOUND_S
    assert client.get("/hits").status_code == 200


@pytest.mark.parametrize("exc", [DeadlineExceeded("deadline-exceeded"), DownstreamOverloaded(), QueueFull()])
def test_a_refusal_raised_by_a_view_is_answered_as_prazo_answers_it(client: Any, exc: BaseException) -> None:
    from django.test import RequestFactory
    from prazo.bindings.integrations.django import DeadlineMiddleware

    def view(request: Any) -> Any:
        raise exc

    middleware = DeadlineMiddleware(view)
    response = middleware.process_exception(RequestFactory().get("/"), exc)  # type: ignore[arg-type]
    status, headers, body = rejection_response(exc)
    assert response is not None
    assert response.status_code == int(status[:3]) and response.content == body
    for name, value in headers:
        assert response[name] == value
    assert middleware.process_exception(RequestFactory().get("/"), ValueError("not ours")) is None


def test_statement_deadline_rejects_what_is_not_a_deadline() -> None:
    from prazo.bindings.integrations.django import StatementDeadline

    with pytest.raises(TypeError, match="deadline"):
        StatementDeadline(250)  # type: ignore[arg-type]


# --- served by `prazo serve`, as a deployment runs it ---------------------------------------------


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """``serve(env)``: migrate, then ``prazo serve seedsite.wsgi:application`` on a free port; returns the port."""
    started: list[subprocess.Popen[str]] = []

    def start(extra_env: dict[str, str]) -> int:
        env = {**os.environ, "SEEDSITE_SQLITE_PATH": str(tmp_path / "db.sqlite3"), **extra_env}
        env.pop("DJANGO_SETTINGS_MODULE", None)
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--verbosity", "0"],
            cwd=PROJECT_DIR, env=env, check=True, timeout=CLIENT_TIMEOUT_S * 3,
        )  # fmt: skip
        command = [
            sys.executable, "-m", "prazo.bindings.servers.serve", "seedsite.wsgi:application",
            "--server", "waitress", "--port", "0", "--threads", str(THREADS), "--max-queue", str(MAX_QUEUE),
        ]  # fmt: skip
        process = subprocess.Popen(command, cwd=PROJECT_DIR, env=env, stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+) ", line)
        assert match, line
        port = int(match.group(1))
        assert request(port, "/healthz").status == 200
        return port

    yield start
    for process in started:
        process.terminate()
        try:
            process.wait(CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(CLIENT_TIMEOUT_S)


def served_hits(port: int) -> int:
    return int(json.loads(request(port, "/hits").body)["hits"])


def seed_burst(port: int, budget_ms: int) -> list[Any]:
    burst = Burst(port, [f"/work?ms={WORK_MS}"] * ARRIVALS, headers={"X-Request-Budget-Ms": str(budget_ms)})
    return burst.join()


def assert_two_second_seed(port: int, budget_ms: int = 2000) -> None:
    before = served_hits(port)
    outcomes = seed_burst(port, budget_ms)
    assert statuses(outcomes) == {200: THREADS + MAX_QUEUE, 503: REFUSED_AT_ONCE}, [
        (o.status, o.reason) for o in outcomes
    ]
    assert {outcome.reason for outcome in outcomes if outcome.status == 503} == {"queue-full"}
    # Every admitted request ran its view once; no refused one ever did.
    assert served_hits(port) - before == THREADS + MAX_QUEUE


def test_seed_scenario_served_with_sqlite(serve: Any) -> None:
    port = serve({"SEEDSITE_DB": "sqlite"})
    assert_two_second_seed(port)

    before = served_hits(port)
    outcomes = seed_burst(port, 750)
    reasons = Counter((outcome.status, outcome.reason) for outcome in outcomes)
    assert reasons[(503, "queue-full")] == REFUSED_AT_ONCE
    completed = reasons[(200, None)]
    # Waves start at 0, 300, 600 ms at best; the 900 ms one can never make 750 ms.
    assert 2 * THREADS <= completed <= 3 * THREADS, reasons
    assert reasons[(504, "expired-in-queue")] == ARRIVALS - REFUSED_AT_ONCE - completed, reasons
    assert served_hits(port) - before == completed


def test_seed_scenario_and_a_cancelled_statement_served_with_postgresql(serve: Any, postgres: Any) -> None:
    import psycopg

    port = serve(
        {"SEEDSITE_DB": "postgresql", "PGHOST": postgres.host, "PGPORT": str(postgres.port), "PGUSER": "postgres"}
    )
    # On PostgreSQL the 300 ms of work is a pg_sleep under the deadline: the sixth
    # wave would end ~200 ms before a 2 s deadline, too close on a loaded machine.
    # A 3 s budget gives the same split (the line's length decides the 503s).
    assert_two_second_seed(port, budget_ms=3000)

    start = time.monotonic()
    outcome = request(port, "/slow-query", headers={"X-Request-Budget-Ms": "200"})
    elapsed = time.monotonic() - start
    print(f"postgresql pg_sleep(5) under 200 ms through Django: {outcome.status} after {elapsed * 1000:.0f} ms")
    assert (outcome.status, outcome.reason) == (504, "deadline-exceeded")
    assert elapsed < SLOW_QUERY_BOUND_S
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        running = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(5)%' AND state = 'active'"
        ).fetchone()
    assert running == (0,)
    # The worker's connection is still usable for the next request.
    assert request(port, "/hits").status == 200

    # Inside transaction.atomic(): the cancelled statement's transaction is rolled back, the connection reused.
    before = served_hits(port)
    outcome = request(port, "/slow-query?atomic=1", headers={"X-Request-Budget-Ms": "200"})
    assert (outcome.status, outcome.reason) == (504, "deadline-exceeded")
    assert served_hits(port) == before
    assert_two_second_seed(port, budget_ms=3000)  # and the workers serve the seed scenario again


@pytest.mark.parametrize(
    ("setting", "value", "error", "names"),
    [
        ("PRAZO_DEFAULT_BUDGET_MS", float("nan"), ValueError, "default_budget_ms"),
        ("PRAZO_MAX_BUDGET_MS", "30000", TypeError, "max_budget_ms"),
        ("PRAZO_RETRY_AFTER_S", -1, ValueError, "retry_after_s"),
    ],
)
def test_bad_settings_fail_at_startup_naming_them(
    client: Any, setting: str, value: object, error: type[Exception], names: str
) -> None:
    from django.test import override_settings
    from prazo.bindings.integrations.django import DeadlineMiddleware

    with override_settings(**{setting: value}), pytest.raises(error, match=f"PRAZO_.*{names}"):
        DeadlineMiddleware(lambda request: None)  # type: ignore[arg-type,return-value]


def test_behind_admission_middleware_the_view_gets_its_deadline_and_db_refusals_pass_through(client: Any) -> None:
    from wsgiref.util import setup_testing_defaults

    from django.core.wsgi import get_wsgi_application
    from prazo.bindings.wsgi import AdmissionMiddleware

    app = AdmissionMiddleware(get_wsgi_application(), max_concurrency=2, max_queue=2, max_budget_ms=300)

    def call(path: str, query: str = "") -> tuple[str, dict[str, str], bytes]:
        environ: dict[str, Any] = {"PATH_INFO": path, "QUERY_STRING": query, "HTTP_X_REQUEST_BUDGET_MS": "20000"}
        setup_testing_defaults(environ)
        seen: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            seen["status"], seen["headers"] = status, dict(headers)
            return lambda data: None

        body = app(environ, start_response)
        try:
            data = b"".join(body)
        finally:
            getattr(body, "close", lambda: None)()
        return seen["status"], seen["headers"], data

    status, _, data = call("/deadline")
    # The middleware's max_budget_ms (300) caps the header's 20 s; the view sees that deadline.
    assert status.startswith("200") and 0 < json.loads(data)["meta_remaining_ms"] <= 300
    status, headers, _ = call("/slow-query", "rows=1")
    assert status.startswith("504") and headers["X-Prazo-Reason"] == "deadline-exceeded"
    assert app.stats()["in_flight"] == 0
