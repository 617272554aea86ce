"""Protocol 2.11's commitments and lane headers: a commitment may bind its checkpoints
by one hash and travel without them (a reveal brings them to the referee who needs
them), and a lane header to a part owner of 2.11 leaves out what every member of the
round knows, and, in an owner-written round, its Merkle proofs. What a member receives
is still checked against what the prover signed: a list other than the one committed
to, or a commitment of another round, experiment or prover, is refused."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from types import SimpleNamespace

import pytest

from shoal.averaging.attestation import ReceivedCommitments, RoundAttestation, global_chunks
from shoal.averaging.group import Group, Member, make_round_id
from shoal.averaging.partition import Plan
from shoal.peer.verify.reveals import Reveal, RevealError, with_revealed_checkpoints
from shoal.peer.verify.verifier import Verifier
from shoal.transport.identity import Identity, PeerID
from shoal.transport.version import Hello, ProtocolVersion
from shoal.verification.commitment import (
    Commitment,
    CommitmentError,
    MerkleTree,
    leaf_hash,
)

pytestmark = pytest.mark.timeout(30)


def h(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


PROVER = Identity.from_seed(h("prover"))
OTHER = Identity.from_seed(h("other"))


def commitment(
    segments: int = 7, *, prover: Identity = PROVER, round_index: int = 12, delta_root: bytes = b""
) -> Commitment:
    return Commitment(
        "an-experiment", prover.peer_id, round_index, h("start"), h("optimizer"), 40,
        2 * segments, 2, tuple(h(f"checkpoint {i}") for i in range(segments)),
        delta_root or h("delta"), 9, h("previous"), h("seed"), residual=(h("r0"), h("r1")),
    )  # fmt: skip


def test_a_commitment_that_binds_its_checkpoints_by_hash_travels_without_them() -> None:
    listed = commitment().signed(PROVER)
    compact = commitment().compact().signed(PROVER)
    received = Commitment.decode(compact.encode())
    assert not received.checkpoints_known
    assert received.digest() == compact.digest() != listed.digest()
    # Its size does not grow with the inner run's segments (but for the step count's
    # own bytes); the listed form's does.
    long = commitment(segments=70)
    assert len(long.compact().signed(PROVER).encode()) <= len(compact.encode()) + 2
    assert len(long.signed(PROVER).encode()) > len(listed.encode()) + 60 * 32


def test_the_revealed_checkpoints_complete_it_only_when_they_are_the_ones_committed_to() -> None:
    received = Commitment.decode(commitment().compact().signed(PROVER).encode())
    checkpoints = commitment().checkpoints
    whole = received.with_checkpoints(checkpoints)
    assert whole.checkpoints == checkpoints and whole.verifies()
    assert whole.digest() == received.digest()
    assert whole.segment_start(3) == checkpoints[2]
    for wrong in (checkpoints[::-1], checkpoints[:-1], (*checkpoints[:-1], h("forged"))):
        with pytest.raises(CommitmentError):
            received.with_checkpoints(wrong)


def test_a_referee_takes_the_checkpoints_from_the_reveal_and_refuses_a_reveal_without() -> None:
    received = Commitment.decode(commitment().compact().signed(PROVER).encode())

    def reveal(checkpoints: tuple[bytes, ...] | None) -> Reveal:
        return Reveal(None, None, h("end optimizer"), checkpoints=checkpoints)

    whole = with_revealed_checkpoints(received, reveal(commitment().checkpoints))
    assert whole.checkpoints_known
    with pytest.raises(RevealError, match="no checkpoints"):
        with_revealed_checkpoints(received, reveal(None))
    with pytest.raises(RevealError, match="not those committed to"):
        with_revealed_checkpoints(received, reveal(commitment().checkpoints[::-1]))
    # A commitment that lists them (a prover before 2.11) needs none from the reveal.
    listed = commitment().signed(PROVER)
    assert with_revealed_checkpoints(listed, reveal(None)) is listed


def test_a_compact_commitment_whose_hash_is_malformed_is_refused() -> None:
    with pytest.raises(CommitmentError, match="32 bytes"):
        Commitment(**{**commitment().__dict__, "checkpoint_hash": b"short"})
    with pytest.raises(CommitmentError, match="not those committed to"):
        Commitment(**{**commitment().compact().__dict__, "checkpoints": (h("x"),) * 7})


@pytest.mark.parametrize("form", ["listed", "compact"])
def test_a_lane_header_leaves_out_what_the_members_know_and_checks_it_on_arrival(
    form: str,
) -> None:
    c = commitment() if form == "listed" else commitment().compact()
    signed = c.signed(PROVER)
    known = signed.encode_known()
    assert len(known) < len(signed.encode()) - len("an-experiment")
    again = Commitment.decode_known(known, "an-experiment", PROVER.peer_id, 12)
    assert again.digest() == signed.digest() and again.verifies()
    # The owner puts back what its round says: another round, experiment or prover
    # than the one signed does not verify.
    for experiment, prover, round_index in (
        ("an-experiment", PROVER.peer_id, 13),
        ("another", PROVER.peer_id, 12),
        ("an-experiment", OTHER.peer_id, 12),
    ):
        with pytest.raises(CommitmentError, match="signature"):
            Commitment.decode_known(known, experiment, prover, round_index)


class Attestor:
    def __init__(self) -> None:
        self.accepted: list[Commitment] = []

    def commit(self, group: Group, delta_root: bytes, parts: int, weight: float) -> Commitment:
        raise AssertionError("not in these tests")

    def accept(self, group: Group, commitment: Commitment, weight: float) -> str | None:
        self.accepted.append(commitment)
        return None

    def on_commit(self, group: Group, commitments: Mapping[PeerID, Commitment]) -> None:
        pass

    def round_fields(self, group: Group) -> tuple[str, int]:
        return "an-experiment", 12


def _round(owner_written: bool) -> tuple[Group, Plan, RoundAttestation]:
    members = tuple(Member(i.peer_id, (), 1.0) for i in (PROVER, OTHER))
    group = Group("t", make_round_id("t", [m.peer_id for m in members], os.urandom(16)), members)
    plan = Plan.build(4096, [1.0, 1.0], streams=1, chunk_elements=512)
    leaves = [leaf_hash(b"chunk %d" % i) for i in range(len(global_chunks(plan)))]
    root = MerkleTree(leaves).root
    c = Commitment(
        "an-experiment", PROVER.peer_id, 12, h("start"), h("optimizer"), 0, 4, 2,
        (h("a"), h("b")), root, len(leaves), b"", h("seed"),
    ).compact().signed(PROVER)  # fmt: skip
    return group, plan, RoundAttestation(plan, c, MerkleTree(leaves))


@pytest.mark.parametrize("owner_written", [False, True])
def test_an_owner_of_2_11_is_sent_the_compact_header_and_an_older_one_the_whole(
    owner_written: bool,
) -> None:
    group, plan, attestation = _round(owner_written)
    older = attestation.header(1, 0)
    newer = attestation.header(1, 0, compact=True, owner_written=owner_written)
    assert set(older) == {"c", "m"} and len(older["m"]) == len(plan.chunks(plan.lanes(1)[0]))
    assert set(newer) == ({"k"} if owner_written else {"k", "m"})
    for header in (older, newer):
        attestor = Attestor()
        owner = ReceivedCommitments(attestor, group, plan, 1, owner_written=owner_written)
        assert owner.attach(0, 0, header, 1.0) is None
        assert owner.by_member[PROVER.peer_id].digest() == attestation.commitment.digest()


def test_a_round_that_sends_chunks_still_needs_their_proofs() -> None:
    group, plan, attestation = _round(owner_written=False)
    header = attestation.header(1, 0, compact=True)
    del header["m"]
    owner = ReceivedCommitments(Attestor(), group, plan, 1)
    assert owner.attach(0, 0, header, 1.0) == "malformed Merkle proofs"


def test_a_compact_header_from_another_member_than_its_prover_is_refused() -> None:
    group, plan, attestation = _round(owner_written=True)
    header = attestation.header(1, 0, compact=True, owner_written=True)
    owner = ReceivedCommitments(Attestor(), group, plan, 0, owner_written=True)
    problem = owner.attach(1, 0, header, 1.0)  # (member 1 sends member 0's commitment)
    assert problem is not None and "signature" in problem


def test_a_prover_binds_its_checkpoints_by_hash_only_when_every_member_reads_that() -> None:
    """An older member could neither read such a commitment nor check a conviction
    holding one; a member whose hello has not come yet counts as older."""
    members = [Identity.from_seed(h(f"member {i}")).peer_id for i in range(3)]
    group = Group("t", b"r" * 32, tuple(Member(p, (), 1.0) for p in members))
    said: dict[PeerID, Hello | None] = {}
    verifier = SimpleNamespace(me=members[0], dht=SimpleNamespace(host=SimpleNamespace(
        versions=SimpleNamespace(peer_version=said.get))))  # fmt: skip
    all_compact = Verifier._all_compact
    said.update({members[1]: Hello(), members[2]: Hello()})
    assert all_compact(verifier, group)  # type: ignore[arg-type]
    said[members[2]] = Hello(ProtocolVersion(2, 10))
    assert not all_compact(verifier, group)  # type: ignore[arg-type]
    del said[members[2]]
    assert not all_compact(verifier, group)  # type: ignore[arg-type]
