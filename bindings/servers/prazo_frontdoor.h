/* The front door's engine: accept, head read, parse, admission and canned
 * refusals in one C thread that never touches Python, and the GIL-free calls
 * the Python workers make (wait for the next admitted connection, read its
 * body, write the response, hand the connection back).
 *
 * Ownership of a connection (struct fd_conn) follows its state, and only the
 * owner touches it:
 *   FD_READING  the I/O thread: in epoll, reading a head under the head timer
 *   FD_QUEUED   the admission line, under srv->mutex (the I/O thread expires it,
 *               a worker takes it)
 *   FD_RUNNING  one worker, until fd_conn_hand_back() puts it on srv->returned
 *               (the Cython Connection hands it back only once no app thread
 *               is still inside a body read or a write on it)
 *   FD_DRAINING the I/O thread: lingering close after a refusal
 * The listening sockets and the epoll/eventfd descriptors belong to the I/O
 * thread; a connection's descriptor to whoever owns the connection.
 */
#ifndef PRAZO_FRONTDOOR_H
#define PRAZO_FRONTDOOR_H

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "picohttpparser.h"
#include "prazo_policy.h"   /* core/: the queue policies' arithmetic, shared with the queue's C twin */

#define FD_MAX_HEADERS 100
#define FD_READ_CHUNK 16384

enum fd_answer {
    FD_A_QUEUE_FULL,         /* 503 queue-full */
    FD_A_EXPIRED_ON_ARRIVAL, /* 504 expired-on-arrival */
    FD_A_EXPIRED_IN_QUEUE,   /* 504 expired-in-queue */
    FD_A_SHUTTING_DOWN,      /* 503 shutting-down */
    FD_A_INSUFFICIENT_BUDGET, /* 504 insufficient-budget: less budget left than the expected service time */
    FD_A_SHED,               /* 503 shed-standing-queue (order="adaptive") */
    FD_A_EVICTED,            /* 503 evicted-by-critical */
    FD_A_COUNT_KEEPABLE,     /* the ones above exist as keep-alive and close variants */
    FD_A_HEADER_TIMEOUT = FD_A_COUNT_KEEPABLE, /* 408, closes */
    FD_A_BAD_REQUEST,        /* 400, closes */
    FD_A_HEAD_TOO_LARGE,     /* 431, closes */
    FD_A_COUNT
};

enum fd_state { FD_READING, FD_QUEUED, FD_RUNNING, FD_DRAINING, FD_CLOSED };

/* Why a request body failed (fd_conn.body_error); 0 while it has not. */
enum fd_body_error { FD_BODY_LOST = 1, FD_BODY_MALFORMED = 2, FD_BODY_TIMEOUT = 3 };
#define FD_BODY_AGAIN (-2)   /* a read that may not wait found nothing yet */

enum fd_order { FD_ORDER_FIFO = 0, FD_ORDER_LIFO = 1, FD_ORDER_ADAPTIVE = 2 };

enum fd_source { FD_SRC_NONE = -1, FD_SRC_BUDGET = 0, FD_SRC_GRPC = 1, FD_SRC_ENVOY = 2 };

/* A trusted proxy's network: family AF_INET or AF_INET6, the network address
 * in network byte order, the prefix length in bits. */
struct fd_net {
    int family;
    unsigned char addr[16];
    int prefix;
};

struct fd_config {
    int threads;
    int max_queue;
    double default_budget_ms;
    double max_budget_ms;
    int64_t header_timeout_ns;
    int64_t io_timeout_ns;   /* a worker's body read or response write stalled this long fails */
    /* A body read never waits past the request's deadline; a response write not
     * past the deadline (or the moment the response began, if later) plus
     * write_grace_ns; and all of one request's waits on its client together
     * never exceed max_io_wait_ns, whatever the budget. */
    int64_t write_grace_ns;
    int64_t max_io_wait_ns;
    int64_t linger_ns;
    int64_t max_drain_bytes;
    int64_t max_lingering;   /* >= 1: lingering closes at once; beyond, the oldest is closed outright */
    size_t max_head;
    /* The queue policies (docs/design.md, "Queue policies"), the same options as AdmissionQueue's. */
    int order;                        /* enum fd_order */
    int64_t codel_target_ns, codel_interval_ns;   /* order == FD_ORDER_ADAPTIVE */
    int64_t expected_service_ns;      /* > 0: a fixed expected service time (doomed-work skip) */
    int expected_quantile_permille;   /* > 0: learn that quantile of the service times instead; both 0: off */
    int vegas;                        /* 1: limit="vegas" between min_concurrency and threads */
    int min_concurrency;
    int reserved;                     /* places kept for the critical class */
    const char *critical_header;      /* a request is critical when this header says "critical"; NULL: none */
    size_t critical_header_len;
    const char *critical_paths;       /* request paths that are critical, each ended by a NUL; NULL: none */
    size_t critical_paths_len;
    /* Front-proxy queue time (prazo.bindings.proxy_headers): with trust_request_start, the
     * time since the earliest valid X-Request-Start / X-Queue-Start stamp, at most
     * max_upstream_ns, comes off the deadline when the peer is one of `trusted`
     * (n_trusted < 0: any peer). */
    int trust_request_start;
    int64_t max_upstream_ns;
    const struct fd_net *trusted;
    int n_trusted;
    /* [answer][keep]: keep = 1 for the keep-alive variant (only below FD_A_COUNT_KEEPABLE) */
    const char *answer[FD_A_COUNT][2];
    size_t answer_len[FD_A_COUNT][2];
};

/* Where a chunked body's decoder stands (fd_chunked_decode). */
enum fd_chunk_state {
    FD_CK_SIZE,            /* first hex digit of a chunk size */
    FD_CK_SIZE_MORE,       /* more hex digits, ';', BWS or CR */
    FD_CK_SIZE_BWS,        /* BWS after the size: only ';' may follow */
    FD_CK_EXT_NAME_START,  /* BWS, then an extension's name */
    FD_CK_EXT_NAME,
    FD_CK_EXT_NAME_BWS,    /* BWS after a name: '=' or ';' */
    FD_CK_EXT_VALUE_START, /* BWS, then a token or a quoted string */
    FD_CK_EXT_TOKEN,
    FD_CK_EXT_QUOTED,
    FD_CK_EXT_QUOTED_PAIR, /* after a backslash in a quoted string */
    FD_CK_EXT_VALUE_END,   /* after a value: BWS, ';' or CR */
    FD_CK_EXT_VALUE_BWS,   /* BWS after a value: only ';' may follow */
    FD_CK_SIZE_LF,
    FD_CK_DATA,
    FD_CK_DATA_CR,
    FD_CK_DATA_LF,
    FD_CK_TRAILER_LINE,    /* start of a trailer field line, or CR of the empty line that ends the body */
    FD_CK_TRAILER_NAME,
    FD_CK_TRAILER_VALUE,
    FD_CK_TRAILER_LF,
    FD_CK_END_LF,
    FD_CK_DONE,
    FD_CK_ERROR            /* sticky: a broken body stays broken, and can be told from a short one */
};

struct fd_chunked {
    enum fd_chunk_state state;
    uint64_t left;         /* chunk size while reading it; then the chunk's bytes still to come */
    size_t meta;           /* bytes of the current chunk line (of all the trailers after the last chunk) */
};

struct fd_conn;

struct fd_list {           /* intrusive doubly linked list of connections */
    struct fd_conn *head, *tail;
    int64_t count;
};

struct fd_conn {
    int fd;
    enum fd_state state;
    struct fd_conn *prev, *next;    /* timer list or admission line */
    int64_t timer_ns;               /* head timer / linger end */
    int verdict;                    /* handed back by a worker: 1 next head, 0 polite close, -1 close now */
    int64_t drained;
    char *buf;
    size_t len, cap;
    size_t head_len;                /* 0 until a head is parsed */
    /* The parsed head; pointers into buf, valid while FD_QUEUED/FD_RUNNING. */
    const char *method, *path;
    size_t method_len, path_len;
    int minor_version;
    struct phr_header headers[FD_MAX_HEADERS];
    size_t num_headers;
    int64_t content_length;         /* -1: none */
    int chunked;
    int client_keep_alive;
    /* Atomic: an app thread may read the body while the worker writes the response. */
    atomic_int expect_continue;
    int64_t arrival_ns, deadline_ns, queued_ns, started_ns;
    int64_t upstream_ns;            /* taken off the deadline for a trusted proxy's X-Request-Start */
    int critical;                   /* of the critical class: waits in srv->crit, served first */
    int drop_answer;                /* the refusal of a connection dropped from the line */
    int budget_source;
    int budget_invalid;
    int arrival_from_kernel;        /* 1: arrival is the kernel's receive stamp of the first bytes */
    int64_t last_read_ns;           /* when bytes were last read: the arrival of pipelined ones */
    /* Body reading by the worker */
    size_t pos;                     /* next unread byte of buf */
    int64_t body_left;              /* Content-Length bytes still to read */
    int body_done;
    int body_error;                 /* enum fd_body_error */
    int64_t write_until;            /* 0 until the response begins: then its last moment to be written */
    _Atomic int64_t io_waited_ns;   /* time spent waiting on the client, reads and writes together */
    struct fd_chunked decoder;
    char *cbuf;                     /* chunked: decoded bytes not yet given out */
    size_t cbuf_pos, cbuf_len, cbuf_cap;
    struct sockaddr_storage peer;
    socklen_t peer_len;
};

struct fd_stats {
    int64_t accepted, open_connections, offered, admitted, started, completed;
    int64_t rejected_full, expired_on_arrival, expired_in_queue, shutting_down;
    int64_t header_timeouts, bad_requests, heads_too_large, kernel_stamps;
    int64_t in_flight, assigned, queued, peak_in_flight, peak_queued, queue_wait_ns_total, pending_heads, lingering;
    int64_t insufficient_budget, shed, evicted, critical_started, limit, expected_service_ns;
    int64_t upstream_stamps;
};

struct fd_server {
    struct fd_config cfg;
    int listen_fds[8];
    int n_listen;
    int epfd, evfd;
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mutex;
    pthread_cond_t ready;       /* a connection entered the line, or stopping */
    pthread_cond_t idle;        /* in_flight or queued went down */
    struct fd_list line;        /* FD_QUEUED normal requests, in arrival order (served per cfg.order) */
    struct fd_list crit;        /* FD_QUEUED critical requests, in arrival order (served first, FIFO) */
    struct fd_conn *returned;   /* finished by workers or refused at pickup, for the I/O thread */
    int64_t in_flight;          /* held by workers */
    int64_t critical_in_flight; /* of which critical */
    /* The policies' state, under mutex. */
    int64_t limit;              /* the current concurrency limit: threads, or Vegas's */
    struct prazo_codel codel;
    struct prazo_vegas vegas;
    struct prazo_service_estimate estimate;
    int draining;               /* under mutex; also read by the I/O thread */
    int stopping;
    int io_done;                /* the I/O thread has exited: workers free what they finish */
    atomic_int listeners_closed;
    /* owned by the I/O thread */
    struct fd_list heads, lingering;
    /* Closed while an epoll batch that may still name them was handled: freed at the next turn. */
    struct fd_conn *graveyard;
    int64_t accept_paused_until;   /* out of descriptors: listeners out of epoll until then (0: not paused) */
    /* counters (written under mutex or by the I/O thread only; read via atomics) */
    _Atomic int64_t accepted, open_connections, offered, admitted, started, completed;
    _Atomic int64_t rejected_full, expired_on_arrival, expired_in_queue, shutting_down;
    _Atomic int64_t header_timeouts, bad_requests, heads_too_large, kernel_stamps;
    _Atomic int64_t peak_in_flight, peak_queued, queue_wait_ns_total;
    _Atomic int64_t pending_heads, lingering_now;   /* published by the I/O thread each turn */
    _Atomic int64_t insufficient_budget, shed, evicted, critical_started;
    _Atomic int64_t expected_now;   /* fd_expected(), published under mutex for the I/O thread's arrivals */
    _Atomic int64_t upstream_stamps;   /* heads whose deadline a trusted proxy's stamp shortened */
};

static inline int64_t fd_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void fd_count(_Atomic int64_t *c, int64_t d) { atomic_fetch_add_explicit(c, d, memory_order_relaxed); }
static inline int64_t fd_read_counter(_Atomic int64_t *c) { return atomic_load_explicit(c, memory_order_relaxed); }

/* ------------------------------------------------------------------ lists */

static void fd_list_push(struct fd_list *l, struct fd_conn *c)
{
    c->next = NULL;
    c->prev = l->tail;
    if (l->tail)
        l->tail->next = c;
    else
        l->head = c;
    l->tail = c;
    l->count++;
}

static void fd_list_remove(struct fd_list *l, struct fd_conn *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        l->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        l->tail = c->prev;
    c->prev = c->next = NULL;
    l->count--;
}

/* ------------------------------------------------------- budget headers */
/* The same rules as prazo.bindings.headers (tests/test_frontdoor_budget.py runs
 * that module's cases against these): a value is at most 40 characters, loses
 * leading and trailing spaces/tabs, and is judged element by element when it
 * holds commas; the smallest valid value of the three headers wins; an invalid
 * one is ignored and counted; the policy caps the result at max_budget_ms. */

#define FD_MAX_VALUE_CHARS 40
#define FD_MAX_WIRE_MS 9223372036854.0   /* (2**63 - 1) // 10**6 */

static int fd_strip(const char **p, size_t *n)
{
    if (*n > FD_MAX_VALUE_CHARS)
        return 0;
    while (*n && (**p == ' ' || **p == '\t')) {
        (*p)++;
        (*n)--;
    }
    while (*n && ((*p)[*n - 1] == ' ' || (*p)[*n - 1] == '\t'))
        (*n)--;
    return 1;
}

static int fd_all_digits(const char *p, size_t n)
{
    if (n == 0)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (p[i] < '0' || p[i] > '9')
            return 0;
    return 1;
}

/* X-Request-Budget-Ms: -?[0-9]+(\.[0-9]+)? ; 1 and *ms when valid. */
static int fd_parse_budget_ms(const char *p, size_t n, double *ms)
{
    char tmp[FD_MAX_VALUE_CHARS + 1];
    if (!fd_strip(&p, &n) || n == 0)
        return 0;
    size_t i = 0;
    if (p[i] == '-')
        i++;
    size_t digits = i;
    while (i < n && p[i] >= '0' && p[i] <= '9')
        i++;
    if (i == digits)
        return 0;
    if (i < n) {
        if (p[i] != '.')
            return 0;
        i++;
        size_t frac = i;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
        if (i == frac || i != n)
            return 0;
    }
    memcpy(tmp, p, n);
    tmp[n] = 0;
    double v = strtod(tmp, NULL);   /* correctly rounded, like Python's float() */
    if (!(v >= -FD_MAX_WIRE_MS && v <= FD_MAX_WIRE_MS))
        return 0;
    *ms = v;
    return 1;
}

static int fd_parse_envoy_ms(const char *p, size_t n, double *ms)
{
    char tmp[FD_MAX_VALUE_CHARS + 1];
    if (!fd_strip(&p, &n) || !fd_all_digits(p, n))
        return 0;
    memcpy(tmp, p, n);
    tmp[n] = 0;
    double v = strtod(tmp, NULL);
    if (!(v <= FD_MAX_WIRE_MS))
        return 0;
    *ms = v;
    return 1;
}

static int fd_parse_grpc_timeout(const char *p, size_t n, double *ms)
{
    if (!fd_strip(&p, &n) || n < 2 || n > 9 || !fd_all_digits(p, n - 1))
        return 0;
    int64_t count = 0;
    for (size_t i = 0; i + 1 < n; i++)
        count = count * 10 + (p[i] - '0');
    int64_t num, den;
    switch (p[n - 1]) {
    case 'H': num = 3600000; den = 1; break;
    case 'M': num = 60000; den = 1; break;
    case 'S': num = 1000; den = 1; break;
    case 'm': num = 1; den = 1; break;
    case 'u': num = 1; den = 1000; break;
    case 'n': num = 1; den = 1000000; break;
    default: return 0;
    }
    /* count * num < 2**53: exact, then one correctly rounded division, as in Python. */
    *ms = (double)(count * num) / (double)den;
    return 1;
}

typedef int (*fd_parser)(const char *, size_t, double *);

static const char *const fd_budget_names[3] = {"x-request-budget-ms", "grpc-timeout", "x-envoy-expected-rq-timeout-ms"};
static const fd_parser fd_budget_parsers[3] = {fd_parse_budget_ms, fd_parse_grpc_timeout, fd_parse_envoy_ms};

/* Which of the three budget headers `name` is, or -1. */
static int fd_budget_header_index(const char *name, size_t len)
{
    for (int i = 0; i < 3; i++)
        if (strlen(fd_budget_names[i]) == len && strncasecmp(name, fd_budget_names[i], len) == 0)
            return i;
    return -1;
}

/* The incoming budget of a head: returns 1 and *ms when some value was valid;
 * *invalid counts the headers (not elements) with any invalid element; *source
 * the winning header (the first in table order on a tie). */
static int fd_incoming_budget(const struct phr_header *headers, size_t n, double *ms, int *invalid, int *source)
{
    double best[3];
    int have[3] = {0, 0, 0}, present[3] = {0, 0, 0}, bad[3] = {0, 0, 0};
    for (size_t h = 0; h < n; h++) {
        if (headers[h].name == NULL)
            continue;
        int which = fd_budget_header_index(headers[h].name, headers[h].name_len);
        if (which < 0)
            continue;
        present[which] = 1;
        const char *v = headers[h].value, *end = v + headers[h].value_len;
        for (;;) {   /* every comma-separated element, as a joined repeat would be split */
            const char *comma = memchr(v, ',', (size_t)(end - v));
            const char *stop = comma ? comma : end;
            double value;
            if (fd_budget_parsers[which](v, (size_t)(stop - v), &value)) {
                if (!have[which] || value < best[which])
                    best[which] = value;
                have[which] = 1;
            } else {
                bad[which] = 1;
            }
            if (!comma)
                break;
            v = comma + 1;
        }
    }
    int found = 0;
    *invalid = 0;
    *source = FD_SRC_NONE;
    for (int i = 0; i < 3; i++) {
        if (!present[i])
            continue;
        *invalid += bad[i];
        if (have[i] && (!found || best[i] < *ms)) {
            *ms = best[i];
            *source = i;
            found = 1;
        }
    }
    return found;
}

/* BudgetPolicy.deadline_for: arrival + min(incoming or default, max) - upstream, the
 * budget >= 0 (upstream can only shorten it, down to "already passed"), saturating. */
static int64_t fd_deadline_for(double default_ms, double max_ms, int have, double incoming_ms, int64_t arrival_ns,
                               int64_t upstream_ns)
{
    double budget = have ? incoming_ms : default_ms;
    if (budget > max_ms)
        budget = max_ms;
    if (budget < 0.0)
        budget = 0.0;
    int64_t budget_ns = (int64_t)(budget * 1000000.0);   /* truncation: never a nanosecond more */
    if (upstream_ns > 0)
        budget_ns -= upstream_ns < budget_ns ? upstream_ns : budget_ns;
    int64_t deadline;
    if (__builtin_add_overflow(arrival_ns, budget_ns, &deadline))
        deadline = INT64_MAX;
    return deadline;
}

/* ------------------------------------------------- front-proxy queue time */
/* The X-Request-Start / X-Queue-Start rules of prazo.bindings.proxy_headers
 * (parse_request_start_ns, upstream_wait_ns, FrontProxyBudgetPolicy), which
 * stay the spec: tests/test_frontdoor_parsing.py runs Hypothesis over both
 * parsers and both deadlines and asserts they agree. A value is at most 40
 * characters, loses leading and trailing spaces/tabs, then is `t=`? digits
 * (1-20) and an optional fraction of 1-9 digits; the unit follows from the
 * integer's magnitude; a moment outside 2000-01-01 .. 2100-01-01 UTC is no
 * stamp. A header sent twice reaches the Python side joined with a comma,
 * which no stamp holds: here too it is no stamp. */

#define FD_EARLIEST_STAMP_NS (946684800LL * 1000000000LL)
#define FD_LATEST_STAMP_NS (4102444800LL * 1000000000LL)

/* 1 and *ns (ns since the epoch) when the value is a valid stamp. */
static int fd_parse_request_start_ns(const char *p, size_t n, int64_t *ns)
{
    if (!fd_strip(&p, &n))
        return 0;
    size_t i = 0;
    if (n >= 2 && p[0] == 't' && p[1] == '=')
        i = 2;
    size_t digits = i;
    uint64_t integer = 0;
    int too_big = 0;
    while (i < n && p[i] >= '0' && p[i] <= '9') {
        /* Anything from LATEST on is out of range in every unit (a value that
         * large can only be ns): stop counting, keep checking the syntax. */
        if (integer >= (uint64_t)FD_LATEST_STAMP_NS / 10)
            too_big = 1;   /* one more digit reaches LATEST (and could overflow) */
        else if ((integer = integer * 10 + (uint64_t)(p[i] - '0')) >= (uint64_t)FD_LATEST_STAMP_NS)
            too_big = 1;
        i++;
    }
    size_t int_digits = i - digits;
    if (int_digits < 1 || int_digits > 20)
        return 0;
    uint64_t fraction = 0, scale = 1;
    int has_fraction = 0;
    if (i < n) {
        if (p[i] != '.')
            return 0;
        i++;
        size_t start = i;
        while (i < n && p[i] >= '0' && p[i] <= '9') {
            fraction = fraction * 10 + (uint64_t)(p[i] - '0');
            scale *= 10;
            i++;
        }
        if (i == start || i - start > 9 || i != n)
            return 0;
        has_fraction = 1;
    }
    if (too_big)
        return 0;
    uint64_t unit = integer < 100000000000ULL ? 1000000000ULL
                    : integer < 100000000000000ULL ? 1000000ULL
                    : integer < 100000000000000000ULL ? 1000ULL : 1ULL;
    if (has_fraction && unit == 1)
        return 0;   /* a fraction of a nanosecond is not a real stamp */
    /* (integer * scale + fraction) * unit // scale, exactly: integer * unit is
     * a multiple of scale's share; fraction * unit < 10**18 fits. */
    uint64_t whole;
    if (__builtin_mul_overflow(integer, unit, &whole))
        return 0;
    uint64_t stamp = whole + fraction * unit / scale;
    if (stamp < (uint64_t)FD_EARLIEST_STAMP_NS || stamp >= (uint64_t)FD_LATEST_STAMP_NS)
        return 0;
    *ns = (int64_t)stamp;
    return 1;
}

/* The earliest valid stamp of a head's X-Request-Start / X-Queue-Start; 1 and *ns when there is one. */
static int fd_request_start(const struct phr_header *headers, size_t n, int64_t *ns)
{
    static const char *const names[2] = {"x-request-start", "x-queue-start"};
    int seen[2] = {0, 0}, have[2] = {0, 0};
    int64_t stamp[2] = {0, 0};
    for (size_t h = 0; h < n; h++) {
        if (headers[h].name == NULL)
            continue;
        for (int k = 0; k < 2; k++) {
            if (headers[h].name_len != strlen(names[k]) || strncasecmp(headers[h].name, names[k], headers[h].name_len))
                continue;
            seen[k]++;
            have[k] = fd_parse_request_start_ns(headers[h].value, headers[h].value_len, &stamp[k]);
        }
    }
    int found = 0;
    for (int k = 0; k < 2; k++) {
        if (seen[k] != 1 || !have[k])
            continue;   /* a repeated header is joined with a comma on the Python side: no stamp */
        if (!found || stamp[k] < *ns)
            *ns = stamp[k];
        found = 1;
    }
    return found;
}

/* Is the peer one of the trusted networks? An IPv4-mapped IPv6 peer
 * (::ffff:a.b.c.d, a dual-stack listener's IPv4 client) also matches as its
 * IPv4 address, as FrontProxyBudgetPolicy._peer_trusted does. */
static int fd_prefix_match(const unsigned char *addr, const unsigned char *net, int prefix)
{
    int full = prefix / 8, rest = prefix % 8;
    if (memcmp(addr, net, (size_t)full) != 0)
        return 0;
    if (rest == 0)
        return 1;
    unsigned char mask = (unsigned char)(0xff << (8 - rest));
    return (addr[full] & mask) == (net[full] & mask);
}

/* `addr` of `family` (AF_INET: 4 bytes, AF_INET6: 16, network byte order). */
static int fd_address_trusted(const struct fd_config *cfg, int family, const unsigned char *addr)
{
    if (cfg->n_trusted < 0)
        return 1;
    const unsigned char *v4 = NULL, *v6 = NULL;
    if (family == AF_INET) {
        v4 = addr;
    } else if (family == AF_INET6) {
        static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        v6 = addr;
        if (memcmp(v6, mapped, 12) == 0)
            v4 = v6 + 12;
    } else {
        return 0;   /* not an IP peer: no REMOTE_ADDR on the Python side either */
    }
    for (int i = 0; i < cfg->n_trusted; i++) {
        const struct fd_net *net = &cfg->trusted[i];
        if (net->family == AF_INET && v4 && fd_prefix_match(v4, net->addr, net->prefix))
            return 1;
        if (net->family == AF_INET6 && v6 && fd_prefix_match(v6, net->addr, net->prefix))
            return 1;
    }
    return 0;
}

static int fd_peer_trusted(const struct fd_config *cfg, const struct sockaddr_storage *peer)
{
    if (peer->ss_family == AF_INET)
        return fd_address_trusted(cfg, AF_INET, (const unsigned char *)&((const struct sockaddr_in *)peer)->sin_addr);
    if (peer->ss_family == AF_INET6)
        return fd_address_trusted(cfg, AF_INET6,
                                  (const unsigned char *)&((const struct sockaddr_in6 *)peer)->sin6_addr);
    return fd_address_trusted(cfg, peer->ss_family, NULL);
}

/* upstream_wait_ns: arrival - stamp within [0, max_wait_ns]. A stamp after the
 * arrival (a proxy clock ahead of ours) is no wait, never more time. Saturating,
 * so any int64 inputs are safe (the engine's are within centuries of 1970). */
static int64_t fd_upstream_wait_ns(int64_t stamp_ns, int64_t arrival_wall_ns, int64_t max_wait_ns)
{
    int64_t wait;
    if (__builtin_sub_overflow(arrival_wall_ns, stamp_ns, &wait))
        wait = arrival_wall_ns > stamp_ns ? INT64_MAX : 0;
    if (wait < 0 || max_wait_ns <= 0)
        return 0;
    return wait < max_wait_ns ? wait : max_wait_ns;
}

/* The time c queued in a trusted front proxy before its arrival here:
 * from the stamp to the wall-clock moment of c->arrival_ns, in [0, max_upstream_ns].
 * The wall clock and the monotonic clock are read together, so the arrival
 * (monotonic) is moved onto the wall clock the stamp is on. */
static int64_t fd_upstream_ns(const struct fd_config *cfg, const struct fd_conn *c)
{
    if (!cfg->trust_request_start || !fd_peer_trusted(cfg, &c->peer))
        return 0;
    int64_t stamp;
    if (!fd_request_start(c->headers, c->num_headers, &stamp))
        return 0;
    struct timespec real;
    clock_gettime(CLOCK_REALTIME, &real);
    int64_t mono = fd_now_ns();
    int64_t arrival_wall = (int64_t)real.tv_sec * 1000000000LL + real.tv_nsec - (mono - c->arrival_ns);
    return fd_upstream_wait_ns(stamp, arrival_wall, cfg->max_upstream_ns);
}

/* --------------------------------------------------------- chunked bodies */
/* RFC 9112 section 7.1, as strictly as llhttp's strict mode reads it, with
 * nothing guessed: a chunk size is 1*HEXDIG that fits 64 bits; extensions
 * follow the grammar (BWS ";" BWS token [BWS "=" BWS (token / quoted-string)]),
 * so no BWS before the CRLF; every line ends in CRLF, never a bare LF; trailer
 * lines are field lines (token ":" field value), so the bytes of a request
 * line after "0\r\n" break the body instead of vanishing as a "trailer".
 * The trailers are read and dropped (PEP 3333 has no place for them). */

/* The non-data bytes a chunk line, or the trailer section, may take: the
 * head's own limit, so a body cannot be made of endless metadata. */
#define FD_MAX_CHUNK_META 65536

static int fd_hex(unsigned char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    ch |= 0x20;
    return ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
}

static int fd_tchar(unsigned char ch)
{
    if ((ch | 0x20) >= 'a' && (ch | 0x20) <= 'z')
        return 1;
    if (ch >= '0' && ch <= '9')
        return 1;
    return ch != 0 && strchr("!#$%&'*+-.^_`|~", ch) != NULL;
}

/* field-vchar / obs-text / SP / HTAB: what a field value may hold. */
static int fd_field_char(unsigned char ch)
{
    return ch == '\t' || (ch >= 0x20 && ch != 0x7f);
}

/* Decode the chunked bytes in buf[0..*bufsz) in place, the way
 * phr_decode_chunked does: the data is moved to the front and *bufsz becomes
 * its length. Returns -2 when the body goes on, -1 when it is broken, else the
 * number of bytes after its end, which are moved to buf + *bufsz. */
static ssize_t fd_chunked_decode(struct fd_chunked *d, char *buf, size_t *bufsz)
{
    size_t n = *bufsz, src = 0, dst = 0;
    *bufsz = 0;
    if (d->state == FD_CK_ERROR || d->state == FD_CK_DONE)
        return -1;   /* nothing may be fed after the end */
    while (src < n) {
        if (d->state == FD_CK_DATA) {
            size_t take = n - src;
            if (take > d->left)
                take = (size_t)d->left;
            memmove(buf + dst, buf + src, take);
            dst += take;
            src += take;
            d->left -= take;
            if (d->left == 0)
                d->state = FD_CK_DATA_CR;
            continue;
        }
        unsigned char ch = (unsigned char)buf[src++];
        int ws = ch == ' ' || ch == '\t';
        if (++d->meta > FD_MAX_CHUNK_META)
            goto broken;
        switch (d->state) {
        case FD_CK_SIZE:
        case FD_CK_SIZE_MORE: {
            int digit = fd_hex(ch);
            if (digit >= 0) {
                if (d->left > (UINT64_MAX >> 4))
                    goto broken;   /* does not fit: never wrap into a small size */
                d->left = d->left * 16 + (uint64_t)digit;
                d->state = FD_CK_SIZE_MORE;
            } else if (d->state == FD_CK_SIZE) {
                goto broken;
            } else if (ch == ';') {
                d->state = FD_CK_EXT_NAME_START;
            } else if (ws) {
                d->state = FD_CK_SIZE_BWS;
            } else if (ch == '\r') {
                d->state = FD_CK_SIZE_LF;
            } else {
                goto broken;
            }
            break;
        }
        case FD_CK_SIZE_BWS:
        case FD_CK_EXT_VALUE_BWS:
            if (ch == ';')
                d->state = FD_CK_EXT_NAME_START;
            else if (!ws)
                goto broken;
            break;
        case FD_CK_EXT_NAME_START:
            if (fd_tchar(ch))
                d->state = FD_CK_EXT_NAME;
            else if (!ws)
                goto broken;
            break;
        case FD_CK_EXT_NAME:
            if (fd_tchar(ch))
                break;
            if (ws)
                d->state = FD_CK_EXT_NAME_BWS;
            else if (ch == '=')
                d->state = FD_CK_EXT_VALUE_START;
            else if (ch == ';')
                d->state = FD_CK_EXT_NAME_START;
            else if (ch == '\r')
                d->state = FD_CK_SIZE_LF;
            else
                goto broken;
            break;
        case FD_CK_EXT_NAME_BWS:
            if (ch == '=')
                d->state = FD_CK_EXT_VALUE_START;
            else if (ch == ';')
                d->state = FD_CK_EXT_NAME_START;
            else if (!ws)
                goto broken;
            break;
        case FD_CK_EXT_VALUE_START:
            if (fd_tchar(ch))
                d->state = FD_CK_EXT_TOKEN;
            else if (ch == '"')
                d->state = FD_CK_EXT_QUOTED;
            else if (!ws)
                goto broken;
            break;
        case FD_CK_EXT_TOKEN:
            if (fd_tchar(ch))
                break;
            /* fall through: the token ended */
        case FD_CK_EXT_VALUE_END:
            if (ws)
                d->state = FD_CK_EXT_VALUE_BWS;
            else if (ch == ';')
                d->state = FD_CK_EXT_NAME_START;
            else if (ch == '\r')
                d->state = FD_CK_SIZE_LF;
            else
                goto broken;
            break;
        case FD_CK_EXT_QUOTED:
            if (ch == '"')
                d->state = FD_CK_EXT_VALUE_END;
            else if (ch == '\\')
                d->state = FD_CK_EXT_QUOTED_PAIR;
            else if (!fd_field_char(ch))
                goto broken;
            break;
        case FD_CK_EXT_QUOTED_PAIR:
            if (!fd_field_char(ch))
                goto broken;
            d->state = FD_CK_EXT_QUOTED;
            break;
        case FD_CK_SIZE_LF:
            if (ch != '\n')
                goto broken;
            d->state = d->left ? FD_CK_DATA : FD_CK_TRAILER_LINE;
            break;
        case FD_CK_DATA_CR:
            if (ch != '\r')
                goto broken;
            d->state = FD_CK_DATA_LF;
            break;
        case FD_CK_DATA_LF:
            if (ch != '\n')
                goto broken;
            d->state = FD_CK_SIZE;
            d->meta = 0;
            break;
        case FD_CK_TRAILER_LINE:
            if (ch == '\r')
                d->state = FD_CK_END_LF;
            else if (fd_tchar(ch))
                d->state = FD_CK_TRAILER_NAME;
            else
                goto broken;   /* obs-fold, a bare LF, a request line's space... */
            break;
        case FD_CK_TRAILER_NAME:
            if (ch == ':')
                d->state = FD_CK_TRAILER_VALUE;
            else if (!fd_tchar(ch))
                goto broken;
            break;
        case FD_CK_TRAILER_VALUE:
            if (ch == '\r')
                d->state = FD_CK_TRAILER_LF;
            else if (!fd_field_char(ch))
                goto broken;
            break;
        case FD_CK_TRAILER_LF:
            if (ch != '\n')
                goto broken;
            d->state = FD_CK_TRAILER_LINE;
            break;
        case FD_CK_END_LF: {
            if (ch != '\n')
                goto broken;
            d->state = FD_CK_DONE;
            size_t rest = n - src;
            memmove(buf + dst, buf + src, rest);
            *bufsz = dst;
            return (ssize_t)rest;
        }
        default:
            goto broken;
        }
    }
    *bufsz = dst;
    return -2;
broken:
    d->state = FD_CK_ERROR;
    return -1;
}

/* ---------------------------------------------------------- head framing */

static int fd_token_in(const char *v, size_t n, const char *token)
{
    size_t tl = strlen(token);
    size_t i = 0;
    while (i < n) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ','))
            i++;
        size_t s = i;
        while (i < n && v[i] != ',')
            i++;
        size_t e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t'))
            e--;
        if (e - s == tl && strncasecmp(v + s, token, tl) == 0)
            return 1;
    }
    return 0;
}

static int fd_name_is(const struct phr_header *h, const char *name)
{
    return h->name != NULL && h->name_len == strlen(name) && strncasecmp(h->name, name, h->name_len) == 0;
}

/* What picohttpparser lets through and RFC 9112 (read as llhttp's strict mode
 * reads it) does not: every line ends in CRLF (a bare LF is where parsers
 * disagree on where a line ends); the request line has single spaces,
 * HTTP/1.0 or 1.1, and a target in origin-form, absolute-form (http/https) or
 * "*" for OPTIONS, of visible ASCII only. CONNECT (a tunnel) and TRACE (it
 * would echo the client's credentials back) are refused: the app behind a WSGI
 * server can do neither safely. */
static int fd_request_line_ok(const struct fd_conn *c)
{
    for (size_t i = 0; i < c->head_len; i++)
        if (c->buf[i] == '\n' && (i == 0 || c->buf[i - 1] != '\r'))
            return 0;
    /* picohttpparser skips runs of spaces; its path pointer shows whether it did. */
    if (c->path != c->method + c->method_len + 1 || c->path[c->path_len + 1] != 'H')
        return 0;
    if (c->minor_version > 1)
        return 0;
    if ((c->method_len == 7 && memcmp(c->method, "CONNECT", 7) == 0) ||
        (c->method_len == 5 && memcmp(c->method, "TRACE", 5) == 0))
        return 0;
    for (size_t i = 0; i < c->path_len; i++)
        if ((unsigned char)c->path[i] <= 0x20 || (unsigned char)c->path[i] >= 0x7f)
            return 0;
    if (c->path[0] == '/')
        return 1;
    if (c->path_len == 1 && c->path[0] == '*')
        return c->method_len == 7 && memcmp(c->method, "OPTIONS", 7) == 0;
    return (c->path_len > 7 && strncasecmp(c->path, "http://", 7) == 0) ||
           (c->path_len > 8 && strncasecmp(c->path, "https://", 8) == 0);
}

/* A Host value is an authority's host and port (RFC 3986 reg-name, IP
 * literal, ':' port) or empty: no spaces, no userinfo, no path. */
static int fd_host_ok(const char *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)v[i];
        if (!(((ch | 0x20) >= 'a' && (ch | 0x20) <= 'z') || (ch >= '0' && ch <= '9') ||
              (ch != 0 && strchr("-._~%!$&'()*+,;=:[]", ch) != NULL)))
            return 0;
    }
    return 1;
}

/* Parse the head in c->buf. Returns 1 complete, 0 incomplete, -1 malformed or ambiguous. */
static int fd_parse_head(struct fd_conn *c, size_t last_len)
{
    c->num_headers = FD_MAX_HEADERS;
    int r = phr_parse_request(c->buf, c->len, &c->method, &c->method_len, &c->path, &c->path_len, &c->minor_version,
                              c->headers, &c->num_headers, last_len);
    if (r == -2)
        return 0;
    if (r < 0)
        return -1;
    c->head_len = (size_t)r;
    c->content_length = -1;
    c->chunked = 0;
    c->expect_continue = 0;
    if (!fd_request_line_ok(c))
        return -1;
    int seen_te = 0, connection_close = 0, connection_keep = 0, hosts = 0;
    for (size_t i = 0; i < c->num_headers; i++) {
        const struct phr_header *h = &c->headers[i];
        if (h->name == NULL || h->name_len == 0)
            return -1;   /* obsolete line folding: refused, never guessed at */
        if (fd_name_is(h, "content-length")) {
            if (!fd_all_digits(h->value, h->value_len) || h->value_len > 18)
                return -1;
            int64_t v = 0;
            for (size_t k = 0; k < h->value_len; k++)
                v = v * 10 + (h->value[k] - '0');
            if (c->content_length >= 0 && c->content_length != v)
                return -1;
            c->content_length = v;
        } else if (fd_name_is(h, "transfer-encoding")) {
            if (seen_te || h->value_len != 7 || strncasecmp(h->value, "chunked", 7) != 0)
                return -1;
            seen_te = 1;
        } else if (fd_name_is(h, "connection")) {
            connection_close |= fd_token_in(h->value, h->value_len, "close");
            connection_keep |= fd_token_in(h->value, h->value_len, "keep-alive");
        } else if (fd_name_is(h, "host")) {
            /* RFC 9112 section 3.2: two Hosts, or one that is no authority, are a 400 (never joined). */
            if (++hosts > 1 || !fd_host_ok(h->value, h->value_len))
                return -1;
        } else if (fd_name_is(h, "expect")) {
            if (h->value_len == 12 && strncasecmp(h->value, "100-continue", 12) == 0)
                c->expect_continue = 1;
        }
    }
    if (hosts == 0 && c->minor_version >= 1)
        return -1;   /* RFC 9112 section 3.2: an HTTP/1.1 request without Host is a 400 */
    if (seen_te) {
        if (c->content_length >= 0 || c->minor_version == 0)
            return -1;
        c->chunked = 1;
    }
    if (c->minor_version >= 1)
        c->client_keep_alive = !connection_close;
    else
        c->client_keep_alive = connection_keep && !connection_close;
    return 1;
}

static int fd_has_body(const struct fd_conn *c)
{
    return c->chunked || c->content_length > 0;
}

enum fd_head_verdict { FD_HEAD_PARTIAL, FD_HEAD_COMPLETE, FD_HEAD_BAD, FD_HEAD_TOO_LARGE };

/* How the head in c->buf is answered. The limit holds for the head however it
 * arrived: a head finished by a later read is as large as one read at once. */
static enum fd_head_verdict fd_judge_head(struct fd_conn *c, size_t max_head, size_t last_len)
{
    int r = fd_parse_head(c, last_len);
    if (r == 1)
        return c->head_len > max_head ? FD_HEAD_TOO_LARGE : FD_HEAD_COMPLETE;
    if (r < 0)
        return FD_HEAD_BAD;
    return c->len >= max_head ? FD_HEAD_TOO_LARGE : FD_HEAD_PARTIAL;
}

/* A worker starts on c: its body is read from just after the head. */
static void fd_conn_start_body(struct fd_conn *c)
{
    c->pos = c->head_len;
    c->body_left = c->chunked ? 0 : (c->content_length > 0 ? c->content_length : 0);
    c->body_done = !fd_has_body(c);
    c->body_error = 0;
    c->write_until = 0;
    atomic_store_explicit(&c->io_waited_ns, 0, memory_order_relaxed);
    memset(&c->decoder, 0, sizeof c->decoder);
    c->cbuf_pos = c->cbuf_len = 0;
}

/* ----------------------------------------------------------- connections */

static void fd_conn_free(struct fd_server *srv, struct fd_conn *c)
{
    if (c->fd >= 0) {
        close(c->fd);
        fd_count(&srv->open_connections, -1);
    }
    free(c->buf);
    free(c->cbuf);
    free(c);
}

static int fd_send_all_nb(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void fd_wake(struct fd_server *srv)
{
    uint64_t one = 1;
    ssize_t ignored = write(srv->evfd, &one, sizeof one);
    (void)ignored;
}

/* Forget the head just answered, keeping any pipelined bytes after it. */
static void fd_conn_reset_for_next(struct fd_conn *c, size_t consumed)
{
    if (consumed < c->len) {
        memmove(c->buf, c->buf + consumed, c->len - consumed);
        /* The next request is here already: it arrived with the read that brought it. */
        c->arrival_ns = c->last_read_ns;
        c->arrival_from_kernel = 0;
    }
    c->len -= consumed;
    c->head_len = 0;
    c->pos = 0;
    c->num_headers = 0;
    if (c->len == 0) {
        /* An idle kept-alive connection holds no buffer: about 3.5 KiB each, not 20. */
        free(c->buf);
        c->buf = NULL;
        c->cap = 0;
    }
    free(c->cbuf);
    c->cbuf = NULL;
    c->cbuf_cap = c->cbuf_pos = c->cbuf_len = 0;
}

/* --------------------------------------------------- the line's policies */
/* The admission line is two lists: critical requests (served first, FIFO
 * among them) and normal ones (served per cfg.order). What a policy decides
 * (CoDel's standing line and sojourn limit, the expected service time, the
 * Vegas limit, whether a class may start) is computed by core/prazo_policy.h,
 * exactly as the queue's C twin computes it; this section only applies it to
 * the engine's lists, under srv->mutex. */

static inline int64_t fd_waiting(const struct fd_server *srv)
{
    return srv->line.count + srv->crit.count;
}

/* The doomed-work skip's expected service time now (0: no skip). Under mutex. */
static inline int64_t fd_expected(const struct fd_server *srv)
{
    if (srv->cfg.expected_service_ns <= 0 && srv->cfg.expected_quantile_permille <= 0)
        return 0;
    return prazo_service_estimate_ns(&srv->estimate);
}

/* Arrivals are refused (or make room) once running + waiting reach this. */
static inline int fd_line_full(const struct fd_server *srv)
{
    return srv->in_flight + fd_waiting(srv) >= srv->limit + (int64_t)srv->cfg.max_queue;
}

/* Take c out of the line it waits in, to drop it with `answer` (counted now,
 * so stats() never sees it in two places); appended to the list at *tail. */
static void fd_line_drop(struct fd_server *srv, struct fd_conn *c, int answer, struct fd_conn ***tail)
{
    fd_list_remove(c->critical ? &srv->crit : &srv->line, c);
    c->drop_answer = answer;
    switch (answer) {
    case FD_A_EXPIRED_IN_QUEUE: fd_count(&srv->expired_in_queue, 1); break;
    case FD_A_INSUFFICIENT_BUDGET: fd_count(&srv->insufficient_budget, 1); break;
    case FD_A_SHED: fd_count(&srv->shed, 1); break;
    default: fd_count(&srv->evicted, 1); break;
    }
    c->next = NULL;
    **tail = c;
    *tail = &c->next;
}

/* order="adaptive": shed, from the old end of each list, every entry that has
 * waited longer than CoDel allows now. */
static void fd_line_shed_stale(struct fd_server *srv, int64_t now, struct fd_conn ***tail)
{
    if (srv->cfg.order != FD_ORDER_ADAPTIVE)
        return;
    int64_t max_sojourn = prazo_codel_max_sojourn(&srv->codel, now);
    struct fd_list *lists[2] = {&srv->crit, &srv->line};
    for (int i = 0; i < 2; i++)
        while (lists[i]->head && now - lists[i]->head->queued_ns > max_sojourn)
            fd_line_drop(srv, lists[i]->head, FD_A_SHED, tail);
}

/* The entry a free worker would start now, or NULL: a critical one when its
 * class may start, else a normal one (FIFO, LIFO, or LIFO while the line
 * stands under "adaptive") when the normal class may start. */
static struct fd_conn *fd_line_pick(struct fd_server *srv, int64_t now)
{
    int64_t critical_active = srv->critical_in_flight + srv->crit.count;
    int64_t reserved = srv->cfg.reserved;
    if (srv->crit.head && prazo_priority_may_start(srv->in_flight, srv->limit, reserved, 1, critical_active))
        return srv->crit.head;
    if (!srv->line.head || !prazo_priority_may_start(srv->in_flight, srv->limit, reserved, 0, critical_active))
        return NULL;
    int lifo = srv->cfg.order == FD_ORDER_LIFO ||
               (srv->cfg.order == FD_ORDER_ADAPTIVE && prazo_codel_standing(&srv->codel, now));
    return lifo ? srv->line.tail : srv->line.head;
}

/* Drop what may no longer start at now: expired or doomed anywhere in the
 * line, and (adaptive) stale entries. Returns when to look again (INT64_MAX: never). */
static int64_t fd_line_sweep(struct fd_server *srv, int64_t now, struct fd_conn ***tail)
{
    int64_t next = INT64_MAX;
    int64_t expected = fd_expected(srv);
    fd_line_shed_stale(srv, now, tail);
    struct fd_list *lists[2] = {&srv->crit, &srv->line};
    for (int i = 0; i < 2; i++) {
        for (struct fd_conn *c = lists[i]->head, *n; c; c = n) {
            n = c->next;
            int verdict = prazo_deadline_verdict(now, c->deadline_ns, expected);
            if (verdict == PRAZO_VERDICT_EXPIRED) {
                fd_line_drop(srv, c, FD_A_EXPIRED_IN_QUEUE, tail);
                continue;
            }
            if (verdict == PRAZO_VERDICT_INSUFFICIENT) {
                fd_line_drop(srv, c, FD_A_INSUFFICIENT_BUDGET, tail);
                continue;
            }
            int64_t at = expected > 0 ? prazo_effective_deadline_ns(c->deadline_ns, expected) : c->deadline_ns;
            if (at < next)
                next = at;
        }
        if (srv->cfg.order == FD_ORDER_ADAPTIVE && lists[i]->head) {
            /* The oldest entry is shed first; the bound catches the moment the line starts standing. */
            int64_t at = lists[i]->head->queued_ns + prazo_codel_max_sojourn(&srv->codel, now) + 1;
            if (now + srv->codel.target_ns < at)
                at = now + srv->codel.target_ns;
            if (at < next)
                next = at;
        }
    }
    return next;
}

/* Entries left the line without a place: shutdown may be waiting for an idle
 * line, and a dropped critical waiter may let parked workers lend its class's
 * reserved places again. Under mutex. */
static void fd_line_dropped_wake(struct fd_server *srv)
{
    pthread_cond_broadcast(&srv->idle);
    if (fd_waiting(srv))
        pthread_cond_broadcast(&srv->ready);
}

/* 1 when the raw path, percent-decoded as urllib's unquote_to_bytes does it
 * (a '%' not followed by two hex digits stays as it is), is `want`. */
static int fd_decoded_path_is(const char *raw, size_t n, const char *want, size_t want_len)
{
    size_t j = 0;
    for (size_t i = 0; i < n; i++, j++) {
        unsigned char ch = (unsigned char)raw[i];
        int hi = ch == '%' && i + 2 < n ? fd_hex((unsigned char)raw[i + 1]) : -1;
        int lo = hi >= 0 ? fd_hex((unsigned char)raw[i + 2]) : -1;
        if (lo >= 0) {
            ch = (unsigned char)(hi * 16 + lo);
            i += 2;
        }
        if (j >= want_len || (unsigned char)want[j] != ch)
            return 0;
    }
    return j == want_len;
}

/* Is this head of the critical class? Its path (what the workers' PATH_INFO
 * holds: before '?', percent-decoded) is one of cfg.critical_paths, or
 * cfg.critical_header says "critical". */
static int fd_is_critical(const struct fd_server *srv, const struct fd_conn *c)
{
    if (srv->cfg.critical_header) {
        for (size_t h = 0; h < c->num_headers; h++) {
            const struct phr_header *hd = &c->headers[h];
            if (hd->name == NULL || hd->name_len != srv->cfg.critical_header_len ||
                strncasecmp(hd->name, srv->cfg.critical_header, hd->name_len) != 0)
                continue;
            const char *v = hd->value;
            size_t n = hd->value_len;
            if (fd_strip(&v, &n) && n == 8 && strncasecmp(v, "critical", 8) == 0)
                return 1;
        }
    }
    if (srv->cfg.critical_paths) {
        const char *path = c->path;
        size_t len = c->path_len;
        /* absolute-form: the path follows the authority, as the workers' PATH_INFO takes it */
        size_t skip = 0;
        if (len >= 7 && memcmp(path, "http://", 7) == 0)
            skip = 7;
        else if (len >= 8 && memcmp(path, "https://", 8) == 0)
            skip = 8;
        if (skip) {
            const char *slash = memchr(path + skip, '/', len - skip);
            len = slash ? len - (size_t)(slash - path) : 0;
            path = slash;
        }
        const char *q = len ? memchr(path, '?', len) : NULL;
        if (q)
            len = (size_t)(q - path);
        for (const char *p = srv->cfg.critical_paths, *end = p + srv->cfg.critical_paths_len; len && p < end;) {
            size_t plen = strlen(p);
            if (fd_decoded_path_is(path, len, p, plen))
                return 1;
            p += plen + 1;
        }
    }
    return 0;
}

/* A finished request's service time: the learned estimate and Vegas take it. Under mutex. */
static void fd_line_sample(struct fd_server *srv, int64_t service_ns)
{
    if (service_ns < 0)
        service_ns = 0;
    if (srv->cfg.expected_quantile_permille > 0) {
        prazo_service_estimate_sample(&srv->estimate, service_ns);
        int64_t expected = fd_expected(srv);
        if (expected != atomic_load_explicit(&srv->expected_now, memory_order_relaxed)) {
            atomic_store_explicit(&srv->expected_now, expected, memory_order_relaxed);
            if (fd_waiting(srv))
                fd_wake(srv);   /* the I/O thread's sweep computes each waiter's effective deadline anew */
        }
    }
    if (srv->cfg.vegas) {
        srv->limit = prazo_vegas_sample(&srv->vegas, service_ns, srv->in_flight);
    }
}

/* ------------------------------------------------------ the I/O thread */

static void fd_io_arm_head(struct fd_server *srv, struct fd_conn *c, int64_t now);
static void fd_io_answer_dropped(struct fd_server *srv, struct fd_conn *dropped, int64_t now);
static int fd_io_try_head(struct fd_server *srv, struct fd_conn *c, int64_t now, size_t last_len);

static void fd_io_close(struct fd_server *srv, struct fd_conn *c)
{
    if (c->state == FD_READING)
        fd_list_remove(&srv->heads, c);
    else if (c->state == FD_DRAINING)
        fd_list_remove(&srv->lingering, c);
    c->state = FD_CLOSED;
    fd_conn_free(srv, c);   /* close() also takes it out of epoll */
}

/* A polite close: shut the write side, read and drop what the client still sends. */
static void fd_io_linger(struct fd_server *srv, struct fd_conn *c, int64_t now)
{
    if (c->state == FD_READING)
        fd_list_remove(&srv->heads, c);
    if (srv->stopping || shutdown(c->fd, SHUT_WR) != 0) {
        c->state = FD_CLOSED;
        fd_conn_free(srv, c);
        return;
    }
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
    if (epoll_ctl(srv->epfd, EPOLL_CTL_MOD, c->fd, &ev) != 0 && epoll_ctl(srv->epfd, EPOLL_CTL_ADD, c->fd, &ev) != 0) {
        c->state = FD_CLOSED;
        fd_conn_free(srv, c);
        return;
    }
    /* Each lingering socket is a descriptor and a buffer held for a client
     * that was already answered: a flood of refused connections may not grow
     * them without bound. The oldest has had the longest to read its answer.
     * Its memory outlives this turn: an event for it may still wait in the
     * batch being handled, and is skipped by its state. */
    while (srv->lingering.count >= srv->cfg.max_lingering && srv->lingering.head) {
        struct fd_conn *old = srv->lingering.head;
        fd_list_remove(&srv->lingering, old);
        close(old->fd);
        old->fd = -1;
        fd_count(&srv->open_connections, -1);
        old->state = FD_CLOSED;
        old->next = srv->graveyard;
        srv->graveyard = old;
    }
    c->state = FD_DRAINING;
    c->drained = 0;
    c->timer_ns = now + srv->cfg.linger_ns;
    fd_list_push(&srv->lingering, c);
}

/* Write a canned answer; then keep the connection for its next head, or close it politely.
 * The connection is out of every list (or FD_READING) when this is called. */
static void fd_io_answer(struct fd_server *srv, struct fd_conn *c, int answer, int64_t now)
{
    int keep = answer < FD_A_COUNT_KEEPABLE && answer != FD_A_SHUTTING_DOWN && c->head_len && c->client_keep_alive &&
               !fd_has_body(c) && !srv->draining;
    const char *bytes = srv->cfg.answer[answer][keep];
    size_t len = srv->cfg.answer_len[answer][keep];
    if (fd_send_all_nb(c->fd, bytes, len) != 0) {
        if (c->state == FD_READING)
            fd_list_remove(&srv->heads, c);
        c->state = FD_CLOSED;
        fd_conn_free(srv, c);
        return;
    }
    if (!keep) {
        fd_io_linger(srv, c, now);
        return;
    }
    size_t consumed = c->head_len;
    fd_conn_reset_for_next(c, consumed);
    if (c->state != FD_READING) {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (epoll_ctl(srv->epfd, EPOLL_CTL_ADD, c->fd, &ev) != 0) {
            c->state = FD_CLOSED;
            fd_conn_free(srv, c);
            return;
        }
        c->state = FD_READING;
        c->timer_ns = now + srv->cfg.header_timeout_ns;
        fd_list_push(&srv->heads, c);
    } else {
        fd_list_remove(&srv->heads, c);
        c->timer_ns = now + srv->cfg.header_timeout_ns;
        fd_list_push(&srv->heads, c);
    }
    if (c->len)
        (void)fd_io_try_head(srv, c, now, 0);
}

/* Refuse a head on arrival. Each arrival's offered and its outcome are counted
 * together under the mutex, which stats() holds while it reads: the counters
 * balance in every snapshot, not only once the server is idle. */
static void fd_io_refuse_on_arrival(struct fd_server *srv, struct fd_conn *c, _Atomic int64_t *outcome, int answer,
                                    int64_t now)
{
    pthread_mutex_lock(&srv->mutex);
    fd_count(&srv->offered, 1);
    fd_count(outcome, 1);
    pthread_mutex_unlock(&srv->mutex);
    fd_io_answer(srv, c, answer, now);
}

/* A complete head: decide. */
static void fd_io_admit(struct fd_server *srv, struct fd_conn *c, int64_t now)
{
    double ms = 0.0;
    int invalid, source;
    int have = fd_incoming_budget(c->headers, c->num_headers, &ms, &invalid, &source);
    c->budget_source = source;
    c->budget_invalid = invalid;
    /* A trusted front proxy's queue time comes off here, before the line sees
     * the deadline: a budget used up in the proxy is answered 504 below, and
     * the line expires and orders by the corrected deadline. */
    c->upstream_ns = fd_upstream_ns(&srv->cfg, c);
    if (c->upstream_ns > 0)
        fd_count(&srv->upstream_stamps, 1);
    c->deadline_ns = fd_deadline_for(srv->cfg.default_budget_ms, srv->cfg.max_budget_ms, have, ms, c->arrival_ns,
                                     c->upstream_ns);
    if (srv->draining) {
        fd_io_refuse_on_arrival(srv, c, &srv->shutting_down, FD_A_SHUTTING_DOWN, now);
        return;
    }
    int verdict = prazo_deadline_verdict(now, c->deadline_ns,
                                         atomic_load_explicit(&srv->expected_now, memory_order_relaxed));
    if (verdict == PRAZO_VERDICT_EXPIRED) {
        fd_io_refuse_on_arrival(srv, c, &srv->expired_on_arrival, FD_A_EXPIRED_ON_ARRIVAL, now);
        return;
    }
    if (verdict == PRAZO_VERDICT_INSUFFICIENT) {
        fd_io_refuse_on_arrival(srv, c, &srv->insufficient_budget, FD_A_INSUFFICIENT_BUDGET, now);
        return;
    }
    c->critical = fd_is_critical(srv, c);
    struct fd_conn *dropped = NULL, **tail = &dropped;
    int refused = 0;
    pthread_mutex_lock(&srv->mutex);
    fd_count(&srv->offered, 1);
    if (srv->draining) {
        refused = 1;
    } else if (fd_line_full(srv)) {
        /* A full standing line makes room by shedding its stale entries first;
         * a critical arrival then pushes out the newest normal waiter. */
        fd_line_shed_stale(srv, now, &tail);
        if (fd_line_full(srv)) {
            if (c->critical && srv->line.tail)
                fd_line_drop(srv, srv->line.tail, FD_A_EVICTED, &tail);
            else
                refused = 1;
        }
    }
    if (!refused) {
        fd_list_remove(&srv->heads, c);
        epoll_ctl(srv->epfd, EPOLL_CTL_DEL, c->fd, NULL);
        c->state = FD_QUEUED;
        c->queued_ns = now;
        if (fd_waiting(srv) == 0)
            prazo_codel_note_empty(&srv->codel, now);
        fd_list_push(c->critical ? &srv->crit : &srv->line, c);
        /* Waiting means: in line beyond the places free to take it at once. */
        int64_t free_places = srv->limit - srv->in_flight;
        int64_t waiting = fd_waiting(srv) - (free_places > 0 ? free_places : 0);
        if (waiting > fd_read_counter(&srv->peak_queued))
            atomic_store_explicit(&srv->peak_queued, waiting, memory_order_relaxed);
        fd_count(&srv->admitted, 1);
        pthread_cond_signal(&srv->ready);
    }
    else
        fd_count(&srv->rejected_full, 1);
    if (dropped)
        fd_line_dropped_wake(srv);
    pthread_mutex_unlock(&srv->mutex);
    fd_io_answer_dropped(srv, dropped, now);
    if (refused)
        fd_io_answer(srv, c, FD_A_QUEUE_FULL, now);
}

/* 1 while the head is still incomplete (c stays with the caller), 0 once c was
 * admitted, answered or closed (the caller must not touch it again). */
static int fd_io_try_head(struct fd_server *srv, struct fd_conn *c, int64_t now, size_t last_len)
{
    switch (fd_judge_head(c, srv->cfg.max_head, last_len)) {
    case FD_HEAD_COMPLETE:
        fd_io_admit(srv, c, now);
        return 0;
    case FD_HEAD_BAD:
        c->head_len = 0;
        fd_count(&srv->bad_requests, 1);
        fd_io_answer(srv, c, FD_A_BAD_REQUEST, now);
        return 0;
    case FD_HEAD_TOO_LARGE:
        c->head_len = 0;
        fd_count(&srv->heads_too_large, 1);
        fd_io_answer(srv, c, FD_A_HEAD_TOO_LARGE, now);
        return 0;
    default:
        return 1;
    }
}

/* Read what arrived; the first bytes of a head take the kernel's receive stamp. */
static void fd_io_read_head(struct fd_server *srv, struct fd_conn *c, int64_t now)
{
    for (;;) {
        if (c->cap - c->len < 1024) {
            size_t cap = c->cap ? c->cap * 2 : FD_READ_CHUNK;
            if (cap > srv->cfg.max_head + FD_READ_CHUNK)
                cap = srv->cfg.max_head + FD_READ_CHUNK;
            if (cap <= c->len) {
                (void)fd_io_try_head(srv, c, now, 0);
                return;
            }
            char *nb = realloc(c->buf, cap);
            if (!nb) {
                fd_io_close(srv, c);
                return;
            }
            c->buf = nb;
            c->cap = cap;
        }
        ssize_t n;
        int first = c->len == 0;
        if (first) {
            char control[CMSG_SPACE(sizeof(struct timespec))];
            struct iovec iov = {.iov_base = c->buf, .iov_len = c->cap};
            struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                                 .msg_controllen = sizeof control};
            n = recvmsg(c->fd, &msg, MSG_DONTWAIT);
            c->arrival_ns = now;
            c->arrival_from_kernel = 0;
            if (n > 0) {
                for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
                    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_TIMESTAMPNS) {
                        struct timespec stamp, real;
                        memcpy(&stamp, CMSG_DATA(cm), sizeof stamp);
                        clock_gettime(CLOCK_REALTIME, &real);
                        int64_t age = ((int64_t)real.tv_sec - stamp.tv_sec) * 1000000000LL +
                                      (real.tv_nsec - stamp.tv_nsec);
                        /* The wall clock may have stepped: believe only a sane age. */
                        if (age >= 0 && age < 60LL * 1000000000LL) {
                            c->arrival_ns = fd_now_ns() - age;
                            c->arrival_from_kernel = 1;
                            fd_count(&srv->kernel_stamps, 1);
                        }
                    }
                }
            }
        } else {
            n = recv(c->fd, c->buf + c->len, c->cap - c->len, MSG_DONTWAIT);
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (n <= 0) {
            fd_io_close(srv, c);
            return;
        }
        size_t last = c->len;
        c->len += (size_t)n;
        c->last_read_ns = now;
        if (!fd_io_try_head(srv, c, now, last))
            return;
        if ((size_t)n < c->cap - last)
            return;   /* all there was; epoll says when more comes */
    }
}

static void fd_io_drain(struct fd_server *srv, struct fd_conn *c)
{
    char sink[FD_READ_CHUNK];
    for (;;) {
        ssize_t n = recv(c->fd, sink, sizeof sink, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        c->drained += n > 0 ? n : 0;
        if (n <= 0 || c->drained >= srv->cfg.max_drain_bytes) {
            fd_io_close(srv, c);
            return;
        }
    }
}

static void fd_io_accept(struct fd_server *srv, int lfd, int64_t now)
{
    for (;;) {
        struct fd_conn *c = calloc(1, sizeof *c);
        if (!c)
            return;
        c->peer_len = sizeof c->peer;
        int fd = accept4(lfd, (struct sockaddr *)&c->peer, &c->peer_len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            int err = errno;
            free(c);
            if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
                /* The listener stays readable: without a pause epoll would spin on it. */
                for (int i = 0; i < srv->n_listen; i++)
                    if (srv->listen_fds[i] >= 0)
                        epoll_ctl(srv->epfd, EPOLL_CTL_DEL, srv->listen_fds[i], NULL);
                srv->accept_paused_until = now + 100000000LL;
            }
            return;   /* EAGAIN & co: epoll tells us again */
        }
        c->fd = fd;
        /* TCP_NODELAY and SO_TIMESTAMPNS come from the listener (Linux copies them on
         * accept): no system call here for them, the refusal path is the hot one. */
        fd_count(&srv->accepted, 1);
        fd_count(&srv->open_connections, 1);
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (epoll_ctl(srv->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
            fd_conn_free(srv, c);
            continue;
        }
        c->state = FD_READING;
        c->timer_ns = now + srv->cfg.header_timeout_ns;
        fd_list_push(&srv->heads, c);
        /* The head is often here already: read it now rather than after another epoll_wait. */
        fd_io_read_head(srv, c, now);
    }
}

static void fd_io_arm_head(struct fd_server *srv, struct fd_conn *c, int64_t now)
{
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
    if (epoll_ctl(srv->epfd, EPOLL_CTL_ADD, c->fd, &ev) != 0) {
        c->state = FD_CLOSED;
        fd_conn_free(srv, c);
        return;
    }
    c->state = FD_READING;
    c->timer_ns = now + srv->cfg.header_timeout_ns;
    fd_list_push(&srv->heads, c);
    if (c->len)
        (void)fd_io_try_head(srv, c, now, 0);
}

static void fd_io_close_listeners(struct fd_server *srv)
{
    if (atomic_exchange(&srv->listeners_closed, 1))
        return;
    for (int i = 0; i < srv->n_listen; i++) {
        epoll_ctl(srv->epfd, EPOLL_CTL_DEL, srv->listen_fds[i], NULL);
        close(srv->listen_fds[i]);
        srv->listen_fds[i] = -1;
    }
}

/* Connections back from the workers: the next head, a refusal to finish, or the end. */
static void fd_io_take_returned(struct fd_server *srv, int64_t now)
{
    pthread_mutex_lock(&srv->mutex);
    struct fd_conn *c = srv->returned;
    srv->returned = NULL;
    pthread_mutex_unlock(&srv->mutex);
    while (c) {
        struct fd_conn *next = c->next;
        c->next = c->prev = NULL;
        int verdict = c->verdict;
        if (verdict == 1 && !srv->draining && !srv->stopping) {
            fd_io_arm_head(srv, c, now);
        } else if (verdict == 0 && !srv->stopping) {
            c->state = FD_RUNNING;   /* in no list yet: fd_io_linger adds it to lingering */
            fd_io_linger(srv, c, now);
        } else {
            c->state = FD_CLOSED;
            fd_conn_free(srv, c);
        }
        c = next;
    }
}

/* Refuse connections dropped from the line, each with its drop_answer. */
static void fd_io_answer_dropped(struct fd_server *srv, struct fd_conn *dropped, int64_t now)
{
    while (dropped) {
        struct fd_conn *c = dropped;
        dropped = c->next;
        c->next = NULL;
        fd_io_answer(srv, c, c->drop_answer, now);
    }
}

/* Waiting connections that may no longer start (deadline passed, too little
 * budget left for the expected service time, or shed by CoDel): answered now,
 * without a worker. Returns when to look again (INT64_MAX when never). */
static int64_t fd_io_expire_line(struct fd_server *srv, int64_t now)
{
    struct fd_conn *dropped = NULL, **tail = &dropped;
    pthread_mutex_lock(&srv->mutex);
    int64_t next = fd_line_sweep(srv, now, &tail);
    if (dropped)
        fd_line_dropped_wake(srv);
    pthread_mutex_unlock(&srv->mutex);
    fd_io_answer_dropped(srv, dropped, now);
    return next;
}

static void *fd_io_main(void *arg)
{
    struct fd_server *srv = arg;
    struct epoll_event events[128];
    int drained_seen = 0;
    for (;;) {
        while (srv->graveyard) {
            struct fd_conn *c = srv->graveyard;
            srv->graveyard = c->next;
            fd_conn_free(srv, c);
        }
        int64_t now = fd_now_ns();
        pthread_mutex_lock(&srv->mutex);
        int draining = srv->draining, stopping = srv->stopping;
        pthread_mutex_unlock(&srv->mutex);
        if (draining && !drained_seen) {
            drained_seen = 1;
            fd_io_close_listeners(srv);
            /* Connections that have sent nothing of a next request are done. */
            for (struct fd_conn *c = srv->heads.head, *n; c; c = n) {
                n = c->next;
                if (c->len == 0)
                    fd_io_close(srv, c);
            }
        }
        if (stopping) {
            fd_io_close_listeners(srv);
            /* What still waits is answered 503 shutting-down; then every connection closes. */
            pthread_mutex_lock(&srv->mutex);
            struct fd_conn *waiting = NULL, **tail = &waiting;
            struct fd_list *lists[2] = {&srv->crit, &srv->line};
            for (int i = 0; i < 2; i++) {
                if (lists[i]->head) {
                    *tail = lists[i]->head;
                    tail = &lists[i]->tail->next;
                }
                fd_count(&srv->shutting_down, lists[i]->count);
                lists[i]->head = lists[i]->tail = NULL;
                lists[i]->count = 0;
            }
            pthread_cond_broadcast(&srv->idle);
            pthread_mutex_unlock(&srv->mutex);
            while (waiting) {
                struct fd_conn *c = waiting;
                waiting = c->next;
                fd_send_all_nb(c->fd, srv->cfg.answer[FD_A_SHUTTING_DOWN][0], srv->cfg.answer_len[FD_A_SHUTTING_DOWN][0]);
                c->state = FD_CLOSED;
                fd_conn_free(srv, c);
            }
            fd_io_take_returned(srv, now);
            pthread_mutex_lock(&srv->mutex);
            srv->io_done = 1;   /* from here on workers free what they finish */
            struct fd_conn *late = srv->returned;
            srv->returned = NULL;
            pthread_mutex_unlock(&srv->mutex);
            while (late) {
                struct fd_conn *c = late;
                late = c->next;
                fd_conn_free(srv, c);
            }
            while (srv->heads.head)
                fd_io_close(srv, srv->heads.head);
            while (srv->lingering.head)
                fd_io_close(srv, srv->lingering.head);
            return NULL;
        }
        fd_io_take_returned(srv, now);
        if (srv->accept_paused_until && now >= srv->accept_paused_until && !draining) {
            srv->accept_paused_until = 0;
            for (int i = 0; i < srv->n_listen; i++) {
                struct epoll_event lev = {.events = EPOLLIN, .data.ptr = &srv->listen_fds[i]};
                if (srv->listen_fds[i] >= 0)
                    epoll_ctl(srv->epfd, EPOLL_CTL_ADD, srv->listen_fds[i], &lev);
            }
        }
        while (srv->heads.head && srv->heads.head->timer_ns <= now) {
            struct fd_conn *c = srv->heads.head;
            if (c->len == 0) {
                fd_io_close(srv, c);   /* silent or idle kept-alive: nothing to answer */
            } else {
                fd_count(&srv->header_timeouts, 1);
                c->head_len = 0;
                fd_io_answer(srv, c, FD_A_HEADER_TIMEOUT, now);
            }
        }
        while (srv->lingering.head && srv->lingering.head->timer_ns <= now)
            fd_io_close(srv, srv->lingering.head);
        int64_t next = fd_io_expire_line(srv, now);
        atomic_store_explicit(&srv->pending_heads, srv->heads.count, memory_order_relaxed);
        atomic_store_explicit(&srv->lingering_now, srv->lingering.count, memory_order_relaxed);
        if (srv->heads.head && srv->heads.head->timer_ns < next)
            next = srv->heads.head->timer_ns;
        if (srv->lingering.head && srv->lingering.head->timer_ns < next)
            next = srv->lingering.head->timer_ns;
        if (srv->accept_paused_until && srv->accept_paused_until < next)
            next = srv->accept_paused_until;
        int timeout_ms = 1000;
        if (next != INT64_MAX) {
            int64_t wait = next - fd_now_ns();
            int64_t ms = wait <= 0 ? 0 : (wait + 999999) / 1000000;
            if (ms < timeout_ms)
                timeout_ms = (int)ms;
        }
        int n = epoll_wait(srv->epfd, events, 128, timeout_ms);
        now = fd_now_ns();
        for (int i = 0; i < n; i++) {
            void *ptr = events[i].data.ptr;
            if (ptr == (void *)&srv->evfd) {
                uint64_t value;
                ssize_t ignored = read(srv->evfd, &value, sizeof value);
                (void)ignored;
                continue;
            }
            int listener = -1;
            for (int k = 0; k < srv->n_listen; k++)
                if (ptr == (void *)&srv->listen_fds[k])
                    listener = k;
            if (listener >= 0) {
                if (srv->listen_fds[listener] >= 0)
                    fd_io_accept(srv, srv->listen_fds[listener], now);
                continue;
            }
            struct fd_conn *c = ptr;
            if (c->state == FD_READING)
                fd_io_read_head(srv, c, now);
            else if (c->state == FD_DRAINING)
                fd_io_drain(srv, c);
        }
    }
}

/* ------------------------------------------------- the server's lifecycle */

static struct fd_server *fd_server_new(const struct fd_config *cfg, const int *listen_fds, int n_listen)
{
    if (n_listen < 1 || n_listen > 8)
        return NULL;
    struct fd_server *srv = calloc(1, sizeof *srv);
    if (!srv)
        return NULL;
    srv->cfg = *cfg;
    for (int a = 0; a < FD_A_COUNT; a++) {
        for (int k = 0; k < 2; k++) {
            srv->cfg.answer[a][k] = NULL;
            if (cfg->answer[a][k] == NULL)
                continue;
            char *copy = malloc(cfg->answer_len[a][k]);
            if (!copy)
                return NULL;
            memcpy(copy, cfg->answer[a][k], cfg->answer_len[a][k]);
            srv->cfg.answer[a][k] = copy;
        }
        if (srv->cfg.answer[a][1] == NULL) {   /* only the close variant given */
            srv->cfg.answer[a][1] = srv->cfg.answer[a][0];
            srv->cfg.answer_len[a][1] = srv->cfg.answer_len[a][0];
        }
    }
    srv->cfg.critical_header = NULL;
    srv->cfg.critical_paths = NULL;
    if (cfg->critical_header && cfg->critical_header_len) {
        char *copy = malloc(cfg->critical_header_len);
        if (!copy)
            return NULL;
        memcpy(copy, cfg->critical_header, cfg->critical_header_len);
        srv->cfg.critical_header = copy;
    }
    if (cfg->critical_paths && cfg->critical_paths_len) {
        char *copy = malloc(cfg->critical_paths_len + 1);
        if (!copy)
            return NULL;
        memcpy(copy, cfg->critical_paths, cfg->critical_paths_len);
        copy[cfg->critical_paths_len] = 0;   /* the last path ends even if the caller forgot */
        srv->cfg.critical_paths = copy;
    }
    srv->cfg.trusted = NULL;
    if (cfg->n_trusted > 0) {
        struct fd_net *copy = malloc((size_t)cfg->n_trusted * sizeof *copy);
        if (!copy)
            return NULL;
        memcpy(copy, cfg->trusted, (size_t)cfg->n_trusted * sizeof *copy);
        srv->cfg.trusted = copy;
    }
    int64_t now = fd_now_ns();
    prazo_codel_init(&srv->codel, cfg->codel_target_ns, cfg->codel_interval_ns, now);
    prazo_service_estimate_init(&srv->estimate, cfg->expected_service_ns, cfg->expected_quantile_permille);
    srv->limit = cfg->threads;
    if (cfg->vegas) {
        prazo_vegas_init(&srv->vegas, cfg->min_concurrency, cfg->threads);
        srv->limit = prazo_vegas_limit(&srv->vegas);
    }
    atomic_store(&srv->expected_now, fd_expected(srv));
    pthread_mutex_init(&srv->mutex, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&srv->ready, &attr);
    pthread_cond_init(&srv->idle, &attr);
    pthread_condattr_destroy(&attr);
    srv->epfd = epoll_create1(EPOLL_CLOEXEC);
    srv->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &srv->evfd};
    epoll_ctl(srv->epfd, EPOLL_CTL_ADD, srv->evfd, &ev);
    srv->n_listen = n_listen;
    for (int i = 0; i < n_listen; i++) {
        int one = 1;
        srv->listen_fds[i] = listen_fds[i];
        fcntl(listen_fds[i], F_SETFL, fcntl(listen_fds[i], F_GETFL) | O_NONBLOCK);
        /* Inherited by every accepted socket on Linux. */
        setsockopt(listen_fds[i], SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
        setsockopt(listen_fds[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        /* Wake accept only once the first bytes are in: no empty read and no extra
         * epoll round per connection, and a connection that never sends costs the
         * kernel, not us (after this many seconds it is accepted anyway). */
        int defer_s = (int)((cfg->header_timeout_ns + 999999999LL) / 1000000000LL);
        setsockopt(listen_fds[i], IPPROTO_TCP, TCP_DEFER_ACCEPT, &defer_s, sizeof defer_s);
        struct epoll_event lev = {.events = EPOLLIN, .data.ptr = &srv->listen_fds[i]};
        epoll_ctl(srv->epfd, EPOLL_CTL_ADD, listen_fds[i], &lev);
    }
    return srv;
}

static int fd_server_start(struct fd_server *srv)
{
    if (srv->thread_started)
        return 0;
    /* A fixed stack: pipelined refusals answered from one read recurse, at most one
     * level per request in a buffer of max_head bytes (< 1.5 MiB); glibc's default
     * follows RLIMIT_STACK, which may be far smaller or "unlimited" (then 2 MiB). */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 8u << 20);
    int rc = pthread_create(&srv->thread, &attr, fd_io_main, srv);
    pthread_attr_destroy(&attr);
    if (rc == 0)
        srv->thread_started = 1;
    return rc;
}

/* Stop accepting: the listeners close, heads completed from now on get 503 shutting-down. */
static void fd_server_drain(struct fd_server *srv)
{
    pthread_mutex_lock(&srv->mutex);
    srv->draining = 1;
    pthread_mutex_unlock(&srv->mutex);
    fd_wake(srv);
}

/* Wait until nothing runs and nothing waits, or until `until_ns`; 1 when idle. */
static int fd_server_wait_idle(struct fd_server *srv, int64_t until_ns)
{
    pthread_mutex_lock(&srv->mutex);
    while (srv->in_flight + fd_waiting(srv) > 0) {
        struct timespec ts = {.tv_sec = until_ns / 1000000000LL, .tv_nsec = until_ns % 1000000000LL};
        if (pthread_cond_timedwait(&srv->idle, &srv->mutex, &ts) == ETIMEDOUT)
            break;
    }
    int idle = srv->in_flight + fd_waiting(srv) == 0;
    pthread_mutex_unlock(&srv->mutex);
    return idle;
}

/* The end: queued connections are answered 503, workers stop waiting, the I/O thread exits and is joined. */
static void fd_server_stop(struct fd_server *srv)
{
    pthread_mutex_lock(&srv->mutex);
    srv->draining = 1;
    srv->stopping = 1;
    pthread_cond_broadcast(&srv->ready);
    pthread_mutex_unlock(&srv->mutex);
    fd_wake(srv);
    if (srv->thread_started) {
        pthread_join(srv->thread, NULL);
        srv->thread_started = 0;
    }
    fd_io_close_listeners(srv);
}

/* Only once the I/O thread is joined and no worker holds a connection. */
static int fd_server_free(struct fd_server *srv)
{
    if (srv->thread_started || srv->in_flight)
        return -1;
    struct fd_conn *c = srv->returned;
    while (c) {
        struct fd_conn *n = c->next;
        fd_conn_free(srv, c);
        c = n;
    }
    fd_io_close_listeners(srv);
    close(srv->epfd);
    close(srv->evfd);
    for (int a = 0; a < FD_A_COUNT; a++) {
        if (srv->cfg.answer[a][1] != srv->cfg.answer[a][0])
            free((void *)srv->cfg.answer[a][1]);
        free((void *)srv->cfg.answer[a][0]);
    }
    free((void *)srv->cfg.critical_header);
    free((void *)srv->cfg.critical_paths);
    free((void *)srv->cfg.trusted);
    pthread_mutex_destroy(&srv->mutex);
    pthread_cond_destroy(&srv->ready);
    pthread_cond_destroy(&srv->idle);
    free(srv);
    return 0;
}

static void fd_server_stats(struct fd_server *srv, struct fd_stats *s)
{
    pthread_mutex_lock(&srv->mutex);
    int64_t free_places = srv->limit - srv->in_flight, waiting = fd_waiting(srv);
    if (free_places < 0)
        free_places = 0;
    s->in_flight = srv->in_flight;
    s->assigned = waiting < free_places ? waiting : free_places;
    s->queued = waiting - s->assigned;
    s->limit = srv->limit;
    s->expected_service_ns = fd_expected(srv);
    s->insufficient_budget = fd_read_counter(&srv->insufficient_budget);
    s->shed = fd_read_counter(&srv->shed);
    s->evicted = fd_read_counter(&srv->evicted);
    s->critical_started = fd_read_counter(&srv->critical_started);
    s->upstream_stamps = fd_read_counter(&srv->upstream_stamps);
    s->accepted = fd_read_counter(&srv->accepted);
    s->open_connections = fd_read_counter(&srv->open_connections);
    s->offered = fd_read_counter(&srv->offered);
    s->admitted = fd_read_counter(&srv->admitted);
    s->started = fd_read_counter(&srv->started);
    s->completed = fd_read_counter(&srv->completed);
    s->rejected_full = fd_read_counter(&srv->rejected_full);
    s->expired_on_arrival = fd_read_counter(&srv->expired_on_arrival);
    s->expired_in_queue = fd_read_counter(&srv->expired_in_queue);
    s->shutting_down = fd_read_counter(&srv->shutting_down);
    s->header_timeouts = fd_read_counter(&srv->header_timeouts);
    s->bad_requests = fd_read_counter(&srv->bad_requests);
    s->heads_too_large = fd_read_counter(&srv->heads_too_large);
    s->kernel_stamps = fd_read_counter(&srv->kernel_stamps);
    s->peak_in_flight = fd_read_counter(&srv->peak_in_flight);
    s->peak_queued = fd_read_counter(&srv->peak_queued);
    s->queue_wait_ns_total = fd_read_counter(&srv->queue_wait_ns_total);
    s->pending_heads = fd_read_counter(&srv->pending_heads);
    s->lingering = fd_read_counter(&srv->lingering_now);
    pthread_mutex_unlock(&srv->mutex);
}

/* ------------------------------------------------------------- workers */

/* Hand a connection back to the I/O thread (keep: 1 next head, 0 polite close, -1 close now). */
static void fd_return(struct fd_server *srv, struct fd_conn *c, int keep)
{
    c->verdict = keep;
    pthread_mutex_lock(&srv->mutex);
    if (srv->io_done) {
        pthread_mutex_unlock(&srv->mutex);
        fd_conn_free(srv, c);
        return;
    }
    c->next = srv->returned;
    srv->returned = c;
    pthread_mutex_unlock(&srv->mutex);
    fd_wake(srv);
}

/* Refuse, from a worker, connections dropped from the line at pickup. */
static void fd_refuse_dropped(struct fd_server *srv, struct fd_conn *dropped)
{
    while (dropped) {
        struct fd_conn *c = dropped;
        dropped = c->next;
        c->next = NULL;
        int keep = c->client_keep_alive && !fd_has_body(c) && !srv->draining;
        const char *bytes = srv->cfg.answer[c->drop_answer][keep];
        size_t len = srv->cfg.answer_len[c->drop_answer][keep];
        int ok = fd_send_all_nb(c->fd, bytes, len) == 0;
        if (ok && keep)
            fd_conn_reset_for_next(c, c->head_len);
        fd_return(srv, c, ok ? keep : -1);
    }
}

/* The next admitted connection, holding one of the `threads` places; NULL once
 * stopping, or at once when nothing may start now and `block` is 0 (*empty is
 * then set). A worker takes a connection only while the policies allow a start
 * (the concurrency limit, the reserved places); the others stay parked here.
 * A connection that may no longer start (deadline passed, too little budget
 * left, shed) is answered here, never started. */
static struct fd_conn *fd_server_next(struct fd_server *srv, int block, int *empty)
{
    *empty = 0;
    for (;;) {
        struct fd_conn *dropped = NULL, **tail = &dropped, *c = NULL;
        int64_t now = 0;
        pthread_mutex_lock(&srv->mutex);
        while (!srv->stopping) {
            now = fd_now_ns();
            fd_line_shed_stale(srv, now, &tail);
            c = fd_line_pick(srv, now);
            if (c != NULL) {
                int verdict = prazo_deadline_verdict(now, c->deadline_ns, fd_expected(srv));
                if (verdict == PRAZO_VERDICT_LIVE)
                    break;
                int answer = verdict == PRAZO_VERDICT_EXPIRED ? FD_A_EXPIRED_IN_QUEUE : FD_A_INSUFFICIENT_BUDGET;
                fd_line_drop(srv, c, answer, &tail);
                c = NULL;
                continue;
            }
            if (dropped)
                break;   /* answer those before waiting */
            if (!block) {
                *empty = 1;
                break;
            }
            pthread_cond_wait(&srv->ready, &srv->mutex);
        }
        int stopping = srv->stopping;
        if (dropped)
            fd_line_dropped_wake(srv);
        if (c != NULL && !stopping) {
            fd_list_remove(c->critical ? &srv->crit : &srv->line, c);
            srv->in_flight++;
            if (c->critical) {
                srv->critical_in_flight++;
                fd_count(&srv->critical_started, 1);
            }
            if (srv->in_flight > fd_read_counter(&srv->peak_in_flight))
                atomic_store_explicit(&srv->peak_in_flight, srv->in_flight, memory_order_relaxed);
            c->state = FD_RUNNING;
            c->started_ns = now;
            fd_count(&srv->started, 1);
            fd_count(&srv->queue_wait_ns_total, now - c->queued_ns);
        } else {
            c = NULL;
        }
        pthread_mutex_unlock(&srv->mutex);
        fd_refuse_dropped(srv, dropped);
        if (c == NULL) {
            if (stopping || *empty)
                return NULL;
            continue;
        }
        fd_conn_start_body(c);
        return c;
    }
}

/* Wait until `fd` is ready for `events` or `until_ns`; 1 ready, 0 timed out or failed. */
static int fd_wait_fd(int fd, short events, int64_t until_ns)
{
    for (;;) {
        int64_t left = until_ns - fd_now_ns();
        if (left <= 0)
            return 0;
        struct pollfd p = {.fd = fd, .events = events};
        int ms = (int)((left + 999999) / 1000000);
        int r = poll(&p, 1, ms);
        if (r > 0)
            return 1;
        if (r < 0 && errno != EINTR)
            return 0;
    }
}

static int64_t fd_add_saturating(int64_t a, int64_t b)
{
    int64_t sum;
    return __builtin_add_overflow(a, b, &sum) ? INT64_MAX : sum;
}

/* Wait for the client until `until_ns`, within what is left of the request's
 * whole allowance for waiting on it (cfg.max_io_wait_ns): without that cap a
 * client trickling within a huge budget would keep the worker for all of it.
 * 1 ready, 0 timed out or failed. */
static int fd_conn_wait(struct fd_server *srv, struct fd_conn *c, short events, int64_t until_ns)
{
    int64_t start = fd_now_ns();
    int64_t cap = fd_add_saturating(start, srv->cfg.max_io_wait_ns - fd_read_counter(&c->io_waited_ns));
    int ready = fd_wait_fd(c->fd, events, until_ns < cap ? until_ns : cap);
    fd_count(&c->io_waited_ns, fd_now_ns() - start);
    return ready;
}

/* The response begins: from now on no 100 Continue may go (it would land in
 * the response), and the whole response is due by its deadline, or by now if
 * the answer was computed after it, plus the write grace. */
static void fd_conn_response_begins(struct fd_server *srv, struct fd_conn *c)
{
    if (c->write_until)
        return;
    atomic_store(&c->expect_continue, 0);
    int64_t now = fd_now_ns();
    c->write_until = fd_add_saturating(now > c->deadline_ns ? now : c->deadline_ns, srv->cfg.write_grace_ns);
}

/* Send what the socket takes now without waiting: bytes sent, or -1 when the client is gone. */
static ssize_t fd_conn_try_write(struct fd_server *srv, struct fd_conn *c, const char *p, size_t n)
{
    fd_conn_response_begins(srv, c);
    size_t done = 0;
    while (done < n) {
        ssize_t w = send(c->fd, p + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            done += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        return -1;
    }
    return (ssize_t)done;
}

/* 1 when a body read can be served from bytes already received (no wait). */
static int fd_conn_body_buffered(const struct fd_conn *c)
{
    if (c->body_error || c->body_done)
        return 1;
    if (c->chunked)
        return c->cbuf_pos < c->cbuf_len;
    return c->pos < c->len;
}

/* Send everything, never waiting past `until_ns` nor io_timeout without progress; 0 sent, -1 not. */
static int fd_conn_send(struct fd_server *srv, struct fd_conn *c, const char *p, size_t n, int64_t until_ns)
{
    int64_t stalled = fd_now_ns() + srv->cfg.io_timeout_ns;
    while (n) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            stalled = fd_now_ns() + srv->cfg.io_timeout_ns;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
            fd_conn_wait(srv, c, POLLOUT, stalled < until_ns ? stalled : until_ns))
            continue;
        return -1;
    }
    return 0;
}

/* Write all of a response's bytes; 0 on success, -1 when the client is gone, stalled or too slow for the bounds. */
static int fd_conn_write(struct fd_server *srv, struct fd_conn *c, const char *p, size_t n)
{
    fd_conn_response_begins(srv, c);
    return fd_conn_send(srv, c, p, n, c->write_until);
}

/* Raw bytes of the body: first what came with the head, then the socket. A
 * read that may wait does so until the request's deadline at most: a client
 * trickling its body must not keep a worker beyond the time its answer is
 * worth anything. Bytes, FD_BODY_AGAIN (only when !wait), or -1 with
 * c->body_error set. */
static ssize_t fd_conn_raw(struct fd_server *srv, struct fd_conn *c, char *dst, size_t n, int wait)
{
    if (c->pos < c->len) {
        size_t have = c->len - c->pos;
        if (have > n)
            have = n;
        memcpy(dst, c->buf + c->pos, have);
        c->pos += have;
        return (ssize_t)have;
    }
    if (wait && atomic_exchange(&c->expect_continue, 0)) {
        static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
        if (fd_conn_send(srv, c, cont, sizeof cont - 1, c->deadline_ns) != 0) {
            c->body_error = FD_BODY_LOST;
            return -1;
        }
    }
    int64_t stalled = fd_now_ns() + srv->cfg.io_timeout_ns;
    int64_t until = stalled < c->deadline_ns ? stalled : c->deadline_ns;
    for (;;) {
        ssize_t r = recv(c->fd, dst, n, MSG_DONTWAIT);
        if (r > 0) {
            c->last_read_ns = fd_now_ns();
            return r;
        }
        if (r == 0) {
            c->body_error = FD_BODY_LOST;   /* the client closed before the body ended */
            return -1;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            c->body_error = FD_BODY_LOST;
            return -1;
        }
        if (!wait)
            return FD_BODY_AGAIN;
        if (!fd_conn_wait(srv, c, POLLIN, until)) {
            c->body_error = FD_BODY_TIMEOUT;
            return -1;
        }
    }
}

/* Up to n bytes of the decoded request body: bytes, 0 at its end, -1 on a
 * failed body (c->body_error says why), FD_BODY_AGAIN when !wait and nothing is here. */
static ssize_t fd_conn_body(struct fd_server *srv, struct fd_conn *c, char *dst, size_t n, int wait)
{
    if (c->body_error)
        return -1;
    if (n == 0)
        return 0;
    if (!c->chunked) {
        if (c->body_left == 0)
            return 0;
        if ((int64_t)n > c->body_left)
            n = (size_t)c->body_left;
        ssize_t r = fd_conn_raw(srv, c, dst, n, wait);
        if (r < 0)
            return r;
        c->body_left -= r;
        if (c->body_left == 0)
            c->body_done = 1;
        return r;
    }
    while (c->cbuf_pos == c->cbuf_len) {
        if (c->body_done)
            return 0;
        if (c->cbuf_cap == 0) {
            c->cbuf = malloc(FD_READ_CHUNK);
            if (!c->cbuf) {
                c->body_error = FD_BODY_LOST;
                return -1;
            }
            c->cbuf_cap = FD_READ_CHUNK;
        }
        ssize_t r = fd_conn_raw(srv, c, c->cbuf, c->cbuf_cap, wait);
        if (r < 0)
            return r;
        size_t size = (size_t)r;
        ssize_t rest = fd_chunked_decode(&c->decoder, c->cbuf, &size);
        if (rest == -1) {
            c->body_error = FD_BODY_MALFORMED;
            return -1;
        }
        c->cbuf_pos = 0;
        c->cbuf_len = size;
        if (rest >= 0) {
            /* The body ended; what follows belongs to the next request: put it back. */
            c->body_done = 1;
            if (rest > 0) {
                size_t keep_from = size;
                size_t tail = c->len - c->pos;
                size_t need = (size_t)rest + tail;
                char *nb = malloc(need > 0 ? need : 1);
                if (!nb) {
                    c->body_error = FD_BODY_LOST;
                    return -1;
                }
                memcpy(nb, c->cbuf + keep_from, (size_t)rest);
                memcpy(nb + rest, c->buf + c->pos, tail);
                free(c->buf);
                c->buf = nb;
                c->cap = need > 0 ? need : 1;
                c->len = need;
                c->pos = 0;
                c->head_len = 0;
            }
        }
    }
    size_t have = c->cbuf_len - c->cbuf_pos;
    if (have > n)
        have = n;
    memcpy(dst, c->cbuf + c->cbuf_pos, have);
    c->cbuf_pos += have;
    return (ssize_t)have;
}

/* Up to n bytes of the decoded request body; 0 at its end, -1 on a failed body (c->body_error says why). */
static ssize_t fd_conn_read_body(struct fd_server *srv, struct fd_conn *c, char *dst, size_t n)
{
    return fd_conn_body(srv, c, dst, n, 1);
}

/* The app is done: drop the rest of the body it left unread, from what has
 * already arrived (never waiting, at most cfg.max_drain_bytes). 1 when the
 * body is all read, so the connection may carry the next request, which
 * starts right after it. */
static int fd_conn_discard_body(struct fd_server *srv, struct fd_conn *c)
{
    char sink[FD_READ_CHUNK];
    atomic_store(&c->expect_continue, 0);   /* the final response is next: asking for the body now is too late */
    for (int64_t left = srv->cfg.max_drain_bytes; left > 0 && (!c->body_done || c->cbuf_pos < c->cbuf_len);) {
        ssize_t r = fd_conn_body(srv, c, sink, sizeof sink, 0);
        if (r <= 0)
            break;
        left -= r;
    }
    return c->body_done && !c->body_error && c->cbuf_pos == c->cbuf_len;
}

/* 1 when the rest of the body has arrived (in the buffers or the socket's), so
 * that dropping it once the app is done needs no wait: while its response
 * streams the app may still read it, so nothing is dropped yet. A chunked
 * body's end cannot be seen without decoding it: 0 until it was read. */
static int fd_conn_body_arrived(const struct fd_conn *c)
{
    if (c->body_error)
        return 0;
    if (c->body_done)
        return 1;
    int queued = 0;
    if (c->chunked || ioctl(c->fd, FIONREAD, &queued) != 0)
        return 0;
    return (int64_t)(c->len - c->pos) + queued >= c->body_left;
}

/* The worker's place is given back (exactly once, here); the connection stays with the caller. */
static void fd_conn_release(struct fd_server *srv, struct fd_conn *c)
{
    int64_t now = fd_now_ns();
    pthread_mutex_lock(&srv->mutex);
    /* The service time (started -> finished) feeds the learned estimate and
     * Vegas; the request still counts as in flight for its own sample. */
    fd_line_sample(srv, now - c->started_ns);
    srv->in_flight--;
    if (c->critical)
        srv->critical_in_flight--;
    fd_count(&srv->completed, 1);
    pthread_cond_broadcast(&srv->idle);
    /* A place is free, and the limit may have risen: every parked worker looks again. */
    if (fd_waiting(srv))
        pthread_cond_broadcast(&srv->ready);
    pthread_mutex_unlock(&srv->mutex);
}

/* The connection goes back to the I/O thread, for its next head (keep) or a polite close. */
static void fd_conn_hand_back(struct fd_server *srv, struct fd_conn *c, int keep)
{
    if (keep && (!c->body_done || c->body_error || c->cbuf_pos != c->cbuf_len))
        keep = 0;   /* the rest of an unread body would be taken for the next head */
    if (keep)
        fd_conn_reset_for_next(c, c->pos);   /* what follows the body is the next head */
    fd_return(srv, c, keep ? 1 : 0);
}

/* The worker is done with c: its place is freed and the connection handed back. */
static void fd_conn_finish(struct fd_server *srv, struct fd_conn *c, int keep)
{
    fd_conn_release(srv, c);
    fd_conn_hand_back(srv, c, keep);
}

/* An address as text and port, for REMOTE_ADDR / SERVER_NAME; 0 when not IP. */
static int fd_addr_text(const struct sockaddr_storage *ss, char *host, size_t hostlen, int *port)
{
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        *port = ntohs(a->sin_port);
        return inet_ntop(AF_INET, &a->sin_addr, host, (socklen_t)hostlen) != NULL;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        *port = ntohs(a->sin6_port);
        return inet_ntop(AF_INET6, &a->sin6_addr, host, (socklen_t)hostlen) != NULL;
    }
    return 0;
}

#endif /* PRAZO_FRONTDOOR_H */
