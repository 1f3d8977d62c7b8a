/* The front door's engine: its admission line is core/prazo_line.h, the same C
 * line the queue's C twin runs (arrival decision, next entry, sweep, drops,
 * counters). This file is the glue: a line token is a struct pfd_conn *, and a
 * drop reason becomes the canned answer the connection gets. Every call is
 * made under srv->mutex; the dropped connections come back as a chain (through
 * c->next) that the caller answers once it has let go of the mutex.
 *
 * The engine takes a slot at worker pickup (PRAZO_LINE_PICKUP), not at
 * arrival: an admitted connection always waits in the line until a free
 * worker asks for the next one, so the line picks by the policies in force
 * when the work can really start. */
#include "pfd_internal.h"

static inline uint64_t pfd_token(struct pfd_conn *c) { return (uint64_t)(uintptr_t)c; }
static inline struct pfd_conn *pfd_token_conn(uint64_t token) { return (struct pfd_conn *)(uintptr_t)token; }

static int pfd_drop_answer(int reason)
{
    switch (reason) {
    case PRAZO_DROP_EXPIRED:
        return PFD_A_EXPIRED_IN_QUEUE;
    case PRAZO_DROP_INSUFFICIENT:
        return PFD_A_INSUFFICIENT_BUDGET;
    case PRAZO_DROP_SHED:
        return PFD_A_SHED;
    case PRAZO_DROP_EVICTED:
        return PFD_A_EVICTED;
    default:
        return PFD_A_SHUTTING_DOWN;
    }
}

static void pfd_line_append(struct pfd_conn *c, int answer, struct pfd_conn ***tail)
{
    c->drop_answer = answer;
    c->next = NULL;
    **tail = c;
    *tail = &c->next;
}

/* The line's drops, appended to the chain at *tail, each with its answer; frees `drops`. */
static void pfd_line_chain(struct prazo_line_drops *drops, struct pfd_conn ***tail)
{
    for (int64_t i = 0; i < drops->count; i++)
        pfd_line_append(pfd_token_conn(drops->items[i].token), pfd_drop_answer(drops->items[i].reason), tail);
    prazo_line_drops_free(drops);
}

/* A complete head that is not refused before the line (draining): -1 when c
 * now waits in the line (state PFD_QUEUED), else the answer it gets. Entries
 * the arrival shed or evicted to make room are appended at *tail. */
/* Observe-only: note what happened to request `serial` at `at`; 0 when it could not be
 * noted (out of memory: counted in observed_lost). Under mutex. */
int pfd_line_note(struct pfd_server *srv, int kind, int64_t serial, int64_t at, int64_t deadline_ns, int critical)
{
    if (srv->n_observed == srv->observed_cap) {
        int64_t cap = srv->observed_cap ? 2 * srv->observed_cap : 64;
        struct pfd_observed *grown = realloc(srv->observed, (size_t)cap * sizeof *grown);
        if (!grown) {
            pfd_count(&srv->observed_lost, 1);
            return 0;
        }
        srv->observed = grown;
        srv->observed_cap = cap;
    }
    srv->observed[srv->n_observed++] = (struct pfd_observed){
        .serial = serial, .at_ns = at, .deadline_ns = deadline_ns, .critical = critical, .kind = kind};
    return 1;
}

int pfd_line_admit(struct pfd_server *srv, struct pfd_conn *c, int64_t now, struct pfd_conn ***tail)
{
    struct prazo_line_drops drops;
    prazo_line_drops_init(&drops);
    /* Observe-only: the line holds no deadline, so it can neither expire nor skip work;
     * the connection keeps its own for the app. */
    int64_t line_deadline = srv->cfg.observe ? INT64_MAX : c->deadline_ns;
    /* Nor a class: a stock server serves in arrival order (the shadow hears the class). */
    int critical = c->critical;
    if (srv->cfg.observe)
        c->critical = 0;
    int outcome = prazo_line_admit(srv->line, line_deadline, now, c->critical, &drops);
    pfd_line_chain(&drops, tail);
    switch (outcome) {
    case PRAZO_ADMIT_WAIT:
        break;
    case PRAZO_ADMIT_EXPIRED:
        return PFD_A_EXPIRED_ON_ARRIVAL;
    case PRAZO_ADMIT_INSUFFICIENT:
        return PFD_A_INSUFFICIENT_BUDGET;
    default: /* PRAZO_ADMIT_FULL; the engine never shuts the line itself down: draining is its own */
        return PFD_A_QUEUE_FULL;
    }
    struct prazo_line_entry entry = {
        .deadline_ns = line_deadline, .enqueued_ns = now, .token = pfd_token(c), .critical = c->critical};
    c->serial = 0;
    if (srv->cfg.observe &&
        pfd_line_note(srv, PFD_NOTE_ADMITTED, srv->observed_serial + 1, now, c->deadline_ns, critical))
        c->serial = ++srv->observed_serial;
    c->state = PFD_QUEUED;
    c->queued_ns = now;
    prazo_line_push(srv->line, &entry);
    return -1;
}

/* The connection a free worker starts now, holding a slot, or NULL (nothing
 * may start now; what may no longer start was appended at *tail). */
struct pfd_conn *pfd_line_next(struct pfd_server *srv, int64_t now, struct pfd_conn ***tail)
{
    struct prazo_line_drops drops;
    struct prazo_line_entry entry;
    prazo_line_drops_init(&drops);
    int got = prazo_line_next(srv->line, now, &drops, &entry);
    pfd_line_chain(&drops, tail);
    if (got == PRAZO_NEXT_NONE)
        return NULL;
    struct pfd_conn *c = pfd_token_conn(entry.token);
    if (got == PRAZO_NEXT_UNREPORTED) {
        /* The drop list ran out of memory: this one holds a slot it may not
         * use. The slot goes back and the connection is answered like any drop. */
        int reason = prazo_line_drop_reason(prazo_deadline_verdict(now, entry.deadline_ns, pfd_expected(srv)));
        prazo_line_give_back(srv->line, entry.critical);
        prazo_line_count_drop(srv->line, reason);
        pfd_line_append(c, pfd_drop_answer(reason), tail);
        return NULL;
    }
    prazo_line_count_start(srv->line, entry.enqueued_ns, now, entry.critical);
    return c;
}

/* Drop what may no longer start at now: stale entries (adaptive), and expired
 * or doomed ones anywhere in the line. Returns when to look again (INT64_MAX: never). */
int64_t pfd_line_sweep(struct pfd_server *srv, int64_t now, struct pfd_conn ***tail)
{
    struct prazo_line_drops drops;
    prazo_line_drops_init(&drops);
    prazo_line_shed_stale(srv->line, now, &drops);
    int64_t next = prazo_line_sweep(srv->line, now, &drops);
    pfd_line_chain(&drops, tail);
    return next;
}

/* Every waiting connection leaves the line (the engine is stopping), appended at *tail; returns how many. */
int64_t pfd_line_take_all(struct pfd_server *srv, struct pfd_conn ***tail)
{
    int64_t n = 0;
    for (; srv->line->count > 0; n++)
        pfd_line_append(pfd_token_conn(prazo_line_take(srv->line, 0).token), PFD_A_SHUTTING_DOWN, tail);
    return n;
}

/* Entries left the line without a place: shutdown may be waiting for an idle
 * line, and a dropped critical waiter may let parked workers lend its class's
 * reserved places again. Under mutex. */
void pfd_line_dropped_wake(struct pfd_server *srv)
{
    pthread_cond_broadcast(&srv->idle);
    if (pfd_waiting(srv))
        pthread_cond_broadcast(&srv->ready);
}

/* A worker's place comes back after service_ns of work: the learned estimate
 * and Vegas take the sample (inside the line), and a changed estimate is
 * published for the I/O thread. Under mutex. */
void pfd_line_release(struct pfd_server *srv, int critical, int64_t service_ns)
{
    prazo_line_release(srv->line, critical, service_ns < 0 ? 0 : service_ns);
    int64_t expected = pfd_expected(srv);
    if (expected != atomic_load_explicit(&srv->expected_now, memory_order_relaxed)) {
        atomic_store_explicit(&srv->expected_now, expected, memory_order_relaxed);
        if (pfd_waiting(srv))
            pfd_wake(srv); /* the I/O thread's sweep computes each waiter's effective deadline anew */
    }
}
