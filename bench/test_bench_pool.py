"""``AdmissionPool`` against ``ThreadPoolExecutor``: whole batches of no-op tasks, end to end.

Every competitor is defined once in ``prazo.bench.pool`` and shared
with ``prazo bench pool``. One round is one batch: submit ``tasks`` no-op
tasks, then wait for all of them; each pool is created and warmed up once,
outside the timing, and a full garbage collection runs before each round
(the collector is off inside it). Throughput is ``tasks / round time``::

    .venv/bin/python -m pytest bench/test_bench_pool.py --benchmark-only
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prazo.bench.pool import (
    GROUP_POOL,
    POOL_COMPETITORS,
    RECORDING_POOL,
    PoolBatch,
    PoolBenchSettings,
    collect_garbage,
    open_batch,
)

SETTINGS = PoolBenchSettings()
ROUNDS = 5


COMPETITORS = (*POOL_COMPETITORS, RECORDING_POOL)


@pytest.fixture(params=COMPETITORS, ids=[competitor.key for competitor in COMPETITORS])
def pool_batch(request: pytest.FixtureRequest) -> Iterator[PoolBatch]:
    """A warmed-up pool of one competitor, shut down after the benchmark."""
    with open_batch(request.param, SETTINGS) as batch:
        yield batch


def test_pool_batch(benchmark: object, pool_batch: PoolBatch) -> None:
    benchmark.group = (  # type: ignore[attr-defined]
        f"{GROUP_POOL}: 1 round = {SETTINGS.tasks} tasks on {SETTINGS.workers} workers"
    )
    benchmark.extra_info["tasks_per_round"] = SETTINGS.tasks  # type: ignore[attr-defined]
    benchmark.pedantic(pool_batch, setup=collect_garbage, rounds=ROUNDS)  # type: ignore[attr-defined]
