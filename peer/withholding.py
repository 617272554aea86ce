"""A verified round's secrets when the DHT is slow or split: ours stored again
while the round's secrets are still being gathered, and a member's missing
secret looked for once more before that member is shunned.

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
from shoal.transport.identity import PeerID
from shoal.verification.commitment import Commitment

from .audit_round import gather, publish_record

__all__ = ["publish_while_gathering", "recheck_withheld"]

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


async def recheck_withheld(
    dht: DHTNode,
    namespace: str,
    round_index: int,
    commitments: Mapping[PeerID, Commitment],
    missing: frozenset[PeerID],
    shun: Callable[[PeerID, int], float | None],
    *,
    after: float,
    timeout: float,
) -> dict[PeerID, bytes]:
    """`after` seconds on, read the secrets of the `missing` members once more (for
    up to `timeout`), and `shun` those still missing; the secrets found late."""
    await asyncio.sleep(after)
    found: dict[PeerID, bytes] = {}
    try:
        known = {p: commitments[p] for p in missing if p in commitments}
        _, secrets = await gather(dht, namespace, round_index, known, list(missing), timeout)
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
