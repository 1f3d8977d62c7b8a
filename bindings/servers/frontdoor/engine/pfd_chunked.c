/* The front door's engine: chunked request bodies, decoded in place. */
#include "pfd_internal.h"

/* RFC 9112 section 7.1, as strictly as llhttp's strict mode reads it, with
 * nothing guessed: a chunk size is 1*HEXDIG that fits 64 bits; extensions
 * follow the grammar (BWS ";" BWS token [BWS "=" BWS (token / quoted-string)]),
 * so no BWS before the CRLF; every line ends in CRLF, never a bare LF; trailer
 * lines are field lines (token ":" field value), so the bytes of a request
 * line after "0\r\n" break the body instead of vanishing as a "trailer".
 * The trailers are read and dropped (PEP 3333 has no place for them). */

/* The non-data bytes a chunk line, or the trailer section, may take: the
 * head's own limit, so a body cannot be made of endless metadata. */
#define PFD_MAX_CHUNK_META 65536

static int pfd_tchar(unsigned char ch)
{
    if ((ch | 0x20) >= 'a' && (ch | 0x20) <= 'z')
        return 1;
    if (ch >= '0' && ch <= '9')
        return 1;
    return ch != 0 && strchr("!#$%&'*+-.^_`|~", ch) != NULL;
}

/* field-vchar / obs-text / SP / HTAB: what a field value may hold. */
static int pfd_field_char(unsigned char ch) { return ch == '\t' || (ch >= 0x20 && ch != 0x7f); }

/* Decode the chunked bytes in buf[0..*bufsz) in place, the way
 * phr_decode_chunked does: the data is moved to the front and *bufsz becomes
 * its length. Returns -2 when the body goes on, -1 when it is broken, else the
 * number of bytes after its end, which are moved to buf + *bufsz. */
ssize_t pfd_chunked_decode(struct pfd_chunked *d, char *buf, size_t *bufsz)
{
    size_t n = *bufsz, src = 0, dst = 0;
    *bufsz = 0;
    if (d->state == PFD_CK_ERROR || d->state == PFD_CK_DONE)
        return -1; /* nothing may be fed after the end */
    while (src < n) {
        if (d->state == PFD_CK_DATA) {
            size_t take = n - src;
            if (take > d->left)
                take = (size_t)d->left;
            memmove(buf + dst, buf + src, take);
            dst += take;
            src += take;
            d->left -= take;
            if (d->left == 0)
                d->state = PFD_CK_DATA_CR;
            continue;
        }
        unsigned char ch = (unsigned char)buf[src++];
        int ws = ch == ' ' || ch == '\t';
        if (++d->meta > PFD_MAX_CHUNK_META)
            goto broken;
        switch (d->state) {
        case PFD_CK_SIZE:
        case PFD_CK_SIZE_MORE: {
            int digit = pfd_hex(ch);
            if (digit >= 0) {
                if (d->left > (UINT64_MAX >> 4))
                    goto broken; /* does not fit: never wrap into a small size */
                d->left = d->left * 16 + (uint64_t)digit;
                d->state = PFD_CK_SIZE_MORE;
            } else if (d->state == PFD_CK_SIZE) {
                goto broken;
            } else if (ch == ';') {
                d->state = PFD_CK_EXT_NAME_START;
            } else if (ws) {
                d->state = PFD_CK_SIZE_BWS;
            } else if (ch == '\r') {
                d->state = PFD_CK_SIZE_LF;
            } else {
                goto broken;
            }
            break;
        }
        case PFD_CK_SIZE_BWS:
        case PFD_CK_EXT_VALUE_BWS:
            if (ch == ';')
                d->state = PFD_CK_EXT_NAME_START;
            else if (!ws)
                goto broken;
            break;
        case PFD_CK_EXT_NAME_START:
            if (pfd_tchar(ch))
                d->state = PFD_CK_EXT_NAME;
            else if (!ws)
                goto broken;
            break;
        case PFD_CK_EXT_NAME:
            if (pfd_tchar(ch))
                break;
            if (ws)
                d->state = PFD_CK_EXT_NAME_BWS;
            else if (ch == '=')
                d->state = PFD_CK_EXT_VALUE_START;
            else if (ch == ';')
                d->state = PFD_CK_EXT_NAME_START;
            else if (ch == '\r')
                d->state = PFD_CK_SIZE_LF;
            else
                goto broken;
            break;
        case PFD_CK_EXT_NAME_BWS:
            if (ch == '=')
                d->state = PFD_CK_EXT_VALUE_START;
            else if (ch == ';')
                d->state = PFD_CK_EXT_NAME_START;
            else if (!ws)
                goto broken;
            break;
        case PFD_CK_EXT_VALUE_START:
            if (pfd_tchar(ch))
                d->state = PFD_CK_EXT_TOKEN;
            else if (ch == '"')
                d->state = PFD_CK_EXT_QUOTED;
            else if (!ws)
                goto broken;
            break;
        case PFD_CK_EXT_TOKEN:
            if (pfd_tchar(ch))
                break;
            /* fall through: the token ended */
        case PFD_CK_EXT_VALUE_END:
            if (ws)
                d->state = PFD_CK_EXT_VALUE_BWS;
            else if (ch == ';')
                d->state = PFD_CK_EXT_NAME_START;
            else if (ch == '\r')
                d->state = PFD_CK_SIZE_LF;
            else
                goto broken;
            break;
        case PFD_CK_EXT_QUOTED:
            if (ch == '"')
                d->state = PFD_CK_EXT_VALUE_END;
            else if (ch == '\\')
                d->state = PFD_CK_EXT_QUOTED_PAIR;
            else if (!pfd_field_char(ch))
                goto broken;
            break;
        case PFD_CK_EXT_QUOTED_PAIR:
            if (!pfd_field_char(ch))
                goto broken;
            d->state = PFD_CK_EXT_QUOTED;
            break;
        case PFD_CK_SIZE_LF:
            if (ch != '\n')
                goto broken;
            d->state = d->left ? PFD_CK_DATA : PFD_CK_TRAILER_LINE;
            break;
        case PFD_CK_DATA_CR:
            if (ch != '\r')
                goto broken;
            d->state = PFD_CK_DATA_LF;
            break;
        case PFD_CK_DATA_LF:
            if (ch != '\n')
                goto broken;
            d->state = PFD_CK_SIZE;
            d->meta = 0;
            break;
        case PFD_CK_TRAILER_LINE:
            if (ch == '\r')
                d->state = PFD_CK_END_LF;
            else if (pfd_tchar(ch))
                d->state = PFD_CK_TRAILER_NAME;
            else
                goto broken; /* obs-fold, a bare LF, a request line's space... */
            break;
        case PFD_CK_TRAILER_NAME:
            if (ch == ':')
                d->state = PFD_CK_TRAILER_VALUE;
            else if (!pfd_tchar(ch))
                goto broken;
            break;
        case PFD_CK_TRAILER_VALUE:
            if (ch == '\r')
                d->state = PFD_CK_TRAILER_LF;
            else if (!pfd_field_char(ch))
                goto broken;
            break;
        case PFD_CK_TRAILER_LF:
            if (ch != '\n')
                goto broken;
            d->state = PFD_CK_TRAILER_LINE;
            break;
        case PFD_CK_END_LF: {
            if (ch != '\n')
                goto broken;
            d->state = PFD_CK_DONE;
            size_t rest = n - src;
            memmove(buf + dst, buf + src, rest);
            *bufsz = dst;
            return (ssize_t)rest;
        }
        default:
            goto broken;
        }
    }
    *bufsz = dst;
    return -2;
broken:
    d->state = PFD_CK_ERROR;
    return -1;
}
