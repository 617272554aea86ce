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

from collections.abc import Sequence

import torch

__all__ = ["centered_clip", "weighted_mean"]


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
