"""Verified sparse rounds: what a member commits to of its error feedback, keeps to
reveal, and what an audit checks of the message it sent.

A sparse message is `encode(decay * residual + delta)` (`averaging.error_feedback`;
`decay` the experiment's `codec_feedback_decay`, named in the round's audit shape),
the residual what earlier rounds did not send. The commitment's root is over the
member's slot (its signed message: `averaging.attestation` binds it to what
everyone received), and the commitment also carries the residual's hashes at the
round's start and after a commit (`Commitment.residual`), its `previous` the
commitment whose commit left that residual (`ErrorFeedback.chain`). So:

- every audit checks the chain: the starting residual is what the previous round
  left, or zero (a join, a re-sync): `residual_chains`. The previous commitment
  comes with the reveal and must hash to `previous`, and with the receipts of its
  round (`verification.receipts`): other members of that round vouch that it is
  the one they received. A referee that was in that round compares its own copy
  instead; a chain nobody vouches for gives no verdict (`unproven_chain`);
- the audit of the last segment, whose end is the run's end, also gets the
  starting residual and the slot, and re-derives exactly (encoding is a pure
  function) the message the run gives and the residual it leaves: both must be
  the committed ones.

A prover that picks its residual or sends another message than its run gives is
caught when its last segment is drawn, as one that sends another dense
pseudo-gradient is; the robust reduction bounds what it sends meanwhile.

What a prover keeps per round (`SparseProver`): the starting residual (a model
size, while its round may be audited), the previous commitment with its round's
receipts, and its slot. The
newest round's residual stays in RAM; with a folder (the work log's), older ones
are written there and read back, checked against the committed hash, when a
reveal needs them, and at most `retain_bytes` of residuals are kept in all (the
oldest rounds beyond the last `keep` go first, as the work log's states do).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgpack
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
from shoal.verification.receipts import ChainProof, ReceiptError

from .recent import RecentRounds
from .segments import flat_difference
from .spill import SpillDir, load_tensor

__all__ = [
    "SparseProver",
    "SparseSource",
    "SparseWork",
    "check_chain",
    "check_message",
    "unproven_chain",
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
    proof: ChainProof | None = None  # the receipts of the previous commitment's round


class _KeptWork:
    """A round's `SparseWork` as kept: its residual in RAM, or in a file once a newer
    round's took its place (`digest`: the committed hash it must still have)."""

    __slots__ = ("chain", "digest", "path", "proof", "residual", "slot")

    def __init__(self, work: SparseWork, digest: bytes) -> None:
        self.chain, self.slot, self.digest = work.chain, work.slot, digest
        self.proof = work.proof
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
        if residual is None:
            return None
        return SparseWork(self.chain, self.slot, residual, self.proof)

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
        proofs: Callable[[int], ChainProof | None] | None = None,
    ) -> None:
        """`spill_dir`: where older rounds' residuals go (None: all stay in RAM);
        `retain_bytes`: the most residual bytes kept, in RAM and folder together;
        `proofs(round)`: our receipt of a round we committed, with its signatures."""
        self.source = source
        self._proofs = proofs
        source.feedback.chain_proof = self._chain_proof_bytes
        source.feedback.chain_vouched = self._chain_vouched
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
        work = SparseWork(feedback.chain, slot, feedback.residual.clone(), self._chain_proof())
        if self._newest is not None and self._disk is not None:
            self._newest.spill(self._disk, f"residual-{next(self._names)}")
        claimed = commitment.residual
        digest = claimed[0] if claimed is not None else residual_digest(work.residual)
        self._newest = _KeptWork(work, digest)
        self._kept.add(round_index, self._newest, tag=commitment.start)
        feedback.propose_chain(commitment.encode())

    def _chain_proof(self) -> ChainProof | None:
        """The receipts of the round of our residual's chain: kept since that round
        (their signatures may still come in), or restored from a checkpoint."""
        feedback = self.source.feedback
        if not feedback.chain:
            return None
        previous = Commitment.decode(feedback.chain)
        proof = None if self._proofs is None else self._proofs(previous.round)
        if proof is not None and proof.lie(previous) is None:
            return proof
        if not feedback.restored_proof:
            return None
        try:  # (a checkpoint's: our own bytes, but a file can be altered)
            restored = ChainProof.from_wire(msgpack.unpackb(feedback.restored_proof))
        except (ReceiptError, ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError):
            return None
        return restored if restored.lie(previous) is None else None

    @property
    def unvouched(self) -> int:
        return self.source.feedback.unvouched_dropped

    def _chain_vouched(self) -> bool:
        """Whether enough other members vouch for our residual's chain (blocking)."""
        proof = self._chain_proof()
        return proof is not None and proof.proves(Commitment.decode(self.source.feedback.chain))

    def _chain_proof_bytes(self) -> bytes | None:
        """What a checkpoint keeps of `_chain_proof` (blocking: decodes the chain)."""
        proof = self._chain_proof()
        return None if proof is None else msgpack.packb(proof.to_wire(), use_bin_type=True)

    def kept(self, round_index: int, start: bytes | None = None) -> SparseWork | None:
        """What we reveal of the round (blocking: may read a file) that started from
        `start` (None: the last of that index); None: not kept, or its file is gone or
        altered."""
        kept = self._kept.get(round_index, start)
        return None if kept is None else kept.work()

    def spilled_files(self) -> list[Path]:
        return [] if self._disk is None else self._disk.files()


def check_chain(
    commitment: Commitment,
    chain: bytes,
    elements: int,
    anchor: bytes | None = None,
    proof: ChainProof | None = None,
) -> str | None:
    """Why `commitment`'s starting residual does not follow from the revealed previous
    commitment `chain`, or None (blocking: hashes a zero residual). `anchor`: the
    digest of the prover's commitment in that previous round as we received it, when
    we were there; `proof`: the receipts of that round the prover revealed (a prover could
    otherwise sign a previous commitment it never sent, chaining to any residual it
    likes; whether enough members vouch is `unproven_chain`'s question)."""
    previous = None
    if chain:
        try:
            previous = Commitment.decode(chain)
        except CommitmentError as e:
            return f"the previous commitment revealed does not decode: {e}"
        if previous.digest() != commitment.previous or previous.prover != commitment.prover:
            return "the previous commitment revealed is not the one named"
        if anchor is not None and anchor != previous.digest():
            return "the previous commitment revealed is not the one its round received"
        lie = None if proof is None else proof.lie(previous)
        if lie is not None:
            return lie
    elif commitment.previous:
        return "the previous commitment named was not revealed"
    return residual_chains(commitment, previous, residual_digest(torch.zeros(elements)))


def unproven_chain(
    commitment: Commitment,
    chain: bytes | None,
    proof: ChainProof | None,
    anchored: bool,
    zero: bytes,
) -> str | None:
    """Why nobody vouches for the previous commitment a sparse round's residual chains
    to, or None (vouched for, not needed, or malformed: `check_chain` says). Needed
    unless the residual starts at zero (`zero`: its hash) or the referee holds its own
    copy of that commitment (`anchored`). Not a finding either way: the other members
    may have crashed right after their commit, before they handed out their receipts."""
    if commitment.residual is None or commitment.residual[0] == zero or not chain or anchored:
        return None
    try:
        previous = Commitment.decode(chain)
    except CommitmentError:
        return None
    if proof is None:
        return "no receipts of the previous commitment's round"
    if proof.lie(previous) is None and not proof.proves(previous):
        return (f"{proof.vouchers(previous.prover)} other members vouch for the previous "
                f"commitment, {proof.receipt.needed()} needed")  # fmt: skip
    return None


def check_message(
    codec: SparseCodec,
    commitment: Commitment,
    work: SparseWork,
    start: Sequence[torch.Tensor],
    end: Sequence[torch.Tensor],
    streams: int,
    chunk_elements: int,
    *,
    decay: float = 1.0,
) -> str | None:
    """Why what the prover sent is not what its run gives, or None: from the round's
    global state `start`, the run's revealed `end` and its starting residual, the
    message and the residual it leaves, re-derived exactly, must be the committed
    ones, and its slot the one its commitment's root covers (blocking)."""
    assert commitment.residual is not None
    delta = flat_difference(start, end)  # (as the strategy computes it: global - end)
    if residual_digest(work.residual) != commitment.residual[0]:
        return "the residual revealed is not the one committed"
    feedback = ErrorFeedback(codec, delta.numel(), decay=decay)
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
