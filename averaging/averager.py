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
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from shoal.dht.node import DHTNode
from shoal.transport.identity import PeerID

from .allreduce import AllReduceService
from .attestation import Attestor
from .averager_config import AveragerConfig
from .certificate import chained_version
from .certifier import Certifier
from .deadline import Deadline
from .deadlines import AveragerDeadlines
from .fingerprint import state_fingerprint
from .group import Group, Member
from .host_state import numel, off_loop
from .lineage import declared_work, lineage_work
from .matchmaking import Matchmaker
from .moshpit import GRID_VERSION, Grid
from .presence import Presence
from .served_state import ServedState
from .state_loading import GENESIS, fetch_state, loaded_version, restored_version, write_state
from .state_loading import version_of as _version
from .state_sync import State, StateServer, downloads_in
from .step_result import Attempt, StepResult
from .step_runner import SUPERSEDED_VERSION_S, UNREACHABLE_VERSION_S, StepRunner

__all__ = [
    "GENESIS",
    "SUPERSEDED_VERSION_S",
    "UNREACHABLE_VERSION_S",
    "Attempt",
    "Averager",
    "AveragerConfig",
    "StepResult",
    "restored_version",
]

log = logging.getLogger("shoal.averaging")

_chained_version = chained_version  # (certificates check the same link)


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
        round_tensors: Callable[[Group, float], Sequence[torch.Tensor]] | None = None,
        live_state: bool = False,
        copies_dir: Path | None = None,
    ) -> None:
        """`state`: the tensors served to joiners and fingerprinted (default: `tensors`).
        `on_commit`: called right after each commit, before the state is frozen.
        `round_tensors`: what a round with this group, at this weight of ours, averages
        instead of `tensors` (a vector whose layout depends on the group: the slots
        of `sparse_gather`); `committing_round` tells the hook which round committed.
        `service`: an all-reduce service shared by several averagers of one host (one
        protocol handler per host; it stays open when this averager closes).
        `live_state`: the state changes only through our commits and loads (and
        writes the owner announces with `before_state_change`): it is served and
        checkpointed from the live tensors, never copied whole but while a download
        overlaps a change (`state_sync.StateServer.before_change`), in a file of
        `copies_dir` when given. Else each commit freezes a host copy of it."""
        self.dht = dht
        self.key = key
        self.tensors = list(tensors)
        self.state = list(self.tensors if state is None else state)
        self.config = config or AveragerConfig()
        if self.config.shared_state and self.config.matchmaking.grid is not None:
            # One state bit for bit everywhere versus groups that each commit their own.
            raise ValueError("a shared state cannot be averaged on a Moshpit grid")
        if self.config.adaptive_deadlines:  # its matchmaking deadlines are ours to change
            self.config = replace(self.config, matchmaking=replace(self.config.matchmaking))
        self._metadata = metadata or dict
        self._on_commit = on_commit
        self._round_tensors = round_tensors
        # The round ID of the commit whose hook runs (b"alone:..." for a lone commit).
        self.committing_round = b""
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
        # The state we serve is the one of our last commit, frozen then (or served
        # live: `served_state`): the caller changes its tensors between rounds.
        self.live_state = live_state
        self.copies_dir = copies_dir
        self._state_server = StateServer(
            dht, key, self._current_state, protocol=self.config.state_protocol, copy=False,
            live=live_state, copies_dir=copies_dir,
        )  # fmt: skip
        self._served = ServedState(self._state_server, live=live_state)
        # A shared state's commit certificates: what decides which lineage anyone
        # adopts (`certifier`), served beside the state.
        self.certifier: Certifier | None = None
        if self.config.shared_state:
            self.certifier = Certifier(dht.host, key, self._state_server.service)
            self._matchmaker.lineages = self.certifier
        self._closed = False
        # When we last declared busy between rounds.
        self.presence = Presence(self._matchmaker, self.config.matchmaking.declaration_ttl)
        # Verified experiments: contributions travel with commitments (`attestation`).
        self.attestor: Attestor | None = None
        # Taken while a downloaded state is written into `state`, for owners whose other
        # threads read it (a stage server computing with the parameters).
        self.state_lock: threading.Lock | None = None
        self.deadlines: AveragerDeadlines | None = None
        if self.config.adaptive_deadlines:
            c = self.config
            self.deadlines = AveragerDeadlines(
                c.matchmaking, c.allreduce, c.state_timeout, self.tensors, self.state
            )
        self._runner = StepRunner(self, self._matchmaker, self._service)

    @property
    def grid(self) -> Grid | None:
        """Our place on the Moshpit grid (`MatchmakingConfig.grid_dims`), or None."""
        return self._runner.grid

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
        return self._served.committed  # None before the first commit: nothing to download

    async def _freeze(self) -> None:
        """Serve the state as it is now (`served_state`). Nothing writes the state
        meanwhile: its owner awaits the step (or load) that froze it."""
        meta = self.metadata()
        meta.setdefault("step", self.commits)
        frozen = await self._served.freeze(self.state, meta, self.work)
        self.last_fingerprint = frozen.fingerprint
        self.last_fingerprint_commits = self.commits

    async def before_state_change(self, *, keep_reads: bool = True) -> None:
        """A live state is about to change (`served_state.ServedState.before_change`).
        Call before writing the state other than through a commit or a load."""
        await self._served.before_change(keep_reads=keep_reads)

    def pinned_state(self) -> contextlib.AbstractAsyncContextManager[State | None]:
        """The committed state, unchanged until the block ends (`ServedState.pinned`)."""
        return self._served.pinned()

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
        self._served.before_download()
        with downloads_in(self.copies_dir):  # (the downloaded tensors, until written)
            fetched = await fetch_state(
                self.dht, self.key, self.config.state_protocol, self.certifier,
                deadline or Deadline.after(timeout), version=version, sources=sources,
                ours=self.state_version, like=self.state, on_refused=self._refused,
            )  # fmt: skip
        if fetched is None:
            return False
        state, lineage = fetched
        if self.deadlines is not None:
            self.deadlines.observe_download(state.tensors, time.monotonic() - started)
        await self.before_state_change(keep_reads=False)  # (ours is behind: not worth a copy)
        await write_state(self.state, state.tensors, self.state_lock)
        self.commits, self.state_version = loaded_version(state.metadata)
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
        return await self.presence.announce(self.matchmaking_version, self.work, timeout)

    @property
    def matchmaking_version(self) -> bytes:
        """The version we declare and group by: our state's, or on a Moshpit grid the
        one every peer there declares (`moshpit.GRID_VERSION`: nobody is behind)."""
        return self.state_version if self._runner.grid is None else GRID_VERSION

    async def refresh_presence(self) -> bool:
        """`announce_presence` when our last declaration is a third of its TTL old (or
        was left by a round that did not commit); call it between rounds. Cheap otherwise."""
        if not self.presence.due():
            return True
        return await self.announce_presence()

    async def _announce_state(self) -> None:
        try:
            await self._state_server.announce()
        except Exception as e:  # announcing is best effort; the next commit retries
            log.debug("announcing state failed: %r", e)

    # ------------------------------------------------------------------ step

    async def step(
        self,
        weight: float = 1.0,
        *,
        timeout: float | None = None,
        alone: bool = True,
        quorum: Callable[[], int] | None = None,
    ) -> StepResult:
        """One averaging round: commit (tensors averaged in place) or abort (untouched).

        When our state is behind the swarm's (we missed a commit), the round is
        not joined: the state is downloaded instead (tensors replaced) and the
        result says `resynced`, so the caller recomputes its contribution. With
        `shared_state`, a peer that finds nobody else declared for the key
        commits alone (group size 1, reason "alone"; not with weight 0), unless
        `alone` is False: a caller that knows another peer holds our version (a
        stage's progress reports) ends the step without a group instead. An aborted
        round is retried at once among the survivors (`step_runner`). `quorum`: the
        smallest group to accept, asked again at every poll of matchmaking (for a
        caller whose quorum depends on who is live); None: the config's
        `min_group_size`.
        """
        return await self._runner.run(weight, timeout, alone, quorum)

    @property
    def state_timeout(self) -> float:
        """How long a state download may take: configured, or adaptive (from the state's
        size at the measured rate, the configured value as a floor)."""
        return self.config.state_timeout if self.deadlines is None else self.deadlines.state_timeout

    def shun(self, peer: PeerID, seconds: float) -> None:
        """Leave `peer` out of our groups for `seconds` (e.g. it withheld what a
        verified round owes the others; not a ban: nothing proves it to third parties)."""
        self._runner.shun(peer, seconds)

    def tensors_for(self, group: Group, weight: float) -> list[torch.Tensor]:
        """What a round with `group` averages (`round_tensors`, or `tensors`)."""
        if self._round_tensors is None:
            return self.tensors
        return list(self._round_tensors(group, weight))

    async def _commit(self, round_id: bytes, members: Sequence[PeerID]) -> None:
        """After the tensors hold the round's result (of `members`): new version,
        commit hook, freeze, and (a shared state) our signature of the commit."""
        previous = self.state_version
        self.committing_round = round_id
        self.commits += 1
        self.work += len(members)
        if self.config.shared_state:
            self.state_version = _chained_version(self.commits, self.state_version, round_id)
        else:
            self.state_version = _version(self.commits)
        await self.before_state_change()
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
