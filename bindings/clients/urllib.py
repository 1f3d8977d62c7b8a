"""``deadline_urlopen``: ``urllib.request.urlopen`` that passes the budget downstream."""

from __future__ import annotations

import copy
import socket
import urllib.error
import urllib.request
from typing import Any

from ..outgoing import (
    DEFAULT_MARGIN_MS,
    DownstreamOverloadedResponse,
    downstream_timed_out,
    drop_budget_headers,
    outgoing_budget,
)

__all__ = ["deadline_urlopen"]


def deadline_urlopen(
    url: str | urllib.request.Request,
    data: bytes | None = None,
    *,
    margin_ms: float = DEFAULT_MARGIN_MS,
    timeout: float | None = None,
    grpc: bool = False,
) -> Any:
    """``urllib.request.urlopen`` under the current deadline.

    Under a ``deadline_scope``: sends ``X-Request-Budget-Ms`` = remaining −
    ``margin_ms`` in place of any budget header on the ``Request`` (whose
    value can only shorten it, see ``prazo.bindings.outgoing``); uses the
    smaller of ``timeout`` and that budget (urllib
    applies it to connecting and to each socket read); refuses with
    ``DeadlineExceeded("no-budget-for-downstream")`` before any connection
    when nothing is left; turns an ``HTTPError`` 503 into
    ``DownstreamOverloaded`` (the ``HTTPError`` is on ``.response``) and a
    timeout into ``DeadlineExceeded("deadline-exceeded")``::

        with deadline_scope(Deadline.after(2.0)):
            with deadline_urlopen("http://b.internal/items") as response:
                body = response.read()

    A ``Request`` you pass is copied, never modified. Outside any deadline
    scope this is ``urlopen(url, data, timeout)`` (``None`` = the socket
    default).
    """
    caller_headers = dict(url.header_items()) if isinstance(url, urllib.request.Request) else None
    budget = outgoing_budget(margin_ms, grpc=grpc, headers=caller_headers)
    if budget is None:
        return urllib.request.urlopen(url, data, timeout=socket.getdefaulttimeout() if timeout is None else timeout)
    if isinstance(url, urllib.request.Request):
        request = copy.copy(url)
        request.headers = dict(url.headers)
        request.unredirected_hdrs = dict(url.unredirected_hdrs)
    else:
        request = urllib.request.Request(url)
    drop_budget_headers(request.headers)
    # urllib sends an unredirected header in place of a plain one of the same
    # name, so a budget left there would win over prazo's.
    drop_budget_headers(request.unredirected_hdrs)
    for name, value in budget.headers.items():
        request.add_header(name, value)
    full_url = request.full_url
    try:
        return urllib.request.urlopen(request, data, timeout=budget.cap(timeout))
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            raise DownstreamOverloadedResponse(exc, full_url) from exc
        raise
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise downstream_timed_out(full_url) from exc
        raise
    except TimeoutError as exc:
        raise downstream_timed_out(full_url) from exc
