# cython: freethreading_compatible = False
"""The compiled twin of ``AdmissionPool``'s per-task path.

``prazo.bindings.pool`` is the specification (``_submit`` and ``_worker``).
This module runs the same steps in C, because on a no-op task almost all of
``AdmissionPool``'s cost was Python frames around the task, not the task or
the admission queue (see NOTES-poolperf.md for the per-task budget):

* ``Submitter.submit`` builds the future and the item, admits the item and
  starts a worker if one is missing, without a Python frame of its own;
* ``run_worker`` is the worker loop: take, claim, mark running, run, release
  the slot, settle the future — no Python frame between tasks;
* futures are plain ``concurrent.futures.Future`` (the pool's subclass): the
  fields ``Future.__init__`` and ``threading.Condition.__init__`` would set
  are set here directly, and ``set_running_or_notify_cancel``/``set_result``
  are done under the future's own condition exactly as the stdlib does, with
  the stdlib's methods called for every case but the common one (a pending
  future becoming running, a running one finishing). ``_stdlib_layout_matches``
  checks at import that the stdlib's objects have the layout this relies on;
  if not, the pool's Python path is used instead.
"""

from cpython.contextvars cimport PyContext_CopyCurrent, PyContext_Enter, PyContext_Exit, PyContextVar_Set
from cpython.object cimport PyObject

import threading
from collections import deque
from concurrent.futures import Future
from time import monotonic, monotonic_ns

from prazo.core import Deadline, DeadlineExceeded, ShutDown, current_deadline, deadline_var

__all__ = ["Submitter", "layout_supported", "results_in_order", "run_worker", "set_interpreter_shutting_down"]

# The C lock type itself: threading.RLock is a Python function returning one.
cdef object _RLock = type(threading.RLock())
cdef object _Condition = threading.Condition
cdef object _deque = deque
cdef object _monotonic_ns = monotonic_ns
cdef object _monotonic = monotonic
cdef object _current_deadline = current_deadline
cdef object _DEADLINE_VAR = deadline_var()
cdef object _ShutDown = ShutDown
cdef object _DeadlineExceeded = DeadlineExceeded
cdef type _DeadlineType = Deadline

cdef extern from "prazo_slots.h":
    Py_ssize_t prazo_slot_offset(object descr)
    PyObject *prazo_slot_value(object obj, Py_ssize_t offset)

# Where Deadline keeps its `_ns` slot (read as the C twin of the queue reads
# it): the ``ns`` property is a Python frame per queued task.
cdef Py_ssize_t _DEADLINE_NS_OFFSET = prazo_slot_offset(Deadline.__dict__["_ns"])


cdef object _context_with(object deadline):
    """``deadline_context(deadline, replace=True)``: a copy of the caller's context with exactly ``deadline``."""
    cdef object context = PyContext_CopyCurrent()
    PyContext_Enter(context)
    try:
        PyContextVar_Set(_DEADLINE_VAR, deadline)
    finally:
        PyContext_Exit(context)
    return context


cdef tuple _future_states():
    """The very objects ``Future`` uses for pending, running and finished (compared by identity)."""
    future = Future()
    pending = future._state
    future.set_running_or_notify_cancel()
    running = future._state
    future.set_result(None)
    return pending, running, future._state


# The states of concurrent.futures.Future (module constants of its _base).
cdef object _PENDING, _RUNNING, _FINISHED
_PENDING, _RUNNING, _FINISHED = _future_states()

cdef bint _interpreter_shutting_down = False

_FUTURE_FIELDS = {"_condition", "_state", "_result", "_exception", "_waiters", "_done_callbacks"}
_CONDITION_FIELDS = {"_lock", "acquire", "release", "_release_save", "_acquire_restore", "_is_owned", "_waiters"}


def _stdlib_layout_matches():
    """True when ``Future()`` and ``Condition()`` hold exactly the fields this module sets."""
    future = Future()
    condition = future._condition
    return (
        type(condition) is _Condition
        and set(vars(future)) == _FUTURE_FIELDS
        and future._state == _PENDING
        and set(vars(condition)) == _CONDITION_FIELDS
        and type(condition._lock) is type(_RLock())
        and type(condition._waiters) is _deque
    )


cdef bint _layout_ok = _stdlib_layout_matches()


def layout_supported():
    """Whether this interpreter's ``concurrent.futures.Future`` is the one this module was written for."""
    return _layout_ok


def set_interpreter_shutting_down():
    """From ``prazo.bindings.pool``'s exit hook: no submission is accepted from now on."""
    global _interpreter_shutting_down
    _interpreter_shutting_down = True


cdef object _new_future(type cls):
    """``cls()`` for a ``Future`` subclass without ``__init__``: what ``Future.__init__`` sets, set directly."""
    # Attribute stores, not stores into ``__dict__``: since 3.11 an instance
    # keeps its attributes inline until ``__dict__`` is asked for, which
    # would allocate a dict per object.
    cdef object lock = _RLock()
    cdef object condition = _Condition.__new__(_Condition)
    condition._lock = lock
    condition.acquire = lock.acquire
    condition.release = lock.release
    condition._release_save = lock._release_save
    condition._acquire_restore = lock._acquire_restore
    condition._is_owned = lock._is_owned
    condition._waiters = _deque()
    cdef object future = cls.__new__(cls)
    future._condition = condition
    future._state = _PENDING
    future._result = None
    future._exception = None
    future._waiters = []
    future._done_callbacks = []
    return future


cdef inline bint _set_running(object future) except -1:
    """``future.set_running_or_notify_cancel()``; the common case (pending) without a Python frame."""
    condition = future._condition
    condition.acquire()
    if future._state is _PENDING:
        future._state = _RUNNING
        condition.release()
        return True
    condition.release()
    # Cancelled (or a state the stdlib reports): only the worker moves a
    # cancelled future on, so the state is still the one seen above.
    return future.set_running_or_notify_cancel()


cdef inline int _set_result(object future, object result) except -1:
    """``future.set_result(result)``; the common case (running) without a Python frame."""
    condition = future._condition
    condition.acquire()
    if future._state is not _RUNNING:
        condition.release()
        future.set_result(result)
        return 0
    try:
        future._result = result
        future._state = _FINISHED
        for waiter in future._waiters:
            waiter.add_result(future)
        if condition._waiters:
            condition.notify_all()
    finally:
        condition.release()
    if future._done_callbacks:
        future._invoke_callbacks()
    return 0


cdef class Submitter:
    """One pool's submission path: ``submit(deadline, context, fn, args, kwargs)`` → future.

    The pool keeps its Python ``_submit`` as the specification; this does the
    same steps in the same order. ``start_worker_locked()`` starts one more
    worker (appending it to ``threads``), called with the pool's lock held.
    """

    cdef object _queue
    cdef object _lock
    cdef object _state
    cdef object _reaper
    cdef type _future_type
    cdef type _item_type
    cdef object _start_worker_locked
    cdef list _threads
    cdef Py_ssize_t _max_workers
    cdef public bint shut_down

    def __init__(self, queue, lock, state, reaper, type future_type, type item_type, start_worker_locked,
                 list threads, Py_ssize_t max_workers):
        self._queue = queue
        self._lock = lock
        self._state = state
        self._reaper = reaper
        self._future_type = future_type
        self._item_type = item_type
        self._start_worker_locked = start_worker_locked
        self._threads = threads
        self._max_workers = max_workers
        self.shut_down = False

    def submit_until(self, deadline, fn, /, *args, **kwargs):
        if deadline is not None and type(deadline) is not _DeadlineType and not isinstance(deadline, _DeadlineType):
            raise TypeError(f"deadline must be a prazo.core.Deadline or None, not {type(deadline).__name__}")
        return self.submit(deadline, _context_with(deadline), fn, args, kwargs)

    def submit_current(self, fn, /, *args, **kwargs):
        return self.submit(_current_deadline(), PyContext_CopyCurrent(), fn, args, kwargs)

    cpdef object submit(self, deadline, context, fn, tuple args, dict kwargs):
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        future = _new_future(self._future_type) if _layout_ok else self._future_type()
        item = self._item_type.__new__(self._item_type)
        # The fields of the pool's _WorkItem.__init__, set without its frame.
        item.future = future
        item.fn = fn
        item.args = args
        item.kwargs = kwargs
        item.context = context
        item.claimed = False
        if self._state.request_duration is not None:
            item.submitted_ns = _monotonic_ns()
        queue = self._queue
        lock = self._lock
        lock.acquire()
        try:
            if self.shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _interpreter_shutting_down:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            try:
                queue.put(item, deadline)
            except _DeadlineExceeded as exc:
                item.claimed = True
                # Without its traceback: it holds this frame's future (see pool._submit).
                future.set_exception(exc.with_traceback(None))
                return future
            if queue.qsize():
                future._prazo_line = (queue, item, self._state)
                if item.claimed:
                    future._prazo_line = None
                if deadline is not None:
                    deadline_ns = <object>prazo_slot_value(deadline, _DEADLINE_NS_OFFSET)
                    reaper = self._reaper
                    # A follower of the reaper's last, already shared entry:
                    # watch_locked would do nothing (see DeadlineReaper).
                    if not (reaper.last_shared and reaper.last_ns == deadline_ns
                            and queue.expected_service_ns <= 0):
                        reaper.watch_locked(deadline_ns, item)
            if len(self._threads) < self._max_workers:
                self._start_worker_locked()
        finally:
            lock.release()
        return future


def run_worker(queue, state, reaper):
    """``prazo.bindings.pool._worker`` in C: the same steps, in the same order, for every task."""
    get = queue.get
    task_done = queue.task_done
    while True:
        try:
            item = get()
        except _ShutDown:
            reaper.wake()
            return
        started_ns = _monotonic_ns()
        item.claimed = True
        future = item.future
        future._prazo_line = None
        if state.cancelling:
            future.cancel()
        if not _set_running(future):
            task_done()
            state.count_cancelled()
            del item, future
            continue
        ok = False
        request_duration = state.request_duration
        if request_duration is not None and state.queue_wait is not None:
            state.queue_wait.record(_monotonic_ns() - item.submitted_ns)
        try:
            result = item.context.run(item.fn, *item.args, **item.kwargs)
            ok = True
        except BaseException as exc:
            result = exc
        finally:
            task_done(started_ns=started_ns)
            if request_duration is not None:
                request_duration.record(_monotonic_ns() - item.submitted_ns)
        if ok:
            _set_result(future, result)
        else:
            with state.lock:
                state.fn_raised += 1
            future.set_exception(result)
        del item, future, result


def results_in_order(list futures, end_time):
    """``prazo.bindings.pool._results_in_order`` in C: a finished future's result is read without a frame."""
    futures.reverse()
    try:
        while futures:
            future = futures.pop()
            # FINISHED is final and its result was stored before the state.
            if future._state is _FINISHED and future._exception is None:
                result = future._result
                del future
                yield result
                continue
            try:
                if end_time is None:
                    yield future.result()
                else:
                    yield future.result(end_time - _monotonic())
            finally:
                future.cancel()
                del future
    finally:
        for future in futures:
            future.cancel()
