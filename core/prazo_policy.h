/* The arithmetic of the queue policies, in plain C: no Python, no locks, no
 * allocation. The queue's C twin (_queue_c.pyx) calls it with its mutex held
 * and the front door (bindings/servers/frontdoor/engine/pfd_line.c) includes it too, so
 * both decide exactly alike. core/_policy_py.py is the readable twin of every
 * section and gives the same integers for the same inputs.
 *
 * One section per policy (docs/design.md, "Queue policies"). */
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
static inline void prazo_codel_note_empty(struct prazo_codel *c, int64_t now_ns) { c->last_empty_ns = now_ns; }

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
    int64_t fixed_ns;      /* > 0: the estimate, and nothing is learned */
    int quantile_permille; /* learned when fixed_ns == 0: 500, 900, 950, 990 */
    int current;           /* the generation being filled: 0 or 1 */
    int64_t count[2];      /* samples in each generation */
    int64_t samples;       /* samples ever taken */
    int64_t estimate_ns;   /* the last learned estimate; 0 until MIN_SAMPLES */
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

/* -- Vegas adaptive limit (owner: core-admission) -----------------------------
 *
 * Netflix concurrency-limits' VegasLimit, fed by this queue's service times
 * (slot start to release), all in integers so every twin computes the same
 * limit from the same samples.
 *
 * Samples are aggregated in windows of PRAZO_VEGAS_WINDOW: a window's rtt is
 * the MEAN service time in it (integer division) and its demand the largest
 * in_flight seen. The mean, not the minimum: under the GIL the scheduling of
 * CPU-bound threads is unfair, so some requests run their 10 ms nearly
 * alone while others wait for the GIL many times that; the minimum of a
 * window stays near the no-load time at any concurrency, while the mean is
 * what Little's law says it is, in_flight / throughput, and grows with the
 * concurrency. Averaging 16 samples also damps the noise of single ones. A
 * sample runs from the moment the slot was handed over (not from when the
 * waiter's thread woke: under a busy GIL waking takes longer than the work,
 * and a slot granted is a slot taken) to its release. Once per window:
 *
 *   rtt_noload = the smallest window rtt since the last probe;
 *   queue      = ceil(limit * (rtt - rtt_noload) / rtt)   (Vegas' queue estimate)
 *   lg         = max(1, floor(log10(limit)))             (Netflix's Log10RootFunction)
 *   queue > BETA*lg          -> limit - lg   (latency grows: back off)
 *   demand * 2 < limit       -> unchanged    (app-limited: no evidence to grow)
 *   queue < ALPHA*lg         -> limit + lg   (little queueing: grow)
 *   otherwise                -> unchanged    (the sweet spot)
 *
 * clamped to [min_limit, max_limit]. ALPHA and BETA are both 2 (Netflix: 3
 * and 6), and the limit never grows by more than lg per window (Netflix jumps
 * by BETA*lg while queue <= lg): under the GIL a CPU-bound app's service time
 * grows like the concurrency, so the queue estimate at limit c against a
 * no-load time probed at c/2 is about c/2, and the limit settles at 3-4; with
 * Netflix's constants it wandered at 5-8 (measured, bench/limit_convergence.py).
 * An I/O-bound app's service time stays flat, the estimate stays 0 and the
 * limit climbs to max_limit (4 -> 32 in about 3 s of 50 ms requests).
 *
 * Probe: rtt_noload measured long ago stops meaning anything when capacity
 * changes, and one measured at the current concurrency would ratchet the
 * limit up. So every PRAZO_VEGAS_PROBE_EVERY windows the limit drops to
 * max(min_limit, limit / 2) (BBR's ProbeRTT, halved rather than drained so an
 * I/O-bound service loses little); samples are ignored until in_flight has
 * drained to that level, the next window's rtt becomes rtt_noload, and the
 * limit goes back to where it was. */
#define PRAZO_VEGAS_WINDOW 16
#define PRAZO_VEGAS_PROBE_EVERY 32
#define PRAZO_VEGAS_INITIAL 4
#define PRAZO_VEGAS_ALPHA 2
#define PRAZO_VEGAS_BETA 2
/* Samples are clamped here: 16 of them still sum inside int64 and a queue
 * estimate's product is scaled below 2^62 (see prazo_vegas_queue). */
#define PRAZO_VEGAS_MAX_SAMPLE_NS ((int64_t)1 << 40)

struct prazo_vegas {
    int64_t min_limit, max_limit, limit;
    int64_t rtt_noload_ns; /* 0 = not measured yet */
    int64_t window_sum_ns; /* sum of the samples of the window being filled */
    int64_t window_count;
    int64_t window_demand; /* largest in_flight seen in the window */
    int64_t windows;       /* windows decided since the last probe */
    int64_t probe_restore; /* > 0: probing; the limit to return to */
};

static inline void prazo_vegas_init(struct prazo_vegas *v, int64_t min_limit, int64_t max_limit)
{
    int64_t start = PRAZO_VEGAS_INITIAL;
    if (start > max_limit)
        start = max_limit;
    if (start < min_limit)
        start = min_limit;
    v->min_limit = min_limit;
    v->max_limit = max_limit;
    v->limit = start;
    v->rtt_noload_ns = 0;
    v->window_sum_ns = 0;
    v->window_count = 0;
    v->window_demand = 0;
    v->windows = 0;
    v->probe_restore = 0;
}

static inline int64_t prazo_vegas_limit(const struct prazo_vegas *v) { return v->limit; }

/* max(1, floor(log10(limit))): Netflix's Log10RootFunction, in integers. */
static inline int64_t prazo_vegas_log10(int64_t limit)
{
    int64_t lg = 0;
    while (limit >= 10) {
        limit /= 10;
        lg += 1;
    }
    return lg < 1 ? 1 : lg;
}

/* ceil(limit * (rtt - noload) / rtt) for 0 < noload <= rtt <= MAX_SAMPLE_NS,
 * 1 <= limit < 2^31: both times are halved together until rtt < 2^31, which
 * keeps the product below 2^62 and the ratio (nearly) unchanged. */
static inline int64_t prazo_vegas_queue(int64_t limit, int64_t rtt, int64_t noload)
{
    while (rtt >= ((int64_t)1 << 31)) {
        rtt >>= 1;
        noload >>= 1;
    }
    return (limit * (rtt - noload) + rtt - 1) / rtt;
}

static inline int64_t prazo_vegas_decide(struct prazo_vegas *v, int64_t rtt, int64_t demand)
{
    int64_t limit = v->limit, lg, queue, next;
    if (v->probe_restore > 0) {
        /* The probe's window: its rtt is the new no-load time. */
        v->rtt_noload_ns = rtt;
        v->limit = v->probe_restore;
        v->probe_restore = 0;
        v->windows = 0;
        return v->limit;
    }
    if (v->rtt_noload_ns == 0 || rtt < v->rtt_noload_ns) {
        v->rtt_noload_ns = rtt;
        return limit;
    }
    v->windows += 1;
    if (v->windows >= PRAZO_VEGAS_PROBE_EVERY) {
        next = limit / 2 > v->min_limit ? limit / 2 : v->min_limit;
        if (next < limit) {
            v->probe_restore = limit;
            v->limit = next;
            return next;
        }
        /* Already at the floor: this window is the probe. */
        v->rtt_noload_ns = rtt;
        v->windows = 0;
        return limit;
    }
    queue = prazo_vegas_queue(limit, rtt, v->rtt_noload_ns);
    lg = prazo_vegas_log10(limit);
    if (queue > PRAZO_VEGAS_BETA * lg)
        next = limit - lg;
    else if (demand * 2 < limit)
        next = limit;
    else if (queue < PRAZO_VEGAS_ALPHA * lg)
        next = limit + lg;
    else
        next = limit;
    if (next > v->max_limit)
        next = v->max_limit;
    if (next < v->min_limit)
        next = v->min_limit;
    v->limit = next;
    return next;
}

/* One service time (ns, clamped to [1, MAX_SAMPLE_NS]) of a slot released
 * while in_flight slots (the releasing one included) were taken; returns the
 * limit, which changes at most once per window. */
static inline int64_t prazo_vegas_sample(struct prazo_vegas *v, int64_t service_ns, int64_t in_flight)
{
    int64_t rtt, demand;
    if (v->probe_restore > 0 && v->window_count == 0 && in_flight > v->limit)
        return v->limit; /* still draining to the probe's level: the sample ran at the old one */
    if (service_ns < 1)
        service_ns = 1;
    if (service_ns > PRAZO_VEGAS_MAX_SAMPLE_NS)
        service_ns = PRAZO_VEGAS_MAX_SAMPLE_NS;
    v->window_sum_ns += service_ns;
    if (v->window_count == 0 || in_flight > v->window_demand)
        v->window_demand = in_flight;
    v->window_count += 1;
    if (v->window_count < PRAZO_VEGAS_WINDOW)
        return v->limit;
    rtt = v->window_sum_ns / PRAZO_VEGAS_WINDOW;
    demand = v->window_demand;
    v->window_count = 0;
    v->window_sum_ns = 0;
    return prazo_vegas_decide(v, rtt, demand);
}

/* -- priority classes (owner: core-admission) ---------------------------------
 *
 * `reserved` of the `limit` slots are kept for the critical class: a critical
 * entry may start whenever a slot under the limit is free; a normal one only
 * below limit - reserved, or up to the limit while the critical class is idle
 * (critical_active = critical entries in flight + waiting is 0: borrowing). */
static inline int prazo_priority_may_start(int64_t in_flight, int64_t limit, int64_t reserved, int critical,
                                           int64_t critical_active)
{
    if (in_flight >= limit)
        return 0;
    if (critical || critical_active == 0)
        return 1;
    return in_flight < limit - reserved;
}

/* -- drain rate and Retry-After (owner: core-admission) -----------------------
 *
 * How long a refused caller should wait: the time the line ahead of it takes
 * to drain, (queued + 1) places at the line's measured interval between
 * completions. The interval is measured, not assumed: at each arrival, once a
 * window of PRAZO_DRAIN_WINDOW_NS has passed, the completions counted since
 * the window opened give one sample, elapsed / completions, averaged with the
 * previous interval (one slow window does not swing it). Measuring at
 * arrivals costs nothing on the completion path (no clock read at release)
 * and is fresh exactly when it is needed: refusals happen at arrivals.
 *
 * A window that saw no completion while work was running stays open (nothing
 * freed yet) up to 4 windows; then elapsed itself is the sample (a place takes
 * at least that long). A window longer than that with completions spanned a
 * quiet stretch with no arrivals (or the line was idle): it says nothing about
 * now and is dropped. The wait is never below one interval (what one place
 * takes to free) and never above PRAZO_RETRY_AFTER_MAX_NS; 0 until the first
 * sample, when the caller falls back to its fixed value. */
#define PRAZO_DRAIN_WINDOW_NS 250000000LL
#define PRAZO_DRAIN_STALE_WINDOWS 4
#define PRAZO_RETRY_AFTER_MAX_NS 60000000000LL

struct prazo_drain {
    int64_t mark_ns;        /* when the window opened; 0: none open yet */
    int64_t mark_completed; /* the completed count then */
    int64_t interval_ns;    /* the measured time between completions; 0: none yet */
};

static inline void prazo_drain_init(struct prazo_drain *d)
{
    d->mark_ns = 0; /* no window open: the first arrival opens one */
    d->mark_completed = 0;
    d->interval_ns = 0;
}

/* At an arrival: close the window when it has run long enough. Returns the interval now. */
static inline int64_t prazo_drain_note(struct prazo_drain *d, int64_t now_ns, int64_t completed, int64_t in_flight)
{
    int64_t elapsed;
    if (__builtin_sub_overflow(now_ns, d->mark_ns, &elapsed)) /* a caller's clock at the ends of int64 */
        elapsed = now_ns < d->mark_ns ? INT64_MIN : INT64_MAX;
    if (d->mark_ns == 0 || elapsed < 0) { /* the first arrival, or a caller's clock behind the window */
        d->mark_ns = now_ns;
        d->mark_completed = completed;
        return d->interval_ns;
    }
    if (elapsed < PRAZO_DRAIN_WINDOW_NS)
        return d->interval_ns;
    int64_t freed = completed - d->mark_completed;
    int stale = elapsed > PRAZO_DRAIN_STALE_WINDOWS * PRAZO_DRAIN_WINDOW_NS;
    int64_t sample = 0;
    if (freed > 0 && !stale)
        sample = elapsed / freed;
    else if (freed == 0 && in_flight > 0 && !stale)
        return d->interval_ns;            /* nothing freed yet: the window stays open */
    else if (freed == 0 && in_flight > 0) /* a place takes at least this long; past the cap, the cap */
        sample = elapsed < PRAZO_RETRY_AFTER_MAX_NS ? elapsed : PRAZO_RETRY_AFTER_MAX_NS;
    if (sample > 0)
        d->interval_ns = d->interval_ns > 0 ? d->interval_ns / 2 + sample / 2 : sample;
    d->mark_ns = now_ns;
    d->mark_completed = completed;
    return d->interval_ns;
}

/* The wait for a caller refused now: (queued + 1) intervals, within [interval, max]; 0 without a measurement. */
static inline int64_t prazo_retry_after_ns(int64_t interval_ns, int64_t queued)
{
    int64_t wait;
    if (interval_ns <= 0)
        return 0;
    if (queued < 0)
        queued = 0;
    if (__builtin_mul_overflow(interval_ns, queued + 1, &wait) || wait > PRAZO_RETRY_AFTER_MAX_NS)
        return PRAZO_RETRY_AFTER_MAX_NS;
    return wait;
}

#endif
