# cython: freethreading_compatible = True
# The head reader's compiled twin (prazo.bindings.servers.plumbing.heads is its
# specification, and a Hypothesis test holds the two together).
#
# Why it exists: the socket-level embeddings look at every request head on the
# server's own I/O loop (gunicorn's main loop, cheroot's and werkzeug's
# accepting threads) before the request is admitted. In Python that costs about
# thirty calls a request and, worse, a recv() that lets go of the GIL: on a
# busy server the loop then waits for a worker thread to hand the GIL back.
# recv_nowait never blocks (MSG_DONTWAIT), so it keeps the GIL for its few
# microseconds in the kernel.
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeLatin1
from libc.string cimport memchr


cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    enum:
        MSG_PEEK
        MSG_DONTWAIT


cdef extern from "<errno.h>" nogil:
    int errno
    enum:
        EAGAIN
        EWOULDBLOCK
        EINTR


# The most a look takes at once (heads.MAX_HEAD_BYTES). One buffer for every
# caller is safe: recv_nowait holds the GIL from the recv to the copy.
DEF _BUFFER_BYTES = 65536
cdef char _buffer[_BUFFER_BYTES]


def recv_nowait(int fd, Py_ssize_t limit, bint peek=False):
    """Up to ``limit`` bytes waiting on ``fd``, taken off it (left in place with ``peek``); never blocks.

    None when nothing has arrived yet, ``b""`` when the peer has closed its
    side or the socket failed (``heads.waiting_bytes`` is the specification).
    """
    if limit <= 0:
        raise ValueError(f"limit must be > 0, got {limit}")
    cdef size_t n = <size_t>limit if limit < _BUFFER_BYTES else _BUFFER_BYTES
    cdef int flags = MSG_DONTWAIT | (MSG_PEEK if peek else 0)
    cdef ssize_t got = recv(fd, _buffer, n, flags)
    cdef int error
    if got < 0:
        # EWOULDBLOCK is EAGAIN on Linux: two separate tests, or C sees one case twice.
        error = errno
        if error == EAGAIN or error == EINTR:
            return None
        if error == EWOULDBLOCK:
            return None
        return b""
    return PyBytes_FromStringAndSize(_buffer, got)


def find_head(bytes data):
    """The request head in ``data`` if all of it is there, else None (``heads.find_head``)."""
    cdef const char *p = PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t start = 0
    cdef Py_ssize_t i
    cdef const char *hit
    while start < n:
        if p[start] == b'\n':
            start += 1
        elif p[start] == b'\r' and start + 1 < n and p[start + 1] == b'\n':
            start += 2
        else:
            break
    i = start
    while i < n:
        hit = <const char *>memchr(p + i, b'\n', n - i)
        if hit == NULL:
            return None
        i = hit - p
        # The head ends at the first empty line: "\n\n" or "\n\r\n".
        if i + 1 < n and (p[i + 1] == b'\n' or (p[i + 1] == b'\r' and i + 2 < n and p[i + 2] == b'\n')):
            return PyBytes_FromStringAndSize(p + start, i + 1 - start)
        i += 1
    return None


cdef inline bint _is_space(char c):
    # What bytes.strip() strips.
    return c == b' ' or c == b'\t' or c == b'\n' or c == b'\r' or c == b'\x0b' or c == b'\x0c'


cdef str _upper_key(const char *name, Py_ssize_t length):
    # "HTTP_" + the name upper-cased, "-" as "_"; ASCII only (the caller checked).
    cdef bytearray key = bytearray(5 + length)
    cdef char *k = key
    cdef Py_ssize_t j
    cdef char c
    k[0] = b'H'; k[1] = b'T'; k[2] = b'T'; k[3] = b'P'; k[4] = b'_'
    for j in range(length):
        c = name[j]
        if c == b'-':
            c = b'_'
        elif b'a' <= c <= b'z':
            c = c - 32
        k[5 + j] = c
    return PyUnicode_DecodeLatin1(k, 5 + length, NULL)


def request_environ(bytes head, remote_addr=None):
    """What ``heads.request_environ`` gives, or None where its rules need Python (then the caller runs them).

    Covered here: a request line of three parts whose target is an
    origin-form path without percent-escapes, and header names in ASCII.
    Anything else (absolute-form targets, escapes, names with non-ASCII bytes,
    a malformed request line) returns None.
    """
    cdef const char *p = PyBytes_AS_STRING(head)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(head)
    cdef Py_ssize_t line_end, end, i, colon, name_end, value_start, value_end, spaces, first_space, second_space
    cdef Py_ssize_t path_end
    cdef const char *hit
    cdef dict environ = {}
    cdef str key
    cdef str text
    cdef object previous
    cdef bint ascii
    if isinstance(remote_addr, str):
        environ["REMOTE_ADDR"] = remote_addr
    # The request line: exactly two single spaces, a method, an origin-form target.
    hit = <const char *>memchr(p, b'\n', n)
    line_end = n if hit == NULL else hit - p
    end = line_end
    while end > 0 and p[end - 1] == b'\r':
        end -= 1
    spaces = 0
    first_space = second_space = -1
    for i in range(end):
        if p[i] == b' ':
            spaces += 1
            if spaces == 1:
                first_space = i
            elif spaces == 2:
                second_space = i
    if spaces != 2 or first_space == 0:
        return None
    if second_space == first_space + 1 or p[first_space + 1] != b'/':
        return None
    path_end = first_space + 1
    while path_end < second_space and p[path_end] != b'?' and p[path_end] != b'#':
        if p[path_end] == b'%':
            return None
        path_end += 1
    # The header lines, as heads.head_environ reads them.
    i = line_end + 1
    while i < n:
        hit = <const char *>memchr(p + i, b'\n', n - i)
        line_end = n if hit == NULL else hit - p
        end = line_end
        while end > i and p[end - 1] == b'\r':
            end -= 1
        hit = <const char *>memchr(p + i, b':', end - i)
        if hit != NULL:
            colon = hit - p
            name_end = colon
            ascii = True
            key = None
            if colon > i and not _is_space(p[i]) and not _is_space(p[colon - 1]):
                for value_start in range(i, colon):
                    if p[value_start] == b' ' or p[value_start] == b'\t':
                        ascii = False  # not a field name: skipped, like the Python rule
                        break
                    if <unsigned char>p[value_start] >= 0x80:
                        return None
                    if p[value_start] == b'_':
                        ascii = False  # an ambiguous name (headers.is_ambiguous_header_name): dropped
                        break
                if ascii:
                    key = _upper_key(p + i, colon - i)
            if key is not None:
                value_start = colon + 1
                value_end = end
                while value_start < value_end and (p[value_start] == b' ' or p[value_start] == b'\t'):
                    value_start += 1
                while value_end > value_start and (p[value_end - 1] == b' ' or p[value_end - 1] == b'\t'):
                    value_end -= 1
                text = PyUnicode_DecodeLatin1(p + value_start, value_end - value_start, NULL)
                previous = environ.get(key)
                environ[key] = text if previous is None else f"{previous},{text}"
        i = line_end + 1
    environ["PATH_INFO"] = PyUnicode_DecodeLatin1(p + first_space + 1, path_end - first_space - 1, NULL)
    environ["REQUEST_METHOD"] = PyUnicode_DecodeLatin1(p, first_space, NULL)
    return environ
