"""An app whose views leave by a ``BaseException`` that is no ``Exception`` (issue 33, defect 5).

What ``prazo serve --server prazo`` serves in ``tests/servers/test_frontdoor_app_exit.py``:

``/ok``
    200 with the worker process's id as the body.
``/exit``
    ``sys.exit(3)`` in the view: ``SystemExit``.
``/argparse``
    ``argparse.ArgumentParser.error()`` in the view: ``SystemExit(2)``, as a
    view that parses its query with argparse gets on a bad one.
``/abort``
    ``Abort``, the app's own ``BaseException`` subclass.
``/exit-in-body``
    200 and a streamed body that yields two chunks, then raises ``SystemExit``:
    the first chunk is on the wire by then (the server holds one chunk back to
    learn whether the body is one piece).
``/exit-in-close``
    200 and a whole body whose ``close()`` raises ``SystemExit`` once it was sent.
``/interrupt``
    ``KeyboardInterrupt`` in the view.
``/stats``
    ``environ["prazo.server_stats"]()`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

FIRST_CHUNK = b"first-chunk-of-a-body-that-exits"
CLOSING_BODY = b"a-body-whose-close-exits"


class Abort(BaseException):
    """An app's own way out that is not an ``Exception`` (as gevent's ``GreenletExit`` is)."""


def _exits_after_two_chunks() -> Iterator[bytes]:
    yield FIRST_CHUNK
    yield b"second-chunk"
    sys.exit(4)


class _ExitsOnClose:
    """A response iterable whose ``close()`` (PEP 3333: the server calls it) exits."""

    def __iter__(self) -> Iterator[bytes]:
        yield CLOSING_BODY

    def close(self) -> None:
        sys.exit(5)


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "")
    if path == "/exit":
        sys.exit(3)
    if path == "/argparse":
        argparse.ArgumentParser(prog="view").error("a bad query")
    if path == "/abort":
        raise Abort("the app's own BaseException")
    if path == "/interrupt":
        raise KeyboardInterrupt
    if path == "/exit-in-body":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return _exits_after_two_chunks()
    if path == "/exit-in-close":
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(CLOSING_BODY)))])
        return _ExitsOnClose()
    if path == "/stats":
        body = json.dumps(environ["prazo.server_stats"]()).encode()
    elif path == "/ok":
        body = str(os.getpid()).encode()
    else:
        start_response("404 Not Found", [("Content-Length", "0")])
        return []
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
