"""What ``prazo.bindings.integrations.django.DeadlineMiddleware`` costs per request.

Django's own WSGI handler (``django.core.handlers.wsgi.WSGIHandler``) is
called in this thread with a prepared environ, the response iterated and
closed as a server would, with and without the middleware first in
``MIDDLEWARE``:

* ``plain`` — a view that touches no database;
* ``one-query`` — a view that runs ``SELECT 1`` on SQLite (persistent
  in-memory connection): with the middleware the statement goes through its
  ``execute_wrapper`` and the SQLite progress handler is installed and removed;
* ``…-header`` — the same with an ``X-Request-Budget-Ms`` header to parse;
* ``noop-middleware`` — a middleware that only calls ``get_response``: what
  Django itself charges for any one middleware (its exception-converting
  layer), so ``with`` minus ``noop-middleware`` is prazo's own share.

One round is ``INNER_LOOPS`` requests, so us/round reads as ns/request::

    .venv/bin/python -m pytest -p no:cacheprovider bench/test_bench_django.py --benchmark-only \\
        --benchmark-columns=min,median,rounds
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
from prazo.bench.harness import LoopRunner

django = pytest.importorskip("django")

from django.conf import settings

GROUP = "Django WSGIHandler request"
MIDDLEWARE = "prazo.bindings.integrations.django.DeadlineMiddleware"
NOOP_MIDDLEWARE = f"{__name__}.NoopMiddleware"


class NoopMiddleware:
    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        return self.get_response(request)


def _views() -> list[Any]:
    from django.db import connection
    from django.http import HttpResponse
    from django.urls import path

    def plain(request: Any) -> HttpResponse:
        return HttpResponse(b"ok")

    def one_query(request: Any) -> HttpResponse:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchall()
        return HttpResponse(b"ok")

    return [path("plain", plain), path("one-query", one_query)]


urlpatterns: list[Any] = []


def _setup() -> None:
    if not settings.configured:
        settings.configure(
            DEBUG=False,
            ALLOWED_HOSTS=["bench"],
            ROOT_URLCONF=__name__,
            MIDDLEWARE=[],
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:", "CONN_MAX_AGE": None}},
        )
        django.setup()
    if not urlpatterns:
        urlpatterns.extend(_views())


def _runner(path: str, *, middleware: list[str], header: bool) -> LoopRunner:
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import override_settings

    with override_settings(MIDDLEWARE=middleware):
        handler = WSGIHandler()
    base = {
        "REQUEST_METHOD": "GET", "PATH_INFO": f"/{path}", "QUERY_STRING": "", "SERVER_NAME": "bench",
        "SERVER_PORT": "80", "HTTP_HOST": "bench", "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(),
    }  # fmt: skip
    if header:
        base["HTTP_X_REQUEST_BUDGET_MS"] = "5000"

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        assert status.startswith("200"), status
        return lambda data: None

    def run(loops: int) -> None:
        for _ in range(loops):
            response = handler(dict(base), start_response)
            for _chunk in response:
                pass
            response.close()

    run(1)  # the first request connects and warms Django's caches
    return run


@pytest.mark.parametrize("path", ["plain", "one-query"])
@pytest.mark.parametrize("variant", ["without", "noop-middleware", "with", "with-header"])
def test_django_request(loop_benchmark: Callable[[LoopRunner, str], None], path: str, variant: str) -> None:
    _setup()
    middleware = {"without": [], "noop-middleware": [NOOP_MIDDLEWARE]}.get(variant, [MIDDLEWARE])
    runner = _runner(path, middleware=middleware, header=variant == "with-header")
    loop_benchmark(runner, f"{GROUP} {path}")
