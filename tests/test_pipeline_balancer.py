"""The stage balancer in a discrete-event simulation: shares follow speed, failures lose nothing.

Peers serve requests one at a time (FIFO) at a fixed number of samples per
second; a trainer keeps a fixed number of microbatches in flight. Time is
simulated, so the figures are exact and the test cannot flake.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest

from shoal.pipeline.balancer import NoPeerAvailable, StageBalancer

SAMPLES = 8  # per microbatch


@dataclass
class SimPeer:
    speed: float  # samples/s
    queue: deque = field(default_factory=deque)
    busy_until: float = 0.0
    alive: bool = True


class Simulation:
    def __init__(self, speeds: dict[str, float], in_flight: int, seed: int = 0) -> None:
        self.peers = {name: SimPeer(speed) for name, speed in speeds.items()}
        self.balancer = StageBalancer(rng=random.Random(seed))
        self.balancer.set_peers((name, None) for name in speeds)
        self.now = 0.0
        self.events: list[tuple[float, int, str, int]] = []  # (time, seq, peer, microbatch)
        self.seq = 0
        self.next_mb = 0
        self.in_flight = in_flight
        self.served: Counter[str] = Counter()
        self.done: Counter[int] = Counter()  # microbatch -> times applied
        self.completions: list[tuple[float, int]] = []

    def send(self, mb: int) -> None:
        peer = self.balancer.choose(self.now, SAMPLES)
        sim = self.peers[peer]
        start = max(self.now, sim.busy_until)
        sim.busy_until = start + SAMPLES / sim.speed
        sim.queue.append(mb)
        self.seq += 1
        heapq.heappush(self.events, (sim.busy_until, self.seq, peer, mb))

    def start(self) -> None:
        for _ in range(self.in_flight):
            self.send(self.next_mb)
            self.next_mb += 1

    def kill(self, name: str) -> None:
        """The peer dies: its queued requests fail at once (a reset connection)."""
        sim = self.peers[name]
        sim.alive = False
        lost = list(sim.queue)
        sim.queue.clear()
        self.events = [e for e in self.events if e[2] != name]
        heapq.heapify(self.events)
        self.balancer.failed(name, self.now)
        self.balancer.set_peers((n, None) for n, p in self.peers.items() if p.alive)
        for mb in lost:
            self.send(mb)  # the trainer still holds its inputs: re-sent, not lost

    def run_until(self, t_end: float) -> None:
        while self.events and self.events[0][0] <= t_end:
            self.now, _, peer, mb = heapq.heappop(self.events)
            sim = self.peers[peer]
            sim.queue.popleft()
            self.balancer.succeeded(peer, SAMPLES, SAMPLES / sim.speed, queue=len(sim.queue))
            self.served[peer] += 1
            self.done[mb] += 1
            self.completions.append((self.now, SAMPLES))
            self.send(self.next_mb)
            self.next_mb += 1
        self.now = t_end

    def rate(self, t0: float, t1: float) -> float:
        return sum(s for t, s in self.completions if t0 < t <= t1) / (t1 - t0)


def test_shares_follow_speed_and_throughput_nears_the_capacity_bound() -> None:
    sim = Simulation({"slow": 1.0, "mid": 2.0, "fast": 4.0}, in_flight=8)
    sim.start()
    sim.run_until(60.0)  # warm-up
    before = Counter(sim.served)
    sim.run_until(660.0)
    served = {p: sim.served[p] - before[p] for p in sim.peers}
    total = sum(served.values())
    for peer, speed in (("slow", 1), ("mid", 2), ("fast", 4)):
        assert served[peer] / total == pytest.approx(speed / 7, rel=0.2), served
    assert sim.rate(60.0, 660.0) >= 0.85 * 7.0


def test_a_killed_peer_loses_no_microbatch_and_throughput_recovers_within_10_s() -> None:
    sim = Simulation({"a": 2.0, "b": 2.0, "c": 4.0}, in_flight=8)
    sim.start()
    sim.run_until(100.0)
    sim.kill("c")
    sim.run_until(200.0)
    assert all(count == 1 for count in sim.done.values())  # none twice
    issued = set(range(sim.next_mb))
    pending = {mb for _, _, _, mb in sim.events}
    assert issued == set(sim.done) | pending  # none lost
    assert sim.rate(110.0, 200.0) >= 0.9 * 4.0  # the new bound: a + b


def test_a_new_peer_is_tried_at_once_and_a_failed_one_is_banned_with_backoff() -> None:
    balancer = StageBalancer(rng=random.Random(1))
    balancer.set_peers([("a", None)])
    for _ in range(5):
        balancer.choose(0.0, SAMPLES)
    balancer.set_peers([("a", None), ("new", None)])
    assert balancer.choose(0.0, SAMPLES) == "new"
    assert balancer.failed("new", 10.0) == 15.0
    assert all(balancer.choose(11.0, SAMPLES) == "a" for _ in range(10))
    assert balancer.failed("new", 30.0) == 30.0  # doubled
    balancer.reannounced("new")  # a newer record: the ban ends
    assert "new" in {balancer.choose(31.0, SAMPLES) for _ in range(20)}


def test_with_every_peer_banned_there_is_no_peer() -> None:
    balancer = StageBalancer()
    balancer.set_peers([("a", None)])
    balancer.failed("a", 0.0)
    with pytest.raises(NoPeerAvailable):
        balancer.choose(1.0, SAMPLES)
    assert balancer.choose(16.0, SAMPLES) == "a"


def test_announced_throughput_is_the_prior_until_measured() -> None:
    balancer = StageBalancer()
    balancer.set_peers([("gpu", 100.0), ("cpu", 1.0)])
    picks = Counter(balancer.choose(0.0, SAMPLES) for _ in range(101))
    assert picks["gpu"] >= 95
