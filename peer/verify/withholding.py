"""A verified round's secrets when the DHT is slow or split: ours stored again
while the round's secrets are still being gathered, the records still missing
asked of their members directly, and a member's missing secret looked for once
more before that member is shunned.

A member whose secret is not found looks like one that withholds it on purpose
(`shunning`). Under churn most are not: a partition kept its record on nodes we
could not reach, or a loaded node answered late. Both drivers here cost a few
DHT requests, and only in rounds where something was missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from shoal.dht.node import DHTNode
from shoal.transport import rpc
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID
from shoal.transport.version import ProtocolVersion
from shoal.verification.commitment import Commitment

from .audit_round import encode_pushed, encode_record, gather, publish_record

__all__ = ["DirectRecords", "publish_while_gathering", "push_or_store", "recheck_withheld"]

ASK_TIMEOUT = 3.0  # a member asked for its record directly, or sent ours
KEEP_RECORDS = 64  # our records served (the latest rounds)
# Records pushed to us (`DirectRecords.push`), kept until their round's gather takes
# them: a few rounds per sender (pushes can come before our own commit of the
# round), and a bound on all of them, so that no sender can make us hold much.
MAX_PUSHED_RECORD = 16 * 1024  # bytes; a secret is 80, a whole record about 600
PUSHED_PER_PEER = 4
MAX_PUSHED = 1024
PUSH_PROTOCOL = ProtocolVersion(2, 10)  # the first that takes pushed records
RECEIPT_PUSH_PROTOCOL = ProtocolVersion(2, 11)  # ... with a receipt's signature on them

log = logging.getLogger("shoal.verifier")


async def publish_while_gathering(
    dht: DHTNode,
    namespace: str,
    mine: Commitment,
    secret: bytes,
    gathered: asyncio.Event,
    *,
    every: float,
    within: float,
) -> int:
    """Store our round record, and store it again `every` seconds until `gathered`
    is set or `within` has passed; how many stores were made.

    While we still miss others' records, they may well miss ours: a store made
    during a partition reached only the nodes on our side, and the DHT's own
    republishing comes minutes later. A fresh store after the partition heals
    finds the nodes every member reads."""
    deadline = time.monotonic() + within
    stores = 0
    while True:
        stores += 1
        if not await publish_record(dht, namespace, mine, secret):
            log.info("round %d: our round record reached no DHT node", mine.round)
        left = deadline - time.monotonic()
        if left <= 0:
            return stores
        try:
            await asyncio.wait_for(gathered.wait(), min(every, left))
            return stores
        except TimeoutError:
            continue


async def push_or_store(
    records: DirectRecords,
    dht: DHTNode,
    namespace: str,
    mine: Commitment,
    secret: bytes,
    others: Sequence[PeerID],
    gathered: asyncio.Event,
    *,
    every: float,
    within: float,
    receipt: object = None,
    hand_out: Callable[[list[PeerID]], object] | None = None,
) -> bool:
    """Our secret to every other member of the round (`DirectRecords.push`), and our
    whole round record into the DHT only when one of them did not take it (a peer
    before protocol 2.10, one out of reach), stored again while our gather goes on
    (`publish_while_gathering`): where they read what no push brought them. Whether
    it went into the DHT. `receipt` (`ReceiptBook.wire`) rides on the pushes to the
    members of 2.11; `hand_out(members)` is called with the others it did not reach."""
    records.publish(mine.round, mine.start, encode_record(mine, secret))
    pushed = encode_pushed(mine, secret)  # (the others hold our commitment already)
    carriers = {p for p in others if records.takes_receipts(p)} if receipt is not None else set()
    took = await records.push(mine.round, mine.start, pushed, others, receipt=receipt,
                              receipt_to=carriers)  # fmt: skip
    if hand_out is not None:
        missed = [p for p in others if p not in took & carriers]
        if missed:
            hand_out(missed)
    if took >= set(others):
        return False
    await publish_while_gathering(dht, namespace, mine, secret, gathered, every=every,
                                  within=within)  # fmt: skip
    return True


async def recheck_withheld(
    dht: DHTNode,
    namespace: str,
    round_place: tuple[int, bytes],
    commitments: Mapping[PeerID, Commitment],
    missing: frozenset[PeerID],
    shun: Callable[[PeerID, int], float | None],
    *,
    after: float,
    timeout: float,
    records: DirectRecords | None = None,
) -> dict[PeerID, bytes]:
    """`after` seconds on, look for the secrets of the `missing` members once more
    (for up to `timeout`): pushed to us since (`records`), in the DHT, or asked of
    them directly (a member whose push came after our gather stored nothing in the
    DHT: every member took it); and `shun` those still missing; the secrets found
    late. `round_place`: the round's index and the global state it started from."""
    round_index, start = round_place
    await asyncio.sleep(after)
    found: dict[PeerID, bytes] = {}
    try:
        known = {p: commitments[p] for p in missing if p in commitments}
        ask = None if records is None else functools.partial(records.ask, round_index, start)
        _, secrets = await gather(dht, namespace, round_index, known, list(missing), timeout,
                                  ask=ask, start=start, pushed=records)  # fmt: skip
        found = {p: s for p, s in secrets.items() if p in missing}
    except Exception as e:  # (a failed re-read leaves them missing)
        log.debug("re-reading round %d's secrets failed: %r", round_index, e)
    if found:
        log.info("round %d: found the secret of %s late: not shunned", round_index,
                 ", ".join(p.short() for p in found))  # fmt: skip
    for peer in sorted(missing - found.keys(), key=PeerID.to_bytes):
        seconds = shun(peer, round_index)
        if seconds is not None:
            log.info("round %d: %s withheld its secret: left out of our rounds for %.0f s",
                     round_index, peer.short(), seconds)  # fmt: skip
    return found


class DirectRecords:
    """Round records sent to the round's members and asked of them directly, over
    the connections of the round.

    After a commit every member sends each other member its secret and its
    commitment's digest (`push` of `audit_round.encode_pushed`, protocol 2.10: the
    others hold the commitment already, it came with the contribution), and a
    member's gather takes what was pushed to it (`pushed`, `arrival`) before it reads
    the DHT: 80 bytes cross the wire once per member, where a whole record (about
    600) was stored on k replicas and every member's read brought back every record
    (bench/verification_swarm.py: 7 KB a peer a round of DHT, a sixth of a sparse
    round). A member that lacks the commitment (it owned no part of the round) asks
    for the whole record (`ask`). The DHT stays the way for every record a member
    could not push (a peer before 2.10, a member out of reach): its member stores
    the whole record there as before, and a gather reads it there for what no push
    brought.

    Members cut off from the DHT together (an island of the swarm averaging by
    itself, see averaging.matchmaking_island) or whose records landed on nodes we
    cannot reach would each look like they withheld their secret, and be shunned for
    it, though the round's connections are still open. So the records missing after
    the first read are also asked of their members directly (`ask`): the same bytes,
    served only once published (after the commit, when they are public anyway), and
    taken only from the member they belong to (pushed ones too).
    """

    def __init__(self, service: rpc.RpcService) -> None:
        self._service = service
        # (round, the global state it started from) -> our record, once published: a
        # re-sync onto another lineage can make us commit a round index twice.
        self._mine: dict[tuple[int, bytes], bytes] = {}
        # (round, start) -> sender -> the record it pushed, oldest first.
        self._pushed: dict[tuple[int, bytes], dict[PeerID, bytes]] = {}
        self._pushes: dict[PeerID, list[tuple[int, bytes]]] = {}
        self._count = 0
        self._waiters: set[asyncio.Event] = set()  # gathers waiting for a push
        self.served = 0
        self.found = 0
        self.pushed_to = 0  # our pushes a member took
        self.pushed_here = 0  # records members pushed to us
        # Where a receipt's signature on a push goes (`ReceiptBook.take`: peer, round,
        # its wire form); None: a push's receipt is refused (not a sparse experiment).
        self.take_receipt: Callable[[PeerID, int, object], object] | None = None
        service.unary("record")(self._on_record)
        service.unary("push")(self._on_push)

    def publish(self, round_index: int, start: bytes, record: bytes) -> None:
        self._mine[(round_index, start)] = record
        for old in list(self._mine)[:-KEEP_RECORDS]:  # (in the order published)
            del self._mine[old]

    async def _on_record(self, ctx: rpc.CallContext, payload: object) -> bytes:
        round_index = payload.get("round") if isinstance(payload, dict) else None
        start = payload.get("start") if isinstance(payload, dict) else None
        if isinstance(round_index, bool) or not isinstance(round_index, int):
            raise ValueError("record request must name a round")
        if start is None:  # (a 2.3 peer: our latest round of that index)
            found = [r for (i, _), r in self._mine.items() if i == round_index]
            record = found[-1] if found else None
        elif isinstance(start, bytes):
            record = self._mine.get((round_index, start))
        else:
            raise ValueError("record request: start must be bytes")
        if record is None:
            raise LookupError(f"no record of round {round_index} here")
        self.served += 1
        return record

    async def _on_push(self, ctx: rpc.CallContext, payload: object) -> bool:
        place = _place(payload)
        record = payload.get("record") if isinstance(payload, dict) else None
        if place is None or not isinstance(record, bytes) or len(record) > MAX_PUSHED_RECORD:
            raise ValueError("push: a round, the global state it started from and a record")
        receipt = payload.get("receipt") if isinstance(payload, dict) else None
        if receipt is not None:  # (2.11: its receipt of the round rides along)
            if self.take_receipt is None:
                raise ValueError("push: a receipt where we keep none")
            self.take_receipt(ctx.peer, place[0], receipt)  # (ValueError: malformed)
        mine = self._pushes.setdefault(ctx.peer, [])
        if place not in mine:
            mine.append(place)
            self._count += 1
        self._pushed.setdefault(place, {})[ctx.peer] = record
        while len(mine) > PUSHED_PER_PEER:
            self._drop(ctx.peer, mine[0])
        while self._count > MAX_PUSHED:  # (the oldest round's first sender)
            oldest = next(iter(self._pushed))
            self._drop(next(iter(self._pushed[oldest])), oldest)
        self.pushed_here += 1
        for event in self._waiters:
            event.set()
        return True

    def _drop(self, peer: PeerID, place: tuple[int, bytes]) -> None:
        places = self._pushes[peer]
        places.remove(place)
        if not places:
            del self._pushes[peer]
        records = self._pushed[place]
        del records[peer]
        if not records:
            del self._pushed[place]
        self._count -= 1

    def pushed(self, round_index: int, start: bytes) -> dict[PeerID, bytes]:
        """The records members pushed to us for round `round_index` from `start`."""
        return dict(self._pushed.get((round_index, start), {}))

    async def arrival(self, since: int, timeout: float) -> None:
        """Until a record is pushed to us after the `since`-th (`pushed_here` when the
        caller last looked), or `timeout`."""
        if self.pushed_here != since:
            return
        event = asyncio.Event()
        self._waiters.add(event)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), max(0.0, timeout))
        finally:
            self._waiters.discard(event)

    def takes_receipts(self, peer: PeerID) -> bool:
        """Whether `peer`'s hello says it takes a receipt on a push (2.11)."""
        hello = self._service.host.versions.peer_version(peer)
        return hello is not None and hello.protocol >= RECEIPT_PUSH_PROTOCOL

    async def push(
        self,
        round_index: int,
        start: bytes,
        record: bytes,
        peers: Sequence[PeerID],
        *,
        receipt: object = None,
        receipt_to: Collection[PeerID] = (),
    ) -> set[PeerID]:
        """Send our `record` of round `round_index` (from `start`) to `peers`, with
        `receipt` to those of `receipt_to` (they take one: `takes_receipts`); those
        that took it (an older peer, or one out of reach, did not)."""
        if len(record) > MAX_PUSHED_RECORD:
            return set()
        plain = {"round": round_index, "start": start, "record": record}
        with_receipt = plain if receipt is None else {**plain, "receipt": receipt}
        versions = self._service.host.versions
        # (A peer whose hello says it is older takes no push: not asked. One whose hello
        # we have not read yet is asked; a refusal is a push not taken, as any failure.)
        peers = [p for p in peers if (h := versions.peer_version(p)) is None
                 or h.protocol >= PUSH_PROTOCOL]  # fmt: skip

        async def one(peer: PeerID) -> PeerID | None:
            request = with_receipt if peer in receipt_to else plain
            try:
                taken = await rpc.call(self._service.host, peer, self._service.protocol,
                                       "push", request, timeout=ASK_TIMEOUT)  # fmt: skip
            except (TransportError, TimeoutError, OSError) as e:
                log.debug("round %d: %s did not take our record: %r", round_index,
                          peer.short(), e)  # fmt: skip
                return None
            return peer if taken is True else None

        took = {p for p in await asyncio.gather(*(one(p) for p in peers)) if p is not None}
        self.pushed_to += len(took)
        return took

    async def ask(
        self, round_index: int, start: bytes, peers: list[PeerID]
    ) -> list[tuple[PeerID, object]]:
        """The records `peers` answer for round `round_index` that started from the
        global state `start` (those that answer in time)."""

        async def one(peer: PeerID) -> tuple[PeerID, object] | None:
            try:
                raw = await rpc.call(
                    self._service.host, peer, self._service.protocol, "record",
                    {"round": round_index, "start": start}, timeout=ASK_TIMEOUT,
                )  # fmt: skip
            except (TransportError, TimeoutError, OSError) as e:
                log.debug("round %d: %s did not send its record: %r", round_index,
                          peer.short(), e)  # fmt: skip
                return None
            return peer, raw

        answers = await asyncio.gather(*(one(p) for p in peers))
        got = [a for a in answers if a is not None]
        self.found += len(got)
        return got


def _place(payload: object) -> tuple[int, bytes] | None:
    """A push's round and start (the first 64 bytes at most of a state digest)."""
    if not isinstance(payload, dict):
        return None
    round_index, start = payload.get("round"), payload.get("start")
    if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
        return None
    if not isinstance(start, bytes) or len(start) > 64:
        return None
    return round_index, start
