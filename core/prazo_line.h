/* The admission line, once for every C path: the queue's C twin
 * (core/_queue_c.pyx) and the front door's engine (bindings/servers/frontdoor/engine/)
 * both keep their waiting entries here and ask it the same questions: does an
 * arrival start, wait or get refused; which entry starts next; what must leave
 * the line and why; what do the counters say. The arithmetic behind the
 * answers (CoDel, the service estimate, Vegas, the priority rule, the deadline
 * verdict) is prazo_policy.h's; this header applies it to one ring.
 *
 * What the line does not do, on purpose:
 *   - no locking: the caller holds its own mutex around every call (the queue
 *     its pthread mutex, the front door srv->mutex), so one lock covers the
 *     line and whatever the caller keeps beside it;
 *   - no callbacks and no Python: whatever leaves the line without a slot is
 *     written into a caller-provided drop list ({token, reason}), which the
 *     caller answers once it has let go of its mutex;
 *   - no pointers into process-local memory: an entry names its owner only by
 *     an opaque 64-bit token (the queue's Waiter * or PyObject *, the front
 *     door's struct pfd_conn *), and the ring is a flexible array at the end of
 *     struct prazo_line. The whole line is one contiguous block of
 *     prazo_line_size(capacity) bytes that the caller allocates, so it can be
 *     placed in shared memory as it is; the tokens are the indirection that a
 *     cross-process caller would make meaningful there (an index into its own
 *     table instead of a pointer).
 *
 * Two callers take a slot at different moments, and the line serves both:
 *   PRAZO_LINE_ASSIGN  (the queue) an arrival that may start takes its slot in
 *                      prazo_line_admit, and a released slot is handed to the
 *                      next entry at once (prazo_line_give_back, then
 *                      prazo_line_next until it says none);
 *   PRAZO_LINE_PICKUP  (the front door) every admitted arrival waits in the line
 *                      until a worker asks prazo_line_next; the line is full
 *                      when running + waiting reach limit + max_queue.
 * prazo_line_next is the same function for both: the queue's hand-over on
 * release and the front door's pick at worker pickup.
 *
 * Counters are relaxed C11 atomics (prazo_sync.h) written only under the
 * caller's mutex, so a caller may read one without it; a snapshot that must
 * balance is copied under it. */
#ifndef PRAZO_LINE_H
#define PRAZO_LINE_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prazo_policy.h"
#include "prazo_sync.h"

/* The order among normal entries; the values are the front door's enum pfd_order too. */
enum { PRAZO_LINE_FIFO = 0, PRAZO_LINE_LIFO = 1, PRAZO_LINE_ADAPTIVE = 2 };

/* When an entry takes its slot (see the top of this file). */
enum { PRAZO_LINE_ASSIGN = 0, PRAZO_LINE_PICKUP = 1 };

/* The arrival decision (prazo_line_admit). */
enum {
    PRAZO_ADMIT_START = 0, /* a slot is taken now (PRAZO_LINE_ASSIGN only) */
    PRAZO_ADMIT_WAIT = 1,  /* there is room: the caller pushes the entry */
    PRAZO_ADMIT_SHUTDOWN = 2,
    PRAZO_ADMIT_EXPIRED = 3,
    PRAZO_ADMIT_FULL = 4,
    PRAZO_ADMIT_INSUFFICIENT = 5
};

/* Why an entry left the line without a slot. The values are the queue's entry
 * states, so its C twin uses them as they are. */
enum {
    PRAZO_DROP_CANCELLED = 2,
    PRAZO_DROP_EXPIRED = 3,      /* its deadline passed: 504 expired-in-queue */
    PRAZO_DROP_INSUFFICIENT = 4, /* less budget left than the expected service time: 504 */
    PRAZO_DROP_SHED = 5,         /* CoDel, order="adaptive": 503 shed-standing-queue */
    PRAZO_DROP_EVICTED = 6       /* pushed out by a critical arrival: 503 evicted-by-critical */
};

/* What prazo_line_next found. */
enum {
    PRAZO_NEXT_NONE = 0,      /* nothing may start now */
    PRAZO_NEXT_TAKEN = 1,     /* *out holds a slot and is live at now */
    PRAZO_NEXT_UNREPORTED = 2 /* *out holds a slot but may not start, and the drop list had no room to
                               * report it: the caller never starts it and passes the slot on */
};

struct prazo_line_entry {
    int64_t deadline_ns;
    int64_t enqueued_ns;
    uint64_t token; /* the caller's opaque handle; the line never follows it */
    int critical;   /* the critical class: reserved slots, served first */
};

/* In this order: the queue's stats() names them in the same order (_COUNTER_NAMES). */
struct prazo_line_counters {
    prazo_atomic_i64 offered;
    prazo_atomic_i64 started;
    prazo_atomic_i64 completed;
    prazo_atomic_i64 rejected_full;
    prazo_atomic_i64 expired_on_arrival;
    prazo_atomic_i64 expired_in_queue;
    prazo_atomic_i64 cancelled;
    prazo_atomic_i64 in_flight;
    prazo_atomic_i64 assigned; /* the queue's: slots handed to an entry that has not started yet */
    prazo_atomic_i64 queued;   /* entries in the ring */
    prazo_atomic_i64 peak_in_flight;
    prazo_atomic_i64 peak_queued;
    prazo_atomic_i64 queue_wait_ns_total;
    prazo_atomic_i64 insufficient_budget;
    prazo_atomic_i64 shed;
    prazo_atomic_i64 evicted;
    prazo_atomic_i64 critical_started;
};

struct prazo_line {
    int64_t capacity;  /* ring entries */
    int64_t max_queue; /* ASSIGN: entries that may wait; PICKUP: waiting beyond the limit */
    int64_t head, count;
    int order, mode, shutdown;
    int use_estimate, use_vegas;
    int64_t reserved;
    int64_t critical_in_flight; /* slots the critical class holds */
    int64_t critical_waiting;   /* critical entries in the ring */
    prazo_atomic_i64 limit;     /* the concurrency limit in force: fixed, or Vegas's */
    struct prazo_codel codel;
    struct prazo_vegas vegas;
    struct prazo_service_estimate estimate;
    struct prazo_drain drain;           /* written under the caller's mutex at each arrival */
    prazo_atomic_i64 drain_interval_ns; /* drain.interval_ns, readable without the mutex */
    struct prazo_line_counters c;
    struct prazo_line_entry ring[];
};

/* ------------------------------------------------------------ drop lists */

struct prazo_line_drop {
    uint64_t token;
    int reason; /* PRAZO_DROP_* */
};

/* Filled under the caller's mutex, answered after it. Small batches stay in
 * on_stack; a larger one moves to the heap (so never copy this struct: items
 * may point into it). When memory runs out the list stops growing, and every
 * function that drops stops before the entry it could not report: that entry
 * stays in line (or, from prazo_line_next, holds a slot as
 * PRAZO_NEXT_UNREPORTED), so it is never started unseen and no slot is lost. */
#define PRAZO_LINE_DROPS_ON_STACK 16
struct prazo_line_drops {
    struct prazo_line_drop *items;
    int64_t count, cap;
    struct prazo_line_drop on_stack[PRAZO_LINE_DROPS_ON_STACK];
};

static inline void prazo_line_drops_init(struct prazo_line_drops *d)
{
    d->items = d->on_stack;
    d->count = 0;
    d->cap = PRAZO_LINE_DROPS_ON_STACK;
}

/* Room for `needed` drops in all; 0 when memory ran out. */
static inline int prazo_line_drops_reserve(struct prazo_line_drops *d, int64_t needed)
{
    int64_t cap = d->cap;
    struct prazo_line_drop *grown;
    if (needed <= cap)
        return 1;
    while (cap < needed)
        cap *= 2;
    if (d->items == d->on_stack) {
        grown = (struct prazo_line_drop *)malloc((size_t)cap * sizeof *grown);
        if (grown)
            memcpy(grown, d->on_stack, (size_t)d->count * sizeof *grown);
    } else {
        grown = (struct prazo_line_drop *)realloc(d->items, (size_t)cap * sizeof *grown);
    }
    if (!grown)
        return 0;
    d->items = grown;
    d->cap = cap;
    return 1;
}

static inline int prazo_line_drops_push(struct prazo_line_drops *d, uint64_t token, int reason)
{
    if (!prazo_line_drops_reserve(d, d->count + 1))
        return 0;
    d->items[d->count].token = token;
    d->items[d->count].reason = reason;
    d->count++;
    return 1;
}

static inline void prazo_line_drops_free(struct prazo_line_drops *d)
{
    if (d->items != d->on_stack)
        free(d->items);
    prazo_line_drops_init(d);
}

/* ------------------------------------------------------------ set-up */

/* The bytes a line of `capacity` ring entries needs, in one block. */
static inline size_t prazo_line_size(int64_t capacity)
{
    return offsetof(struct prazo_line, ring) + (size_t)(capacity > 0 ? capacity : 1) * sizeof(struct prazo_line_entry);
}

/* `line` points at prazo_line_size(capacity) bytes. expected_fixed_ns > 0 or
 * expected_permille > 0 turns the doomed-work skip on; use_vegas moves the
 * limit within [min_concurrency, max_concurrency]. */
static inline void prazo_line_init(struct prazo_line *line, int64_t capacity, int64_t max_queue,
                                   int64_t max_concurrency, int order, int mode, int64_t codel_target_ns,
                                   int64_t codel_interval_ns, int64_t now, int64_t expected_fixed_ns,
                                   int expected_permille, int use_vegas, int64_t min_concurrency, int64_t reserved)
{
    memset(line, 0, offsetof(struct prazo_line, ring));
    line->capacity = capacity > 0 ? capacity : 1;
    line->max_queue = max_queue;
    line->order = order;
    line->mode = mode;
    line->reserved = reserved;
    prazo_codel_init(&line->codel, codel_target_ns, codel_interval_ns, now);
    line->use_estimate = expected_fixed_ns > 0 || expected_permille > 0;
    prazo_service_estimate_init(&line->estimate, expected_fixed_ns, expected_permille);
    line->use_vegas = use_vegas;
    prazo_vegas_init(&line->vegas, min_concurrency, max_concurrency);
    prazo_store(&line->limit, use_vegas ? prazo_vegas_limit(&line->vegas) : max_concurrency);
    prazo_drain_init(&line->drain);
}

/* ------------------------------------------------------------ reading */

static inline int64_t prazo_line_in_flight(struct prazo_line *line) { return prazo_load(&line->c.in_flight); }

/* The doomed-work skip's expected service time now (0: no skip). */
static inline int64_t prazo_line_expected_ns(const struct prazo_line *line)
{
    return line->use_estimate ? prazo_service_estimate_ns(&line->estimate) : 0;
}

/* The wait to suggest to a caller refused now (Retry-After), in ns; 0 before
 * the first measurement. Reads atomics only: callable without the mutex, as
 * the front door's I/O thread does while it writes a refusal. */
static inline int64_t prazo_line_retry_after_ns(struct prazo_line *line)
{
    return prazo_retry_after_ns(prazo_load(&line->drain_interval_ns), prazo_load(&line->c.queued));
}

/* The entry `i` places from the oldest (0 <= i < count). */
static inline struct prazo_line_entry *prazo_line_at(struct prazo_line *line, int64_t i)
{
    return &line->ring[(line->head + i) % line->capacity];
}

/* Whether an entry of this class may take a slot now (the limit and the reservation). */
static inline int prazo_line_may_start(struct prazo_line *line, int critical)
{
    return prazo_priority_may_start(prazo_line_in_flight(line), prazo_load(&line->limit), line->reserved, critical,
                                    line->critical_in_flight + line->critical_waiting);
}

/* No room for one more waiting entry. */
static inline int prazo_line_no_room(struct prazo_line *line)
{
    if (line->mode == PRAZO_LINE_PICKUP)
        return prazo_line_in_flight(line) + line->count >= prazo_load(&line->limit) + line->max_queue;
    return line->count >= line->max_queue;
}

/* An arrival now would be refused queue-full (order="adaptive" may shed instead). */
static inline int prazo_line_full(struct prazo_line *line)
{
    if (line->mode == PRAZO_LINE_PICKUP)
        return prazo_line_no_room(line);
    return prazo_line_no_room(line) && !prazo_line_may_start(line, 0);
}

/* ------------------------------------------------------------ the ring */

static inline void prazo_line_count_drop(struct prazo_line *line, int reason)
{
    switch (reason) {
    case PRAZO_DROP_CANCELLED:
        prazo_add(&line->c.cancelled, 1);
        break;
    case PRAZO_DROP_INSUFFICIENT:
        prazo_add(&line->c.insufficient_budget, 1);
        break;
    case PRAZO_DROP_SHED:
        prazo_add(&line->c.shed, 1);
        break;
    case PRAZO_DROP_EVICTED:
        prazo_add(&line->c.evicted, 1);
        break;
    default:
        prazo_add(&line->c.expired_in_queue, 1);
        break;
    }
}

static inline int prazo_line_drop_reason(int verdict)
{
    return verdict == PRAZO_VERDICT_EXPIRED ? PRAZO_DROP_EXPIRED : PRAZO_DROP_INSUFFICIENT;
}

/* Only after prazo_line_admit said PRAZO_ADMIT_WAIT (there is room). */
static inline void prazo_line_push(struct prazo_line *line, const struct prazo_line_entry *entry)
{
    *prazo_line_at(line, line->count) = *entry;
    line->count++;
    if (entry->critical)
        line->critical_waiting++;
    prazo_add(&line->c.queued, 1);
    int64_t waiting = line->count;
    if (line->mode == PRAZO_LINE_PICKUP) {
        /* Waiting means: in line beyond the slots free to take it at once. */
        int64_t free_slots = prazo_load(&line->limit) - prazo_line_in_flight(line);
        waiting -= free_slots > 0 ? free_slots : 0;
    }
    prazo_raise_peak(&line->c.peak_queued, waiting);
}

/* Take the entry `position` places from the oldest out of the line, keeping
 * the order (O(1) at either end, O(n) in the middle). */
static inline struct prazo_line_entry prazo_line_take(struct prazo_line *line, int64_t position)
{
    struct prazo_line_entry entry = *prazo_line_at(line, position);
    if (position == 0) {
        line->head = (line->head + 1) % line->capacity;
    } else {
        for (int64_t j = position; j < line->count - 1; j++)
            *prazo_line_at(line, j) = *prazo_line_at(line, j + 1);
    }
    line->count--;
    prazo_add(&line->c.queued, -1);
    if (entry.critical)
        line->critical_waiting--;
    return entry;
}

/* Take the first entry holding `token` out of the line, counted as `reason`
 * (an abandoned waiter, a cancelled item, a waiter leaving at its own
 * deadline). 1 when it was there. */
static inline int prazo_line_remove(struct prazo_line *line, uint64_t token, int reason)
{
    for (int64_t i = 0; i < line->count; i++) {
        if (prazo_line_at(line, i)->token == token) {
            prazo_line_take(line, i);
            prazo_line_count_drop(line, reason);
            return 1;
        }
    }
    return 0;
}

/* Where the next entry to serve waits: the oldest critical one, else the
 * line's end by order (the newest for LIFO and a standing adaptive line). */
static inline int64_t prazo_line_next_position(struct prazo_line *line, int64_t now)
{
    if (line->critical_waiting > 0) {
        /* O(n), and only while a critical entry waits. */
        for (int64_t i = 0; i < line->count; i++)
            if (prazo_line_at(line, i)->critical)
                return i;
    }
    if (line->order == PRAZO_LINE_LIFO ||
        (line->order == PRAZO_LINE_ADAPTIVE && prazo_codel_standing(&line->codel, now)))
        return line->count - 1;
    return 0;
}

/* order="adaptive": drop, from the old end, every entry that has waited
 * longer than CoDel allows now (O(entries shed)). One whose deadline (or
 * effective deadline) has passed is dropped as that, not as shed: its caller
 * is owed a 504, not a 503. */
static inline void prazo_line_shed_stale(struct prazo_line *line, int64_t now, struct prazo_line_drops *drops)
{
    if (line->order != PRAZO_LINE_ADAPTIVE)
        return;
    int64_t limit = prazo_codel_max_sojourn(&line->codel, now);
    int64_t expected = prazo_line_expected_ns(line);
    while (line->count > 0) {
        struct prazo_line_entry *oldest = prazo_line_at(line, 0);
        if (prazo_sub_saturating(now, oldest->enqueued_ns) <= limit)
            return;
        int verdict = prazo_deadline_verdict(now, oldest->deadline_ns, expected);
        int reason = verdict == PRAZO_VERDICT_LIVE ? PRAZO_DROP_SHED : prazo_line_drop_reason(verdict);
        if (!prazo_line_drops_push(drops, oldest->token, reason))
            return;
        prazo_line_take(line, 0);
        prazo_line_count_drop(line, reason);
    }
}

/* Make room in a full line for a critical arrival: push out its newest normal
 * waiter. 0 when every waiter is critical, or the drop could not be reported. */
static inline int prazo_line_evict_newest_normal(struct prazo_line *line, struct prazo_line_drops *drops)
{
    for (int64_t i = line->count - 1; i >= 0; i--) {
        struct prazo_line_entry *entry = prazo_line_at(line, i);
        if (entry->critical)
            continue;
        if (!prazo_line_drops_push(drops, entry->token, PRAZO_DROP_EVICTED))
            return 0;
        prazo_line_take(line, i);
        prazo_line_count_drop(line, PRAZO_DROP_EVICTED);
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------ slots */

static inline void prazo_line_take_slot(struct prazo_line *line, int critical)
{
    prazo_add(&line->c.in_flight, 1);
    if (critical)
        line->critical_in_flight++;
    prazo_raise_peak(&line->c.peak_in_flight, prazo_line_in_flight(line));
}

/* An entry holding a slot really starts: counted with the time it waited. */
static inline void prazo_line_count_start(struct prazo_line *line, int64_t enqueued_ns, int64_t now, int critical)
{
    prazo_add(&line->c.started, 1);
    prazo_add_saturating(&line->c.queue_wait_ns_total, prazo_sub_saturating(now, enqueued_ns));
    if (critical)
        prazo_add(&line->c.critical_started, 1);
}

/* A slot comes back without a completion (its holder never started, or left). */
static inline void prazo_line_give_back(struct prazo_line *line, int critical)
{
    if (critical)
        line->critical_in_flight--;
    prazo_add(&line->c.in_flight, -1);
}

/* A slot comes back after its work ran. service_ns >= 0 is a service-time
 * sample (slot start to now) for the learned estimate and Vegas, taken while
 * the finished work still counts as in flight; < 0: no sample. */
static inline void prazo_line_release(struct prazo_line *line, int critical, int64_t service_ns)
{
    prazo_add(&line->c.completed, 1);
    if (service_ns >= 0) {
        if (line->use_estimate)
            prazo_service_estimate_sample(&line->estimate, service_ns);
        if (line->use_vegas)
            prazo_store(&line->limit, prazo_vegas_sample(&line->vegas, service_ns, prazo_line_in_flight(line)));
    }
    prazo_line_give_back(line, critical);
}

/* ------------------------------------------------------------ decisions */

/* Count an arrival and decide (the order of the checks is the design's):
 * shut down, expired, doomed, start if its class may (ASSIGN), wait if there
 * is room, else shed stale entries (adaptive), else evict the newest normal
 * waiter (critical), else full. Entries dropped on the way are in `drops`. */
static inline int prazo_line_admit(struct prazo_line *line, int64_t deadline_ns, int64_t now, int critical,
                                   struct prazo_line_drops *drops)
{
    if (line->shutdown)
        return PRAZO_ADMIT_SHUTDOWN;
    prazo_store(&line->drain_interval_ns,
                prazo_drain_note(&line->drain, now, prazo_load(&line->c.completed), prazo_line_in_flight(line)));
    if (line->order == PRAZO_LINE_ADAPTIVE && line->count == 0)
        prazo_codel_note_empty(&line->codel, now);
    prazo_add(&line->c.offered, 1);
    int verdict = prazo_deadline_verdict(now, deadline_ns, prazo_line_expected_ns(line));
    if (verdict == PRAZO_VERDICT_EXPIRED) {
        prazo_add(&line->c.expired_on_arrival, 1);
        return PRAZO_ADMIT_EXPIRED;
    }
    if (verdict != PRAZO_VERDICT_LIVE) {
        prazo_add(&line->c.insufficient_budget, 1);
        return PRAZO_ADMIT_INSUFFICIENT;
    }
    if (line->mode == PRAZO_LINE_ASSIGN && prazo_line_may_start(line, critical)) {
        prazo_line_take_slot(line, critical);
        return PRAZO_ADMIT_START;
    }
    if (prazo_line_no_room(line))
        prazo_line_shed_stale(line, now, drops); /* a full standing line makes room by shedding first */
    if (prazo_line_no_room(line) && !(critical && prazo_line_evict_newest_normal(line, drops))) {
        prazo_add(&line->c.rejected_full, 1);
        return PRAZO_ADMIT_FULL;
    }
    return PRAZO_ADMIT_WAIT;
}

/* Take the next entry that may start now and give it a slot: stale entries
 * (adaptive) go first, then the entry at prazo_line_next_position; if its
 * class may not start, nothing does; if it expired or is doomed it is dropped
 * and the next one is looked at. The queue calls this after a slot came back
 * until it says none (the hand-over); the front door once per worker pickup. */
static inline int prazo_line_next(struct prazo_line *line, int64_t now, struct prazo_line_drops *drops,
                                  struct prazo_line_entry *out)
{
    int64_t expected = prazo_line_expected_ns(line);
    if (line->count > 0)
        prazo_line_shed_stale(line, now, drops);
    while (line->count > 0) {
        int64_t position = prazo_line_next_position(line, now);
        if (!prazo_line_may_start(line, prazo_line_at(line, position)->critical))
            return PRAZO_NEXT_NONE;
        *out = prazo_line_take(line, position);
        int verdict = prazo_deadline_verdict(now, out->deadline_ns, expected);
        if (verdict != PRAZO_VERDICT_LIVE) {
            int reason = prazo_line_drop_reason(verdict);
            if (prazo_line_drops_push(drops, out->token, reason)) {
                prazo_line_count_drop(line, reason);
                continue;
            }
            prazo_line_take_slot(line, out->critical);
            return PRAZO_NEXT_UNREPORTED;
        }
        prazo_line_take_slot(line, out->critical);
        return PRAZO_NEXT_TAKEN;
    }
    return PRAZO_NEXT_NONE;
}

/* Drop every entry that may no longer start at now (deadline passed, or too
 * little budget for the expected service time), anywhere in the line, keeping
 * the others in order. Returns when to look again: the earliest (effective)
 * deadline left, and with order="adaptive" the moment the oldest entry turns
 * stale (INT64_MAX: never). Stops early, returning now, when a drop cannot be
 * reported. CoDel shedding is prazo_line_shed_stale's, called before this by
 * a caller that wants it. */
static inline int64_t prazo_line_sweep(struct prazo_line *line, int64_t now, struct prazo_line_drops *drops)
{
    int64_t next = INT64_MAX;
    int64_t expected = prazo_line_expected_ns(line);
    int64_t kept = 0, i = 0;
    for (; i < line->count; i++) {
        struct prazo_line_entry entry = *prazo_line_at(line, i);
        int verdict = prazo_deadline_verdict(now, entry.deadline_ns, expected);
        if (verdict != PRAZO_VERDICT_LIVE) {
            int reason = prazo_line_drop_reason(verdict);
            if (!prazo_line_drops_push(drops, entry.token, reason)) {
                next = now;
                break;
            }
            prazo_line_count_drop(line, reason);
            prazo_add(&line->c.queued, -1);
            if (entry.critical)
                line->critical_waiting--;
            continue;
        }
        int64_t at = prazo_effective_deadline_ns(entry.deadline_ns, expected);
        if (at < next)
            next = at;
        *prazo_line_at(line, kept++) = entry;
    }
    for (; i < line->count; i++) /* the rest after a drop that could not be reported */
        *prazo_line_at(line, kept++) = *prazo_line_at(line, i);
    line->count = kept;
    if (line->order == PRAZO_LINE_ADAPTIVE && line->count > 0) {
        /* The oldest entry is shed first; the bound catches the moment the line starts standing. */
        int64_t at = prazo_line_at(line, 0)->enqueued_ns + prazo_codel_max_sojourn(&line->codel, now) + 1;
        if (now + line->codel.target_ns < at)
            at = now + line->codel.target_ns;
        if (at < next)
            next = at;
    }
    return next;
}

#endif /* PRAZO_LINE_H */
