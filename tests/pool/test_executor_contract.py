"""The Executor contract, run against ``ThreadPoolExecutor`` and ``AdmissionPool`` alike.

Whatever a caller may rely on from ``concurrent.futures`` must hold for the
pool too (with a line long enough that admission never refuses here).
Propagation of ``contextvars`` is not part of the contract —
``ThreadPoolExecutor`` runs ``fn`` in the worker thread's own context — so it
is tested in ``test_pool.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, as_completed, wait
from concurrent.futures import TimeoutError as FuturesTimeoutError
from typing import Any

import prazo.bindings.pool as pool_module
import pytest
from prazo.bindings.pool import AdmissionPool

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

Factory = Callable[..., Executor]

WAIT_S = 10.0  # an upper bound for things that happen "soon"; never a speed assertion


def _thread_pool(max_workers: int = 4, thread_name_prefix: str = "contract") -> Executor:
    return ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix)


def _admission_pool(max_workers: int = 4, thread_name_prefix: str = "contract") -> Executor:
    return AdmissionPool(max_workers, 10_000, thread_name_prefix=thread_name_prefix)


def _admission_pool_python_path(max_workers: int = 4, thread_name_prefix: str = "contract") -> Executor:
    """The pool on its Python path (the specification of prazo.bindings._pool_c)."""
    previous = pool_module.use_compiled_path(False)
    try:
        return _admission_pool(max_workers, thread_name_prefix)
    finally:
        pool_module.use_compiled_path(previous)


@pytest.fixture(
    params=[_thread_pool, _admission_pool, _admission_pool_python_path],
    ids=["ThreadPoolExecutor", "AdmissionPool", "AdmissionPool-python-path"],
)
def make(request: pytest.FixtureRequest) -> Iterator[Factory]:
    created: list[Executor] = []

    def factory(*args: object, **kwargs: object) -> Executor:
        executor = request.param(*args, **kwargs)
        created.append(executor)
        return executor

    yield factory
    for executor in created:
        executor.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def executor(make: Factory) -> Executor:
    return make()


class Boom(Exception):
    pass


class FatalBoom(BaseException):
    pass


def _raise(exc: BaseException) -> None:
    raise exc


def _submit_holding(ex: Executor) -> tuple[Future[str], threading.Event]:
    """Submit a call that runs until the returned event is set; return once it is running."""
    release = threading.Event()
    started = threading.Event()

    def hold() -> str:
        started.set()
        release.wait(WAIT_S)
        return "held"

    future = ex.submit(hold)
    assert started.wait(WAIT_S)
    return future, release


def _blocked_single_worker(make: Factory) -> tuple[Executor, threading.Event, Future[str]]:
    """An executor whose only worker is busy until the returned event is set."""
    ex = make(1)
    first, release = _submit_holding(ex)
    return ex, release, first


def test_submit_returns_the_result(executor: Executor) -> None:
    assert executor.submit(pow, 2, 10).result(WAIT_S) == 1024


def test_submit_passes_args_and_kwargs(executor: Executor) -> None:
    future = executor.submit(dict, [("a", 1)], b=2)
    assert future.result(WAIT_S) == {"a": 1, "b": 2}


def test_exception_in_fn_is_set_on_the_future(executor: Executor) -> None:
    future = executor.submit(_raise, Boom("nope"))
    exc = future.exception(WAIT_S)
    assert isinstance(exc, Boom) and str(exc) == "nope"
    with pytest.raises(Boom):
        future.result()


def test_base_exception_in_fn_is_set_on_the_future_and_the_worker_survives(executor: Executor) -> None:
    future = executor.submit(_raise, FatalBoom())
    assert isinstance(future.exception(WAIT_S), FatalBoom)
    assert executor.submit(len, "abc").result(WAIT_S) == 3


def test_future_is_running_while_fn_runs(executor: Executor) -> None:
    future, release = _submit_holding(executor)
    assert future.running() and not future.done()
    release.set()
    assert future.result(WAIT_S) == "held"
    assert future.done() and not future.running()


def test_map_keeps_input_order(executor: Executor) -> None:
    def slow_identity(x: int) -> int:
        time.sleep(0.001 * (10 - x))
        return x

    assert list(executor.map(slow_identity, range(10))) == list(range(10))


def test_map_zips_iterables_like_builtin_map(executor: Executor) -> None:
    assert list(executor.map(pow, [2, 3, 4], [5, 2])) == [32, 9]


def test_map_raises_the_fn_exception_at_its_position(executor: Executor) -> None:
    def check(x: int) -> int:
        if x == 2:
            raise Boom(x)
        return x

    results = executor.map(check, range(4))
    assert next(results) == 0
    assert next(results) == 1
    with pytest.raises(Boom):
        next(results)


def test_map_timeout_raises_timeout_error(executor: Executor) -> None:
    release = threading.Event()
    results = executor.map(lambda _: release.wait(WAIT_S), range(2), timeout=0.05)
    started = time.monotonic()
    with pytest.raises(FuturesTimeoutError):
        next(results)
    assert time.monotonic() - started < WAIT_S / 2
    release.set()


def test_map_is_eager_submission(executor: Executor) -> None:
    calls: list[int] = []
    lock = threading.Lock()

    def record(x: int) -> None:
        with lock:
            calls.append(x)

    results = executor.map(record, range(5))
    deadline = time.monotonic() + WAIT_S
    while len(calls) < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert sorted(calls) == list(range(5))
    assert list(results) == [None] * 5


def test_many_tasks(executor: Executor) -> None:
    futures = [executor.submit(int.__mul__, i, 2) for i in range(2000)]
    assert sum(f.result(WAIT_S) for f in futures) == 2 * sum(range(2000))


def test_concurrency_never_exceeds_max_workers(make: Factory) -> None:
    ex = make(3)
    lock = threading.Lock()
    running = [0]
    peak = [0]

    def work() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.002)
        with lock:
            running[0] -= 1

    wait([ex.submit(work) for _ in range(40)], timeout=WAIT_S)
    assert 1 <= peak[0] <= 3


def test_done_callbacks_run_once_with_the_future(executor: Executor) -> None:
    seen: list[object] = []
    done = threading.Event()

    def callback(future: object) -> None:
        seen.append(future)
        done.set()

    ok: Future[Any] = executor.submit(int, "7")
    ok.add_done_callback(callback)
    failed: Future[Any] = executor.submit(_raise, Boom())
    failed.add_done_callback(callback)
    wait([ok, failed], timeout=WAIT_S)
    assert done.wait(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert sorted(map(id, seen)) == sorted([id(ok), id(failed)])
    # A callback added to a finished future runs at once, in the caller's thread.
    late: list[object] = []
    ok.add_done_callback(late.append)
    assert late == [ok]


def test_wait_and_as_completed_see_pool_futures(executor: Executor) -> None:
    release = threading.Event()
    slow: Future[Any] = executor.submit(release.wait, WAIT_S)
    fast: Future[Any] = executor.submit(int, "1")
    done, pending = wait([slow, fast], timeout=WAIT_S, return_when=FIRST_COMPLETED)
    assert fast in done and slow in pending
    release.set()
    assert set(as_completed([slow, fast], timeout=WAIT_S)) == {slow, fast}


def test_cancel_pending_future_never_runs(make: Factory) -> None:
    ex, release, first = _blocked_single_worker(make)
    ran = threading.Event()
    pending = ex.submit(ran.set)
    assert pending.cancel()
    assert pending.cancelled()
    release.set()
    assert first.result(WAIT_S) == "held"
    # Later work still runs: the cancelled item did not wedge the worker.
    assert ex.submit(int, "5").result(WAIT_S) == 5
    assert not ran.is_set()


def test_cancel_running_future_fails(executor: Executor) -> None:
    future, release = _submit_holding(executor)
    assert not future.cancel()
    release.set()
    assert future.result(WAIT_S) == "held"


def test_shutdown_wait_waits_for_running_and_queued_work(make: Factory) -> None:
    ex = make(2)
    finished: list[int] = []

    def work(i: int) -> None:
        time.sleep(0.01)
        finished.append(i)

    for i in range(6):
        ex.submit(work, i)
    ex.shutdown(wait=True)
    assert sorted(finished) == list(range(6))


def test_shutdown_without_wait_returns_while_work_runs(make: Factory) -> None:
    ex, release, first = _blocked_single_worker(make)
    queued = ex.submit(int, "3")
    started = time.monotonic()
    ex.shutdown(wait=False)
    assert time.monotonic() - started < WAIT_S / 2
    assert not first.done()
    release.set()
    assert first.result(WAIT_S) == "held"
    assert queued.result(WAIT_S) == 3


def test_shutdown_cancel_futures_cancels_what_has_not_started(make: Factory) -> None:
    ex, release, first = _blocked_single_worker(make)
    ran: list[int] = []
    queued = [ex.submit(ran.append, i) for i in range(5)]
    ex.shutdown(wait=False, cancel_futures=True)
    release.set()
    assert first.result(WAIT_S) == "held"
    # (Only cancelled(): ThreadPoolExecutor leaves these futures CANCELLED
    # without notifying concurrent.futures.wait(); AdmissionPool notifies.)
    assert all(f.cancelled() for f in queued)
    ex.shutdown(wait=True)
    assert ran == []


def test_submit_after_shutdown_raises_runtime_error(executor: Executor) -> None:
    executor.shutdown()
    with pytest.raises(RuntimeError, match=r"^cannot schedule new futures after shutdown$"):
        executor.submit(int)


def test_shutdown_twice_is_harmless(executor: Executor) -> None:
    executor.submit(int).result(WAIT_S)
    executor.shutdown()
    executor.shutdown()


def test_context_manager_shuts_down_and_waits(make: Factory) -> None:
    finished = threading.Event()

    def work() -> None:
        time.sleep(0.02)
        finished.set()

    with make(2) as ex:
        future = ex.submit(work)
    assert finished.is_set() and future.done()
    with pytest.raises(RuntimeError):
        ex.submit(int)


def test_worker_threads_carry_the_name_prefix(make: Factory) -> None:
    ex = make(1, thread_name_prefix="named-pool")
    name = ex.submit(lambda: threading.current_thread().name).result(WAIT_S)
    assert name == "named-pool_0"


def test_worker_threads_exit_after_shutdown(make: Factory) -> None:
    ex = make(3, thread_name_prefix="exiting-pool")
    wait([ex.submit(time.sleep, 0.001) for _ in range(10)], timeout=WAIT_S)
    ex.shutdown(wait=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("exiting-pool_")]


def test_asyncio_wrap_future_awaits_pool_futures(executor: Executor) -> None:
    import asyncio

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        done = asyncio.wrap_future(executor.submit(pow, 2, 10), loop=loop)
        failed = asyncio.wrap_future(executor.submit(int, "not a number"), loop=loop)
        gathered = await asyncio.wait_for(asyncio.gather(done, failed, return_exceptions=True), WAIT_S)
        return list(gathered)

    value, error = asyncio.run(main())
    assert value == 1024
    assert isinstance(error, ValueError)


def test_result_wakes_a_caller_blocked_before_the_task_ran(executor: Executor) -> None:
    release = threading.Event()
    future = executor.submit(lambda: release.wait(WAIT_S) and "done")
    waiter_result: list[object] = []
    waiter = threading.Thread(target=lambda: waiter_result.append(future.result(WAIT_S)))
    waiter.start()
    time.sleep(0.05)  # the waiter is (most likely) blocked in result(); either way it must get the value
    release.set()
    waiter.join(WAIT_S)
    assert waiter_result == ["done"]


def test_many_futures_each_settled_once_in_order_of_map(executor: Executor) -> None:
    futures = [executor.submit(operator_neg, i) for i in range(2_000)]
    _, not_done = wait(futures, timeout=WAIT_S)
    assert not not_done
    assert [f.result() for f in futures] == [-i for i in range(2_000)]
    assert list(executor.map(operator_neg, range(2_000), timeout=WAIT_S)) == [-i for i in range(2_000)]


def operator_neg(value: int) -> int:
    return -value
