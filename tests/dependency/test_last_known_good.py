"""The last-known-good store: per-read age limits on a fake clock, the LRU bound (Hypothesis, real threads), arguments."""

from __future__ import annotations

import gc
import math
import threading
from collections import OrderedDict

import pytest
from _helpers import examples
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from prazo.bindings.dependency import LastKnownGood
from prazo.core import NS_PER_SECOND

T0 = 1_000 * NS_PER_SECOND


def test_put_then_get_returns_value_and_age() -> None:
    lkg = LastKnownGood()
    lkg.put("recs:42", ["a", "b"], now_ns=T0)
    assert lkg.get("recs:42", max_age_s=600, now_ns=T0 + 3 * NS_PER_SECOND) == (["a", "b"], 3.0)
    assert lkg.get("recs:42", max_age_s=0, now_ns=T0) == (["a", "b"], 0.0)


def test_absent_key_is_a_miss() -> None:
    lkg = LastKnownGood()
    assert lkg.get("nope", 10, now_ns=T0) is None
    assert lkg.stats()["misses"] == 1


def test_the_age_limit_is_the_readers_and_old_values_are_kept() -> None:
    lkg = LastKnownGood()
    lkg.put("fx:EURBRL", 6.1, now_ns=T0)
    later = T0 + 30 * NS_PER_SECOND
    assert lkg.get("fx:EURBRL", max_age_s=30, now_ns=later) == (6.1, 30.0)  # exactly the limit: still good
    assert lkg.get("fx:EURBRL", max_age_s=30, now_ns=later + 1) is None  # one ns older: too old for this reader
    assert lkg.get("fx:EURBRL", max_age_s=600, now_ns=later + 1) is not None  # ...but kept for a more tolerant one
    assert lkg.get("fx:EURBRL", max_age_s=math.inf, now_ns=T0 + 10**6 * NS_PER_SECOND) is not None
    assert lkg.stats() == {"entries": 1, "max_entries": 1024, "evictions": 0, "hits": 3, "misses": 0, "too_old": 1}


def test_put_replaces_value_and_timestamp() -> None:
    lkg = LastKnownGood()
    lkg.put("k", 1, now_ns=T0)
    lkg.put("k", 2, now_ns=T0 + 5 * NS_PER_SECOND)
    assert lkg.get("k", 1, now_ns=T0 + 5 * NS_PER_SECOND) == (2, 0.0)
    assert len(lkg) == 1


def test_lru_evicts_the_least_recently_used() -> None:
    lkg = LastKnownGood(max_entries=2)
    lkg.put("a", 1, now_ns=T0)
    lkg.put("b", 2, now_ns=T0)
    assert lkg.get("a", 1, now_ns=T0) is not None  # a is now more recent than b
    lkg.put("c", 3, now_ns=T0)
    assert lkg.get("b", 1, now_ns=T0) is None
    assert lkg.get("a", 1, now_ns=T0) is not None
    assert lkg.get("c", 1, now_ns=T0) is not None
    assert len(lkg) == 2
    assert lkg.stats()["evictions"] == 1


def test_a_too_old_read_does_not_refresh_recency() -> None:
    lkg = LastKnownGood(max_entries=2)
    lkg.put("a", 1, now_ns=T0)
    lkg.put("b", 2, now_ns=T0 + NS_PER_SECOND)
    assert lkg.get("a", 0.5, now_ns=T0 + NS_PER_SECOND) is None
    lkg.put("c", 3, now_ns=T0 + NS_PER_SECOND)
    assert lkg.get("a", math.inf, now_ns=T0 + NS_PER_SECOND) is None


def test_clear_keeps_counters() -> None:
    lkg = LastKnownGood()
    lkg.put("a", 1, now_ns=T0)
    lkg.get("a", 1, now_ns=T0)
    lkg.clear()
    assert len(lkg) == 0
    assert lkg.get("a", 1, now_ns=T0) is None
    assert lkg.stats()["hits"] == 1


def test_clock_argument() -> None:
    now = [T0]
    lkg = LastKnownGood(clock=lambda: now[0])
    lkg.put("a", 1)
    now[0] += 2 * NS_PER_SECOND
    assert lkg.get("a", 5) == (1, 2.0)
    assert lkg.get("a", 1) is None


def test_default_clock() -> None:
    lkg = LastKnownGood()
    lkg.put(("tuple", 1), "v")
    hit = lkg.get(("tuple", 1), 60)
    assert hit is not None and hit[0] == "v" and 0 <= hit[1] < 60


@pytest.mark.parametrize("method", ["put", "get"])
def test_unhashable_key_names_key(method: str) -> None:
    lkg = LastKnownGood()
    with pytest.raises(TypeError, match="key"):
        if method == "put":
            lkg.put(["a"], 1)
        else:
            lkg.get({"a": 1}, 1)
    assert len(lkg) == 0


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (math.nan, ValueError),
        (-1, ValueError),
        (-math.inf, ValueError),
        ("5", TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_bad_max_age(value: object, error: type[Exception]) -> None:
    lkg = LastKnownGood()
    lkg.put("a", 1, now_ns=T0)
    with pytest.raises(error, match="max_age_s"):
        lkg.get("a", value, now_ns=T0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-3, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_max_entries(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="max_entries"):
        LastKnownGood(value)  # type: ignore[arg-type]


def test_bad_clock_and_now() -> None:
    with pytest.raises(TypeError, match="clock"):
        LastKnownGood(clock=3)  # type: ignore[arg-type]
    lkg = LastKnownGood()
    with pytest.raises(TypeError, match="now_ns"):
        lkg.put("a", 1, now_ns=1.5)  # type: ignore[arg-type]


def test_a_values_finalizer_may_use_the_store() -> None:
    """Evicted and replaced values are dropped after the lock is released: a __del__ that calls back cannot deadlock.

    The scenario runs on its own thread, so a deadlock fails the test instead of hanging the suite.
    """
    lkg = LastKnownGood(max_entries=1)
    dropped: list[str] = []

    class Remembers:
        def __init__(self, name: str) -> None:
            self.name = name

        def __del__(self) -> None:
            lkg.get("other", 1, now_ns=T0)  # takes the store's lock
            dropped.append(self.name)

    def scenario() -> None:
        lkg.put("a", Remembers("replaced"), now_ns=T0)
        lkg.put("a", Remembers("evicted"), now_ns=T0)  # replaces the first
        lkg.put("b", 2, now_ns=T0)  # evicts the second
        lkg.put("c", Remembers("cleared"), now_ns=T0)
        lkg.clear()
        gc.collect()

    worker = threading.Thread(target=scenario, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "deadlocked: a value was released under the store's lock"
    assert dropped == ["replaced", "evicted", "cleared"]


# -- the LRU bound, against a model ------------------------------------------------

KEYS = st.sampled_from(["a", "b", "c", "d", "e", 1, 2, (3, "x")])


class StoreMachine(RuleBasedStateMachine):
    """Random puts, gets with random age limits, clock steps and clears, checked against an exact LRU model."""

    @initialize(max_entries=st.integers(1, 5))
    def setup(self, max_entries: int) -> None:
        self.now = T0
        self.lkg = LastKnownGood(max_entries)
        self.model: OrderedDict[object, tuple[int, int]] = OrderedDict()  # key -> (value, stored at)
        self.last_put: object = None
        self.counter = 0
        self.evictions = 0

    @rule(key=KEYS)
    def put(self, key: object) -> None:
        self.counter += 1
        self.lkg.put(key, self.counter, now_ns=self.now)
        self.model.pop(key, None)
        self.model[key] = (self.counter, self.now)
        if len(self.model) > self.lkg.max_entries:
            self.model.popitem(last=False)
            self.evictions += 1
        self.last_put = key

    @rule(key=KEYS, max_age_ms=st.one_of(st.sampled_from((0, 10, 1000)), st.integers(0, 3000), st.just(math.inf)))
    def get(self, key: object, max_age_ms: float) -> None:
        got = self.lkg.get(key, max_age_ms / 1000, now_ns=self.now)
        entry = self.model.get(key)
        if entry is None or self.now - entry[1] > max_age_ms * 1_000_000:
            assert got is None
            return
        self.model.move_to_end(key)
        assert got == (entry[0], (self.now - entry[1]) / NS_PER_SECOND)

    @rule(ms=st.sampled_from((0, 1, 10, 999, 1000)))
    def advance(self, ms: int) -> None:
        self.now += ms * 1_000_000

    @rule()
    def clear(self) -> None:
        self.lkg.clear()
        self.model.clear()
        self.last_put = None

    @invariant()
    def bounded_and_same_as_model(self) -> None:
        assert len(self.lkg) <= self.lkg.max_entries
        assert len(self.lkg) == len(self.model)
        assert self.lkg.stats()["evictions"] == self.evictions

    @invariant()
    def most_recent_put_is_there_while_young(self) -> None:
        """The last put is never the one evicted, and a reader accepting its age gets it, with that age."""
        if self.last_put is None:
            return
        value, stored = self.model[self.last_put]
        age_s = (self.now - stored) / NS_PER_SECOND
        assert self.lkg.get(self.last_put, age_s, now_ns=self.now) == (value, age_s)
        self.model.move_to_end(self.last_put)  # a hit is a use, in the model too


def test_store_state_machine() -> None:
    run_state_machine_as_test(
        StoreMachine, settings=settings(max_examples=examples(200), stateful_step_count=50, deadline=None)
    )


# -- real threads -----------------------------------------------------------------------


def test_threads_never_push_it_past_max_entries() -> None:
    lkg = LastKnownGood(max_entries=64)
    stop = threading.Event()
    peak = [0]

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], len(lkg), lkg.stats()["entries"])

    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def writer(i: int) -> None:
        try:
            barrier.wait()
            for n in range(2000):
                key = (i, n % 100)
                lkg.put(key, n)
                hit = lkg.get(key, math.inf)
                assert hit is None or hit[1] >= 0  # another writer may have evicted it already
                lkg.get((i - 1, n % 100), 60)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    watcher.join()
    assert not errors, errors[0]
    stats = lkg.stats()
    assert peak[0] <= 64
    assert stats["entries"] == len(lkg) == 64
    # Every get was counted exactly once, whatever the interleaving.
    assert stats["hits"] + stats["misses"] + stats["too_old"] == 8 * 2000 * 2
