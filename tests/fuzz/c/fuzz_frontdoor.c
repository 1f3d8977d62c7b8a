/* libFuzzer harness over the front door's C engine (bindings/servers/frontdoor/engine/pfd.h),
 * built with clang -fsanitize=fuzzer,address,undefined by `make fuzz` / `make fuzz-ci`.
 *
 * An input is the bytes a client sends on one connection. They go through the
 * engine's own functions, not a copy of them:
 *   - framing: pfd_judge_head, then the worker's pfd_conn_read_body over the bytes
 *     already received (no socket: a read past them fails at once) in reads of
 *     varying size, then the put-back of what follows a body as the next head
 *     (pfd_conn_reset_for_next), request after request;
 *   - each complete head's budget, stamp, critical-class and deadline parsing;
 *   - the head read in pieces (as recv delivers it, with last_len) against the
 *     head read at once: the verdict may not depend on how TCP cut the bytes;
 *   - the chunked decoder over the whole input at once and in pieces: the same
 *     outcome, the same data, the same end;
 *   - the budget and stamp parsers on the input's first bytes as a field value.
 * A disagreement aborts (a finding, like a sanitizer report). Every buffer is
 * allocated to its exact size, so AddressSanitizer sees a read one byte past.
 */
#include "pfd.h"

#define MAX_HEAD 65536

static struct pfd_server *srv;

/* Split points and read sizes from the input itself: a run is reproducible from its input alone. */
static uint64_t mix(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t seed_of(const uint8_t *data, size_t size)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < size; i++)
        h = (h ^ data[i]) * 1099511628211ULL;
    return h;
}

static void check(int ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_frontdoor: %s\n", what);
        abort();
    }
}

static struct pfd_conn *conn_over(const uint8_t *data, size_t size)
{
    struct pfd_conn *c = calloc(1, sizeof *c);
    check(c != NULL, "out of memory");
    c->fd = -1;
    c->buf = malloc(size ? size : 1);
    check(c->buf != NULL, "out of memory");
    memcpy(c->buf, data, size);
    c->len = c->cap = size;
    return c;
}

static void conn_free(struct pfd_conn *c)
{
    free(c->buf);
    free(c->cbuf);
    free(c);
}

/* What the engine reads out of a complete head before it admits it. */
static void parse_head_fields(struct pfd_conn *c)
{
    double ms = 0.0;
    int invalid = 0, source = PRAZO_BUDGET_NONE;
    int have = pfd_incoming_budget(c->headers, c->num_headers, &ms, &invalid, &source);
    check(!have || (source >= 0 && source < 3), "a budget without its source");
    check(invalid >= 0 && invalid <= 3, "more invalid budget headers than there are");
    int64_t arrival = pfd_now_ns();
    c->arrival_ns = arrival;
    c->upstream_ns = pfd_upstream_ns(&srv->cfg, c);
    check(c->upstream_ns >= 0 && c->upstream_ns <= srv->cfg.max_upstream_ns, "upstream wait outside [0, max]");
    int64_t deadline = pfd_deadline_for(1000.0, 30000.0, have, ms, arrival, c->upstream_ns);
    check(deadline >= arrival && deadline <= arrival + 30000LL * 1000000LL, "deadline outside the budget");
    (void)pfd_is_critical(srv, c);
}

/* The requests in data, as the engine frames them on one connection. */
static void frame(const uint8_t *data, size_t size, uint64_t *rng)
{
    struct pfd_conn *c = conn_over(data, size);
    size_t last_end = 0;
    char *scratch = malloc(PFD_READ_CHUNK);
    check(scratch != NULL, "out of memory");
    while (c->len) {
        if (pfd_judge_head(c, MAX_HEAD, 0) != PFD_HEAD_COMPLETE)
            break;
        check(c->head_len <= c->len && c->head_len <= MAX_HEAD, "a head beyond its bytes or the limit");
        parse_head_fields(c);
        int keep = c->client_keep_alive;
        int64_t declared = c->content_length;
        int chunked = c->chunked;
        pfd_conn_start_body(c);
        c->expect_continue = 0; /* no socket to write 100 Continue to */
        int64_t body = 0;
        ssize_t n;
        do {
            size_t want = 1 + (size_t)(mix(rng) % (mix(rng) & 1 ? 7 : PFD_READ_CHUNK));
            n = pfd_conn_read_body(srv, c, scratch, want);
            check(n <= (ssize_t)want, "a read beyond what was asked");
            if (n > 0)
                body += n;
        } while (n > 0);
        if (n < 0) {
            check(!chunked || c->decoder.state == PFD_CK_ERROR || c->pos == c->len, "a short body with bytes left");
            break;
        }
        check(chunked || body == (declared > 0 ? declared : 0), "a Content-Length body of another length");
        check(c->body_done && c->cbuf_pos == c->cbuf_len, "a body ended but not all given out");
        pfd_conn_reset_for_next(c, c->pos);
        size_t end = size - c->len;
        check(end > last_end && end <= size, "a request that took no bytes, or more than there were");
        check((size_t)body <= end - last_end, "a body longer than its bytes");
        /* What is left is the input's own tail: the put-back kept every byte, in order. */
        check(c->len == 0 || memcmp(c->buf, data + end, c->len) == 0, "the next request's bytes changed");
        last_end = end;
        if (!keep)
            break;
    }
    free(scratch);
    conn_free(c);
}

/* The head read in pieces, with last_len as pfd_io_read_head passes it, against the head read at once. */
static void head_in_pieces(const uint8_t *data, size_t size, uint64_t *rng)
{
    struct pfd_conn *whole = conn_over(data, size);
    enum pfd_head_verdict at_once = pfd_judge_head(whole, MAX_HEAD, 0);
    size_t head_len = whole->head_len;
    conn_free(whole);

    struct pfd_conn *c = calloc(1, sizeof *c);
    check(c != NULL, "out of memory");
    c->fd = -1;
    enum pfd_head_verdict v = PFD_HEAD_PARTIAL;
    size_t got = 0;
    while (got < size && v == PFD_HEAD_PARTIAL) {
        size_t piece = 1 + (size_t)(mix(rng) % (size - got < 64 ? size - got : 64));
        char *nb = realloc(c->buf, got + piece); /* exactly what arrived so far */
        check(nb != NULL, "out of memory");
        c->buf = nb;
        memcpy(c->buf + got, data + got, piece);
        size_t last = got;
        got += piece;
        c->len = c->cap = got;
        v = pfd_judge_head(c, MAX_HEAD, last);
    }
    /* Only a complete head must match: picohttpparser with last_len looks for the
     * head's end before it parses, so a broken incomplete head read in pieces
     * waits (for the head timeout or the limit) where one read at once is a 400. */
    if (v == PFD_HEAD_COMPLETE || at_once == PFD_HEAD_COMPLETE)
        check(v == at_once && c->head_len == head_len, "a head judged differently when it arrives in pieces");
    conn_free(c);
}

/* The chunked decoder over data as a body: at once, and fed in pieces. */
static void chunked_in_pieces(const uint8_t *data, size_t size, uint64_t *rng)
{
    struct pfd_chunked one = {0};
    char *all = malloc(size ? size : 1);
    check(all != NULL, "out of memory");
    memcpy(all, data, size);
    size_t all_len = size;
    ssize_t all_rest = pfd_chunked_decode(&one, all, &all_len);
    check(all_rest >= -2 && all_rest <= (ssize_t)size, "an impossible result");
    check(all_len + (all_rest > 0 ? (size_t)all_rest : 0) <= size, "more bytes out than in");

    struct pfd_chunked d = {0};
    char *out = malloc(size ? size : 1);
    check(out != NULL, "out of memory");
    size_t out_len = 0, fed = 0;
    ssize_t rest = -2;
    while (fed < size && rest == -2) {
        size_t piece = 1 + (size_t)(mix(rng) % (size - fed < 300 ? size - fed : 300));
        char *p = malloc(piece);
        check(p != NULL, "out of memory");
        memcpy(p, data + fed, piece);
        size_t n = piece;
        rest = pfd_chunked_decode(&d, p, &n);
        fed += piece;
        check(n <= piece, "decoded more than was fed");
        if (rest >= 0) {
            check((size_t)rest <= piece - n, "more left over than was fed");
            check(memcmp(p + n, data + fed - (size_t)rest, (size_t)rest) == 0, "the bytes after the body changed");
            fed -= (size_t)rest;
        }
        if (rest != -1) {
            memcpy(out + out_len, p, n);
            out_len += n;
        }
        free(p);
    }
    check((rest == -1) == (all_rest == -1), "broken at once but not in pieces, or the other way");
    if (all_rest >= 0) {
        check(rest >= 0 && fed == size - (size_t)all_rest, "the body ends elsewhere in pieces");
        check(out_len == all_len && memcmp(out, all, all_len) == 0, "other data in pieces");
        check(memcmp(all + all_len, data + size - (size_t)all_rest, (size_t)all_rest) == 0, "the tail changed");
    } else if (all_rest == -2) {
        check(rest == -2 && out_len == all_len && memcmp(out, all, all_len) == 0, "other data in pieces");
    }
    /* A broken decoder stays broken; a finished one takes nothing more. */
    if (rest == -1 || rest >= 0) {
        char byte = '0';
        size_t n = 1;
        check(pfd_chunked_decode(&d, &byte, &n) == -1, "the decoder went on after its end");
    }
    free(out);
    free(all);
}

static void value_parsers(const uint8_t *data, size_t size)
{
    size_t n = size < 48 ? size : 48;
    char *v = malloc(n ? n : 1);
    check(v != NULL, "out of memory");
    memcpy(v, data, n);
    double ms;
    int64_t ns;
    if (prazo_parse_budget_ms(v, n, &ms))
        check(ms >= -PRAZO_BUDGET_MAX_WIRE_MS && ms <= PRAZO_BUDGET_MAX_WIRE_MS, "a budget beyond the wire's range");
    if (prazo_parse_envoy_ms(v, n, &ms))
        check(ms >= 0 && ms <= PRAZO_BUDGET_MAX_WIRE_MS, "an envoy timeout beyond the wire's range");
    if (prazo_parse_grpc_timeout(v, n, &ms))
        check(ms >= 0, "a negative grpc-timeout");
    if (pfd_parse_request_start_ns(v, n, &ns))
        check(ns >= PFD_EARLIEST_STAMP_NS && ns < PFD_LATEST_STAMP_NS, "a stamp outside 2000..2100");
    (void)pfd_decoded_path_is(v, n, "/a b", 4);
    free(v);
    if (size >= 24) {
        int64_t a, b, cap;
        memcpy(&a, data, 8);
        memcpy(&b, data + 8, 8);
        memcpy(&cap, data + 16, 8);
        int64_t wait = pfd_upstream_wait_ns(a, b, cap);
        check(wait >= 0 && (cap <= 0 ? wait == 0 : wait <= cap), "an upstream wait outside [0, cap]");
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    srv = calloc(1, sizeof *srv);
    check(srv != NULL, "out of memory");
    pthread_mutex_init(&srv->mutex, NULL);
    srv->cfg.max_head = MAX_HEAD;
    srv->cfg.critical_header = "x-class";
    srv->cfg.critical_header_len = 7;
    static const char paths[] = "/healthz\0/a b\0";
    srv->cfg.critical_paths = paths;
    srv->cfg.critical_paths_len = sizeof paths - 1;
    srv->cfg.trust_request_start = 1;
    srv->cfg.n_trusted = -1; /* any peer: the stamp parsing always runs */
    srv->cfg.max_upstream_ns = 5000LL * 1000000LL;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t rng = seed_of(data, size);
    frame(data, size, &rng);
    head_in_pieces(data, size, &rng);
    chunked_in_pieces(data, size, &rng);
    value_parsers(data, size);
    return 0;
}
