"""Fixtures shared by the test suite: both twins of the core, a fake clock, started servers.

Every core test runs once against the C twin and once against the Python twin
through one parametrized fixture, ``twin`` (ids ``c`` and ``py``): ``impl``
(its ``AdmissionQueue`` class) and ``hist`` (its histogram classes) are views
of it, so a test that takes both gets the queue and the histogram of the
*same* twin. The ``c`` run carries the ``compiled`` marker (``make sanitize``
selects by it). A missing C twin fails the ``c`` run unless
``PRAZO_NO_EXTENSIONS=1`` asks for the Python twin alone (see
``_helpers.load_twin``). ``lockstep`` gives both twins at once, for the tests
that drive them side by side (``twin_pair`` and ``hist_pair`` are its views).

This is the one conftest: the helpers it imports live in ``tests/support``
(on ``sys.path`` through ``pythonpath`` in ``pyproject.toml``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import pytest
from _helpers import TWIN_NAMES, FakeClock, QueueClass, load_histogram_twin, load_twin
from _required import ALLOWED_SKIPS, in_ci
from hypothesis import settings as hypothesis_settings
from prazo.core import HistogramTwin

# HYPOTHESIS_PROFILE=deep (``make test-deep``) multiplies every property's
# examples by PRAZO_DEEP_FACTOR (default ten): the tests size their runs with
# ``_helpers.examples(n)``, which reads the profile's max_examples / 100.
_DEEP_FACTOR = int(os.environ.get("PRAZO_DEEP_FACTOR", "10"))
hypothesis_settings.register_profile("deep", max_examples=100 * _DEEP_FACTOR, deadline=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

if TYPE_CHECKING:
    # Only for the annotation: the core suite also runs where no server is installed.
    from _server_harness import RunningServer
    from _services import PostgresServer


class Twin(NamedTuple):
    """One twin of the core: its name (``"c"`` or ``"py"``), its queue class and its histogram classes."""

    name: str
    queue: QueueClass
    histogram: HistogramTwin


def _load(name: str) -> Twin:
    return Twin(name, load_twin(name), load_histogram_twin(name))


@pytest.fixture(
    scope="session",
    params=[
        pytest.param(name, marks=pytest.mark.compiled if name == "c" else pytest.mark.python_twin)
        for name in TWIN_NAMES
    ],
)
def twin(request: pytest.FixtureRequest) -> Twin:
    """One twin of the core (ids ``c`` and ``py``); the ``c`` run is marked ``compiled``, the ``py`` one ``python_twin``."""
    return _load(request.param)


@pytest.fixture(scope="session")
def impl(twin: Twin) -> QueueClass:
    """The ``AdmissionQueue`` class of one twin (ids ``c`` and ``py``)."""
    return twin.queue


@pytest.fixture(scope="session")
def hist(twin: Twin) -> HistogramTwin:
    """One twin's histogram classes (ids ``c`` and ``py``): ``hist.LatencyHistogram``, ``hist.WindowedHistogram``."""
    return twin.histogram


@pytest.fixture(scope="session")
def lockstep() -> tuple[Twin, Twin]:
    """The C and the Python twin, to be driven in lockstep.

    With ``PRAZO_NO_EXTENSIONS=1`` and no C twin built, the Python twin is
    paired with itself so the lockstep harness and the model still run.
    """
    python_twin = _load("py")
    try:
        c_twin = _load("c")
    except pytest.skip.Exception:
        return python_twin, python_twin
    return c_twin, python_twin


@pytest.fixture(scope="session")
def twin_pair(lockstep: tuple[Twin, Twin]) -> tuple[QueueClass, QueueClass]:
    """The C and the Python queue classes of ``lockstep``."""
    return lockstep[0].queue, lockstep[1].queue


@pytest.fixture(scope="session")
def hist_pair(lockstep: tuple[Twin, Twin]) -> tuple[HistogramTwin, HistogramTwin]:
    """The C and the Python histogram twins of ``lockstep``."""
    return lockstep[0].histogram, lockstep[1].histogram


@pytest.fixture
def clock() -> FakeClock:
    """A fresh fake monotonic clock; pass ``clock.ns`` as ``now_ns=``."""
    return FakeClock()


@pytest.fixture(
    params=[pytest.param("compiled", marks=pytest.mark.compiled), pytest.param("python", marks=pytest.mark.python_twin)]
)
def runner_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Front doors created in the test serve on the compiled request loop, then on its Python specification.

    ``prazo.bindings.servers.frontdoor.runner.use_compiled_path``: the choice is
    made when a server is created, so a test's servers keep it to the end. The
    ``python`` run is marked ``python_twin``, as the core's: ``make tsan`` leaves it out.
    """
    from _required import require_compiled
    from prazo.bindings.servers.frontdoor import runner

    compiled = request.param == "compiled"
    if compiled:
        require_compiled("prazo.bindings.servers.frontdoor._engine_c")
    previous = runner.use_compiled_path(compiled)
    yield request.param
    runner.use_compiled_path(previous)


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


# -- no unexplained skip in CI ------------------------------------------------------

_unjustified_skips: list[str] = []


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under ``CI=true`` remember every skip that ``_required.ALLOWED_SKIPS`` does not justify."""
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return
    reason = _skip_reason(report)
    if not any(allowed in reason for allowed in ALLOWED_SKIPS):
        _unjustified_skips.append(f"{report.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _unjustified_skips:
        terminalreporter.section("skips CI does not allow (tests/support/_required.py ALLOWED_SKIPS)", red=True)
        for line in _unjustified_skips:
            terminalreporter.line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unjustified_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts (``prazo serve``, ...): any still running at the end is killed and reaped."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(30)
