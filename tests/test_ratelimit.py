"""Token buckets: a steady rate, a bounded burst, and bounded memory per key."""

from __future__ import annotations

import pytest

from shoal.transport.ratelimit import KeyedBuckets, TokenBucket


def test_a_bucket_allows_its_burst_at_once_then_its_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take(0.4)  # 0.8 of a token
    assert bucket.take(0.5)
    assert not bucket.take(0.5)


def test_a_bucket_never_saves_more_than_its_burst() -> None:
    bucket = TokenBucket(rate=100.0, burst=2.0)
    assert bucket.available(1000.0) == 2.0


def test_a_refused_take_spends_nothing() -> None:
    bucket = TokenBucket(rate=1.0, burst=5.0)
    assert not bucket.take(0.0, cost=6.0)
    assert bucket.take(0.0, cost=5.0)


def test_time_going_backwards_neither_refills_nor_breaks_the_bucket() -> None:
    bucket = TokenBucket(rate=1.0, burst=1.0)
    assert bucket.take(10.0)
    assert not bucket.take(5.0)
    assert bucket.take(11.0)


def test_each_key_has_its_own_bucket_and_the_least_recent_keys_are_forgotten() -> None:
    buckets = KeyedBuckets(rate=0.0, burst=1.0, max_keys=2)
    assert buckets.take("a", 0.0) and not buckets.take("a", 0.0)
    assert buckets.take("b", 0.0)
    assert buckets.take("c", 0.0)  # "a" was least recently used: forgotten
    assert len(buckets) == 2
    assert buckets.take("a", 0.0)


@pytest.mark.parametrize(("rate", "burst"), [(-1.0, 1.0), (1.0, 0.0)])
def test_nonsense_limits_are_refused(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst)
    with pytest.raises(ValueError):
        KeyedBuckets(rate, burst)
