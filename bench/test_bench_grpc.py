"""prazo's gRPC bindings against plain grpcio: the cost per unary RPC on loopback.

The competitors are defined once in ``prazo.bench.grpc_overhead`` (see its
docstring; ``python -m prazo.bench.grpc_overhead`` runs them interleaved).
One round is ``CALLS`` sequential RPCs, so the per-RPC cost is the round time
divided by ``CALLS`` (``extra_info["calls_per_round"]``)::

    .venv/bin/python -m pytest bench/test_bench_grpc.py --benchmark-only -p no:cacheprovider
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prazo.bench.grpc_overhead import CALLS, COMPETITORS, served

ROUNDS = 15


@pytest.fixture(params=COMPETITORS)
def rpc_round(request: pytest.FixtureRequest) -> Iterator[Callable[[], None]]:
    with served(request.param) as round_of_calls:
        yield round_of_calls


def _collect_garbage() -> None:
    gc.collect()


def test_grpc_unary_rpc(benchmark: Any, rpc_round: Callable[[], None]) -> None:
    benchmark.group = f"gRPC unary echo on loopback: 1 round = {CALLS} sequential RPCs"
    benchmark.extra_info["calls_per_round"] = CALLS
    benchmark.pedantic(rpc_round, setup=_collect_garbage, rounds=ROUNDS)
