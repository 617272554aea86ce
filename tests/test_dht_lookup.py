"""The iterative lookup (`dht/lookup.py`) driven by a scripted network, with no sockets."""

from __future__ import annotations

import asyncio
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
