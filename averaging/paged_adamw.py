"""AdamW's step over moments in a file (`averaging.paged`), a slice of a parameter at a time.

torch's AdamW steps a parameter whole: its two moments' pages all come into the
process, and its temporaries (the denominator: a square root and a quotient) are
two more tensors of the parameter's size. For the largest parameter of a model
(an embedding of a 50k vocabulary at width 4096: 800 MB) that is four times its
size on top of what the process holds between steps. Stepped in slices of
`SLICE_ELEMENTS` (whole pages), each slice's moments given back once stepped, the
step holds two slices' moments and two slices' temporaries, whatever the model.

The same bits as `optimizer.step()`: the slices go through torch's own single-tensor
AdamW (`torch.optim.adam.adam`, as AdamW calls it with `foreach=False`), whose
operations are elementwise, each from the step count the whole step starts from.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from .paged import PAGE, release, release_range

__all__ = ["SLICE_ELEMENTS", "slice_bytes", "step_in_slices"]

# 1 MiB of float32: a whole number of pages, so that releasing a slice's pages never
# drops one of the next slice's (each file tensor starts on a page of its own).
SLICE_ELEMENTS = 1 << 18
assert (SLICE_ELEMENTS * 4) % PAGE == 0


def slice_bytes(largest_parameter_bytes: int, element_bytes: int = 4) -> int:
    """The most bytes of one of a slice's tensors (a moment's, a temporary's)."""
    return min(largest_parameter_bytes, SLICE_ELEMENTS * element_bytes)


def step_in_slices(optimizer: torch.optim.AdamW) -> None:
    """`optimizer.step()` for an AdamW whose parameters (on the CPU, with `foreach`
    off) have their moments in file tensors: a slice at a time, the slices' moment
    pages given back as it goes, and each parameter's whole once it is stepped.
    Parameters without a gradient are left alone, as torch does."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = optimizer.state[p]
                step = state["step"]
                flat = [t.view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                before = (0, 0)  # the start and end of the slice stepped before
                for start in range(0, flat[0].numel(), SLICE_ELEMENTS):
                    param, grad, exp_avg, exp_avg_sq = (
                        t[start : start + SLICE_ELEMENTS] for t in flat
                    )
                    adam([param], [grad], [exp_avg], [exp_avg_sq], [], [step.clone()],
                         foreach=False, capturable=False, differentiable=False, fused=None,
                         grad_scale=None, found_inf=None, has_complex=False,
                         decoupled_weight_decay=True, amsgrad=group["amsgrad"], beta1=beta1,
                         beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                         eps=group["eps"], maximize=group["maximize"])  # fmt: skip
                    # This slice's moment pages, and the previous slice's again: reading
                    # one maps pages around those it touches, back into the one before
                    # (fault-around, large folios of the page cache: measured up to
                    # 6 MiB a parameter held after its step, not two slices').
                    end = start + exp_avg.numel()
                    for moment in flat[2:]:
                        address, size = moment.data_ptr(), moment.element_size()
                        release_range(address + before[0] * size, (end - before[0]) * size)
                    before = (start, end)
                step += 1
                release(state["exp_avg"])  # (the last slice's partial page too)
                release(state["exp_avg_sq"])
