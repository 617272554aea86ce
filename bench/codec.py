"""Codec benchmark: the int8 codec's compiled loops against the same codec in torch passes.

    python bench/codec.py [--elements 1M] [--repeats 40]

Prints one JSON object on stdout:

    {"elements": 1048576,
     "ns_per_element": {"encode": {"compiled": ..., "torch": ..., "speedup": ...},
                        "decode": {...}, "add_decoded": {...}},
     "check_ns_per_element": ...}

The baseline is the codec as it was before the loops were compiled (whole-buffer
torch passes over cache-sized pieces: block maxima, division, rounding, narrowing
cast; widening, multiply, add), kept here and checked to produce the same bytes
and values. The default size is one all-reduce chunk (4 MiB of float32). Times are
medians over `--repeats` calls on one thread; the two take turns call by call, so
a noisy machine slows both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shoal.averaging.compression import Int8BlockCodec
from shoal.averaging.int8_format import FLT_MIN as _FLT_MIN
from shoal.averaging.int8_format import MAX_SCALE as _MAX_SCALE

_PIECE = 1 << 18  # elements per torch pass: a cache-sized temporary


class TorchInt8:
    """The int8 block codec in torch passes (the baseline)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size

    def encode(self, x: torch.Tensor, dst: np.ndarray) -> None:
        n, bs = x.numel(), self.bs
        assert n % bs == 0
        nb = n // bs
        scales = dst[: 4 * nb].view(np.float32)
        q = torch.from_numpy(dst[4 * nb :].view(np.int8))
        rows = x.view(nb, bs)
        absmax = torch.maximum(torch.amax(rows, dim=1), torch.amin(rows, dim=1).neg_())
        s = np.minimum(absmax.numpy() / np.float32(127), _MAX_SCALE)
        normal = s >= _FLT_MIN
        scales[:] = np.where(normal, s, np.float32(0))
        divisor = torch.from_numpy(np.where(normal, s, np.float32(1)).reshape(-1, 1))
        step = _PIECE // bs
        tmp = torch.empty(step, bs)
        for a in range(0, nb, step):
            b = min(a + step, nb)
            t = tmp[: b - a]
            torch.div(rows[a:b], divisor[a:b], out=t)
            t.round_()
            q[a * bs : b * bs].view(-1, bs).copy_(t)

    def _split(self, data: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb = n // self.bs
        scales = torch.from_numpy(data[: 4 * nb].view(np.float32))
        return scales, torch.from_numpy(data[4 * nb :].view(np.int8))

    def decode(self, data: np.ndarray, out: torch.Tensor) -> None:
        scales, q = self._split(data, out.numel())
        bs, step = self.bs, _PIECE // self.bs
        for a in range(0, len(scales), step):
            b = min(a + step, len(scales))
            y = out[a * bs : b * bs].view(-1, bs)
            y.copy_(q[a * bs : b * bs].view(-1, bs))
            y.mul_(scales[a:b, None])

    def add_decoded(self, data: np.ndarray, out: torch.Tensor, weight: float) -> None:
        scales, q = self._split(data, out.numel())
        bs, step = self.bs, _PIECE // self.bs
        tmp = torch.empty(step, bs)
        for a in range(0, len(scales), step):
            b = min(a + step, len(scales))
            widened = tmp[: b - a]
            widened.copy_(q[a * bs : b * bs].view(-1, bs))
            out[a * bs : b * bs].view(-1, bs).addcmul_(widened, scales[a:b, None], value=weight)


def _median_ns(calls: dict[str, Callable[[], None]], repeats: int, n: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) / n * 1e9 for name, ts in times.items()}


def run(n: int, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # as in a peer's reduction thread, and the loops are serial
    codec = Int8BlockCodec()
    baseline = TorchInt8(codec.block_size)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) * 10
    size = codec.encoded_size(n)
    fast, slow = np.empty(size, np.uint8), np.empty(size, np.uint8)
    codec.prepare()
    codec.encode(x, memoryview(fast))
    baseline.encode(x, slow)
    assert bytes(fast) == bytes(slow), "the baseline must produce the same bytes"
    out_fast, out_slow = torch.empty(n), torch.empty(n)
    codec.decode(memoryview(fast), out_fast)
    baseline.decode(slow, out_slow)
    assert torch.equal(out_fast, out_slow), "the baseline must decode to the same values"

    fast_mv = memoryview(fast)
    results: dict[str, Any] = {}
    for op, calls in {
        "encode": {
            "compiled": lambda: codec.encode(x, fast_mv),
            "torch": lambda: baseline.encode(x, slow),
        },
        "decode": {
            "compiled": lambda: codec.decode_checked(fast_mv, out_fast),
            "torch": lambda: baseline.decode(slow, out_slow),
        },
        "add_decoded": {
            "compiled": lambda: codec.add_decoded(fast_mv, out_fast, 0.25),
            "torch": lambda: baseline.add_decoded(slow, out_slow, 0.25),
        },
    }.items():
        ns = _median_ns(calls, repeats, n)
        results[op] = {**{k: round(v, 4) for k, v in ns.items()}}
        results[op]["speedup"] = round(ns["torch"] / ns["compiled"], 2)
    check = _median_ns({"check": lambda: codec.check(fast_mv, n)}, repeats, n)["check"]
    return {"elements": n, "ns_per_element": results, "check_ns_per_element": round(check, 4)}


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=_parse_size, default=1 << 20, help="a multiple of 256")
    ap.add_argument("--repeats", type=int, default=40)
    opts = ap.parse_args(argv)
    print(json.dumps(run(opts.elements, opts.repeats)))


if __name__ == "__main__":
    main()
