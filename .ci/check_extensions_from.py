"""Every compiled module of prazo imports from DIR (the build of .ci/build-extensions-beside), none from elsewhere.

    python .ci/check_extensions_from.py DIR      (with PYTHONPATH=DIR)
"""

import importlib
import sys
from pathlib import Path

COMPILED = (
    "prazo.core._queue_c",
    "prazo.core._histogram_c",
    "prazo.bindings._wsgi_c",
    "prazo.bindings._pool_c",
    "prazo.bindings.servers.frontdoor._engine_c",
    "prazo.bindings.servers.plumbing._heads_c",
)

if __name__ == "__main__":
    directory = Path(sys.argv[1]).resolve()
    elsewhere = {}
    for name in COMPILED:
        where = Path(importlib.import_module(name).__file__).resolve()
        if directory not in where.parents:
            elsewhere[name] = str(where)
    if elsewhere:
        sys.exit(f"compiled modules not from {directory}: {elsewhere}")
    print(f"{len(COMPILED)} compiled modules from {directory}")
