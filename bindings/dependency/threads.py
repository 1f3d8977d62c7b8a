"""``BoundedThreads``: a dependency's own threads, never more than its bulkhead allows.

A blocking call cannot be killed in Python. The only way to stop waiting for
one is to run it on another thread and walk away; the thread stays busy until
the call really returns. A naive timeout wrapper (a new thread, or an
unbounded executor, per call) therefore piles up abandoned threads exactly
while the dependency hangs. Here the *bulkhead place* and the *thread* are the
same thing: ``try_start`` hands a task to one of at most ``max_threads``
threads, or refuses at once when that many tasks are running — there is no
queue, so a hung dependency holds at most ``max_threads`` threads, and new
calls are refused instead of piling up behind it.

Threads start lazily (one when a task arrives and none is idle) and an idle
thread exits after ``idle_s`` seconds, so a dependency that is rarely called
costs no threads. They are daemon threads: a call that hangs forever must not
keep the interpreter from exiting (the caller has long been answered). A
forked child starts with an empty thread set (its parent's threads do not
exist there), so a service forked after making calls (gunicorn ``--preload``)
gets the whole bulkhead.

The task is given a ``release`` callable: calling it gives the place back
before the task's own tail (publishing its result), so a caller that sees the
result can at once start another call without meeting a place that is still
held for a moment. The thread set calls it itself if the task did not.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from numbers import Real

__all__ = ["BoundedThreads", "Task"]

# What a task receives: call it once to give the place back early.
Task = Callable[[Callable[[], None]], None]

# Every thread set, so a forked child can start from nothing (below).
_instances: weakref.WeakSet[BoundedThreads] = weakref.WeakSet()


def _forget_threads_after_fork() -> None:
    # A forked child has only the thread that forked: the others' places and
    # idle slots would be counted forever (gunicorn --preload forks after the
    # app may have made calls), so every thread set starts again empty.
    for threads in list(_instances):
        threads._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads_after_fork)


def _check_idle_s(idle_s: object) -> float:
    if isinstance(idle_s, bool) or not isinstance(idle_s, Real):
        raise TypeError(f"idle_s must be a real number, not {type(idle_s).__name__}")
    as_float = float(idle_s)
    if not 0 < as_float <= 86_400:  # NaN and infinities fail this too
        raise ValueError(f"idle_s must be > 0 and at most 86400 (a day), got {as_float!r}")
    return as_float


class _Place:
    """One bulkhead place; ``release`` gives it back exactly once."""

    __slots__ = ("_generation", "_owner", "_released")

    def __init__(self, owner: BoundedThreads) -> None:
        self._owner = owner
        self._generation = owner._generation
        self._released = False

    def release(self) -> None:
        owner = self._owner
        with owner._cond:
            if self._released or self._generation != owner._generation:
                return  # released already, or taken before a fork reset the set
            self._released = True
            # The thread finishing this task counts as waiting from now on:
            # a task handed over in the meantime is its next one, so a thread
            # is never started for a place this one is about to free.
            owner._running -= 1
            owner._waiting += 1
            if owner._running == 0:
                owner._idle.notify_all()


class BoundedThreads:
    """At most ``max_threads`` tasks at once, each on its own thread; no queue.

    >>> threads = BoundedThreads(2, name="recs")
    >>> threads.try_start(lambda release: None)
    True

    ``try_start(task)`` returns False at once when ``max_threads`` tasks are
    running (a task that outlived its caller included); it never blocks and
    never starts more than ``max_threads`` threads. ``running`` counts the
    places held, ``threads`` the threads alive (running ones plus idle ones
    waiting up to ``idle_s`` for the next task).
    """

    def __init__(self, max_threads: int, *, idle_s: float = 30.0, name: str = "prazo-dependency") -> None:
        if isinstance(max_threads, bool) or not isinstance(max_threads, int):
            raise TypeError(f"max_threads must be an int, not {type(max_threads).__name__}")
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self._max = max_threads
        self._idle_s = _check_idle_s(idle_s)
        self._name = name
        lock = threading.Lock()
        # Workers wait on _cond for a task; wait_idle waits on _idle. One lock,
        # two conditions, so freeing a place never wakes every idle worker.
        self._cond = threading.Condition(lock)
        self._idle = threading.Condition(lock)
        self._tasks: deque[tuple[Task, _Place]] = deque()
        # _running: places held (tasks handed over and not yet released).
        # _waiting: threads alive and not running a task (new ones included),
        # so len(_tasks) <= _waiting always and no task is left without a thread.
        self._running = 0
        self._waiting = 0
        self._threads = 0
        self._started = 0
        self._generation = 0
        _instances.add(self)

    def _reset(self) -> None:
        """Forget every thread and place (in a forked child, where those threads do not exist)."""
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._idle = threading.Condition(lock)
        self._tasks = deque()
        self._running = self._waiting = self._threads = 0
        self._generation += 1

    @property
    def max_threads(self) -> int:
        return self._max

    @property
    def running(self) -> int:
        """Places held: tasks started and not yet finished (abandoned ones included)."""
        return self._running

    @property
    def threads(self) -> int:
        """Threads alive (never more than ``max_threads``)."""
        return self._threads

    def try_start(self, task: Task) -> bool:
        """Run ``task(release)`` on one of the threads, or return False at once when all places are held.

        Raises ``RuntimeError`` (with nothing held) when the system refuses a new thread.
        """
        with self._cond:
            if self._running >= self._max:
                return False
            place = _Place(self)
            self._running += 1
            self._tasks.append((task, place))
            if len(self._tasks) <= self._waiting:
                self._cond.notify()
                return True
            thread = threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True)
            self._waiting += 1
            self._threads += 1
            try:
                thread.start()
            except BaseException:
                self._waiting -= 1
                self._threads -= 1
                self._running -= 1
                self._tasks.pop()
                raise
            self._started += 1
            return True

    def _work(self) -> None:
        generation = self._generation
        while True:
            if self._generation != generation:
                return  # a forked child that went on in this thread: the reset set does not count it
            cond = self._cond
            with cond:
                idle_until = time.monotonic() + self._idle_s
                while not self._tasks:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        self._waiting -= 1
                        self._threads -= 1
                        return
                    cond.wait(left)
                task, place = self._tasks.popleft()
                self._waiting -= 1
            try:
                task(place.release)
            except BaseException as exc:  # noqa: BLE001 - reported, and the thread lives on
                # Tasks catch their own errors; one that escapes is a bug.
                # The thread survives it: a task may already be queued for it.
                threading.excepthook(
                    threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, threading.current_thread()))
                )
                del exc
            finally:
                place.release()
            # Not kept while idle: the task holds its call (arguments, value)
            # and the Dependency itself, which could otherwise never be collected.
            del task, place

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no place is held (for tests and shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout)

    def __repr__(self) -> str:
        return f"<BoundedThreads {self._name!r} running={self._running}/{self._max} threads={self._threads}>"
