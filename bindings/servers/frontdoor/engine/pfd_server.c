/* The front door's engine: the server's lifecycle (new, start, drain, stop,
 * free) and its statistics. */
#include "pfd_internal.h"

/* The "Retry-After: " line of a canned answer: *at its first byte, *end past
 * its CRLF; both 0 when the answer has none (shutting-down keeps its fixed one). */
static void pfd_find_wait_line(const char *bytes, size_t len, size_t *at, size_t *end)
{
    static const char name[] = "\r\nRetry-After: ";
    *at = *end = 0;
    if (bytes == NULL)
        return;
    const char *found = memmem(bytes, len, name, sizeof name - 1);
    if (found == NULL)
        return;
    const char *line_end = memmem(found + 2, len - (size_t)(found + 2 - bytes), "\r\n", 2);
    if (line_end == NULL)
        return;
    *at = (size_t)(found + 2 - bytes);
    *end = (size_t)(line_end + 2 - bytes);
}

/* A server with its configuration copied, its line, locks, epoll and eventfd, and no listener yet. */
struct pfd_server *pfd_server_alloc(const struct pfd_config *cfg)
{
    struct pfd_server *srv = calloc(1, sizeof *srv);
    if (!srv)
        return NULL;
    srv->cfg = *cfg;
    for (int a = 0; a < PFD_A_COUNT; a++) {
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
        if (srv->cfg.answer[a][1] == NULL) { /* only the close variant given */
            srv->cfg.answer[a][1] = srv->cfg.answer[a][0];
            srv->cfg.answer_len[a][1] = srv->cfg.answer_len[a][0];
        }
        if (cfg->measured_retry_after && (a == PFD_A_QUEUE_FULL || a == PFD_A_SHED || a == PFD_A_EVICTED))
            for (int k = 0; k < 2; k++)
                pfd_find_wait_line(srv->cfg.answer[a][k], srv->cfg.answer_len[a][k], &srv->wait_at[a][k],
                                   &srv->wait_end[a][k]);
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
        copy[cfg->critical_paths_len] = 0; /* the last path ends even if the caller forgot */
        srv->cfg.critical_paths = copy;
    }
    srv->cfg.trusted = NULL;
    if (cfg->n_trusted > 0) {
        struct pfd_net *copy = malloc((size_t)cfg->n_trusted * sizeof *copy);
        if (!copy)
            return NULL;
        memcpy(copy, cfg->trusted, (size_t)cfg->n_trusted * sizeof *copy);
        srv->cfg.trusted = copy;
    }
    /* Room for everything that may be in line at once: the line refuses once
     * running + waiting reach limit + max_queue, and the limit is at most threads. */
    int64_t capacity = (int64_t)cfg->threads + cfg->max_queue;
    srv->line = malloc(prazo_line_size(capacity));
    if (!srv->line)
        return NULL;
    prazo_line_init(srv->line, capacity, cfg->max_queue, cfg->threads, cfg->order, PRAZO_LINE_PICKUP,
                    cfg->codel_target_ns, cfg->codel_interval_ns, pfd_now_ns(), cfg->expected_service_ns,
                    cfg->expected_quantile_permille, cfg->vegas, cfg->min_concurrency, cfg->reserved);
    atomic_store(&srv->expected_now, pfd_expected(srv));
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
    return srv;
}

struct pfd_server *pfd_server_new(const struct pfd_config *cfg, const int *listen_fds, int n_listen)
{
    if (n_listen < 1 || n_listen > 8)
        return NULL;
    struct pfd_server *srv = pfd_server_alloc(cfg);
    if (!srv)
        return NULL;
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

int pfd_server_start(struct pfd_server *srv)
{
    if (srv->thread_started)
        return 0;
    /* A fixed stack: pipelined refusals answered from one read recurse, at most one
     * level per request in a buffer of max_head bytes (< 1.5 MiB); glibc's default
     * follows RLIMIT_STACK, which may be far smaller or "unlimited" (then 2 MiB). */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 8u << 20);
    int rc = pthread_create(&srv->thread, &attr, pfd_io_main, srv);
    pthread_attr_destroy(&attr);
    if (rc == 0)
        srv->thread_started = 1;
    return rc;
}

/* Stop accepting: the listeners close, heads completed from now on get 503 shutting-down. */
void pfd_server_drain(struct pfd_server *srv)
{
    pthread_mutex_lock(&srv->mutex);
    srv->draining = 1;
    pthread_mutex_unlock(&srv->mutex);
    pfd_wake(srv);
}

/* Wait until nothing runs and nothing waits, or until `until_ns`; 1 when idle. */
int pfd_server_wait_idle(struct pfd_server *srv, int64_t until_ns)
{
    pthread_mutex_lock(&srv->mutex);
    while (pfd_in_flight(srv) + pfd_waiting(srv) > 0) {
        struct timespec ts = {.tv_sec = until_ns / 1000000000LL, .tv_nsec = until_ns % 1000000000LL};
        if (pthread_cond_timedwait(&srv->idle, &srv->mutex, &ts) == ETIMEDOUT)
            break;
    }
    int idle = pfd_in_flight(srv) + pfd_waiting(srv) == 0;
    pthread_mutex_unlock(&srv->mutex);
    return idle;
}

/* The end: queued connections are answered 503, workers stop waiting, the I/O thread exits and is joined. */
void pfd_server_stop(struct pfd_server *srv)
{
    pthread_mutex_lock(&srv->mutex);
    srv->draining = 1;
    srv->stopping = 1;
    pthread_cond_broadcast(&srv->ready);
    pthread_mutex_unlock(&srv->mutex);
    pfd_wake(srv);
    if (srv->thread_started) {
        pthread_join(srv->thread, NULL);
        srv->thread_started = 0;
    }
    pfd_io_close_listeners(srv);
}

/* Only once the I/O thread is joined and no worker holds a connection. */
int pfd_server_free(struct pfd_server *srv)
{
    if (srv->thread_started || pfd_in_flight(srv))
        return -1;
    struct pfd_conn *c = srv->returned;
    while (c) {
        struct pfd_conn *n = c->next;
        pfd_conn_free(srv, c);
        c = n;
    }
    pfd_io_close_listeners(srv);
    close(srv->epfd);
    close(srv->evfd);
    for (int a = 0; a < PFD_A_COUNT; a++) {
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
    free(srv->line);
    free(srv->msg_buf);
    free(srv->observed);
    free(srv);
    return 0;
}

/* Observe-only: the admissions noted since the last call, handed over (*out is the
 * caller's to free; NULL when none); returns how many. */
int64_t pfd_server_observed(struct pfd_server *srv, struct pfd_observed **out)
{
    pthread_mutex_lock(&srv->mutex);
    int64_t n = srv->n_observed;
    *out = n > 0 ? srv->observed : NULL;
    if (n > 0) {
        srv->observed = NULL;
        srv->n_observed = srv->observed_cap = 0;
    }
    pthread_mutex_unlock(&srv->mutex);
    return n;
}

void pfd_server_stats(struct pfd_server *srv, struct pfd_stats *s)
{
    struct prazo_line *line = srv->line;
    pthread_mutex_lock(&srv->mutex);
    int64_t in_flight = pfd_in_flight(srv), limit = prazo_load(&line->limit);
    int64_t free_places = limit - in_flight, waiting = pfd_waiting(srv);
    if (free_places < 0)
        free_places = 0;
    /* A connection in line while a place is free is as good as assigned: a worker takes it next. */
    s->in_flight = in_flight;
    s->assigned = waiting < free_places ? waiting : free_places;
    s->queued = waiting - s->assigned;
    s->limit = limit;
    s->expected_service_ns = pfd_expected(srv);
    s->insufficient_budget = prazo_load(&line->c.insufficient_budget);
    s->shed = prazo_load(&line->c.shed);
    s->evicted = prazo_load(&line->c.evicted);
    s->critical_started = prazo_load(&line->c.critical_started);
    s->upstream_stamps = pfd_read_counter(&srv->upstream_stamps);
    s->accepted = pfd_read_counter(&srv->accepted);
    s->open_connections = pfd_read_counter(&srv->open_connections);
    s->offered = prazo_load(&line->c.offered);
    s->admitted = pfd_read_counter(&srv->admitted);
    s->started = prazo_load(&line->c.started);
    s->completed = prazo_load(&line->c.completed);
    s->rejected_full = prazo_load(&line->c.rejected_full);
    s->expired_on_arrival = prazo_load(&line->c.expired_on_arrival);
    s->expired_in_queue = prazo_load(&line->c.expired_in_queue);
    s->shutting_down = pfd_read_counter(&srv->shutting_down);
    s->header_timeouts = pfd_read_counter(&srv->header_timeouts);
    s->bad_requests = pfd_read_counter(&srv->bad_requests);
    s->heads_too_large = pfd_read_counter(&srv->heads_too_large);
    s->kernel_stamps = pfd_read_counter(&srv->kernel_stamps);
    s->peak_in_flight = prazo_load(&line->c.peak_in_flight);
    s->peak_queued = prazo_load(&line->c.peak_queued);
    s->queue_wait_ns_total = prazo_load(&line->c.queue_wait_ns_total);
    s->pending_heads = pfd_read_counter(&srv->pending_heads);
    s->lingering = pfd_read_counter(&srv->lingering_now);
    s->worker_lost = pfd_read_counter(&srv->worker_lost);
    s->worker_threads = pfd_read_counter(&srv->remote_count);
    s->workers = pfd_host_worker_count(srv);
    s->observed_lost = pfd_read_counter(&srv->observed_lost);
    pthread_mutex_unlock(&srv->mutex);
}
