"""prazo.bench — what measures prazo; no service imports it.

The runners behind ``prazo bench`` (``core``, ``wsgi``, ``pool``, ``servers``)
with their shared timing and report helpers (``harness``), the seed scenarios
as demos behind ``prazo demo`` (``demo_core``, ``demo_cascade``), the
``prazo`` command itself (``cli``), the pytest-benchmark suites
(``test_bench_*.py``, ``make bench``) and ``RESULTS.md``. It imports
``prazo.core`` and ``prazo.bindings``; neither imports it.
"""
