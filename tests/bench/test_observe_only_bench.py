"""``python -m prazo.bench.observe_only``: an observing embedding at 3x its capacity, a short run.

What must hold anywhere: the clients get no refusal at all (every answer a
200 or a client that gave up, as from the stock server), the line still
decided refusals, and replaying the run's own arrivals and service times
through an enforcing line decides exactly what the shadow decided.
"""

from __future__ import annotations

from prazo.bench.observe_only import run


def test_an_observing_server_refuses_nothing_and_its_shadow_equals_the_replay() -> None:
    point = run(True, load=3.0, seconds=1.5)
    assert point.requests > 100
    assert set(point.answers) <= {"200", "gave-up"}, point.answers
    assert point.decisions["offered"] > 0 and point.decisions["rejected_full"] > 0, point.decisions
    assert point.replayed == point.decisions
