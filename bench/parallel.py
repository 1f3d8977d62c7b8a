"""CPU-bound tasks on more than one core: ``prazo bench parallel``.

On a CPython with a GIL, two threads running Python share one core however
many the machine has; on a free-threaded one (PEP 703, ``--disable-gil``)
they run at once, and a pool of N workers can do N times the work of one.
This measures that, for ``AdmissionPool`` (whichever per-task path this
interpreter has: the compiled one with the C twin) and for the stdlib's
``ThreadPoolExecutor``, the pool a user would pick instead:

* one *batch* is ``tasks`` CPU-bound pure-Python tasks (a loop of
  ``iterations`` multiply-adds, about 1-2 ms each), submitted at once, then
  waited for; throughput is tasks per second of the whole batch;
* each pool runs with 1 worker and with ``workers`` workers; batches of every
  configuration are interleaved (a noisy moment hits all of them), and the
  median of ``batches`` is reported with the ratio N workers / 1 worker.

A scaling ratio is a property of the interpreter and the CPU, not of prazo
alone: the report names both, with whether the GIL was on.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TextIO

from prazo.bench.harness import cpu_model, integer_argument
from prazo.bindings import pool as pool_module
from prazo.bindings.freethreading import gil_state
from prazo.bindings.pool import AdmissionPool
from prazo.core import Deadline

__all__ = [
    "ParallelReport",
    "ParallelRow",
    "ParallelSettings",
    "add_bench_parallel_arguments",
    "render_parallel_report",
    "run_bench_parallel",
    "run_parallel_bench",
    "spin",
]


def spin(iterations: int) -> int:
    """The task: ``iterations`` multiply-adds in pure Python (no I/O, no C call that drops the GIL)."""
    total = 0
    for i in range(iterations):
        total += i * i
    return total


@dataclass(frozen=True)
class ParallelSettings:
    tasks: int = 200
    iterations: int = 20_000
    workers: int = 2
    batches: int = 5

    def __post_init__(self) -> None:
        for name, low in (("tasks", 1), ("iterations", 1), ("workers", 2), ("batches", 1)):
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")


QUICK_PARALLEL = ParallelSettings(tasks=60, batches=3)


@dataclass(frozen=True)
class ParallelRow:
    pool: str
    workers: int
    tasks_per_s: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.tasks_per_s)


@dataclass
class ParallelReport:
    settings: ParallelSettings
    interpreter: str
    gil: str
    cpu: str
    pool_path: str
    rows: list[ParallelRow] = field(default_factory=list)

    def scaling(self, pool: str) -> float:
        """Median tasks/s with ``settings.workers`` workers over that of one worker, for ``pool``."""
        by_workers = {row.workers: row.median for row in self.rows if row.pool == pool}
        return by_workers[self.settings.workers] / by_workers[1]


def _admission_pool(workers: int, tasks: int) -> Executor:
    # Room for the whole batch in line, so nothing is refused.
    return AdmissionPool(max_workers=workers, max_queue=tasks)


_POOLS: dict[str, Callable[[int, int], Executor]] = {
    "ThreadPoolExecutor": lambda workers, _tasks: ThreadPoolExecutor(max_workers=workers),
    "AdmissionPool": _admission_pool,
}


def _batch_s(executor: Executor, settings: ParallelSettings) -> float:
    deadline = Deadline.after(3600.0)
    start = time.perf_counter()
    if isinstance(executor, AdmissionPool):
        futures = [executor.submit_until(deadline, spin, settings.iterations) for _ in range(settings.tasks)]
    else:
        futures = [executor.submit(spin, settings.iterations) for _ in range(settings.tasks)]
    wait(futures)
    elapsed = time.perf_counter() - start
    failed = [future.exception() for future in futures if future.exception() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {settings.tasks} tasks failed, first: {failed[0]!r}")
    return elapsed


def run_parallel_bench(settings: ParallelSettings) -> ParallelReport:
    """Measure every pool with 1 and ``settings.workers`` workers, batches interleaved."""
    configs = [(name, n) for name in _POOLS for n in (1, settings.workers)]
    executors = {(name, n): _POOLS[name](n, settings.tasks) for name, n in configs}
    samples: dict[tuple[str, int], list[float]] = {config: [] for config in configs}
    try:
        for executor in executors.values():
            _batch_s(executor, settings)  # warm-up: the threads started, the code paths hot
        for _ in range(settings.batches):
            for config in configs:
                samples[config].append(settings.tasks / _batch_s(executors[config], settings))
    finally:
        for executor in executors.values():
            executor.shutdown(wait=True)
    report = ParallelReport(
        settings=settings,
        interpreter=f"{platform.python_implementation()} {platform.python_version()}"
        + ("t" if gil_state().free_threaded_build else ""),
        gil=gil_state().describe(),
        cpu=cpu_model(),
        pool_path="compiled" if pool_module._COMPILED is not None else "Python",
    )
    report.rows = [ParallelRow(name, n, samples[(name, n)]) for name, n in configs]
    return report


def render_parallel_report(report: ParallelReport) -> str:
    settings = report.settings
    lines = [
        f"CPU-bound tasks ({settings.tasks} per batch, {settings.iterations} multiply-adds each), "
        f"median of {settings.batches} batches",
        f"{report.interpreter} on {report.cpu}; {report.gil}",
        f"AdmissionPool's per-task path: {report.pool_path}",
        "",
        f"{'pool':<20} {'workers':>7} {'tasks/s':>10} {'best':>10}",
    ]
    for row in report.rows:
        lines.append(f"{row.pool:<20} {row.workers:>7} {row.median:>10.0f} {max(row.tasks_per_s):>10.0f}")
    lines.append("")
    for name in _POOLS:
        lines.append(f"{name}: {settings.workers} workers / 1 worker = x{report.scaling(name):.2f}")
    return "\n".join(lines)


def add_bench_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``prazo bench parallel`` on ``parser``."""
    defaults = ParallelSettings()

    parser.add_argument(
        "--tasks", type=integer_argument(1), metavar="N", help=f"tasks per batch (default {defaults.tasks})"
    )
    parser.add_argument(
        "--iterations",
        type=integer_argument(1),
        metavar="N",
        help=f"multiply-adds per task (default {defaults.iterations})",
    )
    parser.add_argument(
        "--workers",
        type=integer_argument(2),
        metavar="N",
        help=f"the workers compared with one (default {defaults.workers})",
    )
    parser.add_argument(
        "--batches", type=integer_argument(1), metavar="N", help=f"timed batches (default {defaults.batches})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"a fast, rough run ({QUICK_PARALLEL.tasks} tasks, {QUICK_PARALLEL.batches} batches)",
    )


def run_bench_parallel(args: argparse.Namespace, out: TextIO) -> int:
    """``prazo bench parallel``: print the report."""
    base = QUICK_PARALLEL if getattr(args, "quick", False) else ParallelSettings()
    given = {name: getattr(args, name, None) for name in ("tasks", "iterations", "workers", "batches")}
    settings = ParallelSettings(**{**base.__dict__, **{k: v for k, v in given.items() if v is not None}})
    print(render_parallel_report(run_parallel_bench(settings)), file=out)
    return 0
