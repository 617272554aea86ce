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
from bisect import insort
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any, Final

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
    # The candidates' peers by distance to the target, kept sorted as they come:
    # every pass of the beam reads a key's best few of hundreds of candidates, and
    # sorting them all each time was most of a joining peer's CPU (its table fill
    # runs a dozen keys at once, each pass reading every key's best twice).
    _by_distance: list[tuple[int, PeerID]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        target = self.target
        self._by_distance = sorted((c.node_id ^ target, pid) for pid, c in self.candidates.items())

    def add(self, cand: Candidate) -> None:
        old = self.candidates.get(cand.peer_id)
        if old is None:
            insort(self._by_distance, (cand.node_id ^ self.target, cand.peer_id))
        if old is None or cand.depth < old.depth:
            self.candidates[cand.peer_id] = cand

    def best(self, k: int, stalled: set[PeerID]) -> list[Candidate]:
        """The k closest candidates that neither failed nor stalled."""
        state, cands = self.state, self.candidates
        live = (
            cands[pid]
            for _, pid in self._by_distance
            if state.get(pid) != FAILED and pid not in stalled
        )
        return self._closest(live, k)

    def closest_live(self, count: int) -> list[Candidate]:
        """The `count` closest candidates that did not fail (answered or not asked)."""
        state, cands = self.state, self.candidates
        live = (cands[pid] for _, pid in self._by_distance if state.get(pid) != FAILED)
        return self._closest(live, count)

    def closest_answered(self, count: int) -> list[Candidate]:
        target = self.target
        return self._closest(sorted(self.answered, key=lambda c: c.node_id ^ target), count)

    def _closest(self, ordered: Iterable[Candidate], count: int) -> list[Candidate]:
        """The first `count` of `ordered` (closest first), at most `per_group` per IP
        group first; the closest of the rest only fill slots no other group could (and
        come last)."""
        rest = iter(ordered)
        near = list(islice(rest, count))
        if self.per_group is None:
            return near
        groups = [c.group for c in near if c.group is not None]
        if len(groups) <= self.per_group or max(map(groups.count, set(groups))) <= self.per_group:
            return near  # the common case: no group over its share
        return diverse(chain(near, rest), self.per_group, _group, count, fill=True)

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


@dataclass(slots=True, eq=False)
class Ask:
    """One request the beam wants sent: `candidate`, asked about `lookups`."""

    candidate: Candidate
    lookups: list[KeyLookup]
    # When it stops holding up its lookups (set by `Beam.sent`).
    stalls_at: float = float("inf")


class Beam:
    """Which peers a traversal asks next and when it is done; no I/O, time passed in.

    Its driver (`traverse`) calls `pick(now)` and sends what it returns (telling
    `sent`), then reports each request's end (`answered` or `failed`) and calls
    `pick` again, until `finished`; it waits at most until `wake_at()` for an answer.
    """

    def __init__(
        self,
        lookups: Sequence[KeyLookup],
        *,
        k: int,
        alpha: int,
        stall_after: float,
        blocked: Callable[[PeerID], bool],
        max_in_flight: int = 64,
        group_of: Callable[[tuple[Multiaddr, ...]], str | None] | None = None,
    ) -> None:
        self.lookups = lookups
        self.k = k
        self.alpha = alpha
        self.stall_after = stall_after
        self.blocked = blocked
        self.max_in_flight = max_in_flight
        self.group_of = group_of
        # Keyed by request, not peer: one peer may have two requests in flight
        # (asked for one key, then, before answering, picked for another key by a
        # later pass).
        self.in_flight: set[Ask] = set()
        self.finished = False
        self._stalled: set[PeerID] = set()

    def pick(self, now: float) -> list[Ask]:
        """The requests to send now (each to `sent` once sent); sets `finished`."""
        stalled = {a.candidate.peer_id for a in self.in_flight if now >= a.stalls_at}
        self._stalled = stalled
        active = [lk for lk in self.lookups if not lk.done]
        wanted, order = self._wanted(active, stalled)
        if wanted and len(active) > 1:
            self._share(wanted, order, active, stalled)
        asks = []
        for pid in order:
            if len(self.in_flight) >= self.max_in_flight:
                break
            cand, lks = wanted[pid]
            if self.blocked(pid):
                for lk in lks:
                    lk.state[pid] = FAILED
                continue
            for lk in lks:
                lk.state[pid] = ASKED
            ask = Ask(cand, lks)
            self.in_flight.add(ask)
            asks.append(ask)
        if not self.in_flight and (not wanted or all(lk.done for lk in self.lookups)):
            for lk in self.lookups:
                lk.done = True
        # (Nothing in flight but something wanted: every peer wanted was blocked and
        # is now FAILED; the next pick asks the next ones.)
        self.finished = all(lk.done for lk in self.lookups)
        return asks

    def _wanted(
        self, active: list[KeyLookup], stalled: set[PeerID]
    ) -> tuple[dict[PeerID, tuple[Candidate, list[KeyLookup]]], list[PeerID]]:
        """Per peer to ask, the keys it is asked about, and the peers in order; marks the
        lookups that are done."""
        k = self.k
        waiting = {id(lk) for a in self.in_flight for lk in a.lookups}
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
            # Once the alpha closest have answered, the neighbourhood is found: ask
            # the rest of the k closest at once (the paper's final round) rather
            # than alpha at a time.
            closest_answered = all(lk.state.get(c.peer_id) == ANSWERED for c in best[: self.alpha])
            width = k if closest_answered else self.alpha
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
        return wanted, order

    def _share(
        self,
        wanted: dict[PeerID, tuple[Candidate, list[KeyLookup]]],
        order: list[PeerID],
        active: list[KeyLookup],
        stalled: set[PeerID],
    ) -> None:
        """A peer asked for one key is also asked for every other key whose best
        candidates it is among: one request, several keys."""
        best_sets = {id(lk): lk.best(self.k, stalled) for lk in active if not lk.done}
        for pid in order:
            _, lks = wanted[pid]
            for lk in active:
                if lk.done or lk in lks or pid in lk.state:
                    continue
                if any(c.peer_id == pid for c in best_sets[id(lk)]):
                    lks.append(lk)

    def sent(self, ask: Ask, now: float) -> None:
        """`ask` went out at `now`: past `stall_after` it stops holding up its keys."""
        ask.stalls_at = now + self.stall_after

    def wake_at(self) -> float | None:
        """When the next request that the last `pick` did not count as stalled stalls
        (None: none left; wait for an answer)."""
        # Decided by the same `stalled` set as the picks, not by a second reading of
        # the clock: a deadline that passed in between was neither acted on nor waited
        # for, and the lookup waited for the slow peer's answer (a timeout of None)
        # instead of asking the next.
        pending = [a.stalls_at for a in self.in_flight if a.candidate.peer_id not in self._stalled]
        return min(pending) if pending else None

    def failed(self, ask: Ask) -> None:
        self.in_flight.discard(ask)
        for lk in ask.lookups:
            lk.state[ask.candidate.peer_id] = FAILED

    def answered(self, ask: Ask, per_key: list[list[WireContact]]) -> None:
        """`ask`'s answer: per key, the contacts the peer returned."""
        self.in_flight.discard(ask)
        cand = ask.candidate
        for lk, contacts in zip(ask.lookups, per_key, strict=True):
            lk.state[cand.peer_id] = ANSWERED
            lk.answered.append(cand)
            lk.hops = max(lk.hops, cand.depth + 1)
            for wc in contacts:
                if wc.peer_id in lk.candidates or wc.peer_id in lk.skipped:
                    continue
                if self.blocked(wc.peer_id):
                    lk.skipped[wc.peer_id] = node_id(wc.peer_id)
                    continue
                group = None if self.group_of is None else self.group_of(wc.addrs)
                lk.add(Candidate(wc.peer_id, node_id(wc.peer_id), wc.addrs, cand.depth + 1, group))


# query(candidate, lookups) -> per lookup, the contacts the peer returned.
# It raises on any failure (timeout, transport error, garbage); it may also
# record values in the lookups (value lookups).
Query = Callable[[Candidate, list[KeyLookup]], Coroutine[Any, Any, list[list[WireContact]]]]


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
    """Run the lookups to convergence (the `Beam`'s asyncio driver). Every request
    task is owned here and cancelled before returning. `clock` (default: the loop's)
    is for tests. `group_of`: the IP group of a contact learned from an answer, by
    its addresses."""
    loop = asyncio.get_running_loop()
    now_fn = clock or loop.time
    beam = Beam(
        lookups,
        k=k,
        alpha=alpha,
        stall_after=stall_after,
        blocked=blocked,
        max_in_flight=max_in_flight,
        group_of=group_of,
    )
    in_flight: dict[asyncio.Task[list[list[WireContact]]], Ask] = {}
    try:
        while True:
            for ask in beam.pick(now_fn()):
                in_flight[loop.create_task(query(ask.candidate, ask.lookups))] = ask
                # Deadlines, not start times: `now >= deadline` and the wait
                # `deadline - now` then agree; with start times, `now - start <
                # stall_after` could hold while `start + stall_after - now` rounded to
                # 0.0, and the loop spun on zero timeouts without uvloop's clock moving.
                beam.sent(ask, now_fn())
            if beam.finished:
                return
            if not in_flight:
                continue  # everything wanted was blocked: pick again
            wake = beam.wake_at()
            timeout = None if wake is None else max(0.0, wake - now_fn())
            done, _ = await asyncio.wait(
                in_flight, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            # In the order they were sent, not the done set's (the tasks' addresses
            # in memory): which answer the beam takes first must not follow the heap.
            for task in [t for t in in_flight if t in done]:
                ask = in_flight.pop(task)
                exc = task.exception()
                if exc is None:
                    beam.answered(ask, task.result())
                else:
                    beam.failed(ask)
                    on_failure(ask.candidate, exc)
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
