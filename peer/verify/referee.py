"""This peer as a referee of others' work: audits, disputes and convictions.

An audit asks the prover to `reveal` the drawn segment, checks and re-runs it
(`audit_round.check_segment`, in the audit thread) and signs a verdict. The
auditor's accusation opens a `verification.Dispute`: the next two referees are
asked for their `verdict` (each fetches the reveal and re-runs the segment
itself); a majority convicts, and the evidence is published in the DHT, handed
to the convicted peer, and enforced here at once (every other peer enforces it
at its next ban refresh, `ban_watch`).

Only what was revealed convicts: a reveal that does not match its commitment or
whose re-run disagrees. A prover that cannot be reached, or no longer has its
work (a process that was killed and restarted), gives no verdict either way: it
is tried again for `REVEAL_TIMEOUT`, then left out of our rounds for a while
(`shunning`: short at first, longer for a repeat offender). A referee's word
that nothing came cannot be checked by anyone else, so it must not ban: two
referees could frame any peer with it, and every crash of an honest peer would
end in a ban. So does a sparse round whose residual chains to a previous commitment
no other member of its round vouches for (`sparse_work.unproven_chain`): those
members may have crashed before they handed out their receipts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from shoal.averaging.deadlines import PRIOR_RATE, SLACK
from shoal.averaging.error_feedback import zero_digest
from shoal.averaging.sparse_round import parse_sparse_shape
from shoal.dht.node import DHTNode
from shoal.transport import rpc
from shoal.transport.errors import (
    ConnectionLost,
    DialError,
    RemoteError,
    StreamReset,
    TransportError,
)
from shoal.transport.identity import Identity, PeerID
from shoal.transport.version import ProtocolVersion
from shoal.verification.audit import AuditPolicy
from shoal.verification.bans import publish
from shoal.verification.commitment import Commitment, CommitmentError
from shoal.verification.disputes import Dispute, Ledger, Outcome
from shoal.verification.evidence import EvidenceError, Result, Verdict

from ..training.task import Task
from .audit_round import (
    AuditRound,
    Finding,
    check_against_end,
    check_segment,
    check_segment_exact,
    gather,
)
from .ban_watch import BanWatcher
from .rebuild import rebuild_start, rebuildable
from .reveals import (
    PROTOCOL,
    Reveal,
    RevealTooLarge,
    SampleAsk,
    fetch_reveal,
    fetch_reveal_end,
    reveal_bytes,
    with_revealed_checkpoints,
)
from .segments import SegmentRunner
from .sparse_work import unproven_chain

__all__ = ["Referee"]

log = logging.getLogger("shoal.verifier")

# The protocol whose provers send a quantized round's starting optimizer state coded.
CODED_START_PROTOCOL = ProtocolVersion(2, 8)
# Chunks of a sparse round's residual a referee draws (`codec_audit` chunks): a lie in
# every chunk (a bent message) is caught by any one, a lie in a share f of them with
# probability 1 - (1 - f)^8 per audit of a last segment (f = 1/4: 0.90). 8 topk
# chunks of 4,096 are 128 KiB: a model size of 0.07 of the daemon's model.
SAMPLED_CHUNKS = 8
_RANDOM = random.SystemRandom()  # (a prover must not predict our draw)
REVEAL_TIMEOUT = 60.0  # to reach the prover (a restart takes seconds) ...
# ... plus, once reached, what its reveal takes to arrive: its size over the averaging
# deadlines' prior link rate, with their slack (a fixed minute is 7 MB of reveal at the
# default model and 4.8 GB at 300M parameters: no home uplink sends that in a minute).
REVEAL_RATE = PRIOR_RATE / SLACK
REVEAL_RETRY_S = 3.0
LATE_SECRETS_TIMEOUT = 5.0  # a re-read of a round's secrets, after a prover refused us
VERDICT_TIMEOUT = 180.0  # a referee fetches a reveal and re-runs a segment
NOTIFY_TIMEOUT = 5.0


class Referee:
    """Audits and disputes run by this peer, with what they found."""

    def __init__(
        self,
        dht: DHTNode,
        identity: Identity,
        *,
        task: Task,
        num_shards: int,
        namespace: str,
        policy: AuditPolicy,
        runner: SegmentRunner,
        pool: ThreadPoolExecutor,
        bans: BanWatcher,
        retain_s: float,
        shun: Callable[[PeerID, int], float | None] | None = None,
        known: Callable[[Commitment], bytes | None] | None = None,
    ) -> None:
        """`shun(prover, round)`: leave a prover that failed that round out of our
        rounds; how long (None: that round's failure was counted already). `known(previous)`:
        the digest of the commitment of `previous`'s prover as it came to us in
        `previous`'s round, if we were there (first hand: never a record the prover
        wrote itself): the anchor of a sparse round's chain."""
        self.known = known
        self.dht = dht
        self.identity = identity
        self.me = identity.peer_id
        self.task = task
        self.num_shards = num_shards
        self.namespace = namespace
        self.policy = policy
        self.runner = runner
        self.template = runner.inner.state_dict()
        # What a reveal holds: our model's parameters (more is refused unread).
        self.shapes = [p.shape for p in runner.model.parameters()]
        # ... and the state our optimizer keeps of each (another state is refused unread).
        self.layouts = runner.inner.state_layouts()
        self.reveal_bytes = reveal_bytes(self.shapes, self.layouts)
        self.sparse_reveal_bytes = reveal_bytes(self.shapes, self.layouts, sparse=True)
        self.pool = pool
        self.bans = bans
        self.retain_s = retain_s  # how long provers keep their work
        self.shun = shun
        self.counts: Counter[str] = Counter()
        self.disputes: Counter[str] = Counter()
        # Strikes of accusers that a majority overruled, as far as we saw.
        self.ledger = Ledger()
        self._confirming: set[tuple[int, PeerID]] = set()
        self._zeros: dict[int, bytes] = {}  # (by the residual's leaf: 0, hashed whole)

    async def audit(self, rnd: AuditRound, prover: PeerID) -> Verdict | None:
        """Our signed verdict on `prover`'s drawn segment; None when we asked too late
        (the prover no longer has to keep its work: no verdict either way)."""
        c = rnd.commitments[prover]
        self.counts["audits_done"] += 1
        refused = False
        # (A start that is public, or that a 2.8 prover may send as codes: see rebuild.py.)
        coded = self._takes_codes(prover)
        rebuild = rebuildable(c) or coded
        while True:
            segment = rnd.draw.segment(prover, c.segments)
            try:
                sample = self._sample(rnd, c, segment)
                reveal = await self._fetch(rnd, prover, segment, start=not rebuild,
                                           moments=coded, sample=sample)  # fmt: skip
                assert isinstance(reveal, Reveal)
                c = rnd.commitments[prover] = with_revealed_checkpoints(c, reveal)
                if sample is not None:
                    self.counts["residuals_sampled"] += 1
                if reveal.start is None and not await self._rebuild(rnd, prover, segment, reveal):
                    rebuild = False  # (ask again, for the whole)
                    continue
                break
            except ValueError as e:  # it answered, with something that is no reveal
                if isinstance(e, RevealTooLarge):  # (refused before it was read)
                    self.counts["reveals_oversized"] += 1
                log.warning("%s revealed round %d malformed: %s", prover.short(), rnd.round, e)
                verdict = Verdict(self.me, c.digest(), segment, b"", Result.BAD_REVEAL)
                return self._count(verdict.signed(self.identity))
            except (RemoteError, TransportError, OSError, TimeoutError) as e:
                refusal = isinstance(e, RemoteError) and e.kind == "PermissionError"
                if refusal and not refused and await self._learn_late_secrets(rnd):
                    refused = True  # (once: the second ask goes with the draw we share)
                    if self.me in rnd.draw.referees(prover):
                        continue
                    self.counts["audits_done"] -= 1
                    log.info("round %d: %s's draw had a secret ours lacked: not ours to "
                             "audit", rnd.round, prover.short())  # fmt: skip
                    return None
                self._no_reveal(rnd, prover, e)
                return None
        seed = rnd.draw.lsh_seed(prover, c.checkpoints[segment], self.me)
        loop = asyncio.get_running_loop()
        anchor = self._anchor(rnd, prover, reveal)
        unproven = await self._unproven(rnd, c, reveal, anchor)
        if unproven is not None:
            self._no_reveal(rnd, prover, LookupError(unproven), unproven=True)
            return None
        if reveal.end_params is None:  # (withheld: our re-run's end is hashed first)
            finding = await self._check_exact(rnd, prover, segment, reveal, seed, anchor)
            if finding is None:
                return None
        else:  # (a prover before 2.6 sends its end whatever we ask)
            audit = functools.partial(
                check_segment, self.runner, self.task, self.num_shards, self.namespace, rnd,
                c, segment, reveal, seed, self.policy, consume=True,  # (its end is read below)
                anchor=anchor,
            )  # fmt: skip
            finding = await loop.run_in_executor(self.pool, audit)
        revealed = b""
        if reveal.end_params is None:  # (the re-run ended in the committed end: bit for bit)
            revealed = c.checkpoints[segment] if finding.result is not Result.BAD_REVEAL else b""
        elif finding.result is not Result.BAD_REVEAL:  # (a hash of a whole model: in a thread)
            revealed = await asyncio.to_thread(reveal.end_digest)
        log.log(
            logging.INFO if finding.result is Result.PASS else logging.WARNING,
            "audit of %s, round %d, segment %d: %s (%s)",
            prover.short(), rnd.round, segment, finding.result, finding.why,
        )  # fmt: skip
        verdict = Verdict(
            self.me, c.digest(), segment, revealed, finding.result,
            finding.flips, finding.bits, finding.norm_gap,
        )  # fmt: skip
        return self._count(verdict.signed(self.identity))

    def _takes_codes(self, prover: PeerID) -> bool:
        """Whether `prover` speaks 2.8: asked, it sends its round's starting optimizer
        state coded when it can (`inner_state` "quantize"), else the whole start."""
        hello = self.dht.host.versions.peer_version(prover)
        return hello is not None and hello.protocol >= CODED_START_PROTOCOL

    async def _rebuild(self, rnd: AuditRound, prover: PeerID, segment: int, reveal: Reveal) -> bool:
        """Rebuild the start `reveal` withheld (`rebuild.rebuild_start`) into it; False
        when the state reached is not the committed one (or our copy of the round's
        global state is gone): the whole reveal is needed."""
        c, loop = rnd.commitments[prover], asyncio.get_running_loop()
        rebuild = functools.partial(
            rebuild_start, self.runner, self.task, self.num_shards, self.namespace, rnd, c,
            segment, self.template, reveal.moments,
        )  # fmt: skip
        try:
            start = await loop.run_in_executor(self.pool, rebuild)
        except RuntimeError as e:  # (our start state is gone: the log let the round go)
            log.info("round %d: could not rebuild %s's start (%s)", rnd.round, prover.short(), e)
            start = None
        if start is None:
            self.counts["starts_fetched"] += 1
            log.info("round %d: %s's segment %d starts elsewhere than our re-run reached: "
                     "its start is fetched", rnd.round, prover.short(), segment)  # fmt: skip
            return False
        self.counts["starts_rebuilt"] += 1
        if reveal.moments:
            self.counts["starts_from_codes"] += 1
        reveal.start = start
        return True

    async def _check_exact(
        self,
        rnd: AuditRound,
        prover: PeerID,
        segment: int,
        reveal: Reveal,
        seed: bytes,
        anchor: bytes | None,
    ) -> Finding | None:
        """The audit of a reveal that withheld its end: our re-run's end hashed against
        the commitment, and only when it differs the prover's end fetched and compared
        by LSH. None: the end did not come (no verdict, as for a missing reveal)."""
        c, loop = rnd.commitments[prover], asyncio.get_running_loop()
        exact = functools.partial(
            check_segment_exact, self.runner, self.task, self.num_shards, self.namespace, rnd,
            c, segment, reveal, consume=True, anchor=anchor,
        )  # fmt: skip
        outcome = await loop.run_in_executor(self.pool, exact)
        if isinstance(outcome, Finding):
            self.counts["audits_bit_exact"] += 1
            return outcome
        self.counts["reveal_ends_fetched"] += 1
        try:
            fetched = await self._fetch(rnd, prover, segment, only_end=True)
        except ValueError as e:  # (an answer that is no end: as a malformed reveal)
            log.warning("%s revealed round %d's end malformed: %s", prover.short(), rnd.round, e)
            return Finding(Result.BAD_REVEAL, f"a malformed end: {e}"[:200])
        except (RemoteError, TransportError, OSError, TimeoutError) as e:
            self._no_reveal(rnd, prover, e)
            return None
        assert isinstance(fetched, tuple)
        reveal.end_params, reveal.end_optimizer = fetched
        against = functools.partial(
            check_against_end, rnd, c, segment, reveal, outcome, seed, self.policy,
            anchor=anchor,
        )  # fmt: skip
        return await loop.run_in_executor(self.pool, against)

    def _anchor(self, rnd: AuditRound, prover: PeerID, reveal: Reveal) -> bytes | None:
        """Of a sparse round, the digest of the prover's previous commitment as we
        received it in its round, if we were there (None: we were not, or no longer
        keep it). (Not its record in the DHT: the prover writes that itself, whenever
        it likes.)"""
        if not rnd.shape.sparse or not reveal.chain or self.known is None:
            return None
        try:
            previous = Commitment.decode(reveal.chain)
        except CommitmentError:
            return None  # (`check_chain` says so)
        return self.known(previous) if previous.prover == prover else None

    async def _unproven(
        self, rnd: AuditRound, c: Commitment, reveal: Reveal, anchor: bytes | None
    ) -> str | None:
        """Why nobody vouches for the sparse chain `reveal` shows (`unproven_chain`)."""
        if not rnd.shape.sparse or c.residual is None:
            return None
        codec, _, chunks = parse_sparse_shape(rnd.shape.codec)
        leaf = codec.chunk if chunks else 0
        zero = self._zeros.get(leaf)
        if zero is None:  # (the hash of a zero residual: a model size, hashed once)
            elements = sum(math.prod(s) for s in self.shapes)
            zero = self._zeros[leaf] = await asyncio.to_thread(zero_digest, elements, leaf)
        return unproven_chain(c, reveal.chain, reveal.proof, anchor is not None, zero)

    def _sample(self, rnd: AuditRound, c: Commitment, segment: int) -> SampleAsk | None:
        """The chunks of the prover's residual we draw for the audit of `segment` (its
        last, of a sparse round audited by chunks: `sparse_work.check_sampled`), at
        random after the commitment (a prover cannot know them when it commits);
        None for any other audit."""
        if not rnd.shape.sparse or segment != c.segments - 1:
            return None
        codec, _, chunks = parse_sparse_shape(rnd.shape.codec)
        if not chunks:
            return None
        n = sum(math.prod(s) for s in self.shapes)
        count = codec.chunks(n)
        drawn = sorted(_RANDOM.sample(range(count), min(SAMPLED_CHUNKS, count)))
        spans = [codec.chunk_span(i, n) for i in drawn]
        return SampleAsk(tuple(drawn), tuple(length for _, length, _ in spans), codec.kept(n))

    def _no_reveal(
        self, rnd: AuditRound, prover: PeerID, e: BaseException, *, unproven: bool = False
    ) -> None:
        """Unreachable, or without its work (a restart loses it): what an honest peer
        that crashed looks like, and nothing a third party could check (a referee's
        word that no reveal came would let two referees frame anyone). No verdict:
        the prover is left out of our rounds for a while instead."""
        self.counts["audits_done"] -= 1
        late = time.monotonic() - rnd.committed_at > self.retain_s / 2
        if isinstance(e, RemoteError) and e.kind == "LookupError" and late:
            log.info("%s no longer keeps round %d: no verdict", prover.short(), rnd.round)
            return
        self.counts["chains_unproven" if unproven else "reveals_missing"] += 1
        seconds = None if self.shun is None else self.shun(prover, rnd.round)
        shunned = "" if seconds is None else f"; left out of our rounds for {seconds:.0f} s"
        what = "showed no proof of its chain in" if unproven else "did not reveal"
        log.info("%s %s round %d (%s): no verdict%s", prover.short(), what, rnd.round, e,
                 shunned)  # fmt: skip

    async def _learn_late_secrets(self, rnd: AuditRound) -> bool:
        """Read the round's secrets from the DHT again; True when some were new here.

        A prover refuses a referee its own draw does not name: its draw then holds a
        secret ours lacks (our read of the DHT after the commit ended before that
        member's record came; the prover learned ours with the request). That is no
        withholding: once we hold the same secrets we agree on who audits whom."""
        known = len(rnd.secrets)
        try:
            _, secrets = await gather(
                self.dht, self.namespace, rnd.round, rnd.commitments, list(rnd.commitments),
                LATE_SECRETS_TIMEOUT, rnd.secrets, start=rnd.start,
            )  # fmt: skip
        except Exception as e:
            log.debug("re-reading round %d's secrets failed: %r", rnd.round, e)
            return False
        rnd.learn([[p.to_bytes(), secret] for p, secret in secrets.items()])
        return len(rnd.secrets) > known

    def transfer_s(self, rnd: AuditRound) -> float:
        """How long a reveal of `rnd` may take to arrive once its prover is reached (a
        sparse round's last segment brings the residual too: a model's size more)."""
        size = self.sparse_reveal_bytes if rnd.shape.sparse else self.reveal_bytes
        return size / REVEAL_RATE

    async def _fetch(
        self,
        rnd: AuditRound,
        prover: PeerID,
        segment: int,
        *,
        only_end: bool = False,
        start: bool = True,
        moments: bool = False,
        sample: SampleAsk | None = None,
    ) -> Reveal | tuple[list[torch.Tensor], bytes]:
        """The prover's reveal, its end withheld (`check_segment_exact`) and without its
        start unless `start` (`rebuild`), or with `only_end` that end alone; a prover
        that cannot be reached is tried again until `REVEAL_TIMEOUT` (a restart takes
        seconds; its checkpoint keeps its identity), and a reveal has `transfer_s`
        more to arrive."""
        deadline = time.monotonic() + REVEAL_TIMEOUT
        c = rnd.commitments.get(prover)
        digest = None if c is None else c.digest()
        while True:
            timeout = max(1.0, deadline - time.monotonic()) + self.transfer_s(rnd)
            try:
                if only_end:
                    return await fetch_reveal_end(
                        self.dht.host, prover, rnd.round, segment, self.shapes,
                        timeout=timeout, secrets=rnd.secrets_to_wire(), commitment=digest,
                    )  # fmt: skip
                return await fetch_reveal(
                    self.dht.host, prover, rnd.round, segment, self.template, self.shapes,
                    timeout=timeout, secrets=rnd.secrets_to_wire(), layouts=self.layouts,
                    commitment=digest, end=False, start=start, moments=moments, sample=sample,
                )  # fmt: skip
            except (DialError, ConnectionLost, StreamReset):
                if time.monotonic() + REVEAL_RETRY_S >= deadline:
                    raise
                await asyncio.sleep(REVEAL_RETRY_S)

    def _count(self, verdict: Verdict) -> Verdict:
        self.counts["audits_failed" if verdict.accuses else "audits_passed"] += 1
        return verdict

    async def audit_as_auditor(self, rnd: AuditRound, prover: PeerID) -> None:
        c = rnd.commitments[prover]
        if rnd.draw.referees(prover)[:1] != (self.me,):
            log.info("round %d: the draw moved (secrets learned since): %s is not ours to "
                     "audit", rnd.round, prover.short())  # fmt: skip
            return
        try:
            verdict = await self.audit(rnd, prover)
        except Exception as e:
            log.warning("auditing %s failed: %r", prover.short(), e)
            return
        if verdict is None:
            return
        # The draw as it is now: secrets learned during the audit (a member that read
        # the DHT late sent us its own) may have moved it, and us off this audit.
        dispute = Dispute(c, rnd.draw)
        try:
            dispute.add(verdict)
        except EvidenceError as e:
            log.info("round %d: the draw moved while we audited %s (%s): not ours to judge",
                     rnd.round, prover.short(), e)  # fmt: skip
            return
        if dispute.outcome is Outcome.OPEN:
            accusation = dispute.verdicts[self.me]
            asked = dispute.waiting_for()
            replies = await asyncio.gather(
                *(self.ask_referee(r, rnd, prover, accusation) for r in asked)
            )
            for verdict in replies:
                if verdict is not None and dispute.outcome is Outcome.OPEN:
                    try:
                        dispute.add(verdict)
                    except EvidenceError as e:
                        log.warning("a referee's verdict does not check: %s", e)
        self.disputes[str(dispute.outcome)] += 1
        self.ledger.record(dispute)
        if dispute.outcome is Outcome.CONVICTED:
            await self._convict(rnd, dispute)

    async def ask_referee(
        self, referee: PeerID, rnd: AuditRound, prover: PeerID, accusation: Verdict
    ) -> Verdict | None:
        payload = {
            "round": rnd.round,
            "prover": prover.to_bytes(),
            "accusation": accusation.to_wire(),
            "secrets": rnd.secrets_to_wire(),
        }
        try:
            reply = await rpc.call(
                self.dht.host,
                referee,
                PROTOCOL,
                "verdict",
                payload,
                timeout=VERDICT_TIMEOUT + self.transfer_s(rnd),  # (it fetches the reveal too)
            )
            return Verdict.from_wire(reply)
        except Exception as e:
            log.info("referee %s gave no verdict: %r", referee.short(), e)
            return None

    async def _convict(self, rnd: AuditRound, dispute: Dispute) -> None:
        evidence = dispute.evidence(list(rnd.commitments.values()), rnd.secrets)
        prover = dispute.commitment.prover
        log.warning("%s convicted of cheating in round %d", prover.short(), rnd.round)
        await publish(self.dht, evidence)
        # The convicted peer hears it from us before we refuse it: once every peer
        # refuses it, it could not read the DHT to learn why.
        try:
            await rpc.call(self.dht.host, prover, PROTOCOL, "convicted", evidence.encode(),
                           timeout=NOTIFY_TIMEOUT)  # fmt: skip
        except Exception as e:
            log.debug("telling %s of its conviction failed: %r", prover.short(), e)
        self.bans.enforce(evidence)

    async def confirm_acquittal(
        self, rnd: AuditRound, prover: PeerID, accusation: Verdict, ours: Verdict
    ) -> None:
        """We cleared a prover someone accused: ask the third referee for its verdict
        (what the accuser got, or will); if it clears the prover too, the majority
        overruled the accuser, and it gets a strike here. An accuser with
        `MAX_STRIKES` strikes starts no more disputes with us (`may_accuse`) and is
        audited at the probation rate."""
        key = (rnd.round, prover)
        if ours.accuses or key in self._confirming:
            return
        self._confirming.add(key)
        others = [r for r in rnd.draw.referees(prover)[1:] if r != self.me]
        theirs = await self.ask_referee(others[0], rnd, prover, accusation) if others else None
        if theirs is None:
            return
        dispute = Dispute(rnd.commitments[prover], rnd.draw)
        try:
            for verdict in (accusation, ours, theirs):
                if dispute.outcome is Outcome.OPEN:
                    dispute.add(verdict)
        except EvidenceError as e:
            log.warning("a dispute's verdicts do not check: %s", e)
            return
        if dispute.outcome is Outcome.ACQUITTED:
            self.ledger.record(dispute)
            log.warning(
                "%s accused %s falsely in round %d (strike %d)",
                accusation.verifier.short(), prover.short(), rnd.round,
                self.ledger.strikes[accusation.verifier],
            )  # fmt: skip

    def may_accuse(self, peer: PeerID) -> bool:
        return self.ledger.may_referee(peer)
