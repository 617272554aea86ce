"""The pipeline as one peer sees it, for /status: who serves each stage, how fast, what
waits at each, where this peer's microbatches flow, and whom it routes around.

`PipelineStatus.extend` adds these keys to `PipelineRun.status()`'s object (whose
other keys are contracts and stay as they are):

    stages[].servers  [obj]  the stage's peers, in the directory's order, then peers
                             only this trainer's balancer still lists (a dead peer
                             whose record has not expired, or has):
        peer_id     str
        self        bool        this peer
        throughput  float|null  training samples/s the peer announced (its stage record)
        measured    float|null  training samples/s this trainer measured on it (request
                                compute times; null until measured, or not a trainer)
        queue       int|null    requests waiting at the peer: its latest answer to this
                                trainer, else its record (this peer's own: live)
        in_flight   int|null    this trainer's requests at the peer right now
        version     int|null    the stage version it serves (record; own: live)
        flow        float|null  requests per second between this peer and it over
                                `flow.window_s` (a trainer: answered by it; the peer's
                                own stage: served by this peer)
        banned      bool        this trainer routes nothing to it now (a request to it
                                failed or timed out: a ban with exponential backoff)
        ban_s       float|null  seconds the ban has left
        age_s       float|null  seconds since its stage record (null: no live record)
    flow              obj    rates over the last `window_s` seconds (null until two samples):
        window_s            float|null
        microbatches_per_s  float|null  microbatches this trainer completed per second
        samples_per_s       float|null
        stages              [{stage, requests_per_s}]  this trainer's requests answered
        served_per_s        {forward, backward}|null   this peer's stage server's
    bans              [{peer_id, stage, ban_s}]  peers this trainer routes around now

Rates come from the counters as `extend` sees them (the daemon asks for its status
every second): at most one sample per `MIN_SAMPLE_S`, kept for `window_s`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Hashable, Sequence
from typing import Any

from shoal.pipeline.balancer import BACKWARD_COST, PeerView, StageBalancer
from shoal.pipeline.directory import StageRecord
from shoal.pipeline.server import StageServer
from shoal.pipeline.trainer import PipelineTrainer
from shoal.transport.identity import PeerID

__all__ = ["FLOW_WINDOW_S", "PipelineStatus"]

FLOW_WINDOW_S = 10.0
MIN_SAMPLE_S = 0.5
# A training sample is a forward and a backward; the balancer prices both in forward
# samples (a backward costs BACKWARD_COST of them).
TRAINING_SAMPLE_COST = 1.0 + BACKWARD_COST


class _Rates:
    """Per-second rates of monotone counters over a sliding window of snapshots."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, dict[str, float]]] = collections.deque()

    def add(self, now: float, counters: dict[str, float]) -> None:
        if self._samples and now - self._samples[-1][0] < MIN_SAMPLE_S:
            self._samples[-1] = (self._samples[-1][0], counters)  # fresher counts, same slot
        else:
            self._samples.append((now, counters))
        # Keep one sample at or before the window's start, so the rate spans all of it.
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    @property
    def span(self) -> float | None:
        if len(self._samples) < 2:
            return None
        span = self._samples[-1][0] - self._samples[0][0]
        return span if span > 0 else None

    def rate(self, key: str) -> float | None:
        span = self.span
        if span is None:
            return None
        (_, first), (_, last) = self._samples[0], self._samples[-1]
        if key not in last:
            return None
        # A counter first seen after the window's start was 0 before (counters start at 0).
        return max(0.0, last[key] - first.get(key, 0.0)) / span


class PipelineStatus:
    """Assembles the keys above; keeps the counter samples the rates need."""

    def __init__(self, *, window_s: float = FLOW_WINDOW_S) -> None:
        self._rates = _Rates(window_s)

    def extend(
        self,
        status: dict[str, Any],
        *,
        self_id: PeerID,
        directory: Sequence[Sequence[StageRecord]],
        trainer: PipelineTrainer | None,
        server: StageServer | None,
        now: float | None = None,
        wall: float | None = None,
    ) -> dict[str, Any]:
        """`status` (PipelineRun's object) with the keys above added; `now` is
        time.monotonic() (the balancers' clock), `wall` time.time() (the records')."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        self._rates.add(now, _counters(trainer, server))
        rows = {s.get("stage"): s for s in status.get("stages", ()) if isinstance(s, dict)}
        bans: list[dict[str, Any]] = []
        for k, records in enumerate(directory):
            balancer = trainer.balancers[k] if trainer and k < len(trainer.balancers) else None
            own = server if server is not None and server.stage == k else None
            servers = self._servers(records, balancer, own, self_id, now, wall)
            bans += [
                {"peer_id": s["peer_id"], "stage": k, "ban_s": s["ban_s"]}
                for s in servers
                if s["banned"]
            ]
            row = rows.get(k)
            if row is None:
                row = {"stage": k}
                status.setdefault("stages", []).append(row)
            row["servers"] = servers
        status["flow"] = self._flow(len(directory), trainer, server)
        status["bans"] = bans
        return status

    def _servers(
        self,
        records: Sequence[StageRecord],
        balancer: StageBalancer | None,
        own: StageServer | None,
        self_id: PeerID,
        now: float,
        wall: float,
    ) -> list[dict[str, Any]]:
        routing = balancer.snapshot() if balancer is not None else {}
        listed: dict[Hashable, StageRecord | None] = {r.peer: r for r in records}
        for peer in routing:
            listed.setdefault(peer, None)
        if own is not None:
            listed.setdefault(self_id, None)
        out = []
        for peer, record in listed.items():
            state = routing.get(peer)
            box: dict[str, Any] = {
                "peer_id": str(peer),
                "self": peer == self_id,
                "throughput": None if record is None else record.samples_per_s,
                "measured": _measured(state),
                "queue": state.queue if state else None if record is None else record.queue,
                "in_flight": None if state is None else state.in_flight,
                "version": None if record is None else record.version,
                "flow": self._rates.rate(f"peer:{peer}") if state is not None else None,
                "banned": False,
                "ban_s": None,
                "age_s": None if record is None else max(0.0, wall - record.at),
            }
            if state is not None and state.banned_until > now:
                box["banned"], box["ban_s"] = True, state.banned_until - now
            if peer == self_id and own is not None:
                box.update(queue=own.queued, version=own.version,
                           flow=self._rates.rate("served"))  # fmt: skip
            out.append(box)
        return out

    def _flow(
        self, stages: int, trainer: PipelineTrainer | None, server: StageServer | None
    ) -> dict[str, Any]:
        rate = self._rates.rate
        return {
            "window_s": self._rates.span,
            "microbatches_per_s": rate("microbatches") if trainer else None,
            "samples_per_s": rate("samples") if trainer else None,
            "stages": [
                {"stage": k, "requests_per_s": rate(f"stage:{k}") if trainer else None}
                for k in range(stages)
            ],
            "served_per_s": None
            if server is None
            else {"forward": rate("served:forward"), "backward": rate("served:backward")},
        }


def _counters(trainer: PipelineTrainer | None, server: StageServer | None) -> dict[str, float]:
    """The monotone counters the rates are computed from, flattened."""
    out: dict[str, float] = {}
    if trainer is not None:
        out["microbatches"] = trainer.counters.microbatches
        out["samples"] = trainer.counters.samples
        stage_of = {p: k for k, peers in enumerate(trainer.stage_peers) for p in peers}
        for k in range(trainer.stages):
            out[f"stage:{k}"] = 0.0
        for peer, answered in trainer.served_by.items():
            out[f"peer:{peer}"] = answered
            k = stage_of.get(peer)
            if k is not None:
                out[f"stage:{k}"] += answered
    if server is not None:
        out["served:forward"] = server.served["forward"]
        out["served:backward"] = server.served["backward"]
        out["served"] = server.served["forward"] + server.served["backward"]
    return out


def _measured(view: PeerView | None) -> float | None:
    """Training samples/s the balancer measured (None while it only has a prior)."""
    if view is None or view.measured is None:
        return None
    return view.measured / TRAINING_SAMPLE_COST
