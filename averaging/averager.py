"""The averaging API a training loop uses: `await averager.step(weight=...)`.

One `Averager` per averaged key (an experiment's parameter group). A step
forms a group through the DHT (`matchmaking`), runs the fault-tolerant
all-reduce (`allreduce`) and, when a member fails, retries at once among the
survivors. The tensors change only on a commit, and then identically on
every member.

State versions: the version is the number of rounds this peer's state has
committed (empty before the first). Matchmaking groups only peers with the
same version, so a peer that missed a commit (it was stopped, cut off, or
restarted) cannot feed stale data into a round: it is told to re-sync, and
`step` downloads the state from peers that hold it (`state_sync`) instead.
A count rather than a hash chain of round IDs: when a swarm larger than the
target group size splits into several groups, each group commits its own
round, and the groups must still be able to mix in the next round.

With ``shared_state`` (an outer optimizer's global parameters: one state the
whole swarm must hold bit for bit), the version is the commit count followed
by a hash chain of the round IDs instead, so only peers holding the very same
state ever group, and two states that went their own ways (two groups, or two
peers that trained alone) are told apart: the one of more certified work wins
(members summed over its commits as the rounds' members signed them,
`provenance.py`; among equals the one held by more looking peers), and the
others re-sync to it. Every commit is signed by its members (`certifier.py`), and
no state is loaded without the certificate chain of its version. That is what
makes a commit by a peer alone safe: with nobody else declared for the key
(`matchmaking.NobodyElse`), it commits by itself (the mean of one input is the
input; the commit hook still runs), instead of holding its state back until
someone comes.

What is averaged need not be what a joiner downloads. An outer optimizer
(`diloco`) averages pseudo-gradients but shares global parameters and outer
momentum: it passes those as `state` (served to joiners, loaded by
`load_state_from_peers`, covered by the fingerprint) and applies its outer
step in `on_commit`, which runs right after a commit and before the state is
frozen, so the state every member serves is the post-step one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from shoal.dht.node import DHTNode
from shoal.transport.identity import PeerID

from .allreduce import AllReduceConfig, AllReduceOutcome, AllReduceService
from .attestation import Attestor
from .certificate import chained_version
from .certifier import Certifier, Lineage
from .deadline import Deadline
from .deadlines import AveragerDeadlines
from .fingerprint import state_fingerprint
from .group import Member
from .host_state import numel, off_loop
from .lineage import declared_work, lineage_work
from .matchmaking import (
    Matchmaker,
    MatchmakingConfig,
    MatchmakingError,
    NeedsResync,
    NobodyElse,
)
from .reducer import NOTHING_TO_AVERAGE
from .state_sync import DEFAULT_PROTOCOL as STATE_PROTOCOL
from .state_sync import (
    NoHolders,
    State,
    StateServer,
    StateSyncError,
    load_state_from_peers,
    load_version_from_peers,
)

log = logging.getLogger("shoal.averaging")

# How long the peers of a version no reachable peer would serve us are left out.
UNREACHABLE_VERSION_S = 30.0
# After a commit with others, peers still declaring the version we left are behind
# (they missed the round): never re-sync back to it for this long.
SUPERSEDED_VERSION_S = 60.0

GENESIS = b""


def _version(commits: int) -> bytes:
    return commits.to_bytes(8, "big") if commits else GENESIS


_chained_version = chained_version  # (certificates check the same link)


def _valid_version(version: bytes, commits: int) -> bool:
    """A version as peers hold them: empty at 0 commits, else the count (8 bytes),
    possibly followed by a chain hash (8 bytes)."""
    if commits == 0:
        return version == GENESIS
    return len(version) in (8, 16) and version[:8] == commits.to_bytes(8, "big")


def restored_version(commits: object, version: object = None) -> bytes:
    """The state version a checkpoint's `commits` and `version` (hex, or None for
    the count alone) stand for; ValueError when they are malformed or disagree."""
    if isinstance(commits, bool) or not isinstance(commits, int) or commits < 0:
        raise ValueError(f"commits must be an int >= 0, got {commits!r}")
    if version is None:
        return _version(commits)
    try:
        held = bytes.fromhex(version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"version must be hex, got {version!r}") from None
    if not _valid_version(held, commits):
        raise ValueError(f"version {version!r} does not fit {commits} commits")
    return held


@dataclass
class AveragerConfig:
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    codec: str = "none"
    # Immediate retries among the survivors after an aborted round.
    max_retries: int = 3
    bandwidth: float = 1.0
    state_protocol: str = STATE_PROTOCOL
    # One state shared by the whole swarm (see the module docstring): hash-chained
    # versions, and a peer with nobody else to average with commits alone.
    shared_state: bool = False
    # The longest a re-sync may take when the step has no deadline of its own.
    state_timeout: float = 120.0
    # Deadlines from measured link rates and RTTs (`deadlines.AdaptiveDeadlines`), the
    # configured ones (matchmaking, stall, state, the step's timeout) as floors.
    adaptive_deadlines: bool = False


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of a step: how long its matchmaking took, then its averaging (the
    all-reduce, or the re-sync or lone commit matchmaking led to), the group's size
    (0: none formed), how it ended, and the peers it left out (those named failed
    or found quiet in the step's earlier tries, and those we shun). A step's tries
    say where its time went."""

    matchmaking_s: float
    averaging_s: float
    group_size: int
    outcome: str
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepResult:
    committed: bool
    reason: str = ""
    group_size: int = 0
    round_id: bytes | None = None
    members: tuple[PeerID, ...] = ()
    attempts: int = 0
    # After a commit: the state fingerprint every member of the group shares.
    fingerprint: str | None = None
    resynced: bool = False
    seconds: float = 0.0
    bytes_sent: int = 0
    # The peer that assembled the group (any member may; it is not special).
    leader: PeerID | None = None
    # The weight each member contributed with (empty when unknown: we own no part).
    weights: dict[PeerID, float] = field(default_factory=dict)
    # Groups this step formed whose round aborted (our input counted in none of them).
    aborted_rounds: tuple[bytes, ...] = ()
    # Our input may be counted in a round we could not learn the outcome of (we were in
    # doubt): the caller must drop it, as after a re-sync, though the tensors are ours.
    discarded: bool = False
    attempt_log: tuple[Attempt, ...] = ()


class Averager:
    """Averages `tensors` (in place) with peers that average the same `key`."""

    def __init__(
        self,
        dht: DHTNode,
        key: str,
        tensors: Sequence[torch.Tensor],
        *,
        config: AveragerConfig | None = None,
        metadata: Callable[[], dict[str, Any]] | None = None,
        state: Sequence[torch.Tensor] | None = None,
        on_commit: Callable[[], None] | None = None,
        service: AllReduceService | None = None,
    ) -> None:
        """`state`: the tensors served to joiners and fingerprinted (default: `tensors`).
        `on_commit`: called right after each commit, before the state is frozen.
        `service`: an all-reduce service shared by several averagers of one host (one
        protocol handler per host; it stays open when this averager closes)."""
        self.dht = dht
        self.key = key
        self.tensors = list(tensors)
        self.state = list(self.tensors if state is None else state)
        self.config = config or AveragerConfig()
        if self.config.adaptive_deadlines:  # its matchmaking deadlines are ours to change
            self.config = replace(self.config, matchmaking=replace(self.config.matchmaking))
        self._metadata = metadata or dict
        self._on_commit = on_commit
        self.state_version = GENESIS
        self.commits = 0
        # Members summed over the commits that made our state (lineage.py): what
        # orders our version against another one that went its own way.
        self.work = 0
        self.last_fingerprint: str | None = None
        # The commit count of the state `last_fingerprint` hashes: `commits` counts a
        # commit before its hook and freeze finish, so the two differ meanwhile.
        self.last_fingerprint_commits: int | None = None
        # State downloads refused for a layout unlike ours, before allocating it.
        self.oversized_refused = 0
        self._own_service = service is None
        self._service = service or AllReduceService(dht.host, self.config.allreduce)
        self._matchmaker = Matchmaker(
            dht, key, self.config.matchmaking, bandwidth=self.config.bandwidth
        )
        # The state we serve is the one of our last commit, frozen then: the caller
        # changes its tensors between rounds.
        self._state_server = StateServer(
            dht, key, self._current_state, protocol=self.config.state_protocol, copy=False
        )
        self._committed: State | None = None
        # A shared state's commit certificates: what decides which lineage anyone
        # adopts (`certifier`), served beside the state.
        self.certifier: Certifier | None = None
        if self.config.shared_state:
            self.certifier = Certifier(dht.host, key, self._state_server.service)
            self._matchmaker.lineages = self.certifier
        self._closed = False
        self._presence_at = -float("inf")  # when we last declared busy between rounds
        # Verified experiments: contributions travel with commitments (`attestation`).
        self.attestor: Attestor | None = None
        # Taken while a downloaded state is written into `state`, for owners whose other
        # threads read it (a stage server computing with the parameters).
        self.state_lock: threading.Lock | None = None
        self._shunned: dict[PeerID, float] = {}  # peer -> until (monotonic)
        self._aborted: list[bytes] = []  # the current step's groups that aborted
        self._attempts: list[Attempt] = []  # the current step's tries (`Attempt`)
        self._attempt_at = 0.0  # when the current try's matchmaking ended
        self.deadlines: AveragerDeadlines | None = None
        if self.config.adaptive_deadlines:
            c = self.config
            self.deadlines = AveragerDeadlines(
                c.matchmaking, c.allreduce, c.state_timeout, self.tensors, self.state
            )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._matchmaker.aclose()
        if self.certifier is not None:
            await self.certifier.aclose()
        self._state_server.close()
        if not self._own_service:
            return
        close = getattr(self._service, "aclose", None)
        if close is not None:
            await close()
        else:
            self._service.close()

    async def __aenter__(self) -> Averager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ state

    def metadata(self) -> dict[str, Any]:
        return {**self._metadata(), "version": self.state_version.hex(), "commits": self.commits}

    def fingerprint(self) -> str:
        """The hash of the state tensors and metadata as they are now."""
        return state_fingerprint(self.state, self.metadata())

    def _current_state(self) -> State | None:
        return self._committed  # None before the first commit: nothing worth downloading

    async def _freeze(self) -> None:
        """Snapshot the state for the state server: a copy and its hash, in a thread
        (a whole model's worth of both would stall the event loop). Nothing writes
        the state meanwhile: its owner awaits the step (or load) that froze it."""
        meta = self.metadata()
        meta.setdefault("step", self.commits)
        tensors = tuple(self.state)
        work = self.work

        def snapshot() -> State:
            copies = tuple(t.detach().to("cpu", copy=True) for t in tensors)
            return State(copies, meta, state_fingerprint(copies, meta), work)

        self._committed = await asyncio.to_thread(snapshot)
        self.last_fingerprint = self._committed.fingerprint
        self.last_fingerprint_commits = self.commits

    def _refused(self, holder: PeerID) -> None:
        self.oversized_refused += 1
        log.info("%s offered a state of %s laid out unlike ours: refused", holder.short(), self.key)

    async def load_state_from_peers(
        self,
        timeout: float = 300.0,
        *,
        deadline: Deadline | None = None,
        version: bytes | None = None,
        sources: Sequence[Member] = (),
    ) -> bool:
        """Replace our tensors and version with the newest verified state of the swarm,
        by the `deadline` (default: `timeout` seconds from now); with `version`, with
        the state of that version (from `sources` first: peers known to hold it)."""
        started = time.monotonic()
        deadline = deadline or Deadline.after(timeout)
        lineage: Lineage | None = None
        try:
            if self.certifier is not None:
                state, lineage = await self.certifier.load(
                    self.dht, deadline, version, sources, ours=self.state_version,
                    like=self.state, on_refused=self._refused,
                )  # fmt: skip
            elif version is None:
                state = await load_state_from_peers(
                    self.dht, self.key, protocol=self.config.state_protocol, deadline=deadline,
                    like=self.state, on_refused=self._refused,
                )  # fmt: skip
            else:
                state = await load_version_from_peers(
                    self.dht,
                    self.key,
                    version.hex(),
                    sources=[(m.peer_id, m.addrs) for m in sources],
                    protocol=self.config.state_protocol,
                    deadline=deadline,
                    like=self.state,
                    on_refused=self._refused,
                )
        except NoHolders:
            # A peer alone (a restart, the first peer): normal, and nothing to do.
            log.info("no other peer serves the state of %s yet: keeping ours", self.key)
            return False
        except (StateSyncError, TimeoutError) as e:
            log.warning("could not load the state of %s: %s", self.key, e)
            return False
        if len(state.tensors) != len(self.state) or any(
            a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(state.tensors, self.state, strict=True)
        ):
            log.warning("the swarm's state of %s does not fit our tensors", self.key)
            return False
        if self.deadlines is not None:
            self.deadlines.observe_download(state.tensors, time.monotonic() - started)
        await self._replace_state(state.tensors)
        commits = state.metadata.get("commits", 0)
        self.commits = commits if isinstance(commits, int) and commits >= 0 else 0
        self.state_version = _version(self.commits)
        version = state.metadata.get("version")
        if isinstance(version, str):
            try:
                held = bytes.fromhex(version)
            except ValueError:
                held = b""
            if _valid_version(held, self.commits):
                self.state_version = held  # (a chained version, for a shared state)
        self.work = lineage_work(self.state_version, [state.work])
        if self.certifier is not None:
            if lineage is not None:
                self.certifier.adopt(lineage)
                self.work = lineage.rank.coop + lineage.rank.solo
            self.certifier.hold(self.state_version)
        await self._freeze()
        await self._announce_state()
        log.info("loaded state %s of %s", state.fingerprint[:12], self.key)
        return True

    async def publish_state(self) -> None:
        """Serve the state as it is now (a peer that starts the swarm, or resumes from
        a checkpoint, holds a state worth downloading before its first commit)."""
        await self._freeze()
        await self._announce_state()

    def restore(
        self,
        commits: int,
        version: str | None = None,
        work: object = None,
        certificates: object = None,
    ) -> None:
        """Set the commit count, state version and lineage work saved in a checkpoint
        (`version`: the hex of `state_version`, without it the count alone; `work`:
        None in a checkpoint of an older release, which counts as the least there is;
        `certificates`: the chain of `version`, without which our lineage is
        unverified to us as to everyone)."""
        held = restored_version(commits, version)
        if work is not None and declared_work(work) is None:
            raise ValueError(f"work must be an int >= 0, got {work!r}")
        self.commits = commits
        self.state_version = held
        self.work = lineage_work(held, [declared_work(work)])
        certifier = getattr(self, "certifier", None)
        if certifier is not None:
            if certificates is not None and certifier.load_saved(held, certificates) is None:
                log.warning("%s: the checkpoint's certificates do not check: our lineage is "
                            "unverified", self.key)  # fmt: skip
            certifier.hold(held)

    def provenance_status(self) -> dict[str, Any] | None:
        """Our version's certified lineage (`certified_work`: signers summed over
        rounds of two or more; `solo_commits`; `verified`: False when we hold no chain
        for it, e.g. restored from a checkpoint of an older release) and the
        certificates moved (None: not a shared state)."""
        if self.certifier is None:
            return None
        rank = self.certifier.rank(self.state_version)
        return {
            "verified": rank is not None,
            "certified_work": 0 if rank is None else rank.coop,
            "solo_commits": 0 if rank is None else rank.solo,
            **self.certifier.stats(),
        }

    def saved_certificates(self) -> str | None:
        """Our version's certificate chain, for a checkpoint (None: not a shared state)."""
        if self.certifier is None:
            return None
        return self.certifier.saved(self.state_version)

    async def announce_presence(self, timeout: float = 2.0) -> bool:
        """Declare in the matchmaking records that we take part and will look soon.

        Leaders wait (up to `matchmaking_time`) for peers declared busy, as for
        members of the previous round still finishing theirs. Declaring so at
        start, and again between rounds before the declaration expires
        (`refresh_presence`), keeps a peer that reaches a round a little later
        than the others from being left out of it (and then told to re-sync),
        however long the time between rounds.
        """
        ok = await self._matchmaker.declare_busy(
            self.state_version, timeout=timeout, work=self.work
        )
        self._presence_at = time.monotonic()
        return ok

    async def refresh_presence(self) -> bool:
        """`announce_presence` when our last declaration is a third of its TTL old (or
        was left by a round that did not commit); call it between rounds. Cheap otherwise."""
        age = time.monotonic() - self._presence_at
        if age < self.config.matchmaking.declaration_ttl / 3:
            return True
        return await self.announce_presence()

    async def _announce_state(self) -> None:
        try:
            await self._state_server.announce()
        except Exception as e:  # announcing is best effort; the next commit retries
            log.debug("announcing state failed: %r", e)

    # ------------------------------------------------------------------ step

    async def step(
        self, weight: float = 1.0, *, timeout: float | None = None, alone: bool = True
    ) -> StepResult:
        """One averaging round: commit (tensors averaged in place) or abort (untouched).

        When our state is behind the swarm's (we missed a commit), the round is
        not joined: the state is downloaded instead (tensors replaced) and the
        result says `resynced`, so the caller recomputes its contribution. With
        `shared_state`, a peer that finds nobody else declared for the key
        commits alone (group size 1, reason "alone"; not with weight 0), unless
        `alone` is False: a caller that knows another peer holds our version (a
        stage's progress reports) ends the step without a group instead.
        """
        started = time.monotonic()
        stall = None
        if self.deadlines is not None:
            adaptive = self.deadlines.next_round()
            stall = adaptive.stall_timeout
            if timeout is not None:  # (its floor is 0: what the links add to ours)
                timeout += adaptive.round_timeout
        deadline = Deadline.after(timeout)
        await self._service.prepare(self.config.codec)  # before a group would wait for it
        now = time.monotonic()
        self._shunned = {p: until for p, until in self._shunned.items() if until > now}
        exclude: set[PeerID] = set(self._shunned)
        reason = ""
        attempts = 0
        self._aborted = []
        self._attempts = []
        while attempts <= self.config.max_retries:
            attempts += 1
            looking, left_out = time.monotonic(), tuple(sorted(map(str, exclude)))
            try:
                group = await self._matchmaker.form_group(
                    state_version=self.state_version,
                    exclude=exclude,
                    deadline=deadline,
                    work=self.work,
                )
            except NeedsResync as e:
                self._attempt(looking, 0, "re-sync", left_out)
                ok, why = await self._resync(e, deadline)
                self._attempt_ended("re-synced" if ok else "re-sync failed")
                return self._result(False, why, started, attempts, resynced=ok)
            except NobodyElse as e:
                self._attempt(looking, 0, "alone", left_out)
                self._presence_at = -float("inf")  # "looking" stays declared: redeclare soon
                if not (self.config.shared_state and weight > 0 and alone):
                    return self._result(False, f"no group: {e}", started, attempts)
                return await self._commit_alone(started, attempts, weight)
            except (MatchmakingError, TimeoutError) as e:
                self._attempt(looking, 0, "no group", left_out)
                self._presence_at = -float("inf")  # "looking" stays declared: redeclare soon
                return self._result(False, f"no group: {e}", started, attempts)
            self._attempt(looking, group.size, "averaging", left_out)
            outcome = await self._service.run(
                group,
                self.tensors,
                weight,
                codec=self.config.codec,
                attestor=self.attestor,
                stall_timeout=stall,
            )
            if self.deadlines is not None:
                self.deadlines.observe_round(
                    self.dht.host, group, outcome.bytes_received, outcome.busy_seconds
                )
            # form_group declared us busy; after an abort that declaration stays too.
            self._presence_at = time.monotonic()
            self._attempt_ended("committed" if outcome.committed else outcome.reason)
            if outcome.committed:
                if group.size > 1:
                    self._matchmaker.supersede(self.state_version, SUPERSEDED_VERSION_S)
                await self._commit(group.round_id, group.peer_ids)
                if self.attestor is not None:
                    self.attestor.on_commit(group, outcome.commitments)
                return StepResult(
                    True,
                    "",
                    group.size,
                    group.round_id,
                    group.peer_ids,
                    attempts,
                    self.last_fingerprint,
                    False,
                    time.monotonic() - started,
                    outcome.bytes_sent,
                    leader if isinstance(leader := group.extra.get("leader"), PeerID) else None,
                    outcome.weights,
                    tuple(self._aborted),
                    attempt_log=tuple(self._attempts),
                )
            if outcome.in_doubt:
                return self._after_doubt(outcome, started, attempts)
            reason = outcome.reason
            self._aborted.append(group.round_id)
            if reason == NOTHING_TO_AVERAGE:
                # Everyone here just loaded the state (weight 0): a retry would group the
                # same peers again. Back to training; the next round carries our work.
                break
            # Not only the members blamed: one silent for a while at the abort (stopped,
            # or behind a loss spike) would likely make the retry wait out its stall too.
            exclude.update(outcome.failed, outcome.quiet)
            log.info(
                "%s: round aborted (%s, stall %.1fs); retrying without %d peers (%d quiet)",
                self.key, reason, stall or self._service.config.stall_timeout, len(exclude),
                len(set(outcome.quiet) - set(outcome.failed)),
            )  # fmt: skip
            if deadline.expired():
                break
        return self._result(False, reason, started, attempts)

    @property
    def state_timeout(self) -> float:
        """How long a state download may take: configured, or adaptive (from the state's
        size at the measured rate, the configured value as a floor)."""
        return self.config.state_timeout if self.deadlines is None else self.deadlines.state_timeout

    def shun(self, peer: PeerID, seconds: float) -> None:
        """Leave `peer` out of our groups for `seconds` (e.g. it withheld what a
        verified round owes the others; not a ban: nothing proves it to third parties)."""
        self._shunned[peer] = max(self._shunned.get(peer, 0.0), time.monotonic() + seconds)

    async def _resync(self, behind: NeedsResync, deadline: Deadline) -> tuple[bool, str]:
        """Our tensors are stale: they must not enter a round. Replace them with the
        swarm's state (the caller redoes its work on it); (done, why)."""
        self._presence_at = -float("inf")  # "syncing" stays declared: redeclare soon
        log.info("%s: our state is behind the swarm (%s); re-syncing", self.key, behind)
        # Within the step's deadline (a re-sync is part of the step), and at least a
        # second to try.
        budget = deadline.within(self.state_timeout)
        if (budget.remaining() or 0.0) < 1.0:
            budget = Deadline.after(1.0)
        # The version matchmaking named, from the peers that just confirmed holding
        # it: "the newest state" in the DHT can be another one of the same step
        # (two groups committed it; the most announced may be our own).
        ok = await self.load_state_from_peers(
            deadline=budget, version=behind.target, sources=behind.holders
        )
        if ok:
            return True, "re-synced with the swarm"
        # Its holders are out of our reach (behind NATs, restarting): re-syncing again
        # at once would fail again, every round. Go on with the peers we reach.
        self._matchmaker.set_aside_version(behind.target, UNREACHABLE_VERSION_S)
        log.info("%s: no reachable peer serves version %s: its peers are left out of our "
                 "rounds for %.0fs", self.key, behind.target.hex()[-12:],
                 UNREACHABLE_VERSION_S)  # fmt: skip
        return False, f"needs re-sync, which failed: {behind}"

    def _after_doubt(self, outcome: AllReduceOutcome, started: float, attempts: int) -> StepResult:
        """The round ended with us in doubt (no member told us its decision, even when
        asked after we gave up): the others may have committed with our input, so a
        retry with it could count it twice. Give the input up (`discarded`): losing a
        step's work is the price of never counting it twice."""
        log.info("%s: %s; our input is dropped (it may be counted already)", self.key,
                 outcome.reason)  # fmt: skip
        return replace(self._result(False, outcome.reason, started, attempts), discarded=True)

    async def _replace_state(self, tensors: Sequence[torch.Tensor]) -> None:
        def copy() -> None:
            with torch.no_grad():
                for dst, src in zip(self.state, tensors, strict=True):
                    dst.copy_(src)

        if self.state_lock is None:
            copy()
            return

        def locked() -> None:
            with self.state_lock:  # type: ignore[union-attr]
                copy()

        # In a thread: the lock's holder may compute for a while, the loop must not wait.
        await asyncio.shield(asyncio.ensure_future(asyncio.to_thread(locked)))

    async def _commit(self, round_id: bytes, members: Sequence[PeerID]) -> None:
        """After the tensors hold the round's result (of `members`): new version,
        commit hook, freeze, and (a shared state) our signature of the commit."""
        previous = self.state_version
        self.commits += 1
        self.work += len(members)
        if self.config.shared_state:
            self.state_version = _chained_version(self.commits, self.state_version, round_id)
        else:
            self.state_version = _version(self.commits)
        if self._on_commit is not None:
            if self.state_lock is not None:  # the hook takes it: never on the loop
                await asyncio.shield(asyncio.ensure_future(asyncio.to_thread(self._on_commit)))
            else:
                await off_loop(self._on_commit, numel(self.state))
        await self._freeze()
        if self.certifier is not None and self.last_fingerprint is not None:
            self.certifier.certify(previous, round_id, members, self.last_fingerprint)
            self.certifier.hold(self.state_version)
        await self._announce_state()

    async def _commit_alone(self, started: float, attempts: int, weight: float) -> StepResult:
        """Nobody else averages this shared state: the mean of our input alone is the
        input, so commit it as it is. A random round ID makes our version our own:
        should another peer have committed alone meanwhile, out of our sight, the two
        states carry different versions and never mix (one side re-syncs)."""
        round_id = b"alone:" + os.urandom(16)
        await self._commit(round_id, (self.dht.host.peer_id,))
        log.info("%s: nobody else declared for it: committed alone (commit %d, version %s)",
                 self.key, self.commits, self.state_version.hex()[-12:])  # fmt: skip
        # Our "looking" declaration names the version we just left: replace it.
        await self.announce_presence()
        self._attempt_ended("alone")
        return StepResult(
            True,
            "alone",
            1,
            round_id,
            (self.dht.host.peer_id,),
            attempts,
            self.last_fingerprint,
            False,
            time.monotonic() - started,
            0,
            self.dht.host.peer_id,
            {self.dht.host.peer_id: weight},
            attempt_log=tuple(self._attempts),
        )

    def _attempt(
        self, looking: float, group_size: int, outcome: str, excluded: tuple[str, ...]
    ) -> None:
        """A try's matchmaking ended (at once after `looking`); `_attempt_ended` says
        how what followed ended."""
        now = time.monotonic()
        self._attempts.append(Attempt(now - looking, 0.0, group_size, outcome, excluded))
        self._attempt_at = now

    def _attempt_ended(self, outcome: str) -> None:
        if self._attempts:
            last = self._attempts[-1]
            spent = time.monotonic() - self._attempt_at
            self._attempts[-1] = replace(last, averaging_s=spent, outcome=outcome[:120])

    def _result(
        self, committed: bool, reason: str, started: float, attempts: int, *, resynced: bool = False
    ) -> StepResult:
        return StepResult(
            committed, reason, attempts=attempts, resynced=resynced,
            seconds=time.monotonic() - started, aborted_rounds=tuple(self._aborted),
            attempt_log=tuple(self._attempts),
        )  # fmt: skip
