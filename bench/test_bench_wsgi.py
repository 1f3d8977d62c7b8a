"""The WSGI middleware's cost per request, side by side with the bare app and a semaphore limiter.

Every runner is defined once in ``prazo.bench.wsgi`` and shared with
``prazo bench wsgi``; one round is ``INNER_LOOPS`` (1000) requests, so the
table's microseconds per round read as nanoseconds per request. The overhead
of a middleware is its row minus the bare app's row of the same group::

    .venv/bin/python -m pytest bench/test_bench_wsgi.py --benchmark-only
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from prazo.bench.harness import LoopRunner
from prazo.bench.wsgi import (
    GROUP_WSGI,
    REQUEST_KINDS,
    RequestKind,
    bare_requests,
    middleware_for,
    middleware_requests,
    semaphore_requests,
)

LoopBenchmark = Callable[[LoopRunner, str], None]

kinds = pytest.mark.parametrize("kind", REQUEST_KINDS, ids=[kind.key for kind in REQUEST_KINDS])


def _group(kind: RequestKind) -> str:
    return f"{GROUP_WSGI}, {kind.label}"


@kinds
def test_wsgi_bare_app(loop_benchmark: LoopBenchmark, kind: RequestKind) -> None:
    loop_benchmark(bare_requests(kind), _group(kind))


@kinds
def test_wsgi_semaphore_limiter(loop_benchmark: LoopBenchmark, kind: RequestKind) -> None:
    loop_benchmark(semaphore_requests(kind), _group(kind))


@kinds
@pytest.mark.parametrize("fast_path", [None, False], ids=["as-built", "python-path"])
def test_wsgi_admission_middleware(
    loop_benchmark: LoopBenchmark, twin: type, kind: RequestKind, fast_path: bool | None
) -> None:
    """On each twin as built (the C twin's compiled path, if built), then on its Python path."""
    if fast_path is False and not middleware_for(kind.app, twin).fast_path:
        pytest.skip("this twin runs the Python path as built already")
    loop_benchmark(middleware_requests(kind, twin, fast_path=fast_path), _group(kind))


@kinds
@pytest.mark.parametrize("fast_path", [None, False], ids=["as-built", "python-path"])
def test_wsgi_admission_middleware_record_latency(
    loop_benchmark: LoopBenchmark, twin: type, kind: RequestKind, fast_path: bool | None
) -> None:
    """The rows above with ``record_latency=True``: the difference is what the two histogram records cost."""
    if fast_path is False and not middleware_for(kind.app, twin).fast_path:
        pytest.skip("this twin runs the Python path as built already")
    loop_benchmark(middleware_requests(kind, twin, fast_path=fast_path, record_latency=True), _group(kind))


@kinds
@pytest.mark.parametrize(
    "options",
    [{"load_report": "text"}, {"observe_only": True}, {"max_expiry_refusal_fraction": 0.1}],
    ids=["load-report", "observe-only", "expiry-cap"],
)
def test_wsgi_admission_middleware_options(
    loop_benchmark: LoopBenchmark, twin: type, kind: RequestKind, options: dict[str, Any]
) -> None:
    """The as-built row with one opt-in on: the ORCA header, the dry run (Python path), the expiry cap (Python path)."""
    loop_benchmark(middleware_requests(kind, twin, **options), _group(kind))
