"""``prazo.bindings._pool_c.FutureCondition``: the reentrant lock + condition the compiled pool's futures carry.

It replaces ``threading.Condition()`` inside those futures, so it must behave
like one wherever ``concurrent.futures`` uses it: reentrant ``with``, blocking
``acquire`` between threads, ``wait``/``notify``/``notify_all`` with the same
errors and timeout rules. Real-time waits use generous margins.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from _helpers import CheckedThread
from _required import require_compiled

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

_pool_c = require_compiled("prazo.bindings._pool_c")
FutureCondition = _pool_c.FutureCondition


def new() -> Any:
    return FutureCondition.__new__(FutureCondition)


def test_reentrant_and_owned_only_by_its_holder() -> None:
    c = new()
    assert not c._is_owned()
    with c:
        with c:
            assert c._is_owned()
        assert c._is_owned()
    assert not c._is_owned()
    with pytest.raises(RuntimeError, match="un-acquired"):
        c.release()


def test_release_from_another_thread_is_refused() -> None:
    c = new()
    c.acquire()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            c.release()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and c._is_owned()
    c.release()


def test_acquire_arguments_follow_rlock() -> None:
    c = new()
    with pytest.raises(ValueError, match="non-blocking"):
        c.acquire(False, 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        c.acquire(True, -2)


def test_a_second_thread_blocks_until_the_lock_is_free() -> None:
    c = new()
    c.acquire()
    got: list[bool] = []
    inside = threading.Event()

    def other() -> None:
        assert c.acquire(False) is False
        assert c.acquire(True, 0.05) is False
        got.append(c.acquire())
        inside.set()
        c.release()

    t = CheckedThread(target=other)
    t.start()
    time.sleep(0.2)
    assert not inside.is_set()
    c.release()
    t.join(10)
    assert got == [True] and inside.is_set()


def test_many_threads_counting_under_the_lock_lose_no_update() -> None:
    c = new()
    counter = [0]

    def work() -> None:
        for _ in range(2000):
            with c:
                value = counter[0]
                if value % 97 == 0:
                    time.sleep(0)  # let another thread contend while the lock is held
                counter[0] = value + 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter[0] == 12000 and not c._is_owned()


def test_wait_needs_the_lock_and_times_out() -> None:
    c = new()
    with pytest.raises(RuntimeError, match="un-acquired"):
        c.wait(0)
    with pytest.raises(RuntimeError, match="un-acquired"):
        c.notify()
    with c, c:
        assert c.wait(0) is False
        assert c.wait(0.01) is False
        # The depth comes back after the wait.
        assert c._is_owned()
    assert not c._is_owned()


def test_notify_wakes_one_and_notify_all_wakes_the_rest() -> None:
    c = new()
    woken: list[int] = []
    ready = threading.Semaphore(0)

    def waiter(i: int) -> None:
        with c:
            ready.release()
            assert c.wait(30)
            woken.append(i)

    threads = [CheckedThread(target=waiter, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for _ in threads:
        assert ready.acquire(timeout=10)
    with c:
        c.notify()
    deadline = time.monotonic() + 10
    while len(woken) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(woken) == 1
    with c:
        c.notify_all()
    for t in threads:
        t.join(10)
    assert sorted(woken) == [0, 1, 2]


def test_wait_for_returns_the_predicate() -> None:
    c = new()
    flag: list[bool] = []

    def setter() -> None:
        time.sleep(0.05)
        with c:
            flag.append(True)
            c.notify_all()

    t = threading.Thread(target=setter)
    t.start()
    with c:
        assert c.wait_for(lambda: bool(flag), 30) is True
        assert c.wait_for(lambda: False, 0.01) is False
    t.join()


def test_a_huge_timeout_waits_like_forever() -> None:
    c = new()
    c.acquire()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(c.acquire(True, 1e300)) or c.release())
    t.start()
    time.sleep(0.05)
    c.release()
    t.join(10)
    assert got == [True]
