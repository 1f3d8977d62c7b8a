"""Load balancers in front of prazo servers, with the shipped configs: launchers and the per-request overhead.

``HAProxyProcess.start(..., config=...)`` runs ``haproxy`` on the shipped
``haproxy.cfg`` (``examples/loadbalancers/`` in a checkout) exactly as the
docs include it, filling its ``${PRAZO_...}`` variables from the environment;
``NginxProcess.start(..., config=...)`` runs ``nginx`` on the shipped
``nginx.conf`` with only its example addresses (and pid file) replaced, since
nginx has no variables in its config. So what the tests and this runner
exercise is the copy users paste; the caller names it, as the configs are not
part of the package. ``python -m prazo.bench.loadbalancers`` (from a
checkout, or with ``--configs DIR``) times sequential keep-alive requests to
one prazo waitress server, directly and through each balancer installed, and
prints what the balancer adds per request (median and p99, loopback, one
client): a figure to read, not a target.
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
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "NGINX_EXAMPLE_ADDRESSES",
    "HAProxyProcess",
    "LoadBalancerProcess",
    "NginxProcess",
    "haproxy_environment",
    "main",
    "nginx_config_for",
    "time_requests_ns",
]

#: The example addresses of nginx.conf: its listener, the two backends, and its pid file.
NGINX_EXAMPLE_ADDRESSES = ("listen 127.0.0.1:8080;", "server 10.0.0.11:8000", "server 10.0.0.12:8000")
_NGINX_EXAMPLE_PID = "pid /tmp/prazo-nginx.pid;"

# A balancer parses its config and binds in milliseconds; seconds mean a loaded machine, far more a broken one.
_START_TIMEOUT_S = 20.0


def haproxy_environment(bind: str, backends: Sequence[str], maxconn: int) -> dict[str, str]:
    """The ``${PRAZO_...}`` variables of the shipped config: listen address, two backends, per-server maxconn."""
    _check_backends(backends)
    if isinstance(maxconn, bool) or not isinstance(maxconn, int) or maxconn < 1:
        raise ValueError(f"maxconn must be an int >= 1, got {maxconn!r}")
    return {
        "PRAZO_LB_BIND": bind,
        "PRAZO_BACKEND_A": backends[0],
        "PRAZO_BACKEND_B": backends[1],
        "PRAZO_BACKEND_MAXCONN": str(maxconn),
    }


def _check_backends(backends: Sequence[str]) -> None:
    if len(backends) != 2 or not all(isinstance(backend, str) for backend in backends):
        raise ValueError(f"backends must name the two servers of the shipped config, got {list(backends)!r}")


def nginx_config_for(port: int, backends: Sequence[str], workdir: Path, config: Path) -> Path:
    """The shipped nginx.conf listening on 127.0.0.1:``port`` in front of ``backends``, written into ``workdir``."""
    _check_backends(backends)
    text = config.read_text()
    replacements = zip(
        (*NGINX_EXAMPLE_ADDRESSES, _NGINX_EXAMPLE_PID),
        (f"listen 127.0.0.1:{port};", f"server {backends[0]}", f"server {backends[1]}", f"pid {workdir}/nginx.pid;"),
    )
    for example, actual in replacements:
        if text.count(example) != 1:
            raise ValueError(f"{config} must contain {example!r} exactly once (the example the tests replace)")
        text = text.replace(example, actual)
    rendered = workdir / "nginx.conf"
    rendered.write_text(text)
    return rendered


class LoadBalancerProcess:
    """One balancer process in the foreground; ``stop()`` ends it."""

    name = "load balancer"

    def __init__(self, process: subprocess.Popen[str], port: int) -> None:
        self.process = process
        self.port = port

    @classmethod
    def _launch(cls, argv: Sequence[str], port: int, env: dict[str, str] | None = None) -> Any:
        process = subprocess.Popen(list(argv), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        end = time.monotonic() + _START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{cls.name} exited with {process.returncode}: {process.communicate()[1]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                return cls(process, port)
            except OSError:
                if time.monotonic() > end:
                    process.kill()
                    raise RuntimeError(
                        f"{cls.name} did not listen on port {port}: {process.communicate()[1]}"
                    ) from None
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


class HAProxyProcess(LoadBalancerProcess):
    """``haproxy -db`` on the shipped haproxy.cfg."""

    name = "haproxy"

    @classmethod
    def start(
        cls,
        port: int,
        backends: Sequence[str],
        *,
        maxconn: int,
        config: Path,
        binary: str = "haproxy",
    ) -> HAProxyProcess:
        """Start HAProxy listening on 127.0.0.1:``port``; returns once it accepts connections."""
        env = {**os.environ, **haproxy_environment(f"127.0.0.1:{port}", backends, maxconn)}
        process: HAProxyProcess = cls._launch([binary, "-db", "-f", str(config)], port, env)
        return process


class NginxProcess(LoadBalancerProcess):
    """``nginx -g 'daemon off;'`` on the shipped nginx.conf with its addresses replaced (``nginx_config_for``)."""

    name = "nginx"

    @classmethod
    def start(
        cls, port: int, backends: Sequence[str], workdir: Path, *, config: Path, binary: str = "nginx"
    ) -> NginxProcess:
        """Start nginx on the shipped ``config``, listening on 127.0.0.1:``port``; returns once it accepts connections."""
        filled = nginx_config_for(port, backends, workdir, config)
        argv = [binary, "-p", str(workdir), "-e", "stderr", "-c", str(filled), "-g", "daemon off;"]
        process: NginxProcess = cls._launch(argv, port)
        return process


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


def _start_balancer(kind: str, backends: Sequence[str], workdir: Path, configs: Path) -> LoadBalancerProcess:
    if kind == "haproxy":
        return HAProxyProcess.start(_free_port(), backends, maxconn=10, config=configs / "haproxy.cfg")
    return NginxProcess.start(_free_port(), backends, workdir, config=configs / "nginx.conf")


def _version(binary: str) -> str:
    run = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    # "HAProxy version 2.6.12-1+deb12u4 2026/10/17 - https://..." / "nginx version: nginx/1.22.1"
    return " ".join((run.stdout or run.stderr).split()[:3])


def main(argv: Sequence[str] | None = None) -> int:
    """Print the median/p99 of direct vs through-balancer requests and the difference."""
    parser = argparse.ArgumentParser(prog="python -m prazo.bench.loadbalancers", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per path and round (default 3000)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best median counts (default 3)")
    parser.add_argument(
        "--configs",
        type=Path,
        default=Path("examples/loadbalancers"),
        metavar="DIR",
        help="the shipped haproxy.cfg and nginx.conf (default examples/loadbalancers, from a checkout's root)",
    )
    args = parser.parse_args(argv)
    kinds = [kind for kind in ("haproxy", "nginx") if shutil.which(kind)]
    if not kinds:
        print("neither haproxy nor nginx is installed (apt-get install haproxy nginx-light)", file=sys.stderr)
        return 2
    import threading

    from prazo.bindings.servers import waitress as prazo_waitress

    servers = [prazo_waitress.create_server(_hello, host="127.0.0.1", port=0, threads=2, max_queue=8) for _ in "ab"]
    for server in servers:
        threading.Thread(target=server.run, daemon=True).start()
    backends = [f"127.0.0.1:{server.effective_port}" for server in servers]
    direct_port = servers[0].effective_port
    times: dict[str, list[list[int]]] = {"direct": [], **{kind: [] for kind in kinds}}
    with tempfile.TemporaryDirectory(prefix="prazo-lb-bench-") as workdir:
        balancers = {kind: _start_balancer(kind, backends, Path(workdir), args.configs) for kind in kinds}
        try:
            ports = {"direct": direct_port, **{kind: balancer.port for kind, balancer in balancers.items()}}
            for port in ports.values():
                time_requests_ns(port, "/", 200)  # warm every path up
            for _ in range(args.rounds):
                for label, port in ports.items():
                    times[label].append(time_requests_ns(port, "/", args.requests))
        finally:
            for balancer in balancers.values():
                balancer.stop()
            for server in servers:
                prazo_waitress.shutdown(server, 5.0)
    best = {label: min(rounds, key=statistics.median) for label, rounds in times.items()}
    print(f"prazo waitress (2 threads) on loopback; {args.requests} sequential keep-alive GETs per round, "
          f"best median of {args.rounds} rounds")  # fmt: skip
    for label, samples in best.items():
        name = label if label == "direct" else _version(label)
        line = f"  {name:34} median {_quantile_us(samples, 0.5):8.1f} µs   p99 {_quantile_us(samples, 0.99):8.1f} µs"
        if label != "direct":
            added = _quantile_us(samples, 0.5) - _quantile_us(best["direct"], 0.5)
            line += f"   adds {added:+.1f} µs (median)"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
