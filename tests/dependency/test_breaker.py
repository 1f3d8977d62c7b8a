"""The slowness-aware circuit breaker: each transition, the arguments, a state machine against a model, real threads.

Time is a fake clock passed as ``now_ns`` (or as ``clock=``), so every
transition happens at an instant the test chooses; the thread tests assert
on counts only, never on speed.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from _helpers import JOIN_TIMEOUT_S, CheckedThread, examples, run_checked
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from prazo.bindings.dependency import Breaker
from prazo.core import NS_PER_MS, NS_PER_SECOND

SLOW_MS = 100
FAST = 1 * NS_PER_MS
SLOW = SLOW_MS * NS_PER_MS
T0 = 1_000 * NS_PER_SECOND


def small(**overrides: object) -> Breaker:
    options: dict[str, object] = {
        "window": 10,
        "min_calls": 4,
        "failure_rate": 0.5,
        "slow_rate": 0.5,
        "slow_call_ms": SLOW_MS,
        "open_for_s": 5.0,
        "half_open_calls": 3,
    }
    options.update(overrides)
    return Breaker(**options)  # type: ignore[arg-type]


def call(breaker: Breaker, now: int, *, failed: bool = False, duration: int = FAST) -> bool:
    """One whole call at ``now``: acquire, then report; False when refused."""
    if not breaker.try_acquire(now):
        return False
    if failed:
        breaker.on_failure(duration, now)
    else:
        breaker.on_success(duration, now)
    return True


def open_it(breaker: Breaker, now: int = T0) -> None:
    for _ in range(4):
        assert call(breaker, now, failed=True)
    assert breaker.current_state(now) == "open"


# -- closed -> open ------------------------------------------------------------


def test_starts_closed_and_lets_everything_through() -> None:
    breaker = small()
    assert breaker.state == "closed"
    for _ in range(50):
        assert call(breaker, T0)
    stats = breaker.stats(T0)
    assert stats["state"] == "closed"
    assert stats["calls"] == 10  # the window holds the last 10
    assert stats["permitted"] == stats["successes"] == 50
    assert stats["opened"] == stats["rejected"] == 0


def test_no_verdict_before_min_calls() -> None:
    breaker = small()
    for _ in range(3):
        call(breaker, T0, failed=True)
    assert breaker.current_state(T0) == "closed"  # 100 % failures, but only 3 calls
    call(breaker, T0, failed=True)
    assert breaker.current_state(T0) == "open"


def test_opens_at_the_failure_rate_exactly() -> None:
    breaker = small()
    for failed in (False, True, False):
        call(breaker, T0, failed=failed)
    assert breaker.current_state(T0) == "closed"
    call(breaker, T0, failed=True)  # 2 of 4 = 0.5 >= 0.5
    assert breaker.current_state(T0) == "open"
    assert breaker.stats(T0)["opened"] == 1


def test_below_the_rate_stays_closed() -> None:
    breaker = small()
    for i in range(40):
        call(breaker, T0, failed=i % 3 == 2)  # at most 4 of any 10 in a row fail
    assert breaker.current_state(T0) == "closed"


def test_slow_successes_open_it_without_a_single_error() -> None:
    """The seed's point: a dependency that still answers 200, slowly."""
    breaker = small()
    for _ in range(4):
        call(breaker, T0, duration=2_000 * NS_PER_MS)
    stats = breaker.stats(T0)
    assert stats["state"] == "open"
    assert stats["failures"] == 0
    assert stats["slow_rate"] == 1.0


def test_slow_means_at_least_slow_call_ms() -> None:
    breaker = small(min_calls=1, window=1)
    call(breaker, T0, duration=SLOW - 1)
    assert breaker.current_state(T0) == "closed"
    call(breaker, T0, duration=SLOW)
    assert breaker.current_state(T0) == "open"


def test_failures_and_slow_calls_are_counted_separately() -> None:
    """Neither rate reaches 0.5 alone although together they would; a slow failure counts in both."""
    breaker = small(window=10, min_calls=10)
    for _ in range(4):
        call(breaker, T0, failed=True)
    for _ in range(4):
        call(breaker, T0, duration=SLOW)
    call(breaker, T0)
    call(breaker, T0)
    stats = breaker.stats(T0)
    assert stats["state"] == "closed"
    assert (stats["failed_calls"], stats["slow_calls"], stats["calls"]) == (4, 4, 10)
    call(breaker, T0, failed=True, duration=SLOW)  # evicts a failure, adds a slow failure
    stats = breaker.stats(T0)
    assert (stats["failed_calls"], stats["slow_calls"]) == (4, 5)
    assert stats["state"] == "open"


def test_the_window_slides() -> None:
    breaker = small(window=4, min_calls=4)
    call(breaker, T0, failed=True)
    for _ in range(4):
        call(breaker, T0)
    call(breaker, T0, failed=True)  # the first failure has left: 1 of 4
    assert breaker.stats(T0)["failed_calls"] == 1
    call(breaker, T0, failed=True)  # 2 of 4
    assert breaker.current_state(T0) == "open"


def test_time_window_forgets_old_results() -> None:
    breaker = small(window=10, min_calls=4, window_s=10.0)
    for _ in range(3):
        call(breaker, T0, failed=True)
    later = T0 + 10 * NS_PER_SECOND  # exactly window_s later: those three have aged out
    assert breaker.stats(later)["calls"] == 0
    call(breaker, later, failed=True)
    assert breaker.current_state(later) == "closed"
    for _ in range(3):
        call(breaker, later + 1, failed=True)
    assert breaker.current_state(later + 1) == "open"


def test_time_window_still_counts_at_most_window_calls() -> None:
    breaker = small(window=4, min_calls=4, window_s=3600.0)
    for _ in range(20):
        call(breaker, T0)
    assert breaker.stats(T0)["calls"] == 4


# -- open --------------------------------------------------------------------


def test_open_refuses_everything_until_open_for_s() -> None:
    breaker = small()
    open_it(breaker)
    end = T0 + 5 * NS_PER_SECOND
    for now in (T0, T0 + 1, end - 1):
        assert not breaker.try_acquire(now)
        assert breaker.current_state(now) == "open"
    assert breaker.stats(end - 1)["rejected"] == 3
    assert breaker.current_state(end) == "half-open"


def test_results_reported_while_open_are_ignored() -> None:
    breaker = small()
    assert breaker.try_acquire(T0)  # a call admitted while closed...
    open_it(breaker)
    breaker.on_success(FAST, T0 + 1)  # ...returns after the breaker opened
    stats = breaker.stats(T0 + 1)
    assert stats["state"] == "open"
    assert stats["ignored"] == 1


def test_open_moves_to_half_open_lazily_with_the_clock() -> None:
    now = [T0]
    breaker = small(clock=lambda: now[0])
    for _ in range(4):
        assert breaker.try_acquire()
        breaker.on_failure(FAST)
    assert breaker.state == "open"
    now[0] += 5 * NS_PER_SECOND
    assert breaker.state == "half-open"
    assert breaker.stats()["state"] == "half-open"


def test_open_for_zero_probes_at_once() -> None:
    breaker = small(open_for_s=0)
    for _ in range(4):
        call(breaker, T0, failed=True)
    assert breaker.stats(T0)["opened"] == 1
    assert breaker.try_acquire(T0)
    assert breaker.current_state(T0) == "half-open"


# -- half-open -----------------------------------------------------------------


def half_open(**overrides: object) -> tuple[Breaker, int]:
    breaker = small(**overrides)
    open_it(breaker)
    now = T0 + 5 * NS_PER_SECOND
    assert breaker.current_state(now) == "half-open"
    return breaker, now


def test_half_open_hands_out_exactly_half_open_calls_probes() -> None:
    breaker, now = half_open()
    assert [breaker.try_acquire(now) for _ in range(5)] == [True, True, True, False, False]
    assert breaker.stats(now)["probes_in_flight"] == 3


def test_half_open_closes_when_every_probe_is_good() -> None:
    breaker, now = half_open()
    for _ in range(3):
        assert breaker.try_acquire(now)
    breaker.on_success(FAST, now)
    breaker.on_success(FAST, now)
    assert breaker.current_state(now) == "half-open"  # waits for the last probe
    breaker.on_success(FAST, now)
    stats = breaker.stats(now)
    assert stats["state"] == "closed"
    assert stats["calls"] == 0  # a fresh window
    assert call(breaker, now)


def test_half_open_tolerates_failures_below_the_rate() -> None:
    breaker, now = half_open()
    for _ in range(3):
        assert breaker.try_acquire(now)
    breaker.on_failure(FAST, now)  # 1 of 3 < 0.5
    breaker.on_success(FAST, now)
    breaker.on_success(FAST, now)
    assert breaker.current_state(now) == "closed"


def test_half_open_reopens_as_soon_as_the_verdict_is_certain() -> None:
    breaker, now = half_open()
    for _ in range(3):
        assert breaker.try_acquire(now)
    breaker.on_failure(FAST, now)
    assert breaker.current_state(now) == "half-open"
    breaker.on_failure(FAST, now)  # 2 of 3 probes failed whatever the third says
    stats = breaker.stats(now)
    assert stats["state"] == "open"
    assert stats["opened"] == 2
    assert not breaker.try_acquire(now)
    breaker.on_success(FAST, now)  # the third probe, too late
    assert breaker.stats(now)["ignored"] == 1
    assert breaker.current_state(now + 5 * NS_PER_SECOND - 1) == "open"  # open_for_s counts from the re-opening
    assert breaker.current_state(now + 5 * NS_PER_SECOND) == "half-open"


def test_half_open_reopens_on_slow_probes() -> None:
    breaker, now = half_open()
    for _ in range(3):
        assert breaker.try_acquire(now)
    breaker.on_success(SLOW, now)
    breaker.on_success(SLOW, now)
    assert breaker.current_state(now) == "open"


def test_a_single_failed_probe_reopens_when_it_alone_reaches_the_rate() -> None:
    breaker, now = half_open(half_open_calls=1)
    assert breaker.try_acquire(now)
    breaker.on_failure(FAST, now)
    assert breaker.current_state(now) == "open"


def test_released_probe_goes_back_to_the_pool() -> None:
    breaker, now = half_open()
    for _ in range(3):
        assert breaker.try_acquire(now)
    assert not breaker.try_acquire(now)
    breaker.release(now)
    assert breaker.stats(now)["probes_in_flight"] == 2
    assert breaker.try_acquire(now)
    assert not breaker.try_acquire(now)
    for _ in range(3):
        breaker.on_success(FAST, now)
    assert breaker.current_state(now) == "closed"


def test_release_in_closed_records_nothing() -> None:
    breaker = small()
    assert breaker.try_acquire(T0)
    breaker.release(T0)
    stats = breaker.stats(T0)
    assert stats["calls"] == 0
    assert stats["released"] == 1


def test_a_result_with_no_probe_outstanding_is_ignored() -> None:
    breaker, now = half_open()
    breaker.on_failure(FAST, now)
    stats = breaker.stats(now)
    assert stats["state"] == "half-open"
    assert stats["ignored"] == 1
    assert stats["probes_reported"] == 0


def test_a_straggler_from_before_the_opening_stands_in_for_a_probe() -> None:
    """Documented limit of a token-less API: a call admitted while closed that reports in half-open counts as a probe."""
    breaker = small(half_open_calls=1)
    assert breaker.try_acquire(T0)  # admitted while closed, then hangs
    open_it(breaker)
    now = T0 + 5 * NS_PER_SECOND
    assert breaker.try_acquire(now)  # the one probe
    breaker.on_success(now - T0, now)  # the straggler returns: 5 s, slow
    stats = breaker.stats(now)
    assert stats["state"] == "open"  # judged as a slow probe: errs towards staying open
    assert stats["opened"] == 2
    breaker.on_success(FAST, now)  # the real probe, now too late
    assert breaker.stats(now)["ignored"] == 1


def test_stats_keys() -> None:
    assert set(small().stats(T0)) == {
        "state",
        "calls",
        "failed_calls",
        "slow_calls",
        "failure_rate",
        "slow_rate",
        "probes_in_flight",
        "probes_reported",
        "opened",
        "rejected",
        "permitted",
        "successes",
        "failures",
        "slow",
        "ignored",
        "released",
    }


def test_reset_closes_and_clears_the_window_but_keeps_totals() -> None:
    breaker = small()
    open_it(breaker)
    breaker.reset()
    stats = breaker.stats(T0)
    assert stats["state"] == "closed"
    assert stats["calls"] == 0
    assert stats["opened"] == 1
    assert call(breaker, T0)


# -- arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("window", 0, ValueError),
        ("window", 1.5, TypeError),
        ("window", True, TypeError),
        ("min_calls", 0, ValueError),
        ("min_calls", 101, ValueError),
        ("min_calls", "3", TypeError),
        ("failure_rate", 0, ValueError),
        ("failure_rate", 1.01, ValueError),
        ("failure_rate", math.nan, ValueError),
        ("failure_rate", math.inf, ValueError),
        ("failure_rate", "0.5", TypeError),
        ("slow_rate", -0.1, ValueError),
        ("slow_rate", math.nan, ValueError),
        ("slow_rate", None, TypeError),
        ("slow_call_ms", 0, ValueError),
        ("slow_call_ms", -1, ValueError),
        ("slow_call_ms", math.nan, ValueError),
        ("slow_call_ms", math.inf, ValueError),
        ("open_for_s", -1, ValueError),
        ("open_for_s", math.nan, ValueError),
        ("open_for_s", math.inf, ValueError),
        ("open_for_s", "5", TypeError),
        ("half_open_calls", 0, ValueError),
        ("half_open_calls", 2.0, TypeError),
        ("window_s", 0, ValueError),
        ("window_s", math.nan, ValueError),
        ("window_s", math.inf, ValueError),
        ("clock", 5, TypeError),
    ],
)
def test_bad_arguments_are_named(name: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=name):
        Breaker(**{name: value})  # type: ignore[arg-type]


def test_rates_of_exactly_one_are_allowed() -> None:
    breaker = small(failure_rate=1, slow_rate=1.0, min_calls=2)
    call(breaker, T0, failed=True)
    call(breaker, T0)
    assert breaker.current_state(T0) == "closed"


def test_arguments_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Breaker(100)  # type: ignore[misc]


@pytest.mark.parametrize("method", ["on_success", "on_failure"])
def test_bad_durations(method: str) -> None:
    breaker = small()
    report = getattr(breaker, method)
    with pytest.raises(ValueError, match="duration_ns"):
        report(-1, T0)
    with pytest.raises(TypeError, match="duration_ns"):
        report(1.5, T0)
    with pytest.raises(TypeError, match="duration_ns"):
        report(True, T0)
    with pytest.raises(TypeError, match="now_ns"):
        report(1, 1.5)
    assert breaker.stats(T0)["calls"] == 0


def test_bad_now_ns() -> None:
    breaker = small()
    with pytest.raises(TypeError, match="now_ns"):
        breaker.try_acquire(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="now_ns"):
        breaker.release("now")  # type: ignore[arg-type]


def test_default_clock_is_the_monotonic_clock() -> None:
    breaker = Breaker()
    assert breaker.slow_call_ms == 1000.0
    assert breaker.try_acquire()
    breaker.on_success(0)
    assert breaker.state == "closed"
    assert breaker.stats()["calls"] == 1


# -- the state machine against a model -------------------------------------------------


@dataclass
class Model:
    """The breaker as specified, written plainly: lists recomputed at every step, no counters kept in step."""

    window: int
    min_calls: int
    failure_rate: float
    slow_rate: float
    slow_ns: int
    open_for_ns: int
    half_open_calls: int
    window_ns: int | None
    state: str = "closed"
    results: list[tuple[int, bool, bool]] = field(default_factory=list)  # (at, failed, slow), oldest first
    opened_at: int = 0
    probes_granted: int = 0
    probe_results: list[tuple[bool, bool]] = field(default_factory=list)
    opened: int = 0
    rejected: int = 0
    ignored: int = 0

    @property
    def probes_out(self) -> int:
        return self.probes_granted - len(self.probe_results)

    def trips(self, outcomes: list[tuple[bool, bool]], over: int) -> bool:
        failed = sum(1 for f, _ in outcomes if f)
        slow = sum(1 for _, s in outcomes if s)
        return failed / over >= self.failure_rate or slow / over >= self.slow_rate

    def age_out(self, now: int) -> None:
        if self.window_ns is not None:
            self.results = [r for r in self.results if r[0] > now - self.window_ns]

    def tick(self, now: int) -> None:
        if self.state == "open" and now >= self.opened_at + self.open_for_ns:
            self.state = "half-open"
            self.probes_granted = 0
            self.probe_results = []

    def open(self, now: int) -> None:
        self.state = "open"
        self.opened_at = now
        self.opened += 1
        self.probes_granted = 0
        self.probe_results = []

    def close(self) -> None:
        self.state = "closed"
        self.results = []
        self.probes_granted = 0
        self.probe_results = []

    def acquire(self, now: int) -> bool:
        self.tick(now)
        if self.state == "closed":
            return True
        if self.state == "half-open" and self.probes_granted < self.half_open_calls:
            self.probes_granted += 1
            return True
        self.rejected += 1
        return False

    def record(self, now: int, failed: bool, duration: int) -> None:
        slow = duration >= self.slow_ns
        if self.state == "closed":
            self.results = [*self.results, (now, failed, slow)][-self.window :]
            self.age_out(now)
            pairs = [(f, s) for _, f, s in self.results]
            if len(pairs) >= self.min_calls and self.trips(pairs, len(pairs)):
                self.open(now)
        elif self.state == "half-open" and self.probes_out > 0:
            self.probe_results.append((failed, slow))
            if self.trips(self.probe_results, self.half_open_calls):
                self.open(now)
            elif len(self.probe_results) == self.half_open_calls:
                self.close()
        else:
            self.ignored += 1

    def release(self) -> None:
        if self.state == "half-open" and self.probes_out > 0:
            self.probes_granted -= 1


# Transitions the spec allows, by the kind of step that may cause them.
ALLOWED = {
    "acquire": {("open", "half-open")},
    "read": {("open", "half-open")},
    "report": {("closed", "open"), ("half-open", "open"), ("half-open", "closed")},
    "release": set(),
    "advance": set(),
    "reset": {("open", "closed"), ("half-open", "closed")},
}

# (failed, duration_ns), fast successes the most common, slow_call_ms and either side of it included.
DURATIONS = st.one_of(
    st.sampled_from((0, SLOW - 1, SLOW, SLOW + 1, 20 * SLOW)), st.integers(0, 3 * SLOW), st.integers(0, SLOW - 1)
)
OUTCOMES = st.one_of(
    st.tuples(st.just(False), st.integers(0, SLOW - 1)),
    st.tuples(st.booleans(), DURATIONS),
)
CLOCK_STEPS_MS = st.one_of(st.sampled_from((0, 1, 100, 1000)), st.integers(min_value=0, max_value=1500))


class BreakerMachine(RuleBasedStateMachine):
    """Random acquire / success / failure / slow / release / clock / reset steps, checked against ``Model``."""

    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.held = 0  # permits granted and not yet reported or released, as a caller would hold them

    @initialize(
        window=st.integers(1, 8),
        min_frac=st.floats(0, 1),
        failure_rate=st.sampled_from((0.2, 0.5, 1 / 3, 2 / 3, 1.0)),
        slow_rate=st.sampled_from((0.25, 0.5, 0.75, 1.0)),
        open_for_ms=st.sampled_from((0, 1, 100, 1000)),
        half_open_calls=st.integers(1, 4),
        window_ms=st.one_of(st.none(), st.sampled_from((1, 100, 1000, 3000))),
    )
    def setup(
        self,
        window: int,
        min_frac: float,
        failure_rate: float,
        slow_rate: float,
        open_for_ms: int,
        half_open_calls: int,
        window_ms: int | None,
    ) -> None:
        min_calls = max(1, round(min_frac * window))
        self.breaker = Breaker(
            window=window,
            min_calls=min_calls,
            failure_rate=failure_rate,
            slow_rate=slow_rate,
            slow_call_ms=SLOW_MS,
            open_for_s=open_for_ms / 1000,
            half_open_calls=half_open_calls,
            window_s=None if window_ms is None else window_ms / 1000,
        )
        self.model = Model(
            window,
            min_calls,
            failure_rate,
            slow_rate,
            SLOW,
            open_for_ms * NS_PER_MS,
            half_open_calls,
            None if window_ms is None else window_ms * NS_PER_MS,
        )
        self.permitted = 0
        self.reported = 0
        self.released = 0

    def step(self, kind: str) -> None:
        """Check the transition the last step made against the ones allowed for its kind."""
        before, self.last_state = self.last_state, self.model.state
        if before != self.model.state:
            assert (before, self.model.state) in ALLOWED[kind], (kind, before, self.model.state)

    last_state = "closed"

    @rule(ms=CLOCK_STEPS_MS)
    def advance(self, ms: int) -> None:
        self.now += ms * NS_PER_MS
        self.step("advance")

    @rule(ms=CLOCK_STEPS_MS)
    def advance_then_acquire(self, ms: int) -> None:
        """The clock moves and try_acquire is the first to see it (the invariant's stats() read comes after)."""
        self.now += ms * NS_PER_MS
        self.acquire()

    @rule()
    def acquire(self) -> None:
        was_open = self.model.state == "open" and self.now < self.model.opened_at + self.model.open_for_ns
        granted = self.breaker.try_acquire(self.now)
        assert granted == self.model.acquire(self.now)
        if was_open:
            assert not granted, "open refuses everything"
        if granted:
            self.held += 1
            self.permitted += 1
        self.step("acquire")

    @precondition(lambda self: self.held > 0)
    @rule(outcome=OUTCOMES)
    def report(self, outcome: tuple[bool, int]) -> None:
        failed, duration = outcome
        self.held -= 1
        self.reported += 1
        if failed:
            self.breaker.on_failure(duration, self.now)
        else:
            self.breaker.on_success(duration, self.now)
        self.model.record(self.now, failed, duration)
        self.step("report")

    @precondition(lambda self: self.held > 0)
    @rule()
    def release(self) -> None:
        self.held -= 1
        self.released += 1
        self.breaker.release(self.now)
        self.model.release()
        self.step("release")

    @rule(failed=st.booleans())
    def stray_report(self, failed: bool) -> None:
        """A result with no permit behind it (a caller's bug): counted, never trusted beyond the model's rules."""
        self.breaker.on_success(FAST, self.now) if not failed else self.breaker.on_failure(FAST, self.now)
        self.model.record(self.now, failed, FAST)
        self.reported += 1
        self.step("report")

    @rule()
    def read_state(self) -> None:
        self.model.tick(self.now)
        assert self.breaker.current_state(self.now) == self.model.state
        self.step("read")

    @precondition(lambda self: self.model.state != "closed")
    @rule(now=st.integers(0, 9))
    def reset(self, now: int) -> None:
        if now:  # rarely: a reset ends every story
            return
        self.breaker.reset()
        self.model.close()
        self.step("reset")

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "model"):
            return
        model = self.model
        stats = self.breaker.stats(self.now)
        model.tick(self.now)
        if model.state == "closed":
            model.age_out(self.now)
        self.step("read")
        assert stats["state"] == model.state
        assert stats["calls"] == len(model.results)
        assert stats["failed_calls"] == sum(1 for _, f, _ in model.results if f)
        assert stats["slow_calls"] == sum(1 for _, _, s in model.results if s)
        assert stats["opened"] == model.opened
        assert stats["rejected"] == model.rejected
        assert stats["ignored"] == model.ignored
        assert stats["probes_reported"] == len(model.probe_results)
        assert stats["probes_in_flight"] == model.probes_out
        # Never more probes out than half_open_calls; none at all outside half-open.
        assert 0 <= stats["probes_in_flight"] <= model.half_open_calls
        if model.state != "half-open":
            assert stats["probes_in_flight"] == stats["probes_reported"] == 0
        # Counters are consistent with what the callers did.
        assert stats["permitted"] == self.permitted
        assert stats["successes"] + stats["failures"] == self.reported
        assert stats["released"] == self.released
        assert stats["calls"] <= model.window


def test_breaker_state_machine() -> None:
    run_state_machine_as_test(
        BreakerMachine,
        settings=settings(max_examples=examples(300), stateful_step_count=60, deadline=None),
    )


# -- real threads ------------------------------------------------------------------------


def run_threads(count: int, target: Callable[[int], None]) -> None:
    """Run ``target(i)`` on ``count`` threads started together; re-raise the first exception any of them raised."""
    barrier = threading.Barrier(count)

    def starting_together(i: int) -> Callable[[], None]:
        def run() -> None:
            barrier.wait(JOIN_TIMEOUT_S)
            target(i)

        return run

    run_checked([starting_together(i) for i in range(count)])


def test_threads_hammering_every_transition_keep_the_counters_whole() -> None:
    """open_for_s=0 makes the breaker cycle closed -> open -> half-open -> ... under real contention."""
    breaker = Breaker(window=20, min_calls=5, slow_call_ms=SLOW_MS, open_for_s=0, half_open_calls=3)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            stats = breaker.stats()
            assert stats["state"] in ("closed", "open", "half-open")
            assert 0 <= stats["probes_in_flight"] <= 3
            assert stats["failed_calls"] <= stats["calls"] <= 20

    watcher = CheckedThread(target=watch)
    watcher.start()

    def hammer(i: int) -> None:
        rng = random.Random(i)
        for _ in range(3000):
            if not breaker.try_acquire():
                continue
            roll = rng.random()
            if roll < 0.1:
                breaker.release()
            elif roll < 0.5:
                breaker.on_failure(rng.choice((FAST, SLOW)))
            else:
                breaker.on_success(rng.choice((FAST, FAST, SLOW)))

    try:
        run_threads(8, hammer)
    finally:
        stop.set()
        watcher.join()
    stats = breaker.stats()
    assert stats["permitted"] == stats["successes"] + stats["failures"] + stats["released"]
    assert stats["permitted"] + stats["rejected"] == 8 * 3000
    assert stats["opened"] > 0  # the mix (40 % failures) did open it


def test_half_open_never_hands_out_more_than_half_open_calls_to_threads() -> None:
    now = [T0]
    breaker = small(clock=lambda: now[0], half_open_calls=3)
    open_it(breaker, T0)
    now[0] += 5 * NS_PER_SECOND
    lock = threading.Lock()
    held = [0]
    peak = [0]

    def probe(_: int) -> None:
        for _ in range(2000):
            if not breaker.try_acquire():
                continue
            with lock:
                held[0] += 1
                peak[0] = max(peak[0], held[0])
                assert held[0] <= 3
            with lock:  # given back before release(), so held never counts a permit the breaker already reissued
                held[0] -= 1
            breaker.release()

    run_threads(8, probe)
    stats = breaker.stats()
    assert stats["state"] == "half-open"  # nothing reported: still probing
    assert stats["probes_in_flight"] == 0
    assert 1 <= peak[0] <= 3


@pytest.mark.parametrize("round_", range(20))
def test_threads_racing_for_probes_get_exactly_half_open_calls(round_: int) -> None:
    breaker, now = half_open(half_open_calls=3)
    granted: list[bool] = []
    run_threads(12, lambda _: granted.append(breaker.try_acquire(now)))
    assert granted.count(True) == 3
    assert breaker.stats(now)["rejected"] == 9
