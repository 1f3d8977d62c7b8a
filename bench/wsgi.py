"""The WSGI middleware's cost per request: ``prazo bench wsgi`` and its pytest-benchmark group.

Every competitor is driven the way a threaded WSGI server drives an app: a
fresh copy of a minimal PEP 3333 environ (``wsgiref.util.setup_testing_defaults``),
``app(environ, start_response)``, iterate the body, then ``close()`` it if it
has one. One runner repeats that ``loops`` times (see
``prazo.bench.core``), so the harness costs the same for everyone.

Competitors, each measured against the bare app in the same run (the
*overhead* is wrapped minus bare, per request):

* the bare app;
* ``SemaphoreLimiter``: the limiter one writes without prazo, a
  ``threading.BoundedSemaphore`` taken before the app is called and given back
  when the server closes the body (PEP 3333 correct);
* ``AdmissionMiddleware`` on each twin of the admission queue, as built (on
  the C twin that is its compiled path, ``prazo.bindings._wsgi_c``, when the
  extension is built) and, where that differs, on its Python path
  (``fast_path=False``) too.

Three request kinds: a plain request (a one-chunk list body, no budget
header) — the one the target is about —, the same with an
``X-Request-Budget-Ms`` header, and a streaming body (a generator of three
chunks, which the middleware must run inside the request's deadline scope).
Nothing ever waits: one request at a time, so this is the uncontended path.
"""

from __future__ import annotations

import threading
import wsgiref.util
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prazo.bench.harness import (
    DEFAULT_SETTINGS,
    BenchSettings,
    LoopRunner,
    Paint,
    Target,
    best_ns_per_op,
    format_times,
    make_target,
    plain,
    ratio_of,
    render_heading,
    render_targets,
)
from prazo.bindings.headers import BUDGET_ENVIRON_KEY
from prazo.bindings.wsgi import AdmissionMiddleware, Environ, StartResponse, WSGIApp
from prazo.core import AdmissionQueue

__all__ = [
    "GROUP_WSGI",
    "KIND_HEADER",
    "KIND_PLAIN",
    "KIND_STREAM",
    "REQUEST_KINDS",
    "WSGI_OVERHEAD_LIMIT",
    "RequestKind",
    "SemaphoreLimiter",
    "WsgiBenchReport",
    "bare_requests",
    "hello_app",
    "middleware_for",
    "middleware_requests",
    "minimal_environ",
    "render_wsgi_report",
    "run_wsgi_bench",
    "semaphore_requests",
    "serve_requests",
    "streaming_app",
    "wsgi_competitors",
]

QueueClass = type[AdmissionQueue]

GROUP_WSGI = "WSGI request in-process, uncontended"


# Issue #3: the middleware's overhead at most half the semaphore limiter's.
WSGI_OVERHEAD_LIMIT = 0.5

# Far more than one request at a time ever takes: nothing waits, nothing is refused.
_BENCH_CONCURRENCY = 8
_BENCH_BUDGET_MS = "500"
_HEADERS = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", "2")]
_BODY = [b"ok"]
_STREAM_HEADERS = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", "6")]


def hello_app(environ: Environ, start_response: StartResponse) -> list[bytes]:
    """The minimal WSGI app: ``200 OK``, a two-byte body in a list."""
    start_response("200 OK", _HEADERS)
    return _BODY


def streaming_app(environ: Environ, start_response: StartResponse) -> Iterator[bytes]:
    """A generator app streaming three chunks (its code runs while the server iterates)."""
    start_response("200 OK", _STREAM_HEADERS)
    yield b"ok"
    yield b"ok"
    yield b"ok"


def minimal_environ(*, budget_ms: str | None = None) -> Environ:
    """A minimal valid PEP 3333 environ for ``GET /``, with ``X-Request-Budget-Ms`` if given."""
    environ: Environ = {}
    wsgiref.util.setup_testing_defaults(environ)
    if budget_ms is not None:
        environ[BUDGET_ENVIRON_KEY] = budget_ms
    return environ


class SemaphoreLimiter:
    """The concurrency limit one writes without prazo: a ``threading.BoundedSemaphore``.

    Effects: takes the semaphore before calling the app (blocking while
    ``max_concurrency`` requests run) and gives it back exactly once: when
    the server closes the body (PEP 3333 makes every server call ``close()``,
    also after an error or a client gone before the first chunk), or at once
    if the app raises. The app's own ``close()`` is called, as PEP 3333
    requires of a middleware. No queue bound, no deadline: the honest
    baseline for what a limiter costs.

    >>> limited = SemaphoreLimiter(hello_app, max_concurrency=4)
    >>> body = limited(minimal_environ(), lambda status, headers: None)
    >>> list(body)
    [b'ok']
    >>> body.close()
    """

    def __init__(self, app: WSGIApp, max_concurrency: int) -> None:
        self._app = app
        self._semaphore = threading.BoundedSemaphore(max_concurrency)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        self._semaphore.acquire()
        try:
            result = self._app(environ, start_response)
        except BaseException:
            self._semaphore.release()
            raise
        return _ReleasedOnClose(result, self._semaphore.release)


class _ReleasedOnClose:
    """The limiter's body: the app's, plus a ``close()`` that closes it and releases, once."""

    __slots__ = ("_closed", "_release", "_result")

    def __init__(self, result: Iterable[bytes], release: Callable[[], object]) -> None:
        self._result = result
        self._release = release
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._result)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._result, "close", None)
            if close is not None:
                close()
        finally:
            self._release()


def serve_requests(app: WSGIApp, environ: Mapping[str, Any]) -> LoopRunner:
    """A runner: ``loops`` requests, each as a threaded server handles one.

    A fresh copy of ``environ`` per request (the app may add keys), the body
    iterated to the end, then closed if it has ``close()``.
    """

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: object = None) -> Any:
        return _discard

    def run(loops: int) -> None:
        template = dict(environ)
        for _ in range(loops):
            result = app(template.copy(), start_response)
            try:
                for _chunk in result:
                    pass
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()

    return run


def _discard(data: bytes) -> None:
    """The ``write()`` callable of the benchmark's server: the bytes go nowhere."""


def middleware_for(
    app: WSGIApp,
    queue_class: QueueClass,
    *,
    fast_path: bool | None = None,
    max_concurrency: int = _BENCH_CONCURRENCY,
    max_queue: int = _BENCH_CONCURRENCY,
    **options: Any,
) -> AdmissionMiddleware:
    """``AdmissionMiddleware`` around ``app`` on the given twin; by default with room for every request.

    ``fast_path`` as in ``AdmissionMiddleware``: None runs the compiled path
    whenever it can, False the Python path. ``options`` are the middleware's
    other keyword arguments (budgets, ...), for callers that load it.
    """
    twin = queue_class

    class OnTwin(AdmissionMiddleware):
        queue_class = twin

    return OnTwin(app, max_concurrency=max_concurrency, max_queue=max_queue, fast_path=fast_path, **options)


@dataclass(frozen=True)
class RequestKind:
    """One kind of request: the app, its environ, and a short name for keys and labels."""

    key: str
    label: str
    app: WSGIApp
    budget_ms: str | None = None


KIND_PLAIN = RequestKind("plain", "list body, no budget header", hello_app)
KIND_HEADER = RequestKind("header", f"list body, X-Request-Budget-Ms: {_BENCH_BUDGET_MS}", hello_app, _BENCH_BUDGET_MS)
KIND_STREAM = RequestKind("stream", "generator body of 3 chunks, no budget header", streaming_app)
REQUEST_KINDS = (KIND_PLAIN, KIND_HEADER, KIND_STREAM)


def _key(kind: RequestKind, competitor: str) -> str:
    return f"{kind.key}:{competitor}"


def bare_requests(kind: RequestKind) -> LoopRunner:
    """Requests of ``kind`` served by the bare app."""
    return serve_requests(kind.app, minimal_environ(budget_ms=kind.budget_ms))


def semaphore_requests(kind: RequestKind) -> LoopRunner:
    """Requests of ``kind`` served through ``SemaphoreLimiter``."""
    return serve_requests(SemaphoreLimiter(kind.app, _BENCH_CONCURRENCY), minimal_environ(budget_ms=kind.budget_ms))


def middleware_requests(
    kind: RequestKind,
    queue_class: QueueClass,
    *,
    fast_path: bool | None = None,
    record_latency: bool = False,
    **options: Any,
) -> LoopRunner:
    """Requests of ``kind`` served through ``AdmissionMiddleware`` on the twin ``queue_class`` (``options``: its others)."""
    middleware = middleware_for(kind.app, queue_class, fast_path=fast_path, record_latency=record_latency, **options)
    return serve_requests(middleware, minimal_environ(budget_ms=kind.budget_ms))


def _python_path_key(twin: str) -> str:
    return f"{twin}-python"


def wsgi_competitors(kind: RequestKind, twins: Mapping[str, QueueClass]) -> dict[str, tuple[str, LoopRunner]]:
    """``{key: (label, runner)}`` for one request kind: bare, semaphore, then prazo on each twin.

    A twin whose middleware runs the compiled path (key ``c``) gets a second
    row on the Python path (key ``c-python``).
    """
    competitors = {
        _key(kind, "bare"): ("bare app", bare_requests(kind)),
        _key(kind, "semaphore"): ("BoundedSemaphore limiter", semaphore_requests(kind)),
    }
    for name, queue_class in twins.items():
        label = f"prazo {name:<2} AdmissionMiddleware"
        if not middleware_for(kind.app, queue_class).fast_path:
            competitors[_key(kind, name)] = (label, middleware_requests(kind, queue_class))
            continue
        competitors[_key(kind, name)] = (f"{label}, compiled path", middleware_requests(kind, queue_class))
        competitors[_key(kind, _python_path_key(name))] = (
            f"{label}, Python path",
            middleware_requests(kind, queue_class, fast_path=False),
        )
    return competitors


@dataclass
class WsgiBenchReport:
    """Everything ``prazo bench wsgi`` measured: ns per request of each competitor, by key.

    Keys are ``<kind>:<competitor>``, e.g. ``plain:bare``, ``plain:semaphore``, ``plain:c``
    (the C twin as built: its compiled path when there is one), ``plain:c-python``.
    """

    settings: BenchSettings
    twins: tuple[str, ...]
    ns: dict[str, float]
    labels: dict[str, str]
    notes: list[str] = field(default_factory=list)

    def overhead_ns(self, kind: RequestKind, competitor: str) -> float | None:
        """What ``competitor`` adds to the bare app, per request of ``kind``."""
        wrapped, bare = self.ns.get(_key(kind, competitor)), self.ns.get(_key(kind, "bare"))
        return None if wrapped is None or bare is None else wrapped - bare

    def vs_semaphore(self, kind: RequestKind, competitor: str) -> float | None:
        """``competitor``'s overhead relative to the semaphore limiter's, for ``kind``."""
        return ratio_of(self.overhead_ns(kind, competitor), self.overhead_ns(kind, "semaphore"))

    def competitors(self, kind: RequestKind) -> list[str]:
        """The competitors measured for ``kind``, in table order."""
        prefix = _key(kind, "")
        return [key[len(prefix) :] for key in self.labels if key.startswith(prefix)]

    def targets(self) -> list[Target]:
        return [
            make_target(
                "C middleware overhead vs the BoundedSemaphore limiter's",
                self.vs_semaphore(KIND_PLAIN, "c"),
                f"<= {WSGI_OVERHEAD_LIMIT}x",
                lambda r: r <= WSGI_OVERHEAD_LIMIT,
            )
        ]


def run_wsgi_bench(
    twins: Mapping[str, QueueClass], settings: BenchSettings = DEFAULT_SETTINGS, *, notes: Sequence[str] = ()
) -> WsgiBenchReport:
    """Time every request kind for bare, semaphore and each twin, all interleaved in one run."""
    if not twins:
        raise ValueError("twins must name at least one twin of the admission queue")
    labels: dict[str, str] = {}
    runners: dict[str, LoopRunner] = {}
    for kind in REQUEST_KINDS:
        for key, (label, runner) in wsgi_competitors(kind, twins).items():
            labels[key] = label
            runners[key] = runner
    return WsgiBenchReport(settings, tuple(twins), best_ns_per_op(runners, settings), labels, list(notes))


def render_wsgi_report(report: WsgiBenchReport, paint: Paint = plain) -> str:
    """The ``prazo bench wsgi`` table: ns per request, overhead, overhead vs the semaphore's; the target."""
    s = report.settings
    out = render_heading(
        "prazo bench wsgi",
        f"twins: {', '.join(report.twins)} · {s.inner} requests per sample · best of {s.repeat} · "
        "overhead = ns/request minus the bare app's",
        report.notes,
        paint,
    )
    targets = report.targets()
    width = max(len(label) for label in [*report.labels.values(), *(t.label for t in targets)]) + 2
    for kind in REQUEST_KINDS:
        out += [
            "",
            paint(f"{GROUP_WSGI}: {kind.label}", "bold"),
            f"  {'':<{width - 2}}{'ns/req':>10}  {'overhead':>9}  {'vs semaphore':>12}",
        ]
        for competitor in report.competitors(kind):
            key = _key(kind, competitor)
            overhead = report.overhead_ns(kind, competitor)
            shown = "-" if overhead is None or competitor == "bare" else f"{overhead:.1f}"
            out.append(
                f"  {report.labels[key]:<{width - 2}}{report.ns[key]:>10.1f}  {shown:>9}  "
                f"{format_times(report.vs_semaphore(kind, competitor)) if competitor != 'bare' else '':>12}"
            )
    out += render_targets(targets, width, paint)
    return "\n".join(out)
