/* Small static-inline C helpers for the C twin: the monotonic clock, relaxed
 * C11 atomic counters, and a mutex + condition variables that time out on
 * CLOCK_MONOTONIC (never the wall clock, which can jump).
 *
 * Every counter is written only while the queue's mutex is held, so a plain
 * relaxed load + store is enough for writers. qsize()/full() load one or two
 * without the mutex, and the atomics make those unlocked reads well-defined;
 * stats() copies all of them under the mutex so that they balance. */
#ifndef PRAZO_SYNC_H
#define PRAZO_SYNC_H

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sched.h>
#include <time.h>

typedef _Atomic int64_t prazo_atomic_i64;

static inline int64_t prazo_monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
}

static inline int64_t prazo_load(prazo_atomic_i64 *counter)
{
    return atomic_load_explicit(counter, memory_order_relaxed);
}

static inline void prazo_store(prazo_atomic_i64 *counter, int64_t value)
{
    atomic_store_explicit(counter, value, memory_order_relaxed);
}

/* Writers hold the mutex, so read-modify-write needs no lock prefix. */
static inline void prazo_add(prazo_atomic_i64 *counter, int64_t delta)
{
    atomic_store_explicit(counter, atomic_load_explicit(counter, memory_order_relaxed) + delta, memory_order_relaxed);
}

/* a - b, clamped to the int64 range instead of wrapping. */
static inline int64_t prazo_sub_saturating(int64_t a, int64_t b)
{
    int64_t result;
    if (__builtin_sub_overflow(a, b, &result))
        return b < 0 ? INT64_MAX : INT64_MIN;
    return result;
}

/* A total that sticks at the int64 limits instead of wrapping to the other sign. */
static inline void prazo_add_saturating(prazo_atomic_i64 *counter, int64_t delta)
{
    int64_t result;
    if (__builtin_add_overflow(atomic_load_explicit(counter, memory_order_relaxed), delta, &result))
        result = delta > 0 ? INT64_MAX : INT64_MIN;
    atomic_store_explicit(counter, result, memory_order_relaxed);
}

static inline void prazo_raise_peak(prazo_atomic_i64 *peak, int64_t value)
{
    if (value > atomic_load_explicit(peak, memory_order_relaxed))
        atomic_store_explicit(peak, value, memory_order_relaxed);
}

/* A one-shot flag with release/acquire ordering: "I am done touching your memory". */
typedef _Atomic int prazo_flag;

static inline void prazo_flag_set(prazo_flag *flag) { atomic_store_explicit(flag, 1, memory_order_release); }

static inline int prazo_flag_is_set(prazo_flag *flag) { return atomic_load_explicit(flag, memory_order_acquire); }

static inline void prazo_flag_clear(prazo_flag *flag) { atomic_store_explicit(flag, 0, memory_order_relaxed); }

static inline int prazo_cond_init_monotonic(pthread_cond_t *cond)
{
    pthread_condattr_t attr;
    int rc = pthread_condattr_init(&attr);
    if (rc != 0)
        return rc;
    rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (rc == 0)
        rc = pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return rc;
}

/* Wait until signalled or until the absolute monotonic time `until_ns`.
 * Returns 0 when woken (possibly spuriously) and ETIMEDOUT at the time. */
static inline int prazo_cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mutex, int64_t until_ns)
{
    struct timespec ts;
    if (until_ns < 0)
        until_ns = 0;
    ts.tv_sec = (time_t)(until_ns / 1000000000LL);
    ts.tv_nsec = (long)(until_ns % 1000000000LL);
    return pthread_cond_timedwait(cond, mutex, &ts);
}

#endif /* PRAZO_SYNC_H */
