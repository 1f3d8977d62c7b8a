"""The seed scenario's views; every database statement is bounded by the request's deadline.

``/work?ms=300``
    records a ``Hit`` and then spends ``ms`` in the database (``pg_sleep``
    on PostgreSQL, cancelled at the deadline; on SQLite, which has no
    sleep, in the view after its statements), answering the budget left.
``/slow-query`` (``?rows=1``, ``?atomic=1``)
    a query far longer than any budget (``pg_sleep(5)``; on SQLite a
    recursive count to a billion, or with ``rows=1`` a row every 100 000
    steps, so the time goes into fetching): the deadline ends it with a 504.
    With ``atomic=1`` it first records a ``Hit`` in the same transaction,
    which the 504 rolls back.
``/deadline``
    the deadline the view sees: ``META["prazo.deadline"]`` and ``current_deadline()``.
``/hits``
    how many ``Hit`` rows exist (the views that really ran).
"""

import time
from contextlib import nullcontext

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from prazo.core import current_deadline

from seedsite.models import Hit

_MAX_WORK_MS = 10_000
_SQLITE_COUNT = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) SELECT count(*) FROM c"
# Rows now and then: execute() returns with the first one, the long part is the fetch.
_SQLITE_ROWS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) SELECT x FROM c WHERE x % 100000 = 1"


def healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", content_type="text/plain")


def work(request: HttpRequest) -> HttpResponse:
    try:
        ms = min(max(int(request.GET.get("ms", "0")), 0), _MAX_WORK_MS)
    except ValueError:
        return HttpResponse("ms must be an integer\n", status=400, content_type="text/plain")
    deadline = request.META["prazo.deadline"]
    Hit.objects.create(path=request.path, remaining_ms=deadline.remaining_ms())
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_sleep(%s)", [ms / 1000])
        else:
            cursor.execute("SELECT count(*) FROM seedsite_hit")
        cursor.fetchall()
    if connection.vendor != "postgresql":
        # Outside the cursor: an unfinished SELECT would hold SQLite's shared lock and serialize every writer.
        time.sleep(ms / 1000)
    return JsonResponse({"remaining_ms": round(deadline.remaining_ms())})


def slow_query(request: HttpRequest) -> HttpResponse:
    with transaction.atomic() if request.GET.get("atomic") else nullcontext():
        if request.GET.get("atomic"):
            Hit.objects.create(path=request.path, remaining_ms=request.META["prazo.deadline"].remaining_ms())
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SELECT pg_sleep(5)")
            else:
                cursor.execute(_SQLITE_ROWS if request.GET.get("rows") else _SQLITE_COUNT)
            cursor.fetchall()
    return HttpResponse("finished (the deadline did not stop it)\n", content_type="text/plain")


def deadline(request: HttpRequest) -> HttpResponse:
    current = current_deadline()
    return JsonResponse(
        {
            "meta_remaining_ms": round(request.META["prazo.deadline"].remaining_ms()),
            "current_remaining_ms": None if current is None else round(current.remaining_ms()),
            "budget_source": request.META.get("prazo.budget_source"),
        }
    )


def hits(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"hits": Hit.objects.count()})
