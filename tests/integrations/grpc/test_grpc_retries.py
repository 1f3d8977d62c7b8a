"""``DeadlineClientInterceptor(retry=RetryPolicy(...))`` on a real grpcio server on 127.0.0.1.

``UNAVAILABLE`` then OK is retried for a method declared idempotent, and
each attempt carries a smaller ``x-request-budget-ms``; ``DEADLINE_EXCEEDED``
never is; an undeclared method never is; a pushback beyond the budget gives
the error back at once. grpc's own retries are off in the channel options,
as the interceptor's docstring asks.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from prazo.bindings.integrations.grpc.client import PUSHBACK_KEY, DeadlineClientInterceptor
from prazo.bindings.retries import AdaptiveThrottles, RetryBudget, RetryPolicy, Throttled
from prazo.core import Deadline, DeadlineExceeded, DownstreamOverloaded, deadline_scope

SERVICE = "prazo.test.Retry"
FLAKY = f"/{SERVICE}/Flaky"
LATE = f"/{SERVICE}/Late"
PUSHBACK = f"/{SERVICE}/Pushback"
OPTIONS = [("grpc.enable_retries", 0)]


class Handlers:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.budgets: list[int] = []
        self.failures_left = 0

    def _record(self, context: grpc.ServicerContext) -> None:
        budget = dict(context.invocation_metadata()).get("x-request-budget-ms")
        with self.lock:
            self.budgets.append(int(budget) if budget is not None else -1)

    def flaky(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._record(context)
        with self.lock:
            fail = self.failures_left > 0
            self.failures_left -= 1
        if fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "busy")
        return request

    def late(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._record(context)
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "too late")
        return b""

    def pushback(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._record(context)
        context.set_trailing_metadata(((PUSHBACK_KEY, "30000"),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "come back in 30 s")
        return b""


@pytest.fixture
def served() -> Iterator[tuple[Handlers, str]]:
    handlers = Handlers()
    executor = ThreadPoolExecutor(4)
    server = grpc.server(executor)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Flaky": grpc.unary_unary_rpc_method_handler(handlers.flaky),
                    "Late": grpc.unary_unary_rpc_method_handler(handlers.late),
                    "Pushback": grpc.unary_unary_rpc_method_handler(handlers.pushback),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield handlers, f"127.0.0.1:{port}"
    server.stop(None).wait(15)
    executor.shutdown(wait=True)


def channel_for(target: str, **interceptor: Any) -> grpc.Channel:
    sleeps = interceptor.pop("sleep", lambda seconds: time.sleep(0.03))
    policy = RetryPolicy(
        budget=RetryBudget(percent=1.0, min_per_s=10), attempt_ms=0.0, rng=random.Random(2), sleep=sleeps
    )
    interceptor.setdefault("idempotent", True)
    return grpc.intercept_channel(
        grpc.insecure_channel(target, options=OPTIONS), DeadlineClientInterceptor(retry=policy, **interceptor)
    )


def test_unavailable_then_ok_is_retried_with_a_shrinking_budget(served: tuple[Handlers, str]) -> None:
    handlers, target = served
    handlers.failures_left = 2
    channel = channel_for(target)
    with deadline_scope(Deadline.after(5.0)):
        assert channel.unary_unary(FLAKY)(b"hi") == b"hi"
    channel.close()
    first, second, third = handlers.budgets
    assert 5000 >= first > second > third > 0


def test_deadline_exceeded_is_never_retried(served: tuple[Handlers, str]) -> None:
    handlers, target = served
    channel = channel_for(target)
    with deadline_scope(Deadline.after(5.0)), pytest.raises(DeadlineExceeded):
        channel.unary_unary(LATE)(b"")
    channel.close()
    assert len(handlers.budgets) == 1


def test_a_method_not_declared_idempotent_is_never_retried(served: tuple[Handlers, str]) -> None:
    handlers, target = served
    handlers.failures_left = 1
    channel = channel_for(target, idempotent={LATE})
    with deadline_scope(Deadline.after(5.0)), pytest.raises(DownstreamOverloaded) as info:
        channel.unary_unary(FLAKY)(b"")
    channel.close()
    assert isinstance(info.value, grpc.RpcError) and info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert len(handlers.budgets) == 1


def test_a_pushback_beyond_the_budget_gives_the_error_back_at_once(served: tuple[Handlers, str]) -> None:
    handlers, target = served
    waits: list[float] = []
    channel = channel_for(target, sleep=waits.append)
    with deadline_scope(Deadline.after(2.0)), pytest.raises(DownstreamOverloaded):
        channel.unary_unary(PUSHBACK)(b"")
    channel.close()
    assert len(handlers.budgets) == 1 and waits == []


def test_the_future_of_a_retried_call(served: tuple[Handlers, str]) -> None:
    handlers, target = served
    handlers.failures_left = 1
    channel = channel_for(target)
    with deadline_scope(Deadline.after(5.0)):
        future = channel.unary_unary(FLAKY).future(b"yes")
    assert future.result(timeout=15) == b"yes"
    channel.close()
    assert len(handlers.budgets) == 2


def test_wrong_arguments_name_themselves() -> None:
    with pytest.raises(TypeError, match="retry"):
        DeadlineClientInterceptor(retry=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="idempotent"):
        DeadlineClientInterceptor(idempotent="/pkg.S/M")


def test_a_throttled_channel_stops_calling_a_method_that_keeps_refusing(served: tuple[Handlers, str]) -> None:
    # Every call refused (UNAVAILABLE): a plain channel would make all 120; this one refuses
    # most of them itself once its window is full of refusals, and never sends those.
    handlers, target = served
    handlers.failures_left = 10**6
    throttle = AdaptiveThrottles(min_requests=10, rng=random.Random(4))
    policy = RetryPolicy(max_attempts=1, throttle=throttle)
    channel = grpc.intercept_channel(
        grpc.insecure_channel(target, options=OPTIONS), DeadlineClientInterceptor(retry=policy, idempotent=True)
    )
    outcomes: dict[str, int] = {}
    for _ in range(120):
        try:
            with deadline_scope(Deadline.after(5.0)):
                channel.unary_unary(FLAKY)(b"")
        except Throttled as exc:
            outcomes[exc.reason] = outcomes.get(exc.reason, 0) + 1
        except DownstreamOverloaded as exc:
            assert isinstance(exc, grpc.RpcError) and exc.code() is grpc.StatusCode.UNAVAILABLE
            outcomes["unavailable"] = outcomes.get("unavailable", 0) + 1
    channel.close()
    sent = len(handlers.budgets)
    assert outcomes == {"unavailable": sent, "throttled-locally": 120 - sent}
    assert policy.stats()["throttled_locally"] == 120 - sent
    assert 10 <= sent < 60
    assert throttle.for_destination(FLAKY).stats()["accepts"] == 0
