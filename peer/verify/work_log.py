"""A peer's record of its own inner run, round by round: what it commits to, and
what it can reveal to an auditor afterwards.

A round's work starts from the global state of one version (the round's
number) with the inner optimizer's state as it is, and is hashed every `every`
inner steps (`checkpoints`, as `SegmentState.digest`). The states at those
steps are kept (on the CPU) for the last `keep_rounds` rounds, so a reveal
sends them without recomputation; past `retain_bytes`, only every other one
is kept and a reveal re-runs the missing steps from the one before (bit for
bit on the same machine: the digest is checked before anything is sent).

With a folder to spill to (`spill_dir`: the daemon's `<data dir>/work-log/`),
only the newest `memory_states` states stay in RAM, counting one being taken
(one more while a round's end is sealed: the commitment waits on the seal, so
it writes nothing); older ones are written
there (where the inner steps run, never on the event loop), read back and
checked against their committed digest when a reveal needs them, and deleted
when their round is let go. `retain_bytes` then bounds the folder: past it the
oldest rounds beyond `keep_rounds` go even inside `retain_s`.

`begin`, `after_step` and `seal` touch the model: they run where the inner
steps run (the trainer's worker thread), or while it is idle (`seal`, during
the round). Reveals read older rounds from another thread: `lock` guards the
rounds and their snapshot maps (a kept state itself never changes).

A round's work is kept at least `retain_s` after it ended (the window in which
auditors may ask for it), and the last `keep_rounds` rounds in any case.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shoal.transport.identity import PeerID
from shoal.verification.commitment import state_digest

from ..training.inner import InnerOptimizer
from .segments import SegmentState, capture, optimizer_hash, params_hash
from .spill import SpillDir, Spilled, load_kept

__all__ = ["RoundWork", "VerifiedWork", "WorkLog"]

log = logging.getLogger(__name__)

DEFAULT_RETAIN_BYTES = 1 << 30  # states kept in RAM, without a folder to spill to
DEFAULT_SPILL_BYTES = 8 << 30  # states kept (RAM and folder together), with one
DEFAULT_MEMORY_STATES = 2  # the newest states, kept in RAM when spilling
DEFAULT_RETAIN_S = 300.0

Kept = SegmentState | Spilled


def state_bytes(state: SegmentState) -> int:
    total = sum(p.numel() * 4 for p in state.params)
    for per_param in state.optimizer["optimizer"]["state"].values():
        total += sum(v.numel() * v.element_size() for v in per_param.values() if torch.is_tensor(v))
    return total


@dataclass
class RoundWork:
    """One round's inner run, as far as it went."""

    round: int  # the state version (commit count) the run started from
    first_step: int  # the trainer's step count at the start
    every: int
    start_params: bytes  # params_hash of the start: the global state
    start_optimizer: bytes  # optimizer_hash of the start
    steps: int = 0
    checkpoints: list[bytes] = field(default_factory=list)  # after every `every` steps
    snapshots: dict[int, Kept] = field(default_factory=dict)  # step -> state
    sealed: tuple[int, bytes, Kept] | None = None  # the end, when steps % every
    tokens_per_step: int = 0  # the most tokens one step trained on
    ended_at: float | None = None  # monotonic time the next round began
    resets: int = 0  # the strategy's `resets` when the run started (`VerifiedWork.resets_of`)

    def commit_checkpoints(self) -> tuple[bytes, ...]:
        """The checkpoints a commitment of this run carries (sealed first)."""
        if self.steps % self.every == 0:
            return tuple(self.checkpoints)
        if self.sealed is None or self.sealed[0] != self.steps:
            raise RuntimeError("seal the run before committing to it")
        return (*self.checkpoints, self.sealed[1])

    def kept_at(self, step: int) -> Kept | None:
        """The kept state after `step` steps, in RAM or on disk (None: re-run it)."""
        if self.sealed is not None and self.sealed[0] == step:
            return self.sealed[2]
        return self.snapshots.get(step)

    def kept_before(self, step: int) -> list[tuple[int, Kept]]:
        """The kept states at or before `step`, the latest first (the start is last)."""
        return [(s, self.snapshots[s]) for s in sorted(self.snapshots, reverse=True) if s <= step]

    def kept(self) -> list[tuple[int, Kept]]:
        """Every kept state of the run, by step."""
        out = sorted(self.snapshots.items())
        return out if self.sealed is None else [*out, (self.sealed[0], self.sealed[2])]

    def digest_at(self, step: int) -> bytes:
        """The committed hash of the state after `step` steps (0: the start)."""
        if step == 0:
            return state_digest(self.start_params, self.start_optimizer)
        if step % self.every == 0:
            return self.checkpoints[step // self.every - 1]
        assert self.sealed is not None and self.sealed[0] == step
        return self.sealed[1]


class WorkLog:
    """The rounds of work this peer did lately (the last `keep_rounds`)."""

    def __init__(
        self,
        every: int,
        *,
        keep_rounds: int = 2,
        retain_s: float = DEFAULT_RETAIN_S,
        retain_bytes: int | None = None,
        spill_dir: Path | None = None,
        memory_states: int = DEFAULT_MEMORY_STATES,
    ) -> None:
        if every < 1 or keep_rounds < 1 or memory_states < 0:
            raise ValueError("every and keep_rounds must be >= 1, memory_states >= 0")
        self.every = every
        self.keep_rounds = keep_rounds
        self.retain_s = retain_s
        self._disk = None if spill_dir is None else SpillDir(spill_dir)  # clears a past run's
        if retain_bytes is None:
            retain_bytes = DEFAULT_RETAIN_BYTES if self._disk is None else DEFAULT_SPILL_BYTES
        self.retain_bytes = retain_bytes
        self.memory_states = memory_states
        self.lock = threading.Lock()
        # By index and start (`start_params`): a peer that re-synced onto a lineage at a
        # lower commit count does an index's work again from another state, and each
        # round's referees must be answered from that round's work.
        self._rounds: OrderedDict[tuple[int, bytes], RoundWork] = OrderedDict()
        self.current: RoundWork | None = None
        self._state_bytes = 0

    def begin(
        self,
        round_index: int,
        first_step: int,
        model: torch.nn.Module,
        inner: InnerOptimizer,
        *,
        resets: int = 0,
    ) -> RoundWork:
        """A new round's work starts now, from the model's (global) parameters."""
        self._make_room()
        start = capture(model, inner)
        self._state_bytes = state_bytes(start)
        work = RoundWork(
            round_index,
            first_step,
            self.every,
            params_hash(start.params),
            optimizer_hash(start.optimizer),
            snapshots={0: start},
            resets=resets,
        )
        now = time.monotonic()
        with self.lock:
            if self.current is not None:
                self.current.ended_at = now
            gone = []
            # A re-run of a round from the same state (a reset mid-round) replaces it.
            replaced = self._rounds.pop(_key(work), None)
            if replaced is not None:
                gone.append(replaced)
            self._rounds[_key(work)] = work
            while len(self._rounds) > self.keep_rounds:
                oldest = next(iter(self._rounds.values()))
                if oldest.ended_at is not None and now - oldest.ended_at < self.retain_s:
                    break
                gone.append(self._rounds.popitem(last=False)[1])
            self.current = work
            dropped = [k for w in gone for _, k in w.kept()] + self._thin()
        self._spill(dropped)
        return work

    def after_step(self, model: torch.nn.Module, inner: InnerOptimizer, tokens: int) -> None:
        """One inner step of the current round was taken."""
        work = self.current
        if work is None:
            return
        work.steps += 1
        work.tokens_per_step = max(work.tokens_per_step, tokens)
        if work.steps % self.every:
            return
        self._make_room()
        state = capture(model, inner)
        work.checkpoints.append(state.digest())
        with self.lock:
            work.snapshots[work.steps] = state
            dropped = self._thin()
        self._spill(dropped)

    def seal(self, model: torch.nn.Module, inner: InnerOptimizer) -> RoundWork:
        """The current round's work, its end hashed (when not on a checkpoint)."""
        work = self.current
        if work is None:
            raise RuntimeError("no round's work has begun")
        if work.steps % self.every and (work.sealed is None or work.sealed[0] != work.steps):
            state = capture(model, inner)
            with self.lock:
                work.sealed = (work.steps, state.digest(), state)
            # Not spilled here: a seal runs while the round waits for the commitment;
            # the next `begin` writes what is past the budget, in the trainer's time.
        return work

    def get(self, round_index: int, start: bytes | None = None) -> RoundWork | None:
        """Our work of `round_index` from the parameters that hash to `start`; with no
        `start`, the last begun of that index."""
        with self.lock:
            if start is not None:
                return self._rounds.get((round_index, start))
            found = [w for (r, _), w in self._rounds.items() if r == round_index]
            return found[-1] if found else None

    def state_at(self, work: RoundWork, step: int) -> SegmentState | None:
        """Our kept state after `step` steps of `work` (blocking: it may read a file);
        None when not kept or its file no longer holds it (re-run it from an earlier one)."""
        with self.lock:
            kept = work.kept_at(step)
        return load_kept(kept, work.digest_at(step))

    def nearest_before(self, work: RoundWork, step: int) -> tuple[int, SegmentState]:
        """The last intact kept state at or before `step` (blocking); RuntimeError when
        none is left (not even the start): no reveal rather than a wrong one."""
        with self.lock:
            candidates = work.kept_before(step)
        for s, kept in candidates:
            state = load_kept(kept, work.digest_at(s))
            if state is not None:
                return s, state
        raise RuntimeError(f"round {work.round}: no intact state of ours at or before {step}")

    def start_params(self, round_index: int, start_hash: bytes) -> list[torch.Tensor]:
        """The parameters our work of `round_index` started from, which hash to
        `start_hash` (the round's global state; blocking); RuntimeError when gone."""
        work = self.get(round_index, start_hash)
        state = None
        if work is not None:
            state = self.state_at(work, 0)
        if state is None:
            raise RuntimeError(f"round {round_index}: our start state is gone")
        return state.params

    @property
    def spill_path(self) -> Path | None:
        """The folder states are spilled to (None: they all stay in RAM)."""
        return None if self._disk is None else self._disk.path

    def spilled_files(self) -> list[Path]:
        """The files of spilled states (none without a folder to spill to)."""
        return [] if self._disk is None else self._disk.files()

    def _thin(self) -> list[Kept]:
        """Keep at most `retain_bytes` of states over the kept rounds: drop every other
        intermediate one, oldest rounds first (every round's start stays); spilling,
        then the oldest rounds beyond `keep_rounds`. Locked; returns what was dropped."""
        dropped: list[Kept] = []

        def total() -> int:
            return sum(len(w.kept()) for w in self._rounds.values()) * self._state_bytes

        for w in list(self._rounds.values()):
            if total() <= self.retain_bytes:
                return dropped
            for s in sorted(w.snapshots)[1::2]:
                dropped.append(w.snapshots.pop(s))
        while self._disk is not None and total() > self.retain_bytes:
            if len(self._rounds) <= self.keep_rounds:
                break
            _, old = self._rounds.popitem(last=False)
            log.warning("work log over %d bytes: round %d let go before its audit window "
                        "ended", self.retain_bytes, old.round)  # fmt: skip
            dropped += [k for _, k in old.kept()]
        return dropped

    def _make_room(self) -> None:
        """Before a state is captured: write what would be past the newest
        `memory_states` with it, so that RAM never holds one more (a state is the
        model and its optimizer: 3 model sizes with Adam; with the seal's, a round's
        begin held 4 states for a moment). The same files as writing them after."""
        self._spill([], self.memory_states - 1)

    def _spill(self, dropped: list[Kept], in_ram_at_most: int | None = None) -> None:
        """Delete the files of `dropped` states, then write the states past the newest
        `memory_states` (or `in_ram_at_most`) in RAM to the folder (blocking: where
        the inner steps run)."""
        for kept in dropped:
            if isinstance(kept, Spilled):
                kept.remove()
        if self._disk is None:
            return
        keep = self.memory_states if in_ram_at_most is None else max(0, in_ram_at_most)
        with self.lock:
            in_ram = [(w, s, k) for w in self._rounds.values() for s, k in w.kept()
                      if isinstance(k, SegmentState)]  # fmt: skip
        for work, step, state in in_ram[: max(0, len(in_ram) - keep)]:
            spilled = self._disk.write(work.round, step, state)
            with self.lock:
                if not _replace(self._rounds.get(_key(work)), work, step, state, spilled):
                    spilled.remove()  # let go (or thinned) while it was written


def _key(work: RoundWork) -> tuple[int, bytes]:
    return work.round, work.start_params


def _replace(
    kept_round: RoundWork | None, work: RoundWork, step: int, state: SegmentState, by: Spilled
) -> bool:
    """Put `by` in the place of `state` in `work`, if `work` still holds it there."""
    if kept_round is not work:
        return False
    if work.snapshots.get(step) is state:
        work.snapshots[step] = by
        return True
    if work.sealed is not None and work.sealed[2] is state:
        work.sealed = (work.sealed[0], work.sealed[1], by)
        return True
    return False


@dataclass
class VerifiedWork:
    """What the trainer needs to train verifiably: its log, and where batches come from."""

    log: WorkLog
    experiment: str  # the experiment's namespace (what batches and commitments name)
    peer: PeerID
    shard: int  # the data shard the peer's batches come from
    round_of: Callable[[], int]  # the state version the strategy holds now
    # How often the strategy set the parameters back to the global state without a
    # commit (`OuterStrategy.resets`): a reset mid-round restarts the round's work.
    resets_of: Callable[[], int] = lambda: 0

    def current(self) -> RoundWork | None:
        """The work from the global state the strategy holds now; None when there is
        none yet (before the first round's work, or right after a commit or a re-sync,
        until the trainer begins the next: the log's last run started elsewhere)."""
        work = self.log.current
        if work is None or work.round != self.round_of() or work.resets != self.resets_of():
            return None
        return work
