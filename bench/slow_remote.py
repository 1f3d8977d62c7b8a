"""A simulated remote dependency: an HTTP server on loopback whose latency is switched while it runs.

``prazo demo slow-dependency`` runs it in its own process, so the service
under test reaches its dependencies over real sockets, as it would reach
another machine, and the remote's own work never competes for the service's
GIL. It is an asyncio server: a remote that answers in 2 s keeps hundreds
of calls open at once without a thread for each.

Every ``GET /<name>...`` is answered 200 after the current latency of
``<name>`` (the first path segment; unknown names answer at once), with a
small JSON body. Keep-alive is honoured, so a client may reuse its
connection. The latency is changed with::

    POST /_latency?name=recommendations&ms=2000

Run it with ``python -m prazo.bench.slow_remote recommendations=20 cart=5``:
it prints ``port N`` once it listens on 127.0.0.1 and serves until its
standard input closes (so it never outlives the demo that started it).
``SlowRemote`` is that process, seen from the demo.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only

__all__ = ["SlowRemote", "main"]

_CONTROL_PATH = "/_latency"
_STARTUP_TIMEOUT_S = 20.0
_HEAD_LIMIT = 64 * 1024


class _Latencies:
    def __init__(self, initial: dict[str, float]) -> None:
        self.ms = dict(initial)


def _response(status: str, body: bytes, keep_alive: bool) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    return head.encode("ascii") + body


async def _serve_connection(latencies: _Latencies, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, target, version = request_line.split(" ", 2)
            headers = {}
            for line in header_lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            if length:
                await reader.readexactly(length)
            keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
            path, _, query = target.partition("?")
            if method == "POST" and path == _CONTROL_PATH:
                params = dict(urllib.parse.parse_qsl(query))
                latencies.ms[params["name"]] = float(params["ms"])
                body = json.dumps(latencies.ms).encode()
            else:
                name = path.strip("/").split("/", 1)[0]
                delay_ms = latencies.ms.get(name, 0.0)
                if delay_ms > 0:
                    await asyncio.sleep(delay_ms / 1000)
                body = json.dumps({"name": name, "query": query, "delay_ms": delay_ms}).encode()
            writer.write(_response("200 OK", body, keep_alive))
            await writer.drain()
            if not keep_alive:
                return
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError, KeyError):
        return
    except asyncio.CancelledError:
        # The process is stopping with calls still sleeping: they end with it.
        return
    finally:
        writer.close()


async def _serve(latencies: _Latencies) -> None:
    server = await asyncio.start_server(
        lambda r, w: _serve_connection(latencies, r, w), "127.0.0.1", 0, limit=_HEAD_LIMIT, backlog=4096
    )
    port = server.sockets[0].getsockname()[1]
    print(f"port {port}", flush=True)
    loop = asyncio.get_running_loop()
    # Serve until the parent closes our standard input (or dies).
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m prazo.bench.slow_remote NAME=MS ...`` (see the module docstring)."""
    initial = {}
    for spec in sys.argv[1:] if argv is None else argv:
        name, _, ms = spec.partition("=")
        initial[name] = float(ms)
    asyncio.run(_serve(_Latencies(initial)))
    return 0


class SlowRemote:
    """The remote in its own process: ``start()``, ``url``, ``set_latency(name, ms)``, ``stop()``.

    ::

        with SlowRemote({"recommendations": 20}) as remote:
            remote.set_latency("recommendations", 2000)   # the incident starts
    """

    def __init__(self, latencies_ms: dict[str, float]) -> None:
        self._latencies = dict(latencies_ms)
        self._process: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        command = [sys.executable, "-m", __name__, *(f"{n}={ms:g}" for n, ms in self._latencies.items())]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(_STARTUP_TIMEOUT_S)
        if not line or not line[0].startswith("port "):
            self.stop()
            raise RuntimeError("the simulated remote did not start")
        self.port = int(line[0].split()[1])
        return self

    def set_latency(self, name: str, ms: float) -> int:
        """Switch the latency of ``name``; returns the ``time.monotonic_ns()`` at which it took effect."""
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("POST", f"{_CONTROL_PATH}?name={urllib.parse.quote(name)}&ms={ms:g}")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"the simulated remote refused the latency switch: {response.status}")
            return time.monotonic_ns()
        finally:
            conn.close()

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.stdin is not None:
                process.stdin.close()
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
