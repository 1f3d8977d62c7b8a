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
from ..retries import Failure, RetryPolicy, connection_failure, idempotent_request, replayable_body, response_failure

__all__ = ["deadline_urlopen"]


def deadline_urlopen(
    url: str | urllib.request.Request,
    data: bytes | None = None,
    *,
    margin_ms: float = DEFAULT_MARGIN_MS,
    timeout: float | None = None,
    grpc: bool = False,
    retry: RetryPolicy | None = None,
    idempotent: bool | None = None,
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

    ``retry=RetryPolicy(...)`` retries what is safe to retry (see
    ``prazo.bindings.retries``), each attempt with what is left of the
    budget; a POST only with ``idempotent=True``, a file or iterable
    ``data`` never.
    """
    if retry is None:
        return _urlopen_once(url, data, margin_ms, timeout, grpc)
    if not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry must be a prazo RetryPolicy or None, not {type(retry).__name__}")
    policy = retry
    request = url if isinstance(url, urllib.request.Request) else urllib.request.Request(url)
    body = data if data is not None else request.data
    full_url = request.full_url
    retryable_reasons = policy.retryable_reasons

    def attempt(number: int) -> Any:
        moved = policy.url_for_attempt(full_url, number)
        if moved == full_url:
            return _urlopen_once(request, data, margin_ms, timeout, grpc)
        copied = copy.copy(request)
        copied.headers = {name: value for name, value in request.headers.items() if name.lower() != "host"}
        copied.unredirected_hdrs = dict(request.unredirected_hdrs)
        copied.full_url = moved
        return _urlopen_once(copied, data, margin_ms, timeout, grpc)

    def classify(exc: BaseException) -> Failure | None:
        if isinstance(exc, urllib.error.HTTPError):
            # Outside a deadline a 503 is urllib's HTTPError, whose headers are its own.
            if exc.code != 503:
                return None
            return response_failure(DownstreamOverloadedResponse(exc, full_url), retryable_reasons=retryable_reasons)
        failure = response_failure(exc, retryable_reasons=retryable_reasons)
        if failure is not None:
            return failure
        # urlopen returns once the response head is read: whatever it raises
        # (a refused connection, a reset, RemoteDisconnected) came before any of it.
        if isinstance(exc, OSError):
            return connection_failure(exc)
        return None

    return policy.call(
        attempt,
        classify,
        destination=policy.destination_of(full_url),
        idempotent=idempotent_request(request.get_method() if data is None else "POST", idempotent),
        replayable=replayable_body(body),
        discard=_close_response,
    )


def _close_response(exc: BaseException) -> None:
    """Close the connection an HTTPError (or the 503 kept on ``.response``) holds: it will not be read."""
    response = exc if isinstance(exc, urllib.error.HTTPError) else getattr(exc, "response", None)
    if isinstance(response, urllib.error.HTTPError):
        response.close()


def _urlopen_once(
    url: str | urllib.request.Request, data: bytes | None, margin_ms: float, timeout: float | None, grpc: bool
) -> Any:
    """One ``urlopen`` under the current deadline (see ``deadline_urlopen``)."""
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
