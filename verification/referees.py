"""A round's shared randomness and what it decides: whose work is audited,
which segment of it, and who referees. Nobody picks.

Every member commits to a secret (`seed_commit` in its `Commitment`) and
reveals it once every member has committed; the round's seed hashes the
members' secrets in peer-ID order. A prover therefore cannot know, while it
commits, whether it will be audited, on which segment, or by whom; and no
auditor can choose whom it audits or who referees a dispute. A member that
withholds its secret (or reveals one that does not match) is left out of the
seed and audited for sure: withholding never lowers one's own audit odds. Secrets
check against their commitments, so members forward the ones they receive and
a member cannot reveal to some and not to others. The last member to reveal can
still choose between two seeds (revealing or withholding), which biases the
draws of *others* by that one bit of choice; but only a draw with every secret
is provable in evidence (`evidence.Evidence.check`), so a withholder gains no
say in who can convict anyone, and the peers it withheld from see it.

The draws are deterministic functions of the round's commitments and secrets,
so anyone holding them (an evidence bundle carries them) recomputes who the
referees were.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.transport.identity import PeerID

from .commitment import Commitment

__all__ = ["SECRET_BYTES", "RoundDraw", "new_secret", "seed_commit"]

SECRET_BYTES = 32
_SECRET_TAG = b"shoal/round-secret/1\0"
_SEED_TAG = b"shoal/round-seed/1\0"
_DRAW_TAG = b"shoal/draw/1\0"


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def seed_commit(secret: bytes) -> bytes:
    """What a commitment carries for its secret (`Commitment.seed_commit`)."""
    return hashlib.sha256(_SECRET_TAG + secret).digest()


@dataclass(frozen=True)
class RoundDraw:
    """Everything drawn from one round's revealed secrets."""

    experiment: str
    round: int
    seed: bytes
    members: tuple[PeerID, ...]  # every member that committed, in peer-ID order
    withheld: frozenset[PeerID]  # members whose secret is missing or does not match

    @classmethod
    def from_reveals(
        cls, commitments: Sequence[Commitment], secrets: Mapping[PeerID, bytes]
    ) -> RoundDraw:
        """The draw of a round from its members' commitments and revealed secrets.
        ValueError when the commitments are not one round's."""
        if not commitments:
            raise ValueError("a round has at least one commitment")
        first = commitments[0]
        if any(c.experiment != first.experiment or c.round != first.round for c in commitments):
            raise ValueError("commitments of different experiments or rounds")
        ordered = sorted(commitments, key=lambda c: c.prover.to_bytes())
        members = tuple(c.prover for c in ordered)
        if len(set(members)) != len(members):
            raise ValueError("two commitments of one member")
        h = hashlib.sha256(_SEED_TAG + first.experiment.encode() + first.round.to_bytes(8, "big"))
        withheld = set()
        for c in ordered:
            secret = secrets.get(c.prover)
            good = secret is not None and seed_commit(secret) == c.seed_commit
            if not good:
                withheld.add(c.prover)
            h.update(c.prover.to_bytes() + (secret if good and secret is not None else b""))
        return cls(first.experiment, first.round, h.digest(), members, frozenset(withheld))

    def _hash(self, *parts: bytes) -> bytes:
        h = hashlib.sha256(_DRAW_TAG + self.seed)
        for part in parts:
            h.update(len(part).to_bytes(4, "big") + part)
        return h.digest()

    def _uniform(self, *parts: bytes) -> float:
        """A number in [0, 1) drawn from the seed and `parts`."""
        return int.from_bytes(self._hash(*parts)[:8], "big") / 2**64

    def audited(self, prover: PeerID, rate: float) -> bool:
        """Whether `prover`'s contribution is audited at audit probability `rate`."""
        if prover in self.withheld:
            return True
        return self._uniform(b"audit", prover.to_bytes()) < rate

    def segment(self, prover: PeerID, segments: int) -> int:
        """Which segment of `prover`'s inner run is re-executed."""
        if segments < 1:
            raise ValueError("segments must be >= 1")
        return int.from_bytes(self._hash(b"segment", prover.to_bytes()), "big") % segments

    def referees(self, prover: PeerID, count: int = 3) -> tuple[PeerID, ...]:
        """Who checks `prover`'s work: the first is the auditor, the next ones
        referee a dispute. Members only, never the prover."""
        others = [m for m in self.members if m != prover]
        others.sort(key=lambda m: self._hash(b"referee", prover.to_bytes(), m.to_bytes()))
        return tuple(others[:count])

    def lsh_seed(self, prover: PeerID, revealed: bytes, verifier: PeerID) -> bytes:
        """The projection seed `verifier` compares with: it depends on the revealed
        state's hash, so it exists only after the prover revealed (a perturbation
        orthogonal to it cannot be prepared), and differs per verifier."""
        return self._hash(b"lsh", prover.to_bytes(), revealed, verifier.to_bytes())
