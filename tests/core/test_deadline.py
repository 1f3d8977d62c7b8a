"""``Deadline``, ``deadline_scope`` and ``current_deadline``, on a fake clock.

Deadlines are integer nanoseconds on the monotonic clock; every method that
reads "now" takes ``now_ns`` so these tests never depend on real time.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from contextlib import ExitStack
from fractions import Fraction

import pytest
from _helpers import JOIN_TIMEOUT_S, FakeClock, spawn
from hypothesis import given
from hypothesis import strategies as st
from prazo.core import (
    NS_PER_MS,
    NS_PER_SECOND,
    REASON_DEADLINE_EXCEEDED,
    Deadline,
    DeadlineExceeded,
    current_deadline,
    deadline_scope,
)

INT64_MAX = 2**63 - 1
NOW = FakeClock().ns

# -- construction --------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "expected_ns"),
    [(2, 2 * NS_PER_SECOND), (1.5, 1_500_000_000), (0.000_000_001, 1), (Fraction(1, 4), 250_000_000)],
)
def test_after_adds_seconds_to_now(seconds: float, expected_ns: int) -> None:
    assert Deadline.after(seconds, now_ns=NOW).ns == NOW + expected_ns


@pytest.mark.parametrize(("ms", "expected_ns"), [(150, 150 * NS_PER_MS), (0.5, 500_000), (-20, -20 * NS_PER_MS)])
def test_after_ms_adds_milliseconds_to_now(ms: float, expected_ns: int) -> None:
    assert Deadline.after_ms(ms, now_ns=NOW).ns == NOW + expected_ns


def test_at_ns_is_the_absolute_point() -> None:
    assert Deadline.at_ns(NOW).ns == NOW
    assert Deadline.at_ns(NOW) == Deadline.after(0, now_ns=NOW)


def test_after_without_now_uses_the_real_monotonic_clock() -> None:
    d = Deadline.after(3600)
    assert 3599 < d.remaining() <= 3600
    assert not d.expired()
    d.check()


# -- reading it -------------------------------------------------------------------


def test_remaining_in_every_unit() -> None:
    d = Deadline.after_ms(250, now_ns=NOW)
    assert d.remaining_ns(now_ns=NOW) == 250 * NS_PER_MS
    assert d.remaining_ms(now_ns=NOW) == 250.0
    assert d.remaining(now_ns=NOW) == 0.25
    later = NOW + 400 * NS_PER_MS
    assert d.remaining_ns(now_ns=later) == -150 * NS_PER_MS
    assert d.remaining_ms(now_ns=later) == -150.0
    assert d.remaining(now_ns=later) == -0.15


def test_expired_and_check_flip_exactly_at_the_deadline() -> None:
    d = Deadline.at_ns(NOW + 1000)
    assert not d.expired(now_ns=NOW + 999)
    d.check(now_ns=NOW + 999)
    assert d.expired(now_ns=NOW + 1000)
    with pytest.raises(DeadlineExceeded) as info:
        d.check(now_ns=NOW + 1000)
    assert info.value.reason == REASON_DEADLINE_EXCEEDED


@pytest.mark.parametrize("budget", [0, -0.001, -5, -1e6])
def test_a_zero_or_negative_budget_is_a_deadline_already_passed(budget: float) -> None:
    d = Deadline.after(budget, now_ns=NOW)
    assert d.expired(now_ns=NOW)
    assert d.remaining(now_ns=NOW) <= 0
    with pytest.raises(DeadlineExceeded):
        d.check(now_ns=NOW)


# -- bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (float("-inf"), ValueError),
        # Finite, but 1e300 s in nanoseconds overflows a float to inf.
        (1e300, ValueError),
        ("1", TypeError),
        (None, TypeError),
        (True, TypeError),
        (False, TypeError),
        (b"1", TypeError),
        ([1], TypeError),
        (complex(1, 0), TypeError),
    ],
)
@pytest.mark.parametrize(("factory", "argument"), [(Deadline.after, "seconds"), (Deadline.after_ms, "ms")])
def test_a_bad_budget_is_refused_naming_the_argument(
    factory: Callable[..., Deadline], argument: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=argument):
        factory(value, now_ns=NOW)


@pytest.mark.parametrize("value", [1.0, True, "5", None])
def test_at_ns_wants_an_int(value: object) -> None:
    with pytest.raises(TypeError, match="monotonic_ns"):
        Deadline.at_ns(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [1.5, True, "5"])
def test_now_ns_must_be_an_int(value: object) -> None:
    d = Deadline.at_ns(NOW)
    for read in (d.remaining, d.remaining_ms, d.remaining_ns, d.expired, d.check):
        with pytest.raises(TypeError, match="now_ns"):
            read(now_ns=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="now_ns"):
        Deadline.after(1, now_ns=value)  # type: ignore[arg-type]


def test_a_deadline_the_c_twin_cannot_hold_is_refused_not_wrapped() -> None:
    with pytest.raises(ValueError, match="monotonic_ns"):
        Deadline.at_ns(INT64_MAX + 1)
    with pytest.raises(ValueError, match="seconds"):
        Deadline.after(1e12, now_ns=NOW)
    with pytest.raises(ValueError, match="ms"):
        Deadline.after_ms(-(10**16), now_ns=NOW)


# -- comparison -------------------------------------------------------------------


def test_ordering_equality_and_hash_follow_the_point_in_time() -> None:
    early, late = Deadline.at_ns(NOW), Deadline.at_ns(NOW + 1)
    same = Deadline.after(0, now_ns=NOW)
    assert early < late and early <= late and late > early and late >= early
    assert early <= same and early >= same and not early < same
    assert early == same and early != late
    assert hash(early) == hash(same)
    assert len({early, same, late}) == 2
    assert min(late, early) is early
    assert sorted([late, early]) == [early, late]


def test_a_deadline_does_not_compare_with_plain_numbers() -> None:
    d = Deadline.at_ns(NOW)
    assert d != NOW
    with pytest.raises(TypeError):
        assert d < NOW  # type: ignore[operator]


# -- deadline_scope / current_deadline -------------------------------------------


def test_no_scope_means_no_current_deadline() -> None:
    assert current_deadline() is None


def test_scope_sets_and_restores_the_current_deadline() -> None:
    d = Deadline.at_ns(NOW)
    with deadline_scope(d) as effective:
        assert effective is d
        assert current_deadline() is d
    assert current_deadline() is None


@pytest.mark.parametrize(
    ("caller_ms", "callee_ms", "effective"),
    [(10, 99, "caller"), (99, 10, "callee"), (10, 10, "caller")],
    ids=["a-callee-never-extends", "a-callee-may-tighten", "a-tie-keeps-the-caller"],
)
def test_nesting_keeps_the_earlier_until_the_inner_scope_ends(caller_ms: int, callee_ms: int, effective: str) -> None:
    caller, callee = Deadline.after_ms(caller_ms, now_ns=NOW), Deadline.after_ms(callee_ms, now_ns=NOW)
    expected = {"caller": caller, "callee": callee}[effective]
    with deadline_scope(caller):
        with deadline_scope(callee) as inner:
            assert inner is expected
            assert current_deadline() is expected
        assert current_deadline() is caller


def test_a_none_scope_keeps_whatever_is_current() -> None:
    with deadline_scope(None) as effective:
        assert effective is None
        assert current_deadline() is None
    outer = Deadline.at_ns(NOW)
    with deadline_scope(outer), deadline_scope(None) as effective:
        assert effective is outer
        assert current_deadline() is outer


@pytest.mark.parametrize("value", [5, 1.5, "soon", NOW])
def test_scope_wants_a_deadline_or_none(value: object) -> None:
    with pytest.raises(TypeError, match="deadline"):
        deadline_scope(value)  # type: ignore[arg-type]


def test_a_scope_is_not_reentrant_but_can_be_used_again_after_it_ends() -> None:
    d = Deadline.at_ns(NOW)
    scope = deadline_scope(d)
    with scope:
        with pytest.raises(RuntimeError, match="reentrant"):
            scope.__enter__()
        assert current_deadline() is d
    assert current_deadline() is None
    with scope:
        assert current_deadline() is d
    assert current_deadline() is None


def test_scope_restores_the_outer_deadline_when_the_body_raises() -> None:
    outer = Deadline.at_ns(NOW + 50)
    with deadline_scope(outer):
        with pytest.raises(KeyError), deadline_scope(Deadline.at_ns(NOW)):
            raise KeyError("boom")
        assert current_deadline() is outer


def test_a_scope_in_another_thread_is_invisible_here_and_the_reverse() -> None:
    main_deadline = Deadline.at_ns(NOW + 1000)
    # Earlier than main's, so the worker sees its own whether or not the
    # interpreter lets new threads inherit the creating thread's context.
    worker_deadline = Deadline.at_ns(NOW)
    inside, leave = threading.Event(), threading.Event()

    def worker() -> Deadline | None:
        with deadline_scope(worker_deadline):
            seen = current_deadline()
            inside.set()
            leave.wait(JOIN_TIMEOUT_S)
        return seen

    with deadline_scope(main_deadline):
        future = spawn(worker)
        assert inside.wait(JOIN_TIMEOUT_S)
        assert current_deadline() is main_deadline
        leave.set()
        assert future.result(JOIN_TIMEOUT_S) is worker_deadline
        assert current_deadline() is main_deadline


def test_a_copied_context_carries_the_deadline_and_keeps_its_changes() -> None:
    d = Deadline.at_ns(NOW)
    with deadline_scope(d):
        context = contextvars.copy_context()
    assert current_deadline() is None
    assert context.run(current_deadline) is d

    def tighten() -> Deadline | None:
        deadline_scope(Deadline.at_ns(NOW - 1)).__enter__()
        return current_deadline()

    tightened = context.run(tighten)
    assert tightened is not None and tightened.ns == NOW - 1
    assert context.run(current_deadline) is tightened
    assert current_deadline() is None


@given(st.lists(st.one_of(st.none(), st.integers(-(2**62), 2**62)), max_size=12))
def test_nested_scopes_in_any_order_yield_the_earliest(offsets: list[int | None]) -> None:
    deadlines = [None if offset is None else Deadline.at_ns(offset) for offset in offsets]
    with ExitStack() as stack:
        earliest: Deadline | None = None
        for d in deadlines:
            if d is not None and (earliest is None or d < earliest):
                earliest = d
            effective = stack.enter_context(deadline_scope(d))
            assert effective == earliest
            assert current_deadline() == earliest
    assert current_deadline() is None
