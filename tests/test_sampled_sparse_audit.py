"""Audits of sparse rounds by chunks (`codec_audit` "chunks", the default of a new
verified sparse experiment): a member commits to its residual as a Merkle root over
the codec's chunks, and the audit of its last segment takes the values the message
kept and a few chunks of the residual the referee draws, not the whole residual.

The message must be the coding of the kept values (its centroid table and codes
follow from them); each drawn chunk must be a leaf of the committed residual, give
the message's indices and kept values there bit for bit, and leave a leaf of the
residual committed for after the round. The liars: a prover that bends its whole
message (sign-flipped, as `tests/flipper` does), claims kept values its message
does not code, reveals another chunk than it committed to, or claims another
residual after the round; and one that lies in a single chunk, caught when that
chunk is drawn."""

from __future__ import annotations

import dataclasses
import hashlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_sparse_audit import CHUNK_ELEMENTS, CODEC, LOOPBACK, ME, _slot, _slot_root, audit
from test_work_log import NS, SHARDS, reveal, setup  # the verified round's scaffolding

from shoal.averaging.diloco_options import DiLoCoOptions
from shoal.averaging.error_feedback import (
    ErrorFeedback,
    residual_digest,
    residual_leaves,
    zero_digest,
)
from shoal.averaging.sparse_round import sparse_shape
from shoal.peer.verify.audit_round import AuditRound, RoundShape
from shoal.peer.verify.referee import SAMPLED_CHUNKS, Referee
from shoal.peer.verify.reveals import PROTOCOL, send_reveal
from shoal.peer.verify.segments import SegmentRunner, flat_difference
from shoal.peer.verify.sparse_work import SparseWork
from shoal.transport import rpc
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.verification.audit import AuditPolicy
from shoal.verification.commitment import Commitment, MerkleTree
from shoal.verification.evidence import Result

pytestmark = pytest.mark.timeout(120)

LEAF = CODEC.chunk


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    from shoal.peer.training.task import load_task

    return load_task("bytegpt", {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16,
                                 "batch_size": 2})  # fmt: skip


def sampled_round(task, sample: list[int] | None = None, decay: float = 0.9, **lies: Any):  # type: ignore[no-untyped-def]
    """A verified sparse round audited by chunks (or one with `lies`): the commitment,
    the round as referees see it, and each segment's reveal, the last one showing the
    kept values and the chunks `sample` (None: the first, a middle and the last)."""
    hyper, work, verified, c, rnd = setup(task)
    start = rnd.start_params if isinstance(rnd.start_params, list) else rnd.start_params()
    final = reveal(task, hyper, work, verified, c, c.segments - 1).end_params
    n = sum(p.numel() for p in start)
    count = CODEC.chunks(n)
    residual = torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-3
    previous = Commitment(**{**c.__dict__, "round": c.round - 1, "signature": b"",
                             "residual": (hashlib.sha256(b"s").digest(),
                                          residual_digest(residual, LEAF))}).signed(ME)  # fmt: skip
    delta = flat_difference(start, final)
    feedback = ErrorFeedback(CODEC, n, decay=decay, leaf=LEAF)
    feedback.residual.copy_(residual)
    if lies.get("flip"):  # (trained honestly, sends the negated update: `tests/flipper`)
        feedback.residual.neg_()
        delta = -delta
    if "bent_chunk" in lies:  # (one chunk's update replaced by its negation)
        first, length, _ = CODEC.chunk_span(lies["bent_chunk"], n)
        delta[first : first + length].neg_()
        feedback.residual[first : first + length].neg_()
    message = feedback.compress(delta)
    root_start, root_after = feedback.claims()
    leaves = feedback.claimed_leaves
    assert leaves is not None and feedback.kept is not None
    if lies.get("flip") or "bent_chunk" in lies:  # (it must commit to what it started from)
        root_start = residual_digest(residual, LEAF)
        leaves = (residual_leaves(residual, LEAF), leaves[1])
    slot = _slot(lies.get("message", message), n)
    sparse_c = Commitment(**{
        **c.__dict__, "delta_root": _slot_root(slot, n), "previous": previous.digest(),
        "signature": b"", "residual": (root_start, lies.get("next_claim", root_after)),
    }).signed(ME)  # fmt: skip
    shape = RoundShape((1.0, 1.0), 1, CHUNK_ELEMENTS, sparse_shape(CODEC, decay, chunks=True))
    sparse_rnd = AuditRound(**{**rnd.__dict__, "shape": shape})
    kept = lies.get("kept", feedback.kept)
    shown = SparseWork(previous.encode(), (0, 2, slot), residual, kept=kept, leaves=leaves)
    drawn = sample if sample is not None else [0, count // 2, count - 1]
    reveals = []
    for segment in range(c.segments):
        r = reveal(task, hyper, work, verified, c, segment)
        r.chain = previous.encode()
        if segment == c.segments - 1:
            r.slot, r.kept, r.samples = shown.slot, kept, shown.sampled(drawn, LEAF)
            if "altered_chunk" in lies:
                r.samples[0].residual[0] += 1e-3
        reveals.append(r)
    return hyper, sparse_c, sparse_rnd, reveals


def _last(task, hyper, c, rnd, reveals):  # type: ignore[no-untyped-def]
    return audit(task, hyper, rnd, c, len(reveals) - 1, reveals[-1])


def test_an_honest_round_passes_every_segment_s_audit_from_a_few_chunks(task) -> None:  # type: ignore[no-untyped-def]
    hyper, c, rnd, reveals = sampled_round(task)
    for segment, r in enumerate(reveals):
        finding = audit(task, hyper, rnd, c, segment, r)
        assert finding.result is Result.PASS, (segment, finding)
    last = reveals[-1]
    assert last.residual is None and last.samples is not None and len(last.samples) == 3
    n = last.kept.numel() if last.kept is not None else 0
    assert n == CODEC.kept(sum(p.numel() for p in last.start.params))  # type: ignore[union-attr]


def test_every_chunk_drawn_passes_for_an_honest_prover(task) -> None:  # type: ignore[no-untyped-def]
    """The chunk-by-chunk arithmetic gives the whole vector's bits in every chunk, the
    shorter tail included, with and without a decaying feedback."""
    n = sum(p.numel() for p in task.make_model(0).parameters())
    assert n % LEAF, "the model must leave a tail chunk for this test"
    for decay in (1.0, 0.9):
        hyper, c, rnd, reveals = sampled_round(task, list(range(CODEC.chunks(n))), decay=decay)
        assert _last(task, hyper, c, rnd, reveals).result is Result.PASS


def test_a_sign_flipped_message_is_caught_in_any_chunk_drawn(task) -> None:  # type: ignore[no-untyped-def]
    """Its kept values are the ones its message codes (it coded the negated update
    honestly), so only the drawn chunks, re-derived from the committed residual and
    the run, show it: every chunk does."""
    for sample in ([0], [5], [1, 7]):
        hyper, c, rnd, reveals = sampled_round(task, sample, flip=True)
        finding = _last(task, hyper, c, rnd, reveals)
        assert finding.result is Result.FAIL, (sample, finding)
        assert "not the run's" in finding.why, finding


def test_kept_values_the_message_does_not_code_are_caught(task) -> None:  # type: ignore[no-untyped-def]
    """A prover that shows honest-looking kept values beside a bent message (say, its
    centroid table scaled) fails on the message alone, whichever chunks are drawn."""
    hyper, c, rnd, reveals = sampled_round(task)
    kept = reveals[-1].kept
    assert kept is not None
    hyper, c, rnd, reveals = sampled_round(task, kept=kept * 2)
    finding = _last(task, hyper, c, rnd, reveals)
    assert finding.result is Result.FAIL and "coding of the kept values" in finding.why, finding


def test_a_chunk_other_than_the_committed_one_is_caught(task) -> None:  # type: ignore[no-untyped-def]
    hyper, c, rnd, reveals = sampled_round(task, altered_chunk=True)
    finding = _last(task, hyper, c, rnd, reveals)
    assert finding.result is Result.FAIL and "chunk revealed" in finding.why, finding


def test_a_residual_after_the_round_other_than_the_run_leaves_is_caught(task) -> None:  # type: ignore[no-untyped-def]
    hyper, c, rnd, reveals = sampled_round(task, next_claim=hashlib.sha256(b"x").digest())
    finding = _last(task, hyper, c, rnd, reveals)
    assert finding.result is Result.FAIL and "leaves" in finding.why, finding


def test_a_lie_in_one_chunk_is_caught_when_that_chunk_is_drawn(task) -> None:  # type: ignore[no-untyped-def]
    """Sampling is what makes the reveal small: a lie confined to chunk 3 passes an
    audit that draws other chunks, and fails the one that draws it (the referee
    draws after the commitment, so a liar cannot know which)."""
    hyper, c, rnd, reveals = sampled_round(task, [0, 1, 2], bent_chunk=3)
    assert _last(task, hyper, c, rnd, reveals).result is Result.PASS
    hyper, c, rnd, reveals = sampled_round(task, [2, 3], bent_chunk=3)
    finding = _last(task, hyper, c, rnd, reveals)
    assert finding.result is Result.FAIL and "not the run's" in finding.why, finding


def test_a_last_reveal_without_its_chunks_is_malformed(task) -> None:  # type: ignore[no-untyped-def]
    hyper, c, rnd, reveals = sampled_round(task)
    for part in ("kept", "samples"):
        r = dataclasses.replace(reveals[-1], **{part: None})
        finding = audit(task, hyper, rnd, c, len(reveals) - 1, r)
        assert finding.result is Result.BAD_REVEAL, (part, finding)
    whole = dataclasses.replace(reveals[-1], kept=None, samples=None,
                                residual=torch.zeros(reveals[-1].kept.numel()))  # type: ignore[union-attr]  # fmt: skip
    assert audit(task, hyper, rnd, c, len(reveals) - 1, whole).result is Result.BAD_REVEAL


def test_a_zero_residual_s_root_is_what_a_newcomer_commits_to() -> None:
    for n in (1, LEAF, 3 * LEAF + 5):
        assert zero_digest(n, LEAF) == residual_digest(torch.zeros(n), LEAF)
        assert zero_digest(n) == residual_digest(torch.zeros(n))
    assert zero_digest(LEAF, LEAF) != zero_digest(LEAF)


def test_a_new_verified_sparse_experiment_is_audited_by_chunks() -> None:
    """New verified sparse experiments get `codec_audit` chunks; an unverified or dense
    one, or a manifest without the key (an experiment hosted before it), keeps whole."""

    def new(**options: Any) -> dict[str, Any]:
        return DiLoCoOptions.parse(DiLoCoOptions.for_new_experiment(options)).to_dict()

    assert new(codec="topk", verify=True)["codec_audit"] == "chunks"
    assert "codec_audit" not in new(codec="topk", verify=False)
    assert "codec_audit" not in new(codec="int8", verify=True)
    assert (
        new(codec="topk", verify=True, codec_audit="whole").get("codec_audit", "whole") == "whole"
    )
    assert DiLoCoOptions.parse({"codec": "topk"}).codec_audit == "whole"
    with pytest.raises(ValueError, match="codec_audit"):
        DiLoCoOptions.parse({"codec": "topk", "codec_audit": "some"})


async def test_a_referee_draws_chunks_over_the_wire_and_a_prover_must_show_those(task) -> None:  # type: ignore[no-untyped-def]
    """The referee asks for the last segment with the chunks it drew; the prover shows
    those with their proofs and is acquitted from the kept values and a few chunks
    (a reveal far smaller than the residual). Showing other chunks than the ones
    drawn is a malformed reveal: a prover must not pick where it is checked."""
    hyper, c, rnd, reveals = sampled_round(task)
    rnd.commitments = {ME.peer_id: c}
    last = c.segments - 1
    draw = rnd.draw  # (the last segment drawn: the one whose audit takes chunks)
    rnd.draw = SimpleNamespace(segment=lambda _p, _n: last, lsh_seed=draw.lsh_seed,
                               referees=draw.referees)  # type: ignore[assignment]  # fmt: skip
    shown = reveals[-1]
    assert shown.samples is not None and shown.slot is not None and shown.kept is not None
    work = SparseWork(b"", shown.slot, rnd_residual(task), kept=shown.kept,
                      leaves=leaves_of(task, c))  # fmt: skip
    asked: list[list[int]] = []
    shift = [0]
    prover = Host(ME, HostConfig(listen=LOOPBACK))
    asker = Host(Identity.generate(), HostConfig(listen=LOOPBACK))
    await prover.start()
    await asker.start()
    try:
        service = rpc.RpcService(prover, PROTOCOL)

        @service.stream("reveal")
        async def serve(ctx: Any, payload: Any) -> Any:
            chunks = [(i + shift[0]) % CODEC.chunks(work.residual.numel())
                      for i in payload["sample"]]  # fmt: skip
            asked.append(payload["sample"])
            r = dataclasses.replace(reveals[payload["segment"]],
                                    samples=work.sampled(sorted(chunks), LEAF))  # fmt: skip
            await send_reveal(ctx, r)
            yield {"done": True}

        await asker.connect(prover.peer_id, prover.addresses())
        ref = Referee(
            SimpleNamespace(host=asker), Identity.generate(), task=task, num_shards=SHARDS,
            namespace=NS, policy=AuditPolicy(), runner=SegmentRunner(task, hyper), pool=None,
            bans=None, retain_s=3600.0, shun=lambda _p, _r: 30.0,
        )  # type: ignore[arg-type]  # fmt: skip
        ref._unproven = _no_question  # type: ignore[method-assign]  # (chains: test_sparse_audit)
        verdict = await ref.audit(rnd, ME.peer_id)
        assert verdict is not None and verdict.result is Result.PASS, verdict
        assert len(asked[0]) == min(SAMPLED_CHUNKS, CODEC.chunks(work.residual.numel()))
        shift[0] = 1
        verdict = await ref.audit(rnd, ME.peer_id)
        assert verdict is not None and verdict.result is Result.BAD_REVEAL
    finally:
        await asker.aclose()
        await prover.aclose()


async def _no_question(*_args: Any) -> None:
    return None


def rnd_residual(task) -> torch.Tensor:  # type: ignore[no-untyped-def]
    n = sum(p.numel() for p in task.make_model(0).parameters())
    return torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-3


def leaves_of(task, c: Commitment) -> tuple[list[bytes], list[bytes]]:  # type: ignore[no-untyped-def]
    """The leaves `sampled_round`'s honest prover committed to (rebuilt: its run)."""
    hyper, work, verified, c0, rnd = setup(task)
    start = rnd.start_params if isinstance(rnd.start_params, list) else rnd.start_params()
    final = reveal(task, hyper, work, verified, c0, c0.segments - 1).end_params
    feedback = ErrorFeedback(CODEC, rnd_residual(task).numel(), decay=0.9, leaf=LEAF)
    feedback.residual.copy_(rnd_residual(task))
    feedback.compress(flat_difference(start, final))
    feedback.claims()
    assert feedback.claimed_leaves is not None
    assert MerkleTree(feedback.claimed_leaves[0]).root == c.residual[0]  # type: ignore[index]
    return feedback.claimed_leaves
