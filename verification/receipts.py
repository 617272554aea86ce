"""Receipts: the members of a committed round vouch for the commitments they received.

A sparse round's audit checks that the prover's starting residual is what its
previous commitment left (`commitment.residual_chains`), and that previous
commitment is revealed by the prover itself. Signed by the prover, it proves only
that the prover signed it: a prover that signed one it never sent would choose its
residual freely. Only the members of that round know what it sent them. So after a
commit, each member of a verified sparse round signs a `Receipt`: the round
(experiment, commit count, round ID, the global state its work started from), its
members in the round's order and, for each, the digest of the commitment this
member received from it (empty: none). (The start tells apart two rounds of one
commit count in two lineages: a peer that re-synced onto another lineage may
commit the same count again.) The
members hand their signatures to each other (`peer.verify.receipts`), and a prover
proves its chain with a `ChainProof`: the receipt of its previous round, listing
the commitment it reveals, signed by `RECEIPTS_NEEDED` members other than itself.

Members sign only what they received, so no prover can forge a proof without as many
accomplices (the same bound as a round's certificate, `averaging.provenance`). A
proof whose receipt lists another commitment for the prover than the one revealed
is a lie anyone can check (`ChainProof.lie`); one with too few signatures is not (the
others may have crashed right after the commit), and an audit that meets one gives
no verdict (`peer.verify.referee`). Only valid signatures of members are kept: a
proof with another is refused whole when decoded.

Pure functions of bytes: decoding bounds every field before anything is verified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shoal.transport.identity import Identity, PeerID

from .commitment import HASH_BYTES, MAX_TEXT, Commitment

__all__ = ["RECEIPTS_NEEDED", "ChainProof", "Receipt", "ReceiptError"]

RECEIPTS_NEEDED = 2  # other members' signatures a chain needs (fewer in a smaller round)
MAX_MEMBERS = 256  # (as a commit certificate: groups are a few dozen peers)
MAX_ROUND_ID_BYTES = 64
MAX_PEER_ID_BYTES = 64
SIGNATURE_BYTES = 64
_DOMAIN = b"shoal/receipt/1\0"


class ReceiptError(ValueError):
    """A receipt or proof that is malformed, or carries a signature that does not verify."""


@dataclass(frozen=True)
class Receipt:
    """What one member of a committed round saw of the round's commitments."""

    experiment: str
    round: int  # the commit count the round's work started from (`Commitment.round`)
    round_id: bytes
    start: bytes  # the hash of the global state the round's work started from
    members: tuple[PeerID, ...]  # in the round's order
    digests: tuple[bytes, ...]  # per member, its commitment's digest (b"": none came)

    def __post_init__(self) -> None:
        if not isinstance(self.experiment, str) or len(self.experiment) > MAX_TEXT:
            raise ReceiptError("bad experiment name")
        if not isinstance(self.round, int) or isinstance(self.round, bool) or self.round < 0:
            raise ReceiptError("bad round")
        if not isinstance(self.round_id, bytes) or not 0 < len(self.round_id) <= MAX_ROUND_ID_BYTES:
            raise ReceiptError("bad round ID")
        if not isinstance(self.start, bytes) or len(self.start) != HASH_BYTES:
            raise ReceiptError(f"the start is a hash of {HASH_BYTES} bytes")
        if not 0 < len(self.members) <= MAX_MEMBERS or len(set(self.members)) != len(self.members):
            raise ReceiptError("a round has 1 to 256 distinct members")
        if len(self.digests) != len(self.members):
            raise ReceiptError("one digest per member")
        if not all(isinstance(d, bytes) and len(d) in (0, HASH_BYTES) for d in self.digests):
            raise ReceiptError(f"a digest is {HASH_BYTES} bytes, or empty")

    @classmethod
    def of_round(
        cls,
        experiment: str,
        round_index: int,
        round_id: bytes,
        start: bytes,
        members: Sequence[PeerID],
        commitments: Mapping[PeerID, Commitment],
    ) -> Receipt:
        """The receipt of the `commitments` received in a round (blocking: hashes)."""
        digests = tuple(commitments[m].digest() if m in commitments else b"" for m in members)
        return cls(experiment, round_index, round_id, start, tuple(members), digests)

    def signed_bytes(self) -> bytes:
        """The canonical bytes every member signs (domain-separated)."""
        body: bytes = msgpack.packb(self._fields(), use_bin_type=True)
        return _DOMAIN + body

    def sign(self, identity: Identity) -> bytes:
        return identity.sign(self.signed_bytes())

    def digest_of(self, peer: PeerID) -> bytes | None:
        """The digest this receipt lists for `peer` (None: not a member)."""
        return self.digests[self.members.index(peer)] if peer in self.members else None

    def lists(self, previous: Commitment) -> bool:
        """Whether this is a receipt of `previous`'s round (whatever it lists for it)."""
        return (self.experiment, self.round, self.start) == (
            previous.experiment,
            previous.round,
            previous.start,
        )

    def needed(self) -> int:
        """Signatures of members other than a prover that prove its chain."""
        return min(RECEIPTS_NEEDED, len(self.members) - 1)

    def _fields(self) -> list[Any]:
        return [
            self.experiment,
            self.round,
            self.round_id,
            self.start,
            [m.to_bytes() for m in self.members],
            list(self.digests),
        ]


@dataclass
class ChainProof:
    """A receipt and the valid signatures of it by its members found so far."""

    receipt: Receipt
    signatures: dict[PeerID, bytes] = field(default_factory=dict)

    def add(self, peer: PeerID, signature: bytes) -> bool:
        """Keep `signature` if it is member `peer`'s valid signature (True when new)."""
        if peer in self.signatures or peer not in self.receipt.members:
            return False
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            return False
        if not peer.verify(signature, self.receipt.signed_bytes()):
            return False
        self.signatures[peer] = signature
        return True

    def lie(self, previous: Commitment) -> str | None:
        """Why this proof, shown with `previous` as the prover's previous commitment,
        proves that commitment is not the one its round received; None otherwise."""
        r = self.receipt
        if not r.lists(previous):
            return "the receipts shown are of another round than the previous commitment's"
        if r.digest_of(previous.prover) != previous.digest():
            return "the previous commitment revealed is not the one its round received"
        return None

    def vouchers(self, prover: PeerID) -> int:
        """How many members other than `prover` signed."""
        return len(self.signatures.keys() - {prover})

    def proves(self, previous: Commitment) -> bool:
        """Whether enough other members vouch for `previous` (and the proof does not lie)."""
        short = self.vouchers(previous.prover) < self.receipt.needed()
        return not short and self.lie(previous) is None

    def shown(self, prover: PeerID) -> ChainProof:
        """What `prover` reveals of this proof: the receipt with the signatures of
        `RECEIPTS_NEEDED` other members and one more (a referee verifies each one it
        reads: a round of 256 would otherwise cost it 256 verifications)."""
        others = sorted(self.signatures.keys() - {prover}, key=PeerID.to_bytes)
        keep = others[: RECEIPTS_NEEDED + 1]
        return ChainProof(self.receipt, {p: self.signatures[p] for p in keep})

    def to_wire(self) -> list[Any]:
        sigs = sorted((p.to_bytes(), s) for p, s in self.signatures.items())
        return [*self.receipt._fields(), [list(pair) for pair in sigs]]

    @classmethod
    def from_wire(cls, obj: object) -> ChainProof:
        """Decode a proof from untrusted input; ReceiptError when malformed or when a
        signature is not a valid one of a member (an honest prover checked each)."""
        if not isinstance(obj, list | tuple) or len(obj) != 7:
            raise ReceiptError("a chain proof is a list of 7")
        experiment, round_index, round_id, start, members, digests, sigs = obj
        if not isinstance(members, list | tuple) or not 0 < len(members) <= MAX_MEMBERS:
            raise ReceiptError("bad members")
        if not isinstance(digests, list | tuple) or not isinstance(sigs, list | tuple):
            raise ReceiptError("bad digests or signatures")
        if len(sigs) > len(members):
            raise ReceiptError("more signatures than members")
        peers = tuple(_peer(m) for m in members)
        receipt = Receipt(experiment, round_index, round_id, start, peers, tuple(digests))
        proof = cls(receipt)
        for item in sigs:
            if not (isinstance(item, list | tuple) and len(item) == 2):
                raise ReceiptError("bad signature entry")
            if not proof.add(_peer(item[0]), item[1]):
                raise ReceiptError("a signature that is no member's valid one, or repeated")
        return proof


def _peer(obj: object) -> PeerID:
    if not isinstance(obj, bytes) or not 0 < len(obj) <= MAX_PEER_ID_BYTES:
        raise ReceiptError("bad peer ID")
    try:
        return PeerID(obj)
    except ValueError as e:
        raise ReceiptError(f"bad peer ID: {e}") from None
