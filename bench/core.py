"""Core micro-benchmarks: one definition of every measured operation.

The pytest-benchmark suite (``bench/test_bench_core.py``) and ``prazo bench
core`` (``run_core_bench``) import the operations from here, so both time
exactly the same code.

Fair measurement on a small, noisy machine:

* Every loop operation is a *runner*, ``run(loops)``, that repeats the
  operation ``loops`` times in a local ``for`` loop with the bound methods
  already in locals. The harness pays its own call overhead once per 1000
  operations instead of once per operation, and every competitor has the
  same loop shape.
* ``run_core_bench`` takes the best of many short samples (like ``timeit``),
  interleaving the competitors round-robin so a noisy moment hits them all,
  with the garbage collector off, and reports nanoseconds per operation net
  of the empty loop measured in the same run.
* Handoff latency is measured from the releasing thread's clock read just
  before ``release()`` to the woken thread's clock read just after its
  ``acquire()`` returned (``HandoffPingPong``); the releasing thread drops
  the GIL right after ``release()``, so harness code never delays the waiter.
  A wake-up on the same CPU and one across CPUs differ several-fold and an
  unpinned run lands on either by chance, so both threads are pinned and each
  placement is reported on its own (where ``os.sched_setaffinity`` exists).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prazo.bench.harness import (
    DEFAULT_SETTINGS,
    BenchSettings,
    LoopRunner,
    Paint,
    Target,
    best_ns_per_op,
    format_times,
    make_target,
    plain,
    ratio_of,
    render_heading,
    render_targets,
)
from prazo.core import AdmissionQueue, Deadline

if TYPE_CHECKING:  # typing.Self is 3.11+; annotations are never evaluated at runtime here
    from typing_extensions import Self

__all__ = [
    "DEPTHS",
    "GROUP_DEPTH",
    "GROUP_GATE",
    "GROUP_HANDOFF",
    "GROUP_WORK_QUEUE",
    "PLACEMENT_CROSS_CPU",
    "PLACEMENT_SAME_CPU",
    "PLACEMENT_UNPINNED",
    "STDLIB_GATE_OPS",
    "STDLIB_WORK_QUEUE_OPS",
    "TWIN_GATE_OPS",
    "TWIN_WORK_QUEUE_OPS",
    "ConditionGate",
    "ConstantDepthRoundTrip",
    "CoreBenchReport",
    "Gate",
    "HandoffPingPong",
    "HandoffSummary",
    "Row",
    "StdlibOperation",
    "TwinOperation",
    "admission_gate",
    "empty_loop",
    "handoff_gates",
    "handoff_placements",
    "measure_handoffs",
    "pinned",
    "placement_cpus",
    "render_core_report",
    "run_core_bench",
    "summarize_handoff",
]

QueueClass = type[AdmissionQueue]


# Queue depths compared for the "cost does not grow with depth" target.
DEPTHS = (10, 10_000)

# Far enough that no deadline in a benchmark ever passes, near enough to be a
# real deadline (the timed-wait path, not the wait-forever one).
_BENCH_BUDGET_S = 3600.0

GROUP_GATE = "gate fast path (uncontended)"
GROUP_WORK_QUEUE = "work-queue round trip"
GROUP_DEPTH = "work-queue round trip at constant depth"
GROUP_HANDOFF = "handoff latency: release -> waiter running"


# -- loop operations --------------------------------------------------------------


def empty_loop() -> LoopRunner:
    """The loop alone: the overhead every other runner also pays."""

    def run(loops: int) -> None:
        for _ in range(loops):
            pass

    return run


def _acquire_release_pair(lock: threading.Lock | threading.BoundedSemaphore) -> LoopRunner:
    def run(loops: int) -> None:
        acquire, release = lock.acquire, lock.release
        for _ in range(loops):
            acquire()
            release()

    return run


def lock_pair() -> LoopRunner:
    return _acquire_release_pair(threading.Lock())


def lock_with() -> LoopRunner:
    lock = threading.Lock()

    def run(loops: int) -> None:
        for _ in range(loops):
            with lock:
                pass

    return run


def bounded_semaphore_pair() -> LoopRunner:
    return _acquire_release_pair(threading.BoundedSemaphore(1))


def stdlib_queue_put_get() -> LoopRunner:
    q: queue.Queue[int] = queue.Queue(1)

    def run(loops: int) -> None:
        put, get = q.put, q.get
        for _ in range(loops):
            put(1)
            get()

    return run


def stdlib_queue_round_trip() -> LoopRunner:
    q: queue.Queue[int] = queue.Queue(1)

    def run(loops: int) -> None:
        put, get, task_done = q.put, q.get_nowait, q.task_done
        for _ in range(loops):
            put(1)
            get()
            task_done()

    return run


def admission_slot(queue_class: QueueClass) -> LoopRunner:
    q = queue_class(1, 0)

    def run(loops: int) -> None:
        slot, deadline = q.slot, Deadline.after(_BENCH_BUDGET_S)
        for _ in range(loops):
            with slot(deadline):
                pass

    return run


def admission_acquire_release(queue_class: QueueClass) -> LoopRunner:
    q = queue_class(1, 0)

    def run(loops: int) -> None:
        acquire, release, deadline = q.acquire, q.release, Deadline.after(_BENCH_BUDGET_S)
        for _ in range(loops):
            acquire(deadline)
            release()

    return run


def admission_round_trip(queue_class: QueueClass) -> LoopRunner:
    q = queue_class(1, 0)

    def run(loops: int) -> None:
        put, get, task_done = q.put, q.get_nowait, q.task_done
        deadline = Deadline.after(_BENCH_BUDGET_S)
        for _ in range(loops):
            put(1, deadline)
            get()
            task_done()

    return run


class ConstantDepthRoundTrip:
    """A runner: ``put`` + ``task_done`` + ``get_nowait`` with ``depth`` items always waiting.

    One slot, held by the item last taken; ``put`` joins the tail (depth + 1),
    ``task_done`` hands the slot to the head (depth again) and ``get_nowait``
    takes it, so the line never shrinks or grows between iterations::

        run = ConstantDepthRoundTrip(AdmissionQueue, 10_000)
        run(1000)
        assert run.queue.qsize() == 10_000
    """

    def __init__(self, queue_class: QueueClass, depth: int) -> None:
        self.queue = queue_class(1, depth + 1)
        self._deadline = Deadline.after(_BENCH_BUDGET_S)
        self.queue.put(-1, self._deadline)
        self.queue.get_nowait()
        for item in range(depth):
            self.queue.put(item, self._deadline)

    def __call__(self, loops: int) -> None:
        put, get, task_done, deadline = self.queue.put, self.queue.get_nowait, self.queue.task_done, self._deadline
        for _ in range(loops):
            put(1, deadline)
            task_done()
            get()


@dataclass(frozen=True)
class StdlibOperation:
    """A competitor from the standard library; ``make()`` builds its runner."""

    key: str
    label: str
    make: Callable[[], LoopRunner]


@dataclass(frozen=True)
class TwinOperation:
    """A prazo operation; ``make(queue_class)`` builds its runner for one twin."""

    key: str
    label: str
    make: Callable[[QueueClass], LoopRunner]


STDLIB_GATE_OPS = (
    StdlibOperation("lock-pair", "threading.Lock acquire()+release()", lock_pair),
    StdlibOperation("lock-with", "with threading.Lock: pass", lock_with),
    StdlibOperation("bounded-semaphore", "threading.BoundedSemaphore acquire()+release()", bounded_semaphore_pair),
    StdlibOperation("queue-put-get", "queue.Queue put()+get()", stdlib_queue_put_get),
)
TWIN_GATE_OPS = (
    TwinOperation("slot", "with q.slot(d): pass", admission_slot),
    TwinOperation("acquire-release", "q.acquire(d)+q.release()", admission_acquire_release),
)
STDLIB_WORK_QUEUE_OPS = (
    StdlibOperation("queue-round-trip", "queue.Queue put()+get_nowait()+task_done()", stdlib_queue_round_trip),
)
TWIN_WORK_QUEUE_OPS = (TwinOperation("round-trip", "q.put(x, d)+q.get_nowait()+q.task_done()", admission_round_trip),)


# -- handoff latency --------------------------------------------------------------


class Gate(Protocol):
    """A one-slot gate as ``HandoffPingPong`` drives it."""

    def acquire(self) -> object: ...

    def release(self) -> object: ...

    def waiting(self) -> int: ...


class ConditionGate:
    """A one-slot gate on ``threading.Condition``: what one writes without prazo.

    >>> gate = ConditionGate()
    >>> gate.acquire()
    >>> gate.waiting()
    0
    >>> gate.release()
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._waiting = 0

    def acquire(self) -> None:
        with self._cond:
            self._waiting += 1
            while self._busy:
                self._cond.wait()
            self._waiting -= 1
            self._busy = True

    def release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify()

    def waiting(self) -> int:
        return self._waiting


class _AdmissionGate:
    """An ``AdmissionQueue(1, 1)`` seen as a ``Gate``, with a far deadline."""

    def __init__(self, queue_class: QueueClass) -> None:
        self._queue = queue_class(1, 1)
        self._deadline = Deadline.after(_BENCH_BUDGET_S)

    def acquire(self) -> None:
        self._queue.acquire(self._deadline)

    def release(self) -> None:
        self._queue.release()

    def waiting(self) -> int:
        return self._queue.qsize()


def admission_gate(queue_class: QueueClass) -> Gate:
    """A one-slot ``Gate`` backed by the admission queue of ``queue_class``."""
    return _AdmissionGate(queue_class)


def handoff_gates(twins: Mapping[str, QueueClass]) -> dict[str, Gate]:
    """The handoff competitors: the stdlib ``threading.Condition`` gate, then each twin."""
    gates: dict[str, Gate] = {"condition": ConditionGate()}
    gates.update({name: admission_gate(queue_class) for name, queue_class in twins.items()})
    return gates


# Where the two threads of a handoff run. A wake-up on the same CPU and one
# across CPUs cost very different amounts, and an unpinned run lands on either
# at random, so each is measured on its own.
PLACEMENT_SAME_CPU = "same-cpu"
PLACEMENT_CROSS_CPU = "cross-cpu"
PLACEMENT_UNPINNED = "unpinned"


def handoff_placements() -> tuple[str, ...]:
    """The placements this machine can pin (unpinned only without ``sched_setaffinity``)."""
    if not hasattr(os, "sched_setaffinity"):
        return (PLACEMENT_UNPINNED,)
    return (PLACEMENT_SAME_CPU, PLACEMENT_CROSS_CPU) if len(os.sched_getaffinity(0)) > 1 else (PLACEMENT_SAME_CPU,)


def placement_cpus(placement: str) -> tuple[int | None, int | None]:
    """(CPU of the releasing thread, CPU of the waiter) for ``placement``; None: not pinned."""
    if placement == PLACEMENT_UNPINNED:
        return None, None
    if placement not in (PLACEMENT_SAME_CPU, PLACEMENT_CROSS_CPU):
        raise ValueError(
            f"placement must be one of {PLACEMENT_SAME_CPU}, {PLACEMENT_CROSS_CPU}, "
            f"{PLACEMENT_UNPINNED}, got {placement!r}"
        )
    cpus = sorted(os.sched_getaffinity(0))
    if placement == PLACEMENT_SAME_CPU:
        return cpus[0], cpus[0]
    if len(cpus) < 2:
        raise ValueError("placement 'cross-cpu' needs two CPUs this process may run on")
    return cpus[0], cpus[1]


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """Run the calling thread on ``cpu`` only (None: leave it alone); restore on exit."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class HandoffPingPong:
    """The calling thread and one waiter thread pass a single slot back and forth.

    Each ``round_trip()``: the caller holds the slot and the waiter is queued
    for it; the caller reads the clock and releases; the waiter, woken with
    the slot, reads the clock and gives the slot back. The difference of the
    two clock reads is appended to ``latencies_ns``::

        with HandoffPingPong(ConditionGate()) as ping_pong:
            for _ in range(1000):
                ping_pong.round_trip()
        summarize_handoff(ping_pong.latencies_ns)

    Right after ``release()`` the caller blocks on a bare ``threading.Lock``,
    a C call that drops the GIL at once, so the woken waiter never queues for
    the GIL behind harness code: the interval is release → wake-up → acquire
    returning, and nothing else. ``waiter_cpu`` pins the waiter thread (pin
    the caller with ``pinned``). A stuck waiter raises ``RuntimeError`` after
    ``timeout`` seconds instead of hanging.
    """

    def __init__(self, gate: Gate, *, waiter_cpu: int | None = None, timeout: float = 10.0) -> None:
        self._gate = gate
        self._waiter_cpu = waiter_cpu
        self._timeout = timeout
        # Bare locks used as one-shot signals, created held: release() signals.
        self._woken = threading.Lock()  # waiter -> caller: I had the slot and gave it back
        self._resume = threading.Lock()  # caller -> waiter: I hold the slot again, queue up
        self._woken.acquire()
        self._resume.acquire()
        self._woke_ns = 0
        self._stop = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._waiter, name="prazo-bench-handoff-waiter", daemon=True)
        self.latencies_ns: list[int] = []

    @property
    def waiter_alive(self) -> bool:
        """True while the waiter thread runs (between ``__enter__`` and ``__exit__``)."""
        return self._thread.is_alive()

    def __enter__(self) -> Self:
        self._gate.acquire()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop = True
        if self._thread.is_alive() and self._failure is None:
            self._hand_over()
        self._thread.join(self._timeout)

    def _waiter(self) -> None:
        try:
            if self._waiter_cpu is not None:
                os.sched_setaffinity(0, {self._waiter_cpu})
            while True:
                self._gate.acquire()
                self._woke_ns = time.monotonic_ns()
                self._gate.release()
                self._woken.release()
                if self._stop:
                    return
                if not self._resume.acquire(timeout=self._timeout):
                    raise RuntimeError("the caller never took the slot back")
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread by _hand_over
            self._failure = exc
            self._woken.release()

    def _hand_over(self) -> int:
        """Release to the queued waiter and wait until it ran; return the latency in ns."""
        give_up = time.monotonic() + self._timeout
        # Polling with sleep(0) lets the waiter take the GIL and queue up.
        while self._gate.waiting() == 0 and self._failure is None:
            if time.monotonic() > give_up:
                raise RuntimeError("the handoff waiter never queued for the slot")
            time.sleep(0)
        released_ns = time.monotonic_ns()
        self._gate.release()
        if not self._woken.acquire(timeout=self._timeout):
            raise RuntimeError("the handoff waiter never woke up with the slot")
        if self._failure is not None:
            raise RuntimeError("the handoff waiter failed") from self._failure
        return self._woke_ns - released_ns

    def round_trip(self) -> None:
        """One timed handoff; the slot is back with the caller and the waiter re-queues."""
        self.latencies_ns.append(self._hand_over())
        self._gate.acquire()
        self._resume.release()


@dataclass(frozen=True)
class HandoffSummary:
    samples: int
    median_us: float
    p99_us: float


def summarize_handoff(latencies_ns: Sequence[int]) -> HandoffSummary:
    """Median and 99th percentile of handoff latencies, in microseconds."""
    if len(latencies_ns) < 2:
        raise ValueError("latencies_ns needs at least two samples for a p99")
    in_us = [ns / 1000 for ns in latencies_ns]
    return HandoffSummary(len(in_us), statistics.median(in_us), statistics.quantiles(in_us, n=100)[98])


def measure_handoffs(gates: Mapping[str, Gate], samples: int, placement: str) -> dict[str, HandoffSummary]:
    """Handoff latency of each gate on one placement, the gates interleaved in chunks of rounds.

    Interleaving makes a noisy moment hit every competitor alike; the first
    chunk of each is a warm-up and is dropped.
    """
    chunk = 50
    total = samples + chunk
    caller_cpu, waiter_cpu = placement_cpus(placement)
    with pinned(caller_cpu), contextlib.ExitStack() as running:
        ping_pongs = {
            key: running.enter_context(HandoffPingPong(gate, waiter_cpu=waiter_cpu)) for key, gate in gates.items()
        }
        for done in range(0, total, chunk):
            for ping_pong in ping_pongs.values():
                for _ in range(min(chunk, total - done)):
                    ping_pong.round_trip()
    return {key: summarize_handoff(ping_pong.latencies_ns[chunk:]) for key, ping_pong in ping_pongs.items()}


# -- the `prazo bench core` runner ------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One measured loop operation: net nanoseconds per operation, and what it is compared with."""

    group: str
    key: str
    label: str
    ns_per_op: float
    baseline: str


@dataclass
class CoreBenchReport:
    """Everything ``prazo bench core`` measured, for assertions and for the table.

    ``handoff`` maps a placement (``same-cpu``/``cross-cpu``/``unpinned``) to
    the summary of each competitor (``condition``, ``c``, ``py``).
    """

    settings: BenchSettings
    twins: tuple[str, ...]
    loop_overhead_ns: float
    rows: dict[str, Row]
    handoff: dict[str, dict[str, HandoffSummary]]
    notes: list[str] = field(default_factory=list)

    def ns(self, key: str) -> float | None:
        row = self.rows.get(key)
        return None if row is None else row.ns_per_op

    def ratio(self, key: str) -> float | None:
        """A row's cost relative to its baseline row."""
        return ratio_of(self.ns(key), self.ns(self.rows[key].baseline))

    def handoff_median_us(self, placement: str, key: str) -> float | None:
        summary = self.handoff.get(placement, {}).get(key)
        return None if summary is None else summary.median_us

    def targets(self) -> list[Target]:
        """The targets of the issue, as ratios measured in this one run."""
        c_slot = self.ns("c:slot")
        found = [
            make_target(
                "C gate vs a Lock acquire+release pair",
                ratio_of(c_slot, self.ns("lock-pair")),
                "<= 1.0x",
                lambda r: r <= 1.0,
            ),
            make_target(
                "C gate speed-up over BoundedSemaphore",
                ratio_of(self.ns("bounded-semaphore"), c_slot),
                ">= 10x",
                lambda r: r >= 10,
            ),
            make_target(
                "C gate speed-up over the Python twin", ratio_of(self.ns("py:slot"), c_slot), ">= 5x", lambda r: r >= 5
            ),
        ]
        for twin in ("c", "py"):
            key = _depth_key(twin, DEPTHS[1])
            found.append(
                make_target(
                    f"{twin} depth {_spaced(DEPTHS[1])} vs depth {DEPTHS[0]}",
                    self.ratio(key) if key in self.rows else None,
                    "<= 1.2x",
                    lambda r: r <= 1.2,
                )
            )
        for placement in self.handoff:
            found.append(
                make_target(
                    f"C handoff median vs the Python twin's ({placement})",
                    ratio_of(self.handoff_median_us(placement, "c"), self.handoff_median_us(placement, "py")),
                    "<= 0.5x",
                    lambda r: r <= 0.5,
                )
            )
        return found

    def context(self) -> list[tuple[str, float | None]]:
        """Like-for-like ratios that explain the gate targets (a ``with`` block costs more than two calls)."""
        return [
            ("C `with q.slot(d)` vs `with threading.Lock`", ratio_of(self.ns("c:slot"), self.ns("lock-with"))),
            (
                "C q.acquire(d)+q.release() vs the Lock pair",
                ratio_of(self.ns("c:acquire-release"), self.ns("lock-pair")),
            ),
            (
                "C q.acquire(d)+q.release() speed-up over BoundedSemaphore",
                ratio_of(self.ns("bounded-semaphore"), self.ns("c:acquire-release")),
            ),
        ]


def _depth_key(twin: str, depth: int) -> str:
    return f"{twin}:depth-{depth}"


def _spaced(number: int) -> str:
    return f"{number:,}".replace(",", " ")


def _loop_catalogue(twins: Mapping[str, QueueClass]) -> dict[str, tuple[Row, LoopRunner]]:
    """Every loop competitor, as its (not yet measured) row and its runner."""
    catalogue: dict[str, tuple[Row, LoopRunner]] = {}

    def add(group: str, key: str, label: str, baseline: str, runner: LoopRunner) -> None:
        catalogue[key] = (Row(group, key, label, 0.0, baseline), runner)

    for group, baseline, stdlib_ops, twin_ops in (
        (GROUP_GATE, "lock-pair", STDLIB_GATE_OPS, TWIN_GATE_OPS),
        (GROUP_WORK_QUEUE, "queue-round-trip", STDLIB_WORK_QUEUE_OPS, TWIN_WORK_QUEUE_OPS),
    ):
        for stdlib_op in stdlib_ops:
            add(group, stdlib_op.key, stdlib_op.label, baseline, stdlib_op.make())
        for name, queue_class in twins.items():
            for twin_op in twin_ops:
                add(
                    group,
                    f"{name}:{twin_op.key}",
                    f"prazo {name:<2} {twin_op.label}",
                    baseline,
                    twin_op.make(queue_class),
                )
    for name, queue_class in twins.items():
        for depth in DEPTHS:
            add(
                GROUP_DEPTH,
                _depth_key(name, depth),
                f"prazo {name:<2} depth {_spaced(depth):>6}",
                _depth_key(name, DEPTHS[0]),
                ConstantDepthRoundTrip(queue_class, depth),
            )
    return catalogue


def run_core_bench(
    twins: Mapping[str, QueueClass], settings: BenchSettings = DEFAULT_SETTINGS, *, notes: Sequence[str] = ()
) -> CoreBenchReport:
    """Measure every core comparison for the given twins (``{"c": ..., "py": ...}``)."""
    if not twins:
        raise ValueError("twins must name at least one twin of the admission queue")
    catalogue = _loop_catalogue(twins)
    runners = {key: runner for key, (_, runner) in catalogue.items()}
    runners["empty"] = empty_loop()
    ns = best_ns_per_op(runners, settings)
    overhead = ns["empty"]
    rows = {key: dataclasses.replace(row, ns_per_op=ns[key] - overhead) for key, (row, _) in catalogue.items()}
    handoff = {
        placement: measure_handoffs(handoff_gates(twins), settings.handoff_samples, placement)
        for placement in handoff_placements()
    }
    return CoreBenchReport(settings, tuple(twins), overhead, rows, handoff, list(notes))


# -- rendering --------------------------------------------------------------------

_HANDOFF_LABELS = {"condition": "threading.Condition one-slot gate"}
_RATIO_OF = {
    GROUP_GATE: "  vs the Lock pair",
    GROUP_WORK_QUEUE: "  vs queue.Queue",
    GROUP_DEPTH: f"  vs the same twin at depth {DEPTHS[0]}",
}


def render_core_report(report: CoreBenchReport, paint: Paint = plain) -> str:
    """The ``prazo bench core`` table: ns/op with ratios, handoff latency, targets."""
    s = report.settings
    out = render_heading(
        "prazo bench core",
        f"twins: {', '.join(report.twins)} · {s.inner} ops per sample · best of {s.repeat} · "
        f"ns/op net of the empty loop ({report.loop_overhead_ns:.1f} ns/op)",
        report.notes,
        paint,
    )
    targets, context = report.targets(), report.context()
    labels = [row.label for row in report.rows.values()] + [t.label for t in targets] + [label for label, _ in context]
    width = max(len(label) for label in labels) + 2
    for group in (GROUP_GATE, GROUP_WORK_QUEUE, GROUP_DEPTH):
        out += [
            "",
            paint(f"{group:<{width}}", "bold") + f"{'ns/op':>10}  {'ratio':>8}" + paint(_RATIO_OF[group], "dim"),
        ]
        for row in (row for row in report.rows.values() if row.group == group):
            ratio = report.ratio(row.key)
            shown = "-" if ratio is None else f"{ratio:.2f}x"
            baseline = paint("  baseline", "dim") if row.key == row.baseline else ""
            out.append(f"  {row.label:<{width - 2}}{row.ns_per_op:>10.1f}  {shown:>8}{baseline}")
    for placement, summaries in report.handoff.items():
        title = f"{GROUP_HANDOFF} ({placement})"
        out += ["", paint(f"{title:<{width}}", "bold") + f"{'median µs':>10}  {'p99 µs':>8}"]
        for key, summary in summaries.items():
            label = _HANDOFF_LABELS.get(key, f"prazo {key:<2} AdmissionQueue(1, 1)")
            out.append(
                f"  {label:<{width - 2}}{summary.median_us:>10.1f}  {summary.p99_us:>8.1f}"
                + paint(f"  {summary.samples} samples", "dim")
            )
    out += render_targets(targets, width, paint)
    out += ["", paint("context", "bold")]
    for label, ratio in context:
        out.append(f"         {label:<{width - 2}}{format_times(ratio):>8}")
    return "\n".join(out)
