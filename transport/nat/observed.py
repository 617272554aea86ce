"""Observed-address voting (sans-IO): which public address do peers see us at?

Each identify tells us the address a peer sees our connection coming from. A
single peer may lie or sit behind the same NAT as we do, so an address is
*trusted* only once `threshold` distinct peers report it. Each observer has one
vote (its latest report); votes expire after `ttl` seconds unless renewed.

Only observations of connections whose local port is our listen port count:
with port reuse those show the NAT mapping of the listen port, which is what
others can dial (or punch to); an ephemeral port's mapping says nothing.
"""

from __future__ import annotations

from collections import Counter

from ..identity import PeerID
from ..multiaddr import Multiaddr


class ObservedAddresses:
    def __init__(self, threshold: int = 2, ttl: float = 1800.0, max_observers: int = 1024) -> None:
        if threshold < 1:
            raise ValueError("threshold must be at least 1")
        self.threshold = threshold
        self.ttl = ttl
        self.max_observers = max_observers
        self._votes: dict[PeerID, tuple[Multiaddr, float]] = {}  # observer -> (addr, when)

    def record(self, observer: PeerID, addr: Multiaddr, now: float) -> bool:
        """Count `observer`'s report; True when the trusted set changed."""
        before = self.trusted(now)
        self._expire(now)
        if observer not in self._votes and len(self._votes) >= self.max_observers:
            oldest = min(self._votes, key=lambda p: self._votes[p][1])
            del self._votes[oldest]
        self._votes[observer] = (addr.without_peer_id(), now)
        return self.trusted(now) != before

    def candidates(self, now: float) -> list[tuple[Multiaddr, int]]:
        """Every reported address with its number of observers, most reported first."""
        counts = Counter(a for a, t in self._votes.values() if now - t < self.ttl)
        return sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))

    def trusted(self, now: float) -> list[Multiaddr]:
        return [a for a, n in self.candidates(now) if n >= self.threshold]

    def best_guess(self, now: float) -> list[Multiaddr]:
        """Trusted addresses, or else the most reported ones (for hole punching, which
        is a try anyway, a single observer's view beats nothing)."""
        trusted = self.trusted(now)
        if trusted:
            return trusted
        cands = self.candidates(now)
        return [a for a, n in cands if n == cands[0][1]] if cands else []

    def observed_by(self, observer: PeerID, now: float) -> Multiaddr | None:
        entry = self._votes.get(observer)
        return entry[0] if entry is not None and now - entry[1] < self.ttl else None

    def _expire(self, now: float) -> None:
        stale = [p for p, (_, t) in self._votes.items() if now - t >= self.ttl]
        for p in stale:
            del self._votes[p]
