"""The competitors of the gRPC overhead benchmark, defined once, and an interleaved runner.

``bench/test_bench_grpc.py`` times them with pytest-benchmark; this runner
alternates all of them round after round in one process, which keeps a noisy
machine's drift out of the comparison, and prints µs per RPC (best and median
round) and the ratio to plain grpcio::

    .venv/bin/python -m prazo.bench.grpc_overhead --rounds 40

One round is ``CALLS`` sequential unary RPCs (a 16-byte echo, bytes
serializers, client and server in this process, the server on 4 workers),
each with a 5 s ``timeout``. Competitors:

* ``plain``: ``grpc.server(ThreadPoolExecutor(4))``, a plain channel;
* ``server-interceptor``: the same plus ``DeadlineServerInterceptor``;
* ``admission-server``: ``admission_server(AdmissionPool(4, 64))``, a plain channel;
* ``noop-client-interceptor``: that server, and a channel with a client
  interceptor that does nothing (grpc's own interceptor machinery);
* ``admission-both``: that server, and the client under a ``deadline_scope``
  through ``DeadlineClientInterceptor``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import grpc
from prazo.bindings.integrations.grpc.client import DeadlineClientInterceptor
from prazo.bindings.integrations.grpc.server import DeadlineServerInterceptor, admission_server
from prazo.bindings.pool import AdmissionPool
from prazo.core import Deadline, deadline_scope

__all__ = ["CALLS", "COMPETITORS", "main", "served"]

CALLS = 200
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
def served(kind: str) -> Iterator[Callable[[], None]]:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="gRPC unary RPC cost: prazo's bindings against plain grpcio")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per competitor")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    with ExitStack() as stack:
        rounds = {kind: stack.enter_context(served(kind)) for kind in COMPETITORS}
        per_rpc_us: dict[str, list[float]] = {kind: [] for kind in COMPETITORS}
        for _ in range(args.rounds):
            for kind, round_of_calls in rounds.items():
                started = time.perf_counter()
                round_of_calls()
                per_rpc_us[kind].append((time.perf_counter() - started) / CALLS * 1e6)
    best_plain = min(per_rpc_us["plain"])
    median_plain = statistics.median(per_rpc_us["plain"])
    print(f"{'competitor':<24} {'best us/RPC':>11} {'ratio':>6} {'median us/RPC':>13} {'ratio':>6}")
    for kind, samples in per_rpc_us.items():
        best, median = min(samples), statistics.median(samples)
        print(f"{kind:<24} {best:>11.1f} {best / best_plain:>6.2f} {median:>13.1f} {median / median_plain:>6.2f}")


if __name__ == "__main__":
    main()
