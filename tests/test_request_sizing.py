"""How large each request of a state download is: sized to end well within the
request timeout at the rate the link shows (averaging/request_sizing.py)."""

from __future__ import annotations

import itertools

import pytest

from shoal.averaging.request_sizing import (
    FIRST_REQUEST_BYTES,
    MAX_GROWTH,
    MIN_REQUEST_BYTES,
    RequestSizer,
)

MB = 1 << 20
CAP = 64 * MB


def settle(sizer: RequestSizer, rate: float, requests: int = 12) -> list[int]:
    """Sizes of `requests` requests over a link of `rate` bytes/s and 50 ms RTT."""
    sizes = []
    for _ in range(requests):
        n = sizer.next_bytes
        sizes.append(n)
        sizer.observe(n, n / rate + 0.05)
    return sizes


pytestmark = pytest.mark.timeout(10)


def test_the_first_request_is_small_whatever_the_cap() -> None:
    assert RequestSizer(30.0, CAP).next_bytes == FIRST_REQUEST_BYTES
    assert RequestSizer(30.0, 4096).next_bytes == 4096


def test_at_10_mbit_each_request_ends_within_a_quarter_of_the_timeout() -> None:
    rate = 10e6 / 8
    sizes = settle(RequestSizer(30.0, CAP), rate)
    assert all(n / rate + 0.05 <= 30.0 / 4 + 0.05 for n in sizes)
    # Past the first few it carries most of what fits (a round trip lost in ~7 s).
    assert sizes[-1] > 0.9 * rate * 30.0 / 4


def test_on_a_fast_link_requests_grow_at_most_fourfold_up_to_the_cap() -> None:
    sizes = settle(RequestSizer(30.0, CAP), 1e9)
    assert all(b <= MAX_GROWTH * a for a, b in itertools.pairwise(sizes))
    assert sizes[-1] == CAP


def test_a_link_that_slows_down_gets_smaller_requests_at_once() -> None:
    sizer = RequestSizer(30.0, CAP)
    settle(sizer, 100e6)
    assert sizer.next_bytes == CAP
    sizer.observe(CAP, 60.0)  # the link fell to ~1.1 MB/s
    assert sizer.next_bytes * 60.0 / CAP <= 30.0 / 4


def test_however_slow_the_link_a_request_asks_for_some_bytes() -> None:
    sizer = RequestSizer(30.0, CAP)
    sizer.observe(FIRST_REQUEST_BYTES, 1e6)
    assert sizer.next_bytes == MIN_REQUEST_BYTES
    sizer.observe(0, 0.0)  # (nothing measured: nothing changes)
    assert sizer.next_bytes == MIN_REQUEST_BYTES


@pytest.mark.parametrize(("timeout", "cap"), [(0.0, CAP), (-1.0, CAP), (30.0, 0)])
def test_a_timeout_or_cap_that_allows_no_request_is_refused(timeout: float, cap: int) -> None:
    with pytest.raises(ValueError):
        RequestSizer(timeout, cap)
