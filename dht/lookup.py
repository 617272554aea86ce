"""Iterative Kademlia lookups of many keys in one traversal.

Each key keeps its own candidate set, but a peer that is among the current best
candidates of several keys gets ONE request naming all of them (the beam
search of hivemind, and what makes `get_many` of 20 keys cost about as many
round trips as one `get`).

Per key, up to `alpha` requests are in flight among its `k` closest
candidates; the key converges when its `k` closest live candidates have all
answered (or, for value lookups, when enough holders answered). A request that
has been pending for `stall_after` seconds stops counting: the lookup moves on
to the next candidate instead of waiting for a slow peer, and still uses the
answer if it comes before the hop timeout.

Sybil resistance (see `admission`): with `per_group` set, one IP group takes at
most that many of a key's `k` best candidates, so colluding peers in one /24
that answer each other with IDs ground next to the key fill a couple of the
beam's slots and the lookup still converges on the closest honest peers; and a
value lookup's early stop counts its holders by group, so holders in one /24
count once and cannot end it alone. The beam is the lookup's defence here, in
place of S/Kademlia's disjoint paths: those survive a *share* of bad peers
spread over the network, but an attacker holding every ID near the key sits
on every path's last hops; a cap per group bounds its share of each step by
what it cannot make for free, its addresses.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

from .admission import distinct_groups, diverse
from .protocol import WireContact
from .records import Record
from .routing import node_id

ASKED: Final = 1
ANSWERED: Final = 2
FAILED: Final = 3


@dataclass(slots=True, eq=False)
class Candidate:
    peer_id: PeerID
    node_id: int
    addrs: tuple[Multiaddr, ...]
    # Number of answers between the routing table and this contact: 0 for
    # contacts from our own table, d + 1 for those learned from a depth-d peer.
    depth: int
    # Its IP group (admission.ip_group), None when exempt or unknown.
    group: str | None = None


def _group(c: Candidate) -> str | None:
    return c.group


@dataclass(slots=True, eq=False)
class KeyLookup:
    """The state of one key in a traversal; `key` is set for value lookups."""

    target: int
    key: str | None = None
    # Value lookups stop once this many peers returned records (None: never early).
    quorum: int | None = None
    # Done once this many of the closest live candidates answered (None: all k).
    # Stores settle early: the store requests themselves then prove which of
    # the closest candidates are alive, instead of a final find_node round.
    settle: int | None = None
    # At most this many of the k best candidates (and of the holders counted for
    # the quorum) per IP group; None: no cap.
    per_group: int | None = None
    candidates: dict[PeerID, Candidate] = field(default_factory=dict)
    state: dict[PeerID, int] = field(default_factory=dict)
    answered: list[Candidate] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    holders: list[Candidate] = field(default_factory=list)
    # Contacts left out because we blacklisted them (node ids by peer): a key not
    # found may sit with them, after a burst of our own timeouts (a stall).
    skipped: dict[PeerID, int] = field(default_factory=dict)
    hops: int = 0
    done: bool = False

    def add(self, cand: Candidate) -> None:
        old = self.candidates.get(cand.peer_id)
        if old is None or cand.depth < old.depth:
            self.candidates[cand.peer_id] = cand

    def best(self, k: int, stalled: set[PeerID]) -> list[Candidate]:
        """The k closest candidates that neither failed nor stalled."""
        state = self.state
        live = (
            c
            for c in self.candidates.values()
            if state.get(c.peer_id) != FAILED and c.peer_id not in stalled
        )
        return self._closest(live, k)

    def closest_live(self, count: int) -> list[Candidate]:
        """The `count` closest candidates that did not fail (answered or not asked)."""
        state = self.state
        live = (c for c in self.candidates.values() if state.get(c.peer_id) != FAILED)
        return self._closest(live, count)

    def closest_answered(self, count: int) -> list[Candidate]:
        return self._closest(self.answered, count)

    def _closest(self, cands: Iterable[Candidate], count: int) -> list[Candidate]:
        """The `count` closest of `cands`, at most `per_group` per IP group first; the
        closest of the rest only fill slots no other group could (and come last)."""
        target = self.target
        if self.per_group is None:
            return heapq.nsmallest(count, cands, key=lambda c: c.node_id ^ target)
        pool = list(cands)
        near = heapq.nsmallest(count, pool, key=lambda c: c.node_id ^ target)
        groups = [c.group for c in near if c.group is not None]
        if len(groups) <= self.per_group or max(map(groups.count, set(groups))) <= self.per_group:
            return near  # the common case: no group over its share, no full sort
        pool.sort(key=lambda c: c.node_id ^ target)
        return diverse(pool, self.per_group, _group, count, fill=True)

    def skipped_near(self, k: int) -> bool:
        """Whether a contact we blacklisted would have been among the `k` closest
        that answered: what the lookup found may not be the key's neighbourhood."""
        if not self.skipped:
            return False
        answered = self.closest_answered(k)
        if len(answered) < k:
            return True
        edge = answered[-1].node_id ^ self.target
        return any(nid ^ self.target < edge for nid in self.skipped.values())

    def quorum_reached(self) -> bool:
        """Enough holders answered, counting one IP group once (with `per_group`)."""
        if self.quorum is None:
            return False
        if self.per_group is None:
            return len(self.holders) >= self.quorum
        return distinct_groups((c.peer_id, c.group) for c in self.holders) >= self.quorum


# query(candidate, lookups) -> per lookup, the contacts the peer returned.
# It raises on any failure (timeout, transport error, garbage); it may also
# record values in the lookups (value lookups).
Query = Callable[[Candidate, list[KeyLookup]], Awaitable[list[list[WireContact]]]]


async def traverse(
    lookups: Sequence[KeyLookup],
    query: Query,
    *,
    k: int,
    alpha: int,
    stall_after: float,
    on_failure: Callable[[Candidate, BaseException], None],
    blocked: Callable[[PeerID], bool],
    max_in_flight: int = 64,
    clock: Callable[[], float] | None = None,
    group_of: Callable[[tuple[Multiaddr, ...]], str | None] | None = None,
) -> None:
    """Run the lookups to convergence. Every request task is owned here and
    cancelled before returning. `clock` (default: the loop's) is for tests.
    `group_of`: the IP group of a contact learned from an answer, by its addresses."""
    loop = asyncio.get_running_loop()
    now_fn = clock or loop.time
    in_flight: dict[asyncio.Task[list[list[WireContact]]], tuple[Candidate, list[KeyLookup]]] = {}
    # When each request stalls, keyed by task: one peer may have two requests in
    # flight (asked for one key, then, before answering, picked for another key by a
    # later round). Deadlines, not start times: `now >= deadline` and the wait
    # `deadline - now` then agree; with start times, `now - start < stall_after`
    # could hold while `start + stall_after - now` rounded to 0.0, and the loop
    # spun on zero timeouts without uvloop's clock advancing.
    stalls_at: dict[asyncio.Task[list[list[WireContact]]], float] = {}
    try:
        while True:
            now = now_fn()
            stalled = {in_flight[t][0].peer_id for t, at in stalls_at.items() if now >= at}
            active = [lk for lk in lookups if not lk.done]
            waiting = {id(lk) for _, lks in in_flight.values() for lk in lks}
            wanted: dict[PeerID, tuple[Candidate, list[KeyLookup]]] = {}
            order: list[PeerID] = []
            for lk in active:
                if lk.quorum_reached():
                    lk.done = True
                    continue
                best = lk.best(k, stalled)
                need = best if lk.settle is None else best[: lk.settle]
                # Converged: its best live candidates answered. Not while every one of
                # them is a slow peer still expected to answer (a far link: all of
                # them stalled, none to move on to): then it waits for them.
                if all(lk.state.get(c.peer_id) == ANSWERED for c in need) and (
                    need or id(lk) not in waiting
                ):
                    lk.done = True
                    continue
                busy = sum(1 for c in best if lk.state.get(c.peer_id) == ASKED)
                # Once the alpha closest have answered, the neighbourhood is
                # found: ask the rest of the k closest at once (the paper's
                # final round) rather than alpha at a time.
                width = (
                    k if all(lk.state.get(c.peer_id) == ANSWERED for c in best[:alpha]) else alpha
                )
                for c in best:
                    if busy >= width:
                        break
                    if c.peer_id in lk.state:
                        continue
                    busy += 1
                    entry = wanted.get(c.peer_id)
                    if entry is None:
                        wanted[c.peer_id] = (c, [lk])
                        order.append(c.peer_id)
                    else:
                        entry[1].append(lk)
            # A peer asked for one key is also asked for every other key whose
            # best candidates it is among: one request, several keys.
            if wanted and len(active) > 1:
                best_sets = {id(lk): lk.best(k, stalled) for lk in active if not lk.done}
                for pid in order:
                    cand, lks = wanted[pid]
                    for lk in active:
                        if lk.done or lk in lks or pid in lk.state:
                            continue
                        if any(c.peer_id == pid for c in best_sets[id(lk)]):
                            lks.append(lk)
            for pid in order:
                if len(in_flight) >= max_in_flight:
                    break
                cand, lks = wanted[pid]
                if blocked(pid):
                    for lk in lks:
                        lk.state[pid] = FAILED
                    continue
                for lk in lks:
                    lk.state[pid] = ASKED
                task = loop.create_task(query(cand, lks))
                in_flight[task] = (cand, lks)
                stalls_at[task] = now_fn() + stall_after
            if not in_flight:
                if all(lk.done for lk in lookups) or not wanted:
                    for lk in lookups:
                        lk.done = True
                    return
                continue  # everything wanted was blocked: pick again
            if all(lk.done for lk in lookups):
                return
            # Wake on the next answer, or when the next request that this pass did not
            # count as stalled does. Decided by the same `stalled` set as the picks
            # above, not by a second reading of the clock: a deadline that passed in
            # between was neither acted on nor waited for, and the lookup waited for
            # the slow peer's answer (a timeout of None) instead of asking the next.
            pending = [at for t, at in stalls_at.items() if in_flight[t][0].peer_id not in stalled]
            timeout = max(0.0, min(pending) - now_fn()) if pending else None
            done, _ = await asyncio.wait(
                in_flight, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                cand, lks = in_flight.pop(task)
                del stalls_at[task]
                exc = task.exception()
                if exc is not None:
                    for lk in lks:
                        lk.state[cand.peer_id] = FAILED
                    on_failure(cand, exc)
                    continue
                per_key = task.result()
                for lk, contacts in zip(lks, per_key, strict=True):
                    lk.state[cand.peer_id] = ANSWERED
                    lk.answered.append(cand)
                    lk.hops = max(lk.hops, cand.depth + 1)
                    for wc in contacts:
                        if wc.peer_id in lk.candidates or wc.peer_id in lk.skipped:
                            continue
                        if blocked(wc.peer_id):
                            lk.skipped[wc.peer_id] = node_id(wc.peer_id)
                            continue
                        lk.add(
                            Candidate(
                                wc.peer_id,
                                node_id(wc.peer_id),
                                wc.addrs,
                                cand.depth + 1,
                                None if group_of is None else group_of(wc.addrs),
                            )
                        )
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
