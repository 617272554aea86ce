"""Moshpit averaging's virtual grid: groups that mix a swarm larger than one group.

A swarm of more peers than `target_group_size` splits into several groups per round.
With one matchmaking key for all, which peers meet is left to chance, and a peer's
state drifts toward the average of whoever it met. Moshpit All-Reduce (Ryabinin et
al., 2021) puts the peers on a virtual grid of ``dims`` dimensions of ``side`` cells
each and, every round, groups the peers that share all coordinates but one: after
``dims`` rounds on a full grid (``side ** dims`` peers, every group complete), every
peer holds the exact average of all.

A peer starts under the averaged key itself, as without a grid: a swarm that fits
in one group (`target_group_size`) agrees there in one round, where cells would
only split it. Once a round there finds more peers declared than one group holds
(or a newcomer finds nobody there twice in a row: the swarm is in its cells), the
peer moves to the grid for good; a peer alone in its cell averages that round
under the whole key with the others alone in theirs.

Here a peer's place is the ``dims - 1`` coordinates that name its *cell*: the
matchmaking key of its next round (`Matchmaker.enter_cell`). After a round, every
member drops its oldest coordinate and appends a new one: its place in a
permutation of ``range(side)`` that the round ID seeds, so that the members of one
group take distinct coordinates and meet, next round, the members of other groups
(the rotating "group bits" of hivemind's implementation, as coordinates). A peer
starts at coordinates drawn from its peer ID; a peer whose round found no group
draws a fresh last coordinate, so that it does not wait alone in an empty cell.

Every peer on a grid declares one state version (`GRID_VERSION`): nobody is ever
"behind" another, so nobody re-syncs and throws its input away.

A swarm whose peers drew their cells from their IDs fills them unevenly, and a
plain mean then mixes unevenly: a next cell gets two members of one group and
none of another, and the grid needs several rounds more than `dims` to agree.
So each peer carries a *mass* (push-sum, Kempe et al., 2003): the share of the
swarm's inputs its vector stands for, 1 to start with. A round averages its
members' vectors weighted by their masses, and hands the group's whole mass on
in equal parts to the next cells its members move to, split evenly among the
members that move to the same one (`after_round`). The swarm's total mass, and
the mass-weighted sum of its vectors, never change, so every next cell that
receives a member of every group of the last round holds the exact mean of their
inputs, however uneven the groups were. Where cells hold between `side` and
`target_group_size` peers (`N / side ** (dims - 1)`), that makes every peer hold
the exact mean of all after `dims` rounds (`sim/moshpit_rules.py`).

The members that move to one next cell (a peer's *companions*) hold one vector and
equal shares of one part of the mass. A peer that crashes between two rounds would
take its share along, and its next cell would weigh its group's vector short: with
hourly sessions at 1,000 peers, about one cell in eight a round, enough to keep the
grid from agreeing in `dims` rounds. So the companions present in a group carry
the shares of those that are missing from it (`weight_among`).

That needs each cell to form one group, so its peers must look for each other at
the same time. A peer reaches its next cell when its own round ends, and its
cell's leader closes with whoever is there after `min_matchmaking_time`: several
groups per cell. With a `grid_period` every round starts in a slot, at a multiple
of the period on each peer's clock (`slot_wait`): the cell's peers arrive within
their clocks' skew, and a period longer than a round keeps them in step. A cell's
name comes back every slot, so each "looking" says its slot and the leaders of a
slot pass over those of earlier ones (`Outlook.from_an_earlier_slot`): a peer that
crashed after declaring is no leader in the next slot.

Nothing here is a claim of another peer: the round ID binds the members and the
leader's nonce (`make_round_id`), and a peer that lies about its cell only changes
which groups it is in, as a peer that declares under another key could today.

This is a sans-I/O piece; the step runner moves the matchmaker between cells.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Mapping, Sequence

from shoal.transport.identity import PeerID

__all__ = [
    "GRID_VERSION",
    "MAX_GRID_DIMS",
    "MAX_MASS",
    "Grid",
    "cell_key",
    "next_slot",
    "permutation",
    "slot_wait",
]

MAX_GRID_DIMS = 8
# Rounds in a row alone under the whole key before a peer looks in its cell instead.
ALONE_ROUNDS_TO_CELLS = 2
# What every peer on a grid declares as its state version. Grouping by commit count,
# as one key does, has a peer whose group committed later (or not at all) re-sync to
# a faster group's state when they meet, throwing its input away: on a grid every
# peer's state is a partial average and mixing any two is progress. A joiner loads
# the state before its first step (`Averager.load_state_from_peers`), as a DiLoCo
# peer does, rather than being told to by matchmaking.
GRID_VERSION = b"moshpit"
# The most mass a peer carries, and counts of another member. An honest peer's mass
# stays near 1 (a round hands each member about the group's mean mass); a member's
# weight is its own claim, and without this bound a liar's one inflated weight would
# live on in the masses of every peer downstream of its group.
MAX_MASS = 4.0
# What a peer whose last round failed weighs, as a fraction of its mass (None: its
# mass, as any peer). Such a peer holds a vector a round behind its cell's (what its
# last group averaged, or its own input), and weighing its whole mass it pulls its
# next group back by that lag over the group's size, from where the grid has to mix it
# out again. Weighing next to nothing, it takes its next group's mean instead: its mass,
# and its work since its last commit, are lost. Not 0: a group of such peers alone
# would have nothing to average. In the simulator (moshpit_256_slots_churn, seeds 1
# to 4, the same events in both arms) it left spreads after 6 rounds of 1.8e-5,
# 7.8e-4, 3.0e-5 and 8.2e-4, against 1.2e-4, 1.3e-3, 1.1e-4 and 8.2e-4 at full mass.
STALE_WEIGHT: float | None = 2.0**-20
# The least: a peer left with no mass (a group of members with nothing to add)
# would never weigh anything again.
MIN_MASS = 1.0 / 16
_DOMAIN = b"shoal/moshpit/1"


class Grid:
    """Our cell on a Moshpit grid of `dims` dimensions of `side` cells each."""

    def __init__(self, dims: int, side: int, peer_id: PeerID) -> None:
        if not 2 <= dims <= MAX_GRID_DIMS:
            raise ValueError(f"a grid has 2 to {MAX_GRID_DIMS} dimensions, not {dims}")
        if side < 2:
            raise ValueError(f"a grid's side is at least 2 cells, not {side}")
        self.dims = dims
        self.side = side
        self.peer_id = peer_id
        seed = hashlib.sha256(_DOMAIN + peer_id.to_bytes()).digest()
        self.coords: tuple[int, ...] = tuple(
            int.from_bytes(seed[4 * i : 4 * i + 4], "big") % side for i in range(dims - 1)
        )
        self.rounds = 0  # rounds that moved us (commits and scatters)
        self.mass = 1.0  # our share of the swarm's inputs (module docstring)
        # Under the whole key until it is crowded (`note_whole_key`): a swarm that fits
        # in one group agrees in one round there, and would only be split by cells.
        self.in_cells = False
        self._alone_in_key = 0
        self.commits = 0  # rounds committed on this grid
        self.stale = False  # our last round failed after we had committed one
        # The members of our last group that moved to our cell with us, us included
        # (`weight_among`): they hold our vector and share our group's part of the mass.
        self.companions: frozenset[PeerID] = frozenset()

    def next_cell(self) -> str | None:
        """Where our next round forms its group: our cell, or None for the whole key."""
        return self.cell() if self.in_cells else None

    def note_whole_key(self, crowd: int, alone: bool, target: int) -> None:
        """After a round under the whole key where `crowd` peers (us included) were
        declared: more than one group's worth (`target`) sends us to the cells for
        good; so does finding nobody there twice in a row (a newcomer to a swarm
        that is all in cells)."""
        self._alone_in_key = self._alone_in_key + 1 if alone else 0
        if crowd > target or self._alone_in_key >= ALONE_ROUNDS_TO_CELLS:
            self.in_cells = True

    def cell(self) -> str:
        """The name of our cell: the suffix of the matchmaking key of our next round."""
        return ".".join(map(str, self.coords))

    def weight(self, work: float) -> float:
        """What we weigh in our next round: our mass, or 0 with no work to add (a peer
        that has nothing new still takes the round's mean, and a share of its mass)."""
        if work <= 0:
            return 0.0
        if self.stale and STALE_WEIGHT is not None:
            return self.mass * STALE_WEIGHT
        return self.mass

    def weight_among(self, members: Iterable[PeerID], weight: float) -> float:
        """What we weigh in a round with `members`, given `weight` (what `weight`
        gave): our companions' shares too, for those of them not among the members.

        The companions left our last group for the same next cell, with the same
        vector and equal shares of the part of the group's mass that went there. One
        that crashed since took its share along, and our group's mean would weigh
        that group's vector at a fraction of its part: with a crash or so per cell
        and round, the grid's exactness after `dims` rounds was lost to it (a spread
        that fell ten-fold a round instead of to float noise). Carried by those of us
        who are here, the part arrives whole.

        A companion that is alive in another group of a split cell weighs its share
        there too: the mass grows by that share. Leaving out the companions seen
        looking in the cell for the same slot was tried against that, and measured
        worse: a peer that crashes after it declared (a fifth of the crashes, with
        5-s matchmaking in 30-s slots) was left out too, and 1,000 simulated peers
        agreed in 6 rounds instead of 4, with no cell split in either run. One that
        is late, or failed its last round, weighs next to nothing (stale).
        """
        if weight <= 0 or self.stale or len(self.companions) < 2:
            return weight
        here = len(self.companions & set(members)) or 1
        return min(MAX_MASS, weight * len(self.companions) / here)

    def after_round(
        self,
        round_id: bytes,
        members: Sequence[PeerID],
        weights: Mapping[PeerID, float] | None = None,
    ) -> None:
        """Move on after a round with `members` (in the group's order) committed, in
        which each member weighed `weights` (what `weight` gave). Without them (a
        member that owned no part of the round never saw the others' weights) our mass
        stays: the swarm's total then drifts by the difference, never by more."""
        if self.peer_id not in members:
            raise ValueError("we were not a member of that round")
        index = members.index(self.peer_id)
        if weights:
            self.mass = _mass_after(weights, members, self.side, index)
        mine, contributed = index % self.side, weights or {}
        self.companions = frozenset(
            peer for i, peer in enumerate(members) if i % self.side == mine and peer in contributed
        )
        order = permutation(round_id, self.side)
        self._shift(order[index % self.side])
        self.commits += 1
        self.stale = False

    def scatter(self) -> None:
        """Move on after a round that found no group: a random new coordinate."""
        self._shift(int.from_bytes(os.urandom(4), "big") % self.side)
        self.stale = self.commits > 0
        self.companions = frozenset()

    def _shift(self, coordinate: int) -> None:
        self.coords = (*self.coords[1:], coordinate)
        self.rounds += 1


def _mass_after(
    weights: Mapping[PeerID, float], members: Sequence[PeerID], side: int, index: int
) -> float:
    """The mass member `index` of `members` carries on: the group's mass (each
    contributor's weight, bounded) in equal parts to the next cells the members move to
    (member i moves with those whose ``i % side`` equals its own), each part split among
    the members moving there. Only the members that contributed (those in `weights`)
    move on: one dropped mid-round (it crashed, or stalled) takes no share, so the
    group's mass reaches its next cells whole and in equal parts, where counting the
    dropped one left its next cell a share short."""
    total = sum(min(max(w, 0.0), MAX_MASS) for w in weights.values() if math.isfinite(w))
    slots = [i % side for i, peer in enumerate(members) if peer in weights]
    mine = index % side
    cells, along = len(set(slots)), slots.count(mine)
    if along == 0:  # (we are not among the contributors: the group's mean mass)
        return min(MAX_MASS, max(MIN_MASS, total / max(1, len(slots))))
    return min(MAX_MASS, max(MIN_MASS, total / (cells * along)))


def permutation(round_id: bytes, side: int) -> list[int]:
    """``range(side)`` in an order every member of a round computes alike (hashes
    of the round ID, so not tied to one language's random generator)."""
    return sorted(
        range(side),
        key=lambda i: hashlib.sha256(_DOMAIN + round_id + i.to_bytes(4, "big")).digest(),
    )


def next_slot(period: float, now: float, late: float, after: int | None = None) -> int:
    """The index of the round slot we take part in (it starts at index x `period`,
    wall clock): the one that began at most `late` seconds before `now` (its groups
    are still gathering), else the next one; never one at or before `after`, the slot
    our last round took. Every peer computes the same slots from its own clock, so the
    peers of a cell look for each other at the same moment and form one group, where
    peers that arrive as their last rounds end form several. A round that ended
    early in its own slot must not take that slot again: its next cell's peers, in
    other groups of that slot, take the next one unless their rounds ended as early
    (cell-mates whose rounds ended 0.2 s and 0.3 s into a slot with a `late` of
    0.25 s would take two different slots, and neither would find a group)."""
    index = math.floor(now / period)
    slot = index if now - index * period <= late else index + 1
    return slot if after is None else max(slot, after + 1)


def slot_wait(period: float, now: float, late: float, after: int | None = None) -> float:
    """Seconds from `now` (wall clock) to the start of the slot we take part in
    (`next_slot`): 0 for one that began already."""
    return max(0.0, next_slot(period, now, late, after) * period - now)


def cell_key(key: str, cell: str) -> str:
    """The matchmaking key of `cell` of the grid of averaged key `key`."""
    return f"{key}/cell/{cell}"
