"""A quick goodput probe for the front door, until ``prazo bench goodput`` lands.

Runs a CPU-bound app (10 ms of pure-Python CPU per request, holding the GIL)
on one server in a subprocess, measures its capacity (closed loop), then
offers open-loop Poisson load from another process (clients with 1 s budgets
in ``X-Request-Budget-Ms``, a new connection per request, each client gives
up at its budget) and reports goodput, late app runs, p99 of successes and
refusals by reason::

    python -m prazo.bench.frontdoor_probe --servers prazo,waitress --loads 0.5,3

Servers: ``prazo`` (the front door), ``waitress`` (stock), ``waitress-prazo``
(the waitress embedding).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

WORK_S = 0.010
BUDGET_S = 1.0
THREADS = 4
QUEUE = 20

_runs = 0
_late = 0
_lock = threading.Lock()


def cpu_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """10 ms of CPU in Python; counts the runs that end after the client's deadline."""
    global _runs, _late
    sent = float(environ.get("HTTP_X_SENT_AT", "0") or 0)
    start = time.thread_time()
    x = 0
    while time.thread_time() - start < WORK_S:
        for i in range(200):
            x += i * i
    late = sent and time.time() > sent + BUDGET_S
    with _lock:
        _runs += 1
        _late += bool(late)
    body = b"ok\n"
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


def serve(server: str, port: int, threads: int, queue: int) -> None:
    def report(*_: object) -> None:
        print(json.dumps({"runs": _runs, "late": _late}), flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, report)
    if server == "prazo":
        from prazo.bindings.servers.frontdoor import create_server

        front = create_server(cpu_app, port=port, threads=threads, max_queue=queue)
        print("ready", flush=True)
        front.serve_forever()
    elif server == "waitress":
        import waitress

        print("ready", flush=True)
        import logging

        logging.getLogger("waitress").setLevel(logging.ERROR)
        waitress.serve(cpu_app, host="127.0.0.1", port=port, threads=threads, backlog=2048, _quiet=True)
    elif server == "waitress-prazo":
        from prazo.bindings.servers.waitress import create_server as waitress_server

        ws = waitress_server(cpu_app, host="127.0.0.1", port=port, threads=threads, max_queue=queue, backlog=2048)
        print("ready", flush=True)
        ws.run()
    else:
        raise SystemExit(f"unknown server {server}")


async def _one(port: int, budget_s: float, results: list[tuple[float, int, str]], scheduled: float) -> None:
    start = time.monotonic()
    status, reason = 0, "gave-up"
    writer = None
    try:
        async with asyncio.timeout(budget_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                + f"X-Request-Budget-Ms: {int(budget_s * 1000)}\r\nX-Sent-At: {time.time():.6f}\r\n\r\n".encode()
            )
            data = await reader.read()
        line, _, rest = data.partition(b"\r\n")
        status = int(line.split()[1]) if line else 0
        reason = ""
        for header in rest.split(b"\r\n"):
            if header.lower().startswith(b"x-prazo-reason:"):
                reason = header.split(b":", 1)[1].strip().decode()
    except TimeoutError:
        pass
    except OSError as exc:
        status, reason = 0, type(exc).__name__
    finally:
        if writer is not None:
            writer.close()
    results.append((time.monotonic() - start, status, reason))


async def _open_loop(port: int, rate: float, seconds: float, budget_s: float) -> dict[str, Any]:
    results: list[tuple[float, int, str]] = []
    tasks = []
    rng = random.Random(1)
    t0 = time.monotonic()
    next_at = t0
    lag_max = 0.0
    while next_at - t0 < seconds:
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        lag_max = max(lag_max, time.monotonic() - next_at)
        tasks.append(asyncio.create_task(_one(port, budget_s, results, next_at)))
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return _summary(results, seconds, lag_max)


async def _closed_loop(port: int, clients: int, seconds: float) -> dict[str, Any]:
    results: list[tuple[float, int, str]] = []
    end = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < end:
            await _one(port, 10.0, results, time.monotonic())

    await asyncio.gather(*(client() for _ in range(clients)))
    return _summary(results, seconds, 0.0)


def _summary(results: list[tuple[float, int, str]], seconds: float, lag_max: float) -> dict[str, Any]:
    ok = sorted(latency for latency, status, _ in results if status == 200 and latency <= BUDGET_S)
    refusals: dict[str, int] = {}
    for _, status, reason in results:
        if status != 200:
            key = f"{status} {reason}".strip()
            refusals[key] = refusals.get(key, 0) + 1
    p99 = ok[min(len(ok) - 1, int(len(ok) * 0.99))] * 1000 if ok else None
    return {
        "sent": len(results),
        "good": len(ok),
        "goodput_per_s": len(ok) / seconds,
        "p99_ms": p99,
        "refusals": refusals,
        "schedule_lag_max_ms": lag_max * 1000,
    }


def load(mode: str, port: int, value: float, seconds: float) -> None:
    if mode == "open":
        result = asyncio.run(_open_loop(port, value, seconds, BUDGET_S))
    else:
        result = asyncio.run(_closed_loop(port, int(value), seconds))
    print(json.dumps(result), flush=True)


def _start_server(server: str, port: int, threads: int = THREADS) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "prazo.bench.frontdoor_probe", "serve", server, str(port), str(threads)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    process.stdout.readline()
    time.sleep(0.3)
    return process


def _stop_server(process: subprocess.Popen[str]) -> dict[str, int]:
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    for line in out.splitlines():
        if line.startswith("{"):
            return dict(json.loads(line))
    return {"runs": 0, "late": 0}


def _load(mode: str, port: int, value: float, seconds: float) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "prazo.bench.frontdoor_probe", "load", mode, str(port), str(value), str(seconds)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def run(servers: list[str], loads: list[float], seconds: float, port: int, threads: int) -> None:
    print(f"load average before: {os.getloadavg()}", flush=True)
    for server in servers:
        process = _start_server(server, port, threads)
        capacity = _load("closed", port, 16, 4.0)["goodput_per_s"]
        before = _stop_server(process)
        print(
            f"{server}: capacity {capacity:.1f}/s (closed loop, 16 clients, 4 s; app runs {before['runs']})", flush=True
        )
        for x in loads:
            process = _start_server(server, port, threads)
            result = _load("open", port, x * capacity, seconds)
            runs = _stop_server(process)
            late_pct = 100.0 * runs["late"] / runs["runs"] if runs["runs"] else 0.0
            row = {
                "server": server,
                "threads": threads,
                "offered_x": x,
                "capacity_per_s": round(capacity, 1),
                "goodput_per_s": round(result["goodput_per_s"], 1),
                "goodput_pct": round(100.0 * result["goodput_per_s"] / capacity, 1),
                "late_runs_pct": round(late_pct, 1),
                "app_runs": runs["runs"],
                "p99_ms": None if result["p99_ms"] is None else round(result["p99_ms"], 1),
                "sent": result["sent"],
                "refusals": result["refusals"],
                "schedule_lag_max_ms": round(result["schedule_lag_max_ms"], 1),
            }
            print(json.dumps(row), flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    if args and args[0] == "serve":
        serve(args[1], int(args[2]), int(args[3]) if len(args) > 3 else THREADS, QUEUE)
        return
    if args and args[0] == "load":
        load(args[1], int(args[2]), float(args[3]), float(args[4]))
        return
    parser = argparse.ArgumentParser(prog="python -m prazo.bench.frontdoor_probe")
    parser.add_argument("--servers", default="prazo,waitress")
    parser.add_argument("--loads", default="0.5,3")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--threads", type=int, default=THREADS)
    options = parser.parse_args(args)
    run(
        options.servers.split(","),
        [float(x) for x in options.loads.split(",")],
        options.seconds,
        options.port,
        options.threads,
    )


if __name__ == "__main__":
    main()
