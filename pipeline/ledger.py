"""Which stage step includes each microbatch: a trainer's accounting, exactly once.

Sans-I/O. A backward answer says which peer applied it and the epoch (stage
version) whose step its gradients go into. The trainer keeps the backward's
inputs until it learns, from the step logs stage peers attach to their
answers, that the step from that epoch committed: with that peer among its
members the microbatch counted; without it (the peer died, stalled, or was
behind and dropped its gradients) the backward must be replayed on another
peer. A peer that stepped has given its gradients to the step, so its death
afterwards loses nothing. A peer's log of its own steps also lists which of
this trainer's backwards its gradients in each step held (their keys): from
that peer, the keys decide, not only its membership.

A backward whose answer was lost at a peer the trainer could not then ask
(`fencing`: no reply, or still computing) may have counted there, or not. It is
*in doubt* (`Doubt`): the trainer goes on with a dry backward elsewhere (input
gradient only, nothing counted), and the doubt is settled by the first of:

- the peer's own step log listing its key: counted;
- a fence that reaches the peer at last: applied (then an `Applied` entry at the
  epoch it names) or never to be (replayed);
- `DOUBT_STEPS` steps from the version it was sent at, all logged, none with
  the peer among its members: whatever it applied died with it or was dropped
  (replayed);
- the stage restored at `v` after every peer died: what the peer's part of each
  of its steps from the doubt's version to `v` held, by its own word before it
  died (`held`): the key in one, counted (the checkpoint holds that step); in
  none, whatever it applied was lost (replayed);
- `GIVE_UP_VERSIONS` versions on: counted if the peer was a member of a step
  since (assumed: the one case left open), replayed otherwise.

A death loses something only when every peer of the stage dies: the stage goes back to the newest
checkpoint a returning peer holds (`peer.pipelined.checkpoints`), and its steps
after that are gone with the microbatches they counted. So where the stage's
peers checkpoint, a counted entry is kept until a checkpoint of every such peer
holds its step (`release`); when a peer restores the stage at version `v`
(`lost`), the entries of steps from `v` on, counted or not, and the doubts sent
at `v` or later are replayed, and the dead peers' logs of those steps are
forgotten (the versions are taken again, by other members).
What is kept is bounded (KEEP_VERSIONS behind the stage, KEEP_BYTES in all):
beyond it the oldest entries are let go, as without checkpoints.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["DOUBT_STEPS", "GIVE_UP_VERSIONS", "Applied", "Doubt", "MicrobatchLedger"]

# How many versions past its epoch an entry waits for the step's log before it is
# assumed counted (stage peers keep the last 8 steps; memory must stay bounded).
GIVE_UP_VERSIONS = 8
KEEP_VERSIONS = 256  # counted entries kept at most this far behind the stage's version
KEEP_BYTES = 256 * 2**20  # and at most this much of their tensors, all stages together
# Logged steps without the peer, from the version a doubt was sent at, that settle it
# as not counted: the peer applies a backward at its version or the next (it refuses
# while behind the version the trainer sends), then that epoch's step goes without it.
DOUBT_STEPS = 3
KEPT_STEPS = 64  # the steps' members a ledger remembers per stage


@dataclass
class Applied:
    """A backward some peer applied, kept until its step is known."""

    stage: int
    key: str
    peer: Hashable
    epoch: int
    inputs: torch.Tensor
    grad_outputs: torch.Tensor
    samples: int
    # The incarnation of `peer` that applied it (its `since`, as its answer said; None:
    # not told). A restore loses only what earlier incarnations applied.
    since: float | None = None


@dataclass
class Doubt:
    """A backward `peer` may have applied (its answer lost, the peer not reachable to
    ask): the stage's version when it was sent, the attempt to fence, the tensors."""

    stage: int
    key: str
    peer: Hashable
    since: int
    attempt: bytes
    inputs: torch.Tensor
    grad_outputs: torch.Tensor
    samples: int

    def applied_at(self, epoch: int) -> Applied:
        return Applied(self.stage, self.key, self.peer, epoch, self.inputs,
                       self.grad_outputs, self.samples)  # fmt: skip


# A logged step: (version, members) or (version, members, keys of ours in the sender's
# gradients, None when not told).
Step = tuple[int, frozenset[Hashable]] | tuple[int, frozenset[Hashable], frozenset[str] | None]


class MicrobatchLedger:
    def __init__(self, stages: int) -> None:
        self._open: list[dict[str, Applied]] = [{} for _ in range(stages)]
        # Counted, in a step no checkpoint is known to hold yet (stages that checkpoint).
        self._kept: list[dict[str, Applied]] = [{} for _ in range(stages)]
        self._kept_bytes = 0
        self._doubts: list[dict[str, Doubt]] = [{} for _ in range(stages)]
        self._members: list[dict[int, frozenset[Hashable]]] = [{} for _ in range(stages)]
        # A member's own word on which of our keys its part of a step held (version ->
        # peer -> keys): what settles a doubt at a peer that can no longer be asked.
        self._held: list[dict[int, dict[Hashable, frozenset[str]]]] = [{} for _ in range(stages)]
        self.counted = [0] * stages  # samples known to be in a committed step, per stage
        self.replayed = [0] * stages  # samples sent again because their step went without them
        self.assumed = [0] * stages  # samples whose step was never seen (assumed counted)
        self.restored = [0] * stages  # samples replayed because their stage was restored

    def applied(self, entry: Applied) -> None:
        self._open[entry.stage][entry.key] = entry

    def doubted(self, doubt: Doubt) -> None:
        self._doubts[doubt.stage][doubt.key] = doubt

    def open(self, stage: int) -> list[Applied]:
        """Backwards of `stage` whose step is not known yet."""
        return list(self._open[stage].values())

    def doubts(self, stage: int) -> list[Doubt]:
        """Backwards of `stage` not known to have been applied, nor not to have been."""
        return list(self._doubts[stage].values())

    def in_doubt(self, doubt: Doubt) -> bool:
        return self._doubts[doubt.stage].get(doubt.key) is doubt

    def open_samples(self, stage: int) -> int:
        """Samples whose count is not known yet (open or in doubt)."""
        open_ = sum(e.samples for e in self._open[stage].values())
        return open_ + sum(d.samples for d in self._doubts[stage].values())

    def resolve(
        self,
        stage: int,
        steps: Iterable[Step],
        version: int,
        durable: int | None = None,
        source: Hashable | None = None,
    ) -> list[Applied]:
        """Given a stage peer's log of committed steps (version stepped from, members,
        and, when `source` sent it, the keys of ours its gradients held) and the
        stage's version: settle what they settle; the entries to replay.
        `durable`: the version every checkpointing peer of the stage has saved (None:
        they do not checkpoint): counted entries of later steps are kept."""
        log: dict[int, frozenset[Hashable]] = {}
        keys: dict[int, frozenset[str]] = {}
        for step in steps:
            log[step[0]] = step[1]
            if source is not None and len(step) > 2 and step[2] is not None:  # type: ignore[misc]
                keys[step[0]] = step[2]  # type: ignore[misc]
        self._remember(stage, log, keys, source)
        replay = []
        for key, entry in list(self._open[stage].items()):
            members = self._members[stage].get(entry.epoch)  # (this log's, or an earlier one)
            if members is not None:
                del self._open[stage][key]
                mine = keys.get(entry.epoch) if entry.peer == source else None
                if (key in mine) if mine is not None else (entry.peer in members):
                    self.counted[stage] += entry.samples
                    if durable is not None and entry.epoch >= durable:
                        self._keep(entry)
                else:
                    self.replayed[stage] += entry.samples
                    replay.append(entry)
            elif version - entry.epoch > GIVE_UP_VERSIONS:
                del self._open[stage][key]
                self.assumed[stage] += entry.samples
        for key, doubt in list(self._doubts[stage].items()):
            held_by = [v for v, listed in keys.items() if key in listed]
            if doubt.peer == source and held_by:
                del self._doubts[stage][key]
                self.counted[stage] += doubt.samples
                if durable is not None and held_by[0] >= durable:
                    self._keep(doubt.applied_at(held_by[0]))
        return replay + self.settle_doubts(stage, version)

    def settle_doubts(self, stage: int, version: int) -> list[Applied]:
        """Doubts the steps known settle without the peer's word; those to replay."""
        replay = []
        for key, doubt in list(self._doubts[stage].items()):
            with_peer = [v for v, m in self._members[stage].items()
                         if v >= doubt.since and doubt.peer in m]  # fmt: skip
            window = range(doubt.since, doubt.since + DOUBT_STEPS)
            without = not with_peer and all(v in self._members[stage] for v in window)
            if without or version - doubt.since > GIVE_UP_VERSIONS:
                del self._doubts[stage][key]
                if with_peer:
                    self.assumed[stage] += doubt.samples
                else:
                    self.replayed[stage] += doubt.samples
                    replay.append(doubt.applied_at(doubt.since))
        return replay

    def fenced(self, doubt: Doubt, epoch: int | None) -> Applied | None:
        """A fence reached the doubt's peer at last: it applied the backward at `epoch`
        (then it is open at that epoch), or never will (None: the entry to replay)."""
        if not self.in_doubt(doubt):
            return None
        del self._doubts[doubt.stage][doubt.key]
        entry = doubt.applied_at(doubt.since if epoch is None else epoch)
        if epoch is not None:
            self.applied(entry)
            return None
        self.replayed[doubt.stage] += doubt.samples
        return entry

    def held(self, stage: int, version: int, peer: Hashable, key: str) -> bool | None:
        """Whether `peer`'s part of `stage`'s step from `version` held `key`, as the
        peer's own log said (None: it did not say)."""
        keys = self._held[stage].get(version, {}).get(peer)
        return None if keys is None else key in keys

    def doubted_before(
        self, doubt: Doubt, restored: int, survivor: tuple[Hashable, float] | None
    ) -> Applied | None:
        """`doubted`, for a doubt whose version was read before its stage was restored
        at `restored` (by `survivor`): settled as `lost` settled the doubts it found;
        the entry to replay, if it is one."""
        self.doubted(doubt)
        entry = self._lost_doubt(doubt, restored, survivor)
        if entry is not None:
            self.restored[doubt.stage] += entry.samples
            self.replayed[doubt.stage] += entry.samples
        return entry

    def _lost_doubt(
        self, doubt: Doubt, restored: int, survivor: tuple[Hashable, float] | None
    ) -> Applied | None:
        """(`lost`.) A doubt sent at `restored` or later could only have been applied
        there, and is gone. One sent before is in a step the restore kept or not, as the
        peer's own word on its steps says (`_held_before`; not told: it waits, as open
        entries do, for the restored peer's log). Not one at the restoring peer: which
        incarnation it reached is not known, and the fence that asks the live one
        settles it (one it never saw: replayed). The entry to replay, if it is one."""
        at_survivor = survivor is not None and doubt.peer == survivor[0]
        before = self._held_before(doubt, restored) if doubt.since < restored else None
        if before is True:  # (in a step the checkpoint holds)
            del self._doubts[doubt.stage][doubt.key]
            self.counted[doubt.stage] += doubt.samples
            return None
        if before is False or (doubt.since >= restored and not at_survivor):
            del self._doubts[doubt.stage][doubt.key]
            return doubt.applied_at(doubt.since)
        return None

    def _held_before(self, doubt: Doubt, restored: int) -> bool | None:
        """Whether the doubt's peer put its key in one of the stage's steps from the
        doubt's version to `restored` (those a restore at `restored` keeps), by its
        own word; None: a step of that span not logged, or its part not told."""
        told, stage = True, doubt.stage
        for v in range(doubt.since, restored):
            members = self._members[stage].get(v)
            if members is None:
                return None
            if doubt.peer in members:
                held = self.held(stage, v, doubt.peer, doubt.key)
                if held:
                    return True
                told = told and held is not None
        return False if told else None

    def _remember(
        self,
        stage: int,
        log: dict[int, frozenset[Hashable]],
        keys: dict[int, frozenset[str]],
        source: Hashable | None,
    ) -> None:
        members, held = self._members[stage], self._held[stage]
        members.update(log)
        for v, listed in keys.items():
            held.setdefault(v, {})[source] = listed
        for v in sorted(members)[: max(0, len(members) - KEPT_STEPS)]:
            del members[v]
        for v in [v for v in held if v not in members]:
            del held[v]

    def _keep(self, entry: Applied) -> None:
        self._let_go(self._kept[entry.stage].get(entry.key, entry))  # (a replay's again)
        self._kept[entry.stage][entry.key] = entry
        self._kept_bytes += _nbytes(entry)
        while self._kept_bytes > KEEP_BYTES:  # the oldest go first
            oldest = min((e for kept in self._kept for e in kept.values()), key=lambda e: e.epoch)
            self._let_go(oldest)

    def _let_go(self, entry: Applied) -> None:
        kept = self._kept[entry.stage].pop(entry.key, None)
        if kept is not None:
            self._kept_bytes -= _nbytes(kept)

    def kept_samples(self, stage: int) -> int:
        return sum(e.samples for e in self._kept[stage].values())

    def release(self, stage: int, durable: int, version: int) -> None:
        """A checkpoint of every checkpointing peer of `stage` holds its steps before
        `durable`: what they counted is safe. (And the bound: KEEP_VERSIONS.)"""
        for entry in list(self._kept[stage].values()):
            if entry.epoch < durable or version - entry.epoch > KEEP_VERSIONS:
                self._let_go(entry)

    def lost(
        self, stage: int, restored: int, survivor: tuple[Hashable, float] | None = None
    ) -> list[Applied]:
        """Every peer of `stage` died and one restored it at version `restored`: what
        its steps from there on counted, and what the dead peers held for steps to
        come, is gone. The entries to replay (open ones of earlier epochs wait for
        the restored peer's step log, which its checkpoint kept). `survivor`: the
        restoring incarnation (peer, since). What it applied since it restored lives
        on with it (the trainer learns of a restore seconds after the peer serves
        again, and sends it backwards meanwhile): replayed too, they were counted
        twice, once in its step and once in the replays' (a CI run: 32 samples)."""
        replay = []

        def gone(entry: Applied) -> bool:
            alive = survivor is not None and (entry.peer, entry.since) == survivor
            return entry.epoch >= restored and not alive

        for entry in list(self._kept[stage].values()):
            if gone(entry):
                self._let_go(entry)
                self.counted[stage] -= entry.samples
                replay.append(entry)
        for key, entry in list(self._open[stage].items()):
            if gone(entry):
                del self._open[stage][key]
                replay.append(entry)
        for doubt in list(self._doubts[stage].values()):
            entry = self._lost_doubt(doubt, restored, survivor)
            replay += [entry] if entry is not None else []
        # The steps from `restored` on are taken again, by other members: the dead
        # peers' logs of those versions must settle nothing more (a doubt of a peer that
        # was a member there would be assumed counted).
        for v in [v for v in self._members[stage] if v >= restored]:
            del self._members[stage][v]
            self._held[stage].pop(v, None)
        self.restored[stage] += sum(e.samples for e in replay)
        self.replayed[stage] += sum(e.samples for e in replay)
        return replay


def _nbytes(entry: Applied) -> int:
    return entry.inputs.nbytes + entry.grad_outputs.nbytes
