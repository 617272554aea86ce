"""The iterative lookup (`dht/lookup.py`) driven by a scripted network, with no sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from shoal.dht.lookup import Candidate, KeyLookup, traverse
from shoal.dht.protocol import WireContact
from shoal.dht.routing import node_id
from shoal.transport.identity import Identity, PeerID


def _peers(n: int) -> list[PeerID]:
    return [Identity.generate().peer_id for _ in range(n)]


def _cand(peer: PeerID) -> Candidate:
    return Candidate(peer, node_id(peer), (), 0)


async def test_one_peer_may_be_asked_twice_at_once_for_different_keys() -> None:
    """A slow peer asked for key A, then (by a later round, before it answered) for key
    B: two requests in flight to one peer must both be tracked (this used to raise
    KeyError when the first answer came back)."""
    slow, fast = _peers(2)
    a = KeyLookup(1, "a")
    b = KeyLookup(2, "b")
    a.add(_cand(slow))
    b.add(_cand(fast))
    asked: list[tuple[PeerID, list[str | None]]] = []

    async def query(cand: Candidate, lookups: list[KeyLookup]) -> list[list[WireContact]]:
        asked.append((cand.peer_id, [lk.key for lk in lookups]))
        if cand.peer_id == fast:
            # B learns about the slow peer while the slow peer still works on A.
            return [[WireContact(slow, ())]]
        await asyncio.sleep(0.05 if lookups[0] is a else 0.01)
        return [[] for _ in lookups]

    async with asyncio.timeout(5):
        await traverse(
            [a, b],
            query,
            k=20,
            alpha=3,
            stall_after=1.0,
            on_failure=lambda c, e: None,
            blocked=lambda p: False,
        )
    assert (slow, ["a"]) in asked and (slow, ["b"]) in asked
    assert a.done and b.done
    assert {c.peer_id for c in b.answered} == {fast, slow}


async def test_a_stalled_peer_stops_holding_the_lookup() -> None:
    """alpha = 1 and the closest peer does not answer: after `stall_after` the lookup
    asks the next one instead of waiting for the hop timeout, and finishes."""
    slow, other = _peers(2)
    lk = KeyLookup(node_id(slow), "k", quorum=1)  # the slow peer is the closest
    lk.add(_cand(slow))
    lk.add(_cand(other))
    events: list[str] = []

    async def query(cand: Candidate, lookups: list[KeyLookup]) -> Any:
        if cand.peer_id == slow:
            events.append("slow asked")
            await asyncio.sleep(3)
            events.append("slow answered")
            return [[]]
        events.append("other asked")
        lookups[0].holders.append(cand)  # the other peer holds the value
        return [[]]

    async with asyncio.timeout(2):
        await traverse(
            [lk],
            query,
            k=20,
            alpha=1,
            stall_after=0.05,
            on_failure=lambda c, e: None,
            blocked=lambda p: False,
        )
    assert events == ["slow asked", "other asked"]  # done without the slow answer
    assert lk.done


async def test_when_every_candidate_is_slow_the_lookup_waits_for_their_answers() -> None:
    """A far link: the only peer known (a bootstrap behind 300 ms of RTT) answers after
    `stall_after`. Stalled, it no longer holds up the lookup, but with nobody to move
    on to, the lookup waits for its answer instead of ending empty-handed (a joiner
    once found no experiment this way)."""
    (far,) = _peers(1)
    lk = KeyLookup(1, "k", quorum=1)
    lk.add(_cand(far))

    async def query(cand: Candidate, lookups: list[KeyLookup]) -> Any:
        await asyncio.sleep(0.2)
        lookups[0].holders.append(cand)
        return [[]]

    async with asyncio.timeout(5):
        await traverse(
            [lk], query, k=20, alpha=3, stall_after=0.02,
            on_failure=lambda c, e: None, blocked=lambda p: False,
        )  # fmt: skip
    assert lk.done and [c.peer_id for c in lk.holders] == [far]


async def test_a_deadline_passing_between_two_clock_readings_still_counts_as_a_stall() -> None:
    """The clock read at the top of a pass (deadline not yet reached) and again to size
    the wait (deadline passed): the lookup must wake to count the stall, not wait for
    the slow peer's answer. Scripted clock: this is the race CI once hit."""
    slow, other = _peers(2)
    lk = KeyLookup(node_id(slow), "k", quorum=1)
    lk.add(_cand(slow))
    lk.add(_cand(other))
    # pass 1: top, the slow peer's deadline (0.05), the wait; pass 2: top (before the
    # deadline), the wait (after it); then time moves on.
    script = iter([0.0, 0.0, 0.0, 0.049, 0.051])
    later = [0.051]

    def clock() -> float:
        value = next(script, None)
        if value is None:
            later[0] += 0.01
            value = later[0]
        return value

    async def query(cand: Candidate, lookups: list[KeyLookup]) -> Any:
        if cand.peer_id == slow:
            await asyncio.sleep(30)
        lookups[0].holders.append(cand)
        return [[]]

    async with asyncio.timeout(5):
        await traverse(
            [lk],
            query,
            k=20,
            alpha=1,
            stall_after=0.05,
            on_failure=lambda c, e: None,
            blocked=lambda p: False,
            clock=clock,
        )
    assert [c.peer_id for c in lk.holders] == [other]


class _ScriptedPeers:
    """Answers every request with no contacts after `delay(peer)` seconds, logging
    asks and answers and counting the requests out at once."""

    def __init__(self, delay: Callable[[PeerID], float]) -> None:
        self.delay = delay
        self.events: list[tuple[str, PeerID]] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def query(self, cand: Candidate, lookups: list[KeyLookup]) -> Any:
        self.events.append(("asked", cand.peer_id))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay(cand.peer_id))
            self.events.append(("answered", cand.peer_id))
            return [[] for _ in lookups]
        finally:
            self.in_flight -= 1


async def test_slow_peers_do_not_keep_one_key_from_asking_fast_ones() -> None:
    """One key, as `DHTNode` runs it: alpha = 3 and 3 places in flight. The 12 peers
    closest to the target answer late; the 18 others at once. Stalled requests give
    their places up, so every fast peer is asked before the first slow answer comes
    back (once, 3 slow peers held the places until they answered: 4 rounds of the slow
    answer). A key left short of k answers then waits for slow answers to fill it."""
    target = 0
    peers = sorted(_peers(30), key=lambda p: node_id(p) ^ target)
    slow, fast = set(peers[:12]), set(peers[12:])
    lk = KeyLookup(target)
    for p in peers:
        lk.add(_cand(p))
    net = _ScriptedPeers(lambda p: 0.5 if p in slow else 0.0)

    async with asyncio.timeout(10):
        await traverse(
            [lk], net.query, k=20, alpha=3, stall_after=0.02, max_in_flight=3,
            on_failure=lambda c, e: None, blocked=lambda p: False,
        )  # fmt: skip
    events = net.events
    first_slow_answer = events.index(next(e for e in events if e[0] == "answered" and e[1] in slow))
    asked_before = {p for what, p in events[:first_slow_answer] if what == "asked"}
    assert fast <= asked_before
    # 18 fast answers leave the key short of 20: it waited for slow answers to fill it.
    assert lk.done
    answered = {c.peer_id for c in lk.closest_answered(20)}
    assert len(answered) == 20 and answered & slow
    assert net.most_in_flight <= 3 + 20  # stalled requests still count toward a hard limit


async def test_a_lookup_among_slow_peers_keeps_a_hard_limit_on_requests_in_flight() -> None:
    """Every peer is slow: stalls free places for new requests, but no more than
    `max_in_flight + k` requests are ever out at once."""
    lk = KeyLookup(0)
    for p in _peers(60):
        lk.add(_cand(p))
    net = _ScriptedPeers(lambda p: 0.3)

    async with asyncio.timeout(10):
        await traverse(
            [lk], net.query, k=4, alpha=2, stall_after=0.01, max_in_flight=2,
            on_failure=lambda c, e: None, blocked=lambda p: False,
        )  # fmt: skip
    assert net.most_in_flight == 2 + 4
    assert lk.done
