/* The front door's engine: the admission line's policies. */
#include "pfd_internal.h"

/* The admission line is two lists: critical requests (served first, FIFO
 * among them) and normal ones (served per cfg.order). What a policy decides
 * (CoDel's standing line and sojourn limit, the expected service time, the
 * Vegas limit, whether a class may start) is computed by core/prazo_policy.h,
 * exactly as the queue's C twin computes it; this section only applies it to
 * the engine's lists, under srv->mutex. */

/* Take c out of the line it waits in, to drop it with `answer` (counted now,
 * so stats() never sees it in two places); appended to the list at *tail. */
void pfd_line_drop(struct pfd_server *srv, struct pfd_conn *c, int answer, struct pfd_conn ***tail)
{
    pfd_list_remove(c->critical ? &srv->crit : &srv->line, c);
    c->drop_answer = answer;
    switch (answer) {
    case PFD_A_EXPIRED_IN_QUEUE:
        pfd_count(&srv->expired_in_queue, 1);
        break;
    case PFD_A_INSUFFICIENT_BUDGET:
        pfd_count(&srv->insufficient_budget, 1);
        break;
    case PFD_A_SHED:
        pfd_count(&srv->shed, 1);
        break;
    default:
        pfd_count(&srv->evicted, 1);
        break;
    }
    c->next = NULL;
    **tail = c;
    *tail = &c->next;
}

/* order="adaptive": shed, from the old end of each list, every entry that has
 * waited longer than CoDel allows now. */
void pfd_line_shed_stale(struct pfd_server *srv, int64_t now, struct pfd_conn ***tail)
{
    if (srv->cfg.order != PFD_ORDER_ADAPTIVE)
        return;
    int64_t max_sojourn = prazo_codel_max_sojourn(&srv->codel, now);
    struct pfd_list *lists[2] = {&srv->crit, &srv->line};
    for (int i = 0; i < 2; i++)
        while (lists[i]->head && now - lists[i]->head->queued_ns > max_sojourn)
            pfd_line_drop(srv, lists[i]->head, PFD_A_SHED, tail);
}

/* The entry a free worker would start now, or NULL: a critical one when its
 * class may start, else a normal one (FIFO, LIFO, or LIFO while the line
 * stands under "adaptive") when the normal class may start. */
struct pfd_conn *pfd_line_pick(struct pfd_server *srv, int64_t now)
{
    int64_t critical_active = srv->critical_in_flight + srv->crit.count;
    int64_t reserved = srv->cfg.reserved;
    if (srv->crit.head && prazo_priority_may_start(srv->in_flight, srv->limit, reserved, 1, critical_active))
        return srv->crit.head;
    if (!srv->line.head || !prazo_priority_may_start(srv->in_flight, srv->limit, reserved, 0, critical_active))
        return NULL;
    int lifo = srv->cfg.order == PFD_ORDER_LIFO ||
               (srv->cfg.order == PFD_ORDER_ADAPTIVE && prazo_codel_standing(&srv->codel, now));
    return lifo ? srv->line.tail : srv->line.head;
}

/* Drop what may no longer start at now: expired or doomed anywhere in the
 * line, and (adaptive) stale entries. Returns when to look again (INT64_MAX: never). */
int64_t pfd_line_sweep(struct pfd_server *srv, int64_t now, struct pfd_conn ***tail)
{
    int64_t next = INT64_MAX;
    int64_t expected = pfd_expected(srv);
    pfd_line_shed_stale(srv, now, tail);
    struct pfd_list *lists[2] = {&srv->crit, &srv->line};
    for (int i = 0; i < 2; i++) {
        for (struct pfd_conn *c = lists[i]->head, *n; c; c = n) {
            n = c->next;
            int verdict = prazo_deadline_verdict(now, c->deadline_ns, expected);
            if (verdict == PRAZO_VERDICT_EXPIRED) {
                pfd_line_drop(srv, c, PFD_A_EXPIRED_IN_QUEUE, tail);
                continue;
            }
            if (verdict == PRAZO_VERDICT_INSUFFICIENT) {
                pfd_line_drop(srv, c, PFD_A_INSUFFICIENT_BUDGET, tail);
                continue;
            }
            int64_t at = expected > 0 ? prazo_effective_deadline_ns(c->deadline_ns, expected) : c->deadline_ns;
            if (at < next)
                next = at;
        }
        if (srv->cfg.order == PFD_ORDER_ADAPTIVE && lists[i]->head) {
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
void pfd_line_dropped_wake(struct pfd_server *srv)
{
    pthread_cond_broadcast(&srv->idle);
    if (pfd_waiting(srv))
        pthread_cond_broadcast(&srv->ready);
}

/* A finished request's service time: the learned estimate and Vegas take it. Under mutex. */
void pfd_line_sample(struct pfd_server *srv, int64_t service_ns)
{
    if (service_ns < 0)
        service_ns = 0;
    if (srv->cfg.expected_quantile_permille > 0) {
        prazo_service_estimate_sample(&srv->estimate, service_ns);
        int64_t expected = pfd_expected(srv);
        if (expected != atomic_load_explicit(&srv->expected_now, memory_order_relaxed)) {
            atomic_store_explicit(&srv->expected_now, expected, memory_order_relaxed);
            if (pfd_waiting(srv))
                pfd_wake(srv); /* the I/O thread's sweep computes each waiter's effective deadline anew */
        }
    }
    if (srv->cfg.vegas) {
        srv->limit = prazo_vegas_sample(&srv->vegas, service_ns, srv->in_flight);
    }
}
