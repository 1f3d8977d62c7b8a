# cython: freethreading_compatible = True
# The front door's compiled half: a thin Cython face over the engine in engine/ (pfd.h).
# Everything that decides (accept, head read and parse, budget, admission,
# canned refusals) runs in the engine's own pthread, which never holds the
# GIL; the calls below release the GIL around every wait and every socket call.
#
# Why one file of about 1 050 lines: a Cython extension is one module, and the
# engine's declarations, the Engine/Channel/Connection faces and the per-request
# work of the workers that is cheaper in C than in Python (the environ from the
# parsed head, the response head's fields) all need the same cdef extern block.
# The probes that let the tests hold each C rule to its Python twin are in
# _engine_probes.pxi, included at the end.
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memset, memcpy, memchr, memcmp
from libc.stdlib cimport malloc, calloc, free
from posix.unistd cimport close
cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeLatin1
from cpython.dict cimport PyDict_GetItem
# core/: the admission line the engine runs, for EngineLine below (the engine's own
# files call it in C, through pfd_line.c). Extern declarations only: no import at run time.
from prazo.core.prazo_line cimport *


cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    struct sockaddr_storage:
        pass
    struct sockaddr:
        pass
    enum:
        AF_INET
        AF_INET6


cdef extern from "picohttpparser.h" nogil:
    struct phr_header:
        const char *name
        size_t name_len
        const char *value
        size_t value_len


# core/: the budget headers' rules, which the compiled middleware (bindings/_wsgi_c.pyx) shares.
cdef extern from "prazo_budget.h" nogil:
    int prazo_parse_budget_ms(const char *p, size_t n, double *ms)
    int prazo_parse_envoy_ms(const char *p, size_t n, double *ms)
    int prazo_parse_grpc_timeout(const char *p, size_t n, double *ms)


cdef extern from "pfd.h" nogil:
    enum:
        PFD_A_QUEUE_FULL
        PFD_A_EXPIRED_ON_ARRIVAL
        PFD_A_EXPIRED_IN_QUEUE
        PFD_A_SHUTTING_DOWN
        PFD_A_INSUFFICIENT_BUDGET
        PFD_A_SHED
        PFD_A_EVICTED
        PFD_A_COUNT_KEEPABLE
        PFD_A_HEADER_TIMEOUT
        PFD_A_BAD_REQUEST
        PFD_A_HEAD_TOO_LARGE
        PFD_A_COUNT
        PFD_MAX_HEADERS
        PFD_ORDER_FIFO
        PFD_ORDER_LIFO
        PFD_ORDER_ADAPTIVE
        PFD_BODY_LOST
        PFD_BODY_MALFORMED
        PFD_BODY_TIMEOUT
        PFD_HEAD_PARTIAL
        PFD_HEAD_COMPLETE
        PFD_HEAD_BAD
        PFD_HEAD_TOO_LARGE
        PFD_CK_ERROR

    struct pfd_chunked:
        int state

    struct pfd_net:
        int family
        unsigned char addr[16]
        int prefix

    struct pfd_config:
        int threads
        int max_queue
        double default_budget_ms
        double max_budget_ms
        int64_t header_timeout_ns
        int64_t io_timeout_ns
        int64_t write_grace_ns
        int64_t max_io_wait_ns
        int64_t linger_ns
        int64_t max_drain_bytes
        int64_t max_lingering
        size_t max_head
        int order
        int64_t codel_target_ns
        int64_t codel_interval_ns
        int64_t expected_service_ns
        int expected_quantile_permille
        int vegas
        int min_concurrency
        int reserved
        const char *critical_header
        size_t critical_header_len
        const char *critical_paths
        size_t critical_paths_len
        int trust_request_start
        int64_t max_upstream_ns
        int measured_retry_after
        int observe
        const pfd_net *trusted
        int n_trusted
        const char *answer[11][2]
        size_t answer_len[11][2]

    struct pfd_conn:
        int fd
        size_t len, cap, pos
        char *buf
        size_t head_len
        const char *method
        const char *path
        size_t method_len
        size_t path_len
        int minor_version
        phr_header headers[100]
        size_t num_headers
        int64_t content_length
        int chunked
        int client_keep_alive
        int expect_continue
        pfd_chunked decoder
        char *cbuf
        size_t cbuf_pos, cbuf_len
        int64_t arrival_ns
        int64_t deadline_ns
        int64_t serial
        int64_t queued_ns
        int64_t started_ns
        int64_t upstream_ns
        int budget_source
        int budget_invalid
        int arrival_from_kernel
        int body_done
        int body_error
        sockaddr_storage peer

    struct pfd_stats:
        int64_t accepted, open_connections, offered, admitted, started, completed
        int64_t rejected_full, expired_on_arrival, expired_in_queue, shutting_down
        int64_t header_timeouts, bad_requests, heads_too_large, kernel_stamps
        int64_t in_flight, assigned, queued, peak_in_flight, peak_queued, queue_wait_ns_total, pending_heads, lingering
        int64_t insufficient_budget, shed, evicted, critical_started, limit, expected_service_ns
        int64_t upstream_stamps
        int64_t worker_lost, workers, worker_threads
        int64_t observed_lost

    struct pfd_observed:
        int64_t serial
        int64_t at_ns
        int64_t deadline_ns
        int critical
        int kind

    struct pfd_server:
        int draining
        pfd_config cfg

    struct pfd_channel:
        int fd
        char *scratch

    struct pfd_msg:
        pass

    pfd_server *pfd_server_new(const pfd_config *cfg, const int *listen_fds, int n_listen)
    int pfd_server_start(pfd_server *srv)
    void pfd_server_drain(pfd_server *srv)
    int pfd_server_wait_idle(pfd_server *srv, int64_t until_ns)
    void pfd_server_stop(pfd_server *srv)
    int pfd_server_free(pfd_server *srv)
    void pfd_server_stats(pfd_server *srv, pfd_stats *s)
    int64_t pfd_server_observed(pfd_server *srv, pfd_observed **out)
    pfd_conn *pfd_server_next(pfd_server *srv, int block, int *empty)
    pfd_server *pfd_server_new_host(const pfd_config *cfg, const int *listen_fds, int n_listen)
    int pfd_server_add_channel(pfd_server *srv, int fd, int worker)
    void pfd_server_retire_worker(pfd_server *srv, int worker)
    void pfd_server_worker_gone(pfd_server *srv, int worker)
    int pfd_server_worker_loads(pfd_server *srv, int *workers, int64_t *in_flight, int max)
    pfd_server *pfd_server_new_worker(const pfd_config *cfg)
    pfd_conn *pfd_channel_next(pfd_server *srv, pfd_channel *ch)
    int pfd_channel_ask(pfd_channel *ch)
    ssize_t pfd_conn_try_write(pfd_server *srv, pfd_conn *c, const char *p, size_t n)
    int pfd_conn_body_buffered(const pfd_conn *c)
    int pfd_conn_write(pfd_server *srv, pfd_conn *c, const char *p, size_t n)
    ssize_t pfd_conn_read_body(pfd_server *srv, pfd_conn *c, char *dst, size_t n)
    int pfd_conn_discard_body(pfd_server *srv, pfd_conn *c)
    int pfd_conn_body_arrived(const pfd_conn *c)
    void pfd_conn_release(pfd_server *srv, pfd_conn *c)
    void pfd_conn_hand_back(pfd_server *srv, pfd_conn *c, int keep)
    void pfd_conn_finish(pfd_server *srv, pfd_conn *c, int keep)
    int64_t pfd_now_ns()
    int pfd_incoming_budget(const phr_header *headers, size_t n, double *ms, int *invalid, int *source)
    int64_t pfd_deadline_for(double default_ms, double max_ms, int have, double incoming_ms, int64_t arrival_ns,
                             int64_t upstream_ns)
    int pfd_parse_request_start_ns(const char *p, size_t n, int64_t *ns)
    int pfd_request_start(const phr_header *headers, size_t n, int64_t *ns)
    int64_t pfd_upstream_wait_ns(int64_t stamp_ns, int64_t arrival_wall_ns, int64_t max_wait_ns)
    int pfd_address_trusted(const pfd_config *cfg, int family, const unsigned char *addr)
    int pfd_addr_text(const sockaddr_storage *ss, char *host, size_t hostlen, int *port)
    int pfd_parse_head(pfd_conn *c, size_t last_len)
    int pfd_is_critical(const pfd_server *srv, const pfd_conn *c)
    int pfd_judge_head(pfd_conn *c, size_t max_head, size_t last_len)
    void pfd_conn_start_body(pfd_conn *c)
    void pfd_conn_reset_for_next(pfd_conn *c, size_t consumed)


ROLES = frozenset({"single", "triage", "worker"})
# The fixed part of every channel message (struct pfd_msg), for the tests that play a worker.
CHANNEL_MESSAGE_SIZE = sizeof(pfd_msg)
BUDGET_SOURCES = ("X-Request-Budget-Ms", "grpc-timeout", "x-envoy-expected-rq-timeout-ms")
ANSWERS = {
    "queue-full": PFD_A_QUEUE_FULL,
    "expired-on-arrival": PFD_A_EXPIRED_ON_ARRIVAL,
    "expired-in-queue": PFD_A_EXPIRED_IN_QUEUE,
    "shutting-down": PFD_A_SHUTTING_DOWN,
    "insufficient-budget": PFD_A_INSUFFICIENT_BUDGET,
    "shed-standing-queue": PFD_A_SHED,
    "evicted-by-critical": PFD_A_EVICTED,
    "header-timeout": PFD_A_HEADER_TIMEOUT,
    "bad-request": PFD_A_BAD_REQUEST,
    "head-too-large": PFD_A_HEAD_TOO_LARGE,
}
KEEPABLE = frozenset(name for name, index in ANSWERS.items() if index < PFD_A_COUNT_KEEPABLE)
ORDERS = {"fifo": PFD_ORDER_FIFO, "lifo": PFD_ORDER_LIFO, "adaptive": PFD_ORDER_ADAPTIVE}


cdef object _address(const sockaddr_storage *ss):
    cdef char host[64]
    cdef int port = 0
    if pfd_addr_text(ss, host, sizeof(host), &port):
        return (host.decode("ascii"), port)
    return None


# ------------------------------------------------------------ the PEP 3333 environ

# The rules of ``runner.head_environ_py`` (its readable spec; a
# Hypothesis test holds the two to the same dict, keys in the same order), in C
# over the parsed head: the workers' Python spent more on this than on anything
# but the app call.
cdef str _HTTP_1_0 = "HTTP/1.0"
cdef str _HTTP_1_1 = "HTTP/1.1"
cdef bytes _KEY_CONTENT_TYPE = b"CONTENT_TYPE"
cdef bytes _KEY_CONTENT_LENGTH = b"CONTENT_LENGTH"


cdef inline str _latin1(const char *p, Py_ssize_t n):
    return PyUnicode_DecodeLatin1(p, n, NULL)


cdef inline int _hex(char ch) noexcept nogil:
    if c'0' <= ch <= c'9':
        return ch - c'0'
    if c'a' <= ch <= c'f':
        return ch - c'a' + 10
    if c'A' <= ch <= c'F':
        return ch - c'A' + 10
    return -1


cdef str _path_info(const char *p, Py_ssize_t n):
    """``unquote_to_bytes(path).decode("latin-1")``: %XX of two hex digits is a byte, any other % stays."""
    if n == 0 or memchr(p, c'%', n) == NULL:
        return _latin1(p, n)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n)
    cdef char *dst = PyBytes_AS_STRING(out)
    cdef Py_ssize_t i = 0, j = 0
    cdef int hi, lo
    while i < n:
        if p[i] == c'%' and i + 2 < n:
            hi = _hex(p[i + 1])
            lo = _hex(p[i + 2])
            if hi >= 0 and lo >= 0:
                dst[j] = <char>(hi * 16 + lo)
                j += 1
                i += 3
                continue
        dst[j] = p[i]
        j += 1
        i += 1
    return _latin1(dst, j)


cdef object _header_key(const char *p, Py_ssize_t n):
    """The environ key of header name ``p`` (``HTTP_...``, or CONTENT_TYPE/CONTENT_LENGTH); None to drop it."""
    cdef char key[256]
    cdef Py_ssize_t i
    cdef unsigned char ch
    if memchr(p, c'_', n) != NULL:
        return None  # is_ambiguous_header_name: a name with an underscore is dropped
    if n > <Py_ssize_t>sizeof(key) - 5:
        return _header_key_py(_latin1(p, n))
    memcpy(key, b"HTTP_", 5)
    for i in range(n):
        ch = <unsigned char>p[i]
        if ch >= 0x80:
            return _header_key_py(_latin1(p, n))  # str.upper()'s own rules beyond ASCII
        if c'a' <= ch <= c'z':
            ch -= 32
        elif ch == c'-':
            ch = c'_'
        key[5 + i] = <char>ch
    if (n == 12 and memcmp(key + 5, b"CONTENT_TYPE", 12) == 0) or (
            n == 14 and memcmp(key + 5, b"CONTENT_LENGTH", 14) == 0):
        return _latin1(key + 5, n)
    return _latin1(key, n + 5)


cdef object _header_key_py(str name):
    key = name.upper().replace("-", "_")
    if key == "CONTENT_TYPE" or key == "CONTENT_LENGTH":
        return key
    return "HTTP_" + key


cdef dict _head_environ(dict base, const char *method, Py_ssize_t method_len, const char *target,
                        Py_ssize_t target_len, int minor, const phr_header *headers, Py_ssize_t n, object peer):
    cdef dict environ = base.copy()
    cdef const char *path = target
    cdef Py_ssize_t path_len = target_len, i, q
    cdef const char *slash
    cdef const char *start
    cdef const char *query
    cdef void *old
    # absolute-form: the path is what follows the authority
    if (target_len >= 7 and memcmp(target, b"http://", 7) == 0) or (
            target_len >= 8 and memcmp(target, b"https://", 8) == 0):
        start = <const char *>memchr(target, c'/', target_len) + 2  # just past the "//"
        slash = <const char *>memchr(start, c'/', target_len - (start - target))
        if slash != NULL:
            path = slash
            path_len = target_len - (slash - target)
        else:
            path = b"/"
            path_len = 1
    query = <const char *>memchr(path, c'?', path_len)
    q = path_len if query == NULL else query - path
    environ["REQUEST_METHOD"] = _latin1(method, method_len)
    environ["PATH_INFO"] = _path_info(path, q)
    environ["QUERY_STRING"] = _latin1(query + 1, path_len - q - 1) if query != NULL else ""
    uri = _latin1(target, target_len)
    environ["RAW_URI"] = uri
    environ["REQUEST_URI"] = uri
    environ["SERVER_PROTOCOL"] = _HTTP_1_1 if minor == 1 else (_HTTP_1_0 if minor == 0 else f"HTTP/1.{minor}")
    if peer is not None:
        host, port = peer
        environ["REMOTE_ADDR"] = host
        environ["REMOTE_PORT"] = str(port)
    for i in range(n):
        key = _header_key(headers[i].name, headers[i].name_len)
        if key is None:
            continue
        value = _latin1(headers[i].value, headers[i].value_len)
        if key == "CONTENT_TYPE" or key == "CONTENT_LENGTH":
            environ[key] = value
            continue
        old = PyDict_GetItem(environ, key)
        environ[key] = value if old == NULL else f"{<object>old},{value}"
    return environ


def head_environ(dict base, conn):
    """A copy of ``base`` with the CGI keys of ``conn``'s head (``runner.head_environ_py``'s rules).

    ``conn``: a ``Connection``, or anything with its ``method``, ``target``,
    ``minor_version``, ``headers`` and ``peer``.
    """
    cdef phr_header raw[100]
    cdef Connection c
    cdef list items
    cdef bytes method, target
    if type(conn) is Connection:
        c = <Connection>conn
        if c.headers_list is None and c.c != NULL:
            return _head_environ(base, c.method, len(c.method), c.target, len(c.target), c.minor_version,
                                 c.c.headers, c.c.num_headers, c.peer)
    method = bytes(conn.method)
    target = bytes(conn.target)
    items = _raw_headers(conn.headers, raw)
    return _head_environ(base, method, len(method), target, len(target), conn.minor_version, raw, len(items),
                         conn.peer)


# ------------------------------------------------------------ the response head

# The app's part of a response head, for ``runner._Response._head``
# (which adds the framing and Connection lines): the rules of its spec,
# ``runner.response_fields_py``, compiled.
cdef frozenset _HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                                       "proxy-authenticate", "proxy-authorization"})
cdef long long _date_second = -1
cdef str _date_text = ""
cdef object _date_guard = object()


cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    enum:
        CLOCK_REALTIME
    int clock_gettime(int clk, timespec *ts)


def date_line():
    """``Date: ...`` (RFC 9110 requires it of a server with a clock), formatted once a second."""
    return _date_line()


cdef str _date_line():
    global _date_second, _date_text
    cdef timespec ts
    cdef str text
    # The clock of time.time() (time(NULL) reads a coarser one, which can lag it across a second).
    clock_gettime(CLOCK_REALTIME, &ts)
    cdef long long now = ts.tv_sec
    # The cache is read and replaced in a critical section (nothing with a GIL): without
    # one, a worker reading _date_text while another replaces it could use a freed string.
    with cython.critical_section(_date_guard):
        if now == _date_second:
            return _date_text
    from email.utils import formatdate
    text = "Date: " + formatdate(now, usegmt=True)
    with cython.critical_section(_date_guard):
        if now > _date_second:
            _date_text = text
            _date_second = now
        return _date_text


# What each (name, value) field of an app's headers comes to in the head: an app
# sends the same few on every response, so each exact (str, str) tuple is
# judged once (at most _FIELDS_MAX of them, then the memory starts again).
cdef dict _FIELDS = {}
cdef Py_ssize_t _FIELDS_MAX = 1024
cdef dict _STATUS_LINES = {}
cdef enum:
    _F_PLAIN = 0
    _F_HOP = 1
    _F_HOP_CLOSE = 2
    _F_DATE = 3
    _F_LENGTH = 4


cdef tuple _judge_field(name, value):
    lower = name.lower()
    if lower in _HOP_BY_HOP:
        return (_F_HOP_CLOSE if lower == "connection" and "close" in value.lower() else _F_HOP, None, None)
    line = f"{name}: {value}"
    if lower == "date":
        return (_F_DATE, line, None)
    if lower == "content-length":
        digits = value.strip()
        if not (digits.isascii() and digits.isdigit()):
            raise ValueError(f"bad Content-Length {value!r}")
        return (_F_LENGTH, line, int(value))
    return (_F_PLAIN, line, None)


def response_fields(status, list headers):
    """``(text, content_length or None, close)``: the status line, Date and the app's fields but the hop-by-hop ones.

    ``text`` is those lines joined by CRLF (without a final one); ``close`` is
    True when the app's Connection field says close; a Content-Length that is
    not digits raises ValueError. The spec: ``runner.response_fields_py``.
    """
    return _response_fields(status, headers)


cdef tuple _response_fields(status, list headers):
    cdef tuple judged
    cdef int kind
    status_line = _STATUS_LINES.get(status) if type(status) is str else None
    if status_line is None:
        status_line = f"HTTP/1.1 {status}"
        if type(status) is str:
            if len(_STATUS_LINES) >= _FIELDS_MAX:
                _STATUS_LINES.clear()
            _STATUS_LINES[status] = status_line
    cdef list lines = [status_line, _date_line()]
    cdef bint close = False
    length = None
    for field in headers:
        cached = type(field) is tuple and len(<tuple>field) == 2 and type((<tuple>field)[0]) is str and \
            type((<tuple>field)[1]) is str
        judged = _FIELDS.get(field) if cached else None
        if judged is None:
            name, value = field
            judged = _judge_field(name, value)
            if cached:
                if len(_FIELDS) >= _FIELDS_MAX:
                    _FIELDS.clear()
                _FIELDS[field] = judged
        kind = judged[0]
        if kind == _F_HOP:
            continue
        if kind == _F_HOP_CLOSE:
            close = True
            continue
        if kind == _F_DATE:
            lines[1] = judged[1]
            continue
        if kind == _F_LENGTH:
            length = judged[2]
        lines.append(judged[1])
    return "\r\n".join(lines), length, close


cdef int _trusted_config(pfd_config *cfg, networks, pfd_net **out) except -1:
    """Fill ``cfg``'s trusted list from ``networks`` (None: any peer); *out is malloc'ed (caller frees)."""
    out[0] = NULL
    if networks is None:
        cfg.n_trusted = -1
        return 0
    cdef list items = list(networks)
    cfg.n_trusted = len(items)
    if not items:
        return 0
    out[0] = <pfd_net *>malloc(len(items) * sizeof(pfd_net))
    if out[0] == NULL:
        raise MemoryError()
    cdef Py_ssize_t i
    cdef bytes packed
    for i in range(len(items)):
        version, packed, prefix = items[i]
        if version not in (4, 6) or len(packed) != (4 if version == 4 else 16) or not 0 <= prefix <= len(packed) * 8:
            free(out[0])
            out[0] = NULL
            raise ValueError(f"trusted network {i}: (4 or 6, packed address, prefix length), got {items[i]!r}")
        memset(&out[0][i], 0, sizeof(pfd_net))
        out[0][i].family = AF_INET if version == 4 else AF_INET6
        out[0][i].prefix = prefix
        memcpy(out[0][i].addr, PyBytes_AS_STRING(packed), len(packed))
    cfg.trusted = out[0]
    return 0


def engine_networks(networks):
    """``[(4 or 6, packed network address, prefix length), ...]`` of ``ipaddress`` networks (None stays None)."""
    if networks is None:
        return None
    return [(net.version, net.network_address.packed, net.prefixlen) for net in networks]


# ----------------------------------------------------------------- the engine

# pfd.h's PFD_NOTE_* (observe-only's notes), by the byte each is.
NOTE_KINDS = {ord("a"): "admitted", ord("s"): "started", ord("e"): "ended"}

cdef class Engine:
    """One front door: its I/O thread, the admission line and the canned answers.

    ``listen_fds`` are listening sockets the engine takes over (it closes
    them when it stops accepting). ``answers`` maps each reason of ``ANSWERS``
    to ``(close_bytes, keep_alive_bytes or None)``.
    """

    cdef pfd_server *srv
    cdef bint stopped
    cdef readonly int threads
    cdef readonly str role

    def __cinit__(self, listen_fds, *, int threads, int max_queue, double default_budget_ms, double max_budget_ms,
                  double header_timeout_ms, double io_timeout_ms, double write_grace_ms, double max_io_wait_ms,
                  double linger_ms, long long max_drain_bytes,
                  Py_ssize_t max_head, dict answers, Py_ssize_t max_lingering=512, str order="fifo", int64_t codel_target_ns=5000000,
                  int64_t codel_interval_ns=100000000, int64_t expected_service_ns=0,
                  int expected_quantile_permille=0, bint vegas=False, int min_concurrency=1, int reserved=0,
                  bytes critical_header=None, critical_paths=(), bint trust_request_start=False,
                  int64_t max_upstream_ns=0, trusted_networks=None, str role="single", bint measured_retry_after=True,
                  bint observe=False):
        # FrontDoorServer checks the options under the names users know; these
        # checks only keep the engine's own invariants, whoever calls it.
        if order not in ORDERS:
            raise ValueError(f"order must be one of {sorted(ORDERS)}, got {order!r}")
        if codel_target_ns <= 0 or codel_interval_ns <= 0 or expected_service_ns < 0:
            raise ValueError("codel_target_ns and codel_interval_ns must be > 0, expected_service_ns >= 0")
        if not 0 <= expected_quantile_permille <= 1000:
            raise ValueError("expected_quantile_permille must be in [0, 1000]")
        if not 1 <= min_concurrency <= threads:
            raise ValueError("min_concurrency must be in [1, threads]")
        if not 0 <= reserved < threads:
            raise ValueError("reserved must be in [0, threads)")
        if max_upstream_ns < 0:
            raise ValueError("max_upstream_ns must be >= 0")
        if not (0 < io_timeout_ms <= 1e12 and 0 <= write_grace_ms <= 1e12 and 0 < max_io_wait_ms <= 1e12):
            raise ValueError("io_timeout_ms and max_io_wait_ms must be in (0, 1e12], write_grace_ms in [0, 1e12]")
        if max_lingering < 1:
            raise ValueError("max_lingering must be >= 1")
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        cdef list path_list = [bytes(path) for path in critical_paths]
        if any(not path or b"\0" in path for path in path_list):
            raise ValueError("a critical path is a non-empty path without NUL bytes")
        cdef bytes paths = b"".join(path + b"\0" for path in path_list)
        cdef pfd_config cfg
        cdef pfd_net *nets = NULL
        memset(&cfg, 0, sizeof(cfg))
        cfg.order = ORDERS[order]
        cfg.codel_target_ns = codel_target_ns
        cfg.codel_interval_ns = codel_interval_ns
        cfg.expected_service_ns = expected_service_ns
        cfg.expected_quantile_permille = expected_quantile_permille
        cfg.vegas = vegas
        cfg.min_concurrency = min_concurrency
        cfg.reserved = reserved
        if critical_header:
            cfg.critical_header = PyBytes_AS_STRING(critical_header)
            cfg.critical_header_len = PyBytes_GET_SIZE(critical_header)
        if paths:
            cfg.critical_paths = PyBytes_AS_STRING(paths)
            cfg.critical_paths_len = PyBytes_GET_SIZE(paths)
        cfg.threads = threads
        cfg.max_queue = max_queue
        cfg.default_budget_ms = default_budget_ms
        cfg.max_budget_ms = max_budget_ms
        cfg.header_timeout_ns = <int64_t>(header_timeout_ms * 1e6)
        cfg.io_timeout_ns = <int64_t>(io_timeout_ms * 1e6)
        cfg.write_grace_ns = <int64_t>(write_grace_ms * 1e6)
        cfg.max_io_wait_ns = <int64_t>(max_io_wait_ms * 1e6)
        cfg.linger_ns = <int64_t>(linger_ms * 1e6)
        cfg.max_drain_bytes = max_drain_bytes
        cfg.max_lingering = max_lingering
        cfg.max_head = max_head
        missing = set(ANSWERS) - set(answers)
        if missing:
            raise ValueError(f"answers missing for {sorted(missing)}")
        for reason, index in ANSWERS.items():
            close_bytes, keep_bytes = answers[reason]
            cfg.answer[index][0] = PyBytes_AS_STRING(close_bytes)
            cfg.answer_len[index][0] = PyBytes_GET_SIZE(close_bytes)
            if keep_bytes is not None:
                cfg.answer[index][1] = PyBytes_AS_STRING(keep_bytes)
                cfg.answer_len[index][1] = PyBytes_GET_SIZE(keep_bytes)
        cdef int fds[8]
        fd_list = list(listen_fds)
        if role == "worker" and fd_list:
            raise ValueError("a worker process's engine listens on nothing: its connections come by channels")
        if role != "worker" and not 1 <= len(fd_list) <= 8:
            raise ValueError("between 1 and 8 listening sockets")
        for i, fd in enumerate(fd_list):
            fds[i] = fd
        cfg.trust_request_start = trust_request_start
        cfg.max_upstream_ns = max_upstream_ns
        cfg.measured_retry_after = measured_retry_after
        cfg.observe = observe  # a worker process's engine has no line: nothing to note there
        _trusted_config(&cfg, trusted_networks, &nets)
        # Each copies the answers and the networks.
        if role == "worker":
            self.srv = pfd_server_new_worker(&cfg)
        elif role == "triage":
            self.srv = pfd_server_new_host(&cfg, fds, len(fd_list))
        else:
            self.srv = pfd_server_new(&cfg, fds, len(fd_list))
        free(nets)
        if self.srv == NULL:
            raise MemoryError("cannot create the front door")
        self.threads = threads
        self.role = role

    cdef int _require(self, str role) except -1:
        if self.role != role:
            raise RuntimeError(f"only the engine of a {role} does this (this one is {self.role!r})")
        return 0

    def start(self):
        """Start the I/O thread: from now on connections are accepted."""
        if self.role == "worker":
            raise RuntimeError("a worker process's engine has no I/O thread to start")
        if pfd_server_start(self.srv) != 0:
            raise OSError("cannot start the front door's I/O thread")

    def add_channel(self, int fd, int worker):
        """(triage) A channel to one thread of worker process ``worker``; the engine owns ``fd`` from now on."""
        self._require("triage")
        if fd < 0:
            raise ValueError(f"fd must be a descriptor, got {fd}")
        if pfd_server_add_channel(self.srv, fd, worker) != 0:
            raise MemoryError("cannot add the channel")

    def retire_worker(self, int worker):
        """(triage) Each thread of worker process ``worker`` gets STOP when it next asks for a connection."""
        self._require("triage")
        pfd_server_retire_worker(self.srv, worker)

    def worker_gone(self, int worker):
        """(triage) Worker process ``worker`` has exited: its channels are dropped as at their end-of-file.

        Its running requests count in ``worker_lost``, their places come back and their clients'
        connections are shut down; its idle threads take nothing more. The supervisor tells this for
        every death it sees, because a process the worker forked may keep the channels from ending.
        """
        self._require("triage")
        pfd_server_worker_gone(self.srv, worker)

    def worker_loads(self):
        """(triage) ``{worker: requests running there}`` for every worker process with a live channel."""
        self._require("triage")
        cdef int ids[256]
        cdef int64_t loads[256]
        cdef int n = pfd_server_worker_loads(self.srv, ids, loads, 256)
        return {ids[i]: loads[i] for i in range(n)}

    def channel(self, int fd):
        """(worker) The ``Channel`` on descriptor ``fd`` (one per worker thread; it closes ``fd`` when dropped)."""
        self._require("worker")
        channel = Channel.__new__(Channel)
        (<Channel>channel)._init(self, fd)
        return channel

    def next_connection(self):
        """Wait (without the GIL) for the next admitted connection; None once the engine stops."""
        self._require("single")
        cdef pfd_conn *c
        cdef int empty = 0
        # Releasing the GIL costs a CPU-bound app a switch interval to get it
        # back: take a connection already waiting with the GIL held.
        c = pfd_server_next(self.srv, 0, &empty)
        if c == NULL and empty:
            with nogil:
                c = pfd_server_next(self.srv, 1, &empty)
        if c == NULL:
            return None
        conn = Connection.__new__(Connection)
        (<Connection>conn)._init(self, c)
        return conn

    def drain(self):
        """Stop accepting (the listeners close); heads completed from now on get 503 shutting-down."""
        pfd_server_drain(self.srv)

    def wait_idle(self, double timeout_s):
        """Wait up to ``timeout_s`` until nothing runs and nothing waits; True when so."""
        # NaN waits not at all and a huge or infinite timeout a century, never an undefined cast.
        if not timeout_s > 0.0:
            timeout_s = 0.0
        cdef int64_t until = pfd_now_ns() + <int64_t>(min(timeout_s, 3.0e9) * 1e9)
        cdef int idle
        with nogil:
            idle = pfd_server_wait_idle(self.srv, until)
        return bool(idle)

    def stop(self):
        """Answer what still waits 503 shutting-down, release the workers, join the I/O thread."""
        # One caller stops the engine, whichever threads race here (a critical section: nothing with a GIL).
        with cython.critical_section(self):
            if self.stopped:
                return
            self.stopped = True
        with nogil:
            pfd_server_stop(self.srv)

    @property
    def draining(self):
        return bool(self.srv.draining)

    def is_draining(self):
        """``draining``, as a method: what a worker's request loop asks before it promises keep-alive."""
        return bool(self.srv.draining)

    def stats(self):
        """The engine's counters, as a dict."""
        cdef pfd_stats s
        pfd_server_stats(self.srv, &s)
        return {
            "accepted": s.accepted, "open_connections": s.open_connections, "offered": s.offered,
            "admitted": s.admitted, "started": s.started, "completed": s.completed,
            "rejected_full": s.rejected_full, "expired_on_arrival": s.expired_on_arrival,
            "expired_in_queue": s.expired_in_queue, "shutting_down": s.shutting_down,
            "header_timeouts": s.header_timeouts, "bad_requests": s.bad_requests,
            "heads_too_large": s.heads_too_large, "kernel_arrival_stamps": s.kernel_stamps,
            "in_flight": s.in_flight, "assigned": s.assigned, "queued": s.queued,
            "peak_in_flight": s.peak_in_flight, "peak_queued": s.peak_queued,
            "queue_wait_ns_total": s.queue_wait_ns_total,
            "pending_heads": s.pending_heads, "lingering": s.lingering,
            "insufficient_budget": s.insufficient_budget, "shed": s.shed, "evicted": s.evicted,
            "critical_started": s.critical_started, "limit": s.limit, "expected_service_ns": s.expected_service_ns,
            "upstream_stamps": s.upstream_stamps,
            "worker_lost": s.worker_lost, "worker_processes": s.workers, "worker_threads": s.worker_threads,
            "observed_lost": s.observed_lost,
        }

    def observed(self):
        """(observe-only) What happened since the last call, in order: ``(kind, serial, at_ns, deadline_ns, critical)``.

        ``kind`` is ``"admitted"`` (``at_ns``: when the line took it), ``"started"`` or
        ``"ended"`` (``deadline_ns`` and ``critical`` only for an admission); ``serial``
        numbers the requests.
        """
        cdef pfd_observed *items = NULL
        cdef int64_t n
        with nogil:
            n = pfd_server_observed(self.srv, &items)
        try:
            return [
                (NOTE_KINDS[items[i].kind], items[i].serial, items[i].at_ns, items[i].deadline_ns, bool(items[i].critical))
                for i in range(n)
            ]
        finally:
            free(items)

    def __dealloc__(self):
        if self.srv != NULL:
            if not self.stopped:
                pfd_server_stop(self.srv)
            # A worker still holding a connection keeps the engine's memory alive (leaked, not freed under it).
            pfd_server_free(self.srv)


cdef class Channel:
    """A worker thread's end of its channel to the triage (``Engine.channel``): its connections come from here."""

    cdef pfd_channel ch
    cdef Engine engine

    cdef void _init(self, Engine engine, int fd):
        self.engine = engine
        memset(&self.ch, 0, sizeof(self.ch))
        self.ch.fd = fd

    def ask(self):
        """Tell the triage now that this thread takes connections (``next_connection`` then waits without asking)."""
        if pfd_channel_ask(&self.ch) != 0:
            raise OSError("the triage is gone")

    def next_connection(self):
        """Ask the triage (without the GIL) for the next admitted connection; None once it says stop or is gone."""
        cdef pfd_conn *c
        with nogil:
            c = pfd_channel_next(self.engine.srv, &self.ch)
        if c == NULL:
            return None
        conn = Connection.__new__(Connection)
        (<Connection>conn)._init(self.engine, c)
        (<Connection>conn).channel = self  # the channel outlives every connection it gave
        return conn

    def __dealloc__(self):
        if self.ch.fd >= 0:
            close(self.ch.fd)
        free(self.ch.scratch)


cdef class Connection:
    """One admitted request, held by one worker until ``finish()``.

    The head is copied into Python objects at once (``method``, ``target``,
    ``headers``, ...); ``read_body`` and ``write`` release the GIL while they
    wait on the socket. An app may misuse ``wsgi.input`` from a thread of its
    own, even after it returned: one read and one write may be inside the
    engine at a time (another raises ``RuntimeError``), and a connection
    finished meanwhile is handed back only when the last of them returns, so
    the engine never frees what a call still uses.
    """

    cdef pfd_conn *c
    cdef Engine engine
    cdef object channel
    cdef bint reading
    cdef bint writing
    cdef readonly bint finished
    cdef readonly object body_failure
    cdef readonly bytes method
    cdef readonly bytes target
    cdef readonly int minor_version
    # The head's fields and the peer's address become Python objects when first
    # asked (head_environ reads the engine's parsed head directly), and at the
    # latest before anything that may move the engine's buffer (a body read,
    # finish): see _keep_head.
    cdef list headers_list
    cdef object peer_value
    cdef bint peer_known
    cdef readonly int64_t arrival_ns
    cdef readonly int64_t deadline_ns
    cdef readonly int64_t serial
    cdef readonly int64_t upstream_ns
    cdef readonly int64_t queue_wait_ns
    cdef readonly object budget_source
    cdef readonly int budget_invalid
    cdef readonly bint client_keep_alive
    cdef readonly long long content_length
    cdef readonly bint chunked
    cdef readonly bint arrival_from_kernel

    cdef void _init(self, Engine engine, pfd_conn *c):
        self.engine = engine
        self.c = c
        self.method = PyBytes_FromStringAndSize(c.method, c.method_len)
        self.target = PyBytes_FromStringAndSize(c.path, c.path_len)
        self.minor_version = c.minor_version
        self.arrival_ns = c.arrival_ns
        self.deadline_ns = c.deadline_ns
        self.serial = c.serial
        self.upstream_ns = c.upstream_ns
        self.queue_wait_ns = c.started_ns - c.arrival_ns
        self.budget_source = BUDGET_SOURCES[c.budget_source] if c.budget_source >= 0 else None
        self.budget_invalid = c.budget_invalid
        self.client_keep_alive = c.client_keep_alive
        self.content_length = c.content_length
        self.chunked = c.chunked
        self.arrival_from_kernel = c.arrival_from_kernel

    cdef void _keep_head(self):
        """Copy the parsed head's fields out of the engine's buffer, which a body read or the hand-back may reuse."""
        cdef pfd_conn *c = self.c
        if self.headers_list is None:
            self.headers_list = [
                (PyBytes_FromStringAndSize(c.headers[i].name, c.headers[i].name_len),
                 PyBytes_FromStringAndSize(c.headers[i].value, c.headers[i].value_len))
                for i in range(c.num_headers)
            ] if c != NULL else []
        if not self.peer_known:
            self.peer_value = _address(&c.peer) if c != NULL else None
            self.peer_known = True

    @property
    def headers(self):
        """The head's fields, ``[(name, value), ...]`` as bytes, in their order."""
        self._keep_head()
        return self.headers_list

    @property
    def peer(self):
        """``(host, port)`` of the client, or None when the socket has no IP address."""
        if not self.peer_known:
            self.peer_value = _address(&self.c.peer) if self.c != NULL else None
            self.peer_known = True
        return self.peer_value

    # Who may touch the engine's connection: one read and one write at a time, each
    # marked (reading, writing) for its whole call, and finish() after both. The marks,
    # `finished` and `c` change together in the object's critical section: with a GIL that
    # is nothing (no Python runs between the check and the set), without one it is the
    # object's lock, so finish() from the worker and a read from a thread of the app's
    # never both hand the connection to the engine. Never held across a wait.

    cdef int _begin(self, bint write) except -1:
        """Mark a read (or a write) as inside the engine; the errors of a finished or busy connection."""
        with cython.critical_section(self):
            if self.finished:
                raise ValueError("the connection is finished")
            if write:
                if self.writing:
                    raise RuntimeError("another thread is writing this response")
                self.writing = True
            else:
                if self.reading:
                    raise RuntimeError("another thread is reading this request body")
                # Before the engine may move its buffer (a body read): the head's fields out first.
                self._keep_head()
                self.reading = True
        return 0

    cdef void _end(self, bint write):
        """The call returned: a finish() that came meanwhile hands the connection back now."""
        with cython.critical_section(self):
            if write:
                self.writing = False
            else:
                self.reading = False
            if self.finished and self.c != NULL and not self.reading and not self.writing:
                pfd_conn_hand_back(self.engine.srv, self.c, 0)
                self.c = NULL

    def read_body(self, Py_ssize_t size):
        """Up to ``size`` bytes of the decoded body (``b""`` at its end).

        ``OSError`` when the body failed; ``body_failure`` then says why:
        ``"lost"`` (the client closed or reset), ``"malformed"`` (a broken
        chunked encoding) or ``"timeout"`` (it stalled, or the request's
        deadline came first).
        """
        if size <= 0:
            if self.finished:
                raise ValueError("the connection is finished")
            if self.reading:
                raise RuntimeError("another thread is reading this request body")
            return b""
        cdef bytes out = PyBytes_FromStringAndSize(NULL, size)
        cdef char *dst = PyBytes_AS_STRING(out)
        cdef ssize_t n
        self._begin(False)
        if pfd_conn_body_buffered(self.c):
            n = pfd_conn_read_body(self.engine.srv, self.c, dst, <size_t>size)
        else:
            with nogil:
                n = pfd_conn_read_body(self.engine.srv, self.c, dst, <size_t>size)
        if n < 0:
            self.body_failure = _BODY_FAILURES.get(self.c.body_error, "lost")
        self._end(False)
        if n < 0:
            raise OSError(f"the request body failed ({self.body_failure})")
        if n == size:
            return out
        return out[:n]

    def discard_body(self):
        """Drop what the app left of the body from what has already arrived, never waiting; True when it is all read.

        For when the app is done: only then may the connection carry the next
        request. False while another thread is reading the body.
        """
        return self._discard()

    cdef bint _discard(self) except -1:
        cdef int done
        try:
            self._begin(False)
        except RuntimeError:
            return False  # another thread is reading it
        if self.c.body_error or self.c.body_done:
            done = pfd_conn_discard_body(self.engine.srv, self.c)
        else:
            with nogil:
                done = pfd_conn_discard_body(self.engine.srv, self.c)
        self._end(False)
        return done == 1

    def body_arrived(self):
        """True when the rest of the body has arrived, so ``discard_body()`` will need no wait.

        While the app may still read the body (its response streams), this is
        what a response head can promise keep-alive on. False while another
        thread is reading the body, and for a chunked body not read to its end.
        """
        return self._arrived()

    cdef bint _arrived(self) except -1:
        with cython.critical_section(self):
            if self.finished:
                raise ValueError("the connection is finished")
            return not self.reading and pfd_conn_body_arrived(self.c) == 1

    def write(self, data):
        """Send all of ``data``; ``OSError`` when the client is gone, stalls, or takes longer than the write bound."""
        cdef const unsigned char[:] view
        cdef const char *p
        cdef size_t n
        if type(data) is bytes:
            # the common case, without a memoryview
            p = PyBytes_AS_STRING(data)
            n = PyBytes_GET_SIZE(data)
        else:
            view = memoryview(data).cast("B") if len(data) else None
            p = <const char *>&view[0] if view is not None else NULL
            n = view.shape[0] if view is not None else 0
        self._send(p, n)

    cdef int _send(self, const char *p, size_t n) except -1:
        cdef int rc = 0
        cdef ssize_t sent
        self._begin(True)
        if n > 0:
            # Most responses fit the socket buffer: no reason to give the GIL away for them.
            sent = pfd_conn_try_write(self.engine.srv, self.c, p, n)
            if sent < 0:
                rc = -1
            elif <size_t>sent < n:
                with nogil:
                    rc = pfd_conn_write(self.engine.srv, self.c, p + sent, n - sent)
        self._end(True)
        if rc != 0:
            raise OSError("the client is gone, stopped reading or reads too slowly")
        return 0

    def finish(self, bint keep_alive):
        """Give the worker's place back (once) and the connection to the I/O thread: next head, or a polite close.

        While another thread is still inside ``read_body`` or ``write``, only
        the place is given back now; the connection follows (closed politely)
        when that call returns.
        """
        self._finish(keep_alive)

    cdef void _finish(self, bint keep_alive):
        # O(1) under the engine's mutex, never a wait.
        with cython.critical_section(self):
            if self.finished:
                return
            self._keep_head()
            self.finished = True
            if self.reading or self.writing:
                pfd_conn_release(self.engine.srv, self.c)
                return
            pfd_conn_finish(self.engine.srv, self.c, 1 if keep_alive else 0)
            self.c = NULL

    def __dealloc__(self):
        if not self.finished and self.c != NULL:
            pfd_conn_finish(self.engine.srv, self.c, 0)


_BODY_FAILURES = {PFD_BODY_LOST: "lost", PFD_BODY_MALFORMED: "malformed", PFD_BODY_TIMEOUT: "timeout"}


# The workers' request loop and the response, compiled (runner.py is their spec).
include "_engine_runner.pxi"

# The probes: the engine's rules one at a time, for the tests that hold each to its Python twin.
include "_engine_probes.pxi"
