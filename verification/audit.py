"""The judgment of one audit: does a recomputed segment agree with what the
prover revealed, within the honest tolerance?

Both results are signed with the referee's LSH seed (`referees.RoundDraw.
lsh_seed`, drawn after the reveal) and compared: the sign bits must disagree
in at most the binomial threshold for `threshold_angle` at the target false-
positive rate (`lsh.flip_threshold`), and the mean gap of the blocks' log2
norms must stay under `norm_gap_limit` (angles are blind to scale).

The defaults come from `python bench/verification.py --calibrate` on the
built-in task: over 3-step segments the largest honest angle was 7.9e-4
(thread counts and summation orders differing), so 4x that is the threshold;
1e-2 relative noise per step shows an angle of 0.067, sign flips pi, another
shard's data or a stale start well above 0.1. Longer segments widen the
honest floor (1e-2 over 10 steps): audits re-run short segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .evidence import Result
from .lsh import Comparison, SignatureConfig, compare, flip_threshold, sign

__all__ = ["AuditPolicy", "Judgment", "judge"]


@dataclass(frozen=True)
class AuditPolicy:
    """How audits are run and judged (an experiment's manifest carries one)."""

    rate: float = 0.05  # audit probability per contribution
    probation_rate: float = 0.5  # for peers on probation
    segment_steps: int = 3  # inner steps per committed checkpoint, re-run by an audit
    threshold_angle: float = 3.2e-3
    norm_gap_limit: float = 4 / 256  # four quantization steps of the log2 norm
    false_positive_rate: float = 1e-6  # per check, for the flip threshold

    def __post_init__(self) -> None:
        if not (0 <= self.rate <= 1 and 0 <= self.probation_rate <= 1):
            raise ValueError("audit rates must be in [0, 1]")
        if self.segment_steps < 1 or self.threshold_angle <= 0 or self.norm_gap_limit <= 0:
            raise ValueError("segment_steps, threshold_angle and norm_gap_limit must be positive")
        if not 0 < self.false_positive_rate < 1:
            raise ValueError("false_positive_rate must be in (0, 1)")


@dataclass(frozen=True)
class Judgment:
    result: Result
    comparison: Comparison
    flip_limit: int


def judge(
    revealed: torch.Tensor,
    recomputed: torch.Tensor,
    seed: bytes,
    policy: AuditPolicy | None = None,
    config: SignatureConfig | None = None,
) -> Judgment:
    """Compare what the prover revealed with our recomputation of the same segment."""
    policy = policy or AuditPolicy()
    if revealed.numel() != recomputed.numel():
        raise ValueError("the revealed and recomputed results differ in size")
    c = compare(sign(revealed, seed, config), sign(recomputed, seed, config))
    limit = flip_threshold(c.bits, policy.threshold_angle, policy.false_positive_rate)
    ok = c.flips <= limit and c.mean_log2_norm_gap <= policy.norm_gap_limit
    return Judgment(Result.PASS if ok else Result.FAIL, c, limit)
