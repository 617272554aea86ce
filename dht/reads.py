"""The reading side of a DHT node: values merged from their replicas and the
nodes nearest to targets, each looked up once more when our side failed it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Protocol

from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

from .admission import DiversityPolicy
from .errors import PeerBusy
from .lookup import ANSWERED, FAILED, Candidate, KeyLookup
from .protocol import (
    ID_BYTES,
    DHTProtocolError,
    WireContact,
    cursors_to_wire,
    parse_cursors,
    parse_nearest,
    parse_tags,
    parse_values,
    tags_to_wire,
)
from .records import Record, RecordValidator
from .replica_reads import ReplicaReads, ReplicaSets
from .routing import RoutingTable, key_id
from .storage import LocalStorage, StoredValue, merge_records


class ReadingNode(Protocol):
    """What the reader needs of its node (`DHTNode` is one)."""

    peer_id: PeerID
    k: int
    value_quorum: int
    cache_along_path: bool
    storage: LocalStorage
    validator: RecordValidator
    routing_table: RoutingTable

    def count(self, counter: str, n: int = 1) -> int: ...
    def _on_failure(self, cand: Candidate, exc: BaseException) -> None: ...
    def _blocked(self, peer: PeerID) -> bool: ...
    def _cache(self, lk: KeyLookup, merged: StoredValue) -> None: ...
    async def _traverse(
        self, lookups: list[KeyLookup], query: Any, *, skip_blacklisted: bool = True
    ) -> None: ...

    diversity: DiversityPolicy

    def hello(self) -> dict[str, Any]: ...
    def _observed_ip(self, peer: PeerID) -> str | None: ...
    def _rtt(self, peer: PeerID) -> float | None: ...
    def add_contact(
        self,
        peer: PeerID,
        addrs: Sequence[Multiaddr],
        *,
        replace: bool,
        observed_ip: str | None = None,
    ) -> None: ...
    async def _request(
        self, peer: PeerID, addrs: Sequence[Multiaddr], method: str, payload: Any
    ) -> Any: ...


# A sampled read asks its other replicas once the first answered, or HEDGE_RTTS of
# its RTT (and HEDGE_SLACK_S for the two loops) after asking it, at most HEDGE_S:
# a slow first replica (a loaded peer, a loaded us) then costs the bytes it would
# have saved, not the read's time (see `Reader.sampled_value`).
HEDGE_S = 0.5
HEDGE_RTTS = 2.0
HEDGE_SLACK_S = 0.05


class Reader:
    """Runs a node's value and node lookups, with their second tries."""

    def __init__(self, node: ReadingNode, *, delta_reads: bool = True) -> None:
        self.node = node
        self._loop = asyncio.get_running_loop()
        # What each replica answered last, for delta reads (None: full reads).
        self.replica_reads = ReplicaReads() if delta_reads else None
        # The replicas each key's last full latest read found, for sampled reads.
        self.replica_sets = ReplicaSets()

    def _answered(self, cand: Candidate) -> None:
        # We reached it at these addresses: it is a verified contact, and its group
        # is that of the IP we reached, whatever it was advertised with.
        ip = self.node._observed_ip(cand.peer_id)
        if ip is not None:
            cand.group = self.node.diversity.group_of_ip(ip)
        self.node.add_contact(cand.peer_id, cand.addrs, replace=False, observed_ip=ip)

    async def query_find_node(
        self, cand: Candidate, lookups: list[KeyLookup]
    ) -> list[list[WireContact]]:
        ids = [lk.target.to_bytes(ID_BYTES, "big") for lk in lookups]
        reply = await self.node._request(
            cand.peer_id, cand.addrs, "find_node", {**self.node.hello(), "ids": ids}
        )
        _, per_key = parse_nearest(
            reply, len(ids), self.node.k, local=self.node.peer_id, responder=cand.peer_id
        )
        self._answered(cand)
        return per_key

    async def query_find_value(
        self,
        cand: Candidate,
        lookups: list[KeyLookup],
        known: dict[int, dict[bytes, Record]] | None = None,
        *,
        contacts: bool = True,
    ) -> list[list[WireContact]]:
        """Ask `cand` for the lookups' keys; `known` (by key index, records by tag):
        what we hold already, which it names rather than sends (protocol: ``known``);
        not `contacts`: no nearest peers wanted (a read of replicas already found)."""
        keys: list[str] = [lk.key for lk in lookups]  # type: ignore[misc]
        assert all(k is not None for k in keys)
        kept = self.replica_reads
        since = {}
        if kept is not None:
            for i, key in enumerate(keys):
                if (cursor := kept.since(key, cand.peer_id)) is not None:
                    since[i] = cursor
        request: dict[str, Any] = {**self.node.hello(), "keys": keys}
        if since:
            request["since"] = cursors_to_wire(since)
        if known:
            request["known"] = tags_to_wire(known)
        if not contacts:
            request["contacts"] = False
        reply = await self.node._request(cand.peer_id, cand.addrs, "find_value", request)
        response, per_key = parse_nearest(
            reply, len(keys), self.node.k, local=self.node.peer_id, responder=cand.peer_id
        )
        values = parse_values(response, keys)
        cursors = parse_cursors(response.get("cursors"), len(keys))
        had = parse_tags(response.get("had"), len(keys), "had") if known else {}
        self._answered(cand)
        now = time.time()
        for i, lk in enumerate(lookups):
            records = values.get(keys[i], [])
            if had.get(i):  # (named, not sent: ours, which it holds too)
                ours = (known or {}).get(i, {})
                records = [*records, *(ours[t] for t in had[i] if t in ours)]
            if kept is not None:
                records = kept.answered(
                    keys[i], cand.peer_id, since.get(i), cursors.get(i), records, now
                )
            if records:
                lk.records.extend(records)
                lk.holders.append(cand)
        return per_key

    async def find_nodes(
        self, targets: Sequence[int], *, settle: int | None = None
    ) -> list[KeyLookup]:
        """One finished lookup per distinct target, its second try merged in. `settle`:
        each ends once that many of its closest candidates answered (`KeyLookup`)."""
        node = self.node
        lookups = [KeyLookup(t, settle=settle) for t in dict.fromkeys(targets)]
        await node._traverse(lookups, self.query_find_node)
        # Fewer than k peers answered and at least as many failed: more like a burst
        # of timeouts on our side (a loaded machine, a GC pause), which blacklists a
        # whole neighbourhood at once, than like dead peers. Look once more, asking
        # the peers the blacklist would skip, and keep the answers of both. A healthy
        # lookup, or a small network with a dead peer, still costs one traversal.
        retry = {
            id(lk): KeyLookup(lk.target, settle=settle) for lk in lookups if self._mostly_failed(lk)
        }
        if retry:
            node.count("node_retries", len(retry))
            await node._traverse(list(retry.values()), self.query_find_node, skip_blacklisted=False)
        for lk in lookups:
            again = retry.get(id(lk))
            if again is not None:
                seen = {c.peer_id for c in lk.answered}
                lk.answered += [c for c in again.answered if c.peer_id not in seen]
                lk.hops = max(lk.hops, again.hops)
        return lookups

    def _mostly_failed(self, lk: KeyLookup) -> bool:
        # Failed, or still pending when the lookup ended (stalled): not answered.
        unanswered = sum(1 for state in lk.state.values() if state != ANSWERED)
        if not lk.answered and self._skipped_all(lk):
            return True
        k = self.node.k
        return unanswered > 0 and len(lk.answered) <= unanswered and len(lk.answered) < k

    def _skipped_all(self, lk: KeyLookup) -> bool:
        """No peer answered `lk`, and known peers near its target are blacklisted."""
        if lk.answered:
            return False
        nearest = self.node.routing_table.nearest(lk.target, self.node.k)
        return any(self.node._blocked(c.peer_id) for c in nearest)

    async def find_values(
        self,
        keys: list[str],
        *,
        latest: bool,
        within: float | None = None,
        first_lookups: list[KeyLookup] | None = None,
    ) -> dict[str, StoredValue]:
        """The values of `keys` merged from the replicas found; `first_lookups`, when
        given, receives each key's first lookup (the replicas it reached)."""
        node = self.node
        until = None if within is None else self._loop.time() + within
        local = node.storage.get_many(keys, time.time())
        lookups = []
        for key in keys:
            lk = KeyLookup(key_id(key), key, quorum=None if latest else node.value_quorum)
            held = local.get(key)
            if held is not None:
                lk.records.extend(held.records())
                lk.holders.append(Candidate(node.peer_id, node.routing_table.local_id, (), 0))
            lookups.append(lk)
        if first_lookups is not None:
            first_lookups.extend(lookups)
        if not await self._traverse_until(until, lookups, self.query_find_value):
            return self._merge_found(lookups)  # out of time: what answered so far
        # A key found nowhere while some of the peers asked for it failed (a timeout
        # on a loaded machine, a GC pause): look once more, asking peers that the
        # blacklist would skip. A miss is where a second try is worth its cost; in a
        # healthy network a missing key still costs one traversal.
        # So is one that skipped blacklisted peers nearer the key than the ones that
        # answered: after one timeout, a peer that knows only its bootstrap peer
        # would see nothing for `blacklist_for` seconds (a joiner then finds no
        # experiment); after a stall that timed out a lookup's final round (k
        # requests at once), the key's holders are all blacklisted, and the lookup
        # converges on the peers just past them, which hold nothing.
        retry = [
            KeyLookup(lk.target, lk.key, quorum=lk.quorum)
            for lk in lookups
            if not lk.records
            and (any(st == FAILED for st in lk.state.values()) or lk.skipped_near(node.k))
        ]
        if retry:
            node.count("value_retries", len(retry))
            lookups += retry
            await self._traverse_until(until, retry, self.query_find_value, skip_blacklisted=False)
        return self._merge_found(lookups)

    async def sampled_value(
        self, key: str, sample: int, within: float | None
    ) -> StoredValue | None:
        """A latest read of `key` from `sample` replicas drawn at random among those
        its last full latest read found (`ReplicaSets`), ourselves included when we
        are one; a full latest read when none is known, or when none of those drawn
        answers. A replica that fails is dropped from the set until the next full
        read, which happens when the set is too small or too old."""
        now = self._loop.time()
        until = None if within is None else now + within
        chosen = self.replica_sets.draw(key, sample, now, self.node._blocked)
        if chosen is None:
            return await self._full_latest_read(key, within)
        lk = KeyLookup(key_id(key), key)
        held = self.node.storage.get(key, time.time())
        if held is not None:
            lk.records.extend(held.records())
        self.node.count("sampled_reads")

        answered: list[Candidate] = []

        async def ask(cand: Candidate, known: dict[bytes, Record] | None = None) -> None:
            try:
                await self.query_find_value(
                    cand, [lk], {0: known} if known else None, contacts=False
                )
                answered.append(cand)
            except (TransportError, TimeoutError, OSError, DHTProtocolError, PeerBusy) as e:
                self.node._on_failure(cand, e)
                self.replica_sets.failed(key, cand.peer_id)

        # One replica first, the others once it answered (or its hedge passed) with what
        # it sent named rather than sent again: every replica holds every change, and
        # asked at once each sent it (three times over in matchmaking's polls, about
        # half of a sparse round's DHT bytes).
        first = asyncio.ensure_future(ask(chosen[0]))
        try:
            async with asyncio.timeout_at(until):
                if len(chosen) > 1:
                    await asyncio.wait({first}, timeout=self._hedge(chosen[0], until))
                    gathered = {r.tag(): r for r in lk.records}
                    await asyncio.gather(first, *(ask(c, gathered) for c in chosen[1:]))
                else:
                    await first
        except TimeoutError:
            self.node.count("partial_reads")
        finally:
            first.cancel()
        if not answered:
            left = None if until is None else until - self._loop.time()
            if left is None or left > 0:
                return await self._full_latest_read(key, left)
        return merge_records(key, lk.records, time.time(), self.node.validator)

    def _hedge(self, first: Candidate, until: float | None) -> float:
        """How long a sampled read waits for its first replica before asking the others
        (HEDGE_RTTS of the RTT to it, at most HEDGE_S and a third of the time left)."""
        rtt = self.node._rtt(first.peer_id)
        hedge = HEDGE_S if rtt is None else min(HEDGE_S, HEDGE_RTTS * rtt + HEDGE_SLACK_S)
        if until is not None:
            hedge = min(hedge, (until - self._loop.time()) / 3)
        return max(0.0, hedge)

    async def _full_latest_read(self, key: str, within: float | None) -> StoredValue | None:
        """`find_values` of one key with latest, remembering the replicas it found."""
        lookups: list[KeyLookup] = []
        found = await self.find_values([key], latest=True, within=within, first_lookups=lookups)
        if lookups:
            replicas = lookups[0].closest_answered(self.node.k)
            self.replica_sets.found(key, replicas, self._loop.time())
        return found.get(key)

    async def _traverse_until(
        self, until: float | None, lookups: list[KeyLookup], query: Any, **kw: Any
    ) -> bool:
        """The node's traversal, stopped at loop time `until` (None: never); whether it
        ended before then. What the lookups gathered stays in them either way."""
        if until is None:
            await self.node._traverse(lookups, query, **kw)
            return True
        try:
            async with asyncio.timeout_at(until):
                await self.node._traverse(lookups, query, **kw)
        except TimeoutError:
            self.node.count("partial_reads")
            return False
        return True

    def _merge_found(self, lookups: list[KeyLookup]) -> dict[str, StoredValue]:
        now = time.time()
        out: dict[str, StoredValue] = {}
        for lk in lookups:
            assert lk.key is not None
            merged = merge_records(lk.key, lk.records, now, self.node.validator)
            if merged is None:
                continue
            out[lk.key] = merged
            if self.node.cache_along_path:
                self.node._cache(lk, merged)
        return out
