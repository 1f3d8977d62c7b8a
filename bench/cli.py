"""The measuring half of the ``prazo`` command: ``prazo demo`` and ``prazo bench``.

::

    prazo demo [flags]         the default demo: the seed's A -> B cascade over real HTTP
    prazo demo http [flags]    the same, by name
    prazo demo core [flags]    the seed scenario on the admission queue, real threads
    prazo demo slow-dependency [--quick] [--json] [--plot FILE.png]
    prazo demo retries [--quick] [--json] [--plot FILE.png] [--rate N] [--seed N]
                               the second seed's incident: a dependency slows down, without and with prazo
    prazo bench [--quick]      the default benchmarks: core, wsgi and pool, one after another
    prazo bench core [flags]   core micro-benchmarks as a table of ratios and targets
    prazo bench wsgi [flags]   the WSGI middleware's cost per request against a semaphore limiter
    prazo bench pool [flags]   AdmissionPool throughput against ThreadPoolExecutor
    prazo bench servers [...]  each server embedding at 2x capacity, stock vs prazo
    prazo bench goodput [...]  goodput under open-loop overload, CPU- and I/O-bound apps, every server
    prazo bench throughput [...]  answers/s of a hello-world app, every server on one CPU, stock vs prazo
    prazo bench instructions [...]  instructions per request of each server under callgrind, whatever the CPU
    prazo bench soak [--minutes N] [--loads ...]  mixed load with faults at 1.5x capacity; checks every queue at rest
    prazo bench parallel [...]  CPU-bound tasks, 1 worker vs N: what a free-threaded CPython gains

``--impl c|py`` (before or after the command) forces one twin of the
admission queue; without it the demo uses whichever ``prazo.core`` picked and
the benchmark compares both.

The command itself (``main``, ``prazo serve``, ``--version``) is
``prazo.bindings.cli``, what a service installs; it imports this module only
when the command line asks for a demo, a benchmark or the whole help, so
``prazo serve`` never loads the measuring code.

Adding to the command: a new topic of ``demo`` or ``bench`` is added to the
sub-command set ``_add_demo``/``_add_bench`` return. Every handler has the
signature ``handler(args, out) -> exit status``. ``prazo demo`` and ``prazo
bench`` without a topic run ``DEFAULT_DEMO`` / ``DEFAULT_BENCH``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from prazo.bench.core import render_core_report, run_core_bench
from prazo.bench.demo_core import MAX_ARRIVALS, SeedParams, render_seed_result, run_seed_scenario
from prazo.bench.harness import QUICK, BenchSettings, Paint, integer_argument, plain
from prazo.bindings.command import CommandError, Commands, Handler, impl_options
from prazo.core import IMPLEMENTATION, TWINS, AdmissionQueue, load_twin

__all__ = ["TwinUnavailable", "add_commands", "load_queue_class", "make_paint", "select_twins"]

QueueClass = type[AdmissionQueue]


_ANSI = {"bold": "1", "dim": "2", "ok": "32", "warn": "33", "bad": "31", "info": "36"}


class TwinUnavailable(CommandError, RuntimeError):
    """The twin asked for cannot be imported (in practice: the C twin was not built)."""


def load_queue_class(impl: str | None = None) -> tuple[str, QueueClass]:
    """``(name, AdmissionQueue class)`` of the twin ``impl`` (``"c"``/``"py"``), or prazo.core's pick.

    ``prazo.core.load_twin`` never falls back, so ``--impl c`` ignores
    ``PRAZO_NO_EXTENSIONS`` and fails loudly instead.
    """
    if impl is None:
        return IMPLEMENTATION, AdmissionQueue
    if impl not in TWINS:
        raise ValueError(f"impl must be one of {', '.join(TWINS)}, got {impl!r}")
    try:
        queue_class = load_twin(impl)
    except ImportError as exc:
        raise TwinUnavailable(
            f"the {impl} twin cannot be loaded: {exc}. Build the C twin with `make build`, or pass --impl py."
        ) from exc
    return impl, queue_class


def select_twins(impl: str | None = None) -> tuple[dict[str, QueueClass], list[str]]:
    """The twins to compare and notes on any left out.

    ``impl`` keeps just that one (failing if it cannot load); otherwise both,
    or the Python twin alone when prazo.core is running without the C twin.
    """
    if impl is not None:
        name, queue_class = load_queue_class(impl)
        return {name: queue_class}, []
    picked, _ = load_queue_class()
    twins = {"py": load_queue_class("py")[1]}
    if picked == "c":
        return {"c": load_queue_class("c")[1], **twins}, []
    note = "the C twin is left out (PRAZO_NO_EXTENSIONS is set, or it is not built): targets that need it are n/a"
    return twins, [note]


def make_paint(stream: TextIO) -> Paint:
    """A ``paint(text, role)`` that colours for a terminal and is a no-op otherwise.

    Colour only when ``stream`` is a tty, ``NO_COLOR`` is unset and the
    terminal is not ``dumb`` (https://no-color.org).
    """
    isatty = getattr(stream, "isatty", None)
    wanted = bool(isatty and isatty()) and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
    if not wanted:
        return plain
    return lambda text, role: f"\033[{_ANSI[role]}m{text}\033[0m" if role in _ANSI else text


# -- argument types: parse and range-check, so argparse exits 2 naming the flag ----


def _milliseconds(allow_negative: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of milliseconds, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if value < 0 and not allow_negative:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
        return value

    return parse


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of requests per second, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


# -- commands with topics ---------------------------------------------------------


def _add_command_with_topics(commands: Commands, name: str, help: str, default: Callable[[], Handler]) -> Commands:
    """``prazo <name>`` with sub-commands (topics); without one it runs ``default()``."""
    command = commands.add_parser(name, parents=[impl_options()], help=help, description=help.capitalize() + ".")
    command.set_defaults(handler=lambda args, out: default()(args, out))  # noqa: PLW0108 - default() imports lazily, at run time
    return command.add_subparsers(dest="topic", metavar="TOPIC")


def _add_topic(topics: Commands, name: str, help: str, description: str, handler: Handler) -> argparse.ArgumentParser:
    """A topic whose options are absent from ``args`` unless given (see ``_given``)."""
    topic = topics.add_parser(
        name, parents=[impl_options()], argument_default=argparse.SUPPRESS, help=help, description=description
    )
    topic.set_defaults(handler=handler)
    return topic


def _given(args: argparse.Namespace, settings: type) -> dict[str, object]:
    """The fields of the ``settings`` dataclass given on the command line.

    Options left out are absent from ``args`` (``argparse.SUPPRESS``), so the
    dataclass keeps the one copy of the defaults.
    """
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(settings) if hasattr(args, f.name)}


# -- demo -------------------------------------------------------------------------


def _run_demo_core(args: argparse.Namespace, out: TextIO) -> int:
    _, queue_class = load_queue_class(getattr(args, "impl", None))
    result = run_seed_scenario(SeedParams(**_given(args, SeedParams)), queue_class)  # type: ignore[arg-type]
    print(render_seed_result(result, make_paint(out)), file=out)
    return 0 if result.started_after_deadline == 0 else 1


def _run_demo_http(args: argparse.Namespace, out: TextIO) -> int:
    from prazo.bench.demo_cascade import CascadeParams, render_comparison, run_cascade

    params = CascadeParams(**_given(args, CascadeParams))  # type: ignore[arg-type]
    prazo = run_cascade(params, setup="prazo")
    naive = run_cascade(params, setup="naive")
    print(render_comparison(prazo, naive), file=out)
    # Exit status on what admission guarantees: B never starts after its own
    # deadline. Against the client's clock a hop's transit time can still
    # slip past the margin on a loaded machine.
    return 0 if prazo.started_after_own_deadline() == 0 else 1


def _cascade_flag_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    _add_cascade_flags(parser)
    return parser


def _add_cascade_flags(parser: argparse.ArgumentParser) -> None:
    from prazo.bench.demo_cascade import CascadeParams

    defaults = CascadeParams()
    parser.add_argument(
        "--clients",
        type=integer_argument(1, 1000),
        metavar="N",
        help=f"clients hitting A at once (default {defaults.clients})",
    )
    parser.add_argument(
        "--budget-ms",
        type=_milliseconds(allow_negative=False),
        metavar="MS",
        help=f"each client's budget (default {defaults.budget_ms:g})",
    )
    parser.add_argument(
        "--concurrency",
        type=integer_argument(1),
        metavar="N",
        help=f"B's max_concurrency (default {defaults.concurrency})",
    )
    parser.add_argument(
        "--queue", type=integer_argument(0), metavar="N", help=f"B's max_queue (default {defaults.queue})"
    )
    parser.add_argument(
        "--work-ms",
        type=_milliseconds(allow_negative=False),
        metavar="MS",
        help=f"B's work per request (default {defaults.work_ms:g})",
    )
    parser.add_argument(
        "--margin-ms",
        type=_milliseconds(allow_negative=False),
        metavar="MS",
        help=f"safety margin each hop keeps (default {defaults.margin_ms:g})",
    )
    parser.add_argument(
        "--chain",
        type=integer_argument(1, 16),
        metavar="N",
        help=f"hops in front of B (default {defaults.chain}: A only)",
    )
    parser.add_argument(
        "--retry-ms",
        type=_milliseconds(allow_negative=False),
        metavar="MS",
        help=f"client back-off before retrying a 503 (default {defaults.retry_ms:g})",
    )


def _check_plot_extra(args: argparse.Namespace) -> None:
    """With ``--plot``, fail now, naming the extra, rather than after a minute of demo."""
    if getattr(args, "plot", None) is not None:
        import matplotlib  # noqa: F401


def _demo_params(args: argparse.Namespace, quick: Any, full: Any) -> Any:
    """``quick`` with ``--quick``, else ``full``, with ``--rate`` and ``--seed`` applied."""
    params = quick if getattr(args, "quick", False) else full
    changes = {name: getattr(args, name) for name in ("rate_per_s", "seed") if hasattr(args, name)}
    return dataclasses.replace(params, **changes) if changes else params


def _report(
    args: argparse.Namespace, out: TextIO, result: Any, render: Callable[[Any], str], plot: Callable[[Any, str], None]
) -> None:
    """Print a demo's result (``--json``: its ``to_json()``; else its report) and draw ``--plot``."""
    import json

    as_json = getattr(args, "json", False)
    if as_json:
        json.dump(result.to_json(), out, indent=2, default=str)
        print(file=out)
    else:
        print(render(result), file=out)
    path = getattr(args, "plot", None)
    if path is not None:
        plot(result, path)
        print(f"plot written to {path}", file=sys.stderr if as_json else out)


def _run_demo_slow_dependency(args: argparse.Namespace, out: TextIO) -> int:
    from prazo.bench.demo_slow_dependency import (
        QUICK_PARAMS,
        SlowDependencyParams,
        plot_timeline,
        render_report,
        run_demo,
    )

    _check_plot_extra(args)
    result = run_demo(_demo_params(args, QUICK_PARAMS, SlowDependencyParams()))
    impl = getattr(args, "impl", None)
    if impl is not None and impl != IMPLEMENTATION:
        result.notes.append(
            f"the server runs on the twin prazo.core picked ({IMPLEMENTATION}); --impl {impl} does not apply to it "
            "(PRAZO_NO_EXTENSIONS=1 selects the Python twin)"
        )
    _report(args, out, result, render_report, plot_timeline)
    return 0


def _run_demo_retries(args: argparse.Namespace, out: TextIO) -> int:
    from prazo.bench.demo_retries import (
        QUICK_PARAMS,
        RetryExperimentParams,
        plot_experiment,
        render_report,
        run_experiment,
    )

    _check_plot_extra(args)
    result = run_experiment(_demo_params(args, QUICK_PARAMS, RetryExperimentParams()))
    _report(args, out, result, render_report, plot_experiment)
    # Exit status on what the policy guarantees, whatever the machine's load.
    safe = result.prazo.retries_after_deadline() == 0 and result.prazo.retries_of_a_504() == 0
    return 0 if safe else 1


# ``prazo demo`` with no topic runs this (looked up at call time, so it can be repointed).
DEFAULT_DEMO: Handler = _run_demo_http


def _add_demo(commands: Commands) -> Commands:
    defaults = SeedParams()
    topics = _add_command_with_topics(commands, "demo", "run a demonstration", lambda: DEFAULT_DEMO)
    # `prazo demo --chain 3` and `prazo demo http --chain 3` are the same run.
    demo = commands.choices["demo"]
    for action in _cascade_flag_parser()._actions:
        demo._add_action(action)
    http = _add_topic(
        topics,
        "http",
        "the seed's A -> B cascade on real HTTP servers, prazo vs naive (the default)",
        "40 clients hit A, which calls B (4 at once, queue 20, 300 ms of work) with the caller's remaining "
        "budget; then the same load on the naive setup (fixed 2 s timeout, no dequeue check). "
        "Prints both timelines and a side-by-side table.",
        _run_demo_http,
    )
    _add_cascade_flags(http)
    core = _add_topic(
        topics,
        "core",
        "the seed scenario on the admission queue with real threads",
        "A burst of simultaneous arrivals on an AdmissionQueue: each takes "
        "`with q.slot(Deadline.after_ms(budget))` and works inside. Prints the timeline and a summary.",
        _run_demo_core,
    )
    core.add_argument(
        "--arrivals",
        type=integer_argument(1, MAX_ARRIVALS),
        metavar="N",
        help=f"simultaneous arrivals (default {defaults.arrivals})",
    )
    core.add_argument(
        "--concurrency",
        type=integer_argument(1),
        metavar="N",
        help=f"max_concurrency, bodies at once (default {defaults.concurrency})",
    )
    core.add_argument(
        "--queue", type=integer_argument(0), metavar="N", help=f"max_queue, places in line (default {defaults.queue})"
    )
    core.add_argument(
        "--work-ms",
        type=_milliseconds(allow_negative=False),
        metavar="MS",
        help=f"time each body works (default {defaults.work_ms:g})",
    )
    core.add_argument(
        "--budget-ms",
        type=_milliseconds(allow_negative=True),
        metavar="MS",
        help=f"deadline of each arrival, from its arrival; negative = already passed (default {defaults.budget_ms:g})",
    )
    core.add_argument("--order", choices=("fifo", "lifo"), help=f"who gets a freed slot (default {defaults.order})")
    slow = _add_topic(
        topics,
        "slow-dependency",
        "the second seed's incident: recommendations slow from 20 ms to 2 s, without and with prazo (≈ 100 s)",
        "An API on waitress (/product, /cart, /recommendations, /health) under 200 requests/s of open-loop "
        "traffic from a separate process; its recommendations dependency (a second server on loopback) slows "
        "from 20 ms to 2 s mid-run and recovers. Without prazo the handlers share one pool of 50 for their "
        "dependency calls; with prazo recommendations sit behind a Dependency bulkhead of 20 with "
        "last-known-good. Prints per endpoint and phase: requests, p50, p99, error rate, stale share.",
        _run_demo_slow_dependency,
    )
    _add_quick(slow, "phases of 3, 6 and 4 s instead of 10, 20 and 15 s")
    slow.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    slow.add_argument(
        "--plot", metavar="FILE.png", help="draw latency over time per endpoint for both setups (needs prazo[plot])"
    )
    slow.add_argument(
        "--rate",
        dest="rate_per_s",
        type=_rate,
        metavar="N",
        help="requests per second, all endpoints together (default 200, the seed's)",
    )
    slow.add_argument("--seed", type=integer_argument(0), metavar="N", help="seed of the arrival schedule (default 9)")
    retries = _add_topic(
        topics,
        "retries",
        "retry amplification at an overloaded B: naive retries vs a retry budget, and callers that throttle "
        "themselves (≈ 1.5 min)",
        "Clients send 60 requests/s to A, which calls B (4 at once, queue 20, 300 ms of work) and retries: "
        "first with urllib3's Retry (3 attempts, fixed 2 s timeout), then with prazo's RetryPolicy and a 10 % "
        "RetryBudget. Prints B's offered load as a multiple of the client requests, B's wasted work and the "
        "clients' goodput; then a light-faults run (B not overloaded, 5 % random 503s); then 40 requests/s "
        "(3x B's capacity) without and with RetryPolicy(throttle=AdaptiveThrottles()): the load reaching B.",
        _run_demo_retries,
    )
    _add_quick(retries, "4 s overloaded and throttling runs and an 8 s light-faults run instead of 10 s and 25 s")
    retries.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    retries.add_argument(
        "--plot", metavar="FILE.png", help="draw offered load, wasted work and goodput over time (needs prazo[plot])"
    )
    retries.add_argument(
        "--rate", dest="rate_per_s", type=_rate, metavar="N", help="client requests per second (default 60)"
    )
    retries.add_argument(
        "--seed", type=integer_argument(0), metavar="N", help="seed of the jitter and faults (default 24)"
    )
    return topics


# -- bench ------------------------------------------------------------------------


def _bench_settings(args: argparse.Namespace) -> BenchSettings:
    settings = QUICK if getattr(args, "quick", False) else BenchSettings()
    return dataclasses.replace(settings, **_given(args, BenchSettings))  # type: ignore[arg-type]


def _run_bench_core(args: argparse.Namespace, out: TextIO) -> int:
    twins, notes = select_twins(getattr(args, "impl", None))
    print(render_core_report(run_core_bench(twins, _bench_settings(args), notes=notes), make_paint(out)), file=out)
    return 0


def _run_bench_wsgi(args: argparse.Namespace, out: TextIO) -> int:
    from prazo.bench.wsgi import render_wsgi_report, run_wsgi_bench

    twins, notes = select_twins(getattr(args, "impl", None))
    print(render_wsgi_report(run_wsgi_bench(twins, _bench_settings(args), notes=notes), make_paint(out)), file=out)
    return 0


def _run_bench_pool(args: argparse.Namespace, out: TextIO) -> int:
    from prazo.bench.pool import QUICK_POOL, PoolBenchSettings, render_pool_report, run_pool_bench

    settings = QUICK_POOL if getattr(args, "quick", False) else PoolBenchSettings()
    settings = dataclasses.replace(settings, **_given(args, PoolBenchSettings))  # type: ignore[arg-type]
    impl = getattr(args, "impl", None)
    notes = []
    if impl is not None and impl != IMPLEMENTATION:
        notes.append(
            f"AdmissionPool runs on the twin prazo.core picked ({IMPLEMENTATION}); --impl {impl} does not apply "
            "to it (PRAZO_NO_EXTENSIONS=1 selects the Python twin)"
        )
    report = run_pool_bench(settings, twin=IMPLEMENTATION, notes=notes)
    print(render_pool_report(report, make_paint(out)), file=out)
    return 0


def _run_bench_soak(args: argparse.Namespace, out: TextIO) -> int:
    from prazo.bench.soak import run_bench_soak

    twin, queue_class = load_queue_class(getattr(args, "impl", None))
    return run_bench_soak(args, out, queue_class, twin, make_paint(out))


def _run_bench_all(args: argparse.Namespace, out: TextIO) -> int:
    for index, run in enumerate((_run_bench_core, _run_bench_wsgi, _run_bench_pool)):
        if index:
            print(file=out)
        run(args, out)
    return 0


# ``prazo bench`` with no topic runs this (looked up at call time, so it can be repointed).
DEFAULT_BENCH: Handler = _run_bench_all


def _add_quick(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--quick", action="store_true", default=argparse.SUPPRESS, help=f"a fast, rough run ({what})")


def _add_sampling(parser: argparse.ArgumentParser, unit: str, defaults: BenchSettings) -> None:
    """``--inner`` and ``--repeat`` of a loop benchmark whose operation is one ``unit``."""
    parser.add_argument(
        "--inner", type=integer_argument(1), metavar="N", help=f"{unit}s per timed sample (default {defaults.inner})"
    )
    parser.add_argument(
        "--repeat",
        type=integer_argument(1),
        metavar="N",
        help=f"timed samples per {unit}; the best counts (default {defaults.repeat})",
    )


def _add_bench(commands: Commands) -> Commands:
    from prazo.bench.pool import QUICK_POOL, PoolBenchSettings

    defaults, pool_defaults = BenchSettings(), PoolBenchSettings()
    topics = _add_command_with_topics(commands, "bench", "run benchmarks", lambda: DEFAULT_BENCH)
    _add_quick(commands.choices["bench"], "every benchmark with its --quick settings")
    core = _add_topic(
        topics,
        "core",
        "the admission queue against the stdlib primitives, C twin against Python twin",
        "Micro-benchmarks of prazo.core, best of N repeats of an inner loop, "
        "with ratios against the stdlib baseline and the targets of the C twin.",
        _run_bench_core,
    )
    _add_sampling(core, "operation", defaults)
    core.add_argument(
        "--handoff-samples",
        type=integer_argument(2),
        metavar="N",
        help=f"handoffs timed per competitor (default {defaults.handoff_samples})",
    )
    _add_quick(core, f"repeat {QUICK.repeat}, {QUICK.handoff_samples} handoffs")
    wsgi = _add_topic(
        topics,
        "wsgi",
        "the WSGI middleware's cost per request against a BoundedSemaphore limiter",
        "In-process WSGI requests, uncontended: the bare app, a BoundedSemaphore limiter middleware and "
        "AdmissionMiddleware on each twin; the overhead of each over the bare app, and the target.",
        _run_bench_wsgi,
    )
    _add_sampling(wsgi, "request", defaults)
    _add_quick(wsgi, f"repeat {QUICK.repeat}")
    pool = _add_topic(
        topics,
        "pool",
        "AdmissionPool throughput against ThreadPoolExecutor on no-op tasks",
        "Batches of no-op tasks submitted and then waited for, end to end: ThreadPoolExecutor against "
        "AdmissionPool with a deadline on every task, and the target.",
        _run_bench_pool,
    )
    pool.add_argument(
        "--tasks", type=integer_argument(1), metavar="N", help=f"tasks per batch (default {pool_defaults.tasks})"
    )
    pool.add_argument(
        "--batches",
        type=integer_argument(1),
        metavar="N",
        help=f"timed batches per competitor; speed-ups compare medians (default {pool_defaults.batches})",
    )
    pool.add_argument(
        "--workers", type=integer_argument(1), metavar="N", help=f"threads per pool (default {pool_defaults.workers})"
    )
    _add_quick(pool, f"{QUICK_POOL.batches} batches")
    from prazo.bench.servers import add_bench_servers_arguments, run_bench_servers

    servers = _add_topic(
        topics,
        "servers",
        "each server embedding at 2x its capacity, stock vs prazo (not part of bare `prazo bench`: ~25 s)",
        "The same app on waitress, gunicorn, cheroot, werkzeug and wsgiref at twice their capacity, with and "
        "without prazo, in one run: answers within the deadline per second, p99 of successes, wasted work.",
        run_bench_servers,
    )
    add_bench_servers_arguments(servers)
    from prazo.bench.goodput import add_bench_goodput_arguments, run_bench_goodput

    goodput = _add_topic(
        topics,
        "goodput",
        "goodput under open-loop overload, CPU- and I/O-bound apps, every server (not part of bare `prazo bench`)",
        "Stock and prazo servers (and granian, HAProxy in front of waitress, the front door, when there) "
        "with a CPU-bound and an I/O-bound app, open-loop Poisson load from 0.5x to 10x of each one's measured "
        "capacity, 1 s client budgets: goodput, share of app runs finished late, p99, refusals by reason.",
        run_bench_goodput,
    )
    add_bench_goodput_arguments(goodput)
    from prazo.bench.throughput import add_bench_throughput_arguments, run_bench_throughput

    throughput = _add_topic(
        topics,
        "throughput",
        "answers/s of a hello-world app on every server, each on one CPU (not part of bare `prazo bench`)",
        "A hello-world app (13-byte body) on bjoern, granian, uWSGI (when installed), the front door, stock and "
        "prazo waitress, stock and prazo gunicorn gthread, each pinned to one CPU under closed-loop keep-alive load "
        "from wrk (or prazo's own generator): best of interleaved rounds, each embedding's ratio to its stock server.",
        run_bench_throughput,
    )
    add_bench_throughput_arguments(throughput)
    from prazo.bench.instructions import add_bench_instructions_arguments, run_bench_instructions

    instructions = _add_topic(
        topics,
        "instructions",
        "instructions per request of the hello-world app on each server, counted by callgrind "
        "(not part of bare `prazo bench`)",
        "Each server (the front door, granian and bjoern by default) started as `prazo bench throughput` starts "
        "it, under valgrind's callgrind; a warm-up, then the instructions every process of the server executes "
        "over N keep-alive requests, per request, and each server's ratio to the first. Instructions do not "
        "depend on the CPU, so they compare across machines where answers per second do not. Needs valgrind.",
        run_bench_instructions,
    )
    add_bench_instructions_arguments(instructions)
    from prazo.bench.soak import add_bench_soak_arguments

    soak = _add_topic(
        topics,
        "soak",
        "mixed load with random faults at 1.5x capacity, then checks (not part of bare `prazo bench`)",
        "waitress over real HTTP, the WSGI middleware in-process, AdmissionPool, a gate whose waiting main thread "
        "gets signals and a work queue whose on_expired raises, all at once at 1.5x capacity with random faults. "
        "--loads frontdoor,host soaks the front door (in this process, and as a --workers 2 host whose workers are "
        "killed, reloaded and retired meanwhile) with slow clients too. Then every queue must be at rest with "
        "balanced counters, no thread, child process or descriptor left and resident memory flat (in every host "
        "process too); exit status 1 otherwise. --impl picks the twin of the gate, the work queue and the middleware; the pool "
        "and waitress run on prazo.core's pick (PRAZO_NO_EXTENSIONS=1 selects the Python twin for all).",
        _run_bench_soak,
    )
    add_bench_soak_arguments(soak)
    from prazo.bench.parallel import add_bench_parallel_arguments, run_bench_parallel

    parallel = _add_topic(
        topics,
        "parallel",
        "CPU-bound tasks on 1 worker vs N, AdmissionPool and ThreadPoolExecutor (not part of bare `prazo bench`)",
        "Batches of CPU-bound pure-Python tasks through AdmissionPool and ThreadPoolExecutor with one worker and "
        "with N, interleaved: tasks/s and the ratio N workers / 1 worker. With a GIL the ratio stays near 1; on a "
        "free-threaded CPython it approaches N. The report names the interpreter, the CPU and whether the GIL was on.",
        run_bench_parallel,
    )
    add_bench_parallel_arguments(parallel)
    return topics


# -- the commands prazo.bindings.cli wires in ---------------------------------------


def add_commands(commands: Commands) -> None:
    """Add ``demo`` and ``bench`` to the ``prazo`` command (``prazo.bindings.cli.build_parser``)."""
    _add_demo(commands)
    _add_bench(commands)
