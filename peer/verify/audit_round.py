"""One committed round as a member sees it for audits, and the check of one segment.

After a round commits, every member publishes its commitment and the secret
behind its `seed_commit` in the DHT (`publish_record`, under the round's key,
in a subkey only it can write), then reads the others' (`gather`) until every
member's secret is there or the wait ends: the round's draw
(`verification.referees.RoundDraw`) then says who audits whom. Commitments
also came with the contributions (`averaging.attestation`); the DHT carries
them to members that own no part, and one member's two different commitments
for one round are not accepted.

`check_segment` is the audit itself (blocking; a thread runs it): the reveal
against the commitment's hashes, the start against the global state, in the
last segment's audit the pseudo-gradient that was sent against the revealed end
of the run (the same chunks and codec as the round, so the Merkle root must
match bit for bit), then the segment re-run on the prover's batches and
compared by LSH with the seed drawn after the reveal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgpack
import torch

from shoal.averaging.attestation import chunk_leaves
from shoal.averaging.compression import get_codec
from shoal.averaging.group import Group
from shoal.averaging.partition import Plan
from shoal.averaging.sparse_round import SPARSE_SHAPE, parse_sparse_shape
from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker
from shoal.transport.identity import PeerID
from shoal.verification.audit import AuditPolicy, judge
from shoal.verification.commitment import (
    HASH_BYTES,
    Commitment,
    CommitmentError,
    MerkleTree,
    state_digest,
)
from shoal.verification.evidence import Result
from shoal.verification.referees import SECRET_BYTES, RoundDraw, seed_commit

from ..training.task import Task, shard_of
from .recent import RecentRounds
from .reveals import Reveal
from .segments import (
    SegmentRunner,
    SegmentState,
    flat_difference,
    optimizer_hash,
    params_hash,
    round_batch_seed,
    segment_batches,
)
from .sparse_work import SparseWork, check_chain, check_message, check_sampled

__all__ = [
    "AuditRound",
    "EndNeeded",
    "Finding",
    "RecentRounds",
    "RoundShape",
    "check_against_end",
    "check_segment",
    "check_segment_exact",
    "encode_pushed",
    "gather",
    "publish_record",
]

log = logging.getLogger("shoal.audits")

RECORD_TTL = 300.0  # the records serve the draw right after a commit
GATHER_POLL_S = 0.5
# Replicas a read of the round's records asks, drawn among those our own store of our
# record reached (`DHTNode.store`'s `remember_replicas`), each record sent once
# (`DHTNode.get`'s `sample`): every member stores its record on all k, and a full read
# delivered every record k times to every member (bench/verification_swarm.py: 53 KB
# of DHT a round of 4 daemons, a third of a sparse round's bytes). A record the drawn
# replicas lack comes with a later poll, or from its member (`ask`).
GATHER_REPLICAS = 2
UNKNOWN_GRACE_S = 5.0
# How long a gather takes the records members push to it (`PushedRecords`) before it
# reads the DHT for those still missing: members push theirs right after the commit.
PUSH_WAIT_S = 2.0


class PushedRecords(Protocol):
    """The records members pushed to us (`withholding.DirectRecords`)."""

    pushed_here: int  # how many came so far

    def pushed(self, round_index: int, start: bytes) -> Mapping[PeerID, bytes]: ...

    async def arrival(self, since: int, timeout: float) -> None: ...


def records_key(namespace: str, round_index: int, start: bytes) -> str:
    """Where a round's records are: by its index and the global state it started from.
    A peer that re-synced onto another lineage can commit the same index twice; under
    the index alone its second record replaced the first, and the first round's
    members found its secret missing ("withheld": an honest peer shunned)."""
    return f"{namespace}/work/{round_index}/{start[:8].hex()}"


@dataclass(frozen=True)
class RoundShape:
    """How the round's all-reduce cut and encoded the contributions."""

    bandwidths: tuple[float, ...]
    streams: int
    chunk_elements: int
    codec: str

    @classmethod
    def of(cls, group: Group, streams: int, chunk_bytes: int, codec: str) -> RoundShape:
        bws = tuple(m.bandwidth for m in group.members)
        return cls(bws, streams, max(1, chunk_bytes // 4), codec)

    @property
    def sparse(self) -> bool:
        """A sparse round (`DiLoCo.audit_shape`): what it sent is a message coded with
        error feedback, which an audit does not re-derive yet."""
        return self.codec.startswith(SPARSE_SHAPE)

    def delta_root(self, flat: torch.Tensor) -> bytes:
        plan = Plan.build(
            flat.numel(), self.bandwidths, streams=self.streams, chunk_elements=self.chunk_elements
        )
        return MerkleTree(chunk_leaves(plan, flat, get_codec(self.codec))).root


@dataclass
class AuditRound:
    """A committed round's commitments, secrets and draw, as this member knows them."""

    round: int
    shape: RoundShape
    commitments: dict[PeerID, Commitment]
    secrets: dict[PeerID, bytes]
    draw: RoundDraw
    # The global state the round's work started from, or how to read it back (the
    # work log's start state, which may be on disk: blocking, RuntimeError when gone).
    start_params: list[torch.Tensor] | Callable[[], list[torch.Tensor]]
    committed_at: float = 0.0  # monotonic time of the commit here
    start: bytes = b""  # the digest of the global state it started from (`records_key`)

    def learn(self, wire: object) -> None:
        """Take secrets another member saw (`secrets_to_wire`): one that matches its
        commitment fills a gap of ours, so a late DHT read on either side does not
        leave two members with different draws."""
        if not isinstance(wire, list) or len(wire) > len(self.commitments):
            return
        added = False
        for item in wire:
            if not (isinstance(item, list) and len(item) == 2):
                continue
            peer_raw, secret = item
            if not isinstance(peer_raw, bytes) or not isinstance(secret, bytes):
                continue
            try:
                peer = PeerID(peer_raw)
            except ValueError:
                continue
            c = self.commitments.get(peer)
            if c is not None and peer not in self.secrets and seed_commit(secret) == c.seed_commit:
                self.secrets[peer] = secret
                added = True
        if added:
            self.draw = RoundDraw.from_reveals(list(self.commitments.values()), self.secrets)

    def secrets_to_wire(self) -> list[list[bytes]]:
        return [[p.to_bytes(), s] for p, s in self.secrets.items()]


async def publish_record(
    dht: DHTNode, namespace: str, commitment: Commitment, secret: bytes
) -> bool:
    """Our commitment and secret for the round, where the other members look (the
    replicas it reached then serve our `gather`'s sampled reads)."""
    value = encode_record(commitment, secret)
    try:
        return await dht.store(
            records_key(namespace, commitment.round, commitment.start),
            value,
            time.time() + RECORD_TTL,
            subkey=owner_marker(dht.peer_id),
            remember_replicas=True,
        )
    except Exception as e:  # best effort: the others then see us withhold
        log.info("publishing our round record failed: %r", e)
        return False


def encode_record(commitment: Commitment, secret: bytes) -> bytes:
    """A member's round record: what it stores in the DHT and answers when asked."""
    return msgpack.packb([commitment.encode(), secret], use_bin_type=True)


def encode_pushed(commitment: Commitment, secret: bytes) -> bytes:
    """What a member pushes to the others after a commit (`withholding.DirectRecords`):
    its secret and the digest of its commitment, which the others hold already (it
    came with its contribution); one that does not asks for the whole record."""
    return msgpack.packb({"digest": commitment.digest(), "secret": secret}, use_bin_type=True)


def _parse_pushed(raw: object) -> tuple[bytes, bytes] | None:
    """(digest, secret) of a record `encode_pushed` wrote; None for anything else."""
    try:
        data = msgpack.unpackb(raw, raw=False) if isinstance(raw, bytes) else None
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError):
        return None
    if not isinstance(data, dict) or len(data) != 2:
        return None
    digest, secret = data.get("digest"), data.get("secret")
    if not isinstance(digest, bytes) or len(digest) != HASH_BYTES:
        return None
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        return None
    return digest, secret


def _parse(raw: object) -> tuple[Commitment, bytes] | None:
    try:
        data, secret = msgpack.unpackb(raw, raw=False) if isinstance(raw, bytes) else (None, None)
        if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
            return None
        return Commitment.decode(data), secret
    except (CommitmentError, ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError):
        return None


class _Gathered:
    """The commitments and secrets a gather holds so far (`gather`'s state)."""

    def __init__(
        self,
        known: Mapping[PeerID, Commitment],
        have: Mapping[PeerID, bytes],
        members: Sequence[PeerID],
        place: tuple[int, bytes],
    ) -> None:
        self.commitments = dict(known)
        self.secrets = dict(have)
        self.wanted = set(members)
        self.round, self.start = place

    def absorb(self, raw: object, sender: PeerID | None = None) -> None:
        """A record read from the DHT (`sender` None) or sent by `sender` itself."""
        pushed = None if sender is None else _parse_pushed(raw)
        if pushed is not None:
            assert sender is not None
            self._absorb_secret(sender, *pushed)
            return
        parsed = _parse(raw)
        if parsed is None:
            return
        c, secret = parsed
        if c.prover not in self.wanted or c.round != self.round or sender not in (None, c.prover):
            return
        if c.start != self.start:
            return  # (its round of this index in another lineage: asked directly, say)
        if c.prover in self.commitments and self.commitments[c.prover].digest() != c.digest():
            log.warning("%s published another commitment than it sent", c.prover.short())
            return
        self.commitments[c.prover] = c
        if seed_commit(secret) == c.seed_commit:
            self.secrets[c.prover] = secret

    def _absorb_secret(self, sender: PeerID, digest: bytes, secret: bytes) -> None:
        """`sender`'s secret for the commitment of `digest`: taken against the commitment
        we hold of it (none held: its whole record is asked of it, `gather`'s `ask`)."""
        c = self.commitments.get(sender)
        if sender not in self.wanted or c is None:
            return
        if c.digest() != digest:
            log.warning("%s sent a secret for another commitment than it sent", sender.short())
        elif seed_commit(secret) == c.seed_commit:
            self.secrets[sender] = secret

    def take(self, pushed: PushedRecords | None) -> None:
        for peer, raw in pushed.pushed(self.round, self.start).items() if pushed else ():
            self.absorb(raw, peer)

    def whole(self) -> bool:
        """Every member's commitment and secret are here."""
        return self.wanted <= self.commitments.keys() <= self.secrets.keys()

    def settled(self, waited: float) -> bool:
        """Every commitment's secret, once every member's commitment came or the
        grace for members that contributed nothing is over."""
        everyone = self.wanted <= self.commitments.keys() or waited >= UNKNOWN_GRACE_S
        return everyone and self.commitments.keys() <= self.secrets.keys()

    def missing(self) -> list[PeerID]:
        return sorted(self.wanted - self.secrets.keys(), key=PeerID.to_bytes)


async def gather(
    dht: DHTNode,
    namespace: str,
    round_index: int,
    known: Mapping[PeerID, Commitment],
    members: Sequence[PeerID],
    timeout: float,
    have: Mapping[PeerID, bytes] | None = None,
    ask: Callable[[list[PeerID]], Awaitable[list[tuple[PeerID, object]]]] | None = None,
    *,
    start: bytes,
    sample: int | None = None,
    pushed: PushedRecords | None = None,
) -> tuple[dict[PeerID, Commitment], dict[PeerID, bytes]]:
    """The round's commitments and matching secrets, for `members` (commitments
    already `known` must not change), of the round of index `round_index` that
    started from the global state `start`: until every member that committed has its
    secret, or `timeout`. A member whose commitment we never saw may have contributed
    nothing (weight 0): it is waited for `UNKNOWN_GRACE_S` only. `pushed`: the
    records members pushed to us, taken first (for `PUSH_WAIT_S` at most, and as they
    come after); the DHT is read for what they did not bring. `ask`: the records of
    the members still missing after the first read, asked of them directly
    (`withholding.DirectRecords`), once. `sample`: each read asks that many of the
    replicas our store reached or a full read found (`GATHER_REPLICAS`; None: every
    replica, each read)."""
    held = _Gathered(known, have or {}, members, (round_index, start))
    started = time.monotonic()
    deadline = started + timeout
    pushes_until = min(deadline, started + PUSH_WAIT_S)
    if pushed is not None and await _take_pushes(held, pushed, pushes_until):
        return held.commitments, held.secrets
    while True:
        try:
            key = records_key(namespace, round_index, start)
            value = await dht.get(key, latest=True, sample=sample)
        except Exception as e:  # a failed read is retried until the deadline
            log.debug("reading round records failed: %r", e)
            value = None
        for raw, _expiration in value.subkeys.values() if value and value.subkeys else ():
            held.absorb(raw)
        held.take(pushed)
        if ask is not None and (missing := held.missing()):
            for peer, raw in await ask(missing):  # only its own record
                held.absorb(raw, peer)
            ask = None
        now = time.monotonic()
        if held.settled(now - started) or now >= deadline:
            return held.commitments, held.secrets
        await asyncio.sleep(GATHER_POLL_S)


async def _take_pushes(held: _Gathered, pushed: PushedRecords, until: float) -> bool:
    """The records pushed to us, as they come, until every member's are here (True)
    or `until` (monotonic time)."""
    while True:
        seen = pushed.pushed_here
        held.take(pushed)
        if held.whole():
            return True
        if (now := time.monotonic()) >= until:
            return False
        await pushed.arrival(seen, until - now)


def _check_sparse(
    rnd: AuditRound,
    commitment: Commitment,
    segment: int,
    reveal: Reveal,
    start_params: list[torch.Tensor],
    anchor: bytes | None,
    end: Sequence[torch.Tensor] | None,
) -> Finding | None:
    """A sparse round's checks beyond the re-run (`sparse_work`); None when they pass.
    `end`: the segment's end parameters (of the last segment, the run's end)."""
    elements = sum(p.numel() for p in start_params)
    if reveal.chain is None or commitment.residual is None:
        return Finding(Result.BAD_REVEAL, "a sparse round's reveal without its residual's chain")
    codec, decay, chunks = parse_sparse_shape(rnd.shape.codec)
    leaf = codec.chunk if chunks else 0
    why = check_chain(commitment, reveal.chain, elements, anchor, reveal.proof, leaf)
    if why is None and segment == commitment.segments - 1:
        shape = rnd.shape
        if end is not None and reveal.slot is not None and chunks:
            if reveal.kept is None or not reveal.samples:
                return Finding(Result.BAD_REVEAL, "the last segment's reveal without its chunks")
            why = check_sampled(codec, commitment, reveal.slot, reveal.kept, reveal.samples,
                                start_params, list(end), shape.streams, shape.chunk_elements,
                                decay=decay)  # fmt: skip
            return None if why is None else Finding(Result.FAIL, why)
        if reveal.slot is None or reveal.residual is None or end is None or chunks:
            return Finding(Result.BAD_REVEAL, "the last segment's reveal without what was sent")
        work = SparseWork(reveal.chain, reveal.slot, reveal.residual)
        why = check_message(codec, commitment, work, start_params, list(end),
                            shape.streams, shape.chunk_elements, decay=decay)  # fmt: skip
    return None if why is None else Finding(Result.FAIL, why)


def _check_sent(
    rnd: AuditRound,
    commitment: Commitment,
    segment: int,
    reveal: Reveal,
    anchor: bytes | None,
    end: Sequence[torch.Tensor] | None,
) -> Finding | None:
    """The reveal's start against the round's global state, and what was sent against
    the run's end: the last segment's `end` (its re-run's, or the revealed one checked
    against the re-run), or the final state a 2.0 prover reveals anyway. Any other
    segment's audit does not check what was sent: a prover chooses its last
    checkpoint as freely as what it sends, and only re-running the last segment
    checks that. A sparse round's message is `encode(residual + delta)`: its chain
    and, with the run's end, the message itself are checked apart (`sparse_work`)."""
    start_params = rnd.start_params if isinstance(rnd.start_params, list) else rnd.start_params()
    if commitment.start != params_hash(start_params):
        return Finding(Result.FAIL, "the work did not start from the round's global state")
    final = end if segment == commitment.segments - 1 else reveal.final_params
    if rnd.shape.sparse:
        return _check_sparse(rnd, commitment, segment, reveal, start_params, anchor, end)
    if final is not None:
        sent = rnd.shape.delta_root(flat_difference(start_params, final))
        if sent != commitment.delta_root:
            return Finding(Result.FAIL, "the pseudo-gradient sent is not the one of the run")
    return None


@dataclass(frozen=True)
class Finding:
    result: Result
    why: str
    flips: int = 0
    bits: int = 0
    norm_gap: float = 0.0


@dataclass
class EndNeeded:
    """A re-run that did not end in the committed state bit for bit (another
    machine's rounding, or a lie): the prover's end is needed, and is compared by LSH
    with `rerun` (the re-run's pseudo-gradient) in `check_against_end`."""

    rerun: torch.Tensor


def prover_batches(task: Task, num_shards: int, namespace: str, commitment: Commitment,
                   first: int, end: int) -> list[object]:  # fmt: skip
    """The batches of `commitment`'s prover for its round's steps [first, end)."""
    prover = commitment.prover
    seed = round_batch_seed(namespace, prover, commitment.round)
    shard = shard_of(prover.to_bytes(), num_shards)
    return segment_batches(task, shard, num_shards, seed, first, end - first)


def _batches(task: Task, num_shards: int, namespace: str, commitment: Commitment,
             segment: int) -> tuple[list[object], int]:  # fmt: skip
    """The prover's batches of `segment` and the number of its first step."""
    first, end = commitment.segment_bounds(segment)
    batches = prover_batches(task, num_shards, namespace, commitment, first, end)
    return batches, commitment.first_step + first


def check_segment(
    runner: SegmentRunner,
    task: Task,
    num_shards: int,
    namespace: str,
    rnd: AuditRound,
    commitment: Commitment,
    segment: int,
    reveal: Reveal,
    lsh_seed: bytes,
    policy: AuditPolicy,
    *,
    consume: bool = False,
    anchor: bytes | None = None,
) -> Finding:
    """Audit `segment` of `commitment` from what its prover revealed, end included
    (blocking).

    `consume`: the re-run steps the reveal's start optimizer state in place and drops
    it from the reveal (two model sizes with Adam not copied). Only for a reveal this
    process holds alone (read from the wire: a prover's own kept states must not be
    stepped) and reads nothing of afterwards but its end (`Reveal.end_digest`).
    `anchor`: of a sparse round, the digest of the prover's previous commitment as we
    received it in its round, when we were there (`sparse_work.check_chain`)."""
    assert reveal.end_params is not None, "a reveal without its end: check_segment_exact"
    problem = reveal.problem(commitment, segment)
    if problem is not None:
        return Finding(Result.BAD_REVEAL, problem)
    finding = _check_sent(rnd, commitment, segment, reveal, anchor, reveal.end_params)
    if finding is not None:
        return finding
    batches, first_step = _batches(task, num_shards, namespace, commitment, segment)
    start = reveal.start
    assert start is not None, "a withheld start is rebuilt first (`rebuild.rebuild_start`)"
    with runner.ran(start, batches, first_step, adopt=consume) as recomputed:
        rerun = flat_difference(start.params, recomputed)
    if consume:
        reveal.start = SegmentState(start.params, {})
    return _compare(reveal, rerun, lsh_seed, policy)


def check_segment_exact(
    runner: SegmentRunner,
    task: Task,
    num_shards: int,
    namespace: str,
    rnd: AuditRound,
    commitment: Commitment,
    segment: int,
    reveal: Reveal,
    *,
    consume: bool = False,
    anchor: bytes | None = None,
) -> Finding | EndNeeded:
    """Audit `segment` of `commitment` from a reveal that withheld its end (blocking):
    re-run it and hash the state it ends in (parameters and optimizer state) against
    the commitment's checkpoint. Equal, the prover's end is the re-run's bit for bit
    (a pass, once what was sent is checked against it); else `EndNeeded`: ask the
    prover for its end (`reveals.fetch_reveal_end`) and `check_against_end`.
    `consume` and `anchor` as `check_segment`'s."""
    problem = reveal.problem(commitment, segment)
    if problem is not None:
        return Finding(Result.BAD_REVEAL, problem)
    batches, first_step = _batches(task, num_shards, namespace, commitment, segment)
    start = reveal.start
    assert start is not None, "a withheld start is rebuilt first (`rebuild.rebuild_start`)"
    with runner.ran(start, batches, first_step, adopt=consume) as recomputed:
        ended = state_digest(params_hash(recomputed), optimizer_hash(runner.inner.state_dict()))
        if ended == commitment.checkpoints[segment]:
            finding = _check_sent(rnd, commitment, segment, reveal, anchor, recomputed)
            exact = "the re-run ends in the committed state, bit for bit"
            return finding or Finding(Result.PASS, exact)
        rerun = flat_difference(start.params, recomputed)
    if consume:
        reveal.start = SegmentState(start.params, {})
    return EndNeeded(rerun)


def check_against_end(
    rnd: AuditRound,
    commitment: Commitment,
    segment: int,
    reveal: Reveal,
    needed: EndNeeded,
    lsh_seed: bytes,
    policy: AuditPolicy,
    *,
    anchor: bytes | None = None,
) -> Finding:
    """The rest of `check_segment_exact`'s audit once the prover's end came (in
    `reveal.end_params`): the end against the commitment, what was sent against it,
    and the re-run compared with it by LSH (blocking)."""
    problem = reveal.end_problem(commitment, segment)
    if problem is not None:
        return Finding(Result.BAD_REVEAL, problem)
    finding = _check_sent(rnd, commitment, segment, reveal, anchor, reveal.end_params)
    if finding is not None:
        return finding
    return _compare(reveal, needed.rerun, lsh_seed, policy)


def _compare(reveal: Reveal, rerun: torch.Tensor, lsh_seed: bytes, policy: AuditPolicy) -> Finding:
    """The revealed pseudo-gradient of the segment against the re-run's, by LSH."""
    assert reveal.end_params is not None and reveal.start is not None
    claimed = flat_difference(reveal.start.params, reveal.end_params)
    j = judge(claimed, rerun, lsh_seed, policy)
    c = j.comparison
    gap = c.mean_log2_norm_gap
    why = f"{c.flips} of {c.bits} bits differ (limit {j.flip_limit}), norm gap {gap:.4f}"
    return Finding(j.result, why, c.flips, c.bits, float(c.mean_log2_norm_gap))
