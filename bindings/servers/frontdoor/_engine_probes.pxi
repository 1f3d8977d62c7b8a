# The front door engine's probes, compiled into _engine_c (a Cython include: they need the
# same cdef extern block as the face, and a second extension would compile the engine twice).
# Each runs one C rule of the engine alone, for the tests that hold it to its Python twin
# (prazo.bindings.headers, proxy_headers, runner's specs, the queue's line): the budget
# parsers, the front-proxy stamps, the trusted-address match, head checks and splits, the
# critical class and the admission line (EngineLine). Nothing in a request's path calls them.

# ------------------------------------------------------------ budget parsers

cdef object _parsed(int ok, double ms):
    return ms if ok else None


def parse_budget_ms(bytes value):
    """The C parser of ``X-Request-Budget-Ms`` (the rules of ``prazo.bindings.headers``)."""
    cdef double ms = 0
    cdef int ok = prazo_parse_budget_ms(value, len(value), &ms)
    return _parsed(ok, ms)


def parse_grpc_timeout(bytes value):
    """The C parser of ``grpc-timeout``."""
    cdef double ms = 0
    cdef int ok = prazo_parse_grpc_timeout(value, len(value), &ms)
    return _parsed(ok, ms)


def parse_envoy_timeout_ms(bytes value):
    """The C parser of ``x-envoy-expected-rq-timeout-ms``."""
    cdef double ms = 0
    cdef int ok = prazo_parse_envoy_ms(value, len(value), &ms)
    return _parsed(ok, ms)


cdef list _raw_headers(headers, phr_header *raw):
    """Point ``raw`` at ``[(name, value), ...]`` (bytes); the returned list keeps the bytes alive."""
    cdef list items = [(bytes(name), bytes(value)) for name, value in headers]
    if len(items) > PFD_MAX_HEADERS:
        raise ValueError("too many headers")
    cdef Py_ssize_t i
    for i in range(len(items)):
        name, value = items[i]
        raw[i].name = PyBytes_AS_STRING(name)
        raw[i].name_len = PyBytes_GET_SIZE(name)
        raw[i].value = PyBytes_AS_STRING(value)
        raw[i].value_len = PyBytes_GET_SIZE(value)
    return items


def incoming_budget(headers):
    """``(budget_ms or None, invalid, source or None)`` of ``[(name, value), ...]`` (bytes), as the front door reads them."""
    cdef phr_header raw[100]
    cdef list items = _raw_headers(headers, raw)
    cdef Py_ssize_t n = len(items)
    cdef double ms = 0
    cdef int invalid = 0, source = -1
    cdef int have = pfd_incoming_budget(raw, n, &ms, &invalid, &source)
    return (ms if have else None, invalid, BUDGET_SOURCES[source] if source >= 0 else None)


def deadline_ns_for(headers, int64_t arrival_ns, double default_budget_ms, double max_budget_ms,
                    int64_t upstream_ns=0):
    """The deadline the front door gives a head with ``headers`` arriving at ``arrival_ns``.

    ``upstream_ns``: the front-proxy queue time taken off it (``pfd_upstream_ns``).
    """
    budget, _invalid, _source = incoming_budget(headers)
    return pfd_deadline_for(default_budget_ms, max_budget_ms, budget is not None, budget or 0.0, arrival_ns,
                            upstream_ns)


# ------------------------------------------------------- front-proxy stamps

def parse_request_start_ns(bytes value):
    """The C parser of ``X-Request-Start`` (the rules of ``prazo.bindings.proxy_headers``): ns or None."""
    cdef int64_t ns = 0
    cdef int ok = pfd_parse_request_start_ns(value, len(value), &ns)
    return ns if ok else None


def request_start_ns(headers):
    """The earliest valid ``X-Request-Start``/``X-Queue-Start`` stamp of ``[(name, value), ...]`` (bytes), or None."""
    cdef phr_header raw[100]
    cdef list items = _raw_headers(headers, raw)
    cdef int64_t ns = 0
    cdef int ok = pfd_request_start(raw, len(items), &ns)
    return ns if ok else None


def upstream_wait_ns(int64_t stamp_ns, int64_t arrival_wall_ns, int64_t max_wait_ns):
    """The engine's front-proxy wait: ``arrival_wall_ns - stamp_ns`` within ``[0, max_wait_ns]``."""
    return pfd_upstream_wait_ns(stamp_ns, arrival_wall_ns, max_wait_ns)


def address_trusted(networks, bytes packed):
    """Whether the engine trusts a peer at ``packed`` (4 or 16 bytes) given ``engine_networks(...)``."""
    cdef pfd_config cfg
    cdef pfd_net *nets = NULL
    memset(&cfg, 0, sizeof(cfg))
    if len(packed) not in (4, 16):
        raise ValueError("packed must be 4 or 16 bytes")
    _trusted_config(&cfg, networks, &nets)
    cdef int ok = pfd_address_trusted(&cfg, AF_INET if len(packed) == 4 else AF_INET6,
                                      <const unsigned char *>PyBytes_AS_STRING(packed))
    free(nets)
    return bool(ok)


def check_head(bytes data):
    """How the front door judges ``data`` as a request head: ``"complete"``, ``"partial"`` or ``"bad"``."""
    cdef pfd_conn *c = <pfd_conn *>malloc(sizeof(pfd_conn))
    if c == NULL:
        raise MemoryError()
    memset(c, 0, sizeof(pfd_conn))
    c.buf = PyBytes_AS_STRING(data)
    c.len = PyBytes_GET_SIZE(data)
    cdef int r = pfd_parse_head(c, 0)
    free(c)
    return "complete" if r == 1 else ("partial" if r == 0 else "bad")


def is_critical(bytes head, bytes critical_header=None, critical_paths=()):
    """Whether the engine puts the request of ``head`` (a complete head) in the critical class.

    The engine's own rule (``pfd_is_critical``) over the parsed head, with the
    engine's ``critical_header`` and ``critical_paths`` options; raises
    ValueError when ``head`` is not a complete, well-formed head.
    """
    cdef bytes paths = b"".join(bytes(path) + b"\0" for path in critical_paths)
    cdef pfd_server *srv = <pfd_server *>calloc(1, sizeof(pfd_server))
    cdef pfd_conn *c = <pfd_conn *>calloc(1, sizeof(pfd_conn))
    cdef int parsed, critical = 0
    if srv == NULL or c == NULL:
        free(srv)
        free(c)
        raise MemoryError()
    c.buf = PyBytes_AS_STRING(head)
    c.len = PyBytes_GET_SIZE(head)
    if critical_header:
        srv.cfg.critical_header = PyBytes_AS_STRING(critical_header)
        srv.cfg.critical_header_len = PyBytes_GET_SIZE(critical_header)
    if paths:
        srv.cfg.critical_paths = PyBytes_AS_STRING(paths)
        srv.cfg.critical_paths_len = PyBytes_GET_SIZE(paths)
    parsed = pfd_parse_head(c, 0)
    if parsed == 1:
        critical = pfd_is_critical(srv, c)
    free(c)
    free(srv)
    if parsed != 1:
        raise ValueError("head must be a complete, well-formed request head")
    return bool(critical)


def split_requests(bytes data, Py_ssize_t max_head=65536):
    """How the engine frames ``data`` arriving on one connection: ``(requests, outcome)``.

    ``requests`` holds ``(end, method, target, body, keep_alive)`` for each
    request read whole, ``end`` the offset just past it. ``outcome``: ``"end"``
    (the bytes ended with a request), ``"closed"`` (a request that closes the
    connection came first), ``"partial"`` (a head or body not finished),
    ``"bad"`` (400), ``"too-large"`` (431) or ``"bad-body"`` (a broken chunked
    body). The engine's own path, without a socket: ``pfd_judge_head``, the
    worker's ``pfd_conn_read_body`` over the bytes already received, and the
    put-back of what follows a body as the next head (``pfd_conn_reset_for_next``).
    """
    cdef pfd_server *srv = <pfd_server *>calloc(1, sizeof(pfd_server))
    cdef pfd_conn *c = <pfd_conn *>calloc(1, sizeof(pfd_conn))
    cdef char *scratch = <char *>malloc(16384)
    cdef size_t total = len(data)
    cdef ssize_t n
    cdef int verdict
    if srv == NULL or c == NULL or scratch == NULL:
        free(srv)
        free(c)
        free(scratch)
        raise MemoryError()
    c.fd = -1   # no socket: a read beyond the received bytes fails at once
    requests = []
    outcome = "end"
    try:
        c.buf = <char *>malloc(total if total else 1)
        if c.buf == NULL:
            raise MemoryError()
        memcpy(c.buf, PyBytes_AS_STRING(data), total)
        c.len = c.cap = total
        while c.len:
            verdict = pfd_judge_head(c, max_head, 0)
            if verdict != PFD_HEAD_COMPLETE:
                outcome = {PFD_HEAD_PARTIAL: "partial", PFD_HEAD_BAD: "bad"}.get(verdict, "too-large")
                break
            method = PyBytes_FromStringAndSize(c.method, c.method_len)
            target = PyBytes_FromStringAndSize(c.path, c.path_len)
            keep = bool(c.client_keep_alive)
            pfd_conn_start_body(c)
            c.expect_continue = 0   # no socket to write 100 Continue to
            body = []
            n = 1
            while n > 0:
                n = pfd_conn_read_body(srv, c, scratch, 16384)
                if n > 0:
                    body.append(scratch[:n])
            if n < 0:
                outcome = "bad-body" if c.chunked and c.decoder.state == PFD_CK_ERROR else "partial"
                break
            pfd_conn_reset_for_next(c, c.pos)
            requests.append((total - c.len, method, target, b"".join(body), keep))
            if not keep:
                outcome = "closed"
                break
    finally:
        free(c.buf)
        free(c.cbuf)
        free(c)
        free(srv)
        free(scratch)
    return requests, outcome


# ----------------------------------------------------------------- the line alone

# The counters of prazo_line.h's struct prazo_line_counters, in its order.
LINE_COUNTERS = (
    "offered", "started", "completed", "rejected_full", "expired_on_arrival", "expired_in_queue", "cancelled",
    "in_flight", "assigned", "queued", "peak_in_flight", "peak_queued", "queue_wait_ns_total",
    "insufficient_budget", "shed", "evicted", "critical_started",
)
if sizeof(prazo_line_counters) != len(LINE_COUNTERS) * sizeof(prazo_atomic_i64):
    raise ImportError("prazo: prazo_line.h's counters and LINE_COUNTERS disagree; rebuild the front door")


cdef str _admit_answer(int outcome):
    if outcome == PRAZO_ADMIT_EXPIRED:
        return "expired-on-arrival"
    if outcome == PRAZO_ADMIT_INSUFFICIENT:
        return "insufficient-budget"
    return "queue-full"


cdef list _drop_answers(prazo_line_drops *drops):
    """[(token, answer), ...] of the line's drops, in the order met; frees ``drops``."""
    cdef Py_ssize_t i
    cdef int reason
    cdef list out = []
    for i in range(drops.count):
        reason = drops.items[i].reason
        out.append((drops.items[i].token,
                    "expired-in-queue" if reason == PRAZO_DROP_EXPIRED else
                    "insufficient-budget" if reason == PRAZO_DROP_INSUFFICIENT else
                    "shed-standing-queue" if reason == PRAZO_DROP_SHED else
                    "evicted-by-critical" if reason == PRAZO_DROP_EVICTED else "cancelled"))
    prazo_line_drops_free(drops)
    return out


cdef class EngineLine:
    """The engine's admission line on its own: ``core/prazo_line.h`` as this
    extension compiled it, in the engine's mode (a slot is taken when a worker
    asks for the next connection), with ints for tokens instead of connections.

    The engine calls the same C under its mutex; this face exists so a test can
    drive the front door's line and the queue's C twin with one sequence of
    arrivals, pickups, releases and sweeps, on a fake clock. It takes no lock:
    one thread at a time.
    """

    cdef prazo_line *_line

    def __cinit__(self):
        self._line = NULL

    def __init__(self, int threads, int max_queue, *, str order="fifo", int reserved=0,
                 int64_t expected_service_ns=0, int64_t codel_target_ns=5_000_000,
                 int64_t codel_interval_ns=100_000_000, int64_t now_ns=0):
        if self._line != NULL:
            raise RuntimeError("EngineLine.__init__ must not be called twice")
        if threads < 1 or max_queue < 0 or order not in ORDERS:
            raise ValueError("threads >= 1, max_queue >= 0 and an order of ORDERS")
        cdef int64_t capacity = <int64_t>threads + max_queue
        cdef prazo_line *line = <prazo_line *>malloc(prazo_line_size(capacity))
        if line == NULL:
            raise MemoryError()
        prazo_line_init(line, capacity, max_queue, threads, ORDERS[order], PRAZO_LINE_PICKUP, codel_target_ns,
                        codel_interval_ns, now_ns, expected_service_ns, 0, 0, threads, reserved)
        self._line = line

    def __dealloc__(self):
        free(self._line)

    cdef int _check(self) except -1:
        if self._line == NULL:
            raise RuntimeError("the EngineLine is not initialised")
        return 0

    def admit(self, uint64_t token, int64_t deadline_ns, int64_t now_ns, bint critical=False):
        """``(answer, dropped)``: answer None when it waits, else its refusal; dropped ``[(token, answer)]``."""
        self._check()
        cdef prazo_line_drops drops
        cdef prazo_line_entry entry
        prazo_line_drops_init(&drops)
        cdef int outcome = prazo_line_admit(self._line, deadline_ns, now_ns, critical, &drops)
        if outcome == PRAZO_ADMIT_WAIT:
            entry.deadline_ns = deadline_ns
            entry.enqueued_ns = now_ns
            entry.token = token
            entry.critical = critical
            prazo_line_push(self._line, &entry)
        return (None if outcome == PRAZO_ADMIT_WAIT else _admit_answer(outcome)), _drop_answers(&drops)

    def next(self, int64_t now_ns):
        """``(token, dropped)``: the token a free worker starts now (it holds a slot), or None."""
        self._check()
        cdef prazo_line_drops drops
        cdef prazo_line_entry entry
        prazo_line_drops_init(&drops)
        cdef int got = prazo_line_next(self._line, now_ns, &drops, &entry)
        if got == PRAZO_NEXT_TAKEN:
            prazo_line_count_start(self._line, entry.enqueued_ns, now_ns, entry.critical)
        elif got != PRAZO_NEXT_NONE:
            prazo_line_drops_free(&drops)
            raise MemoryError("the drop list ran out of memory")
        return (entry.token if got == PRAZO_NEXT_TAKEN else None), _drop_answers(&drops)

    def release(self, bint critical=False, int64_t service_ns=-1):
        """A started token's slot comes back; ``service_ns`` >= 0 is a service-time sample."""
        self._check()
        if prazo_line_in_flight(self._line) <= 0:
            raise ValueError("release() with no slot taken")
        prazo_line_release(self._line, critical, service_ns)

    def sweep(self, int64_t now_ns):
        """``(next_ns, dropped)``, as the engine's I/O thread sweeps: stale (adaptive), expired, doomed."""
        self._check()
        cdef prazo_line_drops drops
        prazo_line_drops_init(&drops)
        prazo_line_shed_stale(self._line, now_ns, &drops)
        cdef int64_t next_ns = prazo_line_sweep(self._line, now_ns, &drops)
        return next_ns, _drop_answers(&drops)

    def stats(self):
        """The line's counters by LINE_COUNTERS' names, and ``limit``."""
        self._check()
        cdef prazo_atomic_i64 *fields = <prazo_atomic_i64 *>&self._line.c
        cdef Py_ssize_t i
        snapshot = {name: prazo_load(&fields[i]) for i, name in enumerate(LINE_COUNTERS)}
        snapshot["limit"] = prazo_load(&self._line.limit)
        return snapshot
