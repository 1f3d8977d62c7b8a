"""prazo's gRPC bindings against plain grpcio: the cost per unary RPC on loopback.

One round is ``CALLS`` sequential unary RPCs (a 16-byte echo, bytes
serializers, client and server in this process, the server on 4 workers), so
the per-RPC cost is the round time divided by ``CALLS``
(``extra_info["calls_per_round"]``). Competitors, in one group:

* ``plain``: ``grpc.server(ThreadPoolExecutor(4))``, a plain channel;
* ``server-interceptor``: the same plus ``DeadlineServerInterceptor``;
* ``admission-server``: ``admission_server(AdmissionPool(4, 64))``, a plain channel;
* ``noop-client-interceptor``: that server, and a channel with a client
  interceptor that does nothing (grpc's own interceptor machinery);
* ``admission-both``: that server, and the client under a ``deadline_scope``
  through ``DeadlineClientInterceptor``.

Every call carries a 5 s ``timeout`` (the plain client too), so each server
works with a deadline::

    .venv/bin/python -m pytest bench/test_bench_grpc.py --benchmark-only -p no:cacheprovider
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import grpc
import pytest
from prazo.bindings.grpc import DeadlineClientInterceptor, DeadlineServerInterceptor, admission_server
from prazo.bindings.pool import AdmissionPool
from prazo.core import Deadline, deadline_scope

CALLS = 200
ROUNDS = 15
WARMUP_CALLS = 200
PAYLOAD = b"0123456789abcdef"
METHOD = "/prazo.bench.Echo/Echo"
COMPETITORS = ("plain", "server-interceptor", "admission-server", "noop-client-interceptor", "admission-both")


class _NoopClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    """What grpc's own client-interceptor machinery costs, with nothing of prazo's."""

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(client_call_details, request)


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


@contextmanager
def _served(kind: str) -> Iterator[Callable[[], None]]:
    with ExitStack() as stack:
        if kind == "plain":
            executor: Any = stack.enter_context(ThreadPoolExecutor(4))
            server = grpc.server(executor)
        elif kind == "server-interceptor":
            executor = stack.enter_context(ThreadPoolExecutor(4))
            server = grpc.server(executor, interceptors=[DeadlineServerInterceptor()])
        else:  # the admission server, whatever the client
            pool = AdmissionPool(max_workers=4, max_queue=64)
            stack.callback(pool.shutdown)
            server = admission_server(pool)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "prazo.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        stack.callback(lambda: server.stop(None).wait(10))
        channel: grpc.Channel = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{port}"))
        if kind == "admission-both":
            channel = grpc.intercept_channel(channel, DeadlineClientInterceptor())
        elif kind == "noop-client-interceptor":
            channel = grpc.intercept_channel(channel, _NoopClientInterceptor())
        call = channel.unary_unary(METHOD)

        def round_of_calls() -> None:
            for _ in range(CALLS):
                call(PAYLOAD, timeout=5.0)

        if kind == "admission-both":
            scoped = round_of_calls

            def round_of_calls() -> None:
                with deadline_scope(Deadline.after(60.0)):
                    scoped()

        for _ in range(WARMUP_CALLS // CALLS):
            round_of_calls()
        yield round_of_calls


@pytest.fixture(params=COMPETITORS)
def rpc_round(request: pytest.FixtureRequest) -> Iterator[Callable[[], None]]:
    with _served(request.param) as round_of_calls:
        yield round_of_calls


def _collect_garbage() -> None:
    gc.collect()


def test_grpc_unary_rpc(benchmark: Any, rpc_round: Callable[[], None]) -> None:
    benchmark.group = f"gRPC unary echo on loopback: 1 round = {CALLS} sequential RPCs"
    benchmark.extra_info["calls_per_round"] = CALLS
    benchmark.pedantic(rpc_round, setup=_collect_garbage, rounds=ROUNDS)
