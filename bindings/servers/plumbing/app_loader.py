"""``load_app``: the WSGI app a ``MODULE:APP`` spec names, imported as ``prazo serve`` and a host's workers do.

One small module both use: the command imports the app (or a host's
supervisor does, with ``--preload``), and each worker process of a host
imports it itself otherwise. On a free-threaded CPython the import is watched:
an extension that turns the GIL back on is named in the log
(``prazo.bindings.freethreading``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ...freethreading import gil_state, log_gil_state, watch_imports
from ...wsgi import WSGIApp

__all__ = ["load_app", "split_app_spec"]


def split_app_spec(spec: str) -> tuple[str, str]:
    """``MODULE:APP`` as its two parts; ``ValueError`` when it is not of that shape."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"app must look like MODULE:APP, got {spec!r}")
    return module_name, attribute


def load_app(spec: str) -> WSGIApp:
    """Import ``module:attribute`` (dotted attributes allowed) from the current directory or ``sys.path``."""
    module_name, attribute = split_app_spec(spec)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with watch_imports() as enabled_gil:
            target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from exc
    log_gil_state(gil_state(tuple(enabled_gil)), spec)
    for name in attribute.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attribute!r}") from None
    if not callable(target):
        raise TypeError(f"{spec} is not a WSGI callable (got {type(target).__name__})")
    return target  # type: ignore[no-any-return]
