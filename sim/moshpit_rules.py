"""The Moshpit grid's rules alone, at any scale: how many rounds until one state.

    python sim/moshpit_rules.py --peers 1000 --dims 3 --side 10 [--target 20] [--rounds 12]
        [--crash 0.0055]

No network and no averager: the real `moshpit.Grid` (where each peer is, where it
moves, what mass it carries) and the real `split_sizes` (how matchmaking splits a
crowded cell), with every round complete and every group's mean (weighted by the
members' masses) exact in float64. Peers start under the whole key and move to their
cells once it is crowded, and a peer alone in its cell averages under the whole key
with the others alone in theirs, as the step runner does; with `--crash`, that
fraction of the live peers crashes before each round, taking its mass. Beside it, in
the same run, the grid as it was before companions carried the shares of the crashed
(`moshpit_shares_lost`; see `Grid.weight_among`) and one key for all (groups of
`target`, members drawn at random each round). Prints one JSON object: per arm, the
spread after each round (largest difference of a peer's vector to the peers' mean,
over the inputs' largest magnitude), `rounds_to_agreement` (first round at most
1e-6, about 8 float32 epsilons) and `mean_error` (largest difference of a peer's
vector to the exact mean of all inputs, over the same scale). What the network adds
(late peers, partial groups, churn) is `sim/run.py` with a `moshpit` scenario; this
says what the rules themselves cost, from 100 to 10,000 peers in seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from collections.abc import Callable, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shoal.averaging.matchmaking_rules import split_sizes
from shoal.averaging.moshpit import Grid
from shoal.transport.identity import Identity, PeerID

AGREEMENT = 1e-6
Rounds = Callable[[np.ndarray, np.ndarray, random.Random], None]


def grid_round(
    grids: dict[PeerID, Grid], order: Sequence[PeerID], target: int, carry: bool = True
) -> Rounds:
    """One round on the grid: groups by cell, lone peers together under the key.
    `carry`: members weigh the shares of their companions missing from their group
    (`Grid.weight_among`), as the step runner has them do; without, as before."""

    def run(values: np.ndarray, alive: np.ndarray, rng: random.Random) -> None:
        index = {p: i for i, p in enumerate(order)}
        cells: dict[str | None, list[PeerID]] = {}
        for p in order:
            if alive[index[p]]:
                cells.setdefault(grids[p].next_cell(), []).append(p)
        whole = cells.pop(None, [])
        # A peer alone in its cell averages under the whole key this round.
        whole += [m[0] for m in cells.values() if len(m) == 1]
        for members in [m for m in cells.values() if len(m) > 1]:
            _average(members, values, index, rng)
        _average(whole, values, index, rng)
        for p in whole:
            grids[p].note_whole_key(len(whole), len(whole) == 1, target)

    def _average(
        members: list[PeerID], values: np.ndarray, index: dict[PeerID, int], rng: random.Random
    ) -> None:
        rng.shuffle(members)
        start = 0
        for size in split_sizes(len(members), target, 2):
            group = sorted(members[start : start + size])
            start += size
            rows = [index[p] for p in group]
            # Weighted by the members' masses, as the averagers of a grid weigh them.
            weights = {p: grids[p].weight(1.0) for p in group}
            if carry:
                weights = {p: grids[p].weight_among(group, w) for p, w in weights.items()}
            mass = np.array([weights[p] for p in group])
            values[rows] = (mass[:, None] * values[rows]).sum(axis=0) / mass.sum()
            round_id = hashlib.sha256(rng.randbytes(16)).digest()
            for p in group:
                grids[p].after_round(round_id, group, weights)
        for p in members[start:]:
            grids[p].scatter()

    return run


def one_key_round(target: int) -> Rounds:
    def run(values: np.ndarray, alive: np.ndarray, rng: random.Random) -> None:
        members = [int(i) for i in np.flatnonzero(alive)]
        rng.shuffle(members)
        start = 0
        for size in split_sizes(len(members), target, 2):
            rows = members[start : start + size]
            start += size
            values[rows] = values[rows].mean(axis=0)

    return run


def arm(peers: int, rounds: int, step: Rounds, seed: int, crash: float) -> dict[str, object]:
    """`crash`: the fraction of the live peers that crash before each round (drawn
    alike in every arm); the spread and error are over the live peers."""
    rng, crashes = random.Random(seed), np.random.default_rng(seed + 1)
    values = np.random.default_rng(seed).standard_normal((peers, 16))
    alive = np.ones(peers, dtype=bool)
    scale = float(np.abs(values).max())
    exact = values.mean(axis=0)
    spreads, errors = [], []
    for _ in range(rounds):
        alive &= crashes.random(peers) >= crash
        step(values, alive, rng)
        live = values[alive]
        spreads.append(float(np.abs(live - live.mean(axis=0)).max()) / scale)
        errors.append(float(np.abs(live - exact).max()) / scale)
    agreed = next((k + 1 for k, s in enumerate(spreads) if s <= AGREEMENT), None)
    return {
        "rounds_to_agreement": agreed,
        "state_spread": [float(f"{s:.3g}") for s in spreads],
        "mean_error": [float(f"{e:.3g}") for e in errors],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--dims", type=int, default=3)
    parser.add_argument("--side", type=int, default=10)
    parser.add_argument("--target", type=int, default=0, help="group size (0: twice the side)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--crash", type=float, default=0.0,
        help="fraction of the live peers that crash before each round (hourly sessions "
        "and 20-s rounds: 0.0055)",
    )  # fmt: skip
    parser.add_argument(
        "--in-cells", action="store_true",
        help="start in the cells, as peers that found the state announced do (sim/run.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    target = args.target or 2 * args.side
    order = [Identity.from_seed(random.Random(args.seed * 7919 + i).randbytes(32)).peer_id
             for i in range(args.peers)]  # fmt: skip

    def fresh_grids() -> dict[PeerID, Grid]:
        grids = {p: Grid(args.dims, args.side, p) for p in order}
        for grid in grids.values():
            grid.in_cells = args.in_cells
        return grids

    step = grid_round(fresh_grids(), order, target)
    step_lost = grid_round(fresh_grids(), order, target, carry=False)
    result = {
        "peers": args.peers,
        "grid_dims": args.dims,
        "grid_side": args.side,
        "target_group_size": target,
        "in_cells": args.in_cells,
        "crash": args.crash,
        "moshpit": arm(args.peers, args.rounds, step, args.seed, args.crash),
        "moshpit_shares_lost": arm(args.peers, args.rounds, step_lost, args.seed, args.crash),
        "one_key": arm(args.peers, args.rounds, one_key_round(target), args.seed, args.crash),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
