"""The admission queue against the stdlib primitives a user would otherwise reach for.

Every operation is defined once in ``prazo.bench.core`` and shared
with ``prazo bench core``; this module only lays them out as pytest-benchmark
groups, each competitor side by side with its baseline, both twins where the
admission queue takes part::

    .venv/bin/python -m pytest bench --benchmark-only
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prazo.bench.core import (
    DEPTHS,
    GROUP_DEPTH,
    GROUP_GATE,
    GROUP_WORK_QUEUE,
    STDLIB_GATE_OPS,
    STDLIB_WORK_QUEUE_OPS,
    TWIN_GATE_OPS,
    TWIN_WORK_QUEUE_OPS,
    ConditionGate,
    ConstantDepthRoundTrip,
    Gate,
    StdlibOperation,
    TwinOperation,
    admission_gate,
    empty_loop,
    handoff_placements,
)
from prazo.bench.harness import LoopRunner

LoopBenchmark = Callable[[LoopRunner, str], None]
HandoffBenchmark = Callable[[Gate, str], None]


def test_gate_empty_loop(loop_benchmark: LoopBenchmark) -> None:
    """The loop overhead every other runner pays too (subtract it to get the operation alone)."""
    loop_benchmark(empty_loop(), GROUP_GATE)


STDLIB_CASES = [(GROUP_GATE, op) for op in STDLIB_GATE_OPS] + [(GROUP_WORK_QUEUE, op) for op in STDLIB_WORK_QUEUE_OPS]
TWIN_CASES = [(GROUP_GATE, op) for op in TWIN_GATE_OPS] + [(GROUP_WORK_QUEUE, op) for op in TWIN_WORK_QUEUE_OPS]


@pytest.mark.parametrize(("group", "operation"), STDLIB_CASES, ids=[op.key for _, op in STDLIB_CASES])
def test_stdlib(loop_benchmark: LoopBenchmark, group: str, operation: StdlibOperation) -> None:
    loop_benchmark(operation.make(), group)


@pytest.mark.parametrize(("group", "operation"), TWIN_CASES, ids=[op.key for _, op in TWIN_CASES])
def test_prazo(loop_benchmark: LoopBenchmark, twin: type, group: str, operation: TwinOperation) -> None:
    loop_benchmark(operation.make(twin), group)


@pytest.mark.parametrize("depth", DEPTHS, ids=lambda depth: f"depth-{depth}")
def test_depth_prazo(loop_benchmark: LoopBenchmark, twin: type, depth: int) -> None:
    """Same round trip with ``depth`` items waiting: the cost must not grow with the line."""
    loop_benchmark(ConstantDepthRoundTrip(twin, depth), GROUP_DEPTH)


@pytest.mark.parametrize("placement", handoff_placements())
def test_handoff_condition(handoff_benchmark: HandoffBenchmark, placement: str) -> None:
    handoff_benchmark(ConditionGate(), placement)


@pytest.mark.parametrize("placement", handoff_placements())
def test_handoff_prazo(handoff_benchmark: HandoffBenchmark, twin: type, placement: str) -> None:
    handoff_benchmark(admission_gate(twin), placement)
