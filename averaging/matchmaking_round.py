"""The matchmaker's settings (`MatchmakingConfig`), the state one
`Matchmaker.form_group` call shares between its loop, its join client and its
join server (`Round`), and the matchmaker's shutdown signal (`Closing`)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

from .group import Group
from .matchmaking_rules import (
    CALL_TICKET_BYTES,
    MAX_GROUP_SIZE,
    Declaration,
    Gathering,
    JoinReply,
    Outlook,
    PeerState,
)
from .moshpit import MAX_GRID_DIMS
from .step_result import JoinTry

if TYPE_CHECKING:
    from shoal.transport.host import Host

T = TypeVar("T")

# The joins a call keeps for its caller's log (`Round.joins`): the last ones.
MAX_JOINS_KEPT = 32


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
    # Moshpit averaging (`moshpit.Grid`): 0 for one key shared by all peers; else each
    # round groups only the peers of one cell of a grid of this many dimensions, of
    # `grid_side` cells each (0: an eighth of `target_group_size`: cells that hold
    # several times the side, so that each group sends members into every next cell;
    # `sim/moshpit_rules.py` measured it the most robust from 100 to 3,000 peers).
    # Peers start under the key itself and move to their cells once it is crowded
    # (`Grid.note_whole_key`). Not for a shared state.
    grid_dims: int = 0
    grid_side: int = 0
    # 0: a grid round starts when its step is called. A period in seconds: rounds
    # start together, at the multiples of it on the peers' clocks (`moshpit.next_slot`).
    # A cell's peers otherwise arrive as their last rounds end, over seconds, and its
    # leader closes with whoever is there: several smaller groups per cell, which
    # reach only some of the next cells (sim: 1,000 peers no nearer than 0.058 after 7
    # rounds). Longer than one round (`matchmaking_time` and the all-reduce).
    grid_period: float = 0.0

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
        if self.grid_dims and not 2 <= self.grid_dims <= MAX_GRID_DIMS:
            raise ValueError(f"grid_dims must be 0 (no grid) or 2 to {MAX_GRID_DIMS}")
        if self.grid_side and not 2 <= self.grid_side <= MAX_GROUP_SIZE:
            raise ValueError(f"grid_side must be 0 (target_group_size) or 2 to {MAX_GROUP_SIZE}")
        if self.grid_period and not self.matchmaking_time <= self.grid_period < float("inf"):
            raise ValueError("grid_period must be 0 (none) or at least matchmaking_time")

    @property
    def grid(self) -> tuple[int, int] | None:
        """(dimensions, side) of the Moshpit grid, or None without one."""
        if not self.grid_dims:
            return None
        return self.grid_dims, self.grid_side or max(2, self.target_group_size // 8)


class MatchmakingError(Exception):
    """No group formed in time (the message says why)."""


class Mode(enum.StrEnum):
    LEAD = "lead"  # taking joins (also before our first decision)
    FOLLOW = "follow"  # our join is pending at `Round.following`
    CLOSED = "closed"  # the group is settled (or the call ended)


class Round:
    """The state of one `form_group` call, shared by its loop and the join handler."""

    def __init__(self, outlook: Outlook, gathering: Gathering, declaration_ttl: float) -> None:
        self.outlook = outlook
        self.gathering = gathering
        self.declaration_ttl = declaration_ttl
        self.mode = Mode.LEAD
        self.following: tuple[PeerID, tuple[Multiaddr, ...]] | None = None
        # one pending join per member of the gathering, answered together
        self.waiters: dict[PeerID, asyncio.Future[dict[str, Any]]] = {}
        self.changed = asyncio.Event()
        self.group: Group | None = None
        self.view: dict[PeerID, Declaration] = {}
        self.failures: list[str] = []  # why joins failed, for the error message
        self.joins: list[JoinTry] = []  # every join sent and its answer (`joined`)
        self.probed: set[tuple[PeerID, float]] = set()  # declarations already confirmed
        self.poll_backoff = 0  # unchanged reads in a row: polls slow down
        self.ticket = os.urandom(CALL_TICKET_BYTES)  # this call, in our joins
        self.tickets: dict[PeerID, bytes] = {}  # the call of each joiner's pending join
        self.company: Company | None = None  # (set by the matchmaker while the call runs)

    def failed(self, why: str) -> None:
        self.failures = [*self.failures[-15:], why]

    def joined(self, leader: PeerID, answer: str, seconds: float) -> None:
        """A join sent to `leader` ended with `answer` after `seconds`."""
        kept = self.joins[-(MAX_JOINS_KEPT - 1) :]
        self.joins = [*kept, JoinTry(leader.short(), answer, round(seconds, 3))]

    def conclude(self, group: Group, leader: PeerID) -> None:
        group.extra["leader"] = leader
        self.group = group
        self.mode = Mode.CLOSED
        if self.company is not None:
            self.company.keep_members(group.peer_ids)
        self.changed.set()

    def answer(self, peer: PeerID, reply: JoinReply) -> None:
        """Answer one pending join (and take the joiner out of the gathering)."""
        fut = self.waiters.pop(peer, None)
        self.gathering.withdraw(peer)
        if fut is not None and not fut.done():
            fut.set_result(reply.to_wire())

    def answer_all(self, reply: JoinReply) -> list[PeerID]:
        """Answer every pending join with `reply`; the joiners answered."""
        wire = reply.to_wire()
        answered = []
        for peer, fut in self.waiters.items():
            if not fut.done():
                fut.set_result(wire)
                answered.append(peer)
        self.waiters.clear()
        self.gathering.clear()
        return answered

    # ------------------------------------------------------------------ set aside

    def suspect(self, peer: PeerID) -> None:
        """Set `peer` aside until it declares again."""
        decl = self.view.get(peer)
        seen = decl.expiration if decl is not None else time.time() + self.declaration_ttl
        self.outlook.suspicions.add(peer, seen)

    def may_join(self, peer: PeerID) -> bool:
        if peer in self.outlook.excluded:
            return False
        decl = self.view.get(peer)
        if decl is not None:
            return self.outlook.suspicions.allows(decl)
        return not self.outlook.suspicions.blocks(peer, time.time())

    def note_excluded(self) -> None:
        """The caller's exclusions stay set aside in later calls, until they declare again."""
        for p in self.outlook.excluded:
            decl = self.view.get(p)
            if decl is not None:
                self.outlook.suspicions.add(p, decl.expiration)

    def failure(self, min_group_size: int) -> str:
        """Why no group formed, for the error message."""
        seen = len(self.outlook.candidates(self.view))
        why = f"no group of {min_group_size} by the deadline"
        why += f" ({seen} other peers looking with our version, {self.gathering.size} gathered"
        others = [d for d in self.view.values() if d.peer_id != self.outlook.me]
        busy = sum(d.state is PeerState.BUSY for d in others)
        # Looking with our version, but suspected (a failed join, a busy leader's
        # member) or excluded: the usual reason peers that could group do not.
        aside = sum(
            d.state is PeerState.LOOKING
            and d.state_version == self.outlook.version
            and not self.outlook.usable(d)
            for d in others
        )
        why += f"; {len(others)} declared: {busy} busy, {aside} looking but set aside"
        if self.failures:
            why += "; failed: " + ", ".join(dict.fromkeys(self.failures[-5:]))
        return why + ")"


class Company(contextlib.AbstractContextManager["Company"]):
    """The peers a round may group with, kept connectable while it looks for its group
    (`Host.protecting`): at its connection limit a host refused to dial them, and
    let none of them in, until they were members of a round, so a follower at its
    limit could not reach its leader and a leader at its limit could not take its
    joiners; the cell split (1,000 simulated peers, each at 384 connections: an
    instant "DialError" in most of the failed joins). At most `limit` peers, the
    first offered first (`Outlook.company`: lowest rank first): a crowd of declared
    peers, real or made up, never lifts the limit by more."""

    def __init__(self, host: Host, limit: int) -> None:
        self._host = host
        self._limit = limit
        self._kept: set[PeerID] = set()
        self._stack = contextlib.ExitStack()

    def keep(self, peers: Iterable[PeerID]) -> None:
        room = self._limit - len(self._kept)
        new = [p for p in dict.fromkeys(peers) if p not in self._kept][: max(0, room)]
        if new:
            self._stack.enter_context(self._host.protecting(new))
            self._kept.update(new)

    def keep_members(self, peers: Iterable[PeerID]) -> None:
        """The settled group's members, past the limit of the company (a group is at
        most `MAX_GROUP_SIZE`, checked by `check_group`): until the round itself
        protects them, a member at its connection limit closed its idle connection
        to another to make room for a newcomer, and the round that opened a stream
        over it as the close went out aborted, leaving both out of its retry."""
        new = [p for p in dict.fromkeys(peers) if p not in self._kept]
        if new:
            self._stack.enter_context(self._host.protecting(new))
            self._kept.update(new)

    def __len__(self) -> int:
        return len(self._kept)

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


class Closing:
    """The matchmaker's shutdown: everything it awaits is abandoned when it closes."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def pause(self, seconds: float, end: float) -> None:
        """Sleep `seconds` (at most until `end`), or until the matchmaker closes."""
        until = min(end, self._loop.time() + seconds)
        try:
            async with asyncio.timeout_at(until):
                await self._event.wait()
        except TimeoutError:
            pass

    async def abortable(self, aw: Awaitable[T]) -> T:
        """Await `aw`, abandoning it (MatchmakingError) when the matchmaker closes."""
        task = asyncio.ensure_future(aw)
        closing = asyncio.ensure_future(self._event.wait())
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
