"""The servers ``prazo bench goodput`` compares, and starting one: the catalogue and its processes.

``SERVERS`` is the single-process comparison, in table order, with the
``<server>+<policy>`` configurations of ``POLICIES`` (not in the default
run); ``WORKER_SERVERS`` the multi-process hosts of ``--workers N`` (issue
21). Each is a ``ServerSpec``: its label, the ``Process`` command lines that
start it serving one of ``APPS``, and why it cannot run here (an optional
package or the haproxy binary missing). Adding a server to the comparison is
one ``ServerSpec`` in ``SERVERS``. ``started(spec, app, settings)`` runs one
on a free loopback port, waits until it answers (30 s, or
``startup_timeout_s``: a server under valgrind takes longer), and kills it
after.
"""

from __future__ import annotations

import http.client
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from prazo.bench.goodput_apps import ENV_STATS_DIR
from prazo.bench.goodput_settings import GoodputSettings

__all__ = [
    "APPS",
    "POLICIES",
    "POLICY_TITLES",
    "SERVERS",
    "WORKER_SERVERS",
    "Process",
    "ServerSpec",
    "Target",
    "missing_module",
    "package_version",
    "policy_environment",
    "servers_for",
    "started",
]

# The apps a server is started with, by the name the command line gives them.
APPS = {"cpu": "prazo.bench.goodput_apps:cpu", "io": "prazo.bench.goodput_apps:io"}
# How long a server may take to answer its first /ping (unless its caller says otherwise).
_STARTUP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Process:
    """One process of a server setup: its command line and extra environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server of the comparison.

    ``processes(app, port, settings, workdir)`` returns the processes to start,
    in order; the last one must answer HTTP on ``port``. ``unavailable()``
    says why it cannot run here (None when it can).
    """

    name: str
    label: Callable[[], str]
    processes: Callable[[str, int, GoodputSettings, Path], list[Process]]
    unavailable: Callable[[], str | None]
    default: bool = True


def package_version(package: str) -> str:
    """The installed version of ``package``, or ``?``."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def missing_module(name: str, install: str) -> Callable[[], str | None]:
    """A check that says why module ``name`` cannot run (not installed: ``install`` it), or None."""
    return lambda: None if importlib.util.find_spec(name) is not None else f"{name} is not installed ({install})"


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _stock_waitress(app: str, port: int, s: GoodputSettings) -> Process:
    return Process(_python("-m", "waitress", f"--listen=127.0.0.1:{port}", f"--threads={s.threads}", app))


def _prazo_serve(server: str, policy: str = "") -> Callable[[str, int, GoodputSettings, Path], list[Process]]:
    def processes(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
        argv = _python(
            "-m", "prazo.bindings.servers.serve", app, "--server", server, "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(s.threads), "--max-queue", str(s.max_queue),
            "--shutdown-timeout", "1", *POLICIES.get(policy, ()),
            # The front door's own --workers: one host-wide line of max_queue.
            *(() if s.workers is None else ("--workers", str(s.workers))),
        )  # fmt: skip
        return [Process(argv)]

    return processes


def _gunicorn_process(worker: str, app: str, port: int, s: GoodputSettings, policy: str = "") -> Process:
    argv = _python(
        "-m", "gunicorn", "-k", worker, "--threads", str(s.threads), "--workers", str(s.processes),
        "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "1", "--no-control-socket",
        "--log-level", "warning", app,
    )  # fmt: skip
    # PRAZO_MAX_QUEUE is each worker process's line (stock gthread ignores it).
    return Process(argv, {"PRAZO_MAX_QUEUE": str(s.queue_per_process), **policy_environment(policy)})


def _gunicorn(worker: str, policy: str = "") -> Callable[[str, int, GoodputSettings, Path], list[Process]]:
    return lambda app, port, s, workdir: [_gunicorn_process(worker, app, port, s, policy)]


def _stock_gunicorn(app: str, port: int, s: GoodputSettings) -> Process:
    return _gunicorn_process("gthread", app, port, s)


# The queue policies of issue 11 as `prazo serve` options, one configuration
# each, measured beside the plain fixed FIFO queue: `<server>+<policy>`.
POLICIES: dict[str, tuple[str, ...]] = {
    # Doomed-work skip: answer 504 at once a request whose remaining budget is
    # under the live p90 of this queue's service times.
    "doomed": ("--expected-service-ms", "p90"),
    # Adaptive LIFO + CoDel (Fail at Scale), at the contract's defaults
    # (target 5 ms, interval 100 ms).
    "adaptive": ("--order", "adaptive"),
    # The Vegas adaptive concurrency limit, between 1 and --threads.
    "vegas": ("--limit", "vegas", "--min-concurrency", "1"),
    # The pick, from the preliminary pass (NOTES-bench-policies.md): adaptive
    # LIFO is what holds goodput and p99 on mixed budgets and through a drop;
    # a CoDel target near the service time (50 ms, not 5) sheds less at 1x;
    # the doomed skip costs nothing and stops starting dead work. Not Vegas:
    # it read the app's 3x slowdown as queueing and cut the limit, 13 % goodput in the drop.
    "best": ("--order", "adaptive", "--codel-target-ms", "50", "--expected-service-ms", "p90"),
}
POLICY_TITLES = {
    "doomed": "doomed-work skip, learned p90",
    "adaptive": "adaptive LIFO + CoDel",
    "vegas": "Vegas adaptive limit",
    "best": "adaptive LIFO + CoDel (target 50 ms) + doomed-work skip (p90)",
}


def policy_environment(policy: str) -> dict[str, str]:
    """``POLICIES[policy]`` as the ``PRAZO_*`` environment variables (for servers started without ``prazo serve``)."""
    options = POLICIES.get(policy, ())
    return {
        "PRAZO_" + flag.removeprefix("--").replace("-", "_").upper(): value
        for flag, value in zip(options[::2], options[1::2])
    }


def _both(*checks: Callable[[], str | None]) -> Callable[[], str | None]:
    return lambda: next((why for why in (check() for check in checks) if why is not None), None)


def _granian(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
    argv = _python(
        "-m", "granian", "--interface", "wsgi", "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(s.processes), "--blocking-threads", str(s.threads),
        # Per worker process: the host's max_queue shared out.
        "--backpressure", str(s.queue_per_process), "--log-level", "warning", app,
    )  # fmt: skip
    return [Process(argv)]


def _haproxy(
    queue_timeout_ms: int, backend: Callable[[str, int, GoodputSettings], Process] = _stock_waitress
) -> Callable[[str, int, GoodputSettings, Path], list[Process]]:
    def processes(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
        backend_port = _free_port()
        config = workdir / "haproxy.cfg"
        # The tuned setup of issue 10: at most one request per worker thread
        # of the backend (every process's), the rest wait in HAProxy's queue
        # for at most the timeout and are answered 503 after it. One thread:
        # it shares 2 CPUs with the app and the load generator.
        config.write_text(
            "global\n    maxconn 8000\n    nbthread 1\n"
            "defaults\n    mode http\n    timeout connect 1s\n    timeout client 10s\n    timeout server 10s\n"
            f"    timeout queue {queue_timeout_ms}ms\n"
            f"frontend front\n    bind 127.0.0.1:{port}\n    default_backend app\n"
            f"backend app\n    server backend 127.0.0.1:{backend_port} maxconn {s.threads * s.processes}\n"
        )
        return [backend(app, backend_port, s), Process(["haproxy", "-db", "-f", str(config)])]

    return processes


def _no_haproxy() -> str | None:
    return None if shutil.which("haproxy") else "haproxy is not installed (apt-get install haproxy)"


def _available() -> str | None:
    # The front door (its queue policies, --workers, reuse_port) is built with prazo: nothing to install.
    return None


def _haproxy_label(queue_timeout: str, maxconn: str = "4", backend: str = "waitress") -> Callable[[], str]:
    def label() -> str:
        version = subprocess.run(["haproxy", "-v"], capture_output=True, text=True, check=False).stdout.split()
        return (
            f"HAProxy {version[2] if len(version) > 2 else '?'} (maxconn {maxconn}, timeout queue {queue_timeout}) "
            f"+ {backend}"
        )

    return label


_waitress_ok = missing_module("waitress", "pip install 'prazo[servers]'")
_gunicorn_ok = missing_module("gunicorn", "pip install 'prazo[servers]'")
_granian_ok = missing_module("granian", "pip install granian")
_PRAZO_WORKER = "prazo.bindings.servers.gunicorn.AdmissionWorker"


def _policy_specs() -> list[ServerSpec]:
    """``<server>+<policy>`` for each prazo server and each of ``POLICIES`` (not in the default run)."""
    bases: list[tuple[str, str, Callable[[str], Callable[[str, int, GoodputSettings, Path], list[Process]]], Any]] = [
        ("prazo-waitress", "prazo waitress embedding", lambda p: _prazo_serve("waitress", p), _waitress_ok),
        ("prazo-gunicorn", "prazo gunicorn AdmissionWorker", lambda p: _gunicorn(_PRAZO_WORKER, p), _gunicorn_ok),
        ("frontdoor", "prazo front door", lambda p: _prazo_serve("prazo", p), _available),
    ]
    return [
        ServerSpec(
            f"{base}+{policy}",
            _fixed(f"{title} + {POLICY_TITLES[policy]}"),
            processes(policy),
            installed,
            default=False,
        )
        for base, title, processes, installed in bases
        for policy in POLICIES
    ]


def _fixed(text: str) -> Callable[[], str]:
    return lambda: text


# The comparison, in table order. Adding a server is one entry here.
SERVERS: dict[str, ServerSpec] = {
    spec.name: spec
    for spec in (
        ServerSpec(
            "waitress",
            lambda: f"stock waitress {package_version('waitress')}",
            lambda app, port, s, workdir: [_stock_waitress(app, port, s)],
            _waitress_ok,
        ),
        ServerSpec("prazo-waitress", lambda: "prazo waitress embedding", _prazo_serve("waitress"), _waitress_ok),
        ServerSpec(
            "gunicorn",
            lambda: f"stock gunicorn {package_version('gunicorn')} gthread",
            _gunicorn("gthread"),
            _gunicorn_ok,
        ),
        ServerSpec(
            "prazo-gunicorn",
            lambda: "prazo gunicorn AdmissionWorker",
            _gunicorn(_PRAZO_WORKER),
            _gunicorn_ok,
        ),
        ServerSpec("frontdoor", lambda: "prazo front door", _prazo_serve("prazo"), _available),
        ServerSpec(
            "granian",
            lambda: f"granian {package_version('granian')} (--backpressure 20)",
            _granian,
            _granian_ok,
        ),
        ServerSpec("haproxy", _haproxy_label("200ms"), _haproxy(200), _no_haproxy),
        ServerSpec("haproxy-1s", _haproxy_label("1s"), _haproxy(1000), _no_haproxy, default=False),
        *_policy_specs(),
    )
}


def _reuseport_frontdoors(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
    argv = _python(
        "-m", "prazo.bench.reuseport_frontdoors", app, "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(s.processes), "--threads", str(s.threads), "--max-queue", str(s.queue_per_process),
    )  # fmt: skip
    return [Process(argv)]


# `--workers N` (issue 21): every server N processes, in table order. Their
# labels say N; the report's first line says what N was.
WORKER_SERVERS: dict[str, ServerSpec] = {
    spec.name: spec
    for spec in (
        ServerSpec(
            "frontdoor",
            _fixed("prazo front door --workers N (one C triage process, one host-wide line of max_queue)"),
            _prazo_serve("prazo"),
            _available,
        ),
        ServerSpec(
            "gunicorn",
            lambda: f"stock gunicorn {package_version('gunicorn')} gthread -w N",
            _gunicorn("gthread"),
            _gunicorn_ok,
        ),
        ServerSpec(
            "prazo-gunicorn",
            _fixed("prazo gunicorn AdmissionWorker -w N (a line of max_queue/N each)"),
            _gunicorn(_PRAZO_WORKER),
            _gunicorn_ok,
        ),
        ServerSpec(
            "granian",
            lambda: f"granian {package_version('granian')} --workers N (--backpressure max_queue/N each)",
            _granian,
            _granian_ok,
        ),
        ServerSpec(
            "haproxy",
            _haproxy_label("200ms", "N x threads", "stock gunicorn gthread -w N"),
            _haproxy(200, _stock_gunicorn),
            _both(_no_haproxy, _gunicorn_ok),
        ),
        ServerSpec(
            "frontdoor-reuseport",
            _fixed("N front doors on one SO_REUSEPORT port, a line of max_queue/N each (issue 21's prototype B)"),
            _reuseport_frontdoors,
            _available,
        ),
    )
}


def servers_for(workers: int | None) -> dict[str, ServerSpec]:
    """The comparison a run chooses its servers from: ``SERVERS`` without ``--workers``, else ``WORKER_SERVERS``."""
    return SERVERS if workers is None else WORKER_SERVERS


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _ping(host: str, port: int) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=2)
    try:
        connection.request("GET", "/ping", headers={"X-Request-Budget-Ms": "5000"})
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


@dataclass
class Target:
    """A server to measure: where it answers, and the directory its app counts in (None: not known)."""

    host: str
    port: int
    stats_dir: str | None


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    # Each server runs in its own process group (gunicorn's and granian's
    # workers with it), so one signal reaches them all. Killed, not stopped
    # gracefully: the point is measured, and a stock server would otherwise
    # work off its backlog of dead requests first.
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


@contextmanager
def started(
    spec: ServerSpec, app: str, settings: GoodputSettings, startup_timeout_s: float = _STARTUP_TIMEOUT_S
) -> Iterator[Target]:
    """``spec`` serving ``app`` on a free loopback port, with a fresh stats directory; stopped after.

    It must answer within ``startup_timeout_s`` of being started.
    """
    with tempfile.TemporaryDirectory(prefix="prazo-goodput-") as directory:
        workdir = Path(directory)
        stats_dir = workdir / "stats"
        stats_dir.mkdir()
        port = _free_port()
        running: list[subprocess.Popen[bytes]] = []
        try:
            # ``app`` names one of APPS, or is itself a module:callable path.
            for index, process in enumerate(spec.processes(APPS.get(app, app), port, settings, workdir)):
                log = open(workdir / f"server-{index}.log", "wb")  # noqa: SIM115 - closed with the process
                env = {**os.environ, **process.env, ENV_STATS_DIR: str(stats_dir)}
                running.append(
                    subprocess.Popen(
                        process.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
                log.close()
            end = time.monotonic() + startup_timeout_s
            while not _ping("127.0.0.1", port):
                dead = [p for p in running if p.poll() is not None]
                if dead or time.monotonic() > end:
                    logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted(workdir.glob("*.log")))
                    raise RuntimeError(f"{spec.name} did not start serving {app} on port {port}:\n{logs}")
                time.sleep(0.1)
            yield Target("127.0.0.1", port, str(stats_dir))
        finally:
            _stop(running)
