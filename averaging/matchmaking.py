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
     appear redirects its joiners there and joins it itself, naming them: the
     lower rank waits for them (`Gathering.expect`, bounded).

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
when its loop stalls or the network is slow or loses it. Then the member asks the
same leader once more in the same call, and the leader hands the group back to
the join of that call (a random ticket in each join names the call); a member
that cannot reach it again is what the fault-tolerant all-reduce is for.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from shoal.dht.node import DHTNode
from shoal.transport import rpc
from shoal.transport.identity import PeerID
from shoal.transport.tasks import TaskSet

from .deadline import Deadline
from .declarer import DHT_TIMEOUT, Declarer
from .group import Group, Member
from .matchmaking_island import Neighbors
from .matchmaking_join import ANSWER_MARGIN, JoinClient, JoinServer, Prober
from .matchmaking_round import (
    Closing,
    Company,
    MatchmakingConfig,
    MatchmakingError,
    Mode,
    Round,
)
from .matchmaking_rules import (
    MAX_VERSION_BYTES,
    Declaration,
    Gathering,
    JoinReply,
    Outlook,
    PeerState,
    ReplyKind,
    Suspicions,
)
from .matchmaking_upkeep import FIRST_POLL, Upkeep
from .matchmaking_versions import Lineages, NeedsResync, Versions
from .moshpit import cell_key
from .step_result import JoinTry

__all__ = [
    "Lineages",
    "Matchmaker",
    "MatchmakingConfig",
    "MatchmakingError",
    "NeedsResync",
    "NobodyElse",
]

log = logging.getLogger("shoal.averaging.matchmaking")

# The "busy" declaration after a group formed is awaited at most this long (it
# goes on landing in the background after that, for up to BUSY_STORE_LANDING_S).
BUSY_STORE_TIMEOUT = 1.0
BUSY_STORE_LANDING_S = 10.0
CLOSE_TIMEOUT = 5.0
# How many of the peers a round may group with it keeps connectable past the host's
# connection limit (`matchmaking_round.Company`), in groups' worth: in a Moshpit
# cell all of them; under one crowded key, the likeliest leaders and their followers.
COMPANY_PER_GROUP = 2


class NobodyElse(MatchmakingError):
    """No other peer has declared for this key: nobody to average with (see
    `MatchmakingConfig.give_up_alone_after`)."""


class Matchmaker:
    """Forms averaging groups for `key` over `dht`; one `form_group` at a time.

    The loop of one call (look, decide, lead or follow) is here; the RPCs are in
    `matchmaking_join` (`JoinClient` for a follower, `JoinServer` for a leader,
    `Prober` to confirm declarations), the DHT traffic in `Declarer`.
    """

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
        # The key groups form under: `key`, or a Moshpit cell's (`enter_cell`).
        self.group_key = key
        self.cell: str | None = None
        # The grid slot of our next rounds (`MatchmakingConfig.grid_period`), set by
        # the averager before each (None: no slots). Our "looking" says it, and the
        # "looking" of an earlier slot does not count (`Outlook.from_an_earlier_slot`).
        self.slot: int | None = None
        # Peers (us included) declared taking part in our last round's view: how
        # crowded the key is (a Moshpit grid moves to its cells past one group).
        self.last_crowd = 1
        # The joins our last `form_group` call sent, and their answers (the step's log).
        self.last_joins: tuple[JoinTry, ...] = ()
        self.config = config or MatchmakingConfig()
        # The smallest group the caller accepts, asked again at every poll of a
        # round (None: `config.min_group_size`). For a caller whose quorum depends
        # on who is live: a member banned while it looks must stop counting then,
        # not at its next call (a quorum that counts a banned peer can never form).
        self.quorum: Callable[[], int] | None = None
        self.bandwidth = float(bandwidth)
        self.dht_key = f"{key}/matchmaking"
        # One handler per protocol name on a host: the key is part of the name,
        # so that several matchmakers (keys) can share a host.
        tag = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.protocol = f"{self.config.protocol}/{tag}"
        self._suspicions = Suspicions()
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy_stores = TaskSet(log, "busy store")  # landing after form_group
        self._closing = Closing()
        self._loop = asyncio.get_running_loop()
        ttl = self.config.declaration_ttl
        self.declarer = Declarer(dht, self.dht_key, ttl, self.bandwidth, self._closing.abortable)
        self._service = rpc.RpcService(self.host, self.protocol)
        self._server = JoinServer(self._service, key, self.peer_id, self.config, self.declarer)
        self._prober = Prober(self.host, self.protocol, key, self._closing)
        self._versions = Versions(self._prober, self.declarer)
        self._neighbors = Neighbors(self.host, self.protocol, key, self._closing.abortable)
        self._client = JoinClient(
            self.host,
            self.protocol,
            key,
            self.config,
            self.declarer,
            self._closing,
            conclude=self._server.conclude,
            recheck_version=self._versions.check,
        )
        self._upkeep = Upkeep(self.declarer, self._neighbors, self._versions, self.config)

    # ------------------------------------------------------------------ public API

    @property
    def lineages(self) -> Lineages | None:
        """The certified ranks of shared states' versions (set by a shared state's
        averager): what decides which side of two lineages re-syncs."""
        return self._versions.lineages

    @lineages.setter
    def lineages(self, lineages: Lineages | None) -> None:
        self._versions.lineages = lineages

    async def form_group(
        self,
        *,
        state_version: bytes,
        exclude: Collection[PeerID] = (),
        deadline: Deadline | None = None,
        work: int | None = None,
    ) -> Group:
        """The group agreed with other peers (us included), equal on every member.

        `exclude`: peers the caller just saw fail; they are left out at once (and
        set aside until they declare again). `deadline`: when to give up (loop
        time); None means ``matchmaking_time + join_timeout`` from now. `work`: of
        the lineage that made our version (`Outlook.lineage`), None to say none. Raises
        MatchmakingError when no group of ``min_group_size`` formed by then,
        NeedsResync when our `state_version` is behind the swarm's.
        """
        if self._closing.is_set():
            raise MatchmakingError("matchmaker is closed")
        if self._server.round is not None:
            raise RuntimeError("form_group is already running on this matchmaker")
        if not isinstance(state_version, bytes) or len(state_version) > MAX_VERSION_BYTES:
            raise ValueError(f"state_version must be bytes of at most {MAX_VERSION_BYTES}")
        cfg = self.config
        if deadline is None or deadline.at is None:
            deadline = Deadline.after(cfg.matchmaking_time + cfg.join_timeout)
        assert deadline.at is not None
        rnd = self._new_round(state_version, exclude, work)
        self._server.round = rnd
        self._idle.clear()
        # The company (and, once the group is settled, its members: `Round.conclude`)
        # stays connectable up to our return, after the wait for the "busy" store
        # below: the caller's round protects the members from there on.
        with Company(self.host, COMPANY_PER_GROUP * cfg.target_group_size) as rnd.company:
            try:
                group = await self._run(rnd, deadline.at)
            finally:
                if rnd.mode != Mode.CLOSED or rnd.waiters:
                    rnd.answer_all(JoinReply(ReplyKind.DISBANDED))
                rnd.mode = Mode.CLOSED
                self.last_crowd = crowd(rnd.view, self.peer_id)
                self.last_joins = tuple(rnd.joins)
                self._server.round = None
                self._idle.set()
                self._suspicions.prune(time.time())
            # Nobody should wait for us as a leader now, nor count our version: it
            # is stale the moment this round commits. The round waits for that store
            # BUSY_STORE_TIMEOUT at most, but does not cancel it: on a slow DHT it lands
            # late rather than never (a "looking" left behind holds leaders waiting).
            self._neighbors.note(group.peer_ids)
            busy = self._busy_stores.spawn(
                self.declarer.declare(
                    PeerState.BUSY, state_version, timeout=BUSY_STORE_LANDING_S, work=work
                )
            )
            await asyncio.wait({busy}, timeout=BUSY_STORE_TIMEOUT)
        return group

    async def declare_busy(
        self, state_version: bytes, *, timeout: float = DHT_TIMEOUT, work: int | None = None
    ) -> bool:
        """Declare, outside `form_group`, that we take part and will look soon (as a
        member of a round does): leaders wait for us (up to `matchmaking_time`) and
        a peer that would be alone is not. False when the DHT did not take it in
        time. Not while `form_group` runs (it keeps its own declaration)."""
        if self._server.round is not None:
            raise RuntimeError("form_group is running on this matchmaker")
        return await self.declarer.declare(
            PeerState.BUSY, state_version, timeout=timeout, work=work
        )

    def enter_cell(self, cell: str | None) -> None:
        """Form the next groups only with the peers of `cell` of the Moshpit grid
        (`moshpit.Grid`; None: with every peer of the key). The RPC protocol stays
        the key's, so a join that reaches us from our old cell is answered, and
        refused as a group of another key. Our declaration in the cell we leave
        becomes "left" (in the background), so that its leaders do not wait for us."""
        if self._server.round is not None:
            raise RuntimeError("form_group is running on this matchmaker")
        group_key = self.key if cell is None else cell_key(self.key, cell)
        if group_key == self.group_key:
            return
        self.cell, self.group_key = cell, group_key
        for part in (self._server, self._prober, self._neighbors, self._client):
            part.key = group_key
        self.dht_key = f"{group_key}/matchmaking"
        left = self.declarer.move(self.dht_key)
        if self.declarer.declared[0] is not PeerState.LEFT:
            self._busy_stores.spawn(self.declarer.withdraw(left, timeout=BUSY_STORE_LANDING_S))

    def set_aside_version(self, version: bytes, seconds: float) -> None:
        """Leave the peers declaring `version` out of our rounds (and out of the vote
        on which version is current) for `seconds`: a re-sync to it found no
        reachable peer serving it, and the peers we reach go on meanwhile."""
        self._versions.set_aside(version, seconds)

    def supersede(self, version: bytes, seconds: float) -> None:
        """We are leaving `version` by a commit with others: for `seconds`, peers still
        declaring it (they missed the round) never make us re-sync back to it."""
        self._versions.supersede(version, seconds)

    async def aclose(self) -> None:
        """Stop: a running `form_group` raises MatchmakingError, pending joiners
        are answered, and the swarm is told we left (best effort)."""
        if self._closing.is_set():
            return
        self._closing.set()
        rnd = self._server.round
        if rnd is not None:
            rnd.answer_all(JoinReply(ReplyKind.DISBANDED))
            rnd.changed.set()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self._idle.wait()
        except TimeoutError:
            log.warning("form_group did not stop within %s s", CLOSE_TIMEOUT)
        self._service.close()
        self._busy_stores.cancel()
        try:
            await self.declarer.declare(PeerState.LEFT, b"", timeout=1.0)
        except Exception as e:  # best effort: the DHT may be closing too
            log.debug("%s: declaring that we left failed: %r", self.key, e)

    def stats(self) -> dict[str, Any]:
        rnd = self._server.round
        return {
            "key": self.key,
            "cell": self.cell,
            "mode": rnd.mode if rnd is not None else "idle",
            "gathered": rnd.gathering.size if rnd is not None else 0,
            "suspected": len(self._suspicions),
            "versions_set_aside": self._versions.set_aside_count(),
            "cut_off": self.declarer.cut_off,
            "island_reads": self._neighbors.islands,
        }

    # ------------------------------------------------------------------ the call

    def _new_round(
        self, version: bytes, exclude: Collection[PeerID], work: int | None = None
    ) -> Round:
        cfg = self.config
        me = Member(self.peer_id, self.declarer.addrs(), self.bandwidth)
        # Peers blocked on the host (convicted cheaters) are left out like the
        # caller's exclusions: nobody waits for them, follows them or admits them.
        excluded = (frozenset(exclude) | frozenset(self.host.blocked())) - {self.peer_id}
        set_aside, superseded = self._versions.left_out(time.monotonic())
        outlook = Outlook(
            self.group_key, self.peer_id, version, excluded, self._suspicions, set_aside,
            superseded,
            work, None if self.lineages is None else self.lineages.order, self.slot,
        )  # fmt: skip
        gathering = Gathering(
            me,
            min_size=self._min_group_size(),
            target=cfg.target_group_size,
            min_time=cfg.min_matchmaking_time,
            max_time=cfg.matchmaking_time,
            margin=ANSWER_MARGIN,
        )
        return Round(outlook, gathering, cfg.declaration_ttl)

    def _min_group_size(self) -> int:
        cfg = self.config
        if self.quorum is None:
            return cfg.min_group_size
        return max(1, min(self.quorum(), cfg.target_group_size))

    async def _run(self, rnd: Round, end: float) -> Group:
        # Look before declaring: a peer whose state is behind must never
        # appear as looking with it (leaders would wait for it, peers count it).
        rnd.view = await self._upkeep.read(rnd.view, end)
        rnd.note_excluded()
        self._keep_company(rnd)
        if rnd.group is None:  # (joins may have filled the group meanwhile)
            await self._versions.check(rnd, end)
            outlook = rnd.outlook
            await self.declarer.declare(
                PeerState.LOOKING, outlook.version, end=end, work=outlook.work, slot=outlook.slot
            )
        next_poll = self._loop.time() + FIRST_POLL
        while True:
            if self._closing.is_set():
                raise MatchmakingError("matchmaker is closed")
            if rnd.group is not None:
                return rnd.group
            if self._loop.time() >= end:
                raise MatchmakingError(rnd.failure(rnd.gathering.min_size))
            if self._loop.time() >= next_poll:
                next_poll = await self._upkeep.refresh(rnd, end)
                self._keep_company(rnd)
                rnd.gathering.min_size = self._min_group_size()
                if rnd.group is not None:
                    continue  # a join filled the group meanwhile
            leader = rnd.outlook.leader(rnd.view)
            if leader == self.peer_id:
                await self._lead(rnd, end, next_poll)
                continue
            if end - self._loop.time() < ANSWER_MARGIN:  # no time for an answer
                raise MatchmakingError(rnd.failure(rnd.gathering.min_size))
            group = await self._client.follow(rnd, leader, end)
            if group is not None:
                return group
            rnd.gathering.restart(self._loop.time())

    @staticmethod
    def _keep_company(rnd: Round) -> None:
        if rnd.company is not None:
            rnd.company.keep(rnd.outlook.company(rnd.view))

    async def _lead(self, rnd: Round, end: float, next_poll: float) -> None:
        """One step as the leader: confirm the missing, close, or wait for a change."""
        cfg, outlook, gathering = self.config, rnd.outlook, rnd.gathering
        now = self._loop.time()
        gathering.begin(now)
        gathering.capacity = outlook.capacity(
            rnd.view, gathering.members, cfg.target_group_size, gathering.min_size
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
                await self._prober.confirm(rnd, unasked, min(end, gathering.close_by(end)))
                return
        gathering.hold_until = self._hold_for_syncing(rnd, pending, now)
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
            self._server.close(rnd)
            return
        wake = min(decision.wake_at, next_poll, end)
        if alone_after is not None and gathering.size == 1 and not pending:
            give_up_at = gathering.started + alone_after  # (when it is due, if still alone)
            if give_up_at > now:
                wake = min(wake, give_up_at)
        rnd.changed.clear()
        try:
            async with asyncio.timeout_at(wake):
                await rnd.changed.wait()
        except TimeoutError:
            pass

    def _hold_for_syncing(self, rnd: Round, pending: list[PeerID], now: float) -> float | None:
        """Until when (loop time) the leader holds its group open for peers that
        declared they are loading the state: the newest one's start plus the grace."""
        syncing = [rnd.view[p] for p in pending if rnd.view[p].state is PeerState.SYNCING]
        if not syncing:
            return None
        began = max(d.expiration for d in syncing) - self.config.declaration_ttl
        return now + (began + self.config.resync_grace - time.time())


def crowd(view: Mapping[PeerID, Declaration], me: PeerID) -> int:
    """Peers taking part (looking, busy or syncing) in `view`, us included."""
    active = (PeerState.LOOKING, PeerState.BUSY, PeerState.SYNCING)
    return 1 + sum(1 for p, d in view.items() if p != me and d.state in active)
