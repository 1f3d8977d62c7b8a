"""gRPC (grpcio, sync API), the client side: budgets on every call.

``DeadlineClientInterceptor`` (``grpc.intercept_channel``) sets
each call's ``timeout`` to the current budget minus the margin (the smaller
of that and the caller's own timeout, see ``prazo.bindings.outgoing``),
refuses to call when nothing is left (``DeadlineExceeded``,
``no-budget-for-downstream``), and turns ``RESOURCE_EXHAUSTED`` /
``UNAVAILABLE`` into ``DownstreamOverloaded`` and ``DEADLINE_EXCEEDED`` into
``DeadlineExceeded`` — both also ``grpc.RpcError``, with ``code()`` and
``details()`` of the original. Outside any deadline scope it changes nothing.

With ``retry=RetryPolicy(...)`` a unary-request, unary-response call that
failed with ``RESOURCE_EXHAUSTED`` or ``UNAVAILABLE`` (and no
``x-prazo-reason`` saying work was done) is retried within the deadline and
the target's retry budget, each attempt with what is left of the budget; a
``grpc-retry-pushback-ms`` trailer is its ``Retry-After``. Only methods the
caller declares idempotent are retried (``idempotent=True`` for all, or a
collection of full method names); streamed requests and responses never.

gRPC's own retries (the service config's ``retryPolicy``, with its
``retryThrottling`` token bucket: ``maxTokens``, ``tokenRatio``) work per
channel and know nothing of prazo's deadline budget: turn them off
(``grpc.enable_retries`` = 0 in the channel options) when this interceptor
retries, or the two multiply. Left on without ``retry=`` here, gRPC's
throttling is the budget, and a retry it makes carries the call's original
deadline, which grpc itself never extends.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import grpc
from prazo.bindings.headers import format_budget_ms
from prazo.bindings.outgoing import DEFAULT_MARGIN_MS, downstream_timed_out, outgoing_budget, validate_margin_ms
from prazo.bindings.retries import Failure, RetryPolicy, overloaded_failure
from prazo.core import DeadlineExceeded, DownstreamOverloaded

from .metadata import BUDGET_KEY, BUDGET_KEYS, PUSHBACK_KEY, REASON_METADATA_KEY, budget_fields

__all__ = ["PUSHBACK_KEY", "DeadlineClientInterceptor", "DeadlineExceededRpcError", "DownstreamOverloadedRpcError"]

# What a client reads as a 503 ("overloaded, retry elsewhere"), never as a 504.
_OVERLOADED_CODES = frozenset((grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE))


class _RpcErrorView:
    """``grpc.RpcError``'s accessors, answered by the original error on ``.rpc_error``."""

    rpc_error: grpc.RpcError

    def code(self) -> Any:
        return self.rpc_error.code()

    def details(self) -> Any:
        return self.rpc_error.details()

    def initial_metadata(self) -> Any:
        return self.rpc_error.initial_metadata()

    def trailing_metadata(self) -> Any:
        return self.rpc_error.trailing_metadata()


class DownstreamOverloadedRpcError(_RpcErrorView, DownstreamOverloaded, grpc.RpcError):
    """The server answered ``RESOURCE_EXHAUSTED`` or ``UNAVAILABLE``: a 503 (retry elsewhere).

    Also a ``grpc.RpcError``: ``code()``, ``details()`` and the metadata are
    the original's, which is on ``.rpc_error``.
    """

    def __init__(self, rpc_error: grpc.RpcError, method: str) -> None:
        super().__init__(message=f"{method} answered {_code_name(rpc_error)}: {_details(rpc_error)}")
        self.rpc_error = rpc_error

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # The RPC error (a live call) does not pickle; the reason does.
        return (DownstreamOverloaded, (self.reason, str(self)))


class DeadlineExceededRpcError(_RpcErrorView, DeadlineExceeded, grpc.RpcError):
    """The server answered ``DEADLINE_EXCEEDED`` (or the call's timeout ran out): a 504.

    Also a ``grpc.RpcError``, like ``DownstreamOverloadedRpcError``.
    """

    def __init__(self, rpc_error: grpc.RpcError, method: str) -> None:
        base = downstream_timed_out(method)
        super().__init__(base.reason, str(base))
        self.rpc_error = rpc_error

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (DeadlineExceeded, (self.reason, str(self)))


def _code_name(rpc_error: grpc.RpcError) -> str:
    code = getattr(rpc_error, "code", None)
    status = code() if callable(code) else None
    return getattr(status, "name", str(status))


def _details(rpc_error: grpc.RpcError) -> str:
    details = getattr(rpc_error, "details", None)
    return str(details() if callable(details) else "")


def _mapped(exc: BaseException, method: str) -> BaseException:
    """The prazo error for an RPC error, or ``exc`` itself."""
    unmapped = exc  # grpc ships no types: isinstance(exc, grpc.RpcError) would make exc Any
    if not isinstance(exc, grpc.RpcError) or isinstance(exc, (DownstreamOverloaded, DeadlineExceeded)):
        return exc
    code = getattr(exc, "code", None)
    status = code() if callable(code) else None
    if status in _OVERLOADED_CODES:
        return DownstreamOverloadedRpcError(exc, method)
    if status is grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededRpcError(exc, method)
    return unmapped


def _trailer(rpc_error: Any, key: str) -> str | None:
    trailing = getattr(rpc_error, "trailing_metadata", None)
    for name, value in (trailing() if callable(trailing) else None) or ():
        if isinstance(name, str) and name.lower() == key:
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None


def rpc_failure(exc: BaseException, retryable_reasons: frozenset[str]) -> Failure | None:
    """The retry ``Failure`` of a call's error: overloaded, a missed deadline, or None (not retryable)."""
    if isinstance(exc, DeadlineExceeded):
        return Failure("deadline", None, exc.reason)
    if not isinstance(exc, DownstreamOverloadedRpcError):
        return None
    pushback = _trailer(exc.rpc_error, PUSHBACK_KEY)
    if isinstance(pushback, str) and pushback.strip().startswith("-") and pushback.strip()[1:].isdigit():
        return Failure("other", None, "pushback")  # the server said: do not retry
    # In ms, as it came: whole seconds would round a short pushback away.
    return overloaded_failure(
        _trailer(exc.rpc_error, REASON_METADATA_KEY), None, retryable_reasons=retryable_reasons, retry_after_ms=pushback
    )


class _CallDetails(
    NamedTuple(
        "_CallDetails",
        [
            ("method", str),
            ("timeout", float | None),
            ("metadata", Any),
            ("credentials", Any),
            ("wait_for_ready", Any),
            ("compression", Any),
        ],
    ),
    grpc.ClientCallDetails,
):
    pass


class _MappedCall(grpc.Call, grpc.Future):
    """A call (unary response) whose RPC errors come out as prazo errors."""

    def __init__(self, call: Any, method: str) -> None:
        self._call = call
        self._method = method

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._call.result(timeout)
        except grpc.RpcError as exc:
            mapped = _mapped(exc, self._method)
            if mapped is exc:
                raise
            raise mapped from exc

    def exception(self, timeout: float | None = None) -> Any:
        exc = self._call.exception(timeout)
        return exc if exc is None else _mapped(exc, self._method)

    def traceback(self, timeout: float | None = None) -> Any:
        return self._call.traceback(timeout)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self._call.add_done_callback(lambda _call: fn(self))

    def cancel(self) -> bool:
        return bool(self._call.cancel())

    def cancelled(self) -> bool:
        return bool(self._call.cancelled())

    def running(self) -> bool:
        return bool(self._call.running())

    def done(self) -> bool:
        return bool(self._call.done())

    def is_active(self) -> bool:
        return bool(self._call.is_active())

    def time_remaining(self) -> Any:
        return self._call.time_remaining()

    def add_callback(self, callback: Callable[[], None]) -> Any:
        return self._call.add_callback(callback)

    def initial_metadata(self) -> Any:
        return self._call.initial_metadata()

    def trailing_metadata(self) -> Any:
        return self._call.trailing_metadata()

    def code(self) -> Any:
        return self._call.code()

    def details(self) -> Any:
        return self._call.details()

    def __getattr__(self, name: str) -> Any:
        # debug_error_string() and whatever else a grpc release adds.
        return getattr(self._call, name)


class _MappedStream(_MappedCall):
    """A streamed response whose RPC errors come out of iteration as prazo errors."""

    def __iter__(self) -> _MappedStream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            mapped = _mapped(exc, self._method)
            if mapped is exc:
                raise
            raise mapped from exc


class DeadlineClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """A client interceptor passing the remaining budget as each call's gRPC deadline.

    Under a ``deadline_scope`` every call (all four kinds):

    * gets ``timeout`` = remaining − ``margin_ms``, or the caller's own
      ``timeout`` when that is smaller, and the same budget (whole ms, rounded
      down) in the metadata ``x-request-budget-ms``, because grpc rounds the
      wire ``grpc-timeout`` up; budget fields the caller put in the metadata
      can shorten it, never lengthen it, and are replaced;
    * is not made when nothing is left: ``DeadlineExceeded``
      (``no-budget-for-downstream``), raised by the call — by iterating it
      for a streamed response, as grpc reports interceptor errors there;
    * fails with ``DownstreamOverloadedRpcError`` (a ``DownstreamOverloaded``)
      on ``RESOURCE_EXHAUSTED``/``UNAVAILABLE`` and ``DeadlineExceededRpcError``
      (a ``DeadlineExceeded``) on ``DEADLINE_EXCEEDED``, both ``grpc.RpcError``.

    ::

        channel = grpc.intercept_channel(grpc.insecure_channel(target), DeadlineClientInterceptor())
        with deadline_scope(Deadline.after(2.0)):
            reply = channel.unary_unary("/pkg.Service/Method")(request)

    Outside any deadline scope calls are left exactly as they are.

    ``retry=RetryPolicy(...)`` with ``idempotent=`` (True, or the full names
    of the methods that may be sent twice) retries unary calls (see the
    module docstring); such a call is resolved inside the interceptor, so
    its ``future()`` returns once the last attempt has finished.
    """

    def __init__(
        self,
        *,
        margin_ms: float = DEFAULT_MARGIN_MS,
        retry: RetryPolicy | None = None,
        idempotent: bool | Collection[str] = False,
    ) -> None:
        self.margin_ms = validate_margin_ms(margin_ms)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a prazo RetryPolicy or None, not {type(retry).__name__}")
        self.retry = retry
        if isinstance(idempotent, bool):
            self._idempotent_all = idempotent
            self._idempotent_methods: frozenset[str] = frozenset()
        elif isinstance(idempotent, str) or not isinstance(idempotent, Collection):
            raise TypeError(
                f"idempotent must be a bool or a collection of method names, not {type(idempotent).__name__}"
            )
        else:
            self._idempotent_all = False
            self._idempotent_methods = frozenset(idempotent)

    def _is_idempotent(self, method: str) -> bool:
        return self._idempotent_all or method in self._idempotent_methods

    def _budgeted(self, details: grpc.ClientCallDetails) -> _CallDetails | None:
        metadata = details.metadata
        budget = outgoing_budget(self.margin_ms, headers=budget_fields(metadata))
        if budget is None:
            return None
        kept = [(key, value) for key, value in metadata or () if key.lower() not in BUDGET_KEYS]
        # The budget also goes in the metadata, in whole ms rounded down: grpc
        # rounds the wire grpc-timeout *up* (to 10 ms from 1 s on) and a
        # receiver's gRPC deadline came out up to ~10 ms later than the
        # caller's; a prazo server takes the smaller of the two.
        timeout_s = budget.cap(details.timeout)
        kept.append((BUDGET_KEY, format_budget_ms(timeout_s * 1000.0)))
        return _CallDetails(
            details.method,
            timeout_s,
            kept,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def _intercept(self, continuation: Any, client_call_details: Any, request: Any, mapped: type[_MappedCall]) -> Any:
        details = self._budgeted(client_call_details)
        if details is None:
            return continuation(client_call_details, request)
        return mapped(continuation(details, request), details.method)

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        policy = self.retry
        if policy is None:
            return self._intercept(continuation, client_call_details, request, _MappedCall)
        method = client_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        retryable_reasons = policy.retryable_reasons

        last: list[Any] = []

        def attempt(number: int) -> Any:
            call = self._intercept(continuation, client_call_details, request, _MappedCall)
            error = call.exception()  # waits for the answer: the retry decision needs it
            if error is not None:
                last[:] = [call]
                raise error
            return call

        try:
            return policy.call(
                attempt,
                lambda exc: rpc_failure(exc, retryable_reasons),
                destination=method,
                idempotent=self._is_idempotent(method),
                replayable=True,
            )
        except Exception:
            if not last:
                raise
            # grpc hands an interceptor's answer back as a call object: the
            # last attempt's, which raises its (mapped) error as without retry.
            return last[0]

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self._intercept(continuation, client_call_details, request_iterator, _MappedCall)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return self._intercept(continuation, client_call_details, request, _MappedStream)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self._intercept(continuation, client_call_details, request_iterator, _MappedStream)
