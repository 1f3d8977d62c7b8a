"""``AdaptiveThrottle``: the SRE formula against a model (Hypothesis, fake clock), the policy's use of it, real threads, a real server.

The model is the module docstring's definition written plainly: every attempt
and every accept with its time; the window holds those of the last
``GENERATIONS`` generations; ``p = max(0, (requests - k x accepts) / (requests + 1))``,
0 under ``min_requests``, at most ``max_rejection``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from _helpers import SecondsClock, examples, run_checked, scripted_throttle
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.clients.requests import DeadlineSession
from prazo.bindings.retries import AdaptiveThrottle, AdaptiveThrottles, Failure, RetryPolicy, Throttled
from prazo.bindings.retries.window import GENERATIONS
from prazo.core import REASON_THROTTLED_LOCALLY, REASONS, DownstreamOverloaded

WINDOW_S = 10.0


class Model:
    def __init__(self, k: float, min_requests: int, max_rejection: float) -> None:
        self.k, self.min_requests, self.max_rejection = k, min_requests, max_rejection
        self.generation_ns = round(WINDOW_S * 1e9) // GENERATIONS
        self.requests: list[int] = []
        self.accepts: list[int] = []

    def _live(self, events: list[int], now_ns: int) -> int:
        current = now_ns // self.generation_ns
        return sum(1 for at in events if at // self.generation_ns > current - GENERATIONS)

    def probability(self, now_ns: int) -> float:
        requests, accepts = self._live(self.requests, now_ns), self._live(self.accepts, now_ns)
        if requests < self.min_requests:
            return 0.0
        return min(self.max_rejection, max(0.0, (requests - self.k * accepts) / (requests + 1)))


@settings(max_examples=examples(150), deadline=None)
@given(
    k=st.sampled_from([1.5, 2.0, 3.0]),
    min_requests=st.integers(0, 5),
    max_rejection=st.sampled_from([0.5, 0.9, 1.0]),
    steps=st.lists(st.tuples(st.floats(0, 3), st.booleans(), st.booleans()), max_size=60),
)
def test_the_probability_is_the_formula_over_the_window(
    k: float, min_requests: int, max_rejection: float, steps: list[tuple[float, bool, bool]]
) -> None:
    clock = SecondsClock()
    # rng=None is fine: the decision's draw is not what this property checks, only p and the counts.
    throttle = AdaptiveThrottle(
        k=k, window_s=WINDOW_S, min_requests=min_requests, max_rejection=max_rejection, clock=clock
    )
    model = Model(k, min_requests, max_rejection)
    for seconds, attempt, accepted in steps:
        clock.advance(seconds)
        assert throttle.rejection_probability() == pytest.approx(model.probability(clock()))
        if attempt:
            sent = throttle.admit()
            model.requests.append(clock())
            if sent:
                throttle.record(accepted)
                if accepted:
                    model.accepts.append(clock())
    assert throttle.rejection_probability() == pytest.approx(model.probability(clock()))


def test_nothing_is_refused_while_the_destination_takes_everything() -> None:
    throttle = AdaptiveThrottle(min_requests=0, rng=random.Random(3))
    for _ in range(500):
        assert throttle.admit()
        throttle.record(True)
    assert throttle.stats() == {"requests": 500, "accepts": 500, "throttled": 0, "rejection_probability": 0.0}


def test_a_refusing_destination_is_sent_a_trickle_and_its_recovery_is_seen() -> None:
    clock = SecondsClock()
    throttle = AdaptiveThrottle(window_s=WINDOW_S, rng=random.Random(5), clock=clock)
    sent = 0
    for _ in range(2000):  # everything refused: p climbs to its cap, not to 1
        clock.advance(0.001)
        if throttle.admit():
            sent += 1
            throttle.record(False)
    assert throttle.rejection_probability() == 0.9
    assert 150 < sent < 400  # the first min_requests, then about one attempt in ten
    clock.advance(WINDOW_S + 1)  # a quiet window later the history is gone
    assert throttle.rejection_probability() == 0.0


def test_min_requests_holds_off_the_first_refusals() -> None:
    throttle = AdaptiveThrottle(min_requests=20, rng=random.Random(1))
    for _ in range(19):
        assert throttle.admit()
        throttle.record(False)
    assert throttle.rejection_probability() == 0.0
    assert throttle.admit()  # the 20th attempt is decided on a window of 19
    throttle.record(False)
    assert throttle.rejection_probability() == pytest.approx(min(0.9, 20 / 21))


@pytest.mark.parametrize(
    ("arguments", "error", "name"),
    [
        ({"k": 1}, ValueError, "k must be > 1"),
        ({"k": "2"}, TypeError, "k must be a number"),
        ({"k": float("nan")}, ValueError, "k must be between"),
        ({"window_s": 0}, ValueError, "window_s"),
        ({"min_requests": -1}, ValueError, "min_requests"),
        ({"min_requests": True}, ValueError, "min_requests"),
        ({"max_rejection": 1.5}, ValueError, "max_rejection"),
        ({"rng": 4}, TypeError, "rng"),
        ({"clock": 4}, TypeError, "clock"),
    ],
)
def test_bad_arguments_are_refused_naming_them(arguments: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        AdaptiveThrottle(**arguments)
    with pytest.raises(error, match=name):
        AdaptiveThrottles(**arguments)


def test_a_policy_refuses_anything_else_as_its_throttle() -> None:
    with pytest.raises(TypeError, match="throttle must be"):
        RetryPolicy(throttle=0.5)  # type: ignore[arg-type]


def test_one_throttle_per_destination() -> None:
    throttles = AdaptiveThrottles(min_requests=0, rng=random.Random(2))
    a, b = throttles.for_destination("a"), throttles.for_destination("b")
    assert a is throttles.for_destination("a") and a is not b
    for _ in range(50):
        a.admit()
        a.record(False)
    assert a.rejection_probability() > 0.5 and b.rejection_probability() == 0.0
    assert set(throttles.stats()) == {"a", "b"}


def test_throttled_is_a_503_with_its_own_registered_reason() -> None:
    error = Throttled(("http", "b.internal:8080"))
    assert isinstance(error, DownstreamOverloaded) and error.status == 503
    assert error.reason == REASON_THROTTLED_LOCALLY and REASONS[REASON_THROTTLED_LOCALLY].status == 503
    assert "b.internal" in str(error)


def test_the_first_attempt_refused_raises_throttled_and_sends_nothing() -> None:
    policy = RetryPolicy(throttle=scripted_throttle(False))
    sent: list[int] = []

    def attempt(number: int) -> str:
        sent.append(number)
        return "answer"

    with pytest.raises(Throttled) as raised:
        policy.call(attempt, lambda exc: None, destination="b", idempotent=True)
    assert raised.value.destination == "b"
    assert sent == [] and policy.stats()["throttled_locally"] == 1 and policy.stats()["calls"] == 1


def test_a_retry_refused_by_the_throttle_ends_with_the_last_real_answer() -> None:
    throttle = scripted_throttle(True, False)
    policy = RetryPolicy(throttle=throttle, sleep=lambda _s: None)
    sent: list[int] = []

    def attempt(number: int) -> str:
        sent.append(number)
        return "503 queue-full"

    refused = Failure("overloaded", None, "queue-full")
    result = policy.call(attempt, lambda exc: None, destination="b", idempotent=True, judge=lambda _r: refused)
    assert result == "503 queue-full" and sent == [1]
    assert throttle.records == [False]  # the one attempt sent was not taken
    stats = policy.stats()
    assert (stats["throttled_locally"], stats["retries"], stats["not_retried"]) == (1, 0, {"throttled": 1})


def test_a_retry_the_throttle_lets_go_is_sent_and_each_attempt_is_told() -> None:
    throttle = scripted_throttle(True, True)
    policy = RetryPolicy(throttle=throttle, sleep=lambda _s: None)
    answers = iter(["503 queue-full", "200"])
    judged = {"503 queue-full": Failure("overloaded", None, "queue-full"), "200": None}
    result = policy.call(
        lambda number: next(answers), lambda exc: None, destination="b", idempotent=True, judge=judged.get
    )
    assert result == "200" and throttle.records == [False, True]
    assert policy.stats()["retries"] == 1 and policy.stats()["throttled_locally"] == 0


@pytest.mark.parametrize(
    ("failure", "taken"),
    [
        (None, True),  # a success
        (Failure("overloaded", None, "queue-full"), False),  # a 503 refusal, UNAVAILABLE, RESOURCE_EXHAUSTED
        (Failure("refused", None, None), False),  # a refused connection
        (Failure("reset", None, None), False),  # reset before any byte of the answer
        (Failure("deadline", None, None), True),  # a 504: the destination took it and ran out of time
        (Failure("other", None, None), True),  # an application error
    ],
)
def test_what_counts_as_taken(failure: Failure | None, taken: bool) -> None:
    throttle = scripted_throttle()
    RetryPolicy.record_attempt(throttle, failure)
    assert throttle.records == [taken]


def test_many_threads_share_one_throttle_and_lose_no_count() -> None:
    throttle = AdaptiveThrottle(min_requests=0)
    admitted = [0] * 8

    def hammer(index: int) -> None:
        for attempt in range(2000):
            if throttle.admit():
                admitted[index] += 1
                throttle.record(attempt % 3 == 0)

    run_checked([lambda index=index: hammer(index) for index in range(8)])
    stats = throttle.stats()
    assert stats["requests"] == 16000
    assert stats["requests"] - stats["throttled"] == sum(admitted)
    assert 0 < stats["throttled"] < 16000


# -- a real server on loopback -------------------------------------------------------------------


class _Refusing(BaseHTTPRequestHandler):
    """Takes the first ``server.capacity`` requests; every one after gets ``503 queue-full``."""

    protocol_version = "HTTP/1.1"
    server: Any

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.seen += 1
            refuse = self.server.seen > self.server.capacity
        self.send_response(503 if refuse else 200)
        if refuse:
            self.send_header("X-Prazo-Reason", "queue-full")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def refusing_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    server.daemon_threads = True
    server.lock = threading.Lock()  # type: ignore[attr-defined]
    server.seen = 0  # type: ignore[attr-defined]
    server.capacity = 10  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_throttled_session_stops_sending_to_a_server_that_refuses(refusing_server: Any) -> None:
    url = f"http://127.0.0.1:{refusing_server.server_address[1]}/stock"
    throttles = AdaptiveThrottles(min_requests=10, rng=random.Random(11))
    retry = RetryPolicy(max_attempts=1, throttle=throttles)
    statuses: dict[object, int] = {}
    with DeadlineSession(retry=retry) as session:
        for _ in range(300):
            try:
                status: object = session.get(url, timeout=10).status_code
            except Throttled as exc:
                status = exc.reason
            statuses[status] = statuses.get(status, 0) + 1
    seen = refusing_server.seen
    assert statuses[200] == 10 and statuses[503] == seen - 10
    assert statuses[REASON_THROTTLED_LOCALLY] == retry.stats()["throttled_locally"] == 300 - seen
    # A plain session sends all 300. This one: p climbs as refusals fill the window (about 0.3 after
    # 30 attempts, 0.8 after 100, then its 0.9 cap): 82 reach the server with this seed.
    assert seen < 100
    (throttle,) = (throttles.for_destination(destination) for destination in throttles.stats())
    assert throttle.stats()["accepts"] == 10
