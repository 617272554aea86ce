"""Contributions bound to commitments: what a part owner checks of what it receives.

With an `Attestor` (verified experiments), every member that contributes to a
round signs a `verification.Commitment` whose `delta_root` is the Merkle root
over its contribution's chunks *as sent* (encoded with the round's codec, in
the plan's global chunk order). The commitment travels in the header of each
lane, with the Merkle proofs of that lane's chunks; the owner of the part
hashes every chunk as it arrives and checks it against the root, and refuses a
commitment its `Attestor` does not accept (another experiment, round or start
state, or more weight than the committed steps can carry). A member that sends
something other than what it committed to is vetoed out of the round, named.

In an owner-written round (`reducer.BitwiseUnion`: the slots of sparse
messages) nobody sends to another's part, so no owner checks chunks on
arrival: each member re-derives every other member's root from that member's
part as it came to everyone (`owner_part_root`: its slot, zeros elsewhere) and
vetoes, naming it, a part that is not what its author committed to, or a
non-empty part without a commitment (`owner_written_problem`, before its vote).

After the round, the prover reveals its inner run to auditors; the root ties
what it sent to its final state (`Attestor` owners re-derive it there). The
chunks' leaves are computed by the sender before any byte moves (one extra
encoding pass over the contribution, in a thread).

To a part's owner that speaks protocol 2.11 a lane header is smaller: the
commitment without what every member knows (`Commitment.encode_known`: the
experiment, the prover, the round; the owner puts back its `Attestor`'s
`round_fields` and the sender's identity before it checks the signature), and in
an owner-written round no Merkle proofs (no chunk of ours travels to its part).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shoal.transport.identity import PeerID
from shoal.transport.version import ProtocolVersion
from shoal.verification.commitment import (
    Commitment,
    CommitmentError,
    MerkleTree,
    leaf_hash,
    verify_inclusion,
)

from .buffers import bytes_of
from .compression import Codec
from .group import Group
from .partition import Plan, Span

__all__ = [
    "COMPACT_HEADERS_PROTOCOL",
    "Attestor",
    "ReceivedCommitments",
    "RoundAttestation",
    "chunk_leaves",
    "global_chunks",
    "lane_offset",
    "owner_part_root",
    "owner_written_problem",
]

MAX_PROOF = 64  # hashes per proof (a tree of 2**64 chunks)
# The first protocol whose part owners take a lane header without the fields they know
# (and, in an owner-written round, without proofs), and commitments that bind their
# checkpoints by a hash (`Commitment.compact`).
COMPACT_HEADERS_PROTOCOL = ProtocolVersion(2, 11)


class Attestor(Protocol):
    """What verifies contributions for a round: the peer layer implements it."""

    def commit(self, group: Group, delta_root: bytes, parts: int, weight: float) -> Commitment:
        """Our signed commitment for this round's contribution. Called in a worker
        thread while the round waits for it (the model is not being trained meanwhile);
        `accept` and `on_commit` are called on the event loop."""
        ...

    def accept(self, group: Group, commitment: Commitment, weight: float) -> str | None:
        """Why a member's commitment (already signed by it) is refused, or None."""
        ...

    def on_commit(self, group: Group, commitments: Mapping[PeerID, Commitment]) -> None:
        """The round committed with these members' commitments (ours included)."""
        ...

    def round_fields(self, group: Group) -> tuple[str, int]:
        """(experiment, round) that every member's commitment for this round must name:
        what a compact lane header leaves out (`Commitment.decode_known`)."""
        ...


def global_chunks(plan: Plan) -> list[Span]:
    """Every chunk of the plan in the one global order the Merkle leaves follow:
    by owner, by lane, by chunk."""
    return [c for j in range(len(plan.parts)) for lane in plan.lanes(j) for c in plan.chunks(lane)]


def lane_offset(plan: Plan, owner: int, lane: int) -> int:
    """The global index of the first chunk of lane `lane` of `owner`'s part."""
    before = sum(len(plan.chunks(span)) for j in range(owner) for span in plan.lanes(j))
    return before + sum(len(plan.chunks(span)) for span in plan.lanes(owner)[:lane])


def chunk_leaves(plan: Plan, flat: torch.Tensor, codec: Codec) -> list[bytes]:
    """The leaf hash of each chunk of `flat` as the lanes send it (blocking)."""
    spans = global_chunks(plan)
    if codec.name == "none":
        return [leaf_hash(bytes_of(flat[a:b])) for a, b in spans]
    staging = memoryview(bytearray(codec.encoded_size(plan.chunk_elements)))
    leaves = []
    for a, b in spans:
        payload = staging[: codec.encoded_size(b - a)]
        codec.encode(flat[a:b], payload)
        leaves.append(leaf_hash(payload))
    return leaves


def owner_part_root(plan: Plan, result: torch.Tensor, owner: int) -> bytes:
    """The Merkle root of a contribution holding `result`'s part `owner` and zeros
    elsewhere, uncompressed: in an owner-written round (`reducer.BitwiseUnion`) what
    a member contributed is its own part as it arrives to everyone, so this is its
    commitment's root re-derived from what it sent (blocking: hashes the part)."""
    a_part, b_part = plan.parts[owner]
    zeros: dict[int, bytes] = {}
    leaves = []
    for a, b in global_chunks(plan):
        if a_part <= a and b <= b_part:
            leaves.append(leaf_hash(bytes_of(result[a:b])))
        else:
            if b - a not in zeros:
                zeros[b - a] = leaf_hash(bytes(4 * (b - a)))
            leaves.append(zeros[b - a])
    return MerkleTree(leaves).root


def owner_written_problem(
    plan: Plan, result: torch.Tensor, group: Group, me: int, received: ReceivedCommitments
) -> tuple[str, int] | None:
    """The first member of an owner-written round whose part (as everyone received it)
    is not what it committed to, or is not empty without a commitment; None when every
    part checks. Our own part is what we sent: not checked."""
    for j, peer in enumerate(group.peer_ids):
        if j == me:
            continue
        commitment = received.by_member.get(peer)
        a, b = plan.parts[j]
        if commitment is None:
            if bool(result[a:b].view(torch.int32).any()):
                return "sent a part without a commitment to it", j
            continue
        if owner_part_root(plan, result, j) != commitment.delta_root:
            return "sent another part than it committed to", j
    return None


@dataclass
class RoundAttestation:
    """Our commitment for a round and the proofs that go with each lane."""

    plan: Plan
    commitment: Commitment
    tree: MerkleTree
    encoded: bytes = field(init=False)

    encoded_known: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.encoded = self.commitment.encode()
        self.encoded_known = self.commitment.encode_known()

    @classmethod
    def make(
        cls, attestor: Attestor, group: Group, plan: Plan, leaves: Sequence[bytes], weight: float
    ) -> RoundAttestation:
        tree = MerkleTree(leaves)
        commitment = attestor.commit(group, tree.root, len(leaves), weight)
        return cls(plan, commitment, tree)

    def header(
        self, owner: int, lane: int, *, compact: bool = False, owner_written: bool = False
    ) -> dict[str, object]:
        """What the lane's request carries: the commitment and the lane's proofs;
        `compact` (an owner of 2.11): the commitment without the fields the owner
        knows, and no proofs in an `owner_written` round (no chunk travels)."""
        if compact and owner_written:
            return {"k": self.encoded_known}
        first = lane_offset(self.plan, owner, lane)
        count = len(self.plan.chunks(self.plan.lanes(owner)[lane]))
        proofs = [self.tree.proof(first + i) for i in range(count)]
        return {"k" if compact else "c": self.encoded_known if compact else self.encoded,
                "m": proofs}  # fmt: skip


@dataclass
class _Attested:
    commitment: Commitment
    proofs: list[list[bytes]]
    first: int  # global index of the lane's first chunk


class ReceivedCommitments:
    """The owner's side: members' commitments, and every chunk checked against them."""

    def __init__(
        self, attestor: Attestor, group: Group, plan: Plan, me: int, *, owner_written: bool = False
    ) -> None:
        self.attestor = attestor
        self.group = group
        self.plan = plan
        self.me = me  # the owner of the part these lanes carry
        self.owner_written = owner_written  # (no chunk comes: no proofs needed)
        self.by_member: dict[PeerID, Commitment] = {}
        self._lanes: dict[tuple[int, int], _Attested] = {}

    def attach(
        self, sender: int, lane: int, header: dict[str, object], weight: float
    ) -> str | None:
        """Check a lane's request; why it is refused, or None."""
        if not weight > 0:
            return None  # contributes nothing: nothing to commit to
        peer = self.group.peer_ids[sender]
        commitment = self._commitment(peer, header)
        if isinstance(commitment, str):
            return commitment
        # (2.11: an owner-written round's lanes carry no proofs; before, all of them.)
        proofs = header.get("m", [] if self.owner_written else None)
        if commitment.prover != peer:
            return "a commitment of another peer"
        if commitment.parts != len(global_chunks(self.plan)):
            return "the commitment's part count does not match the plan"
        known = self.by_member.get(peer)
        if known is not None and known.digest() != commitment.digest():
            return "two different commitments for one round"
        count = len(self.plan.chunks(self.plan.lanes(self.me)[lane]))
        if self.owner_written and proofs == []:
            count = 0
        if not (
            isinstance(proofs, list)
            and len(proofs) == count
            and all(isinstance(p, list) and len(p) <= MAX_PROOF for p in proofs)
            and all(isinstance(x, bytes) for p in proofs for x in p)
        ):
            return "malformed Merkle proofs"
        problem = self.attestor.accept(self.group, commitment, weight)
        if problem is not None:
            return problem
        self.by_member[peer] = commitment
        self._lanes[(sender, lane)] = _Attested(
            commitment, proofs, lane_offset(self.plan, self.me, lane)
        )
        return None

    def _commitment(self, peer: PeerID, header: dict[str, object]) -> Commitment | str:
        """The lane's commitment (whole, or compact: `Commitment.decode_known`), or
        why there is none."""
        raw, known = header.get("c"), header.get("k")
        try:
            if isinstance(known, bytes):
                experiment, round_index = self.attestor.round_fields(self.group)
                return Commitment.decode_known(known, experiment, peer, round_index)
            if isinstance(raw, bytes):
                return Commitment.decode(raw)
        except CommitmentError as e:
            return f"bad commitment: {e}"
        return "no commitment with the contribution"

    def check_chunk(self, sender: int, lane: int, index: int, payload: memoryview) -> bool:
        """Whether chunk `index` of a lane is what its sender committed to (blocking:
        it hashes the chunk)."""
        attested = self._lanes.get((sender, lane))
        if attested is None or not 0 <= index < len(attested.proofs):
            return False  # (an owner-written round's lanes have none: no chunk comes)
        c = attested.commitment
        proof = attested.proofs[index]
        return verify_inclusion(c.delta_root, leaf_hash(payload), attested.first + index,
                                c.parts, proof)  # fmt: skip
