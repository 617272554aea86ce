"""Tampered code for the end-to-end verification test (on the PYTHONPATH of one
daemon only): after every inner step, relative noise of 1e-2 is added to the
parameters, the cheat `bench/verification.py` calls `noise_1e-2`. Everything
else (commitments, reveals) is the honest code: the peer commits to what it
really did, and the audit finds that what it did is not training."""

import torch

from shoal.peer.training import inner

_honest_step = inner.InnerOptimizer.step


def _noisy_step(self: inner.InnerOptimizer, loss_of, step_index):  # type: ignore[no-untyped-def]
    loss = _honest_step(self, loss_of, step_index)
    with torch.no_grad():
        for p in self.model.parameters():
            p.add_(torch.randn_like(p) * 1e-2 * p.norm() / p.numel() ** 0.5)
    return loss


inner.InnerOptimizer.step = _noisy_step  # type: ignore[method-assign]
