"""What ``Dependency.call`` costs per call against the usual way to put a timeout on a blocking call.

The competitors run a no-op ``fn``, so the table shows the isolation's own
cost (hand-over to another thread and back, the bookkeeping):

* ``direct`` — ``fn()`` on the caller's thread: no isolation, no timeout (the baseline);
* ``executor`` — ``ThreadPoolExecutor.submit(fn).result(timeout)``, the naive
  timeout wrapper (an unbounded queue, no bulkhead, no last-known-good);
* ``dependency`` — ``Dependency.call(fn)``: own threads, bulkhead, timeout, histogram;
* ``dependency+lkg`` — the same with a key and ``stale_for_s`` (a last-known-good write per call).

::

    .venv/bin/python -m pytest bench/test_bench_dependency.py --benchmark-only
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from prazo.bench.harness import LoopRunner
from prazo.bindings.dependency import Dependency

GROUP_DEPENDENCY = "dependency call (no-op fn)"
WORKERS = 4
TIMEOUT_S = 1.0


def noop() -> int:
    return 1


def direct(loops: int) -> None:
    for _ in range(loops):
        noop()


@pytest.fixture(params=["direct", "executor", "dependency", "dependency+lkg"])
def runner(request: pytest.FixtureRequest) -> Iterator[LoopRunner]:
    if request.param == "direct":
        yield direct
        return
    if request.param == "executor":
        with ThreadPoolExecutor(max_workers=WORKERS) as executor:
            submit = executor.submit

            def through_executor(loops: int) -> None:
                for _ in range(loops):
                    submit(noop).result(TIMEOUT_S)

            through_executor(100)
            yield through_executor
        return
    keyed = request.param == "dependency+lkg"
    dep = Dependency("bench", max_concurrent=WORKERS, timeout_ms=TIMEOUT_S * 1000, stale_for_s=60 if keyed else None)
    call = dep.call
    key = "k" if keyed else None

    def through_dependency(loops: int) -> None:
        for _ in range(loops):
            call(noop, key=key)

    through_dependency(100)
    yield through_dependency
    dep.wait_idle(TIMEOUT_S)


def test_dependency_call(loop_benchmark: Callable[[LoopRunner, str], None], runner: LoopRunner) -> None:
    loop_benchmark(runner, GROUP_DEPENDENCY)
