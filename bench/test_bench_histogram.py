"""The latency histogram against the ``hdrhistogram`` package, on the same data, in one run.

Two groups, each with both twins and ``hdrh.histogram.HdrHistogram`` (the
``hdrhistogram`` package from the ``dev`` extra) configured for the same
range and precision (1 ns to 100 s, 2 significant digits)::

    .venv/bin/python -m pytest bench/test_bench_histogram.py --benchmark-only

* **record**: 1000 latencies per round (log-uniform from 1 µs to 10 s, fixed
  seed), each through ``record(ns)`` / ``record_value(ns)``; the empty loop
  over the same list is the overhead all of them pay. µs per round = ns per op.
* **p99 read**: one ``quantile(0.99)`` / ``get_value_at_percentile(99)`` on a
  histogram holding 100 000 of those latencies; µs per read.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest
from prazo.bench.harness import INNER_LOOPS, LoopRunner
from prazo.core import TWINS, HistogramTwin, extension_wanted, load_histogram_twin

hdrh_histogram = pytest.importorskip("hdrh.histogram", reason="the hdrhistogram package (dev extra) is not installed")

GROUP_RECORD = "histogram record"
GROUP_P99 = "histogram p99 read: 1 round = 1 read, in us"
RANGE_NS = (1, 100_000_000_000)
SIGNIFICANT_FIGURES = 2
FILLED = 100_000

LoopBenchmark = Callable[[LoopRunner, str], None]


def latencies(count: int, seed: int = 20261130) -> list[int]:
    """``count`` latencies spread evenly over the orders of magnitude from 1 µs to 10 s."""
    rng = random.Random(seed)
    low, high = math.log(1_000), math.log(10_000_000_000)
    return [round(math.exp(rng.uniform(low, high))) for _ in range(count)]


SAMPLES = latencies(INNER_LOOPS)


def new_hdr() -> Any:
    return hdrh_histogram.HdrHistogram(*RANGE_NS, SIGNIFICANT_FIGURES)


def recording(record: Callable[[int], object]) -> LoopRunner:
    """Feed the first ``loops`` samples to ``record``, bound in a local like every competitor."""

    def run(loops: int) -> None:
        values = SAMPLES[:loops]
        for value in values:
            record(value)

    return run


def empty_loop(loops: int) -> None:
    values = SAMPLES[:loops]
    for _ in values:
        pass


@pytest.fixture(scope="module", params=TWINS)
def hist(request: pytest.FixtureRequest) -> HistogramTwin:
    try:
        return load_histogram_twin(request.param)
    except ImportError as exc:
        if not extension_wanted():
            pytest.skip(f"PRAZO_NO_EXTENSIONS is set: {exc}")
        pytest.fail(f"the C twin is not built ({exc}); run `make build`", pytrace=False)


def test_record_empty_loop(loop_benchmark: LoopBenchmark) -> None:
    """The loop overhead every recorder below pays too."""
    loop_benchmark(empty_loop, GROUP_RECORD)


def test_record_hdrhistogram(loop_benchmark: LoopBenchmark) -> None:
    loop_benchmark(recording(new_hdr().record_value), GROUP_RECORD)


def test_record_prazo(loop_benchmark: LoopBenchmark, hist: HistogramTwin) -> None:
    loop_benchmark(recording(hist.LatencyHistogram().record), GROUP_RECORD)


def test_record_prazo_windowed(loop_benchmark: LoopBenchmark, hist: HistogramTwin) -> None:
    """Into a 10 s window of 10 slices on the real clock (what a dependency's live p95 uses)."""
    loop_benchmark(recording(hist.WindowedHistogram(10.0, slices=10).record), GROUP_RECORD)


@pytest.fixture(scope="module")
def filled_values() -> list[int]:
    return latencies(FILLED, seed=7)


def test_p99_hdrhistogram(benchmark: Any, filled_values: list[int]) -> None:
    hdr = new_hdr()
    for value in filled_values:
        hdr.record_value(value)
    benchmark.group = GROUP_P99
    benchmark(hdr.get_value_at_percentile, 99)


def test_p99_prazo(benchmark: Any, hist: HistogramTwin, filled_values: list[int]) -> None:
    h = hist.LatencyHistogram()
    h.record_many(filled_values)
    benchmark.group = GROUP_P99
    benchmark(h.quantile, 0.99)


def test_p99_prazo_windowed(benchmark: Any, hist: HistogramTwin, filled_values: list[int]) -> None:
    """The live p99 of a 10-slice window: merges the live slices, then reads."""
    w = hist.WindowedHistogram(3600.0, slices=10)
    w.record_many(filled_values)
    benchmark.group = GROUP_P99
    benchmark(w.quantile, 0.99)
