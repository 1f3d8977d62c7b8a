"""The triage process of a front-door host: the engine in its triage role, and the supervisor's and workers' questions.

The C engine accepts, parses and admits every connection of the host (one
line for all its workers) and hands each admitted request to a worker's
channel. This process's Python only answers: the supervisor's control
requests (``add`` a worker's channels, ``retire``, ``gone``, ``stats``,
``drain``) and each worker's ``stats``/``count`` messages (``protocol.py``).
"""

from __future__ import annotations

import faulthandler
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any

from ..plumbing.process_names import name_process
from .observer import EngineObserver
from .protocol import Plan, receive_message, send_message
from .server import compiled_engine

__all__ = ["DUMP_STACKS_SIGNAL", "triage_main"]

DUMP_STACKS_SIGNAL = signal.SIGUSR1

# While it drains, the triage looks this often for the workers' questions (and each
# question waits at most this long for its answer).
_DRAIN_POLL_S = 0.02
# Observe-only: how often the loop hands the engine's notes to the shadow line at the latest.
_OBSERVE_TAKE_S = 0.1


def triage_main(plan: Plan, listener_fd: int, ctl: socket.socket) -> int:
    name_process("triage")
    # Before the supervisor kills a triage that stopped answering it, it asks for every
    # thread's stack on stderr: where it was stuck is the one thing worth keeping of it.
    # (No app runs here, so no handler of an app's is replaced.)
    # Descriptor 2, the process's own stderr (sys.stderr may be something else's by now).
    faulthandler.register(DUMP_STACKS_SIGNAL, file=2, all_threads=True)
    engine = compiled_engine().Engine([listener_fd], role="triage", **plan.triage_engine)
    engine.start()
    selector = selectors.DefaultSelector()
    selector.register(ctl, selectors.EVENT_READ, None)
    counts: dict[int, dict[str, int]] = {}
    # Observe-only: the host's shadow line, fed with the engine's notes on every turn of the loop.
    observer = None if plan.observed is None else EngineObserver(engine, plan.observed, plan.max_concurrency)

    def host_stats() -> dict[str, Any]:
        stats: dict[str, Any] = engine.stats()
        if observer is not None:
            stats.update(observer.decisions(), observe_only=1)
        stats["cancelled"] = stats["shutting_down"]
        stats["expired"] = stats["expired_on_arrival"] + stats["expired_in_queue"]
        stats["reserved"] = plan.reserved
        stats["max_concurrency"] = plan.max_concurrency
        stats["max_queue"] = plan.max_queue
        stats["expired_at_start"] = sum(c.get("expired_at_start", 0) for c in counts.values())
        stats["app_errors"] = sum(c.get("app_errors", 0) for c in counts.values())
        stats["worker_in_flight"] = engine.worker_loads()
        return stats

    def from_worker(sock: socket.socket, worker: int) -> None:
        """One message on a worker's stats socket."""
        message, _ = receive_message(sock)
        if message is None:  # the worker exited; the supervisor tells the engine ("gone")
            selector.unregister(sock)
            sock.close()
            return
        op = message.get("op")
        if op == "stats":
            try:
                send_message(sock, {"stats": host_stats()})
            except OSError:
                pass
        elif op == "count":
            counts[worker] = {k: int(v) for k, v in message.items() if k != "op"}

    def drain(timeout: float) -> bool:
        engine.drain()
        # The workers' questions are answered while they finish: a request admitted before the
        # drain may ask for the host's figures (a metrics scrape), and the drain waits for it.
        end = time.monotonic() + timeout
        while not (idle := bool(engine.wait_idle(min(max(end - time.monotonic(), 0.0), _DRAIN_POLL_S)))):
            if time.monotonic() >= end:
                break
            for key, _ in selector.select(0):
                if key.data is not None:
                    from_worker(key.fileobj, key.data)  # type: ignore[arg-type]
        engine.stop()
        return idle

    failed_adds = [0]

    def add_worker(worker: int, fds: list[int]) -> dict[str, Any]:
        """A new worker's channels and stats socket, or an error when they did not all arrive."""
        expected = plan.threads + 1
        if len(fds) != expected:
            # The kernel drops what a process at its descriptor limit cannot take (slow heads
            # can hold every descriptor until their timeout). A worker with a thread missing
            # would never be whole: what came is closed, and the supervisor tries again later.
            for fd in fds:
                os.close(fd)
            failed_adds[0] += 1
            why = (
                f"the triage (pid {os.getpid()}) did not receive worker {worker}'s descriptors "
                f"({len(fds)} of {expected} arrived; at its descriptor limit?)"
            )
            print(f"prazo host: {why}; {failed_adds[0]} worker start(s) failed so far", file=sys.stderr, flush=True)
            return {"error": why}
        *channels, stats_fd = fds
        for fd in channels:
            engine.add_channel(fd, worker)
        selector.register(socket.socket(fileno=stats_fd), selectors.EVENT_READ, worker)
        return {"ok": True}

    def answer(reply: dict[str, Any]) -> bool:
        try:
            send_message(ctl, reply)
        except OSError:
            return False  # the supervisor is gone
        return True

    while True:
        ready = selector.select(None if observer is None else _OBSERVE_TAKE_S)
        if observer is not None:
            observer.take()
        for key, _ in ready:
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            if key.data is not None:
                from_worker(sock, key.data)
                continue
            message, fds = receive_message(sock)  # the supervisor
            request: dict[str, Any] = message or {}
            op = request.get("op")
            if op == "add":
                reply: dict[str, Any] = add_worker(int(request["worker"]), fds)
            elif op == "retire":
                engine.retire_worker(int(request["worker"]))
                reply = {"ok": True}
            elif op == "gone":
                engine.worker_gone(int(request["worker"]))
                reply = {"ok": True}
            elif op == "stats":
                reply = {"stats": host_stats()}
            elif op == "drain":
                idle = drain(float(request.get("timeout", plan.shutdown_timeout)))
                answer({"idle": idle})
                return 0
            else:
                reply = {"error": f"unknown op {op!r}"}
            if message is None or not answer(reply):
                # The supervisor died: drain on our own (the workers end when their channels close) and leave.
                drain(plan.shutdown_timeout)
                return 0
