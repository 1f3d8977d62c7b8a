/* The front door's engine: accept, head read, parse, admission and canned
 * refusals in one C thread that never touches Python, and the GIL-free calls
 * the Python workers make (wait for the next admitted connection, read its
 * body, write the response, hand the connection back).
 *
 * Ownership of a connection (struct pfd_conn) follows its state, and only the
 * owner touches it:
 *   PFD_READING  the I/O thread: in epoll, reading a head under the head timer
 *   PFD_QUEUED   the admission line (core/prazo_line.h, holding it as a token),
 *               under srv->mutex (the I/O thread expires it, a worker takes it)
 *   PFD_RUNNING  one worker, until pfd_conn_hand_back() puts it on srv->returned
 *               (the Cython Connection hands it back only once no app thread
 *               is still inside a body read or a write on it)
 *   PFD_DRAINING the I/O thread: lingering close after a refusal
 * The listening sockets and the epoll/eventfd descriptors belong to the I/O
 * thread; a connection's descriptor to whoever owns the connection.
 *
 * On a host of several worker processes (prazo serve --workers N) the same
 * engine runs in two roles. The triage process's engine has no Python
 * workers: its I/O thread hands each admitted connection (its descriptor by
 * SCM_RIGHTS, the bytes read so far and the deadline) to a worker thread of a
 * worker process over that thread's channel, a SOCK_SEQPACKET socket (see
 * pfd_host.c), and the line, its policies and counters stay the triage's
 * alone: one admission decision for the host. A worker process's engine
 * (pfd_server_new_worker) has no I/O thread and no line: its Python workers
 * take connections from their channels (pfd_channel.c) and run the very same
 * body/write calls; giving the place and the connection back becomes a
 * message to the triage, which then owns the connection again.
 *
 * This header is the engine's interface: its types, and the calls that the
 * Cython face (_engine_c.pyx) and the fuzz harness make. The engine's own
 * files share the rest through pfd_internal.h.
 */
#ifndef PRAZO_PFD_H
#define PRAZO_PFD_H

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
#include "prazo_budget.h" /* core/: the budget headers' wire rules, shared with the compiled middleware */
#include "prazo_line.h"   /* core/: the admission line and its policies, shared with the queue's C twin */
#include "prazo_policy.h" /* core/: the queue policies' arithmetic */

#define PFD_MAX_HEADERS 100
#define PFD_READ_CHUNK 16384

enum pfd_answer {
    PFD_A_QUEUE_FULL,          /* 503 queue-full */
    PFD_A_EXPIRED_ON_ARRIVAL,  /* 504 expired-on-arrival */
    PFD_A_EXPIRED_IN_QUEUE,    /* 504 expired-in-queue */
    PFD_A_SHUTTING_DOWN,       /* 503 shutting-down */
    PFD_A_INSUFFICIENT_BUDGET, /* 504 insufficient-budget: less budget left than the expected service time */
    PFD_A_SHED,                /* 503 shed-standing-queue (order="adaptive") */
    PFD_A_EVICTED,             /* 503 evicted-by-critical */
    PFD_A_COUNT_KEEPABLE,      /* the ones above exist as keep-alive and close variants */
    PFD_A_HEADER_TIMEOUT = PFD_A_COUNT_KEEPABLE, /* 408, closes */
    PFD_A_BAD_REQUEST,                           /* 400, closes */
    PFD_A_HEAD_TOO_LARGE,                        /* 431, closes */
    PFD_A_COUNT
};

enum pfd_state { PFD_READING, PFD_QUEUED, PFD_RUNNING, PFD_DRAINING, PFD_CLOSED };

/* Why a request body failed (pfd_conn.body_error); 0 while it has not. */
enum pfd_body_error { PFD_BODY_LOST = 1, PFD_BODY_MALFORMED = 2, PFD_BODY_TIMEOUT = 3 };
#define PFD_BODY_AGAIN (-2) /* a read that may not wait found nothing yet */

enum pfd_order { PFD_ORDER_FIFO = 0, PFD_ORDER_LIFO = 1, PFD_ORDER_ADAPTIVE = 2 };

/* A trusted proxy's network: family AF_INET or AF_INET6, the network address
 * in network byte order, the prefix length in bits. */
struct pfd_net {
    int family;
    unsigned char addr[16];
    int prefix;
};

struct pfd_config {
    int threads;
    int max_queue;
    double default_budget_ms;
    double max_budget_ms;
    int64_t header_timeout_ns;
    int64_t io_timeout_ns; /* a worker's body read or response write stalled this long fails */
    /* A body read never waits past the request's deadline; a response write not
     * past the deadline (or the moment the response began, if later) plus
     * write_grace_ns; and all of one request's waits on its client together
     * never exceed max_io_wait_ns, whatever the budget. */
    int64_t write_grace_ns;
    int64_t max_io_wait_ns;
    int64_t linger_ns;
    int64_t max_drain_bytes;
    int64_t max_lingering; /* >= 1: lingering closes at once; beyond, the oldest is closed outright */
    size_t max_head;
    /* The queue policies (docs/design.md, "Queue policies"), the same options as AdmissionQueue's. */
    int order;                                  /* enum pfd_order */
    int64_t codel_target_ns, codel_interval_ns; /* order == PFD_ORDER_ADAPTIVE */
    int64_t expected_service_ns;                /* > 0: a fixed expected service time (doomed-work skip) */
    int expected_quantile_permille;             /* > 0: learn that quantile of the service times instead; both 0: off */
    int vegas;                                  /* 1: limit="vegas" between min_concurrency and threads */
    int min_concurrency;
    int reserved;                /* places kept for the critical class */
    const char *critical_header; /* a request is critical when this header says "critical"; NULL: none */
    size_t critical_header_len;
    const char *critical_paths; /* request paths that are critical, each ended by a NUL; NULL: none */
    size_t critical_paths_len;
    /* Front-proxy queue time (prazo.bindings.proxy_headers): with trust_request_start, the
     * time since the earliest valid X-Request-Start / X-Queue-Start stamp, at most
     * max_upstream_ns, comes off the deadline when the peer is one of `trusted`
     * (n_trusted < 0: any peer). */
    int trust_request_start;
    int64_t max_upstream_ns;
    const struct pfd_net *trusted;
    int n_trusted;
    /* [answer][keep]: keep = 1 for the keep-alive variant (only below PFD_A_COUNT_KEEPABLE) */
    const char *answer[PFD_A_COUNT][2];
    size_t answer_len[PFD_A_COUNT][2];
    /* 1: the overload refusals (queue-full, shed, evicted) carry the line's
     * measured wait in place of their canned Retry-After; 0: it stays fixed. */
    int measured_retry_after;
    /* 1: observe-only. The line never expires, sheds, evicts or skips doomed work (it
     * runs FIFO up to max_queue, as a stock server's backlog); each request's own
     * deadline still reaches the app. Every admission, start and end is noted under the
     * mutex (pfd_server_observed) for the shadow line in Python, which decides what an
     * enforcing line would have. */
    int observe;
};

/* What observe-only notes, in the order it happened (under the mutex). */
enum { PFD_NOTE_ADMITTED = 'a', PFD_NOTE_STARTED = 's', PFD_NOTE_ENDED = 'e' };

/* One note: what the shadow line needs of an admission (deadline, class), a start or an end. */
struct pfd_observed {
    int64_t serial; /* the request's number, > 0 (given at its admission) */
    int64_t at_ns;  /* admitted: when the line took it (when an enforcing line would have decided) */
    int64_t deadline_ns;
    int critical;
    int kind; /* PFD_NOTE_* */
};

/* Where a chunked body's decoder stands (pfd_chunked_decode). */
enum pfd_chunk_state {
    PFD_CK_SIZE,           /* first hex digit of a chunk size */
    PFD_CK_SIZE_MORE,      /* more hex digits, ';', BWS or CR */
    PFD_CK_SIZE_BWS,       /* BWS after the size: only ';' may follow */
    PFD_CK_EXT_NAME_START, /* BWS, then an extension's name */
    PFD_CK_EXT_NAME,
    PFD_CK_EXT_NAME_BWS,    /* BWS after a name: '=' or ';' */
    PFD_CK_EXT_VALUE_START, /* BWS, then a token or a quoted string */
    PFD_CK_EXT_TOKEN,
    PFD_CK_EXT_QUOTED,
    PFD_CK_EXT_QUOTED_PAIR, /* after a backslash in a quoted string */
    PFD_CK_EXT_VALUE_END,   /* after a value: BWS, ';' or CR */
    PFD_CK_EXT_VALUE_BWS,   /* BWS after a value: only ';' may follow */
    PFD_CK_SIZE_LF,
    PFD_CK_DATA,
    PFD_CK_DATA_CR,
    PFD_CK_DATA_LF,
    PFD_CK_TRAILER_LINE, /* start of a trailer field line, or CR of the empty line that ends the body */
    PFD_CK_TRAILER_NAME,
    PFD_CK_TRAILER_VALUE,
    PFD_CK_TRAILER_LF,
    PFD_CK_END_LF,
    PFD_CK_DONE,
    PFD_CK_ERROR /* sticky: a broken body stays broken, and can be told from a short one */
};

struct pfd_chunked {
    enum pfd_chunk_state state;
    uint64_t left; /* chunk size while reading it; then the chunk's bytes still to come */
    size_t meta;   /* bytes of the current chunk line (of all the trailers after the last chunk) */
};

struct pfd_conn;
struct pfd_remote;
struct pfd_worker;

/* ------------------------------------------------ the channels of a host */

/* The messages of a channel between the triage and one worker thread. Every
 * message is one struct pfd_msg, then `len` bytes; a DISPATCH carries the
 * connection's descriptor (SCM_RIGHTS). */
enum pfd_msg_kind {
    PFD_MSG_HELLO = 1, /* worker -> triage: this thread takes a connection now (sent once, and after a stall) */
    PFD_MSG_DISPATCH,  /* triage -> worker: an admitted connection; bytes: all read of it so far */
    PFD_MSG_STOP,      /* triage -> worker: no more connections; the thread ends */
    PFD_MSG_RELEASE,   /* worker -> triage: the place is given back (the thread takes the next one) */
    PFD_MSG_DONE,      /* worker -> triage: the connection is back; bytes: what follows the body */
    PFD_MSG_FINISH,    /* worker -> triage: RELEASE and DONE in one */
};

struct pfd_msg {
    uint32_t kind;   /* enum pfd_msg_kind */
    int32_t verdict; /* DONE/FINISH: 1 next head, 0 polite close, -1 close now, PFD_UNDELIVERED */
    uint64_t token;  /* the triage's name of the connection, echoed back by the worker */
    int64_t deadline_ns, arrival_ns, started_ns, upstream_ns, last_read_ns;
    int32_t critical, budget_source, budget_invalid, arrival_from_kernel;
    int32_t draining; /* DISPATCH: the host drains, so this response closes the connection */
    uint32_t peer_len, len;
    struct sockaddr_storage peer;
};

/* FINISH's verdict for a DISPATCH whose connection never reached the app (its
 * descriptor was dropped by the kernel for want of a free one in the worker,
 * or the worker had no memory for it): the triage closes it and counts it in
 * worker_lost, and the thread takes the next one. */
#define PFD_UNDELIVERED (-2)

/* A worker process's end of one channel (one per worker thread). */
struct pfd_channel {
    int fd;
    /* 1 once a RELEASE/FINISH went: the triage counts the thread as asking
     * again, so its next pfd_channel_next sends no HELLO. */
    atomic_int asked;
    char *scratch; /* receive buffer, allocated at the first message */
    size_t scratch_cap;
};

struct pfd_list { /* intrusive doubly linked list of connections */
    struct pfd_conn *head, *tail;
    int64_t count;
};

struct pfd_conn {
    int fd;
    enum pfd_state state;
    struct pfd_conn *prev, *next; /* timer list, or a chain of connections to answer */
    int64_t timer_ns;             /* head timer / linger end */
    int verdict;                  /* handed back by a worker: 1 next head, 0 polite close, -1 close now */
    /* In the I/O thread's epoll (registered) and waiting for its one event
     * (armed): a connection reading a head is registered EPOLLONESHOT, so its
     * event disarms it and a worker's turn needs no EPOLL_CTL_DEL, its next
     * head one EPOLL_CTL_MOD. I/O thread only. */
    int registered, armed;
    int64_t drained;
    char *buf;
    size_t len, cap;
    size_t head_len; /* 0 until a head is parsed */
    /* The parsed head; pointers into buf, valid while PFD_QUEUED/PFD_RUNNING. */
    const char *method, *path;
    size_t method_len, path_len;
    int minor_version;
    struct phr_header headers[PFD_MAX_HEADERS];
    size_t num_headers;
    int64_t content_length; /* -1: none */
    int chunked;
    int client_keep_alive;
    /* Atomic: an app thread may read the body while the worker writes the response. */
    atomic_int expect_continue;
    int64_t arrival_ns, deadline_ns, queued_ns, started_ns;
    int64_t serial;      /* observe-only: the request's number in the notes; 0 when its admission was not noted */
    int64_t upstream_ns; /* taken off the deadline for a trusted proxy's X-Request-Start */
    int critical;        /* of the critical class: served first, may use the reserved places */
    int drop_answer;     /* the refusal of a connection dropped from the line */
    int budget_source;
    int budget_invalid;
    int arrival_from_kernel; /* 1: arrival is the kernel's receive stamp of the first bytes */
    int64_t last_read_ns;    /* when bytes were last read: the arrival of pipelined ones */
    /* Body reading by the worker */
    size_t pos;        /* next unread byte of buf */
    int64_t body_left; /* Content-Length bytes still to read */
    int body_done;
    int body_error;               /* enum pfd_body_error */
    int64_t write_until;          /* 0 until the response begins: then its last moment to be written */
    _Atomic int64_t io_waited_ns; /* time spent waiting on the client, reads and writes together */
    struct pfd_chunked decoder;
    char *cbuf; /* chunked: decoded bytes not yet given out */
    size_t cbuf_pos, cbuf_len, cbuf_cap;
    struct sockaddr_storage peer;
    socklen_t peer_len;
    /* On a host: in a worker process, the channel it came by (NULL in the
     * triage and in a one-process engine) and the triage's token for it; in
     * the triage, the worker it was handed to and whether its place came back. */
    struct pfd_channel *channel;
    uint64_t token;
    struct pfd_remote *remote;
    int released;
};

struct pfd_stats {
    int64_t accepted, open_connections, offered, admitted, started, completed;
    int64_t rejected_full, expired_on_arrival, expired_in_queue, shutting_down;
    int64_t header_timeouts, bad_requests, heads_too_large, kernel_stamps;
    int64_t in_flight, assigned, queued, peak_in_flight, peak_queued, queue_wait_ns_total, pending_heads, lingering;
    int64_t insufficient_budget, shed, evicted, critical_started, limit, expected_service_ns;
    int64_t upstream_stamps;
    int64_t worker_lost, workers, worker_threads; /* on a host: connections lost with their worker; live channels */
    int64_t observed_lost;                        /* observe-only: notes that could not be made (out of memory) */
};

struct pfd_server {
    struct pfd_config cfg;
    /* Where each answer's "Retry-After: " line starts and ends (0: it has none
     * to compute): the overload refusals carry the line's measured wait. */
    size_t wait_at[PFD_A_COUNT][2], wait_end[PFD_A_COUNT][2];
    int listen_fds[8];
    int n_listen;
    int epfd, evfd;
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mutex;
    pthread_cond_t ready; /* a connection entered the line, or stopping */
    pthread_cond_t idle;  /* in_flight or queued went down */
    /* The PFD_QUEUED connections, the places held by workers, the policies'
     * state and the line's counters, in one block (core/prazo_line.h): under mutex. */
    struct prazo_line *line;
    struct pfd_conn *returned; /* finished by workers or refused at pickup, for the I/O thread */
    /* Written under mutex, read by the I/O thread and the workers' Python (Engine.draining)
     * without it: atomic, so those reads are defined (ThreadSanitizer saw the race). */
    atomic_int draining;
    atomic_int stopping;
    int io_done; /* the I/O thread has exited: workers free what they finish */
    /* The I/O thread found nothing returned (set under mutex, with that look)
     * and sleeps in epoll_wait: the first hand-back after that (which takes it
     * under mutex) writes the eventfd; the others find it awake or about to
     * look at `returned`. */
    atomic_int io_sleeping;
    /* Workers inside pfd_server_next and not asleep on `ready`: each will look
     * at the line under the mutex before it sleeps, so an admission needs to
     * wake a sleeper only for the entries beyond them (counted before the
     * mutex is taken, so a look about to happen is never missed). */
    atomic_int looking;
    atomic_int listeners_closed;
    /* owned by the I/O thread */
    /* Admissions since the I/O thread last woke workers: it wakes them once its batch
     * of events is handled, not one by one, so a woken worker does not preempt it
     * half-way and then find the rest of the batch not yet admitted. */
    int wakes_owed;
    struct pfd_list heads, lingering;
    /* Closed while an epoll batch that may still name them was handled: freed at the next turn. */
    struct pfd_conn *graveyard;
    int64_t accept_paused_until; /* out of descriptors: listeners out of epoll until then (0: not paused) */
    /* counters beside the line's (written under mutex or by the I/O thread only; read via atomics) */
    _Atomic int64_t accepted, open_connections, admitted, shutting_down;
    _Atomic int64_t header_timeouts, bad_requests, heads_too_large, kernel_stamps;
    _Atomic int64_t pending_heads, lingering_now; /* published by the I/O thread each turn */
    _Atomic int64_t expected_now;    /* pfd_expected() as last published: a change wakes the I/O thread's sweep */
    _Atomic int64_t upstream_stamps; /* heads whose deadline a trusted proxy's stamp shortened */
    /* A host's triage (pfd_host.c): the worker threads' channels. `remotes` is
     * the I/O thread's, changed under mutex (stats reads it there); `incoming`
     * and the retire requests come from other threads under mutex. */
    int host;        /* 1: a triage without Python workers */
    int worker_only; /* 1: a worker process's engine: no I/O thread, no line use */
    struct pfd_remote *remotes, *incoming;
    struct pfd_worker *host_workers; /* one per worker process with a live channel */
    uint64_t dispatch_seq;           /* connections handed to worker threads so far */
    _Atomic int64_t worker_lost, remote_count;
    char *msg_buf; /* the I/O thread's receive buffer for channel messages */
    size_t msg_cap;
    /* cfg.observe: the admissions not yet taken by pfd_server_observed (under mutex), the
     * last serial given, and the admissions that could not be noted (out of memory). */
    struct pfd_observed *observed;
    int64_t n_observed, observed_cap, observed_serial;
    _Atomic int64_t observed_lost;
};

#define PFD_EARLIEST_STAMP_NS (946684800LL * 1000000000LL)
#define PFD_LATEST_STAMP_NS (4102444800LL * 1000000000LL)

enum pfd_head_verdict { PFD_HEAD_PARTIAL, PFD_HEAD_COMPLETE, PFD_HEAD_BAD, PFD_HEAD_TOO_LARGE };

static inline int64_t pfd_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* pfd_head.c: what a head says (budget, front-proxy queue time, framing, class) */
int pfd_incoming_budget(const struct phr_header *headers, size_t n, double *ms, int *invalid, int *source);
int64_t pfd_deadline_for(double default_ms, double max_ms, int have, double incoming_ms, int64_t arrival_ns,
                         int64_t upstream_ns);
int pfd_parse_request_start_ns(const char *p, size_t n, int64_t *ns);
int pfd_request_start(const struct phr_header *headers, size_t n, int64_t *ns);
int pfd_address_trusted(const struct pfd_config *cfg, int family, const unsigned char *addr);
int64_t pfd_upstream_wait_ns(int64_t stamp_ns, int64_t arrival_wall_ns, int64_t max_wait_ns);
int64_t pfd_upstream_ns(const struct pfd_config *cfg, const struct pfd_conn *c);
int pfd_parse_head(struct pfd_conn *c, size_t last_len);
enum pfd_head_verdict pfd_judge_head(struct pfd_conn *c, size_t max_head, size_t last_len);
void pfd_conn_start_body(struct pfd_conn *c);
int pfd_decoded_path_is(const char *raw, size_t n, const char *want, size_t want_len);
int pfd_is_critical(const struct pfd_server *srv, const struct pfd_conn *c);

/* pfd_chunked.c: chunked request bodies */
ssize_t pfd_chunked_decode(struct pfd_chunked *d, char *buf, size_t *bufsz);

/* pfd_conn.c: connections */
void pfd_conn_reset_for_next(struct pfd_conn *c, size_t consumed);

/* pfd_server.c: the server's lifecycle */
struct pfd_server *pfd_server_new(const struct pfd_config *cfg, const int *listen_fds, int n_listen);
int pfd_server_start(struct pfd_server *srv);
void pfd_server_drain(struct pfd_server *srv);
int pfd_server_wait_idle(struct pfd_server *srv, int64_t until_ns);
void pfd_server_stop(struct pfd_server *srv);
int pfd_server_free(struct pfd_server *srv);
void pfd_server_stats(struct pfd_server *srv, struct pfd_stats *s);
int64_t pfd_server_observed(struct pfd_server *srv, struct pfd_observed **out);

/* pfd_host.c: a host's triage side: channels to the worker processes' threads */
struct pfd_server *pfd_server_new_host(const struct pfd_config *cfg, const int *listen_fds, int n_listen);
int pfd_server_add_channel(struct pfd_server *srv, int fd, int worker);
void pfd_server_retire_worker(struct pfd_server *srv, int worker);
void pfd_server_worker_gone(struct pfd_server *srv, int worker);
int pfd_server_worker_loads(struct pfd_server *srv, int *workers, int64_t *in_flight, int max);

/* pfd_channel.c: a worker process's side of its channels */
struct pfd_server *pfd_server_new_worker(const struct pfd_config *cfg);
int pfd_channel_ask(struct pfd_channel *ch);
struct pfd_conn *pfd_channel_next(struct pfd_server *srv, struct pfd_channel *ch);

/* pfd_worker.c: the calls the Python workers make, with the GIL released */
struct pfd_conn *pfd_server_next(struct pfd_server *srv, int block, int *empty);
ssize_t pfd_conn_try_write(struct pfd_server *srv, struct pfd_conn *c, const char *p, size_t n);
int pfd_conn_body_buffered(const struct pfd_conn *c);
int pfd_conn_write(struct pfd_server *srv, struct pfd_conn *c, const char *p, size_t n);
ssize_t pfd_conn_read_body(struct pfd_server *srv, struct pfd_conn *c, char *dst, size_t n);
int pfd_conn_discard_body(struct pfd_server *srv, struct pfd_conn *c);
int pfd_conn_body_arrived(const struct pfd_conn *c);
void pfd_conn_release(struct pfd_server *srv, struct pfd_conn *c);
void pfd_conn_hand_back(struct pfd_server *srv, struct pfd_conn *c, int keep);
void pfd_conn_finish(struct pfd_server *srv, struct pfd_conn *c, int keep);
int pfd_addr_text(const struct sockaddr_storage *ss, char *host, size_t hostlen, int *port);

#endif /* PRAZO_PFD_H */
