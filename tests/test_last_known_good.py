"""The last-known-good store: per-read age limits on a fake clock, the LRU bound (Hypothesis, real threads), arguments."""

from __future__ import annotations

import math

import pytest
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
