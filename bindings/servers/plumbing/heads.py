"""The head reader: find a request's head in the bytes waiting on its socket.

The socket-level embeddings compute a request's exact deadline before the
server reads it: they look at the bytes waiting on the connection
(``waiting_bytes``: peeked at, or taken off the socket for a server that is
handed them, as gunicorn's parser is), find the complete head in them
(``find_head``) and turn it into the CGI-style keys a ``BudgetPolicy`` reads
(``request_environ``: ``head_environ``, ``head_path``, ``head_method``).

``find_head``, ``request_environ`` and ``waiting_bytes`` run in C
(``prazo.bindings.servers.plumbing._heads_c``) when it is built; the Python functions
here are their specification.
"""

from __future__ import annotations

import socket
import ssl
from types import ModuleType
from urllib.parse import unquote_to_bytes

from prazo.core import IMPLEMENTATION
from prazo.core.compiled import import_compiled

from ...headers import is_ambiguous_header_name

__all__ = [
    "MAX_HEAD_BYTES",
    "find_head",
    "find_head_py",
    "head_environ",
    "head_method",
    "head_path",
    "peek_bytes",
    "peekable",
    "request_environ",
    "request_environ_py",
    "waiting_bytes",
    "waiting_bytes_py",
]

# A request head larger than this is not peeked at; the request is admitted
# with a provisional deadline and its real one is computed once it is parsed.
MAX_HEAD_BYTES = 65536

_MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_CAN_PEEK_WITHOUT_BLOCKING = hasattr(socket, "MSG_DONTWAIT")


def find_head_py(data: bytes) -> bytes | None:
    """The request head (request line and header lines) if ``data`` holds all of it.

    Leading empty lines are skipped, as HTTP/1.1 servers must; the head ends
    at the first empty line (CRLF or bare LF).
    """
    start = 0
    while data.startswith(b"\r\n", start) or data.startswith(b"\n", start):
        start += 2 if data.startswith(b"\r\n", start) else 1
    body = data[start:]
    end = body.find(b"\n\r\n")
    bare = body.find(b"\n\n")
    if end < 0 or (0 <= bare < end):
        end = bare
    if end < 0:
        return None
    return body[: end + 1]


def head_environ(head: bytes, remote_addr: object = None) -> dict[str, str]:
    """CGI-style ``HTTP_*`` keys for the header fields of a request head.

    Only what a ``BudgetPolicy`` reads: malformed lines, obsolete line
    folding and names with an underscore (``is_ambiguous_header_name``) are
    skipped, repeated fields are joined with ``","`` as WSGI servers do, and
    ``REMOTE_ADDR`` is set when given.
    """
    environ: dict[str, str] = {}
    if isinstance(remote_addr, str):
        environ["REMOTE_ADDR"] = remote_addr
    for line in head.split(b"\n")[1:]:
        name, colon, value = line.rstrip(b"\r").partition(b":")
        if not colon or not name or name != name.strip() or b" " in name or b"\t" in name:
            continue
        text_name = name.decode("latin-1")
        if is_ambiguous_header_name(text_name):
            continue
        key = "HTTP_" + text_name.upper().replace("-", "_")
        text = value.decode("latin-1").strip(" \t")
        environ[key] = f"{environ[key]},{text}" if key in environ else text
    return environ


def _request_line(head: bytes) -> list[bytes] | None:
    parts = head.split(b"\n", 1)[0].rstrip(b"\r").split(b" ")
    return parts if len(parts) == 3 and parts[0] else None


def head_method(head: bytes) -> str | None:
    """The ``REQUEST_METHOD`` of the request of ``head``, or None when the request line is malformed."""
    parts = _request_line(head)
    return None if parts is None else parts[0].decode("latin-1")


def head_path(head: bytes) -> str | None:
    """The ``PATH_INFO`` a WSGI server gives the request of ``head``, or None when the request line is malformed.

    The target's path, without the query, percent-decoded to latin-1 as WSGI
    servers do; an absolute-form target (``http://host/path``) gives its path.
    """
    parts = _request_line(head)
    if parts is None:
        return None
    target = parts[1].split(b"?", 1)[0].split(b"#", 1)[0]
    if not target.startswith(b"/"):
        scheme, separator, rest = target.partition(b"://")
        if not separator or not scheme:
            return None
        target = b"/" + rest.partition(b"/")[2]
    return unquote_to_bytes(target).decode("latin-1")


def request_environ_py(head: bytes, remote_addr: object = None) -> dict[str, str]:
    """What a server embedding knows of a request before admitting it: ``head_environ``, ``PATH_INFO``, ``REQUEST_METHOD``.

    The last two are left out when the request line is malformed (the server
    answers it 400 once the request is admitted).
    """
    environ = head_environ(head, remote_addr)
    path = head_path(head)
    if path is not None:
        environ["PATH_INFO"] = path
    method = head_method(head)
    if method is not None:
        environ["REQUEST_METHOD"] = method
    return environ


def peekable(sock: socket.socket) -> bool:
    """True when ``peek_bytes`` can see what waits on ``sock`` (not TLS, platform support)."""
    return _CAN_PEEK_WITHOUT_BLOCKING and not isinstance(sock, ssl.SSLSocket)


def peek_bytes(sock: socket.socket, limit: int = MAX_HEAD_BYTES) -> bytes | None:
    """Up to ``limit`` bytes waiting on ``sock``, left in place; never blocks.

    Returns None when nothing has arrived yet or the socket cannot be peeked
    at (see ``peekable``), and ``b""`` when the peer has closed its side.
    """
    return waiting_bytes(sock, limit)


def waiting_bytes_py(sock: socket.socket, limit: int = MAX_HEAD_BYTES, *, take: bool = False) -> bytes | None:
    """Up to ``limit`` bytes waiting on ``sock``: left in place, or taken off it with ``take``; never blocks.

    Returns None when nothing has arrived yet or the socket cannot be looked
    at (see ``peekable``), and ``b""`` when the peer has closed its side or
    the socket failed.
    """
    if not peekable(sock):
        return None
    timeout = sock.gettimeout()
    try:
        # A socket with a timeout would first wait for data (CPython polls
        # before recv), whatever MSG_DONTWAIT says; look in non-blocking mode.
        if timeout:
            sock.settimeout(0.0)
        return sock.recv(limit, _MSG_DONTWAIT if take else socket.MSG_PEEK | _MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""
    finally:
        if timeout:
            try:
                sock.settimeout(timeout)
            except OSError:
                pass


def _import_compiled() -> ModuleType | None:
    if IMPLEMENTATION != "c":
        return None
    return import_compiled(
        "prazo.bindings.servers.plumbing._heads_c", "the compiled head reader", "request heads are read in Python"
    )


_COMPILED = _import_compiled()


def _waiting_bytes_c(sock: socket.socket, limit: int = MAX_HEAD_BYTES, *, take: bool = False) -> bytes | None:
    if not peekable(sock):
        return None
    # The compiled recv never blocks, so it keeps the GIL (see _heads_c); a
    # closed socket's fileno() is -1, which recv refuses (EBADF): b"".
    data: bytes | None = _COMPILED.recv_nowait(sock.fileno(), limit, not take)  # type: ignore[union-attr]
    return data


def _request_environ_c(head: bytes, remote_addr: object = None) -> dict[str, str]:
    environ: dict[str, str] | None = _COMPILED.request_environ(head, remote_addr)  # type: ignore[union-attr]
    return request_environ_py(head, remote_addr) if environ is None else environ


if _COMPILED is None:
    find_head = find_head_py
    request_environ = request_environ_py
    waiting_bytes = waiting_bytes_py
else:
    find_head = _COMPILED.find_head
    request_environ = _request_environ_c
    waiting_bytes = _waiting_bytes_c
