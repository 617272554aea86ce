"""Matchmaking: peers that average one key find each other through the DHT and
agree on one group, with no coordinator.

One call of `Matchmaker.form_group` (the rules it applies are in
`matchmaking_rules`, without I/O):

1. *Look.* Read the declarations under ``<key>/matchmaking``. When another
   state version is held by more looking peers than ours, our state is behind:
   declare "syncing" (leaders wait a little for us) and raise `NeedsResync`,
   before we ever appear as looking with a stale version.
2. *Declare* "looking" with our version, addresses and bandwidth, in a subkey
   only we can sign (`owner_marker`), so nobody can declare for us.
3. *Decide*, again after every read: among the looking peers with our
   version, not excluded by the caller and not set aside (`Suspicions`), the
   lowest rank leads. The rank hashes the key, the version and the peer ID:
   it changes every committed round, so leadership rotates and no peer ID can
   be ground to lead always.

   - A follower sends one ``join`` and waits for its answer: the group; or
     "redirect" (that peer now follows a lower rank: join it); or "busy" (it
     is in a group: set it and its members aside until they declare again,
     which is how a crowd larger than the target splits); or "version" /
     "disbanded" / "excluded" (set it aside); or "retry". If the leader dies
     the call fails at once (its connection drops), the follower sets it
     aside and the next rank leads: a new group forms within
     ``min_matchmaking_time`` or so, and nobody waits for a declaration to
     expire.
   - The leader takes joins until it closes: at its share of a balanced split
     (`split_sizes`), or when nobody else is expected (`Outlook.pending`) and
     ``min_matchmaking_time`` has passed, or at ``matchmaking_time``, or just
     before the earliest deadline of a joiner or of the call. Then it answers
     every pending join with the same group. A leader that sees a lower rank
     appear redirects its joiners there and joins it itself.

4. *Busy.* Declare "busy" (nobody waits for us as a leader or counts our
   version, stale as soon as the round commits) and return the group.

Declarations outlive their owners (for ``declaration_ttl``), so two decisions
are checked with the owners first, by a ``hello`` call that returns a peer's
latest declaration: a re-sync is demanded only when the peers that outvote us
confirm their declarations, and a leader still waiting after
``min_matchmaking_time`` asks the missing peers once. Peers that do not answer
are set aside, so dead peers neither send the living to re-sync nor hold every
round to ``matchmaking_time``.

The RPC protocol is ``config.protocol + "/" + sha256(key)[:16 hex]``: one
handler per protocol name on a host, so one name per key.

Why members agree: a group exists only as the one object its leader built,
sent as the answer to each member's single pending join (and round-tripped
through the wire form on the leader too, so every copy is equal, members
ordered by peer ID, ``round_id = make_round_id(key, members, nonce)``, which
each member checks). A peer has at most one join pending and takes a group
only from the peer it asked; a leader that stops leading first answers every
joiner; a closed leader answers later joins "busy". So a peer is in at most one
group per call. The leader closes before any joiner's deadline (minus a
margin), so a member does not give up on an answer already on its way, except
when the network loses it; that is what the fault-tolerant all-reduce is for.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from shoal.dht.node import DHTError, DHTNode
from shoal.dht.records import RecordError, owner_marker
from shoal.transport import rpc
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.rpc import CallContext

from .deadline import Deadline
from .group import Group, Member
from .matchmaking_rules import (
    MAX_ADDRS,
    MAX_GROUP_SIZE,
    MAX_VERSION_BYTES,
    NONCE_BYTES,
    Declaration,
    Gathering,
    JoinReply,
    JoinRequest,
    Outlook,
    PeerState,
    ReplyKind,
    Suspicions,
    View,
    check_group,
    parse_view,
)

log = logging.getLogger("shoal.averaging.matchmaking")

T = TypeVar("T")

# A leader answers this long before a joiner's deadline: the answer must arrive in time.
ANSWER_MARGIN = 0.25
# Each DHT read or write of one call is bounded by this (and by the call's deadline).
DHT_TIMEOUT = 2.0
# The "busy" declaration after a group formed is awaited at most this long.
BUSY_STORE_TIMEOUT = 1.0
MAX_REDIRECTS = 4
# Before a re-sync is demanded, the peers holding the other version are asked
# whether their declaration is still current (a dead peer's stays for its TTL).
PROBE_TIMEOUT = 1.0
MAX_PROBES = 32
# After a redirect to a peer we know failed: give the redirecting peer time to notice.
REDIRECT_PAUSE = 0.1
FIRST_POLL = 0.05
CLOSE_TIMEOUT = 5.0


@dataclass
class MatchmakingConfig:
    min_group_size: int = 2
    target_group_size: int = 16
    matchmaking_time: float = 3.0  # how long to look for peers before the group is closed
    join_timeout: float = 5.0  # how long a follower waits for its leader's answer
    declaration_ttl: float = 30.0
    protocol: str = "/shoal/matchmaking/1.0.0"
    # A leader closes this soon when every peer it knows of has joined (and
    # nobody busy or syncing may still come); `matchmaking_time` bounds the wait.
    min_matchmaking_time: float = 0.5
    # A leader holds its group open up to this long after a peer declared that
    # it is loading the state (told to re-sync), so that it joins this round
    # instead of chasing the next one. Joiners' deadlines still bound the wait.
    resync_grace: float = 5.0
    # None: wait for a group until the caller's deadline. A number: a leader that
    # has led this long with nobody joined and nobody else declared at all (no
    # peer looking, busy or syncing: nobody is coming) gives up at once with
    # `NobodyElse` instead of waiting out the deadline. For callers whose round
    # is optional, such as an outer optimizer that trains on while it is alone.
    give_up_alone_after: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_group_size <= self.target_group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"need 1 <= min_group_size <= target_group_size <= {MAX_GROUP_SIZE}")
        if self.min_matchmaking_time < 0 or self.matchmaking_time <= 0:
            raise ValueError("matchmaking times must be positive")
        # A short matchmaking_time shortens the minimum too (callers often set only the former).
        self.min_matchmaking_time = min(self.min_matchmaking_time, self.matchmaking_time)
        if self.join_timeout <= 0 or self.declaration_ttl <= 0 or self.resync_grace < 0:
            raise ValueError("join_timeout and declaration_ttl must be positive")
        if not self.protocol.startswith("/"):
            raise ValueError("protocol must look like /shoal/<name>/<version>")
        if self.give_up_alone_after is not None and self.give_up_alone_after < 0:
            raise ValueError("give_up_alone_after must be >= 0 (or None)")


class MatchmakingError(Exception):
    """No group formed in time (the message says why)."""


class NobodyElse(MatchmakingError):
    """No other peer has declared for this key: nobody to average with (see
    `MatchmakingConfig.give_up_alone_after`)."""


class NeedsResync(MatchmakingError):
    """Our state version is behind the swarm's: load the state from peers first.

    `target`: the version most looking peers hold; `holders`: those peers;
    `versions`: how many looking peers hold each version (us included).
    """

    def __init__(
        self,
        message: str,
        *,
        version: bytes,
        target: bytes,
        versions: dict[bytes, int],
        holders: tuple[Member, ...],
    ) -> None:
        super().__init__(message)
        self.version = version
        self.target = target
        self.versions = versions
        self.holders = holders


class _Mode(enum.StrEnum):
    LEAD = "lead"  # taking joins (also before our first decision)
    FOLLOW = "follow"  # our join is pending at `_Round.following`
    CLOSED = "closed"  # the group is settled (or the call ended)


class _Round:
    """The state of one `form_group` call, shared by its loop and the join handler."""

    def __init__(self, outlook: Outlook, gathering: Gathering) -> None:
        self.outlook = outlook
        self.gathering = gathering
        self.mode = _Mode.LEAD
        self.following: tuple[PeerID, tuple[Multiaddr, ...]] | None = None
        # one pending join per member of the gathering, answered together
        self.waiters: dict[PeerID, asyncio.Future[dict[str, Any]]] = {}
        self.changed = asyncio.Event()
        self.group: Group | None = None
        self.view: dict[PeerID, Declaration] = {}
        self.failures: list[str] = []  # why joins failed, for the error message
        self.probed: set[tuple[PeerID, float]] = set()  # declarations already confirmed

    def failed(self, why: str) -> None:
        self.failures = [*self.failures[-15:], why]

    def conclude(self, group: Group, leader: PeerID) -> None:
        group.extra["leader"] = leader
        self.group = group
        self.mode = _Mode.CLOSED
        self.changed.set()

    def answer(self, peer: PeerID, reply: JoinReply) -> None:
        """Answer one pending join (and take the joiner out of the gathering)."""
        fut = self.waiters.pop(peer, None)
        self.gathering.withdraw(peer)
        if fut is not None and not fut.done():
            fut.set_result(reply.to_wire())

    def answer_all(self, reply: JoinReply) -> None:
        wire = reply.to_wire()
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_result(wire)
        self.waiters.clear()
        self.gathering.clear()


class Declarer:
    """Our declaration in the DHT (owner-signed subkey of ``<key>/matchmaking``) and
    reading everyone's: the matchmaker's only DHT traffic."""

    def __init__(
        self,
        dht: DHTNode,
        dht_key: str,
        config: MatchmakingConfig,
        bandwidth: float,
        abortable: Callable[[Awaitable[Any]], Awaitable[Any]],
    ) -> None:
        self.dht = dht
        self.host = dht.host
        self.peer_id = dht.peer_id
        self.dht_key = dht_key
        self.config = config
        self.bandwidth = bandwidth
        self._abortable = abortable
        self._subkey = owner_marker(self.peer_id)
        self._loop = asyncio.get_running_loop()
        self._expiration = 0.0
        self.declared_at = -float("inf")  # loop time of our last declaration
        self.declared: tuple[PeerState, bytes] = (PeerState.LEFT, b"")  # what it said

    def addrs(self) -> tuple[Multiaddr, ...]:
        return tuple(self.host.addresses())[:MAX_ADDRS]

    async def poll(
        self, previous: dict[PeerID, Declaration], end: float
    ) -> dict[PeerID, Declaration]:
        """The current declarations; the previous view when the DHT does not answer in time."""
        timeout = min(DHT_TIMEOUT, end - self._loop.time())
        if timeout <= 0:
            return previous
        try:
            async with asyncio.timeout(timeout):
                value = await self._abortable(self.dht.get(self.dht_key, latest=True))
        except (TimeoutError, DHTError, TransportError, OSError) as e:
            log.debug("%s: reading declarations failed: %r", self.dht_key, e)
            return previous
        return parse_view(value.subkeys if value is not None else None, time.time())

    async def declare(
        self,
        state: PeerState,
        version: bytes,
        *,
        end: float | None = None,
        timeout: float = DHT_TIMEOUT,
        at_least: float = 0.0,
    ) -> bool:
        """Store our declaration; False when the DHT did not take it in time."""
        if end is not None:
            timeout = max(min(timeout, end - self._loop.time()), at_least)
        if timeout <= 0:
            return False
        # Strictly later than our previous one: the later expiration wins everywhere.
        expiration = max(time.time() + self.config.declaration_ttl, self._expiration + 1e-3)
        self._expiration = expiration
        self.declared_at = self._loop.time()
        self.declared = (state, version)
        decl = Declaration(self.peer_id, state, version, self.addrs(), self.bandwidth)
        try:
            async with asyncio.timeout(timeout):
                return await self.dht.store(
                    self.dht_key, decl.to_value(), expiration, subkey=self._subkey
                )
        except (TimeoutError, DHTError, TransportError, OSError, RecordError) as e:
            log.debug("%s: declaring %s failed: %r", self.dht_key, state, e)
            return False


class Matchmaker:
    """Forms averaging groups for `key` over `dht`; one `form_group` at a time."""

    def __init__(
        self,
        dht: DHTNode,
        key: str,
        config: MatchmakingConfig | None = None,
        *,
        bandwidth: float = 1.0,
    ) -> None:
        self.dht = dht
        self.host = dht.host
        self.peer_id: PeerID = dht.peer_id
        self.key = key
        self.config = config or MatchmakingConfig()
        self.bandwidth = float(bandwidth)
        self.dht_key = f"{key}/matchmaking"
        # One handler per protocol name on a host: the key is part of the name,
        # so that several matchmakers (keys) can share a host.
        tag = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.protocol = f"{self.config.protocol}/{tag}"
        self._service = rpc.RpcService(self.host, self.protocol)
        self._service.unary("join")(self._on_join)
        self._service.unary("hello")(self._on_hello)
        self._suspicions = Suspicions()
        self._round: _Round | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = asyncio.Event()
        self._last_group: tuple[tuple[PeerID, ...], float] = ((), 0.0)  # members, loop time
        self._loop = asyncio.get_running_loop()
        self.declarer = Declarer(dht, self.dht_key, self.config, self.bandwidth, self._abortable)
        ttl = self.config.declaration_ttl
        self._poll_max = min(1.0, max(0.05, self.config.min_matchmaking_time / 2), ttl / 4)

    # ------------------------------------------------------------------ public API

    async def form_group(
        self,
        *,
        state_version: bytes,
        exclude: Collection[PeerID] = (),
        deadline: Deadline | None = None,
    ) -> Group:
        """The group agreed with other peers (us included), equal on every member.

        `exclude`: peers the caller just saw fail; they are left out at once (and
        set aside until they declare again). `deadline`: when to give up (loop
        time); None means ``matchmaking_time + join_timeout`` from now. Raises
        MatchmakingError when no group of ``min_group_size`` formed by then,
        NeedsResync when our `state_version` is behind the swarm's.
        """
        if self._closing.is_set():
            raise MatchmakingError("matchmaker is closed")
        if self._round is not None:
            raise RuntimeError("form_group is already running on this matchmaker")
        if not isinstance(state_version, bytes) or len(state_version) > MAX_VERSION_BYTES:
            raise ValueError(f"state_version must be bytes of at most {MAX_VERSION_BYTES}")
        cfg = self.config
        if deadline is None or deadline.at is None:
            deadline = Deadline.after(cfg.matchmaking_time + cfg.join_timeout)
        assert deadline.at is not None
        end = deadline.at
        me = Member(self.peer_id, self.declarer.addrs(), self.bandwidth)
        outlook = Outlook(
            self.key,
            self.peer_id,
            state_version,
            frozenset(exclude) - {self.peer_id},
            self._suspicions,
        )
        gathering = Gathering(
            me,
            min_size=cfg.min_group_size,
            target=cfg.target_group_size,
            min_time=cfg.min_matchmaking_time,
            max_time=cfg.matchmaking_time,
            margin=ANSWER_MARGIN,
        )
        rnd = _Round(outlook, gathering)
        self._round = rnd
        self._idle.clear()
        try:
            group = await self._run(rnd, end)
        finally:
            if rnd.mode != _Mode.CLOSED or rnd.waiters:
                rnd.answer_all(JoinReply(ReplyKind.DISBANDED))
            rnd.mode = _Mode.CLOSED
            self._round = None
            self._idle.set()
            self._suspicions.prune(time.time())
        # Nobody should wait for us as a leader now, nor count our version: it
        # is stale the moment this round commits.
        await self.declarer.declare(PeerState.BUSY, state_version, timeout=BUSY_STORE_TIMEOUT)
        return group

    async def declare_busy(self, state_version: bytes, *, timeout: float = DHT_TIMEOUT) -> bool:
        """Declare, outside `form_group`, that we take part and will look soon (as a
        member of a round does): leaders wait for us (up to `matchmaking_time`) and
        a peer that would be alone is not. False when the DHT did not take it in
        time. Not while `form_group` runs (it keeps its own declaration)."""
        if self._round is not None:
            raise RuntimeError("form_group is running on this matchmaker")
        return await self.declarer.declare(PeerState.BUSY, state_version, timeout=timeout)

    async def aclose(self) -> None:
        """Stop: a running `form_group` raises MatchmakingError, pending joiners
        are answered, and the swarm is told we left (best effort)."""
        if self._closing.is_set():
            return
        self._closing.set()
        rnd = self._round
        if rnd is not None:
            rnd.answer_all(JoinReply(ReplyKind.DISBANDED))
            rnd.changed.set()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self._idle.wait()
        except TimeoutError:
            log.warning("form_group did not stop within %s s", CLOSE_TIMEOUT)
        self._service.close()
        try:
            await self.declarer.declare(PeerState.LEFT, b"", timeout=1.0)
        except Exception as e:  # best effort: the DHT may be closing too
            log.debug("%s: declaring that we left failed: %r", self.key, e)

    def stats(self) -> dict[str, Any]:
        rnd = self._round
        return {
            "key": self.key,
            "mode": rnd.mode if rnd is not None else "idle",
            "gathered": rnd.gathering.size if rnd is not None else 0,
            "suspected": len(self._suspicions),
        }

    # ------------------------------------------------------------------ the call

    async def _run(self, rnd: _Round, end: float) -> Group:
        outlook = rnd.outlook
        cfg = self.config
        # Look before declaring: a peer whose state is behind must never
        # appear as looking with it (leaders would wait for it, peers count it).
        rnd.view = await self.declarer.poll(rnd.view, end)
        self._note_excluded(rnd)
        if rnd.group is None:  # (joins may have filled the group meanwhile)
            await self._check_version(rnd, end)
            await self.declarer.declare(PeerState.LOOKING, outlook.version, end=end)
        backoff = 0
        next_poll = self._loop.time() + FIRST_POLL
        while True:
            if self._closing.is_set():
                raise MatchmakingError("matchmaker is closed")
            if rnd.group is not None:
                return rnd.group
            now = self._loop.time()
            if now >= end:
                raise MatchmakingError(self._failure(rnd))
            if now >= next_poll:
                view = await self.declarer.poll(rnd.view, end)
                if rnd.group is not None:
                    continue  # a join filled the group meanwhile
                backoff = 0 if _fingerprint(view) != _fingerprint(rnd.view) else backoff + 1
                rnd.view = view
                self._note_excluded(rnd)
                await self._check_version(rnd, end)
                if self._loop.time() - self.declarer.declared_at > cfg.declaration_ttl / 3:
                    await self.declarer.declare(PeerState.LOOKING, outlook.version, end=end)
                next_poll = self._loop.time() + min(self._poll_max, FIRST_POLL * 2**backoff)
                if rnd.group is not None:
                    continue
            leader = outlook.leader(rnd.view)
            if leader != self.peer_id:
                if end - self._loop.time() < ANSWER_MARGIN:
                    raise MatchmakingError(self._failure(rnd))  # no time for an answer
                group = await self._follow(rnd, leader, end)
                if group is not None:
                    return group
                continue
            gathering = rnd.gathering
            now = self._loop.time()
            gathering.begin(now)
            gathering.capacity = outlook.capacity(
                rnd.view, gathering.members, cfg.target_group_size, cfg.min_group_size
            )
            pending = outlook.pending(rnd.view, gathering.members)
            assert gathering.started is not None
            if pending and now >= gathering.started + cfg.min_matchmaking_time:
                # Still waiting for someone: ask them once per declaration, so
                # that dead peers (whose declarations outlive them) are set
                # aside instead of holding every round to matchmaking_time.
                unasked = [
                    rnd.view[p] for p in pending if (p, rnd.view[p].expiration) not in rnd.probed
                ]
                if unasked:
                    rnd.probed.update((d.peer_id, d.expiration) for d in unasked)
                    await self._confirm(rnd, unasked, min(end, gathering.close_by(end)))
                    continue
            syncing = [rnd.view[p] for p in pending if rnd.view[p].state is PeerState.SYNCING]
            gathering.hold_until = None
            if syncing:  # when the newest began to sync (its expiration - TTL), plus the grace
                began = max(d.expiration for d in syncing) - cfg.declaration_ttl
                gathering.hold_until = now + (began + cfg.resync_grace - time.time())
            alone_after = cfg.give_up_alone_after
            if (
                alone_after is not None
                and gathering.size == 1
                and not pending
                and outlook.alone(rnd.view)
                and now >= gathering.started + alone_after
            ):
                raise NobodyElse(f"no other peer is averaging {self.key!r}")
            decision = gathering.decide(now, pending=len(pending), deadline=end)
            for peer in decision.release:
                rnd.answer(peer, JoinReply(ReplyKind.RETRY))
            if decision.close:
                self._close(rnd)
                continue
            rnd.changed.clear()
            try:
                async with asyncio.timeout_at(min(decision.wake_at, next_poll, end)):
                    await rnd.changed.wait()
            except TimeoutError:
                pass

    async def _follow(self, rnd: _Round, leader: PeerID, end: float) -> Group | None:
        """Join `leader` (following its redirects); the group, or None to decide again."""
        outlook = rnd.outlook
        decl = rnd.view.get(leader)
        target, addrs = leader, decl.addrs if decl is not None else ()
        # From now on joiners go to our leader; those we held go there too.
        rnd.mode = _Mode.FOLLOW
        rnd.following = (target, addrs)
        rnd.answer_all(JoinReply(ReplyKind.REDIRECT, peer=target, addrs=addrs))
        try:
            for _ in range(MAX_REDIRECTS + 1):
                reply = await self._send_join(rnd, target, addrs, end)
                if reply is None:
                    self._suspect(rnd, target)
                    return None
                kind = reply.kind
                if kind is ReplyKind.ACCEPTED:
                    try:
                        group = check_group(
                            reply,
                            key=self.key,
                            version=outlook.version,
                            me=self.peer_id,
                            leader=target,
                        )
                    except ValueError as e:
                        log.info("leader %s sent a bad group: %s", target.short(), e)
                        rnd.failed(f"{target.short()}: bad group")
                        self._suspect(rnd, target)
                        return None
                    self._conclude(rnd, group, target)
                    return group
                if kind is ReplyKind.REDIRECT:
                    nxt = reply.peer
                    assert nxt is not None
                    if (
                        nxt == self.peer_id
                        or not self._may_join(rnd, nxt)
                        or outlook.rank(nxt) >= outlook.rank(target)
                    ):
                        # It follows a peer we know failed (it will notice soon), or
                        # it points back up the ranks: decide again in a moment.
                        await self._pause(REDIRECT_PAUSE, end)
                        return None
                    known = rnd.view.get(nxt)
                    target = nxt
                    addrs = reply.addrs or (known.addrs if known is not None else ())
                    rnd.following = (target, addrs)
                    continue
                if kind is ReplyKind.BUSY:
                    self._suspect(rnd, target)
                    # Its group's members are taken too, until they declare again
                    # (`age`: they may have finished that round and be back already).
                    threshold = time.time() - reply.age + self.config.declaration_ttl
                    for m in reply.members[: self.config.target_group_size]:
                        if m != self.peer_id:
                            self._suspicions.add(m, threshold)
                    return None
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
                    await self._check_version(rnd, end)
                    self._suspect(rnd, target)
                    return None
                if kind is ReplyKind.RETRY:
                    return None
                rnd.failed(f"{target.short()}: {kind}")
                self._suspect(rnd, target)  # disbanded or excluded us
                return None
            await self._pause(REDIRECT_PAUSE, end)
            return None
        finally:
            if rnd.mode == _Mode.FOLLOW:
                rnd.mode = _Mode.LEAD
                rnd.following = None

    async def _send_join(
        self, rnd: _Round, target: PeerID, addrs: tuple[Multiaddr, ...], end: float
    ) -> JoinReply | None:
        """One join request; its reply, or None when the peer failed or answered garbage."""
        until = min(end, self._loop.time() + self.config.join_timeout)
        if until - self._loop.time() < ANSWER_MARGIN:
            return JoinReply(ReplyKind.RETRY)  # no time left: the loop ends the call
        request = JoinRequest(
            self.key, rnd.outlook.version, self.declarer.addrs(), self.bandwidth
        ).to_wire()

        async def call() -> Any:
            async with asyncio.timeout_at(until):
                if self.host.connection(target) is None:
                    await self.host.connect(target, addrs)
                # the leader gets what is left as its deadline to answer us
                left = until - self._loop.time()
                return await rpc.call(
                    self.host, target, self.protocol, "join", request, timeout=left
                )

        try:
            raw = await self._abortable(call())
            return JoinReply.from_wire(raw)
        except (TransportError, TimeoutError, OSError, ValueError) as e:
            log.debug("join at %s failed: %r", target.short(), e)
            rnd.failed(f"{target.short()}: {type(e).__name__}")
            return None

    # ------------------------------------------------------------------ leader side

    async def _on_join(self, ctx: CallContext, payload: object) -> dict[str, Any]:
        request = JoinRequest.from_wire(payload)  # ValueError: the joiner gets an error
        if request.key != self.key:
            raise ValueError("join request for another key")
        peer = ctx.peer
        if peer == self.peer_id:
            raise ValueError("a peer cannot join itself")
        rnd = self._round
        if rnd is None or rnd.mode == _Mode.CLOSED:
            members, formed = self._last_group
            age = max(0.0, self._loop.time() - formed) if members else 0.0
            return JoinReply(ReplyKind.BUSY, members=members, age=age).to_wire()
        if peer in rnd.outlook.excluded:
            return JoinReply(ReplyKind.EXCLUDED).to_wire()
        if request.state_version != rnd.outlook.version:
            return JoinReply(ReplyKind.VERSION, version=rnd.outlook.version).to_wire()
        if rnd.mode == _Mode.FOLLOW:
            assert rnd.following is not None
            leader, addrs = rnd.following
            return JoinReply(ReplyKind.REDIRECT, peer=leader, addrs=addrs).to_wire()
        timeout = ctx.timeout if ctx.timeout is not None else self.config.join_timeout
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        rnd.answer(peer, JoinReply(ReplyKind.RETRY))  # a repeated request replaces one
        rnd.gathering.admit(
            Member(peer, request.addrs, request.bandwidth), self._loop.time() + timeout
        )
        rnd.waiters[peer] = fut
        if rnd.gathering.full:
            self._close(rnd)  # right now, so that the next joiner hears "busy"
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

    async def _on_hello(self, ctx: CallContext, payload: object) -> dict[str, Any]:
        """Our latest declaration, so that a peer can tell it is current (not a dead peer's)."""
        if not isinstance(payload, dict) or payload.get("key") != self.key:
            raise ValueError("hello must name our key")
        state, version = self.declarer.declared
        return {"state": str(state), "version": version}

    def _conclude(self, rnd: _Round, group: Group, leader: PeerID) -> None:
        rnd.conclude(group, leader)
        self._last_group = (group.peer_ids, self._loop.time())

    def _close(self, rnd: _Round) -> None:
        """Settle the group and answer every pending join with it."""
        nonce = os.urandom(NONCE_BYTES)
        group = rnd.gathering.finalize(self.key, rnd.outlook.version, nonce)
        self._conclude(rnd, group, self.peer_id)
        reply = JoinReply(ReplyKind.ACCEPTED, group=group, nonce=nonce).to_wire()
        for fut in rnd.waiters.values():
            if not fut.done():
                fut.set_result(reply)
        rnd.waiters.clear()
        log.debug("%s: closed group %s of %d", self.key, group.round_id.hex()[:12], group.size)

    # ------------------------------------------------------------------ helpers

    async def _check_version(self, rnd: _Round, end: float) -> None:
        """Raise NeedsResync when the swarm has moved past our version.

        The declarations that outvote us are first confirmed with their
        owners: a peer killed while looking leaves its declaration behind for
        a whole TTL, and a few of those must not send live peers to re-sync.
        Owners that do not answer are set aside.
        """
        outlook = rnd.outlook
        target = outlook.resync_target(rnd.view)
        if target is None:
            return
        counts = dict(outlook.version_counts(rnd.view))
        mine = counts[outlook.version]
        holders = outlook.holders(rnd.view, target)
        confirmed = await self._confirm(rnd, holders[:MAX_PROBES], end)
        if rnd.group is not None or rnd.mode == _Mode.CLOSED:
            return  # joins filled our group while we asked
        if not confirmed or not outlook.outvoted(len(confirmed), target, mine):
            return
        rnd.answer_all(JoinReply(ReplyKind.DISBANDED))
        rnd.mode = _Mode.CLOSED
        # Leaders of that version wait a little for a syncing peer.
        await self.declarer.declare(PeerState.SYNCING, target, end=end, at_least=0.2)
        raise NeedsResync(
            f"{len(confirmed)} looking peers hold version {_short(target)}, "
            f"{mine} (us included) hold ours {_short(outlook.version)}: "
            "load the state first",
            version=outlook.version,
            target=target,
            versions=counts,
            holders=tuple(Member(d.peer_id, d.addrs, d.bandwidth) for d in confirmed),
        )

    async def _confirm(
        self, rnd: _Round, decls: list[Declaration], end: float
    ) -> list[Declaration]:
        """The declarations whose owners confirm them as their latest; the
        owners that cannot be reached (or answer garbage) are set aside."""
        until = min(end, self._loop.time() + PROBE_TIMEOUT)
        if until <= self._loop.time():
            return []

        async def ask(d: Declaration) -> bool:
            try:
                async with asyncio.timeout_at(until):
                    if self.host.connection(d.peer_id) is None:
                        await self.host.connect(d.peer_id, d.addrs)
                    left = until - self._loop.time()
                    raw = await rpc.call(
                        self.host,
                        d.peer_id,
                        self.protocol,
                        "hello",
                        {"key": self.key},
                        timeout=left,
                    )
            except (TransportError, TimeoutError, OSError) as e:
                log.debug(
                    "%s: %s did not confirm its declaration: %r", self.key, d.peer_id.short(), e
                )
                self._suspect(rnd, d.peer_id)
                return False
            if not isinstance(raw, dict):
                self._suspect(rnd, d.peer_id)
                return False
            # A live peer whose declaration changed since we read it: not a vote, not a suspect.
            return raw.get("state") == str(d.state) and raw.get("version") == d.state_version

        answers = await self._abortable(asyncio.gather(*(ask(d) for d in decls)))
        return [d for d, ok in zip(decls, answers, strict=True) if ok]

    def _note_excluded(self, rnd: _Round) -> None:
        """The caller's exclusions stay set aside in later calls, until they declare again."""
        for p in rnd.outlook.excluded:
            decl = rnd.view.get(p)
            if decl is not None:
                self._suspicions.add(p, decl.expiration)

    def _may_join(self, rnd: _Round, peer: PeerID) -> bool:
        if peer in rnd.outlook.excluded:
            return False
        decl = rnd.view.get(peer)
        if decl is not None:
            return self._suspicions.allows(decl)
        return not self._suspicions.blocks(peer, time.time())

    def _suspect(self, rnd: _Round, peer: PeerID) -> None:
        """Set `peer` aside until it declares again."""
        decl = rnd.view.get(peer)
        seen = decl.expiration if decl is not None else time.time() + self.config.declaration_ttl
        self._suspicions.add(peer, seen)

    def _failure(self, rnd: _Round) -> str:
        size = rnd.gathering.size
        seen = len(rnd.outlook.candidates(rnd.view))
        why = f"no group of {self.config.min_group_size} by the deadline"
        why += f" ({seen} other peers looking with our version, {size} gathered"
        if rnd.failures:
            why += "; failed: " + ", ".join(dict.fromkeys(rnd.failures[-5:]))
        return why + ")"

    async def _pause(self, seconds: float, end: float) -> None:
        until = min(end, self._loop.time() + seconds)
        try:
            async with asyncio.timeout_at(until):
                await self._closing.wait()
        except TimeoutError:
            pass

    async def _abortable(self, aw: Awaitable[T]) -> T:
        """Await `aw`, abandoning it (MatchmakingError) when the matchmaker closes."""
        task = asyncio.ensure_future(aw)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait((task, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise MatchmakingError("matchmaker is closed")
        return task.result()


def _fingerprint(view: View) -> set[tuple[PeerID, str, bytes, float]]:
    return {(d.peer_id, d.state, d.state_version, d.expiration) for d in view.values()}


def _short(version: bytes) -> str:
    """A version in a log line: its last 12 hex digits (versions that count commits
    differ at the end; the leading digits are zeros)."""
    return version.hex()[-12:] or "empty"
