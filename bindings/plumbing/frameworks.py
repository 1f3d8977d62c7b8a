"""What the web-framework integrations (Django, Flask) share: a request's deadline.

A framework app usually runs behind prazo's admission — ``AdmissionMiddleware``
or a server embedding under ``prazo serve`` — which has already set the
request's deadline in ``environ["prazo.deadline"]`` and as the current
deadline. ``request_deadline_of`` takes that one; when the app runs without
prazo in front (``manage.py runserver``, a plain WSGI server) it reads the
budget headers itself with a ``BudgetPolicy``, so the deadline is the same
whichever way the request came in: a malformed header is ignored (it never
extends the deadline), a budget ``<= 0`` is a deadline already passed.
"""

from __future__ import annotations

import time
from typing import Any

from prazo.bindings.headers import BudgetPolicy
from prazo.bindings.wsgi import DEADLINE_KEY, request_deadline
from prazo.core import REASON_EXPIRED_ON_ARRIVAL, Deadline, DeadlineExceeded, current_deadline

__all__ = ["expired_on_arrival", "request_deadline_of"]


def request_deadline_of(environ: dict[str, Any], policy: BudgetPolicy) -> Deadline:
    """The deadline of the request whose WSGI environ is ``environ``.

    ``environ["prazo.deadline"]`` when prazo's WSGI layer or server set it
    (the earlier of it and the current deadline); otherwise the deadline
    ``policy`` gives the budget headers from now on, stored back into
    ``environ["prazo.deadline"]`` so the app finds it where it always does.
    """
    if not isinstance(policy, BudgetPolicy):
        raise TypeError(f"policy must be a prazo.bindings.headers.BudgetPolicy, not {type(policy).__name__}")
    deadline = environ.get(DEADLINE_KEY)
    if isinstance(deadline, Deadline):
        outer = current_deadline()
        return outer if outer is not None and outer.ns < deadline.ns else deadline
    deadline, _ = request_deadline(policy, environ, time.monotonic_ns())
    environ[DEADLINE_KEY] = deadline
    return deadline


def expired_on_arrival() -> DeadlineExceeded:
    """The refusal of a request whose deadline had passed before the app ran (504 ``expired-on-arrival``)."""
    return DeadlineExceeded(REASON_EXPIRED_ON_ARRIVAL, "the request's deadline passed before the view ran")
