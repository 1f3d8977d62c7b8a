/* The arithmetic of the queue policies, in plain C: no Python, no locks, no
 * allocation. The queue's C twin (_queue_c.pyx) calls it with its mutex held
 * and the front door (bindings/servers/prazo_frontdoor.h) includes it too, so
 * both decide exactly alike. core/_policy_py.py is the readable twin of every
 * section and gives the same integers for the same inputs.
 *
 * Sections, one owner each (see POLICIES.md section 2). */
#ifndef PRAZO_POLICY_H
#define PRAZO_POLICY_H

#include <stdint.h>

#include "prazo_histogram.h"

/* -- CoDel / adaptive LIFO (owner: core-dequeue) ------------------------------
 *
 * Meta's "Fail at Scale" adaptive LIFO with CoDel shedding. The line is
 * *standing* when it has not been empty for longer than `interval_ns`: then
 * the newest entry is served first (its caller still has all its budget) and
 * an entry waiting longer than `target_ns` is shed. While not standing the
 * line is FIFO and only entries waiting longer than `interval_ns` are shed.
 *
 * `last_empty_ns` is the last moment the line was seen empty. The queue
 * notes it at every arrival that finds the line empty: a non-empty stretch
 * always begins with such an arrival, so while the line is non-empty (the
 * only time `standing` is asked) it is exactly the start of the stretch. */
struct prazo_codel {
    int64_t target_ns, interval_ns, last_empty_ns;
};

static inline void prazo_codel_init(struct prazo_codel *c, int64_t target_ns, int64_t interval_ns, int64_t now_ns)
{
    c->target_ns = target_ns;
    c->interval_ns = interval_ns;
    c->last_empty_ns = now_ns;
}

/* The line is empty at now_ns. */
static inline void prazo_codel_note_empty(struct prazo_codel *c, int64_t now_ns)
{
    c->last_empty_ns = now_ns;
}

/* 1 when the line has been standing longer than the interval: serve LIFO. */
static inline int prazo_codel_standing(const struct prazo_codel *c, int64_t now_ns)
{
    int64_t since;
    if (__builtin_sub_overflow(now_ns, c->last_empty_ns, &since))
        return now_ns > c->last_empty_ns;
    return since > c->interval_ns;
}

/* The longest sojourn an entry may have at now_ns; one waiting longer is shed. */
static inline int64_t prazo_codel_max_sojourn(const struct prazo_codel *c, int64_t now_ns)
{
    return prazo_codel_standing(c, now_ns) ? c->target_ns : c->interval_ns;
}

/* -- doomed-work skip: learned service-time estimate (owner: core-dequeue) ----
 *
 * The expected service time, in ns, that an entry's remaining budget must
 * exceed for it to be worth starting (0 = no skip). Either fixed, or learned:
 * the quantile `quantile_permille` / 1000 of this queue's recent service
 * times. Learning keeps two generations of PRAZO_SERVICE_GENERATION samples
 * in core histograms (the current one fills while the previous one is kept
 * whole) and recomputes the estimate every PRAZO_SERVICE_EVERY samples over
 * both, once PRAZO_SERVICE_MIN_SAMPLES exist: a count-based window, so the
 * estimate depends only on the sequence of samples, never on the clock.
 *
 * The quantile follows the histogram twin's rule: nearest rank
 * r = min(max(ceil(q * n), 1), n); rank 1 is the exact minimum, rank n the
 * exact maximum, otherwise the middle of the rank's bucket moved into
 * [min, max]. Recomputing scans the buckets once (a bounded 2 * 2014 loads,
 * every 16 samples); recording is O(1). */
#define PRAZO_SERVICE_GENERATION 256
#define PRAZO_SERVICE_EVERY 16
#define PRAZO_SERVICE_MIN_SAMPLES 32

struct prazo_service_estimate {
    int64_t fixed_ns;          /* > 0: the estimate, and nothing is learned */
    int quantile_permille;     /* learned when fixed_ns == 0: 500, 900, 950, 990 */
    int current;               /* the generation being filled: 0 or 1 */
    int64_t count[2];          /* samples in each generation */
    int64_t samples;           /* samples ever taken */
    int64_t estimate_ns;       /* the last learned estimate; 0 until MIN_SAMPLES */
    prazo_hist gen[2];
};

/* fixed_ns > 0: a fixed estimate (quantile_permille ignored); otherwise learn
 * the quantile_permille / 1000 quantile (1..1000). Zeroes the struct. */
static inline void prazo_service_estimate_init(struct prazo_service_estimate *e, int64_t fixed_ns,
                                               int quantile_permille)
{
    e->fixed_ns = fixed_ns > 0 ? fixed_ns : 0;
    e->quantile_permille = quantile_permille;
    e->current = 0;
    e->count[0] = e->count[1] = 0;
    e->samples = 0;
    e->estimate_ns = 0;
    prazo_hist_clear(&e->gen[0]);
    prazo_hist_clear(&e->gen[1]);
}

static inline int64_t prazo_service_estimate_quantile(const struct prazo_service_estimate *e)
{
    int64_t n = e->count[0] + e->count[1];
    int64_t min = e->gen[0].min < e->gen[1].min ? e->gen[0].min : e->gen[1].min;
    int64_t max = e->gen[0].max > e->gen[1].max ? e->gen[0].max : e->gen[1].max;
    int64_t rank = ((int64_t)e->quantile_permille * n + 999) / 1000;
    if (rank < 1)
        rank = 1;
    if (rank >= n)
        return max;
    if (rank == 1)
        return min;
    int64_t seen = 0;
    for (int i = 0; i < PRAZO_HIST_BUCKETS; i++) {
        seen += e->gen[0].counts[i] + e->gen[1].counts[i];
        if (seen >= rank) {
            int64_t lo = prazo_hist_lo(i), hi = prazo_hist_hi(i);
            int64_t mid = lo + (hi - lo) / 2;
            if (mid < min)
                return min;
            if (mid > max)
                return max;
            return mid;
        }
    }
    return max;
}

/* One service time (ns; a negative one counts as 0). Ignored by a fixed estimate. */
static inline void prazo_service_estimate_sample(struct prazo_service_estimate *e, int64_t service_ns)
{
    if (e->fixed_ns > 0)
        return;
    if (service_ns < 0)
        service_ns = 0;
    prazo_hist_record(&e->gen[e->current], service_ns);
    e->count[e->current] += 1;
    e->samples += 1;
    if (e->samples % PRAZO_SERVICE_EVERY == 0 && e->samples >= PRAZO_SERVICE_MIN_SAMPLES)
        e->estimate_ns = prazo_service_estimate_quantile(e);
    if (e->count[e->current] == PRAZO_SERVICE_GENERATION) {
        e->current ^= 1;
        prazo_hist_clear(&e->gen[e->current]);
        e->count[e->current] = 0;
    }
}

/* The expected service time in ns; 0 = no skip (off, or not learned yet). */
static inline int64_t prazo_service_estimate_ns(const struct prazo_service_estimate *e)
{
    return e->fixed_ns > 0 ? e->fixed_ns : e->estimate_ns;
}

/* The moment an entry with this deadline stops being worth starting: the
 * deadline minus the expected service time (saturating at INT64_MIN). */
static inline int64_t prazo_effective_deadline_ns(int64_t deadline_ns, int64_t expected_ns)
{
    int64_t effective;
    if (__builtin_sub_overflow(deadline_ns, expected_ns, &effective))
        return INT64_MIN;
    return effective;
}

/* What an entry's deadline says at now_ns: start it, or drop it and why. */
enum { PRAZO_VERDICT_LIVE = 0, PRAZO_VERDICT_EXPIRED = 1, PRAZO_VERDICT_INSUFFICIENT = 2 };

static inline int prazo_deadline_verdict(int64_t now_ns, int64_t deadline_ns, int64_t expected_ns)
{
    if (now_ns >= deadline_ns)
        return PRAZO_VERDICT_EXPIRED;
    if (expected_ns > 0 && now_ns >= prazo_effective_deadline_ns(deadline_ns, expected_ns))
        return PRAZO_VERDICT_INSUFFICIENT;
    return PRAZO_VERDICT_LIVE;
}

#endif
