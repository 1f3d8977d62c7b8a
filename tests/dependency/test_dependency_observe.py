"""``Dependency(observe_only=True)``: the bulkhead only counts; every call runs, with real threads.

Two places and five calls held in ``fn``: enforcing, two would run and three
would be refused at once (``bulkhead_full``). Observing, all five run and
return their values, and ``stats()`` counts the three as the bulkhead would
have (``outcomes["bulkhead_full"]``), with ``in_flight`` the places it would
hold. A call after the burst has a place again.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from _helpers import wait_until
from prazo.bindings.dependency import Dependency

WAIT_S = 10.0


def test_an_observing_bulkhead_runs_every_call_and_counts_what_it_would_have_refused() -> None:
    dependency = Dependency("recs", max_concurrent=2, timeout_ms=5000, observe_only=True)
    gate = threading.Event()
    entered: list[int] = []

    def fn(n: int) -> int:
        entered.append(n)
        gate.wait(WAIT_S)
        return n

    with ThreadPoolExecutor(max_workers=5) as callers:
        try:
            futures = [callers.submit(dependency.call, fn, n) for n in range(5)]
            wait_until(lambda: len(entered) == 5, "all five calls to run fn")
            stats = dependency.stats()
            assert (stats["observe_only"], stats["in_flight"], stats["max_concurrent"]) == (1, 2, 2)
        finally:
            gate.set()
        values = sorted(future.result(WAIT_S) for future in futures)
    assert values == [0, 1, 2, 3, 4], "every caller got its own value"
    wait_until(lambda: dependency.stats()["in_flight"] == 0, "the places to come back")
    outcomes = dependency.stats()["outcomes"]
    assert (outcomes["ok"], outcomes["bulkhead_full"]) == (2, 3)
    assert dependency.call(lambda: "again") == "again"
    assert dependency.stats()["outcomes"]["ok"] == 3


def test_observe_only_is_a_bool() -> None:
    with pytest.raises(TypeError, match="observe_only"):
        Dependency("recs", max_concurrent=1, timeout_ms=100, observe_only="yes")  # type: ignore[arg-type]
