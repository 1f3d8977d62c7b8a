/* The front door's engine: the calls the Python workers make, each with the GIL
 * released: take the next admitted connection, read its body, write the
 * response, give the place and the connection back. */
#include "pfd_internal.h"

/* Hand a connection back to the I/O thread (keep: 1 next head, 0 polite close, -1 close now). */
static void pfd_return(struct pfd_server *srv, struct pfd_conn *c, int keep)
{
    c->verdict = keep;
    pthread_mutex_lock(&srv->mutex);
    if (srv->io_done) {
        pthread_mutex_unlock(&srv->mutex);
        pfd_conn_free(srv, c);
        return;
    }
    c->next = srv->returned;
    srv->returned = c;
    int wake = atomic_exchange(&srv->io_sleeping, 0);
    pthread_mutex_unlock(&srv->mutex);
    if (wake)
        pfd_wake(srv);
}

/* Refuse, from a worker, connections dropped from the line at pickup. */
static void pfd_refuse_dropped(struct pfd_server *srv, struct pfd_conn *dropped)
{
    while (dropped) {
        struct pfd_conn *c = dropped;
        dropped = c->next;
        c->next = NULL;
        int keep = c->client_keep_alive && !pfd_has_body(c) && !srv->draining;
        const char *bytes = srv->cfg.answer[c->drop_answer][keep];
        size_t len = srv->cfg.answer_len[c->drop_answer][keep];
        int ok = pfd_send_all_nb(c->fd, bytes, len) == 0;
        if (ok && keep)
            pfd_conn_reset_for_next(c, c->head_len);
        pfd_return(srv, c, ok ? keep : -1);
    }
}

/* The next admitted connection, holding one of the `threads` places; NULL once
 * stopping, or at once when nothing may start now and `block` is 0 (*empty is
 * then set). A worker takes a connection only while the policies allow a start
 * (the concurrency limit, the reserved places); the others stay parked here.
 * A connection that may no longer start (deadline passed, too little budget
 * left, shed) is answered here, never started. */
struct pfd_conn *pfd_server_next(struct pfd_server *srv, int block, int *empty)
{
    *empty = 0;
    atomic_fetch_add(&srv->looking, 1);
    for (;;) {
        struct pfd_conn *dropped = NULL, **tail = &dropped, *c = NULL;
        int64_t now = 0;
        pthread_mutex_lock(&srv->mutex);
        while (!srv->stopping) {
            now = pfd_now_ns();
            /* The same call as the queue's hand-over: stale, expired and doomed
             * entries met on the way are dropped, the one that may start takes a place. */
            c = pfd_line_next(srv, now, &tail);
            if (c != NULL)
                break;
            if (dropped)
                break; /* answer those before waiting */
            if (!block) {
                *empty = 1;
                break;
            }
            atomic_fetch_sub(&srv->looking, 1);
            pthread_cond_wait(&srv->ready, &srv->mutex);
            atomic_fetch_add(&srv->looking, 1);
        }
        int stopping = srv->stopping;
        if (dropped)
            pfd_line_dropped_wake(srv);
        if (c != NULL) { /* taken only while not stopping, under this same hold of the mutex */
            c->state = PFD_RUNNING;
            c->started_ns = now;
            pfd_line_note_run(srv, PFD_NOTE_STARTED, c, now);
        }
        if (c != NULL || stopping || *empty)
            atomic_fetch_sub(&srv->looking, 1); /* done looking, under the mutex an admission holds */
        pthread_mutex_unlock(&srv->mutex);
        pfd_refuse_dropped(srv, dropped);
        if (c == NULL) {
            if (stopping || *empty)
                return NULL;
            continue;
        }
        pfd_conn_start_body(c);
        return c;
    }
}

/* Wait until `fd` is ready for `events` or `until_ns`; 1 ready, 0 timed out or failed. */
static int pfd_wait_fd(int fd, short events, int64_t until_ns)
{
    for (;;) {
        int64_t left = until_ns - pfd_now_ns();
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

static int64_t pfd_add_saturating(int64_t a, int64_t b)
{
    int64_t sum;
    return __builtin_add_overflow(a, b, &sum) ? INT64_MAX : sum;
}

/* Wait for the client until `until_ns`, within what is left of the request's
 * whole allowance for waiting on it (cfg.max_io_wait_ns): without that cap a
 * client trickling within a huge budget would keep the worker for all of it.
 * 1 ready, 0 timed out or failed. */
static int pfd_conn_wait(struct pfd_server *srv, struct pfd_conn *c, short events, int64_t until_ns)
{
    int64_t start = pfd_now_ns();
    int64_t cap = pfd_add_saturating(start, srv->cfg.max_io_wait_ns - pfd_read_counter(&c->io_waited_ns));
    int ready = pfd_wait_fd(c->fd, events, until_ns < cap ? until_ns : cap);
    pfd_count(&c->io_waited_ns, pfd_now_ns() - start);
    return ready;
}

/* The response begins: from now on no 100 Continue may go (it would land in
 * the response), and the whole response is due by its deadline, or by now if
 * the answer was computed after it, plus the write grace. */
static void pfd_conn_response_begins(struct pfd_server *srv, struct pfd_conn *c)
{
    if (c->write_until)
        return;
    atomic_store(&c->expect_continue, 0);
    int64_t now = pfd_now_ns();
    c->write_until = pfd_add_saturating(now > c->deadline_ns ? now : c->deadline_ns, srv->cfg.write_grace_ns);
}

/* Send what the socket takes now without waiting: bytes sent, or -1 when the client is gone. */
ssize_t pfd_conn_try_write(struct pfd_server *srv, struct pfd_conn *c, const char *p, size_t n)
{
    pfd_conn_response_begins(srv, c);
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
int pfd_conn_body_buffered(const struct pfd_conn *c)
{
    if (c->body_error || c->body_done)
        return 1;
    if (c->chunked)
        return c->cbuf_pos < c->cbuf_len;
    return c->pos < c->len;
}

/* Send everything, never waiting past `until_ns` nor io_timeout without progress; 0 sent, -1 not. */
static int pfd_conn_send(struct pfd_server *srv, struct pfd_conn *c, const char *p, size_t n, int64_t until_ns)
{
    int64_t stalled = pfd_now_ns() + srv->cfg.io_timeout_ns;
    while (n) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            stalled = pfd_now_ns() + srv->cfg.io_timeout_ns;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
            pfd_conn_wait(srv, c, POLLOUT, stalled < until_ns ? stalled : until_ns))
            continue;
        return -1;
    }
    return 0;
}

/* Write all of a response's bytes; 0 on success, -1 when the client is gone, stalled or too slow for the bounds. */
int pfd_conn_write(struct pfd_server *srv, struct pfd_conn *c, const char *p, size_t n)
{
    pfd_conn_response_begins(srv, c);
    return pfd_conn_send(srv, c, p, n, c->write_until);
}

/* Raw bytes of the body: first what came with the head, then the socket. A
 * read that may wait does so until the request's deadline at most: a client
 * trickling its body must not keep a worker beyond the time its answer is
 * worth anything. Bytes, PFD_BODY_AGAIN (only when !wait), or -1 with
 * c->body_error set. */
static ssize_t pfd_conn_raw(struct pfd_server *srv, struct pfd_conn *c, char *dst, size_t n, int wait)
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
        if (pfd_conn_send(srv, c, cont, sizeof cont - 1, c->deadline_ns) != 0) {
            c->body_error = PFD_BODY_LOST;
            return -1;
        }
    }
    int64_t stalled = pfd_now_ns() + srv->cfg.io_timeout_ns;
    int64_t until = stalled < c->deadline_ns ? stalled : c->deadline_ns;
    for (;;) {
        ssize_t r = recv(c->fd, dst, n, MSG_DONTWAIT);
        if (r > 0) {
            c->last_read_ns = pfd_now_ns();
            return r;
        }
        if (r == 0) {
            c->body_error = PFD_BODY_LOST; /* the client closed before the body ended */
            return -1;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            c->body_error = PFD_BODY_LOST;
            return -1;
        }
        if (!wait)
            return PFD_BODY_AGAIN;
        if (!pfd_conn_wait(srv, c, POLLIN, until)) {
            c->body_error = PFD_BODY_TIMEOUT;
            return -1;
        }
    }
}

/* Up to n bytes of the decoded request body: bytes, 0 at its end, -1 on a
 * failed body (c->body_error says why), PFD_BODY_AGAIN when !wait and nothing is here. */
static ssize_t pfd_conn_body(struct pfd_server *srv, struct pfd_conn *c, char *dst, size_t n, int wait)
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
        ssize_t r = pfd_conn_raw(srv, c, dst, n, wait);
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
            c->cbuf = malloc(PFD_READ_CHUNK);
            if (!c->cbuf) {
                c->body_error = PFD_BODY_LOST;
                return -1;
            }
            c->cbuf_cap = PFD_READ_CHUNK;
        }
        ssize_t r = pfd_conn_raw(srv, c, c->cbuf, c->cbuf_cap, wait);
        if (r < 0)
            return r;
        size_t size = (size_t)r;
        ssize_t rest = pfd_chunked_decode(&c->decoder, c->cbuf, &size);
        if (rest == -1) {
            c->body_error = PFD_BODY_MALFORMED;
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
                    c->body_error = PFD_BODY_LOST;
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
ssize_t pfd_conn_read_body(struct pfd_server *srv, struct pfd_conn *c, char *dst, size_t n)
{
    return pfd_conn_body(srv, c, dst, n, 1);
}

/* The app is done: drop the rest of the body it left unread, from what has
 * already arrived (never waiting, at most cfg.max_drain_bytes). 1 when the
 * body is all read, so the connection may carry the next request, which
 * starts right after it. */
int pfd_conn_discard_body(struct pfd_server *srv, struct pfd_conn *c)
{
    char sink[PFD_READ_CHUNK];
    atomic_store(&c->expect_continue, 0); /* the final response is next: asking for the body now is too late */
    for (int64_t left = srv->cfg.max_drain_bytes; left > 0 && (!c->body_done || c->cbuf_pos < c->cbuf_len);) {
        ssize_t r = pfd_conn_body(srv, c, sink, sizeof sink, 0);
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
int pfd_conn_body_arrived(const struct pfd_conn *c)
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
void pfd_conn_release(struct pfd_server *srv, struct pfd_conn *c)
{
    if (c->channel) {
        pfd_channel_release(c); /* the place is the triage's */
        return;
    }
    int64_t now = pfd_now_ns();
    pthread_mutex_lock(&srv->mutex);
    /* The service time (started -> finished) feeds the learned estimate and
     * Vegas; the request still counts as in flight for its own sample. */
    pfd_line_release(srv, c->critical, now - c->started_ns);
    pfd_line_note_run(srv, PFD_NOTE_ENDED, c, now);
    pthread_cond_broadcast(&srv->idle);
    /* A place is free, and the limit may have risen: every parked worker looks again. */
    if (pfd_waiting(srv))
        pthread_cond_broadcast(&srv->ready);
    pthread_mutex_unlock(&srv->mutex);
}

/* The connection goes back to the I/O thread, for its next head (keep) or a polite close. */
void pfd_conn_hand_back(struct pfd_server *srv, struct pfd_conn *c, int keep)
{
    if (keep && (!c->body_done || c->body_error || c->cbuf_pos != c->cbuf_len))
        keep = 0; /* the rest of an unread body would be taken for the next head */
    if (keep)
        pfd_conn_reset_for_next(c, c->pos); /* what follows the body is the next head */
    if (c->channel)
        pfd_channel_hand_back(srv, c, keep ? 1 : 0); /* with the place too, when it was not given back yet */
    else
        pfd_return(srv, c, keep ? 1 : 0);
}

/* The worker is done with c: its place is freed and the connection handed back. */
void pfd_conn_finish(struct pfd_server *srv, struct pfd_conn *c, int keep)
{
    if (!c->channel) /* over a channel the hand-back gives the place back too, in one message */
        pfd_conn_release(srv, c);
    pfd_conn_hand_back(srv, c, keep);
}

/* An address as text and port, for REMOTE_ADDR / SERVER_NAME; 0 when not IP. */
int pfd_addr_text(const struct sockaddr_storage *ss, char *host, size_t hostlen, int *port)
{
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        *port = ntohs(a->sin_port);
        /* Dotted quad by hand: inet_ntop formats it with sprintf, about 1.7 k
         * instructions, asked for every request's REMOTE_ADDR. */
        const unsigned char *b = (const unsigned char *)&a->sin_addr;
        char text[16], *p = text;
        for (int i = 0; i < 4; i++) {
            unsigned v = b[i];
            if (v >= 100)
                *p++ = (char)('0' + v / 100);
            if (v >= 10)
                *p++ = (char)('0' + v / 10 % 10);
            *p++ = (char)('0' + v % 10);
            *p++ = i < 3 ? '.' : '\0';
        }
        if ((size_t)(p - text) > hostlen)
            return 0;
        memcpy(host, text, (size_t)(p - text));
        return 1;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        *port = ntohs(a->sin6_port);
        return inet_ntop(AF_INET6, &a->sin6_addr, host, (socklen_t)hostlen) != NULL;
    }
    return 0;
}
