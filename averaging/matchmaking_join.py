"""The matchmaking RPCs: a follower's side (`JoinClient`: one pending ``join``,
its redirects and answers), a leader's side (`JoinServer`: pending joins
answered together with one group, and ``hello``), and confirming declarations
with their owners (`Prober`).

The ordering and the reasons behind each reply are in `matchmaking`'s docstring.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shoal.transport import rpc
from shoal.transport.errors import TransportError
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.rpc import CallContext

from .declarer import Declarer
from .group import Group, Member
from .matchmaking_round import Closing, MatchmakingConfig, Mode, Round
from .matchmaking_rules import (
    MAX_BRINGING,
    NONCE_BYTES,
    Declaration,
    JoinReply,
    JoinRequest,
    PeerState,
    ReplyKind,
    check_group,
)

log = logging.getLogger("shoal.averaging.matchmaking")

# A leader answers this long before a joiner's deadline: the answer must arrive in time.
ANSWER_MARGIN = 0.25
MAX_REDIRECTS = 4
# Before a re-sync is demanded, the peers holding the other version are asked
# whether their declaration is still current (a dead peer's stays for its TTL).
PROBE_TIMEOUT = 1.0
# After a redirect to a peer we know failed: give the redirecting peer time to notice.
REDIRECT_PAUSE = 0.1


class _Late(enum.Enum):
    LATE = "late"
    UNREACHED = "unreached"


# A join sent whose answer did not arrive in time (see JoinClient.follow).
_LATE = _Late.LATE
# A join that never went out: the connection to the leader failed at once (refused at
# either end's connection limit, or the other end's half-open slots were taken, as by
# a DHT request of ours in its handshake there). Asked once more after
# REDIRECT_PAUSE before the leader is set aside: set aside, it stays so until it
# declares again (seconds), and a leader left waiting for us and we alone split
# the cell.
_UNREACHED = _Late.UNREACHED
# How long a joiner waits when it asks a leader again after `_LATE`.
REASK_TIMEOUT = 2.0


class JoinServer:
    """The leader's side: takes joins for the running round (`round`) and answers
    them together; answers ``hello`` with our latest declaration."""

    def __init__(
        self,
        service: rpc.RpcService,
        key: str,
        peer_id: PeerID,
        config: MatchmakingConfig,
        declarer: Declarer,
    ) -> None:
        self.key = key
        self.peer_id = peer_id
        self.config = config
        self.declarer = declarer
        self.round: Round | None = None  # the running form_group call, if any
        self.last_group: tuple[tuple[PeerID, ...], float] = ((), 0.0)  # members, loop time
        # The last group we led, with the call ticket of each member's join: handed
        # back to a member whose join gave up before our answer reached it.
        self.last_led: tuple[JoinReply, dict[PeerID, bytes]] | None = None
        self._loop = asyncio.get_running_loop()
        service.unary("join")(self.on_join)
        service.unary("hello")(self.on_hello)

    async def on_join(self, ctx: CallContext, payload: object) -> dict[str, Any]:
        request = JoinRequest.from_wire(payload)  # ValueError: the joiner gets an error
        if request.key != self.key:
            raise ValueError("join request for another key")
        peer = ctx.peer
        if peer == self.peer_id:
            raise ValueError("a peer cannot join itself")
        rnd = self.round
        refusal = self._refusal(rnd, peer, request)
        if refusal is not None:
            return refusal.to_wire()
        assert rnd is not None
        timeout = ctx.timeout if ctx.timeout is not None else self.config.join_timeout
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        rnd.answer(peer, JoinReply(ReplyKind.RETRY))  # a repeated request replaces one
        rnd.gathering.admit(
            Member(peer, request.addrs, request.bandwidth), self._loop.time() + timeout
        )
        rnd.waiters[peer] = fut
        rnd.tickets[peer] = request.call
        excluded = rnd.outlook.excluded
        rnd.gathering.expect((p for p in request.bringing if p not in excluded), self._loop.time())
        if rnd.gathering.full:
            self.close(rnd)  # right now, so that the next joiner hears "busy"
        else:
            rnd.changed.set()
        try:
            return await fut
        finally:
            if not fut.done():  # the joiner gave up (or its deadline passed): drop it
                fut.cancel()
                if rnd.waiters.get(peer) is fut:
                    del rnd.waiters[peer]
                    rnd.gathering.withdraw(peer)
                    rnd.changed.set()

    def _refusal(self, rnd: Round | None, peer: PeerID, request: JoinRequest) -> JoinReply | None:
        """The answer to a join we do not take into the gathering (None: take it)."""
        if rnd is None or rnd.mode == Mode.CLOSED:
            members, formed = self.last_group
            age = max(0.0, self._loop.time() - formed) if members else 0.0
            ours = self._group_of(peer, request.call)
            if ours is not None:
                log.debug("%s: handing group %s back to %s", self.key, ours[0], peer.short())
                return JoinReply(
                    ReplyKind.BUSY, members=members, age=age, group=ours[1], nonce=ours[2]
                )
            return JoinReply(ReplyKind.BUSY, members=members, age=age)
        if peer in rnd.outlook.excluded:
            return JoinReply(ReplyKind.EXCLUDED)
        if request.state_version != rnd.outlook.version:
            return JoinReply(ReplyKind.VERSION, version=rnd.outlook.version)
        if rnd.mode == Mode.FOLLOW:
            assert rnd.following is not None
            leader, addrs = rnd.following
            return JoinReply(ReplyKind.REDIRECT, peer=leader, addrs=addrs)
        return None

    async def on_hello(self, ctx: CallContext, payload: object) -> dict[str, Any]:
        """Our latest declaration, so that a peer can tell it is current (not a dead
        peer's), or see it at all when the DHT does not answer (matchmaking_island)."""
        if not isinstance(payload, dict) or payload.get("key") != self.key:
            raise ValueError("hello must name our key")
        return self.declarer.hello()

    def _group_of(self, peer: PeerID, call: bytes) -> tuple[str, Group, bytes] | None:
        """The group we last led, if `peer`'s join of this `call` is in it."""
        if self.last_led is None or not call:
            return None
        reply, tickets = self.last_led
        if tickets.get(peer) != call or reply.group is None:
            return None
        return reply.group.round_id.hex()[:12], reply.group, reply.nonce

    def conclude(self, rnd: Round, group: Group, leader: PeerID) -> None:
        """The round's group is settled (by us or by our leader)."""
        rnd.conclude(group, leader)
        self.last_group = (group.peer_ids, self._loop.time())
        if leader != self.peer_id:
            self.last_led = None  # our last group is not ours to hand out

    def close(self, rnd: Round) -> None:
        """Settle the group and answer every pending join with it."""
        nonce = os.urandom(NONCE_BYTES)
        group = rnd.gathering.finalize(self.key, rnd.outlook.version, nonce)
        self.conclude(rnd, group, self.peer_id)
        accepted = JoinReply(ReplyKind.ACCEPTED, group=group, nonce=nonce)
        self.last_led = (accepted, {p: rnd.tickets.get(p, b"") for p in group.peer_ids})
        reply = accepted.to_wire()
        for fut in rnd.waiters.values():
            if not fut.done():
                fut.set_result(reply)
        rnd.waiters.clear()
        log.debug("%s: closed group %s of %d", self.key, group.round_id.hex()[:12], group.size)


class Prober:
    """Asks owners whether the declarations we read are still their latest (``hello``)."""

    def __init__(self, host: Host, protocol: str, key: str, closing: Closing) -> None:
        self.host = host
        self.protocol = protocol
        self.key = key
        self.closing = closing
        self._loop = asyncio.get_running_loop()

    async def confirm(self, rnd: Round, decls: list[Declaration], end: float) -> list[Declaration]:
        """The declarations whose owners confirm them as their latest; the
        owners that cannot be reached (or answer garbage) are set aside."""
        until = min(end, self._loop.time() + PROBE_TIMEOUT)
        if until <= self._loop.time():
            return []
        answers = await self.closing.abortable(
            asyncio.gather(*(self._ask(rnd, d, until) for d in decls))
        )
        return [d for d, ok in zip(decls, answers, strict=True) if ok]

    async def _ask(self, rnd: Round, d: Declaration, until: float) -> bool:
        try:
            async with asyncio.timeout_at(until):
                if self.host.connection(d.peer_id) is None:
                    await self.host.connect(d.peer_id, d.addrs)
                left = until - self._loop.time()
                raw = await rpc.call(
                    self.host, d.peer_id, self.protocol, "hello", {"key": self.key}, timeout=left
                )
        except (TransportError, TimeoutError, OSError) as e:
            log.debug("%s: %s did not confirm its declaration: %r", self.key, d.peer_id.short(), e)
            rnd.suspect(d.peer_id)
            return False
        if not isinstance(raw, dict):
            rnd.suspect(d.peer_id)
            return False
        # A live peer whose declaration changed since we read it: not a vote, not a suspect.
        return raw.get("state") == str(d.state) and raw.get("version") == d.state_version


class JoinClient:
    """The follower's side: one pending join at a time, following redirects."""

    def __init__(
        self,
        host: Host,
        protocol: str,
        key: str,
        config: MatchmakingConfig,
        declarer: Declarer,
        closing: Closing,
        *,
        conclude: Callable[[Round, Group, PeerID], None],
        recheck_version: Callable[[Round, float], Awaitable[None]],
    ) -> None:
        self.host = host
        self.protocol = protocol
        self.key = key
        self.peer_id = declarer.peer_id
        self.config = config
        self.declarer = declarer
        self.closing = closing
        self._conclude = conclude
        # A leader said our version differs: perhaps we are the ones behind
        # (may raise NeedsResync).
        self._recheck_version = recheck_version
        self._loop = asyncio.get_running_loop()

    async def follow(self, rnd: Round, leader: PeerID, end: float) -> Group | None:
        """Join `leader` (following its redirects); the group, or None to decide again."""
        decl = rnd.view.get(leader)
        target, addrs = leader, decl.addrs if decl is not None else ()
        # From now on joiners go to our leader; those we held go there too.
        rnd.mode = Mode.FOLLOW
        rnd.following = (target, addrs)
        # They, and those announced to us that have not come yet (our redirect meets
        # them when they do), are named in our joins: the leader waits for them
        # (`Gathering.expect`).
        coming = rnd.gathering.brought(self._loop.time())
        bringing = rnd.answer_all(JoinReply(ReplyKind.REDIRECT, peer=target, addrs=addrs))
        bringing.extend(p for p in coming if p not in bringing)
        asked_again = again = dialed_again = False
        try:
            for _ in range(MAX_REDIRECTS + 3):
                reply = await self._send_join(
                    rnd, target, addrs, end, again=again, bringing=bringing
                )
                if reply is _UNREACHED and not dialed_again:
                    dialed_again = True
                    await self.closing.pause(REDIRECT_PAUSE, end)
                    continue
                if reply is _LATE and not asked_again:
                    # Our join reached it but its answer did not reach us in time (a
                    # slow network, a stalled loop): it may have put us in its group,
                    # which goes on without us. Ask once more: it hands the group back.
                    asked_again = again = True
                    continue
                again = False
                if not isinstance(reply, JoinReply):
                    rnd.suspect(target)
                    return None
                if reply.kind is ReplyKind.ACCEPTED or (
                    reply.kind is ReplyKind.BUSY and reply.group is not None
                ):
                    return self._accept(rnd, target, reply)
                if reply.kind is ReplyKind.REDIRECT:
                    nxt = self._redirect_target(rnd, target, reply)
                    if nxt is None:
                        await self.closing.pause(REDIRECT_PAUSE, end)
                        return None
                    target, addrs = nxt
                    rnd.following = nxt
                    continue
                await self._refused(rnd, target, reply, end)
                return None
            await self.closing.pause(REDIRECT_PAUSE, end)
            return None
        finally:
            if rnd.mode == Mode.FOLLOW:
                rnd.mode = Mode.LEAD
                rnd.following = None

    def _accept(self, rnd: Round, target: PeerID, reply: JoinReply) -> Group | None:
        try:
            group = check_group(
                reply, key=self.key, version=rnd.outlook.version, me=self.peer_id,
                leader=target, bandwidth=self.declarer.bandwidth,
            )  # fmt: skip
        except ValueError as e:
            log.info("leader %s sent a bad group: %s", target.short(), e)
            rnd.failed(f"{target.short()}: bad group")
            rnd.suspect(target)
            return None
        self._conclude(rnd, group, target)
        return group

    def _redirect_target(
        self, rnd: Round, target: PeerID, reply: JoinReply
    ) -> tuple[PeerID, tuple[Multiaddr, ...]] | None:
        """Where a redirect sends us; None when it points to a peer we know failed
        (the redirecting peer will notice soon) or back up the ranks."""
        nxt = reply.peer
        assert nxt is not None
        outlook = rnd.outlook
        if nxt == self.peer_id or not rnd.may_join(nxt):
            return None
        if outlook.rank(nxt) >= outlook.rank(target):
            return None
        known = rnd.view.get(nxt)
        return nxt, reply.addrs or (known.addrs if known is not None else ())

    async def _refused(self, rnd: Round, target: PeerID, reply: JoinReply, end: float) -> None:
        """Act on a reply that gives us no group: set the leader (and whom it names) aside."""
        kind = reply.kind
        if kind is ReplyKind.RETRY:
            return
        if kind is ReplyKind.BUSY:
            rnd.suspect(target)
            # Its group's members are taken too, until they declare again
            # (`age`: they may have finished that round and be back already).
            threshold = time.time() - reply.age + self.config.declaration_ttl
            for m in reply.members[: self.config.target_group_size]:
                if m != self.peer_id:
                    rnd.outlook.suspicions.add(m, threshold)
            return
        if kind is ReplyKind.VERSION:
            # Its declaration was stale: perhaps we are the ones behind.
            known = rnd.view.get(target)
            if known is not None:
                rnd.view[target] = Declaration(
                    target,
                    PeerState.LOOKING,
                    reply.version,
                    known.addrs,
                    known.bandwidth,
                    known.expiration,
                )
            await self._recheck_version(rnd, end)
            rnd.suspect(target)
            return
        rnd.failed(f"{target.short()}: {kind}")
        rnd.suspect(target)  # disbanded or excluded us

    async def _send_join(
        self,
        rnd: Round,
        target: PeerID,
        addrs: tuple[Multiaddr, ...],
        end: float,
        *,
        again: bool = False,
        bringing: list[PeerID] | None = None,
    ) -> JoinReply | _Late | None:
        """One join request; its reply, None when the peer failed or answered
        garbage, `_LATE` when the request went out but no answer came in time,
        `_UNREACHED` when the connection failed before it went out.
        `again`: the same call asking once more after `_LATE`, with a shorter wait
        (a leader that closed answers at once; a silent one costs less).
        `bringing`: the joiners we redirected to `target`."""
        wait = min(self.config.join_timeout, REASK_TIMEOUT) if again else self.config.join_timeout
        until = min(end, self._loop.time() + wait)
        if until - self._loop.time() < ANSWER_MARGIN:
            return JoinReply(ReplyKind.RETRY)  # no time left: the loop ends the call
        request = JoinRequest(
            self.key, rnd.outlook.version, self.declarer.addrs(), self.declarer.bandwidth,
            call=rnd.ticket, bringing=tuple(bringing or ())[:MAX_BRINGING],
        ).to_wire()  # fmt: skip
        sent = False

        async def call() -> Any:
            nonlocal sent
            # (Dialed past our connection limit, as the round's `Company` is: a
            # redirect's target may be one our view does not hold.)
            with self.host.protecting((target,)):
                async with asyncio.timeout_at(until):
                    if self.host.connection(target) is None:
                        await self.host.connect(target, addrs)
                    # the leader gets what is left as its deadline to answer us
                    left = until - self._loop.time()
                    sent = True
                    return await rpc.call(
                        self.host, target, self.protocol, "join", request, timeout=left
                    )

        started = self._loop.time()
        try:
            raw = await self.closing.abortable(call())
            reply = JoinReply.from_wire(raw)
        except (TransportError, TimeoutError, OSError, ValueError) as e:
            log.debug("join at %s failed: %r", target.short(), e)
            rnd.failed(f"{target.short()}: {type(e).__name__}")
            if sent and isinstance(e, TimeoutError):
                answer: JoinReply | _Late | None = _LATE
            elif not sent and isinstance(e, TransportError):
                answer = _UNREACHED
            else:
                answer = None
            how = answer.value if isinstance(answer, _Late) else f"failed: {type(e).__name__}"
            rnd.joined(target, how, self._loop.time() - started)
            return answer
        rnd.joined(target, str(reply.kind), self._loop.time() - started)
        return reply
