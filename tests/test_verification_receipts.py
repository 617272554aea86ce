"""Receipts (verification/receipts.py, peer/verify/receipt_book.py): the members of a
verified sparse round sign what commitments they received, so that a prover proves
the previous commitment its error feedback chains to with their signatures, never
with its own word or with a record it wrote itself in the DHT. The liars: a prover
that shows receipts listing another commitment, of another round, or with a
signature it made up; a peer that hands out a signature of another receipt."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch
from waiting import eventually

from shoal.averaging.error_feedback import ErrorFeedback, residual_digest
from shoal.averaging.sparse_codec import SparseCodec
from shoal.peer.verify.receipt_book import ReceiptBook
from shoal.peer.verify.sparse_work import SparseProver, SparseWork, check_chain, unproven_chain
from shoal.peer.verify.withholding import DirectRecords, push_or_store
from shoal.transport import rpc
from shoal.transport.errors import RemoteError
from shoal.transport.identity import Identity
from shoal.transport.version import Hello, ProtocolVersion
from shoal.verification.commitment import Commitment
from shoal.verification.receipts import ChainProof, Receipt, ReceiptError

pytestmark = pytest.mark.timeout(60)

H = [hashlib.sha256(bytes([i])).digest() for i in range(8)]
ZERO = H[0]  # (stands for the hash of a zero residual)
PEERS = [Identity.from_seed(hashlib.sha256(b"member %d" % i).digest()) for i in range(4)]
PROVER = PEERS[0]


def commitment(
    prover: Identity = PROVER, round_index: int = 6, start: bytes = H[1], residual: bytes = H[2]
) -> Commitment:
    return Commitment(
        "exp", prover.peer_id, round_index, start, H[1], 0, 3, 3, (H[1],), H[1], 1, b"",
        H[3], residual=(H[4], residual),
    ).signed(prover)  # fmt: skip


def receipt_of(round_commitments: list[Commitment], round_id: bytes = b"r6") -> Receipt:
    c0 = round_commitments[0]
    members = [p.peer_id for p in PEERS]
    by_peer = {c.prover: c for c in round_commitments}
    return Receipt.of_round("exp", c0.round, round_id, c0.start, members, by_peer)


def signed_by(receipt: Receipt, signers: list[Identity]) -> ChainProof:
    proof = ChainProof(receipt)
    for s in signers:
        assert proof.add(s.peer_id, receipt.sign(s))
    return proof


def next_commitment(previous: Commitment, start_residual: bytes) -> Commitment:
    """The prover's commitment of the next round, chained to `previous`."""
    fields = {**previous.__dict__, "round": previous.round + 1, "signature": b"",
              "previous": previous.digest(), "residual": (start_residual, H[5])}  # fmt: skip
    return Commitment(**fields).signed(PROVER)


def test_a_chain_is_proven_by_two_other_members_receipts() -> None:
    sent = commitment()
    others = [commitment(p) for p in PEERS[1:]]
    proof = signed_by(receipt_of([sent, *others]), PEERS[:2])
    assert not proof.proves(sent)  # the prover's own signature and one other: short
    assert proof.vouchers(PROVER.peer_id) == 1
    assert proof.add(PEERS[2].peer_id, proof.receipt.sign(PEERS[2]))
    assert proof.proves(sent) and proof.lie(sent) is None
    # Carried in a reveal and read back, it proves the same.
    back = ChainProof.from_wire(msgpack.unpackb(msgpack.packb(proof.to_wire())))
    assert back.proves(sent) and back.signatures == proof.signatures
    # What a prover shows: enough others' signatures and one more, not every member's.
    assert proof.add(PEERS[3].peer_id, proof.receipt.sign(PEERS[3]))
    shown = proof.shown(PROVER.peer_id)
    assert len(shown.signatures) == 3 and PROVER.peer_id not in shown.signatures
    assert shown.proves(sent)
    # In a round of two, the other member's receipt is all there is.
    pair = Receipt.of_round("exp", 6, b"r", H[1], [PROVER.peer_id, PEERS[1].peer_id],
                            {PROVER.peer_id: sent})  # fmt: skip
    assert signed_by(pair, [PEERS[1]]).proves(sent)


def test_receipts_that_list_another_commitment_prove_the_chain_a_lie() -> None:
    """A prover that signed a second previous commitment (choosing its residual) can
    only show the receipts of the one it sent: they name another digest."""
    sent = commitment()
    forged = commitment(residual=H[6])
    proof = signed_by(receipt_of([sent]), PEERS[1:3])
    assert proof.lie(forged) == "the previous commitment revealed is not the one its round received"
    later = next_commitment(forged, H[6])
    why = check_chain(later, forged.encode(), 10, proof=proof)
    assert why is not None and "its round received" in why
    assert check_chain(next_commitment(sent, H[2]), sent.encode(), 10, proof=proof) is None


def test_receipts_of_another_round_or_lineage_prove_nothing() -> None:
    """Two rounds of one commit count (a peer that re-synced onto another lineage
    commits that count again) are told apart by the state their work started from."""
    sent = commitment()
    elsewhere = commitment(start=H[7])
    proof = signed_by(receipt_of([elsewhere]), PEERS[1:3])
    assert proof.lie(sent) is not None and "another round" in proof.lie(sent)  # type: ignore[operator]
    earlier = signed_by(receipt_of([commitment(round_index=5)]), PEERS[1:3])
    assert earlier.lie(sent) is not None


def test_a_signature_a_prover_made_up_spoils_the_whole_proof() -> None:
    receipt = receipt_of([commitment()])
    wire = signed_by(receipt, PEERS[1:3]).to_wire()
    outsider = Identity.generate()
    for bad in (
        [*wire[:-1], [*wire[-1], [outsider.peer_id.to_bytes(), receipt.sign(outsider)]]],
        [*wire[:-1], [[PEERS[3].peer_id.to_bytes(), receipt.sign(PEERS[2])]]],
        [*wire[:-1], [wire[-1][0], wire[-1][0]]],  # one member twice
        [*wire[:-1], [[p.peer_id.to_bytes(), b"x" * 64] for p in PEERS] * 2],
        wire[:-1],
        [*wire[:5], [b"\x01" * 32] * 4, wire[-1]],  # digests of another length
        [*wire[:3], b"short", *wire[4:]],
    ):
        with pytest.raises(ReceiptError):
            ChainProof.from_wire(bad)


def test_what_needs_a_proof_and_what_does_not() -> None:
    """A residual that starts at zero needs none (a join, a re-sync), nor one a referee
    holds its own copy of; otherwise no proof, or too few signatures, is no verdict
    (the others may have crashed before they handed out their receipts), while a proof
    that lies is left to `check_chain` (a finding)."""
    sent = commitment()
    later = next_commitment(sent, H[2])
    enough = signed_by(receipt_of([sent]), PEERS[1:3])
    short = signed_by(receipt_of([sent]), PEERS[:2])
    lying = signed_by(receipt_of([commitment(residual=H[6])]), PEERS[1:3])
    chain = sent.encode()
    assert unproven_chain(later, chain, enough, False, ZERO) is None
    assert unproven_chain(later, chain, None, False, ZERO) == (
        "no receipts of the previous commitment's round"
    )
    assert unproven_chain(later, chain, short, False, ZERO) == (
        "1 other members vouch for the previous commitment, 2 needed"
    )
    assert unproven_chain(later, chain, lying, False, ZERO) is None  # (a lie: a finding)
    assert unproven_chain(later, chain, None, True, ZERO) is None  # the referee's own copy
    assert unproven_chain(next_commitment(sent, ZERO), chain, None, False, ZERO) is None
    assert unproven_chain(later, b"", None, False, ZERO) is None  # (check_chain refuses it)


async def test_members_hand_each_other_their_receipts(make_host: Callable[..., Any]) -> None:
    """Each member keeps the valid signatures of its own receipt of the round, even one
    that arrives before it made its receipt; a member whose view of the round differs
    (another commitment received from someone) signs a receipt that is not kept."""
    hosts = [await make_host() for _ in range(4)]
    ids = [h.identity for h in hosts]
    books = [ReceiptBook(rpc.RpcService(h, "/test/receipts"), h.identity, 4, 60.0) for h in hosts]
    for h in hosts[1:]:
        await h.connect(hosts[0].peer_id, hosts[0].addresses())
    for a in hosts[1:]:
        for b in hosts[1:]:
            if a is not b:
                await a.connect(b.peer_id, b.addresses())
    commitments = {i.peer_id: commitment(i) for i in ids}
    members = [i.peer_id for i in ids]
    receipt = Receipt.of_round("exp", 6, b"r6", H[1], members, commitments)
    other_view = Receipt.of_round(
        "exp",
        6,
        b"r6",
        H[1],
        members,
        {**commitments, ids[2].peer_id: commitment(ids[2], residual=H[6])},
    )
    proofs = [books[i].sign(receipt) for i in (0, 1)]
    proofs.append(books[2].sign(other_view))  # (it saw another commitment of its own)
    for book, proof in zip(books[:3], proofs, strict=True):
        await book.hand_out(hosts[books.index(book)], proof)
    late = books[3]  # hands out after it got the others' signatures: they were held
    proofs.append(late.sign(receipt))
    await late.hand_out(hosts[3], proofs[3])

    def everyone_has_the_others() -> bool:
        return all(len(p.signatures) == 3 for i, p in enumerate(proofs) if i != 2)

    await eventually(everyone_has_the_others, "the matching members' signatures", timeout=10)
    assert set(proofs[0].signatures) == {members[0], members[1], members[3]}
    assert set(proofs[2].signatures) == {members[2]}  # nobody shares its view
    assert books[0].proof(6) is proofs[0] and books[0].proof(5) is None


def test_a_restarted_prover_still_proves_its_chain_from_its_checkpoint() -> None:
    """The receipts live in memory; the error feedback's checkpoint keeps those of its
    chain, so a peer restarted mid-run is not left without proof (and shunned)."""
    sent = commitment()
    proof = signed_by(receipt_of([sent]), PEERS[1:3])
    codec = SparseCodec.from_density("topk", 64, 0.0625, 2)

    def running(proofs: Callable[[int], ChainProof | None]) -> tuple[SparseProver, ErrorFeedback]:
        feedback = ErrorFeedback(codec, 256)
        source = SimpleNamespace(feedback=feedback, gather=None,
                                 own_slot=lambda _round_id, _me: (0, 4, b"slot"))  # fmt: skip
        return SparseProver(source, 2, 300.0, proofs=proofs), feedback  # type: ignore[arg-type]

    def reveal_of_next_round(p: SparseProver) -> SparseWork:
        mine = SimpleNamespace(residual=(H[2], H[5]), encode=lambda: b"next", start=b"g")
        p.committed(7, SimpleNamespace(round_id=b"r7"), PROVER.peer_id, mine)  # type: ignore[arg-type]
        kept = p.kept(7)
        assert kept is not None
        return kept

    before, feedback = running({6: proof}.get)
    feedback.chain = sent.encode()
    assert reveal_of_next_round(before).proof is proof
    checkpoint = feedback.state_dict()

    after, restored = running(lambda _round: None)  # (a new process: no receipts)
    restored.load_state_dict(checkpoint)
    shown = reveal_of_next_round(after).proof
    assert shown is not None and shown.proves(sent) and shown.signatures == proof.signatures
    # A checkpoint's proof of another chain (or none) proves nothing.
    restored.chain = commitment(residual=H[6]).encode()
    assert reveal_of_next_round(after).proof is None


def test_an_honest_prover_drops_a_residual_nobody_vouches_for_before_coding_a_round() -> None:
    """The members of the round that left our residual crashed before they handed out
    their receipts: rather than show an unproven chain (a referee would leave us out),
    the next round starts from a zero residual, which needs no proof."""
    sent = commitment()
    codec = SparseCodec.from_density("topk", 64, 0.0625, 2)
    for proof, kept in ((signed_by(receipt_of([sent]), PEERS[1:3]), True),
                        (signed_by(receipt_of([sent]), PEERS[:2]), False),
                        (None, False)):  # fmt: skip
        feedback = ErrorFeedback(codec, 256)
        source = SimpleNamespace(feedback=feedback, gather=None, own_slot=lambda *_: None)
        prover = SparseProver(source, 2, 300.0, proofs={6: proof}.get)  # type: ignore[arg-type]
        feedback.residual.fill_(0.5)
        feedback.chain = sent.encode()
        feedback.compress(torch.zeros(256))
        start = feedback.claims()[0]
        assert (start != residual_digest(torch.zeros(256))) == kept
        assert (feedback.chain == sent.encode()) == kept
        assert prover.unvouched == (0 if kept else 1)


async def test_a_receipt_rides_on_the_push_of_the_secret_and_an_older_member_is_handed_it(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protocol 2.11: our signature of the round's receipt goes with the push of our
    secret to each member whose hello says 2.11 (one call each, not two); a member
    whose hello is older is pushed the secret alone and handed the receipt on its
    own. A malformed receipt on a push is refused with the push."""
    hosts = [await make_host() for _ in range(3)]
    for a in hosts:
        for b in hosts:
            if a is not b:
                await a.connect(b.peer_id, b.addresses())
    services = [rpc.RpcService(h, "/test/receipts") for h in hosts]
    books = [ReceiptBook(s, h.identity, 4, 60.0) for s, h in zip(services, hosts, strict=True)]
    records = [DirectRecords(s) for s in services]
    for r, book in zip(records, books, strict=True):
        r.take_receipt = book.take
    ids = [h.identity for h in hosts]
    members = [i.peer_id for i in ids]
    commitments = {i.peer_id: commitment(i) for i in ids}
    receipt = Receipt.of_round("exp", 6, b"r6", H[1], members, commitments)
    proofs = [book.sign(receipt) for book in books]
    old = members[2]
    said = hosts[0].versions.peer_version
    monkeypatch.setattr(hosts[0].versions, "peer_version", lambda p: (
        Hello(ProtocolVersion(2, 10)) if p == old else said(p)))  # fmt: skip
    calls: list[tuple[Any, str]] = []
    real_call = rpc.call

    async def call(host: Any, peer: Any, protocol: str, method: str, *a: Any, **kw: Any) -> Any:
        calls.append((peer, method))
        return await real_call(host, peer, protocol, method, *a, **kw)

    monkeypatch.setattr(rpc, "call", call)
    handed = asyncio.Event()

    def hand_out(peers: list[Any]) -> None:
        async def run() -> None:
            await books[0].hand_out(hosts[0], proofs[0], peers)
            handed.set()

        tasks.append(asyncio.ensure_future(run()))

    tasks: list[asyncio.Task[None]] = []
    mine = commitments[members[0]]  # (of round 6, as the receipt)
    gathered = asyncio.Event()
    gathered.set()
    stored = await push_or_store(
        records[0], None, "exp", mine, bytes(32), members[1:], gathered,  # type: ignore[arg-type]
        every=1.0, within=1.0, receipt=books[0].wire(proofs[0]), hand_out=hand_out,
    )  # fmt: skip
    assert not stored  # (every member took the push)
    await asyncio.wait_for(handed.wait(), 10)
    assert sorted(calls, key=str) == sorted(
        [(members[1], "push"), (old, "push"), (old, "receipt")], key=str
    )
    assert all(members[0] in p.signatures for p in proofs[1:])
    # A push whose receipt is malformed is refused whole.
    bad = {"round": 6, "start": H[1], "record": b"x", "receipt": [b"r6", b"short"]}
    with pytest.raises(RemoteError, match="bad signature"):
        await real_call(hosts[0], members[1], "/test/receipts", "push", bad, timeout=5)
