"""What ``AdmissionPool`` adds to an Executor: bounded admission, deadlines, contexts, stats."""

from __future__ import annotations

import concurrent.futures
import contextvars
import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import wait
from typing import Any

import prazo.bindings.pool as pool_module
import pytest
from _helpers import examples
from _required import require_compiled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prazo.bindings.pool import AdmissionPool
from prazo.core import (
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    Deadline,
    DeadlineExceeded,
    QueueFull,
    current_deadline,
    deadline_scope,
)

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

WAIT_S = 10.0  # an upper bound for things that happen "soon"; never a speed assertion


def require_compiled_pool() -> None:
    """The compiled pool path follows the twins' rule: missing fails, unless PRAZO_NO_EXTENSIONS=1 asked for it.

    Built but unusable (``use_compiled_path(True)`` raises) is an error of the test, never a skip.
    """
    require_compiled("prazo.bindings._pool_c")


@pytest.fixture(params=["compiled", "python"])
def pool_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every pool test runs on both paths of the pool: prazo.bindings._pool_c and the Python specification."""
    compiled = request.param == "compiled"
    if compiled:
        require_compiled_pool()
    previous = pool_module.use_compiled_path(compiled)
    yield request.param
    pool_module.use_compiled_path(previous)


@pytest.fixture
def pools(pool_path: str) -> Iterator[Callable[..., AdmissionPool]]:
    """Make pools that are always shut down, even when a test fails."""
    created: list[AdmissionPool] = []

    def make(*args: Any, **kwargs: Any) -> AdmissionPool:
        pool = AdmissionPool(*args, **kwargs)
        created.append(pool)
        return pool

    yield make
    for pool in created:
        pool.shutdown(wait=True, cancel_futures=True)


class Gate:
    """Blocks every fn that calls it until opened; counts who got in."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0

    def __call__(self, value: object = None) -> object:
        with self._lock:
            self.entered += 1
        assert self._open.wait(WAIT_S)
        return value

    def wait_entered(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.entered < count:
            assert time.monotonic() < deadline, f"only {self.entered} of {count} calls entered"
            time.sleep(0.001)

    def open(self) -> None:
        self._open.set()


class Calls:
    """A thread-safe record of calls, to prove that fn was (never) called."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: list[object] = []

    def __call__(self, value: object = None) -> object:
        with self._lock:
            self.values.append(value)
        return value


def _busy_pool(
    make: Callable[..., AdmissionPool], max_workers: int, max_queue: int, **kwargs: Any
) -> tuple[AdmissionPool, Gate]:
    """A pool whose every worker is inside a gated call."""
    pool = make(max_workers, max_queue, **kwargs)
    gate = Gate()
    for _ in range(max_workers):
        pool.submit(gate)
    gate.wait_entered(max_workers)
    return pool, gate


def _wait_done(future: Any, timeout: float = WAIT_S) -> None:
    done, _ = wait([future], timeout=timeout)
    assert done, "the future did not finish in time"


# -- admission -------------------------------------------------------------------


@pytest.mark.parametrize("round_", range(20))
def test_submit_rejects_at_once_without_waiting_for_workers(pools: Callable[..., AdmissionPool], round_: int) -> None:
    # No sleep anywhere: the workers may not even have started when the last
    # submit runs, yet the decision is already exact.
    max_workers, max_queue = 2, 3
    pool = pools(max_workers, max_queue)
    barrier = threading.Barrier(max_workers + 1, timeout=WAIT_S)
    running = [pool.submit(barrier.wait) for _ in range(max_workers)]
    waiting = [pool.submit(int, str(i)) for i in range(max_queue)]
    with pytest.raises(QueueFull) as info:
        pool.submit(int, "99")
    assert info.value.reason == "queue-full" and info.value.status == 503
    # Both running tasks met this thread at the barrier: the three arrival indices, in
    # whatever order they came (a worker may reach it after this thread does).
    mine = barrier.wait()
    assert sorted([mine, *(f.result(WAIT_S) for f in running)]) == [0, 1, 2]
    assert [f.result(WAIT_S) for f in waiting] == [0, 1, 2]
    assert pool.stats()["rejected_full"] == 1


def test_queue_full_is_a_queue_full_error_of_the_stdlib(pools: Callable[..., AdmissionPool]) -> None:
    import queue

    pool, gate = _busy_pool(pools, 1, 0)
    with pytest.raises(queue.Full):
        pool.submit(int)
    gate.open()


def test_workers_start_lazily_up_to_max_workers(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(3, 100)
    assert pool.stats()["workers"] == 0
    pool.submit(int).result(WAIT_S)
    assert pool.stats()["workers"] == 1
    wait([pool.submit(time.sleep, 0.001) for _ in range(50)], timeout=WAIT_S)
    assert pool.stats()["workers"] == 3


def test_map_refused_midway_cancels_what_it_already_submitted(pools: Callable[..., AdmissionPool]) -> None:
    pool, gate = _busy_pool(pools, 1, 2)
    calls = Calls()
    with pytest.raises(QueueFull):
        pool.map(calls, range(5))
    gate.open()
    pool.shutdown(wait=True)
    assert calls.values == []
    assert pool.stats()["futures_cancelled"] == 2


def test_lifo_order_starts_the_newest_first(pools: Callable[..., AdmissionPool]) -> None:
    pool, gate = _busy_pool(pools, 1, 3, order="lifo")
    calls = Calls()
    futures = [pool.submit(calls, i) for i in range(3)]
    gate.open()
    wait(futures, timeout=WAIT_S)
    assert calls.values == [2, 1, 0]


# -- deadlines -------------------------------------------------------------------


def test_expired_on_arrival_fails_the_future_and_never_calls_fn(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(2, 2)
    calls = Calls()
    future = pool.submit_until(Deadline.after(-0.001), calls)
    with deadline_scope(Deadline.after_ms(-5)):
        inherited = pool.submit(calls)
    for f in (future, inherited):
        exc = f.exception(WAIT_S)
        assert isinstance(exc, DeadlineExceeded) and exc.reason == REASON_EXPIRED_ON_ARRIVAL and exc.status == 504
    assert calls.values == []
    stats = pool.stats()
    assert stats["expired_on_arrival"] == 2 and stats["workers"] == 0


def test_queued_item_fails_at_its_own_deadline_while_workers_are_busy(pools: Callable[..., AdmissionPool]) -> None:
    pool, gate = _busy_pool(pools, 1, 5)
    calls = Calls()
    started = time.monotonic()
    doomed = pool.submit_until(Deadline.after(0.05), calls, "doomed")
    # Active expiry: the worker is still blocked, so nothing but the deadline
    # itself can fail this future.
    _wait_done(doomed)
    assert time.monotonic() - started >= 0.045
    exc = doomed.exception()
    assert isinstance(exc, DeadlineExceeded) and exc.reason == REASON_EXPIRED_IN_QUEUE
    assert gate.entered == 1
    gate.open()
    assert pool.submit(calls, "later").result(WAIT_S) == "later"
    assert calls.values == ["later"]
    assert pool.stats()["expired_in_queue"] == 1


def test_each_queued_item_expires_by_its_own_deadline_in_any_order(pools: Callable[..., AdmissionPool]) -> None:
    pool, gate = _busy_pool(pools, 1, 10)
    calls = Calls()
    # Submitted late-first, so a later submission carries an earlier deadline
    # and must wake the reaper earlier than it planned. The gaps are wide so
    # a loaded machine cannot merge two expiries into one sweep.
    budgets_ms = [800, 300, 40]
    futures = {ms: pool.submit_until(Deadline.after_ms(ms), calls, ms) for ms in budgets_ms}
    survivor = pool.submit_until(None, calls, "survivor")
    still_pending_when_done = {}

    def note(ms: int) -> None:
        still_pending_when_done[ms] = sorted(other for other, f in futures.items() if not f.done())

    for ms, future in futures.items():
        future.add_done_callback(lambda _, ms=ms: note(ms))
    wait(list(futures.values()), timeout=WAIT_S)
    assert still_pending_when_done == {40: [300, 800], 300: [800], 800: []}
    assert all(isinstance(f.exception(), DeadlineExceeded) for f in futures.values())
    assert not survivor.done() and gate.entered == 1
    gate.open()
    assert survivor.result(WAIT_S) == "survivor"
    assert calls.values == ["survivor"]


def test_item_expiring_after_its_slot_was_assigned_never_runs(pools: Callable[..., AdmissionPool]) -> None:
    # The slot is handed to the waiting item in time, but the worker is slow
    # to come back for it (a done callback of the previous item sleeps in the
    # worker thread): the deadline passes in between, and get() drops it.
    pool = pools(1, 1)
    calls = Calls()
    proceed = threading.Event()
    first = pool.submit(proceed.wait, WAIT_S)
    first.add_done_callback(lambda _: time.sleep(0.3))
    doomed = pool.submit_until(Deadline.after(0.2), calls)
    proceed.set()
    exc = doomed.exception(WAIT_S)
    assert isinstance(exc, DeadlineExceeded) and exc.reason == REASON_EXPIRED_IN_QUEUE
    assert calls.values == []
    assert pool.submit(calls, "after").result(WAIT_S) == "after"


def test_fn_runs_inside_the_callers_deadline_scope(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(2, 2)
    caller = Deadline.after(5.0)
    with deadline_scope(caller):
        seen = pool.submit(current_deadline).result(WAIT_S)
    assert seen == caller
    assert pool.submit(current_deadline).result(WAIT_S) is None


def test_submit_until_uses_exactly_the_given_deadline(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(2, 2)
    short, long_ = Deadline.after(5.0), Deadline.after(60.0)
    with deadline_scope(short):
        assert pool.submit_until(long_, current_deadline).result(WAIT_S) == long_
        assert pool.submit_until(None, current_deadline).result(WAIT_S) is None
        assert current_deadline() == short


def test_deadline_check_inside_fn_stops_a_cooperative_loop(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(1, 1)

    def loop_until_told() -> None:
        deadline = current_deadline()
        assert deadline is not None
        for _ in range(10**9):
            deadline.check()
            time.sleep(0.001)

    future = pool.submit_until(Deadline.after(0.05), loop_until_told)
    exc = future.exception(WAIT_S)
    assert isinstance(exc, DeadlineExceeded) and exc.reason == "deadline-exceeded"
    assert pool.stats()["fn_raised"] == 1


# -- contexts ----------------------------------------------------------------------

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def test_fn_sees_the_submitters_context_vars(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(1, 10)
    token = request_id.set("req-1")
    try:
        future = pool.submit(request_id.get)
        request_id.set("req-2")  # later changes are not seen: the copy is taken at submit
        assert future.result(WAIT_S) == "req-1"
    finally:
        request_id.reset(token)


def test_context_changes_in_fn_stay_in_that_task(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(1, 10)

    def set_and_read(value: str) -> str | None:
        before = request_id.get()
        request_id.set(value)
        return before

    # One worker runs both: the second task must not see the first task's value.
    assert pool.submit(set_and_read, "a").result(WAIT_S) is None
    assert pool.submit(set_and_read, "b").result(WAIT_S) is None
    assert request_id.get() is None


# -- cancellation, shutdown, lifetime -----------------------------------------------------


def test_cancelled_waiting_future_leaves_the_line_at_once(pools: Callable[..., AdmissionPool]) -> None:
    pool, gate = _busy_pool(pools, 1, 1)
    calls = Calls()
    cancelled = pool.submit(calls, "cancelled")
    assert pool.stats()["queued"] == 1
    assert cancelled.cancel()
    # Its place is free while the only worker is still busy.
    stats = pool.stats()
    assert (stats["queued"], stats["cancelled"], stats["futures_cancelled"]) == (0, 1, 1)
    assert concurrent.futures.wait([cancelled], timeout=WAIT_S).done == {cancelled}
    replacement = pool.submit(calls, "replacement")
    with pytest.raises(QueueFull):
        pool.submit(calls, "one too many")
    gate.open()
    assert replacement.result(WAIT_S) == "replacement"
    assert calls.values == ["replacement"]


def test_cancelled_waiting_future_never_runs_and_frees_its_place(pools: Callable[..., AdmissionPool]) -> None:
    pool, gate = _busy_pool(pools, 1, 1)
    calls = Calls()
    cancelled = pool.submit(calls, "cancelled")
    assert cancelled.cancel()
    gate.open()
    # Once the cancelled item is dropped at the head, the pool takes the full
    # max_workers + max_queue again.
    deadline = time.monotonic() + WAIT_S
    while pool.stats()["futures_cancelled"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    pool2_gate = Gate()
    blocker = pool.submit(pool2_gate)
    pool2_gate.wait_entered(1)
    queued = pool.submit(calls, "queued")
    with pytest.raises(QueueFull):
        pool.submit(calls, "one too many")
    pool2_gate.open()
    assert blocker.result(WAIT_S) is None and queued.result(WAIT_S) == "queued"
    assert calls.values == ["queued"]
    stats = pool.stats()
    assert stats["futures_cancelled"] == 1 and stats["in_flight"] == 0


def test_shutdown_cancel_futures_counts_and_never_calls(pools: Callable[..., AdmissionPool]) -> None:
    pool, gate = _busy_pool(pools, 2, 4)
    calls = Calls()
    queued = [pool.submit(calls, i) for i in range(4)]
    pool.shutdown(wait=False, cancel_futures=True)
    gate.open()
    pool.shutdown(wait=True)
    assert all(f.cancelled() for f in queued)
    _, not_done = wait(queued, timeout=WAIT_S)  # notified, unlike ThreadPoolExecutor
    assert not not_done
    assert calls.values == []
    stats = pool.stats()
    assert stats["futures_cancelled"] == 4 and stats["cancelled"] == 4
    assert stats["in_flight"] == 0 and stats["queued"] == 0


@pytest.mark.parametrize("wait_for_it", [True, False])
def test_shutdown_stops_the_reaper_thread(pools: Callable[..., AdmissionPool], wait_for_it: bool) -> None:
    prefix = f"reaped-pool-{wait_for_it}"
    pool, gate = _busy_pool(pools, 1, 2, thread_name_prefix=prefix)
    # A far deadline: the reaper sleeps towards it, yet must leave as soon as
    # the line is drained, not 30 s later.
    waiting = pool.submit_until(Deadline.after(30.0), int, "1")
    assert any(t.name == f"{prefix}_reaper" for t in threading.enumerate())
    pool.shutdown(wait=False)
    gate.open()
    if wait_for_it:
        pool.shutdown(wait=True)
    assert waiting.result(WAIT_S) == 1
    _wait_for_threads_to_exit(prefix + "_")


def _wait_for_threads_to_exit(prefix: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while [t for t in threading.enumerate() if t.name.startswith(prefix)]:
        assert time.monotonic() < deadline, f"threads named {prefix}* outlived their pool"
        time.sleep(0.005)


def test_dropped_pool_lets_its_threads_exit() -> None:
    def use_and_drop() -> None:
        pool = AdmissionPool(2, 4, thread_name_prefix="dropped-pool")
        pool.submit_until(Deadline.after(30.0), int, "1").result(WAIT_S)
        pool.submit(int).result(WAIT_S)

    use_and_drop()
    gc.collect()
    _wait_for_threads_to_exit("dropped-pool_")


def test_interpreter_exit_runs_queued_work_like_thread_pool_executor() -> None:
    script = textwrap.dedent(
        """
        import time
        from prazo.bindings.pool import AdmissionPool
        pool = AdmissionPool(1, 4)
        pool.submit(time.sleep, 0.1)
        pool.submit(print, "ran at exit", flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran at exit\n"


# -- stats and arguments -------------------------------------------------------------------


def test_stats_add_the_pools_own_counters(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(2, 8)
    assert pool.submit(int, "1").result(WAIT_S) == 1
    assert isinstance(pool.submit(int, "x").exception(WAIT_S), ValueError)
    pool.shutdown(wait=True)
    stats = pool.stats()
    assert stats["offered"] == 2 and stats["started"] == 2 and stats["completed"] == 2
    assert stats["fn_raised"] == 1 and stats["futures_cancelled"] == 0
    assert stats["max_concurrency"] == 2 and stats["max_queue"] == 8
    assert 1 <= stats["workers"] <= 2
    assert repr(pool).startswith("<prazo.bindings.pool.AdmissionPool max_workers=2 max_queue=8")


@pytest.mark.parametrize(
    "args, kwargs, error, name",
    [
        ((0, 1), {}, ValueError, "max_workers"),
        ((-3, 1), {}, ValueError, "max_workers"),
        ((1.5, 1), {}, TypeError, "max_workers"),
        (("4", 1), {}, TypeError, "max_workers"),
        ((True, 1), {}, TypeError, "max_workers"),
        ((2**31, 1), {}, ValueError, "max_workers"),
        ((1, -1), {}, ValueError, "max_queue"),
        ((1, None), {}, TypeError, "max_queue"),
        ((1, 1), {"order": "random"}, ValueError, "order"),
        ((1, 1), {"order": None}, TypeError, "order"),
        ((1, 1), {"thread_name_prefix": 3}, TypeError, "thread_name_prefix"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(
    args: tuple[Any, ...], kwargs: dict, error: type, name: str
) -> None:
    with pytest.raises(error, match=name):
        AdmissionPool(*args, **kwargs)


def test_bad_submit_arguments_name_the_argument(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(1, 1)
    with pytest.raises(TypeError, match="fn"):
        pool.submit(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="deadline"):
        pool.submit_until(2.0, int)  # type: ignore[arg-type]
    assert pool.stats()["offered"] == 0


# -- property: every accepted future ends in exactly one outcome ------------------------------

_operation = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from([None, -1.0, 1.0, 3.0, 10_000.0])),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("sleep"), st.sampled_from([0.0, 2.0])),
)


def _pool_on_path(compiled: bool, *args: Any) -> AdmissionPool:
    """An AdmissionPool on the compiled or the Python path (skips when the compiled one is not built)."""
    if compiled:
        require_compiled_pool()
    previous = pool_module.use_compiled_path(compiled)
    try:
        return AdmissionPool(*args)
    finally:
        pool_module.use_compiled_path(previous)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_workers=st.integers(1, 3),
    max_queue=st.integers(0, 4),
    operations=st.lists(_operation, max_size=20),
    cancel_at_shutdown=st.booleans(),
)
def test_every_submission_ends_in_exactly_one_outcome(
    compiled: bool, max_workers: int, max_queue: int, operations: list[tuple[str, Any]], cancel_at_shutdown: bool
) -> None:
    pool = _pool_on_path(compiled, max_workers, max_queue)
    gate = Gate()
    calls = Calls()
    futures = []
    rejected = 0
    try:
        for index, (op, value) in enumerate(operations):
            if op == "submit":
                deadline = None if value is None else Deadline.after_ms(value)
                try:
                    futures.append(pool.submit_until(deadline, _gated_call, gate, calls, index))
                except QueueFull:
                    rejected += 1
            elif op == "cancel" and futures:
                futures[value % len(futures)].cancel()
            elif op == "sleep":
                time.sleep(value / 1000)
    finally:
        pool.shutdown(wait=False, cancel_futures=cancel_at_shutdown)
        gate.open()
        pool.shutdown(wait=True)
    _, not_done = wait(futures, timeout=WAIT_S)
    assert not not_done
    succeeded = [f.result() for f in futures if not f.cancelled() and f.exception() is None]
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            assert isinstance(future.exception(), DeadlineExceeded)
    # fn ran exactly for the futures that hold a result, once each.
    assert sorted(calls.values) == sorted(succeeded)  # type: ignore[type-var]
    stats = pool.stats()
    assert stats["offered"] == len(futures) + rejected
    assert stats["rejected_full"] == rejected
    assert stats["in_flight"] == stats["queued"] == stats["assigned"] == 0
    assert stats["offered"] == stats["started"] + stats["rejected_full"] + stats["expired"] + stats["cancelled"]
    cancelled_futures = sum(f.cancelled() for f in futures)
    assert stats["futures_cancelled"] == cancelled_futures


def _gated_call(gate: Gate, calls: Calls, value: int) -> object:
    calls(value)
    return gate(value)


# -- no reference cycles: a finished future dies with its last reference -----------


def _dies_without_collection(ref: Callable[[], object]) -> bool:
    """True once ``ref()`` is None; the cyclic collector is off, so only refcounting can free it."""
    deadline = time.monotonic() + 2.0
    while ref() is not None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("fate", ["ran", "raised", "expired-in-queue", "expired-on-arrival", "cancelled"])
def test_a_future_that_waited_in_line_is_freed_by_refcounting(pools: Callable[..., AdmissionPool], fate: str) -> None:
    """No cycle future -> line -> item -> future, nor future -> exception -> traceback -> frame -> future.

    A soak showed every future that waited in line (and every one failed on
    arrival) surviving as cyclic garbage until a full collection.
    """
    pool, gate = _busy_pool(pools, 1, 4)
    gc.collect()
    gc.disable()
    try:
        if fate == "expired-on-arrival":
            future = pool.submit_until(Deadline.after(-1.0), int, "1")
        elif fate == "expired-in-queue":
            future = pool.submit_until(Deadline.after(0.02), int, "1")
            _wait_done(future)
        else:
            future = pool.submit(int, "x" if fate == "raised" else "1")
            if fate == "cancelled":
                assert future.cancel()
        gate.open()
        _wait_done(future)
        if fate == "ran":
            assert future.result() == 1
        elif fate == "raised":
            assert isinstance(future.exception(), ValueError)
        elif fate != "cancelled":
            assert isinstance(future.exception(), DeadlineExceeded)
        ref = weakref.ref(future)
        del future
        assert _dies_without_collection(ref), f"a {fate} future outlived its last reference (a reference cycle)"
    finally:
        gc.enable()


def test_map_under_an_expired_deadline_never_calls_fn(pools: Callable[..., AdmissionPool]) -> None:
    pool, calls = pools(2, 10), Calls()
    with deadline_scope(Deadline.after(-1.0)):
        results = pool.map(calls, range(5))
    with pytest.raises(DeadlineExceeded) as caught:
        next(results)
    assert caught.value.reason == REASON_EXPIRED_ON_ARRIVAL
    assert calls.values == []


def test_map_runs_every_item_under_the_one_deadline_of_the_batch(pools: Callable[..., AdmissionPool]) -> None:
    pool = pools(2, 100)
    with deadline_scope(Deadline.after(60.0)) as deadline:
        seen = list(pool.map(lambda _: current_deadline(), range(50), timeout=WAIT_S))
    assert all(found is deadline for found in seen)


def test_done_callbacks_of_compiled_and_python_futures_run_once(pools: Callable[..., AdmissionPool]) -> None:
    pool, calls = pools(2, 100), Calls()
    futures = [pool.submit(int, str(i)) for i in range(20)]
    for future in futures:
        future.add_done_callback(lambda f: calls(f.result()))
    wait(futures, timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while len(calls.values) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(calls.values) == list(range(20))  # type: ignore[type-var]


def test_use_compiled_path_names_its_argument() -> None:
    with pytest.raises(TypeError, match="enabled"):
        pool_module.use_compiled_path("yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("first_leaves", ["cancelled", "stays"])
def test_items_sharing_a_deadline_all_expire_at_it_even_when_the_first_left_the_line(
    pools: Callable[..., AdmissionPool], first_leaves: str
) -> None:
    # The reaper keeps one entry for items that share a deadline: the first
    # item leaving the line early must not leave its followers unwatched.
    pool, gate = _busy_pool(pools, 1, 10)
    calls = Calls()
    # Long enough that all six are in line before it passes on a loaded machine (0.1 s was
    # not once, on a free-threaded build beside a compiler: a follower expired on arrival).
    deadline = Deadline.after(0.5)
    first = pool.submit_until(deadline, calls, "first")
    followers = [pool.submit_until(deadline, calls, i) for i in range(5)]
    if first_leaves == "cancelled":
        assert first.cancel()
    for future in followers:
        _wait_done(future)  # the worker is still blocked: only the reaper can fail them
        exc = future.exception()
        assert isinstance(exc, DeadlineExceeded) and exc.reason == REASON_EXPIRED_IN_QUEUE
    assert deadline.remaining_ns() <= 0
    gate.open()
    assert pool.submit(calls, "later").result(WAIT_S) == "later"
    assert calls.values == ["later"]
