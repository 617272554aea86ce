"""The relay directory in the DHT: relays list themselves under owner-signed subkeys;
a reader gets each relay's addresses and nothing a peer wrote in another's name."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker
from shoal.dht.relay_directory import RELAYS_KEY, DHTRelayDirectory
from shoal.transport.multiaddr import Multiaddr


async def test_a_relay_listed_by_one_peer_is_found_by_another(
    make_host: Callable[..., Any],
) -> None:
    a, b = await make_host(), await make_host()
    node_a = await DHTNode.create(a)
    node_b = await DHTNode.create(b, bootstrap=[str(a.addresses()[0])])
    try:
        addr = Multiaddr("/ip4/198.51.100.10/tcp/4001")
        await DHTRelayDirectory(node_a).advertise(a.peer_id, [addr], ttl=60)
        found = await DHTRelayDirectory(node_b).find()
        assert found == {a.peer_id: [addr]}
    finally:
        await node_b.aclose()
        await node_a.aclose()


async def test_entries_that_are_not_relay_listings_are_left_out(
    make_host: Callable[..., Any],
) -> None:
    a = await make_host()
    node = await DHTNode.create(a)
    try:
        expires = time.time() + 60
        # Not owner-marked, a malformed address, a value of the wrong type.
        await node.store(RELAYS_KEY, ["/ip4/198.51.100.10/tcp/1"], expires, subkey="anyone")
        await node.store(RELAYS_KEY, ["not an address"], expires, subkey=owner_marker(a.peer_id))
        directory = DHTRelayDirectory(node)
        assert await directory.find() == {}
        await node.store(RELAYS_KEY, {"x": 1}, expires, subkey=owner_marker(a.peer_id))
        assert await directory.find() == {}
    finally:
        await node.aclose()
