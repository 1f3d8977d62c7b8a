"""``RetryBudget``: its arithmetic against a reference model (Hypothesis, fake clock), and many threads sharing one.

The model is the module docstring's definition written as plainly as
possible: a list of every deposit and withdrawal with its time; the balance
is the reserve plus the amounts whose generation is one of the last
``GENERATIONS``; a withdrawal succeeds when the balance holds one token.
"""

from __future__ import annotations

import pytest
from _helpers import SecondsClock, examples, run_checked
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.retries import RetryBudget, RetryBudgets
from prazo.bindings.retries.budget import TOKEN
from prazo.bindings.retries.window import GENERATIONS


class Model:
    def __init__(self, ttl_s: float, min_per_s: float, percent: float) -> None:
        self.generation_ns = max(1, round(ttl_s * 1e9 / GENERATIONS))
        self.per_call = round(percent * TOKEN)
        self.reserve = round(min_per_s * ttl_s * TOKEN)
        self.events: list[tuple[int, int]] = []

    def balance(self, now_ns: int) -> int:
        current = now_ns // self.generation_ns
        live = sum(amount for at, amount in self.events if at // self.generation_ns > current - GENERATIONS)
        return self.reserve + live

    def deposit(self, now_ns: int) -> None:
        self.events.append((now_ns, self.per_call))

    def try_withdraw(self, now_ns: int) -> bool:
        if self.balance(now_ns) < TOKEN:
            return False
        self.events.append((now_ns, -TOKEN))
        return True


operations = st.lists(
    st.one_of(
        st.just(("deposit", 0.0)),
        st.just(("withdraw", 0.0)),
        st.tuples(st.just("advance"), st.floats(min_value=0.0, max_value=3.0)),
    ),
    max_size=200,
)


@settings(max_examples=examples(200), deadline=None)
@given(
    ttl_s=st.sampled_from([0.5, 1.0, 10.0]),
    min_per_s=st.sampled_from([0.0, 0.5, 1.0, 10.0]),
    percent=st.sampled_from([0.0, 0.1, 0.2, 0.5, 1.0]),
    steps=operations,
)
def test_the_budget_follows_the_model(
    ttl_s: float, min_per_s: float, percent: float, steps: list[tuple[str, float]]
) -> None:
    clock = SecondsClock()
    budget = RetryBudget(ttl_s=ttl_s, min_per_s=min_per_s, percent=percent, clock=clock)
    model = Model(ttl_s, min_per_s, percent)
    withdrawn = 0
    for operation, seconds in steps:
        if operation == "advance":
            clock.advance(seconds)
        elif operation == "deposit":
            budget.deposit()
            model.deposit(clock())
        else:
            taken = budget.try_withdraw()
            assert taken == model.try_withdraw(clock())
            withdrawn += taken
        assert budget.balance() == model.balance(clock()) / TOKEN
    stats = budget.stats()
    assert stats["withdrawn"] == withdrawn
    assert stats["deposits"] == sum(1 for operation, _ in steps if operation == "deposit")


def test_ten_percent_of_the_calls_on_top_and_no_more() -> None:
    clock = SecondsClock()
    budget = RetryBudget(ttl_s=10, min_per_s=0, percent=0.1, clock=clock)
    for _ in range(100):
        budget.deposit()
    assert sum(budget.try_withdraw() for _ in range(20)) == 10
    assert budget.stats()["refused"] == 10


def test_deposits_expire_after_the_ttl_and_withdrawals_give_the_reserve_back() -> None:
    clock = SecondsClock()
    budget = RetryBudget(ttl_s=10, min_per_s=0.1, percent=0.5, clock=clock)  # reserve: 1 token
    budget.deposit()
    budget.deposit()
    assert [budget.try_withdraw() for _ in range(3)] == [True, True, False]
    clock.advance(10.0)  # everything above has left the window: only the reserve remains
    assert budget.balance() == 1.0
    assert [budget.try_withdraw() for _ in range(2)] == [True, False]


def test_the_reserve_allows_min_per_s_over_the_ttl_without_any_call() -> None:
    clock = SecondsClock()
    budget = RetryBudget(ttl_s=2, min_per_s=5, percent=0.2, clock=clock)
    assert sum(budget.try_withdraw() for _ in range(20)) == 10


@pytest.mark.parametrize(
    ("arguments", "error", "name"),
    [
        ({"ttl_s": 0}, ValueError, "ttl_s"),
        ({"ttl_s": float("nan")}, ValueError, "ttl_s"),
        ({"ttl_s": "10"}, TypeError, "ttl_s"),
        ({"min_per_s": -1}, ValueError, "min_per_s"),
        ({"percent": 1.5}, ValueError, "percent"),
        ({"percent": True}, TypeError, "percent"),
        ({"clock": 3}, TypeError, "clock"),
    ],
)
def test_wrong_arguments_name_themselves(arguments: dict[str, object], error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=name):
        RetryBudget(**arguments)  # type: ignore[arg-type]
    with pytest.raises(error, match=name):
        RetryBudgets(**arguments)  # type: ignore[arg-type]


def test_one_budget_per_destination() -> None:
    budgets = RetryBudgets(min_per_s=0, percent=1.0)
    budgets.for_destination("a").deposit()
    assert budgets.for_destination("a").try_withdraw()
    assert not budgets.for_destination("b").try_withdraw()
    assert budgets.destinations() == ["a", "b"]
    single = RetryBudget()
    assert single.for_destination("anything") is single


THREADS = 8


def test_many_threads_sharing_one_budget_never_exceed_it() -> None:
    # A frozen clock: nothing expires, so the bound is exact.
    clock = SecondsClock()
    budget = RetryBudget(ttl_s=10, min_per_s=1, percent=0.1, clock=clock)  # reserve: 10 tokens
    deposits_each, withdrawals_each = 500, 200
    taken = [0] * THREADS

    def mixed(index: int) -> None:
        for step in range(deposits_each):
            budget.deposit()
            if step % 2 == 0:
                taken[index] += budget.try_withdraw()

    run_checked([lambda index=index: mixed(index) for index in range(THREADS)])
    allowed = (THREADS * deposits_each * round(0.1 * TOKEN) + 10 * TOKEN) // TOKEN
    assert sum(taken) <= allowed
    assert budget.balance() >= 0

    # Then every thread withdraws at once: exactly what is left is handed out.
    left = int(budget.balance())
    grabbed = [0] * THREADS

    def withdraw(index: int) -> None:
        for _ in range(withdrawals_each):
            grabbed[index] += budget.try_withdraw()

    run_checked([lambda index=index: withdraw(index) for index in range(THREADS)])
    assert sum(grabbed) == left
    assert sum(taken) + sum(grabbed) == allowed
