"""Matchmaking rules without I/O: what peers declare, who leads, who is still
coming, how a crowd splits into groups, whose state is stale, and the leader's
side of assembling one group.

`matchmaking.Matchmaker` feeds these with what it reads from the DHT and
receives over RPC, passing the time in; nothing here sleeps, dials or reads a
clock, so every rule is tested without a network.

Vocabulary:

- A *declaration* is what a peer publishes under ``<key>/matchmaking`` in an
  owner-signed subkey: its state (looking / busy / syncing / left), its state
  version, addresses and bandwidth. The record's expiration orders them.
- The *rank* of a peer is ``sha256(key, version, peer ID)``. Among the peers
  looking with the same version, the lowest rank leads. The rank changes with
  every committed round (the version is a hash chain), so leadership rotates
  and no one can grind a peer ID that always leads.
- A *suspicion* sets a peer aside until it declares again (a later
  expiration): a dead peer never does, a live one does at its next round.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shoal.dht.records import RecordError, owner_marker, owner_of
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

from .group import ROUND_ID_BYTES, Group, Member, make_round_id
from .lineage import MAX_WORK
from .provenance import UNVERIFIED as UNVERIFIED_ORDER

MAX_VERSION_BYTES = 64
MAX_ADDRS = 16
MAX_ADDR_CHARS = 1024
MAX_BANDWIDTH = 1e15
MAX_GROUP_SIZE = 1024  # Group.from_wire's default bound
# A joiner's `bringing`: the joiners it redirected to its leader (at most a group).
MAX_BRINGING = 64
# How much longer than its window a leader waits for joiners another joiner said it
# redirected to it (`JoinRequest.bringing`): a redirect's answer, a dial and a join
# (1,000 simulated peers on home links: they came 0.6 s after their redirect).
BROUGHT_HOLD_S = 1.5
NONCE_BYTES = 16
# A grid slot's index (`moshpit.next_slot`: UNIX time over the period). Bounded so
# that a declaration cannot carry an integer of any size; 2**48 one-second slots
# is nine million years.
MAX_SLOT = 2**48
CALL_TICKET_BYTES = 16  # a joiner's call (see JoinRequest.call)


# A commit count (8 bytes) then a hash chain of round IDs (8 bytes): the versions
# of a state shared by the whole swarm (`AveragerConfig.shared_state`).
CHAINED_VERSION_BYTES = 16


class PeerState(enum.StrEnum):
    LOOKING = "looking"  # wants a group now
    BUSY = "busy"  # in a group (averaging); back soon, perhaps with a new version
    SYNCING = "syncing"  # told to re-sync: loading state, back soon
    LEFT = "left"  # closed its matchmaker


# ---------------------------------------------------------------------- wire helpers


def _version(obj: object, what: str) -> bytes:
    if not isinstance(obj, bytes) or len(obj) > MAX_VERSION_BYTES:
        raise ValueError(f"{what} must be at most {MAX_VERSION_BYTES} bytes")
    return obj


def _bandwidth(obj: object) -> float:
    if isinstance(obj, bool) or not isinstance(obj, int | float):
        raise ValueError("bandwidth must be a number")
    value = float(obj)
    if not 0 <= value < MAX_BANDWIDTH:  # also rejects NaN
        raise ValueError("bandwidth must be finite and >= 0")
    return value


def _addrs(obj: object) -> tuple[Multiaddr, ...]:
    """Addresses from untrusted input: a bounded list; unparsable entries are dropped."""
    if not isinstance(obj, list) or len(obj) > MAX_ADDRS:
        raise ValueError(f"addrs must be a list of at most {MAX_ADDRS}")
    out = []
    for item in obj:
        if isinstance(item, str) and len(item) <= MAX_ADDR_CHARS:
            try:
                out.append(Multiaddr(item))
            except ValueError:
                continue
    return tuple(dict.fromkeys(out))


def _work(obj: object) -> int | None:
    if obj is None:
        return None
    if isinstance(obj, bool) or not isinstance(obj, int) or not 0 <= obj <= MAX_WORK:
        raise ValueError(f"work must be an int in [0, {MAX_WORK}]")
    return obj


def _slot(obj: object) -> int | None:
    if obj is None:
        return None
    if isinstance(obj, bool) or not isinstance(obj, int) or not 0 <= obj < MAX_SLOT:
        raise ValueError("slot must be an integer in [0, 2**48)")
    return obj


def _peer(obj: object) -> PeerID:
    if not isinstance(obj, bytes):
        raise ValueError("peer ID must be bytes")
    return PeerID(obj)  # ValueError when malformed


# ---------------------------------------------------------------------- declarations


@dataclass(frozen=True, slots=True)
class Declaration:
    """One peer's matchmaking record, as read from the DHT."""

    peer_id: PeerID
    state: PeerState
    state_version: bytes
    addrs: tuple[Multiaddr, ...] = ()
    bandwidth: float = 1.0
    expiration: float = 0.0  # the record's (UNIX time); later means newer
    # The work of the lineage that made `state_version` (see `Outlook.lineage`);
    # None from a peer that does not say (older releases).
    work: int | None = None
    # The grid slot a "looking" declaration is for (`MatchmakingConfig.grid_period`);
    # None without slots, or from an older release.
    slot: int | None = None

    def to_value(self) -> dict[str, Any]:
        """The DHT value (the peer is the subkey's owner, the expiration the record's)."""
        value: dict[str, Any] = {
            "state": str(self.state),
            "version": self.state_version,
            "addrs": [str(a) for a in self.addrs[:MAX_ADDRS]],
            "bandwidth": float(self.bandwidth),
        }
        if self.work is not None:
            value["work"] = self.work
        if self.slot is not None:
            value["slot"] = self.slot
        return value

    @classmethod
    def from_record(cls, subkey: object, value: object, expiration: object) -> Declaration:
        """Parse a DHT subkey record; raises ValueError. The DHT has checked the
        signature of an owned subkey; only a subkey that is exactly an owner
        marker is a declaration (anybody can write unowned subkeys)."""
        if not isinstance(subkey, str):
            raise ValueError("subkey must be a string")
        try:
            owner = owner_of(subkey)
        except RecordError as e:
            raise ValueError(str(e)) from None
        if owner is None or subkey != owner_marker(owner):
            raise ValueError("not an owner-signed declaration")
        return cls._parse(owner, value, expiration)

    @classmethod
    def from_hello(cls, peer: PeerID, raw: object) -> Declaration:
        """A declaration its owner `peer` (the authenticated caller) sent us directly,
        in answer to ``hello`` (see `Declarer.hello`); raises ValueError. Its
        expiration is the owner's, as in the DHT: the two compare."""
        if not isinstance(raw, dict):
            raise ValueError("hello answer must be a map")
        return cls._parse(peer, raw, raw.get("expiration"))

    @classmethod
    def _parse(cls, owner: PeerID, value: object, expiration: object) -> Declaration:
        if not isinstance(value, dict):
            raise ValueError("declaration must be a map")
        try:
            state = PeerState(str(value.get("state")))
        except ValueError:
            raise ValueError("unknown declaration state") from None
        if isinstance(expiration, bool) or not isinstance(expiration, int | float):
            raise ValueError("expiration must be a number")
        if not math.isfinite(expiration):
            raise ValueError("expiration must be finite")
        return cls(
            owner,
            state,
            _version(value.get("version"), "version"),
            _addrs(value.get("addrs", [])),
            _bandwidth(value.get("bandwidth", 1.0)),
            float(expiration),
            _work(value.get("work")),
            _slot(value.get("slot")),
        )


View = Mapping[PeerID, Declaration]


def parse_view(
    subkeys: Mapping[str, tuple[Any, float]] | None, now: float
) -> dict[PeerID, Declaration]:
    """The live declarations among a DHT dictionary's subkeys; anything else is ignored."""
    view: dict[PeerID, Declaration] = {}
    for subkey, item in (subkeys or {}).items():
        try:
            value, expiration = item
            decl = Declaration.from_record(subkey, value, expiration)
        except (ValueError, TypeError):
            continue
        if decl.expiration > now:
            view[decl.peer_id] = decl
    return view


def merge_views(
    previous: Mapping[PeerID, Declaration], fresh: Mapping[PeerID, Declaration], now: float
) -> dict[PeerID, Declaration]:
    """What a new read adds to the view: per peer, the declaration that expires
    last (owners only move it forward, so it is the newest; on a tie, the read).
    A read that reached few of the replicas (a loaded machine's timeouts, a
    partition) then never takes back what an earlier one saw, and a peer whose
    reads keep missing its neighbours does not come to see nobody at all; what
    has expired drops out as it would from the DHT, whether it was read before or
    just now (a neighbour's answer to ``hello`` is its last declaration, however
    old: a "busy" expired since would hold a lone peer waiting for nobody)."""
    view = {p: d for p, d in previous.items() if d.expiration > now}
    for peer, decl in fresh.items():
        if decl.expiration <= now:
            continue
        known = view.get(peer)
        if known is None or decl.expiration >= known.expiration:
            view[peer] = decl
    return view


def rank(key: str, version: bytes, peer: PeerID) -> bytes:
    """The order in which peers of one version are asked to lead (lowest first)."""
    body = msgpack.packb([key, version, peer.to_bytes()], use_bin_type=True)
    return hashlib.sha256(b"shoal-matchmaking-rank:" + body).digest()


# ---------------------------------------------------------------------- suspicions


class Suspicions:
    """Peers set aside until they declare again.

    A peer is suspected at the expiration of the declaration we last saw from
    it; any declaration expiring later is newer (owners only ever move their
    expiration forward), so the peer is back as soon as it re-declares.
    """

    def __init__(self) -> None:
        self._until: dict[PeerID, float] = {}

    def add(self, peer: PeerID, seen_expiration: float) -> None:
        self._until[peer] = max(self._until.get(peer, -math.inf), seen_expiration)

    def allows(self, decl: Declaration) -> bool:
        return decl.expiration > self._until.get(decl.peer_id, -math.inf)

    def blocks(self, peer: PeerID, now: float) -> bool:
        """For a peer whose declaration we have not seen: suspected and not yet expired."""
        return self._until.get(peer, -math.inf) > now

    def prune(self, now: float) -> None:
        """Forget suspicions whose declarations have expired anyway (bounded memory)."""
        self._until = {p: t for p, t in self._until.items() if t > now}

    def __contains__(self, peer: object) -> bool:
        return peer in self._until

    def __len__(self) -> int:
        return len(self._until)


# ---------------------------------------------------------------------- group sizes


def split_sizes(n: int, target: int, minimum: int) -> list[int]:
    """Sizes of the groups `n` peers split into: balanced, each <= target and >= minimum.

    20 peers, target 8 -> [7, 7, 6] (not 8, 8, 4: a group that barely reaches
    the minimum, or misses it, is the first to fail). When no split keeps every
    group at the minimum, groups of `target` form and the rest waits.
    """
    if n < max(1, minimum):
        return []
    groups = math.ceil(n / target)  # the fewest groups that keep each <= target
    if n // groups >= minimum:
        base, extra = divmod(n, groups)
        return [base + 1] * extra + [base] * (groups - extra)
    # No balanced split keeps every group at the minimum: full groups, and the
    # rest forms one only if it is big enough.
    full, rest = divmod(n, target)
    return [target] * full + ([rest] if rest >= minimum else [])


# ---------------------------------------------------------------------- one peer's outlook


@dataclass(frozen=True, slots=True)
class Outlook:
    """The rules as seen by one peer in one matchmaking call.

    `excluded`: the caller's hard exclusions (peers it just saw fail).
    `suspicions`: soft exclusions shared across calls (see `Suspicions`).
    `set_aside`: versions whose peers are left out for now (a re-sync to one
    found no reachable peer serving it: we go on with the peers we reach).
    `superseded`: versions we left by committing a round with others; their
    holders missed that round and are behind us, however many: we never re-sync
    back to one (that would throw the round away, and its members would pull us
    forward again a moment later).
    """

    key: str
    me: PeerID
    version: bytes
    excluded: frozenset[PeerID] = frozenset()
    suspicions: Suspicions = field(default_factory=Suspicions)
    set_aside: frozenset[bytes] = frozenset()
    superseded: frozenset[bytes] = frozenset()
    work: int | None = None  # our lineage's, as we declare it (a hint: see `lineage`)
    # The certified order of a version's lineage (`provenance.Provenance.order`): what
    # decides between versions that went their own ways. None: nothing is certified,
    # every version is unverified alike.
    orders: Callable[[bytes], tuple[int, int]] | None = None
    # The grid slot of our round (`MatchmakingConfig.grid_period`), None without slots.
    slot: int | None = None
    # Ranks computed so far: a pure function of (key, version, peer), asked for every
    # candidate each time a leader wakes (each join), a hash and an encoding apiece.
    _ranks: dict[PeerID, bytes] = field(default_factory=dict, init=False, compare=False, repr=False)

    def usable(self, decl: Declaration) -> bool:
        return (
            decl.peer_id != self.me
            and decl.peer_id not in self.excluded
            and self.suspicions.allows(decl)
            and (decl.state_version not in self.set_aside or decl.state_version == self.version)
            and not self.from_an_earlier_slot(decl)
        )

    def from_an_earlier_slot(self, decl: Declaration) -> bool:
        """A "looking" declared for a slot before ours: its owner would have declared
        again for this one had it come (a round's first move is to declare), so it
        crashed, or is still in a round of that slot, or moved on to another cell.
        A grid cell's name comes back every round, and a declaration outlives a
        period (`declaration_ttl` is 30 s, as long as the usual period): a crashed
        peer of the last slot would otherwise still lead those who come early in
        this one, and each of them would wait `join_timeout` on its silence, holding
        the peers that joined it (1,000 simulated peers: most of the cells that
        formed two groups in one slot)."""
        return (
            self.slot is not None
            and decl.slot is not None
            and decl.state is PeerState.LOOKING
            and decl.slot < self.slot
        )

    def candidates(self, view: View) -> list[Declaration]:
        """Other peers we may group with now: looking, same version, not set aside."""
        return [
            d
            for d in view.values()
            if d.state is PeerState.LOOKING and d.state_version == self.version and self.usable(d)
        ]

    def rank(self, peer: PeerID) -> bytes:
        known = self._ranks.get(peer)
        if known is None:
            known = self._ranks[peer] = rank(self.key, self.version, peer)
        return known

    def leader(self, view: View) -> PeerID:
        """Who we should join (or `me`: lead)."""
        best = self.me
        best_rank = self.rank(self.me)
        for d in self.candidates(view):
            r = self.rank(d.peer_id)
            if r < best_rank:
                best, best_rank = d.peer_id, r
        return best

    def company(self, view: View) -> list[PeerID]:
        """The peers this round may group with (declared looking, busy or syncing, and
        usable), lowest rank first: the likeliest leaders, then their followers."""
        active = (PeerState.LOOKING, PeerState.BUSY, PeerState.SYNCING)
        peers = [d.peer_id for d in view.values() if d.state in active and self.usable(d)]
        return sorted(peers, key=self.rank)

    def version_counts(self, view: View) -> Counter[bytes]:
        """Versions of the peers looking now (us included). Busy peers are left
        out: they declared the version they are averaging *from*, which is
        stale the moment their round commits."""
        counts: Counter[bytes] = Counter({self.version: 1})
        for d in view.values():
            if d.state is PeerState.LOOKING and self.usable(d):
                counts[d.state_version] += 1
        return counts

    def resync_target(self, view: View) -> bytes | None:
        """The version we must load before grouping, None when ours is fine.

        Ours is behind when another version, not one we superseded, is held by
        strictly more looking peers (a tie splits nobody's work: each side keeps
        its own groups). A shared state (chained versions) must be one, and its
        versions order by their certified lineage first (`lineage`), by looking
        holders only among equals: counts are what peers declare, certificates are
        what rounds signed. The empty version means "no committed state yet": it
        never wins against a real one, and it loses to any.
        """
        counts = self.version_counts(view)
        mine = counts[self.version]
        left = {self.version, b"", *self.superseded}
        others = [(c, v) for v, c in counts.items() if v not in left]
        if not others:
            return None
        if len(self.version) == CHAINED_VERSION_BYTES:
            count, best = max(others, key=lambda cv: (self.lineage(cv[1]), cv[0]))
            return best if self.outvoted(count, best, mine) else None
        # most peers first; among equals the smallest version, so every peer picks the same
        count, best = min(others, key=lambda cv: (-cv[0], cv[1]))
        if self.version == b"" or count > mine:
            return best
        return None

    def outvoted(self, count: int, version: bytes, mine: int) -> bool:
        """Whether `version`, held by `count` looking peers, wins over ours, held by
        `mine` (us included). A shared state (chained versions) goes to the lineage
        of more certified work (`lineage`), then to the more held, then to the larger
        version, so that two states that went their own ways (a partition, a peer
        cut off that trained alone) merge again, and no declaration moves anyone
        onto a lineage nobody certified. Other states: the more held wins."""
        if self.version == b"":
            return True
        if len(self.version) != CHAINED_VERSION_BYTES:
            return count > mine
        return (self.lineage(version), count, version) > (self.lineage(self.version), mine,
                                                          self.version)  # fmt: skip

    def lineage(self, version: bytes) -> tuple[int, int]:
        """How versions of a shared state order (the larger wins): by the work of the
        lineage that made them, as their certificates show it
        (`provenance.Rank.order`: the signers summed over rounds of several, then
        fewer commits alone), never as anyone declares it. A version whose chain
        we have not checked ranks below every certified one."""
        if self.orders is None:
            return UNVERIFIED_ORDER
        return self.orders(version)

    def alone(self, view: View) -> bool:
        """No other usable peer declared looking, busy or syncing: nobody is coming."""
        return not any(
            d.state in (PeerState.LOOKING, PeerState.BUSY, PeerState.SYNCING) and self.usable(d)
            for d in view.values()
        )

    def holders(self, view: View, version: bytes) -> list[Declaration]:
        return [
            d
            for d in view.values()
            if d.state is PeerState.LOOKING and d.state_version == version and self.usable(d)
        ]

    def pending(self, view: View, members: Collection[PeerID]) -> set[PeerID]:
        """Peers a leader should still wait for (up to its matchmaking time).

        Looking with our version and not yet joined; busy (most likely members
        of the previous round finishing their all-reduce, back in a moment);
        syncing (loading the state to come back); looking with a version that
        is about to be told to re-sync toward ours.
        """
        counts = self.version_counts(view)
        mine = counts[self.version]
        out = set()
        for d in view.values():
            if d.peer_id in members or not self.usable(d):
                continue
            coming_back = d.state in (PeerState.BUSY, PeerState.SYNCING)
            ours_soon = d.state is PeerState.LOOKING and (
                d.state_version == self.version
                or (d.state_version == b"" and self.version != b"")
                or (  # our (shared, chained) version wins: see resync_target
                    not self.outvoted(counts[d.state_version], d.state_version, mine)
                    if len(self.version) == CHAINED_VERSION_BYTES
                    else counts[d.state_version] < mine
                )
            )
            if coming_back or ours_soon:
                out.add(d.peer_id)
        return out

    def capacity(self, view: View, members: Collection[PeerID], target: int, minimum: int) -> int:
        """How many members (us included) to close at: our share of a balanced
        split when the crowd is larger than `target`, else `target` (a crowd
        that fits is closed by `pending` and the time windows instead: peers
        that are busy or syncing are not in it yet)."""
        crowd = {self.me, *members} | {d.peer_id for d in self.candidates(view)}
        if len(crowd) <= target:
            return target
        sizes = split_sizes(len(crowd), target, minimum)
        return sizes[0] if sizes else target


# ---------------------------------------------------------------------- the leader's side


@dataclass(frozen=True, slots=True)
class Decision:
    close: bool
    wake_at: float  # when to look again at the latest (loop time)
    release: tuple[PeerID, ...] = ()  # joiners to answer "retry" now (their deadline is near)


@dataclass(slots=True)
class _Applicant:
    member: Member
    answer_by: float


class Gathering:
    """A leader assembling one group: who joined (in order), and when to close.

    It closes when it reaches its capacity; or, with at least `min_size`
    members, once nobody else is expected and `min_time` has passed since it
    began to lead; or at the latest `max_time` after that, or `margin` before
    the earliest deadline of a joiner (joiners must have their answer before
    they give up) or of the call. Times are the driver's monotonic clock.
    """

    def __init__(
        self,
        me: Member,
        *,
        min_size: int,
        target: int,
        min_time: float,
        max_time: float,
        margin: float,
    ) -> None:
        self.me = me
        self.min_size = min_size
        self.capacity = target
        self.min_time = min_time
        self.max_time = max_time
        self.margin = margin
        self.started: float | None = None
        # Set by the driver while a peer that is loading the state (syncing) may
        # still come: the window stays open until then (joiners' deadlines permitting).
        self.hold_until: float | None = None
        self._joined: dict[PeerID, _Applicant] = {}
        self._brought: dict[PeerID, float] = {}  # peer -> until when we wait for it

    @property
    def size(self) -> int:
        return len(self._joined) + 1

    @property
    def members(self) -> list[PeerID]:
        return list(self._joined)

    @property
    def full(self) -> bool:
        return self.size >= max(self.capacity, self.min_size)

    def begin(self, now: float) -> None:
        """We lead from now on (the windows count from the first time)."""
        if self.started is None:
            self.started = now

    def restart(self, now: float) -> None:
        """We lead again after following a leader that gave us no group (it died, did
        not answer in time, or refused us): the windows count from now. The peers that
        followed it with us come back about now too; with the window of our first
        lead long past, we closed with the first of them to reach us and the cell
        split (256 simulated peers: a leader that crashed after its round aborted held
        17 survivors 7 s, then groups of 4 and 13 formed)."""
        self.started = now

    def expect(self, peers: Iterable[PeerID], now: float) -> None:
        """Joiners another joiner led and redirected to us (`JoinRequest.bringing`):
        waited for as pending ones, and past the window, for `BROUGHT_HOLD_S` from
        now, never more than that past it. A leader that closed at its window as
        the follower that had led them joined it left them out, and they formed a
        second group in the cell (1,000 simulated peers: 3 of a cell of 14, held
        2.5 s by a higher rank before their redirect). The claim costs a liar's
        leader at most `BROUGHT_HOLD_S` once, and `MAX_BRINGING` entries."""
        until = now + BROUGHT_HOLD_S
        for peer in peers:
            if peer == self.me.peer_id or peer in self._joined:
                continue
            if peer in self._brought or len(self._brought) < MAX_BRINGING:
                self._brought[peer] = until

    def brought(self, now: float) -> list[PeerID]:
        """The joiners announced (`expect`) still on their way."""
        return [p for p, until in self._brought.items() if until > now and p not in self._joined]

    def admit(self, member: Member, answer_by: float) -> None:
        self._joined.pop(member.peer_id, None)  # a second request replaces the first
        self._joined[member.peer_id] = _Applicant(member, answer_by)

    def withdraw(self, peer: PeerID) -> bool:
        return self._joined.pop(peer, None) is not None

    def clear(self) -> list[PeerID]:
        peers = list(self._joined)
        self._joined.clear()
        self._brought.clear()  # (they follow whom we follow now)
        return peers

    def _window_end(self) -> float | None:
        if self.started is None:
            return None
        end = self.started + self.max_time
        if self._brought:
            awaited = [u for p, u in self._brought.items() if p not in self._joined]
            if awaited:
                end = max(end, min(max(awaited), end + BROUGHT_HOLD_S))
        return end if self.hold_until is None else max(end, self.hold_until)

    def close_by(self, deadline: float) -> float:
        """The latest moment to close (when the group is big enough)."""
        limit = deadline - self.margin
        window = self._window_end()
        if window is not None:
            limit = min(limit, window)
        for a in self._joined.values():
            limit = min(limit, a.answer_by - self.margin)
        return limit

    def decide(self, now: float, *, pending: int, deadline: float) -> Decision:
        size = self.size
        pending += len(self.brought(now))
        if size >= self.min_size:
            if size >= self.capacity:
                return Decision(True, now)
            if self.started is not None:
                if now >= self.close_by(deadline):
                    return Decision(True, now)
                if pending == 0 and now >= self.started + self.min_time:
                    return Decision(True, now)
        release = tuple(
            p for p, a in self._joined.items() if a.answer_by - self.margin <= now
        ) if size < self.min_size else ()  # fmt: skip
        wake = deadline
        for a in self._joined.values():
            if a.member.peer_id not in release:
                wake = min(wake, a.answer_by - self.margin)
        for until in self._brought.values():
            if until > now:  # (pending changes then: the early close may be due)
                wake = min(wake, until)
        window = self._window_end()
        if self.started is not None and window is not None:
            # A window that has passed with the group too small wakes nobody: waking
            # at once, every turn of the loop, till the deadline, was a busy wait
            # (a lone leader burnt a core for the whole of its deadline).
            if window > now:
                wake = min(wake, window)
            if now < self.started + self.min_time:
                wake = min(wake, self.started + self.min_time)
        for p in release:
            del self._joined[p]
        return Decision(False, max(wake, now), release)

    def finalize(self, key: str, version: bytes, nonce: bytes) -> Group:
        """The group: members ordered by peer ID, the round ID bound to them and the nonce.
        Round-tripped through the wire form, so the leader holds exactly what
        every member parses."""
        members = sorted(
            [self.me, *(a.member for a in self._joined.values())],
            key=lambda m: m.peer_id.to_bytes(),
        )
        round_id = make_round_id(key, [m.peer_id for m in members], nonce)
        group = Group(key, round_id, tuple(members), version)
        return Group.from_wire(group.to_wire(), max_members=MAX_GROUP_SIZE)


# ---------------------------------------------------------------------- join messages


@dataclass(frozen=True, slots=True)
class JoinRequest:
    key: str
    state_version: bytes
    addrs: tuple[Multiaddr, ...]
    bandwidth: float
    # Random per form_group call of the joiner: a leader that put this call's join
    # in its group hands the group back when the same call asks again.
    call: bytes = b""
    # The joiners we led and just redirected to this leader: on their way (see
    # `Gathering.expect`). A claim: it holds the leader at most `BROUGHT_HOLD_S`.
    bringing: tuple[PeerID, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key,
            "version": self.state_version,
            "addrs": [str(a) for a in self.addrs[:MAX_ADDRS]],
            "bandwidth": float(self.bandwidth),
        }
        if self.call:
            out["call"] = self.call
        if self.bringing:
            out["bringing"] = [p.to_bytes() for p in self.bringing[:MAX_BRINGING]]
        return out

    @classmethod
    def from_wire(cls, obj: object) -> JoinRequest:
        """Parse an untrusted join request; raises ValueError."""
        if not isinstance(obj, dict):
            raise ValueError("join request must be a map")
        key = obj.get("key")
        if not isinstance(key, str) or len(key) > 1024:
            raise ValueError("join request key must be a string")
        return cls(
            key,
            _version(obj.get("version"), "version"),
            _addrs(obj.get("addrs", [])),
            _bandwidth(obj.get("bandwidth", 1.0)),
            _call_ticket(obj.get("call", b"")),
            _bringing(obj.get("bringing", [])),
        )


class ReplyKind(enum.StrEnum):
    ACCEPTED = "accepted"  # here is the group
    REDIRECT = "redirect"  # I follow someone else: join them
    BUSY = "busy"  # I am in a group (these are its members)
    VERSION = "version"  # my state version differs from yours
    RETRY = "retry"  # not enough members before your deadline: ask again
    DISBANDED = "disbanded"  # I stopped leading (re-sync, deadline, shutdown)
    EXCLUDED = "excluded"  # my caller excluded you from this round


@dataclass(frozen=True, slots=True)
class JoinReply:
    kind: ReplyKind
    group: Group | None = None
    nonce: bytes = b""
    peer: PeerID | None = None  # REDIRECT
    addrs: tuple[Multiaddr, ...] = ()  # REDIRECT
    members: tuple[PeerID, ...] = ()  # BUSY: the members of its group
    age: float = 0.0  # BUSY: seconds since that group formed
    # BUSY (with `nonce`): the group the peer led, to a member that asks again in
    # the call whose join it put in that group (its join gave up before the
    # answer arrived); the member takes it as if ACCEPTED.
    version: bytes = b""  # VERSION

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": str(self.kind)}
        if self.kind is ReplyKind.ACCEPTED:
            assert self.group is not None
            out["group"] = self.group.to_wire()
            out["nonce"] = self.nonce
        elif self.kind is ReplyKind.REDIRECT:
            assert self.peer is not None
            out["peer"] = self.peer.to_bytes()
            out["addrs"] = [str(a) for a in self.addrs[:MAX_ADDRS]]
        elif self.kind is ReplyKind.BUSY:
            out["members"] = [p.to_bytes() for p in self.members[:MAX_GROUP_SIZE]]
            out["age"] = float(self.age)
            if self.group is not None:
                out["group"] = self.group.to_wire()
                out["nonce"] = self.nonce
        elif self.kind is ReplyKind.VERSION:
            out["version"] = self.version
        return out

    @classmethod
    def from_wire(cls, obj: object) -> JoinReply:
        """Parse an untrusted reply; raises ValueError."""
        if not isinstance(obj, dict):
            raise ValueError("join reply must be a map")
        try:
            kind = ReplyKind(str(obj.get("kind")))
        except ValueError:
            raise ValueError("unknown join reply kind") from None
        if kind is ReplyKind.ACCEPTED:
            return cls(kind, **_group_and_nonce(obj))
        if kind is ReplyKind.REDIRECT:
            return cls(kind, peer=_peer(obj.get("peer")), addrs=_addrs(obj.get("addrs", [])))
        if kind is ReplyKind.BUSY:
            raw = obj.get("members", [])
            if not isinstance(raw, list) or len(raw) > MAX_GROUP_SIZE:
                raise ValueError("busy members must be a list")
            age = obj.get("age", 0.0)
            if isinstance(age, bool) or not isinstance(age, int | float) or not 0 <= age < 1e9:
                raise ValueError("busy age must be a number of seconds")
            led = _group_and_nonce(obj) if "group" in obj else {}
            return cls(kind, members=tuple(_peer(p) for p in raw), age=float(age), **led)
        if kind is ReplyKind.VERSION:
            return cls(kind, version=_version(obj.get("version"), "version"))
        return cls(kind)


def _bringing(raw: object) -> tuple[PeerID, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_BRINGING:
        raise ValueError(f"bringing must be a list of at most {MAX_BRINGING} peer IDs")
    return tuple(_peer(p) for p in raw)


def _call_ticket(raw: object) -> bytes:
    if not isinstance(raw, bytes) or len(raw) > CALL_TICKET_BYTES:
        raise ValueError(f"call ticket must be at most {CALL_TICKET_BYTES} bytes")
    return raw


def _group_and_nonce(obj: dict[Any, Any]) -> dict[str, Any]:
    nonce = obj.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
    return {"group": Group.from_wire(obj.get("group"), max_members=MAX_GROUP_SIZE), "nonce": nonce}


def check_group(
    reply: JoinReply,
    *,
    key: str,
    version: bytes,
    me: PeerID,
    leader: PeerID,
    bandwidth: float | None = None,
) -> Group:
    """The group of an ACCEPTED reply (or a BUSY one handing our group back) if it
    is one we can be a member of; raises ValueError. With our `bandwidth` (as we
    declared it): a group that states another one for us is refused too, since
    the parts follow the bandwidths (a leader that gave the others 0 would own
    every part it did not give its accomplices)."""
    group = reply.group
    if reply.kind not in (ReplyKind.ACCEPTED, ReplyKind.BUSY) or group is None:
        raise ValueError("not an accepted reply")
    if group.key != key:
        raise ValueError(f"group is for key {group.key[:64]!r}, not ours")
    if group.state_version != version:
        raise ValueError("group state version differs from ours")
    ids = group.peer_ids
    if me not in ids or leader not in ids:
        raise ValueError("group leaves out us or its leader")
    if len(group.round_id) != ROUND_ID_BYTES or group.round_id != make_round_id(
        key, ids, reply.nonce
    ):
        raise ValueError("round ID does not bind the members and the nonce")
    if bandwidth is not None and group.members[group.index(me)].bandwidth != bandwidth:
        raise ValueError("group states another bandwidth for us than we declared")
    return group
