/* The front door's engine on a host of worker processes: a worker process's
 * side (pfd_host.c is the triage's). Each Python worker thread has a channel
 * and takes its connections from it; the connection it gets is a struct
 * pfd_conn like a local one (the same head, parsed again from the same bytes,
 * the triage's deadline and arrival), so the body reads and the writes are
 * the ones of pfd_worker.c. Giving the place back (RELEASE), the connection
 * (DONE) or both (FINISH) are messages: the triage owns the connection again
 * once this process has closed its copy of the descriptor. */
#include "pfd_internal.h"

/* A worker process's engine: the configuration the body reads and writes use, no I/O thread, no line of its own. */
struct pfd_server *pfd_server_new_worker(const struct pfd_config *cfg)
{
    struct pfd_server *srv = pfd_server_alloc(cfg);
    if (srv)
        srv->worker_only = 1;
    return srv;
}

static int pfd_channel_send(struct pfd_channel *ch, const struct pfd_msg *m, const char *bytes, size_t n)
{
    struct iovec iov[2] = {{.iov_base = (void *)m, .iov_len = sizeof *m}, {.iov_base = (void *)bytes, .iov_len = n}};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = n ? 2 : 1};
    for (;;) {
        ssize_t w = sendmsg(ch->fd, &msg, MSG_NOSIGNAL);
        if (w >= 0)
            return 0;
        if (errno != EINTR)
            return -1; /* the triage is gone: the thread learns it at its next ask */
    }
}

static void pfd_channel_close_passed(struct msghdr *msg)
{
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(msg); cm; cm = CMSG_NXTHDR(msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
            close(fd);
        }
    }
}

/* A DISPATCH whose connection cannot run here goes back as undelivered: the
 * triage closes it and frees its place, and takes this thread as asking again
 * (so the caller waits for the next DISPATCH without a HELLO). */
static void pfd_channel_undelivered(struct pfd_channel *ch, uint64_t token)
{
    struct pfd_msg back = {.kind = PFD_MSG_FINISH, .verdict = PFD_UNDELIVERED, .token = token};
    (void)pfd_channel_send(ch, &back, NULL, 0);
}

/* The connection a DISPATCH brings, or NULL when its bytes are no head (then it is already given back, closed). */
static struct pfd_conn *pfd_channel_conn(struct pfd_server *srv, struct pfd_channel *ch, const struct pfd_msg *m,
                                         const char *bytes, int fd)
{
    struct pfd_conn *c = calloc(1, sizeof *c);
    char *buf = malloc(m->len ? m->len : 1);
    if (c && buf) {
        memcpy(buf, bytes, m->len);
        c->fd = fd;
        c->buf = buf;
        c->len = c->cap = m->len;
        pfd_count(&srv->open_connections, 1);
        if (pfd_parse_head(c, 0) == 1) {
            c->state = PFD_RUNNING;
            c->channel = ch;
            c->token = m->token;
            c->deadline_ns = m->deadline_ns;
            c->arrival_ns = m->arrival_ns;
            c->started_ns = m->started_ns;
            c->queued_ns = m->arrival_ns;
            c->upstream_ns = m->upstream_ns;
            c->last_read_ns = m->last_read_ns;
            c->critical = m->critical;
            c->budget_source = m->budget_source;
            c->budget_invalid = m->budget_invalid;
            c->arrival_from_kernel = m->arrival_from_kernel;
            c->peer_len = m->peer_len <= sizeof c->peer ? m->peer_len : sizeof c->peer;
            memcpy(&c->peer, &m->peer, sizeof c->peer);
            if (m->draining)
                c->client_keep_alive = 0; /* as a one-process front door answers while it drains */
            pfd_conn_start_body(c);
            return c;
        }
        pfd_conn_free(srv, c); /* closes fd */
    } else {
        free(c);
        free(buf);
        close(fd);
    }
    /* The triage parsed these very bytes: this cannot happen short of memory. */
    pfd_channel_undelivered(ch, m->token);
    return NULL;
}

/* Tell the triage this thread takes a connection now, before its first
 * pfd_channel_next (which then sends nothing): a worker is ready once every
 * thread has asked. 0, or -1 when the triage is gone. */
int pfd_channel_ask(struct pfd_channel *ch)
{
    struct pfd_msg hello = {.kind = PFD_MSG_HELLO};
    if (pfd_channel_send(ch, &hello, NULL, 0) != 0)
        return -1;
    atomic_store(&ch->asked, 1);
    return 0;
}

/* The next connection for this thread, holding one of the host's places; NULL
 * once the triage says STOP or is gone. Blocks (call it without the GIL). */
struct pfd_conn *pfd_channel_next(struct pfd_server *srv, struct pfd_channel *ch)
{
    if (!ch->scratch) {
        ch->scratch_cap = sizeof(struct pfd_msg) + srv->cfg.max_head + 3 * PFD_READ_CHUNK;
        ch->scratch = malloc(ch->scratch_cap);
        if (!ch->scratch)
            return NULL;
    }
    /* A place given back already told the triage this thread asks again. */
    if (!atomic_exchange(&ch->asked, 0)) {
        struct pfd_msg hello = {.kind = PFD_MSG_HELLO};
        if (pfd_channel_send(ch, &hello, NULL, 0) != 0)
            return NULL;
    }
    for (;;) {
        char control[CMSG_SPACE(sizeof(int) * 4)];
        struct iovec iov = {.iov_base = ch->scratch, .iov_len = ch->scratch_cap};
        struct msghdr msg = {
            .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
        ssize_t n = recvmsg(ch->fd, &msg, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return NULL;
        struct pfd_msg m;
        int fd = -1, fds = 0;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
            if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
                fds += (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                memcpy(&fd, CMSG_DATA(cm), sizeof fd);
            }
        memcpy(&m, ch->scratch, (size_t)n < sizeof m ? (size_t)n : sizeof m);
        int whole = (size_t)n >= sizeof m && !(msg.msg_flags & MSG_TRUNC) && m.len == (size_t)n - sizeof m;
        if (whole && m.kind == PFD_MSG_DISPATCH && fds == 0 && (msg.msg_flags & MSG_CTRUNC)) {
            /* The kernel dropped the descriptor: this process had no free one
             * (EMFILE) for the moment. The channel is sound, and ending the
             * thread would lose a place for good (or, when something still
             * holds this channel open, leave the client waiting). */
            pfd_channel_undelivered(ch, m.token);
            continue;
        }
        if (!whole || (msg.msg_flags & MSG_CTRUNC) || m.kind != PFD_MSG_DISPATCH || fds != 1) {
            pfd_channel_close_passed(&msg);
            return NULL; /* STOP, or a broken channel: the thread ends either way */
        }
        struct pfd_conn *c = pfd_channel_conn(srv, ch, &m, ch->scratch + sizeof m, fd);
        if (c)
            return c;
    }
}

/* pfd_conn_release for a connection that came by a channel. */
void pfd_channel_release(struct pfd_conn *c)
{
    if (c->released)
        return;
    c->released = 1;
    struct pfd_msg m = {.kind = PFD_MSG_RELEASE, .token = c->token};
    atomic_store(&c->channel->asked, 1);
    (void)pfd_channel_send(c->channel, &m, NULL, 0);
}

/* pfd_conn_hand_back (and with the place, pfd_conn_finish) for a connection
 * that came by a channel: the pending bytes go back with it, and this
 * process's copy of the descriptor closes. */
void pfd_channel_hand_back(struct pfd_server *srv, struct pfd_conn *c, int keep)
{
    struct pfd_msg m = {
        .kind = c->released ? PFD_MSG_DONE : PFD_MSG_FINISH,
        .verdict = keep,
        .token = c->token,
        .last_read_ns = c->last_read_ns,
        .len = keep == 1 ? (uint32_t)c->len : 0,
    };
    if (!c->released)
        atomic_store(&c->channel->asked, 1);
    c->released = 1;
    /* This copy of the descriptor goes before the message: once the triage has the
     * connection back, it should be the only one holding it (it does not rely on it). */
    close(c->fd);
    c->fd = -1;
    pfd_count(&srv->open_connections, -1);
    (void)pfd_channel_send(c->channel, &m, c->buf, m.len);
    pfd_conn_free(srv, c);
}
