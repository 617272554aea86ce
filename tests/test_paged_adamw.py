"""AdamW stepped in slices over moments in a file (`averaging.paged_adamw`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.averaging import paged_adamw
from shoal.averaging.paged import file_tensors
from shoal.averaging.paged_adamw import SLICE_ELEMENTS, slice_bytes, step_in_slices

from .test_pipeline_stage_memory import resident_kib

pytestmark = pytest.mark.timeout(60)

FAULT_AROUND = 64 << 10

# One parameter of two slices and a ragged tail, one smaller than a slice, one that
# gets no gradient.
SHAPES = [(2 * SLICE_ELEMENTS // 512 + 3, 512), (333,), (7, 5)]


def _adamw(
    params: list[torch.nn.Parameter], moments: list[torch.Tensor] | None
) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95),
                                  foreach=False)  # fmt: skip
    for i, p in enumerate(params):
        state = optimizer.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p) if moments is None else moments[i]
        state["exp_avg_sq"] = torch.zeros_like(p) if moments is None else moments[len(params) + i]
    return optimizer


def test_a_step_in_slices_gives_the_bits_of_adamws_own_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    whole = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    sliced = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    reference = _adamw(whole, None)
    moments = file_tensors(tmp_path, [(p.shape, p.dtype) for p in sliced] * 2)
    paged = _adamw(sliced, moments)
    for step in range(4):
        for a, b in zip(whole[:-1], sliced[:-1], strict=True):  # (the last: no gradient)
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        for optimizer in (reference, paged):
            for group in optimizer.param_groups:  # (a warmup: the rate changes per step)
                group["lr"] = 3e-3 * min(1.0, (step + 1) / 3)
        reference.step()
        step_in_slices(paged)
        for a, b in zip(whole, sliced, strict=True):
            assert torch.equal(a, b)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(reference.state[a][k], paged.state[b][k]), (step, k)
    assert float(paged.state[sliced[0]]["step"]) == 4
    assert float(paged.state[sliced[-1]]["step"]) == 0  # (never had a gradient)


def test_a_step_in_slices_holds_one_slices_moments_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a slice is stepped, the process holds the pages of that slice's moments
    and of no other but the few the kernel maps around a page touched (the
    parameter's moments are 8 MiB and more); after the step, none."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES[:1]]
    moments = file_tensors(tmp_path, [(p.shape, p.dtype) for p in params] * 2)
    optimizer = _adamw(params, moments)
    params[0].grad = torch.randn_like(params[0])
    held: list[int] = []
    adam = paged_adamw.adam

    def counting(*args: object, **kwargs: object) -> None:
        held.append(resident_kib(moments[0]) * 1024)  # (one mapping holds both moments)
        adam(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_adamw, "adam", counting)
    step_in_slices(optimizer)
    assert len(held) == 3
    # Before each slice: at most what the kernel mapped around the last page the slice
    # before touched (its fault-around: 64 KiB by default), per moment.
    assert max(held) <= 2 * FAULT_AROUND
    assert resident_kib(moments[0]) == 0
    assert moments[0].abs().sum() > 0  # (stepped: in the file)


def test_a_slice_is_a_mebibyte_of_float32_or_the_largest_parameter_when_smaller() -> None:
    assert slice_bytes(100 << 20) == 1 << 20
    assert slice_bytes(4000) == 4000
    assert slice_bytes(100 << 20, element_bytes=2) == 1 << 19
