"""gRPC (grpcio, sync API), the server side: deadlines and admission.

Three pieces that work together::

    pool = AdmissionPool(max_workers=8, max_queue=32)
    server = admission_server(pool)            # grpc.server(AdmissionExecutor(pool), interceptors=[...])
    server.add_generic_rpc_handlers(...)

* ``DeadlineServerInterceptor`` runs every handler inside ``deadline_scope``
  with the RPC's deadline: the earlier of the gRPC deadline (the caller's
  ``timeout``, ``grpc-timeout`` on the wire, what ``context.time_remaining()``
  reports) and a budget in the metadata (``x-request-budget-ms``,
  ``x-envoy-expected-rq-timeout-ms``), counted from the RPC's arrival,
  capped at ``max_budget_ms``. A handler that lets ``DeadlineExceeded`` out
  answers ``DEADLINE_EXCEEDED``; ``DownstreamOverloaded`` answers
  ``UNAVAILABLE`` and ``QueueFull`` answers ``RESOURCE_EXHAUSTED`` (a 503
  stays a 503). Every refusal names its reason in the trailing metadata
  ``x-prazo-reason``.
* ``AdmissionExecutor`` wraps an ``AdmissionPool`` for ``grpc.server``. A
  plain pool cannot be passed as it is: grpc's serving thread calls
  ``executor.submit`` and does not catch what it raises, so the pool's
  ``QueueFull`` kills that thread — the refused RPC hangs until its client
  gives up and the server never serves another one. The adapter never raises
  into grpc: a full pool answers ``RESOURCE_EXHAUSTED`` at once, and an RPC
  whose deadline passes while it waits in line is answered
  ``DEADLINE_EXCEEDED`` at that deadline, its handler never called. Those
  answers are sent from a small refusal thread (``refusal_threads``), never
  from a pool worker, so they need no slot.
* ``admission_server(pool, ...)`` builds the ``grpc.Server`` with both.

How the executor learns the RPC's deadline before the handler runs: grpc
(1.6x and later) runs interceptors in the RPC's own ``contextvars.Context``
and submits ``that_context.run`` to the executor, so the interceptor leaves a
ticket in that context and the executor reads it from ``fn.__self__``; the
gRPC deadline comes from the submitted call's ``call_details``. If a grpc
release stops doing either, the handler still gets its deadline from
``context.time_remaining()`` when it starts (so an expired RPC is still never
handled); only the refusal at the deadline while queued is lost, and the
tests of this module fail loudly.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from prazo.bindings.headers import MAX_WIRE_MS, BudgetPolicy, IncomingBudget, budget_from_headers
from prazo.bindings.pool import AdmissionPool
from prazo.core import (
    NS_PER_MS,
    REASON_EXPIRED_IN_QUEUE,
    REASON_SHUTTING_DOWN,
    REASONS,
    Deadline,
    DeadlineExceeded,
    DownstreamOverloaded,
    QueueFull,
    deadline_context,
    deadline_scope,
)
from prazo.core.arguments import checked_ms

from .metadata import PUSHBACK_KEY, REASON_METADATA_KEY, budget_fields

__all__ = [
    "REASON_METADATA_KEY",
    "AdmissionExecutor",
    "DeadlineServerInterceptor",
    "RpcBudgetPolicy",
    "admission_server",
    "metadata_budget",
]

T = TypeVar("T")

_LOGGER = logging.getLogger(__name__)

_NO_BUDGET = IncomingBudget(None, 0, None)
# grpc reports "no deadline" as a remaining time of about 9.2e18 s; anything
# beyond what a budget can hold is that.
_NO_DEADLINE_S = MAX_WIRE_MS / 1000.0
_INT64_MAX = 2**63 - 1


def metadata_budget(metadata: Sequence[tuple[str, Any]] | None) -> IncomingBudget:
    """The budget in gRPC metadata, judged by the HTTP rules (smallest valid value wins)."""
    fields = budget_fields(metadata)
    return _NO_BUDGET if fields is None else budget_from_headers(fields)


class _Ticket:
    """One RPC's admission state, left by the interceptor in the RPC's context."""

    __slots__ = ("arrival_ns", "deadline", "incoming", "policy", "refusal", "resolved", "retry_after_ns", "started")

    def __init__(self, arrival_ns: int, incoming: IncomingBudget, policy: RpcBudgetPolicy) -> None:
        self.arrival_ns = arrival_ns
        self.incoming = incoming
        self.policy = policy
        self.deadline: Deadline | None = None
        self.resolved = False
        # Set by the executor when the pool refused the RPC: the handler then
        # answers it, with the pool's measured wait for an overload refusal.
        self.refusal: BaseException | None = None
        self.retry_after_ns = 0
        self.started = False

    def resolve(self, grpc_remaining_s: float | None, now_ns: int) -> Deadline | None:
        """Fix the deadline from the gRPC deadline (``grpc_remaining_s`` at ``now_ns``) and the metadata."""
        self.deadline = self.policy.deadline(self.arrival_ns, self.incoming, grpc_remaining_s, now_ns)
        self.resolved = True
        return self.deadline


class RpcBudgetPolicy:
    """An RPC's deadline from its gRPC deadline and metadata budget: ``BudgetPolicy`` rules for gRPC.

    ``deadline(arrival_ns, incoming, grpc_remaining_s, now_ns)`` is ``arrival
    + min(gRPC deadline, incoming budget)``, or ``arrival +
    default_budget_ms`` when neither is given (None when that is None too),
    capped at ``arrival + max_budget_ms`` (None: no cap); a passed gRPC
    deadline gives a deadline already passed. ``grpc_remaining_s`` is what
    grpc reported left at ``now_ns`` (None, or grpc's huge "no deadline": none).
    """

    __slots__ = ("_default", "_policy")

    def __init__(self, *, default_budget_ms: float | None = None, max_budget_ms: float | None = None) -> None:
        if default_budget_ms is not None:
            checked_ms(default_budget_ms, "default_budget_ms", positive=True)
        if max_budget_ms is not None:
            checked_ms(max_budget_ms, "max_budget_ms", positive=True)
        self._default = default_budget_ms is not None
        self._policy = BudgetPolicy(
            default_budget_ms=MAX_WIRE_MS if default_budget_ms is None else default_budget_ms,
            max_budget_ms=MAX_WIRE_MS if max_budget_ms is None else max_budget_ms,
        )

    def deadline(
        self, arrival_ns: int, incoming: IncomingBudget, grpc_remaining_s: float | None, now_ns: int
    ) -> Deadline | None:
        budget_ms = incoming.budget_ms
        if grpc_remaining_s is not None and grpc_remaining_s < _NO_DEADLINE_S:
            # The gRPC deadline as a budget counted from arrival, like the metadata's.
            grpc_ms = grpc_remaining_s * 1000.0 + (now_ns - arrival_ns) / NS_PER_MS
            if budget_ms is None or grpc_ms < budget_ms:
                budget_ms = grpc_ms
        if budget_ms is None and not self._default:
            return None
        granted = self._policy.budget_ms_for(IncomingBudget(budget_ms, incoming.invalid, incoming.source))
        # Saturate: a budget of centuries is "no practical deadline", never an error.
        return Deadline.at_ns(min(arrival_ns + int(granted * NS_PER_MS), _INT64_MAX))


_ticket: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar("prazo.grpc.ticket", default=None)


def _status_for(exc: BaseException) -> grpc.StatusCode:
    """The registry's gRPC status of ``exc``'s reason; by its class for a reason of the application's own."""
    known = REASONS.get(getattr(exc, "reason", None) or "")
    if known is not None and known.grpc_code is not None:
        return grpc.StatusCode[known.grpc_code]
    if isinstance(exc, DeadlineExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.UNAVAILABLE


def _abort(context: grpc.ServicerContext, exc: BaseException, retry_after_ns: int = 0) -> None:
    """Answer the RPC with the status of a prazo refusal; raises, as ``context.abort`` does.

    An overload refusal by the pool (``QueueFull``) carries the line's
    measured wait ``retry_after_ns`` (when > 0) as ``grpc-retry-pushback-ms``,
    the HTTP ``Retry-After`` of gRPC's retry policy and of prazo's client.
    """
    reason = getattr(exc, "reason", None) or type(exc).__name__
    trailers: tuple[tuple[str, str], ...] = ((REASON_METADATA_KEY, reason),)
    if retry_after_ns > 0 and isinstance(exc, QueueFull):
        trailers += ((PUSHBACK_KEY, str(-(-retry_after_ns // 1_000_000))),)
    context.set_trailing_metadata(trailers)
    context.abort(_status_for(exc), str(exc))


_PRAZO_ERRORS = (DeadlineExceeded, DownstreamOverloaded, QueueFull)


class DeadlineServerInterceptor(grpc.ServerInterceptor):
    """Runs each handler inside ``deadline_scope`` with its RPC's deadline; answers prazo's errors.

    Effects, per RPC:

    * the deadline is ``arrival + min(gRPC deadline, metadata budget)``, or
      ``arrival + default_budget_ms`` when the caller set neither (None, the
      default: no deadline, as gRPC means it), capped at ``arrival +
      max_budget_ms`` (None: no cap);
    * an RPC whose deadline has passed when its handler would start is
      answered ``DEADLINE_EXCEEDED`` (reason ``expired-in-queue``) and the
      handler is not called;
    * ``DeadlineExceeded`` out of the handler (or out of a streamed response)
      answers ``DEADLINE_EXCEEDED``; ``DownstreamOverloaded`` ``UNAVAILABLE``;
      ``QueueFull`` ``RESOURCE_EXHAUSTED``; each with the reason in the
      trailing metadata ``x-prazo-reason``.

    Works with any executor; with ``AdmissionExecutor`` it also gives the
    pool each RPC's deadline, so RPCs expire while still in line. List it
    first in ``interceptors`` so the others run inside the deadline too::

        server = grpc.server(AdmissionExecutor(pool), interceptors=[DeadlineServerInterceptor()])
    """

    def __init__(self, *, default_budget_ms: float | None = None, max_budget_ms: float | None = None) -> None:
        self._budget = RpcBudgetPolicy(default_budget_ms=default_budget_ms, max_budget_ms=max_budget_ms)
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._wrapped_lock = threading.Lock()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        arrival_ns = time.monotonic_ns()
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        # grpc runs interceptors in the RPC's own context, the one its handler
        # (and the executor's fn) runs in: the ticket rides there.
        _ticket.set(_Ticket(arrival_ns, metadata_budget(handler_call_details.invocation_metadata), self._budget))
        return self._wrap(handler)

    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        # Generic handlers usually return the same handler object per method:
        # wrap it once. The entry keeps the handler alive, so its id stays its own.
        entry = self._wrapped.get(id(handler))
        if entry is not None and entry[0] is handler:
            return entry[1]
        wrapped = _wrap_handler(handler, self._budget)
        with self._wrapped_lock:
            if len(self._wrapped) >= 4096:
                self._wrapped.clear()
            self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped


def _admitted(context: grpc.ServicerContext, budget: RpcBudgetPolicy) -> Deadline | None:
    """The handler's deadline; answers (and raises) instead when the RPC must not run."""
    ticket = _ticket.get()
    if ticket is None:
        # Not through intercept_service's context (a grpc that runs
        # interceptors elsewhere): arrival is now, as far as we can tell.
        ticket = _Ticket(time.monotonic_ns(), metadata_budget(context.invocation_metadata()), budget)
    ticket.started = True
    if ticket.refusal is not None:
        _abort(context, ticket.refusal, ticket.retry_after_ns)
    deadline = ticket.deadline if ticket.resolved else ticket.resolve(context.time_remaining(), time.monotonic_ns())
    if deadline is not None and deadline.expired():
        _abort(context, DeadlineExceeded(REASON_EXPIRED_IN_QUEUE))
    return deadline


def _wrap_handler(handler: grpc.RpcMethodHandler, budget: RpcBudgetPolicy) -> grpc.RpcMethodHandler:
    if handler.request_streaming and handler.response_streaming:
        behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler

    if handler.response_streaming:

        def run(request: Any, context: grpc.ServicerContext, *rest: Any) -> Any:
            deadline = _admitted(context, budget)
            # The responses are produced later, one next() at a time, outside
            # this call: each runs in a context where the deadline is current.
            ctx = deadline_context(deadline)
            try:
                responses = ctx.run(behavior, request, context, *rest)
            except _PRAZO_ERRORS as exc:
                _abort(context, exc)
            # None from an experimental_non_blocking handler, which answers by callback.
            return None if responses is None else _responses_in(ctx, responses, context)

    else:

        def run(request: Any, context: grpc.ServicerContext, *rest: Any) -> Any:
            with deadline_scope(_admitted(context, budget)):
                try:
                    return behavior(request, context, *rest)
                except _PRAZO_ERRORS as exc:
                    _abort(context, exc)

    # Keeps grpc's per-behaviour options (experimental_thread_pool,
    # experimental_non_blocking), which it reads as attributes of the behaviour.
    functools.update_wrapper(run, behavior)
    return factory(
        run, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def _responses_in(ctx: contextvars.Context, responses: Any, context: grpc.ServicerContext) -> Iterator[Any]:
    iterator = ctx.run(iter, responses)
    while True:
        try:
            response = ctx.run(next, iterator)
        except StopIteration:
            return
        except _PRAZO_ERRORS as exc:
            _abort(context, exc)
        yield response


def _ticket_of(fn: Callable[..., Any]) -> _Ticket | None:
    """The ticket of the RPC grpc submitted: ``fn`` is its context's bound ``run``."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, contextvars.Context):
        return owner.get(_ticket)
    return None


def _grpc_remaining_s(args: tuple[Any, ...]) -> float | None:
    """Seconds left of the gRPC deadline of the submitted call, read from its ``call_details``."""
    for arg in args:
        details = getattr(arg, "call_details", None)
        deadline = getattr(details, "deadline", None)
        if isinstance(deadline, float):
            return deadline - time.time()
    return None


def _shutting_down() -> DownstreamOverloaded:
    """The refusal of an RPC the pool will not run because it is shut down: ``UNAVAILABLE``."""
    return DownstreamOverloaded(REASON_SHUTTING_DOWN, "the server is shutting down")


class _Submission:
    """One RPC in the pool: when the pool refuses it after all, the refusal thread answers it."""

    __slots__ = ("args", "done", "executor", "fn", "kwargs", "ticket")

    def __init__(
        self,
        executor: AdmissionExecutor,
        ticket: _Ticket,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.executor = executor
        self.ticket = ticket
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.done: Future[Any] = Future()
        self.done.set_running_or_notify_cancel()

    def pool_done(self, future: Future[Any]) -> None:
        if future.cancelled():
            # shutdown(cancel_futures=True): the RPC still gets an answer.
            self.refuse(_shutting_down())
            return
        exc = future.exception()
        if isinstance(exc, (DeadlineExceeded, QueueFull)) and not self.ticket.started:
            # Expired (or shed) in line: the handler never ran.
            self.refuse(exc)
        elif exc is not None:
            self.done.set_exception(exc)
        else:
            self.done.set_result(future.result())

    def refuse(self, exc: BaseException) -> None:
        self.ticket.refusal = exc
        self.ticket.retry_after_ns = self.executor.pool.retry_after_ns
        try:
            refusal = self.executor.refusals.submit(self.fn, *self.args, **self.kwargs)
        except RuntimeError:
            # shutdown(wait=False) stopped the refusal threads while RPCs were
            # still in line: the client's own deadline (or the server's stop) ends it.
            _LOGGER.warning("prazo AdmissionExecutor: an RPC refused after shutdown() could not be answered")
            self.done.set_result(None)
            return
        refusal.add_done_callback(self.finished)

    def finished(self, refusal: Future[Any]) -> None:
        self.done.set_result(None)


class AdmissionExecutor(Executor):
    """An ``AdmissionPool`` as ``grpc.server``'s executor; needs ``DeadlineServerInterceptor`` (see module).

    Effects of ``submit`` for an RPC (grpc's serving thread calls it):

    * the RPC enters the pool with its deadline (``submit_until``), so it
      waits at most until then and its handler never starts after it;
    * the pool full (``QueueFull``): answered ``RESOURCE_EXHAUSTED`` at once,
      reason ``queue-full``; its deadline passed in line: answered
      ``DEADLINE_EXCEEDED``, reason ``expired-in-queue`` (or
      ``expired-on-arrival``); in both cases the handler is never called and
      the answer is sent by one of ``refusal_threads`` threads, holding no
      pool slot;
    * ``submit`` never raises into grpc (which would kill its serving thread).

    A submission that is not an RPC carrying the interceptor's ticket is
    passed to the pool as it is (``QueueFull`` raised to the caller) — except
    one from grpc without the interceptor, which cannot be answered by a
    refusal: it is logged and run on the refusal threads, over capacity,
    rather than left hanging.

    Stop the gRPC server before ``shutdown()``: this shuts down the pool
    (cancelled RPCs are answered ``UNAVAILABLE``, reason ``shutdown``, as is
    any RPC arriving at a server whose pool was shut down) and then the
    refusal threads.
    """

    def __init__(self, pool: AdmissionPool, *, refusal_threads: int = 1) -> None:
        if not isinstance(pool, AdmissionPool):
            raise TypeError(f"pool must be a prazo.bindings.pool.AdmissionPool, not {type(pool).__name__}")
        if isinstance(refusal_threads, bool) or not isinstance(refusal_threads, int):
            raise TypeError(f"refusal_threads must be an int, not {type(refusal_threads).__name__}")
        if refusal_threads < 1:
            raise ValueError(f"refusal_threads must be >= 1, got {refusal_threads}")
        self.pool = pool
        self.refusals = ThreadPoolExecutor(refusal_threads, thread_name_prefix="prazo-grpc-refusal")
        self._warned = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        ticket = _ticket_of(fn)
        if ticket is None:
            if not isinstance(getattr(fn, "__self__", None), contextvars.Context):
                return self.pool.submit(fn, *args, **kwargs)
            return self._unticketed(fn, args, kwargs)
        now_ns = time.monotonic_ns()
        remaining_s = _grpc_remaining_s(args)
        deadline = ticket.resolve(remaining_s, now_ns) if remaining_s is not None else None
        submission = _Submission(self, ticket, fn, args, kwargs)
        try:
            future = self.pool.submit_until(deadline, fn, *args, **kwargs)
        except QueueFull as exc:
            submission.refuse(exc.with_traceback(None))
        except RuntimeError:
            # The pool was shut down under a running server.
            submission.refuse(_shutting_down())
        else:
            future.add_done_callback(submission.pool_done)
        return submission.done

    def _unticketed(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[T]:
        try:
            return self.pool.submit(fn, *args, **kwargs)
        except QueueFull:
            if not self._warned:
                self._warned = True
                _LOGGER.error(
                    "prazo AdmissionExecutor: an RPC was refused but cannot be answered without "
                    "DeadlineServerInterceptor; running it over capacity. Use admission_server() "
                    "or list DeadlineServerInterceptor in grpc.server(interceptors=...)."
                )
            return self.refusals.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait, cancel_futures=cancel_futures)
        self.refusals.shutdown(wait)

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__name__} pool={self.pool!r}>"


def admission_server(
    pool: AdmissionPool,
    *,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    default_budget_ms: float | None = None,
    max_budget_ms: float | None = None,
    refusal_threads: int = 1,
    **server_kwargs: Any,
) -> grpc.Server:
    """``grpc.server`` on ``AdmissionExecutor(pool)`` with ``DeadlineServerInterceptor`` first.

    ``interceptors`` run after it, inside the deadline; ``server_kwargs`` go to ``grpc.server``.
    """
    interceptor = DeadlineServerInterceptor(default_budget_ms=default_budget_ms, max_budget_ms=max_budget_ms)
    return grpc.server(
        AdmissionExecutor(pool, refusal_threads=refusal_threads),
        interceptors=[interceptor, *interceptors],
        **server_kwargs,
    )
