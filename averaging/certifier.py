"""A shared state's certificates, for its averager: signs our commits, hands our
signature to the round's members, and picks and checks the lineage of any state we
would load, so that no peer adopts a state no round certified, whatever anyone
declares (`provenance` has the rules, `provenance_sync` the wire)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.transport import rpc
from shoal.transport.errors import RemoteError, TransportError
from shoal.transport.identity import PeerID
from shoal.transport.tasks import TaskSet

from .certificate import VERSION_BYTES, Certificate, CertificateError, Statement
from .deadline import Deadline
from .group import Member
from .provenance import ChainError, Provenance, Rank
from .provenance_sync import ProvenanceService, fetch_chain, push_signature
from .state_sync import (
    MAX_STALE_PAUSE_S,
    STALE_PAUSE_S,
    MovedOn,
    State,
    StateSyncError,
    find_holders,
    load_state_from_peers,
    load_version_from_peers,
)

log = logging.getLogger("shoal.averaging.provenance")

# Versions whose checked chains we keep until we load one of them.
MAX_FETCHED = 8
# Distinct versions a joiner looks at among the holders it finds.
MAX_CANDIDATES = 8
REFUSED_S = 30.0  # a version whose chain did not check is not asked for again meanwhile
UNREACHED_S = 5.0  # ... one none of whose holders we reached, for this long
FETCH_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class Lineage:
    """A version whose chain checked: its rank, and the fingerprint its state must have."""

    version: bytes
    rank: Rank
    certs: tuple[Certificate, ...]

    @property
    def fingerprint(self) -> str:
        return self.certs[0].statement.fingerprint


class Certifier:
    """Certificates of one averager's shared state."""

    def __init__(self, host: Any, key: str, service: rpc.RpcService) -> None:
        self.host = host
        self.key = key
        self.protocol = service.protocol
        self.book = Provenance(key)
        self.server = ProvenanceService(service, self.book)
        self._tasks = TaskSet(log, "certificate")
        self._fetched: OrderedDict[bytes, Lineage] = OrderedDict()
        self._refused: dict[bytes, float] = {}
        self._inflight: set[bytes] = set()
        self.version = b""  # the version we hold
        self.chains_checked = 0
        self.chains_refused = 0

    # ------------------------------------------------------------------ our commits

    def certify(
        self, previous: bytes, round_id: bytes, members: Sequence[PeerID], fingerprint: str
    ) -> Certificate:
        """Sign the commit we just made (and hand our signature to the other members)."""
        statement = Statement.of_round(self.key, previous, round_id, fingerprint, members)
        signature = self.host.identity.sign(statement.signed_bytes())
        cert = Certificate(statement, {self.host.peer_id: signature})
        self.book.add(cert)
        self.server.take_pending(statement.version)
        if len(statement.members) > 1:
            self._tasks.spawn(
                push_signature(
                    self.host, self.protocol, statement.members, statement.version, signature
                )
            )
        return cert

    def rank(self, version: bytes) -> Rank | None:
        return self.book.rank(version)

    def order(self, version: bytes) -> tuple[int, int]:
        fetched = self._fetched.get(version)
        return fetched.rank.order if fetched is not None else self.book.order(version)

    # ------------------------------------------------------------------ other lineages

    def want(self, version: bytes, holders: Sequence[PeerID | Member]) -> None:
        """Check `version`'s chain in the background (matchmaking saw peers with it)."""
        if (
            not version
            or not holders
            or version in self._inflight
            or version in self._fetched
            or self._refused.get(version, 0.0) > time.monotonic()
            or self.book.rank(version) is not None
        ):
            return
        self._tasks.spawn(self.lineage(version, holders))

    async def lineage(self, version: bytes, holders: Sequence[PeerID | Member]) -> Lineage | None:
        """`version`'s chain, fetched from its `holders` and checked; None when none of
        them shows one that checks."""
        known = self._fetched.get(version)
        if known is not None:
            return known
        if self.book.get(version) is not None and self.book.rank(version) is not None:
            certs = tuple(self.book.chain(version, limit=1))
            return Lineage(version, self.book.rank(version), certs)  # type: ignore[arg-type]
        self._inflight.add(version)
        refused = 0  # holders that answered with no chain that checks
        try:
            for holder in list(holders)[:3]:
                peer = holder.peer_id if isinstance(holder, Member) else holder
                if peer == self.host.peer_id:
                    continue
                if isinstance(holder, Member):
                    await _connect(self.host, [holder])
                if self.host.connection(peer) is None:  # (a peer ID alone cannot be dialed)
                    log.info("%s: could not reach %s for the chain of version %s", self.key,
                             peer.short(), version.hex()[-12:])  # fmt: skip
                    continue
                try:
                    rank, certs = await fetch_chain(
                        self.host, peer, self.protocol, self.book, version,
                        known=self.book.locator(self.version), timeout=FETCH_TIMEOUT,
                    )  # fmt: skip
                except (ChainError, CertificateError, RemoteError, ValueError, LookupError) as e:
                    log.info("%s: the chain of version %s from %s does not check: %r",
                             self.key, version.hex()[-12:], peer.short(), e)  # fmt: skip
                    self.chains_refused += 1
                    refused += 1
                    continue
                except (TransportError, TimeoutError, OSError) as e:
                    log.info("%s: could not ask %s for the chain of version %s: %r",
                             self.key, peer.short(), version.hex()[-12:], e)  # fmt: skip
                    continue
                found = Lineage(version, rank, tuple(certs))
                self._fetched[version] = found
                while len(self._fetched) > MAX_FETCHED:
                    self._fetched.popitem(last=False)
                self.book.remember(version, rank)
                self.chains_checked += 1
                return found
            # (Holders we could not reach said nothing against it: asked again sooner.)
            wait = REFUSED_S if refused else UNREACHED_S
            self._refused[version] = time.monotonic() + wait
            return None
        finally:
            self._inflight.discard(version)

    async def best(
        self, candidates: Sequence[tuple[bytes, Sequence[PeerID | Member]]]
    ) -> Lineage | None:
        """The lineage of the highest certified rank among `candidates` (versions and
        who announces each, most announced first); None when none checks."""
        best: Lineage | None = None
        for version, holders in candidates[:MAX_CANDIDATES]:
            found = await self.lineage(version, holders)
            if found is not None and (best is None or found.rank.order > best.rank.order):
                best = found
        return best

    def adopt(self, lineage: Lineage) -> None:
        """We now hold `lineage`'s state: its chain is ours."""
        self.book.adopt(lineage.version, lineage.certs)
        self.book.prune(lineage.version)
        self._fetched.pop(lineage.version, None)

    def hold(self, version: bytes) -> None:
        """The version we hold now (a fetch names its chain as what we know)."""
        self.version = version

    # ------------------------------------------------------------------ loading

    async def load(
        self,
        dht: Any,
        deadline: Deadline,
        version: bytes | None,
        sources: Sequence[Member],
        *,
        ours: bytes,
        like: Sequence[torch.Tensor],
        on_refused: Callable[[PeerID], None],
    ) -> tuple[State, Lineage | None]:
        """A shared state, loaded only with the certificate chain of its version: the
        lineage of most certified work among those announced (or `version`'s, from
        `sources` first, refused when it ranks below `ours`), its bytes checked against
        the fingerprint its last certificate names. Raises StateSyncError (NoHolders
        when nobody announces a state).

        Looking for the newest (`version` None), when no holder gave the version they
        announced and one at least moved on from it (a stage that steps several times
        a second: before we ask, or while a live state is between two commits), the
        holders are asked again at the version they announce then, with a growing
        pause, until the `deadline`: a newcomer otherwise gives up on a live swarm's
        state. So is a holder found with no version announced that serves a committed
        state (it committed since: `MovedOn` both).

        A named `version` whose holders all moved on from it (a re-sync to the version
        matchmaking saw, after its peers committed again) is a search for the newest
        from then on, at once, never taking a lineage of less certified work than
        `ours`: their next versions descend from the one named."""
        pause = STALE_PAUSE_S
        floor: bytes | None = None  # (a named version's holders moved on: not below ours)
        while True:
            try:
                return await self._load_once(dht, deadline, version, sources, ours, like,
                                             on_refused, floor)  # fmt: skip
            except MovedOn as e:
                if version is not None:
                    log.debug("%s: the holders of version %s moved on (%s); loading the "
                              "newest", self.key, version.hex()[-12:], e)  # fmt: skip
                    version, sources, floor = None, (), ours
                    continue
                log.debug("%s: holders moved on (%s); looking again", self.key, e)
                async with deadline.scope():
                    await asyncio.sleep(pause)
                pause = min(2 * pause, MAX_STALE_PAUSE_S)

    async def _load_once(
        self,
        dht: Any,
        deadline: Deadline,
        version: bytes | None,
        sources: Sequence[Member],
        ours: bytes,
        like: Sequence[torch.Tensor],
        on_refused: Callable[[PeerID], None],
        floor: bytes | None = None,
    ) -> tuple[State, Lineage | None]:
        async with deadline.scope():
            if version is None:
                chosen = await self._newest(dht, deadline, like, on_refused, floor)
                if isinstance(chosen, State):
                    return chosen, None
                lineage, targets = chosen
            else:
                lineage = await self._named(version, sources, ours)
                targets = [(m.peer_id, m.addrs) for m in sources]
        state = await load_version_from_peers(
            dht, self.key, lineage.version.hex(), sources=targets, protocol=self.protocol,
            deadline=deadline, fingerprint=lineage.fingerprint, like=like, on_refused=on_refused,
        )  # fmt: skip
        return state, lineage

    async def _newest(
        self,
        dht: Any,
        deadline: Deadline,
        like: Sequence[torch.Tensor],
        on_refused: Callable[[PeerID], None],
        floor: bytes | None = None,
    ) -> State | tuple[Lineage, list[tuple[PeerID, Sequence[Any]]]]:
        """The lineage of most certified work announced and its holders; or, when no
        version is announced, the initial state itself (`_load_first`). With a
        `floor`, only a lineage of more certified work than its version's."""
        by_version = await self._announced(dht)
        if not by_version:  # nothing committed yet (or only claims we cannot check)
            if floor is not None:
                raise StateSyncError("no holder announces a version any more")
            return await self._load_first(dht, deadline, like, on_refused)
        candidates = sorted(by_version.items(), key=lambda vh: -len(vh[1]))
        lineage = await self.best(candidates)
        if lineage is None:
            raise StateSyncError("no holder shows a certificate chain for its state")
        if floor is not None and lineage.rank.order <= self.order(floor):
            raise StateSyncError("no version announced has more certified work than ours")
        return lineage, [(m.peer_id, m.addrs) for m in by_version[lineage.version]]

    async def _named(self, version: bytes, sources: Sequence[Member], ours: bytes) -> Lineage:
        """`version`'s lineage, from `sources` first; refused below ours."""
        lineage = await self.lineage(version, sources)
        named = version.hex()[-12:]
        if lineage is None:
            raise StateSyncError(f"no holder of version {named} shows its certificates")
        if lineage.rank.order < self.order(ours):
            raise StateSyncError(f"version {named} has less certified work than ours")
        return lineage

    async def _announced(self, dht: Any) -> dict[bytes, list[Member]]:
        """Who announces which chained version, and where it is reached (claims: what
        is chosen is checked; bandwidth 0: they are sources, not members of a round)."""
        by_version: dict[bytes, list[Member]] = {}
        for h in await find_holders(dht, self.key):
            try:
                held = bytes.fromhex(h.version) if h.version is not None else b""
            except ValueError:
                continue
            if len(held) == VERSION_BYTES:
                by_version.setdefault(held, []).append(Member(h.peer_id, h.addrs, 0.0))
        return by_version

    async def _load_first(
        self,
        dht: Any,
        deadline: Deadline,
        like: Sequence[torch.Tensor],
        on_refused: Callable[[PeerID], None],
    ) -> State:
        """The state before any commit (its holders resumed from the initial state):
        nothing to certify, and nothing more than that is taken."""
        state = await load_state_from_peers(
            dht, self.key, protocol=self.protocol, deadline=deadline, like=like,
            on_refused=on_refused,
        )  # fmt: skip
        if state.metadata.get("commits", 0) != 0:
            # (It committed since we found no version announced: the swarm's first
            # rounds. Its announcement of that version follows: looked up again.)
            raise MovedOn("a holder serves a committed state without its certificates")
        return state

    # ------------------------------------------------------------------ checkpoints

    def saved(self, version: bytes) -> list[list[Any]]:
        return self.book.saved(version)

    def load_saved(self, version: bytes, wires: object) -> Rank | None:
        return self.book.load_saved(version, wires)

    def stats(self) -> dict[str, int]:
        return {
            "certificates": len(self.book),
            "chains_checked": self.chains_checked,
            "chains_refused": self.chains_refused,
            "chains_served": self.server.chains_served,
            "signatures_received": self.server.signatures_received,
        }

    async def aclose(self) -> None:
        await self._tasks.aclose()


async def _connect(host: Any, sources: Sequence[Member]) -> None:
    """Dial the `sources` we are not connected to (matchmaking just confirmed them:
    most are); one that fails is simply not asked."""
    for m in sources:
        if m.addrs and host.connection(m.peer_id) is None:
            with contextlib.suppress(TransportError, OSError, TimeoutError):
                await host.connect(m.peer_id, m.addrs, timeout=10.0)
