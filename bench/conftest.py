"""pytest-benchmark set-up for the suites: both twins, per-operation units, handoff summary.

Run with ``make bench`` (or ``.venv/bin/python -m pytest bench --benchmark-only``).

* ``twin`` runs a benchmark once per twin (ids ``c`` and ``py``). A missing
  C twin fails the ``c`` run unless ``PRAZO_NO_EXTENSIONS=1`` asks for the
  Python twin alone, as in the test suite.
* One benchmark round is ``INNER_LOOPS`` (1000) operations (WSGI requests,
  for the middleware), and the table is in microseconds, so its numbers read
  directly as ns per operation. The pool's rounds are whole batches of tasks
  (``extra_info["tasks_per_round"]``) and keep pytest-benchmark's own unit.
* Handoff benchmarks time a whole ping-pong round; the one-way latencies
  (release → waiter running) they record are printed as median and p99 at
  the end of the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from prazo.bench.cli import TwinUnavailable, load_queue_class
from prazo.bench.core import (
    GROUP_HANDOFF,
    Gate,
    HandoffPingPong,
    HandoffSummary,
    pinned,
    placement_cpus,
    summarize_handoff,
)
from prazo.bench.harness import INNER_LOOPS, LoopRunner
from prazo.core import TWINS, extension_wanted

# Ping-pong rounds timed per handoff benchmark, after the warm-up ones.
HANDOFF_ROUNDS = 2000
HANDOFF_WARMUP = 50

_handoff_results: dict[str, HandoffSummary] = {}


@pytest.fixture(scope="session", params=TWINS)
def twin(request: pytest.FixtureRequest) -> object:
    """The ``AdmissionQueue`` class of one twin."""
    try:
        return load_queue_class(request.param)[1]
    except TwinUnavailable as exc:
        if not extension_wanted():
            pytest.skip(f"PRAZO_NO_EXTENSIONS is set: {exc}")
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def loop_benchmark(benchmark: object) -> Callable[[LoopRunner, str], None]:
    """``loop_benchmark(runner, group)``: time ``runner(INNER_LOOPS)`` rounds in ``group``."""

    def run(runner: LoopRunner, group: str) -> None:
        benchmark.group = f"{group}: 1 round = {INNER_LOOPS} ops, so us/round = ns/op"  # type: ignore[attr-defined]
        benchmark.extra_info["ops_per_round"] = INNER_LOOPS  # type: ignore[attr-defined]
        benchmark(runner, INNER_LOOPS)  # type: ignore[operator]

    return run


@pytest.fixture
def handoff_benchmark(request: pytest.FixtureRequest, benchmark: object) -> Callable[[Gate, str], None]:
    """``handoff_benchmark(gate, placement)``: time ping-pong rounds, keep the one-way latencies.

    The summary goes to the end-of-run table and to the JSON output
    (``extra_info``); with ``--benchmark-disable`` the single round is only a smoke test.
    """

    def run(gate: Gate, placement: str) -> None:
        caller_cpu, waiter_cpu = placement_cpus(placement)
        benchmark.group = f"{GROUP_HANDOFF}, {placement}: 1 round = 2 handoffs + re-queue"  # type: ignore[attr-defined]
        with pinned(caller_cpu), HandoffPingPong(gate, waiter_cpu=waiter_cpu) as ping_pong:
            benchmark.pedantic(  # type: ignore[attr-defined]
                ping_pong.round_trip, rounds=HANDOFF_ROUNDS, warmup_rounds=HANDOFF_WARMUP
            )
        if benchmark.disabled:  # type: ignore[attr-defined]
            return
        summary = summarize_handoff(ping_pong.latencies_ns[HANDOFF_WARMUP:])
        _handoff_results[request.node.name] = summary
        benchmark.extra_info.update(  # type: ignore[attr-defined]
            handoff_median_us=summary.median_us, handoff_p99_us=summary.p99_us, handoff_samples=summary.samples
        )

    return run


def pytest_benchmark_scale_unit(
    config: pytest.Config, unit: str, benchmarks: Sequence[Any], best: object, worst: object, sort: str
) -> tuple[str, float] | None:
    # Microseconds per 1000-operation round are nanoseconds per operation;
    # a group of whole pool batches keeps the automatic unit, and an explicit
    # --benchmark-time-unit still wins.
    if any("tasks_per_round" in bench["extra_info"] for bench in benchmarks):
        return None
    if unit == "seconds" and config.getoption("benchmark_time_unit", None) in (None, "auto"):
        return "u", 1e6
    return None


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _handoff_results:
        return
    width = max(len(name) for name in _handoff_results) + 2
    terminalreporter.section("handoff latency: release -> waiter running (one way)")
    terminalreporter.write_line(f"{'benchmark':<{width}}{'median us':>10}{'p99 us':>10}  samples")
    for name, summary in sorted(_handoff_results.items()):
        terminalreporter.write_line(
            f"{name:<{width}}{summary.median_us:>10.1f}{summary.p99_us:>10.1f}  {summary.samples}"
        )
