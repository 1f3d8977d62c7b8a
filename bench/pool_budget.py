"""Where a no-op task's time goes, per pool: ``python -m prazo.bench.pool_budget [workers] [batches]``.

The per-task budget of issue #13. Each batch submits ``TASKS`` no-op tasks and
waits for all of them (as ``prazo bench pool`` does); batches of the pools are
interleaved and the garbage collector is off while one runs. Per task, in
microseconds (medians over the batches):

* ``submit``: CPU time of the submitting thread in the submit loop (future,
  work item, context, admission, hand-off to the line);
* ``wait``: CPU time of the submitting thread in ``concurrent.futures.wait``;
* ``workers``: CPU time of every other thread (take, run, release the slot,
  settle the future, wake whoever waits on it; the reaper, if any);
* ``cpu`` and ``wall`` for the whole batch.

Then the Python-level calls per task (``sys.setprofile`` on every thread),
which is what the compiled path removes. ``AdmissionPool`` runs on both of
its paths (``prazo.bindings.pool.use_compiled_path``).
"""

from __future__ import annotations

import collections
import gc
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from types import FrameType
from typing import Any

from prazo.bindings import pool as pool_module
from prazo.bindings.pool import AdmissionPool
from prazo.core import Deadline

TASKS = 20_000
_BUDGET_S = 3600.0


def _noop() -> None:
    """The task."""


def _admission_pool(workers: int, compiled: bool) -> Callable[[], Executor]:
    def make() -> Executor:
        previous = pool_module.use_compiled_path(compiled)
        try:
            return AdmissionPool(workers, TASKS)
        finally:
            pool_module.use_compiled_path(previous)

    return make


def _submit_all(executor: Executor, tasks: int) -> list[Future[None]]:
    if isinstance(executor, AdmissionPool):
        submit_until, deadline = executor.submit_until, Deadline.after(_BUDGET_S)
        return [submit_until(deadline, _noop) for _ in range(tasks)]
    submit = executor.submit
    return [submit(_noop) for _ in range(tasks)]


def _pools(workers: int) -> dict[str, Callable[[], Executor]]:
    pools: dict[str, Callable[[], Executor]] = {"ThreadPoolExecutor.submit(fn)": lambda: ThreadPoolExecutor(workers)}
    pools["AdmissionPool.submit_until(d, fn), Python path"] = _admission_pool(workers, False)
    if pool_module.compiled_path():
        pools["AdmissionPool.submit_until(d, fn), compiled path"] = _admission_pool(workers, True)
    return pools


def cpu_budget(workers: int, batches: int) -> dict[str, list[float]]:
    """Median microseconds per task: submit, wait, workers, cpu, wall."""
    executors = {label: make() for label, make in _pools(workers).items()}
    samples: dict[str, list[tuple[float, ...]]] = {label: [] for label in executors}
    try:
        for executor in executors.values():
            wait(_submit_all(executor, TASKS))
        for _ in range(batches):
            for label, executor in executors.items():
                gc.collect()
                gc.disable()
                try:
                    wall0, cpu0, mine0 = time.perf_counter(), time.process_time(), time.thread_time()
                    futures = _submit_all(executor, TASKS)
                    mine1 = time.thread_time()
                    wait(futures)
                    wall1, cpu1, mine2 = time.perf_counter(), time.process_time(), time.thread_time()
                finally:
                    gc.enable()
                cpu = cpu1 - cpu0
                samples[label].append((mine1 - mine0, mine2 - mine1, cpu - (mine2 - mine0), cpu, wall1 - wall0))
    finally:
        for executor in executors.values():
            executor.shutdown(wait=True)
    return {
        label: [statistics.median(sample[i] for sample in rows) / TASKS * 1e6 for i in range(5)]
        for label, rows in samples.items()
    }


def python_calls(workers: int, tasks: int = 2_000) -> dict[str, tuple[float, list[tuple[str, float]]]]:
    """Python-level function calls per task (every thread), and the most frequent ones."""
    found: dict[str, tuple[float, list[tuple[str, float]]]] = {}
    for label, make in _pools(workers).items():
        counts: collections.Counter[str] = collections.Counter()

        def profile(frame: FrameType, event: str, _arg: Any, counts: collections.Counter[str] = counts) -> None:
            if event == "call":
                counts[frame.f_code.co_qualname] += 1

        # Installed before the pool starts its threads, so they are profiled too.
        threading.setprofile(profile)
        executor = make()
        try:
            wait(_submit_all(executor, 50))
            time.sleep(0.1)
            counts.clear()
            sys.setprofile(profile)
            wait(_submit_all(executor, tasks))
            sys.setprofile(None)
            time.sleep(0.1)
            total = sum(counts.values())
            found[label] = (total / tasks, [(name, n / tasks) for name, n in counts.most_common(8)])
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            executor.shutdown(wait=True)
    return found


def main(argv: list[str]) -> int:
    workers = int(argv[0]) if argv else 4
    batches = int(argv[1]) if len(argv) > 1 else 7
    print(
        f"{workers} workers · {TASKS:,} no-op tasks per batch · medians of {batches} interleaved batches · µs per task"
    )
    print(f"{'':52}{'submit':>8}{'wait':>8}{'workers':>9}{'cpu':>8}{'wall':>8}")
    for label, (submit, waited, in_workers, cpu, wall) in cpu_budget(workers, batches).items():
        print(f"{label:52}{submit:8.2f}{waited:8.2f}{in_workers:9.2f}{cpu:8.2f}{wall:8.2f}")
    print("\nPython-level calls per task (sys.setprofile, every thread)")
    for label, (per_task, top) in python_calls(workers).items():
        print(f"  {label}: {per_task:.1f}  ({', '.join(f'{name} {n:.2f}' for name, n in top)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
