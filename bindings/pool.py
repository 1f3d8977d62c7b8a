"""``AdmissionPool``: a ``concurrent.futures.Executor`` with admission control and deadlines.

It is ``ThreadPoolExecutor`` with the two things a saturated service needs:

* a **bounded** line: ``submit`` raises ``QueueFull`` at once when
  ``max_workers`` items are running (or assigned to a worker) and
  ``max_queue`` are waiting. The decision is taken by the admission queue at
  ``put`` time, so it never depends on how fast worker threads wake up;
* **deadlines**: an item whose deadline passes before it starts never runs;
  its future fails with ``DeadlineExceeded`` — on arrival, when it reaches the
  head of the line, or at its own deadline while it waits (a reaper thread
  sleeps until the earliest queued deadline and sweeps the line then).

``fn`` runs in a copy of the submitter's ``contextvars`` context in which the
item's deadline is current, so ``current_deadline()``, ``Deadline.check()`` and
the outgoing clients of ``prazo.bindings.clients`` see it.

The work-queue face of ``prazo.core.AdmissionQueue`` does the bookkeeping:
``put`` admits, ``get`` hands a worker the next live item, ``task_done``
releases the slot (with the task's start time, a service-time sample for the
learned policies) and ``on_dropped`` reports items that left the line without
a slot (expired, insufficient budget, shed), each with the error to fail its
future with.
"""

from __future__ import annotations

import contextvars
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from types import ModuleType
from typing import Any, TypeVar

from prazo.core import (
    IMPLEMENTATION,
    AdmissionQueue,
    Deadline,
    DeadlineExceeded,
    LatencyHistogram,
    ShutDown,
    current_deadline,
    deadline_context,
)
from prazo.core.arguments import INT32_LIMIT, checked_count
from prazo.core.compiled import import_compiled
from prazo.core.shadow import OBSERVE_SETTLE_NS, OBSERVED_STOCK_QUEUE, ShadowLine

from .plumbing.reaper import DeadlineReaper
from .policies import queue_options

__all__ = ["AdmissionPool", "compiled_path", "use_compiled_path"]

T = TypeVar("T")

# Like ThreadPoolExecutor: at interpreter exit every live pool is shut down and
# its workers are joined, so queued work still runs (or expires) before exit.
_workers_queues: weakref.WeakKeyDictionary[threading.Thread, AdmissionQueue] = weakref.WeakKeyDictionary()
_interpreter_shutting_down = False
# Observe-only: what the shadow reads as "no deadline" for a task submitted without one.
_NO_DEADLINE_NS = 2**62
_global_shutdown_lock = threading.Lock()


def _python_exit() -> None:
    global _interpreter_shutting_down
    with _global_shutdown_lock:
        _interpreter_shutting_down = True
        if _COMPILED_MODULE is not None:
            _COMPILED_MODULE.set_interpreter_shutting_down()
    items = list(_workers_queues.items())
    for _, q in items:
        q.shutdown()
    for thread, _ in items:
        thread.join()


# threading._register_atexit runs before non-daemon threads are joined, which
# is what lets blocked workers be woken; it is what ThreadPoolExecutor uses.
getattr(threading, "_register_atexit")(_python_exit)  # noqa: B009 - private, absent from typeshed


def _import_compiled() -> ModuleType | None:
    """``prazo.bindings._pool_c``, or None: not built, the Python twin in use, or an unknown ``Future`` layout.

    Both paths do the same steps (``_submit`` and ``_worker`` below are the
    specification); the compiled one runs them without Python frames.
    """
    if IMPLEMENTATION != "c":
        return None
    compiled = import_compiled(
        "prazo.bindings._pool_c", "the compiled AdmissionPool path", "the pool runs on its Python path"
    )
    if compiled is None or not compiled.layout_supported():  # pragma: no cover - depends on the interpreter
        return None
    return compiled


_COMPILED_MODULE = _import_compiled()
# What pools created from now on use; use_compiled_path() switches it.
_COMPILED = _COMPILED_MODULE


def compiled_path() -> bool:
    """True when new pools submit and run their tasks on the compiled path (``prazo.bindings._pool_c``)."""
    return _COMPILED is not None


def use_compiled_path(enabled: bool) -> bool:
    """Choose the path of pools created from now on (tests and ``prazo bench pool`` run both); returns the old choice.

    Raises ``RuntimeError`` when ``enabled`` and the compiled path is not available.
    """
    global _COMPILED
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, not {type(enabled).__name__}")
    if enabled and _COMPILED_MODULE is None:
        raise RuntimeError("the compiled AdmissionPool path (prazo.bindings._pool_c) is not available")
    previous = _COMPILED is not None
    _COMPILED = _COMPILED_MODULE if enabled else None
    return previous


class _WorkerState:
    """What the worker threads share with the pool (never the pool itself, so it can be collected)."""

    __slots__ = ("cancelling", "fn_raised", "futures_cancelled", "lock", "queue_wait", "request_duration", "shadow")

    def __init__(self, record_latency: bool, shadow: ShadowLine | None = None) -> None:
        self.lock = threading.Lock()
        # Observe-only: the line that decides is this shadow, told each task's arrival, start and end.
        self.shadow = shadow
        # The pool's opt-in histograms; None (the default) records nothing.
        self.request_duration = LatencyHistogram() if record_latency else None
        self.queue_wait = LatencyHistogram() if record_latency else None
        # Set by shutdown(cancel_futures=True): items already assigned a slot
        # but not yet taken by a worker are cancelled instead of run.
        self.cancelling = False
        self.futures_cancelled = 0
        self.fn_raised = 0

    def count_cancelled(self) -> None:
        with self.lock:
            self.futures_cancelled += 1


class _WorkItem:
    # submitted_ns is set only when the pool records latency.
    __slots__ = ("args", "claimed", "context", "fn", "future", "kwargs", "submitted_ns")
    submitted_ns: int

    def __init__(
        self,
        future: Future[Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: contextvars.Context,
    ) -> None:
        self.future = future
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.context = context
        # True once the item left the line (taken, expired or cancelled); the
        # reaper skips claimed items and drops them from its heap.
        self.claimed = False

    def claim(self) -> None:
        """The item left the line: mark it, and break the cycle future -> ``_prazo_line`` -> item -> future.

        Without this every future that ever waited in line stays in that cycle
        (holding the item, its arguments and the queue) until the cyclic
        collector's next full pass.
        """
        self.claimed = True
        self.future._prazo_line = None  # type: ignore[attr-defined]

    def fail_unstarted(self, exc: BaseException, state: _WorkerState) -> None:
        """Answer an item that will never run (expired or cancelled by shutdown)."""
        self.claim()
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(exc)
        else:
            state.count_cancelled()

    def cancel_unstarted(self, state: _WorkerState) -> None:
        """Cancel an item taken out of the line by ``shutdown(cancel_futures=True)``."""
        self.claim()
        self.future.cancel()
        # Moves the future to CANCELLED_AND_NOTIFIED so wait()/as_completed() see it.
        self.future.set_running_or_notify_cancel()
        state.count_cancelled()


class _PoolFuture(Future):  # type: ignore[type-arg]
    """A ``Future`` whose ``cancel()`` also frees its place in the waiting line at once.

    Without this a cancelled item would keep its place until it reached the
    head, taking room from live submissions while the pool is saturated.
    """

    _prazo_line: tuple[AdmissionQueue, _WorkItem, _WorkerState] | None = None

    def cancel(self) -> bool:
        cancelled = super().cancel()
        line, self._prazo_line = self._prazo_line, None
        if cancelled and line is not None:
            q, item, state = line
            if q.cancel(item):
                item.claim()
                # No worker will see it now: notify wait()/as_completed() here.
                self.set_running_or_notify_cancel()
                state.count_cancelled()
        return cancelled


def _worker(q: AdmissionQueue, state: _WorkerState, reaper: DeadlineReaper) -> None:
    while True:
        try:
            item = q.get()
        except ShutDown:
            # The line is empty for good: let a stopping reaper see that now
            # rather than at the next deadline it was sleeping towards.
            reaper.wake()
            return
        started_ns = time.monotonic_ns()
        item.claim()
        future = item.future
        shadow = state.shadow
        if shadow is not None:
            shadow.started(item, started_ns)
        if state.cancelling:
            future.cancel()
        if not future.set_running_or_notify_cancel():
            # No sample: a cancelled task did no work, and would teach the
            # learned policies a service time of zero.
            q.task_done()
            if shadow is not None:
                shadow.finished(item, started_ns)
            state.count_cancelled()
            del item, future
            continue
        ok = False
        result: Any = None
        request_duration = state.request_duration
        if request_duration is not None and state.queue_wait is not None:
            state.queue_wait.record(time.monotonic_ns() - item.submitted_ns)
        try:
            result = item.context.run(item.fn, *item.args, **item.kwargs)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - like ThreadPoolExecutor, everything goes to the future
            result = exc
        finally:
            # The slot goes back before the future is settled, so a caller who
            # waits for result() and submits again never meets its own slot.
            q.task_done(started_ns=started_ns)
            if shadow is not None:
                shadow.finished(item, time.monotonic_ns())
            if request_duration is not None:
                request_duration.record(time.monotonic_ns() - item.submitted_ns)
        if ok:
            future.set_result(result)
        else:
            with state.lock:
                state.fn_raised += 1
            future.set_exception(result)
        # Break the reference cycle through the exception's traceback and do
        # not keep the item alive while blocked in get().
        del item, future, result


class AdmissionPool(Executor):
    """A thread pool that refuses work it cannot start in time.

    Effects, compared with ``ThreadPoolExecutor``:

    * ``submit`` raises ``prazo.core.QueueFull`` when ``max_workers`` items
      hold a slot and ``max_queue`` wait (rejection never depends on thread
      wake-up);
    * an item whose deadline passes before it starts is never called; its
      future fails with ``DeadlineExceeded`` (``reason`` is
      ``expired-on-arrival`` or ``expired-in-queue``), at the latest about one
      millisecond after the deadline even while it is still in line;
    * the queue policies of ``AdmissionQueue`` (``order``, ``codel_target_ms``,
      ``codel_interval_ms``, ``expected_service_ms``, ``limit``,
      ``min_concurrency``, ``reserved``; None keeps the queue's default) are
      passed through; an item the queue drops fails its future with the
      queue's error: ``DeadlineExceeded("insufficient-budget")`` when its
      budget is below ``expected_service_ms``, ``QueueFull("shed-standing-queue")``
      when ``order="adaptive"`` sheds it. Each task's run time (from the
      moment a worker takes it to the end of ``fn``) is a service-time sample;
    * ``fn`` runs in a copy of the submitter's context with the item's
      deadline current (``current_deadline()``);
    * ``stats()`` reports the queue's counters and the pool's own;
    * ``record_latency=True`` records every task that runs into two
      ``prazo.core.LatencyHistogram``: ``request_duration`` (``submit`` to the
      release of its slot) and ``queue_wait`` (``submit`` to its start),
      exported by ``prazo.bindings.integrations.prometheus``; off, both are None.

    ::

        pool = AdmissionPool(max_workers=8, max_queue=100)
        with deadline_scope(Deadline.after(0.5)):
            future = pool.submit(fetch, key)        # inherits the 500 ms deadline
        try:
            value = future.result()
        except DeadlineExceeded:                    # never started in time
            ...
        except QueueFull:                           # raised by submit itself
            ...

    A future cancelled while pending never runs; if it is still in line it
    leaves the line at once (counted ``cancelled``), freeing its place.
    """

    def __init__(
        self,
        max_workers: int,
        max_queue: int,
        *,
        order: str = "fifo",
        thread_name_prefix: str = "prazo-pool",
        record_latency: bool = False,
        codel_target_ms: float | None = None,
        codel_interval_ms: float | None = None,
        expected_service_ms: float | str | None = None,
        limit: str | None = None,
        min_concurrency: int | None = None,
        reserved: int | None = None,
        observe_only: bool = False,
    ) -> None:
        if not isinstance(observe_only, bool):
            raise TypeError(f"observe_only must be True or False, not {type(observe_only).__name__}")
        self._max_workers = checked_count(
            max_workers, "max_workers", 1, below=INT32_LIMIT, too_small="max_workers must be greater than 0"
        )
        if not isinstance(record_latency, bool):
            raise TypeError(f"record_latency must be True or False, not {type(record_latency).__name__}")
        checked_count(max_queue, "max_queue", 0, below=INT32_LIMIT)
        if not isinstance(thread_name_prefix, str):
            raise TypeError(f"thread_name_prefix must be a str, not {type(thread_name_prefix).__name__}")
        options = queue_options(
            codel_target_ms=codel_target_ms,
            codel_interval_ms=codel_interval_ms,
            expected_service_ms=expected_service_ms,
            limit=limit,
            min_concurrency=min_concurrency,
            reserved=reserved,
        )
        # Observe-only: every task runs, in submission order, as a ThreadPoolExecutor runs it; the
        # line these limits make is a shadow told each arrival, start and end.
        shadow = (
            ShadowLine(AdmissionQueue, max_workers, max_queue, order=order, settle_ns=OBSERVE_SETTLE_NS, **options)
            if observe_only
            else None
        )
        self._state = _WorkerState(record_latency, shadow)
        state = self._state

        def fail_dropped(item: _WorkItem, error: BaseException) -> None:
            item.fail_unstarted(error, state)

        self._queue = (
            AdmissionQueue(max_workers, OBSERVED_STOCK_QUEUE, on_dropped=fail_dropped)
            if observe_only
            else AdmissionQueue(max_workers, max_queue, on_dropped=fail_dropped, order=order, **options)
        )
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shutdown = False
        self._thread_name_prefix = thread_name_prefix
        self._reaper = DeadlineReaper(self._queue, threading.Condition(self._lock), f"{thread_name_prefix}_reaper")
        self._worker_target: Callable[..., None] = _worker
        self._submitter: Any = None
        if _COMPILED is not None and shadow is None:
            self._submitter = _COMPILED.Submitter(
                self._queue,
                self._lock,
                state,
                self._reaper,
                _PoolFuture,
                _WorkItem,
                # Not the bound method: the submitter must not keep the pool alive.
                functools.partial(
                    _start_worker,
                    self._threads,
                    thread_name_prefix,
                    _COMPILED.run_worker,
                    self._queue,
                    state,
                    self._reaper,
                ),
                self._threads,
                max_workers,
            )
            # Instance attributes: the bound methods of the compiled
            # submitter, so a submission enters no Python frame at all.
            self.submit = self._submitter.submit_current  # type: ignore[method-assign]
            self.submit_until = self._submitter.submit_until  # type: ignore[method-assign]
            self._worker_target = _COMPILED.run_worker
        # A pool dropped without shutdown() must not strand its threads
        # blocked in get(); the finalizer holds no reference to the pool.
        weakref.finalize(self, _release_collected_pool, self._queue, self._reaper)

    @property
    def max_workers(self) -> int:
        return self._max_workers

    @property
    def max_queue(self) -> int:
        return self._queue.max_queue

    @property
    def request_duration(self) -> LatencyHistogram | None:
        """Tasks that ran, from ``submit`` to the release of their slot, in ns (None unless ``record_latency``)."""
        return self._state.request_duration

    @property
    def retry_after_ns(self) -> int:
        """The wait to suggest to a caller the pool refuses now, in ns (its line's measured drain; 0: not yet)."""
        return self._queue.retry_after_ns

    @property
    def queue_wait(self) -> LatencyHistogram | None:
        """How long tasks that ran waited for a worker, in ns (None unless ``record_latency``)."""
        return self._state.queue_wait

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` under the caller's current deadline.

        Raises ``QueueFull`` when the pool is full and ``RuntimeError`` after
        ``shutdown()``. A deadline that has already passed gives a future
        failed with ``DeadlineExceeded("expired-on-arrival")``.
        """
        return self._submit(current_deadline(), contextvars.copy_context(), fn, args, kwargs)

    def submit_until(self, deadline: Deadline | None, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Like ``submit``, with exactly ``deadline`` (a ``Deadline`` or None for none).

        The given deadline replaces the caller's, also inside ``fn``: this is
        how a request hands off background work that may outlive it (or must
        finish sooner). Use ``submit`` to inherit the caller's deadline.
        """
        if deadline is not None and not isinstance(deadline, Deadline):
            raise TypeError(f"deadline must be a prazo.core.Deadline or None, not {type(deadline).__name__}")
        return self._submit(deadline, deadline_context(deadline, replace=True), fn, args, kwargs)

    def _submit(
        self,
        deadline: Deadline | None,
        context: contextvars.Context,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Future[T]:
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        future = _PoolFuture()
        item = _WorkItem(future, fn, args, kwargs, context)
        if self._state.request_duration is not None:
            item.submitted_ns = time.monotonic_ns()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _interpreter_shutting_down:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            shadow = self._state.shadow
            if shadow is not None:
                # Observe-only: the shadow decides; the task waits its turn with no deadline, as in a
                # ThreadPoolExecutor (it still runs inside its deadline's scope).
                shadow.arrive(item, time.monotonic_ns(), _NO_DEADLINE_NS if deadline is None else deadline.ns,
                              runs_now=False)  # fmt: skip
                deadline = None
            try:
                self._queue.put(item, deadline)
            except DeadlineExceeded as exc:
                item.claimed = True
                # Without its traceback: it holds this frame, whose ``future``
                # holds the exception, a cycle only a full collection frees.
                future.set_exception(exc.with_traceback(None))
                return future
            # Only items that actually wait in line need the reaper or a way
            # out of the line; an empty line right after put means this one
            # already holds a slot.
            if self._queue.qsize():
                future._prazo_line = (self._queue, item, self._state)
                if item.claimed:
                    # A worker took it meanwhile (its claim() may have cleared the line before we set it).
                    future._prazo_line = None
                if deadline is not None:
                    self._reaper.watch_locked(deadline.ns, item)
            if len(self._threads) < self._max_workers:
                self._start_worker_locked()
        return future

    def _start_worker_locked(self) -> None:
        _start_worker(
            self._threads, self._thread_name_prefix, self._worker_target, self._queue, self._state, self._reaper
        )

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
    ) -> Iterator[T]:
        """``Executor.map``; if a submission is refused, the ones already made are cancelled.

        ``QueueFull`` (or ``RuntimeError`` after shutdown) is raised from
        ``map`` itself, before any result is produced, so a half-submitted
        batch never runs unobserved.
        """
        end_time = None if timeout is None else timeout + time.monotonic()
        futures: list[Future[T]] = []
        # One deadline and one snapshot of the caller's context for the whole
        # batch (what submit would read for each item, read once); each item
        # runs in its own copy, as after submit.
        deadline, context = current_deadline(), contextvars.copy_context()
        submit = self._submit if self._submitter is None else self._submitter.submit
        no_kwargs: dict[str, Any] = {}
        try:
            for args in zip(*iterables):
                futures.append(submit(deadline, context.copy(), fn, args, no_kwargs))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        if self._submitter is not None:
            return _COMPILED_MODULE.results_in_order(futures, end_time)  # type: ignore[union-attr, no-any-return]
        return _results_in_order(futures, end_time)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; optionally cancel what has not started; optionally wait.

        Items already running finish. Waiting items still run (or expire at
        their deadline) unless ``cancel_futures`` is true. Safe to call twice.
        """
        with self._lock:
            self._shutdown = True
            if self._submitter is not None:
                self._submitter.shut_down = True
            if cancel_futures:
                self._state.cancelling = True
            cancelled = self._queue.shutdown(cancel_waiting=cancel_futures)
            self._reaper.stop_locked()
            threads = list(self._threads)
        for item in cancelled:
            item.cancel_unstarted(self._state)
        if wait:
            for thread in threads:
                thread.join()
            self._reaper.join()

    def stats(self) -> dict[str, int]:
        """The admission queue's counters plus ``workers``, ``futures_cancelled`` and ``fn_raised``.

        The queue counts a cancelled future that reached a worker as started
        and completed; ``futures_cancelled`` counts it as what it was.
        """
        shadow = self._state.shadow
        if shadow is not None:
            shadow.catch_up(time.monotonic_ns())
            snapshot = {**shadow.queue.stats(), "observe_only": 1}
        else:
            snapshot = self._queue.stats()
        snapshot["workers"] = len(self._threads)
        snapshot["futures_cancelled"] = self._state.futures_cancelled
        snapshot["fn_raised"] = self._state.fn_raised
        return snapshot

    def __repr__(self) -> str:
        return (
            f"<{type(self).__module__}.{type(self).__name__} max_workers={self._max_workers} "
            f"max_queue={self._queue.max_queue} workers={len(self._threads)} shutdown={self._shutdown}>"
        )


def _start_worker(
    threads: list[threading.Thread],
    name_prefix: str,
    target: Callable[..., None],
    q: AdmissionQueue,
    state: _WorkerState,
    reaper: DeadlineReaper,
) -> None:
    """Start one more worker of a pool, called with its lock held (no reference to the pool itself)."""
    # One thread per submission until max_workers exist: the queue may
    # assign a slot to every submission at once, and each assigned item
    # must find a thread, so fewer threads could leave one waiting.
    thread = threading.Thread(name=f"{name_prefix}_{len(threads)}", target=target, args=(q, state, reaper))
    thread.start()
    threads.append(thread)
    _workers_queues[thread] = q


def _release_collected_pool(q: AdmissionQueue, reaper: DeadlineReaper) -> None:
    q.shutdown()
    reaper.stop()


def _results_in_order(futures: list[Future[T]], end_time: float | None) -> Iterator[T]:
    """Yield results in submission order; cancel the rest when stopped early (as the stdlib does)."""
    futures.reverse()
    try:
        while futures:
            # Pop so the iterator does not keep a finished future alive.
            future = futures.pop()
            try:
                if end_time is None:
                    yield future.result()
                else:
                    yield future.result(end_time - time.monotonic())
            finally:
                future.cancel()
                del future
    finally:
        for future in futures:
            future.cancel()
