# cython: freethreading_compatible = True
"""The compiled twin of ``AdmissionMiddleware``'s common path.

``prazo.bindings.wsgi`` is the specification. This module runs the same
steps in C for the request a service sees most:

* its ``PATH_INFO`` is not a bypass path;
* no budget header, or a plain integer ``X-Request-Budget-Ms`` (digits,
  optionally padded with spaces or tabs, no ``grpc-timeout`` or Envoy header
  beside it), read by core/prazo_budget.h as the front door reads it;
* not a critical request (the middleware's ``critical=`` classifier runs
  here, once, and a critical request goes to the Python path with its class);
* the middleware's queue is the C twin (``prazo.core._queue_c``), which it
  calls directly, and the slot is granted;
* the app returns a list or a tuple.

Every other case is handed to the Python code: the whole request for bypass
paths and the other budget headers (``AdmissionMiddleware._call_python``),
and from the point where the common path ends otherwise (a refusal by the
queue, an exception from the app, a body that runs app code), so the rules
for those live in one place and both paths answer, count and release alike.

Where the Python path's time goes and how this one saves it: the deadline is
an ``int64_t`` until a ``Deadline`` is needed (built without ``__init__``),
the queue is entered through its C methods, the request's context is a copy
entered once around the app call (``deadline_context`` enters it twice), and
a list body is wrapped in a C iterator instead of a Python one.
"""

cimport cython
from cpython.contextvars cimport PyContext_CopyCurrent, PyContext_Enter, PyContext_Exit, PyContextVar_Set, get_value
from cpython.object cimport PyObject, PyTypeObject
from cpython.sequence cimport PySequence_Fast_GET_ITEM, PySequence_Fast_GET_SIZE
from libc.stdint cimport int64_t, INT64_MAX
from cpython.unicode cimport PyUnicode_1BYTE_KIND, PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_KIND

from prazo.core._histogram_c cimport LatencyHistogram
from prazo.core._queue_c cimport AdmissionQueue, prazo_flag, prazo_flag_is_set, prazo_flag_set, prazo_monotonic_ns

from threading import Lock

from prazo.bindings.headers import (
    BUDGET_ENVIRON_KEY,
    BUDGET_HEADER,
    ENVOY_TIMEOUT_ENVIRON_KEY,
    GRPC_TIMEOUT_ENVIRON_KEY,
    MAX_WIRE_MS,
)
from prazo.core import (
    NS_PER_MS,
    Deadline,
    DeadlineExceeded,
    DownstreamOverloaded,
    QueueFull,
    ShutDown,
    deadline_context,
    deadline_var,
)

__all__ = ["CompiledPath", "ListBody", "QueueRelease", "call_admitted", "serve", "set_observer", "supports"]


# core/: the budget headers' wire rules, shared with the front door's engine.
cdef extern from "prazo_budget.h" nogil:
    int prazo_parse_whole_ms(const char *p, size_t n, double *ms)
    int64_t prazo_budget_ns(double default_ms, double max_ms, int have, double incoming_ms)

cdef extern from "prazo_slots.h":
    Py_ssize_t prazo_slot_offset(object descr)
    PyObject *prazo_slot_value(object obj, Py_ssize_t offset)

cdef extern from *:
    """
    /* Store a new reference to `value` in the __slots__ member at `offset` of `obj`. */
    static inline void prazo_slot_store(PyObject *obj, Py_ssize_t offset, PyObject *value)
    {
        PyObject **slot = (PyObject **)((char *)obj + offset);
        PyObject *old = *slot;
        Py_INCREF(value);
        *slot = value;
        Py_XDECREF(old);
    }
    """
    void prazo_slot_store(object obj, Py_ssize_t offset, object value)


cdef type _DeadlineType = Deadline
# Where Deadline keeps its `_ns` slot: read and written directly, as the C
# twin of the queue reads it, because an attribute access costs more than
# the rest of building the deadline.
cdef Py_ssize_t _DEADLINE_NS_OFFSET = prazo_slot_offset(Deadline.__dict__["_ns"])
if _DEADLINE_NS_OFFSET < 0:
    raise ImportError("prazo.core.Deadline no longer keeps `_ns` in a slot; the compiled WSGI path needs it")
cdef tuple _NO_ARGS = ()


cdef object _DEADLINE_VAR = deadline_var()

# C globals for what every request reads (a module global is a dict lookup).
cdef str _BUDGET_KEY = BUDGET_ENVIRON_KEY
cdef str _GRPC_TIMEOUT_KEY = GRPC_TIMEOUT_ENVIRON_KEY
cdef str _ENVOY_TIMEOUT_KEY = ENVOY_TIMEOUT_ENVIRON_KEY
cdef str _BUDGET_HEADER = BUDGET_HEADER

# The longest X-Request-Budget-Ms value read here: the digits of MAX_WIRE_MS.
# The Python parser allows longer ones (leading zeros, padding); those go to it.
cdef Py_ssize_t _MAX_INTEGER_CHARS = len(str(MAX_WIRE_MS))

cdef double _NS_PER_MS = NS_PER_MS


# The Python side, bound when the first CompiledPath is built:
# prazo.bindings.wsgi imports this module, so it cannot be imported above.
cdef prazo_flag _bound
cdef str _BUDGET_SOURCE_KEY, _QUEUE_WAIT_MS_KEY, _DEADLINE_KEY, _OUTCOME_ADMITTED, _OUTCOME_REFUSED
cdef object _reject, _refuse, _AdmittedResponse

# The admission observer (``prazo.bindings.wsgi.set_admission_observer``
# sets it through ``set_observer``); a C global, so None costs one pointer
# comparison per request. A request reads it once into a local. Without a GIL
# a request may read the global while another thread replaces it, so a
# replaced observer is kept alive (in _replaced_observers) rather than freed
# under that reader; observers are set a few times per process, not per request.
cdef object _observer = None
cdef list _replaced_observers = []
cdef object _observer_lock = Lock()


def set_observer(observer):
    """Tell ``observer`` of every decision of this path (None: nobody); ``wsgi.set_admission_observer`` calls it."""
    global _observer
    with _observer_lock:
        _replaced_observers.append(_observer)
        _observer = observer


# Bound once, under _bind_lock; _bound is published with release/acquire ordering so a
# thread that sees it set also sees every global it guards (a free-threaded build runs
# the first two requests truly at once).
cdef object _bind_lock = Lock()


cdef int _bind_python_side() except -1:
    global _bound, _BUDGET_SOURCE_KEY, _QUEUE_WAIT_MS_KEY, _DEADLINE_KEY, _reject, _refuse, _AdmittedResponse
    global _OUTCOME_ADMITTED, _OUTCOME_REFUSED
    if prazo_flag_is_set(&_bound):
        return 0
    with _bind_lock:
        if not prazo_flag_is_set(&_bound):
            _bind_python_side_locked()
    return 0


cdef int _bind_python_side_locked() except -1:
    global _BUDGET_SOURCE_KEY, _QUEUE_WAIT_MS_KEY, _DEADLINE_KEY, _reject, _refuse, _AdmittedResponse
    global _OUTCOME_ADMITTED, _OUTCOME_REFUSED
    from prazo.bindings import wsgi

    _BUDGET_SOURCE_KEY = wsgi.BUDGET_SOURCE_KEY
    _QUEUE_WAIT_MS_KEY = wsgi.QUEUE_WAIT_MS_KEY
    _DEADLINE_KEY = wsgi.DEADLINE_KEY
    _reject = wsgi._reject
    _refuse = wsgi._refuse
    _AdmittedResponse = wsgi.AdmittedResponse
    _OUTCOME_ADMITTED = wsgi.OUTCOME_ADMITTED
    _OUTCOME_REFUSED = wsgi.OUTCOME_REFUSED
    prazo_flag_set(&_bound)
    return 0


cdef inline int64_t _deadline_ns(object deadline) except? -1:
    """``deadline._ns``, straight from the slot for a plain ``Deadline``."""
    cdef PyObject *ns
    if type(deadline) is _DeadlineType:
        ns = prazo_slot_value(deadline, _DEADLINE_NS_OFFSET)
        if ns != NULL:
            return <object>ns
    return deadline._ns


cdef inline object _new_deadline(int64_t ns):
    """``Deadline.at_ns(ns)`` for an ``ns`` known to fit in an int64.

    What ``at_ns`` does itself (``__new__``, then the slot, no ``__init__``),
    through ``Deadline``'s ``tp_new`` and the slot's offset: calling ``at_ns``
    is a Python call that costs more than the rest of this path's deadline work.
    """
    cdef object deadline = (<PyTypeObject *>_DeadlineType).tp_new(_DeadlineType, <PyObject *>_NO_ARGS, NULL)
    prazo_slot_store(deadline, _DEADLINE_NS_OFFSET, ns)
    return deadline


cdef int64_t _integer_budget_ns(object raw, double max_budget_ms) except -2:
    """The budget of a plain integer ``X-Request-Budget-Ms``, as the Python path computes it.

    core/prazo_budget.h's whole-ms rule (the front door's too), then
    ``BudgetPolicy``'s cap and its conversion to ns (the same double
    arithmetic, so the same result). Returns -1 for any other value, and for
    one longer than MAX_WIRE_MS's digits (leading zeros, padding): the Python
    path judges and counts those.
    """
    cdef double ms = 0.0
    if type(raw) is not str or PyUnicode_KIND(raw) != PyUnicode_1BYTE_KIND:
        return -1
    if PyUnicode_GET_LENGTH(raw) > _MAX_INTEGER_CHARS:
        return -1
    if not prazo_parse_whole_ms(<const char *>PyUnicode_DATA(raw), <size_t>PyUnicode_GET_LENGTH(raw), &ms):
        return -1
    return prazo_budget_ns(0.0, max_budget_ms, 1, ms)


def supports(queue):
    """True when ``queue`` is the C twin of the admission queue, the one this path drives."""
    return type(queue) is AdmissionQueue


@cython.final
cdef class ListBody:
    """A list or tuple response body that gives its slot back exactly once.

    The compiled counterpart of ``prazo.bindings.wsgi``'s list wrapper:
    iterating it yields the app's chunks; the slot is released when the
    chunks are exhausted, on ``close()``, or when the body is finalised
    without either (a server that drops it), whichever comes first. After
    that it yields nothing. No app code runs, so no context is entered.
    ``len()`` is the app's list's, which waitress needs to set
    ``Content-Length`` for a one-chunk body.
    """

    cdef object _items           # the app's list or tuple; None once finished
    cdef Py_ssize_t _index
    cdef Py_ssize_t _length
    cdef AdmissionQueue _queue   # holds the slot; None once released
    cdef object _release         # or the release callable that holds it (call_admitted); None once released
    cdef LatencyHistogram _duration  # where the request's duration goes; None while latency recording is off
    cdef int64_t _arrival_ns
    cdef int64_t _started_ns         # when the slot started: the release is a service-time sample

    def __len__(self):
        return self._length

    def __iter__(self):
        return self

    def __next__(self):
        cdef object items
        cdef object chunk = None
        cdef bint more = False
        # In the object's critical section (nothing with a GIL): _finish may clear _items from
        # another thread, which must not free the list under this read.
        with cython.critical_section(self):
            items = self._items
            if items is not None and self._index < PySequence_Fast_GET_SIZE(items):
                chunk = <object>PySequence_Fast_GET_ITEM(items, self._index)
                self._index += 1
                more = True
        if more:
            return chunk
        self._finish()
        raise StopIteration

    def close(self):
        """Release the slot if it is still held; later calls do nothing."""
        self._finish()

    def __del__(self):
        # A safety net for servers that drop the body without close(): the
        # slot must never leak. __del__ (not __dealloc__) so the fields are
        # still set when the garbage collector breaks a cycle through here;
        # and no @cython.freelist, whose recycled objects keep the "already
        # finalised" mark of their previous life and never run __del__ again.
        self._finish()

    cdef int _finish(self) except -1:
        # The claim (clearing _queue) runs no Python code, so under the GIL
        # exactly one caller gets the queue, whoever else races to finish
        # (close() from a server's thread while another ends the iteration);
        # without a GIL the object's critical section makes the claim atomic.
        cdef AdmissionQueue queue
        cdef object release
        with cython.critical_section(self):
            queue = self._queue
            release = self._release
            self._queue = None
            self._release = None
            self._items = None
        if queue is None and release is None:
            return 0
        if queue is not None:
            return _release_slot(queue, self._started_ns, self._duration, self._arrival_ns)
        release()
        return 0


@cython.final
cdef class CompiledPath:
    """The common path of one ``AdmissionMiddleware``, in C.

    Built by the middleware (``AdmissionMiddleware(..., fast_path=None)``)
    around its app, queue, budget policy, bypass paths, counters and
    ``Retry-After``; ``serve`` runs a request through it.
    """

    cdef object _app
    cdef AdmissionQueue _queue
    cdef object _bypass             # frozenset of paths, None when empty
    cdef int64_t _default_budget_ns
    cdef double _max_budget_ms
    cdef object _counters
    cdef object _retry_after_s
    cdef bint _measured_retry_after
    cdef LatencyHistogram _duration     # the C twin's histograms, None while latency recording is off
    cdef LatencyHistogram _queue_wait
    cdef object _critical               # the middleware's CriticalClassifier, None when no request is critical
    cdef object _load_report            # the middleware's LoadReport, None while the option is off

    def __init__(self, app, AdmissionQueue queue not None, policy, bypass, counters, retry_after_s, critical=None,
                 measured_retry_after=False):
        _bind_python_side()
        self._critical = critical
        self._app = app
        self._queue = queue
        self._bypass = frozenset(bypass) or None
        # Exactly what the policy grants a request without a budget header.
        self._default_budget_ns = policy.deadline_for({}, 0)[0].ns
        self._max_budget_ms = policy.max_budget_ms
        self._counters = counters
        self._retry_after_s = retry_after_s
        self._measured_retry_after = measured_retry_after
        self._duration = None
        self._queue_wait = None
        self._load_report = None

    def record_latency(self, LatencyHistogram request_duration not None, LatencyHistogram queue_wait not None):
        """Record each admitted request into these two histograms of the C twin, as the Python path does.

        Recorded with the histogram's C method (lock-free atomic increments),
        not a Python call.
        """
        self._duration = request_duration
        self._queue_wait = queue_wait

    def report_load(self, load_report not None):
        """Start every response this path answers through ``load_report.start_response``, as the Python path does."""
        self._load_report = load_report

    cdef object _serve(self, object middleware, object environ, object start_response):
        """``AdmissionMiddleware._call_python``, for the requests this path serves; the others go there."""
        cdef int64_t budget_ns, arrival_ns, deadline_ns, started_ns
        cdef object source = None
        cdef object outer
        if type(environ) is not dict:
            return middleware._call_python(environ, start_response)
        cdef dict env = <dict>environ
        if self._bypass is not None and env.get("PATH_INFO", "") in self._bypass:
            return middleware._call_python(environ, start_response)
        # Classified once, here; from now on every hand-over says "normal"
        # (False), so the Python path never runs the classifier again.
        if self._critical is not None and self._critical(env):
            return middleware._serve_python(environ, start_response, True)
        if _GRPC_TIMEOUT_KEY in env or _ENVOY_TIMEOUT_KEY in env:
            return middleware._serve_python(environ, start_response, False)
        if _BUDGET_KEY in env:
            budget_ns = _integer_budget_ns(env[_BUDGET_KEY], self._max_budget_ms)
            if budget_ns < 0:
                return middleware._serve_python(environ, start_response, False)
            source = _BUDGET_HEADER
        else:
            budget_ns = self._default_budget_ns
        arrival_ns = prazo_monotonic_ns()
        if budget_ns > INT64_MAX - arrival_ns:
            # Beyond what a Deadline holds: the Python path says so its own way.
            return middleware._serve_python(environ, start_response, False)
        deadline_ns = arrival_ns + budget_ns
        # request_deadline's rule: an earlier deadline already current wins,
        # so stacked admission never waits past the outer layer's deadline.
        outer = get_value(_DEADLINE_VAR)
        if outer is not None and _deadline_ns(outer) < deadline_ns:
            deadline_ns = _deadline_ns(outer)
        env[_BUDGET_SOURCE_KEY] = source
        # Here, after the last hand-over to the Python path (which adds the header itself): the
        # refusal and the admitted response below are both started through it.
        if self._load_report is not None:
            start_response = self._load_report.start_response(start_response)
        try:
            started_ns = self._queue._acquire(deadline_ns, arrival_ns)
        except (QueueFull, DeadlineExceeded, ShutDown) as exc:
            observer = _observer
            if observer is not None:
                observer(env, _OUTCOME_REFUSED, arrival_ns, deadline_ns, prazo_monotonic_ns() - arrival_ns, exc)
            return _reject(exc, start_response, self._counters, self._retry_after_s,
                           self._queue.retry_after_ns if self._measured_retry_after else 0)
        return self._run_admitted(env, start_response, deadline_ns, arrival_ns, started_ns)

    cdef object _run_admitted(
        self, dict environ, object start_response, int64_t deadline_ns, int64_t arrival_ns, int64_t started_ns
    ):
        """``prazo.bindings.wsgi.run_admitted`` for a request holding a slot of ``self._queue``."""
        cdef object context, deadline, outer, result
        cdef int64_t queue_wait_ns = prazo_monotonic_ns() - arrival_ns
        if self._queue_wait is not None:
            self._queue_wait.record_ns(queue_wait_ns if queue_wait_ns > 0 else 0)
        try:
            observer = _observer
            if observer is not None:
                # Inside the try: an observer that raises still gives the slot back.
                observer(environ, _OUTCOME_ADMITTED, arrival_ns, deadline_ns, queue_wait_ns, None)
            environ[_QUEUE_WAIT_MS_KEY] = queue_wait_ns / _NS_PER_MS
            # deadline_context's rule: an earlier deadline already current wins.
            outer = get_value(_DEADLINE_VAR)
            if outer is not None and _deadline_ns(outer) <= deadline_ns:
                deadline = outer
            else:
                deadline = _new_deadline(deadline_ns)
            environ[_DEADLINE_KEY] = deadline
            context = PyContext_CopyCurrent()
            PyContext_Enter(context)
            try:
                PyContextVar_Set(_DEADLINE_VAR, deadline)
                result = self._app(environ, start_response)
            finally:
                PyContext_Exit(context)
        except (DeadlineExceeded, DownstreamOverloaded) as exc:
            _release_slot(self._queue, started_ns, self._duration, arrival_ns)
            return _refuse(exc, start_response, self._counters, self._retry_after_s)
        except BaseException:
            _release_slot(self._queue, started_ns, self._duration, arrival_ns)
            raise
        if type(result) is list or type(result) is tuple:
            return _list_body(result, self._queue, self._duration, arrival_ns, started_ns)
        release = _queue_release(self._queue, started_ns, self._duration, arrival_ns)
        return _AdmittedResponse(result, context, start_response, release, self._counters, self._retry_after_s)


cdef int _release_slot(AdmissionQueue queue, int64_t started_ns, LatencyHistogram duration, int64_t arrival_ns) except -1:
    """Give a slot back with its start time as a service-time sample; record the request's duration if asked."""
    if duration is None:
        return queue._release_sampled(-1, True, started_ns)
    try:
        queue._release_sampled(-1, True, started_ns)
    finally:
        _record_since(duration, arrival_ns)
    return 0


cdef inline void _record_since(LatencyHistogram histogram, int64_t start_ns) noexcept:
    """Record the time since ``start_ns`` (``record_ns`` takes no negative value)."""
    cdef int64_t elapsed = prazo_monotonic_ns() - start_ns
    histogram.record_ns(elapsed if elapsed > 0 else 0)


@cython.final
cdef class QueueRelease:
    """The release of a slot of the C queue, with its start time as a service-time sample.

    What a body that runs app code releases its slot through
    (``AdmittedResponse`` calls it exactly once); with latency recording on
    it also records the request's duration, as ``prazo.bindings.wsgi.TimedRelease``.
    """

    cdef AdmissionQueue _queue
    cdef LatencyHistogram _duration   # None while latency recording is off
    cdef int64_t _arrival_ns
    cdef int64_t _started_ns

    def __call__(self):
        _release_slot(self._queue, self._started_ns, self._duration, self._arrival_ns)


cdef inline QueueRelease _queue_release(
    AdmissionQueue queue, int64_t started_ns, LatencyHistogram duration, int64_t arrival_ns
):
    cdef QueueRelease release = QueueRelease.__new__(QueueRelease)
    release._queue = queue
    release._duration = duration
    release._arrival_ns = arrival_ns
    release._started_ns = started_ns
    return release


cdef inline ListBody _list_body(
    object items, AdmissionQueue queue, LatencyHistogram duration, int64_t arrival_ns, int64_t started_ns
):
    cdef ListBody body = ListBody.__new__(ListBody)
    body._items = items
    body._index = 0
    body._length = PySequence_Fast_GET_SIZE(items)
    body._queue = queue
    body._duration = duration
    body._arrival_ns = arrival_ns
    body._started_ns = started_ns
    return body


def call_admitted(app, dict environ, start_response, deadline, release, queue_wait_ns, counters, retry_after_s,
                  arrival_ns, outcome):
    """``prazo.bindings.wsgi._call_admitted`` (its specification) in C, for a ``Deadline`` and a dict environ.

    What the server embeddings and the front door run for every admitted
    request (``run_admitted``): the same observer call, environ keys and
    deadline rule (an earlier deadline already current wins), the app called
    in a copy of the current context entered once, ``release`` called at once
    if the app raises, and a list or tuple body wrapped in the C ``ListBody``
    (which calls ``release`` exactly once).
    """
    cdef object context, outer, current, result
    _bind_python_side()
    try:
        observer = _observer
        if observer is not None:
            # Inside the try: an observer that raises still gives the slot back.
            observer(environ, outcome, arrival_ns, _deadline_ns(deadline), queue_wait_ns, None)
        environ[_QUEUE_WAIT_MS_KEY] = queue_wait_ns / _NS_PER_MS
        outer = get_value(_DEADLINE_VAR)
        current = deadline
        if outer is not None and _deadline_ns(outer) <= _deadline_ns(deadline):
            current = outer
        environ[_DEADLINE_KEY] = current
        context = PyContext_CopyCurrent()
        PyContext_Enter(context)
        try:
            PyContextVar_Set(_DEADLINE_VAR, current)
            result = app(environ, start_response)
        finally:
            PyContext_Exit(context)
    except (DeadlineExceeded, DownstreamOverloaded) as exc:
        release()
        return _refuse(exc, start_response, counters, retry_after_s)
    except BaseException:
        release()
        raise
    if type(result) is list or type(result) is tuple:
        return _released_list_body(result, release)
    return _AdmittedResponse(result, context, start_response, release, counters, retry_after_s)


cdef inline ListBody _released_list_body(object items, object release):
    cdef ListBody body = ListBody.__new__(ListBody)
    body._items = items
    body._index = 0
    body._length = PySequence_Fast_GET_SIZE(items)
    body._release = release
    return body


def serve(middleware, environ, start_response):
    """Serve one request through ``middleware``: its compiled path if it has one, else its Python path.

    ``AdmissionMiddleware.__call__`` when this module is built.
    """
    compiled = middleware._compiled
    if compiled is None:
        return middleware._call_python(environ, start_response)
    return (<CompiledPath?>compiled)._serve(middleware, environ, start_response)
