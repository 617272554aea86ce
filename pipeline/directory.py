"""Who serves which stage: the stage records of the DHT, read and summarized.

Each stage server keeps a record under `shoal/x/<experiment>/stage/<s>`
(`server.StageServer.record`). This reads them for every stage at once and
answers what joiners and status pages ask: how many peers serve a stage, how
many samples per second it can take, and which stage a joiner should serve
(one short of two peers, else the least capacity).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.dht.node import DHTNode
from shoal.dht.records import RecordError, owner_of
from shoal.transport.identity import PeerID

from .server import RECORD_TTL, stage_key

STAGE_REPLICAS = 2  # peers a joiner gives each stage before it looks at capacity

__all__ = [
    "STAGE_REPLICAS",
    "StageRecord",
    "least_capacity_stage",
    "read_stages",
    "stage_capacity",
]


@dataclass(frozen=True)
class StageRecord:
    peer: PeerID
    forward: float | None  # samples/s, measured by the peer on its own work
    backward: float | None
    queue: int
    version: int
    at: float  # UNIX time of the record
    # False: announced but not taking requests yet (arriving by a move, re-syncing);
    # it counts toward the stage's capacity, trainers do not route to it.
    ready: bool = True
    # The stage a peer arriving by a move leaves (None: not moving). Its record
    # there stays until it drains, so this is how that stage's peers know.
    leaving: int | None = None
    # The version it restarted the stage at, having found no live peer to download
    # it from: from its checkpoint, or 0 from the initial weights (peer.pipelined.checkpoints).
    restored: int | None = None
    since: float = 0.0  # when it (re)started serving: one restart of the peer from another

    @property
    def samples_per_s(self) -> float | None:
        """Training samples (a forward and its backward) per second, when measured."""
        if not self.forward or not self.backward:
            return None
        return 1.0 / (1.0 / self.forward + 1.0 / self.backward)

    @staticmethod
    def parse(peer: PeerID, value: Any) -> StageRecord | None:
        if not isinstance(value, dict):
            return None  # a peer that stopped serving leaves None behind
        fwd, bwd, queue = value.get("fwd"), value.get("bwd"), value.get("queue", 0)
        version, at = value.get("version"), value.get("t")
        if not (isinstance(version, int) and not isinstance(version, bool) and version >= 0):
            return None
        if not isinstance(at, int | float) or not isinstance(queue, int):
            return None
        ready = value.get("ready", True) is not False
        leaving = value.get("from")
        if not (isinstance(leaving, int) and not isinstance(leaving, bool) and leaving >= 0):
            leaving = None
        restored = value.get("restored")
        ok = isinstance(restored, int) and not isinstance(restored, bool)
        if not (ok and 0 <= restored <= version):
            restored = None
        return StageRecord(
            peer, _speed(fwd), _speed(bwd), max(0, queue), version, float(at), ready, leaving,
            restored, float(since) if isinstance(since := value.get("since"), int | float) else 0.0,
        )  # fmt: skip


def _speed(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) and value > 0 else None


async def read_stages(dht: DHTNode, experiment: str, stages: int) -> list[list[StageRecord]]:
    """Every stage's live records (a record older than its TTL is a peer gone)."""
    keys = [stage_key(experiment, s) for s in range(stages)]
    found = await dht.get_many(keys, latest=True)
    now = time.time()
    out: list[list[StageRecord]] = []
    for key in keys:
        value = found.get(key)
        records = []
        for subkey, (raw, _) in ((value.subkeys or {}) if value else {}).items():
            try:
                peer = owner_of(subkey)
            except RecordError:  # a malformed owner marker: skip that record only
                continue
            record = None if peer is None else StageRecord.parse(peer, raw)
            if record is not None and now - record.at <= RECORD_TTL:
                records.append(record)
        out.append(sorted(records, key=lambda r: r.peer.to_bytes()))
    return out


def stage_capacity(records: Sequence[StageRecord], typical: float | None = None) -> float:
    """Samples/s the stage's peers can take together; a peer not measured yet counts
    as `typical` (the median measured peer of the swarm; 1 when none is)."""
    default = typical or 1.0
    return math.fsum(r.samples_per_s or default for r in records)


def least_capacity_stage(
    stages: Sequence[Sequence[StageRecord]],
    replicas: int = STAGE_REPLICAS,
    allowed: Collection[int] | None = None,
) -> int:
    """The stage a new peer should serve: one with fewer than `replicas` peers first
    (the fewest), then the least capacity, then the fewest peers, then the first;
    among `allowed` only (the stages that fit our memory: none is a ValueError),
    whatever the records claim about the others.

    A stage's state lives only on its peers: a stage with one peer loses it to one
    kill (the stage starts again from its seed, and waits for a peer to move there).
    Replicas first costs throughput only until the rebalancer moves a peer to the
    stage that limits the pipeline (never one that leaves a stage unserved)."""
    measured = sorted(s for records in stages for r in records if (s := r.samples_per_s))
    typical = measured[len(measured) // 2] if measured else None
    candidates = range(len(stages)) if allowed is None else sorted(set(allowed))
    if not candidates:
        raise ValueError("no stage to choose from")
    return min(
        candidates,
        key=lambda s: (
            min(len(stages[s]), replicas),
            stage_capacity(stages[s], typical),
            len(stages[s]),
            s,
        ),
    )
