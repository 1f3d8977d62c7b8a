"""Polite refusals: the 503/504/408 answers as bytes, and a close that lets the client read them.

A refused connection is answered by the server's own thread, not by the app:
``rejection_bytes`` is the complete HTTP/1.1 response of a refusal (the same
status, headers and body as the middleware's ``rejection_response``),
``HEADER_TIMEOUT_ANSWER`` the 408 for a head that never completed, and the
``LingeringCloser`` closes the connection so that a client still uploading its
body reads the answer instead of a reset.
"""

from __future__ import annotations

import socket
import ssl

from prazo.core import REASON_BAD_REQUEST, REASON_HEAD_TOO_LARGE, REASON_HEADER_TIMEOUT
from prazo.core.arguments import checked_count

from ...headers import REASON_HEADER_NAME
from ...wsgi import rejection_response
from .sockets import SocketWatcher, WatchedSocket, hard_close, send_all

__all__ = [
    "BAD_REQUEST_ANSWER",
    "DEFAULT_LINGER_S",
    "DEFAULT_MAX_DRAIN_BYTES",
    "DEFAULT_MAX_LINGERING",
    "HEADER_TIMEOUT_ANSWER",
    "HEAD_TOO_LARGE_ANSWER",
    "REASON_BAD_REQUEST",
    "REASON_HEADER_TIMEOUT",
    "REASON_HEAD_TOO_LARGE",
    "LingeringCloser",
    "rejection_bytes",
    "send_rejection_bytes",
    "status_answer",
]

# Polite close: after a refusal the write side is shut and the client's bytes
# are read and dropped for up to DEFAULT_LINGER_S or DEFAULT_MAX_DRAIN_BYTES,
# so a client still sending its body finishes and then reads the answer.
DEFAULT_LINGER_S = 2.0
DEFAULT_MAX_DRAIN_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_LINGERING = 512
_DRAIN_CHUNK = 65536


def _response_bytes(status: str, headers: list[tuple[str, str]], body: bytes, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status}"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    lines.append("Connection: keep-alive" if keep_alive else "Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def rejection_bytes(
    exc: BaseException, *, keep_alive: bool = False, retry_after_s: int = 1, retry_after_ns: int = 0
) -> bytes:
    """A complete HTTP/1.1 response refusing a request, from ``rejection_response`` (its Retry-After arguments)."""
    return _response_bytes(
        *rejection_response(exc, retry_after_s=retry_after_s, retry_after_ns=retry_after_ns), keep_alive
    )


def status_answer(status: str, reason: str, *, keep_alive: bool = False) -> bytes:
    """A complete HTTP/1.1 answer of ``status`` shaped like the refusals (text body, ``X-Prazo-Reason: reason``).

    >>> status_answer("400 Bad Request", "bad-request").split(b"\\r\\n")[0]
    b'HTTP/1.1 400 Bad Request'
    """
    body = f"{status}: {reason}\n".encode("ascii")
    headers = [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(body))),
        ("Cache-Control", "no-store"),
        (REASON_HEADER_NAME, reason),
    ]
    return _response_bytes(status, headers, body, keep_alive)


# Shaped like the 503/504 refusals, so clients and logs read the reason alike.
HEADER_TIMEOUT_ANSWER = status_answer("408 Request Timeout", REASON_HEADER_TIMEOUT)
# The front door's answers to a head it cannot take (malformed or ambiguous; too large).
BAD_REQUEST_ANSWER = status_answer("400 Bad Request", REASON_BAD_REQUEST)
HEAD_TOO_LARGE_ANSWER = status_answer("431 Request Header Fields Too Large", REASON_HEAD_TOO_LARGE)


def send_rejection_bytes(sock: socket.socket, exc: BaseException, *, keep_alive: bool = False) -> bool:
    """Write the refusal of ``exc`` on ``sock``; True when it was all sent."""
    return send_all(sock, rejection_bytes(exc, keep_alive=keep_alive))


class LingeringCloser(SocketWatcher):
    """Closes refused connections politely, from one background thread.

    Effects: ``close(sock)`` shuts the write side at once (the client sees the
    end of the response) and then reads and drops whatever the client still
    sends, until it closes its side, or ``linger_s`` seconds or
    ``max_drain_bytes`` bytes have passed; then the socket is closed. Closing
    with unread bytes would make the kernel send a reset, and a client still
    uploading its body would see ``ECONNRESET`` instead of the 503 it was
    sent. At most ``max_sockets`` linger at once; beyond that (a flood of
    refusals) sockets are closed at once.

    >>> closer = LingeringCloser(linger_s=0.5)
    >>> a, b = socket.socketpair()
    >>> closer.close(a)
    >>> b.recv(1)          # the peer sees the end of the stream
    b''
    >>> b.close(); closer.stop()
    """

    def __init__(
        self,
        *,
        linger_s: float = DEFAULT_LINGER_S,
        max_drain_bytes: int = DEFAULT_MAX_DRAIN_BYTES,
        max_sockets: int = DEFAULT_MAX_LINGERING,
        name: str = "prazo-linger",
    ) -> None:
        if isinstance(linger_s, bool) or not isinstance(linger_s, (int, float)) or not linger_s >= 0:
            raise ValueError(f"linger_s must be a number >= 0, got {linger_s!r}")
        super().__init__(name=name, max_sockets=max_sockets)
        self._linger_s = float(linger_s)
        self._max_drain = checked_count(max_drain_bytes, "max_drain_bytes", 0)

    @property
    def lingering(self) -> int:
        """Sockets currently being drained."""
        return self.watching

    def close(self, sock: socket.socket) -> None:
        """Shut the write side of ``sock`` now and close it once the client is done."""
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
        except OSError:
            hard_close(sock)
            return
        if self._linger_s == 0 or not self.watch(sock, self._linger_s, 0):
            hard_close(sock)

    def _on_readable(self, entry: WatchedSocket) -> bool:
        try:
            data = entry.sock.recv(_DRAIN_CHUNK)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return True
        except OSError:
            data = b""
        entry.data += len(data)
        if data and entry.data < self._max_drain:
            return True
        hard_close(entry.sock)
        return False
