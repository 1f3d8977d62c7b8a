/* The latency histogram of the C twin (_histogram_c.pyx); _histogram_py.py is
 * the specification and explains the bucket layout and the quantile rule.
 *
 * Recording is lock-free: one relaxed atomic increment of the bucket, one of
 * the sum, and a compare-and-swap on min/max only when the value is a new
 * extreme. Relaxed is enough because no reader infers anything about one
 * field from another: a reader copies the buckets and derives the count from
 * that copy, so every quantile is computed from a self-consistent array even
 * while other threads record. The count is not stored at all (the sum of the
 * buckets), which saves the record path an atomic on a shared cache line.
 *
 * The __atomic builtins (GCC, Clang) act on plain int64_t, so a histogram can
 * also be copied and zeroed field by field without _Atomic casts. */
#ifndef PRAZO_HISTOGRAM_H
#define PRAZO_HISTOGRAM_H

#include <stdint.h>

#define PRAZO_HIST_SUB_BITS 6
#define PRAZO_HIST_LINEAR 128            /* 2 << PRAZO_HIST_SUB_BITS: one bucket per value below */
#define PRAZO_HIST_MAX_NS 100000000000LL /* 100 s, the top of the range */
#define PRAZO_HIST_BUCKETS 2014          /* prazo_hist_index(PRAZO_HIST_MAX_NS) + 1 */

/* PRAZO_HIST_MAX_NS lies in [2**36, 2**37), so its bucket is (30 << 6) + (MAX >> 30). */
_Static_assert((1LL << 36) <= PRAZO_HIST_MAX_NS && PRAZO_HIST_MAX_NS < (1LL << 37), "MAX_NS octave");
_Static_assert((30 << PRAZO_HIST_SUB_BITS) + (PRAZO_HIST_MAX_NS >> 30) + 1 == PRAZO_HIST_BUCKETS, "BUCKETS");

/* Kept as aligned by hand: clang-format would split the column at `saturated`, which has no comment. */
/* clang-format off */
typedef struct {
    int64_t counts[PRAZO_HIST_BUCKETS];
    uint64_t sum;      /* may pass INT64_MAX; then `saturated` is set and sum_ns reads INT64_MAX */
    int64_t saturated;
    int64_t min;       /* INT64_MAX when empty */
    int64_t max;       /* -1 when empty */
    int64_t overflow;  /* values above PRAZO_HIST_MAX_NS */
} prazo_hist;
/* clang-format on */

static inline int prazo_hist_index(int64_t ns)
{
    if (ns < PRAZO_HIST_LINEAR)
        return (int)ns;
    int shift = 63 - __builtin_clzll((unsigned long long)ns) - PRAZO_HIST_SUB_BITS;
    return (shift << PRAZO_HIST_SUB_BITS) + (int)(ns >> shift);
}

static inline int64_t prazo_hist_lo(int index)
{
    if (index < PRAZO_HIST_LINEAR)
        return index;
    int shift = (index >> PRAZO_HIST_SUB_BITS) - 1;
    return (int64_t)(index - (shift << PRAZO_HIST_SUB_BITS)) << shift;
}

static inline int64_t prazo_hist_hi(int index)
{
    if (index < PRAZO_HIST_LINEAR)
        return index;
    int shift = (index >> PRAZO_HIST_SUB_BITS) - 1;
    return ((int64_t)(index - (shift << PRAZO_HIST_SUB_BITS) + 1) << shift) - 1;
}

static inline void prazo_hist_clear(prazo_hist *h)
{
    for (int i = 0; i < PRAZO_HIST_BUCKETS; i++)
        __atomic_store_n(&h->counts[i], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&h->sum, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&h->saturated, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&h->min, INT64_MAX, __ATOMIC_RELAXED);
    __atomic_store_n(&h->max, -1, __ATOMIC_RELAXED);
    __atomic_store_n(&h->overflow, 0, __ATOMIC_RELAXED);
}

static inline void prazo_hist_lower_min(prazo_hist *h, int64_t value)
{
    int64_t seen = __atomic_load_n(&h->min, __ATOMIC_RELAXED);
    while (value < seen && !__atomic_compare_exchange_n(&h->min, &seen, value, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static inline void prazo_hist_raise_max(prazo_hist *h, int64_t value)
{
    int64_t seen = __atomic_load_n(&h->max, __ATOMIC_RELAXED);
    while (value > seen && !__atomic_compare_exchange_n(&h->max, &seen, value, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* Adds `value` (0 <= value <= INT64_MAX) to the sum; passing INT64_MAX sticks. */
static inline void prazo_hist_add_sum(prazo_hist *h, uint64_t value)
{
    uint64_t before = __atomic_fetch_add(&h->sum, value, __ATOMIC_RELAXED);
    uint64_t after = before + value;
    if (after > (uint64_t)INT64_MAX || after < before)
        __atomic_store_n(&h->saturated, 1, __ATOMIC_RELAXED);
}

/* ns >= 0 (the callers check). */
static inline void prazo_hist_record(prazo_hist *h, int64_t ns)
{
    if (ns > PRAZO_HIST_MAX_NS) {
        __atomic_fetch_add(&h->counts[PRAZO_HIST_BUCKETS - 1], 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&h->overflow, 1, __ATOMIC_RELAXED);
    } else {
        __atomic_fetch_add(&h->counts[prazo_hist_index(ns)], 1, __ATOMIC_RELAXED);
    }
    prazo_hist_add_sum(h, (uint64_t)ns);
    prazo_hist_lower_min(h, ns);
    prazo_hist_raise_max(h, ns);
}

static inline int64_t prazo_hist_sum_ns(prazo_hist *h)
{
    uint64_t sum = __atomic_load_n(&h->sum, __ATOMIC_RELAXED);
    if (__atomic_load_n(&h->saturated, __ATOMIC_RELAXED) || sum > (uint64_t)INT64_MAX)
        return INT64_MAX;
    return (int64_t)sum;
}

/* A plain copy of `src` into `dst` (which no other thread sees); returns the count. */
static inline int64_t prazo_hist_load(prazo_hist *src, prazo_hist *dst)
{
    int64_t total = 0;
    for (int i = 0; i < PRAZO_HIST_BUCKETS; i++) {
        dst->counts[i] = __atomic_load_n(&src->counts[i], __ATOMIC_RELAXED);
        total += dst->counts[i];
    }
    dst->sum = (uint64_t)prazo_hist_sum_ns(src);
    dst->saturated = 0;
    dst->min = __atomic_load_n(&src->min, __ATOMIC_RELAXED);
    dst->max = __atomic_load_n(&src->max, __ATOMIC_RELAXED);
    dst->overflow = __atomic_load_n(&src->overflow, __ATOMIC_RELAXED);
    return total;
}

static inline int64_t prazo_hist_count(prazo_hist *h)
{
    int64_t total = 0;
    for (int i = 0; i < PRAZO_HIST_BUCKETS; i++)
        total += __atomic_load_n(&h->counts[i], __ATOMIC_RELAXED);
    return total;
}

/* Adds a plain copy (from prazo_hist_load) into a live histogram. */
static inline void prazo_hist_add(prazo_hist *dst, const prazo_hist *copy, int64_t copy_count)
{
    if (copy_count == 0)
        return;
    for (int i = 0; i < PRAZO_HIST_BUCKETS; i++) {
        if (copy->counts[i])
            __atomic_fetch_add(&dst->counts[i], copy->counts[i], __ATOMIC_RELAXED);
    }
    prazo_hist_add_sum(dst, copy->sum);
    prazo_hist_lower_min(dst, copy->min);
    if (copy->max >= 0)
        prazo_hist_raise_max(dst, copy->max);
    if (copy->overflow)
        __atomic_fetch_add(&dst->overflow, copy->overflow, __ATOMIC_RELAXED);
}

/* Adds a live histogram into a private one that no other thread sees (plain
 * arithmetic on `dst`, which stays a valid plain copy); returns src's count.
 * Cheaper than prazo_hist_add, whose atomic adds a window's merge does not need. */
static inline int64_t prazo_hist_accumulate(prazo_hist *dst, prazo_hist *src)
{
    int64_t total = 0;
    for (int i = 0; i < PRAZO_HIST_BUCKETS; i++) {
        int64_t count = __atomic_load_n(&src->counts[i], __ATOMIC_RELAXED);
        dst->counts[i] += count;
        total += count;
    }
    if (total == 0)
        return 0;
    /* Both are <= INT64_MAX, so the unsigned sum cannot wrap. */
    dst->sum += (uint64_t)prazo_hist_sum_ns(src);
    if (dst->sum > (uint64_t)INT64_MAX)
        dst->sum = (uint64_t)INT64_MAX;
    int64_t min = __atomic_load_n(&src->min, __ATOMIC_RELAXED);
    int64_t max = __atomic_load_n(&src->max, __ATOMIC_RELAXED);
    if (min < dst->min)
        dst->min = min;
    if (max > dst->max)
        dst->max = max;
    dst->overflow += __atomic_load_n(&src->overflow, __ATOMIC_RELAXED);
    return total;
}

/* Epochs of the window's ring: zero the slice, *then* publish its epoch (release),
 * so a recorder that sees the new epoch (acquire) increments after the zeroing. */
static inline int64_t prazo_epoch_load(int64_t *epoch) { return __atomic_load_n(epoch, __ATOMIC_ACQUIRE); }

static inline void prazo_epoch_store(int64_t *epoch, int64_t value)
{
    __atomic_store_n(epoch, value, __ATOMIC_RELEASE);
}

static inline int64_t prazo_hist_read(int64_t *field) { return __atomic_load_n(field, __ATOMIC_RELAXED); }

/* The newest epoch that has left the window at epoch `now_epoch`: now_epoch - slices,
 * clamped at INT64_MIN instead of wrapping. */
static inline int64_t prazo_window_oldest_excluded(int64_t now_epoch, int64_t slices)
{
    int64_t result;
    if (__builtin_sub_overflow(now_epoch, slices, &result))
        return INT64_MIN;
    return result;
}

/* Floor division for a positive divisor (C's / truncates toward zero). */
static inline int64_t prazo_floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

#endif
