"""A small Flask app behind prazo: ``prazo serve examples.flask_app:app`` (from the repository root).

``init_app`` puts the request's deadline on ``flask.g.prazo_deadline`` (and
as ``current_deadline()``) and answers a view's ``DeadlineExceeded`` with
prazo's 504 instead of Flask's 500::

    .venv/bin/prazo serve examples.flask_app:app --threads 4 --max-queue 20 &
    curl -s -H 'X-Request-Budget-Ms: 250' localhost:8000/deadline
    curl -s -D - -H 'X-Request-Budget-Ms: 200' 'localhost:8000/work?ms=1000'   # 504 deadline-exceeded
"""

from __future__ import annotations

import time

from flask import Flask, g, request
from prazo.bindings.integrations.flask import init_app

_STEP_S = 0.01
_MAX_WORK_MS = 10_000

app = Flask(__name__)
init_app(app)


@app.get("/deadline")
def deadline() -> dict[str, float]:
    return {"remaining_ms": round(g.prazo_deadline.remaining_ms())}


@app.get("/work")
def work() -> str:
    end = time.monotonic() + min(request.args.get("ms", 0, type=int), _MAX_WORK_MS) / 1000
    while time.monotonic() < end:
        g.prazo_deadline.check()  # the cooperative cancellation point: DeadlineExceeded -> 504
        time.sleep(_STEP_S)
    return "done\n"
