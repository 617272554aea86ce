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
from shoal.averaging.buffers import bytes_of
from shoal.averaging.compression import CodecError, get_codec
from shoal.averaging.error_feedback import ErrorFeedback, residual_digest, zero_digest
from shoal.averaging.group import Group
from shoal.averaging.partition import Plan
from shoal.averaging.sparse_codec import SparseCodec, SparseMessage
from shoal.averaging.sparse_gather import SparseGather
from shoal.transport.identity import PeerID
from shoal.verification.commitment import (
    Commitment,
    CommitmentError,
    MerkleTree,
    leaf_hash,
    residual_chains,
    verify_inclusion,
)
from shoal.verification.receipts import ChainProof, ReceiptError

from .recent import RecentRounds
from .segments import flat_difference
from .spill import SpillDir, load_tensor

__all__ = [
    "SampledChunk",
    "SparseProver",
    "SparseSource",
    "SparseWork",
    "check_chain",
    "check_message",
    "check_sampled",
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
    # Audited by chunks (`codec_audit`): the values the message kept before it was
    # quantized, and the leaf hashes of the residual at the start and after a commit.
    kept: torch.Tensor | None = None
    leaves: tuple[list[bytes], list[bytes]] | None = None

    def sampled(self, chunks: Sequence[int], leaf: int) -> list[SampledChunk]:
        """The residual's chunks `chunks` (of `leaf` elements) with their proofs."""
        assert self.leaves is not None, "a round hashed whole has no chunks to show"
        start, after = MerkleTree(self.leaves[0]), MerkleTree(self.leaves[1])
        return [SampledChunk(i, self.residual[i * leaf : (i + 1) * leaf].clone(),
                             start.proof(i), after.proof(i)) for i in chunks]  # fmt: skip


@dataclass
class SampledChunk:
    """One chunk of a sparse round's starting residual, as a sampled reveal shows it:
    with its Merkle proofs under the commitment's two residual roots (at the start,
    and after the commit: that one the referee's own re-derived chunk must meet)."""

    index: int
    residual: torch.Tensor
    start_proof: list[bytes]
    end_proof: list[bytes]


class _KeptWork:
    """A round's `SparseWork` as kept: its residual in RAM, or in a file once a newer
    round's took its place (`digest`: the committed hash it must still have)."""

    __slots__ = ("chain", "digest", "kept", "leaf", "leaves", "path", "proof", "residual", "slot")

    def __init__(self, work: SparseWork, digest: bytes, leaf: int) -> None:
        self.chain, self.slot, self.digest = work.chain, work.slot, digest
        self.proof, self.kept, self.leaves, self.leaf = work.proof, work.kept, work.leaves, leaf
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
            if residual is not None and residual_digest(residual, self.leaf) != self.digest:
                residual = None  # altered on disk: no reveal rather than a wrong one
        if residual is None:
            return None
        return SparseWork(self.chain, self.slot, residual, self.proof, self.kept, self.leaves)

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
        work = SparseWork(feedback.chain, slot, feedback.residual.clone(), self._chain_proof(),
                          feedback.kept, feedback.claimed_leaves)  # fmt: skip
        if self._newest is not None and self._disk is not None:
            self._newest.spill(self._disk, f"residual-{next(self._names)}")
        claimed = commitment.residual
        leaf = feedback.leaf
        digest = claimed[0] if claimed is not None else residual_digest(work.residual, leaf)
        self._newest = _KeptWork(work, digest, leaf)
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
    leaf: int = 0,
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
    return residual_chains(commitment, previous, zero_digest(elements, leaf))


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
    if gather.message_of(work.slot[2]) != message:
        return "the message sent is not the one of the run"
    if feedback.claims()[1] != commitment.residual[1]:
        return "the residual the round leaves is not the one committed"
    return _slot_problem(gather, commitment, work.slot, streams, chunk_elements)


def _slot_problem(
    gather: SparseGather,
    commitment: Commitment,
    slot: tuple[int, int, bytes],
    streams: int,
    chunk_elements: int,
) -> str | None:
    """Why `slot` is not the one the commitment's root covers, or None (blocking)."""
    index, members, raw = slot
    try:
        buffer = gather.buffer_with(members, index, raw)
    except ValueError as e:
        return f"the slot revealed is malformed: {e}"
    plan = Plan.build(buffer.numel(), [1.0] * members, streams=streams,
                      chunk_elements=chunk_elements)  # fmt: skip
    if MerkleTree(chunk_leaves(plan, buffer, get_codec("none"))).root != commitment.delta_root:
        return "the slot revealed is not the one committed"
    return None


def check_sampled(
    codec: SparseCodec,
    commitment: Commitment,
    slot: tuple[int, int, bytes],
    kept: torch.Tensor,
    samples: Sequence[SampledChunk],
    start: Sequence[torch.Tensor],
    end: Sequence[torch.Tensor],
    streams: int,
    chunk_elements: int,
    *,
    decay: float = 1.0,
) -> str | None:
    """`check_message` of a round audited by chunks (`codec_audit`), from the values
    the message kept (`kept`, float32) and a few chunks of the starting residual
    (`samples`, drawn by the referee after the commitment), or None (blocking):

    - the slot is the committed one, and its message is what `kept` codes at its
      indices (`SparseCodec.recode`: the centroid table and every code follow from
      the kept values, so a liar cannot bend them apart);
    - each sampled chunk is a leaf of the starting residual's root; from it and the
      run's pseudo-gradient there, the chunk's indices and kept values are re-derived
      bit for bit, and what the chunk leaves is a leaf of the root after the commit.

    A prover that lies in a share f of the chunks (values, indices or residual) is
    caught with probability 1 - (1 - f)^s by s samples; one that lies about the kept
    values alone, or bends the whole message, always."""
    assert commitment.residual is not None
    delta = flat_difference(start, end)  # (as the strategy computes it: global - end)
    n = delta.numel()
    gather = SparseGather(codec, n)
    why = _slot_problem(gather, commitment, slot, streams, chunk_elements)
    if why is not None:
        return why
    message = gather.message_of(slot[2])
    try:
        sent = codec.check(message, n)
    except CodecError as e:
        return f"the message sent is malformed: {e}"
    if kept.shape != (codec.kept(n),) or not bool(torch.isfinite(kept).all()):
        return "the kept values revealed are not the message's"
    if codec.recode(message, kept, n) != message:
        return "the message sent is not the coding of the kept values revealed"
    count, decay_t = codec.chunks(n), torch.tensor(decay, dtype=torch.float32)
    for sample in samples:
        why = _chunk_problem(codec, commitment, sample, delta, sent, kept, count, decay_t)
        if why is not None:
            return why
    return None


def _chunk_problem(
    codec: SparseCodec,
    commitment: Commitment,
    sample: SampledChunk,
    delta: torch.Tensor,
    sent: SparseMessage,
    kept: torch.Tensor,
    count: int,
    decay: torch.Tensor,
) -> str | None:
    """`check_sampled`'s checks of one chunk (the error feedback's arithmetic, chunk by
    chunk: the same bits as over the whole vector, every operation elementwise)."""
    assert commitment.residual is not None
    n = delta.numel()
    try:
        first, length, k = codec.chunk_span(sample.index, n)
    except IndexError:
        return "a sampled chunk past the residual's end"
    residual = sample.residual
    if residual.shape != (length,) or residual.dtype != torch.float32:
        return "a sampled chunk of another size"
    if not verify_inclusion(commitment.residual[0], leaf_hash(bytes_of(residual)), sample.index,
                            count, sample.start_proof):  # fmt: skip
        return "a residual chunk revealed is not the one committed"
    acc = torch.mul(residual, decay) if float(decay) != 1.0 else residual.clone()
    acc.add_(delta[first : first + length])
    try:
        offsets, values = codec.pick_chunk(acc, k)
    except CodecError as e:
        return f"the run's pseudo-gradient cannot be coded: {e}"
    at = _kept_at(codec, sample.index, n)
    if not torch.equal(sent.indices[at : at + k] - first, offsets):
        return "the indices sent are not the run's"
    if not torch.equal(kept[at : at + k].view(torch.int32), values.view(torch.int32)):
        return "the values sent are not the run's"
    decoded = torch.zeros(length)
    codec.add_decoded(_chunk_message(sent, at, k, first), decoded, 1.0)
    left = acc.sub_(decoded)
    if not verify_inclusion(commitment.residual[1], leaf_hash(bytes_of(left)), sample.index,
                            count, sample.end_proof):  # fmt: skip
        return "the residual the round leaves is not the one committed"
    return None


def _kept_at(codec: SparseCodec, index: int, n: int) -> int:
    """Where chunk `index`'s kept values begin in a message of n elements."""
    return index * codec.k  # (the tail, last, begins after every full chunk's k)


def _chunk_message(sent: SparseMessage, at: int, k: int, first: int) -> SparseMessage:
    """The part of `sent` in one chunk, its indices from the chunk's start."""
    return SparseMessage(sent.indices[at : at + k] - first, sent.values[at : at + k])
