"""An averager's step: its tries (a group, then its all-reduce), retried among the survivors.

`StepRunner` drives one `Averager.step`: each try forms a group (`matchmaking`) and runs
the all-reduce (`allreduce`); an aborted round is retried at once without the members it
named failed or found quiet, until a commit, the step's deadline or `max_retries`. What
matchmaking finds instead of a group ends the step: a re-sync when our state is behind,
a lone commit when nobody else averages a shared state, or no group at all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import torch

from shoal.dht.node import DHTError, DHTNode
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID

from .allreduce import AllReduceOutcome, AllReduceService
from .attestation import Attestor
from .averager_config import AveragerConfig
from .deadline import Deadline
from .deadlines import AveragerDeadlines
from .group import Group, Member
from .matchmaking import Matchmaker, MatchmakingError, NeedsResync, NobodyElse
from .moshpit import GRID_VERSION, MAX_MASS, Grid, next_slot
from .presence import Presence
from .reducer import NOTHING_TO_AVERAGE
from .state_sync import count_holders
from .step_result import AttemptLog, StepResult

log = logging.getLogger("shoal.averaging")

# How long the peers of a version no reachable peer would serve us are left out.
UNREACHABLE_VERSION_S = 30.0
# After a commit with others, peers still declaring the version we left are behind
# (they missed the round): never re-sync back to it for this long.
SUPERSEDED_VERSION_S = 60.0
# A read of the state holders (how large a Moshpit grid's swarm is) takes at most this.
HOLDERS_TIMEOUT = 2.0
# After an abort, a member blamed on one member's word is asked for this long (a ping).
BLAME_PING_TIMEOUT = 2.0


class StepOwner(Protocol):
    """What a step reads and calls of its averager (`Averager`)."""

    key: str
    tensors: list[torch.Tensor]
    config: AveragerConfig
    dht: DHTNode
    state_version: bytes
    work: int
    commits: int
    attestor: Attestor | None
    deadlines: AveragerDeadlines | None
    last_fingerprint: str | None
    presence: Presence

    @property
    def state_timeout(self) -> float: ...

    async def _commit(self, round_id: bytes, members: Sequence[PeerID]) -> None: ...

    def tensors_for(self, group: Group, weight: float) -> list[torch.Tensor]: ...

    async def load_state_from_peers(
        self,
        timeout: float = ...,
        *,
        deadline: Deadline | None = ...,
        version: bytes | None = ...,
        sources: Sequence[Member] = ...,
    ) -> bool: ...

    async def announce_presence(self, timeout: float = ...) -> bool: ...


class StepRunner:
    """Runs the steps of one averager (`owner`), and keeps the peers it shuns."""

    def __init__(self, owner: StepOwner, matchmaker: Matchmaker, service: AllReduceService) -> None:
        self._owner = owner
        self._matchmaker = matchmaker
        self._service = service
        self.shunned: dict[PeerID, float] = {}  # peer -> until (monotonic)
        self.log = AttemptLog()  # the current step's tries
        grid = owner.config.matchmaking.grid
        # Moshpit: our cell of the grid, where each step forms its groups.
        self.grid = None if grid is None else Grid(*grid, owner.dht.peer_id)
        self._looked = False  # (at the swarm's state holders, before our first step)
        self._last_slot: int | None = None  # (with a grid_period: our last round's slot)

    def shun(self, peer: PeerID, seconds: float) -> None:
        self.shunned[peer] = max(self.shunned.get(peer, 0.0), time.monotonic() + seconds)

    async def run(
        self, weight: float, timeout: float | None, alone: bool,
        quorum: Callable[[], int] | None = None,
    ) -> StepResult:  # fmt: skip
        """One step (see `Averager.step`), in our cell of the grid when there is one."""
        self._matchmaker.quorum = quorum
        try:
            return await self._run_in_cell(weight, timeout, alone)
        finally:
            self._matchmaker.quorum = None

    async def _run_in_cell(self, weight: float, timeout: float | None, alone: bool) -> StepResult:
        if self.grid is None:
            return await self._run(weight, timeout, alone)
        if not self._looked:
            self._looked = True
            began = time.monotonic()
            await self._join_crowded_grid()
            timeout = None if timeout is None else timeout - (time.monotonic() - began)
        await self._wait_for_slot()
        cell = self.grid.next_cell()
        self._matchmaker.enter_cell(cell)
        # On a grid a peer weighs its mass (`moshpit.Grid`), not its work.
        weight = self.grid.weight(weight)
        result = await self._run(weight, timeout, alone)
        left = None if timeout is None else timeout - result.seconds
        if cell is not None and _alone(result) and (left is None or left > 1.0):
            # Nobody else in our cell (a swarm smaller than the grid, or an empty cell
            # after churn): this round, with the peers of the whole key who are alone
            # in theirs too, rather than with nobody.
            self._matchmaker.enter_cell(cell := None)
            first, result = result, await self._run(weight, left, alone)
            attempts = first.attempt_log + result.attempt_log
            result = replace(result, seconds=first.seconds + result.seconds, attempt_log=attempts)
        if cell is None and not self.grid.in_cells:
            target = self._owner.config.matchmaking.target_group_size
            crowd = max(self._matchmaker.last_crowd, await self._holders() or 0)
            self.grid.note_whole_key(crowd, _alone(result), target)
        if result.committed and result.round_id is not None:
            self.grid.after_round(result.round_id, result.members, result.weights)
        else:
            # Alone in the cell, or behind its peers (they moved on after their commit):
            # try another one next time.
            self.grid.scatter()
        # Into the next cell now, not at the next step: what we declare until then
        # (busy, between rounds) tells the leaders there to wait for us.
        self._matchmaker.enter_cell(self.grid.next_cell())
        self._owner.presence.lapsed()
        return result

    async def _wait_for_slot(self) -> None:
        """With a `grid_period`: until our round's slot starts (not counted in the
        step's timeout, which bounds the round itself). A peer a little late (its
        clock, its call, a last round that ran long) still takes the slot that began,
        for as long as its cell's leaders wait for it (`_slot_lateness`), unless our
        last round took that slot (`next_slot`). The
        cell's key stays the same from slot to slot: a key per slot spared its leaders
        the last round's stale "busy" declarations, but each slot's new key took DHT
        lookups of its own (256 simulated peers: 728 DHT requests per peer per minute
        against 433, matchmaking 5.7 s against 6.2, agreement no sooner)."""
        mm = self._owner.config.matchmaking
        if mm.grid_period:
            now = time.time()
            slot = next_slot(mm.grid_period, now, self._slot_lateness(), self._last_slot)
            self._last_slot = self._matchmaker.slot = slot
            await asyncio.sleep(max(0.0, slot * mm.grid_period - now))

    def _slot_lateness(self) -> float:
        """How late into a slot we may still take it. A leader waits up to
        `matchmaking_time` for the peers it sees declared busy in its cell, and we are
        one of them when we declared there since we entered it (`refresh_presence`
        between rounds, as the strategies call it): half of that, so that our join
        reaches the leader before it closes. Undeclared, it waits for nobody beyond
        `min_matchmaking_time`: half of that. A peer that took the next slot instead
        kept its cell's leader waiting for it in vain and came to a cell whose peers
        had averaged already (CI, 12 peers in slots of 4 s: one came to its cell a slot
        after the other four and was alone there for its step's 30 s)."""
        mm = self._owner.config.matchmaking
        assert self.grid is not None
        in_cell = self._matchmaker.cell == self.grid.next_cell()
        declared = in_cell and self._owner.presence.standing()
        return (mm.matchmaking_time if declared else mm.min_matchmaking_time) / 2

    async def _join_crowded_grid(self) -> None:
        """Before our first step: a swarm whose state more than a group's worth of peers
        announced is on its cells already; we go straight to ours rather than declare
        under the whole key, where every peer's declaration would be read by every
        other (at 1,000 peers, 1,000 subkeys of one record per poll)."""
        assert self.grid is not None
        target = self._owner.config.matchmaking.target_group_size
        crowd = await self._holders()
        if crowd is None:
            # Nothing read in time, not even our own announcement: hundreds of peers
            # read it at once (a swarm that starts together), or the DHT is struggling.
            # The cells: a peer alone in its cell averages under the whole key anyway.
            self.grid.in_cells = True
        elif crowd > target:
            self.grid.note_whole_key(crowd, False, target)

    async def _holders(self) -> int | None:
        """Peers (us included) that announced a state of the key: how large the swarm
        is, where one round's view under the whole key can miss most of it (a group
        that formed fast saw only itself, and would never leave the key). A claim of
        each peer, bounded by the DHT's record; a liar can only send peers to their
        cells early, where a peer alone falls back to the whole key anyway."""
        # A partial read (None: unknown). When a swarm of hundreds starts at once,
        # every peer reads every peer's announcement at the same moment, each replica
        # sending hundreds of them to each reader over a home uplink: a read that had
        # to finish ended with nothing by the deadline, every peer counted 0 and
        # stayed under the whole key (sim: 128 peers on 2-20 Mbit/s uplinks).
        dht, key = self._owner.dht, self._owner.key
        try:
            async with asyncio.timeout(HOLDERS_TIMEOUT + 1.0):  # (a bound on the bound)
                return await count_holders(dht, key, within=HOLDERS_TIMEOUT)
        except (TimeoutError, DHTError, TransportError, OSError) as e:
            log.debug("%s: reading the state holders failed: %r", key, e)
            return None

    async def _run(self, weight: float, timeout: float | None, alone: bool) -> StepResult:
        owner = self._owner
        started = time.monotonic()
        stall = None
        if owner.deadlines is not None:
            adaptive = owner.deadlines.next_round()
            if timeout is not None:  # (its floor is 0: what the links add to ours)
                timeout += adaptive.round_timeout
        deadline = Deadline.after(timeout)
        await self._service.prepare(owner.config.codec)  # before a group would wait for it
        now = time.monotonic()
        self.shunned = {p: until for p, until in self.shunned.items() if until > now}
        exclude: set[PeerID] = set(self.shunned)
        reason = ""
        attempts = 0
        self.log.clear()
        while attempts <= owner.config.max_retries:
            attempts += 1
            looking, left_out = time.monotonic(), tuple(sorted(map(str, exclude)))
            try:
                group = await self._matchmaker.form_group(
                    state_version=owner.state_version if self.grid is None else GRID_VERSION,
                    exclude=exclude,
                    deadline=deadline,
                    work=owner.work,
                )
            except (MatchmakingError, TimeoutError) as e:  # (NeedsResync, NobodyElse too)
                joins = self._matchmaker.last_joins
                self.log.matched(looking, 0, _no_group_outcome(e), left_out, joins=joins)
                return await self._without_group(e, deadline, started, attempts, weight, alone)
            leader = group.extra.get("leader")
            self.log.matched(
                looking, group.size, "averaging", left_out,
                joins=self._matchmaker.last_joins, round_id=group.round_id.hex(),
                leader=leader.short() if isinstance(leader, PeerID) else "",
            )  # fmt: skip
            if owner.deadlines is not None:
                stall = owner.deadlines.stall_timeout(group.size)
            outcome = await self._average(group, weight, stall)
            if outcome.committed:
                return await self._committed(group, outcome, started, attempts)
            if outcome.in_doubt:
                return self._after_doubt(outcome, started, attempts)
            reason = outcome.reason
            self.log.aborted.append(group.round_id)
            if reason == NOTHING_TO_AVERAGE:
                # Everyone here just loaded the state (weight 0): a retry would group the
                # same peers again. Back to training; the next round carries our work.
                break
            # Not only the members blamed: one silent for a while at the abort (stopped,
            # or behind a loss spike) would likely make the retry wait out its stall too.
            # (`left_out` holds those, and the blame we judged: see `_judged`.)
            exclude.update(outcome.left_out)
            log.info(
                "%s: round aborted (%s, stall %.1fs); retrying without %d peers (%d quiet)",
                owner.key, reason, stall or self._service.config.stall_timeout, len(exclude),
                len(set(outcome.quiet) - set(outcome.failed)),
            )  # fmt: skip
            if deadline.expired():
                break
        return self.log.result(False, reason, started, attempts)

    async def _average(self, group: Group, weight: float, stall: float | None) -> AllReduceOutcome:
        owner = self._owner
        if self.grid is not None:  # (and our companions' shares, where they are gone)
            weight = self.grid.weight_among(group.peer_ids, weight)
        # (Its members' connections stay open till it ends: see `Host.protecting`.)
        with owner.dht.host.protecting(group.peer_ids):
            outcome = await self._service.run(
                group,
                owner.tensors_for(group, weight),
                weight,
                codec=owner.config.codec,
                attestor=owner.attestor,
                stall_timeout=stall,
                # On a grid a weight is a mass: more than `MAX_MASS` is a lie.
                max_weight=None if self.grid is None else MAX_MASS,
            )
            if not outcome.committed and outcome.contested:
                outcome = await self._judged(outcome)
        if owner.deadlines is not None:
            owner.deadlines.observe_round(
                owner.dht.host, group, outcome.bytes_received, outcome.busy_seconds
            )
        # form_group declared us busy; after an abort that declaration stays too.
        owner.presence.renewed()
        left_out = tuple(p.short() for p in outcome.left_out)
        self.log.ended("committed" if outcome.committed else outcome.reason, left_out)
        return outcome

    async def _judged(self, outcome: AllReduceOutcome) -> AllReduceOutcome:
        """The abort's contested blame settled by asking each member blamed on one
        member's word ourselves (`votes.Blame`): one that does not answer a ping is left
        out; one that answers is left out with its blamer (one of the two lied, or
        their link is broken). A liar's blame costs it its own place in our retry."""
        host = self._owner.dht.host

        async def answers(peer: PeerID) -> bool:
            try:
                await host.ping(peer, timeout=BLAME_PING_TIMEOUT)
            except (TransportError, OSError, TimeoutError):
                return False
            return True

        blamed = list(outcome.contested)
        alive = await asyncio.gather(*(answers(p) for p in blamed))
        left_out = set(outcome.left_out)
        answering = [p for p, up in zip(blamed, alive, strict=True) if up]
        left_out.update(blamed)
        for peer in answering:
            left_out.update(outcome.contested[peer])
        if answering:
            log.info(
                "%s: blamed members that answer us: %s; left out with their blamers",
                self._owner.key, ", ".join(p.short() for p in answering),
            )  # fmt: skip
        return replace(outcome, left_out=tuple(sorted(left_out, key=str)), contested={})

    async def _without_group(
        self,
        why: Exception,
        deadline: Deadline,
        started: float,
        attempts: int,
        weight: float,
        alone: bool,
    ) -> StepResult:
        """Matchmaking ended the try without a group (`why`): a re-sync, a lone commit
        or no group."""
        owner = self._owner
        if isinstance(why, NeedsResync):
            ok, reason = await self._resync(why, deadline)
            self.log.ended("re-synced" if ok else "re-sync failed")
            return self.log.result(False, reason, started, attempts, resynced=ok)
        owner.presence.lapsed()  # "looking" stays declared: redeclare soon
        if isinstance(why, NobodyElse) and owner.config.shared_state and weight > 0 and alone:
            return await self._commit_alone(started, attempts, weight)
        return self.log.result(False, f"no group: {why}", started, attempts)

    async def _committed(
        self, group: Group, outcome: AllReduceOutcome, started: float, attempts: int
    ) -> StepResult:
        owner = self._owner
        if group.size > 1 or owner.config.alone_supersedes:  # (a group of one is alone)
            self._matchmaker.supersede(owner.state_version, SUPERSEDED_VERSION_S)
        await owner._commit(group.round_id, group.peer_ids)
        if owner.attestor is not None:
            owner.attestor.on_commit(group, outcome.commitments)
        return StepResult(
            True,
            "",
            group.size,
            group.round_id,
            group.peer_ids,
            attempts,
            owner.last_fingerprint,
            False,
            time.monotonic() - started,
            outcome.bytes_sent,
            leader if isinstance(leader := group.extra.get("leader"), PeerID) else None,
            outcome.weights,
            tuple(self.log.aborted),
            attempt_log=tuple(self.log.attempts),
        )

    async def _resync(self, behind: NeedsResync, deadline: Deadline) -> tuple[bool, str]:
        """Our tensors are stale: they must not enter a round. Replace them with the
        swarm's state (the caller redoes its work on it); (done, why)."""
        owner = self._owner
        owner.presence.lapsed()  # "syncing" stays declared: redeclare soon
        log.info("%s: our state is behind the swarm (%s); re-syncing", owner.key, behind)
        # Within the step's deadline (a re-sync is part of the step), and at least a
        # second to try.
        budget = deadline.within(owner.state_timeout)
        if (budget.remaining() or 0.0) < 1.0:
            budget = Deadline.after(1.0)
        # The version matchmaking named, from the peers that just confirmed holding
        # it: "the newest state" in the DHT can be another one of the same step
        # (two groups committed it; the most announced may be our own).
        ok = await owner.load_state_from_peers(
            deadline=budget, version=behind.target, sources=behind.holders
        )
        if ok:
            return True, "re-synced with the swarm"
        # Its holders are out of our reach (behind NATs, restarting): re-syncing again
        # at once would fail again, every round. Go on with the peers we reach.
        self._matchmaker.set_aside_version(behind.target, UNREACHABLE_VERSION_S)
        log.info("%s: no reachable peer serves version %s: its peers are left out of our "
                 "rounds for %.0fs", owner.key, behind.target.hex()[-12:],
                 UNREACHABLE_VERSION_S)  # fmt: skip
        return False, f"needs re-sync, which failed: {behind}"

    def _after_doubt(self, outcome: AllReduceOutcome, started: float, attempts: int) -> StepResult:
        """The round ended with us in doubt (no member told us its decision, even when
        asked after we gave up): the others may have committed with our input, so a
        retry with it could count it twice. Give the input up (`discarded`): losing a
        step's work is the price of never counting it twice."""
        log.info("%s: %s; our input is dropped (it may be counted already)", self._owner.key,
                 outcome.reason)  # fmt: skip
        return replace(self.log.result(False, outcome.reason, started, attempts), discarded=True)

    async def _commit_alone(self, started: float, attempts: int, weight: float) -> StepResult:
        """Nobody else averages this shared state: the mean of our input alone is the
        input, so commit it as it is. A random round ID makes our version our own:
        should another peer have committed alone meanwhile, out of our sight, the two
        states carry different versions and never mix (one side re-syncs)."""
        owner = self._owner
        me = owner.dht.host.peer_id
        round_id = b"alone:" + os.urandom(16)
        if owner.config.alone_supersedes:
            self._matchmaker.supersede(owner.state_version, SUPERSEDED_VERSION_S)
        await owner._commit(round_id, (me,))
        log.info("%s: nobody else declared for it: committed alone (commit %d, version %s)",
                 owner.key, owner.commits, owner.state_version.hex()[-12:])  # fmt: skip
        # Our "looking" declaration names the version we just left: replace it.
        await owner.announce_presence()
        self.log.ended("alone")
        return StepResult(
            True,
            "alone",
            1,
            round_id,
            (me,),
            attempts,
            owner.last_fingerprint,
            False,
            time.monotonic() - started,
            0,
            me,
            {me: weight},
            attempt_log=tuple(self.log.attempts),
        )


def _alone(result: StepResult) -> bool:
    """Whether a step ended because nobody else was declared at all (`NobodyElse`)."""
    return (
        not result.committed
        and bool(result.attempt_log)
        and (result.attempt_log[-1].outcome == "alone")
    )


def _no_group_outcome(why: Exception) -> str:
    """What a try that formed no group led to, as its `Attempt` says it at first."""
    if isinstance(why, NeedsResync):
        return "re-sync"
    if isinstance(why, NobodyElse):
        return "alone"
    return "no group"
