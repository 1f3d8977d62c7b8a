"""What a ``RetryBudget`` costs: one deposit (per call) plus one withdrawal (per retry), against a lock.

The competitors, each run in the same local loop:

* ``lock`` — ``threading.Lock`` acquire + release, the floor of anything
  thread-safe in Python;
* ``lock pair`` — two acquire/release pairs, what deposit + withdraw take at the least;
* ``deposit+withdraw`` — ``budget.deposit()`` then ``budget.try_withdraw()``,
  with a budget that always has a token (percent 1.0), so both take their
  full path (each reads the clock and updates the window under the lock);
* ``deposit`` — ``budget.deposit()`` alone, what every call pays.

::

    .venv/bin/python -m pytest bench/test_bench_retry.py --benchmark-only
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from prazo.bench.harness import LoopRunner
from prazo.bindings.retries import RetryBudget

GROUP_RETRY_BUDGET = "retry budget"


def _lock(loops: int) -> None:
    lock = threading.Lock()
    acquire, release = lock.acquire, lock.release
    for _ in range(loops):
        acquire()
        release()


def _lock_pair(loops: int) -> None:
    lock = threading.Lock()
    acquire, release = lock.acquire, lock.release
    for _ in range(loops):
        acquire()
        release()
        acquire()
        release()


def _deposit_withdraw(loops: int) -> None:
    budget = RetryBudget(percent=1.0, min_per_s=0)
    deposit, withdraw = budget.deposit, budget.try_withdraw
    for _ in range(loops):
        deposit()
        withdraw()


def _deposit(loops: int) -> None:
    budget = RetryBudget(percent=1.0, min_per_s=0)
    deposit = budget.deposit
    for _ in range(loops):
        deposit()


RUNNERS: dict[str, LoopRunner] = {
    "lock": _lock,
    "lock pair": _lock_pair,
    "deposit+withdraw": _deposit_withdraw,
    "deposit": _deposit,
}


@pytest.mark.parametrize("name", list(RUNNERS))
def test_retry_budget(loop_benchmark: Callable[[LoopRunner, str], None], name: str) -> None:
    loop_benchmark(RUNNERS[name], GROUP_RETRY_BUDGET)
