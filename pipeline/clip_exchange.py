"""Global clipping's driver: our stage's squared norm into the DHT, the other stages' out.

For step v every peer of every stage stores its claim `{stage, sq, group}` in its
own signed subkey of `shoal/x/<experiment>/clip/<v>` (`clip_key`) and reads the
key until every stage's norm settled (`clipping.NormClaims`), polling fast at
first (the stages step within moments of each other) and slower later. A store that
no replica took is tried again every `STAGES_EVERY_S` while we wait, and
before we step if we settled first (the others still wait for our norm). A claim
counts only from a peer that holds a record of the stage it claims for (its
stage record, which it signed: a stranger's claim is no stage's), and only its
owner can write a subkey, so nobody claims in another's name.

The deadline: a stage whose norm has not settled `deadline` after our step
committed counts as missing, so that no stage waits on another forever. It is
30 s, or 4 times the longest wait of the last steps (at most 10 minutes), for
stages whose steps lie far apart (big stages averaging over slow links). A stage
that no peer serves, or whose records name a version more than `ASTRAY_STEPS`
from ours (it went back to an older version with a lost state), counts as
missing after `ASTRAY_WAIT_S` already: its claim is not coming soon.

A peer of a stage whose own record is already past the step, and which claimed
nothing for it, is not waited for (`StagesSeen.counts`): a peer stores its claim
in the step's commit hook, before it publishes its new version, so it took no
part in that commit (its round aborted while its partners' committed, and it
re-synced), and its partners' claims settle the stage alone. Only its own signed
record says so: nobody makes another peer skip.

The peers of one stage read the same records, so they settle on the same norms
unless one arrives within moments of the deadline: then they can part (one
scales by the full factor, another by its fallback), which the state's
fingerprints show, and the peer that fell back says at its next step when the
missing norms came late with another factor (`late_norms`). The deadline's
margin keeps that window rare; closing it needs an agreement round within the
stage. Fallbacks are counted on /status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.dht.node import DHTNode
from shoal.dht.records import RecordError, owner_marker, owner_of
from shoal.transport.identity import PeerID

from .clipping import ClipDecision, NormClaims, rounded
from .server import stage_key

__all__ = ["CLIP_DEADLINE_S", "ClipExchange", "StagesSeen", "clip_key", "read_claims"]

log = logging.getLogger("shoal.pipeline")

CLIP_DEADLINE_S = 30.0
POLL_FIRST_S = 0.02
POLL_MAX_S = 0.5
DECISIONS_KEPT = 8
STAGES_EVERY_S = 1.0  # the stage records are read again this often while we wait
DEADLINE_MARGIN = 4.0
MAX_DEADLINE_S = 600.0
ASTRAY_STEPS = 6  # a stage this many versions from ours will not claim our step's norm soon
ASTRAY_WAIT_S = 2.0  # ...so it is waited for this long only


def clip_key(experiment: str, version: int) -> str:
    return f"shoal/x/{experiment}/clip/{version}"


def read_claims(
    subkeys: Mapping[Any, tuple[Any, float]], claims: NormClaims, members: Sequence[set[PeerID]]
) -> bool:
    """The claims of a clip key's records (subkey -> (value, expiration)) into `claims`,
    each from a peer holding a record of the stage it claims for (`members`); whether
    one came from a peer not among them (it may have joined since they were read)."""
    unknown = False
    for subkey, (value, _expiration) in subkeys.items():
        try:
            peer = owner_of(subkey) if isinstance(subkey, str) else None
        except RecordError:
            continue
        if peer is None or not isinstance(value, dict):
            continue
        stage = value.get("stage")
        if isinstance(stage, bool) or not isinstance(stage, int):
            continue
        if not 0 <= stage < min(claims.stages, len(members)):
            continue
        if peer not in members[stage]:
            unknown = True
            continue
        claims.add(stage, peer, value.get("sq"), value.get("group"))
    return unknown


@dataclass
class StagesSeen:
    """What the stage records say for one step, per stage: who holds a record (serving
    it, or left it lately: only they may claim), who serves it ready at the step's
    version or past it (or a step before, as records lag) and whose record says it
    does not (left, or steps behind), whose record is past the step (it took the
    step, or re-synced past it), and the newest version a record names (None: no
    record)."""

    members: list[set[PeerID]] = field(default_factory=list)
    ready: list[set[PeerID]] = field(default_factory=list)
    unready: list[set[PeerID]] = field(default_factory=list)
    newest: list[int | None] = field(default_factory=list)
    past: list[set[PeerID]] = field(default_factory=list)

    @property
    def serving(self) -> list[int]:
        """Per stage, how many peers serve it (as `NormClaims.settled` takes it)."""
        return [len(r) for r in self.ready]

    def counts(self, claims: NormClaims) -> tuple[list[int], list[int]]:
        """Per stage, how many peers serve it at the step and how many of the stage's
        peers skipped it (as `NormClaims.settled` takes them): those whose record is past
        the step and which have no claim for it, stored before that record was."""
        skipped = [
            past - claims.claimants(t).keys() if t < claims.stages else set()
            for t, past in enumerate(self.past)
        ]
        serving = [len(r - s) for r, s in zip(self.ready, skipped, strict=True)]
        return serving, [len(s) for s in skipped]

    def add(self, subkeys: Mapping[Any, tuple[Any, float]], version: int) -> None:
        """The next stage's records (subkey -> (record, expiration))."""
        peers: set[PeerID] = set()
        ready: set[PeerID] = set()
        versions: list[int] = []
        past: set[PeerID] = set()
        for subkey, (record, _) in subkeys.items():
            try:
                peer = owner_of(subkey) if isinstance(subkey, str) else None
            except RecordError:
                continue
            if peer is None:
                continue
            peers.add(peer)
            v = record.get("version") if isinstance(record, dict) else None
            if isinstance(v, int) and not isinstance(v, bool):
                versions.append(v)
                # (A record may lag a step behind its peer's version: it still counts.)
                if v >= version - 1 and record.get("ready", True) is True:
                    ready.add(peer)
                if v > version:  # (a step from `version` ends at version + 1)
                    past.add(peer)
        self.members.append(peers)
        self.past.append(past)
        self.ready.append(ready)
        self.unready.append(peers - ready)
        self.newest.append(max(versions, default=None))

    def merged(self, earlier: StagesSeen | None, *, versions: bool = True) -> StagesSeen:
        """This read joined with an earlier one: a read can miss records (replicas that
        did not answer in time), and a read that found only a liar's record of a stage
        would let that liar's lone claim settle the stage's norm (and drop its honest
        peers' claims as strangers'). A peer serves a stage when an earlier read found
        it serving and this one did not find it otherwise. Without `versions`, the
        newest versions, and who is past the step, are this read's only (`earlier` is
        the last step's reads: a stage nobody serves any more is one where no claim can
        come, and a peer past the last step may well claim this one)."""
        if earlier is None:
            return self
        pairs = list(zip(self.ready, self.unready, earlier.ready, earlier.unready, strict=True))
        past = self.past
        if versions:
            past = [a | b for a, b in zip(self.past, earlier.past, strict=True)]
        return StagesSeen(
            [a | b for a, b in zip(self.members, earlier.members, strict=True)],
            [ready | (before - unready) for ready, unready, before, _ in pairs],
            [unready | (before - ready) for ready, unready, _, before in pairs],
            [
                a if not versions or b is None else b if a is None else max(a, b)
                for a, b in zip(self.newest, earlier.newest, strict=True)
            ],
            past,
        )

    def astray(self, claims: NormClaims, mine: int, version: int) -> bool:
        """Whether every stage still unsettled has no claim coming soon: nobody serves
        it, or its version is steps away from ours (it lost its state, or we are far
        behind)."""
        serving, skipped = self.counts(claims)
        for t in range(claims.stages):
            if t == mine or claims.settled(t, serving[t], skipped[t]) is not None:
                continue
            newest = self.newest[t]
            if newest is not None and abs(newest - version) <= ASTRAY_STEPS:
                return False
        return True


@dataclass(frozen=True)
class Decided:
    version: int
    decision: ClipDecision
    seconds: float  # how long we waited for the other stages


class ClipExchange:
    """One stage peer's side of global clipping (`StageOptimizer.clip` calls `factor`)."""

    def __init__(
        self,
        dht: DHTNode,
        experiment: str,
        stage: int,
        stages: int,
        max_norm: float,
        *,
        deadline_s: float = CLIP_DEADLINE_S,
    ) -> None:
        self.dht = dht
        self.experiment = experiment
        self.stage = stage
        self.stages = stages
        self.max_norm = max_norm
        self.deadline_s = deadline_s  # the floor of `deadline`
        self.fallbacks = 0  # steps clipped without some stage's norm
        # Fallbacks whose missing norms came later and gave another factor: a peer of
        # our stage that had them in time may have stepped otherwise (states parted).
        self.late_norms = 0
        self.disputed: set[PeerID] = set()  # peers whose claim differed from the settled one
        self.decided: deque[Decided] = deque(maxlen=DECISIONS_KEPT)
        self._seen: tuple[int, StagesSeen] | None = None  # the last step's records, as read

    async def factor(self, version: int, squared: float, group: int) -> float:
        """Claim our stage's squared norm for the step from `version` (a step of `group`
        peers), wait for the other stages' (until the deadline); the factor to scale by."""
        started = time.monotonic()
        key = clip_key(self.experiment, version)
        claim = {"stage": self.stage, "sq": squared, "group": group}
        deadline = self.deadline
        # Kept until a stage that steps up to a deadline after us has read it.
        expires = time.time() + 2 * deadline + 60
        subkey = owner_marker(self.dht.peer_id)
        stored = await self.dht.store(key, claim, expires, subkey=subkey)
        # What this step's reads found, and with it what the last step's found (a stage
        # that had two peers then needs two claims now, whatever a read missed since,
        # unless a read shows one of them left): only the former is kept for the next.
        last = self._seen[1] if self._seen is not None and self._seen[0] == version - 1 else None
        reads, read_at = await self._stages(version), time.monotonic()
        stages = reads.merged(last, versions=False)
        await self._look_back(version, stages)
        delay = POLL_FIRST_S
        while True:
            if time.monotonic() - read_at >= STAGES_EVERY_S:  # (joiners, versions)
                if not stored:  # (no replica took our claim: nobody would see our norm,
                    # and the DHT's own republishing comes minutes later)
                    stored = await self.dht.store(key, claim, expires, subkey=subkey)
                reads, read_at = (await self._stages(version)).merged(reads), time.monotonic()
                stages = reads.merged(last, versions=False)
            claims = NormClaims(self.stages)
            found = await self.dht.get(key, latest=True)
            read_claims((found.subkeys or {}) if found else {}, claims, stages.members)
            elapsed = time.monotonic() - started
            final = elapsed >= deadline or (
                elapsed >= ASTRAY_WAIT_S and stages.astray(claims, self.stage, version)
            )
            serving, skipped = stages.counts(claims)
            decision = claims.decide(
                self.max_norm, (self.stage, squared), serving, final=final, skipped=skipped
            )
            if decision is not None:
                if not stored:  # (the other stages still wait for our norm)
                    await self._store_until(key, claim, expires, started + deadline)
                self._seen = (version, reads)
                self._note_disputes(claims, squared, serving, skipped)
                return self._decided(version, decision, time.monotonic() - started)
            left = deadline - (time.monotonic() - started)
            await asyncio.sleep(max(0.0, min(delay, left)))
            delay = min(2 * delay, POLL_MAX_S)

    async def _store_until(
        self, key: str, claim: dict[str, Any], expires: float, until: float
    ) -> None:
        """Store our claim again until a replica takes it, or (monotonic) `until`."""
        subkey = owner_marker(self.dht.peer_id)
        while not await self.dht.store(key, claim, expires, subkey=subkey):
            if time.monotonic() + STAGES_EVERY_S >= until:
                log.warning("our gradient norm for %s could not be stored: the other "
                            "stages will clip without it", key)  # fmt: skip
                return
            await asyncio.sleep(STAGES_EVERY_S)

    async def _look_back(self, version: int, stages: StagesSeen) -> None:
        """After a fallback for the step before `version`: did its missing norms come
        since, and would they have given another factor? (Said and counted.)"""
        last = self.decided[-1] if self.decided else None
        if last is None or not last.decision.fell_back or last.version != version - 1:
            return
        claims = NormClaims(self.stages)
        found = await self.dht.get(clip_key(self.experiment, last.version), latest=True)
        read_claims((found.subkeys or {}) if found else {}, claims, stages.members)
        own = last.decision.squared_norms[self.stage]
        assert own is not None
        now = claims.decide(self.max_norm, (self.stage, own), stages.serving)
        if now is not None and now.factor != last.decision.factor:
            self.late_norms += 1
            log.warning(
                "step from %d: the missing gradient norms came late (factor %.4g, not the "
                "%.4g applied): this stage's peers may hold different states",
                last.version, now.factor, last.decision.factor,
            )  # fmt: skip

    @property
    def deadline(self) -> float:
        """How long a step waits for the other stages' norms: `deadline_s`, or more where
        the stages' steps lie further apart (big stages averaging over slow links):
        `DEADLINE_MARGIN` times the longest wait of the last steps that did not fall back."""
        waits = [d.seconds for d in self.decided if not d.decision.fell_back]
        return min(MAX_DEADLINE_S, max(self.deadline_s, DEADLINE_MARGIN * max(waits, default=0.0)))

    def _note_disputes(
        self, claims: NormClaims, squared: float, serving: list[int], skipped: list[int]
    ) -> None:
        for s in range(self.stages):
            if s != self.stage:
                self.disputed.update(claims.disputed(s, serving[s], skipped[s]))
        mine = rounded(squared)  # (our own stage's peers claim what we computed)
        self.disputed.update(p for p, v in claims.claimants(self.stage).items() if v != mine)

    def _decided(self, version: int, decision: ClipDecision, seconds: float) -> float:
        self.decided.append(Decided(version, decision, seconds))
        if decision.fell_back:
            self.fallbacks += 1
            missing = [s for s, n in enumerate(decision.squared_norms) if n is None]
            log.warning(
                "step from %d: no agreed gradient norm from stage(s) %s within %.0f s; "
                "clipped by the other stages' (factor %.4g)",
                version, missing, seconds, decision.factor,
            )  # fmt: skip
        return decision.factor

    async def _stages(self, version: int) -> StagesSeen:
        """Every stage's records, as `StagesSeen` reads them for the step from `version`."""
        keys = [stage_key(self.experiment, s) for s in range(self.stages)]
        found = await self.dht.get_many(keys, latest=True)
        seen = StagesSeen()
        for k in keys:
            value = found.get(k)
            seen.add((value.subkeys or {}) if value is not None else {}, version)
        return seen

    def status(self) -> dict[str, object]:
        """/status.pipeline's `clipping`."""
        last = self.decided[-1] if self.decided else None
        return {
            "max_grad_norm": self.max_norm,
            "factor": None if last is None else last.decision.factor,
            "factor_version": None if last is None else last.version,
            "waited_s": None if last is None else round(last.seconds, 3),
            "fallbacks": self.fallbacks,
            "late_norms": self.late_norms,
            "disputed": sorted(str(p) for p in self.disputed),
        }
