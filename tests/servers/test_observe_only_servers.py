"""Every server embedding observing only (``--observe-only``), on loopback with real HTTP.

One thread, one place in line, five requests held in the app until the test
opens the gate: enforcing, one would run, one would wait and three would be
answered 503 at once (``test_server_embeddings``'s burst). Observing, all
five are served (one at a time, as the stock server's own queue serves
them), and the line's counters, read by the app through
``prazo.server_stats``, say the three it would have refused. The front door
(one process) does the same; its host refuses the switch, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import wait_until
from _server_harness import (
    CLIENT_TIMEOUT_S,
    SERVER_KINDS,
    Burst,
    FrontDoors,
    RunningServer,
    request,
    start_server,
    statuses,
)
from prazo.core import AdmissionQueue
from prazo.core.shadow import DECISIONS, replay_enforcing


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_an_observing_server_serves_the_whole_burst_and_counts_what_it_would_have_refused(
    kind: str, servers: list[RunningServer], tmp_path: Path
) -> None:
    server = start_server(kind, threads=1, max_queue=1, policies={"observe_only": True})
    servers.append(server)
    gate = tmp_path / "gate"
    burst = Burst(server.port, [f"/work?gate={gate}"] * 5)
    server.wait_offered(5)
    gate.touch()
    assert statuses(burst.join()) == {200: 5}
    stats = json.loads(request(server.port, "/server-stats").body)
    # This request itself may be decided or not yet: it ran alone, so it was not refused either way.
    assert stats["observe_only"] == 1
    assert stats["offered"] in (5, 6), stats
    assert (stats["rejected_full"], stats["expired_on_arrival"], stats["expired_in_queue"]) == (3, 0, 0), stats


@pytest.mark.compiled
def test_an_observing_front_door_serves_the_whole_burst_and_counts_what_it_would_have_refused(tmp_path: Path) -> None:
    """The engine's line serves all five in arrival order; the shadow line, fed by the engine's
    notes and the workers' starts and ends, counts the three an enforcing one would have
    refused. A spent budget runs too (no 504 at arrival or at a late start), counted expired."""
    gate = tmp_path / "gate"
    with FrontDoors(threads=1, max_queue=1, observe_only=True) as start:
        server = start()
        server.observer.shadow.keep_journal()
        burst = Burst(server.port, [f"/work?gate={gate}"] * 5)
        wait_until(lambda: server.stats()["offered"] >= 5, "five arrivals decided", CLIENT_TIMEOUT_S)
        gate.touch()
        assert statuses(burst.join()) == {200: 5}
        spent = request(server.port, "/work", headers={"X-Request-Budget-Ms": "0"})
        assert spent.status == 200, spent
        wait_until(lambda: server.stats()["offered"] >= 6, "the spent one decided", CLIENT_TIMEOUT_S)
        stats = server.stats()
        assert stats["observe_only"] == 1
        assert (stats["rejected_full"], stats["expired_on_arrival"], stats["expired_in_queue"]) == (3, 1, 0), stats
        assert stats["started"] == stats["completed"] == 6 and stats["shed"] == stats["evicted"] == 0, stats
    # What the engine noted and the workers told, replayed through an enforcing line: the same decisions.
    replayed = replay_enforcing(AdmissionQueue, server.observer.shadow.journal(), 1, 1)
    assert {name: stats[name] for name in DECISIONS} == replayed, (stats, replayed)


@pytest.mark.compiled
def test_an_observing_front_door_host_serves_the_whole_burst_and_its_triage_counts_what_it_would_have_refused(
    tmp_path: Path,
) -> None:
    """Two worker processes of one thread, one place in line: enforcing, two would run, one would
    wait and three would be refused. The triage's engine notes the admissions, the starts (sent
    to a worker) and the ends (the place back); its shadow line counts the three."""
    gate = tmp_path / "gate"
    with FrontDoors(workers=2, threads=1, max_queue=1, observe_only=True) as start:
        host = start()
        burst = Burst(host.port, [f"/work?gate={gate}"] * 6)
        wait_until(lambda: host.stats()["offered"] >= 6, "six arrivals decided", CLIENT_TIMEOUT_S)
        gate.touch()
        assert statuses(burst.join()) == {200: 6}
        wait_until(lambda: host.stats()["completed"] >= 6, "six ends noted", CLIENT_TIMEOUT_S)
        stats = host.stats()
        assert stats["observe_only"] == 1
        assert (stats["rejected_full"], stats["expired_on_arrival"], stats["expired_in_queue"]) == (3, 0, 0), stats


def test_the_observers_bookkeeping_never_raises_into_a_worker_or_the_triage(caplog: pytest.LogCaptureFixture) -> None:
    """A worker's loop and the triage's call take() and decisions(): a failure there is logged, never raised."""
    from prazo.bindings.servers.frontdoor.observer import EngineObserver
    from prazo.bindings.servers.settings import resolve_settings

    class BrokenEngine:
        def observed(self) -> list[tuple[str, int, int, int, bool]]:
            raise MemoryError("no notes today")

    observer = EngineObserver(BrokenEngine(), resolve_settings(threads=1, max_queue=1), 1)
    observer.take()
    assert observer.decisions()["offered"] == 0
    assert caplog.text.count("could not hand the engine's notes") == 2, caplog.text
