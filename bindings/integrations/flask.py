"""Flask: the request's deadline on ``flask.g``, and prazo's refusals answered as prazo answers them.

Flask turns every exception a view raises into a 500 before any WSGI
middleware sees it, so a view whose database or outgoing call ran out of
budget (``DeadlineExceeded``) or met an overloaded dependency
(``DownstreamOverloaded``) would answer 500 even behind
``AdmissionMiddleware``. ``init_app`` fixes that and gives views the
deadline::

    from flask import Flask, g
    from prazo.bindings.integrations.flask import init_app

    app = Flask(__name__)
    init_app(app)                      # default_budget_ms=, max_budget_ms=, retry_after_s=

    @app.get("/report")
    def report():
        g.prazo_deadline.remaining_ms()    # also prazo.core.current_deadline()
        ...

Effects, per request: the deadline is the one prazo's WSGI layer or server
set (``environ["prazo.deadline"]``), else the budget headers read with
``default_budget_ms``/``max_budget_ms`` (``prazo.bindings.plumbing.frameworks``); it
is ``g.prazo_deadline`` and the current deadline while Flask handles the
request; a request whose deadline already passed is answered 504
``expired-on-arrival`` without running Flask at all; a view raising
``DeadlineExceeded`` is answered 504, ``DownstreamOverloaded`` or
``QueueFull`` 503 with ``Retry-After`` — the status, headers and body of
``prazo.bindings.wsgi.rejection_response``.

Admission itself (the bounded queue) stays where it belongs, in front of
Flask: ``prazo serve myapp:app`` or ``app.wsgi_app = AdmissionMiddleware(app.wsgi_app, ...)``
applied after ``init_app``. The deadline scope ends when ``wsgi_app``
returns: a streamed body (``stream_with_context``) reads the deadline from
``g`` rather than from ``current_deadline()``.
"""

from __future__ import annotations

from collections.abc import Iterable

from flask import Flask, Response, g, request
from prazo.bindings.headers import BudgetPolicy
from prazo.bindings.plumbing.frameworks import expired_on_arrival, request_deadline_of
from prazo.bindings.wsgi import DEADLINE_KEY, Environ, StartResponse, WSGIApp, rejection_response, send_rejection
from prazo.core import DeadlineExceeded, DownstreamOverloaded, QueueFull, deadline_scope

__all__ = ["G_DEADLINE", "DeadlineWSGI", "init_app", "rejection_flask_response"]

# The attribute of flask.g holding the request's Deadline.
G_DEADLINE = "prazo_deadline"


def rejection_flask_response(exc: BaseException, *, retry_after_s: int = 1) -> Response:
    """The Flask response refusing a request for ``exc`` (``rejection_response``'s status, headers, body)."""
    status, headers, body = rejection_response(exc, retry_after_s=retry_after_s)
    return Response(body, status=status, headers=headers)


class DeadlineWSGI:
    """The WSGI layer ``init_app`` puts around ``app.wsgi_app``: the deadline scope, and 504 for one already passed."""

    def __init__(self, wsgi_app: WSGIApp, policy: BudgetPolicy, retry_after_s: int = 1) -> None:
        self.wsgi_app = wsgi_app
        self.policy = policy
        self.retry_after_s = retry_after_s

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        deadline = request_deadline_of(environ, self.policy)
        if deadline.expired():
            return send_rejection(start_response, expired_on_arrival(), retry_after_s=self.retry_after_s)
        with deadline_scope(deadline):
            return self.wsgi_app(environ, start_response)


def init_app(
    app: Flask, *, default_budget_ms: float = 1000, max_budget_ms: float = 30000, retry_after_s: int = 1
) -> None:
    """Give ``app``'s views the request's deadline and answer prazo's refusals (see the module docstring)."""
    if not isinstance(app, Flask):
        raise TypeError(f"app must be a flask.Flask, not {type(app).__name__}")
    policy = BudgetPolicy(default_budget_ms=default_budget_ms, max_budget_ms=max_budget_ms)
    # Validated now (rejection_response's own check), not on the first refusal.
    rejection_response(QueueFull(), retry_after_s=retry_after_s)
    app.wsgi_app = DeadlineWSGI(app.wsgi_app, policy, retry_after_s)  # type: ignore[method-assign]

    def expose_deadline() -> None:
        setattr(g, G_DEADLINE, request.environ[DEADLINE_KEY])

    def refuse(exc: Exception) -> Response:
        return rejection_flask_response(exc, retry_after_s=retry_after_s)

    app.before_request(expose_deadline)
    for refusal in (DeadlineExceeded, DownstreamOverloaded, QueueFull):
        app.register_error_handler(refusal, refuse)
