/* The front door's engine: what a head says. Its budget, a trusted proxy's
 * queue time, its framing (strictly), and its class. */
#include "pfd_internal.h"

/* ------------------------------------------------------- budget headers */
/* The rules are core/prazo_budget.h's, shared with the middleware's compiled
 * path; here they only meet picohttpparser's headers. */

/* The incoming budget of a head: returns 1 and *ms when some value was valid;
 * *invalid counts the headers (not elements) with any invalid element; *source
 * the winning header (enum prazo_budget_source). */
int pfd_incoming_budget(const struct phr_header *headers, size_t n, double *ms, int *invalid, int *source)
{
    struct prazo_budget_fold fold = {0};
    for (size_t h = 0; h < n; h++) {
        if (headers[h].name == NULL)
            continue;
        int which = prazo_budget_header_index(headers[h].name, headers[h].name_len);
        if (which != PRAZO_BUDGET_NONE)
            prazo_budget_fold_value(&fold, which, headers[h].value, headers[h].value_len);
    }
    return prazo_budget_fold_result(&fold, ms, invalid, source);
}

/* BudgetPolicy.deadline_for: arrival + min(incoming or default, max) - upstream, the
 * budget >= 0 (upstream can only shorten it, down to "already passed"), saturating. */
int64_t pfd_deadline_for(double default_ms, double max_ms, int have, double incoming_ms, int64_t arrival_ns,
                         int64_t upstream_ns)
{
    int64_t budget_ns = prazo_budget_ns(default_ms, max_ms, have, incoming_ms);
    if (upstream_ns > 0)
        budget_ns -= upstream_ns < budget_ns ? upstream_ns : budget_ns;
    int64_t deadline;
    if (__builtin_add_overflow(arrival_ns, budget_ns, &deadline))
        deadline = INT64_MAX;
    return deadline;
}

/* ------------------------------------------------- front-proxy queue time */
/* The X-Request-Start / X-Queue-Start rules of prazo.bindings.proxy_headers
 * (parse_request_start_ns, upstream_wait_ns, FrontProxyBudgetPolicy), which
 * stay the spec: tests/test_frontdoor_parsing.py runs Hypothesis over both
 * parsers and both deadlines and asserts they agree. A value is at most 40
 * characters, loses leading and trailing spaces/tabs, then is `t=`? digits
 * (1-20) and an optional fraction of 1-9 digits; the unit follows from the
 * integer's magnitude; a moment outside 2000-01-01 .. 2100-01-01 UTC is no
 * stamp. A header sent twice reaches the Python side joined with a comma,
 * which no stamp holds: here too it is no stamp. */

/* 1 and *ns (ns since the epoch) when the value is a valid stamp. */
int pfd_parse_request_start_ns(const char *p, size_t n, int64_t *ns)
{
    if (!prazo_strip_field_value(&p, &n))
        return 0;
    size_t i = 0;
    if (n >= 2 && p[0] == 't' && p[1] == '=')
        i = 2;
    size_t digits = i;
    uint64_t integer = 0;
    int too_big = 0;
    while (i < n && p[i] >= '0' && p[i] <= '9') {
        /* Anything from LATEST on is out of range in every unit (a value that
         * large can only be ns): stop counting, keep checking the syntax. */
        if (integer >= (uint64_t)PFD_LATEST_STAMP_NS / 10)
            too_big = 1; /* one more digit reaches LATEST (and could overflow) */
        else if ((integer = integer * 10 + (uint64_t)(p[i] - '0')) >= (uint64_t)PFD_LATEST_STAMP_NS)
            too_big = 1;
        i++;
    }
    size_t int_digits = i - digits;
    if (int_digits < 1 || int_digits > 20)
        return 0;
    uint64_t fraction = 0, scale = 1;
    int has_fraction = 0;
    if (i < n) {
        if (p[i] != '.')
            return 0;
        i++;
        size_t start = i;
        while (i < n && p[i] >= '0' && p[i] <= '9') {
            fraction = fraction * 10 + (uint64_t)(p[i] - '0');
            scale *= 10;
            i++;
        }
        if (i == start || i - start > 9 || i != n)
            return 0;
        has_fraction = 1;
    }
    if (too_big)
        return 0;
    uint64_t unit = integer < 100000000000ULL         ? 1000000000ULL
                    : integer < 100000000000000ULL    ? 1000000ULL
                    : integer < 100000000000000000ULL ? 1000ULL
                                                      : 1ULL;
    if (has_fraction && unit == 1)
        return 0; /* a fraction of a nanosecond is not a real stamp */
    /* (integer * scale + fraction) * unit // scale, exactly: integer * unit is
     * a multiple of scale's share; fraction * unit < 10**18 fits. */
    uint64_t whole;
    if (__builtin_mul_overflow(integer, unit, &whole))
        return 0;
    uint64_t stamp = whole + fraction * unit / scale;
    if (stamp < (uint64_t)PFD_EARLIEST_STAMP_NS || stamp >= (uint64_t)PFD_LATEST_STAMP_NS)
        return 0;
    *ns = (int64_t)stamp;
    return 1;
}

/* The earliest valid stamp of a head's X-Request-Start / X-Queue-Start; 1 and *ns when there is one. */
int pfd_request_start(const struct phr_header *headers, size_t n, int64_t *ns)
{
    static const char *const names[2] = {"x-request-start", "x-queue-start"};
    int seen[2] = {0, 0}, have[2] = {0, 0};
    int64_t stamp[2] = {0, 0};
    for (size_t h = 0; h < n; h++) {
        if (headers[h].name == NULL)
            continue;
        for (int k = 0; k < 2; k++) {
            if (headers[h].name_len != strlen(names[k]) || strncasecmp(headers[h].name, names[k], headers[h].name_len))
                continue;
            seen[k]++;
            have[k] = pfd_parse_request_start_ns(headers[h].value, headers[h].value_len, &stamp[k]);
        }
    }
    int found = 0;
    for (int k = 0; k < 2; k++) {
        if (seen[k] != 1 || !have[k])
            continue; /* a repeated header is joined with a comma on the Python side: no stamp */
        if (!found || stamp[k] < *ns)
            *ns = stamp[k];
        found = 1;
    }
    return found;
}

/* Is the peer one of the trusted networks? An IPv4-mapped IPv6 peer
 * (::ffff:a.b.c.d, a dual-stack listener's IPv4 client) also matches as its
 * IPv4 address, as FrontProxyBudgetPolicy._peer_trusted does. */
static int pfd_prefix_match(const unsigned char *addr, const unsigned char *net, int prefix)
{
    int full = prefix / 8, rest = prefix % 8;
    if (memcmp(addr, net, (size_t)full) != 0)
        return 0;
    if (rest == 0)
        return 1;
    unsigned char mask = (unsigned char)(0xff << (8 - rest));
    return (addr[full] & mask) == (net[full] & mask);
}

/* `addr` of `family` (AF_INET: 4 bytes, AF_INET6: 16, network byte order). */
int pfd_address_trusted(const struct pfd_config *cfg, int family, const unsigned char *addr)
{
    if (cfg->n_trusted < 0)
        return 1;
    const unsigned char *v4 = NULL, *v6 = NULL;
    if (family == AF_INET) {
        v4 = addr;
    } else if (family == AF_INET6) {
        static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        v6 = addr;
        if (memcmp(v6, mapped, 12) == 0)
            v4 = v6 + 12;
    } else {
        return 0; /* not an IP peer: no REMOTE_ADDR on the Python side either */
    }
    for (int i = 0; i < cfg->n_trusted; i++) {
        const struct pfd_net *net = &cfg->trusted[i];
        if (net->family == AF_INET && v4 && pfd_prefix_match(v4, net->addr, net->prefix))
            return 1;
        if (net->family == AF_INET6 && v6 && pfd_prefix_match(v6, net->addr, net->prefix))
            return 1;
    }
    return 0;
}

static int pfd_peer_trusted(const struct pfd_config *cfg, const struct sockaddr_storage *peer)
{
    if (peer->ss_family == AF_INET)
        return pfd_address_trusted(cfg, AF_INET, (const unsigned char *)&((const struct sockaddr_in *)peer)->sin_addr);
    if (peer->ss_family == AF_INET6)
        return pfd_address_trusted(cfg, AF_INET6,
                                   (const unsigned char *)&((const struct sockaddr_in6 *)peer)->sin6_addr);
    return pfd_address_trusted(cfg, peer->ss_family, NULL);
}

/* upstream_wait_ns: arrival - stamp within [0, max_wait_ns]. A stamp after the
 * arrival (a proxy clock ahead of ours) is no wait, never more time. Saturating,
 * so any int64 inputs are safe (the engine's are within centuries of 1970). */
int64_t pfd_upstream_wait_ns(int64_t stamp_ns, int64_t arrival_wall_ns, int64_t max_wait_ns)
{
    int64_t wait;
    if (__builtin_sub_overflow(arrival_wall_ns, stamp_ns, &wait))
        wait = arrival_wall_ns > stamp_ns ? INT64_MAX : 0;
    if (wait < 0 || max_wait_ns <= 0)
        return 0;
    return wait < max_wait_ns ? wait : max_wait_ns;
}

/* The time c queued in a trusted front proxy before its arrival here:
 * from the stamp to the wall-clock moment of c->arrival_ns, in [0, max_upstream_ns].
 * The wall clock and the monotonic clock are read together, so the arrival
 * (monotonic) is moved onto the wall clock the stamp is on. */
int64_t pfd_upstream_ns(const struct pfd_config *cfg, const struct pfd_conn *c)
{
    if (!cfg->trust_request_start || !pfd_peer_trusted(cfg, &c->peer))
        return 0;
    int64_t stamp;
    if (!pfd_request_start(c->headers, c->num_headers, &stamp))
        return 0;
    struct timespec real;
    clock_gettime(CLOCK_REALTIME, &real);
    int64_t mono = pfd_now_ns();
    int64_t arrival_wall = (int64_t)real.tv_sec * 1000000000LL + real.tv_nsec - (mono - c->arrival_ns);
    return pfd_upstream_wait_ns(stamp, arrival_wall, cfg->max_upstream_ns);
}

/* ---------------------------------------------------------- head framing */

static int pfd_token_in(const char *v, size_t n, const char *token)
{
    size_t tl = strlen(token);
    size_t i = 0;
    while (i < n) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ','))
            i++;
        size_t s = i;
        while (i < n && v[i] != ',')
            i++;
        size_t e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t'))
            e--;
        if (e - s == tl && strncasecmp(v + s, token, tl) == 0)
            return 1;
    }
    return 0;
}

static int pfd_name_is(const struct phr_header *h, const char *name)
{
    return h->name != NULL && h->name_len == strlen(name) && strncasecmp(h->name, name, h->name_len) == 0;
}

/* What picohttpparser lets through and RFC 9112 (read as llhttp's strict mode
 * reads it) does not: every line ends in CRLF (a bare LF is where parsers
 * disagree on where a line ends); the request line has single spaces,
 * HTTP/1.0 or 1.1, and a target in origin-form, absolute-form (http/https) or
 * "*" for OPTIONS, of visible ASCII only. CONNECT (a tunnel) and TRACE (it
 * would echo the client's credentials back) are refused: the app behind a WSGI
 * server can do neither safely. */
static int pfd_request_line_ok(const struct pfd_conn *c)
{
    for (size_t i = 0; i < c->head_len; i++)
        if (c->buf[i] == '\n' && (i == 0 || c->buf[i - 1] != '\r'))
            return 0;
    /* picohttpparser skips runs of spaces; its path pointer shows whether it did. */
    if (c->path != c->method + c->method_len + 1 || c->path[c->path_len + 1] != 'H')
        return 0;
    if (c->minor_version > 1)
        return 0;
    if ((c->method_len == 7 && memcmp(c->method, "CONNECT", 7) == 0) ||
        (c->method_len == 5 && memcmp(c->method, "TRACE", 5) == 0))
        return 0;
    for (size_t i = 0; i < c->path_len; i++)
        if ((unsigned char)c->path[i] <= 0x20 || (unsigned char)c->path[i] >= 0x7f)
            return 0;
    if (c->path[0] == '/')
        return 1;
    if (c->path_len == 1 && c->path[0] == '*')
        return c->method_len == 7 && memcmp(c->method, "OPTIONS", 7) == 0;
    return (c->path_len > 7 && strncasecmp(c->path, "http://", 7) == 0) ||
           (c->path_len > 8 && strncasecmp(c->path, "https://", 8) == 0);
}

/* A Host value is an authority's host and port (RFC 3986 reg-name, IP
 * literal, ':' port) or empty: no spaces, no userinfo, no path. */
static int pfd_host_ok(const char *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)v[i];
        if (!(((ch | 0x20) >= 'a' && (ch | 0x20) <= 'z') || (ch >= '0' && ch <= '9') ||
              (ch != 0 && strchr("-._~%!$&'()*+,;=:[]", ch) != NULL)))
            return 0;
    }
    return 1;
}

/* Parse the head in c->buf. Returns 1 complete, 0 incomplete, -1 malformed or ambiguous. */
int pfd_parse_head(struct pfd_conn *c, size_t last_len)
{
    c->num_headers = PFD_MAX_HEADERS;
    int r = phr_parse_request(c->buf, c->len, &c->method, &c->method_len, &c->path, &c->path_len, &c->minor_version,
                              c->headers, &c->num_headers, last_len);
    if (r == -2)
        return 0;
    if (r < 0)
        return -1;
    c->head_len = (size_t)r;
    c->content_length = -1;
    c->chunked = 0;
    c->expect_continue = 0;
    if (!pfd_request_line_ok(c))
        return -1;
    int seen_te = 0, connection_close = 0, connection_keep = 0, hosts = 0;
    for (size_t i = 0; i < c->num_headers; i++) {
        const struct phr_header *h = &c->headers[i];
        if (h->name == NULL || h->name_len == 0)
            return -1; /* obsolete line folding: refused, never guessed at */
        if (pfd_name_is(h, "content-length")) {
            if (!prazo_ascii_digits(h->value, h->value_len) || h->value_len > 18)
                return -1;
            int64_t v = 0;
            for (size_t k = 0; k < h->value_len; k++)
                v = v * 10 + (h->value[k] - '0');
            if (c->content_length >= 0 && c->content_length != v)
                return -1;
            c->content_length = v;
        } else if (pfd_name_is(h, "transfer-encoding")) {
            if (seen_te || h->value_len != 7 || strncasecmp(h->value, "chunked", 7) != 0)
                return -1;
            seen_te = 1;
        } else if (pfd_name_is(h, "connection")) {
            connection_close |= pfd_token_in(h->value, h->value_len, "close");
            connection_keep |= pfd_token_in(h->value, h->value_len, "keep-alive");
        } else if (pfd_name_is(h, "host")) {
            /* RFC 9112 section 3.2: two Hosts, or one that is no authority, are a 400 (never joined). */
            if (++hosts > 1 || !pfd_host_ok(h->value, h->value_len))
                return -1;
        } else if (pfd_name_is(h, "expect")) {
            if (h->value_len == 12 && strncasecmp(h->value, "100-continue", 12) == 0)
                c->expect_continue = 1;
        }
    }
    if (hosts == 0 && c->minor_version >= 1)
        return -1; /* RFC 9112 section 3.2: an HTTP/1.1 request without Host is a 400 */
    if (seen_te) {
        if (c->content_length >= 0 || c->minor_version == 0)
            return -1;
        c->chunked = 1;
    }
    if (c->minor_version >= 1)
        c->client_keep_alive = !connection_close;
    else
        c->client_keep_alive = connection_keep && !connection_close;
    return 1;
}

/* How the head in c->buf is answered. The limit holds for the head however it
 * arrived: a head finished by a later read is as large as one read at once. */
enum pfd_head_verdict pfd_judge_head(struct pfd_conn *c, size_t max_head, size_t last_len)
{
    int r = pfd_parse_head(c, last_len);
    if (r == 1)
        return c->head_len > max_head ? PFD_HEAD_TOO_LARGE : PFD_HEAD_COMPLETE;
    if (r < 0)
        return PFD_HEAD_BAD;
    return c->len >= max_head ? PFD_HEAD_TOO_LARGE : PFD_HEAD_PARTIAL;
}

/* A worker starts on c: its body is read from just after the head. */
void pfd_conn_start_body(struct pfd_conn *c)
{
    c->pos = c->head_len;
    c->body_left = c->chunked ? 0 : (c->content_length > 0 ? c->content_length : 0);
    c->body_done = !pfd_has_body(c);
    c->body_error = 0;
    c->write_until = 0;
    atomic_store_explicit(&c->io_waited_ns, 0, memory_order_relaxed);
    memset(&c->decoder, 0, sizeof c->decoder);
    c->cbuf_pos = c->cbuf_len = 0;
}

/* ------------------------------------------------------ the critical class */

/* 1 when the raw path, percent-decoded as urllib's unquote_to_bytes does it
 * (a '%' not followed by two hex digits stays as it is), is `want`. */
int pfd_decoded_path_is(const char *raw, size_t n, const char *want, size_t want_len)
{
    size_t j = 0;
    for (size_t i = 0; i < n; i++, j++) {
        unsigned char ch = (unsigned char)raw[i];
        int hi = ch == '%' && i + 2 < n ? pfd_hex((unsigned char)raw[i + 1]) : -1;
        int lo = hi >= 0 ? pfd_hex((unsigned char)raw[i + 2]) : -1;
        if (lo >= 0) {
            ch = (unsigned char)(hi * 16 + lo);
            i += 2;
        }
        if (j >= want_len || (unsigned char)want[j] != ch)
            return 0;
    }
    return j == want_len;
}

/* Is this head of the critical class? The rule is bindings/policies.py's
 * CriticalClassifier applied to the environ the workers build (the agreement
 * test in tests/servers/test_frontdoor_critical.py holds the two together):
 * its path (PATH_INFO: before '?', percent-decoded; "/" for an absolute-form
 * target without one) is one of cfg.critical_paths, or cfg.critical_header's
 * value, stripped of SP/HTAB, is "critical". A header sent twice reaches the
 * app as the two values joined by ",", which is never "critical". */
int pfd_is_critical(const struct pfd_server *srv, const struct pfd_conn *c)
{
    if (srv->cfg.critical_header) {
        int said = 0, seen = 0;
        for (size_t h = 0; h < c->num_headers; h++) {
            const struct phr_header *hd = &c->headers[h];
            if (hd->name == NULL || hd->name_len != srv->cfg.critical_header_len ||
                strncasecmp(hd->name, srv->cfg.critical_header, hd->name_len) != 0)
                continue;
            const char *v = hd->value;
            size_t n = hd->value_len;
            /* not prazo_strip_field_value: its length cap is the budget parser's, not this rule's */
            while (n && (*v == ' ' || *v == '\t'))
                v++, n--;
            while (n && (v[n - 1] == ' ' || v[n - 1] == '\t'))
                n--;
            seen++;
            said = n == 8 && strncasecmp(v, "critical", 8) == 0;
        }
        if (said && seen == 1)
            return 1;
    }
    if (srv->cfg.critical_paths) {
        const char *path = c->path;
        size_t len = c->path_len;
        /* absolute-form: the path follows the authority, as the workers' PATH_INFO takes it */
        size_t skip = 0;
        if (len >= 7 && memcmp(path, "http://", 7) == 0)
            skip = 7;
        else if (len >= 8 && memcmp(path, "https://", 8) == 0)
            skip = 8;
        if (skip) {
            const char *slash = memchr(path + skip, '/', len - skip);
            if (slash) {
                len -= (size_t)(slash - path);
                path = slash;
            } else {
                path = "/"; /* no path after the authority: the workers' PATH_INFO is "/" */
                len = 1;
            }
        }
        const char *q = len ? memchr(path, '?', len) : NULL;
        if (q)
            len = (size_t)(q - path);
        for (const char *p = srv->cfg.critical_paths, *end = p + srv->cfg.critical_paths_len; len && p < end;) {
            size_t plen = strlen(p);
            if (pfd_decoded_path_is(path, len, p, plen))
                return 1;
            p += plen + 1;
        }
    }
    return 0;
}
