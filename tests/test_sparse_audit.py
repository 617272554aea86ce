"""Audits of sparse rounds: a member commits to its error feedback (the residual it
started from, the one a commit leaves, chained to its previous commitment) and to
its slot; every audit checks the chain, and the audit of the last segment re-derives
exactly the message the run gives and the residual it leaves. The liars: a prover
that picks its residual, reveals another one, sends another message than its run
gives, or claims another residual after the round."""

from __future__ import annotations

import dataclasses
import hashlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_work_log import NS, SHARDS, reveal, setup  # the verified round's scaffolding

from shoal.averaging.attestation import chunk_leaves
from shoal.averaging.compression import get_codec
from shoal.averaging.error_feedback import ErrorFeedback, residual_digest
from shoal.averaging.partition import Plan
from shoal.averaging.sparse_codec import SparseCodec
from shoal.averaging.sparse_gather import SparseGather
from shoal.averaging.sparse_round import parse_sparse_shape, sparse_shape
from shoal.peer.verify.audit_round import (
    AuditRound,
    EndNeeded,
    RoundShape,
    check_segment,
    check_segment_exact,
)
from shoal.peer.verify.referee import Referee
from shoal.peer.verify.reveals import PROTOCOL, Reveal, send_reveal
from shoal.peer.verify.segments import SegmentRunner, flat_difference
from shoal.transport import rpc
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.verification.audit import AuditPolicy
from shoal.verification.commitment import Commitment, MerkleTree, residual_chains
from shoal.verification.evidence import Result
from shoal.verification.receipts import ChainProof, Receipt

pytestmark = pytest.mark.timeout(120)

CODEC = SparseCodec.from_density("topk", 64, 0.0625, 2)
CHUNK_ELEMENTS = 256
ME = Identity.from_seed(hashlib.sha256(b"prover").digest())  # (test_work_log's prover)
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    from shoal.peer.training.task import load_task

    return load_task("bytegpt", {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16,
                                 "batch_size": 2})  # fmt: skip


def _slot_root(slot: bytes, n: int, members: int = 2, index: int = 0) -> bytes:
    buffer = SparseGather(CODEC, n).buffer_with(members, index, slot)
    plan = Plan.build(buffer.numel(), [1.0] * members, streams=1, chunk_elements=CHUNK_ELEMENTS)
    return MerkleTree(chunk_leaves(plan, buffer, get_codec("none"))).root


def _slot(message: bytes, n: int) -> bytes:
    gather = SparseGather(CODEC, n)
    buffer = torch.zeros(gather.words(2))
    gather.fill(buffer, b"round", 0, 1.0, message, ME.sign)
    return buffer.view(torch.uint8)[: gather.slot_words * 4].numpy().tobytes()


def sparse_round(task, residual_scale: float = 1e-3, decay: float = 1.0, **lies: Any):  # type: ignore[no-untyped-def]
    """An honest verified sparse round (or one with `lies`) of an experiment whose error
    feedback keeps `decay`: the commitment, the round as referees see it, and each
    segment's reveal."""
    hyper, work, verified, c, rnd = setup(task)
    start = rnd.start_params if isinstance(rnd.start_params, list) else rnd.start_params()
    final = reveal(task, hyper, work, verified, c, c.segments - 1).end_params
    n = sum(p.numel() for p in start)
    residual = torch.randn(n, generator=torch.Generator().manual_seed(5)) * residual_scale
    previous = Commitment(**{**c.__dict__, "round": c.round - 1, "signature": b"",
                             "residual": (hashlib.sha256(b"s").digest(),
                                          residual_digest(residual))}).signed(ME)  # fmt: skip
    feedback = ErrorFeedback(CODEC, n, decay=lies.get("prover_decay", decay))
    feedback.residual.copy_(lies.get("picked_residual", residual))
    message = feedback.compress(lies.get("delta", flat_difference(start, final)))
    claims = feedback.claims()
    slot = _slot(lies.get("message", message), n)
    sparse_c = Commitment(**{
        **c.__dict__, "delta_root": _slot_root(slot, n), "previous": previous.digest(),
        "signature": b"", "residual": (claims[0], lies.get("next_claim", claims[1])),
    }).signed(ME)  # fmt: skip
    shape = RoundShape((1.0, 1.0), 1, CHUNK_ELEMENTS, sparse_shape(CODEC, decay))
    sparse_rnd = AuditRound(**{**rnd.__dict__, "shape": shape})
    reveals = []
    for segment in range(c.segments):
        r = reveal(task, hyper, work, verified, c, segment)
        r.chain = previous.encode()
        if segment == c.segments - 1:
            r.slot = (0, 2, slot)
            r.residual = lies.get("revealed_residual", feedback.residual if
                                  "picked_residual" in lies else residual)  # fmt: skip
        reveals.append(r)
    return hyper, sparse_c, sparse_rnd, reveals


def _elements(task) -> int:  # type: ignore[no-untyped-def]
    return sum(p.numel() for p in task.make_model(0).parameters())


def audit(task, hyper, rnd, c, segment, r: Reveal):  # type: ignore[no-untyped-def]
    return check_segment(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, segment, r,
                         b"seed", AuditPolicy())  # fmt: skip


def test_an_honest_sparse_round_passes_every_segment_s_audit(task) -> None:  # type: ignore[no-untyped-def]
    hyper, c, rnd, reveals = sparse_round(task)
    for segment, r in enumerate(reveals):
        finding = audit(task, hyper, rnd, c, segment, r)
        assert finding.result is Result.PASS, (segment, finding)


def test_a_message_other_than_the_run_s_is_caught_by_the_last_segment_s_audit(task) -> None:  # type: ignore[no-untyped-def]
    """The prover trained honestly and sent something else (its slot is what it
    committed to, and what everyone applied): only the last segment's audit sees it."""
    n = _elements(task)
    other = CODEC.encode(torch.randn(n, generator=torch.Generator().manual_seed(9)))
    hyper, c, rnd, reveals = sparse_round(task, message=other)
    last = len(reveals) - 1
    finding = audit(task, hyper, rnd, c, last, reveals[last])
    assert finding.result is Result.FAIL and "message sent" in finding.why, finding
    assert all(audit(task, hyper, rnd, c, s, reveals[s]).result is Result.PASS
               for s in range(last))  # fmt: skip


def test_a_decaying_feedback_s_message_is_re_derived_with_the_experiment_s_decay(task) -> None:  # type: ignore[no-untyped-def]
    """With `codec_feedback_decay`, the message codes decay * residual + delta: an
    honest prover passes, and one that keeps its whole residual (sending more of
    its past than the experiment lets it) is caught where the message is checked."""
    hyper, c, rnd, reveals = sparse_round(task, residual_scale=1.0, decay=0.9)
    last = len(reveals) - 1
    assert rnd.shape.codec == f"sparse:{CODEC.name}@0.9"
    assert audit(task, hyper, rnd, c, last, reveals[last]).result is Result.PASS
    hyper, c, rnd, reveals = sparse_round(task, residual_scale=1.0, decay=0.9, prover_decay=1.0)
    finding = audit(task, hyper, rnd, c, last, reveals[last])
    assert finding.result is Result.FAIL and "message sent" in finding.why, finding


def test_a_sparse_round_s_audits_without_the_end_revealed_find_the_same(task) -> None:  # type: ignore[no-untyped-def]
    """A 2.5 referee hashes its re-run's end instead of reading the prover's: an honest
    round passes every segment bit for bit, and the last segment's audit re-derives the
    message from the re-run's end, so a message other than the run's fails as before."""
    n = _elements(task)
    other = CODEC.encode(torch.randn(n, generator=torch.Generator().manual_seed(9)))
    for message, last_result in ((None, Result.PASS), (other, Result.FAIL)):
        lies = {} if message is None else {"message": message}
        hyper, c, rnd, reveals = sparse_round(task, **lies)
        for segment, r in enumerate(reveals):
            r.end_params = None
            finding = check_segment_exact(SegmentRunner(task, hyper), task, SHARDS, NS, rnd,
                                          c, segment, r)  # fmt: skip
            last = segment == len(reveals) - 1
            assert not isinstance(finding, EndNeeded)
            assert finding.result is (last_result if last else Result.PASS), (segment, finding)


def test_a_sparse_shape_names_its_codec_decay_and_audit() -> None:
    assert parse_sparse_shape(sparse_shape(CODEC, 1.0)) == (CODEC, 1.0, False)
    assert sparse_shape(CODEC, 1.0) == "sparse:" + CODEC.name  # as before decays existed
    assert parse_sparse_shape(sparse_shape(CODEC, 0.95)) == (CODEC, 0.95, False)
    assert sparse_shape(CODEC, 0.9, chunks=True) == f"sparse:{CODEC.name}@0.9/chunks"
    assert parse_sparse_shape(sparse_shape(CODEC, 0.9, chunks=True)) == (CODEC, 0.9, True)
    with pytest.raises(ValueError):
        parse_sparse_shape("int8")


def test_a_picked_residual_breaks_the_chain_at_every_audit(task) -> None:  # type: ignore[no-untyped-def]
    """The residual is the prover's free variable unless it follows from the previous
    round: one picked to send what the prover wants (residual = wanted - delta, the
    message then coded honestly from it) is not what the previous round left."""
    picked = torch.randn(_elements(task), generator=torch.Generator().manual_seed(11))
    hyper, c, rnd, reveals = sparse_round(task, picked_residual=picked)
    for segment, r in enumerate(reveals):
        finding = audit(task, hyper, rnd, c, segment, r)
        assert finding.result is Result.FAIL and "previous round left" in finding.why, finding


def test_a_previous_commitment_its_round_never_received_breaks_the_chain(task) -> None:  # type: ignore[no-untyped-def]
    """A prover can sign a previous commitment it never sent, chaining to a residual it
    picked: a referee that was in the previous round knows the one it sent."""
    hyper, c, rnd, reveals = sparse_round(task)
    assert reveals[0].chain is not None
    revealed = Commitment.decode(reveals[0].chain)
    sent = dataclasses.replace(revealed, seed_commit=hashlib.sha256(b"sent").digest())
    sent = sent.signed(ME)
    finding = check_segment(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, 0, reveals[0],
                            b"seed", AuditPolicy(), anchor=sent.digest())  # fmt: skip
    assert finding.result is Result.FAIL and "its round received" in finding.why, finding
    honest = check_segment(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, 0, reveals[0],
                           b"seed", AuditPolicy(), anchor=revealed.digest())  # fmt: skip
    assert honest.result is Result.PASS, honest


def test_a_revealed_residual_other_than_the_committed_one_fails(task) -> None:  # type: ignore[no-untyped-def]
    hyper, c, rnd, reveals = sparse_round(task)
    last = len(reveals) - 1
    r = reveals[last]
    assert r.residual is not None
    r.residual = r.residual + 1e-3
    finding = audit(task, hyper, rnd, c, last, r)
    assert finding.result is Result.FAIL and "residual revealed" in finding.why, finding


def test_a_residual_after_the_round_other_than_the_run_leaves_fails(task) -> None:  # type: ignore[no-untyped-def]
    hyper, c, rnd, reveals = sparse_round(task, next_claim=hashlib.sha256(b"x").digest())
    last = len(reveals) - 1
    finding = audit(task, hyper, rnd, c, last, reveals[last])
    assert finding.result is Result.FAIL and "leaves" in finding.why, finding


def test_a_reveal_of_a_sparse_round_without_its_chain_or_what_was_sent_is_malformed(task) -> None:  # type: ignore[no-untyped-def]
    hyper, c, rnd, reveals = sparse_round(task)
    last = len(reveals) - 1
    no_chain = dataclasses.replace(reveals[0], chain=None)
    assert audit(task, hyper, rnd, c, 0, no_chain).result is Result.BAD_REVEAL
    unsent = dataclasses.replace(reveals[last], slot=None)
    assert audit(task, hyper, rnd, c, last, unsent).result is Result.BAD_REVEAL
    other_chain = dataclasses.replace(reveals[0], chain=Commitment(**{
        **c.__dict__, "round": 1, "signature": b""}).signed(ME).encode())  # fmt: skip
    finding = audit(task, hyper, rnd, c, 0, other_chain)
    assert finding.result is Result.FAIL and "not the one named" in finding.why


def test_the_chain_rules() -> None:
    """A round starts from what the previous commitment's round left: after its commit
    or, had it not applied our message, at its start; a zero residual always (a join,
    a re-sync); nothing else, and nothing without a previous commitment."""
    h = [hashlib.sha256(bytes([i])).digest() for i in range(5)]
    zero = h[0]
    base = dict(experiment="e", prover=ME.peer_id, round=3, start=h[1], optimizer=h[1],
                first_step=0, steps=3, every=3, checkpoints=(h[1],), delta_root=h[1],
                parts=1, previous=b"", seed_commit=h[1])  # fmt: skip

    def made(start: bytes, after: bytes, round_index: int = 3) -> Commitment:
        fields = {**base, "round": round_index}
        return Commitment(**fields, residual=(start, after))  # type: ignore[arg-type]

    previous = made(h[2], h[3], round_index=2)
    assert residual_chains(made(h[3], h[4]), previous, zero) is None  # after its commit
    assert residual_chains(made(h[2], h[4]), previous, zero) is None  # it did not apply it
    assert residual_chains(made(zero, h[4]), None, zero) is None  # a fresh start
    assert residual_chains(made(h[4], h[4]), previous, zero) is not None
    assert residual_chains(made(h[3], h[4]), None, zero) is not None
    assert residual_chains(Commitment(**base), previous, zero) is not None  # type: ignore[arg-type]
    # A peer that missed the previous round the swarm committed re-synced: zero only.
    older = made(h[2], h[3], round_index=1)
    assert residual_chains(made(h[3], h[4]), older, zero) is not None


def test_a_sparse_commitment_round_trips_and_a_dense_one_is_unchanged() -> None:
    h = hashlib.sha256(b"h").digest()
    base = Commitment("e", ME.peer_id, 3, h, h, 0, 3, 3, (h,), h, 1, b"", h)
    dense = base.signed(ME)
    assert Commitment.decode(dense.encode()) == dense and dense.residual is None
    sparse = dataclasses.replace(base, residual=(h, h)).signed(ME)
    again = Commitment.decode(sparse.encode())
    assert again.residual == (h, h) and again.digest() == sparse.digest() != dense.digest()
    with pytest.raises(ValueError):
        dataclasses.replace(base, residual=(h,))  # type: ignore[arg-type]


async def test_a_chain_nobody_vouches_for_is_no_verdict_and_a_made_up_receipt_is_caught(
    task,  # type: ignore[no-untyped-def]
) -> None:
    """Over the wire, as a referee that was not in the previous round meets them: a
    reveal without the receipts of its chain's round, or with too few of them, gives
    no verdict and leaves the prover out for a while (its round's other members may
    have crashed before they handed out their receipts); receipts with a signature the
    prover made up are a malformed reveal, which accuses it."""
    hyper, c, rnd, reveals = sparse_round(task)
    rnd.commitments = {ME.peer_id: c}
    assert reveals[0].chain is not None
    previous = Commitment.decode(reveals[0].chain)
    others = [Identity.from_seed(hashlib.sha256(b"other %d" % i).digest()) for i in (1, 2)]
    receipt = Receipt.of_round(NS, previous.round, b"round", previous.start,
                               [ME.peer_id, *(o.peer_id for o in others)],
                               {ME.peer_id: previous})  # fmt: skip
    short = ChainProof(receipt)
    assert short.add(ME.peer_id, receipt.sign(ME)) and short.add(
        others[0].peer_id, receipt.sign(others[0])
    )
    made_up = ChainProof(receipt, {o.peer_id: receipt.sign(ME) for o in others})
    shown: list[ChainProof | None] = [None]
    prover = Host(ME, HostConfig(listen=LOOPBACK))
    asker = Host(Identity.generate(), HostConfig(listen=LOOPBACK))
    await prover.start()
    await asker.start()
    try:
        service = rpc.RpcService(prover, PROTOCOL)

        @service.stream("reveal")
        async def serve(ctx: Any, payload: Any) -> Any:
            revealed = dataclasses.replace(reveals[payload["segment"]], proof=shown[0])
            await send_reveal(ctx, revealed)
            yield {"done": True}

        await asker.connect(prover.peer_id, prover.addresses())
        shunned: list[int] = []
        ref = Referee(
            SimpleNamespace(host=asker), Identity.generate(), task=task, num_shards=SHARDS,
            namespace=NS, policy=AuditPolicy(), runner=SegmentRunner(task, hyper), pool=None,
            bans=None, retain_s=3600.0, shun=lambda _p, r: shunned.append(r) or 30.0,
        )  # type: ignore[arg-type]  # fmt: skip
        assert await ref.audit(rnd, ME.peer_id) is None  # no receipts at all
        shown[0] = short
        assert await ref.audit(rnd, ME.peer_id) is None  # one other member vouches
        assert shunned == [rnd.round, rnd.round] and ref.counts["chains_unproven"] == 2
        shown[0] = made_up
        verdict = await ref.audit(rnd, ME.peer_id)
        assert verdict is not None and verdict.result is Result.BAD_REVEAL
    finally:
        await asker.aclose()
        await prover.aclose()
