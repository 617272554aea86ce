"""Verified sparse rounds: what a member commits to of its error feedback, keeps to
reveal, and what an audit checks of the message it sent.

A sparse message is `encode(residual + delta)` (`averaging.error_feedback`), the
residual what earlier rounds did not send. The commitment's root is over the
member's slot (its signed message: `averaging.attestation` binds it to what
everyone received), and the commitment also carries the residual's hashes at the
round's start and after a commit (`Commitment.residual`), its `previous` the
commitment whose commit left that residual (`ErrorFeedback.chain`). So:

- every audit checks the chain: the starting residual is what the previous round
  left, or zero (a join, a re-sync): `residual_chains`. The previous commitment
  comes with the reveal and must hash to `previous`;
- the audit of the last segment, whose end is the run's end, also gets the
  starting residual and the slot, and re-derives exactly (encoding is a pure
  function) the message the run gives and the residual it leaves: both must be
  the committed ones.

A prover that picks its residual or sends another message than its run gives is
caught when its last segment is drawn, as one that sends another dense
pseudo-gradient is; the robust reduction bounds what it sends meanwhile.

What a prover keeps per round (`SparseProver`): the starting residual (a model
size, while its round may be audited), the previous commitment and its slot. The
newest round's residual stays in RAM; with a folder (the work log's), older ones
are written there and read back, checked against the committed hash, when a
reveal needs them, and at most `retain_bytes` of residuals are kept in all (the
oldest rounds beyond the last `keep` go first, as the work log's states do).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from shoal.averaging.attestation import chunk_leaves
from shoal.averaging.compression import CodecError, get_codec
from shoal.averaging.error_feedback import ErrorFeedback, residual_digest
from shoal.averaging.group import Group
from shoal.averaging.partition import Plan
from shoal.averaging.sparse_codec import SparseCodec
from shoal.averaging.sparse_gather import SparseGather
from shoal.transport.identity import PeerID
from shoal.verification.commitment import (
    Commitment,
    CommitmentError,
    MerkleTree,
    residual_chains,
)

from .recent import RecentRounds
from .segments import flat_difference
from .spill import SpillDir, load_tensor

__all__ = [
    "SparseProver",
    "SparseSource",
    "SparseWork",
    "check_chain",
    "check_message",
    "previous_round",
]


class SparseSource(Protocol):
    """What a sparse strategy offers its verifier (`averaging.sparse_round.SparseContribution`)."""

    feedback: ErrorFeedback
    gather: SparseGather

    def own_slot(self, round_id: bytes, me: PeerID) -> tuple[int, int, bytes] | None: ...


@dataclass
class SparseWork:
    """What a prover reveals of a sparse round beyond its inner run."""

    chain: bytes  # the previous commitment, encoded (b"": none)
    slot: tuple[int, int, bytes]  # (our index, the round's members, our slot's bytes)
    residual: torch.Tensor  # the residual the round started from


class _KeptWork:
    """A round's `SparseWork` as kept: its residual in RAM, or in a file once a newer
    round's took its place (`digest`: the committed hash it must still have)."""

    __slots__ = ("chain", "digest", "path", "residual", "slot")

    def __init__(self, work: SparseWork, digest: bytes) -> None:
        self.chain, self.slot, self.digest = work.chain, work.slot, digest
        self.residual: torch.Tensor | None = work.residual
        self.path: Path | None = None

    def spill(self, disk: SpillDir, name: str) -> None:
        if self.residual is not None:
            self.path = disk.write_tensor(name, self.residual)
            self.residual = None

    def work(self) -> SparseWork | None:
        residual = self.residual
        if residual is None and self.path is not None:
            residual = load_tensor(self.path)
            if residual is not None and residual_digest(residual) != self.digest:
                residual = None  # altered on disk: no reveal rather than a wrong one
        return None if residual is None else SparseWork(self.chain, self.slot, residual)

    def remove(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class SparseProver:
    """A verified member's error feedback in its commitments, and what it keeps."""

    def __init__(
        self,
        source: SparseSource,
        keep: int,
        retain_s: float,
        *,
        spill_dir: Path | None = None,
        retain_bytes: int | None = None,
    ) -> None:
        """`spill_dir`: where older rounds' residuals go (None: all stay in RAM);
        `retain_bytes`: the most residual bytes kept, in RAM and folder together."""
        self.source = source
        source.feedback.require_chain = True
        self._disk = None if spill_dir is None else SpillDir(spill_dir)  # clears a past run's
        self._names = itertools.count()
        at_most = None
        if retain_bytes is not None:
            at_most = max(keep, retain_bytes // max(1, source.feedback.residual.nbytes))
        self._kept: RecentRounds[_KeptWork] = RecentRounds(
            keep, retain_s, at_most=at_most, on_drop=_KeptWork.remove
        )
        self._newest: _KeptWork | None = None

    def commitment_fields(self) -> tuple[bytes, tuple[bytes, bytes]]:
        """(`previous`, `residual`) of our commitment for the open message (blocking)."""
        chain = self.source.feedback.chain
        previous = Commitment.decode(chain).digest() if chain else b""
        return previous, self.source.feedback.claims()

    def committed(self, round_index: int, group: Group, me: PeerID, commitment: Commitment) -> None:
        """Our commitment for the round is made: it becomes the residual's chain if the
        round commits, and what we reveal of the round is kept (blocking: a copy)."""
        feedback = self.source.feedback
        slot = self.source.own_slot(group.round_id, me)
        if slot is None:
            return
        work = SparseWork(feedback.chain, slot, feedback.residual.clone())
        if self._newest is not None and self._disk is not None:
            self._newest.spill(self._disk, f"residual-{next(self._names)}")
        claimed = commitment.residual
        digest = claimed[0] if claimed is not None else residual_digest(work.residual)
        self._newest = _KeptWork(work, digest)
        self._kept.add(round_index, self._newest)
        feedback.propose_chain(commitment.encode())

    def kept(self, round_index: int) -> SparseWork | None:
        """What we reveal of the round (blocking: may read a file); None: not kept, or
        its file is gone or altered."""
        kept = self._kept.get(round_index)
        return None if kept is None else kept.work()

    def spilled_files(self) -> list[Path]:
        return [] if self._disk is None else self._disk.files()


def check_chain(
    commitment: Commitment, chain: bytes, elements: int, anchor: Commitment | None = None
) -> str | None:
    """Why `commitment`'s starting residual does not follow from the revealed previous
    commitment `chain`, or None (blocking: hashes a zero residual). `anchor`: the
    prover's commitment in that previous round as its members received it (ours, or
    the round's records in the DHT), when known: a prover could otherwise sign a
    previous commitment it never sent, chaining to any residual it likes."""
    previous = None
    if chain:
        try:
            previous = Commitment.decode(chain)
        except CommitmentError as e:
            return f"the previous commitment revealed does not decode: {e}"
        if previous.digest() != commitment.previous or previous.prover != commitment.prover:
            return "the previous commitment revealed is not the one named"
        if anchor is not None and anchor.digest() != previous.digest():
            return "the previous commitment revealed is not the one its round received"
    elif commitment.previous:
        return "the previous commitment named was not revealed"
    return residual_chains(commitment, previous, residual_digest(torch.zeros(elements)))


def previous_round(chain: bytes | None) -> int | None:
    """The round of a revealed previous commitment (None: none, or it does not decode)."""
    try:
        return Commitment.decode(chain).round if chain else None
    except CommitmentError:
        return None


def check_message(
    codec: SparseCodec,
    commitment: Commitment,
    work: SparseWork,
    start: Sequence[torch.Tensor],
    end: Sequence[torch.Tensor],
    streams: int,
    chunk_elements: int,
) -> str | None:
    """Why what the prover sent is not what its run gives, or None: from the round's
    global state `start`, the run's revealed `end` and its starting residual, the
    message and the residual it leaves, re-derived exactly, must be the committed
    ones, and its slot the one its commitment's root covers (blocking)."""
    assert commitment.residual is not None
    delta = flat_difference(start, end)  # (as the strategy computes it: global - end)
    if residual_digest(work.residual) != commitment.residual[0]:
        return "the residual revealed is not the one committed"
    feedback = ErrorFeedback(codec, delta.numel())
    feedback.residual.copy_(work.residual)
    try:
        message = feedback.compress(delta)
    except CodecError as e:
        return f"the run's pseudo-gradient cannot be coded: {e}"
    gather = SparseGather(codec, delta.numel())
    index, members, slot = work.slot
    if gather.message_of(slot) != message:
        return "the message sent is not the one of the run"
    if feedback.claims()[1] != commitment.residual[1]:
        return "the residual the round leaves is not the one committed"
    try:
        buffer = gather.buffer_with(members, index, slot)
    except ValueError as e:
        return f"the slot revealed is malformed: {e}"
    plan = Plan.build(buffer.numel(), [1.0] * members, streams=streams,
                      chunk_elements=chunk_elements)  # fmt: skip
    if MerkleTree(chunk_leaves(plan, buffer, get_codec("none"))).root != commitment.delta_root:
        return "the slot revealed is not the one committed"
    return None
