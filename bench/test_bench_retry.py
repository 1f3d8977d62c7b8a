"""What a ``RetryBudget`` costs: one deposit (per call) plus one withdrawal (per retry), against a lock.

The competitors, each run in the same local loop:

* ``lock`` — ``threading.Lock`` acquire + release, the floor of anything
  thread-safe in Python;
* ``lock pair`` — two acquire/release pairs, what deposit + withdraw take at the least;
* ``deposit+withdraw`` — ``budget.deposit()`` then ``budget.try_withdraw()``,
  with a budget that always has a token (percent 1.0), so both take their
  full path (each reads the clock and updates the window under the lock);
* ``deposit`` — ``budget.deposit()`` alone, what every call pays.

And what an ``AdaptiveThrottle`` costs (group ``adaptive throttle``): every
attempt asks ``admit()``; a refused one is all a caller pays for a request
it does not send (the issue's bound: under 10 µs), an admitted one adds its
``record()``:

* ``lock`` — the same floor;
* ``refused`` — ``admit()`` on a throttle whose window is full of refusals
  (p at its 0.9 cap): the clock, the window, the formula and a draw;
* ``admit+record`` — ``admit()`` then ``record(True)`` while the destination
  takes everything (p = 0, no draw).

::

    .venv/bin/python -m pytest bench/test_bench_retry.py --benchmark-only
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import pytest
from prazo.bench.harness import LoopRunner
from prazo.bindings.retries import AdaptiveThrottle, RetryBudget

GROUP_RETRY_BUDGET = "retry budget"
GROUP_THROTTLE = "adaptive throttle"


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


@functools.cache
def _refusing() -> AdaptiveThrottle:
    """Made once, outside the timed loops: a window of 10 000 refusals (p at the cap for the run's length)."""
    throttle = AdaptiveThrottle(min_requests=0)
    for _ in range(10_000):
        throttle.admit()
        throttle.record(False)
    return throttle


def _refused(loops: int) -> None:
    admit = _refusing().admit
    for _ in range(loops):
        admit()


def _admit_record(loops: int) -> None:
    throttle = AdaptiveThrottle(min_requests=0)
    admit, record = throttle.admit, throttle.record
    for _ in range(loops):
        admit()
        record(True)


THROTTLE_RUNNERS: dict[str, LoopRunner] = {"lock": _lock, "refused": _refused, "admit+record": _admit_record}

RUNNERS: dict[str, LoopRunner] = {
    "lock": _lock,
    "lock pair": _lock_pair,
    "deposit+withdraw": _deposit_withdraw,
    "deposit": _deposit,
}


@pytest.mark.parametrize("name", list(RUNNERS))
def test_retry_budget(loop_benchmark: Callable[[LoopRunner, str], None], name: str) -> None:
    loop_benchmark(RUNNERS[name], GROUP_RETRY_BUDGET)


@pytest.mark.parametrize("name", list(THROTTLE_RUNNERS))
def test_adaptive_throttle(loop_benchmark: Callable[[LoopRunner, str], None], name: str) -> None:
    loop_benchmark(THROTTLE_RUNNERS[name], GROUP_THROTTLE)
