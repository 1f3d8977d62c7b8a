"""Coverage-guided fuzz targets (atheris) for everything that parses client input.

=====================  ========================================================
target                 what it feeds
=====================  ========================================================
``fuzz_headers``       the three budget headers and ``BudgetPolicy``
``fuzz_proxy_headers`` ``X-Request-Start`` / ``X-Queue-Start``, trusted proxies
``fuzz_server_head``   raw request bytes, as the socket-level servers peek them
``fuzz_middleware``    ``AdmissionMiddleware`` (compiled and Python paths, both
                       twins) with arbitrary environs and misbehaving apps
=====================  ========================================================

Each module's docstring lists the properties it asserts; ``_common`` describes
the input format the text targets share. Every target exposes
``test_one_input(data: bytes)``, which needs no atheris.

Running them::

    make fuzz                    # each target FUZZ_SECONDS (default 60), installs atheris
    make fuzz FUZZ_SECONDS=600
    make fuzz-ci                 # all targets within a minute; CI runs this
    PYTHONPATH=tests .venv/bin/python -m fuzz middleware -max_total_time=30 \\
        -dict=tests/fuzz/tokens.dict build/fuzz/corpus/middleware tests/fuzz/corpus/middleware
    PYTHONPATH=tests .venv/bin/python -m fuzz headers CRASH_FILE     # replay one input

A crash leaves its input in ``build/fuzz/crashes/`` (git-ignored), and so does
an input that runs longer than ``-timeout`` (``timeout-*``; ``make`` passes
``FUZZ_TIMEOUT``, 3 s); ``make fuzz-ci`` prints each in base64 when it fails.
``python -m fuzz`` saves the input and aborts at once on an uncaught exception
(``_runner`` says why atheris's own way could lose it). To keep it
as a regression: minimise it (``-minimize_crash=1 -runs=10000 CRASH_FILE``),
copy it into ``tests/fuzz/corpus/TARGET/`` under a name that says what it
exercises, and fix the code; ``tests/repo/test_fuzz_corpus.py`` replays every seed
through its target in the normal test suite, without atheris.
"""
