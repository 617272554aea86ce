"""Global gradient clipping across a pipeline's stages: the norms each stage claims, sans-I/O.

One process clips the whole model's gradient g to `max_norm` by the factor
`min(1, max_norm / (|g| + 1e-6))` (torch's `clip_grad_norm_`). A pipeline holds g
in pieces, one per stage, so for step v each stage's peers square the norm of
their stage's mean gradient after its all-reduce (the same on every peer of the
stage, `stage_squared_norm`), claim it for the other stages to read
(`clip_exchange` carries the claims) and, once they know every stage's, scale by
the same factor from the sum (`clip_factor`).

A claim is what some peer says: `NormClaims` takes a stage's squared norm for v
from the claims of the peers listed as serving it, as the value claimed by the
most distinct peers, and only once `min(2, n)` of them claim it, `n` being the
larger of the step group the stage's claims state and the number of peers its
records show serving it at v. Peers known not to claim v are not waited for: a
peer whose own record is past v and which claimed nothing for v (its round
aborted while its partners committed, and it re-synced) counts neither among
those serving nor in the group. Every honest peer of the stage claims the same
bits, so a lone liar cannot set a stage's value where two or more peers serve it
(itself among them): it never reaches two claimants alone, and claiming first
gains it nothing. A stage whose claims tie, or whose claims do not
arrive by the deadline, counts as missing: the step then clips by the stages
that did settle (it clips at least as much as each of them needs alone, never
less than its own stage needs) and is counted as a fallback.

Squared norms are summed in float64 and rounded to float32 before they are
claimed or used: peers on different processors may add the same floats in
another order, and the rounding makes them agree bit for bit (short of a sum
within ~1e-16 of a rounding boundary).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from shoal.transport.identity import PeerID

__all__ = [
    "CLAIM_QUORUM",
    "ClipDecision",
    "NormClaims",
    "clip_factor",
    "rounded",
    "stage_squared_norm",
]

CLAIM_QUORUM = 2  # distinct peers of a stage that must agree on its norm (if it had as many)
MAX_GROUP = 1 << 16  # a claim's group size beyond this is not believed
EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def rounded(squared: float) -> float:
    """A squared norm as claimed and used: rounded to float32 (see the module's note)."""
    return float(torch.tensor(squared, dtype=torch.float64).to(torch.float32))


def stage_squared_norm(gradients: Iterable[torch.Tensor]) -> float:
    """The squared L2 norm of one stage's gradients, accumulated in float64, rounded."""
    total = 0.0
    for g in gradients:
        total += float(torch.linalg.vector_norm(g.detach(), dtype=torch.float64)) ** 2
    return rounded(total)


def clip_factor(squared_norms: Iterable[float], max_norm: float) -> float:
    """What every stage multiplies its gradient by: torch's `clip_grad_norm_` factor
    over the whole model, from the stages' squared norms (added in stage order)."""
    total = math.sqrt(math.fsum(squared_norms))
    return min(1.0, max_norm / (total + EPS))


def _at(values: Sequence[int], i: int) -> int:
    return values[i] if i < len(values) else 0


@dataclass(frozen=True)
class ClipDecision:
    """The factor a stage scales its step's gradient by, and how it was reached."""

    factor: float
    squared_norms: tuple[float | None, ...]  # per stage; None: missing (not settled)

    @property
    def fell_back(self) -> bool:
        """Some stage's norm was missing: the factor is over the others only."""
        return any(n is None for n in self.squared_norms)


@dataclass(frozen=True)
class _Claim:
    squared: float
    group: int


class NormClaims:
    """The squared norms claimed for one step (version) of a pipeline, per stage."""

    def __init__(self, stages: int) -> None:
        self.stages = stages
        self._claims: list[dict[PeerID, _Claim]] = [{} for _ in range(stages)]

    def add(self, stage: int, peer: PeerID, squared: object, group: object) -> bool:
        """A peer's claim; False (and ignored) when it is malformed. The caller checks
        that `peer` serves `stage` (its stage record) and signed the claim. A peer's
        newer claim replaces its older one."""
        if not 0 <= stage < self.stages:
            return False
        if isinstance(squared, bool) or not isinstance(squared, int | float):
            return False
        if not math.isfinite(squared) or squared < 0:
            return False
        if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= MAX_GROUP:
            return False
        value = rounded(float(squared))
        if not math.isfinite(value):  # (beyond float32)
            return False
        self._claims[stage][peer] = _Claim(value, group)
        return True

    def claimants(self, stage: int) -> Mapping[PeerID, float]:
        return {p: c.squared for p, c in self._claims[stage].items()}

    def settled(self, stage: int, serving: int = 0, skipped: int = 0) -> float | None:
        """Stage `stage`'s squared norm, once enough of its peers agree on one (None: not yet,
        or a tie). `serving`: how many peers the stage's records show at the step's
        version or past it (a lone claim of a stage that more peers serve needs a second);
        `skipped`: how many of the step's group are known not to claim it (their own
        records are past the step and they claimed nothing: their round aborted and they
        re-synced), whom a claim's group size then does not wait for."""
        claims = self._claims[stage].values()
        if not claims:
            return None
        group = max(c.group for c in claims) - skipped
        need = min(CLAIM_QUORUM, max(serving, group))
        votes: dict[float, int] = {}
        for c in claims:
            votes[c.squared] = votes.get(c.squared, 0) + 1
        ranked = sorted(votes.items(), key=lambda kv: -kv[1])
        best, count = ranked[0]
        if count < need or (len(ranked) > 1 and ranked[1][1] == count):
            return None
        return best

    def disputed(self, stage: int, serving: int = 0, skipped: int = 0) -> list[PeerID]:
        """The peers whose claim for `stage` differs from its settled value (liars, or
        peers that left the step's group): for the status, not a conviction."""
        value = self.settled(stage, serving, skipped)
        if value is None:
            return []
        return [p for p, c in self._claims[stage].items() if c.squared != value]

    def decide(
        self,
        max_norm: float,
        own: tuple[int, float],
        serving: Sequence[int] = (),
        *,
        final: bool = False,
        skipped: Sequence[int] = (),
    ) -> ClipDecision | None:
        """The factor once every stage's norm settled; with `final` (the deadline), over
        the stages that did (the others count as missing). `own`: our stage and its
        squared norm, which we computed ourselves (no claim needed); `serving` and
        `skipped`: per stage, as `settled` takes them."""
        mine, squared = own
        norms = tuple(
            rounded(squared) if s == mine else self.settled(s, _at(serving, s), _at(skipped, s))
            for s in range(self.stages)
        )
        if any(n is None for n in norms) and not final:
            return None
        return ClipDecision(clip_factor((n for n in norms if n is not None), max_norm), norms)
