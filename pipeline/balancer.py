"""Choosing the peer of a stage for each microbatch: SWARM's throughput-weighted balancer.

Sans-I/O: the trainer tells it which peers serve the stage (from the DHT),
what each request cost and when a peer failed; it answers which peer to send
the next request to.

Each peer has a *virtual time*: the time at which it would finish the work
already given to it, at its measured speed. A request goes to the peer with
the smallest virtual time, which then advances by the request's size over the
peer's throughput (SWARM's ExpertBalancer). A peer twice as fast advances half
as far per request and so gets twice the requests: shares follow measured
throughput, and a slow or overloaded peer drifts behind without being
starved. New peers enter at the current minimum, so they are tried at once.

Throughput is an exponential moving average of samples per second measured
by the trainer (request round trip, queue included), bias-corrected so the
first measurements count fully. The queue length a peer reports in every
response lengthens its virtual time, so trainers that do not see each other's
traffic still spread out. A failed peer is banned with exponential backoff
(15 s, then x2, as Petals); a ban ends early only when the peer announces
itself again with a newer record.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["NoPeerAvailable", "StageBalancer"]

BACKWARD_COST = 2.5  # a backward request (recompute + backprop) against a forward one


class NoPeerAvailable(Exception):
    """Every peer of the stage is banned or none serves it."""


@dataclass(slots=True)
class _Peer:
    virtual_time: float
    throughput: float  # samples/s, bias-corrected EMA (a prior until measured)
    ema: float = 0.0
    ema_weight: float = 0.0
    queue: int = 0
    banned_until: float = 0.0
    ban_seconds: float = 0.0
    in_flight: int = 0
    returning: bool = False  # banned: re-enters at the others' minimum, not with a credit
    failing: bool = False  # failed, and neither answered nor re-announced itself since


@dataclass(frozen=True)
class PeerView:
    """What the balancer knows of one peer, for status pages."""

    measured: float | None  # work units/s it measured (None: only a prior so far)
    queue: int  # requests the peer last said were queued behind ours
    in_flight: int  # our requests to it not answered yet
    banned_until: float  # (monotonic time; 0: not banned)
    failing: bool = False  # its last request failed (a ban that ran out is not an answer)


class StageBalancer:
    """Routes the requests of one stage among the peers that serve it."""

    def __init__(
        self,
        *,
        alpha: float = 0.1,
        prior_throughput: float = 1.0,
        ban_base: float = 15.0,
        ban_max: float = 300.0,
        rng: random.Random | None = None,
    ) -> None:
        self.alpha = alpha
        self.prior = prior_throughput
        self.ban_base = ban_base
        self.ban_max = ban_max
        self._rng = rng or random.Random()
        self._peers: dict[Hashable, _Peer] = {}
        self._excluded: set[Hashable] = set()  # convicted or caught cheating: never again

    # -- what the DHT says

    def set_peers(self, peers: Iterable[tuple[Hashable, float | None]]) -> None:
        """The stage's serving peers with their announced throughput (None: unknown).

        Known peers keep their measurements; new ones enter at the minimum
        virtual time, so they are tried at once; peers no longer listed go.
        """
        listed = {p: s for p, s in peers if p not in self._excluded}
        for peer in list(self._peers):
            if peer not in listed:
                del self._peers[peer]
        # Just below the minimum: a newcomer gets the next request, then competes.
        floor = self._min_virtual_time() - 1e-9
        # Unannounced and unmeasured, a newcomer is taken for a typical peer of the stage
        # (not for the prior: one request at a made-up speed would put it far behind).
        known = sorted(s.throughput for s in self._peers.values() if s.ema_weight > 0)
        typical = known[len(known) // 2] if known else self.prior
        for peer, announced in listed.items():
            if peer not in self._peers:
                prior = announced if announced and announced > 0 else typical
                self._peers[peer] = _Peer(virtual_time=floor, throughput=prior)

    def reannounced(self, peer: Hashable) -> None:
        """A newer DHT record of `peer`: a ban on it ends (it says it is back)."""
        state = self._peers.get(peer)
        if state is not None:
            state.banned_until = 0.0
            state.failing = False

    def snapshot(self) -> dict[Hashable, PeerView]:
        """Every routed peer's view (a copy)."""
        return {
            peer: PeerView(
                s.throughput if s.ema_weight > 0 else None,
                s.queue,
                s.in_flight,
                s.banned_until,
                s.failing,
            )
            for peer, s in self._peers.items()
        }

    def exclude(self, peer: Hashable) -> None:
        """Never route to `peer` again (it was convicted of cheating)."""
        self._excluded.add(peer)
        self._peers.pop(peer, None)

    # -- routing

    def choose(self, now: float, samples: int, *, backward: bool = False) -> Hashable:
        """The peer for a request of `samples` samples; raises NoPeerAvailable."""
        live = [(p, s) for p, s in self._peers.items() if s.banned_until <= now]
        if not live:
            raise NoPeerAvailable("no peer serves this stage right now")
        settled = [s.virtual_time for _, s in live if not s.returning]
        for _, s in live:
            if s.returning:
                s.virtual_time = max(s.virtual_time, min(settled, default=s.virtual_time))
                s.returning = False
        best = min(s.virtual_time for _, s in live)
        # Ties (new peers, equal speeds) are broken at random, not by name.
        tied = [(p, s) for p, s in live if s.virtual_time <= best + 1e-15]
        peer, state = tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        cost = samples * (BACKWARD_COST if backward else 1.0)
        # Requests of other trainers queued at the peer delay ours too.
        others = max(0, state.queue - state.in_flight)
        state.virtual_time += cost * (1 + others) / state.throughput
        state.in_flight += 1
        return peer

    def succeeded(
        self,
        peer: Hashable,
        samples: int,
        seconds: float,
        *,
        queue: int = 0,
        backward: bool = False,
    ) -> None:
        """A request to `peer` came back; `seconds` is what the peer spent computing it
        (its report; the round trip if it gave none) and `queue` the requests it
        had waiting. Throughput is learnt from compute time, queueing from the
        queue: a round trip would count our own queued requests against it."""
        state = self._peers.get(peer)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        state.queue = max(0, queue)
        state.ban_seconds = 0.0
        state.failing = False
        cost = samples * (BACKWARD_COST if backward else 1.0)
        speed = cost / max(seconds, 1e-6)
        state.ema = (1 - self.alpha) * state.ema + self.alpha * speed
        state.ema_weight = (1 - self.alpha) * state.ema_weight + self.alpha
        old, state.throughput = state.throughput, state.ema / state.ema_weight
        # The work queued on it was priced at the old speed: reprice its lead over the
        # stage (a first request priced at a made-up prior must not idle it for long).
        floor = self._min_virtual_time()
        if state.virtual_time > floor:
            state.virtual_time = floor + (state.virtual_time - floor) * old / state.throughput

    def failed(self, peer: Hashable, now: float, *, answered: bool = False) -> float:
        """A request to `peer` failed or timed out: ban it; returns the ban's length.
        `answered`: the peer itself refused it (behind its stage, re-syncing): banned
        as well, but it is alive, not `failing`."""
        state = self._peers.get(peer)
        if state is None:
            return 0.0
        state.in_flight = max(0, state.in_flight - 1)
        state.failing = state.failing if answered else True
        if state.banned_until > now:
            # Requests sent before the ban fail with it: one fault, not several.
            return state.banned_until - now
        state.ban_seconds = min(self.ban_max, state.ban_seconds * 2 or self.ban_base)
        state.banned_until = now + state.ban_seconds
        state.returning = True
        return state.ban_seconds

    def expected_seconds(self, peer: Hashable, samples: int, *, backward: bool = False) -> float:
        """How long a request to `peer` should take at its measured speed, behind the
        requests it reported queued (for the request's deadline)."""
        state = self._peers.get(peer)
        if state is None:
            return 0.0
        cost = samples * (BACKWARD_COST if backward else 1.0)
        return cost * (1 + state.queue + state.in_flight) / state.throughput

    def throughput(self, peer: Hashable) -> float | None:
        state = self._peers.get(peer)
        return None if state is None else state.throughput

    def peers(self) -> list[Hashable]:
        return list(self._peers)

    def _min_virtual_time(self) -> float:  # where newcomers enter
        return min((s.virtual_time for s in self._peers.values()), default=0.0)


def capacity_bound(speeds: Iterable[float]) -> float:
    """Samples/s a stage can serve at most: the sum of its peers' speeds."""
    return math.fsum(speeds)
