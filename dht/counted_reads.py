"""Counted reads: how many live records a key holds, without the records.

How many peers announced under a key (a swarm's state holders) decides how a
Moshpit peer starts. Reading the records to count them had every replica send
every announcement to every asker: when hundreds of peers start together, the k
replicas' uplinks carry hundreds of readers times hundreds of records, and on home
links their queues reached 47 s, timing out everything else they carried (the
simulator's 256-peer grid committed 31% of its steps; 99% without that read).
A counted read's answer is one integer per key beside the usual contacts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .lookup import Candidate, KeyLookup
from .protocol import parse_counts, parse_nearest, parse_values
from .routing import key_id

if TYPE_CHECKING:
    from .reads import Reader


async def count_records(reader: Reader, key: str, within: float | None) -> int | None:
    """How many live records `key` holds: the largest count that any of its k
    closest replicas answering by `within` seconds claims (ours too, when we are
    one). 0 when they answered and none holds it; None when none answered in time.

    Each count is the claim of one replica, bounded by what one answer could hold
    (`MAX_RECORDS_PER_KEY`): the largest one wins, so that one honest replica is
    enough against replicas that hide records, and a replica that inflates the
    count can only say the key is more crowded than it is."""
    node = reader.node
    counts: list[int] = []
    held = node.storage.get(key, time.time())
    if held is not None:
        counts.append(len(held.subkeys) or 1)
    answered: list[Candidate] = []

    async def query(cand: Candidate, lookups: list[KeyLookup]) -> Any:
        request = {**node.hello(), "keys": [key], "count": True}
        reply = await node._request(cand.peer_id, cand.addrs, "find_value", request)
        response, per_key = parse_nearest(
            reply, 1, node.k, local=node.peer_id, responder=cand.peer_id
        )
        if "counts" in response:
            found = parse_counts(response, 1).get(0, 0)
        else:  # a peer from before counted reads: it sent the records themselves
            found = len(parse_values(response, [key]).get(key, []))
        reader._answered(cand)
        answered.append(cand)
        if found:
            counts.append(found)
        return per_key

    until = None if within is None else reader._loop.time() + within
    # Every one of the k closest (no quorum): records of owner-signed subkeys reach
    # the replicas one by one, and any of them may hold more than the others.
    await reader._traverse_until(until, [KeyLookup(key_id(key), key)], query)
    node.count("counted_reads")
    if counts:
        return max(counts)
    return 0 if answered else None
