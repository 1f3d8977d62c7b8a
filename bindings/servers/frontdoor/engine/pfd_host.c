/* The front door's engine on a host of worker processes: the triage's side.
 *
 * The triage process runs the whole engine (accept, head timeout, parse,
 * budget, the line with its policies, every refusal) and no app. Its worker
 * "threads" are channels: one SOCK_SEQPACKET socket per thread of a worker
 * process, added by pfd_server_add_channel and owned by the I/O thread, which
 * reads them in the same epoll loop as the client sockets. A thread says it
 * is free (HELLO, or by giving its place back); the I/O thread then takes the
 * next connection from the line exactly as a local worker would
 * (pfd_line_next: the same drops, the same policies) and sends it down the
 * channel with its descriptor. The connection stays in the triage, out of
 * epoll, until DONE brings it back with the bytes read after its body.
 *
 * Why this split and not N engines over a line in shared memory: an admitted
 * connection can only run in the process that holds it, so N separate engines
 * would strand a request in a full process while a sibling has room (or need
 * this same hand-over anyway), and a line shared between processes needs a
 * robust process-shared mutex that a dying worker can leave taken. Here a
 * worker that dies only closes its channels: its unfinished requests are
 * counted (worker_lost) and closed, and the line never was in its memory.
 * A channel's end-of-file is not enough to learn of a death, though: a
 * process the app forked holds copies of the channels (and of the running
 * connections), so the supervisor, which watches each worker's pid, tells
 * the triage too (pfd_server_worker_gone), and a dropped connection is shut
 * down, not only closed, so that no copy keeps its client waiting.
 *
 * The triage prefers, among the free threads, one of the worker process with
 * the fewest requests running: a CPU-bound app then runs on every core before
 * any process runs two requests at once under one GIL. */
#include "pfd_internal.h"

struct pfd_worker {
    int id;
    int channels;  /* live channels of this worker process */
    int64_t held;  /* places held by its threads (requests running there) */
    uint64_t last; /* the dispatch sequence number of its latest connection */
    struct pfd_worker *next;
};

struct pfd_remote {
    int fd;
    int worker_id;
    struct pfd_worker *worker;
    int asking;             /* the thread waits for a connection */
    int stopped;            /* STOP went: nothing is sent to it again */
    atomic_int retiring;    /* set by pfd_server_retire_worker: STOP at its next ask */
    atomic_int gone;        /* set by pfd_server_worker_gone: dropped at the I/O thread's next turn */
    struct pfd_conn *conns; /* handed to it and not yet DONE, through c->next */
    struct pfd_remote *next;
};

struct pfd_server *pfd_server_new_host(const struct pfd_config *cfg, const int *listen_fds, int n_listen)
{
    struct pfd_server *srv = pfd_server_new(cfg, listen_fds, n_listen);
    if (!srv)
        return NULL;
    srv->host = 1;
    /* The largest message a worker sends: the bytes after a body, at most the
     * buffered head plus two read chunks (pfd_conn_body's put-back). */
    srv->msg_cap = sizeof(struct pfd_msg) + cfg->max_head + 3 * PFD_READ_CHUNK;
    srv->msg_buf = malloc(srv->msg_cap);
    if (!srv->msg_buf) {
        srv->host = 0;
        return NULL;
    }
    return srv;
}

/* A channel to one thread of worker process `worker`: the engine owns `fd` from here on. */
int pfd_server_add_channel(struct pfd_server *srv, int fd, int worker)
{
    if (!srv->host || fd < 0)
        return -1;
    struct pfd_remote *r = calloc(1, sizeof *r);
    if (!r)
        return -1;
    r->fd = fd;
    r->worker_id = worker;
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    pthread_mutex_lock(&srv->mutex);
    r->next = srv->incoming;
    srv->incoming = r;
    pthread_mutex_unlock(&srv->mutex);
    pfd_wake(srv);
    return 0;
}

/* Mark every channel of worker process `worker`, added or still incoming,
 * retiring or gone, and wake the I/O thread to act on it. */
static void pfd_host_mark_worker(struct pfd_server *srv, int worker, int gone)
{
    pthread_mutex_lock(&srv->mutex);
    struct pfd_remote *lists[2] = {srv->remotes, srv->incoming};
    for (int i = 0; i < 2; i++)
        for (struct pfd_remote *r = lists[i]; r; r = r->next)
            if (r->worker_id == worker)
                atomic_store(gone ? &r->gone : &r->retiring, 1);
    pthread_mutex_unlock(&srv->mutex);
    pfd_wake(srv);
}

/* Worker process `worker` is to stop: each of its threads gets STOP when it next asks. */
void pfd_server_retire_worker(struct pfd_server *srv, int worker) { pfd_host_mark_worker(srv, worker, 0); }

/* Worker process `worker` has exited (its supervisor saw it): its channels go
 * as at their end-of-file, which never comes while a process it forked holds
 * copies of them. Until then its idle threads would count as free, and its
 * running requests would hold their places and leave their clients waiting. */
void pfd_server_worker_gone(struct pfd_server *srv, int worker) { pfd_host_mark_worker(srv, worker, 1); }

/* Each worker process with a live channel and the requests running there; at most `max`. */
int pfd_server_worker_loads(struct pfd_server *srv, int *workers, int64_t *in_flight, int max)
{
    int n = 0;
    pthread_mutex_lock(&srv->mutex);
    for (struct pfd_worker *w = srv->host_workers; w && n < max; w = w->next, n++) {
        workers[n] = w->id;
        in_flight[n] = w->held;
    }
    pthread_mutex_unlock(&srv->mutex);
    return n;
}

int64_t pfd_host_worker_count(struct pfd_server *srv)
{
    int64_t n = 0;
    for (struct pfd_worker *w = srv->host_workers; w; w = w->next)
        n++;
    return n;
}

/* Under mutex. */
static struct pfd_worker *pfd_worker_of(struct pfd_server *srv, int id)
{
    for (struct pfd_worker *w = srv->host_workers; w; w = w->next)
        if (w->id == id)
            return w;
    struct pfd_worker *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->id = id;
    w->next = srv->host_workers;
    srv->host_workers = w;
    return w;
}

/* Channels added since the last turn go into epoll (the I/O thread). */
void pfd_host_take_incoming(struct pfd_server *srv)
{
    if (!srv->host)
        return;
    pthread_mutex_lock(&srv->mutex);
    struct pfd_remote *r = srv->incoming;
    srv->incoming = NULL;
    while (r) {
        struct pfd_remote *next = r->next;
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = (void *)((uintptr_t)r | PFD_REMOTE_TAG)};
        r->worker = pfd_worker_of(srv, r->worker_id);
        if (!r->worker || srv->stopping || epoll_ctl(srv->epfd, EPOLL_CTL_ADD, r->fd, &ev) != 0) {
            close(r->fd);
            free(r);
        } else {
            r->worker->channels++;
            r->next = srv->remotes;
            srv->remotes = r;
            pfd_count(&srv->remote_count, 1);
        }
        r = next;
    }
    pthread_mutex_unlock(&srv->mutex);
}

/* The place of c comes back (once): the line counts it done. */
static void pfd_host_release(struct pfd_server *srv, struct pfd_remote *r, struct pfd_conn *c)
{
    if (c->released)
        return;
    c->released = 1;
    pfd_conn_release(srv, c);
    pthread_mutex_lock(&srv->mutex);
    r->worker->held--;
    pthread_mutex_unlock(&srv->mutex);
}

/* The channel is gone (the worker died, broke the protocol or was stopped):
 * what its thread held is closed, the unfinished requests counted lost. */
static void pfd_host_drop(struct pfd_server *srv, struct pfd_remote *r)
{
    while (r->conns) {
        struct pfd_conn *c = r->conns;
        r->conns = c->next;
        c->next = NULL;
        c->remote = NULL;
        if (!c->released) {
            pfd_count(&srv->worker_lost, 1);
            pfd_host_release(srv, r, c);
        }
        /* The dead worker's copy of the descriptor is closed by the kernel, but
         * a process it forked may hold another: pfd_conn_free shuts the
         * connection down for every copy, so the client never hangs. */
        c->state = PFD_CLOSED;
        pfd_conn_free(srv, c);
    }
    epoll_ctl(srv->epfd, EPOLL_CTL_DEL, r->fd, NULL);
    close(r->fd);
    pthread_mutex_lock(&srv->mutex);
    for (struct pfd_remote **p = &srv->remotes; *p; p = &(*p)->next) {
        if (*p == r) {
            *p = r->next;
            break;
        }
    }
    pfd_count(&srv->remote_count, -1);
    if (--r->worker->channels == 0) {
        for (struct pfd_worker **p = &srv->host_workers; *p; p = &(*p)->next) {
            if (*p == r->worker) {
                *p = r->worker->next;
                break;
            }
        }
        free(r->worker);
    }
    pthread_mutex_unlock(&srv->mutex);
    free(r);
}

static int pfd_host_send(struct pfd_remote *r, const struct pfd_msg *m, const char *bytes, size_t n, int fd)
{
    struct iovec iov[2] = {{.iov_base = (void *)m, .iov_len = sizeof *m}, {.iov_base = (void *)bytes, .iov_len = n}};
    char control[CMSG_SPACE(sizeof(int))];
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = n ? 2 : 1};
    if (fd >= 0) {
        memset(control, 0, sizeof control);
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    for (;;) {
        /* Never blocks in practice: a thread has at most one DISPATCH (or a STOP) unread. */
        ssize_t w = sendmsg(r->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w >= 0)
            return (size_t)w == sizeof *m + n ? 0 : -1;
        if (errno != EINTR)
            return -1;
    }
}

static void pfd_host_stop_thread(struct pfd_remote *r)
{
    struct pfd_msg m = {.kind = PFD_MSG_STOP};
    (void)pfd_host_send(r, &m, NULL, 0, -1);
    r->stopped = 1;
    r->asking = 0;
}

/* Connections back from a channel's thread. 0, or -1 when the channel must go. */
static int pfd_host_read(struct pfd_server *srv, struct pfd_remote *r, int64_t now)
{
    for (;;) {
        struct iovec iov = {.iov_base = srv->msg_buf, .iov_len = srv->msg_cap};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
        ssize_t n = recvmsg(r->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (n <= 0) /* the worker's end closed: it exited or died */
            return -1;
        struct pfd_msg m;
        if ((size_t)n < sizeof m || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
            return -1;
        memcpy(&m, srv->msg_buf, sizeof m);
        if (m.len != (size_t)n - sizeof m)
            return -1;
        if (m.kind == PFD_MSG_HELLO) {
            r->asking = 1;
            continue;
        }
        if (m.kind != PFD_MSG_RELEASE && m.kind != PFD_MSG_DONE && m.kind != PFD_MSG_FINISH)
            return -1;
        if (m.verdict == PFD_UNDELIVERED && m.kind != PFD_MSG_FINISH)
            return -1; /* only a connection whose place is still held can fail to arrive */
        /* The token names one of this channel's connections, or the worker is broken:
         * it is looked up, never trusted as a pointer. */
        struct pfd_conn **at = &r->conns;
        while (*at && (uint64_t)(uintptr_t)*at != m.token)
            at = &(*at)->next;
        struct pfd_conn *c = *at;
        if (!c)
            return -1;
        if (!c->released)
            r->asking = 1; /* the place came back: the thread asks for the next connection */
        if (m.verdict == PFD_UNDELIVERED && !c->released)
            pfd_count(&srv->worker_lost, 1); /* admitted, never run: its one outcome is this loss */
        pfd_host_release(srv, r, c);
        if (m.kind == PFD_MSG_RELEASE)
            continue;
        *at = c->next;
        c->next = NULL;
        c->remote = NULL;
        int verdict = m.verdict == 1 ? 1 : (m.verdict == 0 ? 0 : -1);
        /* When the pipelined bytes were read is the next request's arrival: never
         * later than now, so a worker's clock error cannot extend a deadline. */
        int64_t read_ns = m.last_read_ns > 0 && m.last_read_ns <= now ? m.last_read_ns : now;
        if (verdict == 1 && pfd_conn_take_pending(c, srv->msg_buf + sizeof m, m.len, read_ns) != 0)
            verdict = -1;
        pfd_io_returned(srv, c, verdict, now);
    }
}

void pfd_host_event(struct pfd_server *srv, struct pfd_remote *r, uint32_t events, int64_t now)
{
    (void)events; /* a hang-up is read as the end of the stream, after what came before it */
    if (pfd_host_read(srv, r, now) != 0)
        pfd_host_drop(srv, r);
}

/* The free thread to take the next connection: of the worker process running
 * the fewest requests; between equals, of the one that got a connection least
 * recently, so that even one client at a time is spread over the workers. */
static struct pfd_remote *pfd_host_pick(struct pfd_server *srv)
{
    struct pfd_remote *best = NULL;
    for (struct pfd_remote *r = srv->remotes; r; r = r->next) {
        if (!r->asking || r->stopped)
            continue;
        if (!best || r->worker->held < best->worker->held ||
            (r->worker->held == best->worker->held && r->worker->last < best->worker->last))
            best = r;
    }
    return best;
}

/* Hand what may start now to free threads (the I/O thread, every turn). */
void pfd_host_dispatch(struct pfd_server *srv, int64_t now)
{
    if (!srv->host)
        return;
    for (struct pfd_remote *r = srv->remotes, *next; r; r = next) {
        next = r->next;
        if (!atomic_load(&r->gone))
            continue;
        /* What the thread said before its process died counts (a connection it
         * gave back is not lost), as when its end-of-file follows its messages. */
        (void)pfd_host_read(srv, r, now);
        pfd_host_drop(srv, r);
    }
    for (struct pfd_remote *r = srv->remotes; r; r = r->next)
        if (r->asking && !r->stopped && atomic_load(&r->retiring))
            pfd_host_stop_thread(r);
    for (;;) {
        struct pfd_remote *r = pfd_host_pick(srv);
        if (!r)
            return;
        struct pfd_conn *dropped = NULL, **tail = &dropped, *c;
        pthread_mutex_lock(&srv->mutex);
        c = srv->stopping ? NULL : pfd_line_next(srv, now, &tail);
        if (c) {
            c->state = PFD_RUNNING;
            c->started_ns = now;
            pfd_line_note_run(srv, PFD_NOTE_STARTED, c, now);
            r->worker->held++;
            r->worker->last = ++srv->dispatch_seq;
        }
        if (dropped)
            pfd_line_dropped_wake(srv);
        pthread_mutex_unlock(&srv->mutex);
        pfd_io_answer_dropped(srv, dropped, now);
        if (!c)
            return;
        struct pfd_msg m = {
            .kind = PFD_MSG_DISPATCH,
            .token = (uint64_t)(uintptr_t)c,
            .deadline_ns = c->deadline_ns,
            .arrival_ns = c->arrival_ns,
            .started_ns = c->started_ns,
            .upstream_ns = c->upstream_ns,
            .last_read_ns = c->last_read_ns,
            .critical = c->critical,
            .budget_source = c->budget_source,
            .budget_invalid = c->budget_invalid,
            .arrival_from_kernel = c->arrival_from_kernel,
            .draining = srv->draining,
            .peer_len = c->peer_len,
            .len = (uint32_t)c->len,
        };
        memcpy(&m.peer, &c->peer, sizeof m.peer);
        c->remote = r;
        c->released = 0;
        c->next = r->conns;
        r->conns = c;
        r->asking = 0;
        if (pfd_host_send(r, &m, c->buf, c->len, c->fd) != 0)
            pfd_host_drop(srv, r); /* died since it asked: c is counted lost and closed */
    }
}

/* The I/O thread is stopping: every thread gets STOP (a busy one finds its
 * channel closed when it gives its connection back), and the triage lets go
 * of its copies of the running connections: the workers finish them. */
void pfd_host_stop(struct pfd_server *srv)
{
    if (!srv->host)
        return;
    pfd_host_take_incoming(srv);
    while (srv->remotes) {
        struct pfd_remote *r = srv->remotes;
        if (r->asking && !r->stopped)
            pfd_host_stop_thread(r);
        while (r->conns) {
            struct pfd_conn *c = r->conns;
            r->conns = c->next;
            c->next = NULL;
            c->remote = NULL;
            c->state = PFD_CLOSED;
            pfd_conn_free(srv, c);
        }
        pfd_host_drop(srv, r);
    }
}
