"""Byzantine-robust aggregation: CenteredClip (Karimireddy et al. 2021; BTARD 2022).

The weighted mean lets one peer move the average anywhere: a x100 or
sign-flipped pseudo-gradient dominates it. CenteredClip starts at the
coordinate-wise median and moves towards each contribution by at most `tau`
(in L2), so a contribution's pull on the result is bounded whatever it holds.
Honest contributions within `tau` of the centre pass unclipped, and then the
result is the weighted mean.

Determinism: a fixed number of iterations, float64 accumulation in the
members' order. In the all-reduce each part is reduced by its owner alone and
the result sent to everyone, so members hold bit-identical results whatever
their hardware.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "WEIGHT_OVER_MEDIAN",
    "capped_weights",
    "centered_clip",
    "norm_clip_scales",
    "weighted_mean",
]

# The most a member's weight (its claimed samples) counts in a robust reduction, as a
# multiple of the lower median of the round's positive weights. 2: a DiLoCo member
# whose last round failed honestly brings two rounds of samples.
WEIGHT_OVER_MEDIAN = 2.0


def weighted_mean(values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum(w_i x_i) / sum(w_i), in float64 in member order, rounded once to float32."""
    total = float(sum(weights))
    acc = torch.zeros(values[0].shape, dtype=torch.float64)
    for v, w in zip(values, weights, strict=True):
        acc.add_(v.double(), alpha=w / total)
    return acc.float()


def centered_clip(
    values: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    tau: float | None = None,
    iterations: int = 20,
) -> torch.Tensor:
    """The CenteredClip aggregate of `values` (same shape), weighted by `weights`.

    v <- median; repeat: v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||) / sum_i w_i.
    Without `tau`, it is the median distance of the contributions from the
    coordinate-wise median: honest contributions, the majority, sit within it,
    and no fixed constant has to match the scale of the model's updates.
    """
    if not values or len(values) != len(weights):
        raise ValueError("one weight per value, at least one value")
    if (tau is not None and tau <= 0) or iterations < 0:
        raise ValueError("tau must be positive and iterations >= 0")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("the weights must sum to a positive number")
    stacked = torch.stack([v.detach().reshape(-1).double() for v in values])
    # The lower median: deterministic for an even count.
    centre = stacked.median(dim=0).values
    if tau is None:
        distances = torch.linalg.vector_norm(stacked - centre, dim=1)
        tau = max(float(distances.median()), 1e-30)
    for _ in range(iterations):
        step = torch.zeros_like(centre)
        for x, w in zip(stacked, weights, strict=True):
            diff = x - centre
            norm = float(torch.linalg.vector_norm(diff))
            scale = 1.0 if norm <= tau else tau / norm
            step.add_(diff, alpha=w * scale / total)
        centre += step
    return centre.float().reshape(values[0].shape)


def norm_clip_scales(norms: Sequence[float]) -> list[float]:
    """The factor each contribution is scaled by so that none is longer than the lower
    median of `norms`: CenteredClip's bound for sparse contributions.

    Sparse messages (chunked top-k, a DCT's largest coefficients) keep a percent or two
    of the coordinates each, mostly different ones, so the coordinate-wise median that
    CenteredClip starts from is zero nearly everywhere and tells nothing; the centre is
    zero, and clipping around it is clipping norms. With a majority of honest members
    the median is an honest member's norm, so a member's pull on the mean is bounded by
    what an honest one could do, whatever it sent. A pure function of the norms (no
    summation): the same factors on every member.
    """
    if not norms:
        return []
    if any(not (n >= 0 and math.isfinite(n)) for n in norms):
        raise ValueError("norms must be finite and >= 0")
    tau = sorted(norms)[(len(norms) - 1) // 2]
    return [1.0 if n <= tau else tau / n for n in norms]


def capped_weights(
    weights: Sequence[float], over_median: float = WEIGHT_OVER_MEDIAN
) -> list[float]:
    """`weights` with each positive one capped at `over_median` times the lower median
    of the positive ones.

    A weight is the sender's claim (the samples behind its contribution). Clipping a
    contribution's norm bounds where it pulls the result; without a bound on its
    weight, a liar claiming a billion samples still decides the mean within that
    bound alone. With a majority of honest members the median is an honest weight, so
    a liar counts at most `over_median` honest members. Zero weights (members that
    bring nothing) stay zero. A pure function of the weights: the same on every member.
    """
    if any(not (w >= 0 and math.isfinite(w)) for w in weights):
        raise ValueError("weights must be finite and >= 0")
    if not over_median >= 1:
        raise ValueError("over_median must be >= 1")
    positive = sorted(w for w in weights if w > 0)
    if not positive:
        return list(weights)
    cap = positive[(len(positive) - 1) // 2] * over_median
    return [min(w, cap) for w in weights]
