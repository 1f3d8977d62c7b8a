# cython: freethreading_compatible = True
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
  fields ``Future.__init__`` would set are set here directly, with a
  ``FutureCondition`` (a reentrant lock and condition in one C object, see
  below) as ``_condition`` instead of ``threading.Condition()``, and ``set_running_or_notify_cancel``/``set_result``
  are done under the future's own condition exactly as the stdlib does, with
  the stdlib's methods called for every case but the common one (a pending
  future becoming running, a running one finishing). ``_stdlib_layout_matches``
  checks at import that the stdlib's objects have the layout this relies on;
  if not, the pool's Python path is used instead.
"""

cimport cython
from cpython.contextvars cimport PyContext_CopyCurrent, PyContext_Enter, PyContext_Exit, PyContextVar_Set
from cpython.object cimport PyObject
from cpython.pythread cimport (
    PY_LOCK_ACQUIRED,
    PY_LOCK_INTR,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from libc.stdint cimport int64_t

from prazo.core._queue_c cimport AdmissionQueue as CAdmissionQueue, prazo_flag, prazo_flag_is_set, prazo_flag_set, prazo_monotonic_ns

cdef extern from "Python.h":
    unsigned long PyThread_get_thread_ident() nogil
    int PyThread_acquire_lock_timed(PyThread_type_lock lock, long long microseconds, int intr_flag) nogil
    int Py_MakePendingCalls() except -1
    object PyObject_Call(object callable, object args, PyObject *kwargs)

import threading
from _thread import allocate_lock
from itertools import islice
from concurrent.futures import Future
from time import monotonic, monotonic_ns

from prazo.core import Deadline, DeadlineExceeded, ShutDown, current_deadline, deadline_var

__all__ = ["Submitter", "layout_supported", "results_in_order", "run_worker", "set_interpreter_shutting_down"]

cdef object _Condition = threading.Condition
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

# Set by the exit hook's thread, read by every submitter: atomic (no GIL orders them).
cdef prazo_flag _interpreter_shutting_down

_FUTURE_FIELDS = {"_condition", "_state", "_result", "_exception", "_waiters", "_done_callbacks"}


def _stdlib_layout_matches():
    """True when ``Future()`` holds exactly the fields this module sets, its condition a ``threading.Condition``.

    The futures built here carry a ``FutureCondition`` instead, which has the
    part of ``Condition``'s interface that ``concurrent.futures`` uses.
    """
    future = Future()
    condition = future._condition
    return (
        type(condition) is _Condition
        and set(vars(future)) == _FUTURE_FIELDS
        and future._state == _PENDING
    )


cdef bint _layout_ok = _stdlib_layout_matches()


def layout_supported():
    """Whether this interpreter's ``concurrent.futures.Future`` is the one this module was written for."""
    return _layout_ok


def set_interpreter_shutting_down():
    """From ``prazo.bindings.pool``'s exit hook: no submission is accepted from now on."""
    prazo_flag_set(&_interpreter_shutting_down)



cdef object _allocate_lock = allocate_lock
cdef object _islice = islice
# A lock timeout above this (about 30 years) waits forever.
cdef double _FOREVER_S = 1e9


cdef extern from "prazo_freethreading.h":
    ctypedef struct prazo_ft_mutex:
        pass
    void prazo_ft_lock(prazo_ft_mutex *mutex) nogil
    void prazo_ft_unlock(prazo_ft_mutex *mutex) nogil
    # 1 on a free-threaded build (Py_GIL_DISABLED), else 0.
    const int PRAZO_FREE_THREADED


@cython.final
@cython.no_gc
@cython.freelist(64)
cdef class FutureCondition:
    """``threading.Condition()`` (over an ``RLock``) as one object, for the futures of the compiled path.

    A stdlib ``Future`` carries a ``Condition``, an ``RLock`` (with its OS
    lock), a deque and five bound methods: most of the cost of creating a
    future nobody waits on individually. This is the same reentrant lock and
    condition in one object: the lock's state (owner, depth, the blocked
    count, the posted token) lives in the object, so an uncontended
    acquire/release is two field writes; an OS lock is allocated only when a
    thread has to block for the lock, and the waiters' list only when a
    thread waits on the condition. ``wait`` uses one ``_thread`` lock per
    waiter exactly like ``threading.Condition.wait`` (interruptible, same
    timeout rules). Every use of ``_condition`` in ``concurrent.futures``
    (``with``, ``acquire``/``release``, ``wait``, ``notify_all``) works on it.

    Who guards the state: every read and write of ``_owner``, ``_count``,
    ``_handoff``, ``_blocked`` and ``_posted`` happens between
    ``prazo_ft_lock``/``prazo_ft_unlock`` of ``_guard``, never across a
    call into Python or a wait. With the GIL (a default build) that lock is
    nothing and the GIL alone makes each section atomic, as no section calls
    Python; on a free-threaded build it is a PyMutex. ``_waiters`` is touched
    only by the thread that holds the condition (``wait``, ``notify``), so the
    condition itself guards it, as ``threading.Condition`` guards its deque.
    """

    cdef prazo_ft_mutex _guard       # the state below (nothing with a GIL; see prazo_freethreading.h)
    cdef unsigned long _owner
    cdef Py_ssize_t _count           # recursion depth; 0: free
    cdef PyThread_type_lock _handoff  # NULL until a thread must block; "unlocked" = a wake-up token
    cdef Py_ssize_t _blocked         # threads blocked on _handoff
    cdef bint _posted                # _handoff holds a token
    cdef list _waiters               # _thread locks of threads in wait(); None until the first

    def __dealloc__(self):
        if self._handoff != NULL:
            PyThread_free_lock(self._handoff)

    cdef inline bint _take_locked(self, unsigned long me) noexcept nogil:
        """Take the lock for ``me`` if free or already ``me``'s; ``_guard`` held."""
        if self._count == 0:
            self._owner = me
            self._count = 1
            return True
        if self._owner == me:
            self._count += 1
            return True
        return False

    cdef inline bint _try_acquire(self, unsigned long me) noexcept:
        cdef bint taken
        prazo_ft_lock(&self._guard)
        taken = self._take_locked(me)
        prazo_ft_unlock(&self._guard)
        return taken

    cdef inline bint _owned_by(self, unsigned long me) noexcept:
        cdef bint owned
        prazo_ft_lock(&self._guard)
        owned = self._count > 0 and self._owner == me
        prazo_ft_unlock(&self._guard)
        return owned

    cdef bint _acquire_blocking(self, unsigned long me, double timeout) except -1:
        """Block until the lock is free (timeout < 0: forever); True when taken."""
        if timeout > _FOREVER_S:
            # Beyond any real wait, and its nanoseconds would overflow int64.
            timeout = -1.0
        cdef int64_t end_ns = prazo_monotonic_ns() + <int64_t>(timeout * 1e9) if timeout >= 0 else 0
        cdef long long remaining_us
        cdef int status
        cdef PyThread_type_lock handoff
        cdef bint taken
        while True:
            prazo_ft_lock(&self._guard)
            if self._take_locked(me):
                prazo_ft_unlock(&self._guard)
                return True
            if self._handoff == NULL:
                handoff = PyThread_allocate_lock()
                if handoff == NULL:
                    prazo_ft_unlock(&self._guard)
                    raise MemoryError()
                # Taken at once: an unlocked handoff lock is a pending wake-up.
                PyThread_acquire_lock(handoff, 0)
                self._handoff = handoff
            handoff = self._handoff
            # Counted before the guard is let go: a release from now on posts a token for us.
            self._blocked += 1
            prazo_ft_unlock(&self._guard)
            if timeout < 0:
                remaining_us = -1
            else:
                remaining_us = (end_ns - prazo_monotonic_ns()) // 1000
                if remaining_us < 0:
                    remaining_us = 0
            with nogil:
                status = PyThread_acquire_lock_timed(handoff, remaining_us, 1)
            prazo_ft_lock(&self._guard)
            self._blocked -= 1
            if status == PY_LOCK_ACQUIRED:
                self._posted = False
            taken = self._take_locked(me)
            prazo_ft_unlock(&self._guard)
            if taken:
                return True
            if status == PY_LOCK_INTR:
                Py_MakePendingCalls()
            elif status != PY_LOCK_ACQUIRED and timeout >= 0:
                return False

    cdef inline void _release_all_locked(self) noexcept nogil:
        """Free the lock (whatever its depth); wake one blocked thread if any. ``_guard`` held."""
        self._count = 0
        self._owner = 0
        if self._blocked > 0 and not self._posted:
            self._posted = True
            PyThread_release_lock(self._handoff)

    cdef inline int _enter(self) except -1:
        cdef unsigned long me = PyThread_get_thread_ident()
        if not self._try_acquire(me):
            self._acquire_blocking(me, -1.0)
        return 0

    cdef inline int _exit(self) except -1:
        cdef unsigned long me = PyThread_get_thread_ident()
        prazo_ft_lock(&self._guard)
        if self._count == 0 or self._owner != me:
            prazo_ft_unlock(&self._guard)
            raise RuntimeError("cannot release un-acquired lock")
        self._count -= 1
        if self._count == 0:
            self._release_all_locked()
        prazo_ft_unlock(&self._guard)
        return 0

    def acquire(self, blocking=True, timeout=-1):
        """``RLock.acquire``: reentrant; False when not blocking (or the timeout passed) and another thread holds it."""
        cdef unsigned long me = PyThread_get_thread_ident()
        cdef double seconds = timeout
        if not blocking and seconds != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if seconds < 0 and seconds != -1:
            raise ValueError("timeout value must be a non-negative number")
        if self._try_acquire(me):
            return True
        if not blocking:
            return False
        return self._acquire_blocking(me, seconds)

    def release(self):
        """``RLock.release``: RuntimeError unless the calling thread holds it."""
        self._exit()

    def __enter__(self):
        self._enter()
        return True

    def __exit__(self, exc_type, exc, tb):
        self._exit()

    def _is_owned(self):
        return self._owned_by(PyThread_get_thread_ident())

    def wait(self, timeout=None):
        """``threading.Condition.wait``: release the lock fully, sleep until notified or ``timeout``, take it back."""
        cdef unsigned long me = PyThread_get_thread_ident()
        cdef Py_ssize_t depth
        if not self._owned_by(me):
            raise RuntimeError("cannot wait on un-acquired lock")
        waiter = _allocate_lock()
        waiter.acquire()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        prazo_ft_lock(&self._guard)
        depth = self._count
        self._release_all_locked()
        prazo_ft_unlock(&self._guard)
        gotit = False
        try:
            if timeout is None:
                waiter.acquire()
                gotit = True
            elif timeout > 0:
                gotit = waiter.acquire(True, timeout)
            else:
                gotit = waiter.acquire(False)
            return gotit
        finally:
            if not self._try_acquire(me):
                self._acquire_blocking(me, -1.0)
            # Ours again (depth 1): back to the depth wait() was called at.
            prazo_ft_lock(&self._guard)
            self._count = depth
            prazo_ft_unlock(&self._guard)
            if not gotit:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass

    def wait_for(self, predicate, timeout=None):
        """``threading.Condition.wait_for``."""
        endtime = None
        waittime = timeout
        result = predicate()
        while not result:
            if waittime is not None:
                if endtime is None:
                    endtime = _monotonic() + waittime
                else:
                    waittime = endtime - _monotonic()
                    if waittime <= 0:
                        break
            self.wait(waittime)
            result = predicate()
        return result

    def notify(self, n=1):
        """``threading.Condition.notify``: wake up to ``n`` threads waiting on this condition."""
        if not self._owned_by(PyThread_get_thread_ident()):
            raise RuntimeError("cannot notify on un-acquired lock")
        self._notify(n)

    cdef int _notify(self, n) except -1:
        all_waiters = self._waiters
        if not all_waiters:
            return 0
        for waiter in list(_islice(all_waiters, n)):
            waiter.release()
            try:
                all_waiters.remove(waiter)
            except ValueError:
                pass
        return 0

    def notify_all(self):
        """``threading.Condition.notify_all``."""
        self.notify(len(self._waiters) if self._waiters is not None else 0)

    notifyAll = notify_all

    def __repr__(self):
        cdef Py_ssize_t depth
        prazo_ft_lock(&self._guard)
        depth = self._count
        prazo_ft_unlock(&self._guard)
        return f"<prazo FutureCondition owned={depth > 0} depth={depth} waiters={len(self._waiters or ())}>"

cdef object _new_future(type cls):
    """``cls()`` for a ``Future`` subclass without ``__init__``: what ``Future.__init__`` sets, set directly."""
    # Attribute stores, not stores into ``__dict__``: since 3.11 an instance
    # keeps its attributes inline until ``__dict__`` is asked for, which
    # would allocate a dict per object.
    cdef object future = cls.__new__(cls)
    future._condition = FutureCondition.__new__(FutureCondition)
    future._state = _PENDING
    future._result = None
    future._exception = None
    future._waiters = []
    future._done_callbacks = []
    return future


cdef inline bint _set_running(object future) except -1:
    """``future.set_running_or_notify_cancel()``; the common case (pending) without a Python frame."""
    cdef FutureCondition condition = <FutureCondition?>future._condition
    condition._enter()
    if future._state is _PENDING:
        future._state = _RUNNING
        condition._exit()
        return True
    condition._exit()
    # Cancelled (or a state the stdlib reports): only the worker moves a
    # cancelled future on, so the state is still the one seen above.
    return future.set_running_or_notify_cancel()


cdef inline int _set_result(object future, object result) except -1:
    """``future.set_result(result)``; the common case (running) without a Python frame."""
    cdef FutureCondition condition = <FutureCondition?>future._condition
    condition._enter()
    if future._state is not _RUNNING:
        condition._exit()
        future.set_result(result)
        return 0
    try:
        future._result = result
        future._state = _FINISHED
        for waiter in future._waiters:
            waiter.add_result(future)
        if condition._waiters:
            condition._notify(len(condition._waiters))
    finally:
        condition._exit()
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
            if prazo_flag_is_set(&_interpreter_shutting_down):
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


cdef object _run_in(object context, object fn, tuple args, dict kwargs):
    """``context.run(fn, *args, **kwargs)`` without building the bound method and the argument tuple."""
    if PyContext_Enter(context) < 0:
        raise RuntimeError("the task's context is already entered")
    try:
        return PyObject_Call(fn, args, <PyObject *>kwargs if kwargs else NULL)
    finally:
        PyContext_Exit(context)


def run_worker(CAdmissionQueue queue not None, state, reaper):
    """``prazo.bindings.pool._worker`` in C: the same steps, in the same order, for every task."""
    get = queue.get
    cdef int64_t started_ns
    while True:
        try:
            item = get()
        except _ShutDown:
            reaper.wake()
            return
        started_ns = prazo_monotonic_ns()
        item.claimed = True
        future = item.future
        future._prazo_line = None
        if state.cancelling:
            future.cancel()
        if not _set_running(future):
            queue._release_class(-1, True, -1, False)
            state.count_cancelled()
            del item, future
            continue
        ok = False
        request_duration = state.request_duration
        if request_duration is not None and state.queue_wait is not None:
            state.queue_wait.record(_monotonic_ns() - item.submitted_ns)
        try:
            result = _run_in(item.context, item.fn, item.args, item.kwargs)
            ok = True
        except BaseException as exc:
            result = exc
        finally:
            # queue.task_done(started_ns=started_ns), without the keyword call.
            queue._release_class(-1, True, started_ns, False)
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
            # FINISHED is final and its result was stored before the state. Without a GIL
            # nothing orders those two stores for a reader on another core (a weakly
            # ordered CPU may show the state first): there, result() reads under the lock.
            if not PRAZO_FREE_THREADED and future._state is _FINISHED and future._exception is None:
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
