"""The answering side of a DHT node: admission, the sender in the table, the methods.

Every request passes the rate limits of `admission` first (over them: a typed
busy answer, ``{"busy": true, "retry_after": s}``, which costs us almost
nothing and tells an honest requester to ask someone else for a moment), then
refreshes its sender in the routing table under the IP its connection comes
from. Stored records are charged to the sender and its IP group.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from shoal.transport import rpc
from shoal.transport.connection import Connection
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

from .admission import DiversityPolicy, RequestAdmission
from .protocol import (
    DHTProtocolError,
    build_nearest,
    cursors_to_wire,
    parse_addrs,
    parse_cursors,
    parse_ids,
    parse_keys,
    parse_records,
    parse_tags,
    tags_to_wire,
)
from .records import RecordError
from .routing import RoutingTable, key_id
from .storage import LocalStorage

log = logging.getLogger("shoal.dht")


class ServedNode(Protocol):
    """What the server needs of the node it answers for (`DHTNode` is one)."""

    @property
    def host(self) -> Host: ...
    @property
    def protocol(self) -> str: ...
    @property
    def k(self) -> int: ...
    @property
    def admission(self) -> RequestAdmission: ...
    @property
    def diversity(self) -> DiversityPolicy: ...
    @property
    def routing_table(self) -> RoutingTable: ...
    @property
    def storage(self) -> LocalStorage: ...

    def count(self, counter: str, n: int = 1) -> int:
        """Add `n` to one of the node's counters; its new value."""
        ...

    def hello(self) -> dict[str, Any]:
        """What the node says of itself (its addresses, or that it is a client)."""
        ...

    def add_contact(
        self,
        peer: PeerID,
        addrs: Sequence[Multiaddr],
        *,
        replace: bool,
        observed_ip: str | None = None,
    ) -> None:
        """A sender into the routing table."""
        ...


class DHTServer:
    """Serves ping/find_node/find_value/store of `node` under its protocol."""

    def __init__(self, node: ServedNode) -> None:
        self.node = node
        self._service = rpc.RpcService(node.host, node.protocol)
        # The addresses each connection's remote last said it has (`from`): its later
        # requests over that connection leave them out (the requester's `_over`).
        self._heard: weakref.WeakKeyDictionary[Connection, tuple[Multiaddr, ...]] = (
            weakref.WeakKeyDictionary()
        )
        for method, handler in (
            ("ping", self._on_ping),
            ("find_node", self._on_find_node),
            ("find_value", self._on_find_value),
            ("store", self._on_store),
        ):
            self._service.unary(method)(self._admitted(handler))

    def close(self) -> None:
        self._service.close()

    def _admitted(self, handler: rpc.Handler) -> rpc.Handler:
        """`handler` behind the request rate limits: a request over them gets a typed
        busy answer (cheap, and not garbage to an honest requester)."""

        async def admitted(ctx: rpc.CallContext, payload: Any) -> Any:
            now = asyncio.get_running_loop().time()
            if not self.node.admission.admit(ctx.peer, ctx.remote_ip, now):
                refused = self.node.count("requests_refused")
                if refused & (refused - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood is one line
                    log.info(
                        "DHT: request rate limit: a busy answer to %s at %s (%d so far)",
                        ctx.peer.short(),
                        ctx.remote_ip,
                        refused,
                    )
                return {"busy": True, "retry_after": self.node.admission.limits.retry_after}
            return await handler(ctx, payload)

        return admitted

    def _note_sender(self, ctx: rpc.CallContext, payload: object) -> dict[str, Any]:
        """Every request refreshes its sender in the table."""
        if not isinstance(payload, dict):
            raise DHTProtocolError("request must be a map")
        self.node.count("requests_served")
        if payload.get("client") is True:
            return payload  # a client (e.g. behind NAT): answer it, never route through it
        conn = ctx.stream.connection
        if "from" in payload:
            try:
                addrs = parse_addrs(ctx.peer, payload["from"])
            except DHTProtocolError:
                addrs = ()
            self._heard[conn] = addrs
        else:  # what it said before on this connection (none on a new one: kept as known)
            addrs = self._heard.get(conn, ())
        self.node.add_contact(ctx.peer, addrs, replace=bool(addrs), observed_ip=ctx.remote_ip)
        return payload

    def _nearest_for(self, targets: list[int], exclude: PeerID) -> dict[str, Any]:
        ex = {exclude}
        return build_nearest(
            [
                [(c.peer_id, c.addrs) for c in self.node.routing_table.nearest(t, self.node.k, ex)]
                for t in targets
            ]
        )

    async def _on_ping(self, ctx: rpc.CallContext, payload: Any) -> Any:
        self._note_sender(ctx, payload)
        # Our wall clock, for the asker's clock-skew check (`shoal doctor`): records
        # expire by wall-clock time, so a clock minutes off loses or keeps them wrongly.
        return {**self.node.hello(), "t": time.time()}

    async def _on_find_node(self, ctx: rpc.CallContext, payload: Any) -> Any:
        payload = self._note_sender(ctx, payload)
        return self._nearest_for(parse_ids(payload.get("ids")), ctx.peer)

    async def _on_find_value(self, ctx: rpc.CallContext, payload: Any) -> Any:
        payload = self._note_sender(ctx, payload)
        keys = parse_keys(payload.get("keys"))
        since = parse_cursors(payload.get("since"), len(keys), "since")
        known = parse_tags(payload.get("known"), len(keys), "known")
        storage = self.node.storage
        now = time.time()
        values = storage.get_many(keys, now)
        if payload.get("contacts") is False:  # (a sampled read: not a lookup's step)
            answer = build_nearest([[] for _ in keys])
        else:
            answer = self._nearest_for([key_id(k) for k in keys], ctx.peer)
        if payload.get("count") is True:  # how many records, not the records
            held = {i: values[k] for i, k in enumerate(keys) if k in values}
            answer["counts"] = {i: len(v.subkeys) or 1 for i, v in held.items()}
            return answer
        found: dict[int, list[Any]] = {}
        had: dict[int, list[bytes]] = {}
        for i, key in enumerate(keys):
            cursor = since.get(i)
            if cursor is not None and cursor[0] == storage.epoch:
                records = storage.changed_since(key, cursor[1], now)  # a delta read
            else:
                records = values[key].records() if key in values else []
            if known.get(i):  # (what the asker holds already: named, not sent)
                tags = [r.tag() for r in records]
                had[i] = [t for t in tags if t in known[i]]
                records = [r for r, t in zip(records, tags, strict=True) if t not in known[i]]
            if records:
                found[i] = [r.to_wire() for r in records]
        answer["values"] = found
        if any(had.values()):
            answer["had"] = tags_to_wire(had)
        # Complete up to here, for every key (one held nowhere too): the asker's next
        # read sends these back and gets only what was stored after.
        mark = (storage.epoch, storage.last_seq)
        answer["cursors"] = cursors_to_wire(dict.fromkeys(range(len(keys)), mark))
        return answer

    async def _on_store(self, ctx: rpc.CallContext, payload: Any) -> Any:
        payload = self._note_sender(ctx, payload)
        records = parse_records(payload.get("records"))
        now = time.time()
        origin = (ctx.peer, self.node.diversity.group_of_ip(ctx.remote_ip))
        stored = []
        for r in records:
            try:
                stored.append(self.node.storage.store(r, now, origin))
            except RecordError as e:
                log.debug("refused %s from %s: %s", r.describe(), ctx.peer.short(), e)
                stored.append(False)
        return {"stored": stored}
