"""Every server embedding observing only (``--observe-only``), on loopback with real HTTP.

One thread, one place in line, five requests held in the app until the test
opens the gate: enforcing, one would run, one would wait and three would be
answered 503 at once (``test_server_embeddings``'s burst). Observing, all
five are served (one at a time, as the stock server's own queue serves
them), and the line's counters, read by the app through
``prazo.server_stats``, say the three it would have refused. The front door
refuses the switch, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _server_harness import SERVER_KINDS, Burst, RunningServer, request, start_server, statuses


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


def test_the_front_door_refuses_to_observe_only_naming_the_switch() -> None:
    from prazo.bindings.servers.frontdoor import create_server
    from prazo.bindings.servers.settings import resolve_settings

    settings = resolve_settings(threads=1, max_queue=0, observe_only=True)
    with pytest.raises(ValueError, match=r"observe_only \(--observe-only, \$PRAZO_OBSERVE_ONLY\)"):
        create_server(lambda environ, start_response: [], port=0, settings=settings)
