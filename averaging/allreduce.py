"""Fault-tolerant butterfly all-reduce with commit-or-abort, over the transport.

`AllReduceService` is registered once per host. `run(group, tensors, weight)`
averages the tensors with a group that matchmaking agreed on: on commit every
member holds bit-identical values; on abort every member keeps its own input
untouched, and `failed` names the members to retry without. The round itself
(data plane, reduction, codec) is `butterfly.ButterflyRound`; the decision is
`commit.CommitProtocol`, whose docstring says why survivors always agree.

Control messages are small unary RPCs (method ``m``: ``[round_id, message]``,
message ``["S", status...]`` or ``["P", ballot]``) whose reply is the
receiver's status, so every message is also a heartbeat both ways. A lost
connection makes its peer suspected at once; a peer that says nothing for
``stall_timeout`` (SIGSTOP, a cut link) after that.

Routing. Traffic is routed to the running round by round id. A data stream
that arrives before the local run() of its round (a fast member) waits up to
``start_timeout`` for it; a control message for an unknown round is answered
None ("unknown"), and a takeover's PREPARE is remembered for when the round
starts. Finished rounds are remembered for a while, to answer late messages
and takeover leaders with their decision.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from shoal.transport.connection import Connection
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.rpc import CallContext, RpcLimits, RpcService
from shoal.transport.tasks import TaskSet

from .attestation import Attestor
from .butterfly import (
    FAULT_POINTS,
    AllReduceConfig,
    AllReduceError,
    AllReduceOutcome,
    BadRequest,
    BufferPool,
    ButterflyRound,
    NotAMember,
    RoundOver,
    UnknownRound,
    for_peer,
)
from .commit import CommitProtocol, parse_message
from .compression import get_codec
from .group import ROUND_ID_BYTES, Group

__all__ = [
    "FAULT_POINTS",
    "AllReduceConfig",
    "AllReduceError",
    "AllReduceOutcome",
    "AllReduceService",
]

log = logging.getLogger("shoal.averaging.allreduce")

_MAX_WAITING_HANDLERS = 256  # streams waiting for rounds that have not started here yet
_MAX_FINISHED = 1024  # finished rounds remembered (to answer late and takeover messages)
_MAX_EARLY = 1024  # PREPAREs remembered for rounds that have not started here


@dataclass(slots=True)
class _Finished:
    state: CommitProtocol
    index: dict[PeerID, int]
    expires: float


class AllReduceService:
    """Registered once per host; routes incoming all-reduce traffic to the running round
    by round_id, and remembers finished rounds to answer late and takeover messages."""

    def __init__(self, host: Host, config: AllReduceConfig | None = None) -> None:
        self.host = host
        self.config = config or AllReduceConfig()
        self._rpc = RpcService(host, self.config.protocol, RpcLimits(max_message=1 << 20))
        self._rpc.unary("m")(self._on_message)
        self._rpc.stream("d")(self._on_data)
        self._rounds: dict[bytes, ButterflyRound] = {}
        self._finished: OrderedDict[bytes, _Finished] = OrderedDict()
        self._early: OrderedDict[bytes, tuple[PeerID, int]] = OrderedDict()
        self._arrivals: dict[bytes, tuple[asyncio.Future[None], list[int]]] = {}
        self._waiting = 0
        self._dials: dict[PeerID, list[asyncio.Future[None]]] = {}
        self._tasks = TaskSet(log, "all-reduce")
        self._closed = False
        self._pool = BufferPool()
        self._remove_listener = host.add_connection_listener(
            opened=self._on_connection_opened, closed=self._on_connection_closed
        )

    # --- public API ---------------------------------------------------------------------------

    async def run(
        self,
        group: Group,
        tensors: Sequence[torch.Tensor],
        weight: float,
        *,
        codec: str | None = None,
        attestor: Attestor | None = None,
        stall_timeout: float | None = None,
        max_weight: float | None = None,
    ) -> AllReduceOutcome:
        """Average `tensors` with the group, weighted by `weight` (e.g. the samples behind
        this member's values; 0: contribute nothing, still receive the result).

        With an `attestor` every contribution travels with its sender's signed
        commitment and is checked against it chunk by chunk (`attestation`); the
        outcome carries the members' commitments. Every member must use one.

        On commit the averages are written in place, bit-identical on every member; on
        abort the tensors are untouched and `failed` names the members to retry
        without. They must not change while this runs (they are sent from their own
        storage). Raises only for bad arguments, cancellation, or a fault hook's crash.
        `stall_timeout`: this round's (adaptive deadlines), for the configured stall and
        decision timeouts. `max_weight`: this round's bound on a member's weight, for
        the configured one (a member over it is vetoed out of the round, named).
        """
        if self._closed:
            raise RuntimeError("the all-reduce service is closed")
        if self.host.peer_id not in group.peer_ids:
            raise ValueError("this host is not a member of the group")
        tensors = _checked_inputs(tensors, weight)
        codec_obj = get_codec(codec or self.config.codec)
        await self.prepare(codec_obj.name)
        rid = group.round_id
        if rid in self._rounds or rid in self._finished:
            raise ValueError(f"round {rid.hex()[:12]} was already run here")
        early = 0
        entry = self._early.pop(rid, None)
        if entry is not None and entry[0] in group.peer_ids:
            early = entry[1]
        config = self.config
        if stall_timeout is not None:
            config = replace(config, stall_timeout=stall_timeout, decision_timeout=stall_timeout)
        if max_weight is not None:
            config = replace(config, max_weight=max_weight)
        rnd = ButterflyRound(
            self.host,
            config,
            self._pool,
            self._spawn,
            self._wait_connection,
            group,
            tensors,
            float(weight),
            codec_obj,
            early,
            attestor,
        )
        self._rounds[rid] = rnd
        arrival = self._arrivals.pop(rid, None)
        if arrival is not None and not arrival[0].done():
            arrival[0].set_result(None)
        try:
            return await rnd.run()
        finally:
            del self._rounds[rid]
            self._remember(rnd)

    async def prepare(self, codec: str | None = None) -> None:
        """Load what `codec` (default: the configured one) needs, in a thread: the int8
        codec's compiled loops take about half a second to load the first time in a
        process, which would otherwise stall the event loop in the middle of a round."""
        codec_obj = get_codec(codec or self.config.codec)
        if not codec_obj.prepared:
            await asyncio.to_thread(codec_obj.prepare)

    def close(self) -> None:
        """Stop serving; running rounds abort, pending messages are dropped."""
        if self._closed:
            return
        self._closed = True
        self._rpc.close()
        self._remove_listener()
        for rnd in self._rounds.values():
            rnd.abort("the all-reduce service closed")
        self._tasks.cancel()

    async def aclose(self) -> None:
        self.close()
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- internals ----------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return self._tasks.spawn(coro)

    def _remember(self, rnd: ButterflyRound) -> None:
        now = time.monotonic()
        ttl = max(60.0, 4 * (self.config.stall_timeout + self.config.decision_timeout))
        self._finished[rnd.round_id] = _Finished(rnd.state, rnd.index, now + ttl)
        while self._finished:
            rid, fin = next(iter(self._finished.items()))
            if len(self._finished) <= _MAX_FINISHED and fin.expires > now:
                break
            del self._finished[rid]

    async def _on_message(self, ctx: CallContext, payload: Any) -> Any:
        if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[0], bytes)):
            raise BadRequest("a control message is [round_id, message]")
        rid, msg = payload
        rnd = self._rounds.get(rid)
        if rnd is not None:
            return for_peer(self.host, ctx.peer, rnd.on_control(ctx.peer, msg))
        fin = self._finished.get(rid)
        if fin is not None:
            src = fin.index.get(ctx.peer)
            if src is None:
                raise NotAMember(f"{ctx.peer.short()} is not a member of this round")
            try:
                kind, body = parse_message(msg, fin.state.n)
            except ValueError as e:
                raise BadRequest(str(e)) from None
            reply = fin.state.on_message(src, kind, body, time.monotonic())
            return for_peer(self.host, ctx.peer, reply)
        if (
            isinstance(msg, list)
            and len(msg) == 2
            and msg[0] == "P"
            and isinstance(msg[1], int)
            and len(rid) == ROUND_ID_BYTES
        ):
            # A takeover leader asks before our run() started: remember the promise.
            old = self._early.get(rid)
            self._early[rid] = (ctx.peer, max(int(msg[1]), old[1] if old else 0))
            while len(self._early) > _MAX_EARLY:
                self._early.popitem(last=False)
        return None

    async def _on_data(self, ctx: CallContext, payload: Any) -> Any:
        if not isinstance(payload, dict):
            raise BadRequest("a data stream starts with a map")
        rid = payload.get("r")
        if not isinstance(rid, bytes) or len(rid) != ROUND_ID_BYTES:
            raise BadRequest("bad round id")
        rnd = await self._wait_round(rid)
        await rnd.serve_lane(ctx, payload)
        return
        yield  # an async generator for RpcService.stream; it answers in raw chunks

    async def _wait_round(self, rid: bytes) -> ButterflyRound:
        rnd = self._rounds.get(rid)
        if rnd is not None:
            return rnd
        if rid in self._finished:
            raise RoundOver(f"round {rid.hex()[:12]} is over here")
        if self._waiting >= _MAX_WAITING_HANDLERS:
            raise UnknownRound("too many streams for rounds that have not started")
        entry = self._arrivals.get(rid)
        if entry is None:
            entry = self._arrivals[rid] = (asyncio.get_running_loop().create_future(), [0])
        fut, count = entry
        count[0] += 1
        self._waiting += 1
        try:
            async with asyncio.timeout(self.config.start_timeout):
                await asyncio.shield(fut)
        except TimeoutError:
            raise UnknownRound(
                f"round {rid.hex()[:12]} did not start here within {self.config.start_timeout}s"
            ) from None
        finally:
            self._waiting -= 1
            count[0] -= 1
            if count[0] == 0 and self._arrivals.get(rid) is entry:
                del self._arrivals[rid]
        rnd = self._rounds.get(rid)
        if rnd is None:
            raise RoundOver(f"round {rid.hex()[:12]} is over here")
        return rnd

    async def _wait_connection(self, peer: PeerID, timeout: float) -> None:
        if self.host.connection(peer) is not None:
            return
        fut = asyncio.get_running_loop().create_future()
        self._dials.setdefault(peer, []).append(fut)
        try:
            async with asyncio.timeout(timeout):
                await fut
        except TimeoutError:
            pass
        finally:
            waiters = self._dials.get(peer)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._dials[peer]

    def _on_connection_opened(self, conn: Connection) -> None:
        for fut in self._dials.pop(conn.remote_peer, []):
            if not fut.done():
                fut.set_result(None)

    def _on_connection_closed(self, conn: Connection) -> None:
        peer = conn.remote_peer
        if peer is None or self.host.connection(peer) is not None:
            return  # a duplicate went away; the peer is still connected
        if conn.went_away:
            # Closed in order (an idle close or a trim that went out before a round
            # protected the member, a host closing): the member is not lost, and the
            # round dials it again when it sends. Blaming it had aborted rounds, each
            # end naming the other (1,000 simulated peers: "failed: idle" and "closed
            # by peer"), and the retry then left both out. A member that dies after
            # its GOAWAY fails the next message sent to it instead.
            return
        if not self.host.versions.heard_from(conn):
            # Closed before the peer spoke on it: a dial that failed (its handshake
            # slots were full), which the round's own dial reports, and retries.
            return
        for rnd in list(self._rounds.values()):
            rnd.peer_lost(peer, conn.close_reason or "connection closed")


def _checked_inputs(tensors: Sequence[torch.Tensor], weight: float) -> list[torch.Tensor]:
    """The tensors as a list; raises for a weight or tensors `run` cannot average."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise TypeError("weight must be a number")
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
    tensors = list(tensors)
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.device.type != "cpu":
            raise TypeError("tensors must be floating-point CPU torch tensors")
    return tensors
