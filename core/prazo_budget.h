/* The incoming budget headers' wire rules, once for every C path: the front
 * door's engine (bindings/servers/frontdoor/engine/pfd_head.c) and the middleware's
 * compiled path (bindings/_wsgi_c.pyx) both parse with these. The spec is
 * prazo.bindings.headers; tests/test_frontdoor_parsing.py, tests/test_headers.py
 * and tests/test_wsgi_fast_path.py hold both C paths to it.
 *
 * A value is at most 40 bytes, loses leading and trailing spaces/tabs, and is
 * judged element by element when it holds commas (a header sent twice arrives
 * joined); the smallest valid value of the three headers wins; a header with
 * any invalid element counts once as invalid; the policy caps the result.
 *
 * No locale decides a number: a decimal budget goes through strtod_l with the
 * C locale, so an app that sets LC_NUMERIC to a comma-decimal locale does not
 * turn "1.5" into 1. Plain C, no Python, no lock, safe from any thread.
 * strtod_l and newlocale are POSIX 2008 / GNU: the includer defines
 * _GNU_SOURCE before any system header (Python.h does). */
#ifndef PRAZO_BUDGET_H
#define PRAZO_BUDGET_H

#include <locale.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define PRAZO_BUDGET_MAX_VALUE_CHARS 40
#define PRAZO_BUDGET_MAX_WIRE_MS 9223372036854.0 /* (2**63 - 1) // 10**6 */

/* Which header an incoming budget came from: the table order is the tie-break. */
enum prazo_budget_source {
    PRAZO_BUDGET_NONE = -1,
    PRAZO_BUDGET_REQUEST_BUDGET_MS = 0,
    PRAZO_BUDGET_GRPC_TIMEOUT = 1,
    PRAZO_BUDGET_ENVOY = 2,
    PRAZO_BUDGET_HEADERS = 3
};

/* The field value's limits and optional whitespace: 0 when it is too long. */
static int prazo_strip_field_value(const char **p, size_t *n)
{
    if (*n > PRAZO_BUDGET_MAX_VALUE_CHARS)
        return 0;
    while (*n && (**p == ' ' || **p == '\t')) {
        (*p)++;
        (*n)--;
    }
    while (*n && ((*p)[*n - 1] == ' ' || (*p)[*n - 1] == '\t'))
        (*n)--;
    return 1;
}

static int prazo_ascii_digits(const char *p, size_t n)
{
    if (n == 0)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (p[i] < '0' || p[i] > '9')
            return 0;
    return 1;
}

/* The C locale, made once per process (per includer); a thread that loses the
 * race to publish it frees its own copy. NULL only when out of memory. */
static locale_t prazo_budget_c_locale(void)
{
    static _Atomic(locale_t) cached = (locale_t)0;
    locale_t loc = atomic_load_explicit(&cached, memory_order_acquire);
    if (loc != (locale_t)0)
        return loc;
    locale_t made = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    if (made == (locale_t)0)
        return (locale_t)0;
    locale_t expected = (locale_t)0;
    if (atomic_compare_exchange_strong_explicit(&cached, &expected, made, memory_order_acq_rel, memory_order_acquire))
        return made;
    freelocale(made);
    return expected;
}

/* The digits and '.' in p[0..n) (n <= 40, already checked) as the nearest
 * double, like Python's float(); 0 when no C locale could be had. */
static int prazo_budget_decimal(const char *p, size_t n, double *v)
{
    char tmp[PRAZO_BUDGET_MAX_VALUE_CHARS + 1];
    locale_t c_locale = prazo_budget_c_locale();
    if (c_locale == (locale_t)0)
        return 0;
    memcpy(tmp, p, n);
    tmp[n] = 0;
    *v = strtod_l(tmp, NULL, c_locale);
    return 1;
}

/* Whole milliseconds, [0-9]+ : what prazo itself sends as X-Request-Budget-Ms
 * and all that x-envoy-expected-rq-timeout-ms may be; 1 and *ms when valid. */
static int prazo_parse_whole_ms(const char *p, size_t n, double *ms)
{
    double v;
    if (!prazo_strip_field_value(&p, &n) || !prazo_ascii_digits(p, n) || !prazo_budget_decimal(p, n, &v))
        return 0;
    if (!(v <= PRAZO_BUDGET_MAX_WIRE_MS))
        return 0;
    *ms = v;
    return 1;
}

/* X-Request-Budget-Ms: -?[0-9]+(\.[0-9]+)? ; 1 and *ms when valid. */
static int prazo_parse_budget_ms(const char *p, size_t n, double *ms)
{
    if (!prazo_strip_field_value(&p, &n) || n == 0)
        return 0;
    size_t i = 0;
    if (p[i] == '-')
        i++;
    size_t digits = i;
    while (i < n && p[i] >= '0' && p[i] <= '9')
        i++;
    if (i == digits)
        return 0;
    if (i < n) {
        if (p[i] != '.')
            return 0;
        i++;
        size_t frac = i;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
        if (i == frac || i != n)
            return 0;
    }
    double v;
    if (!prazo_budget_decimal(p, n, &v) || !(v >= -PRAZO_BUDGET_MAX_WIRE_MS && v <= PRAZO_BUDGET_MAX_WIRE_MS))
        return 0;
    *ms = v;
    return 1;
}

/* x-envoy-expected-rq-timeout-ms: whole ms only. */
static int prazo_parse_envoy_ms(const char *p, size_t n, double *ms) { return prazo_parse_whole_ms(p, n, ms); }

/* grpc-timeout: 1-8 digits and one unit of H M S m u n ; 1 and *ms when valid. */
static int prazo_parse_grpc_timeout(const char *p, size_t n, double *ms)
{
    if (!prazo_strip_field_value(&p, &n) || n < 2 || n > 9 || !prazo_ascii_digits(p, n - 1))
        return 0;
    int64_t count = 0;
    for (size_t i = 0; i + 1 < n; i++)
        count = count * 10 + (p[i] - '0');
    int64_t num, den;
    switch (p[n - 1]) {
    case 'H':
        num = 3600000;
        den = 1;
        break;
    case 'M':
        num = 60000;
        den = 1;
        break;
    case 'S':
        num = 1000;
        den = 1;
        break;
    case 'm':
        num = 1;
        den = 1;
        break;
    case 'u':
        num = 1;
        den = 1000;
        break;
    case 'n':
        num = 1;
        den = 1000000;
        break;
    default:
        return 0;
    }
    /* count * num < 2**53: exact, then one correctly rounded division, as in Python. */
    *ms = (double)(count * num) / (double)den;
    return 1;
}

/* Which of the three headers `name` (any case) is, or PRAZO_BUDGET_NONE. */
static int prazo_budget_header_index(const char *name, size_t len)
{
    static const char *const names[PRAZO_BUDGET_HEADERS] = {"x-request-budget-ms", "grpc-timeout",
                                                            "x-envoy-expected-rq-timeout-ms"};
    for (int i = 0; i < PRAZO_BUDGET_HEADERS; i++)
        if (strlen(names[i]) == len && strncasecmp(name, names[i], len) == 0)
            return i;
    return PRAZO_BUDGET_NONE;
}

/* What the budget headers of one request said so far. Zero it to start. */
struct prazo_budget_fold {
    double best[PRAZO_BUDGET_HEADERS];
    int have[PRAZO_BUDGET_HEADERS];
    int present[PRAZO_BUDGET_HEADERS];
    int bad[PRAZO_BUDGET_HEADERS];
};

/* One value of header `which`: every comma-separated element counts. */
static void prazo_budget_fold_value(struct prazo_budget_fold *f, int which, const char *v, size_t n)
{
    typedef int (*parser)(const char *, size_t, double *);
    static const parser parsers[PRAZO_BUDGET_HEADERS] = {prazo_parse_budget_ms, prazo_parse_grpc_timeout,
                                                         prazo_parse_envoy_ms};
    const char *end = v + n;
    f->present[which] = 1;
    for (;;) {
        const char *comma = memchr(v, ',', (size_t)(end - v));
        const char *stop = comma ? comma : end;
        double value;
        if (parsers[which](v, (size_t)(stop - v), &value)) {
            if (!f->have[which] || value < f->best[which])
                f->best[which] = value;
            f->have[which] = 1;
        } else {
            f->bad[which] = 1;
        }
        if (!comma)
            break;
        v = comma + 1;
    }
}

/* The incoming budget: 1 and *ms when some value was valid; *invalid counts
 * the headers (not elements) with any invalid element; *source is the winning
 * header (the first in table order on a tie). */
static int prazo_budget_fold_result(const struct prazo_budget_fold *f, double *ms, int *invalid, int *source)
{
    int found = 0;
    *invalid = 0;
    *source = PRAZO_BUDGET_NONE;
    for (int i = 0; i < PRAZO_BUDGET_HEADERS; i++) {
        if (!f->present[i])
            continue;
        *invalid += f->bad[i];
        if (f->have[i] && (!found || f->best[i] < *ms)) {
            *ms = f->best[i];
            *source = i;
            found = 1;
        }
    }
    return found;
}

/* BudgetPolicy.budget_ms_for, then its conversion: the incoming budget (or the
 * default) within [0, max_ms], in ns, truncated: never a nanosecond more. */
static int64_t prazo_budget_ns(double default_ms, double max_ms, int have, double incoming_ms)
{
    double budget = have ? incoming_ms : default_ms;
    if (budget > max_ms)
        budget = max_ms;
    if (budget < 0.0)
        budget = 0.0;
    return (int64_t)(budget * 1000000.0);
}

#endif /* PRAZO_BUDGET_H */
