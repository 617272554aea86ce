"""A peer's record of its own inner run, round by round: what it commits to, and
what it can reveal to an auditor afterwards.

A round's work starts from the global state of one version (the round's
number) with the inner optimizer's state as it is, and is hashed every `every`
inner steps (`checkpoints`, as `SegmentState.digest`). The states at those
steps are kept (on the CPU) for the last `keep_rounds` rounds, so a reveal
sends them without recomputation; past `retain_bytes`, only every other one
is kept and a reveal re-runs the missing steps from the one before (bit for
bit on the same machine: the digest is checked before anything is sent).

`begin`, `after_step` and `seal` touch the model: they run where the inner
steps run (the trainer's worker thread), or while it is idle (`seal`, during
the round). Reveals read older rounds from another thread: `lock` guards the
rounds and their snapshot maps (a kept state itself never changes).

A round's work is kept at least `retain_s` after it ended (the window in which
auditors may ask for it), and the last `keep_rounds` rounds in any case.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.transport.identity import PeerID
from shoal.verification.commitment import state_digest

from ..training.inner import InnerOptimizer
from .segments import SegmentState, capture, optimizer_hash, params_hash

__all__ = ["RoundWork", "VerifiedWork", "WorkLog"]

DEFAULT_RETAIN_BYTES = 1 << 30
DEFAULT_RETAIN_S = 300.0


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
    snapshots: dict[int, SegmentState] = field(default_factory=dict)  # step -> state
    sealed: tuple[int, bytes, SegmentState] | None = None  # the end, when steps % every
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

    def state_at(self, step: int) -> SegmentState | None:
        """The kept state after `step` steps (None: re-run from an earlier one)."""
        if self.sealed is not None and self.sealed[0] == step:
            return self.sealed[2]
        return self.snapshots.get(step)

    def nearest_before(self, step: int) -> tuple[int, SegmentState]:
        """The last kept state at or before `step` (the start is always kept)."""
        best = max(s for s in list(self.snapshots) if s <= step)
        return best, self.snapshots[best]

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
        retain_bytes: int = DEFAULT_RETAIN_BYTES,
    ) -> None:
        if every < 1 or keep_rounds < 1:
            raise ValueError("every and keep_rounds must be >= 1")
        self.every = every
        self.keep_rounds = keep_rounds
        self.retain_s = retain_s
        self.retain_bytes = retain_bytes
        self.lock = threading.Lock()
        self._rounds: OrderedDict[int, RoundWork] = OrderedDict()
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
            self._rounds.pop(round_index, None)  # a re-run of a round replaces it
            self._rounds[round_index] = work
            while len(self._rounds) > self.keep_rounds:
                oldest = next(iter(self._rounds.values()))
                if oldest.ended_at is not None and now - oldest.ended_at < self.retain_s:
                    break
                self._rounds.popitem(last=False)
            self.current = work
            self._thin()
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
        state = capture(model, inner)
        work.checkpoints.append(state.digest())
        with self.lock:
            work.snapshots[work.steps] = state
            self._thin()

    def seal(self, model: torch.nn.Module, inner: InnerOptimizer) -> RoundWork:
        """The current round's work, its end hashed (when not on a checkpoint)."""
        work = self.current
        if work is None:
            raise RuntimeError("no round's work has begun")
        if work.steps % self.every and (work.sealed is None or work.sealed[0] != work.steps):
            state = capture(model, inner)
            work.sealed = (work.steps, state.digest(), state)
        return work

    def get(self, round_index: int) -> RoundWork | None:
        with self.lock:
            return self._rounds.get(round_index)

    def _thin(self) -> None:
        """Keep at most `retain_bytes` of states over the kept rounds: drop every other
        intermediate one, oldest rounds first (every round's start stays). Locked."""

        def total() -> int:
            return sum(len(w.snapshots) for w in self._rounds.values()) * self._state_bytes

        for w in list(self._rounds.values()):
            if total() <= self.retain_bytes:
                return
            for s in sorted(w.snapshots)[1::2]:
                del w.snapshots[s]


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
