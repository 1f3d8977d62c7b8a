"""Fixtures shared by the test suite: both twins of the queue and the histogram, a fake clock, started servers.

Every core test takes ``impl`` and so runs once against the C twin
(``prazo.core._queue_c``) and once against the Python twin
(``prazo.core._queue_py``). A missing C twin fails the ``c`` run unless
``PRAZO_NO_EXTENSIONS=1`` asks for the Python twin alone (see
``_helpers.load_twin``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from _helpers import TWIN_NAMES, FakeClock, QueueClass, load_histogram_twin, load_twin
from prazo.core import HistogramTwin

if TYPE_CHECKING:
    # Only for the annotation: the core suite also runs where no server is installed.
    from _server_harness import RunningServer
    from _services import PostgresServer


@pytest.fixture(scope="session", params=TWIN_NAMES)
def impl(request: pytest.FixtureRequest) -> QueueClass:
    """The ``AdmissionQueue`` class of one twin (ids ``c`` and ``py``)."""
    return load_twin(request.param)


@pytest.fixture(scope="session")
def twin_pair() -> tuple[QueueClass, QueueClass]:
    """The C and the Python twin, to be driven in lockstep.

    With ``PRAZO_NO_EXTENSIONS=1`` and no C twin built, the Python twin is
    paired with itself so the lockstep harness and the model still run.
    """
    python_twin = load_twin("py")
    try:
        c_twin = load_twin("c")
    except pytest.skip.Exception:
        return python_twin, python_twin
    return c_twin, python_twin


@pytest.fixture(scope="session", params=TWIN_NAMES)
def hist(request: pytest.FixtureRequest) -> HistogramTwin:
    """One twin's histogram classes (ids ``c`` and ``py``): ``hist.LatencyHistogram``, ``hist.WindowedHistogram``."""
    return load_histogram_twin(request.param)


@pytest.fixture(scope="session")
def hist_pair() -> tuple[HistogramTwin, HistogramTwin]:
    """The C and the Python histogram twins, for lockstep tests (the Python twin twice without the C one)."""
    python_twin = load_histogram_twin("py")
    try:
        c_twin = load_histogram_twin("c")
    except pytest.skip.Exception:
        return python_twin, python_twin
    return c_twin, python_twin


@pytest.fixture
def clock() -> FakeClock:
    """A fresh fake monotonic clock; pass ``clock.ns`` as ``now_ns=``."""
    return FakeClock()


@pytest.fixture
def servers() -> Iterator[list[RunningServer]]:
    """Servers a test starts (append them); whatever is still running at the end is stopped."""
    started: list[RunningServer] = []
    yield started
    for server in started:
        if not server.stopped:
            server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster of this test session's own on loopback (``.dsn``), stopped at the end.

    Imported lazily: the core suite (dist-check) runs without ``_services`` and psycopg.
    """
    from _services import start_postgres

    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()
