"""Where the outer strategies keep their state when the model trains on a device.

The model's parameters may live on a GPU; everything the swarm must agree on
(global parameters, outer momentum, the pseudo-gradients on the wire and the
fingerprints over them) lives in host memory in float32, so that a CPU peer and
a GPU peer that committed the same state hold the same bytes. The host buffers
of a CUDA model are pinned, so the two copies a round makes between host and
device (the local parameters down, the new globals up) run at full PCIe speed
and without a staging copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "OFF_LOOP_ELEMENTS",
    "check_params",
    "copy_into",
    "delta_into",
    "host_clone",
    "host_flat_zeros",
    "host_zeros",
    "numel",
    "off_loop",
    "shift_into",
]


def check_params(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The model's parameters: floating point, all on one device (any device)."""
    params = list(params)
    if not params:
        raise ValueError("no parameters to optimize")
    device = params[0].device if isinstance(params[0], torch.Tensor) else None
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise TypeError(f"parameter {i} must be a floating-point tensor")
        if p.device != device:
            raise TypeError(f"parameter {i} is on {p.device}, parameter 0 on {device}")
    return params


def _pinned(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if like.device.type == "cuda" else t


def host_clone(p: torch.Tensor) -> torch.Tensor:
    """A float32 host copy of `p` (pinned when `p` is on a CUDA device)."""
    out = _pinned(torch.empty(p.shape, dtype=torch.float32), p)
    out.copy_(p.detach())
    return out


def host_zeros(p: torch.Tensor) -> torch.Tensor:
    """Float32 host zeros shaped like `p` (pinned when `p` is on a CUDA device)."""
    return _pinned(torch.zeros(p.shape, dtype=torch.float32), p)


def host_flat_zeros(params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One float32 host buffer for all of `params` (pinned for a CUDA model) and a view
    of it shaped like each: the all-reduce sends and writes the buffer in place (no
    flattening copy on the way out, no copy back on the way in), the strategy's math
    works on the views."""
    flat = _pinned(torch.zeros(sum(p.numel() for p in params), dtype=torch.float32), params[0])
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return flat, views


def delta_into(
    out: Sequence[torch.Tensor], base: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> None:
    """out = base - params, on the host; `params` may be on a device.

    A device's parameters are copied into `out` first (one device-to-host copy
    of P bytes, no temporary), then subtracted in place.
    """
    with torch.no_grad():
        for o, b, p in zip(out, base, params, strict=True):
            if p.device.type == "cpu":
                torch.sub(b, p, out=o)
            else:
                o.copy_(p, non_blocking=True)
        if any(p.device.type != "cpu" for p in params):
            _synchronize(params)
            for o, b in zip(out, base, strict=True):
                torch.sub(b, o, out=o)


def shift_into(
    params: Sequence[torch.Tensor], to: Sequence[torch.Tensor], since: Sequence[torch.Tensor]
) -> None:
    """params += to - since: the steps taken from `since` moved onto `to` (host float32
    tensors; `params` may be on a device, in its own dtype). The difference is taken
    on the host in float32 first, so a low-precision model adds one rounding, not two."""
    with torch.no_grad():
        for p, t, s in zip(params, to, since, strict=True):
            p.add_(torch.sub(t, s).to(p.device, p.dtype))
    _synchronize(params)


def copy_into(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """dst[i] = src[i], across devices; returns once every copy has landed."""
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=d.device.type != s.device.type)
    _synchronize([*dst, *src])


def _synchronize(tensors: Sequence[torch.Tensor]) -> None:
    """Wait for the copies queued on the devices of `tensors` (none on the CPU)."""
    devices = {t.device for t in tensors if t.device.type != "cpu"}
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()


# Above this many elements, whole-state math (pseudo-gradients, outer steps, copies)
# runs in a thread: on a 50M-parameter model one such pass holds the event loop for
# tens of milliseconds, which every heartbeat and request of the peer would wait for.
OFF_LOOP_ELEMENTS = 1 << 20


async def off_loop(work: Callable[[], None], elements: int) -> None:
    """Run `work` (whole-state tensor math) in a thread when it covers more than
    OFF_LOOP_ELEMENTS elements, else inline. A thread cannot be interrupted: if the
    caller is cancelled meanwhile, `work` still finishes before the cancellation goes
    on, so no tensor is left half-written."""

    def run() -> None:
        with torch.no_grad():  # (grad mode is per thread)
            work()

    if elements <= OFF_LOOP_ELEMENTS:
        run()
        return
    job = asyncio.ensure_future(asyncio.to_thread(run))
    try:
        await asyncio.shield(job)
    except asyncio.CancelledError:
        await job
        raise


def numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)
