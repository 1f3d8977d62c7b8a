"""Helpers shared by the core tests: loading a twin, a fake clock, threads.

Everything here exists so the test modules say *what* they check and not how
to set it up: the rule for a missing C twin lives in one place
(``load_twin``), and every real-thread test joins with the same generous
bound (``JOIN_TIMEOUT_S``) so a hang fails instead of blocking the suite.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest
from hypothesis import settings
from prazo.core import NS_PER_MS, TWINS, Deadline, HistogramTwin, extension_wanted
from prazo.core import load_histogram_twin as load_core_histogram_twin
from prazo.core import load_twin as load_core_twin
from prazo.core._queue_py import AdmissionQueue

__all__ = [
    "COUNTER_NAMES",
    "JOIN_TIMEOUT_S",
    "TWIN_NAMES",
    "CheckedThread",
    "ConcurrencyMeter",
    "Dropped",
    "FakeClock",
    "QueueClass",
    "assert_conservation",
    "assert_counters",
    "examples",
    "import_test_module",
    "load_histogram_twin",
    "load_twin",
    "needs_the_gil",
    "reasons",
    "recorder",
    "run_checked",
    "spawn",
    "unaccounted",
    "wait_until",
]

TWIN_NAMES = TWINS

# For a test that stops every other thread by holding the GIL (a C call made with it held):
# on a free-threaded build with the GIL off nothing stops them. The reason is an allowed
# skip (tests/support/_required.py).
needs_the_gil = pytest.mark.skipif(
    not getattr(sys, "_is_gil_enabled", lambda: True)(),
    reason="needs the GIL: holding it is how this test stops the other threads",
)

# The counters ``stats()`` documents, besides the derived ``expired`` and the
# configuration (``max_concurrency``, ``max_queue``). Spelled out here, not
# imported from a twin, so a renamed or missing counter fails the tests.
COUNTER_NAMES = (
    "offered",
    "started",
    "completed",
    "rejected_full",
    "expired_on_arrival",
    "expired_in_queue",
    "cancelled",
    "in_flight",
    "assigned",
    "queued",
    "peak_in_flight",
    "peak_queued",
    "queue_wait_ns_total",
    "insufficient_budget",
    "shed",
    "evicted",
    "critical_started",
)

# Real-thread tests never wait longer than this for something that should take
# milliseconds: long enough for a loaded 2-core machine, short enough to fail.
JOIN_TIMEOUT_S = 10.0

# The C twin mirrors the Python twin's API exactly, so the Python class is the
# static type of both.
QueueClass = type[AdmissionQueue]

T = TypeVar("T")


def load_twin(name: str) -> QueueClass:
    """The ``AdmissionQueue`` class of the ``"c"`` or ``"py"`` twin.

    A missing C twin skips the test only when the Python twin was asked for on
    purpose (``PRAZO_NO_EXTENSIONS=1``, or an interpreter without C
    extensions); otherwise it fails, so ``make test`` can never pass quietly
    on the Python twin alone.
    """
    return _load(load_core_twin, name)


def load_histogram_twin(name: str) -> HistogramTwin:
    """The histogram classes of the ``"c"`` or ``"py"`` twin, with ``load_twin``'s rule for a missing C twin."""
    return _load(load_core_histogram_twin, name)


def _load(loader: Callable[[str], T], name: str) -> T:
    try:
        return loader(name)
    except ImportError as exc:
        if not extension_wanted():
            pytest.skip(f"C twin not available and PRAZO_NO_EXTENSIONS is set ({exc})")
        pytest.fail(
            f"the C twin cannot be loaded ({exc}); "
            "build it (`make build`) or set PRAZO_NO_EXTENSIONS=1 to test the Python twin alone",
            pytrace=False,
        )


def import_test_module(folder: str, name: str) -> ModuleType:
    """The test module ``tests/<folder>/<name>.py``, for a file that reuses another's cases.

    pytest puts a test file's own folder on ``sys.path`` as it collects it, so a
    module of another folder is importable by name only once that folder was
    collected: loaded by path, a file also runs alone (``pytest tests/x/test_y.py``).
    It is registered under its plain name, the one pytest gives it, so a full run
    imports it once.
    """
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def examples(n: int) -> int:
    """``n`` Hypothesis examples scaled by the loaded profile (``HYPOTHESIS_PROFILE=deep``: ``PRAZO_DEEP_FACTOR`` × ``n``)."""
    return max(1, n * settings.default.max_examples // 100)


class FakeClock:
    """A monotonic clock in integer nanoseconds that moves only when told to.

    Pass ``clock.ns`` as ``now_ns=`` to every core call, so a test decides
    exactly when each deadline passes::

        clock = FakeClock()
        d = clock.deadline_in(10)      # 10 ms from the fake now
        clock.advance(10)
        assert d.expired(now_ns=clock.ns)
    """

    def __init__(self, start_ns: int = 1_000_000 * NS_PER_MS) -> None:
        self.ns = start_ns

    def advance(self, ms: float) -> int:
        """Move forward by ``ms`` milliseconds; return the new ``ns``."""
        if ms < 0:
            raise ValueError("a monotonic clock never goes back")
        self.ns += round(ms * NS_PER_MS)
        return self.ns

    def deadline_in(self, ms: float) -> Deadline:
        """The deadline ``ms`` milliseconds after the fake now (negative: passed)."""
        return Deadline.after_ms(ms, now_ns=self.ns)


class SecondsClock:
    """A callable fake monotonic clock (ns) for ``clock=`` parameters, moved in seconds; safe across threads."""

    def __init__(self, start_ns: int = 1_000_000 * NS_PER_MS) -> None:
        self.ns = start_ns
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return self.ns

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.ns += round(seconds * 1e9)


class ConcurrencyMeter:
    """Counts the bodies running at once, under a lock, and keeps the peak.

    >>> meter = ConcurrencyMeter()
    >>> with meter:
    ...     pass
    >>> meter.peak
    1
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def __enter__(self) -> None:
        with self._lock:
            self.current += 1
            self.peak = max(self.peak, self.current)

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self.current -= 1


class CheckedThread(threading.Thread):
    """A thread whose failure fails the test: ``join()`` re-raises, in the test's thread, what the target raised.

    An ``assert`` in a plain ``threading.Thread`` only prints a traceback
    (pytest turns it into a warning); checks made in worker threads go through
    this class, so they fail the test that made them. ``join()`` also fails
    when the thread is still running after ``timeout`` (a hang, not a pass).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("daemon", True)
        super().__init__(*args, **kwargs)
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread by join()
            self.failure = exc

    def join(self, timeout: float | None = JOIN_TIMEOUT_S) -> None:
        super().join(timeout)
        if self.is_alive():
            raise AssertionError(f"{self.name} still running after {timeout} s")
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure


def run_checked(targets: Iterable[Callable[[], object]], timeout: float = JOIN_TIMEOUT_S) -> None:
    """Run each target on its own ``CheckedThread`` at once; join them all, then re-raise the first failure."""
    threads = [CheckedThread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    failures: list[BaseException] = []
    for thread in threads:
        try:
            thread.join(timeout)
        except BaseException as exc:  # noqa: BLE001 - every thread is joined before the first failure is raised
            failures.append(exc)
    if failures:
        raise failures[0]


def spawn(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """Run ``fn`` in a new daemon thread; its outcome lands in the returned future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever the thread raised
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = JOIN_TIMEOUT_S) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.001)


def unaccounted(stats: Mapping[str, int]) -> int:
    """Offered arrivals with no outcome in ``stats`` (0 when docs/design.md invariant 3 holds)."""
    accounted = (
        stats["started"]
        + stats["rejected_full"]
        + stats["expired"]
        + stats["cancelled"]
        + stats["queued"]
        + stats["assigned"]
        # The policies' outcomes (docs/design.md); absent from the front door's stats.
        + stats.get("insufficient_budget", 0)
        + stats.get("shed", 0)
        + stats.get("evicted", 0)
    )
    return stats["offered"] - accounted


def assert_conservation(stats: Mapping[str, int]) -> None:
    """Every offered arrival is accounted for exactly once (docs/design.md invariant 3)."""
    assert unaccounted(stats) == 0, f"conservation broken: {dict(stats)}"
    assert stats["expired"] == stats["expired_on_arrival"] + stats["expired_in_queue"], dict(stats)


def assert_counters(q: AdmissionQueue, **expected: int) -> None:
    """The named counters of ``q.stats()`` have these values, and conservation holds."""
    stats = q.stats()
    assert_conservation(stats)
    assert {name: stats[name] for name in expected} == expected


# What an ``on_dropped`` callback heard: ``(item, error)`` in the order told.
Dropped = list[tuple[Any, BaseException]]


def recorder() -> tuple[Dropped, Callable[[Any, BaseException], None]]:
    """A list and an ``on_dropped`` callback appending ``(item, error)`` to it."""
    seen: Dropped = []
    return seen, lambda item, error: seen.append((item, error))


def reasons(seen: Dropped) -> list[tuple[Any, str, int]]:
    """``(item, error.reason, error.status)`` for each dropped item heard."""
    return [(item, error.reason, error.status) for item, error in seen]  # type: ignore[attr-defined]


def scripted_throttle(*decisions: bool) -> Any:
    """An ``AdaptiveThrottle`` whose ``admit()`` answers ``decisions`` in order; ``records`` keeps what it is told."""
    from prazo.bindings.retries import AdaptiveThrottle

    class ScriptedThrottle(AdaptiveThrottle):
        def __init__(self) -> None:
            super().__init__(min_requests=0)
            self.decisions = list(decisions)
            self.records: list[bool] = []

        def admit(self) -> bool:
            return self.decisions.pop(0)

        def record(self, accepted: bool) -> None:
            self.records.append(accepted)

    return ScriptedThrottle()
