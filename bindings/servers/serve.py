"""``prazo serve``: run a WSGI app on a real server with admission at the server's own queue.

::

    prazo serve myapp:app --server waitress --threads 4 --max-queue 16 \\
        --default-budget-ms 1000 --max-budget-ms 30000 --host 0.0.0.0 --port 8000

Queue policies (``AdmissionQueue``'s, in every server): ``--order
fifo|lifo|adaptive`` (adaptive LIFO with CoDel shedding, tuned by
``--codel-target-ms`` / ``--codel-interval-ms``), ``--expected-service-ms``
(a number, or ``p50``/``p90``/``p95``/``p99`` learned live: requests with less
budget left are answered 504 at once), ``--limit fixed|vegas`` with
``--min-concurrency``, and ``--reserved N`` slots for critical requests: those
on a ``--critical-path`` (repeatable, e.g. ``/healthz``) or whose
``--critical-header`` says ``critical``.

It prints one line saying what runs where and with which limits, serves
until SIGTERM or Ctrl-C, then shuts down gracefully: new requests are refused
(503 ``shutting-down``) and every admitted request finishes, for at most
``--shutdown-timeout`` seconds. Options not given fall back to the
``PRAZO_*`` environment variables, then to the defaults (see
``prazo.bindings.servers.settings.resolve_settings``).

Servers: ``waitress`` (the default: production-grade, pure Python),
``gunicorn`` (``--workers`` processes of ``AdmissionWorker``; POSIX only),
``cheroot``, ``werkzeug`` and ``wsgiref`` (development servers), and ``prazo``
(the front door: accept, head parsing and admission in a C thread that never
waits for the GIL; Linux). ``--server prazo --workers N`` runs a host: one
triage process and N worker processes of ``--threads`` threads each, with one
admission line for the host (``prazo.bindings.servers.frontdoor.supervisor``); ``--preload``
imports the app once before forking (default: each worker imports it), and
``--max-requests N`` replaces a worker after N requests (plus a random number
of at most ``--max-requests-jitter J``). SIGHUP reloads its workers one at a
time.

For the ``prazo`` command line: ``add_serve_arguments(parser)`` declares the
options on a (sub)parser and ``run_serve(args, out)`` runs them;
``main_serve(argv)`` is the same as a standalone program, which is also
``python -m prazo.bindings.servers.serve`` (no ``prazo.bench`` needed).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any, TextIO

from prazo.core.arguments import checked_count

from ..freethreading import GIL_LOGGER
from ..wsgi import WSGIApp
from .frontdoor.server import checked_timeout
from .frontdoor.supervisor import checked_max_requests, checked_workers
from .plumbing.agent_check import AgentCheck
from .plumbing.app_loader import load_app, split_app_spec
from .plumbing.process_names import name_process
from .settings import (
    ServerSettings,
    add_setting_arguments,
    resolve_settings,
    settings_environment,
    settings_from_arguments,
)

__all__ = ["SERVERS", "add_serve_arguments", "build_serve_parser", "main_serve", "run_serve"]

SERVERS = ("waitress", "gunicorn", "cheroot", "werkzeug", "wsgiref", "prazo")
DEFAULT_SERVER = "waitress"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``prazo serve`` on ``parser`` (a subparser of the ``prazo`` command).

    The command's own (which app, which server, where, how many processes) are
    here; each server setting's flag is its row in ``settings.SETTINGS``.
    """
    parser.add_argument("app", metavar="MODULE:APP", help="the WSGI application, e.g. myproject.wsgi:application")
    parser.add_argument("--server", choices=SERVERS, default=DEFAULT_SERVER, help=f"default {DEFAULT_SERVER}")
    parser.add_argument("--host", default=DEFAULT_HOST, metavar="H", help=f"default {DEFAULT_HOST}")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="P", help=f"default {DEFAULT_PORT}")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="W",
        help="worker processes, gunicorn or prazo (default 1); prazo: --threads each, one host-wide line",
    )
    parser.add_argument(
        "--preload",
        action="store_true",
        help="prazo --workers: import the app once, before forking the workers (default: each worker imports it)",
    )
    parser.add_argument(
        "--max-requests",
        type=int,
        default=None,
        metavar="N",
        help="prazo --workers: replace a worker after it served N requests (default: never)",
    )
    parser.add_argument(
        "--max-requests-jitter",
        type=int,
        default=None,
        metavar="J",
        help="prazo --workers: add a random 0..J to each worker's --max-requests, so they are not replaced together",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help=f"seconds admitted requests get to finish on SIGTERM (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    add_setting_arguments(parser)


def build_serve_parser(prog: str = "prazo serve") -> argparse.ArgumentParser:
    """A standalone parser for ``prazo serve``."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n", 1)[0] if __doc__ else None)
    add_serve_arguments(parser)
    return parser


def _server_version(server: str) -> str:
    if server == "prazo":
        server = "prazo front door"
        try:
            return f"{server} {metadata.version('prazo')}"
        except metadata.PackageNotFoundError:
            return server
    try:
        return f"{server} {metadata.version(server)}"
    except metadata.PackageNotFoundError:
        return server  # wsgiref ships with Python


def _startup_line(args: argparse.Namespace, settings: ServerSettings, port: object) -> str:
    workers = f" x{args.workers} workers" if args.workers > 1 else ""
    return (
        f"prazo serve: {args.app} on http://{args.host}:{port} with {_server_version(args.server)}{workers} — "
        f"{settings.describe()} shutdown_timeout={args.shutdown_timeout:g}s"
    )


def _on_sigterm(action: Callable[[], object], agent: AgentCheck | None = None) -> None:
    """Run ``action`` when SIGTERM arrives (from the main thread, which owns signal handlers).

    The agent check answers ``drain`` from that moment: the balancer stops sending before the port closes.
    """

    def handler(signum: int, frame: object) -> None:
        if agent is not None:
            agent.mark_draining()
        action()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def _agent_check(
    args: argparse.Namespace,
    settings: ServerSettings,
    stats: Callable[[], Any],
    draining: Callable[[], bool] | None = None,
) -> AgentCheck | None:
    """The agent-check responder of ``--agent-port``, answering from ``stats`` (None without the option)."""
    if settings.agent_port is None:
        return None
    with _listening(args, settings.agent_port):
        return AgentCheck(stats, host=args.host, port=settings.agent_port, draining=draining).start()


def _with_agent(line: str, agent: AgentCheck | None) -> str:
    return line if agent is None else f"{line} agent-check on port {agent.port}"


def _raise_system_exit() -> None:
    raise SystemExit(0)


def _in_background(action: Callable[[], object]) -> Callable[[], None]:
    """``action`` started in a thread: stopping a server must not run in the thread serving it."""
    return lambda: threading.Thread(target=action, name="prazo-serve-stop", daemon=True).start()


class _CannotListen(Exception):
    """The address of ``--host``/``--port`` cannot be listened on: reported in one line, exit status 2."""


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: OSError) -> str:
    """What the system said, without the servers' wrapping: ``address already in use``."""
    if isinstance(exc, socket.gaierror) or exc.errno is None:
        text = exc.strerror or str(exc)
        # cheroot folds the system's error into a message of its own:
        # "No socket could be created -- (('127.0.0.1', 8000): [Errno 98] Address already in use)".
        folded = re.search(r"\[Errno (\d+)\]", text)
        if folded is not None:
            text = os.strerror(int(folded.group(1)))
    else:
        # Not exc.strerror: socket.create_server appends "(while attempting to bind on address ...)".
        text = os.strerror(exc.errno)
    return text[:1].lower() + text[1:]


@contextlib.contextmanager
def _listening(args: argparse.Namespace, port: int | None = None) -> Iterator[None]:
    """Around the step that binds a port (``--port``, or ``port``): the system's refusal becomes one line.

    Only that step: an OSError once the server runs is no fault of the address.
    """
    try:
        yield
    except OSError as exc:
        where = _address(args.host, args.port if port is None else port)
        raise _CannotListen(f"cannot listen on {where}: {_reason(exc)}") from None


def _checked_host(host: str, port: int) -> None:
    """``--host`` must name an address of this machine's: resolved here, before any server takes it.

    Each server reports a bad one its own way (waitress as "Invalid host/port
    specified." deep in a traceback), so it is looked up once, the way they do.
    """
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise _CannotListen(f"cannot listen on {_address(host, port)}: {_reason(exc)}") from None
    except UnicodeError as exc:  # a name the IDNA codec refuses (a label over 63 characters, ...)
        raise _CannotListen(f"cannot listen on {_address(host, port)}: {exc}") from None


def _serve_waitress(app: WSGIApp, args: argparse.Namespace, settings: ServerSettings, out: TextIO) -> int:
    from .waitress import create_server

    with _listening(args):
        server = create_server(app, host=args.host, port=args.port, settings=settings)
    server.task_dispatcher.shutdown_timeout = args.shutdown_timeout
    agent = _agent_check(args, settings, server.task_dispatcher.stats)
    print(_with_agent(_startup_line(args, settings, server.effective_port), agent), file=out, flush=True)
    # waitress's run() ends on SystemExit/KeyboardInterrupt by draining its
    # dispatcher: prazo's finishes every admitted request first.
    _on_sigterm(_raise_system_exit, agent)
    try:
        server.run()
    finally:
        if agent is not None:
            agent.stop()
    return 0


def _serve_socketserver(app: WSGIApp, args: argparse.Namespace, settings: ServerSettings, out: TextIO) -> int:
    if args.server == "werkzeug":
        from .werkzeug import make_server
    else:
        from .wsgiref import make_server  # type: ignore[assignment]
    with _listening(args):
        server = make_server(args.host, args.port, app, settings=settings)
    server.shutdown_timeout = args.shutdown_timeout
    agent = _agent_check(args, settings, server.stats)
    print(_with_agent(_startup_line(args, settings, server.server_address[1]), agent), file=out, flush=True)
    _on_sigterm(_in_background(server.shutdown), agent)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()  # waits until admitted requests are done
        if agent is not None:
            agent.stop()
    return 0


def _serve_cheroot(app: WSGIApp, args: argparse.Namespace, settings: ServerSettings, out: TextIO) -> int:
    from .cheroot import create_server

    server = create_server(app, (args.host, args.port), shutdown_timeout=args.shutdown_timeout, settings=settings)
    with _listening(args):
        server.prepare()
    agent = _agent_check(args, settings, server.requests.stats)
    print(_with_agent(_startup_line(args, settings, server.bind_addr[1]), agent), file=out, flush=True)
    stopped = threading.Event()

    def stop() -> None:
        server.stop()
        stopped.set()

    _on_sigterm(_in_background(stop), agent)
    try:
        server.serve()
    except KeyboardInterrupt:
        stop()
    stopped.wait()
    if agent is not None:
        agent.stop()
    return 0


def _serve_frontdoor(app: WSGIApp, args: argparse.Namespace, settings: ServerSettings, out: TextIO) -> int:
    from .frontdoor import create_server

    with _listening(args):
        server = create_server(
            app, host=args.host, port=args.port, settings=settings, shutdown_timeout=args.shutdown_timeout
        )
    agent = _agent_check(args, settings, server.stats, lambda: server.draining)
    print(_with_agent(_startup_line(args, settings, server.port), agent), file=out, flush=True)
    _on_sigterm(_in_background(lambda: server.shutdown(args.shutdown_timeout)), agent)
    try:
        server.serve_forever()
    finally:
        if agent is not None:
            agent.stop()
    return 0


def _print_log(logger: logging.Logger, stream: TextIO) -> None:
    """``logger``'s INFO lines on ``stream``: the host's lifecycle (serving, a worker replaced or reloaded, the drain), the GIL.

    A library leaves logging to its application, and Python alone prints only
    warnings; ``prazo serve`` is the application here, and an operator must see
    a reload or a retirement happen (each line names the pids), and whether a
    free-threaded interpreter still runs without the GIL once the app is loaded.
    """
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the app's own logging setup (in a worker) does not print these twice


def _serve_frontdoor_host(args: argparse.Namespace, settings: ServerSettings, out: TextIO) -> int:
    """``--server prazo --workers N``: the supervisor runs here; the app is imported in the workers (or here with --preload)."""
    from .frontdoor.supervisor import HOST_LOGGER, FrontDoorHost

    name_process("supervisor")
    _print_log(logging.getLogger(HOST_LOGGER), sys.stderr)
    app = load_app(args.app) if args.preload else None
    with _listening(args):
        host = FrontDoorHost(
            app, app_spec=None if args.preload else args.app, host=args.host, port=args.port, settings=settings,
            workers=args.workers, shutdown_timeout=args.shutdown_timeout, max_requests=args.max_requests,
            max_requests_jitter=args.max_requests_jitter or 0,
        )  # fmt: skip
    # Before the workers serve the host cannot count, and the agent answers drain: nothing is sent yet.
    agent = _agent_check(args, settings, host.stats, lambda: host.draining)
    line = _startup_line(args, settings, host.port)
    line += f" host: {args.workers * settings.threads} running places, one line"
    try:
        # Printed once every worker serves; SIGTERM and Ctrl-C drain the host, SIGHUP reloads the workers.
        host.serve_forever(serving=lambda: print(_with_agent(line, agent), file=out, flush=True))
    except RuntimeError as exc:  # a worker could not start (its app did not import): the host stopped
        return _error(exc, 1)
    finally:
        if agent is not None:
            agent.stop()
    return 0


def _serve_gunicorn(app: WSGIApp, args: argparse.Namespace, settings: ServerSettings, out: TextIO) -> int:
    from gunicorn.app.base import BaseApplication

    # The worker processes read their limits from the environment, as they do
    # when gunicorn is started by hand.
    os.environ.update(settings_environment(settings))
    # Bound here, so the startup line names the real port (also with --port 0);
    # gunicorn takes the listening socket over as fd://N.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with _listening(args):
        listener = socket.create_server((args.host, args.port), family=family, backlog=2048)
    listener.set_inheritable(True)
    port = listener.getsockname()[1]
    # gunicorn owns the descriptor from here on and closes it itself: a socket
    # object still holding it would close the number again when collected,
    # by then perhaps reused by an unrelated file (a pipe, another socket).
    listener_fd = listener.detach()
    options = {
        "bind": f"fd://{listener_fd}",
        "workers": args.workers,
        "threads": settings.threads,
        "worker_class": "prazo.bindings.servers.gunicorn.AdmissionWorker",
        "graceful_timeout": math.ceil(args.shutdown_timeout),
    }

    class PrazoGunicorn(BaseApplication):  # type: ignore[misc]
        def load_config(self) -> None:
            for name, value in options.items():
                self.cfg.set(name, value)

        def load(self) -> WSGIApp:
            return app

    print(_startup_line(args, settings, port), file=out, flush=True)
    PrazoGunicorn().run()
    return 0


_RUNNERS: dict[str, Callable[[WSGIApp, argparse.Namespace, ServerSettings, TextIO], int]] = {
    "waitress": _serve_waitress,
    "gunicorn": _serve_gunicorn,
    "cheroot": _serve_cheroot,
    "werkzeug": _serve_socketserver,
    "wsgiref": _serve_socketserver,
    "prazo": _serve_frontdoor,
}


def _check(args: argparse.Namespace) -> ServerSettings:
    """The settings the options give; ``ValueError``/``TypeError`` name the option.

    Each setting's flag is checked by its row of ``settings.SETTINGS``; what
    depends on several (--reserved < --threads, CoDel only with --order
    adaptive, --default-budget-ms <= --max-budget-ms) by ``ServerSettings``,
    whose errors name the flags too. Here: the command's own options.
    """
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    host = args.server == "prazo" and args.workers != 1
    if args.server == "prazo":
        checked_workers(args.workers, "--workers")
    else:
        checked_count(args.workers, "--workers", 1)
    if args.workers != 1 and args.server not in ("gunicorn", "prazo"):
        raise ValueError("--workers is for --server gunicorn or prazo only (the other servers run one process)")
    if args.preload and not host:
        raise ValueError("--preload is for --server prazo --workers N only")
    if (args.max_requests is not None or args.max_requests_jitter is not None) and not host:
        raise ValueError("--max-requests is for --server prazo --workers N only")
    checked_max_requests(args.max_requests, args.max_requests_jitter or 0, ("--max-requests", "--max-requests-jitter"))
    if args.agent_port is not None and args.server == "gunicorn":
        raise ValueError(
            "--agent-port is not for --server gunicorn (each worker has a line of its own; "
            "--server prazo --workers N has one for the host)"
        )
    if args.yield_when_full is False and args.server != "gunicorn":
        raise ValueError("--no-yield-when-full is for --server gunicorn only (the other servers run one process)")
    checked_timeout(args.shutdown_timeout, "--shutdown-timeout")
    settings = resolve_settings(
        **settings_from_arguments(args),
        # A front-door host has one line for all its workers: reserved places and the default queue count them all.
        host_workers=args.workers if args.server == "prazo" else None,
    )
    # Last: a name lookup may take a while, and a typo in a flag is found without one.
    _checked_host(args.host, args.port)
    return settings


def _error(exc: Exception, status: int) -> int:
    print(f"prazo serve: error: {exc}", file=sys.stderr)
    return status


def run_serve(args: argparse.Namespace, out: TextIO) -> int:
    """Serve as ``args`` (from ``add_serve_arguments``) say; the exit status (2 for bad options)."""
    try:
        settings = _check(args)
        _print_log(logging.getLogger(GIL_LOGGER), sys.stderr)
        if args.server == "prazo" and args.workers > 1:
            # Each worker imports the app itself (unless --preload): not here, before the fork.
            split_app_spec(args.app)
            return _serve_frontdoor_host(args, settings, out)
        app = load_app(args.app)
    except (TypeError, ValueError, _CannotListen) as exc:
        return _error(exc, 2)
    # Outside the first try: a ValueError raised while serving is no bad option.
    try:
        return _RUNNERS[args.server](app, args, settings, out)
    except _CannotListen as exc:
        return _error(exc, 2)


def main_serve(argv: list[str] | None = None) -> int:
    """``prazo serve`` as a standalone program; returns the exit status."""
    return run_serve(build_serve_parser().parse_args(argv), sys.stdout)


if __name__ == "__main__":
    sys.exit(main_serve())
