/* The front door's engine: what every owner of a connection does with it
 * (free it, write a canned answer, wake the I/O thread, forget an answered head). */
#include "pfd_internal.h"

void pfd_conn_close_fd(struct pfd_server *srv, int fd)
{
    /* Another process may hold a copy of the descriptor: a host's worker, or any
     * process the app forked (multiprocessing's fork start method copies every
     * descriptor). close() takes it out of epoll only once every copy is closed,
     * and epoll would go on reporting the freed connection; and close() ends the
     * connection only then, so its client would wait on a socket no one reads.
     * The engine that owns the connection (one process's I/O thread, a host's
     * triage) ends it for every copy: out of epoll, then shutdown(). A worker
     * process's engine owns none (it hands them back) and has no epoll. */
    if (!srv->worker_only) {
        epoll_ctl(srv->epfd, EPOLL_CTL_DEL, fd, NULL);
        shutdown(fd, SHUT_RDWR);
    }
    close(fd);
    pfd_count(&srv->open_connections, -1);
}

void pfd_conn_free(struct pfd_server *srv, struct pfd_conn *c)
{
    if (c->fd >= 0)
        pfd_conn_close_fd(srv, c->fd);
    free(c->buf);
    free(c->cbuf);
    free(c);
}

int pfd_send_all_nb(int fd, const char *p, size_t n)
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

void pfd_wake(struct pfd_server *srv)
{
    uint64_t one = 1;
    ssize_t ignored = write(srv->evfd, &one, sizeof one);
    (void)ignored;
}

/* Forget the head just answered, keeping any pipelined bytes after it. */
void pfd_conn_reset_for_next(struct pfd_conn *c, size_t consumed)
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

/* A worker process gave the connection back with these bytes after the body
 * (read from the socket there): they are the start of its next head. 0, or
 * -1 when memory ran out (the bytes cannot be kept: close the connection). */
int pfd_conn_take_pending(struct pfd_conn *c, const char *bytes, size_t n, int64_t last_read_ns)
{
    if (n > c->cap) {
        char *nb = realloc(c->buf, n);
        if (!nb)
            return -1;
        c->buf = nb;
        c->cap = n;
    }
    if (n)
        memcpy(c->buf, bytes, n);
    c->len = n;
    c->last_read_ns = last_read_ns;
    pfd_conn_reset_for_next(c, 0);
    return 0;
}
