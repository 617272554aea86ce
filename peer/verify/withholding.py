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
import logging
import time
from collections.abc import Callable, Mapping

from shoal.dht.node import DHTNode
from shoal.transport import rpc
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID
from shoal.verification.commitment import Commitment

from .audit_round import gather, publish_record

__all__ = ["DirectRecords", "publish_while_gathering", "recheck_withheld"]

ASK_TIMEOUT = 3.0  # a member asked for its record directly
KEEP_RECORDS = 64  # our records served (the latest rounds)

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
    published: asyncio.Event | None = None,
) -> int:
    """Store our round record, and store it again `every` seconds until `gathered`
    is set or `within` has passed; how many stores were made (`published` set after
    the first).

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
        if published is not None:
            published.set()  # (the replicas it reached serve our reads of the records)
        left = deadline - time.monotonic()
        if left <= 0:
            return stores
        try:
            await asyncio.wait_for(gathered.wait(), min(every, left))
            return stores
        except TimeoutError:
            continue


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
) -> dict[PeerID, bytes]:
    """`after` seconds on, read the secrets of the `missing` members once more (for
    up to `timeout`), and `shun` those still missing; the secrets found late.
    `round_place`: the round's index and the global state it started from."""
    round_index, start = round_place
    await asyncio.sleep(after)
    found: dict[PeerID, bytes] = {}
    try:
        known = {p: commitments[p] for p in missing if p in commitments}
        _, secrets = await gather(
            dht, namespace, round_index, known, list(missing), timeout, start=start
        )
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
    """Round records asked of their members over the connections of the round.

    The DHT is where members publish their records (commitment and secret) after
    a commit, and where the others read them. Members cut off from it together (an
    island of the swarm averaging by itself, see averaging.matchmaking_island) or
    whose records landed on nodes we cannot reach would each look like they
    withheld their secret, and be shunned for it, though the round's connections
    are still open. So the records missing after the first read are asked of their
    members directly: the same bytes, served only once published (after the commit,
    when they are public anyway), and taken only from the member they belong to.
    """

    def __init__(self, service: rpc.RpcService) -> None:
        self._service = service
        # (round, the global state it started from) -> our record, once published: a
        # re-sync onto another lineage can make us commit a round index twice.
        self._mine: dict[tuple[int, bytes], bytes] = {}
        self.served = 0
        self.found = 0
        service.unary("record")(self._on_record)

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
