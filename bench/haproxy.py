"""HAProxy in front of prazo servers, with the shipped config: a launcher and the per-request overhead.

``HAProxyProcess.start(...)`` runs ``haproxy`` on
``examples/loadbalancers/haproxy.cfg`` exactly as the README ships it, filling
its ``${PRAZO_...}`` variables from the environment, so what the tests and this
runner exercise is the copy users paste. ``python -m prazo.bench.haproxy``
times sequential keep-alive requests to one prazo waitress server, directly
and through HAProxy, and prints what HAProxy adds per request (median and
p99, loopback, one client): a figure to read, not a target.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SHIPPED_HAPROXY_CONFIG",
    "HAProxyProcess",
    "haproxy_environment",
    "main",
    "time_requests_ns",
]

#: The config the README ships (and the tests run as is).
SHIPPED_HAPROXY_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "loadbalancers" / "haproxy.cfg"

# HAProxy parses its config and binds in milliseconds; seconds mean a loaded machine, far more a broken one.
_START_TIMEOUT_S = 20.0


def haproxy_environment(bind: str, backends: Sequence[str], maxconn: int) -> dict[str, str]:
    """The ``${PRAZO_...}`` variables of the shipped config: listen address, two backends, per-server maxconn."""
    if len(backends) != 2:
        raise ValueError(f"backends must name the two servers of the shipped config, got {list(backends)!r}")
    if isinstance(maxconn, bool) or not isinstance(maxconn, int) or maxconn < 1:
        raise ValueError(f"maxconn must be an int >= 1, got {maxconn!r}")
    return {
        "PRAZO_LB_BIND": bind,
        "PRAZO_BACKEND_A": backends[0],
        "PRAZO_BACKEND_B": backends[1],
        "PRAZO_BACKEND_MAXCONN": str(maxconn),
    }


class HAProxyProcess:
    """One ``haproxy -db`` (foreground) process on the shipped config; ``stop()`` ends it."""

    def __init__(self, process: subprocess.Popen[str], port: int) -> None:
        self.process = process
        self.port = port

    @classmethod
    def start(
        cls,
        port: int,
        backends: Sequence[str],
        *,
        maxconn: int,
        binary: str = "haproxy",
        config: Path = SHIPPED_HAPROXY_CONFIG,
    ) -> HAProxyProcess:
        """Start HAProxy listening on 127.0.0.1:``port``; returns once it accepts connections."""
        env = {**os.environ, **haproxy_environment(f"127.0.0.1:{port}", backends, maxconn)}
        process = subprocess.Popen(
            [binary, "-db", "-f", str(config)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        end = time.monotonic() + _START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"haproxy exited with {process.returncode}: {process.communicate()[1]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                return cls(process, port)
            except OSError:
                if time.monotonic() > end:
                    process.kill()
                    raise RuntimeError(f"haproxy did not listen on port {port}: {process.communicate()[1]}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(_START_TIMEOUT_S)
        if self.process.stderr is not None:
            self.process.stderr.close()


def time_requests_ns(port: int, path: str, count: int) -> list[int]:
    """Nanoseconds of each of ``count`` sequential GETs on one keep-alive connection (each must be 200)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
    times = []
    try:
        for _ in range(count):
            start = time.perf_counter_ns()
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            times.append(time.perf_counter_ns() - start)
            if response.status != 200:
                raise RuntimeError(f"GET {path} on port {port} answered {response.status}")
    finally:
        conn.close()
    return times


def _hello(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
    return [b"ok"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _quantile_us(times_ns: list[int], q: float) -> float:
    ordered = sorted(times_ns)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000


def main(argv: Sequence[str] | None = None) -> int:
    """Print the median/p99 of direct vs through-HAProxy requests and the difference."""
    parser = argparse.ArgumentParser(prog="python -m prazo.bench.haproxy", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per path (default 3000)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best median counts")
    args = parser.parse_args(argv)
    binary = shutil.which("haproxy")
    if binary is None:
        print("haproxy is not installed (apt-get install haproxy)", file=sys.stderr)
        return 2
    import threading

    from prazo.bindings.servers import waitress as prazo_waitress

    servers = [prazo_waitress.create_server(_hello, host="127.0.0.1", port=0, threads=2, max_queue=8) for _ in "ab"]
    for server in servers:
        threading.Thread(target=server.run, daemon=True).start()
    backends = [f"127.0.0.1:{server.effective_port}" for server in servers]
    proxy = HAProxyProcess.start(_free_port(), backends, maxconn=10, binary=binary)
    try:
        time_requests_ns(servers[0].effective_port, "/", 200)  # warm both paths up
        time_requests_ns(proxy.port, "/", 200)
        direct: list[list[int]] = []
        through: list[list[int]] = []
        for _ in range(args.rounds):
            direct.append(time_requests_ns(servers[0].effective_port, "/", args.requests))
            through.append(time_requests_ns(proxy.port, "/", args.requests))
    finally:
        proxy.stop()
        for server in servers:
            prazo_waitress.shutdown(server, 5.0)
    best_direct = min(direct, key=statistics.median)
    best_through = min(through, key=statistics.median)
    version = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False).stdout.split("\n")[0]
    print(f"{version}; prazo waitress (2 threads) on loopback; {args.requests} sequential keep-alive GETs, "
          f"best of {args.rounds} rounds")  # fmt: skip
    for label, times in (("direct", best_direct), ("through HAProxy", best_through)):
        print(f"  {label:16} median {_quantile_us(times, 0.5):8.1f} µs   p99 {_quantile_us(times, 0.99):8.1f} µs")
    added_median = _quantile_us(best_through, 0.5) - _quantile_us(best_direct, 0.5)
    added_p99 = _quantile_us(best_through, 0.99) - _quantile_us(best_direct, 0.99)
    print(f"  HAProxy adds     median {added_median:8.1f} µs   p99 {added_p99:8.1f} µs per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
