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

Nothing here is a claim of another peer: the round ID binds the members and the
leader's nonce (`make_round_id`), and a peer that lies about its cell only changes
which groups it is in, as a peer that declares under another key could today.

This is a sans-I/O piece; the step runner moves the matchmaker between cells.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from shoal.transport.identity import PeerID

__all__ = ["GRID_VERSION", "MAX_GRID_DIMS", "Grid", "cell_key", "permutation"]

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
        # Under the whole key until it is crowded (`note_whole_key`): a swarm that fits
        # in one group agrees in one round there, and would only be split by cells.
        self.in_cells = False
        self._alone_in_key = 0

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

    def after_round(self, round_id: bytes, members: Sequence[PeerID]) -> None:
        """Move on after a round with `members` (in the group's order) committed."""
        if self.peer_id not in members:
            raise ValueError("we were not a member of that round")
        order = permutation(round_id, self.side)
        self._shift(order[members.index(self.peer_id) % self.side])

    def scatter(self) -> None:
        """Move on after a round that found no group: a random new coordinate."""
        self._shift(int.from_bytes(os.urandom(4), "big") % self.side)

    def _shift(self, coordinate: int) -> None:
        self.coords = (*self.coords[1:], coordinate)
        self.rounds += 1


def permutation(round_id: bytes, side: int) -> list[int]:
    """``range(side)`` in an order every member of a round computes alike (hashes
    of the round ID, so not tied to one language's random generator)."""
    return sorted(
        range(side),
        key=lambda i: hashlib.sha256(_DOMAIN + round_id + i.to_bytes(4, "big")).digest(),
    )


def cell_key(key: str, cell: str) -> str:
    """The matchmaking key of `cell` of the grid of averaged key `key`."""
    return f"{key}/cell/{cell}"
