"""A round of members that committed and revealed their secrets, for the
verification tests: commitments, verdicts, disputes and convictions."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from shoal.averaging.group import Group, Member, make_round_id
from shoal.peer.training.task import Task, shard_of
from shoal.peer.verify.audit_round import AuditRound, RoundShape
from shoal.peer.verify.segments import SegmentRunner, round_batch_seed
from shoal.peer.verify.verifier import audit_round_of
from shoal.peer.verify.work_log import RoundWork, VerifiedWork, WorkLog
from shoal.transport.identity import Identity, PeerID
from shoal.verification.commitment import Commitment, MerkleTree, leaf_hash
from shoal.verification.disputes import Dispute, Outcome
from shoal.verification.evidence import Evidence, Result, Verdict
from shoal.verification.referees import RoundDraw, new_secret, seed_commit

EXPERIMENT = "exp"


def h(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def identities(n: int, salt: str = "") -> list[Identity]:
    return [Identity.from_seed(h(f"{salt}peer{i}")) for i in range(n)]


def commit(
    me: Identity,
    secret: bytes,
    *,
    rnd: int = 7,
    steps: int = 6,
    every: int = 2,
    start: bytes = h("global"),
) -> Commitment:
    segments = -(-steps // every)
    return Commitment(
        EXPERIMENT,
        me.peer_id,
        rnd,
        start=start,
        optimizer=h(f"opt {me.peer_id}"),
        first_step=100,
        steps=steps,
        every=every,
        checkpoints=tuple(h(f"{me.peer_id} ckpt {i}") for i in range(segments)),
        delta_root=MerkleTree([leaf_hash(b"part a"), leaf_hash(b"part b")]).root,
        parts=2,
        previous=b"",
        seed_commit=seed_commit(secret),
    ).signed(me)


class Round:
    """One round of `n` members that committed and revealed their secrets."""

    def __init__(
        self, n: int, *, rnd: int = 7, salt: str = "", also: tuple[Identity, ...] = ()
    ) -> None:
        """`n` members made from seeds (`salt` varies them), plus the identities `also`."""
        self.ids = identities(n, salt) + list(also)
        self.by_peer = {i.peer_id: i for i in self.ids}
        self.secrets = {i.peer_id: new_secret() for i in self.ids}
        self.commitments = [commit(i, self.secrets[i.peer_id], rnd=rnd) for i in self.ids]
        self.draw = RoundDraw.from_reveals(self.commitments, self.secrets)

    def of(self, peer: PeerID) -> Commitment:
        return next(c for c in self.commitments if c.prover == peer)

    def verdict(self, referee: PeerID, c: Commitment, result: Result) -> Verdict:
        segment = self.draw.segment(c.prover, c.segments)
        return Verdict(referee, c.digest(), segment, h("revealed"), result).signed(
            self.by_peer[referee]
        )

    def dispute(self, prover: PeerID, results: list[Result]) -> Dispute:
        c = self.of(prover)
        dispute = Dispute(c, self.draw)
        for referee, result in zip(dispute.referees, results, strict=False):
            if dispute.outcome is not Outcome.OPEN:
                break
            dispute.add(self.verdict(referee, c, result))
        return dispute


def conviction(r: Round, prover: PeerID | None = None) -> Evidence:
    """A checked conviction of `prover` (default: the first member) by two referees."""
    d = r.dispute(prover or r.ids[0].peer_id, [Result.FAIL, Result.FAIL])
    assert d.outcome is Outcome.CONVICTED
    return d.evidence(r.commitments, r.secrets)


def audited_round(
    log: WorkLog,
    work: RoundWork,
    me: Identity,
    final: Sequence[torch.Tensor],
    *,
    namespace: str,
    shards: int,
) -> tuple[Commitment, VerifiedWork, AuditRound]:
    """`me` alone committed `work` of `log` (which ended at the parameters `final`):
    its commitment, its verified work as a prover replays it, and the round as its
    referees see it (`me` drew itself)."""
    group = Group("k", make_round_id("k", [me.peer_id], b"n"), (Member(me.peer_id),))
    shape = RoundShape.of(group, 1, 4096, "none")
    start = log.state_at(work, 0)
    assert start is not None
    final_flat = torch.cat([p.detach().reshape(-1) for p in final])
    secret = new_secret()
    c = Commitment(
        namespace, me.peer_id, work.round, work.start_params, work.start_optimizer,
        work.first_step, work.steps, log.every, work.commit_checkpoints(),
        shape.delta_root(start.flat() - final_flat), 1, b"", seed_commit(secret),
    ).signed(me)  # fmt: skip
    shard = shard_of(me.peer_id.to_bytes(), shards)
    verified = VerifiedWork(log, namespace, me.peer_id, shard, lambda: work.round)
    draw = RoundDraw.from_reveals([c], {me.peer_id: secret})
    rnd = audit_round_of(work.round, group, (1, 4096, "none"), {me.peer_id: c},
                         {me.peer_id: secret}, draw, log, 0.0)  # fmt: skip
    assert rnd is not None
    return c, verified, rnd


def proved_round(
    task: Task,
    hyper: dict[str, Any],
    me: Identity,
    *,
    namespace: str,
    shards: int,
    every: int,
    round_index: int,
    steps: int,
    steps_before: int = 0,
    quantize: bool = False,
) -> tuple[RoundWork, VerifiedWork, Commitment, AuditRound, SegmentRunner]:
    """`me` trains `steps` inner steps of a verified round on its own batches, hashed
    every `every`, and commits alone (`audited_round`); `steps_before` steps first (on
    other batches: moments carried into the round), then the optimizer's state rounded
    to codes as a round of `inner_state` "quantize" starts (`quantize`)."""
    log = WorkLog(every)
    runner = SegmentRunner(task, hyper)
    model, inner = runner.model, runner.inner
    first = 40
    earlier = task.batches(0, shards, 99)
    for i in range(steps_before):
        batch = next(earlier)
        inner.step(lambda b=batch: task.loss(model, b), first - steps_before + i)
    if quantize:
        inner.quantize_state()
    seed = round_batch_seed(namespace, me.peer_id, round_index)
    batches = task.batches(shard_of(me.peer_id.to_bytes(), shards), shards, seed)
    log.begin(round_index, first, model, inner)
    for i in range(steps):
        batch = next(batches)
        inner.step(lambda b=batch: task.loss(model, b), first + i)
        log.after_step(model, inner, int(task.batch_tokens(batch)))
    work = log.seal(model, inner)
    c, verified, rnd = audited_round(log, work, me, list(model.parameters()),
                                     namespace=namespace, shards=shards)  # fmt: skip
    return work, verified, c, rnd, runner
