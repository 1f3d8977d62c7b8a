"""``python -m prazo.bench.observe_only``: an observing embedding and front door at 3x their capacity, a short run.

What must hold anywhere: the clients get no refusal at all (every answer a
200 or a client that gave up, as from the stock server), the line still
decided refusals, and replaying the run's own arrivals and service times
through an enforcing line decides exactly what the shadow decided.
"""

from __future__ import annotations

import pytest
from prazo.bench.observe_only import SERVERS, run


@pytest.mark.parametrize("server_name", SERVERS)
def test_an_observing_server_refuses_nothing_and_its_shadow_equals_the_replay(server_name: str) -> None:
    point = run(True, load=3.0, seconds=1.0, server_name=server_name)
    assert point.requests > 60
    assert set(point.answers) <= {"200", "gave-up"}, point.answers
    assert point.decisions["offered"] > 0 and point.decisions["rejected_full"] > 0, point.decisions
    assert point.replayed == point.decisions
