"""Flask behind prazo: the view sees the deadline (``flask.g``, environ, ``current_deadline``) and refusals are prazo's.

Three ways in: Flask's test client with ``init_app`` alone (it reads the
budget headers itself), the app behind ``AdmissionMiddleware`` on a real
server on loopback, and the app served by prazo's waitress embedding (admission at
the server's queue), with real threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from _helpers import examples
from _required import require
from _server_harness import CLIENT_TIMEOUT_S, Burst, request, statuses
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.headers import BudgetPolicy, budget_from_headers
from prazo.bindings.wsgi import AdmissionMiddleware, rejection_response
from prazo.core import DeadlineExceeded, DownstreamOverloaded, QueueFull, current_deadline

flask = require("flask")

from prazo.bindings.integrations.flask import init_app, rejection_flask_response

DEFAULT_BUDGET_MS = 1000
# serve_forever looks for a shutdown request every poll_interval (0.5 s by default):
# a shorter one lets shutdown() return at once instead of waiting out the poll.
_POLL = {"poll_interval": 0.05}


def make_app(*, with_init: bool = True) -> Any:
    app = flask.Flask("prazo_flask_test")
    calls: list[str] = []
    app.config["calls"] = calls

    @app.get("/deadline")
    def deadline() -> Any:
        calls.append("deadline")
        current = current_deadline()
        g_deadline = getattr(flask.g, "prazo_deadline", None)
        return {
            "environ_ms": round(flask.request.environ["prazo.deadline"].remaining_ms()),
            "current_ms": None if current is None else round(current.remaining_ms()),
            "g_ms": None if g_deadline is None else round(g_deadline.remaining_ms()),
        }

    @app.get("/work")
    def work() -> Any:
        calls.append("work")
        time.sleep(int(flask.request.args.get("ms", "0")) / 1000)
        return "done"

    # Held until the test sets the gate (bounded): the requests running or
    # waiting keep their places, whatever the machine's load.
    gate = threading.Event()
    app.config["gate"] = gate

    @app.get("/held")
    def held() -> Any:
        calls.append("held")
        gate.wait(CLIENT_TIMEOUT_S)
        return "done"

    @app.get("/raise/<kind>")
    def raise_refusal(kind: str) -> Any:
        raise {"deadline": DeadlineExceeded("no-budget-for-downstream"), "overloaded": DownstreamOverloaded()}[kind]

    if with_init:
        init_app(app, default_budget_ms=DEFAULT_BUDGET_MS)
    return app


class QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def serve_wsgi() -> Iterator[Any]:
    """``serve_wsgi(app)``: a threaded wsgiref server on 127.0.0.1 serving ``app``; returns its port."""
    servers: list[Any] = []

    def start(app: Any) -> int:
        from socketserver import ThreadingMixIn
        from wsgiref.simple_server import WSGIServer

        class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
            daemon_threads = True

        server = make_server("127.0.0.1", 0, app, server_class=ThreadingWSGIServer, handler_class=QuietHandler)
        threading.Thread(target=server.serve_forever, kwargs=_POLL, daemon=True).start()
        servers.append(server)
        return int(server.server_address[1])

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_init_app_reads_the_budget_header_and_the_view_sees_it_everywhere() -> None:
    body = make_app().test_client().get("/deadline", headers={"X-Request-Budget-Ms": "400"}).get_json()
    assert 0 < body["environ_ms"] <= 400 and 0 < body["current_ms"] <= 400 and 0 < body["g_ms"] <= 400


@settings(max_examples=examples(60), deadline=None)
@given(value=st.one_of(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
                       st.sampled_from(["NaN", "inf", "1e9", "", "250ms", "5,abc", "99999999999999999999999", "1H"])))  # fmt: skip
def test_a_malformed_budget_header_never_500s_and_never_extends_the_deadline(value: str) -> None:
    response = make_app().test_client().get("/deadline", headers={"X-Request-Budget-Ms": value, "grpc-timeout": value})
    if response.status_code == 504:
        assert response.headers["X-Prazo-Reason"] == "expired-on-arrival"
        return
    assert response.status_code == 200, (value, response.data)
    # A value valid for one of the two (e.g. "1H", a valid grpc-timeout) may ask for more than the
    # default, up to the cap; an invalid one never gets more than the default.
    allowed = BudgetPolicy(default_budget_ms=DEFAULT_BUDGET_MS).budget_ms_for(
        budget_from_headers({"X-Request-Budget-Ms": value, "grpc-timeout": value})
    )
    # The view reports whole milliseconds (round); round never takes a smaller number above a larger one.
    assert response.get_json()["g_ms"] <= round(allowed)


def test_no_budget_left_is_504_and_flask_never_runs() -> None:
    app = make_app()
    response = app.test_client().get("/deadline", headers={"X-Request-Budget-Ms": "0"})
    assert (response.status_code, response.headers["X-Prazo-Reason"]) == (504, "expired-on-arrival")
    assert app.config["calls"] == []


@pytest.mark.parametrize(("kind", "exc"), [("deadline", DeadlineExceeded("no-budget-for-downstream")),
                                           ("overloaded", DownstreamOverloaded())])  # fmt: skip
def test_a_refusal_raised_by_a_view_is_prazos_answer_not_a_500(kind: str, exc: BaseException) -> None:
    response = make_app().test_client().get(f"/raise/{kind}")
    status, headers, body = rejection_response(exc)
    assert response.status == status and response.data == body
    for name, value in headers:
        assert response.headers[name] == value
    # Without init_app Flask makes it a 500: the value init_app adds.
    assert make_app(with_init=False).test_client().get(f"/raise/{kind}").status_code == 500


def test_rejection_flask_response_is_rejection_response() -> None:
    response = rejection_flask_response(QueueFull(), retry_after_s=3)
    assert response.status_code == 503 and response.headers["Retry-After"] == "3"


def test_init_app_rejects_what_is_not_flask() -> None:
    with pytest.raises(TypeError, match=r"app must be a flask\.Flask"):
        init_app(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="default_budget_ms"):
        init_app(flask.Flask("x"), default_budget_ms=float("nan"))


def test_flask_behind_admission_middleware_on_a_real_server(serve_wsgi: Any) -> None:
    app = make_app()
    app.wsgi_app = AdmissionMiddleware(app.wsgi_app, max_concurrency=2, max_queue=2, default_budget_ms=700)
    port = serve_wsgi(app)
    outcome = request(port, "/deadline", headers={"X-Request-Budget-Ms": "20000"})
    body = flask.json.loads(outcome.body)
    # The middleware's deadline (its max_budget_ms is 30 s) reaches g, the environ and current_deadline.
    # One deadline, read twice in whole ms: the second read may fall 1 ms later.
    assert 0 < body["g_ms"] <= 20000 and abs(body["g_ms"] - body["environ_ms"]) <= 1
    # Six at once on two slots and a queue of two: 2 run, 2 wait and run next, 2 are refused at once.
    _assert_two_refused_while_four_are_held(app, port)


def _assert_two_refused_while_four_are_held(app: Any, port: int) -> None:
    """Six requests held in the app on two slots and two places: two 503 queue-full first, then four 200s."""
    burst = Burst(port, ["/held"] * 6, headers={"X-Request-Budget-Ms": "20000"})
    refused = burst.wait(2)
    assert [(o.status, o.reason) for o in refused] == [(503, "queue-full")] * 2
    app.config["gate"].set()
    assert statuses(burst.join()) == {200: 4, 503: 2}


def test_flask_served_by_prazos_waitress_embedding_sees_the_servers_deadline() -> None:
    from prazo.bindings.servers import waitress as prazo_waitress

    app = make_app()
    server = prazo_waitress.create_server(
        app, host="127.0.0.1", port=0, threads=2, max_queue=2, default_budget_ms=800, max_budget_ms=30000
    )
    runner = threading.Thread(target=server.run, daemon=True)
    runner.start()
    try:
        port = server.effective_port
        body = flask.json.loads(request(port, "/deadline").body)
        # No header: the server's default budget, the same deadline in the environ and as the current one.
        assert 0 < body["environ_ms"] <= 800 and 0 < body["current_ms"] <= 800
        assert body["g_ms"] == body["environ_ms"]
        _assert_two_refused_while_four_are_held(app, port)
    finally:
        prazo_waitress.shutdown(server, 10.0)
        runner.join(10.0)


def test_the_example_app_answers_504_when_its_work_outlives_the_budget() -> None:
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    example = importlib.import_module("examples.flask_app")
    client = example.app.test_client()
    assert 0 < client.get("/deadline", headers={"X-Request-Budget-Ms": "250"}).get_json()["remaining_ms"] <= 250
    start = time.monotonic()
    response = client.get("/work?ms=5000", headers={"X-Request-Budget-Ms": "200"})
    assert (response.status_code, response.headers["X-Prazo-Reason"]) == (504, "deadline-exceeded")
    assert time.monotonic() - start < 1.5  # generous: the view checks its deadline every 10 ms
