"""Three hardening properties of both twins (issue 7, defects 3 to 5).

* ``stats()`` is a snapshot: read from a monitor thread while real threads
  work both faces (with rejections and expiries), every snapshot balances and
  is within bounds. The old C twin read its atomics one by one and the old
  Python twin read its ints without the lock; both broke the balance in a few
  of every ten thousand snapshots, so the test takes tens of thousands.
* A reference cycle through a queued item (queue -> item -> queue) or through
  ``on_expired`` is collected; a queue the collector cleared refuses every
  call instead of crashing.
* A queue whose ``__init__`` never completed refuses every call with a
  ``RuntimeError`` (the old C twin died of SIGFPE), and ``__init__`` cannot
  be run twice on a live queue.

What could crash the interpreter runs in a subprocess with a timeout, so a
crash or a hang fails the test instead of killing the suite.
"""

from __future__ import annotations

import ctypes
import gc
import json
import queue
import random
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from _helpers import COUNTER_NAMES, JOIN_TIMEOUT_S, QueueClass, assert_conservation, unaccounted
from prazo.core import Deadline, DeadlineExceeded, QueueFull, ShutDown

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

NOT_INITIALISED = "not initialised"
SUBPROCESS_TIMEOUT_S = 60.0

# -- stats() is a snapshot ----------------------------------------------------------

SNAPSHOT_MAX_CONCURRENCY = 2
SNAPSHOT_MAX_QUEUE = 8
GATE_THREADS = 24
PRODUCERS = 4
CONSUMERS = 2
# The monitor reads for MONITOR_S, and on past that (up to MONITOR_CAP_S on a
# very loaded machine) until it has MIN_SNAPSHOTS. The old twins broke 5
# snapshots within the first few thousand in every measured run.
MONITOR_S = 3.0
MONITOR_CAP_S = 30.0
MIN_SNAPSHOTS = 2_000
# A short switch interval makes the GIL change hands often, so snapshots
# interleave with the writers at many more points.
SWITCH_INTERVAL_S = 1e-4
MONOTONIC_COUNTERS = tuple(name for name in COUNTER_NAMES if name not in ("in_flight", "assigned", "queued"))


def snapshot_problems(stats: Mapping[str, int], previous: Mapping[str, int] | None) -> list[str]:
    """What is wrong with one ``stats()`` snapshot (empty when it is consistent)."""
    problems = []
    if gap := unaccounted(stats):
        problems.append(f"offered {stats['offered']} has {gap} arrivals without an outcome")
    if stats["expired"] != stats["expired_on_arrival"] + stats["expired_in_queue"]:
        problems.append("expired != expired_on_arrival + expired_in_queue")
    if not 0 <= stats["in_flight"] <= stats["peak_in_flight"] <= stats["max_concurrency"]:
        problems.append("in_flight out of bounds")
    if not 0 <= stats["queued"] <= stats["peak_queued"] <= stats["max_queue"]:
        problems.append("queued out of bounds")
    if not 0 <= stats["assigned"] <= stats["in_flight"]:
        problems.append("assigned out of bounds")
    # Every slot is held by a started, unfinished entry or assigned to one.
    if stats["in_flight"] != stats["started"] - stats["completed"] + stats["assigned"]:
        problems.append("in_flight != started - completed + assigned")
    if previous is not None:
        problems.extend(f"{name} went down" for name in MONOTONIC_COUNTERS if stats[name] < previous[name])
    return problems


def budget_ms(rng: random.Random) -> float:
    """A few ms, sometimes already passed: waits, active expiries and expiries on arrival."""
    return rng.uniform(-0.2, 3.0)


def test_every_stats_snapshot_balances_while_threads_work(impl: QueueClass) -> None:
    q = impl(SNAPSHOT_MAX_CONCURRENCY, SNAPSHOT_MAX_QUEUE, on_expired=lambda item: None)
    stop = threading.Event()
    errors: list[BaseException] = []

    def guarded(body: Callable[[random.Random], None], seed: int) -> Callable[[], None]:
        def run() -> None:
            try:
                body(random.Random(seed))
            except ShutDown:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        return run

    def gate(rng: random.Random) -> None:
        while not stop.is_set():
            try:
                with q.slot(Deadline.after_ms(budget_ms(rng))):
                    time.sleep(rng.uniform(0.0, 0.002))
            except (QueueFull, DeadlineExceeded):
                pass

    def producer(rng: random.Random) -> None:
        while not stop.is_set():
            try:
                q.put(object(), Deadline.after_ms(budget_ms(rng)))
            except (QueueFull, DeadlineExceeded):
                pass
            time.sleep(0.001)

    def consumer(rng: random.Random) -> None:
        while not stop.is_set():
            try:
                q.get(timeout=0.05)
            except queue.Empty:
                continue
            q.task_done()

    def sweeper(rng: random.Random) -> None:
        while not stop.is_set():
            q.expire_overdue()
            time.sleep(0.001)

    bodies = [gate] * GATE_THREADS + [producer] * PRODUCERS + [consumer] * CONSUMERS + [sweeper]
    threads = [threading.Thread(target=guarded(body, seed), daemon=True) for seed, body in enumerate(bodies)]
    broken: list[tuple[dict[str, int], list[str]]] = []
    snapshots = 0
    previous = None
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        for thread in threads:
            thread.start()
        start = time.monotonic()
        while len(broken) < 5:
            elapsed = time.monotonic() - start
            if elapsed > MONITOR_CAP_S or (elapsed > MONITOR_S and snapshots >= MIN_SNAPSHOTS):
                break
            stats = q.stats()
            snapshots += 1
            problems = snapshot_problems(stats, previous)
            if problems:
                broken.append((stats, problems))
            previous = stats
    finally:
        stop.set()
        sys.setswitchinterval(old_interval)
        q.shutdown(cancel_waiting=True)
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a worker thread did not stop"
    assert errors == []
    assert broken == [], f"{len(broken)} of {snapshots} snapshots broken, first: {broken[0]}"
    final = q.stats()
    assert snapshot_problems(final, None) == []
    assert (final["in_flight"], final["queued"], final["assigned"]) == (0, 0, 0)
    # The writers did reach every outcome the balance is made of.
    for name in ("started", "rejected_full", "expired_on_arrival", "expired_in_queue"):
        assert final[name] > 0, f"no {name} in {final}"
    assert snapshots >= MIN_SNAPSHOTS


# -- reference cycles through the queue are collected ---------------------------------


class Holder:
    """Holds whatever a test gives it (a queue) and reacts to expiries."""

    q: Any

    def on_expired(self, item: object) -> None:
        pass


def own_class() -> type[Holder]:
    """A subclass of this test's own, so counting its live instances sees only this test's objects."""
    return type("Holder", (Holder,), {})


def freed(cls: type, *refs: weakref.ref[Any]) -> bool:
    """After a collection, no instance of ``cls`` and none of ``refs`` is alive.

    Weak references die as soon as the collector finds a cycle unreachable,
    even when clearing the cycle then fails to free it; counting the live
    instances is what shows the objects were really freed.
    """
    gc.collect()
    return all(ref() is None for ref in refs) and not any(type(obj) is cls for obj in gc.get_objects())


def test_a_cycle_through_items_in_both_rings_is_freed(impl: QueueClass) -> None:
    item_class = own_class()
    q = impl(1, 4)
    # A tuple has no tp_clear, so only the queue itself can break these cycles.
    q.put((q, item_class()))  # takes the slot: it waits in the hand-off buffer for get()
    q.put((q, item_class()))  # waits in line
    holder = item_class()
    holder.q = q
    q.put(holder)
    assert q.stats()["assigned"] == 1 and q.qsize() == 2
    queue_ref = weakref.ref(q)
    del q, holder
    assert freed(item_class, queue_ref)


def test_a_cycle_through_on_expired_is_freed(impl: QueueClass) -> None:
    holder_class = own_class()
    holder = holder_class()
    holder.q = impl(1, 1, on_expired=holder.on_expired)
    queue_ref = weakref.ref(holder.q)
    del holder
    assert freed(holder_class, queue_ref)


def test_collections_while_threads_use_a_cyclic_queue_never_crash(impl: QueueClass) -> None:
    """Threads put, get and wait on a queue whose items refer to it while
    another thread keeps collecting: the collector reads the rings as they move."""
    script = f"""
        import gc, queue, random, threading, time
        from prazo.core import Deadline, DeadlineExceeded, QueueFull, ShutDown
        from {impl.__module__} import AdmissionQueue

        q = AdmissionQueue(2, 16, on_expired=lambda item: None)
        stop = threading.Event()

        def producer(rng):
            while not stop.is_set():
                try:
                    q.put([q, object()], Deadline.after_ms(rng.uniform(-0.2, 3.0)))
                except (QueueFull, DeadlineExceeded):
                    time.sleep(0.0005)

        def consumer(rng):
            while not stop.is_set():
                try:
                    q.get(timeout=0.05)
                except queue.Empty:
                    continue
                q.task_done()

        def gate(rng):
            while not stop.is_set():
                try:
                    with q.slot(Deadline.after_ms(rng.uniform(0.0, 3.0))):
                        pass
                except (QueueFull, DeadlineExceeded):
                    pass

        def collector(rng):
            while not stop.is_set():
                gc.collect()

        bodies = [producer] * 3 + [consumer] * 2 + [gate] * 6 + [collector] * 2
        threads = [threading.Thread(target=body, args=(random.Random(i),)) for i, body in enumerate(bodies)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        stop.set()
        for thread in threads:
            thread.join()
        stats = q.stats()
        left = q.shutdown(cancel_waiting=True)
        print("ok", stats["offered"], len(left))
    """
    result = run_script(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


# -- an unusable queue refuses every call ---------------------------------------------

# Every public method and property, called with valid arguments and bounded
# waits (so a twin that wrongly accepts the call cannot hang the test).
CALLS = {
    "max_concurrency": "q.max_concurrency",
    "max_queue": "q.max_queue",
    "order": "q.order",
    "is_shutdown": "q.is_shutdown",
    "qsize": "q.qsize()",
    "full": "q.full()",
    "stats": "q.stats()",
    "slot": "q.slot()",
    "with slot": "q.slot(Deadline.after(0.05)).__enter__()",
    "acquire": "q.acquire(Deadline.after(0.05))",
    "release": "q.release()",
    "put": "q.put('x')",
    "put_nowait": "q.put_nowait('x')",
    "get": "q.get(timeout=0.05)",
    "get_nowait": "q.get_nowait()",
    "task_done": "q.task_done()",
    "expire_overdue": "q.expire_overdue()",
    "cancel": "q.cancel('x')",
    "shutdown": "q.shutdown(cancel_waiting=True)",
}

# The ways a queue ends up never initialised: __new__ alone, or an __init__
# that raised on each argument in turn (after the earlier ones were valid).
NEVER_INITIALISED = {
    "new only": "",
    "bad max_concurrency": "q.__init__(0, 4)",
    "bad max_queue": "q.__init__(4, -1)",
    "bad order": "q.__init__(4, 4, order='random')",
    "bad on_expired": "q.__init__(4, 4, on_expired=42)",
}


def run_script(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )


def test_the_half_initialised_queue_of_the_issue_raises_instead_of_crashing(impl: QueueClass) -> None:
    result = run_script(f"""
        from {impl.__module__} import AdmissionQueue
        q = AdmissionQueue.__new__(AdmissionQueue)
        try:
            q.__init__(4, -1)
        except ValueError:
            pass
        try:
            q.put("x")
        except RuntimeError as exc:
            print(exc)
    """)
    assert result.returncode == 0, f"the process died ({result.returncode}): {result.stderr}"
    assert NOT_INITIALISED in result.stdout


def outcomes_of_every_call(module: str, setup: str) -> dict[str, Any]:
    """Run every call of ``CALLS`` on a queue built by ``setup``, in a subprocess."""
    result = run_script(f"""
        import json
        from prazo.core import Deadline
        from {module} import AdmissionQueue
        calls = {CALLS!r}
        outcomes = {{}}
        for name, call in calls.items():
            q = AdmissionQueue.__new__(AdmissionQueue)
            try:
                exec({setup!r})
            except (TypeError, ValueError):
                pass
            try:
                eval(call)
                outcomes[name] = "returned"
            except BaseException as exc:
                outcomes[name] = [type(exc).__name__, str(exc)]
        outcomes["repr"] = repr(q)
        print(json.dumps(outcomes))
    """)
    assert result.returncode == 0, f"the process died ({result.returncode}): {result.stderr}"
    outcomes: dict[str, Any] = json.loads(result.stdout)
    return outcomes


@pytest.mark.parametrize("setup", list(NEVER_INITIALISED.values()), ids=list(NEVER_INITIALISED))
def test_every_call_on_a_never_initialised_queue_raises(impl: QueueClass, setup: str) -> None:
    outcomes = outcomes_of_every_call(impl.__module__, setup)
    assert NOT_INITIALISED in outcomes.pop("repr")
    wrong = {name: outcome for name, outcome in outcomes.items() if outcome[0] != "RuntimeError"}
    assert wrong == {}
    assert all(NOT_INITIALISED in message for _, message in outcomes.values())


def test_a_slot_not_made_by_a_queue_refuses_to_enter(impl: QueueClass) -> None:
    result = run_script(f"""
        from {impl.__module__} import Slot
        try:
            Slot.__new__(Slot).__enter__()
        except RuntimeError as exc:
            print(exc)
    """)
    assert result.returncode == 0, f"the process died ({result.returncode}): {result.stderr}"
    assert "AdmissionQueue.slot()" in result.stdout


def test_init_after_a_failed_init_builds_a_working_queue(impl: QueueClass) -> None:
    q = impl.__new__(impl)
    with pytest.raises(ValueError, match="order"):
        q.__init__(4, 4, order="random")
    q.__init__(1, 2, order="lifo")
    assert (q.max_concurrency, q.max_queue, q.order) == (1, 2, "lifo")
    q.put("a")
    q.put("b")
    assert q.get_nowait() == "a"


def test_init_twice_is_refused_and_leaves_the_queue_as_it_was(impl: QueueClass) -> None:
    q = impl(1, 2)
    q.put("running")
    q.put("waiting")
    before = q.stats()
    with pytest.raises(RuntimeError, match="twice"):
        q.__init__(3, 5)
    assert q.stats() == before
    assert (q.max_concurrency, q.max_queue) == (1, 2)
    assert q.get_nowait() == "running"
    q.task_done()
    assert q.get_nowait() == "waiting"
    assert_conservation(q.stats())


# tp_clear is what the collector calls on each object of an unreachable cycle;
# calling it on a live queue shows what any code that still reached the queue
# afterwards would see. Its offset in PyTypeObject has been the same on every
# CPython 3 release; the checks below fail loudly if that ever changes.
_POINTER_SLOTS_BEFORE_FLAGS = (
    "tp_dealloc",
    "tp_vectorcall_offset",
    "tp_getattr",
    "tp_setattr",
    "tp_as_async",
    "tp_repr",
    "tp_as_number",
    "tp_as_sequence",
    "tp_as_mapping",
    "tp_hash",
    "tp_call",
    "tp_str",
    "tp_getattro",
    "tp_setattro",
    "tp_as_buffer",
)


# PyObject's head: a reference count on a default build; on a free-threaded one (3.13's
# Include/object.h) the owning thread, flags, a mutex, GC bits and two reference counts.
_OBJECT_HEAD = (
    [
        ("ob_tid", ctypes.c_size_t),
        ("ob_flags", ctypes.c_uint16),
        ("ob_mutex", ctypes.c_uint8),
        ("ob_gc_bits", ctypes.c_uint8),
        ("ob_ref_local", ctypes.c_uint32),
        ("ob_ref_shared", ctypes.c_ssize_t),
    ]
    if sysconfig.get_config_var("Py_GIL_DISABLED")
    else [("ob_refcnt", ctypes.c_ssize_t)]
)


class _TypeHead(ctypes.Structure):
    _fields_ = [
        *_OBJECT_HEAD,
        ("ob_type", ctypes.c_void_p),
        ("ob_size", ctypes.c_ssize_t),
        ("tp_name", ctypes.c_char_p),
        ("tp_basicsize", ctypes.c_ssize_t),
        ("tp_itemsize", ctypes.c_ssize_t),
        *[(slot, ctypes.c_void_p) for slot in _POINTER_SLOTS_BEFORE_FLAGS],
        ("tp_flags", ctypes.c_ulong),
        ("tp_doc", ctypes.c_char_p),
        ("tp_traverse", ctypes.c_void_p),
        ("tp_clear", ctypes.c_void_p),
    ]


def clear_like_the_collector(obj: object) -> None:
    head = _TypeHead.from_address(id(type(obj)))
    assert head.tp_basicsize == type(obj).__basicsize__ and head.tp_flags == type(obj).__flags__, (
        "PyTypeObject layout not as expected"
    )
    assert head.tp_clear, f"{type(obj).__name__} has no tp_clear"
    # PYFUNCTYPE keeps the GIL held during the call, as the collector does.
    ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object)(head.tp_clear)(obj)


def test_a_queue_cleared_by_the_collector_drops_its_items_and_refuses_every_call(impl: QueueClass) -> None:
    item_class = own_class()
    q = impl(2, 40, on_expired=item_class().on_expired)
    # More than one batch (16) of items to drop, in both rings.
    for _ in range(2 + 40):
        q.put(item_class())
    assert q.stats()["assigned"] == 2 and q.qsize() == 40
    clear_like_the_collector(q)
    assert freed(item_class), "the cleared queue still holds its items or its callback"
    assert NOT_INITIALISED in repr(q)
    outcomes = {}
    for name, call in CALLS.items():
        try:
            eval(call, {"q": q, "Deadline": Deadline})
            outcomes[name] = "returned"
        except Exception as exc:  # noqa: BLE001 - the test compares whatever each call raised
            outcomes[name] = f"{type(exc).__name__}: {exc}"
    wrong = {name: outcome for name, outcome in outcomes.items() if not outcome.startswith("RuntimeError")}
    assert wrong == {}
    assert all(NOT_INITIALISED in outcome for outcome in outcomes.values())


class _Interrupt(BaseException):
    pass


def test_an_interrupt_from_on_expired_leaves_no_reference_cycle(impl: QueueClass) -> None:
    """The BaseException an ``on_expired`` callback raised reaches the caller, then dies by refcounting.

    The Python twin kept it in a local of the frame its traceback holds: one
    cycle (with every frame below it) per interrupt, until a full collection.
    """

    def on_expired(item: object) -> None:
        raise _Interrupt()

    q = impl(1, 4, on_expired=on_expired)
    q.put("holds the slot", Deadline.at_ns(10**15), now_ns=1_000)
    q.put("waits in line", Deadline.at_ns(2_000), now_ns=1_000)
    gc.collect()
    gc.disable()
    try:
        try:
            q.expire_overdue(now_ns=3_000)
        except _Interrupt as exc:
            ref = weakref.ref(exc)
        else:
            pytest.fail("the callback's interrupt did not reach the caller")
        assert ref() is None, "the interrupt outlived the except block (a reference cycle)"
    finally:
        gc.enable()
