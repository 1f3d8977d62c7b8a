"""The parameters of one ``prazo bench goodput`` run (``GoodputSettings``) and its default offered loads.

Every other part of the bench reads them: the servers' command lines
(``prazo.bench.goodput_servers``), the measurement
(``prazo.bench.goodput_measure``), the report (``prazo.bench.goodput_report``)
and the command (``prazo.bench.goodput``), which builds them from its options.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_LOADS",
    "QUICK",
    "QUICK_LOADS",
    "WORKER_LOADS",
    "WORKER_QUICK_LOADS",
    "GoodputSettings",
]

DEFAULT_LOADS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
QUICK_LOADS = (0.5, 3.0, 10.0)
# --workers adds issue 21's refusal check just below capacity (REFUSAL_TARGET_PCT at 0.9x).
WORKER_LOADS = (0.5, 0.9, 1.0, 2.0, 3.0, 5.0, 10.0)
WORKER_QUICK_LOADS = (0.5, 0.9, 3.0, 10.0)


@dataclass(frozen=True)
class GoodputSettings:
    """Parameters of one ``prazo bench goodput`` run."""

    servers: tuple[str, ...] = ()
    apps: tuple[str, ...] = ("cpu", "io")
    loads: tuple[float, ...] = DEFAULT_LOADS
    seconds: float = 4.0
    warmup_s: float = 1.0
    capacity_seconds: float = 2.0
    threads: int = 4
    max_queue: int = 20
    budget_ms: float = 1000.0
    capacity_budget_ms: float = 10_000.0
    max_requests: int = 50_000
    seed: int = 1
    workloads: tuple[str, ...] = ("steady",)
    # The drop workload's measured window: a third at full speed, a third with
    # the app DROP_FACTOR x slower, a third to recover; and its loads (None: ``loads``).
    drop_seconds: float = 30.0
    drop_loads: tuple[float, ...] | None = None
    # None: today's comparison, every server one process (``SERVERS``). N: the
    # multi-process hosts of issue 21 (``WORKER_SERVERS``), N processes each,
    # ``threads`` per process and ``max_queue`` for the whole host.
    workers: int | None = None

    @property
    def processes(self) -> int:
        """Processes per server: ``workers``, or 1 for the single-process comparison."""
        return self.workers or 1

    @property
    def queue_per_process(self) -> int:
        """Each process's share of ``max_queue`` where every process has a line of its own (rounded up).

        So a host of N independent lines (prazo's gunicorn worker, granian's
        backpressure, the SO_REUSEPORT doors) waits for at least as many as the
        front door's one line, and the comparison is of the sharing, not the sizes.
        """
        return -(-self.max_queue // self.processes)

    def loads_of(self, workload: str) -> tuple[float, ...]:
        """The offered loads of ``workload`` (drop points are long: they may have loads of their own)."""
        return self.drop_loads if workload == "drop" and self.drop_loads else self.loads


QUICK = GoodputSettings(loads=QUICK_LOADS, seconds=2.5, capacity_seconds=1.0, drop_seconds=9.0)
