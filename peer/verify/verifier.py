"""Verification in the daemon: commit to our work, audit others', convict cheaters.

`Verifier` is the `averaging.attestation.Attestor` of a verified experiment:
- `commit`: our signed commitment for the round's contribution (the work log
  sealed, a fresh secret behind `seed_commit`);
- `accept`: a member's commitment must name this experiment and round, start
  from the same global state as ours, use the experiment's checkpoint spacing,
  and carry no more weight than its steps can;
- `on_commit`: after the round, publish our secret, gather everyone's, draw,
  and run the audits this peer was drawn for; of a sparse round, sign our
  receipt of the commitments we received and hand it to the members
  (`receipt_book`: what a chain of error feedback is proven with).

The audits themselves are the `referee`'s; the verifier serves the RPCs of a
round: `reveal` (our work, to its referees), `verdict` (a referee's, to the
auditor who accused) and `convicted` (evidence of our own conviction). New
peers are audited at the probation rate for their first `PROBATION_ROUNDS`
rounds in our sight.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shoal.averaging.attestation import COMPACT_HEADERS_PROTOCOL
from shoal.averaging.group import Group
from shoal.dht.node import DHTNode
from shoal.transport import rpc
from shoal.transport.identity import Identity, PeerID
from shoal.transport.tasks import TaskSet
from shoal.verification.audit import AuditPolicy
from shoal.verification.commitment import Commitment
from shoal.verification.evidence import Evidence, Verdict
from shoal.verification.receipts import ChainProof, Receipt, ReceiptError
from shoal.verification.referees import RoundDraw, new_secret, seed_commit

from ..training.inner import InnerOptimizer
from ..training.priority import lower_this_thread
from ..training.state_codes import CodedState, code_state
from ..training.task import Task
from .audit_round import (
    GATHER_REPLICAS,
    AuditRound,
    RecentRounds,
    RoundShape,
    gather,
)
from .ban_watch import BanWatcher
from .receipt_book import ReceiptBook
from .referee import LATE_SECRETS_TIMEOUT, Referee
from .reveals import (
    MAX_SAMPLED,
    PROTOCOL,
    Replay,
    Reveal,
    reveal_of,
    send_reveal,
    send_reveal_end,
)
from .segments import SegmentRunner
from .shunning import Shunning
from .sparse_work import SparseProver, SparseSource, SparseWork
from .withholding import DirectRecords, push_or_store, recheck_withheld
from .work_log import RoundWork, VerifiedWork, WorkLog

__all__ = ["PROBATION_ROUNDS", "Verifier"]

log = logging.getLogger("shoal.verifier")

PROBATION_ROUNDS = 10  # rounds a new peer is audited at the probation rate
GATHER_TIMEOUT = 30.0  # how long secrets are awaited after a commit
PUBLISH_AGAIN_S = 5.0  # our round record is stored again this often while we gather
WITHHELD_RECHECK_S = 20.0  # a member's missing secret is looked for once more after this
KEEP_ROUNDS = 4  # rounds answerable however old (and all of the last `retain_s`)
MAX_REVEALS = 2  # per round and referee (one retry)


class Verifier:
    """A verified experiment's commitments, audits and disputes on this peer."""

    def __init__(
        self,
        dht: DHTNode,
        identity: Identity,
        *,
        task: Task,
        hyper: dict[str, Any],
        policy: AuditPolicy,
        work: VerifiedWork,
        model: torch.nn.Module,
        inner: InnerOptimizer,
        bans: BanWatcher,
        shape: tuple[int, int, str],  # the all-reduce's streams, chunk bytes, codec
        precision: str = "fp32",
        shun: Callable[[PeerID, float], None] | None = None,
        runner: SegmentRunner | None = None,
    ) -> None:
        """`shun(peer, seconds)`: leave a peer out of our rounds for a while (one that
        withheld its secret or did not reveal; how long is `shunning`'s). `runner`: the
        model audits re-run steps on (default: built here; a caller on the event loop
        builds it in a thread, `SegmentRunner(task, hyper, precision=...)`: building a
        model of real size takes seconds)."""
        self.dht = dht
        self.identity = identity
        self.me = identity.peer_id
        self.task = task
        self.num_shards = int(hyper["num_shards"])
        self.policy = policy
        self.work = work
        self.namespace = work.experiment
        self._model, self._inner = model, inner
        self.bans = bans
        self._shape = shape
        # Audits and reveals re-run steps on a model of their own, one at a time,
        # below the training thread's priority.
        self.runner = runner or SegmentRunner(task, hyper, precision=precision)
        self._pool = ThreadPoolExecutor(1, "shoal-audit", initializer=lower_this_thread)
        self.referee = Referee(
            dht, identity, task=task, num_shards=self.num_shards, namespace=self.namespace,
            policy=policy, runner=self.runner, pool=self._pool, bans=bans,
            retain_s=work.log.retain_s, shun=self._shun_for, known=self._received_digest,
        )  # fmt: skip
        self._secrets: dict[int, bytes] = {}
        self._previous = b""  # our last commitment's digest (the chain)
        self._rounds: RecentRounds[asyncio.Future[AuditRound | None]] = RecentRounds(
            KEEP_ROUNDS, work.log.retain_s
        )
        self._seen: Counter[PeerID] = Counter()  # committed rounds per peer, in our sight
        self._tasks = TaskSet(log, "verifier")
        self.withheld = 0
        self.records_stored = 0  # rounds whose record went into the DHT (a push failed)
        self.ignored_accusations = 0
        self._shun = shun
        self.shunning = Shunning()
        # What one round may cost us, whoever asks: one verdict per (round, prover),
        # re-used for every asker, and at most two reveals per (round, referee).
        # (Keyed by round, commitment or start, and peer: an index may be ours twice.)
        self._verdicts: dict[tuple[int, bytes, PeerID], asyncio.Future[Verdict | None]] = {}
        self._revealed: Counter[tuple[int, bytes, PeerID]] = Counter()
        self._service = rpc.RpcService(dht.host, PROTOCOL)
        self._service.stream("reveal")(self._on_reveal)
        self._service.unary("verdict")(self._on_verdict)
        self._service.unary("convicted")(self._on_convicted)
        self.records = DirectRecords(self._service)
        self.receipts = ReceiptBook(self._service, identity, KEEP_ROUNDS, work.log.retain_s)
        self.records.take_receipt = self.receipts.take  # (2.11: receipts ride on pushes)
        self.sparse: SparseProver | None = None  # (`attach_sparse`)

    def close(self) -> None:
        self._service.close()
        self._tasks.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ Attestor

    def attach_sparse(self, source: SparseSource) -> None:
        """Our rounds are sparse: commit to the error feedback too, and keep what we
        sent to reveal it (`sparse_work`)."""
        log_ = self.work.log
        spill = log_.spill_path
        self.sparse = SparseProver(
            source,
            KEEP_ROUNDS,
            log_.retain_s,
            spill_dir=None if spill is None else spill.with_name(spill.name + "-residuals"),
            # With AdamW a round's states are 2 or more of (parameters, 2 moments):
            # its residual, one model size, is at most a sixth of them, so a quarter
            # of the states' budget keeps the residual of every round whose states
            # are kept (with a moment-free inner optimizer, of about half of them).
            retain_bytes=log_.retain_bytes // 4,
            proofs=self.receipts.proof,
        )

    def commit(self, group: Group, delta_root: bytes, parts: int, weight: float) -> Commitment:
        """(In a thread, while the trainer waits for the round.)"""
        work = self.work.log.seal(self._model, self._inner)
        secret = new_secret()
        self._secrets[work.round] = secret
        previous, residual = self._previous, None
        if self.sparse is not None:  # (the chain our residual came from)
            previous, residual = self.sparse.commitment_fields()
        commitment = Commitment(
            self.namespace, self.me, work.round, work.start_params, work.start_optimizer,
            work.first_step, work.steps, work.every, work.commit_checkpoints(), delta_root,
            parts, previous, seed_commit(secret), residual=residual,
        )  # fmt: skip
        if self._all_compact(group):  # (its checkpoints by one hash: protocol 2.11)
            commitment = commitment.compact()
        commitment = commitment.signed(self.identity)
        if self.sparse is not None:
            self.sparse.committed(work.round, group, self.me, commitment)
        return commitment

    def _all_compact(self, group: Group) -> bool:
        """Whether every other member of `group` reads commitments that bind their
        checkpoints by a hash (protocol 2.11; its referees and convicting peers are
        among them). A member whose hello we have not read counts as older."""
        versions = self.dht.host.versions
        for peer in group.peer_ids:
            if peer == self.me:
                continue
            hello = versions.peer_version(peer)
            if hello is None or hello.protocol < COMPACT_HEADERS_PROTOCOL:
                return False
        return True

    def round_fields(self, group: Group) -> tuple[str, int]:
        return self.namespace, self.work.round_of()

    def accept(self, group: Group, commitment: Commitment, weight: float) -> str | None:
        c = commitment
        version = self.work.round_of()
        if c.experiment != self.namespace or c.round != version:
            return f"a commitment for {c.experiment} round {c.round}, not round {version}"
        # (Without work from the state we hold now, right after a re-sync or during the
        # catch-up round that follows it, we cannot check the start: the members that
        # did work check it. Our last run started from a state we no longer hold.)
        work = self.work.current()
        if work is not None and c.start != work.start_params:
            return "work started from another global state"
        if c.every != self.policy.segment_steps:
            return f"checkpoints every {c.every} steps, not {self.policy.segment_steps}"
        if (c.residual is None) != (self.sparse is None):
            return "a sparse round's commitment without its residual, or a dense one with"
        last = self.work.log.current  # (any round's: what one step of our batches carries)
        if last is not None and last.tokens_per_step and weight > c.steps * last.tokens_per_step:
            return f"weight {weight:.0f} is more than {c.steps} steps can carry"
        return None

    def on_commit(self, group: Group, commitments: Mapping[PeerID, Commitment]) -> None:
        mine = commitments.get(self.me)
        if mine is None:
            return  # we contributed nothing (weight 0): nothing to reveal, not drawn
        self._previous = mine.digest()
        receipt = None
        if self.sparse is not None and group.size > 1:
            receipt = self._sign_receipt(group, commitments, mine)
        for peer in commitments:
            self._seen[peer] += 1
        future: asyncio.Future[AuditRound | None] = asyncio.get_running_loop().create_future()
        self._rounds.add(mine.round, future, tag=mine.start)
        oldest = self._rounds.oldest() or 0
        self._verdicts = {k: v for k, v in self._verdicts.items() if k[0] >= oldest}
        self._revealed = Counter({k: v for k, v in self._revealed.items() if k[0] >= oldest})
        self._spawn(self._after_round(group, dict(commitments), mine, future, time.monotonic(),
                                      receipt))  # fmt: skip

    def _sign_receipt(
        self, group: Group, commitments: Mapping[PeerID, Commitment], mine: Commitment
    ) -> ChainProof | None:
        """Sign our receipt of the round's commitments as they came to us (first hand):
        what proves the chains of their residuals. It goes to the members with our
        secret (`_publish`)."""
        try:
            receipt = Receipt.of_round(
                self.namespace, mine.round, group.round_id, mine.start, group.peer_ids,
                commitments,
            )  # fmt: skip
        except ReceiptError as e:  # (a group outside a receipt's bounds: none then)
            log.warning("round %d: no receipt: %s", mine.round, e)
            return None
        return self.receipts.sign(receipt)

    def _received_digest(self, previous: Commitment) -> bytes | None:
        """The digest of the commitment of `previous`'s prover as it came to us in
        `previous`'s round, if we committed that round (our receipt of it), else None.
        (The round's commitments gathered from the DHT would not do: a prover writes
        its own record, whenever it likes.)"""
        proof = self.receipts.proof(previous.round)
        if proof is None or not proof.receipt.lists(previous):
            return None  # (not that round: another lineage's round of that commit count)
        return proof.receipt.digest_of(previous.prover) or None

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        """A task of ours: cancelled by `close`."""
        return self._tasks.spawn(coro)

    # ------------------------------------------------------------------ after a round

    async def _after_round(
        self,
        group: Group,
        commitments: dict[PeerID, Commitment],
        mine: Commitment,
        future: asyncio.Future[AuditRound | None],
        committed_at: float,
        receipt: ChainProof | None = None,
    ) -> None:
        try:
            rnd = await self._gather(group, commitments, mine, committed_at, receipt)
        except Exception as e:
            log.warning("round %d: gathering the members' secrets failed: %r", mine.round, e)
            rnd = None
        if not future.done():
            future.set_result(rnd)
        if rnd is None:
            return
        drawn = [
            p
            for p in rnd.draw.members
            if p != self.me
            and rnd.draw.audited(p, self._rate(p))
            and rnd.draw.referees(p)[:1] == (self.me,)
        ]
        for prover in drawn:
            await self.referee.audit_as_auditor(rnd, prover)

    async def _gather(
        self,
        group: Group,
        commitments: dict[PeerID, Commitment],
        mine: Commitment,
        committed_at: float,
        receipt: ChainProof | None = None,
    ) -> AuditRound | None:
        secret = self._secrets.pop(mine.round)
        gathered = asyncio.Event()
        self._spawn(self._publish(group, mine, secret, gathered, receipt))
        try:
            commitments, secrets = await gather(
                self.dht, self.namespace, mine.round, commitments, list(group.peer_ids),
                GATHER_TIMEOUT, {self.me: secret},
                ask=lambda peers: self.records.ask(mine.round, mine.start, peers),
                start=mine.start, sample=GATHER_REPLICAS, pushed=self.records,
            )  # fmt: skip
        finally:
            gathered.set()
        draw = RoundDraw.from_reveals(list(commitments.values()), secrets)
        rnd = audit_round_of(
            mine.round, group, self._shape, commitments, secrets, draw,
            self.work.log, committed_at, mine.start,
        )  # fmt: skip
        missing = draw.withheld - {self.me}
        if missing:
            # Its work cannot be proven wrong to anyone (a draw without every secret
            # convicts nobody), so we stop averaging with it for a while instead.
            self.withheld += len(missing)
            log.info("round %d: %d members withheld their secret: %s", mine.round,
                     len(missing), ", ".join(p.short() for p in missing))  # fmt: skip
            self._spawn(self._shun_withheld(mine, commitments, missing, rnd))
        return rnd

    async def _publish(
        self,
        group: Group,
        mine: Commitment,
        secret: bytes,
        gathered: asyncio.Event,
        receipt: ChainProof | None = None,
    ) -> None:
        """Our secret to the members (and, of a sparse round, our signed receipt of its
        commitments with it: what proves the chains of their residuals)."""
        others = [p for p in group.peer_ids if p != self.me]

        def hand_out(peers: list[PeerID]) -> None:  # (those the pushes did not carry it to)
            assert receipt is not None
            self._spawn(self.receipts.hand_out(self.dht.host, receipt, peers))

        if await push_or_store(
            self.records, self.dht, self.namespace, mine, secret, others, gathered,
            every=PUBLISH_AGAIN_S, within=GATHER_TIMEOUT,
            receipt=None if receipt is None else self.receipts.wire(receipt),
            hand_out=None if receipt is None else hand_out,
        ):  # fmt: skip
            self.records_stored += 1

    async def _shun_withheld(
        self,
        mine: Commitment,
        commitments: dict[PeerID, Commitment],
        missing: frozenset[PeerID],
        rnd: AuditRound | None,
    ) -> None:
        found = await recheck_withheld(
            self.dht, self.namespace, (mine.round, mine.start), commitments, missing,
            self._shun_for, after=WITHHELD_RECHECK_S, timeout=LATE_SECRETS_TIMEOUT,
            records=self.records,
        )  # fmt: skip
        if found and rnd is not None:
            rnd.learn([[p.to_bytes(), s] for p, s in found.items()])

    def _shun_for(self, peer: PeerID, round_index: int) -> float | None:
        """Leave `peer` out of our rounds for its failure of `round_index`; how long,
        or None when that round's failure was counted already."""
        seconds = self.shunning.offend(peer, round_index, time.monotonic())
        if seconds is not None and self._shun is not None:
            self._shun(peer, seconds)
        return seconds

    def _rate(self, peer: PeerID) -> float:
        if self._seen[peer] <= PROBATION_ROUNDS or not self.referee.may_accuse(peer):
            return max(self.policy.rate, self.policy.probation_rate)
        return self.policy.rate

    @property
    def on_probation(self) -> bool:
        """Whether the others still audit us at the probation rate (in our own sight)."""
        return self._seen[self.me] <= PROBATION_ROUNDS

    # ------------------------------------------------------------------ auditing

    # ------------------------------------------------------------------ serving

    async def _round(
        self, round_index: int, member: PeerID, digest: bytes | None
    ) -> AuditRound | None:
        return await round_committed(self._rounds, round_index, member, digest)

    async def _on_reveal(self, ctx: rpc.CallContext, payload: Any) -> Any:
        round_index, segment, final, digest = parse_reveal_request(payload)
        with_end, only_end, with_start = parse_reveal_parts(payload)
        with_moments = parse_reveal_moments(payload)
        sample = parse_reveal_sample(payload)
        # (Against another round's commitment than the asker's, a reveal would read as
        # a lie: an honest peer convicted. A 2.3 referee names none: the last round.)
        rnd = await self._round(round_index, self.me, digest)
        mine = None if rnd is None else rnd.commitments.get(self.me)
        work = None if mine is None else self.work.log.get(round_index, mine.start)
        if rnd is None or mine is None or work is None:
            raise LookupError(f"no work of round {round_index} here")
        rnd.learn(payload.get("secrets"))
        if ctx.peer not in rnd.draw.referees(self.me):
            raise PermissionError("only this round's referees of our work may ask")
        if segment != rnd.draw.segment(self.me, mine.segments):
            raise PermissionError("not the segment drawn")
        # (A referee that could not rebuild our start asks again, for the whole.)
        asked = (round_index, mine.start, ctx.peer, only_end, with_start)
        self._revealed[asked] += 1
        if self._revealed[asked] > MAX_REVEALS:
            raise PermissionError("this referee had our reveal already")
        loop = asyncio.get_running_loop()
        replay = Replay(self.runner, self.task, self.work, self.num_shards)
        if only_end:  # (its re-run did not end in our committed state bit for bit)
            _, step = mine.segment_bounds(segment)
            end = await loop.run_in_executor(self._pool, replay.state_after, work, step)
            await send_reveal_end(ctx, end)
            yield {"done": True}
            return
        sparse = None
        if self.sparse is not None:  # (may read a spilled residual back: off the loop)
            sparse = await loop.run_in_executor(
                self._pool, self.sparse.kept, round_index, mine.start
            )
            if sparse is None:
                raise LookupError(f"no sparse work of round {round_index} here")
        leaf = 0 if self.sparse is None else self.sparse.source.feedback.leaf
        if sample is not None and (sparse is None or sparse.leaves is None
                                   or sample[-1] >= len(sparse.leaves[0])):  # fmt: skip
            raise ValueError("chunks of a residual we did not hash by chunks, or past its end")
        reveal = await loop.run_in_executor(
            self._pool, reveal_segment, replay, work, mine, segment, final, sparse, with_end,
            with_start, with_moments, (sample, leaf) if sample is not None else None,
        )  # fmt: skip
        if mine.checkpoint_hash is not None:  # (2.11: the commitment binds them by hash)
            reveal.checkpoints = mine.checkpoints or work.commit_checkpoints()
        await send_reveal(ctx, reveal)
        yield {"done": True}

    async def _on_verdict(self, ctx: rpc.CallContext, payload: Any) -> Any:
        """A referee's verdict, asked for by the auditor who accused."""
        round_index, prover, accusation = parse_verdict_request(payload)
        rnd = await self._round(round_index, prover, accusation.commitment)
        if rnd is None or prover not in rnd.commitments:
            raise LookupError(f"no commitment of {prover.short()} in round {round_index} here")
        rnd.learn(payload.get("secrets"))
        check_dispute(rnd, self.me, prover, accusation)
        if not self.referee.may_accuse(accusation.verifier):
            self.ignored_accusations += 1
            raise PermissionError("the accuser lost its refereeing: too many false accusations")
        key = (round_index, accusation.commitment, prover)
        job = self._verdicts.get(key)
        if job is None:
            job = self._verdicts[key] = self._spawn(self.referee.audit(rnd, prover))
        verdict = await asyncio.shield(job)
        if verdict is None:
            raise LookupError("the prover no longer keeps this round's work")
        self._spawn(self.referee.confirm_acquittal(rnd, prover, accusation, verdict))
        return verdict.to_wire()

    async def _on_convicted(self, ctx: rpc.CallContext, payload: Any) -> Any:
        """Evidence of our own conviction (checked like any other)."""
        if not isinstance(payload, bytes):
            raise ValueError("bad evidence")
        evidence = Evidence.decode(payload)
        if evidence.prover != self.me:
            raise ValueError("evidence against another peer")
        return self.bans.enforce(evidence) is not None

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        counts = self.referee.counts
        return {
            "audits_done": counts["audits_done"],
            "audits_passed": counts["audits_passed"],
            "audits_failed": counts["audits_failed"],
            # Audits whose re-run ended in the committed state bit for bit (the end never
            # crossed the wire), and those that then asked the prover for its end.
            "audits_bit_exact": counts["audits_bit_exact"],
            "reveal_ends_fetched": counts["reveal_ends_fetched"],
            # Segment starts rebuilt here from the round's global state (a reset round:
            # the start never crossed the wire), and those that then were fetched.
            "starts_rebuilt": counts["starts_rebuilt"],
            "starts_fetched": counts["starts_fetched"],
            # ... of which from the round's starting optimizer state, sent as 8-bit codes
            # (`inner_state` "quantize": half a model size with AdamW).
            "starts_from_codes": counts["starts_from_codes"],
            "disputes": dict(self.referee.disputes),
            "withheld": self.withheld,
            # Round records asked of their members directly (the DHT lacked them).
            "records_asked_found": self.records.found,
            "records_served": self.records.served,
            # Our round records members took over the round's connections, records
            # members sent us so, and rounds whose record went into the DHT as well.
            "records_pushed": self.records.pushed_to,
            "records_received": self.records.pushed_here,
            "records_stored": self.records_stored,
            # Members left out of our rounds for a withheld secret or a missing reveal.
            "shuns": self.shunning.shuns,
            "probation": self.on_probation,
            # Accusers overruled by a majority, as this peer saw it.
            "strikes": {str(p): n for p, n in self.referee.ledger.strikes.items()},
            "ignored_accusations": self.ignored_accusations,
            # Reveals refused unread for announcing more than our model holds
            # (peer/verify/reveals.py); each is a malformed reveal.
            "oversized_refused": counts["reveals_oversized"],
            # Sparse rounds: audits that met a residual chained to a previous commitment
            # no other member vouched for (no verdict: shunned), and the signatures of
            # our receipts other members handed us (`receipt_book`).
            "chains_unproven": counts["chains_unproven"],
            # Audits of a last segment that took the message's kept values and a few
            # drawn chunks of the residual, not the whole (`codec_audit` chunks).
            "residuals_sampled": counts["residuals_sampled"],
            "receipts_received": self.receipts.received,
            # Our residuals dropped before a round for want of receipts (the members
            # of the round that left them crashed before they handed theirs out).
            "residuals_unvouched": 0 if self.sparse is None else self.sparse.unvouched,
        }


# ------------------------------------------------------------------ sans-I/O pieces


def audit_round_of(
    round_index: int,
    group: Group,
    shape: tuple[int, int, str],
    commitments: dict[PeerID, Commitment],
    secrets: dict[PeerID, bytes],
    draw: RoundDraw,
    log: WorkLog,
    committed_at: float,
    start: bytes = b"",
) -> AuditRound | None:
    """The round as audits see it, or None when we kept no work of it to start from.
    Its start is read from the log when an audit needs it (it may be on disk by then)."""
    work = log.get(round_index, start or None)
    if work is None or 0 not in work.snapshots:
        return None
    streams, chunk_bytes, codec = shape
    return AuditRound(
        round_index,
        RoundShape.of(group, streams, chunk_bytes, codec),
        commitments,
        secrets,
        draw,
        functools.partial(log.start_params, round_index, work.start_params),
        committed_at,
        start,
    )


async def round_committed(
    rounds: RecentRounds[asyncio.Future[AuditRound | None]],
    round_index: int,
    member: PeerID,
    digest: bytes | None,
) -> AuditRound | None:
    """Our round of `round_index` in which `member` committed to `digest` (None: the
    last round of that index, as a 2.3 referee asks). An index may be ours twice:
    after a re-sync onto a lineage at a lower commit count, we commit it again from
    another state, and each round's referees must be answered from that round."""
    for future in reversed(rounds.of_round(round_index)):
        rnd = await asyncio.wait_for(asyncio.shield(future), GATHER_TIMEOUT + 10)
        theirs = None if rnd is None else rnd.commitments.get(member)
        if digest is None:
            return rnd if theirs is not None else None
        if theirs is not None and theirs.digest() == digest:
            return rnd
    return None


def parse_reveal_request(payload: object) -> tuple[int, int, bool, bytes | None]:
    """(round, segment, whether the run's final state too, the digest of the commitment
    audited) that a referee asks us to reveal; ValueError when malformed. A 2.0 referee
    does not say whether: it wants the final. Before 2.4 none names the commitment."""
    if not isinstance(payload, dict):
        raise ValueError("bad reveal request")
    round_index, segment = payload.get("round"), payload.get("segment")
    final = payload.get("final", True)
    digest = payload.get("commitment")
    if not isinstance(round_index, int) or not isinstance(segment, int):
        raise ValueError("bad reveal request")
    if not isinstance(final, bool):
        raise ValueError("bad reveal request")
    if digest is not None and not (isinstance(digest, bytes) and len(digest) <= 64):
        raise ValueError("bad reveal request")
    return round_index, segment, final, digest


def parse_reveal_parts(payload: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(whether the segment's end parameters go with the reveal, whether they go alone,
    whether its start state goes with it) of a reveal request (parsed by
    `parse_reveal_request` before); askers before 2.6 say none: the whole reveal, end
    included; before 2.7, nothing of the start: it goes. ValueError when malformed."""
    with_end, only_end = payload.get("end", True), payload.get("only_end", False)
    with_start = payload.get("start", True)
    if not all(isinstance(v, bool) for v in (with_end, only_end, with_start)):
        raise ValueError("bad reveal request")
    return with_end, only_end, with_start


def parse_reveal_moments(payload: dict[str, Any]) -> bool:
    """Whether a reveal request that withholds the start takes the round's starting
    optimizer state coded instead (since 2.8); ValueError when malformed."""
    moments = payload.get("moments", False)
    if not isinstance(moments, bool):
        raise ValueError("bad reveal request")
    return moments and payload.get("start", True) is False


def parse_reveal_sample(payload: dict[str, Any]) -> tuple[int, ...] | None:
    """The residual's chunks a reveal request draws (a sparse round audited by
    chunks), distinct and ascending; None when it draws none; ValueError when
    malformed."""
    sample = payload.get("sample")
    if sample is None:
        return None
    ok = isinstance(sample, list) and 0 < len(sample) <= MAX_SAMPLED
    if not ok or not all(type(i) is int and i >= 0 for i in sample):
        raise ValueError("bad reveal request")
    if any(b <= a for a, b in itertools.pairwise(sample)):
        raise ValueError("bad reveal request")
    return tuple(sample)


def _moments_of(replay: Replay, work: RoundWork) -> CodedState | None:
    """The optimizer state `work` started from, coded ([]: it was empty); None when it
    cannot be coded bit for bit (a carried state: the start goes whole)."""
    began = replay.state_after(work, 0)
    return code_state(began.optimizer["optimizer"]["state"])


def parse_verdict_request(payload: object) -> tuple[int, PeerID, Verdict]:
    """(round, prover, accusation) of an auditor's verdict request; ValueError when malformed."""
    if not isinstance(payload, dict) or not isinstance(payload.get("prover"), bytes):
        raise ValueError("bad verdict request")
    round_index, prover = payload.get("round"), PeerID(payload["prover"])
    accusation = Verdict.from_wire(payload.get("accusation"))
    if not isinstance(round_index, int):
        raise ValueError("bad verdict request")
    return round_index, prover, accusation


def check_dispute(rnd: AuditRound, me: PeerID, prover: PeerID, accusation: Verdict) -> None:
    """PermissionError unless `accusation` is the round's auditor accusing `prover`'s
    commitment and we are one of the referees after it."""
    referees = rnd.draw.referees(prover)
    if me not in referees[1:] or accusation.verifier != referees[0]:
        raise PermissionError("not a dispute we referee")
    if not accusation.accuses or accusation.commitment != rnd.commitments[prover].digest():
        raise PermissionError("no accusation of this commitment")


def reveal_segment(
    replay: Replay,
    work: RoundWork,
    mine: Commitment,
    segment: int,
    final: bool = False,
    sparse: SparseWork | None = None,
    with_end: bool = True,
    with_start: bool = True,
    with_moments: bool = False,
    sample: tuple[Sequence[int], int] | None = None,
) -> Reveal:
    """Our reveal of `segment` of the round's work, with the run's `final` state for a
    referee of protocol 2.0 (in the audit thread: it re-runs steps); of a sparse
    round, with the previous commitment, and for the last segment what we sent;
    without the end's parameters unless `with_end` (a referee of 2.6 hashes its own
    re-run's end first), without the start state unless `with_start` (a referee of
    2.7 rebuilds a start it can: `rebuild.rebuild_start`); `with_moments` (a referee
    of 2.8): the round's starting optimizer state goes coded in its place when it
    can be (`state_codes.code_state`), or else the whole start. `sample` (chunks,
    their elements): of a sparse round audited by chunks, the last segment shows the
    message's kept values and those chunks of the residual, not the whole."""
    first, end = mine.segment_bounds(segment)
    last = replay.state_after(work, work.steps) if final else None
    moments = None
    if with_moments and not with_start:
        moments = _moments_of(replay, work)
        with_start = moments is None
    start = replay.state_after(work, first) if with_start else None
    stop = replay.state_after(work, end)
    reveal = reveal_of(start, stop, last, with_end=with_end)
    reveal.moments = moments or None
    if sparse is not None:
        reveal.chain = sparse.chain
        reveal.proof = None if sparse.proof is None else sparse.proof.shown(mine.prover)
        if segment == mine.segments - 1 and sample is not None:
            reveal.slot, reveal.kept = sparse.slot, sparse.kept
            reveal.samples = sparse.sampled(*sample)
        elif segment == mine.segments - 1:
            reveal.slot, reveal.residual = sparse.slot, sparse.residual
    return reveal
