"""When a stage steps: the samples its peers have accumulated, shared through the DHT.

Every peer of a stage reports how many samples it holds gradients for, and at
which stage version (optimizer steps), in its own subkey of
`shoal/x/<experiment>/stage/<s>/progress`. Once the reports of one version add
up to the experiment's global batch, the stage's peers step together
(`StageOptimizer.step`): each sees the same records within a refresh, so they
reach the matchmaking of the step within about one refresh of each other. A
report older than `STALE_S` (its peer died) no longer counts.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from shoal.dht.node import DHTNode
from shoal.dht.records import RecordError, owner_marker, owner_of
from shoal.transport.identity import PeerID

__all__ = ["Report", "StageProgress", "peers_at", "progress_key", "samples_at"]

PROGRESS_TTL = 60.0
STALE_S = 10.0  # stage peers renew their report every 3 s


def progress_key(experiment: str, stage: int) -> str:
    return f"shoal/x/{experiment}/stage/{stage}/progress"


@dataclass(frozen=True)
class Report:
    peer: PeerID
    samples: int
    version: int
    at: float  # UNIX time of the report


def samples_at(reports: Iterable[Report], version: int, now: float) -> int:
    """The samples accumulated for stepping from `version`, by peers heard lately."""
    return sum(r.samples for r in reports if r.version == version and now - r.at <= STALE_S)


def peers_at(
    reports: Iterable[Report], version: int, now: float, *, stepped_with: Collection[PeerID] = ()
) -> set[PeerID]:
    """The peers heard lately that hold `version`: those whose report says so, and
    those of `stepped_with` (the members of the step that made it) whose report
    still names an older one: they committed that step with us, and their new
    report has not reached us yet. Counted as behind, two peers that stepped
    together would each see the other one behind, and each step alone."""
    return {
        r.peer
        for r in reports
        if now - r.at <= STALE_S
        and (r.version == version or (r.version < version and r.peer in stepped_with))
    }


class StageProgress:
    """Our report of one stage's progress, and everyone's."""

    def __init__(self, dht: DHTNode, experiment: str, stage: int, global_batch: int) -> None:
        if global_batch < 1:
            raise ValueError("global_batch must be >= 1")
        self.dht = dht
        self.key = progress_key(experiment, stage)
        self.global_batch = global_batch

    async def report(self, samples: int, version: int) -> bool:
        now = time.time()
        value = {"samples": int(samples), "version": int(version), "t": now}
        return await self.dht.store(
            self.key, value, now + PROGRESS_TTL, subkey=owner_marker(self.dht.peer_id)
        )

    async def reports(self) -> list[Report]:
        found = await self.dht.get(self.key, latest=True)
        out = []
        for subkey, (value, _expiration) in ((found.subkeys or {}) if found else {}).items():
            try:
                peer = owner_of(subkey)
            except RecordError:  # a malformed owner marker: one bad record, not our reports
                continue
            if peer is None or not isinstance(value, dict):
                continue
            samples, version, at = value.get("samples"), value.get("version"), value.get("t")
            ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (samples, version))
            if ints and isinstance(at, int | float) and samples >= 0 and version >= 0:
                out.append(Report(peer, samples, version, float(at)))
        return out

    async def ready(self, samples: int, version: int) -> bool:
        """Report ours; whether the stage's peers at `version` reached the global batch."""
        await self.report(samples, version)
        return samples_at(await self.reports(), version, time.time()) >= self.global_batch
