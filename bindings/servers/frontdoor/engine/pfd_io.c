/* The front door's engine: the I/O thread, which owns the listeners, epoll and
 * every connection reading a head or lingering; it admits or refuses each head
 * and never touches Python. */
#include "pfd_internal.h"

static void pfd_io_arm_head(struct pfd_server *srv, struct pfd_conn *c, int64_t now);
static int pfd_io_try_head(struct pfd_server *srv, struct pfd_conn *c, int64_t now, size_t last_len);
static void pfd_io_close(struct pfd_server *srv, struct pfd_conn *c);

/* A connection reading a head waits for its next bytes: armed for one event
 * (EPOLLONESHOT), by MOD when it is still registered from an earlier head.
 * On failure it is closed: the caller must not touch it again. */
static void pfd_io_rearm(struct pfd_server *srv, struct pfd_conn *c)
{
    if (c->armed)
        return;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT, .data.ptr = c};
    int failed = c->registered ? epoll_ctl(srv->epfd, EPOLL_CTL_MOD, c->fd, &ev) != 0 &&
                                     epoll_ctl(srv->epfd, EPOLL_CTL_ADD, c->fd, &ev) != 0
                               : epoll_ctl(srv->epfd, EPOLL_CTL_ADD, c->fd, &ev) != 0;
    if (failed) {
        pfd_io_close(srv, c);
        return;
    }
    c->registered = 1;
    c->armed = 1;
}

static void pfd_io_close(struct pfd_server *srv, struct pfd_conn *c)
{
    if (c->state == PFD_READING)
        pfd_list_remove(&srv->heads, c);
    else if (c->state == PFD_DRAINING)
        pfd_list_remove(&srv->lingering, c);
    c->state = PFD_CLOSED;
    pfd_conn_free(srv, c); /* and out of epoll */
}

/* A polite close: shut the write side, read and drop what the client still sends. */
static void pfd_io_linger(struct pfd_server *srv, struct pfd_conn *c, int64_t now)
{
    if (c->state == PFD_READING)
        pfd_list_remove(&srv->heads, c);
    if (srv->stopping || shutdown(c->fd, SHUT_WR) != 0) {
        c->state = PFD_CLOSED;
        pfd_conn_free(srv, c);
        return;
    }
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
    if (epoll_ctl(srv->epfd, EPOLL_CTL_MOD, c->fd, &ev) != 0 && epoll_ctl(srv->epfd, EPOLL_CTL_ADD, c->fd, &ev) != 0) {
        c->state = PFD_CLOSED;
        pfd_conn_free(srv, c);
        return;
    }
    c->registered = 1;
    c->armed = 0; /* level-triggered from here on, until it closes */
    /* Each lingering socket is a descriptor and a buffer held for a client
     * that was already answered: a flood of refused connections may not grow
     * them without bound. The oldest has had the longest to read its answer.
     * Its memory outlives this turn: an event for it may still wait in the
     * batch being handled, and is skipped by its state. */
    while (srv->lingering.count >= srv->cfg.max_lingering && srv->lingering.head) {
        struct pfd_conn *old = srv->lingering.head;
        pfd_list_remove(&srv->lingering, old);
        pfd_conn_close_fd(srv, old->fd);
        old->fd = -1;
        old->state = PFD_CLOSED;
        old->next = srv->graveyard;
        srv->graveyard = old;
    }
    c->state = PFD_DRAINING;
    c->drained = 0;
    c->timer_ns = now + srv->cfg.linger_ns;
    pfd_list_push(&srv->lingering, c);
}

/* An overload refusal with the line's measured wait in place of the canned
 * Retry-After: whole seconds (at least 1, as HTTP has no smaller unit) and the
 * same wait in ms beside it. Returns its length in `out`, or 0 to send the
 * canned answer as it is (no measurement yet, or no room). */
static size_t pfd_io_answer_with_wait(const struct pfd_server *srv, int answer, int keep, char *out, size_t cap)
{
    size_t at = srv->wait_at[answer][keep], end = srv->wait_end[answer][keep];
    size_t len = srv->cfg.answer_len[answer][keep];
    int64_t wait_ns = at ? prazo_line_retry_after_ns(srv->line) : 0;
    if (wait_ns <= 0)
        return 0;
    long long seconds = (wait_ns + 999999999LL) / 1000000000LL, ms = (wait_ns + 999999LL) / 1000000LL;
    char lines[96];
    int n = snprintf(lines, sizeof lines, "Retry-After: %lld\r\nX-Prazo-Retry-After-Ms: %lld\r\n", seconds, ms);
    if (n <= 0 || (size_t)n >= sizeof lines || at + (size_t)n + (len - end) > cap)
        return 0;
    const char *bytes = srv->cfg.answer[answer][keep];
    memcpy(out, bytes, at);
    memcpy(out + at, lines, (size_t)n);
    memcpy(out + at + (size_t)n, bytes + end, len - end);
    return at + (size_t)n + (len - end);
}

/* Write a canned answer; then keep the connection for its next head, or close it politely.
 * The connection is out of every list (or PFD_READING) when this is called. */
static void pfd_io_answer(struct pfd_server *srv, struct pfd_conn *c, int answer, int64_t now)
{
    int keep = answer < PFD_A_COUNT_KEEPABLE && answer != PFD_A_SHUTTING_DOWN && c->head_len && c->client_keep_alive &&
               !pfd_has_body(c) && !srv->draining;
    const char *bytes = srv->cfg.answer[answer][keep];
    size_t len = srv->cfg.answer_len[answer][keep];
    char waited[1024];
    size_t waited_len = pfd_io_answer_with_wait(srv, answer, keep, waited, sizeof waited);
    if (waited_len) {
        bytes = waited;
        len = waited_len;
    }
    if (pfd_send_all_nb(c->fd, bytes, len) != 0) {
        if (c->state == PFD_READING)
            pfd_list_remove(&srv->heads, c);
        c->state = PFD_CLOSED;
        pfd_conn_free(srv, c);
        return;
    }
    if (!keep) {
        pfd_io_linger(srv, c, now);
        return;
    }
    size_t consumed = c->head_len;
    pfd_conn_reset_for_next(c, consumed);
    if (c->state == PFD_READING)
        pfd_list_remove(&srv->heads, c); /* its head timer starts again */
    pfd_io_arm_head(srv, c, now);
}

/* A complete head: decide. Each arrival's offered and its outcome are counted
 * together under the mutex, which stats() holds while it reads: the counters
 * balance in every snapshot, not only once the server is idle. */
static void pfd_io_admit(struct pfd_server *srv, struct pfd_conn *c, int64_t now)
{
    double ms = 0.0;
    int invalid, source;
    int have = pfd_incoming_budget(c->headers, c->num_headers, &ms, &invalid, &source);
    c->budget_source = source;
    c->budget_invalid = invalid;
    /* A trusted front proxy's queue time comes off here, before the line sees
     * the deadline: a budget used up in the proxy is answered 504 below, and
     * the line expires and orders by the corrected deadline. */
    c->upstream_ns = pfd_upstream_ns(&srv->cfg, c);
    if (c->upstream_ns > 0)
        pfd_count(&srv->upstream_stamps, 1);
    c->deadline_ns =
        pfd_deadline_for(srv->cfg.default_budget_ms, srv->cfg.max_budget_ms, have, ms, c->arrival_ns, c->upstream_ns);
    if (srv->draining) {
        pthread_mutex_lock(&srv->mutex);
        prazo_add(&srv->line->c.offered, 1);
        pfd_count(&srv->shutting_down, 1);
        pthread_mutex_unlock(&srv->mutex);
        pfd_io_answer(srv, c, PFD_A_SHUTTING_DOWN, now);
        return;
    }
    c->critical = pfd_is_critical(srv, c);
    struct pfd_conn *dropped = NULL, **tail = &dropped;
    int answer;
    pthread_mutex_lock(&srv->mutex);
    if (srv->draining) {
        /* Drained between the look above and the mutex: too late to say shutting-down. */
        prazo_add(&srv->line->c.offered, 1);
        prazo_add(&srv->line->c.rejected_full, 1);
        answer = PFD_A_QUEUE_FULL;
    } else {
        /* Expired, doomed, full (after shedding stale entries, and a critical
         * arrival evicting the newest normal waiter), or into the line. */
        answer = pfd_line_admit(srv, c, now, &tail);
    }
    if (answer < 0) {
        pfd_list_remove(&srv->heads, c);
        /* Its event disarmed it (EPOLLONESHOT); only a head read at accept, before any event, is still armed. */
        if (c->armed) {
            epoll_ctl(srv->epfd, EPOLL_CTL_DEL, c->fd, NULL);
            c->armed = 0;
            c->registered = 0;
        }
        pfd_count(&srv->admitted, 1);
        srv->wakes_owed++; /* paid by pfd_io_wake_workers, before this thread sleeps at the latest */
    }
    if (dropped)
        pfd_line_dropped_wake(srv);
    pthread_mutex_unlock(&srv->mutex);
    pfd_io_answer_dropped(srv, dropped, now);
    if (answer >= 0)
        pfd_io_answer(srv, c, answer, now);
}

/* 1 while the head is still incomplete (c stays with the caller), 0 once c was
 * admitted, answered or closed (the caller must not touch it again). */
static int pfd_io_try_head(struct pfd_server *srv, struct pfd_conn *c, int64_t now, size_t last_len)
{
    switch (pfd_judge_head(c, srv->cfg.max_head, last_len)) {
    case PFD_HEAD_COMPLETE:
        pfd_io_admit(srv, c, now);
        return 0;
    case PFD_HEAD_BAD:
        c->head_len = 0;
        pfd_count(&srv->bad_requests, 1);
        pfd_io_answer(srv, c, PFD_A_BAD_REQUEST, now);
        return 0;
    case PFD_HEAD_TOO_LARGE:
        c->head_len = 0;
        pfd_count(&srv->heads_too_large, 1);
        pfd_io_answer(srv, c, PFD_A_HEAD_TOO_LARGE, now);
        return 0;
    default:
        return 1;
    }
}

/* Read what arrived; the first bytes of a head take the kernel's receive stamp. */
static void pfd_io_read_head(struct pfd_server *srv, struct pfd_conn *c, int64_t now)
{
    for (;;) {
        if (c->cap - c->len < 1024) {
            size_t cap = c->cap ? c->cap * 2 : PFD_READ_CHUNK;
            if (cap > srv->cfg.max_head + PFD_READ_CHUNK)
                cap = srv->cfg.max_head + PFD_READ_CHUNK;
            if (cap <= c->len) {
                if (pfd_io_try_head(srv, c, now, 0))
                    pfd_io_rearm(srv, c);
                return;
            }
            char *nb = realloc(c->buf, cap);
            if (!nb) {
                pfd_io_close(srv, c);
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
            struct msghdr msg = {
                .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
            n = recvmsg(c->fd, &msg, MSG_DONTWAIT);
            c->arrival_ns = now;
            c->arrival_from_kernel = 0;
            if (n > 0) {
                for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
                    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_TIMESTAMPNS) {
                        struct timespec stamp, real;
                        memcpy(&stamp, CMSG_DATA(cm), sizeof stamp);
                        clock_gettime(CLOCK_REALTIME, &real);
                        int64_t age =
                            ((int64_t)real.tv_sec - stamp.tv_sec) * 1000000000LL + (real.tv_nsec - stamp.tv_nsec);
                        /* The wall clock may have stepped: believe only a sane age. */
                        if (age >= 0 && age < 60LL * 1000000000LL) {
                            c->arrival_ns = pfd_now_ns() - age;
                            /* A pause between the two clock reads can put the arrival after
                             * this turn's `now`; capped there, the deadline is at worst a few us
                             * early, never late, and a budget used up upstream is refused on
                             * arrival instead of looking not yet passed and waiting in line. */
                            if (c->arrival_ns > now)
                                c->arrival_ns = now;
                            c->arrival_from_kernel = 1;
                            pfd_count(&srv->kernel_stamps, 1);
                        }
                    }
                }
            }
        } else {
            n = recv(c->fd, c->buf + c->len, c->cap - c->len, MSG_DONTWAIT);
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            pfd_io_rearm(srv, c);
            return;
        }
        if (n <= 0) {
            pfd_io_close(srv, c);
            return;
        }
        size_t last = c->len;
        c->len += (size_t)n;
        c->last_read_ns = now;
        if (!pfd_io_try_head(srv, c, now, last))
            return;
        if ((size_t)n < c->cap - last) {
            pfd_io_rearm(srv, c); /* all there was; epoll says when more comes */
            return;
        }
    }
}

static void pfd_io_drain(struct pfd_server *srv, struct pfd_conn *c)
{
    char sink[PFD_READ_CHUNK];
    for (;;) {
        ssize_t n = recv(c->fd, sink, sizeof sink, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        c->drained += n > 0 ? n : 0;
        if (n <= 0 || c->drained >= srv->cfg.max_drain_bytes) {
            pfd_io_close(srv, c);
            return;
        }
    }
}

static void pfd_io_accept(struct pfd_server *srv, int lfd, int64_t now)
{
    for (;;) {
        struct pfd_conn *c = calloc(1, sizeof *c);
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
            return; /* EAGAIN & co: epoll tells us again */
        }
        c->fd = fd;
        /* TCP_NODELAY and SO_TIMESTAMPNS come from the listener (Linux copies them on
         * accept): no system call here for them, the refusal path is the hot one. */
        pfd_count(&srv->accepted, 1);
        pfd_count(&srv->open_connections, 1);
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT, .data.ptr = c};
        if (epoll_ctl(srv->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
            pfd_conn_free(srv, c);
            continue;
        }
        c->registered = 1;
        c->armed = 1;
        c->state = PFD_READING;
        c->timer_ns = now + srv->cfg.header_timeout_ns;
        pfd_list_push(&srv->heads, c);
        /* The head is often here already: read it now rather than after another epoll_wait. */
        pfd_io_read_head(srv, c, now);
    }
}

static void pfd_io_arm_head(struct pfd_server *srv, struct pfd_conn *c, int64_t now)
{
    c->state = PFD_READING;
    c->timer_ns = now + srv->cfg.header_timeout_ns;
    pfd_list_push(&srv->heads, c);
    /* A pipelined head already here goes first; armed only while it waits for bytes. */
    if (c->len && !pfd_io_try_head(srv, c, now, 0))
        return;
    pfd_io_rearm(srv, c);
}

void pfd_io_close_listeners(struct pfd_server *srv)
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
static void pfd_io_take_returned(struct pfd_server *srv, int64_t now)
{
    pthread_mutex_lock(&srv->mutex);
    struct pfd_conn *c = srv->returned;
    srv->returned = NULL;
    pthread_mutex_unlock(&srv->mutex);
    while (c) {
        struct pfd_conn *next = c->next;
        c->next = c->prev = NULL;
        pfd_io_returned(srv, c, c->verdict, now);
        c = next;
    }
}

/* A connection back from a worker (in this process or another), in no list:
 * its next head (verdict 1), a polite close (0) or the end (-1).
 *
 * While the server drains, a kept-alive connection with bytes of its next
 * request already here (pipelined behind the one that ran) reads that head like
 * any other head of the drain, answered 503 shutting-down (pfd_io_admit); one
 * with nothing of a next request is done, as an idle connection is when the
 * drain starts. Once it stops, such a request is answered 503 shutting-down at
 * once: the drain ends when the place of the request before it comes back, which
 * may be just before its connection does. Its client is told, never left with a
 * connection closed under a request it sent. */
void pfd_io_returned(struct pfd_server *srv, struct pfd_conn *c, int verdict, int64_t now)
{
    if (verdict == 1 && c->len > 0 && srv->stopping) {
        pthread_mutex_lock(&srv->mutex);
        prazo_add(&srv->line->c.offered, 1);
        pfd_count(&srv->shutting_down, 1);
        pthread_mutex_unlock(&srv->mutex);
        pfd_send_all_nb(c->fd, srv->cfg.answer[PFD_A_SHUTTING_DOWN][0], srv->cfg.answer_len[PFD_A_SHUTTING_DOWN][0]);
        c->state = PFD_CLOSED;
        pfd_conn_free(srv, c);
    } else if (verdict == 1 && !srv->stopping && (!srv->draining || c->len > 0)) {
        pfd_io_arm_head(srv, c, now);
    } else if (verdict == 0 && !srv->stopping) {
        c->state = PFD_RUNNING; /* in no list yet: pfd_io_linger adds it to lingering */
        pfd_io_linger(srv, c, now);
    } else {
        c->state = PFD_CLOSED;
        pfd_conn_free(srv, c);
    }
}

/* Refuse connections dropped from the line, each with its drop_answer. */
void pfd_io_answer_dropped(struct pfd_server *srv, struct pfd_conn *dropped, int64_t now)
{
    while (dropped) {
        struct pfd_conn *c = dropped;
        dropped = c->next;
        c->next = NULL;
        pfd_io_answer(srv, c, c->drop_answer, now);
    }
}

/* Waiting connections that may no longer start (deadline passed, too little
 * budget left for the expected service time, or shed by CoDel): answered now,
 * without a worker. Returns when to look again (INT64_MAX when never). */
static int64_t pfd_io_expire_line(struct pfd_server *srv, int64_t now)
{
    struct pfd_conn *dropped = NULL, **tail = &dropped;
    pthread_mutex_lock(&srv->mutex);
    int64_t next = pfd_line_sweep(srv, now, &tail);
    if (dropped)
        pfd_line_dropped_wake(srv);
    pthread_mutex_unlock(&srv->mutex);
    pfd_io_answer_dropped(srv, dropped, now);
    return next;
}

/* Wake a worker for each entry admitted since the last call that no worker
 * already looking will take (a look about to happen is never missed: `looking`
 * is counted before the mutex is taken). */
static void pfd_io_wake_workers(struct pfd_server *srv)
{
    if (srv->wakes_owed == 0)
        return;
    srv->wakes_owed = 0;
    pthread_mutex_lock(&srv->mutex);
    int64_t unseen = pfd_waiting(srv) - atomic_load(&srv->looking);
    if (unseen >= srv->cfg.threads)
        pthread_cond_broadcast(&srv->ready);
    else
        for (int64_t i = 0; i < unseen; i++)
            pthread_cond_signal(&srv->ready);
    pthread_mutex_unlock(&srv->mutex);
}

void *pfd_io_main(void *arg)
{
    struct pfd_server *srv = arg;
    struct epoll_event events[128];
    int drained_seen = 0;
    for (;;) {
        while (srv->graveyard) {
            struct pfd_conn *c = srv->graveyard;
            srv->graveyard = c->next;
            pfd_conn_free(srv, c);
        }
        int64_t now = pfd_now_ns();
        pfd_host_take_incoming(srv);
        pthread_mutex_lock(&srv->mutex);
        int draining = srv->draining, stopping = srv->stopping;
        pthread_mutex_unlock(&srv->mutex);
        if (draining && !drained_seen) {
            drained_seen = 1;
            pfd_io_close_listeners(srv);
            /* Connections that have sent nothing of a next request are done. */
            for (struct pfd_conn *c = srv->heads.head, *n; c; c = n) {
                n = c->next;
                if (c->len == 0)
                    pfd_io_close(srv, c);
            }
        }
        if (stopping) {
            pfd_io_close_listeners(srv);
            /* What still waits is answered 503 shutting-down; then every connection closes. */
            pthread_mutex_lock(&srv->mutex);
            struct pfd_conn *waiting = NULL, **tail = &waiting;
            pfd_count(&srv->shutting_down, pfd_line_take_all(srv, &tail));
            pthread_cond_broadcast(&srv->idle);
            pthread_mutex_unlock(&srv->mutex);
            while (waiting) {
                struct pfd_conn *c = waiting;
                waiting = c->next;
                pfd_send_all_nb(c->fd, srv->cfg.answer[PFD_A_SHUTTING_DOWN][0],
                                srv->cfg.answer_len[PFD_A_SHUTTING_DOWN][0]);
                c->state = PFD_CLOSED;
                pfd_conn_free(srv, c);
            }
            pfd_io_take_returned(srv, now);
            pfd_host_stop(srv);
            pthread_mutex_lock(&srv->mutex);
            srv->io_done = 1; /* from here on workers free what they finish */
            struct pfd_conn *late = srv->returned;
            srv->returned = NULL;
            pthread_mutex_unlock(&srv->mutex);
            while (late) {
                struct pfd_conn *c = late;
                late = c->next;
                pfd_conn_free(srv, c);
            }
            while (srv->heads.head)
                pfd_io_close(srv, srv->heads.head);
            while (srv->lingering.head)
                pfd_io_close(srv, srv->lingering.head);
            return NULL;
        }
        pfd_io_take_returned(srv, now);
        if (srv->accept_paused_until && now >= srv->accept_paused_until && !draining) {
            srv->accept_paused_until = 0;
            for (int i = 0; i < srv->n_listen; i++) {
                struct epoll_event lev = {.events = EPOLLIN, .data.ptr = &srv->listen_fds[i]};
                if (srv->listen_fds[i] >= 0)
                    epoll_ctl(srv->epfd, EPOLL_CTL_ADD, srv->listen_fds[i], &lev);
            }
        }
        while (srv->heads.head && srv->heads.head->timer_ns <= now) {
            struct pfd_conn *c = srv->heads.head;
            if (c->len == 0) {
                pfd_io_close(srv, c); /* silent or idle kept-alive: nothing to answer */
            } else {
                pfd_count(&srv->header_timeouts, 1);
                c->head_len = 0;
                pfd_io_answer(srv, c, PFD_A_HEADER_TIMEOUT, now);
            }
        }
        while (srv->lingering.head && srv->lingering.head->timer_ns <= now)
            pfd_io_close(srv, srv->lingering.head);
        int64_t next = pfd_io_expire_line(srv, now);
        /* A host's triage hands what may start now to its idle worker threads. */
        pfd_host_dispatch(srv, now);
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
            int64_t wait = next - pfd_now_ns();
            int64_t ms = wait <= 0 ? 0 : (wait + 999999) / 1000000;
            if (ms < timeout_ms)
                timeout_ms = (int)ms;
        }
        pfd_io_wake_workers(srv);
        /* A worker's hand-back writes the eventfd only when this thread sleeps
         * (io_sleeping, set under the mutex with the look at `returned`). */
        pthread_mutex_lock(&srv->mutex);
        if (srv->returned != NULL)
            timeout_ms = 0;
        else
            atomic_store(&srv->io_sleeping, 1);
        pthread_mutex_unlock(&srv->mutex);
        int n = epoll_wait(srv->epfd, events, 128, timeout_ms);
        atomic_store(&srv->io_sleeping, 0); /* a hand-back that took it meanwhile only wrote the eventfd once more */
        now = pfd_now_ns();
        for (int i = 0; i < n; i++) {
            void *ptr = events[i].data.ptr;
            if ((uintptr_t)ptr & PFD_REMOTE_TAG) {
                pfd_host_event(srv, (struct pfd_remote *)((uintptr_t)ptr & ~PFD_REMOTE_TAG), events[i].events, now);
                continue;
            }
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
                    pfd_io_accept(srv, srv->listen_fds[listener], now);
                continue;
            }
            struct pfd_conn *c = ptr;
            if (c->state == PFD_READING) {
                c->armed = 0; /* EPOLLONESHOT: this event disarmed it */
                pfd_io_read_head(srv, c, now);
            } else if (c->state == PFD_DRAINING)
                pfd_io_drain(srv, c);
        }
        pfd_io_wake_workers(srv);
    }
}
