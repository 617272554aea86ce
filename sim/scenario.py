"""Scenario files: how many peers, their link and NAT distributions, churn, and the workload."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simnet import Link

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class LinkClass:
    """A kind of access link (home, datacenter): its share of peers and the ranges
    its figures are drawn from (bandwidths log-uniform, latency uniform)."""

    name: str
    share: float
    down_mbit: tuple[float, float]
    up_mbit: tuple[float, float]
    latency_ms: tuple[float, float]  # one-way, host to the network core
    loss: float = 0.0
    nat: float = 0.0  # the fraction of these peers that accept no inbound connection

    def draw(self, rng: random.Random) -> tuple[Link, bool]:
        def log_uniform(lo: float, hi: float) -> float:
            return math.exp(rng.uniform(math.log(lo), math.log(hi)))

        link = Link(
            up_Bps=log_uniform(*self.up_mbit) * MBIT,
            down_Bps=log_uniform(*self.down_mbit) * MBIT,
            latency_s=rng.uniform(*self.latency_ms) / 1000,
            loss=self.loss,
        )
        return link, rng.random() < self.nat


@dataclass(frozen=True)
class Churn:
    """Sessions last an exponential time of this mean; each departure is replaced by
    a newcomer (the population stays about constant), who joins through a live peer."""

    mean_session_min: float


@dataclass(frozen=True)
class Scenario:
    name: str
    peers: int
    seed: int
    links: tuple[LinkClass, ...]
    churn: Churn | None
    workload: dict[str, Any] = field(default_factory=dict)

    def draw_link(self, rng: random.Random) -> tuple[str, Link, bool]:
        x = rng.random() * sum(c.share for c in self.links)
        for c in self.links:
            x -= c.share
            if x <= 0:
                return (c.name, *c.draw(rng))
        c = self.links[-1]
        return (c.name, *c.draw(rng))


def load(path: str | Path, *, peers: int | None = None) -> Scenario:
    """A scenario from a JSON file (`peers` overrides the file's count)."""
    raw = json.loads(Path(path).read_text())
    links = tuple(
        LinkClass(
            name,
            float(c["share"]),
            tuple(c["down_mbit"]),
            tuple(c["up_mbit"]),
            tuple(c["latency_ms"]),
            float(c.get("loss", 0.0)),
            float(c.get("nat", 0.0)),
        )
        for name, c in raw["links"].items()
    )
    churn = raw.get("churn")
    return Scenario(
        name=raw.get("name", Path(path).stem),
        peers=int(peers if peers is not None else raw["peers"]),
        seed=int(raw.get("seed", 0)),
        links=links,
        churn=Churn(float(churn["mean_session_min"])) if churn else None,
        workload=dict(raw.get("workload", {})),
    )


def sim_ip(i: int) -> str:
    """Peer i's address: each of the first 16,384 peers in a /24 of its own, inside
    100.64.0.0/10 (shared address space: never routed on the internet, and unlike
    10/8 not exempt from the DHT's per-/24 diversity limits, which then apply as
    between home peers)."""
    return f"100.{64 + (i >> 8) % 64}.{i & 255}.{1 + (i >> 14) % 254}"
