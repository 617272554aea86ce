"""How long a member that failed a verified round is left out of our rounds.

A member that withholds its round secret makes the round's draw unprovable (nobody
in it can be convicted), and a prover that does not reveal cannot be checked. Both
look exactly like an honest peer that crashed, restarted (its secret and its work
are lost) or sat behind a partition: nothing tells the two apart, so neither may
ban. We leave the member out of our rounds for a while instead.

How long: short at first, doubling for a repeat offender. A flat 600 s (the rule
until stop 27) let a swarm under churn shun a third of its honest peers at any
time: in the eleventh soak two peers began every round with 5-8 peers shunned and
averaged alone for the swarm's longest gaps. An honest peer fails a round rarely
and gets `FIRST_SHUN_S`; one that withholds whenever it is let back in gets
`MAX_SHUN_S` from its sixth offence on, which is the old rule. One strike is
forgiven per `STRIKE_DECAY_S`: slower than the longest shun, so a persistent
withholder never climbs back down, while one failure an hour stays at the first
step.

Sans-I/O: the caller passes the clock and applies the shun.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.transport.identity import PeerID

__all__ = ["FIRST_SHUN_S", "MAX_SHUN_S", "STRIKE_DECAY_S", "Shunning"]

FIRST_SHUN_S = 30.0  # a first offence: a few rounds
MAX_SHUN_S = 600.0  # a repeat offender's, from its sixth offence in quick succession
STRIKE_DECAY_S = 1800.0  # one strike forgiven per this long (> MAX_SHUN_S)
_KEEP_ROUNDS = 64  # (peer, round) offences remembered, so one round counts once


@dataclass
class _Record:
    strikes: float
    at: float  # when `strikes` was last updated (monotonic)


class Shunning:
    """Strikes per peer, decaying with time; each offence sets the next shun."""

    def __init__(self) -> None:
        self._records: dict[PeerID, _Record] = {}
        self._counted: dict[tuple[PeerID, int], None] = {}  # insertion-ordered
        self.shuns = 0  # offences that set a shun, since start

    def strikes(self, peer: PeerID, now: float) -> float:
        """`peer`'s strikes at `now`, after decay."""
        record = self._records.get(peer)
        if record is None:
            return 0.0
        return max(0.0, record.strikes - (now - record.at) / STRIKE_DECAY_S)

    def offend(self, peer: PeerID, round_index: int, now: float) -> float | None:
        """`peer` failed round `round_index` (withheld its secret, or did not reveal):
        how long to leave it out of our rounds, or None when that round's failure was
        already counted (a member that restarted both withholds and cannot reveal)."""
        key = (peer, round_index)
        if key in self._counted:
            return None
        self._counted[key] = None
        while len(self._counted) > _KEEP_ROUNDS:
            del self._counted[next(iter(self._counted))]
        strikes = self.strikes(peer, now) + 1.0
        self._forget_forgiven(now)
        self._records[peer] = _Record(strikes, now)
        self.shuns += 1
        return shun_seconds(strikes)

    def _forget_forgiven(self, now: float) -> None:
        """Drop peers whose strikes have all decayed (the table stays bounded by the
        peers that failed rounds recently)."""
        forgiven = [p for p in self._records if self.strikes(p, now) == 0.0]
        for peer in forgiven:
            del self._records[peer]


def shun_seconds(strikes: float) -> float:
    """The shun after an offence that brought a peer to `strikes` (>= 1): doubling
    from `FIRST_SHUN_S` per whole strike, at most `MAX_SHUN_S`."""
    level = max(1, math.ceil(strikes - 1e-9))
    return min(MAX_SHUN_S, FIRST_SHUN_S * 2.0 ** (level - 1))
