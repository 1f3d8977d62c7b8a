"""What every ``prazo bench`` runner shares: timing loops, settings, targets, report lines, paint.

A runner (``prazo.bench.core``, ``.wsgi``, ``.pool``) times ``LoopRunner`` s
with ``best_ns_per_op`` under ``BenchSettings``, states its goals as
``Target`` s, and renders its report with ``render_heading`` and
``render_targets`` through a ``Paint`` (``plain`` for pipes, files and
tests; the CLI paints a terminal). A runner whose figures depend on the CPU
says where it ran with ``describe_machine`` (its JSON) and ``render_machine``
(its report's line), so figures from two CPUs are never read as one run.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

__all__ = [
    "DEFAULT_SETTINGS",
    "INNER_LOOPS",
    "QUICK",
    "BenchSettings",
    "LoopRunner",
    "Paint",
    "Target",
    "best_ns_per_op",
    "check_counts",
    "cpu_model",
    "describe_machine",
    "format_times",
    "integer_argument",
    "make_target",
    "plain",
    "ratio_of",
    "render_heading",
    "render_machine",
    "render_targets",
    "run_standalone",
]

# Role names understood by a ``Paint`` function (see prazo.bench.cli).
Paint = Callable[[str, str], str]


def plain(text: str, role: str) -> str:
    """The ``Paint`` that adds nothing: for pipes, files and tests."""
    return text


# Operations per timed round: per-round microseconds read directly as per-operation nanoseconds.
INNER_LOOPS = 1000
# A runner repeats its operation ``loops`` times in a local loop, so the harness
# pays its own call overhead once per round (``prazo.bench.core`` explains why).
LoopRunner = Callable[[int], None]


@dataclass(frozen=True)
class BenchSettings:
    """How long to measure: ``repeat`` samples of ``inner`` operations (the best counts), and handoffs."""

    inner: int = INNER_LOOPS
    repeat: int = 100
    handoff_samples: int = 2000

    def __post_init__(self) -> None:
        check_counts(self, inner=1, repeat=1, handoff_samples=2)


def check_counts(settings: object, **minimums: int) -> None:
    """Check that each named field of ``settings`` is an int at least its minimum (TypeError / ValueError)."""
    for name, minimum in minimums.items():
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


DEFAULT_SETTINGS = BenchSettings()
QUICK = BenchSettings(repeat=10, handoff_samples=200)


@dataclass(frozen=True)
class Target:
    """An issue target, its measured ratio, and whether it was met (None: not measurable here)."""

    label: str
    ratio: float | None
    limit: str
    met: bool | None


def ratio_of(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def make_target(label: str, value: float | None, limit: str, test: Callable[[float], bool]) -> Target:
    """A ``Target`` whose verdict is ``test(value)`` (None when ``value`` could not be measured)."""
    return Target(label, value, limit, None if value is None else test(value))


def best_ns_per_op(runners: Mapping[str, LoopRunner], settings: BenchSettings) -> dict[str, float]:
    """Best sample of each runner, in ns per operation, the runners interleaved round-robin.

    Like ``timeit``: the garbage collector is off while timing, and each
    runner is called once untimed first (first-call costs, caches).
    """
    best = {key: float("inf") for key in runners}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for run in runners.values():
            run(settings.inner)
        for _ in range(settings.repeat):
            for key, run in runners.items():
                started = time.perf_counter_ns()
                run(settings.inner)
                best[key] = min(best[key], time.perf_counter_ns() - started)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {key: elapsed / settings.inner for key, elapsed in best.items()}


def format_times(ratio: float | None) -> str:
    """A ratio as ``1.23x``, or ``-`` when it could not be measured."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def render_heading(title: str, detail: str, notes: Sequence[str], paint: Paint = plain) -> list[str]:
    """The first lines of every ``prazo bench`` report: what ran, on what, and any notes."""
    return [
        paint(title, "bold") + f" — {detail}",
        f"{platform.python_implementation()} {platform.python_version()} on {platform.system()}, "
        f"{os.cpu_count()} CPUs — " + paint("on a shared machine the numbers are noisy; compare ratios", "dim"),
        *(paint(f"note: {note}", "warn") for note in notes),
    ]


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as Linux reports it (``cpuinfo``), else what ``platform`` knows.

    Not every kernel writes a ``model name`` (Linux on ARM names the
    implementer and part instead), and other systems have no ``/proc``.
    """
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_machine() -> dict[str, object]:
    """Where a run ran: the CPU model, the CPUs, the system and its kernel, the interpreter (a report's JSON)."""
    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "system": f"{platform.system()} {platform.release()}",
        # "3.13.1t": a free-threaded build (PEP 703), as its own executable is named.
        "python": f"{platform.python_implementation()} {platform.python_version()}"
        + ("t" if sysconfig.get_config_var("Py_GIL_DISABLED") else ""),
    }


def render_machine(machine: Mapping[str, object]) -> str:
    """``describe_machine()`` as a report's line: ``machine: AMD EPYC, 2 CPUs, Linux 6.1.0, CPython 3.11.7``."""
    return f"machine: {machine['cpu_model']}, {machine['cpus']} CPUs, {machine['system']}, {machine['python']}"


def render_targets(targets: Sequence[Target], width: int, paint: Paint = plain) -> list[str]:
    """The ``targets`` block: one ``[pass]`` / ``[MISS]`` / ``[n/a ]`` line per target."""
    out = ["", paint("targets", "bold")]
    for t in targets:
        verdict, role = ("n/a ", "dim") if t.met is None else ("pass", "ok") if t.met else ("MISS", "bad")
        out.append(
            f"  {paint(f'[{verdict}]', role)} {t.label:<{width - 2}}{format_times(t.ratio):>8}  (target {t.limit})"
        )
    return out


def run_standalone(
    prog: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], object],
    run: Callable[[argparse.Namespace, TextIO], int],
    argv: list[str] | None,
    out: TextIO | None,
) -> int:
    """A ``prazo bench`` topic as a program of its own: its flags, parsed from ``argv``; returns the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n", 1)[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), out or sys.stdout)


def seconds_argument(text: str) -> float:
    """An argparse type: a finite number of seconds above 0, else an error saying so (exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def integer_argument(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int from ``minimum`` (to ``maximum``), else an error naming the bounds (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse
