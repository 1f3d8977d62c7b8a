"""gRPC on real grpcio servers and channels on 127.0.0.1: deadlines in, admission, budgets out.

Handlers are generic handlers with bytes in and bytes out (no protoc). Every
wait is bounded; assertions on time are generous upper bounds (a loaded
2-core machine), never speed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prazo.bindings.integrations.grpc.client import (
    DeadlineClientInterceptor,
    DeadlineExceededRpcError,
    DownstreamOverloadedRpcError,
)
from prazo.bindings.integrations.grpc.metadata import PUSHBACK_KEY, REASON_METADATA_KEY
from prazo.bindings.integrations.grpc.server import (
    AdmissionExecutor,
    DeadlineServerInterceptor,
    RpcBudgetPolicy,
    admission_server,
    metadata_budget,
)
from prazo.bindings.pool import AdmissionPool
from prazo.core import (
    NS_PER_MS,
    REASON_DEADLINE_EXCEEDED,
    REASON_EXPIRED_IN_QUEUE,
    REASON_NO_BUDGET_FOR_DOWNSTREAM,
    REASON_QUEUE_FULL,
    REASON_SHUTTING_DOWN,
    Deadline,
    DeadlineExceeded,
    DownstreamOverloaded,
    QueueFull,
    current_deadline,
    deadline_scope,
)

SERVICE = "prazo.test.Echo"
WAIT_S = 15.0
# A call that must be refused "at once" is refused far sooner than this.
PROMPT_S = 5.0
# grpc core itself may report a few ms more than the client's timeout (it
# rounds the wire timeout up): measured up to ~10 ms on loopback.
GRPC_SLACK_MS = 50


class Recorder:
    """What the handlers saw: each call's remaining budget (ms, None without a deadline) and metadata."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.budgets: list[float | None] = []
        self.metadata: list[dict[str, str]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()

    def record(self, context: grpc.ServicerContext) -> None:
        deadline = current_deadline()
        with self.lock:
            self.budgets.append(None if deadline is None else deadline.remaining_ms())
            self.metadata.append(dict(context.invocation_metadata()))

    @property
    def calls(self) -> int:
        with self.lock:
            return len(self.budgets)


def _handlers(rec: Recorder) -> grpc.GenericRpcHandler:
    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        rec.record(context)
        return request

    def blocking(request: bytes, context: grpc.ServicerContext) -> bytes:
        rec.record(context)
        rec.entered.set()
        rec.gate.wait(WAIT_S)
        return b"released"

    def raising(request: bytes, context: grpc.ServicerContext) -> bytes:
        rec.record(context)
        kind = request.decode()
        if kind == "deadline":
            raise DeadlineExceeded(REASON_NO_BUDGET_FOR_DOWNSTREAM)
        if kind == "overloaded":
            raise DownstreamOverloaded()
        if kind == "full":
            raise QueueFull()
        context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        return b""

    def count_up(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for index in range(int(request)):
            rec.record(context)
            yield str(index).encode()

    def stream_then_expire(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        deadline = current_deadline()
        assert deadline is not None
        deadline.check(now_ns=deadline.ns)

    def echo_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        for request in requests:
            rec.record(context)
            yield request

    def join(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        rec.record(context)
        return b"".join(requests)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Block": grpc.unary_unary_rpc_method_handler(blocking),
            "Raise": grpc.unary_unary_rpc_method_handler(raising),
            "Count": grpc.unary_stream_rpc_method_handler(count_up),
            "Expire": grpc.unary_stream_rpc_method_handler(stream_then_expire),
            "EchoStream": grpc.stream_stream_rpc_method_handler(echo_stream),
            "Join": grpc.stream_unary_rpc_method_handler(join),
        },
    )


class Served:
    def __init__(self, server: grpc.Server, port: int, rec: Recorder, pool: AdmissionPool | None) -> None:
        self.server = server
        self.target = f"127.0.0.1:{port}"
        self.rec = rec
        self.pool = pool
        self.channel = grpc.insecure_channel(self.target)

    def method(self, name: str, channel: grpc.Channel | None = None, kind: str = "unary_unary") -> Any:
        return getattr(channel or self.channel, kind)(f"/{SERVICE}/{name}")


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    started: list[tuple[Served, Any]] = []

    def start(
        *, max_workers: int = 4, max_queue: int = 8, executor: Any = None, interceptors: Any = None, **kwargs: Any
    ) -> Served:
        rec = Recorder()
        pool = None
        if executor is None:
            pool = AdmissionPool(max_workers=max_workers, max_queue=max_queue)
            server = admission_server(pool, **kwargs)
            owned: Any = pool
        else:
            server = grpc.server(executor, interceptors=interceptors)
            owned = executor
            pool = getattr(executor, "pool", None)
        server.add_generic_rpc_handlers((_handlers(rec),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        served = Served(server, port, rec, pool)
        started.append((served, owned))
        return served

    yield start
    for served, owned in started:
        served.rec.gate.set()
        served.channel.close()
        served.server.stop(None).wait(WAIT_S)
        owned.shutdown(wait=True)


def _reason(error: grpc.RpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY)  # type: ignore[attr-defined]


def _wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


# -- the server: the RPC's deadline inside deadline_scope ------------------------------------


def test_handler_runs_under_the_grpc_deadline(serve: Callable[..., Served]) -> None:
    served = serve()
    assert served.method("Echo")(b"hi", timeout=2.0) == b"hi"
    (budget,) = served.rec.budgets
    assert budget is not None and 0 < budget <= 2000 + GRPC_SLACK_MS


def test_no_deadline_means_none_unless_a_default_is_set(serve: Callable[..., Served]) -> None:
    plain = serve()
    plain.method("Echo")(b"x")
    assert plain.rec.budgets == [None]
    defaulted = serve(default_budget_ms=500)
    defaulted.method("Echo")(b"x")
    (budget,) = defaulted.rec.budgets
    assert budget is not None and 0 < budget <= 500


def test_metadata_budget_shortens_and_max_budget_caps(serve: Callable[..., Served]) -> None:
    served = serve(max_budget_ms=1000)
    served.method("Echo")(b"x", timeout=30.0, metadata=(("x-request-budget-ms", "300"),))
    served.method("Echo")(b"x", timeout=30.0)
    served.method("Echo")(b"x", timeout=30.0, metadata=(("x-envoy-expected-rq-timeout-ms", "250"),))
    short, capped, envoy = served.rec.budgets
    assert short is not None and 0 < short <= 300
    assert capped is not None and 300 < capped <= 1000
    assert envoy is not None and 0 < envoy <= 250


def test_any_executor_gets_deadlines_from_the_interceptor(serve: Callable[..., Served]) -> None:
    served = serve(executor=ThreadPoolExecutor(2), interceptors=[DeadlineServerInterceptor()])
    served.method("Echo")(b"x", timeout=1.0)
    (budget,) = served.rec.budgets
    assert budget is not None and 0 < budget <= 1000 + GRPC_SLACK_MS


def test_prazo_errors_from_the_handler_become_statuses(serve: Callable[..., Served]) -> None:
    served = serve()
    expected = {
        b"deadline": (grpc.StatusCode.DEADLINE_EXCEEDED, REASON_NO_BUDGET_FOR_DOWNSTREAM),
        b"overloaded": (grpc.StatusCode.UNAVAILABLE, "downstream-overloaded"),
        b"full": (grpc.StatusCode.RESOURCE_EXHAUSTED, REASON_QUEUE_FULL),
        b"other": (grpc.StatusCode.NOT_FOUND, None),
    }
    for request, (code, reason) in expected.items():
        with pytest.raises(grpc.RpcError) as caught:
            served.method("Raise")(request, timeout=WAIT_S)
        assert caught.value.code() is code  # type: ignore[attr-defined]
        assert _reason(caught.value) == reason


def test_streams_run_under_the_deadline(serve: Callable[..., Served]) -> None:
    served = serve()
    assert list(served.method("Count", kind="unary_stream")(b"3", timeout=2.0)) == [b"0", b"1", b"2"]
    assert list(served.method("EchoStream", kind="stream_stream")(iter([b"a", b"b"]), timeout=2.0)) == [b"a", b"b"]
    assert served.method("Join", kind="stream_unary")(iter([b"a", b"b"]), timeout=2.0) == b"ab"
    assert len(served.rec.budgets) == 6
    assert all(budget is not None and 0 < budget <= 2000 + GRPC_SLACK_MS for budget in served.rec.budgets)


def test_deadline_exceeded_mid_stream_ends_the_stream(serve: Callable[..., Served]) -> None:
    served = serve()
    responses = served.method("Expire", kind="unary_stream")(b"", timeout=WAIT_S)
    assert next(responses) == b"first"
    with pytest.raises(grpc.RpcError) as caught:
        next(responses)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert _reason(caught.value) == REASON_DEADLINE_EXCEEDED


# -- the server: admission through AdmissionExecutor ----------------------------------------


def test_full_pool_answers_resource_exhausted_at_once_and_keeps_serving(serve: Callable[..., Served]) -> None:
    served = serve(max_workers=1, max_queue=0)
    first = served.method("Block").future(b"x", timeout=WAIT_S)
    assert served.rec.entered.wait(WAIT_S)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        served.method("Echo")(b"refused", timeout=WAIT_S)
    assert time.monotonic() - started < PROMPT_S
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert _reason(caught.value) == REASON_QUEUE_FULL
    assert served.rec.calls == 1  # the refused RPC's handler never ran
    served.rec.gate.set()
    assert first.result(WAIT_S) == b"released"
    # The serving thread is alive: a plain AdmissionPool would have killed it.
    assert served.method("Echo")(b"again", timeout=WAIT_S) == b"again"
    assert served.pool is not None and served.pool.stats()["rejected_full"] == 1


def _trailer(error: grpc.RpcError, key: str) -> str | None:
    return dict(error.trailing_metadata() or ()).get(key)  # type: ignore[attr-defined]


def _refused_while_blocked(served: Served) -> grpc.RpcError:
    """An Echo refused while a Block holds the only worker (the pool has no line)."""
    first = served.method("Block").future(b"x", timeout=WAIT_S)
    assert served.rec.entered.wait(WAIT_S)
    with pytest.raises(grpc.RpcError) as caught:
        served.method("Echo")(b"refused", timeout=WAIT_S)
    served.rec.gate.set()
    assert first.result(WAIT_S) == b"released"
    assert _reason(caught.value) == REASON_QUEUE_FULL
    return caught.value


def test_a_full_pool_pushes_back_with_its_measured_wait(serve: Callable[..., Served]) -> None:
    served = serve(max_workers=1, max_queue=0)
    # Calls for longer than one measuring window (250 ms): the pool's line measures its drain.
    until = time.monotonic() + 0.4
    while time.monotonic() < until:
        assert served.method("Echo")(b"x", timeout=WAIT_S) == b"x"
    error = _refused_while_blocked(served)
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    pushback = _trailer(error, PUSHBACK_KEY)
    assert pushback is not None and int(pushback) >= 1


def test_a_pool_that_has_not_measured_its_drain_sends_no_pushback(serve: Callable[..., Served]) -> None:
    served = serve(max_workers=1, max_queue=0)
    assert _trailer(_refused_while_blocked(served), PUSHBACK_KEY) is None


def test_metadata_deadline_passing_in_line_answers_deadline_exceeded(serve: Callable[..., Served]) -> None:
    served = serve(max_workers=1, max_queue=4)
    first = served.method("Block").future(b"x", timeout=WAIT_S)
    assert served.rec.entered.wait(WAIT_S)
    started = time.monotonic()
    # The client's own deadline is far away: only the server can end this call early.
    with pytest.raises(grpc.RpcError) as caught:
        served.method("Echo")(b"late", timeout=WAIT_S, metadata=(("x-request-budget-ms", "200"),))
    elapsed = time.monotonic() - started
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert _reason(caught.value) == REASON_EXPIRED_IN_QUEUE
    assert 0.15 < elapsed < PROMPT_S
    assert not first.done()  # answered while the worker was still busy: at its own deadline
    assert served.rec.calls == 1
    served.rec.gate.set()
    assert first.result(WAIT_S) == b"released"
    assert served.pool is not None and served.pool.stats()["expired_in_queue"] >= 1


def test_grpc_deadline_frees_the_place_in_line_at_the_deadline(serve: Callable[..., Served]) -> None:
    served = serve(max_workers=1, max_queue=1)
    assert served.pool is not None
    first = served.method("Block").future(b"x", timeout=WAIT_S)
    assert served.rec.entered.wait(WAIT_S)
    with pytest.raises(grpc.RpcError) as caught:
        served.method("Echo")(b"late", timeout=0.2)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    # The pool knew the gRPC deadline (read from the call at submit): the line empties.
    assert _wait_until(lambda: served.pool.stats()["queued"] == 0)  # type: ignore[union-attr]
    assert not first.done()
    with pytest.raises(grpc.RpcError) as refused_place:
        # ...so this one finds the place free instead of a full pool.
        served.method("Echo")(b"waits", timeout=0.2)
    assert refused_place.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    served.rec.gate.set()
    assert first.result(WAIT_S) == b"released"
    assert served.rec.calls == 1
    assert served.pool.stats()["rejected_full"] == 0


def test_expired_on_arrival_never_runs(serve: Callable[..., Served]) -> None:
    served = serve()
    with pytest.raises(grpc.RpcError) as caught:
        served.method("Echo")(b"x", timeout=WAIT_S, metadata=(("x-request-budget-ms", "0"),))
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert _reason(caught.value) == "expired-on-arrival"
    assert served.rec.calls == 0


def test_shutdown_cancelling_answers_queued_rpcs_unavailable(serve: Callable[..., Served]) -> None:
    served = serve(max_workers=1, max_queue=2)
    first = served.method("Block").future(b"x", timeout=WAIT_S)
    assert served.rec.entered.wait(WAIT_S)
    queued = served.method("Echo").future(b"queued", timeout=WAIT_S)
    assert served.pool is not None
    assert _wait_until(lambda: served.pool.stats()["queued"] == 1)  # type: ignore[union-attr]
    served.pool.shutdown(wait=False, cancel_futures=True)
    error = queued.exception(WAIT_S)
    assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
    assert _reason(error) == REASON_SHUTTING_DOWN
    served.rec.gate.set()
    assert first.result(WAIT_S) == b"released"


def test_without_the_interceptor_a_refusal_runs_over_capacity_and_is_logged(
    serve: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    pool = AdmissionPool(max_workers=1, max_queue=0)
    served = serve(executor=AdmissionExecutor(pool), interceptors=None)
    first = served.method("Block").future(b"x", timeout=WAIT_S)
    assert served.rec.entered.wait(WAIT_S)
    with caplog.at_level(logging.ERROR, logger="prazo.bindings.integrations.grpc"):
        assert served.method("Echo")(b"over", timeout=WAIT_S) == b"over"
    assert "DeadlineServerInterceptor" in caplog.text
    served.rec.gate.set()
    assert first.result(WAIT_S) == b"released"


def test_non_rpc_submissions_go_to_the_pool_unchanged() -> None:
    pool = AdmissionPool(max_workers=1, max_queue=0)
    executor = AdmissionExecutor(pool)
    gate = threading.Event()
    try:
        running = executor.submit(gate.wait, WAIT_S)
        with pytest.raises(QueueFull):
            executor.submit(int, "1")
        gate.set()
        assert running.result(WAIT_S) is True
    finally:
        gate.set()
        executor.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"refusal_threads": 0}, ValueError),
        ({"refusal_threads": 1.5}, TypeError),
        ({"refusal_threads": True}, TypeError),
    ],
)
def test_executor_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception]) -> None:
    pool = AdmissionPool(max_workers=1, max_queue=0)
    try:
        with pytest.raises(error, match="refusal_threads"):
            AdmissionExecutor(pool, **kwargs)
    finally:
        pool.shutdown()


def test_executor_needs_an_admission_pool() -> None:
    with ThreadPoolExecutor(1) as plain, pytest.raises(TypeError, match="pool"):
        AdmissionExecutor(plain)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"default_budget_ms": 0}, ValueError, "default_budget_ms"),
        ({"default_budget_ms": math.nan}, ValueError, "default_budget_ms"),
        ({"max_budget_ms": -1}, ValueError, "max_budget_ms"),
        ({"max_budget_ms": "1"}, TypeError, "max_budget_ms"),
    ],
)
def test_interceptor_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=name):
        DeadlineServerInterceptor(**kwargs)


@given(
    arrival_ns=st.integers(0, 10**15),
    waited_ns=st.integers(0, 10**10),
    metadata_ms=st.none() | st.integers(-1000, 10**7),
    grpc_remaining_s=st.none() | st.floats(-10, 1e5, allow_nan=False) | st.just(9.2e18),
    default_ms=st.none() | st.floats(1, 1e6),
    max_ms=st.none() | st.floats(1, 1e6),
)
def test_rpc_deadline_never_extends_any_limit(
    arrival_ns: int,
    waited_ns: int,
    metadata_ms: int | None,
    grpc_remaining_s: float | None,
    default_ms: float | None,
    max_ms: float | None,
) -> None:
    policy = RpcBudgetPolicy(default_budget_ms=default_ms, max_budget_ms=max_ms)
    now_ns = arrival_ns + waited_ns
    incoming = metadata_budget(None if metadata_ms is None else [("x-request-budget-ms", str(metadata_ms))])
    deadline = policy.deadline(arrival_ns, incoming, grpc_remaining_s, now_ns)
    has_grpc = grpc_remaining_s is not None and grpc_remaining_s < 1e12
    if deadline is None:
        assert metadata_ms is None and not has_grpc and default_ms is None
        return
    slack = 1_000  # float rounding of ms to ns
    if max_ms is not None:
        assert deadline.ns <= arrival_ns + max_ms * NS_PER_MS + slack
    if metadata_ms is not None:
        assert deadline.ns <= arrival_ns + max(metadata_ms, 0) * NS_PER_MS + slack
    if has_grpc:
        assert grpc_remaining_s is not None
        assert deadline.ns <= max(now_ns + grpc_remaining_s * 1e9, arrival_ns) + slack
    assert deadline.ns >= arrival_ns


def test_metadata_budget_takes_the_smallest_valid_value() -> None:
    assert metadata_budget(None).budget_ms is None
    assert metadata_budget([("user-agent", "x")]).budget_ms is None
    incoming = metadata_budget(
        [("x-request-budget-ms", "500"), ("x-request-budget-ms", "oops"), ("X-Request-Budget-Ms", "300")]
    )
    assert incoming.budget_ms == 300 and incoming.invalid == 1


# -- the client interceptor -----------------------------------------------------------------


def _client(served: Served, margin_ms: float = 20) -> grpc.Channel:
    return grpc.intercept_channel(served.channel, DeadlineClientInterceptor(margin_ms=margin_ms))


def test_client_sets_the_timeout_from_the_budget(serve: Callable[..., Served]) -> None:
    served = serve()
    channel = _client(served, margin_ms=100)
    with deadline_scope(Deadline.after(1.0)):
        served.method("Echo", channel)(b"x")
        served.method("Echo", channel)(b"x", timeout=0.3)
        served.method("Echo", channel)(b"x", metadata=(("x-request-budget-ms", "200"), ("other", "kept")))
    budget, caller_timeout, caller_metadata = served.rec.budgets
    assert budget is not None and 0 < budget <= 900
    assert caller_timeout is not None and 0 < caller_timeout <= 300
    assert caller_metadata is not None and 0 < caller_metadata <= 200
    sent = served.rec.metadata[2]
    assert int(sent["x-request-budget-ms"]) <= 200 and sent["other"] == "kept"
    # The budget in the metadata never exceeds the caller's, unlike grpc's rounded-up grpc-timeout.
    assert int(served.rec.metadata[0]["x-request-budget-ms"]) <= 900
    assert int(served.rec.metadata[1]["x-request-budget-ms"]) <= 300


def test_client_outside_a_deadline_changes_nothing(serve: Callable[..., Served]) -> None:
    served = serve()
    channel = _client(served)
    served.method("Echo", channel)(b"x")
    assert served.rec.budgets == [None]
    with pytest.raises(grpc.RpcError) as caught:
        served.method("Raise", channel)(b"full")
    assert not isinstance(caught.value, DownstreamOverloaded)


def test_client_refuses_to_call_without_budget(serve: Callable[..., Served]) -> None:
    served = serve()
    channel = _client(served, margin_ms=50)
    with deadline_scope(Deadline.after_ms(30)):
        with pytest.raises(DeadlineExceeded) as unary:
            served.method("Echo", channel)(b"x")
        with pytest.raises(DeadlineExceeded) as streamed:
            next(iter(served.method("Count", channel, kind="unary_stream")(b"2")))
        with pytest.raises(DeadlineExceeded):
            served.method("Join", channel, kind="stream_unary")(iter([b"a"]))
        with pytest.raises(DeadlineExceeded):
            next(iter(served.method("EchoStream", channel, kind="stream_stream")(iter([b"a"]))))
    assert unary.value.reason == streamed.value.reason == REASON_NO_BUDGET_FOR_DOWNSTREAM
    assert served.rec.calls == 0


def test_client_maps_statuses_to_prazo_errors(serve: Callable[..., Served]) -> None:
    served = serve()
    channel = _client(served)
    with deadline_scope(Deadline.after(WAIT_S)):
        for request, expected, status in (
            (b"full", DownstreamOverloadedRpcError, 503),
            (b"overloaded", DownstreamOverloadedRpcError, 503),
            (b"deadline", DeadlineExceededRpcError, 504),
        ):
            with pytest.raises(expected) as caught:
                served.method("Raise", channel)(request)
            assert caught.value.status == status
            assert isinstance(caught.value, grpc.RpcError)
            assert isinstance(caught.value.__cause__, grpc.RpcError)
            assert caught.value.details()  # the original's, still readable
        with pytest.raises(grpc.RpcError) as other:
            served.method("Raise", channel)(b"other")
        assert other.value.code() is grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        assert not isinstance(other.value, (DownstreamOverloaded, DeadlineExceeded))
        future = served.method("Raise", channel).future(b"full")
        assert isinstance(future.exception(WAIT_S), DownstreamOverloadedRpcError)
        with pytest.raises(DownstreamOverloaded):
            future.result()
        stream = served.method("Expire", channel, kind="unary_stream")(b"")
        assert next(stream) == b"first"
        with pytest.raises(DeadlineExceeded):
            next(stream)


def test_client_local_timeout_is_deadline_exceeded(serve: Callable[..., Served]) -> None:
    served = serve(max_workers=1, max_queue=4)
    channel = _client(served)
    with deadline_scope(Deadline.after(WAIT_S)):
        blocked = served.method("Block", channel).future(b"x")
        assert served.rec.entered.wait(WAIT_S)
        with pytest.raises(DeadlineExceeded) as caught:
            served.method("Echo", channel)(b"x", timeout=0.2)
    assert caught.value.reason == REASON_DEADLINE_EXCEEDED
    served.rec.gate.set()
    assert blocked.result(WAIT_S) == b"released"


def test_client_unavailable_server_is_overloaded() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as raw:
        channel = grpc.intercept_channel(raw, DeadlineClientInterceptor())
        with deadline_scope(Deadline.after(WAIT_S)), pytest.raises(DownstreamOverloaded) as caught:
            channel.unary_unary(f"/{SERVICE}/Echo")(b"x")
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_client_margin_is_checked() -> None:
    with pytest.raises(ValueError, match="margin_ms"):
        DeadlineClientInterceptor(margin_ms=-1)
    with pytest.raises(TypeError, match="margin_ms"):
        DeadlineClientInterceptor(margin_ms="20")  # type: ignore[arg-type]


def test_refusal_after_shutdown_without_wait_is_logged_not_raised(
    serve: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    pool = AdmissionPool(max_workers=1, max_queue=2)
    executor = AdmissionExecutor(pool)
    served = serve(executor=executor, interceptors=[DeadlineServerInterceptor()])
    first = served.method("Block").future(b"x", timeout=WAIT_S)
    assert served.rec.entered.wait(WAIT_S)
    with caplog.at_level(logging.WARNING, logger="prazo.bindings.integrations.grpc"):
        late = served.method("Echo").future(b"late", timeout=1.0, metadata=(("x-request-budget-ms", "200"),))
        assert _wait_until(lambda: pool.stats()["queued"] == 1)
        executor.shutdown(wait=False)
        # Nobody is left to answer the refusal at 200 ms: the client's own deadline ends the call.
        error = late.exception(WAIT_S)
        assert _wait_until(lambda: "could not be answered" in caplog.text)
    assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    served.rec.gate.set()
    assert first.result(WAIT_S) == b"released"


def test_pool_shut_down_under_a_running_server_answers_unavailable(serve: Callable[..., Served]) -> None:
    served = serve()
    assert served.pool is not None
    served.pool.shutdown()
    for _ in range(2):  # the serving thread survives the first one
        with pytest.raises(grpc.RpcError) as caught:
            served.method("Echo")(b"x", timeout=WAIT_S)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert _reason(caught.value) == REASON_SHUTTING_DOWN
    assert served.rec.calls == 0
