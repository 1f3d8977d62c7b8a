"""prazo.core — admission control with monotonic-clock deadlines.

The hot path has two twins with one API: the C ring buffer
(``prazo.core._queue_c``, built with Cython) and the pure-Python
specification (``prazo.core._queue_py``). This module picks the C twin, or
the Python twin when ``PRAZO_NO_EXTENSIONS=1`` is set, on interpreters other
than CPython, or when the extension was not built (with a loud warning, so a
silent slowdown never goes unnoticed). ``IMPLEMENTATION`` says which one won,
``extension_wanted()`` whether the C twin was asked for, and ``load_twin(name)``
gives either twin by name, for the tests and benchmarks that drive both.

The latency histogram (``LatencyHistogram``, ``WindowedHistogram``) has twins
too, ``prazo.core._histogram_c`` and ``prazo.core._histogram_py``, picked by the
same rule (both or neither come from C: ``IMPLEMENTATION`` holds for both);
``load_histogram_twin(name)`` gives either pair by name.

``__version__`` is the installed distribution's version (``prazo`` itself is
a namespace package, so it has no module to carry one).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import NamedTuple

from ._policy_py import DEFAULT_CODEL_INTERVAL_MS, DEFAULT_CODEL_TARGET_MS, codel_option_ns, expected_service_option
from .arguments import env_flag
from .compiled import warn_compiled_missing
from .deadline import (
    NS_PER_MS,
    NS_PER_SECOND,
    Deadline,
    current_deadline,
    deadline_context,
    deadline_scope,
    deadline_var,
)
from .errors import (
    REASON_BAD_REQUEST,
    REASON_BREAKER_OPEN,
    REASON_BULKHEAD_FULL,
    REASON_DEADLINE_EXCEEDED,
    REASON_DEPENDENCY_TIMEOUT,
    REASON_DEPENDENCY_UNAVAILABLE,
    REASON_DOWNSTREAM_OVERLOADED,
    REASON_EVICTED,
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    REASON_HEAD_TOO_LARGE,
    REASON_HEADER_TIMEOUT,
    REASON_INSUFFICIENT_BUDGET,
    REASON_NO_BUDGET_FOR_DOWNSTREAM,
    REASON_QUEUE_FULL,
    REASON_SHED,
    REASON_SHUTTING_DOWN,
    REASON_THROTTLED_LOCALLY,
    REASONS,
    DeadlineExceeded,
    DownstreamOverloaded,
    QueueFull,
    Reason,
    ShutDown,
)

__all__ = [
    "DEFAULT_CODEL_INTERVAL_MS",
    "DEFAULT_CODEL_TARGET_MS",
    "IMPLEMENTATION",
    "NS_PER_MS",
    "NS_PER_SECOND",
    "REASONS",
    "REASON_BAD_REQUEST",
    "REASON_BREAKER_OPEN",
    "REASON_BULKHEAD_FULL",
    "REASON_DEADLINE_EXCEEDED",
    "REASON_DEPENDENCY_TIMEOUT",
    "REASON_DEPENDENCY_UNAVAILABLE",
    "REASON_DOWNSTREAM_OVERLOADED",
    "REASON_EVICTED",
    "REASON_EXPIRED_IN_QUEUE",
    "REASON_EXPIRED_ON_ARRIVAL",
    "REASON_HEADER_TIMEOUT",
    "REASON_HEAD_TOO_LARGE",
    "REASON_INSUFFICIENT_BUDGET",
    "REASON_NO_BUDGET_FOR_DOWNSTREAM",
    "REASON_QUEUE_FULL",
    "REASON_SHED",
    "REASON_SHUTTING_DOWN",
    "REASON_THROTTLED_LOCALLY",
    "TWINS",
    "AdmissionQueue",
    "Deadline",
    "DeadlineExceeded",
    "DownstreamOverloaded",
    "HistogramTwin",
    "LatencyHistogram",
    "QueueFull",
    "Reason",
    "ShutDown",
    "WindowedHistogram",
    "codel_option_ns",
    "current_deadline",
    "deadline_context",
    "deadline_scope",
    "deadline_var",
    "expected_service_option",
    "extension_wanted",
    "load_histogram_twin",
    "load_twin",
]

# The version of the installed distribution: pyproject.toml's [project] version is the one source.
try:
    __version__ = metadata.version("prazo")
except metadata.PackageNotFoundError:  # a tree that was never installed
    __version__ = "unknown"

# The names of the two twins, as ``IMPLEMENTATION`` and ``load_twin`` spell them.
TWINS = ("c", "py")


def extension_wanted() -> bool:
    """True when this interpreter should run the C twin.

    False with ``PRAZO_NO_EXTENSIONS=1`` (or ``true``/``yes``/``on``; a
    word that is not a yes or a no raises ``ValueError``) and on
    interpreters other than CPython. When it is True but ``IMPLEMENTATION``
    is ``"py"``, the extension was wanted and failed to load: a broken build,
    which a test suite must report instead of quietly testing the twin twice.
    """
    return not env_flag(os.environ, "PRAZO_NO_EXTENSIONS") and sys.implementation.name == "cpython"


if extension_wanted():
    try:
        from ._histogram_c import LatencyHistogram, WindowedHistogram
        from ._queue_c import AdmissionQueue
    except ImportError as exc:  # pragma: no cover - depends on the build
        warn_compiled_missing("the C extension", exc, "using the pure-Python twin")
        from ._histogram_py import LatencyHistogram, WindowedHistogram  # type: ignore[assignment]
        from ._queue_py import AdmissionQueue  # type: ignore[assignment]

        IMPLEMENTATION = "py"
    else:
        IMPLEMENTATION = "c"
else:
    from ._histogram_py import LatencyHistogram, WindowedHistogram  # type: ignore[assignment]
    from ._queue_py import AdmissionQueue  # type: ignore[assignment]

    IMPLEMENTATION = "py"


def load_twin(name: str) -> type[AdmissionQueue]:
    """The ``AdmissionQueue`` class of the twin ``name`` (``"c"`` or ``"py"``), whichever one won.

    For tests and benchmarks that compare or cross-check the twins. Nothing
    falls back here: asking for the C twin when it was not built raises
    ``ImportError``, even with ``PRAZO_NO_EXTENSIONS=1``.
    """
    if name == "c":
        from ._queue_c import AdmissionQueue as c_twin

        return c_twin
    if name == "py":
        from ._queue_py import AdmissionQueue as python_twin

        return python_twin  # type: ignore[return-value]
    raise ValueError(f"name must be one of {', '.join(TWINS)}, got {name!r}")


class HistogramTwin(NamedTuple):
    """One twin's histogram classes, as ``load_histogram_twin`` returns them."""

    LatencyHistogram: type[LatencyHistogram]
    WindowedHistogram: type[WindowedHistogram]


def load_histogram_twin(name: str) -> HistogramTwin:
    """The histogram classes of the twin ``name`` (``"c"`` or ``"py"``), like ``load_twin``.

    Nothing falls back here either: the C twin unbuilt raises ``ImportError``.
    """
    if name == "c":
        from ._histogram_c import LatencyHistogram as c_latency
        from ._histogram_c import WindowedHistogram as c_windowed

        return HistogramTwin(c_latency, c_windowed)
    if name == "py":
        from ._histogram_py import LatencyHistogram as python_latency
        from ._histogram_py import WindowedHistogram as python_windowed

        return HistogramTwin(python_latency, python_windowed)  # type: ignore[arg-type]
    raise ValueError(f"name must be one of {', '.join(TWINS)}, got {name!r}")
