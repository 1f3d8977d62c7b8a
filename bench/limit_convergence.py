"""How ``AdmissionQueue(limit="vegas")`` settles on real workloads: the limit over time.

Usage::

    python -m prazo.bench.limit_convergence [--seconds 10] [--clients 48] [--max-concurrency 32]
        [--workloads cpu,io] [--plot FILE.png]

For each workload a real ``AdmissionQueue(max_concurrency, clients,
limit="vegas")`` gates ``clients`` closed-loop threads; each thread loops
``with q.slot(deadline): work()`` (5 s budgets, so nothing expires), and a
sampler records ``q.limit`` and ``in_flight`` every 20 ms. The queue learns
from the slots' own service times (``Slot.__exit__`` passes its start).

* ``cpu``: 10 ms of Python CPU per request (``goodput_apps.burn_cpu``). Under
  the GIL a request's service time grows with the number running, so the
  right limit is small: Vegas should settle at 1-4.
* ``io``: a 50 ms sleep. Service time is flat, so the limit climbs to
  ``max_concurrency`` (dipping to half of it for one window at each probe of
  the no-load time).

Prints, per workload, the limit's median and range over the last third of the
run (the settled limit) and the throughput; ``--plot`` draws both limits over
time (needs the ``plot`` extra: matplotlib). The committed figure is
``bench/limit_convergence.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prazo.core import AdmissionQueue, Deadline, DeadlineExceeded, QueueFull

from .goodput_apps import burn_cpu

__all__ = ["WORKLOADS", "Trace", "main", "run_workload"]

SAMPLE_PERIOD_S = 0.02
CLIENT_BUDGET_S = 5.0


def _io_work() -> None:
    time.sleep(0.05)


def _cpu_work() -> None:
    burn_cpu(10.0)


# name -> (what one request does, a description for the plot)
WORKLOADS: dict[str, tuple[Callable[[], None], str]] = {
    "cpu": (_cpu_work, "CPU-bound: 10 ms of Python CPU per request"),
    "io": (_io_work, "I/O-bound: 50 ms sleep per request"),
}


@dataclass
class Trace:
    """One workload's run: the limit and in_flight sampled over time, and what got done."""

    workload: str
    seconds: float
    max_concurrency: int
    times_s: list[float] = field(default_factory=list)
    limits: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)
    completed: int = 0
    refused: int = 0

    def settled(self) -> list[int]:
        """The limits sampled over the last third of the run."""
        cut = self.seconds * 2 / 3
        return [limit for t, limit in zip(self.times_s, self.limits) if t >= cut] or self.limits[-1:]

    def summary(self) -> str:
        settled = self.settled()
        return (
            f"{self.workload}: settled limit median {statistics.median(settled):g} "
            f"(range {min(settled)}-{max(settled)}, max_concurrency {self.max_concurrency}); "
            f"{self.completed / self.seconds:.0f} requests/s, {self.refused} refused"
        )


def run_workload(workload: str, *, seconds: float, clients: int, max_concurrency: int) -> Trace:
    """Run one workload through a real Vegas-limited queue for ``seconds``; return its trace."""
    work, _ = WORKLOADS[workload]
    q = AdmissionQueue(max_concurrency, clients, limit="vegas")
    trace = Trace(workload, seconds, max_concurrency)
    stop = threading.Event()
    counts_lock = threading.Lock()

    go = threading.Event()

    def client() -> None:
        done = refused = 0
        go.wait()
        while not stop.is_set():
            try:
                with q.slot(Deadline.after(CLIENT_BUDGET_S)):
                    work()
                done += 1
            except (QueueFull, DeadlineExceeded):
                refused += 1
        with counts_lock:
            trace.completed += done
            trace.refused += refused

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    # Started before the clock runs: starting threads while others burn the
    # GIL would take seconds of the run.
    for thread in threads:
        thread.start()
    start = time.monotonic()
    go.set()
    while (elapsed := time.monotonic() - start) < seconds:
        trace.times_s.append(elapsed)
        trace.limits.append(q.limit)
        trace.in_flight.append(q.stats()["in_flight"])
        time.sleep(SAMPLE_PERIOD_S)
    stop.set()
    for thread in threads:
        thread.join()
    return trace


def plot(traces: Sequence[Trace], path: str) -> None:
    """Both limits over time, one panel per workload, in_flight shaded behind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 3.2 * len(traces)), squeeze=False)
    for ax, trace in zip(axes[:, 0], traces):
        ax.fill_between(trace.times_s, trace.in_flight, step="post", alpha=0.25, label="in_flight")
        ax.step(trace.times_s, trace.limits, where="post", linewidth=1.6, label='limit ("vegas")')
        ax.axhline(trace.max_concurrency, color="grey", linestyle=":", linewidth=1, label="max_concurrency")
        ax.set_title(f"{WORKLOADS[trace.workload][1]} - {trace.summary().split(';')[0].split(': ', 1)[1]}")
        ax.set_ylabel("slots")
        ax.set_ylim(0, trace.max_concurrency * 1.1)
        ax.legend(loc="center right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle("AdmissionQueue(limit='vegas'): the limit converges from 4", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prazo.bench.limit_convergence", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per workload (default 10)")
    parser.add_argument("--clients", type=int, default=48, help="closed-loop client threads (default 48)")
    parser.add_argument("--max-concurrency", type=int, default=32, help="the limit's ceiling (default 32)")
    parser.add_argument("--workloads", default="cpu,io", help="comma-separated: cpu, io (default both)")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="draw the limit over time (needs matplotlib)")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        parser.error(f"--workloads must name some of {', '.join(WORKLOADS)}, got {args.workloads!r}")
    if args.seconds <= 0 or args.clients < 1 or args.max_concurrency < 1:
        parser.error("--seconds, --clients and --max-concurrency must be positive")
    traces = []
    for name in names:
        trace = run_workload(name, seconds=args.seconds, clients=args.clients, max_concurrency=args.max_concurrency)
        print(trace.summary(), flush=True)
        traces.append(trace)
    if args.plot:
        plot(traces, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
