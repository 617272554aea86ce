"""The daemon measures its clock against its peers' and says when it is off.

A clock minutes off breaks matchmaking (declarations live 30 s by the wall clock),
so the daemon must say so, with what to do, instead of silently never finding a
group."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

import shoal.dht.server as dht_server
from shoal.dht.node import DHTNode
from shoal.peer.status.clock_watch import MAX_RTT_S, ClockWatch, SkewEstimate
from shoal.transport.identity import Identity, PeerID

HOST_OPTS = {"max_connections_per_ip": 100_000, "close_grace": 0.1}


def peer() -> PeerID:
    return Identity.generate().peer_id


def test_the_estimate_is_the_median_so_one_wrong_clock_moves_nothing() -> None:
    est = SkewEstimate()
    ids = [peer() for _ in range(3)]
    for p, theirs in zip(ids, [1000.0, 1000.5, 1400.0], strict=True):
        assert est.observe(p, sent=1000.0, theirs=theirs, received=1000.2, now=0.0)
    assert est.median(0.0) == pytest.approx(1000.1 - 1000.5)


def test_half_the_peers_wrong_is_not_enough_to_call_our_clock_off() -> None:
    """Two of four peers 164 s ahead (in the soak: peers restarted with wrong clocks):
    the even count's middle offsets are 0 and -164, and the estimate takes the one
    nearer zero; three of four would move it."""
    est = SkewEstimate()
    ids = [peer() for _ in range(4)]
    for p, theirs in zip(ids, [1000.1, 1000.1, 1164.1, 1164.1], strict=True):
        est.observe(p, sent=1000.0, theirs=theirs, received=1000.2, now=0.0)
    assert est.median(0.0) == pytest.approx(0.0)
    est.observe(ids[0], sent=1000.0, theirs=1164.1, received=1000.2, now=0.0)
    assert est.median(0.0) == pytest.approx(-164.0)


def test_a_slow_answer_or_a_stale_one_does_not_count() -> None:
    est = SkewEstimate()
    a, b = peer(), peer()
    assert not est.observe(a, sent=0.0, theirs=500.0, received=MAX_RTT_S + 0.1, now=0.0)
    assert est.median(0.0) is None
    assert est.observe(b, sent=0.0, theirs=-60.0, received=0.1, now=0.0)
    assert est.median(1.0) == pytest.approx(60.05)
    assert est.median(10_000.0) is None  # heard from too long ago


@pytest.mark.timeout(30)
async def test_a_clock_minutes_off_is_said_once_with_what_to_do(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # Every peer of this process answers pings with a clock 5 minutes ahead of ours.
    real = time.time
    # (dht/server.py answers the DHT's requests, pings included)
    monkeypatch.setattr(dht_server, "time", SimpleNamespace(time=lambda: real() + 300.0))
    nodes = []
    try:
        for _ in range(4):
            host = await make_host(**HOST_OPTS)
            boot = [str(nodes[0].host.addresses()[0])] if nodes else []
            nodes.append(await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0))
        watch = ClockWatch(nodes[0].host)
        others = [n.host.peer_id for n in nodes[1:]]
        for n in nodes[1:]:
            await nodes[0].host.connect(n.host.addresses()[0])
        with caplog.at_level(logging.INFO, logger="shoal.peer"):
            skew = await watch.check(others)
            await watch.check(others)
        assert skew == pytest.approx(-300.0, abs=2.0)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "-300 s off the median of 3 peers" in warnings[0].getMessage()
        assert "NTP" in warnings[0].getMessage()

        # Their clocks are fixed: we say so, once.
        monkeypatch.setattr(dht_server, "time", time)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shoal.peer"):
            assert abs(await watch.check(others) or 0) < 2.0
        assert any("within" in r.getMessage() for r in caplog.records)
    finally:
        for n in nodes:
            await n.aclose()
