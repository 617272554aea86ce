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
size, while its round may be audited), the previous commitment and its slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


class SparseProver:
    """A verified member's error feedback in its commitments, and what it keeps."""

    def __init__(self, source: SparseSource, keep: int, retain_s: float) -> None:
        self.source = source
        source.feedback.require_chain = True
        self._kept: RecentRounds[SparseWork] = RecentRounds(keep, retain_s)

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
        self._kept.add(round_index, SparseWork(feedback.chain, slot, feedback.residual.clone()))
        feedback.propose_chain(commitment.encode())

    def kept(self, round_index: int) -> SparseWork | None:
        return self._kept.get(round_index)


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
