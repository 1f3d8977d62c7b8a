"""Django: the request's deadline in the views and in every database statement they send.

Put the middleware first in ``settings.MIDDLEWARE``::

    MIDDLEWARE = [
        "prazo.bindings.integrations.django.DeadlineMiddleware",
        # ... Django's own middleware ...
    ]
    PRAZO_DEFAULT_BUDGET_MS = 1000    # when no prazo layer set a deadline and no budget header came
    PRAZO_MAX_BUDGET_MS = 30000       # the most a caller's header can ask for
    PRAZO_RETRY_AFTER_S = 1           # Retry-After of the 503s it answers

and serve the project with admission at the server's queue
(``prazo serve mysite.wsgi:application``) or behind ``AdmissionMiddleware``.

Effects, per request:

* the deadline is the one prazo's WSGI layer or server set
  (``request.META["prazo.deadline"]``), else the budget headers read with the
  settings above (``prazo.bindings.plumbing.frameworks.request_deadline_of``); it is
  the current deadline (``prazo.core.current_deadline()``) while the view
  runs, so outgoing calls (``prazo.bindings.clients``) pass the remaining
  budget on;
* a request whose deadline passed before the view ran is answered 504
  ``expired-on-arrival``, and the view never runs;
* every statement sent on any of Django's database connections during the
  request is bounded by the deadline (``connection.execute_wrapper``):
  PostgreSQL through ``prazo.bindings.integrations.psycopg.run_bounded`` (the backend is
  cancelled at the deadline; no statement is sent without budget left),
  SQLite through ``prazo.bindings.integrations.sqlite.deadline_guard`` (its progress
  handler stays installed until the request ends, so rows fetched after
  ``execute`` returned are bounded too); other backends get no statement
  sent once the deadline has passed;
* a view that raises ``DeadlineExceeded`` (directly, or as the mapped
  database error) is answered 504, one that raises ``DownstreamOverloaded``
  or ``QueueFull`` 503 with ``Retry-After`` — the same status, headers and
  body as every other prazo refusal (``prazo.bindings.wsgi.rejection_response``),
  as a Django ``HttpResponse`` that the rest of the middleware stack sees.

Connections opened by threads the view starts itself are not wrapped (Django
keeps connections per thread); give such work the deadline explicitly.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextvars import ContextVar
from functools import partial
from typing import Any

from django.conf import settings
from django.db import connections
from django.http import HttpRequest, HttpResponse
from prazo.bindings.headers import BudgetPolicy
from prazo.bindings.plumbing.frameworks import expired_on_arrival, request_deadline_of
from prazo.bindings.wsgi import rejection_response
from prazo.core import Deadline, DeadlineExceeded, DownstreamOverloaded, QueueFull, deadline_scope

from .psycopg import run_bounded
from .sqlite import deadline_guard

__all__ = [
    "SETTING_DEFAULT_BUDGET_MS",
    "SETTING_MAX_BUDGET_MS",
    "SETTING_RETRY_AFTER_S",
    "DeadlineMiddleware",
    "StatementDeadline",
    "rejection_http_response",
]

SETTING_DEFAULT_BUDGET_MS = "PRAZO_DEFAULT_BUDGET_MS"
SETTING_MAX_BUDGET_MS = "PRAZO_MAX_BUDGET_MS"
SETTING_RETRY_AFTER_S = "PRAZO_RETRY_AFTER_S"
_SETTING_NAMES = f"{SETTING_DEFAULT_BUDGET_MS}, {SETTING_MAX_BUDGET_MS}, {SETTING_RETRY_AFTER_S}"

# The same defaults as BudgetPolicy and the middleware's Retry-After.
_DEFAULT_BUDGET_MS = 1000
_DEFAULT_MAX_BUDGET_MS = 30000
_DEFAULT_RETRY_AFTER_S = 1

# The refusals a view may raise that are answered as prazo answers them, not as a 500.
_REFUSALS = (DeadlineExceeded, DownstreamOverloaded, QueueFull)

# The statements of the request being handled in this context; process_exception reads it.
_current_statements: ContextVar[StatementDeadline | None] = ContextVar("prazo_django_statements", default=None)


def rejection_http_response(exc: BaseException, *, retry_after_s: int = _DEFAULT_RETRY_AFTER_S) -> HttpResponse:
    """The Django response refusing a request for ``exc`` (``QueueFull``, ``DeadlineExceeded``, ...).

    Status, headers and body are ``prazo.bindings.wsgi.rejection_response``'s:
    504 for a missed deadline, 503 with ``Retry-After`` for overload, the
    reason in ``X-Prazo-Reason``. Any other exception raises ``TypeError``.
    """
    status, headers, body = rejection_response(exc, retry_after_s=retry_after_s)
    response = HttpResponse(body, status=int(status.split(" ", 1)[0]))
    for name, value in headers:
        response[name] = value
    return response


class StatementDeadline:
    """A Django ``execute_wrapper`` bounding every statement by ``deadline``; ``close()`` when the request ends.

    Usable on its own, e.g. around a management command's work::

        bound = StatementDeadline(Deadline.after(2.0))
        try:
            with connection.execute_wrapper(bound):
                Report.objects.build()
        finally:
            bound.close()
    """

    __slots__ = ("_deadline", "_sqlite_guards")

    def __init__(self, deadline: Deadline) -> None:
        if not isinstance(deadline, Deadline):
            raise TypeError(f"deadline must be a prazo.core.Deadline, not {type(deadline).__name__}")
        self._deadline = deadline
        # One guard per raw SQLite connection, open until close(): Django fetches a
        # query's rows after execute() returned, outside this wrapper.
        self._sqlite_guards: dict[int, deadline_guard] = {}

    @property
    def deadline(self) -> Deadline:
        return self._deadline

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        connection = context["connection"]
        vendor = connection.vendor
        if vendor == "postgresql":
            return run_bounded(connection.connection, partial(execute, sql, params, many, context), self._deadline)
        self._deadline.check()
        if vendor != "sqlite":
            return execute(sql, params, many, context)
        guard = self._sqlite_guard(connection.connection)
        try:
            return execute(sql, params, many, context)
        except Exception as exc:
            error = guard.deadline_error(exc)
            if error is None:
                raise
            raise error from exc

    def _sqlite_guard(self, raw: sqlite3.Connection) -> deadline_guard:
        guard = self._sqlite_guards.get(id(raw))
        if guard is None:
            guard = deadline_guard(raw, self._deadline)
            guard.__enter__()
            self._sqlite_guards[id(raw)] = guard
        return guard

    def deadline_error(self, exc: BaseException) -> DeadlineExceeded | None:
        """The ``DeadlineExceeded`` that ``exc`` stands for (a SQLite statement interrupted at the deadline), or None."""
        for guard in self._sqlite_guards.values():
            error = guard.deadline_error(exc)
            if error is not None:
                return error
        return None

    def close(self) -> None:
        """Remove the SQLite progress handlers this request installed (newest first)."""
        guards = list(self._sqlite_guards.values())
        self._sqlite_guards.clear()
        for guard in reversed(guards):
            try:
                guard.__exit__(None, None, None)
            except sqlite3.ProgrammingError:
                pass  # the view closed that connection: nothing left to remove


def _setting(name: str, default: Any) -> Any:
    return getattr(settings, name, default)


class DeadlineMiddleware:
    """Django middleware: the request's deadline in the view and its database statements (see the module docstring).

    ::

        MIDDLEWARE = ["prazo.bindings.integrations.django.DeadlineMiddleware", ...]

        def report(request):
            request.META["prazo.deadline"].remaining_ms()   # also current_deadline()
            return JsonResponse(list(Row.objects.values()))  # bounded by the deadline
    """

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        try:
            self.policy = BudgetPolicy(
                default_budget_ms=_setting(SETTING_DEFAULT_BUDGET_MS, _DEFAULT_BUDGET_MS),
                max_budget_ms=_setting(SETTING_MAX_BUDGET_MS, _DEFAULT_MAX_BUDGET_MS),
            )
            retry_after_s = _setting(SETTING_RETRY_AFTER_S, _DEFAULT_RETRY_AFTER_S)
            # Validated now (rejection_response's own check), not on the first refusal.
            rejection_response(QueueFull(), retry_after_s=retry_after_s)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"prazo's Django settings ({_SETTING_NAMES}): {exc}") from exc
        self.retry_after_s: int = retry_after_s

    def __call__(self, request: HttpRequest) -> HttpResponse:
        deadline = request_deadline_of(request.META, self.policy)
        if deadline.expired():
            return rejection_http_response(expired_on_arrival(), retry_after_s=self.retry_after_s)
        statements = StatementDeadline(deadline)
        # Entered and left by hand rather than through an ExitStack: this runs on every request.
        wrappers = [connection.execute_wrapper(statements) for connection in connections.all()]
        token = _current_statements.set(statements)
        try:
            for wrapper in wrappers:
                wrapper.__enter__()
            with deadline_scope(deadline):
                return self.get_response(request)
        finally:
            for wrapper in reversed(wrappers):
                wrapper.__exit__(None, None, None)
            statements.close()
            _current_statements.reset(token)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """Answer a view's ``DeadlineExceeded``/``DownstreamOverloaded``/``QueueFull`` as prazo does; None otherwise."""
        refusal: BaseException | None = exception if isinstance(exception, _REFUSALS) else None
        if refusal is None:
            statements = _current_statements.get()
            refusal = None if statements is None else statements.deadline_error(exception)
        if refusal is None:
            return None
        return rejection_http_response(refusal, retry_after_s=self.retry_after_s)
