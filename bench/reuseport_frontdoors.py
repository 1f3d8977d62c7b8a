"""Prototype B of issue 21's data plane: N independent front doors on one ``SO_REUSEPORT`` port.

::

    python -m prazo.bench.reuseport_frontdoors APP --port 8000 --workers 2 --threads 4 --max-queue 10

starts ``--workers`` processes, each importing ``APP`` and running its own
front door (``prazo.bindings.servers.frontdoor.create_server(...,
reuse_port=True)``) with ``--threads`` worker threads and its own admission
line of ``--max-queue``. The kernel spreads new connections over the
listeners by a hash of their addresses; nothing is shared, so a door whose
line is full refuses (503) while a sibling may have room. That is what the
shared-memory design of the issue would add, and why ``prazo bench goodput
--workers N`` measures this launcher beside the front door's own
``--workers`` (``frontdoor-reuseport``): its figures are the losing
prototype's, kept in ``bench/RESULTS.md``.

No door serves before every door listens (a pipe barrier): a door that
started alone would take every connection of the first requests, as the
others' listeners do not exist yet. SIGTERM or SIGINT is passed on to every
door, each shutting down gracefully; a door that dies ends the others and the
launcher (exit status 1): a benchmark must not run on fewer doors than it says.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _fixed_port(text: str) -> int:
    # Port 0 would give every door a port of its own: one shared port is the point.
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number 1-65535, got {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number 1-65535 (not 0: the doors share it), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The launcher's options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m prazo.bench.reuseport_frontdoors", description=(__doc__ or "").split("\n", 1)[0]
    )
    parser.add_argument("app", metavar="APP", help="the WSGI app, MODULE:CALLABLE")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_fixed_port, required=True, help="the one port every door listens on")
    parser.add_argument("--workers", type=_at_least_one, default=2, help="front door processes (default 2)")
    parser.add_argument("--threads", type=_at_least_one, default=4, help="worker threads per door (default 4)")
    parser.add_argument(
        "--max-queue", type=_at_least_one, default=10, help="each door's own admission line (default 10)"
    )
    parser.add_argument("--shutdown-timeout", type=float, default=1.0, help="each door's graceful shutdown, s")
    return parser


def _door(args: argparse.Namespace, ready_fd: int, go_fd: int) -> None:
    """One child: import the app, listen, report ready, wait for the go, serve until SIGTERM."""
    from prazo.bindings.servers.frontdoor import create_server
    from prazo.bindings.servers.plumbing.app_loader import load_app

    server = create_server(
        load_app(args.app), host=args.host, port=args.port, threads=args.threads, max_queue=args.max_queue,
        shutdown_timeout=args.shutdown_timeout, reuse_port=True,
    )  # fmt: skip
    # The handler only notes the signal (one may come before the go, while the
    # server is not started); a thread shuts down once it is serving: shutting
    # down from the handler itself would block the main thread that serves.
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    os.write(ready_fd, b"r")
    os.read(go_fd, 1)
    server.start()
    threading.Thread(
        target=lambda: stopping.wait() and server.shutdown(args.shutdown_timeout), name="door-stop", daemon=True
    ).start()
    server.serve_forever()


def _spawn(args: argparse.Namespace) -> list[int]:
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    children = []
    for _index in range(args.workers):
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                os.close(ready_r)
                os.close(go_w)
                _door(args, ready_w, go_r)
            except BaseException as exc:  # noqa: BLE001 - a child must never return into the parent's code
                print(f"reuseport_frontdoors: door {os.getpid()}: {exc!r}", file=sys.stderr, flush=True)
                status = 1
            os._exit(status)
        children.append(pid)
    os.close(ready_w)
    os.close(go_r)
    ready = 0
    while ready < args.workers:
        chunk = os.read(ready_r, args.workers)
        if not chunk:  # every child closed its end: one died before listening
            break
        ready += len(chunk)
    os.close(ready_r)
    if ready == args.workers:
        os.write(go_w, b"g" * args.workers)
    os.close(go_w)
    return children


def main(argv: Sequence[str] | None = None) -> int:
    """Run the doors until SIGTERM/SIGINT or until one of them exits; the exit status."""
    args = build_parser().parse_args(argv)
    children = _spawn(args)
    stopping = False

    def pass_on(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    print(
        f"reuseport_frontdoors: {args.app} on http://{args.host}:{args.port}, {args.workers} front doors "
        f"(SO_REUSEPORT), {args.threads} threads and a line of {args.max_queue} each",
        flush=True,
    )
    failed = False
    remaining = set(children)
    while remaining:
        pid, status = os.wait()
        remaining.discard(pid)
        if not stopping and remaining:
            # One door fewer is another benchmark: end the rest.
            failed = True
            pass_on(signal.SIGTERM, None)
        failed = failed or os.waitstatus_to_exitcode(status) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
