/* What the engine's files share and nothing outside the engine needs. */
#ifndef PRAZO_PFD_INTERNAL_H
#define PRAZO_PFD_INTERNAL_H

/* accept4 and the monotonic-clock condition variables are GNU/POSIX, beyond C11;
 * every engine file includes this header first, before any system header. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif

#include "pfd.h"

/* The counters are written under srv->mutex or by the I/O thread alone, and
 * read without a lock: relaxed atomics are all they need. */
static inline void pfd_count(_Atomic int64_t *c, int64_t d) { atomic_fetch_add_explicit(c, d, memory_order_relaxed); }
static inline int64_t pfd_read_counter(_Atomic int64_t *c) { return atomic_load_explicit(c, memory_order_relaxed); }

/* ------------------------------------------------------------------ lists */

static inline void pfd_list_push(struct pfd_list *l, struct pfd_conn *c)
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

static inline void pfd_list_remove(struct pfd_list *l, struct pfd_conn *c)
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

static inline int pfd_has_body(const struct pfd_conn *c) { return c->chunked || c->content_length > 0; }

static inline int pfd_hex(unsigned char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    ch |= 0x20;
    return ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
}

/* Connections in the admission line. Under mutex. */
static inline int64_t pfd_waiting(const struct pfd_server *srv) { return srv->line->count; }

/* Connections holding a worker's place. Under mutex. */
static inline int64_t pfd_in_flight(const struct pfd_server *srv) { return prazo_line_in_flight(srv->line); }

/* The doomed-work skip's expected service time now (0: no skip). Under mutex. */
static inline int64_t pfd_expected(const struct pfd_server *srv) { return prazo_line_expected_ns(srv->line); }

/* pfd_conn.c: connections */
/* End descriptor fd of a connection: for every copy when this engine owns it (not a worker process). */
void pfd_conn_close_fd(struct pfd_server *srv, int fd);
void pfd_conn_free(struct pfd_server *srv, struct pfd_conn *c);
int pfd_send_all_nb(int fd, const char *p, size_t n);
void pfd_wake(struct pfd_server *srv);

/* pfd_line.c: the admission line (core/prazo_line.h) with connections as its tokens, under srv->mutex */
int pfd_line_admit(struct pfd_server *srv, struct pfd_conn *c, int64_t now, struct pfd_conn ***tail);
int pfd_line_note(struct pfd_server *srv, int kind, int64_t serial, int64_t at, int64_t deadline_ns, int critical);
/* Observe-only: c started or ended at `at` (a request the line could not note is left out). Under mutex. */
static inline void pfd_line_note_run(struct pfd_server *srv, int kind, const struct pfd_conn *c, int64_t at)
{
    if (srv->cfg.observe && c->serial)
        (void)pfd_line_note(srv, kind, c->serial, at, 0, 0);
}
struct pfd_conn *pfd_line_next(struct pfd_server *srv, int64_t now, struct pfd_conn ***tail);
int64_t pfd_line_sweep(struct pfd_server *srv, int64_t now, struct pfd_conn ***tail);
int64_t pfd_line_take_all(struct pfd_server *srv, struct pfd_conn ***tail);
void pfd_line_dropped_wake(struct pfd_server *srv);
void pfd_line_release(struct pfd_server *srv, int critical, int64_t service_ns);

/* pfd_server.c */
struct pfd_server *pfd_server_alloc(const struct pfd_config *cfg);

/* pfd_host.c: the triage's I/O thread and its channels (each a no-op without any) */
void pfd_host_take_incoming(struct pfd_server *srv);
void pfd_host_event(struct pfd_server *srv, struct pfd_remote *r, uint32_t events, int64_t now);
void pfd_host_dispatch(struct pfd_server *srv, int64_t now);
void pfd_host_stop(struct pfd_server *srv);
int64_t pfd_host_worker_count(struct pfd_server *srv); /* under mutex */
void pfd_channel_release(struct pfd_conn *c);
void pfd_channel_hand_back(struct pfd_server *srv, struct pfd_conn *c, int keep);
#define PFD_REMOTE_TAG ((uintptr_t)1) /* epoll data of a channel: its struct pfd_remote *, tagged */

/* pfd_io.c: the I/O thread */
void pfd_io_returned(struct pfd_server *srv, struct pfd_conn *c, int verdict, int64_t now);
void pfd_io_answer_dropped(struct pfd_server *srv, struct pfd_conn *dropped, int64_t now);
int pfd_conn_take_pending(struct pfd_conn *c, const char *bytes, size_t n, int64_t last_read_ns);
void pfd_io_close_listeners(struct pfd_server *srv);
void *pfd_io_main(void *arg);

#endif /* PRAZO_PFD_INTERNAL_H */
