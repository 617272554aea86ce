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

__all__ = ["centered_clip", "norm_clip_scales", "weighted_mean"]


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
