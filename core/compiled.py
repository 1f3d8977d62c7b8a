"""Import a compiled twin, or say loudly that its Python twin runs instead.

A silent fallback would let a slow build pass unnoticed, so every compiled
module of prazo (the queue, the histogram, the middleware's and the pool's
paths) falls back through here, with the same banner.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

__all__ = ["import_compiled", "warn_compiled_missing"]

_BANNER = "!" * 72


def warn_compiled_missing(what: str, exc: ImportError, fallback: str) -> None:
    """The ``RuntimeWarning`` that ``what`` did not import (``exc``) and ``fallback`` runs instead."""
    warnings.warn(
        f"\n{_BANNER}\nprazo: {what} is missing ({exc}); {fallback}.\n"
        f"Rebuild with `make build` (or set PRAZO_NO_EXTENSIONS=1 to silence this).\n{_BANNER}",
        RuntimeWarning,
        stacklevel=3,
    )


def import_compiled(module: str, what: str, fallback: str) -> ModuleType | None:
    """The compiled ``module``, or None after ``warn_compiled_missing`` when it does not import."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the build
        warn_compiled_missing(what, exc, fallback)
        return None
