"""``max_expiry_refusal_fraction``: at most that share refused for a budget that arrived spent.

The cap's arithmetic on a fake clock, its invariant as a property, and the
middleware with a real HTTP client on werkzeug: a caller whose every budget
header says 0 gets at most the cap's share of 504s, the rest run on the
default budget and are counted; a deadline the process already holds is
never overruled.
"""

from __future__ import annotations

import http.client
import threading
from typing import Any

import pytest
from _helpers import examples
from _required import require
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.headers import BUDGET_HEADER, REASON_HEADER_NAME
from prazo.bindings.plumbing.expiry_cap import ExpiryRefusalCap
from prazo.bindings.wsgi import DEADLINE_KEY, AdmissionMiddleware
from prazo.core import NS_PER_SECOND, Deadline, deadline_context

serving = require("werkzeug.serving")


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000 * NS_PER_SECOND

    def __call__(self) -> int:
        return self.ns


def test_a_spent_budget_is_refused_only_within_the_share() -> None:
    clock = Clock()
    cap = ExpiryRefusalCap(0.2, window_s=10, clock=clock)
    assert [cap.should_refuse(False) for _ in range(10)] == [False] * 10
    # 11 arrivals: 1 refusal fits in 20 %; 12: 2; 13: 3 would not.
    assert [cap.should_refuse(True) for _ in range(3)] == [True, True, False]
    assert cap.stats() == {"arrivals": 13, "refused": 2}
    clock.ns += 11 * NS_PER_SECOND  # the window has moved past all of them
    assert cap.stats() == {"arrivals": 0, "refused": 0}
    assert cap.should_refuse(True) is False, "1 refusal of 1 arrival is more than 20 %"


@given(
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 2 * NS_PER_SECOND)), max_size=200),
    fraction=st.floats(0.01, 0.99),
)
@settings(max_examples=examples(200))
def test_the_refused_share_of_the_window_never_exceeds_the_cap(steps: list[tuple[bool, int]], fraction: float) -> None:
    clock = Clock()
    cap = ExpiryRefusalCap(fraction, window_s=3600, clock=clock)  # longer than any run: one window
    arrivals = refused = 0
    for spent, elapsed in steps:
        clock.ns += elapsed
        arrivals += 1
        said = cap.should_refuse(spent)
        assert not said or spent, "only a spent budget is ever refused"
        if spent and not said:
            assert refused + 1 > fraction * arrivals, "a spent budget is let through only when refusing would exceed"
        refused += said
        assert refused <= fraction * arrivals
    assert cap.stats() == {"arrivals": arrivals, "refused": refused}


@pytest.mark.parametrize(
    ("arguments", "error"),
    [({"fraction": 0}, ValueError), ({"fraction": 1}, ValueError), ({"fraction": "0.1"}, TypeError),
     ({"fraction": 0.1, "window_s": 0}, ValueError), ({"fraction": 0.1, "window_s": True}, TypeError)],
)  # fmt: skip
def test_wrong_arguments_name_themselves(arguments: dict[str, Any], error: type[Exception]) -> None:
    name = "max_expiry_refusal_fraction" if "window_s" not in arguments else "window_s"
    with pytest.raises(error, match=name):
        ExpiryRefusalCap(**arguments)


def test_the_middleware_refuses_at_most_the_share_and_runs_the_rest_on_the_default_budget() -> None:
    budgets: list[float] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        budgets.append(environ[DEADLINE_KEY].remaining_ms())
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    middleware = AdmissionMiddleware(
        app, max_concurrency=2, max_queue=2, default_budget_ms=5000, max_expiry_refusal_fraction=0.25
    )
    assert middleware.fast_path is False
    server = serving.make_server("127.0.0.1", 0, middleware, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        answers = []
        for _ in range(8):
            connection = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
            connection.request("GET", "/", headers={BUDGET_HEADER: "0"})  # a broken upstream: always spent
            response = connection.getresponse()
            response.read()
            answers.append((response.status, response.getheader(REASON_HEADER_NAME)))
            connection.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    # Arrivals 4 and 8 are the ones a 25 % share allows to refuse.
    assert [status for status, _ in answers] == [200, 200, 200, 504, 200, 200, 200, 504]
    assert {reason for status, reason in answers if status == 504} == {"expired-on-arrival"}
    assert len(budgets) == 6 and all(4000 < budget <= 5000 for budget in budgets), budgets
    stats = middleware.stats()
    assert (stats["expiry_refusals_capped"], stats["expired_on_arrival"]) == (6, 2)


def test_a_deadline_the_process_already_holds_is_never_overruled() -> None:
    ran = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        ran.append(True)
        start_response("200 OK", [])
        return [b""]

    middleware = AdmissionMiddleware(app, max_concurrency=1, max_queue=0, max_expiry_refusal_fraction=0.5)
    statuses = []
    for _ in range(4):
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "wsgi.input": None}
        body = deadline_context(Deadline.after_ms(-5)).run(
            middleware, environ, lambda status, headers, exc_info=None: statuses.append(status)
        )
        b"".join(body)
    assert ran == [] and set(statuses) == {"504 Gateway Timeout"}
    assert middleware.stats()["expiry_refusals_capped"] == 0
